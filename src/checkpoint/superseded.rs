//! What a resume replaces in its run directory, and where that goes.
//!
//! A resume goes on from its checkpoint's step, so whatever the run recorded after that step
//! is replaced: later checkpoints, metrics rows, a completed run's summary and final weights.
//! `Ahead` finds them, for the decision whether the resume may go ahead. `set_aside` moves
//! them to `superseded/<when>-from-step-<N>/`: a resume never deletes a result.

use crate::checkpoint;
use crate::error::{Error, Result};
use crate::run::Summary;
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

/// The run directory's folder for what resumes replaced, one folder per resume.
pub const DIR: &str = "superseded";

/// What a run directory holds from after one of its checkpoints.
#[derive(Debug, Default)]
pub struct Ahead {
    /// Checkpoint files of later steps: (step, path).
    pub later_checkpoints: Vec<(u64, PathBuf)>,
    /// metrics.csv rows after the checkpoint's rows.
    pub rows_after: u64,
    /// The step of metrics.csv's last row, when there are rows after the checkpoint's.
    pub last_row_step: Option<u64>,
    /// The run's outcome, when summary.json says it completed.
    pub completed: Option<Completed>,
    /// model.safetensors is there: the weights the run ended with.
    pub final_weights: bool,
}

/// A completed run's outcome, from its summary.json.
#[derive(Debug, Default)]
pub struct Completed {
    pub steps: u64,
    /// Its final metrics ("val_accuracy", ...).
    pub finals: BTreeMap<String, f64>,
}

impl Ahead {
    /// What `run` holds from after the checkpoint at `step`, which was written after
    /// `rows` metrics rows. Unreadable files count as holding nothing.
    pub fn of(run: &Path, step: u64, rows: u64) -> Ahead {
        let later_checkpoints = checkpoint::list(&run.join(checkpoint::DIR))
            .into_iter()
            .filter(|(s, _)| *s > step)
            .collect();
        let (rows_after, last_row_step) = rows_after(&run.join("metrics.csv"), rows);
        Ahead {
            later_checkpoints,
            rows_after,
            last_row_step,
            completed: completed(run),
            final_weights: run.join(checkpoint::weights::MODEL_FILE).is_file(),
        }
    }

    /// Whether the run completed at exactly this checkpoint's state: then a resume from it
    /// extends the run rather than goes back in it.
    pub fn completed_at(&self, step: u64, finished: bool) -> bool {
        finished && self.completed.as_ref().is_some_and(|c| c.steps == step)
    }

    /// The lines naming what a resume from the checkpoint at `step` replaces, for the
    /// refusal; `rows` says whether the metrics rows after it count as lost.
    pub fn described(&self, step: u64, finished: bool, rows: bool) -> Vec<String> {
        let mut lines = Vec::new();
        if let Some(done) = self
            .completed
            .as_ref()
            .filter(|_| !self.completed_at(step, finished))
        {
            let finals: Vec<String> = done
                .finals
                .iter()
                .filter(|(k, _)| !k.starts_with("train_"))
                .map(|(k, v)| format!("{k} {v:.4}"))
                .collect();
            lines.push(format!(
                "its completed result: {} steps{}, in summary.json{}",
                done.steps,
                match finals.is_empty() {
                    true => String::new(),
                    false => format!(" ({})", finals.join(", ")),
                },
                match self.final_weights {
                    true => " and model.safetensors (its final weights)",
                    false => "",
                }
            ));
        }
        if rows && self.rows_after > 0 {
            lines.push(format!(
                "{} metrics.csv row(s) after the checkpoint's{}",
                self.rows_after,
                self.last_row_step
                    .map_or(String::new(), |s| format!(", up to step {s}"))
            ));
        }
        if let Some((newest, _)) = self.later_checkpoints.last() {
            let steps: Vec<String> = self
                .later_checkpoints
                .iter()
                .map(|(s, _)| s.to_string())
                .collect();
            lines.push(format!(
                "{} later checkpoint(s), at step {} (the newest: {newest})",
                steps.len(),
                steps.join(", ")
            ));
        }
        lines
    }
}

/// The metrics.csv rows after the first `rows`, and the last row's step.
fn rows_after(path: &Path, rows: u64) -> (u64, Option<u64>) {
    let Ok(text) = fs::read_to_string(path) else {
        return (0, None);
    };
    // The header, then one row a line (cells are numbers and split names).
    let lines: Vec<&str> = text.lines().skip(1).filter(|l| !l.is_empty()).collect();
    let after = (lines.len() as u64).saturating_sub(rows);
    let last_step = lines
        .last()
        .filter(|_| after > 0)
        .and_then(|l| l.split(',').next()?.parse().ok());
    (after, last_step)
}

/// The run's outcome, when its summary.json says it completed.
fn completed(run: &Path) -> Option<Completed> {
    let summary = Summary::read(run)?;
    let completed = summary.completed()?;
    let finals = completed
        .finals
        .iter()
        .filter_map(|(k, v)| Some((k.clone(), (*v)?)))
        .collect();
    Some(Completed {
        steps: completed.steps,
        finals,
    })
}

