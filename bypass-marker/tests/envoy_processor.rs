//! The Envoy external processor over a real gRPC connection on 127.0.0.1,
//! driven by envoy-types' generated tonic client as Envoy drives it with the documented
//! configuration (request body BUFFERED, response body STREAMED, mode override allowed).
//!
//! Each exchange is played twice: through the processor, applying its answers the way Envoy
//! applies them (header and body mutations, mode overrides, local replies), and through the tower
//! stack (`BypassMarkerLayer` + `JsonGuardLayer`) with the same request and the same response
//! chunks. The bytes the upstream receives, the bytes the client receives and the refusals must
//! be identical.
use test_support::{logs, serve};

mod support;

use std::convert::Infallible;
use std::net::SocketAddr;

use bypass_marker::budget;
use bypass_marker::envoy::{self, ExtProc};
use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap as ProtoHeaderMap, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation::Mutation, external_processor_client::ExternalProcessorClient,
    processing_request::Request as Msg, processing_response::Response as Answer, CommonResponse,
    HeaderMutation, HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
    ProtocolConfiguration,
};
use http::{header, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use serve::{concat, data, frames_body, read_all, MARKER, PATIENCE};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Code, Status, Streaming};
use tower::{service_fn, ServiceBuilder, ServiceExt};
use tower_bypass_marker::json::JsonGuardBody;
use tower_bypass_marker::{BypassMarkerLayer, Overflow};

// ---------------------------------------------------------------------------------------------
// The processor on 127.0.0.1 and a client that plays Envoy

struct Server {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), tonic::transport::Error>>,
}

/// `processor` served by `envoy::serve` on 127.0.0.1, as the binary serves it.
async fn start(processor: ExtProc) -> Server {
    serve_on(|listener, stopped| {
        envoy::serve(listener, processor, async {
            let _ = stopped.await;
        })
    })
    .await
}

/// `service` alone in a tonic server of its own (no health), as a user would add it.
async fn start_own<S>(service: S) -> Server
where
    S: tower::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
            Error = Infallible,
        > + tonic::server::NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    serve_on(|listener, stopped| {
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(listener),
                async {
                    let _ = stopped.await;
                },
            )
    })
    .await
}

/// What `serve` makes of a listener on a free 127.0.0.1 port and the signal to stop, spawned.
async fn serve_on<F, Fut>(serve: F) -> Server
where
    F: FnOnce(tokio::net::TcpListener, oneshot::Receiver<()>) -> Fut,
    Fut: std::future::Future<Output = Result<(), tonic::transport::Error>> + Send + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(serve(listener, stopped));
    Server {
        addr,
        stop: Some(stop),
        task,
    }
}

/// `processor` served on 127.0.0.1, and a client connected to it.
async fn connected(processor: ExtProc) -> (Server, ExternalProcessorClient<Channel>) {
    let server = start(processor).await;
    let client = server.client().await;
    (server, client)
}

impl Server {
    async fn client(&self) -> ExternalProcessorClient<Channel> {
        ExternalProcessorClient::connect(format!("http://{}", self.addr))
            .await
            .unwrap()
            .max_decoding_message_size(64 << 20)
    }

    /// Stops the server and waits until it has returned.
    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(PATIENCE, self.task)
            .await
            .expect("the server did not stop")
            .unwrap()
            .unwrap();
    }
}

/// One gRPC stream: one HTTP request as Envoy reports it.
struct Stream {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: Streaming<ProcessingResponse>,
    sent: usize,
}

impl Stream {
    async fn open(client: &mut ExternalProcessorClient<Channel>) -> Stream {
        let (tx, rx) = process(client, 4).await;
        Stream { tx, rx, sent: 0 }
    }

    /// A stream on which Envoy has sent a GET's headers and a 200 response's headers with
    /// `content_type`, each answered: the response body comes next.
    async fn response(client: &mut ExternalProcessorClient<Channel>, content_type: &str) -> Stream {
        let mut stream = Stream::open(client).await;
        stream.call(get_request()).await.unwrap();
        stream.call(response_headers(content_type)).await.unwrap();
        stream
    }

    /// Sends one message and waits for its answer (Envoy waits for each in the documented modes).
    async fn call(&mut self, request: Msg) -> Result<ProcessingResponse, Status> {
        let msg = if self.sent == 0 {
            // Envoy announces its body modes in the first message.
            with_modes(request, BodySendMode::Buffered, BodySendMode::Streamed)
        } else {
            msg(request)
        };
        self.send(msg).await
    }

    /// Sends `msg` as it is (no body modes added) and waits for its answer.
    async fn send(&mut self, msg: ProcessingRequest) -> Result<ProcessingResponse, Status> {
        self.sent += 1;
        self.tx.send(msg).await.unwrap();
        match tokio::time::timeout(PATIENCE, self.rx.message())
            .await
            .unwrap()
        {
            Ok(Some(answer)) => Ok(answer),
            Ok(None) => panic!("the processor ended the stream cleanly instead of answering"),
            Err(status) => Err(status),
        }
    }

    /// Sends (a piece of) the request body: the processor's answer to it (`None`: the body goes
    /// on as it is).
    async fn request_body(&mut self, body: &[u8], end: bool) -> Option<CommonResponse> {
        let answer = self.call(request_body(body, end)).await.unwrap();
        let Some(Answer::RequestBody(b)) = answer.response else {
            panic!("unexpected answer to the request body: {answer:?}");
        };
        b.response
    }

    /// Sends a response chunk: the processor's answer to it (`None`: the chunk goes on as it is).
    async fn response_body(&mut self, chunk: &[u8], end: bool) -> Option<CommonResponse> {
        let answer = self.call(response_body(chunk, end)).await.unwrap();
        let Some(Answer::ResponseBody(b)) = answer.response else {
            panic!("unexpected answer to a response chunk: {answer:?}");
        };
        b.response
    }

    /// Ends Envoy's side (a client gone, an upstream reset): what the processor sends next
    /// (`Ok(None)` when it ends its side too).
    async fn close(self) -> Result<Option<ProcessingResponse>, Status> {
        let Stream { tx, mut rx, .. } = self;
        drop(tx);
        tokio::time::timeout(PATIENCE, rx.message()).await.unwrap()
    }
}

/// Opens a `Process` call: the sender of Envoy's messages (`buffer` of them may wait) and the
/// processor's answers.
async fn process(
    client: &mut ExternalProcessorClient<Channel>,
    buffer: usize,
) -> (
    mpsc::Sender<ProcessingRequest>,
    Streaming<ProcessingResponse>,
) {
    let (tx, rx) = mpsc::channel(buffer);
    let rx = tokio::time::timeout(PATIENCE, client.process(ReceiverStream::new(rx)))
        .await
        .unwrap()
        .unwrap()
        .into_inner();
    (tx, rx)
}

/// Headers as Envoy sends them: `raw_value` bytes (the default), or `value` strings.
fn proto_headers(pairs: &[(&str, &[u8])], raw: bool) -> ProtoHeaderMap {
    ProtoHeaderMap {
        headers: pairs
            .iter()
            .map(|(k, v)| HeaderValue {
                key: (*k).to_owned(),
                value: if raw {
                    String::new()
                } else {
                    String::from_utf8(v.to_vec()).unwrap()
                },
                raw_value: if raw { v.to_vec() } else { Vec::new() },
            })
            .collect(),
    }
}

fn headers_msg(pairs: &[(&str, &[u8])], end_of_stream: bool, raw: bool) -> HttpHeaders {
    HttpHeaders {
        headers: Some(proto_headers(pairs, raw)),
        end_of_stream,
        ..HttpHeaders::default()
    }
}

/// A message with no protocol configuration (as a stream's later messages, or an Envoy older than
/// 1.34, send it).
fn msg(request: Msg) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(request),
        ..ProcessingRequest::default()
    }
}

/// `request` with the body modes Envoy announces in a stream's first message.
fn with_modes(
    request: Msg,
    request_body: BodySendMode,
    response_body: BodySendMode,
) -> ProcessingRequest {
    ProcessingRequest {
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: request_body as i32,
            response_body_mode: response_body as i32,
            send_body_without_waiting_for_header_response: false,
        }),
        ..msg(request)
    }
}

fn body_msg(body: &[u8], end_of_stream: bool) -> HttpBody {
    HttpBody {
        body: body.to_vec(),
        end_of_stream,
        ..HttpBody::default()
    }
}

/// `request` as Envoy sends it in observability mode (it does not wait for the answers).
fn observed(request: Msg) -> ProcessingRequest {
    ProcessingRequest {
        observability_mode: true,
        ..msg(request)
    }
}

/// A GET's request headers: no body follows.
fn get_request() -> Msg {
    Msg::RequestHeaders(headers_msg(&[(":method", b"GET")], true, true))
}

/// A POST's request headers with `content_type`: a body follows.
fn post_request(content_type: &str) -> Msg {
    Msg::RequestHeaders(headers_msg(
        &[
            (":method", b"POST"),
            ("content-type", content_type.as_bytes()),
        ],
        false,
        true,
    ))
}

/// A 200 response's headers with `content_type`: a body follows.
fn response_headers(content_type: &str) -> Msg {
    Msg::ResponseHeaders(headers_msg(
        &[
            (":status", b"200"),
            ("content-type", content_type.as_bytes()),
        ],
        false,
        true,
    ))
}

/// The request body (buffered: all of it), or a piece of it; `end` on the last.
fn request_body(body: &[u8], end: bool) -> Msg {
    Msg::RequestBody(body_msg(body, end))
}

/// A piece of the response body; `end` on the last.
fn response_body(chunk: &[u8], end: bool) -> Msg {
    Msg::ResponseBody(body_msg(chunk, end))
}

/// `pseudo` headers, then `headers`: a list Envoy's header mutations edit.
fn header_list(
    pseudo: &[(&str, &[u8])],
    headers: &[(&'static str, Vec<u8>)],
) -> Vec<(String, Vec<u8>)> {
    pseudo
        .iter()
        .map(|(k, v)| ((*k).to_owned(), v.to_vec()))
        .chain(headers.iter().map(|(k, v)| ((*k).to_owned(), v.clone())))
        .collect()
}

/// [`headers_msg`] of a header list.
fn list_msg(headers: &[(String, Vec<u8>)], end_of_stream: bool, raw: bool) -> HttpHeaders {
    let pairs: Vec<(&str, &[u8])> = headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_slice()))
        .collect();
    headers_msg(&pairs, end_of_stream, raw)
}

// ---------------------------------------------------------------------------------------------
// One HTTP exchange, and what a client and an upstream see of it

