use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::header::{CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE, TRANSFER_ENCODING};
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use pin_project_lite::pin_project;

use crate::annotations::RequestedAnnotations;
use crate::body::BypassMarkerBody;
use crate::config::{Config, ErrorParts};
use crate::filter::EventStreamFilter;
use crate::observe::Observer;
use crate::scan::Scanner;

pin_project! {
    /// Response future for [`BypassMarker`](crate::BypassMarker): decides from the response head
    /// whether the body is filtered or passed through.
    pub struct ResponseFuture<F> {
        #[pin]
        inner: F,
        config: Arc<Config>,
        requested: u64,
        // The request was `HEAD`: the response has no content, whatever its headers say.
        head: bool,
        // The request's own observer (`FrameObserver::for_request`), if it has one.
        observer: Option<Observer>,
    }
}

impl<F> ResponseFuture<F> {
    pub(crate) fn new(
        inner: F,
        config: Arc<Config>,
        requested: u64,
        head: bool,
        observer: Option<Observer>,
    ) -> Self {
        Self {
            inner,
            config,
            requested,
            head,
            observer,
        }
    }
}

impl<F: std::fmt::Debug> std::fmt::Debug for ResponseFuture<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<F, B, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<BypassMarkerBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let res = ready!(this.inner.poll(cx))?;
        let (mut parts, body) = res.into_parts();
        let config = this.config;

        let body = match head_kind(*this.head, parts.status, &parts.headers) {
            HeadKind::Other => BypassMarkerBody::passthrough(body),
            // No content, whatever the inner body holds: an HTTP/1.1 server sends none, but
            // hyper's HTTP/2 server sends DATA frames for a 204 or 304 whose body has them.
            HeadKind::NoContent => BypassMarkerBody::emptied(body),
            kind => {
                let requested = *this.requested
                    | parts
                        .extensions
                        .get::<RequestedAnnotations>()
                        .map_or(0, |r| config.requested_mask(r));
                if kind == HeadKind::Encoded {
                    if config.removal_mask(requested) != 0 {
                        // An encoded event stream with something to remove for this client: a
                        // 502 in its place, before any byte of it. Its body is never polled.
                        let coding = codings(&parts.headers);
                        if let Some(observer) = this.observer.as_ref().or(config.observer.as_ref())
                        {
                            observer.0.encoded_stream_refused(&coding);
                        }
                        #[cfg(feature = "tracing")]
                        tracing::warn!(
                            coding = %coding,
                            "encoded event stream refused with a 502: it cannot be filtered"
                        );
                        let (content_type, json) = match &config.error_body {
                            None => (
                                HeaderValue::from_static("application/json"),
                                encoded_refusal_json(&coding),
                            ),
                            Some(shape) => shape.shape(&ErrorParts {
                                status: StatusCode::BAD_GATEWAY,
                                kind: "server_error",
                                code: "encoded_event_stream",
                                message: &encoded_message(&coding),
                            }),
                        };
                        parts.status = StatusCode::BAD_GATEWAY;
                        keep_safe_headers(&mut parts.headers);
                        parts.headers.insert(CONTENT_TYPE, content_type);
                        parts
                            .headers
                            .insert(CONTENT_LENGTH, HeaderValue::from(json.len()));
                        BypassMarkerBody::refused(body, json)
                    } else {
                        BypassMarkerBody::passthrough(body)
                    }
                } else {
                    match body_filter(config, requested, this.observer.take()) {
                        None => BypassMarkerBody::passthrough(body),
                        Some(filter) => {
                            parts.headers.remove(CONTENT_LENGTH);
                            BypassMarkerBody::filtering(body, filter)
                        }
                    }
                }
            }
        };
        Poll::Ready(Ok(Response::from_parts(parts, body)))
    }
}

