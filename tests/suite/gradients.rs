//! Gradient checks: every layer and every loss, analytic gradients against central finite
//! differences of the loss, on random inputs.

use crate::common;

use common::{network, network_with, random_vec, spec};
use trainer::graph::{DataShape, Network, Op};
use trainer::ops::activation::Kernels as _;
use trainer::ops::dropout::Kernels as _;
use trainer::tensor::cpu::CpuBackend;
use trainer::tensor::{Backend, HalfKind};

const N: usize = 5;
const STEP_KEY: u64 = 3;

fn mean_loss(net: &mut Network<CpuBackend>, b: &CpuBackend) -> f64 {
    let mut stats = b.new_stats().unwrap();
    net.forward(b, N, true, STEP_KEY);
    net.loss(b, N, None, &mut stats);
    stats.loss_sum / stats.samples
}

/// Compares d(loss)/d(param) with (L(p+h) - L(p-h)) / 2h for every parameter.
pub(crate) fn check_gradients(job: &str, data: DataShape) {
    check_gradients_on(job, data, None);
}

/// One training step's parameter gradients over the network's N samples (a single
/// `backward_pass`).
fn gradients(b: &CpuBackend, net: &mut Network<CpuBackend>) -> Vec<f32> {
    backward_pass(net, b, true);
    net.finish_gradients(b);
    net.grads.clone()
}

/// The same, with the given input batch instead of random values (token ids).
pub(crate) fn check_gradients_on(job: &str, data: DataShape, input: Option<&[f32]>) {
    let b = CpuBackend::new(1);
    let spec = spec(job);
    let mut net = network(&spec, &data, N, 7);
    if let Some(input) = input {
        net.set_input(&b, input);
    }
    let analytic = gradients(&b, &mut net);
    assert!(
        analytic.iter().any(|&g| g.abs() > 1e-4),
        "gradients are all ~0: nothing checked"
    );

    let h = 1e-3f32;
    for (i, &a) in analytic.iter().enumerate() {
        let original = net.params[i];
        net.params[i] = original + h;
        let up = mean_loss(&mut net, &b);
        net.params[i] = original - h;
        let down = mean_loss(&mut net, &b);
        net.params[i] = original;
        let numeric = (up - down) / (2.0 * h as f64);
        let a = a as f64;
        let error = (a - numeric).abs() / (a.abs().max(numeric.abs()) * 1e-2 + 2e-4);
        assert!(
            error <= 1.0,
            "param {i}: analytic {a:.6} vs numeric {numeric:.6}\n{job}"
        );
    }
}

pub(crate) fn between_linears(layer: &str) -> String {
    format!(
        r#"
        [data]
        source = "synthetic"
        [model]
        layers = [{{ type = "linear", out = 6 }}, {layer}, {{ type = "linear", out = 3 }}]
        [optimizer]
        type = "sgd"
        lr = 0.1
        "#
    )
}

pub(crate) fn classes(n: usize) -> DataShape {
    DataShape {
        sample_shape: vec![4],
        classes: Some(n),
        classes_from: None,
        target_dim: 1,
    }
}

/// ReLU, tanh, sigmoid and dropout run in place where the buffer plan allows it (see
/// `BufferPlan::in_place`): the same bits as writing to another buffer, in the chunked
/// parallel path (over 2^16 values) and the short one.
#[test]
fn in_place_activations_and_dropout_equal_their_out_of_place_forms() {
    use trainer::tensor::Activation;
    let b = CpuBackend::new(2);
    for len in [1000, 100_003] {
        let x: Vec<f32> = (0..len)
            .map(|i| ((i * 7919) % 2001) as f32 / 250.0 - 4.0)
            .collect();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for f in [Activation::Relu, Activation::Tanh, Activation::Sigmoid] {
            let (mut y, mut in_place) = (vec![f32::NAN; len], x.clone());
            b.activation_forward(f, &x, &mut y, len);
            b.activation_in_place(f, &mut in_place, len);
            assert_eq!(bits(&in_place), bits(&y), "{f:?}, {len} values");
        }
        let (mut y, mut in_place) = (vec![f32::NAN; len], x.clone());
        b.dropout_forward(0.3, 11, 5, &x, &mut y, len);
        b.dropout_in_place(0.3, 11, 5, &mut in_place, len);
        assert_eq!(bits(&in_place), bits(&y), "dropout, {len} values");
    }
}

