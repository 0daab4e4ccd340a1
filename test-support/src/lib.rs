//! The workspace's test scaffolding, in one home: what more than one test file, benchmark, example
//! or fuzz target of the workspace needs, so that each of them reads as its case. Unpublished; a
//! dev-dependency only.
//!
//! What needs a feature of another package of the workspace is behind a feature of this crate
//! (`json`, `sidecar`), and so are the modules that need a runtime or a server (`serve`, `logs`), so that a test of the library without `json` still sees it without.

pub mod alloc;
pub mod body;
pub mod clock;
pub mod fuzz;
pub mod model;
pub mod rng;

#[cfg(feature = "bench")]
pub mod bench;
#[cfg(feature = "sidecar")]
pub mod client;
#[cfg(feature = "logs")]
pub mod logs;
#[cfg(feature = "serve")]
pub mod serve;
