//! The client's opt-in: [`RequestedAnnotations`] and its iterators.
//!
//! The layer forwards a frame of an opt-in name only to a client whose [`RequestedAnnotations`]
//! holds that name, in the request's or the response's extensions: only application code puts it
//! there. With the `json` feature, `JsonGuardLayer` does it from the request body; without it, the
//! handler that parses the request does, with
//! [`BypassMarkerLayer::guard_annotations`](crate::BypassMarkerLayer::guard_annotations).
//!
//! # A handler that parses the request itself
//!
//! A handler that parses the request itself can run the client's `nvext.annotations` through the
//! layer's guard with a typed request, and return what the client may see as a response extension:
//!
//! ```rust
//! use axum::{Extension, Json};
//! use serde::{Deserialize, Serialize};
//! use serde_json::{Map, Value};
//! use tower_bypass_marker::{BypassMarkerLayer, RequestedAnnotations};
//!
//! #[derive(Deserialize, Serialize)]
//! struct ChatRequest {
//!     model: String,
//!     nvext: Option<NvExt>,
//!     #[serde(flatten)]
//!     rest: Map<String, Value>,
//! }
//!
//! #[derive(Deserialize, Serialize)]
//! struct NvExt {
//!     #[serde(default)]
//!     annotations: Vec<String>,
//!     #[serde(flatten)]
//!     rest: Map<String, Value>,
//! }
//!
//! async fn chat_completions(
//!     Extension(layer): Extension<BypassMarkerLayer>,
//!     Json(mut request): Json<ChatRequest>,
//! ) -> (Extension<RequestedAnnotations>, String) {
//!     let granted = match &mut request.nvext {
//!         Some(nvext) => layer.guard_annotations(&mut nvext.annotations),
//!         None => RequestedAnnotations::new(),
//!     };
//!     // ... send `request` to the router and stream its `text/event-stream` response back ...
//!     (Extension(granted), String::new())
//! }
//! # fn app() -> axum::Router {
//! #     let layer = BypassMarkerLayer::new().opt_in("request_id");
//! #     axum::Router::new()
//! #         .route("/v1/chat/completions", axum::routing::post(chat_completions))
//! #         .layer(layer.clone())
//! #         .layer(Extension(layer))
//! # }
//! ```
//!
//! A body whose `nvext` or `annotations` has another type is refused by `Json` (422) before the
//! handler runs. (`Extension(layer)` works when the same `BypassMarkerLayer` is also added with
//! `.layer(Extension(layer.clone()))`.) An outer middleware that knows the opt-in earlier can insert
//! a [`RequestedAnnotations`] into the request's extensions instead; the union of both counts.

use std::collections::btree_set;
use std::collections::BTreeSet;
use std::fmt;
use std::iter::FusedIterator;

/// The annotations a client asked for, and is allowed, in its request's `nvext.annotations`.
///
/// [`BypassMarker`](crate::BypassMarker) reads it from the request's extensions when it is called
/// and from the response's extensions when the response head arrives; the union is the client's
/// opt-in. Frames of an opt-in name in this set are forwarded to the client; never-forwarded names
/// are removed whatever this set says.
///
/// Build one with [`BypassMarkerLayer::guard_annotations`](crate::BypassMarkerLayer::guard_annotations),
/// which also strips router-owned names from the request (see the [module docs](self) for a
/// handler that does), or collect one from names the application grants:
///
/// ```
/// use tower_bypass_marker::{RequestedAnnotations, BYPASS_REMOTE_PREFILL};
///
/// let requested: RequestedAnnotations = ["request_id", BYPASS_REMOTE_PREFILL].into_iter().collect();
/// assert!(requested.contains("request_id"));
/// assert_eq!(requested.len(), 2);
/// ```
///
/// It is a set of strings compared byte for byte: two sets with the same names are equal (and
/// hash alike) whatever order the names were added in. The layer matches its names against the
/// configured ones in any ASCII case, as it compares names everywhere (an opt-in of `Request_ID`
/// forwards `request_id` frames); the JSON guard grants a client only the configured names it
/// listed exactly, as Dynamo matches them. Adding, looking up and removing a name
/// take O(log n) comparisons, so collecting a client's list of n names directly costs
/// O(n log n). Iteration is in byte order of the names, not in insertion order.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct RequestedAnnotations {
    names: BTreeSet<Box<str>>,
}

