use std::fmt;
use std::sync::Arc;

use http::{HeaderMap, Method, StatusCode};
use tower_layer::Layer;

use crate::annotations::RequestedAnnotations;
use crate::config::{
    Config, ErrorBodyFn, ErrorParts, Grant, InvalidName, Kind, NonJsonBodies, Overflow, Role,
};
#[cfg(doc)]
use crate::config::{BYPASS_REMOTE_PREFILL, MAX_NAMES, MAX_NAME_LEN};
use crate::filter::EventStreamFilter;
use crate::future::{body_filter, encoded_event_stream, filters_head};
use crate::observe::{FrameObserver, Observer};
use crate::service::BypassMarker;

/// Removes router-internal annotation frames from `text/event-stream` responses unless the client
/// opted in.
///
/// See the [crate docs](crate) for examples and where to put the layer, and
/// [`BypassMarkerBody`](crate::BypassMarkerBody) for what exactly is removed.
///
/// # Configuration
///
/// | setter | default | what it does |
/// | --- | --- | --- |
/// | [`BypassMarkerLayer::new()`] | | frames whose event type is `x-bypass-remote-prefill` are removed unless the client opted in; the guard strips that name from requests |
/// | [`BypassMarkerLayer::dynamo()`] | | the preset for NVIDIA Dynamo 1.6.1's frontend: router-owned `x-bypass-remote-prefill` and `x-prefill-continue` (newer Dynamo source); opt-in `request_id`, `formatted_prompt`, `token_ids` (Dynamo sends them only to clients that list them, as `event: NAME` plus a `: "<JSON string>"` comment, no `data`); never-forwarded `llm_metrics`, `payload_usage` (internal). `error` events are not annotations and are left alone |
/// | `.opt_in(name)` | | also remove `name` frames (e.g. `request_id`) unless the client opted in; the guard leaves `name` in the request |
/// | `.router_owned(name)` | | another router-owned marker: removed unless opted in, stripped from requests in every form |
/// | `.never_forward(name)` | | always remove `name` frames (e.g. `llm_metrics`), even when the client asks |
/// | `.max_frame_bytes(n)` | 1 MiB | cap on the bytes held for one frame that spans body chunks |
/// | `.on_overflow(o)` | [`Overflow::Forward`] | past the cap: forward that frame unfiltered as it arrives, or [`Overflow::Error`]: fail the body with [`FrameTooLarge`](crate::FrameTooLarge) |
/// | `.json_guard()` | | (feature `json`) the request guard as middleware, a `JsonGuardLayer` with this layer's names |
/// | `JsonGuardLayer::max_body_bytes(n)` | 32 MiB | cap on a JSON request body the guard buffers: one image at OpenAI's 20 MB per-image maximum is 26.7 MB of base64, and 32 MiB leaves room for the conversation |
/// | `.sdk_safe(bool)` | off | also remove every frame with field lines but no `data` field that no opt-in of the client covers (fatal to the OpenAI SDKs; never dispatched by browsers, though a frame with only `id:` or `retry:` still sets the last event ID or the reconnection time there, and goes with the frame); comment-only keep-alives stay; a frame of a type the client opted in to is always forwarded |
///
/// A layer knows at most 64 names ([`MAX_NAMES`]). A name must be non-empty, at most 256 bytes
/// ([`MAX_NAME_LEN`]), without `:` or any control character (CR and LF included), and must not start
/// or end with whitespace: exactly the names the guard can recognise in every form it strips. The
/// setters above panic on anything else; for names that come from runtime configuration, use
/// [`try_opt_in`](BypassMarkerLayer::try_opt_in), `try_router_owned` and `try_never_forward`, which
/// return an [`InvalidName`] error instead (the 65th name too):
///
/// ```rust
/// use tower_bypass_marker::BypassMarkerLayer;
///
/// let from_config = ["request_id", "x-route:hint"];
/// let mut layer = BypassMarkerLayer::new();
/// for name in from_config {
///     layer = match layer.clone().try_opt_in(name) {
///         Ok(layer) => layer,
///         Err(e) => {
///             eprintln!("skipping {name:?}: {e}"); // annotation name "x-route:hint" contains ':'
///             layer
///         }
///     };
/// }
/// ```
///
/// # With tonic
///
/// The layer passes gRPC through untouched, so one layer can sit in front of a server that carries
/// both gRPC services and HTTP streaming routes:
///
/// ```rust,no_run
/// use tonic::transport::Server;
/// use tower_bypass_marker::BypassMarkerLayer;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let (_reporter, health) = tonic_health::server::health_reporter();
/// Server::builder()
///     .layer(BypassMarkerLayer::new())
///     .add_service(health)
///     .serve("127.0.0.1:50051".parse()?)
///     .await?;
/// # Ok(())
/// # }
/// ```
///
/// # Security model
///
/// The upstream router is trusted; the client is not. What each side judges, what it refuses,
/// and why:
///
/// | what arrives | what happens | why |
/// | --- | --- | --- |
/// | a router-owned name in the client's `nvext.annotations`: `name`, `name:value`, any ASCII case, surrounding whitespace | stripped ([`guard_annotations`](Self::guard_annotations), and the JSON guard after JSON unescaping) | clients cannot force the bypass |
/// | an entry with a control or non-ASCII character whose part before it begins a router-owned name (`\u{1c}x-bypass-remote-prefill`, `ｘ-bypass-remote-prefill`, `x-bypaſs-remote-prefill`, `x-bypass-remote-prefill：true`) | stripped | Python's `str.strip` removes U+001C to U+001F and U+0085, Unicode case folding and NFKC map characters such as `ſ`, `K` (Kelvin) and the fullwidth forms to ASCII: from such a character on the entry could become the name in a lenient upstream. Stripped rather than refused, as every other form of the name is; Dynamo matches names exactly and its names are ASCII, so it loses nothing it would act on |
/// | (JSON guard) duplicate `nvext` or `annotations` keys however spelled, input that is not RFC 8259 JSON, an `nvext` that is not an object or `null`, an `annotations` that is not an array or `null` | 400 | parsers read these differently from the guard (which key wins, `NaN`, a Python `in` test on a string) |
/// | (JSON guard) an encoded JSON body; one over its limit | 415; 413 | it cannot be read; memory stays bounded |
/// | (JSON guard) a body with a non-JSON content type (`text/plain`, forms) | as [`non_json_bodies`](Self::non_json_bodies) says: forwarded unread (the default and the Dynamo preset's), judged as JSON, or refused with 415 when it looks like JSON | an upstream that parses only JSON content types (Dynamo: axum's `Json` answers 415) never reads it; one that parses any body (Starlette's `request.json()`) needs `Judge` or `Refuse` |
/// | a `never_forward` name the client asks for | its frames removed | never-forwarded annotations are the router's |
/// | an opt-in | granted only from [`RequestedAnnotations`] in the request or response extensions or [`opt_in_from`](Self::opt_in_from)'s closure, which only application code sets; no header or query parameter is read | a value form such as `x-bypass-remote-prefill:true` is stripped, not an opt-in |
/// | an event stream with a `content-encoding` other than `identity`, or a `transfer-encoding` other than `chunked` (`gzip, chunked`), with something to remove | 502 `encoded_event_stream` in its place, before any byte ([Encoded bodies](crate::BypassMarkerBody#encoded-bodies)) | the filter cannot read it, and passing it would hand a decoding client the frames |
/// | a client's `Accept-Encoding` and `TE` on a request whose response may be filtered | replaced by `identity`; `TE` cut down to `trailers` | so that the services below answer readably (layers outside still compress) |
/// | an event-stream `204` or `304`, or the response to `HEAD`, with a body | headers kept, body dropped unread | HTTP says it has no content; hyper's HTTP/2 server would send it |
///
/// What the layer does not protect:
///
/// - **Oversized frames under [`Overflow::Forward`].** A frame that outgrows `max_frame_bytes`
///   (1 MiB by default) is forwarded unfiltered, even one that starts with
///   `event: x-bypass-remote-prefill`; memory stays bounded either way. Use [`Overflow::Error`] if
///   such a frame must never reach a client. Dynamo's routing marker frame is 39 bytes; its
///   opt-in `formatted_prompt` and `token_ids` frames grow with the prompt, so size the cap for them
///   if clients ask for them.
/// - **Non-event-stream responses.** JSON and gRPC bodies are never inspected.
/// - **Requests the JSON guard does not read** under [`NonJsonBodies::Forward`]: see the table. A
///   valid JSON body whose top level is not an object is forwarded unchanged (an upstream reads
///   `nvext` only as a member of the top-level object).
///
/// The names this rule could not match (with `:`, control characters or surrounding whitespace,
/// or over 256 bytes) are refused when the layer is configured, so it holds for every configured
/// name. The guard's validator is held to serde_json's verdict by property tests and a fuzz
/// target; `tests/no_leak.rs` runs the table's rows over HTTP/1.1 and h2c.
#[derive(Clone)]
pub struct BypassMarkerLayer {
    pub(crate) config: Arc<Config>,
}

