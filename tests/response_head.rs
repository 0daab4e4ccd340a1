//! What the response head decides: which headers make a body an event stream the layer filters,
//! and which responses carry no content and pass through with every header kept.

use std::convert::Infallible;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty, Full};
use test_support::serve::{h1_client, spawn_axum, MARKER, PATIENCE};
use tower::{service_fn, Layer, ServiceExt};
use tower_bypass_marker::BypassMarkerLayer;

const DATA: &str = "data: 1\n\n";

/// Sends a `method` request through the default layer to an upstream answering with `status`
/// and `headers` and the marker then `DATA` as its body; returns the response's headers, whether
/// the layer filters, and the body.
async fn through(
    method: Method,
    status: StatusCode,
    headers: &[(header::HeaderName, &[u8])],
) -> (http::HeaderMap, bool, Bytes) {
    let mut res = Response::builder().status(status);
    for (name, value) in headers {
        res = res.header(name, HeaderValue::from_bytes(value).unwrap());
    }
    let res = res
        .body(Full::new(Bytes::from(format!("{MARKER}{DATA}"))))
        .unwrap();
    let upstream = service_fn(move |_req: Request<Empty<Bytes>>| {
        let res = res.clone();
        async move { Ok::<_, Infallible>(res) }
    });
    let svc = BypassMarkerLayer::new().layer(upstream);
    let req = Request::builder()
        .method(method)
        .body(Empty::new())
        .unwrap();
    let (parts, body) = svc.oneshot(req).await.unwrap().into_parts();
    let filtering = body.is_filtering();
    let bytes = body.collect().await.unwrap().to_bytes();
    (parts.headers, filtering, bytes)
}

fn sse(content_type: &[u8]) -> Vec<(header::HeaderName, &[u8])> {
    vec![(header::CONTENT_TYPE, content_type)]
}

#[tokio::test]
async fn an_obs_text_parameter_does_not_let_the_marker_through() {
    let (_, filtering, body) = through(
        Method::GET,
        StatusCode::OK,
        &sse(b"text/event-stream; x=\"\xE9\""),
    )
    .await;
    assert!(filtering);
    assert_eq!(body, DATA);
}

#[tokio::test]
async fn empty_content_coding_list_elements_do_not_let_the_marker_through() {
    for coding in [&b"identity, "[..], b",identity", b""] {
        let mut headers = sse(b"text/event-stream");
        headers.push((header::CONTENT_ENCODING, coding));
        let (_, filtering, body) = through(Method::GET, StatusCode::OK, &headers).await;
        assert!(filtering, "{:?}", String::from_utf8_lossy(coding));
        assert_eq!(body, DATA, "{:?}", String::from_utf8_lossy(coding));
    }
}

