//! The response side without tower: [`EventStreamFilter`], a sans-IO filter any host can drive.

use std::fmt;
use std::ops::Range;

use bytes::{Buf, Bytes, BytesMut};

use crate::scan::{Lead, Scanner, Step};

/// The capacity a filter's buffer for frames that span chunks starts with (at most
/// `max_frame_bytes`).
const HELD_CAPACITY: usize = 4096;

/// Removes annotation frames from one `text/event-stream` body, fed chunk by chunk: the engine of
/// [`BypassMarkerBody`](crate::BypassMarkerBody), for hosts that are not tower services (an Envoy
/// external processor, a proxy written on another stack, a test).
///
/// Made by [`BypassMarkerLayer::response_filter`](crate::BypassMarkerLayer::response_filter) (which
/// also decides from the response head whether the body is filtered at all) or
/// [`BypassMarkerLayer::event_stream_filter`](crate::BypassMarkerLayer::event_stream_filter). It
/// does no I/O and never blocks. The calling contract:
///
/// 1. [`push`](Self::push) a chunk of the body;
/// 2. call [`poll_output`](Self::poll_output) until it returns [`FilterOutput::NeedInput`],
///    forwarding every [`FilterOutput::Data`] in order;
/// 3. repeat; at the end of the body call [`finish`](Self::finish), then `poll_output` until it
///    returns [`FilterOutput::End`].
///
/// The output is what [`BypassMarkerBody`](crate::BypassMarkerBody) yields for the same chunks,
/// byte for byte, with the same guarantees (see its docs): every byte that is not
/// part of a removed frame, in order; a complete frame is output before the next chunk is needed;
/// forwarded bytes are slices of the pushed chunks (a chunk of whole kept frames comes back as the
/// very same `Bytes`), and only a frame that spans chunks is copied, into a buffer capped by
/// [`max_frame_bytes`](crate::BypassMarkerLayer::max_frame_bytes); time linear in the bytes
/// however they are split.
///
/// ```
/// use bytes::Bytes;
/// use tower_bypass_marker::sans_io::FilterOutput;
/// use tower_bypass_marker::{BypassMarkerLayer, RequestedAnnotations};
///
/// let layer = BypassMarkerLayer::new();
/// let mut filter = layer.event_stream_filter(&RequestedAnnotations::new()).unwrap();
/// let mut out = Vec::new();
/// // The marker split across two chunks, then an event.
/// for chunk in ["event: x-bypass", "-remote-prefill\n: true\n\ndata: {}\n\n"] {
///     filter.push(Bytes::from(chunk));
///     while let FilterOutput::Data(bytes) = filter.poll_output()? {
///         out.extend_from_slice(&bytes);
///     }
/// }
/// filter.finish();
/// while let FilterOutput::Data(bytes) = filter.poll_output()? {
///     out.extend_from_slice(&bytes);
/// }
/// assert_eq!(out, b"data: {}\n\n");
/// # Ok::<_, tower_bypass_marker::FrameTooLarge>(())
/// ```
///
/// From a response head, as a host that is not a tower service decides and filters (the Dynamo
/// preset, the marker split across chunks):
///
/// ```rust
/// use bytes::Bytes;
/// use http::{header, HeaderMap, Method, StatusCode};
/// use tower_bypass_marker::sans_io::FilterOutput;
/// use tower_bypass_marker::{BypassMarkerLayer, RequestedAnnotations};
///
/// let layer = BypassMarkerLayer::dynamo();
/// let mut headers = HeaderMap::new();
/// headers.insert(header::CONTENT_TYPE, "text/event-stream".parse().unwrap());
/// let asked = RequestedAnnotations::new(); // from the request's nvext.annotations, via the guard
/// let mut filter = layer
///     .response_filter(&Method::POST, StatusCode::OK, &headers, &asked)
///     .expect("an event stream with something to remove");
/// let mut out = Vec::new();
/// for chunk in ["event: x-bypass-remote-prefill\n: tr", "ue\n\ndata: {}\n\n"] {
///     filter.push(Bytes::from(chunk));
///     while let FilterOutput::Data(bytes) = filter.poll_output().unwrap() {
///         out.extend_from_slice(&bytes); // write these to the client now
///     }
/// }
/// filter.finish();
/// while let FilterOutput::Data(bytes) = filter.poll_output().unwrap() {
///     out.extend_from_slice(&bytes);
/// }
/// assert_eq!(out, b"data: {}\n\n");
/// ```
pub struct EventStreamFilter {
    /// What is left of the current chunk, when acting on it yielded data before its end.
    pub(crate) chunk: Bytes,
    pub(crate) frames: Frames,
    state: State,
}

