//! The configuration itself: the annotation names and what each one is, the masks and lookups the
//! scanner and the guards use, and the limits.
//!
//! Nothing here builds a configuration for users (that is [`BypassMarkerLayer`]'s job) and nothing
//! here knows about bodies, futures or HTTP: the scanner and the guards depend on this file, and it
//! depends on nothing above it.
//!
//! [`BypassMarkerLayer`]: crate::BypassMarkerLayer

use std::fmt;

use crate::annotations::RequestedAnnotations;
use crate::observe::Observer;

/// The event type Dynamo's router gives the frame it prepends when it bypasses remote prefill.
pub const BYPASS_REMOTE_PREFILL: &str = "x-bypass-remote-prefill";

/// The most annotation names one layer can be configured with.
pub const MAX_NAMES: usize = 64;

/// The longest annotation name a layer accepts, in bytes.
///
/// Annotation names are short identifiers (Dynamo's longest is 23 bytes). The bound also caps the
/// prefix of a line the scanner keeps when a line spans body chunks: `event: ` plus the longest
/// configured name, at most 263 bytes.
pub const MAX_NAME_LEN: usize = 256;

/// The default cap on the bytes held for one frame that spans body chunks: 1 MiB.
pub const DEFAULT_MAX_FRAME_BYTES: usize = 1024 * 1024;

/// The bytes every `event` field line with a non-empty value starts with.
pub(crate) const EVENT_FIELD: &[u8] = b"event:";

/// An annotation name that a [`BypassMarkerLayer`](crate::BypassMarkerLayer) cannot accept, or
/// one name too many.
///
/// Returned by the fallible setters ([`try_opt_in`](crate::BypassMarkerLayer::try_opt_in),
/// [`try_router_owned`](crate::BypassMarkerLayer::try_router_owned),
/// [`try_never_forward`](crate::BypassMarkerLayer::try_never_forward)); the other setters panic
/// with its message. A name is accepted when it is non-empty, at most [`MAX_NAME_LEN`] bytes long,
/// holds no `:` and no control character (CR and LF included), and neither starts nor ends with
/// whitespace. Those are exactly the names the request guard can recognise in every form it strips
/// (`name`, `name:value`, any ASCII case, surrounding whitespace).
///
/// ```
/// use tower_bypass_marker::{BypassMarkerLayer, InvalidNameKind};
///
/// let err = BypassMarkerLayer::new().try_opt_in("x-route:hint").unwrap_err();
/// assert_eq!(err.kind(), InvalidNameKind::Colon);
/// assert_eq!(err.name(), "x-route:hint");
///
/// // Names are compared in any ASCII case: a second spelling of a configured name is refused.
/// let layer = BypassMarkerLayer::new().opt_in("Request_Id");
/// let err = layer.try_never_forward("request_id").unwrap_err();
/// assert_eq!(err.kind(), InvalidNameKind::CaseConflict);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidName {
    name: String,
    reason: InvalidNameKind,
}

/// Why a name was refused: [`InvalidName::kind`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum InvalidNameKind {
    /// The name is empty.
    Empty,
    /// The name is longer than [`MAX_NAME_LEN`] bytes.
    TooLong,
    /// The name holds a `:`, which separates a name from its value in a client's annotations.
    Colon,
    /// The name holds a control character (CR and LF included).
    ControlCharacter,
    /// The name starts or ends with whitespace.
    Whitespace,
    /// The layer already knows [`MAX_NAMES`] names.
    TooMany,
    /// The layer knows this name in another ASCII case (`Request_Id` and `request_id`): names are
    /// compared in any case by [`role`](crate::BypassMarkerLayer::role) and the guard, so two
    /// spellings could not have two roles. The same spelling again updates the name instead.
    CaseConflict,
}

impl InvalidName {
    /// The name that was refused.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Why it was refused.
    pub fn kind(&self) -> InvalidNameKind {
        self.reason
    }
}

