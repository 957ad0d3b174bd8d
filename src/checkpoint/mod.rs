//! Checkpoints: training state to continue a run exactly (this file), locating one to resume
//! from and checking the job against it (`resume`), PyTorch-compatible weights (`weights`),
//! and the crash-safe safetensors files under both (`file`).
//!
//! A training checkpoint is `<run>/checkpoints/step-NNNNNNNN.safetensors` (the optimizer
//! step, zero-padded to 8 digits) holding the tensors
//!
//! - `params` [P]: the flat parameter buffer (the engine's layout, each tensor aligned
//!   by `graph::PARAM_ALIGN`; earlier versions wrote the tensors back to back, which a
//!   resume converts; see `weights` for PyTorch's),
//! - `optimizer.momentum_buffer` or `optimizer.exp_avg` and `optimizer.exp_avg_sq` [P]:
//!   the optimizer's state buffers (PyTorch's names), when it has any,
//! - `window.loss_stats` [3] (f64): the loss sum, correct count and samples of the train
//!   row being accumulated, so the next row is bit-identical,
//!
//! and in the header metadata: `state` (JSON `TrainState`: step, epoch and position in it,
//! micro-step, optimizer steps, metrics rows...), `spec` (the resolved job as JSON),
//! `spec_hash`, `format`, and the integrity fields of `file`.

mod config;
pub mod file;
pub mod hugging_face;
pub mod llama;
mod mapping;
mod resume;
pub mod superseded;
pub mod weights;

pub use resume::{
    changeable_keys, differences, differences_in, find_auto_resume, incompatible_changes, locate,
    named_run_dir, run_dir_of, training_differences, ResumePoint, DECIDED_BY_RANK_ZERO,
};

use crate::error::{Error, Result};
use crate::spec::{BestMode, CheckpointSpec, JobSpec, KeepBestSpec, StopMode};
use crate::tensor::LossStats;
use file::{TensorOut, Values};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The checkpoints' directory inside a run directory.
pub const DIR: &str = "checkpoints";
/// The `format` metadata of a training checkpoint; a file without it is not one.
pub const FORMAT: &str = "trainer-checkpoint-1";

/// Where training stands, and what a resumed run needs besides the tensors. Our random
/// numbers are counter-based: the data order of an epoch is a pure function of
/// (job.seed, epoch), a dropout mask of (job.seed, layer, micro_step), so `seed`, `epoch`
/// and `micro_step` are the whole random state.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    /// Optimizer steps taken.
    pub step: u64,
    pub seed: u64,
    /// The epoch the loop stands in (1-based), and the optimizer steps already taken in it:
    /// where in that epoch's batch order to continue.
    pub epoch: usize,
    pub steps_in_epoch: usize,
    /// Micro-batches taken so far: the dropout key of the next one.
    pub micro_step: u64,
    /// The optimizer's own step count (Adam's bias corrections, SGD's first step).
    pub optimizer_steps: u64,
    /// metrics.csv rows (header excluded) written when the checkpoint was taken: a resumed
    /// run truncates the file to them, so no row is duplicated or lost.
    pub metrics_rows: u64,
    /// The train row being accumulated: samples and seconds so far (its loss sums are the
    /// `window.loss_stats` tensor).
    pub window_samples: u64,
    pub window_seconds: f64,
    /// Totals for summary.json and the elapsed_s column.
    pub train_samples: u64,
    pub train_seconds: f64,
    pub elapsed_s: f64,
    /// The run had finished (final evaluation done).
    pub finished: bool,
    /// The evaluation of exactly these parameters, when one was made right before the
    /// checkpoint, e.g. {"val_loss": 0.31, "val_accuracy": 0.9}; keep_best compares these.
    pub evaluation: BTreeMap<String, f64>,
    /// Mixed precision: the loss scaler's state (absent without loss scaling).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scaler: Option<crate::optim::LossScaler>,
    /// Optimizer steps skipped for inf/NaN gradients: the learning-rate schedule counts only
    /// the steps taken.
    #[serde(default)]
    pub skipped_steps: u64,
    /// Early stopping's best value and evaluations without improvement (absent without
    /// early stopping, and in checkpoints from before it was kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub early_stopping: Option<StoppingProgress>,
    /// Each batch-norm layer's num_batches_tracked at the run's start (`model.init_from`'s;
    /// empty: 0): the exported count is this plus `micro_step`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub batches_tracked_before: Vec<u64>,
    /// Why the run ended, in its final checkpoint (`finished`); absent before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_reason: Option<crate::run::EndReason>,
}

