//! A simulated disaggregated LLM router with an OpenAI-compatible HTTP API, shared by the `router`
//! and `demo` examples and by its test, `tests.rs` beside it.
//!
//! It reproduces the Dynamo behaviour this crate exists for. The router remembers the prompts it
//! has served (a hash of each, the last 100,000); a request whose prompt it has seen before is a
//! prefix-cache hit, so the router
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
//! Its memory is bounded in bytes: the prefix cache holds 64-bit hashes, not prompts, and the
//! worker's log keeps the newest 1024 requests within [`WORKER_LOG_BYTES`], each with at most
//! [`WORKER_LOG_ANNOTATION_BYTES`] of its annotations.
//!
//! The model is an echo model: the completion is the prompt's words, repeated until `max_tokens`
//! (16 by default) words have been produced, one word per streamed chunk.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::future::Future;
use std::hash::{Hash, Hasher};
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tower_bypass_marker::{BypassMarkerLayer, RequestedAnnotations};

use super::client::{http_post, BoxError, Reply};

/// The frame the router prepends to the stream of a request that bypassed remote prefill.
pub(crate) const BYPASS_FRAME: &str = "event: x-bypass-remote-prefill\n: true\n\n";

/// The frame the router prepends to every stream (after [`BYPASS_FRAME`], if any): `event:
/// request_id` and the completion's `id` as a JSON string in a comment, no `data` line.
pub(crate) fn request_id_frame(id: &str) -> String {
    let id = serde_json::to_string(id).expect("a string serializes");
    format!("event: request_id\n: {id}\n\n")
}

/// The last frame of every stream.
pub(crate) const DONE_FRAME: &str = "data: [DONE]\n\n";

/// The completion length when the request does not set `max_tokens`.
pub(crate) const DEFAULT_MAX_TOKENS: u64 = 16;

/// The largest `max_tokens` the simulated worker accepts.
pub(crate) const MAX_TOKENS_LIMIT: u64 = 4096;

/// How many prompts the prefix cache holds before it is emptied. It keeps a 64-bit hash of each
/// prompt, not the prompt, so it holds at most about 100,000 x 32 bytes (3.2 MB), however long
/// the prompts.
const PREFIX_CACHE_ENTRIES: usize = 100_000;

/// How many requests the worker's log keeps, the newest.
const WORKER_LOG_ENTRIES: usize = 1024;

/// The most bytes the worker's log keeps, counted by [`WorkerRequest::bytes`]: the oldest
/// requests go first.
pub(crate) const WORKER_LOG_BYTES: usize = 4 << 20;

/// The most bytes of annotations kept for one request in the worker's log; the rest are counted
/// in [`WorkerRequest::annotations_dropped`].
pub(crate) const WORKER_LOG_ANNOTATION_BYTES: usize = 64 << 10;

/// The layer the simulated router is served with: Dynamo's marker and the `request_id` frame the
/// router prepends to every stream both reach only the clients that asked for them.
pub(crate) fn layer() -> BypassMarkerLayer {
    BypassMarkerLayer::new().opt_in("request_id")
}

/// The simulated router's axum app, with a new prefix cache, wrapped in [`layer()`] when
/// `with_layer` is true. Use [`SimRouter`] to also read what its worker was handed.
pub(crate) fn app(with_layer: bool) -> axum::Router {
    SimRouter::new(with_layer).app()
}

/// The OpenAI endpoints the router serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Endpoint {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/completions`.
    Completions,
}

/// What the simulated worker was handed for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WorkerRequest {
    /// The endpoint the request came in on.
    pub(crate) endpoint: Endpoint,
    /// The request's `nvext.annotations`, after the guard when the router has the layer.
    pub(crate) annotations: Vec<String>,
    /// Whether the router bypassed remote prefill (a prefix-cache hit).
    pub(crate) bypass_remote_prefill: bool,
    /// Whether the response was streamed.
    pub(crate) stream: bool,
    /// How many of the request's annotations are not in `annotations`: those past
    /// [`WORKER_LOG_ANNOTATION_BYTES`].
    pub(crate) annotations_dropped: usize,
}

