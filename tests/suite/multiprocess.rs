//! Multi-process data parallelism: `trainer run` started once per rank with RANK,
//! WORLD_SIZE, MASTER_ADDR and MASTER_PORT (as torchrun, srun or a shell loop do), on
//! loopback. The ranks train exactly what the same number of threaded replicas train; only
//! rank 0 writes a run directory; a rank that is killed, hangs, or runs another job makes
//! the others fail with an error naming it, in bounded time; a signal on any rank stops the
//! whole run with a checkpoint that resumes exactly.

use crate::common;

use common::{
    free_port, one_at_a_time, only_run_dir, read_csv, summary, trainer_bin, trainer_with_env,
    write_job,
};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Small, but with everything a step carries: shuffling, dropout, gradient accumulation,
/// clipping, AdamW with a schedule, a validation split, and checkpoints.
const JOB: &str = r#"
[job]
name = "mp"
seed = 5
[device]
type = "cpu"
[data]
source = "synthetic"
samples = 720
num_features = 12
classes = 3
batch_size = 24
[model]
layers = [{ type = "linear", out = 32 }, { type = "relu" }, { type = "dropout", p = 0.25 },
          { type = "linear", out = 3 }]
[optimizer]
type = "adamw"
lr = 0.003
schedule = { type = "cosine", warmup_steps = 5 }
[train]
epochs = 3
grad_accum_steps = 2
clip_grad_norm = 1.0
log_every = 4
threads = 1
[checkpoint]
every_steps = 10
"#;

/// Long enough (thousands of steps) for a kill or a signal to land mid-run.
const LONG_JOB: &str = r#"
[job]
name = "long"
seed = 7
[device]
type = "cpu"
[data]
source = "synthetic"
samples = 20000
num_features = 64
classes = 10
batch_size = 24
[model]
layers = [{ type = "linear", out = 256 }, { type = "relu" }, { type = "linear", out = 10 }]
[optimizer]
type = "adam"
lr = 1e-3
[train]
epochs = 5
log_every = 5
threads = 1
[checkpoint]
every_steps = 25
"#;

/// `trainer run JOB ARGS` as `rank` of `world` ranks meeting on `port`.
fn spawn_rank(rank: usize, world: usize, port: u16, args: &[&str]) -> Child {
    spawn_rank_with(rank, world, port, args, &[])
}

/// `spawn_rank` with more environment variables.
fn spawn_rank_with(
    rank: usize,
    world: usize,
    port: u16,
    args: &[&str],
    env: &[(&str, &str)],
) -> Child {
    rank_command(rank, world, port, args, env).spawn().unwrap()
}

