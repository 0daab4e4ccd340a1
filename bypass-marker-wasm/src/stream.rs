//! One HTTP stream: the module's [`StreamFilter`] driven from proxy-wasm's hooks, over
//! [`WasmHost`]. Safe Rust over [`Proxy`], tested with a fake of it.

use bypass_marker_envoy_adapter::config::FilterConfig;
use bypass_marker_envoy_adapter::stream::{
    BodyStatus, HeadersStatus, RequestHead, StreamFilter, TrailersStatus,
};
use proxy_wasm::types::Action;

use crate::host::{Hook, WasmHost};
use crate::proxy::Proxy;

/// The filter's state for one stream, and the proxy it calls.
#[derive(Debug)]
pub struct Stream<P> {
    filter: StreamFilter,
    proxy: P,
    /// The request body Envoy holds for the plugin: the size the last request body hook was
    /// given while the plugin paused (Envoy's buffered body, which a trailers hook then reads),
    /// so that the trailers hook need not copy the body into the VM to learn its length.
    request_held: usize,
}

fn headers(status: HeadersStatus) -> Action {
    match status {
        HeadersStatus::Continue => Action::Continue,
        // Envoy (1.35 and later) turns this into StopIteration where the plugin's configuration
        // sets `allow_on_headers_stop_iteration: true`: the head waits, and the body hooks go on.
        // Without that setting Envoy makes it StopAllIterationAndWatermark, and the body hooks of
        // a head held for the guard never come (docs/envoy.md, "Holding the request head").
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
    /// A stream under this configuration, its request head held until the guard has judged the
    /// body ([`RequestHead::Held`], which needs Envoy's `allow_on_headers_stop_iteration`) or
    /// passed on at once ([`RequestHead::Forwarded`]).
    pub fn new(config: &FilterConfig, head: RequestHead, proxy: P) -> Self {
        Self {
            filter: StreamFilter::with_request_head(config, head),
            proxy,
            request_held: 0,
        }
    }

    /// The proxy, for the tests.
    pub fn proxy(&mut self) -> &mut P {
        &mut self.proxy
    }

    /// Whether the request's head is held waiting for its body
    /// ([`StreamFilter::holds_request_head`]).
    pub fn holds_request_head(&self) -> bool {
        self.filter.holds_request_head()
    }

    /// `on_http_request_headers`.
    pub fn on_request_headers(&mut self, end_of_stream: bool) -> Action {
        let mut host = WasmHost::new(&mut self.proxy, Hook::RequestHeaders);
        headers(self.filter.on_request_headers(&mut host, end_of_stream))
    }

    /// `on_http_request_body`.
    pub fn on_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let mut host = WasmHost::new(&mut self.proxy, Hook::RequestBody(body_size));
        let action = body(self.filter.on_request_body(&mut host, end_of_stream));
        self.request_held = match action {
            Action::Pause => host.buffer_len(),
            _ => 0,
        };
        action
    }

    /// `on_http_request_trailers`.
    pub fn on_request_trailers(&mut self) -> Action {
        let mut host = WasmHost::new(&mut self.proxy, Hook::RequestTrailers(self.request_held));
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
        drop(host);
        crate::metrics::report_memory(&mut self.proxy, crate::metrics::vm_memory());
    }
}
