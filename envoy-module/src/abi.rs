//! Envoy's dynamic-module ABI: the hooks this library exports and the callbacks of Envoy's it
//! calls, declared here against `source/extensions/dynamic_modules/abi/abi.h` in Envoy's
//! repository, and nothing else. All of the package's `unsafe` code is in this file.
//!
//! - The ABI version returned is Envoy 1.40's, `v0.2.0`. Envoy 1.38 and 1.39 expect `v0.1.0` and
//!   only warn on a mismatch; the declarations used here are the same in all three.
//! - Envoy resolves every symbol when it loads the module, so only callbacks that 1.38.3, 1.39.3
//!   and 1.40.0 all export are referenced (`log`, not 1.40's `log_v2`), and every hook Envoy
//!   looks up for an HTTP filter is exported, the ones the filter does not use included
//!   (`tests/envoy/module.sh` loads the module in all three).
//! - Every hook that runs the filter's code catches a panic: the stream is reset (the client sees
//!   a broken stream, never an unfiltered or a clean-looking truncated one), its later hooks let
//!   nothing through, and Envoy goes on serving. Nothing unwinds into Envoy. This relies on the
//!   default `panic = "unwind"`.

#![allow(unsafe_code)]
// The hooks are `pub` for the dynamic symbol table, not for Rust callers, and take the ABI's
// private types.
#![allow(unreachable_pub, private_interfaces)]

use std::ffi::{c_char, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;

use http::{HeaderMap, HeaderName, HeaderValue};

use crate::config::Config;
use crate::metrics::Counter;
use crate::stream::{
    Body, BodyStatus, Headers, HeadersStatus, Host, Level, StreamFilter, TrailersStatus,
};

/// The ABI version this module is written against: Envoy 1.40's.
const ABI_VERSION: &CStr = c"v0.2.0";

/// `envoy_dynamic_module_type_envoy_buffer`: bytes Envoy owns.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct EnvoyBuffer {
    ptr: *const c_char,
    length: usize,
}

/// `envoy_dynamic_module_type_module_buffer`: bytes the module owns, lent for one call.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct ModuleBuffer {
    ptr: *const c_char,
    length: usize,
}

/// `envoy_dynamic_module_type_module_http_header`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct ModuleHttpHeader {
    key_ptr: *const c_char,
    key_length: usize,
    value_ptr: *const c_char,
    value_length: usize,
}

type ConfigEnvoyPtr = *mut c_void;
type ConfigModulePtr = *const c_void;
type FilterEnvoyPtr = *mut c_void;
type FilterModulePtr = *const c_void;

// Enums are C `int`s.
/// `envoy_dynamic_module_type_http_header_type`.
const REQUEST_HEADER: i32 = 0;
const RESPONSE_HEADER: i32 = 2;
/// `envoy_dynamic_module_type_http_body_type`.
const RECEIVED_REQUEST_BODY: i32 = 0;
const BUFFERED_REQUEST_BODY: i32 = 1;
const RECEIVED_RESPONSE_BODY: i32 = 2;
const BUFFERED_RESPONSE_BODY: i32 = 3;
/// `envoy_dynamic_module_type_log_level`.
const LOG_INFO: i32 = 2;
const LOG_WARN: i32 = 3;
const LOG_ERROR: i32 = 4;
/// `envoy_dynamic_module_type_http_filter_stream_reset_reason`: `LocalReset`.
const LOCAL_RESET: i32 = 0;
/// `envoy_dynamic_module_type_metrics_result`: `Success`.
const METRICS_SUCCESS: i32 = 0;
/// The hooks' statuses.
const HEADERS_CONTINUE: i32 = 0;
const HEADERS_STOP_ITERATION: i32 = 1;
const BODY_CONTINUE: i32 = 0;
const BODY_STOP_ITERATION_AND_BUFFER: i32 = 1;
const BODY_STOP_ITERATION_NO_BUFFER: i32 = 3;
const TRAILERS_CONTINUE: i32 = 0;
const TRAILERS_STOP_ITERATION: i32 = 1;

