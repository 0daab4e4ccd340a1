//! The processor's state for one gRPC stream (one HTTP request), sans-IO: a `ProcessingRequest`
//! in, the `ProcessingResponse` to send back (or the error that fails the stream) out.

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::ProcessingMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request, processing_response::Response, BodyResponse, HeaderMutation,
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, TrailersResponse,
};
use http::{Method, StatusCode};
use tonic::Status;

use super::proto;
use crate::budget::Charge;
use tower_bypass_marker::sans_io::{
    BodyStep, ChunkEdit, ExchangeError, GatewayExchange, Refusal, RequestGuard, RequestStep,
    ResponseStep, UnseenRequest,
};
use tower_bypass_marker::BypassMarkerLayer;

/// One HTTP request through Envoy's external processing filter: the shared
/// [`GatewayExchange`] state machine, spoken in ext_proc's messages.
pub(crate) struct ExtProcExchange {
    exchange: GatewayExchange,
    /// Body modes Envoy announced in `protocol_config` (first message), else the documented
    /// configuration's (BUFFERED, STREAMED).
    request_body_mode: i32,
    response_body_mode: i32,
    /// Envoy announced its body modes (Envoy 1.34 and later do, in the first message).
    announced: bool,
    /// What to forward for the response chunk at hand; reused.
    edit: ChunkEdit,
    /// The request body bytes this stream holds, as a share of the processor's budget: those
    /// still arriving ([`receiving`](Self::receiving)), the full-duplex chunks held, a buffered
    /// body while it is judged. Never a declared length: Envoy holds a buffered body until it
    /// sends it.
    charge: Charge,
    /// The guard reads the request body and has not judged it yet: its bytes are charged as they
    /// arrive. A body the guard does not read passes uncharged.
    reading: bool,
    /// Bytes of the next message that the transport holds, not yet complete, while `reading`.
    incoming: u64,
    /// `FULL_DUPLEX_STREAMED` request body the guard reads: the chunks so far, held until the
    /// body ends (nothing of it goes upstream before the guard has judged all of it).
    held: Option<Vec<Bytes>>,
    held_len: usize,
    /// A `FULL_DUPLEX_STREAMED` request body message came (so its end must be answered).
    request_body_seen: bool,
    /// Answers owed after the one [`answer`](Self::answer) returned (a full-duplex body released
    /// in several chunks, then the trailers' answer).
    queued: VecDeque<ProcessingResponse>,
}

/// The largest body chunk sent back in one `FULL_DUPLEX_STREAMED` answer, as Envoy recommends.
const STREAMED_CHUNK: usize = 64 << 10;

impl ExtProcExchange {
    pub(crate) fn new(layer: &BypassMarkerLayer, guard: RequestGuard, charge: Charge) -> Self {
        Self {
            // Request headers that never came mean `request_header_mode: SKIP`: the guard did
            // not run, so the response is failed rather than passed as if all were well.
            exchange: GatewayExchange::new(layer, guard, UnseenRequest::Fail),
            request_body_mode: proto::BODY_BUFFERED,
            response_body_mode: proto::BODY_STREAMED,
            announced: false,
            edit: ChunkEdit::new(),
            charge,
            reading: false,
            incoming: 0,
            held: None,
            held_len: 0,
            request_body_seen: false,
            queued: VecDeque::new(),
        }
    }

    /// The request body bytes this stream holds now, with `judging` more (a buffered body being
    /// judged): the incoming bytes of a body being read and the full-duplex chunks held.
    fn holding(&self, judging: u64) -> u64 {
        let incoming = if self.reading { self.incoming } else { 0 };
        let held = if self.held.is_some() {
            self.held_len as u64
        } else {
            0
        };
        incoming.saturating_add(held).saturating_add(judging)
    }

    /// Brings the stream's charge to what it holds with `judging` more; `false` (the charge left
    /// as it was) when that would take the bodies held past the budget.
    fn hold(&mut self, judging: u64) -> bool {
        self.charge.set(self.holding(judging))
    }

    /// Gives back what the stream no longer holds (never takes more).
    fn settle(&mut self) {
        let now = self.holding(0);
        if now < self.charge.held() {
            self.charge.set(now);
        }
    }

