//! `trainer sweep --devices cpu,cpu` (or `cuda:0,cuda:1`): points side by side, one per
//! listed device (a slot) at a time; a slot that becomes free takes the next point.
//!
//! Each point is a child process of this program (`trainer run JOB --set ...
//! --run-dir POINT`, or `--resume POINT` to continue one), so points share nothing: each has
//! its own signal handlers, thread pool, CUDA context and train.log, and a point that crashes
//! or is killed takes no other point with it. This process only schedules, relays the
//! points' stderr with a `[NNN device]` prefix, and rewrites sweep.csv whenever a point starts
//! or ends.
//!
//! Signals: the points stay in this process's process group, so Ctrl-C (SIGINT to the
//! terminal's foreground group) reaches each point once, directly: each stops after its step
//! with a checkpoint, as a lone run does, and this process, which gets the same signal, starts
//! no more points and exits 130 once they have ended. A second Ctrl-C ends everything at
//! once. A signal sent to this process alone only stops it from starting more points; the
//! running ones finish. Killing this process (SIGKILL) leaves the running points to finish:
//! a re-run of the sweep leaves points that are still training alone.

use super::{interrupted, Pending, Sweep, Trained};
use crate::commands::{Need, Place};
use crate::error::{Error, Result};
use crate::signals::{Stop, SIGINT, SIGTERM};
use crate::spec::{parse_device, DeviceChoice, JobSpec};
use crate::tensor::cuda;
use crate::train::parallel::launch;
use crate::{job_err, runtime_err};
use std::collections::VecDeque;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A place for one point at a time.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Slot {
    /// What the point's device.type is set to.
    pub device: String,
    /// The CPU threads a point in this slot may use: the cores divided among the slots that
    /// train on the CPU. None on a GPU (its loop needs one thread).
    pub threads: Option<usize>,
}

/// Parses `--devices`: comma-separated device names, with device.type's rules (auto, cpu,
/// cuda, cuda:N).
pub(super) fn parse(value: &str) -> Result<Vec<Slot>> {
    let allowed = "allowed: auto, cpu, cuda, cuda:N, comma-separated, one per point that runs \
                   at a time, e.g. --devices cuda:0,cuda:1 or --devices cpu,cpu";
    let mut names = Vec::new();
    for name in value.split(',').map(str::trim) {
        if name.is_empty() {
            return Err(job_err!(
                "--devices {value:?}: an empty device name; {allowed}"
            ));
        }
        if parse_device(name).is_none() {
            return Err(job_err!(
                "--devices {value:?}: \"{name}\" is not a device; {allowed}"
            ));
        }
        names.push(name.to_string());
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    Ok(slots(names, cores))
}

/// Every CUDA device among the slots is on this machine: checked before the sweep's
/// directory is made (a point would otherwise find out when it starts).
pub(super) fn check_present(slots: &[Slot], value: &str) -> Result<()> {
    let mut gpus = None; // probed once, if a slot is a GPU
    for name in distinct(slots) {
        let Some(DeviceChoice::Cuda(n)) = parse_device(name) else {
            continue;
        };
        let found = gpus.get_or_insert_with(|| cuda::probe().map(|(devices, _)| devices.len()));
        let why = match found.clone() {
            Err(why) => why,
            Ok(count) if n >= count => format!(
                "this machine has {count} GPU{} (cuda:0 to cuda:{})",
                if count == 1 { "" } else { "s" },
                count.saturating_sub(1)
            ),
            Ok(_) => continue,
        };
        return Err(job_err!("--devices {value:?}: {name} requested, but {why}"));
    }
    Ok(())
}

/// The slots for `names` on a machine with `cores` CPU threads. `auto` counts as a CPU slot
/// for the split: on a GPU its points leave train.threads unused.
fn slots(names: Vec<String>, cores: usize) -> Vec<Slot> {
    let on_cpu = |name: &str| name == "cpu" || name == "auto";
    let cpu_slots = names.iter().filter(|n| on_cpu(n)).count();
    let share = (cores / cpu_slots.max(1)).max(1);
    names
        .into_iter()
        .map(|device| Slot {
            threads: on_cpu(&device).then_some(share),
            device,
        })
        .collect()
}

/// The different devices among the slots, in order (each point is validated on each).
pub(super) fn distinct(slots: &[Slot]) -> Vec<&str> {
    let mut out: Vec<&str> = Vec::new();
    for s in slots {
        if !out.contains(&s.device.as_str()) {
            out.push(&s.device);
        }
    }
    out
}

/// Points side by side on one device share its memory, and each was checked alone: this
/// warns where the largest of them, as many as there are slots on the device, plan more
/// together than it has. Only a warning: which points meet depends on the order they end in,
/// and a point that runs out of memory fails alone (`--retry-failed` trains it again).
/// `needs`: per point to train, its plan on each of `distinct(slots)`, in that order.
pub(super) fn warn_of_shared_memory(slots: &[Slot], needs: &[Vec<Need>]) {
    for crowd in crowded(slots, needs) {
        tracing::warn!("{}", crowd.warning());
    }
}

impl Crowd<'_> {
    fn warning(&self) -> String {
        let place = self.place;
        let has = match place {
            Place::Host => "has free",
            Place::Gpu(_) => "has",
        };
        format!(
            "up to {n} points train side by side on {place} (--devices {listed}), and the {n} \
             largest plan {together} together where {place} {has} {room}: a point that runs \
             out of memory fails (--retry-failed trains it again); to avoid it, list fewer \
             slots on {place}, or lower data.batch_size or the model's sizes",
            n = self.side_by_side,
            listed = self.listed.join(","),
            together = crate::commands::bytes(self.together),
            room = crate::commands::bytes(self.room),
        )
    }
}

