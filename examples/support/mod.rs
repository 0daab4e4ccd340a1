//! A simulated disaggregated LLM router with an OpenAI-compatible HTTP API, shared by the `router`
//! and `demo` examples and by `tests/router.rs`.
//!
//! It reproduces the Dynamo behaviour this crate exists for. The router remembers every prompt it
//! has served; a request whose prompt it has seen before is a prefix-cache hit, so the router
//! bypasses remote prefill and starts the event stream with Dynamo's marker frame,
//!
//! ```text
//! event: x-bypass-remote-prefill
//! : true
//!
//! ```
//!
//! which the OpenAI SDKs cannot parse. Like Dynamo, it also prepends a `request_id` annotation
//! frame to *every* stream, whatever the client asked for (after the marker on a cache hit):
//!
//! ```text
//! event: request_id
//! : "<the completion's id>"
//!
//! ```
//!
//! It has no `data` line either, so without the layer every streamed request breaks the SDKs, cold
//! or not.
//!
//! With the layer ([`SimRouter::new(true)`](SimRouter::new), configured by [`layer()`]) both frames
//! are opt-in: the handler runs the client's `nvext.annotations` through
//! [`BypassMarkerLayer::guard_annotations`] before the simulated worker sees them, and puts the
//! returned [`RequestedAnnotations`] in the response's extensions, where [`BypassMarkerLayer`]
//! reads the client's opt-in. A client that lists `x-bypass-remote-prefill` gets the marker, one
//! that lists `request_id` gets the `request_id` frame, others get neither. Without the layer the
//! router behaves as Dynamo does today.
//!
//! The model is an echo model: the completion is the prompt's words, repeated until `max_tokens`
//! (16 by default) words have been produced, one word per streamed chunk.

// Each example and test that includes this module uses a different part of it.
#![allow(dead_code)]

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tower_bypass_marker::{BypassMarkerLayer, RequestedAnnotations};

/// The frame the router prepends to the stream of a request that bypassed remote prefill.
pub const BYPASS_FRAME: &str = "event: x-bypass-remote-prefill\n: true\n\n";

/// The frame the router prepends to every stream (after [`BYPASS_FRAME`], if any): `event:
/// request_id` and the completion's `id` as a JSON string in a comment, no `data` line.
pub fn request_id_frame(id: &str) -> String {
    let id = serde_json::to_string(id).expect("a string serializes");
    format!("event: request_id\n: {id}\n\n")
}

/// The last frame of every stream.
pub const DONE_FRAME: &str = "data: [DONE]\n\n";

/// The completion length when the request does not set `max_tokens`.
pub const DEFAULT_MAX_TOKENS: u64 = 16;

/// The largest `max_tokens` the simulated worker accepts.
pub const MAX_TOKENS_LIMIT: u64 = 4096;

/// How many prompts the prefix cache holds before it is emptied.
const PREFIX_CACHE_ENTRIES: usize = 100_000;

/// How many requests the worker's log keeps, the newest.
const WORKER_LOG_ENTRIES: usize = 1024;

/// The layer the simulated router is served with: Dynamo's marker and the `request_id` frame the
/// router prepends to every stream both reach only the clients that asked for them.
pub fn layer() -> BypassMarkerLayer {
    BypassMarkerLayer::new().opt_in("request_id")
}

/// The simulated router's axum app, with a new prefix cache, wrapped in [`layer()`] when
/// `with_layer` is true. Use [`SimRouter`] to also read what its worker was handed.
pub fn app(with_layer: bool) -> axum::Router {
    SimRouter::new(with_layer).app()
}

/// The OpenAI endpoints the router serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/completions`.
    Completions,
}

/// What the simulated worker was handed for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerRequest {
    /// The endpoint the request came in on.
    pub endpoint: Endpoint,
    /// The request's `nvext.annotations`, after the guard when the router has the layer.
    pub annotations: Vec<String>,
    /// Whether the router bypassed remote prefill (a prefix-cache hit).
    pub bypass_remote_prefill: bool,
    /// Whether the response was streamed.
    pub stream: bool,
}

