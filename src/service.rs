use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Method, Request, Response};
use tower_service::Service;

use crate::annotations::RequestedAnnotations;
use crate::body::BypassMarkerBody;
use crate::config::Config;
use crate::future::ResponseFuture;

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

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes `self`, returning the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
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

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let requested = req
            .extensions()
            .get::<RequestedAnnotations>()
            .map_or(0, |r| self.config.requested_mask(r));
        let head = req.method() == Method::HEAD;
        ResponseFuture::new(self.inner.call(req), self.config.clone(), requested, head)
    }
}
