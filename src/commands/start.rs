//! How a run begins: fresh or from a checkpoint (found, intact, of this job, not past its
//! end), and the command that continues a run.

use super::*;
use crate::checkpoint::superseded::{self, Ahead};

/// A resumed run continues from its checkpoint, whatever model.init_from says now. It keeps
/// recording the file it first started from (config.toml and its next checkpoints say where
/// its weights came from), and a different file given now is named as not read.
pub(super) fn with_original_init_from(
    mut spec: JobSpec,
    checkpoint_job: &serde_json::Value,
) -> JobSpec {
    let original = checkpoint_job
        .pointer("/model/init_from")
        .and_then(|v| v.as_str())
        .map(PathBuf::from);
    if let Some(given) = spec
        .model
        .init_from
        .as_ref()
        .filter(|&g| Some(g) != original.as_ref())
    {
        tracing::warn!(
            "model.init_from = \"{}\" is not read: a resumed run continues from its checkpoint \
             (the run started from {})",
            given.display(),
            original
                .as_ref()
                .map_or("the seeded initialisation".into(), |p| p
                    .display()
                    .to_string())
        );
    }
    spec.model.init_from = original;
    spec
}

/// A parameter tensor whose shape (or place) differs between the checkpoint's model and
/// this job's, though the two hold as many values: a --force resume would read 3x3 kernels
/// as 1x9 ones. None where the checkpoint's model cannot be built for this data.
fn reshaped_tensor(
    checkpoint_spec: &serde_json::Value,
    graph: &Graph,
    data: &Data,
) -> Option<String> {
    let old: JobSpec = serde_json::from_value(checkpoint_spec.clone()).ok()?;
    let shape = DataShape::of(data);
    let old = Graph::build(&old, &shape).ok()?.state_dict_entries();
    let new = graph.state_dict_entries();
    let shown = |e: &crate::graph::StateDictEntry| format!("{} {:?}", e.name, e.shape);
    // Another number of values is the parameter count's error (`plan_start`), said as such.
    let values = |entries: &[crate::graph::StateDictEntry]| -> usize {
        entries.iter().map(|e| e.len()).sum()
    };
    if values(&old) != values(&new) {
        return None;
    }
    if old.len() != new.len() {
        return Some(format!(
            "its model has {} parameter tensors, this job's {}",
            old.len(),
            new.len()
        ));
    }
    old.iter()
        .zip(&new)
        .find(|(a, b)| a.shape != b.shape || a.offset != b.offset)
        .map(|(a, b)| format!("{} in the checkpoint is {} now", shown(a), shown(b)))
}

