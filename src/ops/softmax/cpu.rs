//! softmax on the CPU: rows in parallel, sums in f64.

use super::Kernels;
use crate::tensor::cpu::CpuBackend;
use rayon::prelude::*;

impl Kernels for CpuBackend {
    fn softmax_forward(
        &self,
        x: &Vec<f32>,
        y: &mut Vec<f32>,
        rows: usize,
        width: usize,
        log: bool,
    ) {
        y[..rows * width]
            .par_chunks_mut(width)
            .zip(x[..rows * width].par_chunks(width))
            .for_each(|(y, x)| {
                let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let total: f64 = x.iter().map(|&v| (v - m).exp() as f64).sum();
                if log {
                    let log_total = total.ln() as f32;
                    y.iter_mut()
                        .zip(x)
                        .for_each(|(y, &v)| *y = v - m - log_total);
                } else {
                    let inv = (1.0 / total) as f32;
                    y.iter_mut()
                        .zip(x)
                        .for_each(|(y, &v)| *y = (v - m).exp() * inv);
                }
            });
    }

    fn softmax_backward(
        &self,
        y: &Vec<f32>,
        dy: &Vec<f32>,
        dx: &mut Vec<f32>,
        rows: usize,
        width: usize,
        log: bool,
    ) {
        let len = rows * width;
        dx[..len]
            .par_chunks_mut(width)
            .zip(y[..len].par_chunks(width).zip(dy[..len].par_chunks(width)))
            .for_each(|(dx, (y, dy))| {
                if log {
                    let t = dy.iter().map(|&g| g as f64).sum::<f64>() as f32;
                    for ((dx, &y), &g) in dx.iter_mut().zip(y).zip(dy) {
                        *dx = g - y.exp() * t;
                    }
                } else {
                    let t = dy
                        .iter()
                        .zip(y)
                        .map(|(&g, &y)| g as f64 * y as f64)
                        .sum::<f64>();
                    let t = t as f32;
                    for ((dx, &y), &g) in dx.iter_mut().zip(y).zip(dy) {
                        *dx = y * (g - t);
                    }
                }
            });
    }
}
