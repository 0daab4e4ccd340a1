//! [`GatewayExchange`]: one request and its response through a gateway that calls a filter at each
//! step (Envoy's external processor, the Envoy dynamic module), sans-IO.

use std::fmt;

use bytes::Bytes;
use http::{header, HeaderMap, Method, StatusCode};

use super::guard::{
    reads_content_type, BodyDecision, HeadDecision, Refusal, RequestGuard, Spliced,
};
use crate::filter::{ChunkEdit, EventStreamFilter};
use crate::future::{head_kind, HeadKind};
use crate::{BypassMarkerLayer, FrameTooLarge, RequestedAnnotations};

/// One HTTP request and its response, as a gateway's filter sees them: the JSON guard on the
/// request, the client's opt-in carried to the response, the response body through an
/// [`EventStreamFilter`]. It does no I/O; the host calls it at each step and does what it answers.
///
/// The calling contract, in the order a gateway calls its filters:
///
/// 1. [`request_headers`](Self::request_headers): forward the request, read its whole body, or
///    refuse it (a local reply: [`Refusal`]'s status and body; forward nothing);
/// 2. after [`RequestStep::ReadBody`], [`request_body`](Self::request_body) with the whole body:
///    forward it, forward a spliced one (and set `content-length`), or refuse it;
/// 3. [`response_headers`](Self::response_headers): pass the response through untouched,
///    filter its body (and drop its `content-length`), or refuse it (an encoded event stream
///    with something to remove: answer [`Refusal`]'s 502 instead, before any byte of it, or
///    reset the stream if the response has started);
/// 4. while filtering, [`response_body`](Self::response_body) for every chunk, the last one
///    (perhaps empty) with `end_of_stream`; the [`ChunkEdit`] says what to forward in its place.
///
/// Steps out of that order are errors ([`ExchangeError::Order`]) that the host turns into a
/// failed stream, never into a request or response forwarded unjudged. A response whose request
/// headers were never seen is an error or is filtered for a client that asked for nothing, as
/// [`GatewayExchange::new`] is told ([`UnseenRequest`]).
///
/// `bypass-marker ext-proc` and the Envoy dynamic module both drive this type, so that they
/// answer the same input with the same bytes.
///
/// ```
/// use bytes::Bytes;
/// use http::{header, HeaderMap, HeaderValue, Method, StatusCode};
/// use tower_bypass_marker::sans_io::{
///     BodyStep, ChunkEdit, GatewayExchange, RequestStep, ResponseStep, UnseenRequest,
/// };
/// use tower_bypass_marker::BypassMarkerLayer;
///
/// let layer = BypassMarkerLayer::dynamo();
/// let mut exchange = GatewayExchange::new(&layer, layer.request_guard(), UnseenRequest::Fail);
///
/// let mut json = HeaderMap::new();
/// json.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
/// let step = exchange.request_headers(Method::POST, &json, false)?;
/// assert!(matches!(step, RequestStep::ReadBody));
/// let body = Bytes::from_static(br#"{"stream":true,"nvext":{"annotations":["request_id"]}}"#);
/// assert!(matches!(exchange.request_body(body, true)?, BodyStep::Forward));
///
/// let mut sse = HeaderMap::new();
/// sse.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
/// let step = exchange.response_headers(StatusCode::OK, &sse, false)?;
/// assert!(matches!(step, ResponseStep::Filter { .. }));
///
/// let chunk = b"event: x-bypass-remote-prefill\n: true\n\ndata: {}\n\n";
/// let mut edit = ChunkEdit::new();
/// exchange.response_body(&[chunk], true, &mut edit)?;
/// assert_eq!(edit.to_vec(&[&chunk[..]]), b"data: {}\n\n");
/// # Ok::<_, tower_bypass_marker::sans_io::ExchangeError>(())
/// ```
#[derive(Debug)]
pub struct GatewayExchange {
    layer: BypassMarkerLayer,
    guard: RequestGuard,
    unseen: UnseenRequest,
    request: RequestState,
    method: Method,
    granted: RequestedAnnotations,
    response: ResponseState,
}

/// What [`GatewayExchange::response_headers`] does when the request's headers never came to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum UnseenRequest {
    /// An error: the host can skip request headers by configuration (ext_proc's
    /// `request_header_mode: SKIP`), and then the guard never ran and clients could reach the
    /// router with its own names.
    Fail,
    /// Filter the response for a client that asked for nothing: the host calls the request step
    /// for every request it forwards, so a response without one is a reply the gateway made itself
    /// (another filter's local reply).
    Filter,
}

