//! The sans-IO `EventStreamFilter` is the tower body's engine: for any input, configuration and
//! chunking it outputs the same bytes as `BypassMarkerBody`, after every chunk and at the end.

use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http::{header, HeaderMap, Method, StatusCode};
use http_body::Body;
use proptest::prelude::*;
use test_support::body::{cut, data, response, through, Gated};
use test_support::fuzz::body::ready;
use test_support::fuzz::filter::{finish, push_chunk};
use tower_bypass_marker::sans_io::FilterOutput;
use tower_bypass_marker::{BypassMarkerLayer, FrameObserver, Overflow, RequestedAnnotations};

const PIECES: &[&[u8]] = &[
    b"event: x-bypass-remote-prefill\n",
    b": true\n",
    b"\n",
    b"\r\n",
    b"\r",
    b"event: request_id\n: \"r-1\"\n\n",
    b"event: llm_metrics\n",
    b"data: {\"id\":1}\n\n",
    b"data: [DONE]\n\n",
    b"id: 7\n",
    b"\xEF\xBB\xBF",
    b"event: message\ndata: x\n\n",
    b": keep-alive\n\n",
    b"data: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
];

fn layer(sdk_safe: bool, cap: usize, overflow_error: bool) -> BypassMarkerLayer {
    BypassMarkerLayer::new()
        .opt_in("request_id")
        .never_forward("llm_metrics")
        .sdk_safe(sdk_safe)
        .max_frame_bytes(cap)
        .on_overflow(if overflow_error {
            Overflow::Error
        } else {
            Overflow::Forward
        })
}

/// What a driver sees: the output after each chunk, and how it ended.
#[derive(Debug, PartialEq, Eq)]
struct Run {
    after_each: Vec<Vec<u8>>,
    failed: bool,
}

fn through_body(
    layer: &BypassMarkerLayer,
    requested: &RequestedAnnotations,
    chunks: &[Bytes],
) -> Run {
    let gated = Gated::default();
    let upstream = response("text/event-stream", gated.clone());
    let res = ready(through(layer, Some(requested.clone()), upstream));
    let mut body = pin!(res.into_body());
    let mut cx = Context::from_waker(Waker::noop());
    let mut out = Vec::new();
    let mut run = Run {
        after_each: Vec::new(),
        failed: false,
    };
    let mut drain = |out: &mut Vec<u8>, run: &mut Run| loop {
        match body.as_mut().poll_frame(&mut cx) {
            Poll::Ready(Some(Ok(frame))) => out.extend_from_slice(&frame.into_data().unwrap()),
            Poll::Ready(Some(Err(_))) => {
                run.failed = true;
                return true;
            }
            Poll::Ready(None) => return true,
            Poll::Pending => return false,
        }
    };
    for chunk in chunks {
        gated.push(data(chunk.clone()));
        if drain(&mut out, &mut run) {
            run.after_each.push(out.clone());
            return run;
        }
        run.after_each.push(out.clone());
    }
    gated.close();
    drain(&mut out, &mut run);
    run.after_each.push(out);
    run
}

fn through_filter(
    layer: &BypassMarkerLayer,
    requested: &RequestedAnnotations,
    chunks: &[Bytes],
) -> Run {
    let mut headers = HeaderMap::new();
    headers.insert(header::CONTENT_TYPE, "text/event-stream".parse().unwrap());
    let mut run = Run {
        after_each: Vec::new(),
        failed: false,
    };
    let mut out = Vec::new();
    let Some(mut filter) =
        layer.response_filter(&Method::POST, StatusCode::OK, &headers, requested)
    else {
        // Passed through: the body's output is its input.
        for chunk in chunks {
            out.extend_from_slice(chunk);
            run.after_each.push(out.clone());
        }
        run.after_each.push(out);
        return run;
    };
    for chunk in chunks {
        if push_chunk(&mut filter, chunk.clone(), &mut out).is_err() {
            run.failed = true;
            run.after_each.push(out);
            return run;
        }
        run.after_each.push(out.clone());
    }
    run.failed = finish(&mut filter, &mut out).is_err();
    assert_eq!(filter.poll_output(), Ok(FilterOutput::End), "End is sticky");
    run.after_each.push(out);
    run
}

