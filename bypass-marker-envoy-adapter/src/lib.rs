//! The Envoy adapter that the bypass-marker dynamic module (`bypass-marker-envoy-module`) and the
//! proxy-wasm plugin (`bypass-marker-wasm`) share: what one HTTP stream inside Envoy does, in safe
//! Rust, whichever way the filter is loaded.
//!
//! - [`config`]: the filter's JSON configuration (the module's `filter_config`, the plugin's
//!   `configuration`), with errors that name the key.
//! - [`metrics`]: the counters and their names.
//! - [`stream`]: [`stream::StreamFilter`] drives
//!   [`tower_bypass_marker::sans_io::GatewayExchange`] from Envoy's header, body and trailer hooks,
//!   over the few stream operations of [`stream::Host`]. The module implements `Host` on Envoy's
//!   dynamic-module callbacks, the plugin on proxy-wasm's, and [`stream::memory`] in memory, with
//!   Envoy's buffer semantics, for the tests and the fuzz targets.
//! - [`log_limit`]: the rate limit on the lines a client can cause.
//!
//! # Why a crate
//!
//! The adapter is a package of its own, not a module of the dynamic module's package, because the
//! plugin cannot depend on that package: its exported hooks and the Envoy callbacks they call
//! would be linked into the Wasm binary, and reaching around them took a feature that existed only
//! for the plugin and the fuzz targets. Nor is it a module of the published library, whose public
//! surface is the tower middleware's and its sans-IO cores: Envoy's stream model (a head that waits
//! while the body is buffered, a local reply, a reset) is a host's concern. So the cores stay in
//! `tower-bypass-marker`, each host stays a thin layer of calls, and the one thing the two Envoy
//! hosts share sits here, unpublished, between them.

pub mod config;
pub mod log_limit;
pub mod metrics;
pub mod stream;
