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

use std::cell::RefCell;

use bypass_marker_envoy_adapter::metrics::Counter;
use bypass_marker_envoy_adapter::stream::{append_header_values, Body, Headers, Host, Level};
use http::{HeaderMap, HeaderName};
use proxy_wasm::types::{BufferType, LogLevel, MapType};

use crate::proxy::Proxy;

/// Which hook is running: where a reset goes, and which buffers exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    /// A request headers hook.
    RequestHeaders,
    /// A request body hook, with the size Envoy gave it.
    RequestBody(usize),
    /// A request trailers hook, with the length of the request body Envoy holds (from the last
    /// body hook).
    RequestTrailers(usize),
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
pub struct WasmHost<'a, P: Proxy> {
    proxy: &'a mut P,
    hook: Hook,
    /// The length of the hook's body buffer, as changed by this hook (0 where it has none).
    len: usize,
    /// A drain of the whole body buffer not made yet: the next append replaces the body in one
    /// `set_buffer` call; if none comes, the drain is made when the hook ends.
    drained: Option<(BufferType, usize)>,
    /// The headers of the hook's map, read once per hook (until the hook sets one).
    headers: RefCell<Option<(MapType, HeaderList)>>,
}

impl<'a, P: Proxy> WasmHost<'a, P> {
    /// The host of one hook.
    pub fn new(proxy: &'a mut P, hook: Hook) -> Self {
        let len = match hook {
            Hook::RequestBody(n) | Hook::ResponseBody(n) | Hook::RequestTrailers(n) => n,
            _ => 0,
        };
        Self {
            proxy,
            hook,
            len,
            drained: None,
            headers: RefCell::new(None),
        }
    }

    /// The length of the hook's body buffer now.
    pub fn buffer_len(&self) -> usize {
        self.len
    }

    /// Makes a pending drain of the whole buffer.
    fn flush_drain(&mut self) {
        if let Some((buffer, n)) = self.drained.take() {
            self.proxy.set_buffer(buffer, 0, n, &[]);
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
                Hook::RequestBody(_) | Hook::RequestTrailers(_),
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

    /// The body buffer's bytes, copied into the VM by Envoy (the one copy the plugin makes).
    fn read(&self, body: Body) -> Option<Vec<u8>> {
        match self.buffer(body) {
            Some(buffer) if self.len > 0 => self.proxy.get_buffer(buffer, 0),
            _ => None,
        }
    }
}

impl<P: Proxy> Drop for WasmHost<'_, P> {
    fn drop(&mut self) {
        // A drain with nothing appended after it: made before the hook returns to Envoy.
        self.flush_drain();
    }
}

impl<P: Proxy> Host for WasmHost<'_, P> {
    fn headers(&self, headers: Headers, name: &HeaderName, into: &mut HeaderMap) -> bool {
        self.with_headers(headers, |list| {
            let values = list
                .iter()
                .filter(|(key, _)| key.eq_ignore_ascii_case(name.as_str()))
                .map(|(_, value)| value.as_slice());
            append_header_values(name, values, into)
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
        self.buffer(body).map_or(0, |_| self.len)
    }

    fn with_body<R>(&self, body: Body, f: impl FnOnce(&[&[u8]]) -> R) -> R {
        match self.read(body) {
            Some(bytes) if !bytes.is_empty() => f(&[bytes.as_slice()]),
            _ => f(&[]),
        }
    }

    fn body_bytes(&self, body: Body) -> bytes::Bytes {
        // Envoy's copy into the VM is the buffer judged: not copied again.
        self.read(body).map(bytes::Bytes::from).unwrap_or_default()
    }

    fn drain_body(&mut self, body: Body, n: usize) -> bool {
        let Some(buffer) = self.buffer(body) else {
            return false;
        };
        if n > self.len {
            return false;
        }
        if n == self.len && self.drained.is_none() {
            // The whole buffer: left for the append that replaces it, in one call.
            self.drained = Some((buffer, n));
        } else {
            self.flush_drain();
            self.proxy.set_buffer(buffer, 0, n, &[]);
        }
        self.len -= n;
        true
    }

    fn append_body(&mut self, body: Body, data: &[u8]) -> bool {
        let Some(buffer) = self.buffer(body) else {
            return false;
        };
        match self.drained.take() {
            // From 0, Envoy drains `n` bytes and puts the data in front: the body replaced.
            Some((drained, n)) if drained == buffer => self.proxy.set_buffer(buffer, 0, n, data),
            pending => {
                self.drained = pending;
                self.flush_drain();
                self.proxy.set_buffer(buffer, self.len, 0, data);
            }
        }
        self.len += data.len();
        true
    }

    fn send_response(&mut self, status: u16, headers: &[(&str, &[u8])], body: &[u8]) {
        let headers: Vec<(&str, &str)> = headers
            .iter()
            .filter_map(|(name, value)| Some((*name, std::str::from_utf8(value).ok()?)))
            .collect();
        self.flush_drain();
        self.proxy.send_response(u32::from(status), &headers, body);
    }

    fn reset_stream(&mut self, _details: &str) {
        let response = self.is_response();
        self.flush_drain();
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
