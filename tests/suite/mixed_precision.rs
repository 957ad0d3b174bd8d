//! Mixed precision (`precision.mode = "fp16" | "bf16"`): half-precision activations with fp32
//! master weights, GradScaler's dynamic loss scaling (skipped steps, backoff, growth, the
//! schedule waiting), exact resume, accuracy against fp32, and the bad inputs.

use crate::common;

use common::{network_in, spec, stderr, trainer};
use std::path::{Path, PathBuf};
use trainer::data::Dataset;
use trainer::graph::DataShape;
use trainer::optim::Optimizer;
use trainer::tensor::cast::{round_to_half, HalfKind};
use trainer::tensor::cpu::CpuBackend;
use trainer::tensor::Backend;
use trainer::train::{
    half_kind, optimizer_step, Batch, MicroBatches, Samples, StepContext, StepSettings,
};

const SMALL_NET: &str = r#"
[data]
source = "synthetic"
batch_size = 16
[model]
layers = [{ type = "linear", out = 24 }, { type = "gelu" }, { type = "dropout", p = 0.1 },
          { type = "linear", out = 5 }]
[optimizer]
type = "adam"
lr = 1e-2
[precision]
mode = "fp16"
"#;

fn shape() -> DataShape {
    DataShape {
        sample_shape: vec![6],
        classes: Some(5),
        classes_from: None,
        target_dim: 1,
    }
}

fn run_dir(o: &std::process::Output) -> PathBuf {
    assert!(o.status.success(), "{}", stderr(o));
    PathBuf::from(String::from_utf8(o.stdout.clone()).unwrap().trim())
}

/// metrics.csv as rows of named cells.
fn metrics(dir: &Path) -> Vec<std::collections::HashMap<String, String>> {
    let mut reader = csv::Reader::from_path(dir.join("metrics.csv")).unwrap();
    let header: Vec<String> = reader
        .headers()
        .unwrap()
        .iter()
        .map(str::to_string)
        .collect();
    reader
        .records()
        .map(|r| {
            header
                .iter()
                .cloned()
                .zip(r.unwrap().iter().map(str::to_string))
                .collect()
        })
        .collect()
}

fn number(row: &std::collections::HashMap<String, String>, column: &str) -> f64 {
    row[column]
        .parse()
        .unwrap_or_else(|_| panic!("{column} = {:?}", row[column]))
}

#[test]
fn a_step_with_an_inf_gradient_is_skipped_leaving_parameters_and_optimizer_state_untouched() {
    let b = CpuBackend::new(1);
    let spec = spec(SMALL_NET);
    let n = 16;
    let mut net = network_in(&spec, &shape(), n, 3, half_kind(spec.precision.mode));
    let mut optimizer = Optimizer::new(&b, &spec, net.graph.param_len).unwrap();
    let x = common::random_vec(n * 6, 4);
    let y: Vec<f32> = (0..n).map(|i| (i % 5) as f32).collect();
    let set = Dataset {
        features: x,
        targets: y,
        len: n,
        ..Dataset::default()
    };
    let samples = Samples::new(&b, set, (6, 1), net.data_reads(), true).unwrap();
    let batch = Batch::<CpuBackend> { samples: &samples };
    let rows: Vec<u64> = (0..n as u64).collect();
    let mut stats = b.new_stats().unwrap();
    let mut micro_step = 0;
    let mut step = |net: &mut _, optimizer: &mut _, loss_scale: f64| {
        let settings = StepSettings {
            lr: 1e-2,
            clip: Some(1.0),
            want_grad_norm: false,
            loss_scale: Some(loss_scale),
            skip_nonfinite: false,
        };
        // Two micro-batches of 8.
        let micro = MicroBatches {
            rows: &rows,
            size: 8,
        };
        let cx = StepContext {
            backend: &b,
            net,
            optimizer,
            stats: &mut stats,
            micro_step: &mut micro_step,
        };
        optimizer_step(cx, &batch, micro, settings)
    };
    // A clean step first, so the optimizer has state to protect.
    assert!(!step(&mut net, &mut optimizer, 1024.0).skipped);
    let params = net.params.clone();
    let state: Vec<Vec<f32>> = optimizer
        .state()
        .iter()
        .map(|(_, b)| (*b).clone())
        .collect();
    // 2^40 times the loss overflows fp16 (max 65504) in the output gradient: inf gradients.
    let result = step(&mut net, &mut optimizer, 2f64.powi(40));
    assert!(result.skipped, "{result:?}");
    assert!(!result.grad_norm.unwrap().is_finite());
    assert_eq!(net.params, params, "a skipped step changed the parameters");
    let after: Vec<Vec<f32>> = optimizer
        .state()
        .iter()
        .map(|(_, b)| (*b).clone())
        .collect();
    assert_eq!(after, state, "a skipped step changed the optimizer state");
    assert_eq!(
        optimizer.steps(),
        1,
        "a skipped step counted as an optimizer step"
    );
    // A sane scale steps again, and reports the norm of the unscaled gradients.
    let result = step(&mut net, &mut optimizer, 1024.0);
    assert!(!result.skipped && result.grad_norm.unwrap().is_finite());
    assert_ne!(net.params, params);
    assert_eq!(optimizer.steps(), 2);
}

