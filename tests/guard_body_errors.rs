//! The guard's answer when the request body fails while it reads it (issue 47, item 3): a length
//! limit is 413, a body timeout 408, anything else 400, over real HTTP with tower-http's layers
//! outside the guard, and what axum's `DefaultBodyLimit` does (and does not) do to the guard.
#![cfg(feature = "json")]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{header, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use test_support::serve::{
    self, data, fed_body, forever, frames_body, read_all, spawn_axum, FedBody, FeedSender,
    FramesBody, PATIENCE,
};
use tower::ServiceExt;
use tower_bypass_marker::json::{JsonGuardBody, JsonGuardLayer};
use tower_bypass_marker::sans_io::Refusal;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::timeout::{RequestBodyTimeoutLayer, TimeoutBody};

fn app(guard: JsonGuardLayer) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(|_: Bytes| async { "ok" }))
        .layer(guard)
}

/// A chunked JSON upload the test feeds: the sender, and the task that gets the response.
fn upload(addr: SocketAddr) -> (FeedSender, tokio::task::JoinHandle<Response<Incoming>>) {
    let (tx, body) = fed_body(4);
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

/// The status and the error `code` of a response.
async fn answer(res: Response<Incoming>) -> (StatusCode, String) {
    let status = res.status();
    let (body, _) = read_all(res.into_body()).await;
    let json: serde_json::Value = serde_json::from_slice(&body)
        .unwrap_or_else(|_| panic!("{status} {}", String::from_utf8_lossy(&body)));
    (status, json["error"]["code"].as_str().unwrap().to_owned())
}

#[tokio::test]
async fn a_length_limit_outside_the_guard_is_413() {
    let addr = spawn_axum(app(JsonGuardLayer::new()).layer(RequestBodyLimitLayer::new(1024))).await;
    let (tx, res) = upload(addr);
    // Chunked: no length to refuse up front, so the limit is hit while the guard reads.
    for _ in 0..4 {
        if tx.send(data(vec![b' '; 512])).await.is_err() {
            break;
        }
    }
    let res = tokio::time::timeout(PATIENCE, res).await.unwrap().unwrap();
    assert_eq!(
        answer(res).await,
        (
            StatusCode::PAYLOAD_TOO_LARGE,
            "request_too_large".to_owned()
        )
    );
}

#[tokio::test]
async fn a_body_timeout_outside_the_guard_is_408() {
    let timeout = RequestBodyTimeoutLayer::new(Duration::from_millis(200));
    let addr = spawn_axum(app(JsonGuardLayer::new()).layer(timeout)).await;
    let (tx, res) = upload(addr);
    tx.send(data(r#"{"model":"#)).await.unwrap();
    // ... and nothing more: the body timeout ends it.
    let res = tokio::time::timeout(PATIENCE, res).await.unwrap().unwrap();
    assert_eq!(
        answer(res).await,
        (StatusCode::REQUEST_TIMEOUT, "request_timeout".to_owned())
    );
    drop(tx);
}

/// The guard called in process over a body that yields `{` and then fails with `error`.
async fn failing_with(error: serve::BoxError) -> Refusal {
    let upstream = tower::service_fn(|_: Request<JsonGuardBody<FramesBody>>| async {
        Ok::<_, Infallible>(Response::new(Full::<Bytes>::default()))
    });
    let svc = tower::ServiceBuilder::new()
        .layer(JsonGuardLayer::new())
        .service(upstream);
    let req = Request::post("/v1/chat/completions")
        .header(header::CONTENT_TYPE, "application/json")
        .body(frames_body(vec![data("{"), Err(error)]))
        .unwrap();
    let res = svc.oneshot(req).await.unwrap();
    let status = res.status();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let code = json["error"]["code"].as_str().unwrap();
    let expected = match code {
        "body_read_error" => Refusal::body_read_error(),
        "request_timeout" => Refusal::body_timeout(),
        other => panic!("{other}"),
    };
    assert_eq!(status, expected.status());
    expected
}

#[tokio::test]
async fn any_other_body_error_is_400_and_an_io_timeout_408() {
    let refusal = failing_with("the connection broke".into()).await;
    assert_eq!(
        (refusal.status(), refusal.code()),
        (StatusCode::BAD_REQUEST, "body_read_error")
    );
    // An io::Error of kind TimedOut, anywhere in the chain, is a timeout.
    let timed_out = std::io::Error::new(std::io::ErrorKind::TimedOut, "read timed out");
    let wrapped = std::io::Error::other(timed_out);
    let refusal = failing_with(Box::new(wrapped)).await;
    assert_eq!(
        (refusal.status(), refusal.code()),
        (StatusCode::REQUEST_TIMEOUT, "request_timeout")
    );
}

/// The guard knows these errors by their text: the real types hold it to it, so that a new
/// wording upstream fails here.
#[tokio::test]
async fn the_limit_and_timeout_errors_are_known_by_their_real_types() {
    let limited = Limited::new(Full::new(Bytes::from_static(b"{\"a\":1}")), 2);
    let error = limited.collect().await.unwrap_err();
    let refusal = Refusal::for_body_error(&*error);
    assert_eq!(
        (refusal.status(), refusal.code()),
        (StatusCode::PAYLOAD_TOO_LARGE, "request_too_large")
    );

    let timeout = Box::pin(TimeoutBody::new(Duration::from_millis(1), forever()));
    let error = timeout.collect().await.unwrap_err();
    let refusal = Refusal::for_body_error(&*error);
    assert_eq!(
        (refusal.status(), refusal.code()),
        (StatusCode::REQUEST_TIMEOUT, "request_timeout")
    );
}

/// axum's `DefaultBodyLimit` is an extension its extractors read: the guard, a layer, reads the
/// body whole before any extractor runs. Set the guard's own cap to the same limit.
#[tokio::test]
async fn default_body_limit_binds_the_handler_not_the_guard() {
    let json = format!(r#"{{"model":"{}"}}"#, "a".repeat(4096));
    let post_json = |addr: SocketAddr| {
        Request::post(format!("http://{addr}/v1/chat/completions"))
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(json.clone())))
            .unwrap()
    };
    // The guard reads and forwards the 4 KiB body; the handler's extractor refuses it, in axum's
    // words (text, not OpenAI's shape).
    let limit = DefaultBodyLimit::max(1024);
    let addr = spawn_axum(app(JsonGuardLayer::new()).layer(limit)).await;
    let res = serve::h1_client().request(post_json(addr)).await.unwrap();
    assert_eq!(res.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_ne!(res.headers()[header::CONTENT_TYPE], "application/json");

    // With the guard's cap at the same limit, the guard refuses first, in OpenAI's shape.
    let guard = JsonGuardLayer::new().max_body_bytes(1024);
    let addr = spawn_axum(app(guard).layer(limit)).await;
    let res = serve::h1_client().request(post_json(addr)).await.unwrap();
    assert_eq!(
        answer(res).await,
        (
            StatusCode::PAYLOAD_TOO_LARGE,
            "request_too_large".to_owned()
        )
    );
}
