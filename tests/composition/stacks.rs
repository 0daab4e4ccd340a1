// The stacks of tests/composition.rs, written once: that file compiles this module once per
// tower-http version, each time with `tower_http` naming that version (so no inner attributes or
// `//!` docs here: the second copy comes in through `include!`).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::error_handling::HandleErrorLayer;
use axum::extract::State;
use axum::response::sse::{Event, Sse};
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use futures_util::stream::{self, Stream};
use http::{header, HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body_util::Full;
use test_support::serve::decoded;
use test_support::serve::*;
use tokio::sync::Notify;
use tower::util::BoxCloneSyncService;
use tower::{service_fn, BoxError, ServiceBuilder};
use tower_bypass_marker::{BypassMarkerBody, BypassMarkerLayer, BYPASS_REMOTE_PREFILL};
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::compression::predicate::{NotForContentType, Predicate, SizeAbove};
use tower_http::compression::CompressionLayer;
use tower_http::cors::CorsLayer;
use tower_http::decompression::RequestDecompressionLayer;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::timeout::TimeoutLayer;
use tower_http::trace::TraceLayer;
use tower_http::validate_request::{AcceptHeader, ValidateRequestHeaderLayer};

/// The data frames after the marker.
const CHUNKS: [&str; 2] = [r#"{"id":"c1","choices":[]}"#, "[DONE]"];

/// What a client that did not opt in must receive.
fn filtered() -> String {
    CHUNKS.iter().map(|c| format!("data: {c}\n\n")).collect()
}

fn events() -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let marker = Event::default()
        .event(BYPASS_REMOTE_PREFILL)
        .comment("true");
    let chunks = CHUNKS.map(|c| Event::default().data(c));
    Sse::new(stream::iter(std::iter::once(marker).chain(chunks).map(Ok)))
}

/// Raised by `/slow` when its request has reached the handler.
#[derive(Clone, Default)]
struct Entered(Arc<Notify>);

/// The endpoints every stack serves: an event stream with the marker, a handler slower than every
/// timeout here, a handler that panics, and an upload that answers with the bytes it read.
fn routes() -> Router {
    routes_with(Entered::default())
}

fn routes_with(entered: Entered) -> Router {
    Router::new()
        .route("/v1/events", get(|| async { events() }))
        .route(
            "/slow",
            get(|State(entered): State<Entered>| async move {
                entered.0.notify_one();
                tokio::time::sleep(Duration::from_secs(30)).await;
                "too late"
            }),
        )
        .route(
            "/panic",
            get(|| async {
                if true {
                    panic!("the handler panicked");
                }
                ""
            }),
        )
        .route("/v1/upload", post(|body: Bytes| async move { body }))
        .with_state(entered)
}

/// Sends `req` on a fresh HTTP/1.1 client: status, headers, whole body.
async fn send(req: Request<Full<Bytes>>) -> (StatusCode, http::HeaderMap, Bytes) {
    let res = tokio::time::timeout(PATIENCE, h1_client().request(req))
        .await
        .expect("no response in time")
        .unwrap();
    let (parts, body) = res.into_parts();
    (parts.status, parts.headers, read_all(body).await.0)
}

fn get_req(addr: std::net::SocketAddr, path: &str) -> Request<Full<Bytes>> {
    Request::get(format!("http://{addr}{path}"))
        .body(Full::default())
        .unwrap()
}

/// tower-http's default predicate, less its exception for event streams.
fn events_too() -> impl Predicate {
    SizeAbove::default()
        .and(NotForContentType::GRPC)
        .and(NotForContentType::IMAGES)
}

#[tokio::test]
async fn router_layer_service_builder_request_id_trace_cors_catch_panic_timeout_around_the_layer() {
    let x_request_id = HeaderName::from_static("x-request-id");
    let stack = ServiceBuilder::new()
        .layer(SetRequestIdLayer::new(
            x_request_id.clone(),
            MakeRequestUuid,
        ))
        .layer(TraceLayer::new_for_http())
        .layer(CorsLayer::permissive())
        .layer(PropagateRequestIdLayer::new(x_request_id))
        .layer(CatchPanicLayer::new())
        // Answers 408 with `ResBody::default()`: a `BypassMarkerBody<axum::body::Body>`.
        .layer(TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            Duration::from_millis(300),
        ))
        .layer(BypassMarkerLayer::new());
    let addr = spawn_axum(routes().layer(stack)).await;

    let mut req = get_req(addr, "/v1/events");
    req.headers_mut()
        .insert(header::ORIGIN, HeaderValue::from_static("https://app.test"));
    let (status, headers, body) = send(req).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, filtered(), "the marker is removed inside the stack");
    assert_eq!(
        headers["access-control-allow-origin"], "*",
        "CORS still applies"
    );
    assert_eq!(
        headers["x-request-id"].len(),
        36,
        "a UUID request id is propagated"
    );

    let (status, _, body) = send(get_req(addr, "/slow")).await;
    assert_eq!(
        status,
        StatusCode::REQUEST_TIMEOUT,
        "tower-http's timeout answers"
    );
    assert!(body.is_empty(), "with the default body");

    let (status, headers, _) = send(get_req(addr, "/panic")).await;
    assert_eq!(
        status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "the panic is caught"
    );
    assert!(headers.contains_key("x-request-id"));
}

