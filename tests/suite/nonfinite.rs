//! `train.on_nonfinite`, end to end through the binary: with "skip", steps with an inf/NaN
//! loss are not applied (the run equals one without the bad batch, bit for bit), are counted
//! in skipped_steps and stay out of the rows' loss; too many in a row, or "error", end the
//! run as diverged.

use crate::common;
use common::only_run_dir;

use common::{
    column, expect_error, ok, read_csv, stderr, stdout, summary, trainer_with_env as trainer,
    write_job,
};
use std::path::{Path, PathBuf};

/// A regression on `rows` CSV rows in file order, four per batch: with the bad row in the
/// last batch, leaving that batch out leaves every other batch as it was.
fn regression_job(dir: &Path, rows: usize, bad_row: Option<usize>, on_nonfinite: &str) -> PathBuf {
    let mut csv = String::from("a,b,c,y\n");
    for i in 0..rows {
        let x: Vec<f64> = (0..3)
            .map(|j| ((i * 7 + j * 3) % 11) as f64 / 5.0 - 1.0)
            .collect();
        let y = 0.5 * x[0] - x[1] + 0.25 * x[2] + 0.1;
        let y = if bad_row == Some(i) {
            "inf".to_string()
        } else {
            y.to_string()
        };
        csv += &format!("{},{},{},{y}\n", x[0], x[1], x[2]);
    }
    let name = format!("data-{rows}.csv");
    std::fs::write(dir.join(&name), csv).unwrap();
    write_job(
        dir,
        &format!(
            r#"
[job]
name = "nonfinite"
seed = 3
[data]
source = "csv"
path = "{name}"
task = "regression"
batch_size = 4
shuffle = false
normalize = "none"
[model]
layers = [{{ type = "linear", out = 1 }}]
[loss]
type = "mse"
[optimizer]
type = "adam"
lr = 0.05
[train]
epochs = 3
log_every = 1
eval_every_epochs = 0
threads = 1
on_nonfinite = "{on_nonfinite}"
[checkpoint]
every_steps = 2
"#
        ),
    )
}

fn run(job: &Path, runs: &Path) -> std::process::Output {
    trainer(
        &[
            "run",
            job.to_str().unwrap(),
            "--runs-dir",
            runs.to_str().unwrap(),
        ],
        &[],
    )
}

/// The train rows of metrics.csv as (step, loss, skipped_steps).
fn train_rows(dir: &Path) -> Vec<(u64, String, String)> {
    let (header, rows) = read_csv(&dir.join("metrics.csv"));
    rows.iter()
        .filter(|r| column(&header, r, "split") == "train")
        .map(|r| {
            (
                column(&header, r, "step").parse().unwrap(),
                column(&header, r, "loss").to_string(),
                column(&header, r, "skipped_steps").to_string(),
            )
        })
        .collect()
}

#[test]
fn skipped_steps_leave_the_model_as_if_the_bad_batch_were_not_there() {
    let tmp = tempfile::tempdir().unwrap();
    let runs = tmp.path().join("runs");
    // 32 rows, the bad one in the last batch: 8 steps an epoch, the 8th skipped.
    let job = regression_job(tmp.path(), 32, Some(30), "skip");
    let out = ok(run(&job, &runs));
    let skipping = PathBuf::from(stdout(&out).trim());
    let log = stderr(&out);
    for step in [8, 16, 24] {
        assert!(
            log.contains(&format!(
                "step {step} skipped: the loss or gradients are inf/NaN"
            )),
            "{log}"
        );
    }
    let s = summary(&skipping);
    assert_eq!(s["status"], "completed");
    assert_eq!(s["steps"], 24);

    // The same data without the last batch: 7 steps an epoch, nothing to skip.
    let job = regression_job(tmp.path(), 28, None, "skip");
    let clean = PathBuf::from(stdout(&ok(run(&job, &runs))).trim());
    assert_eq!(summary(&clean)["steps"], 21);

    // Parameters and Adam's state were untouched by the skipped steps: the same model, bit
    // for bit, and the same losses row by row.
    assert_eq!(
        std::fs::read(skipping.join("model.safetensors")).unwrap(),
        std::fs::read(clean.join("model.safetensors")).unwrap()
    );
    let rows = train_rows(&skipping);
    let clean_rows = train_rows(&clean);
    let losses = |rows: &[(u64, String, String)]| -> Vec<String> {
        rows.iter().map(|r| r.1.clone()).collect()
    };
    assert_eq!(losses(&rows), losses(&clean_rows));
    assert!(rows.iter().all(|r| r.1.parse::<f64>().unwrap().is_finite()));
    // A skipped step's window holds no applied step: no row (log_every = 1); skipped_steps
    // counts them in the rows after.
    let steps: Vec<u64> = rows.iter().map(|r| r.0).collect();
    assert!(!steps.contains(&8) && !steps.contains(&16) && !steps.contains(&24));
    assert_eq!(rows.iter().find(|r| r.0 == 9).unwrap().2, "1");
    let last = rows.last().unwrap();
    assert_eq!((last.0, last.2.as_str()), (23, "2"));
}

