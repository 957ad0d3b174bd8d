//! `trainer sweep`: one run per point of a grid of overrides, grouped in
//! `<runs-dir>/<name>/<sweep-id>/` with sweep.csv indexing the points. The points run one
//! after another in this process, or side by side with `--devices` (`devices`: one child
//! process per point, one point per listed device at a time).
//!
//! A point's directory name is fixed by its place in the grid (`002-lr=1e-3-batch_size=64`),
//! so the state of a sweep is its directory: re-running the same sweep (same resolved job, same
//! grid: the same sweep id) skips the points that finished and resumes or restarts the others.
//! Where the points run (`--devices`) is not part of the sweep id. sweep.csv is rebuilt from
//! the point directories and rewritten atomically whenever a point starts or ends.

mod devices;

use crate::commands::{self, RunArgs};
use crate::error::{Error, Result};
use crate::results::table::{Cell, Format, Table};
use crate::results::{RunRecord, Status};
use crate::signals::Stop;
use crate::spec::{
    canonical_keys, check_run_name, load_job, parse_set_arg, JobSpec, PrecisionFallback,
    PrecisionMode,
};
use crate::{job_err, provenance, runtime_err};
use std::path::{Path, PathBuf};

pub struct SweepArgs {
    pub job: PathBuf,
    /// Overrides shared by every point.
    pub sets: Vec<String>,
    /// `KEY=V1,V2,...`: every combination of the grid axes is a point.
    pub grid: Vec<String>,
    /// `KEY=V1,V2,...`: zipped keys move together, as one more axis of the grid.
    pub zip: Vec<String>,
    pub name: Option<String>,
    pub runs_dir: PathBuf,
    pub sweep_id: Option<String>,
    /// Run points that failed before again (a failure is otherwise final: same job, same
    /// seed, same result).
    pub retry_failed: bool,
    /// `--devices`, as given: a comma-separated list of devices (`cpu,cpu`,
    /// `cuda:0,cuda:1`); points run side by side, one per listed device, each in a child
    /// process of this program. None: one after another, in this process.
    pub devices: Option<String>,
    /// Points in child processes (`--devices`) print only warnings and errors too.
    pub quiet: bool,
}

/// One swept key with its values as given (TOML text, as for `--set`).
#[derive(Debug, Clone, PartialEq)]
struct Axis {
    key: String,
    values: Vec<String>,
}

/// One point: (key, value) overrides, in axis order.
type Point = Vec<(String, String)>;

/// A sweep being run: what training and indexing any of its points needs.
struct Sweep<'a> {
    args: &'a SweepArgs,
    dir: PathBuf,
    /// The swept keys, in axis order: sweep.csv's columns after `point`.
    keys: Vec<String>,
    points: Vec<Point>,
    point_dirs: Vec<PathBuf>,
    /// sweep.csv's metric columns, known from the points' jobs before any has run.
    metric_columns: Vec<String>,
}

impl Sweep<'_> {
    /// "sweep point 002 (optimizer.lr=0.1)": numbered as its directory, its sweep.csv row and
    /// its log lines' `[002 cpu]` prefix are.
    fn label(&self, index: usize) -> String {
        format!("sweep point {index:03} ({})", describe(&self.points[index]))
    }

    /// The point's `--set` overrides: the shared ones, then the point's own.
    fn sets(&self, index: usize) -> Vec<String> {
        point_sets(&self.args.sets, &self.points[index])
    }
}

/// A point to train, with the run directory to resume when it stopped at a checkpoint.
struct Pending {
    index: usize,
    resume: Option<PathBuf>,
}

impl Pending {
    /// Whether another copy of this sweep started the point after it was planned here (it
    /// had no directory then): it is that process's to train, as in `plan`.
    fn taken_since_planned(&self, sweep: &Sweep) -> bool {
        let dir = &sweep.point_dirs[self.index];
        let taken = self.resume.is_none() && dir.exists();
        if taken {
            tracing::warn!(
                "{}: another process started it ({}), left alone",
                sweep.label(self.index),
                dir.display()
            );
        }
        taken
    }
}

/// What training the planned points came to.
#[derive(Default)]
struct Trained {
    failed: usize,
    /// Points another process started meanwhile (the same sweep run twice at once).
    taken: usize,
}

/// A sweep is one process that writes its own directory (and starts its points' processes):
/// started once per rank by torchrun or srun, every rank would write the same sweep. Each
/// point of a multi-process sweep is a `trainer run` launched per rank.
fn refuse_multi_process_environment() -> Result<()> {
    match crate::train::parallel::Rendezvous::from_env(|k| std::env::var(k).ok()) {
        Some(Ok(world)) => Err(job_err!(
            "trainer sweep runs as one process, but RANK={} and WORLD_SIZE={} are set (a \
             torchrun/srun launch with several ranks); launch `trainer run` per rank for each \
             point instead, or unset RANK and WORLD_SIZE",
            world.rank,
            world.world_size
        )),
        // RANK and WORLD_SIZE without the rest (MASTER_ADDR...), or with values that do not
        // fit together (RANK >= WORLD_SIZE): still a launch by rank.
        Some(Err(e)) => Err(job_err!(
            "trainer sweep runs as one process, but the environment describes a \
             multi-process launch ({e}); launch `trainer run` per rank for each point \
             instead, or unset RANK and WORLD_SIZE"
        )),
        None => Ok(()),
    }
}