#[tokio::test]
async fn route_layer_service_builder_validate_request_header_and_request_body_limit() {
    let stack = ServiceBuilder::new()
        .layer(RequestBodyLimitLayer::new(16))
        // Answers 406 with `ResBody::default()` to a client that does not accept event streams.
        .layer(ValidateRequestHeaderLayer::<
            AcceptHeader<BypassMarkerBody<axum::body::Body>>,
        >::accept("text/event-stream"))
        .layer(BypassMarkerLayer::new());
    let addr = spawn_axum(routes().route_layer(stack)).await;

    let mut req = get_req(addr, "/v1/events");
    req.headers_mut().insert(
        header::ACCEPT,
        HeaderValue::from_static("text/event-stream"),
    );
    let (status, _, body) = send(req).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, filtered());

    let mut req = get_req(addr, "/v1/events");
    req.headers_mut()
        .insert(header::ACCEPT, HeaderValue::from_static("application/json"));
    let (status, _, body) = send(req).await;
    assert_eq!(status, StatusCode::NOT_ACCEPTABLE);
    assert!(body.is_empty());

    let mut req = Request::post(format!("http://{addr}/v1/upload"))
        .header(header::ACCEPT, "text/event-stream")
        .body(Full::new(Bytes::from(vec![b'x'; 64])))
        .unwrap();
    req.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    let (status, _, _) = send(req).await;
    assert_eq!(
        status,
        StatusCode::PAYLOAD_TOO_LARGE,
        "the body limit applies"
    );
}

#[tokio::test]
async fn service_builder_compression_and_request_decompression_around_the_layer() {
    let stack = ServiceBuilder::new()
        .layer(RequestDecompressionLayer::new())
        .layer(CompressionLayer::new().compress_when(events_too()))
        .layer(BypassMarkerLayer::new());
    let addr = spawn_axum(routes().layer(stack)).await;

    for coding in ["gzip", "br", "zstd", "deflate"] {
        let mut req = get_req(addr, "/v1/events");
        req.headers_mut()
            .insert(header::ACCEPT_ENCODING, HeaderValue::from_static(coding));
        let res = h1_client().request(req).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(res.headers()[header::CONTENT_ENCODING], coding);
        assert_eq!(decoded(res).await, filtered(), "{coding}");
    }

    // A gzip request body reaches the handler decompressed.
    let gz = {
        use std::io::Write;
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        enc.write_all(b"hello upload").unwrap();
        enc.finish().unwrap()
    };
    let req = Request::post(format!("http://{addr}/v1/upload"))
        .header(header::CONTENT_ENCODING, "gzip")
        .body(Full::new(Bytes::from(gz)))
        .unwrap();
    let (status, _, body) = send(req).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, "hello upload");
}

