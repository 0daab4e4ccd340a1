//! The sidecar (`bypass-marker proxy`, `bypass_marker`), served on 127.0.0.1 in front
//! of real upstream servers and called with real clients (hyper's, and raw TCP where the test
//! needs control of every byte).
//!
//! The tests run the library code the binary runs (its flag parsing, listener, accept loop,
//! timeouts and service), minus `main`'s signal handling; `tests/cli.rs` runs the binary itself.
//!
//! `BYPASS_MARKER_PROXY_STREAMS` sets the number of concurrent streams of the load test (200 by
//! default, 1,000 in CI):
//!
//! ```text
//! BYPASS_MARKER_PROXY_STREAMS=1000 cargo test --test proxy -- --nocapture
//! ```

use bypass_marker as proxy;

use test_support::logs;
use test_support::rng::{random_chunks, XorShift};
mod support;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::MethodRouter;
use bytes::Bytes;
use http::{header, StatusCode};
use http_body_util::{BodyExt, Full};
use support::{
    client, get, post_json, proxy_args, raise_open_files_limit, raw_exchange, raw_request, send,
    serve_upstream, split_head, stopped, BoxError, PATIENCE,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, Barrier};
use tokio_stream::wrappers::ReceiverStream;

const MARKER: &str = "event: x-bypass-remote-prefill\n: true\n\n";

/// A proxy served in the background; stopped (gracefully) when `stop` is sent or dropped.
struct Proxy {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

/// Starts the proxy with `args` (`--listen 127.0.0.1:0` is added) in front of `upstream`.
async fn start_proxy(upstream: &str, args: &[&str]) -> Proxy {
    Proxy::spawn(proxy_args(upstream, args), |listener, config, stop| {
        proxy::serve(listener, config, stopped(stop))
    })
}

impl Proxy {
    /// Binds `config.listen` and spawns `serve` on it, given the receiver of `stop` (whose
    /// [`stopped`] is the shutdown future).
    fn spawn<S, Fut>(config: proxy::ProxyArgs, serve: S) -> Self
    where
        S: FnOnce(TcpListener, proxy::ProxyArgs, oneshot::Receiver<()>) -> Fut,
        Fut: Future<Output = std::io::Result<()>> + Send + 'static,
    {
        let listener = proxy::bind(config.listen, config.backlog).unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(serve(listener, config, rx));
        Proxy {
            addr,
            stop: Some(stop),
            task,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        drop(self.stop.take());
    }
}

/// The header names of a raw response head, lowercase.
fn header_names(head: &str) -> Vec<String> {
    head.lines()
        .skip(1)
        .filter_map(|l| l.split_once(':'))
        .map(|(name, _)| name.trim().to_ascii_lowercase())
        .collect()
}

fn error_json(body: &[u8]) -> serde_json::Value {
    let json: serde_json::Value = serde_json::from_slice(body).expect("a JSON error body");
    let error = &json["error"];
    assert!(error["message"].is_string(), "{json}");
    assert!(error["type"].is_string(), "{json}");
    assert!(error["code"].is_string(), "{json}");
    json
}

/// An upstream handler that answers with what it received: method, path and query, headers
/// (as sent, lowercase names) and body.
async fn echo(req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let headers: Vec<(String, String)> = parts
        .headers
        .iter()
        .map(|(n, v)| (n.as_str().to_owned(), v.to_str().unwrap_or("").to_owned()))
        .collect();
    let json = serde_json::json!({
        "method": parts.method.as_str(),
        "uri": parts.uri.to_string(),
        "headers": headers,
        "body": String::from_utf8_lossy(&body),
    });
    (
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::CONNECTION, "x-upstream-hop"),
        ],
        [
            ("x-upstream-hop", "1"),
            ("keep-alive", "timeout=5"),
            ("x-end-to-end", "kept"),
        ],
        json.to_string(),
    )
        .into_response()
}

fn echo_header<'a>(echo: &'a serde_json::Value, name: &str) -> Vec<&'a str> {
    echo["headers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|h| h[0] == name)
        .map(|h| h[1].as_str().unwrap())
        .collect()
}

#[tokio::test]
async fn forwards_every_method_and_path_with_query_and_body() {
    let upstream = serve_upstream(axum::Router::new().fallback(echo)).await;
    let proxy = start_proxy(&format!("http://{upstream}"), &[]).await;
    for (method, path, body) in [
        ("GET", "/v1/models", ""),
        ("GET", "/health", ""),
        ("GET", "/metrics?name=a&x=%20y", ""),
        ("POST", "/v1/responses", "{\"input\":\"hi\"}"),
        ("PUT", "/some/other/path", "plain text"),
        ("DELETE", "/v1/files/file-1", ""),
        ("PATCH", "/v1/x", "{}"),
        ("OPTIONS", "/v1/chat/completions", ""),
    ] {
        let req = http::Request::builder()
            .method(method)
            .uri(proxy.url(path))
            .header(header::CONTENT_TYPE, "text/plain")
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        let reply = send(req).await.unwrap();
        assert_eq!(reply.status, StatusCode::OK, "{method} {path}");
        let seen: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
        assert_eq!(seen["method"], method);
        assert_eq!(seen["uri"], path);
        assert_eq!(seen["body"], body);
    }
    // HEAD: the upstream's head, no body.
    let req = http::Request::head(proxy.url("/v1/models"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let reply = send(req).await.unwrap();
    assert_eq!(reply.status, StatusCode::OK);
    assert!(reply.body.is_empty());
}

#[tokio::test]
async fn an_upstream_path_prefix_comes_before_the_request_path() {
    let upstream = serve_upstream(axum::Router::new().fallback(echo)).await;
    let proxy = start_proxy(&format!("http://{upstream}/base/"), &[]).await;
    let seen: serde_json::Value =
        serde_json::from_slice(&get(proxy.url("/v1/models?a=1")).await.body).unwrap();
    assert_eq!(seen["uri"], "/base/v1/models?a=1");
}

#[tokio::test]
async fn hop_by_hop_headers_are_removed_both_ways_and_host_is_the_upstreams() {
    let upstream = serve_upstream(axum::Router::new().fallback(echo)).await;
    let proxy = start_proxy(&format!("http://{upstream}"), &[]).await;
    let request = "GET /v1/models HTTP/1.1\r\n\
        Host: proxy.example\r\n\
        Connection: close, X-Client-Hop\r\n\
        X-Client-Hop: secret\r\n\
        Keep-Alive: timeout=300\r\n\
        Proxy-Connection: keep-alive\r\n\
        TE: trailers\r\n\
        Trailer: x-checksum\r\n\
        X-End-To-End: kept\r\n\
        \r\n";
    let response = raw_exchange(proxy.addr, request.as_bytes()).await;
    let (head, body) = split_head(&response);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let seen: serde_json::Value = serde_json::from_slice(body).unwrap();
    assert_eq!(echo_header(&seen, "host"), [upstream.to_string().as_str()]);
    assert_eq!(echo_header(&seen, "x-end-to-end"), ["kept"]);
    for hop in [
        "x-client-hop",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
    ] {
        assert!(
            echo_header(&seen, hop).is_empty(),
            "{hop} reached the upstream: {seen}"
        );
    }
    // The upstream's own `Connection` header named `x-upstream-hop`; neither reaches the client
    // (the proxy's `Connection: close` answers the client's).
    let names = header_names(&head);
    assert!(names.contains(&"x-end-to-end".to_owned()), "{head}");
    assert!(!names.contains(&"x-upstream-hop".to_owned()), "{head}");
    assert!(!names.contains(&"keep-alive".to_owned()), "{head}");
    assert!(
        !head.to_ascii_lowercase().contains("x-upstream-hop"),
        "{head}"
    );
}

#[tokio::test]
async fn an_unreachable_upstream_is_a_502_in_openai_shape() {
    // A port that was just free: nothing listens there.
    let free = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = free.local_addr().unwrap();
    drop(free);
    let proxy = start_proxy(&format!("http://{addr}"), &[]).await;
    let reply = post_json(
        proxy.url("/v1/chat/completions"),
        &serde_json::json!({"model": "m", "messages": []}),
    )
    .await;
    assert_eq!(reply.status, StatusCode::BAD_GATEWAY);
    assert_eq!(reply.headers[header::CONTENT_TYPE], "application/json");
    let json = error_json(&reply.body);
    assert_eq!(json["error"]["code"], "upstream_unreachable", "{json}");
    discloses_nothing(&json, addr);
}

/// A proxy's own error tells the client what kind of failure it was, and nothing of the
/// upstream: not its address (nor port), not the OS error. That goes to the log.
fn discloses_nothing(json: &serde_json::Value, upstream: SocketAddr) {
    let message = json["error"]["message"]
        .as_str()
        .unwrap()
        .to_ascii_lowercase();
    for secret in [
        upstream.ip().to_string(),
        upstream.port().to_string(),
        "os error".to_owned(),
        "refused".to_owned(),
        "http://".to_owned(),
        "closed".to_owned(),
    ] {
        assert!(!message.contains(&secret), "{secret:?} in {json}");
    }
}

#[tokio::test]
async fn an_upstream_that_fails_before_its_head_is_a_502() {
    // Reads the request, then closes the connection without answering.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut buf = [0; 1024];
            let _ = conn.read(&mut buf).await;
            drop(conn);
        }
    });
    let proxy = start_proxy(&format!("http://{addr}"), &[]).await;
    let reply = get(proxy.url("/v1/models")).await;
    assert_eq!(reply.status, StatusCode::BAD_GATEWAY);
    let json = error_json(&reply.body);
    assert_eq!(json["error"]["code"], "upstream_failed", "{json}");
    discloses_nothing(&json, addr);
}

