//! attention on the CPU: one sample per task, its heads in turn, each head's rows in bands
//! that are tasks too (so batch 1 uses every thread), each band a few single-threaded
//! matrix products around a row softmax.

use super::{Kernels, ProbsDropout};
use crate::tensor::cpu::{simd_fn, vectorized, CpuBackend};
use crate::tensor::matmul::matmul_into_rows;
use crate::tensor::vector_math::exp;
use crate::tensor::Attention as Shape;
use rayon::iter::{repeat_n, Either};
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
        let (t, c, w) = (shape.len, shape.width(), workspace_len(shape, 1));
        let xs = shape.qkv_width();
        y[..n * t * c]
            .par_chunks_mut(t * c)
            .zip(probs[..n * shape.saved_len()].par_chunks_mut(shape.saved_len()))
            .zip(workspace[..n * w].par_chunks_mut(w))
            .zip(qkv[..n * t * xs].par_chunks(t * xs))
            .enumerate()
            .for_each(|(b, (((y, saved), scratch), x))| {
                let dropout = dropout.map(|d| d.from_sample(b, shape));
                vectorized(|| forward_sample(x, y, saved, scratch, shape, dropout))
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
        let (t, c, w) = (shape.len, shape.width(), workspace_len(shape, 1));
        let xs = shape.qkv_width();
        dqkv[..n * t * xs]
            .par_chunks_mut(t * xs)
            .zip(workspace[..n * w].par_chunks_mut(w))
            .zip(qkv[..n * t * xs].par_chunks(t * xs))
            .zip(probs[..n * shape.saved_len()].par_chunks(shape.saved_len()))
            .zip(dy[..n * t * c].par_chunks(t * c))
            .enumerate()
            .for_each(|(b, ((((dx, scratch), x), saved), dy))| {
                let dropout = dropout.map(|d| d.from_sample(b, shape));
                vectorized(|| backward_sample(x, saved, dy, dx, scratch, shape, dropout))
            });
    }
}

/// Workspace values for `max_batch` samples: one head's [T, T] each (the kept probabilities
/// in forward when dropout is on, the score gradients in backward); with `flash`, a second
/// for the head's probabilities.
pub fn workspace_len(shape: &Shape, max_batch: usize) -> usize {
    let heads_kept = if shape.flash { 2 } else { 1 };
    max_batch * heads_kept * shape.len * shape.len
}

/// kept = p ∘ mask / (1 − p) for a band of head `h`'s probability rows, from query row
/// `first`. Only the attended columns draw the mask: past them p is 0, and so is kept.
fn drop_probs(p: &[f32], kept: &mut [f32], d: ProbsDropout, shape: &Shape, h: usize, first: usize) {
    let t = shape.len;
    for (r, (kept, p)) in kept.chunks_exact_mut(t).zip(p.chunks_exact(t)).enumerate() {
        let (i, last) = (first + r, shape.attended(first + r));
        masked(&mut kept[..last], &p[..last], d, (h * t * t + i * t) as u64);
        kept[last..].fill(0.0);
    }
}

// The mask's hashes run in SIMD lanes (`simd_fn!`): drawn one at a time they took half of
// attention's time with dropout.
simd_fn! {
    /// out = a ∘ mask / (1 − p), a's first value element `first` of the stream.
    fn masked(out: &mut [f32], a: &[f32], d: ProbsDropout, first: u64) {
        for (i, (o, &a)) in out.iter_mut().zip(a).enumerate() {
            *o = a * d.factor(first + i as u64);
        }
    }
}

simd_fn! {
    /// `masked` in place.
    fn masked_in_place(buf: &mut [f32], d: ProbsDropout, first: u64) {
        for (i, v) in buf.iter_mut().enumerate() {
            *v *= d.factor(first + i as u64);
        }
    }
}

/// Where query head `h`'s queries (part 0), keys (1) or values (2) start in a sample: its
/// own queries, the keys and values of the key and value head it shares. Their rows lie
/// `qkv_width` apart.
fn part(shape: &Shape, part: usize, h: usize) -> usize {
    let d = shape.head_dim;
    match part {
        Q => h * d,
        K => shape.width() + shape.kv_head(h) * d,
        _ => shape.width() + shape.kv_width() + shape.kv_head(h) * d,
    }
}

const Q: usize = 0;
const K: usize = 1;
const V: usize = 2;

/// Query rows a band holds: each band of a head is a task, and reads only the keys its rows
/// attend to. Up to 64 rows, one band: a whole small product runs faster than parts.
const BAND_ROWS: usize = 64;

/// The keys rows up to `end` (exclusive) read: all of them, or with a causal mask those up
/// to `end`.
fn keys_for(shape: &Shape, end: usize) -> usize {
    if shape.causal {
        end
    } else {
        shape.len
    }
}

