//! What the sidecar (`bypass-marker proxy`, `bypass_marker`) costs, over loopback, with the layer and the guard
//! against `--no-layer` (forwarding untouched), measured in one run:
//!
//! ```text
//! cargo run --release -p bypass-marker --example proxy_bench
//! ```
//!
//! Three threads, each with its own single-threaded tokio runtime: an upstream that streams
//! OpenAI `chat.completion.chunk` events, the proxy (the library code the binary runs), and the
//! clients. The proxy's own CPU time is read on its thread (`CLOCK_THREAD_CPUTIME_ID`), so its
//! cost per event or per request does not depend on what the other two threads do.
//!
//! - **Throughput**: 32 concurrent streams of small events (about 150 bytes) sent by the upstream
//!   as fast as it can, one event per chunk. Rounds alternate the order of the two proxies; the
//!   figures are the median over rounds of events per second, and the ratio layer / no-layer is
//!   taken within each round.
//! - **Latency per event**: 16 streams, one event per millisecond each; every event carries the
//!   instant the upstream wrote it, and the client records when the event was complete. Direct to
//!   the upstream, and through each proxy, in rounds that rotate the order; the proxy adds the
//!   difference of the percentiles. The proxy's CPU time per paced event is reported too.
//! - **Guard cost per request**: non-streamed `POST /v1/chat/completions` with a JSON body (a
//!   2 KiB chat request and a 256 KiB one), 8 at a time; the proxy's CPU time per request with
//!   the guard and without.
//!
//! `--rounds N` (default 5) sets the number of throughput rounds. With 10 rounds or more, the
//! median ratio comes with a 95% confidence interval for the median (distribution-free: from the
//! order statistics of the rounds' ratios). `--throughput-only` stops after the throughput rounds.
//!
//! `--variants` measures streamed throughput only, through four proxies in one run: `--no-layer`,
//! the response layer only, the guard only, and both (the proxy as shipped). Every round runs
//! each once, in an order that rotates and reverses every other round; the ratios to `--no-layer`
//! are taken within the round, and the medians over rounds are printed, with the proxy's CPU time
//! per event and, per event, the data frames the client got, the proxy's read and write system
//! calls (`/proc/thread-self/io`: `read`/`write`/`writev`, not `recv`/`send`), its voluntary
//! context switches, and its CPU time in user space (`getrusage(RUSAGE_THREAD)`).
//!
//! `--pin` runs the proxies on CPU 1 and the upstream and the clients on CPU 0.
//!
//! `--events N` sets the events per stream of the throughput runs, in both modes (default 5,000).

use bypass_marker as proxy;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::Query;
use axum::response::IntoResponse;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::sync::{mpsc, oneshot};
use tower::ServiceBuilder;

/// One streamed chat token, as an OpenAI-compatible server sends it.
const EVENT: &[u8] = b"data: {\"id\":\"chatcmpl-8b1e2f\",\"object\":\"chat.completion.chunk\",\"created\":1764500000,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" token\"},\"finish_reason\":null}]}\n\n";

const THROUGHPUT_STREAMS: usize = 32;
const THROUGHPUT_EVENTS: usize = 5_000;
const LATENCY_STREAMS: usize = 16;
const LATENCY_EVENTS: usize = 400;
const GUARD_REQUESTS: usize = 2_000;
const GUARD_CONCURRENCY: usize = 8;