/// Runs (or completes) a sweep; prints its directory on stdout as soon as it exists.
pub fn sweep(args: &SweepArgs) -> Result<()> {
    refuse_multi_process_environment()?;
    let slots = args.devices.as_deref().map(devices::parse).transpose()?;
    let grid = args
        .grid
        .iter()
        .map(|a| parse_axis("--grid", a))
        .collect::<Result<Vec<_>>>()?;
    let zip = args
        .zip
        .iter()
        .map(|a| parse_axis("--zip", a))
        .collect::<Result<Vec<_>>>()?;
    check_axes(&args.job, &grid, &zip, &args.sets)?;
    if slots.is_some() {
        devices::check_keys(grid.iter().chain(&zip).map(|a| a.key.as_str()), &args.sets)?;
    }
    let points = expand(&grid, &zip);

    // Every point must be a valid job, on every device it may run on, before the first one
    // trains.
    let base = load_job(&args.job, &args.sets)?;
    let invalid = |i: usize, e: Error, on: &str| {
        job_err!("sweep point {i:03} ({}){on}: {e}", describe(&points[i]))
    };
    // Each point as a job (its sweep.csv row), and as the job it runs: as it is, or on each
    // device it may run on (`point_runs`), with its overrides.
    let mut specs: Vec<JobSpec> = Vec::with_capacity(points.len());
    let mut point_jobs: Vec<Vec<(String, Vec<String>, JobSpec)>> = Vec::new();
    // Quietly: what loading a point's job warns of, its run says again in its own log.
    let load_quietly = |sets: &[String]| {
        let quiet = tracing::subscriber::NoSubscriber::default();
        tracing::subscriber::with_default(quiet, || load_job(&args.job, sets))
    };
    for (i, point) in points.iter().enumerate() {
        let sets = point_sets(&args.sets, point);
        let spec = load_quietly(&sets).map_err(|e| invalid(i, e, ""))?;
        let mut jobs = Vec::new();
        for (on, sets) in point_runs(&args.sets, point, slots.as_deref()) {
            let spec = match on.is_empty() {
                true => spec.clone(),
                false => load_quietly(&sets).map_err(|e| invalid(i, e, &on))?,
            };
            jobs.push((on, sets, spec));
        }
        specs.push(spec);
        point_jobs.push(jobs);
    }
    // Values that differ as TOML but not as the key's type (0 and 0.0 for a learning rate)
    // would train one job twice.
    let hashes = specs
        .iter()
        .map(provenance::spec_hash)
        .collect::<Result<Vec<_>>>()?;
    if let Some((i, j)) = first_repeat(&hashes) {
        return Err(job_err!(
            "sweep points {i:03} ({}) and {j:03} ({}) resolve to the same job; give each value \
             once",
            describe(&points[i]),
            describe(&points[j])
        ));
    }
    if let (Some(slots), Some(value)) = (&slots, &args.devices) {
        devices::check_present(slots, value)?;
    }

    let definition = definition(&base, &grid, &zip)?;
    let sweep_id = match &args.sweep_id {
        Some(id) => check_sweep_id(id)?,
        None => format!(
            "sweep-{:08x}",
            provenance::fnv1a64(definition.as_bytes()) >> 32
        ),
    };
    let name = args.name.clone().unwrap_or_else(|| base.name().to_string());
    if args.name.is_some() {
        check_run_name(&name).map_err(|why| job_err!("--name: {why}"))?;
    }
    let dir = args.runs_dir.join(&name).join(&sweep_id);
    let point_dirs: Vec<PathBuf> = points
        .iter()
        .enumerate()
        .map(|(i, p)| dir.join(point_dir_name(i, p)))
        .collect();

    // The points still to train must also have data their model fits, and fit in memory
    // where they will run. (A re-run does not load the data of the points that are done.)
    let mut data = None;
    // What each point to train plans to hold on each device it may run on (with --devices,
    // in the order of `devices::distinct`, as `point_runs` lists them).
    let mut needs: Vec<Vec<commands::Need>> = Vec::new();
    for (i, point_dir) in point_dirs.iter().enumerate() {
        if standing(point_dir, args.retry_failed).0 != Standing::ToTrain {
            continue;
        }
        let mut on_each = Vec::new();
        for (on, sets, spec) in &point_jobs[i] {
            // Quietly: what loading the data and picking the device say, the point's run says
            // again in its own log.
            let quiet = tracing::subscriber::NoSubscriber::default();
            let checked = tracing::subscriber::with_default(quiet, || {
                commands::check_sweep_point(&args.job, sets, spec, &mut data)
            });
            let need = checked.map_err(|e| match e {
                // A failure to read, or a point too large for the machine (not a bad job),
                // stays a failure while running, exit 1.
                Error::Runtime(m) => {
                    runtime_err!("sweep point {i:03} ({}){on}: {m}", describe(&points[i]))
                }
                e => invalid(i, e, on),
            })?;
            on_each.push(need);
        }
        needs.push(on_each);
    }
    drop(data);
    if let Some(slots) = &slots {
        devices::warn_of_shared_memory(slots, &needs);
    }

    std::fs::create_dir_all(&dir)
        .map_err(|e| crate::run::create_dir_error("sweep directory", &dir, e))?;
    record_definition(&dir, &definition, args)?;
    // At once, as `trainer run` prints its run directory: a script has it however the sweep
    // ends. A reader that has gone does not stop the sweep, but is said.
    if let Err(e) = crate::commands::print_path(&dir) {
        tracing::warn!(
            "cannot print the sweep directory on stdout ({e}); it is {}",
            dir.display()
        );
    }

    let sweep = Sweep {
        args,
        dir,
        keys: grid.iter().chain(&zip).map(|a| a.key.clone()).collect(),
        points,
        point_dirs,
        metric_columns: metric_columns(&specs),
    };
    let plan = plan(&sweep, &specs)?;
    sweep.write_index(&[])?;
    let trained = match &slots {
        None => run_here(&sweep, &plan.todo),
        Some(slots) => devices::run_side_by_side(&sweep, plan.todo, slots, &specs),
    };
    sweep.write_index(&[])?;
    let trained = trained?;
    let failed = plan.failed_before + trained.failed;
    let index = sweep.dir.join("sweep.csv");
    let elsewhere = plan.running_elsewhere + trained.taken;
    if elsewhere > 0 {
        return Err(runtime_err!(
            "{elsewhere} of {} sweep points are being trained by another process and were left \
             alone; run the sweep again once they have finished; see {}",
            sweep.points.len(),
            index.display()
        ));
    }
    if failed > 0 {
        return Err(runtime_err!(
            "{failed} of {} sweep points failed; see {}",
            sweep.points.len(),
            index.display()
        ));
    }
    Ok(())
}

