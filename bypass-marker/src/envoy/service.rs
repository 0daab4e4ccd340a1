use std::convert::Infallible;
use std::fmt;
use std::future::{ready, Ready};
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use http::{HeaderMap, HeaderValue};
use http_body::{Body, Frame};
use pin_project_lite::pin_project;
use prost::Message;
use tonic::server::NamedService;
use tonic::Status;

use super::answer_times::{AnswerClock, MessageKind};
use super::connection::Origin;
use super::exchange::ExtProcExchange;
use super::{proto, ExtProc};

/// The path of the one method, `envoy.service.ext_proc.v3.ExternalProcessor/Process`.
const PROCESS: &str = "/envoy.service.ext_proc.v3.ExternalProcessor/Process";

/// gRPC's message prefix: a compression flag and a big-endian length.
const PREFIX: usize = 5;

/// Messages up to this size share the stream's buffer; larger ones (buffered request bodies)
/// leave it.
const SMALL: usize = 64 << 10;

/// [`ExtProc`] as the `envoy.service.ext_proc.v3.ExternalProcessor` service of a tonic server,
/// made by [`ExtProc::into_service`].
///
/// It gives the same answers, from the same per-stream state, as the tonic-generated
/// `ExternalProcessorServer<ExtProc>`, but reads and writes the gRPC messages of a `Process` call
/// itself (a 5-byte prefix each): every message Envoy sends is decoded as soon as its last byte
/// is in, and its answer is the next frame of the response body. That leaves out tonic's
/// per-message streaming adapters (`Streaming`, `EncodeBody`), which cost about a fifth of the
/// processor's CPU per streamed chunk in `envoy_bench` (BENCHMARKS.md as of 05c9ef8, "Envoy with
/// the external processor"); tonic still serves the connection, HTTP/2 and the routing. A call it cannot
/// read fails with a status, never a clean end (which would let Envoy go on without the
/// processor): compressed messages with `UNIMPLEMENTED` (Envoy sends none), a message over the
/// processor's limit with `RESOURCE_EXHAUSTED` (judged on its prefix), bytes that are no
/// `ProcessingRequest` or a request that ends inside a message with `INTERNAL`; other methods
/// get `UNIMPLEMENTED`.
///
/// In a server of your own, the `error` line about Envoy's `observability_mode` (see the
/// [module docs](super)) is logged once per processor rather than once per connection: tonic
/// gives the service nothing per connection to remember it by, unlike [`serve`](super::serve).
///
/// ```
/// use bypass_marker::envoy::ExtProc;
/// use tower_bypass_marker::BypassMarkerLayer;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
/// let server = tonic::transport::Server::builder()
///     .add_service(ExtProc::new(BypassMarkerLayer::dynamo()).into_service())
///     .serve_with_incoming_shutdown(
///         tonic::transport::server::TcpIncoming::from(listener),
///         async {}, // your shutdown signal
///     );
/// server.await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct ExtProcService {
    processor: ExtProc,
}

impl ExtProcService {
    pub(crate) fn new(processor: ExtProc) -> Self {
        Self { processor }
    }
}

impl NamedService for ExtProcService {
    const NAME: &'static str = "envoy.service.ext_proc.v3.ExternalProcessor";
}

impl<B> tower_service::Service<http::Request<B>> for ExtProcService
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: fmt::Display,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if request.uri().path() != PROCESS {
            return ready(Ok(Status::unimplemented("").into_http()));
        }
        if let Some(encoding) = request.headers().get("grpc-encoding") {
            if encoding != "identity" {
                let message = format!(
                    "compressed messages are not supported ({}): send them uncompressed",
                    String::from_utf8_lossy(encoding.as_bytes())
                );
                return ready(Ok(Status::unimplemented(message).into_http()));
            }
        }
        let answers = Answers {
            origin: self.processor.origin(request.extensions()),
            inbound: request.into_body(),
            exchange: self.processor.exchange(),
            max_message: self.processor.max_message_bytes(),
            pending: BytesMut::new(),
            skip: 0,
            clock: self.processor.answer_clock(),
            done: false,
        };
        let mut response = http::Response::new(tonic::body::Body::new(answers));
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/grpc"),
        );
        ready(Ok(response))
    }
}

