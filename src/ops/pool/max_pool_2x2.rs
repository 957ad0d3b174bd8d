//! The backward pass of 2 × 2, stride-2 max pooling (a conv net's usual downsampling), one
//! row of windows at a time: each output gradient goes to the first position of its window,
//! in row-major order, that holds the window's maximum (NaN counting as equal to NaN), as
//! PyTorch routes it; the window's other three positions get zero. The maximum is found
//! again from x and y: no index buffer is kept.
//!
//! Written for scalars, the pass moved 8 GB/s on one thread where the forward pass moves
//! 18-27: the windows' values interleave in pairs and LLVM does not vectorise the
//! compare-and-select across them. With AVX-512 a step takes 8 windows, their 16 values of
//! each input row in one register, and the choice of the first maximum is arithmetic on the
//! compare masks: 2.5-3x faster (`cargo run --release --example pooling`, BENCHMARKS.md).
//! (An AVX-512 forward pass was tried and dropped: the scalar one already runs at the
//! memory's speed.)

/// One row of windows: x0 and x1 are the window pair's two input rows (2·ow values read),
/// d0 and d1 their gradients (2·ow values written), y and dy the ow outputs and their
/// gradients. `through_relu`: x is a ReLU's output and d0, d1 the gradient of its input, so
/// each routed gradient is also multiplied by (maximum > 0 ? 1 : 0), as the ReLU's backward
/// step would (`graph::BufferPlan::through_relu`).
pub fn route_gradients(
    x0: &[f32],
    x1: &[f32],
    y: &[f32],
    dy: &[f32],
    (d0, d1): (&mut [f32], &mut [f32]),
    through_relu: bool,
) {
    let ow = y.len();
    assert!(dy.len() == ow, "max_pool_2x2: dy and y differ in length");
    assert!(
        x0.len() >= 2 * ow && x1.len() >= 2 * ow && d0.len() >= 2 * ow && d1.len() >= 2 * ow,
        "max_pool_2x2: rows shorter than the windows"
    );
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is present; the asserts above keep every access in bounds.
        unsafe { avx512::route_gradients(x0, x1, y, dy, (d0, d1), through_relu) };
        return;
    }
    route_gradients_scalar(x0, x1, y, dy, (d0, d1), through_relu);
}

/// The ReLU's derivative at its output `y`, as a factor (its backward step's dy · this).
#[inline(always)]
pub fn relu_factor(y: f32) -> f32 {
    if y > 0.0 {
        1.0
    } else {
        0.0
    }
}

