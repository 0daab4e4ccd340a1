//! The sidecar's own HTTP/1.1 upstream client against hyper's: the same upstream bytes, cut into
//! the same writes, give the same verdict (`test-support/src/client.rs`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    test_support::client::check(data);
});
