//! What the examples and tests that use the simulated router share, by role.
//!
//! - [`router`]: the simulated Dynamo-like router, its app and a way to serve it in the background;
//! - [`client`]: HTTP client helpers that call it and take its event streams apart.

// Each example and test that includes these modules uses a different part of them.
#[allow(dead_code)]
pub(crate) mod client;
#[allow(dead_code)]
pub(crate) mod router;
