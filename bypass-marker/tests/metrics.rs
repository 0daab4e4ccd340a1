//! The proxy's Prometheus metrics (`--metrics-listen`), with real requests through the proxy to
//! real upstreams on 127.0.0.1: exact counts, names and labels, read from `GET /metrics` and
//! parsed strictly as OpenMetrics text (see [`parse`]).

mod support;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::response::IntoResponse;
use bypass_marker::{self as cli, metrics, Metrics};
use bytes::Bytes;
use http::{header, StatusCode};
use http_body_util::{BodyExt as _, Full};
use support::{
    client, post_json, proxy_args, raw_exchange, send, serve_upstream, stopped, PATIENCE,
};
use test_support::body::Chunks;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// A proxy (or processor) and its metrics endpoint, both on 127.0.0.1; stopped when dropped.
struct Served {
    proxy: SocketAddr,
    metrics: SocketAddr,
    _stop: oneshot::Sender<()>,
}

impl Served {
    /// Spawns `serve`, the server on `addr`, given `registry` and the receiver whose sender the
    /// `Served` holds (it stops when that is dropped), and a metrics endpoint for `registry` that
    /// stops once `serve` has returned.
    fn spawn<S, Fut>(addr: SocketAddr, registry: Arc<Metrics>, serve: S) -> Self
    where
        S: FnOnce(Arc<Metrics>, oneshot::Receiver<()>) -> Fut,
        Fut: Future + Send + 'static,
    {
        let metrics_listener = cli::bind("127.0.0.1:0".parse().unwrap(), 128).unwrap();
        let metrics = metrics_listener.local_addr().unwrap();
        let (stop, rx) = oneshot::channel();
        let (stop_metrics, rx_metrics) = oneshot::channel::<()>();
        tokio::spawn(metrics::serve_metrics(
            metrics_listener,
            registry.clone(),
            stopped(rx_metrics),
        ));
        let serving = serve(registry, rx);
        tokio::spawn(async move {
            let _ = serving.await;
            drop(stop_metrics);
        });
        Served {
            proxy: addr,
            metrics,
            _stop: stop,
        }
    }
}

/// The proxy with `args` in front of `upstream`, and its metrics endpoint.
async fn start(upstream: &str, args: &[&str]) -> Served {
    let config = proxy_args(upstream, args);
    let registry: Arc<Metrics> = cli::proxy::metrics_for(&config).unwrap();
    let listener = cli::bind(config.listen, 128).unwrap();
    let proxy = listener.local_addr().unwrap();
    Served::spawn(proxy, registry, |registry, stop| {
        cli::serve_metered(listener, config, registry, stopped(stop))
    })
}

/// A POST of `body` to the proxy's `/v1/chat/completions`: the status and the body.
async fn post(addr: SocketAddr, body: serde_json::Value) -> (StatusCode, Bytes) {
    let reply = post_json(format!("http://{addr}/v1/chat/completions"), &body).await;
    (reply.status, reply.body)
}

/// One sample: (name, labels as `k="v"` sorted, joined by `,`).
type Key = (String, String);

/// Parses OpenMetrics text strictly: `# HELP`, `# TYPE` (and `# UNIT`) lines name a family before
/// its samples; every sample's name is its family's plus a suffix its type allows; names and
/// label names are valid, label values quoted; values are numbers; no sample twice; histogram
/// buckets cumulative with `+Inf` equal to `_count`; the text ends with `# EOF`. Panics with the
/// offending line otherwise. Every sample must carry the `front_door` label, the same in the
/// whole text (the proxy's `sidecar`, the processor's `ext-proc`: [`front_door`]); the keys leave
/// it out.
fn parse(text: &str) -> BTreeMap<Key, f64> {
    parse_with_door(text).1
}

/// The `front_door` every sample of `text` carries (see [`parse`]).
fn front_door(text: &str) -> String {
    parse_with_door(text).0
}

