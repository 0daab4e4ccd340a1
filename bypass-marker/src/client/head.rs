//! The response head, parsed (httparse), and how its body is framed.

use std::io;

use bytes::Buf as _;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Response, StatusCode, Version};
use tokio::io::AsyncRead;

use super::chunked::Decoder;
use super::reading::Reading;
use super::{invalid, trim_ows};

/// The longest response head accepted, and the most header fields.
pub(super) const MAX_HEAD: usize = 64 * 1024;
pub(super) const MAX_HEADERS: usize = 128;

/// The most interim (1xx) responses before the final one.
pub(super) const MAX_INTERIM: usize = 16;

/// The largest `Content-Length` that frames a body: hyper's (`u64::MAX - 2`; it keeps the two
/// values above for its own use), so that the proxy's server, hyper, can send what this client
/// accepted.
pub(super) const MAX_LENGTH: u64 = u64::MAX - 2;

/// Why a response head was refused: the error the head's `io::Error` carries (what the logs say,
/// and what the differential test holds against hyper's verdict).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadRefusal {
    /// A head (one of the interim ones, or the final one) of 64 KiB or more.
    HeadTooLarge,
    /// More than 16 interim responses (`MAX_INTERIM`).
    TooManyInterim,
    /// Not a head httparse reads (with more than 128 fields: `httparse::Error::TooManyHeaders`).
    Malformed(Option<httparse::Error>),
    /// A status code outside 100 to 999.
    InvalidStatus,
    /// 101 Switching Protocols, to a request that asked for no upgrade.
    SwitchingProtocols,
    /// A field name `http` does not take.
    InvalidHeaderName,
    /// A field value `http` does not take.
    InvalidHeaderValue,
    /// A `Content-Length` that is not a number (or list of numbers).
    InvalidContentLength,
    /// `Content-Length` values that are not all the same number.
    ConflictingContentLength,
    /// A `Content-Length` over `MAX_LENGTH` (hyper's limit, `u64::MAX - 2`) framing a body.
    ContentLengthTooLarge,
    /// Both `Transfer-Encoding` and `Content-Length`.
    TransferEncodingAndContentLength,
    /// `Transfer-Encoding` in an HTTP/1.0 response.
    TransferEncodingInHttp10,
    /// A transfer coding other than one `chunked`.
    NotChunked,
}

impl std::fmt::Display for HeadRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::HeadTooLarge => "a response head of 64 KiB or more",
            Self::TooManyInterim => "more than 16 interim responses",
            Self::Malformed(Some(err)) => {
                return write!(f, "a malformed response head: {err}");
            }
            Self::Malformed(None) => "a malformed response head",
            Self::InvalidStatus => "an invalid status code",
            Self::SwitchingProtocols => "101 Switching Protocols to a request that asked for none",
            Self::InvalidHeaderName => "an invalid header name",
            Self::InvalidHeaderValue => "an invalid header value",
            Self::InvalidContentLength => "an invalid Content-Length",
            Self::ConflictingContentLength => "conflicting Content-Length values",
            Self::ContentLengthTooLarge => "a Content-Length over 2^64 - 3",
            Self::TransferEncodingAndContentLength => "both Transfer-Encoding and Content-Length",
            Self::TransferEncodingInHttp10 => "Transfer-Encoding in an HTTP/1.0 response",
            Self::NotChunked => "a transfer coding other than chunked",
        })
    }
}

impl std::error::Error for HeadRefusal {}

impl Reading {
    /// Reads the response head (skipping up to `MAX_INTERIM` interim 1xx responses). On
    /// failure, how many bytes had arrived.
    pub(super) async fn head<R: AsyncRead + Unpin>(
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
        // Empty lines before a status line are skipped, as hyper (httparse) does, however they
        // arrive; they count towards the `MAX_HEAD` of the head they precede.
        let mut skipped: usize = 0;
        loop {
            if matches!(self.buf.first(), Some(b'\r' | b'\n')) {
                let blank = leading_empty_lines(&self.buf);
                if blank > 0 {
                    skipped += blank;
                    self.buf.advance(blank);
                    searched = 0;
                }
            }
            if !has_head_end(&self.buf, searched.saturating_sub(2)) {
                searched = self.buf.len();
                // hyper's rule: a head not complete in 64 KiB is refused.
                if self.buf.len() + skipped >= MAX_HEAD {
                    return Err((invalid(HeadRefusal::HeadTooLarge), got));
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
                    // hyper's rule for a head complete in one read: over 64 KiB is refused.
                    if len + skipped > MAX_HEAD {
                        return Err((invalid(HeadRefusal::HeadTooLarge), got));
                    }
                    let code = parsed.code.unwrap_or(0);
                    if (100..200).contains(&code) && code != 101 {
                        // 100 Continue, 103 Early Hints: the final response follows.
                        interim += 1;
                        if interim > MAX_INTERIM {
                            return Err((invalid(HeadRefusal::TooManyInterim), got));
                        }
                        self.buf.advance(len);
                        searched = 0;
                        skipped = 0;
                        continue;
                    }
                    let head = response(&parsed, method).map_err(|err| (err, got))?;
                    self.buf.advance(len);
                    return Ok(head);
                }
                // An empty line that httparse does not take for the head's end.
                Ok(httparse::Status::Partial) => {
                    return Err((invalid(HeadRefusal::Malformed(None)), got));
                }
                Err(err) => return Err((invalid(HeadRefusal::Malformed(Some(err))), got)),
            }
        }
    }
}

