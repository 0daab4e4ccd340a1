use std::fmt;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::{
    external_processor_server::ExternalProcessor, ProcessingRequest,
};
use tonic::{Request, Response, Status, Streaming};

use super::answer_times::{AnswerClock, AnswerTimes};
use super::connection::Origin;
use super::exchange::ExtProcExchange;
use super::stream::ProcessStream;
use super::ExtProcService;
use crate::budget::BodyBudget;
use tower_bypass_marker::sans_io::RequestGuard;
use tower_bypass_marker::BypassMarkerLayer;

/// Room for the headers and attributes that come with a request body in one message.
const MESSAGE_OVERHEAD: usize = 1 << 20;

/// The largest response body chunk the processor takes in one message, whatever the guard's
/// limit: Envoy streams a response in chunks of what it read, and with a client slower than the
/// upstream they reach its buffer limit (1 MiB by default), so a small `--max-body` must not cut
/// them (tonic's own default limit).
const RESPONSE_CHUNK_ROOM: usize = 4 << 20;

/// An Envoy external processor (`envoy.service.ext_proc.v3.ExternalProcessor`) that applies a
/// [`BypassMarkerLayer`]'s JSON guard to requests and its filter to responses.
///
/// See the [module docs](super) for the Envoy configuration, what each message does and what
/// happens on failure.
#[derive(Clone)]
pub struct ExtProc {
    layer: BypassMarkerLayer,
    guard: RequestGuard,
    /// The request body bytes every stream of the processor may hold at once.
    budget: BodyBudget,
    /// Whether the observability-mode error was logged, for streams that come on a connection
    /// [`serve`](super::serve) did not accept (shared by the clones).
    observability_logged: Arc<AtomicBool>,
    /// Hears how long each message took to answer ([`ExtProc::answer_times`]).
    answer_times: Option<Arc<dyn AnswerTimes>>,
}

impl ExtProc {
    /// A processor with this layer's names and limits; request bodies up to the guard's default
    /// limit (32 MiB).
    pub fn new(layer: BypassMarkerLayer) -> Self {
        Self {
            guard: layer.request_guard(),
            budget: BodyBudget::unlimited(),
            layer,
            observability_logged: Arc::new(AtomicBool::new(false)),
            answer_times: None,
        }
    }

    /// Tells `times` how long each message took to answer: from the moment the HTTP/2
    /// connection handed the stream the message's last bytes (it woke the stream's task) to the
    /// moment the answer was handed back to it, so the wait for the serving thread counts as
    /// well as the work. Not counted: the time in the sockets and in Envoy, and the HTTP/2
    /// connection's own turn to read and to write. Messages the processor answers with a
    /// failed stream are not timed. Off by default (it costs a clock read and a lock per
    /// wake); `bypass-marker ext-proc` makes the histogram
    /// `bypass_marker_ext_proc_answer_seconds{message}` of it, to size Envoy's
    /// `message_timeout` by (docs/envoy.md).
    #[must_use]
    pub fn answer_times(mut self, times: Arc<dyn AnswerTimes>) -> Self {
        self.answer_times = Some(times);
        self
    }

    /// A clock for one stream's answers, if they are timed.
    pub(crate) fn answer_clock(&self) -> Option<AnswerClock> {
        self.answer_times.clone().map(AnswerClock::new)
    }

    /// Caps the request body the guard reads (default 32 MiB). A larger body is refused with
    /// 413, as the `JsonGuard` layer does. Envoy's own buffer limit applies first: with a lower
    /// one, Envoy answers 413 itself.
    #[must_use]
    pub fn max_body_bytes(mut self, max: usize) -> Self {
        self.guard = self.guard.max_body_bytes(max);
        self
    }

    /// Shares `budget` between the request bodies of every stream (unlimited by default). A body
    /// the guard reads is charged with the bytes the processor holds of it: a buffered body's
    /// message as its bytes arrive and while it is judged, a `FULL_DUPLEX_STREAMED` body's
    /// chunks until its end. A declared `content-length` reserves nothing (Envoy, not the
    /// processor, holds a buffered body until it sends it), and a body the guard does not read
    /// passes uncharged. A body that would take the bytes held past the budget gets a 503 with
    /// `retry-after: 1` (an immediate response: Envoy's local reply, as the sidecar's answer),
    /// at once, before the rest of it is read; so does a declared length the budget could
    /// never hold, at the request headers. The bytes are given back once the body has been
    /// judged, or the stream ends. Envoy's own buffers are bounded by Envoy (see
    /// docs/envoy.md).
    ///
    /// In the tonic-generated `ExternalProcessorServer<ExtProc>`, tonic holds a message until
    /// it is complete: its bytes are charged once it is, not as they arrive.
    ///
    /// `bypass-marker ext-proc` sets it from `--max-buffered-bytes`.
    #[must_use]
    pub fn body_budget(mut self, budget: BodyBudget) -> Self {
        self.budget = budget;
        self
    }

    /// The largest gRPC message the processor accepts: a whole request body (the guard's
    /// limit) or a response chunk of up to 4 MiB, whichever is larger, plus 1 MiB for the
    /// headers that come with it. (With a slow client, Envoy's response chunks grow to its
    /// buffer limit, 1 MiB by default, whatever the guard's limit.) For
    /// `ExternalProcessorServer::new(processor).max_decoding_message_size(..)`;
    /// [`into_service`](Self::into_service) applies it itself.
    pub fn max_message_bytes(&self) -> usize {
        self.guard
            .max_body()
            .max(RESPONSE_CHUNK_ROOM)
            .saturating_add(MESSAGE_OVERHEAD)
    }

    /// The processor as a tonic service, for a `tonic::transport::Server` of your own (add
    /// gRPC health yourself; [`serve`](super::serve) does both).
    ///
    /// This is the service [`serve`](super::serve) runs. `ExtProc` also implements the
    /// tonic-generated `ExternalProcessor` trait, for `ExternalProcessorServer::new(processor)`
    /// with tonic's interceptors or compression; that server gives the same answers at a
    /// higher CPU cost per message (see [`ExtProcService`]). Set its
    /// `max_decoding_message_size` to the guard's limit plus room for the headers, or request
    /// bodies over tonic's default 4 MiB fail.
    pub fn into_service(self) -> ExtProcService {
        ExtProcService::new(self)
    }

    /// A fresh state for one gRPC stream.
    pub(crate) fn exchange(&self) -> ExtProcExchange {
        ExtProcExchange::new(&self.layer, self.guard.clone(), self.budget.charge())
    }

    /// The connection of a stream whose request carries `extensions` (see [`Origin::of`]).
    pub(crate) fn origin(&self, extensions: &http::Extensions) -> Origin {
        Origin::of(extensions, &self.observability_logged)
    }
}

#[tonic::async_trait]
impl ExternalProcessor for ExtProc {
    type ProcessStream = ProcessStream;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<ProcessStream>, Status> {
        let origin = self.origin(request.extensions());
        Ok(Response::new(ProcessStream::new(
            request.into_inner(),
            self.exchange(),
            origin,
            self.answer_clock(),
        )))
    }
}

impl fmt::Debug for ExtProc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExtProc")
            .field("layer", &self.layer)
            .field("max_body_bytes", &self.guard.max_body())
            .finish()
    }
}