/// The answer to [`GatewayExchange::request_headers`].
#[derive(Debug)]
#[must_use]
#[non_exhaustive]
pub enum RequestStep {
    /// Forward the request; its body (if any) is not read.
    Forward,
    /// Read the whole body, then call [`GatewayExchange::request_body`]; forward nothing before.
    ReadBody,
    /// Answer the client with this refusal; forward nothing.
    Refuse(Refusal),
}

/// The answer to [`GatewayExchange::request_body`].
#[derive(Debug)]
#[must_use]
#[non_exhaustive]
pub enum BodyStep {
    /// Forward the body as it is.
    Forward,
    /// Forward `body` instead: router-owned names were removed from `nvext.annotations`.
    #[non_exhaustive]
    Replace {
        /// The body to forward.
        body: Spliced,
        /// The request had a `content-length`: set it to [`Spliced::len`].
        set_content_length: bool,
    },
    /// Answer the client with this refusal; forward nothing.
    Refuse(Refusal),
}

/// The answer to [`GatewayExchange::response_headers`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
#[non_exhaustive]
pub enum ResponseStep {
    /// Pass the response through untouched: there is nothing to remove from it.
    Pass,
    /// Filter the body: call [`GatewayExchange::response_body`] for every chunk. Also the answer
    /// to an event-stream head on a response that has no content (a `204` or `304`, the response
    /// to `HEAD`) that does not end the stream: whatever body follows is removed whole.
    #[non_exhaustive]
    Filter {
        /// The response has a `content-length`, which no longer holds: remove it.
        remove_content_length: bool,
    },
    /// Send this refusal instead of the response ([`Refusal::encoded_event_stream`]): it is an
    /// event stream in a content coding the filter cannot read, and something would have to be
    /// removed from it for this client. Forward no byte of the response.
    Refuse(Refusal),
}

/// Why an [`GatewayExchange`] cannot go on: the host must fail the stream (reset it, or answer 5xx
/// before the response started), never end it cleanly.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ExchangeError {
    /// A step out of order, or a step the guard cannot judge (a request body that is not whole):
    /// the host is configured so that part of the exchange would pass unjudged.
    Order(&'static str),
    /// A frame that spans chunks outgrew the layer's `max_frame_bytes`.
    FrameTooLarge(FrameTooLarge),
}

impl fmt::Display for ExchangeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Order(message) => f.write_str(message),
            Self::FrameTooLarge(err) => err.fmt(f),
        }
    }
}

impl std::error::Error for ExchangeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Order(_) => None,
            Self::FrameTooLarge(err) => Some(err),
        }
    }
}

impl From<FrameTooLarge> for ExchangeError {
    fn from(err: FrameTooLarge) -> Self {
        Self::FrameTooLarge(err)
    }
}

/// Where the request is.
#[derive(Debug)]
enum RequestState {
    /// No request headers yet.
    Start,
    /// The guard reads the body: the next body is all of it. `json`: its content type is JSON
    /// (or absent).
    ReadBody { has_length: bool, json: bool },
    /// The request went on (forwarded, spliced or refused).
    Done,
}

/// Where the response is.
// One per stream, for the stream's life: boxing the filter would only add an allocation.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum ResponseState {
    /// No response headers yet.
    Start,
    /// The body goes through this filter.
    Filter(EventStreamFilter),
    /// The body of an event-stream response that has no content (a `204`, a `304`, the response
    /// to `HEAD`): every byte of it is removed.
    Discard,
    /// Passed through, or its body has ended.
    Done,
}

impl GatewayExchange {
    /// An exchange with this layer's names and this guard's limits.
    pub fn new(layer: &BypassMarkerLayer, guard: RequestGuard, unseen: UnseenRequest) -> Self {
        Self {
            layer: layer.clone(),
            guard,
            unseen,
            request: RequestState::Start,
            method: Method::GET,
            granted: RequestedAnnotations::new(),
            response: ResponseState::Start,
        }
    }

