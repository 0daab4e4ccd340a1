//! Many concurrent streams through one layered server on 127.0.0.1, each compared byte for byte
//! with what its client must receive.
//!
//! 200 streams by default; `BYPASS_MARKER_LOAD_STREAMS=1000` (or any count) for the full run:
//!
//! ```text
//! BYPASS_MARKER_LOAD_STREAMS=1000 cargo test --test load -- --nocapture
//! ```
//!
//! Every stream waits at a barrier halfway through until all streams have reached it, so they are
//! all open at the same time; half of them go over HTTP/1.1 (one connection each, fewer if the
//! file-descriptor limit is low) and the rest share h2c connections, 100 streams each. The test
//! prints the process's resident memory before and after.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body as AxumBody;
use axum::extract::{Path, Request as AxumRequest, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response as AxumResponse};
use axum::routing::get;
use axum::{Extension, Router};
use bytes::Bytes;
use http::{header, Request};
use http_body_util::{BodyExt, Full};
use test_support::rng::{random_chunks, XorShift};
use test_support::serve::*;
use tokio::sync::{mpsc, Barrier};
use tokio_stream::wrappers::ReceiverStream;
use tower_bypass_marker::BypassMarkerLayer;

const DEFAULT_STREAMS: usize = 200;
const EVENTS_PER_STREAM: usize = 300;
/// h2c streams per connection. With all 500 of a 1,000-stream run on one connection, one run in
/// six here stalled: some requests never reached the server within 90 s while the streams already
/// open waited at the barrier for them (the requests had not arrived, so no response body, and so
/// not the layer, was involved).
const H2_STREAMS_PER_CONNECTION: usize = 100;

fn streams() -> usize {
    std::env::var("BYPASS_MARKER_LOAD_STREAMS")
        .ok()
        .map(|v| {
            v.parse()
                .expect("BYPASS_MARKER_LOAD_STREAMS must be a number")
        })
        .unwrap_or(DEFAULT_STREAMS)
}

/// How a stream's client asks (or does not ask) for the marker.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Client {
    /// No annotations.
    Default,
    /// Opt-in granted by middleware outside the layer, in the request extensions.
    OptInRequest,
    /// Opt-in granted by the handler, in the response extensions.
    OptInResponse,
    /// Tries to force the bypass with `x-bypass-remote-prefill:true`: stripped, not an opt-in.
    Forcing,
}

impl Client {
    fn of(id: usize) -> Self {
        match id % 4 {
            0 => Self::Default,
            1 => Self::OptInRequest,
            2 => Self::OptInResponse,
            _ => Self::Forcing,
        }
    }

    fn opted_in(self) -> bool {
        matches!(self, Self::OptInRequest | Self::OptInResponse)
    }
}

/// Stream `id`: every byte the upstream sends, and the bytes without the marker frames.
fn script(id: usize) -> (String, String) {
    let mut rng = XorShift::new(id as u64 + 1);
    // Some streams use CRLF line ends throughout.
    let eol = if id % 5 == 0 { "\r\n" } else { "\n" };
    let marker = format!("event: x-bypass-remote-prefill{eol}: true{eol}{eol}");
    let (mut full, mut filtered) = (marker.clone(), String::new());
    for i in 0..EVENTS_PER_STREAM {
        let frame = match rng.below(20) {
            // The marker again, mid-stream.
            0 => {
                full.push_str(&marker);
                continue;
            }
            1 => format!(": keep-alive{eol}{eol}"),
            2 => format!("event: usage{eol}data: {{\"tokens\":{i}}}{eol}{eol}"),
            _ => format!(
                "data: {{\"id\":\"cmpl-{id}\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{i}\"}}}}]}}{eol}{eol}"
            ),
        };
        full.push_str(&frame);
        filtered.push_str(&frame);
    }
    let done = format!("data: [DONE]{eol}{eol}");
    full.push_str(&done);
    filtered.push_str(&done);
    (full, filtered)
}

/// The upstream's chunks for stream `id`: from 1 to 400 bytes, cutting frames anywhere.
fn upstream_chunks(id: usize, full: &str) -> Vec<Bytes> {
    random_chunks(!(id as u64), full.as_bytes(), 400)
}

struct Server {
    layer: BypassMarkerLayer,
    /// Every stream waits here halfway until all are open.
    halfway: Barrier,
    open: AtomicUsize,
    most_open: AtomicUsize,
    /// Which streams' handlers ran, for the report when the run does not finish.
    reached: Vec<AtomicBool>,
}

async fn stream_handler(Path(id): Path<usize>, State(server): State<Arc<Server>>) -> AxumResponse {
    server.reached[id].store(true, Ordering::SeqCst);
    let (full, _) = script(id);
    let chunks = upstream_chunks(id, &full);
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(8);
    let server2 = server.clone();
    tokio::spawn(async move {
        let open = server2.open.fetch_add(1, Ordering::SeqCst) + 1;
        server2.most_open.fetch_max(open, Ordering::SeqCst);
        let half = chunks.len() / 2;
        for (i, chunk) in chunks.into_iter().enumerate() {
            if i == half {
                server2.halfway.wait().await;
            }
            if tx.send(Ok(chunk)).await.is_err() {
                break;
            }
        }
        server2.open.fetch_sub(1, Ordering::SeqCst);
    });
    let body = AxumBody::from_stream(ReceiverStream::new(rx));
    let res = ([(header::CONTENT_TYPE, "text/event-stream")], body);
    if Client::of(id) == Client::OptInResponse {
        let mut annotations = vec!["x-bypass-remote-prefill".to_owned()];
        let granted = server.layer.guard_annotations(&mut annotations);
        (Extension(granted), res).into_response()
    } else {
        res.into_response()
    }
}

