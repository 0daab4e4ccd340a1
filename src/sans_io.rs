//! The two engines without tower, for hosts that are not tower services: the frame filter and,
//! with feature `json`, the request guard and the exchange that joins them.
//!
//! # Who this module is for
//!
//! A tower or axum user does not need anything here: [`BypassMarkerLayer`](crate::BypassMarkerLayer),
//! [`BypassMarker`](crate::BypassMarker), [`BypassMarkerBody`](crate::BypassMarkerBody) and, with
//! `json`, `JsonGuardLayer` drive these cores for them. This module
//! is for the other hosts, the ones that get bytes and headers from something that is not a tower
//! service and must answer with decisions:
//!
//! - the `bypass-marker` sidecar (a hyper proxy with its own connection handling);
//! - the Envoy external processor (`bypass-marker ext-proc`, one gRPC stream per HTTP request);
//! - the Envoy dynamic module and the proxy-wasm plugin (callbacks per header block and per body
//!   chunk, no async runtime);
//! - a proxy of your own, a fuzzer, a test.
//!
//! Nothing here does I/O, spawns, sleeps or needs an executor: like `httparse`, each type takes
//! byte slices and header maps and returns what to do, and reports "need more input" as a value.
//! Each type's page states its calling contract (which method to call with which input, in which
//! order).
//!
//! | type | what it judges | made by |
//! | --- | --- | --- |
//! | [`EventStreamFilter`] | one `text/event-stream` response body, chunk by chunk: [`FilterOutput`] to forward as owned `Bytes`, or a [`ChunkEdit`] of [`Piece`]s over the host's own chunk | [`BypassMarkerLayer::response_filter`](crate::BypassMarkerLayer::response_filter), [`event_stream_filter`](crate::BypassMarkerLayer::event_stream_filter) |
//! | `RequestGuard` (`json`) | one JSON request: its head (`HeadDecision`), then its whole body (`BodyDecision`: forward, a `Spliced` body, or a `Refusal`) | `BypassMarkerLayer::request_guard` |
//! | `GatewayExchange` (`json`) | one request and its response through a gateway's filter callbacks (`RequestStep`, `BodyStep`, `ResponseStep`) | `GatewayExchange::new` |
//!
//! The errors they return are the crate's: [`FrameTooLarge`](crate::FrameTooLarge) (also the
//! error of a filtered [`BypassMarkerBody`](crate::BypassMarkerBody)) and, for the exchange,
//! `ExchangeError`.
//!
//! # Why a module of its own
//!
//! The middleware and the cores change for different reasons. A tower user names the layer, the
//! service, the body, the future, [`RequestedAnnotations`](crate::RequestedAnnotations) and the
//! configuration; the hosts above need finer control (edits over borrowed chunks, steps in a
//! gateway's order), and they grow with Envoy's and proxy-wasm's callbacks. Keeping the cores here
//! lets the root and `json` hold only what the middleware's users name, so a
//! change that one of the other hosts needs shows up in this module and nowhere else.
//!
//! A module rather than a core crate: the cores and the middleware share one configuration
//! ([`BypassMarkerLayer`](crate::BypassMarkerLayer) builds both, so that every front door applies
//! the same names and limits) and one version number keeps the hosts and the middleware in step.
//! A separate crate would need that configuration in a third crate and a public API between the
//! two for what is internal today.
//!
//! # Stability
//!
//! This module follows semver like the rest of the crate, with these rules for growth:
//!
//! - every enum here is `#[non_exhaustive]`, and so are the struct variants whose fields may
//!   grow (`BodyStep::Replace`, `ResponseStep::Filter`): match with a wildcard arm (and `..`
//!   there), so that a new decision (a new kind of refusal, a new step) is a minor release;
//! - new methods and new types may appear in a minor release;
//! - a change that only the other hosts need (a new step for a new Envoy callback, a new edit
//!   shape) happens here, in a minor release if it is additive; the middleware's items do not
//!   change for it.
//!
//! The bytes they produce are the contract the middleware keeps too: for the same input, every
//! host that drives these cores forwards the same bytes as [`BypassMarkerBody`](crate::BypassMarkerBody)
//! and `JsonGuardLayer`. The repository's tests hold every front
//! door to that.

pub use crate::filter::{ChunkEdit, EventStreamFilter, FilterOutput, Piece};
#[cfg(feature = "json")]
#[cfg_attr(docsrs, doc(cfg(feature = "json")))]
pub use crate::json::exchange::{
    BodyStep, ExchangeError, GatewayExchange, RequestStep, ResponseStep, UnseenRequest,
};
#[cfg(feature = "json")]
#[cfg_attr(docsrs, doc(cfg(feature = "json")))]
pub use crate::json::guard::{BodyDecision, HeadDecision, Refusal, RequestGuard, Spliced};