fn parse_with_door(text: &str) -> (String, BTreeMap<Key, f64>) {
    fn valid_name(name: &str, colon: bool) -> bool {
        let mut chars = name.chars();
        chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || (colon && c == ':'))
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || (colon && c == ':'))
    }
    assert!(text.ends_with("# EOF\n"), "no # EOF at the end:\n{text}");
    let mut types: BTreeMap<String, String> = BTreeMap::new();
    let mut helped: Vec<String> = Vec::new();
    let mut family: Option<String> = None;
    let mut samples = BTreeMap::new();
    let mut door: Option<String> = None;
    let lines: Vec<&str> = text.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        if *line == "# EOF" {
            assert_eq!(i, lines.len() - 1, "# EOF before the end");
            continue;
        }
        if let Some(rest) = line.strip_prefix("# ") {
            let mut parts = rest.splitn(3, ' ');
            let (kind, name) = (parts.next().unwrap(), parts.next().expect(line));
            assert!(valid_name(name, true), "{line}");
            match kind {
                "HELP" => {
                    assert!(!helped.contains(&name.to_owned()), "HELP twice: {line}");
                    helped.push(name.to_owned());
                    family = Some(name.to_owned());
                }
                "TYPE" => {
                    let ty = parts.next().expect(line);
                    assert!(
                        ["counter", "gauge", "histogram"].contains(&ty),
                        "unexpected type: {line}"
                    );
                    assert!(
                        types.insert(name.to_owned(), ty.to_owned()).is_none(),
                        "{line}"
                    );
                    family = Some(name.to_owned());
                }
                "UNIT" => {}
                _ => panic!("unknown comment: {line}"),
            }
            continue;
        }
        assert!(!line.is_empty(), "empty line {i}");
        let (series, value) = line.rsplit_once(' ').expect(line);
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            v => v.parse().unwrap_or_else(|_| panic!("value of {line}")),
        };
        let (name, labels) = match series.split_once('{') {
            None => (series, ""),
            Some((name, labels)) => (name, labels.strip_suffix('}').expect(line)),
        };
        assert!(valid_name(name, true), "{line}");
        let fam = family.as_deref().expect("a sample before any # TYPE");
        let suffix = name
            .strip_prefix(fam)
            .unwrap_or_else(|| panic!("{line} outside {fam}"));
        let allowed: &[&str] = match types[fam].as_str() {
            "counter" => &["_total", "_created"],
            "gauge" => &[""],
            "histogram" => &["_bucket", "_sum", "_count", "_created"],
            _ => unreachable!(),
        };
        assert!(
            allowed.contains(&suffix),
            "{line}: suffix {suffix:?} for a {}",
            types[fam]
        );
        let mut pairs: Vec<String> = Vec::new();
        let mut rest = labels;
        while !rest.is_empty() {
            let (label, after) = rest.split_once("=\"").expect(line);
            assert!(valid_name(label, false), "label {label:?} in {line}");
            // The value runs to the next unescaped quote.
            let mut end = None;
            let mut escaped = false;
            for (j, c) in after.char_indices() {
                match (escaped, c) {
                    (true, _) => escaped = false,
                    (false, '\\') => escaped = true,
                    (false, '"') => {
                        end = Some(j);
                        break;
                    }
                    _ => {}
                }
            }
            let end = end.expect(line);
            pairs.push(format!("{label}=\"{}\"", &after[..end]));
            rest = &after[end + 1..];
            rest = rest.strip_prefix(',').unwrap_or(rest);
        }
        pairs.sort();
        let doors: Vec<String> = pairs
            .iter()
            .filter_map(|p| p.strip_prefix("front_door=\""))
            .map(|v| v.trim_end_matches('"').to_owned())
            .collect();
        assert_eq!(doors.len(), 1, "no front_door label, or two: {line}");
        match &door {
            None => door = Some(doors[0].clone()),
            Some(d) => assert_eq!(d, &doors[0], "two front doors in one text: {line}"),
        }
        pairs.retain(|p| !p.starts_with("front_door=\""));
        let key = (name.to_owned(), pairs.join(","));
        assert!(samples.insert(key, value).is_none(), "sample twice: {line}");
    }
    // Histograms: per series (the labels but `le`), cumulative buckets, +Inf = count.
    for (fam, ty) in &types {
        if ty != "histogram" {
            continue;
        }
        let mut series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
        for ((name, labels), v) in &samples {
            if *name != format!("{fam}_bucket") {
                continue;
            }
            let (mut le, mut rest) = (None, Vec::new());
            for pair in labels.split(',') {
                match pair.strip_prefix("le=\"") {
                    Some(value) => le = Some(value.trim_end_matches('"')),
                    None => rest.push(pair),
                }
            }
            let le = match le.expect("a bucket without le") {
                "+Inf" => f64::INFINITY,
                le => le.parse().unwrap(),
            };
            series.entry(rest.join(",")).or_default().push((le, *v));
        }
        for (labels, mut sorted) in series {
            sorted.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
            assert!(
                sorted.windows(2).all(|w| w[0].1 <= w[1].1),
                "{fam}{{{labels}}}: {sorted:?}"
            );
            let count = samples[&(format!("{fam}_count"), labels.clone())];
            assert_eq!(
                sorted.last().unwrap(),
                &(f64::INFINITY, count),
                "{fam}{{{labels}}}"
            );
        }
    }
    (door.unwrap_or_default(), samples)
}

/// Scrapes `GET /metrics` and parses it.
async fn scrape(served: &Served) -> BTreeMap<Key, f64> {
    let reply = support::get(format!("http://{}/metrics", served.metrics)).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.headers[header::CONTENT_TYPE], metrics::CONTENT_TYPE);
    parse(std::str::from_utf8(&reply.body).unwrap())
}

fn get(samples: &BTreeMap<Key, f64>, name: &str, labels: &str) -> f64 {
    *samples
        .get(&(name.to_owned(), labels.to_owned()))
        .unwrap_or_else(|| panic!("no {name}{{{labels}}} in {samples:#?}"))
}

