//! Real servers and clients on 127.0.0.1, and the hand-made bodies their tests send: what the
//! integration tests of the library and of the `bypass-marker` package that run servers share.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{header, HeaderMap, Response};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, StreamBody};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

/// The frame Dynamo's router prepends when it bypasses remote prefill.
pub const MARKER: &str = "event: x-bypass-remote-prefill\n: true\n\n";

/// Bound on every wait in these tests: a hang fails the test instead of stalling the run.
pub const PATIENCE: Duration = Duration::from_secs(20);

/// The error type of the hand-made bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A `text/event-stream` response around `body`.
pub fn event_stream<B>(body: B) -> Response<B> {
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .body(body)
        .unwrap()
}

/// A listener on 127.0.0.1, port chosen by the OS.
pub async fn listener() -> (TcpListener, SocketAddr) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    (listener, addr)
}

/// Serves `router` with `axum::serve` on 127.0.0.1; the server stops with the test's runtime.
pub async fn spawn_axum(router: axum::Router) -> SocketAddr {
    let (listener, addr) = listener().await;
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    addr
}

/// Serves `svc` with hyper-util's auto (HTTP/1.1 and h2c) connection builder on 127.0.0.1, with
/// room for `max_streams` concurrent HTTP/2 streams per connection.
pub async fn spawn_auto<S, B>(svc: S, max_streams: u32) -> SocketAddr
where
    S: tower::Service<http::Request<hyper::body::Incoming>, Response = Response<B>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let (listener, addr) = listener().await;
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            let svc = hyper_util::service::TowerToHyperService::new(svc.clone());
            tokio::spawn(async move {
                let mut builder =
                    hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                builder.http2().max_concurrent_streams(max_streams);
                // A client that goes away mid-response is an error here, and expected.
                let _ = builder
                    .serve_connection(hyper_util::rt::TokioIo::new(tcp), svc)
                    .await;
            });
        }
    });
    addr
}

/// A pooled HTTP/1.1 client.
pub fn h1_client() -> Client<HttpConnector, http_body_util::Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

/// An HTTP/2 prior-knowledge (h2c) client: one connection, many streams.
pub fn h2_client() -> Client<HttpConnector, http_body_util::Full<Bytes>> {
    Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http()
}

/// Reads a whole body: its data, concatenated, and its trailers.
pub async fn read_all<B>(body: B) -> (Bytes, Option<HeaderMap>)
where
    B: Body,
    B::Error: std::fmt::Debug,
{
    let collected = tokio::time::timeout(PATIENCE, body.collect())
        .await
        .expect("body did not end in time")
        .expect("body failed");
    let trailers = collected.trailers().cloned();
    (collected.to_bytes(), trailers)
}

/// A body fed by the test through a channel of frames (or errors).
pub type FedBody = StreamBody<ReceiverStream<Result<Frame<Bytes>, BoxError>>>;

/// The test's end of a [`FedBody`]: what it sends, the body yields; dropping it ends the body.
pub type FeedSender = mpsc::Sender<Result<Frame<Bytes>, BoxError>>;

/// A body the test feeds frame by frame.
pub fn fed_body(capacity: usize) -> (FeedSender, FedBody) {
    let (tx, rx) = mpsc::channel(capacity);
    (tx, StreamBody::new(ReceiverStream::new(rx)))
}

/// A body made of a fixed list of frames (or errors).
pub type FramesBody =
    StreamBody<futures_util::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, BoxError>>>>;

/// A body that yields `frames` in order, then ends.
pub fn frames_body(frames: Vec<Result<Frame<Bytes>, BoxError>>) -> FramesBody {
    StreamBody::new(futures_util::stream::iter(frames))
}

/// A data frame.
pub fn data(s: impl Into<Bytes>) -> Result<Frame<Bytes>, BoxError> {
    Ok(Frame::data(s.into()))
}

/// Raises a flag, and completes a receiver if there is one, when dropped: what [`DropFlag`] hangs
/// on a body.
struct OnDrop {
    flag: Arc<AtomicBool>,
    on_drop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for OnDrop {
    fn drop(&mut self) {
        self.flag.store(true, Ordering::SeqCst);
        if let Some(tx) = self.on_drop.take() {
            let _ = tx.send(());
        }
    }
}

/// A body, unchanged, that raises a flag when it is dropped.
#[derive(Debug)]
pub struct DropFlag;

impl DropFlag {
    /// `inner`, and the flag its drop raises.
    // One name for the constructors of a body whose type is the map's.
    #[allow(clippy::new_ret_no_self)]
    pub fn new<B: Body>(
        inner: B,
    ) -> (impl Body<Data = B::Data, Error = B::Error>, Arc<AtomicBool>) {
        let flag = Arc::new(AtomicBool::new(false));
        (Self::hang(inner, flag.clone(), None), flag)
    }

    /// `inner`, and a receiver that completes when it is dropped.
    pub fn notifying<B: Body>(
        inner: B,
    ) -> (
        impl Body<Data = B::Data, Error = B::Error>,
        tokio::sync::oneshot::Receiver<()>,
    ) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let flag = Arc::new(AtomicBool::new(false));
        (Self::hang(inner, flag, Some(tx)), rx)
    }