impl BypassMarkerLayer {
    /// The default layer: frames whose event type is [`BYPASS_REMOTE_PREFILL`] are removed unless
    /// the client opted in; frames spanning chunks are held up to 1 MiB, then forwarded.
    pub fn new() -> Self {
        Self {
            config: Arc::new(Config::new()),
        }
    }

    /// A layer for NVIDIA Dynamo's OpenAI-compatible frontend: every annotation name Dynamo 1.6.1
    /// puts in a response stream or reserves for its router, from its source and its running
    /// frontend (KV router with conditional disaggregation), and `x-prefill-continue`, the routing
    /// marker of newer Dynamo source:
    ///
    /// | name | role here | where it comes from |
    /// | --- | --- | --- |
    /// | `x-bypass-remote-prefill` | router-owned, opt-in | the prefill router (`lib/llm/src/kv_router/prefill_router.rs`) removes a client's copy and prepends its own frame, `event: x-bypass-remote-prefill` and `: true`, whenever the KV router bypasses remote prefill, whether or not the client asked |
    /// | `x-prefill-continue` | router-owned, opt-in | newer Dynamo source (after 1.6.1): the prefill router's second routing marker, which it also strips from clients in the `marker` and `marker:value` forms; a client must not set it, and a frame of it must not reach a client that did not ask |
    /// | `request_id` | opt-in | the HTTP service (`ANNOTATION_REQUEST_ID`, `lib/llm/src/http/service/openai.rs`) |
    /// | `formatted_prompt` | opt-in | the preprocessor (`ANNOTATION_FORMATTED_PROMPT`, `lib/llm/src/preprocessor.rs`) |
    /// | `token_ids` | opt-in | the preprocessor (`ANNOTATION_TOKEN_IDS`); its value is a JSON string that itself holds an array |
    /// | `llm_metrics` | never forwarded | the preprocessor's per-response metrics (`ANNOTATION_LLM_METRICS`); Dynamo's own HTTP layer drops them |
    /// | `payload_usage` | never forwarded | internal usage accounting (`ANNOTATION_PAYLOAD_USAGE`); dropped by Dynamo's HTTP layer too |
    ///
    /// Dynamo emits `request_id`, `formatted_prompt` and `token_ids` only when the client lists
    /// them in `nvext.annotations`, each as `event: NAME` and one comment line holding a JSON
    /// string (`: "..."`), with no `data` line, `request_id` first when several are asked for. A
    /// client that lists one is granted it by [`guard_annotations`](Self::guard_annotations) and
    /// receives that frame byte for byte; a client that does not is spared it. The never-forwarded
    /// names are removed for frontends that do not drop them themselves.
    ///
    /// `error` events are not annotations: Dynamo turns them into a stream error the client must
    /// see, so the preset leaves them alone.
    ///
    /// The preset's guard forwards bodies with a non-JSON content type unread
    /// ([`NonJsonBodies::Forward`]): Dynamo's handlers take the request with axum's `Json`
    /// extractor (ai-dynamo/dynamo, `lib/llm/src/http/service/openai.rs`), which answers 415 to
    /// any content type but `application/json` and `application/*+json` before it reads a byte
    /// (tokio-rs/axum, `axum/src/json.rs`, `json_content_type`; `tests/dynamo/run.sh` sends
    /// Dynamo 1.6.1 a forged marker as `text/plain` and gets that 415). So such a body never
    /// reaches Dynamo's annotations, and reading it would only cost the guard memory (an upload
    /// of any size would be buffered). In front of an upstream that parses any body as JSON
    /// (Starlette's `request.json()`), choose [`NonJsonBodies::Refuse`] or
    /// [`NonJsonBodies::Judge`].
    ///
    /// ```
    /// use tower_bypass_marker::BypassMarkerLayer;
    ///
    /// let layer = BypassMarkerLayer::dynamo();
    /// let mut annotations = vec![
    ///     "x-bypass-remote-prefill".to_owned(),
    ///     "x-prefill-continue:1".to_owned(),
    ///     "request_id".to_owned(),
    /// ];
    /// let granted = layer.guard_annotations(&mut annotations);
    /// assert_eq!(annotations, ["request_id"]); // both routing markers stripped
    /// assert!(granted.contains("request_id"));
    /// ```
    pub fn dynamo() -> Self {
        Self::new()
            .non_json_bodies(NonJsonBodies::Forward)
            .router_owned("x-prefill-continue")
            .opt_in("request_id")
            .opt_in("formatted_prompt")
            .opt_in("token_ids")
            .never_forward("llm_metrics")
            .never_forward("payload_usage")
    }

