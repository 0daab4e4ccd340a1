//! Logs on stderr with `tracing-subscriber`: `RUST_LOG` sets the levels (an `EnvFilter`, `info`
//! when unset), `--log-format` the format (`text`, or `json`: one object per line).
//!
//! The proxy logs one `info` line per request, target `bypass_marker::access`, when its response
//! has been written to the socket (or dropped): `client` (the client's address and port),
//! `request_id` (the request's `x-request-id`, or one the proxy made and sent upstream in that
//! header), `method`, `path` (without the query), `status`,
//! `duration_ms` (from the request head to the response's last byte in the socket), `bytes` (of
//! response body sent), `frames_removed` (annotation frames the layer removed from this
//! response) and `complete` (`false`: the body failed, or the client went away or was cut off
//! before its last byte was written). For example:
//!
//! ```text
//! 2026-12-01T04:12:00.123456Z  INFO bypass_marker::access: request client=10.0.3.7:51234 request_id=9f1c2e4b7a0d3f6e5c8b1a2d4e6f8091 method=POST path=/v1/chat/completions status=200 duration_ms=812.4 bytes=5321 frames_removed=1 complete=true
//! ```
//!
//! ```text
//! {"timestamp":"2026-12-01T04:12:00.123456Z","level":"INFO","message":"request","client":"10.0.3.7:51234","request_id":"9f1c2e4b7a0d3f6e5c8b1a2d4e6f8091","method":"POST","path":"/v1/chat/completions","status":200,"duration_ms":812.4,"bytes":5321,"frames_removed":1,"complete":true,"target":"bypass_marker::access"}
//! ```

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use http::{HeaderValue, Method, StatusCode, Uri};
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
        // A line that cannot be written (stderr closed, or its reader gone) is dropped: the
        // subscriber's own report of it would go to stderr with `eprintln!`, which panics there.
        .log_internal_errors(false)
        .with_ansi(false);
    match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    }
}

/// One request, from its head to the end of its response: logged and measured when dropped.
pub(crate) struct RequestLog {
    started: Instant,
    client: Option<SocketAddr>,
    request_id: HeaderValue,
    first_byte: bool,
    /// The requests in flight on the serving loop that took this one (for the count of the
    /// streams cut when `--shutdown-grace` runs out).
    in_flight: Arc<AtomicU64>,
    method: Method,
    uri: Uri,
    status: StatusCode,
    pub(crate) bytes: u64,
    pub(crate) frames_removed: u64,
    pub(crate) complete: bool,
    metrics: Arc<Metrics>,
}

impl RequestLog {
    /// A request arrived (counted in `streams_active` until this is dropped).
    pub(crate) fn begin(
        metrics: Arc<Metrics>,
        method: Method,
        uri: Uri,
        client: Option<SocketAddr>,
        request_id: HeaderValue,
        in_flight: Arc<AtomicU64>,
    ) -> Self {
        metrics.stream_started();
        in_flight.fetch_add(1, Ordering::Relaxed);
        Self {
            started: Instant::now(),
            client,
            request_id,
            first_byte: false,
            in_flight,
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

    /// The response body yielded bytes: the first time, its time to first byte is measured.
    #[inline]
    pub(crate) fn body_bytes(&mut self, n: usize) {
        if !self.first_byte && n > 0 {
            self.first_byte = true;
            self.metrics.first_byte(self.started.elapsed());
        }
        self.bytes += n as u64;
    }
}

impl Drop for RequestLog {
    fn drop(&mut self) {
        let elapsed = self.started.elapsed();
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.metrics.stream_ended(self.status, elapsed);
        let client = self.client.map(tracing::field::display);
        tracing::info!(
            target: ACCESS_TARGET,
            client,
            request_id = %String::from_utf8_lossy(self.request_id.as_bytes()),
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

/// The header that carries a request's id, read from the client and sent upstream.
pub const REQUEST_ID: &str = "x-request-id";

/// The id of the request with `headers`: its `x-request-id` when it has one that is 1 to 128
/// visible ASCII characters, else a new one (32 hex digits), put in `headers` so that the
/// upstream receives it. Any other `x-request-id` (empty, too long, or with spaces or control
/// characters, which would make the log line ambiguous) is replaced.
pub(crate) fn request_id(headers: &mut http::HeaderMap) -> HeaderValue {
    let given = headers.get(REQUEST_ID).filter(|v| {
        let bytes = v.as_bytes();
        (1..=128).contains(&bytes.len()) && bytes.iter().all(u8::is_ascii_graphic)
    });
    if let Some(id) = given {
        if headers.get_all(REQUEST_ID).iter().count() == 1 {
            return id.clone();
        }
    }
    let id = new_request_id();
    headers.insert(REQUEST_ID, id.clone());
    id
}

/// 128 bits in 32 hex digits: a counter, hashed with two keys this process drew at random (the
/// standard library's `RandomState`), so that ids differ between processes and do not show how
/// many requests came before.
fn new_request_id() -> HeaderValue {
    use std::hash::{BuildHasher as _, RandomState};
    use std::sync::OnceLock;
    static KEYS: OnceLock<(RandomState, RandomState)> = OnceLock::new();
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let (a, b) = KEYS.get_or_init(|| (RandomState::new(), RandomState::new()));
    let n = COUNT.fetch_add(1, Ordering::Relaxed);
    let id = format!("{:016x}{:016x}", a.hash_one(n), b.hash_one(n));
    HeaderValue::from_str(&id).expect("hex digits are a valid header value")
}