/// What a (re-)run of a sweep has to do, from the point directories.
struct Plan {
    todo: Vec<Pending>,
    /// Points that failed in an earlier run (final without --retry-failed).
    failed_before: usize,
    /// Points another live process is training.
    running_elsewhere: usize,
}

/// Skips the points that completed (or failed, without --retry-failed) or that another
/// process is training; the others are to train, resumed or from scratch.
fn plan(sweep: &Sweep, specs: &[JobSpec]) -> Result<Plan> {
    let mut plan = Plan {
        todo: Vec::new(),
        failed_before: 0,
        running_elsewhere: 0,
    };
    for (index, point_dir) in sweep.point_dirs.iter().enumerate() {
        let label = sweep.label(index);
        let (standing, record) = standing(point_dir, sweep.args.retry_failed);
        if let Some(record) = &record {
            warn_if_changed(&label, record, &specs[index]);
        }
        match standing {
            Standing::Completed => tracing::info!("{label}: completed before, skipped"),
            Standing::FailedBefore => {
                tracing::info!("{label}: failed before, skipped (--retry-failed runs it again)");
                plan.failed_before += 1;
            }
            Standing::RunningElsewhere => {
                tracing::warn!(
                    "{label}: another process is training it ({}), left alone",
                    point_dir.display()
                );
                plan.running_elsewhere += 1;
            }
            Standing::ToTrain => {
                let resume = match point_dir.exists() {
                    true => restart_or_resume(point_dir)?,
                    false => None,
                };
                plan.todo.push(Pending { index, resume });
            }
        }
    }
    Ok(plan)
}

/// Where a point stands before this run of the sweep, from its directory.
#[derive(Debug, PartialEq)]
enum Standing {
    /// No directory yet, a run that did not finish, or one that failed with --retry-failed.
    ToTrain,
    Completed,
    /// Failed in an earlier run: final without --retry-failed.
    FailedBefore,
    /// Another live process is training it.
    RunningElsewhere,
}

/// The point's standing, with its run's record where it has a readable one.
fn standing(point_dir: &Path, retry_failed: bool) -> (Standing, Option<RunRecord>) {
    if !point_dir.exists() {
        return (Standing::ToTrain, None);
    }
    let record = RunRecord::load(point_dir).ok();
    let standing = match record.as_ref().map(|r| r.status) {
        Some(Status::Completed) => Standing::Completed,
        Some(Status::Failed) if !retry_failed => Standing::FailedBefore,
        Some(Status::Running) if running_elsewhere(point_dir) => Standing::RunningElsewhere,
        _ => Standing::ToTrain,
    };
    (standing, record)
}

