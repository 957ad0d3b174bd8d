//! The training step allocates nothing of its own once warmed up: every buffer is planned
//! when the network is built. The one exception is not ours: the `gemm` crate takes, per matrix
//! product, a packing scratch buffer and a small `did_pack_lhs` flag vector (gemm-common's
//! gemm.rs; mallocs from the free list, no system call: checked with `strace -c`). Counted with
//! a global allocator around the real `optimizer_step`, and around the steps of a two-rank
//! multi-process run (both ranks as threads of this process, meeting over loopback TCP).
//! gemm's two have alignments nothing of ours has (a cache line, and 1 for its `bool`s), so
//! every other allocation is counted as ours, and there must be none.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use trainer::data::Dataset;
use trainer::graph::{DataShape, Graph, Network};
use trainer::ops::Engine;
use trainer::optim::Optimizer;
use trainer::tensor::cpu::CpuBackend;
use trainer::tensor::{Backend, HalfKind};
use trainer::train::{
    optimizer_step, Batch, DataParallel, MicroBatches, ProcessReplicas, Samples, StepContext,
    StepSettings,
};

struct Counting;
static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);
/// Allocations with an alignment gemm's do not have (see the module's comment).
static OURS: AtomicUsize = AtomicUsize::new(0);
static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Whether this thread's allocations count: the threads doing a test's steps (the one
    /// calling `counted_epochs`, the pools' workers), not the test harness's, which records
    /// another test's result whenever it ends.
    static COUNTED: Cell<bool> = const { Cell::new(false) };
}

fn count_this_thread() {
    COUNTED.with(|c| c.set(true));
}

/// A pool of one thread whose allocations count.
fn one_thread_pool() -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .start_handler(|_| count_this_thread())
        .build()
        .unwrap()
}

fn counted_thread() -> bool {
    COUNTED.try_with(Cell::get).unwrap_or(false)
}

