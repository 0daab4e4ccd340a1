//! What the filter does for one HTTP stream, in safe Rust: the shared
//! [`GatewayExchange`] state machine driven from Envoy's hooks,
//! over the few stream operations of [`Host`]. The FFI file implements `Host` on Envoy's
//! callbacks; the tests implement it on a fake stream.

use bytes::Bytes;
use http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use tower_bypass_marker::sans_io::{
    BodyStep, ChunkEdit, ExchangeError, GatewayExchange, Refusal, RequestStep, ResponseStep,
    UnseenRequest,
};

use crate::config::FilterConfig;
use crate::log_limit::LogLimit;
use crate::metrics::{self, Counter};

/// A header map of the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Headers {
    /// The request's headers.
    Request,
    /// The response's headers.
    Response,
}

/// A body buffer of the stream, as Envoy names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Body {
    /// The request chunk the current hook is called for.
    ReceivedRequest,
    /// The request body buffered so far (the filter asked Envoy to buffer).
    BufferedRequest,
    /// The response chunk the current hook is called for.
    ReceivedResponse,
    /// The response body buffered so far.
    BufferedResponse,
}

/// Envoy's log levels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// `info`.
    Info,
    /// `warn`.
    Warn,
    /// `error`.
    Error,
}

/// The operations on one stream that the filter needs: Envoy's callbacks, or a fake.
pub trait Host {
    /// Appends every value of header `name` to `into`; false if a value is not a valid header
    /// value.
    fn headers(&self, headers: Headers, name: &HeaderName, into: &mut HeaderMap) -> bool;
    /// The first value of a header or pseudo-header (`:method`, `:status`).
    fn value(&self, headers: Headers, name: &str) -> Option<Vec<u8>>;
    /// Sets header `name` to `value`, or removes it (`None`).
    fn set_header(&mut self, headers: Headers, name: &str, value: Option<&[u8]>) -> bool;
    /// Whether the request chunk the current hook is called for is the buffered request body
    /// itself: an earlier filter in the chain buffered the body and resumed, and Envoy hands that
    /// buffer on as the received chunk. The two names then reach the same bytes, to be read once.
    fn received_request_is_buffered(&self) -> bool;
    /// The bytes in a body buffer (0 if it does not exist).
    fn body_len(&self, body: Body) -> usize;
    /// Calls `f` with the slices of a body buffer, in order (Envoy's own memory: valid only until
    /// something changes the stream, so only within `f`).
    fn with_body<R>(&self, body: Body, f: impl FnOnce(&[&[u8]]) -> R) -> R;
    /// The bytes of a body buffer as one owned buffer, to judge. The default copies them out of
    /// [`Host::with_body`]; a host whose read is already a copy of its own (the proxy-wasm plugin,
    /// whose Envoy copies the body into the VM) hands that copy over instead of copying it again.
    fn body_bytes(&self, body: Body) -> Bytes {
        let mut bytes = Vec::with_capacity(self.body_len(body));
        self.with_body(body, |slices| {
            for slice in slices {
                bytes.extend_from_slice(slice);
            }
        });
        Bytes::from(bytes)
    }
    /// Removes the first `n` bytes of a body buffer.
    fn drain_body(&mut self, body: Body, n: usize) -> bool;
    /// Appends `data` to a body buffer.
    fn append_body(&mut self, body: Body, data: &[u8]) -> bool;
    /// Answers the client with this response instead of forwarding the request.
    fn send_response(&mut self, status: u16, headers: &[(&str, &[u8])], body: &[u8]);
    /// Resets the stream: the client sees a broken stream, never a clean end.
    fn reset_stream(&mut self, details: &str);
    /// Adds `value` to a counter's series with this label.
    fn increment(&mut self, counter: Counter, label: &str, value: u64);
    /// Writes a line to Envoy's log.
    fn log(&mut self, level: Level, message: &str);
}

/// Appends each of `values` to `into` as a value of header `name`: the one loop behind every
/// host's [`Host::headers`], which differ only in where the values come from. False at the first
/// value that is not a valid header value.
pub fn append_header_values<'v>(
    name: &HeaderName,
    values: impl IntoIterator<Item = &'v [u8]>,
    into: &mut HeaderMap,
) -> bool {
    for value in values {
        let Ok(value) = HeaderValue::from_bytes(value) else {
            return false;
        };
        into.append(name.clone(), value);
    }
    true
}

