//! The sidecar: a streaming reverse proxy for any OpenAI-compatible server (Dynamo, vLLM, SGLang,
//! ...) that applies [`BypassMarkerLayer`](tower_bypass_marker::BypassMarkerLayer) to the responses and the
//! request guard to the requests. `bypass-marker proxy` runs it; [`serve`] is the same code for
//! tests and embedders.
//!
//! What it does, in the order a request meets it:
//!
//! - **Accepting.** It listens with a backlog of `--backlog` (1024 by default; tokio's
//!   `TcpListener::bind` uses 128, which bursts of new connections overflow). It holds at most
//!   `--max-connections` client connections (by default half of what the open-file limit leaves
//!   the process: each may need an upstream connection too); more wait in the backlog. When the
//!   process runs out of file descriptors all the same, the accept loop backs off (10 ms,
//!   doubling to 1 s) instead of spinning or stopping, and serves again once descriptors are
//!   free.
//! - **Reading the request.** HTTP/1.1. A connection that is idle between requests is closed after
//!   `--idle-timeout` (idle from the moment its last response's last byte was written to the
//!   socket); one that has started a request head must finish it within
//!   `--header-read-timeout`; a request body that stops arriving for `--body-timeout` ends the
//!   request with a 408. A request whose `Transfer-Encoding` names a coding other than `chunked`
//!   gets a 501 (RFC 9112 section 6.1: the proxy would otherwise forward the still-encoded body as
//!   if it were plain). `CONNECT` gets a 405 and never reaches the upstream: the proxy is not a
//!   tunnel.
//! - **Hop-by-hop headers** (RFC 9110 section 7.6.1: `Connection` and every header it names,
//!   `Keep-Alive`, `Proxy-Connection`, `TE`, `Transfer-Encoding`, `Upgrade`, `Trailer`) are
//!   removed from the request *before* the guard reads it, so the guard decides on exactly the
//!   headers the upstream receives (a `Connection: content-type` cannot hide a JSON body from the
//!   guard and then show it to the upstream). `Connection` is read as bytes: a value with
//!   non-ASCII bytes still has its names removed. They are removed from responses too.
//! - **The request guard** ([`JsonGuardLayer`](tower_bypass_marker::JsonGuardLayer)). A JSON request body is
//!   read (at most `--max-body` bytes, else 413), the router-owned names are stripped from its
//!   `nvext.annotations`, and the names the client may see become its opt-in for the response
//!   layer. Other bodies stream through unread.
//! - **Forwarding.** `Host` is set to the upstream's, `accept-encoding: identity` replaces the
//!   client's (an encoded event stream could not be filtered, so the upstream is asked not to
//!   encode; the proxy does not compress for the client), and the request streams to the upstream.
//!   Connecting may take `--connect-timeout`, the response head `--response-timeout` from the
//!   request's last byte (504 when it fires), a pause in the response body
//!   `--upstream-idle-timeout` (a cut stream). An upstream that is unreachable or fails before its
//!   head gives a 502; a request body that fails on the client's side, a 400. Errors are JSON in
//!   OpenAI's shape: `{"error":{"code":..,"message":..,"param":null,"type":..}}`.
//! - **The response** streams back: each frame is written as soon as it is complete, nothing is
//!   buffered beyond the frame being read. The proxy's own HTTP/1.1 client reads the upstream's
//!   socket in the task of the client connection that streams the response, and what one read
//!   brings (one event, or the hundreds a busy upstream's writes coalesce into one TCP segment)
//!   is decoded in place and goes on as one frame, scanned once and written in one write: the
//!   cost is per read, not per event. A frame is written before the upstream's socket is read
//!   again, and the upstream is read only while hyper can take more for the client: a client
//!   that stops reading stops the reads (and `--write-timeout` ends it). Upstream connections are
//!   kept for reuse
//!   (HTTP/1.1 keep-alive, 30 s idle at most, no more idle ones than `--max-connections`); a
//!   response the client abandons closes its upstream connection, so the upstream stops
//!   generating. An upstream body that ends early or is framed wrongly ends the client's response
//!   as an error (the connection is reset without a last chunk), never as a complete one.
//! - **Threads** ([`serve_threads`], `--threads`, 1 by default): the binary serves on one
//!   single-threaded runtime per thread, each accepting from the one listener (no `SO_REUSEPORT`:
//!   the address is the process's alone) with its own upstream client and pool, so a stream and
//!   its upstream connection stay on the thread that accepted it.
//!   A client that goes away drops the upstream request, so the upstream stops generating.
//! - **Reads under load** (`--read-coalesce`, 50 µs by default): once a read of an upstream finds
//!   more than one chunk waiting (the upstream writes faster than the thread reads), the thread
//!   waits that long before it next sleeps on its sockets, so the reads after it bring many
//!   events each instead of one wake-up, read and write per event. What a read brings is still
//!   written before that upstream is read again; a thread whose reads each bring one chunk never
//!   waits. Only [`serve_threads`] waits: [`serve`] and [`serve_metered`] run on the caller's
//!   runtime.
//! - **Slow readers.** A write to a client that makes no progress for `--write-timeout` (the
//!   client stopped reading) closes its connection abortively (an RST: the kernel frees the
//!   megabytes of send buffer the client never read at once, instead of holding them behind a
//!   FIN for minutes), which cancels its upstream request.
//! - **Accounting.** Each request is counted in the [`Metrics`] and logged in one line once its
//!   response's last byte has been written to the socket, or the connection has ended
//!   ([`logs`](crate::logs)).
//! - **Stopping.** When `shutdown` completes (the binary: Ctrl-C or SIGTERM), it stops accepting,
//!   marks the [`Metrics`] as draining (`/readyz` answers 503; `/livez` stays 200), lets the
//!   requests in flight finish for up to `--shutdown-grace`, then cuts those still there
//!   (counted in `bypass_marker_shutdown_streams_cut_total` and in one `warn` line) and returns.
//! - **Probes.** `GET` or `HEAD` `/livez` and `/readyz` are answered by the proxy itself (see
//!   [`metrics::probe`](crate::metrics::probe)), never forwarded, logged or counted.
//! - **Request ids.** A request's `x-request-id` (1 to 128 visible ASCII characters) goes upstream
//!   as it came; a request without one gets a new one (32 hex digits), sent upstream and logged.
//!
//! `--no-layer` forwards everything untouched (no guard, no filter): the control for benchmarks
//! and for showing the bug.

