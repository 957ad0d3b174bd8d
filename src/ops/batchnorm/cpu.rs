//! batch norm on the CPU: channels reduced in parallel, each in a fixed order.

use super::Kernels;
use crate::tensor::cpu::CpuBackend;
use rayon::prelude::*;

impl Kernels for CpuBackend {
    fn batchnorm_forward(
        &self,
        x: &Vec<f32>,
        y: &mut Vec<f32>,
        (n, c, spatial): (usize, usize, usize),
        params: &Vec<f32>,
        gamma: usize,
        state: &mut Vec<f32>,
        train: bool,
        momentum: f32,
        eps: f32,
    ) {
        let (g, b) = (&params[gamma..gamma + c], &params[gamma + c..gamma + 2 * c]);
        let (running, saved) = state[..4 * c].split_at_mut(2 * c);
        let running = running.split_at_mut(c);
        let saved = saved.split_at_mut(c);
        batchnorm_forward(
            x, y, n, c, spatial, g, b, running, saved, train, momentum, eps,
        );
    }

    fn batchnorm_backward(
        &self,
        x: &Vec<f32>,
        dy: &Vec<f32>,
        dx: Option<&mut Vec<f32>>,
        (n, c, spatial): (usize, usize, usize),
        params: &Vec<f32>,
        grads: &mut Vec<f32>,
        gamma: usize,
        state: &Vec<f32>,
    ) {
        let (dgamma, dbeta) = grads[gamma..gamma + 2 * c].split_at_mut(c);
        let saved = (&state[2 * c..3 * c], &state[3 * c..4 * c]);
        let g = &params[gamma..gamma + c];
        batchnorm_backward(
            x,
            dy,
            dx.map(|d| &mut d[..]),
            n,
            c,
            spatial,
            g,
            saved,
            (dgamma, dbeta),
        );
    }
}

/// Batch norm over [n, c, spatial]: statistics per channel over the batch and the spatial
/// positions. Training uses (and returns through `mean`/`invstd`) the batch statistics and
/// updates the running ones; evaluation uses the running ones. Channels are reduced in
/// parallel, each in a fixed order (sample by sample, f64), then planes are normalised in
/// parallel.
#[allow(clippy::too_many_arguments)]
pub fn batchnorm_forward(
    x: &[f32],
    y: &mut [f32],
    n: usize,
    c: usize,
    spatial: usize,
    gamma: &[f32],
    beta: &[f32],
    running: (&mut [f32], &mut [f32]),
    (mean, invstd): (&mut [f32], &mut [f32]),
    train: bool,
    momentum: f32,
    eps: f32,
) {
    let (running_mean, running_var) = running;
    let m = (n * spatial) as f64;
    let planes = |ch: usize| channel_planes(x, n, c, spatial, ch);
    if train {
        let stats = mean.par_iter_mut().zip(invstd.par_iter_mut());
        let running = running_mean.par_iter_mut().zip(running_var.par_iter_mut());
        stats.zip(running).enumerate().for_each(
            |(ch, ((mean, invstd), (running_mean, running_var)))| {
                // One pass: Σx and Σx² in f64 (exact enough for E[x²] - E[x]² unless the
                // mean is 10⁸ standard deviations from zero).
                let (sum, sum_sq) = lane_sums(planes(ch).zip(planes(ch)), |v, _| {
                    (v as f64, v as f64 * v as f64)
                });
                let mu = sum / m;
                let var = (sum_sq / m - mu * mu).max(0.0);
                *mean = mu as f32;
                *invstd = (1.0 / (var + eps as f64).sqrt()) as f32;
                let unbiased = if m > 1.0 { var * m / (m - 1.0) } else { var };
                *running_mean = (1.0 - momentum) * *running_mean + momentum * mu as f32;
                *running_var = (1.0 - momentum) * *running_var + momentum * unbiased as f32;
            },
        );
    } else {
        for ch in 0..c {
            mean[ch] = running_mean[ch];
            invstd[ch] = 1.0 / (running_var[ch] + eps).sqrt();
        }
    }
    let (mean, invstd) = (&*mean, &*invstd);
    y[..n * c * spatial]
        .par_chunks_mut(spatial)
        .zip(x[..n * c * spatial].par_chunks(spatial))
        .enumerate()
        .for_each(|(k, (y, x))| {
            let ch = k % c;
            let (mu, is, g, b) = (mean[ch], invstd[ch], gamma[ch], beta[ch]);
            for (y, &x) in y.iter_mut().zip(x) {
                *y = (x - mu) * is * g + b;
            }
        });
}

