//! No silent hang where Envoy withholds the body of a held request head.
//!
//! The plugin holds a request's head until the guard has judged the body (`request-head: held`,
//! the default). Envoy lets a proxy-wasm plugin do that and still calls its body hooks only where
//! the plugin's configuration sets `allow_on_headers_stop_iteration: true` (Envoy 1.35 and later);
//! without it Envoy makes the held head `StopAllIterationAndWatermark`, the body hooks never come,
//! and the request waits in silence until Envoy's `stream_idle_timeout` (docs/envoy.md, "Holding
//! the request head"). Envoy does not tell the plugin whether the setting is there, so the root
//! context watches: each held head ([`HeldHeads::held`]) that gets no body hook within
//! [`HELD_HEAD_BOUND_SECS`] is answered with a 500 naming the setting ([`TIMED_OUT_BODY`]), and an
//! error line naming it goes to Envoy's log (the first of each VM at once, then at most one a
//! minute). The first body hook after a held head ([`HeldHeads::body`]) proves the setting is there
//! for this configuration (Envoy applies it to the whole plugin): from then on the VM watches
//! nothing, so a slow client is never cut short where Envoy is set up right.

use std::collections::BTreeMap;
use std::collections::BTreeSet;

use bypass_marker_envoy_adapter::log_limit::LogLimit;
use proxy_wasm::types::LogLevel;

use crate::proxy::Proxy;

/// How long a held head may wait for its first body hook, until the VM has seen one: 10 s.
pub const HELD_HEAD_BOUND_SECS: u64 = 10;

/// How often the root context looks at the held heads while it watches: every second.
pub const TICK_SECS: u64 = 1;

/// The local reply to a held head that no body hook followed: OpenAI-shaped, naming the setting
/// and the alternative.
pub const TIMED_OUT_BODY: &str = concat!(
    r#"{"error":{"message":"bypass_marker: the request head was held for the guard and no request "#,
    r#"body reached the plugin within 10 s. Envoy withholds the body from a proxy-wasm plugin that "#,
    r#"holds the head unless the plugin's configuration sets allow_on_headers_stop_iteration: true "#,
    r#"(Envoy 1.35 and later): set it, or give the plugin's configuration \"request-head\": "#,
    r#"\"forwarded\" where the setting cannot be reached (Istio, Envoy Gateway)","#,
    r#""type":"server_error","param":null,"code":"allow_on_headers_stop_iteration"}}"#
);

/// The held heads of one VM (one root context), by HTTP context id.
#[derive(Debug)]
pub struct HeldHeads {
    /// Context id to the second (of the Unix epoch) its head was held.
    waiting: BTreeMap<u32, u64>,
    /// Streams this watch answered: their hooks pass the plugin's own reply untouched.
    answered: BTreeSet<u32>,
    /// A body hook came after a held head: Envoy has the setting for this configuration.
    proven: bool,
    lines: LogLimit,
    /// Local replies sent, for the log line.
    replies: u64,
}

impl Default for HeldHeads {
    fn default() -> Self {
        Self {
            waiting: BTreeMap::new(),
            answered: BTreeSet::new(),
            proven: false,
            lines: LogLimit::new(60),
            replies: 0,
        }
    }
}

impl HeldHeads {
    /// Stream `id` held its head at second `now`, waiting for its body.
    pub fn held(&mut self, id: u32, now: u64) {
        if !self.proven {
            self.waiting.insert(id, now);
        }
    }

    /// Stream `id` got a body hook: Envoy calls the body hooks of a held head, so the setting is
    /// there and nothing needs watching any more.
    pub fn body(&mut self, id: u32) {
        if self.waiting.remove(&id).is_some() {
            self.proven = true;
            self.waiting.clear();
        }
    }

    /// Stream `id` is over.
    pub fn done(&mut self, id: u32) {
        self.waiting.remove(&id);
        self.answered.remove(&id);
    }

    /// Whether this watch answered stream `id` (its hooks must let that reply through).
    pub fn answered(&self, id: u32) -> bool {
        self.answered.contains(&id)
    }

    /// Whether the setting has been seen to be there.
    pub fn proven(&self) -> bool {
        self.proven
    }

    /// Whether the root context still needs its tick: heads are waiting.
    pub fn watching(&self) -> bool {
        !self.waiting.is_empty()
    }

    /// The root context's tick at second `now`: every head held longer than the bound is
    /// answered with the 500. `enter(id)` makes stream `id` the one `proxy` answers (Envoy's
    /// `set_effective_context`); the log line goes through `proxy` too.
    pub fn tick(&mut self, now: u64, proxy: &mut impl Proxy, mut enter: impl FnMut(u32)) {
        let expired: Vec<u32> = self
            .waiting
            .iter()
            .filter(|&(_, &since)| now.saturating_sub(since) >= HELD_HEAD_BOUND_SECS)
            .map(|(&id, _)| id)
            .collect();
        for id in expired {
            self.waiting.remove(&id);
            self.answered.insert(id);
            self.replies += 1;
            if let Some(held) = self.lines.admit(now) {
                let since = if held > 0 {
                    format!(" ({held} more since the last such line, not logged)")
                } else {
                    String::new()
                };
                proxy.log(
                    LogLevel::Error,
                    &format!(
                        "bypass_marker: a request head held for the guard got no body within \
                         {HELD_HEAD_BOUND_SECS} s: Envoy is not calling the plugin's body hooks, \
                         which it does only where the plugin's configuration sets \
                         allow_on_headers_stop_iteration: true (Envoy 1.35 and later). Set it, or \
                         set \"request-head\": \"forwarded\" in the plugin's configuration. \
                         Answered 500{since} (logged at most once a minute)"
                    ),
                );
            }
            enter(id);
            proxy.send_response(
                500,
                &[("content-type", "application/json")],
                TIMED_OUT_BODY.as_bytes(),
            );
        }
    }
}