/// The command `spawn_rank_with` starts.
fn rank_command(
    rank: usize,
    world: usize,
    port: u16,
    args: &[&str],
    env: &[(&str, &str)],
) -> Command {
    let mut command = Command::new(trainer_bin());
    command
        .arg("run")
        .args(args)
        .current_dir(common::root())
        .env_remove("RUST_LOG")
        .envs(env.iter().copied())
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

struct Ended {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    /// When it ended, from when `finish` was called.
    after: Duration,
}

/// Returns once `rank` says it is at the rendezvous (it catches signals from before that
/// line), reading its stderr a byte at a time so that `finish` still gets the rest.
fn at_the_rendezvous(rank: &mut Child) {
    let stderr = rank.stderr.as_mut().unwrap();
    let (mut seen, mut byte) = (Vec::new(), [0u8]);
    let said = |seen: &[u8]| {
        let seen = String::from_utf8_lossy(seen);
        seen.contains("joining rank 0") || seen.contains("waiting for the other ranks")
    };
    while !said(&seen) {
        let n = stderr.read(&mut byte).unwrap();
        assert_eq!(
            n,
            1,
            "the rank ended first: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.push(byte[0]);
    }
}

/// Waits for `child` at most `limit` (then kills it and fails).
fn finish(mut child: Child, limit: Duration) -> Ended {
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > limit {
            child.kill().ok();
            child.wait().ok();
            let mut err = String::new();
            child.stderr.take().unwrap().read_to_string(&mut err).ok();
            panic!("a rank did not finish within {limit:?}:\n{err}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (mut stdout, mut stderr) = (String::new(), String::new());
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .ok();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .ok();
    Ended {
        code: status.code(),
        stdout,
        stderr,
        after: started.elapsed(),
    }
}

/// Runs `world` ranks of `trainer run ARGS` to the end; returns them in rank order.
fn run_ranks(world: usize, args: &[&str]) -> Vec<Ended> {
    let port = free_port();
    let children: Vec<Child> = (0..world)
        .map(|r| spawn_rank(r, world, port, args))
        .collect();
    children
        .into_iter()
        .map(|c| finish(c, Duration::from_secs(120)))
        .collect()
}

fn run_dir_of(ended: &Ended) -> PathBuf {
    assert_eq!(ended.code, Some(0), "{}", ended.stderr);
    PathBuf::from(ended.stdout.trim())
}

/// One process, no multi-process variables: the reference.
fn run_alone(args: &[&str]) -> PathBuf {
    let mut all = vec!["run"];
    all.extend_from_slice(args);
    let o = trainer_with_env(&all, &[]);
    assert!(o.status.success(), "{}", common::stderr(&o));
    PathBuf::from(String::from_utf8(o.stdout).unwrap().trim())
}

/// Every metrics.csv column but the timing ones.
fn numbers(dir: &Path) -> Vec<Vec<String>> {
    let (header, rows) = read_csv(&dir.join("metrics.csv"));
    let keep: Vec<usize> = (0..header.len())
        .filter(|&i| !common::TIMING_COLUMNS.contains(&header[i].as_str()))
        .collect();
    rows.iter()
        .map(|r| keep.iter().map(|&i| r[i].clone()).collect())
        .collect()
}

/// metrics.csv's loss column, every row.
fn losses_of(dir: &Path) -> Vec<f64> {
    let (header, rows) = read_csv(&dir.join("metrics.csv"));
    rows.iter()
        .map(|r| common::column(&header, r, "loss").parse().unwrap())
        .collect()
}

fn model(dir: &Path) -> Vec<u8> {
    std::fs::read(dir.join("model.safetensors")).unwrap()
}

/// Waits until rank 0's run directory under `runs` has a checkpoint.
fn wait_for_checkpoint(runs: &Path) {
    let started = Instant::now();
    while !common::walk(runs)
        .iter()
        .any(|p| p.extension().is_some_and(|e| e == "safetensors"))
    {
        assert!(started.elapsed() < Duration::from_secs(60), "no checkpoint");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The run in `dir` (stopped and resumed) equals 2 threaded replicas training `job` without
/// a stop (in `scratch`): metrics.csv and model.safetensors, byte for byte.
fn assert_trains_like_two_threaded_replicas(job: &str, scratch: &Path, dir: &Path) {
    let reference = run_alone(&[
        job,
        "--runs-dir",
        scratch.join("reference").to_str().unwrap(),
        "--set",
        "parallel.replicas=2",
    ]);
    assert_eq!(numbers(dir), numbers(&reference));
    assert_eq!(model(dir), model(&reference));
}

#[test]
fn ranks_train_exactly_what_as_many_threaded_replicas_train() {
    let _turn = one_at_a_time();
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), JOB);
    let job = job.to_str().unwrap();
    for world in [2, 3] {
        let runs = tmp.path().join(format!("ranks-{world}"));
        let mut args = vec![job, "--runs-dir", runs.to_str().unwrap()];
        if world == 3 {
            // A bucket per layer: each goes to rank 0 as the backward pass has it, and the
            // sums are still the threads' to the bit.
            args.extend(["--set", "parallel.bucket_mb=0.0001"]);
        }
        let ranks = run_ranks(world, &args);
        let dir = run_dir_of(&ranks[0]);
        for (rank, ended) in ranks.iter().enumerate().skip(1) {
            assert_eq!(ended.code, Some(0), "rank {rank}: {}", ended.stderr);
            assert_eq!(ended.stdout, "", "only rank 0 names a run directory");
            assert!(
                ended.stderr.contains("the run completed"),
                "{}",
                ended.stderr
            );
        }
        // Rank 0 alone writes: one run directory, its checkpoints, its model.
        assert_eq!(only_run_dir(&runs), dir);
        assert!(dir.join("checkpoints").exists());

        // The run's config.toml records the ranks as replicas: run alone, it trains them as
        // threads, to the same bits.
        let config = std::fs::read_to_string(dir.join("config.toml")).unwrap();
        assert!(config.contains(&format!("replicas = {world}")), "{config}");
        let threads = tmp.path().join(format!("threads-{world}"));
        let reference = run_alone(&[
            dir.join("config.toml").to_str().unwrap(),
            "--runs-dir",
            threads.to_str().unwrap(),
        ]);
        assert_eq!(numbers(&dir), numbers(&reference), "{world} ranks");
        let (header, rows) = read_csv(&dir.join("metrics.csv"));
        for row in rows.iter().filter(|r| r[2] == "train") {
            // batch_size 24 (all ranks together) x 2 accumulation steps.
            assert_eq!(common::column(&header, row, "global_batch"), "48");
        }
        assert_eq!(model(&dir), model(&reference), "{world} ranks");
        assert!(
            config.contains(&format!(
                "# device: {world} processes (rank 0 of {world}) x 1 thread each"
            )) && config.contains(&format!("x {world} replicas x 2 accumulation steps")),
            "{config}"
        );
    }
}

/// `world` ranks of `job_text` (plus `extra` arguments) in a temporary directory, once rank 0
/// has written its first checkpoint: the run is under way.
struct MidRun {
    /// Holds the directory: bind it for as long as the ranks run.
    tmp: tempfile::TempDir,
    job: PathBuf,
    runs: PathBuf,
    /// In rank order.
    ranks: Vec<Child>,
}

fn start_mid_run(job_text: &str, world: usize, extra: &[&str]) -> MidRun {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), job_text);
    let runs = tmp.path().join("runs");
    let mut args = vec![job.to_str().unwrap(), "--runs-dir", runs.to_str().unwrap()];
    args.extend_from_slice(extra);
    let port = free_port();
    let ranks = (0..world)
        .map(|r| spawn_rank(r, world, port, &args))
        .collect();
    wait_for_checkpoint(&runs);
    MidRun {
        tmp,
        job,
        runs,
        ranks,
    }
}

#[test]
fn a_signal_on_any_rank_stops_the_run_with_a_checkpoint_that_resumes_exactly() {
    let _turn = one_at_a_time();
    let MidRun {
        tmp,
        job,
        runs,
        ranks,
    } = start_mid_run(&LONG_JOB.replace("epochs = 5", "epochs = 1"), 2, &[]);
    // SIGTERM to rank 1 only: the whole run stops after the step, with rank 0's checkpoint.
    unsafe { libc::kill(ranks[1].id() as i32, libc::SIGTERM) };
    let ended: Vec<Ended> = (ranks.into_iter())
        .map(|c| finish(c, Duration::from_secs(60)))
        .collect();
    let (zero, one) = (&ended[0], &ended[1]);
    assert_eq!(zero.code, Some(143), "{}", zero.stderr);
    assert_eq!(one.code, Some(143), "{}", one.stderr);
    assert!(
        zero.stderr.contains("rank 1 received signal 15"),
        "{}",
        zero.stderr
    );
    let dir = only_run_dir(&runs);
    assert_eq!(summary(&dir)["status"], "interrupted");

    // Both ranks again, rank 0 resuming its run: the same as never stopping.
    let (job, runs, dir_arg) = (
        job.to_str().unwrap(),
        runs.to_str().unwrap(),
        dir.to_str().unwrap(),
    );
    let resumed = run_ranks(2, &[job, "--runs-dir", runs, "--resume", dir_arg]);
    assert_eq!(run_dir_of(&resumed[0]), dir);
    assert_eq!(resumed[1].code, Some(0), "{}", resumed[1].stderr);
    assert_trains_like_two_threaded_replicas(job, tmp.path(), &dir);
}

#[test]
fn a_killed_rank_fails_rank_zero_at_once_naming_it_and_the_checkpoints_stay() {
    let _turn = one_at_a_time();
    let MidRun {
        runs,
        ranks,
        tmp: _tmp,
        ..
    } = start_mid_run(LONG_JOB, 2, &[]);
    let [rank0, mut rank1] = ranks.try_into().unwrap();
    rank1.kill().unwrap();
    rank1.wait().unwrap();
    let zero = finish(rank0, Duration::from_secs(30));
    assert_eq!(zero.code, Some(1), "{}", zero.stderr);
    assert!(
        zero.stderr
            .contains("rank 0: lost rank 1: its connection closed"),
        "{}",
        zero.stderr
    );
    assert!(zero.after < Duration::from_secs(10), "{:?}", zero.after);
    let dir = only_run_dir(&runs);
    assert_eq!(summary(&dir)["status"], "failed");
    assert!(std::fs::read_dir(dir.join("checkpoints")).unwrap().count() > 0);
}

#[test]
fn a_killed_rank_zero_stops_the_other_ranks_at_once() {
    let _turn = one_at_a_time();
    let MidRun {
        mut ranks,
        tmp: _tmp,
        ..
    } = start_mid_run(LONG_JOB, 3, &[]);
    let others = ranks.split_off(1);
    ranks[0].kill().unwrap();
    ranks[0].wait().unwrap();
    for (rank, child) in (1..).zip(others) {
        let ended = finish(child, Duration::from_secs(30));
        assert_eq!(ended.code, Some(1), "{}", ended.stderr);
        assert!(
            ended
                .stderr
                .contains(&format!("rank {rank}: lost rank 0: its connection closed")),
            "{}",
            ended.stderr
        );
        assert!(ended.after < Duration::from_secs(10));
    }
}

#[test]
fn a_hung_rank_fails_rank_zero_after_parallel_timeout() {
    let _turn = one_at_a_time();
    let timeout = ["--set", "parallel.timeout=\"2s\""];
    let MidRun {
        ranks, tmp: _tmp, ..
    } = start_mid_run(LONG_JOB, 2, &timeout);
    let [rank0, mut rank1] = ranks.try_into().unwrap();
    // Stopped, not dead: its connection stays open and silent.
    unsafe { libc::kill(rank1.id() as i32, libc::SIGSTOP) };
    let zero = finish(rank0, Duration::from_secs(30));
    rank1.kill().unwrap();
    rank1.wait().unwrap();
    assert_eq!(zero.code, Some(1), "{}", zero.stderr);
    assert!(
        zero.stderr
            .contains("rank 0: rank 1 did not answer within 2s (parallel.timeout)"),
        "{}",
        zero.stderr
    );
    assert!(zero.after < Duration::from_secs(10), "{:?}", zero.after);
}

/// JOB trained by two ranks, rank 1 given `rank_one_extra` besides what both get; their
/// ends, and the runs directory.
fn two_ranks(rank_one_extra: &[&str]) -> (Ended, Ended, PathBuf, tempfile::TempDir) {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), JOB);
    let job = job.to_str().unwrap();
    let runs = tmp.path().join("runs");
    let common = [job, "--runs-dir", runs.to_str().unwrap()];
    let port = free_port();
    let rank0 = spawn_rank(0, 2, port, &common);
    let rank1 = spawn_rank(1, 2, port, &[&common[..], rank_one_extra].concat());
    let limit = Duration::from_secs(60);
    let (zero, one) = (finish(rank0, limit), finish(rank1, limit));
    (zero, one, runs, tmp)
}

