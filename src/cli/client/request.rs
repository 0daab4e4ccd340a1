//! The request written to the upstream: its head, and a streamed body framed by length or chunked.

use std::pin::Pin;

use bytes::Bytes;
use http::header;
use http_body::Body;
use http_body_util::BodyExt as _;
use tokio::io::AsyncWriteExt as _;

use super::SendError;
use crate::BoxError;

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

/// Sends the head and then the body of a request whose body is streamed: with
/// `Content-Length: declared`, or chunked when `declared` is `None`. A body that is longer or
/// shorter than it declared fails (it would leave the connection out of step).
pub(super) async fn send_body<B>(
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