// LIVE_BYTES wraps where a counted thread frees what another allocated: only its change
// over the counted epochs is compared.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if counted_thread() {
            if COUNTING.load(Ordering::Relaxed) {
                ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
                if layout.align() > 1 && layout.align() < 64 {
                    OURS.fetch_add(1, Ordering::Relaxed);
                }
            }
            LIVE_BYTES.fetch_add(layout.size(), Ordering::Relaxed);
        }
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if counted_thread() {
            LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Adam with clipping, the gradient norm computed at every step.
const SETTINGS: StepSettings = StepSettings {
    lr: 1e-3,
    clip: Some(1.0),
    want_grad_norm: true,
    loss_scale: None,
    skip_nonfinite: false,
};

/// Runs `epoch` once to warm up (gemm's and the pool's thread-local state), then twice
/// counted: asserts that none of the allocations were ours and nothing was retained, and
/// returns how many there were (gemm's).
fn counted_epochs(what: &str, mut epoch: impl FnMut()) -> usize {
    count_this_thread();
    epoch();
    let live_before = LIVE_BYTES.load(Ordering::SeqCst);
    ALLOCATIONS.store(0, Ordering::SeqCst);
    OURS.store(0, Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    epoch();
    epoch();
    COUNTING.store(false, Ordering::SeqCst);
    assert_eq!(
        OURS.load(Ordering::SeqCst),
        0,
        "{what}: allocations of ours"
    );
    let live = LIVE_BYTES.load(Ordering::SeqCst);
    assert_eq!(live, live_before, "{what}: steps retained memory");
    ALLOCATIONS.load(Ordering::SeqCst)
}

#[test]
fn training_steps_allocate_nothing_but_gemm_scratch_and_retain_nothing() {
    // The counters are global: the tests of this file take turns.
    let _turn = common::one_at_a_time();
    let spec = common::spec(
        r#"
        [data]
        source = "synthetic"
        [model]
        layers = [
          { type = "linear", out = 512 }, { type = "gelu" }, { type = "dropout", p = 0.2 },
          { type = "linear", out = 256 }, { type = "relu" }, { type = "linear", out = 10 },
        ]
        [optimizer]
        type = "adamw"
        lr = 1e-3
        "#,
    );
    let (batch, features, samples) = (64, 300, 512);
    let data = DataShape {
        sample_shape: vec![features],
        classes: Some(10),
        classes_from: None,
        target_dim: 1,
    };
    // One thread: the count is then deterministic (threaded gemm takes a scratch per thread).
    let backend = CpuBackend::new(1);
    let pool = one_thread_pool();
    pool.install(|| {
        let graph = Graph::build(&spec, &data).unwrap();
        let params = graph.init_params(1);
        let mut net = Network::new(&backend, graph, &params, batch, 1).unwrap();
        let mut optimizer = Optimizer::new(&backend, &spec, params.len()).unwrap();
        let x = common::random_vec(samples * features, 2);
        let y: Vec<f32> = (0..samples).map(|i| (i % 10) as f32).collect();
        let order: Vec<u64> = (0..samples as u64).rev().collect();
        let groups = order.len().div_ceil(batch);
        let mut stats = backend.new_stats().unwrap();
        let mut micro_step = 0;
        let set = Dataset {
            features: x,
            targets: y,
            len: samples,
            ..Dataset::default()
        };
        let samples = Samples::new(&backend, set, (features, 1), net.data_reads(), true).unwrap();
        let input = Batch::<CpuBackend> { samples: &samples };
        let settings = SETTINGS;
        let epoch = || {
            for rows in order.chunks(2 * batch) {
                let pair = MicroBatches { rows, size: batch };
                let cx = StepContext {
                    backend: &backend,
                    net: &mut net,
                    optimizer: &mut optimizer,
                    stats: &mut stats,
                    micro_step: &mut micro_step,
                };
                optimizer_step(cx, &input, pair, settings);
            }
        };
        let allocations = counted_epochs("mlp", epoch);
        // Matrix products per optimizer step: per micro-batch, each of the 3 linear layers runs
        // forward and dW, and all but the first dx. At most gemm's two per product over the
        // two counted epochs, nothing else.
        let products_per_epoch = groups * (3 + 3 + 2);
        assert!(
            allocations <= 2 * 2 * products_per_epoch,
            "{allocations} allocations in 2 epochs of {products_per_epoch} matrix products"
        );
        assert!(backend.take_stats(&mut stats).samples > 0.0);
    });
}

#[test]
fn multi_process_steps_allocate_nothing_but_gemm_scratch_on_either_rank() {
    use trainer::data::{Data, Dataset};
    use trainer::train::parallel::Rendezvous;

    let _turn = common::one_at_a_time();
    let (batch, features, samples) = (32, 40, 256);
    let mut spec = common::spec(
        r#"
        [data]
        source = "synthetic"
        batch_size = 32
        [model]
        layers = [{ type = "linear", out = 64 }, { type = "relu" }, { type = "linear", out = 10 }]
        [optimizer]
        type = "adam"
        lr = 1e-3
        "#,
    );
    let port = common::free_port();
    let world = |rank: usize| Rendezvous {
        rank,
        world_size: 2,
        local_rank: rank,
        local_world_size: 2,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        timeout: std::time::Duration::from_secs(30),
    };
    let data = move || Data {
        sample_shape: vec![features],
        classes: Some(10),
        classes_from: None,
        target_dim: 1,
        train: Dataset {
            features: common::random_vec(samples * features, 2),
            targets: (0..samples).map(|i| (i % 10) as f32).collect(),
            len: samples,
            ..Dataset::default()
        },
        eval: Vec::new(),
        preprocess: trainer::data::Preprocess::identity(vec![features], Some(10), 1),
    };
    let shape = DataShape {
        sample_shape: vec![features],
        classes: Some(10),
        classes_from: None,
        target_dim: 1,
    };
    let graph = Graph::build(&spec, &shape).unwrap();
    let mut spec1 = spec.clone();
    spec1.parallel.world = Some(world(1));
    let graph1 = graph.clone();
    let rank1 = std::thread::spawn(move || {
        one_thread_pool()
            .install(|| trainer::train::serve(&CpuBackend::new(1), &spec1, graph1, data(), None))
    });

    spec.parallel.world = Some(world(0));
    let backend = CpuBackend::new(1);
    one_thread_pool().install(|| {
        let data = data();
        let mut replicas = ProcessReplicas::connect(
            &backend,
            &spec,
            &data,
            graph.param_len,
            "1 thread".into(),
            false,
        )
        .unwrap();
        let params = graph.init_params(1);
        let mut net = Network::new(&backend, graph.clone(), &params, batch / 2, 1).unwrap();
        let mut optimizer = Optimizer::new(&backend, &spec, params.len()).unwrap();
        replicas
            .broadcast(&spec, &net, &optimizer, &backend)
            .unwrap();
        let order: Vec<u64> = (0..samples as u64).rev().collect();
        let groups = order.len().div_ceil(batch);
        let (x, y) = (data.train.features.clone(), data.train.targets.clone());
        let set = Dataset {
            features: x,
            targets: y,
            len: samples,
            ..Dataset::default()
        };
        let samples = Samples::new(&backend, set, (features, 1), net.data_reads(), true).unwrap();
        let input = Batch::<CpuBackend> { samples: &samples };
        let settings = SETTINGS;
        let mut stats = backend.new_stats().unwrap();
        let mut micro_step = 0;
        let mut epoch = |replicas: &mut ProcessReplicas<CpuBackend>| {
            for rows in order.chunks(2 * batch) {
                let pair = MicroBatches { rows, size: batch };
                let cx = StepContext {
                    backend: &backend,
                    net: &mut net,
                    optimizer: &mut optimizer,
                    stats: &mut stats,
                    micro_step: &mut micro_step,
                };
                replicas.step(cx, &input, pair, settings).unwrap();
            }
        };
        epoch(&mut replicas); // warm-up: message buffers grow to their size, gemm's state
        let live_before = LIVE_BYTES.load(Ordering::SeqCst);
        ALLOCATIONS.store(0, Ordering::SeqCst);
        OURS.store(0, Ordering::SeqCst);
        COUNTING.store(true, Ordering::SeqCst);
        epoch(&mut replicas);
        epoch(&mut replicas);
        // Rank 1 answers only once its last update is applied: its steps are inside the count.
        replicas.verify(&backend, &net.params).unwrap();
        COUNTING.store(false, Ordering::SeqCst);
        let allocations = ALLOCATIONS.load(Ordering::SeqCst);
        // Each rank: per micro-batch, 2 linear layers forward and dW, and one dx.
        let products_per_epoch = groups * (2 + 2 + 1);
        assert!(
            allocations <= 2 * 2 * 2 * products_per_epoch,
            "{allocations} allocations in 2 epochs of 2 ranks x {products_per_epoch} products"
        );
        assert_eq!(OURS.load(Ordering::SeqCst), 0, "allocations of ours");
        assert_eq!(
            LIVE_BYTES.load(Ordering::SeqCst),
            live_before,
            "steps retained memory"
        );
        replicas.finish(None);
    });
    rank1.join().unwrap().unwrap();
}

/// A residual conv net (conv, batch norm, ReLU, add, pooling, layer norm, dropout) and a
/// graph of branches (concat, tanh, sigmoid, softmax layers).
const CONV_NET: &str = r#"[
  { type = "conv2d", out = 4, kernel_size = 3, padding = 1 }, { type = "batchnorm2d" },
  { type = "relu", name = "r1" },
  { type = "conv2d", out = 4, kernel_size = 3, padding = 1, bias = false },
  { type = "batchnorm2d", name = "b2" }, { type = "add", inputs = ["b2", "r1"] },
  { type = "relu" }, { type = "maxpool2d", kernel_size = 2 },
  { type = "conv2d", out = 8, kernel_size = 3, stride = 2, padding = 1 },
  { type = "layernorm" }, { type = "gelu" }, { type = "dropout", p = 0.1 },
  { type = "avgpool2d", kernel_size = 3 }, { type = "flatten" },
  { type = "linear", out = 10 },
]"#;
const BRANCHES: &str = r#"[
  { type = "linear", out = 16, name = "a" }, { type = "tanh", name = "t" },
  { type = "linear", out = 8, inputs = ["t"] }, { type = "sigmoid", name = "s" },
  { type = "concat", inputs = ["t", "s"] }, { type = "softmax" },
  { type = "linear", out = 12 }, { type = "log_softmax" }, { type = "linear", out = 10 },
]"#;

