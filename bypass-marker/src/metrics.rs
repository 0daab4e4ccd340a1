//! The proxy's Prometheus metrics, served at `GET /metrics` on `--metrics-listen` (OpenMetrics
//! text, with the `prometheus-client` crate), beside the probes `/livez` and `/readyz` (see
//! [`probe`]). That address answers until the process exits: through the drain after SIGTERM,
//! `/readyz` says 503 and `/livez` 200.
//!
//! | metric | labels | what |
//! |---|---|---|
//! | `bypass_marker_frames_removed_total` | `annotation` | annotation frames removed, per configured name; `annotation=""`: frames `--sdk-safe` removed that carried no configured name |
//! | `bypass_marker_frames_forwarded_total` | `annotation` | annotation frames forwarded to a client that opted in |
//! | `bypass_marker_requests_refused_total` | `status` | requests the proxy answered itself without forwarding: the guard's refusals (400, 413, 415), a stalled request body (408), an unsupported transfer coding (501), a request body past `--max-buffered-bytes` (503) |
//! | `bypass_marker_upstream_errors_total` | `kind` | `connect`: the upstream is unreachable (502); `timeout`: no response head within `--response-timeout` of the request's end, or the upstream took no byte of the request for as long (504); `head`: the upstream failed before its response head (502); `body`: its response body failed mid-stream |
//! | `bypass_marker_encoded_streams_refused_total` | `coding` | event streams in a content coding other than `identity` (which cannot be filtered) answered with a 502 `encoded_event_stream` instead, because something would have been removed for their client, per coding: the first coding other than `identity` (a content coding, else a transfer coding), one of `gzip`, `deflate`, `br`, `zstd`, `compress`, or `other`, as the Envoy module's and plugin's `coding` label (every one there at 0 from the start); each is also logged at `warn` (the proxy and the processor) |
//! | `bypass_marker_write_timeouts_total` | | client connections reset because a write to them made no progress for `--write-timeout` (their upstream requests cancelled) |
//! | `bypass_marker_upstream_idle_timeouts_total` | | upstream response bodies cut because no byte came for `--upstream-idle-timeout` (also counted as `upstream_errors_total{kind="body"}`) |
//! | `bypass_marker_read_coalesce_waits_total` | | times a serving thread waited `--read-coalesce` before sleeping on its sockets, because an upstream had written faster than it was read |
//! | `bypass_marker_request_body_errors_total` | | request bodies that failed on the client's side while being forwarded (malformed, or the client left): a 400, not an upstream error |
//! | `bypass_marker_request_bytes_held` | | bytes of request bodies the guard holds now, over every request (see `--max-buffered-bytes`) |
//! | `bypass_marker_request_bytes_budget` | | `--max-buffered-bytes` (or its default) |
//! | `bypass_marker_streams_active` | | requests in flight: from the request head until the response's last byte has been written to the socket, or dropped |
//! | `bypass_marker_request_duration_seconds` | | histogram of the same span, per request |
//! | `bypass_marker_requests_total` | `class` | requests answered, by the class of their status (`1xx` to `5xx`; the proxy's own answers included), counted when the response has ended |
//! | `bypass_marker_time_to_first_byte_seconds` | | histogram of the time from the request head to the first byte of the response body handed to the connection (requests whose response has a body) |
//! | `bypass_marker_connections_open` | | client connections open now |
//! | `bypass_marker_shutdown_streams_cut_total` | | requests still in flight when `--shutdown-grace` ran out, and so cut (the process then exits with code 3) |
//! | `bypass_marker_build_info` | `version`, `revision` | always 1: the version of the package and the commit it was built from (`BYPASS_MARKER_REVISION` at build time, else `unknown`); the proxy and the processor |
//! | `bypass_marker_ext_proc_answer_seconds` | `message` | `bypass-marker ext-proc` only: histogram of the time the processor took to answer each message Envoy sent, from the moment the message's last bytes reached its stream to the moment the answer was handed back to HTTP/2 (see [`ExtProc::answer_times`](crate::envoy::ExtProc::answer_times)); `message` is the message's kind: `request_headers`, `request_body`, `request_trailers`, `response_headers`, `response_body`, `response_trailers`. Buckets at 0.2 s (Envoy's default `message_timeout`) and 2 s (the shipped bootstrap's) |
//!
//! Every series also carries the label `front_door`: `sidecar` from `bypass-marker proxy`
//! ([`Metrics::new`]), `ext-proc` from `bypass-marker ext-proc` ([`Metrics::frames_only`]). The two
//! serve the same names, so a query that sums over both (one dashboard for every front door,
//! `dist/grafana/bypass-marker.json`) tells them apart by it, not by the scrape job; Envoy's
//! dynamic module and proxy-wasm plugin have names of their own (docs/envoy.md, "Metrics and
//! logs").
//!
//! The frame counts come from the layer itself ([`FrameObserver`], called as each frame is
//! removed or forwarded), not from parsing the stream again; a series exists for every configured
//! name from the start, at 0.