/// A Dynamo-like stream: the router's marker, a `request_id` annotation, data.
async fn dynamo_stream() -> impl IntoResponse {
    let frames = [
        "event: x-bypass-remote-prefill\n: true\n\n",
        "event: request_id\n: \"r-1\"\n\n",
        "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n",
        "data: [DONE]\n\n",
    ];
    (
        [(header::CONTENT_TYPE, "text/event-stream")],
        Body::new(Chunks::new(frames.map(Bytes::from))),
    )
}

fn request(annotations: &[&str]) -> serde_json::Value {
    serde_json::json!({
        "model": "m", "stream": true, "messages": [],
        "nvext": { "annotations": annotations },
    })
}

const REMOVED: &str = "bypass_marker_frames_removed_total";
const FORWARDED: &str = "bypass_marker_frames_forwarded_total";
const REFUSED: &str = "bypass_marker_requests_refused_total";
const ERRORS: &str = "bypass_marker_upstream_errors_total";

#[tokio::test]
async fn frames_removed_and_forwarded_are_counted_exactly_per_name() {
    let upstream = serve_upstream(axum::Router::new().fallback(dynamo_stream)).await;
    let served = start(&format!("http://{upstream}"), &[]).await;

    // Before any request: a series at 0 for every name of the dynamo preset.
    let before = scrape(&served).await;
    let preset = tower_bypass_marker::BypassMarkerLayer::dynamo();
    assert_eq!(preset.names().count(), 7);
    for name in preset.names() {
        let label = format!("annotation=\"{name}\"");
        assert_eq!(get(&before, REMOVED, &label), 0.0);
        assert_eq!(get(&before, FORWARDED, &label), 0.0);
    }
    assert_eq!(get(&before, "bypass_marker_streams_active", ""), 0.0);

    // 7 streams with no opt-in, 3 that opt in to the marker, 2 to both annotations.
    let (plain, marker, both) = (7, 3, 2);
    for _ in 0..plain {
        let (status, body) = post(served.proxy, request(&[])).await;
        assert_eq!(status, StatusCode::OK);
        assert!(!body.windows(6).any(|w| w == b"event:"), "{body:?}");
    }
    for _ in 0..marker {
        post(served.proxy, request(&["x-bypass-remote-prefill"])).await;
    }
    for _ in 0..both {
        post(
            served.proxy,
            request(&["x-bypass-remote-prefill", "request_id"]),
        )
        .await;
    }
    let after = scrape(&served).await;
    let marker_label = "annotation=\"x-bypass-remote-prefill\"";
    let id_label = "annotation=\"request_id\"";
    assert_eq!(get(&after, REMOVED, marker_label), plain as f64);
    assert_eq!(get(&after, FORWARDED, marker_label), (marker + both) as f64);
    assert_eq!(get(&after, REMOVED, id_label), (plain + marker) as f64);
    assert_eq!(get(&after, FORWARDED, id_label), both as f64);
    assert_eq!(get(&after, REMOVED, "annotation=\"llm_metrics\""), 0.0);
    // No `annotation=""` series outside SDK-safe mode.
    assert!(!after.contains_key(&(REMOVED.to_owned(), "annotation=\"\"".to_owned())));
    // Every request is in the histogram; none is in flight.
    let total = (plain + marker + both) as f64;
    assert_eq!(
        get(&after, "bypass_marker_request_duration_seconds_count", ""),
        total
    );
    assert_eq!(get(&after, "bypass_marker_streams_active", ""), 0.0);
    assert_eq!(get(&after, REFUSED, "status=\"400\""), 0.0);
}

#[tokio::test]
async fn sdk_safe_removals_of_no_name_have_the_empty_label() {
    async fn comments() -> impl IntoResponse {
        (
            [(header::CONTENT_TYPE, "text/event-stream")],
            "id: 1\n\ndata: x\n\nretry: 5\n\n",
        )
    }
    let upstream = serve_upstream(axum::Router::new().fallback(comments)).await;
    let served = start(
        &format!("http://{upstream}"),
        &["--sdk-safe", "--preset", "none"],
    )
    .await;
    assert_eq!(get(&scrape(&served).await, REMOVED, "annotation=\"\""), 0.0);
    let body = support::get(format!("http://{}/s", served.proxy))
        .await
        .body;
    assert_eq!(body, "data: x\n\n");
    let after = scrape(&served).await;
    assert_eq!(get(&after, REMOVED, "annotation=\"\""), 2.0);
    assert_eq!(
        get(&after, REMOVED, "annotation=\"x-bypass-remote-prefill\""),
        0.0
    );
}

/// Writes `request` on a new connection and returns the status code of the answer.
async fn raw_status(addr: SocketAddr, request: &[u8]) -> u16 {
    let out = raw_exchange(addr, request).await;
    std::str::from_utf8(&out[9..12]).unwrap().parse().unwrap()
}

