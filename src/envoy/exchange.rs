//! The processor's state for one gRPC stream (one HTTP request), sans-IO: a `ProcessingRequest`
//! in, the `ProcessingResponse` to send back (or the error that fails the stream) out.

use bytes::Bytes;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::ProcessingMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request, processing_response::Response, BodyResponse, HeaderMutation,
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, TrailersResponse,
};
use http::{header, Method, StatusCode};
use tonic::Status;

use super::proto;
use crate::json::{BodyDecision, HeadDecision, Refusal, RequestGuard};
use crate::{BypassMarkerLayer, EventStreamFilter, FilterOutput, RequestedAnnotations};

/// Where the HTTP request is, as far as the processor is concerned.
enum RequestState {
    /// No request headers yet (or a response Envoy made itself).
    Start,
    /// The guard reads the body: the next request body message is all of it.
    ReadBody { has_length: bool },
    /// The request went on (forwarded, spliced or skipped).
    Done,
}

/// One HTTP request through Envoy's external processing filter.
pub(crate) struct Exchange {
    layer: BypassMarkerLayer,
    guard: RequestGuard,
    request: RequestState,
    method: Method,
    granted: RequestedAnnotations,
    /// Body modes Envoy announced in `protocol_config` (first message), else the documented
    /// configuration's (BUFFERED, STREAMED).
    request_body_mode: i32,
    response_body_mode: i32,
    /// The response's filter, between response headers and the end of the body.
    filter: Option<EventStreamFilter>,
    /// Response headers have been judged (a body message before them is refused).
    response_headers: bool,
}

impl Exchange {
    pub(crate) fn new(layer: BypassMarkerLayer, guard: RequestGuard) -> Self {
        Self {
            layer,
            guard,
            request: RequestState::Start,
            method: Method::GET,
            granted: RequestedAnnotations::new(),
            request_body_mode: proto::BODY_BUFFERED,
            response_body_mode: proto::BODY_STREAMED,
            filter: None,
            response_headers: false,
        }
    }

    /// The answer to one message; `None` for a message that carries no HTTP part (nothing to
    /// answer). `Err`: the stream must fail (Envoy then resets the HTTP stream, or answers 500
    /// before the response started; never a clean end).
    pub(crate) fn answer(
        &mut self,
        msg: ProcessingRequest,
    ) -> Result<Option<ProcessingResponse>, Status> {
        // Envoy ignores answers in observability mode, so nothing would be stripped or
        // filtered: refuse the stream rather than look as if it protected anything.
        if msg.observability_mode {
            return Err(Status::failed_precondition(
                "observability_mode cannot change requests or responses: turn it off",
            ));
        }
        self.on_message(msg)
    }

    fn on_message(&mut self, msg: ProcessingRequest) -> Result<Option<ProcessingResponse>, Status> {
        if let Some(config) = msg.protocol_config {
            self.request_body_mode = config.request_body_mode;
            self.response_body_mode = config.response_body_mode;
        }
        let Some(request) = msg.request else {
            return Ok(None);
        };
        let (response, mode_override) = match request {
            Request::RequestHeaders(h) => self.request_headers(h)?,
            Request::RequestBody(b) => (self.request_body(b)?, None),
            Request::RequestTrailers(_) => {
                (Response::RequestTrailers(TrailersResponse::default()), None)
            }
            Request::ResponseHeaders(h) => self.response_headers(h)?,
            Request::ResponseBody(b) => (Response::ResponseBody(self.response_body(b)?), None),
            Request::ResponseTrailers(_) => (
                Response::ResponseTrailers(TrailersResponse::default()),
                None,
            ),
        };
        Ok(Some(ProcessingResponse {
            response: Some(response),
            mode_override,
            ..ProcessingResponse::default()
        }))
    }

