//! layer norm on the CPU: bands of rows in parallel, each row's statistics in f64.

use super::Kernels;
use crate::tensor::cpu::CpuBackend;
use rayon::prelude::*;

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

/// Rows per parallel task: at least 16k values, so a task outweighs its scheduling.
fn band(width: usize) -> usize {
    (16_384 / width.max(1)).max(1)
}

/// Layer norm over the last `width` values of each of `rows` rows, with γ (and β) per position.
/// Saves each row's mean and invstd for the backward pass. Bands of rows run in parallel.
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
    let band = band(width);
    (y[..rows * width].par_chunks_mut(band * width))
        .zip(mean[..rows].par_chunks_mut(band))
        .zip(invstd[..rows].par_chunks_mut(band))
        .enumerate()
        .for_each(|(i, ((y, mean), invstd))| {
            let x = &x[i * band * width..];
            for (r, y) in y.chunks_mut(width).enumerate() {
                let row = &x[r * width..(r + 1) * width];
                let mu = row.iter().map(|&v| v as f64).sum::<f64>() / width as f64;
                let var = row.iter().map(|&v| (v as f64 - mu).powi(2)).sum::<f64>() / width as f64;
                let (m, s) = (mu as f32, (1.0 / (var + eps as f64).sqrt()) as f32);
                (mean[r], invstd[r]) = (m, s);
                // Slices zipped, not indexed: the loops vectorize.
                match beta {
                    Some(b) => {
                        for (((out, &v), &g), &b) in y.iter_mut().zip(row).zip(gamma).zip(b) {
                            *out = (v - m) * s * g + b;
                        }
                    }
                    None => {
                        for ((out, &v), &g) in y.iter_mut().zip(row).zip(gamma) {
                            *out = (v - m) * s * g + 0.0;
                        }
                    }
                }
            }
        });
}

/// dx by bands of rows, then dγ (and dβ) by bands of columns, each summed over the rows in
/// order: the same sums as one thread, no per-thread partials to allocate.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward(
    x: &[f32],
    dy: &[f32],
    dx: Option<&mut [f32]>,
    rows: usize,
    width: usize,
    gamma: &[f32],
    (mean, invstd): (&[f32], &[f32]),
    (dgamma, dbeta): (&mut [f32], Option<&mut [f32]>),
) {
    // Slices zipped, not indexed, so that the loops over a row vectorize; the sums over a
    // row stay in order.
    if let Some(dx) = dx {
        let band = band(width);
        (dx[..rows * width].par_chunks_mut(band * width))
            .enumerate()
            .for_each(|(i, dx)| {
                for (k, dx) in dx.chunks_mut(width).enumerate() {
                    let r = i * band + k;
                    let (xr, dyr) = (&x[r * width..][..width], &dy[r * width..][..width]);
                    let (m, s) = (mean[r], invstd[r]);
                    let (mut sum_g, mut sum_g_xhat) = (0.0f64, 0.0f64);
                    for ((&v, &d), &gamma) in xr.iter().zip(dyr).zip(gamma) {
                        let g = d as f64 * gamma as f64;
                        sum_g += g;
                        sum_g_xhat += g * ((v - m) * s) as f64;
                    }
                    let (w, s64) = (width as f64, s as f64);
                    let mean_g = sum_g / w;
                    for (((out, &v), &d), &gamma) in dx.iter_mut().zip(xr).zip(dyr).zip(gamma) {
                        let (g, xhat) = (d as f64 * gamma as f64, ((v - m) * s) as f64);
                        *out = (s64 * (g - mean_g - xhat * sum_g_xhat / w)) as f32;
                    }
                }
            });
    }
    let columns = width.div_ceil(rayon::current_num_threads()).max(8);
    (dgamma[..width].par_chunks_mut(columns))
        .enumerate()
        .for_each(|(i, dgamma)| {
            let first = i * columns;
            for r in 0..rows {
                let (m, s) = (mean[r], invstd[r]);
                let xr = &x[r * width + first..][..dgamma.len()];
                let dyr = &dy[r * width + first..][..dgamma.len()];
                for ((dg, &d), &v) in dgamma.iter_mut().zip(dyr).zip(xr) {
                    *dg += d * ((v - m) * s);
                }
            }
        });
    if let Some(dbeta) = dbeta {
        (dbeta[..width].par_chunks_mut(columns))
            .enumerate()
            .for_each(|(i, dbeta)| {
                for r in 0..rows {
                    let dyr = &dy[r * width + i * columns..][..dbeta.len()];
                    dbeta.iter_mut().zip(dyr).for_each(|(db, &d)| *db += d);
                }
            });
    }
}