#[test]
fn activations_and_their_gradients_hold_half_values_and_the_gradients_stay_close_to_fp32() {
    let b = CpuBackend::new(1);
    let n = 16;
    let mut grads = Vec::new();
    for mode in ["fp32", "bf16", "fp16"] {
        let spec = spec(&SMALL_NET.replace("mode = \"fp16\"", &format!("mode = \"{mode}\"")));
        let half = half_kind(spec.precision.mode);
        let mut net = network_in(&spec, &shape(), n, 3, half);
        let mut stats = b.new_stats().unwrap();
        b.fill(&mut net.grads, 0.0);
        net.forward(&b, n, true, 1);
        if let Some(kind) = half {
            let output = net.output()[..n * 5].to_vec();
            let mut rounded = output.clone();
            round_to_half(kind, &mut rounded);
            assert_eq!(
                output, rounded,
                "{mode}: the output is not made of half values"
            );
        }
        net.loss(&b, n, Some(1.0), &mut stats);
        net.backward(&b, n, 1);
        grads.push(net.grads.clone());
    }
    let difference = |a: &[f32], b: &[f32]| {
        let norm = a.iter().map(|v| v * v).sum::<f32>().sqrt();
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y) * (x - y))
            .sum::<f32>()
            .sqrt()
            / norm
    };
    let (bf16, fp16) = (
        difference(&grads[0], &grads[1]),
        difference(&grads[0], &grads[2]),
    );
    // Rounding happened (the gradients differ), at each format's precision: bf16 keeps 8
    // significant bits, fp16 11.
    assert!(
        bf16 > 1e-5 && bf16 < 2e-2,
        "bf16 relative difference {bf16}"
    );
    assert!(
        fp16 > 1e-7 && fp16 < 3e-3,
        "fp16 relative difference {fp16}"
    );
    assert!(fp16 < bf16);
}

#[test]
fn half_rounding_is_round_to_nearest_even_with_overflow_to_infinity() {
    let mut v = vec![
        1.0 + 2f32.powi(-11),
        1.0 + 3.0 * 2f32.powi(-11),
        65520.0,
        -1e6,
        0.1,
    ];
    round_to_half(HalfKind::F16, &mut v);
    assert_eq!(v[0], 1.0, "a tie rounds to the even neighbour");
    assert_eq!(v[1], 1.0 + 2.0 * 2f32.powi(-10));
    assert_eq!((v[2], v[3]), (f32::INFINITY, f32::NEG_INFINITY));
    assert_eq!(v[4], half::f16::from_f32(0.1).to_f32());
    let mut w = vec![1.0 + 2f32.powi(-8), 3e38];
    round_to_half(HalfKind::Bf16, &mut w);
    assert_eq!(w[0], 1.0);
    assert!(w[1].is_finite(), "bf16 has f32's range");
}

