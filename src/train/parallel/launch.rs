//! `trainer run` of a job whose replicas are processes: parallel.devices lists GPUs (one
//! process drives one GPU, as DDP recommends), or parallel.launch = "processes". This
//! process trains nothing: it starts one `trainer run` per replica with RANK, WORLD_SIZE,
//! LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set as torchrun sets them (so
//! the ranks are exactly a multi-process run, `processes`), relays their stderr
//! prefixed with the rank and its device, prints rank 0's run directory, and ends as the
//! ranks end.
//!
//! Signals: the ranks run in a process group of their own, so a terminal's Ctrl-C reaches
//! this process only, and it passes every SIGINT and SIGTERM on to rank 0, which stops the
//! whole run after its step with a checkpoint (a second one stops it at once), as a lone run
//! does. On Linux a rank also gets SIGTERM if this process dies, so no rank outlives it.
//! Ending: rank 0 ends the others itself (it tells them, or its connections close), and a
//! rank that fails closes its connection to rank 0, which then fails naming it. Ranks that
//! wait where no connection tells them (for a rank that never started, say) would wait for
//! parallel.timeout, so once rank 0 has ended or a rank has failed, the ranks still running
//! a grace period later get SIGTERM, and SIGKILL two grace periods after that.

use crate::error::{Error, Result};
use crate::runtime_err;
use crate::signals::{Received, SIGINT, SIGTERM};
use crate::spec::JobSpec;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long ranks may outlive rank 0 before they are told to stop.
const GRACE: Duration = Duration::from_secs(5);

/// A rank's process.
struct Rank {
    device: String,
    child: Child,
    /// Relays its stderr; returns its last `error: ` line.
    relay: Option<JoinHandle<Option<String>>>,
    /// How and when it ended.
    ended: Option<(ExitStatus, Instant)>,
}

/// Starts the job's replicas as processes and waits for them (rank 0 prints the run
/// directory).
/// `run_arguments` are this `trainer run`'s own arguments, which every rank gets.
pub fn run(run_arguments: &[OsString], spec: &JobSpec) -> Result<()> {
    let world = spec.parallel.replicas().unwrap_or(1);
    let devices = rank_devices(spec, world);
    let program = std::env::current_exe()
        .map_err(|e| runtime_err!("cannot find this program to start the replicas: {e}"))?;
    // Caught before anything is said: a Ctrl-C that follows the "starting" line must be
    // passed on to the ranks, not end this process by the default action.
    let signals =
        Received::install().map_err(|e| runtime_err!("cannot install the signal handlers: {e}"))?;
    let port = free_port()?;
    tracing::info!(
        "starting {world} processes, one per replica ({}), meeting on 127.0.0.1:{port}",
        devices.join(", ")
    );
    let mut ranks = Vec::with_capacity(world);
    for (rank, device) in devices.iter().enumerate() {
        let mut cmd = rank_command(&program, run_arguments, rank, world, port);
        let mut child = match cmd.spawn() {
            Ok(child) => child,
            Err(e) => {
                stop_all(&mut ranks);
                return Err(runtime_err!(
                    "cannot start rank {rank} ({}): {e}",
                    program.display()
                ));
            }
        };
        let prefix = format!("[rank {rank} {device}] ");
        let stderr = child.stderr.take();
        let relay = std::thread::spawn(move || stderr.and_then(|s| relay(s, &prefix)));
        ranks.push(Rank {
            device: device.clone(),
            child,
            relay: Some(relay),
            ended: None,
        });
    }
    watch(&mut ranks, &signals);
    match outcome(&mut ranks) {
        None => Ok(()),
        Some(e) => Err(e),
    }
}

