//! The guard's decisions without tower: [`RequestGuard`], for any host (an Envoy external
//! processor, a proxy on another stack).

use std::fmt;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use http::header::{CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE};
use http::{HeaderMap, StatusCode};

use crate::config::{Config, NonJsonBodies};
use crate::json::splice::{self, Reason};
use crate::json::{JsonGuardLayer, DEFAULT_MAX_BODY_BYTES};
use crate::observe::Observer;
use crate::{BypassMarkerLayer, RequestedAnnotations};

/// What [`JsonGuard`](crate::json::JsonGuard) decides about a request, as plain functions of its
/// head and its body: the same rules, for hosts that are not tower services.
///
/// Made by [`BypassMarkerLayer::request_guard`] or [`JsonGuardLayer::request_guard`]. The calling
/// contract: [`check_head`](Self::check_head) with the request's headers; on
/// [`HeadDecision::Read`], read the whole body (refusing with [`Refusal::too_large`] as soon as it
/// passes [`max_body`](Self::max_body) bytes), then [`check_body`](Self::check_body).
///
/// ```
/// use bytes::Bytes;
/// use http::{header, HeaderMap};
/// use tower_bypass_marker::sans_io::{BodyDecision, HeadDecision};
/// use tower_bypass_marker::BypassMarkerLayer;
///
/// let guard = BypassMarkerLayer::new().opt_in("request_id").request_guard();
/// let mut headers = HeaderMap::new();
/// headers.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
/// assert!(matches!(guard.check_head(&headers, false), HeadDecision::Read));
///
/// let body = Bytes::from_static(
///     br#"{"nvext":{"annotations":["x-bypass-remote-prefill:true","request_id"]}}"#,
/// );
/// match guard.check_body(body) {
///     BodyDecision::Splice { body, granted } => {
///         assert_eq!(body.to_vec(), br#"{"nvext":{"annotations":["request_id"]}}"#);
///         assert!(granted.contains("request_id"));
///     }
///     other => panic!("{other:?}"),
/// }
///
/// // Not JSON: refused with OpenAI's error shape.
/// let BodyDecision::Refuse(refusal) = guard.check_body(Bytes::from_static(b"{")) else {
///     panic!()
/// };
/// assert_eq!(refusal.status(), 400);
/// assert_eq!(refusal.code(), "invalid_json");
/// ```
#[derive(Clone)]
pub struct RequestGuard {
    config: Arc<Config>,
    max_body_bytes: usize,
}

/// What to do with a request, from its head.
#[derive(Debug)]
#[non_exhaustive]
pub enum HeadDecision {
    /// The guard does not read this body (it is empty, or not JSON): forward the request
    /// untouched, with nothing granted.
    Skip,
    /// Read the whole body, then call [`RequestGuard::check_body`].
    Read,
    /// Answer the client with this refusal; forward nothing.
    Refuse(Refusal),
}

/// What to do with a request, from its body.
#[derive(Debug)]
#[non_exhaustive]
pub enum BodyDecision {
    /// Forward the body as it is; the client is granted `granted` (perhaps nothing).
    Forward {
        /// The configured names the client asked for and may receive.
        granted: RequestedAnnotations,
    },
    /// Forward `body` instead: router-owned names were stripped from `nvext.annotations`. Update
    /// the request's `content-length`, if it has one, to [`Spliced::len`].
    Splice {
        /// The body to forward.
        body: Spliced,
        /// The configured names the client asked for and may receive.
        granted: RequestedAnnotations,
    },
    /// Answer the client with this refusal; forward nothing.
    Refuse(Refusal),
}

/// A body with its `nvext.annotations` array replaced: the client's bytes before the array and
/// after it, as slices of the body that was checked, and the new array between them.
#[derive(Debug, Clone)]
pub struct Spliced {
    chunks: [Bytes; 3],
}

