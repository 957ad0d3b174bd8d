//! Cross-entropy on the CPU, a row of logits at a time; long losses score blocks of rows on
//! the pool's threads. Each logit costs one exp, in f32 and vectorised. The gradient reuses
//! it: the row's e^(x − max) are kept in place of the logits until the sum is known.

use super::simd_fn;
use crate::tensor::vector_math::{exp, lane_sum, LANES};
use crate::tensor::LossStats;
use rayon::prelude::*;

/// Rows of a block scored together, their results on the stack.
const SCORED_BLOCK: usize = 64;
/// Logits a thread takes at least: a short row's loss is not worth a task.
const LOGITS_PER_TASK: usize = 1 << 14;

/// A cross-entropy's rows: their labels, and which are scored. PyTorch's label smoothing:
/// the target is (1 − ε)·onehot + ε/C.
pub(super) struct CrossEntropyRows<'a> {
    targets: &'a [f32],
    n: usize,
    dim: usize,
    smoothing: f64,
    ignore_index: Option<u32>,
}

impl<'a> CrossEntropyRows<'a> {
    pub(super) fn new(
        targets: &'a [f32],
        n: usize,
        dim: usize,
        smoothing: f32,
        ignore_index: Option<u32>,
    ) -> Self {
        CrossEntropyRows {
            targets,
            n,
            dim,
            smoothing: smoothing as f64,
            ignore_index,
        }
    }

    /// Scores the logits `x` into `stats`, and writes their gradient times `grad_scale` (over
    /// the rows scored) into `grad` where given.
    pub(super) fn score_into(
        &self,
        x: &[f32],
        grad: Option<&mut [f32]>,
        grad_scale: f32,
        stats: &mut LossStats,
    ) {
        let g = self.gradient_scale(grad_scale);
        let (x, dim) = (&x[..self.n * self.dim], self.dim);
        match (grad, self.parallel()) {
            (Some(d), false) => {
                let rows = x.chunks_exact(dim).zip(d.chunks_exact_mut(dim));
                let scored = rows.enumerate().map(|(s, (x, d))| self.row(s, x, g, d));
                add_in_order(scored, stats);
            }
            (None, false) => {
                let scored = x.chunks_exact(dim).enumerate();
                add_in_order(scored.map(|(s, x)| self.row_loss(s, x)), stats);
            }
            (Some(d), true) => {
                let block = SCORED_BLOCK * dim;
                let blocks = x.chunks(block).zip(d[..x.len()].chunks_mut(block));
                let blocks = blocks.map(|(x, d)| x.par_chunks(dim).zip(d.par_chunks_mut(dim)));
                self.score(blocks, stats, |s, (x, d)| self.row(s, x, g, d));
            }
            (None, true) => {
                let blocks = x.chunks(SCORED_BLOCK * dim).map(|x| x.par_chunks(dim));
                self.score(blocks, stats, |s, x| self.row_loss(s, x));
            }
        }
    }

    /// `score_into`, with the gradient written over the logits.
    pub(super) fn score_in_place(&self, x: &mut [f32], grad_scale: f32, stats: &mut LossStats) {
        let g = self.gradient_scale(grad_scale);
        let x = &mut x[..self.n * self.dim];
        if self.parallel() {
            let blocks = x
                .chunks_mut(SCORED_BLOCK * self.dim)
                .map(|b| b.par_chunks_mut(self.dim));
            self.score(blocks, stats, |s, row| self.row_in_place(s, row, g));
        } else {
            let rows = x.chunks_exact_mut(self.dim).enumerate();
            add_in_order(rows.map(|(s, row)| self.row_in_place(s, row, g)), stats);
        }
    }

    fn ignored(&self, s: usize) -> bool {
        (self.ignore_index).is_some_and(|i| self.targets[s] == i as f32)
    }

    /// The factor of each row's gradient: the mean over the rows scored. None scored: no
    /// gradient (PyTorch's would be NaN).
    fn gradient_scale(&self, grad_scale: f32) -> f64 {
        let scored = (0..self.n).filter(|&s| !self.ignored(s)).count();
        grad_scale as f64 / scored.max(1) as f64
    }

    /// Row `s` of logits `x`: its loss and hit (1 or 0), or None for an ignored row.
    fn row_loss(&self, s: usize, x: &[f32]) -> Option<(f64, f64)> {
        if self.ignored(s) {
            return None;
        }
        let label = self.targets[s] as usize;
        let (max, argmax) = max_and_argmax(x);
        let mut sum_exp = 0.0;
        sum_exp_shifted(x, max, &mut sum_exp);
        let loss = self.loss(x[label], self.smoothed_sum(x), max, sum_exp);
        Some((loss, f64::from(argmax == label)))
    }

