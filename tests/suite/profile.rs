//! Profiling: `trainer profile` and `trainer run --profile-steps` time every layer's forward
//! and backward, the loss, data, clipping and the update; the shares add up to the step, and
//! trace.json is a Chrome trace whose op events lie inside their steps.

use crate::common::{gpu_present, only_run_dir, read_csv, run_job, stderr, stdout, trainer};
use std::path::Path;

/// profile.csv's rows, as (part, pass, calls, share).
fn profile_rows(dir: &Path) -> Vec<(String, String, usize, f64)> {
    let (header, rows) = read_csv(&dir.join("profile.csv"));
    let at = |name: &str| header.iter().position(|h| h == name).unwrap();
    let (part, pass, calls, share) = (at("part"), at("pass"), at("calls"), at("share"));
    (rows.iter())
        .map(|r| {
            let calls = r[calls].parse().unwrap();
            (
                r[part].clone(),
                r[pass].clone(),
                calls,
                r[share].parse().unwrap(),
            )
        })
        .collect()
}

/// trace.json's complete events, as (name, category, start, duration) in microseconds.
fn trace_events(dir: &Path) -> Vec<(String, String, f64, f64)> {
    let text = std::fs::read_to_string(dir.join("trace.json")).unwrap();
    let trace: serde_json::Value = serde_json::from_str(&text).expect("trace.json is JSON");
    (trace["traceEvents"].as_array().unwrap().iter())
        .filter(|e| e["ph"] == "X")
        .map(|e| {
            let number = |k: &str| e[k].as_f64().unwrap();
            let text = |k: &str| e[k].as_str().unwrap().to_string();
            (text("name"), text("cat"), number("ts"), number("dur"))
        })
        .collect()
}

/// Each of `steps` steps is an event, and every other event lies inside one of them.
fn check_trace(dir: &Path, steps: &[u64]) {
    let events = trace_events(dir);
    let spans: Vec<(f64, f64)> = (events.iter())
        .filter(|e| e.1 == "step")
        .map(|e| (e.2, e.2 + e.3))
        .collect();
    let names: Vec<&str> = (events.iter())
        .filter(|e| e.1 == "step")
        .map(|e| e.0.as_str())
        .collect();
    let want: Vec<String> = steps.iter().map(|s| format!("step {s}")).collect();
    assert_eq!(names, want);
    for (name, cat, start, duration) in events.iter().filter(|e| e.1 != "step") {
        assert!(*duration >= 0.0, "{name}");
        assert!(
            (spans.iter()).any(|&(a, b)| *start >= a - 1.0 && start + duration <= b + 1.0),
            "{name} ({cat}) at {start} µs lies in no step: {spans:?}"
        );
    }
}

