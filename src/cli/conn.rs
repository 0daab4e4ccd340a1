//! One client connection: its idle and header timeouts ([`Watch`]), and the request body's stall
//! timeout ([`StallTimeout`]).

use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio::time::Sleep;

use crate::BoxError;

pin_project! {
    /// A request body that fails with [`BodyStalled`] when no frame arrives for `timeout`, and
    /// tells its connection's [`Watch`].
    pub struct StallTimeout<B> {
        #[pin]
        body: B,
        #[pin]
        sleep: Sleep,
        armed: bool,
        timeout: Duration,
        watch: Arc<Watch>,
    }
}

impl<B> StallTimeout<B> {
    pub(crate) fn new(body: B, timeout: Duration, watch: Arc<Watch>) -> Self {
        Self {
            body,
            sleep: tokio::time::sleep(timeout),
            armed: false,
            timeout,
            watch,
        }
    }
}

/// A request body stopped arriving.
#[derive(Debug)]
pub(crate) struct BodyStalled(Duration);

impl fmt::Display for BodyStalled {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "no request body data for {:?}", self.0)
    }
}

impl std::error::Error for BodyStalled {}

impl<B> Body for StallTimeout<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Data = B::Data;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let mut this = self.project();
        if let Poll::Ready(frame) = this.body.poll_frame(cx) {
            *this.armed = false;
            return Poll::Ready(frame.map(|r| r.map_err(Into::into)));
        }
        if !*this.armed {
            *this.armed = true;
            let deadline = tokio::time::Instant::now() + *this.timeout;
            this.sleep.as_mut().reset(deadline);
        }
        match this.sleep.poll(cx) {
            Poll::Ready(()) => {
                this.watch.stalled.store(true, Ordering::Release);
                Poll::Ready(Some(Err(Box::new(BodyStalled(*this.timeout)))))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// Milliseconds since `epoch`, plus one, so that 0 can mean "never".
fn stamp(epoch: Instant) -> u64 {
    epoch.elapsed().as_millis() as u64 + 1
}

/// What one connection is doing, for its idle and header timeouts.
pub(crate) struct Watch {
    epoch: Instant,
    /// Requests whose response has not finished.
    in_flight: AtomicUsize,
    /// When the connection last became idle ([`stamp`]).
    idle_since: AtomicU64,
    /// When the first byte of the next request head arrived ([`stamp`]), 0 if none has.
    head_since: AtomicU64,
    /// The body of the request in flight stalled (see [`StallTimeout`]).
    pub(crate) stalled: AtomicBool,
    changed: Notify,
}

impl Watch {
    pub(crate) fn new() -> Arc<Self> {
        let epoch = Instant::now();
        Arc::new(Self {
            epoch,
            in_flight: AtomicUsize::new(0),
            idle_since: AtomicU64::new(stamp(epoch)),
            head_since: AtomicU64::new(0),
            stalled: AtomicBool::new(false),
            changed: Notify::new(),
        })
    }

    /// Bytes arrived.
    fn read(&self) {
        if self.in_flight.load(Ordering::Acquire) == 0
            && self.head_since.load(Ordering::Relaxed) == 0
        {
            self.head_since.store(stamp(self.epoch), Ordering::Release);
            self.changed.notify_one();
        }
    }

    /// A request head was read: the connection is busy until the returned guard is dropped.
    pub(crate) fn begin(self: &Arc<Self>) -> Busy {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.head_since.store(0, Ordering::Release);
        self.stalled.store(false, Ordering::Release);
        self.changed.notify_one();
        Busy(self.clone())
    }

    /// Completes when the connection has been idle for `idle`, or has been reading a request head
    /// for `header`.
    pub(crate) async fn expired(&self, idle: Duration, header: Duration) {
        loop {
            let notified = self.changed.notified();
            let deadline = if self.in_flight.load(Ordering::Acquire) > 0 {
                None
            } else {
                match self.head_since.load(Ordering::Acquire) {
                    0 => Some((self.idle_since.load(Ordering::Acquire), idle)),
                    since => Some((since, header)),
                }
            };
            match deadline {
                None => notified.await,
                Some((since, limit)) => {
                    let at = self.epoch + Duration::from_millis(since - 1) + limit;
                    tokio::select! {
                        () = tokio::time::sleep_until(at.into()) => {
                            if Instant::now() >= at && self.in_flight.load(Ordering::Acquire) == 0 {
                                return;
                            }
                        }
                        () = notified => {}
                    }
                }
            }
        }
    }
}

/// A request in flight on a [`Watch`]ed connection.
pub(crate) struct Busy(Arc<Watch>);

impl Drop for Busy {
    fn drop(&mut self) {
        let watch = &self.0;
        watch
            .idle_since
            .store(stamp(watch.epoch), Ordering::Release);
        watch.in_flight.fetch_sub(1, Ordering::AcqRel);
        watch.changed.notify_one();
    }
}

/// Up to this many bytes are gathered into one write (see [`Watched`]).
const GATHER_MAX: usize = 32 * 1024;

pin_project! {
    /// A connection that tells its [`Watch`] when bytes arrive, and gathers the frames that are
    /// ready into one write.
    ///
    /// hyper writes as soon as the response body has no frame ready; the upstream's body hands
    /// over one frame at a time (hyper's client decodes one chunk, then waits for it to be
    /// taken), so every event would cost a `write` of its own even when many arrived in one read.
    /// When hyper asks to write more bytes than the last time, the write yields once instead:
    /// the task is woken at once and runs again after the tasks already ready on this thread,
    /// among them the upstream connection's, which decodes the next chunk if it has one (from
    /// its buffer, or from a read that does not wait). The write happens as soon as a turn
    /// brings nothing new (nothing more is ready: nothing waits for data that has not arrived),
    /// or `GATHER_MAX` bytes are waiting.
    pub(crate) struct Watched {
        #[pin]
        pub(crate) io: TcpStream,
        pub(crate) watch: Arc<Watch>,
        // The length of the write that last yielded; 0 after a write.
        pub(crate) gathered: usize,
    }
}

impl Watched {
    pub(crate) fn new(io: TcpStream, watch: Arc<Watch>) -> Self {
        Self {
            io,
            watch,
            gathered: 0,
        }
    }
}

/// Whether a write of `len` bytes yields once more (see [`Watched`]).
fn gather(gathered: &mut usize, len: usize, cx: &Context<'_>) -> bool {
    if len > *gathered && len < GATHER_MAX {
        *gathered = len;
        cx.waker().wake_by_ref();
        true
    } else {
        *gathered = 0;
        false
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.project();
        let before = buf.filled().len();
        let poll = this.io.poll_read(cx, buf);
        if buf.filled().len() > before {
            this.watch.read();
        }
        poll
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.project();
        if gather(this.gathered, buf.len(), cx) {
            return Poll::Pending;
        }
        this.io.poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.project().io.poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.project().io.poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.project();
        let len = bufs.iter().map(|b| b.len()).sum();
        if gather(this.gathered, len, cx) {
            return Poll::Pending;
        }
        this.io.poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}
