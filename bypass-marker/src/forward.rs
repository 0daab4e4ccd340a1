//! The service at the bottom of the proxy's stack: forwards a request to the upstream and answers
//! the upstream's failures with JSON errors in OpenAI's shape.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt as _, Either, Full};
use tower::Service;

use crate::args::{ProxyArgs, Upstream};
use crate::client::{trim_ows, Client, SendError, UpstreamResponseBody};
use crate::conn::BodyStalled;
use crate::metrics::{Metrics, UpstreamError};
use tower_bypass_marker::BoxError;

/// The body of a response [`Forward`] gives: the upstream's, or the proxy's own JSON error.
pub type UpstreamBody = Either<UpstreamResponseBody, Full<Bytes>>;

/// Put in the extensions of every response [`Forward`] gives, so that the proxy tells a response
/// that went through the whole stack from one a layer above answered itself (a refusal).
#[derive(Debug, Clone, Copy)]
pub(crate) struct FromForward;

/// A JSON error in OpenAI's shape.
pub(crate) fn error(
    status: StatusCode,
    kind: &str,
    code: &str,
    message: String,
) -> Response<UpstreamBody> {
    let body = serde_json::json!({
        "error": { "message": message, "type": kind, "param": null, "code": code }
    });
    let mut res = Response::new(Either::Right(Full::new(Bytes::from(body.to_string()))));
    *res.status_mut() = status;
    res.extensions_mut().insert(FromForward);
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    res
}

/// The service at the bottom of the stack: forwards every request to the upstream.
#[derive(Clone)]
pub struct Forward(Arc<Forwarding>);

impl std::fmt::Debug for Forward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forward")
            .field("upstream", &self.0.upstream)
            .field("response_timeout", &self.0.response_timeout)
            .finish_non_exhaustive()
    }
}

/// What [`Forward`] needs: the upstream and its client.
struct Forwarding {
    upstream: Upstream,
    client: Client,
    response_timeout: Duration,
    metrics: Arc<Metrics>,
}

