//! The Envoy dynamic module's per-stream layer against the tower body.
#![no_main]

use libfuzzer_sys::fuzz_target;
use test_support::fuzz::case::Case;
use tower_bypass_marker_fuzz::module;

fuzz_target!(|data: &[u8]| {
    module::check_module(&Case::decode(data));
});
