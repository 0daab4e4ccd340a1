//! Shared by the fuzz targets and by `tests/fuzz_regressions.rs`: decoding a fuzz input into a
//! case, the oracle, and the body driver. See FUZZING.md.

#[path = "../../tests/model/mod.rs"]
pub mod model;

pub mod body;
pub mod case;
pub mod chunked;
pub mod client;
pub mod filter;
pub mod json;
pub mod module;
pub mod oracle;
pub mod wasm;