/// A NaN feature spoils only the steps that read it (skipped, or the run ends as diverged at
/// the first), through a linear layer and through a
/// ReLU (which passes NaN on, as PyTorch's does: clipped to 0 it would hide the NaN from
/// the loss while the weight gradient, 0 · NaN, turned the weights to NaN), on the CPU and,
/// where there is one, the GPU (whose linear layers then apply the ReLU in a pass of their
/// own, not in cuBLASLt's epilogue).
#[test]
fn a_nan_feature_spoils_only_its_own_steps_even_when_standardised() {
    let hidden = "layers = [{ type = \"linear\", out = 8 }, { type = \"relu\" }, \
                  { type = \"linear\", out = 1 }]";
    let mut cases = vec![("cpu", None), ("cpu", Some(hidden))];
    if common::gpu_present() {
        cases.extend([("cuda", None), ("cuda", Some(hidden))]);
    }
    for (device, layers) in cases {
        let case = format!("{device}, {}", layers.unwrap_or("one linear layer"));
        let tmp = tempfile::tempdir().unwrap();
        let runs = tmp.path().join("runs");
        let job = regression_job(tmp.path(), 32, None, "skip");
        // Row 30 (line 32, in the last batch) gets a NaN feature, and the features are
        // standardised: statistics over finite values keep the NaN out of every other sample.
        let mut text = std::fs::read_to_string(&job).unwrap();
        text = text.replace("normalize = \"none\"", "normalize = \"standardize\"");
        if let Some(layers) = layers {
            text = text.replace("layers = [{ type = \"linear\", out = 1 }]", layers);
        }
        text += &format!("[device]\ntype = \"{device}\"\n");
        std::fs::write(&job, text).unwrap();
        let csv_path = tmp.path().join("data-32.csv");
        let csv = std::fs::read_to_string(&csv_path).unwrap();
        let mut lines: Vec<String> = csv.lines().map(String::from).collect();
        let rest = lines[31].split_once(',').unwrap().1.to_string();
        lines[31] = format!("nan,{rest}");
        std::fs::write(&csv_path, lines.join("\n") + "\n").unwrap();

        let out = ok(run(&job, &runs));
        let log = stderr(&out);
        assert!(
            log.contains("data-32.csv: 1 value is not a finite number, the first at line 32, column 0 (`a`): `nan`"),
            "{case}: {log}"
        );
        let dir = PathBuf::from(stdout(&out).trim());
        assert_eq!(summary(&dir)["status"], "completed", "{case}");
        let rows = train_rows(&dir);
        assert!(
            rows.iter().all(|r| r.1.parse::<f64>().unwrap().is_finite()),
            "{case}"
        );
        assert_eq!(
            rows.last().unwrap().2,
            "2",
            "{case}: steps 8 and 16 skipped before the last row"
        );
        for step in [8, 16, 24] {
            assert!(
                log.contains(&format!("step {step} skipped")),
                "{case}: {log}"
            );
        }
        assert!(!log.contains("step 7 skipped"), "{case}: {log}");
        let weights = std::fs::read(dir.join("model.safetensors")).unwrap();
        let file = safetensors::SafeTensors::deserialize(&weights).unwrap();
        for (name, tensor) in file.tensors() {
            let mut values = tensor.data().chunks_exact(4);
            let finite = values.all(|b| f32::from_le_bytes(b.try_into().unwrap()).is_finite());
            assert!(finite, "{case}: {name} holds NaN");
        }
        // Without skipping, the first step that reads the NaN ends the run as diverged.
        let text = std::fs::read_to_string(&job).unwrap();
        std::fs::write(&job, text.replace("\"skip\"", "\"error\"")).unwrap();
        let out = run(&job, &runs);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{case}: {err}");
        let diverged = "training diverged: the loss is NaN at step 8 (epoch 1)";
        assert!(err.contains(diverged), "{case}: {err}");
    }
}