use http_body_util::Full;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderMap};
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Either;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use pin_project_lite::pin_project;
use tokio::net::{TcpListener, TcpSocket};
use tower::{Service, ServiceBuilder, ServiceExt as _};

pub use crate::args::default_max_connections;
use crate::args::{max_connections, ProxyArgs};
use crate::budget::BodyBudget;
use crate::client::trim_ows;
use crate::conn::{
    is_connection_error, Busy, Expired, HeldBody, Releasing, StallTimeout, Watch, Watched,
};
use crate::forward::{error, remove_hop_by_hop, stalled, FromForward};
use crate::logs::{request_id, RequestLog};
use crate::metrics::{probe, removed_on_this_thread, Metrics, UpstreamError};
use crate::{Forward, UpstreamBody};
use tower_bypass_marker::json::GuardBudget;
use tower_bypass_marker::sans_io::{HeadDecision, RequestGuard};
use tower_bypass_marker::BoxError;

/// Listens on `addr` with a queue of `backlog` connections.
pub fn bind(addr: SocketAddr, backlog: u32) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    // A restarted proxy can bind while connections of the old one are in TIME_WAIT.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(backlog)
}

/// Listens on `addr` once, with a queue of `backlog` connections, and gives `n` handles to that
/// one listener, one for each serving thread of [`serve_threads`]: each thread accepts from the
/// same queue (a thread that is busy accepts less). Call it within a tokio runtime: the handles
/// come back deregistered from it, for each thread's runtime to take.
///
/// The address is this process's alone, whatever `n`: a second proxy on it fails with "address in
/// use". (One listener per thread with `SO_REUSEPORT` would let the kernel spread connections, but
/// also let any other process of the same user join the group and silently serve a share of the
/// clients: a stale instance, or one configured differently.)
pub fn bind_each(
    addr: SocketAddr,
    backlog: u32,
    n: usize,
) -> io::Result<Vec<std::net::TcpListener>> {
    let listener = bind(addr, backlog)?.into_std()?;
    let mut listeners = Vec::with_capacity(n.max(1));
    for _ in 1..n {
        listeners.push(listener.try_clone()?);
    }
    listeners.push(listener);
    Ok(listeners)
}