#[tokio::test]
async fn refusals_are_counted_per_status_and_never_reach_the_upstream() {
    let reached = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = reached.clone();
    let app = axum::Router::new().fallback(move || {
        counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        dynamo_stream()
    });
    let upstream = serve_upstream(app).await;
    let served = start(
        &format!("http://{upstream}"),
        &["--max-body", "1000", "--body-timeout", "0.3"],
    )
    .await;
    let addr = served.proxy;
    // 400: not JSON, twice.
    for _ in 0..2 {
        let req = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
            Content-Type: application/json\r\nContent-Length: 5\r\n\r\n{nope";
        assert_eq!(raw_status(addr, req).await, 400);
    }
    // 413: larger than --max-body.
    let big = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: 2000\r\n\r\n{}",
        " ".repeat(2000)
    );
    assert_eq!(raw_status(addr, big.as_bytes()).await, 413);
    // 415: an encoded JSON body.
    let req = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
        Content-Type: application/json\r\nContent-Encoding: gzip\r\nContent-Length: 2\r\n\r\n{}";
    assert_eq!(raw_status(addr, req).await, 415);
    // 501: a transfer coding other than chunked.
    let req = b"POST /v1/x HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\n\
        Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n";
    assert_eq!(raw_status(addr, req).await, 501);
    // 408: a JSON body that stops arriving.
    let req = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
        Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":";
    assert_eq!(raw_status(addr, req).await, 408);
    // Forwarded, not refused: an upstream 404 is the upstream's answer.
    let (status, _) = post(addr, request(&[])).await;
    assert_eq!(status, StatusCode::OK);

    let after = scrape(&served).await;
    for (status, n) in [
        ("400", 2.0),
        ("408", 1.0),
        ("413", 1.0),
        ("415", 1.0),
        ("501", 1.0),
    ] {
        assert_eq!(
            get(&after, REFUSED, &format!("status=\"{status}\"")),
            n,
            "{status}"
        );
    }
    let refused: f64 = after
        .iter()
        .filter(|((name, _), _)| name == REFUSED)
        .map(|(_, v)| v)
        .sum();
    assert_eq!(refused, 6.0);
    // Only the one request that was not refused reached the upstream.
    assert_eq!(reached.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(
        get(&after, "bypass_marker_request_duration_seconds_count", ""),
        7.0
    );
}

#[tokio::test]
async fn upstream_errors_are_counted_per_kind() {
    // connect: nothing listens.
    let free = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let closed = free.local_addr().unwrap();
    drop(free);
    // timeout: accepts, never answers.
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = silent.accept().await {
            held.push(conn);
        }
    });
    // head: reads the request, closes. body: a head promising 100 bytes, 10, then closes.
    let rude = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let rude_addr = rude.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = rude.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0; 4096];
                let n = conn.read(&mut buf).await.unwrap_or(0);
                if buf[..n].starts_with(b"GET /body") {
                    let _ = conn
                        .write_all(
                            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\
                              content-length: 100\r\n\r\n0123456789",
                        )
                        .await;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            });
        }
    });
    let get_status = |addr: SocketAddr, path: &'static str| async move {
        let req = http::Request::get(format!("http://{addr}{path}"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let res = tokio::time::timeout(PATIENCE, client().request(req))
            .await
            .unwrap()
            .unwrap();
        let status = res.status();
        let _ = res.into_body().collect().await;
        status
    };

    let to_closed = start(&format!("http://{closed}"), &[]).await;
    assert_eq!(
        get_status(to_closed.proxy, "/").await,
        StatusCode::BAD_GATEWAY
    );
    assert_eq!(
        get_status(to_closed.proxy, "/").await,
        StatusCode::BAD_GATEWAY
    );
    let m = scrape(&to_closed).await;
    assert_eq!(get(&m, ERRORS, "kind=\"connect\""), 2.0);
    assert_eq!(get(&m, ERRORS, "kind=\"timeout\""), 0.0);

    let to_silent = start(
        &format!("http://{silent_addr}"),
        &["--response-timeout", "0.2"],
    )
    .await;
    assert_eq!(
        get_status(to_silent.proxy, "/").await,
        StatusCode::GATEWAY_TIMEOUT
    );
    let m = scrape(&to_silent).await;
    assert_eq!(get(&m, ERRORS, "kind=\"timeout\""), 1.0);
    assert_eq!(get(&m, ERRORS, "kind=\"connect\""), 0.0);

    let to_rude = start(&format!("http://{rude_addr}"), &[]).await;
    assert_eq!(
        get_status(to_rude.proxy, "/head").await,
        StatusCode::BAD_GATEWAY
    );
    assert_eq!(get_status(to_rude.proxy, "/body").await, StatusCode::OK);
    let m = scrape(&to_rude).await;
    assert_eq!(get(&m, ERRORS, "kind=\"head\""), 1.0);
    assert_eq!(get(&m, ERRORS, "kind=\"body\""), 1.0);
    assert_eq!(get(&m, REFUSED, "status=\"400\""), 0.0);
}