proptest! {
    #[test]
    fn the_filter_outputs_what_the_body_yields_after_every_chunk(
        pieces in prop::collection::vec(0..PIECES.len(), 0..30),
        cuts in prop::collection::vec(any::<usize>(), 0..10),
        sdk_safe in any::<bool>(),
        small_cap in any::<bool>(),
        overflow_error in any::<bool>(),
        asked in prop::collection::vec(any::<bool>(), 3),
    ) {
        let input: Vec<u8> = pieces.iter().flat_map(|&p| PIECES[p].iter().copied()).collect();
        let chunks = cut(&input, &cuts);
        let layer = layer(sdk_safe, if small_cap { 40 } else { 1 << 20 }, overflow_error);
        let requested: RequestedAnnotations = ["x-bypass-remote-prefill", "request_id", "llm_metrics"]
            .into_iter()
            .zip(asked)
            .filter(|(_, a)| *a)
            .map(|(n, _)| n)
            .collect();
        let body = through_body(&layer, &requested, &chunks);
        let filter = through_filter(&layer, &requested, &chunks);
        prop_assert_eq!(body, filter);
    }
}

#[test]
fn every_split_of_the_marker_across_two_chunks_gives_the_bodys_bytes() {
    let input = b"event: x-bypass-remote-prefill\r\n: true\r\n\r\ndata: {\"a\":1}\n\n".as_slice();
    let layer = BypassMarkerLayer::dynamo();
    let none = RequestedAnnotations::new();
    for at in 0..=input.len() {
        let chunks = [
            Bytes::copy_from_slice(&input[..at]),
            Bytes::copy_from_slice(&input[at..]),
        ];
        let filter = through_filter(&layer, &none, &chunks);
        assert_eq!(
            filter,
            through_body(&layer, &none, &chunks),
            "split at {at}"
        );
        assert_eq!(filter.after_each.last().unwrap(), b"data: {\"a\":1}\n\n");
    }
}

#[test]
fn a_chunk_of_whole_kept_frames_comes_back_as_the_same_bytes() {
    let layer = BypassMarkerLayer::new();
    let mut filter = layer
        .event_stream_filter(&RequestedAnnotations::new())
        .unwrap();
    let chunk = Bytes::from_static(
        b"data: {\"id\":\"chatcmpl-1\",\"choices\":[{\"delta\":{\"content\":\"Hello\"}}]}\n\n",
    );
    filter.push(chunk.clone());
    let FilterOutput::Data(out) = filter.poll_output().unwrap() else {
        panic!("expected data");
    };
    assert_eq!(out.as_ptr(), chunk.as_ptr(), "not copied");
    assert_eq!(out.len(), chunk.len());
    assert_eq!(filter.poll_output(), Ok(FilterOutput::NeedInput));
}

#[test]
fn held_bytes_are_bounded_by_the_cap_and_overflow_error_fails_the_filter() {
    let layer = BypassMarkerLayer::new()
        .max_frame_bytes(64)
        .on_overflow(Overflow::Error);
    let mut filter = layer
        .event_stream_filter(&RequestedAnnotations::new())
        .unwrap();
    filter.push(Bytes::from_static(b"data: open frame"));
    assert_eq!(filter.poll_output(), Ok(FilterOutput::NeedInput));
    assert_eq!(filter.held_bytes(), 16);
    filter.push(Bytes::from(vec![b'a'; 100]));
    let err = filter.poll_output().unwrap_err();
    assert_eq!(err.limit(), 64);
    assert_eq!(filter.held_bytes(), 0, "the frame's bytes are dropped");
    assert_eq!(filter.poll_output(), Ok(FilterOutput::End));
}

#[test]
#[should_panic(expected = "before poll_output returned NeedInput")]
fn pushing_before_the_previous_chunk_is_used_up_panics() {
    let layer = BypassMarkerLayer::new();
    let mut filter = layer
        .event_stream_filter(&RequestedAnnotations::new())
        .unwrap();
    filter.push(Bytes::from_static(
        b"data: 1\n\nevent: x-bypass-remote-prefill\n\ndata: 2\n\n",
    ));
    filter.push(Bytes::from_static(b"data: 3\n\n"));
}

