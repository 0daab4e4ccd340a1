//! Failures around the layer: bodies that fail or stop mid-frame, services that fail or are not
//! ready, clients that go away. Hand-made bodies and services, so every fault lands exactly where
//! the test wants it.

use std::convert::Infallible;
use std::future::{ready, Ready};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use test_support::serve::*;
use tower::{service_fn, Layer, Service, ServiceBuilder, ServiceExt};
use tower_bypass_marker::{BypassMarkerBody, BypassMarkerLayer};

/// Runs `body` as a `text/event-stream` response through the default layer, for a client that
/// did not opt in.
async fn filtered<B>(body: B) -> BypassMarkerBody<B>
where
    B: Body + Send + 'static,
{
    let mut body = Some(body);
    let svc = ServiceBuilder::new()
        .layer(BypassMarkerLayer::new())
        .service_fn(move |_req: Request<()>| {
            ready(Ok::<_, Infallible>(event_stream(body.take().unwrap())))
        });
    let res = svc.oneshot(Request::new(())).await.unwrap();
    let body = res.into_body();
    assert!(body.is_filtering());
    body
}

/// The next frame, which must come without waiting.
async fn next<B: Body + Unpin>(body: &mut B) -> Option<Result<Frame<B::Data>, B::Error>> {
    tokio::time::timeout(PATIENCE, body.frame())
        .await
        .expect("the body did not yield a frame in time")
}

async fn next_data<B>(body: &mut B) -> Bytes
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Debug,
{
    next(body)
        .await
        .expect("the body ended")
        .expect("the body failed")
        .into_data()
        .expect("not a data frame")
}

async fn next_error<B>(body: &mut B) -> B::Error
where
    B: Body<Data = Bytes> + Unpin,
{
    match next(body).await {
        Some(Err(err)) => err,
        Some(Ok(frame)) => panic!("expected an error, got {frame:?}"),
        None => panic!("expected an error, the body ended"),
    }
}

fn upstream_reset() -> BoxError {
    Box::new(io::Error::new(
        io::ErrorKind::ConnectionReset,
        "upstream reset",
    ))
}

fn assert_upstream_reset(err: &BoxError) {
    let err = err
        .downcast_ref::<io::Error>()
        .unwrap_or_else(|| panic!("not the inner body's error: {err:?}"));
    assert_eq!(err.kind(), io::ErrorKind::ConnectionReset);
    assert_eq!(err.to_string(), "upstream reset");
}

// --- the inner body fails -------------------------------------------------------------------

#[tokio::test]
async fn inner_error_mid_frame_yields_the_held_kept_frame_then_the_error() {
    let mut body = filtered(frames_body(vec![
        data("data: 1\n\ndata: par"),
        Err(upstream_reset()),
    ]))
    .await;

    assert_eq!(next_data(&mut body).await, "data: 1\n\n");
    // The open frame is judged as it stands: not an annotation, so it is yielded, unterminated.
    assert_eq!(next_data(&mut body).await, "data: par");
    assert_upstream_reset(&next_error(&mut body).await);
}

#[tokio::test]
async fn inner_error_mid_frame_drops_a_held_marker_frame_then_passes_the_error() {
    let mut body = filtered(frames_body(vec![
        data("data: 1\n\nevent: x-bypass"),
        data("-remote-prefill\n: tr"),
        Err(upstream_reset()),
    ]))
    .await;

    assert_eq!(next_data(&mut body).await, "data: 1\n\n");
    // The partial marker frame is removed: the next thing the client sees is the error.
    assert_upstream_reset(&next_error(&mut body).await);
}

