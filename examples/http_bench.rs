//! End-to-end throughput over HTTP/1.1 on 127.0.0.1: a hyper server streams at least 256 MiB of
//! OpenAI chat-completion SSE (Dynamo's marker first) to a hyper client, through
//! `BypassMarkerLayer` and without it, in one run.
//!
//! ```text
//! cargo run --release --example http_bench [-- [--mib N] [--rounds N]]
//! ```
//!
//! Two servers run side by side, one with the layer and one without; each round (7 by default)
//! the client downloads the stream once from each, the order alternating between rounds, and reads
//! the body to its end. Two chunk shapes: one event per body chunk (how an LLM server writes
//! tokens) and sixteen events per chunk. The table shows median MiB/s, the median over rounds of
//! the per-round ratio layer / no layer, and the server thread's CPU time per GiB sent (read from
//! `/proc/thread-self/schedstat`), which a machine shared with other work disturbs less than
//! wall-clock throughput. Everything is bounded: each server accepts as many connections as the
//! client will make, every transfer has a time limit, and the process exits when the rounds are
//! done.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, Request, Response};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Empty, StreamBody};
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tower::{service_fn, Layer};
use tower_bypass_marker::BypassMarkerLayer;

const MARKER: &[u8] = b"event: x-bypass-remote-prefill\n: true\n\n";
const MIB: u64 = 1024 * 1024;
const TRANSFER_LIMIT: Duration = Duration::from_secs(120);

/// One cycle of chat events, cut into chunks of `per_chunk` events, sharing one buffer (like the
/// `Bytes` an application hands to hyper).
fn event_chunks(per_chunk: usize) -> Arc<[Bytes]> {
    let events: Vec<String> = (0..4096u32)
        .map(|i| {
            let words = ["the", "model", "streams", "tokens", "to", "each", "client"];
            let content: Vec<&str> = (0..8 + i % 24).map(|k| words[((i + k) % 7) as usize]).collect();
            format!(
                "data: {{\"id\":\"chatcmpl-{i:08x}\",\"object\":\"chat.completion.chunk\",\"model\":\"llama-3.1-8b\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{}\"}},\"finish_reason\":null}}]}}\n\n",
                content.join(" ")
            )
        })
        .collect();
    let all = Bytes::from(events.concat());
    let mut at = 0;
    events
        .chunks(per_chunk)
        .map(|group| {
            let len: usize = group.iter().map(String::len).sum();
            let chunk = all.slice(at..at + len);
            at += len;
            chunk
        })
        .collect()
}

/// The response body: the marker, then the event chunks over and over until `remaining` is spent
/// (the chunk that crosses it is sent whole), one chunk per poll, always ready.
fn event_stream(
    chunks: Arc<[Bytes]>,
    mut remaining: u64,
) -> impl Body<Data = Bytes, Error = Infallible> {
    let events = (0..)
        .map(move |i| chunks[i % chunks.len()].clone())
        .take_while(move |chunk| {
            let more = remaining > 0;
            remaining = remaining.saturating_sub(chunk.len() as u64);
            more
        });
    let all = std::iter::once(Bytes::from_static(MARKER)).chain(events);
    StreamBody::new(futures_util::stream::iter(
        all.map(|chunk| Ok::<_, Infallible>(Frame::data(chunk))),
    ))
}

/// The payload after the marker, in bytes, for a stream of at least `min` bytes.
fn payload_len(chunks: &[Bytes], min: u64) -> u64 {
    let mut total = 0;
    let mut i = 0;
    while total < min {
        total += chunks[i % chunks.len()].len() as u64;
        i += 1;
    }
    total
}

/// CPU time the calling thread has used, in nanoseconds (Linux; `None` elsewhere).
fn thread_cpu_ns() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    stat.split_whitespace().next()?.parse().ok()
}