#[test]
fn with_error_a_nonfinite_loss_fails_the_run_and_keeps_its_last_good_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let runs = tmp.path().join("runs");
    let job = regression_job(tmp.path(), 32, Some(30), "error");
    let out = run(&job, &runs);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("training diverged: the loss is inf at step 8 (epoch 1)"),
        "{err}"
    );
    assert!(err.contains("train.on_nonfinite = \"skip\""), "{err}");
    // The data's inf is the likelier cause than the learning rate.
    assert!(
        err.contains("the data holds values that are not finite numbers"),
        "{err}"
    );
    let dir = only_run_dir(&runs);
    let s = summary(&dir);
    assert_eq!(s["status"], "failed");
    assert_eq!(s["end_reason"], "diverged");
    // The error names the run, and its log ends with the error.
    assert!(
        err.contains(&format!("the run: {}", dir.display())),
        "{err}"
    );
    let log = std::fs::read_to_string(dir.join("train.log")).unwrap();
    assert!(
        log.contains("error: training diverged: the loss is inf at step 8"),
        "{log}"
    );
    let mut checkpoints: Vec<String> = std::fs::read_dir(dir.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    checkpoints.sort();
    assert_eq!(checkpoints.last().unwrap(), "step-00000006.safetensors");
}

/// The loss is checked at train rows only: a checkpoint due between rows after an inf/NaN
/// step is not written (its weights are already spoilt), so the newest checkpoint stays the
/// last good state, and docs/errors.md's way on from it (skip, --force) completes the run.
#[test]
fn no_checkpoint_is_written_after_a_nonfinite_step_and_the_last_good_one_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    let runs = tmp.path().join("runs");
    let job = regression_job(tmp.path(), 32, Some(30), "error");
    let text = std::fs::read_to_string(&job)
        .unwrap()
        .replace("log_every = 1", "log_every = 5");
    std::fs::write(&job, text).unwrap();
    let out = run(&job, &runs);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(
            "training diverged: the loss since the last train row is inf at step 8, so no \
             checkpoint was written there"
        ),
        "{err}"
    );
    let dir = only_run_dir(&runs);
    assert_eq!(summary(&dir)["end_reason"], "diverged");
    let mut checkpoints: Vec<String> = std::fs::read_dir(dir.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    checkpoints.sort();
    assert_eq!(checkpoints.last().unwrap(), "step-00000006.safetensors");
    assert!(
        err.contains("the newest checkpoint, at step 6, is the last good state"),
        "{err}"
    );

    let resumed = trainer(
        &[
            "run",
            job.to_str().unwrap(),
            "--resume",
            dir.to_str().unwrap(),
            "--set",
            "train.on_nonfinite=\"skip\"",
            "--force",
        ],
        &[],
    );
    ok(resumed);
    assert_eq!(summary(&dir)["status"], "completed");
    // Steps 8, 16 and 24 hold the bad row: skipped in each epoch.
    let last = train_rows(&dir).pop().unwrap();
    assert_eq!((last.0, last.2.as_str()), (24, "3"));
    assert!(last.1.parse::<f64>().unwrap().is_finite());
}

#[test]
fn too_many_skipped_steps_in_a_row_end_the_run_as_diverged() {
    let tmp = tempfile::tempdir().unwrap();
    let runs = tmp.path().join("runs");
    // Gradient descent on a quadratic with a far too large step grows until it overflows;
    // from then on every step is skipped.
    let job = write_job(
        tmp.path(),
        r#"
[job]
name = "exploding"
[data]
source = "synthetic"
task = "regression"
samples = 256
num_features = 8
[model]
layers = [{ type = "linear", out = 1 }]
[loss]
type = "mse"
[optimizer]
type = "sgd"
lr = 100.0
[train]
epochs = 100
log_every = 1
threads = 1
on_nonfinite = "skip"
"#,
    );
    let out = run(&job, &runs);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("training diverged: 100 steps in a row"),
        "{err}"
    );
    assert!(err.contains("99 in a row"), "each skip is logged: {err}");
    let dir = only_run_dir(&runs);
    assert_eq!(summary(&dir)["end_reason"], "diverged");
    // Every row written has a finite loss: skipped steps never reach one.
    assert!(train_rows(&dir)
        .iter()
        .all(|r| r.1.parse::<f64>().unwrap().is_finite()));
}

