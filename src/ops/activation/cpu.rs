//! The activations on the CPU: elementwise passes split across threads, the functions and
//! their derivatives in f32 as PyTorch computes them.

use super::Kernels;
use crate::tensor::cpu::{map1, map2, CpuBackend};
use crate::tensor::{Activation, Backend, HalfKind};

impl Kernels for CpuBackend {
    fn activation_forward(&self, f: Activation, x: &Vec<f32>, y: &mut Vec<f32>, len: usize) {
        // ReLU gets a loop of its own: a per-element match on `f` keeps LLVM from vectorising.
        if f == Activation::Relu {
            return map2(&mut y[..len], &x[..len], |y, x, _| {
                for (y, &x) in y.iter_mut().zip(x) {
                    *y = relu(x);
                }
            });
        }
        map2(&mut y[..len], &x[..len], |y, x, _| {
            for (y, &x) in y.iter_mut().zip(x) {
                *y = activation(f, x);
            }
        });
    }

    fn activation_in_place(&self, f: Activation, buf: &mut Vec<f32>, len: usize) {
        if f == Activation::Relu {
            return map1(&mut buf[..len], |y, _| {
                for y in y {
                    *y = relu(*y);
                }
            });
        }
        map1(&mut buf[..len], |y, _| {
            for y in y {
                *y = activation(f, *y);
            }
        });
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
        let (x, y, dy) = (&x[..len], &y[..len], &dy[..len]);
        if f == Activation::Relu {
            // The same arithmetic as activation_derivative (dy·1 or dy·0), without the match.
            return map2(&mut dx[..len], dy, |dx, dy, start| {
                let y = &y[start..start + dx.len()];
                for ((d, &g), &y) in dx.iter_mut().zip(dy).zip(y) {
                    *d = g * if y > 0.0 { 1.0 } else { 0.0 };
                }
            });
        }
        map2(&mut dx[..len], dy, |dx, dy, start| {
            let x = &x[start..start + dx.len()];
            let y = &y[start..start + dx.len()];
            for i in 0..dx.len() {
                dx[i] = dy[i] * activation_derivative(f, x[i], y[i]);
            }
        });
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

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_COEF: f32 = 0.044_715;

/// max(x, 0) that passes NaN on, as PyTorch's ReLU does (`f32::max` would return 0): a NaN
/// from bad data then reaches the loss, which fails or skips its step, instead of vanishing
/// here while the weight gradient (0 · NaN) quietly turns the weights to NaN.
#[inline]
pub fn relu(x: f32) -> f32 {
    if x > 0.0 || x.is_nan() {
        x
    } else {
        0.0
    }
}

#[inline]
pub fn activation(f: Activation, x: f32) -> f32 {
    match f {
        Activation::Relu => relu(x),
        Activation::Gelu => 0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2)),
        Activation::GeluTanh => {
            0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + GELU_COEF * x * x * x)).tanh())
        }
        Activation::Tanh => x.tanh(),
        Activation::Sigmoid => 1.0 / (1.0 + (-x).exp()),
    }
}

/// f'(x), using y = f(x) where that is cheaper.
#[inline]
pub fn activation_derivative(f: Activation, x: f32, y: f32) -> f32 {
    match f {
        // From y, as tanh and sigmoid, so that these three can run in place; y > 0 exactly
        // where x > 0 (y = max(x, 0), which is 0 for a NaN x).
        Activation::Relu => {
            if y > 0.0 {
                1.0
            } else {
                0.0
            }
        }
        Activation::Gelu => {
            let cdf = 0.5 * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2));
            let pdf = (-0.5 * x * x).exp() * 0.398_942_3; // 1/√(2π)
            cdf + x * pdf
        }
        Activation::GeluTanh => {
            let inner = SQRT_2_OVER_PI * (x + GELU_COEF * x * x * x);
            let t = inner.tanh();
            0.5 * (1.0 + t)
                + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_COEF * x * x)
        }
        Activation::Tanh => 1.0 - y * y,
        Activation::Sigmoid => y * (1.0 - y),
    }
}
