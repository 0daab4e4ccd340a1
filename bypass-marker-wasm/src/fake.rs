//! A stream held in memory with the buffer semantics of Envoy's proxy-wasm host (Envoy's
//! `source/extensions/common/wasm/context.cc`): the host of the plugin's tests and of the fuzz
//! target, which drive [`Stream`] without Envoy.
//!
//! - The request body hook sees the chunk alone until the plugin pauses; from then on Envoy adds
//!   each chunk to the body it buffers before the call, and the hook sees all of it.
//! - The response body hook sees its chunk; a trailers hook sees no response body.
//! - `set_buffer` from 0 drains `size` bytes and puts the data in front; from the end or past it,
//!   appends.
//! - A local reply or a reset takes effect when the hook has returned.

use std::cell::RefCell;
use std::collections::HashMap;

use bypass_marker_envoy_adapter::config::FilterConfig;
use bypass_marker_envoy_adapter::stream::memory::request_head;
use bypass_marker_envoy_adapter::stream::RequestHead;
use proxy_wasm::types::{Action, BufferType, LogLevel, MapType};

use crate::proxy::Proxy;
use crate::stream::Stream;

thread_local! {
    /// Counter names by id: ids outlive one fake (the plugin keeps them per VM, per thread).
    static NAMES: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
}

/// One stream as Envoy's proxy-wasm host holds it, and what left it.
#[derive(Debug, Default)]
pub struct FakeProxy {
    /// The request's headers.
    pub request_headers: Vec<(String, Vec<u8>)>,
    /// The response's headers.
    pub response_headers: Vec<(String, Vec<u8>)>,
    /// The request body the current hook sees, if any.
    pub request_body: Option<Vec<u8>>,
    /// The response body the current hook sees, if any.
    pub response_body: Option<Vec<u8>>,
    /// The request head as it went upstream, once it went (Envoy passes it on when a hook of the
    /// plugin first answers Continue).
    pub upstream_head: Option<Vec<(String, Vec<u8>)>>,
    /// What went upstream (the request body).
    pub upstream: Vec<u8>,
    /// What went to the client (the response body).
    pub client: Vec<u8>,
    /// The local reply: status and body.
    pub sent: Option<(u32, Vec<u8>)>,
    /// Whether the stream was reset.
    pub reset: bool,
    /// Counter increments, by metric name.
    pub counts: HashMap<String, u64>,
    /// Log lines.
    pub logs: Vec<(LogLevel, String)>,
    /// `set_buffer` calls on the response body.
    pub response_writes: usize,
    /// `set_buffer` calls on the request body.
    pub request_writes: usize,
    /// `set_buffer` calls on either body that only drained (no data put in).
    pub bare_drains: usize,
    /// `get_buffer` calls on the request body (each a copy into the VM).
    pub request_reads: std::cell::Cell<usize>,
}

impl FakeProxy {
    fn body(&mut self, buffer: BufferType) -> Option<&mut Vec<u8>> {
        match buffer {
            BufferType::HttpRequestBody => {
                self.request_writes += 1;
                self.request_body.as_mut()
            }
            BufferType::HttpResponseBody => {
                self.response_writes += 1;
                self.response_body.as_mut()
            }
            _ => None,
        }
    }

    /// The first value of a request header.
    pub fn header_value(&self, name: &str) -> Option<Vec<u8>> {
        self.request_headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    }

    /// The count of a counter's series with this label.
    pub fn count(
        &self,
        counter: bypass_marker_envoy_adapter::metrics::Counter,
        label: &str,
    ) -> u64 {
        self.counts
            .get(&crate::metrics::metric_name(counter, label))
            .copied()
            .unwrap_or(0)
    }
}

impl Proxy for FakeProxy {
    fn get_buffer(&self, buffer: BufferType, start: usize) -> Option<Vec<u8>> {
        let body = match buffer {
            BufferType::HttpRequestBody => {
                self.request_reads.set(self.request_reads.get() + 1);
                self.request_body.as_ref()
            }
            BufferType::HttpResponseBody => self.response_body.as_ref(),
            _ => None,
        }?;
        Some(body.get(start..).unwrap_or_default().to_vec())
    }

    fn set_buffer(&mut self, buffer: BufferType, start: usize, size: usize, data: &[u8]) {
        let body = self
            .body(buffer)
            .unwrap_or_else(|| panic!("set_buffer on {buffer:?}, which this hook does not have"));
        if start == 0 {
            assert!(size <= body.len(), "drained past the end");
            let bare = size > 0 && data.is_empty();
            body.drain(..size);
            body.splice(0..0, data.iter().copied());
            self.bare_drains += usize::from(bare);
        } else {
            assert!(
                start >= body.len(),
                "set_buffer inside the buffer: BadArgument"
            );
            body.extend_from_slice(data);
        }
    }

    fn get_headers(&self, map: MapType) -> Vec<(String, Vec<u8>)> {
        match map {
            MapType::HttpRequestHeaders => self.request_headers.clone(),
            MapType::HttpResponseHeaders => self.response_headers.clone(),
            _ => Vec::new(),
        }
    }

    fn set_header(&mut self, map: MapType, name: &str, value: Option<&[u8]>) {
        let list = match map {
            MapType::HttpRequestHeaders => &mut self.request_headers,
            MapType::HttpResponseHeaders => &mut self.response_headers,
            _ => panic!("set_header on {map:?}"),
        };
        list.retain(|(key, _)| key != name);
        if let Some(value) = value {
            list.push((name.to_owned(), value.to_vec()));
        }
    }

