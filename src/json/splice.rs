//! The sans-IO half of the JSON guard: bytes in, a decision out. No async, no http types.
//!
//! [`guard`] reads a request body once. serde_json parses every key and every value (as a
//! [`RawValue`], which borrows its bytes from the input, so its position is known); the only
//! grammar handled here is the punctuation of the two objects and the one array the guard walks
//! (the top-level object, `nvext` and `nvext.annotations`): `{`, `}`, `[`, `]`, `,`, `:` and
//! whitespace. Everything else of the document is skipped by serde_json without being decoded.

use std::borrow::Cow;
use std::ops::Range;

use serde_json::value::RawValue;

use crate::config::Config;
use crate::RequestedAnnotations;

/// What the guard decided for a body it accepted.
#[derive(Debug)]
pub(crate) struct Guarded {
    /// The configured names the client asked for and may have.
    pub(crate) granted: RequestedAnnotations,
    /// `None`: forward the body as it is.
    pub(crate) splice: Option<Splice>,
}

/// Replace `body[span]` (the `nvext.annotations` array, `[` to `]`) with `array`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Splice {
    pub(crate) span: Range<usize>,
    pub(crate) array: Vec<u8>,
}

/// Why a body is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reason {
    /// Not RFC 8259 JSON: not UTF-8, a syntax error, truncated, trailing data, `NaN`, nested past
    /// the recursion limit, or an annotation or key with an escape that does not decode.
    Invalid,
    /// `nvext` twice at the top level, or `annotations` twice in `nvext`.
    Duplicate,
    /// `nvext` is not an object or null, or `nvext.annotations` is not an array or null.
    Shape,
}

/// A refused body: why, and a message for the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Rejection {
    pub(crate) reason: Reason,
    pub(crate) message: String,
}

impl Rejection {
    fn new(reason: Reason, message: String) -> Self {
        Self { reason, message }
    }
}

/// Reads `body` once: refuses it, or says what the client is granted and what to splice.
///
/// An empty body, and a valid document whose top level is not an object, are accepted with
/// nothing granted and nothing to splice.
pub(crate) fn guard(config: &Config, body: &[u8]) -> Result<Guarded, Rejection> {
    let text = std::str::from_utf8(body).map_err(|e| {
        Rejection::new(
            Reason::Invalid,
            format!(
                "the request body is not valid UTF-8 (at byte {})",
                e.valid_up_to()
            ),
        )
    })?;
    let mut walk = Walk { text, pos: 0 };
    let mut out = Guarded {
        granted: RequestedAnnotations::new(),
        splice: None,
    };
    walk.skip_ws();
    if walk.peek()? == b'{' {
        walk.top_level(config, &mut out)?;
    } else {
        walk.value()?;
    }
    walk.skip_ws();
    if walk.pos != text.len() {
        return Err(walk.invalid("trailing data after the JSON value"));
    }
    if let Some(at) = too_deep(body) {
        return Err(Rejection::new(
            Reason::Invalid,
            format!(
                "the request body is not valid JSON: nested deeper than {} levels at byte {at}",
                MAX_DEPTH - 1
            ),
        ));
    }
    Ok(out)
}

/// The nesting serde_json refuses when it deserializes a document (its recursion limit): 128
/// levels of arrays and objects, counted from the top; 127 pass.
const MAX_DEPTH: usize = 128;

