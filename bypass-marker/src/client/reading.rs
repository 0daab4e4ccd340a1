//! What has been read from an upstream connection and not yet used: the buffer the head parser
//! and the body reader share.

use std::cell::Cell;
use std::future::Future as _;
use std::io;
use std::task::{ready, Context, Poll};
use std::time::Duration;

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
    /// The last read filled the room it was given: the socket may hold more.
    pub(super) filled: bool,
}

impl Default for Reading {
    fn default() -> Self {
        Self {
            buf: BytesMut::new(),
            size: READ_MIN,
            filled: false,
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
        self.filled = n == room;
        if self.filled {
            self.size = (self.size * 2).min(READ_MAX);
        } else if n < self.size / 8 {
            self.size = (self.size / 2).max(READ_MIN);
        }
        Poll::Ready(Ok(n))
    }
}

thread_local! {
    /// Whether a read on this thread found an upstream writing faster than it was read, since
    /// the thread last slept (see [`note_burst`] and [`before_park`]).
    static BURST: Cell<bool> = const { Cell::new(false) };
}

/// Records that a read found an upstream writing faster than it is read, in small pieces: two
/// chunks or more in a read that drained the socket. (A read that fills its room is as large as
/// reads get: waiting would not make it larger.)
pub(super) fn note_burst() {
    BURST.with(|burst| burst.set(true));
}

/// Called by a serving thread when it has nothing to do and is about to sleep until a socket is
/// ready. When a read of its last turn found an upstream writing faster than it was read
/// ([`note_burst`]), the thread first waits `wait`, so that the upstreams' next writes are read
/// together, many events a read, instead of each waking the thread for one or two (see
/// `--read-coalesce`). A thread whose reads each bring one chunk (streams paced slower than the
/// thread reads them) never waits: their events are read as they come.
///
/// Returns whether it waited.
pub(crate) fn before_park(wait: Duration) -> bool {
    if BURST.with(|burst| burst.replace(false)) && !wait.is_zero() {
        std::thread::sleep(wait);
        return true;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_waits_once_per_burst_and_never_with_a_zero_wait() {
        let wait = Duration::from_micros(1);
        assert!(!before_park(wait), "no burst yet");
        note_burst();
        note_burst();
        assert!(before_park(wait), "a burst since the last sleep");
        assert!(!before_park(wait), "the burst was taken by the last wait");
        note_burst();
        assert!(!before_park(Duration::ZERO), "0 never waits");
        assert!(!before_park(wait), "a zero wait takes the burst too");
    }
}