/// Where a filter is in its calling contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Open,
    /// [`EventStreamFilter::finish`] was called; the held frame has not been judged yet.
    Finishing,
    /// Everything has been output (or the filter failed).
    Ended,
}

/// What an [`EventStreamFilter`] asks of its caller next.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum FilterOutput {
    /// Forward these bytes now, before anything else that follows.
    Data(Bytes),
    /// Everything pushed has been acted on: push the next chunk, or call
    /// [`finish`](EventStreamFilter::finish).
    NeedInput,
    /// The body has ended and everything has been output.
    End,
}

/// Everything about the frames of a filtered body but the current chunk, so that a driver can act
/// on a chunk where it lies.
pub(crate) struct Frames {
    scanner: Scanner,
    /// Data to yield before anything else: the bytes that follow the LF (or the first bytes of a
    /// BOM) that [`Scanner::lead`] put before them.
    pub(crate) ready: Bytes,
    /// The bytes of a frame that spans chunks.
    pub(crate) held: BytesMut,
    /// Frames and bytes removed so far; `None` once the summary has been logged.
    #[cfg(feature = "tracing")]
    removed: Option<(u64, u64)>,
    /// The span current when the filter was made (the request's, under tower-http's
    /// `TraceLayer`): every event is emitted inside it, also when the body is polled or dropped
    /// outside it.
    #[cfg(feature = "tracing")]
    span: tracing::Span,
}

impl EventStreamFilter {
    #[cfg_attr(not(feature = "tracing"), allow(unused_mut))]
    pub(crate) fn new(mut scanner: Scanner) -> Self {
        #[cfg(feature = "tracing")]
        {
            scanner.span = tracing::Span::current();
        }
        Self {
            chunk: Bytes::new(),
            frames: Frames {
                scanner,
                ready: Bytes::new(),
                held: BytesMut::new(),
                #[cfg(feature = "tracing")]
                removed: Some((0, 0)),
                #[cfg(feature = "tracing")]
                span: tracing::Span::current(),
            },
            state: State::Open,
        }
    }

    /// Panics unless the filter is open and its last input is used up: what `method` ([`push`]
    /// or [`edit`]) requires.
    ///
    /// [`push`]: Self::push
    /// [`edit`]: Self::edit
    #[track_caller]
    fn assert_takes_input(&self, method: &str) {
        assert!(
            self.state == State::Open,
            "EventStreamFilter::{method} after finish"
        );
        assert!(
            self.chunk.is_empty() && self.frames.ready.is_empty(),
            "EventStreamFilter::{method} before poll_output returned NeedInput"
        );
    }

    /// Feeds the next chunk of the body. An empty chunk is not the end of the body.
    ///
    /// # Panics
    ///
    /// When the previous chunk has not been used up (`poll_output` has not returned
    /// [`FilterOutput::NeedInput`] since the last `push`), or after [`finish`](Self::finish).
    pub fn push(&mut self, chunk: Bytes) {
        self.assert_takes_input("push");
        self.chunk = chunk;
    }

    /// Marks the end of the body: a frame still open is judged as it stands, its unterminated
    /// last line included. Call `poll_output` until it returns [`FilterOutput::End`].
    ///
    /// Calling it again changes nothing.
    pub fn finish(&mut self) {
        if self.state == State::Open {
            self.state = State::Finishing;
        }
    }

