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
    /// did not opt in to, forwarding every other byte as a slice of the inner body's data; or, in
    /// place of an event stream it cannot read, is the layer's own 502. The rules are below; the
    /// [crate docs](crate) have the examples.
    ///
    /// It is a [`Body`] with `Data = Bytes` for any inner body whose data type is `'static` (every
    /// body in hyper, axum, tonic and tower-http is). When that data type is [`Bytes`] itself, each
    /// chunk is used as it is; any other [`Buf`] is first gathered with [`Buf::copy_to_bytes`].
    /// (Without the bound every chunk would go through `copy_to_bytes`, also a move for `Bytes`,
    /// but measured about 1.8 times slower per chunk in passthrough: BENCHMARKS.md as of 57eacbb,
    /// in the repository's history.)
    ///
    /// # What is removed, exactly
    ///
    /// The body is filtered when the response can have content (not a `1xx`, `204` or `304`
    /// response, nor the response to a `HEAD` request), its media type is `text/event-stream`, it has
    /// no `content-encoding` other than `identity` and no `transfer-encoding` other than `chunked`,
    /// and at least one configured name is to be removed for this request (or SDK-safe mode is on).
    /// Every other response (JSON, gRPC) passes through untouched, headers included, with the inner
    /// body's `size_hint` and `is_end_stream`. A filtered response loses its `content-length`
    /// header. An event stream with another coding is not read at all: see [Encoded
    /// bodies](#encoded-bodies) below.
    ///
    /// A response with an event-stream media type that has no content (a `1xx`, `204` or `304`, or
    /// the response to a `HEAD` request) keeps its headers and loses whatever body the inner
    /// service gave it, which is never polled. HTTP says such a response has no body, and an
    /// HTTP/1.1 server sends none; but hyper's HTTP/2 server sends the DATA frames of a 204 or 304
    /// whose body has any, so without this they would reach the client unfiltered.
    ///
    /// Headers are read as bytes, as a browser reads them:
    ///
    /// - The media type is the one Fetch's "extract a MIME type" gives, which is what `EventSource`
    ///   checks: of all `content-type` values (several headers, or a comma-separated list), the last
    ///   one that parses as `type/subtype` (other than `*/*`) counts; type and subtype compare in any
    ///   case, and parameters are not looked at, so `text/event-stream; x="\xE9"` is an event stream.
    ///   So `text/event-stream` followed by a second `content-type: application/json` header is not.
    /// - `content-encoding` is a list (RFC 9110, section 5.6.1): empty elements are ignored, so
    ///   `identity, `, `,identity` and an empty value mean identity, while `gzip` or `identity, gzip`
    ///   mean the body is encoded.
    ///
    /// The event-stream grammar is WHATWG's:
    ///
    /// - Lines end in CRLF, LF or CR; a CR ending one chunk and a LF starting the next are one line
    ///   end. One UTF-8 BOM at the very start of the body is kept and is not part of the first line;
    ///   any later BOM is content.
    /// - A frame is a run of non-empty lines closed by an empty line. Its event type is the value of
    ///   its *last* `event` field: the field name is compared byte for byte, a line without a colon is
    ///   a field with an empty value, and exactly one space after the colon is removed. Comment lines
    ///   (starting with `:`) belong to the frame they stand in.
    /// - A frame whose event type is a name to remove is removed whole, its closing empty line
    ///   included. Everything else is forwarded unchanged and in order: other frames, comments,
    ///   keep-alives, stray empty lines, invalid UTF-8, NUL bytes.
    /// - A frame still open when the body ends (or when trailers or an error arrive) is judged as it
    ///   stands, its unterminated last line included.
    /// - In SDK-safe mode, a frame with field lines but no `data` field is removed too, unless its
    ///   event type is a name the client opted in to.
    /// - The one byte the layer ever adds: when the first bytes it forwards would begin with a BOM
    ///   (EF BB BF) and the body did not begin with one (the first kept frame after removed ones
    ///   starts with a BOM), it forwards a LF first, then those bytes unchanged. Clients strip a BOM
    ///   at the start of a stream, which would turn a line such as `\u{FEFF}event: x` (a field
    ///   named `\u{FEFF}event`, ignored) into an `event` field; the LF is an empty line, a no-op at
    ///   that point of the grammar.
    ///
    /// # Latency, copies and memory
    ///
    /// Once the last byte of a frame has arrived, the frame is yielded before the inner body is
    /// polled again; only the bytes of a frame that is still open are held. Forwarded data are slices
    /// of the inner body's [`Bytes`](bytes::Bytes): a chunk made of whole frames that are all kept is
    /// forwarded as that same `Bytes`. Only a frame that spans chunks is copied, into a buffer capped
    /// by [`BypassMarkerLayer::max_frame_bytes`](crate::BypassMarkerLayer::max_frame_bytes) (1 MiB by default). Past the cap the frame is
    /// forwarded as it arrives, unfiltered ([`Overflow::Forward`](crate::Overflow::Forward), the default: annotation frames are
    /// tiny, so such a frame is data), or the body fails with [`FrameTooLarge`](crate::FrameTooLarge)
    /// ([`Overflow::Error`](crate::Overflow::Error)).
    ///
    /// Trailers are forwarded after all data. An error from the inner body is passed through, after
    /// the data held for an open frame, judged as at the end of the body.
    ///
    ///
    /// # Encoded bodies
    ///
    /// The filter reads event-stream bytes; it cannot read a gzip or brotli stream, and cutting bytes
    /// out of one would break it. The same holds for a `transfer-encoding` other than `chunked`
    /// (`gzip, chunked`, which a client may ask for with `TE: gzip`; the layer does not forward a
    /// client's `TE` but for `trailers` when it asks for identity): it is refused as below, with
    /// the message `the event stream has transfer-encoding gzip, which cannot be filtered: ...`. An
    /// event stream whose `content-encoding` is not `identity` has one of two causes: an upstream that compresses (although a proxy asked it for
    /// `accept-encoding: identity`), or a compression layer inside this one that ignores the
    /// `accept-encoding: identity` the layer asks it for (see [where to put
    /// it](crate#where-to-put-it)). Such a stream is never passed through to a client it would have to
    /// be filtered for: when at least one configured name is to be removed for this request, the layer
    /// answers **502** in its place, before any byte of it, with an error in OpenAI's shape
    /// (`{"error":{"code":"encoded_event_stream","message":"...","param":null,"type":"server_error"}}`,
    /// `content-type: application/json`, the stream's own headers dropped but for `vary`,
    /// `access-control-*` and `x-request-id`) whose message names the
    /// coding and both causes, on one line:
    ///
    /// ```text
    /// the event stream has content-encoding gzip, which cannot be filtered: either the upstream
    /// compressed it (it must answer with content-encoding identity) or compression is applied
    /// before the filter (the compression layer must be outside it)
    /// ```
    ///
    /// It never polls the stream's body, which is dropped with the response
    /// ([`is_refused`](Self::is_refused)). A [`FrameObserver`](crate::FrameObserver) hears of it
    /// ([`encoded_stream_refused`](crate::FrameObserver::encoded_stream_refused)). When nothing is to
    /// be removed (the client opted in to every configured name that is not never-forwarded), the
    /// encoded stream passes through untouched. The same holds at every front door: the JSON guard's
    /// `sans_io::GatewayExchange` (feature `json`; the Envoy processor and module drive it) answers
    /// `ResponseStep::Refuse` with the same error, the sidecar answers the same 502, and a host of
    /// your own asks [`BypassMarkerLayer::refuses_encoded`](crate::BypassMarkerLayer::refuses_encoded).
    ///
    /// Failing is the only safe answer: decoding and re-encoding would cost the layer a decompressor
    /// and a compressor per stream (and the dependencies), and passing the stream on would hand
    /// router-owned frames to a client that decompresses them.
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
    /// No body, in place of the body of an event-stream response that has no content (a `204`,
    /// a `304`, the response to `HEAD`); the inner body is never polled.
    Empty,
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

    /// No body in place of `inner`, which is kept (and dropped with this body) but never polled.
    pub(crate) fn emptied(inner: B) -> Self {
        Self {
            inner,
            mode: Mode::Empty,
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
    /// coding it cannot read (see [Encoded bodies](Self#encoded-bodies)); the inner body is not
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

/// An empty passthrough body over `B::default()`: what a layer outside this one (tower-http's
/// `TimeoutLayer`, `CorsLayer`, `RequestBodyLimitLayer`, ...) answers with when it builds its own
/// response with `ResBody::default()`, so that such a layer composes in a `ServiceBuilder`.
impl<B: Default> Default for BypassMarkerBody<B> {
    fn default() -> Self {
        Self::passthrough(B::default())
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
            Mode::Refused(json) => return refused_frame(json),
            Mode::Empty => return Poll::Ready(None),
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
            Mode::Empty => true,
        }
    }

    fn size_hint(&self) -> SizeHint {
        let f = match &self.mode {
            Mode::Pass => return self.inner.size_hint(),
            Mode::Filter(f) => f,
            Mode::Refused(json) => {
                return SizeHint::with_exact(json.as_ref().map_or(0, |j| j.len() as u64))
            }
            Mode::Empty => return SizeHint::with_exact(0),
        };
        let inner = self.inner.size_hint();
        // Frames may be removed, so only an upper bound holds. An inner bound of `u64::MAX` (or
        // near it) stays `u64::MAX`: the sum would overflow.
        let mut hint = SizeHint::new();
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper.saturating_add(f.filter.pending() as u64));
        }
        hint
    }
}

/// The next frame of a refused body: its error body, then the end. Out of line, so that the
/// two paths taken on every poll (pass and filter) stay short.
#[cold]
#[inline(never)]
fn refused_frame(json: &mut Option<Bytes>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
    Poll::Ready(json.take().map(|j| Ok(Frame::data(j))))
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
