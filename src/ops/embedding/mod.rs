//! embedding: a learned vector per token id, as PyTorch's Embedding. It reads the data's
//! token ids (u32, in [0, num_embeddings)): [length] → [length, embedding_dim].
//! Its kernels live here too: `cpu.rs`, `cuda.rs`, `embedding.cu`.

pub mod cpu;
mod cuda;

use super::Flops;
use super::{Backward, Build, Checks, Compute, Dx, Engine, Forward, Init, Op, OpKind, ParamTensor};
use super::{Properties, SavedState, Scratch};
use crate::error::Result;
use crate::tensor::Backend;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::ops::Range;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingSpec {
    /// The number of token ids (the vocabulary size).
    #[schemars(range(min = 1, max = 2147483647))]
    pub num_embeddings: usize,
    /// The length of each vector.
    #[schemars(range(min = 1, max = 2147483647))]
    pub embedding_dim: usize,
}

impl EmbeddingSpec {
    pub(super) fn check(&self, c: &mut Checks) {
        c.size("num_embeddings", self.num_embeddings, 1);
        c.size("embedding_dim", self.embedding_dim, 1);
    }
}

/// Rows of the table at `weight` ([vocab, dim]) for the token ids in the data.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Embedding {
    pub vocab: usize,
    pub dim: usize,
    pub weight: usize,
}

pub fn build(spec: &EmbeddingSpec, at: &mut Build) -> Result<(Op, Vec<usize>)> {
    // Token ids come from the data (through flatten/reshape at most).
    if !at.reads_data {
        return Err(at.error(
            "embedding",
            "it reads token ids, which only the data holds; make it read \
             \"input\" (the first layer, or inputs = [\"input\"])",
        ));
    }
    let (vocab, dim) = (spec.num_embeddings, spec.embedding_dim);
    let weight = at.reserve(vocab * dim);
    let mut out = at.in_shape().to_vec();
    out.push(dim);
    Ok((Op::Embedding(Embedding { vocab, dim, weight }), out))
}

/// The backend's side of embedding: a CPU and a CUDA implementation, in this folder.
pub trait Kernels: Backend {
    /// y[p, ·] = W[ids[p], ·] for `count` token ids, W = params[w..] as [vocab, dim].
    #[allow(clippy::too_many_arguments)]
    fn embedding_forward(
        &self,
        ids: &Self::Ids,
        params: &Self::Buf,
        w: usize,
        y: &mut Self::Buf,
        count: usize,
        dim: usize,
    );

    /// grads[W][ids[p], ·] += dy[p, ·], summed in position order (deterministic).
    #[allow(clippy::too_many_arguments)]
    fn embedding_backward(
        &self,
        ids: &Self::Ids,
        dy: &Self::Buf,
        grads: &mut Self::Buf,
        w: usize,
        count: usize,
        dim: usize,
    );
}

impl OpKind for Embedding {
    fn properties(&self) -> Properties {
        Properties {
            writes_in_place: false,
            backward_reads_input: true,
            backward_reads_output: false,
            forward_keeps_half: false,
            is_view: false,
            activation: None,
            applies_relu_after: false,
            takes_gradient_through_relu: false,
            multiplies_input: false,
            rounds_dx_after: true,
            token_vocab: Some(self.vocab),
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
            shape: vec![self.vocab, self.dim],
            offset: self.weight,
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
        // A gather; its backward adds rows into the table.
        Flops::per_value(out, 0.0, 1.0)
    }
}

impl<B: Engine> Compute<B> for Embedding {
    fn forward(&self, f: &mut Forward<'_, B>) {
        let (backend, rows) = (f.backend, f.out_len / self.dim);
        let ids = f.ids;
        let io = f.io();
        backend.embedding_forward(ids, io.params, self.weight, io.y, rows, self.dim);
    }

    /// The ids need no gradient: only the table's.
    fn backward(&self, b: &mut Backward<'_, B>) -> Dx {
        let (backend, rows) = (b.backend, b.out_len / self.dim);
        let ids = b.ids;
        let g = b.io();
        backend.embedding_backward(ids, g.dy, g.grads, self.weight, rows, self.dim);
        Dx::Done
    }
}