#[tokio::test]
async fn a_late_response_head_is_a_504_after_the_response_timeout() {
    // Accepts and never answers.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let held = Arc::new(Mutex::new(Vec::new()));
    let held2 = held.clone();
    tokio::spawn(async move {
        loop {
            let (conn, _) = listener.accept().await.unwrap();
            held2.lock().unwrap().push(conn);
        }
    });
    let proxy = start_proxy(&format!("http://{addr}"), &["--response-timeout", "0.5"]).await;
    let started = Instant::now();
    let reply = get(proxy.url("/v1/models")).await;
    assert_eq!(reply.status, StatusCode::GATEWAY_TIMEOUT);
    assert!(started.elapsed() >= Duration::from_millis(500));
    let json = error_json(&reply.body);
    assert_eq!(json["error"]["code"], "upstream_timeout", "{json}");
    discloses_nothing(&json, addr);
    assert!(!json["error"]["message"].as_str().unwrap().contains("500ms"));
}

/// Sends a signal when dropped: tells the test that the upstream stopped serving a request.
struct DropSignal(Option<oneshot::Sender<()>>);

impl Drop for DropSignal {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

#[derive(Clone, Default)]
struct Observed {
    dropped: Arc<Mutex<Vec<oneshot::Sender<()>>>>,
}

impl Observed {
    /// A signal for the next request the upstream serves, and the future that completes when that
    /// request's work is dropped.
    fn expect(&self) -> oneshot::Receiver<()> {
        let (tx, rx) = oneshot::channel();
        self.dropped.lock().unwrap().push(tx);
        rx
    }

    fn take(&self) -> DropSignal {
        DropSignal(self.dropped.lock().unwrap().pop())
    }

