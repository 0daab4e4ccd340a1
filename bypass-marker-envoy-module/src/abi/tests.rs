//! The hooks called as Envoy calls them, against a fake of the callbacks they use (defined here,
//! so that the test binary links without Envoy).

use std::cell::{Cell, RefCell};
use std::ffi::{c_char, CStr};
use std::ptr;

use super::hooks::*;
use super::sys::*;

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
    /// The received request chunk is the buffered body (an earlier filter buffered it).
    received_is_buffered: bool,
    /// A filter whose hooks the fake calls from inside `reset_stream`, as Envoy 1.40 does:
    /// `stream_complete`, then `destroy`.
    reenter_on_reset: Option<usize>,
    /// Filters freed when the fake's `reset_stream` returned to the module.
    freed_at_reset: Option<usize>,
    /// A filter whose response hooks the fake calls from inside `send_response` (the local reply
    /// encoded through the filter chain); their statuses.
    reenter_on_reply: Option<usize>,
    reply_statuses: Vec<i32>,
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
extern "C" fn envoy_dynamic_module_callback_http_received_buffered_request_body(
    _filter: FilterEnvoyPtr,
) -> bool {
    with(|envoy| envoy.received_is_buffered)
}

/// The body buffer a name reaches: the received request chunk is the buffered one when an
/// earlier filter buffered it, as in Envoy.
fn slot(envoy: &FakeEnvoy, body_type: i32) -> usize {
    if body_type == RECEIVED_REQUEST_BODY && envoy.received_is_buffered {
        BUFFERED_REQUEST_BODY as usize
    } else {
        body_type as usize
    }
}

#[no_mangle]
extern "C" fn envoy_dynamic_module_callback_http_get_body_size(
    _filter: FilterEnvoyPtr,
    body_type: i32,
) -> usize {
    with(|envoy| envoy.bodies[slot(envoy, body_type)].len())
}

#[no_mangle]
extern "C" fn envoy_dynamic_module_callback_http_get_body_chunks_size(
    _filter: FilterEnvoyPtr,
    body_type: i32,
) -> usize {
    with(|envoy| usize::from(!envoy.bodies[slot(envoy, body_type)].is_empty()))
}

