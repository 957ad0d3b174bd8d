//! dropout: zeroes each value with probability p in training and scales the rest by
//! 1/(1-p); the identity in evaluation. The mask is a pure function of the seed, the layer
//! and the micro-step, so backward (and a recomputation) draws the same one.
//! Its kernels live here too: `cpu.rs`, `cuda.rs`, `dropout.cu`.

pub mod cpu;
mod cuda;

use super::Flops;
use super::{Backward, Build, Checks, Compute, Dx, Engine, Forward, Op, OpKind, Pass};
use super::{ParamTensor, Properties, SavedState, Scratch};
use crate::error::Result;
use crate::tensor::Backend;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::ops::Range;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DropoutSpec {
    /// Probability of zeroing an element, in [0, 1).
    #[serde(default = "default_dropout")]
    #[schemars(range(min = 0), extend("exclusiveMaximum" = 1))]
    pub p: f64,
}

fn default_dropout() -> f64 {
    0.5
}

impl DropoutSpec {
    pub(super) fn check(&self, c: &mut Checks) {
        let message = format!("{} given; must be in [0, 1)", self.p);
        c.check((0.0..1.0).contains(&self.p), "p", message);
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dropout {
    pub p: f32,
}

pub fn build(spec: &DropoutSpec, at: &mut Build) -> Result<(Op, Vec<usize>)> {
    let op = Dropout { p: spec.p as f32 };
    Ok((Op::Dropout(op), at.in_shape().to_vec()))
}

/// The backend's side of dropout: a CPU and a CUDA implementation, in this folder.
pub trait Kernels: Backend {
    /// Keeps x[i] / (1 - p) where `rng::uniform(key, first + i) >= p`, else 0. The mask is
    /// never stored: the backward pass (and a recomputation) draws it again from the same key.
    /// `first` places these elements in a larger batch's stream: a data-parallel replica's
    /// share of a micro-batch draws the mask the whole micro-batch would for those samples.
    fn dropout_forward(
        &self,
        p: f32,
        key: u64,
        first: u64,
        x: &Self::Buf,
        y: &mut Self::Buf,
        len: usize,
    );

    fn dropout_backward(
        &self,
        p: f32,
        key: u64,
        first: u64,
        dy: &Self::Buf,
        dx: &mut Self::Buf,
        len: usize,
    );

    /// `dropout_forward` writing y over x.
    fn dropout_in_place(&self, p: f32, key: u64, first: u64, buf: &mut Self::Buf, len: usize);
}

impl OpKind for Dropout {
    fn properties(&self) -> Properties {
        Properties {
            writes_in_place: true,
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
            draws_masks: true,
            one_value_per_channel: false,
            one_position_at_a_time: true,
            attention: None,
            layer_norm_eps: None,
            rms_norm_eps: None,
            rotary: None,
        }
    }
    fn parameters(&self) -> Vec<ParamTensor> {
        Vec::new()
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

impl<B: Engine> Compute<B> for Dropout {
    fn forward(&self, f: &mut Forward<'_, B>) {
        let (backend, len, mask, p) = (f.backend, f.out_len, f.mask, self.p);
        let drops = f.pass != Pass::Eval && p > 0.0;
        match (f.in_place, drops) {
            (true, true) => backend.dropout_in_place(p, mask.key, mask.first, f.output(), len),
            (true, false) => {} // the identity, in place
            (false, true) => {
                let io = f.io();
                backend.dropout_forward(p, mask.key, mask.first, io.x, io.y, len);
            }
            (false, false) => {
                let io = f.io();
                backend.copy(io.x, io.y, len);
            }
        }
    }

    fn backward(&self, b: &mut Backward<'_, B>) -> Dx {
        let (backend, len, mask, p) = (b.backend, b.out_len, b.mask, self.p);
        let g = b.io();
        let Some(dx) = g.dx else {
            return Dx::Done;
        };
        if p > 0.0 {
            backend.dropout_backward(p, mask.key, mask.first, g.dy, dx, len);
        } else {
            backend.copy(g.dy, dx, len);
        }
        Dx::Written { exact: false }
    }
}
