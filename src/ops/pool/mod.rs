//! maxpool2d, avgpool2d and global_avg_pool over [channels, height, width] samples, as
//! PyTorch's MaxPool2d, AvgPool2d (count_include_pad) and AdaptiveAvgPool2d(1).
//! Its kernels live here too: `cpu.rs` (with `max_pool_2x2.rs`), `cuda.rs`, `pool.cu`.

pub mod cpu;
mod cuda;
pub mod max_pool_2x2;

use super::shape::chw;
use super::Flops;
use super::{Backward, Build, Checks, Compute, Dx, Engine, Forward, NoSettings, Op, OpKind};
use super::{ParamTensor, Properties, SavedState, Scratch, Size2};
use crate::error::Result;
use crate::tensor::{Backend, Pool2d, PoolKind};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::ops::Range;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PoolSpec {
    pub kernel_size: Size2,
    /// Defaults to kernel_size, as in PyTorch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stride: Option<Size2>,
    /// Padding on each side (at most half the kernel).
    #[serde(default = "size_zero")]
    pub padding: Size2,
}

fn size_zero() -> Size2 {
    Size2::Square(0)
}

impl PoolSpec {
    /// The window's step: the kernel size unless given, as in PyTorch.
    pub fn stride(&self) -> Size2 {
        self.stride.unwrap_or(self.kernel_size)
    }

    pub(super) fn check(&self, c: &mut Checks) {
        c.size2("kernel_size", self.kernel_size, 1);
        if let Some(stride) = self.stride {
            c.size2("stride", stride, 1);
        }
        c.size2("padding", self.padding, 0);
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pool {
    pub kind: PoolKind,
    pub geom: Pool2d,
}

pub fn max(spec: &PoolSpec, at: &mut Build) -> Result<(Op, Vec<usize>)> {
    build(PoolKind::Max, spec, at)
}

pub fn avg(spec: &PoolSpec, at: &mut Build) -> Result<(Op, Vec<usize>)> {
    build(PoolKind::Avg, spec, at)
}

fn build(kind: PoolKind, l: &PoolSpec, at: &mut Build) -> Result<(Op, Vec<usize>)> {
    let name = if kind == PoolKind::Max {
        "maxpool2d"
    } else {
        "avgpool2d"
    };
    let (c, h, w) = chw(at.key, name, at.in_shape())?;
    let k = l.kernel_size.pair();
    let pad = l.padding.pair();
    if pad.0 * 2 > k.0 || pad.1 * 2 > k.1 {
        let why = format!("padding {pad:?} must be at most half the kernel {k:?} (as in PyTorch)");
        return Err(at.error(name, why));
    }
    let geom = Pool2d {
        c,
        h,
        w,
        k,
        stride: l.stride().pair(),
        pad,
    };
    match geom.out_hw() {
        Some((oh, ow)) if oh > 0 && ow > 0 && geom.stride.0 > 0 && geom.stride.1 > 0 => {
            Ok((Op::Pool(Pool { kind, geom }), vec![c, oh, ow]))
        }
        _ => Err(at.error(
            name,
            format!("a {}x{} window does not fit the {h}x{w} input", k.0, k.1),
        )),
    }
}

/// AdaptiveAvgPool2d(1): an average pool whose window is the whole plane.
pub fn global_avg(_: &NoSettings, at: &mut Build) -> Result<(Op, Vec<usize>)> {
    let (c, h, w) = chw(at.key, "global_avg_pool", at.in_shape())?;
    let geom = Pool2d {
        c,
        h,
        w,
        k: (h, w),
        stride: (h, w),
        pad: (0, 0),
    };
    let kind = PoolKind::Avg;
    Ok((Op::Pool(Pool { kind, geom }), vec![c, 1, 1]))
}

/// The backend's side of pooling: a CPU and a CUDA implementation, in this folder.
pub trait Kernels: Backend {
    fn pool2d_forward(
        &self,
        kind: PoolKind,
        s: &Pool2d,
        x: &Self::Buf,
        y: &mut Self::Buf,
        n: usize,
    );

    /// dx from dy (max pooling sends each to its window's first maximum, found again from x
    /// and y). `through_relu`: x is a ReLU's output and dx the gradient of that ReLU's input,
    /// each value times (x > 0 ? 1 : 0) as the ReLU's backward step would give
    /// (`graph::BufferPlan::through_relu`).
    #[allow(clippy::too_many_arguments)]
    fn pool2d_backward(
        &self,
        kind: PoolKind,
        s: &Pool2d,
        x: &Self::Buf,
        y: &Self::Buf,
        dy: &Self::Buf,
        dx: &mut Self::Buf,
        n: usize,
        through_relu: bool,
    );
}

impl OpKind for Pool {
    fn properties(&self) -> Properties {
        Properties {
            writes_in_place: false,
            backward_reads_input: true,
            backward_reads_output: true,
            // The maximum of half values is one.
            forward_keeps_half: self.kind == PoolKind::Max,
            is_view: false,
            activation: None,
            applies_relu_after: false,
            takes_gradient_through_relu: true,
            multiplies_input: false,
            rounds_dx_after: true,
            token_vocab: None,
            draws_masks: false,
            one_value_per_channel: false,
            one_position_at_a_time: false,
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

    fn flops(&self, input: &[usize], _: &[usize]) -> Flops {
        // Each input value read once.
        Flops::per_value(input, 1.0, 1.0)
    }
}

impl<B: Engine> Compute<B> for Pool {
    fn forward(&self, f: &mut Forward<'_, B>) {
        let (backend, n) = (f.backend, f.n);
        let io = f.io();
        backend.pool2d_forward(self.kind, &self.geom, io.x, io.y, n);
    }

    fn backward(&self, b: &mut Backward<'_, B>) -> Dx {
        let (backend, n, through_relu) = (b.backend, b.n, b.through_relu);
        let g = b.io();
        if let Some(dx) = g.dx {
            let (kind, geom) = (self.kind, &self.geom);
            backend.pool2d_backward(kind, geom, g.x, g.y, g.dy, dx, n, through_relu);
        }
        Dx::Written { exact: false }
    }
}