    fn request_headers(
        &mut self,
        h: HttpHeaders,
    ) -> Result<(Response, Option<ProcessingMode>), Status> {
        if !matches!(self.request, RequestState::Start) {
            return Err(Status::failed_precondition(
                "a second request headers message on one stream",
            ));
        }
        let (headers, method) = proto::to_header_map(h.headers.as_ref(), ":method");
        if let Some(method) = method {
            self.method = Method::from_bytes(&method)
                .map_err(|_| Status::invalid_argument("invalid :method"))?;
        }
        match self.guard.check_head(&headers, h.end_of_stream) {
            HeadDecision::Skip => {
                self.request = RequestState::Done;
                // Nothing to read: tell Envoy not to buffer and send the body (a large upload
                // would otherwise hit Envoy's buffer limit and be refused with 413).
                let mode =
                    (!h.end_of_stream && self.request_body_mode != proto::BODY_NONE).then(|| {
                        self.request_body_mode = proto::BODY_NONE;
                        proto::mode(proto::BODY_NONE, self.response_body_mode)
                    });
                Ok((Response::RequestHeaders(proto::identity_encoding()), mode))
            }
            HeadDecision::Refuse(refusal) => Ok((refuse(&refusal), None)),
            HeadDecision::Read if h.end_of_stream => {
                // No body will come: judge the empty body now.
                self.request = RequestState::Done;
                match self.guard.check_body(Bytes::new()) {
                    BodyDecision::Forward { granted } => {
                        self.granted = granted;
                        Ok((Response::RequestHeaders(proto::identity_encoding()), None))
                    }
                    BodyDecision::Refuse(refusal) => Ok((refuse(&refusal), None)),
                    BodyDecision::Splice { .. } => Err(Status::internal(
                        "the guard spliced a request that has no body",
                    )),
                }
            }
            HeadDecision::Read => {
                if self.request_body_mode != proto::BODY_BUFFERED {
                    // Only a whole body can be judged; a request that cannot be judged must not
                    // reach the upstream (failure_mode_allow: false turns this into a 500).
                    return Err(Status::failed_precondition(
                        "request_body_mode must be BUFFERED for the JSON guard",
                    ));
                }
                self.request = RequestState::ReadBody {
                    has_length: headers.contains_key(header::CONTENT_LENGTH),
                };
                Ok((Response::RequestHeaders(proto::identity_encoding()), None))
            }
        }
    }

    fn request_body(&mut self, b: HttpBody) -> Result<Response, Status> {
        let has_length = match self.request {
            RequestState::ReadBody { has_length } => has_length,
            // A body the guard does not read (Envoy sends it when the mode was not overridden).
            RequestState::Done => return Ok(Response::RequestBody(proto::unchanged_body())),
            // A body whose headers were never judged (request headers not sent to the
            // processor): it cannot be judged as a whole, so it must not reach the upstream.
            RequestState::Start => {
                return Err(Status::failed_precondition(
                    "a request body before its headers: request_header_mode must be SEND",
                ))
            }
        };
        // BUFFERED: this message holds the whole body (end_of_stream is false only when
        // trailers follow it). A body over the guard's cap is refused with 413.
        self.request = RequestState::Done;
        match self.guard.check_body(Bytes::from(b.body)) {
            BodyDecision::Forward { granted } => {
                self.granted = granted;
                Ok(Response::RequestBody(proto::unchanged_body()))
            }
            BodyDecision::Splice { body, granted } => {
                self.granted = granted;
                let headers = has_length.then(|| HeaderMutation {
                    set_headers: vec![proto::set_header(
                        "content-length",
                        body.len().to_string().as_bytes(),
                    )],
                    remove_headers: Vec::new(),
                });
                Ok(Response::RequestBody(proto::replace_body(
                    body.to_vec(),
                    headers,
                )))
            }
            BodyDecision::Refuse(refusal) => Ok(refuse(&refusal)),
        }
    }

