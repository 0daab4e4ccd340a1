//! The request side as middleware (feature `json`): a guard that reads JSON request bodies, strips
//! router-owned names from `nvext.annotations` and grants the client's opt-in, with no handler
//! code.
//!
//! A gateway in front of Dynamo, vLLM or SGLang has no handler that parses the request, so
//! [`BypassMarkerLayer::guard_annotations`](crate::BypassMarkerLayer::guard_annotations) has no
//! place to run. [`JsonGuardLayer`], made from the same [`BypassMarkerLayer`](crate::BypassMarkerLayer)
//! with [`json_guard`](crate::BypassMarkerLayer::json_guard) so that there is one configuration,
//! does its job on the request body itself:
//!
//! - from the top-level object's `nvext.annotations` array it removes every entry that names a
//!   router-owned name, by the rule of `guard_annotations` (`name` or `name:value`, any ASCII
//!   case, surrounding whitespace, or a near miss a lenient upstream could fold into the name),
//!   compared after JSON unescaping (`"x\u002dbypass-remote-prefill"` is the marker);
//! - it puts the opt-in the client is allowed (each configured name it listed exactly, never a
//!   never-forwarded one) into the request's extensions, and into the response's, as
//!   [`RequestedAnnotations`](crate::RequestedAnnotations), where the response layer finds it.
//!
//! # Example
//!
//! ```
//! use bytes::Bytes;
//! use http::{header, Request, Response};
//! use http_body_util::{BodyExt, Full};
//! use tower::{service_fn, BoxError, ServiceBuilder, ServiceExt};
//! use tower_bypass_marker::json::JsonGuardBody;
//! use tower_bypass_marker::{BypassMarkerLayer, RequestedAnnotations};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), BoxError> {
//! let bypass = BypassMarkerLayer::new().opt_in("request_id");
//! // The upstream: here it answers with the JSON it received and the opt-in it was given.
//! let upstream = service_fn(|req: Request<JsonGuardBody<Full<Bytes>>>| async move {
//!     let granted = req.extensions().get::<RequestedAnnotations>().cloned().unwrap_or_default();
//!     let body = req.into_body().collect().await?.to_bytes();
//!     Ok::<_, BoxError>(Response::new(Full::new(Bytes::from(format!("{granted:?} {}",
//!         String::from_utf8_lossy(&body))))))
//! });
//! let svc = ServiceBuilder::new()
//!     .layer(bypass.json_guard()) // reads the request ...
//!     .layer(bypass.clone())      // ... for the response layer
//!     .service(upstream);
//!
//! let req = Request::post("/v1/chat/completions")
//!     .header(header::CONTENT_TYPE, "application/json")
//!     .body(Full::new(Bytes::from_static(
//!         br#"{"model":"m","nvext":{"annotations":["request_id", "X-Bypass-Remote-Prefill:true"]}}"#,
//!     )))?;
//! let res = svc.oneshot(req).await?;
//! let seen = res.into_body().collect().await?.to_bytes();
//! // The router never sees the client's marker, and the client gets its request_id frame.
//! assert_eq!(seen, r#"{"request_id"} {"model":"m","nvext":{"annotations":["request_id"]}}"#);
//! # Ok(())
//! # }
//! ```
//!
//! A customised guard, for chat requests with images larger than the default limit allows:
//!
//! ```
//! use tower_bypass_marker::BypassMarkerLayer;
//!
//! let bypass = BypassMarkerLayer::new().never_forward("llm_metrics");
//! let guard = bypass.json_guard().max_body_bytes(96 * 1024 * 1024);
//! # let _ = guard;
//! ```
//!
//! In axum, `Router::layer` wraps what is already there, so the guard is added last:
//! `.layer(bypass.clone()).layer(bypass.json_guard())`. The order of the two layers does not
//! matter for the opt-in, though: the guard puts it in the response's extensions too, which the
//! response layer reads when the response head arrives; the tests run both orders. A compression
//! layer goes after both, outermost: see [where to put it](crate#where-to-put-it).
//!
//! # Which requests are read
//!
//! A request is read when it has a body (one not known to be empty) and a JSON content type:
//! `application/json` or `application/<anything>+json`, any case, with parameters (any one of
//! several `content-type` headers counts, and so does any one element of a comma-separated value,
//! which is how Envoy merges repeated headers: `text/plain,application/json` is read), or no
//! `content-type` at all (or an empty one, or an empty element), which many frameworks (FastAPI
//! among them) parse as JSON anyway. Elements are split at commas outside quoted strings and, in
//! case a quote is left open, at every comma: a comma inside a quoted parameter may make the guard
//! read a body it could have skipped, never the other way round. Every other request (GET, gRPC,
//! multipart, text, forms) passes through without being buffered: same body, same `size_hint`,
//! same `is_end_stream`, unless [`BypassMarkerLayer::non_json_bodies`](crate::BypassMarkerLayer::non_json_bodies)
//! asks the guard to judge ([`NonJsonBodies::Judge`](crate::NonJsonBodies::Judge)) or refuse
//! ([`NonJsonBodies::Refuse`](crate::NonJsonBodies::Refuse), 415 `unsupported_media_type`) those
//! bodies that look like JSON.
//!
//! # Limits and errors
//!
//! A read body is buffered whole, up to [`JsonGuardLayer::max_body_bytes`]
//! ([`DEFAULT_MAX_BODY_BYTES`], 32 MiB). The guard answers itself, with an error in OpenAI's shape
//! (`{"error":{"code":"...","message":"...","param":null,"type":"invalid_request_error"}}`,
//! `content-type: application/json`), when:
//!
//! | status | `code` | when |
//! | --- | --- | --- |
//! | 413 | `request_too_large` | `content-length` (or the body's size hint) is over the limit: refused before reading, so no `100 Continue` is sent; a body without a length: as soon as the bytes received pass the limit |
//! | 415 | `unsupported_content_encoding` | a `content-encoding` other than `identity`: the guard cannot read an encoded body |
//! | 415 | `unsupported_media_type` | under [`NonJsonBodies::Refuse`](crate::NonJsonBodies::Refuse): a body with a non-JSON content type that looks like JSON |
//! | 400 | `invalid_json` | not RFC 8259 JSON: not UTF-8 (a BOM included), truncated, trailing data, `NaN`, `Infinity`, comments, nesting deeper than serde_json's recursion limit (128), an escape in a key or an annotation that does not decode (a lone surrogate) |
//! | 400 | `duplicate_key` | `nvext` twice in the top-level object, or `annotations` twice in `nvext`, however spelled (`"nv\u0065xt"` is `nvext`): parsers disagree on which one counts, and a guard that read one while the upstream read the other would let a client force the bypass |
//! | 400 | `invalid_nvext` | `nvext` that is not an object or `null`, or `nvext.annotations` that is not an array or `null`: an upstream that tests a string or an object for membership would find a name the guard never saw as an entry |
//! | 413 | `request_too_large` | the request body failed with a length limit while being read: tower-http's `RequestBodyLimitLayer` or http-body-util's `Limited` outside the guard (their `LengthLimitError`, anywhere in the error's `source()` chain) |
//! | 408 | `request_timeout` | the request body failed with a timeout while being read: tower-http's `RequestBodyTimeoutLayer` outside the guard (its `TimeoutError`), or an `io::Error` of kind `TimedOut` |
//! | 400 | `body_read_error` | the request body failed while being read, with any other error |
//! | 503 | `request_bodies_over_budget` | the bodies being read would hold more than the guard's [`GuardBudget`] (type `server_error`, with `Retry-After: 1`; see [Memory across requests](#memory-across-requests)) |
//!
//! An empty body is forwarded as it is. A valid JSON document whose top level is not an object (an
//! array, a string, a number) is forwarded unchanged with nothing granted: the upstream reads
//! `nvext` only as a member of the top-level object, so nothing in such a document is an
//! annotation. Keys other than `nvext` and `annotations` may repeat (the guard does not read them).
//!
//! The guard depends on neither tower-http nor http-body-util: it knows their errors by their
//! `Display` text (`length limit exceeded`, `data was not received within the designated timeout`),
//! which its tests hold to the real types of tower-http 0.7 and http-body-util 0.1
//! ([`Refusal::for_body_error`](crate::sans_io::Refusal::for_body_error)). For that it needs the
//! body's error to be a `BoxError` or convertible into one (`B::Error: Into<BoxError>`, as hyper's,
//! axum's and tower-http's bodies are).
//!
//! axum's `DefaultBodyLimit` is not honoured by the guard: it is an extension that axum's extractors
//! read, and the guard, a layer, has read the body whole before any extractor runs. The handler's
//! extractor still refuses the body afterwards (axum's own 413, in text), but the guard has buffered
//! it up to its own cap first. Set [`JsonGuardLayer::max_body_bytes`] to the same limit, or put
//! tower-http's `RequestBodyLimitLayer` outside the guard, to bound what it reads.
//!
//! # Memory across requests
//!
//! The bytes held by all the bodies being read at once are capped by a [`GuardBudget`], shared by
//! every clone of a [`JsonGuardLayer`] and every service it makes: [`DEFAULT_MAX_BUFFERED_BYTES`]
//! (1 GiB, 32 bodies of the default cap) unless set with
//! [`JsonGuardLayer::max_buffered_bytes`], or shared between several layers with
//! [`JsonGuardLayer::budget`]. A body is charged only what it holds: each chunk as it arrives (a
//! `content-length` reserves nothing, and a body refused by it before reading is charged nothing),
//! all of it given back once the body is judged (forwarded or refused) or its future dropped (a client
//! gone mid-upload). Past the budget the request is answered 503 `request_bodies_over_budget` with
//! `Retry-After: 1`, as the `bypass-marker` sidecar answers past `--max-buffered-bytes`, and a body
//! over [`SMALL_BODY_BYTES`] may use only seven eighths of it, so that large uploads never lock out
//! small chat requests. Size it to the memory the process may spend on request bodies: the sidecar
//! takes half its cgroup's memory limit. [`JsonGuardLayer::held_bytes`] reads what is held now.
//!
//! # Bytes and copies
//!
//! The body is read once, in one pass that both validates it (the RFC 8259 grammar, UTF-8 inside
//! strings, serde_json's nesting limit of 127 levels) and finds `nvext.annotations`; every value the
//! guard does not need is stepped over without being decoded. Only the keys of the top-level object
//! and of `nvext`, and the string entries of `nvext.annotations`, are unescaped (by serde_json) to
//! be compared. The pass is held to serde_json's verdict by the `json` fuzz target and by exhaustive
//! tests of its string and UTF-8 rules. On a 1 MiB chat request with a base64 image the guard is
//! faster than `serde_json::from_slice::<IgnoredAny>` of the same bytes, which checks less
//! ([BENCHMARKS.md](https://github.com/tower-bypass-marker/tower-bypass-marker/blob/main/BENCHMARKS.md)).
//! When nothing is stripped the upstream gets the very `Bytes` the
//! guard buffered (a body that arrived in one chunk is not copied at all; one that arrived in
//! several is joined once). When something is stripped, only the array's bytes change: the
//! upstream gets the bytes before the array and after it as slices of that buffer, with the new
//! array between them. The kept entries keep their spelling and the separators before them; every
//! other byte of the document (key order, whitespace, `1.0`, `1e400`, long integers, escapes) is
//! the client's. A `content-length` header is updated; trailers are forwarded after the data.
//!
//! Entries that are not strings, and strings the configuration does not know, stay.

mod body;
mod budget;
pub(crate) mod exchange;
mod future;
pub(crate) mod guard;
mod layer;
mod response;
mod service;
mod splice;

pub use body::JsonGuardBody;
pub use budget::{BudgetCharge, GuardBudget, DEFAULT_MAX_BUFFERED_BYTES, SMALL_BODY_BYTES};
pub use future::ResponseFuture;
pub use layer::JsonGuardLayer;
pub use response::ResponseBody;
pub use service::JsonGuard;

/// The default cap on a JSON request body the guard buffers: 32 MiB.
///
/// Chat requests carry images inline as base64 data URLs, which are a third larger than the image.
/// OpenAI accepts images of up to 20 MB each; one of them is 26.7 MB of base64 (25.4 MiB), and 32
/// MiB leaves room for the rest of a long conversation. Requests with several large images need a
/// larger [`JsonGuardLayer::max_body_bytes`] (OpenAI's own cap, 50 MB of images per request, is
/// 64 MiB of base64).
pub const DEFAULT_MAX_BODY_BYTES: usize = 32 * 1024 * 1024;
