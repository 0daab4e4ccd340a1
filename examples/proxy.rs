//! A sidecar for any OpenAI-compatible server (Dynamo, vLLM, SGLang, ...): a streaming reverse
//! proxy that applies `BypassMarkerLayer` to the responses and the request guard to the requests.
//!
//! ```text
//! cargo run --release --features json --example proxy -- --upstream http://127.0.0.1:8000 --listen 127.0.0.1:3000
//! ```
//!
//! Point the clients at `http://127.0.0.1:3000/v1`. Every method and path is forwarded to the
//! upstream; `text/event-stream` responses lose the annotation frames the client did not ask for
//! (with `--preset dynamo`, the default: `x-bypass-remote-prefill`, `x-prefill-continue`,
//! `request_id`, `formatted_prompt`, `token_ids`, and never `llm_metrics` or `payload_usage`).
//!
//! What it does, in the order a request meets it:
//!
//! - **Accepting.** It listens with a backlog of `--backlog` (1024 by default; tokio's
//!   `TcpListener::bind` uses 128, which bursts of new connections overflow). When the process
//!   runs out of file descriptors, the accept loop backs off (10 ms, doubling to 1 s) instead of
//!   spinning or stopping, and serves again once descriptors are free.
//! - **Reading the request.** HTTP/1.1. A connection that is idle between requests is closed after
//!   `--idle-timeout`; one that has started a request head must finish it within
//!   `--header-read-timeout`; a request body that stops arriving for `--body-timeout` ends the
//!   request with a 408.
//! - **The request guard** (`JsonGuardLayer`, the `json` feature). A JSON request body is read
//!   (at most `--max-body` bytes, else 413), the router-owned names are stripped from its
//!   `nvext.annotations`, and the names the client may see become its opt-in for the response
//!   layer. Other bodies stream through unread.
//! - **Forwarding.** Hop-by-hop headers (RFC 9110 section 7.6.1: `Connection` and every header it
//!   names, `Keep-Alive`, `Proxy-Connection`, `TE`, `Transfer-Encoding`, `Upgrade`) are removed in
//!   both directions, `Host` is set to the upstream's, and the request streams to the upstream.
//!   Connecting may take `--connect-timeout`, the response head `--response-timeout` (504 when it
//!   fires). An upstream that is unreachable or fails before its head gives a 502. Errors are
//!   JSON in OpenAI's shape: `{"error":{"message":..,"type":..,"code":..}}`.
//! - **The response** streams back: each frame is written as soon as it is complete, nothing is
//!   buffered beyond the frame being read. A client that goes away drops the upstream request, so
//!   the upstream stops generating.
//! - **Stopping.** Ctrl-C or SIGTERM stops accepting, lets the requests in flight finish for up to
//!   `--shutdown-grace`, then exits.
//!
//! `--no-layer` forwards everything untouched (no guard, no filter): the control for benchmarks
//! and for showing the bug.

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::io::{self, Write as _};
use std::net::SocketAddr;
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode, Uri, Version};
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt as _, Either, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::graceful::GracefulShutdown;
use pin_project_lite::pin_project;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::Notify;
use tokio::time::Sleep;
use tower::{Service, ServiceBuilder, ServiceExt as _};
use tower_bypass_marker::BypassMarkerLayer;

/// An error of a body or a service.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body of a response `forward` gives: the upstream's, or the proxy's own JSON error.
pub type UpstreamBody = Either<Incoming, Full<Bytes>>;

pub const USAGE: &str = "\
usage: proxy --upstream URL [options]

