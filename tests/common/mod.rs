//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use trainer::graph::{DataShape, Graph, Network};
use trainer::spec::JobSpec;
use trainer::tensor::cpu::CpuBackend;
use trainer::tensor::rng::Rng;
use trainer::tensor::HalfKind;

/// The project root: the manifest directory, or the current directory where the build
/// machine's path does not exist (test binaries carried to the GPU machine).
pub fn root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    if manifest.join("Cargo.toml").exists() {
        manifest
    } else {
        std::env::current_dir().unwrap()
    }
}

/// The trainer binary: $TRAINER_BIN when set, else the one cargo built.
pub fn trainer_bin() -> PathBuf {
    std::env::var_os("TRAINER_BIN").map_or_else(
        || PathBuf::from(env!("CARGO_BIN_EXE_trainer")),
        PathBuf::from,
    )
}

/// A job spec from TOML text (the text alone, no layering).
pub fn spec(text: &str) -> JobSpec {
    toml::from_str(text).unwrap_or_else(|e| panic!("test spec does not parse: {e}"))
}

/// A network on the CPU for `spec`, with random inputs and targets for `n` samples.
pub fn network(spec: &JobSpec, data: &DataShape, n: usize, seed: u64) -> Network<CpuBackend> {
    network_in(spec, data, n, seed, None)
}

/// `network` in mixed precision with activations in `half` (None: fp32).
pub fn network_in(
    spec: &JobSpec,
    data: &DataShape,
    n: usize,
    seed: u64,
    half: Option<HalfKind>,
) -> Network<CpuBackend> {
    network_with(spec, data, n, seed, half, None)
}

/// `network_in` with the given parameters (None: initialised from `seed`).
pub fn network_with(
    spec: &JobSpec,
    data: &DataShape,
    n: usize,
    seed: u64,
    half: Option<HalfKind>,
    params: Option<&[f32]>,
) -> Network<CpuBackend> {
    let backend = CpuBackend::new(1);
    let graph = Graph::build(spec, data).unwrap();
    let params = params.map_or_else(|| graph.init_params(seed), <[f32]>::to_vec);
    let mut net = Network::with_precision(&backend, graph, &params, n, seed, half).unwrap();
    let mut rng = Rng::new(seed);
    for v in net.input_mut().iter_mut() {
        *v = rng.normal() as f32;
    }
    let classes = data.classes;
    for v in net.targets_mut().iter_mut() {
        *v = match classes {
            Some(c) => rng.below(c) as f32,
            None => rng.next_f64() as f32,
        };
    }
    net
}

pub fn random_vec(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..len).map(|_| rng.normal() as f32).collect()
}

/// Runs the trainer binary from the project root with extra environment variables (RUST_LOG
/// cleared, so stderr holds only what the run itself prints).
pub fn trainer_with_env(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = std::process::Command::new(trainer_bin());
    cmd.args(args).current_dir(root()).env_remove("RUST_LOG");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("trainer runs")
}

/// Runs the trainer binary from the project root.
pub fn trainer(args: &[&str]) -> std::process::Output {
    trainer_with_env(args, &[])
}

pub fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn ok(o: Output) -> Output {
    assert!(
        o.status.success(),
        "exit {:?}: {}",
        o.status.code(),
        stderr(&o)
    );
    o
}

/// A small, fast job on the bundled digits with a validation split (results, sweeps).
pub const TINY_JOB: &str = r#"
[job]
name = "tiny"
seed = 1
[device]
type = "cpu"
[data]
source = "digits"
batch_size = 64
val_fraction = 0.2
[model]
layers = [{ type = "flatten" }, { type = "linear", out = 10 }]
[optimizer]
type = "sgd"
lr = 0.1
[train]
epochs = 1
log_every = 5
threads = 1
"#;

pub fn write_job(dir: &Path, text: &str) -> PathBuf {
    let path = dir.join("job.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// metrics.csv's columns that time the run: they differ between two runs of one job.
pub const TIMING_COLUMNS: [&str; 5] = [
    "samples_per_sec",
    "elapsed_s",
    "tokens_per_sec",
    "flops_per_sec",
    "mfu",
];

/// The model FLOPs a sample that `trainer check` printed in `text`.
pub fn flops_a_sample(text: &str) -> f64 {
    let line = (text.lines())
        .find_map(|l| l.strip_prefix("model FLOPs (forward, backward and loss): "))
        .unwrap_or_else(|| panic!("no model FLOPs line: {text}"));
    let (number, rest) = line.split_once(' ').unwrap();
    let scale = match &rest[..1] {
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        _ => panic!("{line}"),
    };
    number.parse::<f64>().unwrap() * scale
}

pub fn read_csv(path: &Path) -> (Vec<String>, Vec<Vec<String>>) {
    let mut r = csv::Reader::from_path(path).unwrap();
    let header = r.headers().unwrap().iter().map(String::from).collect();
    let rows = r
        .records()
        .map(|rec| rec.unwrap().iter().map(String::from).collect())
        .collect();
    (header, rows)
}

pub fn column<'a>(header: &[String], row: &'a [String], name: &str) -> &'a str {
    let i = header
        .iter()
        .position(|h| h == name)
        .unwrap_or_else(|| panic!("no column {name} in {header:?}"));
    &row[i]
}

