//! What has been read from an upstream connection and not yet used: the buffer the head parser
//! and the body reader share.

use std::future::Future as _;
use std::io;
use std::task::{ready, Context, Poll};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt as _};

/// The room a read asks for starts at `READ_MIN` and doubles, up to `READ_MAX`, each time a read
/// fills it (a busy upstream), halving again when reads bring little: a quiet stream holds a
/// few KiB, not 64.
pub(super) const READ_MIN: usize = 4 * 1024;
pub(super) const READ_MAX: usize = 64 * 1024;

/// What has been read from an upstream connection and not yet used, and how much room the next
/// read asks for.
#[derive(Debug)]
pub(super) struct Reading {
    pub(super) buf: BytesMut,
    size: usize,
}

impl Default for Reading {
    fn default() -> Self {
        Self {
            buf: BytesMut::new(),
            size: READ_MIN,
        }
    }
}

impl Reading {
    /// Reads into the room left in the buffer (growing it when less than half a read is left):
    /// the number of bytes read, 0 at the end of the stream.
    ///
    /// Through tokio's `AsyncRead`, which takes a read that did not fill the room for the socket
    /// drained: the next read waits for the socket to be readable again instead of trying (and
    /// finding nothing) at once.
    pub(super) fn poll_fill<R>(
        &mut self,
        io: &mut R,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<usize>>
    where
        R: AsyncRead + Unpin,
    {
        if self.buf.capacity() - self.buf.len() < self.size / 2 {
            self.buf.reserve(self.size);
        }
        let room = self.buf.capacity() - self.buf.len();
        let n = ready!(std::pin::pin!(io.read_buf(&mut self.buf)).poll(cx))?;
        if n == room {
            self.size = (self.size * 2).min(READ_MAX);
        } else if n < self.size / 8 {
            self.size = (self.size / 2).max(READ_MIN);
        }
        Poll::Ready(Ok(n))
    }
}
