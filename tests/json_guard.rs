//! The JSON request guard (`json` feature) through its public API: which requests it reads, what
//! the upstream receives, and the guard's own answers.
#![cfg(feature = "json")]

use test_support::serve;

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full};
use serve::{data, fed_body, forever, frames_body, read_all, BoxError, Forever, PATIENCE};
use tower::{service_fn, ServiceBuilder, ServiceExt};
use tower_bypass_marker::json::{JsonGuardBody, ResponseBody};
use tower_bypass_marker::{BypassMarkerLayer, JsonGuardLayer, RequestedAnnotations};

/// What the upstream received.
#[derive(Debug, Default, Clone)]
struct Seen {
    headers: HeaderMap,
    granted: Option<RequestedAnnotations>,
    frames: Vec<Bytes>,
    trailers: Option<HeaderMap>,
}

impl Seen {
    fn body(&self) -> Bytes {
        serve::concat(&self.frames)
    }
}

fn bypass() -> BypassMarkerLayer {
    BypassMarkerLayer::new()
        .opt_in("request_id")
        .never_forward("llm_metrics")
}

/// Sends `req` through `guard` to an upstream that reads the whole body; returns the response
/// (status, headers, body, extensions' opt-in) and what the upstream saw, if it was called.
async fn through<B>(
    guard: JsonGuardLayer,
    req: Request<B>,
) -> (Response<Bytes>, Option<RequestedAnnotations>, Option<Seen>)
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let seen = Arc::new(Mutex::new(None));
    let record = seen.clone();
    let upstream = service_fn(move |req: Request<JsonGuardBody<B>>| {
        let record = record.clone();
        async move {
            let (parts, body) = req.into_parts();
            let mut body = std::pin::pin!(body);
            let mut seen = Seen {
                headers: parts.headers,
                granted: parts.extensions.get::<RequestedAnnotations>().cloned(),
                ..Seen::default()
            };
            while let Some(frame) = body.frame().await {
                match frame.map_err(Into::into)?.into_data() {
                    Ok(data) => seen.frames.push(data),
                    Err(frame) => seen.trailers = frame.into_trailers().ok(),
                }
            }
            *record.lock().unwrap() = Some(seen);
            Ok::<_, BoxError>(Response::new(Full::new(Bytes::from_static(b"upstream"))))
        }
    });
    let svc = ServiceBuilder::new().layer(guard).service(upstream);
    let res = tokio::time::timeout(PATIENCE, svc.oneshot(req))
        .await
        .expect("the guard did not answer in time")
        .expect("the service failed");
    let (parts, body) = res.into_parts();
    let granted = parts.extensions.get::<RequestedAnnotations>().cloned();
    let (bytes, _) = read_all(body).await;
    let seen = seen.lock().unwrap().take();
    (Response::from_parts(parts, bytes), granted, seen)
}

fn json(body: &'static str) -> Request<Full<Bytes>> {
    Request::post("/v1/chat/completions")
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONTENT_LENGTH, body.len())
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

const WITH_MARKER: &str = r#"{"model":"m", "nvext":{"annotations":["request_id", "x-bypass-remote-prefill:true"]},"stream":true}"#;
const STRIPPED: &str = r#"{"model":"m", "nvext":{"annotations":["request_id"]},"stream":true}"#;

/// The guard's error: status, and the `code` of its OpenAI-shaped body (checked here).
fn error_code(res: &Response<Bytes>) -> (StatusCode, String) {
    assert_eq!(res.headers()[header::CONTENT_TYPE], "application/json");
    assert_eq!(
        res.headers()[header::CONTENT_LENGTH],
        res.body().len().to_string().as_str()
    );
    let v: serde_json::Value = serde_json::from_slice(res.body()).unwrap();
    let error = v["error"].as_object().expect("an `error` object");
    assert_eq!(error["type"], "invalid_request_error");
    assert!(error["param"].is_null());
    assert!(!error["message"].as_str().unwrap().is_empty());
    (res.status(), error["code"].as_str().unwrap().to_owned())
}

