//! `trainer sweep --devices`: points side by side, each in its own process, end to end through
//! the binary: the same results as one point at a time, the CPU threads split among the
//! slots, a failing point that leaves the others alone, re-runs, and bad device lists.

use crate::common;

use common::{
    column, expect_error, ok, read_csv, stderr, stdout, summary, trainer_with_env as trainer,
    write_job, TINY_JOB,
};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// TINY_JOB on every core (no train.threads).
fn job_text() -> String {
    TINY_JOB
        .replace("threads = 1\n", "")
        .replace("epochs = 1", "epochs = 3")
}

fn sweep<'a>(job: &'a str, runs: &'a str, id: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "sweep",
        job,
        "--grid",
        "optimizer.lr=0.05,0.2",
        "--grid",
        "data.batch_size=32,64",
        "--runs-dir",
        runs,
        "--sweep-id",
        id,
    ];
    args.extend_from_slice(extra);
    args
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn modified(path: &Path) -> SystemTime {
    std::fs::metadata(path).unwrap().modified().unwrap()
}

#[test]
fn two_cpu_slots_give_the_same_results_as_one_point_at_a_time() {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), &job_text());
    let runs = tmp.path().join("runs");
    let (job, runs_s) = (job.to_str().unwrap(), runs.to_str().unwrap());

    let one_by_one = PathBuf::from(
        stdout(&ok(trainer(
            &sweep(job, runs_s, "one-by-one", &["-q"]),
            &[],
        )))
        .trim(),
    );
    let out = ok(trainer(
        &sweep(job, runs_s, "side-by-side", &["--devices", "cpu,cpu"]),
        &[],
    ));
    let side_by_side = PathBuf::from(stdout(&out).trim());
    assert_eq!(side_by_side, runs.join("tiny/side-by-side"));
    // The points' own log lines come through, labelled with point and device.
    let log = stderr(&out);
    assert!(
        log.contains("[000 cpu] ") && log.contains("[003 cpu] "),
        "{log}"
    );

    let (header, rows) = read_csv(&side_by_side.join("sweep.csv"));
    let (header_1, rows_1) = read_csv(&one_by_one.join("sweep.csv"));
    assert_eq!(header, header_1);
    assert_eq!(rows.len(), 4);
    for (row, row_1) in rows.iter().zip(&rows_1) {
        assert_eq!(column(&header, row, "status"), "completed");
        for (name, (value, value_1)) in header.iter().zip(row.iter().zip(row_1)) {
            if name != "wall_s" {
                assert_eq!(value, value_1, "{name} differs: {row:?} vs {row_1:?}");
            }
        }
    }
    assert!(header.contains(&"val_loss".to_string()), "{header:?}");

    // Each point ran in a process of its own, on the CPU, with its share of the cores.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let share = (cores / 2).max(1) as i64;
    let dirs: Vec<PathBuf> = rows
        .iter()
        .map(|r| side_by_side.join(column(&header, r, "run_dir")))
        .collect();
    let mut pids = Vec::new();
    for dir in &dirs {
        let config: toml::Table =
            toml::from_str(&std::fs::read_to_string(dir.join("config.toml")).unwrap()).unwrap();
        assert_eq!(config["device"]["type"].as_str(), Some("cpu"));
        assert_eq!(config["train"]["threads"].as_integer(), Some(share));
        let provenance = json(&dir.join("provenance.json"));
        let command = provenance["command_line"].as_str().unwrap();
        assert!(
            command.contains(" run ") && command.contains("--run-dir"),
            "{command}"
        );
        pids.push(provenance["pid"].as_u64().unwrap());
        assert_eq!(summary(dir)["status"], "completed");
    }
    pids.sort_unstable();
    pids.dedup();
    assert_eq!(pids.len(), 4, "one process per point");

    // Running it again trains nothing.
    let summaries: Vec<String> = dirs
        .iter()
        .map(|d| std::fs::read_to_string(d.join("summary.json")).unwrap())
        .collect();
    let again = ok(trainer(
        &sweep(job, runs_s, "side-by-side", &["--devices", "cpu,cpu"]),
        &[],
    ));
    assert_eq!(
        stderr(&again).matches("completed before, skipped").count(),
        4
    );
    for (dir, before) in dirs.iter().zip(&summaries) {
        assert_eq!(
            &std::fs::read_to_string(dir.join("summary.json")).unwrap(),
            before
        );
    }
}

