//! The backends' building blocks that ops compose, against their definitions on the CPU and
//! CUDA against the CPU (on the emulated GPU in CI).

use crate::common::random_vec;
use crate::cuda_parity::{assert_close, down, gpu, poisoned, up};
use trainer::tensor::cpu::CpuBackend;
use trainer::tensor::{Backend, Matrices};

const CPU: CpuBackend = CpuBackend::new(2);

/// A batched product's layout: `batch` matrices of `rows` x `cols` as stored (the operand's
/// transpose when `transposed`), rows `pad` values longer than they need, matrices 3 values
/// apart beyond that, after an offset of 5.
fn layout(
    batch: usize,
    rows: usize,
    cols: usize,
    pad: usize,
    transposed: bool,
) -> (Matrices, usize) {
    let row_stride = cols + pad;
    let batch_stride = rows * row_stride + 3;
    let at = Matrices {
        offset: 5,
        batch_stride,
        row_stride,
        transposed,
    };
    (at, 5 + batch * batch_stride)
}

/// Element (r, c) of matrix `i` of an operand, by the definition of `Matrices`.
fn element(v: &[f32], at: Matrices, i: usize, r: usize, c: usize) -> f64 {
    let (r, c) = if at.transposed { (c, r) } else { (r, c) };
    v[at.offset + i * at.batch_stride + r * at.row_stride + c] as f64
}

struct Case {
    shape: (usize, usize, usize),
    batch: usize,
    a: (Vec<f32>, Matrices),
    b: (Vec<f32>, Matrices),
    c: (Vec<f32>, Matrices),
}

fn case((m, n, k): (usize, usize, usize), batch: usize, a_t: bool, b_t: bool) -> Case {
    let (a_at, a_len) = match a_t {
        false => layout(batch, m, k, 2, false),
        true => layout(batch, k, m, 1, true),
    };
    let (b_at, b_len) = match b_t {
        false => layout(batch, k, n, 0, false),
        true => layout(batch, n, k, 3, true),
    };
    let c_at = Matrices {
        offset: 4,
        batch_stride: m * n + 1,
        row_stride: n,
        transposed: false,
    };
    Case {
        shape: (m, n, k),
        batch,
        a: (random_vec(a_len, 1), a_at),
        b: (random_vec(b_len, 2), b_at),
        c: (random_vec(4 + batch * (m * n + 1), 3), c_at),
    }
}

/// What C holds after the product, by the definition, in f64.
fn by_definition(t: &Case, accumulate: bool) -> Vec<f32> {
    let ((m, n, k), (a, a_at), (b, b_at)) = (t.shape, &t.a, &t.b);
    let (mut c, c_at) = t.c.clone();
    for i in 0..t.batch {
        for r in 0..m {
            for col in 0..n {
                let sum: f64 = (0..k)
                    .map(|j| element(a, *a_at, i, r, j) * element(b, *b_at, i, j, col))
                    .sum();
                let at = c_at.offset + i * c_at.batch_stride + r * n + col;
                c[at] = (sum + if accumulate { c[at] as f64 } else { 0.0 }) as f32;
            }
        }
    }
    c
}

const SHAPES: [((usize, usize, usize), usize); 3] =
    [((7, 5, 9), 4), ((1, 33, 16), 3), ((64, 64, 8), 2)];

#[test]
fn batched_matmul_is_its_definition_for_every_transpose() {
    for (shape, batch) in SHAPES {
        for (a_t, b_t, accumulate) in [
            (false, false, false),
            (false, true, true),
            (true, false, false),
            (true, true, true),
        ] {
            let t = case(shape, batch, a_t, b_t);
            let mut c = t.c.0.clone();
            CPU.batched_matmul(
                shape, batch, &t.a.0, t.a.1, &t.b.0, t.b.1, &mut c, t.c.1, accumulate,
            );
            let want = by_definition(&t, accumulate);
            let what = format!("{shape:?} x{batch} a_t={a_t} b_t={b_t} accumulate={accumulate}");
            for (i, (got, want)) in c.iter().zip(&want).enumerate() {
                assert!(
                    (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "{what}: value {i}: {got} vs {want}"
                );
            }
        }
    }
}

#[test]
fn batched_matmul_on_cuda_matches_the_cpu() {
    let Some(g) = gpu() else {
        return;
    };
    for (shape, batch) in SHAPES {
        for (a_t, b_t, accumulate) in [
            (false, false, true),
            (false, true, false),
            (true, false, true),
            (true, true, false),
        ] {
            let t = case(shape, batch, a_t, b_t);
            let mut c = t.c.0.clone();
            CPU.batched_matmul(
                shape, batch, &t.a.0, t.a.1, &t.b.0, t.b.1, &mut c, t.c.1, accumulate,
            );
            let (ag, bg) = (up(&g, &t.a.0), up(&g, &t.b.0));
            let mut cg = match accumulate {
                true => up(&g, &t.c.0),
                false => poisoned(&g, t.c.0.len()),
            };
            g.batched_matmul(
                shape, batch, &ag, t.a.1, &bg, t.b.1, &mut cg, t.c.1, accumulate,
            );
            // Only the products' values are compared: the gaps between them are not written.
            let (got, at) = (down(&g, &cg, c.len()), t.c.1);
            let (m, n, _) = shape;
            let values = |v: &[f32]| -> Vec<f32> {
                (0..batch)
                    .flat_map(|i| v[at.offset + i * at.batch_stride..][..m * n].to_vec())
                    .collect()
            };
            let what = format!("{shape:?} x{batch} a_t={a_t} b_t={b_t} accumulate={accumulate}");
            assert_close(&values(&got), &values(&c), &what);
        }
    }
}