/// `route_gradients` one window at a time, branch-free.
fn route_gradients_scalar(
    x0: &[f32],
    x1: &[f32],
    y: &[f32],
    dy: &[f32],
    (d0, d1): (&mut [f32], &mut [f32]),
    through_relu: bool,
) {
    let same = |v: f32, t: f32| v == t || (v.is_nan() && t.is_nan());
    let outs = d0.chunks_exact_mut(2).zip(d1.chunks_exact_mut(2));
    let ins = x0.chunks_exact(2).zip(x1.chunks_exact(2));
    for (((o0, o1), (a, b)), (&t, &g)) in outs.zip(ins).zip(y.iter().zip(dy)) {
        let g = if through_relu { g * relu_factor(t) } else { g };
        let (e0, e1, e2, e3) = (same(a[0], t), same(a[1], t), same(b[0], t), same(b[1], t));
        o0[0] = if e0 { g } else { 0.0 };
        o0[1] = if !e0 && e1 { g } else { 0.0 };
        o1[0] = if !e0 && !e1 && e2 { g } else { 0.0 };
        o1[1] = if !e0 && !e1 && !e2 && e3 { g } else { 0.0 };
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// Windows a step takes: their 2 × 8 values of a row fill one register.
    const WINDOWS: usize = 8;
    /// The lanes of a window's left column (lane 2i for window i).
    const LEFT: u16 = 0x5555;

    /// # Safety
    /// AVX-512F must be present, and the slices must hold what `super::route_gradients`
    /// asserts.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn route_gradients(
        x0: &[f32],
        x1: &[f32],
        y: &[f32],
        dy: &[f32],
        (d0, d1): (&mut [f32], &mut [f32]),
        through_relu: bool,
    ) {
        let ow = y.len();
        let (zeros, ones) = (_mm512_setzero_ps(), _mm512_set1_ps(1.0));
        // Window i's output in lanes 2i and 2i+1, beside its pair of inputs.
        let twice = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
        for j in (0..ow).step_by(WINDOWS) {
            // The last step may take fewer windows: masked loads and stores touch only theirs.
            let windows = (ow - j).min(WINDOWS);
            let outputs = ((1u32 << windows) - 1) as __mmask16;
            let inputs = ((1u32 << (2 * windows)) - 1) as __mmask16;
            let widen = |v: &[f32]| {
                _mm512_permutexvar_ps(twice, _mm512_maskz_loadu_ps(outputs, v.as_ptr().add(j)))
            };
            let (t, mut g) = (widen(y), widen(dy));
            if through_relu {
                // g · relu_factor(t), the same product as the scalar code's.
                let positive = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(t, zeros);
                g = _mm512_mul_ps(g, _mm512_mask_blend_ps(positive, zeros, ones));
            }
            let a = _mm512_maskz_loadu_ps(inputs, x0.as_ptr().add(2 * j));
            let b = _mm512_maskz_loadu_ps(inputs, x1.as_ptr().add(2 * j));
            let t_nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(t, t);
            let same = |v: __m512| {
                _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(v, t)
                    | (_mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v) & t_nan)
            };
            let (top, bottom) = (same(a), same(b));
            // Window i's four candidates, in row-major order, as bits 2i and 2i+1 of the
            // two masks; a window's bits are never shifted into another's.
            let (e0, e1) = (top & LEFT, top & !LEFT);
            let (e2, e3) = (bottom & LEFT, bottom & !LEFT);
            let in_top = e0 | (e1 >> 1);
            let keep_top = e0 | (e1 & !(e0 << 1));
            let keep_bottom = (e2 & !in_top) | (e3 & !((in_top | e2) << 1));
            let (out0, out1) = (d0.as_mut_ptr().add(2 * j), d1.as_mut_ptr().add(2 * j));
            _mm512_mask_storeu_ps(out0, inputs, _mm512_maskz_mov_ps(keep_top, g));
            _mm512_mask_storeu_ps(out1, inputs, _mm512_maskz_mov_ps(keep_bottom, g));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{route_gradients, route_gradients_scalar};

    /// Values on a coarse grid, so that windows often hold ties, with a NaN now and then.
    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut z = seed;
        (0..len)
            .map(|_| {
                z = z
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                match (z >> 40) % 23 {
                    0 => f32::NAN,
                    r => (r % 5) as f32 - 2.0,
                }
            })
            .collect()
    }

    /// The gradient of each position by the definition: the output's gradient where the
    /// position is the first of its window to equal the window's maximum, then through the
    /// ReLU whose output x is when `through_relu`.
    fn by_definition(x0: &[f32], x1: &[f32], dy: &[f32], through_relu: bool) -> Vec<Vec<f32>> {
        let ow = dy.len();
        let (mut d0, mut d1) = (vec![0.0; 2 * ow], vec![0.0; 2 * ow]);
        for i in 0..ow {
            let window = [x0[2 * i], x0[2 * i + 1], x1[2 * i], x1[2 * i + 1]];
            let max =
                window.iter().fold(
                    f32::NEG_INFINITY,
                    |m, &v| if v > m || v.is_nan() { v } else { m },
                );
            let first = window
                .iter()
                .position(|&v| v == max || (v.is_nan() && max.is_nan()))
                .unwrap();
            let row = if first < 2 { &mut d0 } else { &mut d1 };
            // The ReLU passes the gradient where its output is positive (NaN is not).
            let relu = if !through_relu || max > 0.0 { 1.0 } else { 0.0 };
            row[2 * i + first % 2] = dy[i] * relu;
        }
        vec![d0, d1]
    }

    #[test]
    fn each_gradient_goes_to_the_first_maximum_of_its_window_and_nowhere_else() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        // Widths through the 8-window steps and their remainders.
        for ow in [1, 2, 7, 8, 9, 14, 16, 23] {
            for (seed, through_relu) in (0..40).map(|seed| (seed, seed % 2 == 1)) {
                let (x0, x1) = (values(2 * ow, seed), values(2 * ow, seed + 100));
                let y: Vec<f32> = (0..ow)
                    .map(|i| {
                        let w = [x0[2 * i], x0[2 * i + 1], x1[2 * i], x1[2 * i + 1]];
                        w.iter().fold(
                            f32::NEG_INFINITY,
                            |m, &v| if v > m || v.is_nan() { v } else { m },
                        )
                    })
                    .collect();
                // Negative gradients too: times the ReLU's 0 they give -0.
                let dy: Vec<f32> = (0..ow).map(|i| i as f32 - 3.5).collect();
                let want = by_definition(&x0, &x1, &dy, through_relu);
                // One value past the windows on each row, which must stay untouched.
                let mut got = vec![vec![f32::NAN; 2 * ow + 1]; 2];
                let (d0, d1) = got.split_at_mut(1);
                route_gradients(&x0, &x1, &y, &dy, (&mut d0[0], &mut d1[0]), through_relu);
                let mut scalar = vec![vec![f32::NAN; 2 * ow + 1]; 2];
                let (d0, d1) = scalar.split_at_mut(1);
                route_gradients_scalar(&x0, &x1, &y, &dy, (&mut d0[0], &mut d1[0]), through_relu);
                for (name, rows) in [("dispatched", &got), ("scalar", &scalar)] {
                    for (row, want) in rows.iter().zip(&want) {
                        let what = format!("{name}, ow {ow}, seed {seed}, relu {through_relu}");
                        assert_eq!(bits(&row[..2 * ow]), bits(want), "{what}");
                        assert!(row[2 * ow].is_nan(), "{what}: wrote past 2·ow");
                    }
                }
            }
        }
    }
}
