use std::sync::Arc;
use std::task::{Context, Poll};

use http::header::{CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::Body;
use tower_service::Service;

use crate::config::Config;
use crate::json::response::Refusal;
use crate::json::{JsonGuardBody, JsonGuardLayer, ResponseBody, ResponseFuture};

/// Middleware that strips router-owned names from the `nvext.annotations` of JSON request bodies
/// and puts the client's opt-in in the request's extensions.
///
/// Made by [`JsonGuardLayer`]; see the [module docs](crate::json) for the rules and an example.
#[derive(Clone)]
pub struct JsonGuard<S> {
    inner: S,
    config: Arc<Config>,
    max_body_bytes: usize,
}

impl<S> JsonGuard<S> {
    pub(crate) fn new(inner: S, layer: JsonGuardLayer) -> Self {
        Self {
            inner,
            config: layer.config,
            max_body_bytes: layer.max_body_bytes,
        }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes `self`, returning the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: std::fmt::Debug> std::fmt::Debug for JsonGuard<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JsonGuard")
            .field("inner", &self.inner)
            .field(
                "layer",
                &JsonGuardLayer {
                    config: self.config.clone(),
                    max_body_bytes: self.max_body_bytes,
                },
            )
            .finish()
    }
}

impl<S, B, ResBody> Service<Request<B>> for JsonGuard<S>
where
    S: Service<Request<JsonGuardBody<B>>, Response = Response<ResBody>> + Clone,
    B: Body,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        if !inspects(&req) {
            return ResponseFuture::call(self.inner.call(req.map(JsonGuardBody::passthrough)));
        }
        if !identity_only(req.headers()) {
            return ResponseFuture::refused(Refusal::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_content_encoding",
                "the request body has a content-encoding; send JSON request bodies unencoded"
                    .to_owned(),
            ));
        }
        let declared = declared_length(&req);
        if declared > self.max_body_bytes as u64 {
            return ResponseFuture::refused(too_large(self.max_body_bytes));
        }
        // The service that was made ready goes with the request; `self` keeps a clone.
        let clone = self.inner.clone();
        let service = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::collect(req, service, self.config.clone(), self.max_body_bytes)
    }
}

pub(crate) fn too_large(max: usize) -> Refusal {
    Refusal::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "request_too_large",
        format!("the request body is larger than the limit of {max} bytes"),
    )
}

/// Whether the guard reads this request's body: it has one (not known to be empty), and its
/// content type is JSON (`application/json` or `application/*+json`, any case, parameters
/// allowed; any of several `content-type` headers), absent, or empty (FastAPI parses a body whose
/// `content-type` is empty as JSON, as it does one without the header).
fn inspects<B: Body>(req: &Request<B>) -> bool {
    let body = req.body();
    if body.is_end_stream() || body.size_hint().exact() == Some(0) {
        return false;
    }
    let mut types = req.headers().get_all(CONTENT_TYPE).iter().peekable();
    types.peek().is_none()
        || types.any(|v| trim_ows(v.as_bytes()).is_empty() || is_json_media_type(v.as_bytes()))
}

/// `application/json` or `application/<anything>+json`, any case, parameters allowed.
pub(crate) fn is_json_media_type(value: &[u8]) -> bool {
    let essence = value.split(|&b| b == b';').next().unwrap_or(value);
    let essence = trim_ows(essence);
    let Some(slash) = essence.iter().position(|&b| b == b'/') else {
        return false;
    };
    let (kind, subtype) = (&essence[..slash], &essence[slash + 1..]);
    kind.eq_ignore_ascii_case(b"application")
        && (subtype.eq_ignore_ascii_case(b"json")
            || (subtype.len() > b"+json".len()
                && subtype[subtype.len() - 5..].eq_ignore_ascii_case(b"+json")))
}

/// No `content-encoding` but `identity` (any case; empty list elements are ignored, RFC 9110
/// section 5.6.1).
fn identity_only(headers: &HeaderMap) -> bool {
    headers.get_all(CONTENT_ENCODING).iter().all(|v| {
        v.as_bytes()
            .split(|&b| b == b',')
            .map(trim_ows)
            .all(|coding| coding.is_empty() || coding.eq_ignore_ascii_case(b"identity"))
    })
}

/// The larger of the `content-length` header and the body's lower size bound.
fn declared_length<B: Body>(req: &Request<B>) -> u64 {
    let header = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| std::str::from_utf8(v.as_bytes()).ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    let hint = req.body().size_hint().lower();
    header.unwrap_or(0).max(hint)
}

fn trim_ows(mut bytes: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = bytes {
        bytes = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = bytes {
        bytes = rest;
    }
    bytes
}
