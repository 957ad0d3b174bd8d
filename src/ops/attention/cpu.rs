//! attention on the CPU: one sample per task, its heads in turn, each row's scores, softmax
//! and weighted sum in one pass (nothing masked is computed).

use super::Kernels;
use crate::tensor::cpu::{vectorized, CpuBackend};
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
        _: &mut Vec<f32>,
        n: usize,
        shape: &Shape,
    ) {
        let (t, c) = (shape.len, shape.width());
        y[..n * t * c]
            .par_chunks_mut(t * c)
            .zip(probs[..n * shape.probs_len()].par_chunks_mut(shape.probs_len()))
            .zip(qkv[..n * t * 3 * c].par_chunks(t * 3 * c))
            .for_each(|((y, p), x)| vectorized(|| forward_sample(x, y, p, shape)));
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
    ) {
        let (t, c) = (shape.len, shape.width());
        dqkv[..n * t * 3 * c]
            .par_chunks_mut(t * 3 * c)
            .zip(workspace[..n * t].par_chunks_mut(t))
            .zip(qkv[..n * t * 3 * c].par_chunks(t * 3 * c))
            .zip(probs[..n * shape.probs_len()].par_chunks(shape.probs_len()))
            .zip(dy[..n * t * c].par_chunks(t * c))
            .for_each(|((((dx, ds), x), p), dy)| {
                vectorized(|| backward_sample(x, p, dy, dx, ds, shape))
            });
    }
}

/// Workspace values for `max_batch` samples: one row of score gradients each.
pub fn workspace_len(shape: &Shape, max_batch: usize) -> usize {
    max_batch * shape.len
}

/// Where head `h`'s query, key and value of position `i` start in a [T, 3·C] sample.
fn at(shape: &Shape, i: usize, part: usize, h: usize) -> usize {
    let c = shape.width();
    i * 3 * c + part * c + h * shape.head_dim
}

const Q: usize = 0;
const K: usize = 1;
const V: usize = 2;

/// One sample: x [T, 3·C] → y [T, C], probabilities p [heads, T, T].
pub fn forward_sample(x: &[f32], y: &mut [f32], p: &mut [f32], shape: &Shape) {
    let (t, c, d) = (shape.len, shape.width(), shape.head_dim);
    let scale = shape.scale();
    for h in 0..shape.heads {
        for i in 0..t {
            let row = &mut p[(h * t + i) * t..][..t];
            let last = shape.attended(i);
            let q = &x[at(shape, i, Q, h)..][..d];
            let mut max = f32::NEG_INFINITY;
            for (j, s) in row[..last].iter_mut().enumerate() {
                *s = dot(q, &x[at(shape, j, K, h)..][..d]) * scale;
                max = max.max(*s);
            }
            let mut total = 0.0f64;
            for s in &mut row[..last] {
                *s = (*s - max).exp();
                total += *s as f64;
            }
            let inv = (1.0 / total) as f32;
            row[..last].iter_mut().for_each(|s| *s *= inv);
            row[last..].fill(0.0);
            let out = &mut y[i * c + h * d..][..d];
            out.fill(0.0);
            for (j, &pj) in row[..last].iter().enumerate() {
                axpy(pj, &x[at(shape, j, V, h)..][..d], out);
            }
        }
    }
}

/// One sample's input gradient dx [T, 3·C] from dy [T, C]; `ds` holds one row of score
/// gradients.
pub fn backward_sample(
    x: &[f32],
    p: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    ds: &mut [f32],
    shape: &Shape,
) {
    let (t, c, d) = (shape.len, shape.width(), shape.head_dim);
    let scale = shape.scale();
    dx.fill(0.0);
    for h in 0..shape.heads {
        for i in 0..t {
            let last = shape.attended(i);
            let row = &p[(h * t + i) * t..][..last];
            let dyi = &dy[i * c + h * d..][..d];
            // dv_j += p_ij·dy_i; dp_ij = dy_i·v_j.
            let mut total = 0.0f64;
            for (j, &pj) in row.iter().enumerate() {
                let dp = dot(dyi, &x[at(shape, j, V, h)..][..d]);
                ds[j] = dp;
                total += (dp * pj) as f64;
                axpy(pj, dyi, &mut dx[at(shape, j, V, h)..][..d]);
            }
            // Through the softmax and the scale: ds_ij = p_ij·(dp_ij − Σ_j p_ij·dp_ij)/√d.
            let total = total as f32;
            for (s, &pj) in ds[..last].iter_mut().zip(row) {
                *s = pj * (*s - total) * scale;
            }
            // dq_i += Σ_j ds_ij·k_j; dk_j += ds_ij·q_i.
            for (j, &s) in ds[..last].iter().enumerate() {
                let (qi, kj) = (at(shape, i, Q, h), at(shape, j, K, h));
                axpy(s, &x[kj..][..d], &mut dx[qi..][..d]);
                axpy(s, &x[qi..][..d], &mut dx[kj..][..d]);
            }
        }
    }
}

/// a·b, summed in eight lanes (which vectorise) and then across them.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = (a8.remainder().iter().zip(b8.remainder()))
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in a8.zip(b8) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// y += a·x.
fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}