/// The headers a head is judged by (type, codings, length), read from the host; `None` if one of
/// them has a value that is not a valid header value. `transfer-encoding` is among them: a
/// response whose transfer codings go beyond `chunked` (`gzip, chunked`) carries its content
/// encoded, and is refused like a content coding. (Envoy's HTTP/1.1 codec refuses such a
/// response before any filter sees it, and HTTP/2 has no transfer codings; a host that passed
/// one on would otherwise have it filtered as if it were plain.)
fn judged_headers(host: &impl Host, headers: Headers) -> Option<HeaderMap> {
    let mut into = HeaderMap::new();
    [
        header::CONTENT_TYPE,
        header::CONTENT_ENCODING,
        header::CONTENT_LENGTH,
        header::TRANSFER_ENCODING,
    ]
    .iter()
    .all(|name| host.headers(headers, name, &mut into))
    .then_some(into)
}

/// What a headers hook tells Envoy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadersStatus {
    /// Go on.
    Continue,
    /// Hold the headers (until the body has been judged, or for good after a local reply or a
    /// reset).
    StopIteration,
}

/// What a body hook tells Envoy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyStatus {
    /// Go on with the chunk as it now is.
    Continue,
    /// Keep the chunk in the buffered body and call again with the next one.
    StopIterationAndBuffer,
    /// Forward nothing (after a local reply or a reset).
    StopIterationNoBuffer,
}

/// What a trailers hook tells Envoy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrailersStatus {
    /// Go on.
    Continue,
    /// Hold them (after a local reply or a reset).
    StopIteration,
}

/// When the request's head goes on to the upstream while the guard reads the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestHead {
    /// Held until the guard has judged the body: the dynamic module, whose headers hook may stop
    /// iteration and still be called with the body, and the proxy-wasm plugin where Envoy's
    /// `allow_on_headers_stop_iteration` is set. A spliced body gets its new `content-length`.
    Held,
    /// Passed on at once: the proxy-wasm plugin where its Envoy configuration cannot set
    /// `allow_on_headers_stop_iteration` (Istio's `WasmPlugin`, Envoy Gateway), without which a
    /// proxy-wasm headers hook that stops iteration also stops the body hooks. The body is still
    /// held whole and judged before any byte of it goes on, and a refusal resets the upstream
    /// request. A body the guard shortens keeps the `content-length` the upstream was already
    /// sent: it is padded with trailing spaces, which JSON ignores.
    Forwarded,
}

/// Where the request body is: the buffered body and the chunk at hand, or, when the chunk is the
/// buffered body itself (an earlier filter buffered the body: `envoy.filters.http.buffer`, a Lua
/// `body()`, ext_authz with the body), the buffered body alone, so that no byte is read twice.
fn request_parts(host: &impl Host) -> &'static [Body] {
    if host.received_request_is_buffered() {
        &[Body::BufferedRequest]
    } else {
        &[Body::BufferedRequest, Body::ReceivedRequest]
    }
}

/// Whether an encoded event stream refused has been logged (once, the first): once per process
/// in the dynamic module; in the proxy-wasm plugin, whose statics live in its VM, once per VM
/// (each worker's, and again in a VM reloaded after a trap).
static ENCODED_LOGGED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Seconds of the Unix epoch (0 if the clock cannot be read: the first line still goes).
fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The filter's state for one stream.
#[derive(Debug)]
pub struct StreamFilter {
    exchange: GatewayExchange,
    head: RequestHead,
    /// The request's body is being buffered for the guard.
    reading: bool,
    /// The filter answered the request itself: nothing more of it goes upstream (its own reply
    /// comes back through the response hooks, and passes).
    refused: bool,
    /// The filter reset the stream: nothing more goes through.
    failed: bool,
    /// The filter answered the response itself (an encoded event stream): nothing of the
    /// upstream's response goes through; only its own reply's head and body, should Envoy pass
    /// them through the response hooks (`reply_seen`).
    response_refused: bool,
    /// The response hooks saw the filter's own reply's head, after `response_refused`.
    reply_seen: bool,
    edit: ChunkEdit,
    /// A rebuilt response chunk, before it goes back into Envoy's buffer; reused.
    out: Vec<u8>,
    /// The configuration's limit on refusal log lines.
    refusal_lines: std::sync::Arc<LogLimit>,
    #[cfg(feature = "test-panic")]
    panic_at: Option<String>,
}