impl fmt::Display for InvalidName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = &self.name;
        match self.reason {
            InvalidNameKind::Empty => write!(f, "annotation name is empty"),
            InvalidNameKind::TooLong => write!(
                f,
                "annotation name is {} bytes long, more than {MAX_NAME_LEN}",
                name.len()
            ),
            InvalidNameKind::Colon => write!(f, "annotation name {name:?} contains ':'"),
            InvalidNameKind::ControlCharacter => {
                write!(f, "annotation name {name:?} contains a control character")
            }
            InvalidNameKind::Whitespace => {
                write!(f, "annotation name {name:?} starts or ends with whitespace")
            }
            InvalidNameKind::TooMany => write!(
                f,
                "cannot add annotation name {name:?}: a layer takes at most {MAX_NAMES} names"
            ),
            InvalidNameKind::CaseConflict => write!(
                f,
                "annotation name {name:?} is configured already in another ASCII case"
            ),
        }
    }
}

impl std::error::Error for InvalidName {}

/// Checks `name` against the rules of [`InvalidName`].
pub(crate) fn validate_name(name: &str) -> Result<(), InvalidName> {
    let reason = if name.is_empty() {
        InvalidNameKind::Empty
    } else if name.len() > MAX_NAME_LEN {
        InvalidNameKind::TooLong
    } else if name.contains(':') {
        InvalidNameKind::Colon
    } else if name.chars().any(char::is_control) {
        InvalidNameKind::ControlCharacter
    } else if name.starts_with(char::is_whitespace) || name.ends_with(char::is_whitespace) {
        InvalidNameKind::Whitespace
    } else {
        return Ok(());
    };
    Err(InvalidName {
        name: name.to_owned(),
        reason,
    })
}

/// What happens when a frame that spans chunks grows past
/// [`BypassMarkerLayer::max_frame_bytes`](crate::BypassMarkerLayer::max_frame_bytes).
///
/// The trade-off: `Forward` keeps a long data frame flowing but lets an oversized annotation frame
/// through unfiltered; `Error` never lets one through but fails the stream. See [latency, copies
/// and memory](crate::BypassMarkerBody#latency-copies-and-memory) and the layer's [security
/// model](crate::BypassMarkerLayer#security-model).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Overflow {
    /// Forward the frame as it arrives, unfiltered (the held bytes first). Routing markers are a
    /// few dozen bytes, so a frame this large is data, not a marker. The default.
    #[default]
    Forward,
    /// Fail the response body with a [`FrameTooLarge`](crate::FrameTooLarge) error.
    Error,
}

/// What the JSON guard (feature `json`) does with a request body whose `content-type` is not JSON
/// (`text/plain`, `multipart/form-data`: anything but `application/json`, `application/*+json`,
/// an empty value or none): see
/// [`BypassMarkerLayer::non_json_bodies`](crate::BypassMarkerLayer::non_json_bodies).
///
/// A body *looks like JSON* when its first byte that is not a space, tab, CR, LF, NUL or a byte of
/// a byte-order mark (EF BB BF, FE FF) is `{`: that covers what Python's `json.loads` takes from
/// bytes (it detects UTF-8 with a BOM, UTF-16 and UTF-32), so an upstream that parses any body as
/// JSON (Starlette's `request.json()`) can only find an `nvext` in a body that looks like JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum NonJsonBodies {
    /// Forward them unread, without buffering (the default, and the Dynamo preset's): an
    /// upstream that parses only JSON content types never reads their `nvext`.
    #[default]
    Forward,
    /// Read them too (buffered up to the guard's body cap, refused when encoded, as JSON bodies
    /// are); one that looks like JSON is judged as a JSON body (router-owned names stripped, the
    /// opt-in granted, refused when it is not RFC 8259 JSON), any other is forwarded as it came.
    Judge,
    /// Read them too (as for `Judge`); one that looks like JSON is refused with 415
    /// `unsupported_media_type`, any other is forwarded as it came.
    Refuse,
}

/// What a response does with frames of a configured annotation name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Removed unless the client opted in.
    OptIn,
    /// Always removed.
    NeverForward,
}

