//! Property tests: streams built from a vocabulary of event-stream lines, split at random points,
//! go through the real body and must match the whole-input reference model, both at the end and
//! after every chunk (every complete frame yielded, nothing of an open frame).
//!
//! `PROPTEST_CASES=100000 cargo test --release --test properties` runs a long campaign.

use std::pin::pin;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http_body::Body;
use proptest::prelude::*;
use test_support::body::{cut, data, response, through, Gated};
use test_support::fuzz::body::ready;
use test_support::model;
use tower_bypass_marker::{BypassMarkerLayer, RequestedAnnotations};

const LINES: &[&[u8]] = &[
    b"event: x-bypass-remote-prefill",
    b"event:x-bypass-remote-prefill",
    b"event:  x-bypass-remote-prefill",
    b"Event: x-bypass-remote-prefill",
    b" event: x-bypass-remote-prefill",
    b"event: request_id",
    b"event: llm_metrics",
    b"event: message",
    b"event",
    b"event:",
    b": true",
    b":",
    b": \"req-1\"",
    b"data: {\"id\":\"chatcmpl-1\",\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}",
    b"data: [DONE]",
    b"data",
    b"data:event: x-bypass-remote-prefill",
    b"id: 42",
    b"retry: 100",
    b"data: \xff\xfe\x00 event:",
    b"\xEF\xBB\xBF",
    b"",
];
const EOLS: &[&[u8]] = &[b"\n", b"\r", b"\r\n"];
const NAMES: &[&str] = &["x-bypass-remote-prefill", "request_id", "llm_metrics"];

fn stream() -> impl Strategy<Value = Vec<u8>> {
    (
        any::<bool>(),
        prop::collection::vec((0..LINES.len(), 0..EOLS.len()), 0..40),
        any::<bool>(),
    )
        .prop_map(|(bom, lines, cut_last_eol)| {
            let mut out = Vec::new();
            if bom {
                out.extend_from_slice(b"\xEF\xBB\xBF");
            }
            let n = lines.len();
            for (k, (line, eol)) in lines.into_iter().enumerate() {
                out.extend_from_slice(LINES[line]);
                if !(cut_last_eol && k + 1 == n) {
                    out.extend_from_slice(EOLS[eol]);
                }
            }
            out
        })
}

/// Split points: sorted offsets into the stream, or every byte.
fn chunking(input: &[u8], cuts: &[usize], bytewise: bool) -> Vec<Bytes> {
    if bytewise {
        return input
            .iter()
            .map(|b| Bytes::copy_from_slice(&[*b]))
            .collect();
    }
    cut(input, cuts)
}

#[derive(Debug, Clone)]
struct Setup {
    request_id: bool,
    llm_metrics: bool,
    sdk_safe: bool,
    requested: Vec<bool>,
}

fn setup() -> impl Strategy<Value = Setup> {
    (
        any::<bool>(),
        any::<bool>(),
        prop::bool::weighted(0.2),
        prop::collection::vec(prop::bool::weighted(0.3), 3),
    )
        .prop_map(|(request_id, llm_metrics, sdk_safe, requested)| Setup {
            request_id,
            llm_metrics,
            sdk_safe,
            requested,
        })
}

fn check(input: &[u8], chunks: &[Bytes], setup: &Setup) -> Result<(), TestCaseError> {
    let mut layer = BypassMarkerLayer::new().sdk_safe(setup.sdk_safe);
    let mut remove = vec![NAMES[0].as_bytes().to_vec()];
    if setup.request_id {
        layer = layer.opt_in("request_id");
        remove.push(b"request_id".to_vec());
    }
    if setup.llm_metrics {
        layer = layer.never_forward("llm_metrics");
        remove.push(b"llm_metrics".to_vec());
    }
    let requested: RequestedAnnotations = NAMES
        .iter()
        .zip(&setup.requested)
        .filter(|(_, r)| **r)
        .map(|(n, _)| *n)
        .collect();
    let configured = remove.clone();
    remove.retain(|name| {
        name == b"llm_metrics" || !requested.contains(std::str::from_utf8(name).unwrap())
    });
    // The configured names that are not removed: the client opted in to them.
    let opted_in = configured
        .into_iter()
        .filter(|name| !remove.contains(name))
        .collect();
    let rules = model::Rules {
        remove,
        sdk_safe: setup.sdk_safe,
        opted_in,
    };

    let gated = Gated::default();
    let upstream = response("text/event-stream", gated.clone());
    let res = ready(through(&layer, Some(requested), upstream));
    let mut body = pin!(res.into_body());
    let mut cx = Context::from_waker(Waker::noop());
    let mut out = Vec::new();
    let mut seen = Vec::new();
    let mut drain = |body: &mut std::pin::Pin<&mut _>, out: &mut Vec<u8>| -> bool {
        loop {
            let body: &mut std::pin::Pin<&mut tower_bypass_marker::BypassMarkerBody<Gated>> = body;
            match body.as_mut().poll_frame(&mut cx) {
                Poll::Ready(Some(Ok(frame))) => out.extend_from_slice(&frame.into_data().unwrap()),
                Poll::Ready(Some(Err(e))) => panic!("error: {e}"),
                Poll::Ready(None) => return true,
                Poll::Pending => return false,
            }
        }
    };
    for chunk in chunks {
        seen.extend_from_slice(chunk);
        gated.push(data(chunk.clone()));
        prop_assert!(!drain(&mut body, &mut out), "ended early");
        // With nothing to remove the body is passed through, byte for byte as it arrives.
        let passthrough = rules.remove.is_empty() && !rules.sdk_safe;
        let expected = if passthrough {
            seen.clone()
        } else {
            model::filter(&seen, &rules).complete
        };
        prop_assert_eq!(
            out.escape_ascii().to_string(),
            expected.escape_ascii().to_string(),
            "after {} bytes",
            seen.len()
        );
    }
    gated.close();
    prop_assert!(drain(&mut body, &mut out));
    prop_assert!(body.is_end_stream());
    let expected = model::filter(input, &rules).all;
    prop_assert_eq!(
        out.escape_ascii().to_string(),
        expected.escape_ascii().to_string()
    );
    Ok(())
}

proptest! {
    #[test]
    fn random_chunkings_match_the_model(
        input in stream(),
        cuts in prop::collection::vec(any::<usize>(), 0..12),
        setup in setup(),
    ) {
        let chunks = chunking(&input, &cuts, false);
        check(&input, &chunks, &setup)?;
    }

    #[test]
    fn byte_by_byte_matches_the_model(input in stream(), setup in setup()) {
        let chunks = chunking(&input, &[], true);
        check(&input, &chunks, &setup)?;
    }
}
