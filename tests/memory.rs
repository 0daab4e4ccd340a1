//! Memory stays bounded by `max_frame_bytes`, whatever the input: a gigabyte without a line end,
//! or a frame that never closes, goes through a layer with a small cap while a counting global
//! allocator records the peak of live heap bytes, and the configured overflow outcome happens.
//!
//! Each stream is 1 GiB (a few seconds in a debug build), generated lazily from one shared chunk.
//! The tests in this binary take turns, so each peak belongs to one test. Run with `--nocapture`
//! to see the figures.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use http::Request;
use http_body::{Body, Frame, SizeHint};
use test_support::alloc::{live, peak, reset_peak, Counting, Turn};
use test_support::serve::event_stream;
use tower::{Layer, Service};
use tower_bypass_marker::{BypassMarkerBody, BypassMarkerLayer, FrameTooLarge, Overflow};

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// One test at a time, from its first allocation: another test building its input would count in
/// this one's peak.
static TURN: Turn = Turn::new();

fn my_turn() -> std::sync::MutexGuard<'static, ()> {
    TURN.take()
}

/// Runs `f` and returns its result and the peak of live heap bytes above the level at the start.
fn peak_above_baseline<R>(f: impl FnOnce() -> R) -> (R, usize) {
    reset_peak();
    let baseline = live();
    let out = f();
    (out, peak() - baseline)
}

const CHUNK: usize = 64 * 1024;
const CAP: usize = 256 * 1024;
const MIB: u64 = 1024 * 1024;

/// Bytes per stream: just over 1 GiB, not a multiple of the chunk.
fn stream_len() -> u64 {
    1024 * MIB + 7
}

/// A body that yields `total` bytes: `head` once (in pieces of at most [`CHUNK`] bytes), then
/// `chunk` repeated. Every data frame is a slice of one of them, so the body allocates nothing as
/// it goes.
struct Lazy {
    head: Bytes,
    chunk: Bytes,
    remaining: u64,
    produced: u64,
}

impl Lazy {
    fn new(head: &[u8], chunk: Bytes, total: u64) -> Self {
        Self {
            head: Bytes::copy_from_slice(head),
            chunk,
            remaining: total,
            produced: 0,
        }
    }
}

impl Body for Lazy {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.remaining == 0 {
            return Poll::Ready(None);
        }
        let source = if self.head.is_empty() {
            self.chunk.clone()
        } else {
            let n = self.head.len().min(CHUNK);
            self.head.split_to(n)
        };
        let n = source
            .len()
            .min(usize::try_from(self.remaining).unwrap_or(usize::MAX));
        self.remaining -= n as u64;
        self.produced += n as u64;
        Poll::Ready(Some(Ok(Frame::data(source.slice(..n)))))
    }

    fn is_end_stream(&self) -> bool {
        self.remaining == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.remaining)
    }
}

/// `len` bytes of `line` repeated (the last copy cut short).
fn repeated(line: &[u8], len: usize) -> Bytes {
    let mut out = BytesMut::with_capacity(len);
    while out.len() < len {
        let take = line.len().min(len - out.len());
        out.extend_from_slice(&line[..take]);
    }
    out.freeze()
}

/// The body the layer makes of `inner`, as an event-stream response to a client that did not opt
/// in.
fn through(layer: BypassMarkerLayer, inner: Lazy) -> BypassMarkerBody<Lazy> {
    let mut inner = Some(inner);
    let mut svc = layer.layer(tower::service_fn(move |_req: Request<()>| {
        std::future::ready(Ok::<_, std::convert::Infallible>(event_stream(
            inner.take().unwrap(),
        )))
    }));
    let mut cx = Context::from_waker(futures_util::task::noop_waker_ref());
    let mut fut = std::pin::pin!(svc.call(Request::new(())));
    match fut.as_mut().poll(&mut cx) {
        Poll::Ready(Ok(res)) => {
            let body = res.into_body();
            assert!(body.is_filtering());
            body
        }
        _ => unreachable!("the inner service answers at once"),
    }
}

/// What reading a whole body gave.
#[derive(Debug)]
struct Outcome {
    /// Bytes yielded, and whether they were the expected bytes in order.
    yielded: u64,
    /// The largest gap seen between bytes taken from the inner body and bytes yielded.
    max_lag: u64,
    error: Option<tower_bypass_marker::BoxError>,
    /// Bytes the inner body had produced when the body ended or failed.
    consumed: u64,
}

