//! [`GuardBudget`]: a cap on the request body bytes held, at once, by every guard that shares it.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The default [`GuardBudget`] of a [`JsonGuardLayer`](crate::json::JsonGuardLayer): 1 GiB.
///
/// That is 32 bodies of [`DEFAULT_MAX_BODY_BYTES`](crate::json::DEFAULT_MAX_BODY_BYTES) (32
/// MiB) at once, the `bypass-marker` sidecar's budget when its process has no cgroup memory limit.
/// A library cannot read the memory of the process it runs in, so the default is a number: size
/// it to what the gateway may spend on request bodies, for example half its container's memory
/// limit, which is what the sidecar takes by default. The guard also copies a body of several
/// chunks into one buffer while it judges it, for a moment, so at the peak the bodies being judged
/// may take up to twice the bytes the budget counts.
pub const DEFAULT_MAX_BUFFERED_BYTES: u64 = 1 << 30;

/// The body size up to which a body may use the last eighth of a [`GuardBudget`] (64 KiB: a
/// chat request with a long conversation fits).
pub const SMALL_BODY_BYTES: u64 = 64 * 1024;

/// A cap on the bytes of request bodies held in memory at once by the guards that share it: the
/// chunks each guard has buffered so far of the bodies it is reading. Clones share one count.
///
/// Every [`JsonGuardLayer`](crate::json::JsonGuardLayer) has one
/// ([`DEFAULT_MAX_BUFFERED_BYTES`] unless set), shared by its clones and by every service it
/// makes. Several layers (two routers, a guard per listener) share one by being given the same
/// budget with [`JsonGuardLayer::budget`](crate::json::JsonGuardLayer::budget): the memory they
/// spend is the process's, whichever layer spends it.
///
/// A body takes its bytes as they arrive (a declared `content-length` reserves nothing) and gives
/// them all back when it has been judged (forwarded or refused) or its future is dropped. A piece
/// that would take the total past the budget ends the read: the request is answered with 503
/// `request_bodies_over_budget` and `Retry-After: 1`, as `bypass-marker`'s
/// `--max-buffered-bytes` answers. The last eighth of the budget is kept for small bodies: a body
/// past [`SMALL_BODY_BYTES`] may fill the budget only to seven eighths, so that a few large
/// uploads never stop a chat request of a few kilobytes.
///
/// ```
/// use tower_bypass_marker::json::{GuardBudget, JsonGuardLayer};
///
/// // One budget for two guards (say, two listeners): 512 MiB of request bodies in all.
/// let budget = GuardBudget::new(512 << 20);
/// let public = JsonGuardLayer::new().budget(budget.clone());
/// let internal = JsonGuardLayer::new().max_body_bytes(64 << 20).budget(budget.clone());
/// assert_eq!(budget.held_bytes(), 0);
/// # let _ = (public, internal);
/// ```
#[derive(Clone)]
pub struct GuardBudget(Arc<Shared>);

struct Shared {
    limit: u64,
    held: AtomicU64,
}

impl GuardBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: u64) -> Self {
        Self(Arc::new(Shared {
            limit,
            held: AtomicU64::new(0),
        }))
    }

    /// A budget that never refuses.
    pub fn unlimited() -> Self {
        Self::new(u64::MAX)
    }

    /// The budget, in bytes.
    pub fn limit(&self) -> u64 {
        self.0.limit
    }

    /// The bytes held now by the bodies being read.
    pub fn held_bytes(&self) -> u64 {
        self.0.held.load(Ordering::Acquire)
    }

    /// Whether a body of `n` bytes could be held at all, alone in the budget (seven eighths of it
    /// once the body is over [`SMALL_BODY_BYTES`]).
    pub fn fits(&self, n: u64) -> bool {
        n <= cap(self.0.limit, n)
    }

    /// A new, empty charge for one request body, for hosts that read bodies themselves.
    pub fn charge(&self) -> BudgetCharge {
        BudgetCharge {
            budget: self.clone(),
            held: 0,
        }
    }
}

impl Default for GuardBudget {
    /// A budget of [`DEFAULT_MAX_BUFFERED_BYTES`].
    fn default() -> Self {
        Self::new(DEFAULT_MAX_BUFFERED_BYTES)
    }
}

impl fmt::Debug for GuardBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuardBudget")
            .field("limit", &self.limit())
            .field("held", &self.held_bytes())
            .finish()
    }
}