/// The instant the benchmark started: events carry their time since it.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// CPU time of the calling thread. (test-support has this too; the sidecar's package takes nothing
/// from it outside its tests, as test-support is built on the sidecar.)
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the struct we pass, nothing else.
    #[allow(unsafe_code)]
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0);
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// What the calling thread has done so far: read and write system calls (`/proc/thread-self/io`),
/// voluntary context switches (`/proc/thread-self/status`) and microseconds of CPU time in user
/// space (`getrusage(RUSAGE_THREAD)`), in that order.
fn thread_counts() -> [u64; 4] {
    let mut out = [0; 4];
    // SAFETY: getrusage writes the struct we pass, nothing else.
    #[allow(unsafe_code)]
    unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_THREAD, &mut usage) == 0 {
            out[3] = usage.ru_utime.tv_sec as u64 * 1_000_000 + usage.ru_utime.tv_usec as u64;
        }
    }
    let io = std::fs::read_to_string("/proc/thread-self/io").unwrap_or_default();
    let status = std::fs::read_to_string("/proc/thread-self/status").unwrap_or_default();
    for line in io.lines().chain(status.lines()) {
        let slot = match line.split(':').next() {
            Some("syscr") => 0,
            Some("syscw") => 1,
            Some("voluntary_ctxt_switches") => 2,
            _ => continue,
        };
        out[slot] = line
            .split(':')
            .nth(1)
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
    }
    out
}

/// `--pin`: the proxies run on CPU 1, the upstream and the clients on CPU 0.
static PIN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Pins the calling thread to `cpu` when `--pin` was given.
fn pin(cpu: usize) {
    if !PIN.load(std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    // SAFETY: the set is a plain bit mask, initialised before use; only this thread is changed.
    #[allow(unsafe_code)]
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        let rc = libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
        assert_eq!(rc, 0, "sched_setaffinity to CPU {cpu}");
    }
}

