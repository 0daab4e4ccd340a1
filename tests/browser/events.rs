//! What a browser's `EventSource` dispatches for a stream, and what it must dispatch for the
//! filtered stream, computed from the raw stream's own lines and frames.
//!
//! The raw stream is cut into lines and frames as the WHATWG grammar says (the grammar the layer
//! implements). The frames the layer must remove are taken out of that line list (with their
//! closing empty line), and the events are computed from what is left. Nothing here looks at the
//! layer's output bytes: whatever the layer forwards, the browser must dispatch what the kept
//! lines dispatch. The lastEventId of each event follows from the `id` fields of the kept lines
//! only, so an `id:` in a removed frame does not count.

/// The byte order mark.
pub(crate) const BOM: &[u8] = b"\xEF\xBB\xBF";

/// One dispatched event as the page records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Event {
    pub(crate) kind: String,
    pub(crate) data: String,
    pub(crate) last_event_id: String,
}

impl From<(String, String, String)> for Event {
    fn from((kind, data, last_event_id): (String, String, String)) -> Self {
        Event {
            kind,
            data,
            last_event_id,
        }
    }
}

/// A line of the stream: content and terminator (empty for an unterminated last line).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Line<'a> {
    pub(crate) content: &'a [u8],
    pub(crate) terminator: &'a [u8],
}

/// The stream cut into lines, after a leading BOM (which the UTF-8 decoder strips).
#[derive(Debug)]
pub(crate) struct Lines<'a> {
    pub(crate) bom: bool,
    pub(crate) lines: Vec<Line<'a>>,
}

/// Cuts `input` into lines ending in CRLF, LF or CR.
pub(crate) fn lines(input: &[u8]) -> Lines<'_> {
    let bom = input.starts_with(BOM);
    let rest = if bom { &input[BOM.len()..] } else { input };
    let mut lines = Vec::new();
    let (mut start, mut i) = (0, 0);
    while i < rest.len() {
        let end = match rest[i] {
            b'\n' => i + 1,
            b'\r' if rest.get(i + 1) == Some(&b'\n') => i + 2,
            b'\r' => i + 1,
            _ => {
                i += 1;
                continue;
            }
        };
        lines.push(Line {
            content: &rest[start..i],
            terminator: &rest[i..end],
        });
        i = end;
        start = end;
    }
    if start < rest.len() {
        lines.push(Line {
            content: &rest[start..],
            terminator: b"",
        });
    }
    Lines { bom, lines }
}

/// Field name and value of a non-comment line (one space after the colon removed).
pub(crate) fn field(content: &[u8]) -> (&[u8], &[u8]) {
    match content.iter().position(|&b| b == b':') {
        Some(c) => {
            let value = &content[c + 1..];
            (&content[..c], value.strip_prefix(b" ").unwrap_or(value))
        }
        None => (content, b""),
    }
}

/// What the layer is configured to remove, for one client.
#[derive(Debug, Clone)]
pub(crate) struct Removal {
    /// Event types whose frames are removed.
    pub(crate) types: Vec<&'static str>,
    /// SDK-safe mode: also remove frames with a field line and no `data` field ...
    pub(crate) sdk_safe: bool,
    /// ... unless their event type is one the client opted in to.
    pub(crate) opted_in: Vec<&'static str>,
}

impl Removal {
    /// Whether the layer must remove `frame` (its lines, closing empty line excluded).
    pub(crate) fn removes(&self, frame: &[Line<'_>]) -> bool {
        let mut kind: Option<&[u8]> = None;
        let (mut fields, mut data) = (false, false);
        for line in frame {
            if line.content.first() == Some(&b':') {
                continue;
            }
            fields = true;
            match field(line.content) {
                (b"event", value) => kind = Some(value),
                (b"data", _) => data = true,
                _ => {}
            }
        }
        let is = |names: &[&str]| kind.is_some_and(|k| names.iter().any(|n| n.as_bytes() == k));
        is(&self.types) || (self.sdk_safe && fields && !data && !is(&self.opted_in))
    }
}

/// The lines of `stream` that are left once the frames `removal` removes are taken out, each
/// with its closing empty line. A frame still open at the end is judged as it stands.
pub(crate) fn kept<'a>(stream: &Lines<'a>, removal: &Removal) -> Lines<'a> {
    let mut out = Vec::new();
    let mut frame: Vec<Line<'a>> = Vec::new();
    for line in &stream.lines {
        let closes = line.content.is_empty() && !line.terminator.is_empty();
        if !closes {
            frame.push(*line);
        } else if frame.is_empty() {
            out.push(*line);
        } else {
            if !removal.removes(&frame) {
                out.append(&mut frame);
                out.push(*line);
            }
            frame.clear();
        }
    }
    if !frame.is_empty() && !removal.removes(&frame) {
        out.append(&mut frame);
    }
    Lines {
        bom: stream.bom,
        lines: out,
    }
}