#[no_mangle]
extern "C" fn envoy_dynamic_module_callback_http_get_body_chunks(
    _filter: FilterEnvoyPtr,
    body_type: i32,
    result: *mut EnvoyBuffer,
) -> bool {
    with(|envoy| {
        let body = &envoy.bodies[slot(envoy, body_type)];
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
        let slot = slot(envoy, body_type);
        let body = &mut envoy.bodies[slot];
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
    with(|envoy| {
        let slot = slot(envoy, body_type);
        envoy.bodies[slot].extend_from_slice(&data)
    });
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
    let reenter = with(|envoy| {
        envoy.replies.push((status, body));
        envoy.reenter_on_reply
    });
    if let Some(module) = reenter {
        // The local reply goes through the filter chain's response hooks, this filter's too.
        let module = module as FilterModulePtr;
        let statuses = [
            envoy_dynamic_module_on_http_filter_response_headers(STREAM, module, false),
            envoy_dynamic_module_on_http_filter_response_body(STREAM, module, true),
        ];
        with(|envoy| envoy.reply_statuses.extend(statuses));
    }
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
    let reenter = with(|envoy| {
        envoy.resets.push(String::from_utf8(details).unwrap());
        envoy.reenter_on_reset.take()
    });
    if let Some(module) = reenter {
        // Envoy 1.40 completes (and may destroy) the stream from inside the reset.
        let module = module as FilterModulePtr;
        envoy_dynamic_module_on_http_filter_stream_complete(STREAM, module);
        envoy_dynamic_module_on_http_filter_destroy(module);
        let freed = FREED.with(Cell::get);
        with(|envoy| envoy.freed_at_reset = Some(freed));
    }
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

/// A header list as the fake Envoy holds it.
fn head(pairs: &[(&str, &str)]) -> Vec<(Vec<u8>, Vec<u8>)> {
    pairs
        .iter()
        .map(|(name, value)| (name.as_bytes().to_vec(), value.as_bytes().to_vec()))
        .collect()
}

/// Gives the fake stream a GET whose response is an event stream.
fn event_stream(envoy: &mut FakeEnvoy) {
    envoy.request_headers = head(&[(":method", "GET")]);
    envoy.response_headers = head(&[(":status", "200"), ("content-type", "text/event-stream")]);
}

/// Runs the event stream's two heads through the hooks: both go on.
fn pass_heads(filter: FilterModulePtr) {
    assert_eq!(
        envoy_dynamic_module_on_http_filter_request_headers(STREAM, filter, true),
        HEADERS_CONTINUE,
        "request head"
    );
    assert_eq!(
        envoy_dynamic_module_on_http_filter_response_headers(STREAM, filter, false),
        HEADERS_CONTINUE,
        "response head"
    );
}

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
            "bypass_marker_requests_refused",
            "bypass_marker_encoded_streams_refused"
        ]
    );
    let filter = envoy_dynamic_module_on_http_filter_new(config, STREAM);
    with(event_stream);
    pass_heads(filter);
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
            event_stream(envoy);
            envoy.request_headers.extend(head(&[(
                bypass_marker_envoy_adapter::stream::TEST_PANIC_HEADER,
                hook,
            )]));
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

/// Issue 27, item 1, through the exported hooks: when Envoy says the received chunk is the
/// buffered body (an earlier filter buffered it), the body is read once.
#[test]
fn a_body_an_earlier_filter_buffered_is_read_once_through_the_hooks() {
    let config = config(br#"{"max-body":20}"#);
    let filter = envoy_dynamic_module_on_http_filter_new(config, STREAM);
    with(|envoy| {
        *envoy = FakeEnvoy::default();
        envoy.request_headers = head(&[(":method", "POST"), ("content-type", "application/json")]);
        envoy.bodies[BUFFERED_REQUEST_BODY as usize] = br#"{"model":"m"}"#.to_vec();
        envoy.received_is_buffered = true;
    });
    assert_eq!(
        envoy_dynamic_module_on_http_filter_request_headers(STREAM, filter, false),
        HEADERS_STOP_ITERATION
    );
    // 13 bytes under a limit of 20 (26, read twice, would be over).
    assert_eq!(
        envoy_dynamic_module_on_http_filter_request_body(STREAM, filter, true),
        BODY_CONTINUE
    );
    with(|envoy| {
        assert!(envoy.replies.is_empty(), "{:?}", envoy.replies);
        assert_eq!(
            envoy.bodies[BUFFERED_REQUEST_BODY as usize],
            br#"{"model":"m"}"#
        );
    });
    envoy_dynamic_module_on_http_filter_destroy(filter);
    envoy_dynamic_module_on_http_filter_config_destroy(config);
}

/// Issue 27, item 3: Envoy 1.40 runs `stream_complete` and may run `destroy` from inside the
/// filter's own `reset_stream`. The re-entered `stream_complete` does not run the filter while
/// the outer hook holds it (it runs once, after), and the filter is freed only when the outer
/// hook is done with it.
#[test]
fn a_stream_completed_and_destroyed_from_inside_its_reset_is_freed_after_the_hook_returns() {
    let config = config(br#"{"preset":"dynamo"}"#);
    let filter = envoy_dynamic_module_on_http_filter_new(config, STREAM);
    with(|envoy| {
        *envoy = FakeEnvoy::default();
        event_stream(envoy);
        envoy.reenter_on_reset = Some(filter as usize);
    });
    pass_heads(filter);
    // A marker frame and then a frame over the 1 MiB limit: the filter resets the stream.
    let mut body = b"event: x-bypass-remote-prefill\n: true\n\n".to_vec();
    body.extend(std::iter::repeat_n(b'x', 2 << 20));
    with(|envoy| envoy.bodies[RECEIVED_RESPONSE_BODY as usize] = body);
    let freed_before = FREED.with(Cell::get);
    assert_eq!(
        envoy_dynamic_module_on_http_filter_response_body(STREAM, filter, false),
        BODY_STOP_ITERATION_NO_BUFFER
    );
    let (resets, freed_at_reset, increments) = with(|envoy| {
        (
            envoy.resets.clone(),
            envoy.freed_at_reset,
            std::mem::take(&mut envoy.increments),
        )
    });
    assert_eq!(resets, ["bypass_marker"]);
    // Not freed while the hook that called reset_stream still ran; freed once it returned.
    assert_eq!(freed_at_reset, Some(freed_before));
    assert_eq!(FREED.with(Cell::get), freed_before + 1);
    // The marker removed before the reset is counted once.
    assert_eq!(
        increments,
        [(1, "x-bypass-remote-prefill".to_owned(), 1)],
        "{increments:?}"
    );
    envoy_dynamic_module_on_http_filter_config_destroy(config);
}

/// Issue 34, item 4: a filter freed after the hook that outlived its `destroy` (rule 3) is freed
/// as `destroy` frees one, inside `catch_unwind`: a panic in its `Drop` never unwinds into
/// Envoy (here it would abort the test binary), on either path.
#[test]
fn a_panic_freeing_a_filter_is_caught_on_both_destroy_paths() {
    let config = config(br#"{"preset":"dynamo"}"#);
    // destroy when no hook runs.
    let filter = envoy_dynamic_module_on_http_filter_new(config, STREAM);
    let freed_before = FREED.with(Cell::get);
    PANIC_ON_FREE.with(|panic| panic.set(true));
    envoy_dynamic_module_on_http_filter_destroy(filter);
    assert_eq!(FREED.with(Cell::get), freed_before + 1);
    // destroy from inside the hook's reset_stream: freed by the hook once it is done.
    let filter = envoy_dynamic_module_on_http_filter_new(config, STREAM);
    with(|envoy| {
        *envoy = FakeEnvoy::default();
        event_stream(envoy);
        envoy.reenter_on_reset = Some(filter as usize);
    });
    envoy_dynamic_module_on_http_filter_request_headers(STREAM, filter, true);
    envoy_dynamic_module_on_http_filter_response_headers(STREAM, filter, false);
    let body = vec![b'x'; 2 << 20];
    with(|envoy| envoy.bodies[RECEIVED_RESPONSE_BODY as usize] = body);
    let freed_before = FREED.with(Cell::get);
    PANIC_ON_FREE.with(|panic| panic.set(true));
    assert_eq!(
        envoy_dynamic_module_on_http_filter_response_body(STREAM, filter, false),
        BODY_STOP_ITERATION_NO_BUFFER
    );
    assert_eq!(with(|envoy| envoy.resets.clone()), ["bypass_marker"]);
    assert_eq!(FREED.with(Cell::get), freed_before + 1);
    assert!(!PANIC_ON_FREE.with(Cell::get), "the panicking Drop ran");
    envoy_dynamic_module_on_http_filter_config_destroy(config);
}

/// Issue 27, item 3: the filter's local reply may be encoded through its own response hooks
/// from inside `send_response`; they pass it without touching the filter the outer hook holds.
#[test]
fn the_filters_own_reply_passes_its_response_hooks_from_inside_send_response() {
    let config = config(b"");
    let filter = envoy_dynamic_module_on_http_filter_new(config, STREAM);
    with(|envoy| {
        *envoy = FakeEnvoy::default();
        envoy.request_headers = head(&[(":method", "POST"), ("content-type", "application/json")]);
        envoy.bodies[RECEIVED_REQUEST_BODY as usize] = br#"{"nvext":{"annotations":"x"}}"#.to_vec();
        envoy.reenter_on_reply = Some(filter as usize);
    });
    let _ = envoy_dynamic_module_on_http_filter_request_headers(STREAM, filter, false);
    assert_eq!(
        envoy_dynamic_module_on_http_filter_request_body(STREAM, filter, true),
        BODY_STOP_ITERATION_NO_BUFFER
    );
    let (replies, statuses) = with(|envoy| (envoy.replies.clone(), envoy.reply_statuses.clone()));
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].0, 400);
    assert_eq!(statuses, [HEADERS_CONTINUE, BODY_CONTINUE]);
    // A response hook Envoy called from inside another hook, for anything but the reply, stops.
    envoy_dynamic_module_on_http_filter_destroy(filter);
    envoy_dynamic_module_on_http_filter_config_destroy(config);
}
