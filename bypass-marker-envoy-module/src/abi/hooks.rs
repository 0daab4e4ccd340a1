//! The hooks this library exports, and why each is sound.
//!
//! # The rule for re-entry
//!
//! Envoy calls a stream's hooks on its worker thread, but not always one after another: a
//! callback the filter makes can run another hook of the same stream before it returns. Seen in
//! Envoy 1.40: `reset_stream` from inside `on_http_filter_response_body` runs
//! `on_http_filter_stream_complete` (and may run `on_http_filter_destroy`); `send_response`
//! encodes the local reply, which may run this filter's response hooks. So:
//!
//! 1. No hook ever makes a `&mut Filter`. Every hook makes only a shared `&Filter` from the
//!    pointer, and the filter's mutable state sits in a [`RefCell`]: the one hook that runs the
//!    filter holds the only `&mut StreamFilter` (a `RefMut`), and a hook Envoy calls from inside
//!    it finds the cell borrowed. Two `&mut` to the same state cannot exist.
//! 2. A re-entered hook does not run the filter. It answers from what the outer hook is doing
//!    ([`Filter::replying`]): the response hooks pass this filter's own local reply (the only
//!    response Envoy encodes from inside one of its hooks); every other request or response
//!    hook stops the stream (fail closed); `stream_complete` is remembered and run by the outer
//!    hook once the filter is free.
//! 3. `on_http_filter_destroy` from inside a hook does not free the filter: it marks it, and the
//!    outermost hook frees it after its last use ([`Filter::depth`]). Envoy's side of the stream
//!    (the pointer the callbacks take) is deleted by Envoy only later, from its event loop, so
//!    the callbacks the outer hook still makes after the reset (counting, mostly) reach a live
//!    object.
//!
//! `abi/tests.rs` pins each: a fake `reset_stream` that calls `stream_complete` and `destroy` from
//! inside the hook, and a fake `send_response` that calls the response hooks.

use std::cell::{Cell, RefCell};
use std::ffi::{c_char, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;

use super::host::EnvoyStream;
use super::sys::*;
use super::{log, ModuleBuffer};
use bypass_marker_envoy_adapter::config::FilterConfig;
use bypass_marker_envoy_adapter::metrics::Counter;
use bypass_marker_envoy_adapter::stream::{
    BodyStatus, HeadersStatus, Level, StreamFilter, TrailersStatus,
};

/// A configuration Envoy loaded: the filter's, and its counters' ids.
struct ModuleConfig {
    config: FilterConfig,
    counters: [usize; Counter::ALL.len()],
}

/// One stream's state: the module pointer Envoy holds for it. Hooks only ever see it as `&Filter`
/// (the rule for re-entry, above).
pub(super) struct Filter {
    /// The per-stream layer, borrowed mutably by the one hook that runs it.
    stream: RefCell<StreamFilter>,
    counters: [usize; Counter::ALL.len()],
    /// How many hooks of this stream are running now: the outer one and those Envoy called from
    /// inside it.
    depth: Cell<u32>,
    /// The running hook is inside `send_response`: a response hook called now is for this
    /// filter's own local reply.
    pub(super) replying: Cell<bool>,
    /// `stream_complete` came while the filter was borrowed: the outer hook runs it.
    complete_pending: Cell<bool>,
    /// `destroy` came while a hook ran: the outermost hook frees the filter.
    destroy_pending: Cell<bool>,
}

#[cfg(test)]
thread_local! {
    /// Filters freed on this thread (the tests check when).
    pub(super) static FREED: Cell<usize> = const { Cell::new(0) };
}

#[cfg(test)]
thread_local! {
    /// The next filter freed on this thread panics in its `Drop` (the tests check that both ways
    /// of freeing catch it).
    pub(super) static PANIC_ON_FREE: Cell<bool> = const { Cell::new(false) };
}

#[cfg(test)]
impl Drop for Filter {
    fn drop(&mut self) {
        FREED.with(|freed| freed.set(freed.get() + 1));
        if PANIC_ON_FREE.with(|panic| panic.replace(false)) {
            panic!("a filter's Drop panicked");
        }
    }
}

/// Frees a filter, the one way both `on_http_filter_destroy` and a hook that outlived it (rule
/// 3) do: a panic in its `Drop` is caught, never unwound into Envoy (which would abort it).
///
/// # Safety
///
/// `raw` is a pointer `on_http_filter_new` returned, given back once, and no reference to the
/// filter is live or used after this call.
unsafe fn free(raw: *const Filter) {
    // SAFETY: the caller's: the pointer is a leaked `Box<Filter>` and nothing else refers to it.
    let filter = unsafe { Box::from_raw(raw.cast_mut()) };
    let _ = catch_unwind(AssertUnwindSafe(|| drop(filter)));
}

/// What a hook does when Envoy calls it from inside another hook of the stream.
#[derive(Clone, Copy)]
enum Reentry {
    /// A request hook: stop the stream.
    Stop,
    /// A response hook: pass this filter's own local reply, stop anything else.
    PassOwnReply,
    /// `stream_complete`: run it once the outer hook is done.
    Complete,
}

/// Runs a stream's hook on the filter and its host. A panic is caught and turned into a reset
/// stream (`on_panic` is then what the hook returns); a re-entered hook answers by the rule
/// above: `pass` if it may pass the filter's own reply, else `on_panic` (which stops).
fn on_stream<R>(
    envoy: FilterEnvoyPtr,
    module: FilterModulePtr,
    on_panic: R,
    reentry: (Reentry, R),
    hook: impl FnOnce(&mut StreamFilter, &mut EnvoyStream<'_>) -> R,
) -> R {
    if module.is_null() {
        return on_panic;
    }
    let raw = module.cast::<Filter>();
    // SAFETY: `module` is the pointer `on_http_filter_new` returned (a leaked `Box<Filter>`). It
    // is freed by `on_http_filter_destroy` only when no hook runs (`depth` is 0), else by the
    // outermost hook below after its last use of `filter`; so it is live here. Only shared
    // references to a `Filter` are ever made (rule 1), so this one aliases nothing mutable.
    let filter = unsafe { &*raw };
    filter.depth.set(filter.depth.get() + 1);
    let status = match filter.stream.try_borrow_mut() {
        Ok(mut stream) => {
            let mut host = EnvoyStream::new(envoy, filter.counters, &filter.replying);
            let status = match catch_unwind(AssertUnwindSafe(|| hook(&mut stream, &mut host))) {
                Ok(status) => status,
                Err(_) => {
                    // Resetting cannot panic in a way that matters; should it, nothing more is
                    // tried.
                    let _ = catch_unwind(AssertUnwindSafe(|| stream.poison(&mut host)));
                    on_panic
                }
            };
            // A `stream_complete` Envoy called from inside the hook runs now, once.
            if filter.complete_pending.replace(false) {
                let _ = catch_unwind(AssertUnwindSafe(|| stream.on_stream_complete(&mut host)));
            }
            status
        }
        // Re-entered (rule 2): the filter is the outer hook's; this hook does not touch it.
        Err(_) => match reentry {
            (Reentry::PassOwnReply, pass) if filter.replying.get() => pass,
            (Reentry::Complete, _) => {
                filter.complete_pending.set(true);
                on_panic
            }
            _ => on_panic,
        },
    };
    let depth = filter.depth.get() - 1;
    filter.depth.set(depth);
    if depth == 0 && filter.destroy_pending.get() {
        // SAFETY: Envoy destroyed the filter from inside this hook (rule 3); this is the
        // outermost hook, `filter` is not used after this line and no other reference exists.
        unsafe { free(raw) };
    }
    status
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
        let config = match FilterConfig::parse(text) {
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
        let mut counters = [0usize; Counter::ALL.len()];
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
            stream: RefCell::new(StreamFilter::new(&config.config)),
            counters: config.counters,
            depth: Cell::new(0),
            replying: Cell::new(false),
            complete_pending: Cell::new(false),
            destroy_pending: Cell::new(false),
        }))
        .cast_const()
        .cast()
    }))
    .unwrap_or(ptr::null())
}

