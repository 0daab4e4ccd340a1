//! The scanner on whole inputs, through the public `EventStreamFilter` as a host drives it: each
//! input becomes the expected output whole, split at every offset, at every pair of offsets (short
//! inputs) and a byte at a time, and after every chunk exactly what the reference model
//! (`test_support::model`) calls complete has come out (nothing held back that could go, nothing
//! of an open frame let out). The scanner's own steps and masks are tested beside it, in
//! `src/scan.rs`.

use bytes::Bytes;
use test_support::fuzz::oracle::esc;
use test_support::model;
use tower_bypass_marker::sans_io::{EventStreamFilter, FilterOutput};
use tower_bypass_marker::{BypassMarkerLayer, RequestedAnnotations};

const MARKER: &[u8] = b"event: x-bypass-remote-prefill\n: true\n\n";
const CHUNK: &[u8] = b"data: {\"id\":1}\n\n";
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// The model's rules for `layer`: the names it removes (the tests here configure none that a
/// client could opt in to but by name) and its SDK-safe rule.
fn rules(names: &[&str], sdk_safe: bool) -> model::Rules {
    model::Rules {
        remove: names.iter().map(|n| n.as_bytes().to_vec()).collect(),
        sdk_safe,
        opted_in: Vec::new(),
    }
}

/// A layer and the model's rules for it.
struct Setup {
    layer: BypassMarkerLayer,
    rules: model::Rules,
}

impl Setup {
    fn new() -> Self {
        Self::with(BypassMarkerLayer::new(), &[], false)
    }

    /// `layer`, which removes `extra` besides the bypass marker.
    fn with(layer: BypassMarkerLayer, extra: &[&str], sdk_safe: bool) -> Self {
        let mut names = vec![tower_bypass_marker::BYPASS_REMOTE_PREFILL];
        names.extend_from_slice(extra);
        Self {
            layer,
            rules: rules(&names, sdk_safe),
        }
    }

    fn filter(&self) -> EventStreamFilter {
        self.layer
            .event_stream_filter(&RequestedAnnotations::default())
            .expect("the bypass marker is always removed")
    }
}

/// Feeds `chunks` the way a host does and returns the output. After every chunk, checks that
/// exactly what the model calls complete has been yielded, and that nothing is held at the end.
fn drive(setup: &Setup, chunks: &[&[u8]]) -> Vec<u8> {
    let mut filter = setup.filter();
    let mut out = Vec::new();
    let mut seen = Vec::new();
    for chunk in chunks {
        filter.push(Bytes::copy_from_slice(chunk));
        drain(&mut filter, &mut out, FilterOutput::NeedInput);
        seen.extend_from_slice(chunk);
        assert_eq!(
            esc(&out),
            esc(&model::filter(&seen, &setup.rules).complete),
            "after {:?}",
            esc(&seen)
        );
    }
    filter.finish();
    drain(&mut filter, &mut out, FilterOutput::End);
    assert_eq!(filter.held_bytes(), 0, "held bytes left behind");
    out
}

/// Takes the filter's output into `out` until it says `until`.
fn drain(filter: &mut EventStreamFilter, out: &mut Vec<u8>, until: FilterOutput) {
    loop {
        match filter.poll_output().expect("no overflow") {
            FilterOutput::Data(data) => out.extend_from_slice(&data),
            other => {
                assert_eq!(other, until);
                return;
            }
        }
    }
}

/// Checks that `input` becomes `expected` whole, split at every offset, split at every pair of
/// offsets (short inputs) and fed a byte at a time, and that the model agrees.
fn assert_filters(setup: &Setup, input: &[u8], expected: &[u8]) {
    assert_eq!(
        esc(&model::filter(input, &setup.rules).all),
        esc(expected),
        "the model disagrees with the expectation"
    );
    assert_eq!(esc(&drive(setup, &[input])), esc(expected), "whole");
    for i in 0..=input.len() {
        let (a, b) = input.split_at(i);
        assert_eq!(esc(&drive(setup, &[a, b])), esc(expected), "split at {i}");
    }
    if input.len() <= 64 {
        for i in 0..=input.len() {
            for j in i..=input.len() {
                let parts = [&input[..i], &input[i..j], &input[j..]];
                assert_eq!(
                    esc(&drive(setup, &parts)),
                    esc(expected),
                    "split at {i}, {j}"
                );
            }
        }
    }
    let bytes: Vec<&[u8]> = input.chunks(1).collect();
    assert_eq!(esc(&drive(setup, &bytes)), esc(expected), "byte by byte");
}

fn cat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

#[test]
fn marker_frame_is_removed_at_every_split() {
    let layer = Setup::new();
    let input = cat(&[MARKER, CHUNK, b"data: [DONE]\n\n"]);
    assert_filters(&layer, &input, &cat(&[CHUNK, b"data: [DONE]\n\n"]));
}