/// A server on its own thread and single-threaded runtime.
struct Served {
    addr: SocketAddr,
    cpu: mpsc::UnboundedSender<oneshot::Sender<(Duration, [u64; 4])>>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Served {
    /// Starts `serve(listener, stop)` on a new thread.
    fn start<F, Fut>(name: &str, serve: F) -> Self
    where
        F: FnOnce(tokio::net::TcpListener, oneshot::Receiver<()>) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()>,
    {
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (cpu, mut cpu_rx) = mpsc::unbounded_channel::<oneshot::Sender<(Duration, [u64; 4])>>();
        let (stop, stopped) = oneshot::channel();
        let name_owned = name.to_owned();
        let thread = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                pin(if name_owned.starts_with("proxy") {
                    1
                } else {
                    0
                });
                on_this_thread(async move {
                    let listener = proxy::bind("127.0.0.1:0".parse().unwrap(), 4096).unwrap();
                    addr_tx.send(listener.local_addr().unwrap()).unwrap();
                    // Answers with this thread's CPU time.
                    tokio::spawn(async move {
                        while let Some(reply) = cpu_rx.recv().await {
                            let _ = reply.send((thread_cpu(), thread_counts()));
                        }
                    });
                    serve(listener, stopped).await;
                });
            })
            .unwrap();
        Self {
            addr: addr_rx.recv().unwrap(),
            cpu,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    async fn cpu(&self) -> Duration {
        self.counts().await.0
    }

    /// CPU time and [`thread_counts`] of the server's thread.
    async fn counts(&self) -> (Duration, [u64; 4]) {
        let (tx, rx) = oneshot::channel();
        self.cpu.send(tx).unwrap();
        rx.await.unwrap()
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[derive(serde::Deserialize)]
struct StreamQuery {
    events: usize,
    /// Microseconds between events; 0 sends them as fast as the connection takes them.
    pace_us: u64,
}

/// `events` chat events, one per chunk; paced ones carry the microsecond they were written at.
async fn stream(Query(q): Query<StreamQuery>) -> impl IntoResponse {
    let body = if q.pace_us == 0 {
        let chunks = std::iter::repeat_n(Bytes::from_static(EVENT), q.events);
        Body::from_stream(futures_util::stream::iter(chunks.map(Ok::<_, Infallible>)))
    } else {
        let interval = tokio::time::interval(Duration::from_micros(q.pace_us));
        let events = q.events;
        let stream = futures_util::stream::unfold(
            (0, interval),
            move |(i, mut interval)| async move {
                if i == events {
                    return None;
                }
                interval.tick().await;
                let at = epoch().elapsed().as_micros();
                let event = format!(
                "data: {{\"t\":{at},\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\" token\"}}}}]}}\n\n"
            );
                Some((Ok::<_, Infallible>(Bytes::from(event)), (i + 1, interval)))
            },
        );
        Body::from_stream(stream)
    };
    ([(http::header::CONTENT_TYPE, "text/event-stream")], body)
}

/// A non-streamed completion, after reading the request as a real server does.
async fn completion(_request: Bytes) -> impl IntoResponse {
    (
        [(http::header::CONTENT_TYPE, "application/json")],
        r#"{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}"#,
    )
}

fn upstream() -> Served {
    Served::start("upstream", |listener, stopped| async move {
        let app = axum::Router::new()
            .route("/stream", axum::routing::get(stream))
            .route("/v1/chat/completions", axum::routing::post(completion));
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .await;
    })
}

/// The proxy's command line for `upstream`: any port on 127.0.0.1, a short shutdown grace.
fn proxy_args(upstream: SocketAddr) -> Vec<String> {
    vec![
        "--listen".to_owned(),
        "127.0.0.1:0".to_owned(),
        "--upstream".to_owned(),
        format!("http://{upstream}"),
        "--shutdown-grace".to_owned(),
        "1".to_owned(),
    ]
}

fn start_proxy(name: &str, upstream: SocketAddr, layer: bool) -> Served {
    let mut args = proxy_args(upstream);
    if !layer {
        args.push("--no-layer".to_owned());
    }
    let config = proxy::ProxyArgs::from_args(args).unwrap();
    Served::start(name, move |listener, stopped| async move {
        proxy::serve(listener, config, async {
            let _ = stopped.await;
        })
        .await
        .unwrap();
    })
}

/// The proxy with the response layer and the guard each on or off (`--variants`): `proxy::serve`
/// itself for both on (the default flags) and both off (`--no-layer`), and the two halves of
/// the stack it builds with the layer.
fn start_variant(name: &str, upstream: SocketAddr, filter: bool, guard: bool) -> Served {
    if filter == guard {
        return start_proxy(name, upstream, filter);
    }
    let config = proxy::ProxyArgs::from_args(proxy_args(upstream)).unwrap();
    Served::start(name, move |listener, stopped| async move {
        let layer = config.layer().unwrap().expect("the layer is on");
        let json_guard = layer.json_guard().max_body_bytes(config.naming.max_body);
        let metrics = proxy::proxy::metrics_for(&config).unwrap();
        let forward = proxy::Forward::new(&config, metrics.clone());
        let stopped = async {
            let _ = stopped.await;
        };
        let served = if filter {
            let stack = ServiceBuilder::new().layer(layer).service(forward);
            proxy::serve_with(listener, config, metrics, stack, stopped).await
        } else {
            let stack = ServiceBuilder::new().layer(json_guard).service(forward);
            proxy::serve_with(listener, config, metrics, stack, stopped).await
        };
        served.unwrap();
    })
}

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

/// Runs `work` to its end on a runtime of the calling thread alone: every server here and the
/// clients each run on a thread of their own, so that the CPU time read per thread is theirs.
fn on_this_thread<F: std::future::Future>(work: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
        .block_on(work)
}

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// Streams `streams` x `events` unpaced events through `target`; returns events per second and
/// the target's CPU time per event.
async fn throughput(client: &HttpClient, target: &Served, per_stream: usize) -> (f64, Duration) {
    let sample = throughput_frames(client, target, per_stream).await;
    (sample.rate, sample.cpu)
}

/// [`throughput`] with `events` per stream, also returning the data frames the client got per
/// event.
async fn throughput_frames(client: &HttpClient, target: &Served, per_stream: usize) -> Sample {
    let url = target.url(&format!("/stream?events={per_stream}&pace_us=0"));
    let (cpu, counts) = target.counts().await;
    let started = Instant::now();
    let runs = each_stream(client, &url, THROUGHPUT_STREAMS, |mut body| async move {
        let (mut bytes, mut frames) = (0, 0);
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame.expect("a body frame").into_data() {
                bytes += data.len();
                frames += 1;
            }
        }
        (bytes, frames)
    });
    let (bytes, frames) = runs
        .await
        .into_iter()
        .fold((0, 0), |(b, f), (bytes, frames)| (b + bytes, f + frames));
    let elapsed = started.elapsed();
    let (cpu_after, counts_after) = target.counts().await;
    let events = THROUGHPUT_STREAMS * per_stream;
    assert_eq!(bytes, events * EVENT.len(), "every byte arrived");
    let per_event = |i: usize| (counts_after[i] - counts[i]) as f64 / events as f64;
    Sample {
        rate: events as f64 / elapsed.as_secs_f64(),
        cpu: (cpu_after - cpu) / events as u32,
        frames: frames as f64 / events as f64,
        reads: per_event(0),
        writes: per_event(1),
        switches: per_event(2),
        user_ns: per_event(3) * 1000.0,
    }
}

/// One throughput run through a target.
#[derive(Clone, Copy, Default)]
struct Sample {
    /// Events per second.
    rate: f64,
    /// The target's CPU time per event.
    cpu: Duration,
    /// Data frames the client got per event.
    frames: f64,
    /// The target's read and write system calls, and voluntary context switches, per event.
    reads: f64,
    writes: f64,
    switches: f64,
    /// The target's CPU time in user space per event, in nanoseconds.
    user_ns: f64,
}

/// `--variants`: the proxy with no layer, the response layer only, the guard only, and both, in
/// one run; every round runs each once, in an order that rotates (and reverses every other
/// round), and the ratios to no-layer are taken within the round.
fn variants(rounds: usize, per_stream: usize) {
    epoch();
    let upstream = upstream();
    let names = ["no-layer", "layer only", "guard only", "layer+guard"];
    pin(0);
    let proxies = [
        start_variant("proxy-none", upstream.addr, false, false),
        start_variant("proxy-layer", upstream.addr, true, false),
        start_variant("proxy-guard", upstream.addr, false, true),
        start_variant("proxy-both", upstream.addr, true, true),
    ];
    on_this_thread(async {
        let client = client();
        for proxy in &proxies {
            throughput_frames(&client, proxy, per_stream).await;
        }
        println!(
            "variants: {THROUGHPUT_STREAMS} streams x {per_stream} events of {} bytes, one per chunk; {rounds} rounds",
            EVENT.len()
        );
        let n = proxies.len();
        let mut rate = vec![Vec::new(); n];
        let mut cpu = vec![Vec::new(); n];
        let mut rate_ratio = vec![Vec::new(); n];
        let mut cpu_diff = vec![Vec::new(); n];
        let mut syscalls = vec![Vec::new(); n];
        for round in 0..rounds {
            let mut order: Vec<usize> = (0..n).map(|i| (i + round) % n).collect();
            if round % 2 == 1 {
                order.reverse();
            }
            let mut got = vec![Sample::default(); n];
            for &i in &order {
                got[i] = throughput_frames(&client, &proxies[i], per_stream).await;
            }
            let line: Vec<String> = (0..n)
                .map(|i| {
                    format!(
                        "{} {:.0}/s {} ns",
                        names[i],
                        got[i].rate,
                        got[i].cpu.as_nanos()
                    )
                })
                .collect();
            println!("  round {round}: {}", line.join(", "));
            for i in 0..n {
                let c = got[i].cpu.as_nanos() as f64;
                rate[i].push(got[i].rate);
                cpu[i].push(c);
                rate_ratio[i].push(got[i].rate / got[0].rate);
                cpu_diff[i].push(c - got[0].cpu.as_nanos() as f64);
                syscalls[i].push(got[i]);
            }
        }
        println!("  medians over {rounds} rounds:");
        for i in 0..n {
            let lo = rate_ratio[i].iter().copied().fold(f64::INFINITY, f64::min);
            let hi = rate_ratio[i].iter().copied().fold(0.0, f64::max);
            let med = |f: fn(&Sample) -> f64| median(syscalls[i].iter().map(f).collect());
            println!(
                "  {:<12} {:>8.0} events/s, ratio {:.3} ({lo:.3} to {hi:.3}); proxy CPU {:>6.0} ns/event, {:+.0} ns vs no-layer (median of round differences)",
                names[i],
                median(rate[i].clone()),
                median(rate_ratio[i].clone()),
                median(cpu[i].clone()),
                median(cpu_diff[i].clone()),
            );
            println!(
                "  {:<12} per event: {:.3} frames to the client, {:.3} reads, {:.3} writes, {:.3} voluntary switches, {:.0} ns of CPU in user space",
                "",
                med(|s| s.frames),
                med(|s| s.reads),
                med(|s| s.writes),
                med(|s| s.switches),
                med(|s| s.user_ns),
            );
        }
    });
    drop(proxies);
    drop(upstream);
}

/// Paced events through `url`'s server: every event's latency in microseconds, from the upstream
/// writing it to the client having all of it.
async fn latencies(client: &HttpClient, base: &str) -> Vec<u64> {
    let url = format!("{base}/stream?events={LATENCY_EVENTS}&pace_us=1000");
    let runs = each_stream(client, &url, LATENCY_STREAMS, |mut body| async move {
        let mut held: Vec<u8> = Vec::new();
        let mut out = Vec::with_capacity(LATENCY_EVENTS);
        while let Some(frame) = body.frame().await {
            let Ok(data) = frame.expect("a body frame").into_data() else {
                continue;
            };
            let now = epoch().elapsed().as_micros() as u64;
            held.extend_from_slice(&data);
            while let Some(end) = held.windows(2).position(|w| w == b"\n\n") {
                let event = &held[..end];
                let t = event
                    .strip_prefix(b"data: {\"t\":")
                    .and_then(|rest| rest.iter().position(|&b| b == b',').map(|i| &rest[..i]))
                    .and_then(|t| std::str::from_utf8(t).ok()?.parse::<u64>().ok())
                    .expect("a timed event");
                out.push(now.saturating_sub(t));
                held.drain(..end + 2);
            }
        }
        assert_eq!(out.len(), LATENCY_EVENTS);
        out
    });
    let mut all: Vec<u64> = runs.await.into_iter().flatten().collect();
    all.sort_unstable();
    all
}

/// Opens `streams` GETs of `url` at once and has `read` read each response's body as it arrives,
/// all concurrently: what `read` made of each.
async fn each_stream<T, F>(
    client: &HttpClient,
    url: &str,
    streams: usize,
    read: impl Fn(hyper::body::Incoming) -> F,
) -> Vec<T>
where
    F: std::future::Future<Output = T>,
{
    let read = &read;
    let runs = (0..streams).map(|_| {
        let res = client.get(url.parse().unwrap());
        async move { read(res.await.expect("a response").into_body()).await }
    });
    futures_util::future::join_all(runs).await
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// A chat request body of about `size` bytes: one long user message, and an opt-in.
fn chat_request(size: usize) -> Bytes {
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(size / 45 + 1);
    let json = serde_json::json!({
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": &text[..size.saturating_sub(200)]},
        ],
        "max_tokens": 64,
        "nvext": {"annotations": ["request_id"]},
    });
    Bytes::from(json.to_string())
}

/// `GUARD_REQUESTS` non-streamed requests with `body`, `GUARD_CONCURRENCY` at a time; returns
/// requests per second and the target's CPU time per request.
async fn requests(client: &HttpClient, target: &Served, body: &Bytes) -> (f64, Duration) {
    let url = target.url("/v1/chat/completions");
    let cpu = target.cpu().await;
    let started = Instant::now();
    let workers = (0..GUARD_CONCURRENCY).map(|_| {
        let client = client.clone();
        let url = url.clone();
        let body = body.clone();
        async move {
            for _ in 0..GUARD_REQUESTS / GUARD_CONCURRENCY {
                let req = http::Request::post(&url)
                    .header(http::header::CONTENT_TYPE, "application/json")
                    .body(Full::new(body.clone()))
                    .unwrap();
                let res = client.request(req).await.expect("a response");
                assert_eq!(res.status(), 200);
                res.into_body().collect().await.unwrap();
            }
        }
    });
    futures_util::future::join_all(workers).await;
    let elapsed = started.elapsed();
    let cpu = target.cpu().await - cpu;
    (
        GUARD_REQUESTS as f64 / elapsed.as_secs_f64(),
        cpu / GUARD_REQUESTS as u32,
    )
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// A 95% confidence interval for the median of the distribution `values` were drawn from, with no
/// assumption about its shape: the order statistics `n/2 -+ 1.96 sqrt(n)/2` (the normal
/// approximation to the binomial count of values below the median). `None` under 10 values.
fn median_interval(mut values: Vec<f64>) -> Option<(f64, f64)> {
    let n = values.len();
    if n < 10 {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let half_width = 1.96 * (n as f64).sqrt() / 2.0;
    let low = (n as f64 / 2.0 - half_width).floor().max(0.0) as usize;
    let high = ((n as f64 / 2.0 + half_width).ceil() as usize).min(n - 1);
    Some((values[low], values[high]))
}

fn main() {
    let mut rounds = 5;
    let mut variant_mode = false;
    let mut throughput_only = false;
    let mut per_stream = THROUGHPUT_EVENTS;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--rounds" => {
                rounds = args
                    .next()
                    .and_then(|n| n.parse().ok())
                    .expect("--rounds N")
            }
            "--variants" => variant_mode = true,
            "--pin" => PIN.store(true, std::sync::atomic::Ordering::Relaxed),
            "--throughput-only" => throughput_only = true,
            "--events" => {
                per_stream = args
                    .next()
                    .and_then(|n| n.parse().ok())
                    .expect("--events N")
            }
            other => {
                eprintln!(
                    "usage: proxy_bench [--rounds N] [--events N] [--variants] [--pin] [--throughput-only]  (unknown argument {other:?})"
                );
                std::process::exit(2);
            }
        }
    }
    if variant_mode {
        variants(rounds, per_stream);
        return;
    }
    epoch();
    let upstream = upstream();
    let with = start_proxy("proxy-layer", upstream.addr, true);
    let without = start_proxy("proxy-no-layer", upstream.addr, false);
    on_this_thread(async {
        let client = client();
        // Warm up both proxies and their upstream connections.
        throughput(&client, &with, per_stream).await;
        throughput(&client, &without, per_stream).await;

        println!(
            "throughput: {THROUGHPUT_STREAMS} streams x {per_stream} events of {} bytes, one per chunk",
            EVENT.len()
        );
        let (mut ratios, mut rate_with, mut rate_without, mut cpu_with, mut cpu_without) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for round in 0..rounds {
            let (a, b) = if round % 2 == 0 {
                let a = throughput(&client, &with, per_stream).await;
                (a, throughput(&client, &without, per_stream).await)
            } else {
                let b = throughput(&client, &without, per_stream).await;
                (throughput(&client, &with, per_stream).await, b)
            };
            println!(
                "  round {round}: layer {:>9.0} events/s ({:>4} ns proxy CPU/event), no-layer {:>9.0} events/s ({:>4} ns/event), ratio {:.3}",
                a.0,
                a.1.as_nanos(),
                b.0,
                b.1.as_nanos(),
                a.0 / b.0
            );
            ratios.push(a.0 / b.0);
            rate_with.push(a.0);
            rate_without.push(b.0);
            cpu_with.push(a.1.as_nanos() as f64);
            cpu_without.push(b.1.as_nanos() as f64);
        }
        let (cw, cn) = (median(cpu_with), median(cpu_without));
        println!(
            "  median: layer {:.0} events/s, no-layer {:.0} events/s, ratio {:.3}{} (rounds {:.3} to {:.3}); proxy CPU per event {cw:.0} ns vs {cn:.0} ns: the layer adds {:.0} ns, {:.1}%",
            median(rate_with),
            median(rate_without),
            median(ratios.clone()),
            median_interval(ratios.clone()).map_or(String::new(), |(lo, hi)| format!(
                ", 95% confidence interval of the median {lo:.3} to {hi:.3}"
            )),
            ratios.iter().copied().fold(f64::INFINITY, f64::min),
            ratios.iter().copied().fold(0.0, f64::max),
            cw - cn,
            (cw / cn - 1.0) * 100.0
        );

        if throughput_only {
            return;
        }
        println!(
            "\nlatency per event: {LATENCY_STREAMS} streams x {LATENCY_EVENTS} events, one per ms each (microseconds)"
        );
        // Rounds rotate the order of the three targets; each target's samples are pooled.
        let (mut direct, mut through_without, mut through_with) =
            (Vec::new(), Vec::new(), Vec::new());
        let (mut paced_cpu_with, mut paced_cpu_without) = (Duration::ZERO, Duration::ZERO);
        for round in 0..rounds {
            for slot in 0..3 {
                match (round + slot) % 3 {
                    0 => direct.extend(latencies(&client, &upstream.url("")).await),
                    1 => {
                        let cpu = without.cpu().await;
                        through_without.extend(latencies(&client, &without.url("")).await);
                        paced_cpu_without += without.cpu().await - cpu;
                    }
                    _ => {
                        let cpu = with.cpu().await;
                        through_with.extend(latencies(&client, &with.url("")).await);
                        paced_cpu_with += with.cpu().await - cpu;
                    }
                }
            }
        }
        for samples in [&mut direct, &mut through_without, &mut through_with] {
            samples.sort_unstable();
        }
        let (d50, d99) = (percentile(&direct, 0.5), percentile(&direct, 0.99));
        for (name, sorted) in [
            ("direct to upstream", &direct),
            ("proxy --no-layer", &through_without),
            ("proxy with layer", &through_with),
        ] {
            let (p50, p99) = (percentile(sorted, 0.5), percentile(sorted, 0.99));
            println!(
                "  {name:<20} p50 {p50:>5} p99 {p99:>5}   added by the proxy: p50 {:>5} p99 {:>5}",
                p50 as i64 - d50 as i64,
                p99 as i64 - d99 as i64
            );
        }
        let paced_events = (rounds * LATENCY_STREAMS * LATENCY_EVENTS) as u32;
        let (pw, pn) = (
            (paced_cpu_with / paced_events).as_nanos(),
            (paced_cpu_without / paced_events).as_nanos(),
        );
        println!(
            "  proxy CPU per paced event (one event per chunk): layer {pw} ns, no-layer {pn} ns, the layer adds {} ns",
            pw as i64 - pn as i64
        );

        println!(
            "\nguard: {GUARD_REQUESTS} non-streamed chat requests, {GUARD_CONCURRENCY} at a time"
        );
        for size in [2 << 10, 256 << 10] {
            let body = chat_request(size);
            requests(&client, &with, &body).await;
            requests(&client, &without, &body).await;
            let a = requests(&client, &with, &body).await;
            let b = requests(&client, &without, &body).await;
            println!(
                "  {:>6} byte body: layer {:>6.0} req/s ({:>5.1} us proxy CPU/request), no-layer {:>6.0} req/s ({:>5.1} us/request): the guard adds {:.1} us a request, throughput ratio {:.3}",
                body.len(),
                a.0,
                a.1.as_secs_f64() * 1e6,
                b.0,
                b.1.as_secs_f64() * 1e6,
                (a.1.as_secs_f64() - b.1.as_secs_f64()) * 1e6,
                a.0 / b.0
            );
        }
    });
    drop(with);
    drop(without);
    drop(upstream);
}
