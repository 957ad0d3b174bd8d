//! Training checkpoints end to end, through the real binary: a run killed with SIGKILL (or
//! stopped by SIGINT / SIGTERM) and resumed gives the same metrics rows (timing columns
//! aside) and bit-identical final weights as the run that was never stopped; resuming from
//! any checkpoint does too; keep_last / keep_best / resume = "auto"; and the bad inputs:
//! corrupt or truncated checkpoints, changed jobs, paths that do not exist.

use crate::common;

use common::{stderr, trainer};

use common::{root, trainer_bin};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

fn run_dir(o: &Output) -> PathBuf {
    assert!(o.status.success(), "{}", stderr(o));
    PathBuf::from(String::from_utf8(o.stdout.clone()).unwrap().trim())
}

/// Every number in metrics.csv but the timing columns (samples_per_sec, elapsed_s).
fn metrics(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("metrics.csv"))
        .unwrap()
        .lines()
        .map(|l| l.split(',').take(7).collect::<Vec<_>>().join(","))
        .collect()
}

fn weights(dir: &Path) -> Vec<u8> {
    std::fs::read(dir.join("model.safetensors")).unwrap()
}

fn checkpoints(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir.join("checkpoints"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

fn summary(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap()
}

/// Long enough (846 steps) that a kill lands mid-run, and exercising everything the
/// resumed state must carry: shuffling, a validation split, dropout, gradient accumulation,
/// clipping, AdamW, warm-up and cosine schedule, log rows that do not fall on checkpoint
/// steps, and checkpoints both mid-epoch and at epoch ends.
const LONG_JOB: &str = r#"
[job]
name = "long"
seed = 3
[data]
source = "synthetic"
samples = 20000
num_features = 64
classes = 10
noise = 3.0
batch_size = 32
val_fraction = 0.1
[model]
layers = [
  { type = "linear", out = 384 }, { type = "relu" }, { type = "dropout", p = 0.2 },
  { type = "linear", out = 256 }, { type = "gelu" }, { type = "linear", out = 10 },
]
[optimizer]
type = "adamw"
lr = 1e-3
schedule = { type = "cosine", warmup_steps = 30 }
[train]
epochs = 3
grad_accum_steps = 2
clip_grad_norm = 1.0
log_every = 7
[checkpoint]
every_steps = 25
every_epochs = 1
"#;

struct Job {
    _dir: tempfile::TempDir,
    path: PathBuf,
    runs: PathBuf,
}

fn write_job(text: &str) -> Job {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("job.toml");
    std::fs::write(&path, text).unwrap();
    let runs = dir.path().join("runs");
    Job {
        _dir: dir,
        path,
        runs,
    }
}

impl Job {
    fn args<'a>(&'a self, extra: &[&'a str]) -> Vec<&'a str> {
        let mut args = vec![
            "run",
            self.path.to_str().unwrap(),
            "--runs-dir",
            self.runs.to_str().unwrap(),
            "--quiet",
        ];
        args.extend_from_slice(extra);
        args
    }
    fn run(&self, extra: &[&str]) -> Output {
        trainer(&self.args(extra))
    }
}

/// The uninterrupted run of LONG_JOB, shared by the tests of this file.
struct Reference {
    job: Job,
    dir: PathBuf,
    metrics: Vec<String>,
    weights: Vec<u8>,
}

fn reference() -> &'static Reference {
    static REFERENCE: OnceLock<Reference> = OnceLock::new();
    REFERENCE.get_or_init(|| {
        let job = write_job(LONG_JOB);
        let dir = run_dir(&job.run(&[]));
        Reference {
            metrics: metrics(&dir),
            weights: weights(&dir),
            dir,
            job,
        }
    })
}

fn assert_same_as_reference(dir: &Path) {
    let r = reference();
    let (got, want) = (metrics(dir), &r.metrics);
    assert_eq!(
        got.len(),
        want.len(),
        "metrics rows: {} vs {}",
        got.len(),
        want.len()
    );
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert_eq!(a, b, "metrics.csv line {}", i + 1);
    }
    assert!(weights(dir) == r.weights, "final weights differ");
    assert_eq!(summary(dir)["status"], "completed");
}

/// LONG_JOB training in the background.
/// LONG_JOB started in the background; its stderr goes to `stderr_of(job)` (a pipe nobody
/// reads until it ends would fill and stop it).
fn start(job: &Job) -> std::process::Child {
    let stderr = std::fs::File::create(stderr_of(job)).unwrap();
    Command::new(trainer_bin())
        .args(job.args(&[]))
        .current_dir(root())
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .unwrap()
}

fn stderr_of(job: &Job) -> PathBuf {
    job.path.with_file_name("stderr.log")
}

/// Starts LONG_JOB, waits until its checkpoint for `step` exists, then sends `signal`
/// (`count` times). Returns the exit status and the run directory, which the run printed.
fn start_then_signal(
    job: &Job,
    step: u64,
    signal: i32,
    count: usize,
) -> (std::process::ExitStatus, PathBuf) {
    let mut child = start(job);
    let dir = wait_for_checkpoint(job, &mut child, step);
    // SAFETY: plain kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as i32, signal) };
    if count > 1 {
        // Signals sent back to back can merge into one pending signal, and on a busy machine
        // the child may not run between two sends. So the "second" signal is repeated every
        // millisecond until the child is gone: one of them lands while the stop the first
        // asked for (finish the step, fsync a checkpoint, write the summary) is under way.
        let deadline = Instant::now() + Duration::from_secs(10);
        while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
            // SAFETY: as above; the child has not been reaped yet, so its pid is still ours.
            unsafe { libc::kill(child.id() as i32, signal) };
        }
    }
    let ended = child.wait_with_output().unwrap();
    // The run directory is on stdout from the start, for a script to resume it from.
    assert_eq!(
        String::from_utf8_lossy(&ended.stdout).trim(),
        dir.to_str().unwrap()
    );
    (ended.status, dir)
}

/// The run directory of LONG_JOB's `child`, once its checkpoint for `step` exists.
fn wait_for_checkpoint(job: &Job, child: &mut std::process::Child, step: u64) -> PathBuf {
    let wanted = format!("step-{step:08}.safetensors");
    let deadline = Instant::now() + Duration::from_secs(120);
    let dir = loop {
        let found = std::fs::read_dir(job.runs.join("long"))
            .ok()
            .and_then(|mut d| d.next())
            .and_then(|e| e.ok())
            .map(|e| e.path())
            .filter(|d| d.join("checkpoints").join(&wanted).exists());
        if let Some(dir) = found {
            break dir;
        }
        assert!(Instant::now() < deadline, "no {wanted} after 120 s");
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before {wanted}"
        );
        std::thread::sleep(Duration::from_millis(1));
    };
    dir
}

/// A run being trained is not resumed by a second process at the same time (the two
/// interleaved their rows and checkpoints, and the one that failed marked the live run
/// failed); once it has ended, the resume goes ahead.
#[test]
fn a_run_in_training_is_not_resumed_by_a_second_process() {
    let job = write_job(LONG_JOB);
    let mut child = start(&job);
    let dir = wait_for_checkpoint(&job, &mut child, 25);
    let out = job.run(&["--resume", dir.to_str().unwrap()]);
    let still_running = child.try_wait().unwrap().is_none();
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        still_running,
        "the first run ended before the second was refused"
    );
    expect_exit_2(&out, &["is being trained by another process (pid"]);
    run_dir(&job.run(&["--resume", dir.to_str().unwrap()]));
    assert_eq!(summary(&dir)["status"], "completed");
}

