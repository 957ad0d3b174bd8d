//! dropout on the CPU: the mask drawn from the counter-based RNG, never stored.

use super::Kernels;
use crate::tensor::cpu::CpuBackend;
use crate::tensor::cpu::{map1, map2, simd_fn};
use crate::tensor::rng;

impl Kernels for CpuBackend {
    fn dropout_forward(
        &self,
        p: f32,
        key: u64,
        first: u64,
        x: &Vec<f32>,
        y: &mut Vec<f32>,
        len: usize,
    ) {
        map2(&mut y[..len], &x[..len], |y, x, start| {
            dropped(y, x, p, key, first + start as u64)
        });
    }

    fn dropout_backward(
        &self,
        p: f32,
        key: u64,
        first: u64,
        dy: &Vec<f32>,
        dx: &mut Vec<f32>,
        len: usize,
    ) {
        // Same mask as the forward pass: same key, same indices.
        self.dropout_forward(p, key, first, dy, dx, len);
    }

    fn dropout_in_place(&self, p: f32, key: u64, first: u64, buf: &mut Vec<f32>, len: usize) {
        map1(&mut buf[..len], |y, start| {
            dropped_in_place(y, p, key, first + start as u64)
        });
    }
}

// The mask's hashes run in SIMD lanes (`simd_fn!`): drawn one at a time they took most of a
// dropout's time.
simd_fn! {
    /// y = x / (1 − p) where element `first + i` of the stream `key` is kept, else 0.
    fn dropped(y: &mut [f32], x: &[f32], p: f32, key: u64, first: u64) {
        let keep_scale = 1.0 / (1.0 - p);
        for (i, (y, &x)) in y.iter_mut().zip(x).enumerate() {
            let keep = rng::uniform(key, first + i as u64) >= p;
            *y = if keep { x * keep_scale } else { 0.0 };
        }
    }
}

simd_fn! {
    fn dropped_in_place(y: &mut [f32], p: f32, key: u64, first: u64) {
        let keep_scale = 1.0 / (1.0 - p);
        for (i, y) in y.iter_mut().enumerate() {
            let keep = rng::uniform(key, first + i as u64) >= p;
            *y = if keep { *y * keep_scale } else { 0.0 };
        }
    }
}
