//! Counting what the layer does: a hook for metrics.

use std::fmt;
use std::sync::Arc;

/// Observes the annotation frames a layer removes or forwards, for metrics.
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
}

/// The observer a configuration holds.
#[derive(Clone)]
pub(crate) struct Observer(pub(crate) Arc<dyn FrameObserver>);

impl fmt::Debug for Observer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FrameObserver")
    }
}
