//! The `chunked` transfer coding of HTTP/1.1 responses (RFC 9112 section 7.1), decoded in place.
//!
//! [`Decoder::decode`] takes whatever one read brought and moves the data of every chunk in it
//! together, over the chunk-size lines between them, so that a read that carried 370 events (a
//! server under load: TCP coalesces its writes) becomes one piece of data, handed on as one frame:
//! the proxy's cost is per read, not per chunk. A read that holds a single chunk's data moves
//! nothing. The decoder keeps the state of a chunk-size line, a chunk or the trailers across reads,
//! so any split of the bytes decodes the same. Each byte is looked at once or moved once.
//!
//! Malformed or hostile framing is an error, never a guess: a size that is not hexadecimal or
//! needs more than 64 bits (leading zeros are no part of that: `000000000000000000A` is 10), a
//! size followed by whitespace and then anything but `;` or CR (`2 x`), a missing CRLF, a
//! chunk size or extensions or trailer section over its limit. The chunk-size line is read by
//! hyper's rule (`hyper::proto::h1::decode`): digits, optional spaces or tabs, then extensions
//! after `;`, which count against one budget for the whole body, [`MAX_EXTENSIONS`], as hyper's
//! do (a body of many chunks with long extensions fails, one long extension does not). The size
//! and the blanks around it have a limit of their own, [`MAX_LINE`], which hyper does not have.
//! The trailer section is read by hyper's rule too: its lines (each ended by CRLF) are kept, up to
//! [`MAX_TRAILERS`] bytes (the response head's limit, as hyper's `max_header_size` bounds both)
//! and [`MAX_TRAILER_FIELDS`] lines, and parsed as header fields (httparse) once the final empty
//! line arrives; a malformed section (a field name with a space, a line without a colon, a folded
//! line) is an error, so the body ends cut rather than complete. The trailers are then dropped.

use std::fmt;

/// The most bytes of a chunk-size line outside its extensions (the size with its leading zeros,
/// the blanks after it, the CRLF). hyper has no such limit.
pub(crate) const MAX_LINE: usize = 4 * 1024;
/// The chunk extensions of a whole body (the bytes after each `;`, up to the CR) must be fewer
/// than this: hyper's `CHUNKED_EXTENSIONS_LIMIT`, a budget for the body, not for one line.
pub(crate) const MAX_EXTENSIONS: u64 = 16 * 1024;
/// A trailer section (its lines and the final CRLF) must be shorter than this: the response
/// head's limit, as in hyper, whose `max_header_size` bounds the head and the trailers alike (the
/// trailers are read and dropped).
pub(crate) const MAX_TRAILERS: usize = 64 * 1024;
/// The most trailer lines accepted (the response head's limit on its fields).
pub(crate) const MAX_TRAILER_FIELDS: usize = 128;

/// Where the decoder is in the coding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Reading the hexadecimal chunk size; whether a digit came yet.
    Size {
        value: u64,
        digits: bool,
    },
    /// Spaces or tabs after the size: more of them, `;` or CR may follow, nothing else.
    SizeLws {
        value: u64,
    },
    /// Past a `;`: extensions until CR.
    Extension {
        value: u64,
    },
    /// After the CR of a chunk-size line.
    SizeLf {
        value: u64,
    },
    /// Inside a chunk's data: this many bytes left.
    Data(u64),
    /// After a chunk's data: CR, then LF.
    DataCr,
    DataLf,
    /// At the start of a trailer line (or the final CRLF).
    TrailerStart,
    /// Inside a trailer line.
    Trailer,
    /// After the CR of a trailer line.
    TrailerLf,
    /// After the CR of the final empty line.
    EndLf,
    /// The terminal chunk and its trailers were read: the body is complete.
    Done,
}

/// A malformed `chunked` body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ChunkedError(pub(crate) &'static str);

impl fmt::Display for ChunkedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "malformed chunked response body: {}", self.0)
    }
}

impl std::error::Error for ChunkedError {}

