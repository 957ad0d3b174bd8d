//! model.safetensors and model.init_from: PyTorch nn.Sequential names and layouts, an exact
//! round trip, clear errors for files that do not fit, and (when a Python with torch is
//! found) the file loaded into the equivalent torch model gives the same outputs.

use crate::common;

use common::{stderr, torch_python, trainer};

use common::root;
use safetensors::SafeTensors;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use trainer::checkpoint::weights;
use trainer::graph::{DataShape, Graph, Network, Op};
use trainer::spec::JobSpec;
use trainer::tensor::cpu::CpuBackend;
use trainer::tensor::{Activation, PoolKind};

/// Digits, a model with parameterless layers between the linear ones (they still count in
/// the names), one linear without bias.
const LAYERS: &str = r#"[
  { type = "flatten" }, { type = "linear", out = 32 }, { type = "relu" },
  { type = "dropout", p = 0.2 }, { type = "linear", out = 24, bias = false },
  { type = "gelu", approximate = "tanh" }, { type = "linear", out = 16 }, { type = "tanh" },
  { type = "linear", out = 12 }, { type = "sigmoid" }, { type = "gelu" },
  { type = "linear", out = 10 },
]"#;

/// The digits with `layers`; a model with an embedding reads the raw pixel values (whole
/// numbers 0-16) as token ids.
fn job_text(layers: &str, extra: &str) -> String {
    let normalize = if layers.contains("embedding") {
        "normalize = \"none\"\n"
    } else {
        ""
    };
    format!(
        "[job]\nname = \"w\"\nseed = 4\n[data]\nsource = \"digits\"\nval_fraction = 0.2\n\
         {normalize}[model]\nlayers = {layers}\n{extra}\n[optimizer]\ntype = \"adam\"\nlr = 3e-3\n\
         [train]\nepochs = 2\nlog_every = 1\n"
    )
}

/// Runs a job written to `dir`; returns the run directory.
fn run(dir: &Path, file: &str, text: &str) -> Output {
    let job = dir.join(file);
    std::fs::write(&job, text).unwrap();
    let runs = dir.join("runs");
    trainer(&[
        "run",
        job.to_str().unwrap(),
        "--runs-dir",
        runs.to_str().unwrap(),
        "-q",
    ])
}

fn run_dir(o: &Output) -> PathBuf {
    assert!(o.status.success(), "{}", stderr(o));
    PathBuf::from(String::from_utf8(o.stdout.clone()).unwrap().trim())
}

#[test]
fn model_safetensors_has_pytorch_sequential_names_and_layouts() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = run_dir(&run(tmp.path(), "job.toml", &job_text(LAYERS, "")));
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<(String, Vec<usize>)> = file
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.shape().to_vec()))
        .collect();
    names.sort();
    let expected: Vec<(String, Vec<usize>)> = [
        ("1.bias", vec![32]),
        ("1.weight", vec![32, 64]),
        ("11.bias", vec![10]),
        ("11.weight", vec![10, 12]),
        ("4.weight", vec![24, 32]),
        ("6.bias", vec![16]),
        ("6.weight", vec![16, 24]),
        ("8.bias", vec![12]),
        ("8.weight", vec![12, 16]),
    ]
    .into_iter()
    .map(|(n, s)| (n.to_string(), s))
    .collect();
    assert_eq!(names, expected);
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(meta.metadata().as_ref().unwrap()["format"], "pt");
}

fn digits_graph(layers: &str) -> (JobSpec, Graph) {
    let spec = common::spec(&job_text(layers, ""));
    let data = DataShape {
        sample_shape: vec![1, 8, 8],
        classes: Some(10),
        classes_from: None,
        target_dim: 1,
    };
    let graph = Graph::build(&spec, &data).unwrap();
    (spec, graph)
}

