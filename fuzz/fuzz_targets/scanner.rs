//! Differential target for the sans-IO scanner: the public `EventStreamFilter` driven over
//! fuzz-chosen chunks, with a fuzz-chosen configuration, against the reference model (extended
//! with the frame cap).
#![no_main]

use libfuzzer_sys::fuzz_target;
use test_support::fuzz::case::Case;
use test_support::fuzz::{filter, oracle};

fuzz_target!(|data: &[u8]| {
    let case = Case::decode(data);
    oracle::check_scanner(&case, filter::filter_chunks(&case));
});