    fn response_headers(
        &mut self,
        h: HttpHeaders,
    ) -> Result<(Response, Option<ProcessingMode>), Status> {
        if self.response_headers {
            return Err(Status::failed_precondition(
                "a second response headers message on one stream",
            ));
        }
        self.response_headers = true;
        let (headers, status) = proto::to_header_map(h.headers.as_ref(), ":status");
        let status = status
            .and_then(|s| StatusCode::from_bytes(&s).ok())
            .ok_or_else(|| Status::invalid_argument("response headers without a valid :status"))?;
        if h.end_of_stream {
            return Ok((Response::ResponseHeaders(proto::unchanged_headers()), None));
        }
        match self
            .layer
            .response_filter(&self.method, status, &headers, &self.granted)
        {
            Some(filter) => {
                self.filter = Some(filter);
                let response = if headers.contains_key(header::CONTENT_LENGTH) {
                    proto::remove_headers(&["content-length"])
                } else {
                    proto::unchanged_headers()
                };
                // The body must come to the processor, chunk by chunk: STREAMED is asked for on
                // every filtered response, whatever mode Envoy announced (an Envoy older than
                // 1.34 announces none, and a configuration with NONE would send no body). It rides
                // on this answer, so it costs no message.
                self.response_body_mode = proto::BODY_STREAMED;
                let mode = proto::mode(self.request_body_mode, proto::BODY_STREAMED);
                Ok((Response::ResponseHeaders(response), Some(mode)))
            }
            None => {
                // Passed through untouched: stop the body messages (one message per response).
                let mode = (self.response_body_mode != proto::BODY_NONE).then(|| {
                    self.response_body_mode = proto::BODY_NONE;
                    proto::mode(self.request_body_mode, proto::BODY_NONE)
                });
                Ok((Response::ResponseHeaders(proto::unchanged_headers()), mode))
            }
        }
    }

    fn response_body(&mut self, b: HttpBody) -> Result<BodyResponse, Status> {
        let Some(filter) = self.filter.as_mut() else {
            if !self.response_headers {
                // A body whose headers were never judged (response headers not sent to the
                // processor): whether it is an event stream is unknown, so nothing of it may
                // reach the client unjudged.
                return Err(Status::failed_precondition(
                    "a response body before its headers: response_header_mode must be SEND",
                ));
            }
            return Ok(proto::unchanged_body());
        };
        let input = Bytes::from(b.body);
        // The answer owns the bytes it sends back: one buffer per changed chunk.
        let mut out = Vec::new();
        let unchanged = drive(filter, &input, b.end_of_stream, &mut out)?;
        if b.end_of_stream {
            self.filter = None;
        }
        if unchanged {
            return Ok(proto::unchanged_body());
        }
        Ok(proto::replace_body(out, None))
    }
}

fn refuse(refusal: &Refusal) -> Response {
    Response::ImmediateResponse(proto::immediate(refusal))
}

/// Pushes `input` through the filter (and finishes it at the end of the stream). Returns true when
/// the filter forwards exactly `input` (the chunk goes on unchanged and `out` is left empty);
/// otherwise the bytes to forward are in `out`.
fn drive(
    filter: &mut EventStreamFilter,
    input: &Bytes,
    end: bool,
    out: &mut Vec<u8>,
) -> Result<bool, Status> {
    out.clear();
    // Outputs that are consecutive slices of `input` from its start are not copied unless
    // something else follows.
    let mut covered = 0usize;
    let mut copied = false;
    let mut take = |data: Bytes, out: &mut Vec<u8>| {
        if !copied
            && data.as_ptr() == input.as_ptr().wrapping_add(covered)
            && covered + data.len() <= input.len()
        {
            covered += data.len();
        } else {
            if !copied {
                out.extend_from_slice(&input[..covered]);
                copied = true;
            }
            out.extend_from_slice(&data);
        }
    };
    if !input.is_empty() {
        filter.push(input.clone());
        loop {
            match filter.poll_output().map_err(too_large)? {
                FilterOutput::Data(data) => take(data, out),
                FilterOutput::NeedInput => break,
                FilterOutput::End => return Err(Status::internal("filter ended before its input")),
            }
        }
    }
    if end {
        filter.finish();
        loop {
            match filter.poll_output().map_err(too_large)? {
                FilterOutput::Data(data) => take(data, out),
                FilterOutput::End => break,
                FilterOutput::NeedInput => {
                    return Err(Status::internal("filter asked for input after finish"))
                }
            }
        }
    }
    if !copied {
        if covered == input.len() {
            return Ok(true);
        }
        out.extend_from_slice(&input[..covered]);
    }
    Ok(false)
}

fn too_large(err: crate::FrameTooLarge) -> Status {
    Status::resource_exhausted(err.to_string())
}
