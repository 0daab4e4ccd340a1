//! The proxy-wasm plugin's body path against the tower body.
#![no_main]

use libfuzzer_sys::fuzz_target;
use test_support::fuzz::case::Case;
use tower_bypass_marker_fuzz::wasm;

fuzz_target!(|data: &[u8]| {
    wasm::check_wasm(&Case::decode(data));
});