/// Called after the stream's last hook, or (rule 3) from inside one.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_destroy(filter: FilterModulePtr) {
    if filter.is_null() {
        return;
    }
    let raw = filter.cast::<Filter>();
    {
        // SAFETY: `filter` is a pointer `on_http_filter_new` returned, not yet freed (Envoy
        // destroys a filter once); a shared reference, as every hook makes.
        let running = unsafe { &*raw };
        if running.depth.get() > 0 {
            running.destroy_pending.set(true);
            return;
        }
    }
    // SAFETY: given back once, and no hook of the stream runs, so no reference to it is live.
    unsafe { free(raw) };
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
    on_stream(
        envoy,
        module,
        HEADERS_STOP_ITERATION,
        (Reentry::Stop, HEADERS_STOP_ITERATION),
        |filter, host| headers_status(filter.on_request_headers(host, end_of_stream)),
    )
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
        (Reentry::Stop, BODY_STOP_ITERATION_NO_BUFFER),
        |filter, host| body_status(filter.on_request_body(host, end_of_stream)),
    )
}

/// The request's trailers.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    envoy: FilterEnvoyPtr,
    module: FilterModulePtr,
) -> i32 {
    on_stream(
        envoy,
        module,
        TRAILERS_STOP_ITERATION,
        (Reentry::Stop, TRAILERS_STOP_ITERATION),
        |filter, host| trailers_status(filter.on_request_trailers(host)),
    )
}

/// The response's headers.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    envoy: FilterEnvoyPtr,
    module: FilterModulePtr,
    end_of_stream: bool,
) -> i32 {
    on_stream(
        envoy,
        module,
        HEADERS_STOP_ITERATION,
        (Reentry::PassOwnReply, HEADERS_CONTINUE),
        |filter, host| headers_status(filter.on_response_headers(host, end_of_stream)),
    )
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
        (Reentry::PassOwnReply, BODY_CONTINUE),
        |filter, host| body_status(filter.on_response_body(host, end_of_stream)),
    )
}

/// The response's trailers.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    envoy: FilterEnvoyPtr,
    module: FilterModulePtr,
) -> i32 {
    on_stream(
        envoy,
        module,
        TRAILERS_STOP_ITERATION,
        (Reentry::PassOwnReply, TRAILERS_CONTINUE),
        |filter, host| trailers_status(filter.on_response_trailers(host)),
    )
}

/// The stream is over: ended, or reset by either side.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    envoy: FilterEnvoyPtr,
    module: FilterModulePtr,
) {
    on_stream(
        envoy,
        module,
        (),
        (Reentry::Complete, ()),
        |filter, host| filter.on_stream_complete(host),
    );
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
