//! batchnorm1d and batchnorm2d: batch normalisation per channel, with batch statistics in
//! training and running statistics in evaluation, as PyTorch's BatchNorm1d/2d. γ then β in
//! the flat buffer; the running statistics are state saved with the parameters. Its kernels
//! live here too: `cpu.rs`, `cuda.rs`, `batchnorm.cu`.

pub mod cpu;
mod cuda;

use super::layernorm::{default_norm_eps, norm_parameters};
use super::shape::chw;
use super::Flops;
use super::{shape_str, Backward, Build, Checks, Compute, Dx, Engine, Forward, Op, OpKind};
use super::{ParamTensor, Pass, Properties, SavedState, Scratch};
use crate::error::Result;
use crate::tensor::Backend;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::ops::Range;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchNormSpec {
    /// Added to the variance for numerical stability.
    #[serde(default = "default_norm_eps")]
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub eps: f64,
    /// Weight of the newest batch in the running statistics.
    #[serde(default = "default_bn_momentum")]
    #[schemars(range(min = 0, max = 1))]
    pub momentum: f64,
}

fn default_bn_momentum() -> f64 {
    0.1
}

impl BatchNormSpec {
    pub(super) fn check(&self, c: &mut Checks) {
        let message = format!("{} given; must be positive", self.eps);
        c.check(self.eps > 0.0, "eps", message);
        let message = format!("{} given; must be in [0, 1]", self.momentum);
        c.check((0.0..=1.0).contains(&self.momentum), "momentum", message);
    }
}

/// Per channel of [channels, spatial] samples; γ at `gamma`, β right after it. Its state:
/// [running mean | running var | batch mean | batch invstd], `channels` values each.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchNorm {
    pub channels: usize,
    pub spatial: usize,
    pub gamma: usize,
    pub eps: f32,
    pub momentum: f32,
}

/// Over [features] (or [channels, length]) samples.
pub fn build_1d(spec: &BatchNormSpec, at: &mut Build) -> Result<(Op, Vec<usize>)> {
    let (channels, spatial) = match *at.in_shape() {
        [f] => (f, 1),
        [c, l] => (c, l),
        _ => {
            let why = format!(
                "its input has shape {} but batchnorm1d needs [features] or [channels, length] \
                 per sample (batchnorm2d is for images)",
                shape_str(at.in_shape())
            );
            return Err(at.error("batchnorm1d", why));
        }
    };
    Ok(build(spec, channels, spatial, at))
}

/// Over [channels, height, width] samples.
pub fn build_2d(spec: &BatchNormSpec, at: &mut Build) -> Result<(Op, Vec<usize>)> {
    let (c, h, w) = chw(at.key, "batchnorm2d", at.in_shape())?;
    Ok(build(spec, c, h * w, at))
}

fn build(
    spec: &BatchNormSpec,
    channels: usize,
    spatial: usize,
    at: &mut Build,
) -> (Op, Vec<usize>) {
    let gamma = at.reserve(2 * channels);
    let op = BatchNorm {
        channels,
        spatial,
        gamma,
        eps: spec.eps as f32,
        momentum: spec.momentum as f32,
    };
    (Op::BatchNorm(op), at.in_shape().to_vec())
}

/// The backend's side of batch norm: a CPU and a CUDA implementation, in this folder.
pub trait Kernels: Backend {
    /// Batch norm over [n, c, spatial] with γ = params[gamma..], β = params[gamma + c..] and
    /// `state` = [running mean | running var | batch mean | batch invstd] (c each).
    #[allow(clippy::too_many_arguments)]
    fn batchnorm_forward(
        &self,
        x: &Self::Buf,
        y: &mut Self::Buf,
        shape: (usize, usize, usize),
        params: &Self::Buf,
        gamma: usize,
        state: &mut Self::Buf,
        train: bool,
        momentum: f32,
        eps: f32,
    );

    /// Training-mode backward; uses the batch statistics the forward pass saved in `state`.
    #[allow(clippy::too_many_arguments)]
    fn batchnorm_backward(
        &self,
        x: &Self::Buf,
        dy: &Self::Buf,
        dx: Option<&mut Self::Buf>,
        shape: (usize, usize, usize),
        params: &Self::Buf,
        grads: &mut Self::Buf,
        gamma: usize,
        state: &Self::Buf,
    );
}

impl OpKind for BatchNorm {
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
            one_value_per_channel: self.spatial == 1,
            one_position_at_a_time: false,
            attention: None,
            layer_norm_eps: None,
            rms_norm_eps: None,
            rotary: None,
        }
    }
    fn parameters(&self) -> Vec<ParamTensor> {
        norm_parameters(self.channels, self.gamma)
    }
    fn written_params(&self) -> Vec<Range<usize>> {
        Vec::new()
    }
    fn state_len(&self, _: &[usize], _: usize) -> usize {
        4 * self.channels
    }
    fn saved_state(&self) -> Option<SavedState> {
        // PyTorch's start: mean 0, variance 1.
        let c = self.channels;
        let mut initial = vec![0.0; 4 * c];
        initial[c..2 * c].fill(1.0);
        Some(SavedState {
            names: &["running_mean", "running_var"],
            len: c,
            initial,
            counts_batches: true,
        })
    }
    fn workspace(&self, _: &Scratch) -> Option<usize> {
        None
    }

    fn flops(&self, _: &[usize], out: &[usize]) -> Flops {
        // Mean, variance, normalise and scale; backward about eight a value.
        Flops::per_value(out, 5.0, 8.0)
    }
}

impl<B: Engine> Compute<B> for BatchNorm {
    fn forward(&self, f: &mut Forward<'_, B>) {
        let (backend, train) = (f.backend, f.pass != Pass::Eval);
        // A recomputation must not move the running statistics a second time.
        let momentum = match f.pass {
            Pass::Recompute => 0.0,
            Pass::Train | Pass::Eval => self.momentum,
        };
        let shape = (f.n, self.channels, self.spatial);
        let io = f.io();
        let (params, gamma, eps) = (io.params, self.gamma, self.eps);
        backend.batchnorm_forward(
            io.x, io.y, shape, params, gamma, io.state, train, momentum, eps,
        );
    }

    fn backward(&self, b: &mut Backward<'_, B>) -> Dx {
        let (backend, shape) = (b.backend, (b.n, self.channels, self.spatial));
        let g = b.io();
        let (params, gamma) = (g.params, self.gamma);
        backend.batchnorm_backward(g.x, g.dy, g.dx, shape, params, g.grads, gamma, g.state);
        Dx::Written { exact: false }
    }
}
