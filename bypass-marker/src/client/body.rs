//! The response body: reads the upstream's socket when polled.

use std::fmt;
use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf as _, Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use tokio::time::{Instant, Sleep};

use super::connection::Connection;
use super::head::{Framing, Kind};
use super::pool::Pool;
use super::reading::Reading;
use super::{invalid, OnExpiry};

/// The body of an upstream response: reads the upstream's socket when polled, and yields what
/// each read brings as one frame (the promises it keeps are listed in `src/client/mod.rs`).
pub struct UpstreamResponseBody {
    io: Option<Connection>,
    pub(super) read: Reading,
    /// The body failed: every later poll fails too, never ends cleanly.
    failed: bool,
    kind: Kind,
    reusable: bool,
    /// A frame was just yielded: hyper writes it before the socket is read again.
    yielded: bool,
    pool: Arc<Pool>,
    /// The idle timeout, if any.
    idle: Option<Box<Idle>>,
}

/// The longest pause between two reads of a body, while the body is asked for more: the clock
/// restarts at each read that brought bytes and each time the body is asked again after a frame
/// (a client that does not take the frames is `--write-timeout`'s business, not this).
struct Idle {
    timeout: Duration,
    last: Instant,
    /// Set for `last + timeout` or earlier, moved on only when it fires: a read costs a clock
    /// reading, not a timer update.
    sleep: Pin<Box<Sleep>>,
    on_expiry: Option<OnExpiry>,
}

impl Idle {
    /// Whether the pause has run past the timeout (else the timer wakes the task in time).
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        loop {
            if self.sleep.as_mut().poll(cx).is_pending() {
                return false;
            }
            let deadline = self.last + self.timeout;
            if deadline <= Instant::now() {
                return true;
            }
            self.sleep.as_mut().reset(deadline);
        }
    }
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
    pub(super) fn new(
        io: Connection,
        read: Reading,
        framing: Framing,
        pool: &Arc<Pool>,
        idle: Option<(Duration, Option<OnExpiry>)>,
    ) -> Self {
        let idle = idle.map(|(timeout, on_expiry)| {
            let last = Instant::now();
            Box::new(Idle {
                timeout,
                last,
                sleep: Box::pin(tokio::time::sleep_until(last + timeout)),
                on_expiry,
            })
        });
        let mut body = Self {
            io: Some(io),
            read,
            failed: false,
            kind: framing.kind,
            reusable: framing.reusable,
            yielded: false,
            pool: pool.clone(),
            idle,
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
                match io.into_reusable() {
                    Ok(Some(io)) => self.pool.checkin(io),
                    Ok(None) => {}
                    // The request body is still being sent: the connection goes back to the pool
                    // when it is, if it went well (as hyper's does).
                    Err(sending) => {
                        let pool = self.pool.clone();
                        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                            runtime.spawn(async move {
                                if let Some(io) = sending.sent().await {
                                    pool.checkin(io);
                                }
                            });
                        }
                    }
                }
            }
        }
        self.idle = None;
        self.read.buf = BytesMut::new();
    }

    /// The body failed with `err`: its connection is closed, and it stays failed.
    fn fail(&mut self, err: io::Error) -> io::Error {
        self.io = None;
        self.idle = None;
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
                if decoded.chunks > 1 && !self.read.filled {
                    super::reading::note_burst();
                }
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
                if let Some(idle) = &mut this.idle {
                    idle.last = Instant::now();
                }
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            let read = match this.read.poll_fill(io, cx) {
                Poll::Ready(read) => read,
                Poll::Pending => {
                    let Some(idle) = this.idle.as_mut() else {
                        return Poll::Pending;
                    };
                    if !idle.expired(cx) {
                        return Poll::Pending;
                    }
                    let timeout = idle.timeout;
                    if let Some(on_expiry) = &idle.on_expiry {
                        on_expiry();
                    }
                    return Poll::Ready(Some(Err(this.fail(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("no byte of the response body from the upstream for {timeout:?}"),
                    )))));
                }
            };
            match read {
                Ok(0) if matches!(this.kind, Kind::Close) => {
                    this.io = None;
                    this.idle = None;
                    this.kind = Kind::Length(0);
                    return Poll::Ready(None);
                }
                Ok(0) => {
                    return Poll::Ready(Some(Err(this.fail(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the upstream closed the connection before the end of the response body",
                    )))));
                }
                Ok(_) => {
                    if let Some(idle) = &mut this.idle {
                        idle.last = Instant::now();
                    }
                }
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