    /// Serves `route` at `path` on a new upstream that observes its requests' work: the upstream's
    /// address and the observer.
    async fn upstream(path: &str, route: MethodRouter<Observed>) -> (SocketAddr, Self) {
        let observed = Self::default();
        let app = axum::Router::new()
            .route(path, route)
            .with_state(observed.clone());
        (serve_upstream(app).await, observed)
    }
}

/// Waits until the request's work that `dropped` (from [`Observed::expect`]) signals has been
/// dropped; `what` says what the test waits for, when it does not come in time.
async fn until_dropped(dropped: oneshot::Receiver<()>, what: &str) {
    tokio::time::timeout(PATIENCE, dropped)
        .await
        .expect(what)
        .unwrap();
}

/// An event every 20 ms, forever; the stream holds a [`DropSignal`].
async fn forever(State(observed): State<Observed>) -> Response {
    let signal = observed.take();
    let stream = futures_util::stream::unfold((0u64, signal), |(i, signal)| async move {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let frame = Bytes::from(format!("data: {i}\n\n"));
        Some((Ok::<_, Infallible>(frame), (i + 1, signal)))
    });
    (
        [(header::CONTENT_TYPE, "text/event-stream")],
        Body::from_stream(stream),
    )
        .into_response()
}

/// Never answers; the handler's future holds a [`DropSignal`].
async fn never(State(observed): State<Observed>) -> Response {
    let _signal = observed.take();
    std::future::pending::<()>().await;
    unreachable!()
}

#[tokio::test]
async fn a_client_that_goes_away_mid_stream_cancels_the_upstream_request() {
    let (upstream, observed) = Observed::upstream("/forever", axum::routing::post(forever)).await;
    let proxy = start_proxy(&format!("http://{upstream}"), &[]).await;
    let dropped = observed.expect();
    let mut conn = raw_request(
        proxy.addr,
        b"POST /forever HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
    )
    .await;
    // Read until two events have arrived: the stream is flowing through the proxy.
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("data: 1\n\n") {
        let mut buf = [0; 1024];
        let n = tokio::time::timeout(PATIENCE, conn.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "the proxy closed the stream");
        seen.extend_from_slice(&buf[..n]);
    }
    drop(conn);
    until_dropped(
        dropped,
        "the upstream's stream is dropped once the client has gone",
    )
    .await;
}

#[tokio::test]
async fn a_client_that_goes_away_before_the_head_cancels_the_upstream_request() {
    let (upstream, observed) = Observed::upstream("/never", axum::routing::get(never)).await;
    let proxy = start_proxy(&format!("http://{upstream}"), &[]).await;
    let dropped = observed.expect();
    let conn = raw_request(proxy.addr, b"GET /never HTTP/1.1\r\nHost: x\r\n\r\n").await;
    // Wait until the upstream has the request, then go.
    while observed.dropped.lock().unwrap().len() == 1 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(conn);
    until_dropped(
        dropped,
        "the upstream's handler is dropped once the client has gone",
    )
    .await;
}

/// `events` frames `data: <i>\n\n`, one every `gap_ms`, as chunks.
async fn paced(axum::extract::Query(q): axum::extract::Query<Paced>) -> Response {
    let stream = futures_util::stream::unfold(0u64, move |i| async move {
        if i == q.events {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(q.gap_ms)).await;
        Some((
            Ok::<_, Infallible>(Bytes::from(format!("data: {i}\n\n"))),
            i + 1,
        ))
    });
    (
        [(header::CONTENT_TYPE, "text/event-stream")],
        Body::from_stream(stream),
    )
        .into_response()
}

#[derive(serde::Deserialize, Clone, Copy)]
struct Paced {
    events: u64,
    gap_ms: u64,
}

/// The events `data: 0` to `data: <events - 1>`, as [`paced`] and [`chunked_events_upstream`]
/// send them and a client gets them.
fn events_text(events: u64) -> String {
    (0..events).map(|i| format!("data: {i}\n\n")).collect()
}

fn timeout_app() -> axum::Router {
    axum::Router::new()
        .route("/paced", axum::routing::get(paced))
        .fallback(echo)
}

const SHORT: [&str; 6] = [
    "--header-read-timeout",
    "0.5",
    "--idle-timeout",
    "1",
    "--body-timeout",
    "0.5",
];

/// Reads until the peer closes; returns what arrived and when the close came.
async fn read_until_closed(conn: &mut TcpStream) -> (Vec<u8>, Instant) {
    let mut out = Vec::new();
    tokio::time::timeout(PATIENCE, conn.read_to_end(&mut out))
        .await
        .expect("the proxy closes the connection")
        .ok();
    (out, Instant::now())
}

#[tokio::test]
async fn a_partial_request_head_is_closed_after_the_header_read_timeout() {
    let upstream = serve_upstream(timeout_app()).await;
    let proxy = start_proxy(&format!("http://{upstream}"), &SHORT).await;
    let mut conn = TcpStream::connect(proxy.addr).await.unwrap();
    let started = Instant::now();
    conn.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let (out, closed) = read_until_closed(&mut conn).await;
    assert!(out.is_empty() || out.starts_with(b"HTTP/1.1 4"), "{out:?}");
    let held = closed - started;
    assert!(held >= Duration::from_millis(500), "closed after {held:?}");
    // Closed by the header timeout (0.5 s), not the idle one (1 s) nor the test's patience.
    assert!(held < Duration::from_secs(5), "closed after {held:?}");
}

#[tokio::test]
async fn an_idle_connection_is_closed_after_the_idle_timeout() {
    let upstream = serve_upstream(timeout_app()).await;
    let proxy = start_proxy(&format!("http://{upstream}"), &SHORT).await;
    // Never sends a byte.
    let mut conn = TcpStream::connect(proxy.addr).await.unwrap();
    let started = Instant::now();
    let (out, closed) = read_until_closed(&mut conn).await;
    assert!(out.is_empty());
    assert!(
        closed - started >= Duration::from_secs(1),
        "{:?}",
        closed - started
    );
    // Idle after a complete keep-alive exchange: from the end of the response, which comes after
    // `sent`.
    let mut conn = TcpStream::connect(proxy.addr).await.unwrap();
    let sent = Instant::now();
    conn.write_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let (out, closed) = read_until_closed(&mut conn).await;
    assert!(out.starts_with(b"HTTP/1.1 200"), "{out:?}");
    assert!(
        closed - sent >= Duration::from_secs(1),
        "{:?}",
        closed - sent
    );
}

/// Sends `request`, a head and part of its body, and checks that the proxy answers 408 with an
/// OpenAI-shaped error once the body timeout (500 ms in [`SHORT`]) has passed, and closes.
async fn assert_stalled_body_gets_a_408(request: &[u8]) {
    let upstream = serve_upstream(timeout_app()).await;
    let proxy = start_proxy(&format!("http://{upstream}"), &SHORT).await;
    let mut conn = TcpStream::connect(proxy.addr).await.unwrap();
    let started = Instant::now();
    conn.write_all(request).await.unwrap();
    let (out, closed) = read_until_closed(&mut conn).await;
    let (head, body) = split_head(&out);
    assert!(head.starts_with("HTTP/1.1 408"), "{head}");
    error_json(body);
    assert!(closed - started >= Duration::from_millis(500));
    assert!(
        closed - started < Duration::from_secs(5),
        "{:?}",
        closed - started
    );
}

#[tokio::test]
async fn a_stalled_json_body_gets_a_408_after_the_body_timeout() {
    assert_stalled_body_gets_a_408(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Content-Length: 100\r\n\r\n{\"model\":",
    )
    .await;
}

#[tokio::test]
async fn a_stalled_streamed_body_gets_a_408_after_the_body_timeout() {
    // Not JSON: streamed to the upstream as it arrives, which waits for the rest.
    assert_stalled_body_gets_a_408(
        b"PUT /upload HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\n\
          Content-Length: 100\r\n\r\nsome of it",
    )
    .await;
}

#[tokio::test]
async fn a_stream_longer_than_every_timeout_is_not_cut() {
    let upstream = serve_upstream(timeout_app()).await;
    let proxy = start_proxy(&format!("http://{upstream}"), &SHORT).await;
    // 12 events 250 ms apart: 3 s, longer than the header, idle and body timeouts.
    let reply = get(proxy.url("/paced?events=12&gap_ms=250")).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.body, events_text(12));
}

#[tokio::test]
async fn slow_readers_do_not_delay_other_streams() {
    let upstream = serve_upstream(timeout_app()).await;
    let proxy = start_proxy(&format!("http://{upstream}"), &[]).await;
    // Slow readers take 1 byte every 100 ms of a stream far larger than the socket buffers, so the
    // proxy holds their upstream responses back.
    let slow_events = 400_000;
    let reading = Arc::new(AtomicBool::new(true));
    let mut slow = Vec::new();
    for _ in 0..4 {
        let request =
            format!("GET /paced?events={slow_events}&gap_ms=0 HTTP/1.1\r\nHost: x\r\n\r\n");
        let mut conn = raw_request(proxy.addr, request.as_bytes()).await;
        let reading = reading.clone();
        slow.push(tokio::spawn(async move {
            let mut got = Vec::new();
            while reading.load(Ordering::SeqCst) {
                let mut byte = [0; 1];
                if conn.read(&mut byte).await.unwrap() == 0 {
                    break;
                }
                got.push(byte[0]);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            got
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Meanwhile, 20 other streams run to their end.
    let fast = (0..20).map(|_| tokio::spawn(get(proxy.url("/paced?events=2000&gap_ms=0"))));
    for reply in futures_util::future::join_all(fast).await {
        let reply = reply.unwrap();
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(reply.body, events_text(2000));
    }
    // The slow readers are still reading: the fast streams did not wait for them.
    reading.store(false, Ordering::SeqCst);
    for got in futures_util::future::join_all(slow).await {
        let got = got.unwrap();
        assert!(
            got.starts_with(b"HTTP/1.1 200"),
            "{:?}",
            String::from_utf8_lossy(&got)
        );
        assert!(got.len() < 1000, "a slow reader read {} bytes", got.len());
    }
}

#[tokio::test]
async fn shutdown_lets_a_stream_in_flight_finish_and_stops_accepting() {
    let upstream = serve_upstream(timeout_app()).await;
    let mut proxy = start_proxy(&format!("http://{upstream}"), &[]).await;
    let in_flight = tokio::spawn(get(proxy.url("/paced?events=10&gap_ms=100")));
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(proxy.stop.take());
    let reply = in_flight.await.unwrap();
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.body, events_text(10));
    tokio::time::timeout(PATIENCE, &mut proxy.task)
        .await
        .expect("the proxy stops once the stream is done")
        .unwrap()
        .unwrap();
    assert!(TcpStream::connect(proxy.addr).await.is_err());
}

// ---- the layer and the guard, through the proxy ----------------------------------------------

/// What the upstream of the stream tests saw: a router-owned name in a request's annotations.
#[derive(Default)]
struct StreamUpstream {
    halfway: Option<Barrier>,
    forced: AtomicUsize,
    open: AtomicUsize,
    most_open: AtomicUsize,
}

/// How the client of stream `id` asks for annotations.
fn annotations_of(id: u64) -> Vec<&'static str> {
    match id % 4 {
        0 => vec![],
        1 => vec!["x-bypass-remote-prefill", "request_id"],
        2 => vec!["X-Bypass-Remote-Prefill:true", "token_ids"], // forcing: stripped, no opt-in
        _ => vec!["llm_metrics", "request_id"],                 // never forwarded
    }
}

/// Every byte the upstream sends for stream `id` (Dynamo as it is: every annotation, asked for
/// or not), and what its client must receive through the proxy with the Dynamo preset.
fn script(id: u64) -> (String, String) {
    let asked = annotations_of(id);
    let mut rng = XorShift::new(id + 1);
    let (mut full, mut expected) = (String::new(), String::new());
    let mut frame = |name: Option<&str>, text: String| {
        full.push_str(&text);
        // `llm_metrics` is never forwarded, even when asked for.
        if name.is_none_or(|n| n != "llm_metrics" && asked.contains(&n)) {
            expected.push_str(&text);
        }
    };
    if id % 2 == 1 {
        frame(Some("x-bypass-remote-prefill"), MARKER.to_owned());
    }
    frame(
        Some("request_id"),
        format!("event: request_id\n: \"req-{id}\"\n\n"),
    );
    for i in 0..60 {
        match rng.below(12) {
            0 => frame(
                Some("llm_metrics"),
                format!("event: llm_metrics\n: {{\"i\":{i}}}\n\n"),
            ),
            1 => frame(None, ": keep-alive\n\n".to_owned()),
            2 => frame(
                Some("token_ids"),
                format!("event: token_ids\n: \"[{i}, {id}]\"\n\n"),
            ),
            _ => frame(
                None,
                format!(
                    "data: {{\"id\":\"chatcmpl-{id}\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{i}{}\"}}}}]}}\n\n",
                    "x".repeat(rng.below(200) as usize)
                ),
            ),
        }
    }
    frame(None, "data: [DONE]\n\n".to_owned());
    (full, expected)
}

/// The upstream's chunks for stream `id`: 1 to 300 bytes, cutting frames anywhere.
fn chunks(id: u64, full: &str) -> Vec<Bytes> {
    random_chunks(!id, full.as_bytes(), 300)
}

async fn stream_handler(State(upstream): State<Arc<StreamUpstream>>, body: Bytes) -> Response {
    let request: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let id = request["stream_id"].as_u64().unwrap();
    let names: Vec<String> = request["nvext"]["annotations"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str())
        .map(str::to_ascii_lowercase)
        .collect();
    if names
        .iter()
        .any(|n| n.starts_with("x-bypass-remote-prefill") || n.starts_with("x-prefill-continue"))
    {
        upstream.forced.fetch_add(1, Ordering::SeqCst);
    }
    let (full, _) = script(id);
    let chunks = chunks(id, &full);
    let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(4);
    let upstream = upstream.clone();
    tokio::spawn(async move {
        let open = upstream.open.fetch_add(1, Ordering::SeqCst) + 1;
        upstream.most_open.fetch_max(open, Ordering::SeqCst);
        let half = chunks.len() / 2;
        for (i, chunk) in chunks.into_iter().enumerate() {
            if i == half {
                if let Some(barrier) = &upstream.halfway {
                    barrier.wait().await;
                }
            }
            if tx.send(Ok(chunk)).await.is_err() {
                break;
            }
        }
        upstream.open.fetch_sub(1, Ordering::SeqCst);
    });
    (
        [(header::CONTENT_TYPE, "text/event-stream")],
        Body::from_stream(ReceiverStream::new(rx)),
    )
        .into_response()
}

/// Fails with the first difference between what stream `id` got and what it should have.
fn assert_same(id: u64, got: &[u8], want: &str) {
    if got == want.as_bytes() {
        return;
    }
    let at = got
        .iter()
        .zip(want.as_bytes())
        .position(|(a, b)| a != b)
        .unwrap_or(got.len().min(want.len()));
    let around = |s: &[u8]| {
        String::from_utf8_lossy(&s[at.saturating_sub(60)..(at + 60).min(s.len())]).into_owned()
    };
    panic!(
        "stream {id}: {} bytes, want {}; first difference at {at}:\n got ..{:?}..\nwant ..{:?}..",
        got.len(),
        want.len(),
        around(got),
        around(want.as_bytes())
    );
}

fn stream_request(id: u64) -> serde_json::Value {
    serde_json::json!({
        "model": "m",
        "stream": true,
        "stream_id": id,
        "messages": [{"role": "user", "content": "hi"}],
        "nvext": {"annotations": annotations_of(id)},
    })
}

async fn stream_upstream(halfway: Option<usize>) -> (SocketAddr, Arc<StreamUpstream>) {
    let state = Arc::new(StreamUpstream {
        halfway: halfway.map(Barrier::new),
        ..StreamUpstream::default()
    });
    let app = axum::Router::new()
        .route("/v1/chat/completions", axum::routing::post(stream_handler))
        .with_state(state.clone());
    (serve_upstream(app).await, state)
}

#[tokio::test]
async fn the_layer_and_the_guard_apply_and_no_layer_forwards_untouched() {
    let (upstream, seen) = stream_upstream(None).await;
    let with = start_proxy(&format!("http://{upstream}"), &[]).await;
    let without = start_proxy(&format!("http://{upstream}"), &["--no-layer"]).await;
    for id in 0..8 {
        let (_, expected) = script(id);
        let reply = post_json(with.url("/v1/chat/completions"), &stream_request(id)).await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_same(id, &reply.body, &expected);
    }
    // The guard stripped every router-owned name, the opt-ins of streams 1 and 5 included.
    assert_eq!(seen.forced.load(Ordering::SeqCst), 0);
    for id in 0..8 {
        let (full, _) = script(id);
        let reply = post_json(without.url("/v1/chat/completions"), &stream_request(id)).await;
        assert_same(id, &reply.body, &full);
    }
    // Untouched: streams 1, 2, 5 and 6 named the marker, and the upstream saw it.
    assert_eq!(seen.forced.load(Ordering::SeqCst), 4);
}

fn stream_count() -> usize {
    std::env::var("BYPASS_MARKER_PROXY_STREAMS")
        .ok()
        .map(|v| {
            v.parse()
                .expect("BYPASS_MARKER_PROXY_STREAMS must be a number")
        })
        .unwrap_or(200)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams_through_the_proxy_arrive_byte_for_byte() {
    let streams = stream_count();
    // Each stream holds four descriptors here (client, proxy's accepted, proxy's upstream,
    // upstream's accepted).
    let fds = raise_open_files_limit();
    assert!(
        fds as usize > streams * 4 + 100,
        "{streams} streams need {} file descriptors, the limit is {fds}",
        streams * 4 + 100
    );
    // Every stream waits halfway until all are open, so all are in flight through the proxy at once.
    let (upstream, seen) = stream_upstream(Some(streams)).await;
    let proxy = start_proxy(&format!("http://{upstream}"), &[]).await;
    let started = Instant::now();
    let client = client();
    let runs = (0..streams as u64).map(|id| {
        let client = client.clone();
        let url = proxy.url("/v1/chat/completions");
        tokio::spawn(async move {
            let req = http::Request::post(url)
                .header(header::CONTENT_TYPE, "application/json")
                .body(Full::new(Bytes::from(stream_request(id).to_string())))
                .unwrap();
            let res = client.request(req).await?;
            let status = res.status();
            let body = res.into_body().collect().await?.to_bytes();
            assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
            Ok::<_, BoxError>((id, body))
        })
    });
    let results = tokio::time::timeout(
        Duration::from_secs(300),
        futures_util::future::join_all(runs),
    )
    .await
    .unwrap_or_else(|_| {
        panic!(
            "not done in time; {} streams open at most",
            seen.most_open.load(Ordering::SeqCst)
        )
    });
    for result in results {
        let (id, body) = result.unwrap().unwrap();
        let (_, expected) = script(id);
        assert_same(id, &body, &expected);
    }
    assert_eq!(seen.most_open.load(Ordering::SeqCst), streams);
    assert_eq!(seen.forced.load(Ordering::SeqCst), 0);
    eprintln!(
        "{streams} concurrent streams through the proxy, byte for byte, in {:?}",
        started.elapsed()
    );
}

#[test]
fn the_help_lists_every_flag_and_bad_flags_are_refused() {
    use clap::CommandFactory as _;
    let mut cli = proxy::Cli::command();
    cli.build(); // propagates the global flags to the subcommands
    let help = cli
        .find_subcommand_mut("proxy")
        .expect("a proxy subcommand")
        .render_long_help()
        .to_string();
    for flag in [
        "--listen",
        "--upstream",
        "--preset",
        "--opt-in",
        "--router-owned",
        "--never-forward",
        "--sdk-safe",
        "--no-layer",
        "--max-body",
        "--backlog",
        "--header-read-timeout",
        "--idle-timeout",
        "--body-timeout",
        "--connect-timeout",
        "--response-timeout",
        "--shutdown-grace",
        "--metrics-listen",
        "--log-format",
        "--help",
        "--version",
    ] {
        assert!(
            help.contains(flag),
            "--help does not mention {flag}:\n{help}"
        );
        if !matches!(flag, "--help" | "--version") {
            let var = format!(
                "BYPASS_MARKER_{}",
                flag[2..].replace('-', "_").to_ascii_uppercase()
            );
            assert!(
                help.contains(&var),
                "--help does not mention {var}:\n{help}"
            );
        }
    }
    let refused = |args: &[&str]| proxy::ProxyArgs::from_args(args.iter().copied()).unwrap_err();
    assert!(refused(&[]).contains("--upstream"));
    assert!(refused(&["--upstream", "https://x"]).contains("https"));
    assert!(refused(&["--upstream", "http://x", "--preset", "vllm"]).contains("--preset"));
    assert!(refused(&["--upstream", "http://x", "--idle-timeout", "0"]).contains("positive"));
    assert!(refused(&["--upstream", "http://x", "--frobnicate"]).contains("--frobnicate"));
    assert!(refused(&["--upstream", "http://x", "--opt-in", "a:b"]).contains("--opt-in \"a:b\""));
    assert!(refused(&["--upstream", "http://x", "--never-forward", ""]).contains("--never-forward"));
    let config = proxy::ProxyArgs::from_args([
        "--upstream=http://127.0.0.1:8000",
        "--opt-in",
        "a",
        "--opt-in",
        "b,c",
        "--body-timeout",
        "0.25",
    ])
    .unwrap();
    assert_eq!(config.naming.opt_in, ["a", "b", "c"]);
    assert_eq!(config.body_timeout, Duration::from_millis(250));
    // Every default of the example the binary replaced.
    assert_eq!(config.backlog, 1024);
    assert_eq!(
        config.listen,
        "127.0.0.1:3000".parse::<SocketAddr>().unwrap()
    );
    assert_eq!(config.naming.preset, proxy::Preset::Dynamo);
    assert_eq!(config.naming.max_body, 32 * 1024 * 1024);
    assert!(!config.naming.sdk_safe && !config.no_layer);
    assert_eq!(config.metrics_listen, None);
    assert_eq!(config.header_read_timeout, Duration::from_secs(10));
    assert_eq!(config.idle_timeout, Duration::from_secs(60));
    assert_eq!(config.connect_timeout, Duration::from_secs(5));
    assert_eq!(config.response_timeout, Duration::from_secs(600));
    assert_eq!(config.shutdown_grace, Duration::from_secs(30));
}

#[test]
fn the_naming_flags_build_the_layer_or_say_which_name_is_wrong() {
    let naming = |args: &[&str]| {
        let mut all = vec!["--upstream", "http://x"];
        all.extend_from_slice(args);
        // Parse without the name check of `from_args`, as the ext-proc subcommand will.
        use clap::Parser as _;
        let mut argv = vec!["bypass-marker", "proxy"];
        argv.extend(all);
        #[allow(unreachable_patterns)] // until a second subcommand
        match proxy::Cli::try_parse_from(argv).unwrap().command {
            proxy::Command::Proxy(args) => args.naming,
            _ => unreachable!(),
        }
    };
    let layer = naming(&[
        "--opt-in",
        "x-a",
        "--never-forward",
        "x-b",
        "--preset",
        "none",
    ])
    .layer()
    .unwrap();
    let names: Vec<&str> = layer.names().collect();
    assert_eq!(names, ["x-bypass-remote-prefill", "x-a", "x-b"]);
    let err = naming(&["--router-owned", "bad\nname"])
        .layer()
        .unwrap_err();
    assert_eq!(err.flag(), "--router-owned");
    assert!(
        err.to_string()
            .starts_with("--router-owned \"bad\\nname\": "),
        "{err}"
    );
}

/// The annotations of the JSON body an [`echo`] saw.
fn echoed_annotations(seen: &serde_json::Value) -> Vec<String> {
    let body: serde_json::Value =
        serde_json::from_str(seen["body"].as_str().unwrap()).expect("the upstream got JSON");
    body["nvext"]["annotations"]
        .as_array()
        .map(|a| a.iter().map(|v| v.as_str().unwrap().to_owned()).collect())
        .unwrap_or_default()
}

#[tokio::test]
async fn a_connection_header_cannot_hide_a_json_body_from_the_guard() {
    // The client's body is JSON, declared `text/plain` (the guard does not read it), and its
    // `Connection` header names `content-type`: hop by hop, the proxy removes that header, so the
    // upstream gets a body with no content type, which FastAPI parses as JSON. The guard must
    // decide on those headers, the upstream's: it reads the body and strips the marker.
    let upstream = serve_upstream(axum::Router::new().fallback(echo)).await;
    let proxy = start_proxy(&format!("http://{upstream}"), &[]).await;
    let body = br#"{"model":"m","nvext":{"annotations":["x-bypass-remote-prefill","request_id"]}}"#;
    for connection in [
        &b"close, content-type"[..],
        b"close,Content-Type , x-client-hop",
        // Non-ASCII bytes (obs-text) in the value: its names are still read.
        b"close, content-type, \xe9t\xe9, x-client-hop",
        b"\xff, close, content-type",
    ] {
        let mut request = Vec::new();
        request.extend_from_slice(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n");
        request.extend_from_slice(b"Content-Type: text/plain\r\nX-Client-Hop: secret\r\n");
        request.extend_from_slice(b"Connection: ");
        request.extend_from_slice(connection);
        request.extend_from_slice(b"\r\nConnection: close\r\n");
        request.extend_from_slice(format!("Content-Length: {}\r\n\r\n", body.len()).as_bytes());
        request.extend_from_slice(body);
        let response = raw_exchange(proxy.addr, &request).await;
        let (head, body) = split_head(&response);
        let shown = String::from_utf8_lossy(connection);
        assert!(head.starts_with("HTTP/1.1 200"), "{shown}: {head}");
        let seen: serde_json::Value = serde_json::from_slice(body).unwrap();
        assert!(
            echo_header(&seen, "content-type").is_empty(),
            "{shown}: {seen}"
        );
        assert_eq!(echoed_annotations(&seen), ["request_id"], "{shown}: {seen}");
        if shown.contains("x-client-hop") {
            assert!(
                echo_header(&seen, "x-client-hop").is_empty(),
                "{shown}: {seen}"
            );
        }
    }
}

#[tokio::test]
async fn a_non_ascii_connection_header_still_removes_the_headers_it_names() {
    let upstream = serve_upstream(axum::Router::new().fallback(echo)).await;
    let proxy = start_proxy(&format!("http://{upstream}"), &[]).await;
    let request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\
        Connection: X-Client-Hop, caf\xc3\xa9\r\nConnection: close\r\n\
        X-Client-Hop: secret\r\nX-End-To-End: kept\r\n\r\n";
    let response = raw_exchange(proxy.addr, request).await;
    let (head, body) = split_head(&response);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let seen: serde_json::Value = serde_json::from_slice(body).unwrap();
    assert!(echo_header(&seen, "x-client-hop").is_empty(), "{seen}");
    assert_eq!(echo_header(&seen, "x-end-to-end"), ["kept"]);
}

/// An event stream with the marker; gzip-encoded when the request accepts gzip, as a server
/// behind a compression middleware sends it.
async fn compressing(req: Request) -> Response {
    let events = format!("{MARKER}data: {{\"x\":1}}\n\n{MARKER}data: [DONE]\n\n");
    let accepts_gzip = req
        .headers()
        .get_all(header::ACCEPT_ENCODING)
        .iter()
        .any(|v| v.to_str().unwrap_or("").contains("gzip"));
    if accepts_gzip {
        gzipped_event_stream(&events)
    } else {
        ([(header::CONTENT_TYPE, "text/event-stream")], events).into_response()
    }
}

#[tokio::test]
async fn the_upstream_is_asked_for_unencoded_event_streams() {
    use std::io::Read as _;
    let app = axum::Router::new()
        .route("/stream", axum::routing::get(compressing))
        .fallback(echo);
    let upstream = serve_upstream(app).await;
    let proxy = start_proxy(&format!("http://{upstream}"), &[]).await;
    // What the upstream is asked for.
    let req = http::Request::get(proxy.url("/v1/models"))
        .header(header::ACCEPT_ENCODING, "gzip, br")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let seen: serde_json::Value = serde_json::from_slice(&send(req).await.unwrap().body).unwrap();
    assert_eq!(
        echo_header(&seen, "accept-encoding"),
        ["identity"],
        "{seen}"
    );
    // A client that accepts gzip gets the stream filtered (and, from this proxy, unencoded).
    let req = http::Request::get(proxy.url("/stream"))
        .header(header::ACCEPT_ENCODING, "gzip")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let reply = send(req).await.unwrap();
    assert_eq!(reply.status, StatusCode::OK);
    let body = if reply.headers.get(header::CONTENT_ENCODING).is_some() {
        let mut plain = Vec::new();
        flate2::read::GzDecoder::new(&reply.body[..])
            .read_to_end(&mut plain)
            .unwrap();
        plain
    } else {
        reply.body.to_vec()
    };
    assert_eq!(
        String::from_utf8(body).unwrap(),
        "data: {\"x\":1}\n\ndata: [DONE]\n\n"
    );
}

/// An upstream that gzips its event stream whatever it is asked for.
async fn always_gzip() -> Response {
    gzipped_event_stream(&format!("{MARKER}data: {{\"x\":1}}\n\n"))
}

/// `events` as a gzip-encoded event stream.
fn gzipped_event_stream(events: &str) -> Response {
    use std::io::Write as _;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(events.as_bytes()).unwrap();
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CONTENT_ENCODING, "gzip"),
        ],
        gz.finish().unwrap(),
    )
        .into_response()
}

/// An upstream that compresses although it was asked for `identity`: the proxy cannot filter the
/// stream, so a client with something to remove gets a 502 in OpenAI's shape and no byte of it,
/// counted and logged once; a client that opted in to every name gets it untouched.
#[tokio::test]
async fn an_encoded_event_stream_is_answered_with_a_502_counted_and_logged() {
    let captured = logs::Captured::default();
    let _log = tracing::subscriber::set_default(captured.subscriber(tracing::Level::WARN));
    let app = axum::Router::new().fallback(always_gzip);
    let upstream = serve_upstream(app).await;
    let (proxy, metrics) =
        start_metered(&format!("http://{upstream}"), &["--preset", "none"]).await;
    let chat = |annotations: &str| {
        http::Request::post(proxy.url("/v1/chat/completions"))
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(format!(
                r#"{{"model":"m","stream":true,"nvext":{{"annotations":{annotations}}}}}"#
            ))))
            .unwrap()
    };
    let reply = send(chat("[]")).await.unwrap();
    assert_eq!(reply.status, StatusCode::BAD_GATEWAY);
    assert_eq!(reply.headers[header::CONTENT_TYPE], "application/json");
    assert!(reply.headers.get(header::CONTENT_ENCODING).is_none());
    let error: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
    assert_eq!(error["error"]["code"], "encoded_event_stream", "{error}");
    assert_eq!(error["error"]["type"], "server_error", "{error}");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("content-encoding gzip,"),
        "{error}"
    );
    assert_metrics(
        &metrics,
        &["bypass_marker_encoded_streams_refused_total{coding=\"gzip\"} 1\n"],
    );
    let logged = captured.text();
    assert_eq!(
        logged.matches("encoded_event_stream").count(),
        1,
        "{logged}"
    );
    assert!(
        logged.contains("WARN") && logged.contains("coding=\"gzip\""),
        "{logged}"
    );

