//! The sidecar's in-place `chunked` decoder: any bytes decode the same whatever the reads, and a
//! valid encoding decodes to its chunks, ending at its last byte (`fuzz/src/chunked.rs`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tower_bypass_marker_fuzz::chunked::check(data);
});