#[test]
fn flatten_gradients() {
    let job = between_linears(r#"{ type = "flatten" }"#).replace(
        r#"layers = [{ type = "linear""#,
        r#"layers = [{ type = "flatten" }, { type = "linear""#,
    );
    check_gradients(
        &job,
        DataShape {
            sample_shape: vec![2, 2],
            classes: Some(3),
            classes_from: None,
            target_dim: 1,
        },
    );
}

fn loss_job(loss: &str) -> String {
    format!(
        r#"
        [data]
        source = "synthetic"
        [model]
        layers = [{{ type = "linear", out = 3 }}]
        [loss]
        {loss}
        [optimizer]
        type = "sgd"
        lr = 0.1
        "#
    )
}

#[test]
fn cross_entropy_gradients() {
    check_gradients(&loss_job(r#"type = "cross_entropy""#), classes(3));
}

#[test]
fn cross_entropy_with_label_smoothing_gradients() {
    check_gradients(
        &loss_job("type = \"cross_entropy\"\nlabel_smoothing = 0.2"),
        classes(3),
    );
}

/// Positions whose label is loss.ignore_index add nothing; the mean is over the others.
#[test]
fn cross_entropy_with_an_ignored_class_gradients() {
    let job = format!("{PER_POSITION_JOB}\n[loss]\nignore_index = 2\nlabel_smoothing = 0.1");
    check_gradients(&job, labelled_sequences());
}

/// An ignored class with any other loss, or past the classes, is refused.
#[test]
fn an_ignore_index_that_cannot_apply_is_refused() {
    let cases = [
        (
            "type = \"mse\"\nignore_index = 1",
            "key `loss.ignore_index`: only applies to type = \"cross_entropy\"",
        ),
        (
            "ignore_index = 3",
            "loss.ignore_index = 3 is no class: the data has 3 (0..2)",
        ),
    ];
    for (loss, needle) in cases {
        let job = format!(
            "[data]\nsource = \"synthetic\"\nclasses = 3\n[model]\nlayers = [{{ type = \"linear\", out = 3 }}]\n\
             [loss]\n{loss}\n[optimizer]\ntype = \"sgd\"\nlr = 0.1\n"
        );
        crate::common::expect_error(&job, &["check", "JOB"], 2, &[needle]);
    }
}

/// PyTorch allows label_smoothing = 1: the target is the uniform distribution alone.
#[test]
fn cross_entropy_with_full_label_smoothing_gradients() {
    check_gradients(
        &loss_job("type = \"cross_entropy\"\nlabel_smoothing = 1.0"),
        classes(3),
    );
}

#[test]
fn mse_gradients() {
    let data = DataShape {
        sample_shape: vec![4],
        classes: None,
        classes_from: None,
        target_dim: 3,
    };
    check_gradients(&loss_job(r#"type = "mse""#), data);
}

#[test]
fn bce_with_logits_gradients() {
    let data = DataShape {
        sample_shape: vec![4],
        classes: None,
        classes_from: None,
        target_dim: 3,
    };
    check_gradients(&loss_job(r#"type = "bce_with_logits""#), data);
}

/// An image model: input [2, 6, 5] samples, `middle` between a conv and the classifier.
/// A classifier: `first`, then `middle`, flattened to 3 classes.
fn classifier_job(first: &str, middle: &str) -> String {
    format!(
        r#"
        [data]
        source = "synthetic"
        [model]
        layers = [
          {first},
          {middle},
          {{ type = "flatten" }},
          {{ type = "linear", out = 3 }},
        ]
        [optimizer]
        type = "sgd"
        lr = 0.1
        "#
    )
}

pub(crate) fn image_job(middle: &str) -> String {
    classifier_job(
        r#"{ type = "conv2d", out = 4, kernel_size = 3, padding = 1 }"#,
        middle,
    )
}

pub(crate) fn images() -> DataShape {
    DataShape {
        sample_shape: vec![2, 6, 5],
        classes: Some(3),
        classes_from: None,
        target_dim: 1,
    }
}

#[test]
fn conv2d_gradients() {
    check_gradients(
        &image_job(
            r#"{ type = "conv2d", out = 4, kernel_size = [3, 2], stride = [2, 1], padding = [1, 0], groups = 2 }"#,
        ),
        images(),
    );
}

#[test]
fn dilated_conv2d_without_bias_gradients() {
    check_gradients(
        &image_job(r#"{ type = "conv2d", out = 3, kernel_size = 2, dilation = 2, bias = false }"#),
        images(),
    );
}

#[test]
fn reshape_gradients() {
    check_gradients(
        &image_job(
            r#"{ type = "reshape", shape = [2, -1, 5] }, { type = "conv2d", out = 2, kernel_size = 1 }"#,
        ),
        images(),
    );
}

/// A pooling straight after a ReLU takes the gradient through both in one step
/// (`BufferPlan::through_relu`): the 2x2 AVX-512 path, the general max path and average.
#[test]
fn relu_then_pooling_gradients() {
    for pool in [
        r#"{ type = "maxpool2d", kernel_size = 2 }"#,
        r#"{ type = "maxpool2d", kernel_size = 3, stride = 2, padding = 1 }"#,
        r#"{ type = "avgpool2d", kernel_size = 2 }"#,
    ] {
        let job = image_job(&format!(r#"{{ type = "relu" }}, {pool}"#));
        let plan = network(&spec(&job), &images(), N, 7).graph.buffer_plan();
        assert_eq!(plan.through_relu, [false, false, true, false, false]);
        check_gradients(&job, images());
    }
}

/// The same gradients, to the bit, as with the ReLU's own backward step: a dropout of p = 0
/// between the two (a copy) keeps them apart. In fp32 and in mixed precision, where the
/// gradient is rounded to bf16 along the way.
#[test]
fn a_relu_taken_through_by_its_pooling_gives_the_gradients_of_its_own_step() {
    let relu = r#"{ type = "relu" }"#;
    for pool in [
        r#"{ type = "maxpool2d", kernel_size = 2 }"#,
        r#"{ type = "maxpool2d", kernel_size = 3, stride = 2, padding = 1 }"#,
        r#"{ type = "avgpool2d", kernel_size = 2 }"#,
    ] {
        let fused = image_job(&format!("{relu}, {pool}"));
        let apart = image_job(&format!(
            r#"{relu}, {{ type = "dropout", p = 0.0 }}, {pool}"#
        ));
        // Dropout has no parameters: both take the same ones.
        let params = network(&spec(&fused), &images(), N, 7).params;
        for half in [None, Some(HalfKind::Bf16)] {
            let grads = |job: &str| {
                let b = CpuBackend::new(1);
                let mut net = network_with(&spec(job), &images(), N, 7, half, Some(&params));
                let bits: Vec<u32> = gradients(&b, &mut net)
                    .iter()
                    .map(|g| g.to_bits())
                    .collect();
                (bits, net.graph.buffer_plan().through_relu.contains(&true))
            };
            let ((fused_grads, taken), (apart_grads, not_taken)) = (grads(&fused), grads(&apart));
            assert!(
                taken && !not_taken,
                "{pool}: the plans differ in the fusion alone"
            );
            assert_eq!(fused_grads, apart_grads, "{pool}, {half:?}");
        }
    }
}

/// A residual block whose branch point feeds three layers (the add, the branch, a concat),
/// one input read twice by the same add, and a concat with the data itself: gradients of
/// every value read by several layers are summed.
const RESIDUAL_GRAPH: &str = r#"
[data]
source = "synthetic"
[model]
layers = [
  { type = "linear", out = 6, name = "stem" },
  { type = "tanh", name = "a" },
  { type = "linear", out = 6 },
  { type = "gelu", name = "branch" },
  { type = "add", inputs = ["branch", "a", "a"], name = "sum" },
  { type = "concat", inputs = ["sum", "a", "input"] },
  { type = "linear", out = 3 },
]
[optimizer]
type = "sgd"
lr = 0.1
"#;

#[test]
fn residual_and_concat_graph_gradients() {
    check_gradients(RESIDUAL_GRAPH, classes(3));
}

/// Smooth activations: after batch norm many values sit near 0, where ReLU's kink makes
/// finite differences meaningless.
#[test]
fn image_residual_block_with_batch_norm_gradients() {
    check_gradients(
        r#"
        [data]
        source = "synthetic"
        [model]
        layers = [
          { type = "conv2d", out = 4, kernel_size = 3, padding = 1, name = "stem" },
          { type = "batchnorm2d" },
          { type = "tanh", name = "x" },
          { type = "conv2d", out = 4, kernel_size = 3, padding = 1, bias = false },
          { type = "batchnorm2d", name = "bn" },
          { type = "add", inputs = ["bn", "x"] },
          { type = "gelu" },
          { type = "global_avg_pool" },
          { type = "flatten" },
          { type = "linear", out = 3 },
        ]
        [optimizer]
        type = "sgd"
        lr = 0.1
        "#,
        images(),
    );
}

/// The gradients of one backward pass: the step's first (`start_gradients`), over a buffer
/// of NaN as a training step leaves it (the first pass writes the linear and conv gradients
/// and zeroes the rest, so nothing there is read), or one more (adding to what is there).
fn backward_pass(net: &mut Network<CpuBackend>, b: &CpuBackend, first: bool) {
    if first {
        b.fill(&mut net.grads, f32::NAN);
        net.start_gradients();
    }
    let mut stats = b.new_stats().unwrap();
    net.forward(b, N, true, STEP_KEY);
    net.loss(b, N, Some(1.0), &mut stats);
    net.backward(b, N, STEP_KEY);
}

#[test]
fn a_steps_later_backward_passes_add_to_the_first() {
    // Every kind of parameter gradient: conv and linear weights and biases (written by the
    // first pass), batch and layer norm's (zeroed by it first).
    let job = image_job(
        r#"{ type = "batchnorm2d" }, { type = "tanh" }, { type = "conv2d", out = 2, kernel_size = 3 },
           { type = "layernorm" }"#,
    );
    let (b, spec) = (CpuBackend::new(1), spec(&job));
    let mut net = network(&spec, &images(), N, 7);
    let inputs = [
        random_vec(net.input_mut().len(), 1),
        random_vec(net.input_mut().len(), 2),
    ];
    let mut separately = Vec::new();
    for input in &inputs {
        net.input_mut().copy_from_slice(input);
        separately.push(gradients(&b, &mut net));
    }
    for (k, input) in inputs.iter().enumerate() {
        net.input_mut().copy_from_slice(input);
        backward_pass(&mut net, &b, k == 0);
    }
    net.finish_gradients(&b);
    let sum: Vec<f32> = separately[0]
        .iter()
        .zip(&separately[1])
        .map(|(a, b)| a + b)
        .collect();
    assert!(sum.iter().all(|g| g.is_finite()) && sum.iter().any(|&g| g != 0.0));
    for (i, (got, want)) in net.grads.iter().zip(&sum).enumerate() {
        assert!(
            (got - want).abs() <= 1e-6 * want.abs().max(1.0),
            "parameter {i}: {got} after both passes, {want} as the sum of each"
        );
    }
}

#[test]
fn a_step_without_a_backward_pass_has_zero_gradients() {
    // A data-parallel replica with no samples in any micro-batch of the step.
    let (b, spec) = (CpuBackend::new(1), spec(&image_job(r#"{ type = "relu" }"#)));
    let mut net = network(&spec, &images(), N, 7);
    b.fill(&mut net.grads, f32::NAN);
    net.start_gradients();
    net.finish_gradients(&b);
    assert!(net.grads.iter().all(|&g| g == 0.0));
}

/// A model over sequences: per-sample [3, 4], linear, GELU and layer norm over the last
/// axis (rows = batch × 3), then flattened to the classes.
pub(crate) fn sequence_job(middle: &str) -> String {
    classifier_job(r#"{ type = "linear", out = 5 }"#, middle)
}

pub(crate) fn sequences() -> DataShape {
    DataShape {
        sample_shape: vec![3, 4],
        classes: Some(3),
        classes_from: None,
        target_dim: 1,
    }
}

#[test]
fn linear_over_the_last_axis_gradients() {
    check_gradients(
        &sequence_job(
            r#"{ type = "gelu" }, { type = "layernorm" }, { type = "linear", out = 2, bias = false }"#,
        ),
        sequences(),
    );
}

/// Each row of a [T, C] sample goes through the same weights, as PyTorch's nn.Linear on
/// [B, T, C]: y[b, t] = W·x[b, t] + bias.
#[test]
fn linear_over_the_last_axis_applies_per_row() {
    let b = CpuBackend::new(1);
    let job = r#"
        [data]
        source = "synthetic"
        task = "regression"
        [model]
        layers = [{ type = "linear", out = 5 }]
        [loss]
        type = "mse"
        [optimizer]
        type = "sgd"
        lr = 0.1
    "#;
    let data = DataShape {
        sample_shape: vec![3, 4],
        classes: None,
        classes_from: None,
        target_dim: 15,
    };
    let mut net = network(&spec(job), &data, N, 3);
    let (x, params) = (net.input_mut().clone(), net.params.clone());
    net.forward(&b, N, false, STEP_KEY);
    let layer = &net.graph.layers[0];
    assert_eq!(layer.out_shape, [3, 5]);
    let Op::Linear(linear) = &layer.op else {
        panic!("not a linear layer")
    };
    let (inp, out, rows, weight, bias) = (
        linear.inp,
        linear.out,
        linear.rows,
        linear.weight,
        linear.bias,
    );
    assert_eq!((inp, out, rows), (4, 5, 3));
    let y = net.output();
    for row in 0..N * rows {
        for o in 0..out {
            let w = &params[weight + o * inp..weight + (o + 1) * inp];
            let dot: f32 = (0..inp).map(|k| w[k] * x[row * inp + k]).sum();
            let expected = dot + params[bias.unwrap() + o];
            let got = y[row * out + o];
            assert!(
                (got - expected).abs() <= 1e-5,
                "row {row}, output {o}: {got} vs {expected}"
            );
        }
    }
}

/// Sequences with a class label at every position (a language model's next tokens).
fn labelled_sequences() -> DataShape {
    DataShape {
        sample_shape: vec![3, 4],
        classes: Some(5),
        classes_from: None,
        target_dim: 3,
    }
}

const PER_POSITION_JOB: &str = r#"
    [data]
    source = "synthetic"
    [model]
    layers = [{ type = "linear", out = 8 }, { type = "gelu" }, { type = "linear", out = 5 }]
    [optimizer]
    type = "sgd"
    lr = 0.1
"#;

#[test]
fn cross_entropy_at_every_position_gradients() {
    check_gradients(PER_POSITION_JOB, labelled_sequences());
}

/// [T, classes] logits against T labels: the loss is the mean over batch × T of each
/// position's cross-entropy, as F.cross_entropy(logits.view(-1, C), targets.view(-1)); with
/// an ignored class, the mean over the positions of the other classes.
#[test]
fn cross_entropy_at_every_position_is_the_mean_over_positions() {
    let b = CpuBackend::new(1);
    for ignored in [None, Some(2)] {
        let job = match ignored {
            Some(i) => format!("{PER_POSITION_JOB}\n[loss]\nignore_index = {i}"),
            None => PER_POSITION_JOB.to_string(),
        };
        let mut net = network(&spec(&job), &labelled_sequences(), N, 4);
        net.forward(&b, N, false, 0);
        let (logits, labels) = (
            net.output()[..N * 15].to_vec(),
            net.targets_mut()[..N * 3].to_vec(),
        );
        let (mut expected, mut scored) = (0.0f64, 0);
        for (row, &label) in logits.chunks_exact(5).zip(&labels) {
            if ignored == Some(label as u32) {
                continue;
            }
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
            let total: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
            expected += max + total.ln() - row[label as usize] as f64;
            scored += 1;
        }
        assert!(ignored.is_none() || scored < N * 3, "no label 2 drawn");
        expected /= scored as f64;
        let mut stats = b.new_stats().unwrap();
        net.loss(&b, N, None, &mut stats);
        let loss = stats.loss_sum / stats.samples;
        assert!(
            (loss - expected).abs() < 1e-6,
            "{ignored:?}: {loss} vs {expected}"
        );
        assert_eq!(stats.samples, scored as f64);
    }
}