#[tokio::test]
async fn streams_in_flight_are_a_gauge_and_other_paths_are_404() {
    let (release, released) = oneshot::channel::<()>();
    let released = Arc::new(tokio::sync::Mutex::new(Some(released)));
    let app = axum::Router::new().fallback(move || {
        let released = released.clone();
        async move {
            let rx = released.lock().await.take();
            let stream = futures_util::stream::once(async move {
                if let Some(rx) = rx {
                    let _ = rx.await;
                }
                Ok::<_, Infallible>(Bytes::from_static(b"data: done\n\n"))
            });
            (
                [(header::CONTENT_TYPE, "text/event-stream")],
                Body::from_stream(stream),
            )
        }
    });
    let upstream = serve_upstream(app).await;
    let served = start(&format!("http://{upstream}"), &[]).await;
    let streaming = tokio::spawn(support::get(format!("http://{}/stream", served.proxy)));
    let mut active = 0.0;
    for _ in 0..100 {
        active = get(&scrape(&served).await, "bypass_marker_streams_active", "");
        if active == 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(active, 1.0);
    release.send(()).unwrap();
    let body = streaming.await.unwrap().body;
    assert_eq!(body, "data: done\n\n");
    let m = scrape(&served).await;
    assert_eq!(get(&m, "bypass_marker_streams_active", ""), 0.0);

    for path in ["/", "/metric", "/metrics/x"] {
        let status = support::get(format!("http://{}{path}", served.metrics))
            .await
            .status;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}");
    }
    let req = http::Request::post(format!("http://{}/metrics", served.metrics))
        .body(Full::new(Bytes::new()))
        .unwrap();
    assert_eq!(
        send(req).await.unwrap().status,
        StatusCode::METHOD_NOT_ALLOWED
    );
}

#[test]
fn the_parser_refuses_what_prometheus_would() {
    let good = "# HELP x_total A.\n# TYPE x counter\nx_total{front_door=\"d\",a=\"1\"} 2\n# EOF\n";
    // (The family of a counter is named without _total.)
    let good = good.replace("# HELP x_total", "# HELP x");
    assert_eq!(parse(&good).len(), 1);
    for bad in [
        good.replace("# EOF\n", ""),
        good.replace("x_total{", "x{"),
        good.replace("a=\"1\"", "a=1"),
        good.replace(" 2\n", " two\n"),
        good.replace(
            "x_total{front_door=\"d\",a=\"1\"} 2\n",
            "x_total{front_door=\"d\",a=\"1\"} 2\nx_total{front_door=\"d\",a=\"1\"} 3\n",
        ),
        good.replace(",a=", ",1a="),
        // Every sample names its front door, one per text.
        good.replace("front_door=\"d\",", ""),
        good.replace(
            "x_total{front_door=\"d\",a=\"1\"} 2\n",
            "x_total{front_door=\"d\",a=\"1\"} 2\nx_total{front_door=\"e\",a=\"2\"} 3\n",
        ),
    ] {
        assert!(
            std::panic::catch_unwind(|| parse(&bad)).is_err(),
            "accepted:\n{bad}"
        );
    }
    // The crate's own encoding of an empty registry parses.
    let empty = Metrics::new([], false).encode();
    let samples = parse(&empty);
    assert!(samples.contains_key(&("bypass_marker_streams_active".to_owned(), String::new())));
}

