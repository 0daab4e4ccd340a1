//! Logs on stderr with `tracing-subscriber`: `RUST_LOG` sets the levels (an `EnvFilter`, `info`
//! when unset), `--log-format` the format (`text`, or `json`: one object per line).
//!
//! The proxy logs one `info` line per request, target `bypass_marker::access`, when its response
//! has been written to the socket (or dropped): `method`, `path` (without the query), `status`,
//! `duration_ms` (from the request head to the response's last byte in the socket), `bytes` (of
//! response body sent), `frames_removed` (annotation frames the layer removed from this
//! response) and `complete` (`false`: the body failed, or the client went away or was cut off
//! before its last byte was written). For example:
//!
//! ```text
//! 2026-12-01T04:12:00.123456Z  INFO bypass_marker::access: request method=POST path=/v1/chat/completions status=200 duration_ms=812.4 bytes=5321 frames_removed=1 complete=true
//! ```
//!
//! ```text
//! {"timestamp":"2026-12-01T04:12:00.123456Z","level":"INFO","message":"request","method":"POST","path":"/v1/chat/completions","status":200,"duration_ms":812.4,"bytes":5321,"frames_removed":1,"complete":true,"target":"bypass_marker::access"}
//! ```

use std::sync::Arc;
use std::time::Instant;

use http::{Method, StatusCode, Uri};
use tracing_subscriber::EnvFilter;

use crate::args::LogFormat;
use crate::metrics::Metrics;

/// The target of the per-request lines.
pub const ACCESS_TARGET: &str = "bypass_marker::access";

/// Installs the global subscriber: `format` on stderr, levels from `RUST_LOG` (default `info`).
/// Fails when a global subscriber is already set, or `RUST_LOG` does not parse.
pub fn init(format: LogFormat) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let filter = match std::env::var_os(EnvFilter::DEFAULT_ENV) {
        Some(_) => EnvFilter::try_from_default_env()?,
        None => EnvFilter::new("info"),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false);
    match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    }
}

/// One request, from its head to the end of its response: logged and measured when dropped.
pub(crate) struct Exchange {
    started: Instant,
    method: Method,
    uri: Uri,
    status: StatusCode,
    pub(crate) bytes: u64,
    pub(crate) frames_removed: u64,
    pub(crate) complete: bool,
    metrics: Arc<Metrics>,
}

impl Exchange {
    /// A request arrived (counted in `streams_active` until this is dropped).
    pub(crate) fn begin(metrics: Arc<Metrics>, method: Method, uri: Uri) -> Self {
        metrics.stream_started();
        Self {
            started: Instant::now(),
            method,
            uri,
            status: StatusCode::OK,
            bytes: 0,
            frames_removed: 0,
            complete: false,
            metrics,
        }
    }

    /// The response head has been given, with `status`.
    pub(crate) fn status(&mut self, status: StatusCode) {
        self.status = status;
    }

    pub(crate) fn metrics(&self) -> &Metrics {
        &self.metrics
    }
}

impl Drop for Exchange {
    fn drop(&mut self) {
        let elapsed = self.started.elapsed();
        self.metrics.stream_ended(elapsed);
        tracing::info!(
            target: ACCESS_TARGET,
            method = %self.method,
            path = %self.uri.path(),
            status = self.status.as_u16(),
            // Whole microseconds: `812.4`, `0.56`, not `0.5594600000000001`.
            duration_ms = elapsed.as_micros() as f64 / 1e3,
            bytes = self.bytes,
            frames_removed = self.frames_removed,
            complete = self.complete,
            "request"
        );
    }
}