    fn with(mut self, f: impl FnOnce(&mut Config)) -> Self {
        f(Arc::make_mut(&mut self.config));
        self
    }

    fn try_with(
        mut self,
        f: impl FnOnce(&mut Config) -> Result<(), InvalidName>,
    ) -> Result<Self, InvalidName> {
        // Checked on a copy, so a refused name leaves no trace even when the config is shared.
        let mut config = Config::clone(&self.config);
        f(&mut config)?;
        self.config = Arc::new(config);
        Ok(self)
    }

    /// Also removes frames whose event type is `name` (for example `request_id`) unless the client
    /// opted in. The guard leaves `name` in the request's annotations, so the router still sees
    /// the request for it.
    ///
    /// # Panics
    ///
    /// When `name` is not a valid annotation name (see [`InvalidName`] for the rules: non-empty,
    /// at most [`MAX_NAME_LEN`] bytes, no `:`, no control character, no leading or trailing
    /// whitespace), or when the layer would know more than [`MAX_NAMES`] names. Use
    /// [`try_opt_in`](Self::try_opt_in) for names that come from runtime configuration.
    #[must_use]
    pub fn opt_in(self, name: &str) -> Self {
        self.try_opt_in(name).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`opt_in`](Self::opt_in), returning an error instead of panicking on an invalid name or one
    /// name too many.
    pub fn try_opt_in(self, name: &str) -> Result<Self, InvalidName> {
        self.try_with(|c| c.set(name, Some(Kind::OptIn), false))
    }