    /// The next thing to do: forward bytes, push more input, or nothing more (after
    /// [`finish`](Self::finish)).
    ///
    /// # Errors
    ///
    /// [`FrameTooLarge`] when the layer is set to [`Overflow::Error`](crate::Overflow::Error) and a
    /// frame that spans chunks outgrew [`max_frame_bytes`](crate::BypassMarkerLayer::max_frame_bytes).
    /// The stream must then be failed, not ended cleanly: the frame's bytes are dropped, and
    /// every later call returns [`FilterOutput::End`].
    pub fn poll_output(&mut self) -> Result<FilterOutput, FrameTooLarge> {
        loop {
            if !self.frames.ready.is_empty() {
                return Ok(FilterOutput::Data(std::mem::take(&mut self.frames.ready)));
            }
            if !self.chunk.is_empty() {
                match self.frames.drain(&mut self.chunk) {
                    Ok(Some(data)) => return Ok(FilterOutput::Data(data)),
                    Ok(None) => {}
                    Err(err) => {
                        self.state = State::Ended;
                        return Err(err);
                    }
                }
            }
            match self.state {
                State::Open => return Ok(FilterOutput::NeedInput),
                State::Ended => return Ok(FilterOutput::End),
                State::Finishing => {
                    self.state = State::Ended;
                    if let Some(data) = self.frames.finish() {
                        return Ok(FilterOutput::Data(data));
                    }
                }
            }
        }
    }

    /// The bytes held for a frame that spans chunks (at most
    /// [`max_frame_bytes`](crate::BypassMarkerLayer::max_frame_bytes)), plus any output not yet
    /// taken.
    pub fn held_bytes(&self) -> usize {
        self.frames.held.len() + self.frames.ready.len() + self.chunk.len()
    }

    /// Filters a whole body given as chunks, returning the output joined: a convenience for tests
    /// and small bodies.
    ///
    /// # Errors
    ///
    /// As [`poll_output`](Self::poll_output).
    pub fn filter_all<'a>(
        mut self,
        chunks: impl IntoIterator<Item = &'a [u8]>,
    ) -> Result<Vec<u8>, FrameTooLarge> {
        let mut out = Vec::new();
        for chunk in chunks {
            self.push(Bytes::copy_from_slice(chunk));
            while let FilterOutput::Data(data) = self.poll_output()? {
                out.extend_from_slice(&data);
            }
        }
        self.finish();
        while let FilterOutput::Data(data) = self.poll_output()? {
            out.extend_from_slice(&data);
        }
        Ok(out)
    }

    /// Acts on a chunk that the caller keeps (a host's own buffer, such as Envoy's), given as the
    /// slices it is made of: appends to `edit` what to forward for it, as ranges of the chunk
    /// (counted from the start of its first slice) and the few bytes the filter owns (a frame
    /// that began in an earlier chunk). Nothing of the chunk is copied but a frame that is still
    /// open at its end; a frame that spans two of its slices stays where it is.
    ///
    /// The borrowed-chunk counterpart of [`push`](Self::push) and
    /// [`poll_output`](Self::poll_output); the two can be mixed between chunks. At the end of the
    /// body call [`edit_end`](Self::edit_end).
    ///
    /// ```
    /// use tower_bypass_marker::sans_io::ChunkEdit;
    /// use tower_bypass_marker::{BypassMarkerLayer, RequestedAnnotations};
    ///
    /// let layer = BypassMarkerLayer::new();
    /// let mut filter = layer.event_stream_filter(&RequestedAnnotations::new()).unwrap();
    /// let mut edit = ChunkEdit::new();
    /// let chunk = b"event: x-bypass-remote-prefill\n: true\n\ndata: {}\n\n";
    /// filter.edit(&[chunk], &mut edit)?;
    /// // Forward the chunk from byte 39 on: the front of the buffer is drained, nothing copied.
    /// assert_eq!(edit.skip_front(), Some(39));
    /// assert_eq!(edit.to_vec(&[&chunk[..]]), b"data: {}\n\n");
    /// # Ok::<_, tower_bypass_marker::FrameTooLarge>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`poll_output`](Self::poll_output): the stream must then be failed.
    ///
    /// # Panics
    ///
    /// When output of a [`push`](Self::push)ed chunk has not been taken, or after the end.
    pub fn edit(&mut self, chunk: &[&[u8]], edit: &mut ChunkEdit) -> Result<(), FrameTooLarge> {
        self.assert_takes_input("edit");
        // The open frame's bytes in this chunk, from this offset on, left where they are.
        let mut span = None;
        let start = edit.len;
        for slice in chunk {
            let base = edit.len;
            edit.len += slice.len();
            if let Err(err) = self.frames.edit(slice, base, &mut span, edit) {
                self.state = State::Ended;
                return Err(err);
            }
        }
        // A frame still open at the end of the chunk: its bytes are copied now, while the
        // slices are still there.
        if let Some(from) = span {
            let mut at = start;
            for slice in chunk {
                let end = at + slice.len();
                if end > from {
                    self.frames.hold(&slice[from.saturating_sub(at)..]);
                }
                at = end;
            }
        }
        Ok(())
    }

    /// The end of a body driven by [`edit`](Self::edit): appends to `edit` what the end
    /// releases (a frame still open, judged as it stands). Call it with the edit of the last
    /// chunk, or with a fresh one when the body ends without data. Calling it again adds nothing.
    ///
    /// # Errors
    ///
    /// None today; a `Result` as [`edit`](Self::edit) is, so that a host handles both alike.
    pub fn edit_end(&mut self, edit: &mut ChunkEdit) -> Result<(), FrameTooLarge> {
        self.finish();
        while let FilterOutput::Data(data) = self.poll_output()? {
            edit.push_bytes(data);
        }
        Ok(())
    }

    /// Everything pushed has been acted on and the body has not ended: `poll_output` would return
    /// `NeedInput`. The tower body's per-chunk check, cheaper than a call to `poll_output`.
    #[inline]
    pub(crate) fn wants_input(&self) -> bool {
        self.chunk.is_empty() && self.frames.ready.is_empty() && self.state == State::Open
    }

    /// Nothing is buffered and nothing pending can come out at the end of the body.
    pub(crate) fn is_idle(&self) -> bool {
        self.chunk.is_empty()
            && self.frames.ready.is_empty()
            && self.frames.held.is_empty()
            && (self.state == State::Ended || self.frames.scanner.is_idle())
    }

    /// An upper bound on the bytes held or owed that the inner body's size hint does not count.
    pub(crate) fn pending(&self) -> usize {
        self.chunk.len()
            + self.frames.ready.len()
            + self.frames.held.len()
            + self.frames.scanner.lead_owed()
    }

    /// Acts on a chunk where it lies (a body's polled frame): what to yield, and what is left of
    /// the chunk is kept for the next [`Self::poll_output`].
    #[inline]
    pub(crate) fn drain_in_place(
        &mut self,
        chunk: &mut Bytes,
    ) -> Result<Option<Bytes>, FrameTooLarge> {
        let out = self.frames.drain(chunk);
        if !chunk.is_empty() {
            self.chunk = std::mem::take(chunk);
        }
        if out.is_err() {
            self.state = State::Ended;
        }
        out
    }

    /// The summary of a body that has ended, once (`tracing`).
    #[cfg(feature = "tracing")]
    pub(crate) fn log_end(&mut self) {
        self.frames.log_end();
    }
}

