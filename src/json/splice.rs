//! The sans-IO half of the JSON guard: bytes in, a decision out. No async, no http types.
//!
//! [`guard`] reads a request body once, in one pass that validates it (RFC 8259 grammar, UTF-8
//! inside strings, the nesting limit) and finds the three containers the guard looks into: the
//! top-level object, `nvext` and `nvext.annotations`. Every other value is stepped over without
//! being decoded. Only keys of the first two objects and string entries of the array are
//! unescaped, with serde_json, to be compared.
//!
//! The pass is the crate's own because checking UTF-8 apart (`str::from_utf8` on the whole body,
//! which serde_json needs to borrow a [`RawValue`](serde_json::value::RawValue) from it) and then
//! skipping with serde_json reads every byte twice; the `json` fuzz target holds the pass to
//! serde_json's verdict on every input.

use std::borrow::Cow;
use std::ops::Range;

use crate::config::Config;
use crate::RequestedAnnotations;

/// What the guard decided for a body it accepted.
#[derive(Debug)]
pub(crate) struct Guarded {
    /// The configured names the client asked for and may have.
    pub(crate) granted: RequestedAnnotations,
    /// `None`: forward the body as it is.
    pub(crate) splice: Option<Splice>,
    /// The router-owned names stripped (bit `i` for the configuration's name `i`).
    pub(crate) stripped: u64,
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
    let mut walk = Walk {
        bytes: body,
        pos: 0,
    };
    let mut out = Guarded {
        granted: RequestedAnnotations::new(),
        splice: None,
        stripped: 0,
    };
    walk.skip_ws();
    if walk.peek()? == b'{' {
        walk.top_level(config, &mut out)?;
    } else {
        walk.value(0)?;
    }
    walk.skip_ws();
    if walk.pos != body.len() {
        return Err(walk.invalid("trailing data after the JSON value"));
    }
    Ok(out)
}

/// The nesting serde_json refuses when it deserializes a document (its recursion limit): 128
/// levels of arrays and objects, counted from the top; 127 pass. A document the upstream's parser
/// may refuse, or overflow its stack on, is refused here.
const MAX_DEPTH: u32 = 128;

/// Eight copies of a byte, one in each byte of a `u64`.
const fn splat(byte: u8) -> u64 {
    0x0101_0101_0101_0101 * byte as u64
}

/// Whether a byte inside a string needs a closer look: `"`, `\`, a control character (which
/// RFC 8259 does not allow unescaped) and, when `NON_ASCII`, a byte of a UTF-8 sequence.
fn is_special<const NON_ASCII: bool>(byte: u8) -> bool {
    matches!(byte, b'"' | b'\\' | ..0x20) || (NON_ASCII && byte >= 0x80)
}

/// The index of the first byte of `s` that [`is_special`], or `s.len()`.
///
/// Eight bytes at a time: in each of the tests (equal to `"`, equal to `\`, below 0x20, top bit
/// set) a matching byte sets its top bit. A borrow can set the top bit of a byte above one that
/// matched, never below it, so the lowest set bit is the first special byte.
fn find_special<const NON_ASCII: bool>(s: &[u8]) -> usize {
    const ONES: u64 = splat(0x01);
    const TOPS: u64 = splat(0x80);
    let hits = |word: &[u8]| {
        let x = u64::from_le_bytes(word.try_into().expect("eight bytes"));
        let quote = x ^ splat(b'"');
        let backslash = x ^ splat(b'\\');
        let mut hits = (quote.wrapping_sub(ONES) & !quote)
            | (backslash.wrapping_sub(ONES) & !backslash)
            | (x.wrapping_sub(splat(0x20)) & !x);
        if NON_ASCII {
            hits |= x;
        }
        hits & TOPS
    };
    let at = |hits: u64| (hits.trailing_zeros() / 8) as usize;
    // Sixteen bytes a round: one branch for both words, as most rounds find nothing.
    let mut pairs = s.chunks_exact(16);
    let mut offset = 0;
    for pair in &mut pairs {
        let (low, high) = (hits(&pair[..8]), hits(&pair[8..]));
        if low | high != 0 {
            return offset + if low != 0 { at(low) } else { 8 + at(high) };
        }
        offset += 16;
    }
    let rest = pairs.remainder();
    offset
        + rest
            .iter()
            .position(|&b| is_special::<NON_ASCII>(b))
            .unwrap_or(rest.len())
}

