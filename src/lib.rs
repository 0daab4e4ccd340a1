//! Tower middleware that keeps router-internal annotation frames out of `text/event-stream`
//! responses unless the client asked for them.
//!
//! # The problem
//!
//! Disaggregated LLM routers such as NVIDIA Dynamo annotate streamed responses with frames meant
//! for the router's own clients. When the KV router bypasses remote prefill, Dynamo starts the
//! event stream with
//!
//! ```text
//! event: x-bypass-remote-prefill
//! : true
//!
//! ```
//!
//! an `event` field and a comment, with no `data` line. The OpenAI SDKs parse the `data` of every
//! frame as JSON, so openai-python raises `JSONDecodeError` and openai-node `SyntaxError`, and
//! every bypassed request fails.
//!
//! [`BypassMarkerLayer`] removes such frames from the response body, unless the client opted in
//! through its request's `nvext.annotations` (the same contract as Dynamo's `request_id`). Its
//! request-side guard, [`BypassMarkerLayer::guard_annotations`], strips router-owned names from
//! what the client sent, so a client cannot force the bypass either.
//!
//! With the `json` feature, a gateway that has no handler parsing the request gets that guard as
//! middleware: `BypassMarkerLayer::json_guard` makes a `JsonGuardLayer` from the same
//! configuration, which reads JSON request bodies, strips router-owned names from
//! `nvext.annotations` (splicing the array, never re-serialising the body) and puts the client's
//! opt-in in the request's extensions. See the `json` module (docs.rs builds with every feature).
//!
//! ```toml
//! tower-bypass-marker = { version = "0.1", features = ["json"] }
//! ```
//!
//! The other features: `envoy` adds `envoy::ExtProc`, an Envoy external processor over tonic that
//! drives the same guard and filter inside Envoy's `ext_proc` filter; `cli` adds the
//! `bypass-marker` binary (`bypass-marker proxy`, a sidecar in front of a server you cannot
//! rebuild, and `bypass-marker ext-proc`) and its library half, the `cli` module; `tracing` logs
//! every removed frame at `debug`. None is on by default: a middleware's users compile none of
//! tokio, hyper or tonic through this crate.
//!
//! # Example
//!
//! ```
//! use bytes::Bytes;
//! use http::{header, Request, Response};
//! use http_body_util::{BodyExt, Full};
//! use std::convert::Infallible;
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//! use tower_bypass_marker::{BypassMarkerLayer, RequestedAnnotations, BYPASS_REMOTE_PREFILL};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! // A streaming endpoint that starts its stream with Dynamo's marker.
//! let upstream = service_fn(|_req: Request<Full<Bytes>>| async {
//!     let body = "event: x-bypass-remote-prefill\n: true\n\ndata: {\"id\":1}\n\ndata: [DONE]\n\n";
//!     Ok::<_, Infallible>(
//!         Response::builder()
//!             .header(header::CONTENT_TYPE, "text/event-stream")
//!             .body(Full::new(Bytes::from(body)))
//!             .unwrap(),
//!     )
//! });
//!
//! // The default layer: the marker reaches only clients that opted in.
//! let svc = ServiceBuilder::new()
//!     .layer(BypassMarkerLayer::new())
//!     .service(upstream);
//!
//! let res = svc.clone().oneshot(Request::new(Full::default())).await?;
//! let bytes = res.into_body().collect().await?.to_bytes();
//! assert_eq!(bytes, "data: {\"id\":1}\n\ndata: [DONE]\n\n");
//!
//! // A client that listed the marker in `nvext.annotations`: the app puts the opt-in in the
//! // request's (or the response's) extensions and the frame is forwarded byte for byte.
//! let mut req = Request::new(Full::default());
//! req.extensions_mut()
//!     .insert([BYPASS_REMOTE_PREFILL].into_iter().collect::<RequestedAnnotations>());
//! let bytes = svc.oneshot(req).await?.into_body().collect().await?.to_bytes();
//! assert!(bytes.starts_with(b"event: x-bypass-remote-prefill\n: true\n\n"));
//! # Ok(())
//! # }
//! ```
//!
//! A customised layer, for a router that also emits `request_id` on request and `llm_metrics`
//! for itself:
//!
//! ```
//! use tower_bypass_marker::{BypassMarkerLayer, Overflow};
//!
//! let layer = BypassMarkerLayer::new()
//!     .opt_in("request_id")          // forwarded only to clients that ask
//!     .never_forward("llm_metrics")  // never forwarded, even when asked for
//!     .max_frame_bytes(64 * 1024)    // hold at most 64 KiB of a frame that spans chunks
//!     .on_overflow(Overflow::Error)  // and fail the body past that
//!     .sdk_safe(true);               // also drop every frame with fields but no `data`
//!
//! // In a handler, after parsing the request body:
//! let mut annotations = vec!["x-bypass-remote-prefill:true".to_owned(), "request_id".to_owned()];
//! let granted = layer.guard_annotations(&mut annotations);
//! assert_eq!(annotations, ["request_id"]); // the router never sees the client's marker
//! assert!(granted.contains("request_id")); // and the client gets its request_id frame
//!                                          // (an opt-in wins over SDK-safe mode)
//! ```
//!
//! In front of NVIDIA Dynamo, [`BypassMarkerLayer::dynamo`] configures every annotation name
//! Dynamo 1.6.1 uses (its routing markers, its opt-in annotations and its internal metrics). Names
//! from runtime configuration go through the fallible setters
//! ([`try_opt_in`](BypassMarkerLayer::try_opt_in) and the like), which return an [`InvalidName`]
//! instead of panicking.
//!
//! # What is removed, exactly
//!
//! The body is filtered when the response can have content (not a `1xx`, `204` or `304`
//! response, nor the response to a `HEAD` request), its media type is `text/event-stream`, it has
//! no `content-encoding` other than `identity`, and at least one configured name is to be removed
//! for this request (or SDK-safe mode is on). Every other response (JSON, gRPC, compressed
//! streams, responses without content) passes through untouched, headers included, with the inner
//! body's `size_hint` and `is_end_stream`. A filtered response loses its `content-length` header.
//!
//! Headers are read as bytes, as a browser reads them:
//!
//! - The media type is the one Fetch's "extract a MIME type" gives, which is what `EventSource`
//!   checks: of all `content-type` values (several headers, or a comma-separated list), the last
//!   one that parses as `type/subtype` (other than `*/*`) counts; type and subtype compare in any
//!   case, and parameters are not looked at, so `text/event-stream; x="\xE9"` is an event stream.
//!   So `text/event-stream` followed by a second `content-type: application/json` header is not.
//! - `content-encoding` is a list (RFC 9110, section 5.6.1): empty elements are ignored, so
//!   `identity, `, `,identity` and an empty value mean identity, while `gzip` or `identity, gzip`
//!   mean the body is encoded.
//!
//! The event-stream grammar is WHATWG's:
//!
//! - Lines end in CRLF, LF or CR; a CR ending one chunk and a LF starting the next are one line
//!   end. One UTF-8 BOM at the very start of the body is kept and is not part of the first line;
//!   any later BOM is content.
//! - A frame is a run of non-empty lines closed by an empty line. Its event type is the value of
//!   its *last* `event` field: the field name is compared byte for byte, a line without a colon is
//!   a field with an empty value, and exactly one space after the colon is removed. Comment lines
//!   (starting with `:`) belong to the frame they stand in.
//! - A frame whose event type is a name to remove is removed whole, its closing empty line
//!   included. Everything else is forwarded unchanged and in order: other frames, comments,
//!   keep-alives, stray empty lines, invalid UTF-8, NUL bytes.
//! - A frame still open when the body ends (or when trailers or an error arrive) is judged as it
//!   stands, its unterminated last line included.
//! - In SDK-safe mode, a frame with field lines but no `data` field is removed too, unless its
//!   event type is a name the client opted in to.
//! - The one byte the layer ever adds: when the first bytes it forwards would begin with a BOM
//!   (EF BB BF) and the body did not begin with one (the first kept frame after removed ones
//!   starts with a BOM), it forwards a LF first, then those bytes unchanged. Clients strip a BOM
//!   at the start of a stream, which would turn a line such as `\u{FEFF}event: x` (a field
//!   named `\u{FEFF}event`, ignored) into an `event` field; the LF is an empty line, a no-op at
//!   that point of the grammar.
//!
//! # Latency, copies and memory
//!
//! Once the last byte of a frame has arrived, the frame is yielded before the inner body is
//! polled again; only the bytes of a frame that is still open are held. Forwarded data are slices
//! of the inner body's [`Bytes`](bytes::Bytes): a chunk made of whole frames that are all kept is
//! forwarded as that same `Bytes`. Only a frame that spans chunks is copied, into a buffer capped
//! by [`BypassMarkerLayer::max_frame_bytes`] (1 MiB by default). Past the cap the frame is
//! forwarded as it arrives, unfiltered ([`Overflow::Forward`], the default: annotation frames are
//! tiny, so such a frame is data), or the body fails with [`FrameTooLarge`]
//! ([`Overflow::Error`]).
//!
//! Trailers are forwarded after all data. An error from the inner body is passed through, after
//! the data held for an open frame, judged as at the end of the body.
//!
//! # Without tower
//!
//! The layer is a thin adapter over two sans-IO cores that any host can drive, with no runtime,
//! no `http-body` and no tower: [`EventStreamFilter`] (made by
//! [`BypassMarkerLayer::response_filter`] from a response head) takes a body's chunks and gives
//! back the bytes to forward, and, with the `json` feature, `json::RequestGuard` (made by
//! `BypassMarkerLayer::request_guard`) decides what to do with a request from its head and its
//! body. The tower body, the JSON guard middleware and the crate's other front doors all drive
//! these two, so their behaviour cannot differ. [`FrameObserver`] counts what they remove and
//! forward, for metrics.
//!
//! # Where to put it
//!
//! Inside any compression layer: an encoded body is passed through unfiltered. With the `json`
//! feature, in axum: `.layer(bypass.clone()).layer(bypass.json_guard())` (either order works).

#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

pub mod annotations;
mod body;
#[cfg(feature = "cli")]
#[cfg_attr(docsrs, doc(cfg(feature = "cli")))]
pub mod cli;
mod config;
#[cfg(feature = "envoy")]
pub mod envoy;
mod filter;
mod future;
#[cfg(feature = "json")]
pub mod json;
mod layer;
mod observe;
mod scan;
mod service;

#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

#[cfg(test)]
#[path = "../tests/model/mod.rs"]
mod test_model;

pub use annotations::RequestedAnnotations;
pub use body::BypassMarkerBody;
pub use config::{
    InvalidName, Overflow, BYPASS_REMOTE_PREFILL, DEFAULT_MAX_FRAME_BYTES, MAX_NAMES, MAX_NAME_LEN,
};
pub use filter::{ChunkEdit, EventStreamFilter, FilterOutput, FrameTooLarge, Piece};
pub use future::ResponseFuture;
#[cfg(feature = "json")]
pub use json::{JsonGuard, JsonGuardLayer};
pub use layer::BypassMarkerLayer;
pub use observe::FrameObserver;
pub use service::BypassMarker;

/// The error type of [`BypassMarkerBody`]: the inner body's error, or [`FrameTooLarge`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
