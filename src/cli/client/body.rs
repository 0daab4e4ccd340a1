//! The response body: reads the upstream's socket when polled.

use std::fmt;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::{Buf as _, Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use tokio::net::TcpStream;

use super::head::{Framing, Kind};
use super::invalid;
use super::pool::Pool;
use super::reading::Reading;

/// The body of an upstream response: reads the upstream's socket when polled, and yields what
/// each read brings as one frame (see the [module](super)).
pub struct UpstreamResponseBody {
    io: Option<TcpStream>,
    pub(super) read: Reading,
    /// The body failed: every later poll fails too, never ends cleanly.
    failed: bool,
    kind: Kind,
    reusable: bool,
    /// A frame was just yielded: hyper writes it before the socket is read again.
    yielded: bool,
    pool: Arc<Pool>,
}

impl fmt::Debug for UpstreamResponseBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpstreamResponseBody")
            .field("kind", &self.kind)
            .field("buffered", &self.read.buf.len())
            .finish_non_exhaustive()
    }
}

impl UpstreamResponseBody {
    pub(super) fn new(io: TcpStream, read: Reading, framing: Framing, pool: &Arc<Pool>) -> Self {
        let mut body = Self {
            io: Some(io),
            read,
            failed: false,
            kind: framing.kind,
            reusable: framing.reusable,
            yielded: false,
            pool: pool.clone(),
        };
        if matches!(body.kind, Kind::Length(0)) {
            body.finish();
        }
        body
    }

    /// The body is complete: its connection goes back to the pool if nothing follows it.
    fn finish(&mut self) {
        self.kind = Kind::Length(0);
        if let Some(io) = self.io.take() {
            if self.reusable && self.read.buf.is_empty() {
                self.pool.checkin(io);
            }
        }
        self.read.buf = BytesMut::new();
    }

    /// The body failed with `err`: its connection is closed, and it stays failed.
    fn fail(&mut self, err: io::Error) -> io::Error {
        self.io = None;
        self.failed = true;
        self.read.buf = BytesMut::new();
        err
    }

    /// What is buffered, decoded: `None` when nothing is.
    fn decode(&mut self) -> io::Result<Option<Bytes>> {
        if self.read.buf.is_empty() {
            return Ok(None);
        }
        let data = match &mut self.kind {
            Kind::Length(0) => {
                // Bytes past the end of the body: the connection cannot be reused.
                self.reusable = false;
                return Ok(None);
            }
            Kind::Length(left) => {
                let n = usize::try_from(*left)
                    .map_or(self.read.buf.len(), |l| l.min(self.read.buf.len()));
                *left -= n as u64;
                let data = self.read.buf.split_to(n).freeze();
                if *left == 0 {
                    self.finish();
                }
                data
            }
            Kind::Chunked(decoder) => {
                let decoded = decoder.decode(&mut self.read.buf).map_err(invalid)?;
                let done = decoder.is_done();
                self.read.buf.advance(decoded.start);
                let data = self.read.buf.split_to(decoded.end - decoded.start).freeze();
                self.read.buf.advance(decoded.consumed - decoded.end);
                if done {
                    self.finish();
                }
                data
            }
            Kind::Close => self.read.buf.split().freeze(),
        };
        Ok(Some(data))
    }
}

impl Body for UpstreamResponseBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = &mut *self;
        if this.failed {
            return Poll::Ready(Some(Err(io::Error::other(
                "the upstream's response body failed",
            ))));
        }
        loop {
            match this.decode() {
                Ok(Some(data)) if !data.is_empty() => {
                    this.yielded = true;
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Ok(_) => {}
                Err(err) => return Poll::Ready(Some(Err(this.fail(err)))),
            }
            let Some(io) = this.io.as_mut() else {
                return Poll::Ready(None);
            };
            if this.yielded {
                // What was just yielded is written before the next read.
                this.yielded = false;
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            match ready!(this.read.poll_fill(io, cx)) {
                Ok(0) if matches!(this.kind, Kind::Close) => {
                    this.io = None;
                    this.kind = Kind::Length(0);
                    return Poll::Ready(None);
                }
                Ok(0) => {
                    return Poll::Ready(Some(Err(this.fail(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the upstream closed the connection before the end of the response body",
                    )))));
                }
                Ok(_) => {}
                Err(err) => return Poll::Ready(Some(Err(this.fail(err)))),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.kind, Kind::Length(0))
    }

    fn size_hint(&self) -> SizeHint {
        match self.kind {
            Kind::Length(n) => SizeHint::with_exact(n),
            _ => SizeHint::default(),
        }
    }
}
