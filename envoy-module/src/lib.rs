//! `tower-bypass-marker` as an Envoy dynamic module: the JSON request guard and the event-stream
//! filter inside Envoy, in-process, at the cost of a function call per chunk.
//!
//! Built with `cargo build --release -p bypass-marker-envoy-module` into
//! `target/release/libbypass_marker.so`, which Envoy (1.38 to 1.40) loads from
//! `ENVOY_DYNAMIC_MODULES_SEARCH_PATH`:
//!
//! ```yaml
//! - name: envoy.filters.http.dynamic_modules
//!   typed_config:
//!     "@type": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter
//!     dynamic_module_config: {name: bypass_marker}
//!     filter_name: bypass_marker
//!     filter_config:
//!       "@type": type.googleapis.com/google.protobuf.StringValue
//!       value: '{"preset": "dynamo"}'
//! ```
//!
//! `filter_config` is JSON with the keys of `bypass-marker ext-proc`'s naming flags (`preset`,
//! `opt-in`, `router-owned`, `never-forward`, `sdk-safe`, `max-body`); empty or `{}` is the Dynamo
//! preset. A configuration with an unknown key, a wrong type or an invalid name is refused when
//! Envoy loads it, with a log line that names the key ([`config`]).
//!
//! Each stream drives [`tower_bypass_marker::sans_io::GatewayExchange`], the state machine
//! `bypass-marker ext-proc` drives too, so the module and the processor answer the same input with
//! the same bytes ([`stream`]). The package is layered as the -sys crates are: `abi/` holds every
//! `unsafe` block, split into the raw declarations alone (`abi/sys.rs`), the exported hooks with
//! their safety argument, re-entry included (`abi/hooks.rs`), and [`stream::Host`] on Envoy's
//! callbacks (`abi/host.rs`); [`stream::StreamFilter`] above it is safe Rust over the few stream
//! operations of [`stream::Host`], tested with a fake of them. Counters go to Envoy's stats
//! ([`metrics`]).

#![warn(missing_docs, unreachable_pub)]

#[cfg(feature = "abi")]
mod abi;
pub mod config;
pub mod log_limit;
pub mod metrics;
pub mod stream;
