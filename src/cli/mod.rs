//! The `bypass-marker` binary's library half (feature `cli`): its command line, the sidecar proxy,
//! its metrics and its logs. The binary (`src/bin/bypass-marker/main.rs`) only parses, binds,
//! waits for signals and picks the exit code; everything it serves is here, so the tests run the
//! same code in process.
//!
//! ```text
//! cargo install tower-bypass-marker --features cli      # or: --path . from a clone
//! bypass-marker proxy --upstream http://127.0.0.1:8000 --listen 127.0.0.1:3000
//! ```
//!
//! - [`args`]: the subcommands and flags (clap), each flag also from `BYPASS_MARKER_<FLAG>`;
//!   [`NamingArgs`] are the naming flags every filtering subcommand shares.
//! - [`proxy`]: the streaming reverse proxy ([`serve`]).
//! - [`ext_proc`]: the Envoy external processor ([`crate::envoy::ExtProc`]) with metrics.
//! - [`metrics`]: Prometheus metrics at `GET /metrics` on `--metrics-listen`.
//! - [`logs`]: one line per request, text or JSON, `RUST_LOG` respected.

pub mod args;
mod client;
mod conn;
#[doc(hidden)]
pub mod differential;
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