/// Where a valid JSON document first nests [`MAX_DEPTH`] levels deep, if it does.
///
/// serde_json skips a [`RawValue`] without recursing, so it has no depth limit there; this scan
/// applies the one serde_json has elsewhere, so that a document the upstream's parser may refuse
/// or overflow on is refused here. Strings are crossed with `memchr`; only the bytes between them
/// are looked at one by one.
fn too_deep(doc: &[u8]) -> Option<usize> {
    // Nesting that deep takes that many `[` and `{`: most bodies have far fewer, and counting them
    // (with memchr, stopping at the limit) is cheaper than walking the strings.
    if memchr::memchr2_iter(b'[', b'{', doc)
        .take(MAX_DEPTH)
        .count()
        < MAX_DEPTH
    {
        return None;
    }
    let mut depth = 0usize;
    let mut i = 0;
    while i < doc.len() {
        match doc[i] {
            b'"' => {
                i += 1;
                // Valid JSON: every string is closed, and a backslash escapes the next byte.
                while let Some(j) = memchr::memchr2(b'"', b'\\', &doc[i..]) {
                    if doc[i + j] == b'"' {
                        i += j;
                        break;
                    }
                    i += j + 2;
                }
            }
            b'[' | b'{' => {
                depth += 1;
                if depth >= MAX_DEPTH {
                    return Some(i);
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        i += 1;
    }
    None
}

/// A cursor over the document, for the punctuation of the containers the guard walks.
struct Walk<'a> {
    text: &'a str,
    pos: usize,
}

impl<'a> Walk<'a> {
    fn bytes(&self) -> &'a [u8] {
        self.text.as_bytes()
    }

    fn invalid(&self, what: &str) -> Rejection {
        Rejection::new(
            Reason::Invalid,
            format!(
                "the request body is not valid JSON: {what} at byte {}",
                self.pos
            ),
        )
    }

    fn skip_ws(&mut self) {
        let bytes = self.bytes();
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = bytes.get(self.pos) {
            self.pos += 1;
        }
    }

    /// The byte at the cursor; the end of the body here is a truncated document.
    fn peek(&self) -> Result<u8, Rejection> {
        self.bytes()
            .get(self.pos)
            .copied()
            .ok_or_else(|| self.invalid("unexpected end of the body"))
    }

    /// Steps over `byte`, which must be at the cursor.
    fn expect(&mut self, byte: u8, what: &str) -> Result<(), Rejection> {
        if self.peek()? != byte {
            return Err(self.invalid(what));
        }
        self.pos += 1;
        Ok(())
    }

    /// After a member or an element: skips whitespace and a `,` (returning `true`) or the closing
    /// `close` (returning `false`).
    fn next_or_close(&mut self, close: u8) -> Result<bool, Rejection> {
        self.skip_ws();
        let found = self.peek()?;
        self.pos += 1;
        if found == b',' {
            self.skip_ws();
            Ok(true)
        } else if found == close {
            Ok(false)
        } else {
            self.pos -= 1;
            Err(self.invalid(if close == b'}' {
                "expected `,` or `}`"
            } else {
                "expected `,` or `]`"
            }))
        }
    }

    /// Parses the value at the cursor (which is not whitespace) with serde_json and steps over
    /// it; returns its text and where it starts.
    fn value(&mut self) -> Result<(usize, &'a str), Rejection> {
        let rest = &self.text[self.pos..];
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<&RawValue>();
        match values.next() {
            Some(Ok(raw)) => {
                let raw = raw.get();
                let start = raw.as_ptr() as usize - self.text.as_ptr() as usize;
                self.pos = start + raw.len();
                Ok((start, raw))
            }
            Some(Err(e)) => Err(self.serde_error(self.pos, rest, &e)),
            None => Err(self.invalid("unexpected end of the body")),
        }
    }

    /// A serde_json error in `rest` (which starts at byte `base`), with its position in the body.
    fn serde_error(&self, base: usize, rest: &str, e: &serde_json::Error) -> Rejection {
        let mut offset = 0;
        for _ in 1..e.line() {
            match rest[offset..].find('\n') {
                Some(nl) => offset += nl + 1,
                None => break,
            }
        }
        let at = base + offset + e.column().saturating_sub(1);
        let message = e.to_string();
        let what = match message.rfind(" at line ") {
            Some(cut) => &message[..cut],
            None => &message,
        };
        Rejection::new(
            Reason::Invalid,
            format!("the request body is not valid JSON: {what} at byte {at}"),
        )
    }

    /// The key at the cursor, unescaped, with the cursor after its `:` and the whitespace after.
    fn key(&mut self) -> Result<Cow<'a, str>, Rejection> {
        if self.peek()? != b'"' {
            return Err(self.invalid("expected a string key"));
        }
        let (start, raw) = self.value()?;
        let key = unescape(raw).map_err(|e| self.serde_error(start, raw, &e))?;
        self.skip_ws();
        self.expect(b':', "expected `:`")?;
        self.skip_ws();
        Ok(key)
    }

    /// The top-level object, the cursor at its `{`.
    fn top_level(&mut self, config: &Config, out: &mut Guarded) -> Result<(), Rejection> {
        self.members("nvext", "the top-level object", |this| {
            this.nvext(config, out)
        })
    }

    /// The value of `nvext`: an object or null.
    fn nvext(&mut self, config: &Config, out: &mut Guarded) -> Result<(), Rejection> {
        match self.peek()? {
            b'{' => {}
            b'n' if self.value()?.1 == "null" => return Ok(()),
            _ => return Err(shape("`nvext` must be an object or null")),
        }
        self.members("annotations", "`nvext`", |this| {
            this.annotations(config, out)
        })
    }

    /// The members of the object whose `{` is at the cursor: `read` reads the value of `key`, a
    /// second `key` is refused, every other value is skipped.
    fn members(
        &mut self,
        key: &str,
        within: &str,
        mut read: impl FnMut(&mut Self) -> Result<(), Rejection>,
    ) -> Result<(), Rejection> {
        self.pos += 1;
        self.skip_ws();
        if self.peek()? == b'}' {
            self.pos += 1;
            return Ok(());
        }
        let mut seen = false;
        loop {
            if self.key()? == key {
                if seen {
                    return Err(duplicate(key, within));
                }
                seen = true;
                read(self)?;
            } else {
                self.value()?;
            }
            if !self.next_or_close(b'}')? {
                return Ok(());
            }
        }
    }

    /// The value of `nvext.annotations`: an array or null. Decides every string entry.
    fn annotations(&mut self, config: &Config, out: &mut Guarded) -> Result<(), Rejection> {
        match self.peek()? {
            b'[' => {}
            b'n' if self.value()?.1 == "null" => return Ok(()),
            _ => return Err(shape("`nvext.annotations` must be an array or null")),
        }
        let open = self.pos;
        self.pos += 1;
        self.skip_ws();
        if self.peek()? == b']' {
            self.pos += 1;
            return Ok(());
        }
        // Each entry's span and whether it stays.
        let mut entries = Vec::new();
        let mut stripped = false;
        loop {
            let (start, raw) = self.value()?;
            let mut keep = true;
            if raw.starts_with('"') {
                let entry = unescape(raw).map_err(|e| self.serde_error(start, raw, &e))?;
                let decision = config.guard_entry(&entry);
                if let Some(name) = decision.grant {
                    out.granted.insert(name);
                }
                keep = !decision.strip;
                stripped |= decision.strip;
            }
            entries.push((start..start + raw.len(), keep));
            if !self.next_or_close(b']')? {
                break;
            }
        }
        if stripped {
            let span = open..self.pos;
            out.splice = Some(Splice {
                array: rebuild(self.bytes(), &span, &entries),
                span,
            });
        }
        Ok(())
    }
}