A streaming reverse proxy for OpenAI-compatible servers: removes router-internal annotation frames
(such as Dynamo's `event: x-bypass-remote-prefill`) from event streams unless the client opted in
through `nvext.annotations`, and strips router-owned names from the requests.

  --upstream URL             the server to forward to, http://HOST:PORT[/PREFIX] (required)
  --listen ADDR              address to listen on (default 127.0.0.1:3000; port 0 picks a free one)
  --preset dynamo|none       the names the layer starts from (default dynamo):
                               dynamo: router-owned x-bypass-remote-prefill and x-prefill-continue,
                                 opt-in request_id, formatted_prompt and token_ids, never
                                 llm_metrics and payload_usage (Dynamo 1.6.1)
                               none: the layer's default, x-bypass-remote-prefill only
  --opt-in NAME              also remove NAME frames unless the client lists NAME (repeatable)
  --router-owned NAME        another router-owned marker: removed unless the client opted in,
                               stripped from requests in every form (repeatable)
  --never-forward NAME       always remove NAME frames, even when asked for (repeatable)
  --sdk-safe                 also remove every frame with fields but no `data` line
  --no-layer                 forward everything untouched (no guard, no filter): the control
  --max-body BYTES           largest JSON request body the guard reads (default 33554432, 32 MiB:
                               a chat request with a 20 MB image, base64-encoded, fits); larger
                               ones get a 413
  --backlog N                listen backlog (default 1024; the kernel caps it at somaxconn)
  --header-read-timeout SECS time from a request head's first byte to its end (default 10)
  --idle-timeout SECS        how long a keep-alive connection may wait for its next request
                               (default 60)
  --body-timeout SECS        longest pause within a request body before a 408 (default 30)
  --connect-timeout SECS     time to connect to the upstream (default 5)
  --response-timeout SECS    time from sending the request to the upstream's response head, 504
                               after it (default 600: a non-streamed completion sends its head
                               only when it is done)
  --shutdown-grace SECS      after Ctrl-C or SIGTERM, how long requests in flight may finish
                               (default 30)
  -h, --help                 print this help

SECS may have a fraction (0.5). Errors are JSON in OpenAI's shape:
{\"error\":{\"message\":...,\"type\":...,\"code\":...}}, 502 when the upstream is unreachable or fails
before its response head, 504 when the head is late.";

/// The preset a layer starts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// Dynamo 1.6.1's names.
    Dynamo,
    /// The layer's default: `x-bypass-remote-prefill` only.
    None,
}

/// Where requests go: `http://authority` plus an optional path prefix.
#[derive(Debug, Clone)]
pub struct Upstream {
    authority: http::uri::Authority,
    host: HeaderValue,
    prefix: String,
}

impl Upstream {
    /// Parses `http://HOST:PORT[/PREFIX]`.
    pub fn parse(url: &str) -> Result<Self, String> {
        let uri: Uri = url
            .parse()
            .map_err(|err| format!("invalid --upstream {url:?}: {err}"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => {
                return Err(format!(
                    "--upstream {url:?}: https is not supported; run the proxy next to the server \
                     and forward over http"
                ))
            }
            _ => return Err(format!("--upstream {url:?} must start with http://")),
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or(format!("--upstream {url:?} has no host"))?;
        if uri.query().is_some() {
            return Err(format!("--upstream {url:?} must not have a query"));
        }
        let host = HeaderValue::from_str(authority.as_str())
            .map_err(|err| format!("--upstream {url:?}: {err}"))?;
        let prefix = uri.path().trim_end_matches('/').to_owned();
        Ok(Self {
            authority,
            host,
            prefix,
        })
    }

    fn uri(&self, path_and_query: &str) -> Result<Uri, http::Error> {
        Uri::builder()
            .scheme("http")
            .authority(self.authority.clone())
            .path_and_query(format!("{}{}", self.prefix, path_and_query))
            .build()
    }
}

impl fmt::Display for Upstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "http://{}{}", self.authority, self.prefix)
    }
}