#[test]
fn batch_norm_buffers_and_named_layers_use_pytorch_names() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = run_dir(&run(tmp.path(), "job.toml", &job_text(RESIDUAL_LAYERS, "")));
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let names: Vec<String> = file.names().into_iter().map(String::from).collect();
    for name in [
        "0.weight",
        "1.running_mean",
        "1.running_var",
        "conv.weight",
        "conv.bias",
        "bn.weight",
        "bn.running_var",
        "fc.weight",
        "10.num_batches_tracked",
    ] {
        assert!(names.iter().any(|n| n == name), "{name} not in {names:?}");
    }
    let tracked = file.tensor("bn.num_batches_tracked").unwrap();
    assert_eq!(tracked.dtype(), safetensors::Dtype::I64);
    assert!(tracked.shape().is_empty());
    // Two epochs of 1,438 samples in batches of 64: 46 training forward passes.
    let count = i64::from_le_bytes(tracked.data().try_into().unwrap());
    assert_eq!(count, 46);
    // The running variance has moved from its initial 1.
    let var: Vec<f32> = bytemuck::pod_collect_to_vec(file.tensor("bn.running_var").unwrap().data());
    assert!(var.iter().all(|&v| v > 0.0) && var.iter().any(|&v| (v - 1.0).abs() > 1e-3));

    // A run from these weights counts on from them, as PyTorch after load_state_dict does.
    let init = format!(
        "init_from = \"{}\"",
        dir.join("model.safetensors").display()
    );
    let next = run_dir(&run(
        tmp.path(),
        "next.toml",
        &job_text(RESIDUAL_LAYERS, &init),
    ));
    let bytes = std::fs::read(next.join("model.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let tracked = file.tensor("bn.num_batches_tracked").unwrap();
    assert_eq!(i64::from_le_bytes(tracked.data().try_into().unwrap()), 92);

    // A negative running variance (a damaged file, or the mean and variance swapped) would
    // make every evaluation NaN: refused by its tensor.
    let (_, graph) = digits_graph(RESIDUAL_LAYERS);
    let mut w = weights::read(&dir.join("model.safetensors"), &graph).unwrap();
    let var = graph
        .running_stat_entries()
        .into_iter()
        .find(|e| e.name == "bn.running_var")
        .unwrap();
    w.running_stats[var.offset + 2] = -0.5;
    let negative = tmp.path().join("negative.safetensors");
    weights::write(&negative, &graph, &w, "{}").unwrap();
    let init = format!("init_from = \"{}\"", negative.display());
    let out = run(tmp.path(), "neg.toml", &job_text(RESIDUAL_LAYERS, &init));
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("tensor `bn.running_var` holds -0.5 (at flat index 2); a variance cannot"),
        "{err}"
    );
}

/// Each layer's parameters, and every weight and bias a matrix product reads, start 16-byte
/// aligned in half precision (cuBLAS's fast kernels and cuBLASLt's bias epilogue need it);
/// the tensors lie in model order without overlaps, and the buffer holds nothing but them
/// and the gaps before them.
#[test]
fn parameter_tensors_start_aligned_in_order_in_the_flat_buffer() {
    let aligned = |offset: usize| offset.is_multiple_of(trainer::graph::PARAM_ALIGN);
    for layers in [LAYERS, RESIDUAL_LAYERS] {
        let (_, graph) = digits_graph(layers);
        for (i, span) in graph.parameter_spans().iter().enumerate() {
            assert!(span.as_ref().is_none_or(|s| aligned(s.start)), "layer {i}");
            let (weight, bias) = match &graph.layers[i].op {
                Op::Linear(l) => (l.weight, l.bias),
                Op::Conv2d(c) => (c.weight, c.bias),
                Op::Embedding(e) => (e.weight, None),
                _ => continue,
            };
            assert!(aligned(weight) && bias.is_none_or(aligned), "layer {i}");
        }
        let entries = graph.state_dict_entries();
        let mut end = 0;
        for e in &entries {
            assert!(
                e.offset >= end && e.offset - end < trainer::graph::PARAM_ALIGN,
                "{} at {} after a tensor ending at {end}",
                e.name,
                e.offset
            );
            end = e.offset + e.len();
        }
        assert_eq!(end, graph.param_len);
        let count: usize = entries.iter().map(|e| e.len()).sum();
        assert_eq!(count, graph.parameter_count());
        assert!(
            graph.param_len > count,
            "the models have widths that need gaps"
        );
        // A packed buffer's values land in their tensors.
        let packed: Vec<f32> = (1..=count).map(|v| v as f32).collect();
        let unpacked = graph.from_packed_layout(&packed).unwrap();
        let mut next = 1.0;
        for e in &entries {
            let tensor = &unpacked[e.offset..e.offset + e.len()];
            assert!(tensor.iter().all(|&v| {
                next += 1.0;
                v == next - 1.0
            }));
        }
        assert_eq!(
            unpacked.iter().filter(|&&v| v == 0.0).count(),
            graph.param_len - count
        );
        assert!(graph.from_packed_layout(&unpacked).is_none());
    }
}