/// [`serve_metered`] on each of `listeners` (from [`bind_each`]), each on a thread of its own with
/// a single-threaded tokio runtime, until the future `shutdown` makes for it completes.
///
/// A connection, its requests to the upstream and the upstream connections they use (each
/// thread has its own client and pool) stay on the thread that accepted it: a frame goes from the
/// upstream's socket to the client's without waking another thread, and no task is stolen. The
/// metrics are shared. Returns when every thread has stopped, or at the first that fails.
pub async fn serve_threads<F, Fut>(
    listeners: Vec<std::net::TcpListener>,
    config: ProxyArgs,
    metrics: Arc<Metrics>,
    shutdown: F,
) -> io::Result<()>
where
    F: Fn() -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let (done, mut results) = tokio::sync::mpsc::unbounded_channel();
    let n = listeners.len();
    // The connections are shared out between the threads (at least one each).
    let total = max_connections(&config, n);
    tracing::info!("at most {total} client connections at once (--max-connections)");
    // One budget for the whole process, whatever the threads.
    let budget = budget_for(&config);
    for (i, listener) in listeners.into_iter().enumerate() {
        let (mut config, metrics, shutdown, done, budget) = (
            config.clone(),
            metrics.clone(),
            shutdown(),
            done.clone(),
            budget.clone(),
        );
        let share = total / n + usize::from(i < total % n);
        config.max_connections = std::num::NonZeroUsize::new(share.max(1));
        std::thread::Builder::new()
            .name(format!("bypass-marker-{i}"))
            .spawn(move || {
                let (wait, waits) = (config.read_coalesce, metrics.clone());
                let served = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .on_thread_park(move || {
                        if crate::client::before_park(wait) {
                            waits.read_coalesce_wait();
                        }
                    })
                    .build()
                    .and_then(|runtime| {
                        runtime.block_on(async move {
                            let listener = TcpListener::from_std(listener)?;
                            serve_budgeted(listener, config, metrics, budget, shutdown).await
                        })
                    });
                let _ = done.send(served);
            })?;
    }
    drop(done);
    for _ in 0..n {
        match results.recv().await {
            Some(Ok(())) => {}
            Some(Err(err)) => return Err(err),
            None => return Err(io::Error::other("a serving thread panicked")),
        }
    }
    Ok(())
}

/// How many times `accept` has failed for want of file descriptors or memory, in this process.
pub static ACCEPT_FAILURES: AtomicU64 = AtomicU64::new(0);

/// The metrics for `config`: a series for each of its layer's names (none with `--no-layer`).
pub fn metrics_for(config: &ProxyArgs) -> Result<Arc<Metrics>, crate::NameError> {
    let metrics = match config.layer()? {
        Some(layer) => Metrics::new(layer.names(), config.naming.sdk_safe),
        None => Metrics::new([], false),
    };
    Ok(Arc::new(metrics))
}

/// Serves `config` on `listener` until `shutdown` completes, then lets the requests in flight
/// finish for up to `config.shutdown_grace`. Counts in metrics of its own; see [`serve_metered`].
pub async fn serve<F>(listener: TcpListener, config: ProxyArgs, shutdown: F) -> io::Result<()>
where
    F: Future<Output = ()>,
{
    let metrics = metrics_for(&config).map_err(invalid_input)?;
    serve_metered(listener, config, metrics, shutdown).await
}

