//! The JSON request guard on arbitrary bytes, in arbitrary chunks, against serde_json's `Value`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    test_support::fuzz::json::check(data);
});