    /// The request's head. `end_of_stream`: the request has no body.
    ///
    /// A request that goes on ([`RequestStep::Forward`], [`RequestStep::ReadBody`]) should ask
    /// its upstream for `accept-encoding: identity`: an encoded event stream cannot be filtered,
    /// so one from an upstream that compresses for a client that accepts gzip is refused
    /// ([`ResponseStep::Refuse`]) when something would be removed from it.
    ///
    /// # Errors
    ///
    /// [`ExchangeError::Order`] for a second request head.
    pub fn request_headers(
        &mut self,
        method: Method,
        headers: &HeaderMap,
        end_of_stream: bool,
    ) -> Result<RequestStep, ExchangeError> {
        if !matches!(self.request, RequestState::Start) {
            return Err(ExchangeError::Order(
                "a second request headers message on one stream",
            ));
        }
        self.method = method;
        self.request = RequestState::Done;
        Ok(match self.guard.check_head(headers, end_of_stream) {
            HeadDecision::Skip => RequestStep::Forward,
            HeadDecision::Refuse(refusal) => {
                self.guard.report_refusal(None, &refusal);
                RequestStep::Refuse(refusal)
            }
            // No body will come: the empty body is judged now.
            HeadDecision::Read if end_of_stream => match self.judge(true, Bytes::new(), false) {
                BodyStep::Refuse(refusal) => RequestStep::Refuse(refusal),
                BodyStep::Forward | BodyStep::Replace { .. } => RequestStep::Forward,
            },
            HeadDecision::Read => {
                self.request = RequestState::ReadBody {
                    has_length: headers.contains_key(header::CONTENT_LENGTH),
                    json: reads_content_type(headers),
                };
                RequestStep::ReadBody
            }
        })
    }

    /// The request's body, after [`RequestStep::ReadBody`]: all of it, with `end_of_stream`
    /// (trailers may follow). A body the guard does not read is forwarded as it is.
    ///
    /// # Errors
    ///
    /// [`ExchangeError::Order`] for a body before the request's head, and for a body the guard
    /// reads that is not whole (`end_of_stream` false): it cannot be judged.
    pub fn request_body(
        &mut self,
        body: Bytes,
        end_of_stream: bool,
    ) -> Result<BodyStep, ExchangeError> {
        match self.request {
            RequestState::ReadBody { has_length, json } if end_of_stream => {
                self.request = RequestState::Done;
                Ok(self.judge(json, body, has_length))
            }
            RequestState::ReadBody { .. } => Err(ExchangeError::Order(
                "a request body that is not the whole body: the guard judges whole bodies \
                 (request_body_mode must be BUFFERED)",
            )),
            RequestState::Done => Ok(BodyStep::Forward),
            RequestState::Start => Err(ExchangeError::Order(
                "a request body before its headers: request headers must reach the processor",
            )),
        }
    }

    /// The guard's decision on a whole body (`json`: its content type is JSON), reported to the
    /// layer's observer.
    fn judge(&mut self, json: bool, body: Bytes, has_length: bool) -> BodyStep {
        let (decision, stripped) = self.guard.judge(json, body);
        self.guard.report(None, stripped, &decision);
        match decision {
            BodyDecision::Forward { granted } => {
                self.granted = granted;
                BodyStep::Forward
            }
            BodyDecision::Splice { body, granted } => {
                self.granted = granted;
                BodyStep::Replace {
                    body,
                    set_content_length: has_length,
                }
            }
            BodyDecision::Refuse(refusal) => BodyStep::Refuse(refusal),
        }
    }

    /// The largest request body the guard reads: a longer one is refused with
    /// [`Refusal::too_large`], which a host that buffers the body can answer before it has all of
    /// it.
    pub fn max_request_body(&self) -> usize {
        self.guard.max_body()
    }

    /// The response's head. `end_of_stream`: the response has no body.
    ///
    /// An event stream with a `content-encoding` other than `identity` cannot be read: when a
    /// configured name would be removed for this client, the answer is
    /// [`ResponseStep::Refuse`] (a 502), so that no frame reaches it unfiltered; when nothing
    /// would be, it passes.
    ///
    /// # Errors
    ///
    /// [`ExchangeError::Order`] for a second response head, and for a response whose request
    /// headers never came when the exchange was made with [`UnseenRequest::Fail`].
    pub fn response_headers(
        &mut self,
        status: StatusCode,
        headers: &HeaderMap,
        end_of_stream: bool,
    ) -> Result<ResponseStep, ExchangeError> {
        if !matches!(self.response, ResponseState::Start) {
            return Err(ExchangeError::Order(
                "a second response headers message on one stream",
            ));
        }
        if matches!(self.request, RequestState::Start) && self.unseen == UnseenRequest::Fail {
            self.response = ResponseState::Done;
            return Err(ExchangeError::Order(
                "response headers for a request whose headers never reached the processor: \
                 the guard did not run (request_header_mode must be SEND)",
            ));
        }
        self.response = ResponseState::Done;
        if end_of_stream {
            return Ok(ResponseStep::Pass);
        }
        if head_kind(self.method == Method::HEAD, status, headers) == HeadKind::NoContent {
            // Its headers stay (`content-length` included: it states another representation's
            // length); an HTTP/2 upstream may still send DATA frames, which never pass.
            self.response = ResponseState::Discard;
            return Ok(ResponseStep::Filter {
                remove_content_length: false,
            });
        }
        if let Some(coding) =
            self.layer
                .refuses_encoded(&self.method, status, headers, &self.granted)
        {
            self.layer.report_encoded_refusal(&coding);
            return Ok(ResponseStep::Refuse(Refusal::encoded_event_stream(&coding)));
        }
        match self
            .layer
            .response_filter(&self.method, status, headers, &self.granted)
        {
            Some(filter) => {
                self.response = ResponseState::Filter(filter);
                Ok(ResponseStep::Filter {
                    remove_content_length: headers.contains_key(header::CONTENT_LENGTH),
                })
            }
            None => Ok(ResponseStep::Pass),
        }
    }