    /// `inner` with an [`OnDrop`] in the closure of a frame map that changes nothing: the body's
    /// drop drops it.
    fn hang<B: Body>(
        inner: B,
        flag: Arc<AtomicBool>,
        on_drop: Option<tokio::sync::oneshot::Sender<()>>,
    ) -> impl Body<Data = B::Data, Error = B::Error> {
        let guard = OnDrop { flag, on_drop };
        inner.map_frame(move |frame| {
            let _ = &guard;
            frame
        })
    }
}

/// A body that never yields anything and never ends: polling it to its end would hang.
pub type Forever =
    http_body_util::StreamBody<futures_util::stream::Pending<Result<Frame<Bytes>, Infallible>>>;

/// A [`Forever`] body.
pub fn forever() -> Forever {
    http_body_util::StreamBody::new(futures_util::stream::pending())
}

/// Splits `bytes` into chunks whose lengths cycle through `sizes`, so frames and lines straddle
/// chunk boundaries at many offsets.
pub fn chunked(bytes: &[u8], sizes: &[usize]) -> Vec<Bytes> {
    let mut out = Vec::new();
    let mut rest = Bytes::copy_from_slice(bytes);
    for size in sizes.iter().cycle() {
        if rest.is_empty() {
            break;
        }
        out.push(rest.split_to((*size).clamp(1, rest.len())));
    }
    out
}

/// Concatenates byte strings.
pub fn concat<I: IntoIterator<Item = T>, T: AsRef<[u8]>>(parts: I) -> Bytes {
    let mut out = BytesMut::new();
    for part in parts {
        out.extend_from_slice(part.as_ref());
    }
    out.freeze()
}

/// A field of `/proc/self/status` in KiB (e.g. `VmRSS`, `VmHWM`), where there is one.
pub fn proc_status_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

#[cfg(feature = "decode")]
/// The body of `res`, decoded from its `content-encoding` (gzip, br, zstd, deflate or none) by
/// tower-http's client-side `Decompression`, as a string.
pub async fn decoded<B>(res: Response<B>) -> String
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    use tower::ServiceExt;
    let mut res = Some(res);
    let svc = tower::ServiceBuilder::new()
        .layer(tower_http::decompression::DecompressionLayer::new())
        .service(tower::service_fn(move |_req: http::Request<()>| {
            let res = res.take().expect("one response");
            async move { Ok::<_, Infallible>(res) }
        }));
    let res = svc.oneshot(http::Request::new(())).await.unwrap();
    let bytes = tokio::time::timeout(PATIENCE, res.into_body().collect())
        .await
        .expect("body did not end in time")
        .map_err(|e| e.to_string())
        .expect("the body did not decode")
        .to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// The JSON guard and the response layer of one configuration, in process, over a service that
/// answers: what the tests of the guard's decisions (its observer calls, its events) send requests
/// through.
#[cfg(feature = "json")]
pub mod guarded {
    use std::convert::Infallible;
    use std::sync::{Arc, Mutex};

    use bytes::Bytes;
    use http::{header, Request, Response, StatusCode};
    use http_body_util::{BodyExt, Full};
    use tower::{service_fn, ServiceBuilder, ServiceExt};
    use tower_bypass_marker::json::{JsonGuardBody, JsonGuardLayer};
    use tower_bypass_marker::BypassMarkerLayer;

    /// `req` through `guard` and `layer` to a service that answers `answer`: the status and the
    /// whole body the client gets (empty if the body fails).
    pub async fn send(
        guard: JsonGuardLayer,
        layer: &BypassMarkerLayer,
        req: Request<Full<Bytes>>,
        answer: Response<Full<Bytes>>,
    ) -> (StatusCode, Bytes) {
        let answer = Arc::new(Mutex::new(Some(answer)));
        let svc = ServiceBuilder::new()
            .layer(guard)
            .layer(layer.clone())
            .service(service_fn(
                move |_req: Request<JsonGuardBody<Full<Bytes>>>| {
                    let res = answer.lock().unwrap().take().expect("called once");
                    async move { Ok::<_, Infallible>(res) }
                },
            ));
        let res = svc.oneshot(req).await.unwrap();
        let status = res.status();
        let body = res.into_body().collect().await;
        (status, body.map(|b| b.to_bytes()).unwrap_or_default())
    }

    /// A POST of `body` as `content_type` to the chat endpoint.
    pub fn post(content_type: &str, body: &'static str) -> Request<Full<Bytes>> {
        Request::post("/v1/chat/completions")
            .header(header::CONTENT_TYPE, content_type)
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .unwrap()
    }

    /// A 200 with a small JSON body.
    pub fn ok() -> Response<Full<Bytes>> {
        Response::new(Full::new(Bytes::from_static(b"{}")))
    }

    /// A 200 event stream with `body` and these extra headers.
    pub fn sse(
        headers: &[(&'static str, &'static str)],
        body: &'static str,
    ) -> Response<Full<Bytes>> {
        let mut res = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
        res.headers_mut()
            .insert(header::CONTENT_TYPE, "text/event-stream".parse().unwrap());
        for (name, value) in headers {
            res.headers_mut().insert(*name, value.parse().unwrap());
        }
        res
    }
}