/// The header a `test-panic` build reads: the name of the hook that is to panic.
#[cfg(feature = "test-panic")]
pub const TEST_PANIC_HEADER: &str = "x-bypass-marker-test-panic";

impl StreamFilter {
    /// A stream under this configuration, its request head held while the guard reads the body.
    pub fn new(config: &FilterConfig) -> Self {
        Self::with_request_head(config, RequestHead::Held)
    }

    /// A stream under this configuration, its request head held or passed on while the guard
    /// reads the body.
    pub fn with_request_head(config: &FilterConfig, head: RequestHead) -> Self {
        Self {
            head,
            // Envoy calls the request hooks of every request it forwards through this filter;
            // a response without them is a reply Envoy made itself (another filter's, or one made
            // before this filter ran), filtered for a client that asked for nothing.
            exchange: GatewayExchange::new(
                config.layer(),
                config.guard().clone(),
                UnseenRequest::Filter,
            ),
            reading: false,
            refused: false,
            failed: false,
            response_refused: false,
            reply_seen: false,
            edit: ChunkEdit::new(),
            out: Vec::new(),
            refusal_lines: config.refusal_lines(),
            #[cfg(feature = "test-panic")]
            panic_at: None,
        }
    }

    /// Whether the request's head is held waiting for its body: the guard reads the body, the
    /// head goes on only once it has been judged ([`RequestHead::Held`]), and the stream has been
    /// neither answered nor reset. The proxy-wasm plugin watches such heads for the body hooks
    /// Envoy withholds without `allow_on_headers_stop_iteration`.
    pub fn holds_request_head(&self) -> bool {
        self.reading && self.head == RequestHead::Held && !self.refused && !self.failed
    }

    /// Fails the stream on the exchange's error, or on a step this adapter does not know.
    fn fail_on<T>(&mut self, host: &mut impl Host, step: Result<T, ExchangeError>) {
        let err = step
            .err()
            .unwrap_or(ExchangeError::Order("a step this module does not know"));
        self.fail(host, &err);
    }

    /// The request's headers.
    pub fn on_request_headers(
        &mut self,
        host: &mut impl Host,
        end_of_stream: bool,
    ) -> HeadersStatus {
        #[cfg(feature = "test-panic")]
        {
            self.panic_at = host
                .value(Headers::Request, TEST_PANIC_HEADER)
                .map(|v| String::from_utf8_lossy(&v).into_owned());
        }
        self.test_panic("request_headers");
        let method = host
            .value(Headers::Request, ":method")
            .and_then(|m| Method::from_bytes(&m).ok())
            .unwrap_or(Method::GET);
        let Some(headers) = judged_headers(host, Headers::Request) else {
            // Envoy passes no such value on; should one come, the guard cannot judge it.
            self.fail(
                host,
                &ExchangeError::Order("a request header value that is not valid"),
            );
            return HeadersStatus::StopIteration;
        };
        let step = self
            .exchange
            .request_headers(method, &headers, end_of_stream);
        if matches!(step, Ok(RequestStep::Forward | RequestStep::ReadBody))
            && !host.set_header(Headers::Request, "accept-encoding", Some(b"identity"))
        {
            self.fail(
                host,
                &ExchangeError::Order("Envoy refused to set accept-encoding"),
            );
            return HeadersStatus::StopIteration;
        }
        match step {
            Ok(RequestStep::Forward) => HeadersStatus::Continue,
            Ok(RequestStep::ReadBody) => {
                self.reading = true;
                match self.head {
                    RequestHead::Held => HeadersStatus::StopIteration,
                    RequestHead::Forwarded => HeadersStatus::Continue,
                }
            }
            Ok(RequestStep::Refuse(refusal)) => {
                self.refuse(host, &refusal);
                HeadersStatus::StopIteration
            }
            // An error, or a step added in a later version of the library: fail closed.
            other => {
                self.fail_on(host, other);
                HeadersStatus::StopIteration
            }
        }
    }