/// The array `bytes[span]` with only the entries marked to keep. The bytes before the first
/// entry (`[` and whitespace) and after the last (whitespace and `]`) stay; each kept entry but
/// the first is preceded by the separator (`,` and whitespace) that preceded it in the input.
fn rebuild(bytes: &[u8], span: &Range<usize>, entries: &[(Range<usize>, bool)]) -> Vec<u8> {
    let mut array = Vec::with_capacity(span.len());
    let first = entries.first().map_or(span.end - 1, |(e, _)| e.start);
    let last = entries.last().map_or(span.end - 1, |(e, _)| e.end);
    array.extend_from_slice(&bytes[span.start..first]);
    let mut previous_end = first;
    let mut any = false;
    for (entry, keep) in entries {
        if *keep {
            if any {
                array.extend_from_slice(&bytes[previous_end..entry.start]);
            }
            array.extend_from_slice(&bytes[entry.clone()]);
            any = true;
        }
        previous_end = entry.end;
    }
    array.extend_from_slice(&bytes[last..span.end]);
    array
}

/// The contents of a JSON string literal, unescaped (borrowed when it has no escape).
fn unescape(raw: &str) -> Result<Cow<'_, str>, serde_json::Error> {
    let inner = &raw[1..raw.len() - 1];
    if inner.contains('\\') {
        serde_json::from_str::<String>(raw).map(Cow::Owned)
    } else {
        Ok(Cow::Borrowed(inner))
    }
}

