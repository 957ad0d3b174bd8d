//! rmsnorm: each row of the last axis divided by its root mean square, times a learned
//! scale, as PyTorch's nn.RMSNorm: y = x / sqrt(mean(x²) + eps) · γ. It saves each row's
//! 1 / rms for backward. Its kernels live here too: `cpu.rs`, `cuda.rs`, `rmsnorm.cu`.

mod cpu;
mod cuda;

use super::Flops;
use super::{numel, Backward, Build, Checks, Compute, Dx, Engine, Forward, Init, Op, OpKind};
use super::{ParamTensor, Properties, SavedState, Scratch};
use crate::error::Result;
use crate::tensor::Backend;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::ops::Range;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RmsNormSpec {
    /// Added to the mean square for numerical stability; by default f32's machine epsilon,
    /// as PyTorch's `eps=None` in fp32.
    #[serde(default = "default_eps")]
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub eps: f64,
}

fn default_eps() -> f64 {
    f32::EPSILON as f64
}

impl RmsNormSpec {
    pub(super) fn check(&self, c: &mut Checks) {
        let message = format!("{} given; must be positive", self.eps);
        c.check(self.eps > 0.0, "eps", message);
    }
}

/// Over rows of `width` values; γ at `gamma`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RmsNorm {
    pub width: usize,
    pub gamma: usize,
    pub eps: f32,
}

pub fn build(spec: &RmsNormSpec, at: &mut Build) -> Result<(Op, Vec<usize>)> {
    let width = *at.in_shape().last().unwrap_or(&1);
    let gamma = at.reserve(width);
    let eps = spec.eps as f32;
    Ok((
        Op::RmsNorm(RmsNorm { width, gamma, eps }),
        at.in_shape().to_vec(),
    ))
}

/// The backend's side of rmsnorm: a CPU and a CUDA implementation, in this folder.
pub trait Kernels: Backend {
    /// y = x · r · γ over `rows` rows of `width`, r = 1 / sqrt(mean(x²) + eps) of each row,
    /// which goes to `saved` (`rows` values). γ is `width` values of `params` at `gamma`.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_forward(
        &self,
        x: &Self::Buf,
        y: &mut Self::Buf,
        shape: (usize, usize),
        params: &Self::Buf,
        gamma: usize,
        saved: &mut Self::Buf,
        eps: f32,
    );

    /// dx (where given) from dy and the saved r; dγ added to `grads` at `gamma`.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_backward(
        &self,
        x: &Self::Buf,
        dy: &Self::Buf,
        dx: Option<&mut Self::Buf>,
        shape: (usize, usize),
        params: &Self::Buf,
        grads: &mut Self::Buf,
        gamma: usize,
        saved: &Self::Buf,
    );
}

impl OpKind for RmsNorm {
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
            layer_norm_eps: None,
            rms_norm_eps: Some(self.eps),
            rotary: None,
        }
    }
    fn parameters(&self) -> Vec<ParamTensor> {
        vec![ParamTensor {
            name: "weight",
            shape: vec![self.width],
            offset: self.gamma,
            init: Init::Constant(1.0),
        }]
    }
    fn written_params(&self) -> Vec<Range<usize>> {
        Vec::new()
    }
    fn state_len(&self, out_shape: &[usize], max_batch: usize) -> usize {
        // Each row's 1 / rms.
        max_batch * numel(out_shape) / self.width.max(1)
    }
    fn saved_state(&self) -> Option<SavedState> {
        None
    }
    fn workspace(&self, _: &Scratch) -> Option<usize> {
        None
    }

    fn flops(&self, _: &[usize], out: &[usize]) -> Flops {
        Flops::per_value(out, 4.0, 7.0)
    }
}

impl<B: Engine> Compute<B> for RmsNorm {
    fn forward(&self, f: &mut Forward<'_, B>) {
        let (backend, shape) = (f.backend, (f.out_len / self.width, self.width));
        let io = f.io();
        backend.rmsnorm_forward(io.x, io.y, shape, io.params, self.gamma, io.state, self.eps);
    }

    fn backward(&self, b: &mut Backward<'_, B>) -> Dx {
        let (backend, shape) = (b.backend, (b.out_len / self.width, self.width));
        let g = b.io();
        let (params, gamma) = (g.params, self.gamma);
        backend.rmsnorm_backward(g.x, g.dy, g.dx, shape, params, g.grads, gamma, g.state);
        Dx::Written { exact: false }
    }
}
