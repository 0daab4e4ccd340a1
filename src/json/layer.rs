use std::fmt;
use std::sync::Arc;

use tower_layer::Layer;

use crate::config::Config;
use crate::json::{GuardBudget, JsonGuard, DEFAULT_MAX_BODY_BYTES};
use crate::BypassMarkerLayer;

/// Strips router-owned names from the `nvext.annotations` of JSON request bodies and grants the
/// client's opt-in, with the names of a [`BypassMarkerLayer`].
///
/// Made by [`BypassMarkerLayer::json_guard`]. See the [module docs](crate::json) for the rules and
/// an example.
#[derive(Clone)]
pub struct JsonGuardLayer {
    pub(crate) config: Arc<Config>,
    pub(crate) max_body_bytes: usize,
    pub(crate) budget: GuardBudget,
}

impl JsonGuardLayer {
    /// A guard with the default names ([`BypassMarkerLayer::new`]) and body limit
    /// ([`DEFAULT_MAX_BODY_BYTES`]).
    pub fn new() -> Self {
        BypassMarkerLayer::new().json_guard()
    }

    /// Caps the bytes of a JSON body the guard buffers (default [`DEFAULT_MAX_BODY_BYTES`],
    /// 32 MiB). A larger body is refused with 413: before it is read when its `content-length`
    /// says so, otherwise as soon as the bytes received pass the cap.
    #[must_use]
    pub fn max_body_bytes(mut self, max: usize) -> Self {
        self.max_body_bytes = max;
        self
    }

    /// Caps the bytes of request bodies this guard (every clone, every service it makes) holds at
    /// once, while it reads them: a new [`GuardBudget`] of `max` bytes (default
    /// [`DEFAULT_MAX_BUFFERED_BYTES`](crate::json::DEFAULT_MAX_BUFFERED_BYTES), 1 GiB). Past it,
    /// a request is answered with 503 `request_bodies_over_budget` and `Retry-After: 1`. To share
    /// one budget between several layers, give each the same [`budget`](Self::budget).
    #[must_use]
    pub fn max_buffered_bytes(self, max: u64) -> Self {
        self.budget(GuardBudget::new(max))
    }

    /// Holds the request bodies this guard reads under `budget`, which other layers given a clone
    /// of it share (see [`GuardBudget`]).
    #[must_use]
    pub fn budget(mut self, budget: GuardBudget) -> Self {
        self.budget = budget;
        self
    }

    /// The budget the bodies this guard reads are held under (read its
    /// [`held_bytes`](GuardBudget::held_bytes) for a gauge).
    pub fn guard_budget(&self) -> &GuardBudget {
        &self.budget
    }

    /// The bytes of request bodies held now under this guard's budget, by every guard that
    /// shares it.
    pub fn held_bytes(&self) -> u64 {
        self.budget.held_bytes()
    }
}

impl BypassMarkerLayer {
    /// The request-side guard for this layer's names, as middleware: see [`JsonGuardLayer`] and
    /// the [`json` module](crate::json). Needs the `json` feature.
    ///
    /// The guard keeps a copy of the configuration as it is now; names added to this layer later
    /// are not seen by a guard made before.
    #[cfg_attr(docsrs, doc(cfg(feature = "json")))]
    pub fn json_guard(&self) -> JsonGuardLayer {
        JsonGuardLayer {
            config: self.config.clone(),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            budget: GuardBudget::default(),
        }
    }
}

impl Default for JsonGuardLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for JsonGuardLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JsonGuardLayer")
            .field(
                "names",
                &BypassMarkerLayer {
                    config: self.config.clone(),
                },
            )
            .field("max_body_bytes", &self.max_body_bytes)
            .field("budget", &self.budget)
            .finish()
    }
}

impl<S> Layer<S> for JsonGuardLayer {
    type Service = JsonGuard<S>;

    fn layer(&self, inner: S) -> Self::Service {
        JsonGuard::new(inner, self.clone())
    }
}