impl RequestedAnnotations {
    /// An empty set: the client opted in to nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `name`; returns `false` if it was already there.
    pub fn insert(&mut self, name: &str) -> bool {
        if self.contains(name) {
            return false;
        }
        self.names.insert(name.into())
    }

    /// Whether the client asked for `name` (compared byte for byte).
    pub fn contains(&self, name: &str) -> bool {
        self.names.contains(name)
    }

    /// Removes `name`; returns whether it was there.
    pub fn remove(&mut self, name: &str) -> bool {
        self.names.remove(name)
    }

    /// The names, in byte order.
    pub fn iter(&self) -> Iter<'_> {
        Iter(self.names.iter())
    }

    /// How many names there are.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }
}

impl fmt::Debug for RequestedAnnotations {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.iter()).finish()
    }
}

impl<'a> Extend<&'a str> for RequestedAnnotations {
    fn extend<I: IntoIterator<Item = &'a str>>(&mut self, iter: I) {
        for name in iter {
            self.insert(name);
        }
    }
}

impl Extend<String> for RequestedAnnotations {
    fn extend<I: IntoIterator<Item = String>>(&mut self, iter: I) {
        // An owned name is moved into the set, not copied.
        self.names
            .extend(iter.into_iter().map(String::into_boxed_str));
    }
}

impl<'a> FromIterator<&'a str> for RequestedAnnotations {
    fn from_iter<I: IntoIterator<Item = &'a str>>(iter: I) -> Self {
        let mut set = Self::new();
        set.extend(iter);
        set
    }
}

impl FromIterator<String> for RequestedAnnotations {
    fn from_iter<I: IntoIterator<Item = String>>(iter: I) -> Self {
        let mut set = Self::new();
        set.extend(iter);
        set
    }
}

impl<'a> IntoIterator for &'a RequestedAnnotations {
    type Item = &'a str;
    type IntoIter = Iter<'a>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl IntoIterator for RequestedAnnotations {
    type Item = String;
    type IntoIter = IntoIter;

    /// The names, owned, in byte order.
    fn into_iter(self) -> Self::IntoIter {
        IntoIter(self.names.into_iter())
    }
}

/// The names of a [`RequestedAnnotations`], borrowed, in byte order.
///
/// Made by [`RequestedAnnotations::iter`].
#[derive(Debug, Clone)]
pub struct Iter<'a>(btree_set::Iter<'a, Box<str>>);

impl<'a> Iterator for Iter<'a> {
    type Item = &'a str;

    fn next(&mut self) -> Option<&'a str> {
        self.0.next().map(|n| &**n)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.0.size_hint()
    }
}

impl DoubleEndedIterator for Iter<'_> {
    fn next_back(&mut self) -> Option<Self::Item> {
        self.0.next_back().map(|n| &**n)
    }
}

impl ExactSizeIterator for Iter<'_> {}

impl FusedIterator for Iter<'_> {}

/// The names of a [`RequestedAnnotations`], owned, in byte order.
///
/// Made by its [`IntoIterator`] implementation.
#[derive(Debug)]
pub struct IntoIter(btree_set::IntoIter<Box<str>>);

impl Iterator for IntoIter {
    type Item = String;

    fn next(&mut self) -> Option<String> {
        self.0.next().map(String::from)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.0.size_hint()
    }
}

impl DoubleEndedIterator for IntoIter {
    fn next_back(&mut self) -> Option<String> {
        self.0.next_back().map(String::from)
    }
}

impl ExactSizeIterator for IntoIter {}

impl FusedIterator for IntoIter {}
