//! Data parallelism on the CPU: N replicas in threads train the model one device trains on
//! the full batches (within float rounding), with accumulation, uneven last batches and
//! dropout; a checkpoint written by 2 replicas resumes on 1; and the bad jobs are refused
//! before anything runs.

use crate::common;

use common::{stderr, trainer};
use std::path::{Path, PathBuf};
use trainer::checkpoint;
use trainer::data;
use trainer::graph::{DataShape, GradBuckets, GradientSync, Graph};
use trainer::run::MetricsWriter;
use trainer::spec::JobSpec;
use trainer::tensor::cpu::CpuBackend;
use trainer::tensor::Backend;
use trainer::train::{train_session, CpuReplicas, Outcome, Session};

/// Trains `spec` through the library: on one device, or on `replicas` CPU replicas of one
/// thread each.
fn train(spec: &JobSpec, replicas: Option<usize>) -> Outcome {
    let data = data::load(&spec.data, spec.job.seed).unwrap();
    let shape = DataShape {
        sample_shape: data.sample_shape.clone(),
        classes: data.classes,
        classes_from: None,
        target_dim: data.target_dim,
    };
    let graph = Graph::build(spec, &shape).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut metrics = MetricsWriter::create(&dir.path().join("metrics.csv")).unwrap();
    let mut session = Session::default();
    if let Some(n) = replicas {
        session.parallel = Some(Box::new(CpuReplicas::new(n, 1, graph.param_len).unwrap()));
    }
    train_session(
        &CpuBackend::new(1),
        spec,
        graph,
        data,
        &mut metrics,
        session,
    )
    .unwrap()
}

fn job(samples: usize, batch: usize, accum: usize, optimizer: &str) -> JobSpec {
    job_with(samples, batch, accum, optimizer, "")
}

/// `job` with `extra` TOML at the end.
fn job_with(samples: usize, batch: usize, accum: usize, optimizer: &str, extra: &str) -> JobSpec {
    common::spec(&format!(
        r#"
        [job]
        seed = 11
        [data]
        source = "synthetic"
        samples = {samples}
        num_features = 12
        classes = 3
        batch_size = {batch}
        [model]
        layers = [{{ type = "linear", out = 32 }}, {{ type = "relu" }}, {{ type = "dropout", p = 0.25 }},
                  {{ type = "linear", out = 16 }}, {{ type = "tanh" }}, {{ type = "linear", out = 3 }}]
        [optimizer]
        {optimizer}
        [train]
        epochs = 2
        grad_accum_steps = {accum}
        log_every = 3
        {extra}
        "#
    ))
}

const SGD: &str = "type = \"sgd\"\nlr = 0.05\nmomentum = 0.9";
const ADAMW: &str = "type = \"adamw\"\nlr = 0.003";

fn max_relative_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / x.abs().max(y.abs()).max(1e-3))
        .fold(0.0, f32::max)
}

/// One device against 2 and 4 replicas: same steps, same samples, same parameters (1e-5
/// relative), the same logged loss. 250 samples in batches of 32 end each epoch with a batch
/// of 26 (shares 13/13, or 7/7/6/6: weighted by rows); 258 with one of 2 (1/1/0/0: two
/// replicas idle); the dropout layer must draw the whole batch's masks in every replica.
#[test]
fn replicas_train_the_same_model_as_one_device_on_the_full_batch() {
    for (samples, accum, optimizer) in [(250, 1, SGD), (258, 3, ADAMW), (250, 2, ADAMW)] {
        let spec = job(samples, 32, accum, optimizer);
        let one = train(&spec, None);
        assert!(one.steps >= 6, "{} steps", one.steps);
        for replicas in [2, 4] {
            let what = format!("{samples} samples, accumulation {accum}, {replicas} replicas");
            let many = train(&spec, Some(replicas));
            assert_eq!(many.steps, one.steps, "{what}");
            assert_eq!(many.train_samples, one.train_samples, "{what}");
            let diff =
                max_relative_difference(&many.final_weights.params, &one.final_weights.params);
            assert!(diff < 1e-5, "{what}: max relative difference {diff}");
            let (a, b) = (many.last_train.unwrap(), one.last_train.clone().unwrap());
            assert!(
                (a.loss - b.loss).abs() < 1e-5 * b.loss,
                "{what}: loss {a:?} vs {b:?}"
            );
            assert_eq!(a.accuracy, b.accuracy, "{what}");
            assert!(
                (a.grad_norm.unwrap() - b.grad_norm.unwrap()).abs() < 1e-4 * b.grad_norm.unwrap(),
                "{what}"
            );
        }
    }
}