/// A point's run that trained something other than its point (resumed by hand with a
/// change and --force, say): its metrics are not those of its sweep.csv values, so say so.
fn warn_if_changed(label: &str, record: &RunRecord, point: &JobSpec) {
    let Ok(run) = toml::Value::Table(record.config.clone()).try_into::<JobSpec>() else {
        return;
    };
    let json = |spec: &JobSpec| crate::checkpoint::spec_json(spec).0;
    // A GPU without half-precision support trains the point in fp32 when the job allows it,
    // and records that (`commands::precision_on_gpu`): no change by hand.
    let fell_back = point.precision.fallback == PrecisionFallback::Fp32
        && run.precision.mode == PrecisionMode::Fp32;
    let changes: Vec<String> = crate::checkpoint::training_differences(&json(point), &json(&run))
        .into_iter()
        .filter(|(key, _, _)| !(fell_back && key.starts_with("precision.")))
        .map(|(key, sweep, run)| format!("{key} = {run} (the sweep's is {sweep})"))
        .collect();
    if !changes.is_empty() {
        tracing::warn!(
            "{label}: its run trained with {}: its results in sweep.csv are not those of \
             its sweep values",
            changes.join(", ")
        );
    }
}

/// Trains the points one after another in this process. A bad job or a stop signal ends the
/// sweep there.
fn run_here(sweep: &Sweep, todo: &[Pending]) -> Result<Trained> {
    let stop = Stop::install()
        .map_err(|e| runtime_err!("cannot install the SIGINT/SIGTERM handlers: {e}"))?;
    let mut trained = Trained::default();
    for pending in todo {
        let (index, args) = (pending.index, sweep.args);
        let label = sweep.label(index);
        // A signal after the last point's training (or before the first's) stops here.
        if let Some(signal) = stop.requested() {
            return Err(interrupted(signal, &format!("{label} was not started")));
        }
        if pending.taken_since_planned(sweep) {
            trained.taken += 1;
            continue;
        }
        let point_dir = &sweep.point_dirs[index];
        tracing::info!("{label}: {}", point_dir.display());
        sweep.write_index(&[index])?;
        let result = commands::run(&RunArgs {
            job: args.job.clone(),
            job_given: true,
            sets: sweep.sets(index),
            name: args.name.clone(),
            runs_dir: args.runs_dir.clone(),
            dir: Some(point_dir.clone()),
            resume_fallback: pending.resume.is_some(),
            resume: pending.resume.clone(),
            force: false,
            quiet: args.quiet,
            profile: None,
            print_run_dir: false,
        });
        sweep.write_index(&[])?;
        match result {
            Ok(_) => {}
            // A bad job is a bad sweep: stop at once rather than fail every point alike.
            Err(e) if e.exit_code() == 2 => return Err(job_err!("{label}: {e}")),
            Err(Error::Interrupted { signal, message }) => {
                return Err(interrupted(signal, &format!("{label}: {message}")))
            }
            Err(e) => {
                tracing::warn!("{label} failed: {e}");
                trained.failed += 1;
            }
        }
    }
    Ok(trained)
}

/// A sweep stopped by SIGINT or SIGTERM (exit 128 + signal); `what` says where it stood.
fn interrupted(signal: i32, what: &str) -> Error {
    Error::Interrupted {
        signal,
        message: format!(
            "sweep stopped by a signal: {what}\nrun the same sweep command again to finish it \
             (finished points are skipped, the others resume from their checkpoint or start \
             again)"
        ),
    }
}

/// Whether a point without a summary is being trained right now by another process of this
/// program on this host: the same sweep started twice, or the points of a `--devices` sweep
/// whose own process was killed (they finish their points). Another process holds the run's
/// lock; or, for a run without a lock file, the pid in its provenance.json is alive, not
/// this process, and runs this same program, so that a pid reused by an unrelated process
/// does not keep a dead point from running again.
fn running_elsewhere(point_dir: &Path) -> bool {
    match crate::run::lock_state(point_dir) {
        Some(crate::run::LockState::HeldBy(pid)) => return pid != std::process::id(),
        Some(crate::run::LockState::Free) => return false,
        None => {}
    }
    let pid = std::fs::read_to_string(point_dir.join("provenance.json"))
        .ok()
        .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
        .and_then(|p| p["pid"].as_u64());
    let Some(pid) = pid.filter(|&p| p != u64::from(std::process::id())) else {
        return false;
    };
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let program = |path: &Path| path.file_name().map(|n| n.to_os_string());
    let theirs = cmdline
        .split(|&b| b == 0)
        .next()
        .and_then(|arg0| program(Path::new(&*String::from_utf8_lossy(arg0))));
    let ours = std::env::current_exe().ok().and_then(|p| program(&p));
    theirs.is_some() && theirs == ours
}