impl fmt::Debug for EventStreamFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventStreamFilter")
            .field("held_bytes", &self.held_bytes())
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

/// What to forward in place of one chunk of a body that its host keeps: filled by
/// [`EventStreamFilter::edit`], read by the host to rewrite its buffer only where something
/// changed.
///
/// The pieces are in output order. Most chunks come out [unchanged](Self::is_unchanged) (leave the
/// buffer as it is) or with a front removed ([`skip_front`](Self::skip_front): drain that many
/// bytes); anything else is rebuilt from [`pieces`](Self::pieces) or [`to_vec`](Self::to_vec).
/// Reused across chunks ([`clear`](Self::clear)), it allocates only while it grows.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ChunkEdit {
    /// The bytes of input seen since the last clear.
    len: usize,
    pieces: Vec<Piece>,
}

/// One piece of a [`ChunkEdit`]'s output.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Piece {
    /// These bytes of the input, counted from the start of the chunk.
    Input(Range<usize>),
    /// Bytes the filter owns: a frame that began in an earlier chunk, or the few bytes that keep
    /// a byte order mark from starting the output.
    Bytes(Bytes),
}

impl ChunkEdit {
    /// An empty edit.
    pub fn new() -> Self {
        Self::default()
    }

    /// An edit that forwards nothing of `chunk`.
    #[cfg(feature = "json")]
    pub(crate) fn remove_all(&mut self, chunk: &[&[u8]]) {
        self.len += chunk.iter().map(|slice| slice.len()).sum::<usize>();
    }

    /// Forgets the last chunk, keeping the allocation.
    pub fn clear(&mut self) {
        self.len = 0;
        self.pieces.clear();
    }