    /// Adds a router-owned marker like [`BYPASS_REMOTE_PREFILL`]: removed unless the client opted
    /// in (or always, if it is also [never-forwarded](Self::never_forward)), and stripped from the
    /// client's annotations by [`guard_annotations`](Self::guard_annotations) in every form
    /// (`name`, `name:value`, any ASCII case, surrounding whitespace), so clients cannot set it.
    ///
    /// # Panics
    ///
    /// As for [`opt_in`](Self::opt_in); [`try_router_owned`](Self::try_router_owned) returns the
    /// error instead.
    #[must_use]
    pub fn router_owned(self, name: &str) -> Self {
        self.try_router_owned(name)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`router_owned`](Self::router_owned), returning an error instead of panicking on an invalid
    /// name or one name too many.
    pub fn try_router_owned(self, name: &str) -> Result<Self, InvalidName> {
        self.try_with(|c| c.set(name, None, true))
    }

    /// Always removes frames whose event type is `name` (for example `llm_metrics`), even for a
    /// client that asked for it. A name configured before becomes never-forwarded,
    /// [`BYPASS_REMOTE_PREFILL`] included; a router-owned name stays router-owned, so the guard
    /// still strips it from requests.
    ///
    /// # Panics
    ///
    /// As for [`opt_in`](Self::opt_in); [`try_never_forward`](Self::try_never_forward) returns the
    /// error instead.
    #[must_use]
    pub fn never_forward(self, name: &str) -> Self {
        self.try_never_forward(name)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`never_forward`](Self::never_forward), returning an error instead of panicking on an
    /// invalid name or one name too many.
    pub fn try_never_forward(self, name: &str) -> Result<Self, InvalidName> {
        self.try_with(|c| c.set(name, Some(Kind::NeverForward), false))
    }