/// The run's lock is taken before a checkpoint is chosen: a process still training the run
/// (a stopped rank 0 still writing its last checkpoint) is named, and the resume does not
/// go on from the checkpoints there were before that one. Here every checkpoint is cut
/// short, as one being written is; the resume must not get as far as reading them.
#[test]
fn a_resume_waits_for_no_checkpoint_of_a_run_another_process_holds() {
    let job = write_job(SMALL_JOB);
    let dir = crashed_small_run(&job);
    for name in checkpoints(&dir) {
        let path = dir.join("checkpoints").join(name);
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    }
    let lock = std::fs::File::open(dir.join(".lock")).unwrap();
    lock.try_lock().unwrap();
    let out = job.run(&["--resume", dir.to_str().unwrap()]);
    expect_exit_2(&out, &["is being trained by another process"]);
    assert!(!stderr(&out).contains("truncated"), "{}", stderr(&out));
    drop(lock);
    let out = job.run(&["--resume", dir.to_str().unwrap()]);
    expect_exit_2(&out, &["truncated"]);
}

#[test]
fn sigkill_then_resume_gives_the_uninterrupted_run_exactly() {
    use std::os::unix::process::ExitStatusExt;
    let job = write_job(LONG_JOB);
    let (status, dir) = start_then_signal(&job, 100, libc::SIGKILL, 1);
    assert_eq!(status.signal(), Some(libc::SIGKILL));
    assert!(
        !dir.join("summary.json").exists(),
        "the run finished before the kill: make LONG_JOB longer"
    );
    let out = job.run(&["--resume", dir.to_str().unwrap()]);
    assert_eq!(
        run_dir(&out),
        dir,
        "a resumed run continues in its directory"
    );
    assert_same_as_reference(&dir);
}

#[test]
fn sigint_and_sigterm_checkpoint_the_current_step_and_exit_130_and_143() {
    for (signal, code) in [(libc::SIGINT, 130), (libc::SIGTERM, 143)] {
        let job = write_job(LONG_JOB);
        let (status, dir) = start_then_signal(&job, 50, signal, 1);
        assert_eq!(status.code(), Some(code));
        let s = summary(&dir);
        assert_eq!(s["status"], "interrupted");
        assert_eq!(s["end_reason"], "interrupted", "as every summary has one");
        assert_eq!(s["signal"], signal);
        let steps = s["steps"].as_u64().unwrap();
        assert!(steps >= 50);
        let newest = checkpoints(&dir).pop().unwrap();
        assert_eq!(newest, format!("step-{steps:08}.safetensors"));
        run_dir(&job.run(&["--resume", dir.to_str().unwrap()]));
        assert_same_as_reference(&dir);
    }
}

#[test]
fn a_second_sigint_stops_at_once_and_leaves_a_resumable_run() {
    let job = write_job(LONG_JOB);
    let (status, dir) = start_then_signal(&job, 75, libc::SIGINT, 2);
    assert_eq!(status.code(), Some(130));
    // It did not wait for the graceful stop, which ends by writing summary.json; on a
    // loaded machine that stop may finish before a second signal lands (1 run in 4 with
    // three other runs beside it): then it is the ordinary interrupted run.
    if dir.join("summary.json").exists() {
        assert_eq!(summary(&dir)["status"], "interrupted");
    } else {
        let err = std::fs::read_to_string(stderr_of(&job)).unwrap();
        assert!(
            err.contains("error: a second SIGINT: stopped at once; what came after the newest"),
            "{err}"
        );
    }
    run_dir(&job.run(&["--resume", dir.to_str().unwrap()]));
    assert_same_as_reference(&dir);
}

/// A copy of the reference run as a crash right after `checkpoint` would have left it:
/// later checkpoints gone, no summary or final weights, metrics.csv with the rows written
/// after the checkpoint still in it.
fn crashed_copy(checkpoint: &str) -> (tempfile::TempDir, PathBuf) {
    let r = reference();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    std::fs::create_dir_all(dir.join("checkpoints")).unwrap();
    for name in ["metrics.csv", "config.toml", "train.log"] {
        std::fs::copy(r.dir.join(name), dir.join(name)).unwrap();
    }
    let mut found = false;
    for name in checkpoints(&r.dir) {
        if name.as_str() <= checkpoint {
            found |= name == checkpoint;
            let from = r.dir.join("checkpoints").join(&name);
            std::fs::copy(from, dir.join("checkpoints").join(&name)).unwrap();
        }
    }
    assert!(found, "the reference run has no {checkpoint}");
    (tmp, dir)
}

#[test]
fn resuming_from_any_checkpoint_gives_the_same_run() {
    let r = reference();
    // 563 training batches per epoch in steps of 2: 282 steps per epoch, 846 in all.
    assert!(checkpoints(&r.dir).contains(&"step-00000282.safetensors".to_string()));
    // Mid-epoch; at an epoch's end (written after its evaluation); the run's last step, a
    // crash while it wrote its weights.
    for name in [
        "step-00000550.safetensors",
        "step-00000564.safetensors",
        "step-00000846.safetensors",
    ] {
        let (_tmp, dir) = crashed_copy(name);
        std::fs::remove_file(dir.join("summary.json")).ok();
        let checkpoint = dir.join("checkpoints").join(name);
        // The final checkpoint too: that run stopped while writing its weights and summary,
        // which the resume writes, training nothing.
        run_dir(&r.job.run(&["--resume", checkpoint.to_str().unwrap()]));
        assert_same_as_reference(&dir);
        // The resumed session's own start-up (it was 0: only a run's step 0 measured it);
        // none when it only finished the run.
        match summary(&dir)["startup_s"].as_f64() {
            Some(startup) => assert!(startup > 0.0 && startup < 30.0, "{startup}"),
            None => assert!(name.ends_with("846.safetensors"), "{name}"),
        }
    }
}

/// The bundled digits: a run of a fraction of a second, for the bad inputs.
const SMALL_JOB: &str = r#"
[job]
name = "small"
[data]
source = "digits"
val_fraction = 0.2
[model]
layers = [{ type = "flatten" }, { type = "linear", out = 32 }, { type = "relu" }, { type = "linear", out = 10 }]
[optimizer]
type = "adam"
lr = 1e-3
[train]
epochs = 4
[checkpoint]
every_steps = 10
"#;

/// A small run whose final checkpoint was lost, as a crash would leave it.
fn crashed_small_run(job: &Job) -> PathBuf {
    let dir = run_dir(&job.run(&[]));
    std::fs::remove_file(dir.join("summary.json")).unwrap();
    let newest = checkpoints(&dir).pop().unwrap();
    std::fs::remove_file(dir.join("checkpoints").join(newest)).unwrap();
    dir
}

fn expect_exit_2(out: &Output, needles: &[&str]) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    for n in needles {
        assert!(err.contains(n), "message lacks {n:?}:\n{err}");
    }
}

