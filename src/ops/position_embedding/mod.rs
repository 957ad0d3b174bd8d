//! position_embedding: adds a learned vector per position to a sequence, as GPT's `wpe`:
//! y[t] = x[t] + W[t] for a sample of [T, C], W a table of [num_positions, C] (T at most
//! num_positions). nanoGPT writes it as `tok_emb + wpe(arange(T))`.
//! Its kernels live here too: `cpu.rs`, `cuda.rs`, `position_embedding.cu`.

mod cpu;
mod cuda;

use super::Flops;
use super::{shape_str, Backward, Build, Checks, Compute, Dx, Engine, Forward, Init, Op, OpKind};
use super::{ParamTensor, Properties, SavedState, Scratch};
use crate::error::Result;
use crate::tensor::Backend;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::ops::Range;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PositionEmbeddingSpec {
    /// Rows of the table: the longest sequence it can take (GPT's block_size).
    #[schemars(range(min = 1, max = 2147483647))]
    pub num_positions: usize,
}

impl PositionEmbeddingSpec {
    pub(super) fn check(&self, c: &mut Checks) {
        c.size("num_positions", self.num_positions, 1);
    }
}

/// The table at `weight` ([positions, width]); a sample reads its first `len` rows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PositionEmbedding {
    pub positions: usize,
    pub len: usize,
    pub width: usize,
    pub weight: usize,
}

pub fn build(spec: &PositionEmbeddingSpec, at: &mut Build) -> Result<(Op, Vec<usize>)> {
    let shape = at.in_shape().to_vec();
    let [len, width] = shape[..] else {
        let why = format!(
            "it reads [length, width] samples (a token embedding's output), but the previous \
             layer outputs {}",
            shape_str(&shape)
        );
        return Err(at.error("position_embedding", why));
    };
    if len > spec.num_positions {
        let why = format!(
            "its input has {len} positions, past num_positions = {} rows of its table",
            spec.num_positions
        );
        return Err(at.error("position_embedding", why));
    }
    let weight = at.reserve(spec.num_positions * width);
    let op = PositionEmbedding {
        positions: spec.num_positions,
        len,
        width,
        weight,
    };
    Ok((Op::PositionEmbedding(op), shape))
}

/// The backend's side of position_embedding: a CPU and a CUDA implementation, in this folder.
pub trait Kernels: Backend {
    /// y = x + W[..len] for each of n samples of `len` values, W = params[w..].
    #[allow(clippy::too_many_arguments)]
    fn position_embedding_forward(
        &self,
        x: &Self::Buf,
        params: &Self::Buf,
        w: usize,
        y: &mut Self::Buf,
        n: usize,
        len: usize,
    );

    /// grads[W][j] += Σ over the samples of dy[·, j], in sample order (deterministic).
    fn position_embedding_backward(
        &self,
        dy: &Self::Buf,
        grads: &mut Self::Buf,
        w: usize,
        n: usize,
        len: usize,
    );
}

impl OpKind for PositionEmbedding {
    fn properties(&self) -> Properties {
        Properties {
            writes_in_place: false,
            backward_reads_input: false,
            backward_reads_output: false,
            forward_keeps_half: false,
            is_view: false,
            activation: None,
            applies_relu_after: false,
            takes_gradient_through_relu: false,
            multiplies_input: false,
            rounds_dx_after: true,
            token_vocab: None,
            draws_masks: false,
            one_value_per_channel: false,
            one_position_at_a_time: true,
            attention: None,
            layer_norm_eps: None,
            rms_norm_eps: None,
            rotary: None,
        }
    }
    fn parameters(&self) -> Vec<ParamTensor> {
        vec![ParamTensor {
            name: "weight",
            shape: vec![self.positions, self.width],
            offset: self.weight,
            // PyTorch's Embedding.
            init: Init::Normal(1.0),
        }]
    }
    fn written_params(&self) -> Vec<Range<usize>> {
        Vec::new()
    }
    fn state_len(&self, _: &[usize], _: usize) -> usize {
        0
    }
    fn saved_state(&self) -> Option<SavedState> {
        None
    }
    fn workspace(&self, _: &Scratch) -> Option<usize> {
        None
    }

    fn flops(&self, _: &[usize], out: &[usize]) -> Flops {
        Flops::per_value(out, 1.0, 1.0)
    }
}

impl<B: Engine> Compute<B> for PositionEmbedding {
    fn forward(&self, f: &mut Forward<'_, B>) {
        let (backend, n, len) = (f.backend, f.n, self.len * self.width);
        // Rows from the pass's position on: one token a step reads its own position's row.
        let weight = self.weight + f.position * self.width;
        let io = f.io();
        backend.position_embedding_forward(io.x, io.params, weight, io.y, n, len);
    }

    /// dx = dy; the table's gradient sums dy over the samples.
    fn backward(&self, b: &mut Backward<'_, B>) -> Dx {
        let (backend, n, len) = (b.backend, b.n, self.len * self.width);
        let g = b.io();
        backend.position_embedding_backward(g.dy, g.grads, self.weight, n, len);
        if let Some(dx) = g.dx {
            backend.copy(g.dy, dx, n * len);
        }
        Dx::Written { exact: true }
    }
}
