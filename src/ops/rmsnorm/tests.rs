//! rmsnorm's tests. The library does not compile this file: tests/suite/main.rs does, as
//! `ops::rmsnorm`, so that its CUDA tests run on the emulated GPU with the rest.

use crate::common::random_vec;
use crate::cuda_parity::{
    assert_close, assert_within, down, gpu, loss_curve, poisoned_in, stored, tolerance, up, up_in,
    STORAGES,
};
use crate::gradients::{check_gradients, image_job, images, sequence_job, sequences};
use trainer::ops::rmsnorm::Kernels;
use trainer::tensor::cpu::CpuBackend;
use trainer::tensor::Backend;

const CPU: CpuBackend = CpuBackend::new(1);

/// PyTorch's nn.RMSNorm in f64: x / sqrt(mean(x²) + eps) · γ.
fn by_definition(x: &[f32], width: usize, gamma: &[f32], eps: f32) -> Vec<f32> {
    let mut y = Vec::new();
    for row in x.chunks(width) {
        let mean_square = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / width as f64;
        let inv = 1.0 / (mean_square + eps as f64).sqrt();
        y.extend(
            row.iter()
                .zip(gamma)
                .map(|(&v, &g)| (v as f64 * inv * g as f64) as f32),
        );
    }
    y
}

#[test]
fn rmsnorm_is_pytorchs_definition() {
    let (rows, width, eps) = (7, 33, f32::EPSILON);
    let (x, gamma) = (random_vec(rows * width, 1), random_vec(width, 2));
    let (mut y, mut saved) = (vec![f32::NAN; rows * width], vec![f32::NAN; rows]);
    CPU.rmsnorm_forward(&x, &mut y, (rows, width), &gamma, 0, &mut saved, eps);
    let want = by_definition(&x, width, &gamma, eps);
    for (i, (a, b)) in y.iter().zip(&want).enumerate() {
        assert!(
            (a - b).abs() <= 1e-6 * b.abs().max(1.0),
            "value {i}: {a} vs {b}"
        );
    }
}

#[test]
fn rmsnorm_gradients() {
    check_gradients(&image_job(r#"{ type = "rmsnorm" }"#), images());
    check_gradients(
        &sequence_job(r#"{ type = "rmsnorm", eps = 1e-6 }, { type = "linear", out = 2 }"#),
        sequences(),
    );
}

/// CUDA against the CPU on random inputs, with activations in f32 and in each half format.
#[test]
fn rmsnorm_on_cuda_matches_the_cpu() {
    let Some(g) = gpu() else {
        return;
    };
    let (rows, width) = (37, 300);
    for storage in STORAGES {
        let at = format!("{storage:?}");
        let x = stored(storage, &random_vec(rows * width, 30));
        let dy = stored(storage, &random_vec(rows * width, 31));
        let params = random_vec(width, 32);
        let (mut y, mut saved) = (vec![f32::NAN; rows * width], vec![0.0; rows]);
        CPU.rmsnorm_forward(&x, &mut y, (rows, width), &params, 0, &mut saved, 1e-6);
        let (xg, pg) = (up_in(&g, storage, &x), up(&g, &params));
        let (mut saved_g, mut yg) = (
            g.alloc(rows).unwrap(),
            poisoned_in(&g, storage, rows * width),
        );
        g.rmsnorm_forward(&xg, &mut yg, (rows, width), &pg, 0, &mut saved_g, 1e-6);
        let tol = tolerance(storage);
        assert_within(
            &down(&g, &yg, rows * width),
            &stored(storage, &y),
            tol,
            &format!("{at} forward"),
        );

        let (mut grads, mut dx) = (vec![0.5; width], vec![f32::NAN; rows * width]);
        let shape = (rows, width);
        CPU.rmsnorm_backward(
            &x,
            &dy,
            Some(&mut dx),
            shape,
            &params,
            &mut grads,
            0,
            &saved,
        );
        let (mut grads_g, mut dxg) = (
            up(&g, &vec![0.5; width]),
            poisoned_in(&g, storage, rows * width),
        );
        let dyg = up_in(&g, storage, &dy);
        g.rmsnorm_backward(
            &xg,
            &dyg,
            Some(&mut dxg),
            shape,
            &pg,
            &mut grads_g,
            0,
            &saved_g,
        );
        assert_within(
            &down(&g, &dxg, rows * width),
            &stored(storage, &dx),
            tol,
            &format!("{at} dx"),
        );
        assert_close(
            &down(&g, &grads_g, width),
            &grads,
            &format!("{at} dgamma, added"),
        );
    }
}

/// A model over sequences with rmsnorm trains on CUDA as on the CPU.
#[test]
fn an_rmsnorm_job_on_cuda_follows_the_cpu_loss_curve() {
    if gpu().is_none() {
        return;
    }
    let layers = "model.layers=[{type=\"linear\",out=16},{type=\"rmsnorm\"},{type=\"gelu\"},\
                  {type=\"flatten\"},{type=\"linear\",out=10}]";
    let extra = ["--set", "model.input_shape=[8,8]", "--set", layers];
    let (cpu, cuda) = (loss_curve("cpu", &extra), loss_curve("cuda", &extra));
    assert_eq!(cpu.len(), 100);
    for ((step, a), (_, b)) in cpu.iter().zip(&cuda) {
        assert!(
            (a - b).abs() <= 1e-4 * a.abs(),
            "step {step}: cpu loss {a} vs cuda {b}"
        );
    }
}
