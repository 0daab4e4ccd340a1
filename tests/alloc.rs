//! Allocations and copies of a filtering body, counted by a global allocator in this test binary.
//!
//! The crate's promise (module docs, "Latency, copies and memory"): forwarded data are slices of
//! the inner body's `Bytes`, a chunk made of whole kept frames is forwarded as that same `Bytes`,
//! and only a frame that spans chunks is copied. Here "the same" is checked by pointer and length,
//! and "without allocating" by counting every allocation the polling thread makes.

use std::convert::Infallible;
use std::future::Future;
use std::pin::{pin, Pin};
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::task::noop_waker_ref;
use http::{header, Request, Response};
use http_body::Body;
use test_support::alloc::{allocations, Counting};
use test_support::body::Chunks;
use tower::{service_fn, Layer, ServiceExt};
use tower_bypass_marker::{BypassMarkerBody, BypassMarkerLayer};

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const MARKER: &str = "event: x-bypass-remote-prefill\n: true\n\n";

fn chat(i: usize) -> String {
    format!(
        "data: {{\"id\":\"chatcmpl-{i}\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"token {i}\"}}}}]}}\n\n"
    )
}

/// Cuts `pieces` out of one buffer, as a network read buffer is cut into chunks, and returns the
/// chunks (clones of them, for the test to compare pointers with, are the second item).
fn chunks(pieces: &[&str]) -> (Chunks, Vec<Bytes>) {
    let all = Bytes::from(pieces.concat());
    let mut at = 0;
    let chunks: Vec<Bytes> = pieces
        .iter()
        .map(|p| {
            let chunk = all.slice(at..at + p.len());
            at += p.len();
            chunk
        })
        .collect();
    (Chunks::new(chunks.iter().cloned()), chunks)
}

/// The filtering body the default layer makes for a `text/event-stream` response with `body`.
fn filtered(body: Chunks) -> BypassMarkerBody<Chunks> {
    let mut body = Some(body);
    let upstream = service_fn(move |_req: Request<()>| {
        let res = Response::builder()
            .header(header::CONTENT_TYPE, "text/event-stream")
            .body(body.take().expect("called once"))
            .unwrap();
        std::future::ready(Ok::<_, Infallible>(res))
    });
    let svc = BypassMarkerLayer::new().layer(upstream);
    let mut cx = Context::from_waker(noop_waker_ref());
    let Poll::Ready(Ok(res)) = pin!(svc.oneshot(Request::new(()))).poll(&mut cx) else {
        panic!("the upstream answers at once");
    };
    let body = res.into_body();
    assert!(body.is_filtering());
    body
}

/// Polls one frame and returns its data, with the number of allocations the poll made.
fn next_data(body: &mut Pin<&mut BypassMarkerBody<Chunks>>) -> (Option<Bytes>, u64) {
    let mut cx = Context::from_waker(noop_waker_ref());
    let before = allocations();
    let polled = body.as_mut().poll_frame(&mut cx);
    let allocated = allocations() - before;
    let data = match polled {
        Poll::Ready(Some(Ok(frame))) => Some(frame.into_data().expect("a data frame")),
        Poll::Ready(None) => None,
        other => panic!("unexpected poll: {other:?}"),
    };
    (data, allocated)
}

fn is_slice_of(data: &Bytes, chunk: &Bytes, offset: usize) -> bool {
    data.as_ptr() == chunk[offset..].as_ptr() && chunk[offset..].starts_with(data)
}

fn points_into(data: &Bytes, chunk: &Bytes) -> bool {
    let range = chunk.as_ptr_range();
    range.contains(&data.as_ptr())
}

#[test]
fn chunks_of_whole_kept_frames_are_forwarded_as_the_same_bytes_without_allocating() {
    let first = format!("{MARKER}{}", chat(0));
    let second = chat(1);
    let third = format!("{}{}{}", chat(2), chat(3), chat(4));
    let sixteen: String = (5..21).map(chat).collect();
    let (body, inputs) = chunks(&[&first, &second, &third, &sixteen]);
    let mut body = pin!(filtered(body));

    // The marker chunk: the marker is dropped, the rest is forwarded as a slice of that chunk.
    let (data, allocated) = next_data(&mut body);
    let data = data.unwrap();
    assert!(is_slice_of(&data, &inputs[0], MARKER.len()));
    assert_eq!(data.len(), inputs[0].len() - MARKER.len());
    assert_eq!(allocated, 0, "removing a leading marker allocated");

    for input in &inputs[1..] {
        let (data, allocated) = next_data(&mut body);
        let data = data.unwrap();
        assert_eq!(
            data.as_ptr(),
            input.as_ptr(),
            "a whole-frame chunk was copied"
        );
        assert_eq!(data.len(), input.len());
        assert_eq!(allocated, 0, "forwarding a whole-frame chunk allocated");
    }

    let (end, allocated) = next_data(&mut body);
    assert!(end.is_none());
    assert_eq!(allocated, 0, "ending the body allocated");
}

