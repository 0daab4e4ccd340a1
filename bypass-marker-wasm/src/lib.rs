//! `tower-bypass-marker` as a proxy-wasm plugin: the JSON request guard and the event-stream
//! filter inside any Envoy with a Wasm runtime (Istio's `WasmPlugin`, Envoy Gateway's
//! `EnvoyExtensionPolicy.spec.wasm`, a bootstrap of your own), in Envoy's V8.
//!
//! Built with `bash bypass-marker-wasm/build.sh` into `target/wasm32-wasip1/release/bypass_marker.wasm`:
//!
//! ```yaml
//! - name: envoy.filters.http.wasm
//!   typed_config:
//!     "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
//!     config:
//!       name: bypass_marker
//!       failure_policy: FAIL_RELOAD      # a trapped plugin fails its streams, then reloads
//!       allow_on_headers_stop_iteration: true  # the request head waits for the guard
//!       configuration:
//!         "@type": type.googleapis.com/google.protobuf.StringValue
//!         value: '{"preset": "dynamo"}'
//!       vm_config:
//!         runtime: envoy.wasm.runtime.v8
//!         code: {local: {filename: bypass_marker.wasm}}
//! ```
//!
//! The `configuration` is the dynamic module's `filter_config`, read by the same parser
//! ([`bypass_marker_envoy_adapter::config`]), with the plugin's own keys `request-head` and `build`
//! ([`plugin::parse`]); a bad one stops the plugin from starting, with a log line that names the
//! key. The request head waits until the guard has judged the body, which needs Envoy's
//! `allow_on_headers_stop_iteration` (Envoy 1.35 and later); where a gateway cannot set it, the
//! configuration says `"request-head": "forwarded"` (docs/envoy.md, "Holding the request head").
//! Each stream drives the Envoy adapter the module drives too
//! ([`bypass_marker_envoy_adapter::stream::StreamFilter`], over
//! `tower_bypass_marker::sans_io::GatewayExchange`), so the plugin, the module and
//! `bypass-marker ext-proc` answer the same input with the same bytes. The layers:
//! [`proxy::Proxy`] names the few proxy-wasm calls made ([`proxy::Hostcalls`] makes them on
//! Envoy); [`host`] implements the adapter's `Host` with them; [`stream::Stream`] maps proxy-wasm's
//! hooks onto the adapter; [`plugin`] holds the proxy-wasm contexts; [`watch`] answers a held
//! head whose body Envoy withholds (no `allow_on_headers_stop_iteration`) within 10 s. Everything but the entry
//! point is safe Rust, and everything but [`plugin`] runs on a fake of [`proxy::Proxy`] in the
//! tests ([`fake`]).
//!
//! A panic cannot be caught on `wasm32-wasip1` (panics abort): it traps the plugin's VM, and Envoy
//! fails every stream of that VM (a 503 before the response, a reset after its head), never
//! passing one on unfiltered, unless the configuration sets `fail_open` or `FAIL_OPEN`.

pub mod fake;
pub mod host;
pub mod metrics;
pub mod plugin;
pub mod proxy;
pub mod stream;
#[cfg(test)]
mod tests;
pub mod watch;
#[cfg(test)]
mod watch_tests;

// The reactor's entry point: proxy-wasm's `main!` exports `_initialize`, which runs the static
// constructors and registers the root context.
#[cfg(target_arch = "wasm32")]
#[allow(unsafe_code)]
mod entry {
    use proxy_wasm::traits::RootContext;
    use proxy_wasm::types::LogLevel;

    // SAFETY: `_initialize` is exported once, as the WASI reactor ABI expects, and Envoy calls it
    // once before any other export; `__wasm_call_ctors` runs there and nowhere else.
    proxy_wasm::main! {{
        proxy_wasm::set_log_level(LogLevel::Info);
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
            Box::new(crate::plugin::Root::default())
        });
    }}
}
