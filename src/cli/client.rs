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
//! - **Backpressure**: the body reads only when hyper asks for a frame, and hyper asks only while
//!   the client takes bytes; a client that stops reading stops the upstream's reads, and
//!   `--write-timeout` ends it.
//! - **Cancellation**: dropping a body before its end closes its upstream connection, so the
//!   upstream stops generating. A connection goes back to the pool only after a complete response
//!   with nothing after it, to an upstream that did not ask to close.
//! - **Fail closed**: a body the upstream ends early (a closed connection before the
//!   `Content-Length` or the last chunk) or frames wrongly is an error, which hyper turns into an
//!   aborted response (no terminal chunk): the client never sees a cut stream as a complete one.

pub(crate) mod chunked;

use std::fmt;
use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Buf as _, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Response, StatusCode, Version};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt as _;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use crate::cli::args::Upstream;
use crate::BoxError;
use chunked::Decoder;

/// The longest response head accepted, and the most header fields.
const MAX_HEAD: usize = 64 * 1024;
const MAX_HEADERS: usize = 128;
/// The room a read asks for starts at `READ_MIN` and doubles, up to `READ_MAX`, each time a read
/// fills it (a busy upstream), halving again when reads bring little: a quiet stream holds a
/// few KiB, not 64.
const READ_MIN: usize = 4 * 1024;
const READ_MAX: usize = 64 * 1024;
/// The most interim (1xx) responses before the final one.
const MAX_INTERIM: usize = 16;
/// A request body of a known length up to this is sent in one write with its head, and the
/// request can be retried on a fresh connection when a pooled one turns out closed.
const BUFFERED_BODY: u64 = 64 * 1024;
/// An idle pooled connection older than this is closed.
const IDLE_FOR: Duration = Duration::from_secs(30);

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
}

impl fmt::Display for SendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The cause is the error's source.
        f.write_str(match self {
            Self::Connect(_) => "connecting failed",
            Self::RequestBody(_) => "the request body failed",
            Self::BeforeHead(_) => "no response head",
        })
    }
}

impl std::error::Error for SendError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Connect(err) | Self::BeforeHead(err) => Some(err),
            Self::RequestBody(err) => Some(err.as_ref()),
        }
    }
}

fn invalid(why: impl Into<BoxError>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why)
}

/// The client of one upstream, with its pool of idle connections.
pub(crate) struct Client {
    upstream: Upstream,
    connect_timeout: Duration,
    pool: Arc<Pool>,
}

/// Idle connections to the upstream, the most recent last.
struct Pool {
    idle: Mutex<Vec<(TcpStream, Instant)>>,
    max_idle: usize,
}

impl Pool {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(TcpStream, Instant)>> {
        // A list of sockets stays consistent whatever panicked while holding it.
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The most recent idle connection that is still open.
    fn checkout(&self) -> Option<TcpStream> {
        let mut idle = self.lock();
        while let Some((io, since)) = idle.pop() {
            if since.elapsed() < IDLE_FOR && is_open(&io) {
                return Some(io);
            }
        }
        None
    }

    fn checkin(&self, io: TcpStream) {
        let mut idle = self.lock();
        Self::expire(&mut idle);
        if idle.len() < self.max_idle {
            idle.push((io, Instant::now()));
        }
    }