/// The simulated router: its prefix cache, its worker's log and, optionally, the layer.
///
/// Cloning it shares the state.
#[derive(Clone)]
pub struct SimRouter {
    shared: Arc<Shared>,
}

struct Shared {
    layer: Option<BypassMarkerLayer>,
    /// How many times each prompt has been served: the prefix cache.
    seen: Mutex<HashMap<(Endpoint, String), u64>>,
    worker_log: Mutex<Vec<WorkerRequest>>,
}

impl SimRouter {
    /// A router with an empty prefix cache, served with [`layer()`] when `with_layer` is true.
    pub fn new(with_layer: bool) -> Self {
        Self {
            shared: Arc::new(Shared {
                layer: with_layer.then(layer),
                seen: Mutex::default(),
                worker_log: Mutex::default(),
            }),
        }
    }

    /// Whether the router is served with the layer.
    pub fn has_layer(&self) -> bool {
        self.shared.layer.is_some()
    }

    /// The axum app: both endpoints, wrapped in the layer if the router has one.
    pub fn app(&self) -> axum::Router {
        let app = axum::Router::new()
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/completions", post(completions))
            .with_state(self.clone());
        match &self.shared.layer {
            Some(layer) => app.layer(layer.clone()),
            None => app,
        }
    }

    /// What the simulated worker has been handed (the last 1024 requests), oldest first.
    pub fn worker_log(&self) -> Vec<WorkerRequest> {
        lock(&self.shared.worker_log).clone()
    }

    fn handle(&self, endpoint: Endpoint, body: &[u8]) -> Response {
        let req: CompletionRequest = match serde_json::from_slice(body) {
            Ok(req) => req,
            Err(err) => return bad_request(&format!("invalid JSON body: {err}")),
        };
        let prompt = match req.prompt_text(endpoint) {
            Ok(prompt) => prompt,
            Err(message) => return bad_request(&message),
        };
        let max_tokens = req
            .max_tokens
            .or(req.max_completion_tokens)
            .unwrap_or(DEFAULT_MAX_TOKENS);
        if !(1..=MAX_TOKENS_LIMIT).contains(&max_tokens) {
            return bad_request(&format!(
                "max_tokens must be between 1 and {MAX_TOKENS_LIMIT}, got {max_tokens}"
            ));
        }

        // The request-side guard: a client cannot hand the worker a router-owned marker.
        let mut annotations = req
            .nvext
            .and_then(|nvext| nvext.annotations)
            .unwrap_or_default();
        let granted = match &self.shared.layer {
            Some(layer) => layer.guard_annotations(&mut annotations),
            None => RequestedAnnotations::new(),
        };

        // The KV router: a prompt it has served before is in the prefix cache.
        let stream = req.stream.unwrap_or(false);
        let served_before = {
            let mut seen = lock(&self.shared.seen);
            if seen.len() >= PREFIX_CACHE_ENTRIES {
                seen.clear(); // evicted, all at once
            }
            let count = seen.entry((endpoint, prompt.clone())).or_insert(0);
            *count += 1;
            *count - 1
        };
        let bypass = served_before > 0;
        {
            let mut log = lock(&self.shared.worker_log);
            if log.len() >= WORKER_LOG_ENTRIES {
                log.remove(0);
            }
            log.push(WorkerRequest {
                endpoint,
                annotations: annotations.clone(),
                bypass_remote_prefill: bypass,
                stream,
            });
        }

        let completion = Completion {
            endpoint,
            id: completion_id(endpoint, &prompt, served_before),
            created: created(),
            model: req.model,
            prompt_tokens: prompt.split_whitespace().count() as u64,
            tokens: echo_tokens(&prompt, max_tokens),
        };
        let mut res = if stream {
            let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
            let mut frames = Vec::new();
            if bypass {
                frames.push(Bytes::from_static(BYPASS_FRAME.as_bytes()));
            }
            // Always, whatever the client asked for; the layer makes it opt-in.
            frames.push(Bytes::from(request_id_frame(&completion.id)));
            frames.extend(completion.chunks(include_usage));
            frames.push(Bytes::from_static(DONE_FRAME.as_bytes()));
            event_stream(frames)
        } else {
            json_response(StatusCode::OK, completion.to_json())
        };
        res.extensions_mut().insert(granted);
        res
    }
}

