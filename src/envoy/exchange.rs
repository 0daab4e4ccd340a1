//! The processor's state for one gRPC stream (one HTTP request), sans-IO: a `ProcessingRequest`
//! in, the `ProcessingResponse` to send back (or the error that fails the stream) out.

use bytes::Bytes;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::ProcessingMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request, processing_response::Response, BodyResponse, HeaderMutation,
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, TrailersResponse,
};
use http::{Method, StatusCode};
use tonic::Status;

use super::proto;
use crate::json::{
    self, BodyStep, ExchangeError, Refusal, RequestStep, ResponseStep, UnseenRequest,
};
use crate::{BypassMarkerLayer, ChunkEdit};

/// One HTTP request through Envoy's external processing filter: the shared
/// [`json::Exchange`] state machine, spoken in ext_proc's messages.
pub(crate) struct Exchange {
    exchange: json::Exchange,
    /// Body modes Envoy announced in `protocol_config` (first message), else the documented
    /// configuration's (BUFFERED, STREAMED).
    request_body_mode: i32,
    response_body_mode: i32,
    /// Envoy announced its body modes (Envoy 1.34 and later do, in the first message).
    announced: bool,
    /// What to forward for the response chunk at hand; reused.
    edit: ChunkEdit,
}

impl Exchange {
    pub(crate) fn new(layer: &BypassMarkerLayer, guard: crate::json::RequestGuard) -> Self {
        Self {
            // Request headers that never came mean `request_header_mode: SKIP`: the guard did
            // not run, so the response is failed rather than passed as if all were well.
            exchange: json::Exchange::new(layer, guard, UnseenRequest::Fail),
            request_body_mode: proto::BODY_BUFFERED,
            response_body_mode: proto::BODY_STREAMED,
            announced: false,
            edit: ChunkEdit::new(),
        }
    }

    /// The answer to one message; `None` for a message that carries no HTTP part (nothing to
    /// answer). `Err`: the stream must fail (Envoy then resets the HTTP stream, or answers 500
    /// before the response started; never a clean end).
    pub(crate) fn answer(
        &mut self,
        msg: ProcessingRequest,
    ) -> Result<Option<ProcessingResponse>, Status> {
        // Envoy ignores answers in observability mode, and has forwarded the request before
        // the processor sees it: nothing would be stripped or filtered. Every stream fails from
        // its first message rather than look as if it protected anything.
        if msg.observability_mode {
            return Err(Status::failed_precondition(
                "observability_mode cannot change requests or responses, so the guard cannot \
                 work: turn it off",
            ));
        }
        self.on_message(msg)
    }

    fn on_message(&mut self, msg: ProcessingRequest) -> Result<Option<ProcessingResponse>, Status> {
        if let Some(config) = msg.protocol_config {
            self.request_body_mode = config.request_body_mode;
            self.response_body_mode = config.response_body_mode;
            self.announced = true;
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
        let (headers, method) = proto::to_header_map(h.headers.as_ref(), ":method");
        let method = match method {
            Some(method) => Method::from_bytes(&method)
                .map_err(|_| Status::invalid_argument("invalid :method"))?,
            None => Method::GET,
        };
        match self
            .exchange
            .request_headers(method, &headers, h.end_of_stream)
            .map_err(status)?
        {
            RequestStep::Forward => {
                // Nothing to read: tell Envoy not to buffer and send the body (a large upload
                // would otherwise hit Envoy's buffer limit and be refused with 413).
                let mode =
                    (!h.end_of_stream && self.request_body_mode != proto::BODY_NONE).then(|| {
                        self.request_body_mode = proto::BODY_NONE;
                        proto::mode(proto::BODY_NONE, self.response_body_mode)
                    });
                Ok((Response::RequestHeaders(proto::identity_encoding()), mode))
            }
            RequestStep::Refuse(refusal) => Ok((refuse(&refusal), None)),
            RequestStep::ReadBody => {
                if self.request_body_mode != proto::BODY_BUFFERED {
                    // Only a whole body can be judged; a request that cannot be judged must not
                    // reach the upstream (failure_mode_allow: false turns this into a 500).
                    return Err(Status::failed_precondition(
                        "request_body_mode must be BUFFERED for the JSON guard",
                    ));
                }
                Ok((Response::RequestHeaders(proto::identity_encoding()), None))
            }
        }
    }

    fn request_body(&mut self, b: HttpBody) -> Result<Response, Status> {
        // BUFFERED: the message holds the whole body. It is the last one, or trailers follow it
        // (end_of_stream false), which only an Envoy that announced BUFFERED is believed on:
        // without the announcement, a body in pieces (a STREAMED configuration) would be judged
        // by its first piece, so the stream fails. A body over the guard's cap is refused with
        // 413.
        let whole =
            b.end_of_stream || (self.announced && self.request_body_mode == proto::BODY_BUFFERED);
        match self
            .exchange
            .request_body(Bytes::from(b.body), whole)
            .map_err(status)?
        {
            BodyStep::Forward => Ok(Response::RequestBody(proto::unchanged_body())),
            BodyStep::Replace {
                body,
                set_content_length,
            } => {
                let headers = set_content_length.then(|| HeaderMutation {
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
            BodyStep::Refuse(refusal) => Ok(refuse(&refusal)),
        }
    }

    fn response_headers(
        &mut self,
        h: HttpHeaders,
    ) -> Result<(Response, Option<ProcessingMode>), Status> {
        let (headers, status_code) = proto::to_header_map(h.headers.as_ref(), ":status");
        let status_code = status_code
            .and_then(|s| StatusCode::from_bytes(&s).ok())
            .ok_or_else(|| Status::invalid_argument("response headers without a valid :status"))?;
        match self
            .exchange
            .response_headers(status_code, &headers, h.end_of_stream)
            .map_err(status)?
        {
            ResponseStep::Filter {
                remove_content_length,
            } => {
                let response = if remove_content_length {
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
            // An encoded event stream with something to remove: a 502 before any byte.
            ResponseStep::Refuse(refusal) => Ok((refuse(&refusal), None)),
            ResponseStep::Pass if h.end_of_stream => {
                Ok((Response::ResponseHeaders(proto::unchanged_headers()), None))
            }
            ResponseStep::Pass => {
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
        if !self.exchange.filters_response() {
            // Passed through (a body Envoy sends when the mode was not overridden), or an error
            // for a body whose headers were never judged.
            self.exchange
                .response_body(&[], b.end_of_stream, &mut self.edit)
                .map_err(status)?;
            return Ok(proto::unchanged_body());
        }
        let input = b.body;
        self.exchange
            .response_body(&[&input[..]], b.end_of_stream, &mut self.edit)
            .map_err(status)?;
        if self.edit.input_len() == input.len() && self.edit.is_unchanged() {
            return Ok(proto::unchanged_body());
        }
        // The answer owns the bytes it sends back: one buffer per changed chunk.
        Ok(proto::replace_body(self.edit.to_vec(&[&input[..]]), None))
    }
}

fn refuse(refusal: &Refusal) -> Response {
    Response::ImmediateResponse(proto::immediate(refusal))
}

/// The status a stream fails with.
fn status(err: ExchangeError) -> Status {
    match err {
        ExchangeError::FrameTooLarge(err) => Status::resource_exhausted(err.to_string()),
        err => Status::failed_precondition(err.to_string()),
    }
}
