//! The guard's budget across requests (issue 47, item 2): bodies being read share one
//! `GuardBudget`; past it a request gets 503 `request_bodies_over_budget` with `Retry-After`, and
//! whatever happens to a request (answered, refused, abandoned mid-upload) its bytes come back.
#![cfg(feature = "json")]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{header, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use test_support::serve::{
    self, data, fed_body, read_all, spawn_axum, FedBody, FeedSender, PATIENCE,
};
use tokio::task::JoinHandle;
use tower_bypass_marker::json::{GuardBudget, JsonGuardLayer, SMALL_BODY_BYTES};
use tower_bypass_marker::{BypassMarkerLayer, FrameObserver};

/// A large upload's first piece: over the small-body size, so it may fill only 7/8 of a budget.
const PIECE: usize = 200 * 1024;
/// Four pieces fit in seven eighths of this budget; a fifth does not.
const BUDGET: u64 = 1024 * 1024;

/// Records the refusals the guard reports.
#[derive(Default)]
struct Refusals(Mutex<Vec<(StatusCode, String)>>);

impl FrameObserver for Refusals {
    fn request_refused(&self, status: StatusCode, code: &str) {
        self.0.lock().unwrap().push((status, code.to_owned()));
    }
}

/// An app whose handler reads the whole body and answers 200, behind a guard with `budget`.
async fn serve(budget: &GuardBudget, observer: Arc<Refusals>) -> (SocketAddr, JsonGuardLayer) {
    let guard = BypassMarkerLayer::new()
        .observe(observer)
        .json_guard()
        .budget(budget.clone());
    let app = Router::new()
        .route("/v1/chat/completions", post(|_: Bytes| async { "ok" }))
        .layer(guard.clone());
    (spawn_axum(app).await, guard)
}

/// A chunked JSON upload the test feeds: the sender, and the task that gets the response.
fn upload(addr: SocketAddr) -> (FeedSender, JoinHandle<Response<Incoming>>) {
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

/// Waits until `f` holds, or fails the test.
async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let start = tokio::time::Instant::now();
    while !f() {
        assert!(start.elapsed() < PATIENCE, "waited too long for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A JSON document of exactly `n` bytes: `{"model":"aaa…"}`.
fn json_of(n: usize) -> String {
    format!(r#"{{"model":"{}"}}"#, "a".repeat(n - 12))
}

#[tokio::test]
async fn uploads_past_the_budget_get_503_and_every_byte_comes_back() {
    let budget = GuardBudget::new(BUDGET);
    let observer = Arc::new(Refusals::default());
    let (addr, guard) = serve(&budget, observer.clone()).await;
    assert_eq!(guard.held_bytes(), 0);

    // Eight concurrent uploads, each holding its first 200 KiB: four fit, the next four are
    // refused (each one's partial bytes given back), one at a time so the count is exact.
    let (mut open, mut refused) = (Vec::new(), 0);
    // Each body is its first piece and a short tail, which still fits once four pieces are held.
    let body = json_of(PIECE + 100);
    for i in 0..8 {
        let (tx, res) = upload(addr);
        tx.send(data(body[..PIECE].to_owned())).await.unwrap();
        let held = (open.len() as u64 + 1) * PIECE as u64;
        until("the piece to be held or refused", || {
            budget.held_bytes() == held || res.is_finished()
        })
        .await;
        if res.is_finished() {
            let res = res.await.unwrap();
            assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE, "upload {i}");
            assert_eq!(res.headers()[header::RETRY_AFTER], "1");
            let (json, _) = read_all(res.into_body()).await;
            let json: serde_json::Value = serde_json::from_slice(&json).unwrap();
            assert_eq!(json["error"]["code"], "request_bodies_over_budget");
            assert_eq!(json["error"]["type"], "server_error");
            refused += 1;
        } else {
            open.push((tx, res));
        }
    }
    assert_eq!((open.len(), refused), (4, 4));
    assert_eq!(budget.held_bytes(), 4 * PIECE as u64);
    assert_eq!(
        observer.0.lock().unwrap().as_slice(),
        vec![
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "request_bodies_over_budget".to_owned()
            );
            4
        ]
    );

    // A small request still fits, in the eighth kept for small bodies.
    let small = Request::post(format!("http://{addr}/v1/chat/completions"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(json_of(SMALL_BODY_BYTES as usize))))
        .unwrap();
    let res = serve::h1_client().request(small).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);

    // The held uploads end: each is answered 200, and nothing is held after the last response.
    for (tx, res) in open {
        tx.send(data(body[PIECE..].to_owned())).await.unwrap();
        drop(tx);
        let res = tokio::time::timeout(PATIENCE, res).await.unwrap().unwrap();
        assert_eq!(res.status(), StatusCode::OK);
    }
    assert_eq!(budget.held_bytes(), 0);
}

#[tokio::test]
async fn an_upload_abandoned_mid_read_gives_its_bytes_back() {
    let budget = GuardBudget::new(BUDGET);
    let (addr, guard) = serve(&budget, Arc::default()).await;
    let (tx, res) = upload(addr);
    tx.send(data(json_of(2 * PIECE)[..PIECE].to_owned()))
        .await
        .unwrap();
    until("the piece to be held", || {
        guard.held_bytes() == PIECE as u64
    })
    .await;
    // The client gives up: its body fails, hyper closes the connection, and the server drops the
    // guard's future in the middle of the read.
    tx.send(Err("client gave up".into())).await.unwrap();
    let _ = res.await;
    until("the bytes to come back", || guard.held_bytes() == 0).await;
}

#[tokio::test]
async fn a_body_refused_by_its_length_charges_nothing() {
    let budget = GuardBudget::new(BUDGET);
    let guard = JsonGuardLayer::new()
        .max_body_bytes(1024)
        .budget(budget.clone());
    let app = Router::new()
        .route("/v1/chat/completions", post(|_: Bytes| async { "ok" }))
        .layer(guard);
    let addr = spawn_axum(app).await;
    let (tx, res) = {
        let (tx, body) = fed_body(1);
        let req = Request::post(format!("http://{addr}/v1/chat/completions"))
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::CONTENT_LENGTH, PIECE)
            .body(body)
            .unwrap();
        let client: Client<_, FedBody> = Client::builder(TokioExecutor::new()).build_http();
        (tx, client.request(req))
    };
    let res = tokio::time::timeout(PATIENCE, res).await.unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(budget.held_bytes(), 0);
    drop(tx);
}

/// A guard future dropped in the middle of the read (a server that gives up on the request, a
/// timeout around the service) gives the bytes it held back.
#[tokio::test]
async fn a_future_dropped_mid_read_gives_its_bytes_back() {
    use tower::{Layer, ServiceExt};
    let guard = JsonGuardLayer::new().max_buffered_bytes(BUDGET);
    let upstream = tower::service_fn(|_: Request<_>| async {
        Ok::<_, std::convert::Infallible>(Response::new(Full::<Bytes>::default()))
    });
    let svc = guard.layer(upstream);
    let (tx, body) = fed_body(4);
    let req = Request::post("/v1/chat/completions")
        .header(header::CONTENT_TYPE, "application/json")
        .body(body)
        .unwrap();
    tx.send(data(vec![b' '; PIECE])).await.unwrap();
    let mut future = Box::pin(svc.oneshot(req));
    // Polled until it has read the piece and waits for more.
    assert!(futures_util::poll!(future.as_mut()).is_pending());
    assert_eq!(guard.held_bytes(), PIECE as u64);
    drop(future);
    assert_eq!(guard.held_bytes(), 0);
    drop(tx);
}