use std::cell::Cell;
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

use crate::budget::BodyBudget;
use crate::envoy::{AnswerTimes, MessageKind};
use tower_bypass_marker::FrameObserver;

/// The content type of the `/metrics` answer.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AnnotationLabel {
    annotation: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabel {
    status: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodingLabel {
    coding: String,
}

/// The values of `bypass_marker_encoded_streams_refused_total`'s `coding` label, as the Envoy
/// module's and plugin's (`bypass-marker-envoy-adapter`, `metrics::encoded_refused`): a known
/// coding, else `other`, so that an upstream cannot grow the series.
pub const CODINGS: [&str; 6] = ["gzip", "deflate", "br", "zstd", "compress", "other"];

/// The `coding` label of an encoded event stream the layer refused, from the codings its
/// observer reports (`gzip, br`; `transfer-encoding gzip, chunked` for a transfer coding): the
/// first of them, if it is one of [`CODINGS`], else `other`.
pub fn coding_label(codings: &str) -> &'static str {
    let codings = codings
        .strip_prefix("transfer-encoding ")
        .unwrap_or(codings);
    let first = codings
        .split(',')
        .map(str::trim)
        .find(|c| {
            !c.is_empty()
                && !c.eq_ignore_ascii_case("identity")
                && !c.eq_ignore_ascii_case("chunked")
        })
        .unwrap_or_default();
    CODINGS[..5]
        .iter()
        .find(|known| first.eq_ignore_ascii_case(known))
        .copied()
        .unwrap_or("other")
}

/// The name of the `front_door` label every series carries.
pub const FRONT_DOOR: &str = "front_door";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClassLabel {
    class: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabel {
    version: String,
    revision: String,
}

/// The commit this binary was built from: `BYPASS_MARKER_REVISION` in the environment of the
/// build (`dist/release.sh` and the `Containerfile`'s by-hand recipe set it to `git rev-parse
/// HEAD`), else `unknown`. The `revision` label of `bypass_marker_build_info`.
pub const REVISION: &str = match option_env!("BYPASS_MARKER_REVISION") {
    Some(revision) if !revision.is_empty() => revision,
    _ => "unknown",
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MessageLabel {
    message: String,
}

/// The buckets of `bypass_marker_ext_proc_answer_seconds`, in seconds: from 100 us, with one at
/// Envoy's default `message_timeout` (0.2 s) and one at the shipped bootstrap's (2 s).
const ANSWER_BUCKETS: [f64; 15] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: String,
}

/// How the upstream failed, the `kind` label of `bypass_marker_upstream_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum UpstreamError {
    /// Connecting failed (or timed out): a 502.
    Connect,
    /// No response head within `--response-timeout` of the request's end, or a write of the
    /// request that made no progress for as long: a 504.
    Timeout,
    /// The upstream failed after the request was sent and before its response head: a 502.
    BeforeHead,
    /// The upstream's response body failed mid-stream.
    Body,
}

impl UpstreamError {
    const ALL: [UpstreamError; 4] = [Self::Connect, Self::Timeout, Self::BeforeHead, Self::Body];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Connect => "connect",
            Self::Timeout => "timeout",
            Self::BeforeHead => "head",
            Self::Body => "body",
        }
    }
}