/// The bytes one request body holds of a [`GuardBudget`]; given back when dropped.
#[derive(Debug)]
pub struct BudgetCharge {
    budget: GuardBudget,
    held: u64,
}

impl BudgetCharge {
    /// Takes `n` more bytes for this body. `false` (and nothing taken) when they would take the
    /// total past the budget: past seven eighths of it once this body is over
    /// [`SMALL_BODY_BYTES`], past the whole budget while it is not.
    pub fn take(&mut self, n: u64) -> bool {
        if n == 0 {
            return true;
        }
        let shared = &self.budget.0;
        let mine = self.held.saturating_add(n);
        let cap = cap(shared.limit, mine);
        let taken = shared
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(n).filter(|&total| total <= cap)
            });
        if taken.is_ok() {
            self.held = mine;
        }
        taken.is_ok()
    }

    /// Brings this body's bytes to `n`: takes what it lacks, as [`take`](Self::take) does (`false`
    /// and nothing taken past the budget), or gives back what it holds beyond `n` (always `true`).
    pub fn set(&mut self, n: u64) -> bool {
        match n.checked_sub(self.held) {
            Some(more) => self.take(more),
            None => {
                let less = self.held - n;
                self.held = n;
                self.budget.0.held.fetch_sub(less, Ordering::AcqRel);
                true
            }
        }
    }

    /// The bytes this body holds.
    pub fn held_bytes(&self) -> u64 {
        self.held
    }

    /// The budget this charge takes from.
    pub fn budget(&self) -> &GuardBudget {
        &self.budget
    }

    /// Gives every byte back now (as dropping does).
    pub fn release(&mut self) {
        let held = std::mem::take(&mut self.held);
        if held > 0 {
            self.budget.0.held.fetch_sub(held, Ordering::AcqRel);
        }
    }
}

impl Drop for BudgetCharge {
    fn drop(&mut self) {
        self.release();
    }
}

/// The most bytes the budget may hold once a body holds `mine`: all of it while the body is
/// small, seven eighths after.
fn cap(limit: u64, mine: u64) -> u64 {
    if mine <= SMALL_BODY_BYTES {
        limit
    } else {
        limit - limit / 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Large bodies fill the budget to seven eighths; a small one still fits after them, and what
    /// is dropped is given back.
    #[test]
    fn large_bodies_leave_the_last_eighth_to_small_ones() {
        let budget = GuardBudget::new(8 * SMALL_BODY_BYTES);
        let mut a = budget.charge();
        assert!(a.take(7 * SMALL_BODY_BYTES));
        let mut b = budget.charge();
        assert!(!b.take(SMALL_BODY_BYTES + 1));
        assert_eq!(b.held_bytes(), 0);
        assert!(
            b.take(SMALL_BODY_BYTES),
            "a small body may use the last eighth"
        );
        assert!(
            !b.take(1),
            "now over the small size, so capped at seven eighths"
        );
        drop(a);
        assert_eq!(budget.held_bytes(), SMALL_BODY_BYTES);
        drop(b);
        assert_eq!(budget.held_bytes(), 0);
        let tiny = GuardBudget::new(800);
        let mut c = tiny.charge();
        assert!(c.take(800));
        assert!(!tiny.charge().take(1));
    }

    /// `set` takes what a body lacks and gives back what it holds beyond the new size; `fits`
    /// says whether a body could ever be held.
    #[test]
    fn set_moves_a_charge_to_a_size_either_way() {
        let budget = GuardBudget::new(8 * SMALL_BODY_BYTES);
        let mut a = budget.charge();
        assert!(a.set(3 * SMALL_BODY_BYTES));
        assert!(a.set(SMALL_BODY_BYTES));
        assert_eq!(
            (a.held_bytes(), budget.held_bytes()),
            (SMALL_BODY_BYTES, SMALL_BODY_BYTES)
        );
        assert!(!a.set(8 * SMALL_BODY_BYTES), "past seven eighths");
        assert_eq!(a.held_bytes(), SMALL_BODY_BYTES, "nothing taken");
        assert!(a.set(0));
        assert_eq!(budget.held_bytes(), 0);
        assert!(budget.fits(7 * SMALL_BODY_BYTES));
        assert!(!budget.fits(7 * SMALL_BODY_BYTES + 1));
    }
}