    /// Closes the connections idle for `IDLE_FOR` or more: the oldest, at the front.
    fn expire(idle: &mut Vec<(TcpStream, Instant)>) {
        let expired = idle.partition_point(|(_, since)| since.elapsed() >= IDLE_FOR);
        idle.drain(..expired);
    }
}

/// Whether an idle connection is still open with nothing unasked-for to read: the upstream may
/// have closed it while it sat in the pool. A peek at the socket itself, not at the runtime's
/// record of its readiness, which a busy thread updates late.
fn is_open(io: &TcpStream) -> bool {
    #[cfg(unix)]
    {
        use rustix::net::RecvFlags;
        let mut byte = [0; 1];
        matches!(
            rustix::net::recv(io, &mut byte, RecvFlags::PEEK | RecvFlags::DONTWAIT),
            Err(rustix::io::Errno::AGAIN)
        )
    }
    #[cfg(not(unix))]
    {
        let mut byte = [0; 1];
        matches!(io.try_read(&mut byte), Err(err) if err.kind() == io::ErrorKind::WouldBlock)
    }
}

impl Client {
    /// A client of `upstream`; at most `max_idle` connections wait in its pool. Within a tokio
    /// runtime, a task closes the expired idle connections every `IDLE_FOR`, requests or not, for
    /// as long as the client lives.
    pub(crate) fn new(upstream: Upstream, connect_timeout: Duration, max_idle: usize) -> Self {
        let pool = Arc::new(Pool {
            idle: Mutex::new(Vec::new()),
            max_idle,
        });
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let pool = Arc::downgrade(&pool);
            runtime.spawn(async move {
                let mut every = tokio::time::interval(IDLE_FOR);
                every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    every.tick().await;
                    let Some(pool) = pool.upgrade() else { return };
                    Pool::expire(&mut pool.lock());
                }
            });
        }
        Self {
            upstream,
            connect_timeout,
            pool,
        }
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
        B: Body<Data = Bytes>,
        B::Error: Into<BoxError>,
    {
        let mut head = request_head(parts);
        let mut body = std::pin::pin!(body);
        let known = body.size_hint().exact().filter(|&n| n <= BUFFERED_BODY);
        if let Some(len) = known {
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
        let mut io = match self.pool.checkout() {
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
        // The response head is read while the body is sent: an upstream may answer (a 413, a
        // 401) before it has read the whole body, and then stop reading or close.
        let (head, early) = {
            let (reader, mut writer) = io.split();
            let mut reader = reader;
            let reading = read.head(&mut reader, &parts.method);
            let sending = send_body(&mut writer, &head, body, declared);
            tokio::pin!(reading, sending);
            tokio::select! {
                biased;
                head = &mut reading => (head, true),
                sent = &mut sending => match sent {
                    Ok(()) => (reading.await, false),
                    // The upstream stopped taking the body: it may have answered first.
                    Err(SendError::BeforeHead(err)) => match reading.await {
                        Ok(head) => (Ok(head), true),
                        Err(_) => return Err(SendError::BeforeHead(err)),
                    },
                    Err(err) => return Err(err),
                },
            }
        };
        let (res, mut framing) = head.map_err(|(err, _)| SendError::BeforeHead(err))?;
        // The rest of the request body was never sent: the connection cannot carry another.
        framing.reusable &= !early;
        Ok(res.map(|()| UpstreamResponseBody::new(io, read, framing, &self.pool)))
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
        let written = io.write_all(request).await;
        let head = read.head(&mut io, &parts.method).await;
        let whole = written.is_ok();
        let (res, mut framing) = match (written, head) {
            (Ok(()), head) => head.map_err(|(err, got)| Retry::before_response(err, got, retry))?,
            // Not taken whole: the upstream had answered, or closed the connection.
            (Err(_), Ok(head)) => head,
            (Err(err), Err(_)) => return Err(Retry::before_response(err, 0, true)),
        };
        framing.reusable &= whole;
        Ok(res.map(|()| UpstreamResponseBody::new(io, read, framing, &self.pool)))
    }
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

/// The request line and header fields, without the body's framing and the final CRLF.
fn request_head(parts: &http::request::Parts) -> Vec<u8> {
    let mut head = Vec::with_capacity(256 + parts.headers.len() * 32);
    let target = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    head.extend_from_slice(parts.method.as_str().as_bytes());
    head.push(b' ');
    head.extend_from_slice(target.as_bytes());
    head.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in &parts.headers {
        if name == header::CONTENT_LENGTH || name == header::TRANSFER_ENCODING {
            continue;
        }
        head.extend_from_slice(name.as_str().as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(value.as_bytes());
        head.extend_from_slice(b"\r\n");
    }
    head
}

/// Sends the head and then the body of a request whose body is streamed: with
/// `Content-Length: declared`, or chunked when `declared` is `None`. A body that is longer or
/// shorter than it declared fails (it would leave the connection out of step).
async fn send_body<B>(
    io: &mut tokio::net::tcp::WriteHalf<'_>,
    head: &[u8],
    body: Pin<&mut B>,
    declared: Option<u64>,
) -> Result<(), SendError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let mut body = body;
    io.write_all(head).await.map_err(SendError::BeforeHead)?;
    let mut sent = 0u64;
    let mut piece = Vec::new();
    while let Some(frame) = body.as_mut().frame().await {
        let frame = frame.map_err(|err| SendError::RequestBody(err.into()))?;
        let Some(data) = frame.data_ref().filter(|d| !d.is_empty()) else {
            continue;
        };
        sent += data.len() as u64;
        if declared.is_some_and(|len| sent > len) {
            return Err(SendError::RequestBody(
                "the request body is longer than its length".into(),
            ));
        }
        if declared.is_some() {
            io.write_all(data).await.map_err(SendError::BeforeHead)?;
        } else {
            // One write a chunk: size line, data and CRLF.
            piece.clear();
            piece.extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
            piece.extend_from_slice(data);
            piece.extend_from_slice(b"\r\n");
            io.write_all(&piece).await.map_err(SendError::BeforeHead)?;
        }
    }
    match declared {
        Some(len) if sent != len => Err(SendError::RequestBody(
            "the request body is shorter than its length".into(),
        )),
        Some(_) => Ok(()),
        None => io
            .write_all(b"0\r\n\r\n")
            .await
            .map_err(SendError::BeforeHead),
    }
}

/// What has been read from an upstream connection and not yet used, and how much room the next
/// read asks for.
#[derive(Debug)]
struct Reading {
    buf: BytesMut,
    size: usize,
}

impl Default for Reading {
    fn default() -> Self {
        Self {
            buf: BytesMut::new(),
            size: READ_MIN,
        }
    }
}

impl Reading {
    /// Reads into the room left in the buffer (growing it when less than half a read is left):
    /// the number of bytes read, 0 at the end of the stream.
    ///
    /// Through tokio's `AsyncRead`, which takes a read that did not fill the room for the socket
    /// drained: the next read waits for the socket to be readable again instead of trying (and
    /// finding nothing) at once.
    fn poll_fill<R>(&mut self, io: &mut R, cx: &mut Context<'_>) -> Poll<io::Result<usize>>
    where
        R: AsyncRead + Unpin,
    {
        if self.buf.capacity() - self.buf.len() < self.size / 2 {
            self.buf.reserve(self.size);
        }
        let room = self.buf.capacity() - self.buf.len();
        let n = ready!(std::pin::pin!(io.read_buf(&mut self.buf)).poll(cx))?;
        if n == room {
            self.size = (self.size * 2).min(READ_MAX);
        } else if n < self.size / 8 {
            self.size = (self.size / 2).max(READ_MIN);
        }
        Poll::Ready(Ok(n))
    }

    /// Reads the response head (skipping up to `MAX_INTERIM` interim 1xx responses). On
    /// failure, how many bytes had arrived.
    async fn head<R: AsyncRead + Unpin>(
        &mut self,
        io: &mut R,
        method: &Method,
    ) -> Result<(Response<()>, Framing), (io::Error, usize)> {
        let mut got = 0;
        let mut interim = 0;
        // The head is parsed only once its end has arrived, and each byte is looked at for that
        // end once or twice: a head dribbled a byte at a time is not parsed again at every
        // read (quadratic in its length).
        let mut searched: usize = 0;
        loop {
            if !has_head_end(&self.buf, searched.saturating_sub(2)) {
                searched = self.buf.len();
                if self.buf.len() >= MAX_HEAD {
                    return Err((invalid("a response head over 64 KiB"), got));
                }
                let n = std::future::poll_fn(|cx| self.poll_fill(io, cx))
                    .await
                    .map_err(|err| (err, got))?;
                if n == 0 {
                    return Err((
                        io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "the upstream closed the connection before its response head",
                        ),
                        got,
                    ));
                }
                got += n;
                continue;
            }
            let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
            let mut parsed = httparse::Response::new(&mut fields);
            match parsed.parse(&self.buf) {
                Ok(httparse::Status::Complete(len)) => {
                    let code = parsed.code.unwrap_or(0);
                    if (100..200).contains(&code) && code != 101 {
                        // 100 Continue, 103 Early Hints: the final response follows.
                        interim += 1;
                        if interim > MAX_INTERIM {
                            return Err((invalid("more than 16 interim responses"), got));
                        }
                        self.buf.advance(len);
                        searched = 0;
                        continue;
                    }
                    let head = response(&parsed, method).map_err(|err| (err, got))?;
                    self.buf.advance(len);
                    return Ok(head);
                }
                // An empty line that httparse does not take for the head's end.
                Ok(httparse::Status::Partial) => {
                    return Err((invalid("a malformed response head"), got));
                }
                Err(err) => {
                    return Err((invalid(format!("a malformed response head: {err}")), got))
                }
            }
        }
    }
}

/// Whether `buf`, looked at from `from` on, holds the empty line that ends a head: a LF followed
/// by LF or CRLF.
fn has_head_end(buf: &[u8], from: usize) -> bool {
    let mut at = from;
    while let Some(found) = memchr::memchr(b'\n', &buf[at..]) {
        let lf = at + found;
        match buf.get(lf + 1..) {
            Some([b'\n', ..] | [b'\r', b'\n', ..]) => return true,
            _ => at = lf + 1,
        }
    }
    false
}

/// How a response body is delimited (RFC 9112 section 6.3), and whether its connection may serve
/// another request after it.
#[derive(Debug)]
struct Framing {
    kind: Kind,
    reusable: bool,
}

#[derive(Debug)]
enum Kind {
    /// This many bytes left.
    Length(u64),
    Chunked(Decoder),
    /// Until the upstream closes the connection.
    Close,
}

/// The response of a parsed head, and how its body is framed.
fn response(
    parsed: &httparse::Response<'_, '_>,
    method: &Method,
) -> io::Result<(Response<()>, Framing)> {
    let code = parsed.code.unwrap_or(0);
    let status = StatusCode::from_u16(code).map_err(|_| invalid("an invalid status code"))?;
    if code == 101 {
        return Err(invalid(
            "101 Switching Protocols to a request that asked for none",
        ));
    }
    let mut headers = HeaderMap::with_capacity(parsed.headers.len());
    for field in parsed.headers.iter() {
        let name = HeaderName::from_bytes(field.name.as_bytes())
            .map_err(|_| invalid("an invalid header name"))?;
        let value =
            HeaderValue::from_bytes(field.value).map_err(|_| invalid("an invalid header value"))?;
        headers.append(name, value);
    }
    let http11 = parsed.version == Some(1);
    let close = headers
        .get_all(header::CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .any(|token| trim_ows(token).eq_ignore_ascii_case(b"close"));
    let no_body = *method == Method::HEAD
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED;
    // Not reused after a response without a body either: a broken upstream that sends one all
    // the same would have it taken for the next request's response.
    let reusable = http11 && !close && !no_body;
    let kind = if no_body {
        Kind::Length(0)
    } else if headers.contains_key(header::TRANSFER_ENCODING) {
        // RFC 9112 section 6.3: with both, the framing is ambiguous (the mark of response
        // splitting), and a coding other than chunked would be forwarded still applied. Both are
        // refused rather than guessed at, as is a transfer coding in HTTP/1.0, which has none.
        if headers.contains_key(header::CONTENT_LENGTH) {
            return Err(invalid("both Transfer-Encoding and Content-Length"));
        }
        if !http11 {
            return Err(invalid("Transfer-Encoding in an HTTP/1.0 response"));
        }
        let mut codings = headers
            .get_all(header::TRANSFER_ENCODING)
            .iter()
            .flat_map(|v| v.as_bytes().split(|&b| b == b','))
            .map(trim_ows)
            .filter(|coding| !coding.is_empty());
        let only_chunked = codings
            .next()
            .is_some_and(|c| c.eq_ignore_ascii_case(b"chunked"))
            && codings.next().is_none();
        if !only_chunked {
            return Err(invalid("a transfer coding other than chunked"));
        }
        Kind::Chunked(Decoder::default())
    } else if let Some(len) = content_length(&headers)? {
        Kind::Length(len)
    } else {
        Kind::Close
    };
    let reusable = reusable && !matches!(kind, Kind::Close);
    let mut res = Response::new(());
    *res.status_mut() = status;
    *res.version_mut() = Version::HTTP_11;
    *res.headers_mut() = headers;
    Ok((res, Framing { kind, reusable }))
}

/// The `Content-Length` of a response, if any: every value (and list element) must be the same
/// number, else the body's end is ambiguous.
fn content_length(headers: &HeaderMap) -> io::Result<Option<u64>> {
    let mut len = None;
    for value in headers.get_all(header::CONTENT_LENGTH) {
        for item in value.as_bytes().split(|&b| b == b',') {
            let item = trim_ows(item);
            let n = std::str::from_utf8(item)
                .ok()
                .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|s| s.parse::<u64>().ok())
                .ok_or_else(|| invalid("an invalid Content-Length"))?;
            if len.is_some_and(|l| l != n) {
                return Err(invalid("conflicting Content-Length values"));
            }
            len = Some(n);
        }
    }
    Ok(len)
}

/// The body of an upstream response: reads the upstream's socket when polled, and yields what
/// each read brings as one frame (see the [module](self)).
pub struct UpstreamResponseBody {
    io: Option<TcpStream>,
    read: Reading,
    /// The body failed: every later poll fails too, never ends cleanly.
    failed: bool,
    kind: Kind,
    reusable: bool,
    /// A frame was just yielded: hyper writes it before the socket is read again.
    yielded: bool,
    pool: Arc<Pool>,
}

impl fmt::Debug for UpstreamResponseBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpstreamResponseBody")
            .field("kind", &self.kind)
            .field("buffered", &self.read.buf.len())
            .finish_non_exhaustive()
    }
}

impl UpstreamResponseBody {
    fn new(io: TcpStream, read: Reading, framing: Framing, pool: &Arc<Pool>) -> Self {
        let mut body = Self {
            io: Some(io),
            read,
            failed: false,
            kind: framing.kind,
            reusable: framing.reusable,
            yielded: false,
            pool: pool.clone(),
        };
        if matches!(body.kind, Kind::Length(0)) {
            body.finish();
        }
        body
    }