/// What [`Decoder::decode`] made of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Decoded {
    /// The decoded data is `buf[start..end]`.
    pub(crate) start: usize,
    pub(crate) end: usize,
    /// How many bytes of the buffer the coding took: all of them, unless the body ended before
    /// the buffer did (the rest then belongs to no message of this exchange).
    pub(crate) consumed: usize,
    /// How many chunks' data ended in the buffer.
    pub(crate) chunks: usize,
}

/// The decoder of one `chunked` body.
#[derive(Debug, Clone)]
pub(crate) struct Decoder {
    state: State,
    /// Bytes of the current chunk-size line outside its extensions, or of the trailers so far.
    line: usize,
    /// Bytes of chunk extensions in the body so far.
    extensions: u64,
    /// The trailer section so far (allocated only when there is one), parsed at its end.
    trailers: Vec<u8>,
    /// How many trailer lines have ended.
    fields: usize,
}

impl Default for Decoder {
    fn default() -> Self {
        Self {
            state: State::Size {
                value: 0,
                digits: false,
            },
            line: 0,
            extensions: 0,
            trailers: Vec::new(),
            fields: 0,
        }
    }
}

impl Decoder {
    /// Whether the terminal chunk and the trailers have been read.
    pub(crate) fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Decodes `reads` one after the other, each copied into a buffer of its own as a socket
    /// read would fill it, up to the end of the body: the data, and how many bytes of all the
    /// reads the coding took. Checks the decoder's promises on each read as it goes (the data lies
    /// within what was taken, and all of a read is taken unless the body ended in it); the unit
    /// tests and the `chunked` fuzz target both decode through it.
    pub(crate) fn decode_reads(
        &mut self,
        reads: &[&[u8]],
    ) -> Result<(Vec<u8>, usize), ChunkedError> {
        let mut data = Vec::new();
        let mut taken = 0;
        for read in reads {
            let mut buf = read.to_vec();
            let decoded = self.decode(&mut buf)?;
            assert!(decoded.start <= decoded.end && decoded.end <= decoded.consumed);
            assert!(decoded.consumed <= buf.len());
            assert!(self.is_done() || decoded.consumed == buf.len());
            data.extend_from_slice(&buf[decoded.start..decoded.end]);
            taken += decoded.consumed;
            if self.is_done() {
                break;
            }
        }
        Ok((data, taken))
    }

    /// Decodes `buf` in place: the data of its chunks ends up together in
    /// `buf[decoded.start..decoded.end]`, where the first chunk's data began (nothing moves when
    /// `buf` holds the data of one chunk only). Stops at the end of the body.
    pub(crate) fn decode(&mut self, buf: &mut [u8]) -> Result<Decoded, ChunkedError> {
        let mut read = 0;
        // Where the data begins, and where the next chunk's data goes.
        let mut start = None;
        let mut write = 0;
        let mut chunks = 0;
        while read < buf.len() {
            match self.state {
                State::Data(left) => {
                    let n = usize::try_from(left)
                        .unwrap_or(usize::MAX)
                        .min(buf.len() - read);
                    if start.is_none() {
                        start = Some(read);
                        write = read;
                    }
                    if write != read {
                        buf.copy_within(read..read + n, write);
                    }
                    write += n;
                    read += n;
                    let left = left - n as u64;
                    self.state = if left == 0 {
                        chunks += 1;
                        State::DataCr
                    } else {
                        State::Data(left)
                    };
                }
                State::Done => break,
                _ => {
                    self.step(buf[read])?;
                    read += 1;
                }
            }
        }
        let start = start.unwrap_or(0);
        Ok(Decoded {
            start,
            end: write.max(start),
            consumed: read,
            chunks,
        })
    }

