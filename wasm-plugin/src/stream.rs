//! One HTTP stream: the module's [`StreamFilter`] driven from proxy-wasm's hooks, over
//! [`WasmHost`]. Safe Rust over [`Proxy`], tested with a fake of it.

use bypass_marker::config::Config;
use bypass_marker::stream::{BodyStatus, HeadersStatus, RequestHead, StreamFilter, TrailersStatus};
use proxy_wasm::types::Action;

use crate::host::{Hook, WasmHost};
use crate::proxy::Proxy;

/// The filter's state for one stream, and the proxy it calls.
#[derive(Debug)]
pub struct Stream<P> {
    filter: StreamFilter,
    proxy: P,
}

fn headers(status: HeadersStatus) -> Action {
    match status {
        HeadersStatus::Continue => Action::Continue,
        // Envoy's proxy-wasm turns this into StopAllIterationAndWatermark (the plugin has replied
        // or reset the stream by then; its body hooks are not needed).
        HeadersStatus::StopIteration => Action::Pause,
    }
}

fn body(status: BodyStatus) -> Action {
    match status {
        BodyStatus::Continue => Action::Continue,
        // proxy-wasm has one way to stop a body: StopIterationAndBuffer. After a local reply or a
        // reset what it buffers goes nowhere.
        BodyStatus::StopIterationAndBuffer | BodyStatus::StopIterationNoBuffer => Action::Pause,
    }
}

fn trailers(status: TrailersStatus) -> Action {
    match status {
        TrailersStatus::Continue => Action::Continue,
        TrailersStatus::StopIteration => Action::Pause,
    }
}

impl<P: Proxy> Stream<P> {
    /// A stream under this configuration. The request's head goes on before its body
    /// ([`RequestHead::Forwarded`]): a proxy-wasm headers hook that stops also stops the body
    /// hooks.
    pub fn new(config: &Config, proxy: P) -> Self {
        Self {
            filter: StreamFilter::with_request_head(config, RequestHead::Forwarded),
            proxy,
        }
    }

    /// The proxy, for the tests.
    pub fn proxy(&mut self) -> &mut P {
        &mut self.proxy
    }

    /// `on_http_request_headers`.
    pub fn on_request_headers(&mut self, end_of_stream: bool) -> Action {
        let mut host = WasmHost::new(&mut self.proxy, Hook::RequestHeaders);
        headers(self.filter.on_request_headers(&mut host, end_of_stream))
    }

    /// `on_http_request_body`.
    pub fn on_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let mut host = WasmHost::new(&mut self.proxy, Hook::RequestBody(body_size));
        body(self.filter.on_request_body(&mut host, end_of_stream))
    }

    /// `on_http_request_trailers`.
    pub fn on_request_trailers(&mut self) -> Action {
        let mut host = WasmHost::new(&mut self.proxy, Hook::RequestTrailers);
        trailers(self.filter.on_request_trailers(&mut host))
    }

    /// `on_http_response_headers`.
    pub fn on_response_headers(&mut self, end_of_stream: bool) -> Action {
        let mut host = WasmHost::new(&mut self.proxy, Hook::ResponseHeaders);
        headers(self.filter.on_response_headers(&mut host, end_of_stream))
    }

    /// `on_http_response_body`.
    pub fn on_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let mut host = WasmHost::new(&mut self.proxy, Hook::ResponseBody(body_size));
        body(self.filter.on_response_body(&mut host, end_of_stream))
    }

    /// `on_http_response_trailers`.
    pub fn on_response_trailers(&mut self) -> Action {
        let mut host = WasmHost::new(&mut self.proxy, Hook::ResponseTrailers);
        trailers(self.filter.on_response_trailers(&mut host))
    }

    /// `on_done`: the stream is over; what is left to count is counted.
    pub fn on_done(&mut self) {
        let mut host = WasmHost::new(&mut self.proxy, Hook::Done);
        self.filter.on_stream_complete(&mut host);
    }
}
