//! The CPU's matrix product, a primitive the backend and the ops' CPU code share: the
//! `gemm-f32` crate's AVX2/AVX-512 kernels over strided operands.

pub use gemm_common::Parallelism;
use rayon::prelude::*;

/// A thread's band of rows is at least this tall; shorter products stay on the crate's threads.
const MIN_BAND_ROWS: usize = 32;

/// Row-major dst[m, n] = (accumulate ? dst : 0) + lhs·rhs, where lhs and rhs are given by
/// their element strides (row stride, column stride), so transposes cost nothing.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    dst: &mut [f32],
    accumulate: bool,
    lhs: &[f32],
    (lhs_rs, lhs_cs): (usize, usize),
    rhs: &[f32],
    (rhs_rs, rhs_cs): (usize, usize),
    (m, n, k): (usize, usize, usize),
    threads: Parallelism,
) {
    assert!(dst.len() >= m * n, "gemm destination too small");
    // Threads take a band of rows each, every band one single-threaded product: the crate's
    // own threading gains little at these sizes (1.25x on two threads for 768×128·128×384).
    if let Parallelism::Rayon(threads) = threads {
        if threads > 1 && m >= 2 * MIN_BAND_ROWS && n > 0 && k > 0 {
            let band = m.div_ceil(threads).next_multiple_of(MIN_BAND_ROWS / 2);
            return dst[..m * n]
                .par_chunks_mut(band * n)
                .enumerate()
                .for_each(|(i, dst)| {
                    let rows = dst.len() / n;
                    matmul(
                        dst,
                        accumulate,
                        &lhs[i * band * lhs_rs..],
                        (lhs_rs, lhs_cs),
                        rhs,
                        (rhs_rs, rhs_cs),
                        (rows, n, k),
                        Parallelism::None,
                    )
                });
        }
    }
    product(
        dst,
        n,
        accumulate,
        lhs,
        (lhs_rs, lhs_cs),
        rhs,
        (rhs_rs, rhs_cs),
        (m, n, k),
        threads,
    );
}

/// dst = lhs·rhs on one thread, or dst += lhs·rhs with `accumulate`, into a destination
/// whose rows lie `dst_rs` values apart (a column block of a wider matrix, such as one head's
/// slice of attention's output).
#[allow(clippy::too_many_arguments)]
pub fn matmul_into_rows(
    dst: &mut [f32],
    dst_rs: usize,
    accumulate: bool,
    lhs: &[f32],
    lhs_strides: (usize, usize),
    rhs: &[f32],
    rhs_strides: (usize, usize),
    (m, n, k): (usize, usize, usize),
) {
    assert!(n <= dst_rs, "destination rows overlap");
    let none = Parallelism::None;
    product(
        dst,
        dst_rs,
        accumulate,
        lhs,
        lhs_strides,
        rhs,
        rhs_strides,
        (m, n, k),
        none,
    );
}

/// One call of the crate's kernel.
#[allow(clippy::too_many_arguments)]
fn product(
    dst: &mut [f32],
    dst_row_stride: usize,
    accumulate: bool,
    lhs: &[f32],
    (lhs_rs, lhs_cs): (usize, usize),
    rhs: &[f32],
    (rhs_rs, rhs_cs): (usize, usize),
    (m, n, k): (usize, usize, usize),
    threads: Parallelism,
) {
    assert!(m == 0 || n == 0 || dst.len() >= (m - 1) * dst_row_stride + n);
    assert!(m == 0 || k == 0 || lhs.len() > (m - 1) * lhs_rs + (k - 1) * lhs_cs);
    assert!(n == 0 || k == 0 || rhs.len() > (k - 1) * rhs_rs + (n - 1) * rhs_cs);
    // Row-major dst: its columns are contiguous, so the product is computed transposed,
    // dstᵀ = rhsᵀ·lhsᵀ, as the `gemm` crate's wrapper does (its microkernels prefer
    // column-major destinations).
    let (m, n, (lhs, lhs_cs, lhs_rs), (rhs, rhs_cs, rhs_rs), (dst_cs, dst_rs)) = if 1 < n {
        (
            n,
            m,
            (rhs, rhs_rs, rhs_cs),
            (lhs, lhs_rs, lhs_cs),
            (dst_row_stride, 1),
        )
    } else {
        (
            m,
            n,
            (lhs, lhs_cs, lhs_rs),
            (rhs, rhs_cs, rhs_rs),
            (1, dst_row_stride),
        )
    };
    // SAFETY: the asserts above keep every index the kernel touches inside the slices,
    // and `dst` does not alias `lhs` or `rhs` (it is a distinct &mut).
    unsafe {
        gemm_f32::gemm::f32::get_gemm_fn()(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            dst_cs as isize,
            dst_rs as isize,
            accumulate,
            lhs.as_ptr(),
            lhs_cs as isize,
            lhs_rs as isize,
            rhs.as_ptr(),
            rhs_cs as isize,
            rhs_rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            threads,
        );
    }
}