/// A device whose points side by side may need more than it has.
#[derive(Debug, PartialEq)]
struct Crowd<'a> {
    place: Place,
    /// The slots that train there, as --devices names them.
    listed: Vec<&'a str>,
    side_by_side: usize,
    together: usize,
    room: usize,
}

fn crowded<'a>(slots: &'a [Slot], needs: &[Vec<Need>]) -> Vec<Crowd<'a>> {
    // Each place (slots named "cuda" and "cuda:0" are one GPU) with its slots and room.
    let mut places: Vec<(Place, Vec<&str>, Option<usize>)> = Vec::new();
    for (d, name) in distinct(slots).into_iter().enumerate() {
        let Some(need) = needs.iter().find_map(|on| on.get(d)) else {
            return Vec::new(); // nothing to train
        };
        let listed = slots
            .iter()
            .filter(|s| s.device == name)
            .map(|s| s.device.as_str());
        match places.iter_mut().find(|p| p.0 == need.place) {
            Some(p) => p.1.extend(listed),
            None => places.push((need.place, listed.collect(), need.room)),
        }
    }
    let mut crowds = Vec::new();
    for (place, listed, room) in places {
        let Some(room) = room else { continue };
        // Each point's plan there (the largest, if two slot names lead to this place).
        let mut each: Vec<usize> = needs
            .iter()
            .map(|on| {
                on.iter()
                    .filter(|n| n.place == place)
                    .map(|n| n.bytes)
                    .max()
            })
            .map(Option::unwrap_or_default)
            .collect();
        each.sort_unstable_by(|a, b| b.cmp(a));
        let side_by_side = listed.len().min(each.len());
        let together = each[..side_by_side].iter().sum::<usize>();
        if side_by_side > 1 && together > room {
            crowds.push(Crowd {
                place,
                listed,
                side_by_side,
                together,
                room,
            });
        }
    }
    crowds
}

/// The override that puts a point on `device`.
pub(super) fn device_set(device: &str) -> String {
    format!("device.type=\"{device}\"")
}