impl Spliced {
    /// The length of the new body in bytes.
    #[allow(clippy::len_without_is_empty)] // never empty: it holds at least `[]`
    pub fn len(&self) -> usize {
        self.chunks.iter().map(Bytes::len).sum()
    }

    /// The new body as three chunks (before the array, the array, after it), none copied but the
    /// array.
    pub fn into_chunks(self) -> [Bytes; 3] {
        self.chunks
    }

    /// The new body in one contiguous buffer (a copy).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut all = Vec::with_capacity(self.len());
        for chunk in &self.chunks {
            all.extend_from_slice(chunk);
        }
        all
    }
}

/// The guard's answer to a request it refuses: a status and an error in OpenAI's shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    status: StatusCode,
    kind: &'static str,
    code: &'static str,
    message: String,
}

impl Refusal {
    pub(crate) fn new(status: StatusCode, code: &'static str, message: String) -> Self {
        Self {
            status,
            kind: "invalid_request_error",
            code,
            message,
        }
    }

    /// 502 `encoded_event_stream` (error type `server_error`): the response is a
    /// `text/event-stream` in a content coding (`coding`, such as `gzip`) that the filter cannot
    /// read, and something would have to be removed from it for this client. Sent instead of the
    /// response, before any byte of it. The message names both causes: an upstream that
    /// compressed the stream, and a compression layer (or filter) that runs before this one.
    pub fn encoded_event_stream(coding: &str) -> Self {
        Self {
            status: StatusCode::BAD_GATEWAY,
            kind: "server_error",
            code: "encoded_event_stream",
            message: crate::future::encoded_message(coding),
        }
    }

    /// 413 `request_too_large`: the body is over `max` bytes.
    pub fn too_large(max: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request_too_large",
            format!("the request body is larger than the limit of {max} bytes"),
        )
    }

    /// 400 `body_read_error`: the request body failed while being read.
    pub fn body_read_error() -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "body_read_error",
            "the request body could not be read".to_owned(),
        )
    }

    /// 503 `request_bodies_over_budget` (error type `server_error`): the request bodies held
    /// would pass the guard's [`GuardBudget`](crate::json::GuardBudget). Sent with
    /// `Retry-After: 1` by [`JsonGuard`](crate::json::JsonGuard), as `bypass-marker` sends it.
    pub fn over_budget() -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "server_error",
            code: "request_bodies_over_budget",
            message: "the server holds as many request bodies as it may; retry shortly".to_owned(),
        }
    }

    /// 408 `request_timeout`: the request body stopped arriving (a body timeout, such as
    /// tower-http's `RequestBodyTimeoutLayer`, ended it).
    pub fn body_timeout() -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            "the request body was not received in time".to_owned(),
        )
    }

    /// The refusal for an error the request body failed with while the guard read it, by what
    /// the error (or any error in its `source()` chain) is: a length limit (http-body-util's
    /// `LengthLimitError`, which tower-http's `RequestBodyLimitLayer` and axum's limits use) is
    /// 413 `request_too_large`; a timeout (tower-http's `TimeoutError`, or an `io::Error` of kind
    /// `TimedOut`) is 408 `request_timeout`; anything else is 400 `body_read_error`.
    ///
    /// The guard depends on neither crate, so their errors are known by their `Display` text
    /// (`length limit exceeded`, `data was not received within the designated timeout`); the
    /// tests hold those texts to the real types.
    pub fn for_body_error(error: &(dyn std::error::Error + 'static)) -> Self {
        let mut next = Some(error);
        while let Some(error) = next {
            let mut source = error.source();
            if let Some(io) = error.downcast_ref::<std::io::Error>() {
                if io.kind() == std::io::ErrorKind::TimedOut {
                    return Self::body_timeout();
                }
                // An io::Error's `source` is its inner error's source: the inner error is next.
                if let Some(inner) = io.get_ref() {
                    source = Some(inner as &(dyn std::error::Error + 'static));
                }
            }
            let text = error.to_string();
            if text == LENGTH_LIMIT_ERROR {
                return Self::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "request_too_large",
                    "the request body is larger than the server's limit".to_owned(),
                );
            }
            if text == BODY_TIMEOUT_ERROR {
                return Self::body_timeout();
            }
            next = source;
        }
        Self::body_read_error()
    }

    /// The response status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The error's `code`: `request_too_large`, `unsupported_content_encoding`, `invalid_json`,
    /// `duplicate_key`, `invalid_nvext`, `body_read_error`, `request_timeout` or
    /// `request_bodies_over_budget` (see the [module docs](crate::json)),
    /// or `encoded_event_stream` for a response ([`Refusal::encoded_event_stream`]).
    pub fn code(&self) -> &str {
        self.code
    }

    /// The error's message, for the client.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The error's `type`: `invalid_request_error` for a refused request, `server_error` for a
    /// refused response and for [`over_budget`](Self::over_budget).
    pub fn kind(&self) -> &str {
        self.kind
    }

    /// The response body, `content-type: application/json`:
    /// `{"error":{"code":...,"message":...,"param":null,"type":"invalid_request_error"}}` (the
    /// `type` is [`kind`](Self::kind)), keys in that order.
    ///
    /// ```
    /// use tower_bypass_marker::sans_io::Refusal;
    ///
    /// let body = Refusal::too_large(8).body();
    /// assert_eq!(
    ///     body,
    ///     r#"{"error":{"code":"request_too_large","message":"the request body is larger than the limit of 8 bytes","param":null,"type":"invalid_request_error"}}"#
    /// );
    /// ```
    pub fn body(&self) -> Bytes {
        let json = serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": null,
                "code": self.code,
            }
        });
        Bytes::from(json.to_string())
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.status.as_u16(),
            self.code,
            self.message
        )
    }
}