/// A UTF-8 validator as a deterministic automaton over bytes, in the "shift DFA" form: a state is
/// a bit offset (a multiple of 6), and `TABLE[byte] >> state & 63` is the next one: each byte
/// costs a load and a shift. It accepts exactly the well-formed sequences of
/// RFC 3629, section 4: no overlong form, no surrogate, nothing above U+10FFFF.
mod utf8 {
    /// A whole number of characters so far.
    pub(super) const ACCEPT: u64 = 0;
    const REJECT: u64 = 6;
    /// One, two or three continuation bytes (0x80 to 0xBF) to come.
    const TAIL_1: u64 = 12;
    const TAIL_2: u64 = 18;
    const TAIL_3: u64 = 24;
    /// After 0xE0 (0xA0 to 0xBF next: no overlong form), 0xED (0x80 to 0x9F: no surrogate),
    /// 0xF0 (0x90 to 0xBF: no overlong form) and 0xF4 (0x80 to 0x8F: nothing above U+10FFFF).
    const AFTER_E0: u64 = 30;
    const AFTER_ED: u64 = 36;
    const AFTER_F0: u64 = 42;
    const AFTER_F4: u64 = 48;

    const fn next(state: u64, byte: u8) -> u64 {
        let tail = matches!(byte, 0x80..=0xBF);
        match state {
            ACCEPT => match byte {
                0x00..=0x7F => ACCEPT,
                0xC2..=0xDF => TAIL_1,
                0xE0 => AFTER_E0,
                0xE1..=0xEC | 0xEE..=0xEF => TAIL_2,
                0xED => AFTER_ED,
                0xF0 => AFTER_F0,
                0xF1..=0xF3 => TAIL_3,
                0xF4 => AFTER_F4,
                _ => REJECT,
            },
            TAIL_1 if tail => ACCEPT,
            TAIL_2 if tail => TAIL_1,
            TAIL_3 if tail => TAIL_2,
            AFTER_E0 if matches!(byte, 0xA0..=0xBF) => TAIL_1,
            AFTER_ED if matches!(byte, 0x80..=0x9F) => TAIL_1,
            AFTER_F0 if matches!(byte, 0x90..=0xBF) => TAIL_2,
            AFTER_F4 if matches!(byte, 0x80..=0x8F) => TAIL_2,
            _ => REJECT,
        }
    }

    static TABLE: [u64; 256] = {
        let mut table = [0; 256];
        let mut byte = 0;
        while byte < 256 {
            let mut state = 0;
            while state <= AFTER_F4 {
                table[byte] |= next(state, byte as u8) << state;
                state += 6;
            }
            byte += 1;
        }
        table
    };

    /// The length of the run of non-ASCII bytes `bytes` starts with, and the state after it.
    pub(super) fn non_ascii_run(bytes: &[u8]) -> (usize, u64) {
        let mut state = ACCEPT;
        for (i, &b) in bytes.iter().enumerate() {
            if b.is_ascii() {
                return (i, state);
            }
            state = (TABLE[usize::from(b)] >> state) & 63;
        }
        (bytes.len(), state)
    }
}

