//! How long the processor takes to answer each of Envoy's messages: [`AnswerTimes`] hears it, per
//! [`MessageKind`], from an [`AnswerClock`] on each stream.

use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ext_proc::v3::{processing_request, ProcessingRequest};

/// Hears how long the processor took to answer each message ([`ExtProc::answer_times`]);
/// `bypass-marker ext-proc` makes a histogram of it.
///
/// [`ExtProc::answer_times`]: super::ExtProc::answer_times
pub trait AnswerTimes: Send + Sync + 'static {
    /// A message of kind `message` was answered `elapsed` after its last bytes reached the
    /// stream (see [`ExtProc::answer_times`] for what the span covers).
    ///
    /// [`ExtProc::answer_times`]: super::ExtProc::answer_times
    fn answered(&self, message: MessageKind, elapsed: Duration);
}

/// The kind of message Envoy sent: the part of the HTTP exchange it carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MessageKind {
    /// The request's headers.
    RequestHeaders,
    /// The request's body (whole in `BUFFERED`, a chunk in `FULL_DUPLEX_STREAMED`).
    RequestBody,
    /// The request's trailers.
    RequestTrailers,
    /// The response's headers.
    ResponseHeaders,
    /// A chunk of the response's body.
    ResponseBody,
    /// The response's trailers.
    ResponseTrailers,
}

impl MessageKind {
    /// Every kind, in the order of an exchange.
    pub const ALL: [MessageKind; 6] = [
        Self::RequestHeaders,
        Self::RequestBody,
        Self::RequestTrailers,
        Self::ResponseHeaders,
        Self::ResponseBody,
        Self::ResponseTrailers,
    ];

    /// The kind's name, as ext_proc's `ProcessingRequest` spells its field: `request_headers`,
    /// `request_body`, ...
    pub fn as_str(self) -> &'static str {
        match self {
            Self::RequestHeaders => "request_headers",
            Self::RequestBody => "request_body",
            Self::RequestTrailers => "request_trailers",
            Self::ResponseHeaders => "response_headers",
            Self::ResponseBody => "response_body",
            Self::ResponseTrailers => "response_trailers",
        }
    }

    /// The kind of `msg`; `None` for a message that carries no HTTP part.
    pub(crate) fn of(msg: &ProcessingRequest) -> Option<Self> {
        use processing_request::Request;
        Some(match msg.request.as_ref()? {
            Request::RequestHeaders(_) => Self::RequestHeaders,
            Request::RequestBody(_) => Self::RequestBody,
            Request::RequestTrailers(_) => Self::RequestTrailers,
            Request::ResponseHeaders(_) => Self::ResponseHeaders,
            Request::ResponseBody(_) => Self::ResponseBody,
            Request::ResponseTrailers(_) => Self::ResponseTrailers,
        })
    }
}

/// Times one stream's answers for an [`AnswerTimes`]: the stream's inbound side is polled with
/// a waker of its own, which notes when the HTTP/2 connection woke the stream with new bytes
/// before it wakes the stream's task; a message is timed from the wake that brought the bytes
/// the poll read (so the wait for the task to run counts, as it does for Envoy).
pub(crate) struct AnswerClock {
    times: Arc<dyn AnswerTimes>,
    woken: Arc<Woken>,
    waker: Waker,
    /// The wake that led to the poll running now (at first, when the stream began).
    since: Instant,
}

#[derive(Default)]
struct Woken {
    inner: Mutex<(Option<Instant>, Option<Waker>)>,
}

impl Wake for Woken {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let waker = {
            let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            inner.0.get_or_insert_with(Instant::now);
            inner.1.clone()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

impl AnswerClock {
    pub(crate) fn new(times: Arc<dyn AnswerTimes>) -> Self {
        let woken = Arc::new(Woken::default());
        Self {
            times,
            waker: Waker::from(woken.clone()),
            woken,
            // Made when the stream's headers arrived: the first message, which comes with them,
            // is timed from then (no wake comes before the stream's first poll).
            since: Instant::now(),
        }
    }

    /// A poll of the stream begins: the first wake since the last poll is what the messages it
    /// reads are timed from. A poll no wake led to (the one after an answer was handed over)
    /// reads bytes that came since the last wake at the latest: they keep its time.
    pub(crate) fn polled(clock: Option<&mut Self>) {
        let Some(clock) = clock else { return };
        let mut inner = clock.woken.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(at) = inner.0.take() {
            clock.since = at;
        }
    }

    /// Polls the inbound side, with the clock's waker (which wakes `cx`'s) if there is a clock.
    pub(crate) fn poll<T>(
        clock: Option<&mut Self>,
        cx: &mut Context<'_>,
        poll: impl FnOnce(&mut Context<'_>) -> Poll<T>,
    ) -> Poll<T> {
        let Some(clock) = clock else {
            return poll(cx);
        };
        {
            let mut inner = clock.woken.inner.lock().unwrap_or_else(|e| e.into_inner());
            if !inner.1.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                inner.1 = Some(cx.waker().clone());
            }
        }
        poll(&mut Context::from_waker(&clock.waker))
    }

    /// A message of kind `kind` was answered now.
    pub(crate) fn answered(clock: Option<&Self>, kind: Option<MessageKind>) {
        if let (Some(clock), Some(kind)) = (clock, kind) {
            clock.times.answered(kind, clock.since.elapsed());
        }
    }
}
