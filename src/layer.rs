use std::fmt;
use std::sync::Arc;

use tower_layer::Layer;

use crate::{BypassMarker, RequestedAnnotations, BYPASS_REMOTE_PREFILL};

/// The most annotation names one layer can be configured with.
pub const MAX_NAMES: usize = 64;

/// The default cap on the bytes held for one frame that spans body chunks: 1 MiB.
pub const DEFAULT_MAX_FRAME_BYTES: usize = 1024 * 1024;

/// What happens when a frame that spans chunks grows past
/// [`BypassMarkerLayer::max_frame_bytes`].
///
/// See the [module docs](crate) for the trade-off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Overflow {
    /// Forward the frame as it arrives, unfiltered (the held bytes first). Annotation frames are a
    /// few dozen bytes, so a frame this large is data, not an annotation. The default.
    #[default]
    Forward,
    /// Fail the response body with a [`FrameTooLarge`](crate::FrameTooLarge) error.
    Error,
}

/// What a response does with frames of a configured annotation name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Removed unless the client opted in.
    OptIn,
    /// Always removed.
    NeverForward,
}

#[derive(Debug, Clone)]
pub(crate) struct Name {
    pub(crate) name: Box<str>,
    pub(crate) kind: Kind,
    /// Set by the router itself: the guard strips it from the client's annotations.
    pub(crate) router_owned: bool,
}

/// The layer's configuration, shared by every service, future and body it makes.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) names: Vec<Name>,
    pub(crate) max_frame_bytes: usize,
    pub(crate) on_overflow: Overflow,
    pub(crate) sdk_safe: bool,
    /// Finds `event:`, built once per layer rather than once per chunk.
    pub(crate) event_finder: memchr::memmem::Finder<'static>,
    /// How many bytes of a line the scanner needs to tell whether it is an `event` field naming a
    /// configured name.
    pub(crate) line_cap: usize,
}

impl Config {
    fn new() -> Self {
        let mut config = Self {
            names: Vec::new(),
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            on_overflow: Overflow::default(),
            sdk_safe: false,
            event_finder: memchr::memmem::Finder::new(crate::scan::EVENT_FIELD).into_owned(),
            line_cap: 0,
        };
        config.set(BYPASS_REMOTE_PREFILL, Some(Kind::OptIn), true);
        config
    }

    /// Adds `name`, or updates it: `kind` (when given) replaces the old one, `router_owned` is
    /// never taken back.
    fn set(&mut self, name: &str, kind: Option<Kind>, router_owned: bool) {
        assert!(
            !name.is_empty() && !name.contains(['\r', '\n']),
            "annotation names must be non-empty and free of CR and LF, got {name:?}"
        );
        if let Some(existing) = self.names.iter_mut().find(|n| &*n.name == name) {
            existing.kind = kind.unwrap_or(existing.kind);
            existing.router_owned |= router_owned;
            return;
        }
        assert!(
            self.names.len() < MAX_NAMES,
            "a BypassMarkerLayer takes at most {MAX_NAMES} annotation names"
        );
        self.names.push(Name {
            name: name.into(),
            kind: kind.unwrap_or(Kind::OptIn),
            router_owned,
        });
        let longest = self.names.iter().map(|n| n.name.len()).max().unwrap_or(0);
        // "event: " + the name; never less than "data:" plus a byte.
        self.line_cap = (b"event: ".len() + longest).max(8);
    }

    /// The names to remove from a response to a client that asked for `requested` (bit `i` for
    /// `names[i]`).
    pub(crate) fn removal_mask(&self, requested: u64) -> u64 {
        let mut mask = 0;
        for (i, n) in self.names.iter().enumerate() {
            let bit = 1 << i;
            if n.kind == Kind::NeverForward || requested & bit == 0 {
                mask |= bit;
            }
        }
        mask
    }

    /// The bits of the configured names in `requested`.
    pub(crate) fn requested_mask(&self, requested: &RequestedAnnotations) -> u64 {
        let mut mask = 0;
        for (i, n) in self.names.iter().enumerate() {
            if requested.contains(&n.name) {
                mask |= 1 << i;
            }
        }
        mask
    }

    /// The index of the name in `mask` that `value` is, if any.
    pub(crate) fn find(&self, value: &[u8], mask: u64) -> Option<u8> {
        self.names
            .iter()
            .enumerate()
            .find(|(i, n)| mask & (1 << i) != 0 && n.name.as_bytes() == value)
            .map(|(i, _)| i as u8)
    }
}

/// Removes router-internal annotation frames from `text/event-stream` responses unless the client
/// opted in.
///
/// See the [module docs](crate) for an example and the exact rules.
#[derive(Clone)]
pub struct BypassMarkerLayer {
    pub(crate) config: Arc<Config>,
}

impl BypassMarkerLayer {
    /// The default layer: frames whose event type is [`BYPASS_REMOTE_PREFILL`] are removed unless
    /// the client opted in; frames spanning chunks are held up to 1 MiB, then forwarded.
    pub fn new() -> Self {
        Self {
            config: Arc::new(Config::new()),
        }
    }

    fn with(mut self, f: impl FnOnce(&mut Config)) -> Self {
        f(Arc::make_mut(&mut self.config));
        self
    }

