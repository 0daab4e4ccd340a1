//! The workspace's test scaffolding, in one home: what more than one test file, benchmark, example
//! or fuzz target of the workspace needs, so that each of them reads as its case. Unpublished; a
//! dev-dependency only.

#![warn(unreachable_pub)]

pub mod alloc;
pub mod clock;