/// Each model in fp32, in bf16, in fp16 with loss scaling, and with activation
/// checkpointing: (what, layers, sample shape, half format, loss scale, extra job text).
#[allow(clippy::type_complexity)]
fn model_variants() -> Vec<(
    String,
    &'static str,
    Vec<usize>,
    Option<HalfKind>,
    Option<f64>,
    &'static str,
)> {
    let models = [
        ("conv net", CONV_NET, vec![1, 12, 12]),
        ("branches", BRANCHES, vec![24]),
    ];
    let checkpointing = "[checkpoint]\nactivations = { segments = 3 }\n";
    let variants = [
        ("fp32", None, None, ""),
        ("bf16", Some(HalfKind::Bf16), None, ""),
        (
            "fp16 with loss scaling",
            Some(HalfKind::F16),
            Some(1024.0),
            "",
        ),
        ("activation checkpointing", None, None, checkpointing),
    ];
    let mut all = Vec::new();
    for (model, layers, shape) in &models {
        for (variant, half, loss_scale, extra) in variants {
            let what = format!("{model}, {variant}");
            all.push((what, *layers, shape.clone(), half, loss_scale, extra));
        }
    }
    all
}

/// Adam steps of 2 micro-batches of 16 over 64 random samples on `backend`, counted as
/// `counted_epochs` does; returns the allocations counted. `step_graphs`: record the
/// micro-step and replay it (CUDA graphs, where the model allows).
#[allow(clippy::too_many_arguments)]
fn counted_steps<B: Engine>(
    backend: &B,
    what: &str,
    layers: &str,
    shape: &[usize],
    half: Option<HalfKind>,
    loss_scale: Option<f64>,
    extra: &str,
    step_graphs: bool,
) -> usize {
    let (batch, samples) = (16, 64);
    let spec = common::spec(&format!(
        "[data]\nsource = \"synthetic\"\n[model]\nlayers = {layers}\n\
         [optimizer]\ntype = \"adam\"\nlr = 1e-3\n{extra}"
    ));
    let data = DataShape {
        sample_shape: shape.to_vec(),
        classes: Some(10),
        classes_from: None,
        target_dim: 1,
    };
    let graph = Graph::build(&spec, &data).unwrap();
    let params = graph.init_params(1);
    let mut net = Network::with_precision(backend, graph, &params, batch, 1, half).unwrap();
    if step_graphs {
        // A model with dropout runs op by op (a new mask every step).
        let _ = net.enable_step_graphs();
    }
    let mut optimizer = Optimizer::new(backend, &spec, params.len()).unwrap();
    let row_len = shape.iter().product();
    let set = Dataset {
        features: common::random_vec(samples * row_len, 3),
        targets: (0..samples).map(|i| (i % 10) as f32).collect(),
        len: samples,
        ..Dataset::default()
    };
    let samples_in = Samples::new(backend, set, (row_len, 1), net.data_reads(), true).unwrap();
    let input = Batch::<B> {
        samples: &samples_in,
    };
    let order: Vec<u64> = (0..samples as u64).collect();
    let mut stats = backend.new_stats().unwrap();
    let mut micro_step = 0;
    let settings = StepSettings {
        loss_scale,
        ..SETTINGS
    };
    let epoch = || {
        for rows in order.chunks(2 * batch) {
            let pair = MicroBatches { rows, size: batch };
            let cx = StepContext {
                backend,
                net: &mut net,
                optimizer: &mut optimizer,
                stats: &mut stats,
                micro_step: &mut micro_step,
            };
            optimizer_step(cx, &input, pair, settings);
        }
    };
    let allocations = counted_epochs(what, epoch);
    assert!(backend.take_stats(&mut stats).samples > 0.0, "{what}");
    allocations
}