    /// Caps the bytes held for one frame that spans body chunks (default 1 MiB). Past the cap,
    /// [`on_overflow`](Self::on_overflow) decides.
    #[must_use]
    pub fn max_frame_bytes(self, max: usize) -> Self {
        self.with(|c| c.max_frame_bytes = max)
    }

    /// What happens to a frame that outgrows [`max_frame_bytes`](Self::max_frame_bytes). Default:
    /// [`Overflow::Forward`].
    #[must_use]
    pub fn on_overflow(self, overflow: Overflow) -> Self {
        self.with(|c| c.on_overflow = overflow)
    }

    /// SDK-safe mode (off by default): also removes every frame that has field lines but no `data`
    /// field, unless its event type is a name the client opted in to (such a frame is forwarded
    /// either way). The OpenAI SDKs crash on data-less frames. Browsers never dispatch them as
    /// events, but they still have effects there: a frame with only `id:` sets the stream's last
    /// event ID (sent back as `Last-Event-ID` on reconnection), and one with `retry:` sets the
    /// reconnection time. SDK-safe mode removes those effects with the frame. Comment-only frames,
    /// such as `:\n\n` keep-alives, are kept.
    ///
    /// One case it does not cover: a stream whose events carry `id:`. openai-python keeps the last
    /// event ID across events (as the spec says) and dispatches an event at every empty line while
    /// it is set, so after the first `id:` a keep-alive, or any extra empty line, reaches it as an
    /// event with empty data, which it fails to parse as JSON (openai-node does not).
    #[must_use]
    pub fn sdk_safe(self, enabled: bool) -> Self {
        self.with(|c| c.sdk_safe = enabled)
    }

    /// What the JSON guard (feature `json`) does with request bodies whose `content-type` is not
    /// JSON: forward them unread ([`NonJsonBodies::Forward`], the default), judge those that look
    /// like JSON as JSON ([`NonJsonBodies::Judge`]), or refuse those with 415
    /// ([`NonJsonBodies::Refuse`]); the [Dynamo preset](Self::dynamo) says why it forwards.
    ///
    /// Under `Judge` and `Refuse` the guard buffers every body with a non-JSON content type (up to
    /// its body cap: a larger one gets 413), so use them in front of upstreams that take JSON
    /// only, as Dynamo does; in front of one that takes large uploads (`multipart/form-data`),
    /// keep `Forward`, which is safe as long as that upstream does not parse such bodies as JSON.
    ///
    /// ```
    /// use tower_bypass_marker::{BypassMarkerLayer, NonJsonBodies};
    ///
    /// let layer = BypassMarkerLayer::new().non_json_bodies(NonJsonBodies::Judge);
    /// # let _ = layer;
    /// ```
    #[must_use]
    pub fn non_json_bodies(self, bodies: NonJsonBodies) -> Self {
        self.with(|c| c.non_json = bodies)
    }

    /// Calls `observer` for every annotation frame a body, filter or processor made from this layer
    /// removes, and for every frame of a configured name it forwards to a client that opted in:
    /// the counts behind metrics. See [`FrameObserver`] for the cost.
    #[must_use]
    pub fn observe(self, observer: Arc<dyn FrameObserver>) -> Self {
        self.with(|c| c.observer = Some(Observer(observer)))
    }

