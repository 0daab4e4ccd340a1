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
//! [`BypassMarkerLayer`] removes such frames from the response body unless the client opted in
//! through its request's `nvext.annotations` (the same contract as Dynamo's `request_id`); other
//! responses pass untouched. Its request side ([`BypassMarkerLayer::guard_annotations`], or with
//! `json` the `JsonGuardLayer` middleware) strips router-owned names from what clients send.
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
//! Dynamo 1.6.1 uses, and `x-prefill-continue`. Names from runtime configuration go through the
//! fallible setters ([`try_opt_in`](BypassMarkerLayer::try_opt_in) and the like).
//!
//! # Where to put it
//!
//! The layer reads the body as the service below it wrote it, so its place is *inside* any layer
//! that compresses responses: compression then applies to the filtered stream. The two ways of stacking
//! layers nest in opposite orders:
//!
//! - axum's `Router::layer` wraps what is already there: the layer added **last** is the outermost,
//!   so add the compression layer after this one;
//! - in a tower `ServiceBuilder` the layer added **first** is the outermost, so add the compression
//!   layer before this one.
//!
//! A gateway in front of Dynamo, vLLM or SGLang, in axum, with the JSON guard and tower-http's
//! `CompressionLayer` set to compress event streams (its default predicate never does):
//!
//! ```rust,no_run
//! use axum::{routing::post, Router};
//! use tower_bypass_marker::BypassMarkerLayer;
//! use tower_http::compression::predicate::{NotForContentType, Predicate, SizeAbove};
//! use tower_http::compression::CompressionLayer;
//!
//! # async fn chat_completions() -> &'static str { "" }
//! # #[cfg(feature = "json")]
//! # async fn run() {
//! let bypass = BypassMarkerLayer::dynamo(); // Dynamo 1.6.1's annotation names
//! // tower-http's default predicate, less its exception for `text/event-stream`.
//! let events_too = SizeAbove::default()
//!     .and(NotForContentType::GRPC)
//!     .and(NotForContentType::IMAGES);
//! let app = Router::new()
//!     .route("/v1/chat/completions", post(chat_completions))
//!     .layer(bypass.clone())       // responses: annotation frames only for clients that asked
//!     .layer(bypass.json_guard())  // requests: router-owned names stripped, the opt-in granted
//!     .layer(CompressionLayer::new().compress_when(events_too)); // last: compresses what is kept
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await.unwrap();
//! axum::serve(listener, app).await.unwrap();
//! # }
//! ```
//!
//! Clients that accept gzip get each filtered event compressed as soon as it is written. The guard
//! and the response layer may come in either order; a `ServiceBuilder` reads the other way round:
//!
//! ```rust
//! use tower::ServiceBuilder;
//! use tower_bypass_marker::BypassMarkerLayer;
//! use tower_http::compression::CompressionLayer;
//!
//! let middleware = ServiceBuilder::new()
//!     .layer(CompressionLayer::new()) // first: the outermost, compresses what the next one kept
//!     .layer(BypassMarkerLayer::new());
//! # let _ = middleware;
//! ```
//!
//! The other order works too: for every request that may have something removed, the layer asks
//! the services below it for `accept-encoding: identity` (and cuts `TE` down to `trailers`), so a
//! compression layer inside it leaves the stream readable; the layers outside still compress, but
//! below it nothing is compressed for such requests. A service below that compresses anyway gets a
//! **502** `encoded_event_stream` in place of its stream ([Encoded
//! bodies](BypassMarkerBody#encoded-bodies)), which keeps `vary`, `access-control-*` and
//! `x-request-id`. With tonic's `Server::layer` (ordered as a `ServiceBuilder`), gRPC passes
//! through untouched: see [tonic](BypassMarkerLayer#with-tonic).
//!
//! # Features
//!
//! None is on by default:
//! - `json`: `JsonGuardLayer` (`BypassMarkerLayer::json_guard`), the request guard as middleware
//!   (the `json` module), and in [`sans_io`] its core and `GatewayExchange`.
//! - `tracing`: an event for every decision, in the request's span: every removed frame at
//!   `debug`, a summary per filtered body, and the guard's strips, grants and refusals, frames too
//!   large and encoded streams refused ([the list, with their fields](FrameObserver#tracing-events)).
//!
//! ```toml
//! tower-bypass-marker = { version = "0.1", features = ["json"] }
//! ```
//!
//! # Status
//!
//! Version 0.1.0, the first release (not yet on crates.io). Stable under semver from 0.1: the
//! middleware (the layers, services, bodies and futures), the configuration, [`FrameObserver`]
//! and the error shapes. [`sans_io`] follows the growth rules on its page (`#[non_exhaustive]`
//! enums; new decisions in minor releases). Tested with tower-http 0.7 and 0.6
//! (`tests/composition.rs` runs its stacks over both), axum 0.8, hyper 1 and tonic 0.14, on Rust
//! 1.85 and later.
//!
//! # Reference
//!
//! - [`BypassMarkerLayer`]: every setting and its default, the rules for names, tonic, and the
//!   [security model](BypassMarkerLayer#security-model): what the layer guarantees against a
//!   client, and what it does not.
//! - [`BypassMarkerBody`]: [what is removed, exactly](BypassMarkerBody#what-is-removed-exactly)
//!   (the headers and the event-stream grammar as a browser reads them), latency, copies and
//!   memory, and encoded bodies.
//! - [`RequestedAnnotations`]: the client's opt-in; the [`annotations`] module: a handler that
//!   parses the request itself.
//! - Hooks, each with its default: [`BypassMarkerLayer::opt_in_from`] (the opt-in from the
//!   request's head, without the JSON guard), [`BypassMarkerLayer::error_body`] (the shape of the
//!   error responses; OpenAI's envelope by default) and [`FrameObserver::for_request`] (an observer
//!   per request, from its extensions). Every body the crate returns implements `Default` where
//!   its inner body does, for layers that answer with `ResBody::default()`.
//! - Without tower: the [`sans_io`] module, [`sans_io::EventStreamFilter`] (made by
//!   [`BypassMarkerLayer::response_filter`] from a response head) and, with `json`,
//!   `sans_io::RequestGuard`, the two sans-IO cores every front
//!   door drives, for a host of your own; [`FrameObserver`] counts what they remove and forward.
//! - In front of a server you cannot rebuild, or inside Envoy: the sidecar and the Envoy external
//!   processor of the [`bypass-marker`](https://docs.rs/bypass-marker) package, and the Envoy
//!   dynamic module; the operators' pages are
//!   [docs/sidecar.md](https://github.com/tower-bypass-marker/tower-bypass-marker/blob/main/docs/sidecar.md)
//!   and
//!   [docs/envoy.md](https://github.com/tower-bypass-marker/tower-bypass-marker/blob/main/docs/envoy.md).

#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_code)]

#[macro_use]
mod macros;

pub mod annotations;
mod body;
mod config;
mod filter;
mod future;
#[cfg(feature = "json")]
#[cfg_attr(docsrs, doc(cfg(feature = "json")))]
pub mod json;
mod layer;
mod observe;
pub mod sans_io;
mod scan;
mod service;

#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

pub use annotations::RequestedAnnotations;
pub use body::BypassMarkerBody;
pub use config::{
    ErrorParts, InvalidName, InvalidNameKind, NonJsonBodies, Overflow, Role, BYPASS_REMOTE_PREFILL,
    DEFAULT_MAX_FRAME_BYTES, MAX_NAMES, MAX_NAME_LEN,
};
pub use filter::FrameTooLarge;
pub use future::ResponseFuture;
#[cfg(feature = "json")]
#[cfg_attr(docsrs, doc(cfg(feature = "json")))]
pub use json::{JsonGuard, JsonGuardLayer};
pub use layer::BypassMarkerLayer;
pub use observe::FrameObserver;
pub use service::BypassMarker;

/// The error type of [`BypassMarkerBody`]: the inner body's error, or [`FrameTooLarge`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
