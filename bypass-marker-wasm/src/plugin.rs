//! The proxy-wasm contexts: the root context reads the configuration, each HTTP context is a
//! [`Stream`] on Envoy's host calls.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, SystemTime};

use bypass_marker_envoy_adapter::config::FilterConfig;
use bypass_marker_envoy_adapter::stream::RequestHead;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};
use serde_json::{Map, Value};

use crate::proxy::{Hostcalls, Proxy};
use crate::stream::Stream;
use crate::watch::{HeldHeads, TICK_SECS};

/// The largest `max-body` the plugin takes: 512 MiB. A request body being judged is held in the
/// worker's VM (one copy; a rewrite is made of its pieces), and Envoy's V8 does not grow a VM to
/// hold a body of 1 GiB: measured with tests/envoy/wasm_memory.sh in Envoy 1.40.0, a 512 MiB body
/// is judged with the VM at 513 MiB, and a 1 GiB body traps the VM (Envoy's 503), which fails
/// every stream of that worker.
pub const MAX_BODY_LIMIT: u64 = 512 << 20;

/// Which build this is: `None` for the release build, else the name of a test or benchmark build
/// (the cargo feature it was built with), which starts only where the configuration names it
/// (`"build": "<name>"`).
pub const BUILD: Option<&str> = if cfg!(feature = "test-panic") {
    Some("test-panic")
} else if cfg!(feature = "floor-call") {
    Some("floor-call")
} else if cfg!(feature = "floor-read") {
    Some("floor-read")
} else {
    None
};

/// A plugin configuration read: the module's configuration, and where the request head waits.
#[derive(Debug, Clone)]
pub struct PluginConfig {
    /// The keys the plugin shares with the dynamic module (its `filter_config`).
    pub config: FilterConfig,
    /// `request-head`: held until the guard has judged the body (the default; Envoy's
    /// `allow_on_headers_stop_iteration: true` must be set in the plugin's Envoy configuration),
    /// or forwarded at once (`"forwarded"`, for an Envoy whose configuration cannot reach that
    /// setting: the body is still judged whole before any byte of it goes on, but a refused
    /// request's head has reached the upstream, and a shortened body is padded with spaces to the
    /// `content-length` already sent).
    pub head: RequestHead,
}

/// Reads a plugin configuration: the module's `filter_config` JSON, plus the plugin's own keys
/// `request-head` and `build`. Errors name the key as the user wrote it in Envoy's
/// `configuration`.
pub fn parse(text: &[u8]) -> Result<PluginConfig, String> {
    let mut object = if text.iter().all(u8::is_ascii_whitespace) {
        Map::new()
    } else {
        match serde_json::from_slice::<Value>(text) {
            Ok(Value::Object(object)) => object,
            Ok(_) => return Err("configuration: must be a JSON object".to_owned()),
            Err(err) => return Err(format!("configuration: not JSON: {err}")),
        }
    };
    let head = match object.remove("request-head") {
        None => RequestHead::Held,
        Some(Value::String(v)) if v == "held" => RequestHead::Held,
        Some(Value::String(v)) if v == "forwarded" => RequestHead::Forwarded,
        Some(other) => {
            return Err(format!(
                "configuration field \"request-head\": {other} is not \"held\" (the default, which \
                 needs allow_on_headers_stop_iteration: true beside the plugin's configuration) \
                 or \"forwarded\""
            ))
        }
    };
    let build = object.remove("build");
    match (BUILD, &build) {
        (None, None) => {}
        (Some(name), Some(Value::String(asked))) if asked == name => {}
        (Some(name), _) => {
            return Err(format!(
                "configuration field \"build\": this plugin is the {name} build, for tests and \
                 benchmarks only; it starts only where the configuration says \"build\": \"{name}\""
            ))
        }
        (None, Some(_)) => {
            return Err(
                "configuration field \"build\": this plugin is the release build, which \
                        takes no \"build\" key"
                    .to_owned(),
            )
        }
    }
    if let Some(n) = object.get("max-body").and_then(Value::as_u64) {
        if n > MAX_BODY_LIMIT {
            return Err(format!(
                "configuration field \"max-body\": {n} bytes is more than one plugin VM can hold; \
                 at most {MAX_BODY_LIMIT} (512 MiB: each body being judged lives in the worker's \
                 VM, which Envoy's V8 does not grow to 1 GiB)"
            ));
        }
    }
    let shared = serde_json::to_vec(&Value::Object(object)).unwrap_or_default();
    let config = FilterConfig::parse(&shared).map_err(|err| match err.key() {
        Some(key) => format!("configuration field \"{key}\": {}", err.message()),
        None => format!("configuration: {}", err.message()),
    })?;
    Ok(PluginConfig { config, head })
}

