//! Where the layer goes relative to tower-http's `CompressionLayer`: inside it. The layer reads
//! the body it is given; a gzip body is opaque to it and passes through untouched, marker and all.
//!
//! tower-http's default predicate does not compress `text/event-stream` at all, so the order only
//! matters once an application compresses event streams; these tests use such a predicate, and pin
//! the default too.

mod common;

use std::convert::Infallible;
use std::io::Read;

use axum::extract::Request as AxumRequest;
use axum::middleware::{self, Next};
use axum::response::sse::{Event, Sse};
use axum::response::Response as AxumResponse;
use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use common::*;
use futures_util::stream::{self, Stream};
use http::{header, HeaderValue, Request};
use http_body_util::Full;
use tower::ServiceBuilder;
use tower_bypass_marker::{BypassMarkerLayer, RequestedAnnotations, BYPASS_REMOTE_PREFILL};
use tower_http::compression::predicate::{NotForContentType, Predicate, SizeAbove};
use tower_http::compression::CompressionLayer;

const CHUNKS: [&str; 3] = [
    r#"{"choices":[{"delta":{"content":"Hello"}}]}"#,
    r#"{"choices":[{"delta":{"content":" world"}}]}"#,
    "[DONE]",
];

fn filtered() -> String {
    CHUNKS.iter().map(|c| format!("data: {c}\n\n")).collect()
}

fn unfiltered() -> String {
    format!("{MARKER}{}", filtered())
}

fn events() -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let marker = Event::default()
        .event(BYPASS_REMOTE_PREFILL)
        .comment("true");
    let chunks = CHUNKS.map(|c| Event::default().data(c));
    Sse::new(stream::iter(
        std::iter::once(marker)
            .chain(chunks)
            .map(Ok::<_, Infallible>),
    ))
}

/// Grants the opt-in to requests that carry `x-opt-in`, outside every other layer.
async fn opt_in(mut req: AxumRequest, next: Next) -> AxumResponse {
    if req.headers().contains_key("x-opt-in") {
        let granted: RequestedAnnotations = [BYPASS_REMOTE_PREFILL].into_iter().collect();
        req.extensions_mut().insert(granted);
    }
    next.run(req).await
}

/// tower-http's default predicate without its exception for event streams.
fn compresses_event_streams() -> impl Predicate {
    SizeAbove::new(32)
        .and(NotForContentType::GRPC)
        .and(NotForContentType::IMAGES)
}

fn routes() -> Router {
    Router::new().route("/v1/events", get(|| async { events() }))
}

/// The event stream gzip-encoded with stored (uncompressed) blocks: the marker frame's bytes
/// appear literally inside the encoded body.
fn stored_gzip() -> Vec<u8> {
    use std::io::Write;
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::none());
    encoder
        .write_all(format!(": stream start\n\n{}", unfiltered()).as_bytes())
        .unwrap();
    encoder.finish().unwrap()
}

/// What a client gets: whether the body was gzip-encoded, and the body decoded.
async fn fetch(addr: std::net::SocketAddr, gzip: bool, opt_in: bool) -> (bool, String) {
    let mut req = Request::get(format!("http://{addr}/v1/events"));
    if gzip {
        req = req.header(header::ACCEPT_ENCODING, "gzip");
    }
    if opt_in {
        req = req.header("x-opt-in", "1");
    }
    let res = h1_client()
        .request(req.body(Full::<Bytes>::default()).unwrap())
        .await
        .unwrap();
    let encoding = res.headers().get(header::CONTENT_ENCODING).cloned();
    let (body, _) = read_all(res.into_body()).await;
    match encoding {
        None => (false, String::from_utf8(body.to_vec()).unwrap()),
        Some(v) if v == HeaderValue::from_static("gzip") => {
            let mut text = String::new();
            flate2::read::GzDecoder::new(&body[..])
                .read_to_string(&mut text)
                .unwrap();
            (true, text)
        }
        Some(other) => panic!("unexpected content-encoding {other:?}"),
    }
}

#[tokio::test]
async fn inside_compression_the_gzip_body_decompresses_to_the_filtered_stream() {
    let app = routes()
        .layer(
            ServiceBuilder::new()
                .layer(CompressionLayer::new().compress_when(compresses_event_streams()))
                .layer(BypassMarkerLayer::new()),
        )
        .layer(middleware::from_fn(opt_in));
    let addr = spawn_axum(app).await;

    assert_eq!(fetch(addr, true, false).await, (true, filtered()));
    assert_eq!(fetch(addr, true, true).await, (true, unfiltered()));
    assert_eq!(fetch(addr, false, false).await, (false, filtered()));
}

#[tokio::test]
async fn outside_compression_the_gzip_body_passes_through_unfiltered() {
    // The wrong order: the layer sees `content-encoding: gzip` and leaves the body alone, so the
    // marker reaches a client that did not opt in, once it decompresses the body.
    let app = routes()
        .layer(
            ServiceBuilder::new()
                .layer(BypassMarkerLayer::new())
                .layer(CompressionLayer::new().compress_when(compresses_event_streams())),
        )
        .layer(middleware::from_fn(opt_in));
    let addr = spawn_axum(app).await;

    assert_eq!(fetch(addr, true, false).await, (true, unfiltered()));
    // A client that does not accept gzip gets an identity body, which the layer does filter.
    assert_eq!(fetch(addr, false, false).await, (false, filtered()));
}

#[tokio::test]
async fn default_compression_predicate_leaves_event_streams_uncompressed_and_filtered() {
    // tower-http does not compress event streams by default, so with the default predicate both
    // orders filter; the order above matters once event streams are compressed.
    for inside in [true, false] {
        let app = if inside {
            routes().layer(
                ServiceBuilder::new()
                    .layer(CompressionLayer::new())
                    .layer(BypassMarkerLayer::new()),
            )
        } else {
            routes().layer(
                ServiceBuilder::new()
                    .layer(BypassMarkerLayer::new())
                    .layer(CompressionLayer::new()),
            )
        };
        let addr = spawn_axum(app.layer(middleware::from_fn(opt_in))).await;
        assert_eq!(
            fetch(addr, true, false).await,
            (false, filtered()),
            "inside: {inside}"
        );
    }
}

#[tokio::test]
async fn an_encoded_event_stream_passes_byte_for_byte_even_with_marker_bytes_inside() {
    let gz = stored_gzip();
    assert!(
        gz.windows(MARKER.len()).any(|w| w == MARKER.as_bytes()),
        "the encoded body should hold the marker frame literally"
    );
    let app = Router::new()
        .route(
            "/v1/events",
            get(|| async {
                (
                    [
                        (header::CONTENT_TYPE, "text/event-stream"),
                        (header::CONTENT_ENCODING, "gzip"),
                    ],
                    stored_gzip(),
                )
            }),
        )
        .layer(BypassMarkerLayer::new());
    let addr = spawn_axum(app).await;

    let res = h1_client()
        .request(
            Request::get(format!("http://{addr}/v1/events"))
                .body(Full::<Bytes>::default())
                .unwrap(),
        )
        .await
        .unwrap();
    let (body, _) = read_all(res.into_body()).await;
    // Filtering the encoded bytes would have cut the marker out of the gzip stream and broken it.
    assert_eq!(body, gz);
    assert_eq!(
        fetch(addr, true, false).await,
        (true, format!(": stream start\n\n{}", unfiltered()))
    );
}