/// `KEY=V1,V2,...` into an axis; each value is checked as `--set KEY=V` would read it.
fn parse_axis(flag: &str, arg: &str) -> Result<Axis> {
    let usage = format!("expected KEY=V1,V2,..., e.g. {flag} optimizer.lr=1e-4,3e-4,1e-3");
    let (key, raw) = arg
        .split_once('=')
        .ok_or_else(|| job_err!("{flag} {arg}: {usage}"))?;
    let key = key.trim().to_string();
    let values = split_values(raw);
    if values.is_empty() || values.iter().any(|v| v.is_empty()) {
        return Err(job_err!("{flag} {arg}: an empty value; {usage}"));
    }
    let mut parsed = Vec::with_capacity(values.len());
    for v in &values {
        let (_, value) =
            parse_set_arg(&format!("{key}={v}")).map_err(|e| job_err!("{flag} {arg}: {e}"))?;
        parsed.push(value);
    }
    // A --grid value given twice (1e-3 and 0.001 are one value) would train the same job
    // twice; zipped keys may repeat a value, as long as no two rows are the same.
    if flag == "--grid" {
        if let Some((i, j)) = first_repeat(&parsed) {
            return Err(job_err!(
                "{flag} {arg}: the value {} is given twice ({} and {}); each point would \
                 train the same job",
                parsed[i],
                values[i],
                values[j]
            ));
        }
    }
    // One spelling per value (1e-3 and 0.001 alike, "sgd" and sgd alike), so that the
    // sweep's identity and its points' directory names do not depend on how it was typed.
    let values = parsed.iter().map(canonical_text).collect();
    Ok(Axis { key, values })
}

/// A swept value as `--set` text that reads back as the same value: the shorter of a
/// float's plain and exponent forms (1e-4, 0.05, 2.0), a string bare unless that would read
/// as something else (`sgd`, but `"true"`), anything else as TOML writes it.
fn canonical_text(value: &toml::Value) -> String {
    match value {
        toml::Value::Float(f) if f.is_finite() => {
            let plain = value.to_string();
            let exponent = format!("{f:e}");
            match exponent.len() < plain.len() {
                true => exponent,
                false => plain,
            }
        }
        toml::Value::String(s) => {
            let bare = parse_set_arg(&format!("v={s}")).is_ok_and(|(_, v)| v == *value);
            match bare && !s.is_empty() && s.trim() == s && !s.contains(',') {
                true => s.clone(),
                false => value.to_string(),
            }
        }
        other => other.to_string(),
    }
}

/// The first pair of equal items, by position.
fn first_repeat<T: PartialEq>(items: &[T]) -> Option<(usize, usize)> {
    (0..items.len()).find_map(|j| (0..j).find(|&i| items[i] == items[j]).map(|i| (i, j)))
}