    fn send_response(&mut self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
        assert_eq!(headers, [("content-type", "application/json")]);
        assert!(self.sent.is_none(), "two local replies");
        self.sent = Some((status, body.to_vec()));
    }

    fn reset(&mut self, _response: bool) {
        self.reset = true;
    }

    fn define_counter(&mut self, name: &str) -> u32 {
        NAMES.with(|names| {
            let mut names = names.borrow_mut();
            names.push(name.to_owned());
            u32::try_from(names.len() - 1).unwrap_or(u32::MAX)
        })
    }

    fn define_gauge(&mut self, name: &str) -> u32 {
        self.define_counter(name)
    }

    fn raise_gauge(&mut self, id: u32, value: u64) {
        let name = NAMES.with(|names| names.borrow()[id as usize].clone());
        let held = self.counts.entry(name).or_default();
        *held = (*held).max(value);
    }

    fn increment(&mut self, id: u32, value: u64) {
        let name = NAMES.with(|names| names.borrow()[id as usize].clone());
        *self.counts.entry(name).or_default() += value;
    }

    fn log(&mut self, level: LogLevel, message: &str) {
        self.logs.push((level, message.to_owned()));
    }
}

/// A plugin stream and its fake Envoy, driven as Envoy drives them.
#[derive(Debug)]
pub struct SimulatedPlugin {
    /// The stream under test, on its fake.
    pub stream: Stream<FakeProxy>,
    buffering_request: bool,
}

impl SimulatedPlugin {
    /// A new stream under this configuration, its request head held until the guard has judged
    /// the body (an Envoy with `allow_on_headers_stop_iteration`).
    pub fn new(config: &FilterConfig) -> Self {
        Self::with_head(config, RequestHead::Held)
    }

    /// A new stream under this configuration, its request head held or forwarded at once.
    pub fn with_head(config: &FilterConfig, head: RequestHead) -> Self {
        Self {
            stream: Stream::new(config, head, FakeProxy::default()),
            buffering_request: false,
        }
    }

    /// The fake Envoy.
    pub fn fake(&mut self) -> &mut FakeProxy {
        self.stream.proxy()
    }

    /// The request's head (`:method` and these headers).
    pub fn request(
        &mut self,
        method: &str,
        headers: &[(&str, &str)],
        end_of_stream: bool,
    ) -> Action {
        self.fake().request_headers = request_head(method, headers);
        let action = self.stream.on_request_headers(end_of_stream);
        if action == Action::Continue {
            self.send_head();
        }
        action
    }

    /// The request head goes upstream as it now is, unless the plugin answered or reset.
    fn send_head(&mut self) {
        let fake = self.fake();
        if fake.upstream_head.is_none() && fake.sent.is_none() && !fake.reset {
            fake.upstream_head = Some(fake.request_headers.clone());
        }
    }

    /// A request chunk: added to the buffered body first if the plugin paused before; on
    /// Continue, what the hook saw goes upstream.
    pub fn request_chunk(&mut self, chunk: &[u8], end_of_stream: bool) -> Action {
        let buffering = self.buffering_request;
        let fake = self.fake();
        match (&mut fake.request_body, buffering) {
            (Some(body), true) => body.extend_from_slice(chunk),
            (body, _) => *body = Some(chunk.to_vec()),
        }
        let size = fake.request_body.as_ref().map_or(0, Vec::len);
        let action = self.stream.on_request_body(size, end_of_stream);
        self.after_request(action);
        action
    }

    /// The request's trailers: the buffered body is there if the plugin paused on a chunk.
    pub fn request_trailers(&mut self) -> Action {
        if !self.buffering_request {
            self.fake().request_body = None;
        }
        let action = self.stream.on_request_trailers();
        self.after_request(action);
        action
    }

    fn after_request(&mut self, action: Action) {
        if action == Action::Continue {
            self.send_head();
        }
        let fake = self.stream.proxy();
        match action {
            Action::Continue => {
                let body = fake.request_body.take().unwrap_or_default();
                fake.upstream.extend_from_slice(&body);
                self.buffering_request = false;
            }
            _ => self.buffering_request = true,
        }
    }

    /// The response's head.
    pub fn response(&mut self, headers: &[(&str, &str)], end_of_stream: bool) -> Action {
        self.fake().request_body = None;
        self.fake().response_headers = headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec()))
            .collect();
        self.stream.on_response_headers(end_of_stream)
    }

    /// A `200 text/event-stream` response head.
    pub fn sse(&mut self) -> Action {
        self.response(
            &[(":status", "200"), ("content-type", "text/event-stream")],
            false,
        )
    }

    /// A response chunk; on Continue what the hook left in it goes to the client.
    pub fn response_chunk(&mut self, chunk: &[u8], end_of_stream: bool) -> Action {
        self.fake().response_body = Some(chunk.to_vec());
        let action = self.stream.on_response_body(chunk.len(), end_of_stream);
        let fake = self.fake();
        let body = fake.response_body.take().unwrap_or_default();
        if action == Action::Continue && !fake.reset {
            fake.client.extend_from_slice(&body);
        }
        action
    }

    /// The response's trailers (no body buffer in the hook).
    pub fn response_trailers(&mut self) -> Action {
        self.stream.on_response_trailers()
    }

    /// The end of the stream.
    pub fn done(&mut self) {
        self.stream.on_done();
    }
}