/// How many bytes of empty lines (CRLF or LF) `buf` starts with; a CR alone at its end waits
/// for its LF.
fn leading_empty_lines(buf: &[u8]) -> usize {
    let mut at = 0;
    loop {
        match buf[at..] {
            [b'\r', b'\n', ..] => at += 2,
            [b'\n', ..] => at += 1,
            _ => return at,
        }
    }
}

/// Whether `buf`, looked at from `from` on, holds the empty line that ends a head: a LF followed
/// by LF or CRLF.
pub(super) fn has_head_end(buf: &[u8], from: usize) -> bool {
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
pub(super) struct Framing {
    pub(super) kind: Kind,
    pub(super) reusable: bool,
    /// The response says `Connection: close` (or is HTTP/1.0 without keep-alive's promise).
    pub(super) close: bool,
}

#[derive(Debug)]
pub(super) enum Kind {
    /// This many bytes left.
    Length(u64),
    Chunked(Decoder),
    /// Until the upstream closes the connection.
    Close,
}

/// The response of a parsed head, and how its body is framed.
pub(super) fn response(
    parsed: &httparse::Response<'_, '_>,
    method: &Method,
) -> io::Result<(Response<()>, Framing)> {
    let code = parsed.code.unwrap_or(0);
    let status = StatusCode::from_u16(code).map_err(|_| invalid(HeadRefusal::InvalidStatus))?;
    if code == 101 {
        return Err(invalid(HeadRefusal::SwitchingProtocols));
    }
    let mut headers = HeaderMap::with_capacity(parsed.headers.len());
    for field in parsed.headers.iter() {
        let name = HeaderName::from_bytes(field.name.as_bytes())
            .map_err(|_| invalid(HeadRefusal::InvalidHeaderName))?;
        let value = HeaderValue::from_bytes(field.value)
            .map_err(|_| invalid(HeadRefusal::InvalidHeaderValue))?;
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
    // Checked on every response, bodiless ones too (a HEAD's says what a GET would get): an
    // invalid or conflicting value is refused, as nginx does, and a list of one number repeated
    // (`2, 2`) goes on as that number (RFC 9110 section 8.6: a proxy must not forward the list).
    // RFC 9112 section 6.3: both framings is the refusal below, whatever the length says.
    if !no_body
        && headers.contains_key(header::TRANSFER_ENCODING)
        && headers.contains_key(header::CONTENT_LENGTH)
    {
        return Err(invalid(HeadRefusal::TransferEncodingAndContentLength));
    }
    let len = content_length(&headers)?;
    if let Some(len) = len {
        let mut values = headers.get_all(header::CONTENT_LENGTH).iter();
        let listed = values.next().is_some_and(|v| v.as_bytes().contains(&b','));
        if listed || values.next().is_some() {
            headers.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
        }
    }
    let kind = if no_body {
        Kind::Length(0)
    } else if headers.contains_key(header::TRANSFER_ENCODING) {
        // RFC 9112 section 6.3: with both, the framing is ambiguous (the mark of response
        // splitting), and a coding other than chunked would be forwarded still applied. Both are
        // refused rather than guessed at, as is a transfer coding in HTTP/1.0, which has none.
        if headers.contains_key(header::CONTENT_LENGTH) {
            return Err(invalid(HeadRefusal::TransferEncodingAndContentLength));
        }
        if !http11 {
            return Err(invalid(HeadRefusal::TransferEncodingInHttp10));
        }
        // Exactly one element, `chunked`, over all the field lines: an empty element
        // (`chunked,`, or a second, empty `Transfer-Encoding:` line) is refused too, since
        // readers differ on it (hyper reads the last element only, finds no `chunked` and reads
        // the body to the close): two framings of one response.
        let mut codings = headers
            .get_all(header::TRANSFER_ENCODING)
            .iter()
            .flat_map(|v| v.as_bytes().split(|&b| b == b','))
            .map(trim_ows);
        let only_chunked = codings
            .next()
            .is_some_and(|c| c.eq_ignore_ascii_case(b"chunked"))
            && codings.next().is_none();
        if !only_chunked {
            return Err(invalid(HeadRefusal::NotChunked));
        }
        Kind::Chunked(Decoder::default())
    } else if let Some(len) = len {
        // hyper's rule, for a length that frames a body (a bodiless response's is only checked).
        if len > MAX_LENGTH {
            return Err(invalid(HeadRefusal::ContentLengthTooLarge));
        }
        Kind::Length(len)
    } else {
        Kind::Close
    };
    let reusable = reusable && !matches!(kind, Kind::Close);
    let mut res = Response::new(());
    *res.status_mut() = status;
    *res.version_mut() = Version::HTTP_11;
    *res.headers_mut() = headers;
    Ok((
        res,
        Framing {
            kind,
            reusable,
            close: close || !http11,
        },
    ))
}

/// The `Content-Length` of a response, if any: every value (and list element) must be the same
/// number, else the body's end is ambiguous.
pub(super) fn content_length(headers: &HeaderMap) -> io::Result<Option<u64>> {
    let mut len = None;
    for value in headers.get_all(header::CONTENT_LENGTH) {
        for item in value.as_bytes().split(|&b| b == b',') {
            let item = trim_ows(item);
            let n = std::str::from_utf8(item)
                .ok()
                .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|s| s.parse::<u64>().ok())
                .ok_or_else(|| invalid(HeadRefusal::InvalidContentLength))?;
            if len.is_some_and(|l| l != n) {
                return Err(invalid(HeadRefusal::ConflictingContentLength));
            }
            len = Some(n);
        }
    }
    Ok(len)
}
