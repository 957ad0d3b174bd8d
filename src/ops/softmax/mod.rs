//! softmax and log_softmax over the last axis, computed stably.
//! Its kernels live here too: `cpu.rs`, `cuda.rs`, `softmax.cu`.

pub mod cpu;
mod cuda;

use super::Flops;
use super::{Backward, Build, Compute, Dx, Engine, Forward, NoSettings, Op, OpKind};
use super::{ParamTensor, Properties, SavedState, Scratch};
use crate::error::Result;
use crate::tensor::Backend;
use std::ops::Range;

/// (log_)softmax over rows of `width` values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Softmax {
    pub width: usize,
    pub log: bool,
}

fn build(log: bool, at: &Build) -> Result<(Op, Vec<usize>)> {
    let width = *at.in_shape().last().unwrap_or(&1);
    Ok((Op::Softmax(Softmax { width, log }), at.in_shape().to_vec()))
}

pub fn softmax(_: &NoSettings, at: &mut Build) -> Result<(Op, Vec<usize>)> {
    build(false, at)
}

pub fn log_softmax(_: &NoSettings, at: &mut Build) -> Result<(Op, Vec<usize>)> {
    build(true, at)
}

/// The backend's side of softmax and log_softmax: a CPU and a CUDA implementation, in this folder.
pub trait Kernels: Backend {
    /// softmax (or log_softmax with `log`) of each row of `width` values.
    fn softmax_forward(
        &self,
        x: &Self::Buf,
        y: &mut Self::Buf,
        rows: usize,
        width: usize,
        log: bool,
    );

    /// dx from the forward output y: softmax y·(dy − Σ dy·y), log_softmax dy − exp(y)·Σ dy.
    #[allow(clippy::too_many_arguments)]
    fn softmax_backward(
        &self,
        y: &Self::Buf,
        dy: &Self::Buf,
        dx: &mut Self::Buf,
        rows: usize,
        width: usize,
        log: bool,
    );
}

impl OpKind for Softmax {
    fn properties(&self) -> Properties {
        Properties {
            writes_in_place: false,
            backward_reads_input: false,
            backward_reads_output: true,
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
        Flops::per_value(out, 3.0, 3.0)
    }
}

impl<B: Engine> Compute<B> for Softmax {
    fn forward(&self, f: &mut Forward<'_, B>) {
        let (backend, rows) = (f.backend, f.out_len / self.width);
        let io = f.io();
        backend.softmax_forward(io.x, io.y, rows, self.width, self.log);
    }

    fn backward(&self, b: &mut Backward<'_, B>) -> Dx {
        let (backend, rows) = (b.backend, b.out_len / self.width);
        let g = b.io();
        if let Some(dx) = g.dx {
            backend.softmax_backward(g.y, g.dy, dx, rows, self.width, self.log);
        }
        Dx::Written { exact: false }
    }
}