    /// The body is complete: its connection goes back to the pool if nothing follows it.
    fn finish(&mut self) {
        self.kind = Kind::Length(0);
        if let Some(io) = self.io.take() {
            if self.reusable && self.read.buf.is_empty() {
                self.pool.checkin(io);
            }
        }
        self.read.buf = BytesMut::new();
    }

    /// The body failed with `err`: its connection is closed, and it stays failed.
    fn fail(&mut self, err: io::Error) -> io::Error {
        self.io = None;
        self.failed = true;
        self.read.buf = BytesMut::new();
        err
    }

    /// What is buffered, decoded: `None` when nothing is.
    fn decode(&mut self) -> io::Result<Option<Bytes>> {
        if self.read.buf.is_empty() {
            return Ok(None);
        }
        let data = match &mut self.kind {
            Kind::Length(0) => {
                // Bytes past the end of the body: the connection cannot be reused.
                self.reusable = false;
                return Ok(None);
            }
            Kind::Length(left) => {
                let n = usize::try_from(*left)
                    .map_or(self.read.buf.len(), |l| l.min(self.read.buf.len()));
                *left -= n as u64;
                let data = self.read.buf.split_to(n).freeze();
                if *left == 0 {
                    self.finish();
                }
                data
            }
            Kind::Chunked(decoder) => {
                let decoded = decoder.decode(&mut self.read.buf).map_err(invalid)?;
                let done = decoder.is_done();
                self.read.buf.advance(decoded.start);
                let data = self.read.buf.split_to(decoded.end - decoded.start).freeze();
                self.read.buf.advance(decoded.consumed - decoded.end);
                if done {
                    self.finish();
                }
                data
            }
            Kind::Close => self.read.buf.split().freeze(),
        };
        Ok(Some(data))
    }
}

impl Body for UpstreamResponseBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = &mut *self;
        if this.failed {
            return Poll::Ready(Some(Err(io::Error::other(
                "the upstream's response body failed",
            ))));
        }
        loop {
            match this.decode() {
                Ok(Some(data)) if !data.is_empty() => {
                    this.yielded = true;
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Ok(_) => {}
                Err(err) => return Poll::Ready(Some(Err(this.fail(err)))),
            }
            let Some(io) = this.io.as_mut() else {
                return Poll::Ready(None);
            };
            if this.yielded {
                // What was just yielded is written before the next read.
                this.yielded = false;
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            match ready!(this.read.poll_fill(io, cx)) {
                Ok(0) if matches!(this.kind, Kind::Close) => {
                    this.io = None;
                    this.kind = Kind::Length(0);
                    return Poll::Ready(None);
                }
                Ok(0) => {
                    return Poll::Ready(Some(Err(this.fail(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the upstream closed the connection before the end of the response body",
                    )))));
                }
                Ok(_) => {}
                Err(err) => return Poll::Ready(Some(Err(this.fail(err)))),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.kind, Kind::Length(0))
    }

    fn size_hint(&self) -> SizeHint {
        match self.kind {
            Kind::Length(n) => SizeHint::with_exact(n),
            _ => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    use http_body_util::{BodyExt as _, Empty, Full, StreamBody};
    use tokio::io::AsyncReadExt as _;
    use tokio::net::TcpListener;

    use super::*;

    /// An upstream on 127.0.0.1 that runs `script` on each connection it accepts (with the
    /// connection's number, from 0), and counts them.
    async fn upstream<F, Fut>(script: F) -> (Client, Arc<AtomicUsize>)
    where
        F: Fn(usize, TcpStream) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counted = accepted.clone();
        tokio::spawn(async move {
            while let Ok((io, _)) = listener.accept().await {
                let n = counted.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(script(n, io));
            }
        });
        let upstream = Upstream::parse(&format!("http://{addr}")).unwrap();
        (Client::new(upstream, Duration::from_secs(5), 16), accepted)
    }

    /// Reads one request, head and body (by its `content-length`, or up to the last chunk).
    async fn read_request(io: &mut TcpStream) -> Vec<u8> {
        let mut got = Vec::new();
        let mut buf = [0; 4096];
        loop {
            if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
                let len = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length: "))
                    .map(|n| n.trim().parse::<usize>().unwrap());
                let complete = match len {
                    Some(len) => got.len() >= end + 4 + len,
                    None if head.contains("transfer-encoding: chunked") => {
                        got.ends_with(b"0\r\n\r\n")
                    }
                    None => true,
                };
                if complete {
                    return got;
                }
            }
            let n = io.read(&mut buf).await.unwrap();
            if n == 0 {
                return got;
            }
            got.extend_from_slice(&buf[..n]);
        }
    }

    fn get(path: &str) -> http::request::Parts {
        http::Request::get(path).body(()).unwrap().into_parts().0
    }

    fn post(path: &str) -> http::request::Parts {
        http::Request::post(path).body(()).unwrap().into_parts().0
    }

    fn chunks(events: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for event in events {
            out.extend_from_slice(format!("{:x}\r\n", event.len()).as_bytes());
            out.extend_from_slice(event);
            out.extend_from_slice(b"\r\n");
        }
        out
    }

    const SSE_HEAD: &[u8] =
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";

    /// Every frame of a body, or its error.
    async fn frames(body: UpstreamResponseBody) -> Result<Vec<Bytes>, io::Error> {
        let mut body = std::pin::pin!(body);
        let mut frames = Vec::new();
        while let Some(frame) = body.frame().await {
            frames.push(frame?.into_data().unwrap());
        }
        Ok(frames)
    }

    #[tokio::test]
    async fn a_read_that_carried_many_chunks_is_one_frame() {
        let event: &[u8] = b"data: {\"choices\":[{\"delta\":{\"content\":\" token\"}}]}\n\n";
        let (client, _) = upstream(move |_, mut io| async move {
            read_request(&mut io).await;
            let mut response = SSE_HEAD.to_vec();
            response.extend(chunks(&[event; 200]));
            response.extend_from_slice(b"0\r\n\r\n");
            io.write_all(&response).await.unwrap();
            let _ = io.read(&mut [0; 1]).await;
        })
        .await;
        let res = client
            .send(&get("/v1/stream"), Empty::<Bytes>::new())
            .await
            .unwrap();
        let frames = frames(res.into_body()).await.unwrap();
        // One write of 12 KiB arrives in one read on loopback: hyper's client made 200 frames.
        assert!(frames.len() <= 2, "{} frames", frames.len());
        assert_eq!(frames.concat(), event.repeat(200));
    }

    /// Counts its wake-ups.
    #[derive(Default)]
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[tokio::test]
    async fn after_a_frame_the_body_yields_once_before_reading_again() {
        let (more, wait) = tokio::sync::oneshot::channel::<()>();
        let wait = Mutex::new(Some(wait));
        let (client, _) = upstream(move |_, mut io| {
            let wait = wait.lock().unwrap().take().unwrap();
            async move {
                read_request(&mut io).await;
                let mut first = SSE_HEAD.to_vec();
                first.extend(chunks(&[b"data: 1\n\n"]));
                io.write_all(&first).await.unwrap();
                wait.await.unwrap();
                io.write_all(&chunks(&[b"data: 2\n\n"])).await.unwrap();
                let _ = io.read(&mut [0; 1]).await;
            }
        })
        .await;
        let res = client.send(&get("/"), Empty::<Bytes>::new()).await.unwrap();
        let mut body = std::pin::pin!(res.into_body());
        let count = Arc::new(Count::default());
        let waker = std::task::Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);
        let first = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await;
        assert_eq!(first.unwrap().unwrap().into_data().unwrap(), "data: 1\n\n");
        more.send(()).unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        // The second event is in the socket; the body lets the first be written first.
        assert!(body.as_mut().poll_frame(&mut cx).is_pending());
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "woken at once");
        let second = body.as_mut().poll_frame(&mut cx);
        let Poll::Ready(Some(Ok(frame))) = second else {
            panic!("the next poll reads: {second:?}");
        };
        assert_eq!(frame.into_data().unwrap(), "data: 2\n\n");
    }

    /// An upstream that answers every request on a connection with `reply`.
    fn answering(
        reply: &'static [u8],
    ) -> impl Fn(usize, TcpStream) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> + Send
    {
        move |_, mut io| {
            Box::pin(async move {
                loop {
                    if read_request(&mut io).await.is_empty() {
                        return;
                    }
                    if io.write_all(reply).await.is_err() {
                        return;
                    }
                }
            })
        }
    }

    #[tokio::test]
    async fn a_connection_is_reused_only_after_a_complete_response_that_does_not_close_it() {
        let cases: [(&'static [u8], usize); 6] = [
            (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", 1),
            (
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
                1,
            ),
            (
                b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok",
                3,
            ),
            (b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok", 3),
            // Bytes after the body: they would be read as the next request's response.
            (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokXX", 3),
            (
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\nHTTP/1.1 200 OK\r\n\r\n",
                3,
            ),
        ];
        for (reply, connections) in cases {
            let (client, accepted) = upstream(answering(reply)).await;
            for _ in 0..3 {
                let res = client.send(&get("/"), Empty::<Bytes>::new()).await.unwrap();
                assert_eq!(frames(res.into_body()).await.unwrap().concat(), b"ok");
            }
            let what = String::from_utf8_lossy(reply);
            assert_eq!(accepted.load(Ordering::SeqCst), connections, "{what}");
        }
    }

    #[tokio::test]
    async fn a_body_dropped_before_its_end_closes_its_connection() {
        let (closed, saw_close) = tokio::sync::oneshot::channel();
        let closed = Mutex::new(Some(closed));
        let (client, accepted) = upstream(move |n, mut io| {
            let closed = closed.lock().unwrap().take();
            async move {
                read_request(&mut io).await;
                if n == 0 {
                    let mut reply = SSE_HEAD.to_vec();
                    reply.extend(chunks(&[b"data: 1\n\n"]));
                    io.write_all(&reply).await.unwrap();
                    // The proxy cancels: the upstream sees its connection end.
                    assert_eq!(io.read(&mut [0; 1]).await.unwrap(), 0);
                    closed.unwrap().send(()).unwrap();
                } else {
                    io.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                        .await
                        .unwrap();
                }
            }
        })
        .await;
        let res = client.send(&get("/"), Empty::<Bytes>::new()).await.unwrap();
        let mut body = Box::pin(res.into_body());
        body.frame().await.unwrap().unwrap();
        drop(body);
        tokio::time::timeout(Duration::from_secs(5), saw_close)
            .await
            .expect("the upstream connection was closed")
            .unwrap();
        client.send(&get("/"), Empty::<Bytes>::new()).await.unwrap();
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_pooled_connection_the_upstream_closed_is_not_used() {
        let (client, accepted) = upstream(|_, mut io| async move {
            read_request(&mut io).await;
            io.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                .await
                .unwrap();
            // Closed right after, without saying so: an upstream's keep-alive timeout.
        })
        .await;
        for _ in 0..3 {
            let res = client
                .send(&post("/"), Full::new(Bytes::from("{}")))
                .await
                .unwrap();
            assert_eq!(frames(res.into_body()).await.unwrap().concat(), b"ok");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_request_cut_off_by_a_pooled_connection_closing_is_retried_only_if_idempotent() {
        for (parts, answered) in [(get("/"), true), (post("/"), false)] {
            let (client, accepted) = upstream(|n, mut io| async move {
                read_request(&mut io).await;
                io.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    .await
                    .unwrap();
                if n == 0 {
                    // The next request is read, then the connection closes unanswered.
                    read_request(&mut io).await;
                }
            })
            .await;
            let res = client.send(&parts, Empty::<Bytes>::new()).await.unwrap();
            frames(res.into_body()).await.unwrap();
            let second = client.send(&parts, Empty::<Bytes>::new()).await;
            assert_eq!(second.is_ok(), answered, "{}: {second:?}", parts.method);
            assert_eq!(accepted.load(Ordering::SeqCst), 1 + usize::from(answered));
        }
    }

    #[tokio::test]
    async fn a_body_the_upstream_ends_early_is_an_error_and_one_that_closes_is_complete() {
        let cases: [(&'static [u8], Option<&str>); 3] = [
            (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort", None),
            (
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nshort\r\n",
                None,
            ),
            (
                b"HTTP/1.1 200 OK\r\n\r\nuntil the close",
                Some("until the close"),
            ),
        ];
        for (reply, complete) in cases {
            let (client, _) = upstream(move |_, mut io| async move {
                read_request(&mut io).await;
                io.write_all(reply).await.unwrap();
            })
            .await;
            let res = client.send(&get("/"), Empty::<Bytes>::new()).await.unwrap();
            let got = frames(res.into_body()).await;
            let what = String::from_utf8_lossy(reply);
            match complete {
                Some(data) => assert_eq!(got.unwrap().concat(), data.as_bytes(), "{what}"),
                None => assert_eq!(
                    got.unwrap_err().kind(),
                    io::ErrorKind::UnexpectedEof,
                    "{what}"
                ),
            }
        }
    }

    #[tokio::test]
    async fn interim_responses_are_skipped_and_bodiless_responses_end_at_their_head() {
        for (parts, reply) in [
            (
                get("/"),
                &b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n"[..],
            ),
            (
                http::Request::head("/").body(()).unwrap().into_parts().0,
                b"HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\n",
            ),
        ] {
            let (client, accepted) = upstream(answering(reply)).await;
            for _ in 0..2 {
                let res = client.send(&parts, Empty::<Bytes>::new()).await.unwrap();
                assert!(res.body().is_end_stream());
                assert!(frames(res.into_body()).await.unwrap().is_empty());
            }
            // Not reused: a body the upstream sent all the same would answer the next request.
            assert_eq!(accepted.load(Ordering::SeqCst), 2);
        }
    }

    #[tokio::test]
    async fn a_head_that_arrives_a_byte_at_a_time_is_read_whole() {
        let reply: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nx-a: b\r\ncontent-length: 2\r\n\r\nok";
        let (client, _) = upstream(move |_, mut io| async move {
            read_request(&mut io).await;
            io.set_nodelay(true).unwrap();
            for byte in reply {
                io.write_all(&[*byte]).await.unwrap();
                tokio::task::yield_now().await;
            }
            let _ = io.read(&mut [0; 1]).await;
        })
        .await;
        let res = client.send(&get("/"), Empty::<Bytes>::new()).await.unwrap();
        assert_eq!(res.headers()["x-a"], "b");
        assert_eq!(frames(res.into_body()).await.unwrap().concat(), b"ok");
    }

    #[tokio::test]
    async fn a_head_that_is_not_http_or_is_ambiguous_fails_before_the_head() {
        let mut huge = b"HTTP/1.1 200 OK\r\n".to_vec();
        while huge.len() < MAX_HEAD + 10 {
            huge.extend_from_slice(b"x-filler: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n");
        }
        let huge: &'static [u8] = huge.leak();
        let interim: &'static [u8] = b"HTTP/1.1 100 Continue\r\n\r\n".repeat(17).leak();
        for reply in [
            &b"SSH-2.0-OpenSSH\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nok",
            b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
            b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\n\r\n",
            // Response splitting: which framing is the upstream's?
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 5\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\nxx",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
            b"HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
            interim,
            huge,
        ] {
            let (client, _) = upstream(answering(reply)).await;
            let parts = get("/");
            let sent = client.send(&parts, Empty::<Bytes>::new());
            let err = tokio::time::timeout(Duration::from_secs(5), sent)
                .await
                .expect("an answer")
                .unwrap_err();
            let what = String::from_utf8_lossy(&reply[..reply.len().min(80)]);
            assert!(matches!(err, SendError::BeforeHead(_)), "{what}: {err:?}");
        }
    }

    #[tokio::test]
    async fn request_bodies_are_framed_by_length_or_chunked() {
        let (seen, mut requests) = tokio::sync::mpsc::unbounded_channel();
        let (client, _) = upstream(move |_, mut io| {
            let seen = seen.clone();
            async move {
                loop {
                    let request = read_request(&mut io).await;
                    if request.is_empty() {
                        return;
                    }
                    seen.send(request).unwrap();
                    io.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                        .await
                        .unwrap();
                }
            }
        })
        .await;
        let mut parts = post("/v1/chat/completions");
        parts
            .headers
            .insert(header::HOST, HeaderValue::from_static("up"));
        // A stale length from the client is never sent: the body's own is.
        parts
            .headers
            .insert(header::CONTENT_LENGTH, HeaderValue::from_static("99"));
        client
            .send(&parts, Full::new(Bytes::from("{\"a\":1}")))
            .await
            .unwrap();
        assert_eq!(
            requests.recv().await.unwrap(),
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: up\r\ncontent-length: 7\r\n\r\n{\"a\":1}"
        );
        let pieces = futures_util::stream::iter(
            ["ab", "cde"].map(|s| Ok::<_, io::Error>(Frame::data(Bytes::from(s)))),
        );
        client.send(&parts, StreamBody::new(pieces)).await.unwrap();
        assert_eq!(
            requests.recv().await.unwrap(),
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: up\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n3\r\ncde\r\n0\r\n\r\n"
        );
        client
            .send(&get("/v1/models"), Empty::<Bytes>::new())
            .await
            .unwrap();
        assert_eq!(
            requests.recv().await.unwrap(),
            b"GET /v1/models HTTP/1.1\r\n\r\n"
        );
    }

    /// A streamed request body of `len` bytes, of unknown length.
    fn upload(len: usize) -> impl Body<Data = Bytes, Error = io::Error> {
        let piece = Bytes::from(vec![b'x'; 16 * 1024]);
        let pieces = (0..len / piece.len()).map(move |_| Ok(Frame::data(piece.clone())));
        StreamBody::new(futures_util::stream::iter(pieces))
    }

    #[tokio::test]
    async fn an_answer_before_the_request_body_is_sent_is_the_response() {
        for close in [true, false] {
            let (client, _) = upstream(move |_, mut io| async move {
                // The head only, then the refusal; then close, or stop reading and wait.
                let mut head = Vec::new();
                while !head.ends_with(b"\r\n\r\n") {
                    let mut byte = [0];
                    io.read_exact(&mut byte).await.unwrap();
                    head.push(byte[0]);
                }
                io.write_all(b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 3\r\n\r\nbig")
                    .await
                    .unwrap();
                if !close {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                }
            })
            .await;
            let parts = post("/upload");
            let sent = client.send(&parts, upload(16 << 20));
            let res = tokio::time::timeout(Duration::from_secs(10), sent)
                .await
                .unwrap_or_else(|_| panic!("no answer (close: {close})"))
                .unwrap();
            assert_eq!(res.status(), StatusCode::PAYLOAD_TOO_LARGE);
            assert_eq!(frames(res.into_body()).await.unwrap().concat(), b"big");
        }
    }

    /// A body whose length is not the one it declared.
    struct Lying(Option<Bytes>, u64);

    impl Body for Lying {
        type Data = Bytes;
        type Error = io::Error;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
            Poll::Ready(self.0.take().map(|data| Ok(Frame::data(data))))
        }

        fn size_hint(&self) -> SizeHint {
            SizeHint::with_exact(self.1)
        }
    }

    #[tokio::test]
    async fn a_request_body_that_is_not_its_declared_length_fails() {
        let reply = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
        let (client, _) = upstream(answering(reply)).await;
        for (len, declared) in [(10, 100_000), (100_010, 100_000), (10, 5), (3, 5)] {
            let body = Lying(Some(Bytes::from(vec![b'x'; len])), declared);
            let err = client.send(&post("/"), body).await.unwrap_err();
            assert!(
                matches!(err, SendError::RequestBody(_)),
                "{len}/{declared}: {err:?}"
            );
        }
    }

    #[tokio::test]
    async fn a_failed_body_stays_failed() {
        let reply = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n";
        let (client, _) = upstream(answering(reply)).await;
        let res = client.send(&get("/"), Empty::<Bytes>::new()).await.unwrap();
        let mut body = Box::pin(res.into_body());
        assert!(body.frame().await.unwrap().is_err());
        assert!(body.frame().await.unwrap().is_err(), "never a clean end");
    }

    #[tokio::test]
    async fn a_quiet_stream_holds_a_small_buffer_and_a_busy_one_reads_more_at_once() {
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let wait = Mutex::new(Some(wait));
        let (client, _) = upstream(move |_, mut io| {
            let wait = wait.lock().unwrap().take().unwrap();
            async move {
                read_request(&mut io).await;
                io.write_all(SSE_HEAD).await.unwrap();
                for _ in 0..20 {
                    io.write_all(&chunks(&[b"data: 1\n\n"])).await.unwrap();
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                wait.await.unwrap();
                let big = vec![b'y'; 1 << 20];
                io.write_all(&chunks(&[&big])).await.unwrap();
                io.write_all(b"0\r\n\r\n").await.unwrap();
            }
        })
        .await;
        let res = client.send(&get("/"), Empty::<Bytes>::new()).await.unwrap();
        let mut body = Box::pin(res.into_body());
        let mut got = 0;
        while got < 20 * 9 {
            got += body
                .frame()
                .await
                .unwrap()
                .unwrap()
                .into_data()
                .unwrap()
                .len();
        }
        let held = body.read.buf.capacity();
        assert!(held <= 2 * READ_MIN, "a quiet stream holds {held} bytes");
        go.send(()).unwrap();
        let mut largest = 0;
        while let Some(frame) = body.frame().await {
            largest = largest.max(frame.unwrap().into_data().unwrap().len());
        }
        assert!(largest > READ_MIN, "reads grew: {largest}");
    }
}
