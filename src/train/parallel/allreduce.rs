//! Gradient averaging for replicas that are threads of one process. Deterministic: every
//! element is summed over the replicas in rank order, so results do not depend on timing;
//! the work is split, each replica reducing its own chunk. All buffers are allocated once.

use std::sync::{Barrier, RwLock};

pub struct CpuAllReduce {
    replicas: usize,
    len: usize,
    /// Each replica's gradients, deposited before reducing.
    slots: Vec<RwLock<Vec<f32>>>,
    /// The averaged values, one chunk of the range being averaged per replica (each reduces
    /// its own); each holds a chunk of the whole buffer, the largest a range can have.
    result: Vec<RwLock<Vec<f32>>>,
    barrier: Barrier,
}

impl CpuAllReduce {
    /// For `replicas` replicas averaging buffers of `len` values. Holds `exchange_len`
    /// values: (replicas + 1) x len, none for one replica.
    pub fn new(replicas: usize, len: usize) -> Self {
        let held = Self::exchange_len(replicas, len) / (replicas + 1);
        let chunks = (0..replicas).map(|_| Self::chunk(held, replicas, 0).len());
        CpuAllReduce {
            replicas,
            len,
            slots: (0..replicas)
                .map(|_| RwLock::new(vec![0.0; held]))
                .collect(),
            result: chunks.map(|n| RwLock::new(vec![0.0; n])).collect(),
            barrier: Barrier::new(replicas),
        }
    }

    /// Values per buffer.
    pub fn buffer_len(&self) -> usize {
        self.len
    }

    /// f32 values the exchange holds for `replicas` replicas of `len`-value buffers: a slot
    /// per replica and the result; nothing for one replica (see `mean`).
    pub fn exchange_len(replicas: usize, len: usize) -> usize {
        if replicas > 1 {
            (replicas + 1) * len
        } else {
            0
        }
    }

    fn chunk(len: usize, replicas: usize, rank: usize) -> std::ops::Range<usize> {
        let per = len.div_ceil(replicas.max(1));
        (rank * per).min(len)..((rank + 1) * per).min(len)
    }

    /// Replaces `range` of `grads` by its mean over all replicas (a gradient bucket; the
    /// result does not depend on how the buffer is cut into buckets). Every replica must
    /// call it, with its own rank, for the same ranges in the same order.
    pub fn mean(&self, rank: usize, grads: &mut [f32], range: std::ops::Range<usize>) {
        assert_eq!(grads.len(), self.len, "all-reduce buffer length");
        if self.replicas == 1 {
            // The mean of one buffer is itself (and x * 1.0 == x): nothing to exchange.
            return;
        }
        let (start, len) = (range.start, range.len());
        self.slots[rank].write().expect("no replica panicked")[range.clone()]
            .copy_from_slice(&grads[range]);
        self.barrier.wait();
        {
            let mine = Self::chunk(len, self.replicas, rank);
            let at = start + mine.start..start + mine.end;
            let mut out = self.result[rank].write().expect("no replica panicked");
            let out = &mut out[..mine.len()];
            out.copy_from_slice(&self.slots[0].read().expect("no replica panicked")[at.clone()]);
            for slot in &self.slots[1..] {
                let slot = slot.read().expect("no replica panicked");
                for (o, v) in out.iter_mut().zip(&slot[at.clone()]) {
                    *o += v;
                }
            }
            let inv = 1.0 / self.replicas as f32;
            out.iter_mut().for_each(|v| *v *= inv);
        }
        self.barrier.wait();
        for (r, chunk) in self.result.iter().enumerate() {
            let theirs = Self::chunk(len, self.replicas, r);
            let chunk = chunk.read().expect("no replica panicked");
            grads[start + theirs.start..start + theirs.end].copy_from_slice(&chunk[..theirs.len()]);
        }
        // Nobody may deposit the next round's gradients before everyone has read this one.
        self.barrier.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn every_replica_gets_the_mean_in_a_fixed_order() {
        for replicas in [1, 2, 3, 4] {
            let len = 1001;
            let group = Arc::new(CpuAllReduce::new(replicas, len));
            let handles: Vec<_> = (0..replicas)
                .map(|rank| {
                    let group = group.clone();
                    std::thread::spawn(move || {
                        let mut results = Vec::new();
                        for round in 0..3 {
                            let mut g: Vec<f32> = (0..len)
                                .map(|i| (i * (rank + 1) + round) as f32 * 0.1)
                                .collect();
                            group.mean(rank, &mut g, 0..len);
                            results.push(g);
                        }
                        results
                    })
                })
                .collect();
            let all: Vec<Vec<Vec<f32>>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            for round in 0..3 {
                for i in [0, 1, 500, 1000] {
                    let expected: f32 = (0..replicas)
                        .map(|r| (i * (r + 1) + round) as f32 * 0.1)
                        .sum::<f32>()
                        / replicas as f32;
                    for replica in &all {
                        assert!(
                            (replica[round][i] - expected).abs() <= 1e-5 * expected.abs().max(1.0)
                        );
                    }
                }
                assert!(
                    all.iter().all(|r| r[round] == all[0][round]),
                    "replicas differ"
                );
            }
        }
    }

    #[test]
    fn averaging_bucket_by_bucket_gives_the_same_bits_as_all_at_once() {
        let (replicas, len) = (3, 1001);
        let group = Arc::new(CpuAllReduce::new(replicas, len));
        let grads = move |rank: usize| -> Vec<f32> {
            (0..len)
                .map(|i| ((i * 7919 + rank * 104_729) % 1000) as f32 * 0.0137 - 6.1)
                .collect()
        };
        let handles: Vec<_> = (0..replicas)
            .map(|rank| {
                let group = group.clone();
                std::thread::spawn(move || {
                    let mut whole = grads(rank);
                    group.mean(rank, &mut whole, 0..len);
                    // Buckets from the end down, of uneven sizes, one smaller than the
                    // number of replicas.
                    let mut bucketed = grads(rank);
                    for bucket in [999..1001, 640..999, 1..640, 0..1] {
                        group.mean(rank, &mut bucketed, bucket);
                    }
                    (whole, bucketed)
                })
            })
            .collect();
        for h in handles {
            let (whole, bucketed) = h.join().unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&whole), bits(&bucketed));
        }
    }
}
