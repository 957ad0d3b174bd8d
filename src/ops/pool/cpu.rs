//! max and average pooling on the CPU: planes in parallel; the common 2x2 max pool through
//! its AVX-512 kernel (`max_pool_2x2`).

use super::max_pool_2x2;
use super::Kernels;
use crate::tensor::cpu::CpuBackend;
use crate::tensor::{Pool2d, PoolKind};
use rayon::prelude::*;

impl Kernels for CpuBackend {
    fn pool2d_forward(&self, kind: PoolKind, s: &Pool2d, x: &Vec<f32>, y: &mut Vec<f32>, n: usize) {
        match kind {
            PoolKind::Max => maxpool2d_forward(s, x, y, n),
            PoolKind::Avg => avgpool2d_forward(s, x, y, n),
        }
    }

    fn pool2d_backward(
        &self,
        kind: PoolKind,
        s: &Pool2d,
        x: &Vec<f32>,
        y: &Vec<f32>,
        dy: &Vec<f32>,
        dx: &mut Vec<f32>,
        n: usize,
        through_relu: bool,
    ) {
        match kind {
            PoolKind::Max => maxpool2d_backward(s, x, y, dy, dx, n, through_relu),
            PoolKind::Avg => avgpool2d_backward(s, x, dy, dx, n, through_relu),
        }
    }
}

/// The first position (row-major) of each tiling window holding `target`'s value, for the
/// non-overlapping case; calls `f(output index, input index)`.
#[inline]
fn first_max_in_tiles(s: &Pool2d, x_c: &[f32], y_c: &[f32], mut f: impl FnMut(usize, usize)) {
    let (oh, ow) = s.out_hw().expect("validated geometry");
    let (kh, kw) = s.k;
    for p in 0..oh {
        for q in 0..ow {
            let target = y_c[p * ow + q];
            'window: for a in 0..kh {
                let base = (p * kh + a) * s.w + q * kw;
                for (b, &v) in x_c[base..base + kw].iter().enumerate() {
                    if v == target || (target.is_nan() && v.is_nan()) {
                        f(p * ow + q, base + b);
                        break 'window;
                    }
                }
            }
        }
    }
}

/// The running maximum after seeing `v`: NaN wins, as in PyTorch. A select, not a branch.
#[inline(always)]
fn max_step(m: f32, v: f32) -> f32 {
    if v > m || v.is_nan() {
        v
    } else {
        m
    }
}

/// Max over each window (padding counts as -inf; NaN wins, as in PyTorch).
pub fn maxpool2d_forward(s: &Pool2d, x: &[f32], y: &mut [f32], n: usize) {
    let (_, ow) = s.out_hw().expect("validated geometry");
    if s.tiles() && s.k == (2, 2) {
        // The common case, branch-free: the window's four values in row-major order.
        return s.planes(n, x, y, |_, x_c, y_c| {
            for (p, out) in y_c.chunks_exact_mut(ow).enumerate() {
                let r0 = &x_c[2 * p * s.w..][..2 * ow];
                let r1 = &x_c[(2 * p + 1) * s.w..][..2 * ow];
                for ((o, a), b) in out
                    .iter_mut()
                    .zip(r0.chunks_exact(2))
                    .zip(r1.chunks_exact(2))
                {
                    let m = max_step(max_step(f32::NEG_INFINITY, a[0]), a[1]);
                    *o = max_step(max_step(m, b[0]), b[1]);
                }
            }
        });
    }
    if s.tiles() {
        let (kh, kw) = s.k;
        return s.planes(n, x, y, |_, x_c, y_c| {
            for (p, out) in y_c.chunks_exact_mut(ow).enumerate() {
                out.fill(f32::NEG_INFINITY);
                for a in 0..kh {
                    let row = &x_c[(p * kh + a) * s.w..][..ow * kw];
                    for (o, window) in out.iter_mut().zip(row.chunks_exact(kw)) {
                        for &v in window {
                            if v > *o || v.is_nan() {
                                *o = v;
                            }
                        }
                    }
                }
            }
        });
    }
    s.planes(n, x, y, |_, x_c, y_c| {
        for (idx, out) in y_c.iter_mut().enumerate() {
            let (rows, cols) = s.window(idx / ow, idx % ow);
            let mut m = f32::NEG_INFINITY;
            for i in rows {
                for &v in &x_c[i * s.w + cols.start..i * s.w + cols.end] {
                    if v > m || v.is_nan() {
                        m = v;
                    }
                }
            }
            *out = m;
        }
    });
}

