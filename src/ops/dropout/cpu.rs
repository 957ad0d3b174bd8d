//! dropout on the CPU: the mask drawn from the counter-based RNG, never stored.

use super::Kernels;
use crate::tensor::cpu::CpuBackend;
use crate::tensor::cpu::{map1, map2};
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
        let keep_scale = 1.0 / (1.0 - p);
        map2(&mut y[..len], &x[..len], |y, x, start| {
            for (i, (y, &x)) in y.iter_mut().zip(x).enumerate() {
                let keep = rng::uniform(key, first + (start + i) as u64) >= p;
                *y = if keep { x * keep_scale } else { 0.0 };
            }
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
        let keep_scale = 1.0 / (1.0 - p);
        map1(&mut buf[..len], |y, start| {
            for (i, y) in y.iter_mut().enumerate() {
                let keep = rng::uniform(key, first + (start + i) as u64) >= p;
                *y = if keep { *y * keep_scale } else { 0.0 };
            }
        });
    }
}
