//! The seeded order of an epoch's training samples.
//!
//! Rows of a table or of images are shuffled in a list (Fisher-Yates), as they always were.
//! A language model's windows are not: FineWeb's 10B tokens are 10B windows, and their list
//! would take 80 GB and a minute to shuffle each epoch. Their order is a keyed permutation
//! computed at each position instead: a Feistel network on the smallest power of four that
//! holds them, walking again from any value past the last window (cycle walking).

use crate::tensor::rng::{derive, mix, Rng};

/// Rounds of the Feistel network: four make a pseudo-random permutation; six leave margin.
const ROUNDS: usize = 6;

/// Where each of an epoch's `len` samples comes: position i of the epoch reads `at(i)`.
pub struct EpochOrder {
    len: u64,
    shuffled: Shuffled,
}

enum Shuffled {
    No,
    Listed(Vec<u32>),
    Computed { half_bits: u32, keys: [u64; ROUNDS] },
}

impl EpochOrder {
    /// `len` samples in the order of epoch `epoch`: unshuffled, shuffled in a list, or for
    /// `windows` of a language model's tokens, shuffled by a computed permutation.
    pub fn new(len: usize, windows: bool, shuffle: bool, seed: u64, epoch: usize) -> Self {
        let mut rng = Rng::new(derive(derive(seed, 12), epoch as u64));
        let shuffled = match (shuffle, windows) {
            (false, _) => Shuffled::No,
            (true, false) => {
                let mut order: Vec<u32> = (0..len as u32).collect();
                rng.shuffle(&mut order);
                Shuffled::Listed(order)
            }
            (true, true) => {
                // 4^half_bits >= len, so at most 3 of 4 values are walked past.
                let bits = u64::BITS - (len.max(2) as u64 - 1).leading_zeros();
                Shuffled::Computed {
                    half_bits: bits.div_ceil(2),
                    keys: std::array::from_fn(|_| rng.next_u64()),
                }
            }
        };
        EpochOrder {
            len: len as u64,
            shuffled,
        }
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The sample at position `i` of the epoch (`i < len`).
    pub fn at(&self, i: u64) -> u64 {
        match &self.shuffled {
            Shuffled::No => i,
            Shuffled::Listed(order) => u64::from(order[i as usize]),
            Shuffled::Computed { half_bits, keys } => {
                let mut x = i;
                loop {
                    x = feistel(x, *half_bits, keys);
                    if x < self.len {
                        return x;
                    }
                }
            }
        }
    }

    /// The samples at positions `positions`, into `rows` (cleared first).
    pub fn fill(&self, positions: std::ops::Range<u64>, rows: &mut Vec<u64>) {
        rows.clear();
        rows.extend(positions.map(|i| self.at(i)));
    }
}

/// A bijection of [0, 4^half_bits): the two halves of `x` swap through `ROUNDS` rounds, each
/// mixing one half with a round key into the other.
fn feistel(x: u64, half_bits: u32, keys: &[u64; ROUNDS]) -> u64 {
    let mask = (1u64 << half_bits) - 1;
    let (mut left, mut right) = (x >> half_bits, x & mask);
    for &key in keys {
        (left, right) = (right, left ^ (mix(right ^ key) & mask));
    }
    (left << half_bits) | right
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(order: &EpochOrder) -> Vec<u64> {
        let mut rows = Vec::new();
        order.fill(0..order.len(), &mut rows);
        rows
    }

    #[test]
    fn every_window_comes_once_an_epoch() {
        for len in [0, 1, 2, 3, 4, 5, 63, 64, 65, 1000, 4097] {
            let mut rows = all(&EpochOrder::new(len, true, true, 7, 1));
            rows.sort_unstable();
            assert_eq!(rows, (0..len as u64).collect::<Vec<_>>(), "len {len}");
        }
    }

    #[test]
    fn the_order_is_the_seeds_and_the_epochs() {
        let order = |seed, epoch| all(&EpochOrder::new(1000, true, true, seed, epoch));
        assert_eq!(order(7, 1), order(7, 1));
        assert_ne!(order(7, 1), order(7, 2));
        assert_ne!(order(7, 1), order(8, 1));
        // Shuffled: few windows stay in place, and neighbours part.
        let rows = order(7, 1);
        let fixed = rows
            .iter()
            .enumerate()
            .filter(|(i, &r)| *i as u64 == r)
            .count();
        assert!(fixed < 10, "{fixed} windows in place");
        let adjacent = rows.windows(2).filter(|w| w[0].abs_diff(w[1]) == 1).count();
        assert!(adjacent < 10, "{adjacent} neighbours kept together");
    }

    #[test]
    fn ten_billion_windows_need_no_list() {
        let len = 10_000_000_000usize;
        let order = EpochOrder::new(len, true, true, 1337, 1);
        let mut rows = Vec::new();
        order.fill(0..100_000, &mut rows);
        assert!(rows.iter().all(|&r| r < len as u64));
        // They reach past u32 and spread over the whole range.
        assert!(rows.iter().any(|&r| r > u64::from(u32::MAX)));
        let mean = rows.iter().map(|&r| r as f64).sum::<f64>() / rows.len() as f64;
        assert!((mean / len as f64 - 0.5).abs() < 0.01, "mean {mean}");
        rows.sort_unstable();
        rows.dedup();
        assert_eq!(rows.len(), 100_000);
    }

    #[test]
    fn rows_of_a_table_are_shuffled_as_before() {
        let listed = all(&EpochOrder::new(100, false, true, 3, 2));
        let mut expected: Vec<u32> = (0..100).collect();
        Rng::new(derive(derive(3, 12), 2)).shuffle(&mut expected);
        assert_eq!(
            listed,
            expected.iter().map(|&r| u64::from(r)).collect::<Vec<_>>()
        );
        let unshuffled = all(&EpochOrder::new(100, true, false, 3, 2));
        assert_eq!(unshuffled, (0..100).collect::<Vec<_>>());
    }
}
