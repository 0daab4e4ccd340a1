//! The sans-IO frame scanner.
//!
//! [`Scanner`] is fed the data of a `text/event-stream` body one input slice at a time and answers
//! with [`Step`]s: how many of the next bytes to forward, to discard, or to hold because they belong
//! to a frame that has not closed yet. It never copies or allocates on its own (apart from a prefix
//! of at most a few dozen bytes of a line that spans inputs); the caller owns the bytes and the
//! buffer of held bytes. It knows nothing about `http`, bodies or async, so it is unit-tested and
//! fuzzed on plain slices.
//!
//! The grammar is the WHATWG event-stream grammar: lines end in CRLF, LF or CR; a frame is a run of
//! non-empty lines closed by an empty line; a frame's event type is the value of its last `event`
//! field.

use std::sync::Arc;

use crate::layer::{Config, Overflow};

const BOM: &[u8] = b"\xEF\xBB\xBF";
/// The bytes every `event` field line with a non-empty value starts with.
const EVENT_FIELD: &[u8] = b"event:";

/// What the caller does with the bytes at the front of the input it passed to [`Scanner::step`].
///
/// Every variant that carries `n` consumes the next `n` bytes of that input; the caller then passes
/// the rest of the input (from `n` on) to the next call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Forward the next `n` bytes unchanged.
    Forward(usize),
    /// Drop the next `n` bytes: they belong to a removed frame.
    Discard(usize),
    /// Append the next `n` bytes to the held bytes: a frame is open at the end of the input.
    Hold(usize),
    /// Append the next `n` bytes to the held bytes, then forward all held bytes.
    Release(usize),
    /// Drop the held bytes and the next `n` bytes: the held frame is removed.
    DiscardHeld(usize),
    /// The open frame outgrew the configured cap and the configuration says to fail.
    Overflow,
    /// The whole input has been consumed; feed more (or call [`Scanner::finish`]).
    NeedInput,
}

/// What a LF at the start of the next input belongs to, when the previous input ended with a CR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cr {
    None,
    /// The CR ended a non-empty line of the open frame.
    Frame,
    /// The CR ended an empty line whose bytes were forwarded.
    Forwarded,
    /// The CR ended the empty line that closed a removed frame.
    Discarded,
}

/// The frame that is open at the current position, if any.
#[derive(Debug, Clone, Copy, Default)]
struct Frame {
    open: bool,
    /// Bytes of the frame held by the caller (those before the current input).
    held: usize,
    /// Index of the configured name the last `event` field named, if it named one to remove.
    event: Option<u8>,
    /// The frame has a line that is not a comment.
    fields: bool,
    /// The frame has a `data` field.
    data: bool,
    /// The frame outgrew the cap and is being forwarded as it arrives.
    unfiltered: bool,
}

/// Incremental event-stream frame scanner for one response body.
#[derive(Debug)]
pub(crate) struct Scanner {
    config: Arc<Config>,
    /// Bit `i` set: frames whose event type is `config.names[i]` are removed.
    remove: u64,
    /// `Some(k)`: at the very start of the body, `k` bytes of a BOM matched so far.
    bom: Option<u8>,
    cr: Cr,
    frame: Frame,
    /// Length of the current line so far (0 at a line start).
    line_len: usize,
    /// Prefix (at most `config.line_cap` bytes) of a line that spans inputs.
    line: Vec<u8>,
    queued: Option<Step>,
    /// Index of the configured name that made the last removed frame go (`None`: SDK-safe rule).
    last_removed: Option<u8>,
}

impl Scanner {
    /// A scanner for a body in which the names selected by `remove` (a bit mask over
    /// `config.names`) are removed.
    pub(crate) fn new(config: Arc<Config>, remove: u64) -> Self {
        Self {
            config,
            remove,
            bom: Some(0),
            cr: Cr::None,
            frame: Frame::default(),
            line_len: 0,
            line: Vec::new(),
            queued: None,
            last_removed: None,
        }
    }

    /// The configured name that caused the most recent removal, or `None` when the SDK-safe rule
    /// (a frame with fields but no `data`) did.
    #[cfg_attr(not(feature = "tracing"), allow(dead_code))]
    pub(crate) fn last_removed_name(&self) -> Option<&str> {
        self.last_removed
            .map(|i| &*self.config.names[usize::from(i)].name)
    }

    /// The cap on held bytes, for the error that reports it.
    pub(crate) fn max_frame_bytes(&self) -> usize {
        self.config.max_frame_bytes
    }

    /// True when no partial line, frame, CR or BOM is pending: the end of the body here yields
    /// nothing more.
    pub(crate) fn is_idle(&self) -> bool {
        self.queued.is_none() && !self.frame.open && !matches!(self.bom, Some(k) if k > 0)
    }

