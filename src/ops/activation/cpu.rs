//! The activations on the CPU: elementwise passes split across threads, the functions and
//! their derivatives in f32 as PyTorch computes them.

use super::Kernels;
use crate::tensor::cpu::{map1, map2, simd_fn, CpuBackend};
use crate::tensor::vector_math::{erfc, exp};
use crate::tensor::{Activation, Backend, HalfKind};

impl Kernels for CpuBackend {
    fn activation_forward(&self, f: Activation, x: &Vec<f32>, y: &mut Vec<f32>, len: usize) {
        // One loop per function: a per-element match on `f` keeps LLVM from vectorising.
        let (x, y) = (&x[..len], &mut y[..len]);
        match f {
            Activation::Relu => map_from(y, x, relu),
            Activation::Gelu => map_from(y, x, gelu),
            Activation::GeluTanh => map_from(y, x, gelu_tanh),
            Activation::Tanh => map_from(y, x, f32::tanh),
            Activation::Sigmoid => map_from(y, x, sigmoid),
            Activation::Silu => map_from(y, x, silu),
        }
    }

    fn activation_in_place(&self, f: Activation, buf: &mut Vec<f32>, len: usize) {
        let buf = &mut buf[..len];
        match f {
            Activation::Relu => map_in_place(buf, relu),
            Activation::Gelu => map_in_place(buf, gelu),
            Activation::GeluTanh => map_in_place(buf, gelu_tanh),
            Activation::Tanh => map_in_place(buf, f32::tanh),
            Activation::Sigmoid => map_in_place(buf, sigmoid),
            Activation::Silu => map_in_place(buf, silu),
        }
    }

    fn activation_backward(
        &self,
        f: Activation,
        x: &Vec<f32>,
        y: &Vec<f32>,
        dy: &Vec<f32>,
        dx: &mut Vec<f32>,
        len: usize,
    ) {
        let (x, y, dy, dx) = (&x[..len], &y[..len], &dy[..len], &mut dx[..len]);
        match f {
            // From y, as tanh and sigmoid, so that these three can run in place: y > 0 exactly
            // where x > 0 (y = max(x, 0), which is 0 for a NaN x).
            Activation::Relu => chain(dx, dy, y, |y| if y > 0.0 { 1.0 } else { 0.0 }),
            Activation::Gelu => chain(dx, dy, x, gelu_derivative),
            Activation::GeluTanh => chain(dx, dy, x, gelu_tanh_derivative),
            Activation::Tanh => chain(dx, dy, y, |y| 1.0 - y * y),
            Activation::Sigmoid => chain(dx, dy, y, |y| y * (1.0 - y)),
            Activation::Silu => chain(dx, dy, x, silu_derivative),
        }
    }

    fn activation_in_place_rounding(
        &self,
        kind: HalfKind,
        f: Activation,
        buf: &mut Self::Buf,
        len: usize,
    ) {
        self.round_to_half(kind, buf, len);
        self.activation_in_place(f, buf, len);
        if f != Activation::Relu {
            self.round_to_half(kind, buf, len);
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn activation_backward_rounding(
        &self,
        kind: HalfKind,
        f: Activation,
        x: &Self::Buf,
        y: &Self::Buf,
        dy: &mut Self::Buf,
        dx: &mut Self::Buf,
        len: usize,
    ) {
        self.round_to_half(kind, dy, len);
        self.activation_backward(f, x, y, dy, dx, len);
        if f != Activation::Relu {
            self.round_to_half(kind, dx, len);
        }
    }
}

/// y = f(x), in parallel chunks.
fn map_from(y: &mut [f32], x: &[f32], f: impl Fn(f32) -> f32 + Sync + Copy) {
    map2(y, x, |y, x, _| apply(y, x, f));
}

fn map_in_place(buf: &mut [f32], f: impl Fn(f32) -> f32 + Sync + Copy) {
    map1(buf, |buf, _| apply_in_place(buf, f));
}

/// dx = dy · f'(at), where `at` is the input or the output, whichever f' reads.
fn chain(dx: &mut [f32], dy: &[f32], at: &[f32], derivative: impl Fn(f32) -> f32 + Sync + Copy) {
    map2(dx, dy, |dx, dy, start| {
        let at = &at[start..start + dx.len()];
        zip_with(dx, dy, at, |g, a| g * derivative(a));
    });
}

// `f` is inlined into a loop of each width (`simd_fn!`).
simd_fn! {
    fn apply(out: &mut [f32], a: &[f32], f: impl Fn(f32) -> f32 + Copy) {
        for (o, &a) in out.iter_mut().zip(a) {
            *o = f(a);
        }
    }
}

simd_fn! {
    fn apply_in_place(buf: &mut [f32], f: impl Fn(f32) -> f32 + Copy) {
        for v in buf {
            *v = f(*v);
        }
    }
}

simd_fn! {
    fn zip_with(out: &mut [f32], a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32 + Copy) {
        for ((o, &a), &b) in out.iter_mut().zip(a).zip(b) {
            *o = f(a, b);
        }
    }
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_COEF: f32 = 0.044_715;
const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;

/// max(x, 0) that passes NaN on, as PyTorch's ReLU does (`f32::max` would return 0): a NaN
/// from bad data then reaches the loss, which fails or skips its step, instead of vanishing
/// here while the weight gradient (0 · NaN) quietly turns the weights to NaN.
#[inline(always)]
pub fn relu(x: f32) -> f32 {
    if x > 0.0 || x.is_nan() {
        x
    } else {
        0.0
    }
}

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// x / (1 + e^−x), as PyTorch's CPU kernel writes x·σ(x). The vectorisable exp keeps the
/// loop in SIMD lanes.
#[inline(always)]
fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// σ(x)·(1 + x·(1 − σ(x))), PyTorch's silu_backward.
#[inline(always)]
fn silu_derivative(x: f32) -> f32 {
    let s = 1.0 / (1.0 + exp(-x));
    s * (1.0 + x * (1.0 - s))
}

/// x·Φ(x), exact GELU.
#[inline(always)]
fn gelu(x: f32) -> f32 {
    0.5 * x * erfc(-x * std::f32::consts::FRAC_1_SQRT_2)
}

/// Φ(x) + x·φ(x).
#[inline(always)]
fn gelu_derivative(x: f32) -> f32 {
    let cdf = 0.5 * erfc(-x * std::f32::consts::FRAC_1_SQRT_2);
    cdf + x * exp(-0.5 * x * x) * FRAC_1_SQRT_2PI
}

/// x·(1 + tanh(u))/2 with u = √(2/π)·(x + 0.044715·x³), written as x·σ(2u): no 1 + tanh
/// to cancel in the left tail.
#[inline(always)]
fn gelu_tanh(x: f32) -> f32 {
    x / (1.0 + exp(-2.0 * gelu_tanh_inner(x)))
}

/// σ(2u) + x·2σ(2u)(1 − σ(2u))·u′, the tanh form's derivative through the same σ.
#[inline(always)]
fn gelu_tanh_derivative(x: f32) -> f32 {
    let e = exp(-2.0 * gelu_tanh_inner(x));
    let s = 1.0 / (1.0 + e);
    s + 2.0 * x * s * (e * s) * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_COEF * x * x)
}

#[inline(always)]
fn gelu_tanh_inner(x: f32) -> f32 {
    SQRT_2_OVER_PI * (x + GELU_COEF * x * x * x)
}