/// Decides how the run begins, and checks everything about it that can be wrong before a
/// run directory is touched: the checkpoint (found, intact, of this job, not past the end)
/// or the model.init_from file.
pub(super) fn plan_start(
    args: &RunArgs,
    spec: &JobSpec,
    graph: &Graph,
    data: &Data,
) -> Result<Start> {
    let train_len = data.train.len;
    let target = match (&args.resume, spec.checkpoint.resume) {
        (Some(path), _) => Some(path.clone()),
        (None, Some(ResumeMode::Auto)) => checkpoint::find_auto_resume(&args.runs_dir, spec.name()),
        _ => None,
    };
    let Some(target) = target else {
        let resumes_auto = spec.checkpoint.resume == Some(ResumeMode::Auto);
        if (args.force || args.resume_fallback) && !resumes_auto {
            // Without anything to resume, the flag would be ignored: likely a script that
            // lost its --resume, about to start over instead of continuing.
            let flag = if args.force {
                "--force"
            } else {
                "--resume-fallback"
            };
            return Err(Error::Job(format!(
                "{flag} applies to a resumed run: give --resume RUN_DIR|CHECKPOINT (or set \
                 checkpoint.resume = \"auto\"), or leave {flag} out to start afresh"
            )));
        }
        let initial = match &spec.model.init_from {
            Some(path) => Some(read_init_from(&args.job, &args.sets, path, graph)?),
            None => None,
        };
        return Ok(Start::Fresh { initial });
    };
    // The run's lock first: a process still training it (a stopped rank 0 writing its last
    // checkpoint) is refused before a checkpoint is chosen, and none is written meanwhile.
    let locked = match checkpoint::run_dir_of(&target) {
        Some(dir) if dir.is_dir() => Some(RunDir::open(&dir)?),
        _ => None,
    };
    let loading = Instant::now();
    let mut point = checkpoint::locate(&target, args.resume_fallback)?;
    let c = &mut point.checkpoint;
    let name = c.path.display().to_string();
    tracing::info!(
        "read and verified checkpoint {name} ({:.1} MiB) in {:.3} s",
        std::fs::metadata(&c.path).map_or(0, |m| m.len()) as f64 / (1024.0 * 1024.0),
        loading.elapsed().as_secs_f64()
    );
    let (job, _) = checkpoint::spec_json(spec);
    let changes = checkpoint::incompatible_changes(&c.spec, &job);
    if !changes.is_empty() {
        if !args.force {
            return Err(Error::Job(format!(
                "cannot resume from {name}: the job differs from the checkpoint's in keys that \
                 change training:\n  {}\n(only {} may change; pass --force to resume anyway)",
                changes.join("\n  "),
                checkpoint::changeable_keys()
            )));
        }
        if let Some(reshaped) = reshaped_tensor(&c.spec, graph, data) {
            return Err(Error::Job(format!(
                "cannot resume from {name}, even with --force: {reshaped}; its values would be \
                 read in the other shape (change a layer's shape in a new run, with \
                 model.init_from for the layers that keep theirs)"
            )));
        }
        tracing::warn!(
            "--force: resuming from {name} although the job changed: {}",
            changes.join("; ")
        );
    }
    if c.params.len() != graph.param_len {
        // Written before each parameter tensor was aligned in the flat buffer: the same
        // values, back to back.
        if let Some(params) = graph.from_packed_layout(&c.params) {
            c.params = params;
            for (_, state) in &mut c.optimizer {
                if let Some(aligned) = graph.from_packed_layout(state) {
                    *state = aligned;
                }
            }
        }
    }
    if c.params.len() != graph.param_len {
        return Err(Error::Job(format!(
            "cannot resume from {name}: it holds {} parameter values, the job's model needs {} \
             ({} parameters)",
            c.params.len(),
            graph.param_len,
            graph.parameter_count()
        )));
    }
    if c.running_stats.len() != graph.running_stats_len() {
        return Err(Error::Job(format!(
            "cannot resume from {name}: it holds {} batch-norm running statistics, the job's \
             model has {}",
            c.running_stats.len(),
            graph.running_stats_len()
        )));
    }
    let kept: Vec<&str> = c.optimizer.iter().map(|(n, _)| n.as_str()).collect();
    if kept != optim::state_names(spec) {
        // Only reachable with --force: the optimizer changed kind.
        tracing::warn!("--force: the optimizer changed; its state starts afresh");
        c.optimizer.clear();
        c.state.optimizer_steps = 0;
    }
    let total = train::total_steps(spec, train_len) as u64;
    let step = c.state.step;
    let finishing = nothing_left_to_train(c, spec, total);
    if finishing && run_completed(&point.run_dir) {
        let why = if c.state.end_reason == Some(EndReason::EarlyStopped) {
            "early stopping ended it there; change train.early_stopping (its patience, say) or \
             remove it to train further"
                .to_string()
        } else {
            format!(
                "this job trains {total} steps (train.epochs = {}{}); raise train.epochs or \
                 train.max_steps to train further",
                spec.train.epochs,
                spec.train
                    .max_steps
                    .map_or(String::new(), |m| format!(", train.max_steps = {m}"))
            )
        };
        return Err(Error::Job(format!(
            "cannot resume from {name}: it is at step {step}, where the run completed, and \
             {why}"
        )));
    }
    if step > total && !c.state.finished {
        return Err(Error::Job(format!(
            "cannot resume from {name}: it is at step {step} and this job trains {total} steps \
             (train.epochs = {}{}); raise train.epochs or train.max_steps to train further",
            spec.train.epochs,
            spec.train
                .max_steps
                .map_or(String::new(), |m| format!(", train.max_steps = {m}"))
        )));
    }
    refuse_going_back(args, &point, &job)?;
    let c = &point.checkpoint;
    // Its rows up to the checkpoint must be there before anything of the run is rewritten.
    let metrics = point.run_dir.join("metrics.csv");
    let (_, rows, _) = MetricsWriter::resumable_len(&metrics, c.state.metrics_rows, args.force)?;
    if rows < c.state.metrics_rows {
        tracing::warn!(
            "--force: {} has {rows} of the {} rows written before the checkpoint; the run goes \
             on after them, and rows {} to {} stay missing",
            metrics.display(),
            c.state.metrics_rows,
            rows + 1,
            c.state.metrics_rows
        );
    }
    if finishing {
        tracing::info!(
            "{name} is the final checkpoint of {}, which stopped before it completed: writing \
             its weights and summary (nothing is trained)",
            point.run_dir.display()
        );
    } else {
        tracing::info!(
            "resuming {} from {name} (step {step})",
            point.run_dir.display()
        );
    }
    Ok(Start::Resume(Box::new(point), locked))
}

