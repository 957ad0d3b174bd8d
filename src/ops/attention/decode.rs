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
/// the samples in turn, then each sample's keys and values [positions, 2·C].
pub fn state_len(shape: &Shape, positions: usize, max_batch: usize) -> usize {
    shape.heads * positions + max_batch * positions * 2 * shape.width()
}

/// The scores of every head [heads, positions].
pub fn workspace_len(shape: &Shape, positions: usize) -> usize {
    shape.heads * positions
}

/// y [n, C] from qkv [n, 3·C] at `cache.position`, per head softmax(q·Kᵀ/√d)·V over the
/// cached positions up to it.
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
    let (c, d, heads) = (shape.width(), shape.head_dim, shape.heads);
    let attended = cache.position + 1;
    let probs_len = heads * cache.positions;
    for b in 0..n {
        let keys = probs_len + b * cache.positions * 2 * c;
        // This position's key and value, side by side in qkv, join the cache.
        let at = (2 * c, keys + cache.position * 2 * c);
        backend.copy_rows(qkv, (3 * c, b * 3 * c + c), state, at, 2 * c, 1, false);
        let query = Matrices {
            offset: b * 3 * c,
            batch_stride: d,
            row_stride: 3 * c,
            transposed: false,
        };
        let cached = |offset| Matrices {
            offset,
            batch_stride: d,
            row_stride: 2 * c,
            transposed: offset == keys,
        };
        let rows = Matrices {
            offset: 0,
            batch_stride: attended,
            row_stride: attended,
            transposed: false,
        };
        // Shapes are (m, n, k): one query row against `attended` keys of d values.
        let (q_k, s) = ((1, attended, d), heads);
        backend.batched_matmul(q_k, s, qkv, query, state, cached(keys), scores, rows, false);
        backend.scale(scores, shape.scale());
        backend.softmax_forward(scores, state, heads, attended, false);
        let out = Matrices {
            offset: b * c,
            batch_stride: d,
            // One row: C's rows are n = d apart.
            row_stride: d,
            transposed: false,
        };
        let p_v = (1, d, attended);
        backend.batched_matmul(
            p_v,
            heads,
            state,
            rows,
            state,
            cached(keys + c),
            y,
            out,
            false,
        );
    }
}