async fn chat_completions(State(router): State<SimRouter>, body: Bytes) -> Response {
    router.handle(Endpoint::Chat, &body)
}

async fn completions(State(router): State<SimRouter>, body: Bytes) -> Response {
    router.handle(Endpoint::Completions, &body)
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The part of an OpenAI request body the simulation reads; other fields are ignored.
#[derive(Deserialize)]
struct CompletionRequest {
    model: String,
    #[serde(default)]
    messages: Option<Vec<Message>>,
    #[serde(default)]
    prompt: Option<Prompt>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    nvext: Option<NvExt>,
}

#[derive(Deserialize)]
struct Message {
    #[serde(default)]
    content: Option<Content>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize)]
struct ContentPart {
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Prompt {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Deserialize)]
struct NvExt {
    #[serde(default)]
    annotations: Option<Vec<String>>,
}

impl CompletionRequest {
    /// The prompt as text: the messages' text for chat, the prompt for completions.
    fn prompt_text(&self, endpoint: Endpoint) -> Result<String, String> {
        match endpoint {
            Endpoint::Chat => {
                let messages = self
                    .messages
                    .as_ref()
                    .ok_or("`messages` is required for /v1/chat/completions")?;
                if messages.is_empty() {
                    return Err("`messages` must not be empty".to_owned());
                }
                let mut text = Vec::new();
                for message in messages {
                    match &message.content {
                        Some(Content::Text(t)) => text.push(t.as_str()),
                        Some(Content::Parts(parts)) => {
                            text.extend(parts.iter().filter_map(|p| p.text.as_deref()))
                        }
                        None => {}
                    }
                }
                Ok(text.join("\n"))
            }
            Endpoint::Completions => match &self.prompt {
                Some(Prompt::One(prompt)) => Ok(prompt.clone()),
                Some(Prompt::Many(prompts)) if prompts.len() == 1 => Ok(prompts[0].clone()),
                Some(Prompt::Many(_)) => {
                    Err("this simulated router takes exactly one prompt per request".to_owned())
                }
                None => Err("`prompt` is required for /v1/completions".to_owned()),
            },
        }
    }
}

/// The echo model: the prompt's words, cycled, `max_tokens` of them; a word is a token.
fn echo_tokens(prompt: &str, max_tokens: u64) -> Vec<String> {
    let mut words: Vec<&str> = prompt.split_whitespace().collect();
    if words.is_empty() {
        words.push("...");
    }
    words
        .iter()
        .cycle()
        .take(max_tokens as usize)
        .enumerate()
        .map(|(i, w)| {
            if i == 0 {
                (*w).to_owned()
            } else {
                format!(" {w}")
            }
        })
        .collect()
}

/// A deterministic id: the same prompt served the same number of times before gets the same id,
/// so two routers that saw the same requests answer byte for byte the same.
fn completion_id(endpoint: Endpoint, prompt: &str, served_before: u64) -> String {
    // FNV-1a, 64 bits.
    let hash = prompt.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    let prefix = match endpoint {
        Endpoint::Chat => "chatcmpl",
        Endpoint::Completions => "cmpl",
    };
    format!("{prefix}-{hash:016x}-{served_before}")
}

/// The `created` timestamp: when this process first served a request, so that responses do not
/// depend on the second they were made in.
fn created() -> u64 {
    static CREATED: OnceLock<u64> = OnceLock::new();
    *CREATED.get_or_init(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
    })
}

struct Completion {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    prompt_tokens: u64,
    tokens: Vec<String>,
}

#[derive(Serialize)]
struct Usage {
    prompt_tokens: u64,
    completion_tokens: u64,
    total_tokens: u64,
}

#[derive(Serialize)]
struct Envelope<'a, C> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<C>,
    /// Absent, `null` (stream chunks with `include_usage`), or the usage.
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Option<Usage>>,
}