/// Keeps, on the 502 that replaces an encoded event stream, the headers that layers inside this one
/// set and that still hold for the error: `vary`, CORS's `access-control-*` (without which a browser
/// hides the error from the page) and `x-request-id`. Every other header described the stream.
pub(crate) fn keep_safe_headers(headers: &mut HeaderMap) {
    let mut kept = HeaderMap::new();
    let mut current = None;
    // `drain` names a header once, then yields its other values with `None`.
    for (name, value) in headers.drain() {
        if let Some(name) = name {
            let keep = {
                let name = name.as_str();
                name == "vary" || name == "x-request-id" || name.starts_with("access-control-")
            };
            current = keep.then_some(name);
        }
        if let Some(name) = &current {
            kept.append(name.clone(), value);
        }
    }
    *headers = kept;
}

/// What a response head announces, for the layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HeadKind {
    /// Content that is not an event stream: passed through.
    Other,
    /// An event-stream head on a response that has no content (a `1xx`, `204` or `304`, or the
    /// response to a `HEAD` request): whatever body it comes with is dropped, headers kept.
    NoContent,
    /// An unencoded event stream: filtered.
    Plain,
    /// An event stream with a content coding other than `identity`, or a transfer coding other
    /// than `chunked`: it cannot be read.
    Encoded,
}

/// What a response with this head carries: content (not a `1xx`, `204` or `304`, nor the
/// response to a `HEAD` request) that is an event stream, unencoded or encoded; an event-stream
/// head without content; or anything else.
pub(crate) fn head_kind(head_request: bool, status: StatusCode, headers: &HeaderMap) -> HeadKind {
    // A response without content keeps every header, `content-length` included (it states the
    // length of the content a GET would have had, or of the cached one for a 304).
    let no_content = head_request
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED;
    if !is_event_stream(headers) {
        HeadKind::Other
    } else if no_content {
        HeadKind::NoContent
    } else if is_identity(headers) && transfer_codings(headers).is_empty() {
        HeadKind::Plain
    } else {
        HeadKind::Encoded
    }
}

/// The message of the error that replaces an encoded event stream. For a content coding it names
/// both causes: an upstream that compressed the stream, and a compression layer placed inside the
/// filter (in axum, `.layer(compression).layer(bypass)`: the last `.layer` is the outermost). For a
/// transfer coding (`coding` is `transfer-encoding gzip`, as [`codings`] writes it) it names the
/// upstream's.
pub(crate) fn encoded_message(coding: &str) -> String {
    if coding.starts_with(TRANSFER_PREFIX) {
        return format!(
            "the event stream has {coding}, which cannot be filtered: the upstream applied a \
             transfer coding other than chunked (it must answer with chunked or a content-length; \
             a client's TE header is not forwarded to it)"
        );
    }
    format!(
        "the event stream has content-encoding {coding}, which cannot be filtered: either the \
         upstream compressed it (it must answer with content-encoding identity) or compression \
         is applied before the filter (the compression layer must be outside it)"
    )
}

