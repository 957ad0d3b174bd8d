//! Sweeps and results end to end through the binary: sweeps (and finishing a killed one),
//! ls / compare parsed back in every format, plots, early stopping and the other ways a run
//! ends, provenance, `check --explain`, completions, and the bad-input cases.

use crate::common;

use common::{
    column, expect_error, ok, read_csv, root, stderr, stdout, summary, torch_python, trainer_bin,
    trainer_with_env as trainer, write_job, TINY_JOB,
};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// TINY_JOB with a hidden layer: `optimizer.lr=1e30` makes its outputs NaN (TINY_JOB's
/// single linear layer only grows huge).
fn hidden_layer_job() -> String {
    TINY_JOB.replace(
        "layers = [{ type = \"flatten\" }, { type = \"linear\", out = 10 }]",
        "layers = [{ type = \"flatten\" }, { type = \"linear\", out = 16 },\n\
         { type = \"relu\" }, { type = \"linear\", out = 10 }]",
    )
}

/// `trainer run JOB --runs-dir RUNS -q EXTRA...`, which must succeed: its run directory.
fn trained(job: &Path, runs: &Path, extra: &[&str]) -> PathBuf {
    let mut args = vec!["run", job.to_str().unwrap(), "--runs-dir"];
    args.extend([runs.to_str().unwrap(), "-q"]);
    args.extend_from_slice(extra);
    PathBuf::from(stdout(&ok(trainer(&args, &[]))).trim())
}

fn sweep_args<'a>(job: &'a str, runs: &'a str) -> Vec<&'a str> {
    vec![
        "sweep",
        job,
        "--grid",
        "optimizer.lr=0.05,0.2",
        "--grid",
        "data.batch_size=32,64",
        "--runs-dir",
        runs,
    ]
}

#[test]
fn a_2x2_sweep_makes_four_runs_and_an_index_and_a_rerun_redoes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), TINY_JOB);
    let runs = tmp.path().join("runs");
    let (job, runs_s) = (job.to_str().unwrap(), runs.to_str().unwrap());
    let out = ok(trainer(&sweep_args(job, runs_s), &[]));
    let sweep_dir = PathBuf::from(stdout(&out).trim());
    assert_eq!(sweep_dir.parent().unwrap(), runs.join("tiny"));
    assert!(sweep_dir
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .starts_with("sweep-"));

    let (header, rows) = read_csv(&sweep_dir.join("sweep.csv"));
    assert_eq!(rows.len(), 4, "{rows:?}");
    let mut seen = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        assert_eq!(column(&header, row, "point"), i.to_string());
        assert_eq!(column(&header, row, "status"), "completed");
        assert_eq!(column(&header, row, "end_reason"), "completed");
        let lr = column(&header, row, "optimizer.lr");
        let bs = column(&header, row, "data.batch_size");
        seen.push(format!("{lr} {bs}"));
        let run_dir = sweep_dir.join(column(&header, row, "run_dir"));
        let config = std::fs::read_to_string(run_dir.join("config.toml")).unwrap();
        assert!(config.contains(&format!("lr = {lr}")), "{config}");
        // A point's log is its own run's, not the sweep's lines about other points.
        let log = std::fs::read_to_string(run_dir.join("train.log")).unwrap();
        assert!(!log.contains("sweep point"), "{log}");
        assert!(config.contains(&format!("batch_size = {bs}")), "{config}");
        let s = summary(&run_dir);
        let val_loss: f64 = column(&header, row, "val_loss").parse().unwrap();
        // (serde_json's float parsing may differ in the last bit.)
        assert!((val_loss - s["final"]["val_loss"].as_f64().unwrap()).abs() < 1e-12);
        let best: f64 = column(&header, row, "best_val_accuracy").parse().unwrap();
        assert!((0.0..=1.0).contains(&best));
        assert!(column(&header, row, "wall_s").parse::<f64>().unwrap() > 0.0);
    }
    assert_eq!(seen, ["0.05 32", "0.05 64", "0.2 32", "0.2 64"]);
    let point_dirs = std::fs::read_dir(&sweep_dir)
        .unwrap()
        .flatten()
        .filter(|e| e.path().join("config.toml").exists())
        .count();
    assert_eq!(point_dirs, 4);

    // The same sweep again: the same directory, nothing trained again.
    let first_run = sweep_dir.join(column(&header, &rows[0], "run_dir"));
    let first_summary = std::fs::read_to_string(first_run.join("summary.json")).unwrap();
    let again = ok(trainer(&sweep_args(job, runs_s), &[]));
    assert_eq!(stdout(&again).trim(), sweep_dir.to_str().unwrap());
    assert_eq!(
        stderr(&again).matches("completed before, skipped").count(),
        4
    );
    assert_eq!(
        std::fs::read_to_string(first_run.join("summary.json")).unwrap(),
        first_summary
    );
    assert!(!stderr(&again).contains("its run trained with"));
    // Spelled otherwise, it is still the same sweep.
    let respelled: Vec<&str> = sweep_args(job, runs_s)
        .into_iter()
        .map(|a| match a {
            "optimizer.lr=0.05,0.2" => "optimizer.lr=5e-2,2E-1",
            "data.batch_size=32,64" => "data.batch_size=3_2,64",
            a => a,
        })
        .collect();
    let again = ok(trainer(&respelled, &[]));
    assert_eq!(stdout(&again).trim(), sweep_dir.to_str().unwrap());
    assert_eq!(
        stderr(&again).matches("completed before, skipped").count(),
        4
    );

    // A point resumed by hand with another learning rate (--force, which rewrites its
    // config.toml) no longer holds what its sweep.csv values say: the sweep says so when it
    // runs again.
    let config = first_run.join("config.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replace("lr = 0.05\n", "lr = 0.5\n")).unwrap();
    let again = ok(trainer(&sweep_args(job, runs_s), &[]));
    let says = "sweep point 000 (optimizer.lr=0.05 data.batch_size=32): its run trained with \
                optimizer.lr = 0.5 (the sweep's is 0.05)";
    assert!(stderr(&again).contains(says), "{}", stderr(&again));

    // compare and ls read the sweep back, in every format.
    let csv_out = ok(trainer(
        &["compare", sweep_dir.to_str().unwrap(), "--format", "csv"],
        &[],
    ));
    let mut reader = csv::Reader::from_reader(csv_out.stdout.as_slice());
    let header: Vec<String> = reader.headers().unwrap().iter().map(String::from).collect();
    let rows: Vec<Vec<String>> = reader
        .records()
        .map(|r| r.unwrap().iter().map(String::from).collect())
        .collect();
    assert_eq!(rows.len(), 4);
    assert!(header.contains(&"optimizer.lr".to_string()), "{header:?}");
    assert!(header.contains(&"data.batch_size".to_string()));
    assert!(
        !header.contains(&"optimizer.type".to_string()),
        "only keys that differ: {header:?}"
    );
    for row in &rows {
        assert_eq!(column(&header, row, "status"), "completed");
        let last: f64 = column(&header, row, "val_loss").parse().unwrap();
        let best: f64 = column(&header, row, "best_val_loss").parse().unwrap();
        assert!(best <= last);
        assert_eq!(column(&header, row, "epochs"), "1");
    }

    let json_out = ok(trainer(
        &["compare", sweep_dir.to_str().unwrap(), "--format", "json"],
        &[],
    ));
    let json: serde_json::Value = serde_json::from_slice(&json_out.stdout).unwrap();
    let array = json.as_array().unwrap();
    assert_eq!(array.len(), 4);
    assert_eq!(array[0]["status"], "completed");
    assert!(array[0]["val_accuracy"].as_f64().unwrap() > 0.5);
    // Keys in column order, config values as JSON numbers.
    let text = stdout(&json_out);
    let keys: Vec<usize> = header
        .iter()
        .map(|c| text.find(&format!("\"{c}\":")).unwrap())
        .collect();
    assert!(keys.windows(2).all(|w| w[0] < w[1]), "{header:?}\n{text}");
    assert_eq!(array[3]["optimizer.lr"], 0.2);
    assert_eq!(array[3]["data.batch_size"], 64);

    let md = stdout(&ok(trainer(
        &[
            "compare",
            sweep_dir.to_str().unwrap(),
            "--format",
            "markdown",
        ],
        &[],
    )));
    let lines: Vec<&str> = md.lines().collect();
    assert_eq!(lines.len(), 6, "{md}");
    assert!(lines[1].starts_with("| --- |"));
    assert!(lines.iter().all(|l| l.starts_with('|') && l.ends_with('|')));

    let table = stdout(&ok(trainer(&["ls", runs_s], &[])));
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 5, "{table}");
    let heads: Vec<&str> = lines[0].split_whitespace().collect();
    assert_eq!(&heads[..3], ["run", "status", "end_reason"]);
    for line in &lines[1..] {
        let fields: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(fields.len(), heads.len(), "{table}");
        assert_eq!(fields[1], "completed");
    }
    // Columns line up: every row's status starts where the header's does.
    let at = lines[0].find("status").unwrap();
    assert!(lines[1..].iter().all(|l| l[at..].starts_with("completed")));

    // plot writes a PNG and an SVG of the four runs.
    let png = tmp.path().join("curves.png");
    ok(trainer(
        &[
            "plot",
            sweep_dir.to_str().unwrap(),
            "--metric",
            "loss,accuracy",
            "-o",
            png.to_str().unwrap(),
        ],
        &[],
    ));
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    assert!(bytes.len() > 20_000, "{} bytes", bytes.len());
    let svg = tmp.path().join("curves.svg");
    ok(trainer(
        &[
            "plot",
            sweep_dir.to_str().unwrap(),
            "--x",
            "epoch",
            "-o",
            svg.to_str().unwrap(),
        ],
        &[],
    ));
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg"), "{}", &text[..100]);
    assert!(
        text.contains("batch_size=64 lr=0.2"),
        "legend names the runs"
    );
    assert!(text.contains("\nepoch\n"), "the x axis is named");
}