    // Opted in to the one configured name: nothing to remove, the stream passes encoded.
    let reply = send(chat(r#"["x-bypass-remote-prefill"]"#)).await.unwrap();
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.headers[header::CONTENT_ENCODING], "gzip");
    assert_metrics(
        &metrics,
        &["bypass_marker_encoded_streams_refused_total{coding=\"gzip\"} 1\n"],
    );
}

/// An upstream that answers with [`echo`] and counts the requests it gets: its address and the
/// count.
async fn counting_echo_upstream() -> (SocketAddr, Arc<AtomicUsize>) {
    let forwarded = Arc::new(AtomicUsize::new(0));
    let counted = forwarded.clone();
    let app = axum::Router::new().fallback(move |req: Request| {
        counted.fetch_add(1, Ordering::SeqCst);
        echo(req)
    });
    (serve_upstream(app).await, forwarded)
}

#[tokio::test]
async fn transfer_codings_other_than_chunked_are_refused_and_never_forwarded() {
    let (upstream, forwarded) = counting_echo_upstream().await;
    let proxy = start_proxy(&format!("http://{upstream}"), &[]).await;
    let chunked_body = "5\r\nhello\r\n0\r\n\r\n";
    let with_coding = |te: &str| {
        format!(
            "POST /v1/x HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\n\
             Transfer-Encoding: {te}\r\n\r\n{chunked_body}"
        )
    };
    // hyper decodes `chunked` as the last coding; a coding before it would reach the upstream
    // still applied, and no longer named: RFC 9112 section 6.1 says 501.
    for te in [
        "gzip, chunked",
        "x-custom,chunked",
        "chunked\r\nTransfer-Encoding: chunked, deflate, chunked",
    ] {
        let response = raw_exchange(proxy.addr, with_coding(te).as_bytes()).await;
        let (head, body) = split_head(&response);
        assert!(head.starts_with("HTTP/1.1 501"), "{te}: {head}");
        let json = error_json(body);
        assert_eq!(json["error"]["code"], "unsupported_transfer_coding");
    }
    // A last coding other than chunked: hyper itself refuses (400) before the proxy sees it.
    for te in ["gzip", "chunked, gzip"] {
        let response = raw_exchange(proxy.addr, with_coding(te).as_bytes()).await;
        let (head, _) = split_head(&response);
        assert!(
            head.starts_with("HTTP/1.1 400") || head.starts_with("HTTP/1.1 501"),
            "{te}: {head}"
        );
    }
    assert_eq!(forwarded.load(Ordering::SeqCst), 0);
    // Plain chunked (any case) is forwarded, decoded.
    let request = format!(
        "POST /v1/x HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nConnection: close\r\n\
         Transfer-Encoding: Chunked\r\n\r\n{chunked_body}"
    );
    let response = raw_exchange(proxy.addr, request.as_bytes()).await;
    let (head, body) = split_head(&response);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let seen: serde_json::Value = serde_json::from_slice(body).unwrap();
    assert_eq!(seen["body"], "hello");
    assert_eq!(forwarded.load(Ordering::SeqCst), 1);
}

/// `CONNECT` gets a 405 from the proxy itself (with `Allow`, and the connection closed): it was
/// forwarded as `CONNECT <upstream authority>` and answered 200 with an empty event stream.
#[tokio::test]
async fn connect_is_refused_and_never_forwarded() {
    let (upstream, forwarded) = counting_echo_upstream().await;
    for args in [&[][..], &["--no-layer"][..]] {
        let proxy = start_proxy(&format!("http://{upstream}"), args).await;
        for target in [format!("{upstream}"), "example.com:443".to_owned()] {
            let request = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n");
            let response = raw_exchange(proxy.addr, request.as_bytes()).await;
            let (head, body) = split_head(&response);
            assert!(
                head.starts_with("HTTP/1.1 405"),
                "{args:?} {target}: {head}"
            );
            let names = header_names(&head);
            assert!(names.contains(&"allow".to_owned()), "{head}");
            let json = error_json(body);
            assert_eq!(json["error"]["code"], "method_not_allowed", "{json}");
        }
    }
    assert_eq!(forwarded.load(Ordering::SeqCst), 0);
}

/// An upstream on raw TCP that answers one request with an event stream: first `together` (one
/// chunk each, all in one write), then, once `go` fires, `after` in a write of its own, then the
/// end.
async fn raw_stream_upstream(
    together: Vec<&'static str>,
    after: &'static str,
    go: oneshot::Receiver<()>,
) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut conn, _) = listener.accept().await.unwrap();
        if read_head(&mut conn).await.is_err() {
            return;
        }
        let chunk = |event: &str| format!("{:x}\r\n{event}\r\n", event.len());
        let mut first = String::from(
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
        );
        for event in together {
            first.push_str(&chunk(event));
        }
        conn.write_all(first.as_bytes()).await.unwrap();
        if go.await.is_ok() {
            let rest = format!("{}0\r\n\r\n", chunk(after));
            let _ = conn.write_all(rest.as_bytes()).await;
        }
        let _ = read_until_closed(&mut conn).await;
    });
    addr
}

