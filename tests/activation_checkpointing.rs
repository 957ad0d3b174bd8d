//! Activation checkpointing: the gradients are bit-identical to those without it, for every
//! segment count and "all", with dropout (whose masks the recomputation redraws) and
//! flatten (which shares a buffer) in the model; and the network really allocates less:
//! the bytes `Network::new` takes, counted by the allocator, match the memory plan, which
//! drops by more than 40% for an 8-layer MLP with 4 segments.

mod common;

use common::{network, spec};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use trainer::graph::{ActivationStorage, DataShape, Graph, MemoryPlan, Network};
use trainer::spec::JobSpec;
use trainer::tensor::cpu::CpuBackend;
use trainer::tensor::Backend;

/// Counts the bytes allocated on the current thread while `COUNTING` is set there (tests
/// of this binary run on other threads at the same time).
struct PerThread;
thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static ALLOCATED: Cell<usize> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for PerThread {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = COUNTING.try_with(|c| {
            if c.get() {
                ALLOCATED.with(|a| a.set(a.get() + layout.size()));
            }
        });
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let _ = COUNTING.try_with(|c| {
            if c.get() {
                ALLOCATED.with(|a| a.set(a.get() + layout.size()));
            }
        });
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: PerThread = PerThread;

const N: usize = 6;
const STEP_KEY: u64 = 11;

fn job(activations: &str) -> JobSpec {
    spec(&format!(
        r#"
        [data]
        source = "synthetic"
        [model]
        layers = [
          {{ type = "flatten" }}, {{ type = "linear", out = 24 }}, {{ type = "relu" }},
          {{ type = "dropout", p = 0.3 }}, {{ type = "linear", out = 20 }}, {{ type = "gelu" }},
          {{ type = "linear", out = 16 }}, {{ type = "tanh" }}, {{ type = "dropout", p = 0.2 }},
          {{ type = "linear", out = 12 }}, {{ type = "sigmoid" }}, {{ type = "linear", out = 4 }},
        ]
        [optimizer]
        type = "sgd"
        lr = 0.1
        [checkpoint]
        activations = {activations}
        "#
    ))
}

fn data() -> DataShape {
    DataShape {
        sample_shape: vec![3, 4],
        classes: Some(4),
        classes_from: None,
        target_dim: 1,
    }
}

/// Gradients (accumulated over two micro-steps, as gradient accumulation does), the loss,
/// and the eval-mode output.
fn run(activations: &str) -> (Vec<f32>, f64, Vec<f32>) {
    let b = CpuBackend::new(1);
    let mut net = network(&job(activations), &data(), N, 7);
    b.fill(&mut net.grads, 0.0);
    let mut stats = b.new_stats().unwrap();
    for key in [STEP_KEY, STEP_KEY + 1] {
        net.forward(&b, N, true, key);
        net.loss(&b, N, Some(0.5), &mut stats);
        net.backward(&b, N, key);
    }
    net.forward(&b, N, false, 0);
    let output = net.output()[..N * 4].to_vec();
    (net.grads.clone(), b.take_stats(&mut stats).loss_sum, output)
}

#[test]
fn gradients_are_bit_identical_with_any_segment_count() {
    let (grads, loss, output) = run("\"none\"");
    assert!(grads.iter().any(|&g| g.abs() > 1e-4));
    let layers = 12;
    let mut modes: Vec<String> = (1..=layers)
        .map(|s| format!("{{ segments = {s} }}"))
        .collect();
    modes.push("\"all\"".into());
    for mode in modes {
        let (g, l, o) = run(&mode);
        let same = g
            .iter()
            .zip(&grads)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "activations = {mode}: gradients differ");
        assert_eq!(l.to_bits(), loss.to_bits(), "activations = {mode}: loss");
        assert_eq!(o, output, "activations = {mode}: eval output");
    }
}