#[test]
fn marker_in_the_middle_and_at_the_end_is_removed() {
    let layer = Setup::new();
    assert_filters(&layer, &cat(&[CHUNK, MARKER, CHUNK]), &cat(&[CHUNK, CHUNK]));
    assert_filters(&layer, &cat(&[CHUNK, MARKER]), CHUNK);
    assert_filters(&layer, MARKER, b"");
}

#[test]
fn every_line_ending_is_understood() {
    let layer = Setup::new();
    for eol in [&b"\n"[..], b"\r", b"\r\n"] {
        let marker = cat(&[b"event: x-bypass-remote-prefill", eol, b": true", eol, eol]);
        let data = cat(&[b"data: 1", eol, eol]);
        assert_filters(&layer, &cat(&[&marker, &data]), &data);
    }
    // Mixed endings within one frame and between frames.
    assert_filters(
        &layer,
        b"data: a\r\n\revent: x-bypass-remote-prefill\r: true\n\r\ndata: b\r\r",
        b"data: a\r\n\rdata: b\r\r",
    );
}

#[test]
fn crlf_split_after_a_removed_frame_drops_the_lf() {
    let layer = Setup::new();
    let out = drive(
        &layer,
        &[
            b"event: x-bypass-remote-prefill\r\n: true\r\n\r",
            b"\ndata: 1\r\n\r\n",
        ],
    );
    assert_eq!(esc(&out), esc(b"data: 1\r\n\r\n"));
}

#[test]
fn crlf_split_after_a_kept_frame_forwards_the_lf() {
    let layer = Setup::new();
    let out = drive(&layer, &[b"data: 1\r\n\r", b"\ndata: 2\r\n\r\n"]);
    assert_eq!(esc(&out), esc(b"data: 1\r\n\r\ndata: 2\r\n\r\n"));
    // And after a kept frame that was held across chunks.
    let out = drive(&layer, &[b"data: 1\r", b"\n\r", b"\n"]);
    assert_eq!(esc(&out), esc(b"data: 1\r\n\r\n"));
}

#[test]
fn a_cr_then_a_cr_is_two_line_ends() {
    let layer = Setup::new();
    let out = drive(
        &layer,
        &[b"event: x-bypass-remote-prefill\r", b"\rdata: 1\n\n"],
    );
    assert_eq!(esc(&out), esc(b"data: 1\n\n"));
}

#[test]
fn leading_bom_is_kept_and_is_not_part_of_the_field_name() {
    let layer = Setup::new();
    let input = cat(&[BOM, MARKER, CHUNK]);
    assert_filters(&layer, &input, &cat(&[BOM, CHUNK]));
    assert_filters(&layer, BOM, BOM);
}

#[test]
fn partial_bom_is_part_of_the_first_field_name() {
    let layer = Setup::new();
    // "\xEF\xBBevent" is not "event": the frame is kept, bytes unchanged.
    let input = cat(&[b"\xEF\xBB", MARKER, MARKER]);
    assert_filters(&layer, &input, &cat(&[b"\xEF\xBB", MARKER]));
    assert_filters(&layer, b"\xEF", b"\xEF");
    assert_filters(&layer, b"\xEF\xBB\n\n", b"\xEF\xBB\n\n");
}

#[test]
fn a_bom_that_did_not_begin_the_body_never_begins_the_output() {
    let layer = Setup::new();
    // `\u{FEFF}data` is a field of another name: kept as it is, a LF before it.
    let kept = cat(&[BOM, b"data: 2\n\n"]);
    assert_filters(&layer, &cat(&[MARKER, &kept]), &cat(&[b"\n", &kept]));
    assert_filters(
        &layer,
        &cat(&[MARKER, MARKER, &kept, &kept]),
        &cat(&[b"\n", &kept, &kept]),
    );
    let crlf = b"event: x-bypass-remote-prefill\r\n: true\r\n\r\n\xEF\xBB\xBFdata: 2\r\n\r\n";
    assert_filters(&layer, crlf, b"\n\xEF\xBB\xBFdata: 2\r\n\r\n");
    let cr = b"event: x-bypass-remote-prefill\r\r\xEF\xBB\xBF\r\r";
    assert_filters(&layer, cr, b"\n\xEF\xBB\xBF\r\r");
    // An unterminated frame at the end, released when the body ends.
    assert_filters(
        &layer,
        &cat(&[MARKER, BOM, b"x"]),
        &cat(&[b"\n", BOM, b"x"]),
    );
    assert_filters(&layer, &cat(&[MARKER, BOM]), &cat(&[b"\n", BOM]));
    // The first bytes of a BOM are not a BOM.
    assert_filters(&layer, &cat(&[MARKER, b"\xEF\xBB\n\n"]), b"\xEF\xBB\n\n");
    assert_filters(&layer, &cat(&[MARKER, b"\xEF\n\n"]), b"\xEF\n\n");
    // Not the first bytes forwarded: content.
    assert_filters(&layer, &cat(&[b"\n", MARKER, &kept]), &cat(&[b"\n", &kept]));
    assert_filters(&layer, &cat(&[CHUNK, MARKER, &kept]), &cat(&[CHUNK, &kept]));
    // A body that began with a BOM keeps it, and a BOM after it stays content.
    assert_filters(&layer, &cat(&[BOM, MARKER, &kept]), &cat(&[BOM, &kept]));
}

