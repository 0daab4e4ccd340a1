//! What the fuzz targets (fuzz/, see FUZZING.md) and `tests/fuzz_regressions.rs` share: decoding a
//! fuzz input into a case, the oracle, and the drivers of the tower body, of the public sans-IO
//! filter and (feature `json`) of the request guard and the gateway exchange. The targets replay through these, and so do
//! the regression tests, so a finding and its test cannot drift apart.

pub mod body;
pub mod case;
#[cfg(feature = "json")]
pub mod exchange;
pub mod filter;
#[cfg(feature = "json")]
pub mod json;
pub mod oracle;