async fn opt_in_from_header(
    State(server): State<Arc<Server>>,
    mut req: AxumRequest,
    next: Next,
) -> AxumResponse {
    if let Some(v) = req.headers().get("x-nvext-annotations") {
        let mut annotations = vec![v.to_str().unwrap().to_owned()];
        let granted = server.layer.guard_annotations(&mut annotations);
        req.extensions_mut().insert(granted);
    }
    next.run(req).await
}

/// The soft limit on open files, from `/proc/self/limits`.
fn open_files_limit() -> Option<usize> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

fn kib(field: &str) -> String {
    proc_status_kib(field).map_or("n/a".to_owned(), |k| format!("{} MiB", k / 1024))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams_each_arrive_byte_for_byte() {
    let n = streams();
    let rss_before = kib("VmRSS");
    let server = Arc::new(Server {
        layer: BypassMarkerLayer::new(),
        halfway: Barrier::new(n),
        open: AtomicUsize::new(0),
        most_open: AtomicUsize::new(0),
        reached: (0..n).map(|_| AtomicBool::new(false)).collect(),
    });
    let app = Router::new()
        .route("/v1/streams/{id}", get(stream_handler))
        .layer(server.layer.clone())
        .layer(middleware::from_fn_with_state(
            server.clone(),
            opt_in_from_header,
        ))
        .with_state(server.clone());
    let addr = spawn_auto(app, u32::try_from(n).unwrap() + 16).await;

    // HTTP/1.1 takes two descriptors per stream in this process (client and server end).
    let h1_budget = open_files_limit().map_or(n / 2, |limit| limit.saturating_sub(256) / 2);
    let h1_streams = (n / 2).min(h1_budget);
    let h1 = h1_client();
    // One client (and so one h2c connection) per H2_STREAMS_PER_CONNECTION streams.
    let h2: Vec<_> = (0..(n - h1_streams).div_ceil(H2_STREAMS_PER_CONNECTION).max(1))
        .map(|_| h2_client())
        .collect();

    let started = Instant::now();
    let mut tasks = Vec::with_capacity(n);
    for id in 0..n {
        let client = if id < h1_streams {
            h1.clone()
        } else {
            h2[(id - h1_streams) / H2_STREAMS_PER_CONNECTION].clone()
        };
        tasks.push(tokio::spawn(async move {
            let mut req = Request::get(format!("http://{addr}/v1/streams/{id}"));
            match Client::of(id) {
                Client::OptInRequest => req = req.header("x-nvext-annotations", "x-bypass-remote-prefill"),
                Client::Forcing => {
                    req = req.header("x-nvext-annotations", "x-bypass-remote-prefill:true");
                }
                Client::Default | Client::OptInResponse => {}
            }
            let res = client
                .request(req.body(Full::<Bytes>::default()).unwrap())
                .await
                .map_err(|e| format!("stream {id}: request failed: {e}"))?;
            let version = res.version();
            let body = res
                .into_body()
                .collect()
                .await
                .map_err(|e| format!("stream {id}: body failed: {e}"))?
                .to_bytes();
            let (full, filtered) = script(id);
            let expected = if Client::of(id).opted_in() {
                full
            } else {
                filtered
            };
            if body != expected.as_bytes() {
                let at = body
                    .iter()
                    .zip(expected.as_bytes())
                    .position(|(a, b)| a != b)
                    .unwrap_or(body.len().min(expected.len()));
                return Err(format!(
                    "stream {id} ({:?}, {version:?}): {} bytes, expected {}; first difference at {at}",
                    Client::of(id),
                    body.len(),
                    expected.len()
                ));
            }
            Ok::<_, String>((version, body.len()))
        }));
    }

    // Generous: a debug build on two busy cores runs 1,000 streams in a few seconds.
    let deadline = Duration::from_secs(60) + Duration::from_millis(30) * n as u32;
    let results = tokio::time::timeout(deadline, async {
        let mut results = Vec::with_capacity(n);
        for task in tasks {
            results.push(task.await.unwrap());
        }
        results
    })
    .await
    .unwrap_or_else(|_| {
        let missing: Vec<_> = (0..n)
            .filter(|&id| !server.reached[id].load(Ordering::SeqCst))
            .collect();
        panic!(
            "not done in time: {} of {n} streams were open at once at most; requests that never \
             reached the handler: {missing:?} (ids below {h1_streams} use HTTP/1.1)",
            server.most_open.load(Ordering::SeqCst)
        )
    });
    let elapsed = started.elapsed();

    let mut report = String::new();
    let failures: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    for failure in failures.iter().take(5) {
        writeln!(report, "{failure}").unwrap();
    }
    assert!(
        failures.is_empty(),
        "{} of {n} streams differ:\n{report}",
        failures.len()
    );

    let ok: Vec<_> = results.into_iter().map(Result::unwrap).collect();
    let bytes: usize = ok.iter().map(|(_, len)| len).sum();
    let over_h2 = ok
        .iter()
        .filter(|(v, _)| *v == http::Version::HTTP_2)
        .count();
    assert_eq!(over_h2, n - h1_streams);
    assert_eq!(server.most_open.load(Ordering::SeqCst), n);
    println!(
        "{n} concurrent streams ({h1_streams} HTTP/1.1, {over_h2} h2c), {EVENTS_PER_STREAM} events \
         each, {:.1} MiB delivered in {elapsed:.2?}; RSS before {rss_before}, after {}, peak {}",
        bytes as f64 / (1024.0 * 1024.0),
        kib("VmRSS"),
        kib("VmHWM"),
    );
}
