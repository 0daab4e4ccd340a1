//! The layer and tower-http's `CompressionLayer`, in either order. Outside the layer (the
//! documented order), compression applies to the filtered stream. Inside it, the layer has asked
//! the services below for `accept-encoding: identity`, so the inner compression leaves the stream
//! readable and the client gets it filtered, unencoded (or compressed by a layer further out). Only
//! an upstream that compresses although asked not to still gets the 502 (`encoded_event_stream`),
//! which keeps the `vary`, CORS and request-id headers the layers inside set.
//!
//! tower-http's default predicate does not compress `text/event-stream` at all; these tests use a
//! predicate that does, and pin the default too.

use std::convert::Infallible;
use std::io::Read;

use axum::extract::Request as AxumRequest;
use axum::middleware::{self, Next};
use axum::response::sse::{Event, Sse};
use axum::response::Response as AxumResponse;
use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use futures_util::stream::{self, Stream};
use http::{header, HeaderValue, Request};
use http_body_util::Full;
#[cfg(feature = "json")]
use test_support::serve::decoded;
use test_support::serve::*;
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
    SizeAbove::default()
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

/// An upstream that gzips its event stream whatever it was asked: [`stored_gzip`], labelled.
async fn gzipped_events() -> impl axum::response::IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CONTENT_ENCODING, "gzip"),
        ],
        stored_gzip(),
    )
}

/// What a client gets: whether the body was gzip-encoded, and the body decoded.
async fn fetch(addr: std::net::SocketAddr, gzip: bool, opt_in: bool) -> (bool, String) {
    let (status, gzipped, body) = fetch_status(addr, gzip, opt_in).await;
    assert_eq!(status, http::StatusCode::OK, "{body}");
    (gzipped, body)
}