extern "C" {
    fn envoy_dynamic_module_callback_http_get_header(
        filter_envoy_ptr: FilterEnvoyPtr,
        header_type: i32,
        key: ModuleBuffer,
        result_buffer: *mut EnvoyBuffer,
        index: usize,
        optional_size: *mut usize,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_set_header(
        filter_envoy_ptr: FilterEnvoyPtr,
        header_type: i32,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_get_body_size(
        filter_envoy_ptr: FilterEnvoyPtr,
        body_type: i32,
    ) -> usize;
    fn envoy_dynamic_module_callback_http_get_body_chunks_size(
        filter_envoy_ptr: FilterEnvoyPtr,
        body_type: i32,
    ) -> usize;
    fn envoy_dynamic_module_callback_http_get_body_chunks(
        filter_envoy_ptr: FilterEnvoyPtr,
        body_type: i32,
        result_buffer_vector: *mut EnvoyBuffer,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_drain_body(
        filter_envoy_ptr: FilterEnvoyPtr,
        body_type: i32,
        number_of_bytes: usize,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_append_body(
        filter_envoy_ptr: FilterEnvoyPtr,
        body_type: i32,
        data: ModuleBuffer,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_send_response(
        filter_envoy_ptr: FilterEnvoyPtr,
        status_code: u32,
        headers_vector: *mut ModuleHttpHeader,
        headers_vector_size: usize,
        body: ModuleBuffer,
        details: ModuleBuffer,
    );
    fn envoy_dynamic_module_callback_http_filter_reset_stream(
        filter_envoy_ptr: FilterEnvoyPtr,
        reason: i32,
        details: ModuleBuffer,
    );
    fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        filter_config_envoy_ptr: ConfigEnvoyPtr,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        counter_id_ptr: *mut usize,
    ) -> i32;
    fn envoy_dynamic_module_callback_http_filter_increment_counter(
        filter_envoy_ptr: FilterEnvoyPtr,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> i32;
    fn envoy_dynamic_module_callback_log(level: i32, message: ModuleBuffer);
}

impl ModuleBuffer {
    fn new(bytes: &[u8]) -> Self {
        Self {
            ptr: bytes.as_ptr().cast(),
            length: bytes.len(),
        }
    }

    /// A null buffer: "no value" where Envoy takes one (a header to remove).
    const NULL: Self = Self {
        ptr: ptr::null(),
        length: 0,
    };
}

impl EnvoyBuffer {
    const EMPTY: Self = Self {
        ptr: ptr::null(),
        length: 0,
    };

    /// The bytes, borrowed for `'a`.
    ///
    /// # Safety
    ///
    /// Envoy must keep them valid and unchanged for `'a`.
    unsafe fn bytes<'a>(self) -> &'a [u8] {
        if self.ptr.is_null() || self.length == 0 {
            return &[];
        }
        // SAFETY: a non-null buffer from Envoy points at `length` initialised bytes, valid for
        // `'a` by this function's contract.
        unsafe { std::slice::from_raw_parts(self.ptr.cast(), self.length) }
    }
}

fn log(level: Level, message: &str) {
    let level = match level {
        Level::Info => LOG_INFO,
        Level::Warn => LOG_WARN,
        Level::Error => LOG_ERROR,
    };
    // SAFETY: `message` outlives the call; Envoy copies it. The callback may be called on any
    // thread.
    unsafe { envoy_dynamic_module_callback_log(level, ModuleBuffer::new(message.as_bytes())) }
}

/// A configuration Envoy loaded: the filter's, and its counters' ids.
struct ModuleConfig {
    config: Config,
    counters: [usize; 3],
}

/// One stream's state: the module pointer Envoy holds for it.
struct Filter {
    stream: StreamFilter,
    counters: [usize; 3],
}

/// One stream's operations: Envoy's callbacks on its pointer, for the duration of one hook.
struct EnvoyStream {
    envoy: FilterEnvoyPtr,
    counters: [usize; 3],
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

impl EnvoyStream {
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

impl Host for EnvoyStream {
    fn headers(&self, headers: Headers, name: &HeaderName, into: &mut HeaderMap) -> bool {
        let Some((first, count)) = self.header_at(headers, name.as_str().as_bytes(), 0) else {
            return true;
        };
        for index in 0..count {
            let value = if index == 0 {
                Some(first)
            } else {
                self.header_at(headers, name.as_str().as_bytes(), index)
                    .map(|(value, _)| value)
            };
            let Some(value) = value else { break };
            match HeaderValue::from_bytes(value) {
                Ok(value) => {
                    into.append(name.clone(), value);
                }
                Err(_) => return false,
            }
        }
        true
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

/// Runs a stream's hook: the filter and its host, with a panic caught and turned into a reset
/// stream (`on_panic` is then what the hook returns).
fn on_stream<R>(
    envoy: FilterEnvoyPtr,
    module: FilterModulePtr,
    on_panic: R,
    hook: impl FnOnce(&mut StreamFilter, &mut EnvoyStream) -> R,
) -> R {
    if module.is_null() {
        return on_panic;
    }
    // SAFETY: `module` is the pointer `on_http_filter_new` returned (a leaked `Box<Filter>`),
    // freed only by `on_http_filter_destroy`, after the stream's last hook. Envoy calls a stream's
    // hooks on its worker thread one at a time, so this is the only reference while it runs.
    let filter = unsafe { &mut *module.cast_mut().cast::<Filter>() };
    let mut host = EnvoyStream {
        envoy,
        counters: filter.counters,
    };
    match catch_unwind(AssertUnwindSafe(|| hook(&mut filter.stream, &mut host))) {
        Ok(status) => status,
        Err(_) => {
            // Resetting cannot panic in a way that matters; should it, nothing more is tried.
            let _ = catch_unwind(AssertUnwindSafe(|| filter.stream.poison(&mut host)));
            on_panic
        }
    }
}

/// Called once when Envoy loads the module.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const c_char {
    ABI_VERSION.as_ptr()
}

/// Called on the main thread for each `filter_config`: null refuses it (Envoy does not start, or
/// rejects the update), after a log line that names the field at fault.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    config_envoy: ConfigEnvoyPtr,
    name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> ConfigModulePtr {
    let made = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: Envoy keeps the name and the configuration valid during this call; they are
        // read before it returns.
        let (name, text) = unsafe { (name.bytes(), config.bytes()) };
        let config = match Config::parse(text) {
            Ok(config) => config,
            Err(err) => {
                log(
                    Level::Error,
                    &format!(
                        "bypass_marker: filter {:?}: {err}",
                        String::from_utf8_lossy(name)
                    ),
                );
                return ptr::null();
            }
        };
        let mut counters = [0usize; 3];
        for counter in Counter::ALL {
            let name = counter.name();
            let mut labels = [ModuleBuffer::new(counter.label().as_bytes())];
            let mut id = 0usize;
            // SAFETY: `config_envoy` is the configuration's pointer, valid during this call (the
            // only time Envoy lets counters be defined); name and labels outlive the call and
            // `id` is valid for writes.
            let result = unsafe {
                envoy_dynamic_module_callback_http_filter_config_define_counter(
                    config_envoy,
                    ModuleBuffer::new(name.as_bytes()),
                    labels.as_mut_ptr(),
                    labels.len(),
                    &mut id,
                )
            };
            if result != METRICS_SUCCESS {
                log(
                    Level::Error,
                    &format!("bypass_marker: cannot define the counter {name} (error {result})"),
                );
                return ptr::null();
            }
            counters[counter as usize] = id;
        }
        Box::into_raw(Box::new(ModuleConfig { config, counters }))
            .cast_const()
            .cast()
    }));
    made.unwrap_or_else(|_| {
        log(
            Level::Error,
            "bypass_marker: internal error reading filter_config",
        );
        ptr::null()
    })
}

/// Called when Envoy drops a configuration (after its last stream).
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config: ConfigModulePtr) {
    if config.is_null() {
        return;
    }
    // SAFETY: `config` is a pointer `on_http_filter_config_new` returned, given back once.
    let config = unsafe { Box::from_raw(config.cast_mut().cast::<ModuleConfig>()) };
    let _ = catch_unwind(AssertUnwindSafe(|| drop(config)));
}

/// Called on a worker thread for each new stream.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(
    config: ConfigModulePtr,
    _filter_envoy: FilterEnvoyPtr,
) -> FilterModulePtr {
    if config.is_null() {
        return ptr::null();
    }
    // SAFETY: `config` is a pointer `on_http_filter_config_new` returned; Envoy keeps it until
    // `on_http_filter_config_destroy`, which comes after every stream made from it. Streams only
    // read it.
    let config = unsafe { &*config.cast::<ModuleConfig>() };
    catch_unwind(AssertUnwindSafe(|| {
        Box::into_raw(Box::new(Filter {
            stream: StreamFilter::new(&config.config),
            counters: config.counters,
        }))
        .cast_const()
        .cast()
    }))
    .unwrap_or(ptr::null())
}

/// Called after the stream's last hook.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_destroy(filter: FilterModulePtr) {
    if filter.is_null() {
        return;
    }
    // SAFETY: `filter` is a pointer `on_http_filter_new` returned, given back once, after the
    // stream's last hook.
    let filter = unsafe { Box::from_raw(filter.cast_mut().cast::<Filter>()) };
    let _ = catch_unwind(AssertUnwindSafe(|| drop(filter)));
}

fn headers_status(status: HeadersStatus) -> i32 {
    match status {
        HeadersStatus::Continue => HEADERS_CONTINUE,
        HeadersStatus::StopIteration => HEADERS_STOP_ITERATION,
    }
}

fn body_status(status: BodyStatus) -> i32 {
    match status {
        BodyStatus::Continue => BODY_CONTINUE,
        BodyStatus::StopIterationAndBuffer => BODY_STOP_ITERATION_AND_BUFFER,
        BodyStatus::StopIterationNoBuffer => BODY_STOP_ITERATION_NO_BUFFER,
    }
}

fn trailers_status(status: TrailersStatus) -> i32 {
    match status {
        TrailersStatus::Continue => TRAILERS_CONTINUE,
        TrailersStatus::StopIteration => TRAILERS_STOP_ITERATION,
    }
}

/// The request's headers.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    envoy: FilterEnvoyPtr,
    module: FilterModulePtr,
    end_of_stream: bool,
) -> i32 {
    on_stream(envoy, module, HEADERS_STOP_ITERATION, |filter, host| {
        headers_status(filter.on_request_headers(host, end_of_stream))
    })
}

/// A chunk of the request's body.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    envoy: FilterEnvoyPtr,
    module: FilterModulePtr,
    end_of_stream: bool,
) -> i32 {
    on_stream(
        envoy,
        module,
        BODY_STOP_ITERATION_NO_BUFFER,
        |filter, host| body_status(filter.on_request_body(host, end_of_stream)),
    )
}

