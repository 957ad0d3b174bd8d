//! The CPU's matrix product, a primitive the backend and the ops' CPU code share: the
//! `gemm-f32` crate's AVX2/AVX-512 kernels over strided operands.

pub use gemm_common::Parallelism;

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
    assert!(m == 0 || k == 0 || lhs.len() > (m - 1) * lhs_rs + (k - 1) * lhs_cs);
    assert!(n == 0 || k == 0 || rhs.len() > (k - 1) * rhs_rs + (n - 1) * rhs_cs);
    // Row-major dst: its columns are contiguous, so the product is computed transposed,
    // dstᵀ = rhsᵀ·lhsᵀ, as the `gemm` crate's wrapper does (its microkernels prefer
    // column-major destinations).
    let (m, n, (lhs, lhs_cs, lhs_rs), (rhs, rhs_cs, rhs_rs), (dst_cs, dst_rs)) = if 1 < n {
        (n, m, (rhs, rhs_rs, rhs_cs), (lhs, lhs_rs, lhs_cs), (n, 1))
    } else {
        (m, n, (lhs, lhs_cs, lhs_rs), (rhs, rhs_cs, rhs_rs), (1, n))
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