    /// One byte outside a chunk's data.
    fn step(&mut self, byte: u8) -> Result<(), ChunkedError> {
        match self.state {
            // hyper's count: every byte of an extension but the CR that ends it (a LF there is
            // an error below).
            State::Extension { .. } if byte != b'\r' && byte != b'\n' => {
                self.extensions += 1;
                if self.extensions >= MAX_EXTENSIONS {
                    return Err(ChunkedError("chunk extensions of 16 KiB or more"));
                }
            }
            State::Size { .. }
            | State::SizeLws { .. }
            | State::Extension { .. }
            | State::SizeLf { .. } => {
                self.line += 1;
                if self.line > MAX_LINE {
                    return Err(ChunkedError("a chunk size and blanks over 4 KiB"));
                }
            }
            // hyper's count: the section's bytes, the final CRLF included, when there is one.
            State::TrailerStart | State::Trailer | State::TrailerLf | State::EndLf => {
                self.line += 1;
                if self.line >= MAX_TRAILERS {
                    return Err(ChunkedError("trailers of 64 KiB or more"));
                }
            }
            _ => {}
        }
        self.state = match (self.state, byte) {
            (State::Size { value, .. }, _) if byte.is_ascii_hexdigit() => {
                // Leading zeros are free; only a value past 64 bits is refused.
                if value > u64::MAX >> 4 {
                    return Err(ChunkedError("a chunk size over 64 bits"));
                }
                let digit = (byte as char).to_digit(16).unwrap_or(0);
                State::Size {
                    value: value << 4 | u64::from(digit),
                    digits: true,
                }
            }
            (State::Size { digits: false, .. }, b'\r' | b'\n' | b' ' | b'\t' | b';') => {
                return Err(ChunkedError("a chunk-size line without a size"))
            }
            (
                State::Size { value, .. } | State::SizeLws { value } | State::Extension { value },
                b'\r',
            ) => State::SizeLf { value },
            (State::Size { .. } | State::SizeLws { .. } | State::Extension { .. }, b'\n') => {
                return Err(ChunkedError("a chunk-size line ended by LF without CR"))
            }
            (State::Size { value, .. } | State::SizeLws { value }, b' ' | b'\t') => {
                State::SizeLws { value }
            }
            (State::Size { value, .. } | State::SizeLws { value }, b';') => {
                State::Extension { value }
            }
            (State::Size { .. }, _) => {
                return Err(ChunkedError("a chunk size that is not hexadecimal"))
            }
            (State::SizeLws { .. }, _) => {
                return Err(ChunkedError(
                    "whitespace after a chunk size followed by no `;`",
                ))
            }
            (State::Extension { value }, _) => State::Extension { value },
            (State::SizeLf { value }, b'\n') => {
                self.line = 0;
                if value == 0 {
                    State::TrailerStart
                } else {
                    State::Data(value)
                }
            }
            (State::SizeLf { .. }, _) => {
                return Err(ChunkedError("a CR without LF after a chunk size"))
            }
            (State::DataCr, b'\r') => State::DataLf,
            (State::DataCr, _) => return Err(ChunkedError("no CRLF after a chunk's data")),
            (State::DataLf, b'\n') => State::Size {
                value: 0,
                digits: false,
            },
            (State::DataLf, _) => return Err(ChunkedError("no CRLF after a chunk's data")),
            // As hyper reads them: a line is any bytes up to a CR, which a LF must follow (a
            // bare LF is kept in the line, for the parse at the end to judge).
            (State::TrailerStart, b'\r') => {
                if !self.trailers.is_empty() {
                    self.trailers.push(byte);
                }
                State::EndLf
            }
            (State::TrailerStart | State::Trailer, _) => {
                self.trailers.push(byte);
                if byte == b'\r' {
                    State::TrailerLf
                } else {
                    State::Trailer
                }
            }
            (State::TrailerLf, b'\n') => {
                if self.fields >= MAX_TRAILER_FIELDS {
                    return Err(ChunkedError("more than 128 trailer lines"));
                }
                self.fields += 1;
                self.trailers.push(byte);
                State::TrailerStart
            }
            (State::TrailerLf, _) => return Err(ChunkedError("a CR without LF in the trailers")),
            (State::EndLf, b'\n') => {
                if !self.trailers.is_empty() {
                    self.trailers.push(byte);
                    let trailers = std::mem::take(&mut self.trailers);
                    check_trailers(&trailers, self.fields)?;
                }
                State::Done
            }
            (State::EndLf, _) => return Err(ChunkedError("a CR without LF at the body's end")),
            (State::Data(_) | State::Done, _) => unreachable!("handled by `decode`"),
        };
        Ok(())
    }
}