pub fn summary(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap()
}

/// Runs `args` (with the tiny job as `JOB` and a temporary runs directory as `RUNS`) and
/// checks the exit code and that the message names the problem.
pub fn expect_error(job_text: &str, args: &[&str], code: i32, needles: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), job_text);
    let runs = tmp.path().join("runs");
    let args: Vec<&str> = args
        .iter()
        .map(|a| match *a {
            "JOB" => job.to_str().unwrap(),
            "RUNS" => runs.to_str().unwrap(),
            a => a,
        })
        .collect();
    let out = trainer_with_env(&args, &[]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(code), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: message lacks {n:?}:\n{err}");
    }
    assert!(
        !runs.exists() || code != 2 || !has_summary(&runs),
        "a bad sweep trained nothing"
    );
}

/// `trainer run JOB -q --runs-dir RUNS EXTRA...`, which must succeed: its run directory.
pub fn run_job(job: &Path, runs: &Path, extra: &[&str]) -> PathBuf {
    let mut args = vec![
        "run",
        job.to_str().unwrap(),
        "-q",
        "--runs-dir",
        runs.to_str().unwrap(),
    ];
    args.extend(extra);
    let out = trainer(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    PathBuf::from(stdout(&out).trim())
}

pub fn has_summary(dir: &Path) -> bool {
    walk(dir).iter().any(|p| p.ends_with("summary.json"))
}

pub fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.path().is_dir() {
            out.extend(walk(&e.path()));
        } else {
            out.push(e.path());
        }
    }
    out
}

/// Tests that start processes meeting on a TCP port take turns: a port `free_port` found free
/// could otherwise be taken by another test's process before ours binds it, and our peer
/// would greet the wrong process. (One lock per test binary.)
pub fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// A loopback port nothing listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Whether a GPU is usable; without one a GPU test skips, saying why, or fails when
/// TRAINER_REQUIRE_CUDA=1 (the GPU machine's scripts and tests/emulated_cuda/run.sh set it).
pub fn gpu_present() -> bool {
    match trainer::tensor::cuda::probe() {
        Ok((devices, _)) if !devices.is_empty() => true,
        Ok(_) => skip_without_gpu("no GPU"),
        Err(why) => skip_without_gpu(&why),
    }
}

/// Whether the GPU is tests/emulated_cuda's (which injects faults, poses as another GPU,
/// traces what a job queues, stalls an all-reduce): a test of what only it can do runs
/// there. Elsewhere it skips, saying it needs `what`, or as every GPU test does without one.
pub fn on_emulated_gpu(what: &str) -> bool {
    if !gpu_present() {
        return false;
    }
    let emulated = trainer::tensor::cuda::probe()
        .is_ok_and(|(devices, _)| devices[0].name.starts_with("Emulated GPU"));
    if !emulated {
        eprintln!("skipped: {what}, which only the emulated GPU has");
    }
    emulated
}

/// Skips a GPU test that cannot run here (`reason`), or fails it under TRAINER_REQUIRE_CUDA=1.
/// Returns false, for `if !gpu_present() { return; }`.
pub fn skip_without_gpu(reason: &str) -> bool {
    let required = std::env::var("TRAINER_REQUIRE_CUDA").is_ok_and(|v| v == "1");
    assert!(
        !required,
        "TRAINER_REQUIRE_CUDA=1 but CUDA is unusable: {reason}"
    );
    eprintln!("skipped: {reason}");
    false
}

/// A Python that has torch and safetensors: $TRAINER_TORCH_PYTHON, the development
/// machine's /work/torch-venv, or python3.
pub fn torch_python() -> Option<String> {
    let candidates = [
        std::env::var("TRAINER_TORCH_PYTHON").ok(),
        Some("/work/torch-venv/bin/python".into()),
        Some("python3".into()),
    ];
    candidates.into_iter().flatten().find(|py| {
        Command::new(py)
            .args(["-c", "import torch, safetensors"])
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

/// The one run directory (the one with a metrics.csv) anywhere under `runs`.
pub fn only_run_dir(runs: &Path) -> PathBuf {
    let dirs: Vec<PathBuf> = walk(runs)
        .into_iter()
        .filter(|p| p.ends_with("metrics.csv"))
        .map(|p| p.parent().unwrap().to_path_buf())
        .collect();
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    dirs[0].clone()
}

/// Writes f32 tensors, each (name, values, shape), to a safetensors file.
pub fn write_f32_safetensors(path: &Path, tensors: &[(&str, &[f32], Vec<usize>)]) {
    let views = tensors.iter().map(|(name, values, shape)| {
        let bytes: &[u8] = bytemuck::cast_slice(values);
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes);
        (*name, view.unwrap())
    });
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}