/// What happens to the frames of a configured annotation name: see
/// [`BypassMarkerLayer::role`](crate::BypassMarkerLayer::role).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Role {
    /// Set by the router itself: its frames are removed unless the client opted in, and the
    /// request guard strips the name from what clients send
    /// ([`router_owned`](crate::BypassMarkerLayer::router_owned)).
    RouterOwned,
    /// Its frames are removed unless the client opted in
    /// ([`opt_in`](crate::BypassMarkerLayer::opt_in)).
    OptIn,
    /// Its frames are never forwarded, even to a client that asked
    /// ([`never_forward`](crate::BypassMarkerLayer::never_forward)).
    NeverForward,
}

/// One configured annotation name.
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
    /// What the JSON guard does with bodies of another content type.
    pub(crate) non_json: NonJsonBodies,
    /// Finds `event:`, built once per layer rather than once per chunk.
    pub(crate) event_finder: memchr::memmem::Finder<'static>,
    /// How many bytes of a line the scanner needs to tell whether it is an `event` field naming a
    /// configured name.
    pub(crate) line_cap: usize,
    /// Told of every removed and every forwarded annotation frame.
    pub(crate) observer: Option<Observer>,
    /// The application's opt-in from the request's head, if it set one.
    pub(crate) grant: Option<Grant>,
    /// The application's shape for the error responses the middleware writes itself.
    pub(crate) error_body: Option<ErrorBodyFn>,
}

/// An error response the middleware answers with itself (the layer's 502 for an encoded event
/// stream, the JSON guard's refusals), as
/// [`BypassMarkerLayer::error_body`](crate::BypassMarkerLayer::error_body) is given it to shape.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct ErrorParts<'a> {
    /// The response status (`502`, `400`, `413`, `415`).
    pub status: http::StatusCode,
    /// OpenAI's error `type`: `server_error` for the 502, `invalid_request_error` otherwise.
    pub kind: &'a str,
    /// The error's `code`, such as `encoded_event_stream` or `invalid_json`.
    pub code: &'a str,
    /// The message for the client.
    pub message: &'a str,
}

/// The closure of [`BypassMarkerLayer::error_body`](crate::BypassMarkerLayer::error_body).
pub(crate) type ErrorBodyFnInner =
    dyn Fn(&ErrorParts<'_>) -> (http::HeaderValue, bytes::Bytes) + Send + Sync;

/// The error-body closure a configuration holds.
#[derive(Clone)]
pub(crate) struct ErrorBodyFn(pub(crate) std::sync::Arc<ErrorBodyFnInner>);

impl fmt::Debug for ErrorBodyFn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("error_body(..)")
    }
}

impl ErrorBodyFn {
    /// The content type and the body for `parts`.
    pub(crate) fn shape(&self, parts: &ErrorParts<'_>) -> (http::HeaderValue, bytes::Bytes) {
        (self.0)(parts)
    }
}

/// The opt-in closure of [`BypassMarkerLayer::opt_in_from`](crate::BypassMarkerLayer::opt_in_from).
pub(crate) type GrantFn = dyn Fn(&http::request::Parts) -> RequestedAnnotations + Send + Sync;

/// The opt-in closure a configuration holds.
#[derive(Clone)]
pub(crate) struct Grant(pub(crate) std::sync::Arc<GrantFn>);

impl fmt::Debug for Grant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("opt_in_from(..)")
    }
}

/// What a guard does with one entry of a client's `nvext.annotations`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GuardEntry<'a> {
    /// The entry names a router-owned name (this index in `names`): remove it from the request.
    pub(crate) strip: Option<u8>,
    /// The configured name the entry grants the client: the entry is exactly that name (bare, as
    /// written) and it is not never-forwarded.
    pub(crate) grant: Option<&'a str>,
}

