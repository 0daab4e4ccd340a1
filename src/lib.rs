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
//! for this request (or SDK-safe mode is on). Every other response (JSON, gRPC, responses without
//! content) passes through untouched, headers included, with the inner body's `size_hint` and
//! `is_end_stream`. A filtered response loses its `content-length` header. An event stream with a
//! `content-encoding` other than `identity` is not read at all: see [Encoded
//! bodies](#encoded-bodies).
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
//! ```rust
//! use bytes::Bytes;
//! use http::{header, HeaderMap, Method, StatusCode};
//! use tower_bypass_marker::{BypassMarkerLayer, FilterOutput, RequestedAnnotations};
//!
//! let layer = BypassMarkerLayer::dynamo();
//! let mut headers = HeaderMap::new();
//! headers.insert(header::CONTENT_TYPE, "text/event-stream".parse().unwrap());
//! let asked = RequestedAnnotations::new(); // from the request's nvext.annotations, via the guard
//! let mut filter = layer
//!     .response_filter(&Method::POST, StatusCode::OK, &headers, &asked)
//!     .expect("an event stream with something to remove");
//! let mut out = Vec::new();
//! for chunk in ["event: x-bypass-remote-prefill\n: tr", "ue\n\ndata: {}\n\n"] {
//!     filter.push(Bytes::from(chunk));
//!     while let FilterOutput::Data(bytes) = filter.poll_output().unwrap() {
//!         out.extend_from_slice(&bytes); // write these to the client now
//!     }
//! }
//! filter.finish();
//! while let FilterOutput::Data(bytes) = filter.poll_output().unwrap() {
//!     out.extend_from_slice(&bytes);
//! }
//! assert_eq!(out, b"data: {}\n\n");
//! ```
//!
//! # Where to put it
//!
//! Inside any compression layer: the layer reads the body as the service below it wrote it, and
//! cannot read an encoded one (see [Encoded bodies](#encoded-bodies)).
//!
//! ```rust
//! use tower::ServiceBuilder;
//! use tower_bypass_marker::BypassMarkerLayer;
//! use tower_http::compression::CompressionLayer;
//!
//! let middleware = ServiceBuilder::new()
//!     .layer(CompressionLayer::new()) // outer: compresses what the inner layer filtered
//!     .layer(BypassMarkerLayer::new());
//! # let _ = middleware;
//! ```
//!
//! tower-http's default `CompressionLayer` predicate never compresses `text/event-stream`, so with it
//! either order filters. The order matters as soon as event streams are compressed (a custom
//! `compress_when` predicate): outside the compression layer, this layer sees `content-encoding:
//! gzip` and answers 502 instead of the stream (below), so every client that did not opt in to
//! everything gets an error rather than its stream (`tests/compression.rs` pins both orders).
//!
//! # Encoded bodies
//!
//! The filter reads event-stream bytes; it cannot read a gzip or brotli stream, and cutting bytes
//! out of one would break it. So an event stream whose `content-encoding` is not `identity` (a
//! compression layer below this one, an upstream that compresses although a proxy asked it for
//! `accept-encoding: identity`) is never passed through to a client it would have to be filtered
//! for: when at least one configured name is to be removed for this request, the layer answers
//! **502** in its place, before any byte of it, with an error in OpenAI's shape
//! (`{"error":{"code":"encoded_event_stream","message":"... content-encoding gzip ...",
//! "param":null,"type":"server_error"}}`, `content-type: application/json`, the stream's own
//! headers dropped) and never polls the stream's body, which is dropped with the response
//! ([`BypassMarkerBody::is_refused`]). A [`FrameObserver`] hears of it
//! ([`encoded_stream_refused`](FrameObserver::encoded_stream_refused)). When nothing is to be
//! removed (the client opted in to every configured name that is not never-forwarded), the encoded
//! stream passes through untouched. The same holds at every front door: the JSON guard's
//! `json::Exchange` (feature `json`; the Envoy processor and module drive it) answers
//! `ResponseStep::Refuse` with the same error, the sidecar answers the same 502, and a host of
//! your own asks [`BypassMarkerLayer::refuses_encoded`].
//!
//! Failing is the only safe answer: decoding and re-encoding would cost the layer a decompressor
//! and a compressor per stream (and the dependencies), and passing the stream on would hand
//! router-owned frames to a client that decompresses them. An application that compresses event
//! streams puts its compression layer outside this one.
//!
//! # Configuration
//!
//! | setter | default | what it does |
//! | --- | --- | --- |
//! | [`BypassMarkerLayer::new()`] | | frames whose event type is `x-bypass-remote-prefill` are removed unless the client opted in; the guard strips that name from requests |
//! | [`BypassMarkerLayer::dynamo()`] | | the preset for NVIDIA Dynamo 1.6.1's frontend: router-owned `x-bypass-remote-prefill` and `x-prefill-continue` (newer Dynamo source); opt-in `request_id`, `formatted_prompt`, `token_ids` (Dynamo sends them only to clients that list them, as `event: NAME` plus a `: "<JSON string>"` comment, no `data`); never-forwarded `llm_metrics`, `payload_usage` (internal). `error` events are not annotations and are left alone |
//! | `.opt_in(name)` | | also remove `name` frames (e.g. `request_id`) unless the client opted in; the guard leaves `name` in the request |
//! | `.router_owned(name)` | | another router-owned marker: removed unless opted in, stripped from requests in every form |
//! | `.never_forward(name)` | | always remove `name` frames (e.g. `llm_metrics`), even when the client asks |
//! | `.max_frame_bytes(n)` | 1 MiB | cap on the bytes held for one frame that spans body chunks |
//! | `.on_overflow(o)` | [`Overflow::Forward`] | past the cap: forward that frame unfiltered as it arrives, or [`Overflow::Error`]: fail the body with [`FrameTooLarge`] |
//! | `.json_guard()` | | (feature `json`) the request guard as middleware, a `JsonGuardLayer` with this layer's names |
//! | `JsonGuardLayer::max_body_bytes(n)` | 32 MiB | cap on a JSON request body the guard buffers: one image at OpenAI's 20 MB per-image maximum is 26.7 MB of base64, and 32 MiB leaves room for the conversation |
//! | `.sdk_safe(bool)` | off | also remove every frame with field lines but no `data` field that no opt-in of the client covers (fatal to the OpenAI SDKs; never dispatched by browsers, though a frame with only `id:` or `retry:` still sets the last event ID or the reconnection time there, and goes with the frame); comment-only keep-alives stay; a frame of a type the client opted in to is always forwarded |
//!
//! A layer knows at most 64 names ([`MAX_NAMES`]). A name must be non-empty, at most 256 bytes
//! ([`MAX_NAME_LEN`]), without `:` or any control character (CR and LF included), and must not start
//! or end with whitespace: exactly the names the guard can recognise in every form it strips. The
//! setters above panic on anything else; for names that come from runtime configuration, use
//! [`try_opt_in`](BypassMarkerLayer::try_opt_in), `try_router_owned` and `try_never_forward`, which
//! return an [`InvalidName`] error instead (the 65th name too):
//!
//! ```rust
//! use tower_bypass_marker::BypassMarkerLayer;
//!
//! let from_config = ["request_id", "x-route:hint"];
//! let mut layer = BypassMarkerLayer::new();
//! for name in from_config {
//!     layer = match layer.clone().try_opt_in(name) {
//!         Ok(layer) => layer,
//!         Err(e) => {
//!             eprintln!("skipping {name:?}: {e}"); // annotation name "x-route:hint" contains ':'
//!             layer
//!         }
//!     };
//! }
//! ```
//!
//! The `tracing` feature (off by default) logs at `debug` level every removed frame (its event type
//! and size) and a summary per filtered body: removed frames and bytes when it ends, the limit when
//! it fails with [`FrameTooLarge`], and the held bytes when it is dropped before its end.
//!
//! # Use it with axum
//!
//! A gateway in front of Dynamo, vLLM or SGLang, with no handler that parses the request: the
//! response layer and, with the `json` feature, the request guard, both from one configuration:
//!
//! ```rust,no_run
//! use axum::{routing::post, Router};
//! use tower_bypass_marker::BypassMarkerLayer;
//!
//! # async fn chat_completions() -> &'static str { "" }
//! # #[cfg(feature = "json")]
//! # async fn run() {
//! let bypass = BypassMarkerLayer::new().opt_in("request_id");
//! let app = Router::new()
//!     .route("/v1/chat/completions", post(chat_completions))
//!     .layer(bypass.clone())       // responses: annotation frames only for clients that asked
//!     .layer(bypass.json_guard()); // requests: router-owned names stripped, the opt-in granted
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await.unwrap();
//! axum::serve(listener, app).await.unwrap();
//! # }
//! ```
//!
//! The guard reads JSON request bodies (`application/json`, `application/*+json`, or no content
//! type), strips every router-owned entry from the top-level `nvext.annotations` (in every form,
//! compared after JSON unescaping), and puts what the client may see into the request's and the
//! response's extensions as [`RequestedAnnotations`], where the response layer finds it; either
//! layer order works. The rest of the body is not re-serialised: when nothing is stripped the
//! upstream gets the very bytes the client sent; otherwise only the array's bytes change. Bodies are
//! buffered up to 32 MiB (`.json_guard().max_body_bytes(n)`; 413 past it, before reading when
//! `content-length` says so); encoded JSON bodies get 415; malformed JSON (`NaN`, trailing data,
//! truncated, nested past 127 levels), duplicate `nvext` or `annotations` keys, and an `nvext` or
//! `annotations` of another type get 400. Errors are JSON in OpenAI's shape. Other requests pass
//! through unread. The rules in full: the `json` module's docs.
//!
//! A handler that parses the request itself can run the client's `nvext.annotations` through the
//! layer's guard with a typed request, and return what the client may see as a response extension:
//!
//! ```rust
//! use axum::{Extension, Json};
//! use serde::{Deserialize, Serialize};
//! use serde_json::{Map, Value};
//! use tower_bypass_marker::{BypassMarkerLayer, RequestedAnnotations};
//!
//! #[derive(Deserialize, Serialize)]
//! struct ChatRequest {
//!     model: String,
//!     nvext: Option<NvExt>,
//!     #[serde(flatten)]
//!     rest: Map<String, Value>,
//! }
//!
//! #[derive(Deserialize, Serialize)]
//! struct NvExt {
//!     #[serde(default)]
//!     annotations: Vec<String>,
//!     #[serde(flatten)]
//!     rest: Map<String, Value>,
//! }
//!
//! async fn chat_completions(
//!     Extension(layer): Extension<BypassMarkerLayer>,
//!     Json(mut request): Json<ChatRequest>,
//! ) -> (Extension<RequestedAnnotations>, String) {
//!     let granted = match &mut request.nvext {
//!         Some(nvext) => layer.guard_annotations(&mut nvext.annotations),
//!         None => RequestedAnnotations::new(),
//!     };
//!     // ... send `request` to the router and stream its `text/event-stream` response back ...
//!     (Extension(granted), String::new())
//! }
//! # fn app() -> axum::Router {
//! #     let layer = BypassMarkerLayer::new().opt_in("request_id");
//! #     axum::Router::new()
//! #         .route("/v1/chat/completions", axum::routing::post(chat_completions))
//! #         .layer(layer.clone())
//! #         .layer(Extension(layer))
//! # }
//! ```
//!
//! A body whose `nvext` or `annotations` has another type is refused by `Json` (422) before the
//! handler runs. (`Extension(layer)` works when the same `BypassMarkerLayer` is also added with
//! `.layer(Extension(layer.clone()))`.) An outer middleware that knows the opt-in earlier can insert
//! a `RequestedAnnotations` into the request's extensions instead; the union of both counts.
//!
//! # Use it with tonic
//!
//! The layer passes gRPC through untouched, so one layer can sit in front of a server that carries
//! both gRPC services and HTTP streaming routes:
//!
//! ```rust,no_run
//! use tonic::transport::Server;
//! use tower_bypass_marker::BypassMarkerLayer;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let (_reporter, health) = tonic_health::server::health_reporter();
//! Server::builder()
//!     .layer(BypassMarkerLayer::new())
//!     .add_service(health)
//!     .serve("127.0.0.1:50051".parse()?)
//!     .await?;
//! # Ok(())
//! # }
//! ```
//!
//! # Security model
//!
//! The upstream router is trusted; the client is not.
//!
//! - **Clients cannot force the bypass.** `guard_annotations` strips every router-owned name from the
//!   client's `nvext.annotations` before the request reaches the router, in every form: `name`,
//!   `name:value`, any ASCII case, surrounding spaces (`tests/guard.rs` tests each form;
//!   `tests/router.rs` checks that the simulated worker never sees one). Names this rule could not
//!   match (with `:`, control characters or surrounding whitespace, or over 256 bytes) are refused
//!   when the layer is configured, so it holds for every configured name (`tests/names.rs` checks
//!   every one- and two-byte ASCII name and generated ones).
//! - **Nor behind the JSON guard's back.** `JsonGuardLayer` applies the same rule to the body, after
//!   JSON unescaping, and refuses (400) what a parser could read differently from it: duplicate
//!   `nvext` or `annotations` keys however spelled (`"nv\u0065xt"`), which parsers resolve
//!   differently; input that is not RFC 8259 JSON (`NaN` and `Infinity`, which Python accepts;
//!   trailing data; truncated bodies; nesting past serde_json's limit); an `nvext` that is not an
//!   object or `null` and an `annotations` that is not an array or `null` (a Python `in` test on a
//!   string or an object would find a name the guard never saw as an entry). A JSON body it cannot
//!   read (encoded) is refused with 415, one over its limit with 413
//!   (`tests/json_guard.rs`, `tests/json_properties.rs`, `tests/json_stacks.rs`, a fuzz target).
//! - **Clients cannot read never-forwarded annotations**, even when they ask: `never_forward` names
//!   are removed whatever `RequestedAnnotations` says.
//! - **Clients cannot opt in through anything but what the application grants.** The layer reads
//!   the opt-in only from `RequestedAnnotations` in the request or response extensions, which only
//!   application code can put there; no header or query parameter is consulted. A value form such as
//!   `x-bypass-remote-prefill:true` is stripped and is not an opt-in.
//!
//! The sidecar and the processor (`bypass-marker proxy`, `ext-proc`) fail closed when misused or
//! misconfigured:
//!
//! - **One instance per address.** A second proxy or processor on an address in use fails to start
//!   ("address in use"), whatever `--threads` says: no stale or misconfigured instance can share the
//!   port and serve some of the clients (the proxy's threads accept from one listener, without
//!   `SO_REUSEPORT`).
//! - **Nothing about the upstream reaches clients.** 502 and 504 bodies say only which kind of
//!   failure it was (`upstream_unreachable`, `upstream_failed`, `upstream_timeout`); the upstream's
//!   address and the OS error are logged. An `--upstream` with credentials (`http://user:pass@host`)
//!   is refused at start, without repeating them: they would have gone upstream in `Host` and into
//!   the logs.
//! - **No tunnels.** `CONNECT` gets a 405 and never reaches the upstream.
//! - **Slow or stalled clients cannot hold the proxy.** A client that stops reading is cut off after
//!   `--write-timeout` (its upstream request cancelled), and the proxy holds at most
//!   `--max-connections` connections (by default what its open-file limit leaves room for, with the
//!   upstream connections they need): the others wait in the backlog, and no accepted request is
//!   refused its upstream connection for want of a descriptor.
//! - **The processor's limits.** A headers message with more than 16,384 headers fails its stream
//!   with `RESOURCE_EXHAUSTED` (Envoy answers 500); the processor allows 1,024 concurrent streams per
//!   HTTP/2 connection (`SETTINGS_MAX_CONCURRENT_STREAMS`; Envoy opens another connection past it).
//!
//! What the layer does not protect:
//!
//! - **Encoded bodies** cannot be filtered: an encoded event stream is refused with a 502 when
//!   something is to be removed from it ([Encoded bodies](#encoded-bodies)), so such a route fails
//!   until the layer goes inside the compression layer or the upstream stops compressing.
//! - **Oversized frames under `Overflow::Forward`.** A frame that outgrows `max_frame_bytes` (1 MiB by
//!   default) is forwarded unfiltered, even one that starts with `event: x-bypass-remote-prefill`;
//!   memory stays bounded either way. Use `Overflow::Error` if such a frame must never reach a
//!   client. Dynamo's annotation frames are a few dozen bytes.
//! - **Non-event-stream responses.** JSON and gRPC bodies are never inspected.
//! - **Requests the JSON guard does not read.** It reads bodies with a JSON content type, an empty
//!   one or none; an upstream that parses bodies of other content types (`text/plain`, forms) as
//!   JSON, as a Starlette handler calling `request.json()` does, can be sent annotations the guard
//!   never saw.
//!   A valid JSON body whose top level is not an object is forwarded unchanged (an upstream reads
//!   `nvext` only as a member of the top-level object).

#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

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
    InvalidName, Overflow, Role, BYPASS_REMOTE_PREFILL, DEFAULT_MAX_FRAME_BYTES, MAX_NAMES,
    MAX_NAME_LEN,
};
pub use filter::{ChunkEdit, EventStreamFilter, FilterOutput, FrameTooLarge, Piece};
pub use future::ResponseFuture;
#[cfg(feature = "json")]
#[cfg_attr(docsrs, doc(cfg(feature = "json")))]
pub use json::{JsonGuard, JsonGuardLayer};
pub use layer::BypassMarkerLayer;
pub use observe::FrameObserver;
pub use service::BypassMarker;

/// The error type of [`BypassMarkerBody`]: the inner body's error, or [`FrameTooLarge`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