#[test]
fn ranks_with_different_jobs_are_refused_before_anything_is_written() {
    let _turn = one_at_a_time();
    let (zero, one, runs, _tmp) = two_ranks(&["--set", "optimizer.lr=0.5"]);
    for ended in [&zero, &one] {
        assert_eq!(ended.code, Some(2), "{}", ended.stderr);
        assert!(
            ended.stderr.contains("rank 1's job differs from rank 0's")
                && ended
                    .stderr
                    .contains("optimizer.lr: 0.003 on rank 0, 0.5 on rank 1"),
            "{}",
            ended.stderr
        );
    }
    assert!(!runs.exists(), "nothing is written for a refused run");
}

#[test]
fn a_resume_given_to_another_rank_but_not_rank_zero_is_refused() {
    let _turn = one_at_a_time();
    let (zero, one, runs, _tmp) = two_ranks(&["--resume", "runs/mp/earlier"]);
    for ended in [&zero, &one] {
        assert_eq!(ended.code, Some(2), "{}", ended.stderr);
        assert!(
            ended
                .stderr
                .contains("rank 1 was given --resume runs/mp/earlier, but rank 0 starts a new run"),
            "{}",
            ended.stderr
        );
    }
    assert!(!runs.exists(), "nothing is written for a refused run");
}

#[test]
fn a_rank_told_to_train_longer_than_rank_zero_warns_that_rank_zero_decides() {
    let _turn = one_at_a_time();
    let (zero, one, runs, _tmp) = two_ranks(&["--set", "train.epochs=5"]);
    assert_eq!(zero.code, Some(0), "{}", zero.stderr);
    assert_eq!(one.code, Some(0), "{}", one.stderr);
    assert!(
        one.stderr.contains(
            "rank 1: train.epochs is 5 here and 3 on rank 0; rank 0 decides how long to train"
        ),
        "{}",
        one.stderr
    );
    let dir = only_run_dir(&runs);
    assert_eq!(summary(&dir)["epochs"], 3, "rank 0's epochs are used");
}

