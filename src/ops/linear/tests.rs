//! linear's tests. The library does not compile this file: tests/suite/ops.rs does, so
//! that its CUDA tests run on the emulated GPU with the rest.

use crate::common::{random_vec, spec};
use crate::cuda_parity::{assert_close, down, gpu, poisoned, stale_grads, up};
use crate::gradients::{between_linears, check_gradients, check_gradients_on, classes};
use trainer::graph::{DataShape, Graph};
use trainer::ops::linear::Kernels;
use trainer::tensor::cpu::CpuBackend;
use trainer::tensor::{Activation, Backend, GradWrite, HalfKind};

const CPU: CpuBackend = CpuBackend::new(1);

/// fp32 GEMMs, and in mixed precision the tensor-core GEMMs (inputs converted to f16/bf16,
/// f32 accumulation): on half-valued inputs the products are exact, so only the order of
/// the sums differs from the CPU's fp32.
#[test]
fn linear_forward_and_backward_match_the_cpu() {
    let Some(g) = gpu() else { return };
    let halves = [None, Some(HalfKind::F16), Some(HalfKind::Bf16)];
    for (half, (n, inp, out)) in halves
        .into_iter()
        .flat_map(|h| [(37, 53, 29), (256, 784, 256), (1, 7, 3)].map(|s| (h, s)))
    {
        g.set_half_matmuls(half);
        let modes = [GradWrite::Add, GradWrite::Overwrite];
        for (bias, dw_write) in [true, false]
            .into_iter()
            .flat_map(|b| modes.map(|m| (b, m)))
        {
            let mut params = random_vec(out * inp + out, 1);
            let b = bias.then_some(out * inp);
            let mut x = random_vec(n * inp, 2);
            let mut dy = random_vec(n * out, 3);
            if let Some(kind) = half {
                for v in [&mut params, &mut x, &mut dy] {
                    let len = v.len();
                    CPU.round_to_half(kind, v, len);
                }
            }
            let written = out * inp + if bias { out } else { 0 };
            let grads0 = stale_grads(random_vec(params.len(), 4), written, dw_write);
            let what = format!("linear {half:?} n={n} in={inp} out={out} bias={bias} {dw_write:?}");

            // With the ReLU after it too, which fp32 applies in cuBLASLt's epilogue where the
            // bias's address allows (shape 2: 16-byte aligned; 1 and 3 not).
            let mut linear = Vec::new();
            for then in [None, Some(Activation::Relu)] {
                let mut y_cpu = vec![f32::NAN; n * out];
                CPU.linear_forward(&x, &params, 0, b, &mut y_cpu, n, inp, out, then);
                let mut y_gpu = poisoned(&g, n * out);
                let (xg, pg) = (up(&g, &x), up(&g, &params));
                g.linear_forward(&xg, &pg, 0, b, &mut y_gpu, n, inp, out, then);
                let what = format!("{what} forward, then {then:?}");
                assert_close(&down(&g, &y_gpu, n * out), &y_cpu, &what);
                linear.push(y_cpu);
            }
            let relu: Vec<f32> = linear[0].iter().map(|v| v.max(0.0)).collect();
            assert_eq!(linear[1], relu, "{what}: the CPU's ReLU after the product");

            let (mut grads_cpu, mut dx_cpu) = (grads0.clone(), vec![f32::NAN; n * inp]);
            CPU.linear_backward(
                &x,
                &dy,
                &params,
                &mut grads_cpu,
                dw_write,
                0,
                b,
                Some(&mut dx_cpu),
                n,
                inp,
                out,
            );
            let (mut grads_gpu, mut dx_gpu) = (up(&g, &grads0), poisoned(&g, n * inp));
            g.linear_backward(
                &up(&g, &x),
                &up(&g, &dy),
                &up(&g, &params),
                &mut grads_gpu,
                dw_write,
                0,
                b,
                Some(&mut dx_gpu),
                n,
                inp,
                out,
            );
            assert_close(
                &down(&g, &grads_gpu, params.len()),
                &grads_cpu,
                &format!("{what} dW/db"),
            );
            assert_close(&down(&g, &dx_gpu, n * inp), &dx_cpu, &format!("{what} dx"));
        }
    }
    g.set_half_matmuls(None);
}

#[test]
fn linear_gradients() {
    check_gradients(
        &between_linears(r#"{ type = "linear", out = 5 }"#),
        classes(3),
    );
}

#[test]
fn linear_without_bias_gradients() {
    check_gradients(
        &between_linears(r#"{ type = "linear", out = 5, bias = false }"#),
        classes(3),
    );
}

/// A language model's output layer tied to its token embedding: one matrix, its gradient
/// the sum of both uses, counted once.
const TIED_JOB: &str = r#"
    [data]
    source = "synthetic"
    [model]
    layers = [
      { type = "embedding", num_embeddings = 7, embedding_dim = 3, name = "wte" },
      { type = "tanh" },
      { type = "linear", out = 7, bias = false, tied_to = "wte", name = "lm_head" },
    ]
    [optimizer]
    type = "sgd"
    lr = 0.1
"#;

fn token_sequences() -> DataShape {
    DataShape {
        sample_shape: vec![4],
        classes: Some(7),
        classes_from: None,
        target_dim: 4,
    }
}

#[test]
fn a_tied_weight_is_one_matrix_with_the_gradient_of_both_uses() {
    let graph = Graph::build(&spec(TIED_JOB), &token_sequences()).unwrap();
    assert_eq!(graph.parameter_count(), 21);
    let names: Vec<(String, usize)> = (graph.state_dict_entries().into_iter())
        .map(|e| (e.name, e.offset))
        .collect();
    assert_eq!(
        names,
        [
            ("wte.weight".to_string(), 0),
            ("lm_head.weight".to_string(), 0)
        ]
    );
    let ids: Vec<f32> = (0..20).map(|i| ((i * 3) % 7) as f32).collect();
    check_gradients_on(TIED_JOB, token_sequences(), Some(&ids));
}

#[test]
fn a_tied_weight_must_name_an_earlier_embedding_of_its_shape() {
    let cases = [
        (
            "tied_to = \"wte\", out = 5",
            "its table is [7, 3], but this layer's weight is [out, in] = [5, 3]",
        ),
        (
            "tied_to = \"act\", out = 7",
            "that layer is not an embedding",
        ),
        (
            "tied_to = \"nope\", out = 7",
            "no earlier layer has that name",
        ),
    ];
    for (settings, expected) in cases {
        let job = TIED_JOB
            .replace("{ type = \"tanh\" }", "{ type = \"tanh\", name = \"act\" }")
            .replace("out = 7, bias = false, tied_to = \"wte\"", settings);
        let e = Graph::build(&spec(&job), &token_sequences())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(expected) && e.contains("model.layers[2] (linear)"),
            "{e}"
        );
    }
}
