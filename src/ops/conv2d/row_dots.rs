//! dst[i, j] += a[i, ·] · b[j, ·]: every dot product of a row of `a` with a row of `b`, both
//! rows contiguous. A convolution's weight gradient per sample has this shape (the output
//! gradient's channels against the unrolled input's rows, over the output pixels): a few
//! dozen rows each way and a few hundred values long. There a general GEMM spends much of
//! its time packing panels that are then used a few times only (the `gemm` crate ran these
//! at about half of this CPU's peak); this kernel reads the rows in place, 4 × 4 dot
//! products at a time in 16 AVX-512 registers.

/// dst[i·ldd + j] += Σ_t a[i·lda + t] · b[j·ldb + t] for i < m, j < n, t < k. Returns false,
/// touching nothing, where the CPU has no AVX-512 (the caller then uses a general GEMM).
#[allow(clippy::too_many_arguments)]
pub fn add_row_dots(
    dst: &mut [f32],
    ldd: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    (m, n, k): (usize, usize, usize),
) -> bool {
    if m == 0 || n == 0 {
        return true;
    }
    assert!(k <= lda && k <= ldb && n <= ldd, "row_dots: rows overlap");
    assert!(a.len() >= (m - 1) * lda + k, "row_dots: a too short");
    assert!(b.len() >= (n - 1) * ldb + k, "row_dots: b too short");
    assert!(dst.len() >= (m - 1) * ldd + n, "row_dots: dst too short");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is present; the asserts above keep every access in bounds.
        unsafe { avx512::add_row_dots(dst, ldd, a, lda, b, ldb, (m, n, k)) };
        return true;
    }
    false
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// Rows of `a` and of `b` a tile takes.
    const TILE: usize = 4;

    /// # Safety
    /// AVX-512F must be present, and the slices must hold what `super::add_row_dots`
    /// asserts.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn add_row_dots(
        dst: &mut [f32],
        ldd: usize,
        a: &[f32],
        lda: usize,
        b: &[f32],
        ldb: usize,
        (m, n, k): (usize, usize, usize),
    ) {
        let (a, b, d) = (a.as_ptr(), b.as_ptr(), dst.as_mut_ptr());
        for i in (0..m).step_by(TILE) {
            for j in (0..n).step_by(TILE) {
                let (ai, bj, dij) = (a.add(i * lda), b.add(j * ldb), d.add(i * ldd + j));
                let rows = ((m - i).min(TILE), (n - j).min(TILE));
                macro_rules! dispatch {
                    ($(($mr:literal, $nr:literal)),*) => {
                        match rows {
                            $(($mr, $nr) => tile::<$mr, $nr>(dij, ldd, ai, lda, bj, ldb, k),)*
                            _ => unreachable!(),
                        }
                    };
                }
                dispatch!(
                    (4, 4),
                    (4, 3),
                    (4, 2),
                    (4, 1),
                    (3, 4),
                    (3, 3),
                    (3, 2),
                    (3, 1),
                    (2, 4),
                    (2, 3),
                    (2, 2),
                    (2, 1),
                    (1, 4),
                    (1, 3),
                    (1, 2),
                    (1, 1)
                );
            }
        }
    }

    /// MR × NR dot products of length k, 16 values a step (the last step masked), in
    /// MR·NR accumulators; each sum then reduced across its lanes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn tile<const MR: usize, const NR: usize>(
        d: *mut f32,
        ldd: usize,
        a: *const f32,
        lda: usize,
        b: *const f32,
        ldb: usize,
        k: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); NR]; MR];
        let mut t = 0;
        while t + 16 <= k {
            let mut bv = [_mm512_setzero_ps(); NR];
            for (c, v) in bv.iter_mut().enumerate() {
                *v = _mm512_loadu_ps(b.add(c * ldb + t));
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let av = _mm512_loadu_ps(a.add(r * lda + t));
                for (sum, &bv) in row.iter_mut().zip(&bv) {
                    *sum = _mm512_fmadd_ps(av, bv, *sum);
                }
            }
            t += 16;
        }
        if t < k {
            let mask: __mmask16 = ((1u32 << (k - t)) - 1) as u16;
            let mut bv = [_mm512_setzero_ps(); NR];
            for (c, v) in bv.iter_mut().enumerate() {
                *v = _mm512_maskz_loadu_ps(mask, b.add(c * ldb + t));
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let av = _mm512_maskz_loadu_ps(mask, a.add(r * lda + t));
                for (sum, &bv) in row.iter_mut().zip(&bv) {
                    *sum = _mm512_fmadd_ps(av, bv, *sum);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (c, &sum) in row.iter().enumerate() {
                *d.add(r * ldd + c) += _mm512_reduce_add_ps(sum);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::add_row_dots;
    use crate::tensor::rng::Rng;

    /// Values in [-1, 1) from a fixed seed (a zero, which could hide a missed term, has
    /// probability 2^-53).
    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        (0..len).map(|_| rng.uniform(-1.0, 1.0) as f32).collect()
    }

    #[test]
    fn every_tile_shape_and_length_adds_the_dot_products_of_the_rows() {
        // Row counts through the 4 × 4 tiles and their edges; lengths around the 16-value
        // step; rows strided wider than they are long, as a convolution's windows are.
        for (m, n) in [(1, 1), (3, 5), (4, 4), (5, 9), (16, 48), (7, 3)] {
            for k in [1, 15, 16, 17, 33, 196] {
                let (lda, ldb, ldd) = (k + 3, k + 5, n + 2);
                let (a, b) = (values(m * lda, 1), values(n * ldb, 2));
                let before = values(m * ldd, 3);
                let mut dst = before.clone();
                if !add_row_dots(&mut dst, ldd, &a, lda, &b, ldb, (m, n, k)) {
                    eprintln!("no AVX-512 here: row_dots is not used, nothing to check");
                    return;
                }
                for i in 0..m {
                    for j in 0..ldd {
                        let got = dst[i * ldd + j];
                        if j >= n {
                            assert_eq!(got, before[i * ldd + j], "[{i}, {j}] past n written");
                            continue;
                        }
                        let dot: f64 = (0..k)
                            .map(|t| a[i * lda + t] as f64 * b[j * ldb + t] as f64)
                            .sum();
                        let want = before[i * ldd + j] as f64 + dot;
                        let tolerance = 1e-6 * (k as f64).sqrt() * (1.0 + want.abs());
                        assert!(
                            (got as f64 - want).abs() <= tolerance,
                            "m {m} n {n} k {k} [{i}, {j}]: {got} against {want}"
                        );
                    }
                }
            }
        }
    }
}
