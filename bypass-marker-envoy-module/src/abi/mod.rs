//! Envoy's dynamic-module ABI, in the layout of a -sys crate: all of the package's `unsafe` code
//! is under this directory, in three files that each do one thing.
//!
//! - `sys.rs`: the raw declarations, checked against `source/extensions/dynamic_modules/abi/abi.h`
//!   of each Envoy release (docs/envoy.md's versions table): types, constants, Envoy's
//!   callbacks. No logic.
//! - `hooks.rs`: the hooks this library exports, and the argument that each is sound, including
//!   when Envoy calls a hook of the stream from inside another (re-entry).
//! - `host.rs`: [`Host`](bypass_marker_envoy_adapter::stream::Host) on Envoy's callbacks.
//!
//! Across the three:
//!
//! - The ABI version returned is Envoy 1.40's, `v0.2.0`. Envoy 1.38 and 1.39 expect `v0.1.0` and
//!   only warn on a mismatch; the declarations used here are the same in all three.
//! - Envoy resolves every symbol when it loads the module, so only callbacks that 1.38.3, 1.39.3
//!   and 1.40.0 all export are referenced (`log`, not 1.40's `log_v2`), and every hook Envoy
//!   looks up for an HTTP filter is exported, the ones the filter does not use included
//!   (`tests/envoy/module.sh` loads the module in all three).
//! - Every hook that runs the filter's code catches a panic: the stream is reset (the client sees
//!   a broken stream, never an unfiltered or a clean-looking truncated one), its later hooks let
//!   nothing through, and Envoy goes on serving. Nothing unwinds into Envoy. This relies on the
//!   default `panic = "unwind"`.

#![allow(unsafe_code)]
// The hooks are `pub` for the dynamic symbol table, not for Rust callers, and take the ABI's
// private types.
#![allow(unreachable_pub, private_interfaces)]

use std::ptr;

use bypass_marker_envoy_adapter::stream::Level;

mod hooks;
mod host;
mod sys;
#[cfg(test)]
mod tests;

use sys::*;

impl ModuleBuffer {
    fn new(bytes: &[u8]) -> Self {
        Self {
            ptr: bytes.as_ptr().cast(),
            length: bytes.len(),
        }
    }

    /// A null buffer: "no value" where Envoy takes one (a header to remove).
    const NULL: Self = Self {
        ptr: ptr::null(),
        length: 0,
    };
}

impl EnvoyBuffer {
    const EMPTY: Self = Self {
        ptr: ptr::null(),
        length: 0,
    };

    /// The bytes, borrowed for `'a`.
    ///
    /// # Safety
    ///
    /// Envoy must keep them valid and unchanged for `'a`.
    unsafe fn bytes<'a>(self) -> &'a [u8] {
        if self.ptr.is_null() || self.length == 0 {
            return &[];
        }
        // SAFETY: a non-null buffer from Envoy points at `length` initialised bytes, valid for
        // `'a` by this function's contract.
        unsafe { std::slice::from_raw_parts(self.ptr.cast(), self.length) }
    }
}

fn log(level: Level, message: &str) {
    let level = match level {
        Level::Info => LOG_INFO,
        Level::Warn => LOG_WARN,
        Level::Error => LOG_ERROR,
    };
    // SAFETY: `message` outlives the call; Envoy copies it. The callback may be called on any
    // thread.
    unsafe { envoy_dynamic_module_callback_log(level, ModuleBuffer::new(message.as_bytes())) }
}