    /// Grants each request the opt-in `grant` returns from its head (method, URI, headers,
    /// extensions), in addition to any [`RequestedAnnotations`] in its extensions: tower-http's
    /// `compress_when` habit, for an opt-in that does not come from the JSON body (a header your
    /// gateway trusts, a route, an API key's plan), with no `from_fn` middleware and no JSON guard.
    ///
    /// Only configured names count; a never-forwarded name is never forwarded. The closure is the
    /// application's code: it decides what a client may receive, so read only what the client
    /// cannot forge, or what you are willing to let any client ask for. The guard (if any) still
    /// strips router-owned names from the body, so the router never sees them. Called once per
    /// request, in [`BypassMarker`]'s `call`, before the service below it.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http::{header, Request, Response};
    /// use http_body_util::{BodyExt, Full};
    /// use std::convert::Infallible;
    /// use tower::{service_fn, ServiceBuilder, ServiceExt};
    /// use tower_bypass_marker::{BypassMarkerLayer, RequestedAnnotations};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// let upstream = service_fn(|_req: Request<Full<Bytes>>| async {
    ///     let body = "event: request_id\n: \"r-1\"\n\ndata: {}\n\n";
    ///     Ok::<_, Infallible>(
    ///         Response::builder()
    ///             .header(header::CONTENT_TYPE, "text/event-stream")
    ///             .body(Full::new(Bytes::from(body)))
    ///             .unwrap(),
    ///     )
    /// });
    /// // Internal tools (behind the gateway's own auth, which sets `x-internal`) get request ids.
    /// let layer = BypassMarkerLayer::new()
    ///     .opt_in("request_id")
    ///     .opt_in_from(|parts: &http::request::Parts| {
    ///         if parts.headers.contains_key("x-internal") {
    ///             ["request_id"].into_iter().collect()
    ///         } else {
    ///             RequestedAnnotations::new()
    ///         }
    ///     });
    /// let svc = ServiceBuilder::new().layer(layer).service(upstream);
    ///
    /// let req = Request::builder().header("x-internal", "1").body(Full::default())?;
    /// let body = svc.clone().oneshot(req).await?.into_body().collect().await?.to_bytes();
    /// assert_eq!(body, "event: request_id\n: \"r-1\"\n\ndata: {}\n\n");
    ///
    /// let body = svc.oneshot(Request::new(Full::default())).await?.into_body().collect().await?;
    /// assert_eq!(body.to_bytes(), "data: {}\n\n");
    /// # Ok(())
    /// # }
    /// ```
    #[must_use]
    pub fn opt_in_from<F>(self, grant: F) -> Self
    where
        F: Fn(&http::request::Parts) -> RequestedAnnotations + Send + Sync + 'static,
    {
        self.with(|c| c.grant = Some(Grant(Arc::new(grant))))
    }

    /// Shapes the error responses the middleware writes itself: [`BypassMarker`]'s 502 for an
    /// encoded event stream and, with `json`, the JSON guard's refusals (400, 413, 415). `shape`
    /// gets the status, OpenAI's error `type`, the `code` and the message, and returns the
    /// `content-type` and the body; the status stays, and `content-length` is set. Without it, the
    /// body is OpenAI's envelope (`{"error":{"code":...,"message":...,"param":null,"type":...}}`,
    /// `application/json`), which the SDKs parse. The sans-IO cores' `Refusal`s are not shaped:
    /// their host writes the response.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http::{header, HeaderValue, Request, Response, StatusCode};
    /// use http_body_util::{BodyExt, Full};
    /// use tower::{service_fn, ServiceBuilder, ServiceExt};
    /// use tower_bypass_marker::{BypassMarkerLayer, ErrorParts};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// // An RFC 9457 problem document instead of OpenAI's envelope.
    /// let layer = BypassMarkerLayer::new().error_body(|e: &ErrorParts<'_>| {
    ///     let body = format!(r#"{{"type":"about:blank#{}","status":{}}}"#, e.code, e.status.as_u16());
    ///     (HeaderValue::from_static("application/problem+json"), Bytes::from(body))
    /// });
    /// let upstream = service_fn(|_req: Request<Full<Bytes>>| async {
    ///     Ok::<_, std::convert::Infallible>(
    ///         Response::builder()
    ///             .header(header::CONTENT_TYPE, "text/event-stream")
    ///             .header(header::CONTENT_ENCODING, "gzip") // although asked for identity
    ///             .body(Full::new(Bytes::from_static(b"\x1f\x8b")))
    ///             .unwrap(),
    ///     )
    /// });
    /// let res = ServiceBuilder::new().layer(layer).service(upstream)
    ///     .oneshot(Request::new(Full::default())).await.unwrap();
    /// assert_eq!(res.status(), StatusCode::BAD_GATEWAY);
    /// assert_eq!(res.headers()[header::CONTENT_TYPE], "application/problem+json");
    /// let body = res.into_body().collect().await.unwrap().to_bytes();
    /// assert_eq!(body, r#"{"type":"about:blank#encoded_event_stream","status":502}"#);
    /// # }
    /// ```
    #[must_use]
    pub fn error_body<F>(self, shape: F) -> Self
    where
        F: Fn(&ErrorParts<'_>) -> (http::HeaderValue, bytes::Bytes) + Send + Sync + 'static,
    {
        self.with(|c| c.error_body = Some(ErrorBodyFn(Arc::new(shape))))
    }

    /// What happens to the frames of `name` (compared ASCII case-insensitively), or `None` when
    /// it is not configured: with [`names`](Self::names), what an operator's log line or a
    /// metric's description needs.
    ///
    /// ```
    /// use tower_bypass_marker::{BypassMarkerLayer, Role, BYPASS_REMOTE_PREFILL};
    ///
    /// let layer = BypassMarkerLayer::new().opt_in("request_id").never_forward("llm_metrics");
    /// assert_eq!(layer.role(BYPASS_REMOTE_PREFILL), Some(Role::RouterOwned));
    /// assert_eq!(layer.role("REQUEST_ID"), Some(Role::OptIn));
    /// assert_eq!(layer.role("llm_metrics"), Some(Role::NeverForward));
    /// assert_eq!(layer.role("token_ids"), None);
    /// ```
    pub fn role(&self, name: &str) -> Option<Role> {
        self.config.role(name)
    }

    /// The configured annotation names, in the order they were added (the default name first):
    /// for example to create a metric series per name up front.
    pub fn names(&self) -> impl Iterator<Item = &str> + '_ {
        self.config.names.iter().map(|n| &*n.name)
    }