#[test]
fn a_marker_inside_a_chunk_is_cut_out_by_slicing_without_allocating() {
    let before = chat(1);
    let after = format!("{}{}", chat(2), chat(3));
    let middle = format!("{before}{MARKER}{after}");
    let (body, inputs) = chunks(&[&chat(0), &middle]);
    let mut body = pin!(filtered(body));

    let (data, _) = next_data(&mut body);
    assert_eq!(data.unwrap().as_ptr(), inputs[0].as_ptr());

    let (head, head_allocated) = next_data(&mut body);
    let (tail, tail_allocated) = next_data(&mut body);
    let (head, tail) = (head.unwrap(), tail.unwrap());
    assert!(is_slice_of(&head, &inputs[1], 0));
    assert_eq!(head, before.as_bytes());
    assert!(is_slice_of(&tail, &inputs[1], before.len() + MARKER.len()));
    assert_eq!(tail, after.as_bytes());
    assert_eq!(
        head_allocated + tail_allocated,
        0,
        "cutting out a marker allocated"
    );
}

#[test]
fn only_a_frame_that_spans_chunks_is_copied() {
    // "data: b..." starts at the end of the first chunk and ends in the second.
    let b = chat(1);
    let (b_head, b_tail) = b.split_at(20);
    let first = format!("{}{b_head}", chat(0));
    let second = format!("{b_tail}{}", chat(2));
    let third = chat(3);
    let (body, inputs) = chunks(&[&first, &second, &third]);
    let mut body = pin!(filtered(body));

    // The whole frame before the split is a slice of the first chunk. (The same poll starts holding
    // the spanning frame, which may allocate.)
    let (a, _) = next_data(&mut body);
    let a = a.unwrap();
    assert!(is_slice_of(&a, &inputs[0], 0));
    assert_eq!(a, chat(0).as_bytes());

    // The spanning frame is the one copy: its bytes live in neither chunk.
    let (spanning, _) = next_data(&mut body);
    let spanning = spanning.unwrap();
    assert_eq!(spanning, b.as_bytes());
    assert!(!points_into(&spanning, &inputs[0]) && !points_into(&spanning, &inputs[1]));

    // What follows it in the second chunk is a slice again, and so is the next whole chunk.
    let (c, allocated) = next_data(&mut body);
    let c = c.unwrap();
    assert!(is_slice_of(&c, &inputs[1], b_tail.len()));
    assert_eq!(c, chat(2).as_bytes());
    assert_eq!(allocated, 0);
    let (d, allocated) = next_data(&mut body);
    assert_eq!(d.unwrap().as_ptr(), inputs[2].as_ptr());
    assert_eq!(allocated, 0);
    assert!(next_data(&mut body).0.is_none());
}

#[test]
fn a_marker_that_spans_chunks_is_dropped_and_what_follows_is_not_copied() {
    let (m_head, m_tail) = MARKER.split_at(34);
    let second = format!("{m_tail}{}", chat(0));
    let (body, inputs) = chunks(&[m_head, &second, &chat(1)]);
    let mut body = pin!(filtered(body));

    // Holding the marker's first bytes may allocate; what follows the marker is not copied.
    let (data, _) = next_data(&mut body);
    let data = data.unwrap();
    assert!(is_slice_of(&data, &inputs[1], m_tail.len()));
    assert_eq!(data, chat(0).as_bytes());
    let (next, allocated) = next_data(&mut body);
    assert_eq!(next.unwrap().as_ptr(), inputs[2].as_ptr());
    assert_eq!(allocated, 0);
    assert!(next_data(&mut body).0.is_none());
}

#[test]
fn the_counter_sees_this_threads_allocations() {
    let before = allocations();
    let v = std::hint::black_box(vec![0u8; 64]);
    assert_eq!(allocations() - before, 1);
    drop(v);
}