/// The statuses of refusals made before any request arrives, so that they are listed at 0.
const REFUSALS: [StatusCode; 6] = [
    StatusCode::BAD_REQUEST,
    StatusCode::REQUEST_TIMEOUT,
    StatusCode::PAYLOAD_TOO_LARGE,
    StatusCode::UNSUPPORTED_MEDIA_TYPE,
    StatusCode::NOT_IMPLEMENTED,
    StatusCode::SERVICE_UNAVAILABLE,
];

thread_local! {
    /// Frames removed by observers on this thread, ever: the proxy reads it before and after it
    /// polls a response body to count the frames removed for that response.
    static REMOVED_HERE: Cell<u64> = const { Cell::new(0) };
}

/// The frames removed on this thread so far (see [`Metrics`]'s [`FrameObserver`]): the
/// difference across one `poll_frame` of a response body is what that call removed.
pub(crate) fn removed_on_this_thread() -> u64 {
    REMOVED_HERE.with(Cell::get)
}

/// The proxy's metrics: a Prometheus registry and handles to its series.
///
/// Also the layer's [`FrameObserver`]: `layer.observe(metrics.clone())`.
pub struct Metrics {
    registry: Registry,
    /// Per configured name, in the layer's order: (name, removed, forwarded).
    names: Vec<(Box<str>, Counter, Counter)>,
    removed_family: Family<AnnotationLabel, Counter>,
    forwarded_family: Family<AnnotationLabel, Counter>,
    /// `annotation=""`: removed by SDK-safe mode, no configured name (listed in SDK-safe mode).
    removed_unnamed: Option<Counter>,
    /// Per coding, in [`CODINGS`]' order.
    encoded_refused: [Counter; 6],
    refused: Family<StatusLabel, Counter>,
    upstream_errors: [Counter; 4],
    write_timeouts: Counter,
    upstream_idle_timeouts: Counter,
    read_coalesce_waits: Counter,
    request_body_errors: Counter,
    streams_active: Gauge<i64, AtomicI64>,
    duration: Histogram,
    /// `requests_total`, per status class: 1xx to 5xx.
    requests: [Counter; 5],
    first_byte: Histogram,
    connections_open: Gauge<i64, AtomicI64>,
    streams_cut: Counter,
    /// Set at Ctrl-C or SIGTERM: `/readyz` answers 503 from then on.
    draining: AtomicBool,
    /// The request body budget, read at each scrape (`watch_budget`).
    budget: std::sync::OnceLock<BodyBudget>,
    bytes_held: Gauge<i64, AtomicI64>,
    bytes_budget: Gauge<i64, AtomicI64>,
    /// Per [`MessageKind`], in [`MessageKind::ALL`]'s order: the processor's answer times.
    answer_seconds: Vec<Histogram>,
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Metrics")
            .field("registry", &self.registry)
            .finish_non_exhaustive()
    }
}

