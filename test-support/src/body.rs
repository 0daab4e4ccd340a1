//! Hand-made bodies for driving a layer chunk by chunk: [`Chunks`], the one the tests, fuzz drivers
//! and benchmarks of the workspace reach for most (given chunks, always ready); [`Items`] (data,
//! trailers and errors, always ready) and [`Gated`] (fed by the test, `Pending` in between); and
//! running a response through the layer ([`through`]) and reading what comes out ([`collect`]).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use bytes::{Buf, Bytes};
use http::{header, HeaderMap, Request, Response};
use http_body::{Body, Frame, SizeHint};
use tower::{service_fn, Layer, Service, ServiceExt};
use tower_bypass_marker::{BoxError, BypassMarkerBody, BypassMarkerLayer, RequestedAnnotations};

/// A body that yields the given chunks as data frames, one per poll, never `Pending`, then ends.
///
/// Yielding allocates nothing: each chunk is handed over as it was given. The chunks may be any
/// [`Buf`], for a test of a layer over data that is not `Bytes`. Its `is_end_stream` is true once
/// every chunk is out; its size hint is the default (unknown), as a streamed upstream body's is.
#[derive(Debug, Clone)]
pub struct Chunks<D = Bytes>(VecDeque<D>);

impl<D> Chunks<D> {
    /// The body of `chunks`, in order.
    pub fn new(chunks: impl IntoIterator<Item = D>) -> Self {
        Self(chunks.into_iter().collect())
    }
}

impl Chunks {
    /// The body of `chunks`, borrowed for the program's life: no copy, no reference count.
    pub fn from_static(chunks: &[&'static [u8]]) -> Self {
        Self::new(chunks.iter().map(|&c| Bytes::from_static(c)))
    }
}

impl<D> Default for Chunks<D> {
    fn default() -> Self {
        Self(VecDeque::new())
    }
}

impl<D: Buf + Unpin> Body for Chunks<D> {
    type Data = D;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<D>, Infallible>>> {
        Poll::Ready(self.0.pop_front().map(|chunk| Ok(Frame::data(chunk))))
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_empty()
    }
}

/// One thing the test body yields.
#[derive(Debug, Clone)]
pub enum Item {
    /// A data frame.
    Data(Bytes),
    /// A trailers frame.
    Trailers(HeaderMap),
    /// An error with this message; the body is done after it.
    Error(&'static str),
    /// `Poll::Pending` once, with the waker woken at once (a body that waits a moment).
    Pending,
}

/// A data item.
pub fn data(bytes: impl Into<Bytes>) -> Item {
    Item::Data(bytes.into())
}

#[derive(Debug, Default)]
struct Shared {
    items: VecDeque<Item>,
    closed: bool,
    waker: Option<Waker>,
    polls_while_empty: usize,
}

/// A body fed by the test: it yields what was pushed, is `Pending` (with the waker kept) while
/// nothing is queued, and ends once closed and drained.
#[derive(Debug, Clone, Default)]
pub struct Gated(Arc<Mutex<Shared>>);

impl Gated {
    /// Queues `item`, and wakes the body's poller.
    pub fn push(&self, item: Item) {
        let mut s = self.0.lock().unwrap();
        s.items.push_back(item);
        if let Some(w) = s.waker.take() {
            w.wake();
        }
    }

    /// Ends the body once what is queued has been yielded.
    pub fn close(&self) {
        let mut s = self.0.lock().unwrap();
        s.closed = true;
        if let Some(w) = s.waker.take() {
            w.wake();
        }
    }

