//! One client connection: its idle, header and write timeouts ([`Watch`]), and the request body's
//! stall timeout ([`StallTimeout`]).

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use http_body::{Body, Frame, SizeHint};
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::TokioIo;
use pin_project_lite::pin_project;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio::time::Sleep;

use crate::cli::logs::Exchange;
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
    /// Responses whose body has ended (or been dropped) while hyper may still hold their last
    /// bytes: they stay in flight, and their exchange open, until hyper flushes (see
    /// [`Watched`]'s `poll_flush`).
    finishing: Mutex<Vec<Exchange>>,
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

    fn lock_finishing(&self) -> std::sync::MutexGuard<'_, Vec<Exchange>> {
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
    pub(crate) fn finish(&mut self, exchange: Exchange) {
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
    /// among them the upstream connection's, which decodes the next chunk if it already has it
    /// in its buffer. While a write is gathering, the upstream connections of this thread do not
    /// read their sockets (see [`Gate`]): a complete frame is written before the next read. The
    /// write happens as soon as a turn brings nothing new (nothing waits for data that has not
    /// arrived), or `GATHER_MAX` bytes are waiting.
    pub(crate) struct Watched {
        #[pin]
        pub(crate) io: TcpStream,
        pub(crate) watch: Arc<Watch>,
        gathering: Gathering,
    }

    impl PinnedDrop for Watched {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            this.gathering.release();
            // The connection is gone: responses whose last bytes were not flushed never will be.
            this.watch.finish(false);
        }
    }
}

impl Watched {
    pub(crate) fn new(io: TcpStream, watch: Arc<Watch>) -> Self {
        Self {
            io,
            watch,
            gathering: Gathering::default(),
        }
    }
}

/// After this many yields in a row that brought nothing new, a connection writes at once ...
const MISSES_BEFORE_SKIPPING: u8 = 2;
/// ... except for one write in this many, which yields again to see whether frames now come
/// together.
const PROBE_EVERY: u8 = 8;

/// The gathering state of one connection (see [`Watched`]).
#[derive(Default)]
struct Gathering {
    /// The length of the write that last yielded; 0 after a write.
    len: usize,
    /// The closing of the gate this connection holds while it yields.
    closed: Option<Closing>,
    /// Yields in a row that brought nothing new.
    misses: u8,
    /// Writes made at once since the last yield.
    skipped: u8,
    /// The last write did not take all its bytes (the client's socket is full): the rest goes
    /// at once, with no yield.
    blocked: bool,
}

impl Gathering {
    /// Whether a write of `len` bytes yields once more (see [`Watched`]). While it does, the
    /// gate of this thread is held closed; it opens before the write.
    ///
    /// When frames arrive one at a time (a paced stream: an event every few milliseconds), a
    /// yield brings nothing and costs a turn of two tasks per event; after
    /// [`MISSES_BEFORE_SKIPPING`] such yields in a row the connection writes at once, and tries a
    /// yield again every [`PROBE_EVERY`] writes. A write that follows one the socket did not
    /// take whole does not yield: its bytes were ready long ago.
    fn hold(&mut self, len: usize, cx: &Context<'_>) -> bool {
        if self.len > 0 && len > self.len {
            // The last yield brought more.
            self.misses = 0;
        }
        if self.blocked || len >= GATHER_MAX || len <= self.len {
            if self.len > 0 && len == self.len {
                self.misses = self.misses.saturating_add(1);
            }
            self.release();
            return false;
        }
        if self.len == 0 {
            if self.misses >= MISSES_BEFORE_SKIPPING && self.skipped < PROBE_EVERY - 1 {
                self.skipped += 1;
                return false;
            }
            self.skipped = 0;
        }
        self.len = len;
        if self.closed.is_none() {
            self.closed = Some(Gate::close_current());
        }
        cx.waker().wake_by_ref();
        true
    }