/// Issue 34, item 6: `bypass-marker ext-proc` times each answer it gives Envoy in the histogram
/// `bypass_marker_ext_proc_answer_seconds`, one series per kind of message (six at most, there
/// from the start at 0), with buckets at Envoy's default `message_timeout` (0.2 s) and the
/// shipped bootstrap's (2 s). The proxy serves no such series.
#[tokio::test]
async fn the_processors_answer_times_are_a_histogram_per_kind_of_message() {
    use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
    use envoy_types::pb::envoy::service::ext_proc::v3::{
        external_processor_client::ExternalProcessorClient, processing_request::Request as Msg,
        HttpBody, HttpHeaders, ProcessingRequest,
    };

    const ANSWERS: &str = "bypass_marker_ext_proc_answer_seconds";
    // The answers are timed for metrics that are served (`--metrics-listen`, which main binds).
    let args =
        cli::ExtProcArgs::from_args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
            .unwrap();
    let registry = cli::ext_proc::metrics_for(&args).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let processor = listener.local_addr().unwrap();
    let served = Served::spawn(processor, registry, |registry, stop| async move {
        cli::ext_proc::serve(listener, &args, registry, stopped(stop)).await
    });
    let count = |samples: &BTreeMap<Key, f64>, message: &str| {
        get(
            samples,
            &format!("{ANSWERS}_count"),
            &format!("message=\"{message}\""),
        )
    };
    let before = scrape(&served).await;
    for message in [
        "request_headers",
        "request_body",
        "request_trailers",
        "response_headers",
        "response_body",
        "response_trailers",
    ] {
        assert_eq!(count(&before, message), 0.0, "{message}");
        for le in ["0.2", "2.0"] {
            let labels = format!("le=\"{le}\",message=\"{message}\"");
            assert_eq!(get(&before, &format!("{ANSWERS}_bucket"), &labels), 0.0);
        }
    }

    let headers = |pairs: &[(&str, &str)]| HttpHeaders {
        headers: Some(HeaderMap {
            headers: pairs
                .iter()
                .map(|(k, v)| HeaderValue {
                    key: (*k).to_owned(),
                    raw_value: v.as_bytes().to_vec(),
                    ..HeaderValue::default()
                })
                .collect(),
        }),
        end_of_stream: false,
        ..HttpHeaders::default()
    };
    let mut client = ExternalProcessorClient::connect(format!("http://{processor}"))
        .await
        .unwrap();
    for _ in 0..3 {
        let messages = [
            Msg::RequestHeaders(HttpHeaders {
                end_of_stream: true,
                ..headers(&[(":method", "GET")])
            }),
            Msg::ResponseHeaders(headers(&[
                (":status", "200"),
                ("content-type", "text/event-stream"),
            ])),
            Msg::ResponseBody(HttpBody {
                body: b"event: x-bypass-remote-prefill\n: true\n\n".to_vec(),
                ..HttpBody::default()
            }),
            Msg::ResponseBody(HttpBody {
                body: b"data: 1\n\n".to_vec(),
                end_of_stream: true,
                ..HttpBody::default()
            }),
        ];
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let mut answers = tokio::time::timeout(
            PATIENCE,
            client.process(tokio_stream::wrappers::ReceiverStream::new(rx)),
        )
        .await
        .unwrap()
        .unwrap()
        .into_inner();
        for message in messages {
            tx.send(ProcessingRequest {
                request: Some(message),
                ..ProcessingRequest::default()
            })
            .await
            .unwrap();
            tokio::time::timeout(PATIENCE, answers.message())
                .await
                .unwrap()
                .unwrap()
                .expect("an answer");
        }
    }
    let after = scrape(&served).await;
    for (message, n) in [
        ("request_headers", 3.0),
        ("request_body", 0.0),
        ("response_headers", 3.0),
        ("response_body", 6.0),
    ] {
        assert_eq!(count(&after, message), n, "{message}");
        let within = format!("le=\"2.0\",message=\"{message}\"");
        assert_eq!(get(&after, &format!("{ANSWERS}_bucket"), &within), n);
    }
    assert!(
        get(
            &after,
            &format!("{ANSWERS}_sum"),
            "message=\"response_body\""
        ) > 0.0
    );

    // The proxy times requests, not answers: no such series there.
    let upstream = serve_upstream(axum::Router::new().fallback(dynamo_stream)).await;
    let proxy = start(&format!("http://{upstream}"), &[]).await;
    let samples = scrape(&proxy).await;
    assert!(!samples.keys().any(|(name, _)| name.starts_with(ANSWERS)));
}

