//! f32 ⇄ f16 / bf16 conversions for mixed precision, round-to-nearest-even as PyTorch does
//! (tests/suite/casts.rs checks them bit for bit against PyTorch). Half values are kept as their
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

/// Rounds every value to the nearest half (ties to even) in place, keeping it as f32.
/// Values beyond the half's range become ±inf, as a cast would make them.
pub fn round_to_half(kind: HalfKind, values: &mut [f32]) {
    match kind {
        // Through a small buffer of halves: the slice conversions use the CPU's F16C
        // instructions when present (the scalar ones test for them per value).
        HalfKind::F16 => {
            let mut halves = [0u16; 256];
            for chunk in values.chunks_mut(halves.len()) {
                let h = &mut halves[..chunk.len()];
                to_half(HalfKind::F16, chunk, h);
                from_half(HalfKind::F16, h, chunk);
            }
        }
        HalfKind::Bf16 => values.iter_mut().for_each(|v| *v = round_to_bf16(*v)),
    }
}

/// f32 → bf16 → f32 without branches (so the loop vectorises): add half an ulp of bf16,
/// plus one if the kept part is odd (ties to even), and clear the low 16 bits. Carries
/// propagate into the exponent, so values past bf16's largest round to inf. NaNs stay NaN.
fn round_to_bf16(v: f32) -> f32 {
    let u = v.to_bits();
    let rounded = f32::from_bits(u.wrapping_add(0x7fff + ((u >> 16) & 1)) & 0xffff_0000);
    if v.is_nan() {
        v
    } else {
        rounded
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_in_place_agrees_with_the_half_crate_bit_for_bit() {
        let mut values: Vec<f32> = vec![
            0.0,
            -0.0,
            1.0,
            65504.0,
            65520.0,
            1e-8,
            -1e-5,
            3.0e38,
            f32::MAX,
            f32::MIN_POSITIVE,
            1.0e-40,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ];
        let mut state = 0x9e37_79b9_u32;
        for _ in 0..100_000 {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            values.push(f32::from_bits(state));
        }
        values.retain(|v| !v.is_nan());
        for kind in [HalfKind::F16, HalfKind::Bf16] {
            let mut rounded = values.clone();
            round_to_half(kind, &mut rounded);
            for (v, r) in values.iter().zip(&rounded) {
                let expected = match kind {
                    HalfKind::F16 => f16::from_f32(*v).to_f32(),
                    HalfKind::Bf16 => bf16::from_f32(*v).to_f32(),
                };
                assert_eq!(r.to_bits(), expected.to_bits(), "{kind:?} of {v:e}");
            }
        }
        let mut nan = [f32::NAN];
        round_to_half(HalfKind::Bf16, &mut nan);
        assert!(nan[0].is_nan());
    }
}