    /// The output, in order.
    pub fn pieces(&self) -> &[Piece] {
        &self.pieces
    }

    /// The bytes of input the edit has seen.
    pub fn input_len(&self) -> usize {
        self.len
    }

    /// The output is the input exactly: forward the chunk as it is.
    pub fn is_unchanged(&self) -> bool {
        match self.pieces.as_slice() {
            [] => self.len == 0,
            [Piece::Input(range)] => range.start == 0 && range.end == self.len,
            _ => false,
        }
    }

    /// `Some(n)` when the output is the input without its first `n` bytes (`n` may be 0, or the
    /// whole input): drain them and forward the rest.
    pub fn skip_front(&self) -> Option<usize> {
        match self.pieces.as_slice() {
            [] => Some(self.len),
            [Piece::Input(range)] if range.end == self.len => Some(range.start),
            _ => None,
        }
    }

    /// The length of the output.
    pub fn output_len(&self) -> usize {
        self.pieces
            .iter()
            .map(|piece| match piece {
                Piece::Input(range) => range.len(),
                Piece::Bytes(bytes) => bytes.len(),
            })
            .sum()
    }

    /// Appends the output to `out`, reading input ranges from `slices`: the chunk the edit was
    /// made from, as the same slices in the same order.
    ///
    /// # Panics
    ///
    /// When `slices` hold fewer bytes than the edit has seen.
    pub fn write_to(&self, slices: &[&[u8]], out: &mut Vec<u8>) {
        out.reserve(self.output_len());
        // Slices are walked once: ranges only move forward.
        let mut slice = 0;
        let mut slice_start = 0;
        for piece in &self.pieces {
            let mut range = match piece {
                Piece::Bytes(bytes) => {
                    out.extend_from_slice(bytes);
                    continue;
                }
                Piece::Input(range) => range.clone(),
            };
            while !range.is_empty() {
                while range.start >= slice_start + slices[slice].len() {
                    slice_start += slices[slice].len();
                    slice += 1;
                }
                let s = slices[slice];
                let end = range.end.min(slice_start + s.len());
                out.extend_from_slice(&s[range.start - slice_start..end - slice_start]);
                range.start = end;
            }
        }
    }

    /// The output as one vector (see [`write_to`](Self::write_to)).
    pub fn to_vec(&self, slices: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        self.write_to(slices, &mut out);
        out
    }

    fn push_input(&mut self, range: Range<usize>) {
        if range.is_empty() {
            return;
        }
        if let Some(Piece::Input(last)) = self.pieces.last_mut() {
            if last.end == range.start {
                last.end = range.end;
                return;
            }
        }
        self.pieces.push(Piece::Input(range));
    }

    fn push_bytes(&mut self, bytes: Bytes) {
        if !bytes.is_empty() {
            self.pieces.push(Piece::Bytes(bytes));
        }
    }
}

impl Frames {
    /// Acts on `chunk` until there is something to yield or it is used up; what has been acted
    /// on is taken off its front.
    fn drain(&mut self, chunk: &mut Bytes) -> Result<Option<Bytes>, FrameTooLarge> {
        if chunk.is_empty() {
            return Ok(None);
        }
        // Small chunks mostly continue a held frame: `step_in_frame` decides those directly.
        let mut step = match self.scanner.step_in_frame(chunk) {
            Some(step) => step,
            None => self.scanner.step(chunk),
        };
        loop {
            match step {
                Step::Forward(n) => {
                    // Most often the whole chunk: taken without a call into `bytes`.
                    let data = if n == chunk.len() {
                        std::mem::take(chunk)
                    } else {
                        chunk.split_to(n)
                    };
                    if !self.scanner.lead_open() {
                        return Ok(Some(data));
                    }
                    if let Some(data) = self.lead(data) {
                        return Ok(Some(data));
                    }
                }
                Step::Discard(n) => {
                    self.note_removed(n);
                    chunk.advance(n);
                }
                Step::DiscardLf(n) => {
                    // The end of the frame removed at the end of the previous chunk.
                    self.note_removed_tail(n);
                    chunk.advance(n);
                }
                Step::Hold(n) => {
                    self.hold(&chunk[..n]);
                    chunk.advance(n);
                }
                Step::Release(n) => {
                    self.held.extend_from_slice(&chunk[..n]);
                    chunk.advance(n);
                    if !self.held.is_empty() {
                        let data = self.held.split().freeze();
                        if let Some(data) = self.lead(data) {
                            return Ok(Some(data));
                        }
                    }
                }
                Step::DiscardHeld(n) => {
                    self.note_removed(self.held.len() + n);
                    self.held.clear();
                    chunk.advance(n);
                }
                Step::Overflow => {
                    chunk.clear();
                    return Err(self.overflow());
                }
                Step::NeedInput => return Ok(None),
            }
            if chunk.is_empty() {
                return Ok(None);
            }
            step = self.scanner.step(chunk);
        }
    }

