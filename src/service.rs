use std::sync::Arc;
use std::task::{Context, Poll};

use http::header::{ACCEPT_ENCODING, TE};
use http::{HeaderMap, HeaderValue, Method, Request, Response};
use tower_service::Service;

use crate::annotations::RequestedAnnotations;
use crate::body::BypassMarkerBody;
use crate::config::Config;
use crate::future::ResponseFuture;
use crate::observe::Observer;

/// Middleware that removes router-internal annotation frames from `text/event-stream` responses
/// unless the client opted in.
///
/// Made by [`BypassMarkerLayer`](crate::BypassMarkerLayer); see the [module docs](crate) for an example.
#[derive(Clone)]
pub struct BypassMarker<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> BypassMarker<S> {
    pub(crate) fn new(inner: S, config: Arc<Config>) -> Self {
        Self { inner, config }
    }

    /// Wraps `inner` with the default configuration ([`BypassMarkerLayer::new`](crate::BypassMarkerLayer::new)).
    pub fn with_defaults(inner: S) -> Self {
        Self::new(inner, Arc::new(Config::new()))
    }

    inner_service_accessors!();
}

impl<S: std::fmt::Debug> std::fmt::Debug for BypassMarker<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("BypassMarker");
        d.field("inner", &self.inner);
        self.config.debug_fields(&mut d);
        d.finish()
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for BypassMarker<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    type Response = Response<BypassMarkerBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<ReqBody>) -> Self::Future {
        let mut requested = req
            .extensions()
            .get::<RequestedAnnotations>()
            .map_or(0, |r| self.config.requested_mask(r));
        let mut observer = None;
        if self.config.grant.is_some() || self.config.observer.is_some() {
            let (parts, body) = req.into_parts();
            if let Some(grant) = &self.config.grant {
                requested |= self.config.requested_mask(&(grant.0)(&parts));
            }
            if let Some(config_observer) = &self.config.observer {
                observer = config_observer.0.for_request(&parts).map(Observer);
            }
            req = Request::from_parts(parts, body);
        }
        let head = req.method() == Method::HEAD;
        if !head && self.config.removal_mask(requested) != 0 {
            ask_for_identity(&mut req);
        }
        ResponseFuture::new(
            self.inner.call(req),
            self.config.clone(),
            requested,
            head,
            observer,
        )
    }
}

/// Asks the services below for an unencoded response: a request that may be answered with an event
/// stream to filter gets `accept-encoding: identity` in place of the client's codings, so that a
/// compression layer inside this one (or an upstream that compresses) leaves the stream readable,
/// and loses the transfer codings of its `TE` header (all but `trailers`, which gRPC needs), so
/// that an upstream does not answer with `transfer-encoding: gzip, chunked`. The layers outside
/// this one read the client's headers before they call it, and compress what it forwards. See
/// [where to put it](crate#where-to-put-it).
fn ask_for_identity<B>(req: &mut Request<B>) {
    let headers = req.headers_mut();
    only_trailers_in_te(headers);
    let mut values = headers.get_all(ACCEPT_ENCODING).iter();
    match (values.next(), values.next()) {
        (None, _) => return,
        (Some(only), None) if only.as_bytes().eq_ignore_ascii_case(b"identity") => return,
        _ => {}
    }
    #[cfg(feature = "tracing")]
    tracing::debug!(
        accept_encoding = ?headers.get(ACCEPT_ENCODING),
        "the inner service is asked for accept-encoding identity: compression inside the \
         bypass-marker layer is given up for this request, layers outside it still compress"
    );
    headers.insert(ACCEPT_ENCODING, HeaderValue::from_static("identity"));
}

/// Removes from `TE` every transfer coding the client would accept (`gzip`, `deflate`, any other),
/// keeping `trailers` (any case) if it is listed, and the header not at all otherwise.
fn only_trailers_in_te(headers: &mut HeaderMap) {
    let mut values = headers.get_all(TE).iter();
    let Some(first) = values.next() else {
        return;
    };
    if values.next().is_none() && first.as_bytes().eq_ignore_ascii_case(b"trailers") {
        return;
    }
    let trailers = headers.get_all(TE).iter().any(|value| {
        value.as_bytes().split(|&b| b == b',').any(|element| {
            // `trailers` takes no parameters; `trailers;q=1` is not it.
            element.trim_ascii().eq_ignore_ascii_case(b"trailers")
        })
    });
    if trailers {
        headers.insert(TE, HeaderValue::from_static("trailers"));
    } else {
        headers.remove(TE);
    }
}
