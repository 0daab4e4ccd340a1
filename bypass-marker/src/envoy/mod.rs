//! The layer as an Envoy external processor.
//!
//! Envoy's external processing filter (`envoy.filters.http.ext_proc`) opens one gRPC stream to
//! the processor for every HTTP request and sends it the request's and the response's headers
//! and bodies. [`ExtProc`] answers them with the same two sans-IO cores the tower layers drive,
//! so Envoy, the `BypassMarkerLayer` and the `JsonGuard` layer cannot disagree:
//!
//! - **Request headers and body**: the JSON guard's rules
//!   ([`RequestGuard`](tower_bypass_marker::sans_io::RequestGuard)). Every request that goes on asks the upstream
//!   for `accept-encoding: identity`, as the sidecar does: an encoded event stream cannot be
//!   filtered, so a compressing upstream's stream would be refused (put Envoy's compressor filter
//!   before `ext_proc` in the chain to compress for clients). A request the guard does not read goes on otherwise untouched (and Envoy is
//!   told not to send its body); a refused one gets the guard's status,
//!   `content-type: application/json` and its OpenAI-shaped error as Envoy's local reply
//!   (`immediate_response`); a body whose
//!   `nvext.annotations` named a router-owned name is replaced by the spliced body (and its
//!   `content-length`, if it had one, updated). The client's opt-in is kept for the response.
//! - **Response headers**:
//!   [`BypassMarkerLayer::response_filter`](tower_bypass_marker::BypassMarkerLayer::response_filter) decides,
//!   as the tower layer does. A response it passes through (JSON, gRPC, nothing to remove for
//!   this client) is answered with a `mode_override` that stops Envoy sending its body: one
//!   message per response. A filtered one loses `content-length`, and its answer carries a
//!   `mode_override` to `STREAMED`, whatever body mode Envoy announced (Envoy before 1.34
//!   announces none). An event stream in a `content-encoding` other than `identity` with
//!   something to remove for this client gets Envoy's local reply instead: a 502
//!   [`encoded_event_stream`](tower_bypass_marker::sans_io::Refusal::encoded_event_stream), before any byte of it
//!   (the layer's observer hears of it once).
//! - **Response body**: every chunk through an [`EventStreamFilter`](tower_bypass_marker::sans_io::EventStreamFilter).
//!   A chunk the filter forwards as it is gets an answer without a body mutation (Envoy forwards
//!   the chunk it holds; nothing is copied back); otherwise the answer carries the bytes to
//!   forward for that chunk: the complete frames, without the removed ones. A frame that spans
//!   chunks is held, at most `max_frame_bytes`, and released with the chunk that completes it;
//!   at the end of the body a frame still open is judged as it stands.
//!
//! Per-frame counts reach a [`FrameObserver`](tower_bypass_marker::FrameObserver) set on the layer
//! ([`BypassMarkerLayer::observe`](tower_bypass_marker::BypassMarkerLayer::observe)), as with the tower layer.
//! With an observer, the event streams of clients that opted in go through the processor too
//! (so that their frames are counted), at one message per chunk.
//!
//! # In Envoy
//!
//! The processor works with the configuration an operator writes from Envoy's documentation:
//!
//! ```yaml
//! - name: envoy.filters.http.ext_proc
//!   typed_config:
//!     "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
//!     grpc_service: {envoy_grpc: {cluster_name: bypass_marker}}
//!     processing_mode: {request_header_mode: SEND, request_body_mode: BUFFERED, request_trailer_mode: SKIP,
//!                       response_header_mode: SEND, response_body_mode: STREAMED, response_trailer_mode: SKIP}
//!     allow_mode_override: true
//!     failure_mode_allow: false
//! ```
//!
//! The cluster must speak HTTP/2 (`typed_extension_protocol_options` with
//! `explicit_http_config: {http2_protocol_options: {}}`). `request_body_mode` must be `BUFFERED`:
//! the guard judges whole bodies (a request it must read under another mode fails, see below).
//! Without `allow_mode_override`, Envoy sends every body anyway and the processor answers each
//! with no change: correct, only slower (and Envoy buffers every request body, so a large upload
//! that the guard does not read meets Envoy's buffer limit). Under another `response_body_mode`
//! (`NONE`, say), the processor asks for `STREAMED` on the responses it must filter.
//!
//! ## `FULL_DUPLEX_STREAMED`
//!
//! Either body mode may also be `FULL_DUPLEX_STREAMED` (with that direction's trailer mode
//! `SEND`, as Envoy requires). Envoy then streams each chunk without waiting and forwards only
//! what comes back in `streamed_response`s. A JSON request body is held until its end (its last
//! chunk or its trailers), at most `max_body_bytes` (past it, the 413 at once), judged whole and
//! sent on in chunks of at most 64 KiB: nothing of it goes upstream unjudged. Other request bodies,
//! and responses passed through, go back chunk by chunk as they came; a filtered response's
//! chunks go back as their frames complete, and trailers flush a frame left open. No
//! `mode_override` is sent while a direction is in this mode, so every chunk costs a message.
//! A mode the processor cannot support fails the stream with `FAILED_PRECONDITION` naming the
//! mode: `GRPC`; `STREAMED` or `BUFFERED_PARTIAL` for a request the guard must read; a response
//! to filter whose body mode cannot be switched on (see docs/envoy.md).
//!
//! ## A configuration that keeps `content-length` on JSON responses
//!
//! Envoy drops the `content-length` of every response whose body mode is `STREAMED` when its
//! headers arrive, before the processor answers, so with the configuration above JSON responses
//! reach clients chunked (their bytes unchanged). With `response_body_mode: NONE` instead, the
//! processor asks for `STREAMED` (a `mode_override`) on exactly the responses it filters: JSON
//! responses keep their `content-length`, and the count of messages is the same. This relies on
//! `allow_mode_override: true`: without it, event streams would pass unfiltered under `NONE`,
//! whereas the documented configuration fails safe (checked by hand with Envoy 1.40.0: the marker
//! removed, a 20 MiB request body spliced with its `content-length` updated, a 50 MB upload that
//! the guard does not read passed without Envoy buffering it).
//!
//! # Running it
//!
//! ```
//! use bypass_marker::envoy::{self, ExtProc};
//! use tower_bypass_marker::BypassMarkerLayer;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! let processor = ExtProc::new(BypassMarkerLayer::dynamo()).max_body_bytes(8 << 20);
//! // Serves the processor and grpc.health.v1 until the future completes (a signal, usually).
//! let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
//! let server = tokio::spawn(envoy::serve(listener, processor, async {
//!     let _ = stopped.await;
//! }));
//! stop.send(()).unwrap();
//! server.await??;
//! # Ok(())
//! # }
//! ```
//!
//! [`ExtProc::into_service`] gives the service alone ([`ExtProcService`]), for a tonic server of
//! your own. It reads and writes the gRPC messages of a `Process` call itself, one answer per
//! message as soon as the message is in; `ExtProc` also implements tonic's generated
//! `ExternalProcessor` trait, for `ExternalProcessorServer::new` (same answers, more CPU per
//! message).
//!
//! # On failure
//!
//! Run Envoy with `failure_mode_allow: false` (the default): a response that the processor
//! cannot judge then never reaches a client unfiltered.
//!
//! - **Processor unreachable before a request**: Envoy answers the request itself with a 5xx;
//!   nothing reaches the upstream.
//! - **Processor gone in the middle of a stream**: Envoy resets the HTTP stream; the client sees
//!   a broken stream (HTTP/2 `RST_STREAM`, or an HTTP/1 chunked body that stops without its last
//!   chunk), never a clean end, and never the bytes held for an open frame.
//! - **Slow processor**: each message has Envoy's `message_timeout` (200 ms by default); past it
//!   Envoy fails the request as above.
//! - **Client disconnects, upstream resets**: Envoy closes the gRPC stream; the processor drops
//!   the stream's state (held bytes included) as soon as it sees the end.
//! - **A frame outgrows `max_frame_bytes`** with [`Overflow::Error`](tower_bypass_marker::Overflow): the gRPC
//!   stream fails with `RESOURCE_EXHAUSTED`, so Envoy resets the HTTP stream (with the default
//!   `Overflow::Forward` the frame is forwarded unfiltered instead, as the tower body does).
//!   Checked by hand with Envoy 1.40.0: the frames before it arrive, then curl reports
//!   "transfer closed with outstanding read data remaining" over HTTP/1.1 and `RST_STREAM`
//!   `INTERNAL_ERROR` over HTTP/2.
//! - **A request the guard must read, with `request_body_mode` `STREAMED` or
//!   `BUFFERED_PARTIAL`** (or `GRPC` either way): the gRPC stream fails with
//!   `FAILED_PRECONDITION`, the message naming the mode (Envoy answers 500): the guard never lets
//!   a body it has not judged through.
//! - **An encoded event stream** with something to remove: a 502 `encoded_event_stream` as
//!   Envoy's local reply, before any byte of it.
//! - **`observability_mode` in Envoy's filter configuration**: the guard cannot work there.
//!   Envoy forwards requests and responses without waiting for the processor and ignores its
//!   answers, so router-owned names reach the upstream and annotations reach clients whatever
//!   the processor says. Every stream in that mode fails with `FAILED_PRECONDITION` from its
//!   first message, and the processor logs why in one `error` line (feature `tracing`, or `cli`:
//!   the binary logs it), once per connection: Envoy sends all its requests over a few HTTP/2
//!   connections, so the line does not repeat per request. That is under [`serve`]; in a tonic
//!   server of your own, which keeps nothing per connection for the processor, the line is
//!   logged once per [`ExtProc`] (its clones share it). Turn `observability_mode` off.
//! - **Message sequences it cannot judge** fail the gRPC stream with `FAILED_PRECONDITION`
//!   (Envoy answers 500, or resets a response in flight) rather than let a byte through unjudged:
//!   a request body before its headers or a response body before its headers
//!   (`request_header_mode` or `response_header_mode` set to `SKIP`), a second headers message.
//! - **Request bodies past the budget** ([`ExtProc::body_budget`]): a body whose bytes, as they
//!   arrive, would take the bodies every stream holds past it gets a 503 with `retry-after: 1`
//!   as Envoy's local reply (`request_bodies_over_budget`), as from the sidecar; never a failed
//!   stream, which Envoy would answer with a 500.
//! - **A headers message with more than 16,384 headers** (Envoy forwards 100 by default,
//!   `max_headers_count`) fails the gRPC stream with `RESOURCE_EXHAUSTED` (Envoy answers 500).
//! - **Response trailers**: in `STREAMED` mode Envoy does not tell the processor that a body
//!   ended when trailers end it. Bytes held for a frame still open at that point (a stream that
//!   ends in the middle of a frame, then sends trailers) are dropped rather than judged; complete
//!   frames are never held. In `FULL_DUPLEX_STREAMED` the trailers come to the processor, which
//!   judges and sends the open frame before answering them.
//!
//! Memory per stream: the request body while the guard reads it (at most `max_body_bytes`, in up
//! to three copies for the moment of the decision: gRPC's receive buffer, the decoded message, the
//! spliced body sent back; the receive buffer grows with the bytes that arrive, not with the size
//! a message's prefix announces, and is let go once the message is decoded; gRPC messages over
//! `max_body_bytes` plus 1 MiB are refused), then at
//! most `max_frame_bytes` held for a response frame, plus the chunk in hand. The guard judges a
//! body on the task that serves the stream (a 32 MiB chat request took 10 ms of ASCII text to
//! 47 ms of dense non-ASCII text on a 2-core test VM, release build): large bodies delay the other
//! streams of that worker thread by as much.
//!
//! # Public API (for the binary and the end-to-end suite)
//!
//! - [`ExtProc::new`]`(layer)`, [`ExtProc::max_body_bytes`]`(n)`: the processor.
//! - [`serve`]`(listener, processor, shutdown)`: the processor and `grpc.health.v1` on a
//!   `tokio::net::TcpListener`, until `shutdown` completes; returns `tonic::transport::Error`.
//!   It allows [`MAX_CONCURRENT_STREAMS`] streams per HTTP/2 connection.
//! - [`ExtProc::into_service`]: the [`ExtProcService`] alone, for a tonic server of your own.

mod answer_times;
mod connection;
mod exchange;
mod processor;
mod proto;
mod serve;
mod service;
mod stream;

pub use answer_times::{AnswerTimes, MessageKind};
pub use processor::ExtProc;
pub use serve::{serve, MAX_CONCURRENT_STREAMS};
pub use service::ExtProcService;
pub use stream::ProcessStream;