#[test]
fn an_open_frame_is_judged_at_finish() {
    let layer = BypassMarkerLayer::new();
    let none = RequestedAnnotations::new();
    let out = layer
        .event_stream_filter(&none)
        .unwrap()
        .filter_all([&b"data: 1\n\nevent: x-bypass-remote-prefill\n: true"[..]])
        .unwrap();
    assert_eq!(out, b"data: 1\n\n");
    let out = layer
        .event_stream_filter(&none)
        .unwrap()
        .filter_all([&b"data: 1\n\ndata: 2"[..]])
        .unwrap();
    assert_eq!(out, b"data: 1\n\ndata: 2");
}

#[test]
fn response_filter_decides_from_the_head_as_the_layer_does() {
    let layer = BypassMarkerLayer::new();
    let none = RequestedAnnotations::new();
    let sse = |extra: &[(&str, &str)]| {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            "text/event-stream; charset=utf-8".parse().unwrap(),
        );
        for (k, v) in extra {
            h.append(
                header::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    };
    let post = Method::POST;
    assert!(layer
        .response_filter(&post, StatusCode::OK, &sse(&[]), &none)
        .is_some());
    assert!(layer
        .response_filter(&Method::HEAD, StatusCode::OK, &sse(&[]), &none)
        .is_none());
    assert!(layer
        .response_filter(&post, StatusCode::NO_CONTENT, &sse(&[]), &none)
        .is_none());
    assert!(layer
        .response_filter(&post, StatusCode::NOT_MODIFIED, &sse(&[]), &none)
        .is_none());
    assert!(layer
        .response_filter(
            &post,
            StatusCode::OK,
            &sse(&[("content-encoding", "gzip")]),
            &none
        )
        .is_none());
    assert!(layer
        .response_filter(
            &post,
            StatusCode::OK,
            &sse(&[("content-type", "application/json")]),
            &none
        )
        .is_none());
    // An error status with an event stream is still filtered.
    assert!(layer
        .response_filter(&post, StatusCode::BAD_GATEWAY, &sse(&[]), &none)
        .is_some());
    let asked: RequestedAnnotations = ["x-bypass-remote-prefill"].into_iter().collect();
    assert!(layer
        .response_filter(&post, StatusCode::OK, &sse(&[]), &asked)
        .is_none());
    // SDK-safe mode filters every event stream.
    let safe = BypassMarkerLayer::new().sdk_safe(true);
    assert!(safe
        .response_filter(&post, StatusCode::OK, &sse(&[]), &asked)
        .is_some());
}

#[derive(Default)]
struct Counts {
    removed: Mutex<Vec<(Option<String>, usize)>>,
    forwarded: Mutex<Vec<String>>,
    calls: AtomicU64,
}

impl FrameObserver for Counts {
    fn frame_removed(&self, annotation: Option<&str>, bytes: usize) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.removed
            .lock()
            .unwrap()
            .push((annotation.map(str::to_owned), bytes));
    }

    fn frame_forwarded(&self, annotation: &str) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.forwarded.lock().unwrap().push(annotation.to_owned());
    }
}

const OBSERVED: &[u8] = b"event: x-bypass-remote-prefill\n: true\n\nevent: request_id\n: \"r\"\n\nevent: llm_metrics\ndata: {}\n\nid: 1\n\ndata: ok\n\n";

#[test]
fn the_observer_is_told_of_each_removed_frame_with_its_name_and_length() {
    let counts = Arc::new(Counts::default());
    let layer = BypassMarkerLayer::new()
        .opt_in("request_id")
        .never_forward("llm_metrics")
        .sdk_safe(true)
        .observe(counts.clone());
    let none = RequestedAnnotations::new();
    // Byte by byte and whole: the same counts.
    for chunks in [vec![OBSERVED], OBSERVED.chunks(1).collect::<Vec<_>>()] {
        counts.removed.lock().unwrap().clear();
        let out = layer
            .event_stream_filter(&none)
            .unwrap()
            .filter_all(chunks)
            .unwrap();
        assert_eq!(out, b"data: ok\n\n");
        assert_eq!(
            *counts.removed.lock().unwrap(),
            [
                (Some("x-bypass-remote-prefill".to_owned()), 39),
                (Some("request_id".to_owned()), 25),
                (Some("llm_metrics".to_owned()), 29),
                (None, 7),
            ]
        );
    }
    assert!(counts.forwarded.lock().unwrap().is_empty());
}