/// The status, whether the body was gzip-encoded, and the body decoded.
async fn fetch_status(
    addr: std::net::SocketAddr,
    gzip: bool,
    opt_in: bool,
) -> (http::StatusCode, bool, String) {
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
    let status = res.status();
    let encoding = res.headers().get(header::CONTENT_ENCODING).cloned();
    let (body, _) = read_all(res.into_body()).await;
    match encoding {
        None => (status, false, String::from_utf8(body.to_vec()).unwrap()),
        Some(v) if v == HeaderValue::from_static("gzip") => {
            let mut text = String::new();
            flate2::read::GzDecoder::new(&body[..])
                .read_to_string(&mut text)
                .unwrap();
            (status, true, text)
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

/// The axum stack of the crate docs and the README ("Where to put it"): `Router::layer` wraps
/// what is there already, so the compression layer, added last, is the outermost and compresses
/// the stream the bypass layer filtered.
#[cfg(feature = "json")]
fn documented_axum_stack(routes: Router) -> Router {
    let bypass = BypassMarkerLayer::dynamo();
    routes
        .layer(bypass.clone())
        .layer(bypass.json_guard())
        .layer(CompressionLayer::new().compress_when(compresses_event_streams()))
}

/// The same layers added the other way round: compression inside the filter.
#[cfg(feature = "json")]
fn reversed_axum_stack(routes: Router) -> Router {
    let bypass = BypassMarkerLayer::dynamo();
    routes
        .layer(CompressionLayer::new().compress_when(compresses_event_streams()))
        .layer(bypass.clone())
        .layer(bypass.json_guard())
}

/// A chat completion request accepting gzip, listing `annotations` in `nvext.annotations`.
#[cfg(feature = "json")]
fn chat(addr: std::net::SocketAddr, annotations: &str) -> Request<Full<Bytes>> {
    Request::post(format!("http://{addr}/v1/chat/completions"))
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::ACCEPT_ENCODING, "gzip")
        .body(Full::new(Bytes::from(format!(
            r#"{{"model":"m","stream":true,"nvext":{{"annotations":{annotations}}}}}"#
        ))))
        .unwrap()
}

#[cfg(feature = "json")]
#[tokio::test]
async fn the_documented_axum_stack_streams_gzip_compressed_filtered_events() {
    use http_body::Body as _;
    use std::io::Write;
    use std::sync::{Arc, Mutex};
    use tokio::sync::mpsc;

    // Each request's events come from a channel the test feeds, so that the test can see an event
    // reach the client while the stream is still open.
    type Events = mpsc::Receiver<Result<Event, Infallible>>;
    let next: Arc<Mutex<Option<Events>>> = Arc::default();
    let handler_next = next.clone();
    let routes = Router::new().route(
        "/v1/chat/completions",
        axum::routing::post(move || {
            let events = handler_next
                .lock()
                .unwrap()
                .take()
                .expect("one stream per request");
            async move { Sse::new(tokio_stream::wrappers::ReceiverStream::new(events)) }
        }),
    );
    let addr = spawn_axum(documented_axum_stack(routes)).await;

    for (annotations, first) in [
        ("[]", format!("data: {}\n\n", CHUNKS[0])),
        (
            r#"["x-bypass-remote-prefill"]"#,
            format!("{MARKER}data: {}\n\n", CHUNKS[0]),
        ),
    ] {
        let (tx, rx) = mpsc::channel(8);
        *next.lock().unwrap() = Some(rx);
        let marker = Event::default()
            .event(BYPASS_REMOTE_PREFILL)
            .comment("true");
        // Dynamo's preset never forwards `llm_metrics`, even to a client that asks.
        let metrics = Event::default().event("llm_metrics").comment("{}");
        for event in [marker, metrics, Event::default().data(CHUNKS[0])] {
            tx.send(Ok(event)).await.unwrap();
        }

        let res = h1_client().request(chat(addr, annotations)).await.unwrap();
        assert_eq!(res.status(), http::StatusCode::OK);
        assert_eq!(res.headers()[header::CONTENT_ENCODING], "gzip");
        let mut body = std::pin::pin!(res.into_body());
        let mut decoded = flate2::write::GzDecoder::new(Vec::new());
        let mut next_data = async || {
            let frame = tokio::time::timeout(
                PATIENCE,
                std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)),
            )
            .await
            .expect("an event in time");
            frame.map(|f| f.unwrap().into_data().unwrap())
        };
        // The first event, compressed, while the stream is still open.
        while decoded.get_ref().len() < first.len() {
            let data = next_data().await.expect("the stream is open");
            decoded.write_all(&data).unwrap();
            decoded.flush().unwrap(); // into `get_ref()`: the decoder holds its output until then
        }
        assert_eq!(String::from_utf8_lossy(decoded.get_ref()), first);

        for chunk in &CHUNKS[1..] {
            tx.send(Ok(Event::default().data(*chunk))).await.unwrap();
        }
        drop(tx);
        while let Some(data) = next_data().await {
            decoded.write_all(&data).unwrap();
        }
        let decoded = decoded.finish().unwrap();
        let expected = if annotations == "[]" {
            filtered()
        } else {
            unfiltered()
        };
        assert_eq!(
            String::from_utf8(decoded).unwrap(),
            expected,
            "{annotations}"
        );
    }
}

/// What the OpenAI and Anthropic SDKs' HTTP clients (httpx, undici, reqwest) send by default.
const SDK_ACCEPT_ENCODING: &str = "gzip, deflate, br, zstd";

