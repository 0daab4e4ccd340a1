use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes};
use http::header::CONTENT_LENGTH;
use http::{request, HeaderMap, HeaderValue, Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::config::ErrorBodyFn;
use crate::json::guard::join;
use crate::json::guard::{reads_content_type, BodyDecision, Refusal, RequestGuard};
use crate::json::{BudgetCharge, JsonGuardBody, ResponseBody};
use crate::observe::Observer;
use crate::{BoxError, RequestedAnnotations};

pin_project! {
    /// Response future for [`JsonGuard`](crate::json::JsonGuard): reads an inspected request's
    /// body, then calls the inner service with the guarded request, or answers with the guard's
    /// error.
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<JsonGuardBody<B>>>,
    {
        #[pin]
        state: State<S, S::Future, B>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, F, B> {
        Collecting {
            #[pin]
            body: B,
            collected: Collected<S>,
        },
        Calling {
            #[pin]
            future: F,
            granted: Option<RequestedAnnotations>,
        },
        Refused {
            refusal: Option<Refusal>,
            shape: Option<ErrorBodyFn>,
        },
    }
}

/// What a request being read carries besides its body.
struct Collected<S> {
    service: Option<S>,
    parts: Option<request::Parts>,
    guard: RequestGuard,
    /// The request's own observer, if it has one (else the guard's configuration's is told).
    observer: Option<Observer>,
    chunks: Vec<Bytes>,
    /// The bytes of `chunks`, taken from the guard's budget; given back when this is dropped
    /// (the body judged, or the future dropped).
    charge: BudgetCharge,
    received: usize,
    trailers: Option<HeaderMap>,
}

impl<S, B> ResponseFuture<S, B>
where
    S: Service<Request<JsonGuardBody<B>>>,
{
    pub(crate) fn call(future: S::Future) -> Self {
        Self {
            state: State::Calling {
                future,
                granted: None,
            },
        }
    }

    pub(crate) fn refused(refusal: Refusal, guard: &RequestGuard) -> Self {
        Self {
            state: State::Refused {
                refusal: Some(refusal),
                shape: guard.error_body(),
            },
        }
    }

    pub(crate) fn collect(
        parts: request::Parts,
        body: B,
        service: S,
        guard: RequestGuard,
        charge: BudgetCharge,
        observer: Option<Observer>,
    ) -> Self {
        Self {
            state: State::Collecting {
                body,
                collected: Collected {
                    service: Some(service),
                    parts: Some(parts),
                    guard,
                    observer,
                    chunks: Vec::new(),
                    charge,
                    received: 0,
                    trailers: None,
                },
            },
        }
    }
}

impl<S, B> std::fmt::Debug for ResponseFuture<S, B>
where
    S: Service<Request<JsonGuardBody<B>>>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            State::Collecting { collected, .. } => {
                return f
                    .debug_struct("ResponseFuture")
                    .field("received", &collected.received)
                    .finish_non_exhaustive()
            }
            State::Calling { .. } => "calling",
            State::Refused { .. } => "refused",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish_non_exhaustive()
    }
}

impl<S, B, ResBody> Future for ResponseFuture<S, B>
where
    S: Service<Request<JsonGuardBody<B>>, Response = Response<ResBody>>,
    B: Body,
    B::Error: Into<BoxError>,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.project().state;
        loop {
            let next = match state.as_mut().project() {
                StateProj::Collecting { body, collected } => match ready!(collected.read(body, cx))
                {
                    Ok(()) => collected.finish(),
                    Err(refusal) => {
                        collected
                            .guard
                            .report_refusal(collected.observer.as_ref(), &refusal);
                        State::Refused {
                            refusal: Some(refusal),
                            shape: collected.guard.error_body(),
                        }
                    }
                },
                StateProj::Calling { future, granted } => {
                    let mut res = ready!(future.poll(cx))?;
                    if let Some(granted) = granted.take() {
                        merge(res.extensions_mut(), granted);
                    }
                    return Poll::Ready(Ok(res.map(ResponseBody::service)));
                }
                StateProj::Refused { refusal, shape } => {
                    let refusal = refusal.take().expect("polled after completion");
                    return Poll::Ready(Ok(ResponseBody::refused(&refusal, shape.as_ref())));
                }
            };
            state.set(next);
        }
    }
}