/// The proxy's configuration, from its command line.
#[derive(Debug, Clone)]
pub struct Config {
    /// `--listen`.
    pub listen: SocketAddr,
    /// `--upstream`.
    pub upstream: Upstream,
    /// `--preset`.
    pub preset: Preset,
    /// `--opt-in`.
    pub opt_in: Vec<String>,
    /// `--router-owned`.
    pub router_owned: Vec<String>,
    /// `--never-forward`.
    pub never_forward: Vec<String>,
    /// `--sdk-safe`.
    pub sdk_safe: bool,
    /// Not `--no-layer`.
    pub with_layer: bool,
    /// `--max-body`.
    pub max_body: usize,
    /// `--backlog`.
    pub backlog: u32,
    /// `--header-read-timeout`.
    pub header_read_timeout: Duration,
    /// `--idle-timeout`.
    pub idle_timeout: Duration,
    /// `--body-timeout`.
    pub body_timeout: Duration,
    /// `--connect-timeout`.
    pub connect_timeout: Duration,
    /// `--response-timeout`.
    pub response_timeout: Duration,
    /// `--shutdown-grace`.
    pub shutdown_grace: Duration,
}

impl Config {
    /// Parses the command line (without the program name). `Ok(None)` asks for the help.
    pub fn from_args<I, S>(args: I) -> Result<Option<Self>, String>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut args = args.into_iter().map(Into::into);
        let mut upstream = None;
        let mut config = Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 3000)),
            // Replaced below; `--upstream` is required.
            upstream: Upstream::parse("http://127.0.0.1").expect("a valid URL"),
            preset: Preset::Dynamo,
            opt_in: Vec::new(),
            router_owned: Vec::new(),
            never_forward: Vec::new(),
            sdk_safe: false,
            with_layer: true,
            max_body: tower_bypass_marker::json::DEFAULT_MAX_BODY_BYTES,
            backlog: 1024,
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            body_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            response_timeout: Duration::from_secs(600),
            shutdown_grace: Duration::from_secs(30),
        };
        while let Some(arg) = args.next() {
            // `--flag=value` and `--flag value` both work.
            let (flag, inline) = match arg.split_once('=') {
                Some((flag, value)) if flag.starts_with("--") => (flag.to_owned(), Some(value)),
                _ => (arg.clone(), None),
            };
            let inline = inline.map(str::to_owned);
            let mut value = || {
                inline
                    .clone()
                    .or_else(|| args.next())
                    .ok_or(format!("{flag} needs a value"))
            };
            match flag.as_str() {
                "-h" | "--help" => return Ok(None),
                "--upstream" => upstream = Some(Upstream::parse(&value()?)?),
                "--listen" => {
                    let addr = value()?;
                    config.listen = addr
                        .parse()
                        .map_err(|err| format!("invalid --listen {addr:?}: {err}"))?;
                }
                "--preset" => {
                    config.preset = match value()?.as_str() {
                        "dynamo" => Preset::Dynamo,
                        "none" => Preset::None,
                        other => {
                            return Err(format!("--preset must be dynamo or none, not {other:?}"))
                        }
                    }
                }
                "--opt-in" => config.opt_in.push(value()?),
                "--router-owned" => config.router_owned.push(value()?),
                "--never-forward" => config.never_forward.push(value()?),
                "--sdk-safe" => config.sdk_safe = true,
                "--no-layer" => config.with_layer = false,
                "--max-body" => config.max_body = number(&flag, &value()?)?,
                "--backlog" => config.backlog = number(&flag, &value()?)?,
                "--header-read-timeout" => config.header_read_timeout = secs(&flag, &value()?)?,
                "--idle-timeout" => config.idle_timeout = secs(&flag, &value()?)?,
                "--body-timeout" => config.body_timeout = secs(&flag, &value()?)?,
                "--connect-timeout" => config.connect_timeout = secs(&flag, &value()?)?,
                "--response-timeout" => config.response_timeout = secs(&flag, &value()?)?,
                "--shutdown-grace" => config.shutdown_grace = secs(&flag, &value()?)?,
                other => return Err(format!("unknown argument {other:?}")),
            }
        }
        config.upstream = upstream.ok_or("--upstream is required")?;
        config.layer()?; // refuses invalid names now rather than when serving
        Ok(Some(config))
    }

    /// The response layer, or `None` with `--no-layer`; an error names a flag's invalid name.
    pub fn layer(&self) -> Result<Option<BypassMarkerLayer>, String> {
        if !self.with_layer {
            return Ok(None);
        }
        let mut layer = match self.preset {
            Preset::Dynamo => BypassMarkerLayer::dynamo(),
            Preset::None => BypassMarkerLayer::new(),
        };
        let invalid = |flag: &str, name: &str, err| format!("{flag} {name:?}: {err}");
        for name in &self.opt_in {
            layer = layer
                .try_opt_in(name)
                .map_err(|e| invalid("--opt-in", name, e))?;
        }
        for name in &self.router_owned {
            layer = layer
                .try_router_owned(name)
                .map_err(|e| invalid("--router-owned", name, e))?;
        }
        for name in &self.never_forward {
            layer = layer
                .try_never_forward(name)
                .map_err(|e| invalid("--never-forward", name, e))?;
        }
        Ok(Some(layer.sdk_safe(self.sdk_safe)))
    }
}

