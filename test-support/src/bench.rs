//! Workloads and the polling harness shared by `benches/throughput.rs` (criterion),
//! `examples/bench_summary.rs` (the self-timing ratio table) and `examples/chunk_cost.rs`.
//!
//! Every variant of a workload reads the same prepared `Bytes` chunks through the same harness: a
//! `tower::service_fn` upstream answers with a body that yields the chunks (a `StreamBody` over them), the response
//! is produced by `oneshot`, and the body is polled to completion synchronously with a no-op waker
//! (every poll is ready). The chunks are handed over in one of two ways ([`Handover`]): as
//! `Bytes::from_static` (no reference counting at all), or reference-counted, split off one shared
//! buffer the way hyper splits them off its read buffer (an atomic increment when a chunk is split
//! off, an atomic decrement when its consumer drops it). Only what happens to the chunks differs:
//!
//! - `layer`: through `BypassMarkerLayer::new()`, the bench's subject;
//! - `unfiltered`: the upstream's body as is;
//! - `memchr2 floor`: the upstream's body as is, plus a `memchr2(b'\n', b'\r', ..)` scan that finds
//!   every line end of every chunk and does nothing else: what any filter that looks at line
//!   structure must at least do;
//! - `decode + re-encode`: what an application would write without this crate: parse with
//!   `eventsource-stream`, drop the marker events, serialise the rest back to bytes.

use std::convert::Infallible;
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use eventsource_stream::Eventsource;
use futures_util::task::noop_waker_ref;
use futures_util::Stream;
use http::{header, Request, Response};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, StreamBody};
use tower::{service_fn, Layer, ServiceExt};
use tower_bypass_marker::{BypassMarkerLayer, RequestedAnnotations, BYPASS_REMOTE_PREFILL};

/// Dynamo's marker frame, as the router prepends it.
pub const MARKER: &[u8] = b"event: x-bypass-remote-prefill\n: true\n\n";

/// How a workload's chunks are processed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// Through `BypassMarkerLayer::new()`.
    Layer,
    /// The upstream body, untouched.
    Unfiltered,
    /// The upstream body plus a bare `memchr2` scan for every line end.
    Floor,
    /// `eventsource-stream` decode, drop the marker, re-serialise.
    Decode,
}

impl Variant {
    /// Every variant, in the order the tables show them.
    pub const ALL: [Variant; 4] = [
        Variant::Layer,
        Variant::Unfiltered,
        Variant::Floor,
        Variant::Decode,
    ];

    /// A short name, used as the criterion function id.
    pub fn name(self) -> &'static str {
        match self {
            Variant::Layer => "layer",
            Variant::Unfiltered => "unfiltered",
            Variant::Floor => "memchr2_floor",
            Variant::Decode => "decode_reencode",
        }
    }
}

/// How the upstream body hands its chunks over. Every variant of a run gets them the same way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handover {
    /// `Bytes::from_static` slices of one static buffer: cloning, slicing and dropping them
    /// touches no reference count.
    Static,
    /// Reference-counted slices of one shared buffer, as hyper hands them over: each chunk is
    /// split off the front of the buffer (`Bytes::split_to`, an atomic increment of the buffer's
    /// count) and whoever drops it last gives the count back (an atomic decrement).
    Refcounted,
}

impl Handover {
    /// Both ways, in the order the tables show them.
    pub const ALL: [Handover; 2] = [Handover::Static, Handover::Refcounted];

    /// A short name, used in table titles and criterion function ids.
    pub fn name(self) -> &'static str {
        match self {
            Handover::Static => "static",
            Handover::Refcounted => "refcounted",
        }
    }
}

