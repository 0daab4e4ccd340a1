//! The proxy's HTTP/1.1 client to its one upstream: a pool of connections, the request written,
//! the response head parsed (httparse), and a response body ([`UpstreamResponseBody`]) that reads
//! the upstream's socket itself, in the task of the client connection that streams it.
//!
//! Why not hyper's client: it decodes each chunk of a `chunked` body on the upstream connection's
//! own task and hands it over a channel, one chunk per frame, one wake-up and one hand-over per
//! chunk. An upstream under load writes many events per TCP segment (TCP coalesces whenever the
//! reader lags), and the proxy then paid per event what Envoy pays per read (issue 24:
//! 4.1x Envoy's CPU per event with coalesced writes). Here one read from the upstream becomes one
//! frame: its chunks are decoded in place ([`chunked`]), the layer scans it, hyper writes it.
//!
//! What the proxy promises is kept:
//!
//! - **No frame is held back**: a body yields what each read decoded, at once.
//! - **A complete frame is written before the next read**: after yielding data the body returns
//!   `Pending` once (waking itself), so hyper writes before the body reads the socket again.
//! - **Reads batch under load, not frames**: a read that empties the socket and finds several
//!   chunks in it marks the thread, which then waits `--read-coalesce` before it sleeps on its
//!   sockets ([`before_park`]), so the next reads bring more; nothing already read waits.
//! - **Backpressure**: the body reads only when hyper asks for a frame, and hyper asks only while
//!   the client takes bytes; a client that stops reading stops the upstream's reads, and
//!   `--write-timeout` ends it.
//! - **Cancellation**: dropping a body before its end closes its upstream connection, so the
//!   upstream stops generating. A connection goes back to the pool only after a complete response
//!   with nothing after it, to an upstream that did not ask to close.
//! - **Fail closed**: a body the upstream ends early (a closed connection before the
//!   `Content-Length` or the last chunk) or frames wrongly is an error, which hyper turns into an
//!   aborted response (no terminal chunk): the client never sees a cut stream as a complete one.
//!   So is a pause in the body past the idle timeout ([`Client::idle_timeout`]).
//! - **Early answers**: a response head that comes before the request body's end is the response,
//!   and the body goes on being sent while it streams (RFC 9112 section 9.6, as hyper does),
//!   unless it is a final error that closes the connection (the upstream will not read on).
//! - **Timeouts named for what they time**: the response timeout ([`Client::response_timeout`])
//!   starts at the request's last byte; a slow upload that keeps moving is never cut by it.
//!
//! The parts, each in its own file: [`pool`] (idle connections), [`request`] (the request
//! written), [`reading`] (the connection's read buffer), [`head`] (the response head parsed and
//! its body's framing), [`body`] (the response body read), [`connection`] (the connection a body
//! reads, whole or while its request is still being sent), [`chunked`] (the decoder).

mod body;
pub(crate) mod chunked;
mod connection;
mod head;
mod pool;
mod reading;
mod request;
#[cfg(test)]
mod tests;

use std::fmt;
use std::io;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Response};
use http_body::Body;
use http_body_util::BodyExt as _;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::TcpStream;

use crate::args::Upstream;
pub use body::UpstreamResponseBody;
pub(crate) use chunked::ChunkedError;
use connection::{Connection, Upload};
use head::Framing;
pub use head::HeadRefusal;
use pool::Pool;
pub(crate) use reading::before_park;
use reading::Reading;
use request::{request_head, send_body, write_all};
use tower_bypass_marker::BoxError;

/// A request body of a known length up to this is sent in one write with its head, and the
/// request can be retried on a fresh connection when a pooled one turns out closed.
const BUFFERED_BODY: u64 = 64 * 1024;

