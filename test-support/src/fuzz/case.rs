//! Decodes a fuzz input into a test case: a layer configuration, the client's opt-in, a body
//! (bytes and where it is cut into chunks) and, for the `body` target, how the inner body behaves
//! around the data.
//!
//! The first bytes are a header; a byte past the end of the input reads as 0, so every input
//! decodes. The layout is documented in FUZZING.md.

use tower_bypass_marker::{
    BypassMarkerLayer, Overflow, RequestedAnnotations, BYPASS_REMOTE_PREFILL,
};

/// Tokens the dictionary mode maps input bytes to (`byte % 32`), so that a few mutations reach
/// frames, line endings and event names the scanner has to tell apart.
pub const TOKENS: [&[u8]; 32] = [
    b"\n",
    b"\r",
    b"\r\n",
    b"\n\n",
    b"event:",
    b"event: ",
    b"data:",
    b"data: ",
    b":",
    b" ",
    b"x-bypass-remote-prefill",
    b"request_id",
    b"llm_metrics",
    b"true",
    b"\xEF\xBB\xBF",
    b"\xEF",
    b"\xEF\xBB",
    b"id: 1",
    b"event",
    b"data",
    b"x",
    b"\0",
    b"\xFF",
    b": true",
    b"retry: 5",
    b"{\"id\":1}",
    b"[DONE]",
    b"Event",
    b"x-bypass-remote-prefil",
    b"x-bypass-remote-prefillx",
    // A long run of `x` instead when byte 3 has bit 7 set (see `LONG_RUN`).
    b"\t",
    // The fuzz-chosen extra name, or "event: " when there is none.
    b"",
];

/// What token 30 stands for when byte 3 has bit 7 set: a line longer than the scanner's
/// long-line threshold (16 KiB with no line end in its first KiB), which it walks instead of
/// searching for `event:`.
pub const LONG_RUN: &[u8] = &[b'x'; 16 * 1024 + 100];

/// How a configured name is treated, as the layer's builder leaves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Removed unless the client opted in.
    OptIn,
    /// Always removed.
    NeverForward,
}

/// A builder call on the layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    /// [`BypassMarkerLayer::opt_in`].
    OptIn,
    /// [`BypassMarkerLayer::never_forward`].
    NeverForward,
    /// [`BypassMarkerLayer::router_owned`].
    RouterOwned,
}

/// What the `body` target's inner response and body do besides yielding the data.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BodyPlan {
    /// Trailers after the data.
    pub trailers: bool,
    /// An error after this many data chunks (instead of the rest of the data and the trailers).
    pub error_after: Option<usize>,
    /// The inner body is `Pending` once after every data chunk.
    pub pending: bool,
    /// An empty data chunk before every data chunk.
    pub empty_chunks: bool,
    /// Index into [`CONTENT_TYPES`].
    pub content_type: usize,
    /// Where the opt-in goes: 0 request extensions, 1 response extensions, 2 split between the
    /// two, 3 both.
    pub opt_in_at: u8,
    /// The response's status and the request's method (byte 4 bit 7, then the head byte).
    pub head: HeadPlan,
    /// Index into [`TRANSFER_CODINGS`]: the response's `transfer-encoding`.
    pub transfer: usize,
}

/// The response's status and the request's method: a `200` to a `GET` (the default), a `204`, a
/// `304`, or a `200` to `HEAD`. The last three have no content: an event-stream head among them
/// gets no body byte through, whatever its codings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum HeadPlan {
    /// `200` to a `GET`.
    #[default]
    Ok,
    /// `204 No Content`.
    NoContent,
    /// `304 Not Modified`.
    NotModified,
    /// `200` to a `HEAD` request.
    Head,
}

impl HeadPlan {
    /// The response's status.
    pub fn status(self) -> http::StatusCode {
        match self {
            Self::Ok | Self::Head => http::StatusCode::OK,
            Self::NoContent => http::StatusCode::NO_CONTENT,
            Self::NotModified => http::StatusCode::NOT_MODIFIED,
        }
    }