/// An event stream in a real coding cannot be read: the layer answers its own 502 instead (its
/// body is the error, not the stream), however the coding is listed.
#[tokio::test]
async fn a_real_coding_after_identity_gets_the_502_not_the_body() {
    for coding in [
        &b"identity, gzip"[..],
        b"GZIP",
        b"identity,,br",
        b"identity;q=1",
    ] {
        let mut headers = sse(b"text/event-stream");
        headers.push((header::CONTENT_ENCODING, coding));
        let (headers, filtering, body) = through(Method::GET, StatusCode::OK, &headers).await;
        let coding = String::from_utf8_lossy(coding);
        assert!(!filtering, "{coding}");
        assert_eq!(
            headers[header::CONTENT_TYPE],
            "application/json",
            "{coding}"
        );
        assert!(headers.get(header::CONTENT_ENCODING).is_none(), "{coding}");
        let body = String::from_utf8(body.to_vec()).unwrap();
        assert!(
            body.contains(r#""code":"encoded_event_stream""#),
            "{coding}: {body}"
        );
    }
    // Without content (a HEAD request, a 204), there is nothing to refuse: headers kept.
    let mut headers = sse(b"text/event-stream");
    headers.push((header::CONTENT_ENCODING, b"gzip"));
    let (kept, _, _) = through(Method::HEAD, StatusCode::OK, &headers).await;
    assert_eq!(kept[header::CONTENT_ENCODING], "gzip");
    let (kept, _, _) = through(Method::GET, StatusCode::NO_CONTENT, &headers).await;
    assert_eq!(kept[header::CONTENT_ENCODING], "gzip");
}

#[tokio::test]
async fn the_last_of_two_content_types_decides() {
    let last_sse = [
        (header::CONTENT_TYPE, &b"application/json"[..]),
        (header::CONTENT_TYPE, b"text/event-stream"),
    ];
    let (_, filtering, body) = through(Method::GET, StatusCode::OK, &last_sse).await;
    assert!(filtering);
    assert_eq!(body, DATA);

    let last_json = [
        (header::CONTENT_TYPE, &b"text/event-stream"[..]),
        (header::CONTENT_TYPE, b"application/json"),
    ];
    let (_, filtering, body) = through(Method::GET, StatusCode::OK, &last_json).await;
    assert!(!filtering);
    assert_eq!(body, format!("{MARKER}{DATA}"));
}

/// 1xx, 204 and 304 responses and responses to HEAD have no content: their `content-length`
/// describes a representation, not this message, and stays.
#[tokio::test]
async fn responses_without_content_keep_their_content_length() {
    let length = b"123";
    let headers = [
        (header::CONTENT_TYPE, &b"text/event-stream"[..]),
        (header::CONTENT_LENGTH, length),
    ];
    for (method, status) in [
        (Method::HEAD, StatusCode::OK),
        (Method::HEAD, StatusCode::CREATED),
        (Method::GET, StatusCode::NO_CONTENT),
        (Method::GET, StatusCode::NOT_MODIFIED),
        (Method::GET, StatusCode::CONTINUE),
        (Method::GET, StatusCode::SWITCHING_PROTOCOLS),
        (Method::GET, StatusCode::from_u16(103).unwrap()),
        (Method::POST, StatusCode::NO_CONTENT),
    ] {
        let (headers, filtering, _) = through(method.clone(), status, &headers).await;
        assert!(!filtering, "{method} {status}");
        assert_eq!(headers[header::CONTENT_LENGTH], "123", "{method} {status}");
    }
}

#[tokio::test]
async fn responses_with_content_still_lose_their_content_length_when_filtered() {
    let headers = [
        (header::CONTENT_TYPE, &b"text/event-stream"[..]),
        (header::CONTENT_LENGTH, &b"49"[..]),
    ];
    for (method, status) in [
        (Method::GET, StatusCode::OK),
        (Method::POST, StatusCode::OK),
        (Method::OPTIONS, StatusCode::OK),
        (Method::GET, StatusCode::PARTIAL_CONTENT),
        (Method::GET, StatusCode::NOT_FOUND),
    ] {
        let (headers, filtering, body) = through(method.clone(), status, &headers).await;
        assert!(filtering, "{method} {status}");
        assert!(
            !headers.contains_key(header::CONTENT_LENGTH),
            "{method} {status}"
        );
        assert_eq!(body, DATA);
    }
}

/// Over a real HTTP/1.1 connection: the client learns the length of the stream a GET would get.
#[tokio::test]
async fn head_over_http1_keeps_the_content_length_of_the_get() {
    let body = format!("{MARKER}{DATA}");
    let len = body.len();
    let app = axum::Router::new()
        .route(
            "/events",
            axum::routing::get(move || async move {
                (
                    [
                        (header::CONTENT_TYPE, "text/event-stream".to_owned()),
                        (header::CONTENT_LENGTH, len.to_string()),
                    ],
                    body,
                )
            }),
        )
        .layer(BypassMarkerLayer::new());
    let addr = spawn_axum(app).await;
    let client = h1_client();
    let uri = format!("http://{addr}/events");
    let request = |method: Method| {
        Request::builder()
            .method(method)
            .uri(&uri)
            .body(Full::<Bytes>::default())
            .unwrap()
    };
    let head = tokio::time::timeout(PATIENCE, client.request(request(Method::HEAD)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(head.status(), StatusCode::OK);
    assert_eq!(head.headers()[header::CONTENT_LENGTH], len.to_string());

    let get = tokio::time::timeout(PATIENCE, client.request(request(Method::GET)))
        .await
        .unwrap()
        .unwrap();
    assert!(!get.headers().contains_key(header::CONTENT_LENGTH));
    let bytes = get.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(bytes, DATA);
}