/// SIGINT between a sweep's points, or while the next point loads its data (a large data
/// set here), stops the sweep with exit 130, as it does during training: it was caught by a
/// handler with nothing left to do and lost, and the sweep went on to the end.
#[test]
fn a_signal_between_sweep_points_stops_the_sweep() {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(
        tmp.path(),
        r#"
[job]
name = "slow_start"
[device]
type = "cpu"
[data]
source = "synthetic"
num_features = 8
classes = 4
batch_size = 64
[model]
layers = [{ type = "linear", out = 4 }]
[optimizer]
type = "sgd"
lr = 0.1
[train]
epochs = 1
threads = 1
"#,
    );
    let runs = tmp.path().join("runs");
    let mut child = Command::new(trainer_bin())
        .args(["sweep", job.to_str().unwrap(), "--quiet", "--sweep-id", "s"])
        .args(["--grid", "data.samples=64,3000000", "--runs-dir"])
        .arg(&runs)
        .current_dir(root())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let sweep = runs.join("slow_start/s");
    let first_done = || {
        let dirs = std::fs::read_dir(&sweep).into_iter().flatten().flatten();
        dirs.into_iter().any(|e| {
            e.file_name().to_string_lossy().starts_with("000-")
                && e.path().join("summary.json").exists()
        })
    };
    let started = Instant::now();
    while !first_done() {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no first point"
        );
        assert!(child.try_wait().unwrap().is_none(), "the sweep ended early");
        std::thread::sleep(Duration::from_millis(1));
    }
    // SAFETY: kill(2) on our own child, not yet reaped.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(err.contains("sweep stopped by a signal"), "{err}");
    let (header, rows) = read_csv(&sweep.join("sweep.csv"));
    assert_eq!(column(&header, &rows[0], "status"), "completed");
    assert_ne!(column(&header, &rows[1], "status"), "completed");
}

#[test]
fn a_killed_sweep_finishes_when_run_again_without_redoing_finished_points() {
    let tmp = tempfile::tempdir().unwrap();
    // Points that last 1.5 s on any machine (max_time), so the kill lands inside the second.
    let job = write_job(
        tmp.path(),
        &TINY_JOB.replace("epochs = 1", "epochs = 1000000\nmax_time = \"1.5s\""),
    );
    let runs = tmp.path().join("runs");
    let args = vec![
        "sweep",
        job.to_str().unwrap(),
        "--grid",
        "optimizer.lr=0.01,0.02,0.03",
        "--runs-dir",
        runs.to_str().unwrap(),
        "--sweep-id",
        "killed",
        "--quiet",
    ];
    let mut child = Command::new(trainer_bin())
        .args(&args)
        .current_dir(root())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let index = runs.join("tiny/killed/sweep.csv");
    let started = Instant::now();
    // Wait until the first point has completed and the second has written its first rows.
    let second_started = || {
        let index = std::fs::read_to_string(&index).unwrap_or_default();
        index.contains(",completed,")
            && index.contains(",running,")
            && std::fs::read_dir(runs.join("tiny/killed"))
                .unwrap()
                .flatten()
                .any(|e| {
                    e.file_name().to_string_lossy().starts_with("001-")
                        && e.path().join("metrics.csv").exists()
                })
    };
    while !second_started() {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the second point never started"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let (header, rows) = read_csv(&index);
    assert_eq!(column(&header, &rows[0], "status"), "completed");
    assert_eq!(
        column(&header, &rows[1], "status"),
        "running",
        "the kill should land in the second point: {rows:?}"
    );
    let first = runs
        .join("tiny/killed")
        .join(column(&header, &rows[0], "run_dir"));
    let first_summary = std::fs::read_to_string(first.join("summary.json")).unwrap();
    let second = runs
        .join("tiny/killed")
        .join(column(&header, &rows[1], "run_dir"));
    assert!(!second.join("summary.json").exists());

    // ls sees the killed run for what it is.
    let ls = stdout(&ok(trainer(
        &["ls", runs.to_str().unwrap(), "--format", "json"],
        &[],
    )));
    let listed: serde_json::Value = serde_json::from_str(&ls).unwrap();
    let statuses: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["status"].as_str().unwrap())
        .collect();
    assert_eq!(statuses, ["completed", "killed"]);

    let mut again = args.clone();
    again.pop(); // not --quiet: the log says what was skipped
    let out = ok(trainer(&again, &[]));
    assert_eq!(stderr(&out).matches("completed before, skipped").count(), 1);
    assert!(stderr(&out).contains("did not finish; starting it again"));
    // The killed attempt, which wrote no checkpoint, is kept beside the point it restarted.
    let kept = PathBuf::from(format!("{}.attempt-1", second.display()));
    assert!(kept.join("metrics.csv").is_file() && kept.join("train.log").is_file());
    assert!(!kept.join("summary.json").exists());
    let (header, rows) = read_csv(&index);
    assert_eq!(rows.len(), 3);
    assert!(rows
        .iter()
        .all(|r| column(&header, r, "status") == "completed"));
    assert_eq!(
        std::fs::read_to_string(first.join("summary.json")).unwrap(),
        first_summary,
        "the finished point was not trained again"
    );
    assert_eq!(summary(&second)["status"], "completed");
}

#[test]
fn early_stopping_ends_at_the_expected_epoch_on_a_plateau() {
    let tmp = tempfile::tempdir().unwrap();
    // A learning rate so small that val_loss cannot improve by min_delta: epoch 1 sets the
    // best, epochs 2 and 3 do not beat it, patience 2 stops after epoch 3.
    let job = TINY_JOB.replace("lr = 0.1", "lr = 1e-9").replace(
        "epochs = 1",
        "epochs = 20\nearly_stopping = { metric = \"val_loss\", patience = 2, min_delta = 0.01 }",
    );
    let job = write_job(tmp.path(), &job);
    let runs = tmp.path().join("runs");
    let out = ok(trainer(
        &[
            "run",
            job.to_str().unwrap(),
            "--runs-dir",
            runs.to_str().unwrap(),
        ],
        &[],
    ));
    let dir = PathBuf::from(stdout(&out).trim());
    let s = summary(&dir);
    assert_eq!(s["end_reason"], "early_stopped");
    assert_eq!(s["epochs"], 3);
    let (header, rows) = read_csv(&dir.join("metrics.csv"));
    let val_epochs: Vec<&str> = rows
        .iter()
        .filter(|r| column(&header, r, "split") == "val")
        .map(|r| column(&header, r, "epoch"))
        .collect();
    assert_eq!(val_epochs, ["1", "2", "3"]);
    assert!(stderr(&out).contains("early stopping: val_loss has not improved"));
    // The last train row covers the last step (69, where log_every = 5 wrote 65 last).
    let last_train = rows
        .iter()
        .rfind(|r| column(&header, r, "split") == "train")
        .unwrap();
    assert_eq!(column(&header, last_train, "step"), "69");
    assert_eq!(s["steps"], 69);

    // A learning model is not stopped: accuracy keeps improving for a while at lr 0.1.
    let job = write_job(
        tmp.path(),
        &TINY_JOB.replace(
            "epochs = 1",
            "epochs = 4\nearly_stopping = { metric = \"val_accuracy\", patience = 3 }",
        ),
    );
    let s = summary(&trained(&job, &runs, &[]));
    assert_eq!(s["end_reason"], "completed");
    assert_eq!(s["epochs"], 4);
}

#[test]
fn every_way_a_run_ends_is_in_its_summary() {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), TINY_JOB);
    let runs = tmp.path().join("runs");
    let run = |sets: &[&str]| {
        let mut args = vec![
            "run",
            job.to_str().unwrap(),
            "--runs-dir",
            runs.to_str().unwrap(),
            "-q",
        ];
        for s in sets {
            args.extend(["--set", s]);
        }
        trainer(&args, &[])
    };
    let reason = |out: &Output| summary(Path::new(stdout(out).trim()))["end_reason"].clone();

    assert_eq!(reason(&ok(run(&[]))), "completed");
    assert_eq!(reason(&ok(run(&["train.max_steps=3"]))), "max_steps");
    let timed = ok(run(&["train.epochs=100000", "train.max_time=\"1s\""]));
    assert_eq!(reason(&timed), "max_time");
    let s = summary(Path::new(stdout(&timed).trim()));
    assert!(s["wall_s"].as_f64().unwrap() < 30.0);
    assert!(s["final"]["val_loss"].is_number(), "evaluated at the end");

    // Gradient descent on a quadratic with a far too large step grows geometrically.
    let exploding = write_job(
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
epochs = 50
log_every = 1
"#,
    );
    let diverged = trainer(
        &[
            "run",
            exploding.to_str().unwrap(),
            "--runs-dir",
            runs.to_str().unwrap(),
            "-q",
        ],
        &[],
    );
    assert_eq!(diverged.status.code(), Some(1), "{}", stderr(&diverged));
    assert!(stderr(&diverged).contains("training diverged"));
    let dir = std::fs::read_dir(runs.join("exploding"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| summary(p)["status"] == "failed")
        .expect("the diverged run has a summary");
    assert_eq!(summary(&dir)["end_reason"], "diverged");
}

#[test]
fn each_run_records_its_provenance() {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), TINY_JOB);
    let runs = tmp.path().join("runs");
    let run = |lr: &str| {
        let set = format!("optimizer.lr={lr}");
        let out = ok(trainer(
            &[
                "run",
                job.to_str().unwrap(),
                "--runs-dir",
                runs.to_str().unwrap(),
                "-q",
                "--set",
                &set,
            ],
            &[],
        ));
        let dir = PathBuf::from(stdout(&out).trim());
        let text = std::fs::read_to_string(dir.join("provenance.json")).unwrap();
        serde_json::from_str::<serde_json::Value>(&text).unwrap()
    };
    let a = run("0.1");
    assert_eq!(a["trainer_version"], env!("CARGO_PKG_VERSION"));
    assert!(!a["git_commit"].as_str().unwrap().is_empty());
    assert!(a["device"].as_str().unwrap().starts_with("cpu"));
    let command = a["command_line"].as_str().unwrap();
    assert!(command.contains(" run ") && command.contains("--set optimizer.lr=0.1"));
    let hash = a["spec_hash"].as_str().unwrap();
    assert!(hash.starts_with("fnv1a64:") && hash.len() == 24, "{hash}");
    // Same resolved spec, same hash; another value, another hash.
    assert_eq!(run("0.1")["spec_hash"], a["spec_hash"]);
    assert_ne!(run("0.2")["spec_hash"], a["spec_hash"]);
}

