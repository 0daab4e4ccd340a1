//! What only the fuzz targets need: the drivers of the sidecar's `chunked` decoder, of the Envoy
//! dynamic module's stream and of the proxy-wasm plugin's, and the oracle the last two share. The
//! case decoding, the oracle and the drivers that `tests/fuzz_regressions.rs` replays through too
//! live in the workspace's `test-support` crate (`test_support::fuzz`, `test_support::client`).
//! See FUZZING.md.

pub mod chunked;
pub mod host;
pub mod module;
pub mod wasm;
