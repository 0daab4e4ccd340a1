//! Deterministic randomness for the load tests: the same seed gives the same streams and the same
//! cuts on every run and every machine, so a failure names a stream that fails again.

use bytes::Bytes;

/// A small xorshift generator (Marsaglia's 13/7/17 triple): fast, deterministic and good enough
/// to vary stream shapes; not for anything that must be unpredictable.
#[derive(Debug, Clone)]
pub struct XorShift(u64);

impl XorShift {
    /// A generator for `seed`; any seed, zero included, gives a usable sequence.
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// The next number below `n` (which must not be 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// `bytes` cut into chunks of 1 to `most` bytes (the last may be shorter), at places `seed`
/// chooses: frames and lines are cut anywhere, as a network would cut them. The chunks share one
/// buffer.
pub fn random_chunks(seed: u64, bytes: &[u8], most: u64) -> Vec<Bytes> {
    let mut rng = XorShift::new(seed);
    let mut rest = Bytes::copy_from_slice(bytes);
    let mut out = Vec::new();
    while !rest.is_empty() {
        let n = (1 + rng.below(most) as usize).min(rest.len());
        out.push(rest.split_to(n));
    }
    out
}