#[tokio::test]
async fn events_that_arrive_together_come_through_and_none_waits_for_the_next() {
    let (go, wait) = oneshot::channel();
    let upstream = raw_stream_upstream(
        vec![MARKER, "data: {\"n\":1}\n\n", "data: {\"n\":2}\n\n"],
        "data: {\"n\":3}\n\n",
        wait,
    )
    .await;
    let proxy = start_proxy(&format!("http://{upstream}"), &[]).await;
    let mut conn = raw_request(proxy.addr, b"GET /v1/stream HTTP/1.1\r\nhost: x\r\n\r\n").await;
    // Every read the client makes, until both first events have come.
    let mut reads: Vec<Vec<u8>> = Vec::new();
    let seen = |reads: &[Vec<u8>], what: &str| {
        reads
            .iter()
            .position(|r| r.windows(what.len()).any(|w| w == what.as_bytes()))
    };
    tokio::time::timeout(PATIENCE, async {
        while seen(&reads, "{\"n\":2}").is_none() {
            let mut buf = vec![0u8; 64 << 10];
            let n = conn.read(&mut buf).await.unwrap();
            assert!(n > 0, "the proxy closed the stream early");
            reads.push(buf[..n].to_vec());
        }
    })
    .await
    .expect("the first two events came through");
    // The events the upstream sent in one write came through, the marker among them removed
    // (how many writes they took is pinned by the unit tests of `cli::conn`: a client's reads
    // cannot tell).
    assert!(seen(&reads, "{\"n\":1}").is_some());
    assert!(seen(&reads, "x-bypass-remote-prefill").is_none());
    // Nothing waited for the third event, which the upstream sends only now.
    go.send(()).unwrap();
    let (rest, _) = tokio::time::timeout(PATIENCE, read_until_closed_or_end(&mut conn))
        .await
        .expect("the third event and the end came through");
    assert!(String::from_utf8_lossy(&rest).contains("data: {\"n\":3}\n\n"));
}

