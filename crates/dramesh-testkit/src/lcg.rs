//! A deterministic generator for randomised tests and benches: a seed always yields the same
//! sequence, on every machine.

/// Knuth's MMIX linear congruential generator; each value is taken from the high bits.
pub struct Lcg(pub u64);

impl Lcg {
    /// Next value in `0..n` (`0` when `n` is 0).
    pub fn next(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n.max(1)
    }
}