#[derive(Serialize)]
struct ChatChoice<'a> {
    index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    message: Option<ChatMessage<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    delta: Option<Delta<'a>>,
    logprobs: Option<()>,
    finish_reason: Option<&'static str>,
}

#[derive(Serialize)]
struct ChatMessage<'a> {
    role: &'static str,
    content: &'a str,
}

#[derive(Serialize, Default)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
}

#[derive(Serialize)]
struct TextChoice<'a> {
    index: u32,
    text: &'a str,
    logprobs: Option<()>,
    finish_reason: Option<&'static str>,
}

impl Completion {
    fn usage(&self) -> Usage {
        let completion_tokens = self.tokens.len() as u64;
        Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens,
            total_tokens: self.prompt_tokens + completion_tokens,
        }
    }

    fn envelope<C>(
        &self,
        object: &'static str,
        choices: Vec<C>,
        usage: Option<Option<Usage>>,
    ) -> Envelope<'_, C> {
        Envelope {
            id: &self.id,
            object,
            created: self.created,
            model: &self.model,
            choices,
            usage,
        }
    }

    /// The non-streamed response body.
    fn to_json(&self) -> Vec<u8> {
        let text = self.tokens.concat();
        let usage = Some(Some(self.usage()));
        let json = match self.endpoint {
            Endpoint::Chat => serde_json::to_vec(&self.envelope(
                "chat.completion",
                vec![ChatChoice {
                    index: 0,
                    message: Some(ChatMessage {
                        role: "assistant",
                        content: &text,
                    }),
                    delta: None,
                    logprobs: None,
                    finish_reason: Some("length"),
                }],
                usage,
            )),
            Endpoint::Completions => serde_json::to_vec(&self.envelope(
                "text_completion",
                vec![TextChoice {
                    index: 0,
                    text: &text,
                    logprobs: None,
                    finish_reason: Some("length"),
                }],
                usage,
            )),
        };
        json.expect("completions serialize")
    }

    /// The streamed response's `data` frames, `[DONE]` excluded.
    fn chunks(&self, include_usage: bool) -> Vec<Bytes> {
        // With `include_usage`, every chunk carries `"usage": null` and a last chunk the usage.
        let usage_field = || include_usage.then_some(None);
        let mut out = Vec::new();
        let mut push = |json: serde_json::Result<Vec<u8>>| {
            let json = json.expect("chunks serialize");
            let mut frame = Vec::with_capacity(json.len() + 8);
            frame.extend_from_slice(b"data: ");
            frame.extend_from_slice(&json);
            frame.extend_from_slice(b"\n\n");
            out.push(Bytes::from(frame));
        };
        match self.endpoint {
            Endpoint::Chat => {
                let chunk = |delta: Delta<'_>, finish_reason| {
                    serde_json::to_vec(&self.envelope(
                        "chat.completion.chunk",
                        vec![ChatChoice {
                            index: 0,
                            message: None,
                            delta: Some(delta),
                            logprobs: None,
                            finish_reason,
                        }],
                        usage_field(),
                    ))
                };
                push(chunk(
                    Delta {
                        role: Some("assistant"),
                        content: Some(""),
                    },
                    None,
                ));
                for token in &self.tokens {
                    push(chunk(
                        Delta {
                            role: None,
                            content: Some(token),
                        },
                        None,
                    ));
                }
                push(chunk(Delta::default(), Some("length")));
                if include_usage {
                    let last: Vec<ChatChoice<'_>> = Vec::new();
                    push(serde_json::to_vec(&self.envelope(
                        "chat.completion.chunk",
                        last,
                        Some(Some(self.usage())),
                    )));
                }
            }
            Endpoint::Completions => {
                let chunk = |text, finish_reason| {
                    serde_json::to_vec(&self.envelope(
                        "text_completion",
                        vec![TextChoice {
                            index: 0,
                            text,
                            logprobs: None,
                            finish_reason,
                        }],
                        usage_field(),
                    ))
                };
                for token in &self.tokens {
                    push(chunk(token, None));
                }
                push(chunk("", Some("length")));
                if include_usage {
                    let last: Vec<TextChoice<'_>> = Vec::new();
                    push(serde_json::to_vec(&self.envelope(
                        "text_completion",
                        last,
                        Some(Some(self.usage())),
                    )));
                }
            }
        }
        out
    }
}