impl RequestGuard {
    pub(crate) fn new(config: Arc<Config>, max_body_bytes: usize) -> Self {
        Self {
            config,
            max_body_bytes,
        }
    }

    /// Caps the bytes of a body the guard reads (default [`DEFAULT_MAX_BODY_BYTES`], 32 MiB).
    #[must_use]
    pub fn max_body_bytes(mut self, max: usize) -> Self {
        self.max_body_bytes = max;
        self
    }

    /// The cap on the bytes of a body the guard reads.
    pub fn max_body(&self) -> usize {
        self.max_body_bytes
    }

    /// The application's shape for the guard's error responses, if the layer has one.
    pub(crate) fn error_body(&self) -> Option<crate::config::ErrorBodyFn> {
        self.config.error_body.clone()
    }

    /// Decides from the request's head. `body_empty`: the request is known to have no body (an
    /// HTTP/2 `END_STREAM` on the headers, a body whose own size is 0); a `content-length` header
    /// alone does not make it so.
    ///
    /// The body is read when it may be non-empty and its content type is JSON as lenient servers
    /// read it (see the [module docs](crate::json)), or whatever its content type under
    /// [`NonJsonBodies::Judge`] and [`NonJsonBodies::Refuse`]; it is refused first when it has a
    /// `content-encoding` other than `identity` (415) or a `content-length` over the cap (413).
    /// Judge a body read for a head with a non-JSON content type with
    /// [`check_body_for`](Self::check_body_for).
    pub fn check_head(&self, headers: &HeaderMap, body_empty: bool) -> HeadDecision {
        // Only the body itself says it is empty: a `content-length: 0` that does not match the
        // bytes behind it (a body rewritten by a middleware, a host that does not check) must not
        // let a body past unread.
        if body_empty
            || (!reads_content_type(headers) && self.config.non_json == NonJsonBodies::Forward)
        {
            return HeadDecision::Skip;
        }
        if !identity_only(headers) {
            return HeadDecision::Refuse(Refusal::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_content_encoding",
                "the request body has a content-encoding; send JSON request bodies unencoded"
                    .to_owned(),
            ));
        }
        if declared_length(headers).is_some_and(|n| n > self.max_body_bytes as u64) {
            return HeadDecision::Refuse(Refusal::too_large(self.max_body_bytes));
        }
        HeadDecision::Read
    }

    /// Decides from the whole body (at most [`max_body`](Self::max_body) bytes): forward it,
    /// forward a spliced one, or refuse it. An empty body is forwarded with nothing granted.
    pub fn check_body(&self, body: Bytes) -> BodyDecision {
        self.judge_json(body).0
    }

    /// [`check_body`](Self::check_body), with the router-owned names it stripped (bit `i` for the
    /// configuration's name `i`).
    fn judge_json(&self, body: Bytes) -> (BodyDecision, u64) {
        if body.len() > self.max_body_bytes {
            return (
                BodyDecision::Refuse(Refusal::too_large(self.max_body_bytes)),
                0,
            );
        }
        if body.is_empty() {
            let granted = RequestedAnnotations::new();
            return (BodyDecision::Forward { granted }, 0);
        }
        let guarded = match splice::guard(&self.config, &body) {
            Ok(guarded) => guarded,
            Err(rejection) => {
                let code = match rejection.reason {
                    Reason::Invalid => "invalid_json",
                    Reason::Duplicate => "duplicate_key",
                    Reason::Shape => "invalid_nvext",
                };
                let refusal = Refusal::new(StatusCode::BAD_REQUEST, code, rejection.message);
                return (BodyDecision::Refuse(refusal), 0);
            }
        };
        let decision = match guarded.splice {
            None => BodyDecision::Forward {
                granted: guarded.granted,
            },
            Some(splice) => BodyDecision::Splice {
                body: Spliced {
                    chunks: [
                        body.slice(..splice.span.start),
                        Bytes::from(splice.array),
                        body.slice(splice.span.end..),
                    ],
                },
                granted: guarded.granted,
            },
        };
        (decision, guarded.stripped)
    }

    /// [`check_body`](Self::check_body) for a request with these `headers`. A body whose content
    /// type is JSON (or absent) is judged as `check_body` judges it. One with another content type
    /// (read under [`NonJsonBodies::Judge`] or [`NonJsonBodies::Refuse`]) is forwarded as it came
    /// unless it looks like JSON (see [`NonJsonBodies`]); if it does, it is judged as JSON
    /// (`Judge`) or refused with 415 `unsupported_media_type` (`Refuse`).
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http::{header, HeaderMap};
    /// use tower_bypass_marker::sans_io::BodyDecision;
    /// use tower_bypass_marker::BypassMarkerLayer;
    ///
    /// use tower_bypass_marker::NonJsonBodies;
    ///
    /// let guard = BypassMarkerLayer::dynamo().non_json_bodies(NonJsonBodies::Refuse).request_guard();
    /// let mut headers = HeaderMap::new();
    /// headers.insert(header::CONTENT_TYPE, "text/plain".parse().unwrap());
    /// let forged = Bytes::from_static(br#"{"nvext":{"annotations":["x-bypass-remote-prefill"]}}"#);
    /// let BodyDecision::Refuse(refusal) = guard.check_body_for(&headers, forged) else { panic!() };
    /// assert_eq!((refusal.status().as_u16(), refusal.code()), (415, "unsupported_media_type"));
    /// let text = Bytes::from_static(b"just text");
    /// assert!(matches!(guard.check_body_for(&headers, text), BodyDecision::Forward { .. }));
    /// ```
    pub fn check_body_for(&self, headers: &HeaderMap, body: Bytes) -> BodyDecision {
        self.judge(reads_content_type(headers), body).0
    }

    /// [`check_body_for`](Self::check_body_for) of a body whose content type is JSON (`json`) or
    /// not, with the router-owned names it stripped (bit `i` for the configuration's name `i`).
    pub(crate) fn judge(&self, json: bool, body: Bytes) -> (BodyDecision, u64) {
        if json {
            return self.judge_json(body);
        }
        if body.len() > self.max_body_bytes {
            return (
                BodyDecision::Refuse(Refusal::too_large(self.max_body_bytes)),
                0,
            );
        }
        let forward = || BodyDecision::Forward {
            granted: RequestedAnnotations::new(),
        };
        if !looks_like_json(&body) {
            return (forward(), 0);
        }
        match self.config.non_json {
            NonJsonBodies::Judge => self.judge_json(body),
            NonJsonBodies::Refuse => {
                let refusal = Refusal::new(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "unsupported_media_type",
                    "the request body looks like JSON but its content-type is not JSON; send it \
                     with content-type application/json"
                        .to_owned(),
                );
                (BodyDecision::Refuse(refusal), 0)
            }
            // Forward (a host that read the body anyway), and any later choice: nothing is
            // granted for a body the guard was not asked to judge.
            _ => (forward(), 0),
        }
    }

    /// The request's own observer ([`FrameObserver::for_request`](crate::FrameObserver::for_request)
    /// of the configuration's), if it has one.
    pub(crate) fn observer_for(&self, parts: &http::request::Parts) -> Option<Observer> {
        let observer = self.config.observer.as_ref()?;
        observer.0.for_request(parts).map(Observer)
    }

    /// Tells the observer (`observer`, the request's own, else the configuration's) and, with
    /// feature `tracing`, the request's span what the guard decided about a body: each name it
    /// stripped (`stripped`, a mask of the configuration's names), each it granted, or the
    /// refusal.
    pub(crate) fn report(
        &self,
        observer: Option<&Observer>,
        stripped: u64,
        decision: &BodyDecision,
    ) {
        let granted = match decision {
            BodyDecision::Forward { granted } | BodyDecision::Splice { granted, .. } => granted,
            BodyDecision::Refuse(refusal) => return self.report_refusal(observer, refusal),
        };
        let observer = observer.or(self.config.observer.as_ref());
        for (i, name) in self.config.names.iter().enumerate() {
            if stripped & (1 << i) != 0 {
                if let Some(observer) = observer {
                    observer.0.annotation_stripped(&name.name);
                }
                #[cfg(feature = "tracing")]
                tracing::info!(
                    annotation = &*name.name,
                    "router-owned annotation stripped from the request's nvext.annotations"
                );
            }
        }
        for name in granted.iter() {
            if let Some(observer) = observer {
                observer.0.annotation_granted(name);
            }
            #[cfg(feature = "tracing")]
            tracing::debug!(annotation = name, "annotation granted to the client");
        }
    }

    /// [`report`](Self::report) of a refusal, whichever step made it.
    pub(crate) fn report_refusal(&self, observer: Option<&Observer>, refusal: &Refusal) {
        if let Some(observer) = observer.or(self.config.observer.as_ref()) {
            observer.0.request_refused(refusal.status, refusal.code);
        }
        #[cfg(feature = "tracing")]
        tracing::info!(
            status = refusal.status.as_u16(),
            code = refusal.code,
            reason = %refusal.message,
            "request refused by the guard"
        );
    }

    /// [`check_body`](Self::check_body) of a body received in several chunks, joined once.
    pub fn check_chunks(&self, chunks: Vec<Bytes>) -> BodyDecision {
        self.check_body(join(chunks))
    }
}