/// `--devices` decides device.type: the key may not also be swept or set.
pub(super) fn check_keys<'a>(
    swept: impl Iterator<Item = &'a str>,
    sets: &'a [String],
) -> Result<()> {
    let set_keys = sets
        .iter()
        .filter_map(|s| s.split_once('=').map(|(k, _)| k.trim()));
    match swept.chain(set_keys).find(|k| *k == "device.type") {
        Some(_) => Err(job_err!(
            "--devices sets device.type for every point; leave device.type out of --grid, \
             --zip and --set (or leave out --devices)"
        )),
        None => Ok(()),
    }
}

/// A point training in a child process.
struct Running {
    index: usize,
    slot: usize,
    child: Child,
    /// Relays the child's stderr; returns its last `error: ` line.
    relay: JoinHandle<Option<String>>,
    started: Instant,
}

/// How a point's process ended.
enum Ended {
    Completed,
    /// Failed while training (its summary.json says why), crashed, or was killed.
    Failed(String),
    /// Its job or checkpoint was refused (exit 2): every point would be, so the sweep stops.
    BadJob(String),
    /// Stopped by SIGINT or SIGTERM (the signal, and which point): the sweep stops too.
    Interrupted(i32, String),
}

/// Trains `todo` with one point per slot at a time. A bad job, a stop signal or a point that
/// cannot be started stops the launching of points; the running ones are waited for, then
/// the sweep ends with that error.
pub(super) fn run_side_by_side(
    sweep: &Sweep,
    todo: Vec<Pending>,
    slots: &[Slot],
    specs: &[JobSpec],
) -> Result<Trained> {
    let mut trained = Trained::default();
    if todo.is_empty() {
        return Ok(trained);
    }
    if let Some(share) = slots.iter().find_map(|s| s.threads) {
        tracing::info!(
            "points on the CPU use train.threads = {share} (or fewer if their job says so), \
             their share of the cores"
        );
    }
    let program = std::env::current_exe()
        .map_err(|e| runtime_err!("cannot find this program to run the sweep points: {e}"))?;
    let stop = Stop::install()
        .map_err(|e| runtime_err!("cannot install the SIGINT/SIGTERM handlers: {e}"))?;
    let mut queue: VecDeque<Pending> = todo.into();
    let mut running: Vec<Option<Running>> = slots.iter().map(|_| None).collect();
    // Why no more points start.
    let mut halt: Option<Error> = None;
    loop {
        if halt.is_none() {
            if let Some(signal) = stop.requested() {
                tracing::warn!("signal received: starting no more points");
                halt = Some(interrupted(
                    signal,
                    "it started no more points and waited for the running ones",
                ));
            }
        }
        let mut changed = false;
        for place in running.iter_mut() {
            let Some(point) = place else { continue };
            let status = match point.child.try_wait() {
                Ok(Some(status)) => status,
                Ok(None) => continue,
                Err(e) => {
                    tracing::warn!("cannot wait for point process {}: {e}", point.child.id());
                    continue;
                }
            };
            let Some(point) = place.take() else { continue };
            changed = true;
            match finish(sweep, point, status, slots) {
                Ended::Completed => {}
                Ended::Failed(why) => {
                    tracing::warn!("{why}");
                    trained.failed += 1;
                }
                Ended::BadJob(why) => {
                    halt.get_or_insert(job_err!("{why}"));
                }
                Ended::Interrupted(signal, which) => {
                    halt.get_or_insert_with(|| {
                        interrupted(signal, &format!("{which} was stopped"))
                    });
                }
            }
        }
        if halt.is_none() {
            for (slot, place) in running.iter_mut().enumerate() {
                if place.is_some() {
                    continue;
                }
                let Some(pending) = queue.pop_front() else {
                    break;
                };
                if pending.taken_since_planned(sweep) {
                    trained.taken += 1;
                    continue;
                }
                let index = pending.index;
                match launch(sweep, &program, pending, slot, &slots[slot], &specs[index]) {
                    Ok(point) => *place = Some(point),
                    Err(e) => {
                        halt = Some(e);
                        break;
                    }
                }
                changed = true;
            }
        }
        if changed {
            let now: Vec<usize> = running.iter().flatten().map(|r| r.index).collect();
            sweep.write_index(&now)?;
        }
        if running.iter().all(Option::is_none) && (queue.is_empty() || halt.is_some()) {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    match halt {
        Some(e) => Err(e),
        None => Ok(trained),
    }
}

/// Starts a point's process in `slot`.
fn launch(
    sweep: &Sweep,
    program: &std::path::Path,
    pending: Pending,
    slot: usize,
    on: &Slot,
    spec: &JobSpec,
) -> Result<Running> {
    let index = pending.index;
    let args = sweep.args;
    let point_dir = &sweep.point_dirs[index];
    let mut sets = sweep.sets(index);
    sets.push(device_set(&on.device));
    // The job's own thread count stands when it fits the slot's share of the cores.
    if let Some(share) = on.threads {
        if spec.train.threads.is_none_or(|own| own > share) {
            sets.push(format!("train.threads={share}"));
        }
    }
    let mut cmd = Command::new(program);
    cmd.arg("run")
        .arg(&args.job)
        .arg("--runs-dir")
        .arg(&args.runs_dir);
    if let Some(name) = &args.name {
        cmd.arg("--name").arg(name);
    }
    for set in &sets {
        cmd.arg("--set").arg(set);
    }
    match &pending.resume {
        Some(run) => cmd.arg("--resume").arg(run).arg("--resume-fallback"),
        None => cmd.arg("--run-dir").arg(point_dir),
    };
    if args.quiet {
        cmd.arg("--quiet");
    }
    // stdout carries only the run directory, which sweep.csv names.
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| {
        runtime_err!(
            "{}: cannot start {}: {e}",
            sweep.label(index),
            program.display()
        )
    })?;
    tracing::info!(
        "{} on {}: {} (pid {})",
        sweep.label(index),
        on.device,
        point_dir.display(),
        child.id()
    );
    let prefix = format!("[{index:03} {}] ", on.device);
    let stderr = child.stderr.take();
    let relay = std::thread::spawn(move || stderr.and_then(|s| launch::relay(s, &prefix)));
    Ok(Running {
        index,
        slot,
        child,
        relay,
        started: Instant::now(),
    })
}

/// What a point's exit status means for the sweep.
fn finish(sweep: &Sweep, point: Running, status: ExitStatus, slots: &[Slot]) -> Ended {
    let label = sweep.label(point.index);
    let device = &slots[point.slot].device;
    // The relay ends when the pipe closes, which the exit has done.
    let error = point.relay.join().ok().flatten();
    let log = sweep.point_dirs[point.index].join("train.log");
    let signalled = |signal: i32| signal == SIGINT || signal == SIGTERM;
    match (status.code(), status.signal()) {
        (Some(0), _) => {
            tracing::info!(
                "{label}: completed on {device} in {:.1} s",
                point.started.elapsed().as_secs_f64()
            );
            Ended::Completed
        }
        (Some(2), _) => Ended::BadJob(format!(
            "{label}: {}",
            error.unwrap_or_else(|| "its job was refused (exit 2)".into())
        )),
        (Some(code), _) if code > 128 && signalled(code - 128) => {
            Ended::Interrupted(code - 128, label)
        }
        (None, Some(signal)) if signalled(signal) => Ended::Interrupted(signal, label),
        (Some(code), _) => Ended::Failed(format!(
            "{label} failed on {device} (exit {code}): {}; see {}",
            error.unwrap_or_else(|| "no error message".into()),
            log.display()
        )),
        (None, signal) => Ended::Failed(format!(
            "{label} on {device} was killed (signal {}); see {}",
            signal.map_or("unknown".into(), |s| s.to_string()),
            log.display()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn need(place: Place, gib: usize, room_gib: Option<usize>) -> Need {
        Need {
            place,
            plan: Default::default(),
            bytes: gib << 30,
            room: room_gib.map(|r| r << 30),
        }
    }

    /// Two slots on one 80 GiB GPU: the two largest points (50 + 40 GiB) may meet there;
    /// each fits alone. A third point of 10 GiB does not change the worst case.
    #[test]
    fn the_largest_points_side_by_side_on_one_gpu_are_warned_of() {
        let slots = slots(vec!["cuda:0".into(), "cuda".into()], 16);
        let gpu = Place::Gpu(0);
        let needs: Vec<Vec<Need>> = [50, 10, 40]
            .into_iter()
            .map(|gib| vec![need(gpu, gib, Some(80)), need(gpu, gib, Some(80))])
            .collect();
        assert_eq!(
            crowded(&slots, &needs),
            [Crowd {
                place: gpu,
                listed: vec!["cuda:0", "cuda"],
                side_by_side: 2,
                together: 90 << 30,
                room: 80 << 30,
            }]
        );
        // 40 + 30 fit in 80; one slot per GPU never crowds it; one point meets nobody.
        let fitting: Vec<Vec<Need>> = [40, 30, 10]
            .into_iter()
            .map(|gib| vec![need(gpu, gib, Some(80)), need(gpu, gib, Some(80))])
            .collect();
        assert_eq!(crowded(&slots, &fitting), []);
        let apart = super::slots(vec!["cuda:0".into(), "cuda:1".into()], 16);
        let two_gpus: Vec<Vec<Need>> = [50, 40]
            .into_iter()
            .map(|gib| vec![need(gpu, gib, Some(80)), need(Place::Gpu(1), gib, Some(80))])
            .collect();
        assert_eq!(crowded(&apart, &two_gpus), []);
        assert_eq!(crowded(&slots, &needs[..1]), []);
    }

    /// CPU slots share the host's free memory; a room that cannot be read is not guessed.
    #[test]
    fn cpu_slots_share_the_host_memory_and_an_unknown_room_is_not_judged() {
        let slots = slots(vec!["cpu".into(), "cpu".into(), "cpu".into()], 6);
        let host = |gib, room| vec![need(Place::Host, gib, room)];
        let needs = vec![host(3, Some(8)), host(3, Some(8)), host(3, Some(8))];
        let crowds = crowded(&slots, &needs);
        assert_eq!(crowds.len(), 1);
        assert_eq!((crowds[0].side_by_side, crowds[0].together), (3, 9 << 30));
        assert_eq!(
            crowds[0].warning(),
            "up to 3 points train side by side on this machine (--devices cpu,cpu,cpu), and \
             the 3 largest plan 9.00 GiB together where this machine has free 8.00 GiB: a \
             point that runs out of memory fails (--retry-failed trains it again); to avoid \
             it, list fewer slots on this machine, or lower data.batch_size or the model's \
             sizes"
        );
        let unknown = vec![host(3, None), host(3, None), host(3, None)];
        assert_eq!(crowded(&slots, &unknown), []);
    }

    #[test]
    fn cpu_slots_share_the_cores_and_gpus_take_none() {
        let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let threads = |s: &[Slot]| s.iter().map(|s| s.threads).collect::<Vec<_>>();
        assert_eq!(
            threads(&slots(names(&["cpu", "cpu"]), 16)),
            [Some(8), Some(8)]
        );
        assert_eq!(
            threads(&slots(names(&["cpu", "cpu", "cpu"]), 2)),
            [Some(1); 3]
        );
        assert_eq!(
            threads(&slots(names(&["cuda:0", "cuda:1", "cpu"]), 16)),
            [None, None, Some(16)]
        );
        assert_eq!(
            threads(&slots(names(&["auto", "cpu"]), 8)),
            [Some(4), Some(4)]
        );
    }

    #[test]
    fn devices_are_checked_like_device_type() {
        assert_eq!(parse("cpu, cuda:1").unwrap()[1].device, "cuda:1");
        for bad in ["gpu", "cpu,,cpu", "", "cuda:x", "cpu,CUDA"] {
            let e = parse(bad).unwrap_err().to_string();
            assert!(
                e.starts_with("--devices") && e.contains("allowed: auto, cpu"),
                "{e}"
            );
        }
        let slots = parse("cpu,cuda:0,cpu").unwrap();
        assert_eq!(distinct(&slots), ["cpu", "cuda:0"]);
    }
}
