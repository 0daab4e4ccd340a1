//! The JSON request guard (`json` feature) in a real stack: axum on 127.0.0.1 with the guard and
//! the response layer, driven by hyper's client (whole and chunked uploads, `Expect:
//! 100-continue`) and by raw HTTP/1.1 where the exchange itself is what is tested.
#![cfg(feature = "json")]

use test_support::serve;

use std::net::SocketAddr;

use axum::body::Body;
use axum::extract::State;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{header, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serve::{data, fed_body, read_all, spawn_axum, FedBody, FeedSender, MARKER, PATIENCE};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tower_bypass_marker::BypassMarkerLayer;

const REQUEST_ID: &str = "event: request_id\n: \"r-1\"\n\n";
const CHUNK: &str = "data: {\"choices\":[]}\n\n";

/// What the upstream (the handler) received, sent to the test.
type Received = mpsc::UnboundedSender<Bytes>;

/// A Dynamo-like handler: records the request body, and streams the marker, a `request_id`
/// frame and a chunk, whatever it was asked.
async fn chat(State(received): State<Received>, body: Bytes) -> Response<Body> {
    received.send(body).unwrap();
    serve::event_stream(Body::from(format!("{MARKER}{REQUEST_ID}{CHUNK}")))
}

/// Serves the guarded app; `guard_outside` chooses the layer order.
async fn serve(
    guard_outside: bool,
    max_body_bytes: usize,
) -> (SocketAddr, mpsc::UnboundedReceiver<Bytes>) {
    let bypass = BypassMarkerLayer::new().opt_in("request_id");
    let guard = bypass.json_guard().max_body_bytes(max_body_bytes);
    let (tx, rx) = mpsc::unbounded_channel();
    let app = Router::new()
        .route("/v1/chat/completions", post(chat))
        .with_state(tx);
    // `Router::layer` wraps what is there: the layer added last is the outermost.
    let app = if guard_outside {
        app.layer(bypass.clone()).layer(guard)
    } else {
        app.layer(guard).layer(bypass.clone())
    };
    (spawn_axum(app).await, rx)
}

const ASKED: &str = r#"{"model":"m","nvext":{"annotations":["request_id","x-bypass-remote-prefill"]},"stream":true}"#;
const FORCED: &str = r#"{"model":"m","nvext":{"annotations":["x-bypass-remote-prefill:true", "X-BYPASS-REMOTE-PREFILL"]},"stream":true}"#;
const ASKED_SEEN: &str = r#"{"model":"m","nvext":{"annotations":["request_id"]},"stream":true}"#;
const FORCED_SEEN: &str = r#"{"model":"m","nvext":{"annotations":[]},"stream":true}"#;

fn post_json(addr: SocketAddr, body: &'static str) -> Request<Full<Bytes>> {
    Request::post(format!("http://{addr}/v1/chat/completions"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

async fn received(rx: &mut mpsc::UnboundedReceiver<Bytes>) -> Bytes {
    tokio::time::timeout(PATIENCE, rx.recv())
        .await
        .unwrap()
        .unwrap()
}

#[tokio::test]
async fn the_guard_strips_the_request_and_grants_the_response_in_either_order() {
    for guard_outside in [true, false] {
        let (addr, mut rx) = serve(guard_outside, 1 << 20).await;
        let client = serve::h1_client();

        // A client that asked for the marker and request_id: the router never sees the marker,
        // the client gets both frames.
        let res = client.request(post_json(addr, ASKED)).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(received(&mut rx).await, ASKED_SEEN);
        let (body, _) = read_all(res.into_body()).await;
        assert_eq!(
            body,
            format!("{MARKER}{REQUEST_ID}{CHUNK}"),
            "guard outside: {guard_outside}"
        );

        // A client that tried to force the bypass: stripped, and not an opt-in.
        let res = client.request(post_json(addr, FORCED)).await.unwrap();
        assert_eq!(received(&mut rx).await, FORCED_SEEN);
        let (body, _) = read_all(res.into_body()).await;
        assert_eq!(body, CHUNK, "guard outside: {guard_outside}");
    }
}

/// A JSON upload to `addr`'s chat endpoint whose body the test feeds piece by piece through the
/// sender (sent chunked, as it comes): the sender, and the task that gets the response.
fn chunked_upload(addr: SocketAddr) -> (FeedSender, JoinHandle<Response<Incoming>>) {
    let (tx, body) = fed_body(16);
    let req = Request::post(format!("http://{addr}/v1/chat/completions"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(body)
        .unwrap();
    let client: Client<_, FedBody> = Client::builder(TokioExecutor::new()).build_http();
    let res = client.request(req);
    (
        tx,
        tokio::spawn(async move { res.await.expect("a response") }),
    )
}

#[tokio::test]
async fn a_chunked_upload_is_read_as_it_arrives() {
    let (addr, mut rx) = serve(true, 1 << 20).await;
    let (tx, res) = chunked_upload(addr);
    // Cut inside the marker and inside an escape.
    for piece in [
        "{\"model\":\"m\",\"nvext\":{\"annotations\":[\"request_id\",\"x-byp",
        "ass-remote-prefill\"",
        ",\"x\\u00",
        "2dbypass-remote-prefill\"]},\"stream\":true}",
    ] {
        tx.send(data(piece)).await.unwrap();
        tokio::task::yield_now().await;
    }
    drop(tx);
    let res = tokio::time::timeout(PATIENCE, res).await.unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(received(&mut rx).await, ASKED_SEEN);
    let (body, _) = read_all(res.into_body()).await;
    assert_eq!(body, format!("{MARKER}{REQUEST_ID}{CHUNK}"));
}

#[tokio::test]
async fn a_chunked_upload_over_the_limit_gets_413_before_its_end() {
    let (addr, mut rx) = serve(true, 1000).await;
    let (tx, res) = chunked_upload(addr);
    tx.send(data(format!("{{\"pad\":\"{}", "x".repeat(600))))
        .await
        .unwrap();
    tx.send(data("y".repeat(600))).await.unwrap();
    // The upload is still open when the answer comes.
    let res = tokio::time::timeout(PATIENCE, res).await.unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let (body, _) = read_all(res.into_body()).await;
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["code"], "request_too_large");
    assert!(rx.try_recv().is_err(), "the upstream was not called");
    drop(tx);
}

#[tokio::test]
async fn hyper_clients_expect_100_continue_is_served() {
    let (addr, mut rx) = serve(true, 1 << 20).await;
    let mut req = post_json(addr, ASKED);
    req.headers_mut()
        .insert(header::EXPECT, "100-continue".parse().unwrap());
    let res = serve::h1_client().request(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(received(&mut rx).await, ASKED_SEEN);
    let (body, _) = read_all(res.into_body()).await;
    assert_eq!(body, format!("{MARKER}{REQUEST_ID}{CHUNK}"));
}

/// Reads from `tcp` until `until` is in what was read.
async fn read_until(tcp: &mut TcpStream, until: &str) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains(until) {
        let n = tokio::time::timeout(PATIENCE, tcp.read(&mut buf))
            .await
            .expect("the server did not answer")
            .unwrap();
        assert!(n > 0, "closed after {:?}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    String::from_utf8(got).unwrap()
}

#[tokio::test]
async fn expect_100_continue_is_answered_only_when_the_guard_reads() {
    let (addr, mut rx) = serve(true, 1000).await;

    // Within the limit: the server asks for the body once the guard reads it.
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nexpect: 100-continue\r\n\r\n",
        ASKED.len()
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    let interim = read_until(&mut tcp, "\r\n\r\n").await;
    assert!(
        interim.starts_with("HTTP/1.1 100 Continue\r\n"),
        "{interim}"
    );
    tcp.write_all(ASKED.as_bytes()).await.unwrap();
    let response = read_until(&mut tcp, CHUNK).await;
    assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
    assert!(response.contains(MARKER));
    assert_eq!(received(&mut rx).await, ASKED_SEEN);

    // Over the limit: refused from the head, and no 100 Continue invites the body.
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: 5000\r\nexpect: 100-continue\r\n\r\n"
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    let response = read_until(&mut tcp, "request_too_large").await;
    assert!(
        response.starts_with("HTTP/1.1 413 Payload Too Large\r\n"),
        "{response}"
    );
    assert!(!response.contains("100 Continue"));
    assert!(rx.try_recv().is_err());
}

#[tokio::test]
async fn a_bad_body_gets_a_json_400_through_the_stack() {
    let (addr, mut rx) = serve(true, 1 << 20).await;
    let body = r#"{"nvext":{"annotations":["x-bypass-remote-prefill"]},"nv\u0065xt":null}"#;
    let res = serve::h1_client()
        .request(post_json(addr, body))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(res.headers()[header::CONTENT_TYPE], "application/json");
    let (body, _) = read_all(res.into_body()).await;
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["code"], "duplicate_key");
    assert!(rx.try_recv().is_err());
}
