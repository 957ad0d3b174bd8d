//! A convolution's output in one pass: y = bias + Σ over kernel rows of W[row] · (that kernel
//! row's window of the unrolled input), every sum held in registers. With the general GEMM
//! the output was written by a bias fill and then read and written again by one product per
//! kernel row, each with few output channels (16-64) and short sums (the input channels ×
//! the kernel width): shapes where the `gemm` crate spends much of its time packing. This
//! kernel reads the windows and the weights in place, 8 channels × 48 pixels at a time in 24
//! AVX-512 registers.

/// y[o·ldy + p] = bias[o] (0 without) + Σ_r Σ_t w[r·m·k + o·k + t] · x[starts[r] + t·ldx + p]
/// for o < m, p < n, t < k, and r over `starts` (the kernel rows' windows). Returns false,
/// touching nothing, where the CPU has no AVX-512 (the caller then uses a general GEMM).
#[allow(clippy::too_many_arguments)]
pub fn conv_rows(
    y: &mut [f32],
    ldy: usize,
    bias: Option<&[f32]>,
    w: &[f32],
    x: &[f32],
    starts: &[usize],
    ldx: usize,
    (m, n, k): (usize, usize, usize),
) -> bool {
    if m == 0 || n == 0 {
        return true;
    }
    assert!(
        n <= ldy && y.len() >= (m - 1) * ldy + n,
        "conv_rows: y too short"
    );
    assert!(w.len() >= starts.len() * m * k, "conv_rows: w too short");
    assert!(
        bias.is_none_or(|b| b.len() >= m),
        "conv_rows: bias too short"
    );
    let last_row = starts
        .iter()
        .max()
        .map_or(0, |&s| s + k.saturating_sub(1) * ldx);
    assert!(k == 0 || x.len() >= last_row + n, "conv_rows: x too short");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is present; the asserts above keep every access in bounds.
        unsafe { avx512::conv_rows(y, ldy, bias, w, x, starts, ldx, (m, n, k)) };
        return true;
    }
    false
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// Pixels a step: three vectors of 16.
    const PIXELS: usize = 48;

    /// # Safety
    /// AVX-512F must be present, and the slices must hold what `super::conv_rows` asserts.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn conv_rows(
        y: &mut [f32],
        ldy: usize,
        bias: Option<&[f32]>,
        w: &[f32],
        x: &[f32],
        starts: &[usize],
        ldx: usize,
        (m, n, k): (usize, usize, usize),
    ) {
        let geometry = Rows {
            starts,
            x: x.as_ptr(),
            ldx,
            k,
            w_block: m * k,
        };
        let mut o = 0;
        while o < m {
            // 8 channels a tile while they last, then 4, 2, 1.
            let channels = [8, 4, 2, 1].into_iter().find(|&c| c <= m - o).unwrap_or(1);
            let bias = bias.map(|b| b.as_ptr().add(o));
            let (w, y) = (w.as_ptr().add(o * k), y.as_mut_ptr().add(o * ldy));
            let mut p = 0;
            while p < n {
                let left = (n - p).min(PIXELS);
                let vectors = left.div_ceil(16);
                // The last vector's lanes that are pixels (a partial one is masked).
                let last = match left % 16 {
                    0 => u16::MAX,
                    lanes => ((1u32 << lanes) - 1) as u16,
                };
                macro_rules! dispatch {
                    ($(($c:literal, $v:literal)),*) => {
                        match (channels, vectors) {
                            $(($c, $v) => tile::<$c, $v>(&geometry, w, bias, y.add(p), ldy, p, last),)*
                            _ => unreachable!(),
                        }
                    };
                }
                dispatch!(
                    (8, 3),
                    (8, 2),
                    (8, 1),
                    (4, 3),
                    (4, 2),
                    (4, 1),
                    (2, 3),
                    (2, 2),
                    (2, 1),
                    (1, 3),
                    (1, 2),
                    (1, 1)
                );
                p += left;
            }
            o += channels;
        }
    }

    /// What every tile reads: the unrolled input's windows and the weights' layout.
    struct Rows<'a> {
        starts: &'a [usize],
        x: *const f32,
        ldx: usize,
        k: usize,
        /// Values between one kernel row's weights and the next's (m·k).
        w_block: usize,
    }

    /// C channels × V vectors of 16 pixels from pixel `p`: the bias, then every kernel row's
    /// products, in C·V accumulators; stored once. The last vector's lanes outside `last`
    /// are neither read nor written.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn tile<const C: usize, const V: usize>(
        rows: &Rows,
        w: *const f32,
        bias: Option<*const f32>,
        y: *mut f32,
        ldy: usize,
        p: usize,
        last: __mmask16,
    ) {
        let mut acc = [[_mm512_setzero_ps(); V]; C];
        if let Some(b) = bias {
            for (c, row) in acc.iter_mut().enumerate() {
                *row = [_mm512_set1_ps(*b.add(c)); V];
            }
        }
        let mask = |v: usize| if v + 1 == V { last } else { u16::MAX };
        for (r, &start) in rows.starts.iter().enumerate() {
            let w = w.add(r * rows.w_block);
            let x = rows.x.add(start + p);
            for t in 0..rows.k {
                let xt = x.add(t * rows.ldx);
                let mut xv = [_mm512_setzero_ps(); V];
                for (v, xv) in xv.iter_mut().enumerate() {
                    *xv = _mm512_maskz_loadu_ps(mask(v), xt.add(16 * v));
                }
                for (c, row) in acc.iter_mut().enumerate() {
                    let wv = _mm512_set1_ps(*w.add(c * rows.k + t));
                    for (sum, &xv) in row.iter_mut().zip(&xv) {
                        *sum = _mm512_fmadd_ps(wv, xv, *sum);
                    }
                }
            }
        }
        for (c, row) in acc.iter().enumerate() {
            for (v, &sum) in row.iter().enumerate() {
                _mm512_mask_storeu_ps(y.add(c * ldy + 16 * v), mask(v), sum);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::conv_rows;
    use crate::tensor::rng::Rng;

    /// Values in [-1, 1) from a fixed seed (a zero, which could hide a missed term, has
    /// probability 2^-53).
    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        (0..len).map(|_| rng.uniform(-1.0, 1.0) as f32).collect()
    }

    #[test]
    fn every_tile_shape_sums_the_bias_and_every_kernel_rows_products() {
        // Channel counts through the 8/4/2/1 tiles; pixel counts around the 16- and
        // 48-pixel steps; one to three kernel rows whose windows overlap, as a
        // convolution's do; rows strided wider than the pixels, with and without a bias.
        for m in [1, 3, 8, 13, 32] {
            for n in [1, 15, 16, 17, 47, 48, 49, 196] {
                for (k, rows) in [(1, 1), (3, 3), (7, 2)] {
                    let ldx = n + 5;
                    let starts: Vec<usize> = (0..rows).map(|r| r * (ldx + 1)).collect();
                    let x = values(starts[rows - 1] + k * ldx + n, 1);
                    let w = values(rows * m * k, 2);
                    let bias = values(m, 3);
                    for with_bias in [false, true] {
                        let ldy = n + 3;
                        let before = values(m * ldy, 4);
                        let mut y = before.clone();
                        let b = with_bias.then_some(&bias[..]);
                        if !conv_rows(&mut y, ldy, b, &w, &x, &starts, ldx, (m, n, k)) {
                            eprintln!("no AVX-512 here: conv_rows is not used, nothing to check");
                            return;
                        }
                        for o in 0..m {
                            for p in 0..ldy {
                                let got = y[o * ldy + p];
                                if p >= n {
                                    assert_eq!(got, before[o * ldy + p], "[{o}, {p}] past n");
                                    continue;
                                }
                                let mut want = if with_bias { bias[o] as f64 } else { 0.0 };
                                for (r, &start) in starts.iter().enumerate() {
                                    for t in 0..k {
                                        want += w[r * m * k + o * k + t] as f64
                                            * x[start + t * ldx + p] as f64;
                                    }
                                }
                                let tolerance =
                                    1e-6 * ((rows * k) as f64).sqrt() * (1.0 + want.abs());
                                assert!(
                                    (got as f64 - want).abs() <= tolerance,
                                    "m {m} n {n} k {k} rows {rows} [{o}, {p}]: {got} against {want}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
