//! Copies made by the JSON request guard (`json` feature), counted by a global allocator in this
//! test binary: guarding a 1 MiB body allocates a few hundred bytes (the request's bookkeeping and,
//! when something is stripped, the new array), never a copy of the body.
#![cfg(feature = "json")]

use std::convert::Infallible;
use test_support::alloc::{bytes_allocated, Counting};

use bytes::Bytes;
use futures_util::FutureExt;
use http::{header, Request, Response};
use http_body::Body;
use http_body_util::Full;
use tower::{service_fn, Layer, Service};
use tower_bypass_marker::json::JsonGuardBody;
use tower_bypass_marker::BypassMarkerLayer;

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// A 1 MiB JSON body: a long base64 string, then `nvext.annotations`.
fn big(annotations: &str) -> Bytes {
    Bytes::from(format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}],"nvext":{{"annotations":{annotations}}}}}"#,
        "QUJD".repeat(256 * 1024)
    ))
}

/// Guards `body` (in one chunk) for an upstream that reads the forwarded body and checks its
/// length; returns the bytes the guard and the upstream allocated.
fn guard(body: Bytes, forwarded: usize) -> u64 {
    let bypass = BypassMarkerLayer::new().opt_in("request_id");
    let upstream = service_fn(move |req: Request<JsonGuardBody<Full<Bytes>>>| async move {
        let mut body = std::pin::pin!(req.into_body());
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let mut len = 0;
        while let std::task::Poll::Ready(Some(frame)) = body.as_mut().poll_frame(&mut cx) {
            len += frame.unwrap().into_data().unwrap().len();
        }
        assert_eq!(len, forwarded);
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    });
    let mut svc = bypass.json_guard().layer(upstream);
    let req = Request::post("/")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))
        .unwrap();
    let before = bytes_allocated();
    let res = svc.call(req).now_or_never().unwrap().unwrap();
    let after = bytes_allocated();
    assert_eq!(res.status(), 200);
    after - before
}

#[test]
fn guarding_a_megabyte_copies_none_of_it() {
    let body = big(r#"["request_id","other"]"#);
    assert!(body.len() > 1 << 20);
    let bytes = guard(body.clone(), body.len());
    assert!(
        bytes < 4096,
        "allocated {bytes} bytes for a body of {}",
        body.len()
    );

    // Stripping allocates the new array, not the body.
    let body = big(r#"["request_id","x-bypass-remote-prefill:true"]"#);
    let stripped = r#","x-bypass-remote-prefill:true""#.len();
    let bytes = guard(body.clone(), body.len() - stripped);
    assert!(
        bytes < 4096,
        "allocated {bytes} bytes for a body of {}",
        body.len()
    );
}