/// Splits on commas that are not inside brackets, braces or quotes, so values can be TOML
/// arrays and strings: `model.input_shape=[1,64],[64]`.
fn split_values(raw: &str) -> Vec<String> {
    let mut values = Vec::new();
    let (mut depth, mut quote, mut current) = (0i32, None, String::new());
    let mut escaped = false;
    for c in raw.chars() {
        match (quote, c) {
            // In a TOML basic string (double quotes) a backslash escapes the next character:
            // `"a\",b"` is one value.
            (Some('"'), _) if escaped => escaped = false,
            (Some('"'), '\\') => escaped = true,
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '"' | '\'') => quote = Some(c),
            (None, '[' | '{') => depth += 1,
            (None, ']' | '}') => depth -= 1,
            (None, ',') if depth == 0 => {
                values.push(current.trim().to_string());
                current.clear();
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    values.push(current.trim().to_string());
    values
}

fn check_axes(job: &Path, grid: &[Axis], zip: &[Axis], sets: &[String]) -> Result<()> {
    if grid.is_empty() && zip.is_empty() {
        return Err(job_err!(
            "trainer sweep needs at least one --grid KEY=V1,V2,... (or --zip)"
        ));
    }
    // Keys compared as the job file resolves them (a layer by name, by position, from the
    // end), and a key against the tables holding it: each pair would have one value
    // silently override the other while sweep.csv records both.
    let flagged: Vec<(&str, String)> = grid
        .iter()
        .map(|a| ("--grid", a.key.clone()))
        .chain(zip.iter().map(|a| ("--zip", a.key.clone())))
        .chain(sets.iter().filter_map(|s| {
            s.split_once('=')
                .map(|(k, _)| ("--set", k.trim().to_string()))
        }))
        .collect();
    let keys: Vec<String> = flagged.iter().map(|(_, k)| k.clone()).collect();
    let paths = canonical_keys(job, &keys)?;
    let mut given: Vec<(&str, String, Vec<String>)> = Vec::new();
    for ((flag, key), path) in flagged.into_iter().zip(paths) {
        for (other_flag, other, other_path) in &given {
            // A later --set of a --set's key replaces it, as for `trainer run`.
            if flag == "--set" && *other_flag == "--set" {
                continue;
            }
            let overlap = path.starts_with(other_path) || other_path.starts_with(&path);
            if !overlap {
                continue;
            }
            let how = if path == *other_path {
                "set the same key".to_string()
            } else if path.len() < other_path.len() {
                format!("overlap: {key} holds {other}")
            } else {
                format!("overlap: {other} holds {key}")
            };
            return Err(job_err!(
                "{other_flag} {other} and {flag} {key} {how}, so one would override the \
                 other; give each key once"
            ));
        }
        given.push((flag, key, path));
    }
    if let Some(first) = zip.first() {
        for other in &zip[1..] {
            if other.values.len() != first.values.len() {
                return Err(job_err!(
                    "--zip {} has {} values but --zip {} has {}; zipped keys need the same number",
                    first.key,
                    first.values.len(),
                    other.key,
                    other.values.len()
                ));
            }
        }
        let rows: Vec<Vec<toml::Value>> = (0..first.values.len())
            .map(|i| {
                zip.iter()
                    .filter_map(|a| parse_set_arg(&format!("{}={}", a.key, a.values[i])).ok())
                    .map(|(_, v)| v)
                    .collect()
            })
            .collect();
        if let Some((i, j)) = first_repeat(&rows) {
            return Err(job_err!(
                "--zip: points {} and {} give every zipped key the same value; each would \
                 train the same job",
                i + 1,
                j + 1
            ));
        }
    }
    Ok(())
}

/// Every combination: the first --grid key varies slowest, the zipped keys fastest.
fn expand(grid: &[Axis], zip: &[Axis]) -> Vec<Point> {
    let mut axes: Vec<Vec<Point>> = grid
        .iter()
        .map(|a| {
            a.values
                .iter()
                .map(|v| vec![(a.key.clone(), v.clone())])
                .collect()
        })
        .collect();
    if let Some(first) = zip.first() {
        axes.push(
            (0..first.values.len())
                .map(|i| {
                    zip.iter()
                        .map(|a| (a.key.clone(), a.values[i].clone()))
                        .collect()
                })
                .collect(),
        );
    }
    axes.iter().fold(vec![Vec::new()], |points, axis| {
        points
            .iter()
            .flat_map(|p| {
                axis.iter().map(move |choice| {
                    let mut q = p.clone();
                    q.extend(choice.iter().cloned());
                    q
                })
            })
            .collect()
    })
}

fn point_sets(base: &[String], point: &Point) -> Vec<String> {
    let mut sets = base.to_vec();
    sets.extend(point.iter().map(|(k, v)| format!("{k}={v}")));
    sets
}

/// The `--set` overrides of a point as it will run: as it is, or (`--devices`) on each of
/// the listed devices, with " on DEVICE" to say which.
fn point_runs(
    base: &[String],
    point: &Point,
    slots: Option<&[devices::Slot]>,
) -> Vec<(String, Vec<String>)> {
    let sets = point_sets(base, point);
    let Some(slots) = slots else {
        return vec![(String::new(), sets)];
    };
    devices::distinct(slots)
        .into_iter()
        .map(|device| {
            let mut on_device = sets.clone();
            on_device.push(devices::device_set(device));
            (format!(" on {device}"), on_device)
        })
        .collect()
}

fn describe(point: &Point) -> String {
    point
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// What identifies a sweep: the resolved base job (however it was spelled) and the axes.
fn definition(base: &crate::spec::JobSpec, grid: &[Axis], zip: &[Axis]) -> Result<String> {
    let mut text = format!("job {}\n", provenance::spec_hash(base)?);
    for (flag, axes) in [("grid", grid), ("zip", zip)] {
        for a in axes {
            text += &format!("{flag} {}={}\n", a.key, a.values.join(","));
        }
    }
    Ok(text)
}

fn check_sweep_id(id: &str) -> Result<String> {
    let ok = !id.is_empty()
        && !id.starts_with('.')
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    if ok {
        Ok(id.to_string())
    } else {
        Err(job_err!(
            "--sweep-id {id:?}: allowed: letters, digits, '-', '_' and '.' (not first)"
        ))
    }
}

/// sweep.txt holds the definition; a sweep id reused for another job or grid is refused
/// rather than mixing two sweeps in one directory.
fn record_definition(dir: &Path, definition: &str, args: &SweepArgs) -> Result<()> {
    let path = dir.join("sweep.txt");
    let text = format!(
        "{definition}# started by: {}\n# job file: {}\n",
        provenance::command_line(),
        args.job.display()
    );
    match std::fs::read_to_string(&path) {
        Ok(old) if !old.starts_with(definition) => Err(job_err!(
            "{} holds a different sweep (another job or grid); give another --sweep-id, or \
             leave it out to get one from the job and grid",
            dir.display()
        )),
        Ok(_) => Ok(()),
        Err(_) => std::fs::write(&path, text)
            .map_err(|e| runtime_err!("cannot write {}: {e}", path.display())),
    }
}

fn point_dir_name(index: usize, point: &Point) -> String {
    let mut name = format!("{index:03}");
    for (k, v) in point {
        let short = k.rsplit('.').next().unwrap_or(k);
        name += &format!("-{short}={v}");
    }
    // Quotes, spaces and brackets of list and table values are left out (`[1, 64]` is
    // `1_64`, `{ type = "sgd" }` is `type=sgd`); the index keeps the names unique.
    name.chars()
        .filter(|c| !"\"' {}[]".contains(*c))
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.=+".contains(c) {
                c
            } else {
                '_'
            }
        })
        .take(96)
        .collect()
}