/// A rank that stops before the ranks meet (a bad --resume on rank 0, a bad --set on the
/// other) tells the others why: every rank ends at once with its error (they waited out
/// parallel.timeout and then blamed the connection).
#[test]
fn a_rank_that_stops_before_the_rendezvous_tells_the_others_why() {
    let _turn = one_at_a_time();
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), JOB);
    let runs = tmp.path().join("runs");
    let (job, runs) = (job.to_str().unwrap(), runs.to_str().unwrap());
    let base = [job, "--runs-dir", runs, "--set", "parallel.timeout=\"60s\""];
    let with = |extra: &[&'static str]| [&base[..], extra].concat();
    // (the failing rank, its arguments, what the other rank says, what it says itself)
    let cases: [(usize, &[&str], &str, &str); 3] = [
        (
            0,
            &["--resume", "no/such/run"],
            "rank 0 stopped before training: --resume no/such/run",
            "--resume no/such/run",
        ),
        (
            1,
            &["--set", "train.epochs=0"],
            "rank 1 stopped before training: --set train.epochs",
            "--set train.epochs",
        ),
        // A command line clap refuses, before anything of the job is read.
        (
            1,
            &["--name", "a", "--name", "b"],
            "rank 1 stopped before training: a bad command line: the argument '--name",
            "error: the argument '--name",
        ),
    ];
    for (failing, extra, needle, own_error) in cases {
        let port = free_port();
        let started = Instant::now();
        let ranks: Vec<Child> = (0..2)
            .map(|rank| {
                let args = if rank == failing {
                    with(extra)
                } else {
                    base.to_vec()
                };
                spawn_rank(rank, 2, port, &args)
            })
            .collect();
        // The failing rank prints its own error; the other, that error as the cause.
        for (rank, child) in ranks.into_iter().enumerate() {
            let ended = finish(child, Duration::from_secs(30));
            assert_eq!(ended.code, Some(2), "{}", ended.stderr);
            let want = if rank == failing { own_error } else { needle };
            assert!(ended.stderr.contains(want), "{want}\n{}", ended.stderr);
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{:?}",
            started.elapsed()
        );
    }
    assert!(!Path::new(runs).exists(), "nothing is written");
}

#[test]
fn bad_multi_process_settings_exit_2_naming_the_key() {
    let _turn = one_at_a_time();
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), JOB);
    let job = job.to_str().unwrap();
    let env = |rank: &'static str| {
        [
            ("RANK", rank),
            ("WORLD_SIZE", "5"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "1"),
        ]
    };
    let cases: [(&[&str], &str); 5] = [
        (
            &[],
            "key `data.batch_size`: 24 given with 5 data-parallel replicas",
        ),
        // A list of this machine's devices of the wrong length is named as such, not as a
        // batch that does not divide among as many replicas as it lists.
        (
            &[
                "--set",
                "parallel.devices=[\"cpu\", \"cpu\", \"cpu\"]",
                "--set",
                "data.batch_size=25",
            ],
            "key `parallel.devices`: 3 device(s) given in a multi-process run",
        ),
        (
            &[
                "--set",
                "data.batch_size=50",
                "--set",
                "parallel.replicas=2",
            ],
            "key `parallel.replicas`: 2 replica(s) given in a multi-process run (RANK=0, \
             WORLD_SIZE=5",
        ),
        (
            &[
                "--set",
                "data.batch_size=25",
                "--set",
                "parallel.timeout=\"soon\"",
            ],
            "key `parallel.timeout`: \"soon\" given",
        ),
        (
            &[
                "--set",
                "data.batch_size=25",
                "--set",
                "parallel.backend=\"nccl\"",
            ],
            "key `parallel.backend`: \"nccl\" given, but this run is on the CPU",
        ),
    ];
    for (extra, needle) in cases {
        let mut args = vec!["run", job];
        args.extend_from_slice(extra);
        let o = trainer_with_env(&args, &env("0"));
        assert_eq!(o.status.code(), Some(2), "{}", common::stderr(&o));
        assert!(
            common::stderr(&o).contains(needle),
            "{}",
            common::stderr(&o)
        );
    }
    let o = trainer_with_env(&["sweep", job, "--grid", "optimizer.lr=0.1,0.2"], &env("1"));
    assert_eq!(o.status.code(), Some(2));
    assert!(
        common::stderr(&o).contains(
            "trainer sweep runs as one process, but RANK=1 and \
             WORLD_SIZE=5 are set"
        ),
        "{}",
        common::stderr(&o)
    );
    // RANK and WORLD_SIZE alone are a launch by rank too, refused before the sweep makes its
    // directory (it used to start a point first).
    let runs = tempfile::tempdir().unwrap();
    let o = trainer_with_env(
        &[
            "sweep",
            job,
            "--grid",
            "optimizer.lr=0.1,0.2",
            "--runs-dir",
            runs.path().to_str().unwrap(),
        ],
        &[("RANK", "1"), ("WORLD_SIZE", "2")],
    );
    assert_eq!(o.status.code(), Some(2), "{}", common::stderr(&o));
    assert!(common::stderr(&o).contains("trainer sweep runs as one process"));
    assert_eq!(std::fs::read_dir(runs.path()).unwrap().count(), 0);
    let o = trainer_with_env(&["run", job], &[("RANK", "5"), ("WORLD_SIZE", "5")]);
    assert_eq!(o.status.code(), Some(2));
    assert!(common::stderr(&o).contains("RANK=5 must be below WORLD_SIZE=5"));
    // A rank 0 whose ranks never come.
    let port = free_port().to_string();
    let o = trainer_with_env(
        &[
            "run",
            job,
            "--set",
            "data.batch_size=25",
            "--set",
            "parallel.timeout=\"1s\"",
        ],
        &[
            ("RANK", "0"),
            ("WORLD_SIZE", "5"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", &port),
        ],
    );
    assert_eq!(o.status.code(), Some(1), "{}", common::stderr(&o));
    assert!(
        common::stderr(&o).contains("rank(s) 1, 2, 3, 4 did not connect within 1s"),
        "{}",
        common::stderr(&o)
    );
}

