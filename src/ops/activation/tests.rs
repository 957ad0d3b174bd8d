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
        Activation::Silu,
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

#[test]
fn silu_gradients() {
    check_gradients(&between_linears(r#"{ type = "silu" }"#), classes(3));
}

/// The vectorisable exp and erfc against f64 over grids, with their limits.
#[test]
fn vector_math_is_accurate() {
    use trainer::tensor::vector_math::{erfc, exp};
    let grid = (-2_000_000..=2_000_000).map(|i| i as f32 * 5e-6); // [-10, 10]
    let (mut exp_rel, mut erfc_rel) = (0.0f64, 0.0f64);
    for x in grid {
        // exp over [-87, 87]: past that its arguments are clamped.
        let at = x * 8.7;
        let e = (at as f64).exp();
        exp_rel = exp_rel.max(((exp(at) as f64) - e).abs() / e);
        // erfc over [-9, 3]. Its relative error grows to the right with f32's rounding of
        // x² (half an ulp of 9 is 5e-7 relative in e^(−x²)).
        let at = x * 0.9 - 6.0;
        let e = libm::erfc(at as f64);
        erfc_rel = erfc_rel.max((erfc(at) as f64 - e).abs() / e);
    }
    println!("relative errors: exp {exp_rel:e}, erfc {erfc_rel:e}");
    assert!(exp_rel < 3e-7, "exp's relative error {exp_rel}");
    assert!(erfc_rel < 2e-6, "erfc's relative error {erfc_rel}");
    assert_eq!(exp(0.0), 1.0);
    assert_eq!(exp(-1000.0), exp(-87.3));
    assert!(exp(-1000.0) < 1e-37);
    assert!(exp(f32::NAN).is_nan());
    assert!((erfc(0.0) - 1.0).abs() <= 2e-7);
    assert_eq!(erfc(-20.0), 2.0);
    assert!(erfc(20.0) < 1e-37);
}

/// GELU (both forms) and their derivatives against the definitions in f64.
#[test]
fn gelu_matches_its_definition() {
    let len = 20_001;
    let x: Vec<f32> = (0..len).map(|i| (i as f32 - 10_000.0) * 1e-3).collect();
    let dy = vec![1.0f32; len];
    let exact = |x: f64| 0.5 * x * (1.0 + libm::erf(x / 2f64.sqrt()));
    let tanh_form = |x: f64| {
        0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
    };
    for (f, reference) in [
        (Activation::Gelu, &exact as &dyn Fn(f64) -> f64),
        (Activation::GeluTanh, &tanh_form),
    ] {
        let (mut y, mut dx) = (vec![0.0; len], vec![0.0; len]);
        CPU.activation_forward(f, &x, &mut y, len);
        CPU.activation_backward(f, &x, &y, &dy, &mut dx, len);
        for i in 0..len {
            let v = x[i] as f64;
            let h = 1e-6;
            let slope = (reference(v + h) - reference(v - h)) / (2.0 * h);
            assert!(
                (y[i] as f64 - reference(v)).abs() < 1e-6,
                "{f:?}({v}) = {}",
                y[i]
            );
            assert!(
                (dx[i] as f64 - slope).abs() < 1e-5,
                "{f:?}'({v}) = {}",
                dx[i]
            );
        }
    }
}
