//! multiply on the CPU: elementwise passes split across threads.

use super::Kernels;
use crate::tensor::cpu::{map2, simd_fn, CpuBackend};

impl Kernels for CpuBackend {
    fn multiply(&self, a: &Vec<f32>, b: &Vec<f32>, y: &mut Vec<f32>, len: usize) {
        let b = &b[..len];
        map2(&mut y[..len], &a[..len], |y, a, start| {
            product(y, a, &b[start..start + y.len()]);
        });
    }

    fn multiply_backward(
        &self,
        dy: &Vec<f32>,
        other: &Vec<f32>,
        dx: &mut Vec<f32>,
        len: usize,
        add: bool,
    ) {
        let other = &other[..len];
        map2(&mut dx[..len], &dy[..len], |dx, dy, start| {
            let other = &other[start..start + dx.len()];
            match add {
                true => add_product(dx, dy, other),
                false => product(dx, dy, other),
            }
        });
    }
}

simd_fn! {
    fn product(out: &mut [f32], a: &[f32], b: &[f32]) {
        for ((o, &a), &b) in out.iter_mut().zip(a).zip(b) {
            *o = a * b;
        }
    }
}

simd_fn! {
    fn add_product(out: &mut [f32], a: &[f32], b: &[f32]) {
        for ((o, &a), &b) in out.iter_mut().zip(a).zip(b) {
            *o += a * b;
        }
    }
}
