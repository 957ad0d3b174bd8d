//! activation's tests. The library does not compile this file: tests/suite/ops.rs does, so
//! that its CUDA tests run on the emulated GPU with the rest.

use crate::common::random_vec;
use crate::cuda_parity::{assert_close, down, gpu, poisoned, up};
use crate::gradients::{between_linears, check_gradients, classes};
use trainer::ops::activation::Kernels;
use trainer::tensor::cpu::CpuBackend;
use trainer::tensor::Activation;

const CPU: CpuBackend = CpuBackend::new(1);

#[test]
fn activations_forward_and_backward_match_the_cpu() {
    let Some(g) = gpu() else { return };
    let len = 10_007;
    let x: Vec<f32> = random_vec(len, 5).iter().map(|v| v * 3.0).collect();
    let dy = random_vec(len, 6);
    for f in [
        Activation::Relu,
        Activation::Gelu,
        Activation::GeluTanh,
        Activation::Tanh,
        Activation::Sigmoid,
    ] {
        let mut y_cpu = vec![0.0; len];
        CPU.activation_forward(f, &x, &mut y_cpu, len);
        let (xg, mut yg) = (up(&g, &x), poisoned(&g, len));
        g.activation_forward(f, &xg, &mut yg, len);
        assert_close(&down(&g, &yg, len), &y_cpu, &format!("{f:?} forward"));
        let mut dx_cpu = vec![0.0; len];
        CPU.activation_backward(f, &x, &y_cpu, &dy, &mut dx_cpu, len);
        let mut dxg = poisoned(&g, len);
        g.activation_backward(f, &xg, &yg, &up(&g, &dy), &mut dxg, len);
        assert_close(&down(&g, &dxg, len), &dx_cpu, &format!("{f:?} backward"));
        let mut in_place = up(&g, &x);
        g.activation_in_place(f, &mut in_place, len);
        assert_close(
            &down(&g, &in_place, len),
            &y_cpu,
            &format!("{f:?} in place"),
        );
    }
}

#[test]
fn relu_gradients() {
    check_gradients(&between_linears(r#"{ type = "relu" }"#), classes(3));
}

#[test]
fn gelu_gradients() {
    check_gradients(&between_linears(r#"{ type = "gelu" }"#), classes(3));
}

#[test]
fn gelu_tanh_gradients() {
    check_gradients(
        &between_linears(r#"{ type = "gelu", approximate = "tanh" }"#),
        classes(3),
    );
}

#[test]
fn tanh_gradients() {
    check_gradients(&between_linears(r#"{ type = "tanh" }"#), classes(3));
}

#[test]
fn sigmoid_gradients() {
    check_gradients(&between_linears(r#"{ type = "sigmoid" }"#), classes(3));
}