/// One sample: x [T, C + 2·C_kv] → y [T, C]. Each head, a band of query rows at a time on the
/// pool's threads, is two matrix products, S = Q·Kᵀ and Y = P·V, around a row softmax; with
/// dropout, V is weighted by the kept probabilities. `saved` keeps the probabilities
/// [heads, T, T]; with `flash`, y and each row's log-sum-exp [heads, T] instead, the
/// probabilities a head's scratch. A band's products stop at the last key it attends to.
fn forward_sample(
    x: &[f32],
    y: &mut [f32],
    saved: &mut [f32],
    scratch: &mut [f32],
    shape: &Shape,
    dropout: Option<ProbsDropout>,
) {
    let (t, c, d) = (shape.len, shape.width(), shape.head_dim);
    let xs = shape.qkv_width();
    let (kept, head_probs) = scratch.split_at_mut(t * t);
    // The probabilities [heads, T, T], or with flash y's copy [T, C] and then the lse.
    let (front, lse) = saved.split_at_mut(if shape.flash { t * c } else { saved.len() });
    for h in 0..shape.heads {
        let p = match shape.flash {
            true => &mut head_probs[..],
            false => &mut front[h * t * t..][..t * t],
        };
        let (q, k, v) = (part(shape, Q, h), part(shape, K, h), part(shape, V, h));
        // With flash, each band's rows' log-sum-exps; without, nothing to keep.
        let lse_bands = match shape.flash {
            true => Either::Left(lse[h * t..][..t].par_chunks_mut(BAND_ROWS).map(Some)),
            false => Either::Right(repeat_n((), t.div_ceil(BAND_ROWS)).map(|_| None)),
        };
        (y.par_chunks_mut(BAND_ROWS * c))
            .zip(p.par_chunks_mut(BAND_ROWS * t))
            .zip(kept.par_chunks_mut(BAND_ROWS * t))
            .zip(lse_bands)
            .enumerate()
            .for_each(|(band, (((y, p), kept), mut lse))| {
                let (first, rows) = (band * BAND_ROWS, y.len() / c);
                let keys = keys_for(shape, first + rows);
                vectorized(|| {
                    let at_q = &x[first * xs + q..];
                    let dims = (rows, keys, d);
                    matmul_into_rows(p, t, false, at_q, (xs, 1), &x[k..], (1, xs), dims);
                    for (r, row) in p.chunks_exact_mut(t).enumerate() {
                        let row_lse = softmax_row(row, shape.attended(first + r), shape.scale());
                        if let Some(lse) = lse.as_deref_mut() {
                            lse[r] = row_lse;
                        }
                    }
                    let weights: &[f32] = match dropout {
                        Some(dropout) => {
                            drop_probs(p, kept, dropout, shape, h, first);
                            kept
                        }
                        None => p,
                    };
                    let (out, v) = (&mut y[h * d..], &x[v..]);
                    let dims = (rows, d, keys);
                    matmul_into_rows(out, c, false, weights, (t, 1), v, (xs, 1), dims);
                });
            });
    }
    if shape.flash {
        front.copy_from_slice(&y[..t * c]);
    }
}

/// row = softmax(row[..last]·scale), 0 past `last`; returns the log-sum-exp of the scaled
/// scores.
fn softmax_row(row: &mut [f32], last: usize, scale: f32) -> f32 {
    let (row, masked) = row.split_at_mut(last);
    masked.fill(0.0);
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s)) * scale;
    row.iter_mut().for_each(|s| *s = exp(*s * scale - max));
    let total = in_lanes(row, row, |s, _| s);
    let inv = 1.0 / total;
    row.iter_mut().for_each(|s| *s *= inv);
    max + total.ln()
}

/// Head `h`'s probabilities [T, T] again from its scores and the rows' log-sum-exps `lse`
/// [T]: p = exp(s·scale − lse), 0 where masked. A band of rows a task.
fn probs_again(x: &[f32], lse: &[f32], p: &mut [f32], shape: &Shape, h: usize) {
    let (t, d, xs, scale) = (shape.len, shape.head_dim, shape.qkv_width(), shape.scale());
    let (q, k) = (part(shape, Q, h), part(shape, K, h));
    (p.par_chunks_mut(BAND_ROWS * t))
        .zip(lse.par_chunks(BAND_ROWS))
        .enumerate()
        .for_each(|(band, (p, lse))| {
            let (first, rows) = (band * BAND_ROWS, lse.len());
            let keys = keys_for(shape, first + rows);
            vectorized(|| {
                let at_q = &x[first * xs + q..];
                let dims = (rows, keys, d);
                matmul_into_rows(p, t, false, at_q, (xs, 1), &x[k..], (1, xs), dims);
                for (r, row) in p.chunks_exact_mut(t).enumerate() {
                    let (row, masked) = row.split_at_mut(shape.attended(first + r));
                    row.iter_mut().for_each(|s| *s = exp(*s * scale - lse[r]));
                    masked.fill(0.0);
                }
            });
        });
}

