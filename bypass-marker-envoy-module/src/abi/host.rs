//! [`Host`] on Envoy's callbacks: the stream operations the safe per-stream layer uses, each one
//! callback into Envoy on the stream's pointer, valid for the duration of the hook that made the
//! `EnvoyStream`.

use std::cell::Cell;

use http::{HeaderMap, HeaderName};

use super::log;
use super::sys::*;
use bypass_marker_envoy_adapter::metrics::Counter;
use bypass_marker_envoy_adapter::stream::{append_header_values, Body, Headers, Host, Level};

/// One stream's operations: Envoy's callbacks on its pointer, for the duration of one hook.
pub(super) struct EnvoyStream<'a> {
    envoy: FilterEnvoyPtr,
    counters: [usize; Counter::ALL.len()],
    /// Set while `send_response` runs: Envoy may run this filter's response hooks for the reply
    /// from inside it (`abi/hooks.rs`, the rule for re-entry).
    replying: &'a Cell<bool>,
}

impl<'a> EnvoyStream<'a> {
    /// The stream whose pointer Envoy passed to the running hook.
    pub(super) fn new(
        envoy: FilterEnvoyPtr,
        counters: [usize; Counter::ALL.len()],
        replying: &'a Cell<bool>,
    ) -> Self {
        Self {
            envoy,
            counters,
            replying,
        }
    }
}

fn header_type(headers: Headers) -> i32 {
    match headers {
        Headers::Request => REQUEST_HEADER,
        Headers::Response => RESPONSE_HEADER,
    }
}

fn body_type(body: Body) -> i32 {
    match body {
        Body::ReceivedRequest => RECEIVED_REQUEST_BODY,
        Body::BufferedRequest => BUFFERED_REQUEST_BODY,
        Body::ReceivedResponse => RECEIVED_RESPONSE_BODY,
        Body::BufferedResponse => BUFFERED_RESPONSE_BODY,
    }
}

impl EnvoyStream<'_> {
    /// The value of header `name` at `index`, and how many values it has.
    fn header_at(&self, headers: Headers, name: &[u8], index: usize) -> Option<(&[u8], usize)> {
        let mut value = EnvoyBuffer::EMPTY;
        let mut count = 0usize;
        // SAFETY: `self.envoy` is the stream's pointer, valid while the hook runs; `name` outlives
        // the call; `value` and `count` are valid for writes.
        let found = unsafe {
            envoy_dynamic_module_callback_http_get_header(
                self.envoy,
                header_type(headers),
                ModuleBuffer::new(name),
                &mut value,
                index,
                &mut count,
            )
        };
        // SAFETY: a header value stays valid until the hook returns or a setter is called; the
        // borrow of `self` ends before any setter (`&mut self`) can be.
        found.then(|| (unsafe { value.bytes() }, count))
    }
}

