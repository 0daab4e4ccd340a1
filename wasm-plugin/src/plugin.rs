//! The proxy-wasm contexts: the root context reads the configuration, each HTTP context is a
//! [`Stream`] on Envoy's host calls.

use std::rc::Rc;

use bypass_marker::config::Config;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

use crate::proxy::{Hostcalls, Proxy};
use crate::stream::Stream;

/// The root context of one plugin configuration.
#[derive(Debug, Default)]
pub struct Root {
    config: Option<Rc<Config>>,
}

/// Reads a plugin configuration: the module's `filter_config` JSON. A refused one is logged at
/// `error` with the key at fault, and the plugin does not start (`on_configure` answers false).
pub fn configure(proxy: &mut impl Proxy, text: &[u8]) -> Option<Config> {
    match Config::parse(text) {
        Ok(config) => Some(config),
        Err(err) => {
            proxy.log(
                LogLevel::Error,
                &format!("bypass_marker: refused the plugin configuration: {err}"),
            );
            None
        }
    }
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let text = self.get_plugin_configuration().unwrap_or_default();
        self.config = configure(&mut Hostcalls, &text).map(Rc::new);
        self.config.is_some()
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        let config = self.config.as_ref()?;
        Some(Box::new(Http(Stream::new(config, Hostcalls))))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// One HTTP stream's context.
#[derive(Debug)]
pub struct Http(Stream<Hostcalls>);

impl Context for Http {
    fn on_done(&mut self) -> bool {
        self.0.on_done();
        true
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.0.on_request_headers(end_of_stream)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.0.on_request_body(body_size, end_of_stream)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        self.0.on_request_trailers()
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.0.on_response_headers(end_of_stream)
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if cfg!(feature = "floor-call") {
            return Action::Continue;
        }
        if cfg!(feature = "floor-read") {
            let chunk = Hostcalls.get_buffer(proxy_wasm::types::BufferType::HttpResponseBody, 0);
            std::hint::black_box(chunk);
            return Action::Continue;
        }
        self.0.on_response_body(body_size, end_of_stream)
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        self.0.on_response_trailers()
    }
}