fn number<T: std::str::FromStr>(flag: &str, value: &str) -> Result<T, String>
where
    T::Err: fmt::Display,
{
    value
        .parse()
        .map_err(|err| format!("invalid {flag} {value:?}: {err}"))
}

fn secs(flag: &str, value: &str) -> Result<Duration, String> {
    let secs: f64 = number(flag, value)?;
    match Duration::try_from_secs_f64(secs) {
        Ok(d) if !d.is_zero() => Ok(d),
        _ => Err(format!(
            "invalid {flag} {value:?}: a positive number of seconds"
        )),
    }
}

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

/// A JSON error in OpenAI's shape.
fn error(status: StatusCode, kind: &str, code: &str, message: String) -> Response<UpstreamBody> {
    let body = serde_json::json!({
        "error": { "message": message, "type": kind, "param": null, "code": code }
    });
    let mut res = Response::new(Either::Right(Full::new(Bytes::from(body.to_string()))));
    *res.status_mut() = status;
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    res
}

/// The service at the bottom of the stack: forwards every request to the upstream.
#[derive(Clone)]
pub struct Forward(Arc<Forwarding>);

/// What [`Forward`] needs: the upstream and its client.
struct Forwarding {
    upstream: Upstream,
    client: Client<HttpConnector, UnsyncBoxBody<Bytes, BoxError>>,
    response_timeout: Duration,
}

impl Forward {
    /// Forwards to `config.upstream`, with `config`'s timeouts.
    pub fn new(config: &Config) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(config.connect_timeout));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        Self(Arc::new(Forwarding {
            upstream: config.upstream.clone(),
            client,
            response_timeout: config.response_timeout,
        }))
    }
}

impl<B> Service<Request<B>> for Forward
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<UpstreamBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let forwarding = self.0.clone();
        let req = req.map(|body| body.map_err(Into::into).boxed_unsync());
        Box::pin(async move { Ok(forward(&forwarding, req).await) })
    }
}

/// Removes the hop-by-hop headers of RFC 9110 section 7.6.1: those `Connection` names, and the
/// ones that are hop-by-hop wherever they appear.
fn remove_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in [
        header::CONNECTION,
        header::TE,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
        header::TRAILER,
    ] {
        headers.remove(name);
    }
    headers.remove("keep-alive");
    headers.remove("proxy-connection");
}

async fn forward(
    forward: &Forwarding,
    req: Request<UnsyncBoxBody<Bytes, BoxError>>,
) -> Response<UpstreamBody> {
    let (mut parts, body) = req.into_parts();
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    parts.uri = match forward.upstream.uri(path) {
        Ok(uri) => uri,
        Err(err) => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "invalid_path",
                format!("cannot forward {path:?}: {err}"),
            )
        }
    };
    parts.version = Version::HTTP_11;
    remove_hop_by_hop(&mut parts.headers);
    // The proxy answered any `Expect: 100-continue` itself.
    parts.headers.remove(header::EXPECT);
    parts
        .headers
        .insert(header::HOST, forward.upstream.host.clone());
    let request = forward.client.request(Request::from_parts(parts, body));
    let mut res = match tokio::time::timeout(forward.response_timeout, request).await {
        Ok(Ok(res)) => res.map(Either::Left),
        Ok(Err(err)) => return upstream_error(&forward.upstream, err),
        Err(_) => {
            return error(
                StatusCode::GATEWAY_TIMEOUT,
                "upstream_error",
                "upstream_timeout",
                format!(
                    "no response head from the upstream {} within {:?}",
                    forward.upstream, forward.response_timeout
                ),
            )
        }
    };
    remove_hop_by_hop(res.headers_mut());
    res
}