/// The events Chromium dispatches for a stream made of `stream`'s lines, in order.
///
/// This is the WHATWG interpretation with Chromium's one deviation: its parser checks the first
/// three bytes for a BOM and then takes the byte after them as line content, without looking
/// at it. So when a leading BOM is followed by CR or LF, that byte does not end a line:
/// - BOM CR LF: the first line is a lone CR, a field with an unknown name (no effect), and the
///   next line is read as usual;
/// - BOM LF or BOM CR (not followed by LF): that byte starts the next line, whose field name then
///   begins with it: the next line has no effect, whatever it was (a field, a comment, or the
///   empty line that would close a frame).
///
/// In WHATWG terms: the first line is empty, and with a CRLF it becomes a no-op field line; with
/// an LF or a lone CR it vanishes and the line after it becomes a no-op field line.
pub(crate) fn chromium_events(stream: &Lines<'_>) -> Vec<Event> {
    // Index of the line that Chromium reads as an unknown field, and of the one it skips.
    let (mut noop, mut skip) = (None, None);
    if stream.bom {
        if let Some(first) = stream.lines.first() {
            if first.content.is_empty() && first.terminator == b"\r\n" {
                noop = Some(0);
            } else if first.content.is_empty() {
                skip = Some(0);
                noop = Some(1);
            }
        }
    }
    let mut events = Vec::new();
    let (mut data, mut kind, mut id_buffer) = (Vec::new(), Vec::new(), Vec::new());
    let mut last_event_id = Vec::new();
    for (i, line) in stream.lines.iter().enumerate() {
        if skip == Some(i) || noop == Some(i) {
            continue;
        }
        if line.terminator.is_empty() {
            // An unterminated last line is never processed.
            break;
        }
        if line.content.is_empty() {
            last_event_id.clone_from(&id_buffer);
            if !data.is_empty() {
                data.pop(); // the LF after the last data line
                let kind = if kind.is_empty() {
                    "message".to_owned()
                } else {
                    String::from_utf8_lossy(&kind).into_owned()
                };
                events.push(Event {
                    kind,
                    data: String::from_utf8_lossy(&data).into_owned(),
                    last_event_id: String::from_utf8_lossy(&last_event_id).into_owned(),
                });
            }
            data.clear();
            kind.clear();
            continue;
        }
        if line.content[0] == b':' {
            continue;
        }
        match field(line.content) {
            (b"event", value) => kind = value.to_vec(),
            (b"data", value) => {
                data.extend_from_slice(value);
                data.push(b'\n');
            }
            (b"id", value) if !value.contains(&0) => id_buffer = value.to_vec(),
            _ => {}
        }
    }
    events
}

/// Every string a line of `bytes` could give as an event type, so the page can listen for it:
/// the value of each line whose field name is `event` (with and without a BOM in front), and
/// `message`.
pub(crate) fn possible_types(bytes: &[u8]) -> Vec<String> {
    let mut types = vec!["message".to_owned()];
    for piece in bytes.split(|&b| b == b'\r' || b == b'\n') {
        for piece in [piece, piece.strip_prefix(BOM).unwrap_or(piece)] {
            if let (b"event", value) = field(piece) {
                if !value.is_empty() {
                    types.push(String::from_utf8_lossy(value).into_owned());
                }
            }
        }
    }
    types.sort();
    types.dedup();
    types
}