/// The conv net and the branches in every precision and with activation checkpointing: no
/// allocation of ours in a step, nothing retained.
#[test]
fn conv_nets_and_graphs_in_every_precision_allocate_nothing_of_their_own() {
    let _turn = common::one_at_a_time();
    let backend = CpuBackend::new(1);
    let pool = one_thread_pool();
    for (what, layers, shape, half, loss_scale, extra) in model_variants() {
        pool.install(|| {
            counted_steps(
                &backend, &what, layers, &shape, half, loss_scale, extra, false,
            );
        });
    }
}

/// The same on CUDA: no host allocation at all in a step (there is no gemm crate), whether
/// the step is replayed from a CUDA graph or runs op by op; nothing retained.
#[test]
fn cuda_steps_allocate_nothing_on_the_host() {
    let _turn = common::one_at_a_time();
    if !common::gpu_present() {
        return;
    }
    let backend = trainer::tensor::cuda::CudaBackend::new(0, false).unwrap();
    for (what, layers, shape, half, loss_scale, extra) in model_variants() {
        backend.set_half_matmuls(half);
        for graphs in [true, false] {
            let what = format!("{what}, CUDA graphs {graphs}");
            let allocations = counted_steps(
                &backend, &what, layers, &shape, half, loss_scale, extra, graphs,
            );
            assert_eq!(allocations, 0, "{what}: host allocations in a step");
        }
    }
}