    /// A chunk of the request's body.
    pub fn on_request_body(&mut self, host: &mut impl Host, end_of_stream: bool) -> BodyStatus {
        self.test_panic("request_body");
        if self.refused || self.failed {
            return BodyStatus::StopIterationNoBuffer;
        }
        if !self.reading {
            return BodyStatus::Continue;
        }
        let size = request_parts(host)
            .iter()
            .map(|part| host.body_len(*part))
            .sum::<usize>();
        if size > self.exchange.max_request_body() {
            // Refused as soon as it is known to be too large, without buffering the rest.
            self.refuse(host, &Refusal::too_large(self.exchange.max_request_body()));
            return BodyStatus::StopIterationNoBuffer;
        }
        if !end_of_stream {
            return BodyStatus::StopIterationAndBuffer;
        }
        self.judge_request(host)
    }

    /// The request's trailers: a body being read is whole now.
    pub fn on_request_trailers(&mut self, host: &mut impl Host) -> TrailersStatus {
        self.test_panic("request_trailers");
        if self.refused || self.failed {
            return TrailersStatus::StopIteration;
        }
        if !self.reading {
            return TrailersStatus::Continue;
        }
        match self.judge_request(host) {
            BodyStatus::Continue => TrailersStatus::Continue,
            _ => TrailersStatus::StopIteration,
        }
    }

    /// Judges the whole buffered request body (the received chunk included, once).
    fn judge_request(&mut self, host: &mut impl Host) -> BodyStatus {
        self.reading = false;
        let parts = request_parts(host);
        let body = match parts {
            // One buffer: judged from the host's one copy of it.
            [part] => host.body_bytes(*part),
            _ => {
                let mut body =
                    Vec::with_capacity(parts.iter().map(|part| host.body_len(*part)).sum());
                for &part in parts {
                    host.with_body(part, |slices| {
                        for slice in slices {
                            body.extend_from_slice(slice);
                        }
                    });
                }
                Bytes::from(body)
            }
        };
        match self.exchange.request_body(body, true) {
            Ok(BodyStep::Forward) => BodyStatus::Continue,
            Ok(BodyStep::Replace {
                body,
                set_content_length,
                ..
            }) => {
                let length = body.len();
                let original: usize = parts.iter().map(|part| host.body_len(*part)).sum();
                // With the head already gone on, its content-length stands: pad to it.
                let pad = match (self.head, set_content_length) {
                    (RequestHead::Forwarded, true) if length <= original => original - length,
                    (RequestHead::Forwarded, true) => {
                        self.fail(
                            host,
                            &ExchangeError::Order(
                                "a spliced request body longer than the original",
                            ),
                        );
                        return BodyStatus::StopIterationNoBuffer;
                    }
                    _ => 0,
                };
                // The spliced body goes where Envoy keeps the body it forwards: the buffered body
                // once there is one, else the chunk at hand.
                let target = if host.body_len(Body::BufferedRequest) > 0 {
                    Body::BufferedRequest
                } else {
                    Body::ReceivedRequest
                };
                let mut ok = true;
                for &part in parts {
                    let n = host.body_len(part);
                    if n > 0 {
                        ok &= host.drain_body(part, n);
                    }
                }
                for chunk in body.into_chunks() {
                    ok &= chunk.is_empty() || host.append_body(target, &chunk);
                }
                if pad > 0 {
                    ok &= host.append_body(target, &vec![b' '; pad]);
                }
                if set_content_length && self.head == RequestHead::Held {
                    ok &= host.set_header(
                        Headers::Request,
                        "content-length",
                        Some(length.to_string().as_bytes()),
                    );
                }
                if !ok {
                    // Part of the spliced body may be missing: nothing of it may go upstream.
                    self.fail(
                        host,
                        &ExchangeError::Order("Envoy refused the spliced request body"),
                    );
                    return BodyStatus::StopIterationNoBuffer;
                }
                BodyStatus::Continue
            }
            Ok(BodyStep::Refuse(refusal)) => {
                self.refuse(host, &refusal);
                BodyStatus::StopIterationNoBuffer
            }
            // An error, or a step added in a later version of the library: fail closed.
            other => {
                self.fail_on(host, other);
                BodyStatus::StopIterationNoBuffer
            }
        }
    }