    /// Records how much of a write of `len` bytes the socket took.
    fn wrote(&mut self, len: usize, poll: &Poll<io::Result<usize>>) {
        self.blocked = match poll {
            Poll::Ready(Ok(n)) => *n < len,
            Poll::Ready(Err(_)) => false,
            Poll::Pending => true,
        };
    }

    /// Ends a gathering: the write happens now (or the connection ends).
    fn release(&mut self) {
        self.len = 0;
        if let Some(closing) = self.closed.take() {
            closing.gate.release(closing.number);
        }
    }
}

/// Keeps the upstream connections of a thread from reading while a client connection of that
/// thread gathers frames for a write (see [`Watched`]), so that a frame that is complete is
/// written before the upstream's socket is read again.
///
/// One per thread. A gathering connection takes a numbered closing of the gate of the thread it
/// runs on and keeps it until it writes (tasks may move between threads on a multi-threaded
/// runtime: it releases the closing of the gate it took it from). An upstream connection asks the
/// gate of the thread it runs on; when closings are held, the read waits (its waker is kept) until
/// every closing taken before it was first put off is released. Closings taken later do not hold
/// it: every connection that had taken a frame of this upstream had closed the gate before the
/// read was tried (hyper's client reads only once its one-item body channel is empty, that is
/// once the connection has taken the last frame, and that connection closes the gate in the same
/// poll, before the upstream's task can run), so all of them have written. A read thus waits for
/// the writes already under way, never for a stream of later ones.
#[derive(Default)]
pub(crate) struct Gate {
    state: Mutex<GateState>,
}

#[derive(Default)]
struct GateState {
    /// The number of the first closing in `held`.
    first: u64,
    /// The closings from `first` on, in the order they were taken: true while still held.
    held: VecDeque<bool>,
    /// Upstream reads waiting: until every closing up to this number is released.
    waiting: Vec<(u64, Waker)>,
}

thread_local! {
    static GATE: Arc<Gate> = Arc::default();
}

/// A closing of a [`Gate`], held by a gathering connection until it writes.
struct Closing {
    gate: Arc<Gate>,
    number: u64,
}

impl Gate {
    /// Takes a closing of this thread's gate.
    fn close_current() -> Closing {
        let gate = GATE.with(Arc::clone);
        let number = {
            let mut state = gate.lock();
            state.held.push_back(true);
            state.first + state.held.len() as u64 - 1
        };
        Closing { gate, number }
    }

    /// Releases closing `number`: the reads that waited only for it and earlier ones are woken.
    fn release(&self, number: u64) {
        let woken = {
            let mut state = self.lock();
            let index = (number - state.first) as usize;
            state.held[index] = false;
            let before = state.first;
            while state.held.front() == Some(&false) {
                state.held.pop_front();
                state.first += 1;
            }
            if state.first == before || state.waiting.is_empty() {
                return;
            }
            let first = state.first;
            let (ready, still): (Vec<_>, Vec<_>) = std::mem::take(&mut state.waiting)
                .into_iter()
                .partition(|(upto, _)| *upto < first);
            state.waiting = still;
            ready
        };
        for (_, waker) in woken {
            waker.wake();
        }
    }