#[test]
fn two_ranks_sharing_one_gpu_follow_the_cpu_ranks() {
    let _turn = one_at_a_time();
    if !common::gpu_present() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), JOB);
    let job = job.to_str().unwrap();
    let losses = |device: &str| -> Vec<f64> {
        let runs = tmp.path().join(device.replace(':', "-"));
        let set = format!("device.type=\"{device}\"");
        let ranks = run_ranks(
            2,
            &[job, "--runs-dir", runs.to_str().unwrap(), "--set", &set],
        );
        assert_eq!(ranks[1].code, Some(0), "{}", ranks[1].stderr);
        losses_of(&run_dir_of(&ranks[0]))
    };
    let (gpu, cpu) = (losses("cuda:0"), losses("cpu"));
    // The same two ranks started by `trainer run` itself: cuda:0 listed twice.
    let runs = tmp.path().join("launched");
    let launched = finish(
        launch(&[
            job,
            "--runs-dir",
            runs.to_str().unwrap(),
            "--set",
            "device.type=\"cuda\"",
            "--set",
            "parallel.devices=[\"cuda:0\", \"cuda:0\"]",
        ]),
        Duration::from_secs(120),
    );
    assert!(
        launched
            .stderr
            .contains("parallel.devices lists cuda:0 twice"),
        "{}",
        launched.stderr
    );
    let launched = losses_of(&run_dir_of(&launched));
    assert_eq!(gpu.len(), cpu.len());
    assert_eq!(launched, gpu, "launched ranks = ranks started by hand");
    for (g, c) in gpu.iter().zip(&cpu) {
        assert!((g - c).abs() <= 1e-4 * c.abs(), "cuda {g} vs cpu {c}");
    }
}

/// NCCL refuses two ranks on one GPU (NCCL of some versions may allow it): either way the
/// ranks end in bounded time, with an error that says what to do, or with the CPU's numbers.
#[test]
fn two_ranks_forced_onto_nccl_on_one_gpu_end_clearly() {
    let _turn = one_at_a_time();
    if !common::gpu_present() || !nccl_present() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), JOB);
    let runs = tmp.path().join("runs");
    let args = [
        job.to_str().unwrap(),
        "--runs-dir",
        runs.to_str().unwrap(),
        "--set",
        "device.type=\"cuda:0\"",
        "--set",
        "parallel.backend=\"nccl\"",
        "--set",
        "parallel.timeout=\"60s\"",
    ];
    let ranks = run_ranks(2, &args);
    if ranks[0].code == Some(0) {
        eprintln!("NCCL allowed two ranks on one GPU");
        assert_eq!(ranks[1].code, Some(0), "{}", ranks[1].stderr);
        return;
    }
    eprintln!("NCCL refused two ranks on one GPU:\n{}", ranks[0].stderr);
    for ended in &ranks {
        assert_eq!(ended.code, Some(1), "{}", ended.stderr);
    }
    assert!(
        ranks
            .iter()
            .any(|e| e.stderr.contains("ranks sharing one GPU cannot use NCCL")),
        "{}\n{}",
        ranks[0].stderr,
        ranks[1].stderr
    );
}

/// `parallel.replicas = 1` on CUDA runs the data-parallel path with a 1-rank NCCL
/// communicator: the mean over one rank changes nothing, so the numbers are the plain run's,
/// with the buckets' all-reduces on their own stream during the backward pass (one bucket,
/// or one per layer), after it, and with accumulation (whose last micro-step, the one that
/// averages, is a CUDA graph of its own).
#[test]
fn one_replica_through_nccl_trains_what_the_plain_run_trains() {
    let _turn = one_at_a_time();
    if !common::gpu_present() || !nccl_present() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // jobs/mlp.toml on CUDA with these --set values.
    let on_cuda = |sets: &[&str]| {
        let mut args = vec!["jobs/mlp.toml", "--runs-dir", tmp.path().to_str().unwrap()];
        for set in ["device.type=\"cuda\""].iter().chain(sets) {
            args.extend(["--set", set]);
        }
        run_alone(&args)
    };
    let plain = on_cuda(&[]);
    let accumulating = "train.grad_accum_steps=3";
    let plain_accumulating = on_cuda(&[accumulating]);
    let mut nccl = None;
    for (extra, expected) in [
        ("parallel.overlap=true", &plain),
        ("parallel.bucket_mb=0.0001", &plain),
        ("parallel.overlap=false", &plain),
        (accumulating, &plain_accumulating),
    ] {
        let run = on_cuda(&["parallel.replicas=1", extra]);
        assert_eq!(numbers(expected), numbers(&run), "{extra}");
        assert_eq!(model(expected), model(&run), "{extra}");
        nccl.get_or_insert(run);
    }
    let nccl = nccl.unwrap();
    // devices = "all" on a one-GPU machine: that one replica, in this process.
    let all = on_cuda(&["parallel.devices=\"all\""]);
    if trainer::tensor::cuda::probe().is_ok_and(|(d, _)| d.len() == 1) {
        assert_eq!(numbers(&plain), numbers(&all));
    }
    let config = std::fs::read_to_string(nccl.join("config.toml")).unwrap();
    assert!(
        config.contains("1 replica, gradients through NCCL"),
        "{config}"
    );
}

