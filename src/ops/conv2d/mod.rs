//! conv2d: 2-D convolution over [channels, height, width] samples, PyTorch's Conv2d
//! (groups, stride, padding, dilation).
//! Its kernels live here too: `cpu.rs` (with the AVX-512 `conv_rows` and `row_dots`),
//! `cuda.rs`, `conv2d.cu`.

pub mod conv_rows;
pub mod cpu;
mod cuda;
pub mod row_dots;

pub use cuda::conv_workspace_len as cuda_workspace_len;

use super::shape::chw;
use super::{numel, Flops};
use super::{values, Backward, Build, Checks, Compute, Dx, Engine, Forward, Init, Op, OpKind};
use super::{ParamTensor, Properties, SavedState, Scratch, MAX_SAMPLE_VALUES};
use crate::error::Result;
use crate::tensor::{Backend, Conv2d as Geometry, GradWrite};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// A size given as one number (both dimensions) or as [height, width].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged, expecting = "expected a size: a number, or [height, width]")]
pub enum Size2 {
    Square(usize),
    HeightWidth([usize; 2]),
}

impl Size2 {
    pub fn pair(self) -> (usize, usize) {
        match self {
            Size2::Square(s) => (s, s),
            Size2::HeightWidth([h, w]) => (h, w),
        }
    }
}

impl std::fmt::Display for Size2 {
    /// As written in a job: `3` or `[3, 5]`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Size2::Square(s) => write!(f, "{s}"),
            Size2::HeightWidth([h, w]) => write!(f, "[{h}, {w}]"),
        }
    }
}

pub(super) fn size_one() -> Size2 {
    Size2::Square(1)
}

pub(super) fn size_zero() -> Size2 {
    Size2::Square(0)
}

fn yes() -> bool {
    true
}

fn one() -> usize {
    1
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Conv2dSpec {
    /// Output channels.
    #[schemars(range(min = 1, max = 2147483647))]
    pub out: usize,
    /// Input channels; inferred from the input, checked when given.
    #[serde(default, rename = "in", skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 2147483647))]
    pub in_channels: Option<usize>,
    pub kernel_size: Size2,
    #[serde(default = "size_one")]
    pub stride: Size2,
    /// Zero padding on each side.
    #[serde(default = "size_zero")]
    pub padding: Size2,
    #[serde(default = "size_one")]
    pub dilation: Size2,
    /// Channel groups: input and output channels must both divide by it.
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = 2147483647))]
    pub groups: usize,
    #[serde(default = "yes")]
    pub bias: bool,
}

impl Conv2dSpec {
    pub(super) fn check(&self, c: &mut Checks) {
        c.size("out", self.out, 1);
        if let Some(n) = self.in_channels {
            c.size("in", n, 1);
        }
        c.size("groups", self.groups, 1);
        for (name, size, min) in [
            ("kernel_size", self.kernel_size, 1),
            ("stride", self.stride, 1),
            ("padding", self.padding, 0),
            ("dilation", self.dilation, 1),
        ] {
            c.size2(name, size, min);
        }
    }
}

/// Parameters at `weight` ([o, c/groups, kh, kw]) and `bias` (o).
#[derive(Debug, Clone, PartialEq)]
pub struct Conv2d {
    pub geom: Geometry,
    pub weight: usize,
    pub bias: Option<usize>,
}

pub fn build(l: &Conv2dSpec, at: &mut Build) -> Result<(Op, Vec<usize>)> {
    let (c, h, w) = chw(at.key, "conv2d", at.in_shape())?;
    let err = |m: String| Err(at.error("conv2d", m));
    if let Some(given) = l.in_channels {
        if given != c {
            return err(format!(
                "in = {given} given, but its input has {c} channels"
            ));
        }
    }
    if l.groups == 0 || c % l.groups != 0 || !l.out.is_multiple_of(l.groups) {
        return err(format!(
            "groups = {} must divide both the input channels ({c}) and out ({})",
            l.groups, l.out
        ));
    }
    let (kh, kw) = l.kernel_size.pair();
    let geom = Geometry {
        c,
        h,
        w,
        o: l.out,
        kh,
        kw,
        stride: l.stride.pair(),
        pad: l.padding.pair(),
        dil: l.dilation.pair(),
        groups: l.groups,
    };
    let Some((oh, ow)) = geom.out_hw() else {
        return err(format!(
            "a {kh}x{kw} kernel (dilation {:?}) does not fit the {h}x{w} input with padding {:?}",
            geom.dil, geom.pad
        ));
    };
    // One sample's unrolled input (im2col): this also bounds the weight's length.
    let unrolled = values(&[c, kh, kw, oh, ow]);
    if unrolled > MAX_SAMPLE_VALUES {
        return err(format!(
            "its unrolled input holds {unrolled} values per sample ({c} channels x a {kh}x{kw} \
             kernel x {oh}x{ow} outputs); at most {MAX_SAMPLE_VALUES} are allowed"
        ));
    }
    let weight = at.reserve(geom.weight_len());
    let bias = l.bias.then(|| at.reserve(l.out));
    Ok((
        Op::Conv2d(Conv2d { geom, weight, bias }),
        vec![l.out, oh, ow],
    ))
}