/// How far early stopping has come, kept in checkpoints (`TrainState::early_stopping`) so a
/// resumed run stops where the uninterrupted one would have, as Lightning's EarlyStopping
/// restores its wait count and best score.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoppingProgress {
    /// The monitored metric and direction it was counted for, e.g. "val_loss", "min": a
    /// forced resume that changes either starts counting again.
    pub metric: String,
    pub mode: StopMode,
    /// The best value so far (never NaN: a NaN is no improvement).
    pub best: Option<f64>,
    pub evals_without_improvement: usize,
}

impl TrainState {
    /// The state before the first step.
    pub fn start(seed: u64) -> Self {
        TrainState {
            seed,
            epoch: 1,
            ..Default::default()
        }
    }
}

/// A training checkpoint read back.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    pub path: PathBuf,
    pub state: TrainState,
    /// The resolved job it was trained with, as JSON.
    pub spec: serde_json::Value,
    pub params: Vec<f32>,
    /// Batch norm's running statistics (`Network::running_stats`; empty without batch norm).
    pub running_stats: Vec<f32>,
    /// The optimizer's state buffers by PyTorch name ("exp_avg", ...).
    pub optimizer: Vec<(String, Vec<f32>)>,
    pub window: LossStats,
}

/// What `save` writes, borrowed from the training loop.
pub struct Saving<'a> {
    pub state: &'a TrainState,
    pub spec: &'a JobSpec,
    pub params: &'a [f32],
    pub running_stats: &'a [f32],
    pub optimizer: &'a [(&'static str, Vec<f32>)],
    pub window: LossStats,
}

pub fn file_name(step: u64) -> String {
    format!("step-{step:08}.safetensors")
}

/// The step of a checkpoint file name, None for any other file.
fn step_of(name: &str) -> Option<u64> {
    name.strip_prefix("step-")?
        .strip_suffix(".safetensors")?
        .parse()
        .ok()
}

/// The resolved job as JSON, and its hash (XXH3-64 of that JSON).
pub fn spec_json(spec: &JobSpec) -> (serde_json::Value, String) {
    let value = serde_json::to_value(spec).unwrap_or_default();
    let hash = xxhash_rust::xxh3::xxh3_64(value.to_string().as_bytes());
    (value, format!("{hash:016x}"))
}

/// Writes a checkpoint into `dir` (created if needed), crash-safely; returns its path and
/// size in bytes.
pub fn save(dir: &Path, c: Saving) -> Result<(PathBuf, u64)> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::Runtime(format!("cannot create {}: {e}", dir.display())))?;
    let path = dir.join(file_name(c.state.step));
    let stats = [c.window.loss_sum, c.window.correct, c.window.samples];
    let mut tensors = vec![
        TensorOut {
            name: "params".into(),
            shape: vec![c.params.len()],
            values: Values::F32(c.params),
        },
        TensorOut {
            name: "window.loss_stats".into(),
            shape: vec![3],
            values: Values::F64(&stats),
        },
    ];
    if !c.running_stats.is_empty() {
        tensors.push(TensorOut {
            name: "running_stats".into(),
            shape: vec![c.running_stats.len()],
            values: Values::F32(c.running_stats),
        });
    }
    for (name, values) in c.optimizer {
        tensors.push(TensorOut {
            name: format!("optimizer.{name}"),
            shape: vec![values.len()],
            values: Values::F32(values),
        });
    }
    let (spec, hash) = spec_json(c.spec);
    let metadata = BTreeMap::from([
        ("format".to_string(), FORMAT.to_string()),
        (
            "state".to_string(),
            serde_json::to_string(c.state).unwrap_or_default(),
        ),
        ("spec".to_string(), spec.to_string()),
        ("spec_hash".to_string(), hash),
    ]);
    let size = file::write(&path, &tensors, metadata).map_err(Error::Runtime)?;
    Ok((path, size))
}