/// Many steps with overflowing gradients at first: the scale starts at 2^40.
const SCALING_JOB: &str = r#"
[job]
name = "scaling"
seed = 2
[data]
source = "synthetic"
samples = 2000
num_features = 16
classes = 4
batch_size = 32
val_fraction = 0.1
[model]
layers = [{ type = "linear", out = 64 }, { type = "relu" }, { type = "dropout", p = 0.1 },
          { type = "linear", out = 4 }]
[optimizer]
type = "adamw"
lr = 2e-3
schedule = { type = "cosine", warmup_steps = 40 }
[train]
epochs = 3
log_every = 1
grad_accum_steps = 2
clip_grad_norm = 1.0
[precision]
mode = "fp16"
init_scale = 1099511627776.0
growth_interval = 12
[checkpoint]
every_steps = 20
"#;

fn write_job(dir: &Path, text: &str) -> PathBuf {
    let path = dir.join("job.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn run_job(job: &Path, runs: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "run",
        job.to_str().unwrap(),
        "--runs-dir",
        runs.to_str().unwrap(),
        "--quiet",
    ];
    args.extend_from_slice(extra);
    trainer(&args)
}

#[test]
fn overflows_halve_the_scale_and_skip_the_step_growth_doubles_it_and_the_schedule_waits() {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), SCALING_JOB);
    let dir = run_dir(&run_job(&job, &tmp.path().join("runs"), &[]));
    let rows: Vec<_> = metrics(&dir)
        .into_iter()
        .filter(|r| r["split"] == "train")
        .collect();
    let skipped: Vec<u64> = rows
        .iter()
        .map(|r| r["skipped_steps"].parse().unwrap())
        .collect();
    let scale: Vec<f64> = rows.iter().map(|r| number(r, "loss_scale")).collect();
    let lr: Vec<f64> = rows.iter().map(|r| number(r, "lr")).collect();
    // The first steps overflow: each is skipped and halves the scale.
    assert!(skipped[0] == 1 && skipped[1] == 2, "{skipped:?}");
    // Every row against GradScaler's rule, replayed on the steps that were skipped.
    let (mut expected, mut clean, mut growths) = (2f64.powi(40), 0, 0);
    let mut applied = 0;
    let was_skipped: Vec<bool> = (0..rows.len())
        .map(|i| skipped[i] > if i == 0 { 0 } else { skipped[i - 1] })
        .collect();
    for i in 0..rows.len() {
        if was_skipped[i] {
            expected *= 0.5;
            clean = 0;
        } else {
            clean += 1;
            applied += 1;
            if clean == 12 {
                expected *= 2.0;
                clean = 0;
                growths += 1;
            }
        }
        assert_eq!(scale[i], expected, "loss scale at step {}", i + 1);
        // The schedule counts only the steps taken: warm-up (40 steps) rises with them.
        if i > 0 && applied < 40 {
            if !was_skipped[i - 1] {
                assert!(
                    lr[i] > lr[i - 1],
                    "step {}: {} after {}",
                    i + 1,
                    lr[i],
                    lr[i - 1]
                );
            } else {
                assert_eq!(lr[i], lr[i - 1], "a skipped step advanced the schedule");
            }
        }
    }
    assert!(growths >= 1, "the scale never grew: {skipped:?}");
    // Training still works.
    let last = rows.last().unwrap();
    assert!(number(last, "loss") < number(&rows[0], "loss"));
}

