use std::fmt;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures_core::Stream;
use tonic::{Status, Streaming};

use super::answer_times::{AnswerClock, MessageKind};
use super::connection::Origin;
use super::exchange::ExtProcExchange;
use super::proto;

/// The processor's side of one `Process` call: one response for each message Envoy sends, in
/// order, computed as the message arrives (no task, no channel, no queue).
///
/// Made by [`ExtProc`](super::ExtProc) for each gRPC stream. It ends when Envoy closes its side
/// or resets the stream, and after the one error that fails the stream (see the
/// [module docs](super) for when that happens).
pub struct ProcessStream {
    inbound: Streaming<ProcessingRequest>,
    exchange: ExtProcExchange,
    origin: Origin,
    clock: Option<AnswerClock>,
    done: bool,
}

impl ProcessStream {
    pub(crate) fn new(
        inbound: Streaming<ProcessingRequest>,
        exchange: ExtProcExchange,
        origin: Origin,
        clock: Option<AnswerClock>,
    ) -> Self {
        Self {
            inbound,
            exchange,
            origin,
            clock,
            done: false,
        }
    }
}

impl Stream for ProcessStream {
    type Item = Result<ProcessingResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        AnswerClock::polled(this.clock.as_mut());
        loop {
            if this.done {
                return Poll::Ready(None);
            }
            // Answers owed for the last message (a full-duplex body released in chunks).
            if let Some(answer) = this.exchange.queued() {
                return Poll::Ready(Some(Ok(answer)));
            }
            let inbound = &mut this.inbound;
            let next = AnswerClock::poll(this.clock.as_mut(), cx, |cx| {
                Pin::new(inbound).poll_next(cx)
            });
            match ready!(next) {
                // Envoy closed its side (the HTTP stream is over): nothing more to answer.
                None => {
                    this.done = true;
                }
                // A message tonic could not read (over the decoding limit, compressed, cut
                // short, undecodable) or a broken call: fail the call. A clean end would tell
                // Envoy to go on without the processor, past a body nobody judged.
                Some(Err(status)) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(status)));
                }
                Some(Ok(msg)) => {
                    // The exchange fails every message in observability mode.
                    let observed = msg.observability_mode;
                    let kind = MessageKind::of(&msg);
                    match proto::admit(&msg).and_then(|()| this.exchange.answer(msg)) {
                        Err(status) => {
                            if observed {
                                this.origin.observability_mode();
                            }
                            this.done = true;
                            return Poll::Ready(Some(Err(status)));
                        }
                        Ok(Some(response)) => {
                            AnswerClock::answered(this.clock.as_ref(), kind);
                            return Poll::Ready(Some(Ok(response)));
                        }
                        Ok(None) => {}
                    }
                }
            }
        }
    }
}

impl fmt::Debug for ProcessStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessStream")
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}
