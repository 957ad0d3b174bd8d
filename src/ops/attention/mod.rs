//! attention: multi-head scaled dot-product attention, causal by default, as in nanoGPT's
//! CausalSelfAttention between its two projections. A sample of [T, 3·C] holds each
//! position's query, key and value side by side (a `linear` layer of 3·C outputs makes them);
//! the output is [T, C], the heads side by side (a `linear` layer of C outputs after it is
//! the output projection).
//! Its kernels live here too: `cpu.rs`, `cuda.rs`, `attention.cu`.

pub mod cpu;
mod cuda;

pub use cuda::workspace_len as cuda_workspace_len;

use super::{shape_str, Backward, Build, Checks, Compute, Dx, Engine, Forward, Op, OpKind};
use super::{ParamTensor, Properties, SavedState, Scratch};
use crate::error::Result;
use crate::tensor::{Attention as Shape, Backend};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::ops::Range;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AttentionSpec {
    /// Attention heads; they split the width C evenly.
    #[schemars(range(min = 1, max = 2147483647))]
    pub heads: usize,
    /// Each position attends to itself and earlier positions only (a language model's
    /// mask). Default true.
    #[serde(default = "yes")]
    pub causal: bool,
}

fn yes() -> bool {
    true
}

impl AttentionSpec {
    pub(super) fn check(&self, c: &mut Checks) {
        c.size("heads", self.heads, 1);
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Attention {
    pub shape: Shape,
}

pub fn build(spec: &AttentionSpec, at: &mut Build) -> Result<(Op, Vec<usize>)> {
    let shape = at.in_shape().to_vec();
    let [len, fused] = shape[..] else {
        let why = format!(
            "it reads [length, 3·width] samples (queries, keys and values side by side, from a \
             linear layer of 3·width outputs), but the previous layer outputs {}",
            shape_str(&shape)
        );
        return Err(at.error("attention", why));
    };
    if fused % 3 != 0 {
        let why = format!(
            "its input's last axis holds queries, keys and values side by side, 3·width values, \
             but it has {fused}, which 3 does not divide"
        );
        return Err(at.error("attention", why));
    }
    let width = fused / 3;
    if width % spec.heads != 0 {
        let why = format!("heads = {} does not divide the width {width}", spec.heads);
        return Err(at.error("attention", why));
    }
    let shape = Shape {
        len,
        heads: spec.heads,
        head_dim: width / spec.heads,
        causal: spec.causal,
    };
    Ok((Op::Attention(Attention { shape }), vec![len, width]))
}

/// The backend's side of attention: a CPU and a CUDA implementation, in this folder.
pub trait Kernels: Backend {
    /// The scratch `attention_forward` and `attention_backward` need for `max_batch` samples.
    fn attention_workspace_len(&self, shape: &Shape, max_batch: usize) -> usize;

    /// y [n, T, C] from qkv [n, T, 3·C]: per head, softmax(q·kᵀ/√d, masked)·v. Keeps the
    /// probabilities [n, heads, T, T] in `probs` for backward (0 where masked).
    #[allow(clippy::too_many_arguments)]
    fn attention_forward(
        &self,
        qkv: &Self::Buf,
        y: &mut Self::Buf,
        probs: &mut Self::Buf,
        workspace: &mut Self::Buf,
        n: usize,
        shape: &Shape,
    );

    /// dqkv [n, T, 3·C] from dy [n, T, C], the input and the kept probabilities.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        qkv: &Self::Buf,
        probs: &Self::Buf,
        dy: &Self::Buf,
        dqkv: &mut Self::Buf,
        workspace: &mut Self::Buf,
        n: usize,
        shape: &Shape,
    );
}

impl OpKind for Attention {
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
            token_vocab: None,
            draws_masks: false,
            one_value_per_channel: false,
        }
    }
    fn parameters(&self) -> Vec<ParamTensor> {
        Vec::new()
    }
    fn written_params(&self) -> Vec<Range<usize>> {
        Vec::new()
    }
    fn state_len(&self, _: &[usize], max_batch: usize) -> usize {
        // The probabilities, which backward reads.
        max_batch * self.shape.probs_len()
    }
    fn saved_state(&self) -> Option<SavedState> {
        None
    }
    fn workspace(&self, rules: &Scratch) -> Option<usize> {
        Some((rules.attention)(&self.shape))
    }
}

impl<B: Engine> Compute<B> for Attention {
    fn forward(&self, f: &mut Forward<'_, B>) {
        let (backend, n) = (f.backend, f.n);
        let io = f.io();
        backend.attention_forward(io.x, io.y, io.state, io.workspace, n, &self.shape);
    }

    fn backward(&self, b: &mut Backward<'_, B>) -> Dx {
        let (backend, n) = (b.backend, b.n);
        let g = b.io();
        if let Some(dx) = g.dx {
            backend.attention_backward(g.x, g.state, g.dy, dx, g.workspace, n, &self.shape);
        }
        Dx::Written { exact: false }
    }
}
