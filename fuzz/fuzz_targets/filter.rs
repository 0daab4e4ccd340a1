//! Differential target for the public sans-IO filter: `EventStreamFilter` against the tower body
//! it drives, for the same response head, opt-in and chunks (same bytes after every chunk, same
//! end, same `FrameTooLarge`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tower_bypass_marker_fuzz::case::Case;
use tower_bypass_marker_fuzz::filter;

fuzz_target!(|data: &[u8]| {
    filter::check_filter(&Case::decode(data));
});
