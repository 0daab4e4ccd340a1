use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

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

/// Why the guard answered a request itself.
#[derive(Debug)]
pub(crate) struct Refusal {
    pub(crate) status: StatusCode,
    pub(crate) code: &'static str,
    pub(crate) message: String,
}

impl Refusal {
    pub(crate) fn new(status: StatusCode, code: &'static str, message: String) -> Self {
        Self {
            status,
            code,
            message,
        }
    }

    /// The response, an error in OpenAI's shape:
    /// `{"error":{"message":...,"type":"invalid_request_error","param":null,"code":...}}`.
    pub(crate) fn into_response<B>(self) -> Response<ResponseBody<B>> {
        let json = serde_json::json!({
            "error": {
                "message": self.message,
                "type": "invalid_request_error",
                "param": null,
                "code": self.code,
            }
        });
        let json = Bytes::from(json.to_string());
        let mut res = Response::new(ResponseBody {
            inner: Inner::Refused {
                json: Some(json.clone()),
            },
        });
        *res.status_mut() = self.status;
        res.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        res.headers_mut()
            .insert(header::CONTENT_LENGTH, HeaderValue::from(json.len()));
        res
    }
}