    /// Decides what to do with the front of `input`. Call again with the rest of the input until it
    /// returns [`Step::NeedInput`].
    pub(crate) fn step(&mut self, input: &[u8]) -> Step {
        if let Some(step) = self.queued.take() {
            return step;
        }
        if input.is_empty() {
            return Step::NeedInput;
        }
        let mut i = 0;

        // A LF completing a CRLF whose CR ended the previous input.
        let cr = std::mem::replace(&mut self.cr, Cr::None);
        if cr != Cr::None && input[0] == b'\n' {
            match cr {
                Cr::Discarded => return Step::Discard(1),
                Cr::Frame | Cr::Forwarded | Cr::None => i = 1,
            }
        }

        if let Some(matched) = self.bom {
            match self.step_bom(input, matched) {
                Ok(step) => return step,
                Err(next) => i = next,
            }
        }

        if self.frame.open {
            return self.continue_frame(input, i);
        }
        self.run(input, i)
    }

    /// Matches a leading BOM. `Ok` is the step to return; `Err(i)` means go on scanning at `i`.
    fn step_bom(&mut self, input: &[u8], matched: u8) -> Result<Step, usize> {
        let before = usize::from(matched);
        let mut k = before;
        let mut i = 0;
        while k < BOM.len() && i < input.len() && input[i] == BOM[k] {
            k += 1;
            i += 1;
        }
        if k == BOM.len() {
            self.bom = None;
            if before > 0 {
                // The BOM's first bytes are held: release them with the rest of the BOM.
                return Ok(Step::Release(i));
            }
            // Forwarded as part of the run that starts at 0.
            return Err(i);
        }
        if i == input.len() {
            // Still a BOM prefix; wait for the next input.
            self.bom = Some(k as u8);
            return Ok(Step::Hold(i));
        }
        // Not a BOM: the bytes matched so far start the first line of the first frame. Those in
        // this input are scanned again as line bytes; those held open the frame.
        self.bom = None;
        if before > 0 {
            self.frame = Frame {
                open: true,
                held: before,
                ..Frame::default()
            };
            self.line.clear();
            self.line.extend_from_slice(&BOM[..before]);
            self.line_len = before;
        }
        Err(0)
    }

    /// Scans from `i` in a frame that started before this input.
    fn continue_frame(&mut self, input: &[u8], i: usize) -> Step {
        match self.scan_frame(input, i) {
            Some(end) => {
                let frame = std::mem::take(&mut self.frame);
                if frame.unfiltered {
                    self.mark_cr(input, end, Cr::Forwarded);
                    Step::Forward(end)
                } else if self.removes(&frame) {
                    self.mark_cr(input, end, Cr::Discarded);
                    Step::DiscardHeld(end)
                } else {
                    self.mark_cr(input, end, Cr::Forwarded);
                    Step::Release(end)
                }
            }
            None if self.frame.unfiltered => Step::Forward(input.len()),
            None => {
                let held = self.frame.held + input.len();
                if held <= self.config.max_frame_bytes {
                    self.frame.held = held;
                    return Step::Hold(input.len());
                }
                match self.config.on_overflow {
                    Overflow::Error => Step::Overflow,
                    Overflow::Forward => {
                        self.frame.unfiltered = true;
                        self.queued = Some(Step::Forward(input.len()));
                        Step::Release(0)
                    }
                }
            }
        }
    }

    /// Scans from `i`, at a line start outside any frame: everything up to the first frame that is
    /// removed or left open is forwarded as one run.
    fn run(&mut self, input: &[u8], mut i: usize) -> Step {
        let len = input.len();
        // Where the next `event:` starts; frames before it cannot be removed (see `skip_to`).
        let mut next_event = 0;
        while i < len {
            let b = input[i];
            if b == b'\n' || b == b'\r' {
                // A stray empty line between frames.
                i = self.end_of_terminator(input, i, Cr::Forwarded);
                continue;
            }
            if !self.config.sdk_safe {
                if next_event <= i {
                    next_event = memchr::memmem::find(&input[i..], EVENT_FIELD).map_or(len, |p| i + p);
                }
                if let Some(end) = last_blank_line_end(input, i, next_event) {
                    i = end;
                    if i == len && input[len - 1] == b'\r' {
                        self.cr = Cr::Forwarded;
                    }
                    continue;
                }
            }
            let start = i;
            self.frame = Frame {
                open: true,
                ..Frame::default()
            };
            match self.scan_frame(input, start) {
                Some(end) => {
                    let frame = std::mem::take(&mut self.frame);
                    if !self.removes(&frame) {
                        self.mark_cr(input, end, Cr::Forwarded);
                        i = end;
                        continue;
                    }
                    self.mark_cr(input, end, Cr::Discarded);
                    if start == 0 {
                        return Step::Discard(end);
                    }
                    self.queued = Some(Step::Discard(end - start));
                    return Step::Forward(start);
                }
                None => {
                    let rest = len - start;
                    let open = if rest <= self.config.max_frame_bytes {
                        self.frame.held = rest;
                        Step::Hold(rest)
                    } else {
                        match self.config.on_overflow {
                            Overflow::Error => Step::Overflow,
                            Overflow::Forward => {
                                self.frame.unfiltered = true;
                                return Step::Forward(len);
                            }
                        }
                    };
                    if start == 0 {
                        return open;
                    }
                    self.queued = Some(open);
                    return Step::Forward(start);
                }
            }
        }
        Step::Forward(len)
    }

