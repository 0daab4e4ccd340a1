//! [`Host`] on proxy-wasm: the module's per-stream operations made with the calls of [`Proxy`].
//!
//! Envoy's proxy-wasm shows a hook one body buffer per direction, not the module's two:
//!
//! - **The request body** is one buffer. Once the plugin has paused on a chunk, Envoy adds each
//!   new chunk to the body it buffers *before* calling the plugin, and the plugin sees that whole
//!   buffered body (the chunk at hand in it); before, it sees the chunk alone. A body a filter
//!   before the plugin buffered arrives as one chunk. So the received chunk is always "the
//!   buffered body" ([`Host::received_request_is_buffered`]), read once.
//! - **The response chunk** is the buffer of the body hook. A trailers hook has no body buffer to
//!   add to, so bytes held at the end of the body cannot go out before the trailers: the stream
//!   is reset instead ([`Host::append_body`] refuses).

use std::cell::{Cell, RefCell};

use bypass_marker::metrics::Counter;
use bypass_marker::stream::{Body, Headers, Host, Level};
use http::{HeaderMap, HeaderName, HeaderValue};
use proxy_wasm::types::{BufferType, LogLevel, MapType};

use crate::proxy::Proxy;

/// Which hook is running: where a reset goes, and which buffers exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    /// A request headers hook.
    RequestHeaders,
    /// A request body hook, with the size Envoy gave it.
    RequestBody(usize),
    /// A request trailers hook.
    RequestTrailers,
    /// A response headers hook.
    ResponseHeaders,
    /// A response body hook, with the size Envoy gave it.
    ResponseBody(usize),
    /// A response trailers hook.
    ResponseTrailers,
    /// The end of the stream.
    Done,
}

/// A header map as read from Envoy: (name, value) pairs in order.
type HeaderList = Vec<(String, Vec<u8>)>;

/// One stream's view of Envoy during one hook.
#[derive(Debug)]
pub struct WasmHost<'a, P> {
    proxy: &'a mut P,
    hook: Hook,
    /// The length of the hook's body buffer, as changed by this hook; `None` until known.
    len: Cell<Option<usize>>,
    /// The headers of the hook's map, read once per hook (until the hook sets one).
    headers: RefCell<Option<(MapType, HeaderList)>>,
}

impl<'a, P: Proxy> WasmHost<'a, P> {
    /// The host of one hook.
    pub fn new(proxy: &'a mut P, hook: Hook) -> Self {
        let len = match hook {
            Hook::RequestBody(n) | Hook::ResponseBody(n) => Some(n),
            _ => None,
        };
        Self {
            proxy,
            hook,
            len: Cell::new(len),
            headers: RefCell::new(None),
        }
    }

    fn is_response(&self) -> bool {
        matches!(
            self.hook,
            Hook::ResponseHeaders | Hook::ResponseBody(_) | Hook::ResponseTrailers
        )
    }

    /// The buffer a body name reaches in this hook, if it has one.
    fn buffer(&self, body: Body) -> Option<BufferType> {
        match (body, self.hook) {
            (
                Body::ReceivedRequest | Body::BufferedRequest,
                Hook::RequestBody(_) | Hook::RequestTrailers,
            ) => Some(BufferType::HttpRequestBody),
            (Body::ReceivedResponse, Hook::ResponseBody(_)) => Some(BufferType::HttpResponseBody),
            _ => None,
        }
    }

    fn map(headers: Headers) -> MapType {
        match headers {
            Headers::Request => MapType::HttpRequestHeaders,
            Headers::Response => MapType::HttpResponseHeaders,
        }
    }

    /// Calls `f` with the headers of a map, read from Envoy once per hook.
    fn with_headers<R>(&self, headers: Headers, f: impl FnOnce(&[(String, Vec<u8>)]) -> R) -> R {
        let map = Self::map(headers);
        let mut cache = self.headers.borrow_mut();
        match &*cache {
            Some((cached, _)) if *cached == map => {}
            _ => *cache = Some((map, self.proxy.get_headers(map))),
        }
        f(cache.as_ref().map_or(&[][..], |(_, list)| list))
    }

    /// The length of a body buffer, asked of Envoy once per hook where the hook did not say.
    fn len_of(&self, buffer: BufferType) -> usize {
        match self.len.get() {
            Some(n) => n,
            None => {
                let n = self.proxy.get_buffer(buffer, 0).map_or(0, |b| b.len());
                self.len.set(Some(n));
                n
            }
        }
    }
}

impl<P: Proxy> Host for WasmHost<'_, P> {
    fn headers(&self, headers: Headers, name: &HeaderName, into: &mut HeaderMap) -> bool {
        self.with_headers(headers, |list| {
            for (key, value) in list {
                if key.eq_ignore_ascii_case(name.as_str()) {
                    match HeaderValue::from_bytes(value) {
                        Ok(value) => {
                            into.append(name.clone(), value);
                        }
                        Err(_) => return false,
                    }
                }
            }
            true
        })
    }

    fn value(&self, headers: Headers, name: &str) -> Option<Vec<u8>> {
        self.with_headers(headers, |list| {
            list.iter()
                .find(|(key, _)| key.eq_ignore_ascii_case(name))
                .map(|(_, value)| value.clone())
        })
    }

    fn set_header(&mut self, headers: Headers, name: &str, value: Option<&[u8]>) -> bool {
        self.proxy.set_header(Self::map(headers), name, value);
        *self.headers.get_mut() = None;
        true
    }

    fn received_request_is_buffered(&self) -> bool {
        true
    }

    fn body_len(&self, body: Body) -> usize {
        self.buffer(body).map_or(0, |buffer| self.len_of(buffer))
    }

    fn with_body<R>(&self, body: Body, f: impl FnOnce(&[&[u8]]) -> R) -> R {
        let bytes = match (self.buffer(body), self.len.get()) {
            (None, _) | (_, Some(0)) => None,
            (Some(buffer), _) => self.proxy.get_buffer(buffer, 0),
        };
        match &bytes {
            Some(bytes) if !bytes.is_empty() => f(&[bytes.as_slice()]),
            _ => f(&[]),
        }
    }

    fn drain_body(&mut self, body: Body, n: usize) -> bool {
        let Some(buffer) = self.buffer(body) else {
            return false;
        };
        let len = self.len_of(buffer);
        if n > len {
            return false;
        }
        self.proxy.set_buffer(buffer, 0, n, &[]);
        self.len.set(Some(len - n));
        true
    }

    fn append_body(&mut self, body: Body, data: &[u8]) -> bool {
        let Some(buffer) = self.buffer(body) else {
            return false;
        };
        let len = self.len_of(buffer);
        self.proxy.set_buffer(buffer, len, 0, data);
        self.len.set(Some(len + data.len()));
        true
    }

    fn send_response(&mut self, status: u16, headers: &[(&str, &[u8])], body: &[u8]) {
        let headers: Vec<(&str, &str)> = headers
            .iter()
            .filter_map(|(name, value)| Some((*name, std::str::from_utf8(value).ok()?)))
            .collect();
        self.proxy.send_response(u32::from(status), &headers, body);
    }

    fn reset_stream(&mut self, _details: &str) {
        let response = self.is_response();
        self.proxy.reset(response);
    }

    fn increment(&mut self, counter: Counter, label: &str, value: u64) {
        crate::metrics::increment(self.proxy, counter, label, value);
    }

    fn log(&mut self, level: Level, message: &str) {
        let level = match level {
            Level::Info => LogLevel::Info,
            Level::Warn => LogLevel::Warn,
            Level::Error => LogLevel::Error,
        };
        self.proxy.log(level, message);
    }
}