#[test]
fn written_weights_read_back_bit_identical() {
    let (_, graph) = digits_graph(LAYERS);
    // Random values in every tensor; the alignment gaps between them hold zeros.
    let params = graph
        .from_packed_layout(&common::random_vec(graph.parameter_count(), 21))
        .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("w.safetensors");
    let w = weights::Weights {
        params: params.clone(),
        running_stats: Vec::new(),
        batches_tracked: Vec::new(),
    };
    weights::write(&path, &graph, &w, "{}").unwrap();
    let back = weights::read(&path, &graph).unwrap().params;
    assert!(back
        .iter()
        .zip(&params)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    assert_eq!(back.len(), params.len());
}

#[test]
fn init_from_starts_a_job_from_a_previous_runs_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let first = run_dir(&run(tmp.path(), "a.toml", &job_text(LAYERS, "")));
    let file = first.join("model.safetensors");
    let first_loss = |dir: &Path| -> f64 {
        let m = std::fs::read_to_string(dir.join("metrics.csv")).unwrap();
        m.lines()
            .nth(1)
            .unwrap()
            .split(',')
            .nth(3)
            .unwrap()
            .parse()
            .unwrap()
    };
    let init = format!("init_from = \"{}\"", file.display());
    let second = run_dir(&run(tmp.path(), "b.toml", &job_text(LAYERS, &init)));
    // The first step of a fresh run sees an untrained model (loss ~ln 10 = 2.30); started
    // from the weights trained for two epochs, the loss is lower from the first step.
    let (fresh, continued) = (first_loss(&first), first_loss(&second));
    assert!(
        continued < fresh - 0.2,
        "first-step loss {continued} vs {fresh}"
    );
    // A relative path is relative to the job file.
    let rel = file.strip_prefix(tmp.path()).unwrap().display().to_string();
    let init = format!("init_from = \"{rel}\"");
    run_dir(&run(tmp.path(), "c.toml", &job_text(LAYERS, &init)));

    // The run says where its weights came from, and still does after a resume whose job
    // leaves the key out (a resume reads the checkpoint, not the file).
    let checkpointed =
        |init: &str| format!("{}[checkpoint]\nevery_epochs = 1\n", job_text(LAYERS, init));
    let init = format!("init_from = \"{}\"", file.display());
    let started = run_dir(&run(tmp.path(), "d.toml", &checkpointed(&init)));
    let log = std::fs::read_to_string(started.join("train.log")).unwrap();
    assert!(log.contains("starting from the weights in"), "{log}");
    let without = tmp.path().join("e.toml");
    std::fs::write(&without, checkpointed("")).unwrap();
    let resumed = trainer(&[
        "run",
        without.to_str().unwrap(),
        "--resume",
        started.to_str().unwrap(),
        "--set",
        "train.epochs=3",
        "-q",
    ]);
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    let config = std::fs::read_to_string(started.join("config.toml")).unwrap();
    assert!(config.contains(&init), "{config}");

    // Another file given on a resume is not read, and train.log says so (the warning comes
    // before the run directory is opened again; the log keeps it).
    let other = second.join("model.safetensors");
    let resumed = trainer(&[
        "run",
        without.to_str().unwrap(),
        "--resume",
        started.to_str().unwrap(),
        "--set",
        "train.epochs=4",
        "--set",
        &format!("model.init_from=\"{}\"", other.display()),
        "-q",
    ]);
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    let log = std::fs::read_to_string(started.join("train.log")).unwrap();
    let warning = format!(
        "model.init_from = \"{}\" is not read: a resumed run continues from its checkpoint \
         (the run started from {})",
        other.display(),
        file.display()
    );
    assert!(log.contains(&warning), "{warning}\nnot in\n{log}");
    let config = std::fs::read_to_string(started.join("config.toml")).unwrap();
    assert!(config.contains(&init), "{config}");
}