/// Why a request got no response head.
#[derive(Debug)]
pub(crate) enum SendError {
    /// Connecting failed or timed out.
    Connect(io::Error),
    /// The request's body failed (the client's side: a stall, a reset).
    RequestBody(BoxError),
    /// The upstream failed after the request was sent and before its head was complete: an I/O
    /// error, an early close, or a head that is not HTTP/1.
    BeforeHead(io::Error),
    /// No response head within the response timeout of the request's end, or a write of the
    /// request that made no progress for as long (see [`Client::response_timeout`]).
    Timeout(Duration),
}

impl fmt::Display for SendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The cause is the error's source.
        f.write_str(match self {
            Self::Connect(_) => "connecting failed",
            Self::RequestBody(_) => "the request body failed",
            Self::BeforeHead(_) => "no response head",
            Self::Timeout(_) => "the upstream did not answer in time",
        })
    }
}

impl std::error::Error for SendError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Connect(err) | Self::BeforeHead(err) => Some(err),
            Self::RequestBody(err) => Some(err.as_ref()),
            Self::Timeout(_) => None,
        }
    }
}

fn invalid(why: impl Into<BoxError>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why)
}

/// What a response body calls when its idle timeout runs out.
type OnExpiry = Arc<dyn Fn() + Send + Sync>;

/// The client of one upstream, with its pool of idle connections.
pub(crate) struct Client {
    upstream: Upstream,
    connect_timeout: Duration,
    response_timeout: Option<Duration>,
    idle_timeout: Option<Duration>,
    on_idle_timeout: Option<OnExpiry>,
    pool: Arc<Pool>,
}

