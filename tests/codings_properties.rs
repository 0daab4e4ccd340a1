//! Property test of issue 48's paths: hostile event streams (markers in every spelling, CR, LF and
//! CRLF, a BOM, frames cut anywhere) under a random response head (a `200` to `GET`, a `204`, a
//! `304`, a `200` to `HEAD`; `text/event-stream` or JSON; `content-encoding` none, `identity` or
//! `gzip`; `transfer-encoding` none, `chunked`, `gzip, chunked` or `identity, chunked`), cut at
//! random points, through the tower `BypassMarker` service and the sans-IO `GatewayExchange` (the
//! Envoy hosts' driver), with the `body` fuzz target's drivers and oracle
//! (`test_support::fuzz::{body, exchange}`):
//!
//! - a head without content: no body byte, its headers kept;
//! - an unreadable coding with something to remove: the 502 `encoded_event_stream` naming the
//!   coding, and no byte of the stream;
//! - otherwise, a filtered stream is the WHATWG reference model's output byte for byte, after every
//!   chunk and at the end (the model extended with the frame cap), and a passed-through one is the
//!   inner body untouched.
//!
//! `PROPTEST_CASES=100000 cargo test --release --features json --test codings_properties` runs a
//! long campaign.
#![cfg(feature = "json")]

use proptest::prelude::*;
use test_support::fuzz::body::check_body;
use test_support::fuzz::case::{Case, CONTENT_TYPES, TRANSFER_CODINGS};
use test_support::fuzz::exchange::check_exchange;

const LINES: &[&[u8]] = &[
    b"event: x-bypass-remote-prefill",
    b"event:x-bypass-remote-prefill",
    b"Event: x-bypass-remote-prefill",
    b"event: x-bypass-remote-prefillx",
    b"event: request_id",
    b"event: llm_metrics",
    b"event: message",
    b"event:",
    b": true",
    b":",
    b"data: {\"id\":\"chatcmpl-1\",\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}",
    b"data: [DONE]",
    b"data",
    b"data:event: x-bypass-remote-prefill",
    b"id: 42",
    b"retry: 100",
    b"\x1f\x8b\x08\x00",
    b"\xEF\xBB\xBF",
    b"",
];
const EOLS: &[&[u8]] = &[b"\n", b"\r", b"\r\n"];

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

/// The fuzz input header of the `body` target (FUZZING.md, "How an input is decoded") with the head
/// byte, and no chunk lengths: the configuration, the opt-in, the small cap, the body plan (byte 4
/// bit 7 set: the head byte follows the error point), the status and codings.
#[allow(clippy::too_many_arguments)]
fn header(
    flags: u8,
    opt_in: u8,
    cap: u8,
    plan: u8,
    content_type: usize,
    error_at: u8,
    status: u8,
    transfer: usize,
) -> Vec<u8> {
    // No dictionary mode, no extra name, no byte-by-byte mode: the body is the stream as it is.
    let flags = flags & 0x1F;
    let plan = (plan & 0x0F) | ((content_type as u8) << 4) | 0x80;
    let head = (status & 3) | ((transfer as u8) << 2);
    vec![flags, opt_in & 0x7F, cap, 0, plan, error_at, head, 0]
}

/// `input` cut at the sorted `cuts` (taken modulo its length): the chunk ends, the last one its
/// length.
fn ends(input: &[u8], cuts: &[usize]) -> Vec<usize> {
    let mut ends: Vec<usize> = cuts.iter().map(|c| c % (input.len() + 1)).collect();
    ends.sort_unstable();
    ends.push(input.len());
    ends
}

proptest! {
    #[test]
    fn every_status_and_coding_over_random_cuts_matches_the_rule(
        input in stream(),
        cuts in prop::collection::vec(any::<usize>(), 0..12),
        flags in any::<u8>(),
        opt_in in any::<u8>(),
        cap in prop::sample::select(vec![0u8, 8, 40, 255]),
        plan in any::<u8>(),
        content_type in 0..CONTENT_TYPES.len(),
        error_at in any::<u8>(),
        status in 0u8..4,
        transfer in 0..TRANSFER_CODINGS.len(),
    ) {
        let mut data = header(flags, opt_in, cap, plan, content_type, error_at, status, transfer);
        data.extend_from_slice(&input);
        let mut case = Case::decode(&data);
        prop_assert_eq!(&case.input, &input);
        prop_assert_eq!(case.body.transfer, transfer);
        case.ends = ends(&input, &cuts);
        check_body(&case);
        check_exchange(&case);
    }
}

/// Every head the property test picks, with a marker split across two chunks and nothing opted
/// in: each path at least once, whatever proptest draws.
#[test]
fn every_head_once_with_a_split_marker() {
    let input = b"event: x-bypass-remote-prefill\r\n: true\r\n\r\ndata: 1\n\n";
    for content_type in 0..CONTENT_TYPES.len() {
        for status in 0..4 {
            for transfer in 0..TRANSFER_CODINGS.len() {
                for plan in [0, 0x01, 0x0C] {
                    let mut data = header(0, 0, 0, plan, content_type, 0, status, transfer);
                    data.extend_from_slice(input);
                    let mut case = Case::decode(&data);
                    case.ends = vec![9, 33, input.len()];
                    check_body(&case);
                    check_exchange(&case);
                }
            }
        }
    }
}
