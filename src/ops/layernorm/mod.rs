//! layernorm: normalises over the last axis with a learned scale and shift, as PyTorch's
//! LayerNorm; γ then β in the flat buffer. It saves each row's mean and inverse standard
//! deviation for backward. Its kernels live here too: `cpu.rs`, `cuda.rs`, `layernorm.cu`.

pub mod cpu;
mod cuda;

use super::Flops;
use super::ParamTensor;
use super::{numel, Properties, SavedState, Scratch};
use super::{Backward, Build, Checks, Compute, Dx, Engine, Forward, Init, Op, OpKind};
use crate::error::Result;
use crate::tensor::Backend;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::ops::Range;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LayerNormSpec {
    /// Added to the variance for numerical stability.
    #[serde(default = "default_norm_eps")]
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub eps: f64,
    /// A learned shift β after the scale (PyTorch's default); nanoGPT's GPT has none.
    #[serde(default = "yes")]
    pub bias: bool,
}

fn yes() -> bool {
    true
}

pub(super) fn default_norm_eps() -> f64 {
    1e-5
}

impl LayerNormSpec {
    pub(super) fn check(&self, c: &mut Checks) {
        let message = format!("{} given; must be positive", self.eps);
        c.check(self.eps > 0.0, "eps", message);
    }
}

/// Over rows of `width` values; γ at `gamma`, β (with `bias`) right after it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerNorm {
    pub width: usize,
    pub gamma: usize,
    pub bias: bool,
    pub eps: f32,
}

pub fn build(spec: &LayerNormSpec, at: &mut Build) -> Result<(Op, Vec<usize>)> {
    let width = *at.in_shape().last().unwrap_or(&1);
    let gamma = at.reserve(if spec.bias { 2 * width } else { width });
    let op = LayerNorm {
        width,
        gamma,
        bias: spec.bias,
        eps: spec.eps as f32,
    };
    Ok((Op::LayerNorm(op), at.in_shape().to_vec()))
}

/// The backend's side of layer norm: a CPU and a CUDA implementation, in this folder.
pub trait Kernels: Backend {
    /// Layer norm over rows of `width`, γ = params[gamma..], β = params[gamma + width..]
    /// with `bias` (else none); `saved` = [mean | invstd] per row.
    #[allow(clippy::too_many_arguments)]
    fn layernorm_forward(
        &self,
        x: &Self::Buf,
        y: &mut Self::Buf,
        shape: (usize, usize),
        params: &Self::Buf,
        at: (usize, bool),
        saved: &mut Self::Buf,
        eps: f32,
    );

    /// dx (where given) from dy and the saved statistics; dγ (and dβ with `bias`) added to
    /// `grads`.
    #[allow(clippy::too_many_arguments)]
    fn layernorm_backward(
        &self,
        x: &Self::Buf,
        dy: &Self::Buf,
        dx: Option<&mut Self::Buf>,
        shape: (usize, usize),
        params: &Self::Buf,
        grads: &mut Self::Buf,
        at: (usize, bool),
        saved: &Self::Buf,
    );
}

impl OpKind for LayerNorm {
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
            one_position_at_a_time: true,
            attention: None,
            layer_norm_eps: Some(self.eps),
            rms_norm_eps: None,
            rotary: None,
        }
    }
    fn parameters(&self) -> Vec<ParamTensor> {
        let mut tensors = norm_parameters(self.width, self.gamma);
        tensors.truncate(if self.bias { 2 } else { 1 });
        tensors
    }
    fn written_params(&self) -> Vec<Range<usize>> {
        Vec::new()
    }
    fn state_len(&self, out_shape: &[usize], max_batch: usize) -> usize {
        // Each row's mean and inverse standard deviation.
        2 * max_batch * numel(out_shape) / self.width.max(1)
    }
    fn saved_state(&self) -> Option<SavedState> {
        None
    }
    fn workspace(&self, _: &Scratch) -> Option<usize> {
        None
    }

    fn flops(&self, _: &[usize], out: &[usize]) -> Flops {
        // Mean, variance, normalise and scale; backward about eight a value.
        Flops::per_value(out, 5.0, 8.0)
    }
}

/// A norm layer's γ (ones) and β (zeros), `width` each, β right after γ.
pub(super) fn norm_parameters(width: usize, gamma: usize) -> Vec<ParamTensor> {
    let tensor = |name, offset, value| ParamTensor {
        name,
        shape: vec![width],
        offset,
        init: Init::Constant(value),
    };
    vec![
        tensor("weight", gamma, 1.0),
        tensor("bias", gamma + width, 0.0),
    ]
}

impl<B: Engine> Compute<B> for LayerNorm {
    fn forward(&self, f: &mut Forward<'_, B>) {
        let (backend, shape) = (f.backend, (f.out_len / self.width, self.width));
        let io = f.io();
        let at = (self.gamma, self.bias);
        backend.layernorm_forward(io.x, io.y, shape, io.params, at, io.state, self.eps);
    }

    fn backward(&self, b: &mut Backward<'_, B>) -> Dx {
        let (backend, shape) = (b.backend, (b.out_len / self.width, self.width));
        let g = b.io();
        let (params, at) = (g.params, (self.gamma, self.bias));
        backend.layernorm_backward(g.x, g.dy, g.dx, shape, params, g.grads, at, g.state);
        Dx::Written { exact: false }
    }
}