#[test]
fn corrupt_checkpoint_is_refused_by_name_and_fallback_uses_the_previous_one() {
    let job = write_job(SMALL_JOB);
    let dir = crashed_small_run(&job);
    let names = checkpoints(&dir);
    let newest = dir.join("checkpoints").join(names.last().unwrap());
    let mut bytes = std::fs::read(&newest).unwrap();
    let last = bytes.len() - 5;
    bytes[last] ^= 0x40; // one bit in the tensor data
    std::fs::write(&newest, &bytes).unwrap();
    let out = job.run(&["--resume", dir.to_str().unwrap()]);
    expect_exit_2(
        &out,
        &[
            names.last().unwrap(),
            "checksum mismatch",
            "--resume-fallback",
        ],
    );

    let out = job.run(&["--resume", dir.to_str().unwrap(), "--resume-fallback"]);
    assert_eq!(run_dir(&out), dir);
    assert_eq!(summary(&dir)["status"], "completed");
}

#[test]
fn a_changed_digit_in_the_training_position_is_refused() {
    let job = write_job(SMALL_JOB);
    let dir = crashed_small_run(&job);
    let newest = dir
        .join("checkpoints")
        .join(checkpoints(&dir).pop().unwrap());
    let mut bytes = std::fs::read(&newest).unwrap();
    // The state is JSON inside the header's JSON: `\"step\":30`. Another digit still
    // parses, and would resume at the wrong step without the metadata checksum.
    let key = br#"\"step\":"#;
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    assert!(bytes[at].is_ascii_digit());
    bytes[at] = if bytes[at] == b'9' {
        b'8'
    } else {
        bytes[at] + 1
    };
    std::fs::write(&newest, &bytes).unwrap();
    let out = job.run(&["--resume", newest.to_str().unwrap()]);
    expect_exit_2(
        &out,
        &[newest.to_str().unwrap(), "metadata checksum mismatch"],
    );
}

#[test]
fn truncated_checkpoint_is_refused_by_name() {
    let job = write_job(SMALL_JOB);
    let dir = crashed_small_run(&job);
    let newest = dir
        .join("checkpoints")
        .join(checkpoints(&dir).pop().unwrap());
    let bytes = std::fs::read(&newest).unwrap();
    std::fs::write(&newest, &bytes[..bytes.len() / 2]).unwrap();
    let out = job.run(&["--resume", newest.to_str().unwrap()]);
    expect_exit_2(&out, &[newest.to_str().unwrap(), "truncated"]);
}

#[test]
fn resuming_a_changed_model_is_refused_naming_the_keys_unless_forced() {
    let job = write_job(SMALL_JOB);
    let dir = crashed_small_run(&job);
    let d = dir.to_str().unwrap();
    let changed = [
        "--set",
        "model.layers[1].out=64",
        "--set",
        "optimizer.lr=0.01",
    ];
    let out = job.run(&[&["--resume", d][..], &changed].concat());
    expect_exit_2(
        &out,
        &[
            "model.layers[1].out: 32 in the checkpoint, 64 now",
            "optimizer.lr: 0.001 in the checkpoint, 0.01 now",
            "only train.epochs, train.max_steps, train.max_time, train.early_stopping, \
             train.log_every, train.eval_every_epochs, train.evaluate_test, checkpoint.*, \
             job.name, train.threads, device.*, parallel.*, model.init_from may change",
            "--force",
        ],
    );
    // --force cannot make 64 hidden units out of 32.
    let out = job.run(&[&["--resume", d, "--force"][..], &changed].concat());
    expect_exit_2(&out, &["parameter values, the job's model needs"]);
    // A changed learning rate can be forced.
    let out = job.run(&["--resume", d, "--force", "--set", "optimizer.lr=0.01"]);
    assert_eq!(run_dir(&out), dir);
}

/// Nor can it read a tensor in another shape of as many values: 3x3 kernels as 1x9 ones.
#[test]
fn a_forced_resume_refuses_a_parameter_of_the_same_size_in_another_shape() {
    let conv = SMALL_JOB.replace(
        "layers = [{ type = \"flatten\" }, { type = \"linear\", out = 32 },",
        "layers = [{ type = \"conv2d\", out = 4, kernel_size = 3, padding = 1 }, \
         { type = \"flatten\" }, { type = \"linear\", out = 32 },",
    );
    assert_ne!(conv, SMALL_JOB);
    let job = write_job(&conv);
    let dir = crashed_small_run(&job);
    let reshaped = [
        "--set",
        "model.layers[0].kernel_size=[1, 9]",
        "--set",
        "model.layers[0].padding=[0, 4]",
    ];
    let out = job.run(
        &[
            &["--resume", dir.to_str().unwrap(), "--force"][..],
            &reshaped,
        ]
        .concat(),
    );
    expect_exit_2(
        &out,
        &[
            "even with --force: 0.weight [4, 1, 3, 3] in the checkpoint is 0.weight [4, 1, 1, 9] now",
        ],
    );
    assert!(!stderr(&out).contains("WARN --force: resuming"));
}

#[test]
fn safe_changes_are_allowed_and_a_finished_run_can_train_further() {
    let job = write_job(SMALL_JOB);
    let dir = run_dir(&job.run(&[]));
    let steps = summary(&dir)["steps"].as_u64().unwrap();
    // Finished, and nothing more asked for.
    let out = job.run(&["--resume", dir.to_str().unwrap()]);
    expect_exit_2(&out, &["raise train.epochs or train.max_steps"]);
    // More epochs, other log interval, checkpoint settings, a time budget: allowed.
    let out = job.run(&[
        "--resume",
        dir.to_str().unwrap(),
        "--set",
        "train.epochs=6",
        "--set",
        "train.log_every=5",
        "--set",
        "checkpoint.keep_last=2",
        "--set",
        "train.max_time=\"1h\"",
    ]);
    assert_eq!(run_dir(&out), dir);
    let s = summary(&dir);
    assert_eq!(s["steps"].as_u64().unwrap(), steps / 4 * 6);
    assert_eq!(s["epochs"], 6);
    // No step appears twice in the train rows.
    let rows = metrics(&dir);
    let train: Vec<&String> = rows.iter().filter(|r| r.contains(",train,")).collect();
    let mut seen: Vec<&str> = train.iter().map(|r| r.split(',').next().unwrap()).collect();
    let n = seen.len();
    seen.dedup();
    assert_eq!(seen.len(), n);
}

/// A finished run whose metrics.csv lost rows (or the whole file) cannot be continued: the
/// resume is refused with exit 2 before anything in the run directory is touched, so the run
/// still reads as it was (its summary.json, config.toml and provenance.json unchanged).
#[test]
fn a_resume_whose_metrics_lost_rows_is_refused_leaving_the_run_as_it_was() {
    let job = write_job(SMALL_JOB);
    let dir = run_dir(&job.run(&[]));
    let d = dir.to_str().unwrap();
    let files = [
        "summary.json",
        "config.toml",
        "provenance.json",
        "train.log",
    ];
    let read = |dir: &Path| files.map(|f| std::fs::read(dir.join(f)).unwrap());
    let before = read(&dir);
    let metrics_path = dir.join("metrics.csv");
    let text = std::fs::read_to_string(&metrics_path).unwrap();
    let more = ["--resume", d, "--set", "train.epochs=6"];
    let first_rows: String = text.lines().take(3).map(|l| format!("{l}\n")).collect();
    std::fs::write(&metrics_path, &first_rows).unwrap();
    expect_exit_2(
        &job.run(&more),
        &["metrics.csv has 2 rows", "cannot be continued"],
    );
    assert_eq!(read(&dir), before, "the run directory was changed");
    std::fs::remove_file(&metrics_path).unwrap();
    expect_exit_2(&job.run(&more), &["metrics.csv is gone", "--force"]);
    assert_eq!(read(&dir), before, "the run directory was changed");

    // --force goes on after the rows that are there, saying which are missing; the run
    // then resumes as any other (its checkpoints count the rows it has).
    std::fs::write(&metrics_path, &first_rows).unwrap();
    let forced = job.run(&[&more[..], &["--force"]].concat());
    assert!(forced.status.success(), "{}", stderr(&forced));
    let err = stderr(&forced);
    assert!(
        err.contains("metrics.csv has 2 of the") && err.contains("stay missing"),
        "{err}"
    );
    let now = std::fs::read_to_string(&metrics_path).unwrap();
    assert!(
        now.starts_with(&first_rows) && now.lines().count() > 3,
        "{now}"
    );
    let again = job.run(&["--resume", d, "--set", "train.epochs=7"]);
    assert!(again.status.success(), "{}", stderr(&again));
}