impl Metrics {
    /// Metrics with a series at 0 for each of `names` (the layer's,
    /// [`BypassMarkerLayer::names`](tower_bypass_marker::BypassMarkerLayer::names)), and for `annotation=""`
    /// when `sdk_safe`.
    pub fn new<'a>(names: impl IntoIterator<Item = &'a str>, sdk_safe: bool) -> Self {
        Self::build(names, sdk_safe, true)
    }

    /// Metrics for `bypass-marker ext-proc`: the frame series (as [`Metrics::new`] makes them)
    /// the request body budget's (`request_bytes_held`, `request_bytes_budget`, once
    /// [`watch_budget`](Self::watch_budget) is called) and the processor's answer times
    /// (`bypass_marker_ext_proc_answer_seconds`, once the processor is given these metrics as its
    /// [`AnswerTimes`]). Envoy answers and times the requests itself, so the proxy's request,
    /// upstream and stream series would only ever read 0 there, and are left out.
    pub fn frames_only<'a>(names: impl IntoIterator<Item = &'a str>, sdk_safe: bool) -> Self {
        Self::build(names, sdk_safe, false)
    }

    fn build<'a>(names: impl IntoIterator<Item = &'a str>, sdk_safe: bool, proxy: bool) -> Self {
        let door = if proxy { "sidecar" } else { "ext-proc" };
        let mut registry = Registry::with_prefix_and_labels(
            "bypass_marker",
            [(FRONT_DOOR.into(), door.into())].into_iter(),
        );
        let build_info = Family::<BuildLabel, Gauge>::default();
        registry.register(
            "build_info",
            "The version of bypass-marker and the commit it was built from (always 1)",
            build_info.clone(),
        );
        build_info
            .get_or_create(&BuildLabel {
                version: env!("CARGO_PKG_VERSION").to_owned(),
                revision: REVISION.to_owned(),
            })
            .set(1);
        let removed_family = Family::<AnnotationLabel, Counter>::default();
        let forwarded_family = Family::<AnnotationLabel, Counter>::default();
        registry.register(
            "frames_removed",
            "Annotation frames removed from event streams, per configured name (\"\": removed by SDK-safe mode, no configured name)",
            removed_family.clone(),
        );
        registry.register(
            "frames_forwarded",
            "Annotation frames forwarded to a client that opted in, per configured name",
            forwarded_family.clone(),
        );
        let series = |family: &Family<AnnotationLabel, Counter>, name: &str| {
            family
                .get_or_create(&AnnotationLabel {
                    annotation: name.to_owned(),
                })
                .clone()
        };
        let names = names
            .into_iter()
            .map(|name| {
                (
                    Box::from(name),
                    series(&removed_family, name),
                    series(&forwarded_family, name),
                )
            })
            .collect();
        // Only a layer in SDK-safe mode removes frames of no name.
        let removed_unnamed = sdk_safe.then(|| series(&removed_family, ""));
        let encoded_family = Family::<CodingLabel, Counter>::default();
        registry.register(
            "encoded_streams_refused",
            "Event streams in a content coding other than identity answered with a 502 instead, because something would have been removed from them, per coding",
            encoded_family.clone(),
        );
        let encoded_refused = CODINGS.map(|coding| {
            encoded_family
                .get_or_create(&CodingLabel {
                    coding: coding.to_owned(),
                })
                .clone()
        });
        // The proxy's own series: registered only for the proxy.
        let mut proxy_registry = Registry::default();
        let proxy_series = if proxy {
            &mut registry
        } else {
            &mut proxy_registry
        };
        let refused = Family::<StatusLabel, Counter>::default();
        proxy_series.register(
            "requests_refused",
            "Requests the proxy answered itself without forwarding them, per status",
            refused.clone(),
        );
        for status in REFUSALS {
            drop(refused.get_or_create(&StatusLabel {
                status: status.as_str().to_owned(),
            }));
        }
        let errors = Family::<KindLabel, Counter>::default();
        proxy_series.register(
            "upstream_errors",
            "Failures of the upstream, per kind",
            errors.clone(),
        );
        let upstream_errors = UpstreamError::ALL.map(|kind| {
            errors
                .get_or_create(&KindLabel {
                    kind: kind.as_str().to_owned(),
                })
                .clone()
        });
        let write_timeouts = Counter::default();
        proxy_series.register(
            "write_timeouts",
            "Client connections closed because a write to them made no progress for --write-timeout",
            write_timeouts.clone(),
        );
        let upstream_idle_timeouts = Counter::default();
        proxy_series.register(
            "upstream_idle_timeouts",
            "Upstream response bodies cut because no byte came for --upstream-idle-timeout",
            upstream_idle_timeouts.clone(),
        );
        let read_coalesce_waits = Counter::default();
        proxy_series.register(
            "read_coalesce_waits",
            "Times a serving thread waited --read-coalesce before sleeping, an upstream having written faster than it was read",
            read_coalesce_waits.clone(),
        );
        let request_body_errors = Counter::default();
        proxy_series.register(
            "request_body_errors",
            "Request bodies that failed on the client's side while being forwarded",
            request_body_errors.clone(),
        );
        let streams_active = Gauge::<i64, AtomicI64>::default();
        proxy_series.register(
            "streams_active",
            "Requests in flight, until their response body has been sent or dropped",
            streams_active.clone(),
        );
        // 5 ms to about 11 minutes (beyond the default --response-timeout of 600 s).
        let duration = Histogram::new(exponential_buckets(0.005, 2.0, 18));
        proxy_series.register(
            "request_duration_seconds",
            "Time from the request head to the end of the response body",
            duration.clone(),
        );
        let classes = Family::<ClassLabel, Counter>::default();
        proxy_series.register(
            "requests",
            "Requests answered, by the class of their status, counted when the response has ended",
            classes.clone(),
        );
        let requests = ["1xx", "2xx", "3xx", "4xx", "5xx"].map(|class| {
            classes
                .get_or_create(&ClassLabel {
                    class: class.to_owned(),
                })
                .clone()
        });
        // 1 ms to about 2 minutes.
        let first_byte = Histogram::new(exponential_buckets(0.001, 2.0, 18));
        proxy_series.register(
            "time_to_first_byte_seconds",
            "Time from the request head to the first byte of the response body",
            first_byte.clone(),
        );
        let connections_open = Gauge::<i64, AtomicI64>::default();
        proxy_series.register(
            "connections_open",
            "Client connections open now",
            connections_open.clone(),
        );
        let streams_cut = Counter::default();
        proxy_series.register(
            "shutdown_streams_cut",
            "Requests still in flight when --shutdown-grace ran out, and so cut",
            streams_cut.clone(),
        );
        // The budget's series: both the proxy and the processor hold request bodies under it.
        let bytes_held = Gauge::<i64, AtomicI64>::default();
        registry.register(
            "request_bytes_held",
            "Bytes of request bodies the guard holds now, summed over every request",
            bytes_held.clone(),
        );
        let bytes_budget = Gauge::<i64, AtomicI64>::default();
        registry.register(
            "request_bytes_budget",
            "The most bytes of request bodies held at once (--max-buffered-bytes)",
            bytes_budget.clone(),
        );
        // The processor's own series: registered only for it.
        let mut unused = Registry::default();
        let ext_proc_series = if proxy { &mut unused } else { &mut registry };
        let answers =
            Family::<MessageLabel, Histogram, fn() -> Histogram>::new_with_constructor(|| {
                Histogram::new(ANSWER_BUCKETS)
            });
        ext_proc_series.register(
            "ext_proc_answer_seconds",
            "Time the processor took to answer a message of Envoy's, from its last bytes reaching the stream to the answer handed to HTTP/2, per kind of message",
            answers.clone(),
        );
        let answer_seconds = MessageKind::ALL
            .iter()
            .map(|kind| {
                answers
                    .get_or_create(&MessageLabel {
                        message: kind.as_str().to_owned(),
                    })
                    .clone()
            })
            .collect();
        Self {
            answer_seconds,
            budget: std::sync::OnceLock::new(),
            bytes_held,
            bytes_budget,
            registry,
            names,
            removed_family,
            forwarded_family,
            removed_unnamed,
            encoded_refused,
            refused,
            upstream_errors,
            write_timeouts,
            upstream_idle_timeouts,
            read_coalesce_waits,
            request_body_errors,
            streams_active,
            duration,
            requests,
            first_byte,
            connections_open,
            streams_cut,
            draining: AtomicBool::new(false),
        }
    }

    /// The process is stopping (Ctrl-C or SIGTERM): `/readyz` answers 503 from now on, while
    /// `/livez` and `/metrics` go on answering until the process exits.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// Whether [`drain`](Self::drain) has been called.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// `n` requests were still in flight when `--shutdown-grace` ran out.
    pub(crate) fn streams_cut(&self, n: u64) {
        self.streams_cut.inc_by(n);
    }

    /// Requests cut so far because `--shutdown-grace` ran out: the binary exits with code 3 when
    /// this is not 0.
    pub fn shutdown_streams_cut(&self) -> u64 {
        self.streams_cut.get()
    }

    /// A client connection was accepted.
    pub(crate) fn connection_opened(&self) {
        self.connections_open.inc();
    }

    /// A client connection ended.
    pub(crate) fn connection_closed(&self) {
        self.connections_open.dec();
    }

    /// The first byte of a response body, `elapsed` after its request's head.
    pub(crate) fn first_byte(&self, elapsed: Duration) {
        self.first_byte.observe(elapsed.as_secs_f64());
    }

    /// Serves `budget`'s bytes held as `bypass_marker_request_bytes_held` and its limit as
    /// `bypass_marker_request_bytes_budget` (the first budget given; later ones are ignored).
    pub fn watch_budget(&self, budget: &BodyBudget) {
        if self.budget.set(budget.clone()).is_ok() {
            self.bytes_budget
                .set(i64::try_from(budget.limit()).unwrap_or(i64::MAX));
        }
    }

    /// The metrics in the OpenMetrics text format ([`CONTENT_TYPE`]).
    pub fn encode(&self) -> String {
        if let Some(budget) = self.budget.get() {
            self.bytes_held
                .set(i64::try_from(budget.held()).unwrap_or(i64::MAX));
        }
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)
            .expect("writing to a String does not fail");
        text
    }

    fn by_name(&self, annotation: &str) -> Option<&(Box<str>, Counter, Counter)> {
        self.names.iter().find(|(name, ..)| &**name == annotation)
    }

    /// A removal by a name that has no series yet (not one of the names given to `new`).
    #[cold]
    fn removed_slow(&self, name: &str) {
        self.removed_family
            .get_or_create(&AnnotationLabel {
                annotation: name.to_owned(),
            })
            .inc();
    }

    /// The proxy answered a request itself with `status`.
    pub(crate) fn refused(&self, status: StatusCode) {
        self.refused
            .get_or_create(&StatusLabel {
                status: status.as_str().to_owned(),
            })
            .inc();
    }

    /// The upstream failed.
    pub(crate) fn upstream_error(&self, kind: UpstreamError) {
        self.upstream_errors[kind as usize].inc();
    }

    /// A client connection was closed for its write timeout.
    pub(crate) fn write_timeout(&self) {
        self.write_timeouts.inc();
    }

    /// An upstream response body was cut for `--upstream-idle-timeout`.
    pub(crate) fn upstream_idle_timeout(&self) {
        self.upstream_idle_timeouts.inc();
    }

    /// A serving thread waited `--read-coalesce` before sleeping.
    pub(crate) fn read_coalesce_wait(&self) {
        self.read_coalesce_waits.inc();
    }

    /// A request body failed on the client's side while being forwarded.
    pub(crate) fn request_body_error(&self) {
        self.request_body_errors.inc();
    }

    /// A request arrived.
    pub(crate) fn stream_started(&self) {
        self.streams_active.inc();
    }

    /// A request's response, with `status`, has been sent or dropped, `elapsed` after its head
    /// arrived.
    pub(crate) fn stream_ended(&self, status: StatusCode, elapsed: Duration) {
        self.streams_active.dec();
        self.duration.observe(elapsed.as_secs_f64());
        if let Some(class) = self
            .requests
            .get(usize::from(status.as_u16() / 100).wrapping_sub(1))
        {
            class.inc();
        }
    }
}

