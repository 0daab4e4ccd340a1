//! A limit on log lines that clients can cause: at most one a period, with a count of those held
//! back. Its own module, below both the configuration that owns one and the stream that uses it.

/// At most one log line per period; how many were held back in between. The refusals' lines,
/// which any client can cause, go at most once a minute, as the processor's: one limit per
/// configuration ([`FilterConfig::refusal_lines`](crate::config::FilterConfig::refusal_lines): per filter
/// configuration in the dynamic module, per VM in the proxy-wasm plugin), each line saying how
/// many refusals went unlogged since the one before. `bypass_marker_requests_refused` counts every
/// one.
#[derive(Debug)]
pub struct LogLimit {
    period: u64,
    /// The second (of the Unix epoch) from which the next line may go.
    next: std::sync::atomic::AtomicU64,
    /// Lines held back since the last one.
    held: std::sync::atomic::AtomicU64,
}

impl LogLimit {
    /// One line per `period` seconds.
    pub const fn new(period: u64) -> Self {
        Self {
            period,
            next: std::sync::atomic::AtomicU64::new(0),
            held: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// At second `now`: `Some(held back since the last line)` if a line may go, else `None`
    /// (and this one is held back).
    pub fn admit(&self, now: u64) -> Option<u64> {
        use std::sync::atomic::Ordering::Relaxed;
        let next = self.next.load(Relaxed);
        if now >= next
            && self
                .next
                .compare_exchange(next, now + self.period, Relaxed, Relaxed)
                .is_ok()
        {
            return Some(self.held.swap(0, Relaxed));
        }
        self.held.fetch_add(1, Relaxed);
        None
    }
}