/// Moves what a resume from the checkpoint at `step` (written after `rows` metrics rows)
/// replaces into `run/superseded/<when>-from-step-<step>/`: the later checkpoints (moved),
/// a copy of metrics.csv when it has rows after the checkpoint's (the resume cuts them off),
/// config.toml and a completed run's summary.json (copied: the attempt rewrites the one, and
/// sets the other aside itself until it writes its own) and model.safetensors (linked: the
/// new weights replace the file by a rename). Returns the folder, or None when nothing is
/// replaced. On an error the run is as it was: the folder is removed, moved files put back.
pub fn set_aside(run: &Path, step: u64, rows: u64) -> Result<Option<PathBuf>> {
    let ahead = Ahead::of(run, step, rows);
    if ahead.later_checkpoints.is_empty()
        && ahead.rows_after == 0
        && ahead.completed.is_none()
        && !ahead.final_weights
    {
        return Ok(None);
    }
    let aside = new_folder(run, step)?;
    let mut moved = Vec::new();
    let result = fill(run, &aside, &ahead, &mut moved);
    if let Err(e) = result {
        for (from, to) in moved.iter().rev() {
            let _ = fs::rename(to, from);
        }
        let _ = fs::remove_dir_all(&aside);
        return Err(Error::Runtime(format!(
            "cannot set aside what this resume replaces into {}: {e}; the run is as it was",
            aside.display()
        )));
    }
    Ok(Some(aside))
}

/// Copies, links and moves (recorded in `moved` as (from, to)) what `set_aside` keeps.
fn fill(
    run: &Path,
    aside: &Path,
    ahead: &Ahead,
    moved: &mut Vec<(PathBuf, PathBuf)>,
) -> std::result::Result<(), String> {
    let failed = |what: &Path, e: std::io::Error| format!("{}: {e}", what.display());
    // config.toml: the settings of what is replaced; with it the folder reads as a run of
    // its own (`trainer ls`, `plot`).
    let completed = ahead.completed.is_some();
    let copies = [
        ("config.toml", true),
        ("metrics.csv", ahead.rows_after > 0),
        ("summary.json", completed),
    ];
    for (name, replaced) in copies {
        let file = run.join(name);
        if replaced && file.is_file() {
            fs::copy(&file, aside.join(name)).map_err(|e| failed(&file, e))?;
        }
    }
    if ahead.final_weights {
        let weights = run.join(checkpoint::weights::MODEL_FILE);
        let kept = aside.join(checkpoint::weights::MODEL_FILE);
        fs::hard_link(&weights, &kept)
            .or_else(|_| fs::copy(&weights, &kept).map(|_| ()))
            .map_err(|e| failed(&weights, e))?;
    }
    if !ahead.later_checkpoints.is_empty() {
        let dir = aside.join(checkpoint::DIR);
        fs::create_dir_all(&dir).map_err(|e| failed(&dir, e))?;
        for (_, path) in &ahead.later_checkpoints {
            let target = dir.join(path.file_name().expect("a checkpoint file"));
            fs::rename(path, &target).map_err(|e| failed(path, e))?;
            moved.push((path.clone(), target));
        }
    }
    Ok(())
}

/// A new folder `superseded/<UTC time>-from-step-<step>[-N]/` in `run`.
fn new_folder(run: &Path, step: u64) -> Result<PathBuf> {
    let parent = run.join(DIR);
    let io = |e: std::io::Error| Error::Runtime(format!("cannot create {}: {e}", parent.display()));
    fs::create_dir_all(&parent).map_err(io)?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let base = format!("{}-from-step-{step}", crate::run::utc_stamp(now));
    for n in 1.. {
        let name = match n {
            1 => base.clone(),
            n => format!("{base}-{n}"),
        };
        match fs::create_dir(parent.join(&name)) {
            Ok(()) => return Ok(parent.join(name)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(io(e)),
        }
    }
    unreachable!("some numbered folder is free")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_after_the_checkpoint_are_counted_with_the_last_step() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.csv");
        fs::write(
            &path,
            "step,epoch,split\n10,1,train\n20,1,train\n20,1,val\n30,2,train\n",
        )
        .unwrap();
        assert_eq!(rows_after(&path, 2), (2, Some(30)));
        assert_eq!(rows_after(&path, 4), (0, None));
        assert_eq!(rows_after(&dir.path().join("gone.csv"), 0), (0, None));
    }

    #[test]
    fn a_completed_run_is_described_unless_the_checkpoint_is_its_end() {
        let ahead = Ahead {
            rows_after: 3,
            last_row_step: Some(690),
            completed: Some(Completed {
                steps: 690,
                finals: BTreeMap::from([
                    ("train_loss".to_string(), 0.1),
                    ("val_accuracy".to_string(), 0.98607),
                ]),
            }),
            final_weights: true,
            ..Ahead::default()
        };
        let lines = ahead.described(69, true, true);
        assert_eq!(
            lines,
            [
                "its completed result: 690 steps (val_accuracy 0.9861), in summary.json and \
                 model.safetensors (its final weights)",
                "3 metrics.csv row(s) after the checkpoint's, up to step 690"
            ]
        );
        assert!(ahead.completed_at(690, true) && !ahead.completed_at(690, false));
        assert_eq!(ahead.described(690, true, false), Vec::<String>::new());
    }
}