#[test]
fn check_explain_says_where_every_value_came_from() {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), TINY_JOB);
    let out = ok(trainer(
        &[
            "check",
            job.to_str().unwrap(),
            "--explain",
            "--set",
            "train.epochs=2",
            "--set",
            "model.layers[1].bias=false",
        ],
        &[("TRAINER_OPTIMIZER__LR", "0.3")],
    ));
    let text = stdout(&out);
    let line = |key: &str| -> Vec<String> {
        let l = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(key))
            .unwrap_or_else(|| panic!("no {key} in\n{text}"));
        l.split_whitespace().map(String::from).collect()
    };
    assert_eq!(
        line("optimizer.lr")[1..],
        ["0.3", "environment", "TRAINER_OPTIMIZER__LR"]
    );
    assert_eq!(line("train.epochs")[1..], ["2", "--set", "train.epochs"]);
    assert_eq!(line("data.source")[1], "\"digits\"");
    assert_eq!(line("data.source")[2], "file");
    assert_eq!(line("train.eval_every_epochs")[1..], ["1", "default"]);
    // The other values of a layer that --set changed are still the file's.
    assert_eq!(line("model.layers[1].out")[1..3], ["10", "file"]);
    assert_eq!(
        line("model.layers[1].bias")[1..],
        ["false", "--set", "model.layers[1].bias"]
    );
    assert_eq!(line("model.layers[0].type")[2], "file");
    // Settings this job cannot take (another optimizer's, dynamic loss scaling's without
    // it, data parallelism's without replicas) are not listed.
    for absent in [
        "optimizer.betas",
        "optimizer.eps",
        "precision.init_scale",
        "parallel.backend",
    ] {
        assert!(
            !text.lines().any(|l| l.starts_with(&format!("{absent} "))),
            "{absent} in\n{text}"
        );
    }
    assert_eq!(line("optimizer.momentum")[1..], ["0.0", "default"]);

    // A --set that gives a layer's key its file value is still the --set.
    let out = ok(trainer(
        &[
            "check",
            job.to_str().unwrap(),
            "--explain",
            "--set",
            "model.layers[1].out=10",
        ],
        &[],
    ));
    let text = stdout(&out);
    assert!(
        text.lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>()
                == ["model.layers[1].out", "10", "--set", "model.layers[1].out"]),
        "{text}"
    );
}

#[test]
fn completions_are_generated_for_the_common_shells() {
    for shell in ["bash", "zsh", "fish"] {
        let out = ok(trainer(&["completions", shell], &[]));
        let text = stdout(&out);
        assert!(
            text.contains("trainer") && text.contains("sweep"),
            "{shell}"
        );
    }
    let out = trainer(&["completions", "tcsh"], &[]);
    assert_eq!(out.status.code(), Some(2));
    let help = stdout(&ok(trainer(&["--help"], &[])));
    for command in ["sweep", "ls", "compare", "plot", "completions", "--explain"] {
        assert!(help.contains(command), "--help lacks {command}");
    }
    let sweep_help = stdout(&ok(trainer(&["sweep", "--help"], &[])));
    for flag in [
        "--grid",
        "--zip",
        "--sweep-id",
        "--retry-failed",
        "--runs-dir",
        "--devices",
    ] {
        assert!(sweep_help.contains(flag), "sweep --help lacks {flag}");
    }
}

/// The notation errors use for a layer's key (`model.layers[1].out`) is one `--set` and
/// `--grid` take, by position or by the layer's name.
#[test]
fn a_sweep_over_one_layers_width_edits_that_layer_only() {
    let tmp = tempfile::tempdir().unwrap();
    let hidden = TINY_JOB.replace(
        "layers = [{ type = \"flatten\" }, { type = \"linear\", out = 10 }]",
        "layers = [{ type = \"flatten\" }, { type = \"linear\", out = 32, name = \"hidden\" },\n\
         { type = \"relu\" }, { type = \"linear\", out = 10 }]",
    );
    assert_ne!(hidden, TINY_JOB);
    let job = write_job(tmp.path(), &hidden);
    let runs = tmp.path().join("runs");
    let (job, runs_s) = (job.to_str().unwrap(), runs.to_str().unwrap());
    let grid = ["--grid", "model.layers[hidden].out=8,16"];
    let sets = ["--set", "model.layers[2].type=\"tanh\""];
    let args = [
        &["sweep", job, "--runs-dir", runs_s, "-q"][..],
        &grid,
        &sets,
    ]
    .concat();
    let sweep_dir = PathBuf::from(stdout(&ok(trainer(&args, &[]))).trim());
    let (header, rows) = read_csv(&sweep_dir.join("sweep.csv"));
    let widths: Vec<&str> = rows
        .iter()
        .map(|row| column(&header, row, "model.layers[hidden].out"))
        .collect();
    assert_eq!(widths, ["8", "16"]);
    for (row, width) in rows.iter().zip(["8", "16"]) {
        let run_dir = sweep_dir.join(column(&header, row, "run_dir"));
        let config = std::fs::read_to_string(run_dir.join("config.toml")).unwrap();
        let spec: toml::Table = toml::from_str(&config).unwrap();
        let layers = spec["model"]["layers"].as_array().unwrap();
        let types: Vec<&str> = layers.iter().map(|l| l["type"].as_str().unwrap()).collect();
        assert_eq!(types, ["flatten", "linear", "tanh", "linear"]);
        assert_eq!(layers[1]["out"].to_string(), width);
        assert_eq!(layers[1]["name"].as_str(), Some("hidden"));
        assert_eq!(layers[3]["out"].as_integer(), Some(10));
        assert_eq!(summary(&run_dir)["status"], "completed");
    }
    // compare shows the one key that differs, not the whole list of layers.
    let sweep_s = sweep_dir.to_str().unwrap();
    let table = stdout(&ok(trainer(&["compare", sweep_s, "--format", "csv"], &[])));
    let header = table.lines().next().unwrap();
    assert!(header.contains(",model.layers[1].out,"), "{header}");
    assert!(!header.contains(",model.layers,"), "{header}");
}

#[test]
fn bad_sweeps_are_refused_before_anything_trains() {
    let sweep = |extra: &[&'static str]| {
        let mut a = vec!["sweep", "JOB", "--runs-dir", "RUNS"];
        a.extend_from_slice(extra);
        a
    };
    expect_error(
        TINY_JOB,
        &sweep(&["--grid", "optimizer.lr"]),
        2,
        &["--grid optimizer.lr", "expected KEY=V1,V2"],
    );
    expect_error(
        TINY_JOB,
        &sweep(&["--grid", "optimizer.lr="]),
        2,
        &["--grid optimizer.lr=", "empty value"],
    );
    // One value in two TOML types: one job.
    expect_error(
        TINY_JOB,
        &sweep(&["--grid", "optimizer.weight_decay=0,0.0"]),
        2,
        &[
            "sweep points 000 (optimizer.weight_decay=0) and 001 (optimizer.weight_decay=0.0) \
           resolve to the same job",
        ],
    );
    expect_error(
        TINY_JOB,
        &sweep(&["--grid", "optimizer.lrr=0.1,0.2"]),
        2,
        &[
            "sweep point 000 (optimizer.lrr=0.1)",
            "optimizer.lrr",
            "did you mean `lr`?",
        ],
    );
    expect_error(
        TINY_JOB,
        &sweep(&["--grid", "optimizer.lr=0.1,-1"]),
        2,
        &[
            "sweep point 001 (optimizer.lr=-1)",
            "-1 given; must be a positive number",
        ],
    );
    // What only the data tells (a model that does not fit it, a data file missing) is
    // checked for every point too, before the first trains.
    expect_error(
        TINY_JOB,
        &sweep(&["--grid", "model.layers[1].out=10,5"]),
        2,
        &[
            "sweep point 001 (model.layers[1].out=5)",
            "outputs [5] (5 values per sample) but cross_entropy needs one logit per class",
        ],
    );
    let digits = common::root().join("jobs/data/digits.csv.gz");
    let csv_job = TINY_JOB.replace(
        "source = \"digits\"",
        &format!("source = \"csv\"\npath = \"{}\"", digits.display()),
    );
    let paths = format!("data.path=\"{}\",\"nowhere.csv\"", digits.display());
    let mut args: Vec<&str> = sweep(&["--grid"]);
    args.push(&paths);
    expect_error(
        &csv_job,
        &args,
        2,
        &[
            "sweep point 001 (data.path=nowhere.csv)",
            "cannot read data file",
        ],
    );
    expect_error(
        TINY_JOB,
        &sweep(&["--grid", "model.layers[2].out=8,16"]),
        2,
        &["model.layers[2]`: the list has 2 elements, [0] to [1]"],
    );
    expect_error(
        TINY_JOB,
        &sweep(&["--grid", "model.layers[fc].out=8,16"]),
        2,
        &["no element of `model.layers` has a name; pick one by position"],
    );
    expect_error(
        TINY_JOB,
        &sweep(&[
            "--zip",
            "optimizer.lr=0.1,0.2",
            "--zip",
            "data.batch_size=8,16,32",
        ]),
        2,
        &["--zip optimizer.lr has 2 values but --zip data.batch_size has 3"],
    );
    expect_error(
        TINY_JOB,
        &sweep(&["--grid", "optimizer.lr=1e-3,0.01,0.001"]),
        2,
        &["the value 0.001 is given twice (1e-3 and 0.001)"],
    );
    expect_error(
        TINY_JOB,
        &sweep(&[
            "--zip",
            "optimizer.lr=0.1,0.2,0.1",
            "--zip",
            "data.batch_size=8,16,8",
        ]),
        2,
        &["points 1 and 3 give every zipped key the same value"],
    );
    expect_error(
        TINY_JOB,
        &sweep(&[
            "--grid",
            "optimizer.lr=0.1,0.2",
            "--set",
            "optimizer.lr=0.3",
        ]),
        2,
        &["--grid optimizer.lr and --set optimizer.lr set the same key"],
    );
    // One key spelled two ways (by position, by name, from the end; or inside a table
    // another axis sets): one value silently won, and sweep.csv recorded both.
    let named = TINY_JOB.replace(
        "{ type = \"linear\", out = ",
        "{ type = \"linear\", name = \"fc\", out = ",
    );
    expect_error(
        &named,
        &sweep(&[
            "--grid",
            "model.layers[-1].out=3,4",
            "--grid",
            "model.layers[fc].out=5,6",
        ]),
        2,
        &["--grid model.layers[-1].out and --grid model.layers[fc].out set the same key"],
    );
    expect_error(
        TINY_JOB,
        &sweep(&[
            "--grid",
            "optimizer.lr=0.1,0.2",
            "--grid",
            "optimizer={ type = \"sgd\", lr = 0.5 },{ type = \"adam\", lr = 0.5 }",
        ]),
        2,
        &["--grid optimizer.lr and --grid optimizer overlap: optimizer holds optimizer.lr"],
    );
    expect_error(
        TINY_JOB,
        &sweep(&["--grid", "optimizer.lr=0.1,\"0.2"]),
        2,
        &["`\"0.2` is not a valid TOML value"],
    );
    // What the device tells: NCCL averages gradients between GPUs, not CPU replicas.
    expect_error(
        TINY_JOB,
        &sweep(&[
            "--grid",
            "parallel.backend=\"tcp\",\"nccl\"",
            "--set",
            "parallel.replicas=2",
        ]),
        2,
        &[
            "sweep point 001 (parallel.backend=nccl)",
            "this run is on the CPU",
        ],
    );
    expect_error(TINY_JOB, &sweep(&[]), 2, &["at least one --grid"]);
    expect_error(
        TINY_JOB,
        &sweep(&["--grid", "optimizer.lr=0.1", "--sweep-id", "../x"]),
        2,
        &["--sweep-id \"../x\"", "allowed"],
    );
}