/// One input stream, cut into the chunks the upstream body yields.
#[derive(Debug)]
pub struct Workload {
    /// A short name, used as the criterion group id.
    pub name: &'static str,
    /// What the chunks look like.
    pub shape: &'static str,
    /// The target for layer / memchr2 floor, if the brief sets one for this shape.
    pub floor_target: Option<f64>,
    chunks: Arc<[&'static [u8]]>,
    /// The same bytes as `chunks`, in one reference-counted buffer (`Handover::Refcounted`).
    shared: Bytes,
    /// The client opted in to the marker: the layer passes the body through.
    opted_in: bool,
    /// An adversarial shape: it ends in an open frame, which `eventsource-stream` never yields,
    /// so only the layer, the unfiltered body and the floor are run on it.
    pub adversarial: bool,
    /// The input minus its marker frames.
    without_marker: Vec<u8>,
}

/// The upstream body: yields `chunks` as data frames, one per poll, always ready
/// (`http_body_util::StreamBody` over an iterator).
fn upstream_body(
    chunks: impl Iterator<Item = Bytes> + Unpin,
) -> impl Body<Data = Bytes, Error = Infallible> + Unpin {
    StreamBody::new(futures_util::stream::iter(
        chunks.map(|chunk| Ok(Frame::data(chunk))),
    ))
}

impl Workload {
    fn new(
        name: &'static str,
        shape: &'static str,
        floor_target: Option<f64>,
        chunks: Vec<Bytes>,
    ) -> Self {
        let input: Vec<u8> = chunks.iter().flat_map(|c| c.iter().copied()).collect();
        let without_marker = crate::model::remove_all(&input, MARKER);
        // One static buffer per workload (leaked: workloads live as long as the process), so
        // that a chunk is handed over as `Bytes::from_static`, with no call through a vtable.
        let buffer: &'static [u8] = Vec::leak(input.clone());
        let mut at = 0;
        let chunks: Vec<&'static [u8]> = chunks
            .iter()
            .map(|c| {
                at += c.len();
                &buffer[at - c.len()..at]
            })
            .collect();
        // A buffer whose handles are counted, like hyper's read buffer once a chunk has been split
        // off it: `split` makes the `BytesMut` shared, so the frozen `Bytes` counts its clones.
        let shared = BytesMut::from(&input[..]).split().freeze();
        Self {
            name,
            shape,
            floor_target,
            chunks: chunks.into(),
            shared,
            opted_in: false,
            adversarial: false,
            without_marker,
        }
    }

    fn opted_in(mut self) -> Self {
        self.opted_in = true;
        self
    }

    /// The bytes the upstream body yields per run.
    pub fn input_len(&self) -> u64 {
        self.chunks.iter().map(|c| c.len() as u64).sum()
    }

    /// The variants that run on this workload.
    pub fn variants(&self) -> &'static [Variant] {
        if self.adversarial {
            &Variant::ALL[..3]
        } else {
            &Variant::ALL
        }
    }

    /// How many chunks the upstream body yields per run.
    pub fn chunk_count(&self) -> usize {
        self.chunks.len()
    }

    fn request(&self) -> Request<()> {
        let mut req = Request::new(());
        if self.opted_in {
            req.extensions_mut().insert(
                [BYPASS_REMOTE_PREFILL]
                    .into_iter()
                    .collect::<RequestedAnnotations>(),
            );
        }
        req
    }

    /// Runs `variant` once over the workload, its chunks handed over as `handover` says. Returns
    /// the number of bytes yielded (the number of line ends found, for the floor), so the work
    /// cannot be optimised away.
    pub fn run(&self, handover: Handover, variant: Variant) -> u64 {
        let mut total = 0u64;
        let n = self.run_with(handover, variant, |data| total += data.len() as u64);
        if variant == Variant::Floor {
            n
        } else {
            total
        }
    }

    /// Checks that every variant does the work it is meant to: the layer removes the marker (or,
    /// for an opted-in client, forwards everything), the decode path yields the same bytes as the
    /// layer minus the marker, and the floor finds every line end.
    pub fn check(&self) {
        for handover in Handover::ALL {
            self.check_with(handover);
        }
    }

    fn check_with(&self, handover: Handover) {
        let input: Vec<u8> = self.chunks.iter().flat_map(|c| c.iter().copied()).collect();
        assert!(self.shared == input, "{}: shared buffer", self.name);
        let collect = |variant| {
            let mut out = Vec::new();
            self.run_with(handover, variant, |data| out.extend_from_slice(data));
            out
        };
        let layer_expected = if self.opted_in {
            &input
        } else {
            &self.without_marker
        };
        assert!(
            collect(Variant::Layer) == *layer_expected,
            "{}: layer output differs from the input minus its markers",
            self.name
        );
        assert!(
            collect(Variant::Unfiltered) == input,
            "{}: unfiltered",
            self.name
        );
        // eventsource-stream never yields a frame without data, so the decode path loses the marker
        // even for a client that opted in.
        assert!(
            self.adversarial || collect(Variant::Decode) == self.without_marker,
            "{}: decode + re-encode output differs from the input minus its markers",
            self.name
        );
        let line_ends = memchr::memchr2_iter(b'\n', b'\r', &input).count() as u64;
        assert_eq!(
            self.run(handover, Variant::Floor),
            line_ends,
            "{}: floor",
            self.name
        );
    }