impl fmt::Debug for RequestGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("RequestGuard");
        self.config.debug_fields(&mut d);
        d.field("max_body_bytes", &self.max_body_bytes).finish()
    }
}

impl BypassMarkerLayer {
    /// The request-side guard's decisions for this layer's names, without tower: see
    /// [`RequestGuard`]. The body cap is [`DEFAULT_MAX_BODY_BYTES`].
    #[cfg_attr(docsrs, doc(cfg(feature = "json")))]
    pub fn request_guard(&self) -> RequestGuard {
        RequestGuard::new(self.config.clone(), DEFAULT_MAX_BODY_BYTES)
    }
}

impl JsonGuardLayer {
    /// This guard's decisions, without tower: see [`RequestGuard`].
    pub fn request_guard(&self) -> RequestGuard {
        RequestGuard::new(self.config.clone(), self.max_body_bytes)
    }
}

/// The `Display` of http-body-util's `LengthLimitError` (0.1).
const LENGTH_LIMIT_ERROR: &str = "length limit exceeded";
/// The `Display` of tower-http's `timeout::TimeoutError` (0.5 to 0.7).
const BODY_TIMEOUT_ERROR: &str = "data was not received within the designated timeout";

/// Chunks joined into one buffer (the one chunk itself when there is one).
pub(crate) fn join(mut chunks: Vec<Bytes>) -> Bytes {
    match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.pop().expect("one chunk"),
        _ => {
            let mut all = BytesMut::with_capacity(chunks.iter().map(Bytes::len).sum());
            for chunk in chunks {
                all.extend_from_slice(&chunk);
            }
            all.freeze()
        }
    }
}