/// A rank on each of two GPUs, averaging through NCCL, trains what two CPU ranks train (to
/// float rounding: the products and the all-reduce sum in other orders). Skips, saying so,
/// with fewer than two GPUs; tests/emulated_cuda/run.sh emulates two.
#[test]
fn two_gpus_through_nccl_follow_the_cpu_ranks() {
    let _turn = one_at_a_time();
    if !common::gpu_present() || !nccl_present() {
        return;
    }
    let gpus = trainer::tensor::cuda::probe().map_or(0, |(devices, _)| devices.len());
    if gpus < 2 {
        eprintln!("skipped: {gpus} GPU here, two are needed");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), JOB);
    let job = job.to_str().unwrap();
    let runs = tmp.path().join("gpus");
    let launched = finish(
        launch(&[
            job,
            "--runs-dir",
            runs.to_str().unwrap(),
            "--set",
            "device.type=\"cuda\"",
            "--set",
            "parallel.devices=[\"cuda:0\", \"cuda:1\"]",
        ]),
        Duration::from_secs(300),
    );
    let gpu_run = run_dir_of(&launched);
    assert!(
        launched
            .stderr
            .contains("gradients averaged by NCCL on the GPUs"),
        "{}",
        launched.stderr
    );
    let cpu_runs = tmp.path().join("cpu");
    let ranks = run_ranks(
        2,
        &[
            job,
            "--runs-dir",
            cpu_runs.to_str().unwrap(),
            "--set",
            "device.type=\"cpu\"",
        ],
    );
    assert_eq!(ranks[1].code, Some(0), "{}", ranks[1].stderr);
    let (gpu, cpu) = (losses_of(&gpu_run), losses_of(&run_dir_of(&ranks[0])));
    assert_eq!(gpu.len(), cpu.len());
    for (g, c) in gpu.iter().zip(&cpu) {
        assert!((g - c).abs() <= 1e-4 * c.abs(), "cuda {g} vs cpu {c}");
    }
}

/// An all-reduce that never comes (a rank's GPU or network stuck) fails the ranks through
/// NCCL after parallel.timeout, where NCCL itself would wait forever: the host polls the
/// all-reduce, then aborts the communicator, and the run's checkpoints stay. The stall is
/// the emulated GPU's (TRAINER_EMULATED_NCCL_STALL: rank 1's 60th all-reduce never
/// happens); elsewhere this skips.
#[test]
fn a_stalled_all_reduce_fails_the_ranks_after_parallel_timeout() {
    let _turn = one_at_a_time();
    if !common::on_emulated_gpu("a stalled all-reduce") || !nccl_present() {
        return;
    }
    let gpus = trainer::tensor::cuda::probe().map_or(0, |(devices, _)| devices.len());
    if gpus < 2 {
        eprintln!("skipped: {gpus} emulated GPU here, two are needed");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), LONG_JOB);
    let runs = tmp.path().join("runs");
    let mut args = vec![job.to_str().unwrap(), "--runs-dir", runs.to_str().unwrap()];
    args.extend([
        "--set",
        "device.type=\"cuda\"",
        "--set",
        "parallel.timeout=\"2s\"",
    ]);
    args.extend(["--set", "checkpoint.every_steps=10"]);
    let port = free_port();
    let stall = [("TRAINER_EMULATED_NCCL_STALL", "1:60")];
    let ranks: Vec<Child> = (0..2)
        .map(|r| spawn_rank_with(r, 2, port, &args, &stall))
        .collect();
    let ended: Vec<Ended> = ranks
        .into_iter()
        .map(|child| finish(child, Duration::from_secs(120)))
        .collect();
    let timeout =
        "NCCL: an all-reduce of the gradients did not finish within parallel.timeout (2s)";
    for (rank, e) in ended.iter().enumerate() {
        assert_eq!(e.code, Some(1), "rank {rank}: {}", e.stderr);
    }
    // Rank 0 waits for rank 1's buffer; rank 1 for its own all-reduce (or it hears rank 0 end).
    assert!(
        ended[0].stderr.contains(&format!("rank 0: {timeout}")),
        "{}",
        ended[0].stderr
    );
    let dir = only_run_dir(&runs);
    assert_eq!(summary(&dir)["status"], "failed");
    assert!(std::fs::read_dir(dir.join("checkpoints")).unwrap().count() > 0);
}

/// Whether libnccl loads (the GPU machine needs libnccl.so on LD_LIBRARY_PATH: see
/// bench/gpu.sh); on a GPU machine under TRAINER_REQUIRE_CUDA=1 its absence fails.
fn nccl_present() -> bool {
    match trainer::tensor::cuda::nccl_missing() {
        None => true,
        Some(why) => common::skip_without_gpu(&why),
    }
}

#[test]
fn check_shows_the_batch_layout_over_the_processes() {
    let o = trainer_with_env(
        &["check", "jobs/mlp.toml", "--set", "device.type=\"cpu\""],
        &[
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
        ],
    );
    assert!(o.status.success(), "{}", common::stderr(&o));
    assert!(
        common::stdout(&o).contains(
            "batch: 16 per replica x 4 replicas x 1 accumulation step = 64 global (processes: \
             this is rank 1 of 4, meeting at node0:29500)"
        ),
        "{}",
        common::stdout(&o)
    );
    // CPU ranks send their buckets to rank 0 during the backward pass.
    assert!(
        common::stdout(&o).contains(
            "all-reduce: gradients averaged through rank 0 over tcp in 1 bucket during the \
             backward pass"
        ),
        "{}",
        common::stdout(&o)
    );
}

#[test]
fn a_rank_still_waiting_for_rank_zero_ends_at_once_on_sigterm() {
    let _turn = one_at_a_time();
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), JOB);
    // No rank 0: rank 1 waits at the rendezvous (for parallel.timeout, 10 minutes).
    let mut waiting = spawn_rank(1, 2, free_port(), &[job.to_str().unwrap()]);
    at_the_rendezvous(&mut waiting);
    unsafe { libc::kill(waiting.id() as i32, libc::SIGTERM) };
    // A launcher (torchrun, srun) stopping a run that never started does not wait for it.
    let ended = finish(waiting, Duration::from_secs(5));
    assert_ne!(ended.code, Some(0));
}

