//! Causal attention one position at a time, with a key/value cache: how `trainer sample`
//! writes a token without recomputing its context. Each step adds the new position's key and
//! value to the cache and attends to the positions up to it. Built from the backends'
//! building blocks (row copies, strided-batched products, a row softmax), so it runs on
//! every backend.

use crate::ops::Engine;
use crate::tensor::{Attention as Shape, Matrices};

/// Where a step stands in its cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cache {
    /// Positions the cache holds.
    pub positions: usize,
    /// The position this step reads, below `positions`.
    pub position: usize,
}

/// The layer's state: one head's probabilities for every head [heads, positions], shared by
/// the samples in turn, then each sample's keys and values [positions, 2·C_kv].
pub fn state_len(shape: &Shape, positions: usize, max_batch: usize) -> usize {
    shape.heads * positions + max_batch * positions * 2 * shape.kv_width()
}

/// The scores of every head [heads, positions].
pub fn workspace_len(shape: &Shape, positions: usize) -> usize {
    shape.heads * positions
}

/// y [n, C] from qkv [n, C + 2·C_kv] at `cache.position`, per head softmax(q·Kᵀ/√d)·V over
/// the cached positions up to it.
#[allow(clippy::too_many_arguments)]
pub fn forward<B: Engine>(
    backend: &B,
    qkv: &B::Buf,
    y: &mut B::Buf,
    state: &mut B::Buf,
    scores: &mut B::Buf,
    n: usize,
    shape: &Shape,
    cache: Cache,
) {
    let (c, kv, d, heads) = (shape.width(), shape.kv_width(), shape.head_dim, shape.heads);
    let (xs, group) = (shape.qkv_width(), heads / shape.kv_heads);
    let attended = cache.position + 1;
    let probs_len = heads * cache.positions;
    for b in 0..n {
        let keys = probs_len + b * cache.positions * 2 * kv;
        // This position's keys and values, side by side in qkv, join the cache.
        let at = (2 * kv, keys + cache.position * 2 * kv);
        backend.copy_rows(qkv, (xs, b * xs + c), state, at, 2 * kv, 1, false);
        let cached = |offset| Matrices {
            offset,
            batch_stride: d,
            row_stride: 2 * kv,
            transposed: offset == keys,
        };
        // Query head g·group + j reads key and value head g: each product takes the j-th
        // query head of every group, kv_heads of them, at once.
        let queries = |j: usize| Matrices {
            offset: b * xs + j * d,
            batch_stride: group * d,
            row_stride: xs,
            transposed: false,
        };
        let rows = |j: usize| Matrices {
            offset: j * attended,
            batch_stride: group * attended,
            row_stride: attended,
            transposed: false,
        };
        // Shapes are (m, n, k): one query row against `attended` keys of d values.
        let (q_k, s) = ((1, attended, d), shape.kv_heads);
        for j in 0..group {
            let (query, key_rows) = (queries(j), cached(keys));
            backend.batched_matmul(q_k, s, qkv, query, state, key_rows, scores, rows(j), false);
        }
        backend.scale(scores, shape.scale());
        backend.softmax_forward(scores, state, heads, attended, false);
        for j in 0..group {
            let out = Matrices {
                offset: b * c + j * d,
                batch_stride: group * d,
                // One row: C's rows are n = d apart.
                row_stride: d,
                transposed: false,
            };
            let (p_v, values) = ((1, d, attended), cached(keys + kv));
            backend.batched_matmul(p_v, s, state, rows(j), state, values, y, out, false);
        }
    }
}
