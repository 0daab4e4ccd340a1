use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{header, HeaderValue, Response};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::config::{ErrorBodyFn, ErrorParts};
use crate::json::guard::Refusal;

pin_project! {
    /// The response body of [`JsonGuard`](crate::json::JsonGuard): the inner service's body,
    /// untouched, or the guard's own JSON error.
    ///
    /// See the [module docs](crate::json).
    pub struct ResponseBody<B> {
        #[pin]
        inner: Inner<B>,
    }
}

pin_project! {
    #[project = InnerProj]
    enum Inner<B> {
        Service {
            #[pin]
            body: B,
        },
        Refused {
            json: Option<Bytes>,
        },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn service(body: B) -> Self {
        Self {
            inner: Inner::Service { body },
        }
    }
}

/// The inner body's default, passed through: for layers outside the guard that build their own
/// response with `ResBody::default()` (tower-http's `TimeoutLayer`, `CorsLayer`, ...).
impl<B: Default> Default for ResponseBody<B> {
    fn default() -> Self {
        Self::service(B::default())
    }
}

impl<B: std::fmt::Debug> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner {
            Inner::Service { body } => f.debug_tuple("Service").field(body).finish(),
            Inner::Refused { json } => f.debug_tuple("Refused").field(json).finish(),
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().inner.project() {
            InnerProj::Service { body } => body.poll_frame(cx),
            InnerProj::Refused { json } => Poll::Ready(json.take().map(|j| Ok(Frame::data(j)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Inner::Service { body } => body.is_end_stream(),
            Inner::Refused { json } => json.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Service { body } => body.size_hint(),
            Inner::Refused { json } => {
                SizeHint::with_exact(json.as_ref().map_or(0, |j| j.len() as u64))
            }
        }
    }
}

impl<B> ResponseBody<B> {
    /// The guard's own response to a request it refuses.
    pub(crate) fn refused(refusal: &Refusal, shape: Option<&ErrorBodyFn>) -> Response<Self> {
        let (content_type, json) = match shape {
            None => (HeaderValue::from_static("application/json"), refusal.body()),
            Some(shape) => shape.shape(&ErrorParts {
                status: refusal.status(),
                kind: refusal.kind(),
                code: refusal.code(),
                message: refusal.message(),
            }),
        };
        let mut res = Response::new(ResponseBody {
            inner: Inner::Refused {
                json: Some(json.clone()),
            },
        });
        *res.status_mut() = refusal.status();
        res.headers_mut().insert(header::CONTENT_TYPE, content_type);
        res.headers_mut()
            .insert(header::CONTENT_LENGTH, HeaderValue::from(json.len()));
        if refusal.status() == http::StatusCode::SERVICE_UNAVAILABLE {
            res.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        res
    }
}