/// fp16 with a loss scale of 2^40: the first steps overflow. The inf/NaN check follows the
/// all-reduce, so every replica skips exactly the steps one device skips (replicas that
/// skipped on their own would drift apart, which `verify` turns into an error).
#[test]
fn with_fp16_every_replica_skips_the_steps_one_device_skips() {
    let precision =
        "[precision]\nmode = \"fp16\"\ninit_scale = 1099511627776.0\ngrowth_interval = 4";
    let spec = job_with(250, 32, 2, ADAMW, precision);
    let one = train(&spec, None);
    let skipped = one.last_train.as_ref().unwrap().skipped_steps.unwrap();
    assert!(skipped >= 2, "{skipped} steps skipped");
    for replicas in [2, 4] {
        let many = train(&spec, Some(replicas));
        let (a, b) = (many.last_train.unwrap(), one.last_train.clone().unwrap());
        assert_eq!(
            (a.skipped_steps, a.loss_scale),
            (b.skipped_steps, b.loss_scale),
            "{replicas} replicas"
        );
        let diff = max_relative_difference(&many.final_weights.params, &one.final_weights.params);
        assert!(
            diff < 1e-3,
            "{replicas} replicas: max relative difference {diff}"
        );
    }
}

/// Buckets averaged during the backward pass (parallel.overlap, DDP's way) give the bits of
/// averaging the whole buffer after it: every element is summed over the replicas in rank
/// order either way. Tiny buckets (about 26 values: one per layer) with accumulation and a
/// last batch that leaves replicas idle (they average after their backward pass, in the
/// same buckets).
#[test]
fn averaging_bucket_by_bucket_during_backward_is_averaging_after_it_bit_for_bit() {
    let tiny = job_with(258, 32, 3, ADAMW, "[parallel]\nbucket_mb = 0.0001");
    let after = job_with(258, 32, 3, ADAMW, "[parallel]\noverlap = false");
    for replicas in [2, 4] {
        assert_eq!(
            train(&tiny, Some(replicas)).final_weights.params,
            train(&after, Some(replicas)).final_weights.params,
            "{replicas} replicas"
        );
    }
}

/// What the backward pass hands to a `GradientSync`.
#[derive(Default)]
struct Handed {
    buckets: Vec<(std::ops::Range<usize>, Vec<f32>)>,
    finished: usize,
}

impl GradientSync<CpuBackend> for Handed {
    fn ready(&mut self, _: &CpuBackend, grads: &mut Vec<f32>, bucket: std::ops::Range<usize>) {
        self.buckets.push((bucket.clone(), grads[bucket].to_vec()));
    }
    fn finished(&mut self, _: &CpuBackend, _: &mut Vec<f32>) {
        self.finished += 1;
    }
}

