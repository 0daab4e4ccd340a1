use std::fmt;

/// The annotations a client asked for, and is allowed, in its request's `nvext.annotations`.
///
/// [`BypassMarker`](crate::BypassMarker) reads it from the request's extensions when it is called
/// and from the response's extensions when the response head arrives; the union is the client's
/// opt-in. Frames of an opt-in name in this set are forwarded to the client; never-forwarded names
/// are removed whatever this set says.
///
/// Build one with [`BypassMarkerLayer::guard_annotations`](crate::BypassMarkerLayer::guard_annotations),
/// which also strips router-owned names from the request, or collect one from names the
/// application grants:
///
/// ```
/// use tower_bypass_marker::{RequestedAnnotations, BYPASS_REMOTE_PREFILL};
///
/// let requested: RequestedAnnotations = ["request_id", BYPASS_REMOTE_PREFILL].into_iter().collect();
/// assert!(requested.contains("request_id"));
/// assert_eq!(requested.len(), 2);
/// ```
#[derive(Clone, Default, PartialEq, Eq)]
pub struct RequestedAnnotations {
    names: Vec<Box<str>>,
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
        self.names.push(name.into());
        true
    }

    /// Whether the client asked for `name` (compared byte for byte).
    pub fn contains(&self, name: &str) -> bool {
        self.names.iter().any(|n| **n == *name)
    }

    /// Removes `name`; returns whether it was there.
    pub fn remove(&mut self, name: &str) -> bool {
        let before = self.names.len();
        self.names.retain(|n| **n != *name);
        self.names.len() != before
    }

    /// The names, in the order they were first added.
    pub fn iter(&self) -> impl Iterator<Item = &str> + '_ {
        self.names.iter().map(|n| &**n)
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
        for name in iter {
            self.insert(&name);
        }
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
    type IntoIter = Box<dyn Iterator<Item = &'a str> + 'a>;

    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}