    /// The request body is refused for the budget: nothing of it is held any more, the refusal
    /// is counted (and logged at most once a minute), and the client gets the 503 with
    /// `Retry-After`, as from the sidecar.
    fn over_budget(&mut self) -> Response {
        self.reading = false;
        self.incoming = 0;
        self.held = None;
        self.held_len = 0;
        self.charge.release();
        let budget = self.charge.budget();
        if let Some(n) = budget.refusal() {
            tracing::warn!(
                "503: {n} request(s) refused since the last line: the request bodies held would \
                 pass the processor's budget ({} bytes, --max-buffered-bytes)",
                budget.limit()
            );
        }
        Response::ImmediateResponse(proto::over_budget())
    }

    /// The transport holds `n` bytes of a message that is not complete yet. While the guard reads
    /// the request body they are charged to the budget (the message is that body, or a chunk of
    /// it); past the budget the answer to send at once is the 503 (the transport then drops the
    /// rest of the message as it comes, unread). Other messages are not charged.
    pub(crate) fn receiving(&mut self, n: usize) -> Option<ProcessingResponse> {
        if !self.reading {
            return None;
        }
        self.incoming = n as u64;
        if self.hold(0) {
            return None;
        }
        Some(ProcessingResponse {
            response: Some(self.over_budget()),
            ..ProcessingResponse::default()
        })
    }

    /// A message is complete and about to be [`answer`](Self::answer)ed; the transport holds
    /// `remaining` bytes of the next one. The charge stays until the answer: the message's
    /// bytes have moved into it, and the answer charges what it holds.
    pub(crate) fn received(&mut self, remaining: usize) {
        self.incoming = remaining as u64;
    }

    /// The next answer owed for the last message, after the one [`answer`](Self::answer)
    /// returned: the callers send them, in order, before reading the next message.
    pub(crate) fn queued(&mut self) -> Option<ProcessingResponse> {
        self.queued.pop_front()
    }

    /// Envoy streams this direction's body in `FULL_DUPLEX_STREAMED`: every body message is
    /// answered with a `streamed_response` (Envoy forwards only what comes back).
    fn duplex_request(&self) -> bool {
        self.request_body_mode == proto::BODY_FULL_DUPLEX
    }

    fn duplex_response(&self) -> bool {
        self.response_body_mode == proto::BODY_FULL_DUPLEX
    }

    /// A `mode_override` may be sent: not when a direction is `FULL_DUPLEX_STREAMED`, whose mode
    /// cannot be changed mid-stream (Envoy ignores or refuses it), so every message is answered
    /// instead.
    fn overrides(&self) -> bool {
        !self.duplex_request() && !self.duplex_response()
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
        let answer = self.on_message(msg);
        self.settle();
        answer
    }