/// The name an entry of a client's annotations refers to, for the guard's matching rule: the part
/// before the first `:`, without surrounding whitespace. `"x-a"`, `" X-A:true "` and `"x-a:"` all
/// refer to `x-a` (compared in any ASCII case by [`Config::guard_entry`]).
pub(crate) fn entry_name(entry: &str) -> &str {
    entry.split(':').next().unwrap_or(entry).trim()
}

/// For an entry holding a character that a lenient upstream may fold away or into ASCII: the part
/// of the entry before the first such character, without leading (Unicode) whitespace, which
/// [`entry_name`] trims too; `None` for an entry
/// of printable ASCII only.
///
/// Those characters are the control characters (C0, DEL, C1: Python's `str.strip` removes U+001C
/// to U+001F and U+0085, and a C string ends at NUL) and every character outside ASCII (Unicode
/// case folding maps U+212A KELVIN SIGN to `k` and U+017F LONG S to `s`, NFKC maps the fullwidth
/// forms U+FF01 to U+FF5E, `：` included, to ASCII, and either may expand one character into
/// several). From that character on, the rest of the entry could become any text, so an entry
/// whose part before it begins a router-owned name (in any ASCII case) could become that name, or
/// `name:value`, in such an upstream: the guard strips it. An entry that differs from every
/// router-owned name in plain ASCII before any such character cannot, and is kept.
pub(crate) fn near_miss_prefix(entry: &str) -> Option<&str> {
    let entry = entry.trim_start();
    let at = entry.find(|c: char| !c.is_ascii() || c.is_ascii_control())?;
    Some(&entry[..at])
}

/// `name` begins with `prefix` in any ASCII case.
fn starts_with_ignore_case(name: &str, prefix: &str) -> bool {
    name.len() >= prefix.len()
        && name.as_bytes()[..prefix.len()].eq_ignore_ascii_case(prefix.as_bytes())
}

impl Config {
    /// The default configuration: [`BYPASS_REMOTE_PREFILL`], router-owned and opt-in.
    pub(crate) fn new() -> Self {
        let mut config = Self {
            names: Vec::new(),
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            on_overflow: Overflow::default(),
            sdk_safe: false,
            non_json: NonJsonBodies::Forward,
            event_finder: memchr::memmem::Finder::new(EVENT_FIELD).into_owned(),
            line_cap: 0,
            observer: None,
            grant: None,
            error_body: None,
        };
        config
            .set(BYPASS_REMOTE_PREFILL, Some(Kind::OptIn), true)
            .expect("the default name is valid");
        config
    }