impl AnswerTimes for Metrics {
    fn answered(&self, message: MessageKind, elapsed: Duration) {
        if let Some(histogram) = self.answer_seconds.get(message as usize) {
            histogram.observe(elapsed.as_secs_f64());
        }
    }
}

impl FrameObserver for Metrics {
    fn frame_removed(&self, annotation: Option<&str>, _bytes: usize) {
        REMOVED_HERE.with(|n| n.set(n.get() + 1));
        match annotation {
            None => match &self.removed_unnamed {
                Some(removed) => {
                    removed.inc();
                }
                None => self.removed_slow(""),
            },
            Some(name) => match self.by_name(name) {
                Some((_, removed, _)) => {
                    removed.inc();
                }
                None => self.removed_slow(name),
            },
        }
    }

    fn frame_forwarded(&self, annotation: &str) {
        match self.by_name(annotation) {
            Some((_, _, forwarded)) => {
                forwarded.inc();
            }
            None => {
                self.forwarded_family
                    .get_or_create(&AnnotationLabel {
                        annotation: annotation.to_owned(),
                    })
                    .inc();
            }
        }
    }

    fn encoded_stream_refused(&self, coding: &str) {
        let label = coding_label(coding);
        if let Some(counter) = CODINGS
            .iter()
            .position(|known| *known == label)
            .and_then(|i| self.encoded_refused.get(i))
        {
            counter.inc();
        }
        tracing::warn!(
            coding,
            "an event stream in a content coding the filter cannot read was answered with a 502 \
             (encoded_event_stream): the upstream compressed it although asked for identity, or a \
             compressor runs between the upstream and the filter"
        );
    }
}