/// A rank waiting at the rendezvous ends on SIGINT (exit 130) with nothing written, even
/// when it inherited SIGINT ignored, as a shell's background job (`trainer run ... &` in a
/// script) does: it waited out parallel.timeout, 10 minutes, and a second Ctrl-C too.
#[test]
fn a_rank_waiting_at_the_rendezvous_stops_on_sigint_even_started_with_it_ignored() {
    use std::os::unix::process::CommandExt;
    let _turn = one_at_a_time();
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), JOB);
    let runs = tmp.path().join("runs");
    for rank in [0, 1] {
        let runs_arg = runs.to_str().unwrap();
        let args = [job.to_str().unwrap(), "--runs-dir", runs_arg];
        let mut command = rank_command(rank, 2, free_port(), &args, &[]);
        // SAFETY: setting a disposition to SIG_IGN between fork and exec is async-signal-safe.
        unsafe {
            command.pre_exec(|| {
                libc::signal(libc::SIGINT, libc::SIG_IGN);
                Ok(())
            });
        }
        let mut waiting = command.spawn().unwrap();
        at_the_rendezvous(&mut waiting);
        unsafe { libc::kill(waiting.id() as i32, libc::SIGINT) };
        let ended = finish(waiting, Duration::from_secs(5));
        assert_eq!(ended.code, Some(130), "rank {rank}: {}", ended.stderr);
        assert!(
            ended
                .stderr
                .contains("stopped by SIGINT during the rendezvous"),
            "rank {rank}: {}",
            ended.stderr
        );
        assert!(!runs.exists(), "nothing is written before training");
    }
}

/// Rank 0 whose MASTER_PORT another process holds says so and what to change (exit 1: the
/// job is fine, the machine is busy), with nothing written.
#[test]
fn rank_zero_on_a_port_in_use_names_master_port() {
    let _turn = one_at_a_time();
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), JOB);
    let runs = tmp.path().join("runs");
    let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = holder.local_addr().unwrap().port();
    let args = [job.to_str().unwrap(), "--runs-dir", runs.to_str().unwrap()];
    let ended = finish(spawn_rank(0, 2, port, &args), Duration::from_secs(10));
    assert_eq!(ended.code, Some(1), "{}", ended.stderr);
    assert!(
        ended.stderr.contains("another MASTER_PORT"),
        "{}",
        ended.stderr
    );
    assert!(!runs.exists(), "nothing is written before training");
}

/// `trainer run` of a job whose replicas are processes: it starts one rank per replica
/// itself (parallel.devices of GPUs, or parallel.launch = "processes" as here on the CPU).
fn launch(args: &[&str]) -> Child {
    Command::new(trainer_bin())
        .arg("run")
        .args(args)
        .current_dir(common::root())
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn a_run_that_launches_a_process_per_replica_trains_what_threaded_replicas_train() {
    let _turn = one_at_a_time();
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), JOB);
    let job = job.to_str().unwrap();
    let runs = tmp.path().join("launched");
    let ended = finish(
        launch(&[
            job,
            "--runs-dir",
            runs.to_str().unwrap(),
            "--set",
            "parallel.devices=[\"cpu\", \"cpu\"]",
            "--set",
            "parallel.launch=\"processes\"",
        ]),
        Duration::from_secs(120),
    );
    let dir = run_dir_of(&ended);
    assert_eq!(only_run_dir(&runs), dir, "one run directory, rank 0's");
    for line in [
        "starting 2 processes, one per replica (cpu, cpu)",
        "[rank 1 cpu]  INFO rank 1: the run completed",
        "[rank 0 cpu]  INFO done:",
    ] {
        assert!(ended.stderr.contains(line), "{line}\n{}", ended.stderr);
    }
    let threads = tmp.path().join("threads");
    let reference = run_alone(&[
        job,
        "--runs-dir",
        threads.to_str().unwrap(),
        "--set",
        "parallel.devices=[\"cpu\", \"cpu\"]",
    ]);
    assert_eq!(numbers(&dir), numbers(&reference));
    assert_eq!(model(&dir), model(&reference));
    let config = std::fs::read_to_string(dir.join("config.toml")).unwrap();
    assert!(
        config.contains("# device: 2 processes (rank 0 of 2)"),
        "{config}"
    );
}

/// Ctrl-C as the launcher starts its ranks, before they can catch it: the run is stopped
/// (exit 130), not reported as a rank that crashed.
#[test]
fn a_signal_as_the_ranks_start_is_a_stop_not_a_crash() {
    use std::io::BufRead;
    let _turn = one_at_a_time();
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), LONG_JOB);
    let runs = tmp.path().join("runs");
    let mut launcher = launch(&[
        job.to_str().unwrap(),
        "--runs-dir",
        runs.to_str().unwrap(),
        "--set",
        "parallel.replicas=2",
        "--set",
        "parallel.launch=\"processes\"",
    ]);
    let mut stderr = std::io::BufReader::new(launcher.stderr.take().unwrap());
    let mut seen = String::new();
    while !seen.contains("starting 2 processes") {
        assert_ne!(stderr.read_line(&mut seen).unwrap(), 0, "{seen}");
    }
    unsafe { libc::kill(launcher.id() as i32, libc::SIGINT) };
    let status = launcher.wait().unwrap();
    stderr.read_to_string(&mut seen).unwrap();
    assert_eq!(status.code(), Some(130), "{seen}");
    assert!(!seen.contains("was killed"), "{seen}");
}

#[test]
fn a_signal_to_a_launching_run_stops_every_rank_with_a_checkpoint_to_resume() {
    let _turn = one_at_a_time();
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), &LONG_JOB.replace("epochs = 5", "epochs = 1"));
    let runs = tmp.path().join("runs");
    let (job, runs_arg) = (job.to_str().unwrap(), runs.to_str().unwrap());
    let processes = [
        "--set",
        "parallel.replicas=2",
        "--set",
        "parallel.launch=\"processes\"",
    ];
    let mut args = vec![job, "--runs-dir", runs_arg];
    args.extend_from_slice(&processes);
    let launcher = launch(&args);
    wait_for_checkpoint(&runs);
    // As Ctrl-C in a terminal: the launcher gets it, and passes it to rank 0 once.
    unsafe { libc::kill(launcher.id() as i32, libc::SIGINT) };
    let ended = finish(launcher, Duration::from_secs(60));
    assert_eq!(ended.code, Some(130), "{}", ended.stderr);
    for line in [
        "passing SIGINT on to rank 0",
        "[rank 0 cpu] stopped by SIGINT after step",
        "[rank 1 cpu] rank 1: the run stopped on signal 2",
    ] {
        assert!(ended.stderr.contains(line), "{line}\n{}", ended.stderr);
    }
    let dir = only_run_dir(&runs);
    assert_eq!(summary(&dir)["status"], "interrupted");

    let mut again = vec![
        job,
        "--runs-dir",
        runs_arg,
        "--resume",
        dir.to_str().unwrap(),
    ];
    again.extend_from_slice(&processes);
    let resumed = finish(launch(&again), Duration::from_secs(120));
    assert_eq!(run_dir_of(&resumed), dir);
    assert_trains_like_two_threaded_replicas(job, tmp.path(), &dir);
}