/// The backend's side of conv2d: a CPU and a CUDA implementation, in this folder.
pub trait Kernels: Backend {
    /// f32 elements of scratch `conv2d_*` needs for batches of up to `max_batch`.
    fn conv_workspace_len(&self, s: &Geometry, max_batch: usize) -> usize;

    /// y[n, o, oh, ow] = conv(x, W) + b, W = params[w..] as [o, c/groups, kh, kw].
    #[allow(clippy::too_many_arguments)]
    fn conv2d_forward(
        &self,
        s: &Geometry,
        x: &Self::Buf,
        params: &Self::Buf,
        w: usize,
        b: Option<usize>,
        y: &mut Self::Buf,
        n: usize,
        workspace: &mut Self::Buf,
    );

    /// grads[W] += ∂/∂W, grads[b] += ∂/∂b (both = with `GradWrite::Overwrite`), dx = ∂/∂x
    /// when given.
    #[allow(clippy::too_many_arguments)]
    fn conv2d_backward(
        &self,
        s: &Geometry,
        x: &Self::Buf,
        dy: &Self::Buf,
        params: &Self::Buf,
        grads: &mut Self::Buf,
        dw_write: GradWrite,
        w: usize,
        b: Option<usize>,
        dx: Option<&mut Self::Buf>,
        n: usize,
        workspace: &mut Self::Buf,
    );
}

impl OpKind for Conv2d {
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
            multiplies_input: true,
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
        let g = &self.geom;
        let fan_in = g.c / g.groups * g.kh * g.kw;
        let init = Init::Uniform(1.0 / (fan_in as f64).sqrt());
        let weight = ParamTensor {
            name: "weight",
            shape: vec![g.o, g.c / g.groups, g.kh, g.kw],
            offset: self.weight,
            init,
        };
        let bias = self.bias.map(|offset| ParamTensor {
            name: "bias",
            shape: vec![g.o],
            offset,
            init,
        });
        std::iter::once(weight).chain(bias).collect()
    }
    fn written_params(&self) -> Vec<Range<usize>> {
        let weight = self.weight..self.weight + self.geom.weight_len();
        let bias = self.bias.map(|b| b..b + self.geom.o);
        std::iter::once(weight).chain(bias).collect()
    }
    fn state_len(&self, _: &[usize], _: usize) -> usize {
        0
    }
    fn saved_state(&self) -> Option<SavedState> {
        None
    }
    fn workspace(&self, rules: &Scratch) -> Option<usize> {
        Some((rules.conv)(&self.geom))
    }

    fn flops(&self, _: &[usize], out: &[usize]) -> Flops {
        // Each output value is a dot product over its group's window.
        Flops::product(numel(out) * self.geom.group_rows())
    }
}

impl<B: Engine> Compute<B> for Conv2d {
    fn forward(&self, f: &mut Forward<'_, B>) {
        let (backend, n) = (f.backend, f.n);
        let io = f.io();
        let (w, b) = (self.weight, self.bias);
        backend.conv2d_forward(&self.geom, io.x, io.weights, w, b, io.y, n, io.workspace);
    }

    fn backward(&self, b: &mut Backward<'_, B>) -> Dx {
        let (backend, n, dw) = (b.backend, b.n, b.dw);
        let g = b.io();
        backend.conv2d_backward(
            &self.geom,
            g.x,
            g.dy,
            g.weights,
            g.grads,
            dw,
            self.weight,
            self.bias,
            g.dx,
            n,
            g.workspace,
        );
        Dx::Written { exact: false }
    }
}