/// Scrapes until `ready` holds for the samples (the request counters move when a response has
/// been flushed, a moment after the client has read it), within [`PATIENCE`].
async fn scrape_until(
    served: &Served,
    ready: impl Fn(&BTreeMap<Key, f64>) -> bool,
) -> BTreeMap<Key, f64> {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let m = scrape(served).await;
        if ready(&m) || tokio::time::Instant::now() > deadline {
            return m;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Issue 42: `requests_total` by status class (the upstream's answers and the proxy's own),
/// `time_to_first_byte_seconds` for each response with a body, `connections_open` as a gauge, and
/// `build_info` with the version and the revision, all from real requests.
#[tokio::test]
async fn requests_by_status_class_first_bytes_connections_and_build_info() {
    let app = axum::Router::new()
        .route("/ok", axum::routing::get(dynamo_stream))
        .route(
            "/moved",
            axum::routing::get(|| async { (StatusCode::FOUND, [(header::LOCATION, "/ok")]) }),
        )
        .route(
            "/missing",
            axum::routing::get(|| async { (StatusCode::NOT_FOUND, "no such thing") }),
        )
        .route(
            "/broken",
            axum::routing::get(|| async { (StatusCode::INTERNAL_SERVER_ERROR, "broken") }),
        );
    let upstream = serve_upstream(app).await;
    let served = start(&format!("http://{upstream}"), &[]).await;
    let m = scrape(&served).await;
    for class in ["1xx", "2xx", "3xx", "4xx", "5xx"] {
        let labels = format!("class=\"{class}\"");
        assert_eq!(get(&m, "bypass_marker_requests_total", &labels), 0.0);
    }
    let build = format!(
        "revision=\"{}\",version=\"{}\"",
        metrics::REVISION,
        env!("CARGO_PKG_VERSION")
    );
    assert_eq!(get(&m, "bypass_marker_build_info", &build), 1.0);
    assert_eq!(get(&m, "bypass_marker_connections_open", ""), 0.0);

    for (path, status) in [
        ("/ok", 200),
        ("/ok", 200),
        ("/moved", 302),
        ("/missing", 404),
        ("/broken", 500),
    ] {
        let reply = support::get(format!("http://{}{path}", served.proxy)).await;
        assert_eq!(reply.status.as_u16(), status, "{path}");
    }
    // The proxy's own answer, a 415 from the guard, counts in its class too.
    let req = http::Request::post(format!("http://{}/v1/chat/completions", served.proxy))
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONTENT_ENCODING, "gzip")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    assert_eq!(
        send(req).await.unwrap().status,
        StatusCode::UNSUPPORTED_MEDIA_TYPE
    );
    let m = scrape_until(&served, |m| {
        get(m, "bypass_marker_requests_total", "class=\"4xx\"") == 2.0
            && get(m, "bypass_marker_requests_total", "class=\"5xx\"") == 1.0
    })
    .await;
    for (class, n) in [
        ("1xx", 0.0),
        ("2xx", 2.0),
        ("3xx", 1.0),
        ("4xx", 2.0),
        ("5xx", 1.0),
    ] {
        let labels = format!("class=\"{class}\"");
        assert_eq!(
            get(&m, "bypass_marker_requests_total", &labels),
            n,
            "{class}"
        );
    }
    // Every response but the 302's has a body: five first bytes.
    assert_eq!(
        get(&m, "bypass_marker_time_to_first_byte_seconds_count", ""),
        5.0
    );
    assert_eq!(
        get(
            &m,
            "bypass_marker_time_to_first_byte_seconds_bucket",
            "le=\"+Inf\""
        ),
        5.0
    );

    // A client connection that sends nothing is open until it closes.
    let m = scrape_until(&served, |m| {
        get(m, "bypass_marker_connections_open", "") == 0.0
    })
    .await;
    assert_eq!(get(&m, "bypass_marker_connections_open", ""), 0.0);
    let conn = tokio::net::TcpStream::connect(served.proxy).await.unwrap();
    let m = scrape_until(&served, |m| {
        get(m, "bypass_marker_connections_open", "") == 1.0
    })
    .await;
    assert_eq!(get(&m, "bypass_marker_connections_open", ""), 1.0);
    drop(conn);
    let m = scrape_until(&served, |m| {
        get(m, "bypass_marker_connections_open", "") == 0.0
    })
    .await;
    assert_eq!(get(&m, "bypass_marker_connections_open", ""), 0.0);
}

/// Issue 42: the probes. `/livez` and `/readyz` on the proxy's own address are answered by the
/// proxy (never forwarded, logged or counted); on the metrics address, through a stop, `/readyz`
/// turns 503 while `/livez` and `/metrics` answer on through the drain; requests still in flight
/// when `--shutdown-grace` runs out are counted as cut.
#[tokio::test]
async fn probes_through_a_drain_and_streams_cut_when_the_grace_runs_out() {
    let hits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = hits.clone();
    // A stream that sends one frame and then never ends.
    let app = axum::Router::new().fallback(move || {
        counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        async {
            let first = futures_util::stream::once(async {
                Ok::<_, Infallible>(Bytes::from_static(b"data: first\n\n"))
            });
            let stream = futures_util::StreamExt::chain(first, futures_util::stream::pending());
            (
                [(header::CONTENT_TYPE, "text/event-stream")],
                Body::from_stream(stream),
            )
        }
    });
    let upstream = serve_upstream(app).await;
    let config = proxy_args(&format!("http://{upstream}"), &["--shutdown-grace", "1"]);
    let registry: Arc<Metrics> = cli::proxy::metrics_for(&config).unwrap();
    let listener = cli::bind(config.listen, 128).unwrap();
    let proxy = listener.local_addr().unwrap();
    let served = Served::spawn(proxy, registry.clone(), |registry, stop| {
        cli::serve_metered(listener, config, registry, stopped(stop))
    });
    let probe = |addr: SocketAddr, path: &'static str| async move {
        let reply = support::get(format!("http://{addr}{path}")).await;
        (reply.status, reply.body)
    };
    for addr in [served.proxy, served.metrics] {
        assert_eq!(
            probe(addr, "/livez").await,
            (StatusCode::OK, Bytes::from("ok\n"))
        );
        assert_eq!(
            probe(addr, "/readyz").await,
            (StatusCode::OK, Bytes::from("ready\n"))
        );
    }
    assert_eq!(
        hits.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "a probe was forwarded"
    );

    // Two streams in flight, each past its first frame.
    let mut streams = Vec::new();
    for _ in 0..2 {
        let res = client()
            .request(
                http::Request::get(format!("http://{}/stream", served.proxy))
                    .body(Full::default())
                    .unwrap(),
            )
            .await
            .unwrap();
        let mut body = res.into_body();
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first, "data: first\n\n");
        streams.push(body);
    }
    let m = scrape(&served).await;
    assert_eq!(get(&m, "bypass_marker_streams_active", ""), 2.0);
    assert_eq!(
        get(&m, "bypass_marker_requests_total", "class=\"2xx\""),
        0.0
    );

    let Served {
        metrics: metrics_addr,
        _stop: stop,
        ..
    } = served;
    drop(stop);
    let drained = tokio::time::Instant::now();
    // During the drain: not ready, alive, and still scraped.
    let mut ready = StatusCode::OK;
    while ready == StatusCode::OK && drained.elapsed() < Duration::from_millis(800) {
        ready = probe(metrics_addr, "/readyz").await.0;
    }
    assert_eq!(ready, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        drained.elapsed() < Duration::from_millis(900),
        "the drain was over"
    );
    assert_eq!(probe(metrics_addr, "/livez").await.0, StatusCode::OK);
    assert_eq!(probe(metrics_addr, "/metrics").await.0, StatusCode::OK);
    assert!(
        tokio::net::TcpStream::connect(proxy).await.is_err(),
        "still accepting"
    );

    // The grace runs out: both streams are cut, and counted.
    for mut body in streams {
        let end = tokio::time::timeout(PATIENCE, body.frame()).await.unwrap();
        assert!(
            !matches!(end, None | Some(Ok(_))),
            "a cut stream ended cleanly: {end:?}"
        );
    }
    assert_eq!(registry.shutdown_streams_cut(), 2);
    let m = parse(&registry.encode());
    assert_eq!(get(&m, "bypass_marker_shutdown_streams_cut_total", ""), 2.0);
}