#[tokio::test]
async fn a_body_with_nothing_to_strip_is_forwarded_as_the_same_bytes() {
    let body =
        Bytes::from_static(br#"{"model":"m","nvext":{"annotations":["request_id","other",1]}}"#);
    let req = Request::post("/")
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONTENT_LENGTH, body.len())
        .body(Full::new(body.clone()))
        .unwrap();
    let (res, granted, seen) = through(bypass().json_guard(), req).await;
    assert_eq!(res.status(), StatusCode::OK);
    let seen = seen.unwrap();
    assert_eq!(seen.frames.len(), 1);
    assert_eq!(seen.frames[0], body);
    assert_eq!(
        seen.frames[0].as_ptr(),
        body.as_ptr(),
        "the very same bytes"
    );
    assert_eq!(
        seen.headers[header::CONTENT_LENGTH],
        body.len().to_string().as_str()
    );
    let expected: RequestedAnnotations = ["request_id"].into_iter().collect();
    assert_eq!(seen.granted.as_ref(), Some(&expected));
    assert_eq!(
        granted.as_ref(),
        Some(&expected),
        "and in the response's extensions"
    );
}

#[tokio::test]
async fn a_stripped_body_is_spliced_and_its_content_length_updated() {
    let (res, granted, seen) = through(bypass().json_guard(), json(WITH_MARKER)).await;
    assert_eq!(res.status(), StatusCode::OK);
    let seen = seen.unwrap();
    assert_eq!(seen.body(), STRIPPED);
    assert_eq!(
        seen.headers[header::CONTENT_LENGTH],
        STRIPPED.len().to_string().as_str()
    );
    // The bytes around the array are slices of the buffered body: before, the array, after.
    assert_eq!(seen.frames.len(), 3);
    assert_eq!(seen.frames[1], r#"["request_id"]"#);
    // The value form is stripped but is not an opt-in.
    let expected: RequestedAnnotations = ["request_id"].into_iter().collect();
    assert_eq!(granted, Some(expected));

    // Without a content-length, none is added.
    let req = Request::post("/")
        .body(Full::new(Bytes::from_static(WITH_MARKER.as_bytes())))
        .unwrap();
    let (_, _, seen) = through(bypass().json_guard(), req).await;
    let seen = seen.unwrap();
    assert_eq!(seen.body(), STRIPPED);
    assert!(seen.headers.get(header::CONTENT_LENGTH).is_none());
}

#[tokio::test]
async fn json_content_types_and_bodies_without_one_are_read() {
    for content_type in [
        Some("application/json"),
        Some("application/json; charset=utf-8"),
        Some("APPLICATION/JSON"),
        Some("Application/Json ;charset=UTF-8"),
        Some(" application/json "),
        Some("application/vnd.api+json"),
        Some("application/merge-patch+JSON"),
        None,
    ] {
        let mut req = Request::post("/")
            .body(Full::new(Bytes::from_static(WITH_MARKER.as_bytes())))
            .unwrap();
        if let Some(ct) = content_type {
            req.headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static(ct));
        }
        let (_, _, seen) = through(bypass().json_guard(), req).await;
        assert_eq!(seen.unwrap().body(), STRIPPED, "{content_type:?}");
    }
    // Any one of several content-type headers.
    let mut req = json(WITH_MARKER);
    req.headers_mut()
        .append(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    let (_, _, seen) = through(bypass().json_guard(), req).await;
    assert_eq!(seen.unwrap().body(), STRIPPED);
}

/// FastAPI and Starlette read the header as latin-1 and test the media type with Python's
/// `email.message`: the part before `;` is stripped of Unicode whitespace (NBSP 0xA0 and NEL 0x85
/// among it), and any subtype that ends in `+json` counts, `+json` itself included. Each of these
/// bodies is parsed as JSON there, so the guard must read it.
#[tokio::test]
async fn json_content_types_as_lenient_servers_read_them_are_read() {
    for content_type in [
        &b"\xA0application/json"[..],
        b"application/json\xA0",
        b"\x85application/json\x85; charset=utf-8",
        b"\xA0 \x85APPLICATION/+JSON",
        b"application/+json",
    ] {
        let mut req = json(WITH_MARKER);
        req.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_bytes(content_type).unwrap(),
        );
        let (_, _, seen) = through(bypass().json_guard(), req).await;
        assert_eq!(
            seen.unwrap().body(),
            STRIPPED,
            "{}",
            content_type.escape_ascii()
        );
    }
}

