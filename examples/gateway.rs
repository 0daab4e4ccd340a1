//! The gateway users write: an axum reverse proxy in front of any OpenAI-compatible upstream
//! (Dynamo's frontend, the simulated router), with the layer, the guard and the tower-http
//! middleware a production gateway runs. The upstream's body streams through, never buffered.
//!
//! ```text
//! cargo run --example gateway --features json -- --upstream http://127.0.0.1:8000 --listen 127.0.0.1:3000
//! ```

use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Body;
use axum::error_handling::HandleErrorLayer;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::Response;
use axum::{BoxError, Router};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use tower::ServiceBuilder;
use tower_bypass_marker::BypassMarkerLayer;
use tower_http::compression::predicate::{NotForContentType, Predicate, SizeAbove};
use tower_http::compression::CompressionLayer;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::timeout::{RequestBodyTimeoutLayer, ResponseBodyTimeoutLayer, TimeoutLayer};
use tower_http::trace::TraceLayer;

#[derive(Clone)]
struct Upstream {
    client: Client<HttpConnector, Body>,
    base: String, // scheme://authority, no trailing slash
}

/// Forwards the request to the upstream and its response back, body streaming both ways.
async fn forward(State(up): State<Upstream>, mut req: Request) -> Result<Response, StatusCode> {
    let path = req.uri().path_and_query().map_or("/", |p| p.as_str());
    *req.uri_mut() = format!("{}{path}", up.base)
        .parse()
        .map_err(|_| StatusCode::BAD_REQUEST)?;
    strip_hop_by_hop(req.headers_mut());
    req.headers_mut().remove(header::HOST); // the client sets the upstream's
    let mut res = up.client.request(req).await.map_err(|err| {
        eprintln!("gateway: upstream: {err}");
        StatusCode::BAD_GATEWAY
    })?;
    strip_hop_by_hop(res.headers_mut());
    Ok(res.map(Body::new))
}

/// The headers that belong to one connection, not to the message (RFC 9110, 7.6.1).
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    for name in [
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    ] {
        headers.remove(name);
    }
}

fn app(upstream: Upstream, max_in_flight: usize) -> Router {
    let bypass = BypassMarkerLayer::dynamo();
    // tower-http's default predicate, less its exception for `text/event-stream`.
    let events_too = SizeAbove::default()
        .and(NotForContentType::GRPC)
        .and(NotForContentType::IMAGES);
    let stack = ServiceBuilder::new() // outermost first
        .layer(CompressionLayer::new().compress_when(events_too)) // compresses what the layer kept
        .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
        .layer(TraceLayer::new_for_http()) // a span per request; 5xx and body errors logged
        .layer(PropagateRequestIdLayer::x_request_id())
        // The one error below: load shed's `Overloaded`.
        .layer(HandleErrorLayer::new(|_: BoxError| async {
            StatusCode::SERVICE_UNAVAILABLE
        }))
        .load_shed() // over the limit: 503 at once, not a queue
        // In flight until the response's head: the guard's buffered bodies and the upstream's
        // time to answer. tower returns the permit with the head, so streams are not counted: to
        // cap them, also hold a semaphore permit in the response body.
        .concurrency_limit(max_in_flight)
        // Streaming: `TimeoutLayer` bounds the time to the response's head (the guard reading the
        // body, the upstream's first byte) and ends there, so it never cuts a stream; the body
        // timeouts are idle timeouts, reset by every frame, so a slow client or a stalled upstream
        // is cut and a long generation is not. (`ResponseBodyDeadlineLayer` caps the whole body:
        // it would cut long streams.)
        .layer(RequestBodyTimeoutLayer::new(Duration::from_secs(30)))
        .layer(ResponseBodyTimeoutLayer::new(Duration::from_secs(300)))
        .layer(TimeoutLayer::with_status_code(
            StatusCode::GATEWAY_TIMEOUT,
            Duration::from_secs(60),
        ))
        // Requests: router-owned names stripped, the opt-in granted; at most 512 MiB of request
        // bodies held at once (past it a 503 with `Retry-After`), size it to the process's memory.
        .layer(bypass.json_guard().max_buffered_bytes(512 * 1024 * 1024))
        .layer(bypass); // responses: annotation frames only for clients that asked
    Router::new()
        .fallback(forward)
        .with_state(upstream)
        .layer(stack)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let (mut upstream, mut listen) = (None::<String>, SocketAddr::from(([127, 0, 0, 1], 3000)));
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match (arg.as_str(), args.next()) {
            ("--upstream", Some(url)) => upstream = Some(url.trim_end_matches('/').to_owned()),
            ("--listen", Some(addr)) => listen = addr.parse()?,
            _ => return Err("usage: gateway --upstream http://HOST:PORT [--listen ADDR]".into()),
        }
    }
    let base = upstream.ok_or("--upstream http://HOST:PORT is required")?;
    base.parse::<Uri>()?;
    tracing_subscriber::fmt::init();
    let client = Client::builder(TokioExecutor::new()).build_http();
    let listener = tokio::net::TcpListener::bind(listen).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app(Upstream { client, base }, 256)).await?;
    Ok(())
}