fn mlp8(activations: &str) -> (JobSpec, DataShape) {
    let mut layers = vec![r#"{ type = "flatten" }"#.to_string()];
    for i in 0..8 {
        let out = if i == 7 { 10 } else { 256 };
        layers.push(format!(r#"{{ type = "linear", out = {out} }}"#));
        if i < 7 {
            layers.push(r#"{ type = "relu" }"#.into());
        }
    }
    let spec = spec(&format!(
        "[data]\nsource = \"synthetic\"\n[model]\nlayers = [{}]\n[optimizer]\ntype = \"adam\"\n\
         lr = 1e-3\n[checkpoint]\nactivations = {activations}\n",
        layers.join(", ")
    ));
    let data = DataShape {
        sample_shape: vec![1, 28, 28],
        classes: Some(10),
        classes_from: None,
        target_dim: 1,
    };
    (spec, data)
}

/// Bytes `Network::new` allocates, and the plan's bytes of activations and of their
/// gradients.
fn measured(activations: &str, batch: usize) -> (usize, (usize, usize)) {
    let (spec, data) = mlp8(activations);
    let graph = Graph::build(&spec, &data).unwrap();
    let params = graph.init_params(1);
    let plan = MemoryPlan::new(&graph, batch, 2, 0, 0, ActivationStorage::F32);
    let backend = CpuBackend::new(1);
    COUNTING.with(|c| c.set(true));
    ALLOCATED.with(|a| a.set(0));
    let net = Network::new(&backend, graph, &params, batch, 1).unwrap();
    COUNTING.with(|c| c.set(false));
    let bytes = ALLOCATED.with(|a| a.get());
    drop(net);
    (bytes, (plan.activations, plan.activation_grads))
}

#[test]
fn eight_layer_mlp_with_four_segments_allocates_over_40_percent_less_activation_memory() {
    let batch = 128;
    let (net_without, (acts_without, grads_without)) = measured("\"none\"", batch);
    let (net_with, (acts_with, grads_with)) = measured("{ segments = 4 }", batch);
    // The network allocates what the plan says: everything else it holds (parameters,
    // gradients, input, targets) is the same in both, but for a few hundred bytes of
    // bookkeeping (the buffer lists, the plan's tables).
    let fewer = net_without - net_with;
    let planned = acts_without + grads_without - acts_with - grads_with;
    assert!(
        fewer.abs_diff(planned) < 4096,
        "allocated {fewer} bytes fewer, planned {planned} fewer"
    );
    let saved = 1.0 - acts_with as f64 / acts_without as f64;
    assert!(saved >= 0.4, "only {:.0}% less", 100.0 * saved);
    // The activations' gradients take two hidden layers' worth either way: each is freed
    // (its buffer reused) once the layer that produced it has used it.
    assert_eq!(grads_with, grads_without);
    assert_eq!(grads_with, 2 * batch * 256 * 4);
    // "all" picks the segment count that needs the least.
    let (_, (acts_all, _)) = measured("\"all\"", batch);
    assert!(acts_all <= acts_with);
}

/// Skip connections across segment boundaries, a value read by three layers, batch norm
/// (whose running statistics a recomputation must not move again) and dropout.
fn residual_job(activations: &str) -> JobSpec {
    spec(&format!(
        r#"
        [data]
        source = "synthetic"
        [model]
        layers = [
          {{ type = "conv2d", out = 3, kernel_size = 3, padding = 1, name = "stem" }},
          {{ type = "batchnorm2d" }}, {{ type = "tanh", name = "x" }},
          {{ type = "conv2d", out = 3, kernel_size = 3, padding = 1 }}, {{ type = "batchnorm2d" }},
          {{ type = "dropout", p = 0.2 }}, {{ type = "gelu", name = "branch" }},
          {{ type = "add", inputs = ["branch", "x"], name = "sum" }},
          {{ type = "concat", inputs = ["sum", "x", "stem"] }}, {{ type = "relu" }},
          {{ type = "flatten" }}, {{ type = "linear", out = 4 }},
        ]
        [optimizer]
        type = "sgd"
        lr = 0.1
        [checkpoint]
        activations = {activations}
        "#
    ))
}

#[test]
fn graphs_with_skip_connections_and_batch_norm_are_bit_identical_with_any_segment_count() {
    let run = |activations: &str| {
        let b = CpuBackend::new(1);
        let images = DataShape {
            sample_shape: vec![2, 3, 4],
            classes: Some(4),
            classes_from: None,
            target_dim: 1,
        };
        let mut net = network(&residual_job(activations), &images, N, 7);
        b.fill(&mut net.grads, 0.0);
        let mut stats = b.new_stats().unwrap();
        for key in [STEP_KEY, STEP_KEY + 1] {
            net.forward(&b, N, true, key);
            net.loss(&b, N, Some(0.5), &mut stats);
            net.backward(&b, N, key);
        }
        net.forward(&b, N, false, 0);
        let output = net.output()[..N * 4].to_vec();
        (net.grads.clone(), net.running_stats(&b), output)
    };
    let (grads, running, output) = run("\"none\"");
    assert!(grads.iter().any(|&g| g.abs() > 1e-4));
    for mode in (1..=12)
        .map(|s| format!("{{ segments = {s} }}"))
        .chain(["\"all\"".to_string()])
    {
        let (g, r, o) = run(&mode);
        let same = g
            .iter()
            .zip(&grads)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "activations = {mode}: gradients differ");
        assert_eq!(
            r, running,
            "activations = {mode}: running statistics moved again"
        );
        assert_eq!(o, output, "activations = {mode}: eval output");
    }
}