    /// The request's method.
    pub fn method(self) -> http::Method {
        match self {
            Self::Head => http::Method::HEAD,
            _ => http::Method::GET,
        }
    }

    /// The response has no content (a `204`, a `304`, the response to `HEAD`).
    pub fn no_content(self) -> bool {
        self != Self::Ok
    }
}

/// The `transfer-encoding` values the head byte picks from: none, `chunked` (the framing an HTTP/1.1
/// client undid: the content as it is), `gzip, chunked` (the content still gzip-encoded: unreadable,
/// refused like a content coding when something would be removed), `identity, chunked` (readable:
/// `identity` is no coding).
pub const TRANSFER_CODINGS: [Option<&str>; 4] = [
    None,
    Some("chunked"),
    Some("gzip, chunked"),
    Some("identity, chunked"),
];

impl BodyPlan {
    /// The response's codings leave its content unreadable: a `content-encoding` other than
    /// `identity`, or a transfer coding other than `chunked`.
    pub fn encoded(&self) -> bool {
        let (_, encoding, _) = CONTENT_TYPES[self.content_type];
        encoding.is_some_and(|e| e != "identity") || self.transfer == 2
    }

    /// The response's media type is an event stream (whatever its codings and status).
    pub fn event_stream(&self) -> bool {
        CONTENT_TYPES[self.content_type]
            .0
            .to_ascii_lowercase()
            .starts_with("text/event-stream")
    }
}

/// Response heads the `body` target picks from: (content-type, content-encoding, filtered).
pub const CONTENT_TYPES: [(&str, Option<&str>, bool); 8] = [
    ("text/event-stream", None, true),
    ("text/event-stream", None, true),
    ("text/event-stream", None, true),
    ("text/event-stream", None, true),
    ("Text/Event-Stream; charset=utf-8", None, true),
    ("application/json", None, false),
    ("text/event-stream", Some("gzip"), false),
    ("text/event-stream", Some("identity"), true),
];

/// One decoded fuzz input.
#[derive(Debug, Clone)]
pub struct Case {
    /// The builder calls after `BypassMarkerLayer::new()`, in order.
    pub calls: Vec<(String, Call)>,
    /// The configured names and their kinds once those calls are made (the bypass marker first),
    /// as the layer's documentation describes them.
    pub names: Vec<(String, Kind)>,
    /// The SDK-safe preset's rule (frames without data are removed).
    pub sdk_safe: bool,
    /// `Some(cap)`: a small `max_frame_bytes`; `None`: the default (1 MiB).
    pub cap: Option<usize>,
    /// What an over-long frame does.
    pub overflow: Overflow,
    /// The names the client opted in to.
    pub requested: Vec<String>,
    /// The body's bytes.
    pub input: Vec<u8>,
    /// The end offset of every chunk, the last one `input.len()`.
    pub ends: Vec<usize>,
    /// How the inner body behaves around the data.
    pub body: BodyPlan,
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((b, rest)) => {
                self.0 = rest;
                *b
            }
            None => 0,
        }
    }

    fn take(&mut self, n: usize) -> &[u8] {
        let (head, rest) = self.0.split_at(n.min(self.0.len()));
        self.0 = rest;
        head
    }
}

/// The longest body decoded (dictionary mode can expand an input a lot).
const MAX_INPUT: usize = 64 * 1024;

/// The longest body decoded in byte-by-byte mode, where every prefix is checked against the model.
const BYTEWISE_MAX: usize = 512;

