//! Copies made by the JSON request guard (`json` feature), counted by a global allocator in this
//! test binary: guarding a 1 MiB body allocates a few hundred bytes (the request's bookkeeping and,
//! when something is stripped, the new array), never a copy of the body.
#![cfg(feature = "json")]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::convert::Infallible;

use bytes::Bytes;
use futures_util::FutureExt;
use http::{header, Request, Response};
use http_body::Body;
use http_body_util::Full;
use tower::{service_fn, Layer, Service};
use tower_bypass_marker::json::JsonGuardBody;
use tower_bypass_marker::BypassMarkerLayer;

/// Counts the bytes each thread allocates, so tests running in parallel do not see each other's.
struct Counting;

thread_local! {
    static BYTES: Cell<u64> = const { Cell::new(0) };
}

fn count(n: usize) {
    let _ = BYTES.try_with(|b| b.set(b.get() + n as u64));
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        System.alloc_zeroed(layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size);
        System.realloc(ptr, layout, new_size)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocated() -> u64 {
    BYTES.with(Cell::get)
}

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
    let before = allocated();
    let res = svc.call(req).now_or_never().unwrap().unwrap();
    let after = allocated();
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