/// The request's trailers.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    envoy: FilterEnvoyPtr,
    module: FilterModulePtr,
) -> i32 {
    on_stream(envoy, module, TRAILERS_STOP_ITERATION, |filter, host| {
        trailers_status(filter.on_request_trailers(host))
    })
}

/// The response's headers.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    envoy: FilterEnvoyPtr,
    module: FilterModulePtr,
    end_of_stream: bool,
) -> i32 {
    on_stream(envoy, module, HEADERS_STOP_ITERATION, |filter, host| {
        headers_status(filter.on_response_headers(host, end_of_stream))
    })
}

/// A chunk of the response's body.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    envoy: FilterEnvoyPtr,
    module: FilterModulePtr,
    end_of_stream: bool,
) -> i32 {
    on_stream(
        envoy,
        module,
        BODY_STOP_ITERATION_NO_BUFFER,
        |filter, host| body_status(filter.on_response_body(host, end_of_stream)),
    )
}

/// The response's trailers.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    envoy: FilterEnvoyPtr,
    module: FilterModulePtr,
) -> i32 {
    on_stream(envoy, module, TRAILERS_STOP_ITERATION, |filter, host| {
        trailers_status(filter.on_response_trailers(host))
    })
}

/// The stream is over: ended, or reset by either side.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    envoy: FilterEnvoyPtr,
    module: FilterModulePtr,
) {
    on_stream(envoy, module, (), |filter, host| {
        filter.on_stream_complete(host)
    });
}

