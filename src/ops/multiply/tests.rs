//! multiply's tests. The library does not compile this file: tests/suite/ops.rs does, so
//! that its CUDA tests run on the emulated GPU with the rest.

use crate::common::random_vec;
use crate::cuda_parity::STORAGES;
use crate::cuda_parity::{assert_within, down, gpu, poisoned_in, stored, tolerance, up_in};
use crate::gradients::{check_gradients, classes};
use trainer::ops::multiply::Kernels;
use trainer::tensor::cpu::CpuBackend;

const CPU: CpuBackend = CpuBackend::new(1);

fn job(layers: &str) -> String {
    format!(
        r#"
        [data]
        source = "synthetic"
        [model]
        layers = [{layers}]
        [optimizer]
        type = "sgd"
        lr = 0.1
        "#
    )
}

/// Llama's gated MLP: down(silu(gate(x)) · up(x)).
#[test]
fn gated_mlp_gradients() {
    check_gradients(
        &job(r#"
          { type = "linear", out = 6, name = "gate" },
          { type = "silu", name = "act" },
          { type = "linear", out = 6, inputs = ["input"], name = "up" },
          { type = "multiply", inputs = ["act", "up"] },
          { type = "linear", out = 3 },
        "#),
        classes(3),
    );
}

/// A square (one input read twice) whose input another layer reads too: the gradients of
/// both reads and of the add are summed.
#[test]
fn a_square_and_a_shared_input_gradients() {
    check_gradients(
        &job(r#"
          { type = "linear", out = 6 },
          { type = "tanh", name = "a" },
          { type = "multiply", inputs = ["a", "a"], name = "square" },
          { type = "add", inputs = ["square", "a"] },
          { type = "linear", out = 3 },
        "#),
        classes(3),
    );
}

#[test]
fn multiply_is_the_elementwise_product_and_its_gradient_adds() {
    let len = 1000;
    let (a, b, dy) = (random_vec(len, 1), random_vec(len, 2), random_vec(len, 3));
    let mut y = vec![f32::NAN; len];
    CPU.multiply(&a, &b, &mut y, len);
    let mut dx = vec![f32::NAN; len];
    CPU.multiply_backward(&dy, &b, &mut dx, len, false);
    let mut added = vec![0.5; len];
    CPU.multiply_backward(&dy, &b, &mut added, len, true);
    for i in 0..len {
        assert_eq!(y[i], a[i] * b[i]);
        assert_eq!(dx[i], dy[i] * b[i]);
        assert_eq!(added[i], 0.5 + dy[i] * b[i]);
    }
}

/// CUDA against the CPU on random inputs, in f32 and in each half format, over a length
/// that leaves a tail past the vectorised part.
#[test]
fn multiply_on_cuda_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    let len = 10_007;
    for storage in STORAGES {
        let at = format!("{storage:?}");
        let [a, b, dy, acc] = [1, 2, 3, 4].map(|seed| stored(storage, &random_vec(len, seed)));
        let tol = tolerance(storage);
        let mut y = vec![0.0; len];
        CPU.multiply(&a, &b, &mut y, len);
        let (ag, bg) = (up_in(&g, storage, &a), up_in(&g, storage, &b));
        let mut yg = poisoned_in(&g, storage, len);
        g.multiply(&ag, &bg, &mut yg, len);
        assert_within(&down(&g, &yg, len), &stored(storage, &y), tol, &at);
        for add in [false, true] {
            let mut dx = acc.clone();
            CPU.multiply_backward(&dy, &b, &mut dx, len, add);
            let mut dxg = match add {
                true => up_in(&g, storage, &acc),
                false => poisoned_in(&g, storage, len),
            };
            g.multiply_backward(&up_in(&g, storage, &dy), &bg, &mut dxg, len, add);
            let what = format!("{at} backward, add {add}");
            assert_within(&down(&g, &dxg, len), &stored(storage, &dx), tol, &what);
        }
    }
}
