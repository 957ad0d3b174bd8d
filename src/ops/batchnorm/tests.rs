//! batch norm's tests. The library does not compile this file: tests/suite/ops.rs does, so
//! that its CUDA tests run on the emulated GPU with the rest.

use crate::common::random_vec;
use crate::cuda_parity::{
    assert_close, assert_within, down, gpu, poisoned_in, stored, tolerance, up, up_in, STORAGES,
};
use crate::gradients::{between_linears, check_gradients, classes, image_job, images};
use crate::spatial::{assert_close as assert_near_pytorch, cases, floats, int};
use trainer::ops::batchnorm::cpu::{batchnorm_backward, batchnorm_forward};
use trainer::ops::batchnorm::Kernels;
use trainer::tensor::cpu::CpuBackend;

#[test]
fn batchnorm_matches_pytorch_in_training_and_evaluation() {
    for c in cases("batchnorm") {
        let (n, ch, sp) = (int(&c["n"]), int(&c["c"]), int(&c["spatial"]));
        let (momentum, eps) = (
            c["momentum"].as_f64().unwrap() as f32,
            c["eps"].as_f64().unwrap() as f32,
        );
        let (x, gamma, beta, dy) = (
            floats(&c["x"]),
            floats(&c["gamma"]),
            floats(&c["beta"]),
            floats(&c["dy"]),
        );
        let (mut rm, mut rv) = (floats(&c["running_mean0"]), floats(&c["running_var0"]));
        let (mut mean, mut invstd) = (vec![0.0; ch], vec![0.0; ch]);
        let mut y = vec![f32::NAN; x.len()];
        batchnorm_forward(
            &x,
            &mut y,
            n,
            ch,
            sp,
            &gamma,
            &beta,
            (&mut rm, &mut rv),
            (&mut mean, &mut invstd),
            true,
            momentum,
            eps,
        );
        assert_near_pytorch(&y, &floats(&c["y"]), "batchnorm y");
        assert_near_pytorch(&rm, &floats(&c["running_mean"]), "running mean");
        assert_near_pytorch(&rv, &floats(&c["running_var"]), "running var");
        let (mut dx, mut dg, mut dbeta) = (vec![f32::NAN; x.len()], vec![0.0; ch], vec![0.0; ch]);
        batchnorm_backward(
            &x,
            &dy,
            Some(&mut dx),
            n,
            ch,
            sp,
            &gamma,
            (&mean, &invstd),
            (&mut dg, &mut dbeta),
        );
        assert_near_pytorch(&dx, &floats(&c["dx"]), "batchnorm dx");
        assert_near_pytorch(&dg, &floats(&c["dgamma"]), "batchnorm dgamma");
        assert_near_pytorch(&dbeta, &floats(&c["dbeta"]), "batchnorm dbeta");
        let mut y_eval = vec![f32::NAN; x.len()];
        batchnorm_forward(
            &x,
            &mut y_eval,
            n,
            ch,
            sp,
            &gamma,
            &beta,
            (&mut rm, &mut rv),
            (&mut mean, &mut invstd),
            false,
            momentum,
            eps,
        );
        assert_near_pytorch(&y_eval, &floats(&c["y_eval"]), "batchnorm eval y");
    }
}

#[test]
fn batchnorm2d_gradients() {
    check_gradients(&image_job(r#"{ type = "batchnorm2d" }"#), images());
}

#[test]
fn batchnorm1d_gradients() {
    check_gradients(&between_linears(r#"{ type = "batchnorm1d" }"#), classes(3));
}

/// CUDA against the CPU on random inputs, with activations in f32 and in each half format:
/// training and evaluation, forward and backward.
#[test]
fn batchnorm_on_cuda_matches_the_cpu() {
    let Some(g) = gpu() else {
        return;
    };
    let (g, cpu, n) = (&g, CpuBackend::new(2), 5);
    for storage in STORAGES {
        let (tol, at) = (tolerance(storage), format!("{storage:?}"));
        let (c, spatial) = (6, 49);
        let len = n * c * spatial;
        let (x, dy) = (random_vec(len, 26), random_vec(len, 27));
        let (x, dy) = (stored(storage, &x), stored(storage, &dy));
        let params = random_vec(2 * c, 28);
        let mut state0 = random_vec(4 * c, 29);
        state0[c..2 * c].iter_mut().for_each(|v| *v = v.abs() + 0.5); // a running variance
        for train in [true, false] {
            let (mut st_cpu, mut y_cpu) = (state0.clone(), vec![f32::NAN; len]);
            cpu.batchnorm_forward(
                &x,
                &mut y_cpu,
                (n, c, spatial),
                &params,
                0,
                &mut st_cpu,
                train,
                0.1,
                1e-5,
            );
            let (mut st_gpu, mut yg) = (up(g, &state0), poisoned_in(g, storage, len));
            let (xg, pg) = (up_in(g, storage, &x), up(g, &params));
            g.batchnorm_forward(
                &xg,
                &mut yg,
                (n, c, spatial),
                &pg,
                0,
                &mut st_gpu,
                train,
                0.1,
                1e-5,
            );
            assert_within(
                &down(g, &yg, len),
                &stored(storage, &y_cpu),
                tol,
                &format!("{at} batch norm train={train}"),
            );
            assert_close(
                &down(g, &st_gpu, 4 * c),
                &st_cpu,
                &format!("{at} batch norm state train={train}"),
            );
            if train {
                let (mut gr_cpu, mut dx_cpu) = (vec![0.5; 2 * c], vec![f32::NAN; len]);
                cpu.batchnorm_backward(
                    &x,
                    &dy,
                    Some(&mut dx_cpu),
                    (n, c, spatial),
                    &params,
                    &mut gr_cpu,
                    0,
                    &st_cpu,
                );
                let (mut gr_gpu, mut dxg) = (up(g, &[0.5; 12]), poisoned_in(g, storage, len));
                g.batchnorm_backward(
                    &xg,
                    &up_in(g, storage, &dy),
                    Some(&mut dxg),
                    (n, c, spatial),
                    &pg,
                    &mut gr_gpu,
                    0,
                    &st_gpu,
                );
                assert_within(
                    &down(g, &dxg, len),
                    &stored(storage, &dx_cpu),
                    tol,
                    &format!("{at} batch norm dx"),
                );
                assert_close(
                    &down(g, &gr_gpu, 2 * c),
                    &gr_cpu,
                    &format!("{at} batch norm dgamma/dbeta"),
                );
            }
        }
    }
}