/// A run with data parallelism records parallel.timeout and bucket_mb, one without does not
/// (they do nothing there): compared, they are not a difference, replicas are.
#[test]
fn compare_does_not_count_parallel_defaults_as_differences() {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), TINY_JOB);
    let runs = tmp.path().join("runs");
    let plain = trained(&job, &runs, &[]);
    let replicas = trained(&job, &runs, &["--set", "parallel.replicas=2"]);
    let out = ok(trainer(
        &[
            "compare",
            plain.to_str().unwrap(),
            replicas.to_str().unwrap(),
            "--format",
            "csv",
        ],
        &[],
    ));
    let header = stdout(&out).lines().next().unwrap().to_string();
    assert!(header.contains("parallel.replicas"), "{header}");
    assert!(
        !header.contains("parallel.timeout") && !header.contains("parallel.bucket_mb"),
        "{header}"
    );
}

/// A run whose metrics.csv is gone or emptied lost its rows: plot says that, not that the
/// run ended before its first row.
#[test]
fn plot_names_a_lost_or_emptied_metrics_file() {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), TINY_JOB);
    let runs = tmp.path().join("runs");
    let run = trained(&job, &runs, &[]);
    let metrics = run.join("metrics.csv");
    let png = tmp.path().join("p.png");
    let plot = || {
        trainer(
            &["plot", run.to_str().unwrap(), "-o", png.to_str().unwrap()],
            &[],
        )
    };
    std::fs::remove_file(&metrics).unwrap();
    let out = plot();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains(&format!("{} is missing", metrics.display())),
        "{}",
        stderr(&out)
    );
    std::fs::write(&metrics, "").unwrap();
    let out = plot();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains(&format!("{} is empty", metrics.display())),
        "{}",
        stderr(&out)
    );
}

/// A point too large for this machine is refused (exit 1, as `trainer run` refuses it) before
/// the first point trains, not when its turn comes.
#[test]
fn a_sweep_point_larger_than_the_machine_is_refused_before_anything_trains() {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), &hidden_layer_job());
    let runs = tmp.path().join("runs");
    // 2·10^8 hidden units: 1.28·10^10 weights in the first layer alone, 51 GB.
    let out = trainer(
        &[
            "sweep",
            job.to_str().unwrap(),
            "--grid",
            "model.layers[1].out=16,200000000",
            "--runs-dir",
            runs.to_str().unwrap(),
        ],
        &[],
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("sweep point 001 (model.layers[1].out=200000000): not enough memory"),
        "{err}"
    );
    assert!(!runs.exists(), "nothing was trained or made");
}

/// Running a finished sweep again reads nothing of its points' data: here the data file is
/// gone, and every point is still skipped as completed. A point still to train does read it.
#[test]
fn a_finished_sweep_run_again_does_not_load_its_data() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("digits.csv.gz");
    std::fs::copy(root().join("jobs/data/digits.csv.gz"), &data).unwrap();
    let csv_job = TINY_JOB.replace(
        "source = \"digits\"",
        &format!("source = \"csv\"\npath = \"{}\"", data.display()),
    );
    let job = write_job(tmp.path(), &csv_job);
    let runs = tmp.path().join("runs");
    let (job, runs_s) = (job.to_str().unwrap(), runs.to_str().unwrap());
    let grid = |seeds: &'static str| {
        vec![
            "sweep",
            job,
            "--grid",
            seeds,
            "--runs-dir",
            runs_s,
            "--sweep-id",
            "s",
        ]
    };
    ok(trainer(&grid("job.seed=1,2"), &[]));
    std::fs::remove_file(&data).unwrap();
    let again = ok(trainer(&grid("job.seed=1,2"), &[]));
    assert_eq!(
        stderr(&again).matches("completed before, skipped").count(),
        2,
        "{}",
        stderr(&again)
    );
    // A point to train is still checked up front, with the data key named.
    let sweep_csv = runs.join("tiny/s/sweep.csv");
    std::fs::remove_dir_all(runs.join("tiny/s")).unwrap();
    let out = trainer(&grid("job.seed=1,2"), &[]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("sweep point 000 (job.seed=1)"));
    assert!(stderr(&out).contains("cannot read data file"));
    assert!(!sweep_csv.exists());
}

/// The same sweep started twice at once: a point the other copy started after this one
/// planned it is left to that copy (this one stopped with "already exists", exit 2).
#[test]
fn a_point_another_copy_of_the_sweep_started_meanwhile_is_left_to_it() {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), &TINY_JOB.replace("epochs = 1", "epochs = 3000"));
    let runs = tmp.path().join("runs");
    let sweep = std::process::Command::new(common::trainer_bin())
        .args([
            "sweep",
            job.to_str().unwrap(),
            "--grid",
            "optimizer.lr=0.05,0.2",
            "-q",
        ])
        .args(["--runs-dir", runs.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // While point 0 trains, "another copy" takes point 1.
    let started = std::time::Instant::now();
    let first = loop {
        let found = std::fs::read_dir(runs.join("tiny"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|sweep_dir| sweep_dir.path().join("000-lr=0.05"))
            .find(|p| p.exists());
        if let Some(point) = found {
            break point;
        }
        assert!(started.elapsed().as_secs() < 30, "point 0 never started");
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    std::fs::create_dir(first.with_file_name("001-lr=0.2")).unwrap();
    let out = sweep.wait_with_output().unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("another process started it")
            && err.contains("1 of 2 sweep points are being trained by another process"),
        "{err}"
    );
    assert_eq!(summary(&first)["status"], "completed");
}

/// A run whose process is gone reads as killed even when its pid has been reused since (a
/// restarted machine): no process holds the run's lock.
#[test]
fn a_run_whose_pid_lives_on_in_another_process_is_still_killed() {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), TINY_JOB);
    let runs = tmp.path().join("runs");
    let dir = trained(&job, &runs, &[]);
    std::fs::remove_file(dir.join("summary.json")).unwrap();
    // provenance.json now names a live process: this test's.
    let path = dir.join("provenance.json");
    let mut provenance: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    provenance["pid"] = std::process::id().into();
    std::fs::write(&path, provenance.to_string()).unwrap();
    let out = ok(trainer(
        &["ls", runs.to_str().unwrap(), "--format", "csv"],
        &[],
    ));
    let mut reader = csv::Reader::from_reader(out.stdout.as_slice());
    let header = reader.headers().unwrap().clone();
    let status = header.iter().position(|h| h == "status").unwrap();
    let rows: Vec<csv::StringRecord> = reader.records().map(Result::unwrap).collect();
    assert_eq!(rows.len(), 1);
    assert_eq!(&rows[0][status], "killed");
}

#[test]
fn bad_training_controls_name_the_key_and_what_is_allowed() {
    let run = ["run", "JOB", "--runs-dir", "RUNS"];
    expect_error(
        &TINY_JOB.replace("epochs = 1", "epochs = 1\nmax_time = \"2 hours\""),
        &run,
        2,
        &[
            "train.max_time",
            "\"2 hours\" given",
            "\"90s\", \"30m\", \"2h\"",
        ],
    );
    expect_error(
        &TINY_JOB.replace("val_fraction = 0.2\n", "").replace(
            "epochs = 1",
            "epochs = 1\nearly_stopping = { metric = \"val_loss\" }",
        ),
        &run,
        2,
        &[
            "train.early_stopping.metric",
            "\"val_loss\" given",
            "no evaluation split",
        ],
    );
    expect_error(
        &TINY_JOB.replace(
            "epochs = 1",
            "epochs = 1\nearly_stopping = { metric = \"test_accuracy\" }",
        ),
        &run,
        2,
        &[
            "\"test_accuracy\" given, which this job never produces",
            "allowed for this job: val_loss, val_accuracy",
        ],
    );
    expect_error(
        &TINY_JOB.replace(
            "epochs = 1",
            "epochs = 1\nearly_stopping = { metric = \"val_loss\", patience = 0 }",
        ),
        &run,
        2,
        &["train.early_stopping.patience", "0 given"],
    );
}