#[cfg(feature = "json")]
#[tokio::test]
async fn both_layer_orders_give_every_encoding_and_the_sdk_header_a_filtered_stream() {
    let routes = || {
        Router::new().route(
            "/v1/chat/completions",
            axum::routing::post(|| async { events() }),
        )
    };
    let documented = spawn_axum(documented_axum_stack(routes())).await;
    let reversed = spawn_axum(reversed_axum_stack(routes())).await;
    // Compression on both sides: the outer one compresses what the layer kept.
    let both = spawn_axum(
        reversed_axum_stack(routes())
            .layer(CompressionLayer::new().compress_when(compresses_event_streams())),
    )
    .await;
    for accept in ["gzip", "br", "zstd", "deflate", SDK_ACCEPT_ENCODING] {
        for (stack, addr, compressed) in [
            ("documented", documented, true),
            ("reversed", reversed, false),
            ("both", both, true),
        ] {
            for (annotations, expected) in [
                ("[]", filtered()),
                (r#"["x-bypass-remote-prefill"]"#, unfiltered()),
            ] {
                let mut req = chat(addr, annotations);
                req.headers_mut()
                    .insert(header::ACCEPT_ENCODING, HeaderValue::from_static(accept));
                let res = h1_client().request(req).await.unwrap();
                assert_eq!(res.status(), http::StatusCode::OK, "{stack} {accept}");
                let coding = res.headers().get(header::CONTENT_ENCODING).cloned();
                // Dynamo's preset never forwards `llm_metrics`: something is removed for every
                // client, so the inner compression is given up for the opted-in one too.
                if compressed {
                    let coding = coding.expect("compressed by the outer layer");
                    assert!(
                        accept.contains(coding.to_str().unwrap()),
                        "{stack} {accept}"
                    );
                } else {
                    assert_eq!(
                        coding, None,
                        "{stack} {accept}: compression inside is given up"
                    );
                }
                assert_eq!(
                    decoded(res).await,
                    expected,
                    "{stack} {accept} {annotations}"
                );
            }
        }
    }
}

/// The error a client gets instead of an encoded event stream it would have had filtered.
fn assert_encoded_refusal((status, gzipped, body): (http::StatusCode, bool, String)) {
    assert_eq!(status, http::StatusCode::BAD_GATEWAY, "{body}");
    assert!(!gzipped);
    let error: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(error["error"]["code"], "encoded_event_stream", "{body}");
    assert_eq!(error["error"]["type"], "server_error", "{body}");
    assert!(error["error"]["param"].is_null(), "{body}");
    assert_eq!(error["error"]["message"], refusal_message("gzip"), "{body}");
}

/// The refusal's message, which names both causes: the upstream, and the application's own
/// layer order.
fn refusal_message(coding: &str) -> String {
    format!(
        "the event stream has content-encoding {coding}, which cannot be filtered: either the \
         upstream compressed it (it must answer with content-encoding identity) or compression is \
         applied before the filter (the compression layer must be outside it)"
    )
}

#[tokio::test]
async fn with_compression_inside_the_layer_a_gzip_client_gets_the_stream_filtered_unencoded() {
    // The other order: the layer asks the compression inside it for identity, so the stream it
    // sees is readable. (This client used to get a 502 `encoded_event_stream`.)
    let app = routes()
        .layer(
            ServiceBuilder::new()
                .layer(BypassMarkerLayer::new())
                .layer(CompressionLayer::new().compress_when(compresses_event_streams())),
        )
        .layer(middleware::from_fn(opt_in));
    let addr = spawn_axum(app).await;

    assert_eq!(fetch(addr, true, false).await, (false, filtered()));
    // A client that opted in to the marker has nothing removed: its stream passes, encoded.
    assert_eq!(fetch(addr, true, true).await, (true, unfiltered()));
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
async fn an_encoded_event_stream_is_refused_or_passes_byte_for_byte_even_with_marker_bytes_inside()
{
    let gz = stored_gzip();
    assert!(
        gz.windows(MARKER.len()).any(|w| w == MARKER.as_bytes()),
        "the encoded body should hold the marker frame literally"
    );
    let app = Router::new()
        .route("/v1/events", get(gzipped_events))
        .layer(BypassMarkerLayer::new())
        .layer(middleware::from_fn(opt_in));
    let addr = spawn_axum(app).await;

    let res = h1_client()
        .request(
            Request::get(format!("http://{addr}/v1/events"))
                .header("x-opt-in", "1")
                .body(Full::<Bytes>::default())
                .unwrap(),
        )
        .await
        .unwrap();
    let (body, _) = read_all(res.into_body()).await;
    // Filtering the encoded bytes would have cut the marker out of the gzip stream and broken it:
    // for a client with nothing to remove, it passes byte for byte.
    assert_eq!(body, gz);
    assert_eq!(
        fetch(addr, true, true).await,
        (true, format!(": stream start\n\n{}", unfiltered()))
    );
    // For one that did not opt in: the 502, whatever it accepts.
    assert_encoded_refusal(fetch_status(addr, true, false).await);
    assert_encoded_refusal(fetch_status(addr, false, false).await);
}

/// The layer's own 502 carries exactly the error body and headers it announces, and never reads
/// the encoded stream.
#[tokio::test]
async fn the_502_for_an_encoded_stream_is_complete_and_the_stream_is_not_read() {
    use http_body::Body as _;
    use tower::{service_fn, ServiceExt};
    let svc = ServiceBuilder::new()
        .layer(BypassMarkerLayer::dynamo())
        .service(service_fn(|req: Request<Full<Bytes>>| async move {
            // Asked for identity, it answers br anyway: an upstream that ignores the header.
            assert_eq!(req.headers()[header::ACCEPT_ENCODING], "identity");
            let mut res = http::Response::new(forever());
            let headers = res.headers_mut();
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream"),
            );
            headers.append(
                header::CONTENT_ENCODING,
                HeaderValue::from_static("identity"),
            );
            headers.append(header::CONTENT_ENCODING, HeaderValue::from_static("br"));
            headers.insert("x-upstream", HeaderValue::from_static("1"));
            headers.append(header::VARY, HeaderValue::from_static("origin"));
            headers.append(header::VARY, HeaderValue::from_static("accept-encoding"));
            headers.insert("access-control-allow-origin", HeaderValue::from_static("*"));
            headers.insert("x-request-id", HeaderValue::from_static("r-1"));
            Ok::<_, std::convert::Infallible>(res)
        }));
    let mut req = Request::new(Full::default());
    req.headers_mut().insert(
        header::ACCEPT_ENCODING,
        HeaderValue::from_static(SDK_ACCEPT_ENCODING),
    );
    let res = svc.oneshot(req).await.unwrap();
    assert_eq!(res.status(), http::StatusCode::BAD_GATEWAY);
    assert!(res.body().is_refused() && !res.body().is_filtering());
    assert_eq!(res.headers()[header::CONTENT_TYPE], "application/json");
    assert!(res.headers().get(header::CONTENT_ENCODING).is_none());
    assert!(res.headers().get("x-upstream").is_none());
    // The headers that hold for the error too stay, every value of them.
    let vary: Vec<_> = res.headers().get_all(header::VARY).iter().collect();
    assert_eq!(vary, ["origin", "accept-encoding"]);
    assert_eq!(res.headers()["access-control-allow-origin"], "*");
    assert_eq!(res.headers()["x-request-id"], "r-1");
    assert_eq!(res.headers().len(), 6, "{:?}", res.headers());
    let length: u64 = res.headers()[header::CONTENT_LENGTH]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(res.body().size_hint().exact(), Some(length));
    // The inner body never ends: collecting the whole response shows it is not polled.
    let (body, trailers) = read_all(res.into_body()).await;
    assert!(trailers.is_none());
    assert_eq!(body.len() as u64, length);
    let error: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(error["error"]["code"], "encoded_event_stream");
    assert_eq!(error["error"]["message"], refusal_message("br"));
    // The layer writes it without serde_json; the JSON guard's refusal (serde_json's bytes) is
    // the reference.
    #[cfg(feature = "json")]
    assert_eq!(
        body,
        tower_bypass_marker::sans_io::Refusal::encoded_event_stream("br").body()
    );
}

#[tokio::test]
async fn the_502_keeps_the_cors_vary_and_request_id_headers_that_layers_inside_set() {
    use tower_http::cors::CorsLayer;
    use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
    // An upstream that gzips whatever it is asked, behind CORS and request ids set inside the
    // layer: the client's 502 still reaches the page (CORS) and names its request.
    let x_request_id = http::HeaderName::from_static("x-request-id");
    let app = Router::new()
        .route("/v1/events", get(gzipped_events))
        .layer(
            ServiceBuilder::new()
                .layer(BypassMarkerLayer::new())
                .layer(SetRequestIdLayer::new(
                    x_request_id.clone(),
                    MakeRequestUuid,
                ))
                .layer(PropagateRequestIdLayer::new(x_request_id))
                // tower-http 0.7's permissive CORS sets no `vary` (0.6's did): named here.
                .layer(CorsLayer::permissive().vary([header::ORIGIN])),
        );
    let addr = spawn_axum(app).await;
    let res = h1_client()
        .request(
            Request::get(format!("http://{addr}/v1/events"))
                .header(header::ORIGIN, "https://app.test")
                .header(header::ACCEPT_ENCODING, SDK_ACCEPT_ENCODING)
                .body(Full::<Bytes>::default())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(res.status(), http::StatusCode::BAD_GATEWAY);
    assert_eq!(res.headers()["access-control-allow-origin"], "*");
    assert_eq!(res.headers()["x-request-id"].len(), 36);
    assert!(res.headers().get_all(header::VARY).iter().count() > 0);
    assert_eq!(res.headers()[header::CONTENT_TYPE], "application/json");
    assert!(res.headers().get(header::CONTENT_ENCODING).is_none());
}