    /// Runs `variant`, passing every yielded data chunk to `sink`; returns the floor's line-end
    /// count (0 for the other variants).
    fn run_with(&self, handover: Handover, variant: Variant, sink: impl FnMut(&Bytes)) -> u64 {
        let chunks = self.chunks.clone();
        match handover {
            Handover::Static => self.run_on(
                move || {
                    let chunks = chunks.clone();
                    upstream_body((0..chunks.len()).map(move |i| Bytes::from_static(chunks[i])))
                },
                variant,
                sink,
            ),
            Handover::Refcounted => {
                let shared = self.shared.clone();
                self.run_on(
                    move || {
                        // What is left of the run's buffer: a handle of its own. Each chunk is
                        // split off its front, like hyper's `read_buf.split_to(n).freeze()`: one
                        // more reference to the buffer, given back when the chunk (or the last
                        // slice taken of it) is dropped. The last chunk takes the handle itself.
                        let mut rest = shared.clone();
                        let chunks = chunks.clone();
                        upstream_body(
                            (0..chunks.len()).map(move |i| rest.split_to(chunks[i].len())),
                        )
                    },
                    variant,
                    sink,
                )
            }
        }
    }

    /// Runs `variant` on an upstream whose body `make_body` builds.
    fn run_on<U>(
        &self,
        make_body: impl Fn() -> U + Clone,
        variant: Variant,
        sink: impl FnMut(&Bytes),
    ) -> u64
    where
        U: Body<Data = Bytes, Error = Infallible> + Unpin,
    {
        let upstream = service_fn(move |_req: Request<()>| {
            let body = make_body();
            let res = Response::builder()
                .header(header::CONTENT_TYPE, "text/event-stream")
                .body(body)
                .expect("valid response");
            std::future::ready(Ok::<_, Infallible>(res))
        });
        match variant {
            Variant::Layer => {
                let svc = BypassMarkerLayer::new().layer(upstream);
                let body = ready(svc.oneshot(self.request())).into_body();
                drain(body, sink);
                0
            }
            Variant::Unfiltered => {
                drain(ready(upstream.oneshot(self.request())).into_body(), sink);
                0
            }
            Variant::Floor => {
                let mut line_ends = 0;
                drain(
                    ready(upstream.oneshot(self.request())).into_body(),
                    |chunk| line_ends += count_line_ends(chunk),
                );
                line_ends
            }
            Variant::Decode => {
                let body = ready(upstream.oneshot(self.request())).into_body();
                decode_reencode(body, sink);
                0
            }
        }
    }
}

/// The floor: finds every line end in `chunk` and does nothing else.
#[inline(never)]
fn count_line_ends(chunk: &[u8]) -> u64 {
    let mut n = 0;
    let mut i = 0;
    while let Some(p) = memchr::memchr2(b'\n', b'\r', &chunk[i..]) {
        n += 1;
        i += p + 1;
    }
    n
}

/// What an application would write without the layer: decode every event, drop the marker,
/// serialise the rest again. Generous to this path: only `event` and `data` are written back, into
/// one exact-size buffer per event.
fn decode_reencode<B>(body: B, mut sink: impl FnMut(&Bytes))
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Debug,
{
    let mut events = pin!(body.into_data_stream().eventsource());
    let mut cx = Context::from_waker(noop_waker_ref());
    loop {
        let event = match events.as_mut().poll_next(&mut cx) {
            Poll::Ready(Some(Ok(event))) => event,
            Poll::Ready(Some(Err(err))) => panic!("event stream error: {err:?}"),
            Poll::Ready(None) => return,
            Poll::Pending => unreachable!("the upstream body is always ready"),
        };
        if event.event == BYPASS_REMOTE_PREFILL {
            continue;
        }
        let named = event.event != "message";
        let lines = event.data.split('\n').count();
        let mut out = Vec::with_capacity(
            event.data.len() + lines * 7 + 1 + if named { event.event.len() + 8 } else { 0 },
        );
        if named {
            out.extend_from_slice(b"event: ");
            out.extend_from_slice(event.event.as_bytes());
            out.push(b'\n');
        }
        for line in event.data.split('\n') {
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(line.as_bytes());
            out.push(b'\n');
        }
        out.push(b'\n');
        sink(&Bytes::from(out));
    }
}

/// Polls a future that is ready at once (the upstream and the layer's response future are).
fn ready<T, F: Future<Output = Result<T, Infallible>>>(fut: F) -> T {
    let mut cx = Context::from_waker(noop_waker_ref());
    match pin!(fut).poll(&mut cx) {
        Poll::Ready(Ok(out)) => out,
        Poll::Ready(Err(never)) => match never {},
        Poll::Pending => unreachable!("the upstream answers at once"),
    }
}