    /// Whether a read may go ahead on this thread now; if not, `cx` is woken when it may.
    ///
    /// `waited` is the read's ticket: the gate and the last closing taken when the read was first
    /// put off. `empty` tells whether the socket has nothing to read yet (and if so, arranges for
    /// `cx` to be woken when it has): such a read waits for the socket, as it would anyway, not
    /// for the gate (which would cost one more poll of its connection when the gate opens).
    fn ready(
        waited: &mut Option<(Arc<Gate>, u64)>,
        cx: &mut Context<'_>,
        empty: impl FnOnce(&mut Context<'_>) -> bool,
    ) -> bool {
        GATE.with(|gate| {
            let mut state = gate.lock();
            let upto = match waited {
                // A ticket of this gate: has every closing up to it been released?
                Some((of, upto)) if Arc::ptr_eq(of, gate) => *upto,
                _ => {
                    if state.held.is_empty() {
                        *waited = None;
                        return true;
                    }
                    if empty(cx) {
                        *waited = None;
                        return false;
                    }
                    let upto = state.first + state.held.len() as u64 - 1;
                    *waited = Some((gate.clone(), upto));
                    upto
                }
            };
            if upto < state.first {
                *waited = None;
                return true;
            }
            if let Some(entry) = state
                .waiting
                .iter_mut()
                .find(|(_, w)| w.will_wake(cx.waker()))
            {
                entry.0 = upto;
            } else {
                state.waiting.push((upto, cx.waker().clone()));
            }
            false
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        // The state stays consistent whatever panicked while holding it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// An upstream connection that reads only while its thread's [`Gate`] lets it.
pub(crate) struct Gated {
    io: TokioIo<TcpStream>,
    /// When a read was put off: the gate, and the last closing taken then.
    waited: Option<(Arc<Gate>, u64)>,
}

impl Gated {
    pub(crate) fn new(io: TokioIo<TcpStream>) -> Self {
        Self { io, waited: None }
    }
}

impl hyper::rt::Read for Gated {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let socket = this.io.inner();
        if !Gate::ready(&mut this.waited, cx, |cx| {
            socket.poll_read_ready(cx).is_pending()
        }) {
            return Poll::Pending;
        }
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl hyper::rt::Write for Gated {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
}

impl Connection for Gated {
    fn connected(&self) -> Connected {
        self.io.connected()
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
        if this.gathering.hold(buf.len(), cx) {
            return Poll::Pending;
        }
        let poll = this.io.poll_write(cx, buf);
        this.gathering.wrote(buf.len(), &poll);
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
        this.gathering.release();
        this.io.poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.project();
        let len = bufs.iter().map(|b| b.len()).sum();
        if this.gathering.hold(len, cx) {
            return Poll::Pending;
        }
        let poll = this.io.poll_write_vectored(cx, bufs);
        this.gathering.wrote(len, &poll);
        this.watch.wrote(&poll);
        poll
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::task::Wake;

    use tokio::io::AsyncWriteExt as _;
    use tokio::net::TcpListener;

    use super::*;

    /// Counts its wake-ups.
    #[derive(Default)]
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    impl Count {
        fn woken(&self) -> usize {
            self.0.load(Ordering::SeqCst)
        }
    }

    /// Both ends of a connection on 127.0.0.1.
    async fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let near = TcpStream::connect(listener.local_addr().unwrap());
        let (near, far) = tokio::join!(near, listener.accept());
        (near.unwrap(), far.unwrap().0)
    }

    /// A client connection that gathers, and an upstream connection with bytes waiting to be read.
    async fn setup() -> (Watched, TcpStream, Gated, TcpStream) {
        let (client_near, client_far) = pair().await;
        let (mut upstream_far, upstream_near) = pair().await;
        upstream_far.write_all(b"data: 2\n\n").await.unwrap();
        // The bytes have reached the upstream connection's socket.
        upstream_near.readable().await.unwrap();
        (
            Watched::new(client_far, Watch::new()),
            client_near,
            Gated::new(TokioIo::new(upstream_near)),
            upstream_far,
        )
    }

    /// Waits (up to 10 s) until `done` holds, letting the runtime's reactor run.
    async fn until(done: impl Fn() -> bool) {
        for _ in 0..1000 {
            if done() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("not done after 10 s");
    }

    /// A writer's waker, and a reader's waker with its count of wake-ups.
    fn wakers() -> (Arc<Count>, Waker, Waker) {
        let reader = Arc::new(Count::default());
        let reader_waker = Waker::from(reader.clone());
        (
            reader,
            Waker::from(Arc::new(Count::default())),
            reader_waker,
        )
    }

    fn contexts<'a>(waker: &'a Waker, reader: &'a Waker) -> (Context<'a>, Context<'a>) {
        (Context::from_waker(waker), Context::from_waker(reader))
    }

    fn read(gated: &mut Gated, cx: &mut Context<'_>) -> Poll<usize> {
        let mut storage = [0u8; 64];
        let mut buf = hyper::rt::ReadBuf::new(&mut storage);
        match hyper::rt::Read::poll_read(Pin::new(gated), cx, buf.unfilled()) {
            Poll::Ready(read) => {
                read.unwrap();
                Poll::Ready(buf.filled().len())
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn write(watched: &mut Watched, cx: &mut Context<'_>, bytes: &[u8]) -> Poll<usize> {
        Pin::new(watched)
            .poll_write(cx, bytes)
            .map(|written| written.unwrap())
    }

    #[tokio::test]
    async fn the_upstream_is_not_read_while_a_complete_frame_waits_to_be_written() {
        let (mut watched, _client, mut upstream, _far) = setup().await;
        let (writer, reader) = (Arc::new(Count::default()), Arc::new(Count::default()));
        let writer_waker = Waker::from(writer.clone());
        let reader_waker = Waker::from(reader.clone());
        let (mut wcx, mut rcx) = (
            Context::from_waker(&writer_waker),
            Context::from_waker(&reader_waker),
        );

        // The first attempt to write a frame yields once (its task is woken at once) ...
        assert!(write(&mut watched, &mut wcx, b"data: 1\n\n").is_pending());
        assert_eq!(writer.woken(), 1);
        // ... and until it has written, the upstream's bytes stay in its socket.
        assert!(read(&mut upstream, &mut rcx).is_pending());
        assert_eq!(reader.woken(), 0);
        // The next turn brings nothing new: the frame is written, and the read may go ahead.
        assert_eq!(
            write(&mut watched, &mut wcx, b"data: 1\n\n"),
            Poll::Ready(9)
        );
        assert_eq!(reader.woken(), 1);
        assert_eq!(read(&mut upstream, &mut rcx), Poll::Ready(9));
    }

    #[tokio::test]
    async fn a_write_that_grew_yields_again_and_one_that_did_not_is_written() {
        let (mut watched, _client, _upstream, _far) = setup().await;
        let count = Arc::new(Count::default());
        let waker = Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);
        assert!(write(&mut watched, &mut cx, b"data: 1\n\n").is_pending());
        assert!(write(&mut watched, &mut cx, b"data: 1\n\ndata: 2\n\n").is_pending());
        assert_eq!(
            write(&mut watched, &mut cx, b"data: 1\n\ndata: 2\n\n"),
            Poll::Ready(18)
        );
        // After a write, the next one gathers again.
        assert!(write(&mut watched, &mut cx, b"data: 3\n\n").is_pending());
        assert_eq!(count.woken(), 3);
    }

    #[tokio::test]
    async fn a_write_of_the_gathering_limit_is_not_held() {
        let (mut watched, _client, mut upstream, _far) = setup().await;
        let waker = Waker::from(Arc::new(Count::default()));
        let mut cx = Context::from_waker(&waker);
        let big = vec![b'x'; GATHER_MAX];
        assert!(matches!(write(&mut watched, &mut cx, &big), Poll::Ready(n) if n > 0));
        assert_eq!(read(&mut upstream, &mut cx), Poll::Ready(9));
    }

    #[tokio::test]
    async fn a_connection_dropped_while_gathering_lets_the_upstream_read() {
        let (mut watched, _client, mut upstream, _far) = setup().await;
        let (reader, waker, reader_waker) = wakers();
        let (mut cx, mut rcx) = contexts(&waker, &reader_waker);
        assert!(write(&mut watched, &mut cx, b"data: 1\n\n").is_pending());
        assert!(read(&mut upstream, &mut rcx).is_pending());
        drop(watched);
        assert_eq!(reader.woken(), 1);
        assert_eq!(read(&mut upstream, &mut rcx), Poll::Ready(9));
    }

    #[tokio::test]
    async fn the_gate_stays_closed_until_every_gathering_connection_has_written() {
        let (mut first, _c1, mut upstream, _far) = setup().await;
        let (mut second, _c2, _u2, _f2) = setup().await;
        let (reader, waker, reader_waker) = wakers();
        let (mut cx, mut rcx) = contexts(&waker, &reader_waker);
        assert!(write(&mut first, &mut cx, b"data: 1\n\n").is_pending());
        assert!(write(&mut second, &mut cx, b"data: 1\n\n").is_pending());
        assert_eq!(write(&mut first, &mut cx, b"data: 1\n\n"), Poll::Ready(9));
        assert!(read(&mut upstream, &mut rcx).is_pending());
        assert_eq!(reader.woken(), 0);
        assert_eq!(write(&mut second, &mut cx, b"data: 1\n\n"), Poll::Ready(9));
        assert_eq!(reader.woken(), 1);
        assert_eq!(read(&mut upstream, &mut rcx), Poll::Ready(9));
    }

    #[tokio::test]
    async fn a_read_put_off_waits_only_for_the_gatherings_under_way_when_it_was_put_off() {
        let (mut first, _c1, mut upstream, mut far) = setup().await;
        let (mut second, _c2, _u2, _f2) = setup().await;
        let (mut third, _c3, _u3, _f3) = setup().await;
        let (reader, waker, reader_waker) = wakers();
        let (mut cx, mut rcx) = contexts(&waker, &reader_waker);
        assert!(write(&mut first, &mut cx, b"data: 1\n\n").is_pending());
        assert!(read(&mut upstream, &mut rcx).is_pending());
        // Another connection starts gathering after the read was put off, and is still gathering
        // when the first one writes: the read does not wait for it.
        assert!(write(&mut second, &mut cx, b"data: 1\n\n").is_pending());
        assert_eq!(reader.woken(), 0);
        assert_eq!(write(&mut first, &mut cx, b"data: 1\n\n"), Poll::Ready(9));
        assert_eq!(reader.woken(), 1);
        assert_eq!(read(&mut upstream, &mut rcx), Poll::Ready(9));
        // The next read, with bytes waiting, is put off again: now behind the second connection
        // (and a third that starts later does not hold it). First nothing is there to read.
        assert!(read(&mut upstream, &mut rcx).is_pending());
        far.write_all(b"data: 3\n\n").await.unwrap();
        until(|| reader.woken() == 2).await;
        assert!(read(&mut upstream, &mut rcx).is_pending());
        assert!(write(&mut third, &mut cx, b"data: 1\n\n").is_pending());
        assert_eq!(write(&mut second, &mut cx, b"data: 1\n\n"), Poll::Ready(9));
        assert_eq!(reader.woken(), 3);
        assert_eq!(read(&mut upstream, &mut rcx), Poll::Ready(9));
    }

    #[tokio::test]
    async fn a_write_after_one_the_socket_did_not_take_whole_does_not_yield() {
        let (mut watched, _client, mut upstream, _far) = setup().await;
        // Filling the socket takes a hundred writes or more, as many as tokio's cooperative budget
        // for one poll of a task (128 operations), past which its sockets answer Pending whatever
        // they hold: no budget here, so that Pending means a full socket.
        tokio::task::unconstrained(async move {
            let count = Arc::new(Count::default());
            let waker = Waker::from(count.clone());
            let mut cx = Context::from_waker(&waker);
            // The client reads nothing: fill its socket with writes of the gathering limit (which
            // go at once) until one is not taken whole.
            let big = vec![b'x'; GATHER_MAX];
            let mut filled = false;
            for _ in 0..10_000 {
                match write(&mut watched, &mut cx, &big) {
                    Poll::Ready(n) if n == big.len() => {}
                    _ => {
                        filled = true;
                        break;
                    }
                }
            }
            assert!(filled, "the client's socket never filled");
            let woken = count.woken();
            // A small write now goes straight to the socket (which is full): no yield, no
            // wake-up of its own, and the gate stays open for the upstream.
            assert!(write(&mut watched, &mut cx, b"data: 1\n\n").is_pending());
            assert_eq!(count.woken(), woken);
            assert_eq!(read(&mut upstream, &mut cx), Poll::Ready(9));
        })
        .await;
    }

    #[tokio::test]
    async fn a_read_with_nothing_to_read_waits_for_the_socket_not_for_the_gate() {
        let (mut watched, _client, mut upstream, mut far) = setup().await;
        let (reader, waker, reader_waker) = wakers();
        let (mut cx, mut rcx) = contexts(&waker, &reader_waker);
        assert_eq!(read(&mut upstream, &mut rcx), Poll::Ready(9));
        assert!(write(&mut watched, &mut cx, b"data: 1\n\n").is_pending());
        assert!(read(&mut upstream, &mut rcx).is_pending());
        // The gate opens: the read, which had nothing to read, is not polled for nothing.
        assert_eq!(write(&mut watched, &mut cx, b"data: 1\n\n"), Poll::Ready(9));
        assert_eq!(reader.woken(), 0);
        // Bytes arrive: the socket wakes it.
        far.write_all(b"data: 3\n\n").await.unwrap();
        until(|| reader.woken() == 1).await;
        assert_eq!(read(&mut upstream, &mut rcx), Poll::Ready(9));
    }

    #[tokio::test]
    async fn frames_that_come_one_at_a_time_are_written_at_once_with_a_yield_every_few_writes() {
        let (mut watched, _client, _upstream, _far) = setup().await;
        let waker = Waker::from(Arc::new(Count::default()));
        let mut cx = Context::from_waker(&waker);
        let frame = b"data: 1\n\n";
        // Two yields that bring nothing new ...
        for _ in 0..MISSES_BEFORE_SKIPPING {
            assert!(write(&mut watched, &mut cx, frame).is_pending());
            assert_eq!(write(&mut watched, &mut cx, frame), Poll::Ready(9));
        }
        // ... and the next writes go at once, but for one in PROBE_EVERY, which yields again.
        for _ in 0..PROBE_EVERY - 1 {
            assert_eq!(write(&mut watched, &mut cx, frame), Poll::Ready(9));
        }
        assert!(write(&mut watched, &mut cx, frame).is_pending());
        // That yield brings more: gathering is back.
        assert!(write(&mut watched, &mut cx, b"data: 1\n\ndata: 2\n\n").is_pending());
        assert_eq!(
            write(&mut watched, &mut cx, b"data: 1\n\ndata: 2\n\n"),
            Poll::Ready(18)
        );
        assert!(write(&mut watched, &mut cx, frame).is_pending());
    }

    #[tokio::test]
    async fn shutting_down_a_gathering_connection_lets_the_upstream_read() {
        let (mut watched, _client, mut upstream, _far) = setup().await;
        let waker = Waker::from(Arc::new(Count::default()));
        let mut cx = Context::from_waker(&waker);
        assert!(write(&mut watched, &mut cx, b"data: 1\n\n").is_pending());
        assert!(read(&mut upstream, &mut cx).is_pending());
        assert!(matches!(
            Pin::new(&mut watched).poll_shutdown(&mut cx),
            Poll::Ready(Ok(()))
        ));
        assert_eq!(read(&mut upstream, &mut cx), Poll::Ready(9));
    }

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

    fn exchange(complete: bool) -> Exchange {
        let metrics = Arc::new(crate::cli::Metrics::new([], false));
        let mut exchange = Exchange::begin(metrics, http::Method::GET, "/x".parse().unwrap());
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
