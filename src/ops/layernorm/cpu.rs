//! layer norm on the CPU: bands of rows in parallel, each row's statistics in f64.

use super::Kernels;
use crate::tensor::cpu::{row_bands, rows_per_band, simd_fn, CpuBackend};
use crate::tensor::vector_math::{lane_sum, LANES};
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
    let band = rows_per_band(width);
    (y[..rows * width].par_chunks_mut(band * width))
        .zip(mean[..rows].par_chunks_mut(band))
        .zip(invstd[..rows].par_chunks_mut(band))
        .enumerate()
        .for_each(|(i, ((y, mean), invstd))| {
            let x = &x[i * band * width..][..y.len()];
            forward_rows(x, y, width, gamma, beta, mean, invstd, eps);
        });
}

// The loops zip slices rather than index them, so that they vectorise, in a copy for each
// SIMD width (`simd_fn!`). Each row's sums are in f64, in LANES partial sums added at the end.
simd_fn! {
    /// `layernorm_forward` on a band of rows.
    fn forward_rows(
        x: &[f32],
        y: &mut [f32],
        width: usize,
        gamma: &[f32],
        beta: Option<&[f32]>,
        mean: &mut [f32],
        invstd: &mut [f32],
        eps: f32,
    ) {
        for (r, (row, y)) in x.chunks_exact(width).zip(y.chunks_exact_mut(width)).enumerate() {
            let mu = lane_sum(row, |v| v as f64) / width as f64;
            let var = lane_sum(row, |v| (v as f64 - mu).powi(2)) / width as f64;
            let (m, s) = (mu as f32, (1.0 / (var + eps as f64).sqrt()) as f32);
            (mean[r], invstd[r]) = (m, s);
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
    }
}

simd_fn! {
    /// dx of a band of rows (`layernorm_backward`).
    fn dx_rows(
        x: &[f32],
        dy: &[f32],
        dx: &mut [f32],
        width: usize,
        gamma: &[f32],
        mean: &[f32],
        invstd: &[f32],
    ) {
        let rows = x.chunks_exact(width).zip(dy.chunks_exact(width));
        for (r, ((xr, dyr), dx)) in rows.zip(dx.chunks_exact_mut(width)).enumerate() {
            let (m, s) = (mean[r], invstd[r]);
            let (sum_g, sum_g_xhat) = row_sums(xr, dyr, gamma, (m, s));
            let (w, s64) = (width as f64, s as f64);
            let mean_g = sum_g / w;
            for (((out, &v), &d), &gamma) in dx.iter_mut().zip(xr).zip(dyr).zip(gamma) {
                let (g, xhat) = (d as f64 * gamma as f64, ((v - m) * s) as f64);
                *out = (s64 * (g - mean_g - xhat * sum_g_xhat / w)) as f32;
            }
        }
    }
}

simd_fn! {
    /// dγ[first..first + dgamma.len()] += Σ over the rows of dy·x̂, in row order.
    fn dgamma_columns(
        x: &[f32],
        dy: &[f32],
        width: usize,
        first: usize,
        mean: &[f32],
        invstd: &[f32],
        dgamma: &mut [f32],
    ) {
        let rows = x.chunks_exact(width).zip(dy.chunks_exact(width));
        for ((xr, dyr), (&m, &s)) in rows.zip(mean.iter().zip(invstd)) {
            let (xr, dyr) = (&xr[first..][..dgamma.len()], &dyr[first..][..dgamma.len()]);
            for ((dg, &d), &v) in dgamma.iter_mut().zip(dyr).zip(xr) {
                *dg += d * ((v - m) * s);
            }
        }
    }
}

/// Σ dy·γ and Σ dy·γ·x̂ over a row (x̂ = (x − mean)·invstd), in f64 lanes as `lane_sum`.
#[inline(always)]
fn row_sums(x: &[f32], dy: &[f32], gamma: &[f32], (m, s): (f32, f32)) -> (f64, f64) {
    let (mut sum_g, mut sum_g_xhat) = ([0.0f64; LANES], [0.0f64; LANES]);
    let whole = x.len() / LANES * LANES;
    let chunks = (x[..whole].chunks_exact(LANES))
        .zip(dy[..whole].chunks_exact(LANES))
        .zip(gamma[..whole].chunks_exact(LANES));
    // Two loops, one sum each: LLVM vectorises a loop with one array of lanes.
    for ((_, dc), gc) in chunks.clone() {
        for ((sum, &d), &gamma) in sum_g.iter_mut().zip(dc).zip(gc) {
            *sum += d as f64 * gamma as f64;
        }
    }
    for ((xc, dc), gc) in chunks {
        for (((sum, &v), &d), &gamma) in sum_g_xhat.iter_mut().zip(xc).zip(dc).zip(gc) {
            *sum += d as f64 * gamma as f64 * ((v - m) * s) as f64;
        }
    }
    let (mut tail_g, mut tail_g_xhat) = (0.0f64, 0.0f64);
    for ((&v, &d), &gamma) in x[whole..].iter().zip(&dy[whole..]).zip(&gamma[whole..]) {
        let g = d as f64 * gamma as f64;
        tail_g += g;
        tail_g_xhat += g * ((v - m) * s) as f64;
    }
    let total = |lanes: [f64; LANES], tail: f64| lanes.iter().sum::<f64>() + tail;
    (total(sum_g, tail_g), total(sum_g_xhat, tail_g_xhat))
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
    let (x, dy) = (&x[..rows * width], &dy[..rows * width]);
    if let Some(dx) = dx {
        row_bands(&mut dx[..rows * width], width, |rows, dx| {
            let at = rows.start * width..rows.end * width;
            let (mean, invstd) = (&mean[rows.clone()], &invstd[rows]);
            dx_rows(&x[at.clone()], &dy[at], dx, width, gamma, mean, invstd);
        });
    }
    let columns = width.div_ceil(rayon::current_num_threads()).max(8);
    (dgamma[..width].par_chunks_mut(columns))
        .enumerate()
        .for_each(|(i, dgamma)| {
            dgamma_columns(
                x,
                dy,
                width,
                i * columns,
                &mean[..rows],
                &invstd[..rows],
                dgamma,
            );
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
