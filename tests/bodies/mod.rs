//! Hand-made bodies for driving the layer chunk by chunk.
#![allow(dead_code)]

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http::{header, HeaderMap, Request, Response};
use http_body::{Body, Frame, SizeHint};
use tower::{service_fn, Layer, Service, ServiceExt};
use tower_bypass_marker::{BoxError, BypassMarkerBody, BypassMarkerLayer, RequestedAnnotations};

/// One thing the test body yields.
#[derive(Debug, Clone)]
pub(crate) enum Item {
    Data(Bytes),
    Trailers(HeaderMap),
    Error(&'static str),
}

pub(crate) fn data(bytes: impl Into<Bytes>) -> Item {
    Item::Data(bytes.into())
}

#[derive(Default)]
struct Shared {
    items: VecDeque<Item>,
    closed: bool,
    waker: Option<Waker>,
    polls_while_empty: usize,
}

/// A body fed by the test: it yields what was pushed, is `Pending` (with the waker kept) while
/// nothing is queued, and ends once closed and drained.
#[derive(Clone, Default)]
pub(crate) struct Gated(Arc<Mutex<Shared>>);

impl Gated {
    pub(crate) fn push(&self, item: Item) {
        let mut s = self.0.lock().unwrap();
        s.items.push_back(item);
        if let Some(w) = s.waker.take() {
            w.wake();
        }
    }

    pub(crate) fn close(&self) {
        let mut s = self.0.lock().unwrap();
        s.closed = true;
        if let Some(w) = s.waker.take() {
            w.wake();
        }
    }

    /// Whether the body is parked on a registered waker.
    pub(crate) fn has_waker(&self) -> bool {
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

/// A body that yields a fixed list of items, then ends.
pub(crate) struct Items {
    items: VecDeque<Item>,
    hint: SizeHint,
}

impl Items {
    pub(crate) fn new(items: impl IntoIterator<Item = Item>) -> Self {
        let items: VecDeque<Item> = items.into_iter().collect();
        let len: u64 = items
            .iter()
            .map(|i| match i {
                Item::Data(d) => d.len() as u64,
                _ => 0,
            })
            .sum();
        Self {
            items,
            hint: SizeHint::with_exact(len),
        }
    }
}

impl Body for Items {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Poll::Ready(self.items.pop_front().map(|item| match item {
            Item::Data(d) => Ok(Frame::data(d)),
            Item::Trailers(t) => Ok(Frame::trailers(t)),
            Item::Error(e) => Err(e.into()),
        }))
    }

    fn is_end_stream(&self) -> bool {
        self.items.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        self.hint
    }
}

/// A response with `content_type` and `body`.
pub(crate) fn response<B>(content_type: &str, body: B) -> Response<B> {
    Response::builder()
        .header(header::CONTENT_TYPE, content_type)
        .body(body)
        .unwrap()
}

/// Runs `body` (with `content-type: text/event-stream`) through `layer` for a request carrying
/// `requested` in its extensions, returning the response.
pub(crate) async fn through<B>(
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
pub(crate) struct Collected {
    pub(crate) data: Vec<u8>,
    pub(crate) chunks: Vec<Bytes>,
    pub(crate) trailers: Option<HeaderMap>,
    pub(crate) error: Option<String>,
}

pub(crate) async fn collect<B>(body: B) -> Collected
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