/// An empty `content-type` is no content type: FastAPI, which parses a body without one as JSON,
/// tests the header's value for truth (`if not content_type_value: await request.json()`), so an
/// empty value would otherwise carry the marker past the guard.
#[tokio::test]
async fn an_empty_content_type_is_read_like_none() {
    for content_type in ["", " ", "\t"] {
        let req = Request::post("/")
            .header(header::CONTENT_TYPE, content_type)
            .body(Full::new(Bytes::from_static(WITH_MARKER.as_bytes())))
            .unwrap();
        let (_, granted, seen) = through(bypass().json_guard(), req).await;
        assert_eq!(seen.unwrap().body(), STRIPPED, "{content_type:?}");
        assert!(granted.unwrap().contains("request_id"));
    }
}

#[tokio::test]
async fn other_requests_pass_through_unread() {
    for content_type in [
        "text/plain",
        "multipart/form-data; boundary=x",
        "application/grpc",
        "application/x-www-form-urlencoded",
        "application/jsonl",
        "application/json-seq",
        "text/json",
        "json",
    ] {
        // A body that never ends: the upstream is called at once, with the body itself.
        let req = Request::post("/")
            .header(header::CONTENT_TYPE, content_type)
            .body(forever())
            .unwrap();
        let upstream = service_fn(|req: Request<JsonGuardBody<Forever>>| async move {
            assert!(!req.body().is_end_stream());
            assert_eq!(req.body().size_hint().upper(), None);
            Ok::<_, BoxError>(Response::new(Full::new(Bytes::from_static(b"upstream"))))
        });
        let svc = ServiceBuilder::new()
            .layer(bypass().json_guard())
            .service(upstream);
        let res = tokio::time::timeout(PATIENCE, svc.oneshot(req))
            .await
            .unwrap_or_else(|_| panic!("{content_type}: the guard read the body"))
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK);
    }
    // Data frames are forwarded as they come, even with the marker in them.
    let req = Request::post("/")
        .header(header::CONTENT_TYPE, "text/plain")
        .body(frames_body(vec![data(WITH_MARKER), data("x")]))
        .unwrap();
    let (_, granted, seen) = through(bypass().json_guard(), req).await;
    let seen = seen.unwrap();
    assert_eq!(seen.frames, [WITH_MARKER, "x"]);
    assert!(granted.is_none() && seen.granted.is_none());
}

#[tokio::test]
async fn requests_without_a_body_pass_even_with_a_json_content_type() {
    for method in ["GET", "POST"] {
        let req = Request::builder()
            .method(method)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let (res, _, seen) = through(bypass().json_guard(), req).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(seen.unwrap().body(), "");
    }
    // A body that turns out empty once read is forwarded empty.
    let req = Request::post("/")
        .header(header::CONTENT_TYPE, "application/json")
        .body(frames_body(vec![data("")]))
        .unwrap();
    let (res, _, seen) = through(bypass().json_guard(), req).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(seen.unwrap().body(), "");
}

#[tokio::test]
async fn an_encoded_json_body_is_refused_with_415() {
    for encoding in ["gzip", "br", "identity, gzip", "GZIP", "deflate,identity"] {
        let mut req = json(WITH_MARKER);
        req.headers_mut()
            .insert(header::CONTENT_ENCODING, HeaderValue::from_static(encoding));
        let (res, _, seen) = through(bypass().json_guard(), req).await;
        assert_eq!(
            error_code(&res),
            (
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_content_encoding".into()
            ),
            "{encoding}"
        );
        assert!(seen.is_none());
    }
    for encoding in ["identity", "IDENTITY", "identity, ", ", identity", ""] {
        let mut req = json(WITH_MARKER);
        req.headers_mut()
            .insert(header::CONTENT_ENCODING, HeaderValue::from_static(encoding));
        let (_, _, seen) = through(bypass().json_guard(), req).await;
        assert_eq!(seen.unwrap().body(), STRIPPED, "{encoding:?}");
    }
}

#[tokio::test]
async fn a_content_length_over_the_limit_is_refused_before_the_body_is_read() {
    // The body never yields: reading it would hang.
    let req = Request::post("/")
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONTENT_LENGTH, "101")
        .body(forever())
        .unwrap();
    let (res, _, seen) = through(bypass().json_guard().max_body_bytes(100), req).await;
    assert_eq!(
        error_code(&res),
        (StatusCode::PAYLOAD_TOO_LARGE, "request_too_large".into())
    );
    assert!(seen.is_none());
}