#[derive(Clone)]
struct Exchange {
    method: &'static str,
    request_headers: Vec<(&'static str, Vec<u8>)>,
    request_body: Option<Bytes>,
    status: u16,
    response_headers: Vec<(&'static str, Vec<u8>)>,
    chunks: Vec<Bytes>,
    /// How Envoy reports the end of the response body: on the last chunk, or in an empty
    /// message after it (an upstream that ends with an empty DATA frame).
    separate_end: bool,
    /// Header values in `value` rather than `raw_value`.
    string_values: bool,
}

impl Exchange {
    fn chat(body: &str, response: &[Bytes]) -> Exchange {
        Exchange {
            method: "POST",
            request_headers: vec![
                ("content-type", b"application/json".to_vec()),
                ("content-length", body.len().to_string().into_bytes()),
            ],
            request_body: Some(Bytes::copy_from_slice(body.as_bytes())),
            status: 200,
            response_headers: vec![("content-type", b"text/event-stream".to_vec())],
            chunks: response.to_vec(),
            separate_end: false,
            string_values: false,
        }
    }

    fn response_type(mut self, content_type: &str) -> Self {
        self.response_headers = vec![("content-type", content_type.as_bytes().to_vec())];
        self
    }
}

#[derive(Debug, PartialEq)]
enum Seen {
    /// Refused before the upstream: what the client got.
    Refused {
        status: u16,
        content_type: Vec<u8>,
        body: Bytes,
    },
    /// Forwarded, but the response was replaced by the filter's own error (an encoded event
    /// stream): the request body the upstream got, and what the client got instead.
    ResponseRefused {
        upstream_body: Option<Bytes>,
        status: u16,
        content_type: Vec<u8>,
        body: Bytes,
    },
    /// Forwarded: the request body the upstream got (and its content-length), the response
    /// body the client got (and whether it still had content-length).
    Forwarded {
        upstream_body: Option<Bytes>,
        upstream_length: Option<Vec<u8>>,
        client_body: Bytes,
        client_length: bool,
    },
}

/// What Envoy does with the processor's answers, for one exchange; also returns the number of
/// messages it sent.
async fn through_envoy(
    client: &mut ExternalProcessorClient<Channel>,
    ex: &Exchange,
) -> (Seen, usize) {
    let raw = !ex.string_values;
    let mut stream = Stream::open(client).await;
    let mut request_headers = header_list(
        &[
            (":method", ex.method.as_bytes()),
            (":path", b"/v1/chat/completions"),
            (":authority", b"gateway"),
        ],
        &ex.request_headers,
    );
    let head = list_msg(&request_headers, ex.request_body.is_none(), raw);
    let answer = stream.call(Msg::RequestHeaders(head)).await.unwrap();
    let mut request_body_mode = BodySendMode::Buffered as i32;
    let mut response_body_mode = BodySendMode::Streamed as i32;
    if let Some(mode) = &answer.mode_override {
        request_body_mode = mode.request_body_mode;
        response_body_mode = mode.response_body_mode;
    }
    let common = match answer.response.unwrap() {
        Answer::RequestHeaders(h) => h.response,
        Answer::ImmediateResponse(i) => return (refused(i), stream.sent),
        other => panic!("unexpected answer to request headers: {other:?}"),
    };
    apply_headers(&mut request_headers, common.as_ref());
    let mut upstream_body = ex.request_body.clone();
    if let Some(body) = &ex.request_body {
        if request_body_mode == BodySendMode::Buffered as i32 {
            let answer = stream.call(request_body(body, true)).await.unwrap();
            assert!(answer.mode_override.is_none());
            let common = match answer.response.unwrap() {
                Answer::RequestBody(b) => b.response,
                Answer::ImmediateResponse(i) => return (refused(i), stream.sent),
                other => panic!("unexpected answer to the request body: {other:?}"),
            };
            apply_headers(&mut request_headers, common.as_ref());
            if let Some(new) = replaced(common.as_ref()) {
                upstream_body = Some(new);
            }
        } else {
            assert_eq!(request_body_mode, BodySendMode::None as i32);
        }
    }
    let upstream_length = request_headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .map(|(_, v)| v.clone());

    // The response.
    let status = ex.status.to_string();
    let mut response_headers = header_list(&[(":status", status.as_bytes())], &ex.response_headers);
    let head = list_msg(&response_headers, ex.chunks.is_empty(), raw);
    let answer = stream.call(Msg::ResponseHeaders(head)).await.unwrap();
    if let Some(mode) = &answer.mode_override {
        response_body_mode = mode.response_body_mode;
    }
    if let Some(Answer::ImmediateResponse(i)) = answer.response {
        let Seen::Refused {
            status,
            content_type,
            body,
        } = refused(i)
        else {
            unreachable!()
        };
        let seen = Seen::ResponseRefused {
            upstream_body,
            status,
            content_type,
            body,
        };
        return (seen, stream.sent);
    }
    let Some(Answer::ResponseHeaders(h)) = answer.response else {
        panic!("unexpected answer to response headers: {answer:?}");
    };
    apply_headers(&mut response_headers, h.response.as_ref());
    let mut client_body = Vec::new();
    if response_body_mode == BodySendMode::Streamed as i32 {
        let last = ex.chunks.len().saturating_sub(1);
        for (i, chunk) in ex.chunks.iter().enumerate() {
            let end = i == last && !ex.separate_end;
            forward_chunk(&mut stream, chunk, end, &mut client_body).await;
        }
        if ex.separate_end && !ex.chunks.is_empty() {
            forward_chunk(&mut stream, &Bytes::new(), true, &mut client_body).await;
        }
    } else {
        assert_eq!(response_body_mode, BodySendMode::None as i32);
        for chunk in &ex.chunks {
            client_body.extend_from_slice(chunk);
        }
    }
    let client_length = response_headers.iter().any(|(k, _)| k == "content-length");
    let seen = Seen::Forwarded {
        upstream_body,
        upstream_length,
        client_body: client_body.into(),
        client_length,
    };
    (seen, stream.sent)
}

/// Sends a response chunk and adds to `client_body` what the client gets of it.
async fn forward_chunk(stream: &mut Stream, chunk: &Bytes, end: bool, client_body: &mut Vec<u8>) {
    match replaced(stream.response_body(chunk, end).await.as_ref()) {
        Some(new) => client_body.extend_from_slice(&new),
        None => client_body.extend_from_slice(chunk),
    }
}

fn refused(i: envoy_types::pb::envoy::service::ext_proc::v3::ImmediateResponse) -> Seen {
    let headers = i.headers.unwrap_or_default();
    let content_type = headers
        .set_headers
        .iter()
        .filter_map(|o| o.header.as_ref())
        .find(|h| h.key.eq_ignore_ascii_case("content-type"))
        .map(|h| {
            if h.raw_value.is_empty() {
                h.value.clone().into_bytes()
            } else {
                h.raw_value.clone()
            }
        })
        .expect("a refusal without content-type");
    Seen::Refused {
        status: u16::try_from(i.status.unwrap().code).unwrap(),
        content_type,
        body: i.body.into(),
    }
}

/// Envoy's header mutation: removals, then values set (overwriting).
fn apply_headers(headers: &mut Vec<(String, Vec<u8>)>, common: Option<&CommonResponse>) {
    let Some(HeaderMutation {
        set_headers,
        remove_headers,
    }) = common.and_then(|c| c.header_mutation.as_ref())
    else {
        return;
    };
    for name in remove_headers {
        headers.retain(|(k, _)| !k.eq_ignore_ascii_case(name));
    }
    for option in set_headers {
        let h = option.header.as_ref().unwrap();
        assert!(
            h.value.is_empty() || h.raw_value.is_empty(),
            "Envoy rejects both set"
        );
        let value = if h.raw_value.is_empty() {
            h.value.clone().into_bytes()
        } else {
            h.raw_value.clone()
        };
        headers.retain(|(k, _)| !k.eq_ignore_ascii_case(&h.key));
        headers.push((h.key.to_ascii_lowercase(), value));
    }
}

/// The bytes that replace the chunk (or the buffered body), if the answer replaces it.
fn replaced(common: Option<&CommonResponse>) -> Option<Bytes> {
    match common?.body_mutation.as_ref()?.mutation.as_ref()? {
        Mutation::Body(b) => Some(Bytes::copy_from_slice(b)),
        Mutation::ClearBody(true) => Some(Bytes::new()),
        Mutation::ClearBody(false) => None,
        Mutation::StreamedResponse(_) => panic!("not in the documented modes"),
    }
}

/// The same exchange through the tower stack: the layer and the JSON guard around an upstream
/// that records the request body and answers with the exchange's response, chunk by chunk.
async fn through_tower(layer: &BypassMarkerLayer, max_body: usize, ex: &Exchange) -> Seen {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Bytes, Option<Vec<u8>>)>();
    let response = ex.clone();
    let upstream = service_fn(move |req: Request<JsonGuardBody<Full<Bytes>>>| {
        let tx = tx.clone();
        let response = response.clone();
        async move {
            let length = req
                .headers()
                .get(header::CONTENT_LENGTH)
                .map(|v| v.as_bytes().to_vec());
            let body = req.into_body().collect().await.unwrap().to_bytes();
            tx.send((body, length)).unwrap();
            let mut builder = Response::builder().status(response.status);
            for (k, v) in &response.response_headers {
                builder = builder.header(*k, v.as_slice());
            }
            let frames = response.chunks.iter().cloned().map(data).collect();
            Ok::<_, Infallible>(builder.body(frames_body(frames)).unwrap())
        }
    });
    let svc = ServiceBuilder::new()
        .layer(layer.clone())
        .layer(layer.json_guard().max_body_bytes(max_body))
        .service(upstream);
    let mut req = Request::builder()
        .method(ex.method)
        .uri("http://gateway/v1/chat/completions");
    for (k, v) in &ex.request_headers {
        req = req.header(*k, v.as_slice());
    }
    let req = req
        .body(Full::new(ex.request_body.clone().unwrap_or_default()))
        .unwrap();
    let res = svc.oneshot(req).await.unwrap();
    let status = res.status();
    let content_type = res
        .headers()
        .get(header::CONTENT_TYPE)
        .map(|v| v.as_bytes().to_vec());
    let client_length = res.headers().contains_key(header::CONTENT_LENGTH);
    let (client_body, _) = read_all(res.into_body()).await;
    match rx.try_recv() {
        Ok((upstream_body, _)) if status.as_u16() != ex.status => Seen::ResponseRefused {
            upstream_body: ex.request_body.as_ref().map(|_| upstream_body),
            status: status.as_u16(),
            content_type: content_type.unwrap_or_default(),
            body: client_body,
        },
        Ok((upstream_body, upstream_length)) => Seen::Forwarded {
            upstream_body: ex.request_body.as_ref().map(|_| upstream_body),
            upstream_length,
            client_body,
            client_length,
        },
        Err(_) => Seen::Refused {
            status: status.as_u16(),
            content_type: content_type.unwrap_or_default(),
            body: client_body,
        },
    }
}

/// Plays `ex` through the processor and through tower; they must agree. Returns what was seen
/// and the number of messages Envoy sent.
async fn same(
    client: &mut ExternalProcessorClient<Channel>,
    layer: &BypassMarkerLayer,
    ex: &Exchange,
) -> (Seen, usize) {
    let (envoy, messages) = through_envoy(client, ex).await;
    let tower = through_tower(layer, 32 << 20, ex).await;
    assert_eq!(
        envoy, tower,
        "processor and tower differ on chunks {:?}",
        ex.chunks
    );
    (envoy, messages)
}

fn client_body(seen: &Seen) -> &Bytes {
    match seen {
        Seen::Forwarded { client_body, .. } => client_body,
        Seen::Refused { .. } | Seen::ResponseRefused { .. } => panic!("refused: {seen:?}"),
    }
}

const CHAT: &str = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}"#;
const OPTED_IN: &str =
    r#"{"model":"m","nvext":{"annotations":["x-bypass-remote-prefill"]},"stream":true}"#;
const STREAM: &str = "event: x-bypass-remote-prefill\n: true\n\ndata: {\"id\":1}\n\ndata: {\"id\":2}\n\ndata: [DONE]\n\n";
const FILTERED: &str = "data: {\"id\":1}\n\ndata: {\"id\":2}\n\ndata: [DONE]\n\n";

fn one(s: &str) -> Vec<Bytes> {
    vec![Bytes::copy_from_slice(s.as_bytes())]
}

// ---------------------------------------------------------------------------------------------
// Message sequences

