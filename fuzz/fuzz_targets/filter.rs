//! Differential target for the public sans-IO filter: `EventStreamFilter` against the tower body
//! it drives, for the same response head, opt-in and chunks (same bytes after every chunk, same
//! end, same `FrameTooLarge`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use test_support::fuzz::case::Case;
use test_support::fuzz::filter;

fuzz_target!(|data: &[u8]| {
    filter::check_filter(&Case::decode(data));
});
