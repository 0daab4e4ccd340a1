//! The hand-made body the tests, fuzz drivers and benchmarks of the workspace reach for most: one
//! that yields given chunks and is always ready.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use http_body::{Body, Frame};

/// A body that yields the given chunks as data frames, one per poll, never `Pending`, then ends.
///
/// Yielding allocates nothing: each chunk is handed over as it was given. The chunks may be any
/// [`Buf`], for a test of a layer over data that is not `Bytes`. Its `is_end_stream` is true once
/// every chunk is out; its size hint is the default (unknown), as a streamed upstream body's is.
#[derive(Debug, Clone)]
pub struct Chunks<D = Bytes>(VecDeque<D>);

impl<D> Chunks<D> {
    /// The body of `chunks`, in order.
    pub fn new(chunks: impl IntoIterator<Item = D>) -> Self {
        Self(chunks.into_iter().collect())
    }
}

impl Chunks {
    /// The body of `chunks`, borrowed for the program's life: no copy, no reference count.
    pub fn from_static(chunks: &[&'static [u8]]) -> Self {
        Self::new(chunks.iter().map(|&c| Bytes::from_static(c)))
    }
}

impl<D> Default for Chunks<D> {
    fn default() -> Self {
        Self(VecDeque::new())
    }
}

impl<D: Buf + Unpin> Body for Chunks<D> {
    type Data = D;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<D>, Infallible>>> {
        Poll::Ready(self.0.pop_front().map(|chunk| Ok(Frame::data(chunk))))
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_empty()
    }
}