/// Each bucket reaches the all-reduce once, from the buffer's end down, holding its final
/// gradients (no later layer writes into it), then `finished`: also through a residual
/// branch and activation checkpointing, whose recomputation runs inside the backward pass.
#[test]
fn the_backward_pass_hands_over_each_bucket_once_its_gradients_are_final() {
    let spec = common::spec(
        r#"
        [data]
        source = "synthetic"
        [model]
        layers = [{ type = "linear", out = 24, name = "a" }, { type = "relu" },
                  { type = "linear", out = 24 }, { type = "tanh", name = "t" },
                  { type = "add", inputs = ["a", "t"] }, { type = "layernorm" },
                  { type = "linear", out = 16 }, { type = "relu" }, { type = "linear", out = 4 }]
        [optimizer]
        type = "sgd"
        lr = 0.1
        [checkpoint]
        activations = { segments = 3 }
        "#,
    );
    let shape = DataShape {
        sample_shape: vec![10],
        classes: Some(4),
        classes_from: None,
        target_dim: 1,
    };
    let b = CpuBackend::new(1);
    for cap_bytes in [64, 1200, 1 << 20] {
        let mut net = common::network(&spec, &shape, 6, 3);
        let buckets = GradBuckets::new(&net.graph, cap_bytes);
        let expected: Vec<_> = buckets.in_backward_order().collect();
        net.set_grad_buckets(Some(buckets));
        b.fill(&mut net.grads, 0.0);
        let mut stats = b.new_stats().unwrap();
        let mut handed = Handed::default();
        assert!(net.train_step(&b, 6, 1.0, &mut stats, 0, Some(&mut handed)));
        let ranges: Vec<_> = handed.buckets.iter().map(|(r, _)| r.clone()).collect();
        assert_eq!(ranges, expected, "cap {cap_bytes} bytes");
        assert_eq!(ranges.last().unwrap().start, 0);
        assert_eq!(ranges[0].end, net.graph.param_len);
        for (bucket, values) in &handed.buckets {
            assert_eq!(
                values,
                &net.grads[bucket.clone()],
                "bucket {bucket:?} changed later"
            );
        }
        assert_eq!(handed.finished, 1);
        assert!(net.grads.iter().any(|&g| g != 0.0));
    }
    // Without buckets the caller averages after the pass.
    let mut net = common::network(&spec, &shape, 6, 3);
    let mut stats = b.new_stats().unwrap();
    let mut handed = Handed::default();
    assert!(!net.train_step(&b, 6, 1.0, &mut stats, 0, Some(&mut handed)));
    assert!(handed.buckets.is_empty() && handed.finished == 0);
}

#[test]
fn one_replica_through_the_data_parallel_path_is_the_one_device_run_exactly() {
    let spec = job(250, 32, 2, ADAMW);
    assert_eq!(
        train(&spec, Some(1)).final_weights.params,
        train(&spec, None).final_weights.params
    );
}

#[test]
fn dropout_masks_follow_the_global_rows_not_the_replica() {
    // Without the sample offset every replica would draw the first rows' masks, and the
    // result would differ from one device by far more than rounding.
    let spec = job(256, 32, 1, SGD);
    let diff = max_relative_difference(
        &train(&spec, Some(2)).final_weights.params,
        &train(&spec, None).final_weights.params,
    );
    assert!(diff < 1e-5, "{diff}");
    let mut without_dropout = spec.clone();
    without_dropout.model.layers.remove(2);
    let changed = max_relative_difference(
        &train(&without_dropout, None).final_weights.params,
        &train(&spec, None).final_weights.params,
    );
    assert!(changed > 1e-3, "dropout changes the model: {changed}");
}

/// A job file `name` in `dir`: synthetic data, dropout, checkpoints every epoch, and
/// `extra` TOML at the end.
fn write_job(dir: &Path, name: &str, extra: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(
        &path,
        format!(
            r#"
[job]
seed = 3
[data]
source = "synthetic"
samples = 300
num_features = 10
classes = 4
val_fraction = 0.2
batch_size = 32
[model]
layers = [{{ type = "linear", out = 24 }}, {{ type = "relu" }}, {{ type = "dropout", p = 0.2 }}, {{ type = "linear", out = 4 }}]
[optimizer]
type = "adam"
lr = 0.01
[train]
epochs = 2
log_every = 2
[checkpoint]
every_epochs = 1
{extra}
"#
        ),
    )
    .unwrap();
    path
}

/// The same job with `data.global_batch_size = global` instead of `data.batch_size`.
fn with_global_batch(job: &Path, global: usize) -> PathBuf {
    let path = job.with_file_name(format!("global-{global}.toml"));
    let text = std::fs::read_to_string(job)
        .unwrap()
        .replace("batch_size = 32", &format!("global_batch_size = {global}"));
    std::fs::write(&path, text).unwrap();
    path
}

fn run(job: &Path, runs: &Path, extra: &[&str]) -> std::process::Output {
    let (job, runs) = (job.to_str().unwrap(), runs.to_str().unwrap());
    let mut args = vec!["run", job, "--runs-dir", runs, "-q"];
    args.extend_from_slice(extra);
    trainer(&args)
}

