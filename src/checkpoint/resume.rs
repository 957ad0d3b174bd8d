//! Finding the checkpoint a run resumes from, and deciding whether the job may continue
//! from it. Everything here happens before training, so its errors are bad input (exit 2).

use super::{list, load, Checkpoint, DIR};
use crate::error::{Error, Result};
use crate::run::Summary;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A checkpoint to continue from, and the run directory the run continues in.
pub struct ResumePoint {
    pub run_dir: PathBuf,
    pub checkpoint: Checkpoint,
    /// Later checkpoints that failed their integrity check (`--resume-fallback`).
    pub skipped: Vec<PathBuf>,
}

/// The checkpoints/ directory a --resume path names (a run directory, its checkpoints/, or
/// a checkpoint file in that), and whether the path is a checkpoint file.
fn checkpoints_dir(path: &Path) -> Result<(PathBuf, bool)> {
    let given = path.display();
    let meta = std::fs::metadata(path).map_err(|e| Error::Job(format!("--resume {given}: {e}")))?;
    if meta.is_dir() {
        if path.join(DIR).is_dir() {
            return Ok((path.join(DIR), false));
        }
        if path.file_name().is_some_and(|n| n == DIR) {
            return Ok((path.to_path_buf(), false));
        }
        return Err(Error::Job(format!(
            "--resume {given}: no {DIR}/ directory there; give a run directory \
             (runs/<name>/<run-id>) whose run wrote a checkpoint, or a checkpoint file"
        )));
    }
    let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
    if dir.file_name().is_none_or(|n| n != DIR) {
        return Err(Error::Job(format!(
            "--resume {given}: a checkpoint must lie in its run's {DIR}/ directory, so the \
             run can continue in that run directory"
        )));
    }
    Ok((dir, true))
}

/// The run directory a --resume path names, as `locate` reads it; None where it names none.
pub fn run_dir_of(path: &Path) -> Option<PathBuf> {
    named_run_dir(path).ok()
}

/// The run directory a --resume path names, or why it names none.
pub fn named_run_dir(path: &Path) -> Result<PathBuf> {
    let (dir, _) = checkpoints_dir(path)?;
    Ok(dir.parent().unwrap_or(Path::new(".")).to_path_buf())
}

/// `--resume PATH`: a run directory (its newest checkpoint), that run's checkpoints/
/// directory, or one checkpoint file in it. A checkpoint that fails its integrity check is
/// an error naming it, unless `fallback`: then the newest intact older one is used.
pub fn locate(path: &Path, fallback: bool) -> Result<ResumePoint> {
    let given = path.display();
    let (dir, is_file) = checkpoints_dir(path)?;
    let candidates = if is_file {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let step = super::step_of(name).unwrap_or(u64::MAX);
        let mut candidates = vec![path.to_path_buf()];
        candidates.extend(
            list(&dir)
                .into_iter()
                .rev()
                .filter(|(s, _)| *s < step)
                .map(|(_, p)| p),
        );
        candidates
    } else {
        let newest_first: Vec<PathBuf> = list(&dir).into_iter().rev().map(|(_, p)| p).collect();
        if newest_first.is_empty() {
            return Err(Error::Job(format!(
                "--resume {given}: {} holds no checkpoint (step-*.safetensors)",
                dir.display()
            )));
        }
        newest_first
    };
    let run_dir = dir.parent().unwrap_or(Path::new(".")).to_path_buf();
    let mut problems = Vec::new();
    for p in &candidates {
        match load(p) {
            Ok(checkpoint) => {
                if !problems.is_empty() {
                    tracing::warn!(
                        "--resume-fallback: resuming from {} (step {})",
                        p.display(),
                        checkpoint.state.step
                    );
                }
                let skipped = candidates.iter().take_while(|c| *c != p).cloned().collect();
                return Ok(ResumePoint {
                    run_dir,
                    checkpoint,
                    skipped,
                });
            }
            Err(why) => {
                let line = format!("checkpoint {}: {why}", p.display());
                if !fallback {
                    let hint = if candidates.len() > 1 {
                        "; pass --resume-fallback to resume from the newest intact earlier \
                         checkpoint instead"
                    } else {
                        ""
                    };
                    return Err(Error::Job(format!("cannot resume from {line}{hint}")));
                }
                tracing::warn!("--resume-fallback: skipping {line}");
                problems.push(line);
            }
        }
    }
    Err(Error::Job(format!(
        "--resume {given}: no intact checkpoint to fall back to:\n{}",
        problems.join("\n")
    )))
}