#[test]
fn bad_results_arguments_are_usage_errors() {
    expect_error(TINY_JOB, &["compare", "RUNS"], 2, &["no such directory"]);
    expect_error(TINY_JOB, &["ls", "RUNS"], 2, &["no such directory"]);
    expect_error(TINY_JOB, &["compare"], 2, &["RUN_OR_SWEEP"]);
    expect_error(
        TINY_JOB,
        &["ls", "--format", "xml"],
        2,
        &["csv", "json", "markdown"],
    );
    // A real run to plot, then bad plot arguments.
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), TINY_JOB);
    let runs = tmp.path().join("runs");
    let dir = trained(&job, &runs, &[]).display().to_string();
    let jpg = tmp.path().join("x.jpg");
    let bad = trainer(&["plot", &dir, "-o", jpg.to_str().unwrap()], &[]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(stderr(&bad).contains(".png or .svg"), "{}", stderr(&bad));
    let png = tmp.path().join("x.png");
    let bad = trainer(
        &[
            "plot",
            &dir,
            "--metric",
            "perplexity",
            "-o",
            png.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        stderr(&bad).contains("--metric perplexity: no run has it; allowed: accuracy"),
        "{}",
        stderr(&bad)
    );
    assert!(!png.exists());
    let nowhere = tmp.path().join("no/such/dir/x.png");
    let bad = trainer(&["plot", &dir, "-o", nowhere.to_str().unwrap()], &[]);
    assert_eq!(bad.status.code(), Some(2));
    let err = stderr(&bad);
    assert!(err.contains("no/such/dir does not exist"), "{err}");
    let job_file = job.to_str().unwrap();
    let bad = trainer(&["ls", job_file], &[]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(stderr(&bad).contains("job.toml: not a directory"));
}

#[test]
fn a_damaged_run_is_skipped_in_a_listing_and_refused_when_named() {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), TINY_JOB);
    let runs = tmp.path().join("runs");
    let run = || {
        let args = ["run", job.to_str().unwrap(), "--runs-dir"];
        let out = ok(trainer(
            &[&args[..], &[runs.to_str().unwrap(), "-q"]].concat(),
            &[],
        ));
        stdout(&out).trim().to_string()
    };
    let (good, damaged) = (run(), run());
    std::fs::write(Path::new(&damaged).join("config.toml"), "[job\nname = ").unwrap();

    let listed = ok(trainer(
        &["ls", runs.to_str().unwrap(), "--format", "csv"],
        &[],
    ));
    let table = stdout(&listed);
    let name = |dir: &str| {
        Path::new(dir)
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .to_string()
    };
    assert!(table.contains(&name(&good)), "{table}");
    assert!(!table.contains(&name(&damaged)), "{table}");
    let warning = stderr(&listed);
    assert!(
        warning.contains("skipping a run") && warning.contains(&damaged),
        "{warning}"
    );

    let named = trainer(&["compare", &good, &damaged], &[]);
    assert_eq!(named.status.code(), Some(2), "{}", stderr(&named));
    // Where in the file, as for a job file.
    assert!(
        stderr(&named).contains("config.toml:1:"),
        "{}",
        stderr(&named)
    );

    // A damaged summary.json or metrics.csv still lists the run, with a warning naming it.
    let (no_summary, no_metrics) = (run(), run());
    let summary = Path::new(&no_summary).join("summary.json");
    std::fs::write(&summary, "{\"status\": \"compl").unwrap();
    let metrics = Path::new(&no_metrics).join("metrics.csv");
    std::fs::write(&metrics, "garbage\n1,2,3\n").unwrap();
    let listed = ok(trainer(&["ls", runs.to_str().unwrap()], &[]));
    let warning = stderr(&listed);
    let says = format!("{}: not JSON", summary.display());
    assert!(warning.contains(&says), "{warning}");
    let says = format!(
        "{}: its header has no step, epoch and split",
        metrics.display()
    );
    assert!(warning.contains(&says), "{warning}");
    assert!(stdout(&listed).contains(&name(&no_summary)));
    assert!(stdout(&listed).contains(&name(&no_metrics)));

    // Valid files with nothing in them: an emptied config.toml is a damaged run (its blanks
    // read as differences from every other run), a summary without a status is none.
    let (emptied, statusless) = (run(), run());
    std::fs::write(Path::new(&emptied).join("config.toml"), "").unwrap();
    let summary = Path::new(&statusless).join("summary.json");
    std::fs::write(&summary, "[]").unwrap();
    let listed = ok(trainer(&["ls", runs.to_str().unwrap()], &[]));
    let warning = stderr(&listed);
    assert!(!stdout(&listed).contains(&name(&emptied)));
    let says = "config.toml: incomplete, without `data.source`";
    assert!(warning.contains(says), "{warning}");
    let says = format!("{}: no \"status\" string in it", summary.display());
    assert!(warning.contains(&says), "{warning}");
    let named = trainer(&["compare", &emptied], &[]);
    assert_eq!(named.status.code(), Some(2), "{}", stderr(&named));

    // A damaged line inside metrics.csv is named, and the rows after it still count.
    let damaged_line = run();
    let metrics = Path::new(&damaged_line).join("metrics.csv");
    let text = std::fs::read_to_string(&metrics).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    lines.insert(3, "junk");
    std::fs::write(&metrics, lines.join("\n") + "\n").unwrap();
    let listed = ok(trainer(&["ls", &damaged_line], &[]));
    let warning = stderr(&listed);
    let says = format!("{}: line(s) 4 are not metrics rows", metrics.display());
    assert!(warning.contains(&says), "{warning}");
    assert!(!warning.contains("do not hold"), "{warning}");
}

/// A run whose every evaluation is NaN has no best value: NaN in CSV and the table, null in
/// JSON (it was the search's starting value, inf, in the text formats).
#[test]
fn a_best_value_is_over_finite_values_only() {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), &hidden_layer_job());
    let runs = tmp.path().join("runs");
    let (job, runs_s) = (job.to_str().unwrap(), runs.to_str().unwrap());
    let nan = [
        "--set",
        "optimizer.lr=1e30",
        "--set",
        "train.on_nonfinite=\"skip\"",
    ];
    ok(trainer(
        &[&["run", job, "--runs-dir", runs_s, "-q"][..], &nan].concat(),
        &[],
    ));
    let csv = stdout(&ok(trainer(&["ls", runs_s, "--format", "csv"], &[])));
    let mut reader = csv::Reader::from_reader(csv.as_bytes());
    let header: Vec<String> = reader.headers().unwrap().iter().map(String::from).collect();
    let row: Vec<String> = reader
        .records()
        .next()
        .unwrap()
        .unwrap()
        .iter()
        .map(String::from)
        .collect();
    assert_eq!(column(&header, &row, "val_loss"), "NaN", "{csv}");
    assert_eq!(column(&header, &row, "best_val_loss"), "NaN", "{csv}");
    let json = stdout(&ok(trainer(&["ls", runs_s, "--format", "json"], &[])));
    let json: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert!(json[0]["best_val_loss"].is_null(), "{json}");
    let table = stdout(&ok(trainer(&["ls", runs_s], &[])));
    assert!(!table.contains("inf"), "{table}");
}

/// A completed run's final metrics are its summary.json's, whatever happened to its
/// metrics.csv since, and ls/compare say when that file is missing or lost rows; numbers
/// read from summary.json are the values written, to the last bit.
#[test]
fn final_metrics_come_from_the_summary_and_a_damaged_metrics_file_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), &TINY_JOB.replace("epochs = 1", "epochs = 3"));
    let runs = tmp.path().join("runs");
    let run = |name: &str| {
        let args = ["run", job.to_str().unwrap(), "--name", name, "--runs-dir"];
        let out = ok(trainer(
            &[&args[..], &[runs.to_str().unwrap(), "-q"]].concat(),
            &[],
        ));
        PathBuf::from(stdout(&out).trim())
    };
    let (intact, cut, gone) = (run("intact"), run("cut"), run("gone"));
    // The last row of each split, as written.
    let last_rows = |dir: &Path| {
        let (header, rows) = read_csv(&dir.join("metrics.csv"));
        let last = |split: &str| {
            let row = rows
                .iter()
                .rev()
                .find(|r| column(&header, r, "split") == split)
                .unwrap();
            column(&header, row, "loss").parse::<f64>().unwrap()
        };
        (last("train"), last("val"))
    };
    let expected: Vec<(f64, f64)> = [&intact, &cut, &gone].map(|d| last_rows(d)).to_vec();
    // summary.json's wall_s as written (serde_json, in these tests, may read it 1 ulp off).
    let wall = |dir: &Path| {
        let text = std::fs::read_to_string(dir.join("summary.json")).unwrap();
        let at = text.find("\"wall_s\": ").unwrap() + "\"wall_s\": ".len();
        let end = at + text[at..].find([',', '\n']).unwrap();
        text[at..end].parse::<f64>().unwrap()
    };
    let walls: Vec<f64> = [&intact, &cut, &gone].map(|d| wall(d)).to_vec();

    // Cut: the last rows gone (the final evaluation with them) and half a row left.
    let metrics = std::fs::read_to_string(cut.join("metrics.csv")).unwrap();
    let lines: Vec<&str> = metrics.lines().collect();
    let kept = lines[..lines.len() - 4].join("\n") + "\n" + &lines[lines.len() - 4][..12];
    std::fs::write(cut.join("metrics.csv"), kept).unwrap();
    std::fs::remove_file(gone.join("metrics.csv")).unwrap();

    let out = ok(trainer(
        &["compare", runs.to_str().unwrap(), "--format", "csv"],
        &[],
    ));
    let warnings = stderr(&out);
    let (header, rows) = {
        let text = stdout(&out);
        let mut reader = csv::Reader::from_reader(text.as_bytes());
        let header: Vec<String> = reader.headers().unwrap().iter().map(String::from).collect();
        let rows: Vec<Vec<String>> = reader
            .records()
            .map(|r| r.unwrap().iter().map(String::from).collect())
            .collect();
        (header, rows)
    };
    assert_eq!(rows.len(), 3);
    for (i, name) in ["cut", "gone", "intact"].iter().enumerate() {
        let row = &rows[i];
        assert!(column(&header, row, "run").starts_with(name), "{rows:?}");
        let at = ["intact", "cut", "gone"]
            .iter()
            .position(|n| n == name)
            .unwrap();
        let value = |c: &str| column(&header, row, c).parse::<f64>().unwrap();
        assert_eq!(value("train_loss"), expected[at].0, "{name}");
        assert_eq!(value("val_loss"), expected[at].1, "{name}");
        assert!(value("best_val_loss") <= value("val_loss"), "{name}");
        assert_eq!(value("wall_s"), walls[at], "{name}");
    }
    let says = |dir: &Path, what: &str| {
        let path = dir.join("metrics.csv").display().to_string();
        warnings
            .lines()
            .any(|l| l.contains(&path) && l.contains(what))
    };
    assert!(
        says(&cut, "last rows do not hold the run's final"),
        "{warnings}"
    );
    assert!(
        says(&gone, "no metrics rows in a completed run"),
        "{warnings}"
    );
    assert!(
        !warnings.contains(&intact.display().to_string()),
        "{warnings}"
    );
}