impl Case {
    /// Decodes `data`. Header: flags, opt-in, cap, extra name, body plan, error point, extra
    /// name bytes, chunk count and lengths; the rest is the body (mapped through [`TOKENS`] in
    /// dictionary mode).
    pub fn decode(data: &[u8]) -> Case {
        let mut r = Reader(data);
        let flags = r.byte();
        let opt_in = r.byte();
        let cap = r.byte();
        let extra = r.byte();
        let plan = r.byte();
        let error_at = r.byte();
        // The head byte is there only when byte 4 has bit 7 set, so inputs from before it decode
        // as they did.
        let head = if plan & 0x80 != 0 { r.byte() } else { 0 };

        let mut calls = Vec::new();
        if opt_in & 0x10 != 0 {
            calls.push((BYPASS_REMOTE_PREFILL.to_owned(), Call::NeverForward));
        }
        if flags & 0x01 != 0 {
            calls.push(("request_id".to_owned(), Call::OptIn));
        }
        if flags & 0x02 != 0 {
            calls.push(("llm_metrics".to_owned(), Call::NeverForward));
        }
        let extra_len = usize::from(extra & 0x1F);
        let extra_name = if flags & 0x40 != 0 && extra_len > 0 {
            let raw = r.take(extra_len);
            // A name the builder accepts: no `:`, no control character, no surrounding
            // whitespace.
            let name: String = String::from_utf8_lossy(raw)
                .chars()
                .map(|c| if c == ':' || c.is_control() { '_' } else { c })
                .collect();
            let name = name.trim().to_owned();
            (!name.is_empty()).then_some(name)
        } else {
            None
        };
        // Nor another ASCII case of a name already configured, which the builder refuses
        // (`InvalidNameKind::CaseConflict`).
        let extra_name = extra_name.filter(|name| {
            std::iter::once(BYPASS_REMOTE_PREFILL)
                .chain(calls.iter().map(|(known, _)| known.as_str()))
                .all(|known| known == name || !known.eq_ignore_ascii_case(name))
        });
        if let Some(name) = &extra_name {
            let call = match (extra >> 5) & 3 {
                0 | 3 => Call::OptIn,
                1 => Call::NeverForward,
                _ => Call::RouterOwned,
            };
            calls.push((name.clone(), call));
        }
        let names = configured_names(&calls);

        let mut requested = Vec::new();
        for (bit, name) in [
            (0x01, Some(BYPASS_REMOTE_PREFILL)),
            (0x02, Some("request_id")),
            (0x04, Some("llm_metrics")),
            (0x08, extra_name.as_deref()),
        ] {
            if let Some(name) = name {
                if opt_in & bit != 0 && !requested.iter().any(|r| r == name) {
                    requested.push(name.to_owned());
                }
            }
        }

        let cuts = usize::from(r.byte() % 32);
        let lengths: Vec<usize> = r.take(cuts).iter().map(|&b| usize::from(b)).collect();
        let rest = r.0;
        let mut input = if flags & 0x20 != 0 {
            let extra_token = extra_name.as_deref().unwrap_or("event: ").as_bytes();
            let long = extra & 0x80 != 0;
            rest.iter()
                .flat_map(|&b| match usize::from(b % 32) {
                    30 if long => LONG_RUN,
                    31 => extra_token,
                    k => TOKENS[k],
                })
                .copied()
                .collect()
        } else {
            rest.to_vec()
        };
        let bytewise = flags & 0x80 != 0;
        input.truncate(if bytewise { BYTEWISE_MAX } else { MAX_INPUT });

        let mut ends = Vec::new();
        if bytewise {
            ends.extend(1..=input.len());
        } else {
            let mut at = 0;
            for len in lengths {
                at = (at + len).min(input.len());
                ends.push(at);
            }
        }
        if ends.last() != Some(&input.len()) {
            ends.push(input.len());
        }

        let body = BodyPlan {
            trailers: plan & 0x01 != 0,
            error_after: (plan & 0x02 != 0).then(|| usize::from(error_at) % (ends.len() + 1)),
            pending: plan & 0x04 != 0,
            empty_chunks: plan & 0x08 != 0,
            content_type: usize::from(plan >> 4) % CONTENT_TYPES.len(),
            opt_in_at: (opt_in >> 5) & 3,
            head: match head & 3 {
                0 => HeadPlan::Ok,
                1 => HeadPlan::NoContent,
                2 => HeadPlan::NotModified,
                _ => HeadPlan::Head,
            },
            transfer: usize::from(head >> 2) % TRANSFER_CODINGS.len(),
        };

        Case {
            calls,
            names,
            sdk_safe: flags & 0x04 != 0,
            cap: (flags & 0x08 != 0).then_some(usize::from(cap)),
            overflow: if flags & 0x10 != 0 {
                Overflow::Error
            } else {
                Overflow::Forward
            },
            requested,
            input,
            ends,
            body,
        }
    }