#[test]
fn init_from_files_that_do_not_fit_are_refused_with_the_names() {
    let tmp = tempfile::tempdir().unwrap();
    let small = r#"[{ type = "flatten" }, { type = "linear", out = 32 }, { type = "relu" }, { type = "linear", out = 10 }]"#;
    let dir = run_dir(&run(tmp.path(), "a.toml", &job_text(small, "")));
    let file = dir.join("model.safetensors").display().to_string();
    let cases: [(String, Vec<&str>); 3] = [
        (
            small.replace("out = 32", "out = 16"),
            vec![
                "model.init_from",
                "tensor `1.weight` has shape [32, 64], the model needs [16, 64]",
            ],
        ),
        (
            small.replace(
                r#"{ type = "relu" }"#,
                r#"{ type = "relu" }, { type = "dropout" }"#,
            ),
            vec![
                "missing tensors 4.weight, 4.bias",
                "unexpected tensors 3.bias, 3.weight",
            ],
        ),
        (
            small.to_string(),
            vec!["nowhere.safetensors", "cannot read it"],
        ),
    ];
    for (i, (layers, needles)) in cases.iter().enumerate() {
        let target = if i == 2 { "nowhere.safetensors" } else { &file };
        let out = run(
            tmp.path(),
            "bad.toml",
            &job_text(layers, &format!("init_from = \"{target}\"")),
        );
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{err}");
        for n in needles {
            assert!(err.contains(n), "message lacks {n:?}:\n{err}");
        }
    }
    // A NaN in the file: refused by its tensor, not left to show as a diverged loss.
    let (_, graph) = digits_graph(small);
    let mut w = weights::read(Path::new(&file), &graph).unwrap();
    let second_layer = graph.state_dict_entries()[2].offset;
    w.params[second_layer + 5] = f32::NAN;
    let poisoned = tmp.path().join("nan.safetensors");
    weights::write(&poisoned, &graph, &w, "{}").unwrap();
    let init = format!("init_from = \"{}\"", poisoned.display());
    let out = run(tmp.path(), "nan.toml", &job_text(small, &init));
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("tensor `3.weight` holds NaN (at flat index 5); every value must be finite"),
        "{err}"
    );

    // A run's training checkpoint is named as one, with what was likely meant.
    let checkpointed = format!("{}[checkpoint]\nevery_epochs = 1\n", job_text(small, ""));
    let checkpointed = run_dir(&run(tmp.path(), "ck.toml", &checkpointed));
    let step = std::fs::read_dir(checkpointed.join("checkpoints"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .unwrap();
    let init = format!("init_from = \"{}\"", step.display());
    let out = run(tmp.path(), "from-ck.toml", &job_text(small, &init));
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("it is a training checkpoint") && err.contains("--resume"),
        "{err}"
    );
    // An empty path would name the job file's directory.
    let out = run(
        tmp.path(),
        "empty.toml",
        &job_text(small, "init_from = \"\""),
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("model.init_from") && err.contains("is empty"),
        "{err}"
    );
}

