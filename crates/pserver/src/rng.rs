//! Small deterministic randomness: a SplitMix64 generator and FNV-1a hashing.
//!
//! Parameter initialisation must give the same numbers on every pserver and
//! in every process, so it uses these fixed, documented algorithms rather
//! than a platform or crate-version dependent generator. The trainer crate
//! reuses them for synthetic data.

const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;
const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// SplitMix64 (Steele, Lea, Flood 2014): a tiny, fast, statistically decent
/// generator whose whole state is one `u64`. Not cryptographic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator starting from `seed`; equal seeds give equal sequences.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN_GAMMA);
        mix64(self.state)
    }

    /// A uniform `f32` in `[0, 1)` with 24 bits of randomness.
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// A standard normal `f32` (Box-Muller, computed in `f64`; uses two draws
    /// and keeps no spare, so the state stays one `u64`).
    pub fn next_normal(&mut self) -> f32 {
        // u1 in (0, 1] so ln(u1) is finite.
        let u1 = ((self.next_u64() >> 11) as f64 + 1.0) * (1.0 / (1u64 << 53) as f64);
        let u2 = (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }
}

/// The SplitMix64 output function: a strong 64-bit mixer, used to derive
/// independent per-element seeds.
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// 64-bit FNV-1a hash of a string's UTF-8 bytes: stable across platforms and
/// releases, unlike `std`'s `DefaultHasher`.
pub fn hash_str(s: &str) -> u64 {
    let mut h = Fnv64::new();
    h.write(s.as_bytes());
    h.finish()
}

/// Incremental FNV-1a, for fingerprints built from several fields.
#[derive(Clone, Debug)]
pub(crate) struct Fnv64(u64);

impl Fnv64 {
    pub(crate) fn new() -> Self {
        Self(FNV_OFFSET)
    }

    pub(crate) fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(FNV_PRIME);
        }
    }

    pub(crate) fn write_u64(&mut self, v: u64) {
        self.write(&v.to_le_bytes());
    }

    pub(crate) fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_reference_values() {
        // Reference outputs of SplitMix64 seeded with 1234567 (from the
        // original C implementation by Vigna).
        let mut r = SplitMix64::new(1234567);
        assert_eq!(r.next_u64(), 6457827717110365317);
        assert_eq!(r.next_u64(), 3203168211198807973);
        assert_eq!(r.next_u64(), 9817491932198370423);
    }

    #[test]
    fn fnv1a_reference_values() {
        assert_eq!(hash_str(""), 0xcbf29ce484222325);
        assert_eq!(hash_str("a"), 0xaf63dc4c8601ec8c);
        assert_eq!(hash_str("foobar"), 0x85944171f73967e8);
    }

    #[test]
    fn f32_in_unit_interval_and_roughly_uniform() {
        let mut r = SplitMix64::new(7);
        let n = 20_000;
        let mut sum = 0.0f64;
        for _ in 0..n {
            let x = r.next_f32();
            assert!((0.0..1.0).contains(&x), "{x}");
            sum += f64::from(x);
        }
        let mean = sum / n as f64;
        assert!((mean - 0.5).abs() < 0.01, "mean {mean}");
    }

    #[test]
    fn normal_has_zero_mean_unit_variance() {
        let mut r = SplitMix64::new(99);
        let n = 20_000;
        let xs: Vec<f64> = (0..n).map(|_| f64::from(r.next_normal())).collect();
        assert!(xs.iter().all(|x| x.is_finite()));
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.03, "mean {mean}");
        assert!((var - 1.0).abs() < 0.05, "var {var}");
    }

    #[test]
    fn same_seed_same_sequence() {
        let mut a = SplitMix64::new(42);
        let mut b = SplitMix64::new(42);
        for _ in 0..10 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        assert_ne!(SplitMix64::new(1).next_u64(), SplitMix64::new(2).next_u64());
    }
}
