//! Every decision observable: the calls a `FrameObserver` gets from the JSON guard (names
//! stripped and granted, refusals with their status and code; also through `GatewayExchange` and
//! from a request's own observer) and from the response side (a frame too large, forwarded or
//! failed; an encoded stream refused). The `tracing` events of the same decisions are pinned in
//! tests/tracing.rs.
#![cfg(feature = "json")]

use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{header, HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use test_support::serve::guarded::{ok, post, send, sse};
use tower::{service_fn, ServiceBuilder, ServiceExt};
use tower_bypass_marker::sans_io::{GatewayExchange, UnseenRequest};
use tower_bypass_marker::{BypassMarkerLayer, FrameObserver, NonJsonBodies, Overflow};

/// Every call, as a line.
#[derive(Default)]
struct Recorder(Mutex<Vec<String>>);

impl Recorder {
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
    fn push(&self, line: String) {
        self.0.lock().unwrap().push(line);
    }
}

impl FrameObserver for Recorder {
    fn frame_too_large(&self, limit: usize, forwarded: bool) {
        self.push(format!("too large {limit} forwarded={forwarded}"));
    }
    fn encoded_stream_refused(&self, coding: &str) {
        self.push(format!("encoded {coding}"));
    }
    fn annotation_stripped(&self, annotation: &str) {
        self.push(format!("stripped {annotation}"));
    }
    fn annotation_granted(&self, annotation: &str) {
        self.push(format!("granted {annotation}"));
    }
    fn request_refused(&self, status: StatusCode, code: &str) {
        self.push(format!("refused {} {code}", status.as_u16()));
    }
}

/// The guard (with a 256-byte cap) and the layer of `layer` over a service that answers `answer`.
async fn guarded(
    layer: &BypassMarkerLayer,
    req: Request<Full<Bytes>>,
    answer: Response<Full<Bytes>>,
) -> (StatusCode, Bytes) {
    send(layer.json_guard().max_body_bytes(256), layer, req, answer).await
}

#[tokio::test]
async fn the_guard_reports_each_stripped_and_granted_name_once_per_request() {
    let recorder = Arc::new(Recorder::default());
    let layer = BypassMarkerLayer::dynamo().observe(recorder.clone());
    let body = r#"{"nvext":{"annotations":["x-bypass-remote-prefill","X-BYPASS-REMOTE-PREFILL:1","x-prefill-continue","request_id","llm_metrics"]}}"#;
    guarded(&layer, post("application/json", body), ok()).await;
    let mut calls = recorder.take();
    calls.sort();
    assert_eq!(
        calls,
        [
            // The bare names are the client's opt-in; every form of them is stripped.
            "granted request_id",
            "granted x-bypass-remote-prefill",
            "granted x-prefill-continue",
            "stripped x-bypass-remote-prefill",
            "stripped x-prefill-continue",
        ]
    );
    // Nothing to strip or grant: no call.
    guarded(&layer, post("application/json", r#"{"model":"m"}"#), ok()).await;
    assert_eq!(recorder.take(), Vec::<String>::new());
}

#[tokio::test]
async fn every_refusal_is_reported_with_its_status_and_code() {
    let recorder = Arc::new(Recorder::default());
    let layer = BypassMarkerLayer::dynamo()
        .non_json_bodies(NonJsonBodies::Refuse)
        .observe(recorder.clone());
    let gzip = Request::post("/")
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONTENT_ENCODING, "gzip")
        .body(Full::new(Bytes::from_static(b"x")))
        .unwrap();
    let cases = [
        (post("application/json", "{"), "refused 400 invalid_json"),
        (
            post("application/json", r#"{"nvext":{},"nvext":{}}"#),
            "refused 400 duplicate_key",
        ),
        (
            post("application/json", r#"{"nvext":"x"}"#),
            "refused 400 invalid_nvext",
        ),
        (gzip, "refused 415 unsupported_content_encoding"),
        (
            post("text/plain", r#"{"nvext":{}}"#),
            "refused 415 unsupported_media_type",
        ),
        (
            // Over the guard's 256 bytes, by its size hint.
            Request::post("/")
                .header(header::CONTENT_TYPE, "application/json")
                .body(Full::new(Bytes::from(vec![b' '; 300])))
                .unwrap(),
            "refused 413 request_too_large",
        ),
    ];
    for (req, expected) in cases {
        let (status, _) = guarded(&layer, req, ok()).await;
        assert!(status.is_client_error(), "{expected}: {status}");
        assert_eq!(recorder.take(), [expected]);
    }
}

#[tokio::test]
async fn a_requests_own_observer_hears_of_the_guards_decisions() {
    struct PerRequest(Arc<Recorder>);
    impl FrameObserver for PerRequest {
        fn for_request(&self, request: &http::request::Parts) -> Option<Arc<dyn FrameObserver>> {
            request
                .headers
                .contains_key("x-tenant")
                .then(|| self.0.clone() as Arc<dyn FrameObserver>)
        }
    }
    let tenant = Arc::new(Recorder::default());
    let layer = BypassMarkerLayer::dynamo().observe(Arc::new(PerRequest(tenant.clone())));
    let mut req = post(
        "application/json",
        r#"{"nvext":{"annotations":["x-bypass-remote-prefill:1"]}}"#,
    );
    req.headers_mut().insert("x-tenant", "a".parse().unwrap());
    guarded(&layer, req, ok()).await;
    assert_eq!(tenant.take(), ["stripped x-bypass-remote-prefill"]);
}

#[test]
fn the_gateway_exchange_reports_to_the_layers_observer() {
    let recorder = Arc::new(Recorder::default());
    let layer = BypassMarkerLayer::dynamo().observe(recorder.clone());
    let mut headers = HeaderMap::new();
    headers.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
    let mut exchange = GatewayExchange::new(&layer, layer.request_guard(), UnseenRequest::Fail);
    let _ = exchange
        .request_headers(Method::POST, &headers, false)
        .unwrap();
    let body =
        Bytes::from_static(br#"{"nvext":{"annotations":["x-prefill-continue:1","token_ids"]}}"#);
    let _ = exchange.request_body(body, true).unwrap();
    let mut calls = recorder.take();
    calls.sort();
    assert_eq!(calls, ["granted token_ids", "stripped x-prefill-continue"]);

    let mut exchange = GatewayExchange::new(&layer, layer.request_guard(), UnseenRequest::Fail);
    let _ = exchange
        .request_headers(Method::POST, &headers, false)
        .unwrap();
    let _ = exchange
        .request_body(Bytes::from_static(b"[1,"), true)
        .unwrap();
    assert_eq!(recorder.take(), ["refused 400 invalid_json"]);
}

#[tokio::test]
async fn a_frame_too_large_is_reported_forwarded_or_failed() {
    let big = "data: 0123456789012345678901234567890123456789\n\n";
    for (overflow, forwarded) in [(Overflow::Forward, true), (Overflow::Error, false)] {
        let recorder = Arc::new(Recorder::default());
        let layer = BypassMarkerLayer::new()
            .max_frame_bytes(16)
            .on_overflow(overflow)
            .observe(recorder.clone());
        // Two chunks, so the frame spans them and is held.
        let svc = ServiceBuilder::new().layer(layer).service(service_fn(
            move |_req: Request<()>| async move {
                let chunks = [&big[..20], &big[20..]].map(|c| {
                    Ok::<_, Infallible>(http_body::Frame::data(Bytes::from_static(c.as_bytes())))
                });
                let body = http_body_util::StreamBody::new(futures_util::stream::iter(chunks));
                let res = Response::builder()
                    .header(header::CONTENT_TYPE, "text/event-stream")
                    .body(body)
                    .unwrap();
                Ok::<_, Infallible>(res)
            },
        ));
        let out = svc
            .oneshot(Request::new(()))
            .await
            .unwrap()
            .into_body()
            .collect()
            .await;
        assert_eq!(out.is_ok(), forwarded, "{overflow:?}");
        assert_eq!(
            recorder.take(),
            [format!("too large 16 forwarded={forwarded}")]
        );
    }
}

#[tokio::test]
async fn an_encoded_stream_refused_is_reported_by_its_coding() {
    let recorder = Arc::new(Recorder::default());
    let layer = BypassMarkerLayer::dynamo().observe(recorder.clone());
    for (headers, expected) in [
        (vec![("content-encoding", "br")], "encoded br"),
        (
            vec![("transfer-encoding", "gzip, chunked")],
            "encoded transfer-encoding gzip",
        ),
    ] {
        let (status, _) = guarded(&layer, post("application/json", "{}"), sse(&headers, "x")).await;
        assert_eq!(status, StatusCode::BAD_GATEWAY);
        assert_eq!(recorder.take(), [expected]);
    }
}

/// `refuses_encoded` is a query: it tells no observer. The host that acts on it does:
/// `GatewayExchange` reports the refusal it answers with.
#[test]
fn refuses_encoded_is_a_query_and_the_exchange_reports_the_refusal() {
    let recorder = Arc::new(Recorder::default());
    let layer = BypassMarkerLayer::dynamo().observe(recorder.clone());
    let mut headers = HeaderMap::new();
    headers.insert(header::CONTENT_TYPE, "text/event-stream".parse().unwrap());
    headers.insert(header::CONTENT_ENCODING, "gzip".parse().unwrap());
    let none = tower_bypass_marker::RequestedAnnotations::new();
    for _ in 0..2 {
        let coding = layer.refuses_encoded(&Method::POST, StatusCode::OK, &headers, &none);
        assert_eq!(coding.as_deref(), Some("gzip"));
    }
    assert_eq!(recorder.take(), Vec::<String>::new());

    let mut json = HeaderMap::new();
    json.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
    let mut exchange = GatewayExchange::new(&layer, layer.request_guard(), UnseenRequest::Fail);
    let _ = exchange
        .request_headers(Method::POST, &json, false)
        .unwrap();
    let _ = exchange
        .request_body(Bytes::from_static(b"{}"), true)
        .unwrap();
    let step = exchange
        .response_headers(StatusCode::OK, &headers, false)
        .unwrap();
    assert!(matches!(
        step,
        tower_bypass_marker::sans_io::ResponseStep::Refuse(_)
    ));
    assert_eq!(recorder.take(), ["encoded gzip"]);
}