#[tokio::test]
async fn tower_handle_error_load_shed_concurrency_limit_buffer_timeout_around_the_layer() {
    let entered = Entered::default();
    let svc = ServiceBuilder::new()
        .layer(HandleErrorLayer::new(|err: BoxError| async move {
            if err.is::<tower::timeout::error::Elapsed>() {
                StatusCode::REQUEST_TIMEOUT
            } else if err.is::<tower::load_shed::error::Overloaded>() {
                StatusCode::SERVICE_UNAVAILABLE
            } else {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }))
        .load_shed()
        .concurrency_limit(1)
        .buffer(8)
        .timeout(Duration::from_millis(500))
        .layer(BypassMarkerLayer::new())
        .service(routes_with(entered.clone()));
    let addr = spawn_auto(svc, 10).await;

    let (status, _, body) = send(get_req(addr, "/v1/events")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, filtered());

    // While a slow request holds the only permit, the next one is shed.
    let slow = tokio::spawn(send(get_req(addr, "/slow")));
    tokio::time::timeout(PATIENCE, entered.0.notified())
        .await
        .expect("the slow request never reached its handler");
    let (status, _, _) = send(get_req(addr, "/v1/events")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "load shed");
    let (status, _, _) = slow.await.unwrap();
    assert_eq!(status, StatusCode::REQUEST_TIMEOUT, "tower's timeout");

    let (status, _, body) = send(get_req(addr, "/v1/events")).await;
    assert_eq!(status, StatusCode::OK, "the permit is back");
    assert_eq!(body, filtered());
}

/// A bare tower service (no axum) that streams the marker, then data.
async fn bare_upstream(
    _req: Request<hyper::body::Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let body = format!("{MARKER}{}", filtered());
    Ok(event_stream(Full::new(Bytes::from(body))))
}

#[tokio::test]
async fn bare_hyper_util_server_with_service_builder_cors_timeout_around_the_layer() {
    let svc = ServiceBuilder::new()
        .layer(CorsLayer::permissive())
        .layer(TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            Duration::from_secs(5),
        ))
        .layer(BypassMarkerLayer::new())
        .service(service_fn(bare_upstream));
    let addr = spawn_auto(svc, 10).await;

    let mut req = get_req(addr, "/");
    req.headers_mut()
        .insert(header::ORIGIN, HeaderValue::from_static("https://app.test"));
    let (status, headers, body) = send(req).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["access-control-allow-origin"], "*");
    assert_eq!(body, filtered());
}

#[tokio::test]
async fn box_clone_sync_service_of_the_layered_router_on_hyper_util() {
    let svc: BoxCloneSyncService<
        Request<hyper::body::Incoming>,
        Response<BypassMarkerBody<axum::body::Body>>,
        Infallible,
    > = BoxCloneSyncService::new(
        ServiceBuilder::new()
            .layer(BypassMarkerLayer::new())
            .service(routes()),
    );
    let addr = spawn_auto(svc, 10).await;
    let (status, _, body) = send(get_req(addr, "/v1/events")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, filtered());
}