/// Whether a trailer section (its lines and the final empty line) parses as header fields, by the
/// rule hyper applies to it: httparse's, with as many fields as the section has lines, then each
/// name and value as `http` takes them.
fn check_trailers(section: &[u8], lines: usize) -> Result<(), ChunkedError> {
    let mut fields = vec![httparse::EMPTY_HEADER; lines];
    match httparse::parse_headers(section, &mut fields) {
        Ok(httparse::Status::Complete((_, fields))) => {
            for field in fields.iter() {
                if http::HeaderName::from_bytes(field.name.as_bytes()).is_err()
                    || http::HeaderValue::from_bytes(field.value).is_err()
                {
                    return Err(ChunkedError("a malformed trailer field"));
                }
            }
            Ok(())
        }
        Ok(httparse::Status::Partial) | Err(_) => Err(ChunkedError("a malformed trailer section")),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// Decodes `pieces` as successive reads: the data, whether the body ended, and how many bytes
    /// the coding took.
    fn decode_all(pieces: &[&[u8]]) -> Result<(Vec<u8>, bool, usize), ChunkedError> {
        let mut decoder = Decoder::default();
        let (data, taken) = decoder.decode_reads(pieces)?;
        Ok((data, decoder.is_done(), taken))
    }

    fn encode(chunks: &[Vec<u8>], ext: bool, trailers: bool) -> Vec<u8> {
        let mut out = Vec::new();
        for chunk in chunks.iter().filter(|c| !c.is_empty()) {
            out.extend_from_slice(format!("{:X}", chunk.len()).as_bytes());
            if ext {
                out.extend_from_slice(b" ; name=\"v\"");
            }
            out.extend_from_slice(b"\r\n");
            out.extend_from_slice(chunk);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"0\r\n");
        if trailers {
            out.extend_from_slice(b"x-checksum: abc\r\nx-more: 1\r\n");
        }
        out.extend_from_slice(b"\r\n");
        out
    }

    #[test]
    fn many_chunks_in_one_read_become_one_piece_of_data() {
        let mut buf = b"5\r\nhello\r\n1\r\n \r\n5\r\nworld\r\n0\r\n\r\n".to_vec();
        let mut decoder = Decoder::default();
        let decoded = decoder.decode(&mut buf).unwrap();
        assert_eq!(&buf[decoded.start..decoded.end], b"hello world");
        assert!(decoder.is_done());
        assert_eq!(decoded.consumed, buf.len());
        assert_eq!(decoded.chunks, 3, "the last chunk carries no data");
    }

    /// `chunks` counts the chunks whose data ends in a read (what tells the proxy an upstream
    /// wrote faster than it was read), not the ones that begin there.
    #[test]
    fn chunks_count_the_data_that_ends_in_each_read() {
        let mut decoder = Decoder::default();
        let mut counts = Vec::new();
        for piece in [
            &b"5\r\nhel"[..],
            b"lo\r\n3\r\nabc\r\n2\r",
            b"\nde\r\n",
            b"0\r\n\r\n",
        ] {
            let mut buf = piece.to_vec();
            counts.push(decoder.decode(&mut buf).unwrap().chunks);
        }
        assert_eq!(counts, [0, 2, 1, 0]);
    }

    #[test]
    fn a_read_of_one_chunk_moves_nothing() {
        let mut buf = b"5\r\nhello\r\n".to_vec();
        let decoded = Decoder::default().decode(&mut buf).unwrap();
        assert_eq!((decoded.start, decoded.end), (3, 8));
        assert_eq!(buf, b"5\r\nhello\r\n");
    }

    #[test]
    fn bytes_after_the_end_of_the_body_are_not_consumed() {
        let (data, done, consumed) = decode_all(&[b"2\r\nok\r\n0\r\n\r\nHTTP/1.1"]).unwrap();
        assert_eq!((data.as_slice(), done, consumed), (&b"ok"[..], true, 12));
    }

    #[test]
    fn a_body_cut_short_is_not_done() {
        let (data, done, _) = decode_all(&[b"5\r\nhel"]).unwrap();
        assert_eq!((data.as_slice(), done), (&b"hel"[..], false));
    }

    #[test]
    fn malformed_framing_is_an_error_naming_what_is_wrong() {
        for (bytes, why) in [
            (&b"g\r\n"[..], "a chunk size that is not hexadecimal"),
            (b"\r\n", "a chunk-size line without a size"),
            (b"5\nhello", "a chunk-size line ended by LF without CR"),
            (b"5\rhello", "a CR without LF after a chunk size"),
            (b"2\r\nokX\r\n", "no CRLF after a chunk's data"),
            (b"2\r\nok\rX", "no CRLF after a chunk's data"),
            (b"10000000000000000\r\n", "a chunk size over 64 bits"),
            (b"0\r\nx: 1\ny: 2\r\n\r\n", "a malformed trailer section"),
            (b"0\r\nbad trailer\r\n\r\n", "a malformed trailer section"),
            (b"0\r\nx y: 1\r\n\r\n", "a malformed trailer section"),
            (
                b"0\r\nx-a: 1\r\n x-fold\r\n\r\n",
                "a malformed trailer section",
            ),
            (b"0\r\n\rX", "a CR without LF at the body's end"),
        ] {
            let err = decode_all(&[bytes]).unwrap_err();
            assert_eq!(
                err,
                ChunkedError(why),
                "{:?}",
                String::from_utf8_lossy(bytes)
            );
        }
    }

    #[test]
    fn a_size_of_sixteen_hex_digits_is_accepted() {
        let (data, done, _) =
            decode_all(&[b"000000000000000A\r\n0123456789\r\n0\r\n\r\n"]).unwrap();
        assert_eq!((data.as_slice(), done), (&b"0123456789"[..], true));
    }

    /// hyper's rule: leading zeros count for nothing, only the value may not pass 64 bits.
    #[test]
    fn leading_zeros_are_accepted_however_many_as_hyper_does() {
        let (data, done, _) =
            decode_all(&[b"0000000000000000000000A\r\n0123456789\r\n00000000000000000\r\n\r\n"])
                .unwrap();
        assert_eq!((data.as_slice(), done), (&b"0123456789"[..], true));
        assert_eq!(
            decode_all(&[b"010000000000000000\r\n"]).unwrap_err(),
            ChunkedError("a chunk size over 64 bits"),
        );
    }

    /// hyper's rule: after the size, spaces or tabs, then `;` (an extension) or the CR.
    #[test]
    fn whitespace_after_a_size_is_followed_by_an_extension_or_the_line_end_only() {
        let err = ChunkedError("whitespace after a chunk size followed by no `;`");
        for bytes in [&b"2 x\r\nok\r\n0\r\n\r\n"[..], b"2\t1\r\n", b"2 \t=\r\n"] {
            let what = String::from_utf8_lossy(bytes);
            assert_eq!(decode_all(&[bytes]).unwrap_err(), err, "{what}");
        }
        for bytes in [
            &b"2 \r\nok\r\n0\r\n\r\n"[..],
            b"2\t ;a=b\r\nok\r\n0\r\n\r\n",
            b"2;a b\r\nok\r\n0 ; x\r\n\r\n",
        ] {
            let what = String::from_utf8_lossy(bytes);
            let (data, done, _) = decode_all(&[bytes]).unwrap();
            assert_eq!((data.as_slice(), done), (&b"ok"[..], true), "{what}");
        }
    }

    /// A body of chunks of one byte, the line of each with an extension of that many bytes after
    /// its `;` (what hyper counts).
    fn extended(lens: &[usize]) -> Vec<u8> {
        let mut out = Vec::new();
        for &len in lens {
            out.extend_from_slice(b"1;");
            out.resize(out.len() + len, b'x');
            out.extend_from_slice(b"\r\nA\r\n");
        }
        out.extend_from_slice(b"0\r\n\r\n");
        out
    }

    /// hyper's budget (issue 34): the extensions of the whole body, not of one line. One line
    /// with a 5,000-byte extension completes; 20 lines of 1,000 bytes fail.
    #[test]
    fn chunk_extensions_count_against_one_budget_for_the_body_as_hyper_counts_them() {
        let (data, done, _) = decode_all(&[&extended(&[5000])]).unwrap();
        assert_eq!((data.len(), done), (1, true));
        let over = ChunkedError("chunk extensions of 16 KiB or more");
        assert_eq!(decode_all(&[&extended(&[1000; 20])]).unwrap_err(), over);
        // The boundary: 16,383 bytes after the `;`s pass, 16,384 fail, however they are spread.
        let most = MAX_EXTENSIONS as usize - 1;
        for lens in [
            vec![most],
            vec![most - 1, 1],
            vec![4000, 4000, 4000, most - 12_000],
        ] {
            let (data, done, _) = decode_all(&[&extended(&lens)]).unwrap();
            assert_eq!((data.len(), done), (lens.len(), true), "{lens:?}");
            let mut one_more = lens.clone();
            one_more.push(1);
            assert_eq!(decode_all(&[&extended(&one_more)]).unwrap_err(), over);
        }
    }

    #[test]
    fn endless_sizes_and_trailers_are_refused() {
        // The size and the blanks around it: hyper reads any number of leading zeros, this
        // decoder 4 KiB of them.
        for filler in [b'0', b' '] {
            let mut line = vec![b'1'; 1];
            line.resize(MAX_LINE + 10, filler);
            if filler == b'0' {
                line.reverse();
            }
            assert_eq!(
                decode_all(&[&line]).unwrap_err(),
                ChunkedError("a chunk size and blanks over 4 KiB")
            );
        }
        let mut trailers = b"0\r\nx-a: ".to_vec();
        trailers.resize(MAX_TRAILERS + 100, b'b');
        assert_eq!(
            decode_all(&[&trailers]).unwrap_err(),
            ChunkedError("trailers of 64 KiB or more")
        );
        let mut trailers = b"0\r\n".to_vec();
        for _ in 0..=MAX_TRAILER_FIELDS {
            trailers.extend_from_slice(b"x-a: b\r\n");
        }
        assert_eq!(
            decode_all(&[&trailers]).unwrap_err(),
            ChunkedError("more than 128 trailer lines")
        );
    }

    /// hyper's limit on a trailer section is its `max_header_size`, the head's (16 KiB when it is
    /// not set): a section, its final CRLF included, of one byte less passes, of the limit fails.
    #[test]
    fn a_trailer_section_up_to_the_heads_limit_completes_the_body() {
        let section = |len: usize| {
            let mut out = b"1\r\nA\r\n0\r\nx-a: ".to_vec();
            let start = out.len() - 5;
            out.resize(start + len - 4, b'b');
            out.extend_from_slice(b"\r\n\r\n");
            assert_eq!(out.len() - start, len);
            out
        };
        // Issue 34: a 20 KiB section.
        for len in [20 * 1024, MAX_TRAILERS - 1] {
            let (data, done, _) = decode_all(&[&section(len)]).unwrap();
            assert_eq!((data.as_slice(), done), (&b"A"[..], true), "{len}");
        }
        assert_eq!(
            decode_all(&[&section(MAX_TRAILERS)]).unwrap_err(),
            ChunkedError("trailers of 64 KiB or more")
        );
    }

    /// hyper's rule: the trailer section is parsed as header fields, and a malformed one fails
    /// the body; a sound one, whatever its lines, completes it.
    #[test]
    fn a_trailer_section_completes_the_body_only_when_it_parses() {
        let mut most = b"0\r\n".to_vec();
        for _ in 0..MAX_TRAILER_FIELDS {
            most.extend_from_slice(b"x-a: b\r\n");
        }
        most.extend_from_slice(b"\r\n");
        for bytes in [
            &b"2\r\nok\r\n0\r\nx-sum: 1\r\nX-Other:\t\xe9 \r\n\r\n"[..],
            // A bare LF ends a field for the parse, as long as the lines are no more fields.
            b"2\r\nok\r\n0\r\nx: 1\n\r\n\r\n",
            &most,
        ] {
            let what = String::from_utf8_lossy(&bytes[..bytes.len().min(60)]);
            let (_, done, consumed) = decode_all(&[bytes]).unwrap();
            assert!(done, "{what}");
            assert_eq!(consumed, bytes.len(), "{what}");
        }
        // Split anywhere, a malformed section fails the same.
        let bad = b"2\r\nok\r\n0\r\nx-a: 1\r\nbad trailer\r\n\r\n";
        for at in 0..bad.len() {
            assert_eq!(
                decode_all(&[&bad[..at], &bad[at..]]).unwrap_err(),
                ChunkedError("a malformed trailer section"),
            );
        }
    }

    proptest! {
        /// Whatever the chunks, their extensions, the trailers and the way reads split the
        /// bytes, the data comes out whole and the end is found.
        #[test]
        fn any_split_decodes_to_the_data(
            chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..40), 0..12),
            ext in any::<bool>(),
            trailers in any::<bool>(),
            cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..8),
        ) {
            let bytes = encode(&chunks, ext, trailers);
            let mut at: Vec<usize> = cuts.iter().map(|i| i.index(bytes.len() + 1)).collect();
            at.push(0);
            at.push(bytes.len());
            at.sort_unstable();
            let pieces: Vec<&[u8]> = at.windows(2).map(|w| &bytes[w[0]..w[1]]).collect();
            let (data, done, _) = decode_all(&pieces).unwrap();
            prop_assert_eq!(data, chunks.concat());
            prop_assert!(done);
            // Each chunk with data is counted once, in the read where its data ends.
            let mut decoder = Decoder::default();
            let mut counted = 0;
            for piece in &pieces {
                counted += decoder.decode(&mut piece.to_vec()).unwrap().chunks;
            }
            prop_assert_eq!(counted, chunks.iter().filter(|c| !c.is_empty()).count());
        }

        /// On any bytes at all (hostile or broken framing), the decoder never panics, and reads
        /// that split the bytes differently get the same data, the same error, the same end.
        #[test]
        fn any_bytes_decode_the_same_however_split(
            bytes in proptest::collection::vec(
                prop_oneof![
                    Just(b'\r'), Just(b'\n'), Just(b'0'), Just(b'1'), Just(b'a'), Just(b';'),
                    any::<u8>(),
                ],
                0..200,
            ),
            cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..8),
        ) {
            let mut at: Vec<usize> = cuts.iter().map(|i| i.index(bytes.len() + 1)).collect();
            at.push(0);
            at.push(bytes.len());
            at.sort_unstable();
            let pieces: Vec<&[u8]> = at.windows(2).map(|w| &bytes[w[0]..w[1]]).collect();
            let whole = decode_all(&[&bytes]).map(|(data, done, _)| (data, done));
            let split = decode_all(&pieces).map(|(data, done, _)| (data, done));
            match (&whole, &split) {
                (Ok(a), Ok(b)) => prop_assert_eq!(a, b),
                (Err(a), Err(b)) => prop_assert_eq!(a, b),
                // One split failed where the other did not.
                _ => prop_assert!(false, "{whole:?} against {split:?}"),
            }
        }
    }
}
