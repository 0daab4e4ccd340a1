//! Differential target for the sans-IO scanner: the scanner driven over fuzz-chosen chunks, with a
//! fuzz-chosen configuration, against the reference model (extended with the frame cap).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tower_bypass_marker_fuzz::case::Case;
use tower_bypass_marker_fuzz::oracle;

fuzz_target!(|data: &[u8]| {
    let case = Case::decode(data);
    let got = tower_bypass_marker::__fuzz::filter_chunks(
        &case.layer(),
        &case.requested(),
        &case.chunks(),
    );
    oracle::check_scanner(&case, got);
});