#[tokio::test]
async fn a_body_without_a_length_is_counted_as_it_arrives() {
    let (tx, body) = fed_body(16);
    let req = Request::post("/").body(body).unwrap();
    let guard = bypass().json_guard().max_body_bytes(100);
    let answer = tokio::spawn(through(guard, req));
    tx.send(data(vec![b' '; 60])).await.unwrap();
    tx.send(data(vec![b' '; 41])).await.unwrap();
    // The sender stays open: the guard answers without waiting for the end of the body.
    let (res, _, seen) = tokio::time::timeout(PATIENCE, answer)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        error_code(&res),
        (StatusCode::PAYLOAD_TOO_LARGE, "request_too_large".into())
    );
    assert!(seen.is_none());
    drop(tx);

    // At the limit exactly, it passes.
    let padded = format!("{WITH_MARKER:<100}");
    let req = Request::post("/")
        .body(frames_body(vec![
            data(padded[..50].to_owned()),
            data(padded[50..].to_owned()),
        ]))
        .unwrap();
    let (res, _, seen) = through(bypass().json_guard().max_body_bytes(100), req).await;
    assert_eq!(res.status(), StatusCode::OK);
    let width = 100 - WITH_MARKER.len() + STRIPPED.len();
    assert_eq!(seen.unwrap().body(), format!("{STRIPPED:<width$}"));
}

#[tokio::test]
async fn the_default_limit_is_32_mib() {
    assert_eq!(tower_bypass_marker::json::DEFAULT_MAX_BODY_BYTES, 32 << 20);
    let req = Request::post("/")
        .header(header::CONTENT_LENGTH, (32u64 << 20) + 1)
        .body(forever())
        .unwrap();
    let (res, _, _) = through(JsonGuardLayer::new(), req).await;
    assert_eq!(res.status(), StatusCode::PAYLOAD_TOO_LARGE);
}

