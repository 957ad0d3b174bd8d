//! dropout's tests. The library does not compile this file: tests/suite/ops.rs does, so
//! that its CUDA tests run on the emulated GPU with the rest.

use crate::common::random_vec;
use crate::cuda_parity::{assert_close, down, gpu, poisoned, up};
use crate::gradients::{between_linears, check_gradients, classes};
use trainer::ops::dropout::Kernels;
use trainer::tensor::cpu::CpuBackend;

const CPU: CpuBackend = CpuBackend::new(1);

#[test]
fn dropout_draws_the_same_mask_as_the_cpu() {
    let Some(g) = gpu() else { return };
    let len = 50_001;
    let x = random_vec(len, 7);
    // A nonzero `first` is a data-parallel replica's share of a micro-batch.
    for (p, key, first) in [
        (0.1f32, 1u64, 0u64),
        (0.5, 0xdead_beef_1234, 12_345),
        (0.9, u64::MAX, 7),
    ] {
        let mut y_cpu = vec![0.0; len];
        CPU.dropout_forward(p, key, first, &x, &mut y_cpu, len);
        let mut yg = poisoned(&g, len);
        g.dropout_forward(p, key, first, &up(&g, &x), &mut yg, len);
        let y_gpu = down(&g, &yg, len);
        assert_eq!(
            y_gpu.iter().map(|v| *v == 0.0).collect::<Vec<_>>(),
            y_cpu.iter().map(|v| *v == 0.0).collect::<Vec<_>>()
        );
        assert_close(&y_gpu, &y_cpu, &format!("dropout p={p}"));
        let mut in_place = up(&g, &x);
        g.dropout_in_place(p, key, first, &mut in_place, len);
        assert_close(
            &down(&g, &in_place, len),
            &y_cpu,
            &format!("dropout in place p={p}"),
        );
        let mut dx_cpu = vec![0.0; len];
        CPU.dropout_backward(p, key, first, &x, &mut dx_cpu, len);
        let mut dxg = poisoned(&g, len);
        g.dropout_backward(p, key, first, &up(&g, &x), &mut dxg, len);
        assert_close(
            &down(&g, &dxg, len),
            &dx_cpu,
            &format!("dropout backward p={p}"),
        );
    }
}

#[test]
fn dropout_gradients_use_the_same_mask_as_forward() {
    check_gradients(
        &between_linears(r#"{ type = "dropout", p = 0.4 }"#),
        classes(3),
    );
}