/// A cursor over the document.
struct Walk<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Walk<'a> {
    fn invalid(&self, what: &str) -> Rejection {
        invalid_at(what, self.pos)
    }

    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.bytes.get(self.pos) {
            self.pos += 1;
        }
    }

    /// The byte at the cursor; the end of the body here is a truncated document.
    fn peek(&self) -> Result<u8, Rejection> {
        self.bytes
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

    /// After a member or an element: skips whitespace and a `,` (returning `true`, with the
    /// whitespace after it skipped) or the closing `close` (returning `false`).
    fn next_or_close(&mut self, close: u8) -> Result<bool, Rejection> {
        self.skip_ws();
        match self.peek()? {
            b',' => {
                self.pos += 1;
                self.skip_ws();
                Ok(true)
            }
            found if found == close => {
                self.pos += 1;
                Ok(false)
            }
            _ => Err(self.invalid(if close == b'}' {
                "expected `,` or `}`"
            } else {
                "expected `,` or `]`"
            })),
        }
    }

    /// Steps over the value at the cursor (which is not whitespace), whose container is `depth`
    /// levels deep (0 for the top level); returns where it starts.
    ///
    /// Nested arrays and objects are walked with a stack of one bit a level (set for an object),
    /// not by recursion, so no input can exhaust the thread's stack.
    fn value(&mut self, depth: u32) -> Result<usize, Rejection> {
        let start = self.pos;
        // Bit `i` is set when the container `i + 1` levels below `depth` is an object.
        let mut objects: u128 = 0;
        let mut open: u32 = 0;
        loop {
            // A value.
            match self.peek()? {
                c @ (b'{' | b'[') => {
                    if depth + open + 1 >= MAX_DEPTH {
                        return Err(invalid_at(
                            &format!("nested deeper than {} levels", MAX_DEPTH - 1),
                            self.pos,
                        ));
                    }
                    let object = c == b'{';
                    objects = (objects & !(1 << open)) | (u128::from(object) << open);
                    open += 1;
                    self.pos += 1;
                    self.skip_ws();
                    let close = if object { b'}' } else { b']' };
                    if self.peek()? == close {
                        self.pos += 1;
                        open -= 1;
                    } else {
                        if object {
                            self.member_key()?;
                        }
                        continue;
                    }
                }
                b'"' => self.string()?,
                b'-' | b'0'..=b'9' => self.number()?,
                b't' => self.literal(b"true")?,
                b'f' => self.literal(b"false")?,
                b'n' => self.literal(b"null")?,
                _ => return Err(self.invalid("expected value")),
            }
            // After a value: close containers until one has a next element.
            loop {
                if open == 0 {
                    return Ok(start);
                }
                let object = objects & (1 << (open - 1)) != 0;
                if self.next_or_close(if object { b'}' } else { b']' })? {
                    if object {
                        self.member_key()?;
                    }
                    break;
                }
                open -= 1;
            }
        }
    }

    /// A key that is only stepped over, `:` and the whitespace around it.
    fn member_key(&mut self) -> Result<(), Rejection> {
        if self.peek()? != b'"' {
            return Err(self.invalid("expected a string key"));
        }
        self.string()?;
        self.skip_ws();
        self.expect(b':', "expected `:`")?;
        self.skip_ws();
        Ok(())
    }

    /// Steps over the string whose `"` is at the cursor, checking its escapes, that it has no
    /// control character and that it is UTF-8.
    fn string(&mut self) -> Result<(), Rejection> {
        self.pos += 1;
        loop {
            self.pos += find_special::<true>(&self.bytes[self.pos..]);
            match self.peek()? {
                b'"' => {
                    self.pos += 1;
                    return Ok(());
                }
                b'\\' => match self.bytes.get(self.pos + 1) {
                    Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => self.pos += 2,
                    Some(b'u') => {
                        let hex = self.bytes.get(self.pos + 2..self.pos + 6);
                        match hex {
                            Some(hex) if hex.iter().all(u8::is_ascii_hexdigit) => self.pos += 6,
                            Some(_) => return Err(self.invalid("invalid `\\u` escape in a string")),
                            None => {
                                self.pos = self.bytes.len();
                                return Err(self.invalid("unexpected end of the body"));
                            }
                        }
                    }
                    Some(_) => return Err(self.invalid("invalid escape in a string")),
                    None => {
                        self.pos += 1;
                        return Err(self.invalid("unexpected end of the body"));
                    }
                },
                ..0x20 => return Err(self.invalid("control character in a string")),
                _ => {
                    // A run of non-ASCII bytes. Every byte of a UTF-8 sequence is 0x80 or above,
                    // so the string is UTF-8 exactly when each such run is UTF-8 on its own.
                    let (len, state) = utf8::non_ascii_run(&self.bytes[self.pos..]);
                    let run = &self.bytes[self.pos..self.pos + len];
                    if state != utf8::ACCEPT {
                        // Where it fails, for the message.
                        self.pos += match std::str::from_utf8(run) {
                            Ok(_) => run.len(),
                            Err(e) => e.valid_up_to(),
                        };
                        return Err(self.invalid("the request body is not UTF-8"));
                    }
                    self.pos += run.len();
                }
            }
        }
    }

    /// Steps over the number at the cursor: `-`, then `0` or digits not starting with `0`, then
    /// optionally a fraction and an exponent. Its value is not read: `1e400` passes.
    fn number(&mut self) -> Result<(), Rejection> {
        if self.bytes[self.pos] == b'-' {
            self.pos += 1;
        }
        match self.peek()? {
            b'0' => self.pos += 1,
            b'1'..=b'9' => self.digits(),
            _ => return Err(self.invalid("invalid number")),
        }
        if self.bytes.get(self.pos) == Some(&b'.') {
            self.pos += 1;
            self.one_or_more_digits()?;
        }
        if let Some(b'e' | b'E') = self.bytes.get(self.pos) {
            self.pos += 1;
            if let Some(b'+' | b'-') = self.bytes.get(self.pos) {
                self.pos += 1;
            }
            self.one_or_more_digits()?;
        }
        Ok(())
    }

    fn digits(&mut self) {
        while self.bytes.get(self.pos).is_some_and(u8::is_ascii_digit) {
            self.pos += 1;
        }
    }

    fn one_or_more_digits(&mut self) -> Result<(), Rejection> {
        if !self.peek()?.is_ascii_digit() {
            return Err(self.invalid("invalid number"));
        }
        self.digits();
        Ok(())
    }

    /// Steps over `word` (`true`, `false` or `null`), which must be at the cursor.
    fn literal(&mut self, word: &[u8]) -> Result<(), Rejection> {
        let end = self.pos + word.len();
        match self.bytes.get(self.pos..end) {
            Some(found) if found == word => {
                self.pos = end;
                Ok(())
            }
            Some(_) => Err(self.invalid("expected value")),
            None => {
                self.pos = self.bytes.len();
                Err(self.invalid("unexpected end of the body"))
            }
        }
    }

    /// The string at the cursor, unescaped, with the cursor after it.
    fn decoded_string(&mut self) -> Result<Cow<'a, str>, Rejection> {
        let start = self.pos;
        self.string()?;
        unescape(&self.bytes[start..self.pos], start)
    }

    /// The key at the cursor, unescaped, with the cursor after its `:` and the whitespace after.
    fn key(&mut self) -> Result<Cow<'a, str>, Rejection> {
        if self.peek()? != b'"' {
            return Err(self.invalid("expected a string key"));
        }
        let key = self.decoded_string()?;
        self.skip_ws();
        self.expect(b':', "expected `:`")?;
        self.skip_ws();
        Ok(key)
    }

    /// Whether `null` is at the cursor (stepped over if so).
    fn null(&mut self) -> Result<bool, Rejection> {
        if self.peek()? != b'n' {
            return Ok(false);
        }
        self.literal(b"null")?;
        Ok(true)
    }

    /// The top-level object, the cursor at its `{`.
    fn top_level(&mut self, config: &Config, out: &mut Guarded) -> Result<(), Rejection> {
        self.members(1, "nvext", "the top-level object", |this| {
            this.nvext(config, out)
        })
    }

    /// The value of `nvext`: an object or null.
    fn nvext(&mut self, config: &Config, out: &mut Guarded) -> Result<(), Rejection> {
        if self.null()? {
            return Ok(());
        }
        if self.peek()? != b'{' {
            return Err(shape("`nvext` must be an object or null"));
        }
        self.members(2, "annotations", "`nvext`", |this| {
            this.annotations(config, out)
        })
    }

    /// The members of the object whose `{` is at the cursor, `depth` levels deep: `read` reads
    /// the value of `key`, a second `key` is refused, every other value is stepped over.
    fn members(
        &mut self,
        depth: u32,
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
                self.value(depth)?;
            }
            if !self.next_or_close(b'}')? {
                return Ok(());
            }
        }
    }

    /// The value of `nvext.annotations`: an array or null. Decides every string entry.
    fn annotations(&mut self, config: &Config, out: &mut Guarded) -> Result<(), Rejection> {
        if self.null()? {
            return Ok(());
        }
        if self.peek()? != b'[' {
            return Err(shape("`nvext.annotations` must be an array or null"));
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
            let start = self.pos;
            let mut keep = true;
            if self.peek()? == b'"' {
                let entry = self.decoded_string()?;
                let decision = config.guard_entry(&entry);
                if let Some(name) = decision.grant {
                    out.granted.insert(name);
                }
                if let Some(i) = decision.strip {
                    out.stripped |= 1 << i;
                    keep = false;
                    stripped = true;
                }
            } else {
                self.value(3)?;
            }
            entries.push((start..self.pos, keep));
            if !self.next_or_close(b']')? {
                break;
            }
        }
        if stripped {
            let span = open..self.pos;
            out.splice = Some(Splice {
                array: rebuild(self.bytes, &span, &entries),
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

/// The contents of the JSON string literal `raw`, which starts at byte `start` and which
/// [`Walk::string`] accepted, unescaped (borrowed when it has no escape). Decoding an escape can
/// still fail: `\ud800` alone is not a character.
fn unescape(raw: &[u8], start: usize) -> Result<Cow<'_, str>, Rejection> {
    let inner = &raw[1..raw.len() - 1];
    if memchr::memchr(b'\\', inner).is_some() {
        serde_json::from_slice::<String>(raw)
            .map(Cow::Owned)
            .map_err(|e| {
                // The message without serde_json's position, which is given in the body's terms.
                let message = e.to_string();
                let what = message
                    .rfind(" at line ")
                    .map_or(&*message, |cut| &message[..cut]);
                invalid_at(what, start + e.column().saturating_sub(1))
            })
    } else {
        // Checked already by the pass; a key or an entry is short, so checking again costs little
        // and keeps this safe code.
        std::str::from_utf8(inner)
            .map(Cow::Borrowed)
            .map_err(|e| invalid_at("the request body is not UTF-8", start + 1 + e.valid_up_to()))
    }
}

fn invalid_at(what: &str, at: usize) -> Rejection {
    Rejection::new(
        Reason::Invalid,
        format!("the request body is not valid JSON: {what} at byte {at}"),
    )
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

    /// A small xorshift generator: the tests below need many inputs, not a dependency.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    #[test]
    fn find_special_finds_the_first_special_byte_wherever_it_is() {
        // Bytes on both sides of every boundary the word tests draw, and the ones they look for:
        // a borrow from one byte into the next must never make an earlier byte look special.
        let palette = [
            0x00, 0x01, 0x1F, 0x20, 0x21, 0x22, 0x23, 0x41, 0x5B, 0x5C, 0x5D, 0x7E, 0x7F, 0x80,
            0xA2, 0xDC, 0xFF,
        ];
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        for _ in 0..200_000 {
            let len = (rng.next() % 40) as usize;
            let ordinary = rng.next() % 4 != 0;
            let s: Vec<u8> = (0..len)
                .map(|_| {
                    let b = palette[(rng.next() % palette.len() as u64) as usize];
                    // Mostly ordinary bytes, so that the first special one falls anywhere.
                    if ordinary && is_special::<true>(b) && rng.next() % 8 != 0 {
                        b'a'
                    } else {
                        b
                    }
                })
                .collect();
            let first = |non_ascii: bool| {
                s.iter()
                    .position(|&b| matches!(b, b'"' | b'\\' | ..0x20) || (non_ascii && b >= 0x80))
                    .unwrap_or(len)
            };
            assert_eq!(find_special::<true>(&s), first(true), "{s:02x?}");
            assert_eq!(find_special::<false>(&s), first(false), "{s:02x?}");
        }
    }

    #[test]
    fn long_strings_are_judged_as_serde_json_judges_them() {
        // Whole and broken UTF-8 sequences, ASCII, and what ends a run of non-ASCII text.
        let pieces: [&[u8]; 16] = [
            b"a",
            b"abcdefghijklmnopq",
            b" ",
            "\u{e9}".as_bytes(),
            "\u{6771}\u{4eac}".as_bytes(),
            "\u{1F642}".as_bytes(),
            b"\xE6\x9D",
            b"\x9D",
            b"\xC0\xAF",
            b"\xED\xA0\x80",
            b"\xF4\x90\x80\x80",
            b"\xFF",
            b"\\\"",
            b"\\u00e9",
            b"\t",
            b"\"",
        ];
        let mut rng = Rng(0x2545_F491_4F6C_DD1D);
        for _ in 0..50_000 {
            let mut doc = b"[\"".to_vec();
            for _ in 0..rng.next() % 12 {
                let piece = pieces[(rng.next() % (pieces.len() as u64 - 1)) as usize];
                doc.extend_from_slice(piece);
            }
            doc.extend_from_slice(b"\"]");
            let serde = serde_json::from_slice::<serde_json::Value>(&doc).is_ok();
            let ours = guard(&layer().config, &doc).is_ok();
            assert_eq!(ours, serde, "{:?}", String::from_utf8_lossy(&doc));
        }
    }

    #[test]
    fn utf8_runs_are_accepted_exactly_when_the_standard_library_accepts_them() {
        let check = |s: &[u8]| {
            let (len, state) = utf8::non_ascii_run(s);
            let run = s.iter().position(u8::is_ascii).unwrap_or(s.len());
            assert_eq!(len, run, "{s:02x?}");
            assert_eq!(
                state == utf8::ACCEPT,
                std::str::from_utf8(&s[..run]).is_ok(),
                "{s:02x?}"
            );
        };
        for a in 0..=0xFF {
            check(&[a]);
            for b in 0..=0xFF {
                check(&[a, b]);
                if a >= 0x80 {
                    for c in 0..=0xFF {
                        check(&[a, b, c]);
                        if a >= 0xF0 || b >= 0xF0 {
                            for d in [0x00, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xFF] {
                                check(&[a, b, c, d]);
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn strings_are_judged_as_serde_json_judges_them() {
        // Every string of two arbitrary bytes, as a value and as a key.
        for a in 0..=0xFF_u8 {
            for b in 0..=0xFF_u8 {
                for doc in [
                    vec![b'[', b'"', a, b, b'"', b']'],
                    vec![b'{', b'"', a, b, b'"', b':', b'1', b'}'],
                ] {
                    let serde = serde_json::from_slice::<serde_json::Value>(&doc).is_ok();
                    let ours = guard(&layer().config, &doc).is_ok();
                    assert_eq!(ours, serde, "{doc:02x?}");
                }
            }
        }
        for escape in [
            r#"["\u00e9"]"#,
            r#"["\u00E9\uD83D\uDE42"]"#,
            r#"["\u00g9"]"#,
            r#"["\u00e"]"#,
            r#"["\u"]"#,
            r#"["\"#,
            r#"["\u00e9"#,
            "[\"\\\u{e9}\"]",
        ] {
            let serde = serde_json::from_str::<serde_json::Value>(escape).is_ok();
            let ours = guard(&layer().config, escape.as_bytes()).is_ok();
            assert_eq!(ours, serde, "{escape}");
        }
    }

    #[test]
    fn numbers_and_literals_are_judged_as_serde_json_judges_them() {
        for value in [
            "0",
            "-0",
            "1",
            "-1",
            "10",
            "01",
            "-01",
            "1.",
            "1.5",
            ".5",
            "-.5",
            "1e5",
            "1E+5",
            "1e-5",
            "1e",
            "1e+",
            "1.5e400",
            "-",
            "+1",
            "0x10",
            "1_000",
            "00",
            "0.0e0",
            "123456789012345678901234567890",
            "true",
            "false",
            "null",
            "tru",
            "nul",
            "True",
            "nulll",
            "truefalse",
            "-Infinity",
        ] {
            for doc in [
                value.to_owned(),
                format!("[{value}]"),
                format!("{{\"a\":{value}}}"),
            ] {
                let serde = serde_json::from_str::<serde::de::IgnoredAny>(&doc).is_ok();
                let ours = guard(&layer().config, doc.as_bytes()).is_ok();
                assert_eq!(ours, serde, "{doc}");
            }
        }
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