impl fmt::Debug for ExtProcService {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExtProcService")
            .field("processor", &self.processor)
            .finish()
    }
}

pin_project! {
    /// The response body of one `Process` call: an answer for each message of the request body,
    /// in order, then the call's status as trailers.
    struct Answers<B> {
        #[pin]
        inbound: B,
        exchange: ExtProcExchange,
        // Where the one observability-mode line per connection is logged.
        origin: Origin,
        max_message: usize,
        // Bytes of messages not yet complete.
        pending: BytesMut,
        // Bytes still to come of a message refused before it was complete, dropped as they come.
        skip: usize,
        // Times the answers, if the processor's are timed.
        clock: Option<AnswerClock>,
        done: bool,
    }
}

/// What the next complete message in `pending` is.
enum Next {
    /// Not all of it is in yet.
    Incomplete,
    Message(Bytes),
}

fn next_message(pending: &mut BytesMut, max: usize) -> Result<Next, Status> {
    if pending.len() < PREFIX {
        return Ok(Next::Incomplete);
    }
    let compressed = pending[0];
    let len = u32::from_be_bytes([pending[1], pending[2], pending[3], pending[4]]) as usize;
    if compressed != 0 {
        return Err(Status::unimplemented(format!(
            "compressed messages are not supported (flag {compressed})"
        )));
    }
    if len > max {
        return Err(Status::resource_exhausted(format!(
            "message of {len} bytes, the limit is {max} bytes"
        )));
    }
    // The buffer grows with what arrives (amortised doubling: linear in the message), not with
    // what the prefix announces, so a prefix alone reserves nothing.
    if pending.len() < PREFIX + len {
        return Ok(Next::Incomplete);
    }
    pending.advance(PREFIX);
    let message = pending.split_to(len).freeze();
    if len > SMALL {
        // The rest would keep the large allocation alive (and reuse it) for the whole stream:
        // move it to a buffer of its own, so the allocation goes once the message is decoded.
        *pending = BytesMut::from(&pending[..]);
    }
    Ok(Next::Message(message))
}

/// The bytes still to come of the message that starts `pending`: 0 until its prefix is in, and
/// for a message over `max` (which [`next_message`] refuses).
fn rest_of_message(pending: &BytesMut, max: usize) -> usize {
    if pending.len() < PREFIX {
        return 0;
    }
    let len = u32::from_be_bytes([pending[1], pending[2], pending[3], pending[4]]) as usize;
    if len > max {
        return 0;
    }
    (PREFIX + len).saturating_sub(pending.len())
}

fn framed(answer: &ProcessingResponse) -> Result<Bytes, Status> {
    let len = answer.encoded_len();
    // A spliced request body that gRPC's 4-byte length cannot carry (a `max_body_bytes` near
    // 4 GiB): fail the call rather than corrupt the framing.
    let prefix = u32::try_from(len).map_err(|_| {
        Status::resource_exhausted(format!(
            "an answer of {len} bytes does not fit a gRPC message"
        ))
    })?;
    let mut out = BytesMut::with_capacity(PREFIX + len);
    out.put_u8(0);
    out.put_u32(prefix);
    answer
        .encode(&mut out)
        .expect("the buffer was sized by encoded_len");
    Ok(out.freeze())
}

/// What one poll of the answers gives: a gRPC frame (a message, or the status as trailers), the
/// end, or nothing yet.
type NextFrame = Poll<Option<Result<Frame<Bytes>, Status>>>;