/// A rank killed from outside is named as the cause, with its signal; rank 0, which failed
/// because it lost that rank, ends in the same moment (it was reported instead).
#[test]
fn a_launching_run_names_the_rank_that_was_killed() {
    let _turn = one_at_a_time();
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(tmp.path(), LONG_JOB);
    let runs = tmp.path().join("runs");
    let launcher = launch(&[
        job.to_str().unwrap(),
        "--runs-dir",
        runs.to_str().unwrap(),
        "--set",
        "parallel.replicas=2",
        "--set",
        "parallel.launch=\"processes\"",
    ]);
    wait_for_checkpoint(&runs);
    let id = launcher.id();
    let children = std::fs::read_to_string(format!("/proc/{id}/task/{id}/children")).unwrap();
    let rank_one = children
        .split_whitespace()
        .map(|p| p.parse::<i32>().unwrap())
        .find(|p| {
            std::fs::read(format!("/proc/{p}/environ"))
                .is_ok_and(|env| env.split(|&b| b == 0).any(|v| v == b"RANK=1"))
        })
        .expect("the launcher's rank-1 process");
    unsafe { libc::kill(rank_one, libc::SIGKILL) };
    let ended = finish(launcher, Duration::from_secs(60));
    assert_eq!(ended.code, Some(1), "{}", ended.stderr);
    let last = ended.stderr.lines().last().unwrap_or_default();
    assert!(
        last.contains("rank 1 (cpu) was killed (signal 9)"),
        "{}",
        ended.stderr
    );
}

#[test]
fn replica_processes_are_refused_clearly_where_they_cannot_run() {
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(
        tmp.path(),
        &JOB.replace("type = \"cpu\"", "type = \"auto\""),
    );
    let job = job.to_str().unwrap();
    let gpus = "parallel.devices=[\"cuda:0\", \"cuda:1\"]";
    type Env<'a> = &'a [(&'a str, &'a str)];
    let cases: [(&[&str], Env, &str); 4] = [
        (
            &["--set", gpus, "--set", "parallel.launch=\"threads\""],
            &[],
            "key `parallel.launch`: \"threads\" given, but the replicas are on GPUs",
        ),
        (
            &["--set", gpus, "--set", "device.type=\"cpu\""],
            &[],
            "key `device.type`: \"cpu\" given, but parallel.devices lists GPUs",
        ),
        (
            &["--set", gpus, "--set", "device.type=\"cuda:1\""],
            &[],
            "key `device.type`: \"cuda:1\" given, but parallel.devices lists the GPUs",
        ),
        // Under another launcher the list is this machine's devices, one per LOCAL_RANK.
        (
            &["--set", gpus],
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "3"),
                ("LOCAL_WORLD_SIZE", "3"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", "1"),
            ],
            "key `parallel.devices`: 2 device(s) given in a multi-process run (RANK=0, \
             WORLD_SIZE=3, LOCAL_WORLD_SIZE=3 in the environment)",
        ),
    ];
    for (extra, env, needle) in cases {
        let mut args = vec!["run", job];
        args.extend_from_slice(extra);
        let o = trainer_with_env(&args, env);
        assert_eq!(o.status.code(), Some(2), "{}", common::stderr(&o));
        assert!(
            common::stderr(&o).contains(needle),
            "{}",
            common::stderr(&o)
        );
    }
    // Without a GPU, "all" is none: a clear error.
    if !matches!(trainer::tensor::cuda::probe(), Ok((d, _)) if !d.is_empty()) {
        let o = trainer_with_env(&["run", job, "--set", "parallel.devices=\"all\""], &[]);
        assert_eq!(o.status.code(), Some(2), "{}", common::stderr(&o));
        assert!(
            common::stderr(&o).contains("key `parallel.devices`: \"all\" given, but"),
            "{}",
            common::stderr(&o)
        );
    }
}

/// device.data = "streamed" (each batch gathered from host memory into the network's input,
/// the path a GPU takes when the data set does not fit) trains what the resident data set
/// trains: on rank 0 and the other ranks, and in evaluation.
#[test]
fn a_streamed_data_set_trains_what_a_resident_one_trains() {
    let _turn = one_at_a_time();
    let tmp = tempfile::tempdir().unwrap();
    let job = write_job(
        tmp.path(),
        &JOB.replace("batch_size = 24", "batch_size = 24\nval_fraction = 0.2"),
    );
    let job = job.to_str().unwrap();
    let mut dirs = Vec::new();
    for data in ["resident", "streamed"] {
        let runs = tmp.path().join(data);
        let placement = format!("device.data=\"{data}\"");
        let ended = finish(
            launch(&[
                job,
                "--runs-dir",
                runs.to_str().unwrap(),
                "--set",
                "parallel.replicas=2",
                "--set",
                "parallel.launch=\"processes\"",
                "--set",
                &placement,
            ]),
            Duration::from_secs(120),
        );
        dirs.push(run_dir_of(&ended));
    }
    let (header, rows) = read_csv(&dirs[1].join("metrics.csv"));
    assert!(rows
        .iter()
        .any(|r| common::column(&header, r, "split") == "val"));
    assert_eq!(numbers(&dirs[0]), numbers(&dirs[1]));
    assert_eq!(model(&dirs[0]), model(&dirs[1]));
}
