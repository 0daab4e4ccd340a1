use std::fmt;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::scan::{Lead, Scanner, Step};
use crate::BoxError;

pin_project! {
    /// Response body for [`BypassMarker`](crate::BypassMarker).
    ///
    /// Either passes the inner body through untouched, or removes the annotation frames the client
    /// did not opt in to, forwarding every other byte as a slice of the inner body's data. See the
    /// [module docs](crate) for the rules.
    ///
    /// It is a [`Body`] with `Data = Bytes` for any inner body whose data type is `'static` (every
    /// body in hyper, axum, tonic and tower-http is). When that data type is [`Bytes`] itself, each
    /// chunk is used as it is; any other [`Buf`] is first gathered with [`Buf::copy_to_bytes`].
    /// (Without the bound every chunk would go through `copy_to_bytes`, also a move for `Bytes`,
    /// but measured about 1.8 times slower per chunk in passthrough; see BENCHMARKS.md.)
    pub struct BypassMarkerBody<B> {
        #[pin]
        inner: B,
        filter: Option<Filter>,
    }
}

/// The capacity a filtered body's buffer for frames that span chunks starts with (at most
/// `max_frame_bytes`).
const HELD_CAPACITY: usize = 4096;

/// The state of a body that is being filtered.
struct Filter {
    /// What is left of the inner body's current data chunk, when acting on it yielded data
    /// before its end.
    chunk: Bytes,
    frames: Frames,
}

/// Everything about the frames of a filtered body but the current chunk, so that the chunk can be
/// acted on where it lies.
struct Frames {
    scanner: Scanner,
    /// Data to yield before anything else: the bytes that follow the LF (or the first bytes of a
    /// BOM) that [`Scanner::lead`] put before them.
    ready: Bytes,
    /// The bytes of a frame that spans chunks.
    held: BytesMut,
    end: End,
    /// Frames and bytes removed so far; `None` once the summary has been logged.
    #[cfg(feature = "tracing")]
    removed: Option<(u64, u64)>,
}

/// What comes after the data, once the inner body has ended.
enum End {
    Open,
    Trailers(HeaderMap),
    Error(BoxError),
    Done,
}

impl<B> BypassMarkerBody<B> {
    pub(crate) fn passthrough(inner: B) -> Self {
        Self {
            inner,
            filter: None,
        }
    }

    pub(crate) fn filtering(inner: B, scanner: Scanner) -> Self {
        Self {
            inner,
            filter: Some(Filter {
                chunk: Bytes::new(),
                frames: Frames {
                    scanner,
                    ready: Bytes::new(),
                    held: BytesMut::new(),
                    end: End::Open,
                    #[cfg(feature = "tracing")]
                    removed: Some((0, 0)),
                },
            }),
        }
    }

    /// Whether this body removes annotation frames (`false`: it is passed through untouched).
    pub fn is_filtering(&self) -> bool {
        self.filter.is_some()
    }

    /// The inner body.
    pub fn get_ref(&self) -> &B {
        &self.inner
    }

    /// Consumes `self`, returning the inner body. Data held for a partial frame is lost.
    pub fn into_inner(self) -> B {
        self.inner
    }
}

impl<B: fmt::Debug> fmt::Debug for BypassMarkerBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BypassMarkerBody")
            .field("inner", &self.inner)
            .field("filtering", &self.filter.is_some())
            .finish()
    }
}

impl<B> Body for BypassMarkerBody<B>
where
    B: Body,
    B::Data: 'static,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    #[inline]
    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        let Some(filter) = this.filter else {
            let frame = ready!(this.inner.poll_frame(cx));
            return Poll::Ready(frame.map(|r| r.map(into_bytes_frame).map_err(Into::into)));
        };
        #[cfg(feature = "tracing")]
        {
            let mut inner = this.inner;
            let polled = filter.poll_frame(inner.as_mut(), cx);
            // hyper stops polling (and drops the body) once `is_end_stream` says the body has
            // ended after a data frame: that is the end of the body, not a drop before it.
            if matches!(polled, Poll::Ready(Some(Ok(_)))) && filter.is_end_stream(&*inner) {
                filter.frames.log_end();
            }
            polled
        }
        #[cfg(not(feature = "tracing"))]
        filter.poll_frame(this.inner, cx)
    }

    fn is_end_stream(&self) -> bool {
        match &self.filter {
            None => self.inner.is_end_stream(),
            Some(f) => f.is_end_stream(&self.inner),
        }
    }

    fn size_hint(&self) -> SizeHint {
        let inner = self.inner.size_hint();
        let Some(f) = &self.filter else {
            return inner;
        };
        // Frames may be removed, so only an upper bound holds.
        let mut hint = SizeHint::new();
        if let Some(upper) = inner.upper() {
            let frames = &f.frames;
            let pending =
                f.chunk.len() + frames.ready.len() + frames.held.len() + frames.scanner.lead_owed();
            hint.set_upper(upper + pending as u64);
        }
        hint
    }
}

/// `data` itself when the inner body's data type is `Bytes` (the common case: hyper, axum, tonic),
/// so that no call to `copy_to_bytes` is needed to own it.
fn as_bytes<D: Buf + 'static>(data: &mut D) -> Option<&mut Bytes> {
    (data as &mut dyn std::any::Any).downcast_mut::<Bytes>()
}