    /// `row_loss`, and the row's gradient times `g` into `grad` (zeros for an ignored row).
    fn row(&self, s: usize, x: &[f32], g: f64, grad: &mut [f32]) -> Option<(f64, f64)> {
        grad.copy_from_slice(x);
        self.row_in_place(s, grad, g)
    }

    /// `row`, with the gradient written over the logits.
    fn row_in_place(&self, s: usize, row: &mut [f32], g: f64) -> Option<(f64, f64)> {
        if self.ignored(s) {
            row.fill(0.0);
            return None;
        }
        let label = self.targets[s] as usize;
        let (max, argmax) = max_and_argmax(row);
        // What the loss reads of the logits, before they turn into exps.
        let (x_label, sum_x) = (row[label], self.smoothed_sum(row));
        let mut sum_exp = 0.0;
        exp_shifted_in_place(row, max, &mut sum_exp);
        let loss = self.loss(x_label, sum_x, max, sum_exp);
        let e_label = row[label] as f64;
        let floor = self.smoothing / self.dim as f64;
        softmax_gradient(row, 1.0 / sum_exp, floor, g);
        row[label] = ((e_label / sum_exp - floor - (1.0 - self.smoothing)) * g) as f32;
        Some((loss, f64::from(argmax == label)))
    }

    /// Σx over a row, which label smoothing's loss needs: 0 without smoothing.
    fn smoothed_sum(&self, x: &[f32]) -> f64 {
        if self.smoothing > 0.0 {
            lane_sum(x, |v| v as f64)
        } else {
            0.0
        }
    }

    /// A row's loss from its label's logit, its Σx (`smoothed_sum`), its largest logit and
    /// Σ e^(x − max).
    fn loss(&self, x_label: f32, sum_x: f64, max: f32, sum_exp: f64) -> f64 {
        let log_sum_exp = max as f64 + sum_exp.ln();
        let nll = log_sum_exp - x_label as f64;
        if self.smoothing > 0.0 {
            let mean_nll = log_sum_exp - sum_x / self.dim as f64;
            (1.0 - self.smoothing) * nll + self.smoothing * mean_nll
        } else {
            nll
        }
    }

    /// Whether the rows are worth threads: a small batch's loss is not.
    fn parallel(&self) -> bool {
        self.n * self.dim > LOGITS_PER_TASK
    }

    /// Scores every row, `score(s, its item of blocks)`, in parallel, and adds the results to
    /// `stats` in row order: the same sums, to the bit, as one thread's. `blocks` holds the
    /// rows in blocks of `SCORED_BLOCK`, whose results are on the stack: nothing is allocated.
    fn score<I>(
        &self,
        blocks: impl Iterator<Item = I>,
        stats: &mut LossStats,
        score: impl Fn(usize, I::Item) -> Option<(f64, f64)> + Sync + Send,
    ) where
        I: IndexedParallelIterator,
    {
        let min_rows = LOGITS_PER_TASK.div_ceil(self.dim);
        let mut results = [None; SCORED_BLOCK];
        let mut first = 0;
        for block in blocks {
            let m = block.len();
            (block
                .zip(results[..m].par_iter_mut())
                .enumerate()
                .with_min_len(min_rows))
            .for_each(|(i, (item, result))| *result = score(first + i, item));
            add_in_order(results[..m].iter().copied(), stats);
            first += m;
        }
    }
}

/// Adds scored rows' (loss, hit) to `stats`, in order; None is a row not scored.
fn add_in_order(scored: impl Iterator<Item = Option<(f64, f64)>>, stats: &mut LossStats) {
    for (loss, correct) in scored.flatten() {
        stats.loss_sum += loss;
        stats.correct += correct;
        stats.samples += 1.0;
    }
}

/// A row's largest logit and where it first stands. NaNs are passed over, as `>` does.
fn max_and_argmax(x: &[f32]) -> (f32, usize) {
    let mut max = f32::NEG_INFINITY;
    row_max(x, &mut max);
    (max, x.iter().position(|&v| v == max).unwrap_or(0))
}

// Each loop is compiled for each SIMD width (`simd_fn!`). Sums run in LANES partial sums.
simd_fn! {
    fn row_max(x: &[f32], max: &mut f32) {
        let mut lanes = [f32::NEG_INFINITY; LANES];
        let chunks = x.chunks_exact(LANES);
        let tail = chunks.remainder().iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        for chunk in chunks {
            for (lane, &v) in lanes.iter_mut().zip(chunk) {
                *lane = lane.max(v);
            }
        }
        *max = lanes.iter().fold(tail, |m, &v| m.max(v));
    }
}