    /// [`Self::drain`] for one slice of a borrowed chunk: every step's output goes into `edit`
    /// (ranges count from `base`). `span`: where in the chunk the bytes of a frame still open
    /// begin, when all of them are in this chunk (they stay where they are until the frame is
    /// released, discarded, or the chunk ends).
    fn edit(
        &mut self,
        input: &[u8],
        base: usize,
        span: &mut Option<usize>,
        edit: &mut ChunkEdit,
    ) -> Result<(), FrameTooLarge> {
        if input.is_empty() {
            return Ok(());
        }
        let mut at = 0;
        let mut step = match self.scanner.step_in_frame(input) {
            Some(step) => step,
            None => self.scanner.step(input),
        };
        loop {
            match step {
                Step::Forward(n) => {
                    let range = base + at..base + at + n;
                    if !self.scanner.lead_open() {
                        edit.push_input(range);
                    } else {
                        match self.scanner.lead(&input[at..at + n]) {
                            Lead::Pass => edit.push_input(range),
                            Lead::Prefix(prefix) => {
                                edit.push_bytes(Bytes::from_static(prefix));
                                edit.push_input(range);
                            }
                            Lead::Wait => {}
                        }
                    }
                    at += n;
                }
                Step::Discard(n) => {
                    self.note_removed(n);
                    at += n;
                }
                Step::DiscardLf(n) => {
                    self.note_removed_tail(n);
                    at += n;
                }
                Step::Hold(n) => {
                    // A frame open at the end of a slice: left in place while the whole of it is
                    // in this chunk (and the output's start is settled), else held.
                    if span.is_none() {
                        if self.held.is_empty() && !self.scanner.lead_open() {
                            *span = Some(base + at);
                        } else {
                            self.hold(&input[at..at + n]);
                        }
                    }
                    at += n;
                }
                Step::Release(n) => {
                    if let Some(from) = span.take() {
                        edit.push_input(from..base + at + n);
                    } else {
                        self.held.extend_from_slice(&input[at..at + n]);
                        if !self.held.is_empty() {
                            let data = self.held.split().freeze();
                            if let Some(data) = self.lead(data) {
                                edit.push_bytes(data);
                            }
                            let ready = std::mem::take(&mut self.ready);
                            if !ready.is_empty() {
                                edit.push_bytes(ready);
                            }
                        }
                    }
                    at += n;
                }
                Step::DiscardHeld(n) => {
                    let in_place = span.take().map_or(0, |from| base + at - from);
                    self.note_removed(self.held.len() + in_place + n);
                    self.held.clear();
                    at += n;
                }
                Step::Overflow => {
                    *span = None;
                    return Err(self.overflow());
                }
                Step::NeedInput => return Ok(()),
            }
            if at == input.len() {
                return Ok(());
            }
            step = self.scanner.step(&input[at..]);
        }
    }

    /// Appends the start of a frame that spans chunks to the held bytes.
    fn hold(&mut self, bytes: &[u8]) {
        if self.held.capacity() == 0 {
            // Room for a few frames at once: each release splits its frame off the front, and
            // the buffer is reclaimed whole once the consumer has dropped them, instead of being
            // grown (and reclaimed) every frame or two.
            let room = HELD_CAPACITY.min(self.scanner.max_frame_bytes());
            self.held.reserve(bytes.len().max(room));
        }
        self.held.extend_from_slice(bytes);
    }