// Hooks Envoy looks up for every HTTP filter, which this filter does not use (it makes no HTTP
// callouts or streams, schedules nothing and does not watch watermarks). They do nothing, so
// nothing in them can panic.

/// Unused: the filter makes no HTTP callouts.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    _envoy: FilterEnvoyPtr,
    _module: FilterModulePtr,
    _callout_id: u64,
    _result: i32,
    _headers: *mut c_void,
    _headers_size: usize,
    _body_chunks: *mut c_void,
    _body_chunks_size: usize,
) {
}

/// Unused: the filter opens no HTTP streams.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
    _envoy: FilterEnvoyPtr,
    _module: FilterModulePtr,
    _stream_id: u64,
    _headers: *mut c_void,
    _headers_size: usize,
    _end_stream: bool,
) {
}

/// Unused: the filter opens no HTTP streams.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
    _envoy: FilterEnvoyPtr,
    _module: FilterModulePtr,
    _stream_id: u64,
    _data: *const c_void,
    _data_count: usize,
    _end_stream: bool,
) {
}

/// Unused: the filter opens no HTTP streams.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
    _envoy: FilterEnvoyPtr,
    _module: FilterModulePtr,
    _stream_id: u64,
    _trailers: *mut c_void,
    _trailers_size: usize,
) {
}