/// Whether a body looks like JSON to a lenient parser (see [`NonJsonBodies`]): its first byte that
/// is not whitespace, NUL or a byte of a byte-order mark is `{`.
pub(crate) fn looks_like_json(body: &[u8]) -> bool {
    body.iter().find(|b| {
        !matches!(
            b,
            b' ' | b'\t' | b'\r' | b'\n' | 0 | 0xEF | 0xBB | 0xBF | 0xFE | 0xFF
        )
    }) == Some(&b'{')
}

/// Whether the content type is one a lenient server parses as JSON: no `content-type` header, or
/// any one of several whose value [`reads_value`] reads.
pub(crate) fn reads_content_type(headers: &HeaderMap) -> bool {
    let mut types = headers.get_all(CONTENT_TYPE).iter().peekable();
    types.peek().is_none() || types.any(|v| reads_value(v.as_bytes()))
}

/// Whether one `content-type` value is read: the value as a whole is empty or a JSON media type
/// (see [`is_json_media_type`]), or it is a comma-separated list (as Envoy and other proxies merge
/// repeated headers: `text/plain,application/json`) and one of its elements is.
///
/// Elements are found twice, at the commas outside quoted strings (RFC 9110) and at every comma,
/// and either finding counts: a quoted string that one header opens and the next one closes (`a/b;
/// x="` then `application/json; y="`, merged) cannot hide the element after it. So a list is
/// read whenever one of the headers it was merged from would have been, and also when the merged
/// value as a whole reads as JSON to a server that does not split it. Both passes are linear.
pub(crate) fn reads_value(value: &[u8]) -> bool {
    let reads = |element: &[u8]| trim_lenient(element).is_empty() || is_json_media_type(element);
    reads(value)
        || value.split(|&b| b == b',').any(reads)
        || crate::future::split_outside_quotes(value).any(reads)
}