/// sweep.csv's columns are the same from its first writing: here no point writes a row
/// (both diverge at their first log row), and the metric columns are there all the same.
/// Swept values are written as compare writes config values. A plot of runs that ended
/// without rows does not say "yet".
#[test]
fn sweep_csv_has_its_columns_before_any_point_has_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), &hidden_layer_job());
    let runs = tmp.path().join("runs");
    let (job, runs_s) = (job.to_str().unwrap(), runs.to_str().unwrap());
    let out = trainer(
        &[
            "sweep",
            job,
            "--grid",
            "optimizer.lr=1e30,1e31",
            "--runs-dir",
            runs_s,
            "-q",
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let sweep_dir = std::fs::read_dir(runs.join("tiny"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let (header, rows) = read_csv(&sweep_dir.join("sweep.csv"));
    let expected = [
        "point",
        "optimizer.lr",
        "status",
        "end_reason",
        "run_dir",
        "wall_s",
        "train_loss",
        "train_accuracy",
        "val_loss",
        "best_val_loss",
        "val_accuracy",
        "best_val_accuracy",
    ];
    assert_eq!(header, expected);
    assert_eq!(column(&header, &rows[0], "status"), "failed");
    assert_eq!(column(&header, &rows[0], "optimizer.lr"), "1e30");
    assert_eq!(column(&header, &rows[0], "val_loss"), "");

    let png = tmp.path().join("none.png");
    let sweep_s = sweep_dir.to_str().unwrap();
    let out = trainer(&["plot", sweep_s, "-o", png.to_str().unwrap()], &[]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("no metrics rows") && !err.contains("yet"),
        "{err}"
    );
    for empty in ["", "loss,,accuracy"] {
        let out = trainer(&["plot", sweep_s, "--metric", empty, "-o", "x.png"], &[]);
        assert_eq!(out.status.code(), Some(2));
        assert!(
            stderr(&out).contains("of the list is empty"),
            "{}",
            stderr(&out)
        );
    }
}

/// Config values in CSV and JSON are plain values (a string without TOML's quotes), and a
/// newline in one (a layer's name) stays inside its cell in the table and Markdown.
#[test]
fn config_strings_are_plain_values_and_a_newline_stays_in_its_cell() {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), TINY_JOB);
    let runs = tmp.path().join("runs");
    let (job, runs_s) = (job.to_str().unwrap(), runs.to_str().unwrap());
    for name in ["\"h\\nx\"", "\"y|z\""] {
        let set = format!("model.layers[1].name={name}");
        ok(trainer(
            &["run", job, "--set", &set, "--runs-dir", runs_s, "-q"],
            &[],
        ));
    }
    let key = "model.layers[1].name";
    let csv = stdout(&ok(trainer(&["ls", runs_s, "--format", "csv"], &[])));
    let mut reader = csv::Reader::from_reader(csv.as_bytes());
    let header: Vec<String> = reader.headers().unwrap().iter().map(String::from).collect();
    let mut names: Vec<String> = reader
        .records()
        .map(|r| {
            column(
                &header,
                &r.unwrap().iter().map(String::from).collect::<Vec<_>>(),
                key,
            )
            .to_string()
        })
        .collect();
    names.sort();
    assert_eq!(names, ["h\nx", "y|z"]);
    let json = stdout(&ok(trainer(&["ls", runs_s, "--format", "json"], &[])));
    let json: serde_json::Value = serde_json::from_str(&json).unwrap();
    let names: Vec<&serde_json::Value> = json.as_array().unwrap().iter().map(|r| &r[key]).collect();
    assert!(names.contains(&&serde_json::Value::from("h\nx")), "{json}");
    for format in ["table", "markdown"] {
        let text = stdout(&ok(trainer(&["ls", runs_s, "--format", format], &[])));
        let lines: Vec<&str> = text.lines().collect();
        let header_lines = if format == "markdown" { 2 } else { 1 };
        assert_eq!(lines.len(), header_lines + 2, "{text}");
        // (Markdown escapes the backslash too.)
        let escaped = if format == "markdown" {
            "h\\\\nx"
        } else {
            "h\\nx"
        };
        assert!(text.contains(escaped), "{text}");
    }
}

/// The legend tells every run apart: keys that share a last part are named in full
/// (`job.name`, `layers[1].name`), nothing is cut off, and with many runs it stays inside
/// the image.
#[test]
fn plot_legends_tell_runs_apart_and_fit() {
    let tmp = tempfile::tempdir().unwrap();
    let named = TINY_JOB.replace(
        "{ type = \"linear\", out = 10 }",
        "{ type = \"linear\", out = 10, name = \"out\" }",
    );
    let job = write_job(tmp.path(), &named);
    let runs = tmp.path().join("runs");
    let (job, runs_s) = (job.to_str().unwrap(), runs.to_str().unwrap());
    let long = "\"a_layer_name_long_enough_to_have_been_cut_off\"";
    let grid = format!("model.layers[1].name=\"out\",{long}");
    let args = [
        "sweep",
        job,
        "--grid",
        "optimizer.lr=0.01,0.02,0.03,0.04",
        "--grid",
        &grid,
    ];
    let out = trainer(&[&args[..], &["--runs-dir", runs_s, "-q"]].concat(), &[]);
    ok(out);
    let set = [
        "--set",
        "job.name=\"other\"",
        "--set",
        "model.layers[1].name=\"o\"",
    ];
    ok(trainer(
        &[&["run", job, "--runs-dir", runs_s, "-q"][..], &set].concat(),
        &[],
    ));
    let svg = tmp.path().join("legend.svg");
    ok(trainer(&["plot", runs_s, "-o", svg.to_str().unwrap()], &[]));
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.contains("job.name=other"), "job.name in full");
    assert!(
        text.contains("layers[1].name=o "),
        "the layer's name in full, unquoted"
    );
    assert!(text.contains("a_layer_name_long_enough_to_have_been_cut_off"));
    assert!(!text.contains('…'));
    // Each run named once: the figure has one legend, its names all different (a long one
    // wraps, with lr on its last line).
    let legend: Vec<&str> = text.lines().filter(|l| l.contains("lr=")).collect();
    assert_eq!(legend.len(), 9, "{legend:?}");
    let mut unique = legend.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), 9, "{legend:?}");
    // Every line of the legend inside the image (a text's y is its top).
    let number = |tag: &str, attribute: &str| -> f64 {
        let at = tag.find(&format!(" {attribute}=\"")).unwrap() + attribute.len() + 3;
        tag[at..at + tag[at..].find('"').unwrap()].parse().unwrap()
    };
    let svg_tag = text.lines().find(|l| l.starts_with("<svg")).unwrap();
    let (width, height) = (number(svg_tag, "width"), number(svg_tag, "height"));
    let lines: Vec<&str> = text.lines().collect();
    let mut checked = 0;
    for pair in lines.windows(2) {
        if pair[0].starts_with("<text") && (pair[1].contains('=') || pair[1] == "val") {
            let (x, y) = (number(pair[0], "x"), number(pair[0], "y"));
            assert!(x < width && y + 20.0 < height, "{pair:?}");
            checked += 1;
        }
    }
    assert!(checked >= 10, "{checked}");
}

/// The last row of `split` in a run's metrics.csv: (loss, accuracy) as written.
fn last_row(run: &Path, split: &str) -> (String, String) {
    let (header, rows) = read_csv(&run.join("metrics.csv"));
    let row = rows
        .iter()
        .rev()
        .find(|r| column(&header, r, "split") == split)
        .unwrap();
    let cell = |name: &str| column(&header, row, name).to_string();
    (cell("loss"), cell("accuracy"))
}

/// `trainer eval -o FILE`'s rows: (metric, class) -> value.
fn eval_csv(path: &Path) -> std::collections::BTreeMap<(String, String), String> {
    let (header, rows) = read_csv(path);
    assert_eq!(header, ["split", "metric", "class", "value"]);
    rows.into_iter()
        .map(|r| ((r[1].clone(), r[2].clone()), r[3].clone()))
        .collect()
}

/// `trainer predict RUN INPUT -o OUTPUT --keep-columns KEEP`, which must succeed.
fn predicted(run: &Path, input: &Path, output: &Path, keep: &str) {
    let (run, input, output) = (
        run.to_str().unwrap(),
        input.to_str().unwrap(),
        output.to_str().unwrap(),
    );
    ok(trainer(
        &["predict", run, input, "-o", output, "--keep-columns", keep],
        &[],
    ));
}

/// A CSV classification job with an id column, a held-out test file and 3 classes; the
/// second feature's scale is far from the others', so normalisation matters.
fn csv_job(dir: &Path) -> PathBuf {
    let row = |i: usize| {
        let (a, b, c) = (
            (i * 7 % 13) as f64 / 13.0,
            (i * 5 % 11) as f64,
            (i % 3) as f64,
        );
        let label = ((a * 3.0) as usize + (b > 5.0) as usize) % 3;
        format!("r{i},{a},{},{c},{label}\n", b * 100.0)
    };
    let header = "id,a,b,c,label\n";
    let train: String = (0..300).map(row).collect();
    let test: String = (300..360).map(row).collect();
    std::fs::write(dir.join("train.csv"), format!("{header}{train}")).unwrap();
    std::fs::write(dir.join("test.csv"), format!("{header}{test}")).unwrap();
    write_job(
        dir,
        r#"
[job]
name = "table"
[device]
type = "cpu"
[data]
source = "csv"
path = "train.csv"
test_path = "test.csv"
features = ["a", "b", "c"]
label = "label"
val_fraction = 0.2
batch_size = 32
[model]
layers = [{ type = "linear", out = 16 }, { type = "relu" }, { type = "linear", out = 3 }]
[optimizer]
type = "adam"
lr = 0.01
[train]
epochs = 5
[checkpoint]
every_epochs = 5
"#,
    )
}