/// Reads and checks a checkpoint; the error says what is wrong with it (not its name).
pub fn load(path: &Path) -> Result<Checkpoint, String> {
    let f = file::read(path)?;
    let meta = f.metadata();
    if meta.get("format").map(String::as_str) != Some(FORMAT) {
        return Err(format!(
            "it is not a trainer training checkpoint (no `format = {FORMAT}` in its metadata)"
        ));
    }
    let field = |key: &str| {
        meta.get(key)
            .ok_or_else(|| format!("its metadata lacks `{key}`"))
    };
    let state: TrainState = serde_json::from_str(field("state")?)
        .map_err(|e| format!("its `state` metadata does not parse: {e}"))?;
    let spec: serde_json::Value = serde_json::from_str(field("spec")?)
        .map_err(|e| format!("its `spec` metadata does not parse: {e}"))?;
    let stats = f.f64s("window.loss_stats")?;
    let [loss_sum, correct, samples] = stats[..] else {
        return Err("tensor `window.loss_stats` does not hold 3 values".into());
    };
    let mut optimizer = Vec::new();
    for name in f.names() {
        if let Some(short) = name.strip_prefix("optimizer.") {
            optimizer.push((short.to_string(), f.f32s(&name)?));
        }
    }
    Ok(Checkpoint {
        path: path.to_path_buf(),
        params: f.f32s("params")?,
        running_stats: if f.names().iter().any(|n| n == "running_stats") {
            f.f32s("running_stats")?
        } else {
            Vec::new()
        },
        state,
        spec,
        optimizer,
        window: LossStats {
            loss_sum,
            correct,
            samples,
        },
    })
}

/// The checkpoints in `dir`, oldest first.
pub fn list(dir: &Path) -> Vec<(u64, PathBuf)> {
    let mut found: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let step = step_of(e.file_name().to_str()?)?;
            Some((step, e.path()))
        })
        .collect();
    found.sort();
    found
}

/// The checkpoint in `dir` that `best` ranks first by the evaluation it carries; None where
/// none carries that metric.
pub fn best(dir: &Path, best: &KeepBestSpec) -> Option<PathBuf> {
    best_of(&list(dir), best).map(Path::to_path_buf)
}

/// The checkpoint of `all` that `best` ranks first (the earliest among equals).
fn best_of<'a>(all: &'a [(u64, PathBuf)], best: &KeepBestSpec) -> Option<&'a Path> {
    let metric = best.metric.name();
    let better = |a: f64, b: f64| match best.mode() {
        BestMode::Min => a < b,
        BestMode::Max => a > b,
    };
    let mut winner: Option<(f64, &Path)> = None;
    for (_, path) in all {
        let value = file::read_metadata_only(path)
            .and_then(|m| serde_json::from_str::<TrainState>(m.get("state")?).ok())
            .and_then(|s| s.evaluation.get(metric).copied());
        if let Some(v) = value {
            if winner.is_none_or(|(w, _)| better(v, w)) {
                winner = Some((v, path));
            }
        }
    }
    winner.map(|(_, p)| p)
}

/// Deletes the checkpoints `keep_last` and `keep_best` do not keep, and temporary files a
/// killed write left behind. Without keep_last every checkpoint is kept.
pub fn prune(dir: &Path, policy: &CheckpointSpec) -> Result<()> {
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') && name.ends_with(".tmp") {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    let Some(keep_last) = policy.keep_last else {
        return Ok(());
    };
    let all = list(dir);
    let mut keep: Vec<&Path> = all
        .iter()
        .rev()
        .take(keep_last)
        .map(|(_, p)| p.as_path())
        .collect();
    if let Some(best) = &policy.keep_best {
        keep.extend(best_of(&all, best));
    }
    for (_, path) in &all {
        if !keep.contains(&path.as_path()) {
            std::fs::remove_file(path).map_err(|e| {
                Error::Runtime(format!(
                    "cannot delete old checkpoint {}: {e}",
                    path.display()
                ))
            })?;
        }
    }
    Ok(())
}