    /// The response's headers.
    pub fn on_response_headers(
        &mut self,
        host: &mut impl Host,
        end_of_stream: bool,
    ) -> HeadersStatus {
        self.test_panic("response_headers");
        if self.failed {
            return HeadersStatus::StopIteration;
        }
        if self.response_refused {
            // A second head after the filter replied: its own reply, which passes.
            self.reply_seen = true;
            return HeadersStatus::Continue;
        }
        let status = host
            .value(Headers::Response, ":status")
            .and_then(|s| StatusCode::from_bytes(&s).ok())
            .unwrap_or(StatusCode::OK);
        let Some(headers) = judged_headers(host, Headers::Response) else {
            // A head the filter cannot read: filter the body as if it were an event stream
            // would be guessing, so the stream fails.
            self.fail(
                host,
                &ExchangeError::Order("a response header value that is not valid"),
            );
            return HeadersStatus::StopIteration;
        };
        match self
            .exchange
            .response_headers(status, &headers, end_of_stream)
        {
            Ok(ResponseStep::Pass) => HeadersStatus::Continue,
            Ok(ResponseStep::Filter {
                remove_content_length,
                ..
            }) => {
                if remove_content_length
                    && !host.set_header(Headers::Response, "content-length", None)
                {
                    self.fail(
                        host,
                        &ExchangeError::Order("Envoy refused to remove content-length"),
                    );
                    return HeadersStatus::StopIteration;
                }
                HeadersStatus::Continue
            }
            Ok(ResponseStep::Refuse(refusal)) => {
                self.refuse_response(host, &headers, &refusal);
                HeadersStatus::StopIteration
            }
            // An error, or a step added in a later version of the library: fail closed.
            other => {
                self.fail_on(host, other);
                HeadersStatus::StopIteration
            }
        }
    }

