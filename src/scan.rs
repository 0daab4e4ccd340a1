//! The sans-IO frame scanner.
//!
//! [`Scanner`] is fed the data of a `text/event-stream` body one input slice at a time and answers
//! with [`Step`]s: how many of the next bytes to forward, to discard, or to hold because they belong
//! to a frame that has not closed yet. It never copies or allocates on its own (apart from the
//! prefix of a line that spans inputs: at most `event: ` and the longest configured name, 263 bytes
//! with a name of [`MAX_NAME_LEN`](crate::MAX_NAME_LEN)); the caller owns the bytes and the
//! buffer of held bytes. It knows nothing about `http`, bodies or async, so it is unit-tested and
//! fuzzed on plain slices.
//!
//! The grammar is the WHATWG event-stream grammar: lines end in CRLF, LF or CR; a frame is a run of
//! non-empty lines closed by an empty line; a frame's event type is the value of its last `event`
//! field.

use std::sync::Arc;

use crate::config::{Config, Overflow};

const BOM: &[u8] = b"\xEF\xBB\xBF";

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
    /// Drop the next `n` bytes: the LF of a CRLF that closed a removed frame, whose CR ended the
    /// previous input. Part of that frame, not a frame of its own.
    DiscardLf(usize),
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
    /// Index of the configured name the last `event` field named, if the client opted in to it:
    /// the frame is forwarded whatever the SDK-safe rule says.
    opted_in: Option<u8>,
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
    /// The last frame boundary of the current input, once [`Self::run`] has looked for it.
    boundary: Option<Boundary>,
    /// `Some(k)`: nothing has been forwarded yet, and the body did not begin with a BOM; the
    /// forwarded bytes so far withheld are `BOM[..k]` (see [`Self::lead`]).
    lead: Option<u8>,
    /// The request's own observer ([`FrameObserver::for_request`]), in place of the
    /// configuration's.
    ///
    /// [`FrameObserver::for_request`]: crate::FrameObserver::for_request
    observer: Option<crate::observe::Observer>,
    /// The request's span, for the event of a frame forwarded unfiltered (set by the filter).
    #[cfg(feature = "tracing")]
    pub(crate) span: tracing::Span,
}

/// What a driver forwards for the next bytes it would forward (see [`Scanner::lead`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lead {
    /// The bytes, as they are.
    Pass,
    /// These bytes first, then the bytes: a LF that keeps a BOM from becoming the start of the
    /// output, and/or the first bytes of a BOM withheld so far.
    Prefix(&'static [u8]),
    /// Nothing yet: the bytes are the first bytes of a BOM; the scanner remembers them.
    Wait,
}

/// A LF, then the first two bytes of a BOM: every prefix [`Lead::Prefix`] gives with a LF.
const LF_BOM: &[u8] = b"\n\xEF\xBB";