#[test]
fn a_second_bom_is_ordinary_bytes() {
    let layer = Setup::new();
    let input = cat(&[BOM, BOM, MARKER, MARKER]);
    assert_filters(&layer, &input, &cat(&[BOM, BOM, MARKER]));
}

#[test]
fn field_names_are_compared_exactly() {
    let layer = Setup::new();
    for kept in [
        &b"Event: x-bypass-remote-prefill\n\n"[..],
        b"event:  x-bypass-remote-prefill\n\n",
        b" event: x-bypass-remote-prefill\n\n",
        b"event: x-bypass-remote-prefill \n\n",
        b"event: X-Bypass-Remote-Prefill\n\n",
        b"event: x-bypass-remote-prefillx\n\n",
        b"event: x-bypass-remote\n\n",
        b"eventx: x-bypass-remote-prefill\n\n",
        b"event\n\n",
        b"data: event: x-bypass-remote-prefill\n\n",
        b": event: x-bypass-remote-prefill\n\n",
    ] {
        assert_filters(&layer, &cat(&[kept, CHUNK]), &cat(&[kept, CHUNK]));
    }
    assert_filters(
        &layer,
        b"event:x-bypass-remote-prefill\n\ndata: 1\n\n",
        b"data: 1\n\n",
    );
}

#[test]
fn the_last_event_field_wins() {
    let layer = Setup::new();
    let kept = b"event: x-bypass-remote-prefill\nevent: message\ndata: 1\n\n";
    assert_filters(&layer, kept, kept);
    let removed = b"event: message\nevent: x-bypass-remote-prefill\ndata: 1\n\n";
    assert_filters(&layer, &cat(&[removed, CHUNK]), CHUNK);
    // An `event` line without a colon sets an empty type, undoing the marker.
    let kept = b"event: x-bypass-remote-prefill\nevent\n\n";
    assert_filters(&layer, kept, kept);
}

#[test]
fn marker_frame_with_data_and_id_is_removed_whole() {
    let layer = Setup::new();
    let input = b"id: 7\nevent: x-bypass-remote-prefill\ndata: {}\nretry: 10\n: c\n\ndata: 1\n\n";
    assert_filters(&layer, input, b"data: 1\n\n");
}

#[test]
fn keep_alives_comments_and_stray_blank_lines_are_forwarded() {
    let layer = Setup::new();
    let input = cat(&[
        b"\n\r\n:\n\n: ping\r\n\r\n",
        MARKER,
        b"\n\n:keep\n\n",
        CHUNK,
        b"\r",
    ]);
    assert_filters(
        &layer,
        &input,
        &cat(&[b"\n\r\n:\n\n: ping\r\n\r\n", b"\n\n:keep\n\n", CHUNK, b"\r"]),
    );
}

#[test]
fn invalid_utf8_and_nul_bytes_are_forwarded_unchanged() {
    let layer = Setup::new();
    let odd = b"data: \xff\xfe\x00\xc3\n\xf0\x9f: \x00\n\n";
    assert_filters(&layer, &cat(&[odd, MARKER, odd]), &cat(&[odd, odd]));
    let nul_event = b"event: x-bypass-remote-prefill\x00\n\n";
    assert_filters(&layer, nul_event, nul_event);
}

#[test]
fn unterminated_frame_at_the_end_is_judged_as_it_stands() {
    let layer = Setup::new();
    assert_filters(
        &layer,
        b"data: 1\n\nevent: x-bypass-remote-prefill",
        b"data: 1\n\n",
    );
    assert_filters(
        &layer,
        b"data: 1\n\nevent: x-bypass-remote-prefill\n: t",
        b"data: 1\n\n",
    );
    assert_filters(
        &layer,
        b"data: 1\n\nevent: x-bypass-remote-prefill\n",
        b"data: 1\n\n",
    );
    assert_filters(&layer, b"data: 1\n\ndata: 2", b"data: 1\n\ndata: 2");
    assert_filters(
        &layer,
        b"data: 1\n\nevent: other\r",
        b"data: 1\n\nevent: other\r",
    );
}

#[test]
fn empty_input_yields_nothing() {
    let layer = Setup::new();
    assert_eq!(drive(&layer, &[]), b"");
    assert_eq!(drive(&layer, &[b"", b""]), b"");
}