impl Forward {
    /// Forwards to `config.upstream`, with `config`'s timeouts; counts the upstream's failures
    /// in `metrics`. Each `Forward` has its own pool of upstream connections, holding at most as
    /// many idle ones as `--max-connections` allows client connections (so that the proxy's
    /// descriptors stay within the open-file limit).
    pub fn new(config: &ProxyArgs, metrics: Arc<Metrics>) -> Self {
        let max_idle = crate::args::max_connections(config, 1);
        let counted = metrics.clone();
        let client = Client::new(config.upstream.clone(), config.connect_timeout, max_idle)
            .response_timeout(config.response_timeout)
            .idle_timeout(config.upstream_idle_timeout, move || {
                counted.upstream_idle_timeout();
            });
        Self(Arc::new(Forwarding {
            upstream: config.upstream.clone(),
            client,
            response_timeout: config.response_timeout,
            metrics,
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
        // The body's own error type need not be `Send`; a `BoxError` is.
        let req = req.map(|body| body.map_err(Into::<BoxError>::into));
        Box::pin(async move { Ok(forward(&forwarding, req).await) })
    }
}

/// Removes the hop-by-hop headers of RFC 9110 section 7.6.1: those `Connection` names, and the
/// ones that are hop-by-hop wherever they appear.
///
/// `Connection` values are read as bytes: a value with non-ASCII bytes (obs-text) still has its
/// ASCII names removed. The proxy calls this on a request before the guard reads its headers, so
/// that the guard decides on the headers the upstream will receive.
pub(crate) fn remove_hop_by_hop(headers: &mut HeaderMap) {
    // The common case, no `Connection` header, allocates nothing.
    if headers.contains_key(header::CONNECTION) {
        let named: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .flat_map(|v| v.as_bytes().split(|&b| b == b','))
            .filter_map(|name| HeaderName::from_bytes(trim_ows(name)).ok())
            .collect();
        for name in named {
            headers.remove(name);
        }
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

async fn forward<B>(forward: &Forwarding, req: Request<B>) -> Response<UpstreamBody>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
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
    // Hop-by-hop headers are gone already (`remove_hop_by_hop`, before the guard).
    // The proxy answered any `Expect: 100-continue` itself.
    parts.headers.remove(header::EXPECT);
    parts
        .headers
        .insert(header::HOST, forward.upstream.host.clone());
    // An encoded event stream is passed through unfiltered by the layer: ask the upstream for
    // unencoded responses, so that every event stream can be filtered.
    parts.headers.insert(
        header::ACCEPT_ENCODING,
        HeaderValue::from_static("identity"),
    );
    // The response timeout is the client's: it starts once the request is sent.
    let mut res = match forward.client.send(&parts, body).await {
        Ok(res) => res.map(Either::Left),
        Err(err) => return upstream_error(forward, err),
    };
    remove_hop_by_hop(res.headers_mut());
    res.extensions_mut().insert(FromForward);
    res
}

pub(crate) fn stalled() -> Response<UpstreamBody> {
    error(
        StatusCode::REQUEST_TIMEOUT,
        "invalid_request_error",
        "request_body_timeout",
        "the request body stopped arriving".to_owned(),
    )
}

pub(crate) fn source_is<E: std::error::Error + 'static>(
    err: &(dyn std::error::Error + 'static),
) -> bool {
    let mut err = Some(err);
    while let Some(e) = err {
        if e.is::<E>() {
            return true;
        }
        err = e.source();
    }
    false
}

/// The 400 for a request whose body failed on the client's side (malformed `chunked` framing,
/// or the client left mid-body) while it was forwarded: the client's failure, not the
/// upstream's, so it is counted apart from upstream errors and logged below WARN (any client
/// could otherwise page an operator). A client that left never reads it.
fn request_body_failed(forward: &Forwarding, cause: &BoxError) -> Response<UpstreamBody> {
    forward.metrics.request_body_error();
    let mut detail = cause.to_string();
    let mut source = cause.source();
    while let Some(s) = source {
        detail.push_str(&format!(": {s}"));
        source = s.source();
    }
    tracing::info!("400: the request body failed on the client's side: {detail}");
    let mut res = error(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        "invalid_request_body",
        "the request body could not be read".to_owned(),
    );
    // The rest of the body is unread: the connection cannot carry another request.
    res.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    res
}

/// The 502 for a request the upstream did not answer. The client learns only which of the two
/// failures it was: the upstream's address and the OS error go to the log, not to a client.
fn upstream_error(forward: &Forwarding, err: SendError) -> Response<UpstreamBody> {
    let (code, what, message) = match &err {
        SendError::RequestBody(body) if source_is::<BodyStalled>(body.as_ref()) => {
            return stalled()
        }
        SendError::RequestBody(cause) => return request_body_failed(forward, cause),
        SendError::Timeout(limit) => {
            forward.metrics.upstream_error(UpstreamError::Timeout);
            tracing::warn!(
                upstream = %forward.upstream,
                "504: the upstream did not answer, or take the request, within {limit:?}"
            );
            return error(
                StatusCode::GATEWAY_TIMEOUT,
                "upstream_error",
                "upstream_timeout",
                "the upstream server did not answer in time".to_owned(),
            );
        }
        SendError::Connect(_) => {
            forward.metrics.upstream_error(UpstreamError::Connect);
            (
                "upstream_unreachable",
                "cannot reach the upstream",
                "the upstream server is unavailable",
            )
        }
        SendError::BeforeHead(_) => {
            forward.metrics.upstream_error(UpstreamError::BeforeHead);
            (
                "upstream_failed",
                "the upstream failed before its response head",
                "the upstream server failed before answering",
            )
        }
    };
    let mut detail = err.to_string();
    let mut source = std::error::Error::source(&err);
    while let Some(s) = source {
        detail.push_str(&format!(": {s}"));
        source = s.source();
    }
    tracing::warn!(upstream = %forward.upstream, "502: {what}: {detail}");
    error(
        StatusCode::BAD_GATEWAY,
        "upstream_error",
        code,
        message.to_owned(),
    )
}
