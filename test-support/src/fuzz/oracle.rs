//! What the layer must yield for a case: the reference model, extended with the frame cap.
//!
//! [`crate::model`] knows nothing about `max_frame_bytes`. The crate's
//! documented rule is: a frame that is still open at the end of a chunk, with more than
//! `max_frame_bytes` of its bytes arrived by then, is forwarded as it arrives, unfiltered
//! ([`Overflow::Forward`]), or fails the body ([`Overflow::Error`]). This module cuts the input
//! into frames and stray empty lines on its own, applies that rule, and asks the model only whether
//! a frame is removed.

use tower_bypass_marker::Overflow;

use super::case::Case;
use crate::model;

const BOM: &[u8] = b"\xEF\xBB\xBF";

/// A frame (non-empty lines and the empty line that closes it), or an empty line outside frames.
#[derive(Debug, Clone, Copy)]
struct Piece {
    start: usize,
    /// Just past the piece's last terminator (or the input's end, for an unterminated frame).
    end: usize,
    /// Where the terminator of the empty line that closes it starts; `None` for an unterminated
    /// frame. A frame is open at a chunk end `b` when `start < b <= close`.
    close: Option<usize>,
    frame: bool,
}

/// The length of a leading BOM (0 or 3) and the pieces after it.
fn pieces(input: &[u8]) -> (usize, Vec<Piece>) {
    let bom = if input.starts_with(BOM) { BOM.len() } else { 0 };
    let mut out = Vec::new();
    let mut frame_start = None;
    let mut i = bom;
    while i < input.len() {
        let Some(off) = input[i..].iter().position(|&b| b == b'\n' || b == b'\r') else {
            frame_start.get_or_insert(i);
            break;
        };
        let t = i + off;
        let end = if input[t] == b'\r' && input.get(t + 1) == Some(&b'\n') {
            t + 2
        } else {
            t + 1
        };
        if off == 0 {
            out.push(match frame_start.take() {
                Some(start) => Piece {
                    start,
                    end,
                    close: Some(t),
                    frame: true,
                },
                None => Piece {
                    start: t,
                    end,
                    close: Some(t),
                    frame: false,
                },
            });
        } else {
            frame_start.get_or_insert(i);
        }
        i = end;
    }
    if let Some(start) = frame_start {
        out.push(Piece {
            start,
            end: input.len(),
            close: None,
            frame: true,
        });
    }
    (bom, out)
}

/// At `b`, the input so far is the start of a BOM: the scanner is matching it, no frame is open.
fn bom_pending(input: &[u8], b: usize) -> bool {
    b < BOM.len() && BOM.starts_with(&input[..b])
}

/// The model's rules for `case`.
pub fn rules(case: &Case) -> model::Rules {
    model::Rules {
        remove: case.removed_names(),
        sdk_safe: case.sdk_safe,
        opted_in: case.opted_in_names(),
    }
}

/// Whether the model removes `frame` (a frame's bytes, its closing empty line included if any).
fn removed(frame: &[u8], rules: &model::Rules) -> bool {
    // A stray empty line first, so that a frame starting with BOM bytes is not taken for a BOM.
    let mut input = Vec::with_capacity(frame.len() + 1);
    input.push(b'\n');
    input.extend_from_slice(frame);
    model::filter(&input, rules).all.len() == 1
}

/// What the layer yields for a body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    /// The whole output, or `Err` with the output before the body fails with `FrameTooLarge`.
    pub all: Result<Vec<u8>, Vec<u8>>,
    /// For each chunk the scanner handled without failing: the output length once it was
    /// handled.
    pub after: Vec<usize>,
}