#[test]
fn points_run_at_the_same_time() {
    let tmp = tempfile::tempdir().unwrap();
    // Points of 1.5 s each on any machine (max_time), so that running one after another
    // could not look like running together.
    let job = write_job(
        tmp.path(),
        &TINY_JOB.replace("epochs = 1", "epochs = 1000000\nmax_time = \"1.5s\""),
    );
    let runs = tmp.path().join("runs");
    let out = ok(trainer(
        &[
            "sweep",
            job.to_str().unwrap(),
            "--grid",
            "optimizer.lr=0.1,0.2",
            "--runs-dir",
            runs.to_str().unwrap(),
            "--devices",
            "cpu,cpu",
            "-q",
        ],
        &[],
    ));
    let dir = PathBuf::from(stdout(&out).trim());
    let point = |prefix: &str| {
        std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .find(|p| p.file_name().unwrap().to_string_lossy().starts_with(prefix))
            .unwrap()
    };
    let (first, second) = (point("000-"), point("001-"));
    assert_eq!(summary(&first)["end_reason"], "max_time");
    assert!(
        modified(&second.join("provenance.json")) < modified(&first.join("summary.json")),
        "the second point should start before the first one ends"
    );
}

#[test]
fn a_failing_point_leaves_the_others_running() {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), TINY_JOB);
    let runs = tmp.path().join("runs");
    // lr = 1e38 makes the loss NaN within a few steps.
    let out = trainer(
        &[
            "sweep",
            job.to_str().unwrap(),
            "--grid",
            "optimizer.lr=1e38,0.1,0.2",
            "--runs-dir",
            runs.to_str().unwrap(),
            "--sweep-id",
            "one-fails",
            "--devices",
            "cpu,cpu",
            "-q",
        ],
        &[],
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("1 of 3 sweep points failed"), "{err}");
    assert!(err.contains("[000 cpu] error: training diverged"), "{err}");
    assert!(
        err.contains("sweep point 000 (optimizer.lr=1e38) failed on cpu (exit 1)"),
        "{err}"
    );
    // A script has the sweep's directory however it ended.
    let dir = runs.join("tiny/one-fails");
    assert_eq!(stdout(&out).trim(), dir.to_str().unwrap());
    let (header, rows) = read_csv(&dir.join("sweep.csv"));
    let status: Vec<&str> = rows.iter().map(|r| column(&header, r, "status")).collect();
    assert_eq!(status, ["failed", "completed", "completed"]);
    assert_eq!(column(&header, &rows[0], "end_reason"), "diverged");
}

#[test]
fn bad_device_lists_are_usage_errors() {
    let sweep = |devices: &'static str| {
        vec![
            "sweep",
            "JOB",
            "--grid",
            "optimizer.lr=0.1,0.2",
            "--runs-dir",
            "RUNS",
            "--devices",
            devices,
        ]
    };
    let allowed = "allowed: auto, cpu, cuda, cuda:N";
    expect_error(
        TINY_JOB,
        &sweep("gpu"),
        2,
        &["--devices \"gpu\"", "\"gpu\" is not a device", allowed],
    );
    expect_error(
        TINY_JOB,
        &sweep("cpu,cuda:x"),
        2,
        &[
            "--devices \"cpu,cuda:x\"",
            "\"cuda:x\" is not a device",
            allowed,
        ],
    );
    expect_error(
        TINY_JOB,
        &sweep("cpu,,cpu"),
        2,
        &["--devices \"cpu,,cpu\"", "an empty device name", allowed],
    );
    expect_error(TINY_JOB, &sweep(""), 2, &["--devices \"\"", allowed]);
    // A GPU this machine lacks (no driver, or fewer GPUs) is named before anything runs.
    expect_error(
        TINY_JOB,
        &sweep("cpu,cuda:99"),
        2,
        &["--devices \"cpu,cuda:99\": cuda:99 requested, but"],
    );
    let mut both = sweep("cpu,cpu");
    both.extend(["--set", "device.type=\"cpu\""]);
    expect_error(
        TINY_JOB,
        &both,
        2,
        &["--devices sets device.type", "leave device.type out"],
    );
    // Each point is checked on each listed device before anything trains.
    expect_error(
        &TINY_JOB.replace(
            "[train]",
            "[parallel]\nreplicas = 2\nlaunch = \"threads\"\n[train]",
        ),
        &sweep("cpu,cuda:1"),
        2,
        &[
            "sweep point 000 (optimizer.lr=0.1) on cuda:1",
            "parallel.launch",
        ],
    );
}