/// Training-mode backward: dx = γ·invstd·(dy - mean(dy) - x̂·mean(dy·x̂)); dγ += Σ dy·x̂;
/// dβ += Σ dy. The per-channel sums run in parallel over channels (each in a fixed order),
/// dx in parallel over planes.
#[allow(clippy::too_many_arguments)]
pub fn batchnorm_backward(
    x: &[f32],
    dy: &[f32],
    dx: Option<&mut [f32]>,
    n: usize,
    c: usize,
    spatial: usize,
    gamma: &[f32],
    (mean, invstd): (&[f32], &[f32]),
    (dgamma, dbeta): (&mut [f32], &mut [f32]),
) {
    let m = (n * spatial) as f64;
    let mut dx = dx;
    for first in (0..c).step_by(BN_CHANNEL_BLOCK) {
        let block = first..(first + BN_CHANNEL_BLOCK).min(c);
        let mut sums = [(0.0f64, 0.0f64); BN_CHANNEL_BLOCK];
        sums[..block.len()]
            .par_iter_mut()
            .zip(dgamma[block.clone()].par_iter_mut())
            .zip(dbeta[block.clone()].par_iter_mut())
            .enumerate()
            .for_each(|(j, ((sum, dgamma), dbeta))| {
                let ch = first + j;
                let plane = |b| channel_planes(b, n, c, spatial, ch);
                // Σ dy·x̂ = invstd·(Σ dy·x - mean·Σ dy), both sums in one f64 pass.
                let (sum_dy, sum_dy_x) = lane_sums(plane(dy).zip(plane(x)), |g, v| {
                    (g as f64, g as f64 * v as f64)
                });
                let sum_dy_xhat = invstd[ch] as f64 * (sum_dy_x - mean[ch] as f64 * sum_dy);
                *dgamma += sum_dy_xhat as f32;
                *dbeta += sum_dy as f32;
                *sum = (sum_dy, sum_dy_xhat);
            });
        let Some(dx) = dx.as_deref_mut() else {
            continue;
        };
        dx[..n * c * spatial]
            .par_chunks_mut(spatial)
            .enumerate()
            .filter(|(k, _)| block.contains(&(k % c)))
            .for_each(|(k, dx)| {
                let ch = k % c;
                let (sum_dy, sum_dy_xhat) = sums[ch - first];
                let (mean_dy, mean_dy_xhat) = (sum_dy / m, sum_dy_xhat / m);
                // dx = scale·(dy - mean(dy) - x̂·mean(dy·x̂)), as f32 a·dy + b·(x - mean) + c
                // with the per-channel factors from f64.
                let scale = gamma[ch] as f64 * invstd[ch] as f64;
                let a = scale as f32;
                let b = (-scale * invstd[ch] as f64 * mean_dy_xhat) as f32;
                let c = (-scale * mean_dy) as f32;
                let mu = mean[ch];
                let at = k * spatial;
                for ((d, &g), &v) in dx.iter_mut().zip(&dy[at..]).zip(&x[at..]) {
                    *d = a * g + b * (v - mu) + c;
                }
            });
    }
}

/// Channel `ch`'s plane of each of the `n` samples of [n, c, spatial] values.
fn channel_planes(
    values: &[f32],
    n: usize,
    c: usize,
    spatial: usize,
    ch: usize,
) -> impl Iterator<Item = &[f32]> {
    (0..n).map(move |s| &values[(s * c + ch) * spatial..][..spatial])
}

/// Two sums Σ f(a, b) over the paired values of the planes `pairs` yields (a plane of one
/// tensor and the same plane of another), in one pass, in f64 with 8 running sums each (one
/// per lane of a vector register, so the loop vectorises) combined in a fixed order:
/// deterministic, and independent of the thread count.
fn lane_sums<'a>(
    pairs: impl Iterator<Item = (&'a [f32], &'a [f32])>,
    f: impl Fn(f32, f32) -> (f64, f64),
) -> (f64, f64) {
    let (mut first, mut second) = ([0.0f64; 8], [0.0f64; 8]);
    let (mut rest_first, mut rest_second) = (0.0f64, 0.0f64);
    for (a, b) in pairs {
        let (a, b) = (a.chunks_exact(8), b.chunks_exact(8));
        for (&u, &v) in a.remainder().iter().zip(b.remainder()) {
            let (x, y) = f(u, v);
            rest_first += x;
            rest_second += y;
        }
        for (a, b) in a.zip(b) {
            for i in 0..8 {
                let (x, y) = f(a[i], b[i]);
                first[i] += x;
                second[i] += y;
            }
        }
    }
    (
        first.iter().sum::<f64>() + rest_first,
        second.iter().sum::<f64>() + rest_second,
    )
}

/// Channels whose backward sums one pass keeps (on the stack: the step allocates nothing).
const BN_CHANNEL_BLOCK: usize = 512;
