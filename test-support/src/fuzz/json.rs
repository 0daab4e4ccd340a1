//! The JSON request guard (`json` feature) on arbitrary bytes: decoding, the driver and the
//! oracle, shared by the `json` target and `tests/fuzz_regressions.rs`. See FUZZING.md.
//!
//! Input: byte 0 flags (`0x01` chunked by byte 1, `0x02` no `content-type`, `0x04` limit = byte 2,
//! `0x08` a `content-length` header, `0x10` the marker is never-forwarded), then the body.

use std::convert::Infallible;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http::{header, Request, Response, StatusCode};
use http_body::Body;
use serde_json::Value;
use tower::{service_fn, Layer, Service};
use tower_bypass_marker::json::JsonGuardBody;

use crate::body::Chunks;
use tower_bypass_marker::{BypassMarkerLayer, RequestedAnnotations};

fn layer(flags: u8) -> BypassMarkerLayer {
    let layer = BypassMarkerLayer::new()
        .router_owned("x-prefill-continue")
        .opt_in("request_id")
        .never_forward("llm_metrics");
    if flags & 0x10 != 0 {
        layer.never_forward("x-bypass-remote-prefill")
    } else {
        layer
    }
}

/// Whether `guard_annotations` strips `entry`.
fn is_stripped(layer: &BypassMarkerLayer, entry: &str) -> bool {
    let mut one = vec![entry.to_owned()];
    layer.guard_annotations(&mut one);
    one.is_empty()
}