#[test]
fn resuming_a_mixed_precision_run_gives_the_uninterrupted_run_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), SCALING_JOB);
    let runs = tmp.path().join("runs");
    let full = run_dir(&run_job(&job, &runs, &[]));
    // A copy of the run as a crash after step 40's checkpoint would have left it.
    let crashed = tmp.path().join("crashed");
    std::fs::create_dir_all(crashed.join("checkpoints")).unwrap();
    for name in ["metrics.csv", "config.toml", "train.log"] {
        std::fs::copy(full.join(name), crashed.join(name)).unwrap();
    }
    let kept = "step-00000040.safetensors";
    for step in ["step-00000020.safetensors", kept] {
        std::fs::copy(
            full.join("checkpoints").join(step),
            crashed.join("checkpoints").join(step),
        )
        .unwrap();
    }
    run_dir(&run_job(
        &job,
        &runs,
        &["--resume", crashed.to_str().unwrap()],
    ));
    let without_timing = |dir: &Path| -> Vec<Vec<String>> {
        metrics(dir)
            .into_iter()
            .map(|r| {
                let mut cells: Vec<(String, String)> = r
                    .into_iter()
                    .filter(|(k, _)| !common::TIMING_COLUMNS.contains(&k.as_str()))
                    .collect();
                cells.sort();
                cells.into_iter().map(|(k, v)| format!("{k}={v}")).collect()
            })
            .collect()
    };
    assert_eq!(without_timing(&crashed), without_timing(&full));
    assert_eq!(
        std::fs::read(crashed.join("model.safetensors")).unwrap(),
        std::fs::read(full.join("model.safetensors")).unwrap()
    );
}

/// Final validation accuracy of `job` with `--set` overrides.
fn val_accuracy(job: &str, sets: &[&str]) -> f64 {
    let tmp = tempfile::tempdir().unwrap();
    let mut args = vec![
        "run",
        job,
        "--runs-dir",
        tmp.path().to_str().unwrap(),
        "--quiet",
        "--set",
        "device.type=cpu",
    ];
    for s in sets {
        args.extend(["--set", s]);
    }
    let dir = run_dir(&trainer(&args));
    let rows = metrics(&dir);
    let split = if rows.iter().any(|r| r["split"] == "test") {
        "test"
    } else {
        "val"
    };
    number(
        rows.iter().rev().find(|r| r["split"] == split).unwrap(),
        "accuracy",
    )
}

/// The final accuracy of fp16 and bf16 training is within half a percentage point of
/// fp32's, each averaged over three seeds (one seed's accuracy alone varies by more: the
/// Fashion-MNIST MLP's fp32 runs give 89.44% and 88.52% for seeds 0 and 1).
fn assert_half_precision_matches_fp32(job: &str) {
    let mean = |mode: &str| {
        let runs: Vec<f64> = (0..3)
            .map(|seed| {
                let seed = format!("job.seed={seed}");
                let mode = format!("precision.mode={mode}");
                val_accuracy(job, &[&seed, &mode])
            })
            .collect();
        println!("{job}: {mode} {runs:?}");
        runs.iter().sum::<f64>() / 3.0
    };
    let fp32 = mean("fp32");
    for mode in ["fp16", "bf16"] {
        let half = mean(mode);
        assert!(
            (half - fp32).abs() <= 0.005,
            "{job}: {mode} reached {half:.4} on average, fp32 {fp32:.4}"
        );
    }
}

#[test]
fn fp16_and_bf16_train_the_digits_mlp_to_the_fp32_accuracy() {
    assert_half_precision_matches_fp32("jobs/mlp.toml");
}

#[test]
fn fp16_and_bf16_train_the_fashion_mnist_mlp_to_the_fp32_accuracy() {
    let data = Path::new("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz");
    if !data.exists() {
        println!(
            "skipped: Fashion-MNIST is not installed ({}; apt-get install dataset-fashion-mnist)",
            data.display()
        );
        return;
    }
    assert_half_precision_matches_fp32("jobs/fashion_mnist_mlp.toml");
}

/// SCALING_JOB with a fixed loss scale that overflows every step.
const FIXED_SCALE_1E30: [&str; 6] = [
    "--set",
    "precision.loss_scale=1e30",
    // The dynamic scaler's settings would now be refused as doing nothing.
    "--set",
    "precision.init_scale=65536",
    "--set",
    "precision.growth_interval=2000",
];

fn summary_of(out: &std::process::Output) -> serde_json::Value {
    let text = std::fs::read_to_string(run_dir(out).join("summary.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

#[test]
fn a_fixed_loss_scale_that_overflows_every_step_ends_the_run_as_diverged() {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), SCALING_JOB);
    let args = [&FIXED_SCALE_1E30[..], &["--set", "train.epochs=5"]].concat();
    let out = run_job(&job, &tmp.path().join("runs"), &args);
    // It completed with exit 0, its weights never changed, before 100 in a row ended it.
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("training diverged: 100 steps in a row (steps 1..=100, epoch 4)")
            && err.contains("at loss scale 1e30"),
        "{err}"
    );
}