/// The layers as the torch script builds them: {prefix, inputs, layer}.
fn layers_json(graph: &Graph) -> String {
    let items: Vec<String> = graph
        .layers
        .iter()
        .enumerate()
        .map(|(i, l)| {
            format!(
                "{{\"prefix\": \"{}\", \"inputs\": {:?}, \"layer\": {}}}",
                l.prefix(i),
                l.inputs,
                layer_json(&l.op, &l.out_shape)
            )
        })
        .collect();
    format!("[{}]", items.join(", "))
}

fn layer_json(op: &Op, out_shape: &[usize]) -> String {
    match op {
        Op::View(_) => format!("[\"view\", {out_shape:?}]"),
        Op::Conv2d(c) => {
            let g = &c.geom;
            format!(
                "[\"conv2d\", {}, {}, [{}, {}], [{}, {}], [{}, {}], [{}, {}], {}, {}]",
                g.c,
                g.o,
                g.kh,
                g.kw,
                g.stride.0,
                g.stride.1,
                g.pad.0,
                g.pad.1,
                g.dil.0,
                g.dil.1,
                g.groups,
                c.bias.is_some()
            )
        }
        Op::Pool(p) => format!(
            "[\"{}\", [{}, {}], [{}, {}], [{}, {}]]",
            if p.kind == PoolKind::Max {
                "maxpool2d"
            } else {
                "avgpool2d"
            },
            p.geom.k.0,
            p.geom.k.1,
            p.geom.stride.0,
            p.geom.stride.1,
            p.geom.pad.0,
            p.geom.pad.1
        ),
        Op::LayerNorm(l) => format!("[\"layernorm\", {}, {}, {}]", l.width, l.eps, l.bias),
        Op::RmsNorm(r) => format!("[\"rmsnorm\", {}, {}]", r.width, r.eps),
        Op::Linear(l) => {
            format!("[\"linear\", {}, {}, {}]", l.inp, l.out, l.bias.is_some())
        }
        Op::Dropout(d) => format!("[\"dropout\", {}]", d.p),
        Op::Activation(a) => match a.f {
            Activation::Relu => "[\"relu\"]".into(),
            Activation::Gelu => "[\"gelu\", \"none\"]".into(),
            Activation::GeluTanh => "[\"gelu\", \"tanh\"]".into(),
            Activation::Tanh => "[\"tanh\"]".into(),
            Activation::Sigmoid => "[\"sigmoid\"]".into(),
            Activation::Silu => "[\"silu\"]".into(),
        },
        Op::BatchNorm(b) => format!(
            "[\"batchnorm{}d\", {}, {}, {}]",
            if out_shape.len() == 3 { 2 } else { 1 },
            b.channels,
            b.eps,
            b.momentum
        ),
        Op::Add(_) => "[\"add\"]".into(),
        Op::Multiply(_) => "[\"multiply\"]".into(),
        Op::Embedding(e) => format!("[\"embedding\", {}, {}]", e.vocab, e.dim),
        Op::Concat(_) => "[\"concat\"]".into(),
        Op::PositionEmbedding(p) => {
            format!("[\"position_embedding\", {}, {}]", p.positions, p.width)
        }
        Op::Attention(a) => format!("[\"attention\", {}, {}]", a.shape.heads, a.shape.causal),
        Op::Rotary(r) => format!("[\"rotary\", {}, {}]", r.rotation.heads, r.rotation.theta),
        Op::Softmax(s) => {
            format!("[\"{}\"]", if s.log { "log_softmax" } else { "softmax" })
        }
    }
}

/// A CNN over the digits' [1, 8, 8]: grouped, dilated and strided convolutions, both
/// poolings, layer norm, global pooling and reshape, so every image layer's names and layouts
/// are checked against torch's.
const CNN_LAYERS: &str = r#"[
  { type = "conv2d", out = 4, kernel_size = 3, padding = 1 }, { type = "relu" },
  { type = "maxpool2d", kernel_size = 3, stride = 2, padding = 1 },
  { type = "conv2d", out = 6, kernel_size = [3, 2], padding = [1, 1], groups = 2, bias = false },
  { type = "layernorm" }, { type = "avgpool2d", kernel_size = 2 },
  { type = "reshape", shape = [6, 1, -1] }, { type = "conv2d", out = 8, kernel_size = [1, 2], dilation = 2 },
  { type = "global_avg_pool" }, { type = "flatten" }, { type = "linear", out = 10 },
]"#;

