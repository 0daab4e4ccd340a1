//! The filter's counters, in Envoy's stats: what the sidecar's metrics count, under the same
//! names as far as Envoy's stat naming allows.
//!
//! The filter core reports frames to a [`FrameObserver`] as it decides them, without the stream at
//! hand. [`Tally`] keeps those reports in a per-thread list (Envoy runs each stream's hooks on one
//! worker thread, one hook at a time), and the hook that made them hands them to Envoy's counters
//! before it returns ([`take`]).

use std::cell::RefCell;

use tower_bypass_marker::FrameObserver;

/// `bypass_marker_frames_removed{annotation}`: annotation frames removed, per configured name.
pub const FRAMES_REMOVED: &str = "bypass_marker_frames_removed";
/// `bypass_marker_frames_forwarded{annotation}`: annotation frames forwarded to a client that
/// opted in.
pub const FRAMES_FORWARDED: &str = "bypass_marker_frames_forwarded";
/// `bypass_marker_requests_refused{status}`: requests the filter answered itself.
pub const REQUESTS_REFUSED: &str = "bypass_marker_requests_refused";
/// `bypass_marker_encoded_streams_refused{coding}`: event streams the upstream sent in a content
/// coding the filter cannot read, answered with a 502 instead because something would have had to
/// be removed for the client. `coding` is the first coding other than `identity`, one of `gzip`,
/// `deflate`, `br`, `zstd`, `compress`, or `other` (so the upstream cannot grow the series).
pub const ENCODED_STREAMS_REFUSED: &str = "bypass_marker_encoded_streams_refused";
/// The counters' label names, in the order of the four names above.
pub const LABELS: [&str; 4] = ["annotation", "annotation", "status", "coding"];

/// The `annotation` label of frames that `sdk-safe` removed without a configured name (the
/// sidecar's empty label, which Envoy's stat names cannot carry).
pub const SDK_SAFE_LABEL: &str = "sdk-safe";

/// Which counter a count is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    /// [`FRAMES_REMOVED`].
    FramesRemoved,
    /// [`FRAMES_FORWARDED`].
    FramesForwarded,
    /// [`REQUESTS_REFUSED`].
    RequestsRefused,
    /// [`ENCODED_STREAMS_REFUSED`].
    EncodedStreamsRefused,
}

impl Counter {
    /// Every counter, in the order they are defined.
    pub const ALL: [Counter; 4] = [
        Counter::FramesRemoved,
        Counter::FramesForwarded,
        Counter::RequestsRefused,
        Counter::EncodedStreamsRefused,
    ];

    /// The counter's stat name.
    pub fn name(self) -> &'static str {
        match self {
            Counter::FramesRemoved => FRAMES_REMOVED,
            Counter::FramesForwarded => FRAMES_FORWARDED,
            Counter::RequestsRefused => REQUESTS_REFUSED,
            Counter::EncodedStreamsRefused => ENCODED_STREAMS_REFUSED,
        }
    }

    /// The counter's one label.
    pub fn label(self) -> &'static str {
        LABELS[self as usize]
    }
}

/// The [`FrameObserver`] of every layer the module builds: counts go to this thread's list.
#[derive(Debug, Clone, Copy)]
pub struct Tally;

thread_local! {
    /// Counts not yet handed to Envoy: (counter, label, count). Entries stay once made (their
    /// count back at 0), so a thread allocates only for the names it has not seen yet.
    static PENDING: RefCell<Vec<(Counter, String, u64)>> = const { RefCell::new(Vec::new()) };
}

fn add(counter: Counter, label: &str) {
    PENDING.with(|pending| {
        let mut pending = pending.borrow_mut();
        match pending
            .iter_mut()
            .find(|(c, l, _)| *c == counter && l == label)
        {
            Some(entry) => entry.2 += 1,
            None => pending.push((counter, label.to_owned(), 1)),
        }
    });
}

impl FrameObserver for Tally {
    fn frame_removed(&self, annotation: Option<&str>, _bytes: usize) {
        add(Counter::FramesRemoved, annotation.unwrap_or(SDK_SAFE_LABEL));
    }

    fn frame_forwarded(&self, annotation: &str) {
        add(Counter::FramesForwarded, annotation);
    }
}

/// Hands this thread's counts to `f` (counter, label, count) and forgets them.
pub fn take(mut f: impl FnMut(Counter, &str, u64)) {
    PENDING.with(|pending| {
        for (counter, label, count) in pending.borrow_mut().iter_mut() {
            if *count > 0 {
                f(*counter, label, std::mem::take(count));
            }
        }
    });
}

/// Counts a refusal on this thread, as the observer counts frames.
pub fn refused(status: u16) {
    let mut digits = [0u8; 3];
    let label = status_label(status, &mut digits);
    add(Counter::RequestsRefused, label);
}

/// Counts an encoded event stream refused, by the first coding other than `identity` in
/// `content-encoding` (its values as the response has them).
pub fn encoded_refused<'a>(content_encoding: impl IntoIterator<Item = &'a [u8]>) -> &'static str {
    let first = content_encoding
        .into_iter()
        .flat_map(|value| value.split(|&b| b == b','))
        .map(|coding| coding.trim_ascii())
        .find(|coding| !coding.is_empty() && !coding.eq_ignore_ascii_case(b"identity"))
        .unwrap_or_default();
    let label = ["gzip", "deflate", "br", "zstd", "compress"]
        .into_iter()
        .find(|known| first.eq_ignore_ascii_case(known.as_bytes()))
        .unwrap_or("other");
    add(Counter::EncodedStreamsRefused, label);
    label
}

fn status_label(status: u16, digits: &mut [u8; 3]) -> &str {
    let status = status.min(999);
    digits[0] = b'0' + (status / 100) as u8;
    digits[1] = b'0' + (status / 10 % 10) as u8;
    digits[2] = b'0' + (status % 10) as u8;
    std::str::from_utf8(digits).unwrap_or("0")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_wait_for_take_and_go_once() {
        take(|_, _, _| {});
        Tally.frame_removed(Some("x-bypass-remote-prefill"), 40);
        Tally.frame_removed(Some("x-bypass-remote-prefill"), 40);
        Tally.frame_removed(None, 10);
        Tally.frame_forwarded("request_id");
        refused(413);
        let mut seen = Vec::new();
        take(|counter, label, n| seen.push((counter, label.to_owned(), n)));
        seen.sort_by(|a, b| a.1.cmp(&b.1));
        assert_eq!(
            seen,
            [
                (Counter::RequestsRefused, "413".to_owned(), 1),
                (Counter::FramesForwarded, "request_id".to_owned(), 1),
                (Counter::FramesRemoved, "sdk-safe".to_owned(), 1),
                (
                    Counter::FramesRemoved,
                    "x-bypass-remote-prefill".to_owned(),
                    2
                ),
            ]
        );
        take(|counter, label, n| panic!("{counter:?} {label} {n} counted twice"));
    }
}
