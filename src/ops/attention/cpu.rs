//! attention on the CPU: one sample per task, its heads in turn, each head a few
//! single-threaded matrix products around a row softmax.

use super::{Kernels, ProbsDropout};
use crate::tensor::cpu::{vectorized, CpuBackend};
use crate::tensor::matmul::matmul_into_rows;
use crate::tensor::vector_math::exp;
use crate::tensor::Attention as Shape;
use rayon::prelude::*;

impl Kernels for CpuBackend {
    fn attention_workspace_len(&self, shape: &Shape, max_batch: usize) -> usize {
        workspace_len(shape, max_batch)
    }

    fn attention_forward(
        &self,
        qkv: &Vec<f32>,
        y: &mut Vec<f32>,
        probs: &mut Vec<f32>,
        workspace: &mut Vec<f32>,
        n: usize,
        shape: &Shape,
        dropout: Option<ProbsDropout>,
    ) {
        let (t, c) = (shape.len, shape.width());
        y[..n * t * c]
            .par_chunks_mut(t * c)
            .zip(probs[..n * shape.probs_len()].par_chunks_mut(shape.probs_len()))
            .zip(workspace[..n * t * t].par_chunks_mut(t * t))
            .zip(qkv[..n * t * 3 * c].par_chunks(t * 3 * c))
            .enumerate()
            .for_each(|(b, (((y, p), kept), x))| {
                let dropout = dropout.map(|d| d.from_sample(b, shape));
                vectorized(|| forward_sample(x, y, p, kept, shape, dropout))
            });
    }

    fn attention_backward(
        &self,
        qkv: &Vec<f32>,
        probs: &Vec<f32>,
        dy: &Vec<f32>,
        dqkv: &mut Vec<f32>,
        workspace: &mut Vec<f32>,
        n: usize,
        shape: &Shape,
        dropout: Option<ProbsDropout>,
    ) {
        let (t, c) = (shape.len, shape.width());
        dqkv[..n * t * 3 * c]
            .par_chunks_mut(t * 3 * c)
            .zip(workspace[..n * t * t].par_chunks_mut(t * t))
            .zip(qkv[..n * t * 3 * c].par_chunks(t * 3 * c))
            .zip(probs[..n * shape.probs_len()].par_chunks(shape.probs_len()))
            .zip(dy[..n * t * c].par_chunks(t * c))
            .enumerate()
            .for_each(|(b, ((((dx, ds), x), p), dy))| {
                let dropout = dropout.map(|d| d.from_sample(b, shape));
                vectorized(|| backward_sample(x, p, dy, dx, ds, shape, dropout))
            });
    }
}

/// Workspace values for `max_batch` samples: one head's [T, T] each (the kept probabilities
/// in forward when dropout is on, the score gradients in backward).
pub fn workspace_len(shape: &Shape, max_batch: usize) -> usize {
    max_batch * shape.len * shape.len
}

/// kept = p ∘ mask / (1 − p) for head `h`'s probabilities p [T, T].
fn drop_probs(p: &[f32], kept: &mut [f32], d: ProbsDropout, h: usize) {
    let first = (h * p.len()) as u64;
    for (i, (k, &p)) in kept.iter_mut().zip(p).enumerate() {
        *k = p * d.factor(first + i as u64);
    }
}

/// Where head `h`'s queries (part 0), keys (1) or values (2) start in a [T, 3·C] sample;
/// their rows lie 3·C apart.
fn part(shape: &Shape, part: usize, h: usize) -> usize {
    part * shape.width() + h * shape.head_dim
}

const Q: usize = 0;
const K: usize = 1;
const V: usize = 2;