fn stalled() -> Response<UpstreamBody> {
    error(
        StatusCode::REQUEST_TIMEOUT,
        "invalid_request_error",
        "request_body_timeout",
        "the request body stopped arriving".to_owned(),
    )
}

fn source_is<E: std::error::Error + 'static>(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut err = Some(err);
    while let Some(e) = err {
        if e.is::<E>() {
            return true;
        }
        err = e.source();
    }
    false
}

fn upstream_error(
    upstream: &Upstream,
    err: hyper_util::client::legacy::Error,
) -> Response<UpstreamBody> {
    if source_is::<BodyStalled>(&err) {
        return stalled();
    }
    let (code, what) = if err.is_connect() {
        ("upstream_unreachable", "cannot reach the upstream")
    } else {
        (
            "upstream_failed",
            "the upstream failed before its response head",
        )
    };
    let mut message = format!("{what} {upstream}: {err}");
    let mut source = std::error::Error::source(&err);
    while let Some(s) = source {
        message.push_str(&format!(": {s}"));
        source = s.source();
    }
    error(StatusCode::BAD_GATEWAY, "upstream_error", code, message)
}

pin_project! {
    /// A request body that fails with [`BodyStalled`] when no frame arrives for `timeout`, and
    /// tells its connection's [`Watch`].
    pub struct StallTimeout<B> {
        #[pin]
        body: B,
        #[pin]
        sleep: Sleep,
        armed: bool,
        timeout: Duration,
        watch: Arc<Watch>,
    }
}

impl<B> StallTimeout<B> {
    fn new(body: B, timeout: Duration, watch: Arc<Watch>) -> Self {
        Self {
            body,
            sleep: tokio::time::sleep(timeout),
            armed: false,
            timeout,
            watch,
        }
    }
}

/// A request body stopped arriving.
#[derive(Debug)]
struct BodyStalled(Duration);

impl fmt::Display for BodyStalled {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "no request body data for {:?}", self.0)
    }
}

impl std::error::Error for BodyStalled {}