    /// Also removes frames whose event type is `name` (for example `request_id`) unless the client
    /// opted in. The guard leaves `name` in the request's annotations, so the router still sees
    /// the request for it.
    ///
    /// # Panics
    ///
    /// When `name` is empty or holds a CR or LF, or when the layer would know more than
    /// [`MAX_NAMES`] names.
    #[must_use]
    pub fn opt_in(self, name: &str) -> Self {
        self.with(|c| c.set(name, Some(Kind::OptIn), false))
    }

    /// Adds a router-owned marker like [`BYPASS_REMOTE_PREFILL`]: removed unless the client opted
    /// in (or always, if it is also [never-forwarded](Self::never_forward)), and stripped from the client's annotations by [`guard_annotations`] in every form
    /// (`name`, `name:value`, any ASCII case, surrounding spaces), so clients cannot set it.
    ///
    /// # Panics
    ///
    /// As for [`opt_in`](Self::opt_in).
    ///
    /// [`guard_annotations`]: Self::guard_annotations
    #[must_use]
    pub fn router_owned(self, name: &str) -> Self {
        self.with(|c| c.set(name, None, true))
    }

    /// Always removes frames whose event type is `name` (for example `llm_metrics`), even for a
    /// client that asked for it. A name configured before becomes never-forwarded,
    /// [`BYPASS_REMOTE_PREFILL`] included; a router-owned name stays router-owned, so the guard
    /// still strips it from requests.
    ///
    /// # Panics
    ///
    /// As for [`opt_in`](Self::opt_in).
    #[must_use]
    pub fn never_forward(self, name: &str) -> Self {
        self.with(|c| c.set(name, Some(Kind::NeverForward), false))
    }

    /// Caps the bytes held for one frame that spans body chunks (default 1 MiB). Past the cap,
    /// [`on_overflow`](Self::on_overflow) decides.
    #[must_use]
    pub fn max_frame_bytes(self, max: usize) -> Self {
        self.with(|c| c.max_frame_bytes = max)
    }

    /// What happens to a frame that outgrows [`max_frame_bytes`](Self::max_frame_bytes). Default:
    /// [`Overflow::Forward`].
    #[must_use]
    pub fn on_overflow(self, overflow: Overflow) -> Self {
        self.with(|c| c.on_overflow = overflow)
    }

    /// SDK-safe mode (off by default): also removes every frame that has field lines but no `data`
    /// field. Browsers never dispatch such frames and the OpenAI SDKs crash on them. Comment-only
    /// frames, such as `:\n\n` keep-alives, are kept.
    #[must_use]
    pub fn sdk_safe(self, enabled: bool) -> Self {
        self.with(|c| c.sdk_safe = enabled)
    }

    /// The request-side guard, for a handler that has parsed the client's `nvext.annotations`.
    ///
    /// Removes from `annotations` every entry that names a router-owned marker (such as
    /// [`BYPASS_REMOTE_PREFILL`]) in any form (`name` or `name:value`, any ASCII case, surrounding
    /// spaces), so a client cannot make the router take a path it reserves for itself. Returns the
    /// opt-in the client is allowed: each configured opt-in or router-owned name it listed exactly
    /// (bare, as written), never a never-forwarded one. Entries the layer does not know stay in the
    /// list and are not part of the opt-in.
    ///
    /// Put the result in the response's extensions (or the request's, before this layer's service
    /// is called) and the layer forwards those frames to this client.
    pub fn guard_annotations(&self, annotations: &mut Vec<String>) -> RequestedAnnotations {
        let mut granted = RequestedAnnotations::new();
        annotations.retain(|entry| {
            let exact = self.config.names.iter().find(|n| *n.name == **entry);
            if let Some(n) = exact {
                if n.kind != Kind::NeverForward {
                    granted.insert(&n.name);
                }
            }
            !self.names_router_owned(entry)
        });
        granted
    }

    fn names_router_owned(&self, entry: &str) -> bool {
        let name = entry.split(':').next().unwrap_or(entry).trim();
        self.config
            .names
            .iter()
            .any(|n| n.router_owned && n.name.eq_ignore_ascii_case(name))
    }
}

impl Default for BypassMarkerLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for BypassMarkerLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = |keep: fn(&Name) -> bool| {
            self.config
                .names
                .iter()
                .filter(move |n| keep(n))
                .map(|n| &*n.name)
                .collect::<Vec<_>>()
        };
        f.debug_struct("BypassMarkerLayer")
            .field("router_owned", &names(|n| n.router_owned))
            .field("opt_in", &names(|n| n.kind == Kind::OptIn))
            .field("never_forward", &names(|n| n.kind == Kind::NeverForward))
            .field("max_frame_bytes", &self.config.max_frame_bytes)
            .field("on_overflow", &self.config.on_overflow)
            .field("sdk_safe", &self.config.sdk_safe)
            .finish()
    }
}

impl<S> Layer<S> for BypassMarkerLayer {
    type Service = BypassMarker<S>;

    fn layer(&self, inner: S) -> Self::Service {
        BypassMarker::new(inner, self.config.clone())
    }
}