/// Polls `body` to its end (it never waits), checking that the bytes yielded are `expected`'s
/// bytes in order, and tracking how far output lags behind input.
fn drain(mut body: BypassMarkerBody<Lazy>, expected: &ExpectedBytes) -> Outcome {
    let mut cx = Context::from_waker(futures_util::task::noop_waker_ref());
    let mut yielded = 0u64;
    let mut max_lag = 0u64;
    let mut error = None;
    loop {
        match Pin::new(&mut body).poll_frame(&mut cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let data = frame.into_data().expect("no trailers in this body");
                expected.check(yielded, &data);
                yielded += data.len() as u64;
            }
            Poll::Ready(Some(Err(err))) => {
                error = Some(err);
                break;
            }
            Poll::Ready(None) => break,
            Poll::Pending => unreachable!("the lazy body never waits"),
        }
        max_lag = max_lag.max(body.get_ref().produced - yielded);
    }
    if error.is_some() {
        // After the error, the body is over.
        assert!(matches!(
            Pin::new(&mut body).poll_frame(&mut cx),
            Poll::Ready(None)
        ));
    }
    Outcome {
        yielded,
        max_lag,
        error,
        consumed: body.get_ref().produced,
    }
}

/// The input: `head`, then `chunk` repeated; checks output slices against it with `memcmp`.
struct ExpectedBytes {
    head: Bytes,
    chunk: Bytes,
}

impl ExpectedBytes {
    fn check(&self, mut at: u64, mut data: &[u8]) {
        while !data.is_empty() {
            let (source, offset) = if at < self.head.len() as u64 {
                (&self.head, at as usize)
            } else {
                let past = at - self.head.len() as u64;
                (&self.chunk, (past % self.chunk.len() as u64) as usize)
            };
            let n = (source.len() - offset).min(data.len());
            assert!(
                data[..n] == source[offset..offset + n],
                "output differs from input at byte {at}"
            );
            data = &data[n..];
            at += n as u64;
        }
    }
}

struct Run {
    outcome: Outcome,
    peak: usize,
}

/// Streams `head` then `chunk` repeated, `total` bytes, through `layer`, measuring the heap peak;
/// the output must be `expected`'s bytes (by default, the input).
fn run(
    layer: BypassMarkerLayer,
    (head, chunk, total): (&[u8], Bytes, u64),
    expected: Option<ExpectedBytes>,
    what: &str,
) -> Run {
    let expected = expected.unwrap_or_else(|| ExpectedBytes {
        head: Bytes::copy_from_slice(head),
        chunk: chunk.clone(),
    });
    let inner = Lazy::new(head, chunk, total);
    let started = Instant::now();
    let (outcome, peak) = peak_above_baseline(|| drain(through(layer, inner), &expected));
    println!(
        "{what}: {:.2} MiB in, {:.2} MiB out in {:.2?}; heap peak +{} KiB (cap {} KiB, chunk {} \
         KiB); max lag {} KiB",
        outcome.consumed as f64 / MIB as f64,
        outcome.yielded as f64 / MIB as f64,
        started.elapsed(),
        peak / 1024,
        CAP / 1024,
        CHUNK / 1024,
        outcome.max_lag / 1024,
    );
    Run { outcome, peak }
}

/// The bound on the heap peak: the held bytes (at most the cap), plus less than a chunk for the
/// layer's own state. (The input's chunk is allocated before the measurement starts.)
const PEAK_BOUND: usize = CAP + CHUNK;

fn assert_bounded(run: &Run) {
    assert!(
        run.peak <= PEAK_BOUND,
        "heap peak +{} bytes, bound {PEAK_BOUND}",
        run.peak
    );
    assert!(
        run.outcome.max_lag <= (CAP + CHUNK) as u64,
        "output lagged input by {} bytes",
        run.outcome.max_lag
    );
}