/// Routes each output gradient to the first position of its window holding the maximum
/// (found again from x and y: no index buffer is kept). `through_relu`: also through the
/// ReLU whose output x is (`graph::BufferPlan::through_relu`).
pub fn maxpool2d_backward(
    s: &Pool2d,
    x: &[f32],
    y: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    n: usize,
    through_relu: bool,
) {
    let (oh, ow) = s.out_hw().expect("validated geometry");
    let plane = s.h * s.w;
    dx[..n * s.c * plane]
        .par_chunks_mut(plane)
        .enumerate()
        .for_each(|(c, dx_c)| {
            let x_c = &x[c * plane..(c + 1) * plane];
            let (y_c, dy_c) = (
                &y[c * oh * ow..(c + 1) * oh * ow],
                &dy[c * oh * ow..(c + 1) * oh * ow],
            );
            if s.tiles() && s.k == (2, 2) {
                // The common case (src/tensor/max_pool_2x2.rs). Every position a window
                // covers is written; only an odd last row or column is left to zero.
                let rows = y_c.chunks_exact(ow).zip(dy_c.chunks_exact(ow));
                for (p, (y_r, dy_r)) in rows.enumerate() {
                    let (x0, x1) = x_c[2 * p * s.w..][..2 * s.w].split_at(s.w);
                    let (d0, d1) = dx_c[2 * p * s.w..][..2 * s.w].split_at_mut(s.w);
                    max_pool_2x2::route_gradients(x0, x1, y_r, dy_r, (d0, d1), through_relu);
                    d0[2 * ow..].fill(0.0);
                    d1[2 * ow..].fill(0.0);
                }
                dx_c[2 * oh * s.w..].fill(0.0);
                return;
            }
            dx_c.fill(0.0);
            if s.tiles() {
                // Windows do not overlap: every input position gets at most one gradient.
                first_max_in_tiles(s, x_c, y_c, |out, input| dx_c[input] = dy_c[out]);
                return relu_backward_in_place(through_relu, x_c, dx_c);
            }
            for idx in 0..oh * ow {
                let (rows, cols) = s.window(idx / ow, idx % ow);
                let target = y_c[idx];
                'search: for i in rows {
                    for j in cols.clone() {
                        let v = x_c[i * s.w + j];
                        if v == target || (target.is_nan() && v.is_nan()) {
                            dx_c[i * s.w + j] += dy_c[idx];
                            break 'search;
                        }
                    }
                }
            }
            relu_backward_in_place(through_relu, x_c, dx_c);
        });
}

/// With `through_relu`, dx · (y > 0 ? 1 : 0): the backward step of the ReLU whose output is
/// y (the pooling's input), taken in the pooling's pass over the plane.
fn relu_backward_in_place(through_relu: bool, y: &[f32], dx: &mut [f32]) {
    if through_relu {
        for (d, &v) in dx.iter_mut().zip(y) {
            *d *= max_pool_2x2::relu_factor(v);
        }
    }
}

/// Mean over each window, dividing by the full kernel area (count_include_pad = true).
pub fn avgpool2d_forward(s: &Pool2d, x: &[f32], y: &mut [f32], n: usize) {
    let (_, ow) = s.out_hw().expect("validated geometry");
    let area = (s.k.0 * s.k.1) as f32;
    s.planes(n, x, y, |_, x_c, y_c| {
        for (idx, out) in y_c.iter_mut().enumerate() {
            let (rows, cols) = s.window(idx / ow, idx % ow);
            let sum: f32 = rows
                .map(|i| {
                    x_c[i * s.w + cols.start..i * s.w + cols.end]
                        .iter()
                        .sum::<f32>()
                })
                .sum();
            *out = sum / area;
        }
    });
}

/// `through_relu`: x is a ReLU's output, and dx is taken through that ReLU too (as
/// `maxpool2d_backward`'s).
pub fn avgpool2d_backward(
    s: &Pool2d,
    x: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    n: usize,
    through_relu: bool,
) {
    let (oh, ow) = s.out_hw().expect("validated geometry");
    let area = (s.k.0 * s.k.1) as f32;
    let plane = s.h * s.w;
    dx[..n * s.c * plane]
        .par_chunks_mut(plane)
        .enumerate()
        .for_each(|(c, dx_c)| {
            dx_c.fill(0.0);
            let dy_c = &dy[c * oh * ow..(c + 1) * oh * ow];
            for (idx, &d) in dy_c.iter().enumerate() {
                let (rows, cols) = s.window(idx / ow, idx % ow);
                let g = d / area;
                for i in rows {
                    dx_c[i * s.w + cols.start..i * s.w + cols.end]
                        .iter_mut()
                        .for_each(|d| *d += g);
                }
            }
            relu_backward_in_place(through_relu, &x[c * plane..(c + 1) * plane], dx_c);
        });
}
