//! The raw declarations of Envoy's dynamic-module ABI that this module uses, as
//! `source/extensions/dynamic_modules/abi/abi.h` declares them (docs/envoy.md's versions table
//! says which header each Envoy release was checked against): types, constants and the callbacks
//! of Envoy's, and nothing else. No logic lives here; `abi/host.rs` calls the callbacks and
//! `abi/hooks.rs` defines the hooks Envoy calls.

use std::ffi::{c_char, c_void, CStr};

/// The ABI version this module is written against: Envoy 1.40's.
pub(super) const ABI_VERSION: &CStr = c"v0.2.0";

/// `envoy_dynamic_module_type_envoy_buffer`: bytes Envoy owns.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct EnvoyBuffer {
    pub(super) ptr: *const c_char,
    pub(super) length: usize,
}

/// `envoy_dynamic_module_type_module_buffer`: bytes the module owns, lent for one call.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct ModuleBuffer {
    pub(super) ptr: *const c_char,
    pub(super) length: usize,
}

/// `envoy_dynamic_module_type_module_http_header`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct ModuleHttpHeader {
    pub(super) key_ptr: *const c_char,
    pub(super) key_length: usize,
    pub(super) value_ptr: *const c_char,
    pub(super) value_length: usize,
}

pub(super) type ConfigEnvoyPtr = *mut c_void;
pub(super) type ConfigModulePtr = *const c_void;
pub(super) type FilterEnvoyPtr = *mut c_void;
pub(super) type FilterModulePtr = *const c_void;

// Enums are C `int`s.
/// `envoy_dynamic_module_type_http_header_type`.
pub(super) const REQUEST_HEADER: i32 = 0;
pub(super) const RESPONSE_HEADER: i32 = 2;
/// `envoy_dynamic_module_type_http_body_type`.
pub(super) const RECEIVED_REQUEST_BODY: i32 = 0;
pub(super) const BUFFERED_REQUEST_BODY: i32 = 1;
pub(super) const RECEIVED_RESPONSE_BODY: i32 = 2;
pub(super) const BUFFERED_RESPONSE_BODY: i32 = 3;
/// `envoy_dynamic_module_type_log_level`.
pub(super) const LOG_INFO: i32 = 2;
pub(super) const LOG_WARN: i32 = 3;
pub(super) const LOG_ERROR: i32 = 4;
/// `envoy_dynamic_module_type_http_filter_stream_reset_reason`: `LocalReset`.
pub(super) const LOCAL_RESET: i32 = 0;
/// `envoy_dynamic_module_type_metrics_result`: `Success`.
pub(super) const METRICS_SUCCESS: i32 = 0;
/// The hooks' statuses.
pub(super) const HEADERS_CONTINUE: i32 = 0;
pub(super) const HEADERS_STOP_ITERATION: i32 = 1;
pub(super) const BODY_CONTINUE: i32 = 0;
pub(super) const BODY_STOP_ITERATION_AND_BUFFER: i32 = 1;
pub(super) const BODY_STOP_ITERATION_NO_BUFFER: i32 = 3;
pub(super) const TRAILERS_CONTINUE: i32 = 0;
pub(super) const TRAILERS_STOP_ITERATION: i32 = 1;

extern "C" {
    pub(super) fn envoy_dynamic_module_callback_http_get_header(
        filter_envoy_ptr: FilterEnvoyPtr,
        header_type: i32,
        key: ModuleBuffer,
        result_buffer: *mut EnvoyBuffer,
        index: usize,
        optional_size: *mut usize,
    ) -> bool;
    pub(super) fn envoy_dynamic_module_callback_http_set_header(
        filter_envoy_ptr: FilterEnvoyPtr,
        header_type: i32,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;
    pub(super) fn envoy_dynamic_module_callback_http_received_buffered_request_body(
        filter_envoy_ptr: FilterEnvoyPtr,
    ) -> bool;
    pub(super) fn envoy_dynamic_module_callback_http_get_body_size(
        filter_envoy_ptr: FilterEnvoyPtr,
        body_type: i32,
    ) -> usize;
    pub(super) fn envoy_dynamic_module_callback_http_get_body_chunks_size(
        filter_envoy_ptr: FilterEnvoyPtr,
        body_type: i32,
    ) -> usize;
    pub(super) fn envoy_dynamic_module_callback_http_get_body_chunks(
        filter_envoy_ptr: FilterEnvoyPtr,
        body_type: i32,
        result_buffer_vector: *mut EnvoyBuffer,
    ) -> bool;
    pub(super) fn envoy_dynamic_module_callback_http_drain_body(
        filter_envoy_ptr: FilterEnvoyPtr,
        body_type: i32,
        number_of_bytes: usize,
    ) -> bool;
    pub(super) fn envoy_dynamic_module_callback_http_append_body(
        filter_envoy_ptr: FilterEnvoyPtr,
        body_type: i32,
        data: ModuleBuffer,
    ) -> bool;
    pub(super) fn envoy_dynamic_module_callback_http_send_response(
        filter_envoy_ptr: FilterEnvoyPtr,
        status_code: u32,
        headers_vector: *mut ModuleHttpHeader,
        headers_vector_size: usize,
        body: ModuleBuffer,
        details: ModuleBuffer,
    );
    pub(super) fn envoy_dynamic_module_callback_http_filter_reset_stream(
        filter_envoy_ptr: FilterEnvoyPtr,
        reason: i32,
        details: ModuleBuffer,
    );
    pub(super) fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        filter_config_envoy_ptr: ConfigEnvoyPtr,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        counter_id_ptr: *mut usize,
    ) -> i32;
    pub(super) fn envoy_dynamic_module_callback_http_filter_increment_counter(
        filter_envoy_ptr: FilterEnvoyPtr,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> i32;
    pub(super) fn envoy_dynamic_module_callback_log(level: i32, message: ModuleBuffer);
}