impl WorkerRequest {
    /// The request as logged: its annotations up to [`WORKER_LOG_ANNOTATION_BYTES`].
    fn logged(
        endpoint: Endpoint,
        mut annotations: Vec<String>,
        bypass_remote_prefill: bool,
        stream: bool,
    ) -> Self {
        let mut bytes = 0;
        let kept = annotations
            .iter()
            .take_while(|a| {
                bytes += annotation_bytes(a);
                bytes <= WORKER_LOG_ANNOTATION_BYTES
            })
            .count();
        let annotations_dropped = annotations.len() - kept;
        annotations.truncate(kept);
        annotations.shrink_to_fit();
        Self {
            endpoint,
            annotations,
            bypass_remote_prefill,
            stream,
            annotations_dropped,
        }
    }

    /// The heap and inline bytes this entry holds in the log.
    pub(crate) fn bytes(&self) -> usize {
        std::mem::size_of::<Self>()
            + self
                .annotations
                .iter()
                .map(|a| annotation_bytes(a))
                .sum::<usize>()
    }
}

/// What one annotation costs in the log: its `String` and its bytes.
fn annotation_bytes(annotation: &str) -> usize {
    std::mem::size_of::<String>() + annotation.len()
}

/// The worker's log: the newest requests, at most [`WORKER_LOG_ENTRIES`] and
/// [`WORKER_LOG_BYTES`].
#[derive(Default)]
struct WorkerLog {
    entries: VecDeque<WorkerRequest>,
    bytes: usize,
}

impl WorkerLog {
    fn push(&mut self, entry: WorkerRequest) {
        self.bytes += entry.bytes();
        self.entries.push_back(entry);
        while self.entries.len() > WORKER_LOG_ENTRIES || self.bytes > WORKER_LOG_BYTES {
            let oldest = self
                .entries
                .pop_front()
                .expect("over a limit, so not empty");
            self.bytes -= oldest.bytes();
        }
    }
}

/// The prefix cache's key for a prompt: a hash, so that an entry's size does not depend on the
/// prompt's length. SipHash with fixed keys: the same in every run.
fn prompt_key(endpoint: Endpoint, prompt: &str) -> (Endpoint, u64) {
    #[allow(deprecated)] // SipHasher: a stable, keyed-by-constant hash is all this needs
    let mut hasher = std::hash::SipHasher::new();
    prompt.hash(&mut hasher);
    (endpoint, hasher.finish())
}

/// The simulated router: its prefix cache, its worker's log and, optionally, the layer.
///
/// Cloning it shares the state.
#[derive(Clone)]
pub(crate) struct SimRouter {
    shared: Arc<Shared>,
}

/// Where the router compresses its responses (tower-http's `CompressionLayer`, event streams
/// included), if at all: outside the layer (the documented order) or inside it (the order that
/// used to answer every client asking for gzip with a 502).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Compression {
    /// No compression layer.
    #[default]
    None,
    /// `CompressionLayer` added after the layer: outermost, it compresses the filtered stream.
    Outside,
    /// `CompressionLayer` added before the layer: inside it, below the filter.
    Inside,
}

/// tower-http's default predicate, less its exception for `text/event-stream`.
fn compress_event_streams() -> tower_http::compression::CompressionLayer<
    tower_http::compression::predicate::And<
        tower_http::compression::predicate::And<
            tower_http::compression::predicate::SizeAbove,
            tower_http::compression::predicate::NotForContentType,
        >,
        tower_http::compression::predicate::NotForContentType,
    >,
> {
    use tower_http::compression::predicate::{NotForContentType, Predicate, SizeAbove};
    tower_http::compression::CompressionLayer::new().compress_when(
        SizeAbove::default()
            .and(NotForContentType::GRPC)
            .and(NotForContentType::IMAGES),
    )
}