/// Issue 42: the request id. A request's `x-request-id` goes upstream as it came; a request
/// without one (or with one that would garble the log line) gets a new one, sent upstream.
#[tokio::test]
async fn request_ids_are_passed_upstream_or_made() {
    let app = axum::Router::new().fallback(|headers: http::HeaderMap| async move {
        let ids: Vec<String> = headers
            .get_all("x-request-id")
            .iter()
            .map(|v| v.to_str().unwrap().to_owned())
            .collect();
        ids.join("|")
    });
    let upstream = serve_upstream(app).await;
    let served = start(&format!("http://{upstream}"), &[]).await;
    let with = |id: Option<&str>| {
        let mut req = http::Request::get(format!("http://{}/id", served.proxy));
        if let Some(id) = id {
            req = req.header("x-request-id", id);
        }
        send(req.body(Full::default()).unwrap())
    };
    let reply = with(Some("client-id-42")).await.unwrap();
    assert_eq!(reply.body, "client-id-42");
    let mut made = Vec::new();
    for id in [None, Some("has space"), Some("")] {
        let reply = with(id).await.unwrap();
        let body = String::from_utf8(reply.body.to_vec()).unwrap();
        assert_eq!(body.len(), 32, "{id:?}: {body}");
        assert!(body.bytes().all(|b| b.is_ascii_hexdigit()), "{body}");
        made.push(body);
    }
    made.sort();
    made.dedup();
    assert_eq!(made.len(), 3, "ids repeat: {made:?}");
}

/// Issue 49, item 5: one dashboard for every front door. The sidecar and the processor serve the
/// same names, so every series of each carries `front_door` (`sidecar`, `ext-proc`); and
/// `bypass_marker_encoded_streams_refused_total` has the `coding` label of the Envoy module's and
/// plugin's counter, with the same values (a known coding, else `other`), every one at 0 from the
/// start.
#[test]
fn each_front_door_labels_its_series_and_encoded_streams_are_counted_per_coding() {
    use tower_bypass_marker::FrameObserver;
    const ENCODED: &str = "bypass_marker_encoded_streams_refused_total";
    for (registry, door) in [
        (Metrics::new(["request_id"], true), "sidecar"),
        (Metrics::frames_only(["request_id"], true), "ext-proc"),
    ] {
        let text = registry.encode();
        assert_eq!(front_door(&text), door, "{text}");
        let before = parse(&text);
        for coding in metrics::CODINGS {
            assert_eq!(get(&before, ENCODED, &format!("coding=\"{coding}\"")), 0.0);
        }
        // What the layer reports (the codings as the response lists them, or its transfer
        // codings), and the label it is counted under.
        for (reported, label) in [
            ("gzip", "gzip"),
            ("GZip, br", "gzip"),
            ("identity, br", "br"),
            ("zstd", "zstd"),
            ("Deflate", "deflate"),
            ("compress", "compress"),
            ("x-foo", "other"),
            ("transfer-encoding gzip, chunked", "gzip"),
            ("transfer-encoding chunked, x-foo", "other"),
        ] {
            assert_eq!(metrics::coding_label(reported), label, "{reported}");
            registry.encoded_stream_refused(reported);
        }
        let after = parse(&registry.encode());
        for (coding, n) in [
            ("gzip", 3.0),
            ("br", 1.0),
            ("zstd", 1.0),
            ("deflate", 1.0),
            ("compress", 1.0),
            ("other", 2.0),
        ] {
            assert_eq!(
                get(&after, ENCODED, &format!("coding=\"{coding}\"")),
                n,
                "{coding}"
            );
        }
        let series = after.keys().filter(|(name, _)| name == ENCODED).count();
        assert_eq!(series, metrics::CODINGS.len());
    }
}