/// An unfinished (or failed, with --retry-failed) point continues from its newest intact
/// checkpoint when it wrote one (the job has `[checkpoint]` settings); otherwise it starts
/// again from scratch, and the earlier attempt (its train.log with the error, its metrics)
/// is kept beside it as `<point>.attempt-N`.
fn restart_or_resume(point_dir: &Path) -> Result<Option<PathBuf>> {
    if crate::checkpoint::locate(point_dir, true).is_ok() {
        tracing::info!(
            "{} did not finish; resuming it from its checkpoint",
            point_dir.display()
        );
        return Ok(Some(point_dir.to_path_buf()));
    }
    let kept = (1..)
        .map(|n| {
            let mut name = point_dir.as_os_str().to_owned();
            name.push(format!(".attempt-{n}"));
            PathBuf::from(name)
        })
        .find(|candidate| !candidate.exists())
        .expect("a free name");
    std::fs::rename(point_dir, &kept).map_err(|e| {
        runtime_err!(
            "cannot move {} aside to {}: {e}",
            point_dir.display(),
            kept.display()
        )
    })?;
    tracing::info!(
        "{} did not finish; starting it again (the earlier attempt is kept as {})",
        point_dir.display(),
        kept.display()
    );
    Ok(None)
}

/// The metric columns of the points' runs, each once, in the order the first job that has
/// it gives them.
fn metric_columns(specs: &[JobSpec]) -> Vec<String> {
    let mut columns: Vec<String> = Vec::new();
    for column in specs.iter().flat_map(crate::results::metric_columns) {
        if !columns.contains(&column) {
            columns.push(column);
        }
    }
    columns
}

