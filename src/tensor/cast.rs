//! f32 ⇄ f16 / bf16 conversions for mixed precision, round-to-nearest-even as PyTorch does
//! (tests/casts.rs checks them bit for bit against PyTorch). Half values are kept as their
//! raw 16-bit patterns, the same layout the CUDA kernels use.

use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use half::{bf16, f16};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HalfKind {
    /// IEEE binary16: 5 exponent bits, 10 mantissa bits.
    F16,
    /// bfloat16: f32's 8 exponent bits, 7 mantissa bits.
    Bf16,
}

/// Rounds every value of `src` to the nearest half (ties to even) into `dst`.
pub fn to_half(kind: HalfKind, src: &[f32], dst: &mut [u16]) {
    let dst = &mut dst[..src.len()];
    match kind {
        HalfKind::F16 => dst
            .reinterpret_cast_mut::<f16>()
            .convert_from_f32_slice(src),
        HalfKind::Bf16 => dst
            .reinterpret_cast_mut::<bf16>()
            .convert_from_f32_slice(src),
    }
}

/// Widens halves to f32 (exact).
pub fn from_half(kind: HalfKind, src: &[u16], dst: &mut [f32]) {
    let dst = &mut dst[..src.len()];
    match kind {
        HalfKind::F16 => src.reinterpret_cast::<f16>().convert_to_f32_slice(dst),
        HalfKind::Bf16 => src.reinterpret_cast::<bf16>().convert_to_f32_slice(dst),
    }
}
