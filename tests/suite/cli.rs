//! The command line end to end: a real run and its directory, overrides, `check`, `schema`,
//! and the bad-input table: every mistake exits 2 (or 1 at run time) with a message that
//! names the problem, never a panic, and never leaves a run that looks finished.

use crate::common;

use common::{stderr, stdout, trainer_with_env as trainer};

use common::root;
use std::path::{Path, PathBuf};
use std::process::Output;

fn finished_runs(runs: &Path) -> usize {
    let Ok(names) = std::fs::read_dir(runs) else {
        return 0;
    };
    names
        .flatten()
        .flat_map(|name| {
            std::fs::read_dir(name.path())
                .into_iter()
                .flatten()
                .flatten()
        })
        .filter(|run| {
            std::fs::read_to_string(run.path().join("summary.json"))
                .is_ok_and(|s| s.contains("\"completed\""))
        })
        .count()
}

#[test]
fn mlp_job_trains_and_writes_a_complete_run_directory() {
    let runs = tempfile::tempdir().unwrap();
    let out = trainer(
        &[
            "run",
            "jobs/mlp.toml",
            "--set",
            "train.epochs=3",
            // What is checked below is the CPU's (a GPU would fill the gpu_mem columns).
            "--set",
            "device.type=\"cpu\"",
            "--runs-dir",
            runs.path().to_str().unwrap(),
            "--quiet",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let dir = String::from_utf8(out.stdout).unwrap().trim().to_string();
    let dir = Path::new(&dir);
    assert!(
        dir.starts_with(runs.path().join("mlp")),
        "{}",
        dir.display()
    );

    let metrics = std::fs::read_to_string(dir.join("metrics.csv")).unwrap();
    let mut lines = metrics.lines();
    assert_eq!(
        lines.next().unwrap(),
        "step,epoch,split,loss,accuracy,lr,grad_norm,samples_per_sec,elapsed_s,gpu_mem_allocated,gpu_mem_peak,loss_scale,skipped_steps,global_batch,tokens_per_sec,flops_per_sec,mfu"
    );
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert!(
        rows.iter().any(|r| r[2] == "train") && rows.iter().filter(|r| r[2] == "val").count() == 3
    );
    for r in &rows {
        assert_eq!(r.len(), 17);
        assert!(
            r[9].is_empty() && r[10].is_empty() && r[16].is_empty(),
            "no GPU memory and no datasheet peak (MFU) on the CPU"
        );
        // jobs/mlp.toml: batch 64, one replica, no accumulation; 1,438 training samples
        // leave 30 for each epoch's last step (the run's last, 69, writes a row).
        let want = match (r[2], r[0]) {
            ("train", "69") => "30",
            ("train", _) => "64",
            _ => "",
        };
        assert_eq!(r[13], want, "{r:?}");
        let loss: f64 = r[3].parse().unwrap();
        assert!(loss.is_finite() && loss > 0.0);
    }
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["status"], "completed");
    assert_eq!(summary["epochs"], 3);
    assert!(summary["final"]["val_accuracy"].as_f64().unwrap() > 0.9);
    assert!(std::fs::read_to_string(dir.join("train.log"))
        .unwrap()
        .contains("val loss"));

    // The resolved config reproduces the run: it is itself a valid job with the override in.
    let config = std::fs::read_to_string(dir.join("config.toml")).unwrap();
    assert!(config.contains("epochs = 3"));
    let check = trainer(&["check", dir.join("config.toml").to_str().unwrap()], &[]);
    assert!(check.status.success(), "{}", stderr(&check));
}

#[test]
fn mlp_job_reaches_97_percent_on_the_digits() {
    let runs = tempfile::tempdir().unwrap();
    let out = trainer(
        &[
            "run",
            "jobs/mlp.toml",
            "--runs-dir",
            runs.path().to_str().unwrap(),
            "--quiet",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let dir = String::from_utf8(out.stdout).unwrap();
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(Path::new(dir.trim()).join("summary.json")).unwrap(),
    )
    .unwrap();
    let accuracy = summary["final"]["val_accuracy"].as_f64().unwrap();
    assert!(accuracy >= 0.97, "validation accuracy {accuracy}");
}

#[test]
fn same_job_twice_gives_identical_metrics_in_distinct_directories() {
    let runs = tempfile::tempdir().unwrap();
    let r = runs.path().to_str().unwrap();
    let args = [
        "run",
        "jobs/mlp.toml",
        "--set",
        "train.epochs=2",
        "--runs-dir",
        r,
        "--quiet",
    ];
    let a = String::from_utf8(trainer(&args, &[]).stdout).unwrap();
    let b = String::from_utf8(trainer(&args, &[]).stdout).unwrap();
    assert_ne!(a, b);
    let numbers = |dir: &str| -> Vec<String> {
        let text = std::fs::read_to_string(Path::new(dir.trim()).join("metrics.csv")).unwrap();
        // Everything but the timing columns.
        text.lines()
            .map(|l| l.split(',').take(7).collect::<Vec<_>>().join(","))
            .collect()
    };
    assert_eq!(numbers(&a), numbers(&b));
}

#[test]
fn config_toml_shows_every_default_and_trains_the_same_job_again() {
    let runs = tempfile::tempdir().unwrap();
    let r = runs.path().to_str().unwrap();
    let run = |job: &str| {
        let out = trainer(
            &[
                "run",
                job,
                "--set",
                "train.epochs=2",
                "--set",
                "checkpoint.every_epochs=1",
                "--runs-dir",
                r,
                "--quiet",
            ],
            &[],
        );
        assert!(out.status.success(), "{}", stderr(&out));
        PathBuf::from(stdout(&out).trim())
    };
    let first = run("jobs/mlp.toml");
    let config = std::fs::read_to_string(first.join("config.toml")).unwrap();
    assert!(
        config.starts_with(
            "# trainer run jobs/mlp.toml --set train.epochs=2 --set checkpoint.every_epochs=1\n"
        ),
        "{config}"
    );
    // jobs/mlp.toml sets a cosine schedule with warm-up and leaves these to their defaults.
    for line in [
        "warmup_start_factor = 0.0",
        "min_lr = 0.0",
        "on_nonfinite = \"error\"",
        "loss_scale = \"none\"",
        "activations = \"none\"",
    ] {
        assert!(config.contains(line), "config.toml lacks {line}:\n{config}");
    }
    let again = run(first.join("config.toml").to_str().unwrap());
    let numbers = |dir: &Path| -> Vec<String> {
        let text = std::fs::read_to_string(dir.join("metrics.csv")).unwrap();
        text.lines()
            .map(|l| l.split(',').take(7).collect::<Vec<_>>().join(","))
            .collect()
    };
    assert_eq!(numbers(&first), numbers(&again));
    // The same job, however spelled: the same hash, and either resumes the other's run.
    let hash = |dir: &Path| {
        let text = std::fs::read_to_string(dir.join("provenance.json")).unwrap();
        serde_json::from_str::<serde_json::Value>(&text).unwrap()["spec_hash"].clone()
    };
    assert_eq!(hash(&first), hash(&again));
    for (job, run) in [
        (first.join("config.toml"), &first),
        (PathBuf::from("jobs/mlp.toml"), &again),
    ] {
        let out = trainer(
            &[
                "run",
                job.to_str().unwrap(),
                "--resume",
                run.to_str().unwrap(),
                "--set",
                "train.epochs=3",
                "--set",
                "checkpoint.every_epochs=1",
                "--quiet",
            ],
            &[],
        );
        assert!(out.status.success(), "{}", stderr(&out));
    }
}

#[test]
fn overrides_layer_file_then_environment_then_set() {
    let runs = tempfile::tempdir().unwrap();
    let r = runs.path().to_str().unwrap();
    let config = |out: Output| {
        assert!(out.status.success(), "{}", stderr(&out));
        let dir = String::from_utf8(out.stdout).unwrap();
        std::fs::read_to_string(Path::new(dir.trim()).join("config.toml")).unwrap()
    };
    let env = [
        ("TRAINER_OPTIMIZER__LR", "0.005"),
        ("TRAINER_TRAIN__EPOCHS", "1"),
        ("TRAINER_BIN_UNRELATED", "x"),
    ];
    let from_env = config(trainer(
        &["run", "jobs/mlp.toml", "--runs-dir", r, "-q"],
        &env,
    ));
    assert!(from_env.contains("lr = 0.005"), "{from_env}");
    let from_set = config(trainer(
        &[
            "run",
            "jobs/mlp.toml",
            "--runs-dir",
            r,
            "-q",
            "--set",
            "optimizer.lr=0.002",
        ],
        &env,
    ));
    assert!(from_set.contains("lr = 0.002"), "{from_set}");
    let named = trainer(
        &[
            "run",
            "jobs/mlp.toml",
            "--runs-dir",
            r,
            "-q",
            "--name",
            "sweep-a",
        ],
        &env,
    );
    assert!(String::from_utf8(named.stdout).unwrap().contains("sweep-a"));
}

#[test]
fn an_environment_variable_that_picks_a_layer_is_refused_naming_it() {
    let out = trainer(
        &["check", "jobs/mlp.toml"],
        &[("TRAINER_MODEL__LAYERS[1]__OUT", "8")],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(
            "environment variable TRAINER_MODEL__LAYERS[1]__OUT: a variable cannot pick a list \
             element; use --set model.layers[1].out=VALUE"
        ),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_runs_dir_that_is_a_file_is_a_usage_error() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("afile");
    std::fs::write(&file, "").unwrap();
    for (command, flag) in [
        ("run", "--runs-dir"),
        ("run", "--run-dir"),
        ("sweep", "--runs-dir"),
    ] {
        let target = file.join("x");
        let mut args = vec![command, "jobs/mlp.toml", flag, target.to_str().unwrap()];
        if command == "sweep" {
            args.extend(["--grid", "optimizer.lr=0.1,0.2"]);
        }
        let out = trainer(&[&args[..], &["--quiet"]].concat(), &[]);
        assert_eq!(out.status.code(), Some(2), "{flag}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("a file is in the way of the path"),
            "{flag}: {}",
            stderr(&out)
        );
    }
    // A symbolic link to nothing is named as one; links in a loop are a usage error too.
    let dangling = tmp.path().join("dangling");
    std::os::unix::fs::symlink(tmp.path().join("gone"), &dangling).unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    std::os::unix::fs::symlink(&b, &a).unwrap();
    std::os::unix::fs::symlink(&a, &b).unwrap();
    for (flag, path, says) in [
        ("--runs-dir", &dangling, "dangling is a symbolic link to"),
        ("--run-dir", &dangling, "which does not exist"),
        ("--runs-dir", &a, "Too many levels of symbolic links"),
    ] {
        let out = trainer(
            &[
                "run",
                "jobs/mlp.toml",
                flag,
                path.to_str().unwrap(),
                "--quiet",
            ],
            &[],
        );
        assert_eq!(out.status.code(), Some(2), "{flag}: {}", stderr(&out));
        assert!(stderr(&out).contains(says), "{flag}: {}", stderr(&out));
    }
}

#[test]
fn check_prints_layers_shapes_parameters_and_memory() {
    let out = trainer(&["check", "jobs/mlp.toml"], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8(out.stdout).unwrap();
    for expected in [
        "flatten",
        "[64]",
        "linear",
        "8,320",
        "total parameters: 9,610",
        "activations",
        "total",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in\n{text}");
    }
}

#[test]
fn check_shows_activation_memory_with_and_without_checkpointing() {
    let out = trainer(
        &[
            "check",
            "bench/mlp8.toml",
            "--set",
            "checkpoint.activations={ segments = 4 }",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8(out.stdout).unwrap();
    for expected in [
        "activations                   4.0 MiB",
        "activation gradients          2.0 MiB",
        "activation checkpointing: 4 segments, 8 layers recomputed",
        "(7.0 MiB without, 43% less)",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in\n{text}");
    }
    let out = trainer(&["check", "bench/mlp8.toml"], &[]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("1      relu *")
            && text.contains("* in place: writes its output over its input")
            && text.contains("activations                   7.0 MiB")
            && text.contains("checkpointing: off; with checkpoint.activations = \"all\""),
        "{text}"
    );
}

#[test]
fn schema_on_disk_is_current() {
    let out = trainer(&["schema"], &[]);
    assert!(out.status.success());
    let on_disk = std::fs::read_to_string(root().join("schemas/job.schema.json")).unwrap();
    assert!(
        String::from_utf8(out.stdout).unwrap() == on_disk,
        "schemas/job.schema.json is stale: run `cargo run -- schema > schemas/job.schema.json`"
    );
}

#[test]
fn help_is_a_manual() {
    let out = trainer(&["--help"], &[]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    for word in ["run", "check", "schema", "devices", "Exit codes", "--set"] {
        assert!(text.contains(word), "--help lacks {word}");
    }
    let run_help = String::from_utf8(trainer(&["run", "--help"], &[]).stdout).unwrap();
    assert!(run_help.contains("--runs-dir") && run_help.contains("--name"));
}

const GOOD_JOB: &str = r#"
[data]
source = "digits"
[model]
layers = [{ type = "flatten" }, { type = "linear", out = 10 }]
[optimizer]
type = "sgd"
lr = 0.1
[train]
epochs = 1
"#;

/// Writes `job` (and any data files) to a fresh directory, runs `trainer run` on it, and
/// checks the exit code, the message and that no finished-looking run was left.
fn expect_failure(job: &str, files: &[(&str, &[u8])], extra: &[&str], code: i32, needles: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let job_path = dir.path().join("bad.toml");
    std::fs::write(&job_path, job).unwrap();
    for (name, bytes) in files {
        std::fs::write(dir.path().join(name), bytes).unwrap();
    }
    let runs = dir.path().join("runs");
    let mut args = vec![
        "run",
        job_path.to_str().unwrap(),
        "--runs-dir",
        runs.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let out = trainer(&args, &[]);
    let err = stderr(&out);
    assert_eq!(
        out.status.code(),
        Some(code),
        "exit code for {needles:?}: {err}"
    );
    assert!(!err.contains("panicked"), "panic: {err}");
    for needle in needles {
        assert!(err.contains(needle), "message lacks {needle:?}:\n{err}");
    }
    assert_eq!(finished_runs(&runs), 0);
}

#[test]
fn multiply_takes_exactly_two_inputs() {
    let layers = r#"layers = [
  { type = "flatten", name = "x" },
  { type = "multiply", inputs = ["x", "x", "x"] },
  { type = "linear", out = 10 },
]"#;
    let job = GOOD_JOB.replace(
        r#"layers = [{ type = "flatten" }, { type = "linear", out = 10 }]"#,
        layers,
    );
    expect_failure(&job, &[], &[], 2, &["takes two inputs, 3 given"]);
}

#[test]
fn malformed_toml_names_the_line_and_column() {
    expect_failure(
        "[data\nsource = \"digits\"\n",
        &[],
        &[],
        2,
        &["bad.toml:1:"],
    );
}

#[test]
fn unknown_key_suggests_the_right_one() {
    let job = GOOD_JOB.replace("lr = 0.1", "lrr = 0.1");
    expect_failure(
        &job,
        &[],
        &[],
        2,
        &["bad.toml:8:1", "unknown field `lrr`", "did you mean `lr`?"],
    );
}

/// A key inside a layer is pointed at on its own line and column, not at the start of the
/// list, and the keys every layer has are among those suggested.
#[test]
fn an_unknown_layer_key_is_pointed_at_and_suggested_among_every_layer_key() {
    let job = GOOD_JOB.replace(
        "layers = [{ type = \"flatten\" }, { type = \"linear\", out = 10 }]",
        "layers = [\n  { type = \"flatten\", name = \"f\" },\n  { type = \"linear\", out = 10, input = [\"f\"] },\n]",
    );
    assert_ne!(job, GOOD_JOB);
    let line = job.lines().position(|l| l.contains("input =")).unwrap() + 1;
    let column = job.lines().nth(line - 1).unwrap().find("input").unwrap() + 1;
    expect_failure(
        &job,
        &[],
        &[],
        2,
        &[
            &format!("bad.toml:{line}:{column}: key `model.layers[1].input`"),
            "expected one of `out`, `in`, `bias`, `tied_to`, `name`, `inputs` (did you mean `inputs`?)",
        ],
    );
}

#[test]
fn force_or_resume_fallback_without_a_resume_is_refused() {
    for flag in ["--force", "--resume-fallback"] {
        expect_failure(
            GOOD_JOB,
            &[],
            &[flag],
            2,
            &[&format!("{flag} applies to a resumed run: give --resume")],
        );
    }
}

#[test]
fn wrong_type_names_the_key() {
    let job = GOOD_JOB.replace("lr = 0.1", "lr = \"fast\"");
    expect_failure(
        &job,
        &[],
        &[],
        2,
        &[
            "bad.toml:8:",
            "optimizer.lr",
            "invalid type: string \"fast\"",
        ],
    );
}

#[test]
fn betas_must_be_exactly_two_numbers() {
    let job = GOOD_JOB.replace(
        "type = \"sgd\"",
        "type = \"adam\"\nbetas = [0.9, 0.99, 0.5]",
    );
    expect_failure(
        &job,
        &[],
        &[],
        2,
        &[
            "optimizer.betas",
            "[0.9, 0.99, 0.5] given; expected a list of exactly 2 numbers",
        ],
    );
}

#[test]
fn zero_batch_size_is_refused() {
    let job = GOOD_JOB.replace("source = \"digits\"", "source = \"digits\"\nbatch_size = 0");
    expect_failure(
        &job,
        &[],
        &[],
        2,
        &["data.batch_size", "0 given; must be at least 1"],
    );
}

#[test]
fn negative_learning_rate_is_refused() {
    expect_failure(
        &GOOD_JOB.replace("lr = 0.1", "lr = -0.1"),
        &[],
        &[],
        2,
        &["optimizer.lr", "-0.1 given"],
    );
}

#[test]
fn unknown_layer_type_lists_the_known_ones() {
    let job = GOOD_JOB.replace("type = \"linear\", out = 10", "type = \"lienar\", out = 10");
    expect_failure(
        &job,
        &[],
        &[],
        2,
        &[
            "model.layers[1]",
            "unknown variant `lienar`",
            "did you mean `linear`?",
        ],
    );
}

#[test]
fn shape_that_cannot_be_inferred_says_how_to_fix_it() {
    let job = GOOD_JOB.replace("{ type = \"flatten\" }, ", "");
    expect_failure(
        &job,
        &[],
        &[],
        2,
        &[
            // A linear layer applies over the last axis: [1, 8, 8] gives [1, 8, 10].
            "model.layers[0] (the last layer) outputs [1, 8, 10]",
            "add { type = \"flatten\" } before the last linear layer",
        ],
    );
}

#[test]
fn a_shape_error_names_the_set_that_gave_the_input_shape() {
    let job = GOOD_JOB.replace(
        "{ type = \"flatten\" }",
        "{ type = \"maxpool2d\", kernel_size = 2 }",
    );
    expect_failure(
        &job,
        &[],
        &["--set", "model.input_shape=[64]"],
        2,
        &[
            "bad.toml: model.layers[0] (maxpool2d)",
            "(model.input_shape = [64] is from --set model.input_shape)",
        ],
    );
    // The layer at fault is the file's; what changed before it is named beside it.
    expect_failure(
        GOOD_JOB,
        &[],
        &["--set", "model.layers[0].type=\"relu\""],
        2,
        &[
            "bad.toml: model.layers[1] (the last layer)",
            "(model.layers is changed by --set model.layers[0].type)",
        ],
    );
}

#[test]
fn output_width_must_match_the_classes() {
    let job = GOOD_JOB.replace("out = 10", "out = 7");
    expect_failure(&job, &[], &[], 2, &["outputs [7]", "10 classes"]);
}

/// A layer named with a number would be taken for a position, and its tensors in
/// model.safetensors ("3.weight") for the unnamed layer 3's (which overwrote them); the error
/// says where the layers came from.
#[test]
fn a_layer_name_that_reads_as_a_position_is_refused() {
    let job = GOOD_JOB.replace(
        r#"{ type = "linear", out = 10 }"#,
        r#"{ type = "linear", out = 32, name = "3" }, { type = "relu" }, { type = "linear", out = 10 }"#,
    );
    let needles = ["bad.toml: model.layers[1] (linear \"3\"): the name \"3\" is a number"];
    expect_failure(&job, &[], &[], 2, &needles);
}

/// What `run` refuses before training, `check` refuses too, and `run` makes no run
/// directory for it.
#[test]
fn check_refuses_what_run_refuses_before_training() {
    let tmp = tempfile::tempdir().unwrap();
    let job = common::write_job(tmp.path(), GOOD_JOB);
    let job = job.to_str().unwrap();
    let runs = tmp.path().join("runs");
    let no_batch = [
        "--set",
        "data.batch_size=100000",
        "--set",
        "data.drop_last=true",
    ];
    let missing = ["--set", "model.init_from=\"/no/such/weights.safetensors\""];
    for (sets, needle) in [
        (
            &no_batch[..],
            "drop_last = true with batch_size 100000 leaves no batch",
        ),
        (
            &missing[..],
            // Named by where the path came from, the --set, once.
            "error: --set model.init_from = \"/no/such/weights.safetensors\": cannot read it",
        ),
    ] {
        for command in ["check", "run"] {
            let mut args = vec![command, job, "--runs-dir", runs.to_str().unwrap()];
            if command == "check" {
                args.truncate(2);
            }
            args.extend(sets);
            let out = trainer(&args, &[]);
            let err = stderr(&out);
            assert_eq!(out.status.code(), Some(2), "{command}: {err}");
            assert!(err.contains(needle), "{command}: {err}");
        }
    }
    assert!(!runs.exists(), "a run directory was made");
}

/// PyTorch refuses to train a batch norm on one value per channel; so does trainer, before
/// training, for every batch or only the last of each epoch (1,797 = 4 · 449 + 1 digits).
#[test]
fn a_batch_norm_over_a_single_sample_is_refused_before_training() {
    let job = GOOD_JOB.replace(
        r#"{ type = "linear", out = 10 }"#,
        r#"{ type = "linear", out = 16 }, { type = "batchnorm1d" }, { type = "linear", out = 10 }"#,
    );
    let every = ["--set", "data.batch_size=1"];
    let needle = "model.layers[2] (batchnorm1d) would train on every training batch, 1 sample";
    expect_failure(
        &job,
        &[],
        &every,
        2,
        &[needle, "choose a larger data.batch_size"],
    );
    let last = ["--set", "data.batch_size=449"];
    let needle = "the last training batch of each epoch, 1 sample";
    expect_failure(&job, &[], &last, 2, &[needle, "set data.drop_last = true"]);
}

#[test]
fn missing_data_file_is_named() {
    let job = GOOD_JOB.replace(
        "source = \"digits\"",
        "source = \"csv\"\npath = \"nowhere.csv\"",
    );
    let says = "bad.toml: key `data.path`: cannot read data file";
    expect_failure(&job, &[], &[], 2, &[says, "nowhere.csv"]);
}

const IDX_JOB: &str = r#"
[data]
source = "idx"
train_images = "images.gz"
train_labels = "labels.idx"
[model]
layers = [{ type = "flatten" }, { type = "linear", out = 10 }]
[optimizer]
type = "sgd"
lr = 0.1
"#;

#[test]
fn corrupt_gzip_data_is_named() {
    let garbage: &[u8] = &[0x1f, 0x8b, 8, 0, 1, 2, 3, 4, 5, 6, 7, 8];
    expect_failure(
        IDX_JOB,
        &[("images.gz", garbage)],
        &[],
        2,
        &["images.gz", "corrupt gzip"],
    );
}

#[test]
fn truncated_idx_file_says_how_much_is_missing() {
    let mut images = vec![0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 2];
    images.extend([7u8; 5]); // 2 images of 2x2 need 8 bytes
    let labels: &[u8] = &[0, 0, 8, 1, 0, 0, 0, 2, 1, 2];
    expect_failure(
        &IDX_JOB.replace("images.gz", "images.idx"),
        &[("images.idx", &images), ("labels.idx", labels)],
        &[],
        2,
        &["images.idx", "truncated", "promises 8 bytes", "has 5"],
    );
    // Dimensions whose product does not fit in a usize (it wrapped to a small promise).
    let mut huge = vec![0, 0, 8, 3, 0x80, 0, 0, 0, 0x80, 0, 0, 0, 0x80, 0, 0, 0];
    huge.extend([7u8; 5]);
    expect_failure(
        &IDX_JOB.replace("images.gz", "images.idx"),
        &[("images.idx", &huge), ("labels.idx", labels)],
        &[],
        2,
        &[
            "images.idx: the IDX header's dimensions",
            "promise more data than any file holds",
        ],
    );
}

#[test]
fn idx_images_of_no_pixels_are_refused() {
    let images: &[u8] = &[0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 2]; // 2 images of 0x2
    let labels: &[u8] = &[0, 0, 8, 1, 0, 0, 0, 2, 1, 2];
    expect_failure(
        &IDX_JOB.replace("images.gz", "images.idx"),
        &[("images.idx", images), ("labels.idx", labels)],
        &[],
        2,
        &["images.idx: the IDX header says 2 images of 0x2 pixels"],
    );
}

/// `cat a.gz b.gz`, `gzip >>` and bgzip write several gzip members: all of them are data.
#[test]
fn a_gzip_file_of_several_members_is_read_whole() {
    use std::io::Write;
    let member = |text: &str| {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(text.as_bytes()).unwrap();
        gz.finish().unwrap()
    };
    let tmp = tempfile::tempdir().unwrap();
    let mut bytes = member("a,b,y\n1,2,0\n3,4,1\n");
    bytes.extend(member("5,6,2\n7,8,1\n9,9,0\n"));
    std::fs::write(tmp.path().join("data.csv"), bytes).unwrap();
    let job = common::write_job(
        tmp.path(),
        &format!("{CSV_JOB}[train]\nepochs = 1\n").replace("[data]", "[data]\nval_fraction = 0"),
    );
    let out = trainer(&["check", job.to_str().unwrap()], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("train 5"), "{}", stdout(&out));
}

const CSV_JOB: &str = r#"
[data]
source = "csv"
path = "data.csv"
classes = 3
[model]
layers = [{ type = "linear", out = 3 }]
[optimizer]
type = "sgd"
lr = 0.1
"#;

#[test]
fn a_column_name_the_header_gives_twice_is_refused() {
    let csv = b"a,y,y\n1,0,1\n3,1,2\n5,2,0\n";
    expect_failure(
        &CSV_JOB.replace("classes = 3", "classes = 3\nlabel = \"y\""),
        &[("data.csv", csv)],
        &[],
        2,
        &["data.csv: the header names columns 1 and 2 `y`: give the column by index"],
    );
}

#[test]
fn classes_are_refused_for_regression_data() {
    expect_failure(
        &CSV_JOB.replace("classes = 3", "classes = 3\ntask = \"regression\""),
        &[],
        &[],
        2,
        &["data.classes", "only applies to task = \"classification\""],
    );
}

#[test]
fn label_out_of_range_names_the_sample() {
    let csv = b"a,b,label\n1,2,0\n3,4,5\n5,6,1\n";
    expect_failure(
        CSV_JOB,
        &[("data.csv", csv)],
        &[],
        2,
        &["data.csv: line 3: label 5 is out of range", "classes = 3"],
    );
}

#[test]
fn a_label_out_of_range_in_the_test_file_names_the_test_file() {
    let job = CSV_JOB.replace(
        "path = \"data.csv\"",
        "path = \"data.csv\"\ntest_path = \"test.csv\"",
    );
    expect_failure(
        &job,
        &[
            ("data.csv", b"a,b,label\n1,2,0\n3,4,2\n5,6,1\n"),
            ("test.csv", b"a,b,label\n1,2,0\n3,4,7\n"),
        ],
        &[],
        2,
        &["test.csv: line 3: label 7 is out of range"],
    );
}

#[test]
fn a_label_that_is_not_exactly_a_class_index_is_refused_as_written() {
    // 1e20 made the class count wrap (a panic in training); 2.00000001 read as an f32 is 2.
    for label in ["1e20", "2.00000001", "16777217"] {
        let csv = format!("a,b,label\n1,2,0\n3,4,{label}\n5,6,1\n");
        expect_failure(
            CSV_JOB,
            &[("data.csv", csv.as_bytes())],
            &[],
            2,
            &[&format!(
                "data.csv: line 3, column 2 (`label`): label `{label}` is not a class index"
            )],
        );
    }
}

#[test]
fn a_test_file_with_its_columns_in_another_order_is_refused() {
    let job = CSV_JOB.replace(
        "path = \"data.csv\"",
        "path = \"data.csv\"\ntest_path = \"test.csv\"",
    );
    expect_failure(
        &job,
        &[
            ("data.csv", b"a,b,label\n1,2,0\n3,4,2\n5,6,1\n"),
            ("test.csv", b"b,a,label\n2,1,0\n4,3,2\n"),
        ],
        &[],
        2,
        &["test.csv: its header gives the columns read (features, then the label) as `b`, `a`, `label`"],
    );
}

#[test]
fn a_header_of_numbers_is_warned_about() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("data.csv"), "1,2,0\n3,4,2\n5,6,1\n").unwrap();
    let job = dir.path().join("job.toml");
    std::fs::write(&job, CSV_JOB).unwrap();
    let out = trainer(&["check", job.to_str().unwrap()], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(
            "data.csv: its first line (1,2,0) holds only numbers but is read as the header"
        ),
        "{}",
        stderr(&out)
    );
}

#[test]
fn infinite_synthetic_noise_is_refused() {
    let job = "[data]\nsource = \"synthetic\"\nnoise = inf\n[model]\nlayers = [{ type = \"linear\", out = 4 }]\n[optimizer]\ntype = \"sgd\"\nlr = 0.1\n";
    expect_failure(
        job,
        &[],
        &[],
        2,
        &["data.noise", "inf given; must be a finite number"],
    );
}

#[test]
fn ragged_csv_row_names_the_line() {
    let csv = b"a,b,label\n1,2,0\n3,4\n5,6,1\n";
    expect_failure(
        CSV_JOB,
        &[("data.csv", csv)],
        &[],
        2,
        &["data.csv: line 3: 2 field(s), where the header has 3"],
    );
    expect_failure(
        CSV_JOB,
        &[("data.csv", b"a,b,label\n1,2,0\n3,\"4,1\n5,6,1\n")],
        &[],
        2,
        &[
            "data.csv: line 3: 2 field(s), where the header has 3 (a field runs over several \
           lines: is a quote left open?)",
        ],
    );
    // Lines are counted as the file has them, blank ones too.
    expect_failure(
        CSV_JOB,
        &[("data.csv", b"a,b,label\n\n\n1,x,0\n")],
        &[],
        2,
        &["data.csv: line 4, column 1 (`b`): `x` is not a number"],
    );
    // In the last column the count is right: the field itself says it.
    let open_in_label: &[u8] = b"a,b,label\n1,2,0\n3,4,\"1\n5,6,1\n";
    let open_on_last_line: &[u8] = b"a,b,label\n1,2,0\n3,4,\"1\n";
    for csv in [open_in_label, open_on_last_line] {
        expect_failure(
            CSV_JOB,
            &[("data.csv", csv)],
            &[],
            2,
            &[
                "data.csv: line 3, column 2 (`label`): the field runs over several lines: is a \
               quote left open?",
            ],
        );
    }
    expect_failure(
        CSV_JOB,
        &[("data.csv", b"a,b,label\n1,2,0,\n3,4,1,\n")],
        &[],
        2,
        &["line 2: 4 field(s), where the header has 3 (does the line end with a comma?)"],
    );
    let no_header = CSV_JOB.replace("[data]", "[data]\nheader = false");
    expect_failure(
        &no_header,
        &[("data.csv", b"1,2,0,\n3,4,1,\n")],
        &["--set", "data.label=2"],
        2,
        &[
            "line 1, column 3: empty (a missing value); it is the last field: does the line end \
           with a comma?",
        ],
    );
    expect_failure(
        &no_header,
        &[("data.csv", b"a,b,label\n1,2,0\n")],
        &[],
        2,
        &[
            "line 1, column 0: `a` is not a number; data.header = false reads the first line as data: \
           is it a header?",
        ],
    );
}

/// The label as a feature would give the model the answer (100% accuracy, exit 0); a
/// column listed twice is a slip; one class has nothing to learn (and gave a message with
/// an underflowed range).
#[test]
fn csv_features_that_hold_the_label_or_repeat_and_a_single_class_are_refused() {
    let csv: &[u8] = b"a,b,label\n1,2,0\n3,4,2\n5,6,1\n";
    let files = [("data.csv", csv)];
    let with = |key: &str| CSV_JOB.replace("classes = 3", &format!("classes = 3\n{key}"));
    let leak = with(r#"features = ["a", "label"]"#);
    let needle = "data.csv: data.features: column `label` is the label (data.label)";
    expect_failure(&leak, &files, &[], 2, &[needle]);
    let twice = with(r#"features = ["a", "b", "a"]"#);
    let needle = "data.csv: data.features: column `a` is listed twice (at 0 and 2)";
    expect_failure(&twice, &files, &[], 2, &[needle]);
    let one_class = CSV_JOB.replace("classes = 3", "classes = 0");
    let needle = "bad.toml: key `data.classes`: must be at least 2";
    expect_failure(&one_class, &files, &[], 2, &[needle]);
}

/// Without data.classes the classes are the labels up to the largest: a model sized for
/// classes the training file lacks, or one label far out, is told where the count came from
/// and how to give it.
#[test]
fn a_class_count_taken_from_the_labels_says_so_and_where_the_largest_is() {
    let no_classes = CSV_JOB.replace("classes = 3\n", "");
    expect_failure(
        &no_classes,
        &[("data.csv", b"a,b,y\n1,2,0\n3,4,1\n5,6,1\n")],
        &[],
        2,
        &[
            "model.layers[0] (the last layer) outputs [3] (3 values per sample) but \
             cross_entropy needs one logit per class (2 classes; data.classes is not set and \
             the largest label is 1, at ",
            "data.csv: line 3; set data.classes = 3 if some classes have no samples)",
        ],
    );
    // Given, the count needs no explanation.
    let out = |job: &str| {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("data.csv"), "a,b,y\n1,2,0\n3,4,1\n").unwrap();
        let job = common::write_job(dir.path(), job);
        stderr(&trainer(&["check", job.to_str().unwrap()], &[]))
    };
    let given = out(&CSV_JOB.replace("classes = 3", "classes = 4"));
    assert!(given.contains("(4 classes)"), "{given}");
    // Labels counted from 1 leave class 0 empty: said, since accuracy would not show it.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("data.csv"), "a,b,y\n1,2,1\n3,4,2\n5,6,2\n").unwrap();
    let job = common::write_job(dir.path(), &no_classes);
    let err = stderr(&trainer(&["check", job.to_str().unwrap()], &[]));
    assert!(
        err.contains("no label is 0 (the smallest is 1); classes count from 0"),
        "{err}"
    );
}

/// Real-valued labels read as classes suggest data.task; a loss that needs classes is
/// blamed on the loss, not on a --set of a layer beside it.
#[test]
fn regression_data_read_as_classes_points_at_data_task_and_loss_type() {
    let csv: &[u8] = b"a,b,y\n0.1,0.2,1.5\n0.3,0.4,2.5\n";
    expect_failure(
        CSV_JOB,
        &[("data.csv", csv)],
        &[],
        2,
        &[
            "label `1.5` is not a class index (a whole number from 0 to 16777216); for \
           real-valued targets set data.task = \"regression\"",
        ],
    );
    let regression = CSV_JOB.replace("classes = 3", "task = \"regression\"");
    expect_failure(
        &regression,
        &[("data.csv", csv)],
        &["--set", "model.layers[0].out=1"],
        2,
        &["bad.toml: loss.type = \"cross_entropy\" needs class labels"],
    );
}

/// An empty field is a missing value, said so (and a trailing comma on every line as such);
/// a line of spaces is skipped as a blank line is.
#[test]
fn empty_csv_fields_are_missing_values_and_lines_of_spaces_are_blank() {
    expect_failure(
        CSV_JOB,
        &[("data.csv", b"a,b,label\n1,2,0\n3,,1\n")],
        &[],
        2,
        &["data.csv: line 3, column 1 (`b`): empty (a missing value)"],
    );
    expect_failure(
        &CSV_JOB.replace("classes = 3", "classes = 3\nlabel = \"label\""),
        &[("data.csv", b"a,b,label,\n1,2,0,\n3,4,1,\n")],
        &[],
        2,
        &[
            "column 3 (``): empty (a missing value); the header's last name is empty too: do \
           the lines end with a comma?",
        ],
    );
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("data.csv"),
        "a,b,label\n1,2,0\n   \n3,4,2\n\t\n5,6,1\n",
    )
    .unwrap();
    let job = common::write_job(
        dir.path(),
        &CSV_JOB.replace("[data]", "[data]\nval_fraction = 0"),
    );
    let out = trainer(&["check", job.to_str().unwrap()], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("data: csv, train 3"),
        "{}",
        stdout(&out)
    );
}

#[test]
fn csv_that_is_not_utf8_names_the_line() {
    let csv = b"a,b,label\n1,2,0\n3,\xff,1\n";
    expect_failure(
        CSV_JOB,
        &[("data.csv", csv)],
        &[],
        2,
        &["data.csv: line 3: not UTF-8 text"],
    );
}

#[test]
fn set_of_an_unknown_key_is_refused() {
    expect_failure(
        GOOD_JOB,
        &[],
        &["--set", "optimizer.lrr=0.1"],
        2,
        &[
            "--set optimizer.lrr: key `optimizer.lrr`: unknown key",
            "did you mean `lr`?",
        ],
    );
}

/// Values TOML reads otherwise than meant say how to write them.
#[test]
fn set_values_typed_as_another_type_say_how_to_write_them() {
    let cases: [(&str, &str); 7] = [
        (
            "optimizer.lr=.001",
            "`.001` is not a number as TOML writes one: write 0.001",
        ),
        (
            "optimizer.lr=1e309",
            "`1e309` is not a number as TOML writes one: it is beyond the largest number",
        ),
        (
            "train.epochs=2.0",
            "2.0 given; expected a whole number, not negative: write 2, without a decimal point",
        ),
        (
            "job.name=123",
            "123 given, which TOML reads as a number; expected a string: quote it to give \
             text, '\"123\"'",
        ),
        (
            "job.name=true",
            "true given, which TOML reads as true or false",
        ),
        // Not a number to begin with: text, as before.
        ("optimizer.type=sgd2", "\"sgd2\" given; allowed:"),
        (
            "optimizer.lr=-1e309",
            "`-1e309` is beyond the largest number",
        ),
    ];
    for (set, says) in cases {
        expect_failure(GOOD_JOB, &[], &["--set", set], 2, &[says]);
    }
    // Quoting is no fix for a duration, which has a form of its own.
    let tmp = tempfile::tempdir().unwrap();
    let job = common::write_job(tmp.path(), GOOD_JOB);
    let out = trainer(
        &["check", job.to_str().unwrap(), "--set", "train.max_time=60"],
        &[],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("60 given, which TOML reads as a number"),
        "{}",
        stderr(&out)
    );
    assert!(!stderr(&out).contains("quote it"), "{}", stderr(&out));
}

/// A table given whole with --set is merged into the file's: the keys it leaves out are
/// named, so that a warm-up kept under another schedule is no surprise.
#[test]
fn a_table_given_whole_with_set_names_the_keys_it_keeps_from_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let job = common::write_job(
        tmp.path(),
        &GOOD_JOB.replace(
            "lr = 0.1",
            "lr = 0.1\nweight_decay = 0.01\nschedule = { type = \"cosine\", warmup_steps = 5 }",
        ),
    );
    let out = trainer(
        &[
            "check",
            job.to_str().unwrap(),
            "--set",
            r#"optimizer.schedule={type="constant"}"#,
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(
            "--set optimizer.schedule={...} is merged into the job file's optimizer.schedule: \
             optimizer.schedule.warmup_steps keeps the file's value"
        ),
        "{}",
        stderr(&out)
    );
    // Keys another --set gives are not kept from the file; `--explain`, which loads the
    // job twice, says it once.
    let out = trainer(
        &[
            "check",
            job.to_str().unwrap(),
            "--explain",
            "--set",
            r#"optimizer={type="sgd"}"#,
            "--set",
            "optimizer.lr=0.5",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let err = stderr(&out);
    assert_eq!(err.matches("is merged into").count(), 1, "{err}");
    assert!(
        err.contains("optimizer.weight_decay, optimizer.schedule keep the file's values"),
        "{err}"
    );
}

/// A table given whole in an environment variable is merged as a --set's is, said the same
/// way, and `--explain` credits its keys to that variable (there is no TRAINER_OPTIMIZER__TYPE).
#[test]
fn a_table_given_whole_in_the_environment_is_said_and_credited_to_its_variable() {
    let tmp = tempfile::tempdir().unwrap();
    let job = common::write_job(
        tmp.path(),
        &GOOD_JOB.replace("lr = 0.1", "lr = 0.1\nweight_decay = 0.01"),
    );
    let out = trainer(
        &[
            "check",
            job.to_str().unwrap(),
            "--explain",
            "--set",
            "optimizer.weight_decay=0",
        ],
        &[("TRAINER_OPTIMIZER", r#"{type="sgd", momentum=0.9}"#)],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let err = stderr(&out);
    assert_eq!(err.matches("is merged into").count(), 1, "{err}");
    assert!(
        err.contains(
            "environment TRAINER_OPTIMIZER={...} is merged into the job file's optimizer: \
             optimizer.lr keeps the file's value (give it in the variable to change it)"
        ),
        "{err}"
    );
    let said = common::stdout(&out);
    let source = |key: &str| {
        let line = said.lines().find(|l| l.starts_with(&format!("{key} ")));
        line.unwrap_or_else(|| panic!("no {key} in:\n{said}"))
            .to_string()
    };
    assert!(source("optimizer.type").ends_with("environment TRAINER_OPTIMIZER"));
    assert!(source("optimizer.momentum").ends_with("environment TRAINER_OPTIMIZER"));
    assert!(source("optimizer.lr").contains("file "), "{said}");
    // An error in the table names the variable too.
    let out = trainer(
        &["check", job.to_str().unwrap()],
        &[("TRAINER_OPTIMIZER", r#"{type="sgd", momentum="x"}"#)],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("environment TRAINER_OPTIMIZER: key `optimizer.momentum`"),
        "{}",
        stderr(&out)
    );
}

/// Environment values are read as TOML, as --set values are: the README's own example,
/// `TRAINER_OPTIMIZER__LR=3e-4`, was read by figment as the text "3e-4". A value that is not
/// TOML is text, as before (`sgd`, a path).
#[test]
fn environment_values_are_read_as_toml_and_bare_words_as_text() {
    let tmp = tempfile::tempdir().unwrap();
    let job = common::write_job(tmp.path(), GOOD_JOB);
    let out = trainer(
        &["check", job.to_str().unwrap(), "--explain"],
        &[
            ("TRAINER_OPTIMIZER__LR", "3e-4"),
            ("TRAINER_OPTIMIZER__TYPE", "adam"),
            ("TRAINER_OPTIMIZER__BETAS", "[0.8, 0.99]"),
            ("TRAINER_JOB__NAME", "2026-11-25"),
            ("TRAINER_TRAIN__CLIP_GRAD_NORM", "1E+1"),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let said = common::stdout(&out);
    for (key, value) in [
        ("optimizer.lr", "0.0003"),
        ("optimizer.type", "\"adam\""),
        ("optimizer.betas", "[0.8, 0.99]"),
        ("job.name", "\"2026-11-25\""),
        ("train.clip_grad_norm", "10.0"),
    ] {
        let line = said.lines().find(|l| l.starts_with(&format!("{key} ")));
        let line = line.unwrap_or_else(|| panic!("no {key} in:\n{said}"));
        let fields: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(
            fields[1..].join(" ").split(" environment").next(),
            Some(value),
            "{line}"
        );
        assert!(line.contains("environment TRAINER_"), "{line}");
    }
    // Two spellings of one key: the credit goes to the one whose value is taken.
    let out = trainer(
        &["check", job.to_str().unwrap(), "--explain"],
        &[
            ("TRAINER_OPTIMIZER__LR", "0.5"),
            ("TRAINER_optimizer__lr", "0.7"),
        ],
    );
    let said = common::stdout(&out);
    let line = said
        .lines()
        .find(|l| l.starts_with("optimizer.lr "))
        .unwrap();
    let taken = if line.contains("0.7") { "lr" } else { "LR" };
    let credited = line.contains("TRAINER_optimizer__lr");
    assert_eq!(taken == "lr", credited, "{line}");
    // A value that is not text is refused by name (any other variable may be anything).
    use std::os::unix::ffi::OsStrExt;
    let bytes = std::ffi::OsStr::from_bytes(b"\xff");
    let out = std::process::Command::new(common::trainer_bin())
        .args(["check", job.to_str().unwrap()])
        .env("TRAINER_OPTIMIZER__LR", bytes)
        .env("SOMETHING_ELSE", bytes)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("environment variable TRAINER_OPTIMIZER__LR is not UTF-8 text"),
        "{}",
        stderr(&out)
    );
}

/// data.batch_size and data.global_batch_size say one thing two ways: a --set of one over a
/// file that gives the other takes its place (no --set could remove the file's), and says so;
/// both in one layer are refused as before.
#[test]
fn a_batch_size_given_the_other_way_by_a_higher_layer_takes_the_place_of_the_files() {
    let tmp = tempfile::tempdir().unwrap();
    let job = common::write_job(
        tmp.path(),
        &GOOD_JOB.replace(
            "source = \"digits\"",
            "source = \"digits\"\nbatch_size = 32",
        ),
    );
    let out = trainer(
        &[
            "check",
            job.to_str().unwrap(),
            "--explain",
            "--set",
            "data.global_batch_size=128",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(
            "data.global_batch_size (--set data.global_batch_size) takes the place of \
             data.batch_size"
        ),
        "{}",
        stderr(&out)
    );
    assert!(common::stdout(&out).contains("data.global_batch_size"));
    let both = GOOD_JOB.replace(
        "source = \"digits\"",
        "source = \"digits\"\nbatch_size = 32\nglobal_batch_size = 64",
    );
    expect_failure(
        &both,
        &[],
        &[],
        2,
        &["given together with data.batch_size = 32"],
    );
    // A table given whole gives the keys it holds only: its batch_size takes the place of the
    // file's global_batch_size.
    let global = GOOD_JOB.replace(
        "source = \"digits\"",
        "source = \"digits\"\nglobal_batch_size = 64",
    );
    let job = common::write_job(tmp.path(), &global);
    let out = trainer(
        &[
            "check",
            job.to_str().unwrap(),
            "--set",
            "data={batch_size=32}",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(
            "data.batch_size (--set data) takes the place of data.global_batch_size (the job \
             file)"
        ),
        "{}",
        stderr(&out)
    );
}

/// The settings of data parallelism without it do nothing: said, not refused (a job written
/// for torchrun keeps them when it runs alone), and not said under a launcher's variables.
#[test]
fn data_parallel_settings_without_data_parallelism_are_warned_of() {
    let tmp = tempfile::tempdir().unwrap();
    let job = common::write_job(tmp.path(), GOOD_JOB);
    let job = job.to_str().unwrap();
    let alone = [
        "check",
        job,
        "--set",
        "parallel.bucket_mb=10",
        "--set",
        "parallel.timeout=\"5m\"",
    ];
    let out = trainer(&alone, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out)
            .contains("parallel.timeout, parallel.bucket_mb only apply with data parallelism"),
        "{}",
        stderr(&out)
    );
    let one_rank = [
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];
    let out = trainer(&alone, &one_rank);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!stderr(&out).contains("only apply"), "{}", stderr(&out));
}

/// A GPU this machine cannot open (here cuda:7, which no test machine has) is `run`'s exit 2,
/// and `check` says so after its report instead of passing the job.
#[test]
fn check_refuses_a_gpu_this_machine_cannot_open_as_run_does() {
    let tmp = tempfile::tempdir().unwrap();
    let job = common::write_job(tmp.path(), GOOD_JOB);
    for set in [
        "device.type=\"cuda:7\"",
        "parallel.devices=[\"cuda:0\", \"cuda:7\"]",
    ] {
        let out = trainer(&["check", job.to_str().unwrap(), "--set", set], &[]);
        assert_eq!(out.status.code(), Some(2), "{set}: {}", stderr(&out));
        assert!(stderr(&out).contains("requested, but"), "{}", stderr(&out));
        assert!(
            common::stdout(&out).contains("`trainer run` would refuse it here"),
            "{}",
            common::stdout(&out)
        );
    }
}

/// A sweep checks every point's device before the first trains: point 000 on the CPU did
/// train, and point 001 then failed on a GPU that is not there.
#[test]
fn a_sweep_point_on_a_gpu_this_machine_cannot_open_is_refused_before_any_trains() {
    let tmp = tempfile::tempdir().unwrap();
    let job = common::write_job(tmp.path(), GOOD_JOB);
    let runs = tmp.path().join("runs");
    let out = trainer(
        &[
            "sweep",
            job.to_str().unwrap(),
            "--runs-dir",
            runs.to_str().unwrap(),
            "--grid",
            r#"device.type="cpu","cuda:7""#,
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("sweep point 001 (device.type=cuda:7): device cuda:7 requested"),
        "{}",
        stderr(&out)
    );
    assert!(
        !runs.exists(),
        "nothing is written before every point is checked"
    );
}

#[test]
fn a_setting_given_to_a_layer_kind_without_settings_names_the_kind() {
    let says = "a flatten layer has no settings besides `type`, `name` and `inputs`";
    let in_file = GOOD_JOB.replacen(
        "{ type = \"flatten\" }",
        "{ type = \"flatten\", out = 3 }",
        1,
    );
    assert_ne!(in_file, GOOD_JOB);
    expect_failure(&in_file, &[], &[], 2, &["key `model.layers[0].out`", says]);
    let set = ["--set", "model.layers[0].out=3"];
    expect_failure(GOOD_JOB, &[], &set, 2, &["--set model.layers[0].out", says]);
}

#[test]
fn picking_an_element_of_a_list_the_file_does_not_set_says_how_to_set_it() {
    expect_failure(
        GOOD_JOB,
        &[],
        &["--set", "optimizer.betas[1]=0.99"],
        2,
        &["no list `optimizer.betas`", "--set optimizer.betas=[...]"],
    );
}

#[test]
fn a_bad_value_is_blamed_on_the_layer_that_gave_it() {
    expect_failure(
        GOOD_JOB,
        &[],
        &["--set", "optimizer.lr=-1"],
        2,
        &["--set optimizer.lr: key `optimizer.lr`: -1 given; must be a positive number"],
    );
    expect_failure(
        GOOD_JOB,
        &[],
        &["--set", "precision.mode=\"fp8\""],
        2,
        &[
            r#"--set precision.mode: key `precision.mode`: "fp8" given; allowed: "fp32", "fp16", "bf16""#,
        ],
    );
    let out = trainer(
        &["check", "jobs/mlp.toml"],
        &[("TRAINER_TRAIN__EPOCHS", "0")],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let says = "environment TRAINER_TRAIN__EPOCHS: key `train.epochs`: 0 given";
    assert!(stderr(&out).contains(says), "{}", stderr(&out));
    // A key left out of a table that --set gave is that --set's fault, not the file's.
    expect_failure(
        GOOD_JOB,
        &[],
        &["--set", "optimizer.schedule={type=\"step\"}"],
        2,
        &["--set optimizer.schedule: key `optimizer.schedule.step_size`"],
    );
    // A --set into a list copies the list to edit one element: the keys of the element it
    // did not touch are still the file's, and a key it left out is the --set's fault.
    let relu = ["--set", "model.layers[1].type=\"relu\""];
    expect_failure(
        GOOD_JOB,
        &[],
        &relu,
        2,
        &["bad.toml: key `model.layers[1].out`: unknown key: a relu layer has no settings"],
    );
    let linear = ["--set", "model.layers[0].type=\"linear\""];
    expect_failure(
        GOOD_JOB,
        &[],
        &linear,
        2,
        &["--set model.layers[0].type: key `model.layers[0].out`: missing key"],
    );
    // A table given whole is blamed for the keys in it, as given.
    expect_failure(
        GOOD_JOB,
        &[],
        &["--set", "optimizer={ type = \"sgd\", lr = -1 }"],
        2,
        &["--set optimizer: key `optimizer.lr`: -1 given"],
    );
}

/// An unquoted date is a TOML date, not text: serde saw a table ("found map").
#[test]
fn a_date_where_text_or_a_number_is_wanted_says_how_toml_read_it() {
    let in_file = format!("[job]\nname = 2024-01-01\n{GOOD_JOB}");
    expect_failure(
        &in_file,
        &[],
        &[],
        2,
        &[
            "key `job.name`: 2024-01-01 given, which TOML reads as a date or time; expected a \
             string: quote it to give text, \"2024-01-01\"",
        ],
    );
    for (set, says) in [
        (
            "job.name=2024-01-01",
            "--set job.name: key `job.name`: 2024-01-01 given, which TOML reads as a date or \
             time; expected a string: quote it to give text, '\"2024-01-01\"'",
        ),
        (
            "optimizer.lr=12:00:00",
            "key `optimizer.lr`: 12:00:00 given, which TOML reads as a date or time; expected \
             a number",
        ),
        (
            "data.normalize=2024-01-01",
            "key `data.normalize`: 2024-01-01 given, which TOML reads as a date or time; \
             expected one of \"none\", \"scale\", \"standardize\"",
        ),
        ("model.layers=2024-01-01", "expected a list"),
    ] {
        expect_failure(GOOD_JOB, &[], &["--set", set], 2, &[says]);
    }
}

#[test]
fn environment_variable_of_an_unknown_key_is_named() {
    let out = trainer(
        &["check", "jobs/mlp.toml"],
        &[("TRAINER_OPTIMIZER__LRR", "0.1")],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    let says = "environment TRAINER_OPTIMIZER__LRR: key `optimizer.lrr`: unknown key";
    assert!(err.contains(says), "{err}");
    // A variable nested below a key (two underscores too many) is named, not the job file.
    let out = trainer(
        &["check", "jobs/mlp.toml"],
        &[("TRAINER_DATA__BATCH__SIZE", "2")],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let says = "environment TRAINER_DATA__BATCH__SIZE: key `data.batch`: unknown key";
    assert!(stderr(&out).contains(says), "{}", stderr(&out));
    // One underscore too few is not a job key: said, not silently ignored.
    let out = trainer(
        &["check", "jobs/mlp.toml"],
        &[("TRAINER_TRAIN_EPOCHS", "1")],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let says = "environment variable TRAINER_TRAIN_EPOCHS is not read: a job key takes two \
                underscores after its section (TRAINER_TRAIN__EPOCHS)";
    assert!(stderr(&out).contains(says), "{}", stderr(&out));
}

/// A value of the wrong type for a key of fixed choices lists the choices, from the file, a
/// --set or the environment (serde said "expected enum Normalize").
#[test]
fn a_wrong_type_for_a_choice_lists_the_choices() {
    let normalize = "expected one of \"none\", \"scale\", \"standardize\"";
    let job = GOOD_JOB.replace(
        "source = \"digits\"",
        "source = \"digits\"\nnormalize = true",
    );
    expect_failure(
        &job,
        &[],
        &[],
        2,
        &["key `data.normalize`: true given;", normalize],
    );
    let out = trainer(
        &["check", "jobs/mlp.toml", "--set", "data.normalize=true"],
        &[],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains(normalize), "{}", stderr(&out));
    let out = trainer(
        &["check", "jobs/mlp.toml"],
        &[("TRAINER_TRAIN__ON_NONFINITE", "1")],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("expected \"error\" or \"skip\""),
        "{}",
        stderr(&out)
    );
}

/// Scripts append overrides to a base list: a key given again takes the later value.
#[test]
fn a_key_set_again_takes_the_later_value() {
    let sets = ["--set", "train.epochs=3", "--set", "train.epochs=5"];
    let out = trainer(
        &[&["check", "jobs/mlp.toml", "--explain"][..], &sets].concat(),
        &[],
    );
    let text = stdout(&out);
    let line = text
        .lines()
        .find(|l| l.starts_with("train.epochs "))
        .unwrap();
    assert!(
        line.contains(" 5 ") && line.ends_with("--set train.epochs"),
        "{line}"
    );
}

#[test]
fn set_without_a_value_is_a_usage_error() {
    expect_failure(
        GOOD_JOB,
        &[],
        &["--set", "optimizer.lr"],
        2,
        &["expected KEY=VALUE"],
    );
}

#[test]
fn cuda_without_a_gpu_is_a_clear_error_not_a_panic() {
    if matches!(trainer::tensor::cuda::probe(), Ok((devices, _)) if !devices.is_empty()) {
        eprintln!("skipped: this machine has a GPU");
        return;
    }
    let job = format!("{GOOD_JOB}\n[device]\ntype = \"cuda:0\"\n");
    expect_failure(&job, &[], &[], 2, &["device cuda:0 requested, but"]);
}

#[test]
fn auto_device_says_which_device_it_picked() {
    let runs = tempfile::tempdir().unwrap();
    let out = trainer(
        &[
            "run",
            "jobs/mlp.toml",
            "--set",
            "train.epochs=1",
            "--runs-dir",
            runs.path().to_str().unwrap(),
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("device auto: "), "{}", stderr(&out));
    let dir = String::from_utf8(out.stdout).unwrap();
    let config = std::fs::read_to_string(Path::new(dir.trim()).join("config.toml")).unwrap();
    assert!(
        config.contains("# device: cpu") || config.contains("# device: cuda:0"),
        "{config}"
    );
}

#[test]
fn a_run_dir_that_exists_is_a_usage_error() {
    let dir = tempfile::tempdir().unwrap();
    let job = dir.path().join("job.toml");
    std::fs::write(&job, GOOD_JOB).unwrap();
    let taken = dir.path().to_str().unwrap();
    let out = trainer(&["run", job.to_str().unwrap(), "--run-dir", taken], &[]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("already exists; name a new one"));
}

#[test]
fn missing_job_argument_is_a_usage_error() {
    let out = trainer(&["run"], &[]);
    assert_eq!(out.status.code(), Some(2));
    let out = trainer(&["run", "no/such/job.toml"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("cannot read job file no/such/job.toml"));
}

#[test]
fn image_layers_on_flat_input_say_how_to_shape_it() {
    let job = GOOD_JOB.replace(
        r#"layers = [{ type = "flatten" }, { type = "linear", out = 10 }]"#,
        r#"layers = [{ type = "flatten" }, { type = "conv2d", out = 4, kernel_size = 3 }, { type = "flatten" }, { type = "linear", out = 10 }]"#,
    );
    expect_failure(
        &job,
        &[],
        &[],
        2,
        &["model.layers[1] (conv2d)", "[64]", "model.input_shape"],
    );
}

#[test]
fn a_kernel_larger_than_the_image_is_refused() {
    let job = GOOD_JOB.replace(
        r#"layers = [{ type = "flatten" }, { type = "linear", out = 10 }]"#,
        r#"layers = [{ type = "conv2d", out = 4, kernel_size = 9 }, { type = "flatten" }, { type = "linear", out = 10 }]"#,
    );
    expect_failure(
        &job,
        &[],
        &[],
        2,
        &[
            "model.layers[0] (conv2d)",
            "9x9 kernel",
            "does not fit the 8x8 input",
        ],
    );
}

#[test]
fn conv_groups_must_divide_the_channels() {
    let job = GOOD_JOB.replace(
        r#"layers = [{ type = "flatten" }, { type = "linear", out = 10 }]"#,
        r#"layers = [{ type = "conv2d", out = 4, kernel_size = 3, groups = 3 }, { type = "flatten" }, { type = "linear", out = 10 }]"#,
    );
    expect_failure(&job, &[], &[], 2, &["groups = 3 must divide"]);
}

#[test]
fn a_bad_value_inside_a_layer_names_its_key_and_what_is_allowed() {
    let layers = r#"layers = [{ type = "flatten" }, { type = "linear", out = 10 }]"#;
    for (layer, needles) in [
        (
            r#"{ type = "conv2d", out = 4, kernel_size = "3" }"#,
            &[
                "bad.toml:5:",
                "key `model.layers[0].kernel_size`",
                "\"3\" given; expected a size: a number, or [height, width]",
            ][..],
        ),
        (
            r#"{ type = "conv2d", out = -4, kernel_size = 3 }"#,
            &[
                "key `model.layers[0].out`",
                "integer `-4`, expected a whole number, not negative",
            ],
        ),
        (
            r#"{ type = "reshape", shape = [1, "8", 8] }"#,
            &["key `model.layers[0].shape[1]`", "expected a whole number"],
        ),
        (
            r#"{ type = "conv2d", name = 4, out = 4, kernel_size = 3 }"#,
            &["key `model.layers[0].name`", "expected a string"],
        ),
    ] {
        let job = GOOD_JOB.replace(
            layers,
            &format!("layers = [{layer}, {{ type = \"flatten\" }}]"),
        );
        expect_failure(&job, &[], &[], 2, needles);
    }
    // The same through --set, and a setting outside the layers that takes several forms.
    let set = ["--set", "model.layers[1].kernel_size=[1, 2, 3]"];
    let conv = r#"layers = [{ type = "flatten" }, { type = "conv2d", out = 4, kernel_size = 3 }]"#;
    expect_failure(
        &GOOD_JOB.replace(layers, conv),
        &[],
        &set,
        2,
        &[
            "--set model.layers[1].kernel_size: key `model.layers[1].kernel_size`",
            "[1, 2, 3] given; expected a size",
        ],
    );
    expect_failure(
        &format!("{GOOD_JOB}[checkpoint]\nactivations = 3\n"),
        &[],
        &[],
        2,
        &[
            "checkpoint.activations",
            "3 given; expected \"none\", \"all\" or { segments = N }",
        ],
    );
}

#[test]
fn sizes_beyond_what_the_engine_can_hold_are_refused_not_crashed_on() {
    let layers = r#"layers = [{ type = "flatten" }, { type = "linear", out = 10 }]"#;
    let with_layers = |l: &str| GOOD_JOB.replace(layers, &format!("layers = [{l}]"));
    let with_data =
        |d: &str| GOOD_JOB.replace("source = \"digits\"", &format!("source = \"digits\"\n{d}"));
    for (job, needles) in [
        (
            with_layers(r#"{ type = "flatten" }, { type = "linear", out = 4611686018427387904 }"#),
            &[
                "model.layers[1].out",
                "4611686018427387904 given",
                "at most 2147483647",
            ][..],
        ),
        (
            with_layers(
                r#"{ type = "flatten" }, { type = "linear", out = 1000000000 }, { type = "linear", out = 10 }"#,
            ),
            &[
                "model.layers[2] (linear)",
                "parameters; at most 68719476736",
            ],
        ),
        (
            with_layers(
                r#"{ type = "conv2d", out = 4, kernel_size = 3, padding = 2000000000 }, { type = "flatten" }, { type = "linear", out = 10 }"#,
            ),
            &[
                "model.layers[0] (conv2d)",
                "unrolled input",
                "at most 4294967296",
            ],
        ),
        // Shapes whose value counts overflow 64 bits.
        (
            with_layers(
                r#"{ type = "reshape", shape = [2147483647, 2147483647, 2147483647] }, { type = "flatten" }, { type = "linear", out = 10 }"#,
            ),
            &["model.layers[0] (reshape)", "cannot hold the 64 values"],
        ),
        (
            GOOD_JOB.replace(
                "[model]",
                "[model]\ninput_shape = [2147483647, 2147483647, 2147483647]",
            ),
            &[
                "model.input_shape",
                "9903520300447984150353281023 values per sample",
            ],
        ),
        (
            with_data("batch_size = 4611686018427387904"),
            &["data.batch_size", "must be at most 16777216"],
        ),
        (
            GOOD_JOB.replace("epochs = 1", "epochs = 1\nthreads = 100000"),
            &["train.threads", "at most 1024"],
        ),
    ] {
        expect_failure(&job, &[], &[], 2, needles);
    }
}

#[test]
fn a_job_larger_than_the_machine_is_refused_before_it_starts() {
    // A layer of 2·10^8 outputs: its 1.28·10^10 weights alone are 51 GB.
    let job = GOOD_JOB.replace(
        r#"{ type = "linear", out = 10 }"#,
        r#"{ type = "linear", out = 200000000 }, { type = "linear", out = 10 }"#,
    );
    expect_failure(
        &job,
        &[],
        &[],
        1,
        &["not enough memory", "`trainer check` shows"],
    );
    // check prints where the memory goes, and refuses the job as run does: a script can
    // gate on its exit code.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.toml");
    std::fs::write(&path, &job).unwrap();
    let out = trainer(&["check", path.to_str().unwrap()], &[]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stdout(&out).contains("`trainer run` would refuse it here"));
    assert!(
        stderr(&out).contains("not enough memory"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_run_name_cannot_reach_outside_the_runs_directory() {
    for name in ["../escaped", "a/b", "", ".hidden"] {
        let job = format!("[job]\nname = {name:?}\n{GOOD_JOB}");
        expect_failure(&job, &[], &[], 2, &["job.name", "a name is one directory"]);
        expect_failure(
            GOOD_JOB,
            &[],
            &["--name", name],
            2,
            &["--name", "one directory"],
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let runs = dir.path().join("runs");
    let out = trainer(
        &[
            "sweep",
            "jobs/mlp.toml",
            "--grid",
            "optimizer.lr=0.1,0.2",
            "--name",
            "../x",
            "--runs-dir",
            runs.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--name: \"../x\" given"));
    assert!(!runs.exists() && !dir.path().join("x").exists());
}

/// Sequences of 6 token ids from a vocabulary of 20; the class is which of the tokens 3, 7
/// and 11 the sequence holds (exactly one of them, at a random place).
fn token_csv() -> Vec<u8> {
    let mut rng = trainer::tensor::rng::Rng::new(5);
    let mut text = String::from("t0,t1,t2,t3,t4,t5,label\n");
    for _ in 0..600 {
        let label = rng.below(3);
        let mut ids: Vec<usize> = (0..6)
            .map(|_| loop {
                let t = rng.below(20);
                if ![3, 7, 11].contains(&t) {
                    break t;
                }
            })
            .collect();
        ids[rng.below(6)] = [3, 7, 11][label];
        let row: Vec<String> = ids.iter().map(|t| t.to_string()).collect();
        text += &format!("{},{label}\n", row.join(","));
    }
    text.into_bytes()
}

const TOKEN_JOB: &str = r#"
[data]
source = "csv"
path = "tokens.csv"
classes = 3
normalize = "none"
val_fraction = 0.2
[model]
layers = [
  { type = "embedding", num_embeddings = 20, embedding_dim = 8, name = "tokens" },
  { type = "flatten" }, { type = "linear", out = 32 }, { type = "relu" }, { type = "linear", out = 3 },
]
[optimizer]
type = "adam"
lr = 1e-2
[train]
epochs = 15
"#;

#[test]
fn an_embedding_learns_from_token_ids() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokens.csv"), token_csv()).unwrap();
    let job = dir.path().join("tokens.toml");
    std::fs::write(&job, TOKEN_JOB).unwrap();
    let runs = dir.path().join("runs");
    let out = trainer(
        &[
            "run",
            job.to_str().unwrap(),
            "--runs-dir",
            runs.to_str().unwrap(),
            "-q",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let run = String::from_utf8(out.stdout).unwrap();
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(Path::new(run.trim()).join("summary.json")).unwrap(),
    )
    .unwrap();
    let accuracy = summary["final"]["val_accuracy"].as_f64().unwrap();
    assert!(accuracy > 0.9, "val accuracy {accuracy} (chance: 1/3)");
}

#[test]
fn token_ids_outside_the_vocabulary_or_normalised_are_refused() {
    let small = TOKEN_JOB.replace("num_embeddings = 20", "num_embeddings = 10");
    expect_failure(
        &small,
        &[("tokens.csv", &token_csv())],
        &[],
        2,
        &[
            "model.layers[0] (embedding)",
            "token ids must be whole numbers in [0, 10)",
            "tokens.csv: line ",
        ],
    );
    // The sample is named by its line in the file, whichever split (val_fraction) holds it.
    let mut lines = String::from("t0,t1,t2,t3,t4,t5,label\n");
    for i in 0..40 {
        let id = if i == 30 { 25 } else { i % 20 };
        lines += &format!("1,2,3,4,{id},5,{}\n", i % 3);
    }
    expect_failure(
        TOKEN_JOB,
        &[("tokens.csv", lines.as_bytes())],
        &[],
        2,
        &["data holds 25 (", "tokens.csv: line 32, feature 4)"],
    );
    let normalised = TOKEN_JOB.replace("normalize = \"none\"", "");
    expect_failure(
        &normalised,
        &[("tokens.csv", &token_csv())],
        &[],
        2,
        &["(embedding)", "data.normalize = \"none\""],
    );
    let not_data = TOKEN_JOB.replace(
        "{ type = \"embedding\", num_embeddings = 20, embedding_dim = 8, name = \"tokens\" },",
        "{ type = \"tanh\" }, { type = \"embedding\", num_embeddings = 20, embedding_dim = 8 },",
    );
    expect_failure(
        &not_data,
        &[("tokens.csv", &token_csv())],
        &[],
        2,
        &["model.layers[1] (embedding): it reads token ids, which only the data holds"],
    );
}

/// A batch larger than the data set is the whole set, once per epoch (as PyTorch's
/// DataLoader gives it): the buffers and the memory plan hold the samples there are, not the
/// batch asked for (it was refused for memory it would never use).
#[test]
fn a_batch_larger_than_the_data_set_plans_and_holds_the_data_set() {
    let tmp = tempfile::tempdir().unwrap();
    let planned = |batch: &str| {
        let job = common::write_job(
            tmp.path(),
            &GOOD_JOB.replace(
                "source = \"digits\"",
                &format!("source = \"digits\"\nbatch_size = {batch}"),
            ),
        );
        let out = trainer(&["check", job.to_str().unwrap()], &[]);
        assert!(out.status.success(), "{}", stderr(&out));
        let text = stdout(&out);
        let total = text.lines().find(|l| l.starts_with("  total "));
        (total.unwrap().to_string(), job)
    };
    // The digits: 1,797 samples, all for training (no val_fraction), all of them one batch.
    let (whole, _) = planned("1797");
    let (huge, job) = planned("16777216");
    assert_eq!(huge, whole);
    let runs = tmp.path().join("runs");
    let run = |extra: &[&str]| {
        let args = [
            "run",
            job.to_str().unwrap(),
            "--runs-dir",
            runs.to_str().unwrap(),
            "-q",
        ];
        let out = trainer(&[&args[..], extra].concat(), &[]);
        assert!(out.status.success(), "{extra:?}: {}", stderr(&out));
    };
    run(&[]);
    // Replicas' shares of an odd split (899 + 898 samples), micro-batches accumulated.
    run(&[
        "--set",
        "parallel.replicas=2",
        "--set",
        "train.grad_accum_steps=2",
    ]);
}

/// The run directory is printed at the start, where a reader that has gone (`| head -c0`, a
/// script that stopped reading) must not end the run; nor `trainer ls` into such a pipe.
#[test]
fn a_closed_stdout_stops_neither_a_run_nor_a_listing() {
    let tmp = tempfile::tempdir().unwrap();
    let job = common::write_job(tmp.path(), GOOD_JOB);
    let runs = tmp.path().join("runs");
    let with_reader_gone = |args: &[&str]| {
        let mut child = std::process::Command::new(common::trainer_bin())
            .args(args)
            .current_dir(root())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take()); // long before the run's first line
        child.wait_with_output().unwrap()
    };
    let runs_arg = runs.to_str().unwrap();
    let ran = with_reader_gone(&["run", job.to_str().unwrap(), "--runs-dir", runs_arg]);
    assert_eq!(ran.status.code(), Some(0), "{}", stderr(&ran));
    let dirs: Vec<_> = std::fs::read_dir(runs.join("job")) // runs/<job name>/<run id>
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    let [dir] = &dirs[..] else {
        panic!("one run directory: {dirs:?}")
    };
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["status"], "completed");
    let listed = with_reader_gone(&["ls", runs_arg]);
    assert_eq!(listed.status.code(), Some(0), "{}", stderr(&listed));
    // Nor `check` or `completions` (a panic, exit 101, before).
    let checked = with_reader_gone(&["check", job.to_str().unwrap()]);
    assert_eq!(checked.status.code(), Some(0), "{}", stderr(&checked));
    let completions = with_reader_gone(&["completions", "bash"]);
    assert_eq!(
        completions.status.code(),
        Some(0),
        "{}",
        stderr(&completions)
    );
}

/// A full stdout is an error for the commands whose output it is (exit 1, said), and a
/// warning naming the directory for a run, which goes on.
#[test]
fn a_full_stdout_is_said_not_a_panic() {
    let tmp = tempfile::tempdir().unwrap();
    let job = common::write_job(tmp.path(), GOOD_JOB);
    let full = || {
        std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap()
    };
    let with_full_stdout = |args: &[&str]| {
        std::process::Command::new(common::trainer_bin())
            .args(args)
            .current_dir(root())
            .stdout(full())
            .output()
            .unwrap()
    };
    let checked = with_full_stdout(&["check", job.to_str().unwrap()]);
    assert_eq!(checked.status.code(), Some(1), "{}", stderr(&checked));
    assert!(
        stderr(&checked).contains("cannot write to stdout"),
        "{}",
        stderr(&checked)
    );
    let runs = tmp.path().join("runs");
    let ran = with_full_stdout(&[
        "run",
        job.to_str().unwrap(),
        "--runs-dir",
        runs.to_str().unwrap(),
    ]);
    assert_eq!(ran.status.code(), Some(0), "{}", stderr(&ran));
    assert!(
        stderr(&ran).contains("cannot print the run directory on stdout"),
        "{}",
        stderr(&ran)
    );
}

/// A path that is not UTF-8 is a path like any other: the run trains, and prints its
/// directory as its bytes (the provenance's command line panicked on it).
#[test]
fn a_runs_dir_that_is_not_utf8_is_printed_as_its_bytes() {
    use std::os::unix::ffi::{OsStrExt, OsStringExt};
    let tmp = tempfile::tempdir().unwrap();
    let job = common::write_job(tmp.path(), GOOD_JOB);
    let mut runs = tmp.path().as_os_str().as_bytes().to_vec();
    runs.extend(b"/runs\xfe");
    let runs = PathBuf::from(std::ffi::OsString::from_vec(runs));
    let out = std::process::Command::new(common::trainer_bin())
        .arg("run")
        .arg(&job)
        .arg("--runs-dir")
        .arg(&runs)
        .current_dir(root())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let printed = PathBuf::from(std::ffi::OsString::from_vec(
        out.stdout.strip_suffix(b"\n").unwrap().to_vec(),
    ));
    assert!(printed.starts_with(&runs), "{printed:?}");
    assert!(printed.join("summary.json").is_file());
}

/// Every unknown key of a job file is named in one error, each at its line, and keys that
/// belong in another section (or that other tools name otherwise) say where.
#[test]
fn every_unknown_key_is_named_at_once_with_where_it_belongs() {
    let job = r#"learning_rate = 0.1
[data]
source = "digits"
val_split = 0.2
target = "y"
[model]
layers = [{ type = "flatten" }, { type = "linear", out = 10 }]
[optimizer]
type = "adam"
learning_rate = 1e-3
[train]
epoch = 3
batch_size = 32
"#;
    common::expect_error(
        job,
        &["check", "JOB"],
        2,
        &[
            "job.toml:1:1: key `learning_rate`: unknown field `learning_rate`",
            "(did you mean `optimizer.lr`?)\n",
            "job.toml:4:1: key `data.val_split`:",
            "(did you mean `data.val_fraction`?)\n",
            "job.toml:5:1: key `data.target`:",
            "(did you mean `data.label`?)\n",
            "job.toml:10:1: key `optimizer.learning_rate`:",
            "job.toml:12:1: key `train.epoch`:",
            "(did you mean `train.epochs`?)\n",
            "job.toml:13:1: key `train.batch_size`:",
            "(did you mean `data.batch_size`?)",
        ],
    );
    common::expect_error(
        common::TINY_JOB,
        &["check", "JOB", "--set", "val_split=0.1"],
        2,
        &[
            "--set val_split: key `val_split`: unknown key",
            "(did you mean `data.val_fraction`?)",
        ],
    );
}