/// The keys that set how far a run trains: a changed value trains the steps after a
/// checkpoint differently (a schedule spans the length) or not at all.
const LENGTH_KEYS: [&str; 3] = ["train.epochs", "train.max_steps", "train.early_stopping"];

/// A resume goes back in its run when the run recorded more than its checkpoint holds:
/// later checkpoints, a completed result past it, or metrics rows after it that this job
/// would train differently. That is refused unless --force, naming what would be replaced.
///
/// Rows after the newest checkpoint of a run that stopped without completing (killed, or
/// failed) are not refused when the job is the run's own: their steps were never saved, and
/// the resume trains them again as they were.
fn refuse_going_back(args: &RunArgs, point: &ResumePoint, job: &serde_json::Value) -> Result<()> {
    let c = &point.checkpoint;
    let (run, step) = (&point.run_dir, c.state.step);
    let mut ahead = Ahead::of(run, step, c.state.metrics_rows);
    ahead
        .later_checkpoints
        .retain(|(_, path)| !point.skipped.contains(path));
    if args.job_given {
        name_job_file_differences(&args.job, &args.sets, run, job);
    }
    // The settings the run recorded its latest rows with: its config.toml as written.
    let recorded = recorded_settings(run).unwrap_or_else(|| c.spec.clone());
    let changed: Vec<String> = checkpoint::training_differences(&recorded, job)
        .into_iter()
        .chain(checkpoint::differences_in(&LENGTH_KEYS, &recorded, job))
        .map(|(key, _, _)| key)
        .collect();
    let past_its_end = ahead.completed.is_some() && !ahead.completed_at(step, c.state.finished);
    let goes_back = !ahead.later_checkpoints.is_empty()
        || past_its_end
        || (ahead.rows_after > 0 && !changed.is_empty());
    if !goes_back {
        return Ok(());
    }
    let lost = ahead.described(step, c.state.finished, true);
    let run_shown = run.display();
    if args.force {
        tracing::warn!(
            "--force: resuming from step {step}, which replaces: {}; they move to \
             {run_shown}/{}/",
            lost.join("; "),
            superseded::DIR
        );
        return Ok(());
    }
    let how = if !ahead.later_checkpoints.is_empty() {
        format!(
            "to continue from the run's newest checkpoint, give the run: {}",
            resume_command(run)
        )
    } else if past_its_end {
        let quote = |p: PathBuf| crate::provenance::shell_quote_os(p.as_os_str());
        format!(
            "the run holds no checkpoint of its final state, so it cannot be extended from \
             there; to train on from its final weights, start a new run from them: trainer run \
             {} --set model.init_from={}",
            quote(run.join("config.toml")),
            crate::provenance::shell_quote(&format!(
                "\"{}\"",
                run.join(weights::MODEL_FILE).display()
            ))
        )
    } else {
        format!(
            "those steps were trained with other values of {} (the run's config.toml); resume \
             with the run's own settings to train them again as they were: {}",
            changed.join(", "),
            resume_command(run)
        )
    };
    Err(Error::Job(format!(
        "cannot resume from {} (step {step}): the run went further, and resuming from there \
         would replace\n  - {}\n{how}; or pass --force to resume from step {step} anyway (what \
         it replaces moves to {run_shown}/{}/)",
        c.path.display(),
        lost.join("\n  - "),
        superseded::DIR
    )))
}

