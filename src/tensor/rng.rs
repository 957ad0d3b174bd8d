//! Random numbers that are the same on every device and every run: a counter-based generator
//! (SplitMix64's mixer keyed by seed and position) for dropout masks, and a sequential stream
//! built on it for initialisation, shuffling and synthetic data.

/// SplitMix64's finaliser: a bijective mix of 64 bits.
#[inline]
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform float in [0, 1) for element `index` of the stream `key`, with 24 random bits.
/// The CUDA kernels compute exactly the same function.
#[inline]
pub fn uniform(key: u64, index: u64) -> f32 {
    // The 24 bits convert exactly through i32, which SIMD lanes convert; u64 they do not.
    ((mix(key ^ mix(index)) >> 40) as i32) as f32 * (1.0 / 16_777_216.0)
}

/// Derives an independent key from a parent key and a purpose or position.
pub fn derive(key: u64, what: u64) -> u64 {
    mix(key ^ mix(what.wrapping_add(0x5851_F42D_4C95_7F2D)))
}

/// A seeded sequential generator.
#[derive(Debug, Clone)]
pub struct Rng {
    key: u64,
    counter: u64,
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng {
            key: mix(seed),
            counter: 0,
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.counter += 1;
        mix(self.key ^ mix(self.counter))
    }

    /// Uniform in [0, 1), 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in [low, high).
    pub fn uniform(&mut self, low: f64, high: f64) -> f64 {
        low + (high - low) * self.next_f64()
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.next_f64();
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Uniform integer in [0, n).
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }

    /// Fisher-Yates shuffle.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i + 1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_is_in_range_and_roughly_flat() {
        let n = 100_000;
        let mean: f64 = (0..n).map(|i| uniform(7, i) as f64).sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 0.01, "mean {mean}");
        assert!((0..n).all(|i| (0.0..1.0).contains(&uniform(7, i))));
    }

    #[test]
    fn streams_are_reproducible_and_distinct() {
        let a: Vec<u64> = (0..5)
            .map({
                let mut r = Rng::new(1);
                move |_| r.next_u64()
            })
            .collect();
        let b: Vec<u64> = (0..5)
            .map({
                let mut r = Rng::new(1);
                move |_| r.next_u64()
            })
            .collect();
        let c: Vec<u64> = (0..5)
            .map({
                let mut r = Rng::new(2);
                move |_| r.next_u64()
            })
            .collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }
}