/// `checkpoint.resume = "auto"`: the newest run of `name` under `runs_dir` (run ids sort by
/// start time), when it did not complete and wrote a checkpoint; None means a new run.
pub fn find_auto_resume(runs_dir: &Path, name: &str) -> Option<PathBuf> {
    let mut runs: Vec<PathBuf> = std::fs::read_dir(runs_dir.join(name))
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    runs.sort();
    let newest = runs.pop()?;
    let completed = Summary::read(&newest).is_some_and(|s| s.completed().is_some());
    if completed {
        tracing::info!(
            "checkpoint.resume = \"auto\": the newest run {} completed; starting a new run",
            newest.display()
        );
        return None;
    }
    if list(&newest.join(DIR)).is_empty() {
        tracing::info!(
            "checkpoint.resume = \"auto\": the newest run {} has no checkpoint; starting a new run",
            newest.display()
        );
        return None;
    }
    Some(newest)
}

/// Keys that may change between a checkpoint and the job resuming from it: how long to
/// train, how often to log, evaluate and checkpoint (`DECIDED_BY_RANK_ZERO`), and these:
/// where, with how many threads or data-parallel replicas (replicas split the same
/// micro-batches, so their number changes rounding only). Any other change (model, data,
/// loss, optimizer, seed, accumulation, clipping, precision) would make the result
/// something no single run produces.
const ALSO_SAFE_TO_CHANGE: [&str; 5] = [
    "job.name",
    "train.threads",
    "device",
    "parallel",
    // Only the start of a fresh run reads it; a resumed run starts from the checkpoint.
    "model.init_from",
];

/// How long to train and when to log, evaluate and checkpoint: a resume may change them,
/// and in a multi-process run only rank 0's are used (another rank's differing values are
/// warned about).
pub const DECIDED_BY_RANK_ZERO: [&str; 8] = [
    "train.epochs",
    "train.max_steps",
    // From this session's start; like epochs, how long to go on.
    "train.max_time",
    // When to stop going on: its progress continues if the metric and mode stay.
    "train.early_stopping",
    "train.log_every",
    "train.eval_every_epochs",
    "train.evaluate_test",
    "checkpoint",
];

fn safe_to_change() -> impl Iterator<Item = &'static str> {
    DECIDED_BY_RANK_ZERO.into_iter().chain(ALSO_SAFE_TO_CHANGE)
}

/// The keys a resume may change, for the message that refuses the others: "train.epochs,
/// ..., device.*, ..." (a section stands for every key in it).
pub fn changeable_keys() -> String {
    let key = |k: &str| {
        if k.contains('.') {
            k.to_string()
        } else {
            format!("{k}.*")
        }
    };
    safe_to_change().map(key).collect::<Vec<_>>().join(", ")
}

fn is_safe(key: &str) -> bool {
    is_under(key, safe_to_change())
}

/// Whether `key` is one of `keys` or inside one of them (a section or a list).
fn is_under<'a>(key: &str, keys: impl IntoIterator<Item = &'a str>) -> bool {
    keys.into_iter().any(|s| {
        key == s
            || key
                .strip_prefix(s)
                .is_some_and(|rest| rest.starts_with('.') || rest.starts_with('['))
    })
}

/// The keys among (or inside) `keys` whose values differ between two jobs: (key, first
/// job's value, second job's value).
pub fn differences_in(
    keys: &[&str],
    first: &Value,
    second: &Value,
) -> Vec<(String, String, String)> {
    differences(first, second)
        .into_iter()
        .filter(|(k, _, _)| is_under(k, keys.iter().copied()))
        .collect()
}

