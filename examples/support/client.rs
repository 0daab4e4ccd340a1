//! HTTP client helpers for the simulated router's examples and tests: a real hyper client that
//! reads whole responses, OpenAI request bodies for the router's endpoints, and functions that
//! take an event stream apart.

use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{header, HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use super::router::Endpoint;

/// An error from the client helpers.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A response as a client received it.
#[derive(Debug)]
pub(crate) struct Reply {
    /// The status code.
    pub(crate) status: StatusCode,
    /// The response headers.
    pub(crate) headers: HeaderMap,
    /// The body, byte for byte.
    pub(crate) body: Bytes,
}

impl Reply {
    /// The response's `content-type`, or `""`.
    pub(crate) fn content_type(&self) -> &str {
        self.headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }
}

/// How long a client helper waits for a whole response.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);

/// `POST`s `body` as JSON to `http://{addr}{path}` with a real HTTP/1.1 client and reads the
/// whole response.
pub(crate) async fn http_post(
    addr: SocketAddr,
    path: &str,
    body: Bytes,
) -> Result<Reply, BoxError> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let req = Request::post(format!("http://{addr}{path}"))
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::ACCEPT, "text/event-stream, application/json")
        .body(Full::new(body))?;
    let exchange = async {
        let res = client.request(req).await?;
        let (parts, body) = res.into_parts();
        let body = body.collect().await?.to_bytes();
        Ok::<_, BoxError>(Reply {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    };
    tokio::time::timeout(CLIENT_TIMEOUT, exchange)
        .await
        .map_err(|_| format!("no complete response from {addr}{path} within {CLIENT_TIMEOUT:?}"))?
}

/// A request body for `endpoint` with `prompt`, streamed or not, with extra top-level fields.
pub(crate) fn request(
    endpoint: Endpoint,
    prompt: &str,
    stream: bool,
    max_tokens: u64,
) -> serde_json::Value {
    match endpoint {
        Endpoint::Chat => serde_json::json!({
            "model": "sim-llm",
            "messages": [{"role": "user", "content": prompt}],
            "stream": stream,
            "max_tokens": max_tokens,
        }),
        Endpoint::Completions => serde_json::json!({
            "model": "sim-llm",
            "prompt": prompt,
            "stream": stream,
            "max_tokens": max_tokens,
        }),
    }
}

/// `request` with `nvext.annotations` set to `annotations`.
pub(crate) fn with_annotations(
    mut request: serde_json::Value,
    annotations: &[&str],
) -> serde_json::Value {
    request["nvext"] = serde_json::json!({ "annotations": annotations });
    request
}

/// The path of `endpoint`.
pub(crate) fn path(endpoint: Endpoint) -> &'static str {
    match endpoint {
        Endpoint::Chat => "/v1/chat/completions",
        Endpoint::Completions => "/v1/completions",
    }
}

/// Splits an event stream into its frames, each with its closing empty line (`\n\n`).
pub(crate) fn frames(body: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        let end = rest
            .windows(2)
            .position(|w| w == b"\n\n")
            .map_or(rest.len(), |i| i + 2);
        let (frame, tail) = rest.split_at(end);
        out.push(frame);
        rest = tail;
    }
    out
}

/// The completion text carried by a stream's `data` frames (chat `delta.content` or `text`).
pub(crate) fn streamed_text(body: &[u8]) -> Result<String, BoxError> {
    let mut text = String::new();
    for frame in frames(body) {
        let Some(data) = frame.strip_prefix(b"data: ") else {
            continue;
        };
        let data = data.strip_suffix(b"\n\n").unwrap_or(data);
        if data == b"[DONE]" {
            continue;
        }
        let chunk: serde_json::Value = serde_json::from_slice(data)?;
        for choice in chunk["choices"].as_array().into_iter().flatten() {
            let piece = choice["delta"]["content"]
                .as_str()
                .or(choice["text"].as_str())
                .unwrap_or("");
            text.push_str(piece);
        }
    }
    Ok(text)
}

/// The `id` of the first `data` frame of a stream: the completion's id.
pub(crate) fn stream_id(body: &[u8]) -> Result<String, BoxError> {
    let data = frames(body)
        .into_iter()
        .find_map(|frame| frame.strip_prefix(b"data: "))
        .ok_or("no data frame in the stream")?;
    let chunk: serde_json::Value =
        serde_json::from_slice(data.strip_suffix(b"\n\n").unwrap_or(data))?;
    Ok(chunk["id"]
        .as_str()
        .ok_or("the first data frame has no string id")?
        .to_owned())
}

/// `bytes` with CR, LF, tab, backslash and other control or non-ASCII bytes escaped, quotes left
/// alone, so that a frame's exact bytes can be printed on one line.
pub(crate) fn escape(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    for &b in bytes {
        match b {
            b'\n' => out.push_str("\\n"),
            b'\r' => out.push_str("\\r"),
            b'\t' => out.push_str("\\t"),
            b'\\' => out.push_str("\\\\"),
            0x20..=0x7e => out.push(char::from(b)),
            _ => out.push_str(&format!("\\x{b:02x}")),
        }
    }
    out
}