/// The settings a run recorded in its config.toml, as JSON; None where it cannot be read (a
/// run directory from an earlier version, say).
fn recorded_settings(run: &Path) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(run.join("config.toml")).ok()?;
    let spec: JobSpec = toml::from_str(&text).ok()?;
    Some(checkpoint::spec_json(&spec).0)
}

/// A job file given with --resume is taken as the job, as before; where it differs from the
/// run's own settings (with the same overrides on top), each difference is named, so that no
/// setting of the run changes unseen (the file's epochs, or its lack of checkpoints).
fn name_job_file_differences(file: &Path, sets: &[String], run: &Path, job: &serde_json::Value) {
    let config = run.join("config.toml");
    // Quietly: the job's own loading has said its warnings.
    let quiet = tracing::subscriber::NoSubscriber::default();
    let Ok(own) = tracing::subscriber::with_default(quiet, || spec::load_job(&config, sets)) else {
        return;
    };
    let differences = checkpoint::differences(&checkpoint::spec_json(&own).0, job);
    if differences.is_empty() {
        return;
    }
    let listed: Vec<String> = differences
        .iter()
        .map(|(key, old, new)| format!("{key}: {old} in the run, {new} now"))
        .collect();
    tracing::warn!(
        "{} differs from the run's own settings ({}), and this resume takes its values:\n  {}\n\
         (leave the job file out to resume with the run's own settings: {})",
        file.display(),
        config.display(),
        listed.join("\n  "),
        resume_command(run)
    );
}

/// The job a run trains: the job file given, or with --resume and none given, the resumed
/// run's own config.toml (its resolved job, overrides included).
pub fn job_of(job: Option<PathBuf>, resume: Option<&Path>) -> Result<PathBuf> {
    if let Some(job) = job {
        return Ok(job);
    }
    let Some(resume) = resume else {
        return Err(Error::Job(
            "give a job file (trainer run JOB), or --resume RUN_DIR to continue a run".into(),
        ));
    };
    let config = checkpoint::named_run_dir(resume)?.join("config.toml");
    if !config.is_file() {
        return Err(Error::Job(format!(
            "--resume {}: the run has no {} to take its job from; give the job file as well \
             (trainer run JOB --resume {})",
            resume.display(),
            config.display(),
            resume.display()
        )));
    }
    Ok(config)
}

/// A final checkpoint (`finished`) with nothing left to train for `spec`: its run ended
/// at the job's last step, or early stopping ended it and the job stops early as it did.
pub(super) fn nothing_left_to_train(
    c: &checkpoint::Checkpoint,
    spec: &JobSpec,
    total: u64,
) -> bool {
    let same_early_stopping =
        || c.spec["train"]["early_stopping"] == serde_json::json!(spec.train.early_stopping);
    c.state.finished
        && (c.state.step >= total
            || (c.state.end_reason == Some(EndReason::EarlyStopped) && same_early_stopping()))
}

/// Whether the run in `dir` completed: its summary says so and its final weights are there
/// (a run stopped while writing them has its final checkpoint, but not these).
fn run_completed(dir: &Path) -> bool {
    Summary::read(dir).is_some_and(|s| s.completed().is_some())
        && dir.join(weights::MODEL_FILE).is_file()
}

/// The rows a finished run ended with, read back from its metrics.csv (for a run that is
/// only finishing): its last train row and each evaluated split's last row.
pub(super) fn final_rows(metrics: &Path) -> (Option<MetricsRow>, Vec<MetricsRow>) {
    let mut last_train = None;
    let mut last_eval: Vec<MetricsRow> = Vec::new();
    for point in crate::results::read_metrics(metrics) {
        let split = match point.split.as_str() {
            "train" => "train",
            "val" => "val",
            "test" => "test",
            _ => continue,
        };
        let row = MetricsRow {
            step: point.step,
            epoch: point.epoch,
            split,
            loss: point.values.get("loss").copied().unwrap_or(f64::NAN),
            accuracy: point.values.get("accuracy").copied(),
            ..Default::default()
        };
        if split == "train" {
            last_train = Some(row);
        } else {
            last_eval.retain(|r| r.split != split);
            last_eval.push(row);
        }
    }
    (last_train, last_eval)
}