    /// The open frame outgrew the cap: the error to fail the stream with; the held bytes go.
    #[cold]
    fn overflow(&mut self) -> FrameTooLarge {
        let limit = self.scanner.max_frame_bytes();
        if let Some(observer) = self.scanner.observer() {
            observer.frame_too_large(limit, false);
        }
        #[cfg(feature = "tracing")]
        if let Some((frames, bytes)) = self.removed.take() {
            let _span = self.span.enter();
            tracing::warn!(
                removed_frames = frames,
                removed_bytes = bytes,
                limit,
                "event stream failed: a frame outgrew max_frame_bytes (Overflow::Error)"
            );
        }
        self.held = BytesMut::new();
        FrameTooLarge::new(limit)
    }

    /// The end of the data: a held frame is judged as it stands.
    pub(crate) fn finish(&mut self) -> Option<Bytes> {
        let out = match self.scanner.finish() {
            Step::Release(_) if !self.held.is_empty() => {
                let data = self.held.split().freeze();
                self.lead(data)
            }
            Step::DiscardHeld(_) => {
                self.note_removed(self.held.len());
                self.held.clear();
                None
            }
            _ => None,
        };
        // The first bytes of a BOM withheld by `lead` come out now: nothing can follow them.
        let out = out.or_else(|| {
            let withheld = self.scanner.lead_end();
            (!withheld.is_empty()).then(|| Bytes::from_static(withheld))
        });
        #[cfg(feature = "tracing")]
        self.log_end();
        out
    }

    /// The summary of a body that has ended, once.
    #[cfg(feature = "tracing")]
    fn log_end(&mut self) {
        if let Some((frames, bytes)) = self.removed.take() {
            let _span = self.span.enter();
            tracing::debug!(
                removed_frames = frames,
                removed_bytes = bytes,
                "event stream ended"
            );
        }
    }

    /// `data`, about to be yielded, through [`Scanner::lead`]: what to yield now, and maybe
    /// `data` into `ready`, to be yielded next.
    #[cold]
    fn lead(&mut self, data: Bytes) -> Option<Bytes> {
        match self.scanner.lead(&data) {
            Lead::Pass => Some(data),
            Lead::Prefix(prefix) => {
                self.ready = data;
                Some(Bytes::from_static(prefix))
            }
            Lead::Wait => None,
        }
    }

    /// Bytes of a removed frame that arrived after the frame was counted.
    #[cfg_attr(not(feature = "tracing"), allow(unused_variables))]
    fn note_removed_tail(&mut self, bytes: usize) {
        #[cfg(feature = "tracing")]
        if let Some(removed) = &mut self.removed {
            removed.1 += bytes as u64;
        }
    }

    fn note_removed(&mut self, bytes: usize) {
        if let Some(observer) = self.scanner.observer() {
            observer.frame_removed(self.scanner.last_removed_name(), bytes);
        }
        #[cfg(feature = "tracing")]
        {
            if let Some(removed) = &mut self.removed {
                removed.0 += 1;
                removed.1 += bytes as u64;
            }
            let _span = self.span.enter();
            tracing::debug!(
                event = self
                    .scanner
                    .last_removed_name()
                    .unwrap_or("(no data field)"),
                bytes,
                "removed annotation frame"
            );
        }
    }
}

#[cfg(feature = "tracing")]
impl Drop for Frames {
    /// A body dropped before its end (the client went away) still gets its summary.
    fn drop(&mut self) {
        if let Some((frames, bytes)) = self.removed.take() {
            let _span = self.span.enter();
            tracing::debug!(
                removed_frames = frames,
                removed_bytes = bytes,
                held_bytes = self.held.len(),
                "event stream dropped before its end"
            );
        }
    }
}

/// The error a filtered body fails with when a frame that spans chunks outgrows
/// [`BypassMarkerLayer::max_frame_bytes`](crate::BypassMarkerLayer::max_frame_bytes) and the layer is
/// set to [`Overflow::Error`](crate::Overflow::Error).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameTooLarge {
    limit: usize,
}

impl FrameTooLarge {
    pub(crate) fn new(limit: usize) -> Self {
        Self { limit }
    }

    /// The cap that was exceeded, in bytes.
    pub fn limit(&self) -> usize {
        self.limit
    }
}

impl fmt::Display for FrameTooLarge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "event-stream frame exceeds the limit of {} held bytes",
            self.limit
        )
    }
}

impl std::error::Error for FrameTooLarge {}