    /// Answers an encoded event stream the filter cannot read, with something in it to remove for
    /// this client, with the 502 instead, before any byte of it: counted by coding, and logged
    /// the first time in the process (every one would be a log line per stream).
    fn refuse_response(&mut self, host: &mut impl Host, headers: &HeaderMap, refusal: &Refusal) {
        self.response_refused = true;
        // Counted by the first coding in the way: a content coding, else a transfer coding
        // other than `chunked` (`gzip, chunked` counts as gzip).
        let transfer = headers
            .get_all(header::TRANSFER_ENCODING)
            .iter()
            .flat_map(|value| value.as_bytes().split(|&b| b == b','))
            .filter(|coding| !coding.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        let coding = metrics::encoded_refused(
            headers
                .get_all(header::CONTENT_ENCODING)
                .iter()
                .map(|value| value.as_bytes())
                .chain(transfer),
        );
        if !ENCODED_LOGGED.swap(true, std::sync::atomic::Ordering::Relaxed) {
            host.log(
                Level::Error,
                &format!(
                    "bypass_marker: answered an encoded event stream ({coding}) with {}: {refusal} \
                     (logged once; bypass_marker_encoded_streams_refused counts every one)",
                    refusal.status().as_u16()
                ),
            );
        }
        host.send_response(
            refusal.status().as_u16(),
            &[("content-type", b"application/json")],
            &refusal.body(),
        );
        self.flush_counts(host);
    }

    /// A chunk of the response's body: scanned where it lies; the buffer is changed only where a
    /// frame is removed or a frame that goes on past the chunk is held.
    pub fn on_response_body(&mut self, host: &mut impl Host, end_of_stream: bool) -> BodyStatus {
        self.test_panic("response_body");
        if self.failed || (self.response_refused && !self.reply_seen) {
            // Nothing of a refused response's own body goes out.
            return BodyStatus::StopIterationNoBuffer;
        }
        if self.response_refused {
            return BodyStatus::Continue;
        }
        if !self.exchange.filters_response() {
            return BodyStatus::Continue;
        }
        // Scanned where the chunk lies; copied out only when it must be rebuilt (a frame removed
        // from its middle, or a frame held across chunks released into it or cut from its end),
        // before the buffer changes.
        self.out.clear();
        let (exchange, edit, out) = (&mut self.exchange, &mut self.edit, &mut self.out);
        let scanned = host.with_body(Body::ReceivedResponse, |slices| {
            exchange.response_body(slices, end_of_stream, edit)?;
            if !edit.is_unchanged() && edit.skip_front().is_none() {
                edit.write_to(slices, out);
            }
            Ok(())
        });
        if let Err(err) = scanned {
            self.flush_counts(host);
            self.fail(host, &err);
            return BodyStatus::StopIterationNoBuffer;
        }
        let ok = if self.edit.is_unchanged() {
            true
        } else if let Some(n) = self.edit.skip_front() {
            host.drain_body(Body::ReceivedResponse, n)
        } else {
            host.drain_body(Body::ReceivedResponse, self.edit.input_len())
                && (self.out.is_empty() || host.append_body(Body::ReceivedResponse, &self.out))
        };
        self.flush_counts(host);
        if !ok {
            self.fail(
                host,
                &ExchangeError::Order("Envoy refused a change to the response body"),
            );
            return BodyStatus::StopIterationNoBuffer;
        }
        BodyStatus::Continue
    }

    /// The response's trailers: the body has ended, and what it held goes out before them.
    pub fn on_response_trailers(&mut self, host: &mut impl Host) -> TrailersStatus {
        self.test_panic("response_trailers");
        if self.failed || (self.response_refused && !self.reply_seen) {
            return TrailersStatus::StopIteration;
        }
        if self.response_refused {
            return TrailersStatus::Continue;
        }
        if !self.exchange.filters_response() {
            return TrailersStatus::Continue;
        }
        let out = self.exchange.response_body(&[], true, &mut self.edit);
        self.flush_counts(host);
        if let Err(err) = out {
            self.fail(host, &err);
            return TrailersStatus::StopIteration;
        }
        self.out.clear();
        self.edit.write_to(&[], &mut self.out);
        if !self.out.is_empty() && !host.append_body(Body::BufferedResponse, &self.out) {
            self.fail(
                host,
                &ExchangeError::Order("Envoy refused the end of the response body"),
            );
            return TrailersStatus::StopIteration;
        }
        TrailersStatus::Continue
    }

    /// The stream is over (ended, or reset by either side): nothing is left to do but count.
    pub fn on_stream_complete(&mut self, host: &mut impl Host) {
        self.flush_counts(host);
    }

    /// Answers the client with a refusal: the guard's status and body, one log line, one count.
    fn refuse(&mut self, host: &mut impl Host, refusal: &Refusal) {
        self.refused = true;
        self.reading = false;
        let status = refusal.status().as_u16();
        if let Some(held) = self.refusal_lines.admit(now_secs()) {
            let since = if held > 0 {
                format!(" ({held} more refused since the last such line, not logged)")
            } else {
                String::new()
            };
            host.log(
                Level::Info,
                &format!(
                    "bypass_marker: refused a request with {status}: {refusal}{since} (logged at \
                     most once a minute; bypass_marker_requests_refused counts every one)"
                ),
            );
        }
        host.send_response(
            status,
            &[("content-type", b"application/json")],
            &refusal.body(),
        );
        metrics::refused(status);
        self.flush_counts(host);
    }

    /// Resets the stream: the client sees a broken stream, never an unfiltered or a clean one.
    fn fail(&mut self, host: &mut impl Host, err: &ExchangeError) {
        self.failed = true;
        self.reading = false;
        let level = match err {
            ExchangeError::FrameTooLarge(_) => Level::Warn,
            _ => Level::Error,
        };
        host.log(level, &format!("bypass_marker: stream reset: {err}"));
        host.reset_stream("bypass_marker");
    }

    /// The filter failed in a way it cannot describe (a panic caught at the boundary): the
    /// stream is reset, and later hooks let nothing through.
    pub fn poison(&mut self, host: &mut impl Host) {
        self.failed = true;
        self.reading = false;
        host.log(Level::Error, "bypass_marker: internal error; stream reset");
        host.reset_stream("bypass_marker_internal_error");
    }

    fn flush_counts(&mut self, host: &mut impl Host) {
        metrics::take(|counter, label, n| host.increment(counter, label, n));
    }

    #[cfg(feature = "test-panic")]
    fn test_panic(&self, hook: &str) {
        if self.panic_at.as_deref() == Some(hook) {
            panic!("bypass_marker test panic in {hook}");
        }
    }

    #[cfg(not(feature = "test-panic"))]
    #[inline(always)]
    fn test_panic(&self, _hook: &str) {}
}

pub mod memory;
#[cfg(test)]
mod tests;