/// Serves `connections` connections on `listener`, one after the other, then returns. Sends the
/// server thread's CPU time for each connection on `cpu`.
async fn serve(
    listener: TcpListener,
    with_layer: bool,
    min_bytes: u64,
    connections: usize,
    cpu: UnboundedSender<Option<u64>>,
) {
    let one = event_chunks(1);
    let sixteen = event_chunks(16);
    let upstream = service_fn(move |req: Request<hyper::body::Incoming>| {
        let chunks = if req.uri().path() == "/16" {
            sixteen.clone()
        } else {
            one.clone()
        };
        let body = event_stream(chunks, min_bytes);
        let res = Response::builder()
            .header(header::CONTENT_TYPE, "text/event-stream")
            .body(body)
            .expect("valid response");
        std::future::ready(Ok::<_, Infallible>(res))
    });
    let layered = BypassMarkerLayer::new().layer(upstream.clone());
    for _ in 0..connections {
        let Ok(Ok((stream, _))) = tokio::time::timeout(TRANSFER_LIMIT, listener.accept()).await
        else {
            eprintln!("server: no connection within {TRANSFER_LIMIT:?}; stopping");
            return;
        };
        stream.set_nodelay(true).expect("nodelay");
        let io = TokioIo::new(stream);
        let http = hyper::server::conn::http1::Builder::new();
        // The client makes one transfer at a time, so each server serves one connection at a time,
        // and the server thread's CPU time over it is that transfer's.
        let cpu_before = thread_cpu_ns();
        let served = if with_layer {
            let svc = TowerToHyperService::new(layered.clone());
            tokio::time::timeout(TRANSFER_LIMIT, http.serve_connection(io, svc)).await
        } else {
            let svc = TowerToHyperService::new(upstream.clone());
            tokio::time::timeout(TRANSFER_LIMIT, http.serve_connection(io, svc)).await
        };
        if let Err(err) = served
            .map_err(|e| e.to_string())
            .and_then(|r| r.map_err(|e| e.to_string()))
        {
            eprintln!("server: connection failed: {err}");
        }
        let used = cpu_before.zip(thread_cpu_ns()).map(|(a, b)| b - a);
        let _ = cpu.send(used);
    }
}

/// Downloads `path` from `addr` and returns the body's bytes and the seconds it took, checking that
/// the marker is there (or not) as it should be.
async fn download(addr: SocketAddr, path: &str, expect_marker: bool) -> (u64, f64) {
    let stream = TcpStream::connect(addr).await.expect("connect");
    stream.set_nodelay(true).expect("nodelay");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let req = Request::get(path)
        .header(header::HOST, "127.0.0.1")
        .body(Empty::<Bytes>::new())
        .expect("valid request");
    let start = Instant::now();
    let res = sender.send_request(req).await.expect("response");
    assert_eq!(res.status(), 200);
    let mut body = res.into_body();
    let mut bytes = 0u64;
    let mut head = Vec::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.expect("body").into_data() {
            if head.len() < MARKER.len() {
                let take = (MARKER.len() - head.len()).min(data.len());
                head.extend_from_slice(&data[..take]);
            }
            bytes += data.len() as u64;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(
        head == MARKER,
        expect_marker,
        "marker present: {}, expected {expect_marker}",
        head == MARKER
    );
    (bytes, secs)
}

fn main() {
    let mut mib = 256u64;
    let mut rounds = 7usize;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let value = args.next().and_then(|v| v.parse::<u64>().ok());
        match (arg.as_str(), value) {
            ("--mib", Some(v)) if v > 0 => mib = v,
            ("--rounds", Some(v)) if v > 0 => rounds = v as usize,
            _ => panic!("usage: http_bench [--mib N] [--rounds N]"),
        }
    }
    // The servers and the client each get a thread and a single-threaded runtime: hyper hands each
    // received chunk from the connection task to the body reader, which is cheap on one thread and
    // a futex round trip per chunk across threads.
    let runtime = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    };
    let shapes = [
        ("/1", "1 event per chunk", 1),
        ("/16", "16 events per chunk", 16),
    ];
    let min_bytes = mib * MIB;
    let connections = shapes.len() * rounds;
    let (with, without) = runtime().block_on(async {
        let with = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let without = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        (with.into_std().unwrap(), without.into_std().unwrap())
    });
    let addrs = (with.local_addr().unwrap(), without.local_addr().unwrap());
    let (cpu_tx, cpu_rx) = unbounded_channel();
    let servers = std::thread::spawn(move || {
        runtime().block_on(async move {
            let with = TcpListener::from_std(with).expect("listener");
            let without = TcpListener::from_std(without).expect("listener");
            tokio::join!(
                serve(with, true, min_bytes, connections, cpu_tx.clone()),
                serve(without, false, min_bytes, connections, cpu_tx)
            );
        })
    });
    runtime().block_on(run(&shapes, addrs, min_bytes, rounds, cpu_rx));
    servers.join().expect("server thread");
}