/// A residual network with batch norm (its running statistics and num_batches_tracked in the
/// file, evaluation on them), a concat, a named-layer state_dict and a log_softmax output.
const RESIDUAL_LAYERS: &str = r#"[
  { type = "conv2d", out = 4, kernel_size = 3, padding = 1, bias = false },
  { type = "batchnorm2d" }, { type = "relu", name = "stem" },
  { type = "conv2d", out = 4, kernel_size = 3, padding = 1, name = "conv" },
  { type = "batchnorm2d", name = "bn", momentum = 0.3 },
  { type = "add", inputs = ["bn", "stem"] }, { type = "relu", name = "block" },
  { type = "concat", inputs = ["block", "stem", "input"] },
  { type = "global_avg_pool" }, { type = "flatten" },
  { type = "batchnorm1d", eps = 1e-3 }, { type = "linear", out = 10, name = "fc" },
  { type = "log_softmax" },
]"#;

/// Pixel values (0-16) as token ids: an embedding table of 17 x 3 per pixel.
const EMBEDDING_LAYERS: &str = r#"[
  { type = "flatten" }, { type = "embedding", num_embeddings = 17, embedding_dim = 3 },
  { type = "flatten" }, { type = "linear", out = 10 },
]"#;

/// Each image as a sequence of its 8 rows: causal attention over them, as nanoGPT's
/// CausalSelfAttention computes it (tests/fixtures/torch_load_model.py).
const ATTENTION_LAYERS: &str = r#"[
  { type = "reshape", shape = [8, 8] },
  { type = "position_embedding", num_positions = 10, name = "wpe" },
  { type = "linear", out = 24, name = "c_attn" },
  { type = "attention", heads = 2 }, { type = "linear", out = 8, name = "c_proj" },
  { type = "layernorm", bias = false }, { type = "flatten" }, { type = "linear", out = 10 },
]"#;

/// A Llama block over the image's rows: RMSNorm, rotary position embedding before causal
/// attention, and the gated MLP down(silu(gate(x)) · up(x)), as Hugging Face's
/// LlamaDecoderLayer computes them (tests/fixtures/torch_load_model.py).
const LLAMA_LAYERS: &str = r#"[
  { type = "reshape", shape = [8, 8], name = "x" },
  { type = "rmsnorm", eps = 1e-5 }, { type = "linear", out = 24, bias = false },
  { type = "rotary", heads = 2, theta = 500.0 }, { type = "attention", heads = 2 },
  { type = "linear", out = 8, bias = false, name = "o_proj" },
  { type = "add", inputs = ["x", "o_proj"], name = "h" },
  { type = "rmsnorm", eps = 1e-5, name = "norm" },
  { type = "linear", out = 12, bias = false, name = "gate" }, { type = "silu", name = "act" },
  { type = "linear", out = 12, bias = false, inputs = ["norm"], name = "up" },
  { type = "multiply", inputs = ["act", "up"] },
  { type = "linear", out = 8, bias = false, name = "down" }, { type = "add", inputs = ["h", "down"] }, { type = "flatten" }, { type = "linear", out = 10 },
]"#;

#[test]
fn pytorch_loads_model_safetensors_and_computes_the_same_outputs() {
    for layers in [
        LAYERS,
        CNN_LAYERS,
        RESIDUAL_LAYERS,
        EMBEDDING_LAYERS,
        ATTENTION_LAYERS,
        LLAMA_LAYERS,
    ] {
        compare_with_torch(layers);
    }
}

