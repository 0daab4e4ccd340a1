//! The layer in the stacks it is deployed in: axum, tonic, and plain hyper, each on a real server
//! on 127.0.0.1 with a real client.

use std::convert::Infallible;
use std::time::Duration;

use axum::extract::{Request as AxumRequest, State};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response as AxumResponse};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use bytes::Bytes;
use futures_util::stream::{self, Stream};
use http::{header, HeaderMap, HeaderValue, Request, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use serde::Deserialize;
use test_support::serve::*;
use tokio::net::TcpStream;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::ServingStatus;
use tower::ServiceBuilder;
use tower_bypass_marker::{BypassMarkerLayer, RequestedAnnotations, BYPASS_REMOTE_PREFILL};

/// The `data` of the chat-completion chunks every streaming endpoint here sends after the marker.
const CHUNKS: [&str; 4] = [
    r#"{"id":"c1","choices":[{"delta":{"role":"assistant"}}]}"#,
    r#"{"id":"c1","choices":[{"delta":{"content":"Hello"}}]}"#,
    r#"{"id":"c1","choices":[{"delta":{"content":" world"}}]}"#,
    "[DONE]",
];

/// What a client that did not opt in must receive: the chunks, and nothing else.
fn filtered() -> String {
    CHUNKS.iter().map(|c| format!("data: {c}\n\n")).collect()
}

/// What a client that opted in must receive: the marker first, then the chunks.
fn unfiltered() -> String {
    format!("{MARKER}{}", filtered())
}

/// The marker as axum's `Sse` writes it, then the chunks, one event each.
fn completion_events() -> impl Stream<Item = Result<Event, Infallible>> {
    let marker = Event::default()
        .event(BYPASS_REMOTE_PREFILL)
        .comment("true");
    let chunks = CHUNKS.map(|c| Event::default().data(c));
    stream::iter(std::iter::once(marker).chain(chunks).map(Ok))
}

// --- axum -----------------------------------------------------------------------------------

#[derive(Deserialize)]
struct ChatRequest {
    nvext: Option<NvExt>,
}

#[derive(Deserialize)]
struct NvExt {
    #[serde(default)]
    annotations: Vec<String>,
}

/// An OpenAI-style endpoint: guards `nvext.annotations`, puts the granted opt-in in the response
/// extensions, and reports in a header what the router would have been told.
async fn chat(
    State(layer): State<BypassMarkerLayer>,
    Json(req): Json<ChatRequest>,
) -> AxumResponse {
    let mut annotations = req.nvext.map(|n| n.annotations).unwrap_or_default();
    let granted = layer.guard_annotations(&mut annotations);
    let seen_by_router = annotations.join(",");
    (
        [("x-router-annotations", seen_by_router)],
        Extension(granted),
        Sse::new(completion_events()),
    )
        .into_response()
}

/// Middleware outside the layer that grants the opt-in from a header, in the request extensions.
async fn opt_in_from_header(
    State(layer): State<BypassMarkerLayer>,
    mut req: AxumRequest,
    next: Next,
) -> AxumResponse {
    if let Some(value) = req.headers().get("x-nvext-annotations") {
        let mut annotations: Vec<String> = value
            .to_str()
            .unwrap()
            .split(',')
            .map(str::to_owned)
            .collect();
        let granted = layer.guard_annotations(&mut annotations);
        req.extensions_mut().insert(granted);
    }
    next.run(req).await
}

/// The app; `layered` puts `BypassMarkerLayer` on every route.
fn app(layered: bool) -> Router {
    let layer = BypassMarkerLayer::new();
    let routes = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route(
            "/v1/events",
            get(|| async { Sse::new(completion_events()) }),
        )
        .route(
            "/v1/models",
            get(|| async {
                Json(serde_json::json!({
                    "object": "list",
                    "data": [{"id": "llama", "object": "model", "owned_by": "dynamo"}],
                }))
            }),
        )
        .route(
            // An event stream with a known length: hyper sends `content-length`.
            "/v1/sized",
            get(|| async { ([(header::CONTENT_TYPE, "text/event-stream")], unfiltered()) }),
        )
        .route(
            // A proxy that copies the upstream's `content-length` and streams the body.
            "/v1/proxied",
            get(|| async {
                let length = unfiltered().len().to_string();
                let chunks = chunked(unfiltered().as_bytes(), &[11, 40]);
                let body = axum::body::Body::from_stream(stream::iter(
                    chunks.into_iter().map(Ok::<_, Infallible>),
                ));
                (
                    [
                        (header::CONTENT_TYPE, "text/event-stream".to_owned()),
                        (header::CONTENT_LENGTH, length),
                    ],
                    body,
                )
            }),
        )
        .with_state(layer.clone());
    let routes = if layered {
        routes.layer(layer.clone())
    } else {
        routes
    };
    routes.layer(middleware::from_fn_with_state(layer, opt_in_from_header))
}

async fn send(
    addr: std::net::SocketAddr,
    req: Request<Full<Bytes>>,
) -> (http::response::Parts, Bytes) {
    let uri = format!("http://{addr}{}", req.uri());
    let (mut parts, body) = req.into_parts();
    parts.uri = uri.parse().unwrap();
    let res = h1_client()
        .request(Request::from_parts(parts, body))
        .await
        .unwrap();
    let (parts, body) = res.into_parts();
    (parts, read_all(body).await.0)
}

fn get_req(path: &str) -> Request<Full<Bytes>> {
    Request::get(path).body(Full::default()).unwrap()
}

/// A GET whose `x-nvext-annotations` header the test app's outer middleware turns into an opt-in.
fn annotated_get(path: &str, annotations: &'static str) -> Request<Full<Bytes>> {
    let mut req = get_req(path);
    req.headers_mut()
        .insert("x-nvext-annotations", HeaderValue::from_static(annotations));
    req
}

fn chat_req(annotations: &[&str]) -> Request<Full<Bytes>> {
    let body = serde_json::json!({
        "model": "llama",
        "stream": true,
        "messages": [{"role": "user", "content": "hi"}],
        "nvext": {"annotations": annotations},
    });
    Request::post("/v1/chat/completions")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap()
}

#[tokio::test]
async fn axum_default_client_never_sees_the_marker() {
    let addr = spawn_axum(app(true)).await;

    let (parts, body) = send(addr, get_req("/v1/events")).await;
    assert_eq!(parts.status, StatusCode::OK);
    assert_eq!(parts.headers[header::CONTENT_TYPE], "text/event-stream");
    assert_eq!(body, filtered());

    let (_, body) = send(addr, chat_req(&[])).await;
    assert_eq!(body, filtered());

    // Without the layer the same endpoints do send it: the servers above are what removed it.
    let plain = spawn_axum(app(false)).await;
    assert_eq!(send(plain, get_req("/v1/events")).await.1, unfiltered());
}

#[tokio::test]
async fn axum_opt_in_in_response_extensions_gets_the_marker_first() {
    let addr = spawn_axum(app(true)).await;

    let (parts, body) = send(addr, chat_req(&[BYPASS_REMOTE_PREFILL, "request_id"])).await;
    assert_eq!(body, unfiltered());
    assert!(body.starts_with(MARKER.as_bytes()));
    // The guard kept the router's own marker out of what the router is told; `request_id` is not a
    // name this layer knows, so it is left alone.
    assert_eq!(parts.headers["x-router-annotations"], "request_id");
}

#[tokio::test]
async fn axum_client_cannot_force_the_bypass_or_smuggle_the_marker() {
    let addr = spawn_axum(app(true)).await;

    // `name:value` and other spellings are stripped from the request and are not an opt-in.
    for forced in [
        "x-bypass-remote-prefill:true",
        " X-Bypass-Remote-Prefill ",
        "x-bypass-remote-prefill: true",
    ] {
        let (parts, body) = send(addr, chat_req(&[forced])).await;
        assert_eq!(body, filtered(), "{forced:?}");
        assert_eq!(parts.headers["x-router-annotations"], "", "{forced:?}");
    }
}

#[tokio::test]
async fn axum_opt_in_in_request_extensions_from_outer_middleware() {
    let addr = spawn_axum(app(true)).await;

    let req = annotated_get("/v1/events", BYPASS_REMOTE_PREFILL);
    let (_, body) = send(addr, req).await;
    assert_eq!(body, unfiltered());

    // The same middleware with another annotation grants nothing the layer knows about.
    let req = annotated_get("/v1/events", "request_id");
    assert_eq!(send(addr, req).await.1, filtered());
}

#[tokio::test]
async fn axum_json_response_is_byte_identical_with_and_without_the_layer() {
    let layered = spawn_axum(app(true)).await;
    let plain = spawn_axum(app(false)).await;

    let (with, with_body) = send(layered, get_req("/v1/models")).await;
    let (without, without_body) = send(plain, get_req("/v1/models")).await;
    assert_eq!(with.status, without.status);
    assert_eq!(with_body, without_body);
    assert_eq!(with.headers[header::CONTENT_TYPE], "application/json");
    assert_eq!(
        with.headers[header::CONTENT_LENGTH],
        without_body.len().to_string().as_str()
    );
    // Every header but the date is the same.
    let strip_date = |mut h: HeaderMap| {
        h.remove(header::DATE);
        h
    };
    assert_eq!(strip_date(with.headers), strip_date(without.headers));
}

#[tokio::test]
async fn axum_content_length_is_removed_only_from_a_filtered_event_stream() {
    let addr = spawn_axum(app(true)).await;

    let (parts, body) = send(addr, get_req("/v1/sized")).await;
    assert_eq!(body, filtered());
    assert!(
        !parts.headers.contains_key(header::CONTENT_LENGTH),
        "a filtered body is shorter than the inner body's content-length: {:?}",
        parts.headers
    );

    // An opted-in client gets the body passed through, with its length.
    let req = annotated_get("/v1/sized", BYPASS_REMOTE_PREFILL);
    let (parts, body) = send(addr, req).await;
    assert_eq!(body, unfiltered());
    assert_eq!(
        parts.headers[header::CONTENT_LENGTH],
        unfiltered().len().to_string().as_str()
    );

    // Without the layer the sized stream has its length (so the test above would notice).
    let plain = spawn_axum(app(false)).await;
    let (parts, _) = send(plain, get_req("/v1/sized")).await;
    assert!(parts.headers.contains_key(header::CONTENT_LENGTH));
}

#[tokio::test]
async fn axum_content_length_copied_from_upstream_is_removed_when_filtering() {
    let addr = spawn_axum(app(true)).await;

    // Left in place, the upstream's length would promise bytes the filtered body never sends.
    let (parts, body) = send(addr, get_req("/v1/proxied")).await;
    assert_eq!(body, filtered());
    assert!(!parts.headers.contains_key(header::CONTENT_LENGTH));

    let req = annotated_get("/v1/proxied", BYPASS_REMOTE_PREFILL);
    let (parts, body) = send(addr, req).await;
    assert_eq!(body, unfiltered());
    assert_eq!(
        parts.headers[header::CONTENT_LENGTH],
        unfiltered().len().to_string().as_str()
    );
}

// --- tonic ----------------------------------------------------------------------------------

async fn health_client(addr: std::net::SocketAddr) -> HealthClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    HealthClient::new(channel)
}