struct Shared {
    layer: Option<BypassMarkerLayer>,
    compression: Compression,
    /// How many times each prompt (by [`prompt_key`]) has been served: the prefix cache.
    seen: Mutex<HashMap<(Endpoint, u64), u64>>,
    worker_log: Mutex<WorkerLog>,
}

impl SimRouter {
    /// A router with an empty prefix cache, served with [`layer()`] when `with_layer` is true.
    pub(crate) fn new(with_layer: bool) -> Self {
        Self::with_compression(with_layer, Compression::None)
    }

    /// A router as [`new`](Self::new) makes it, compressing where `compression` says.
    pub(crate) fn with_compression(with_layer: bool, compression: Compression) -> Self {
        Self {
            shared: Arc::new(Shared {
                layer: with_layer.then(layer),
                compression,
                seen: Mutex::default(),
                worker_log: Mutex::default(),
            }),
        }
    }

    /// Whether the router is served with the layer.
    pub(crate) fn has_layer(&self) -> bool {
        self.shared.layer.is_some()
    }

    /// The axum app: both endpoints, wrapped in the layer if the router has one.
    pub(crate) fn app(&self) -> axum::Router {
        let app = axum::Router::new()
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/completions", post(completions))
            .with_state(self.clone());
        let app = match self.shared.compression {
            Compression::Inside => app.layer(compress_event_streams()),
            Compression::None | Compression::Outside => app,
        };
        let app = match &self.shared.layer {
            Some(layer) => app.layer(layer.clone()),
            None => app,
        };
        match self.shared.compression {
            Compression::Outside => app.layer(compress_event_streams()),
            Compression::None | Compression::Inside => app,
        }
    }

    /// What the simulated worker has been handed (the last 1024 requests, at most
    /// [`WORKER_LOG_BYTES`]), oldest first.
    pub(crate) fn worker_log(&self) -> Vec<WorkerRequest> {
        lock(&self.shared.worker_log)
            .entries
            .iter()
            .cloned()
            .collect()
    }

    /// The bytes the worker's log holds, by [`WorkerRequest::bytes`].
    pub(crate) fn worker_log_bytes(&self) -> usize {
        lock(&self.shared.worker_log).bytes
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
            let count = seen.entry(prompt_key(endpoint, &prompt)).or_insert(0);
            *count += 1;
            *count - 1
        };
        let bypass = served_before > 0;
        {
            let entry = WorkerRequest::logged(endpoint, annotations, bypass, stream);
            lock(&self.shared.worker_log).push(entry);
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
pub(crate) async fn serve<F>(
    listener: TcpListener,
    router: SimRouter,
    shutdown: F,
) -> io::Result<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    axum::serve(listener, router.app())
        .with_graceful_shutdown(shutdown)
        .await
}

/// A router served in the background on `127.0.0.1`, stopped when this is dropped.
pub(crate) struct Running {
    /// Where it listens.
    pub(crate) addr: SocketAddr,
    /// The router, to read its worker's log.
    pub(crate) router: SimRouter,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<io::Result<()>>>,
}

impl Running {
    /// Stops the server and waits for it to finish.
    pub(crate) async fn stop(mut self) -> io::Result<()> {
        drop(self.stop.take());
        match self.task.take() {
            Some(task) => task.await.map_err(io::Error::other)?,
            None => Ok(()),
        }
    }

    /// `POST`s `body` to `path` on this server.
    pub(crate) async fn post(&self, path: &str, body: impl Into<Bytes>) -> Result<Reply, BoxError> {
        http_post(self.addr, path, body.into()).await
    }

    /// `POST`s `json` to `path` on this server.
    pub(crate) async fn post_json(
        &self,
        path: &str,
        json: &serde_json::Value,
    ) -> Result<Reply, BoxError> {
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
pub(crate) async fn spawn(with_layer: bool) -> io::Result<Running> {
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