fn assert_frame_too_large(run: &Run) {
    let err = run.outcome.error.as_ref().expect("the body did not fail");
    let err = err
        .downcast_ref::<FrameTooLarge>()
        .unwrap_or_else(|| panic!("not FrameTooLarge: {err:?}"));
    assert_eq!(err.limit(), CAP);
    // It failed as soon as the frame outgrew the cap, not at the end of the input.
    assert!(run.outcome.consumed <= (CAP + CHUNK) as u64);
    assert!(run.peak <= PEAK_BOUND, "heap peak +{} bytes", run.peak);
}

fn forwarding() -> BypassMarkerLayer {
    BypassMarkerLayer::new().max_frame_bytes(CAP)
}

fn failing() -> BypassMarkerLayer {
    BypassMarkerLayer::new()
        .max_frame_bytes(CAP)
        .on_overflow(Overflow::Error)
}

/// A chunk of `data:` lines with no empty line: a frame made of it never closes.
fn data_lines() -> Bytes {
    let mut line = b"data: ".to_vec();
    line.resize(1023, b'y');
    line.push(b'\n');
    repeated(&line, CHUNK)
}

#[test]
fn forward_streams_every_byte_of_a_line_without_end_in_bounded_memory() {
    let _turn = my_turn();
    let total = stream_len();
    let input = (&b""[..], repeated(b"x", CHUNK), total);
    let run = run(forwarding(), input, None, "one line, Forward");
    assert!(run.outcome.error.is_none());
    assert_eq!(run.outcome.yielded, total);
    assert_bounded(&run);
}

#[test]
fn error_fails_a_line_without_end_at_the_cap() {
    let _turn = my_turn();
    let input = (&b""[..], repeated(b"x", CHUNK), stream_len());
    let run = run(failing(), input, None, "one line, Error");
    assert_eq!(
        run.outcome.yielded, 0,
        "bytes of the oversized frame leaked"
    );
    assert_frame_too_large(&run);
}

#[test]
fn forward_streams_every_byte_of_a_frame_that_never_closes_in_bounded_memory() {
    let _turn = my_turn();
    let total = stream_len();
    let input = (&b"data: 0\n\n"[..], data_lines(), total);
    let run = run(forwarding(), input, None, "open frame, Forward");
    assert!(run.outcome.error.is_none());
    assert_eq!(run.outcome.yielded, total);
    assert_bounded(&run);
}

#[test]
fn forward_lets_an_oversized_marker_frame_through_unfiltered() {
    let _turn = my_turn();
    // The documented trade-off of Overflow::Forward: a frame past the cap is data, so even one
    // that starts like the marker is forwarded whole, in bounded memory.
    let total = stream_len();
    let input = (
        &b"event: x-bypass-remote-prefill\n"[..],
        data_lines(),
        total,
    );
    let run = run(forwarding(), input, None, "open marker frame, Forward");
    assert!(run.outcome.error.is_none());
    assert_eq!(run.outcome.yielded, total);
    assert_bounded(&run);
}

#[test]
fn error_fails_a_frame_that_never_closes_at_the_cap() {
    let _turn = my_turn();
    let input = (
        &b"data: 0\n\nevent: x-bypass-remote-prefill\n"[..],
        data_lines(),
        stream_len(),
    );
    let run = run(failing(), input, None, "open marker frame, Error");
    // The frame before the open one was complete and is yielded; nothing of the open one is.
    assert_eq!(run.outcome.yielded, b"data: 0\n\n".len() as u64);
    assert_frame_too_large(&run);
}

#[test]
fn a_frame_just_under_the_cap_is_held_and_judged() {
    let _turn = my_turn();
    // The cap is not reached: the marker frame is held whole across chunks and removed.
    let mut marker = b"event: x-bypass-remote-prefill\n".to_vec();
    while marker.len() < CAP - 2 * CHUNK {
        marker.extend_from_slice(b": padding padding padding padding\n");
    }
    marker.push(b'\n');
    let tail = repeated(b"data: 1\n\n", CHUNK);
    let total = (marker.len() + 64 * CHUNK) as u64;
    // The output is the tail alone.
    let expected = ExpectedBytes {
        head: Bytes::new(),
        chunk: tail.clone(),
    };
    let input = (&marker[..], tail, total);
    let run = run(failing(), input, Some(expected), "marker under the cap");
    assert!(run.outcome.error.is_none());
    assert_eq!(run.outcome.yielded, total - marker.len() as u64);
    assert!(run.peak <= PEAK_BOUND, "heap peak +{} bytes", run.peak);
}