/// A run that failed says where it is, and, after writing checkpoints, how to continue
/// from the newest.
pub(super) fn with_resume_hint(e: Error, run: &RunDir, summary_written: bool) -> Error {
    let e = match e {
        Error::Runtime(_) | Error::Diverged(_) => e.with_note(&format!(
            "the run: {}{}",
            run.path.display(),
            match summary_written {
                true => " (its summary.json says so too)",
                false => "",
            }
        )),
        other => return other,
    };
    let Some((step, _)) = checkpoint::list(&run.path.join(checkpoint::DIR)).pop() else {
        return e;
    };
    let resume = resume_command(&run.path);
    match e {
        Error::Runtime(message) => Error::Runtime(format!(
            "{message}\nthe run's checkpoints remain (the newest at step {step}); continue \
             with: {resume}"
        )),
        // The same settings would diverge again: the resume needs a change, hence --force.
        Error::Diverged(message) => Error::Diverged(format!(
            "{message}\nthe newest checkpoint, at step {step}, is the last good state (none \
             is written with inf/NaN in it); to go on from it with a change, add it and \
             --force to: {resume}"
        )),
        e => e,
    }
}

/// The command that continues `run`: its config.toml holds the job as this attempt
/// resolved it (overrides, name and environment included).
pub(super) fn resume_command(run: &Path) -> String {
    format!(
        "trainer run --resume {}",
        crate::provenance::shell_quote_os(run.as_os_str())
    )
}

/// This attempt's `trainer run`: the job file when one was given (and --name), `--resume`,
/// and the `--set` overrides, shell-quoted.
pub(super) fn job_command(args: &RunArgs) -> String {
    use crate::provenance::{shell_quote as quote, shell_quote_os};
    let mut command = "trainer run".to_string();
    if args.job_given {
        command += &format!(" {}", shell_quote_os(args.job.as_os_str()));
    }
    if let Some(name) = &args.name {
        command += &format!(" --name {}", quote(name));
    }
    if let Some(resume) = &args.resume {
        command += &format!(" --resume {}", shell_quote_os(resume.as_os_str()));
    }
    for set in &args.sets {
        command += &format!(" --set {}", quote(set));
    }
    command
}

#[cfg(test)]
mod tests {
    use super::*;

    /// config.toml's header names the command that wrote it, with the overrides and name
    /// quoted for a shell; the command that continues a run needs only the run.
    #[test]
    fn the_commands_keep_the_overrides_quoted() {
        let mut args = RunArgs {
            job: "jobs/mlp.toml".into(),
            job_given: true,
            sets: vec![
                "train.epochs=30".into(),
                r#"optimizer.schedule={type="step", step_size=5}"#.into(),
                "job.name='x'".into(),
            ],
            name: Some("lr 3".into()),
            runs_dir: "runs".into(),
            resume: None,
            resume_fallback: false,
            force: false,
            dir: None,
            quiet: false,
            profile: None,
            print_run_dir: false,
        };
        let want = r#"trainer run jobs/mlp.toml --name 'lr 3' --set train.epochs=30 --set 'optimizer.schedule={type="step", step_size=5}' --set 'job.name='\''x'\'''"#;
        assert_eq!(job_command(&args), want);
        args.job_given = false;
        args.resume = Some("runs/mlp/20261124 1".into());
        args.sets.truncate(1);
        args.name = None;
        let want = "trainer run --resume 'runs/mlp/20261124 1' --set train.epochs=30";
        assert_eq!(job_command(&args), want);
        let run = Path::new("runs/mlp/20261124 1");
        assert_eq!(
            resume_command(run),
            "trainer run --resume 'runs/mlp/20261124 1'"
        );
    }
}