fn into_bytes_frame<D: Buf + 'static>(frame: Frame<D>) -> Frame<Bytes> {
    frame.map_data(|mut data| match as_bytes(&mut data) {
        Some(bytes) => std::mem::take(bytes),
        None => data.copy_to_bytes(data.remaining()),
    })
}

impl Filter {
    /// Nothing is buffered and nothing more will come: [`Body::is_end_stream`] of a filtered body.
    fn is_end_stream<B: Body>(&self, inner: &B) -> bool {
        self.chunk.is_empty()
            && self.frames.ready.is_empty()
            && self.frames.held.is_empty()
            && match self.frames.end {
                End::Open => self.frames.scanner.is_idle() && inner.is_end_stream(),
                // Past the end of the data (or a `FrameTooLarge`): nothing more to judge.
                End::Done => true,
                End::Trailers(_) | End::Error(_) => false,
            }
    }

    #[inline]
    fn poll_frame<B>(
        &mut self,
        mut inner: Pin<&mut B>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>>
    where
        B: Body,
        B::Data: 'static,
        B::Error: Into<BoxError>,
    {
        loop {
            if !self.frames.ready.is_empty() {
                let data = std::mem::take(&mut self.frames.ready);
                return Poll::Ready(Some(Ok(Frame::data(data))));
            }
            if !self.chunk.is_empty() {
                // What is left of a chunk that yielded data on an earlier call.
                if let Some(data) = self.frames.drain(&mut self.chunk)? {
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
            }
            if !matches!(self.frames.end, End::Open) {
                return Poll::Ready(match std::mem::replace(&mut self.frames.end, End::Done) {
                    End::Trailers(trailers) => Some(Ok(Frame::trailers(trailers))),
                    End::Error(err) => Some(Err(err)),
                    End::Open | End::Done => None,
                });
            }
            // The result is matched where it lies (not moved out of the `Poll`), so that a data
            // chunk is read in place.
            let mut polled = inner.as_mut().poll_frame(cx);
            match &mut polled {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(frame))) => {
                    if let Some(data) = frame.data_mut() {
                        // Only what is left of the chunk after yielding is stored (most small
                        // chunks are held or forwarded whole). An empty chunk is not the end of
                        // the body; the loop polls again.
                        let mut copied;
                        let chunk = match as_bytes(data) {
                            Some(bytes) => bytes,
                            None => {
                                copied = data.copy_to_bytes(data.remaining());
                                &mut copied
                            }
                        };
                        let out = self.frames.drain(chunk);
                        if !chunk.is_empty() {
                            self.chunk = std::mem::take(chunk);
                        }
                        if let Some(data) = out? {
                            return Poll::Ready(Some(Ok(Frame::data(data))));
                        }
                        continue;
                    }
                }
                Poll::Ready(_) => {}
            }
            match polled {
                Poll::Ready(Some(Ok(frame))) => match frame.into_trailers() {
                    Ok(trailers) => self.frames.end = End::Trailers(trailers),
                    // A frame kind this crate does not know: nothing to forward it as.
                    Err(_) => continue,
                },
                Poll::Ready(Some(Err(err))) => self.frames.end = End::Error(err.into()),
                Poll::Ready(None) => self.frames.end = End::Done,
                Poll::Pending => unreachable!("returned above"),
            }
            // The data has ended: judge a frame left open before what comes after.
            if let Some(data) = self.frames.finish() {
                return Poll::Ready(Some(Ok(Frame::data(data))));
            }
        }
    }
}

impl Frames {
    /// Acts on `chunk` until there is something to yield or it is used up; what has been acted
    /// on is taken off its front.
    fn drain(&mut self, chunk: &mut Bytes) -> Result<Option<Bytes>, BoxError> {
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
                    if self.held.capacity() == 0 {
                        // Room for a few frames at once: each release splits its frame off the
                        // front, and the buffer is reclaimed whole once the consumer has dropped
                        // them, instead of being grown (and reclaimed) every frame or two.
                        let room = HELD_CAPACITY.min(self.scanner.max_frame_bytes());
                        self.held.reserve(n.max(room));
                    }
                    self.held.extend_from_slice(&chunk[..n]);
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
                    let limit = self.scanner.max_frame_bytes();
                    #[cfg(feature = "tracing")]
                    if let Some((frames, bytes)) = self.removed.take() {
                        tracing::debug!(
                            removed_frames = frames,
                            removed_bytes = bytes,
                            limit,
                            "event stream failed: a frame outgrew max_frame_bytes"
                        );
                    }
                    chunk.clear();
                    self.held = BytesMut::new();
                    self.end = End::Done;
                    return Err(Box::new(FrameTooLarge { limit }));
                }
                Step::NeedInput => return Ok(None),
            }
            if chunk.is_empty() {
                return Ok(None);
            }
            step = self.scanner.step(chunk);
        }
    }

    /// The end of the data: a held frame is judged as it stands.
    fn finish(&mut self) -> Option<Bytes> {
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

    #[cfg_attr(not(feature = "tracing"), allow(unused_variables))]
    fn note_removed(&mut self, bytes: usize) {
        #[cfg(feature = "tracing")]
        {
            if let Some(removed) = &mut self.removed {
                removed.0 += 1;
                removed.1 += bytes as u64;
            }
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
