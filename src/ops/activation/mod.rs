//! relu, gelu (exact or tanh), tanh, sigmoid, silu: elementwise, any shape.
//! Its kernels live here too: `cpu.rs`, `cuda.rs`, `activation.cu`.

pub mod cpu;
mod cuda;

use super::Flops;
use super::{Backward, Build, Checks, Compute, Dx, Engine, Forward, NoSettings, Op, OpKind};
use super::{ParamTensor, Properties, SavedState, Scratch};
use crate::error::Result;
use crate::tensor::{Activation as Function, Backend, HalfKind};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::ops::Range;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum GeluApproximation {
    /// The exact form, x·Φ(x) (PyTorch's default).
    None,
    /// The tanh approximation.
    Tanh,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GeluSpec {
    #[serde(default = "default_gelu")]
    pub approximate: GeluApproximation,
}

fn default_gelu() -> GeluApproximation {
    GeluApproximation::None
}

impl GeluSpec {
    pub(super) fn check(&self, _: &mut Checks) {}
}

/// An elementwise activation function.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Activation {
    pub f: Function,
}

fn of(f: Function, at: &Build) -> Result<(Op, Vec<usize>)> {
    Ok((Op::Activation(Activation { f }), at.in_shape().to_vec()))
}

pub fn relu(_: &NoSettings, at: &mut Build) -> Result<(Op, Vec<usize>)> {
    of(Function::Relu, at)
}

pub fn tanh(_: &NoSettings, at: &mut Build) -> Result<(Op, Vec<usize>)> {
    of(Function::Tanh, at)
}

pub fn sigmoid(_: &NoSettings, at: &mut Build) -> Result<(Op, Vec<usize>)> {
    of(Function::Sigmoid, at)
}

pub fn silu(_: &NoSettings, at: &mut Build) -> Result<(Op, Vec<usize>)> {
    of(Function::Silu, at)
}

pub fn gelu(spec: &GeluSpec, at: &mut Build) -> Result<(Op, Vec<usize>)> {
    let f = match spec.approximate {
        GeluApproximation::None => Function::Gelu,
        GeluApproximation::Tanh => Function::GeluTanh,
    };
    of(f, at)
}

/// The backend's side of the activations: a CPU and a CUDA implementation, in this folder.
pub trait Kernels: Backend {
    fn activation_forward(&self, f: Function, x: &Self::Buf, y: &mut Self::Buf, len: usize);

    /// `activation_forward` writing y over x (a layer whose input nothing else needs:
    /// `graph::BufferPlan::in_place`).
    fn activation_in_place(&self, f: Function, buf: &mut Self::Buf, len: usize);

    /// Mixed precision: rounds `buf` to `kind`, applies `f` in place and rounds the result
    /// (ReLU's needs none): the rounding of the layer before, left to its only reader, in
    /// one pass where the backend can (see graph::Network's rounding fusion).
    fn activation_in_place_rounding(
        &self,
        kind: HalfKind,
        f: Function,
        buf: &mut Self::Buf,
        len: usize,
    );

    /// dx = dy · f'(x), given x and y = f(x). ReLU, tanh and sigmoid read y alone, so they
    /// may run in place (x is then y).
    #[allow(clippy::too_many_arguments)]
    fn activation_backward(
        &self,
        f: Function,
        x: &Self::Buf,
        y: &Self::Buf,
        dy: &Self::Buf,
        dx: &mut Self::Buf,
        len: usize,
    );

    /// Mixed precision: `activation_backward` of dy rounded to `kind`, with dx rounded
    /// (ReLU's needs none): the rounding of the layer after, left to its only reader, in one
    /// pass where the backend can. dy may be left rounded or not; nothing else reads it.
    #[allow(clippy::too_many_arguments)]
    fn activation_backward_rounding(
        &self,
        kind: HalfKind,
        f: Function,
        x: &Self::Buf,
        y: &Self::Buf,
        dy: &mut Self::Buf,
        dx: &mut Self::Buf,
        len: usize,
    );
}

impl OpKind for Activation {
    fn properties(&self) -> Properties {
        let relu = self.f == Function::Relu;
        // GELU's and SiLU's backward read their input, so they cannot overwrite it.
        let reads_input = matches!(self.f, Function::Gelu | Function::GeluTanh | Function::Silu);
        Properties {
            writes_in_place: !reads_input,
            backward_reads_input: reads_input,
            backward_reads_output: true,
            // ReLU of a half value is one.
            forward_keeps_half: relu,
            is_view: false,
            activation: Some(self.f),
            applies_relu_after: false,
            takes_gradient_through_relu: false,
            multiplies_input: false,
            rounds_dx_after: false,
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
        // Elementwise: one operation a value, two in backward.
        Flops::per_value(out, 1.0, 2.0)
    }
}

impl<B: Engine> Compute<B> for Activation {
    fn forward(&self, f: &mut Forward<'_, B>) {
        let (backend, len, fusion) = (f.backend, f.out_len, f.fusion);
        if !f.in_place {
            let io = f.io();
            backend.activation_forward(self.f, io.x, io.y, len);
            return;
        }
        // In place: the input is in the output buffer already.
        match (f.half, fusion.input, fusion.by_product) {
            (_, _, true) => {} // the linear layer before applied it
            (Some(kind), true, _) => {
                backend.activation_in_place_rounding(kind, self.f, f.output(), len)
            }
            _ => backend.activation_in_place(self.f, f.output(), len),
        }
    }

    fn backward(&self, b: &mut Backward<'_, B>) -> Dx {
        if self.f == Function::Relu && b.taken_through {
            return Dx::Done; // the pooling after it took the gradient through it
        }
        let (backend, len, half, fusion) = (b.backend, b.out_len, b.half, b.fusion);
        if let (Some(kind), true) = (half, fusion.grad) {
            // dy is unrounded (the layer after left it), dx its own buffer (`Fusion`).
            let (x, y, dy, dx) = b.io_rounding_dy();
            backend.activation_backward_rounding(kind, self.f, x, y, dy, dx, len);
            return Dx::Done;
        }
        let g = b.io();
        let Some(dx) = g.dx else {
            return Dx::Done;
        };
        backend.activation_backward(self.f, g.x, g.y, g.dy, dx, len);
        // ReLU's dx is dy or 0: already a half value.
        Dx::Written {
            exact: self.f == Function::Relu,
        }
    }
}
