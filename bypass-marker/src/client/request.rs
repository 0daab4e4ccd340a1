//! The request written to the upstream: its head, and a streamed body framed by length or chunked.

use std::io;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use http::header;
use http_body::Body;
use http_body_util::BodyExt as _;
use tokio::io::{AsyncWrite, AsyncWriteExt as _};

use super::SendError;
use tower_bypass_marker::BoxError;

/// The request line and header fields, without the body's framing and the final CRLF.
pub(super) fn request_head(parts: &http::request::Parts) -> Vec<u8> {
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

/// Writes all of `bytes`; with `stall`, a write that makes no progress for that long fails with
/// [`SendError::Timeout`] (the upstream stopped taking the request): a slow but steady upload
/// goes on as long as it moves.
pub(super) async fn write_all<W>(
    io: &mut W,
    mut bytes: &[u8],
    stall: Option<Duration>,
) -> Result<(), SendError>
where
    W: AsyncWrite + Unpin,
{
    let Some(stall) = stall else {
        return io.write_all(bytes).await.map_err(SendError::BeforeHead);
    };
    while !bytes.is_empty() {
        let n = match tokio::time::timeout(stall, io.write(bytes)).await {
            Ok(Ok(0)) => return Err(SendError::BeforeHead(io::ErrorKind::WriteZero.into())),
            Ok(Ok(n)) => n,
            Ok(Err(err)) => return Err(SendError::BeforeHead(err)),
            Err(_) => return Err(SendError::Timeout(stall)),
        };
        bytes = &bytes[n..];
    }
    Ok(())
}

/// Sends the head and then the body of a request whose body is streamed: with
/// `Content-Length: declared`, or chunked when `declared` is `None`. A body that is longer or
/// shorter than it declared fails (it would leave the connection out of step). `stall`: see
/// [`write_all`].
pub(super) async fn send_body<W, B>(
    io: &mut W,
    head: &[u8],
    body: Pin<&mut B>,
    declared: Option<u64>,
    stall: Option<Duration>,
) -> Result<(), SendError>
where
    W: AsyncWrite + Unpin,
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let mut body = body;
    write_all(io, head, stall).await?;
    let mut sent = 0u64;
    let mut piece = Vec::new();
    loop {
        // The body's own error is converted at once: it need not be `Send`, the task that may
        // finish the upload is.
        let frame = match body.as_mut().frame().await {
            None => break,
            Some(frame) => frame.map_err(|err| SendError::RequestBody(err.into()))?,
        };
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
            write_all(io, data, stall).await?;
        } else {
            // One write a chunk: size line, data and CRLF.
            piece.clear();
            piece.extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
            piece.extend_from_slice(data);
            piece.extend_from_slice(b"\r\n");
            write_all(io, &piece, stall).await?;
        }
    }
    match declared {
        Some(len) if sent != len => Err(SendError::RequestBody(
            "the request body is shorter than its length".into(),
        )),
        Some(_) => Ok(()),
        None => write_all(io, b"0\r\n\r\n", stall).await,
    }
}