/// Every batch holds the bad row: every step is skipped, and the run says that nothing was
/// trained rather than pass as a quiet success.
#[test]
fn a_run_whose_every_step_was_skipped_warns_that_nothing_was_trained() {
    let tmp = tempfile::tempdir().unwrap();
    let job = regression_job(tmp.path(), 4, Some(0), "skip");
    let out = run(&job, &tmp.path().join("runs"));
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("WARN all 3 steps were skipped") && err.contains("nothing was trained"),
        "{err}"
    );
}

/// A test set whose loss is inf (a target of inf in it): the run warns, and its
/// checkpoints, whose state holds the evaluation, still read back (the inf was written as
/// JSON null, and the checkpoint could not be resumed).
#[test]
fn a_nonfinite_evaluation_is_warned_and_its_checkpoint_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(
        tmp.path().join("test.csv"),
        "a,b,c,y\n0.1,0.2,0.3,inf\n1,2,3,4\n",
    )
    .unwrap();
    let job = regression_job(tmp.path(), 16, None, "error");
    let text = std::fs::read_to_string(&job)
        .unwrap()
        .replace("eval_every_epochs = 0", "eval_every_epochs = 1")
        .replace("task = ", "test_path = \"test.csv\"\ntask = ")
        .replace("every_steps = 2", "every_epochs = 1");
    std::fs::write(&job, text).unwrap();
    let runs = tmp.path().join("runs");
    let out = ok(run(&job, &runs));
    assert!(
        stderr(&out).contains("the test loss is inf at step 4"),
        "{}",
        stderr(&out)
    );
    let dir = PathBuf::from(stdout(&out).trim());
    let early = dir.join("checkpoints/step-00000004.safetensors");
    let resumed = trainer(
        &[
            "run",
            job.to_str().unwrap(),
            "--runs-dir",
            runs.to_str().unwrap(),
            "--resume",
            early.to_str().unwrap(),
            // Back from the completed run's end: --force, as the resume replaces it.
            "--force",
        ],
        &[],
    );
    ok(resumed);
    assert_eq!(summary(&dir)["status"], "completed");
}

#[test]
fn a_bad_on_nonfinite_names_the_key_and_the_choices() {
    expect_error(
        common::TINY_JOB,
        &[
            "run",
            "JOB",
            "--runs-dir",
            "RUNS",
            "--set",
            "train.on_nonfinite=\"ignore\"",
        ],
        2,
        &["train.on_nonfinite", "ignore", "error", "skip"],
    );
}

/// A diverged run names the step whose loss first was not finite, not the step of the log
/// row that averages it; metrics.csv keeps the rows before that row.
#[test]
fn a_diverged_run_names_the_first_step_whose_loss_was_not_finite() {
    let tmp = tempfile::tempdir().unwrap();
    let runs = tmp.path().join("runs");
    // Row 30 (of 4 a batch, unshuffled) is in step 8; rows are logged every 5 steps.
    let job = regression_job(tmp.path(), 64, Some(30), "error");
    let text = std::fs::read_to_string(&job).unwrap();
    // No checkpoints: the one at step 8 would find the inf first.
    let text = text.replace("log_every = 1", "log_every = 5");
    // On the CPU, which sees each step's loss without waiting (a GPU names the row's steps).
    let text = text.replace("[checkpoint]\nevery_steps = 2", "[device]\ntype = \"cpu\"");
    std::fs::write(&job, text).unwrap();
    let out = run(&job, &runs);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("training diverged: the loss is inf at step 8 (epoch 1)"),
        "{err}"
    );
    let dir = only_run_dir(&runs);
    let metrics = std::fs::read_to_string(dir.join("metrics.csv")).unwrap();
    let steps: Vec<&str> = metrics
        .lines()
        .skip(1)
        .map(|l| l.split(',').next().unwrap())
        .collect();
    assert_eq!(steps, ["5"], "{metrics}");
}