fn invalid_input(err: crate::NameError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, err)
}

/// [`serve`], counting in `metrics` (made by [`metrics_for`]). The request bodies the guard
/// holds share one budget of `--max-buffered-bytes` (see [`BodyBudget`]).
pub async fn serve_metered<F>(
    listener: TcpListener,
    config: ProxyArgs,
    metrics: Arc<Metrics>,
    shutdown: F,
) -> io::Result<()>
where
    F: Future<Output = ()>,
{
    let budget = budget_for(&config);
    serve_budgeted(listener, config, metrics, budget, shutdown).await
}

/// The budget of `--max-buffered-bytes` (or its default), logged.
fn budget_for(config: &ProxyArgs) -> BodyBudget {
    let naming = &config.naming;
    let budget = BodyBudget::new(naming.buffered_budget());
    if !config.no_layer {
        let why = match naming.max_buffered_bytes {
            Some(_) => "--max-buffered-bytes".to_owned(),
            None => match crate::args::cgroup_memory_limit() {
                Some(limit) => format!("half the cgroup's memory limit of {limit} bytes"),
                None => "no cgroup memory limit; --max-buffered-bytes sets it".to_owned(),
            },
        };
        tracing::info!(
            "at most {} bytes of request bodies held at once ({why})",
            budget.limit()
        );
        if budget.limit() < naming.max_body as u64 {
            tracing::warn!(
                "--max-buffered-bytes ({}) is below --max-body ({}): the largest bodies always \
                 get a 503",
                budget.limit(),
                naming.max_body
            );
        }
    }
    budget
}

/// [`serve_metered`] with the process's budget.
async fn serve_budgeted<F>(
    listener: TcpListener,
    config: ProxyArgs,
    metrics: Arc<Metrics>,
    budget: BodyBudget,
    shutdown: F,
) -> io::Result<()>
where
    F: Future<Output = ()>,
{
    let forward = Forward::new(&config, metrics.clone());
    match config.layer().map_err(invalid_input)? {
        Some(layer) => {
            let layer = layer.observe(metrics.clone());
            // The guard reads the request first; the response layer finds the opt-in it granted.
            // The bodies are charged to `budget` as the connection reads them (a declared length
            // reserved whole), so the guard's own budget is not a second cap.
            let guard = layer
                .json_guard()
                .max_body_bytes(config.naming.max_body)
                .budget(GuardBudget::unlimited());
            metrics.watch_budget(&budget);
            let budgeting = Budgeting {
                guard: guard.request_guard(),
                budget,
            };
            let stack = ServiceBuilder::new()
                .layer(guard)
                .layer(layer)
                .map_request(release_when_forwarded)
                .service(forward);
            serve_inner(listener, config, metrics, stack, Some(budgeting), shutdown).await
        }
        None => serve_inner(listener, config, metrics, forward, None, shutdown).await,
    }
}

/// The guard's decisions and the budget for the bodies it reads.
struct Budgeting {
    guard: RequestGuard,
    budget: BodyBudget,
}

/// In a request's extensions: the share of the budget its body holds.
#[derive(Clone)]
struct Hold(Arc<HeldBody>);

/// At the bottom of the stack: the request's share of the budget goes with the body that is
/// forwarded, and is given back when that body has been sent (or dropped).
fn release_when_forwarded<B>(mut req: Request<B>) -> Request<Releasing<B>> {
    let held = req.extensions_mut().remove::<Hold>().map(|hold| hold.0);
    req.map(|body| Releasing::new(body, held))
}

/// The request body every service of the proxy gets: hyper's, with the `--body-timeout`.
pub type RequestBody = StallTimeout<Incoming>;

/// The body of the proxy's responses: the service's, or the proxy's own error.
type Answer<B> = Either<B, UpstreamBody>;