#[tokio::test]
async fn inner_error_in_a_passed_through_body_is_the_inner_error() {
    let mut body = Some(frames_body(vec![
        data(r#"{"partial":"#),
        Err(upstream_reset()),
    ]));
    let svc = ServiceBuilder::new()
        .layer(BypassMarkerLayer::new())
        .service_fn(move |_req: Request<()>| {
            let res = Response::builder()
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(body.take().unwrap())
                .unwrap();
            ready(Ok::<_, Infallible>(res))
        });
    let mut body = svc.oneshot(Request::new(())).await.unwrap().into_body();
    assert!(!body.is_filtering());
    assert_eq!(next_data(&mut body).await, r#"{"partial":"#);
    assert_upstream_reset(&next_error(&mut body).await);
}

// --- trailers -------------------------------------------------------------------------------

fn trailers() -> HeaderMap {
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    trailers.insert("x-usage", HeaderValue::from_static("prompt=3,completion=9"));
    trailers
}

#[tokio::test]
async fn trailers_after_a_held_partial_frame_come_after_the_frame() {
    let mut body = filtered(frames_body(vec![
        data("data: 1\n\ndata: 2"),
        Ok(Frame::trailers(trailers())),
    ]))
    .await;

    assert_eq!(next_data(&mut body).await, "data: 1\n\n");
    assert_eq!(next_data(&mut body).await, "data: 2");
    let frame = next(&mut body).await.unwrap().unwrap();
    assert_eq!(frame.into_trailers().unwrap(), trailers());
    assert!(next(&mut body).await.is_none());
    assert!(body.is_end_stream());
}

#[tokio::test]
async fn trailers_after_a_held_marker_frame_come_without_the_frame() {
    let mut body = filtered(frames_body(vec![
        data("data: 1\n\nevent: x-bypass-remote-prefill\n: true"),
        Ok(Frame::trailers(trailers())),
    ]))
    .await;

    assert_eq!(next_data(&mut body).await, "data: 1\n\n");
    let frame = next(&mut body).await.unwrap().unwrap();
    assert_eq!(frame.into_trailers().unwrap(), trailers());
    assert!(next(&mut body).await.is_none());
}

// --- the inner service fails ----------------------------------------------------------------

#[derive(Debug, PartialEq, Eq)]
struct Refused(&'static str);

#[tokio::test]
async fn inner_service_error_passes_through() {
    let svc = ServiceBuilder::new()
        .layer(BypassMarkerLayer::new())
        .service_fn(|_req: Request<()>| {
            ready(Err::<Response<FramesBody>, _>(Refused("no capacity")))
        });
    let err = svc.oneshot(Request::new(())).await.unwrap_err();
    assert_eq!(err, Refused("no capacity"));
}

#[tokio::test]
async fn response_future_failure_after_pending_passes_through() {
    let polled = Arc::new(AtomicUsize::new(0));
    let counter = polled.clone();
    let svc = ServiceBuilder::new()
        .layer(BypassMarkerLayer::new())
        .service_fn(move |_req: Request<()>| {
            let counter = counter.clone();
            async move {
                counter.fetch_add(1, Ordering::SeqCst);
                // Pending once, then the failure.
                tokio::task::yield_now().await;
                counter.fetch_add(1, Ordering::SeqCst);
                Err::<Response<FramesBody>, _>(Refused("worker lost"))
            }
        });
    let err = svc.oneshot(Request::new(())).await.unwrap_err();
    assert_eq!(err, Refused("worker lost"));
    assert_eq!(polled.load(Ordering::SeqCst), 2);
}

// --- readiness ------------------------------------------------------------------------------

/// A service that is not ready until the test opens its gate, and wakes the task that polled it
/// when it is opened; or fails its readiness check when told to.
#[derive(Clone, Default)]
struct Gate {
    open: Arc<AtomicBool>,
    broken: Arc<AtomicBool>,
    waiting: Arc<Mutex<Option<Waker>>>,
    polls: Arc<AtomicUsize>,
}

impl Gate {
    fn open(&self) {
        self.open.store(true, Ordering::SeqCst);
        if let Some(waker) = self.waiting.lock().unwrap().take() {
            waker.wake();
        }
    }
}

impl Service<Request<()>> for Gate {
    type Response = Response<FramesBody>;
    type Error = Refused;
    type Future = Ready<Result<Self::Response, Refused>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Refused>> {
        self.polls.fetch_add(1, Ordering::SeqCst);
        if self.broken.load(Ordering::SeqCst) {
            return Poll::Ready(Err(Refused("overloaded")));
        }
        if self.open.load(Ordering::SeqCst) {
            return Poll::Ready(Ok(()));
        }
        *self.waiting.lock().unwrap() = Some(cx.waker().clone());
        Poll::Pending
    }

    fn call(&mut self, _req: Request<()>) -> Self::Future {
        assert!(
            self.open.load(Ordering::SeqCst),
            "called before it was ready"
        );
        let body = frames_body(vec![data(MARKER), data("data: ok\n\n")]);
        ready(Ok(event_stream(body)))
    }
}

#[tokio::test]
async fn readiness_of_the_inner_service_is_forwarded_with_its_waker() {
    let gate = Gate::default();
    let mut svc = ServiceBuilder::new()
        .layer(BypassMarkerLayer::new())
        .service(gate.clone());

    // Not ready: the layer says so too, and the inner service saw the poll.
    assert!(svc.ready().now_or_never().is_none());
    assert_eq!(gate.polls.load(Ordering::SeqCst), 1);

    // The gate opens later, from another task; the waiting task must be woken through the layer.
    let opener = gate.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(20)).await;
        opener.open();
    });
    let ready = tokio::time::timeout(PATIENCE, svc.ready())
        .await
        .expect("the layer lost the inner service's wake-up")
        .unwrap();
    let res = ready.call(Request::new(())).await.unwrap();
    let (bytes, _) = read_all(res.into_body()).await;
    assert_eq!(bytes, "data: ok\n\n");
}