fn compare_with_torch(layers: &str) {
    let Some(python) = torch_python() else {
        println!("skipped: no Python with torch and safetensors (set TRAINER_TORCH_PYTHON to one)");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = run_dir(&run(tmp.path(), "job.toml", &job_text(layers, "")));
    let model = dir.join("model.safetensors");

    // trainer's own outputs for random inputs, from the same file.
    let (_, graph) = digits_graph(layers);
    let w = weights::read(&model, &graph).unwrap();
    let n = 16;
    let backend = CpuBackend::new(1);
    let json = layers_json(&graph);
    let mut net = Network::new(&backend, graph, &w.params, n, 0).unwrap();
    net.set_running_stats(&backend, &w.running_stats).unwrap();
    let input: Vec<f32> = if layers.contains("embedding") {
        (0..n * 64).map(|i| ((i * 7 + i / 5) % 17) as f32).collect()
    } else {
        common::random_vec(n * 64, 5)
    };
    net.set_input(&backend, &input);
    net.forward(&backend, n, false, 0);
    let expected = net.output()[..n * 10].to_vec();
    let case = tmp.path().join("case.safetensors");
    common::write_f32_safetensors(
        &case,
        &[
            ("input", &input, vec![n, 1, 8, 8]),
            ("expected", &expected, vec![n, 10]),
        ],
    );

    let out = Command::new(&python)
        .arg(root().join("tests/fixtures/torch_load_model.py"))
        .args([model.to_str().unwrap(), case.to_str().unwrap(), &json])
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), stderr(&out));
    println!("{python}: {text}");
    assert!(out.status.success(), "torch disagrees:\n{text}");
}

/// A GPT run's model.safetensors (jobs/gpt_char.toml names its tensors as nanoGPT does)
/// loads, strict, into nanoGPT's GPT module, which computes trainer's logits.
#[test]
fn nanogpt_loads_a_gpt_runs_weights_and_computes_the_same_logits() {
    let Some(python) = torch_python() else {
        println!("skipped: no Python with torch and safetensors (set TRAINER_TORCH_PYTHON to one)");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let out = trainer(&[
        "run",
        "jobs/gpt_char.toml",
        "-q",
        "--runs-dir",
        tmp.path().to_str().unwrap(),
        "--set",
        "train.max_steps=3",
        "--set",
        "data.val_fraction=0.001",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let dir = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
    let model = dir.join("model.safetensors");
    let bytes = std::fs::read(&model).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let names: Vec<String> = file.names().into_iter().map(|n| n.to_string()).collect();
    assert!(
        names
            .iter()
            .any(|n| n == "transformer.h.3.mlp.c_proj.weight"),
        "{names:?}"
    );

    let spec = trainer::spec::load_job(&dir.join("config.toml"), &[]).unwrap();
    let (n, t, vocabulary) = (2, 64, 73);
    let data = DataShape {
        sample_shape: vec![t],
        classes: Some(vocabulary),
        classes_from: None,
        target_dim: t,
    };
    let graph = Graph::build(&spec, &data).unwrap();
    let w = weights::read(&model, &graph).unwrap();
    let backend = CpuBackend::new(1);
    let mut net = Network::new(&backend, graph, &w.params, n, 0).unwrap();
    let input: Vec<f32> = (0..n * t)
        .map(|i| ((i * 31 + i / 7) % vocabulary) as f32)
        .collect();
    net.set_input(&backend, &input);
    net.forward(&backend, n, false, 0);
    let expected = net.output()[..n * t * vocabulary].to_vec();
    let case = tmp.path().join("case.safetensors");
    common::write_f32_safetensors(
        &case,
        &[
            ("input", &input, vec![n, t]),
            ("expected", &expected, vec![n, t, vocabulary]),
        ],
    );
    let config = r#"{"vocab": 73, "block": 64, "width": 128, "heads": 4, "layers": 4,
                     "bias": false, "gelu": "none"}"#;
    let out = Command::new(&python)
        .arg(root().join("tests/fixtures/nanogpt_logits.py"))
        .args([model.to_str().unwrap(), case.to_str().unwrap(), config])
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), stderr(&out));
    println!("{python}: {text}");
    assert!(out.status.success(), "nanoGPT disagrees:\n{text}");
}
