//! The real body: `BypassMarkerLayer` around a `service_fn` whose scripted body yields the fuzz
//! chunks, with empty chunks, `Pending`, trailers or an error as the input says, polled by hand;
//! then the same response head and chunks through the sans-IO `GatewayExchange`, as an Envoy host
//! drives it. Both under the case's status (200, 204, 304, HEAD) and codings.
#![no_main]

use libfuzzer_sys::fuzz_target;
use test_support::fuzz::case::Case;
use test_support::fuzz::{body, exchange};

fuzz_target!(|data: &[u8]| {
    let case = Case::decode(data);
    body::check_body(&case);
    exchange::check_exchange(&case);
});
