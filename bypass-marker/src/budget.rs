//! [`BodyBudget`]: a process-wide cap on the request body bytes the JSON guard holds in memory,
//! shared by every stream (and every thread) of `bypass-marker proxy` or `ext-proc`.
//!
//! `--max-body` bounds one request; nothing else bounds their sum: forty clients that each send
//! all but the last bytes of a 30 MiB body would make the process hold 1.2 GB. The proxy takes a
//! request's bytes from the budget before they are read (its declared `content-length`, or each
//! piece of a body of unknown length as it arrives); the processor takes only the bytes it holds,
//! as they arrive (Envoy holds a buffered body until it sends it, so a declared length reserves
//! nothing there). Both give them back when the body has been forwarded or refused. A request
//! that would take the total past the budget is refused with a 503 and `Retry-After` (the
//! processor's is Envoy's local reply) before more of it is read.
//!
//! The last eighth of the budget is kept for small requests: a request whose body is past
//! [`SMALL_BODY_BYTES`] may fill the budget only to seven eighths, so a few large uploads that
//! fill it never stop a chat request of a few kilobytes from being answered.
//!
//! The accounting is the library's [`GuardBudget`], the budget of its
//! [`JsonGuardLayer`](tower_bypass_marker::JsonGuardLayer), with the same rule; this type adds the
//! count of refusals and their logging.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tower_bypass_marker::json::{BudgetCharge, GuardBudget};

/// The body size up to which a request may use the last eighth of the budget (64 KiB: a chat
/// request with a long conversation fits).
pub use tower_bypass_marker::json::SMALL_BODY_BYTES;

/// A process-wide budget of request body bytes held in memory; clones share it.
///
/// ```
/// use bypass_marker::budget::BodyBudget;
///
/// let budget = BodyBudget::new(8 << 20);
/// let mut first = budget.charge();
/// assert!(first.take(6 << 20));
/// let mut second = budget.charge();
/// assert!(!second.take(2 << 20), "past seven eighths for a large body");
/// assert!(second.take(1000), "a small body may use the last eighth");
/// drop(first);
/// assert_eq!(budget.held(), 1000);
/// ```
#[derive(Clone)]
pub struct BodyBudget(Arc<Shared>);

struct Shared {
    budget: GuardBudget,
    refused: AtomicU64,
    /// When a refusal was last logged, and how many were refused then ([`BodyBudget::should_log`]).
    logged: Mutex<Option<(Instant, u64)>>,
}

impl BodyBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: u64) -> Self {
        Self(Arc::new(Shared {
            budget: GuardBudget::new(limit),
            refused: AtomicU64::new(0),
            logged: Mutex::new(None),
        }))
    }

    /// A budget that never refuses (the default of [`ExtProc`](crate::envoy::ExtProc) built in
    /// code: a library does not guess the process's memory).
    pub fn unlimited() -> Self {
        Self::new(u64::MAX)
    }

    /// The budget, in bytes.
    pub fn limit(&self) -> u64 {
        self.0.budget.limit()
    }

    /// The bytes held now.
    pub fn held(&self) -> u64 {
        self.0.budget.held_bytes()
    }

    /// Whether a body of `n` bytes could be held at all, alone in the budget (the cap
    /// [`Charge::take`] applies to it: seven eighths of the budget once it is over
    /// [`SMALL_BODY_BYTES`]).
    pub fn fits(&self, n: u64) -> bool {
        self.0.budget.fits(n)
    }

    /// Requests refused so far.
    pub fn refused(&self) -> u64 {
        self.0.refused.load(Ordering::Relaxed)
    }

    /// A new, empty charge for one request body.
    pub fn charge(&self) -> Charge {
        Charge {
            inner: self.0.budget.charge(),
            budget: self.clone(),
        }
    }

    /// Counts a refusal; returns the refusals since the last time it returned `Some`, at most once
    /// a minute, so that a flood of refusals is one log line a minute.
    pub fn refusal(&self) -> Option<u64> {
        let total = self.0.refused.fetch_add(1, Ordering::Relaxed) + 1;
        self.should_log(total, Duration::from_secs(60))
    }

    fn should_log(&self, total: u64, every: Duration) -> Option<u64> {
        let mut logged = self.0.logged.lock().unwrap_or_else(|e| e.into_inner());
        match *logged {
            Some((at, _)) if at.elapsed() < every => None,
            last => {
                *logged = Some((Instant::now(), total));
                Some(total - last.map_or(0, |(_, n)| n))
            }
        }
    }
}

impl fmt::Debug for BodyBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BodyBudget")
            .field("limit", &self.limit())
            .field("held", &self.held())
            .finish()
    }
}

/// The bytes one request body holds of a [`BodyBudget`]; given back when dropped.
#[derive(Debug)]
pub struct Charge {
    inner: BudgetCharge,
    budget: BodyBudget,
}

impl Charge {
    /// Takes `n` more bytes for this body. `false` (and nothing taken) when they would take the
    /// total past the budget: past seven eighths of it once this body is over
    /// [`SMALL_BODY_BYTES`], past the whole budget while it is not.
    pub fn take(&mut self, n: u64) -> bool {
        self.inner.take(n)
    }

    /// Brings this body's bytes to `n`: takes what it lacks, as [`take`](Self::take) does (`false`
    /// and nothing taken past the budget), or gives back what it holds beyond `n` (always `true`).
    pub fn set(&mut self, n: u64) -> bool {
        self.inner.set(n)
    }

    /// The bytes this body holds.
    pub fn held(&self) -> u64 {
        self.inner.held_bytes()
    }

    /// The budget this charge takes from.
    pub fn budget(&self) -> &BodyBudget {
        &self.budget
    }

    /// Gives every byte back now (as dropping does).
    pub fn release(&mut self) {
        self.inner.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The accounting itself (the last eighth for small bodies, `set`, `fits`) is the library's
    // `GuardBudget`'s, tested there (src/json/budget.rs).

    /// Refusals are logged once a minute, with the count since the last line.
    #[test]
    fn refusals_are_logged_at_most_once_a_minute() {
        let budget = BodyBudget::new(0);
        assert_eq!(budget.refusal(), Some(1));
        assert_eq!(budget.refusal(), None);
        assert_eq!(budget.refusal(), None);
        assert_eq!(budget.should_log(4, Duration::ZERO), Some(3));
        assert_eq!(budget.refused(), 3);
    }
}
