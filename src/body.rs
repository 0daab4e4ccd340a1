use std::fmt;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::filter::{EventStreamFilter, FilterOutput};
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
        mode: Mode,
    }
}

/// Whether the body is passed through, filtered, or replaced.
// One per body; boxing the filter would add an allocation per filtered stream. An explicit tag:
// with the variant kept in a niche of the filter's fields, telling the three apart took several
// instructions more on every poll (by callgrind, at 61-byte chunks) than one byte compared.
#[allow(clippy::large_enum_variant)]
#[repr(u8)]
enum Mode {
    Pass,
    Filter(Filter),
    /// The layer's own error body (what is left of it), sent in place of an encoded event stream
    /// that it cannot read; the inner body is never polled.
    Refused(Option<Bytes>),
}

/// The state of a body that is being filtered.
struct Filter {
    filter: EventStreamFilter,
    end: End,
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
            mode: Mode::Pass,
        }
    }

    pub(crate) fn filtering(inner: B, filter: EventStreamFilter) -> Self {
        Self {
            inner,
            mode: Mode::Filter(Filter {
                filter,
                end: End::Open,
            }),
        }
    }

    /// The layer's error `json` in place of `inner`, which is kept (and dropped with this body)
    /// but never polled.
    pub(crate) fn refused(inner: B, json: Bytes) -> Self {
        Self {
            inner,
            mode: Mode::Refused(Some(json)),
        }
    }

    /// Whether this body removes annotation frames (`false`: it is passed through untouched).
    pub fn is_filtering(&self) -> bool {
        matches!(self.mode, Mode::Filter(_))
    }

    /// Whether this body is the layer's own 502 error in place of an event stream in a content
    /// coding it cannot read (see the [crate docs](crate#encoded-bodies)); the inner body is not
    /// read.
    pub fn is_refused(&self) -> bool {
        matches!(self.mode, Mode::Refused(_))
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
            .field("filtering", &self.is_filtering())
            .field("refused", &self.is_refused())
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
        let filter = match this.mode {
            Mode::Pass => {
                let frame = ready!(this.inner.poll_frame(cx));
                return Poll::Ready(frame.map(|r| r.map(into_bytes_frame).map_err(Into::into)));
            }
            Mode::Filter(filter) => filter,
            Mode::Refused(json) => return Poll::Ready(json.take().map(|j| Ok(Frame::data(j)))),
        };
        #[cfg(feature = "tracing")]
        {
            let mut inner = this.inner;
            let polled = filter.poll_frame(inner.as_mut(), cx);
            // hyper stops polling (and drops the body) once `is_end_stream` says the body has
            // ended after a data frame: that is the end of the body, not a drop before it.
            if matches!(polled, Poll::Ready(Some(Ok(_)))) && filter.is_end_stream(&*inner) {
                filter.filter.log_end();
            }
            polled
        }
        #[cfg(not(feature = "tracing"))]
        filter.poll_frame(this.inner, cx)
    }

    fn is_end_stream(&self) -> bool {
        match &self.mode {
            Mode::Pass => self.inner.is_end_stream(),
            Mode::Filter(f) => f.is_end_stream(&self.inner),
            Mode::Refused(json) => json.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        let f = match &self.mode {
            Mode::Pass => return self.inner.size_hint(),
            Mode::Filter(f) => f,
            Mode::Refused(json) => {
                return SizeHint::with_exact(json.as_ref().map_or(0, |j| j.len() as u64))
            }
        };
        let inner = self.inner.size_hint();
        // Frames may be removed, so only an upper bound holds.
        let mut hint = SizeHint::new();
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper + f.filter.pending() as u64);
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
        self.filter.is_idle()
            && match self.end {
                End::Open => inner.is_end_stream(),
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
            // Output owed from an earlier chunk (or from the end of the data) comes first.
            if !self.filter.wants_input() {
                match self.filter.poll_output() {
                    Ok(FilterOutput::Data(data)) => {
                        return Poll::Ready(Some(Ok(Frame::data(data))))
                    }
                    Ok(FilterOutput::NeedInput | FilterOutput::End) => {}
                    Err(err) => {
                        self.end = End::Done;
                        return Poll::Ready(Some(Err(Box::new(err))));
                    }
                }
            }
            if !matches!(self.end, End::Open) {
                return Poll::Ready(match std::mem::replace(&mut self.end, End::Done) {
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
                        match self.filter.drain_in_place(chunk) {
                            Ok(Some(data)) => return Poll::Ready(Some(Ok(Frame::data(data)))),
                            Ok(None) => continue,
                            Err(err) => {
                                self.end = End::Done;
                                return Poll::Ready(Some(Err(Box::new(err))));
                            }
                        }
                    }
                }
                Poll::Ready(_) => {}
            }
            match polled {
                Poll::Ready(Some(Ok(frame))) => match frame.into_trailers() {
                    Ok(trailers) => self.end = End::Trailers(trailers),
                    // A frame kind this crate does not know: nothing to forward it as.
                    Err(_) => continue,
                },
                Poll::Ready(Some(Err(err))) => self.end = End::Error(err.into()),
                Poll::Ready(None) => self.end = End::Done,
                Poll::Pending => unreachable!("returned above"),
            }
            // The data has ended: the filter judges a frame left open before what comes after.
            self.filter.finish();
        }
    }
}