/// `application/json` or `application/<anything>+json` (`application/+json` included), any ASCII
/// case, parameters allowed, read as Starlette and FastAPI read it: the value decoded as latin-1,
/// the part before the first `;` stripped of what Python's `str.strip` strips (ASCII whitespace,
/// the separators 0x1C to 0x1F, NEL 0x85 and NBSP 0xA0), the type before the first `/`.
pub(crate) fn is_json_media_type(value: &[u8]) -> bool {
    let essence = value.split(|&b| b == b';').next().unwrap_or(value);
    let essence = trim_lenient(essence);
    let Some(slash) = essence.iter().position(|&b| b == b'/') else {
        return false;
    };
    let (kind, subtype) = (&essence[..slash], &essence[slash + 1..]);
    kind.eq_ignore_ascii_case(b"application")
        && (subtype.eq_ignore_ascii_case(b"json")
            || (subtype.len() >= b"+json".len()
                && subtype[subtype.len() - 5..].eq_ignore_ascii_case(b"+json")))
}

/// Whitespace as Python's `str.strip` sees it in a latin-1 string.
fn is_lenient_space(b: u8) -> bool {
    matches!(b, b'\t'..=b'\r' | 0x1C..=0x20 | 0x85 | 0xA0)
}

fn trim_lenient(mut bytes: &[u8]) -> &[u8] {
    while let [b, rest @ ..] = bytes {
        if !is_lenient_space(*b) {
            break;
        }
        bytes = rest;
    }
    while let [rest @ .., b] = bytes {
        if !is_lenient_space(*b) {
            break;
        }
        bytes = rest;
    }
    bytes
}