#[tokio::test]
async fn bad_bodies_get_openai_shaped_400s() {
    for (body, code) in [
        (
            r#"{"nvext":{"annotations":["x-bypass-remote-prefill"]},"nvext":null}"#,
            "duplicate_key",
        ),
        (
            r#"{"nvext":null,"nv\u0065xt":{"annotations":["x-bypass-remote-prefill"]}}"#,
            "duplicate_key",
        ),
        (
            r#"{"nvext":{"annotations":[],"annotations":["x-bypass-remote-prefill"]}}"#,
            "duplicate_key",
        ),
        (
            r#"{"nvext":{"annotations":"x-bypass-remote-prefill"}}"#,
            "invalid_nvext",
        ),
        (r#"{"nvext":"x-bypass-remote-prefill"}"#, "invalid_nvext"),
        (
            r#"{"nvext":{"annotations":["x-bypass-remote-prefill"]}"#,
            "invalid_json",
        ),
        (
            r#"{"a":1} {"nvext":{"annotations":["x-bypass-remote-prefill"]}}"#,
            "invalid_json",
        ),
        (
            r#"{"temperature":NaN,"nvext":{"annotations":["x-bypass-remote-prefill"]}}"#,
            "invalid_json",
        ),
        (r#"{"temperature":Infinity}"#, "invalid_json"),
        ("not json", "invalid_json"),
    ] {
        let (res, _, seen) = through(bypass().json_guard(), json(body)).await;
        assert_eq!(
            error_code(&res),
            (StatusCode::BAD_REQUEST, code.to_owned()),
            "{body}"
        );
        assert!(seen.is_none(), "{body}");
    }
    let deep = format!("{{\"m\":{}{}}}", "[".repeat(100_000), "]".repeat(100_000));
    let req = Request::post("/")
        .body(Full::new(Bytes::from(deep)))
        .unwrap();
    let (res, _, _) = through(bypass().json_guard(), req).await;
    assert_eq!(
        error_code(&res),
        (StatusCode::BAD_REQUEST, "invalid_json".to_owned())
    );
    // The message says what and where.
    let (res, _, _) = through(bypass().json_guard(), json(r#"{"a":NaN}"#)).await;
    let v: serde_json::Value = serde_json::from_slice(res.body()).unwrap();
    assert_eq!(
        v["error"]["message"],
        "the request body is not valid JSON: expected value at byte 5"
    );
}

#[tokio::test]
async fn other_top_level_shapes_pass_unchanged_with_nothing_granted() {
    for body in [
        r#"[{"nvext":{"annotations":["x-bypass-remote-prefill"]}}]"#,
        r#""x-bypass-remote-prefill""#,
        "1e400",
    ] {
        let (res, granted, seen) = through(bypass().json_guard(), json(body)).await;
        assert_eq!(res.status(), StatusCode::OK);
        let seen = seen.unwrap();
        assert_eq!(seen.body(), body);
        assert!(granted.is_none() && seen.granted.is_none());
    }
}

#[tokio::test]
async fn the_opt_in_is_added_to_what_is_already_there() {
    let mut req = json(WITH_MARKER);
    req.extensions_mut()
        .insert(["other"].into_iter().collect::<RequestedAnnotations>());
    let (_, _, seen) = through(bypass().json_guard(), req).await;
    let expected: RequestedAnnotations = ["other", "request_id"].into_iter().collect();
    assert_eq!(seen.unwrap().granted, Some(expected));
}

#[tokio::test]
async fn trailers_follow_the_data() {
    let mut trailers = HeaderMap::new();
    trailers.insert("x-checksum", HeaderValue::from_static("1"));
    for body in [WITH_MARKER, STRIPPED] {
        let req = Request::post("/")
            .body(frames_body(vec![
                data(&body.as_bytes()[..10]),
                data(&body.as_bytes()[10..]),
                Ok(Frame::trailers(trailers.clone())),
            ]))
            .unwrap();
        let (_, _, seen) = through(bypass().json_guard(), req).await;
        let seen = seen.unwrap();
        assert_eq!(seen.body(), STRIPPED);
        assert_eq!(seen.trailers.as_ref(), Some(&trailers));
    }
}

#[tokio::test]
async fn a_failing_body_gets_400() {
    let req = Request::post("/")
        .body(frames_body(vec![data("{"), Err("connection reset".into())]))
        .unwrap();
    let (res, _, seen) = through(bypass().json_guard(), req).await;
    assert_eq!(
        error_code(&res),
        (StatusCode::BAD_REQUEST, "body_read_error".into())
    );
    assert!(seen.is_none());
}

/// An upstream that streams Dynamo's marker first, whatever it is asked.
async fn sse_upstream(
    _req: Request<JsonGuardBody<Full<Bytes>>>,
) -> Result<Response<Full<Bytes>>, BoxError> {
    Ok(serve::event_stream(Full::new(Bytes::from(format!(
        "{}data: 1\n\n",
        serve::MARKER
    )))))
}

async fn streamed<S, B>(svc: S, body: &'static str) -> Bytes
where
    S: tower::Service<Request<Full<Bytes>>, Response = Response<B>>,
    S::Error: std::fmt::Debug,
    B: Body,
    B::Error: std::fmt::Debug,
{
    let res = svc.oneshot(json(body)).await.unwrap();
    read_all(res.into_body()).await.0
}

#[tokio::test]
async fn either_layer_order_grants_the_opt_in() {
    let bypass = bypass();
    let asked = r#"{"nvext":{"annotations":["x-bypass-remote-prefill"]}}"#;
    let not_asked = r#"{"nvext":{"annotations":["x-bypass-remote-prefill:true"]}}"#;
    let with_marker = format!("{}data: 1\n\n", serve::MARKER);

    let guard_outside = ServiceBuilder::new()
        .layer(bypass.json_guard())
        .layer(bypass.clone())
        .service_fn(sse_upstream);
    assert_eq!(streamed(guard_outside.clone(), asked).await, with_marker);
    assert_eq!(streamed(guard_outside, not_asked).await, "data: 1\n\n");

    // The response layer outside: it finds the opt-in in the response's extensions.
    let guard_inside = ServiceBuilder::new()
        .layer(bypass.clone())
        .layer(bypass.json_guard())
        .service_fn(sse_upstream);
    assert_eq!(streamed(guard_inside.clone(), asked).await, with_marker);
    assert_eq!(streamed(guard_inside, not_asked).await, "data: 1\n\n");
}

#[test]
fn the_response_body_of_a_refusal_is_exact() {
    // ResponseBody is nameable and its refusal has an exact size hint (checked through a 413).
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        let upstream = service_fn(|_req: Request<JsonGuardBody<Forever>>| async {
            Ok::<_, BoxError>(Response::new(Full::new(Bytes::new())))
        });
        let svc = ServiceBuilder::new()
            .layer(JsonGuardLayer::new().max_body_bytes(0))
            .service(upstream);
        let req = Request::post("/")
            .header(header::CONTENT_LENGTH, "1")
            .body(forever())
            .unwrap();
        let res: Response<ResponseBody<Full<Bytes>>> = svc.oneshot(req).await.unwrap();
        let body = res.into_body();
        let hint = body.size_hint();
        assert_eq!(Some(hint.lower()), hint.upper());
        let bytes = body.collect().await.unwrap().to_bytes();
        assert_eq!(hint.lower(), bytes.len() as u64);
    });
}

/// The sans-IO `RequestGuard` decides what `JsonGuard` does, request for request: the same
/// refusal (status and body), the same bytes forwarded, the same opt-in.
#[tokio::test]
async fn the_request_guard_decides_as_the_middleware_does() {
    use tower_bypass_marker::sans_io::{BodyDecision, HeadDecision};

    let cases: &[(&[(&str, &str)], &str)] = &[
        (&[("content-type", "application/json")], WITH_MARKER),
        (&[("content-type", "application/json")], r#"{"model":"m"}"#),
        (
            &[("content-type", "application/json")],
            r#"{"nvext":{"annotations":["request_id","llm_metrics"]}}"#,
        ),
        (&[("content-type", "application/json")], "{"),
        (&[("content-type", "application/json")], r#"{"nvext":1}"#),
        (
            &[("content-type", "application/json")],
            r#"{"nvext":{},"nv\u0065xt":{}}"#,
        ),
        (
            &[
                ("content-type", "application/json"),
                ("content-encoding", "gzip"),
            ],
            WITH_MARKER,
        ),
        (
            &[
                ("content-type", "application/json"),
                ("content-length", "999999999999"),
            ],
            WITH_MARKER,
        ),
        (&[("content-type", "text/plain")], WITH_MARKER),
        (&[], WITH_MARKER),
        (&[("content-type", "application/json")], "[1,2]"),
    ];
    let layer = bypass();
    let guard = layer.request_guard();
    for (headers, body) in cases {
        let mut req = Request::post("/v1/chat/completions")
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .unwrap();
        for (k, v) in *headers {
            req.headers_mut().append(
                header::HeaderName::from_static(k),
                HeaderValue::from_static(v),
            );
        }
        let sans_io = match guard.check_head(req.headers(), false) {
            HeadDecision::Skip => Ok((Bytes::from_static(body.as_bytes()), None)),
            HeadDecision::Refuse(refusal) => Err(refusal),
            HeadDecision::Read => match guard.check_body(Bytes::from_static(body.as_bytes())) {
                BodyDecision::Forward { granted } => {
                    Ok((Bytes::from_static(body.as_bytes()), Some(granted)))
                }
                BodyDecision::Splice { body, granted } => {
                    Ok((Bytes::from(body.to_vec()), Some(granted)))
                }
                BodyDecision::Refuse(refusal) => Err(refusal),
                other => panic!("{body}: a decision this test does not know: {other:?}"),
            },
            other => panic!("{body}: a decision this test does not know: {other:?}"),
        };
        let (res, _, seen) = through(layer.json_guard(), req).await;
        match sans_io {
            Ok((forwarded, granted)) => {
                let seen = seen.unwrap_or_else(|| panic!("{body}: refused by the middleware"));
                assert_eq!(seen.body(), forwarded, "{body}");
                let granted = granted.filter(|g| !g.is_empty());
                assert_eq!(seen.granted, granted, "{body}");
            }
            Err(refusal) => {
                assert!(seen.is_none(), "{body}: forwarded by the middleware");
                assert_eq!(res.status(), refusal.status(), "{body}");
                assert_eq!(res.body(), &refusal.body(), "{body}");
                assert_eq!(error_code(&res).1, refusal.code());
            }
        }
    }
}

/// Only the body says it is empty: a `content-length: 0` (or `+0`) header in front of a JSON body
/// with the marker does not get the body past the guard unread (a middleware may have rewritten
/// the body, or a host may not check the header against it).
#[tokio::test]
async fn a_content_length_of_zero_does_not_skip_a_body_that_has_bytes() {
    for length in ["0", "+0"] {
        let mut req = json(WITH_MARKER);
        req.headers_mut()
            .insert(header::CONTENT_LENGTH, HeaderValue::from_static(length));
        let (_, _, seen) = through(bypass().json_guard(), req).await;
        assert_eq!(seen.unwrap().body(), STRIPPED, "content-length: {length}");
    }
}