#[test]
fn an_event_line_spanning_chunks_is_recognised() {
    let layer = Setup::with(
        BypassMarkerLayer::new().opt_in("request_id"),
        &["request_id"],
        false,
    );
    let out = drive(
        &layer,
        &[
            b"data: 0\n\nev",
            b"ent: x-bypass-rem",
            b"ote-prefill",
            b"\n: true\n",
            b"\ndata: 1\n\n",
        ],
    );
    assert_eq!(esc(&out), esc(b"data: 0\n\ndata: 1\n\n"));
    // A long value spanning chunks is not mistaken for a name it starts with.
    let long = cat(&[b"event: request_id", &[b'x'; 300], b"\n\n"]);
    let out = drive(&layer, &[&long[..10], &long[10..200], &long[200..]]);
    assert_eq!(esc(&out), esc(&long));
}

#[test]
fn opt_in_and_never_forwarded_names_are_removed_too() {
    let layer = Setup::with(
        BypassMarkerLayer::new()
            .opt_in("request_id")
            .never_forward("llm_metrics"),
        &["request_id", "llm_metrics"],
        false,
    );
    let input = b"event: request_id\n: \"abc\"\n\nevent: llm_metrics\ndata: {}\n\nevent: other\ndata: x\n\n";
    assert_filters(&layer, input, b"event: other\ndata: x\n\n");
}

#[test]
fn sdk_safe_mode_removes_frames_without_data_but_keeps_keep_alives() {
    let layer = Setup::with(BypassMarkerLayer::new().sdk_safe(true), &[], true);
    let input =
        b"id: 1\n\n:\n\nevent: ping\n\nretry: 5\n: c\n\nevent: x\ndata: 1\n\ndata\n\nfoo\n\n";
    assert_filters(&layer, input, b":\n\nevent: x\ndata: 1\n\ndata\n\n");
    // Off by default.
    let layer = Setup::new();
    assert_filters(
        &layer,
        b"id: 1\n\nevent: ping\n\n",
        b"id: 1\n\nevent: ping\n\n",
    );
}

#[test]
fn sdk_safe_mode_removes_a_body_of_only_a_partial_bom() {
    let layer = Setup::with(BypassMarkerLayer::new().sdk_safe(true), &[], true);
    assert_filters(&layer, b"\xEF", b"");
    assert_filters(&layer, b"\xEF\xBB", b"");
    assert_filters(&layer, b"\xEF\xBB\xBF", b"\xEF\xBB\xBF");
}

#[test]
fn long_lines_are_walked_and_frames_after_them_still_filtered() {
    let layer = Setup::new();
    let long = vec![b'x'; 40 * 1024];
    let input = cat(&[
        b"data: ",
        &long,
        b"\n\n",
        MARKER,
        b"data: ",
        &long,
        b"\r\n\r\n",
        MARKER,
    ]);
    let expected = cat(&[b"data: ", &long, b"\n\n", b"data: ", &long, b"\r\n\r\n"]);
    assert_eq!(esc(&drive(&layer, &[&input])), esc(&expected));
    for at in [
        1,
        100,
        1025,
        16 * 1024,
        40 * 1024 + 7,
        40 * 1024 + 20,
        80 * 1024,
    ] {
        let (a, b) = input.split_at(at);
        assert_eq!(
            esc(&drive(&layer, &[a, b])),
            esc(&expected),
            "split at {at}"
        );
    }
    // A long `event` line is never a configured name, and a marker after it still goes.
    let input = cat(&[b"event: ", &long, b"\ndata: 1\n\n", MARKER]);
    let expected = cat(&[b"event: ", &long, b"\ndata: 1\n\n"]);
    assert_eq!(esc(&drive(&layer, &[&input])), esc(&expected));
}

/// A chunk of whole frames with no `event:` takes the scanner's quick path (`src/scan.rs`); what
/// follows it in the same chunk is filtered as anywhere else.
#[test]
fn whole_frame_chunks_are_filtered_as_any_other() {
    let data: &[u8] =
        b"data: {\"id\":\"chatcmpl-1\",\"choices\":[{\"delta\":{\"content\":\" token\"}}]}\n\n";
    let layer = Setup::new();
    // The marker after it in the same chunk is removed.
    assert_filters(&layer, &cat(&[data, MARKER]), data);
    // `event:` inside a data value is content: kept.
    let value: &[u8] =
        b"data: {\"content\":\"event: x-bypass-remote-prefill\",\"pad\":\"..........\"}\n\n";
    assert_filters(&layer, value, value);
    // SDK-safe mode removes a data-less frame of such a chunk.
    let sdk = Setup::with(BypassMarkerLayer::new().sdk_safe(true), &[], true);
    assert_filters(&sdk, &cat(&[data, b"id: 7\n\n"]), data);
}