/// Polls `body` to its end, passing every data chunk to `sink`.
fn drain<B>(body: B, mut sink: impl FnMut(&Bytes))
where
    B: Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let mut body = pin!(body);
    let mut cx = Context::from_waker(noop_waker_ref());
    loop {
        match body.as_mut().poll_frame(&mut cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    sink(data);
                }
            }
            Poll::Ready(Some(Err(err))) => panic!("body error: {err:?}"),
            Poll::Ready(None) => return,
            Poll::Pending => unreachable!("the upstream body is always ready"),
        }
    }
}

/// A small deterministic generator, so every run measures the same bytes.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

const WORDS: &[&str] = &[
    "the",
    "model",
    "streams",
    "tokens",
    "as",
    "server",
    "sent",
    "events",
    "and",
    "each",
    "chunk",
    "carries",
    "a",
    "small",
    "delta",
    "of",
    "text",
    "prefill",
    "decode",
    "worker",
    "cache",
    "router",
    "request",
    "latency",
    "is",
    "measured",
    "in",
    "milliseconds",
    "while",
    "throughput",
    "grows",
];

/// Appends words (plain ASCII, no JSON escaping needed) to `out` until it is `len` bytes long.
fn words(rng: &mut Rng, out: &mut String, len: usize) {
    assert!(len <= 1 << 20, "content length {len} out of range");
    while out.len() < len {
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(WORDS[rng.below(WORDS.len() as u64) as usize]);
    }
    out.truncate(len);
}

/// One OpenAI chat-completion chunk event, 150 to 300 bytes long.
fn chat_event(rng: &mut Rng) -> Vec<u8> {
    let id = rng.next() as u32;
    let head = format!(
        "data: {{\"id\":\"chatcmpl-{id:08x}\",\"object\":\"chat.completion.chunk\",\"model\":\"llama-3.1-8b\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\""
    );
    let tail = "\"},\"finish_reason\":null}]}\n\n";
    // The fixed parts are 157 bytes; a content of at least 3 bytes.
    let min = (head.len() + tail.len() + 3).max(150);
    let len = min + rng.below((301 - min) as u64) as usize;
    let mut content = String::new();
    words(rng, &mut content, len - head.len() - tail.len());
    let event = format!("{head}{content}{tail}");
    debug_assert!((150..=300).contains(&event.len()));
    event.into_bytes()
}

/// One `data:` event of exactly `len` bytes: a JSON object with a long text field.
fn big_event(rng: &mut Rng, len: usize) -> Vec<u8> {
    let head = "data: {\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"";
    let tail = "\"}}]}\n\n";
    let mut content = String::new();
    words(rng, &mut content, len - head.len() - tail.len());
    format!("{head}{content}{tail}").into_bytes()
}

/// Chat events totalling at least `bytes`.
fn chat_events(rng: &mut Rng, bytes: usize) -> Vec<Vec<u8>> {
    let mut events = Vec::new();
    let mut total = 0;
    while total < bytes {
        let event = chat_event(rng);
        total += event.len();
        events.push(event);
    }
    events
}

/// Makes `pieces` the chunks of one static buffer: cloning, slicing and dropping them touches no
/// reference count, so the harness costs every variant as little as it can. (`Handover::Refcounted`
/// hands the same bytes over reference-counted, as hyper does.) The buffer is leaked, once per
/// workload and process.
fn share(pieces: Vec<Vec<u8>>) -> Vec<Bytes> {
    let all: &'static [u8] = Box::leak(pieces.concat().into_boxed_slice());
    let mut at = 0;
    pieces
        .iter()
        .map(|p| {
            let chunk = Bytes::from_static(&all[at..at + p.len()]);
            at += p.len();
            chunk
        })
        .collect()
}

fn split_every(stream: &[u8], n: usize) -> Vec<Vec<u8>> {
    stream.chunks(n).map(<[u8]>::to_vec).collect()
}

const MIB: usize = 1024 * 1024;