impl Host for EnvoyStream<'_> {
    fn received_request_is_buffered(&self) -> bool {
        // SAFETY: the stream's pointer, during the hook. Envoy answers whether the received
        // request chunk is the buffered body itself (1.38.3, 1.39.3 and 1.40.0 export it).
        unsafe { envoy_dynamic_module_callback_http_received_buffered_request_body(self.envoy) }
    }

    fn headers(&self, headers: Headers, name: &HeaderName, into: &mut HeaderMap) -> bool {
        let Some((first, count)) = self.header_at(headers, name.as_str().as_bytes(), 0) else {
            return true;
        };
        let rest = (1..count).map_while(|index| {
            self.header_at(headers, name.as_str().as_bytes(), index)
                .map(|(value, _)| value)
        });
        append_header_values(name, std::iter::once(first).chain(rest), into)
    }

    fn value(&self, headers: Headers, name: &str) -> Option<Vec<u8>> {
        self.header_at(headers, name.as_bytes(), 0)
            .map(|(value, _)| value.to_vec())
    }

    fn set_header(&mut self, headers: Headers, name: &str, value: Option<&[u8]>) -> bool {
        let value = value.map_or(ModuleBuffer::NULL, ModuleBuffer::new);
        // SAFETY: the stream's pointer, during the hook; Envoy copies key and value. A null value
        // removes the header.
        unsafe {
            envoy_dynamic_module_callback_http_set_header(
                self.envoy,
                header_type(headers),
                ModuleBuffer::new(name.as_bytes()),
                value,
            )
        }
    }

    fn body_len(&self, body: Body) -> usize {
        // SAFETY: the stream's pointer, during the hook.
        unsafe { envoy_dynamic_module_callback_http_get_body_size(self.envoy, body_type(body)) }
    }

    fn with_body<R>(&self, body: Body, f: impl FnOnce(&[&[u8]]) -> R) -> R {
        /// Chunks looked at without an allocation: Envoy's buffers hold 16 KiB slices, so a
        /// chunk of up to 128 KiB.
        const ON_STACK: usize = 8;
        let kind = body_type(body);
        // SAFETY: the stream's pointer, during the hook.
        let n =
            unsafe { envoy_dynamic_module_callback_http_get_body_chunks_size(self.envoy, kind) };
        if n == 0 {
            return f(&[]);
        }
        let mut stack = [EnvoyBuffer::EMPTY; ON_STACK];
        let mut heap = Vec::new();
        let chunks = if n <= ON_STACK {
            &mut stack[..n]
        } else {
            heap.resize(n, EnvoyBuffer::EMPTY);
            &mut heap[..]
        };
        // SAFETY: `chunks` has room for the `n` buffers Envoy writes.
        let ok = unsafe {
            envoy_dynamic_module_callback_http_get_body_chunks(
                self.envoy,
                kind,
                chunks.as_mut_ptr(),
            )
        };
        if !ok {
            return f(&[]);
        }
        let mut stack_slices: [&[u8]; ON_STACK] = [&[]; ON_STACK];
        let mut heap_slices = Vec::new();
        let slices = if n <= ON_STACK {
            &mut stack_slices[..n]
        } else {
            heap_slices.resize(n, &[][..]);
            &mut heap_slices[..]
        };
        let mut len = 0;
        for chunk in chunks.iter() {
            // SAFETY: a body chunk stays valid until the hook returns or a setter is called; the
            // slices live only during `f`, which gets no way to call a setter (`&self` is
            // borrowed, and setters take `&mut self`).
            let slice = unsafe { chunk.bytes() };
            if !slice.is_empty() {
                slices[len] = slice;
                len += 1;
            }
        }
        f(&slices[..len])
    }

    fn drain_body(&mut self, body: Body, n: usize) -> bool {
        // SAFETY: the stream's pointer, during the hook.
        unsafe { envoy_dynamic_module_callback_http_drain_body(self.envoy, body_type(body), n) }
    }

    fn append_body(&mut self, body: Body, data: &[u8]) -> bool {
        // SAFETY: the stream's pointer, during the hook; Envoy copies `data`.
        unsafe {
            envoy_dynamic_module_callback_http_append_body(
                self.envoy,
                body_type(body),
                ModuleBuffer::new(data),
            )
        }
    }

    fn send_response(&mut self, status: u16, headers: &[(&str, &[u8])], body: &[u8]) {
        let mut headers: Vec<ModuleHttpHeader> = headers
            .iter()
            .map(|(key, value)| ModuleHttpHeader {
                key_ptr: key.as_ptr().cast(),
                key_length: key.len(),
                value_ptr: value.as_ptr().cast(),
                value_length: value.len(),
            })
            .collect();
        // Envoy may encode the reply through this filter's response hooks before returning.
        self.replying.set(true);
        // SAFETY: the stream's pointer, during the hook; the headers, body and details outlive
        // the call, and Envoy copies them.
        unsafe {
            envoy_dynamic_module_callback_http_send_response(
                self.envoy,
                u32::from(status),
                headers.as_mut_ptr(),
                headers.len(),
                ModuleBuffer::new(body),
                ModuleBuffer::new(b"bypass_marker"),
            )
        }
        self.replying.set(false);
    }

    fn reset_stream(&mut self, details: &str) {
        // SAFETY: the stream's pointer, during the hook; Envoy copies `details`.
        unsafe {
            envoy_dynamic_module_callback_http_filter_reset_stream(
                self.envoy,
                LOCAL_RESET,
                ModuleBuffer::new(details.as_bytes()),
            )
        }
    }

    fn increment(&mut self, counter: Counter, label: &str, value: u64) {
        let mut labels = [ModuleBuffer::new(label.as_bytes())];
        // SAFETY: the stream's pointer, during the hook; the id is one Envoy gave this
        // configuration; the one label value outlives the call.
        unsafe {
            envoy_dynamic_module_callback_http_filter_increment_counter(
                self.envoy,
                self.counters[counter as usize],
                labels.as_mut_ptr(),
                labels.len(),
                value,
            );
        }
    }

    fn log(&mut self, level: Level, message: &str) {
        log(level, message);
    }
}
