//! One client connection: its idle, header and write timeouts ([`Watch`]), and the request body's
//! stall timeout ([`StallTimeout`]).

use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Buf;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio::time::Sleep;

use crate::budget::Charge;
use crate::logs::RequestLog;
use tower_bypass_marker::BoxError;

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
        // A body the guard holds: its bytes are taken from the process's budget as they arrive.
        held: Option<Arc<HeldBody>>,
        received: u64,
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
            held: None,
            received: 0,
        }
    }

    /// Takes the bytes of this body from `held`'s budget as they arrive (beyond what it took
    /// already); a piece that does not fit fails the body with [`OverBudget`].
    pub(crate) fn held(mut self, held: Arc<HeldBody>) -> Self {
        self.held = Some(held);
        self
    }
}

/// Whether an `accept` error is about one connection (go on at once) rather than the process
/// (out of file descriptors or memory: back off). The sidecar's and the processor's accept loops
/// both ask it. A signal (`Interrupted`) or a connection gone before it was taken (`WouldBlock`)
/// is no reason to wait.
pub(crate) fn is_connection_error(err: &io::Error) -> bool {
    matches!(
        err.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionRefused
            | io::ErrorKind::Interrupted
            | io::ErrorKind::WouldBlock
    )
}

/// The share of the process's [`BodyBudget`] one request body holds while the guard reads it and
/// until the body has been forwarded (or refused): every clone of the `Arc` gone, it is given
/// back. The request body, its request's extensions and the body forwarded upstream each hold a
/// clone.
#[derive(Debug)]
pub(crate) struct HeldBody {
    charge: Mutex<Charge>,
    /// A piece of the body did not fit: the guard's 400 is the proxy's 503.
    pub(crate) over_budget: AtomicBool,
}