async fn next_status(
    stream: &mut tonic::Streaming<tonic_health::pb::HealthCheckResponse>,
) -> Option<i32> {
    tokio::time::timeout(PATIENCE, stream.message())
        .await
        .expect("no health message in time")
        .expect("the watch stream failed")
        .map(|m| m.status)
}

/// Watches `svc` through `client`, changes its status twice, then clears it, which ends the
/// stream: both messages and the `grpc-status: 0` trailers must arrive.
async fn watch_through(
    client: &mut HealthClient<tonic::transport::Channel>,
    reporter: &mut tonic_health::server::HealthReporter,
    svc: &str,
) {
    reporter
        .set_service_status(svc, ServingStatus::Serving)
        .await;
    let mut stream = client
        .watch(HealthCheckRequest {
            service: svc.to_owned(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        next_status(&mut stream).await,
        Some(ServingStatus::Serving as i32)
    );

    reporter
        .set_service_status(svc, ServingStatus::NotServing)
        .await;
    assert_eq!(
        next_status(&mut stream).await,
        Some(ServingStatus::NotServing as i32)
    );

    // Dropping the service's status sender ends the server stream: an OK status in the trailers.
    reporter.clear_service_status(svc).await;
    assert_eq!(next_status(&mut stream).await, None);
    let trailers = stream.trailers().await.unwrap().expect("no trailers");
    assert_eq!(trailers.get("grpc-status").unwrap(), "0");

    // An error status (a trailers-only response) reaches the client too.
    let err = client
        .check(HealthCheckRequest {
            service: "not-registered".to_owned(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    assert_eq!(err.message(), "service not registered");
}

#[tokio::test]
async fn tonic_health_watch_streams_messages_and_trailers_through_the_layer() {
    let (mut reporter, health) = tonic_health::server::health_reporter();
    let (listener, addr) = listener().await;
    tokio::spawn(
        tonic::transport::Server::builder()
            .layer(BypassMarkerLayer::new())
            .add_service(health)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );

    let mut client = health_client(addr).await;
    watch_through(&mut client, &mut reporter, "inference").await;
}

#[tokio::test]
async fn tonic_and_axum_routes_share_one_server_and_one_layer() {
    let (mut reporter, health) = tonic_health::server::health_reporter();
    let app = tonic::service::Routes::new(health)
        .into_axum_router()
        .merge(app(false))
        .layer(BypassMarkerLayer::new());
    // hyper-util's auto builder speaks HTTP/1.1 and h2c, for the gRPC client.
    let addr = spawn_auto(app, 200).await;

    let mut client = health_client(addr).await;
    watch_through(&mut client, &mut reporter, "inference").await;

    let (_, body) = send(addr, get_req("/v1/events")).await;
    assert_eq!(body, filtered());
    let res = h2_client()
        .request(
            Request::get(format!("http://{addr}/v1/events"))
                .body(Full::default())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(res.version(), http::Version::HTTP_2);
    assert_eq!(read_all(res.into_body()).await.0, filtered());
}

// --- plain hyper ----------------------------------------------------------------------------

/// The marker and chunks, split so that the marker and every chunk straddle frame boundaries.
fn upstream_chunks() -> Vec<Bytes> {
    chunked(unfiltered().as_bytes(), &[7, 1, 30, 3, 64])
}

fn trailers() -> HeaderMap {
    let mut trailers = HeaderMap::new();
    trailers.insert("x-checksum", HeaderValue::from_static("abc123"));
    trailers
}

/// Serves `tcp` with a layered hyper service: an event stream in odd-sized chunks, then trailers.
/// A request that carries `x-opt-in` opts in.
fn serve_hyper_connection(tcp: TcpStream, http2: bool) {
    let svc = ServiceBuilder::new()
        .map_request(|mut req: Request<Incoming>| {
            if req.headers().contains_key("x-opt-in") {
                let granted: RequestedAnnotations = [BYPASS_REMOTE_PREFILL].into_iter().collect();
                req.extensions_mut().insert(granted);
            }
            req
        })
        .layer(BypassMarkerLayer::new())
        .service_fn(|_req: Request<Incoming>| async {
            let mut frames: Vec<_> = upstream_chunks().into_iter().map(data).collect();
            frames.push(Ok(Frame::trailers(trailers())));
            let mut res = event_stream(frames_body(frames));
            // For HTTP/1.1, hyper sends only declared trailer fields.
            res.headers_mut()
                .insert(header::TRAILER, HeaderValue::from_static("x-checksum"));
            Ok::<_, Infallible>(res)
        });
    let svc = TowerToHyperService::new(svc);
    let io = TokioIo::new(tcp);
    if http2 {
        tokio::spawn(
            hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .serve_connection(io, svc),
        );
    } else {
        tokio::spawn(hyper::server::conn::http1::Builder::new().serve_connection(io, svc));
    }
}

async fn hyper_round_trip(http2: bool, opt_in: bool) -> (Bytes, Option<HeaderMap>) {
    let (listener, addr) = listener().await;
    let client_io = TcpStream::connect(addr).await.unwrap();
    serve_hyper_connection(listener.accept().await.unwrap().0, http2);

    let io = TokioIo::new(client_io);
    let mut req = Request::get(format!("http://{addr}/stream"))
        .header(header::TE, "trailers")
        .body(Full::<Bytes>::default())
        .unwrap();
    if opt_in {
        req.headers_mut()
            .insert("x-opt-in", HeaderValue::from_static("1"));
    }
    let res = if http2 {
        let (mut sender, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
            .await
            .unwrap();
        tokio::spawn(conn);
        sender.send_request(req).await.unwrap()
    } else {
        let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await.unwrap();
        tokio::spawn(conn);
        sender.send_request(req).await.unwrap()
    };
    assert_eq!(res.status(), StatusCode::OK);
    assert!(!res.headers().contains_key(header::CONTENT_LENGTH));
    read_all(res.into_body()).await
}

/// Over plain hyper (HTTP/2 when `http2`), a default client gets the filtered stream and an
/// opted-in one the whole stream, both with the trailers.
async fn assert_hyper_stream_is_filtered_and_trailers_forwarded(http2: bool) {
    for (opted_in, expected) in [(false, filtered()), (true, unfiltered())] {
        let (body, trailers) = hyper_round_trip(http2, opted_in).await;
        assert_eq!(body, expected, "opted in: {opted_in}");
        assert_eq!(trailers, Some(self::trailers()), "opted in: {opted_in}");
    }
}

#[tokio::test]
async fn hyper_http1_stream_is_filtered_and_trailers_forwarded() {
    assert_hyper_stream_is_filtered_and_trailers_forwarded(false).await;
}

#[tokio::test]
async fn hyper_h2c_stream_is_filtered_and_trailers_forwarded() {
    assert_hyper_stream_is_filtered_and_trailers_forwarded(true).await;
}

// --- a client that goes away ----------------------------------------------------------------

#[tokio::test]
async fn client_disconnect_mid_stream_drops_the_inner_body_and_the_server_keeps_serving() {
    // Each response body reports its drop; the connection tasks are kept to see how they ended.
    let (dropped_tx, mut dropped_rx) = tokio::sync::mpsc::unbounded_channel();
    let (senders_tx, held_senders) = tokio::sync::mpsc::unbounded_channel();
    let svc = ServiceBuilder::new()
        .layer(BypassMarkerLayer::new())
        .service_fn(move |req: Request<Incoming>| {
            let (tx, body) = fed_body(16);
            if req.uri().path() == "/hang" {
                // A whole frame, then the start of a marker frame that never completes: the layer
                // holds it while the inner body waits (the test keeps the sender).
                tx.try_send(data("data: 1\n\n")).unwrap();
                tx.try_send(data("event: x-bypass-remote-prefill\n: tr"))
                    .unwrap();
                senders_tx.send(tx).unwrap();
            } else {
                for chunk in upstream_chunks() {
                    tx.try_send(data(chunk)).unwrap();
                }
            }
            let (body, dropped) = DropFlag::notifying(body);
            dropped_tx.send(dropped).unwrap();
            std::future::ready(Ok::<_, Infallible>(event_stream(body)))
        });

    let (listener, addr) = listener().await;
    let (conn_tx, mut conn_rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        for _ in 0..2 {
            let (tcp, _) = listener.accept().await.unwrap();
            let svc = TowerToHyperService::new(svc.clone());
            let conn = tokio::spawn(
                hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(tcp), svc),
            );
            conn_tx.send(conn).unwrap();
        }
    });

    // The first client reads the whole frame, then goes away while the marker frame is held.
    let io = TokioIo::new(TcpStream::connect(addr).await.unwrap());
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await.unwrap();
    let client_conn = tokio::spawn(conn);
    let req = Request::get("/hang")
        .body(Full::<Bytes>::default())
        .unwrap();
    let mut body = sender.send_request(req).await.unwrap().into_body();
    let first = tokio::time::timeout(PATIENCE, body.frame())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(first.into_data().unwrap(), "data: 1\n\n");
    // The held part of the marker frame is not sent while the frame is open.
    assert!(
        tokio::time::timeout(Duration::from_millis(200), body.frame())
            .await
            .is_err(),
        "the open marker frame leaked"
    );
    drop(body);
    drop(sender);
    client_conn.abort();

    let dropped = dropped_rx.recv().await.unwrap();
    tokio::time::timeout(PATIENCE, dropped)
        .await
        .expect("the inner body was not dropped after the client went away")
        .unwrap();
    let server_conn = conn_rx.recv().await.unwrap();
    let outcome = tokio::time::timeout(PATIENCE, server_conn)
        .await
        .expect("the connection task did not end");
    assert!(outcome.is_ok(), "the connection task panicked: {outcome:?}");

    // The server goes on serving, filtering as before.
    let (_, body) = send(addr, get_req("/ok")).await;
    assert_eq!(body, filtered());
    // A body that ran to its end is dropped as well.
    let dropped = dropped_rx.recv().await.unwrap();
    tokio::time::timeout(PATIENCE, dropped)
        .await
        .unwrap()
        .unwrap();
    // Until here the test kept the hanging body's sender, so only the client could end it.
    drop(held_senders);
}