    /// The response body is being filtered: [`response_body`](Self::response_body) has work to
    /// do. False before the response's head, for a response passed through, and after the end.
    pub fn filters_response(&self) -> bool {
        matches!(
            self.response,
            ResponseState::Filter(_) | ResponseState::Discard
        )
    }

    /// One chunk of the response body (as one or more slices), the last one with
    /// `end_of_stream`: `edit` (cleared first) says what to forward in its place. A response
    /// that is not filtered leaves it [unchanged](ChunkEdit::is_unchanged).
    ///
    /// # Errors
    ///
    /// [`ExchangeError::Order`] for a body before the response's head;
    /// [`ExchangeError::FrameTooLarge`] when a frame outgrew the cap: the stream must be reset.
    pub fn response_body(
        &mut self,
        chunk: &[&[u8]],
        end_of_stream: bool,
        edit: &mut ChunkEdit,
    ) -> Result<(), ExchangeError> {
        edit.clear();
        let filter = match &mut self.response {
            ResponseState::Filter(filter) => filter,
            ResponseState::Discard => {
                edit.remove_all(chunk);
                if end_of_stream {
                    self.response = ResponseState::Done;
                }
                return Ok(());
            }
            ResponseState::Done => return Ok(()),
            ResponseState::Start => {
                return Err(ExchangeError::Order(
                    "a response body before its headers: response headers must reach the \
                     processor",
                ))
            }
        };
        let out = filter.edit(chunk, edit).and_then(|()| {
            if end_of_stream {
                filter.edit_end(edit)
            } else {
                Ok(())
            }
        });
        if end_of_stream || out.is_err() {
            self.response = ResponseState::Done;
        }
        Ok(out?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    /// An exchange whose request (a JSON body listing `annotations`) has been judged.
    fn after_request(
        layer: &BypassMarkerLayer,
        method: Method,
        annotations: &str,
    ) -> GatewayExchange {
        let mut exchange = GatewayExchange::new(layer, layer.request_guard(), UnseenRequest::Fail);
        let mut json = HeaderMap::new();
        json.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        let step = exchange.request_headers(method, &json, false).unwrap();
        assert!(matches!(step, RequestStep::ReadBody));
        let body = format!(r#"{{"nvext":{{"annotations":{annotations}}}}}"#);
        let step = exchange.request_body(Bytes::from(body), true).unwrap();
        assert!(!matches!(step, BodyStep::Refuse(_)));
        exchange
    }

    fn sse(coding: &'static str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        if !coding.is_empty() {
            headers.insert(header::CONTENT_ENCODING, HeaderValue::from_static(coding));
        }
        headers
    }

    #[test]
    fn an_encoded_event_stream_with_something_to_remove_is_refused_with_a_502() {
        let layer = BypassMarkerLayer::dynamo();
        for (coding, named) in [
            ("gzip", "gzip"),
            ("identity, br", "br"),
            ("GZIP, identity,, zstd", "GZIP, zstd"),
        ] {
            let mut exchange = after_request(&layer, Method::POST, r#"["request_id"]"#);
            let step = exchange
                .response_headers(StatusCode::OK, &sse(coding), false)
                .unwrap();
            let ResponseStep::Refuse(refusal) = step else {
                panic!("{coding}: {step:?}")
            };
            assert_eq!(refusal.status(), StatusCode::BAD_GATEWAY);
            assert_eq!(refusal.code(), "encoded_event_stream");
            assert_eq!(refusal.kind(), "server_error");
            assert!(
                refusal
                    .message()
                    .contains(&format!("content-encoding {named},")),
                "{}",
                refusal.message()
            );
            let body: serde_json::Value = serde_json::from_slice(&refusal.body()).unwrap();
            assert_eq!(body["error"]["code"], "encoded_event_stream");
            assert_eq!(body["error"]["type"], "server_error");
            assert!(body["error"]["param"].is_null());
            // Nothing of the response is filtered afterwards.
            assert!(!exchange.filters_response());
        }
    }

    #[test]
    fn an_encoded_event_stream_with_nothing_to_remove_passes() {
        // The client opted in to every name the layer knows.
        let layer = BypassMarkerLayer::new().opt_in("request_id");
        let mut exchange = after_request(
            &layer,
            Method::POST,
            r#"["request_id","x-bypass-remote-prefill"]"#,
        );
        let step = exchange
            .response_headers(StatusCode::OK, &sse("gzip"), false)
            .unwrap();
        assert_eq!(step, ResponseStep::Pass);
    }

    #[test]
    fn a_transfer_coding_other_than_chunked_is_refused_like_a_content_coding() {
        let layer = BypassMarkerLayer::dynamo();
        for (value, named) in [
            ("gzip, chunked", "transfer-encoding gzip"),
            ("Deflate,Chunked", "transfer-encoding Deflate"),
            ("chunked, br", "transfer-encoding br"),
        ] {
            let mut exchange = after_request(&layer, Method::POST, "[]");
            let mut headers = sse("");
            headers.insert(header::TRANSFER_ENCODING, HeaderValue::from_static(value));
            let step = exchange.response_headers(StatusCode::OK, &headers, false);
            let Ok(ResponseStep::Refuse(refusal)) = step else {
                panic!("{value}: {step:?}");
            };
            assert_eq!(refusal.status(), 502);
            assert_eq!(refusal.code(), "encoded_event_stream");
            assert!(
                refusal
                    .message()
                    .starts_with(&format!("the event stream has {named}, which")),
                "{}",
                refusal.message()
            );
            assert!(!exchange.filters_response());
        }
        // `chunked` alone (any case, empty elements ignored) is read and filtered.
        for value in ["chunked", "CHUNKED", " , chunked"] {
            let mut exchange = after_request(&layer, Method::POST, "[]");
            let mut headers = sse("");
            headers.insert(header::TRANSFER_ENCODING, HeaderValue::from_static(value));
            let step = exchange.response_headers(StatusCode::OK, &headers, false);
            assert!(matches!(step, Ok(ResponseStep::Filter { .. })), "{value}");
        }
    }

    #[test]
    fn responses_without_content_and_plain_streams_are_not_refused() {
        let layer = BypassMarkerLayer::dynamo();
        // No content: not refused, whatever the coding, and no byte of a body passes.
        let no_content = [
            (Method::POST, StatusCode::NO_CONTENT),
            (Method::POST, StatusCode::NOT_MODIFIED),
            (Method::HEAD, StatusCode::OK),
        ];
        for (method, status) in no_content {
            for coding in ["gzip", "identity"] {
                let mut exchange = after_request(&layer, method.clone(), "[]");
                let step = exchange.response_headers(status, &sse(coding), false);
                let expected = ResponseStep::Filter {
                    remove_content_length: false,
                };
                assert_eq!(step.unwrap(), expected, "{method} {status} {coding}");
                let mut edit = ChunkEdit::new();
                let frame: &[u8] = b"event: x-bypass-remote-prefill\n: true\n\n";
                exchange
                    .response_body(&[frame, b"data: 1\n\n"], false, &mut edit)
                    .unwrap();
                assert_eq!(edit.output_len(), 0, "{method} {status}");
                assert_eq!(edit.skip_front(), Some(frame.len() + 9));
                exchange
                    .response_body(&[b"data: 2"], true, &mut edit)
                    .unwrap();
                assert_eq!(edit.output_len(), 0);
                assert!(!exchange.filters_response());
            }
        }
        // No body at all.
        let mut exchange = after_request(&layer, Method::POST, "[]");
        let step = exchange.response_headers(StatusCode::OK, &sse("gzip"), true);
        assert_eq!(step.unwrap(), ResponseStep::Pass);
        // Not an event stream.
        let mut exchange = after_request(&layer, Method::POST, "[]");
        let mut json = HeaderMap::new();
        json.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        let step = exchange.response_headers(StatusCode::OK, &json, false);
        assert_eq!(step.unwrap(), ResponseStep::Pass);
        // Identity: filtered as before.
        let mut exchange = after_request(&layer, Method::POST, "[]");
        let step = exchange.response_headers(StatusCode::OK, &sse("identity"), false);
        assert!(matches!(step.unwrap(), ResponseStep::Filter { .. }));
    }
}