impl HeldBody {
    pub(crate) fn new(charge: Charge) -> Arc<Self> {
        Arc::new(Self {
            charge: Mutex::new(charge),
            over_budget: AtomicBool::new(false),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Charge> {
        self.charge.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The body has `received` bytes so far: takes what the charge lacks. `false`: over budget.
    fn received(&self, received: u64) -> bool {
        let mut charge = self.lock();
        let held = charge.held();
        if received <= held || charge.take(received - held) {
            return true;
        }
        self.over_budget.store(true, Ordering::Release);
        false
    }

    /// Gives the bytes back now: the body is gone.
    pub(crate) fn release(&self) {
        self.lock().release();
    }
}

/// A request body past the process's `--max-buffered-bytes`.
#[derive(Debug)]
pub(crate) struct OverBudget;

impl fmt::Display for OverBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the request bodies held would pass --max-buffered-bytes")
    }
}

impl std::error::Error for OverBudget {}

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
            if let (Some(held), Some(Ok(frame))) = (this.held.as_ref(), &frame) {
                if let Some(data) = frame.data_ref() {
                    *this.received += data.remaining() as u64;
                    if !held.received(*this.received) {
                        return Poll::Ready(Some(Err(Box::new(OverBudget))));
                    }
                }
            }
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

pin_project! {
    /// The request body as forwarded upstream, which gives its [`HeldBody`] back once it has
    /// ended or is dropped (the upload is done, or abandoned).
    pub(crate) struct Releasing<B> {
        #[pin]
        body: B,
        held: Option<Arc<HeldBody>>,
    }

    impl<B> PinnedDrop for Releasing<B> {
        fn drop(this: Pin<&mut Self>) {
            if let Some(held) = this.project().held.take() {
                held.release();
            }
        }
    }
}

impl<B> Releasing<B> {
    pub(crate) fn new(body: B, held: Option<Arc<HeldBody>>) -> Self {
        Self { body, held }
    }
}

impl<B: Body> Body for Releasing<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let poll = this.body.poll_frame(cx);
        if matches!(poll, Poll::Ready(None | Some(Err(_)))) {
            if let Some(held) = this.held.take() {
                held.release();
            }
        }
        poll
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

/// What one connection is doing, for its idle, header and write timeouts.
pub(crate) struct Watch {
    epoch: Instant,
    /// Requests whose response has not been written to the socket yet.
    in_flight: AtomicUsize,
    /// When the connection last became idle ([`stamp`]).
    idle_since: AtomicU64,
    /// When the first byte of the next request head arrived ([`stamp`]), 0 if none has.
    head_since: AtomicU64,
    /// When a write to the client found its socket full with no progress since ([`stamp`]), 0
    /// if the last write made progress.
    blocked_since: AtomicU64,
    /// The body of the request in flight stalled (see [`StallTimeout`]).
    pub(crate) stalled: AtomicBool,
    /// Close the connection abortively (an RST, `SO_LINGER` 0, no FIN) when it ends. Set when a
    /// response body failed (a cut stream: no client, HTTP/1.0's included, may take it for a
    /// complete one; [`Busy::cut`]), and when a write to the client timed out, so that the kernel
    /// frees the send buffer the client never read at once rather than keep it behind a FIN in
    /// FIN-WAIT-1 until it gives up on the orphan (nginx's `reset_timedout_connection`).
    pub(crate) reset: AtomicBool,
    /// Responses whose body has ended (or been dropped) while hyper may still hold their last
    /// bytes: they stay in flight, and their exchange open, until hyper flushes (see
    /// [`Watched`]'s `poll_flush`).
    finishing: Mutex<Vec<RequestLog>>,
    /// `finishing.len()`, read without the lock at every flush.
    finishing_len: AtomicUsize,
    changed: Notify,
}

impl Drop for Watch {
    fn drop(&mut self) {
        // Responses handed over after their connection had gone: never written whole.
        let finishing = self.finishing.get_mut().unwrap_or_else(|e| e.into_inner());
        for exchange in finishing.iter_mut() {
            exchange.complete = false;
        }
    }
}

/// Why [`Watch::expired`] completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Expired {
    /// Idle between requests for the idle timeout, or reading a request head for the header
    /// timeout.
    Idle,
    /// A write to the client made no progress for the write timeout.
    Write,
}

impl Watch {
    pub(crate) fn new() -> Arc<Self> {
        let epoch = Instant::now();
        Arc::new(Self {
            epoch,
            in_flight: AtomicUsize::new(0),
            idle_since: AtomicU64::new(stamp(epoch)),
            head_since: AtomicU64::new(0),
            blocked_since: AtomicU64::new(0),
            stalled: AtomicBool::new(false),
            reset: AtomicBool::new(false),
            finishing: Mutex::new(Vec::new()),
            finishing_len: AtomicUsize::new(0),
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

    /// A write to the client returned `poll`: the write clock starts at the first write that
    /// finds the socket full, and stops at the next that takes bytes.
    fn wrote(&self, poll: &Poll<io::Result<usize>>) {
        match poll {
            Poll::Pending => {
                if self.blocked_since.load(Ordering::Relaxed) == 0 {
                    self.blocked_since
                        .store(stamp(self.epoch), Ordering::Release);
                    self.changed.notify_one();
                }
            }
            Poll::Ready(Ok(n)) if *n > 0 => {
                if self.blocked_since.load(Ordering::Relaxed) != 0 {
                    self.blocked_since.store(0, Ordering::Release);
                }
            }
            Poll::Ready(_) => {}
        }
    }

    /// hyper flushed: every byte it had for the client is in the socket, so the responses that
    /// had ended are done (in flight no more, their exchanges complete).
    fn flushed(&self) {
        if self.finishing_len.load(Ordering::Relaxed) > 0 {
            self.finish(true);
        }
    }

    /// Ends the responses that were finishing; `written`: their last bytes reached the socket
    /// (else the connection ended before they did, and none of them is complete).
    fn finish(&self, written: bool) {
        let mut done = std::mem::take(&mut *self.lock_finishing());
        self.finishing_len.store(0, Ordering::Relaxed);
        if done.is_empty() {
            return;
        }
        self.idle_since.store(stamp(self.epoch), Ordering::Release);
        self.in_flight.fetch_sub(done.len(), Ordering::AcqRel);
        self.changed.notify_one();
        for exchange in &mut done {
            exchange.complete &= written;
        }
        // Logged and measured now.
        drop(done);
    }

    fn lock_finishing(&self) -> std::sync::MutexGuard<'_, Vec<RequestLog>> {
        self.finishing.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A request head was read: the connection is busy until the returned guard is dropped, or
    /// its response is written ([`Busy::finish`]).
    pub(crate) fn begin(self: &Arc<Self>) -> Busy {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.head_since.store(0, Ordering::Release);
        self.stalled.store(false, Ordering::Release);
        self.changed.notify_one();
        Busy {
            watch: self.clone(),
            handed_over: false,
        }
    }

    /// The instant `limit` after `since` (a [`stamp`]).
    fn after(&self, since: u64, limit: Duration) -> Instant {
        self.epoch + Duration::from_millis(since - 1) + limit
    }

    /// Completes when the connection has been idle for `idle`, has been reading a request head
    /// for `header`, or a write to the client has made no progress for `write`.
    pub(crate) async fn expired(
        &self,
        idle: Duration,
        header: Duration,
        write: Duration,
    ) -> Expired {
        loop {
            let notified = self.changed.notified();
            let write_at = match self.blocked_since.load(Ordering::Acquire) {
                0 => None,
                since => Some(self.after(since, write)),
            };
            let idle_at = if self.in_flight.load(Ordering::Acquire) > 0 {
                None
            } else {
                match self.head_since.load(Ordering::Acquire) {
                    0 => Some(self.after(self.idle_since.load(Ordering::Acquire), idle)),
                    since => Some(self.after(since, header)),
                }
            };
            let now = Instant::now();
            if write_at.is_some_and(|at| now >= at) {
                return Expired::Write;
            }
            if idle_at.is_some_and(|at| now >= at) {
                return Expired::Idle;
            }
            match write_at.into_iter().chain(idle_at).min() {
                None => notified.await,
                Some(at) => {
                    tokio::select! {
                        () = tokio::time::sleep_until(at.into()) => {}
                        () = notified => {}
                    }
                }
            }
        }
    }
}

/// A request in flight on a [`Watch`]ed connection.
pub(crate) struct Busy {
    watch: Arc<Watch>,
    /// The response is finishing ([`Busy::finish`]): the watch ends it.
    handed_over: bool,
}

impl Busy {
    /// The response's body has ended or been dropped: the request stays in flight, and
    /// `exchange` open, until hyper has written the response's last bytes to the socket (or the
    /// connection ends first: then the exchange is not complete).
    pub(crate) fn finish(&mut self, exchange: RequestLog) {
        if self.handed_over {
            return;
        }
        self.handed_over = true;
        let watch = &self.watch;
        let mut finishing = watch.lock_finishing();
        finishing.push(exchange);
        watch
            .finishing_len
            .store(finishing.len(), Ordering::Relaxed);
    }
}

impl Busy {
    /// The response's body failed: its connection is reset, never closed cleanly, so that no
    /// client (HTTP/1.0's included, whose response ends at the close) takes the cut stream for a
    /// complete one.
    pub(crate) fn cut(&self) {
        self.watch.reset.store(true, Ordering::Release);
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        if self.handed_over {
            return;
        }
        let watch = &self.watch;
        watch
            .idle_since
            .store(stamp(watch.epoch), Ordering::Release);
        watch.in_flight.fetch_sub(1, Ordering::AcqRel);
        watch.changed.notify_one();
    }
}

pin_project! {
    /// A client connection that tells its [`Watch`] when bytes arrive, when a write makes
    /// progress (or finds the socket full) and when hyper has flushed.
    ///
    /// Frames that are ready together go out in one write without help from here: the upstream's
    /// body yields what one read from the upstream brought as one frame
    /// ([`UpstreamResponseBody`](crate::UpstreamResponseBody)).
    pub(crate) struct Watched {
        #[pin]
        pub(crate) io: TcpStream,
        pub(crate) watch: Arc<Watch>,
    }

    impl PinnedDrop for Watched {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            // The connection is gone: responses whose last bytes were not flushed never will be.
            this.watch.finish(false);
            if this.watch.reset.load(Ordering::Acquire) {
                // The socket closes when `io` is dropped, right after this: with a linger of 0,
                // by an RST that frees its send buffer.
                let _ = rustix::net::sockopt::set_socket_linger(&*this.io, Some(Duration::ZERO));
            }
        }
    }
}

impl Watched {
    pub(crate) fn new(io: TcpStream, watch: Arc<Watch>) -> Self {
        Self { io, watch }
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
        let poll = this.io.poll_write(cx, buf);
        this.watch.wrote(&poll);
        poll
    }

    /// hyper calls it only once its write buffer is empty: every byte of the responses so far is
    /// in the socket.
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.project();
        let poll = this.io.poll_flush(cx);
        if let Poll::Ready(Ok(())) = poll {
            this.watch.flushed();
        }
        poll
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.project();
        if this.watch.reset.load(Ordering::Acquire) {
            // No FIN on a connection to be reset: the drop resets it.
            return Poll::Ready(Ok(()));
        }
        this.io.poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.project();
        let poll = this.io.poll_write_vectored(cx, bufs);
        this.watch.wrote(&poll);
        poll
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The access lines logged while `f` runs.
    fn access_lines(f: impl FnOnce()) -> String {
        #[derive(Clone, Default)]
        struct Captured(Arc<Mutex<Vec<u8>>>);
        impl io::Write for Captured {
            fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(buf);
                Ok(buf.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        let bytes = captured.0.lock().unwrap().clone();
        String::from_utf8(bytes).unwrap()
    }

    fn exchange(complete: bool) -> RequestLog {
        let metrics = Arc::new(crate::Metrics::new([], false));
        let mut exchange = RequestLog::begin(
            metrics,
            http::Method::GET,
            "/x".parse().unwrap(),
            None,
            http::HeaderValue::from_static("id"),
            Arc::default(),
        );
        exchange.complete = complete;
        exchange
    }

    /// A response whose body has ended stays in flight, and is logged, only once hyper has
    /// flushed its last bytes (`complete=true`), or when the connection ends first
    /// (`complete=false`): not when hyper drops the finished body.
    #[test]
    fn a_finished_response_is_done_when_flushed_and_incomplete_if_never_flushed() {
        for flushed in [true, false] {
            let watch = Watch::new();
            let logged = access_lines(|| {
                let mut busy = watch.begin();
                busy.finish(exchange(true));
                drop(busy);
                // Still in flight: the idle clock has not started, nothing is logged.
                assert_eq!(watch.in_flight.load(Ordering::Acquire), 1);
                if flushed {
                    watch.flushed();
                } else {
                    // What the connection's `Watched` does when it is dropped.
                    watch.finish(false);
                }
                assert_eq!(watch.in_flight.load(Ordering::Acquire), 0);
            });
            let line = logged.lines().find(|l| l.contains("bypass_marker::access"));
            let line = line.unwrap_or_else(|| panic!("no access line: {logged}"));
            assert!(line.contains(&format!("complete={flushed}")), "{line}");
        }
    }

    /// The write clock runs from the first write that found the socket full to the next write
    /// that took bytes.
    #[test]
    fn the_write_clock_runs_only_while_writes_make_no_progress() {
        let watch = Watch::new();
        watch.wrote(&Poll::Ready(Ok(10)));
        assert_eq!(watch.blocked_since.load(Ordering::Acquire), 0);
        watch.wrote(&Poll::Pending);
        let since = watch.blocked_since.load(Ordering::Acquire);
        assert_ne!(since, 0);
        // Still blocked: the clock keeps its start.
        watch.wrote(&Poll::Pending);
        assert_eq!(watch.blocked_since.load(Ordering::Acquire), since);
        watch.wrote(&Poll::Ready(Ok(1)));
        assert_eq!(watch.blocked_since.load(Ordering::Acquire), 0);
    }
}