#[test]
fn the_observer_counts_frames_forwarded_to_a_client_that_opted_in() {
    let counts = Arc::new(Counts::default());
    let layer = BypassMarkerLayer::new()
        .opt_in("request_id")
        .never_forward("llm_metrics")
        .observe(counts.clone());
    let asked: RequestedAnnotations = ["x-bypass-remote-prefill", "request_id", "llm_metrics"]
        .into_iter()
        .collect();
    let out = layer
        .event_stream_filter(&asked)
        .unwrap()
        .filter_all([OBSERVED])
        .unwrap();
    assert!(out.starts_with(b"event: x-bypass-remote-prefill\n: true\n\nevent: request_id"));
    assert_eq!(
        *counts.forwarded.lock().unwrap(),
        ["x-bypass-remote-prefill", "request_id"]
    );
    assert_eq!(
        *counts.removed.lock().unwrap(),
        [(Some("llm_metrics".to_owned()), 29)]
    );
    // Without an observer, a client that opted in to everything removable is passed through.
    let plain = BypassMarkerLayer::new();
    let marker: RequestedAnnotations = ["x-bypass-remote-prefill"].into_iter().collect();
    assert!(plain.event_stream_filter(&marker).is_none());
}

#[test]
fn the_tower_body_reports_to_the_observer_too() {
    let counts = Arc::new(Counts::default());
    let layer = BypassMarkerLayer::new().observe(counts.clone());
    let chunks: Vec<Bytes> = OBSERVED.chunks(5).map(Bytes::copy_from_slice).collect();
    through_body(&layer, &RequestedAnnotations::new(), &chunks);
    assert_eq!(
        *counts.removed.lock().unwrap(),
        [(Some("x-bypass-remote-prefill".to_owned()), 39)]
    );
    assert_eq!(counts.calls.load(Ordering::Relaxed), 1);
}

/// A chunk given as slices is filtered as one chunk: a frame that spans two slices is neither
/// copied nor held, a removed one goes wherever it lies, and what is open at the chunk's end is
/// held for the next chunk, whatever the cut.
#[test]
fn edit_of_a_chunk_in_slices_is_the_edit_of_the_whole_chunk() {
    use tower_bypass_marker::sans_io::{ChunkEdit, Piece};
    let layer = BypassMarkerLayer::new();
    let body: &[u8] = b"data: 1\n\nevent: x-bypass-remote-prefill\n: true\n\ndata: 2\n\ndata: 3";
    let whole = {
        let mut filter = layer
            .event_stream_filter(&RequestedAnnotations::new())
            .unwrap();
        let mut edit = ChunkEdit::new();
        filter.edit(&[body], &mut edit).unwrap();
        edit
    };
    assert_eq!(
        whole.pieces(),
        [Piece::Input(0..9), Piece::Input(48..57)],
        "the marker's bytes are skipped, the open `data: 3` is held"
    );
    for cut in 0..=body.len() {
        let (a, b) = body.split_at(cut);
        let mut filter = layer
            .event_stream_filter(&RequestedAnnotations::new())
            .unwrap();
        let mut edit = ChunkEdit::new();
        filter.edit(&[a, b], &mut edit).unwrap();
        assert_eq!(edit.to_vec(&[a, b]), whole.to_vec(&[body]), "cut at {cut}");
        // Past the body's first frame (until which a byte order mark is watched for, so a
        // frame across slices there is held), the very same ranges.
        if cut > 9 {
            assert_eq!(edit, whole, "cut at {cut}");
        }
        // What was held comes out at the end.
        let mut end = ChunkEdit::new();
        filter.edit_end(&mut end).unwrap();
        assert_eq!(end.to_vec(&[]), b"data: 3", "cut at {cut}");
    }
}