    /// The content coding (such as `gzip`) of an event stream that must not pass because the
    /// filter cannot read it: `Some` when the response has content, is a `text/event-stream` with
    /// a `content-encoding` other than `identity`, and something would be removed for a client
    /// that asked for `requested`. Answer such a response with a 502 instead, before any byte of
    /// it, as [`BypassMarker`] does (see [Encoded bodies](crate::BypassMarkerBody#encoded-bodies);
    /// `sans_io::Refusal::encoded_event_stream` makes the error, with feature `json`). A query:
    /// it tells no [observer](Self::observe); the host that refuses the stream does
    /// ([`BypassMarker`] and `sans_io::GatewayExchange` call
    /// [`encoded_stream_refused`](crate::FrameObserver::encoded_stream_refused)).
    ///
    /// ```
    /// use http::{header, HeaderMap, Method, StatusCode};
    /// use tower_bypass_marker::{BypassMarkerLayer, RequestedAnnotations};
    ///
    /// let layer = BypassMarkerLayer::new();
    /// let mut headers = HeaderMap::new();
    /// headers.insert(header::CONTENT_TYPE, "text/event-stream".parse().unwrap());
    /// headers.insert(header::CONTENT_ENCODING, "gzip".parse().unwrap());
    /// let none = RequestedAnnotations::new();
    /// let coding = layer.refuses_encoded(&Method::POST, StatusCode::OK, &headers, &none);
    /// assert_eq!(coding.as_deref(), Some("gzip"));
    /// ```
    pub fn refuses_encoded(
        &self,
        request_method: &Method,
        status: StatusCode,
        headers: &HeaderMap,
        requested: &RequestedAnnotations,
    ) -> Option<String> {
        let coding = encoded_event_stream(request_method == Method::HEAD, status, headers)?;
        let config = &self.config;
        if config.removal_mask(config.requested_mask(requested)) == 0 {
            return None;
        }
        Some(coding)
    }

    /// Tells the observer and, with `tracing`, the current span that an encoded event stream
    /// (`coding`) was refused: what a host does when it acts on
    /// [`refuses_encoded`](Self::refuses_encoded).
    #[cfg_attr(not(feature = "json"), allow(dead_code))]
    pub(crate) fn report_encoded_refusal(&self, coding: &str) {
        if let Some(observer) = &self.config.observer {
            observer.0.encoded_stream_refused(coding);
        }
        #[cfg(feature = "tracing")]
        tracing::warn!(
            coding = %coding,
            "encoded event stream refused with a 502: it cannot be filtered"
        );
    }