/// Reads until the connection closes or the chunked body's last chunk has come.
async fn read_until_closed_or_end(conn: &mut TcpStream) -> (Vec<u8>, Instant) {
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = conn.read(&mut buf).await.unwrap_or(0);
        if n == 0 {
            return (out, Instant::now());
        }
        out.extend_from_slice(&buf[..n]);
        if out.ends_with(b"0\r\n\r\n") {
            return (out, Instant::now());
        }
    }
}

/// A proxy with metrics the test can read.
async fn start_metered(upstream: &str, args: &[&str]) -> (Proxy, Arc<proxy::Metrics>) {
    let config = proxy_args(upstream, args);
    let metrics = proxy::proxy::metrics_for(&config).unwrap();
    let counting = metrics.clone();
    let proxy = Proxy::spawn(config, |listener, config, stop| {
        proxy::serve_metered(listener, config, counting, stopped(stop))
    });
    (proxy, metrics)
}

/// Fails unless the text of `metrics` has each of `lines` (a series and its value, and `\n`).
/// Every series carries `front_door="sidecar"` (issue 49); `lines` are written without it.
fn assert_metrics(metrics: &proxy::Metrics, lines: &[&str]) {
    let text = metrics.encode();
    assert!(
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .all(|l| l.contains("front_door=\"sidecar\"")),
        "a series without front_door=\"sidecar\":\n{text}"
    );
    let text = text
        .replace("{front_door=\"sidecar\"}", "")
        .replace("front_door=\"sidecar\",", "");
    for line in lines {
        assert!(text.contains(line), "{text}");
    }
}

/// A client connection with a 4 KiB receive buffer (it stops taking bytes soon after it stops
/// reading), on which `request` has been written.
async fn small_window_request(addr: SocketAddr, request: &[u8]) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut conn = socket.connect(addr).await.unwrap();
    conn.write_all(request).await.unwrap();
    conn
}

/// 16 KiB events as fast as the connection takes them, forever; the stream holds a
/// [`DropSignal`].
async fn flood(State(observed): State<Observed>) -> Response {
    let signal = observed.take();
    let event = Bytes::from(format!("data: {}\n\n", "x".repeat(16 << 10)));
    let stream = futures_util::stream::unfold(signal, move |signal| {
        let event = event.clone();
        async move { Some((Ok::<_, Infallible>(event), signal)) }
    });
    (
        [(header::CONTENT_TYPE, "text/event-stream")],
        Body::from_stream(stream),
    )
        .into_response()
}

/// A client that asked for [`flood`] through a proxy with `--write-timeout 1`, on a connection
/// with a small window ([`small_window_request`]), and has read nothing yet.
struct StalledClient {
    proxy: Proxy,
    metrics: Arc<proxy::Metrics>,
    conn: TcpStream,
    /// Completes when the upstream's work for the request is dropped.
    dropped: oneshot::Receiver<()>,
}

impl StalledClient {
    /// Starts the upstream and the proxy, and sends the request.
    async fn start() -> Self {
        let (upstream, observed) = Observed::upstream("/flood", axum::routing::get(flood)).await;
        let (proxy, metrics) =
            start_metered(&format!("http://{upstream}"), &["--write-timeout", "1"]).await;
        let dropped = observed.expect();
        let conn =
            small_window_request(proxy.addr, b"GET /flood HTTP/1.1\r\nHost: x\r\n\r\n").await;
        Self {
            proxy,
            metrics,
            conn,
            dropped,
        }
    }
}

/// A client that stops reading is cut off once a write has made no progress for
/// `--write-timeout`, and its upstream request is cancelled; the metrics count it. (The idle and
/// header timeouts do not run while a request is in flight, and `--response-timeout` ends at the
/// response head: both connections stayed open for good.)
#[tokio::test]
async fn a_client_that_stops_reading_is_cut_off_after_the_write_timeout() {
    let StalledClient {
        proxy: _proxy,
        metrics,
        mut conn,
        dropped,
    } = StalledClient::start().await;
    let started = Instant::now();
    // The client reads nothing: the upstream request is cancelled ...
    until_dropped(dropped, "the upstream request is cancelled").await;
    assert!(started.elapsed() >= Duration::from_secs(1));
    assert_metrics(&metrics, &["bypass_marker_write_timeouts_total 1\n"]);
    // ... and the connection closed: what the socket holds, then the end.
    let _ = read_to_end_or_error(&mut conn).await;
}

/// 4 MiB of events as fast as the connection takes them, then the end.
async fn burst() -> Response {
    let body: String = (0..256)
        .map(|i| format!("data: {i:03}{}\n\n", "x".repeat((16 << 10) - 13)))
        .collect();
    ([(header::CONTENT_TYPE, "text/event-stream")], body).into_response()
}

/// A slow reader gets the whole response: the idle clock starts once the response's last byte has
/// been written to the socket, not when hyper drops the finished body with its last bytes still
/// in its write buffer (the idle timer then aborted the connection, and clients reading a 17.7 MB
/// stream at 320 to 640 KB/s lost its tail). The client here reads 8 KiB every 2 ms; the proxy's
/// socket holds some 3 MB, so hyper holds the tail for longer than the idle timeout.
#[tokio::test]
async fn a_slow_reader_gets_the_whole_response_before_the_idle_clock_starts() {
    let app = axum::Router::new().route("/burst", axum::routing::get(burst));
    let upstream = serve_upstream(app).await;
    let (proxy, metrics) =
        start_metered(&format!("http://{upstream}"), &["--idle-timeout", "0.3"]).await;
    let mut conn =
        small_window_request(proxy.addr, b"GET /burst HTTP/1.1\r\nHost: x\r\n\r\n").await;
    let mut response = Vec::new();
    let mut buf = vec![0; 64 << 10];
    tokio::time::timeout(PATIENCE, async {
        while !response.ends_with(b"0\r\n\r\n") {
            tokio::time::sleep(Duration::from_millis(2)).await;
            match conn.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => response.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await
    .expect("the response ends in time");
    let (head, body) = split_head(&response);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let text = String::from_utf8_lossy(body);
    assert_eq!(text.matches("data: ").count(), 256, "events are missing");
    assert!(
        body.ends_with(b"0\r\n\r\n"),
        "the terminal chunk is missing"
    );
    // Once it is written, the connection is idle and closed after the idle timeout.
    let (rest, _) = read_until_closed(&mut conn).await;
    assert!(rest.is_empty());
    assert_metrics(&metrics, &["bypass_marker_streams_active 0\n"]);
}

/// Past `--max-connections`, a connection waits in the backlog: the second client is answered
/// only once the first one's connection has ended.
#[tokio::test]
async fn connections_past_max_connections_wait_in_the_backlog() {
    let upstream = serve_upstream(timeout_app()).await;
    let proxy = start_proxy(&format!("http://{upstream}"), &["--max-connections", "1"]).await;
    let ask = |events: u64| {
        let addr = proxy.addr;
        tokio::spawn(async move {
            let request = format!(
                "GET /paced?events={events}&gap_ms=100 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            );
            let response = raw_exchange(addr, request.as_bytes()).await;
            (response, Instant::now())
        })
    };
    // The first client holds the only place for about a second ...
    let first = ask(10);
    tokio::time::sleep(Duration::from_millis(200)).await;
    // ... the second connects (the backlog takes it) and asks meanwhile.
    let second = ask(1);
    let (first, first_done) = first.await.unwrap();
    let (second, second_done) = second.await.unwrap();
    for (response, events) in [(&first, 10), (&second, 1)] {
        let (head, body) = split_head(response);
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        let body = String::from_utf8_lossy(body);
        assert!(
            body.contains(&format!("data: {}\n\n", events - 1)),
            "{body}"
        );
    }
    // Its one event comes 100 ms after it is accepted: after the first has ended.
    assert!(second_done >= first_done + Duration::from_millis(100));
}

/// The default cap: half of what the open-file limit leaves once 32 descriptors and 2 per thread
/// are kept for the process; at least 1; no cap without a limit.
#[test]
fn max_connections_defaults_to_half_the_descriptors_left() {
    assert_eq!(proxy::default_max_connections(Some(1024), 1), 495);
    assert_eq!(proxy::default_max_connections(Some(65536), 2), 32750);
    assert_eq!(proxy::default_max_connections(Some(48), 1), 7);
    assert_eq!(proxy::default_max_connections(Some(10), 1), 1);
    assert!(proxy::default_max_connections(None, 1) > 1 << 40);
}

/// An upstream on raw TCP that runs `script` on every connection it accepts, after reading the
/// request head (given to it).
async fn scripted_upstream<F, Fut>(script: F) -> SocketAddr
where
    F: Fn(TcpStream, Vec<u8>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            // A head cut short goes to the script as it came.
            let head = read_head(&mut conn).await.unwrap_or_else(|cut| cut);
            tokio::spawn(script(conn, head));
        }
    });
    addr
}

/// Reads a request head byte by byte, so that nothing after it is taken: `Ok` with the head, or
/// `Err` with what came when the connection ended (or failed) before the head did.
async fn read_head(conn: &mut TcpStream) -> Result<Vec<u8>, Vec<u8>> {
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        if conn.read(&mut byte).await.unwrap_or(0) == 0 {
            return Err(head);
        }
        head.push(byte[0]);
    }
    Ok(head)
}