/// Where the last empty line of an input ends, kept so that it is looked for once per input: a
/// removal ends a run, and the next run starts on the rest of the same input.
#[derive(Debug, Clone, Copy)]
struct Boundary {
    /// The address just past the input's last byte: the rest of an input ends where it did.
    input_end: usize,
    /// The end of the input's last empty line, as an offset back from the input's end (`None`:
    /// the input has no empty line after the line start the search began at).
    from_end: Option<usize>,
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
            boundary: None,
            lead: Some(0),
            observer: None,
            #[cfg(feature = "tracing")]
            span: tracing::Span::none(),
        }
    }

    /// A frame outgrew `max_frame_bytes` under [`Overflow::Forward`]: it goes out unfiltered.
    /// Told to the observer and, with `tracing`, the request's span.
    #[cold]
    #[inline(never)]
    fn note_forwarded_oversized(&self) {
        let limit = self.config.max_frame_bytes;
        if let Some(observer) = self.observer() {
            observer.frame_too_large(limit, true);
        }
        #[cfg(feature = "tracing")]
        {
            let _span = self.span.enter();
            tracing::warn!(
                limit,
                "a frame outgrew max_frame_bytes and is forwarded unfiltered (Overflow::Forward)"
            );
        }
    }

    /// Whether the bytes the driver forwards must still go through [`Self::lead`]: true until the
    /// first bytes that are not the start of a BOM have been forwarded.
    #[inline]
    pub(crate) fn lead_open(&self) -> bool {
        self.lead.is_some()
    }

    /// The only bytes the layer adds. A BOM is stripped by every client's UTF-8 decoder when it is
    /// the first thing in the stream, so a BOM that was not at the start of the body (the first
    /// bytes of a kept frame after removed ones) must not become the start of the output: then
    /// a LF goes first, an empty line, which is a no-op at that point of the grammar. A body that
    /// began with a BOM forwards it first, and every later BOM is content.
    ///
    /// The driver calls this with the non-empty bytes it is about to forward while
    /// [`Self::lead_open`], and forwards what the answer says. Withholds at most two bytes (the
    /// first bytes of a BOM, when the bytes forwarded so far are only those).
    pub(crate) fn lead(&mut self, out: &[u8]) -> Lead {
        let Some(k) = self.lead else {
            return Lead::Pass;
        };
        let k = usize::from(k);
        let matched = BOM[k..].iter().zip(out).take_while(|(a, b)| a == b).count();
        if k + matched == BOM.len() {
            self.lead = None;
            return Lead::Prefix(&LF_BOM[..1 + k]);
        }
        if matched == out.len() {
            self.lead = Some((k + matched) as u8);
            return Lead::Wait;
        }
        self.lead = None;
        if k == 0 {
            Lead::Pass
        } else {
            Lead::Prefix(&BOM[..k])
        }
    }

    /// The end of the output: the first bytes of a BOM still withheld by [`Self::lead`], which
    /// can no longer become a BOM.
    pub(crate) fn lead_end(&mut self) -> &'static [u8] {
        match self.lead.take() {
            Some(k) => &BOM[..usize::from(k)],
            None => &[],
        }
    }

    /// An upper bound on the bytes [`Self::lead`] may still add or has withheld.
    pub(crate) fn lead_owed(&self) -> usize {
        self.lead.map_or(0, |k| 1 + usize::from(k))
    }

    /// The configured name that caused the most recent removal, or `None` when the SDK-safe rule
    /// (a frame with fields but no `data`) did.
    pub(crate) fn last_removed_name(&self) -> Option<&str> {
        self.last_removed
            .map(|i| &*self.config.names[usize::from(i)].name)
    }

    /// The request's observer, or else the configuration's, if any.
    #[inline]
    pub(crate) fn observer(&self) -> Option<&dyn crate::observe::FrameObserver> {
        self.observer
            .as_ref()
            .or(self.config.observer.as_ref())
            .map(|o| &*o.0)
    }

    /// Tells `observer` of this body's frames instead of the configuration's observer.
    pub(crate) fn set_observer(&mut self, observer: Option<crate::observe::Observer>) {
        self.observer = observer;
    }

    /// The cap on held bytes, for the error that reports it.
    pub(crate) fn max_frame_bytes(&self) -> usize {
        self.config.max_frame_bytes
    }

    /// True when no partial line, frame, CR or BOM is pending: the end of the body here yields
    /// nothing more.
    pub(crate) fn is_idle(&self) -> bool {
        self.queued.is_none()
            && !self.frame.open
            && !matches!(self.bom, Some(k) if k > 0)
            && !matches!(self.lead, Some(k) if k > 0)
    }

    /// [`Self::step`] for the common case of small chunks: the input continues a frame that is
    /// held, and nothing else (a CR, a BOM, a queued step) is pending. Returns `None`, having
    /// changed nothing, when that is not the case; then call [`Self::step`].
    ///
    /// Always inlined: it is most of the work on such a chunk, and once `Frames::edit` called it
    /// too, LLVM stopped inlining it into `Frames::drain`, the tower body's path (about 20
    /// instructions more per chunk of a 61-byte split, by callgrind).
    #[inline(always)]
    pub(crate) fn step_in_frame(&mut self, input: &[u8]) -> Option<Step> {
        if !self.frame.open
            || self.frame.unfiltered
            || self.queued.is_some()
            || self.cr != Cr::None
            || self.bom.is_some()
        {
            return None;
        }
        match find_line_end(input) {
            // The frame and its line go on past the input: hold all of it.
            None => {
                let held = self.frame.held + input.len();
                if held > self.config.max_frame_bytes {
                    return None;
                }
                self.push_line_part(input);
                self.line_len += input.len();
                self.frame.held = held;
                Some(Step::Hold(input.len()))
            }
            Some(t) => Some(self.continue_frame(input, 0, Some(t))),
        }
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
        match std::mem::replace(&mut self.cr, Cr::None) {
            Cr::Discarded if input[0] == b'\n' => return Step::DiscardLf(1),
            Cr::Frame if input[0] == b'\n' => i = 1,
            _ => {}
        }

        if let Some(matched) = self.bom {
            match self.step_bom(input, matched) {
                Ok(step) => return step,
                Err(next) => i = next,
            }
        }

        if self.frame.open {
            return self.continue_frame(input, i, None);
        }
        if i == 0 {
            if let Some(step) = self.whole_frames(input) {
                return step;
            }
        }
        self.run(input, i)
    }

    /// [`Self::run`] for the commonest input of all, a chunk of whole frames (one chat event, or
    /// a few) that names no event: it ends with an empty line and holds no `event:`, so it is
    /// forwarded whole after one search, without the bookkeeping of a run. `None`, having changed
    /// nothing, for any other input; `run` decides the same way for these, and would answer the
    /// same.
    #[inline]
    fn whole_frames(&mut self, input: &[u8]) -> Option<Step> {
        let len = input.len();
        if self.config.sdk_safe || !(SHORT_SEARCH..LONG_LINE).contains(&len) {
            return None;
        }
        if len <= TOUCH_LINES_MAX {
            touch_lines(input);
        }
        if self.config.event_finder.find(input).is_some() || !input.ends_with(b"\n\n") {
            return None;
        }
        self.boundary = None;
        Some(Step::Forward(len))
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
            // The body began with a BOM: forwarded first, as it is.
            self.lead = None;
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
    /// `first_line_end`: the offset from `i` of the first line end, when already known.
    fn continue_frame(&mut self, input: &[u8], i: usize, first_line_end: Option<usize>) -> Step {
        match self.scan_frame(input, i, first_line_end) {
            Some(end) => {
                let frame = std::mem::take(&mut self.frame);
                if frame.unfiltered {
                    Step::Forward(end)
                } else if self.removes(&frame) {
                    self.mark_cr(input, end, Cr::Discarded);
                    Step::DiscardHeld(end)
                } else {
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
                        self.note_forwarded_oversized();
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
        // Where the next `event:` starts: the frames before it cannot be removed, so they are
        // skipped in bulk, up to their last empty line (see `last_blank_line_end`).
        let mut next_event = 0;
        while i < len {
            let b = input[i];
            if b == b'\n' || b == b'\r' {
                // A stray empty line between frames. (A LF after a CR that ends the input is one
                // too, as far as what to do with it goes: it is forwarded.)
                i = self.end_of_terminator_raw(input, i);
                continue;
            }
            // A rest shorter than one vector search holds at most a frame or two: walking its
            // lines costs less than looking for its last frame boundary and for `event:`.
            if !self.config.sdk_safe && len - i >= SHORT_SEARCH {
                if next_event <= i {
                    // Only whole frames can be skipped, so `event:` is only looked for up to the
                    // last frame boundary: a chunk that ends mid-frame with no boundary after `i`
                    // (the common case for small chunks) costs no search at all.
                    let boundary = if long_line_ahead(input, i) {
                        // Searching a long line for `event:` costs more than walking it line by
                        // line, which visits it once with `memchr2`.
                        None
                    } else {
                        self.last_boundary(input, i)
                    };
                    next_event = match boundary {
                        None => i,
                        Some(end) => match self.config.event_finder.find(&input[i..end]) {
                            Some(p) => i + p,
                            None => {
                                // Every frame up to the boundary can be skipped.
                                i = end;
                                continue;
                            }
                        },
                    };
                }
                // Searches back from the `event:` only as far as the start of its frame, which is
                // then scanned: each byte is visited a bounded number of times.
                if let Some(end) = last_blank_line_end(input, i, next_event) {
                    i = end;
                    continue;
                }
            }
            let start = i;
            self.frame = Frame {
                open: true,
                ..Frame::default()
            };
            match self.scan_frame(input, start, None) {
                Some(end) => {
                    let frame = std::mem::take(&mut self.frame);
                    if !self.removes(&frame) {
                        i = end;
                        continue;
                    }
                    self.mark_cr(input, end, Cr::Discarded);
                    if end == len {
                        self.boundary = None;
                    }
                    if start == 0 {
                        return Step::Discard(end);
                    }
                    self.queued = Some(Step::Discard(end - start));
                    return Step::Forward(start);
                }
                None => {
                    self.boundary = None;
                    let rest = len - start;
                    let open = if rest <= self.config.max_frame_bytes {
                        self.frame.held = rest;
                        Step::Hold(rest)
                    } else {
                        match self.config.on_overflow {
                            Overflow::Error => Step::Overflow,
                            Overflow::Forward => {
                                self.note_forwarded_oversized();
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
        self.boundary = None;
        Step::Forward(len)
    }

    /// The end of the last empty line of `input` after `i` (a line start outside any frame), if
    /// there is one. Searched for once per input: the rest of an input that a removal cut (and
    /// that the next run starts on) ends at the same address, and the answer is kept until a run
    /// consumes the input to its end. Searching again on every run would make a chunk of many
    /// removed frames before a long open frame cost frames x tail.
    fn last_boundary(&mut self, input: &[u8], i: usize) -> Option<usize> {
        let len = input.len();
        let input_end = input.as_ptr() as usize + len;
        let from_end = match self.boundary {
            Some(b) if b.input_end == input_end => b.from_end,
            _ => {
                let from_end = last_blank_line_end(input, i, len).map(|end| len - end);
                self.boundary = Some(Boundary {
                    input_end,
                    from_end,
                });
                from_end
            }
        };
        // An empty line found from an earlier line start lies after `i` exactly when it ends
        // after it (`i` is no line end, so it cannot be inside that line's terminator).
        let end = len.checked_sub(from_end?)?;
        (end > i).then_some(end)
    }

    /// Scans the lines of the open frame from `i` (which may be mid-line). Returns the end of the
    /// frame's closing empty line, or `None` when the input ends first.
    ///
    /// `first_line_end`: the offset from `i` of the first line end, when already known.
    fn scan_frame(
        &mut self,
        input: &[u8],
        mut i: usize,
        mut first_line_end: Option<usize>,
    ) -> Option<usize> {
        loop {
            let found = match first_line_end.take() {
                Some(off) => Some(off),
                None => find_line_end(&input[i..]),
            };
            let Some(off) = found else {
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
        // Past the cap (the usual case in a long `data` line), nothing is copied.
        if room > 0 {
            self.line.extend_from_slice(&part[..part.len().min(room)]);
        }
    }

    /// Updates the frame from one complete non-empty line. `line` holds at least the first
    /// `config.line_cap` bytes of a line that is `len` bytes long.
    fn classify_line(&mut self, line: &[u8], len: usize) {
        if line[0] == b':' {
            return;
        }
        self.frame.fields = true;
        // Only the names `data` and `event` matter, so the colon is looked for in the first six
        // bytes; a line without one there has some other name.
        let (name, value) = match line.iter().take(6).position(|&b| b == b':') {
            Some(c) => (&line[..c], &line[c + 1..]),
            None if len < 6 => (line, &[][..]),
            None => return,
        };
        if name == b"data" {
            self.frame.data = true;
        } else if name == b"event" {
            // Longer than any configured name could make it: no configured name.
            let found = if len > line.len() {
                None
            } else {
                let value = value.strip_prefix(b" ").unwrap_or(value);
                self.config.find(value, u64::MAX)
            };
            (self.frame.event, self.frame.opted_in) = match found {
                Some(i) if self.remove & (1 << i) != 0 => (Some(i), None),
                // A configured name that is not removed: the client opted in to it.
                Some(i) => (None, Some(i)),
                None => (None, None),
            };
        }
    }

    fn removes(&mut self, frame: &Frame) -> bool {
        if frame.event.is_some() {
            self.last_removed = frame.event;
            return true;
        }
        if let Some(i) = frame.opted_in {
            if let Some(observer) = self.observer() {
                observer.frame_forwarded(&self.config.names[usize::from(i)].name);
            }
            return false;
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
            // An unterminated first line made of a BOM's first bytes: a field line with no event
            // and no data, removed only in SDK-safe mode.
            if self.config.sdk_safe {
                self.last_removed = None;
                return Step::DiscardHeld(0);
            }
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

/// Inputs shorter than this are searched for line ends with an inlined SSE2 routine; longer ones
/// go through `memchr2`, which picks the widest vectors the CPU has (AVX2) at the cost of a call
/// through a function pointer and a choice of routine by length.
const SHORT_SEARCH: usize = 64;

/// The longest chunk [`touch_lines`] reads ahead: 16 cache lines, several chat events.
const TOUCH_LINES_MAX: usize = 1024;

/// The first CR or LF in `hay`.
#[inline]
fn find_line_end(hay: &[u8]) -> Option<usize> {
    search_line_ends(hay, false)
}

/// The last CR or LF in `hay`.
#[inline]
fn rfind_line_end(hay: &[u8]) -> Option<usize> {
    search_line_ends(hay, true)
}

/// Most inputs the scanner searches are short: the rest of a line in a small chunk, or a chunk of
/// a few bytes. For those, `memchr2`'s set-up costs more than the search.
#[inline(always)]
fn search_line_ends(hay: &[u8], last: bool) -> Option<usize> {
    #[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
    if hay.len() < SHORT_SEARCH {
        // SSE2 is part of the x86-64 baseline, so this needs no runtime check and is inlined.
        if let Some(two) = memchr::arch::x86_64::sse2::memchr::Two::new(b'\n', b'\r') {
            return if last { two.rfind(hay) } else { two.find(hay) };
        }
    }
    if last {
        memchr::memrchr2(b'\n', b'\r', hay)
    } else {
        memchr::memchr2(b'\n', b'\r', hay)
    }
}

/// How far a line must run, with no line end in its first [`LONG_LINE_PROBE`] bytes, to be walked
/// rather than searched for `event:`.
const LONG_LINE: usize = 16 * 1024;
const LONG_LINE_PROBE: usize = 1024;

/// Whether the line at `i` looks long (think 64 KiB `data:` events): at least [`LONG_LINE`] bytes
/// of input left and no line end among the first [`LONG_LINE_PROBE`].
fn long_line_ahead(input: &[u8], i: usize) -> bool {
    input.len() - i >= LONG_LINE
        && memchr::memchr2(b'\n', b'\r', &input[i..i + LONG_LINE_PROBE]).is_none()
}

/// The end of the last empty line that lies wholly in `input[from..until]` and is not at `from`
/// itself, where `from` is a line start outside any frame. Everything in `input[from..end]` is
/// then whole frames and empty lines.
fn last_blank_line_end(input: &[u8], from: usize, until: usize) -> Option<usize> {
    // The common case: a chunk of whole frames that ends in "\n\n".
    if until >= from + 2 && input[until - 1] == b'\n' && input[until - 2] == b'\n' {
        return Some(until);
    }
    let mut hi = until;
    while hi > from + 1 {
        let j = from + rfind_line_end(&input[from..hi])?;
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

/// Reads one byte of every cache line of `input`, with loads that do not depend on each other, so
/// that the processor fetches the lines at the same time rather than one after another.
///
/// A chunk fresh from a socket is often not in the cache: the kernel copied it into hyper's read
/// buffer before the events ahead of it were written out, and their system calls evicted it. In
/// the sidecar proxy (one chat event per chunk) the first reads of the chunk were then the
/// layer's largest cost per event, each line a miss of its own. Touching every line first makes
/// the misses overlap: `proxy_bench --throughput-only --rounds 1000 --events 300` went from 0.963
/// to 0.985 of `--no-layer` (BENCHMARKS.md as of b155826, "Through the sidecar proxy"). A proxy without the
/// layer never reads the bytes at all: the kernel copies them from the buffer to the client.
///
/// Only chunks of up to [`TOUCH_LINES_MAX`] bytes are touched. Longer chunks are read as a
/// sequential stream that the hardware prefetcher follows by itself, and when they are in the cache
/// already, touching them first is pure cost: with 16 chat events a chunk (3.7 KiB) in the cache,
/// it took the layer from 2.8 to 2.0 times the speed of the `memchr2` floor (BENCHMARKS.md as of
/// 57eacbb, in the repository's history).
#[inline]
fn touch_lines(input: &[u8]) {
    let sum = input.iter().step_by(64).fold(0u8, |sum, &b| sum ^ b);
    // Keeps the loads: their result is otherwise unused.
    std::hint::black_box(sum);
}

#[cfg(test)]
// The test driver `drive_chunks` follows the module.
#[allow(clippy::items_after_test_module)]
mod tests {
    //! The scanner's steps, held bytes and masks. What it makes of whole inputs, split everywhere
    //! and held to the reference model, is in `tests/scanner.rs`, through the public filter.

    use super::*;
    use crate::BypassMarkerLayer;

    const MARKER: &[u8] = b"event: x-bypass-remote-prefill\n: true\n\n";
    const CHUNK: &[u8] = b"data: {\"id\":1}\n\n";

    fn scanner(layer: &BypassMarkerLayer) -> Scanner {
        let config = layer.config.clone();
        let remove = config.removal_mask(0);
        Scanner::new(config, remove)
    }

    /// What the scanner makes of `input` in one chunk, as the body drives it.
    fn filtered(layer: &BypassMarkerLayer, input: &[u8]) -> Vec<u8> {
        let mut s = scanner(layer);
        let out = drive_chunks(&mut s, &[input], |_| {}).expect("no overflow");
        assert!(s.is_idle());
        out
    }

    struct Esc<'a>(&'a [u8]);
    impl PartialEq for Esc<'_> {
        fn eq(&self, other: &Self) -> bool {
            self.0 == other.0
        }
    }
    impl std::fmt::Debug for Esc<'_> {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "\"{}\"", self.0.escape_ascii())
        }
    }

    fn cat(parts: &[&[u8]]) -> Vec<u8> {
        parts.concat()
    }

    #[test]
    fn a_frame_forwarded_as_it_arrives_withholds_at_most_two_bom_bytes() {
        // With a cap of 1 byte, the frame after the marker is forwarded as it arrives: its first
        // bytes come out one chunk at a time, and the output still must not begin with a BOM.
        let layer = BypassMarkerLayer::new().max_frame_bytes(1);
        let input = cat(&[MARKER, BOM, b"data: 2\n\n"]);
        let expected = cat(&[b"\n", BOM, b"data: 2\n\n"]);
        for parts in [
            vec![MARKER, b"\xEF", b"\xBB", b"\xBF", b"data: 2\n\n"],
            vec![MARKER, b"\xEF\xBB", b"\xBFdata: 2\n\n"],
            vec![&input[..]],
        ] {
            let mut s = scanner(&layer);
            let mut yielded = Vec::new();
            let out = drive_chunks(&mut s, &parts, |out| yielded.push(out.len())).unwrap();
            assert_eq!(Esc(&out), Esc(&expected), "{parts:?}");
            if parts.len() == 5 {
                // Nothing of the BOM is out before its third byte; then the LF comes first.
                assert_eq!(yielded, [0, 0, 0, 4, expected.len()]);
            }
        }
        // The first bytes of a BOM, then something else: forwarded unchanged, once known.
        let mut s = scanner(&layer);
        let mut yielded = Vec::new();
        let parts: [&[u8]; 3] = [MARKER, b"\xEF\xBB", b"x\n\n"];
        let out = drive_chunks(&mut s, &parts, |out| yielded.push(out.len())).unwrap();
        assert_eq!(Esc(&out), Esc(b"\xEF\xBBx\n\n"));
        assert_eq!(yielded, [0, 0, 5]);
        // And at the end of the body.
        let mut s = scanner(&layer);
        let parts: [&[u8]; 2] = [MARKER, b"\xEF\xBB"];
        let out = drive_chunks(&mut s, &parts, |_| {}).unwrap();
        assert_eq!(Esc(&out), Esc(b"\xEF\xBB"));
    }

    #[test]
    fn sdk_safe_mode_keeps_the_frames_the_client_opted_in_to() {
        let layer = BypassMarkerLayer::new().opt_in("request_id").sdk_safe(true);
        let config = layer.config.clone();
        let requested: crate::RequestedAnnotations = ["request_id", BYPASS].into_iter().collect();
        let mask = config.removal_mask(config.requested_mask(&requested));
        let input = cat(&[
            MARKER,
            b"event: request_id\n: \"req-1\"\n\n",
            b"event: other\n\nid: 3\n\n",
            // The last event field decides.
            b"event: request_id\nevent: other\n\nevent: other\nevent: request_id\n\n",
            CHUNK,
        ]);
        let expected = cat(&[
            MARKER,
            b"event: request_id\n: \"req-1\"\n\n",
            b"event: other\nevent: request_id\n\n",
            CHUNK,
        ]);
        for at in 0..=input.len() {
            let mut s = Scanner::new(config.clone(), mask);
            let (a, b) = input.split_at(at);
            let out = drive_chunks(&mut s, &[a, b], |_| {}).unwrap();
            assert_eq!(Esc(&out), Esc(&expected), "split at {at}");
        }
        // Not opted in: removed by the SDK-safe rule.
        let mut s = Scanner::new(config.clone(), config.removal_mask(0));
        let out = drive_chunks(&mut s, &[&input], |_| {}).unwrap();
        assert_eq!(Esc(&out), Esc(CHUNK));
    }

    #[test]
    fn requested_names_are_forwarded_but_never_forwarded_ones_are_not() {
        let layer = BypassMarkerLayer::new()
            .opt_in("request_id")
            .never_forward("llm_metrics");
        let config = layer.config.clone();
        let requested: crate::RequestedAnnotations =
            ["request_id", "llm_metrics", BYPASS].into_iter().collect();
        let mask = config.removal_mask(config.requested_mask(&requested));
        let mut s = Scanner::new(config, mask);
        let input = cat(&[MARKER, b"event: request_id\n\nevent: llm_metrics\n\n"]);
        let mut out = Vec::new();
        let mut rest = &input[..];
        loop {
            match s.step(rest) {
                Step::Forward(n) => {
                    out.extend_from_slice(&rest[..n]);
                    rest = &rest[n..];
                }
                Step::Discard(n) => rest = &rest[n..],
                Step::NeedInput => break,
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(Esc(&out), Esc(&cat(&[MARKER, b"event: request_id\n\n"])));
        assert_eq!(s.last_removed_name(), Some("llm_metrics"));
    }
    const BYPASS: &str = crate::BYPASS_REMOTE_PREFILL;

    #[test]
    fn overflow_forward_streams_the_frame_through_unfiltered() {
        let layer = BypassMarkerLayer::new().max_frame_bytes(8);
        let mut s = scanner(&layer);
        // The marker frame spans chunks and outgrows the cap: it is forwarded as it arrives.
        assert_eq!(s.step(b"data: 0\n\nevent: x-bypass"), Step::Forward(24));
        assert_eq!(s.step(b"-remote-prefill\n: true\n\nev"), Step::Forward(24));
        // The frames after it are filtered again.
        assert_eq!(s.step(b"ev"), Step::Hold(2));
        assert_eq!(
            s.step(b"ent: x-bypass-remote-prefill\n\n"),
            Step::DiscardHeld(30)
        );
        // A frame held below the cap is released first when it outgrows it.
        assert_eq!(s.step(b"event: x"), Step::Hold(8));
        assert_eq!(s.step(b"-bypass"), Step::Release(0));
        assert_eq!(s.step(b"-bypass"), Step::Forward(7));
    }

    #[test]
    fn overflow_error_is_reported() {
        let layer = BypassMarkerLayer::new()
            .max_frame_bytes(8)
            .on_overflow(Overflow::Error);
        let mut s = scanner(&layer);
        assert_eq!(s.step(b"data: 0\n\nevent: x-bypass"), Step::Forward(9));
        assert_eq!(s.step(b"event: x-bypass"), Step::Overflow);
    }

    #[test]
    fn held_bytes_never_exceed_the_cap() {
        let layer = BypassMarkerLayer::new().max_frame_bytes(16);
        let mut s = scanner(&layer);
        let mut held = 0;
        let mut forwarded = 0;
        let input = cat(&[
            b"event: x-bypass-remote-prefill\n",
            &[b'a'; 100],
            b"\n\ndata: 1\n\n",
        ]);
        for chunk in input.chunks(3) {
            let mut rest = chunk;
            loop {
                match s.step(rest) {
                    Step::Hold(n) => {
                        held += n;
                        rest = &rest[n..];
                    }
                    Step::Release(n) => {
                        forwarded += held + n;
                        held = 0;
                        rest = &rest[n..];
                    }
                    Step::Forward(n) => {
                        forwarded += n;
                        rest = &rest[n..];
                    }
                    Step::NeedInput => break,
                    other => panic!("{other:?}"),
                }
                assert!(held <= 16, "held {held} bytes");
            }
        }
        assert_eq!(
            forwarded,
            input.len(),
            "the oversized frame is forwarded whole"
        );
    }

    /// A chunk of whole frames (64 bytes or more, ending with an empty line) that holds no
    /// `event:` is forwarded in one step without a run; any `event:` in it, even inside a value,
    /// and SDK-safe mode send it through the general scan, which still removes what it must.
    #[test]
    fn whole_frame_chunks_skip_the_run_only_without_event() {
        let data: &[u8] =
            b"data: {\"id\":\"chatcmpl-1\",\"choices\":[{\"delta\":{\"content\":\" token\"}}]}\n\n";
        assert!(data.len() >= SHORT_SEARCH);
        let layer = BypassMarkerLayer::new();
        let mut s = scanner(&layer);
        assert_eq!(s.step(data), Step::Forward(data.len()));
        assert_eq!(s.step(&[]), Step::NeedInput);
        assert!(s.is_idle());
        // The marker after it in the same chunk is removed (`tests/scanner.rs` splits these inputs
        // everywhere and holds them to the model).
        assert_eq!(Esc(&filtered(&layer, &cat(&[data, MARKER]))), Esc(data));
        // `event:` inside a data value is content: kept.
        let value: &[u8] =
            b"data: {\"content\":\"event: x-bypass-remote-prefill\",\"pad\":\"..........\"}\n\n";
        assert!(value.len() >= SHORT_SEARCH);
        assert_eq!(Esc(&filtered(&layer, value)), Esc(value));
        // SDK-safe mode removes a data-less frame of such a chunk.
        let sdk = BypassMarkerLayer::new().sdk_safe(true);
        assert_eq!(Esc(&filtered(&sdk, &cat(&[data, b"id: 7\n\n"]))), Esc(data));
    }

    #[test]
    fn blank_line_search_finds_the_last_frame_boundary() {
        assert_eq!(last_blank_line_end(b"data: 1\n\n", 0, 9), Some(9));
        assert_eq!(last_blank_line_end(b"data: 1\r\n\r\n", 0, 11), Some(11));
        assert_eq!(last_blank_line_end(b"data: 1\n\r\n", 0, 10), Some(10));
        assert_eq!(last_blank_line_end(b"data: 1\r\r", 0, 9), Some(9));
        assert_eq!(last_blank_line_end(b"data: 1\r\n", 0, 9), None);
        assert_eq!(last_blank_line_end(b"a\n\nb\n", 0, 5), Some(3));
        assert_eq!(last_blank_line_end(b"\n", 0, 1), None);
    }
}

/// Feeds `chunks` to `s` the way the body does, with a plain buffer for the held bytes, and ends
/// the body. Calls `after_chunk` with the output so far after each chunk. `None` on
/// [`Step::Overflow`].
#[cfg(test)]
pub(crate) fn drive_chunks(
    s: &mut Scanner,
    chunks: &[&[u8]],
    mut after_chunk: impl FnMut(&[u8]),
) -> Option<Vec<u8>> {
    let cap = s.config.max_frame_bytes.max(BOM.len() - 1);
    let mut out = Vec::new();
    let mut held = Vec::new();
    for chunk in chunks {
        let mut rest = *chunk;
        let mut steps = 0;
        loop {
            steps += 1;
            assert!(
                steps <= 2 * chunk.len() + 2,
                "the scanner makes no progress"
            );
            // The same entry as the body's: the quick path for a held frame first.
            let step = if steps == 1 {
                s.step_in_frame(rest).unwrap_or_else(|| s.step(rest))
            } else {
                s.step(rest)
            };
            match step {
                Step::Forward(n) => {
                    forward(s, &mut out, &rest[..n]);
                    rest = &rest[n..];
                }
                Step::Discard(n) | Step::DiscardLf(n) => rest = &rest[n..],
                Step::Hold(n) => {
                    held.extend_from_slice(&rest[..n]);
                    rest = &rest[n..];
                }
                Step::Release(n) => {
                    held.extend_from_slice(&rest[..n]);
                    forward(s, &mut out, &held);
                    held.clear();
                    rest = &rest[n..];
                }
                Step::DiscardHeld(n) => {
                    held.clear();
                    rest = &rest[n..];
                }
                Step::Overflow => return None,
                Step::NeedInput => break,
            }
            assert!(held.len() <= cap, "held {} bytes past the cap", held.len());
        }
        assert!(rest.is_empty(), "chunk not consumed");
        after_chunk(&out);
    }
    match s.finish() {
        Step::Release(0) => forward(s, &mut out, &held),
        Step::DiscardHeld(0) => held.clear(),
        Step::NeedInput => assert!(held.is_empty(), "held bytes left behind"),
        other => panic!("finish gave {other:?}"),
    }
    out.extend_from_slice(s.lead_end());
    Some(out)
}

/// Forwards `bytes` to `out` the way the body does, through [`Scanner::lead`].
#[cfg(test)]
fn forward(s: &mut Scanner, out: &mut Vec<u8>, bytes: &[u8]) {
    if bytes.is_empty() {
        return;
    }
    match s.lead(bytes) {
        Lead::Pass => {}
        Lead::Prefix(prefix) => out.extend_from_slice(prefix),
        Lead::Wait => return,
    }
    out.extend_from_slice(bytes);
}
