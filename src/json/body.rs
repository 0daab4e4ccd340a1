use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    /// The request body [`JsonGuard`](crate::json::JsonGuard) hands to its inner service.
    ///
    /// For a request the guard did not inspect, the client's body as it arrives (each chunk as
    /// `Bytes`, moved rather than copied when it already is `Bytes`), with its `size_hint` and
    /// `is_end_stream`. For an inspected request, the buffered body: the very `Bytes` the guard
    /// read when nothing was stripped, or the bytes before the annotations array, the new array
    /// and the bytes after it, then the client's trailers, if any.
    ///
    /// See the [module docs](crate::json).
    pub struct JsonGuardBody<B> {
        #[pin]
        inner: Inner<B>,
    }
}

pin_project! {
    #[project = InnerProj]
    enum Inner<B> {
        Passthrough {
            #[pin]
            body: B,
        },
        Buffered {
            // In reverse order: the next chunk is the last one.
            chunks: Vec<Bytes>,
            remaining: u64,
            trailers: Option<HeaderMap>,
        },
    }
}

impl<B> JsonGuardBody<B> {
    pub(crate) fn passthrough(body: B) -> Self {
        Self {
            inner: Inner::Passthrough { body },
        }
    }

    /// `chunks` in order.
    pub(crate) fn buffered(mut chunks: Vec<Bytes>, trailers: Option<HeaderMap>) -> Self {
        chunks.retain(|c| !c.is_empty());
        chunks.reverse();
        let remaining = chunks.iter().map(|c| c.len() as u64).sum();
        Self {
            inner: Inner::Buffered {
                chunks,
                remaining,
                trailers,
            },
        }
    }
}

/// The inner body's default, passed through (as for the crate's response bodies).
impl<B: Default> Default for JsonGuardBody<B> {
    fn default() -> Self {
        Self::passthrough(B::default())
    }
}

impl<B: std::fmt::Debug> std::fmt::Debug for JsonGuardBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner {
            Inner::Passthrough { body } => f.debug_tuple("Passthrough").field(body).finish(),
            Inner::Buffered {
                remaining,
                trailers,
                ..
            } => f
                .debug_struct("Buffered")
                .field("remaining", remaining)
                .field("trailers", &trailers.is_some())
                .finish(),
        }
    }
}

impl<B> Body for JsonGuardBody<B>
where
    B: Body,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().inner.project() {
            InnerProj::Passthrough { body } => body.poll_frame(cx).map(|frame| {
                frame.map(|frame| frame.map(|f| f.map_data(|mut d| d.copy_to_bytes(d.remaining()))))
            }),
            InnerProj::Buffered {
                chunks,
                remaining,
                trailers,
            } => Poll::Ready(match chunks.pop() {
                Some(chunk) => {
                    *remaining -= chunk.len() as u64;
                    Some(Ok(Frame::data(chunk)))
                }
                None => trailers.take().map(|t| Ok(Frame::trailers(t))),
            }),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Inner::Passthrough { body } => body.is_end_stream(),
            Inner::Buffered {
                chunks, trailers, ..
            } => chunks.is_empty() && trailers.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Passthrough { body } => body.size_hint(),
            Inner::Buffered { remaining, .. } => SizeHint::with_exact(*remaining),
        }
    }
}