/// The keys whose values differ between two jobs: (key, first job's value, second job's
/// value), defaults filled in.
pub fn differences(first: &Value, second: &Value) -> Vec<(String, String, String)> {
    let (mut old, mut new) = (BTreeMap::new(), BTreeMap::new());
    flatten(String::new(), &with_defaults(first), &mut old);
    flatten(String::new(), &with_defaults(second), &mut new);
    let keys: std::collections::BTreeSet<&String> = old.keys().chain(new.keys()).collect();
    let unset = "(not set)".to_string();
    keys.into_iter()
        .filter(|k| old.get(*k) != new.get(*k))
        .map(|k| {
            let value = |map: &BTreeMap<String, String>| map.get(k).unwrap_or(&unset).clone();
            (k.clone(), value(&old), value(&new))
        })
        .collect()
}

/// A job as config.toml records it, every default it implies filled in: a value spelled
/// out (a run's config.toml, `--set precision.loss_scale="none"`) and the same value left
/// to its default are one job. A job JSON this version cannot read (written by an earlier
/// one with keys since removed) is compared as it is.
fn with_defaults(job: &Value) -> Value {
    serde_json::from_value::<crate::spec::JobSpec>(job.clone())
        .ok()
        .and_then(|spec| spec.recorded().ok())
        .and_then(|table| serde_json::to_value(table).ok())
        .unwrap_or_else(|| job.clone())
}

fn flatten(prefix: String, value: &Value, out: &mut BTreeMap<String, String>) {
    let join = |k: &str| {
        if prefix.is_empty() {
            k.to_string()
        } else {
            format!("{prefix}.{k}")
        }
    };
    match value {
        Value::Object(map) if !map.is_empty() => {
            for (k, v) in map {
                flatten(join(k), v, out);
            }
        }
        // Lists of tables (model.layers) are walked into; a list of values is one value, so
        // that `kernel_size = 3` against `[1, 9]` is one change, not two half ones.
        Value::Array(items) if items.iter().any(Value::is_object) => {
            for (i, v) in items.iter().enumerate() {
                flatten(format!("{prefix}[{i}]"), v, out);
            }
        }
        other => {
            out.insert(prefix, other.to_string());
        }
    }
}

/// The keys (dotted paths, e.g. `model.layers[1].out`) whose values differ between the
/// checkpoint's job and this one and may not change, each with both values.
pub fn incompatible_changes(checkpoint: &Value, job: &Value) -> Vec<String> {
    training_differences(checkpoint, job)
        .into_iter()
        .map(|(k, old, new)| format!("{k}: {old} in the checkpoint, {new} now"))
        .collect()
}

/// The keys that change training (not the changeable ones) whose values differ between two
/// jobs: (key, first job's value, second job's value).
pub fn training_differences(first: &Value, second: &Value) -> Vec<(String, String, String)> {
    differences(first, second)
        .into_iter()
        .filter(|(k, _, _)| !is_safe(k))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn only_changes_that_alter_training_are_reported() {
        let old = json!({"train": {"epochs": 3, "clip_grad_norm": 1.0},
            "model": {"layers": [{"type": "linear", "out": 8}, {"type": "maxpool2d", "kernel_size": 3}]},
            "checkpoint": {"every_steps": 5}});
        let new = json!({"train": {"epochs": 9},
            "model": {"layers": [{"type": "linear", "out": 16}, {"type": "maxpool2d", "kernel_size": [1, 9]}]},
            "checkpoint": {"keep_last": 2}});
        assert_eq!(
            incompatible_changes(&old, &new),
            [
                "model.layers[0].out: 8 in the checkpoint, 16 now",
                "model.layers[1].kernel_size: 3 in the checkpoint, [1,9] now",
                "train.clip_grad_norm: 1.0 in the checkpoint, (not set) now"
            ]
        );
        assert!(is_safe("device.type") && !is_safe("devices") && !is_safe("train.epochsx"));
    }
}