/// jobs/mlp.toml with two micro-batches a step: every layer's forward and backward twice a
/// step, the loss and data twice, the update once; shares that add up to the step.
#[test]
fn a_profile_times_every_layer_and_its_shares_add_up_to_the_step() {
    let tmp = tempfile::tempdir().unwrap();
    let runs = tmp.path().to_str().unwrap();
    let args = ["profile", "jobs/mlp.toml", "--steps", "4", "--warmup", "2"];
    let extra = [
        "--runs-dir",
        runs,
        "-q",
        "--set",
        "train.grad_accum_steps=2",
    ];
    let out = trainer(&[&args[..], &extra[..]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    let table = stdout(&out);
    for needle in [
        "ms/step",
        "linear",
        "backward",
        "step: ",
        "samples/s",
        "MFU",
    ] {
        assert!(table.contains(needle), "{needle}: {table}");
    }
    let dir = only_run_dir(&tmp.path().join("mlp"));
    assert_eq!(
        std::fs::read_to_string(dir.join("profile.txt")).unwrap(),
        table
    );
    let rows = profile_rows(&dir);
    let calls = |part: &str, pass: &str| {
        (rows.iter())
            .find(|r| r.0 == part && r.1 == pass)
            .unwrap_or_else(|| panic!("no {part} {pass} in {rows:?}"))
            .2
    };
    for layer in ["0", "1", "2", "3"] {
        assert_eq!(calls(layer, "forward"), 8, "{layer}");
        assert_eq!(calls(layer, "backward"), 8, "{layer}");
    }
    assert_eq!((calls("loss", "loss"), calls("data", "data")), (8, 8));
    assert_eq!(calls("optimizer", "update"), 4);
    let total: f64 = rows.iter().map(|r| r.3).sum();
    assert!((total - 1.0).abs() < 1e-9, "shares add up to {total}");
    assert!(rows.iter().all(|r| r.3 >= 0.0), "{rows:?}");
    check_trace(&dir, &[3, 4, 5, 6]);
}

/// `run --profile-steps A..B` profiles those steps of a real run, activation checkpointing's
/// recomputation included; a range that is not one is refused.
#[test]
fn a_run_profiles_the_steps_it_is_asked_to() {
    let tmp = tempfile::tempdir().unwrap();
    let sets = [
        "train.max_steps=4",
        "train.eval_steps=1",
        "checkpoint.activations=\"all\"",
        "device.type='cpu'",
    ];
    let mut args = vec!["--profile-steps", "2..3"];
    args.extend(sets.iter().flat_map(|s| ["--set", *s]));
    let dir = run_job(Path::new("jobs/gpt_char.toml"), tmp.path(), &args);
    let table = std::fs::read_to_string(dir.join("profile.txt")).unwrap();
    assert!(table.contains("tokens/s"), "{table}");
    let rows = profile_rows(&dir);
    let attention = |pass: &str| {
        (rows.iter())
            .filter(|r| r.0 == "h0_attn_c_attn" && r.1 == pass)
            .map(|r| r.2)
            .next()
    };
    assert_eq!(attention("forward"), Some(2));
    assert_eq!(attention("recompute"), Some(2));
    assert_eq!(attention("backward"), Some(2));
    check_trace(&dir, &[2, 3]);

    let out = trainer(&["run", "jobs/mlp.toml", "--profile-steps", "3..1"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("give A..B"), "{}", stderr(&out));
}

/// On CUDA each op is timed by events in the stream: the linear layers' forward and backward
/// take time (the emulated GPU stamps an event when its stream reaches it), and the shares
/// add up to the step.
#[test]
fn a_profile_on_cuda_times_every_layer() {
    if !gpu_present() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let runs = tmp.path().to_str().unwrap();
    let out = trainer(&[
        "profile",
        "jobs/mlp.toml",
        "--steps",
        "2",
        "--runs-dir",
        runs,
        "-q",
        "--set",
        "device.type='cuda'",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let dir = only_run_dir(&tmp.path().join("mlp"));
    let rows = profile_rows(&dir);
    for layer in ["1", "3"] {
        for pass in ["forward", "backward"] {
            let share = (rows.iter())
                .find(|r| r.0 == layer && r.1 == pass)
                .unwrap_or_else(|| panic!("no {layer} {pass} in {rows:?}"))
                .3;
            assert!(share > 0.0, "{layer} {pass} took no time: {rows:?}");
        }
    }
    let total: f64 = rows.iter().map(|r| r.3).sum();
    assert!((total - 1.0).abs() < 1e-9, "shares add up to {total}");
    check_trace(&dir, &[4, 5]);
    // The device's peak memory beside the plan, which the emulated GPU meets to the byte.
    let table = std::fs::read_to_string(dir.join("profile.txt")).unwrap();
    let line = (table.lines())
        .find(|l| l.starts_with("device memory: peak"))
        .unwrap_or_else(|| panic!("no device memory in {table}"));
    let gib: Vec<&str> = line
        .split_whitespace()
        .filter(|w| w.contains('.'))
        .collect();
    assert_eq!(gib.len(), 2, "{line}");
    assert_eq!(gib[0], gib[1], "peak and planned: {line}");
}
