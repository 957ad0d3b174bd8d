//! exp and erfc in f32 without calls or branches, so the loops that use them vectorise
//! (glibc's and libm's are calls, one value at a time). Accurate to a few ulp; PyTorch's
//! vectorised CPU kernels use the same kinds of formulas.

/// erfc by Numerical Recipes' Chebyshev fit (relative error under 1.2e-7 everywhere), so
/// Φ(x) = erfc(−x/√2)/2 keeps its relative accuracy in the far left tail, where 1 + erf
/// cancels.
#[inline(always)]
pub fn erfc(x: f32) -> f32 {
    const C: [f32; 10] = [
        -1.265_512_2,
        1.000_023_7,
        0.374_091_96,
        0.096_784_18,
        -0.186_288_06,
        0.278_868_07,
        -1.135_204,
        1.488_515_9,
        -0.822_152_2,
        0.170_872_77,
    ];
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let mut poly = C[9];
    for &c in C[..9].iter().rev() {
        poly = poly * t + c;
    }
    let tail = t * exp(poly - z * z);
    if x >= 0.0 {
        tail
    } else {
        2.0 - tail
    }
}

/// e^x by Cephes' expf (relative error about 1e-7), branch-free so its loops vectorise.
/// Arguments are clamped to [-87.3, 88]: below, e^x is under f32's smallest normal.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const P: [f32; 6] = [
        1.987_569_1e-4,
        1.398_2e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ];
    // Adding 1.5·2^23 rounds to an integer n, which then sits in the sum's low mantissa
    // bits: no floor (a call without SSE4.1) and no float-to-int conversion.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.3, 88.0);
    let shifted = x * std::f32::consts::LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = x - n * 0.693_359_4 + n * 2.121_944_4e-4;
    let p = (((((P[0] * r + P[1]) * r + P[2]) * r + P[3]) * r + P[4]) * r + P[5]) * r * r + r + 1.0;
    let two_to_n = (shifted
        .to_bits()
        .wrapping_sub(ROUND.to_bits())
        .wrapping_add(127))
        << 23;
    p * f32::from_bits(two_to_n)
}

/// Partial sums of `lane_sum`: one AVX-512 register of f64.
pub const LANES: usize = 8;

/// Σ f(v) over `values` in f64, in LANES partial sums side by side (so that the loop
/// vectorises), added at the end. A normalisation's row statistics use it.
#[inline(always)]
pub fn lane_sum(values: &[f32], f: impl Fn(f32) -> f64) -> f64 {
    let mut lanes = [0.0f64; LANES];
    let chunks = values.chunks_exact(LANES);
    let tail: f64 = chunks.remainder().iter().map(|&v| f(v)).sum();
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane += f(v);
        }
    }
    lanes.iter().sum::<f64>() + tail
}