fn final_checkpoint(dir: &Path) -> (u64, Vec<f32>) {
    let (step, path) = checkpoint::list(&dir.join(checkpoint::DIR)).pop().unwrap();
    (step, checkpoint::load(&path).unwrap().params)
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// `device.type = "auto"` (the default) with replicas in threads: CPU replicas, with or
/// without a GPU (one process drives one GPU), and the log says why.
#[test]
fn replicas_in_threads_on_device_auto_are_cpu_replicas() {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), "dp.toml", "");
    let runs = tmp.path().join("runs");
    let (job, runs) = (job.to_str().unwrap(), runs.to_str().unwrap());
    let set = ["--set", "parallel.replicas=2"];
    let out = trainer(&[&["run", job, "--runs-dir", runs][..], &set].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let provenance = json(&dir.join("provenance.json"));
    assert_eq!(provenance["device"], "cpu: 2 replicas x 1 thread each");
    assert!(
        stderr(&out).contains("device auto: cpu (parallel.replicas in threads are CPU replicas"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_checkpoint_of_two_replicas_resumes_on_one_and_on_four() {
    let tmp = tempfile::tempdir().unwrap();
    // CPU replicas throughout (one replica would take a GPU where there is one).
    let job = write_job(tmp.path(), "dp.toml", "[device]\ntype = \"cpu\"");
    let runs = tmp.path().join("runs");
    let out = run(&job, &runs, &["--set", "parallel.replicas=2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let dir = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
    let provenance = json(&dir.join("provenance.json"));
    assert_eq!(provenance["device"], "cpu: 2 replicas x 1 thread each");
    assert_eq!(provenance["batch"]["per_replica"], 16);
    assert_eq!(provenance["batch"]["global"], 32);
    let (steps, two) = final_checkpoint(&dir);
    let first = checkpoint::list(&dir.join(checkpoint::DIR))[0].1.clone();
    let metrics_rows = std::fs::read_to_string(dir.join("metrics.csv"))
        .unwrap()
        .lines()
        .count();

    for replicas in [
        None,
        Some("parallel.devices=[\"cpu\", \"cpu\", \"cpu\", \"cpu\"]"),
    ] {
        // Back to the first checkpoint of the completed run: --force, as that replaces it.
        let mut extra = vec!["--resume", first.to_str().unwrap(), "--force"];
        if let Some(set) = replicas {
            extra.extend(["--set", set]);
        }
        let out = run(&job, &runs, &extra);
        assert!(out.status.success(), "{replicas:?}: {}", stderr(&out));
        let (resumed_steps, resumed) = final_checkpoint(&dir);
        assert_eq!(resumed_steps, steps);
        let diff = max_relative_difference(&resumed, &two);
        assert!(diff < 1e-5, "{replicas:?}: max relative difference {diff}");
        let lines = std::fs::read_to_string(dir.join("metrics.csv"))
            .unwrap()
            .lines()
            .count();
        assert_eq!(lines, metrics_rows, "{replicas:?}");
    }
    let device = json(&dir.join("summary.json"))["device"].clone();
    assert_eq!(device, "cpu: 4 replicas x 1 thread each");
}

#[test]
fn check_prints_how_the_global_batch_is_made() {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(
        tmp.path(),
        "dp.toml",
        "[parallel]\ndevices = [\"cpu\", \"cpu\"]",
    );
    let out = trainer(&[
        "check",
        job.to_str().unwrap(),
        "--set",
        "train.grad_accum_steps=3",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("batch: 16 per replica x 2 replicas x 3 accumulation steps = 96 global"),
        "{text}"
    );
    assert!(
        text.contains("batch 16, per replica (2 replicas)"),
        "{text}"
    );
    // One bucket: the model is far below the 1 MiB first bucket.
    assert!(
        text.contains("all-reduce: gradients averaged in 1 bucket during the backward pass"),
        "{text}"
    );

    // global_batch_size instead of batch_size: the micro-batch and each share are derived.
    let global = with_global_batch(&job, 96);
    for (replicas, expected) in [
        ("[\"cpu\", \"cpu\"]", "16 per replica x 2 replicas x 3"),
        (
            "[\"cpu\", \"cpu\", \"cpu\", \"cpu\"]",
            "8 per replica x 4 replicas x 3",
        ),
    ] {
        let set = format!("parallel.devices={replicas}");
        let out = trainer(&[
            "check",
            global.to_str().unwrap(),
            "--set",
            "train.grad_accum_steps=3",
            "--set",
            &set,
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(
            text.contains(&format!("batch: {expected} accumulation steps = 96 global")),
            "{text}"
        );
    }
}

/// Each case: extra job text, --set arguments, and what the error must say.
#[test]
fn bad_data_parallel_jobs_are_refused_before_anything_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let runs = tmp.path().join("runs");
    let cases: [(&str, &[&str], &[&str]); 8] = [
        (
            "[parallel]\nreplicas = 3",
            &[],
            &[
                "key `data.batch_size`",
                "32 given with 3 data-parallel replicas",
                "multiple of 3",
            ],
        ),
        (
            "[parallel]\nreplicas = 2",
            // Both in one layer (a --set of one over the file's other takes its place).
            &[
                "--set",
                "data.global_batch_size=64",
                "--set",
                "data.batch_size=32",
            ],
            &[
                "--set data.global_batch_size: key `data.global_batch_size`",
                "64 given together with data.batch_size = 32",
            ],
        ),
        (
            "[parallel]\ndevices = [\"cuda:0\", \"cuda:1\"]\nlaunch = \"threads\"",
            &[],
            &[
                "key `parallel.launch`",
                "\"threads\" given, but the replicas are on GPUs",
                "use \"processes\" or \"auto\"",
            ],
        ),
        (
            "[parallel]\ndevices = [\"cpu\", \"cuda:0\"]",
            &[],
            &["key `parallel.devices`", "mixes cpu and cuda"],
        ),
        (
            "[parallel]\nreplicas = 2\nlaunch = \"threads\"\n[device]\ntype = \"cuda:0\"",
            &[],
            &["key `parallel.launch`", "one process drives one GPU"],
        ),
        (
            "[parallel]\nreplicas = 2\ndevices = [\"cpu\", \"cpu\"]",
            &[],
            &[
                "key `parallel.replicas`",
                "given together with parallel.devices",
            ],
        ),
        (
            "[parallel]\nreplicas = 2\nbucket_mb = 0",
            &[],
            &[
                "key `parallel.bucket_mb`",
                "0 given; must be a size in MiB above 0",
            ],
        ),
        (
            "[parallel]\ndevices = [\"cpu\", \"tpu\"]",
            &[],
            &[
                "key `parallel.devices[1]`",
                "\"tpu\" given; allowed: \"cpu\" or \"cuda:N\"",
            ],
        ),
    ];
    let refused = |job: &Path, sets: &[&str], needles: &[&str], case: &str| {
        let mut args = vec!["--name", "refused"];
        args.extend_from_slice(sets);
        let out = run(job, &runs, &args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{case}: {err}");
        // The problem is said where the value came from: the file, or (needles say) --set.
        let file = job.file_name().unwrap().to_str().unwrap();
        assert!(
            !sets.is_empty() || err.contains(file),
            "{case} names the file: {err}"
        );
        for needle in needles {
            assert!(err.contains(needle), "{case}: missing {needle:?} in {err}");
        }
        assert!(
            !runs.join("refused").exists(),
            "{case} made a run directory"
        );
    };
    for (extra, sets, needles) in cases {
        refused(
            &write_job(tmp.path(), "dp.toml", extra),
            sets,
            needles,
            extra,
        );
    }
    let job = write_job(tmp.path(), "dp.toml", "[parallel]\nreplicas = 4");
    refused(
        &with_global_batch(&job, 40),
        &["--set", "train.grad_accum_steps=3"],
        &[
            "global-40.toml: key `data.global_batch_size`",
            "40 given; must be a multiple of 4 replica(s) x 3 accumulation step(s) = 12",
        ],
        "global batch 40",
    );
}
