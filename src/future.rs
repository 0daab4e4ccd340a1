use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use http::header::{CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE};
use http::{HeaderMap, Response};
use pin_project_lite::pin_project;

use crate::annotations::RequestedAnnotations;
use crate::body::BypassMarkerBody;
use crate::config::Config;
use crate::scan::Scanner;

pin_project! {
    /// Response future for [`BypassMarker`](crate::BypassMarker): decides from the response head
    /// whether the body is filtered or passed through.
    pub struct ResponseFuture<F> {
        #[pin]
        inner: F,
        config: Arc<Config>,
        requested: u64,
    }
}

impl<F> ResponseFuture<F> {
    pub(crate) fn new(inner: F, config: Arc<Config>, requested: u64) -> Self {
        Self {
            inner,
            config,
            requested,
        }
    }
}

impl<F: std::fmt::Debug> std::fmt::Debug for ResponseFuture<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<F, B, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<BypassMarkerBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let res = ready!(this.inner.poll(cx))?;
        let (mut parts, body) = res.into_parts();
        let config = this.config;

        if !is_plain_event_stream(&parts.headers) {
            return Poll::Ready(Ok(Response::from_parts(
                parts,
                BypassMarkerBody::passthrough(body),
            )));
        }
        let requested = *this.requested
            | parts
                .extensions
                .get::<RequestedAnnotations>()
                .map_or(0, |r| config.requested_mask(r));
        let remove = config.removal_mask(requested);
        let body = if remove == 0 && !config.sdk_safe {
            BypassMarkerBody::passthrough(body)
        } else {
            parts.headers.remove(CONTENT_LENGTH);
            BypassMarkerBody::filtering(body, Scanner::new(config.clone(), remove))
        };
        Poll::Ready(Ok(Response::from_parts(parts, body)))
    }
}

/// `content-type: text/event-stream` (any case, parameters allowed) with no content coding
/// other than `identity`.
fn is_plain_event_stream(headers: &HeaderMap) -> bool {
    let Some(content_type) = headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let essence = content_type.split(';').next().unwrap_or("").trim();
    if !essence.eq_ignore_ascii_case("text/event-stream") {
        return false;
    }
    headers.get_all(CONTENT_ENCODING).iter().all(|v| {
        v.to_str().is_ok_and(|v| {
            v.split(',')
                .all(|coding| coding.trim().eq_ignore_ascii_case("identity"))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(
                http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                value.parse().unwrap(),
            );
        }
        map
    }

    #[test]
    fn event_stream_media_type_is_matched_case_insensitively_with_parameters() {
        assert!(is_plain_event_stream(&headers(&[(
            "content-type",
            "text/event-stream"
        )])));
        assert!(is_plain_event_stream(&headers(&[(
            "content-type",
            "Text/Event-Stream; charset=utf-8"
        )])));
        assert!(is_plain_event_stream(&headers(&[(
            "content-type",
            " text/event-stream ;x=y"
        )])));
    }

    #[test]
    fn other_media_types_are_not_event_streams() {
        assert!(!is_plain_event_stream(&headers(&[])));
        assert!(!is_plain_event_stream(&headers(&[(
            "content-type",
            "application/json"
        )])));
        assert!(!is_plain_event_stream(&headers(&[(
            "content-type",
            "application/grpc"
        )])));
        assert!(!is_plain_event_stream(&headers(&[(
            "content-type",
            "text/event-streamx"
        )])));
    }

    #[test]
    fn encoded_event_streams_are_not_filtered_but_identity_is() {
        let ct = ("content-type", "text/event-stream");
        assert!(!is_plain_event_stream(&headers(&[
            ct,
            ("content-encoding", "gzip")
        ])));
        assert!(!is_plain_event_stream(&headers(&[
            ct,
            ("content-encoding", "identity, br")
        ])));
        assert!(!is_plain_event_stream(&headers(&[
            ct,
            ("content-encoding", "identity"),
            ("content-encoding", "gzip")
        ])));
        assert!(is_plain_event_stream(&headers(&[
            ct,
            ("content-encoding", "Identity")
        ])));
    }
}
