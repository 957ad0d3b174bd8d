//! pooling's tests. The library does not compile this file: tests/suite/ops.rs does, so
//! that its CUDA tests run on the emulated GPU with the rest.

use crate::common::random_vec;
use crate::cuda_parity::{
    assert_within, down, gpu, poisoned_in, stored, tolerance, up_in, STORAGES,
};
use crate::gradients::{check_gradients, image_job, images};
use crate::spatial::{assert_close as assert_near_pytorch, cases, floats, int, pair};
use trainer::ops::pool::cpu::{
    avgpool2d_backward, avgpool2d_forward, maxpool2d_backward, maxpool2d_forward,
};
use trainer::ops::pool::Kernels;
use trainer::tensor::cpu::CpuBackend;
use trainer::tensor::{Pool2d, PoolKind};

#[test]
fn pooling_matches_pytorch_forward_and_backward() {
    for op in ["maxpool2d", "avgpool2d"] {
        for c in cases(op) {
            let n = int(&c["n"]);
            let s = Pool2d {
                c: int(&c["c"]),
                h: int(&c["h"]),
                w: int(&c["w"]),
                k: pair(&c["k"]),
                stride: pair(&c["stride"]),
                pad: pair(&c["pad"]),
            };
            let (x, dy) = (floats(&c["x"]), floats(&c["dy"]));
            // Taken through a ReLU whose output x is: PyTorch's dx, then the ReLU's step.
            let want_dx = floats(&c["dx"]);
            let through: Vec<f32> = want_dx
                .iter()
                .zip(&x)
                .map(|(&d, &v)| d * if v > 0.0 { 1.0 } else { 0.0 })
                .collect();
            for (through_relu, want_dx) in [(false, &want_dx), (true, &through)] {
                let mut y = vec![f32::NAN; dy.len()];
                let mut dx = vec![f32::NAN; x.len()];
                if op == "maxpool2d" {
                    maxpool2d_forward(&s, &x, &mut y, n);
                    maxpool2d_backward(&s, &x, &y, &dy, &mut dx, n, through_relu);
                } else {
                    avgpool2d_forward(&s, &x, &mut y, n);
                    avgpool2d_backward(&s, &x, &dy, &mut dx, n, through_relu);
                }
                let what = format!("{op} {s:?}, through_relu {through_relu}");
                assert_near_pytorch(&y, &floats(&c["y"]), &format!("{what}: y"));
                assert_near_pytorch(&dx, want_dx, &format!("{what}: dx"));
            }
        }
    }
}

#[test]
fn maxpool2d_gradients() {
    check_gradients(
        &image_job(r#"{ type = "maxpool2d", kernel_size = 3, stride = 2, padding = 1 }"#),
        images(),
    );
}

#[test]
fn avgpool2d_gradients() {
    check_gradients(
        &image_job(r#"{ type = "avgpool2d", kernel_size = 2 }"#),
        images(),
    );
}

#[test]
fn global_avg_pool_gradients() {
    check_gradients(&image_job(r#"{ type = "global_avg_pool" }"#), images());
}

#[test]
fn maxpool2d_2x2_on_an_odd_width_gradients() {
    // 6x5 input: the last column is in no window and must get no gradient.
    check_gradients(
        &image_job(r#"{ type = "maxpool2d", kernel_size = 2 }"#),
        images(),
    );
}

/// CUDA against the CPU on random inputs, with activations in f32 and in each half format:
/// forward, and backward with and without the ReLU before it.
#[test]
fn pooling_on_cuda_matches_the_cpu() {
    let Some(g) = gpu() else {
        return;
    };
    let (g, cpu, n) = (&g, CpuBackend::new(2), 5);
    for storage in STORAGES {
        let (tol, at) = (tolerance(storage), format!("{storage:?}"));
        for (kind, s) in [
            (
                PoolKind::Max,
                Pool2d {
                    c: 3,
                    h: 8,
                    w: 8,
                    k: (2, 2),
                    stride: (2, 2),
                    pad: (0, 0),
                },
            ),
            (
                PoolKind::Max,
                Pool2d {
                    c: 2,
                    h: 7,
                    w: 9,
                    k: (3, 3),
                    stride: (2, 2),
                    pad: (1, 1),
                },
            ),
            (
                PoolKind::Avg,
                Pool2d {
                    c: 2,
                    h: 7,
                    w: 9,
                    k: (3, 3),
                    stride: (2, 2),
                    pad: (1, 1),
                },
            ),
            (
                PoolKind::Avg,
                Pool2d {
                    c: 4,
                    h: 7,
                    w: 7,
                    k: (7, 7),
                    stride: (7, 7),
                    pad: (0, 0),
                },
            ),
        ] {
            let (oh, ow) = s.out_hw().unwrap();
            let (in_len, out_len) = (n * s.c * s.h * s.w, n * s.c * oh * ow);
            let (x, dy) = (random_vec(in_len, 24), random_vec(out_len, 25));
            let (x, dy) = (stored(storage, &x), stored(storage, &dy));
            let mut y_cpu = vec![f32::NAN; out_len];
            cpu.pool2d_forward(kind, &s, &x, &mut y_cpu, n);
            let (xg, mut yg) = (up_in(g, storage, &x), poisoned_in(g, storage, out_len));
            g.pool2d_forward(kind, &s, &xg, &mut yg, n);
            assert_within(
                &down(g, &yg, out_len),
                &stored(storage, &y_cpu),
                tol,
                &format!("{at} {kind:?} {s:?} forward"),
            );
            // Also taken through the ReLU whose output x would be (x holds negatives).
            for through_relu in [false, true] {
                let mut dx_cpu = vec![f32::NAN; in_len];
                cpu.pool2d_backward(kind, &s, &x, &y_cpu, &dy, &mut dx_cpu, n, through_relu);
                let mut dxg = poisoned_in(g, storage, in_len);
                let dyg = up_in(g, storage, &dy);
                g.pool2d_backward(kind, &s, &xg, &yg, &dyg, &mut dxg, n, through_relu);
                assert_within(
                    &down(g, &dxg, in_len),
                    &stored(storage, &dx_cpu),
                    tol,
                    &format!("{at} {kind:?} {s:?} backward, through_relu {through_relu}"),
                );
            }
        }
    }
}