    /// Adds `name`, or updates it: `kind` (when given) replaces the old one, `router_owned` is
    /// never taken back. Changes nothing when it fails.
    pub(crate) fn set(
        &mut self,
        name: &str,
        kind: Option<Kind>,
        router_owned: bool,
    ) -> Result<(), InvalidName> {
        validate_name(name)?;
        if let Some(existing) = self
            .names
            .iter_mut()
            .find(|n| n.name.eq_ignore_ascii_case(name))
        {
            if *existing.name != *name {
                return Err(InvalidName {
                    name: name.to_owned(),
                    reason: InvalidNameKind::CaseConflict,
                });
            }
            existing.kind = kind.unwrap_or(existing.kind);
            existing.router_owned |= router_owned;
            return Ok(());
        }
        if self.names.len() >= MAX_NAMES {
            return Err(InvalidName {
                name: name.to_owned(),
                reason: InvalidNameKind::TooMany,
            });
        }
        self.names.push(Name {
            name: name.into(),
            kind: kind.unwrap_or(Kind::OptIn),
            router_owned,
        });
        let longest = self.names.iter().map(|n| n.name.len()).max().unwrap_or(0);
        // "event: " + the name; never less than "data:" plus a byte.
        self.line_cap = (b"event: ".len() + longest).max(8);
        Ok(())
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

    /// The bits of the configured names in `requested`, compared in any ASCII case as names are
    /// everywhere else ([`role`](Self::role), the guard's stripping, [`Self::set`]'s
    /// `CaseConflict`): an application that grants `Request_ID` grants `request_id`.
    pub(crate) fn requested_mask(&self, requested: &RequestedAnnotations) -> u64 {
        let mut mask = 0;
        for asked in requested.iter() {
            for (i, n) in self.names.iter().enumerate() {
                if n.name.eq_ignore_ascii_case(asked) {
                    mask |= 1 << i;
                }
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

    /// The guard's rule for one entry of a client's annotations, shared by every guard.
    ///
    /// The entry is stripped when it names a router-owned name in any form: `name` or
    /// `name:value`, any ASCII case, surrounding whitespace (see [`entry_name`]), or when a
    /// control or non-ASCII character could make it one in a lenient upstream (see
    /// [`near_miss_prefix`]). It grants the configured name it is exactly, unless that name is
    /// never-forwarded.
    pub(crate) fn guard_entry(&self, entry: &str) -> GuardEntry<'_> {
        let grant = self
            .names
            .iter()
            .find(|n| *n.name == *entry && n.kind != Kind::NeverForward)
            .map(|n| &*n.name);
        let name = entry_name(entry);
        let near = near_miss_prefix(entry);
        let strip = self.names.iter().position(|n| {
            n.router_owned
                && (n.name.eq_ignore_ascii_case(name)
                    || near.is_some_and(|prefix| starts_with_ignore_case(&n.name, prefix)))
        });
        GuardEntry {
            // At most MAX_NAMES (64) names.
            strip: strip.map(|i| i as u8),
            grant,
        }
    }

    /// What happens to the frames of `name` (ASCII case-insensitive), if it is configured.
    pub(crate) fn role(&self, name: &str) -> Option<Role> {
        let n = self
            .names
            .iter()
            .find(|n| n.name.eq_ignore_ascii_case(name))?;
        Some(match (n.kind, n.router_owned) {
            (Kind::NeverForward, _) => Role::NeverForward,
            (Kind::OptIn, true) => Role::RouterOwned,
            (Kind::OptIn, false) => Role::OptIn,
        })
    }

    /// Adds the configuration's fields to a `Debug` output: the names by role, then the limits.
    pub(crate) fn debug_fields(&self, d: &mut fmt::DebugStruct<'_, '_>) {
        let names = |keep: fn(&Name) -> bool| {
            self.names
                .iter()
                .filter(move |n| keep(n))
                .map(|n| &*n.name)
                .collect::<Vec<_>>()
        };
        d.field("router_owned", &names(|n| n.router_owned))
            .field("opt_in", &names(|n| n.kind == Kind::OptIn))
            .field("never_forward", &names(|n| n.kind == Kind::NeverForward))
            .field("max_frame_bytes", &self.max_frame_bytes)
            .field("on_overflow", &self.on_overflow)
            .field("sdk_safe", &self.sdk_safe)
            .field("non_json_bodies", &self.non_json);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_name_caps_the_line_prefix_the_scanner_keeps() {
        let mut config = Config::new();
        assert_eq!(config.line_cap, "event: x-bypass-remote-prefill".len());
        config
            .set(&"n".repeat(MAX_NAME_LEN), Some(Kind::OptIn), false)
            .unwrap();
        assert_eq!(config.line_cap, "event: ".len() + MAX_NAME_LEN);
        assert!(config
            .set(&"n".repeat(MAX_NAME_LEN + 1), Some(Kind::OptIn), false)
            .is_err());
        assert_eq!(config.line_cap, "event: ".len() + MAX_NAME_LEN);
        assert_eq!(config.names.len(), 2, "a refused name is not added");
    }

    #[test]
    fn entry_names_are_the_part_before_the_first_colon_trimmed() {
        assert_eq!(entry_name("x-a"), "x-a");
        assert_eq!(entry_name(" X-A:true "), "X-A");
        assert_eq!(entry_name("x-a:b:c"), "x-a");
        assert_eq!(entry_name(":x-a"), "");
        assert_eq!(entry_name("\tx y\u{a0}:"), "x y");
    }
}