    fn on_message(&mut self, msg: ProcessingRequest) -> Result<Option<ProcessingResponse>, Status> {
        if let Some(config) = msg.protocol_config {
            for (direction, mode) in [
                ("request_body_mode", config.request_body_mode),
                ("response_body_mode", config.response_body_mode),
            ] {
                // GRPC (gRPC messages, not bytes) and modes newer than this build: nothing in
                // them could be judged.
                if !(proto::BODY_NONE..=proto::BODY_FULL_DUPLEX).contains(&mode) {
                    return Err(Status::failed_precondition(format!(
                        "{direction} {} is not supported: use BUFFERED or FULL_DUPLEX_STREAMED \
                         for requests, STREAMED or FULL_DUPLEX_STREAMED for responses",
                        proto::mode_name(mode)
                    )));
                }
            }
            self.request_body_mode = config.request_body_mode;
            self.response_body_mode = config.response_body_mode;
            self.announced = true;
        }
        let Some(request) = msg.request else {
            return Ok(None);
        };
        let (response, mode_override) = match request {
            Request::RequestHeaders(h) => self.request_headers(h)?,
            Request::RequestBody(b) if self.duplex_request() => {
                self.duplex_request_body(b)?;
                return Ok(self.queued.pop_front());
            }
            Request::RequestBody(b) => (self.request_body(b)?, None),
            Request::RequestTrailers(_) if self.duplex_request() => {
                self.duplex_request_end(false)?;
                self.queue(Response::RequestTrailers(TrailersResponse::default()));
                return Ok(self.queued.pop_front());
            }
            Request::RequestTrailers(_) => {
                (Response::RequestTrailers(TrailersResponse::default()), None)
            }
            Request::ResponseHeaders(h) => self.response_headers(h)?,
            Request::ResponseBody(b) if self.duplex_response() => {
                (Response::ResponseBody(self.duplex_response_body(b)?), None)
            }
            Request::ResponseBody(b) => (Response::ResponseBody(self.response_body(b)?), None),
            Request::ResponseTrailers(_) if self.duplex_response() => {
                self.duplex_response_end()?;
                self.queue(Response::ResponseTrailers(TrailersResponse::default()));
                return Ok(self.queued.pop_front());
            }
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
                // would otherwise hit Envoy's buffer limit and be refused with 413). In full
                // duplex the chunks are answered as they come instead.
                let mode = (!h.end_of_stream
                    && self.request_body_mode != proto::BODY_NONE
                    && self.overrides())
                .then(|| {
                    self.request_body_mode = proto::BODY_NONE;
                    proto::mode(proto::BODY_NONE, self.response_body_mode)
                });
                Ok((Response::RequestHeaders(proto::identity_encoding()), mode))
            }
            RequestStep::Refuse(refusal) => Ok((refuse(&refusal), None)),
            RequestStep::ReadBody => {
                if self.duplex_request() {
                    // The chunks are held until the body ends, then judged whole.
                    self.held = Some(Vec::new());
                } else if self.request_body_mode != proto::BODY_BUFFERED {
                    // Only a whole body can be judged; a request that cannot be judged must not
                    // reach the upstream (failure_mode_allow: false turns this into a 500).
                    return Err(Status::failed_precondition(format!(
                        "request_body_mode {} cannot be judged: the JSON guard needs BUFFERED or \
                         FULL_DUPLEX_STREAMED",
                        proto::mode_name(self.request_body_mode)
                    )));
                }
                // The body's bytes are charged as they arrive, not when they are declared: Envoy
                // holds a buffered body, not the processor, and a client that declares a length
                // and sends nothing must not keep anyone else's body out. Only a declared length
                // the budget could never hold is refused at once, before Envoy buffers it (one
                // over the guard's cap gets the 413 when it comes, unread).
                let declared = headers
                    .get(http::header::CONTENT_LENGTH)
                    .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
                    .filter(|&n| n <= self.exchange.max_request_body() as u64);
                self.reading = true;
                if declared.is_some_and(|n| !self.charge.budget().fits(n)) {
                    return Ok((self.over_budget(), None));
                }
                Ok((Response::RequestHeaders(proto::identity_encoding()), None))
            }
            // A step added in a later version of the library: fail closed.
            _ => Err(Status::internal("a step this processor does not know")),
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
        // Only a body the guard reads is charged: one it forwards unread (Envoy sends it when
        // no mode override could stop it) goes back at once.
        if self.reading && !self.hold(b.body.len() as u64) {
            return Ok(self.over_budget());
        }
        let step = self.exchange.request_body(Bytes::from(b.body), whole);
        // Judged: the body (and the spliced one) are let go when this message is answered.
        self.reading = false;
        self.charge.release();
        match step.map_err(status)? {
            BodyStep::Forward => Ok(Response::RequestBody(proto::unchanged_body())),
            BodyStep::Replace {
                body,
                set_content_length,
                ..
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
            // A step added in a later version of the library: fail closed.
            _ => Err(Status::internal("a step this processor does not know")),
        }
    }

    fn queue(&mut self, response: Response) {
        self.queued.push_back(ProcessingResponse {
            response: Some(response),
            ..ProcessingResponse::default()
        });
    }

    /// A request body chunk in `FULL_DUPLEX_STREAMED`: held while the guard reads the body (a
    /// body over its cap is refused with 413 at once), judged at its end; a body the guard does
    /// not read goes back as it came.
    fn duplex_request_body(&mut self, b: HttpBody) -> Result<(), Status> {
        self.request_body_seen = true;
        let Some(held) = &mut self.held else {
            // Not read (or already judged): only an error matters here, for a body before its
            // headers.
            let _forward = self
                .exchange
                .request_body(Bytes::new(), b.end_of_stream)
                .map_err(status)?;
            self.queue(Response::RequestBody(proto::streamed(
                b.body,
                b.end_of_stream,
            )));
            return Ok(());
        };
        self.held_len = self.held_len.saturating_add(b.body.len());
        let max = self.exchange.max_request_body();
        if self.held_len > max {
            self.held = None;
            self.reading = false;
            self.charge.release();
            self.queue(refuse(&Refusal::too_large(max)));
            return Ok(());
        }
        if !b.body.is_empty() {
            held.push(Bytes::from(b.body));
        }
        // The chunks held so far count against the processor's budget, as a buffered body does.
        if !self.hold(0) {
            let refusal = self.over_budget();
            self.queue(refusal);
            return Ok(());
        }
        if b.end_of_stream {
            self.duplex_request_end(true)?;
        }
        Ok(())
    }

    /// The end of a `FULL_DUPLEX_STREAMED` request body (its last chunk, or the trailers after
    /// it): the held body is judged, then sent on in chunks of at most 64 KiB, the last one with
    /// `end_of_stream` unless trailers follow; or the refusal is sent instead.
    fn duplex_request_end(&mut self, end_of_stream: bool) -> Result<(), Status> {
        let Some(chunks) = self.held.take() else {
            return Ok(());
        };
        self.reading = false;
        let body = match chunks.len() {
            1 => chunks.into_iter().next().expect("one chunk"),
            _ => {
                let mut all = BytesMut::with_capacity(self.held_len);
                for chunk in &chunks {
                    all.extend_from_slice(chunk);
                }
                all.freeze()
            }
        };
        // The body is whole (its end, or trailers after it); content-length is Envoy's to drop
        // in this mode (it does, for every streamed body mutation).
        let step = self.exchange.request_body(body.clone(), true);
        // Judged: the held chunks are let go as their answers are queued.
        self.charge.release();
        let pieces = match step.map_err(status)? {
            BodyStep::Forward => vec![body],
            BodyStep::Replace { body, .. } => body.into_chunks().to_vec(),
            BodyStep::Refuse(refusal) => {
                self.queue(refuse(&refusal));
                return Ok(());
            }
            // A step added in a later version of the library: fail closed.
            _ => return Err(Status::internal("a step this processor does not know")),
        };
        if !self.request_body_seen {
            // Trailers right after the headers: no body message to answer.
            return Ok(());
        }
        let mut out: Vec<Bytes> = Vec::new();
        for mut piece in pieces {
            while !piece.is_empty() {
                out.push(piece.split_to(piece.len().min(STREAMED_CHUNK)));
            }
        }
        if out.is_empty() {
            out.push(Bytes::new());
        }
        let last = out.len() - 1;
        for (i, chunk) in out.into_iter().enumerate() {
            self.queue(Response::RequestBody(proto::streamed(
                chunk.to_vec(),
                end_of_stream && i == last,
            )));
        }
        Ok(())
    }

    /// A response body chunk in `FULL_DUPLEX_STREAMED`: answered at once with what the filter
    /// forwards for it (its complete frames), or the chunk itself for a response passed through.
    fn duplex_response_body(&mut self, b: HttpBody) -> Result<BodyResponse, Status> {
        let input = b.body;
        if !self.exchange.filters_response() {
            self.exchange
                .response_body(&[], b.end_of_stream, &mut self.edit)
                .map_err(status)?;
            return Ok(proto::streamed(input, b.end_of_stream));
        }
        self.exchange
            .response_body(&[&input[..]], b.end_of_stream, &mut self.edit)
            .map_err(status)?;
        let out = if self.edit.input_len() == input.len() && self.edit.is_unchanged() {
            input
        } else {
            self.edit.to_vec(&[&input[..]])
        };
        Ok(proto::streamed(out, b.end_of_stream))
    }

    /// Response trailers in `FULL_DUPLEX_STREAMED`: the body has ended, so a frame still open is
    /// judged as it stands and what of it goes on is sent before the trailers' answer.
    fn duplex_response_end(&mut self) -> Result<(), Status> {
        if !self.exchange.filters_response() {
            return Ok(());
        }
        self.exchange
            .response_body(&[], true, &mut self.edit)
            .map_err(status)?;
        let rest = self.edit.to_vec(&[]);
        if !rest.is_empty() {
            self.queue(Response::ResponseBody(proto::streamed(rest, false)));
        }
        Ok(())
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
                ..
            } => {
                let response = if remove_content_length {
                    proto::remove_headers(&["content-length"])
                } else {
                    proto::unchanged_headers()
                };
                if !self.overrides() {
                    // With a FULL_DUPLEX_STREAMED direction no mode can be switched: the body
                    // must come in a mode that can be filtered chunk by chunk.
                    return match self.response_body_mode {
                        proto::BODY_STREAMED | proto::BODY_FULL_DUPLEX => {
                            Ok((Response::ResponseHeaders(response), None))
                        }
                        other => Err(Status::failed_precondition(format!(
                            "response_body_mode {} cannot filter an event stream here (a \
                             FULL_DUPLEX_STREAMED direction rules out a mode override): use \
                             STREAMED or FULL_DUPLEX_STREAMED",
                            proto::mode_name(other)
                        ))),
                    };
                }
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
                // In full duplex every chunk is answered with itself instead.
                let mode =
                    (self.response_body_mode != proto::BODY_NONE && self.overrides()).then(|| {
                        self.response_body_mode = proto::BODY_NONE;
                        proto::mode(self.request_body_mode, proto::BODY_NONE)
                    });
                Ok((Response::ResponseHeaders(proto::unchanged_headers()), mode))
            }
            // A step added in a later version of the library: fail closed.
            _ => Err(Status::internal("a step this processor does not know")),
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

/// Issue 48 at the processor: a response the upstream framed with a transfer coding other than
/// `chunked`, and an event-stream head on a response without content followed by a body, played
/// message by message as Envoy sends them, and the answers applied as Envoy applies them.
#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::config::core::v3::{HeaderMap as ProtoHeaderMap, HeaderValue};
    use envoy_types::pb::envoy::service::ext_proc::v3::{
        body_mutation::Mutation, HeadersResponse, ProtocolConfiguration,
    };

    use super::*;
    use crate::budget::BodyBudget;

    const MARKER: &[u8] = b"event: x-bypass-remote-prefill\n: true\n\n";
    const DATA: &[u8] = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n";

    fn exchange() -> ExtProcExchange {
        let layer = BypassMarkerLayer::dynamo();
        ExtProcExchange::new(
            &layer,
            layer.request_guard(),
            BodyBudget::unlimited().charge(),
        )
    }

    fn headers(entries: &[(&str, &str)], end_of_stream: bool) -> HttpHeaders {
        HttpHeaders {
            headers: Some(ProtoHeaderMap {
                headers: entries
                    .iter()
                    .map(|(key, value)| HeaderValue {
                        key: (*key).to_owned(),
                        value: String::new(),
                        raw_value: value.as_bytes().to_vec(),
                    })
                    .collect(),
            }),
            end_of_stream,
            ..HttpHeaders::default()
        }
    }

    fn message(request: Request, duplex: bool) -> ProcessingRequest {
        ProcessingRequest {
            request: Some(request),
            protocol_config: duplex.then(|| ProtocolConfiguration {
                request_body_mode: proto::BODY_FULL_DUPLEX,
                response_body_mode: proto::BODY_FULL_DUPLEX,
                ..ProtocolConfiguration::default()
            }),
            ..ProcessingRequest::default()
        }
    }

    fn answer(x: &mut ExtProcExchange, request: Request, duplex: bool) -> ProcessingResponse {
        x.answer(message(request, duplex))
            .expect("an answer, not a failed stream")
            .expect("an answer to a message with an HTTP part")
    }

    /// The request side, passed: a POST naming `annotations` (the body read whole), or a HEAD.
    fn request(x: &mut ExtProcExchange, method: &str, annotations: &str, duplex: bool) {
        if method == "HEAD" {
            let h = headers(&[(":method", "HEAD"), (":path", "/v1/models")], true);
            answer(x, Request::RequestHeaders(h), duplex);
            return;
        }
        let body = format!(r#"{{"stream":true,"nvext":{{"annotations":{annotations}}}}}"#);
        let length = body.len().to_string();
        let h = headers(
            &[
                (":method", method),
                (":path", "/v1/chat/completions"),
                ("content-type", "application/json"),
                ("content-length", &length),
            ],
            false,
        );
        answer(x, Request::RequestHeaders(h), duplex);
        let b = HttpBody {
            body: body.into_bytes(),
            end_of_stream: true,
            ..HttpBody::default()
        };
        let a = answer(x, Request::RequestBody(b), duplex);
        assert!(
            matches!(a.response, Some(Response::RequestBody(_))),
            "{a:?}"
        );
    }

    /// What Envoy forwards of a response chunk, given the processor's answer to it.
    fn forwarded(input: &[u8], a: &ProcessingResponse) -> Vec<u8> {
        let Some(Response::ResponseBody(body)) = &a.response else {
            panic!("not a body answer: {a:?}");
        };
        let Some(common) = &body.response else {
            return input.to_vec();
        };
        match common
            .body_mutation
            .as_ref()
            .and_then(|m| m.mutation.as_ref())
        {
            None => input.to_vec(),
            Some(Mutation::Body(bytes)) => bytes.clone(),
            Some(Mutation::StreamedResponse(streamed)) => streamed.body.clone(),
            Some(other) => panic!("a body mutation Envoy would not forward: {other:?}"),
        }
    }

    #[test]
    fn an_event_stream_with_a_transfer_coding_other_than_chunked_gets_the_502_before_any_byte() {
        for duplex in [false, true] {
            for annotations in ["[]", r#"["x-bypass-remote-prefill","request_id"]"#] {
                let mut x = exchange();
                request(&mut x, "POST", annotations, duplex);
                let h = headers(
                    &[
                        (":status", "200"),
                        ("content-type", "text/event-stream"),
                        ("transfer-encoding", "gzip, chunked"),
                    ],
                    false,
                );
                let a = answer(&mut x, Request::ResponseHeaders(h), duplex);
                let Some(Response::ImmediateResponse(reply)) = &a.response else {
                    panic!("{duplex} {annotations}: not a local reply: {a:?}");
                };
                assert_eq!(reply.status.as_ref().map(|s| s.code), Some(502));
                let error: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
                assert_eq!(error["error"]["code"], "encoded_event_stream");
                let message = error["error"]["message"].as_str().unwrap();
                assert!(
                    message.starts_with(
                        "the event stream has transfer-encoding gzip, which cannot be filtered"
                    ),
                    "{message}"
                );
                // Envoy sends the local reply instead: no byte of the stream goes out, and
                // nothing is left to filter.
                assert!(!x.exchange.filters_response());
            }
        }
    }

    #[test]
    fn the_body_of_an_event_stream_head_without_content_is_dropped_whole_headers_kept() {
        let cases = [("POST", "204"), ("POST", "304"), ("HEAD", "200")];
        for duplex in [false, true] {
            for (method, status) in cases {
                for annotations in ["[]", r#"["x-bypass-remote-prefill","request_id"]"#] {
                    let what = format!("{method} {status} {annotations} duplex {duplex}");
                    let mut x = exchange();
                    request(&mut x, method, annotations, duplex);
                    let h = headers(
                        &[
                            (":status", status),
                            ("content-type", "text/event-stream"),
                            ("content-length", "1234"),
                        ],
                        false,
                    );
                    let a = answer(&mut x, Request::ResponseHeaders(h), duplex);
                    // Headers kept, content-length included: no mutation at all.
                    assert_eq!(
                        a.response,
                        Some(Response::ResponseHeaders(HeadersResponse {
                            response: None
                        })),
                        "{what}"
                    );
                    // The body still comes to the processor, chunk by chunk.
                    if !duplex {
                        let mode = a.mode_override.as_ref().expect("a mode override");
                        assert_eq!(mode.response_body_mode, proto::BODY_STREAMED, "{what}");
                    }
                    let chunks: [&[u8]; 3] = [&[MARKER, DATA].concat(), MARKER, b"data: [DONE]"];
                    let mut client = Vec::new();
                    for (i, chunk) in chunks.iter().enumerate() {
                        let b = HttpBody {
                            body: chunk.to_vec(),
                            end_of_stream: i == chunks.len() - 1,
                            ..HttpBody::default()
                        };
                        let a = answer(&mut x, Request::ResponseBody(b), duplex);
                        client.extend(forwarded(chunk, &a));
                    }
                    assert!(client.is_empty(), "{what}: {client:?}");
                }
            }
        }
    }
}
