//! Not part of the API: the way in to the sidecar's own upstream client for the differential test
//! that holds it to hyper's client (`tests/client_differential.rs` and the `client` fuzz target,
//! both through `test_support::client`), and to its `chunked` decoder for the `chunked` fuzz
//! target. Hidden, and it may change with any release.

use std::io;
use std::time::Duration;

use bytes::Bytes;
use http::Response;
use http_body::Body;

use super::client::{self, chunked, ChunkedError, SendError};
use super::{Upstream, UpstreamResponseBody};
use tower_bypass_marker::BoxError;

pub use super::client::HeadRefusal;

/// The sidecar's upstream client (`Client::new` and `Client::send` as the proxy calls them).
pub struct Client(client::Client);

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").finish_non_exhaustive()
    }
}

/// Why this client gave no response head, or cut a body: its own reason, which the differential
/// test holds against the reason a listed disagreement gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CutReason {
    /// The response head was refused, for this reason.
    Head(HeadRefusal),
    /// The body's `chunked` framing was refused: the decoder's words.
    Chunked(&'static str),
    /// The request body failed (the client's side).
    RequestBody,
    /// The upstream did not answer in time.
    Timeout,
    /// None of the above: the connection failed, closed or was reset, with this kind.
    Io(io::ErrorKind),
}

impl CutReason {
    /// The reason an error of a response body (or of a head, inside a [`SendError`]) carries.
    pub fn of(err: &io::Error) -> Self {
        if let Some(inner) = err.get_ref() {
            if let Some(refusal) = inner.downcast_ref::<HeadRefusal>() {
                return Self::Head(*refusal);
            }
            if let Some(chunked) = inner.downcast_ref::<ChunkedError>() {
                return Self::Chunked(chunked.0);
            }
        }
        Self::Io(err.kind())
    }
}

/// Why a request got no response: the reason, and the error's words with its source.
#[derive(Debug, Clone)]
pub struct Failure {
    pub reason: CutReason,
    pub message: String,
}

impl Client {
    /// A client of `upstream`, with a 10 s connect timeout and up to 4 idle connections.
    pub fn new(upstream: Upstream) -> Self {
        Self(client::Client::new(upstream, Duration::from_secs(10), 4))
    }

    /// With a response timeout (`--response-timeout`).
    #[must_use]
    pub fn response_timeout(self, timeout: Duration) -> Self {
        Self(self.0.response_timeout(timeout))
    }

    /// Sends `parts` with `body`: the response, or why there is none.
    pub async fn send<B>(
        &self,
        parts: &http::request::Parts,
        body: B,
    ) -> Result<Response<UpstreamResponseBody>, Failure>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        self.0.send(parts, body).await.map_err(|err| {
            let reason = match &err {
                SendError::Connect(err) => CutReason::Io(err.kind()),
                SendError::BeforeHead(err) => CutReason::of(err),
                SendError::RequestBody(_) => CutReason::RequestBody,
                SendError::Timeout(_) => CutReason::Timeout,
            };
            let message = match std::error::Error::source(&err) {
                Some(source) => format!("{err}: {source}"),
                None => err.to_string(),
            };
            Failure { reason, message }
        })
    }
}

/// The sidecar's in-place `chunked` decoder, for the `chunked` fuzz target: each read is decoded
/// in place, the data left at [`Decoded::data`] of the buffer.
#[derive(Debug, Clone, Default)]
pub struct ChunkedDecoder(chunked::Decoder);

/// What [`ChunkedDecoder::decode`] made of one read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decoded {
    /// Where the decoded data lies in the buffer.
    pub data: std::ops::Range<usize>,
    /// How many bytes of the buffer the coding took: all of them, unless the body ended in it.
    pub consumed: usize,
}

impl ChunkedDecoder {
    /// Decodes one read in place, or says why the coding is malformed (the decoder's words).
    pub fn decode(&mut self, buf: &mut [u8]) -> Result<Decoded, &'static str> {
        let decoded = self.0.decode(buf).map_err(|ChunkedError(why)| why)?;
        Ok(Decoded {
            data: decoded.start..decoded.end,
            consumed: decoded.consumed,
        })
    }

    /// Decodes `reads` as successive socket reads, up to the end of the body: the data, and how
    /// many bytes of all the reads the coding took. Panics if the decoder breaks one of its
    /// promises on a read (its data outside what it took, or a read left part-taken before the
    /// end).
    pub fn decode_reads(&mut self, reads: &[&[u8]]) -> Result<(Vec<u8>, usize), &'static str> {
        self.0.decode_reads(reads).map_err(|ChunkedError(why)| why)
    }

    /// Whether the body has ended (the last chunk and the trailer section were read).
    pub fn is_done(&self) -> bool {
        self.0.is_done()
    }
}