/// [`serve_metered`] with the service that answers each request (`service` is cloned for each
/// one): the proxy's own stack, or another for a benchmark. The proxy strips hop-by-hop headers
/// and refuses unsupported transfer codings before `service` sees a request. Its response bodies
/// are served as they are, with no boxing, so each frame costs no more calls through a pointer
/// than the stack makes.
pub async fn serve_with<S, B, F>(
    listener: TcpListener,
    config: ProxyArgs,
    metrics: Arc<Metrics>,
    service: S,
    shutdown: F,
) -> io::Result<()>
where
    S: Service<Request<RequestBody>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    F: Future<Output = ()>,
{
    serve_inner(listener, config, metrics, service, None, shutdown).await
}

/// [`serve_with`], holding the request bodies the guard reads to `budgeting`'s budget.
async fn serve_inner<S, B, F>(
    listener: TcpListener,
    config: ProxyArgs,
    metrics: Arc<Metrics>,
    service: S,
    budgeting: Option<Budgeting>,
    shutdown: F,
) -> io::Result<()>
where
    S: Service<Request<RequestBody>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    F: Future<Output = ()>,
{
    let mut http = hyper::server::conn::http1::Builder::new();
    // The header timeout is the proxy's own (see `Watch`): hyper's also runs while a keep-alive
    // connection waits for its next request, which would cut idle connections short.
    http.header_read_timeout(None).keep_alive(true);
    // One buffer for the head and the frames ready together, written at once: copying small
    // frames is cheaper than a `writev` of three slices (chunk size, data, CRLF) for each.
    http.writev(false);
    let graceful = GracefulShutdown::new();
    let (idle, header, body, write) = (
        config.idle_timeout,
        config.header_read_timeout,
        config.body_timeout,
        config.write_timeout,
    );
    tokio::pin!(shutdown);
    let mut backoff = Duration::ZERO;
    // Past the cap, connections wait in the backlog rather than take the descriptors that
    // accepted requests need for their upstream connections.
    let cap = max_connections(&config, 1);
    let connections = Arc::new(tokio::sync::Semaphore::new(cap));
    let mut warned: Option<Instant> = None;
    let budgeting = budgeting.map(Arc::new);
    // The requests in flight on this loop: those still there when the grace runs out are cut.
    let in_flight = Arc::new(AtomicU64::new(0));
    // Sent `true` when the grace runs out: each connection still open is then ended.
    let (cut_all, cut) = tokio::sync::watch::channel(false);
    loop {
        let permit = match connections.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                if warned.is_none_or(|at| at.elapsed() >= Duration::from_secs(60)) {
                    tracing::warn!(
                        "{cap} connections open (--max-connections): new ones wait in the backlog"
                    );
                    warned = Some(Instant::now());
                }
                tokio::select! {
                    permit = connections.clone().acquire_owned() => {
                        permit.expect("the semaphore is never closed")
                    }
                    () = &mut shutdown => break,
                }
            }
        };
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        let (stream, peer) = match accepted {
            Ok((stream, peer)) => {
                backoff = Duration::ZERO;
                (stream, peer)
            }
            Err(err) if is_connection_error(&err) => continue,
            Err(err) => {
                // Out of file descriptors (EMFILE, ENFILE) or memory: the connection waits in the
                // queue. Retrying at once would spin; stopping would end the service.
                if backoff.is_zero() {
                    tracing::warn!("accept failed, backing off: {err}");
                }
                ACCEPT_FAILURES.fetch_add(1, Ordering::Relaxed);
                backoff = (backoff * 2).clamp(Duration::from_millis(10), Duration::from_secs(1));
                tokio::select! {
                    () = tokio::time::sleep(backoff) => continue,
                    () = &mut shutdown => break,
                }
            }
        };
        let _ = stream.set_nodelay(true);
        let open = ConnectionOpen::new(metrics.clone());
        let in_flight = in_flight.clone();
        let watch = Watch::new();
        let counted = metrics.clone();
        let stack = service.clone();
        let service_watch = watch.clone();
        let metrics = metrics.clone();
        let budgeting = budgeting.clone();
        let service = hyper::service::service_fn(move |mut req: Request<Incoming>| {
            let busy = service_watch.begin();
            // The probes are the proxy's own: answered here, never forwarded, logged or counted.
            if let Some(res) = probe::<Full<Bytes>>(&metrics, req.method(), req.uri().path()) {
                let res =
                    res.map(|body| Tracked::untracked(Either::Right(Either::Right(body)), busy));
                return OneOf::Probe {
                    answer: std::future::ready(Ok::<_, Infallible>(res)),
                };
            }
            let id = request_id(req.headers_mut());
            let mut exchange = RequestLog::begin(
                metrics.clone(),
                req.method().clone(),
                req.uri().clone(),
                Some(peer),
                id,
                in_flight.clone(),
            );
            // Decided on the request as the client sent it; then the hop-by-hop headers go, before
            // the guard reads any header.
            let unsupported = unsupported_transfer_coding(req.headers());
            let connect = req.method() == http::Method::CONNECT;
            remove_hop_by_hop(req.headers_mut());
            // A body the guard will hold takes its bytes from the budget; a declared length is
            // taken whole, before a byte of the body is read.
            let (held, over_budget) = match budgeting.as_deref() {
                Some(budgeting) if !connect && !unsupported => hold(budgeting, &mut req),
                _ => (None, false),
            };
            let req = req.map(|b| {
                let b = StallTimeout::new(b, body, service_watch.clone());
                match &held {
                    Some(held) => b.held(held.clone()),
                    None => b,
                }
            });
            let stack = stack.clone();
            let watch = service_watch.clone();
            let budgeting = budgeting.clone();
            OneOf::Served {
                answer: async move {
                    let res: Response<Answer<B>> = if connect {
                        method_not_allowed().map(Either::Right)
                    } else if unsupported {
                        not_implemented().map(Either::Right)
                    } else if over_budget {
                        over_budget_answer(budgeting.as_deref()).map(Either::Right)
                    } else {
                        let res = stack.oneshot(req).await?;
                        // The guard answers a body that failed with a 400; this one only stopped
                        // arriving, or did not fit in the budget.
                        if res.status() != StatusCode::BAD_REQUEST {
                            res.map(Either::Left)
                        } else if watch.stalled.load(Ordering::Acquire) {
                            stalled().map(Either::Right)
                        } else if held
                            .as_ref()
                            .is_some_and(|h| h.over_budget.load(Ordering::Acquire))
                        {
                            over_budget_answer(budgeting.as_deref()).map(Either::Right)
                        } else {
                            res.map(Either::Left)
                        }
                    };
                    drop(held);
                    let refused = res.extensions().get::<FromForward>().is_none()
                        || (res.status() == StatusCode::REQUEST_TIMEOUT
                            && watch.stalled.load(Ordering::Acquire));
                    if refused {
                        exchange.metrics().refused(res.status());
                    }
                    exchange.status(res.status());
                    Ok::<_, Infallible>(res.map(|body| Tracked::new(body, busy, exchange)))
                },
            }
        });
        let io = TokioIo::new(Watched::new(stream, watch.clone()));
        let conn = tokio::spawn(graceful.watch(http.serve_connection(io, service)));
        // The timeouts in a task of their own, which ends the connection's: in one `select!`
        // with the connection, `expired` would be polled at every wake-up of the connection,
        // once per streamed frame (callgrind: about 200 instructions per event).
        // Aborting the connection drops its response bodies, and so cancels their upstream
        // requests.
        let serving = conn.abort_handle();
        let mut cut = cut.clone();
        tokio::spawn(async move {
            // The connection's place, given back when it ends.
            let _permit = permit;
            let _open = open;
            tokio::select! {
                _ = conn => {}
                expired = watch.expired(idle, header, write) => {
                    if expired == Expired::Write {
                        counted.write_timeout();
                        // What the client did not read is dropped, not sent for minutes.
                        watch.reset.store(true, Ordering::Release);
                    }
                    serving.abort();
                }
                Ok(_) = cut.wait_for(|cut| *cut) => serving.abort(),
            }
        });
    }
    drop(listener);
    // Not ready from now on (the probes on the metrics address say so through the drain).
    metrics.drain();
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(config.shutdown_grace) => {
            let cut = in_flight.load(Ordering::Relaxed);
            metrics.streams_cut(cut);
            let _ = cut_all.send(true);
            tracing::warn!(
                streams_cut = cut,
                "{cut} request(s) still in flight after --shutdown-grace ({:?}): cut",
                config.shutdown_grace
            );
        }
    }
    Ok(())
}

