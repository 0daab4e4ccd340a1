//! `tower-bypass-marker` as an Envoy dynamic module: the JSON request guard and the event-stream
//! filter inside Envoy, in-process, at the cost of a function call per chunk.
//!
//! Built with `cargo build --release -p bypass-marker-envoy-module` into
//! `target/release/libbypass_marker_envoy_module.so`, which Envoy (1.38 to 1.40) loads from
//! `ENVOY_DYNAMIC_MODULES_SEARCH_PATH`:
//!
//! ```yaml
//! - name: envoy.filters.http.dynamic_modules
//!   typed_config:
//!     "@type": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter
//!     dynamic_module_config: {name: bypass_marker_envoy_module}
//!     filter_name: bypass_marker
//!     filter_config:
//!       "@type": type.googleapis.com/google.protobuf.StringValue
//!       value: '{"preset": "dynamo"}'
//! ```
//!
//! `filter_config` is JSON with the keys of `bypass-marker ext-proc`'s naming flags (`preset`,
//! `opt-in`, `router-owned`, `never-forward`, `sdk-safe`, `max-body`); empty or `{}` is the Dynamo
//! preset. A configuration with an unknown key, a wrong type or an invalid name is refused when
//! Envoy loads it, with a log line that names the key.
//!
//! This package is the ABI alone, layered as the -sys crates are: `abi/` holds every `unsafe`
//! block, split into the raw declarations (`abi/sys.rs`), the exported hooks with their safety
//! argument, re-entry included (`abi/hooks.rs`), and the adapter's `Host` on Envoy's callbacks
//! (`abi/host.rs`). What a stream does is the safe Rust of `bypass-marker-envoy-adapter`, which
//! the proxy-wasm plugin drives too: its configuration parser, its counters and its
//! `StreamFilter` over [`tower_bypass_marker::sans_io::GatewayExchange`], the state machine
//! `bypass-marker ext-proc` drives, so the module, the plugin and the processor answer the same
//! input with the same bytes. Counters go to Envoy's stats.
//!
//! [`tower_bypass_marker::sans_io::GatewayExchange`]: https://docs.rs/tower-bypass-marker/latest/tower_bypass_marker/sans_io/struct.GatewayExchange.html

mod abi;