/// `trainer eval` gives the run's own last evaluation bit for bit, of its final weights and
/// of its final checkpoint; its CSV has the per-class accuracies and its confusion matrix
/// counts every sample once. `--data` on the test file gives the test split's numbers: the
/// file is normalised with the run's saved statistics, not its own.
#[test]
fn eval_reproduces_the_run_s_own_evaluation() {
    let tmp = tempfile::tempdir().unwrap();
    let job = csv_job(tmp.path());
    let run = trained(&job, &tmp.path().join("runs"), &[]);
    let r = run.to_str().unwrap();
    for (split, extra) in [("val", vec![]), ("test", vec!["--split", "test"])] {
        let metrics = tmp.path().join(format!("{split}-metrics.csv"));
        let confusion = tmp.path().join(format!("{split}-confusion.csv"));
        let mut args = vec!["eval", r, "-o", metrics.to_str().unwrap()];
        args.extend(["--confusion", confusion.to_str().unwrap()]);
        args.extend(&extra);
        let out = ok(trainer(&args, &[]));
        assert!(
            stdout(&out).starts_with(&format!("{split} (")),
            "{}",
            stdout(&out)
        );
        let got = eval_csv(&metrics);
        let (loss, accuracy) = last_row(&run, split);
        let value = |metric: &str| got[&(metric.to_string(), String::new())].clone();
        assert_eq!(value("loss"), loss, "{split}");
        assert_eq!(value("accuracy"), accuracy, "{split}");
        let (_, rows) = read_csv(&confusion);
        let counted: u64 = rows
            .iter()
            .flat_map(|r| &r[1..])
            .map(|c| c.parse::<u64>().unwrap())
            .sum();
        assert_eq!(counted.to_string(), value("samples"));
        let diagonal: u64 = rows
            .iter()
            .enumerate()
            .map(|(k, r)| r[k + 1].parse::<u64>().unwrap())
            .sum();
        let samples: f64 = value("samples").parse().unwrap();
        assert_eq!(diagonal as f64 / samples, accuracy.parse::<f64>().unwrap());
        assert!(got.contains_key(&("class_accuracy".to_string(), "2".to_string())));
    }
    // With two replicas in threads, evaluation batches are a replica's rows: still exact.
    let replicas = trained(
        &job,
        &tmp.path().join("runs"),
        &["--set", "parallel.replicas=2"],
    );
    let metrics = tmp.path().join("replicas.csv");
    let args = [
        "eval",
        replicas.to_str().unwrap(),
        "-o",
        metrics.to_str().unwrap(),
    ];
    ok(trainer(&args, &[]));
    let (loss, _) = last_row(&replicas, "val");
    assert_eq!(
        eval_csv(&metrics)[&("loss".to_string(), String::new())],
        loss
    );
    // The final checkpoint holds the same weights.
    let checkpoint = run.join("checkpoints/step-00000040.safetensors");
    let out = ok(trainer(
        &["eval", r, "--checkpoint", checkpoint.to_str().unwrap()],
        &[],
    ));
    let (loss, _) = last_row(&run, "val");
    let printed: f64 = loss.parse().unwrap();
    assert!(
        stdout(&out).contains(&format!("loss       {printed:.6}")),
        "{}",
        stdout(&out)
    );
    // Another file of the same kind: the test file, read as data.
    let metrics = tmp.path().join("file.csv");
    let test = tmp.path().join("test.csv");
    let args = [
        "eval",
        r,
        "--data",
        test.to_str().unwrap(),
        "-o",
        metrics.to_str().unwrap(),
    ];
    ok(trainer(&args, &[]));
    let got = eval_csv(&metrics);
    let (loss, accuracy) = last_row(&run, "test");
    assert_eq!(got[&("loss".to_string(), String::new())], loss);
    assert_eq!(got[&("accuracy".to_string(), String::new())], accuracy);
    // preprocess.json holds what training applied, and model.safetensors carries it.
    let preprocess: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("preprocess.json")).unwrap())
            .unwrap();
    assert_eq!(
        preprocess["feature_columns"],
        serde_json::json!(["a", "b", "c"])
    );
    assert_eq!(preprocess["label_column"], "label");
    assert_eq!(preprocess["classes"], 3);
    assert_eq!(preprocess["normalize"], "standardize");
    let scale = preprocess["scale"].as_array().unwrap();
    assert_eq!(scale.len(), 3);
    assert!(
        scale[1].as_f64().unwrap() < 0.01,
        "b spans hundreds: {scale:?}"
    );
    let model = std::fs::read(run.join("model.safetensors")).unwrap();
    let header_len = u64::from_le_bytes(model[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8_lossy(&model[8..8 + header_len]);
    assert!(header.contains("trainer-preprocess-1"), "{header}");
}

/// `trainer predict` writes one row per input row: the kept columns, the predicted class and
/// probabilities that sum to 1. On the labelled test file its classes give the run's test
/// accuracy; the label column may be left out of the input.
#[test]
fn predict_writes_a_row_per_input_with_the_kept_columns() {
    let tmp = tempfile::tempdir().unwrap();
    let job = csv_job(tmp.path());
    let run = trained(&job, &tmp.path().join("runs"), &[]);
    let r = run.to_str().unwrap();
    let test = tmp.path().join("test.csv");
    let out_path = tmp.path().join("predictions.csv");
    predicted(&run, &test, &out_path, "id,label");
    let (header, rows) = read_csv(&out_path);
    assert_eq!(
        header,
        [
            "id",
            "label",
            "predicted_class",
            "prob_0",
            "prob_1",
            "prob_2"
        ]
    );
    assert_eq!(rows.len(), 60);
    assert_eq!(rows[0][0], "r300");
    let mut correct = 0;
    for row in &rows {
        let p: f64 = row[3..].iter().map(|v| v.parse::<f64>().unwrap()).sum();
        assert!((p - 1.0).abs() < 1e-9, "{row:?}");
        correct += usize::from(row[1] == row[2]);
    }
    let (_, accuracy) = last_row(&run, "test");
    assert_eq!(correct as f64 / 60.0, accuracy.parse::<f64>().unwrap());
    // Without the label column, and columns in another order: found by name.
    let shuffled: String = std::fs::read_to_string(&test)
        .unwrap()
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            format!("{},{},{},{}\n", f[3], f[0], f[2], f[1])
        })
        .collect();
    let input = tmp.path().join("inputs.csv");
    std::fs::write(&input, shuffled).unwrap();
    let again = tmp.path().join("again.csv");
    predicted(&run, &input, &again, "id");
    let (_, second) = read_csv(&again);
    for (a, b) in rows.iter().zip(&second) {
        assert_eq!((&a[0], &a[2..]), (&b[0], &b[1..]));
    }
    // A missing feature column is named, with the file's columns.
    std::fs::write(&input, "id,a,c\nx,1,2\n").unwrap();
    let args = [
        "predict",
        r,
        input.to_str().unwrap(),
        "-o",
        again.to_str().unwrap(),
    ];
    let out = trainer(&args, &[]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("no column `b`; its columns: id, a, c"),
        "{}",
        stderr(&out)
    );
}

/// A regression run is evaluated with MSE (its loss), MAE, RMSE and R².
#[test]
fn eval_of_a_regression_run_reports_its_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(
        tmp.path(),
        r#"
[device]
type = "cpu"
[data]
source = "synthetic"
task = "regression"
samples = 500
num_features = 4
val_fraction = 0.2
[model]
layers = [{ type = "linear", out = 1 }]
[loss]
type = "mse"
[optimizer]
type = "sgd"
lr = 0.05
[train]
epochs = 5
"#,
    );
    let run = trained(&job, &tmp.path().join("runs"), &[]);
    let metrics = tmp.path().join("m.csv");
    ok(trainer(
        &[
            "eval",
            run.to_str().unwrap(),
            "-o",
            metrics.to_str().unwrap(),
        ],
        &[],
    ));
    let got = eval_csv(&metrics);
    let value = |m: &str| -> f64 { got[&(m.to_string(), String::new())].parse().unwrap() };
    let (loss, _) = last_row(&run, "val");
    assert_eq!(value("loss"), loss.parse::<f64>().unwrap());
    assert!(
        (value("mse") - value("loss")).abs() < 1e-6 * value("loss"),
        "{got:?}"
    );
    assert!((value("rmse") - value("mse").sqrt()).abs() < 1e-12);
    assert!(
        value("mae") > 0.0 && value("r2") > 0.5 && value("r2") <= 1.0,
        "{got:?}"
    );
    assert!(!got.contains_key(&("accuracy".to_string(), String::new())));
}

/// Bad eval and predict arguments get an exit 2 naming what is wrong.
#[test]
fn bad_eval_and_predict_arguments_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), TINY_JOB);
    let run = trained(&job, &tmp.path().join("runs"), &[]);
    let r = run.to_str().unwrap();
    let cases: [(&[&str], &str); 4] = [
        (&["eval", "no/such/run"], "no/such/run: not a run directory"),
        (
            &["eval", r, "--split", "nope"],
            "--split nope: the run's data has the splits train, val",
        ),
        (
            &["eval", r, "--data", "x.csv"],
            "the run's data.source is \"digits\"",
        ),
        (
            &["predict", r, "no/such.csv", "-o", "p.csv"],
            "cannot read data file no/such.csv",
        ),
    ];
    for (args, needle) in cases {
        let out = trainer(args, &[]);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(needle), "{args:?}: {}", stderr(&out));
    }
}

/// Text labels are classes, sorted by name; `data.exclude` leaves a column out of the
/// features. eval and predict name the classes, and a label the training data did not have
/// is refused by name.
#[test]
fn text_labels_are_classes_that_eval_and_predict_name() {
    let tmp = tempfile::tempdir().unwrap();
    let job = csv_job(tmp.path());
    let names = ["setosa", "versicolor", "virginica"];
    for file in ["train.csv", "test.csv"] {
        let path = tmp.path().join(file);
        let text: String = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .enumerate()
            .map(|(i, l)| match (i, l.rsplit_once(',')) {
                (0, _) | (_, None) => format!("{l}\n"),
                (_, Some((rest, label))) => {
                    format!("{rest},{}\n", names[label.parse::<usize>().unwrap()])
                }
            })
            .collect();
        std::fs::write(&path, text).unwrap();
    }
    let text = std::fs::read_to_string(&job)
        .unwrap()
        .replace("features = [\"a\", \"b\", \"c\"]", "exclude = [\"id\"]");
    std::fs::write(&job, text).unwrap();
    let run = trained(&job, &tmp.path().join("runs"), &[]);
    let r = run.to_str().unwrap();
    let preprocess = std::fs::read_to_string(run.join("preprocess.json")).unwrap();
    assert!(
        preprocess.contains("\"setosa\",\n    \"versicolor\""),
        "{preprocess}"
    );
    let confusion = tmp.path().join("confusion.csv");
    ok(trainer(
        &[
            "eval",
            r,
            "--split",
            "test",
            "--confusion",
            confusion.to_str().unwrap(),
        ],
        &[],
    ));
    let (header, rows) = read_csv(&confusion);
    assert_eq!(
        header[1..],
        [
            "predicted_setosa",
            "predicted_versicolor",
            "predicted_virginica"
        ]
    );
    assert_eq!(rows[2][0], "virginica");
    let test = tmp.path().join("test.csv");
    let predictions = tmp.path().join("p.csv");
    predicted(&run, &test, &predictions, "label");
    let (header, rows) = read_csv(&predictions);
    assert_eq!(header[..3], ["label", "predicted_class", "prob_setosa"]);
    let correct = rows.iter().filter(|r| r[0] == r[1]).count() as f64 / rows.len() as f64;
    let (_, accuracy) = last_row(&run, "test");
    assert_eq!(correct, accuracy.parse::<f64>().unwrap());
    std::fs::write(
        tmp.path().join("new.csv"),
        "id,a,b,c,label\nx,0.5,300,1,rose\n",
    )
    .unwrap();
    let new = tmp.path().join("new.csv");
    let out = trainer(&["eval", r, "--data", new.to_str().unwrap()], &[]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("label `rose` is not one of the training data's classes (setosa, versicolor, virginica)"), "{err}");
}