#[tokio::test]
async fn readiness_error_of_the_inner_service_passes_through() {
    let gate = Gate::default();
    gate.broken.store(true, Ordering::SeqCst);
    let mut svc = BypassMarkerLayer::new().layer(gate);
    let err = svc.ready().await.err().unwrap();
    assert_eq!(err, Refused("overloaded"));
}

// --- the client goes away -------------------------------------------------------------------

#[tokio::test]
async fn dropping_the_body_while_a_frame_is_held_drops_the_inner_body() {
    let (tx, inner) = fed_body(8);
    let (inner, dropped) = DropFlag::new(inner);
    let mut body = filtered(inner).await;

    tx.send(data("data: 1\n\nevent: x-bypass-remote-prefill\n"))
        .await
        .unwrap();
    assert_eq!(next_data(&mut body).await, "data: 1\n\n");
    // The marker frame is open and held: nothing to yield until the inner body says more.
    assert!(body.frame().now_or_never().is_none());
    assert!(!dropped.load(Ordering::SeqCst));

    drop(body);
    assert!(
        dropped.load(Ordering::SeqCst),
        "the inner body outlived the response body"
    );
    assert!(tx.is_closed(), "the upstream still has a reader");
}

#[tokio::test]
async fn dropping_the_response_future_before_the_head_drops_the_inner_future() {
    let (started_tx, started_rx) = tokio::sync::oneshot::channel::<()>();
    let (dropped_tx, dropped_rx) = tokio::sync::oneshot::channel::<()>();
    let mut started_tx = Some(started_tx);
    let mut dropped_tx = Some(dropped_tx);
    let svc = BypassMarkerLayer::new().layer(service_fn(move |_req: Request<()>| {
        let started = started_tx.take().unwrap();
        let guard = DropGuard(dropped_tx.take());
        async move {
            let _guard = guard;
            let _ = started.send(());
            std::future::pending::<Result<Response<FramesBody>, Infallible>>().await
        }
    }));
    let call = tokio::spawn(svc.oneshot(Request::new(())));
    started_rx.await.unwrap();
    call.abort();
    tokio::time::timeout(PATIENCE, dropped_rx)
        .await
        .expect("the inner response future was not dropped")
        .unwrap_err();
    assert!(call.await.unwrap_err().is_cancelled());
}

/// Closes its channel when dropped.
struct DropGuard(Option<tokio::sync::oneshot::Sender<()>>);

impl Drop for DropGuard {
    fn drop(&mut self) {
        // Dropping the sender without sending: the receiver sees the channel close.
        self.0.take();
    }
}

#[tokio::test]
async fn a_frame_that_never_ends_holds_the_response_open_without_yielding_it() {
    // The inner body stays open after a partial marker frame: the client gets the frames before
    // it and then waits; nothing of the held frame leaks, and the body is not at its end.
    let (tx, inner) = fed_body(8);
    tx.send(data("data: 1\n\nevent: x-bypass-remote-prefill\n"))
        .await
        .unwrap();
    let mut body = filtered(inner).await;
    assert_eq!(next_data(&mut body).await, "data: 1\n\n");
    assert!(
        tokio::time::timeout(Duration::from_millis(50), body.frame())
            .await
            .is_err(),
        "the body yielded or ended while the frame was open"
    );
    assert!(!body.is_end_stream());

    // When the frame closes, it is removed and the stream goes on.
    tx.send(data(": true\n\ndata: 2\n\n")).await.unwrap();
    drop(tx);
    assert_eq!(next_data(&mut body).await, "data: 2\n\n");
    assert!(next(&mut body).await.is_none());
}
