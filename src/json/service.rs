use std::task::{Context, Poll};

use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use crate::BoxError;

use crate::json::guard::{HeadDecision, Refusal, RequestGuard};
use crate::json::{GuardBudget, JsonGuardBody, JsonGuardLayer, ResponseBody, ResponseFuture};

/// Middleware that strips router-owned names from the `nvext.annotations` of JSON request bodies
/// and puts the client's opt-in in the request's extensions.
///
/// Made by [`JsonGuardLayer`]; see the [module docs](crate::json) for the rules and an example.
#[derive(Clone)]
pub struct JsonGuard<S> {
    inner: S,
    guard: RequestGuard,
    budget: GuardBudget,
}

impl<S> JsonGuard<S> {
    pub(crate) fn new(inner: S, layer: JsonGuardLayer) -> Self {
        Self {
            inner,
            guard: layer.request_guard(),
            budget: layer.budget,
        }
    }

    inner_service_accessors!();
}

impl<S: std::fmt::Debug> std::fmt::Debug for JsonGuard<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JsonGuard")
            .field("inner", &self.inner)
            .field("guard", &self.guard)
            .field("budget", &self.budget)
            .finish()
    }
}

impl<S, B, ResBody> Service<Request<B>> for JsonGuard<S>
where
    S: Service<Request<JsonGuardBody<B>>, Response = Response<ResBody>> + Clone,
    B: Body,
    B::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let body = req.body();
        let body_empty = body.is_end_stream() || body.size_hint().exact() == Some(0);
        let refusal = match self.guard.check_head(req.headers(), body_empty) {
            HeadDecision::Skip => {
                return ResponseFuture::call(self.inner.call(req.map(JsonGuardBody::passthrough)))
            }
            HeadDecision::Refuse(refusal) => Some(refusal),
            // A body whose own size hint says it is over the cap is refused before it is read too.
            HeadDecision::Read if req.body().size_hint().lower() > self.guard.max_body() as u64 => {
                Some(Refusal::too_large(self.guard.max_body()))
            }
            HeadDecision::Read => None,
        };
        let (parts, body) = req.into_parts();
        let observer = self.guard.observer_for(&parts);
        if let Some(refusal) = refusal {
            self.guard.report_refusal(observer.as_ref(), &refusal);
            return ResponseFuture::refused(refusal, &self.guard);
        }
        // The service that was made ready goes with the request; `self` keeps a clone.
        let clone = self.inner.clone();
        let service = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::collect(
            parts,
            body,
            service,
            self.guard.clone(),
            self.budget.charge(),
            observer,
        )
    }
}