impl Sweep<'_> {
    /// Rebuilds sweep.csv from the point directories; `running` are the points being trained.
    /// Its columns are the same from the first writing to the last (a pending point's cells
    /// are empty), so a script reading it mid-sweep sees the final layout.
    fn write_index(&self, running: &[usize]) -> Result<()> {
        let (dir, keys, points, point_dirs) =
            (&self.dir, &self.keys, &self.points, &self.point_dirs);
        let records: Vec<Option<RunRecord>> =
            point_dirs.iter().map(|d| RunRecord::load(d).ok()).collect();
        let metrics: Vec<Vec<(String, f64)>> = records
            .iter()
            .map(|r| r.as_ref().map(|r| r.final_and_best()).unwrap_or_default())
            .collect();
        // (A run's own columns are the job's; one from an older version may have others.)
        let mut metric_columns = self.metric_columns.clone();
        for (name, _) in metrics.iter().flatten() {
            if !metric_columns.contains(name) {
                metric_columns.push(name.clone());
            }
        }
        let mut columns = vec!["point".to_string()];
        columns.extend(keys.iter().cloned());
        columns.extend(["status", "end_reason", "run_dir", "wall_s"].map(String::from));
        columns.extend(metric_columns.iter().cloned());

        let text = |s: &str| Cell::Text(s.to_string());
        // A swept value as `--set` reads it, written as compare writes config values (`sgd`,
        // not TOML's `"sgd"`; 1e-3 as 0.001); the directory names keep `parse_axis`'s spelling.
        let value = |key: &str, v: &str| {
            parse_set_arg(&format!("{key}={v}")).map_or_else(|_| text(v), |(_, v)| Cell::Setting(v))
        };
        let rows = (0..points.len())
            .map(|i| {
                let record = records[i].as_ref();
                let status = match (running.contains(&i), record) {
                    (true, _) => "running",
                    (false, Some(r)) => r.status.as_str(),
                    (false, None) => "pending",
                };
                let mut row = vec![Cell::Int(i as i64)];
                row.extend(points[i].iter().map(|(k, v)| value(k, v)));
                row.push(text(status));
                row.push(
                    record
                        .and_then(|r| r.end_reason())
                        .map_or(Cell::Empty, text),
                );
                row.push(text(
                    &point_dirs[i]
                        .file_name()
                        .map_or(String::new(), |n| n.to_string_lossy().into_owned()),
                ));
                row.push(
                    record
                        .and_then(|r| r.summary.as_ref())
                        .map(|s| s.wall_s)
                        .map_or(Cell::Empty, Cell::Float),
                );
                row.extend(metric_columns.iter().map(|c| {
                    metrics[i]
                        .iter()
                        .find(|(n, _)| n == c)
                        .map_or(Cell::Empty, |(_, v)| Cell::Float(*v))
                }));
                row
            })
            .collect();
        let csv = Table { columns, rows }.render(Format::Csv);
        let tmp = dir.join(".sweep.csv.tmp");
        let target = dir.join("sweep.csv");
        std::fs::write(&tmp, csv)
            .and_then(|()| std::fs::rename(&tmp, &target))
            .map_err(|e| runtime_err!("cannot write {}: {e}", target.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swept_values_have_one_spelling_each() {
        let values = |arg: &str| parse_axis("--grid", arg).unwrap().values;
        assert_eq!(
            values("optimizer.lr=0.001,3E-4,5e-2,2.0,1_000_000_000.0,-0.5"),
            ["1e-3", "3e-4", "0.05", "2.0", "1e9", "-0.5"]
        );
        assert_eq!(
            values("optimizer.lr=1e-3,0.01"),
            values("optimizer.lr=0.001,1e-2")
        );
        assert_eq!(
            values(r#"optimizer.type="sgd",adam,'adamw'"#),
            ["sgd", "adam", "adamw"]
        );
        // Kept quoted where bare text would read as another value or type.
        assert_eq!(
            values(r#"job.name="true","12",x"#),
            [r#""true""#, r#""12""#, "x"]
        );
        assert_eq!(values("data.batch_size=1_024,32"), ["1024", "32"]);
        assert_eq!(
            values("model.input_shape=[1,64],[ 64 ]"),
            ["[1, 64]", "[64]"]
        );
        // Each reads back as the value given, of the same type.
        let given = [
            "1e-7",
            "0.3",
            "123.456",
            "1e300",
            "-0.0",
            "5e-324",
            "0.30000000000000004",
            "7",
            "true",
            r#""it's \"quoted\"""#,
            r#""a # b""#,
            r#""k=v""#,
            r#""nan""#,
            r#""1979-05-27""#,
            r#""é x""#,
            "[1, 2]",
            r#"{ a = 1, b = "c" }"#,
        ];
        for raw in given {
            let value = parse_set_arg(&format!("job.name={raw}")).unwrap().1;
            let text = canonical_text(&value);
            let again = parse_set_arg(&format!("job.name={text}")).unwrap().1;
            assert_eq!(again, value, "{raw} written {text}");
        }
    }

    #[test]
    fn values_split_on_top_level_commas_only() {
        assert_eq!(split_values("1e-4, 3e-4"), ["1e-4", "3e-4"]);
        assert_eq!(split_values("[1,64],[64]"), ["[1,64]", "[64]"]);
        assert_eq!(split_values("\"a,b\",c"), ["\"a,b\"", "c"]);
        // An escaped quote does not end a basic string; a literal string has no escapes.
        assert_eq!(split_values(r#""a\",b","c""#), [r#""a\",b""#, r#""c""#]);
        assert_eq!(split_values(r"'a\',b"), [r"'a\'", "b"]);
        assert_eq!(split_values(""), [""]);
    }

    #[test]
    fn grid_is_a_product_and_zip_moves_together() {
        let axis = |k: &str, v: &[&str]| Axis {
            key: k.into(),
            values: v.iter().map(|s| s.to_string()).collect(),
        };
        let points = expand(
            &[axis("a", &["1", "2"])],
            &[axis("b", &["x", "y"]), axis("c", &["p", "q"])],
        );
        let described: Vec<String> = points.iter().map(describe).collect();
        assert_eq!(
            described,
            ["a=1 b=x c=p", "a=1 b=y c=q", "a=2 b=x c=p", "a=2 b=y c=q"]
        );
        assert_eq!(point_dir_name(3, &points[3]), "003-a=2-b=y-c=q");
        let table = parse_axis("--grid", r#"optimizer={type="sgd", lr=0.1},[1,64]"#).unwrap();
        let named: Vec<String> = (0..2)
            .map(|i| point_dir_name(i, &vec![(table.key.clone(), table.values[i].clone())]))
            .collect();
        assert_eq!(
            named,
            ["000-optimizer=type=sgd_lr=0.1", "001-optimizer=1_64"]
        );
    }
}
