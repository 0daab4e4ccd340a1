//! The Envoy dynamic module's per-stream layer (`bypass-marker-envoy-module`'s `StreamFilter`),
//! driven through its in-memory stream in the hook orders Envoy can produce, and compared with the
//! tower body for the same layer, opt-in and chunks.

use bypass_marker_envoy_adapter::config::FilterConfig;
use bypass_marker_envoy_adapter::stream::memory::SimulatedStream;
use bypass_marker_envoy_adapter::stream::{BodyStatus, HeadersStatus, TrailersStatus};
use tower_bypass_marker::json::DEFAULT_MAX_BODY_BYTES;

use test_support::fuzz::case::Case;
use test_support::fuzz::filter::{body_seen, response_head};
use test_support::fuzz::oracle::esc;

use crate::host::{assert_as_body, request_body, response_headers, Given};

/// How the response body ends, chosen from the case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// `end_of_stream` on the last data chunk.
    OnData,
    /// An empty last chunk with `end_of_stream`.
    EmptyChunk,
    /// Trailers after the data.
    Trailers,
}

/// Runs one case through the module's stream and holds it to the tower body.
pub fn check_module(case: &Case) {
    // A `200` to the request with no transfer coding: this host sends `:status` 200 to a POST
    // (the head byte's statuses and codings are the `body` and `filter` targets').
    let case = &case.status_200();
    let config = FilterConfig::new(case.layer(), DEFAULT_MAX_BODY_BYTES);
    // Envoy's chunks come in slices, and the module scans each slice where it lies: a frame open
    // at the end of a slice is held as at the end of a chunk (and counts against the frame cap).
    // So the body it is compared with gets the slices as its chunks; `last_slice[i]` is the index
    // of chunk i's last slice.
    let mut sliced = case.clone();
    let mut last_slice = Vec::new();
    if case.body.pending {
        sliced.ends.clear();
        let mut start = 0;
        for &end in &case.ends {
            let mid = start + (end - start) / 2;
            if mid > start {
                sliced.ends.push(mid);
            }
            sliced.ends.push(end);
            last_slice.push(sliced.ends.len() - 1);
            start = end;
        }
    } else {
        last_slice.extend(0..case.ends.len());
    }
    // The body of the same layer, its observer included: a layer with an observer filters the
    // streams of clients that opted in to everything too (to count their frames), where one
    // without passes them through.
    let want = body_seen(&sliced, config.layer());
    let mut stream = SimulatedStream::new(&config);

    // The request: the client's opt-in in `nvext.annotations`, its body in two pieces.
    let body = request_body(case);
    let status = stream.request("POST", &[("content-type", "application/json")], false);
    assert_eq!(status, HeadersStatus::StopIteration, "a JSON body is read");
    let (a, b) = body.split_at(body.len() / 2);
    assert_eq!(
        stream.request_chunk(a, false),
        BodyStatus::StopIterationAndBuffer
    );
    let forwarded = if case.body.trailers {
        stream.request_chunk(b, false) == BodyStatus::StopIterationAndBuffer
            && stream.request_trailers() == TrailersStatus::Continue
    } else {
        stream.request_chunk(b, true) == BodyStatus::Continue
    };
    assert!(
        forwarded,
        "the request was not forwarded: {:?}",
        stream.fake.sent
    );

    // The response.
    let head = response_head(case);
    let headers = response_headers(&head);
    if stream.response(&headers, false) == HeadersStatus::StopIteration {
        // An encoded event stream with something to remove: the 502 (a local reply), never a
        // byte of it. The tower body carries the same refusal.
        assert_eq!(stream.fake.sent.as_ref().map(|s| s.0), Some(502));
        assert!(want.out.contains("encoded_event_stream"), "{want:?}");
        assert!(stream.fake.client.is_empty());
        return;
    }
    let ending = if case.body.trailers {
        Ending::Trailers
    } else if case.input.len() % 2 == 1 {
        Ending::EmptyChunk
    } else {
        Ending::OnData
    };
    let chunks = case.chunks();
    let mut after = Vec::new();
    let mut reset = false;
    for (i, chunk) in chunks.iter().enumerate() {
        if case.body.empty_chunks {
            assert_eq!(stream.response_chunk(&[], false), BodyStatus::Continue);
        }
        let last = i + 1 == chunks.len() && ending == Ending::OnData;
        // Envoy's buffers come in slices: some chunks in two.
        let status = if case.body.pending {
            let (x, y) = chunk.split_at(chunk.len() / 2);
            stream.response_chunk(&[x, y], last)
        } else {
            stream.response_chunk(&[chunk], last)
        };
        if status == BodyStatus::StopIterationNoBuffer {
            reset = true;
            break;
        }
        assert_eq!(status, BodyStatus::Continue);
        after.push(stream.fake.client.len());
    }
    if !reset {
        let end_reset = match ending {
            Ending::OnData => false,
            Ending::EmptyChunk => stream.response_chunk(&[], true) != BodyStatus::Continue,
            Ending::Trailers => stream.response_trailers() != TrailersStatus::Continue,
        };
        reset = end_reset;
    }
    stream.complete();

    assert_eq!(reset, stream.fake.reset.is_some());
    // The body's output is counted before it has seen its end; with `end_of_stream` on the last
    // chunk, the module's last count includes what the end releases.
    let n = match after.len() {
        _ if reset => 0,
        n if ending == Ending::OnData && n > 0 => n - 1,
        n => n,
    };
    let want_after: Vec<usize> = last_slice[..n].iter().map(|&i| want.after[i]).collect();
    let given = Given {
        host: "module",
        client: &stream.fake.client,
        reset,
        after: &after[..n],
    };
    assert_as_body(&given, &want, &want_after, || {
        format!(
            "{:?}, {:?}; requested {:?}, chunks {:?}, upstream got {:?}",
            stream.fake.reset,
            stream.fake.logs,
            case.requested,
            chunks.iter().map(|c| esc(c)).collect::<Vec<_>>(),
            esc(&stream.fake.upstream)
        )
    });
}