impl Client {
    /// A client of `upstream`; at most `max_idle` connections wait in its pool. Within a tokio
    /// runtime, a task closes each idle connection when it has waited 30 s (`IDLE_FOR`), requests
    /// or not, for as long as the client lives.
    pub(crate) fn new(upstream: Upstream, connect_timeout: Duration, max_idle: usize) -> Self {
        let pool = Arc::new(Pool {
            idle: Mutex::new(Vec::new()),
            max_idle,
        });
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(Pool::sweep(Arc::downgrade(&pool)));
        }
        Self {
            upstream,
            connect_timeout,
            response_timeout: None,
            idle_timeout: None,
            on_idle_timeout: None,
            pool,
        }
    }

    /// How long the upstream may take to answer (none by default): the clock starts once the
    /// whole request is sent, and stops at the response head (or when a head comes before the
    /// request's end). While the request is being sent, a write that makes no progress for as
    /// long fails the same way: a slow client's upload is bounded by the client's own timeouts,
    /// not by this one, however long it takes.
    pub(crate) fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = Some(timeout);
        self
    }

    /// The longest pause between two reads of a response body (none by default, `ZERO` for
    /// none): past it the body fails with [`io::ErrorKind::TimedOut`] (a cut stream, never a
    /// complete one), its connection is closed, and `on_expiry` is called.
    pub(crate) fn idle_timeout(
        mut self,
        timeout: Duration,
        on_expiry: impl Fn() + Send + Sync + 'static,
    ) -> Self {
        self.idle_timeout = Some(timeout).filter(|t| !t.is_zero());
        self.on_idle_timeout = Some(Arc::new(on_expiry));
        self
    }

    async fn connect(&self) -> Result<TcpStream, SendError> {
        let authority = &self.upstream.authority;
        let addr = match authority.port_u16() {
            Some(_) => authority.as_str().to_owned(),
            None => format!("{authority}:80"),
        };
        let io = match tokio::time::timeout(self.connect_timeout, TcpStream::connect(addr)).await {
            Ok(Ok(io)) => io,
            Ok(Err(err)) => return Err(SendError::Connect(err)),
            Err(_) => {
                return Err(SendError::Connect(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no connection within {:?}", self.connect_timeout),
                )))
            }
        };
        io.set_nodelay(true).map_err(SendError::Connect)?;
        Ok(io)
    }

    /// Sends the request (`parts` carry the path to ask for in their URI, and the headers to send
    /// as they are, but for the body's framing) and reads the response head.
    pub(crate) async fn send<B>(
        &self,
        parts: &http::request::Parts,
        body: B,
    ) -> Result<Response<UpstreamResponseBody>, SendError>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let mut head = request_head(parts);
        let known = body.size_hint().exact().filter(|&n| n <= BUFFERED_BODY);
        if let Some(len) = known {
            let mut body = std::pin::pin!(body);
            // Small and of a known length (every body the guard rewrote): sent with the head.
            if len > 0 || !matches!(parts.method, Method::GET | Method::HEAD) {
                head.extend_from_slice(format!("content-length: {len}\r\n").as_bytes());
            }
            head.extend_from_slice(b"\r\n");
            let start = head.len();
            while let Some(frame) = body.as_mut().frame().await {
                let frame = frame.map_err(|err| SendError::RequestBody(err.into()))?;
                if let Some(data) = frame.data_ref() {
                    head.extend_from_slice(data);
                }
            }
            if (head.len() - start) as u64 != len {
                return Err(SendError::RequestBody(
                    "the request body's length differs from its Content-Length".into(),
                ));
            }
            // A pooled connection the upstream closed just now fails before any byte of a
            // response: the same bytes go again on a new connection, once.
            if let Some(io) = self.pool.checkout() {
                match self
                    .exchange(io, &head, parts, idempotent(&parts.method))
                    .await
                {
                    Err(Retry::Again) => {}
                    Err(Retry::No(err)) => return Err(err),
                    Ok(res) => return Ok(res),
                }
            }
            let io = self.connect().await?;
            return self
                .exchange(io, &head, parts, false)
                .await
                .map_err(Retry::into_error);
        }
        let io = match self.pool.checkout() {
            Some(io) => io,
            None => self.connect().await?,
        };
        let declared = body.size_hint().exact();
        match declared {
            None => head.extend_from_slice(b"transfer-encoding: chunked\r\n\r\n"),
            Some(len) => {
                head.extend_from_slice(format!("content-length: {len}\r\n\r\n").as_bytes())
            }
        }
        let mut read = Reading::default();
        let (mut reader, mut writer) = io.into_split();
        let stall = self.response_timeout;
        // The body is sent in a future of its own, which a task takes over when the upstream
        // answers before the body's end and reads on.
        let mut sending = Box::pin(async move {
            let body = std::pin::pin!(body);
            let sent = send_body(&mut writer, &head, body, declared, stall).await;
            (writer, sent)
        });
        // The response head is read while the body is sent: an upstream may answer (a 413, a
        // 401, or a 200 that streams while it reads the rest) before it has read the whole body.
        let (head, sent) = {
            let reading = read.head(&mut reader, &parts.method);
            tokio::pin!(reading);
            tokio::select! {
                biased;
                head = &mut reading => (head, Sent::Early),
                (writer, sent) = &mut sending => match sent {
                    Ok(()) => (self.in_time(reading).await?, Sent::Whole(writer)),
                    // The upstream stopped taking the body: it may have answered first.
                    Err(SendError::BeforeHead(err)) => match self.in_time(reading).await? {
                        Ok(head) => (Ok(head), Sent::Stopped),
                        Err(_) => return Err(SendError::BeforeHead(err)),
                    },
                    Err(err) => return Err(err),
                },
            }
        };
        let (res, mut framing) = head.map_err(|(err, _)| SendError::BeforeHead(err))?;
        let io = match sent {
            Sent::Whole(writer) => {
                Connection::Whole(reader.reunite(writer).expect("the halves of one stream"))
            }
            Sent::Stopped => {
                framing.reusable = false;
                Connection::Half(reader, None)
            }
            // An answer before the request's end: RFC 9112 section 9.6 (and hyper) stop sending
            // only when the server will not read the rest, a final error that closes the
            // connection; otherwise the body goes on (an upstream may stream its answer while
            // it reads), in a task, while the response body is read.
            Sent::Early if !res.status().is_success() && framing.close => {
                // The rest of the request body is never sent: the connection cannot carry
                // another.
                framing.reusable = false;
                Connection::Half(reader, None)
            }
            Sent::Early => Connection::Half(reader, Some(Upload(tokio::spawn(sending)))),
        };
        Ok(res.map(|()| self.body(io, read, framing)))
    }

    /// `head` within the response timeout, if there is one.
    async fn in_time<F: std::future::Future>(&self, head: F) -> Result<F::Output, SendError> {
        match self.response_timeout {
            None => Ok(head.await),
            Some(limit) => tokio::time::timeout(limit, head)
                .await
                .map_err(|_| SendError::Timeout(limit)),
        }
    }

    /// The body of a response whose head was read from `io`.
    fn body(&self, io: Connection, read: Reading, framing: Framing) -> UpstreamResponseBody {
        let idle = self
            .idle_timeout
            .map(|timeout| (timeout, self.on_idle_timeout.clone()));
        UpstreamResponseBody::new(io, read, framing, &self.pool, idle)
    }

    /// Writes `request` (head and body) on `io` and reads the response head. `retry`: whether a
    /// close before any byte of a response may be retried (the request may have been processed).
    async fn exchange(
        &self,
        mut io: TcpStream,
        request: &[u8],
        parts: &http::request::Parts,
        retry: bool,
    ) -> Result<Response<UpstreamResponseBody>, Retry> {
        let mut read = Reading::default();
        let written = match write_all(&mut io, request, self.response_timeout).await {
            Err(SendError::BeforeHead(err)) => Err(err),
            Err(err) => return Err(Retry::No(err)),
            Ok(()) => Ok(()),
        };
        let head = self
            .in_time(read.head(&mut io, &parts.method))
            .await
            .map_err(Retry::No)?;
        let whole = written.is_ok();
        let (res, mut framing) = match (written, head) {
            (Ok(()), head) => head.map_err(|(err, got)| Retry::before_response(err, got, retry))?,
            // Not taken whole: the upstream had answered, or closed the connection.
            (Err(_), Ok(head)) => head,
            (Err(err), Err(_)) => return Err(Retry::before_response(err, 0, true)),
        };
        framing.reusable &= whole;
        Ok(res.map(|()| self.body(Connection::Whole(io), read, framing)))
    }
}