    /// Scans the lines of the open frame from `i` (which may be mid-line). Returns the end of the
    /// frame's closing empty line, or `None` when the input ends first.
    fn scan_frame(&mut self, input: &[u8], mut i: usize) -> Option<usize> {
        loop {
            let Some(off) = memchr::memchr2(b'\n', b'\r', &input[i..]) else {
                let part = &input[i..];
                self.push_line_part(part);
                self.line_len += part.len();
                return None;
            };
            let t = i + off;
            if self.line_len == 0 && off == 0 {
                // The empty line that closes the frame.
                return Some(self.end_of_terminator_raw(input, t));
            }
            if self.line_len == 0 {
                self.classify_line(&input[i..t], off);
            } else {
                self.push_line_part(&input[i..t]);
                let total = self.line_len + off;
                let line = std::mem::take(&mut self.line);
                self.classify_line(&line, total);
                self.line = line;
                self.line.clear();
                self.line_len = 0;
            }
            i = self.end_of_terminator(input, t, Cr::Frame);
            if i == input.len() {
                return None;
            }
        }
    }

    fn push_line_part(&mut self, part: &[u8]) {
        let room = self.config.line_cap.saturating_sub(self.line.len());
        self.line.extend_from_slice(&part[..part.len().min(room)]);
    }

    /// Updates the frame from one complete non-empty line. `line` holds at least the first
    /// `config.line_cap` bytes of a line that is `len` bytes long.
    fn classify_line(&mut self, line: &[u8], len: usize) {
        if line[0] == b':' {
            return;
        }
        self.frame.fields = true;
        let (name, value) = match memchr::memchr(b':', line) {
            Some(c) => (&line[..c], &line[c + 1..]),
            None => (line, &[][..]),
        };
        if name == b"data" {
            self.frame.data = true;
        } else if name == b"event" {
            self.frame.event = if len > line.len() {
                // Longer than any configured name could make it.
                None
            } else {
                let value = value.strip_prefix(b" ").unwrap_or(value);
                self.config.find(value, self.remove)
            };
        }
    }

    fn removes(&mut self, frame: &Frame) -> bool {
        if frame.event.is_some() {
            self.last_removed = frame.event;
            return true;
        }
        if self.config.sdk_safe && frame.fields && !frame.data {
            self.last_removed = None;
            return true;
        }
        false
    }

    /// The index just past the line terminator that starts at `t`.
    fn end_of_terminator_raw(&self, input: &[u8], t: usize) -> usize {
        if input[t] == b'\r' && input.get(t + 1) == Some(&b'\n') {
            t + 2
        } else {
            t + 1
        }
    }

    /// Like [`Self::end_of_terminator_raw`], and a CR that ends the input leaves `cr` behind.
    fn end_of_terminator(&mut self, input: &[u8], t: usize, cr: Cr) -> usize {
        let end = self.end_of_terminator_raw(input, t);
        self.mark_cr(input, end, cr);
        end
    }

    /// When `end` (the end of a terminator) is the end of the input and that terminator is a lone
    /// CR, remembers what a LF at the start of the next input belongs to.
    fn mark_cr(&mut self, input: &[u8], end: usize, cr: Cr) {
        if end == input.len() && input[end - 1] == b'\r' {
            self.cr = cr;
        }
    }

    /// Ends the body: judges a frame left open, as it stands.
    pub(crate) fn finish(&mut self) -> Step {
        self.cr = Cr::None;
        if let Some(step) = self.queued.take() {
            return step;
        }
        if matches!(self.bom.take(), Some(k) if k > 0) {
            // An unterminated first line made of a BOM's first bytes: no event, kept.
            return Step::Release(0);
        }
        if !self.frame.open {
            return Step::NeedInput;
        }
        if self.line_len > 0 {
            let line = std::mem::take(&mut self.line);
            self.classify_line(&line, self.line_len);
            self.line_len = 0;
        }
        let frame = std::mem::take(&mut self.frame);
        if frame.unfiltered {
            Step::NeedInput
        } else if self.removes(&frame) {
            Step::DiscardHeld(0)
        } else {
            Step::Release(0)
        }
    }
}

/// The end of the last empty line that lies wholly in `input[from..until]` and is not at `from`
/// itself, where `from` is a line start outside any frame. Everything in `input[from..end]` is
/// then whole frames and empty lines.
fn last_blank_line_end(input: &[u8], from: usize, until: usize) -> Option<usize> {
    let mut hi = until;
    while hi > from + 1 {
        let j = from + memchr::memrchr2(b'\n', b'\r', &input[from..hi])?;
        if j == from {
            return None;
        }
        let p = input[j - 1];
        if (p == b'\n' || p == b'\r') && !(p == b'\r' && input[j] == b'\n') {
            // `input[j]` starts the terminator of an empty line.
            let end = if input[j] == b'\r' && input.get(j + 1) == Some(&b'\n') {
                j + 2
            } else {
                j + 1
            };
            return Some(end);
        }
        hi = j;
    }
    None
}