    /// The filter this layer applies to a response with this head, for a client that asked for
    /// `requested`: the same decision as [`BypassMarker`]'s, for hosts that are not tower services.
    ///
    /// `None` means the body passes through untouched: it is not an unencoded `text/event-stream`,
    /// or nothing is to be removed for this client; or there is no filter to run because the
    /// response has no content (the request was `HEAD`, or it is a `1xx`, `204` or `304`). For
    /// those, drop whatever body comes after an event-stream head, as [`BypassMarker`] and
    /// `sans_io::GatewayExchange` do: an HTTP/2 peer may send DATA frames after such a head. When
    /// it is `Some`, drop the response's `content-length` (frames may be removed) and drive the
    /// [`EventStreamFilter`] with the body's chunks.
    ///
    /// An *encoded* event stream gets `None` too: ask [`refuses_encoded`](Self::refuses_encoded)
    /// first, which says when it must not pass (the layer answers 502 instead).
    ///
    /// ```
    /// use http::{header, HeaderMap, Method, StatusCode};
    /// use tower_bypass_marker::{BypassMarkerLayer, RequestedAnnotations};
    ///
    /// let layer = BypassMarkerLayer::new();
    /// let mut headers = HeaderMap::new();
    /// headers.insert(header::CONTENT_TYPE, "text/event-stream".parse().unwrap());
    /// let none = RequestedAnnotations::new();
    /// assert!(layer.response_filter(&Method::POST, StatusCode::OK, &headers, &none).is_some());
    /// // The client opted in to the only configured name: nothing to remove.
    /// let asked = ["x-bypass-remote-prefill"].into_iter().collect::<RequestedAnnotations>();
    /// assert!(layer.response_filter(&Method::POST, StatusCode::OK, &headers, &asked).is_none());
    /// // JSON passes through.
    /// headers.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
    /// assert!(layer.response_filter(&Method::POST, StatusCode::OK, &headers, &none).is_none());
    /// ```
    pub fn response_filter(
        &self,
        request_method: &Method,
        status: StatusCode,
        headers: &HeaderMap,
        requested: &RequestedAnnotations,
    ) -> Option<EventStreamFilter> {
        if !filters_head(request_method == Method::HEAD, status, headers) {
            return None;
        }
        self.event_stream_filter(requested)
    }

    /// The filter for an event-stream body to a client that asked for `requested`, or `None` when
    /// nothing is to be removed for it (and no [observer](Self::observe) needs to see its frames).
    /// See [`response_filter`](Self::response_filter) for the decision from a response head.
    pub fn event_stream_filter(
        &self,
        requested: &RequestedAnnotations,
    ) -> Option<EventStreamFilter> {
        body_filter(&self.config, self.config.requested_mask(requested), None)
    }

    /// The request-side guard, for a handler that has parsed the client's `nvext.annotations`.
    ///
    /// Removes from `annotations` every entry that names a router-owned marker (such as
    /// [`BYPASS_REMOTE_PREFILL`]) in any form (`name` or `name:value`, any ASCII case, surrounding
    /// spaces), so a client cannot make the router take a path it reserves for itself, and every
    /// near miss that a lenient upstream could fold into one: an entry with a control or non-ASCII
    /// character whose part before that character begins a router-owned name (see the [security
    /// model](Self#security-model)). Returns the
    /// opt-in the client is allowed: each configured opt-in or router-owned name it listed exactly
    /// (bare, as written), never a never-forwarded one. Entries the layer does not know stay in the
    /// list and are not part of the opt-in.
    ///
    /// Put the result in the response's extensions (or the request's, before this layer's service
    /// is called) and the layer forwards those frames to this client.
    pub fn guard_annotations(&self, annotations: &mut Vec<String>) -> RequestedAnnotations {
        let mut granted = RequestedAnnotations::new();
        annotations.retain(|entry| {
            let rule = self.config.guard_entry(entry);
            if let Some(name) = rule.grant {
                granted.insert(name);
            }
            rule.strip.is_none()
        });
        granted
    }
}

impl Default for BypassMarkerLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for BypassMarkerLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("BypassMarkerLayer");
        self.config.debug_fields(&mut d);
        d.finish()
    }
}

impl<S> Layer<S> for BypassMarkerLayer {
    type Service = BypassMarker<S>;

    fn layer(&self, inner: S) -> Self::Service {
        BypassMarker::new(inner, self.config.clone())
    }
}

impl<S> BypassMarker<S> {
    /// Returns a [`Layer`] with the default configuration.
    pub fn layer() -> BypassMarkerLayer {
        BypassMarkerLayer::new()
    }
}
