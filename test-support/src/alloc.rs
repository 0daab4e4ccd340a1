//! A global allocator that counts, for the tests that pin what a path allocates.
//!
//! A test binary installs it with
//! `#[global_allocator] static ALLOCATOR: Counting = Counting;` and then reads, for its own thread,
//! the number of allocations ([`allocations`]) and the bytes asked for ([`bytes_allocated`]), or,
//! across the process, the live heap bytes and their peak ([`live`], [`peak`], [`reset_peak`]).
//! The per-thread counts let tests run in parallel; the process-wide ones need the tests to take
//! turns ([`Turn`]).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

/// The counting allocator: every call goes to [`System`] unchanged, and the counters watch.
#[derive(Debug)]
pub struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
    static BYTES: Cell<u64> = const { Cell::new(0) };
}

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn asked(bytes: usize) {
    // `try_with`: the allocator may be called while a thread is being torn down.
    let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
    let _ = BYTES.try_with(|n| n.set(n.get() + bytes as u64));
}

fn grew(by: usize) {
    let now = LIVE.fetch_add(by, Ordering::Relaxed) + by;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

fn shrank(by: usize) {
    LIVE.fetch_sub(by, Ordering::Relaxed);
}

// SAFETY: every method forwards its arguments to the system allocator unchanged and returns what
// it returned; the counters only observe, and allocate nothing themselves.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        asked(layout.size());
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, which is `System`'s.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        asked(layout.size());
        // SAFETY: as for `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        // SAFETY: `p` was allocated by this allocator, that is by `System`, with `layout`.
        unsafe { System.dealloc(p, layout) };
        shrank(layout.size());
    }

    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        asked(new_size);
        // SAFETY: `p` was allocated by `System` with `layout`; the caller upholds the rest.
        let q = unsafe { System.realloc(p, layout, new_size) };
        if !q.is_null() {
            if new_size > layout.size() {
                grew(new_size - layout.size());
            } else {
                shrank(layout.size() - new_size);
            }
        }
        q
    }
}

/// How many allocations and reallocations this thread has made.
pub fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

/// How many bytes this thread has asked for (a reallocation counts its new size).
pub fn bytes_allocated() -> u64 {
    BYTES.with(Cell::get)
}

/// The process's live heap bytes.
pub fn live() -> usize {
    LIVE.load(Ordering::SeqCst)
}

/// The most live heap bytes since the last [`reset_peak`].
pub fn peak() -> usize {
    PEAK.load(Ordering::SeqCst)
}

/// Starts a new peak at the live bytes of now.
pub fn reset_peak() {
    PEAK.store(LIVE.load(Ordering::SeqCst), Ordering::SeqCst);
}

/// One test at a time, for the process-wide counts: another test building its input would count
/// in this one's peak.
#[derive(Debug)]
pub struct Turn(Mutex<()>);

impl Turn {
    /// A turnstile for a test binary's `static`.
    pub const fn new() -> Self {
        Self(Mutex::new(()))
    }

    /// Waits for this test's turn; it lasts as long as the guard.
    pub fn take(&self) -> MutexGuard<'_, ()> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Default for Turn {
    fn default() -> Self {
        Self::new()
    }
}
