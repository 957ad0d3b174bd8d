//! How a job's batches are divided among data-parallel replicas. `data.batch_size` is the
//! micro-batch of all replicas together, so the replica count never changes what is
//! computed, only where: each replica takes a contiguous share of every micro-batch.

use crate::spec::JobSpec;
use std::fmt;
use std::ops::Range;

/// The batch sizes of a job: a micro-batch is split among the replicas, and
/// `accumulation` micro-batches make one optimizer step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLayout {
    /// Samples per micro-batch, all replicas together.
    pub micro_batch: usize,
    pub replicas: usize,
    /// Micro-batches per optimizer step (train.grad_accum_steps).
    pub accumulation: usize,
}

impl BatchLayout {
    pub fn of(spec: &JobSpec) -> Self {
        BatchLayout {
            micro_batch: spec.batch_size(),
            replicas: spec.parallel.replicas().unwrap_or(1).max(1),
            accumulation: spec.train.grad_accum_steps.max(1),
        }
    }

    /// The largest share of a micro-batch one replica computes.
    pub fn per_replica(&self) -> usize {
        self.micro_batch.div_ceil(self.replicas)
    }

    /// The samples a replica's buffers hold: its share of a micro-batch, or of the largest
    /// split of the data (`Data::largest_split`) when the batch is larger than that.
    pub fn buffer_rows(&self, largest_split: usize) -> usize {
        self.micro_batch.min(largest_split).div_ceil(self.replicas)
    }

    /// Samples per optimizer step (a full one), over all replicas and micro-batches.
    pub fn global(&self) -> usize {
        self.micro_batch * self.accumulation
    }
}

/// `32 per replica x 2 replicas x 4 accumulation steps = 256 global`
impl fmt::Display for BatchLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let plural = |n: usize| if n == 1 { "" } else { "s" };
        write!(
            f,
            "{} per replica x {} replica{} x {} accumulation step{} = {} global",
            self.per_replica(),
            self.replicas,
            plural(self.replicas),
            self.accumulation,
            plural(self.accumulation),
            self.global()
        )
    }
}

/// Replica `rank`'s share of a micro-batch of `rows` samples: contiguous, and as equal as
/// possible, the first `rows % replicas` replicas taking one sample more (a smaller last
/// batch of an epoch; full micro-batches divide evenly, which validation requires).
pub fn share(rows: usize, rank: usize, replicas: usize) -> Range<usize> {
    let (base, extra) = (rows / replicas, rows % replicas);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_the_batch_in_order_and_differ_by_at_most_one() {
        for replicas in 1..=5 {
            for rows in 0..=13 {
                let shares: Vec<Range<usize>> =
                    (0..replicas).map(|r| share(rows, r, replicas)).collect();
                assert_eq!(shares[0].start, 0);
                assert_eq!(shares[replicas - 1].end, rows);
                assert!(shares.windows(2).all(|w| w[0].end == w[1].start));
                let (min, max) = (
                    shares.iter().map(|s| s.len()).min().unwrap(),
                    shares.iter().map(|s| s.len()).max().unwrap(),
                );
                assert!(max - min <= 1, "{rows} rows on {replicas}: {shares:?}");
            }
        }
        assert_eq!(share(10, 0, 4), 0..3);
        assert_eq!(share(10, 3, 4), 8..10);
    }
}