impl<B> Body for StallTimeout<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Data = B::Data;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let mut this = self.project();
        if let Poll::Ready(frame) = this.body.poll_frame(cx) {
            *this.armed = false;
            return Poll::Ready(frame.map(|r| r.map_err(Into::into)));
        }
        if !*this.armed {
            *this.armed = true;
            let deadline = tokio::time::Instant::now() + *this.timeout;
            this.sleep.as_mut().reset(deadline);
        }
        match this.sleep.poll(cx) {
            Poll::Ready(()) => {
                this.watch.stalled.store(true, Ordering::Release);
                Poll::Ready(Some(Err(Box::new(BodyStalled(*this.timeout)))))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// Milliseconds since `epoch`, plus one, so that 0 can mean "never".
fn stamp(epoch: Instant) -> u64 {
    epoch.elapsed().as_millis() as u64 + 1
}

/// What one connection is doing, for its idle and header timeouts.
struct Watch {
    epoch: Instant,
    /// Requests whose response has not finished.
    in_flight: AtomicUsize,
    /// When the connection last became idle ([`stamp`]).
    idle_since: AtomicU64,
    /// When the first byte of the next request head arrived ([`stamp`]), 0 if none has.
    head_since: AtomicU64,
    /// The body of the request in flight stalled (see [`StallTimeout`]).
    stalled: AtomicBool,
    changed: Notify,
}

impl Watch {
    fn new() -> Arc<Self> {
        let epoch = Instant::now();
        Arc::new(Self {
            epoch,
            in_flight: AtomicUsize::new(0),
            idle_since: AtomicU64::new(stamp(epoch)),
            head_since: AtomicU64::new(0),
            stalled: AtomicBool::new(false),
            changed: Notify::new(),
        })
    }

    /// Bytes arrived.
    fn read(&self) {
        if self.in_flight.load(Ordering::Acquire) == 0
            && self.head_since.load(Ordering::Relaxed) == 0
        {
            self.head_since.store(stamp(self.epoch), Ordering::Release);
            self.changed.notify_one();
        }
    }

    /// A request head was read: the connection is busy until the returned guard is dropped.
    fn begin(self: &Arc<Self>) -> Busy {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.head_since.store(0, Ordering::Release);
        self.stalled.store(false, Ordering::Release);
        self.changed.notify_one();
        Busy(self.clone())
    }

    /// Completes when the connection has been idle for `idle`, or has been reading a request head
    /// for `header`.
    async fn expired(&self, idle: Duration, header: Duration) {
        loop {
            let notified = self.changed.notified();
            let deadline = if self.in_flight.load(Ordering::Acquire) > 0 {
                None
            } else {
                match self.head_since.load(Ordering::Acquire) {
                    0 => Some((self.idle_since.load(Ordering::Acquire), idle)),
                    since => Some((since, header)),
                }
            };
            match deadline {
                None => notified.await,
                Some((since, limit)) => {
                    let at = self.epoch + Duration::from_millis(since - 1) + limit;
                    tokio::select! {
                        () = tokio::time::sleep_until(at.into()) => {
                            if Instant::now() >= at && self.in_flight.load(Ordering::Acquire) == 0 {
                                return;
                            }
                        }
                        () = notified => {}
                    }
                }
            }
        }
    }
}

/// A request in flight on a [`Watch`]ed connection.
struct Busy(Arc<Watch>);

impl Drop for Busy {
    fn drop(&mut self) {
        let watch = &self.0;
        watch
            .idle_since
            .store(stamp(watch.epoch), Ordering::Release);
        watch.in_flight.fetch_sub(1, Ordering::AcqRel);
        watch.changed.notify_one();
    }
}

pin_project! {
    /// A response body that keeps its connection busy until it is dropped.
    struct Tracked<B> {
        #[pin]
        body: B,
        busy: Busy,
    }
}

impl<B: Body> Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        self.project().body.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

pin_project! {
    /// A connection that tells its [`Watch`] when bytes arrive.
    struct Watched {
        #[pin]
        io: TcpStream,
        watch: Arc<Watch>,
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.project();
        let before = buf.filled().len();
        let poll = this.io.poll_read(cx, buf);
        if buf.filled().len() > before {
            this.watch.read();
        }
        poll
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.project().io.poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.project().io.poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.project().io.poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.project().io.poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// Whether an `accept` error is about one connection (go on at once) rather than the process
/// (out of file descriptors or memory: back off).
fn is_connection_error(err: &io::Error) -> bool {
    matches!(
        err.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionRefused
            | io::ErrorKind::Interrupted
            | io::ErrorKind::WouldBlock
    )
}

/// How many times `accept` has failed for want of file descriptors or memory, in this process.
pub static ACCEPT_FAILURES: AtomicU64 = AtomicU64::new(0);

/// Serves `config` on `listener` until `shutdown` completes, then lets the requests in flight
/// finish for up to `config.shutdown_grace`.
pub async fn serve<F>(listener: TcpListener, config: Config, shutdown: F) -> io::Result<()>
where
    F: Future<Output = ()>,
{
    let forward = Forward::new(&config);
    match config.layer().expect("names checked by Config::from_args") {
        Some(layer) => {
            // The guard reads the request first; the response layer finds the opt-in it granted.
            let guard = layer.json_guard().max_body_bytes(config.max_body);
            let stack = ServiceBuilder::new()
                .layer(guard)
                .layer(layer)
                .service(forward);
            serve_with(listener, config, stack, shutdown).await
        }
        None => serve_with(listener, config, forward, shutdown).await,
    }
}

/// The request body every service of the proxy gets: hyper's, with the `--body-timeout`.
pub type RequestBody = StallTimeout<Incoming>;

/// [`serve`] with the service that answers each request (`service` is cloned for each one): the
/// proxy's own stack, or another for a benchmark. Its response bodies are served as they are,
/// with no boxing, so each frame costs no more calls through a pointer than the stack makes.
pub async fn serve_with<S, B, F>(
    listener: TcpListener,
    config: Config,
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
    let mut http = hyper::server::conn::http1::Builder::new();
    // The header timeout is the proxy's own (see `Watch`): hyper's also runs while a keep-alive
    // connection waits for its next request, which would cut idle connections short.
    http.header_read_timeout(None).keep_alive(true);
    let graceful = GracefulShutdown::new();
    let (idle, header, body) = (
        config.idle_timeout,
        config.header_read_timeout,
        config.body_timeout,
    );
    tokio::pin!(shutdown);
    let mut backoff = Duration::ZERO;
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        let stream = match accepted {
            Ok((stream, _)) => {
                backoff = Duration::ZERO;
                stream
            }
            Err(err) if is_connection_error(&err) => continue,
            Err(err) => {
                // Out of file descriptors (EMFILE, ENFILE) or memory: the connection waits in the
                // queue. Retrying at once would spin; stopping would end the service.
                if backoff.is_zero() {
                    eprintln!("proxy: accept failed, backing off: {err}");
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
        let watch = Watch::new();
        let stack = service.clone();
        let service_watch = watch.clone();
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let busy = service_watch.begin();
            let req = req.map(|b| StallTimeout::new(b, body, service_watch.clone()));
            let response = stack.clone().oneshot(req);
            let watch = service_watch.clone();
            async move {
                let res = response.await?;
                // The guard answers a body that failed with a 400; this one only stopped arriving.
                let res = if res.status() == StatusCode::BAD_REQUEST
                    && watch.stalled.load(Ordering::Acquire)
                {
                    stalled().map(Either::Right)
                } else {
                    res.map(Either::Left)
                };
                Ok::<_, Infallible>(res.map(|body| Tracked { body, busy }))
            }
        });
        let io = TokioIo::new(Watched {
            io: stream,
            watch: watch.clone(),
        });
        let conn = graceful.watch(http.serve_connection(io, service));
        tokio::spawn(async move {
            tokio::select! {
                _ = conn => {}
                () = watch.expired(idle, header) => {}
            }
        });
    }
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(config.shutdown_grace) => {
            eprintln!("proxy: requests still in flight after {:?}, stopping", config.shutdown_grace);
        }
    }
    Ok(())
}

/// Completes on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut sigterm) => {
                sigterm.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    let why = tokio::select! {
        () = ctrl_c => "Ctrl-C",
        () = terminate => "SIGTERM",
    };
    eprintln!("proxy: {why}, shutting down");
}

#[tokio::main]
async fn main() -> ExitCode {
    let config = match Config::from_args(std::env::args().skip(1)) {
        Ok(Some(config)) => config,
        Ok(None) => {
            // Ignore a closed stdout (`proxy --help | head -1`).
            let _ = writeln!(io::stdout(), "{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(err) => {
            eprintln!("proxy: {err}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let listener = match bind(config.listen, config.backlog) {
        Ok(listener) => listener,
        Err(err) => {
            eprintln!("proxy: cannot listen on {}: {err}", config.listen);
            return ExitCode::FAILURE;
        }
    };
    let addr = match listener.local_addr() {
        Ok(addr) => addr,
        Err(err) => {
            eprintln!("proxy: {err}");
            return ExitCode::FAILURE;
        }
    };
    let mode = match config.layer().expect("names checked by Config::from_args") {
        Some(layer) => format!("{layer:?}"),
        None => "--no-layer: forwarding untouched".to_owned(),
    };
    eprintln!("proxy: upstream {}; {mode}", config.upstream);
    println!("listening on http://{addr}");
    match serve(listener, config, shutdown_signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("proxy: {err}");
            ExitCode::FAILURE
        }
    }
}
