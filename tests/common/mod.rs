//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;
use trainer::graph::{DataShape, Graph, Network};
use trainer::spec::JobSpec;
use trainer::tensor::cpu::CpuBackend;
use trainer::tensor::rng::Rng;

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
    let backend = CpuBackend::new(1);
    let graph = Graph::build(spec, data).unwrap();
    let params = graph.init_params(seed);
    let mut net = Network::new(&backend, graph, &params, n, seed).unwrap();
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