impl<S> Collected<S> {
    /// Reads the body to its end, or to the first byte past the limit.
    fn read<B>(&mut self, mut body: Pin<&mut B>, cx: &mut Context<'_>) -> Poll<Result<(), Refusal>>
    where
        B: Body,
        B::Error: Into<BoxError>,
    {
        loop {
            let frame = match ready!(body.as_mut().poll_frame(cx)) {
                None => return Poll::Ready(Ok(())),
                Some(Err(error)) => {
                    let error: BoxError = error.into();
                    return Poll::Ready(Err(Refusal::for_body_error(&*error)));
                }
                Some(Ok(frame)) => frame,
            };
            match frame.into_data() {
                Ok(mut data) => {
                    let len = data.remaining();
                    self.received = self.received.saturating_add(len);
                    if self.received > self.guard.max_body() {
                        return Poll::Ready(Err(Refusal::too_large(self.guard.max_body())));
                    }
                    if !self.charge.take(len as u64) {
                        return Poll::Ready(Err(Refusal::over_budget()));
                    }
                    if len > 0 {
                        self.chunks.push(data.copy_to_bytes(len));
                    }
                }
                Err(frame) => {
                    if let Ok(trailers) = frame.into_trailers() {
                        self.trailers
                            .get_or_insert_with(HeaderMap::new)
                            .extend(trailers);
                    }
                }
            }
        }
    }

    /// The body has been read: guard it, and call the service or refuse.
    fn finish<F, B>(&mut self) -> State<S, F, B>
    where
        S: Service<Request<JsonGuardBody<B>>, Future = F>,
    {
        let body = join(std::mem::take(&mut self.chunks));
        let mut parts = self.parts.take().expect("finished once");
        let mut service = self.service.take().expect("finished once");
        let trailers = self.trailers.take();
        if body.is_empty() {
            let req = Request::from_parts(parts, JsonGuardBody::buffered(Vec::new(), trailers));
            return State::Calling {
                future: service.call(req),
                granted: None,
            };
        }
        let json = reads_content_type(&parts.headers);
        let (decision, stripped) = self.guard.judge(json, body.clone());
        self.guard
            .report(self.observer.as_ref(), stripped, &decision);
        let (chunks, granted) = match decision {
            BodyDecision::Forward { granted } => (vec![body], granted),
            BodyDecision::Splice { body, granted } => {
                if parts.headers.contains_key(CONTENT_LENGTH) {
                    parts
                        .headers
                        .insert(CONTENT_LENGTH, HeaderValue::from(body.len()));
                }
                (Vec::from(body.into_chunks()), granted)
            }
            BodyDecision::Refuse(refusal) => {
                return State::Refused {
                    refusal: Some(refusal),
                    shape: self.guard.error_body(),
                }
            }
        };
        let granted = if granted.is_empty() {
            None
        } else {
            merge(&mut parts.extensions, granted.clone());
            Some(granted)
        };
        let req = Request::from_parts(parts, JsonGuardBody::buffered(chunks, trailers));
        State::Calling {
            future: service.call(req),
            granted,
        }
    }
}

/// Adds `granted` to the `RequestedAnnotations` in `extensions`, or inserts it.
fn merge(extensions: &mut http::Extensions, granted: RequestedAnnotations) {
    match extensions.get_mut::<RequestedAnnotations>() {
        Some(existing) => existing.extend(granted.iter()),
        None => {
            extensions.insert(granted);
        }
    }
}