pin_project! {
    /// The answer to a request: a probe's, ready at once, or the stack's.
    #[project = OneOfProj]
    enum OneOf<P, S> {
        Probe { #[pin] answer: P },
        Served { #[pin] answer: S },
    }
}

impl<P: Future, S: Future<Output = P::Output>> Future for OneOf<P, S> {
    type Output = P::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<P::Output> {
        match self.project() {
            OneOfProj::Probe { answer } => answer.poll(cx),
            OneOfProj::Served { answer } => answer.poll(cx),
        }
    }
}

/// Counts a client connection in `bypass_marker_connections_open` until dropped.
struct ConnectionOpen(Arc<Metrics>);

impl ConnectionOpen {
    fn new(metrics: Arc<Metrics>) -> Self {
        metrics.connection_opened();
        Self(metrics)
    }
}

impl Drop for ConnectionOpen {
    fn drop(&mut self) {
        self.0.connection_closed();
    }
}

/// If the guard will read `req`'s body: its share of the budget (in `req`'s extensions too),
/// with its declared length taken; `true` when that length does not fit.
fn hold(budgeting: &Budgeting, req: &mut Request<Incoming>) -> (Option<Arc<HeldBody>>, bool) {
    let body = req.body();
    let body_empty = body.is_end_stream() || body.size_hint().exact() == Some(0);
    if !matches!(
        budgeting.guard.check_head(req.headers(), body_empty),
        HeadDecision::Read
    ) {
        return (None, false);
    }
    let mut charge = budgeting.budget.charge();
    // hyper has checked the length; one over `--max-body` gets the guard's 413, unread.
    let declared = body.size_hint().exact();
    if let Some(n) = declared.filter(|&n| n <= budgeting.guard.max_body() as u64) {
        if !charge.take(n) {
            return (None, true);
        }
    }
    let held = HeldBody::new(charge);
    req.extensions_mut().insert(Hold(held.clone()));
    (Some(held), false)
}

/// The 503 for a request body that would take the bodies held past `--max-buffered-bytes`:
/// counted, and logged at most once a minute (with the count since the last line).
fn over_budget_answer(budgeting: Option<&Budgeting>) -> Response<UpstreamBody> {
    if let Some(budget) = budgeting.map(|b| &b.budget) {
        if let Some(n) = budget.refusal() {
            tracing::warn!(
                "503: {n} request(s) refused since the last line: the request bodies held \
                 would pass --max-buffered-bytes ({} bytes)",
                budget.limit()
            );
        }
    }
    let mut res = error(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        "request_bodies_over_budget",
        "the proxy holds as many request bodies as it may; retry shortly".to_owned(),
    );
    res.extensions_mut().remove::<FromForward>();
    let headers = res.headers_mut();
    headers.insert(header::RETRY_AFTER, http::HeaderValue::from_static("1"));
    // The body was not read (or not all of it): the connection cannot be reused.
    headers.insert(header::CONNECTION, http::HeaderValue::from_static("close"));
    res
}

/// Whether a `Transfer-Encoding` of the request names a coding other than `chunked` (any case,
/// empty list elements ignored). hyper has decoded `chunked` (and refuses a request whose last
/// coding is not `chunked`); any other coding would reach the upstream still applied, unnamed.
fn unsupported_transfer_coding(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::TRANSFER_ENCODING)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .map(trim_ows)
        .any(|coding| !coding.is_empty() && !coding.eq_ignore_ascii_case(b"chunked"))
}

fn not_implemented() -> Response<UpstreamBody> {
    let mut res = error(
        StatusCode::NOT_IMPLEMENTED,
        "invalid_request_error",
        "unsupported_transfer_coding",
        "the request has a transfer coding other than chunked; send the body unencoded or \
         chunked only"
            .to_owned(),
    );
    // Answered by the proxy itself: not counted as forwarded.
    res.extensions_mut().remove::<FromForward>();
    // The body was not read: the connection cannot be reused.
    res.headers_mut()
        .insert(header::CONNECTION, http::HeaderValue::from_static("close"));
    res
}

/// The answer to `CONNECT`: the proxy is a reverse proxy for one upstream, not a tunnel (hyper
/// would turn the client's connection into one on a 2xx).
fn method_not_allowed() -> Response<UpstreamBody> {
    let mut res = error(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        "method_not_allowed",
        "CONNECT is not supported".to_owned(),
    );
    res.extensions_mut().remove::<FromForward>();
    res.headers_mut().insert(
        header::ALLOW,
        http::HeaderValue::from_static("GET, HEAD, POST, PUT, DELETE, OPTIONS, TRACE, PATCH"),
    );
    // What the client sends after its `CONNECT` is meant for a tunnel, not a request head.
    res.headers_mut()
        .insert(header::CONNECTION, http::HeaderValue::from_static("close"));
    res
}

pin_project! {
    /// A response body that keeps its connection busy and its request's [`RequestLog`] open until
    /// its last bytes have been written to the socket, counting the bytes it yields and the
    /// frames the layer removed for it.
    ///
    /// Per frame it does no more than that: two reads of a thread-local counter and an addition.
    /// Whether the body completed is read once, when it is dropped; the exchange then waits for
    /// hyper to flush ([`Busy::finish`]): hyper drops a body when it has taken its last frame,
    /// which may still sit in its write buffer, and only bytes in the socket are sent.
    struct Tracked<B: Body> {
        #[pin]
        body: B,
        busy: Busy,
        exchange: Option<RequestLog>,
    }

    impl<B: Body> PinnedDrop for Tracked<B> {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if let Some(mut exchange) = this.exchange.take() {
                // hyper stops polling a body once `is_end_stream` is true, without polling it to
                // `None`.
                if this.body.is_end_stream() {
                    exchange.complete = true;
                }
                this.busy.finish(exchange);
            }
        }
    }
}

impl<B: Body> Tracked<B> {
    fn new(body: B, busy: Busy, exchange: RequestLog) -> Self {
        Self {
            body,
            busy,
            exchange: Some(exchange),
        }
    }

    /// A response that keeps its connection busy but is neither logged nor counted (a probe's).
    fn untracked(body: B, busy: Busy) -> Self {
        Self {
            body,
            busy,
            exchange: None,
        }
    }
}

impl<B> Body for Tracked<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    #[inline]
    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let mut this = self.project();
        // The layer's observer runs within this call, on this thread.
        let before = removed_on_this_thread();
        let poll = this.body.as_mut().poll_frame(cx);
        let Some(exchange) = this.exchange.as_mut() else {
            return poll;
        };
        exchange.frames_removed += removed_on_this_thread() - before;
        match &poll {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    exchange.body_bytes(data.len());
                }
            }
            // The proxy's layer forwards an oversized frame (`Overflow::Forward`) rather than
            // failing: an error here is the upstream's body failing.
            Poll::Ready(Some(Err(_))) => {
                exchange.metrics().upstream_error(UpstreamError::Body);
                this.busy.cut();
            }
            Poll::Ready(None) => exchange.complete = true,
            Poll::Pending => {}
        }
        poll
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