simd_fn! {
    /// Σ e^(x − max) over a row, in f64.
    fn sum_exp_shifted(x: &[f32], max: f32, sum: &mut f64) {
        *sum = lane_sum(x, |v| exp(v - max) as f64);
    }
}

simd_fn! {
    /// e^(x − max) over a row, in place, and their sum in f64.
    fn exp_shifted_in_place(row: &mut [f32], max: f32, sum: &mut f64) {
        let mut lanes = [0.0f64; LANES];
        let mut chunks = row.chunks_exact_mut(LANES);
        for chunk in &mut chunks {
            for (lane, v) in lanes.iter_mut().zip(chunk) {
                *v = exp(*v - max);
                *lane += *v as f64;
            }
        }
        let tail = chunks.into_remainder().iter_mut().map(|v| {
            *v = exp(*v - max);
            *v as f64
        });
        *sum = lanes.iter().sum::<f64>() + tail.sum::<f64>();
    }
}

simd_fn! {
    /// (softmax − ε/C)·g over a row of e^(x − max): softmax = e / Σe.
    fn softmax_gradient(row: &mut [f32], inv_sum: f64, floor: f64, g: f64) {
        for v in row.iter_mut() {
            *v = ((*v as f64 * inv_sum - floor) * g) as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The loss and gradient in f64 by the definition: −log softmax(x)[label] with label
    /// smoothing, and (softmax − target)·g.
    fn by_definition(x: &[f32], label: usize, smoothing: f64, g: f64) -> (f64, Vec<f64>) {
        let max = x.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
        let lse = max + x.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
        let classes = x.len() as f64;
        let nll = lse - x[label] as f64;
        let mean_nll = lse - x.iter().map(|&v| v as f64).sum::<f64>() / classes;
        let loss = (1.0 - smoothing) * nll + smoothing * mean_nll;
        let grad = x.iter().enumerate().map(|(j, &v)| {
            let target = smoothing / classes + if j == label { 1.0 - smoothing } else { 0.0 };
            ((v as f64 - lse).exp() - target) * g
        });
        (loss, grad.collect())
    }

    /// One f32 exp a logit stays within a few f32 ulps of the definition in f64: rows of
    /// odd lengths (a SIMD tail), wide logits, label smoothing and an ignored row.
    #[test]
    fn rows_match_the_definition_in_f64() {
        for (dim, smoothing) in [(7, 0.0), (50_257, 0.0), (1_000, 0.1), (33, 0.2)] {
            let n = 5;
            let x: Vec<f32> = (0..n * dim)
                .map(|i| ((i * 7919) % 2003) as f32 / 100.0 - 10.0)
                .collect();
            let mut targets: Vec<f32> = (0..n).map(|s| ((s * 37 + 3) % dim) as f32).collect();
            targets[2] = 1.0;
            let rows = CrossEntropyRows::new(&targets, n, dim, smoothing, Some(1));
            let (mut grad, mut stats) = (vec![f32::NAN; n * dim], LossStats::default());
            rows.score_into(&x, Some(&mut grad), n as f32, &mut stats);
            let mut losses = 0.0;
            for s in (0..n).filter(|&s| s != 2) {
                let row = &x[s * dim..(s + 1) * dim];
                let g = n as f64 / (n - 1) as f64;
                let (loss, want) = by_definition(row, targets[s] as usize, smoothing as f64, g);
                losses += loss;
                for (j, (&got, want)) in grad[s * dim..(s + 1) * dim].iter().zip(want).enumerate() {
                    // Smoothing's gradient is softmax − ε/C: relative to the terms, not to
                    // their difference.
                    let floor = smoothing as f64 / dim as f64 * g;
                    let tolerance = 1e-6 * (want.abs() + floor) + 1e-12;
                    assert!(
                        (got as f64 - want).abs() <= tolerance,
                        "{dim} classes, row {s}, class {j}: {got} against {want}"
                    );
                }
            }
            assert!(
                (stats.loss_sum - losses).abs() <= 1e-6 * losses,
                "{dim}: {stats:?}"
            );
            assert_eq!(stats.samples, (n - 1) as f64);
            assert!(grad[2 * dim..3 * dim].iter().all(|&v| v == 0.0));
            let mut eval = LossStats::default();
            rows.score_into(&x, None, 0.0, &mut eval);
            assert_eq!(
                eval, stats,
                "{dim} classes: the loss alone, without a gradient"
            );
        }
    }
}