/// The folders of `dir/superseded/`, oldest first (two in one second are named alike).
fn superseded(dir: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir.join("superseded"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    found.sort_by_key(|p| std::fs::metadata(p).and_then(|m| m.modified()).unwrap());
    found
}

/// Every file of a run directory that a refused resume must leave as it was.
fn contents(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files = Vec::new();
    for name in [
        "metrics.csv",
        "summary.json",
        "model.safetensors",
        "config.toml",
    ] {
        files.push((
            name.to_string(),
            std::fs::read(dir.join(name)).unwrap_or_default(),
        ));
    }
    for name in checkpoints(dir) {
        files.push((name.clone(), Vec::new()));
    }
    files
}

/// A resume from an earlier checkpoint than the run's newest goes back in the run: refused,
/// naming the later checkpoints, unless --force; then that continuation's checkpoints (and
/// the completed run's results) move to superseded/, so the next resume of the run directory
/// takes this timeline's newest (it took the abandoned one's, by step number).
#[test]
fn a_resume_from_an_earlier_checkpoint_is_refused_unless_forced_and_sets_the_later_aside() {
    let job = write_job(SMALL_JOB);
    let dir = run_dir(&job.run(&[]));
    let d = dir.to_str().unwrap();
    let first = checkpoints(&dir);
    assert!(
        first.contains(&"step-00000090.safetensors".to_string()),
        "{first:?}"
    );
    let early = dir.join("checkpoints/step-00000030.safetensors");
    let back = [
        "--resume",
        early.to_str().unwrap(),
        "--set",
        "train.max_steps=45",
    ];
    let before = contents(&dir);
    expect_exit_2(
        &job.run(&back),
        &[
            "(step 30): the run went further",
            "its completed result: 92 steps (val_accuracy",
            "7 later checkpoint(s), at step 40, 50, 60, 70, 80, 90, 92",
            "continue from the run's newest checkpoint, give the run: trainer run --resume",
            "pass --force",
        ],
    );
    assert_eq!(contents(&dir), before, "a refused resume changed the run");

    let out = job.run(&[&back[..], &["--force"]].concat());
    assert_eq!(run_dir(&out), dir);
    assert!(
        stderr(&out).contains("WARN --force: resuming from step 30"),
        "{}",
        stderr(&out)
    );
    let now: Vec<String> = checkpoints(&dir);
    assert_eq!(now.last().unwrap(), "step-00000045.safetensors", "{now:?}");
    let folders = superseded(&dir);
    assert_eq!(folders.len(), 1, "{folders:?}");
    let aside = &folders[0];
    assert!(
        aside.to_str().unwrap().ends_with("-from-step-30"),
        "{aside:?}"
    );
    assert_eq!(
        checkpoints(aside),
        first
            .iter()
            .filter(|n| n.as_str() > "step-00000030.safetensors")
            .cloned()
            .collect::<Vec<_>>()
    );
    for (name, bytes) in &before[..3] {
        assert_eq!(&std::fs::read(aside.join(name)).unwrap(), bytes, "{name}");
    }
    let out = job.run(&["--resume", d, "--set", "train.max_steps=60"]);
    assert_eq!(run_dir(&out), dir);
    let resumed = summary(&dir)["resumed_from"].as_str().unwrap().to_string();
    assert!(resumed.ends_with("step-00000045.safetensors"), "{resumed}");
    let steps: Vec<u64> = metrics(&dir)
        .iter()
        .filter(|r| r.contains(",train,"))
        .map(|r| r.split(',').next().unwrap().parse().unwrap())
        .collect();
    assert!(
        steps.windows(2).all(|w| w[0] < w[1]),
        "one timeline: {steps:?}"
    );
    // Back to step 30 again: this timeline's 40, 45, 50 and 60 go to a folder of their own.
    run_dir(&job.run(&[
        "--resume",
        early.to_str().unwrap(),
        "--set",
        "train.max_steps=35",
        "--force",
    ]));
    let folders = superseded(&dir);
    assert_eq!(folders.len(), 3, "{folders:?}");
    assert_eq!(
        checkpoints(&folders[2]),
        [
            "step-00000040.safetensors",
            "step-00000045.safetensors",
            "step-00000050.safetensors",
            "step-00000060.safetensors"
        ]
    );
}

/// The issue's reproduction: a completed run whose final state has no checkpoint (the resume
/// that completed it wrote none) is not rolled back to its last checkpoint by a resume
/// asking for another length. With --force it is, and the old results are in superseded/.
#[test]
fn a_completed_run_is_not_rolled_back_to_an_older_checkpoint() {
    let runs = tempfile::tempdir().unwrap();
    let mlp = root().join("jobs/mlp.toml");
    let (mlp, runs_dir) = (mlp.to_str().unwrap(), runs.path().to_str().unwrap());
    let base = ["run", mlp, "--runs-dir", runs_dir, "-q"];
    let first = [&base[..], &["--name", "repro", "--set", "train.epochs=3"]].concat();
    let first = [&first[..], &["--set", "checkpoint.every_epochs=1"]].concat();
    let dir = run_dir(&trainer(&first));
    let d = dir.to_str().unwrap();
    // The job file given again: its 30 epochs and its lack of checkpoints are taken, and
    // named; the three-epoch result it extends moves aside.
    let out = trainer(&[&base[..], &["--resume", d]].concat());
    assert_eq!(run_dir(&out), dir);
    let err = stderr(&out);
    for needle in [
        "differs from the run's own settings",
        "train.epochs: 3 in the run, 30 now",
        "checkpoint.every_epochs: 1 in the run, (not set) now",
        "job.name: \"repro\" in the run, \"mlp\" now",
    ] {
        assert!(err.contains(needle), "lacks {needle:?}:\n{err}");
    }
    assert_eq!(summary(&dir)["steps"], 690);
    let extended = superseded(&dir);
    assert_eq!(extended.len(), 1);
    assert_eq!(summary(&extended[0])["steps"], 69);
    assert_eq!(
        checkpoints(&dir).last().unwrap(),
        "step-00000069.safetensors"
    );

    let before = contents(&dir);
    let shorter = ["--resume", d, "--set", "train.epochs=5"];
    for out in [
        trainer(&[&base[..], &shorter].concat()),
        trainer(&[&["run", "-q"][..], &shorter].concat()),
    ] {
        expect_exit_2(
            &out,
            &[
                "step-00000069.safetensors (step 69): the run went further",
                "its completed result: 690 steps (val_accuracy 0.9861",
                "in summary.json and model.safetensors",
                "metrics.csv row(s) after the checkpoint's, up to step 690",
                "no checkpoint of its final state",
                "--set model.init_from=",
                "pass --force to resume from step 69 anyway",
            ],
        );
        assert_eq!(contents(&dir), before, "a refused resume changed the run");
    }
    let out = trainer(&[&["run", "-q", "--force"][..], &shorter].concat());
    assert_eq!(run_dir(&out), dir);
    assert_eq!(summary(&dir)["steps"], 115);
    let folders = superseded(&dir);
    assert_eq!(folders.len(), 2, "{folders:?}");
    for (name, bytes) in &before[..3] {
        assert_eq!(
            &std::fs::read(folders[1].join(name)).unwrap(),
            bytes,
            "{name}"
        );
    }
    // The folder reads as the run it was: ls lists its 690 steps.
    let ls = trainer(&["ls", folders[1].to_str().unwrap(), "--format", "csv"]);
    assert!(
        common::stdout(&ls).contains(",690,"),
        "{}",
        common::stdout(&ls)
    );
}

/// `trainer run --resume RUN_DIR` takes the run's own config.toml as the job: its name,
/// overrides and checkpoint settings stay; a --set changes it on top; a completed run with a
/// checkpoint of its final state is extended from there.
#[test]
fn a_resume_without_a_job_file_keeps_the_run_s_own_settings() {
    let job = write_job(SMALL_JOB);
    let first = job.run(&[
        "--name",
        "mine",
        "--set",
        "train.epochs=2",
        "--set",
        "optimizer.lr=2e-3",
    ]);
    let dir = run_dir(&first);
    let d = dir.to_str().unwrap();
    assert_eq!(summary(&dir)["steps"], 46);
    let before = metrics(&dir);
    let out = trainer(&["run", "--resume", d, "--set", "train.epochs=3", "-q"]);
    assert_eq!(run_dir(&out), dir);
    assert!(!stderr(&out).contains("WARN"), "{}", stderr(&out));
    assert_eq!(summary(&dir)["steps"], 69);
    assert!(
        metrics(&dir).starts_with(&before),
        "the run went on after its rows"
    );
    // Its checkpoint settings held: the final state at step 69 is a checkpoint.
    assert_eq!(
        checkpoints(&dir).last().unwrap(),
        "step-00000069.safetensors"
    );
    let config = std::fs::read_to_string(dir.join("config.toml")).unwrap();
    for line in [
        "name = \"mine\"",
        "lr = 0.002",
        "epochs = 3",
        "every_steps = 10",
    ] {
        assert!(config.contains(line), "config.toml lacks {line}:\n{config}");
    }
    assert!(
        config.starts_with(&format!(
            "# trainer run --resume {d} --set train.epochs=3\n"
        )),
        "{config}"
    );
    // The two-epoch result it extended: in superseded/, whole.
    let folders = superseded(&dir);
    assert_eq!(folders.len(), 1);
    assert_eq!(summary(&folders[0])["steps"], 46);
    assert!(folders[0].join("model.safetensors").is_file());
    // A change of training still needs --force.
    let out = trainer(&[
        "run",
        "--resume",
        d,
        "--set",
        "train.epochs=4",
        "--set",
        "optimizer.lr=1e-2",
    ]);
    expect_exit_2(
        &out,
        &["optimizer.lr: 0.002 in the checkpoint, 0.01 now", "--force"],
    );
    // Neither a job file nor a run: a usage error.
    let out = trainer(&["run", "--set", "train.epochs=4"]);
    expect_exit_2(&out, &["--resume"]);
}

/// Rows after the newest checkpoint of a run that was killed are retrained when the job is
/// the run's own (as they were); with another length they would be trained differently, so
/// that is refused unless --force, by --resume and resume = "auto" alike.
#[test]
fn a_killed_run_s_later_rows_are_kept_unless_the_resume_trains_them_differently() {
    let job = write_job(&format!("{SMALL_JOB}resume = \"auto\"\n"));
    let dir = crashed_small_run(&job);
    let before = contents(&dir);
    let d = dir.to_str().unwrap();
    for out in [
        job.run(&["--set", "train.epochs=6"]),
        trainer(&["run", "--resume", d, "--set", "train.epochs=6"]),
    ] {
        expect_exit_2(
            &out,
            &[
                "step-00000090.safetensors (step 90): the run went further",
                "metrics.csv row(s) after the checkpoint's, up to step 92",
                "those steps were trained with other values of train.epochs",
                "--force",
            ],
        );
        assert_eq!(contents(&dir), before, "a refused resume changed the run");
    }
    // The run's own settings: steps 91 and 92 trained again, the earlier rows kept aside.
    let again = run_dir(&trainer(&["run", "--resume", d, "-q"]));
    assert_eq!(again, dir);
    assert_eq!(summary(&dir)["status"], "completed");
    let folders = superseded(&dir);
    assert_eq!(folders.len(), 1);
    assert_eq!(
        std::fs::read(folders[0].join("metrics.csv")).unwrap(),
        before[0].1
    );
    assert_eq!(metrics(&dir), metrics(&folders[0]), "the same rows again");
}

/// A run stopped after its final checkpoint, while writing its weights or summary, is
/// finished by a resume: the same weights, rows and summary, nothing trained (the resume was
/// refused as finished, so the run, `resume = "auto"` and a sweep holding it were stuck).
#[test]
fn a_run_stopped_after_its_final_checkpoint_is_finished_by_a_resume() {
    let job = write_job(SMALL_JOB);
    let dir = run_dir(&job.run(&[]));
    let (weights_before, rows_before, summary_before) =
        (weights(&dir), metrics(&dir), summary(&dir));
    std::fs::remove_file(dir.join("summary.json")).unwrap();
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let out = job.run(&["--resume", dir.to_str().unwrap()]);
    assert_eq!(run_dir(&out), dir);
    assert_eq!(weights(&dir), weights_before);
    assert_eq!(metrics(&dir), rows_before);
    let s = summary(&dir);
    for key in ["status", "end_reason", "steps", "epochs", "final"] {
        assert_eq!(s[key], summary_before[key], "{key}");
    }
    // Completed now: a further resume is refused, as for any completed run.
    let out = job.run(&["--resume", dir.to_str().unwrap()]);
    expect_exit_2(&out, &["where the run completed", "raise train.epochs"]);
}

/// Early stopping's count of evaluations without improvement and its best value are in
/// the checkpoints: a resumed run stops at the epoch the uninterrupted one stopped at (it
/// counted from zero again, and trained two epochs longer).
#[test]
fn a_resumed_run_stops_early_where_the_uninterrupted_one_did() {
    // min_delta = 1.0: no accuracy beats the first evaluation's by more, so with patience 2
    // the run stops after epoch 3's evaluation, at step 69 (23 steps an epoch).
    let job = write_job(&SMALL_JOB.replace(
        "epochs = 4",
        "epochs = 10\nearly_stopping = { metric = \"val_accuracy\", patience = 2, min_delta = 1.0 }",
    ).replace("every_steps = 10", "every_steps = 10\nevery_epochs = 1"));
    let whole = run_dir(&job.run(&[]));
    assert_eq!(summary(&whole)["end_reason"], "early_stopped");
    assert_eq!(summary(&whole)["steps"], 69, "{}", summary(&whole));
    // The run completed: resuming it would train on past where early stopping ended it.
    let out = job.run(&["--resume", whole.to_str().unwrap()]);
    expect_exit_2(
        &out,
        &["where the run completed", "change train.early_stopping"],
    );
    // At epoch 2's end (one evaluation without improvement), and mid-epoch 3 after it.
    // And from the final checkpoint, as a crash while writing the weights leaves the run.
    for name in [
        "step-00000046.safetensors",
        "step-00000050.safetensors",
        "step-00000069.safetensors",
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("run");
        std::fs::create_dir_all(dir.join("checkpoints")).unwrap();
        for file in ["metrics.csv", "config.toml"] {
            std::fs::copy(whole.join(file), dir.join(file)).unwrap();
        }
        let from = whole.join("checkpoints").join(name);
        let checkpoint = dir.join("checkpoints").join(name);
        std::fs::copy(from, &checkpoint).unwrap();
        run_dir(&job.run(&["--resume", checkpoint.to_str().unwrap()]));
        assert_eq!(summary(&dir)["end_reason"], "early_stopped", "from {name}");
        assert_eq!(metrics(&dir), metrics(&whole), "from {name}");
        assert_eq!(weights(&dir), weights(&whole), "from {name}");
    }
}

/// Early stopping counts the evaluations of train.eval_every_steps, as Lightning counts each
/// validation: nothing beats the first (step 5) by min_delta, so with patience 2 the run
/// stops at step 15's, mid-epoch, and its last train row is step 15. A run resumed from the
/// checkpoint between them stops there too.
#[test]
fn early_stopping_counts_the_evaluations_every_n_steps() {
    let job = write_job(
        &SMALL_JOB
            .replace(
                "epochs = 4",
                "epochs = 10\neval_every_steps = 5\n\
                 early_stopping = { metric = \"val_accuracy\", patience = 2, min_delta = 1.0 }",
            )
            .replace("every_steps = 10", "every_steps = 5"),
    );
    let whole = run_dir(&job.run(&[]));
    assert_eq!(summary(&whole)["end_reason"], "early_stopped");
    assert_eq!(summary(&whole)["steps"], 15, "{}", summary(&whole));
    let rows = metrics(&whole);
    let last_train = rows.iter().rev().find(|r| r.contains(",train,")).unwrap();
    assert!(last_train.starts_with("15,"), "{last_train}\n{rows:?}");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    std::fs::create_dir_all(dir.join("checkpoints")).unwrap();
    for file in ["metrics.csv", "config.toml"] {
        std::fs::copy(whole.join(file), dir.join(file)).unwrap();
    }
    let name = "step-00000010.safetensors";
    let checkpoint = dir.join("checkpoints").join(name);
    std::fs::copy(whole.join("checkpoints").join(name), &checkpoint).unwrap();
    run_dir(&job.run(&["--resume", checkpoint.to_str().unwrap()]));
    assert_eq!(summary(&dir)["end_reason"], "early_stopped");
    assert_eq!(metrics(&dir), metrics(&whole));
    assert_eq!(weights(&dir), weights(&whole));
}

#[test]
fn nonexistent_resume_path_and_a_run_without_checkpoints_are_named() {
    let job = write_job(SMALL_JOB);
    let out = job.run(&["--resume", "no/such/run"]);
    expect_exit_2(&out, &["--resume no/such/run", "No such file"]);
    let plain = write_job(&SMALL_JOB.replace("every_steps = 10", ""));
    let dir = run_dir(&plain.run(&[]));
    let out = plain.run(&["--resume", dir.to_str().unwrap()]);
    expect_exit_2(&out, &["no checkpoints/ directory"]);
    // A checkpoint file outside a run's checkpoints/ directory.
    let stray = dir.join("model.safetensors");
    let out = plain.run(&["--resume", stray.to_str().unwrap()]);
    expect_exit_2(&out, &["must lie in its run's checkpoints/ directory"]);
}

#[test]
fn keep_last_and_keep_best_prune_old_checkpoints() {
    let job = write_job(&format!(
        "{SMALL_JOB}every_epochs = 1\nkeep_last = 2\nkeep_best = {{ metric = \"val_loss\" }}\n"
    ));
    let dir = run_dir(&job.run(&[]));
    let kept = checkpoints(&dir);
    // 23 steps per epoch, 92 in all: the newest two, and the best by val_loss, which for a
    // steadily learning model is the final one too.
    assert_eq!(
        kept,
        ["step-00000090.safetensors", "step-00000092.safetensors"]
    );

    // With max mode on the loss, the "best" is the worst: the first epoch's checkpoint.
    let job = write_job(&format!(
        "{SMALL_JOB}every_epochs = 1\nkeep_last = 1\nkeep_best = {{ metric = \"val_loss\", mode = \"max\" }}\n"
    ));
    let dir = run_dir(&job.run(&[]));
    assert_eq!(
        checkpoints(&dir),
        ["step-00000023.safetensors", "step-00000092.safetensors"]
    );
}

/// Checkpoints every 20 steps, evaluated every 10: keep_best ranks them by the evaluation
/// of their own weights (the val_loss rows at their steps), as nanoGPT keeps its best, and
/// `--checkpoint best` reads that one.
#[test]
fn keep_best_ranks_step_checkpoints_by_their_evaluation() {
    let steps =
        "every_steps = 20\nkeep_last = 1\nkeep_best = { metric = \"val_loss\", mode = \"max\" }\n";
    let job = SMALL_JOB.replace("every_steps = 10\n", steps);
    let job = write_job(&job.replace("epochs = 4\n", "epochs = 4\neval_every_steps = 10\n"));
    let dir = run_dir(&job.run(&[]));
    // mode = "max" on a falling loss: the best is the first evaluated checkpoint, at step 20
    // (not step 10's evaluation, which has no checkpoint), besides the final one.
    assert_eq!(
        checkpoints(&dir),
        ["step-00000020.safetensors", "step-00000092.safetensors"]
    );
    let text = std::fs::read_to_string(dir.join("metrics.csv")).unwrap();
    let val_rows = text.lines().filter(|l| l.contains(",val,")).count();
    assert!(val_rows >= 9, "{val_rows} evaluation rows\n{text}");
    // `--checkpoint best` evaluates (and samples, predicts) that one.
    let run = dir.to_str().unwrap();
    let out = trainer(&["eval", run, "--checkpoint", "best"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let report = common::stdout(&out);
    assert!(report.contains("step-00000020.safetensors"), "{report}");
    // A run whose job keeps no best is told so.
    let plain_job = write_job(SMALL_JOB);
    let plain = run_dir(&plain_job.run(&[]));
    let out = trainer(&["eval", plain.to_str().unwrap(), "--checkpoint", "best"]);
    expect_exit_2(&out, &["--checkpoint best", "no checkpoint.keep_best"]);
}

/// A run that stopped before its end has no final weights: eval (and predict, sample) say
/// so and name its newest checkpoint, and `--checkpoint last` reads that one.
#[test]
fn an_unfinished_run_is_read_from_its_newest_checkpoint_by_last() {
    let job = write_job(SMALL_JOB);
    let dir = crashed_small_run(&job);
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let newest = checkpoints(&dir).pop().unwrap();
    let run = dir.to_str().unwrap();
    let out = trainer(&["eval", run]);
    expect_exit_2(&out, &["no final weights", "--checkpoint last", "--resume"]);
    let out = trainer(&["eval", run, "--checkpoint", "last"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let report = common::stdout(&out);
    assert!(report.contains(&newest), "{newest} not in\n{report}");
    // A run with no checkpoints has nothing to read.
    std::fs::remove_dir_all(dir.join("checkpoints")).unwrap();
    let out = trainer(&["eval", run, "--checkpoint", "last"]);
    expect_exit_2(&out, &["--checkpoint last", "has no checkpoints"]);
    let out = trainer(&["eval", run]);
    expect_exit_2(&out, &["no final weights", "no checkpoints either"]);
}

#[test]
fn resume_auto_continues_the_newest_unfinished_run_else_starts_a_new_one() {
    let job = write_job(&format!("{SMALL_JOB}resume = \"auto\"\n"));
    let dir = crashed_small_run(&job);
    let again = run_dir(&job.run(&[]));
    assert_eq!(again, dir, "auto continues the crashed run");
    assert_eq!(summary(&dir)["status"], "completed");
    let fresh = run_dir(&job.run(&[]));
    assert_ne!(fresh, dir, "a completed run is not continued");
}

#[test]
fn checkpoint_keys_are_validated() {
    for (setting, needles) in [
        ("every_steps = 0", vec!["checkpoint.every_steps", "0 given"]),
        (
            "keep_best = { metric = \"val_loss\" }",
            vec!["checkpoint.keep_best", "every_epochs"],
        ),
        (
            "every_steps = 15\nkeep_best = { metric = \"val_loss\" }",
            vec![
                "checkpoint.keep_best",
                "a multiple of train.eval_every_steps",
            ],
        ),
        (
            "every_epochs = 1\nkeep_best = { metric = \"test_accuracy\" }",
            vec!["checkpoint.keep_best.metric", "no test split"],
        ),
        (
            "activations = { segments = 9 }",
            vec!["checkpoint.activations.segments", "9 given"],
        ),
        (
            "resume = \"sometimes\"",
            vec!["checkpoint.resume", "unknown variant"],
        ),
    ] {
        let job = write_job(&format!(
            "{}{setting}\n",
            SMALL_JOB.replace("every_steps = 10\n", "")
        ));
        let out = job.run(&[]);
        expect_exit_2(&out, &needles);
    }
}

#[test]
fn batch_norm_running_statistics_are_checkpointed_so_a_resume_is_exact() {
    let job = write_job(
        r#"
[job]
name = "bn"
[data]
source = "digits"
val_fraction = 0.2
[model]
layers = [{ type = "conv2d", out = 4, kernel_size = 3, padding = 1 }, { type = "batchnorm2d" },
          { type = "relu" }, { type = "flatten" }, { type = "batchnorm1d" }, { type = "linear", out = 10 }]
[optimizer]
type = "adam"
lr = 1e-3
[train]
epochs = 3
log_every = 5
[checkpoint]
every_steps = 30
"#,
    );
    let full = run_dir(&job.run(&[]));
    let tmp = tempfile::tempdir().unwrap();
    let crashed = tmp.path().join("run");
    std::fs::create_dir_all(crashed.join("checkpoints")).unwrap();
    for name in ["metrics.csv", "config.toml", "train.log"] {
        std::fs::copy(full.join(name), crashed.join(name)).unwrap();
    }
    let kept = "step-00000030.safetensors";
    std::fs::copy(
        full.join("checkpoints").join(kept),
        crashed.join("checkpoints").join(kept),
    )
    .unwrap();
    run_dir(&job.run(&["--resume", crashed.to_str().unwrap()]));
    assert_eq!(metrics(&crashed), metrics(&full));
    assert_eq!(
        weights(&crashed),
        weights(&full),
        "model.safetensors differs"
    );
}

/// Checkpoints written before each parameter tensor was aligned in the flat buffer hold the
/// tensors back to back. A resume from one puts every value in its place and continues
/// exactly as from the checkpoint of today's layout.
#[test]
fn a_checkpoint_in_the_earlier_packed_layout_resumes_the_same_run() {
    use trainer::checkpoint::file::{self, TensorOut, Values};
    // Width 30: the next tensors start 2 and 4 values past where the last one ended.
    let text = SMALL_JOB.replace("out = 32", "out = 30");
    let job = write_job(&text);
    let dir = run_dir(&job.run(&[]));
    let (want_metrics, want_weights) = (metrics(&dir), weights(&dir));
    let shape = trainer::graph::DataShape {
        sample_shape: vec![1, 8, 8],
        classes: Some(10),
        classes_from: None,
        target_dim: 1,
    };
    let graph = trainer::graph::Graph::build(&common::spec(&text), &shape).unwrap();
    assert_eq!(graph.param_len - graph.parameter_count(), 6, "the gaps");
    let mut entries = graph.state_dict_entries();
    entries.sort_by_key(|e| e.offset);
    let packed = |aligned: &[f32]| -> Vec<f32> {
        let tensor = |e: &trainer::graph::StateDictEntry| {
            aligned[e.offset..][..e.shape.iter().product::<usize>()].to_vec()
        };
        entries.iter().flat_map(tensor).collect()
    };

    // The run as a crash at step 20 would leave it, its checkpoint rewritten packed.
    std::fs::remove_file(dir.join("summary.json")).unwrap();
    for name in checkpoints(&dir) {
        if name.as_str() > "step-00000020.safetensors" {
            std::fs::remove_file(dir.join("checkpoints").join(name)).unwrap();
        }
    }
    let path = dir.join("checkpoints").join("step-00000020.safetensors");
    let f = file::read(&path).unwrap();
    let stats = f.f64s("window.loss_stats").unwrap();
    let f32_tensors: Vec<(String, Vec<f32>)> = (f.names().into_iter())
        .filter(|name| name != "window.loss_stats")
        .map(|name| {
            let v = f.f32s(&name).unwrap();
            if name == "params" || name.starts_with("optimizer.") {
                assert_eq!(v.len(), graph.param_len, "{name}");
                (name, packed(&v))
            } else {
                (name, v)
            }
        })
        .collect();
    let mut tensors = vec![TensorOut {
        name: "window.loss_stats".into(),
        shape: vec![3],
        values: Values::F64(&stats),
    }];
    tensors.extend(f32_tensors.iter().map(|(name, v)| TensorOut {
        name: name.clone(),
        shape: vec![v.len()],
        values: Values::F32(v),
    }));
    file::write(&path, &tensors, f.metadata().into_iter().collect()).unwrap();
    assert_eq!(
        trainer::checkpoint::load(&path).unwrap().params.len(),
        graph.parameter_count()
    );

    run_dir(&job.run(&["--resume", path.to_str().unwrap()]));
    assert_eq!(metrics(&dir), want_metrics);
    assert!(weights(&dir) == want_weights, "final weights differ");
}

/// `trainer run` of `job` with `extra` arguments under `ulimit -f` of `bytes`, as a full
/// disk fails a write.
fn run_with_file_size_limit(job: &Job, extra: &[&str], bytes: u64) -> Output {
    use std::os::unix::process::CommandExt;
    let mut command = Command::new(trainer_bin());
    command.args(job.args(extra)).current_dir(root());
    // SAFETY: setrlimit is async-signal-safe.
    unsafe {
        command.pre_exec(move || {
            let limit = libc::rlimit {
                rlim_cur: bytes,
                rlim_max: bytes,
            };
            match libc::setrlimit(libc::RLIMIT_FSIZE, &limit) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            }
        });
    }
    command.output().unwrap()
}

/// A row that a full disk cuts short is taken back: metrics.csv ends with a whole row.
#[test]
fn a_metrics_row_cut_short_by_a_full_disk_is_taken_back() {
    let job = write_job(&SMALL_JOB.replace("every_steps = 10", "every_steps = 1000"));
    let out = run_with_file_size_limit(&job, &["--set", "train.log_every=1"], 4096);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let dir = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
    assert_eq!(summary(&dir)["status"], "failed");
    let text = std::fs::read_to_string(dir.join("metrics.csv")).unwrap();
    assert!(text.ends_with('\n'), "{text}");
    let columns = trainer::run::METRICS_COLUMNS.len();
    assert!(
        text.lines().all(|l| l.split(',').count() == columns),
        "{text}"
    );
}

/// A resume that fails while it sets the run directory up (here train.log cannot be
/// opened) ends the run as failed, saying why, and names the command that continues it:
/// the run had lost its summary.json and read as killed.
#[test]
fn a_resume_that_fails_setting_up_its_run_directory_leaves_a_failed_run() {
    let job = write_job(SMALL_JOB);
    let dir = run_dir(&job.run(&[]));
    std::fs::remove_file(dir.join("train.log")).unwrap();
    std::fs::create_dir(dir.join("train.log")).unwrap();
    let d = dir.to_str().unwrap();
    let out = job.run(&["--resume", d, "--set", "train.epochs=6"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("train.log"), "{err}");
    assert!(err.contains("(its summary.json says so too)"), "{err}");
    assert!(err.contains("continue with: trainer run"), "{err}");
    let s = summary(&dir);
    assert_eq!(s["status"], "failed");
    assert!(s["error"].as_str().unwrap().contains("train.log"), "{s}");
}

/// A resume that can write nothing at all (here no file may exceed 64 bytes, as on a full
/// disk) puts the run's earlier summary.json back, rather than leave a run that reads as
/// killed.
#[test]
fn a_resume_that_can_write_nothing_puts_the_earlier_summary_back() {
    let job = write_job(SMALL_JOB);
    let dir = run_dir(&job.run(&[]));
    // A run stopped after its final checkpoint: a resume replaces nothing, and finishes it.
    let interrupted = r#"{"status": "interrupted", "end_reason": "interrupted"}"#;
    std::fs::write(dir.join("summary.json"), interrupted).unwrap();
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let d = dir.to_str().unwrap();
    let out = run_with_file_size_limit(&job, &["--resume", d], 64);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("the earlier summary.json is back"), "{err}");
    assert_eq!(
        std::fs::read_to_string(dir.join("summary.json")).unwrap(),
        interrupted
    );
}

/// A resume that cannot keep what it replaces (a full disk) changes nothing of the run.
#[test]
fn a_resume_that_cannot_set_aside_what_it_replaces_leaves_the_run_as_it_was() {
    let job = write_job(SMALL_JOB);
    let dir = run_dir(&job.run(&[]));
    let before = contents(&dir);
    let d = dir.to_str().unwrap();
    let out = run_with_file_size_limit(&job, &["--resume", d, "--set", "train.epochs=6"], 64);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("cannot set aside what this resume replaces"),
        "{err}"
    );
    assert!(err.contains("the run is as it was"), "{err}");
    assert_eq!(contents(&dir), before);
    assert_eq!(superseded(&dir), Vec::<PathBuf>::new());
}

#[test]
fn a_file_size_limit_fails_the_run_with_a_message_instead_of_killing_it() {
    let job = write_job(LONG_JOB);
    // `ulimit -f 256`: the run directory's small files fit, the first checkpoint (about
    // 1.4 MiB of weights and Adam's moments) does not.
    let out = run_with_file_size_limit(&job, &["--set", "train.epochs=1"], 256 * 1024);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{:?}: {}",
        out.status,
        stderr(&out)
    );
    let err = stderr(&out);
    assert!(err.contains("File too large"), "{err}");
    let dir = job
        .runs
        .join("long")
        .read_dir()
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    assert_eq!(summary(&dir)["status"], "failed");
}

/// A sweep resumes a point that was killed by the same rules as `trainer run --resume`: the
/// point's job is its run's own, so the steps after its newest checkpoint are trained again,
/// and the rows they had are kept in the point's superseded/.
#[test]
fn a_sweep_resumes_a_killed_point_keeping_its_later_rows_aside() {
    let job = write_job(SMALL_JOB);
    let sweep = |extra: &[&str]| {
        let mut args = vec![
            "sweep",
            job.path.to_str().unwrap(),
            "--grid",
            "optimizer.lr=1e-3",
        ];
        args.extend([
            "--sweep-id",
            "s",
            "--runs-dir",
            job.runs.to_str().unwrap(),
            "-q",
        ]);
        args.extend_from_slice(extra);
        trainer(&args)
    };
    assert!(sweep(&[]).status.success());
    let point = job.runs.join("small/s/000-lr=1e-3");
    let whole = metrics(&point);
    std::fs::remove_file(point.join("summary.json")).unwrap();
    std::fs::remove_file(point.join("checkpoints/step-00000092.safetensors")).unwrap();
    let out = sweep(&[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(summary(&point)["status"], "completed");
    assert_eq!(metrics(&point), whole);
    let folders = superseded(&point);
    assert_eq!(folders.len(), 1, "{folders:?}");
    assert_eq!(metrics(&folders[0]), whole);
}

/// A run an earlier trainer started, whose metrics.csv has fewer columns (tokens_per_sec came
/// later), resumes with its rows in that shape: the file stays one table.
#[test]
fn a_run_with_an_earlier_metrics_header_resumes_in_its_columns() {
    let job = write_job(SMALL_JOB);
    let dir = run_dir(&job.run(&[]));
    let metrics_path = dir.join("metrics.csv");
    let text = std::fs::read_to_string(&metrics_path).unwrap();
    // One label a sample: no tokens/s. On a CPU, no MFU.
    assert!(
        text.lines()
            .next()
            .unwrap()
            .ends_with(",tokens_per_sec,flops_per_sec,mfu"),
        "{text}"
    );
    assert!(text.lines().skip(1).all(|l| l.ends_with(',')), "{text}");
    let older = 14;
    let earlier: String = (text.lines())
        .map(|l| l.split(',').take(older).collect::<Vec<_>>().join(",") + "\n")
        .collect();
    assert!(earlier.starts_with("step,epoch,"), "{earlier}");
    std::fs::write(&metrics_path, &earlier).unwrap();
    let more = job.run(&["--resume", dir.to_str().unwrap(), "--set", "train.epochs=6"]);
    assert!(more.status.success(), "{}", stderr(&more));
    let now = std::fs::read_to_string(&metrics_path).unwrap();
    assert!(now.starts_with(&earlier), "{now}");
    assert!(now.lines().count() > earlier.lines().count(), "{now}");
    for line in now.lines() {
        assert_eq!(line.split(',').count(), older, "{line}");
    }
}