/// How far a streamed request body got when the response head came.
enum Sent {
    /// All of it: the write half, to make the connection whole again.
    Whole(OwnedWriteHalf),
    /// The head came first: the body is still being sent.
    Early,
    /// The upstream stopped taking it.
    Stopped,
}

/// Whether a request may be sent twice (RFC 9110 section 9.2.2): a request that a pooled
/// connection's close cut off is retried only then, or if it was not written.
fn idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

/// Whether a request that failed on a pooled connection goes again on a new one.
enum Retry {
    Again,
    No(SendError),
}

impl Retry {
    /// Again when `retry` and the connection was closed or reset before any byte of a response
    /// came.
    fn before_response(err: io::Error, got: usize, retry: bool) -> Self {
        let closed = matches!(
            err.kind(),
            io::ErrorKind::UnexpectedEof
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::BrokenPipe
                | io::ErrorKind::ConnectionAborted
        );
        if retry && closed && got == 0 {
            Self::Again
        } else {
            Self::No(SendError::BeforeHead(err))
        }
    }

    fn into_error(self) -> SendError {
        match self {
            Self::Again => SendError::BeforeHead(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the upstream closed the connection before answering",
            )),
            Self::No(err) => err,
        }
    }
}

/// Without the optional whitespace (space, tab) around a list element.
pub(crate) fn trim_ows(mut bytes: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = bytes {
        bytes = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = bytes {
        bytes = rest;
    }
    bytes
}