/// Each rank's device, for its log prefix: its parallel.devices entry, else `device.type`
/// as a rank resolves it (`commands::pick_device`): "cuda" and "auto" with a usable GPU are
/// the rank's own GPU (LOCAL_RANK), "auto" without one is the CPU.
fn rank_devices(spec: &JobSpec, world: usize) -> Vec<String> {
    use crate::tensor::cuda;
    if let Some(crate::spec::ParallelDevices::List(list)) = &spec.parallel.devices {
        return list.clone();
    }
    let kind = spec.device.kind.as_str();
    let own_gpu = kind == "cuda"
        || kind == "auto"
            && cuda::probe().is_ok_and(|(devices, _)| !devices.is_empty())
            && cuda::libraries_missing().is_none();
    (0..world)
        .map(|rank| match kind {
            _ if own_gpu => format!("cuda:{rank}"),
            "auto" => "cpu".into(),
            _ => kind.into(),
        })
        .collect()
}

/// `trainer run` with this run's arguments, as `rank` of `world`.
fn rank_command(
    program: &std::path::Path,
    run_arguments: &[OsString],
    rank: usize,
    world: usize,
    port: u16,
) -> Command {
    let mut cmd = Command::new(program);
    cmd.arg("run").args(run_arguments);
    cmd.env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        // Not under torchrun's agent, whatever our own environment says.
        .env_remove("TORCHELASTIC_USE_AGENT_STORE")
        .stdin(Stdio::null())
        // Rank 0 prints the run directory, on this process's stdout as `trainer run` would.
        .stdout(if rank == 0 {
            Stdio::inherit()
        } else {
            Stdio::null()
        })
        .stderr(Stdio::piped())
        // A group of its own: Ctrl-C reaches this process, which passes it to rank 0 once.
        .process_group(0);
    #[cfg(target_os = "linux")]
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
    cmd
}