/// Unused: the filter opens no HTTP streams.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(
    _envoy: FilterEnvoyPtr,
    _module: FilterModulePtr,
    _stream_id: u64,
) {
}

/// Unused: the filter opens no HTTP streams.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(
    _envoy: FilterEnvoyPtr,
    _module: FilterModulePtr,
    _stream_id: u64,
    _reason: i32,
) {
}

/// Unused: the filter schedules nothing.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(
    _envoy: FilterEnvoyPtr,
    _module: FilterModulePtr,
    _event_id: u64,
) {
}

/// Unused: the filter holds at most one frame, so it does not watch the client's pace.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
    _envoy: FilterEnvoyPtr,
    _module: FilterModulePtr,
) {
}

/// Unused: as the high watermark.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
    _envoy: FilterEnvoyPtr,
    _module: FilterModulePtr,
) {
}

/// The hooks called as Envoy calls them, against a fake of the callbacks they use (defined here,
/// so that the test binary links without Envoy).
#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;

    /// One stream's state as the fake callbacks see it.
    #[derive(Default)]
    struct FakeEnvoy {
        request_headers: Vec<(Vec<u8>, Vec<u8>)>,
        response_headers: Vec<(Vec<u8>, Vec<u8>)>,
        bodies: [Vec<u8>; 4],
        resets: Vec<String>,
        replies: Vec<(u32, Vec<u8>)>,
        logs: Vec<(i32, String)>,
        counters: Vec<String>,
        increments: Vec<(usize, String, u64)>,
    }

    thread_local! {
        static ENVOY: RefCell<FakeEnvoy> = RefCell::new(FakeEnvoy::default());
    }

    fn with<R>(f: impl FnOnce(&mut FakeEnvoy) -> R) -> R {
        ENVOY.with(|envoy| f(&mut envoy.borrow_mut()))
    }

    unsafe fn module_bytes(buffer: ModuleBuffer) -> Vec<u8> {
        if buffer.ptr.is_null() {
            return Vec::new();
        }
        // SAFETY: the module lends `length` bytes for the call.
        unsafe { std::slice::from_raw_parts(buffer.ptr.cast::<u8>(), buffer.length) }.to_vec()
    }

    fn header_list(envoy: &mut FakeEnvoy, header_type: i32) -> &mut Vec<(Vec<u8>, Vec<u8>)> {
        match header_type {
            REQUEST_HEADER => &mut envoy.request_headers,
            RESPONSE_HEADER => &mut envoy.response_headers,
            other => panic!("header type {other}"),
        }
    }

    #[no_mangle]
    extern "C" fn envoy_dynamic_module_callback_http_get_header(
        _filter: FilterEnvoyPtr,
        header_type: i32,
        key: ModuleBuffer,
        result: *mut EnvoyBuffer,
        index: usize,
        size: *mut usize,
    ) -> bool {
        // SAFETY: the module passes a key it owns and out-pointers valid for writes.
        let key = unsafe { module_bytes(key) };
        with(|envoy| {
            let values: Vec<(*const c_char, usize)> = header_list(envoy, header_type)
                .iter()
                .filter(|(k, _)| *k == key)
                .map(|(_, v)| (v.as_ptr().cast(), v.len()))
                .collect();
            // SAFETY: as above; the values live in the thread-local until the test changes them.
            unsafe {
                if !size.is_null() {
                    *size = values.len();
                }
                match values.get(index) {
                    Some(&(ptr, length)) => {
                        *result = EnvoyBuffer { ptr, length };
                        true
                    }
                    None => false,
                }
            }
        })
    }

    #[no_mangle]
    extern "C" fn envoy_dynamic_module_callback_http_set_header(
        _filter: FilterEnvoyPtr,
        header_type: i32,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool {
        // SAFETY: buffers the module lends for the call.
        let (key, remove, value) =
            unsafe { (module_bytes(key), value.ptr.is_null(), module_bytes(value)) };
        with(|envoy| {
            let list = header_list(envoy, header_type);
            list.retain(|(k, _)| *k != key);
            if !remove {
                list.push((key, value));
            }
        });
        true
    }

    #[no_mangle]
    extern "C" fn envoy_dynamic_module_callback_http_get_body_size(
        _filter: FilterEnvoyPtr,
        body_type: i32,
    ) -> usize {
        with(|envoy| envoy.bodies[body_type as usize].len())
    }

    #[no_mangle]
    extern "C" fn envoy_dynamic_module_callback_http_get_body_chunks_size(
        _filter: FilterEnvoyPtr,
        body_type: i32,
    ) -> usize {
        with(|envoy| usize::from(!envoy.bodies[body_type as usize].is_empty()))
    }

    #[no_mangle]
    extern "C" fn envoy_dynamic_module_callback_http_get_body_chunks(
        _filter: FilterEnvoyPtr,
        body_type: i32,
        result: *mut EnvoyBuffer,
    ) -> bool {
        with(|envoy| {
            let body = &envoy.bodies[body_type as usize];
            // SAFETY: the module allocated room for the one chunk `get_body_chunks_size` gave.
            unsafe {
                *result = EnvoyBuffer {
                    ptr: body.as_ptr().cast(),
                    length: body.len(),
                };
            }
            true
        })
    }

    #[no_mangle]
    extern "C" fn envoy_dynamic_module_callback_http_drain_body(
        _filter: FilterEnvoyPtr,
        body_type: i32,
        n: usize,
    ) -> bool {
        with(|envoy| {
            let body = &mut envoy.bodies[body_type as usize];
            body.drain(..n.min(body.len()));
        });
        true
    }

    #[no_mangle]
    extern "C" fn envoy_dynamic_module_callback_http_append_body(
        _filter: FilterEnvoyPtr,
        body_type: i32,
        data: ModuleBuffer,
    ) -> bool {
        // SAFETY: a buffer the module lends for the call.
        let data = unsafe { module_bytes(data) };
        with(|envoy| envoy.bodies[body_type as usize].extend_from_slice(&data));
        true
    }

    #[no_mangle]
    extern "C" fn envoy_dynamic_module_callback_http_send_response(
        _filter: FilterEnvoyPtr,
        status: u32,
        _headers: *mut ModuleHttpHeader,
        _count: usize,
        body: ModuleBuffer,
        _details: ModuleBuffer,
    ) {
        // SAFETY: a buffer the module lends for the call.
        let body = unsafe { module_bytes(body) };
        with(|envoy| envoy.replies.push((status, body)));
    }

    #[no_mangle]
    extern "C" fn envoy_dynamic_module_callback_http_filter_reset_stream(
        _filter: FilterEnvoyPtr,
        reason: i32,
        details: ModuleBuffer,
    ) {
        assert_eq!(reason, LOCAL_RESET);
        // SAFETY: a buffer the module lends for the call.
        let details = unsafe { module_bytes(details) };
        with(|envoy| envoy.resets.push(String::from_utf8(details).unwrap()));
    }

    #[no_mangle]
    extern "C" fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        _config: ConfigEnvoyPtr,
        name: ModuleBuffer,
        _labels: *mut ModuleBuffer,
        label_count: usize,
        id: *mut usize,
    ) -> i32 {
        assert_eq!(label_count, 1);
        // SAFETY: a buffer the module lends, and an id pointer valid for writes.
        let name = unsafe { module_bytes(name) };
        with(|envoy| {
            envoy.counters.push(String::from_utf8(name).unwrap());
            // SAFETY: as above. Envoy's ids start at 1.
            unsafe { *id = envoy.counters.len() };
        });
        METRICS_SUCCESS
    }

    #[no_mangle]
    extern "C" fn envoy_dynamic_module_callback_http_filter_increment_counter(
        _filter: FilterEnvoyPtr,
        id: usize,
        labels: *mut ModuleBuffer,
        label_count: usize,
        value: u64,
    ) -> i32 {
        assert_eq!(label_count, 1);
        // SAFETY: one label the module lends for the call.
        let label = unsafe { module_bytes(*labels) };
        with(|envoy| {
            envoy
                .increments
                .push((id, String::from_utf8(label).unwrap(), value))
        });
        METRICS_SUCCESS
    }

    #[no_mangle]
    extern "C" fn envoy_dynamic_module_callback_log(level: i32, message: ModuleBuffer) {
        // SAFETY: a buffer the module lends for the call.
        let message = unsafe { module_bytes(message) };
        with(|envoy| {
            envoy
                .logs
                .push((level, String::from_utf8(message).unwrap()))
        });
    }

    fn envoy_buffer(bytes: &'static [u8]) -> EnvoyBuffer {
        EnvoyBuffer {
            ptr: bytes.as_ptr().cast(),
            length: bytes.len(),
        }
    }

    fn config(text: &'static [u8]) -> ConfigModulePtr {
        envoy_dynamic_module_on_http_filter_config_new(
            ptr::null_mut(),
            envoy_buffer(b"bypass_marker"),
            envoy_buffer(text),
        )
    }

    /// A fake stream pointer: the fake keeps one stream per thread, so any non-null value does.
    const STREAM: FilterEnvoyPtr = 1 as FilterEnvoyPtr;

    #[test]
    fn program_init_returns_envoy_1_40s_abi_version() {
        // SAFETY: a static NUL-terminated string.
        let version = unsafe { CStr::from_ptr(envoy_dynamic_module_on_program_init()) };
        assert_eq!(version.to_str(), Ok("v0.2.0"));
    }

    #[test]
    fn a_bad_filter_config_is_refused_with_a_log_line_that_names_the_field() {
        assert!(config(br#"{"opt-in":"request_id"}"#).is_null());
        let logs = with(|envoy| std::mem::take(&mut envoy.logs));
        assert_eq!(logs.len(), 1);
        assert_eq!(logs[0].0, LOG_ERROR);
        assert!(logs[0].1.contains("\"opt-in\""), "{logs:?}");
    }

    #[test]
    fn a_stream_through_the_exported_hooks_has_its_marker_drained_and_counted() {
        let config = config(b"");
        assert!(!config.is_null());
        let counters = with(|envoy| envoy.counters.clone());
        assert_eq!(
            counters,
            [
                "bypass_marker_frames_removed",
                "bypass_marker_frames_forwarded",
                "bypass_marker_requests_refused"
            ]
        );
        let filter = envoy_dynamic_module_on_http_filter_new(config, STREAM);
        with(|envoy| {
            envoy.request_headers = vec![(b":method".to_vec(), b"GET".to_vec())];
            envoy.response_headers = vec![
                (b":status".to_vec(), b"200".to_vec()),
                (b"content-type".to_vec(), b"text/event-stream".to_vec()),
            ];
        });
        assert_eq!(
            envoy_dynamic_module_on_http_filter_request_headers(STREAM, filter, true),
            HEADERS_CONTINUE
        );
        assert_eq!(
            envoy_dynamic_module_on_http_filter_response_headers(STREAM, filter, false),
            HEADERS_CONTINUE
        );
        with(|envoy| {
            envoy.bodies[2] = b"event: x-bypass-remote-prefill\n: true\n\ndata: 1\n\n".to_vec()
        });
        assert_eq!(
            envoy_dynamic_module_on_http_filter_response_body(STREAM, filter, true),
            BODY_CONTINUE
        );
        assert_eq!(with(|envoy| envoy.bodies[2].clone()), b"data: 1\n\n");
        envoy_dynamic_module_on_http_filter_stream_complete(STREAM, filter);
        envoy_dynamic_module_on_http_filter_destroy(filter);
        envoy_dynamic_module_on_http_filter_config_destroy(config);
        let increments = with(|envoy| std::mem::take(&mut envoy.increments));
        assert_eq!(increments, [(1, "x-bypass-remote-prefill".to_owned(), 1)]);
    }

    /// A panic in any hook that runs the filter's code resets the stream and returns a status
    /// that lets nothing through; Envoy (here, the test) goes on.
    #[cfg(feature = "test-panic")]
    #[test]
    fn a_panic_in_a_hook_resets_the_stream_and_never_unwinds_into_envoy() {
        let config = config(b"");
        for hook in [
            "request_headers",
            "response_headers",
            "response_body",
            "response_trailers",
        ] {
            let filter = envoy_dynamic_module_on_http_filter_new(config, STREAM);
            with(|envoy| {
                *envoy = FakeEnvoy::default();
                envoy.request_headers = vec![
                    (b":method".to_vec(), b"GET".to_vec()),
                    (
                        crate::stream::TEST_PANIC_HEADER.as_bytes().to_vec(),
                        hook.as_bytes().to_vec(),
                    ),
                ];
                envoy.response_headers = vec![
                    (b":status".to_vec(), b"200".to_vec()),
                    (b"content-type".to_vec(), b"text/event-stream".to_vec()),
                ];
                envoy.bodies[2] = b"event: x-bypass-remote-prefill\n: true\n\n".to_vec();
            });
            let statuses = [
                envoy_dynamic_module_on_http_filter_request_headers(STREAM, filter, true),
                envoy_dynamic_module_on_http_filter_response_headers(STREAM, filter, false),
                envoy_dynamic_module_on_http_filter_response_body(STREAM, filter, false),
                envoy_dynamic_module_on_http_filter_response_trailers(STREAM, filter),
            ];
            envoy_dynamic_module_on_http_filter_stream_complete(STREAM, filter);
            envoy_dynamic_module_on_http_filter_destroy(filter);
            let resets = with(|envoy| envoy.resets.clone());
            assert_eq!(resets, ["bypass_marker_internal_error"], "{hook}");
            let at = [
                "request_headers",
                "response_headers",
                "response_body",
                "response_trailers",
            ]
            .iter()
            .position(|h| *h == hook)
            .unwrap();
            // From the hook that panicked on, every status stops the stream.
            for (i, status) in statuses.iter().enumerate().skip(at) {
                let stop = if i == 2 {
                    BODY_STOP_ITERATION_NO_BUFFER
                } else {
                    HEADERS_STOP_ITERATION
                };
                assert_eq!(*status, stop, "{hook}: hook {i}");
            }
            // The marker never reached the client.
            if at <= 2 {
                assert!(
                    with(|envoy| envoy.bodies[2].starts_with(b"event: x-bypass")),
                    "{hook}"
                );
            }
        }
        envoy_dynamic_module_on_http_filter_config_destroy(config);
    }
}