/// The string entries of a document's top-level `nvext.annotations` (none if it is not an
/// array).
pub fn annotation_strings(doc: &Value) -> Vec<String> {
    doc.get("nvext")
        .and_then(|n| n.get("annotations"))
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|e| e.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

type Seen = Option<(Vec<Bytes>, Option<RequestedAnnotations>)>;

/// Runs `body` through the guard; returns the status, the guard's own JSON (if it answered) and
/// what the upstream got (if it was called).
fn run(
    layer: &BypassMarkerLayer,
    max: usize,
    chunks: Vec<Bytes>,
    content_type: bool,
    content_length: Option<usize>,
) -> (StatusCode, Option<Value>, Seen) {
    let seen = Arc::new(Mutex::new(None));
    let record = seen.clone();
    let upstream = service_fn(move |req: Request<JsonGuardBody<Chunks>>| {
        let record = record.clone();
        async move {
            let granted = req.extensions().get::<RequestedAnnotations>().cloned();
            let mut body = std::pin::pin!(req.into_body());
            let mut frames = Vec::new();
            let mut cx = Context::from_waker(Waker::noop());
            while let Poll::Ready(Some(frame)) = body.as_mut().poll_frame(&mut cx) {
                frames.push(frame.unwrap().into_data().expect("only data"));
            }
            assert!(body.is_end_stream());
            *record.lock().unwrap() = Some((frames, granted));
            Ok::<_, Infallible>(Response::new(Chunks::default()))
        }
    });
    let mut svc = layer.json_guard().max_body_bytes(max).layer(upstream);
    let mut req = Request::post("/v1/chat/completions");
    if content_type {
        req = req.header(header::CONTENT_TYPE, "application/json");
    }
    if let Some(len) = content_length {
        req = req.header(header::CONTENT_LENGTH, len);
    }
    let req = req.body(Chunks::new(chunks)).unwrap();
    let mut cx = Context::from_waker(Waker::noop());
    assert!(svc.poll_ready(&mut cx).is_ready());
    let mut fut = std::pin::pin!(svc.call(req));
    let Poll::Ready(res) = fut.as_mut().poll(&mut cx) else {
        panic!("the guard waited on a body that was all there");
    };
    let res = res.unwrap();
    let status = res.status();
    let mut body = std::pin::pin!(res.into_body());
    let mut json = Vec::new();
    while let Poll::Ready(Some(frame)) = body.as_mut().poll_frame(&mut cx) {
        json.extend_from_slice(&frame.unwrap().into_data().unwrap());
    }
    let answer = (!json.is_empty()).then(|| serde_json::from_slice(&json).unwrap());
    let seen = seen.lock().unwrap().take();
    (status, answer, seen)
}

/// Decodes `data`, runs it and checks the outcome.
pub fn check(data: &[u8]) {
    let flags = data.first().copied().unwrap_or(0);
    let chunk = data.get(1).copied().unwrap_or(0) as usize;
    let body = data.get(3..).unwrap_or_default();
    let max = if flags & 0x04 != 0 {
        data.get(2).copied().unwrap_or(0) as usize
    } else {
        1 << 20
    };
    let layer = layer(flags);
    let whole = Bytes::copy_from_slice(body);
    let chunks: Vec<Bytes> = if flags & 0x01 != 0 && chunk > 0 {
        body.chunks(chunk).map(Bytes::copy_from_slice).collect()
    } else if body.is_empty() {
        Vec::new()
    } else {
        vec![whole.clone()]
    };
    let one_chunk = chunks.len() == 1;
    let first_ptr = chunks.first().map(|c| c.as_ptr());
    let content_length = (flags & 0x08 != 0).then_some(body.len());
    let (status, answer, seen) = run(&layer, max, chunks, flags & 0x02 == 0, content_length);

    if body.len() > max {
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    }
    if let Some(answer) = &answer {
        assert!(seen.is_none(), "answered and called the upstream");
        assert_eq!(answer["error"]["type"], "invalid_request_error");
        assert!(answer["error"]["message"].is_string());
        let code = answer["error"]["code"].as_str().unwrap();
        let expected = match code {
            "request_too_large" => StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_json" | "duplicate_key" | "invalid_nvext" => StatusCode::BAD_REQUEST,
            _ => panic!("unexpected code {code}"),
        };
        assert_eq!(status, expected);
        if code == "invalid_json" {
            // serde_json agrees (it also refuses lone surrogates in strings the guard does not
            // decode, and numbers out of f64's range, which the guard accepts: never the reverse).
            assert!(
                serde_json::from_slice::<Value>(body).is_err(),
                "valid JSON refused"
            );
        }
        return;
    }
    assert_eq!(status, StatusCode::OK);
    let (frames, granted) = seen.expect("forwarded");
    let out: Vec<u8> = frames.concat();
    if body.is_empty() {
        assert!(out.is_empty());
        return;
    }
    // Only what serde_json accepts is accepted: UTF-8, RFC 8259 grammar (serde_json's skipping,
    // like the guard's, lets lone surrogates and numbers out of f64's range through), nesting
    // within its recursion limit. What is forwarded is JSON too.
    std::str::from_utf8(body).expect("accepted a body that is not UTF-8");
    serde_json::from_slice::<&serde_json::value::RawValue>(body).expect("accepted invalid JSON");
    if let Err(e) = serde_json::from_slice::<Value>(body) {
        assert!(
            !e.to_string().starts_with("recursion limit exceeded"),
            "accepted nesting past the limit"
        );
    }
    serde_json::from_slice::<&serde_json::value::RawValue>(&out).expect("forwards JSON");
    let Ok(input) = serde_json::from_slice::<Value>(body) else {
        // serde_json's `Value` refuses numbers out of range and lone surrogates: the rest of the
        // oracle needs it.
        return;
    };
    let output: Value = serde_json::from_slice(&out).expect("forwards what it read");
    for entry in annotation_strings(&output) {
        assert!(
            !is_stripped(&layer, &entry),
            "{entry:?} reached the upstream"
        );
    }
    let mut expected = input.clone();
    let mut stripped_any = false;
    if let Some(a) = expected
        .get_mut("nvext")
        .and_then(|n| n.get_mut("annotations"))
        .and_then(Value::as_array_mut)
    {
        a.retain(|e| {
            let strip = e.as_str().is_some_and(|s| is_stripped(&layer, s));
            stripped_any |= strip;
            !strip
        });
    }
    assert_eq!(output, expected);
    if !stripped_any {
        assert_eq!(out, body, "bytes changed with nothing stripped");
        if one_chunk {
            assert_eq!(frames.len(), 1);
            assert_eq!(Some(frames[0].as_ptr()), first_ptr, "copied");
        }
    }
    if input.is_object() {
        let mut entries = annotation_strings(&input);
        let expected = layer.guard_annotations(&mut entries);
        assert_eq!(granted.unwrap_or_default(), expected);
    } else {
        assert!(granted.is_none());
    }
    // Guarding what was forwarded changes nothing.
    let (status, _, again) = run(
        &layer,
        usize::MAX,
        vec![Bytes::from(out.clone())],
        true,
        None,
    );
    assert_eq!(status, StatusCode::OK);
    assert_eq!(again.unwrap().0.concat(), out);
}
