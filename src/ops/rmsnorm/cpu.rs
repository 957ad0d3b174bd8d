//! rmsnorm on the CPU: one row at a time, sums in f64.

use super::Kernels;
use crate::tensor::cpu::CpuBackend;

impl Kernels for CpuBackend {
    fn rmsnorm_forward(
        &self,
        x: &Vec<f32>,
        y: &mut Vec<f32>,
        (rows, width): (usize, usize),
        params: &Vec<f32>,
        gamma: usize,
        saved: &mut Vec<f32>,
        eps: f32,
    ) {
        let gamma = &params[gamma..gamma + width];
        for r in 0..rows {
            let row = &x[r * width..(r + 1) * width];
            let mean_square = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / width as f64;
            let inv_rms = (1.0 / (mean_square + eps as f64).sqrt()) as f32;
            saved[r] = inv_rms;
            for (j, out) in y[r * width..(r + 1) * width].iter_mut().enumerate() {
                *out = row[j] * inv_rms * gamma[j];
            }
        }
    }

    fn rmsnorm_backward(
        &self,
        x: &Vec<f32>,
        dy: &Vec<f32>,
        mut dx: Option<&mut Vec<f32>>,
        (rows, width): (usize, usize),
        params: &Vec<f32>,
        grads: &mut Vec<f32>,
        gamma: usize,
        saved: &Vec<f32>,
    ) {
        let (g, dgamma) = (
            &params[gamma..gamma + width],
            &mut grads[gamma..gamma + width],
        );
        for r in 0..rows {
            let (xr, dyr) = (
                &x[r * width..(r + 1) * width],
                &dy[r * width..(r + 1) * width],
            );
            let inv_rms = saved[r];
            // Σ_k dy_k γ_k x_k, for dx_j = r (dy_j γ_j - x_j r² Σ / width).
            let mut sum = 0.0f64;
            for j in 0..width {
                sum += dyr[j] as f64 * g[j] as f64 * xr[j] as f64;
                dgamma[j] += dyr[j] * (xr[j] * inv_rms);
            }
            if let Some(dx) = dx.as_deref_mut() {
                let (r1, w) = (inv_rms as f64, width as f64);
                for j in 0..width {
                    let own = dyr[j] as f64 * g[j] as f64;
                    dx[r * width + j] = (r1 * (own - xr[j] as f64 * r1 * r1 * sum / w)) as f32;
                }
            }
        }
    }
}
