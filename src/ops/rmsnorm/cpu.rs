//! rmsnorm on the CPU: bands of rows in parallel, each row's sums in f64 (as layer norm's).

use super::Kernels;
use crate::tensor::cpu::{row_bands, rows_per_band, simd_fn, CpuBackend};
use crate::tensor::vector_math::{lane_sum, LANES};
use rayon::prelude::*;

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
        let band = rows_per_band(width);
        (y[..rows * width].par_chunks_mut(band * width))
            .zip(saved[..rows].par_chunks_mut(band))
            .enumerate()
            .for_each(|(i, (y, inv_rms))| {
                let x = &x[i * band * width..][..y.len()];
                forward_rows(x, y, width, gamma, inv_rms, eps);
            });
    }

    fn rmsnorm_backward(
        &self,
        x: &Vec<f32>,
        dy: &Vec<f32>,
        dx: Option<&mut Vec<f32>>,
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
        let (x, dy, inv_rms) = (&x[..rows * width], &dy[..rows * width], &saved[..rows]);
        if let Some(dx) = dx {
            row_bands(&mut dx[..rows * width], width, |rows, dx| {
                let at = rows.start * width..rows.end * width;
                dx_rows(&x[at.clone()], &dy[at], dx, width, g, &inv_rms[rows]);
            });
        }
        // dγ by bands of columns, each summed over the rows in order.
        let columns = width.div_ceil(rayon::current_num_threads()).max(8);
        (dgamma.par_chunks_mut(columns))
            .enumerate()
            .for_each(|(i, dgamma)| dgamma_columns(x, dy, width, i * columns, inv_rms, dgamma));
    }
}

// The loops zip slices rather than index them, so that they vectorise, in a copy for each
// SIMD width (`simd_fn!`).
simd_fn! {
    /// y = x · inv_rms · γ for a band of rows, saving each row's inv_rms.
    fn forward_rows(x: &[f32], y: &mut [f32], width: usize, gamma: &[f32], inv_rms: &mut [f32], eps: f32) {
        let rows = x.chunks_exact(width).zip(y.chunks_exact_mut(width));
        for ((row, y), inv_rms) in rows.zip(inv_rms.iter_mut()) {
            let mean_square = lane_sum(row, |v| (v as f64).powi(2)) / width as f64;
            let r = (1.0 / (mean_square + eps as f64).sqrt()) as f32;
            *inv_rms = r;
            for ((out, &v), &g) in y.iter_mut().zip(row).zip(gamma) {
                *out = v * r * g;
            }
        }
    }
}

simd_fn! {
    /// dx_j = r (dy_j γ_j − x_j r² Σ_k dy_k γ_k x_k / width) for a band of rows.
    fn dx_rows(x: &[f32], dy: &[f32], dx: &mut [f32], width: usize, gamma: &[f32], inv_rms: &[f32]) {
        let rows = x.chunks_exact(width).zip(dy.chunks_exact(width));
        for (((xr, dyr), dx), &r) in rows.zip(dx.chunks_exact_mut(width)).zip(inv_rms) {
            let sum = row_sum(xr, dyr, gamma);
            let (r1, w) = (r as f64, width as f64);
            for (((out, &v), &d), &g) in dx.iter_mut().zip(xr).zip(dyr).zip(gamma) {
                let own = d as f64 * g as f64;
                *out = (r1 * (own - v as f64 * r1 * r1 * sum / w)) as f32;
            }
        }
    }
}

simd_fn! {
    /// dγ[first..first + dgamma.len()] += Σ over the rows of dy · x · inv_rms, in row order.
    fn dgamma_columns(x: &[f32], dy: &[f32], width: usize, first: usize, inv_rms: &[f32], dgamma: &mut [f32]) {
        let rows = x.chunks_exact(width).zip(dy.chunks_exact(width));
        for ((xr, dyr), &r) in rows.zip(inv_rms) {
            let (xr, dyr) = (&xr[first..][..dgamma.len()], &dyr[first..][..dgamma.len()]);
            for ((dg, &d), &v) in dgamma.iter_mut().zip(dyr).zip(xr) {
                *dg += d * (v * r);
            }
        }
    }
}

/// Σ dy·γ·x over a row, in f64 lanes as `lane_sum`.
#[inline(always)]
fn row_sum(x: &[f32], dy: &[f32], gamma: &[f32]) -> f64 {
    let mut lanes = [0.0f64; LANES];
    let whole = x.len() / LANES * LANES;
    let chunks = (x[..whole].chunks_exact(LANES))
        .zip(dy[..whole].chunks_exact(LANES))
        .zip(gamma[..whole].chunks_exact(LANES));
    for ((xc, dc), gc) in chunks {
        for (((lane, &v), &d), &g) in lanes.iter_mut().zip(xc).zip(dc).zip(gc) {
            *lane += d as f64 * g as f64 * v as f64;
        }
    }
    let tail = (x[whole..].iter().zip(&dy[whole..]).zip(&gamma[whole..]))
        .map(|((&v, &d), &g)| d as f64 * g as f64 * v as f64)
        .sum::<f64>();
    lanes.iter().sum::<f64>() + tail
}