fn duplicate(key: &str, within: &str) -> Rejection {
    Rejection::new(
        Reason::Duplicate,
        format!("duplicate key `{key}` in {within}: refused because JSON parsers disagree on which one counts"),
    )
}

fn shape(message: &str) -> Rejection {
    Rejection::new(Reason::Shape, message.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BypassMarkerLayer;

    fn layer() -> BypassMarkerLayer {
        BypassMarkerLayer::new()
            .opt_in("request_id")
            .never_forward("llm_metrics")
    }

    /// The guarded body and the granted names, or the rejection.
    fn run(layer: &BypassMarkerLayer, body: &str) -> Result<(String, Vec<String>), Rejection> {
        let guarded = guard(&layer.config, body.as_bytes())?;
        let granted = guarded.granted.iter().map(str::to_owned).collect();
        let out = match guarded.splice {
            None => body.to_owned(),
            Some(s) => {
                assert_eq!(body.as_bytes()[s.span.start], b'[');
                assert_eq!(body.as_bytes()[s.span.end - 1], b']');
                let mut out = body.as_bytes()[..s.span.start].to_vec();
                out.extend_from_slice(&s.array);
                out.extend_from_slice(&body.as_bytes()[s.span.end..]);
                String::from_utf8(out).unwrap()
            }
        };
        Ok((out, granted))
    }

    fn stripped(body: &str) -> String {
        run(&layer(), body).unwrap().0
    }

    fn reason(body: &str) -> Reason {
        run(&layer(), body).unwrap_err().reason
    }

    #[test]
    fn nothing_to_strip_means_no_splice() {
        for body in [
            r#"{}"#,
            r#"{"model":"m"}"#,
            r#"{"nvext":{}}"#,
            r#"{"nvext":null}"#,
            r#"{"nvext":{"annotations":null}}"#,
            r#"{"nvext":{"annotations":[]}}"#,
            r#"{"nvext":{"annotations":["request_id","unknown",1,null,{"a":"x-bypass-remote-prefill"}]}}"#,
            " \t\r\n{ \"nvext\" : { \"annotations\" : [ ] } } \n",
        ] {
            let guarded = guard(&layer().config, body.as_bytes()).unwrap();
            assert_eq!(guarded.splice, None, "{body}");
        }
    }

    #[test]
    fn every_form_of_a_router_owned_entry_is_stripped() {
        for form in [
            r#""x-bypass-remote-prefill""#,
            r#""x-bypass-remote-prefill:true""#,
            r#""X-BYPASS-REMOTE-PREFILL""#,
            r#"" x-bypass-remote-prefill :1""#,
            r#""\tx-bypass-remote-prefill""#,
            r#""x\u002dbypass-remote-prefill""#,
            r#""\u0078\u002D\u0062ypass-remote-prefill""#,
            r#""x-bypass-remote-prefill\u003atrue""#,
            r#""x-bypass\/remote-prefill""#,
        ] {
            let body = format!(r#"{{"nvext":{{"annotations":["a",{form},"b"]}}}}"#);
            let expected = if form.contains("\\/") {
                // `\/` is `/`: another name, kept.
                body.clone()
            } else {
                r#"{"nvext":{"annotations":["a","b"]}}"#.to_owned()
            };
            assert_eq!(stripped(&body), expected, "{form}");
        }
    }

    #[test]
    fn only_the_array_changes_and_kept_entries_keep_their_spelling() {
        let body = "{\"b\":1e400, \"a\" :1.0,\"n\":123456789012345678901234,\n \"nvext\": {\"x\":\"\\u00e9\",\
                    \"annotations\" : [ \"re\\u0071uest_id\" , \"x-bypass-remote-prefill\" ,\t7 ]},\"z\":[]}";
        let out = stripped(body);
        assert_eq!(
            out,
            "{\"b\":1e400, \"a\" :1.0,\"n\":123456789012345678901234,\n \"nvext\": {\"x\":\"\\u00e9\",\
             \"annotations\" : [ \"re\\u0071uest_id\" ,\t7 ]},\"z\":[]}"
        );
    }

    #[test]
    fn entries_are_stripped_wherever_they_stand() {
        let m = "\"x-bypass-remote-prefill\"";
        for (array, expected) in [
            (format!("[{m}]"), "[]".to_owned()),
            (format!("[ {m} ]"), "[  ]".to_owned()),
            (format!("[{m},1]"), "[1]".to_owned()),
            (format!("[1,{m}]"), "[1]".to_owned()),
            (format!("[1, {m} ,2]"), "[1 ,2]".to_owned()),
            (format!("[{m},{m}, {m}]"), "[]".to_owned()),
            (format!("[{m},1,{m},2,{m}]"), "[1,2]".to_owned()),
            (format!("[\n  {m},\n  1\n]"), "[\n  1\n]".to_owned()),
        ] {
            let body = format!(r#"{{"nvext":{{"annotations":{array}}}}}"#);
            let out = stripped(&body);
            assert_eq!(
                out,
                format!(r#"{{"nvext":{{"annotations":{expected}}}}}"#),
                "{array}"
            );
            serde_json::from_str::<serde_json::Value>(&out).unwrap();
        }
    }

    #[test]
    fn the_opt_in_is_exact_names_and_never_a_never_forwarded_one() {
        let (out, granted) = run(
            &layer(),
            r#"{"nvext":{"annotations":["request_id","x-bypass-remote-prefill","llm_metrics","Request_Id","x-bypass-remote-prefill:true","other"]}}"#,
        )
        .unwrap();
        assert_eq!(granted, ["request_id", "x-bypass-remote-prefill"]);
        assert_eq!(
            out,
            r#"{"nvext":{"annotations":["request_id","llm_metrics","Request_Id","other"]}}"#
        );
        // Compared after unescaping.
        let (_, granted) =
            run(&layer(), r#"{"nvext":{"annotations":["request\u005fid"]}}"#).unwrap();
        assert_eq!(granted, ["request_id"]);
    }

    #[test]
    fn a_never_forwarded_router_owned_name_is_stripped_and_not_granted() {
        let layer = BypassMarkerLayer::new().never_forward("x-bypass-remote-prefill");
        let (out, granted) = run(
            &layer,
            r#"{"nvext":{"annotations":["x-bypass-remote-prefill"]}}"#,
        )
        .unwrap();
        assert!(granted.is_empty());
        assert_eq!(out, r#"{"nvext":{"annotations":[]}}"#);
    }

    #[test]
    fn annotations_elsewhere_are_not_read() {
        for body in [
            r#"{"a":{"nvext":{"annotations":["x-bypass-remote-prefill"]}}}"#,
            r#"{"nvext":{"a":{"annotations":["x-bypass-remote-prefill"]}}}"#,
            r#"{"annotations":["x-bypass-remote-prefill"]}"#,
            r#"{"NVEXT":{"annotations":["x-bypass-remote-prefill"]}}"#,
            r#"[{"nvext":{"annotations":["x-bypass-remote-prefill"]}}]"#,
            r#""x-bypass-remote-prefill""#,
            r#"12"#,
        ] {
            let guarded = guard(&layer().config, body.as_bytes()).unwrap();
            assert_eq!(guarded.splice, None, "{body}");
            assert!(guarded.granted.is_empty(), "{body}");
        }
    }

    #[test]
    fn duplicates_are_refused_in_both_orders_however_spelled() {
        let marker = r#"{"annotations":["x-bypass-remote-prefill"]}"#;
        for (first, second) in [
            (marker, "null"),
            ("null", marker),
            (marker, "{}"),
            ("{}", marker),
        ] {
            for key in ["nvext", "nv\\u0065xt", "\\u006evext"] {
                let body = format!(r#"{{"nvext":{first},"{key}":{second}}}"#);
                assert_eq!(reason(&body), Reason::Duplicate, "{body}");
                let body = format!(r#"{{"{key}":{first},"model":"m","nvext":{second}}}"#);
                assert_eq!(reason(&body), Reason::Duplicate, "{body}");
            }
        }
        let list = r#"["x-bypass-remote-prefill"]"#;
        for (first, second) in [(list, "[]"), ("[]", list), (list, "null"), ("null", list)] {
            for key in ["annotations", "annot\\u0061tions"] {
                let body = format!(r#"{{"nvext":{{"annotations":{first},"{key}":{second}}}}}"#);
                assert_eq!(reason(&body), Reason::Duplicate, "{body}");
            }
        }
        // Other keys may repeat.
        assert!(run(&layer(), r#"{"a":1,"a":2,"nvext":{"b":1,"b":2}}"#).is_ok());
    }

    #[test]
    fn other_shapes_of_nvext_and_annotations_are_refused() {
        for body in [
            r#"{"nvext":"x-bypass-remote-prefill"}"#,
            r#"{"nvext":["x-bypass-remote-prefill"]}"#,
            r#"{"nvext":1}"#,
            r#"{"nvext":true}"#,
            r#"{"nvext":{"annotations":"x-bypass-remote-prefill"}}"#,
            r#"{"nvext":{"annotations":{"x-bypass-remote-prefill":true}}}"#,
            r#"{"nvext":{"annotations":false}}"#,
            r#"{"nvext":{"annotations":0}}"#,
        ] {
            assert_eq!(reason(body), Reason::Shape, "{body}");
        }
    }

    #[test]
    fn input_that_is_not_rfc_8259_json_is_refused() {
        let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        let deep_in_nvext = format!(
            r#"{{"nvext":{{"x":{}{}}}}}"#,
            "{\"a\":".repeat(200),
            "}".repeat(200)
        );
        let deep_entry = format!(
            r#"{{"nvext":{{"annotations":[{}{}]}}}}"#,
            "[".repeat(200),
            "]".repeat(200)
        );
        let deep_value = format!(r#"{{"m":{}{}}}"#, "[".repeat(129), "]".repeat(129));
        for body in [
            "",
            " ",
            "{",
            r#"{"nvext":{"annotations":["x-bypass-remote-prefill""#,
            r#"{"nvext":{"annotations":["x-bypass-remote-prefill"]}"#,
            r#"{"nvext":{"annotations":["x-bypass-remote-prefill"]}}x"#,
            r#"{"a":1}{"nvext":{"annotations":["x-bypass-remote-prefill"]}}"#,
            r#"{"a":1} 2"#,
            r#"{"a":NaN}"#,
            r#"{"a":Infinity}"#,
            r#"{"a":-Infinity}"#,
            r#"{"nvext":{"annotations":[NaN,"x-bypass-remote-prefill"]}}"#,
            r#"{"a":1,}"#,
            r#"{"nvext":{"annotations":["a",]}}"#,
            r#"{"a":1 /* c */}"#,
            r#"{'a':1}"#,
            r#"{"a":01}"#,
            r#"{"a":"tab	in string"}"#,
            r#"{a:1}"#,
            r#"{"a" 1}"#,
            r#"{"a":1 "b":2}"#,
            "\u{feff}{}",
            r#"{"nvext":{"annotations":["\ud800"]}}"#,
            r#"{"\udc00":1}"#,
            r#"{"nvext":{"annotations":["\x"]}}"#,
            &deep,
            &deep_in_nvext,
            &deep_entry,
            &deep_value,
        ] {
            assert_eq!(reason(body), Reason::Invalid, "{body:.80}");
        }
        assert_eq!(
            guard(&layer().config, b"{\"a\":\"\xff\"}")
                .unwrap_err()
                .reason,
            Reason::Invalid
        );
    }

    #[test]
    fn error_messages_say_where() {
        let e = run(&layer(), "{\"a\":1,\n\"b\":NaN}").unwrap_err();
        assert_eq!(
            e.message,
            "the request body is not valid JSON: expected value at byte 12"
        );
        let e = run(&layer(), r#"{"a":1}x"#).unwrap_err();
        assert_eq!(
            e.message,
            "the request body is not valid JSON: trailing data after the JSON value at byte 7"
        );
    }

    #[test]
    fn the_nesting_limit_is_serde_jsons() {
        for depth in 120..135 {
            let open = "[\"]\\\"[{\",".repeat(depth);
            for doc in [
                format!("{}{}", open, "]".repeat(depth)),
                format!(r#"{{"m":{}{}}}"#, open, "]".repeat(depth)),
                format!(
                    r#"{{"nvext":{{"annotations":[{}{}]}}}}"#,
                    open,
                    "]".repeat(depth)
                ),
            ] {
                let serde = serde_json::from_str::<serde_json::Value>(&doc).is_ok();
                assert_eq!(
                    run(&layer(), &doc).is_ok(),
                    serde,
                    "depth {depth}: {doc:.40}"
                );
            }
        }
    }
}