/// The last frame of a call: its status as trailers.
fn end(done: &mut bool, status: &Status) -> NextFrame {
    *done = true;
    let mut map = HeaderMap::with_capacity(2);
    if status.add_header(&mut map).is_err() {
        map.insert("grpc-status", HeaderValue::from(status.code() as i32));
    }
    Poll::Ready(Some(Ok(Frame::trailers(map))))
}

impl<B> Body for Answers<B>
where
    B: Body<Data = Bytes>,
    B::Error: fmt::Display,
{
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> NextFrame {
        let mut this = self.project();
        AnswerClock::polled(this.clock.as_mut());
        loop {
            if *this.done {
                return Poll::Ready(None);
            }
            // A request body the guard reads, arriving: its bytes are charged as they come; past
            // the budget the 503 goes at once, and the rest of the message is dropped as it comes.
            let rest = rest_of_message(this.pending, *this.max_message);
            if rest > 0 {
                if let Some(refusal) = this.exchange.receiving(this.pending.len()) {
                    *this.skip = rest;
                    *this.pending = BytesMut::new();
                    return match framed(&refusal) {
                        Ok(bytes) => {
                            AnswerClock::answered(
                                this.clock.as_ref(),
                                Some(MessageKind::RequestBody),
                            );
                            Poll::Ready(Some(Ok(Frame::data(bytes))))
                        }
                        Err(status) => end(this.done, &status),
                    };
                }
            }
            let message = match next_message(this.pending, *this.max_message) {
                Ok(Next::Message(message)) => message,
                Ok(Next::Incomplete) => match AnswerClock::poll(this.clock.as_mut(), cx, |cx| {
                    this.inbound.as_mut().poll_frame(cx)
                }) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Some(Ok(frame))) => {
                        if let Ok(mut data) = frame.into_data() {
                            let dropped = data.len().min(*this.skip);
                            *this.skip -= dropped;
                            data.advance(dropped);
                            this.pending.extend_from_slice(&data);
                        }
                        continue;
                    }
                    // Envoy closed its side: the HTTP stream is over.
                    Poll::Ready(None) if this.pending.is_empty() && *this.skip == 0 => {
                        return end(this.done, &Status::ok(""))
                    }
                    Poll::Ready(None) => {
                        return end(
                            this.done,
                            &Status::internal("the stream ended inside a message"),
                        )
                    }
                    // Envoy reset the call: nobody reads the status, but it is not a clean end.
                    Poll::Ready(Some(Err(err))) => {
                        return end(
                            this.done,
                            &Status::cancelled(format!("the call broke: {err}")),
                        )
                    }
                },
                Err(status) => return end(this.done, &status),
            };
            this.exchange.received(this.pending.len());
            let msg = match ProcessingRequest::decode(message) {
                Ok(msg) => msg,
                Err(err) => {
                    let status = Status::internal(format!("undecodable message: {err}"));
                    return end(this.done, &status);
                }
            };
            // The exchange fails every message in observability mode.
            let observed = msg.observability_mode;
            let kind = MessageKind::of(&msg);
            let answer = proto::admit(&msg)
                .and_then(|()| this.exchange.answer(msg))
                .and_then(|answer| answer.map(|answer| framed(&answer)).transpose())
                .and_then(|first| match (first, this.exchange.queued()) {
                    (Some(first), Some(next)) => {
                        // Several answers for one message (a full-duplex body released in
                        // chunks): one frame with all of them, in order.
                        let mut all = BytesMut::from(&first[..]);
                        all.extend_from_slice(&framed(&next)?);
                        while let Some(next) = this.exchange.queued() {
                            all.extend_from_slice(&framed(&next)?);
                        }
                        Ok(Some(all.freeze()))
                    }
                    (first, _) => Ok(first),
                });
            match answer {
                Ok(Some(bytes)) => {
                    AnswerClock::answered(this.clock.as_ref(), kind);
                    return Poll::Ready(Some(Ok(Frame::data(bytes))));
                }
                Ok(None) => {}
                Err(status) => {
                    if observed {
                        this.origin.observability_mode();
                    }
                    return end(this.done, &status);
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefixed(flag: u8, message: &[u8]) -> BytesMut {
        let mut out = BytesMut::new();
        out.put_u8(flag);
        out.put_u32(message.len() as u32);
        out.extend_from_slice(message);
        out
    }

    #[test]
    fn a_message_is_taken_only_once_all_of_it_is_in() {
        let whole = prefixed(0, b"abcdef");
        for cut in 0..whole.len() {
            let mut pending = BytesMut::from(&whole[..cut]);
            assert!(matches!(
                next_message(&mut pending, 64),
                Ok(Next::Incomplete)
            ));
            pending.extend_from_slice(&whole[cut..]);
            let Ok(Next::Message(message)) = next_message(&mut pending, 64) else {
                panic!("cut at {cut}")
            };
            assert_eq!(&message[..], b"abcdef");
            assert!(pending.is_empty());
        }
    }

    #[test]
    fn a_large_message_leaves_the_rest_in_a_buffer_of_its_own() {
        let mut pending = prefixed(0, &vec![7; SMALL + 1]);
        pending.extend_from_slice(&prefixed(0, b"next")[..3]);
        let Ok(Next::Message(message)) = next_message(&mut pending, 1 << 20) else {
            panic!()
        };
        assert_eq!(message.len(), SMALL + 1);
        assert_eq!(&pending[..], &prefixed(0, b"next")[..3]);
        // Not the tail of the message's allocation (which would start where the message ends).
        assert_ne!(
            pending.as_ptr(),
            message.as_ptr().wrapping_add(message.len())
        );
    }

    #[test]
    fn two_messages_in_one_chunk_come_out_one_after_the_other() {
        let mut pending = prefixed(0, b"one");
        pending.extend_from_slice(&prefixed(0, b""));
        pending.extend_from_slice(&prefixed(0, b"three"));
        let mut seen = Vec::new();
        while let Ok(Next::Message(message)) = next_message(&mut pending, 64) {
            seen.push(message);
        }
        assert_eq!(seen, [&b"one"[..], b"", b"three"]);
    }

    #[test]
    fn compressed_and_oversized_messages_fail_the_call() {
        let err = next_message(&mut prefixed(1, b"x"), 64).err().unwrap();
        assert_eq!(err.code(), tonic::Code::Unimplemented);
        // Judged on the prefix alone: nothing of the body is buffered first.
        let mut head = prefixed(0, &[0; 65]);
        head.truncate(PREFIX);
        let err = next_message(&mut head, 64).err().unwrap();
        assert_eq!(err.code(), tonic::Code::ResourceExhausted);
        // A prefix within the limit reserves nothing before the bytes arrive.
        let mut head = prefixed(0, &[0; 1 << 20]);
        head.truncate(PREFIX);
        let capacity = head.capacity();
        assert!(matches!(
            next_message(&mut head, 2 << 20),
            Ok(Next::Incomplete)
        ));
        assert_eq!(head.capacity(), capacity);
        assert!(matches!(
            next_message(&mut prefixed(0, &[0; 64]), 64),
            Ok(Next::Message(_))
        ));
    }

    #[test]
    fn an_answer_is_framed_with_its_length() {
        let answer = ProcessingResponse::default();
        assert_eq!(&framed(&answer).unwrap()[..], &[0, 0, 0, 0, 0]);
        let answer = ProcessingResponse {
            response: Some(
                envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response::ResponseBody(
                    Default::default(),
                ),
            ),
            ..Default::default()
        };
        let bytes = framed(&answer).unwrap();
        let len = u32::from_be_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]) as usize;
        assert_eq!(bytes.len(), PREFIX + len);
        assert_eq!(
            ProcessingResponse::decode(&bytes[PREFIX..]).unwrap(),
            answer
        );
    }
}
