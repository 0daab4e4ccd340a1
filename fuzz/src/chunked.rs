//! The sidecar's in-place `chunked` decoder (`bypass-marker/src/client/chunked.rs`, reached through
//! the hidden `bypass_marker::differential::ChunkedDecoder`), fuzzed two ways:
//!
//! - **any bytes**, cut into reads at fuzz-chosen places: the decoder never panics, and the data,
//!   the end and the error are the same whatever the cuts (one read of everything, or many);
//! - **a valid encoding** of fuzz-chosen chunks (with extensions, upper- or lower-case sizes,
//!   leading zeros, trailers), cut the same way: the data comes out whole and the end is found,
//!   at the right byte.
//!
//! Input: byte 0 chooses the mode (bit 0: valid encoding) and byte 1 the number of cuts; the
//! next bytes (one per cut) where to cut, as fractions of the length; the rest is the bytes, or
//! the chunks (each a length byte, then that many bytes; byte 0's other bits choose the forms).

use bypass_marker::differential::ChunkedDecoder;

/// Decodes `pieces` as successive reads: the data, whether the body ended, and how many bytes
/// of all the pieces the decoder took (the decoder's own promises on each read are checked as it
/// goes).
fn decode(pieces: &[&[u8]]) -> Result<(Vec<u8>, bool, usize), &'static str> {
    let mut decoder = ChunkedDecoder::default();
    let (data, taken) = decoder.decode_reads(pieces)?;
    Ok((data, decoder.is_done(), taken))
}

fn cut<'a>(bytes: &'a [u8], at: &[u8]) -> Vec<&'a [u8]> {
    let mut places: Vec<usize> = at
        .iter()
        .map(|&f| usize::from(f) * bytes.len() / 255)
        .collect();
    places.push(0);
    places.push(bytes.len());
    places.sort_unstable();
    places.windows(2).map(|w| &bytes[w[0]..w[1]]).collect()
}

/// An encoding of `chunks` in the forms `flags` chooses.
fn encode(chunks: &[&[u8]], flags: u8) -> Vec<u8> {
    let mut out = Vec::new();
    for chunk in chunks.iter().filter(|c| !c.is_empty()) {
        if flags & 0x02 != 0 {
            out.extend_from_slice(b"00");
        }
        let size = if flags & 0x04 != 0 {
            format!("{:X}", chunk.len())
        } else {
            format!("{:x}", chunk.len())
        };
        out.extend_from_slice(size.as_bytes());
        if flags & 0x08 != 0 {
            out.extend_from_slice(b" ;name=\"a;b\"\t;x");
        }
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(chunk);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\n");
    if flags & 0x10 != 0 {
        out.extend_from_slice(b"x-sum: 1\r\nx-more: \r\n");
    }
    out.extend_from_slice(b"\r\n");
    out
}

/// Runs one fuzz input.
pub fn check(data: &[u8]) {
    let [flags, cuts, rest @ ..] = data else {
        return;
    };
    let cuts = usize::from(*cuts % 16).min(rest.len());
    let (at, bytes) = rest.split_at(cuts);
    if flags & 0x01 == 0 {
        let whole = decode(&[bytes]).map(|(data, done, _)| (data, done));
        let split = decode(&cut(bytes, at)).map(|(data, done, _)| (data, done));
        assert_eq!(
            whole, split,
            "the same bytes decode the same whatever the reads"
        );
        return;
    }
    let mut chunks = Vec::new();
    let mut left = bytes;
    while let [len, tail @ ..] = left {
        let len = usize::from(*len).min(tail.len());
        chunks.push(&tail[..len]);
        left = &tail[len..];
    }
    let mut encoded = encode(&chunks, *flags);
    let end = encoded.len();
    // Whatever follows the body is not the body's.
    encoded.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
    let pieces = cut(&encoded, at);
    let (out, done, taken) = decode(&pieces).expect("a valid encoding decodes");
    assert_eq!(out, chunks.concat());
    assert!(done, "the end is found");
    assert_eq!(
        taken, end,
        "the body ends at its last CRLF, not before or after"
    );
}
