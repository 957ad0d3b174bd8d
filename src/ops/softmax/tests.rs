//! softmax's tests. The library does not compile this file: tests/suite/ops.rs does, so
//! that its CUDA tests run on the emulated GPU with the rest.

use crate::common::random_vec;
use crate::cuda_parity::{
    assert_within, down, gpu, poisoned_in, stored, tolerance, up_in, STORAGES,
};
use crate::gradients::check_gradients;
use trainer::graph::DataShape;
use trainer::ops::softmax::Kernels;
use trainer::tensor::cpu::CpuBackend;

const CPU: CpuBackend = CpuBackend::new(1);

#[test]
fn softmax_and_log_softmax_gradients() {
    // mse on softmax outputs (probabilities as a regression target).
    let data = DataShape {
        sample_shape: vec![4],
        classes: None,
        classes_from: None,
        target_dim: 3,
    };
    for kind in ["softmax", "log_softmax"] {
        let job = format!(
            r#"
            [data]
            source = "synthetic"
            task = "regression"
            [model]
            layers = [{{ type = "linear", out = 6 }}, {{ type = "tanh" }}, {{ type = "linear", out = 3 }},
                      {{ type = "{kind}" }}]
            [loss]
            type = "mse"
            [optimizer]
            type = "sgd"
            lr = 0.1
            "#
        );
        check_gradients(&job, data.clone());
    }
}

/// CUDA against the CPU on random inputs, with activations in f32 and in each half format.
#[test]
fn softmax_on_cuda_matches_the_cpu() {
    let Some(g) = gpu() else {
        return;
    };
    let g = &g;
    for storage in STORAGES {
        let (tol, at) = (tolerance(storage), format!("{storage:?}"));
        // softmax / log_softmax, forward and backward, on wide and narrow rows.
        for (rows, width) in [(64, 10), (3, 1000)] {
            let x: Vec<f32> = random_vec(rows * width, 34)
                .iter()
                .map(|v| v * 4.0)
                .collect();
            let (x, dy) = (
                stored(storage, &x),
                stored(storage, &random_vec(rows * width, 35)),
            );
            for log in [false, true] {
                let what = format!("{at} softmax log={log} {rows}x{width}");
                let mut y_cpu = vec![f32::NAN; x.len()];
                CPU.softmax_forward(&x, &mut y_cpu, rows, width, log);
                let y_cpu = stored(storage, &y_cpu);
                let mut y_gpu = poisoned_in(g, storage, x.len());
                g.softmax_forward(&up_in(g, storage, &x), &mut y_gpu, rows, width, log);
                assert_within(
                    &down(g, &y_gpu, x.len()),
                    &y_cpu,
                    tol,
                    &format!("{what} forward"),
                );
                // Both read the CPU's (rounded) output.
                let mut dx_cpu = vec![f32::NAN; x.len()];
                CPU.softmax_backward(&y_cpu, &dy, &mut dx_cpu, rows, width, log);
                let mut dx_gpu = poisoned_in(g, storage, x.len());
                let (yg, dyg) = (up_in(g, storage, &y_cpu), up_in(g, storage, &dy));
                g.softmax_backward(&yg, &dyg, &mut dx_gpu, rows, width, log);
                let dx_cpu = stored(storage, &dx_cpu);
                assert_within(
                    &down(g, &dx_gpu, x.len()),
                    &dx_cpu,
                    tol,
                    &format!("{what} backward"),
                );
            }
        }
    }
}