/// Reads until the connection ends: what arrived, and how it ended (`Ok` at a clean close, FIN;
/// the error that ended it otherwise, such as a reset).
async fn read_to_end_or_error(conn: &mut TcpStream) -> (Vec<u8>, std::io::Result<()>) {
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    let end = tokio::time::timeout(PATIENCE, async {
        loop {
            match conn.read(&mut buf).await {
                Ok(0) => return Ok(()),
                Ok(n) => out.extend_from_slice(&buf[..n]),
                Err(err) => return Err(err),
            }
        }
    })
    .await
    .expect("the proxy ends the connection");
    (out, end)
}

/// How a client connection ended: `Ok(bytes)` at a clean close (FIN), `Err(bytes)` at a reset.
async fn read_to_close_or_reset(conn: &mut TcpStream) -> Result<Vec<u8>, Vec<u8>> {
    match read_to_end_or_error(conn).await {
        (out, Ok(())) => Ok(out),
        (out, Err(err)) if err.kind() == std::io::ErrorKind::ConnectionReset => Err(out),
        (_, Err(err)) => panic!("{err}"),
    }
}

/// A stream the upstream cut short mid-chunk reaches every client as a reset connection, never a
/// clean close: an HTTP/1.0 client's response ends at the close, so a FIN would make the cut
/// stream look complete.
#[tokio::test]
async fn a_cut_stream_is_a_reset_for_http10_and_http11_clients_alike() {
    let upstream = scripted_upstream(|mut conn, _| async move {
        let reply = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                     transfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n9\r\ndata";
        conn.write_all(reply.as_bytes()).await.unwrap();
        // Closed mid-chunk.
    })
    .await;
    let proxy = start_proxy(&format!("http://{upstream}"), &[]).await;
    for version in ["HTTP/1.0", "HTTP/1.1"] {
        let request = format!("GET /v1/stream {version}\r\nhost: x\r\n\r\n");
        let mut conn = raw_request(proxy.addr, request.as_bytes()).await;
        let ended = read_to_close_or_reset(&mut conn).await;
        assert!(
            ended.is_err(),
            "{version}: a clean close after {:?}",
            String::from_utf8_lossy(ended.as_ref().unwrap())
        );
    }
}

/// An upstream that goes silent after its head is cut after `--upstream-idle-timeout`: the
/// client's stream ends as a cut one (a reset, no last chunk) and the metrics say why.
#[tokio::test]
async fn an_upstream_silent_mid_body_is_cut_after_the_upstream_idle_timeout() {
    let upstream = scripted_upstream(|mut conn, _| async move {
        let reply = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                     transfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n";
        conn.write_all(reply.as_bytes()).await.unwrap();
        // Silent until the proxy closes.
        let _ = read_until_closed(&mut conn).await;
    })
    .await;
    let (proxy, metrics) = start_metered(
        &format!("http://{upstream}"),
        &[
            "--upstream-idle-timeout",
            "0.5",
            "--response-timeout",
            "0.5",
        ],
    )
    .await;
    let mut conn = raw_request(proxy.addr, b"GET /v1/stream HTTP/1.1\r\nhost: x\r\n\r\n").await;
    let got = read_to_close_or_reset(&mut conn).await;
    let got = match got {
        Ok(bytes) | Err(bytes) => bytes,
    };
    assert!(
        !got.ends_with(b"0\r\n\r\n"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    assert_metrics(
        &metrics,
        &[
            "bypass_marker_upstream_idle_timeouts_total 1\n",
            "bypass_marker_upstream_errors_total{kind=\"body\"} 1\n",
        ],
    );
}

/// `--response-timeout` starts once the request is sent: an upload slower than it in total, but
/// steady, is answered (it once got a 504 mid-upload), whether its length is known or not.
#[tokio::test]
async fn a_slow_steady_upload_is_not_cut_by_the_response_timeout() {
    let upstream = scripted_upstream(|mut conn, head| async move {
        let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
        // The body, to its end: by its length, or to its last chunk.
        let mut body = Vec::new();
        let mut buf = vec![0u8; 64 << 10];
        let len = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .map(|n| n.trim().parse::<usize>().unwrap());
        loop {
            let done = match len {
                Some(len) => body.len() >= len,
                None => body.ends_with(b"\r\n0\r\n\r\n"),
            };
            if done {
                break;
            }
            let n = conn.read(&mut buf).await.unwrap();
            assert!(n > 0);
            body.extend_from_slice(&buf[..n]);
        }
        let reply = format!(
            "HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{}",
            body.len().to_string().len(),
            body.len()
        );
        conn.write_all(reply.as_bytes()).await.unwrap();
        let _ = read_until_closed(&mut conn).await;
    })
    .await;
    let proxy = start_proxy(&format!("http://{upstream}"), &["--response-timeout", "1"]).await;
    for framing in ["content-length: 20000", "transfer-encoding: chunked"] {
        let head = format!(
            "POST /upload HTTP/1.1\r\nhost: x\r\ncontent-type: application/octet-stream\r\n\
             {framing}\r\n\r\n"
        );
        let mut conn = raw_request(proxy.addr, head.as_bytes()).await;
        // 20 pieces of 1,000 bytes, one every 100 ms: 2 s in all, never a pause of 1 s.
        for _ in 0..20 {
            let piece = [b'x'; 1000];
            if framing.starts_with("transfer") {
                conn.write_all(b"3e8\r\n").await.unwrap();
                conn.write_all(&piece).await.unwrap();
                conn.write_all(b"\r\n").await.unwrap();
            } else {
                conn.write_all(&piece).await.unwrap();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if framing.starts_with("transfer") {
            conn.write_all(b"0\r\n\r\n").await.unwrap();
        }
        let mut got = Vec::new();
        let mut buf = vec![0u8; 4096];
        tokio::time::timeout(PATIENCE, async {
            while !got.windows(4).any(|w| w == b"\r\n\r\n") || got.len() < 10 {
                let n = conn.read(&mut buf).await.unwrap();
                assert!(n > 0, "{}", String::from_utf8_lossy(&got));
                got.extend_from_slice(&buf[..n]);
                if got.starts_with(b"HTTP/1.1 504") {
                    break;
                }
            }
        })
        .await
        .expect("an answer");
        let text = String::from_utf8_lossy(&got);
        assert!(text.starts_with("HTTP/1.1 200"), "{framing}: {text}");
    }
}

/// A request body that fails on the client's side (malformed `chunked` framing) while it is
/// forwarded is the client's failure: a 400, counted apart, not an upstream error.
#[tokio::test]
async fn a_malformed_request_body_is_a_400_and_no_upstream_error() {
    let upstream = scripted_upstream(|mut conn, _| async move {
        // Reads what comes and never answers.
        let _ = read_until_closed(&mut conn).await;
    })
    .await;
    let (proxy, metrics) = start_metered(&format!("http://{upstream}"), &[]).await;
    let mut conn = raw_request(
        proxy.addr,
        b"POST /upload HTTP/1.1\r\nhost: x\r\ncontent-type: application/octet-stream\r\n\
          transfer-encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n",
    )
    .await;
    let got = match read_to_close_or_reset(&mut conn).await {
        Ok(bytes) | Err(bytes) => bytes,
    };
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 400"), "{text}");
    assert!(text.contains("invalid_request_body"), "{text}");
    assert_metrics(
        &metrics,
        &[
            "bypass_marker_upstream_errors_total{kind=\"head\"} 0\n",
            "bypass_marker_request_body_errors_total 1\n",
        ],
    );
}

/// Issue 28, item 11: under `--max-buffered-bytes`, a JSON body whose declared length does not
/// fit gets a 503 with `Retry-After` before a byte of it is sent; a chunked one as soon as the
/// bytes received pass the budget; the bytes are given back once a body has been forwarded (or
/// refused), so the same large request succeeds again and again, one at a time; the refusals
/// are counted.
#[tokio::test]
async fn request_bodies_past_the_buffered_bytes_budget_get_a_503_before_they_are_read() {
    let app = axum::Router::new().route("/v1/echo", axum::routing::post(echo));
    let upstream = serve_upstream(app).await;
    // 1 MiB: large bodies may take 896 KiB of it.
    let (proxy, metrics) = start_metered(
        &format!("http://{upstream}"),
        &["--max-buffered-bytes", "1048576"],
    )
    .await;
    let json = |len: usize| {
        let mut body = b"{\"a\":\"".to_vec();
        body.resize(len - 2, b'x');
        body.extend_from_slice(b"\"}");
        body
    };
    // Declared and too large: answered before the body is sent.
    let head = b"POST /v1/echo HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
                 content-length: 1000000\r\n\r\n";
    let answer = raw_exchange(proxy.addr, head).await;
    let (head, body) = split_head(&answer);
    assert!(head.starts_with("HTTP/1.1 503"), "{head}");
    assert!(head.contains("retry-after: 1"), "{head}");
    assert!(head.contains("connection: close"), "{head}");
    assert_eq!(
        error_json(body)["error"]["code"],
        "request_bodies_over_budget"
    );
    // Chunked, of unknown length: refused once more than 896 KiB have arrived.
    let mut conn = raw_request(
        proxy.addr,
        b"POST /v1/echo HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
          transfer-encoding: chunked\r\n\r\n",
    )
    .await;
    let large = json(1_000_000);
    for piece in large.chunks(100_000) {
        let chunk = [format!("{:x}\r\n", piece.len()).as_bytes(), piece, b"\r\n"].concat();
        if conn.write_all(&chunk).await.is_err() {
            break;
        }
    }
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(PATIENCE, conn.read_to_end(&mut answer)).await;
    let (head, _) = split_head(&answer);
    assert!(head.starts_with("HTTP/1.1 503"), "{head}");
    assert!(head.contains("retry-after: 1"), "{head}");
    // A body that fits is forwarded, and its bytes given back: again and again.
    for _ in 0..3 {
        let req = http::Request::post(proxy.url("/v1/echo"))
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(json(800_000))))
            .unwrap();
        let reply = send(req).await.unwrap();
        assert_eq!(reply.status, StatusCode::OK);
    }
    assert_metrics(
        &metrics,
        &[
            "bypass_marker_requests_refused_total{status=\"503\"} 2\n",
            "bypass_marker_request_bytes_held 0\n",
            "bypass_marker_request_bytes_budget 1048576\n",
        ],
    );
}

/// The default budget follows the cgroup's memory limit: half of cgroup v2's `memory.max` (the
/// smallest of the cgroup's and its ancestors'), or of v1's `memory.limit_in_bytes`; a fixed
/// 1 GiB with no limit ("max", or v1's figure for none).
#[test]
fn the_default_buffered_bytes_budget_is_half_the_cgroup_memory_limit() {
    use proxy::args::{cgroup_limit_in, default_max_buffered_bytes};
    let root = std::env::temp_dir().join(format!("bypass-marker-cgroup-{}", std::process::id()));
    let write = |path: &str, text: &str| {
        let path = root.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    };
    write("memory.max", "max\n");
    write("kubepods/memory.max", "536870912\n");
    write("kubepods/pod1/memory.max", "max\n");
    assert_eq!(
        cgroup_limit_in(&root, "0::/kubepods/pod1\n"),
        Some(512 << 20)
    );
    assert_eq!(cgroup_limit_in(&root, "0::/\n"), None);
    write("memory/memory.limit_in_bytes", "9223372036854771712\n");
    write("memory/docker/memory.limit_in_bytes", "268435456\n");
    assert_eq!(
        cgroup_limit_in(&root, "12:cpu,cpuacct:/docker\n11:memory:/docker\n"),
        Some(256 << 20)
    );
    assert_eq!(cgroup_limit_in(&root, "11:memory:/\n"), None);
    assert_eq!(default_max_buffered_bytes(Some(256 << 20)), 128 << 20);
    assert_eq!(default_max_buffered_bytes(None), 1 << 30);
    std::fs::remove_dir_all(&root).unwrap();
}

/// The kernel's TCP states (`/proc/net/tcp`, hex) of the sockets from `local` to `remote`.
fn tcp_states(local: SocketAddr, remote: SocketAddr) -> Vec<String> {
    let hex = |addr: SocketAddr| match addr {
        SocketAddr::V4(v4) => format!(
            "{:08X}:{:04X}",
            u32::from_le_bytes(v4.ip().octets()),
            v4.port()
        ),
        SocketAddr::V6(_) => unreachable!("IPv4 only"),
    };
    let (local, remote) = (hex(local), hex(remote));
    std::fs::read_to_string("/proc/net/tcp")
        .unwrap()
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            (fields[1] == local && fields[2] == remote).then(|| fields[3].to_owned())
        })
        .collect()
}