/// `ls` groups runs by job on a terminal's table (the differing keys within each job), and
/// keeps the runs a --filter names, in --sort's order, with --columns' columns.
#[test]
fn ls_groups_by_job_and_filters_sorts_and_picks_columns() {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), TINY_JOB);
    let runs = tmp.path().join("runs");
    for lr in ["0.05", "0.2"] {
        trained(&job, &runs, &["--set", &format!("optimizer.lr={lr}")]);
    }
    trained(&job, &runs, &["--name", "other", "--set", "train.epochs=2"]);
    let runs_s = runs.to_str().unwrap();
    let table = stdout(&ok(trainer(&["ls", runs_s], &[])));
    let other = table
        .find("other (1 run)\n")
        .unwrap_or_else(|| panic!("{table}"));
    let tiny = table
        .find("tiny (2 runs)\n")
        .unwrap_or_else(|| panic!("{table}"));
    let tiny_part = &table[tiny..if other > tiny { other } else { table.len() }];
    assert!(tiny_part.contains("optimizer.lr"), "{table}");
    assert!(
        !tiny_part.contains("train.epochs"),
        "only the job's own differences: {table}"
    );

    let csv = |extra: &[&str]| {
        let mut args = vec!["ls", runs_s, "--format", "csv"];
        args.extend_from_slice(extra);
        let out = ok(trainer(&args, &[]));
        let text = stdout(&out);
        let mut reader = csv::Reader::from_reader(text.as_bytes());
        let header: Vec<String> = reader.headers().unwrap().iter().map(String::from).collect();
        let rows: Vec<Vec<String>> = reader
            .records()
            .map(|r| r.unwrap().iter().map(String::from).collect())
            .collect();
        (header, rows)
    };
    let (_, rows) = csv(&[
        "--filter",
        "optimizer.lr=2e-1",
        "--filter",
        "status=completed",
    ]);
    assert_eq!(rows.len(), 1);
    let (header, rows) = csv(&[
        "--filter",
        "job=tiny",
        "--sort=-optimizer.lr",
        "--columns",
        "optimizer.lr,status",
    ]);
    assert_eq!(header, ["run", "optimizer.lr", "status"]);
    let lrs: Vec<&str> = rows.iter().map(|r| r[1].as_str()).collect();
    assert_eq!(lrs, ["0.2", "0.05"]);
    for (args, needle) in [
        (vec!["--filter", "lr=0.2"], "no run has `lr`"),
        (vec!["--filter", "lr"], "give KEY=VALUE"),
        (
            vec!["--sort", "lr"],
            "--sort lr: no column `lr`; columns: run, status",
        ),
        (vec!["--columns", "lr"], "--columns: no column `lr`"),
    ] {
        let out = trainer(&[&["ls", runs_s][..], &args].concat(), &[]);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(needle), "{args:?}: {}", stderr(&out));
    }
}

/// An IDX run: predict reads IDX images (a row per image), and eval of the training files
/// given as --data and --labels gives the training split's numbers.
#[test]
fn predict_and_eval_read_idx_files() {
    let tmp = tempfile::tempdir().unwrap();
    let n = 40u32;
    let mut images = vec![0, 0, 8, 3];
    for d in [n, 3, 3] {
        images.extend(d.to_be_bytes());
    }
    let mut labels = vec![0, 0, 8, 1];
    labels.extend(n.to_be_bytes());
    for i in 0..n {
        let class = (i % 2) as u8;
        images.extend((0..9).map(|p| {
            if class == 1 {
                200 - p * 10
            } else {
                p * 10 + (i % 5) as u8
            }
        }));
        labels.push(class);
    }
    std::fs::write(tmp.path().join("images.idx"), &images).unwrap();
    std::fs::write(tmp.path().join("labels.idx"), &labels).unwrap();
    let job = write_job(
        tmp.path(),
        r#"
[device]
type = "cpu"
[data]
source = "idx"
train_images = "images.idx"
train_labels = "labels.idx"
batch_size = 8
[model]
layers = [{ type = "flatten" }, { type = "linear", out = 2 }]
[optimizer]
type = "adam"
lr = 0.05
[train]
epochs = 3
"#,
    );
    let run = trained(&job, &tmp.path().join("runs"), &[]);
    let (images, labels) = (tmp.path().join("images.idx"), tmp.path().join("labels.idx"));
    let out = tmp.path().join("p.csv");
    let r = run.to_str().unwrap();
    let args = [
        "predict",
        r,
        images.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ];
    ok(trainer(&args, &[]));
    let (header, rows) = read_csv(&out);
    assert_eq!(header, ["predicted_class", "prob_0", "prob_1"]);
    assert_eq!(rows.len(), n as usize);
    let own = ok(trainer(&["eval", r, "--split", "train"], &[]));
    let file = ok(trainer(
        &[
            "eval",
            r,
            "--data",
            images.to_str().unwrap(),
            "--labels",
            labels.to_str().unwrap(),
        ],
        &[],
    ));
    let numbers = |o: &std::process::Output| {
        stdout(o)
            .lines()
            .skip(1)
            .map(String::from)
            .collect::<Vec<_>>()
    };
    assert_eq!(numbers(&own), numbers(&file));
}

/// `train.evaluate_test = "at_end"`: validation every epoch, the test split once after
/// training, also when early stopping ends the run; nothing may be chosen by it.
#[test]
fn the_test_split_can_wait_for_the_end() {
    let tmp = tempfile::tempdir().unwrap();
    let job = csv_job(tmp.path());
    let runs = tmp.path().join("runs");
    let splits_by_epoch = |run: &Path| {
        let (header, rows) = read_csv(&run.join("metrics.csv"));
        rows.iter()
            .filter(|r| column(&header, r, "split") != "train")
            .map(|r| {
                format!(
                    "{}{}",
                    column(&header, r, "split"),
                    column(&header, r, "epoch")
                )
            })
            .collect::<Vec<_>>()
            .join(" ")
    };
    let at_end = ["--set", "train.evaluate_test=\"at_end\""];
    let run = trained(&job, &runs, &at_end);
    assert_eq!(splits_by_epoch(&run), "val1 val2 val3 val4 val5 test5");
    assert!(summary(&run)["final"]["test_accuracy"].is_number());
    let run = trained(&job, &runs, &[]);
    assert_eq!(
        splits_by_epoch(&run),
        "val1 test1 val2 test2 val3 test3 val4 test4 val5 test5"
    );

    // Early stopping on a model that cannot learn stops after epoch 3; the test comes then.
    let mut stopping = at_end.to_vec();
    stopping.extend(["--set", "optimizer.lr=1e-9", "--set", "train.epochs=20"]);
    stopping.extend([
        "--set",
        "train.early_stopping={metric=\"val_loss\",patience=2,min_delta=0.01}",
    ]);
    let run = trained(&job, &runs, &stopping);
    assert_eq!(summary(&run)["end_reason"], "early_stopped");
    assert_eq!(splits_by_epoch(&run), "val1 val2 val3 test3");

    for (key, value) in [
        ("train.early_stopping", "{metric=\"test_loss\"}"),
        ("checkpoint.keep_best", "{metric=\"test_accuracy\"}"),
    ] {
        let set = format!("{key}={value}");
        let mut args = vec!["run", job.to_str().unwrap(), "--runs-dir"];
        args.extend([runs.to_str().unwrap(), "--set", &set]);
        args.extend(at_end);
        let out = trainer(&args, &[]);
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        assert!(
            stderr(&out).contains("evaluates the test split only after training"),
            "{}",
            stderr(&out)
        );
    }
}

/// preprocess.json and model.safetensors are all another tool needs: plain Python (and
/// docs/eval-and-predict.md's PyTorch snippet, where torch is installed) counts the same
/// correct rows of the test file as `trainer eval --data`.
#[test]
fn the_saved_preprocessing_reproduces_the_accuracy_elsewhere() {
    let tmp = tempfile::tempdir().unwrap();
    let job = csv_job(tmp.path());
    let run = trained(&job, &tmp.path().join("runs"), &[]);
    let test_file = tmp.path().join("test.csv");
    let metrics = tmp.path().join("metrics.csv");
    let args = [
        "eval",
        run.to_str().unwrap(),
        "--data",
        test_file.to_str().unwrap(),
    ];
    ok(trainer(
        &[&args[..], &["-o", metrics.to_str().unwrap()]].concat(),
        &[],
    ));
    let got = eval_csv(&metrics);
    let value = |metric: &str| {
        got[&(metric.to_string(), String::new())]
            .parse::<f64>()
            .unwrap()
    };
    let expected = format!(
        "{}/{}",
        (value("accuracy") * value("samples")).round(),
        value("samples")
    );
    let count_with = |python: &str, script: &Path| {
        let out = Command::new(python)
            .arg(script)
            .args([&run, &test_file])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    };
    let plain = root().join("tests/python/accuracy_without_trainer.py");
    assert_eq!(count_with("python3", &plain), expected);

    let Some(python) = torch_python() else {
        println!("PyTorch snippet skipped: no Python with torch and safetensors");
        return;
    };
    let docs = std::fs::read_to_string(root().join("docs/eval-and-predict.md")).unwrap();
    let snippet = docs
        .split("```python\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .unwrap();
    let script = tmp.path().join("snippet.py");
    std::fs::write(&script, snippet).unwrap();
    assert_eq!(count_with(&python, &script), expected);
}
