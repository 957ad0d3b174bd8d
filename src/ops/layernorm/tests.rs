//! layernorm's tests. The library does not compile this file: tests/suite/ops.rs does, so
//! that its CUDA tests run on the emulated GPU with the rest.

use crate::common::random_vec;
use crate::cuda_parity::{
    assert_close, assert_within, down, gpu, poisoned_in, stored, tolerance, up, up_in, STORAGES,
};
use crate::gradients::{check_gradients, image_job, images};
use crate::spatial::{cases, floats, int};
use trainer::ops::layernorm::cpu::{layernorm_backward, layernorm_forward};
use trainer::ops::layernorm::Kernels;
use trainer::tensor::cpu::CpuBackend;
use trainer::tensor::Backend;

/// Forward and every gradient against PyTorch (tests/fixtures/spatial_reference.json).
#[test]
fn layernorm_matches_pytorch() {
    for c in cases("layernorm") {
        let (rows, width, eps) = (
            int(&c["rows"]),
            int(&c["width"]),
            c["eps"].as_f64().unwrap() as f32,
        );
        let (x, gamma, beta, dy) = (
            floats(&c["x"]),
            floats(&c["gamma"]),
            floats(&c["beta"]),
            floats(&c["dy"]),
        );
        let (mut mean, mut invstd) = (vec![0.0; rows], vec![0.0; rows]);
        let mut y = vec![f32::NAN; x.len()];
        layernorm_forward(
            &x,
            &mut y,
            rows,
            width,
            &gamma,
            Some(&beta),
            (&mut mean, &mut invstd),
            eps,
        );
        crate::spatial::assert_close(&y, &floats(&c["y"]), "layernorm y");
        let (mut dx, mut dg, mut db) =
            (vec![f32::NAN; x.len()], vec![0.0; width], vec![0.0; width]);
        layernorm_backward(
            &x,
            &dy,
            Some(&mut dx),
            rows,
            width,
            &gamma,
            (&mean, &invstd),
            (&mut dg, Some(&mut db)),
        );
        crate::spatial::assert_close(&dx, &floats(&c["dx"]), "layernorm dx");
        crate::spatial::assert_close(&dg, &floats(&c["dgamma"]), "layernorm dgamma");
        crate::spatial::assert_close(&db, &floats(&c["dbeta"]), "layernorm dbeta");
    }
}

#[test]
fn layernorm_gradients() {
    check_gradients(&image_job(r#"{ type = "layernorm" }"#), images());
    check_gradients(
        &image_job(r#"{ type = "layernorm", bias = false }"#),
        images(),
    );
}

/// CUDA against the CPU on random inputs, with activations in f32 and in each half format.
#[test]
fn layernorm_on_cuda_matches_the_cpu() {
    let Some(g) = gpu() else {
        return;
    };
    let (g, cpu) = (&g, CpuBackend::new(2));
    for (storage, bias) in STORAGES.into_iter().flat_map(|s| [(s, true), (s, false)]) {
        let (tol, at) = (tolerance(storage), format!("{storage:?} bias {bias}"));
        let (rows, width) = (37, 300);
        let (x, dy) = (random_vec(rows * width, 30), random_vec(rows * width, 31));
        let (x, dy) = (stored(storage, &x), stored(storage, &dy));
        let params = random_vec(2 * width, 32);
        let (mut saved_cpu, mut y_cpu) = (vec![0.0; 2 * rows], vec![f32::NAN; rows * width]);
        cpu.layernorm_forward(
            &x,
            &mut y_cpu,
            (rows, width),
            &params,
            (0, bias),
            &mut saved_cpu,
            1e-5,
        );
        let (xg, pg) = (up_in(g, storage, &x), up(g, &params));
        let (mut saved_gpu, mut yg) = (
            g.alloc(2 * rows).unwrap(),
            poisoned_in(g, storage, rows * width),
        );
        g.layernorm_forward(
            &xg,
            &mut yg,
            (rows, width),
            &pg,
            (0, bias),
            &mut saved_gpu,
            1e-5,
        );
        assert_within(
            &down(g, &yg, rows * width),
            &stored(storage, &y_cpu),
            tol,
            &format!("{at} layer norm forward"),
        );
        let (mut gr_cpu, mut dx_cpu) = (vec![0.0; 2 * width], vec![f32::NAN; rows * width]);
        cpu.layernorm_backward(
            &x,
            &dy,
            Some(&mut dx_cpu),
            (rows, width),
            &params,
            &mut gr_cpu,
            (0, bias),
            &saved_cpu,
        );
        let (mut gr_gpu, mut dxg) = (
            g.alloc(2 * width).unwrap(),
            poisoned_in(g, storage, rows * width),
        );
        g.layernorm_backward(
            &xg,
            &up_in(g, storage, &dy),
            Some(&mut dxg),
            (rows, width),
            &pg,
            &mut gr_gpu,
            (0, bias),
            &saved_gpu,
        );
        assert_within(
            &down(g, &dxg, rows * width),
            &stored(storage, &dx_cpu),
            tol,
            &format!("{at} layer norm dx"),
        );
        assert_close(
            &down(g, &gr_gpu, 2 * width),
            &gr_cpu,
            &format!("{at} layer norm dgamma/dbeta"),
        );
    }
}