    /// Whether the body is parked on a registered waker.
    pub fn has_waker(&self) -> bool {
        self.0.lock().unwrap().waker.is_some()
    }
}

impl Body for Gated {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut s = self.0.lock().unwrap();
        match s.items.pop_front() {
            Some(Item::Data(d)) => Poll::Ready(Some(Ok(Frame::data(d)))),
            Some(Item::Trailers(t)) => Poll::Ready(Some(Ok(Frame::trailers(t)))),
            Some(Item::Error(e)) => Poll::Ready(Some(Err(e.into()))),
            Some(Item::Pending) => {
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            None if s.closed => Poll::Ready(None),
            None => {
                s.polls_while_empty += 1;
                s.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        let s = self.0.lock().unwrap();
        s.closed && s.items.is_empty()
    }
}

/// A body that plays a fixed list of items, then ends: the fuzz drivers' scripted inner body and
/// the tests' body of trailers and errors. It is ready at every poll but an [`Item::Pending`]'s;
/// after an error it yields nothing more. Its size hint is exactly the data still to come.
#[derive(Debug)]
pub struct Items {
    items: VecDeque<Item>,
}

impl Items {
    /// The body of `items`, in order.
    pub fn new(items: impl IntoIterator<Item = Item>) -> Self {
        Self {
            items: items.into_iter().collect(),
        }
    }
}

impl Body for Items {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Poll::Ready(match self.items.pop_front() {
            None => None,
            Some(Item::Data(d)) => Some(Ok(Frame::data(d))),
            Some(Item::Trailers(t)) => Some(Ok(Frame::trailers(t))),
            Some(Item::Error(e)) => {
                self.items.clear();
                Some(Err(e.into()))
            }
            Some(Item::Pending) => {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
        })
    }

    fn is_end_stream(&self) -> bool {
        self.items.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        let data = self.items.iter().map(|item| match item {
            Item::Data(d) => d.len() as u64,
            _ => 0,
        });
        SizeHint::with_exact(data.sum())
    }
}

/// `input` cut at `cuts` (each taken modulo `input.len() + 1`, in any order; repeats give empty
/// chunks): the chunks, in order, which concatenate to `input`.
pub fn cut(input: &[u8], cuts: &[usize]) -> Vec<Bytes> {
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (input.len() + 1)).collect();
    points.push(0);
    points.push(input.len());
    points.sort_unstable();
    points
        .windows(2)
        .map(|w| Bytes::copy_from_slice(&input[w[0]..w[1]]))
        .collect()
}

/// A response with `content_type` and `body`.
pub fn response<B>(content_type: &str, body: B) -> Response<B> {
    Response::builder()
        .header(header::CONTENT_TYPE, content_type)
        .body(body)
        .unwrap()
}

/// Runs `body` (with `content-type: text/event-stream`) through `layer` for a request carrying
/// `requested` in its extensions, returning the response.
pub async fn through<B>(
    layer: &BypassMarkerLayer,
    requested: Option<RequestedAnnotations>,
    res: Response<B>,
) -> Response<BypassMarkerBody<B>>
where
    B: Send + 'static,
{
    let res = Mutex::new(Some(res));
    let mut svc = layer.layer(service_fn(move |_req: Request<()>| {
        let res = res.lock().unwrap().take().expect("called once");
        async move { Ok::<_, Infallible>(res) }
    }));
    let mut req = Request::new(());
    if let Some(r) = requested {
        req.extensions_mut().insert(r);
    }
    svc.ready().await.unwrap().call(req).await.unwrap()
}

/// Everything a body yields, in order.
#[derive(Debug, Default, PartialEq)]
pub struct Collected {
    /// The data, joined.
    pub data: Vec<u8>,
    /// The data frames, as they came.
    pub chunks: Vec<Bytes>,
    /// The trailers, if any came.
    pub trailers: Option<HeaderMap>,
    /// The error the body ended with, if it did.
    pub error: Option<String>,
}

/// Polls `body` to its end (or its first error) and keeps all it yields.
pub async fn collect<B>(body: B) -> Collected
where
    B: Body<Data = Bytes, Error = BoxError>,
{
    let mut body = std::pin::pin!(body);
    let mut out = Collected::default();
    while let Some(frame) = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
        match frame {
            Ok(frame) => match frame.into_data() {
                Ok(d) => {
                    assert!(out.trailers.is_none(), "data after trailers");
                    out.data.extend_from_slice(&d);
                    out.chunks.push(d);
                }
                Err(frame) => out.trailers = Some(frame.into_trailers().unwrap()),
            },
            Err(e) => {
                out.error = Some(e.to_string());
                break;
            }
        }
    }
    out
}
