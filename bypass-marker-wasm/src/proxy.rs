//! The few proxy-wasm operations the plugin uses, as a trait: [`Hostcalls`] makes them on Envoy
//! through the `proxy-wasm` crate, and the tests and the fuzz target make them on a fake stream
//! (`fake`, with the feature of that name) that keeps Envoy's buffer semantics.

use proxy_wasm::types::{BufferType, LogLevel, MapType};

/// The proxy-wasm calls the plugin makes. Envoy answers a call it refuses with a status the
/// `proxy-wasm` crate turns into a panic, which traps the plugin: Envoy then fails the stream
/// (docs/envoy.md, "Failures").
pub trait Proxy {
    /// The bytes of a body buffer from `start` (all of them: Envoy copies them into the plugin's
    /// memory), or `None` where the buffer does not exist.
    fn get_buffer(&self, buffer: BufferType, start: usize) -> Option<Vec<u8>>;
    /// Envoy's `set_buffer`: from `start` 0, drains `size` bytes and puts `data` in front; from a
    /// `start` at or past the end, appends `data`.
    fn set_buffer(&mut self, buffer: BufferType, start: usize, size: usize, data: &[u8]);
    /// Every header of a map, in order, names in lowercase.
    fn get_headers(&self, map: MapType) -> Vec<(String, Vec<u8>)>;
    /// Sets a header to one value, or removes it (`None`).
    fn set_header(&mut self, map: MapType, name: &str, value: Option<&[u8]>);
    /// Answers the client with this response (Envoy's local reply, made after the hook returns).
    fn send_response(&mut self, status: u32, headers: &[(&str, &str)], body: &[u8]);
    /// Resets the stream (Envoy resets it after the hook returns): `response` says from which
    /// direction's hook.
    fn reset(&mut self, response: bool);
    /// Defines a counter by name; its id.
    fn define_counter(&mut self, name: &str) -> u32;
    /// Defines a gauge by name; its id.
    fn define_gauge(&mut self, name: &str) -> u32;
    /// Sets a gauge to `value` if that is more than it holds (every worker's VM writes the same
    /// gauge: it shows the largest).
    fn raise_gauge(&mut self, id: u32, value: u64);
    /// Adds to a counter.
    fn increment(&mut self, id: u32, value: u64);
    /// Writes a line to Envoy's log.
    fn log(&mut self, level: LogLevel, message: &str);
}

/// [`Proxy`] on Envoy, through the `proxy-wasm` crate's host calls.
#[derive(Debug, Default, Clone, Copy)]
pub struct Hostcalls;

impl Proxy for Hostcalls {
    fn get_buffer(&self, buffer: BufferType, start: usize) -> Option<Vec<u8>> {
        proxy_wasm::hostcalls::get_buffer(buffer, start, usize::MAX)
            .ok()
            .flatten()
    }

    fn set_buffer(&mut self, buffer: BufferType, start: usize, size: usize, data: &[u8]) {
        // A refusal panics inside the crate: the plugin traps, Envoy fails the stream.
        let _ = proxy_wasm::hostcalls::set_buffer(buffer, start, size, data);
    }

    fn get_headers(&self, map: MapType) -> Vec<(String, Vec<u8>)> {
        proxy_wasm::hostcalls::get_map_bytes(map).unwrap_or_default()
    }

    fn set_header(&mut self, map: MapType, name: &str, value: Option<&[u8]>) {
        let _ = proxy_wasm::hostcalls::set_map_value_bytes(map, name, value);
    }

    fn send_response(&mut self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
        let _ = proxy_wasm::hostcalls::send_http_response(status, headers.to_vec(), Some(body));
    }

    fn reset(&mut self, response: bool) {
        let _ = if response {
            proxy_wasm::hostcalls::reset_http_response()
        } else {
            proxy_wasm::hostcalls::reset_http_request()
        };
    }

    fn define_counter(&mut self, name: &str) -> u32 {
        // Envoy answers a refusal with a status the crate turns into a panic: there is no error
        // to map here.
        proxy_wasm::hostcalls::define_metric(proxy_wasm::types::MetricType::Counter, name)
            .unwrap_or_default()
    }

    fn define_gauge(&mut self, name: &str) -> u32 {
        proxy_wasm::hostcalls::define_metric(proxy_wasm::types::MetricType::Gauge, name)
            .unwrap_or_default()
    }

    fn raise_gauge(&mut self, id: u32, value: u64) {
        if proxy_wasm::hostcalls::get_metric(id).is_ok_and(|held| held < value) {
            let _ = proxy_wasm::hostcalls::record_metric(id, value);
        }
    }

    fn increment(&mut self, id: u32, value: u64) {
        let _ =
            proxy_wasm::hostcalls::increment_metric(id, i64::try_from(value).unwrap_or(i64::MAX));
    }

    fn log(&mut self, level: LogLevel, message: &str) {
        let _ = proxy_wasm::hostcalls::log(level, message);
    }
}