/// The body of the 502 that replaces an encoded event stream, in OpenAI's error shape, with the
/// keys in the order serde_json writes them (the JSON guard's `Refusal::body` writes the same
/// bytes).
pub(crate) fn encoded_refusal_json(coding: &str) -> Bytes {
    let mut json = String::from(r#"{"error":{"code":"encoded_event_stream","message":""#);
    for c in encoded_message(coding).chars() {
        match c {
            '"' => json.push_str("\\\""),
            '\\' => json.push_str("\\\\"),
            '\n' => json.push_str("\\n"),
            '\r' => json.push_str("\\r"),
            '\t' => json.push_str("\\t"),
            '\u{8}' => json.push_str("\\b"),
            '\u{c}' => json.push_str("\\f"),
            c if u32::from(c) < 0x20 => json.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => json.push(c),
        }
    }
    json.push_str(r#"","param":null,"type":"server_error"}}"#);
    Bytes::from(json)
}

/// Whether a response with this head has a body the layer filters: it has content (not a `1xx`,
/// `204` or `304`, nor the response to a `HEAD` request) and is an unencoded event stream.
pub(crate) fn filters_head(head_request: bool, status: StatusCode, headers: &HeaderMap) -> bool {
    head_kind(head_request, status, headers) == HeadKind::Plain
}

/// The filter for an event stream to a client that asked for the configured names in
/// `requested`, or `None` when nothing would be removed (and nothing observed).
pub(crate) fn body_filter(
    config: &Arc<Config>,
    requested: u64,
    observer: Option<Observer>,
) -> Option<EventStreamFilter> {
    let remove = config.removal_mask(requested);
    // With an observer, the frames a client opted in to are counted, so they are scanned for.
    let observed = (config.observer.is_some() || observer.is_some()) && requested != 0;
    if remove == 0 && !config.sdk_safe && !observed {
        return None;
    }
    let mut scanner = Scanner::new(config.clone(), remove);
    scanner.set_observer(observer);
    Some(EventStreamFilter::new(scanner))
}

/// The content codings of an event stream the filter cannot read: `Some` (the codings other than
/// `identity`, see [`codings`]) when a response with this head has content, is a
/// `text/event-stream` and has a `content-encoding` other than `identity`.
pub(crate) fn encoded_event_stream(
    head_request: bool,
    status: StatusCode,
    headers: &HeaderMap,
) -> Option<String> {
    (head_kind(head_request, status, headers) == HeadKind::Encoded).then(|| codings(headers))
}

/// How [`codings`] names transfer codings: `transfer-encoding gzip`, never a content coding (a
/// token has no space).
const TRANSFER_PREFIX: &str = "transfer-encoding ";

/// The codings that keep the filter from reading the body, for a message, at most 64 bytes: the
/// transfer codings other than `chunked` and `identity` after [`TRANSFER_PREFIX`] when there are
/// any (`transfer-encoding gzip`), else the content codings other than `identity`, as the response
/// lists them, joined by `, ` (`gzip`).
fn codings(headers: &HeaderMap) -> String {
    let mut transfer = transfer_codings(headers);
    if !transfer.is_empty() {
        transfer.truncate(64 - TRANSFER_PREFIX.len());
        return format!("{TRANSFER_PREFIX}{}", String::from_utf8_lossy(&transfer));
    }
    let mut codings = Vec::new();
    for value in headers.get_all(CONTENT_ENCODING) {
        for coding in value.as_bytes().split(|&b| b == b',').map(trim_ows) {
            if !coding.is_empty() && !coding.eq_ignore_ascii_case(b"identity") {
                if !codings.is_empty() {
                    codings.extend_from_slice(b", ");
                }
                codings.extend_from_slice(coding);
            }
        }
    }
    codings.truncate(64);
    String::from_utf8_lossy(&codings).into_owned()
}

/// `content-type: text/event-stream` (any case, parameters allowed), whatever its coding.
fn is_event_stream(headers: &HeaderMap) -> bool {
    media_type(headers).is_some_and(|(ty, subtype)| {
        ty.eq_ignore_ascii_case(b"text") && subtype.eq_ignore_ascii_case(b"event-stream")
    })
}

/// `content-type: text/event-stream` (any case, parameters allowed) with no content coding
/// other than `identity`. Header values are read as bytes, so parameters holding obs-text bytes
/// (`x="\xE9"`) do not matter.
#[cfg(test)]
fn is_plain_event_stream(headers: &HeaderMap) -> bool {
    head_kind(false, StatusCode::OK, headers) == HeadKind::Plain
}

/// The media type of the response (type and subtype) as a browser reads it, the way Fetch's
/// "extract a MIME type" does: every `content-type` value, in order, split at commas outside
/// quoted strings; of the pieces that parse as a media type other than `*/*`, the last one counts.
/// So of two `content-type` headers, the last valid one wins.
fn media_type(headers: &HeaderMap) -> Option<(&[u8], &[u8])> {
    let mut last = None;
    for value in headers.get_all(CONTENT_TYPE) {
        for piece in split_outside_quotes(value.as_bytes()) {
            if let Some((ty, subtype)) = parse_essence(piece) {
                if !(ty == b"*" && subtype == b"*") {
                    last = Some((ty, subtype));
                }
            }
        }
    }
    last
}

/// Splits a header value at the commas that are not inside a quoted string (with `\` escapes).
pub(crate) fn split_outside_quotes(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut quoted = false;
    let mut escaped = false;
    value.split(move |&b| {
        if escaped {
            escaped = false;
        } else if quoted {
            match b {
                b'\\' => escaped = true,
                b'"' => quoted = false,
                _ => {}
            }
        } else if b == b'"' {
            quoted = true;
        } else {
            return b == b',';
        }
        false
    })
}

/// The type and subtype of one media type (`type "/" subtype`, whitespace allowed around the
/// whole and before the parameters), or `None` if it does not parse. Parameters are not looked
/// at: Fetch ignores the ones it cannot parse.
fn parse_essence(piece: &[u8]) -> Option<(&[u8], &[u8])> {
    let piece = trim_ows(piece);
    let slash = piece.iter().position(|&b| b == b'/')?;
    let ty = &piece[..slash];
    let rest = &piece[slash + 1..];
    let end = rest.iter().position(|&b| b == b';').unwrap_or(rest.len());
    // Fetch's parser trims whitespace after the subtype but not before it.
    let subtype = trim_end_ows(&rest[..end]);
    let token = |s: &[u8]| !s.is_empty() && s.iter().all(|&b| is_tchar(b));
    (token(ty) && token(subtype)).then_some((ty, subtype))
}

/// Every content coding listed is `identity` (any case). Empty list elements are ignored (RFC
/// 9110, section 5.6.1), so `identity, `, `,identity` and an empty value all mean identity.
fn is_identity(headers: &HeaderMap) -> bool {
    headers.get_all(CONTENT_ENCODING).iter().all(|value| {
        value
            .as_bytes()
            .split(|&b| b == b',')
            .map(trim_ows)
            .all(|coding| coding.is_empty() || coding.eq_ignore_ascii_case(b"identity"))
    })
}

/// The transfer codings other than `chunked` and `identity` (any case; empty list elements
/// ignored), joined by `, `: empty when the body's bytes are the content as it is. `chunked`
/// framing is undone by the HTTP/1.1 client that read the response; any other transfer coding
/// (`gzip, chunked`) leaves the content encoded, and a client that asked for it with `TE` decodes
/// it.
fn transfer_codings(headers: &HeaderMap) -> Vec<u8> {
    let mut codings = Vec::new();
    for value in headers.get_all(TRANSFER_ENCODING) {
        for coding in value.as_bytes().split(|&b| b == b',').map(trim_ows) {
            if !coding.is_empty()
                && !coding.eq_ignore_ascii_case(b"chunked")
                && !coding.eq_ignore_ascii_case(b"identity")
            {
                if !codings.is_empty() {
                    codings.extend_from_slice(b", ");
                }
                codings.extend_from_slice(coding);
            }
        }
    }
    codings
}

fn is_ows(b: &u8) -> bool {
    *b == b' ' || *b == b'\t'
}

/// `value` without trailing spaces and tabs (RFC 9110's OWS).
fn trim_end_ows(value: &[u8]) -> &[u8] {
    &value[..value.iter().rposition(|b| !is_ows(b)).map_or(0, |i| i + 1)]
}

/// `value` without leading and trailing spaces and tabs.
fn trim_ows(value: &[u8]) -> &[u8] {
    let value = trim_end_ows(value);
    &value[value.iter().position(|b| !is_ows(b)).unwrap_or(value.len())..]
}

/// RFC 9110's `tchar`: the bytes of a token.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &[u8])]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(
                http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                http::HeaderValue::from_bytes(value).unwrap(),
            );
        }
        map
    }

    fn sse_with(pairs: &[(&str, &[u8])]) -> bool {
        let mut all = vec![("content-type", &b"text/event-stream"[..])];
        all.extend_from_slice(pairs);
        is_plain_event_stream(&headers(&all))
    }

    #[test]
    fn event_stream_media_type_is_matched_case_insensitively_with_parameters() {
        for ct in [
            &b"text/event-stream"[..],
            b"Text/Event-Stream; charset=utf-8",
            b" text/event-stream ;x=y",
            b"text/event-stream\t",
            b"TEXT/EVENT-STREAM;",
        ] {
            assert!(
                is_plain_event_stream(&headers(&[("content-type", ct)])),
                "{}",
                String::from_utf8_lossy(ct)
            );
        }
    }

    #[test]
    fn a_parameter_with_obs_text_bytes_is_still_an_event_stream() {
        assert!(is_plain_event_stream(&headers(&[(
            "content-type",
            b"text/event-stream; x=\"\xE9\""
        )])));
        assert!(is_plain_event_stream(&headers(&[(
            "content-type",
            b"text/event-stream; charset=\xFF\xFE"
        )])));
    }

    #[test]
    fn other_media_types_are_not_event_streams() {
        assert!(!is_plain_event_stream(&headers(&[])));
        for ct in [
            &b"application/json"[..],
            b"application/grpc",
            b"text/event-streamx",
            b"text/event-stream-x",
            b"text /event-stream",
            b"text/ event-stream",
            b"text/event stream",
            b"text/\xE9vent-stream",
            b"event-stream",
            b"",
        ] {
            assert!(
                !is_plain_event_stream(&headers(&[("content-type", ct)])),
                "{}",
                String::from_utf8_lossy(ct)
            );
        }
    }

    /// Two `content-type` headers (or a list in one) are read as Fetch reads them, which is what
    /// a browser's `EventSource` checks: the last value that parses as a media type counts.
    #[test]
    fn of_several_content_types_the_last_valid_one_counts_as_in_fetch() {
        let ct = |values: &[&[u8]]| {
            let pairs: Vec<_> = values.iter().map(|v| ("content-type", *v)).collect();
            is_plain_event_stream(&headers(&pairs))
        };
        assert!(!ct(&[b"text/event-stream", b"application/json"]));
        assert!(ct(&[b"application/json", b"text/event-stream"]));
        assert!(!ct(&[b"text/event-stream, application/json"]));
        assert!(ct(&[b"application/json, text/event-stream"]));
        // Values that do not parse, and `*/*`, are skipped.
        assert!(ct(&[b"text/event-stream", b"nonsense"]));
        assert!(ct(&[b"text/event-stream", b"*/*"]));
        assert!(ct(&[b"text/event-stream, ,"]));
        // A comma inside a quoted parameter does not split the value.
        assert!(ct(&[b"text/event-stream; x=\", text/html;\""]));
        assert!(!ct(&[b"text/html; x=\", text/event-stream\""]));
        assert!(ct(&[b"text/event-stream; x=\"a\\\", text/html\""]));
    }

    #[test]
    fn encoded_event_streams_are_not_filtered() {
        for coding in [
            &b"gzip"[..],
            b"identity, br",
            b"identity, gzip",
            b"GZIP",
            b"identity,,br",
            b"identity;q=1",
            b"\xE9",
        ] {
            assert!(
                !sse_with(&[("content-encoding", coding)]),
                "{}",
                String::from_utf8_lossy(coding)
            );
        }
        assert!(!sse_with(&[
            ("content-encoding", b"identity"),
            ("content-encoding", b"gzip")
        ]));
    }

    /// RFC 9110, section 5.6.1: empty list elements are ignored.
    #[test]
    fn identity_and_empty_codings_are_not_encodings() {
        for coding in [
            &b"identity"[..],
            b"Identity",
            b"identity, ",
            b",identity",
            b" , IDENTITY ,, ",
            b"",
            b" ",
            b",",
        ] {
            assert!(
                sse_with(&[("content-encoding", coding)]),
                "{:?}",
                String::from_utf8_lossy(coding)
            );
        }
        assert!(sse_with(&[
            ("content-encoding", b""),
            ("content-encoding", b"identity")
        ]));
    }
}

#[cfg(test)]
mod refusal_tests {
    use super::*;

    /// The layer writes its error without serde_json (not a default dependency): the message is
    /// escaped as serde_json escapes it, keys in its order (tests/compression.rs compares the
    /// whole body with the JSON guard's refusal).
    #[test]
    fn the_layers_502_body_escapes_as_serde_json_does() {
        let body = encoded_refusal_json("x\"y\\z\t\u{1}\u{e9}");
        let text = std::str::from_utf8(&body).unwrap();
        assert!(text.starts_with(r#"{"error":{"code":"encoded_event_stream","message":"#));
        assert!(
            text.contains(r#"content-encoding x\"y\\z\t\u0001é, which"#),
            "{text}"
        );
        assert!(text.ends_with(r#"","param":null,"type":"server_error"}}"#));
    }
}