/// Reads a plugin configuration ([`parse`]). A refused one is logged at `error` with the key at
/// fault, and the plugin does not start (`on_configure` answers false).
pub fn configure(proxy: &mut impl Proxy, text: &[u8]) -> Option<PluginConfig> {
    match parse(text) {
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

/// Seconds of the Unix epoch.
fn seconds(time: SystemTime) -> u64 {
    time.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The root context of one plugin configuration.
#[derive(Debug, Default)]
pub struct Root {
    config: Option<Rc<PluginConfig>>,
    /// The held heads of this VM's streams ([`crate::watch`]).
    watch: Rc<RefCell<HeldHeads>>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let text = self.get_plugin_configuration().unwrap_or_default();
        self.config = configure(&mut Hostcalls, &text).map(Rc::new);
        // Held heads are watched until a body hook proves Envoy calls them (crate::watch).
        if self
            .config
            .as_ref()
            .is_some_and(|c| c.head == RequestHead::Held)
            && !self.watch.borrow().proven()
        {
            self.set_tick_period(Duration::from_secs(TICK_SECS));
        }
        self.config.is_some()
    }

    fn on_tick(&mut self) {
        let now = seconds(self.get_current_time());
        let mut watch = self.watch.borrow_mut();
        watch.tick(now, &mut Hostcalls, |id| {
            // The local reply goes to that stream; a refusal panics inside the crate.
            let _ = proxy_wasm::hostcalls::set_effective_context(id);
        });
        if watch.proven() {
            self.set_tick_period(Duration::ZERO);
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let config = self.config.as_ref()?;
        Some(Box::new(Http {
            stream: Stream::new(&config.config, config.head, Hostcalls),
            id: context_id,
            watch: Rc::clone(&self.watch),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// One HTTP stream's context.
#[derive(Debug)]
pub struct Http {
    stream: Stream<Hostcalls>,
    /// Envoy's id of this context, which the root context's watch knows it by.
    id: u32,
    watch: Rc<RefCell<HeldHeads>>,
}

impl Http {
    /// Whether the watch answered this stream: its hooks let the plugin's own reply through.
    fn answered(&self) -> bool {
        self.watch.borrow().answered(self.id)
    }
}

impl Context for Http {
    fn on_done(&mut self) -> bool {
        self.watch.borrow_mut().done(self.id);
        self.stream.on_done();
        true
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let action = self.stream.on_request_headers(end_of_stream);
        if !end_of_stream && self.stream.holds_request_head() {
            let now = seconds(self.get_current_time());
            self.watch.borrow_mut().held(self.id, now);
        }
        action
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.watch.borrow_mut().body(self.id);
        if self.answered() {
            return Action::Pause;
        }
        self.stream.on_request_body(body_size, end_of_stream)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        self.watch.borrow_mut().body(self.id);
        if self.answered() {
            return Action::Pause;
        }
        self.stream.on_request_trailers()
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if self.answered() {
            return Action::Continue;
        }
        self.stream.on_response_headers(end_of_stream)
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
        if self.answered() {
            return Action::Continue;
        }
        self.stream.on_response_body(body_size, end_of_stream)
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        if self.answered() {
            return Action::Continue;
        }
        self.stream.on_response_trailers()
    }
}