#[tokio::test]
async fn tonic_server_with_service_builder_trace_timeout_around_the_layer_passes_grpc_untouched() {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::ServingStatus;

    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("inference", ServingStatus::Serving)
        .await;
    let (listener, addr) = listener().await;
    tokio::spawn(
        tonic::transport::Server::builder()
            .layer(
                ServiceBuilder::new()
                    .layer(TraceLayer::new_for_grpc())
                    .layer(TimeoutLayer::with_status_code(
                        StatusCode::REQUEST_TIMEOUT,
                        Duration::from_secs(5),
                    ))
                    .layer(BypassMarkerLayer::new()),
            )
            .add_service(health)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );

    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = HealthClient::new(channel);
    let res = client
        .check(HealthCheckRequest {
            service: "inference".to_owned(),
        })
        .await
        .unwrap();
    assert_eq!(res.into_inner().status, ServingStatus::Serving as i32);
    let mut stream = client
        .watch(HealthCheckRequest {
            service: "inference".to_owned(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = tokio::time::timeout(PATIENCE, stream.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(first.status, ServingStatus::Serving as i32);
    let err = client
        .check(HealthCheckRequest {
            service: "unknown".to_owned(),
        })
        .await
        .unwrap_err();
    assert_eq!(
        err.code(),
        tonic::Code::NotFound,
        "a trailers-only error passes"
    );
}

#[cfg(feature = "json")]
#[tokio::test]
async fn router_layer_service_builder_cors_timeout_around_the_json_guard_and_the_layer() {
    let bypass = BypassMarkerLayer::new();
    let stack = ServiceBuilder::new()
        .layer(CorsLayer::permissive())
        // Answers 408 with `ResBody::default()`: a `json::ResponseBody<BypassMarkerBody<_>>`.
        .layer(TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            Duration::from_millis(300),
        ))
        .layer(bypass.json_guard())
        .layer(bypass);
    let addr = spawn_axum(routes().layer(stack)).await;

    let (status, _, body) = send(get_req(addr, "/v1/events")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, filtered());
    let (status, _, body) = send(get_req(addr, "/slow")).await;
    assert_eq!(status, StatusCode::REQUEST_TIMEOUT);
    assert!(body.is_empty());
    // The guard still answers for itself.
    let req = Request::post(format!("http://{addr}/v1/upload"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from_static(b"{")))
        .unwrap();
    let (status, _, body) = send(req).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(std::str::from_utf8(&body).unwrap().contains("invalid_json"));
}

#[tokio::test]
async fn router_layer_opt_in_from_the_request_head_without_the_json_guard() {
    // The application trusts `x-internal` (set by its own auth layer, here by the test).
    let layer = BypassMarkerLayer::new().opt_in_from(|parts: &http::request::Parts| {
        if parts.headers.contains_key("x-internal") {
            [BYPASS_REMOTE_PREFILL].into_iter().collect()
        } else {
            tower_bypass_marker::RequestedAnnotations::new()
        }
    });
    let addr = spawn_axum(routes().layer(layer)).await;

    let mut req = get_req(addr, "/v1/events");
    req.headers_mut()
        .insert("x-internal", HeaderValue::from_static("1"));
    let (status, _, body) = send(req).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        body,
        format!("{MARKER}{}", filtered()),
        "granted: the marker first"
    );

    let (_, _, body) = send(get_req(addr, "/v1/events")).await;
    assert_eq!(body, filtered(), "not granted");
}

#[cfg(feature = "json")]
#[tokio::test]
async fn error_body_shapes_the_guards_refusals_in_a_router_layer_stack() {
    let bypass = BypassMarkerLayer::new().error_body(|e: &tower_bypass_marker::ErrorParts<'_>| {
        let body = format!("{} {} {}", e.status.as_u16(), e.kind, e.code);
        (HeaderValue::from_static("text/plain"), Bytes::from(body))
    });
    let addr = spawn_axum(
        routes()
            .layer(bypass.json_guard())
            .layer(CorsLayer::permissive()),
    )
    .await;
    let req = Request::post(format!("http://{addr}/v1/upload"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from_static(b"{")))
        .unwrap();
    let (status, headers, body) = send(req).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(headers[header::CONTENT_TYPE], "text/plain");
    assert_eq!(
        headers[header::CONTENT_LENGTH],
        body.len().to_string().as_str()
    );
    assert_eq!(body, "400 invalid_request_error invalid_json");
}

/// A body that is the crate's passthrough over the inner body's default: empty, ended.
#[test]
fn default_bodies_are_the_inner_default_passed_through() {
    use http_body::Body;
    let body = BypassMarkerBody::<Full<Bytes>>::default();
    assert!(!body.is_filtering());
    assert!(body.is_end_stream());
    assert_eq!(body.size_hint().exact(), Some(0));
}
