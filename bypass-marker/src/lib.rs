//! `bypass-marker`: the sidecar proxy and the Envoy external processor of
//! [`tower-bypass-marker`](https://docs.rs/tower-bypass-marker), as a binary and as the library its
//! tests (and a tonic server of your own) use.
//!
//! ```text
//! cargo install bypass-marker                # or: cargo install --path bypass-marker, from a clone
//! bypass-marker proxy --upstream http://127.0.0.1:8000 --listen 127.0.0.1:3000
//! bypass-marker ext-proc --listen 127.0.0.1:50051
//! ```
//!
//! The binary (`src/main.rs`) only parses, binds, waits for signals and picks the exit code;
//! everything it serves is here, so the tests run the same code in process.
//!
//! - [`envoy`]: the Envoy external processor ([`envoy::ExtProc`]), a tonic service over the
//!   library's two sans-IO cores, for a tonic server of your own.
//! - [`args`]: the subcommands and flags (clap), each flag also from `BYPASS_MARKER_<FLAG>`;
//!   [`NamingArgs`] are the naming flags every filtering subcommand shares.
//! - [`proxy`]: the streaming reverse proxy ([`serve`]).
//! - [`ext_proc`]: the processor as the binary runs it, with metrics.
//! - [`metrics`]: Prometheus metrics at `GET /metrics` on `--metrics-listen`, and the liveness
//!   and readiness probes (`/livez`, `/readyz`) there and on the proxy's own address.
//! - [`logs`]: one line per request (with the client's address and the request id), text or
//!   JSON, `RUST_LOG` respected.
//!
//! This package's version is its own: a new flag, metric or clap, tonic or envoy-types release is
//! a change of `bypass-marker`, never of `tower-bypass-marker`, whose API names none of them.

#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod args;
pub mod budget;
mod client;
mod conn;
#[doc(hidden)]
pub mod differential;
pub mod envoy;
pub mod ext_proc;
mod forward;
pub mod logs;
pub mod metrics;
pub mod proxy;

pub use args::{
    Cli, Command, ExtProcArgs, LogFormat, NameError, NamingArgs, Preset, ProxyArgs, Upstream,
};
pub use client::UpstreamResponseBody;
pub use conn::StallTimeout;
pub use forward::{Forward, UpstreamBody};
pub use metrics::Metrics;
pub use proxy::{
    bind, bind_each, default_max_connections, serve, serve_metered, serve_threads, serve_with,
    RequestBody,
};