/// The workloads of the brief, each about 1 to 2 MiB per run.
pub fn workloads() -> Vec<Workload> {
    let mut rng = Rng(0x5EED_CAFE_F00D_1234);
    let events = chat_events(&mut rng, 2 * MIB);
    let with_marker = |events: &[Vec<u8>]| {
        let mut pieces = vec![MARKER.to_vec()];
        pieces.extend_from_slice(events);
        pieces
    };
    let stream = with_marker(&events).concat();

    let one_per_chunk = with_marker(&events);
    let sixteen_per_chunk: Vec<Vec<u8>> = {
        let mut chunks: Vec<Vec<u8>> = events.chunks(16).map(<[Vec<u8>]>::concat).collect();
        chunks[0].splice(0..0, MARKER.iter().copied());
        chunks
    };
    let big: Vec<Vec<u8>> = {
        let mut chunks = vec![MARKER.to_vec()];
        chunks.extend((0..32).map(|_| big_event(&mut rng, 64 * 1024)));
        chunks
    };
    let small_stream = with_marker(&chat_events(&mut rng, MIB)).concat();

    vec![
        Workload::new(
            "chat_1_per_chunk",
            "chat chunks, 1 event per chunk",
            Some(0.4),
            share(one_per_chunk.clone()),
        ),
        Workload::new(
            "chat_16_per_chunk",
            "chat chunks, 16 events per chunk",
            Some(0.5),
            share(sixteen_per_chunk),
        ),
        Workload::new(
            "events_64k",
            "64 KiB data events, 1 per chunk",
            Some(0.8),
            share(big),
        ),
        Workload::new(
            "chat_61_byte_splits",
            "chat stream split every 61 bytes",
            Some(0.3),
            share(split_every(&stream, 61)),
        ),
        Workload::new(
            "chat_1_byte_chunks",
            "chat stream in 1-byte chunks (1 MiB)",
            None,
            share(split_every(&small_stream, 1)),
        ),
        Workload::new(
            "chat_no_marker",
            "chat chunks, 1 per chunk, no marker",
            None,
            share(events.clone()),
        ),
        Workload::new(
            "chat_opted_in",
            "chat chunks, 1 per chunk, client opted in",
            None,
            share(one_per_chunk),
        )
        .opted_in(),
    ]
}

/// The shapes of the scanner's worst cases (issue 9, defect 1): each one is linear now, and was
/// quadratic in the bytes of one chunk before.
const ADVERSARIAL: [(&str, &str); 4] = [
    (
        "open_after_frames",
        "frames with `event:`, then a long open frame",
    ),
    (
        "tail_after_removed",
        "removed frames, then a long unterminated line",
    ),
    (
        "open_after_event_in_data",
        "`event:` inside data lines, then a long open frame",
    ),
    (
        "open_after_frames_cr",
        "frames with `event:`, then a long open frame, CR-only",
    ),
];

/// `size` bytes: half the shape's frames, half its open tail (each as close to half as whole
/// frames and tail units make it).
fn adversarial_stream(shape: &str, size: usize) -> Vec<u8> {
    let (frame, tail): (&[u8], &[u8]) = match shape {
        "open_after_frames" => (b"event: message\ndata: x\n\n", b"data: x\n"),
        "tail_after_removed" => (MARKER, b"x"),
        "open_after_event_in_data" => (b"data: event: x\n\n", b"data: x\n"),
        "open_after_frames_cr" => (b"event: message\rdata: x\r\r", b"data: x\r"),
        _ => unreachable!("unknown shape {shape}"),
    };
    let mut out = Vec::with_capacity(size + frame.len());
    while out.len() + frame.len() <= size / 2 {
        out.extend_from_slice(frame);
    }
    let tail_start = out.len();
    if shape == "tail_after_removed" {
        out.extend_from_slice(b"data: ");
    }
    while out.len() - tail_start + tail.len() <= size / 2 {
        out.extend_from_slice(tail);
    }
    out
}

/// The adversarial workloads: for each shape, in one chunk and in 64 KiB chunks, a pair of runs of
/// 1 MiB and 2 MiB, so that the time of the larger one can be compared with the smaller one's.
/// The open frame at the end (half the run, within the default `max_frame_bytes` of 1 MiB) is held
/// and released when the body ends.
pub fn adversarial_workloads() -> Vec<(Workload, Workload)> {
    let mut out = Vec::new();
    for (name, shape) in ADVERSARIAL {
        for one_chunk in [true, false] {
            let workload = |size: usize, label: &'static str| {
                let stream = adversarial_stream(name, size);
                let pieces = if one_chunk {
                    vec![stream]
                } else {
                    split_every(&stream, 64 * 1024)
                };
                let name: &'static str = Box::leak(
                    format!(
                        "{name}_{}_{label}",
                        if one_chunk { "1chunk" } else { "64k" }
                    )
                    .into_boxed_str(),
                );
                let shape: &'static str = Box::leak(
                    format!(
                        "{shape}, {}, {label}",
                        if one_chunk {
                            "one chunk"
                        } else {
                            "64 KiB chunks"
                        }
                    )
                    .into_boxed_str(),
                );
                let mut w = Workload::new(name, shape, Some(0.1), share(pieces));
                w.adversarial = true;
                w
            };
            out.push((workload(MIB, "1MiB"), workload(2 * MIB, "2MiB")));
        }
    }
    out
}