/// Serves `metrics` at `GET /metrics` (and `HEAD`) on `listener` until `shutdown` completes, with
/// the probes: `/livez` (200 while the process runs, through the drain) and `/readyz` (200, then
/// 503 once [`Metrics::drain`] has been called). Any other path is a 404, any other method a 405.
pub async fn serve_metrics<F>(listener: TcpListener, metrics: Arc<Metrics>, shutdown: F)
where
    F: Future<Output = ()>,
{
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(_) => {
                    // Out of descriptors: the proxy's own loop backs off and logs; wait here too.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => return,
        };
        let metrics = metrics.clone();
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let res = answer(&metrics, req.method(), req.uri().path());
            async move { Ok::<_, Infallible>(res) }
        });
        tokio::spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service);
            // A scraper that stalls is cut off; scrapes are quick.
            let _ = tokio::time::timeout(Duration::from_secs(60), conn).await;
        });
    }
}

fn answer(metrics: &Metrics, method: &Method, path: &str) -> Response<Full<Bytes>> {
    if let Some(res) = probe(metrics, method, path) {
        return res;
    }
    let (status, body) = if path != "/metrics" {
        (
            StatusCode::NOT_FOUND,
            Bytes::from_static(
                b"not found: the metrics are at /metrics, the probes at /livez and /readyz\n",
            ),
        )
    } else if method != Method::GET && method != Method::HEAD {
        (
            StatusCode::METHOD_NOT_ALLOWED,
            Bytes::from_static(b"GET /metrics\n"),
        )
    } else {
        (StatusCode::OK, Bytes::from(metrics.encode()))
    };
    let mut res = Response::new(Full::new(body));
    *res.status_mut() = status;
    let content_type = if status == StatusCode::OK && path == "/metrics" {
        CONTENT_TYPE
    } else {
        "text/plain; charset=utf-8"
    };
    res.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    res
}

/// The liveness and readiness probes, `GET` (or `HEAD`) `/livez` and `/readyz`, answered from the
/// process alone; `None` for any other request. `/livez` is 200 `ok` for as long as the process
/// serves (the drain included); `/readyz` is 200 `ready`, then 503 `draining` once
/// [`Metrics::drain`] has been called.
pub fn probe<B: From<Bytes>>(
    metrics: &Metrics,
    method: &Method,
    path: &str,
) -> Option<Response<B>> {
    if method != Method::GET && method != Method::HEAD {
        return None;
    }
    let (status, body) = match path {
        LIVEZ => (StatusCode::OK, "ok\n"),
        READYZ if metrics.is_draining() => (StatusCode::SERVICE_UNAVAILABLE, "draining\n"),
        READYZ => (StatusCode::OK, "ready\n"),
        _ => return None,
    };
    let mut res = Response::new(B::from(Bytes::from_static(body.as_bytes())));
    *res.status_mut() = status;
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    res.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    Some(res)
}

/// The liveness probe's path (see [`probe`]).
pub const LIVEZ: &str = "/livez";
/// The readiness probe's path (see [`probe`]).
pub const READYZ: &str = "/readyz";
