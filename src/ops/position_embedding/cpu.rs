//! position_embedding on the CPU.

use super::Kernels;
use crate::tensor::cpu::{map1, CpuBackend};
use rayon::prelude::*;

impl Kernels for CpuBackend {
    fn position_embedding_forward(
        &self,
        x: &Vec<f32>,
        params: &Vec<f32>,
        w: usize,
        y: &mut Vec<f32>,
        n: usize,
        len: usize,
    ) {
        let table = &params[w..w + len];
        y[..n * len]
            .par_chunks_mut(len)
            .zip(x[..n * len].par_chunks(len))
            .for_each(|(y, x)| {
                for ((y, &x), &p) in y.iter_mut().zip(x).zip(table) {
                    *y = x + p;
                }
            });
    }

    fn position_embedding_backward(
        &self,
        dy: &Vec<f32>,
        grads: &mut Vec<f32>,
        w: usize,
        n: usize,
        len: usize,
    ) {
        // Each value's sum over the samples, in sample order (as the CUDA kernel).
        map1(&mut grads[w..w + len], |g, first| {
            for (j, g) in g.iter_mut().enumerate() {
                let sum: f32 = (0..n).map(|b| dy[b * len + first + j]).sum();
                *g += sum;
            }
        });
    }
}
