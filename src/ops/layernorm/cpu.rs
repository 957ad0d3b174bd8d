//! layer norm on the CPU: one row at a time, statistics in f64.

use super::Kernels;
use crate::tensor::cpu::CpuBackend;

impl Kernels for CpuBackend {
    fn layernorm_forward(
        &self,
        x: &Vec<f32>,
        y: &mut Vec<f32>,
        (rows, width): (usize, usize),
        params: &Vec<f32>,
        (gamma, bias): (usize, bool),
        saved: &mut Vec<f32>,
        eps: f32,
    ) {
        let g = &params[gamma..gamma + width];
        let b = bias.then(|| &params[gamma + width..gamma + 2 * width]);
        let (mean, invstd) = saved[..2 * rows].split_at_mut(rows);
        layernorm_forward(x, y, rows, width, g, b, (mean, invstd), eps);
    }

    fn layernorm_backward(
        &self,
        x: &Vec<f32>,
        dy: &Vec<f32>,
        dx: Option<&mut Vec<f32>>,
        (rows, width): (usize, usize),
        params: &Vec<f32>,
        grads: &mut Vec<f32>,
        (gamma, bias): (usize, bool),
        saved: &Vec<f32>,
    ) {
        let len = if bias { 2 * width } else { width };
        let (dgamma, dbeta) = grads[gamma..gamma + len].split_at_mut(width);
        let dbeta = bias.then_some(dbeta);
        let stats = (&saved[..rows], &saved[rows..2 * rows]);
        let g = &params[gamma..gamma + width];
        layernorm_backward(
            x,
            dy,
            dx.map(|d| &mut d[..]),
            rows,
            width,
            g,
            stats,
            (dgamma, dbeta),
        );
    }
}

/// Layer norm over the last `width` values of each of `rows` rows, with γ (and β) per position.
/// Saves each row's mean and invstd for the backward pass.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward(
    x: &[f32],
    y: &mut [f32],
    rows: usize,
    width: usize,
    gamma: &[f32],
    beta: Option<&[f32]>,
    (mean, invstd): (&mut [f32], &mut [f32]),
    eps: f32,
) {
    for r in 0..rows {
        let row = &x[r * width..(r + 1) * width];
        let mu = row.iter().map(|&v| v as f64).sum::<f64>() / width as f64;
        let var = row.iter().map(|&v| (v as f64 - mu).powi(2)).sum::<f64>() / width as f64;
        mean[r] = mu as f32;
        invstd[r] = (1.0 / (var + eps as f64).sqrt()) as f32;
        for (j, out) in y[r * width..(r + 1) * width].iter_mut().enumerate() {
            *out = (row[j] - mean[r]) * invstd[r] * gamma[j] + beta.map_or(0.0, |b| b[j]);
        }
    }
}

#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward(
    x: &[f32],
    dy: &[f32],
    dx: Option<&mut [f32]>,
    rows: usize,
    width: usize,
    gamma: &[f32],
    (mean, invstd): (&[f32], &[f32]),
    (dgamma, mut dbeta): (&mut [f32], Option<&mut [f32]>),
) {
    let mut dx = dx;
    for r in 0..rows {
        let (xr, dyr) = (
            &x[r * width..(r + 1) * width],
            &dy[r * width..(r + 1) * width],
        );
        let xhat = |j: usize| ((xr[j] - mean[r]) * invstd[r]) as f64;
        let (mut sum_g, mut sum_g_xhat) = (0.0f64, 0.0f64);
        for j in 0..width {
            let g = dyr[j] as f64 * gamma[j] as f64;
            sum_g += g;
            sum_g_xhat += g * xhat(j);
            dgamma[j] += dyr[j] * xhat(j) as f32;
            if let Some(dbeta) = dbeta.as_deref_mut() {
                dbeta[j] += dyr[j];
            }
        }
        if let Some(dx) = dx.as_deref_mut() {
            for j in 0..width {
                let g = dyr[j] as f64 * gamma[j] as f64;
                let w = width as f64;
                dx[r * width + j] =
                    (invstd[r] as f64 * (g - sum_g / w - xhat(j) * sum_g_xhat / w)) as f32;
            }
        }
    }
}