async fn run(
    shapes: &[(&str, &str, usize)],
    (with_addr, without_addr): (SocketAddr, SocketAddr),
    min_bytes: u64,
    rounds: usize,
    mut server_cpu: UnboundedReceiver<Option<u64>>,
) {
    println!(
        "{} MiB of SSE per transfer (marker first), {rounds} rounds, HTTP/1.1 over 127.0.0.1\n",
        min_bytes / MIB
    );
    println!(
        "| chunks | with layer MiB/s | without MiB/s | layer / without (min-max) \
         | server CPU ms/GiB with | without | CPU with / without (min-max) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for &(path, shape, per_chunk) in shapes {
        let payload = payload_len(&event_chunks(per_chunk), min_bytes);
        // Per variant (0: with the layer, 1: without): MiB/s and server CPU ms per GiB, per round.
        let mut speed: [Vec<f64>; 2] = Default::default();
        let mut cpu: [Vec<f64>; 2] = Default::default();
        for round in 0..rounds {
            for k in 0..2 {
                let layered = (k + round) % 2 == 0;
                let (addr, expected) = if layered {
                    (with_addr, payload)
                } else {
                    (without_addr, payload + MARKER.len() as u64)
                };
                let transfer = download(addr, path, !layered);
                let (bytes, secs) = tokio::time::timeout(TRANSFER_LIMIT, transfer)
                    .await
                    .expect("transfer within the time limit");
                assert_eq!(bytes, expected, "{shape}: body length");
                let used = tokio::time::timeout(TRANSFER_LIMIT, server_cpu.recv())
                    .await
                    .expect("the server finishes the connection")
                    .expect("server running");
                let v = usize::from(!layered);
                speed[v].push(bytes as f64 / secs / MIB as f64);
                if let Some(ns) = used {
                    cpu[v].push(ns as f64 / 1e6 / (bytes as f64 / (1024.0 * MIB as f64)));
                }
            }
        }
        let ratios =
            |a: &[f64], b: &[f64]| -> Vec<f64> { a.iter().zip(b).map(|(a, b)| a / b).collect() };
        let speed_ratio = Summary::of(ratios(&speed[0], &speed[1]));
        let cpu_ratio = Summary::of(ratios(&cpu[0], &cpu[1]));
        let [with, without] = speed.map(|s| Summary::of(s).median);
        let [cpu_with, cpu_without] = cpu.map(|c| Summary::of(c).median);
        println!(
            "| {shape} | {with:.0} | {without:.0} | {speed_ratio} | {cpu_with:.0} | {cpu_without:.0} \
             | {cpu_ratio} |"
        );
    }
}

/// The median, lowest and highest of some per-round figures.
struct Summary {
    median: f64,
    low: f64,
    high: f64,
}

impl Summary {
    fn of(mut values: Vec<f64>) -> Self {
        if values.is_empty() {
            return Self {
                median: f64::NAN,
                low: f64::NAN,
                high: f64::NAN,
            };
        }
        values.sort_by(f64::total_cmp);
        let n = values.len();
        let median = if n % 2 == 1 {
            values[n / 2]
        } else {
            (values[n / 2 - 1] + values[n / 2]) / 2.0
        };
        Self {
            median,
            low: values[0],
            high: values[n - 1],
        }
    }
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:.3} ({:.3}-{:.3})", self.median, self.low, self.high)
    }
}