/// Polls the ranks until every one has ended: passes signals on to rank 0, and stops the
/// ranks still running a grace period after the run began to end.
fn watch(ranks: &mut [Rank], signals: &Received) {
    let mut terminated = false;
    loop {
        for signal in signals.take() {
            match &ranks[0].ended {
                None => {
                    tracing::warn!("passing {} on to rank 0", crate::signals::name(signal));
                    send(&ranks[0].child, signal);
                }
                // Rank 0 is gone: the others have nothing to wait for.
                Some(_) => stop_all(ranks),
            }
        }
        // One time for the round: ranks found ended together are told apart by their cause.
        let now = Instant::now();
        for rank in ranks.iter_mut().filter(|r| r.ended.is_none()) {
            match rank.child.try_wait() {
                Ok(Some(status)) => rank.ended = Some((status, now)),
                Ok(None) => {}
                Err(e) => tracing::warn!("cannot wait for rank process {}: {e}", rank.child.id()),
            }
        }
        if ranks.iter().all(|r| r.ended.is_some()) {
            return;
        }
        // The run is ending since rank 0 ended or a rank failed.
        let ending = ranks
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.ended.filter(|(s, _)| i == 0 || !s.success()))
            .map(|(_, at)| at)
            .min();
        if let Some(since) = ending {
            if !terminated && since.elapsed() > GRACE {
                tracing::warn!("the run is ending; stopping the ranks still running");
                stop_all(ranks);
                terminated = true;
            }
            if since.elapsed() > 3 * GRACE {
                for rank in ranks.iter_mut().filter(|r| r.ended.is_none()) {
                    let _ = rank.child.kill();
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// SIGTERM to every rank still running.
fn stop_all(ranks: &mut [Rank]) {
    for rank in ranks.iter().filter(|r| r.ended.is_none()) {
        send(&rank.child, SIGTERM);
    }
}

fn send(child: &Child, signal: i32) {
    // SAFETY: kill has no memory effects; the pid is our child's, not yet reaped.
    unsafe {
        libc::kill(child.id() as libc::pid_t, signal);
    }
}

/// What the run's end means: None when every rank completed; else the error of the rank
/// that failed first (a rank failing after another is usually the consequence; among ranks
/// found ended in the same poll, one killed by a signal), with that rank's exit code class.
fn outcome(ranks: &mut [Rank]) -> Option<Error> {
    let mut failures: Vec<(Instant, usize, ExitStatus, Option<String>)> = Vec::new();
    for (index, rank) in ranks.iter_mut().enumerate() {
        let error = rank.relay.take().and_then(|r| r.join().ok()).flatten();
        if let Some((status, at)) = rank.ended {
            if !status.success() {
                failures.push((at, index, status, error));
            }
        }
    }
    // Found ended in the same round, a rank killed by a signal is the cause: the others
    // failed because they lost it.
    failures.sort_by_key(|f| (f.0, f.2.signal().is_none(), f.1));
    let (_, index, status, error) = failures.into_iter().next()?;
    let device = &ranks[index].device;
    let what = error.map_or_else(String::new, |e| format!(": {e}"));
    Some(match (status.code(), status.signal()) {
        (Some(2), _) => Error::Job(format!("rank {index} ({device}){what}")),
        (Some(code), _) if code == 128 + SIGINT || code == 128 + SIGTERM => Error::Interrupted {
            signal: code - 128,
            message: format!(
                "the ranks were stopped by {}",
                crate::signals::name(code - 128)
            ),
        },
        (Some(code), _) => runtime_err!("rank {index} ({device}) failed (exit {code}){what}"),
        // Killed by the signal itself: the rank had not yet installed its handlers, so it
        // had not begun training (the launcher passes SIGINT on; SIGTERM stops the ranks).
        (None, Some(signal)) if signal == SIGINT || signal == SIGTERM => Error::Interrupted {
            signal,
            message: format!(
                "rank {index} ({device}) was stopped by {} before it began training",
                crate::signals::name(signal)
            ),
        },
        (None, signal) => runtime_err!(
            "rank {index} ({device}) was killed (signal {}){what}",
            signal.map_or("unknown".into(), |s| s.to_string())
        ),
    })
}

/// A port on loopback that nothing listens on (rank 0 binds it a moment later).
fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")
        .map_err(|e| runtime_err!("cannot find a free port on 127.0.0.1: {e}"))?;
    listener
        .local_addr()
        .map(|a| a.port())
        .map_err(|e| runtime_err!("cannot find a free port on 127.0.0.1: {e}"))
}

/// Copies a child's stderr to ours line by line, each line prefixed (a line is written
/// whole, so the children's lines do not mix); returns the last `error: ` line.
pub(crate) fn relay(stderr: impl std::io::Read, prefix: &str) -> Option<String> {
    let mut reader = BufReader::new(stderr);
    let (mut line, mut last_error) = (Vec::new(), None);
    while reader.read_until(b'\n', &mut line).is_ok_and(|n| n > 0) {
        let text = String::from_utf8_lossy(&line);
        let text = text.trim_end_matches(['\n', '\r']);
        if let Some(message) = text.strip_prefix("error: ") {
            last_error = Some(message.to_string());
        }
        let _ = writeln!(std::io::stderr().lock(), "{prefix}{text}");
        line.clear();
    }
    last_error
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relayed_lines_are_prefixed_and_the_last_error_is_kept() {
        let text = "INFO a\nerror: first\nerror: second\nno newline";
        assert_eq!(
            relay(text.as_bytes(), "[000 cpu] "),
            Some("second".to_string())
        );
    }

    fn job_on(device: &str) -> JobSpec {
        let mlp = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("jobs/mlp.toml");
        let sets = [
            format!("device.type=\"{device}\""),
            "parallel.replicas=2".into(),
        ];
        crate::spec::load_job(&mlp, &sets).unwrap()
    }

    #[test]
    fn each_rank_is_labelled_with_the_device_it_resolves() {
        assert_eq!(rank_devices(&job_on("cpu"), 2), ["cpu", "cpu"]);
        assert_eq!(rank_devices(&job_on("cuda"), 2), ["cuda:0", "cuda:1"]);
        // "auto" is each rank's own GPU (LOCAL_RANK) where the driver shows a GPU and the
        // CUDA libraries load (the emulated GPU of tests/emulated_cuda too), else the CPU.
        use crate::tensor::cuda;
        let usable = cuda::probe().is_ok_and(|(devices, _)| !devices.is_empty())
            && cuda::libraries_missing().is_none();
        let want = if usable {
            ["cuda:0", "cuda:1"]
        } else {
            ["cpu", "cpu"]
        };
        assert_eq!(rank_devices(&job_on("auto"), 2), want);
    }
}