/// The expected output for `input` cut at `ends` (ascending chunk ends, the last one
/// `input.len()`).
pub fn expected(
    input: &[u8],
    ends: &[usize],
    rules: &model::Rules,
    cap: usize,
    overflow: Overflow,
) -> Expected {
    let (bom, pieces) = pieces(input);
    let removed: Vec<bool> = pieces
        .iter()
        .map(|p| p.frame && removed(&input[p.start..p.end], rules))
        .collect();
    // For each piece, the first chunk end at which it is an open frame past the cap.
    let overflows: Vec<Option<usize>> = pieces
        .iter()
        .map(|p| {
            let last_open = p.close.unwrap_or(input.len());
            let over = |b: usize| {
                p.start < b && b <= last_open && b - p.start > cap && !bom_pending(input, b)
            };
            p.frame
                .then(|| ends.iter().copied().find(|&b| over(b)))
                .flatten()
        })
        .collect();
    let kept = |k: usize| !removed[k] || overflows[k].is_some();

    // The output once the chunks up to `b` have been handled.
    let yielded = |b: usize| -> usize {
        if bom_pending(input, b) {
            return 0;
        }
        let mut n = bom;
        for (k, p) in pieces.iter().enumerate() {
            if p.start >= b {
                break;
            }
            let closed = p.close.is_some_and(|t| t < b);
            if !p.frame || (closed && kept(k)) {
                n += p.end.min(b) - p.start;
            } else if !closed && overflows[k].is_some_and(|at| at <= b) {
                n += b - p.start;
            }
        }
        n
    };

    let failure = match overflow {
        Overflow::Error => overflows
            .iter()
            .enumerate()
            .filter_map(|(k, at)| at.map(|at| (at, k)))
            .min(),
        _ => None,
    };
    // The rule for a BOM that did not begin the body (`lead`), on the output as a stream: every
    // output so far is a prefix of `raw`, the output without the rule.
    let shown = |raw: &[u8], b: usize| -> usize {
        let n = yielded(b);
        let so_far = raw
            .get(..n)
            .expect("the output so far is a prefix of the output");
        if bom > 0 {
            n
        } else if so_far.starts_with(BOM) {
            n + 1
        } else if BOM.starts_with(so_far) {
            // Nothing, or the first bytes of a BOM: withheld until what follows them is known.
            0
        } else {
            n
        }
    };

    if let Some((at, first)) = failure {
        let before_chunks = ends.iter().position(|&b| b == at).unwrap_or(ends.len());
        let mut before = input[..bom].to_vec();
        for (k, p) in pieces[..first].iter().enumerate() {
            if kept(k) {
                before.extend_from_slice(&input[p.start..p.end]);
            }
        }
        return Expected {
            after: ends[..before_chunks]
                .iter()
                .map(|&b| shown(&before, b))
                .collect(),
            all: Err(lead(bom, before)),
        };
    }

    let mut all = input[..bom].to_vec();
    for (k, p) in pieces.iter().enumerate() {
        if kept(k) {
            all.extend_from_slice(&input[p.start..p.end]);
        }
    }
    Expected {
        after: ends.iter().map(|&b| shown(&all, b)).collect(),
        all: Ok(lead(bom, all)),
    }
}

/// The one byte the layer adds (the crate's guarantee): when the output would begin with a BOM and
/// the body did not (`bom`, its leading BOM's length, is 0), a LF goes first.
fn lead(bom: usize, mut out: Vec<u8>) -> Vec<u8> {
    if bom == 0 && out.starts_with(BOM) {
        out.insert(0, b'\n');
    }
    out
}

/// [`expected`] for a whole case.
pub fn expected_for(case: &Case) -> Expected {
    expected(
        &case.input,
        &case.ends,
        &rules(case),
        case.max_frame_bytes(),
        case.overflow,
    )
}

/// Bytes for a failure message: printable ASCII as is, the rest escaped.
pub fn esc(bytes: &[u8]) -> String {
    bytes.escape_ascii().to_string()
}

/// Checks what the scanner driver (`__fuzz::filter_chunks`, or the body) produced for `case`:
/// `Some((output, output length after each chunk))`, or `None` when it failed with
/// `FrameTooLarge`.
pub fn check_scanner(case: &Case, got: Option<(Vec<u8>, Vec<usize>)>) {
    let input = &case.input;
    let rules = rules(case);
    let exp = expected_for(case);

    // No frame can outgrow the cap: the plain model decides everything, after every chunk too.
    if input.len() <= case.max_frame_bytes() {
        let Some((out, after)) = &got else {
            panic!("FrameTooLarge on a {} byte body", input.len());
        };
        let whole = model::filter(input, &rules).all;
        assert_eq!(esc(out), esc(&whole), "output differs from the model");
        assert_eq!(after.len(), case.ends.len());
        for (&n, &end) in after.iter().zip(&case.ends) {
            let complete = model::filter(&input[..end], &rules).complete;
            assert_eq!(
                esc(&out[..n]),
                esc(&complete),
                "yielded after the chunk ending at {end} differs from the model"
            );
        }
        assert_eq!(
            exp.all.as_ref(),
            Ok(&whole),
            "oracle disagrees with the model"
        );
    }

    match (got, exp.all) {
        (Some((out, after)), Ok(all)) => {
            assert_eq!(esc(&out), esc(&all), "output");
            assert_eq!(after, exp.after, "output length after each chunk");
            assert!(
                after.windows(2).all(|w| w[0] <= w[1]),
                "yielded output shrank"
            );
            // Apart from a LF put before a BOM that did not begin the body.
            let taken = match out.strip_prefix(b"\n") {
                Some(rest) if rest.starts_with(BOM) && !input.starts_with(BOM) => rest,
                _ => &out[..],
            };
            assert!(
                is_subsequence(taken, input),
                "output is not taken from the input"
            );
        }
        (None, Err(_)) => {}
        (Some((out, _)), Err(before)) => panic!(
            "expected FrameTooLarge after {:?}, got output {:?}",
            esc(&before),
            esc(&out)
        ),
        (None, Ok(all)) => panic!("unexpected FrameTooLarge; expected output {:?}", esc(&all)),
    }
}

/// Whether `small` is `big` with some bytes left out.
pub fn is_subsequence(small: &[u8], big: &[u8]) -> bool {
    let mut rest = big.iter();
    small.iter().all(|b| rest.any(|c| c == b))
}