/// The same, in a run too short for 100 in a row: it completes, says that nothing was
/// trained, and summary.json counts the skipped steps.
#[test]
fn a_short_run_whose_every_step_overflowed_warns_that_nothing_was_trained() {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), SCALING_JOB);
    let out = run_job(&job, &tmp.path().join("runs"), &FIXED_SCALE_1E30);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains(
            "steps were skipped for inf/NaN gradients (loss scaling; the scale is now 1e30)"
        ) && err.contains("nothing was trained"),
        "{err}"
    );
    let summary = summary_of(&out);
    assert_eq!(summary["skipped_steps"], summary["steps"]);
    // The dynamic scaler's own overflows are counted too.
    let summary = summary_of(&run_job(&job, &tmp.path().join("runs2"), &[]));
    let skipped = summary["skipped_steps"].as_u64().unwrap();
    assert!(skipped > 0 && skipped < summary["steps"].as_u64().unwrap());
}

#[test]
fn bad_precision_settings_are_named() {
    // The scale is an f32, as GradScaler's: 1e39 would be inf.
    for key in ["loss_scale", "init_scale"] {
        let out = trainer(&[
            "check",
            "jobs/mlp.toml",
            "--set",
            "precision.mode=\"fp16\"",
            "--set",
            &format!("precision.{key}=1e39"),
        ]);
        assert_eq!(out.status.code(), Some(2));
        assert!(
            stderr(&out).contains(&format!("`precision.{key}`: 1e39 given"))
                && stderr(&out).contains("that an f32 holds (1.4e-45 to 3.4028235e38)"),
            "{}",
            stderr(&out)
        );
        // As small as an f32 holds is a scale; smaller rounds to 0, which is none.
        let check = |value: &str| {
            trainer(&[
                "check",
                "jobs/mlp.toml",
                "--set",
                "precision.mode=\"fp16\"",
                "--set",
                &format!("precision.{key}={value}"),
            ])
        };
        assert_eq!(check("3.4028235e38").status.code(), Some(0));
        let out = check("1e-50");
        assert_eq!(out.status.code(), Some(2));
        assert!(stderr(&out).contains("1e-50 given"), "{}", stderr(&out));
    }
    let out = trainer(&[
        "check",
        "jobs/mlp.toml",
        "--set",
        "precision.loss_scale=\"dynamic\"",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("precision.loss_scale") && err.contains("fp16"),
        "{err}"
    );
    let out = trainer(&[
        "check",
        "jobs/mlp.toml",
        "--set",
        "precision.mode=\"fp16\"",
        "--set",
        "precision.backoff_factor=2",
        "--set",
        "precision.loss_scale=-4",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("precision.backoff_factor") && err.contains("2 given"),
        "{err}"
    );
    assert!(
        err.contains("precision.loss_scale") && err.contains("-4 given"),
        "{err}"
    );
    let out = trainer(&[
        "check",
        "jobs/mlp.toml",
        "--set",
        "precision.mode=\"fp16\"",
        "--set",
        "precision.growth_factor=1",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("key `precision.growth_factor`: 1 given; must be greater than 1"),
        "{}",
        stderr(&out)
    );
    // bf16 scales nothing unless asked: the scaler's settings would do nothing.
    let out = trainer(&[
        "check",
        "jobs/mlp.toml",
        "--set",
        "precision.mode=\"bf16\"",
        "--set",
        "precision.init_scale=1024",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains(
            "`precision.init_scale`: 1024 given, but it only applies to dynamic loss scaling, and \
             this job has precision.mode = \"bf16\", which scales no loss unless asked"
        ),
        "{}",
        stderr(&out)
    );
    let out = trainer(&["check", "jobs/mlp.toml", "--set", "precision.mode=\"fp8\""]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("fp8"), "{}", stderr(&out));
}

/// An in-place activation that rounds its neighbour's output (forward) or its neighbour's
/// input gradient (backward) in its own pass, or a ReLU that the linear layer before it
/// applies, computes the same bits as the separate passes, and only where it is that value's
/// only reader: here a ReLU whose input is also the
/// shortcut of a residual add, one whose output is, and one reading a layer other than the
/// one before it are left alone (a wrong fusion would hand an add an unrounded value and
/// change the bits).
#[test]
fn activations_that_round_their_neighbours_give_the_same_bits_and_only_where_they_alone_read() {
    let b = CpuBackend::new(1);
    let n = 8;
    let job = String::from(
        r#"
        [data]
        source = "synthetic"
        [model]
        layers = [
          { type = "flatten" },
          { type = "linear", out = 16 }, { type = "relu" },
          { type = "linear", out = 16, name = "pre" }, { type = "relu", name = "shared" },
          { type = "linear", out = 16 }, { type = "tanh" },
          { type = "linear", out = 16, name = "branch" },
          { type = "add", inputs = ["branch", "shared"] }, { type = "sigmoid" },
          { type = "linear", out = 16, name = "skip" }, { type = "relu", name = "read_twice" },
          { type = "linear", out = 16, name = "after" },
          { type = "add", inputs = ["after", "read_twice"], name = "joined" },
          { type = "linear", out = 16, name = "far" },
          { type = "linear", out = 16, name = "near", inputs = ["joined"] },
          { type = "relu", inputs = ["far"], name = "not_beside" },
          { type = "add", inputs = ["near", "not_beside"] },
          { type = "linear", out = 5 },
        ]
        [optimizer]
        type = "sgd"
        lr = 0.1
        [checkpoint]
        activations = ACTIVATIONS
        "#,
    );
    // Also with activation checkpointing, whose backward recomputes segments.
    let cases = [
        ("bf16", "\"none\""),
        ("fp16", "\"none\""),
        ("bf16", "{ segments = 3 }"),
    ];
    for (mode, activations) in cases {
        let job = spec(&job.replace("ACTIVATIONS", activations));
        let kind = half_kind(if mode == "bf16" {
            trainer::spec::PrecisionMode::Bf16
        } else {
            trainer::spec::PrecisionMode::Fp16
        });
        let run = |fused: bool| {
            let net = network_in(&job, &shape(), n, 5, kind);
            let mut net = if fused { net } else { net.without_fusion() };
            let mut stats = b.new_stats().unwrap();
            b.fill(&mut net.grads, 0.0);
            net.forward(&b, n, true, 1);
            net.loss(&b, n, Some(1.0), &mut stats);
            net.backward(&b, n, 1);
            let loss = b.take_stats(&mut stats).loss_sum;
            net.forward(&b, n, false, 0);
            let fusions = net.fusions();
            (
                net.grads.clone(),
                loss,
                net.output()[..n * 5].to_vec(),
                fusions,
            )
        };
        let (grads, loss, output, fusions) = run(true);
        let (plain_grads, plain_loss, plain_output, _) = run(false);
        assert!(grads.iter().any(|&g| g != 0.0));
        let case = format!("{mode}, activations = {activations}");
        assert!(grads == plain_grads, "{case}: gradients differ");
        assert_eq!(loss.to_bits(), plain_loss.to_bits(), "{case}: loss");
        assert!(output == plain_output, "{case}: evaluation output differs");
        // Forward: every activation beside its input's producer, read by it alone, rounds that
        // input (the tanh; the sigmoid, whose is the add's output), or is applied by the linear
        // layer before it (the three ReLUs); "not_beside" is neither. Backward: the first
        // ReLU, the tanh and the sigmoid round the next linear's dx; "shared" and
        // "read_twice", whose outputs an add reads too, do not.
        if activations == "\"none\"" {
            assert_eq!(fusions, (2, 3, 3), "{case}: which layers fuse");
        } else {
            assert!(
                fusions.0 > 0 && fusions.1 > 0 && fusions.2 > 0,
                "{case}: nothing fused ({fusions:?})"
            );
        }
    }
}

/// A linear layer that reads token ids (which stay f32, for the embedding beside it)
/// multiplies their rounded values, as autocast casts a matrix product's input, and as the
/// CUDA backend's half products do: the same bits, forward and backward, as the layer alone
/// on data that mixed precision rounds.
#[test]
fn a_linear_layer_reading_token_ids_multiplies_them_rounded() {
    let job = |layers: &str| {
        spec(&format!(
            "[data]\nsource = \"synthetic\"\n[model]\nlayers = [{layers}]\n\
             [optimizer]\ntype = \"sgd\"\nlr = 0.1\n[precision]\nmode = \"bf16\"\n"
        ))
    };
    let with_ids = job(
        r#"{ type = "embedding", num_embeddings = 1000, embedding_dim = 3 },
           { type = "flatten", name = "embedded" },
           { type = "linear", out = 3, inputs = ["input"], name = "direct" },
           { type = "linear", out = 3, inputs = ["embedded"], name = "from_ids" },
           { type = "add", inputs = ["direct", "from_ids"] }"#,
    );
    let alone = job(r#"{ type = "linear", out = 3 }"#);
    let shape = DataShape {
        sample_shape: vec![4],
        classes: Some(3),
        classes_from: None,
        target_dim: 1,
    };
    let (n, b) = (5, CpuBackend::new(1));
    // The linear layer's weights in both; the embedding branch contributes exact zeros.
    let alone_graph = trainer::graph::Graph::build(&alone, &shape).unwrap();
    let weights = alone_graph.init_params(7);
    let ids_graph = trainer::graph::Graph::build(&with_ids, &shape).unwrap();
    let mut params = vec![0.0; ids_graph.param_len];
    let offset = |g: &trainer::graph::Graph, name: &str| {
        let entries = g.state_dict_entries();
        entries.iter().find(|e| e.name == name).unwrap().offset
    };
    let at = |name: &str| offset(&ids_graph, name);
    let alone_bias = offset(&alone_graph, "0.bias");
    params[at("direct.weight")..][..12].copy_from_slice(&weights[..12]);
    params[at("direct.bias")..][..3].copy_from_slice(&weights[alone_bias..][..3]);
    // A zero table: the branch adds zeros, and still sends gradients to the rows it read.
    params[at("from_ids.weight")..][..36].fill(0.5);

    // Ids that bf16 moves (257 → 256, 999 → 1000) and ones it keeps.
    let ids: Vec<f32> = (0..n * 4)
        .map(|i| [257.0, 999.0, 3.0, 640.0][i % 4] + (i / 4) as f32)
        .collect();
    let kind = Some(HalfKind::Bf16);
    let mut results = Vec::new();
    for (spec, params) in [(&with_ids, &params), (&alone, &weights)] {
        let mut net = common::network_with(spec, &shape, n, 1, kind, Some(params));
        net.set_input(&b, &ids);
        for (i, t) in net.targets_mut()[..n].iter_mut().enumerate() {
            *t = (i % 3) as f32;
        }
        let mut stats = b.new_stats().unwrap();
        net.start_gradients();
        net.forward(&b, n, true, 1);
        // Read before the loss, which may write its gradient over it.
        let output = net.output()[..n * 3].to_vec();
        net.loss(&b, n, Some(1.0), &mut stats);
        net.backward(&b, n, 1);
        net.finish_gradients(&b);
        let dw = net.grads.clone();
        results.push((output, dw));
    }
    let (with_ids, alone) = (&results[0], &results[1]);
    assert_eq!(with_ids.0, alone.0, "outputs");
    assert_eq!(
        with_ids.1[at("direct.weight")..][..12],
        alone.1[..12],
        "the linear layer's weight gradient"
    );
    assert_eq!(
        with_ids.1[at("direct.bias")..][..3],
        alone.1[alone_bias..][..3],
        "the linear layer's bias gradient"
    );
    // The ids themselves stay whole: the embedding's gradient lands on rows 257 and 999.
    let embedding = &with_ids.1[at("0.weight")..][..1000 * 3];
    let touched = |row: usize| embedding[row * 3..][..3].iter().any(|&g| g != 0.0);
    assert!(touched(257) && touched(999) && !touched(256));
}
