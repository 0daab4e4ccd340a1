//! A whole-input reference model of the filter, written as plainly as possible: split the input
//! into lines, group lines into frames, judge each frame. The property tests and the fuzz targets
//! compare the layer with it.

const BOM: &[u8] = b"\xEF\xBB\xBF";

/// What the model removes.
#[derive(Debug, Clone, Default)]
pub struct Rules {
    /// Event types whose frames are removed.
    pub remove: Vec<Vec<u8>>,
    /// Also remove frames with a non-comment line and no `data` field, unless their event type is
    /// in `opted_in`.
    pub sdk_safe: bool,
    /// Event types the client opted in to: never removed by the SDK-safe rule.
    pub opted_in: Vec<Vec<u8>>,
}

/// The model's output for `input`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    /// What the whole body becomes.
    pub all: Vec<u8>,
    /// What must have been yielded once exactly `input` has arrived and more may follow: every
    /// closed frame and empty line, nothing of a frame (or BOM) still open.
    pub complete: Vec<u8>,
}

struct Line<'a> {
    content: &'a [u8],
    terminator: &'a [u8],
}

fn lines(input: &[u8]) -> Vec<Line<'_>> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i < input.len() {
        match input[i] {
            b'\n' => {
                out.push(Line {
                    content: &input[start..i],
                    terminator: &input[i..i + 1],
                });
                i += 1;
                start = i;
            }
            b'\r' => {
                let end = if input.get(i + 1) == Some(&b'\n') {
                    i + 2
                } else {
                    i + 1
                };
                out.push(Line {
                    content: &input[start..i],
                    terminator: &input[i..end],
                });
                i = end;
                start = i;
            }
            _ => i += 1,
        }
    }
    if start < input.len() {
        out.push(Line {
            content: &input[start..],
            terminator: b"",
        });
    }
    out
}

fn removed(frame: &[Line<'_>], rules: &Rules) -> bool {
    let mut event: Option<&[u8]> = None;
    let mut fields = false;
    let mut data = false;
    for line in frame {
        if line.content.first() == Some(&b':') {
            continue;
        }
        fields = true;
        let (name, value) = match line.content.iter().position(|&b| b == b':') {
            Some(c) => (&line.content[..c], &line.content[c + 1..]),
            None => (line.content, &b""[..]),
        };
        if name == b"event" {
            event = Some(value.strip_prefix(b" ").unwrap_or(value));
        } else if name == b"data" {
            data = true;
        }
    }
    let is = |names: &[Vec<u8>]| event.is_some_and(|e| names.iter().any(|r| r.as_slice() == e));
    is(&rules.remove) || (rules.sdk_safe && fields && !data && !is(&rules.opted_in))
}

fn push_frame(out: &mut Vec<u8>, frame: &[Line<'_>]) {
    for line in frame {
        out.extend_from_slice(line.content);
        out.extend_from_slice(line.terminator);
    }
}

/// Runs the model over a whole input.
pub fn filter(input: &[u8], rules: &Rules) -> Output {
    let mut out = Vec::new();
    let mut rest = input;
    if rest.starts_with(BOM) {
        out.extend_from_slice(BOM);
        rest = &rest[BOM.len()..];
    }
    let mut frame: Vec<Line<'_>> = Vec::new();
    for line in lines(rest) {
        let unterminated = line.terminator.is_empty();
        if line.content.is_empty() && !unterminated {
            if frame.is_empty() {
                out.extend_from_slice(line.terminator);
            } else {
                let keep = !removed(&frame, rules);
                if keep {
                    push_frame(&mut out, &frame);
                    out.extend_from_slice(line.terminator);
                }
                frame.clear();
            }
        } else {
            frame.push(line);
        }
    }
    // A BOM's first bytes at the very end are an open first line, not yet a BOM.
    let complete = if input.len() < BOM.len() && BOM.starts_with(input) {
        Vec::new()
    } else {
        out.clone()
    };
    if !frame.is_empty() && !removed(&frame, rules) {
        push_frame(&mut out, &frame);
    }
    Output {
        all: lead(input, out),
        complete: lead(input, complete),
    }
}

/// The one byte the layer adds: when the output would begin with a BOM that did not begin the
/// body, a LF (an empty line) goes first, so that no client strips that BOM as a byte order mark.
fn lead(input: &[u8], mut out: Vec<u8>) -> Vec<u8> {
    if out.starts_with(BOM) && !input.starts_with(BOM) {
        out.insert(0, b'\n');
    }
    out
}

/// `input` with every copy of `needle` taken out (left to right, copies do not overlap): what a
/// stream of whole marker frames becomes through the filter.
pub fn remove_all(input: &[u8], needle: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(input.len());
    let mut rest = input;
    while let Some(p) = memchr::memmem::find(rest, needle) {
        out.extend_from_slice(&rest[..p]);
        rest = &rest[p + needle.len()..];
    }
    out.extend_from_slice(rest);
    out
}