/// No `content-encoding` but `identity` (any case; empty list elements are ignored, RFC 9110
/// section 5.6.1).
fn identity_only(headers: &HeaderMap) -> bool {
    headers.get_all(CONTENT_ENCODING).iter().all(|v| {
        v.as_bytes()
            .split(|&b| b == b',')
            .map(trim_ows)
            .all(|coding| coding.is_empty() || coding.eq_ignore_ascii_case(b"identity"))
    })
}

/// The `content-length` header, if it is a number (digits only, as RFC 9110 writes it; `+0` is
/// not one).
pub(crate) fn declared_length(headers: &HeaderMap) -> Option<u64> {
    let value = trim_ows(headers.get(CONTENT_LENGTH)?.as_bytes());
    if value.is_empty() || !value.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(value).ok()?.parse().ok()
}

fn trim_ows(mut bytes: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = bytes {
        bytes = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = bytes {
        bytes = rest;
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_media_types_are_read_as_starlette_reads_them() {
        for json in [
            &b"application/json"[..],
            b"APPLICATION/JSON; charset=utf-8",
            b"application/+json",
            b"application/vnd.api+JSON",
            b"\xA0application/json\xA0",
            b"\x85application/json",
            b"application/json\x1F",
            b" \tapplication/json ;x",
        ] {
            assert!(
                is_json_media_type(json),
                "{:?}",
                String::from_utf8_lossy(json)
            );
        }
        for other in [
            &b"text/json"[..],
            b"application/jsonx",
            b"application/xjson",
            b"application",
            b"application /json",
            b"\xC2\xA0application/json", // UTF-8 NBSP: latin-1 "Â" then NBSP
            b"multipart/form-data",
        ] {
            assert!(
                !is_json_media_type(other),
                "{:?}",
                String::from_utf8_lossy(other)
            );
        }
    }

    /// Envoy merges repeated `content-type` headers into one value joined by commas; the docs
    /// promise that any one of several headers counts, so any one element counts.
    #[test]
    fn a_comma_joined_content_type_is_read_when_any_element_is_json() {
        for read in [
            &b"text/plain,application/json"[..],
            b"application/json,text/plain",
            b"text/plain, application/vnd.api+json; charset=utf-8",
            b"text/plain; q=\"a,b\",application/json",
            b"text/plain,",
            b",text/plain",
            b"text/plain, \xA0 ,text/html",
            // A quote that the next header closes does not hide the element between them.
            b"a/b; x=\",application/json; y=\"",
            b"text/plain; x=\"unterminated,application/json",
            // Read whole, as a server that does not split it reads it.
            b"application/xml,text/vnd+json",
        ] {
            assert!(reads_value(read), "{:?}", String::from_utf8_lossy(read));
        }
        for skipped in [
            &b"text/plain,text/html"[..],
            b"text/plain; x=\"application/json\"",
            b"text/plain; x=\"a,application/json\"",
            b"multipart/form-data; boundary=\"a,b\", text/plain",
        ] {
            assert!(
                !reads_value(skipped),
                "{:?}",
                String::from_utf8_lossy(skipped)
            );
        }
    }
}