/// One sample's input gradient dx [T, C + 2·C_kv] from dy [T, C] and what forward saved;
/// `scratch` holds one head's score gradients [T, T] (and with `flash` its probabilities
/// again).
fn backward_sample(
    x: &[f32],
    saved: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    scratch: &mut [f32],
    shape: &Shape,
    dropout: Option<ProbsDropout>,
) {
    let (t, c) = (shape.len, shape.width());
    let (ds, head_probs) = scratch.split_at_mut(t * t);
    for h in 0..shape.heads {
        let p: &[f32] = match shape.flash {
            true => {
                probs_again(x, &saved[t * c + h * t..][..t], head_probs, shape, h);
                head_probs
            }
            false => &saved[h * t * t..][..t * t],
        };
        backward_head(x, p, dy, dx, ds, shape, dropout, h);
    }
}

/// Head `h`'s share of dx from its probabilities p [T, T]; `ds` holds its score gradients.
/// The first query head of a key and value head writes their gradients; the others of its
/// group add to them.
/// dV = Pᵀ·dY, dP = dY·Vᵀ, dS = P∘(dP − rowsum(P∘dP))/√d, dQ = dS·K, dK = dSᵀ·Q. With
/// dropout, dV reads the kept probabilities (drawn into `ds` first) and dP is masked and
/// scaled as they were. dS and dQ go by bands of query rows; dK and dV, which sum over
/// query rows, by bands of key rows, each from the first query that attends to it.
#[allow(clippy::too_many_arguments)]
fn backward_head(
    x: &[f32],
    p: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    ds: &mut [f32],
    shape: &Shape,
    dropout: Option<ProbsDropout>,
    h: usize,
) {
    let (t, c, d) = (shape.len, shape.width(), shape.head_dim);
    let (xs, scale) = (shape.qkv_width(), shape.scale());
    let (q, k, v) = (part(shape, Q, h), part(shape, K, h), part(shape, V, h));
    let adds = !h.is_multiple_of(shape.heads / shape.kv_heads);
    let dyh = &dy[h * d..];
    // The first query row that attends to key `j`.
    let first_query = |j: usize| if shape.causal { j } else { 0 };
    // dV[j] = Σᵢ weights[i, j]·dY[i], by bands of key rows.
    let dv = |dx: &mut [f32], weights: &[f32]| {
        (dx.par_chunks_mut(BAND_ROWS * xs).enumerate()).for_each(|(band, dx)| {
            let (first, rows) = (band * BAND_ROWS, dx.len() / xs);
            let i0 = first_query(first);
            let (w, g) = (&weights[i0 * t + first..], &dyh[i0 * c..]);
            let dims = (rows, d, t - i0);
            let dv = &mut dx[v..];
            vectorized(|| matmul_into_rows(dv, xs, adds, w, (1, t), g, (c, 1), dims));
        });
    };
    if let Some(dropout) = dropout {
        (ds.par_chunks_mut(BAND_ROWS * t)
            .zip(p.par_chunks(BAND_ROWS * t)))
        .enumerate()
        .for_each(|(band, (kept, p))| {
            drop_probs(p, kept, dropout, shape, h, band * BAND_ROWS);
        });
        dv(dx, ds);
    }
    // dS and dQ, by bands of query rows.
    (dx.par_chunks_mut(BAND_ROWS * xs))
        .zip(ds.par_chunks_mut(BAND_ROWS * t))
        .enumerate()
        .for_each(|(band, (dx, ds))| {
            let (first, rows) = (band * BAND_ROWS, ds.len() / t);
            let keys = keys_for(shape, first + rows);
            vectorized(|| {
                let (g, at_v) = (&dyh[first * c..], &x[v..]);
                matmul_into_rows(ds, t, false, g, (c, 1), at_v, (1, xs), (rows, keys, d));
                for (r, dp) in ds.chunks_exact_mut(t).enumerate() {
                    let i = first + r;
                    let last = shape.attended(i);
                    let p = &p[i * t..][..last];
                    if let Some(dropout) = dropout {
                        masked_in_place(&mut dp[..last], dropout, (h * t * t + i * t) as u64);
                    }
                    let total = in_lanes(&dp[..last], p, |g, pj| g * pj);
                    for (s, &pj) in dp[..last].iter_mut().zip(p) {
                        *s = pj * (*s - total) * scale;
                    }
                    dp[last..].fill(0.0);
                }
                let dims = (rows, d, keys);
                let dq = &mut dx[q..];
                matmul_into_rows(dq, xs, false, ds, (t, 1), &x[k..], (xs, 1), dims);
            });
        });
    if dropout.is_none() {
        dv(dx, p);
    }
    // dK[j] = Σᵢ dS[i, j]·Q[i], by bands of key rows.
    let ds: &[f32] = ds;
    (dx.par_chunks_mut(BAND_ROWS * xs).enumerate()).for_each(|(band, dx)| {
        let (first, rows) = (band * BAND_ROWS, dx.len() / xs);
        let i0 = first_query(first);
        let (w, at_q) = (&ds[i0 * t + first..], &x[i0 * xs + q..]);
        let dims = (rows, d, t - i0);
        let dk = &mut dx[k..];
        vectorized(|| matmul_into_rows(dk, xs, adds, w, (1, t), at_q, (xs, 1), dims));
    });
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
