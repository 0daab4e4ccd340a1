//! Hang detector for the scanner's worst cases: adversarial 4 MiB bodies go through the public
//! body in one chunk (and in 64 KiB chunks) and must come out in well under the bound. A linear
//! scan takes well under a second even in a debug build; the quadratic scans this guards against
//! took minutes. This is not a performance claim (see BENCHMARKS.md for those): the bound is
//! generous so that a slow or busy machine never fails it, only an algorithm that is not linear.

use std::convert::Infallible;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, Request, Response};
use http_body_util::BodyExt;
use test_support::body::Chunks;
use test_support::model::remove_all;
use tower::{service_fn, Layer, ServiceExt};
use tower_bypass_marker::BypassMarkerLayer;

const MIB: usize = 1024 * 1024;
const MARKER: &[u8] = b"event: x-bypass-remote-prefill\n: true\n\n";
/// The bound for one body. A linear scan of 4 MiB takes well under a second in a debug build.
const BOUND: Duration = Duration::from_secs(20);

/// `unit` repeated to `frames_len` bytes, then `tail` repeated to `tail_len` bytes.
fn shape(unit: &[u8], frames_len: usize, tail: &[u8], tail_len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(frames_len + tail_len + unit.len() + tail.len());
    while out.len() < frames_len {
        out.extend_from_slice(unit);
    }
    let start = out.len();
    while out.len() - start < tail_len {
        out.extend_from_slice(tail);
    }
    out
}

/// Every adversarial shape, about 4 MiB each: (name, body, the bytes the layer must yield).
fn shapes() -> Vec<(&'static str, Vec<u8>, Vec<u8>)> {
    let mut out = Vec::new();
    // Kept frames with an `event` field, then a long frame that is still open at the end.
    let frames = b"event: message\ndata: x\n\n";
    let body = shape(frames, 2 * MIB, b"data: x\n", 2 * MIB);
    out.push(("frames then an open frame", body.clone(), body));
    // The same with CR-only line ends.
    let body = shape(
        b"event: message\rdata: x\r\r",
        2 * MIB,
        b"data: x\r",
        2 * MIB,
    );
    out.push(("CR-only frames then an open frame", body.clone(), body));
    // Removed frames, then a long `data` line with no line end at all.
    let mut body = shape(MARKER, 2 * MIB, b"", 0);
    let mut tail = b"data: ".to_vec();
    tail.resize(2 * MIB, b'x');
    body.extend_from_slice(&tail);
    out.push(("removed frames then a long open line", body, tail));
    // Removed and kept frames alternating, then a long open frame.
    let unit = [MARKER, b"data: 1\n\n"].concat();
    let body = shape(&unit, 2 * MIB, b"data: x\n", 2 * MIB);
    let expected = remove_all(&body, MARKER);
    out.push(("removed and kept frames then an open frame", body, expected));
    // `event:` inside data lines, then a long open line.
    let body = shape(b"data: event: x\n\n", 2 * MIB, b"data: x\n", 2 * MIB);
    out.push(("event: inside data then an open frame", body.clone(), body));
    out
}

async fn filter(chunks: Vec<Bytes>) -> Vec<u8> {
    let svc = BypassMarkerLayer::new()
        .max_frame_bytes(8 * MIB)
        .layer(service_fn(move |_req: Request<()>| {
            let chunks = chunks.clone();
            async move {
                Ok::<_, Infallible>(
                    Response::builder()
                        .header(header::CONTENT_TYPE, "text/event-stream")
                        .body(Chunks::new(chunks))
                        .unwrap(),
                )
            }
        }));
    let res = svc.oneshot(Request::new(())).await.unwrap();
    res.into_body().collect().await.unwrap().to_bytes().to_vec()
}

#[tokio::test]
async fn adversarial_bodies_pass_in_linear_time() {
    for (name, body, expected) in shapes() {
        for chunk_len in [body.len(), 64 * 1024] {
            let chunks: Vec<Bytes> = body.chunks(chunk_len).map(Bytes::copy_from_slice).collect();
            let start = Instant::now();
            let out = filter(chunks).await;
            let took = start.elapsed();
            eprintln!("{name}, {chunk_len}-byte chunks: {took:?}");
            assert!(
                out == expected,
                "{name}, {chunk_len}-byte chunks: wrong output"
            );
            assert!(
                took < BOUND,
                "{name}, {chunk_len}-byte chunks: {took:?} for {} bytes (bound {BOUND:?})",
                body.len()
            );
        }
    }
}
