//! Counting what the layer does: a hook for metrics.

use std::fmt;
use std::sync::Arc;

/// Observes what a layer and its guard decide, for metrics: the annotation frames removed and
/// forwarded, frames too large to judge, encoded streams refused, and the JSON guard's stripped
/// names, grants and refusals. Every method has a default that does nothing.
///
/// Set with [`BypassMarkerLayer::observe`](crate::BypassMarkerLayer::observe); every body, filter
/// and processor made from that layer calls it. The calls are made where the frame is decided, on
/// the task that polls the body, so an implementation must be cheap and must not block: an atomic
/// increment per call is the intended use. No call allocates. A layer without an observer makes no
/// call and pays one branch per removed frame.
///
/// ```
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use std::sync::Arc;
/// use tower_bypass_marker::{BypassMarkerLayer, FrameObserver, RequestedAnnotations};
///
/// #[derive(Default)]
/// struct Removed(AtomicU64);
///
/// impl FrameObserver for Removed {
///     fn frame_removed(&self, _annotation: Option<&str>, _bytes: usize) {
///         self.0.fetch_add(1, Ordering::Relaxed);
///     }
/// }
///
/// let removed = Arc::new(Removed::default());
/// let layer = BypassMarkerLayer::new().observe(removed.clone());
///
/// let mut filter = layer.event_stream_filter(&RequestedAnnotations::new()).unwrap();
/// let out = filter.filter_all([&b"event: x-bypass-remote-prefill\n: true\n\ndata: 1\n\n"[..]]);
/// assert_eq!(out.unwrap(), &b"data: 1\n\n"[..]);
/// assert_eq!(removed.0.load(Ordering::Relaxed), 1);
/// ```
///
/// # Tracing events
///
/// With feature `tracing`, each decision is also an event, emitted in the span that was current
/// when the request reached the layer or the guard (tower-http's `TraceLayer` makes one per
/// request), with these fields (target `tower_bypass_marker::...`):
///
/// | level | message | fields | observer call |
/// | --- | --- | --- | --- |
/// | `debug` | `removed annotation frame` | `event` (the name, or `(no data field)`), `bytes` | [`frame_removed`](Self::frame_removed) |
/// | `debug` | `event stream ended` / `event stream dropped before its end` | `removed_frames`, `removed_bytes` (`held_bytes` when dropped) | |
/// | `warn` | `a frame outgrew max_frame_bytes and is forwarded unfiltered (Overflow::Forward)` | `limit` | [`frame_too_large`](Self::frame_too_large) `(limit, true)` |
/// | `warn` | `event stream failed: a frame outgrew max_frame_bytes (Overflow::Error)` | `removed_frames`, `removed_bytes`, `limit` | [`frame_too_large`](Self::frame_too_large) `(limit, false)` |
/// | `warn` | `encoded event stream refused with a 502: it cannot be filtered` | `coding` (`gzip`, `transfer-encoding gzip`) | [`encoded_stream_refused`](Self::encoded_stream_refused) |
/// | `info` | `router-owned annotation stripped from the request's nvext.annotations` | `annotation` | [`annotation_stripped`](Self::annotation_stripped) |
/// | `debug` | `annotation granted to the client` | `annotation` | [`annotation_granted`](Self::annotation_granted) |
/// | `info` | `request refused by the guard` | `status`, `code`, `reason` (the error's message) | [`request_refused`](Self::request_refused) |
///
/// `examples/prometheus.rs` turns the calls into Prometheus counters with an `annotation` or a
/// `reason` label.
pub trait FrameObserver: Send + Sync + 'static {
    /// A frame was removed. `annotation` is the configured name whose `event` field made it go,
    /// or `None` when SDK-safe mode removed a frame that has fields but no `data`. `bytes` is the
    /// length of the frame, its closing empty line included (as far as it had arrived: the LF of
    /// a CRLF split across chunks is not counted).
    fn frame_removed(&self, annotation: Option<&str>, bytes: usize) {
        let _ = (annotation, bytes);
    }

    /// A frame whose event type is a configured name was forwarded to a client that opted in to
    /// it. Counted on filtered bodies; a layer with an observer filters every event stream of a
    /// client that opted in to a configured name, so that these are seen.
    fn frame_forwarded(&self, annotation: &str) {
        let _ = annotation;
    }

    /// An event stream in a content coding the filter cannot read (`coding`: the codings other
    /// than `identity`, such as `gzip`) was refused with a 502 before any byte of it, because
    /// something would have been removed from it for its client. Called once per such response,
    /// by the layer and by every processor made from it.
    fn encoded_stream_refused(&self, coding: &str) {
        let _ = coding;
    }

    /// A frame that spans chunks outgrew [`max_frame_bytes`](crate::BypassMarkerLayer::max_frame_bytes)
    /// (`limit`): `forwarded` is true under [`Overflow::Forward`](crate::Overflow::Forward) (the
    /// frame goes out unfiltered, whatever its event type), false under
    /// [`Overflow::Error`](crate::Overflow::Error) (the body fails with
    /// [`FrameTooLarge`](crate::FrameTooLarge)). Once per such frame.
    fn frame_too_large(&self, limit: usize, forwarded: bool) {
        let _ = (limit, forwarded);
    }

    /// The JSON guard (feature `json`) stripped from a request's `nvext.annotations` at least one
    /// entry naming the router-owned `annotation` (in any form, or a near miss of it). Once per
    /// request and name, however many entries named it.
    fn annotation_stripped(&self, annotation: &str) {
        let _ = annotation;
    }

    /// The JSON guard granted a request the configured `annotation` it listed: its frames go to
    /// that client. Once per request and name.
    fn annotation_granted(&self, annotation: &str) {
        let _ = annotation;
    }

    /// The JSON guard answered a request itself: `status` (400, 413, 415) and the error's `code`
    /// (`invalid_json`, `duplicate_key`, `invalid_nvext`, `request_too_large`,
    /// `unsupported_content_encoding`, `unsupported_media_type`, `body_read_error`; see the
    /// [`json` module](crate::json)). Nothing of the request went on.
    fn request_refused(&self, status: http::StatusCode, code: &str) {
        let _ = (status, code);
    }

    /// The observer for one request's frames, from its head: called by
    /// [`BypassMarker`](crate::BypassMarker) and the JSON guard once per request, before the
    /// service below them, so that the calls for that request can be told apart (by route, tenant, request id, or
    /// anything an earlier layer put in its extensions). `None`, the default, means this observer
    /// is called. The sans-IO cores have no request head: their calls go to this observer.
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use tower_bypass_marker::{BypassMarkerLayer, FrameObserver};
    ///
    /// # #[derive(Clone)] struct RequestId(&'static str);
    /// /// Logs removed frames with the request id an earlier layer put in the extensions.
    /// #[derive(Default)]
    /// struct ByRequest(Arc<Mutex<Vec<String>>>);
    ///
    /// struct ForOne(Arc<Mutex<Vec<String>>>, &'static str);
    ///
    /// impl FrameObserver for ByRequest {
    ///     fn for_request(&self, request: &http::request::Parts) -> Option<Arc<dyn FrameObserver>> {
    ///         let id = request.extensions.get::<RequestId>()?.0;
    ///         Some(Arc::new(ForOne(self.0.clone(), id)))
    ///     }
    /// }
    ///
    /// impl FrameObserver for ForOne {
    ///     fn frame_removed(&self, annotation: Option<&str>, _bytes: usize) {
    ///         self.0.lock().unwrap().push(format!("{}: {annotation:?}", self.1));
    ///     }
    /// }
    /// # use bytes::Bytes;
    /// # use http::{header, Request, Response};
    /// # use http_body_util::{BodyExt, Full};
    /// # use tower::{service_fn, ServiceBuilder, ServiceExt};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let seen = Arc::new(Mutex::new(Vec::new()));
    /// let layer = BypassMarkerLayer::new().observe(Arc::new(ByRequest(seen.clone())));
    /// let svc = ServiceBuilder::new().layer(layer).service(service_fn(|_req: Request<Full<Bytes>>| async {
    ///     let body = "event: x-bypass-remote-prefill\n: true\n\ndata: {}\n\n";
    ///     Ok::<_, std::convert::Infallible>(
    ///         Response::builder()
    ///             .header(header::CONTENT_TYPE, "text/event-stream")
    ///             .body(Full::new(Bytes::from(body)))
    ///             .unwrap(),
    ///     )
    /// }));
    /// let mut req = Request::new(Full::default());
    /// req.extensions_mut().insert(RequestId("r-42"));
    /// let body = svc.oneshot(req).await.unwrap().into_body().collect().await.unwrap();
    /// assert_eq!(body.to_bytes(), "data: {}\n\n");
    /// assert_eq!(*seen.lock().unwrap(), ["r-42: Some(\"x-bypass-remote-prefill\")"]);
    /// # }
    /// ```
    fn for_request(&self, request: &http::request::Parts) -> Option<Arc<dyn FrameObserver>> {
        let _ = request;
        None
    }
}

/// The observer a configuration holds.
#[derive(Clone)]
pub(crate) struct Observer(pub(crate) Arc<dyn FrameObserver>);

impl fmt::Debug for Observer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FrameObserver")
    }
}