/// Issue 28, item 10: a client cut off by `--write-timeout` is reset (`SO_LINGER` 0, as nginx's
/// `reset_timedout_connection`): the proxy's socket is gone at once, with the send buffer the
/// client never read, and the client's read ends in `ECONNRESET`. Before, the proxy closed with
/// a FIN that waited in FIN-WAIT-1 behind about 2.8 MB of unread bytes (40 stalled clients held
/// 100+ MB of kernel memory) and the client, had it read on, would have seen a clean end.
#[tokio::test]
async fn a_write_timed_out_client_is_reset_and_its_send_buffer_freed_at_once() {
    let StalledClient {
        proxy,
        metrics,
        mut conn,
        dropped,
    } = StalledClient::start().await;
    let client = conn.local_addr().unwrap();
    until_dropped(dropped, "the upstream request is cancelled").await;
    assert_metrics(&metrics, &["bypass_marker_write_timeouts_total 1\n"]);
    // The proxy's side is gone, not in FIN-WAIT-1 (04) with its send buffer full.
    tokio::time::timeout(PATIENCE, async {
        while !tcp_states(proxy.addr, client).is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| {
        panic!(
            "the proxy's socket is still there: states {:?}",
            tcp_states(proxy.addr, client)
        )
    });
    // The client sees a reset, never a clean end.
    let (_, end) = read_to_end_or_error(&mut conn).await;
    let err = end.expect_err("a reset, not a clean end");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
}

/// Serves `args` on one thread of its own, as the binary does (`serve_threads`, where
/// `--read-coalesce` applies), in front of `upstream`; returns its address, its metrics and the
/// sender that stops it.
async fn start_threaded(
    upstream: SocketAddr,
    args: &[&str],
) -> (SocketAddr, Arc<proxy::Metrics>, oneshot::Sender<()>) {
    let config = proxy_args(&format!("http://{upstream}"), args);
    let metrics = proxy::proxy::metrics_for(&config).unwrap();
    let listeners = proxy::bind_each(config.listen, config.backlog, 1).unwrap();
    let addr = listeners[0].local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let stopped = Arc::new(tokio::sync::Mutex::new(Some(stopped)));
    tokio::spawn(proxy::serve_threads(
        listeners,
        config,
        metrics.clone(),
        move || {
            let stopped = stopped.clone();
            async move {
                if let Some(stopped) = stopped.lock().await.take() {
                    let _ = stopped.await;
                }
            }
        },
    ));
    (addr, metrics, stop)
}

/// An upstream that answers every request with `events` SSE events of its own chunk each:
/// all in one write (`gap` zero: it writes faster than anyone reads), or each in a write of its
/// own, `gap` apart.
async fn chunked_events_upstream(events: usize, gap: Duration) -> SocketAddr {
    scripted_upstream(move |mut conn, _| async move {
        let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                    transfer-encoding: chunked\r\n\r\n";
        conn.write_all(head.as_bytes()).await.unwrap();
        let mut out = Vec::new();
        for i in 0..events {
            let event = format!("data: {i}\n\n");
            out.extend_from_slice(format!("{:x}\r\n{event}\r\n", event.len()).as_bytes());
            if !gap.is_zero() {
                tokio::time::sleep(gap).await;
                conn.write_all(&out).await.unwrap();
                out.clear();
            }
        }
        if !gap.is_zero() {
            tokio::time::sleep(gap).await;
        }
        out.extend_from_slice(b"0\r\n\r\n");
        conn.write_all(&out).await.unwrap();
    })
    .await
}

/// `bypass_marker_read_coalesce_waits_total` once the proxy's thread has had the time to go to
/// sleep after the response (it waits, if it does, only then): at once when it is at least
/// `expected`, else after a quarter of a second.
async fn coalesce_waits(metrics: &proxy::Metrics, expected: u64) -> u64 {
    let read = || {
        let text = metrics.encode();
        text.lines()
            .find_map(|l| {
                l.strip_prefix("bypass_marker_read_coalesce_waits_total{front_door=\"sidecar\"} ")
            })
            .unwrap_or_else(|| panic!("no read_coalesce_waits_total in {text}"))
            .parse::<u64>()
            .unwrap()
    };
    let until = Instant::now() + Duration::from_millis(250);
    while read() < expected.max(1) && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    read()
}

/// `--read-coalesce`: a serving thread waits before it sleeps only after a read found an
/// upstream writing faster than it was read (several chunks in a read that emptied the socket);
/// a stream whose events each come alone never makes it wait, and `0` turns the wait off. Every
/// stream arrives whole either way.
#[tokio::test]
async fn a_thread_waits_to_coalesce_reads_only_after_an_upstream_outran_it() {
    let burst = chunked_events_upstream(200, Duration::ZERO).await;
    let paced = chunked_events_upstream(4, Duration::from_millis(50)).await;
    for (what, upstream, events, coalesce, waits) in [
        ("paced events", paced, 4, "50", false),
        ("a burst", burst, 200, "50", true),
        ("a burst with --read-coalesce 0", burst, 200, "0", false),
    ] {
        let (addr, metrics, _stop) = start_threaded(upstream, &["--read-coalesce", coalesce]).await;
        let url = format!("http://{addr}/v1/stream");
        let reply = get(url).await;
        assert_eq!(reply.body, events_text(events).as_bytes(), "{what}");
        let counted = coalesce_waits(&metrics, u64::from(waits)).await;
        assert_eq!(counted > 0, waits, "{what}: {counted} waits");
    }
}
