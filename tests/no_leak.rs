//! No removed frame through any coding, status or protocol, and no near-miss name through the
//! guard: the layer (and, with `json`, the guard) served by hyper-util's auto builder on loopback,
//! each case asked over HTTP/1.1 and over h2c.
//!
//! - an inner service that answers `transfer-encoding: gzip, chunked` gets the layer's 502, never
//!   a byte of its stream, and the client's `TE: gzip` never reaches it while the layer asks for
//!   identity;
//! - a `204`, a `304` and the response to `HEAD` carry no byte of the body the inner service
//!   gave them (hyper's h2 server would send it: the control without the layer shows it);
//! - (`json`) bodies with a non-JSON content type are forwarded, judged or refused as
//!   [`NonJsonBodies`] says, and annotation entries that a lenient upstream could fold into a
//!   router-owned name are stripped.

use std::convert::Infallible;
use std::io::Write;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use flate2::write::GzEncoder;
use http::{header, HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use test_support::serve::{h1_client, h2_client, read_all, spawn_auto};
use tower::{service_fn, ServiceBuilder};
use tower_bypass_marker::{BypassMarkerLayer, RequestedAnnotations};

const MARKER: &str = "event: x-bypass-remote-prefill\n: true\n\n";
const DATA: &str = "data: {\"choices\":[]}\n\n";

type TestClient = Client<HttpConnector, Full<Bytes>>;

/// Both protocols, with their names for the assertions.
fn clients() -> [(&'static str, TestClient); 2] {
    [("HTTP/1.1", h1_client()), ("h2c", h2_client())]
}

fn gzip(bytes: &[u8]) -> Bytes {
    let mut encoder = GzEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder.write_all(bytes).unwrap();
    Bytes::from(encoder.finish().unwrap())
}

/// Serves, behind `layer` (or nothing), a service that answers every request with `status`, an
/// event-stream head plus `headers`, and `body`; records the request heads it received.
async fn upstream(
    layer: Option<BypassMarkerLayer>,
    status: StatusCode,
    headers: &[(&'static str, &'static str)],
    body: Bytes,
) -> (std::net::SocketAddr, Arc<Mutex<Vec<HeaderMap>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    let headers: Vec<_> = headers.to_vec();
    let inner = service_fn(move |req: Request<hyper::body::Incoming>| {
        record.lock().unwrap().push(req.headers().clone());
        let mut res = Response::new(Full::new(body.clone()));
        *res.status_mut() = status;
        res.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        for (name, value) in &headers {
            res.headers_mut()
                .append(*name, HeaderValue::from_static(value));
        }
        async move { Ok::<_, Infallible>(res) }
    });
    let addr = match layer {
        Some(layer) => spawn_auto(ServiceBuilder::new().layer(layer).service(inner), 100).await,
        None => spawn_auto(inner, 100).await,
    };
    (addr, seen)
}

/// Sends a request with no body and `headers` to `addr`'s chat endpoint; the response's status,
/// headers and whole body.
async fn fetch(
    client: &TestClient,
    method: Method,
    addr: std::net::SocketAddr,
    headers: &[(&str, &str)],
) -> (StatusCode, HeaderMap, Bytes) {
    let mut req = Request::builder()
        .method(method)
        .uri(format!("http://{addr}/v1/chat/completions"));
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let res = client
        .request(req.body(Full::default()).unwrap())
        .await
        .unwrap();
    let (parts, body) = res.into_parts();
    (parts.status, parts.headers, read_all(body).await.0)
}

#[tokio::test]
async fn a_transfer_coded_event_stream_is_refused_before_any_byte_of_it() {
    let stream = format!("{MARKER}{DATA}");
    let body = gzip(stream.as_bytes());
    let (addr, _) = upstream(
        Some(BypassMarkerLayer::dynamo()),
        StatusCode::OK,
        &[("transfer-encoding", "gzip, chunked")],
        body,
    )
    .await;
    for (proto, client) in clients() {
        let (status, headers, bytes) = fetch(&client, Method::POST, addr, &[]).await;
        assert_eq!(status, StatusCode::BAD_GATEWAY, "{proto}");
        assert!(headers.get(header::TRANSFER_ENCODING).is_none(), "{proto}");
        let text = String::from_utf8_lossy(&bytes);
        assert!(
            text.contains(r#""code":"encoded_event_stream""#),
            "{proto}: {text}"
        );
        assert!(
            text.contains("the event stream has transfer-encoding gzip, which cannot be filtered"),
            "{proto}: {text}"
        );
    }
}

#[tokio::test]
async fn a_transfer_coded_event_stream_passes_when_nothing_is_removed() {
    let body = gzip(format!("{MARKER}{DATA}").as_bytes());
    let layer = BypassMarkerLayer::new().opt_in_from(|_| {
        ["x-bypass-remote-prefill"]
            .into_iter()
            .collect::<RequestedAnnotations>()
    });
    let (addr, _) = upstream(
        Some(layer),
        StatusCode::OK,
        &[("transfer-encoding", "gzip, chunked")],
        body.clone(),
    )
    .await;
    // Over HTTP/1.1 hyper's server frames it chunked under the inner service's header; the
    // client's chunked decoder leaves the gzip bytes, which are the inner service's, unchanged.
    let (status, _, bytes) = fetch(&h1_client(), Method::POST, addr, &[]).await;
    assert_eq!((status, bytes), (StatusCode::OK, body));
}

#[tokio::test]
async fn the_clients_transfer_codings_never_reach_the_inner_service_when_identity_is_asked() {
    let (addr, seen) = upstream(
        Some(BypassMarkerLayer::dynamo()),
        StatusCode::OK,
        &[],
        Bytes::from(format!("{MARKER}{DATA}")),
    )
    .await;
    let client = h1_client();
    for (te, forwarded) in [
        ("gzip, trailers", Some("trailers")),
        ("trailers, deflate;q=0.5", Some("trailers")),
        ("gzip", None),
        ("TRAILERS", Some("TRAILERS")),
    ] {
        let (_, _, bytes) = fetch(&client, Method::POST, addr, &[("te", te)]).await;
        assert_eq!(bytes, DATA, "{te}");
        let head = seen.lock().unwrap().pop().unwrap();
        let got = head.get(header::TE).map(|v| v.to_str().unwrap().to_owned());
        assert_eq!(got.as_deref(), forwarded, "TE: {te}");
    }
    // A client that opted in to everything is not asked for identity: its TE is its own.
    let layer = BypassMarkerLayer::new().opt_in_from(|_| {
        ["x-bypass-remote-prefill"]
            .into_iter()
            .collect::<RequestedAnnotations>()
    });
    let (addr, seen) = upstream(Some(layer), StatusCode::OK, &[], Bytes::from(DATA)).await;
    fetch(&client, Method::POST, addr, &[("te", "gzip")]).await;
    let head = seen.lock().unwrap().pop().unwrap();
    assert_eq!(head.get(header::TE).unwrap(), "gzip");
}

#[tokio::test]
async fn responses_without_content_never_carry_a_frame_over_either_protocol() {
    let body = Bytes::from(format!("{MARKER}{DATA}"));
    for status in [StatusCode::NO_CONTENT, StatusCode::NOT_MODIFIED] {
        let (addr, _) = upstream(
            Some(BypassMarkerLayer::dynamo()),
            status,
            &[("x-kept", "yes")],
            body.clone(),
        )
        .await;
        for (proto, client) in clients() {
            let (got, headers, bytes) = fetch(&client, Method::POST, addr, &[]).await;
            assert_eq!(got, status, "{proto}");
            assert_eq!(headers["x-kept"], "yes", "{proto}: headers are kept");
            assert!(bytes.is_empty(), "{proto} {status}: {bytes:?}");
        }
    }
    let (addr, _) = upstream(Some(BypassMarkerLayer::dynamo()), StatusCode::OK, &[], body).await;
    for (proto, client) in clients() {
        let (status, _, bytes) = fetch(&client, Method::HEAD, addr, &[]).await;
        assert_eq!(status, StatusCode::OK, "{proto}");
        assert!(bytes.is_empty(), "{proto} HEAD: {bytes:?}");
    }
}

/// The control: without the layer, hyper's h2 server sends a 204's body, marker and all; the test
/// above would catch a layer that let it through.
#[tokio::test]
async fn without_the_layer_an_h2_204_carries_its_body() {
    let body = Bytes::from(format!("{MARKER}{DATA}"));
    let (addr, _) = upstream(None, StatusCode::NO_CONTENT, &[], body.clone()).await;
    let (status, _, bytes) = fetch(&h2_client(), Method::POST, addr, &[]).await;
    assert_eq!((status, bytes), (StatusCode::NO_CONTENT, body));
}

#[cfg(feature = "json")]
mod guard {
    use super::*;
    use http_body_util::BodyExt;
    use tower_bypass_marker::json::JsonGuardBody;
    use tower_bypass_marker::NonJsonBodies;

    /// Serves the guard and the layer of `layer` over a service that echoes the body it got;
    /// counts the requests that reached it.
    async fn echo(layer: BypassMarkerLayer) -> (std::net::SocketAddr, Arc<Mutex<usize>>) {
        let calls = Arc::new(Mutex::new(0));
        let counted = calls.clone();
        let inner = service_fn(move |req: Request<JsonGuardBody<hyper::body::Incoming>>| {
            *counted.lock().unwrap() += 1;
            async move {
                let body = req.into_body().collect().await?.to_bytes();
                Ok::<_, tower::BoxError>(Response::new(Full::new(body)))
            }
        });
        let svc = ServiceBuilder::new()
            .layer(layer.json_guard())
            .layer(layer)
            .service(inner);
        (spawn_auto(svc, 100).await, calls)
    }

    async fn post(
        client: &TestClient,
        addr: std::net::SocketAddr,
        content_type: &str,
        body: impl Into<Bytes>,
    ) -> (StatusCode, Bytes) {
        let req = Request::post(format!("http://{addr}/v1/chat/completions"))
            .header(header::CONTENT_TYPE, content_type)
            .body(Full::new(body.into()))
            .unwrap();
        let res = client.request(req).await.unwrap();
        let status = res.status();
        (status, read_all(res.into_body()).await.0)
    }

    const FORGED: &str =
        r#"{"model":"m","nvext":{"annotations":["x-bypass-remote-prefill","request_id"]}}"#;
    const JUDGED: &str = r#"{"model":"m","nvext":{"annotations":["request_id"]}}"#;

    #[tokio::test]
    async fn non_json_bodies_are_forwarded_judged_or_refused_as_configured() {
        let dynamo = BypassMarkerLayer::dynamo();
        for (proto, client) in clients() {
            // The Dynamo preset (Forward): unread, as the client sent it (Dynamo answers 415).
            let (addr, _) = echo(dynamo.clone()).await;
            let got = post(&client, addr, "text/plain", FORGED).await;
            assert_eq!(got, (StatusCode::OK, Bytes::from(FORGED)), "{proto}");

            let (addr, _) = echo(dynamo.clone().non_json_bodies(NonJsonBodies::Judge)).await;
            let got = post(&client, addr, "text/plain", FORGED).await;
            assert_eq!(got, (StatusCode::OK, Bytes::from(JUDGED)), "{proto}");
            // Looks like JSON but is not RFC 8259 JSON (UTF-16, which Python's json.loads reads):
            // refused as invalid JSON.
            let utf16: Vec<u8> = FORGED.encode_utf16().flat_map(u16::to_le_bytes).collect();
            let (status, body) = post(&client, addr, "text/plain", utf16).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{proto}");
            assert!(String::from_utf8_lossy(&body).contains("invalid_json"));
            // Does not look like JSON: forwarded as it came.
            let got = post(&client, addr, "text/plain", "nvext x-bypass-remote-prefill").await;
            assert_eq!(got.1, "nvext x-bypass-remote-prefill", "{proto}");

            let (addr, calls) = echo(dynamo.clone().non_json_bodies(NonJsonBodies::Refuse)).await;
            for content_type in ["text/plain", "application/x-www-form-urlencoded", "x/y"] {
                let (status, body) =
                    post(&client, addr, content_type, format!(" \n{FORGED}")).await;
                assert_eq!(
                    status,
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "{proto} {content_type}"
                );
                assert!(String::from_utf8_lossy(&body).contains("unsupported_media_type"));
            }
            assert_eq!(
                *calls.lock().unwrap(),
                0,
                "{proto}: a refused request reached the upstream"
            );
            let got = post(&client, addr, "text/plain", "hello").await;
            assert_eq!(got, (StatusCode::OK, Bytes::from("hello")), "{proto}");
            // A JSON content type is judged as always.
            let got = post(&client, addr, "application/json", FORGED).await;
            assert_eq!(got, (StatusCode::OK, Bytes::from(JUDGED)), "{proto}");
        }
    }

    /// Each entry here differs from `x-bypass-remote-prefill` (or `x-prefill-continue`) only by a
    /// character that a lenient upstream folds away or into ASCII (the comment says which), and is
    /// stripped; the entries of `KEPT` cannot become a router-owned name and stay.
    const NEAR_MISSES: [&str; 9] = [
        "\u{1c}x-bypass-remote-prefill",  // Python's str.strip removes U+001C
        "x-bypass-remote-prefill\u{1f}",  // ... and U+001F
        "x-bypass-remote-prefill\u{0}",   // a C string ends at NUL
        "\u{85}x-prefill-continue",       // Python's str.strip removes NEL
        "\u{ff58}-bypass-remote-prefill", // NFKC: fullwidth x is x
        "x-bypa\u{17f}s-remote-prefill",  // case folding: long s is s
        "X-BYPASS-REMOTE-PREFILL\u{ff1a}true", // NFKC: fullwidth colon is :
        "x-bypass-remote-pre\u{fb01}ll",  // NFKC: the ligature fi is fi
        "x-prefill-continue\u{200b}",     // a zero-width space, which some normalizers drop
    ];
    const KEPT: [&str; 4] = [
        "request_id",
        "x-other\u{e9}",
        "x-bypass-other\u{0}",
        "caf\u{e9}",
    ];

    #[tokio::test]
    async fn near_miss_names_are_stripped_and_other_names_kept() {
        let (addr, _) = echo(BypassMarkerLayer::dynamo()).await;
        let entries: Vec<&str> = NEAR_MISSES.iter().chain(KEPT.iter()).copied().collect();
        let body = serde_json::json!({"model": "m", "nvext": {"annotations": entries}}).to_string();
        let expected = serde_json::json!({"model": "m", "nvext": {"annotations": KEPT}});
        for (proto, client) in clients() {
            let (status, got) = post(&client, addr, "application/json", body.clone()).await;
            assert_eq!(status, StatusCode::OK, "{proto}");
            let got: serde_json::Value = serde_json::from_slice(&got).unwrap();
            assert_eq!(got, expected, "{proto}");
        }
    }
}