/// A `text/event-stream` response that sends each frame as its own body chunk.
fn event_stream(frames: Vec<Bytes>) -> Response {
    let body = Body::from_stream(futures_util::stream::iter(
        frames.into_iter().map(Ok::<_, Infallible>),
    ));
    let mut res = Response::new(body);
    let headers = res.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    res
}

fn json_response(status: StatusCode, json: Vec<u8>) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], json).into_response()
}

/// A 400 with an OpenAI-style JSON error body.
fn bad_request(message: &str) -> Response {
    let json = serde_json::json!({
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": null,
            "code": null,
        }
    });
    json_response(StatusCode::BAD_REQUEST, json.to_string().into_bytes())
}

/// Serves `router` on `listener` until `shutdown` completes, then finishes the requests in flight.
pub async fn serve<F>(listener: TcpListener, router: SimRouter, shutdown: F) -> io::Result<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    axum::serve(listener, router.app())
        .with_graceful_shutdown(shutdown)
        .await
}

/// A router served in the background on `127.0.0.1`, stopped when this is dropped.
pub struct Running {
    /// Where it listens.
    pub addr: SocketAddr,
    /// The router, to read its worker's log.
    pub router: SimRouter,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<io::Result<()>>>,
}

impl Running {
    /// Stops the server and waits for it to finish.
    pub async fn stop(mut self) -> io::Result<()> {
        drop(self.stop.take());
        match self.task.take() {
            Some(task) => task.await.map_err(io::Error::other)?,
            None => Ok(()),
        }
    }

    /// `POST`s `body` to `path` on this server.
    pub async fn post(&self, path: &str, body: impl Into<Bytes>) -> Result<Reply, BoxError> {
        http_post(self.addr, path, body.into()).await
    }

    /// `POST`s `json` to `path` on this server.
    pub async fn post_json(&self, path: &str, json: &serde_json::Value) -> Result<Reply, BoxError> {
        self.post(path, json.to_string()).await
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // Dropping the sender completes the shutdown future.
        drop(self.stop.take());
    }
}

/// Serves a new [`SimRouter`] on `127.0.0.1`, on a port the system picks.
pub async fn spawn(with_layer: bool) -> io::Result<Running> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
    let addr = listener.local_addr()?;
    let router = SimRouter::new(with_layer);
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(serve(listener, router.clone(), async {
        let _ = stopped.await;
    }));
    Ok(Running {
        addr,
        router,
        stop: Some(stop),
        task: Some(task),
    })
}

/// An error from the client helpers.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A response as a client received it.
#[derive(Debug)]
pub struct Reply {
    /// The status code.
    pub status: StatusCode,
    /// The response headers.
    pub headers: HeaderMap,
    /// The body, byte for byte.
    pub body: Bytes,
}

impl Reply {
    /// The response's `content-type`, or `""`.
    pub fn content_type(&self) -> &str {
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
pub async fn http_post(addr: SocketAddr, path: &str, body: Bytes) -> Result<Reply, BoxError> {
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
pub fn request(
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
pub fn with_annotations(mut request: serde_json::Value, annotations: &[&str]) -> serde_json::Value {
    request["nvext"] = serde_json::json!({ "annotations": annotations });
    request
}

/// The path of `endpoint`.
pub fn path(endpoint: Endpoint) -> &'static str {
    match endpoint {
        Endpoint::Chat => "/v1/chat/completions",
        Endpoint::Completions => "/v1/completions",
    }
}

/// Splits an event stream into its frames, each with its closing empty line (`\n\n`).
pub fn frames(body: &[u8]) -> Vec<&[u8]> {
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
pub fn streamed_text(body: &[u8]) -> Result<String, BoxError> {
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
pub fn stream_id(body: &[u8]) -> Result<String, BoxError> {
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
pub fn escape(bytes: &[u8]) -> String {
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