/// One sample: x [T, 3·C] → y [T, C], probabilities p [heads, T, T]. Each head is two
/// matrix products, S = Q·Kᵀ and Y = P·V, around a row softmax; with dropout, V is weighted
/// by the kept probabilities, written to `kept` [T, T]. The products also cover the masked
/// half (its probabilities are 0): at these sizes a whole product runs faster than half of
/// one by hand.
fn forward_sample(
    x: &[f32],
    y: &mut [f32],
    p: &mut [f32],
    kept: &mut [f32],
    shape: &Shape,
    dropout: Option<ProbsDropout>,
) {
    let (t, c, d) = (shape.len, shape.width(), shape.head_dim);
    let xs = 3 * c;
    for h in 0..shape.heads {
        let p = &mut p[h * t * t..][..t * t];
        let (q, k, v) = (part(shape, Q, h), part(shape, K, h), part(shape, V, h));
        matmul_into_rows(p, t, &x[q..], (xs, 1), &x[k..], (1, xs), (t, t, d));
        for i in 0..t {
            softmax_row(&mut p[i * t..][..t], shape.attended(i), shape.scale());
        }
        let weights: &[f32] = match dropout {
            Some(dropout) => {
                drop_probs(p, kept, dropout, h);
                kept
            }
            None => p,
        };
        matmul_into_rows(
            &mut y[h * d..],
            c,
            weights,
            (t, 1),
            &x[v..],
            (xs, 1),
            (t, d, t),
        );
    }
}

/// row = softmax(row[..last]·scale), 0 past `last`.
fn softmax_row(row: &mut [f32], last: usize, scale: f32) {
    let (row, masked) = row.split_at_mut(last);
    masked.fill(0.0);
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s)) * scale;
    row.iter_mut().for_each(|s| *s = exp(*s * scale - max));
    let inv = 1.0 / in_lanes(row, row, |s, _| s);
    row.iter_mut().for_each(|s| *s *= inv);
}

/// One sample's input gradient dx [T, 3·C] from dy [T, C]; `ds` holds one head's score
/// gradients [T, T]. Per head: dV = Pᵀ·dY, dP = dY·Vᵀ, dS = P∘(dP − rowsum(P∘dP))/√d,
/// dQ = dS·K, dK = dSᵀ·Q. With dropout, dV reads the kept probabilities (drawn into `ds`
/// first) and dP is masked and scaled as they were.
fn backward_sample(
    x: &[f32],
    p: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    ds: &mut [f32],
    shape: &Shape,
    dropout: Option<ProbsDropout>,
) {
    let (t, c, d) = (shape.len, shape.width(), shape.head_dim);
    let (xs, scale) = (3 * c, shape.scale());
    for h in 0..shape.heads {
        let p = &p[h * t * t..][..t * t];
        let (q, k, v) = (part(shape, Q, h), part(shape, K, h), part(shape, V, h));
        let dyh = &dy[h * d..];
        let weights: &[f32] = match dropout {
            Some(dropout) => {
                drop_probs(p, ds, dropout, h);
                ds
            }
            None => p,
        };
        matmul_into_rows(&mut dx[v..], xs, weights, (1, t), dyh, (c, 1), (t, d, t));
        matmul_into_rows(ds, t, dyh, (c, 1), &x[v..], (1, xs), (t, t, d));
        for i in 0..t {
            let last = shape.attended(i);
            let (dp, p) = (&mut ds[i * t..][..t], &p[i * t..][..last]);
            if let Some(dropout) = dropout {
                let first = (h * t * t + i * t) as u64;
                for (j, g) in dp[..last].iter_mut().enumerate() {
                    *g *= dropout.factor(first + j as u64);
                }
            }
            let total = in_lanes(&dp[..last], p, |g, pj| g * pj);
            for (s, &pj) in dp[..last].iter_mut().zip(p) {
                *s = pj * (*s - total) * scale;
            }
            dp[last..].fill(0.0);
        }
        matmul_into_rows(&mut dx[q..], xs, ds, (t, 1), &x[k..], (xs, 1), (t, d, t));
        matmul_into_rows(&mut dx[k..], xs, ds, (1, t), &x[q..], (xs, 1), (t, d, t));
    }
}

/// Σ term(a_i, b_i), summed in eight lanes (which vectorise) and then across them.
fn in_lanes(a: &[f32], b: &[f32], term: impl Fn(f32, f32) -> f32) -> f32 {
    let mut lanes = [0.0f32; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = (a8.remainder().iter().zip(b8.remainder()))
        .map(|(&x, &y)| term(x, y))
        .sum();
    for (x, y) in a8.zip(b8) {
        for l in 0..8 {
            lanes[l] += term(x[l], y[l]);
        }
    }
    lanes.iter().sum::<f32>() + tail
}