    /// The same case with a plain inner body: `text/event-stream`, the opt-in in the request, no
    /// trailers, errors, empty chunks or `Pending`. What the `scanner` target exercises.
    pub fn plain(&self) -> Case {
        Case {
            body: BodyPlan::default(),
            ..self.clone()
        }
    }

    /// The same case answered with a `200` to a `GET` and no transfer coding (the head byte's
    /// default): for the drivers that send their own status and method.
    pub fn status_200(&self) -> Case {
        let mut case = self.clone();
        case.body.head = HeadPlan::Ok;
        case.body.transfer = 0;
        case
    }

    /// The layer this case configures.
    pub fn layer(&self) -> BypassMarkerLayer {
        let mut layer = BypassMarkerLayer::new()
            .sdk_safe(self.sdk_safe)
            .on_overflow(self.overflow);
        for (name, call) in &self.calls {
            layer = match call {
                Call::OptIn => layer.opt_in(name),
                Call::NeverForward => layer.never_forward(name),
                Call::RouterOwned => layer.router_owned(name),
            };
        }
        if let Some(cap) = self.cap {
            layer = layer.max_frame_bytes(cap);
        }
        layer
    }

    /// The client's opt-in.
    pub fn requested(&self) -> RequestedAnnotations {
        self.requested.iter().map(String::as_str).collect()
    }

    /// The cap on held bytes the layer enforces.
    pub fn max_frame_bytes(&self) -> usize {
        self.cap
            .unwrap_or(tower_bypass_marker::DEFAULT_MAX_FRAME_BYTES)
    }

    /// The event types whose frames are removed for this client.
    pub fn removed_names(&self) -> Vec<Vec<u8>> {
        self.names
            .iter()
            .filter(|(name, kind)| {
                *kind == Kind::NeverForward || !self.requested.iter().any(|r| r == name)
            })
            .map(|(name, _)| name.as_bytes().to_vec())
            .collect()
    }

    /// The configured event types this client opted in to (never removed, not even by the
    /// SDK-safe rule).
    pub fn opted_in_names(&self) -> Vec<Vec<u8>> {
        let removed = self.removed_names();
        self.names
            .iter()
            .map(|(name, _)| name.as_bytes().to_vec())
            .filter(|name| !removed.contains(name))
            .collect()
    }

    /// The chunks of the body.
    pub fn chunks(&self) -> Vec<&[u8]> {
        let mut start = 0;
        self.ends
            .iter()
            .map(|&end| {
                let chunk = &self.input[start..end];
                start = end;
                chunk
            })
            .collect()
    }
}

/// The names and kinds the builder's documentation says `calls` leave: `opt_in` and
/// `never_forward` set the kind, `router_owned` adds an opt-in name or leaves a known one's kind.
fn configured_names(calls: &[(String, Call)]) -> Vec<(String, Kind)> {
    let mut names = vec![(BYPASS_REMOTE_PREFILL.to_owned(), Kind::OptIn)];
    for (name, call) in calls {
        let kind = match call {
            Call::OptIn => Some(Kind::OptIn),
            Call::NeverForward => Some(Kind::NeverForward),
            Call::RouterOwned => None,
        };
        match names.iter_mut().find(|(n, _)| n == name) {
            Some((_, k)) => *k = kind.unwrap_or(*k),
            None => names.push((name.clone(), kind.unwrap_or(Kind::OptIn))),
        }
    }
    names
}