#[tokio::test]
async fn headers_only_request_and_a_json_response_cost_one_message_each_way() {
    let layer = BypassMarkerLayer::new();
    let (server, mut client) = connected(ExtProc::new(layer.clone())).await;
    // GET /v1/models: no request body, a JSON response whose body Envoy must not send.
    let ex = Exchange {
        method: "GET",
        request_headers: vec![],
        request_body: None,
        ..Exchange::chat("", &one(r#"{"data":[]}"#)).response_type("application/json")
    };
    let (seen, messages) = same(&mut client, &layer, &ex).await;
    assert_eq!(client_body(&seen), r#"{"data":[]}"#);
    assert_eq!(messages, 2, "request headers and response headers only");
    server.stop().await;
}

/// Counts the encoded streams refused.
#[derive(Default)]
struct EncodedRefusals(std::sync::Mutex<Vec<String>>);

impl tower_bypass_marker::FrameObserver for EncodedRefusals {
    fn encoded_stream_refused(&self, coding: &str) {
        self.0.lock().unwrap().push(coding.to_owned());
    }
}

/// Issue 27 item 2: an event stream the upstream gzipped cannot be filtered; the processor
/// answers an immediate 502 at the response headers (before any byte of the body reaches the
/// client), as the tower layer does, and tells the observer once. A client that opted in to every
/// name gets the stream untouched.
#[tokio::test]
async fn an_encoded_event_stream_gets_an_immediate_502_as_from_the_layer() {
    let refusals = std::sync::Arc::new(EncodedRefusals::default());
    let layer = BypassMarkerLayer::new().observe(refusals.clone());
    let (server, mut client) = connected(ExtProc::new(layer.clone())).await;
    let gzipped = |body: &str| Exchange {
        response_headers: vec![
            ("content-type", b"text/event-stream".to_vec()),
            ("content-encoding", b"gzip".to_vec()),
            ("content-length", b"80".to_vec()),
        ],
        ..Exchange::chat(body, &one(STREAM))
    };
    let (seen, _) = same(&mut client, &layer, &gzipped(CHAT)).await;
    let Seen::ResponseRefused {
        status,
        content_type,
        body,
        ..
    } = &seen
    else {
        panic!("not refused: {seen:?}")
    };
    assert_eq!(*status, 502);
    assert_eq!(content_type, b"application/json");
    let error: serde_json::Value = serde_json::from_slice(body).unwrap();
    assert_eq!(error["error"]["code"], "encoded_event_stream");
    assert_eq!(error["error"]["type"], "server_error");
    // Once for the processor, once for the tower stack it was compared with.
    assert_eq!(*refusals.0.lock().unwrap(), ["gzip", "gzip"]);

    let (seen, _) = same(&mut client, &layer, &gzipped(OPTED_IN)).await;
    assert_eq!(client_body(&seen), STREAM);
    assert_eq!(refusals.0.lock().unwrap().len(), 2);
    server.stop().await;
}

#[tokio::test]
async fn the_mode_override_for_a_passed_through_response_stops_its_body() {
    let layer = BypassMarkerLayer::new();
    let (server, mut client) = connected(ExtProc::new(layer.clone())).await;
    let mut stream = Stream::open(&mut client).await;
    let answer = stream.call(get_request()).await.unwrap();
    assert!(
        answer.mode_override.is_none(),
        "nothing to override for a request without body"
    );
    for (content_type, encoding) in [
        ("application/json", None::<&str>),
        ("application/grpc", None),
    ] {
        let mut pairs: Vec<(&str, &[u8])> = vec![
            (":status", b"200"),
            ("content-type", content_type.as_bytes()),
        ];
        if let Some(e) = encoding {
            pairs.push(("content-encoding", e.as_bytes()));
        }
        let mut s = Stream::open(&mut client).await;
        s.call(Msg::RequestHeaders(headers_msg(
            &[(":method", b"POST")],
            true,
            true,
        )))
        .await
        .unwrap();
        let answer = s
            .call(Msg::ResponseHeaders(headers_msg(&pairs, false, true)))
            .await
            .unwrap();
        let mode = answer.mode_override.expect("a mode override");
        assert_eq!(
            mode.response_body_mode,
            BodySendMode::None as i32,
            "{content_type}"
        );
        assert!(
            matches!(answer.response, Some(Answer::ResponseHeaders(h)) if h.response.is_none())
        );
    }
    // An event stream to a client that did not opt in is filtered: its body is asked for
    // STREAMED, whatever mode Envoy announced (or none, as Envoy before 1.34).
    let answer = stream
        .call(Msg::ResponseHeaders(headers_msg(
            &[
                (":status", b"200"),
                ("content-type", b"text/event-stream"),
                ("content-length", b"99"),
            ],
            false,
            true,
        )))
        .await
        .unwrap();
    let mode = answer.mode_override.expect("STREAMED asked for");
    assert_eq!(mode.response_body_mode, BodySendMode::Streamed as i32);
    let Some(Answer::ResponseHeaders(h)) = answer.response else {
        panic!()
    };
    let removed = &h.response.unwrap().header_mutation.unwrap().remove_headers;
    assert_eq!(removed, &["content-length"]);
    drop(stream); // graceful shutdown waits for streams in flight
    server.stop().await;
}

#[tokio::test]
async fn a_stream_in_one_chunk_and_in_many_chunks_matches_the_tower_layer() {
    let layer = BypassMarkerLayer::new().opt_in("request_id");
    let (server, mut client) = connected(ExtProc::new(layer.clone())).await;
    let stream = format!("{STREAM}event: request_id\n: \"r\"\n\n: keep-alive\n\n");
    let (seen, messages) = same(&mut client, &layer, &Exchange::chat(CHAT, &one(&stream))).await;
    assert_eq!(client_body(&seen), &format!("{FILTERED}: keep-alive\n\n"));
    assert_eq!(messages, 4);
    for sizes in [&[1usize][..], &[2], &[3, 7], &[5, 1, 13], &[40], &[17, 64]] {
        for separate_end in [false, true] {
            let mut ex = Exchange::chat(CHAT, &serve::chunked(stream.as_bytes(), sizes));
            ex.separate_end = separate_end;
            let (seen, _) = same(&mut client, &layer, &ex).await;
            assert_eq!(client_body(&seen), &format!("{FILTERED}: keep-alive\n\n"));
        }
    }
    server.stop().await;
}

#[tokio::test]
async fn the_marker_split_at_every_offset_across_two_chunks_matches_the_tower_layer() {
    let layer = BypassMarkerLayer::new();
    let (server, mut client) = connected(ExtProc::new(layer.clone())).await;
    // The marker in the middle, with CRLF line ends: the split falls inside it, on its line
    // ends and in the frames around it.
    let body = "data: {\"id\":1}\r\n\r\nevent: x-bypass-remote-prefill\r\n: true\r\n\r\ndata: [DONE]\r\n\r\n";
    for at in 0..=body.len() {
        let chunks = vec![
            Bytes::copy_from_slice(&body.as_bytes()[..at]),
            Bytes::copy_from_slice(&body.as_bytes()[at..]),
        ];
        let (seen, _) = same(&mut client, &layer, &Exchange::chat(CHAT, &chunks)).await;
        assert_eq!(
            client_body(&seen),
            "data: {\"id\":1}\r\n\r\ndata: [DONE]\r\n\r\n",
            "split at {at}"
        );
    }
    server.stop().await;
}

#[tokio::test]
async fn random_chunkings_of_a_dynamo_stream_match_the_tower_layer() {
    let layer = BypassMarkerLayer::dynamo().sdk_safe(true);
    let (server, mut client) = connected(ExtProc::new(layer.clone())).await;
    let body = format!(
        "\u{FEFF}{MARKER}event: request_id\n: \"r-1\"\n\nid: 7\n\ndata: {{\"a\":1}}\r\rdata: b\n\nevent: llm_metrics\ndata: {{}}\n\n: c\n\ndata: [DONE]\n\nevent: x-bypass-remote-prefill"
    );
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for round in 0..60 {
        let mut sizes = Vec::new();
        for _ in 0..8 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            sizes.push((seed % 24) as usize + 1);
        }
        let mut ex = Exchange::chat(CHAT, &serve::chunked(body.as_bytes(), &sizes));
        ex.separate_end = round % 2 == 1;
        ex.string_values = round % 3 == 0;
        same(&mut client, &layer, &ex).await;
    }
    server.stop().await;
}

#[tokio::test]
async fn a_frame_still_open_at_the_end_is_judged_as_it_stands() {
    let layer = BypassMarkerLayer::new();
    let (server, mut client) = connected(ExtProc::new(layer.clone())).await;
    for (body, expected) in [
        (
            "data: 1\n\nevent: x-bypass-remote-prefill\n: true",
            "data: 1\n\n",
        ),
        (
            "data: 1\n\nevent: x-bypass-remote-prefill\n: tr",
            "data: 1\n\n",
        ),
        ("data: 1\n\ndata: 2", "data: 1\n\ndata: 2"),
        (
            "event: x-bypass-remote-prefill\n: true\n\ndata: 2\n",
            "data: 2\n",
        ),
    ] {
        for at in 1..body.len() {
            for separate_end in [false, true] {
                let chunks = vec![
                    Bytes::copy_from_slice(&body.as_bytes()[..at]),
                    Bytes::copy_from_slice(&body.as_bytes()[at..]),
                ];
                let mut ex = Exchange::chat(CHAT, &chunks);
                ex.separate_end = separate_end;
                let (seen, _) = same(&mut client, &layer, &ex).await;
                assert_eq!(client_body(&seen), expected);
            }
        }
    }
    server.stop().await;
}

#[tokio::test]
async fn a_chunk_the_filter_keeps_whole_goes_back_without_a_body_mutation() {
    let layer = BypassMarkerLayer::new();
    let (server, mut client) = connected(ExtProc::new(layer.clone())).await;
    let mut stream = Stream::response(&mut client, "text/event-stream").await;
    let mut held = Vec::new();
    for (chunk, unchanged) in [
        ("data: 1\n\ndata: 2\n\n", true),
        (
            "event: x-bypass-remote-prefill\n: true\n\ndata: 3\n\n",
            false,
        ),
        ("data: 4\n\ndata: 5", false), // the open frame is held
        ("\n\n", false),               // and released with its end
        ("data: 6\n\n", true),
    ] {
        let answer = stream.response_body(chunk.as_bytes(), false).await;
        assert_eq!(answer.is_none(), unchanged, "{chunk:?}");
        held.push(
            replaced(answer.as_ref()).unwrap_or_else(|| Bytes::copy_from_slice(chunk.as_bytes())),
        );
    }
    assert_eq!(
        concat(&held),
        "data: 1\n\ndata: 2\n\ndata: 3\n\ndata: 4\n\ndata: 5\n\ndata: 6\n\n"
    );
    assert_eq!(held[2], "data: 4\n\n");
    assert_eq!(held[3], "data: 5\n\n");
    assert!(stream.response_body(b"", true).await.is_none());
    drop(stream); // graceful shutdown waits for streams in flight
    server.stop().await;
}

/// With a small `--max-body`, a response chunk as large as Envoy's buffer limit (1 MiB by
/// default, what a slow client makes Envoy send) is still filtered: the gRPC message limit is
/// never below a response chunk's room (it was the guard's limit plus 1 MiB, and such a stream
/// was reset).
#[tokio::test]
async fn a_response_chunk_of_envoys_buffer_limit_passes_under_a_small_max_body() {
    let (server, mut client) =
        connected(ExtProc::new(BypassMarkerLayer::new()).max_body_bytes(64 * 1024)).await;
    let mut stream = Stream::response(&mut client, "text/event-stream").await;
    let event = "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n";
    let mut chunk = String::from("event: x-bypass-remote-prefill\n: true\n\n");
    while chunk.len() < 2 << 20 {
        chunk.push_str(event);
    }
    // A 2 MiB response chunk is answered, with the marker removed.
    let answer = stream.response_body(chunk.as_bytes(), true).await;
    let body = replaced(answer.as_ref()).expect("the marker removed");
    assert_eq!(
        body,
        chunk["event: x-bypass-remote-prefill\n: true\n\n".len()..]
    );
    drop(stream);
    server.stop().await;
}

// ---------------------------------------------------------------------------------------------
// The request side

#[tokio::test]
async fn refusals_are_immediate_responses_with_the_guards_status_and_body() {
    let layer = BypassMarkerLayer::new();
    let (server, mut client) = connected(ExtProc::new(layer.clone())).await;
    let stream = one(STREAM);
    let cases: Vec<(Exchange, u16)> = vec![
        (Exchange::chat(r#"{"model":"m","#, &stream), 400),
        (
            Exchange::chat(
                r#"{"model":"m","nvext":{},"nvext":{"annotations":[]}}"#,
                &stream,
            ),
            400,
        ),
        (
            Exchange {
                request_headers: vec![
                    ("content-type", b"application/json".to_vec()),
                    ("content-encoding", b"gzip".to_vec()),
                ],
                ..Exchange::chat(CHAT, &stream)
            },
            415,
        ),
    ];
    for (ex, status) in cases {
        let (seen, _) = same(&mut client, &layer, &ex).await;
        let Seen::Refused {
            status: got,
            content_type,
            body,
        } = &seen
        else {
            panic!("not refused: {seen:?}");
        };
        assert_eq!(*got, status);
        assert_eq!(content_type, b"application/json");
        let error: serde_json::Value = serde_json::from_slice(body).unwrap();
        assert_eq!(error["error"]["type"], "invalid_request_error");
    }
    server.stop().await;
}

#[tokio::test]
async fn a_body_over_the_limit_is_refused_with_413() {
    let layer = BypassMarkerLayer::new();
    let (server, mut client) = connected(ExtProc::new(layer.clone()).max_body_bytes(64)).await;
    let body = format!(r#"{{"model":"m","pad":"{}"}}"#, "x".repeat(100));
    let ex = Exchange::chat(&body, &one(STREAM));
    let (envoy, _) = through_envoy(&mut client, &ex).await;
    let tower = through_tower(&layer, 64, &ex).await;
    assert_eq!(envoy, tower);
    assert!(
        matches!(envoy, Seen::Refused { status: 413, .. }),
        "{envoy:?}"
    );
    server.stop().await;
}

#[tokio::test]
async fn a_router_owned_name_is_spliced_out_of_the_body_and_content_length_updated() {
    let layer = BypassMarkerLayer::new().opt_in("request_id");
    let (server, mut client) = connected(ExtProc::new(layer.clone())).await;
    let body = r#"{"model":"m","nvext":{"annotations":["x-bypass-remote-prefill:true","request_id"]},"stream":true}"#;
    let response = vec![Bytes::from(format!(
        "{MARKER}event: request_id\n: \"r\"\n\ndata: 1\n\n"
    ))];
    for with_length in [true, false] {
        let mut ex = Exchange::chat(body, &response);
        if !with_length {
            ex.request_headers.retain(|(k, _)| *k != "content-length");
        }
        let (seen, _) = same(&mut client, &layer, &ex).await;
        let Seen::Forwarded {
            upstream_body,
            upstream_length,
            client_body,
            ..
        } = &seen
        else {
            panic!()
        };
        let spliced = r#"{"model":"m","nvext":{"annotations":["request_id"]},"stream":true}"#;
        assert_eq!(upstream_body.as_deref(), Some(spliced.as_bytes()));
        if with_length {
            assert_eq!(
                upstream_length.as_deref(),
                Some(spliced.len().to_string().as_bytes())
            );
        } else {
            assert_eq!(upstream_length, &None);
        }
        // The client asked for request_id (granted) but not the marker (stripped).
        assert_eq!(client_body, "event: request_id\n: \"r\"\n\ndata: 1\n\n");
    }
    server.stop().await;
}

#[tokio::test]
async fn an_opt_in_granted_by_the_request_lets_the_marker_through() {
    let layer = BypassMarkerLayer::new();
    let (server, mut client) = connected(ExtProc::new(layer.clone())).await;
    for sizes in [&[4096usize][..], &[1], &[9, 2]] {
        let ex = Exchange::chat(OPTED_IN, &serve::chunked(STREAM.as_bytes(), sizes));
        let (seen, messages) = same(&mut client, &layer, &ex).await;
        assert_eq!(client_body(&seen), STREAM);
        // Nothing to remove for this client: the response body is not sent to the processor.
        assert_eq!(messages, 3);
    }
    server.stop().await;
}

#[tokio::test]
async fn a_request_the_guard_does_not_read_is_not_buffered_by_envoy() {
    let layer = BypassMarkerLayer::new();
    let (server, mut client) = connected(ExtProc::new(layer.clone())).await;
    let ex = Exchange {
        request_headers: vec![("content-type", b"multipart/form-data; boundary=x".to_vec())],
        ..Exchange::chat("--x--", &one(STREAM))
    };
    let (seen, messages) = same(&mut client, &layer, &ex).await;
    assert_eq!(client_body(&seen), FILTERED);
    // Request headers (answered with request_body_mode NONE), response headers, one chunk.
    assert_eq!(messages, 3);
    server.stop().await;
}

#[tokio::test]
async fn a_buffered_body_followed_by_trailers_is_still_judged_whole() {
    let layer = BypassMarkerLayer::new();
    let (server, mut client) = connected(ExtProc::new(layer.clone())).await;
    let mut stream = Stream::open(&mut client).await;
    stream.call(post_request("application/json")).await.unwrap();
    // With request trailers, an Envoy that announced BUFFERED (Stream::call announces it in
    // the first message) sends the buffered body with end_of_stream false.
    let answer = stream
        .request_body(
            br#"{"nvext":{"annotations":["x-bypass-remote-prefill:true"]}}"#,
            false,
        )
        .await;
    assert_eq!(
        replaced(answer.as_ref()).unwrap(),
        r#"{"nvext":{"annotations":[]}}"#
    );
    drop(stream); // graceful shutdown waits for streams in flight
    server.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Failures

#[tokio::test]
async fn a_frame_too_large_fails_the_grpc_stream() {
    let layer = BypassMarkerLayer::new()
        .max_frame_bytes(64)
        .on_overflow(Overflow::Error);
    let (server, mut client) = connected(ExtProc::new(layer.clone())).await;
    let mut stream = Stream::response(&mut client, "text/event-stream").await;
    stream.response_body(b"data: 1\n\ndata: ", false).await;
    let err = stream
        .call(response_body(&[b'x'; 100], false))
        .await
        .expect_err("the stream must fail");
    assert_eq!(err.code(), Code::ResourceExhausted);
    // The stream is over: no clean continuation.
    let _ = stream.tx.send(ProcessingRequest::default()).await;
    let next = tokio::time::timeout(PATIENCE, stream.rx.message())
        .await
        .unwrap();
    assert!(!matches!(next, Ok(Some(_))), "{next:?}");
    // The tower body fails the same way.
    let ex = Exchange::chat(
        CHAT,
        &[
            Bytes::from_static(b"data: 1\n\ndata: "),
            Bytes::from(vec![b'x'; 100]),
        ],
    );
    let svc = ServiceBuilder::new()
        .layer(layer.clone())
        .service(service_fn(|_req: Request<Full<Bytes>>| {
            let ex = ex.clone();
            async move {
                let frames = ex.chunks.iter().cloned().map(data).collect::<Vec<_>>();
                Ok::<_, Infallible>(serve::event_stream(frames_body(frames)))
            }
        }));
    let res = svc.oneshot(Request::new(Full::default())).await.unwrap();
    assert!(res.into_body().collect().await.is_err());
    server.stop().await;
}

#[tokio::test]
async fn a_json_request_under_a_streamed_request_body_mode_fails_closed() {
    let layer = BypassMarkerLayer::new();
    let (server, mut client) = connected(ExtProc::new(layer)).await;
    let mut stream = Stream::open(&mut client).await;
    let headers = post_request("application/json");
    let err = stream
        .send(with_modes(
            headers,
            BodySendMode::Streamed,
            BodySendMode::Streamed,
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    server.stop().await;
}

#[tokio::test]
async fn health_is_serving_and_shutdown_lets_streams_in_flight_finish() {
    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};

    let layer = BypassMarkerLayer::new();
    let server = start(ExtProc::new(layer)).await;
    let channel = Channel::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    support::assert_ext_proc_serving(channel.clone()).await;
    let mut health = HealthClient::new(channel.clone());
    let unknown = health
        .check(HealthCheckRequest {
            service: "nope".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound);

    // A stream in flight when shutdown starts is answered to its end.
    let mut client = ExternalProcessorClient::new(channel);
    let mut stream = Stream::open(&mut client).await;
    stream.call(get_request()).await.unwrap();
    let Server { stop, task, .. } = server;
    stop.unwrap().send(()).unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    assert!(
        !task.is_finished(),
        "the server must wait for the stream in flight"
    );
    let answer = stream
        .call(response_headers("text/event-stream"))
        .await
        .unwrap();
    assert!(answer.mode_override.is_some());
    let answer = stream.response_body(MARKER.as_bytes(), true).await;
    assert_eq!(replaced(answer.as_ref()).unwrap(), "");
    drop(stream);
    tokio::time::timeout(PATIENCE, task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn a_status_that_has_no_content_is_passed_through() {
    let layer = BypassMarkerLayer::new();
    let (server, mut client) = connected(ExtProc::new(layer.clone())).await;
    let mut ex = Exchange::chat(CHAT, &[]);
    ex.status = 204;
    let (seen, messages) = same(&mut client, &layer, &ex).await;
    assert_eq!(client_body(&seen), "");
    assert_eq!(messages, 3);
    let mut ex = Exchange::chat(CHAT, &one(STREAM));
    ex.status = StatusCode::INTERNAL_SERVER_ERROR.as_u16();
    same(&mut client, &layer, &ex).await;
    server.stop().await;
}

#[tokio::test]
async fn a_filtered_response_under_a_body_mode_of_none_asks_for_its_body() {
    let layer = BypassMarkerLayer::new();
    let (server, mut client) = connected(ExtProc::new(layer)).await;
    let mut stream = Stream::open(&mut client).await;
    // A GET with no body (answered first), then the response, under a response body mode of none.
    stream.send(msg(get_request())).await.unwrap();
    let head = response_headers("text/event-stream");
    let answer = stream
        .send(with_modes(head, BodySendMode::Buffered, BodySendMode::None))
        .await
        .unwrap();
    let mode = answer.mode_override.expect("a mode override");
    assert_eq!(mode.response_body_mode, BodySendMode::Streamed as i32);
    drop(stream);
    server.stop().await;
}

#[tokio::test]
async fn memory_per_stream_is_bounded_by_max_frame_bytes() {
    // A frame of 1 MiB that never ends, in 4 KiB chunks, with a cap of 1 KiB: the processor may
    // hold at most the cap, so after each chunk it has given back all but at most 1 KiB of what
    // it received (Overflow::Forward: a frame past the cap is data and goes on unfiltered).
    let cap = 1024;
    let layer = BypassMarkerLayer::new().max_frame_bytes(cap);
    let (server, mut client) = connected(ExtProc::new(layer.clone())).await;
    let mut frame = b"data: ".to_vec();
    frame.resize(1 << 20, b'x');
    let chunks = serve::chunked(&frame, &[4096]);
    let mut stream = Stream::response(&mut client, "text/event-stream").await;
    let (mut received, mut forwarded) = (0, Vec::new());
    for (i, chunk) in chunks.iter().enumerate() {
        let end = i + 1 == chunks.len();
        received += chunk.len();
        forward_chunk(&mut stream, chunk, end, &mut forwarded).await;
        assert!(
            received - forwarded.len() <= cap,
            "holding {} bytes after {received}",
            received - forwarded.len()
        );
    }
    assert_eq!(forwarded, frame);
    drop(stream);
    // The tower body gives the same bytes.
    let ex = Exchange::chat(CHAT, &chunks);
    assert_eq!(
        through_tower(&layer, 32 << 20, &ex).await,
        through_envoy(&mut client, &ex).await.0
    );
    server.stop().await;
}

#[tokio::test]
async fn the_processor_ends_its_side_when_envoy_closes_the_stream() {
    // A client that disconnects (or an upstream that resets) makes Envoy close the gRPC stream
    // in the middle of a response; the processor ends its side at once, held bytes dropped.
    let (server, mut client) = connected(ExtProc::new(BypassMarkerLayer::new())).await;
    let mut stream = Stream::response(&mut client, "text/event-stream").await;
    let answer = stream
        .response_body(b"data: 1\n\nevent: x-bypass-remote", false)
        .await;
    assert_eq!(replaced(answer.as_ref()).unwrap(), "data: 1\n\n");
    let end = stream.close().await;
    assert!(matches!(end, Ok(None)), "{end:?}");
    server.stop().await;
}

#[tokio::test]
async fn into_service_serves_in_a_server_of_your_own() {
    let server = start_own(ExtProc::new(BypassMarkerLayer::new()).into_service()).await;
    let mut client = server.client().await;
    let layer = BypassMarkerLayer::new();
    let (seen, _) = same(&mut client, &layer, &Exchange::chat(CHAT, &one(STREAM))).await;
    assert_eq!(client_body(&seen), FILTERED);
    server.stop().await;
}

#[tokio::test]
async fn a_request_body_larger_than_grpcs_default_message_limit_is_judged() {
    // tonic refuses messages over 4 MiB by default; a buffered body comes in one message.
    let layer = BypassMarkerLayer::new();
    let (server, mut client) = connected(ExtProc::new(layer.clone())).await;
    let body = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}],"nvext":{{"annotations":["x-bypass-remote-prefill:true"]}}}}"#,
        "x".repeat(8 << 20)
    );
    let (seen, _) = same(&mut client, &layer, &Exchange::chat(&body, &one(STREAM))).await;
    let Seen::Forwarded { upstream_body, .. } = &seen else {
        panic!()
    };
    assert!(upstream_body
        .as_ref()
        .unwrap()
        .ends_with(br#""nvext":{"annotations":[]}}"#));
    server.stop().await;
}

#[tokio::test]
async fn messages_that_need_no_answer_get_none() {
    // A message without an HTTP part is not answered: the next answer on the stream is the one
    // for the next real message.
    let (server, mut client) = connected(ExtProc::new(BypassMarkerLayer::new())).await;
    let mut stream = Stream::open(&mut client).await;
    stream.tx.send(ProcessingRequest::default()).await.unwrap();
    let answer = stream.send(msg(get_request())).await.unwrap();
    assert!(
        matches!(answer.response, Some(Answer::RequestHeaders(_))),
        "{answer:?}"
    );
    let answer = stream
        .send(msg(response_headers("application/json")))
        .await
        .unwrap();
    assert!(
        matches!(answer.response, Some(Answer::ResponseHeaders(_))),
        "{answer:?}"
    );
    let end = stream.close().await;
    assert!(matches!(end, Ok(None)), "{end:?}");
    server.stop().await;
}

/// Message sequences the processor cannot judge fail the stream (Envoy, with
/// `failure_mode_allow: false`, then answers 500 or resets the HTTP stream) rather than let a byte
/// through unjudged: observability mode (answers are ignored), a request body before its headers
/// (request headers skipped), a response body before its headers (response headers skipped), and
/// a second headers message.
#[tokio::test]
async fn sequences_that_cannot_be_judged_fail_the_stream() {
    let server = start(ExtProc::new(BypassMarkerLayer::new())).await;
    let json_request = || msg(post_request("application/json"));
    let event_stream = || msg(response_headers("text/event-stream"));
    let cases: Vec<(&str, Vec<ProcessingRequest>)> = vec![
        (
            "observability mode",
            vec![observed(post_request("application/json"))],
        ),
        (
            "request body first",
            vec![msg(request_body(
                br#"{"nvext":{"annotations":["x-bypass-remote-prefill"]}}"#,
                true,
            ))],
        ),
        (
            "response body first",
            vec![msg(response_body(MARKER.as_bytes(), true))],
        ),
        (
            "request headers twice",
            vec![json_request(), json_request()],
        ),
        (
            "response headers twice",
            vec![msg(get_request()), event_stream(), event_stream()],
        ),
        // request_header_mode: SKIP: the guard never ran, so clients could reach the router
        // with its own names; the response must not look healthy.
        (
            "response headers without request headers",
            vec![event_stream()],
        ),
        // No protocol_config (so BUFFERED is assumed) while Envoy streams the body: its first
        // piece must not be judged as the whole body.
        (
            "a request body in pieces",
            vec![
                json_request(),
                msg(request_body(b"", false)),
                msg(request_body(
                    br#"{"nvext":{"annotations":["x-bypass-remote-prefill"]}}"#,
                    true,
                )),
            ],
        ),
    ];
    for (case, messages) in cases {
        let mut client = server.client().await;
        let (tx, mut inbound) = process(&mut client, 4).await;
        for m in messages {
            tx.send(m).await.unwrap();
        }
        let failed = tokio::time::timeout(PATIENCE, async {
            loop {
                match inbound.message().await {
                    Ok(Some(_)) => continue,
                    Ok(None) => return None,
                    Err(status) => return Some(status),
                }
            }
        })
        .await
        .unwrap();
        let status = failed.unwrap_or_else(|| panic!("{case}: the stream ended cleanly"));
        assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{case}");
    }
    server.stop().await;
}

/// The one `error` line that says why streams in observability mode fail: once per connection
/// (the `tracing` feature or `cli` brings the `tracing` crate).
mod observability_log {
    use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
    use tracing::subscriber::DefaultGuard;

    use super::logs::Captured;
    use super::*;

    /// Opens a stream in observability mode on `client` and waits for its status.
    async fn observed_stream(client: &mut ExternalProcessorClient<Channel>) -> Status {
        let mut stream = Stream::open(client).await;
        let request = observed(post_request("application/json"));
        stream.tx.send(request).await.unwrap();
        match tokio::time::timeout(PATIENCE, stream.rx.message())
            .await
            .unwrap()
        {
            Err(status) => status,
            Ok(answer) => panic!("the stream did not fail: {answer:?}"),
        }
    }

    /// Captures what is logged at `error` on this thread until the guard is dropped: a
    /// `current_thread` test runtime runs the server's tasks on it too.
    fn errors() -> (Captured, DefaultGuard) {
        let captured = Captured::default();
        let guard = tracing::subscriber::set_default(captured.subscriber(tracing::Level::ERROR));
        (captured, guard)
    }

    /// The lines about observability mode.
    fn observability_lines(captured: &Captured) -> Vec<String> {
        captured
            .text()
            .lines()
            .filter(|line| line.contains("observability_mode"))
            .map(str::to_owned)
            .collect()
    }

    /// Envoy in observability mode sends every HTTP request as a stream on a few HTTP/2
    /// connections: `serve` fails each stream, and logs why once per connection, naming the peer.
    /// Three streams on one connection, one on a second, a fourth on the first: two lines, one
    /// per client port.
    #[tokio::test(flavor = "current_thread")]
    async fn observability_mode_is_logged_once_per_connection() {
        let (captured, _guard) = errors();
        let server = start(ExtProc::new(BypassMarkerLayer::dynamo())).await;
        let mut first = server.client().await;
        let mut statuses = Vec::new();
        for _ in 0..3 {
            statuses.push(observed_stream(&mut first).await);
        }
        let mut second = server.client().await;
        statuses.push(observed_stream(&mut second).await);
        statuses.push(observed_stream(&mut first).await);
        for status in &statuses {
            assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
        }
        drop((first, second));
        server.stop().await;

        let lines = observability_lines(&captured);
        assert_eq!(lines.len(), 2, "{lines:#?}");
        let peers: Vec<&str> = lines
            .iter()
            .map(|line| {
                let at = line
                    .find("peer=127.0.0.1:")
                    .unwrap_or_else(|| panic!("{line}"));
                line[at..].split_whitespace().next().unwrap()
            })
            .collect();
        assert_ne!(peers[0], peers[1], "{lines:#?}");
        for line in &lines {
            assert!(line.contains(" ERROR "), "{line}");
            assert!(
                line.contains("router-owned names reach the upstream"),
                "{line}"
            );
            assert!(line.contains("turn observability_mode off"), "{line}");
        }
    }

    /// In a tonic server of the embedder's own there is no flag per connection: the line is
    /// logged once per processor (its clones share it), with `into_service` as with tonic's
    /// generated server, and names the peer from tonic's `TcpConnectInfo`.
    #[tokio::test(flavor = "current_thread")]
    async fn observability_mode_is_logged_once_per_processor_in_a_server_of_your_own() {
        let (captured, _guard) = errors();
        let lean = start_own(ExtProc::new(BypassMarkerLayer::new()).into_service()).await;
        let generated = start_own(ExternalProcessorServer::new(ExtProc::new(
            BypassMarkerLayer::new(),
        )))
        .await;
        for server in [&lean, &generated] {
            for _ in 0..2 {
                let mut client = server.client().await;
                for _ in 0..2 {
                    let status = observed_stream(&mut client).await;
                    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
                }
            }
        }
        lean.stop().await;
        generated.stop().await;

        let lines = observability_lines(&captured);
        assert_eq!(lines.len(), 2, "{lines:#?}");
        for line in &lines {
            assert!(line.contains("peer=127.0.0.1:"), "{line}");
        }
    }
}

/// Every request that goes on asks the upstream for an unencoded response: an encoded event
/// stream passes through the layer unfiltered, so an upstream that compresses for a client that
/// sent `accept-encoding: gzip` would carry the marker past the processor.
#[tokio::test]
async fn requests_that_go_on_ask_the_upstream_for_identity_encoding() {
    let server = start(ExtProc::new(BypassMarkerLayer::new())).await;
    for (headers, end_of_stream) in [
        // Skipped by the guard (no body), read by the guard, and JSON with no body.
        (
            &[(":method", &b"GET"[..]), ("accept-encoding", b"gzip, br")][..],
            true,
        ),
        (
            &[
                (":method", b"POST"),
                ("content-type", b"application/json"),
                ("accept-encoding", b"gzip"),
            ],
            false,
        ),
        (
            &[(":method", b"POST"), ("content-type", b"application/json")],
            true,
        ),
    ] {
        let mut client = server.client().await;
        let mut stream = Stream::open(&mut client).await;
        let answer = stream
            .call(Msg::RequestHeaders(headers_msg(
                headers,
                end_of_stream,
                true,
            )))
            .await
            .unwrap();
        let Some(Answer::RequestHeaders(h)) = answer.response else {
            panic!("{answer:?}")
        };
        let set = h.response.unwrap().header_mutation.unwrap().set_headers;
        assert_eq!(set.len(), 1, "{set:?}");
        let header = set[0].header.as_ref().unwrap();
        assert_eq!(header.key, "accept-encoding");
        assert_eq!(header.raw_value, b"identity");
    }
    server.stop().await;
}

#[tokio::test]
async fn the_layers_observer_counts_the_processors_frames() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[derive(Default)]
    struct Count(AtomicUsize, AtomicUsize);
    impl tower_bypass_marker::FrameObserver for Count {
        fn frame_removed(&self, annotation: Option<&str>, bytes: usize) {
            assert_eq!(annotation, Some("x-bypass-remote-prefill"));
            assert_eq!(bytes, MARKER.len());
            self.0.fetch_add(1, Ordering::SeqCst);
        }
        fn frame_forwarded(&self, annotation: &str) {
            assert_eq!(annotation, "x-bypass-remote-prefill");
            self.1.fetch_add(1, Ordering::SeqCst);
        }
    }
    let count = Arc::new(Count::default());
    let layer = BypassMarkerLayer::new().observe(count.clone());
    let (server, mut client) = connected(ExtProc::new(layer.clone())).await;
    let chunks = serve::chunked(STREAM.as_bytes(), &[7]);
    through_envoy(&mut client, &Exchange::chat(CHAT, &chunks)).await;
    assert_eq!(count.0.load(Ordering::SeqCst), 1);
    assert_eq!(count.1.load(Ordering::SeqCst), 0);
    // An opted-in client: nothing to remove, but the observer must see the frame forwarded, so
    // the body still goes through the processor.
    let (seen, _) = through_envoy(&mut client, &Exchange::chat(OPTED_IN, &chunks)).await;
    assert_eq!(client_body(&seen), STREAM);
    assert_eq!(count.0.load(Ordering::SeqCst), 1);
    assert_eq!(count.1.load(Ordering::SeqCst), 1);
    server.stop().await;
}

// ---------------------------------------------------------------------------------------------
// The gRPC framing of `into_service` (what `serve` runs), and tonic's generated server

#[tokio::test]
async fn the_generated_tonic_server_gives_the_answers_into_service_gives() {
    use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;

    let layer = BypassMarkerLayer::dynamo().sdk_safe(true);
    let processor = ExtProc::new(layer.clone());
    let own = start_own(
        ExternalProcessorServer::new(processor.clone())
            .max_decoding_message_size(processor.max_message_bytes()),
    )
    .await;
    let mut generated = own.client().await;
    let (server, mut lean) = connected(processor).await;
    let body = format!("\u{FEFF}{MARKER}event: request_id\n: \"r-1\"\n\ndata: {{\"a\":1}}\r\rdata: [DONE]\n\nevent: x-bypass-remote-prefill");
    let large = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}],"nvext":{{"annotations":["x-bypass-remote-prefill:true"]}}}}"#,
        "x".repeat(5 << 20)
    );
    let mut exchanges = vec![
        Exchange::chat(CHAT, &one(&body)),
        Exchange::chat(OPTED_IN, &one(&body)),
        Exchange::chat(&large, &one(STREAM)),
        Exchange::chat("{", &one(STREAM)),
    ];
    for sizes in [&[1usize][..], &[3, 7], &[5, 1, 13]] {
        exchanges.push(Exchange::chat(
            CHAT,
            &serve::chunked(body.as_bytes(), sizes),
        ));
    }
    for ex in &exchanges {
        let (by_generated, n) = same(&mut generated, &layer, ex).await;
        let (by_lean, m) = same(&mut lean, &layer, ex).await;
        assert_eq!(by_generated, by_lean);
        assert_eq!(n, m);
    }
    own.stop().await;
    server.stop().await;
}

/// A bare HTTP/2 connection to the processor, ready for a request.
async fn h2_client(addr: SocketAddr) -> h2::client::SendRequest<Bytes> {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (client, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    client.ready().await.unwrap()
}

/// One `Process` call over a bare HTTP/2 connection: `path`, the request body's bytes as they
/// are (gRPC prefixes included), then the end of the request. Returns the response body's bytes
/// and its `grpc-status` (from the trailers, or from the head of a trailers-only answer).
async fn raw_call(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (Vec<u8>, String) {
    let mut client = h2_client(addr).await;
    let mut request = Request::builder()
        .method("POST")
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let (response, mut send) = client
        .send_request(request.body(()).unwrap(), false)
        .unwrap();
    send.send_data(Bytes::copy_from_slice(body), true).unwrap();
    let response = tokio::time::timeout(PATIENCE, response)
        .await
        .unwrap()
        .unwrap();
    let head_status = response
        .headers()
        .get("grpc-status")
        .map(|v| v.to_str().unwrap().to_owned());
    let mut inbound = response.into_body();
    let mut bytes = Vec::new();
    while let Some(chunk) = tokio::time::timeout(PATIENCE, inbound.data())
        .await
        .unwrap()
    {
        let chunk = chunk.unwrap();
        let _ = inbound.flow_control().release_capacity(chunk.len());
        bytes.extend_from_slice(&chunk);
    }
    let trailers = tokio::time::timeout(PATIENCE, inbound.trailers())
        .await
        .unwrap()
        .unwrap();
    let status = head_status
        .or_else(|| {
            trailers
                .as_ref()
                .and_then(|t| t.get("grpc-status"))
                .map(|v| v.to_str().unwrap().to_owned())
        })
        .expect("a grpc-status");
    (bytes, status)
}

fn prefixed(flag: u8, message: &[u8]) -> Vec<u8> {
    let mut out = vec![flag];
    out.extend_from_slice(&(message.len() as u32).to_be_bytes());
    out.extend_from_slice(message);
    out
}

const PROCESS: &str = "/envoy.service.ext_proc.v3.ExternalProcessor/Process";

#[tokio::test]
async fn messages_in_one_data_frame_or_split_across_frames_are_each_answered() {
    use prost::Message;

    let server = start(ExtProc::new(BypassMarkerLayer::new())).await;
    let message = encoded(get_request(), false);
    // Three messages back to back in one DATA frame: three answers, then a clean end.
    let three = [
        message.clone(),
        encoded(response_headers("text/event-stream"), false),
        encoded(
            response_body(format!("{MARKER}data: 1\n\n").as_bytes(), true),
            false,
        ),
    ]
    .concat();
    let (bytes, status) = raw_call(server.addr, PROCESS, &[], &three).await;
    assert_eq!(status, "0");
    let mut answers = Vec::new();
    let mut rest = &bytes[..];
    while !rest.is_empty() {
        assert_eq!(rest[0], 0, "answers are not compressed");
        let len = u32::from_be_bytes(rest[1..5].try_into().unwrap()) as usize;
        answers.push(ProcessingResponse::decode(&rest[5..5 + len]).unwrap());
        rest = &rest[5 + len..];
    }
    assert_eq!(answers.len(), 3);
    assert!(matches!(
        answers[0].response,
        Some(Answer::RequestHeaders(_))
    ));
    assert!(matches!(
        answers[1].response,
        Some(Answer::ResponseHeaders(_))
    ));
    let Some(Answer::ResponseBody(b)) = &answers[2].response else {
        panic!("{:?}", answers[2])
    };
    assert_eq!(replaced(b.response.as_ref()).unwrap(), "data: 1\n\n");
    // The same over a client that sends a message in pieces: tonic's client with one message a
    // call has been covered above; here the prefix itself is split.
    let mut client = h2_client(server.addr).await;
    let request = Request::builder()
        .method("POST")
        .uri(format!("http://{}{PROCESS}", server.addr))
        .header("content-type", "application/grpc")
        .body(())
        .unwrap();
    let (response, mut send) = client.send_request(request, false).unwrap();
    let response = tokio::time::timeout(PATIENCE, response)
        .await
        .unwrap()
        .unwrap();
    let mut inbound = response.into_body();
    for piece in [&message[..2], &message[2..7], &message[7..]] {
        send.send_data(Bytes::copy_from_slice(piece), false)
            .unwrap();
    }
    let answer = tokio::time::timeout(PATIENCE, inbound.data())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let len = u32::from_be_bytes(answer[1..5].try_into().unwrap()) as usize;
    assert_eq!(
        answer.len(),
        5 + len,
        "one whole answer, as soon as the message is in"
    );
    send.send_data(Bytes::new(), true).unwrap();
    drop(inbound);
    server.stop().await;
}

#[tokio::test]
async fn calls_the_processor_cannot_read_fail_with_a_status_not_a_clean_end() {
    use prost::Message;

    let server = start(ExtProc::new(BypassMarkerLayer::new()).max_body_bytes(1024)).await;
    let limit = ExtProc::new(BypassMarkerLayer::new())
        .max_body_bytes(1024)
        .max_message_bytes();
    let headers = msg(get_request()).encode_to_vec();
    // A compressed message (Envoy sends none), by its flag or by the call's header.
    let (_, status) = raw_call(server.addr, PROCESS, &[], &prefixed(1, &headers)).await;
    assert_eq!(status, (Code::Unimplemented as i32).to_string());
    let (bytes, status) = raw_call(
        server.addr,
        PROCESS,
        &[("grpc-encoding", "gzip")],
        &prefixed(0, &headers),
    )
    .await;
    assert_eq!(status, (Code::Unimplemented as i32).to_string());
    assert!(bytes.is_empty());
    // A message over the limit, judged on its prefix.
    let mut over = prefixed(0, &[]);
    over[1..5].copy_from_slice(&((limit + 1) as u32).to_be_bytes());
    let (_, status) = raw_call(server.addr, PROCESS, &[], &over).await;
    assert_eq!(status, (Code::ResourceExhausted as i32).to_string());
    // Bytes that are no ProcessingRequest.
    let (_, status) = raw_call(server.addr, PROCESS, &[], &prefixed(0, &[0xff; 8])).await;
    assert_eq!(status, (Code::Internal as i32).to_string());
    // The request ends inside a message: its first message is answered, the rest is an error.
    let mut cut = prefixed(0, &headers);
    cut.extend_from_slice(&prefixed(0, &headers)[..7]);
    let (bytes, status) = raw_call(server.addr, PROCESS, &[], &cut).await;
    assert_eq!(status, (Code::Internal as i32).to_string());
    assert!(
        !bytes.is_empty(),
        "the whole message before the cut is answered"
    );
    // Another method of the service.
    let (_, status) = raw_call(
        server.addr,
        "/envoy.service.ext_proc.v3.ExternalProcessor/Other",
        &[],
        &[],
    )
    .await;
    assert_eq!(status, (Code::Unimplemented as i32).to_string());
    server.stop().await;
}

#[tokio::test]
async fn the_generated_server_fails_a_call_whose_message_it_cannot_read() {
    use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;

    // A user's own generated server left at a decoding limit below the body: the call must fail,
    // not end cleanly (Envoy would then send the body upstream unjudged).
    let processor = ExtProc::new(BypassMarkerLayer::new());
    let own =
        start_own(ExternalProcessorServer::new(processor).max_decoding_message_size(1024)).await;
    let mut client = own.client().await;
    let mut stream = Stream::open(&mut client).await;
    stream.call(post_request("application/json")).await.unwrap();
    let body = format!(
        r#"{{"model":"m","nvext":{{"annotations":["x-bypass-remote-prefill"]}},"pad":"{}"}}"#,
        "x".repeat(4096)
    );
    let err = stream
        .call(request_body(body.as_bytes(), true))
        .await
        .expect_err("the call must fail");
    assert_ne!(err.code(), Code::Ok);
    own.stop().await;
}

/// A headers message with more headers than one `http::HeaderMap` takes (about 24,576 and up made
/// the processor panic while it reserved room for them) fails its stream with
/// `RESOURCE_EXHAUSTED`, request or response headers, through `serve` and through tonic's
/// generated server; a message with 16,384 is judged.
#[tokio::test]
async fn a_headers_message_with_too_many_headers_fails_with_resource_exhausted() {
    use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;

    let processor = ExtProc::new(BypassMarkerLayer::new());
    let own = start_own(
        ExternalProcessorServer::new(processor.clone())
            .max_decoding_message_size(processor.max_message_bytes()),
    )
    .await;
    let server = start(processor).await;
    let names: Vec<String> = (0..40_000).map(|i| format!("x-h{i}")).collect();
    let headers = |pseudo: (&'static str, &'static [u8]), n: usize| {
        let mut pairs: Vec<(&str, &[u8])> = vec![pseudo, ("content-type", b"text/plain")];
        pairs.extend(names[..n - 2].iter().map(|k| (k.as_str(), &b"v"[..])));
        headers_msg(&pairs, true, true)
    };
    for (which, client) in [("serve", &server), ("generated", &own)] {
        let mut client = client.client().await;
        for n in [24_576, 40_000] {
            for (side, message) in [
                (
                    "request",
                    Msg::RequestHeaders(headers((":method", b"GET"), n)),
                ),
                (
                    "response",
                    Msg::ResponseHeaders(headers((":status", b"200"), n)),
                ),
            ] {
                let mut stream = Stream::open(&mut client).await;
                let status = stream
                    .call(message)
                    .await
                    .expect_err("too many headers are refused");
                assert_eq!(status.code(), Code::ResourceExhausted, "{which} {side} {n}");
            }
        }
        // Up to the limit, the message is judged.
        let mut stream = Stream::open(&mut client).await;
        let answer = stream
            .call(Msg::RequestHeaders(headers((":method", b"GET"), 16_384)))
            .await
            .unwrap();
        assert!(
            matches!(answer.response, Some(Answer::RequestHeaders(_))),
            "{which}"
        );
    }
    own.stop().await;
    server.stop().await;
}

/// `serve` advertises `SETTINGS_MAX_CONCURRENT_STREAMS` (1,024: Envoy's 1,000 concurrent streams
/// of tests/envoy/run.sh fit on one connection; Envoy opens another past it).
#[tokio::test]
async fn serve_advertises_a_max_concurrent_streams() {
    let server = start(ExtProc::new(BypassMarkerLayer::new())).await;
    let mut client = h2_client(server.addr).await;
    // One call, so that the server's SETTINGS have been read.
    let request = Request::builder()
        .method("POST")
        .uri(format!("http://{}{PROCESS}", server.addr))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (response, _send) = client.send_request(request, true).unwrap();
    tokio::time::timeout(PATIENCE, response)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        client.current_max_send_streams(),
        envoy::MAX_CONCURRENT_STREAMS as usize
    );
    assert_eq!(envoy::MAX_CONCURRENT_STREAMS, 1024);
    drop(client);
    server.stop().await;
}

/// A processor with the default layer, a `--max-body` of `max_body` and `budget` shared.
fn budgeted(max_body: usize, budget: &budget::BodyBudget) -> ExtProc {
    ExtProc::new(BypassMarkerLayer::new())
        .max_body_bytes(max_body)
        .body_budget(budget.clone())
}

/// A JSON request's headers, with a declared length or none (the client's body was chunked).
fn json_headers(length: Option<usize>) -> Msg {
    let length = length.map(|n| n.to_string());
    let mut pairs: Vec<(&str, &[u8])> =
        vec![(":method", b"POST"), ("content-type", b"application/json")];
    if let Some(length) = &length {
        pairs.push(("content-length", length.as_bytes()));
    }
    Msg::RequestHeaders(headers_msg(&pairs, false, true))
}

/// A JSON body of `len` bytes: `{"a":"xxx..."}`.
fn json_body(len: usize) -> Vec<u8> {
    let mut body = b"{\"a\":\"".to_vec();
    body.resize(len - 2, b'x');
    body.extend_from_slice(b"\"}");
    body
}

/// The 503 the processor answers past its budget, as the sidecar's: `retry-after: 1`, an
/// OpenAI-shaped `server_error` with code `request_bodies_over_budget`, as Envoy's local reply
/// (never a failed stream, which Envoy turns into a 500).
fn assert_over_budget(answer: &ProcessingResponse) {
    let Some(Answer::ImmediateResponse(i)) = &answer.response else {
        panic!("not an immediate response: {answer:?}")
    };
    assert_eq!(i.status.as_ref().unwrap().code, 503);
    let header = |name: &str| {
        i.headers
            .as_ref()
            .unwrap()
            .set_headers
            .iter()
            .filter_map(|o| o.header.as_ref())
            .find(|h| h.key == name)
            .map(|h| h.raw_value.clone())
    };
    assert_eq!(header("retry-after").as_deref(), Some(&b"1"[..]));
    assert_eq!(
        header("content-type").as_deref(),
        Some(&b"application/json"[..])
    );
    let body: serde_json::Value = serde_json::from_slice(&i.body).unwrap();
    assert_eq!(body["error"]["type"], "server_error");
    assert_eq!(body["error"]["code"], "request_bodies_over_budget");
}

/// Issue 34, item 1: the budget charges the bytes the processor holds, never a declared length
/// (Envoy holds a buffered body until it sends it). The issue's scenario with
/// `--max-buffered-bytes 2000000 --max-body 1000000`: two clients that send a head declaring
/// 950,000 bytes and no body take nothing, and a complete 950 kB JSON request is judged; the
/// bytes are given back once it has been.
#[tokio::test]
async fn a_declared_length_reserves_nothing_of_the_processors_budget() {
    let budget = budget::BodyBudget::new(2_000_000);
    let (server, mut client) = connected(budgeted(1_000_000, &budget)).await;
    let mut heads = Vec::new();
    for _ in 0..2 {
        let mut head_only = Stream::open(&mut client).await;
        let answer = head_only.call(json_headers(Some(950_000))).await.unwrap();
        assert!(matches!(answer.response, Some(Answer::RequestHeaders(_))));
        heads.push(head_only);
    }
    assert_eq!(budget.held(), 0, "nothing held for a declared length");
    for length in [Some(950_000), None] {
        let mut whole = Stream::open(&mut client).await;
        whole.call(json_headers(length)).await.unwrap();
        let answer = whole
            .call(request_body(&json_body(950_000), true))
            .await
            .unwrap();
        assert!(
            matches!(answer.response, Some(Answer::RequestBody(_))),
            "{length:?}: {:?}",
            answer.response.map(|_| ())
        );
        assert_eq!(budget.held(), 0);
    }
    assert_eq!(budget.refused(), 0);
    // A declared length the budget could never hold is refused at once, before Envoy buffers it.
    let tight = budget::BodyBudget::new(1_000_000);
    let (small, mut small_client) = connected(budgeted(1_000_000, &tight)).await;
    let mut never = Stream::open(&mut small_client).await;
    assert_over_budget(&never.call(json_headers(Some(900_000))).await.unwrap());
    assert_eq!((tight.held(), tight.refused()), (0, 1));
    drop((heads, never));
    small.stop().await;
    server.stop().await;
}

/// Issue 34, item 1: a body that would take the bodies held past the budget gets the 503 with
/// `Retry-After` as an immediate response (Envoy's local reply), not a failed stream; a small
/// request still fits in the last eighth; a judged body gives its bytes back.
#[tokio::test]
async fn past_the_processors_budget_a_request_gets_a_503_with_retry_after() {
    let budget = budget::BodyBudget::new(1 << 20);
    let (server, mut client) =
        connected(ExtProc::new(BypassMarkerLayer::new()).body_budget(budget.clone())).await;
    // A body held mid-message: the first 700,000 bytes of an 800,000-byte body message.
    let mut first = RawCall::open(server.addr).await;
    first
        .send(&encoded(json_headers(Some(800_000)), true))
        .await;
    assert!(matches!(
        first.answer().await.response,
        Some(Answer::RequestHeaders(_))
    ));
    let body = encoded(request_body(&json_body(800_000), true), false);
    first.send(&body[..700_000]).await;
    held_at_least(&budget, 690_000).await;
    let mut other = Stream::open(&mut client).await;
    other.call(json_headers(None)).await.unwrap();
    let answer = other
        .call(request_body(&json_body(300_000), true))
        .await
        .expect("an answer, not a failed stream");
    assert_over_budget(&answer);
    // A small request still fits in the last eighth.
    let mut small = Stream::open(&mut client).await;
    small.call(json_headers(Some(1000))).await.unwrap();
    small.request_body(&json_body(1000), true).await;
    // The first body judged: its bytes are given back.
    first.send(&body[700_000..]).await;
    assert!(matches!(
        first.answer().await.response,
        Some(Answer::RequestBody(_))
    ));
    assert_eq!(budget.held(), 0);
    assert_eq!(budget.refused(), 1);
    drop((first, other, small));
    server.stop().await;
}

/// Issue 34, item 1: the bytes of a body message count as they arrive, so a body that passes the
/// budget while it arrives is answered with the 503 at once, before its message is complete;
/// the rest of it is dropped as it comes, nothing stays held, and the call ends cleanly.
#[tokio::test]
async fn a_body_passing_the_budget_as_it_arrives_gets_the_503_before_its_end() {
    let budget = budget::BodyBudget::new(1 << 20);
    let server = start(budgeted(4 << 20, &budget)).await;
    let mut call = RawCall::open(server.addr).await;
    call.send(&encoded(json_headers(None), true)).await;
    call.answer().await;
    let body = encoded(request_body(&json_body(2 << 20), true), false);
    call.send(&body[..1 << 20]).await;
    assert_over_budget(&call.answer().await);
    assert_eq!(budget.held(), 0);
    call.send(&body[1 << 20..]).await;
    call.finish().await;
    assert_eq!((budget.held(), budget.refused()), (0, 1));
    server.stop().await;
}

/// Issue 34, item 2: a body the guard does not read passes uncharged. Without
/// `allow_mode_override` Envoy sends it although the processor asked for none: a 1.9 MB upload
/// that is not JSON goes on unchanged with a budget of 2,000,000 bytes, as an incomplete
/// message and as a whole one.
#[tokio::test]
async fn a_body_the_guard_does_not_read_passes_uncharged() {
    let budget = budget::BodyBudget::new(2_000_000);
    let server = start(budgeted(1_000_000, &budget)).await;
    let upload = Msg::RequestHeaders(headers_msg(
        &[
            (":method", b"POST"),
            ("content-type", b"application/octet-stream"),
            ("content-length", b"1900000"),
        ],
        false,
        true,
    ));
    let mut client = server.client().await;
    let mut stream = Stream::open(&mut client).await;
    stream.call(upload.clone()).await.unwrap();
    let answer = stream.request_body(&vec![7; 1_900_000], true).await;
    assert_eq!(replaced(answer.as_ref()), None, "forwarded unchanged");
    let mut call = RawCall::open(server.addr).await;
    call.send(&encoded(upload, true)).await;
    call.answer().await;
    let body = encoded(request_body(&vec![7; 1_900_000], true), false);
    call.send(&body[..1_800_000]).await;
    call.send(&body[1_800_000..]).await;
    assert!(matches!(
        call.answer().await.response,
        Some(Answer::RequestBody(_))
    ));
    assert_eq!((budget.held(), budget.refused()), (0, 0));
    drop((stream, call));
    server.stop().await;
}

/// Waits until `budget` holds at least `n` bytes (the processor has read what was sent).
async fn held_at_least(budget: &budget::BodyBudget, n: u64) {
    tokio::time::timeout(PATIENCE, async {
        while budget.held() < n {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the bytes sent are held");
}

/// One message, gRPC-framed; with the protocol configuration of the documented modes when
/// `first`.
fn encoded(request: Msg, first: bool) -> Vec<u8> {
    use prost::Message;
    let msg = if first {
        with_modes(request, BodySendMode::Buffered, BodySendMode::Streamed)
    } else {
        msg(request)
    };
    prefixed(0, &msg.encode_to_vec())
}

/// A `Process` call over a bare HTTP/2 connection, whose messages can be sent in pieces.
struct RawCall {
    send: h2::SendStream<Bytes>,
    inbound: h2::RecvStream,
    received: Vec<u8>,
}

impl RawCall {
    async fn open(addr: SocketAddr) -> RawCall {
        let mut client = h2_client(addr).await;
        let request = Request::builder()
            .method("POST")
            .uri(format!("http://{addr}{PROCESS}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .unwrap();
        let (response, send) = client.send_request(request, false).unwrap();
        let response = tokio::time::timeout(PATIENCE, response)
            .await
            .unwrap()
            .unwrap();
        RawCall {
            send,
            inbound: response.into_body(),
            received: Vec::new(),
        }
    }

    /// Sends `bytes`, waiting for the flow-control window they need.
    async fn send(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            self.send.reserve_capacity(bytes.len());
            let capacity = tokio::time::timeout(
                PATIENCE,
                std::future::poll_fn(|cx| self.send.poll_capacity(cx)),
            )
            .await
            .expect("flow-control window")
            .unwrap()
            .unwrap();
            let n = capacity.min(bytes.len());
            self.send
                .send_data(Bytes::copy_from_slice(&bytes[..n]), false)
                .unwrap();
            bytes = &bytes[n..];
        }
    }

    /// The next answer.
    async fn answer(&mut self) -> ProcessingResponse {
        use prost::Message;
        loop {
            if self.received.len() >= 5 {
                let len = u32::from_be_bytes(self.received[1..5].try_into().unwrap()) as usize;
                if self.received.len() >= 5 + len {
                    let answer = ProcessingResponse::decode(&self.received[5..5 + len]).unwrap();
                    self.received.drain(..5 + len);
                    return answer;
                }
            }
            let chunk = tokio::time::timeout(PATIENCE, self.inbound.data())
                .await
                .expect("an answer in time")
                .expect("an answer before the end")
                .unwrap();
            let _ = self.inbound.flow_control().release_capacity(chunk.len());
            self.received.extend_from_slice(&chunk);
        }
    }

    /// Ends Envoy's side; the call must end cleanly with nothing more.
    async fn finish(mut self) {
        self.send.send_data(Bytes::new(), true).unwrap();
        while let Some(chunk) = tokio::time::timeout(PATIENCE, self.inbound.data())
            .await
            .unwrap()
        {
            self.received.extend_from_slice(&chunk.unwrap());
        }
        assert!(self.received.is_empty(), "no answer after the 503");
        let trailers = tokio::time::timeout(PATIENCE, self.inbound.trailers())
            .await
            .unwrap()
            .unwrap()
            .expect("trailers");
        assert_eq!(trailers.get("grpc-status").unwrap(), "0");
    }
}

/// Issue 27 item 6: Envoy's `FULL_DUPLEX_STREAMED` body mode (the Gateway API Inference
/// Extension's and agentgateway's). Envoy sends body chunks without waiting and forwards only what
/// comes back in `streamed_response`s; the request body is held and judged whole before any of it
/// goes upstream, response chunks are answered as they come.
mod full_duplex {
    use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
    use envoy_types::pb::envoy::service::ext_proc::v3::HttpTrailers;

    use super::*;

    const ROUTER_OWNED: &str = r#"{"model":"m","nvext":{"annotations":["request_id","x-bypass-remote-prefill"]},"stream":true}"#;
    const STRIPPED: &str = r#"{"model":"m","nvext":{"annotations":["request_id"]},"stream":true}"#;

    /// One stream in full duplex: messages go out without waiting for answers.
    struct Duplex {
        tx: mpsc::Sender<ProcessingRequest>,
        rx: Streaming<ProcessingResponse>,
        first: bool,
        request_mode: BodySendMode,
        response_mode: BodySendMode,
    }

    impl Duplex {
        async fn open(client: &mut ExternalProcessorClient<Channel>) -> Duplex {
            Duplex::with_modes(
                client,
                BodySendMode::FullDuplexStreamed,
                BodySendMode::FullDuplexStreamed,
            )
            .await
        }

        async fn with_modes(
            client: &mut ExternalProcessorClient<Channel>,
            request_mode: BodySendMode,
            response_mode: BodySendMode,
        ) -> Duplex {
            let (tx, rx) = process(client, 64).await;
            Duplex {
                tx,
                rx,
                first: true,
                request_mode,
                response_mode,
            }
        }

        /// A stream on which Envoy has sent a POST's headers with `content_type`, answered: the
        /// request body comes next.
        async fn request(
            client: &mut ExternalProcessorClient<Channel>,
            content_type: &str,
        ) -> Duplex {
            let mut s = Duplex::open(client).await;
            s.request_headers(content_type).await;
            s
        }

        /// A stream on which Envoy has sent a GET's headers and a 200 response's headers with
        /// `content_type`, each answered: the response body comes next.
        async fn response(
            client: &mut ExternalProcessorClient<Channel>,
            content_type: &str,
        ) -> Duplex {
            let mut s = Duplex::open(client).await;
            s.send(get_request()).await;
            let answer = s.recv().await.unwrap();
            assert!(matches!(answer.response, Some(Answer::RequestHeaders(_))));
            s.send(response_headers(content_type)).await;
            let answer = s.recv().await.unwrap();
            assert!(matches!(answer.response, Some(Answer::ResponseHeaders(_))));
            s
        }

        /// Sends one message without waiting (the first announces the stream's body modes).
        async fn send(&mut self, request: Msg) {
            let msg = if std::mem::take(&mut self.first) {
                with_modes(request, self.request_mode, self.response_mode)
            } else {
                msg(request)
            };
            self.tx.send(msg).await.unwrap();
        }

        /// The next answer (never with a mode override).
        async fn recv(&mut self) -> Result<ProcessingResponse, Status> {
            match tokio::time::timeout(PATIENCE, self.rx.message())
                .await
                .unwrap()
            {
                Ok(Some(answer)) => {
                    assert!(
                        answer.mode_override.is_none(),
                        "no mode override in full duplex"
                    );
                    Ok(answer)
                }
                Ok(None) => panic!("the processor ended the stream cleanly"),
                Err(status) => Err(status),
            }
        }

        /// The streamed body answers up to the one with `end_of_stream`, or up to `count` of
        /// them: their bytes, and whether the last one ended the body.
        async fn streamed(
            &mut self,
            request: bool,
            count: Option<usize>,
        ) -> (Vec<u8>, usize, bool) {
            let mut body = Vec::new();
            let mut n = 0;
            loop {
                let answer = self.recv().await.unwrap();
                let b = match (request, answer.response.unwrap()) {
                    (true, Answer::RequestBody(b)) | (false, Answer::ResponseBody(b)) => b,
                    (_, other) => panic!("not a body answer: {other:?}"),
                };
                let Some(Mutation::StreamedResponse(s)) =
                    b.response.unwrap().body_mutation.unwrap().mutation
                else {
                    panic!("a body answer without streamed_response")
                };
                assert!(s.body.len() <= 64 << 10, "chunks of at most 64 KiB");
                body.extend_from_slice(&s.body);
                n += 1;
                if s.end_of_stream || count == Some(n) {
                    return (body, n, s.end_of_stream);
                }
            }
        }

        /// Sends a POST's headers with `content_type` and checks their answer.
        async fn request_headers(&mut self, content_type: &str) {
            self.send(post_request(content_type)).await;
            let answer = self.recv().await.unwrap();
            assert!(matches!(answer.response, Some(Answer::RequestHeaders(_))));
        }
    }

    async fn servers() -> Vec<Server> {
        let layer = BypassMarkerLayer::dynamo();
        vec![
            start(ExtProc::new(layer.clone()).max_body_bytes(256 << 10)).await,
            start_own(ExternalProcessorServer::new(
                ExtProc::new(layer).max_body_bytes(256 << 10),
            ))
            .await,
        ]
    }

    /// The chunks a full-duplex request body holds count against the processor's budget
    /// (issue 28, item 11), as a buffered body does: past it the client gets the 503 with
    /// `Retry-After` before the body's end (issue 34, item 1), and a judged body gives its bytes
    /// back.
    #[tokio::test]
    async fn held_full_duplex_chunks_count_against_the_processors_budget() {
        let budget = budget::BodyBudget::new(1 << 20);
        let (server, mut client) = connected(
            ExtProc::new(BypassMarkerLayer::dynamo())
                .max_body_bytes(4 << 20)
                .body_budget(budget.clone()),
        )
        .await;

        // Judged whole: the budget is given back once the body has been answered.
        let mut s = Duplex::request(&mut client, "application/json").await;
        s.send(request_body(ROUTER_OWNED.as_bytes(), true)).await;
        let (body, _, end) = s.streamed(true, None).await;
        assert!(end);
        assert_eq!(body, STRIPPED.as_bytes());
        assert_eq!(budget.held(), 0);
        drop(s);

        // Of unknown length, larger than the budget: refused while its chunks arrive.
        let mut s = Duplex::request(&mut client, "application/json").await;
        let chunk = vec![b' '; 256 << 10];
        for _ in 0..8 {
            s.send(request_body(&chunk, false)).await;
        }
        // Nothing of the body is answered before its end: the first answer is the refusal.
        assert_over_budget(&s.recv().await.expect("an answer, not a failed stream"));
        assert_eq!((budget.held(), budget.refused()), (0, 1));
        drop(s);
        server.stop().await;
    }

    #[tokio::test]
    async fn a_request_body_is_held_until_its_end_then_sent_on_stripped() {
        for server in servers().await {
            let mut client = server.client().await;
            for (cuts, trailers) in [(vec![], false), (vec![1, 30, 31], false), (vec![50], true)] {
                let mut s = Duplex::request(&mut client, "application/json").await;
                let body = ROUTER_OWNED.as_bytes();
                let mut start = 0;
                for &cut in &cuts {
                    s.send(request_body(&body[start..cut], false)).await;
                    start = cut;
                }
                s.send(request_body(&body[start..], !trailers)).await;
                if trailers {
                    s.send(Msg::RequestTrailers(HttpTrailers::default())).await;
                }
                // The first answer after the headers already carries the judged body: no chunk
                // was answered (forwarded) before the end.
                let mut got = Vec::new();
                loop {
                    let answer = s.recv().await.unwrap();
                    match answer.response.unwrap() {
                        Answer::RequestBody(b) => {
                            let Some(Mutation::StreamedResponse(r)) =
                                b.response.unwrap().body_mutation.unwrap().mutation
                            else {
                                panic!("a body answer without streamed_response")
                            };
                            got.extend_from_slice(&r.body);
                            // The end is announced by the last chunk, unless trailers follow.
                            assert!(!(trailers && r.end_of_stream));
                            if r.end_of_stream {
                                break;
                            }
                        }
                        Answer::RequestTrailers(_) if trailers => break,
                        other => panic!("{other:?}"),
                    }
                }
                assert_eq!(String::from_utf8(got).unwrap(), STRIPPED, "{cuts:?}");
            }
            server.stop().await;
        }
    }

    #[tokio::test]
    async fn a_large_spliced_body_goes_back_in_chunks_of_at_most_64_kib() {
        let server = &servers().await[0];
        let mut client = server.client().await;
        let pad = "x".repeat(200 << 10);
        let body =
            format!(r#"{{"pad":"{pad}","nvext":{{"annotations":["x-bypass-remote-prefill"]}}}}"#);
        let want = format!(r#"{{"pad":"{pad}","nvext":{{"annotations":[]}}}}"#);
        let mut s = Duplex::request(&mut client, "application/json").await;
        for (i, piece) in body.as_bytes().chunks(16 << 10).enumerate() {
            let last = (i + 1) * (16 << 10) >= body.len();
            s.send(request_body(piece, last)).await;
        }
        let (got, n, ended) = s.streamed(true, None).await;
        assert!(ended);
        assert!(n >= 4, "{n} answers");
        assert!(got == want.as_bytes());
    }

    #[tokio::test]
    async fn a_held_body_over_the_cap_is_refused_with_413_before_its_end() {
        let server = &servers().await[0];
        let mut client = server.client().await;
        let mut s = Duplex::request(&mut client, "application/json").await;
        s.send(request_body(&[b' '; 200 << 10], false)).await;
        s.send(request_body(&[b' '; 100 << 10], false)).await;
        let answer = s.recv().await.unwrap();
        let Some(Answer::ImmediateResponse(i)) = answer.response else {
            panic!("{answer:?}")
        };
        assert_eq!(i.status.unwrap().code, 413);
    }

    #[tokio::test]
    async fn a_body_the_guard_does_not_read_goes_back_chunk_by_chunk() {
        let server = &servers().await[0];
        let mut client = server.client().await;
        let mut s = Duplex::request(&mut client, "text/plain").await;
        for (piece, end) in [(&b"one "[..], false), (ROUTER_OWNED.as_bytes(), true)] {
            s.send(request_body(piece, end)).await;
            let (got, n, ended) = s.streamed(true, Some(1)).await;
            assert_eq!((got.as_slice(), n, ended), (piece, 1, end));
        }
    }

    #[tokio::test]
    async fn response_frames_go_back_as_they_complete_without_the_marker() {
        for server in servers().await {
            let mut client = server.client().await;
            for trailers in [false, true] {
                let mut s = Duplex::response(&mut client, "text/event-stream").await;
                // The marker, a frame cut in two, and (before trailers) a frame left open.
                let chunks: [&[u8]; 3] = [
                    b"event: x-bypass-remote-prefill\n: true\n\ndata: 1\n\ndata: ",
                    b"2\n\n",
                    b"data: [DONE]",
                ];
                let mut got = Vec::new();
                for (i, chunk) in chunks.iter().enumerate() {
                    let end = i == 2 && !trailers;
                    s.send(response_body(chunk, end)).await;
                    let (out, _, ended) = s.streamed(false, Some(1)).await;
                    assert_eq!(ended, end);
                    got.push(String::from_utf8(out).unwrap());
                }
                assert_eq!(got[..2], ["data: 1\n\n", "data: 2\n\n"]);
                if trailers {
                    // The open frame waits for the end, which the trailers announce.
                    assert_eq!(got[2], "");
                    s.send(Msg::ResponseTrailers(HttpTrailers::default())).await;
                    let (out, _, ended) = s.streamed(false, Some(1)).await;
                    assert!(!ended);
                    assert_eq!(out, b"data: [DONE]");
                    let answer = s.recv().await.unwrap();
                    assert!(matches!(answer.response, Some(Answer::ResponseTrailers(_))));
                } else {
                    assert_eq!(got[2], "data: [DONE]");
                }
            }
            server.stop().await;
        }
    }

    #[tokio::test]
    async fn a_response_passed_through_is_answered_chunk_by_chunk_with_itself() {
        let server = &servers().await[0];
        let mut client = server.client().await;
        let mut s = Duplex::response(&mut client, "application/json").await;
        s.send(response_body(MARKER.as_bytes(), true)).await;
        let (out, _, ended) = s.streamed(false, Some(1)).await;
        assert!(ended);
        assert_eq!(out, MARKER.as_bytes());
    }

    /// Modes that cannot be supported fail the stream with a status that names the mode.
    #[tokio::test]
    async fn unsupported_modes_fail_the_stream_naming_the_mode() {
        let server = &servers().await[0];
        let mut client = server.client().await;
        // gRPC messages instead of bytes.
        let grpc = BodySendMode::try_from(5).unwrap();
        let mut s = Duplex::with_modes(&mut client, grpc, BodySendMode::FullDuplexStreamed).await;
        s.send(get_request()).await;
        let err = s.recv().await.unwrap_err();
        assert_eq!(err.code(), Code::FailedPrecondition);
        assert!(err.message().contains("request_body_mode GRPC"), "{err:?}");
        // A JSON request in pieces that are answered one by one: it cannot be judged whole.
        for mode in [BodySendMode::Streamed, BodySendMode::BufferedPartial] {
            let mut s = Duplex::with_modes(&mut client, mode, BodySendMode::Streamed).await;
            s.send(post_request("application/json")).await;
            let err = s.recv().await.unwrap_err();
            assert_eq!(err.code(), Code::FailedPrecondition);
            assert!(
                err.message()
                    .contains(&format!("request_body_mode {}", mode.as_str_name())),
                "{err:?}"
            );
        }
        // Full-duplex requests, no response body: no mode override can turn it on.
        let mut s = Duplex::with_modes(
            &mut client,
            BodySendMode::FullDuplexStreamed,
            BodySendMode::None,
        )
        .await;
        s.send(get_request()).await;
        s.recv().await.unwrap();
        s.send(response_headers("text/event-stream")).await;
        let err = s.recv().await.unwrap_err();
        assert_eq!(err.code(), Code::FailedPrecondition);
        assert!(err.message().contains("response_body_mode NONE"), "{err:?}");
    }
}

/// Issue 34, item 6: [`ExtProc::answer_times`] hears of every answer, with its kind of message,
/// from both front doors (`serve`'s service and the tonic-generated server); a failed stream is
/// not an answer.
#[tokio::test]
async fn both_front_doors_time_every_answer_by_kind() {
    use bypass_marker::envoy::{AnswerTimes, MessageKind};
    use std::sync::{Arc, Mutex};

    #[derive(Default)]
    struct Heard(Mutex<Vec<MessageKind>>);
    impl AnswerTimes for Heard {
        fn answered(&self, message: MessageKind, elapsed: std::time::Duration) {
            assert!(elapsed < PATIENCE);
            self.0.lock().unwrap().push(message);
        }
    }
    let processor =
        |heard: &Arc<Heard>| ExtProc::new(BypassMarkerLayer::dynamo()).answer_times(heard.clone());
    let (lean, generated) = (Arc::new(Heard::default()), Arc::new(Heard::default()));
    let servers = [
        (start(processor(&lean)).await, lean),
        (
            start_own(
                envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer::new(
                    processor(&generated),
                ),
            )
            .await,
            generated,
        ),
    ];
    for (server, heard) in servers {
        let mut client = server.client().await;
        let mut stream = Stream::open(&mut client).await;
        stream.call(json_headers(Some(13))).await.unwrap();
        stream
            .call(request_body(br#"{"model":"m"}"#, true))
            .await
            .unwrap();
        stream
            .call(response_headers("text/event-stream"))
            .await
            .unwrap();
        for end in [false, true] {
            let chunk = format!("{MARKER}data: 1\n\n");
            stream
                .call(response_body(chunk.as_bytes(), end))
                .await
                .unwrap();
        }
        // A second headers message fails the stream: not timed.
        stream
            .call(json_headers(None))
            .await
            .expect_err("a second request headers message");
        assert_eq!(
            *heard.0.lock().unwrap(),
            [
                MessageKind::RequestHeaders,
                MessageKind::RequestBody,
                MessageKind::ResponseHeaders,
                MessageKind::ResponseBody,
                MessageKind::ResponseBody,
            ]
        );
        drop(stream);
        server.stop().await;
    }
}
