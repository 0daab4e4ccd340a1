//! The real body: `BypassMarkerLayer` around a `service_fn` whose scripted body yields the fuzz
//! chunks, with empty chunks, `Pending`, trailers or an error as the input says, polled by hand.
#![no_main]

use libfuzzer_sys::fuzz_target;
use test_support::fuzz::body;
use test_support::fuzz::case::Case;

fuzz_target!(|data: &[u8]| {
    body::check_body(&Case::decode(data));
});
