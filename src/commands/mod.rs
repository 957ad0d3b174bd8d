//! The CLI's commands as library functions: `run` here (a job prepared, its device picked,
//! trained in its run directory), `check` and `devices` in check.rs.

use crate::checkpoint::superseded;
use crate::checkpoint::weights::{self, Weights};
use crate::checkpoint::{self, ResumePoint};
use crate::data::{self, Data};
use crate::error::{Error, Result};
use crate::graph::{ActivationStorage, DataShape, GradBuckets, Graph, MemoryPlan};
use crate::ops::{self, Engine, Scratch};
use crate::optim;
use crate::profile::ProfileSteps;
use crate::run::summary::{self, Ended};
use crate::run::{EndReason, MetricsRow, MetricsWriter, RunDir, Summary};
use crate::signals::Stop;
use crate::spec::{
    self, parse_device, CollectiveBackend, DataPlacement, DeviceChoice, JobSpec, Normalize,
    ParallelDevices, PrecisionFallback, PrecisionMode, ResumeMode,
};
use crate::tensor::cpu::CpuBackend;
use crate::tensor::cuda::{self, CudaBackend};
use crate::tensor::Backend;
use crate::train::parallel::{BatchLayout, CpuAllReduce, Rendezvous};
use crate::train::{
    self, CpuReplicas, DataParallel, OneDeviceCollective, ProcessReplicas, Session,
};
use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

mod check;
mod evaluate;
mod export;
mod memory;
mod profile;
mod sample;
mod start;
mod tokenize;

pub use check::{check, devices, Checked};
pub use evaluate::{evaluate, predict, report, EvalArgs, Evaluation, PredictArgs};
pub use export::{export, ExportArgs};
pub use memory::bytes;
use memory::{all_replicas_memory, check_device_memory, check_host_memory, memory_plan};
pub use memory::{Need, Place};
pub use profile::{profile, ProfileArgs};
pub use sample::{sample, SampleArgs};
pub use start::job_of;
use start::{
    final_rows, job_command, nothing_left_to_train, plan_start, resume_command,
    with_original_init_from, with_resume_hint,
};
pub use tokenize::{tokenize, TokenizeArgs, Tokenized};

pub struct RunArgs {
    /// The job file, or the resumed run's config.toml when none was given (`job_given`).
    pub job: PathBuf,
    pub job_given: bool,
    pub sets: Vec<String>,
    pub name: Option<String>,
    pub runs_dir: PathBuf,
    /// Continue a run: its directory (newest checkpoint) or one checkpoint file.
    pub resume: Option<PathBuf>,
    /// When the checkpoint to resume from is corrupt, use the newest intact older one.
    pub resume_fallback: bool,
    /// Resume even when the job changed keys that alter training.
    pub force: bool,
    /// Create the run directory exactly here (a sweep point) instead of a new one under
    /// `<runs_dir>/<name>/`.
    pub dir: Option<PathBuf>,
    /// Only warnings and errors are logged (passed on to the processes a launch starts).
    pub quiet: bool,
    /// Print the run directory on stdout as soon as it exists (`trainer run`, so that a
    /// script has it however the run ends; not a sweep's points, which sweep.csv names).
    pub print_run_dir: bool,
    /// Steps to profile (`--profile-steps`, `trainer profile`); the files go to the run
    /// directory.
    pub profile: Option<ProfileSteps>,
}

impl RunArgs {
    /// The arguments of `trainer run` that give this run again: what each rank of a launched
    /// run is started with.
    fn rank_arguments(&self) -> Vec<std::ffi::OsString> {
        let mut out: Vec<std::ffi::OsString> = vec![
            self.job.clone().into(),
            "--runs-dir".into(),
            self.runs_dir.clone().into(),
        ];
        for set in &self.sets {
            out.extend(["--set".into(), set.into()]);
        }
        if let Some(name) = &self.name {
            out.extend(["--name".into(), name.into()]);
        }
        if let Some(resume) = &self.resume {
            out.extend(["--resume".into(), resume.into()]);
        }
        if let Some(dir) = &self.dir {
            out.extend(["--run-dir".into(), dir.into()]);
        }
        for (flag, on) in [
            ("--resume-fallback", self.resume_fallback),
            ("--force", self.force),
            ("--quiet", self.quiet),
        ] {
            if on {
                out.push(flag.into());
            }
        }
        out
    }
}

/// How a run begins: fresh (from the seeded initialisation or model.init_from), or from a
/// checkpoint, in that checkpoint's run directory.
enum Start {
    Fresh {
        initial: Option<Weights>,
    },
    /// From a checkpoint; with its run directory, locked before the checkpoint was chosen
    /// (taken when the run opens).
    Resume(Box<ResumePoint>, Option<RunDir>),
}

impl Start {
    fn resumes(&self) -> bool {
        matches!(self, Start::Resume(..))
    }
}

/// A job loaded, with its data and graph: everything `check` shows and `run` needs.
struct Prepared {
    spec: JobSpec,
    data: Data,
    graph: Graph,
}

/// The CPU threads this process uses: the job's threads on this machine (train.threads,
/// else every core), or in a multi-process run an equal part of them for each process on
/// this machine (at least one).
fn cpu_threads(spec: &JobSpec) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let processes = spec
        .parallel
        .world
        .as_ref()
        .map_or(1, |w| w.local_world_size);
    (spec.train.threads.unwrap_or(cores) / processes).max(1)
}

/// The threads of one replica: with CPU data parallelism in threads, an equal part of the
/// job's threads (at least one); without, all of them.
fn replica_threads(spec: &JobSpec) -> usize {
    match spec.parallel.thread_replicas(&spec.device.kind) {
        Some(replicas) => (cpu_threads(spec) / replicas.max(1)).max(1),
        None => cpu_threads(spec),
    }
}

fn prepare(job: &Path, sets: &[String], name: Option<&str>) -> Result<Prepared> {
    let mut spec = spec::load_job(job, sets)?;
    if let Some(name) = name {
        spec::check_run_name(name).map_err(|why| Error::Job(format!("--name: {why}")))?;
        spec.job.name = Some(name.to_string());
    }
    spec.parallel.world = world_from_env(&spec)?;
    let all_gpus = matches!(spec.parallel.devices, Some(ParallelDevices::All(_)));
    if all_gpus {
        let source = spec::KeySources::new(job, sets)?.of("parallel.devices");
        spec.parallel.devices = Some(ParallelDevices::List(every_gpu(&source)?));
    }
    if spec.parallel.world.is_some() || all_gpus {
        // Batches must now divide among the processes or the GPUs found.
        spec::validate(&spec, &spec::KeySources::new(job, sets)?)?;
    }
    let data =
        data::load(&spec.data, spec.job.seed).map_err(|e| with_data_key(job, sets, &spec, e))?;
    let graph = model_for(job, sets, &spec, &data)?;
    Ok(Prepared { spec, data, graph })
}

/// A data file that cannot be read, named with the key that gave it and where that key was
/// set (the job file, an environment variable, a --set): a sweep over data.path, or a path
/// from the environment, is otherwise hard to trace.
fn with_data_key(job: &Path, sets: &[String], spec: &JobSpec, e: Error) -> Error {
    let Error::UnreadableData { path, message } = &e else {
        return e;
    };
    let unread = spec
        .data
        .path_keys()
        .into_iter()
        .find_map(|(key, given)| (given.as_ref() == Some(path)).then_some(key));
    match (unread, spec::KeySources::new(job, sets)) {
        (Some(key), Ok(sources)) => {
            Error::Job(format!("{}: key `{key}`: {message}", sources.of(key)))
        }
        _ => e,
    }
}

/// What `trainer run` checks of a sweep point before anything trains, beyond its keys: its
/// data loads, its model fits the data (shapes, token ids, batches), its device can run it
/// and it fits in that device's memory (`memory::Need::fits`). Returns what it plans to hold
/// there, with its own copy of the data set on the host (a point is a process of its own).
/// `last` keeps the data set of the previous point: points that differ in other keys load it
/// once.
pub fn check_sweep_point(
    job: &Path,
    sets: &[String],
    spec: &JobSpec,
    last: &mut Option<(String, Data)>,
) -> Result<Need> {
    let key = serde_json::to_string(&(&spec.data, spec.job.seed)).expect("a spec serialises");
    let data = match last.take() {
        Some((k, data)) if k == key => data,
        _ => {
            data::load(&spec.data, spec.job.seed).map_err(|e| with_data_key(job, sets, spec, e))?
        }
    };
    let checked = model_for(job, sets, spec, &data).and_then(|graph| {
        let gpu = match pick_device(job, sets, spec)? {
            Device::Cpu => None,
            Device::Cuda(n) => Some(n),
        };
        gpus_usable(spec, gpu)?;
        let mut need = Need::of(spec, &graph, &data, gpu);
        need.fits()?;
        if need.place == Place::Host {
            need.bytes += data.bytes();
        }
        Ok(need)
    });
    *last = Some((key, data));
    checked
}

/// The model of `spec` built for `data`, with what must hold between them before training.
fn model_for(job: &Path, sets: &[String], spec: &JobSpec, data: &Data) -> Result<Graph> {
    let (batch_size, train_len) = (spec.batch_size(), data.train.len);
    if spec.data.drop_last && train_len < batch_size {
        return Err(Error::Job(format!(
            "{}: data.drop_last = true with batch_size {batch_size} leaves no batch: the \
             training split has only {train_len} samples",
            job.display()
        )));
    }
    let shape = DataShape::of(data);
    // The model's errors say which layer; this says where the layers came from.
    let graph = Graph::build(spec, &shape).map_err(|e| match e {
        Error::AtKey { key, message: m } => {
            let Ok(sources) = spec::KeySources::new(job, sets) else {
                return Error::Job(format!("{}: {m}", job.display()));
            };
            // A key other than a layer (the loss for targets it cannot take, the input
            // shape) is credited to its own source alone.
            if !key.starts_with("model.layers") && !key.starts_with("model.blocks") {
                return Error::Job(format!("{}: {m}", sources.of(&key)));
            }
            let from = sources.of(&key);
            let mut notes = Vec::new();
            // What it is given may come from elsewhere: a --set of another layer, the shape.
            let list = match key.starts_with("model.blocks") {
                true => "model.blocks",
                false => "model.layers",
            };
            let layers = sources.of(list);
            if layers != from {
                notes.push(format!("{list} is changed by {layers}"));
            }
            let shape_from = sources.of("model.input_shape");
            if let Some(shape) = spec
                .model
                .input_shape
                .as_ref()
                .filter(|_| shape_from != from)
            {
                notes.push(format!(
                    "model.input_shape = {shape:?} is from {shape_from}"
                ));
            }
            let notes = match notes.is_empty() {
                true => String::new(),
                false => format!(" ({})", notes.join("; ")),
            };
            Error::Job(format!("{from}: {m}{notes}"))
        }
        e => e,
    })?;
    check_token_ids(job, &graph, data)?;
    check_batch_norm_batches(job, spec, &graph, data.train.len)?;
    Ok(graph)
}

/// model.init_from's weights, for a fresh run; an error says where the path came from (the
/// job file, an environment variable, a --set).
fn read_init_from(job: &Path, sets: &[String], path: &Path, graph: &Graph) -> Result<Weights> {
    weights::read(path, graph).map_err(|e| match e {
        Error::Job(message) => {
            let source = spec::KeySources::new(job, sets)
                .map_or_else(|_| job.display().to_string(), |s| s.of("model.init_from"));
            match source.as_str() {
                // The message begins with the key: "--set model.init_from = ...".
                "--set model.init_from" => Error::Job(format!("--set {message}")),
                _ => Error::Job(format!("{source}: {message}")),
            }
        }
        e => e,
    })
}

/// A batch norm over one value per channel (batchnorm1d of [features], or of 1x1 planes)
/// cannot train on a single sample: its variance is 0 and its output β alone, which PyTorch
/// refuses ("Expected more than 1 value per channel when training"). A training batch, or a
/// data-parallel replica's share of one, of a single sample is refused before training.
fn check_batch_norm_batches(
    job: &Path,
    spec: &JobSpec,
    graph: &Graph,
    train_len: usize,
) -> Result<()> {
    let one_per_channel = (graph.layers.iter()).find(|l| l.op.properties().one_value_per_channel);
    let Some(layer) = one_per_channel else {
        return Ok(());
    };
    let (batch, replicas) = (spec.batch_size(), spec.parallel.replicas().unwrap_or(1));
    let last = train_len % batch;
    let larger = "choose a larger data.batch_size";
    let mut batches = vec![(batch.min(train_len), "every training batch", larger)];
    if last > 0 && !spec.data.drop_last && train_len > batch {
        let fix = "set data.drop_last = true or choose another data.batch_size";
        batches.push((last, "the last training batch of each epoch", fix));
    }
    // Rows are shared out in parts that differ by at most one, so some replica gets exactly
    // one row of n when 0 < n < 2 · replicas.
    let Some((n, which, fix)) = batches
        .into_iter()
        .find(|&(n, ..)| n > 0 && n < 2 * replicas)
    else {
        return Ok(());
    };
    let share = match replicas {
        1 => String::new(),
        r => format!(" split among {r} replicas, one of which gets 1"),
    };
    Err(Error::Job(format!(
        "{}: {} ({}) would train on {which}, {n} sample{}{share}: one value per \
         channel, whose variance is 0 (PyTorch refuses to train on it); {fix} ({train_len} \
         training samples)",
        job.display(),
        layer.key,
        layer.kind,
        if n == 1 { "" } else { "s" }
    )))
}

/// This process's place in a multi-process run, from RANK and WORLD_SIZE (or SLURM's
/// SLURM_PROCID and SLURM_NTASKS); None when they are unset or the world is one process.
fn world_from_env(spec: &JobSpec) -> Result<Option<Rendezvous>> {
    let Some(world) = Rendezvous::from_env(|k| std::env::var(k).ok()) else {
        return Ok(None);
    };
    let mut world = world?;
    let timeout = spec
        .parallel
        .timeout
        .as_deref()
        .unwrap_or(spec::DEFAULT_PARALLEL_TIMEOUT);
    world.timeout = spec::parse_duration(timeout).map_err(Error::Job)?;
    Ok(Some(world))
}

/// parallel.devices = "all": every GPU the driver shows (CUDA_VISIBLE_DEVICES applies).
fn every_gpu(source: &str) -> Result<Vec<String>> {
    let no_gpu = |why: &str| {
        Error::Job(format!(
            "{source}: key `parallel.devices`: \"all\" given, but {why}; list the devices, or \
             train on the CPU"
        ))
    };
    match cuda::probe() {
        Ok((devices, _)) if devices.is_empty() => Err(no_gpu("the CUDA driver sees no GPU")),
        Ok((devices, _)) => {
            let names: Vec<String> = (0..devices.len()).map(|i| format!("cuda:{i}")).collect();
            tracing::info!("parallel.devices = \"all\": {}", names.join(", "));
            Ok(names)
        }
        Err(why) => Err(no_gpu(&why)),
    }
}

/// An embedding reads token ids from the data: every feature must be a whole number in
/// [0, num_embeddings), or the job is refused naming the layer, the value and where it is.
fn check_token_ids(job: &Path, graph: &Graph, data: &Data) -> Result<()> {
    // What the loader applied: text and token files are never normalised.
    let normalized = data.preprocess.normalize != Normalize::None;
    let embeddings = graph.embeddings();
    let Some(&(layer, vocab)) = embeddings.iter().min_by_key(|&&(_, v)| v) else {
        return Ok(());
    };
    let row = data.row_len();
    let sets =
        std::iter::once(("train", &data.train)).chain(data.eval.iter().map(|(n, d)| (*n, d)));
    for (split, set) in sets {
        let outside = match set.windows {
            // A text's ids are one stream of tokens, the windows' and targets' alike.
            Some(_) => (set.tokens.first_at_or_past(vocab)?).map(|(i, id)| {
                (
                    id.to_string(),
                    format!("{}: token {i}", set.origin.features),
                )
            }),
            None => (set.features.iter().enumerate())
                .find(|(_, v)| !(v.fract() == 0.0 && (0.0..vocab as f32).contains(*v)))
                .map(|(i, v)| {
                    let sample = set.origin.place(&set.origin.features, i / row);
                    (v.to_string(), format!("{sample}, feature {}", i % row))
                }),
        };
        if let Some((v, place)) = outside {
            return Err(Error::Job(format!(
                "{}: {} (embedding): the {split} data holds {v} ({place}), \
                 but token ids must be whole numbers in [0, {vocab}) (num_embeddings{}){}",
                job.display(),
                graph.layers[layer].key,
                if embeddings.len() > 1 {
                    ", the smallest of the embeddings'"
                } else {
                    ""
                },
                if normalized {
                    "; set data.normalize = \"none\" for token data"
                } else {
                    ""
                }
            )));
        }
    }
    Ok(())
}

/// Whether this machine can open the GPUs a job trains on, `gpu` (its own) and those
/// parallel.devices lists, as `run` would find when it opens them (it refuses the job, exit 2,
/// where it cannot).
fn gpus_usable(spec: &JobSpec, gpu: Option<usize>) -> Result<()> {
    let listed = match &spec.parallel.devices {
        Some(spec::ParallelDevices::List(list)) => list.as_slice(),
        _ => &[],
    };
    let listed = listed.iter().filter_map(|d| match parse_device(d) {
        Some(DeviceChoice::Cuda(n)) => Some(n),
        _ => None,
    });
    for n in gpu.into_iter().chain(listed) {
        cuda::usable(n)?;
    }
    Ok(())
}

/// The device a job runs on, after `auto` is resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Device {
    Cpu,
    Cuda(usize),
}

/// Resolves this process's device: its entry of parallel.devices (by LOCAL_RANK), else
/// `device.type`. `auto` takes cuda:0 when a usable GPU (driver, device, NVRTC, cuBLAS) is
/// present, else the CPU, and logs why; replicas in threads (`parallel.replicas`) are CPU
/// replicas, since one process drives one GPU.
fn pick_device(job: &Path, sets: &[String], spec: &JobSpec) -> Result<Device> {
    let threaded = spec.parallel.thread_replicas(&spec.device.kind);
    let kind = match spec.parallel.listed_device() {
        Some(listed) => {
            tracing::debug!("device: {listed} (parallel.devices)");
            listed
        }
        None => spec.device.kind.as_str(),
    };
    let device = match parse_device(kind) {
        Some(DeviceChoice::Cpu) => Device::Cpu,
        // In a multi-process run, "cuda" is the process's own GPU (LOCAL_RANK), as with torchrun.
        Some(DeviceChoice::Cuda(_)) if kind == "cuda" && spec.parallel.world.is_some() => {
            Device::Cuda(spec.parallel.world.as_ref().map_or(0, |w| w.local_rank))
        }
        Some(DeviceChoice::Cuda(n)) => Device::Cuda(n),
        Some(DeviceChoice::Auto) if threaded.is_some_and(|r| r > 1) => {
            tracing::info!(
                "device auto: cpu (parallel.replicas in threads are CPU replicas; for GPUs, \
                 list them in parallel.devices)"
            );
            Device::Cpu
        }
        Some(DeviceChoice::Auto) => match cuda::probe() {
            Ok((devices, _)) if !devices.is_empty() && cuda::libraries_missing().is_none() => {
                // A process of a multi-process run takes its own GPU (LOCAL_RANK).
                let n = spec.parallel.world.as_ref().map_or(0, |w| w.local_rank);
                let name = devices.get(n).map_or("not present", |d| d.name.as_str());
                tracing::info!("device auto: cuda:{n} ({name})");
                Device::Cuda(n)
            }
            Ok((devices, _)) if devices.is_empty() => {
                tracing::info!("device auto: cpu (the CUDA driver sees no GPU)");
                Device::Cpu
            }
            Ok(_) => {
                let why = cuda::libraries_missing().unwrap_or_default();
                tracing::info!("device auto: cpu (a GPU is present, but {why})");
                Device::Cpu
            }
            Err(why) => {
                tracing::info!("device auto: cpu ({why})");
                Device::Cpu
            }
        },
        None => {
            return Err(Error::Job(format!(
                "device.type = \"{}\" is not a device",
                spec.device.kind
            )))
        }
    };
    if device == Device::Cpu && spec.parallel.backend == CollectiveBackend::Nccl {
        return Err(Error::Job(format!(
            "{}: key `parallel.backend`: \"nccl\" given, but this run is on the CPU; NCCL \
             averages gradients on CUDA devices: use \"tcp\" or \"auto\"",
            spec::KeySources::new(job, sets)?.of("parallel.backend")
        )));
    }
    if device == Device::Cpu && spec.device.allow_tf32 {
        tracing::warn!("device.allow_tf32 has no effect on the CPU, which computes in full fp32");
    }
    if let (Device::Cuda(n), Some(replicas @ 2..)) = (device, threaded) {
        return Err(Error::Job(format!(
            "{}: key `parallel.replicas`: {replicas} given, on cuda:{n} (device.type = \"{}\"): \
             one process drives one GPU; set parallel.launch = \"processes\" (a process per \
             replica), list the GPUs in parallel.devices, or set device.type = \"cpu\" for CPU \
             replicas. (1 runs one replica through NCCL.)",
            job.display(),
            spec.device.kind
        )));
    }
    Ok(device)
}

/// Trains a job, or continues one from a checkpoint, in its run directory (rank 0's, in a
/// multi-process run).
pub fn run(args: &RunArgs) -> Result<()> {
    // train.log keeps what this run logs before its directory exists, not what the process
    // logged before it (a sweep's lines about its other points).
    crate::logging::forget_pending();
    let result = run_job(args);
    if let Err(e) = &result {
        tell_waiting_ranks(e);
    }
    result
}

/// A rank of a multi-process run that stopped before meeting the others tells them why,
/// so that they end now with its error instead of at their timeout with none.
fn tell_waiting_ranks(error: &Error) {
    if matches!(error, Error::Interrupted { .. }) {
        return; // a launcher stopping ranks that never met expects them to end at once
    }
    if let Some(Ok(world)) = Rendezvous::from_env(|k| std::env::var(k).ok()) {
        crate::train::parallel::tell_stopped(&world, error);
    }
}

fn run_job(args: &RunArgs) -> Result<()> {
    let began = run_began();
    let Prepared { spec, data, graph } = prepare(&args.job, &args.sets, args.name.as_deref())?;
    if spec.parallel.launches_processes(&spec.device.kind) {
        // This process only starts and watches the replicas' processes.
        drop((data, graph));
        return crate::train::parallel::launch::run(&args.rank_arguments(), &spec);
    }
    let rank = spec.parallel.world.as_ref().map_or(0, |w| w.rank);
    // Only rank 0 reads checkpoints and init_from files: it sends the others its state.
    let start = match rank {
        0 => Some(plan_start(args, &spec, &graph, &data)?),
        _ => None,
    };
    let spec = match &start {
        Some(Start::Resume(point, _)) => with_original_init_from(spec, &point.checkpoint.spec),
        _ => spec,
    };
    match pick_device(&args.job, &args.sets, &spec)? {
        Device::Cpu => {
            check_host_memory(&spec, &graph, &data)?;
            // With data parallelism every replica gets a pool of its own part of the threads
            // (train::parallel::replicas); rank 0's is this one.
            let threads = replica_threads(&spec);
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .map_err(|e| Error::Runtime(format!("cannot start {threads} CPU threads: {e}")))?;
            // The loop runs on the pool's threads, so the engine's parallel work is forked from
            // a worker rather than injected from outside (on two cores that halves wake-ups).
            let backend = CpuBackend::new(threads);
            pool.install(|| {
                let Some(start) = start else {
                    return train::serve(&backend, &spec, graph, data, args.resume.as_deref());
                };
                let parallel = match &spec.parallel.world {
                    Some(_) => {
                        let each =
                            format!("{threads} thread{}", if threads == 1 { "" } else { "s" });
                        Some(process_replicas(
                            &backend,
                            &spec,
                            &data,
                            &graph,
                            each,
                            start.resumes(),
                        )?)
                    }
                    None => cpu_replicas(&spec, threads, graph.param_len)?,
                };
                run_on(args, began, &spec, data, graph, &backend, start, parallel)
            })
        }
        Device::Cuda(ordinal) => {
            // The GPU does the work; the loop stays on this thread, bound to the CUDA context.
            let backend = CudaBackend::new(ordinal, spec.device.allow_tf32)?;
            let spec = precision_on_gpu(&spec, &backend)?;
            check_device_memory(&spec, &graph, &data, &backend, ordinal)?;
            backend.set_half_matmuls(train::half_kind(spec.precision.mode));
            backend.set_fused_epilogues(fused_epilogues(&spec, &data));
            let Some(start) = start else {
                return train::serve(&backend, &spec, graph, data, args.resume.as_deref());
            };
            let parallel: Option<Box<dyn DataParallel<CudaBackend>>> = match &spec.parallel.world {
                Some(_) => {
                    let each = format!("1 GPU (rank 0 on cuda:{ordinal})");
                    Some(process_replicas(
                        &backend,
                        &spec,
                        &data,
                        &graph,
                        each,
                        start.resumes(),
                    )?)
                }
                // parallel.replicas = 1 (more are refused above): through a 1-rank NCCL
                // communicator, unless tcp is asked for or NCCL is missing and not asked for.
                None if spec.parallel.replicas().is_some() => match spec.parallel.backend {
                    CollectiveBackend::Tcp => None,
                    CollectiveBackend::Auto if cuda::nccl_missing().is_some() => {
                        tracing::info!(
                            "parallel: one replica without NCCL (libnccl.so not found): \
                             gradients need no averaging"
                        );
                        None
                    }
                    _ => Some(Box::new(OneDeviceCollective::new(&backend)?)),
                },
                None => None,
            };
            run_on(args, began, &spec, data, graph, &backend, start, parallel)
        }
    }
}

/// When this run began, for the start-up time in summary.json: the process start for a
/// process's first run (start-up then includes loading the program and its libraries), the
/// call itself for the later ones (a sweep's points trained in this process).
fn run_began() -> Instant {
    static FIRST: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);
    if FIRST.swap(false, std::sync::atomic::Ordering::Relaxed) {
        crate::process_start()
    } else {
        Instant::now()
    }
}

/// Rank 0 of a multi-process run: the other ranks, once they have all joined.
fn process_replicas<B: Engine + 'static>(
    backend: &B,
    spec: &JobSpec,
    data: &Data,
    graph: &Graph,
    each: String,
    resumes: bool,
) -> Result<Box<dyn DataParallel<B>>> {
    let replicas = ProcessReplicas::connect(backend, spec, data, graph.param_len, each, resumes)?;
    Ok(Box::new(replicas))
}

/// The other replicas of CPU data parallelism, each with `threads` threads; None without
/// data parallelism.
fn cpu_replicas(
    spec: &JobSpec,
    threads: usize,
    param_len: usize,
) -> Result<Option<Box<dyn DataParallel<CpuBackend>>>> {
    let Some(replicas) = spec.parallel.replicas() else {
        return Ok(None);
    };
    if replicas > cpu_threads(spec) {
        tracing::warn!(
            "{replicas} replicas on {} threads: each replica gets one thread and they share cores",
            cpu_threads(spec)
        );
    }
    Ok(Some(Box::new(CpuReplicas::new(
        replicas, threads, param_len,
    )?)))
}

/// Whether linear layers add their bias and apply their ReLU in cuBLASLt's epilogue
/// (`device.fused_epilogues`). Not where the data holds a NaN: PyTorch's ReLU passes NaN on,
/// so the loss of the steps that read it is NaN (and they fail or are skipped), but an
/// epilogue's ReLU, like CUTLASS's, may clip it to 0, and those steps would then quietly
/// turn the weights to NaN through their gradient (0 · NaN).
fn fused_epilogues(spec: &JobSpec, data: &Data) -> bool {
    if !spec.device.fused_epilogues {
        return false;
    }
    let finite = data.features_are_finite();
    if !finite {
        tracing::info!(
            "the data holds values that are not finite numbers: linear layers' bias and ReLU \
             run as passes of their own, which pass NaN on as PyTorch's do"
        );
    }
    finite
}

/// Mixed precision on a GPU needs tensor cores for the format: fp16 from compute capability
/// 7.0 (Volta), bf16 from 8.0 (Ampere). Older GPUs get a clear error, or train in fp32 with a
/// warning when the job allows it (`precision.fallback = "fp32"`; config.toml then says fp32).
fn precision_on_gpu(spec: &JobSpec, backend: &CudaBackend) -> Result<JobSpec> {
    let (major, minor) = backend.compute_capability();
    let needed = match spec.precision.mode {
        PrecisionMode::Fp32 => return Ok(spec.clone()),
        PrecisionMode::Fp16 => (7, 0),
        PrecisionMode::Bf16 => (8, 0),
    };
    if (major, minor) >= needed {
        return Ok(spec.clone());
    }
    let mode = serde_json::to_string(&spec.precision.mode).unwrap_or_default();
    let why = format!(
        "precision.mode = {mode} needs a GPU of compute capability {}.{} or newer; {} is {major}.{minor}",
        needed.0,
        needed.1,
        backend.describe()
    );
    match spec.precision.fallback {
        PrecisionFallback::Error => Err(Error::Job(format!(
            "{why}. Use precision.mode = \"fp32\", or allow precision.fallback = \"fp32\""
        ))),
        PrecisionFallback::Fp32 => {
            tracing::warn!("{why}: training in fp32 (precision.fallback = \"fp32\")");
            let mut spec = spec.clone();
            spec.precision.mode = PrecisionMode::Fp32;
            spec.precision.loss_scale = None;
            Ok(spec)
        }
    }
}

/// Opens the run directory (new, or the resumed run's) and trains in it (with the other
/// data-parallel replicas when `parallel` is given).
#[allow(clippy::too_many_arguments)]
fn run_on<B: Engine>(
    args: &RunArgs,
    began: Instant,
    spec: &JobSpec,
    data: Data,
    graph: Graph,
    backend: &B,
    start: Start,
    parallel: Option<Box<dyn DataParallel<B>>>,
) -> Result<()> {
    // Caught from before the run directory exists, so that a signal while it is being set
    // up stops the run after its first step, with a checkpoint, instead of killing the
    // process between its files (a directory without config.toml, which no command sees).
    let stop = Stop::install()
        .map_err(|e| Error::Runtime(format!("cannot install the SIGINT/SIGTERM handlers: {e}")))?;
    let mut start = start;
    let run = match &mut start {
        Start::Fresh { .. } => match &args.dir {
            Some(dir) => RunDir::create_at(dir)?,
            None => RunDir::create(&args.runs_dir, spec.name())?,
        },
        Start::Resume(point, locked) => match locked.take() {
            Some(run) => run,
            None => RunDir::open(&point.run_dir)?,
        },
    };
    if args.print_run_dir {
        // Line-buffered: a script capturing stdout has it even if the run is killed. A
        // closed stdout (`>&-`, a reader gone) must not stop the run, but is said.
        if let Err(e) = print_path(&run.path) {
            tracing::warn!(
                "cannot print the run directory on stdout ({e}); it is {}",
                run.path.display()
            );
        }
    }
    let device = parallel
        .as_ref()
        .map_or_else(|| backend.describe(), |p| p.describe());
    if let Start::Resume(point, _) = &start {
        // Before anything of the run changes; a failure here leaves it as it was.
        let state = &point.checkpoint.state;
        if let Some(aside) = superseded::set_aside(&run.path, state.step, state.metrics_rows)? {
            tracing::info!(
                "what the run recorded after step {} (this resume replaces it) is kept in {}",
                state.step,
                aside.display()
            );
        }
    }
    // From here on the run directory is this attempt's: a failure (a full disk, a file that
    // cannot be written) ends it as failed in summary.json, not as a run that looks killed.
    if let Err(e) = prepare_run_dir(&run, args, spec, &start, &device, &data.preprocess) {
        let e = record_failure(&run, spec, e, 0.0, Training::NotBegun);
        crate::logging::detach_run_log();
        return Err(e);
    }
    if let (Start::Fresh { initial: Some(_) }, Some(path)) = (&start, &spec.model.init_from) {
        tracing::info!(
            "starting from the weights in {} (model.init_from)",
            path.display()
        );
    }
    let result = run_in(
        &run, args, began, spec, data, graph, backend, start, parallel, &stop, &device,
    );
    if let Err(e) = &result {
        // The log of a failed run ends with why (summary.json has it too).
        crate::logging::append_to_run_log(&format!("error: {e}\n"));
    }
    crate::logging::detach_run_log();
    result
}

/// Makes the run directory this attempt's: a resumed run's summary.json goes aside (until
/// the attempt finishes, the run must not look finished); config.toml, preprocess.json and
/// provenance.json are written, and train.log attached.
fn prepare_run_dir(
    run: &RunDir,
    args: &RunArgs,
    spec: &JobSpec,
    start: &Start,
    device: &str,
    preprocess: &data::Preprocess,
) -> Result<()> {
    if let Start::Resume(..) = start {
        run.set_summary_aside()?;
    }
    let resumed = match start {
        Start::Resume(point, _) => {
            format!(
                "\n# resumed from {} (step {})",
                point.checkpoint.path.display(),
                point.checkpoint.state.step
            )
        }
        Start::Fresh { .. } => String::new(),
    };
    let header = format!(
        "# {}\n# resolved spec: defaults filled in, overrides applied\n# device: {device}\n# batch: {}{resumed}",
        job_command(args),
        BatchLayout::of(spec),
    );
    run.write_config(spec, &header)?;
    run.write_atomic(data::preprocess::FILE, preprocess.to_json().as_bytes())?;
    crate::provenance::write(run, spec, device)?;
    let log = run.path.join("train.log");
    crate::logging::attach_run_log(&log)
        .map_err(|e| Error::Runtime(format!("cannot create {}: {e}", log.display())))
}

/// How far an attempt that failed got: whether its run may still read as before it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Training {
    /// Failed setting its run directory up: nothing of the run's training changed.
    NotBegun,
    /// metrics.csv reopened (and cut back to the checkpoint) or training under way.
    Begun,
}

/// Ends an attempt that failed: summary.json says so and why (as far as it can be written),
/// and the error names the run and how to continue it. Where not even that can be written
/// and training had not begun, a resumed run's earlier summary is put back.
fn record_failure(run: &RunDir, spec: &JobSpec, e: Error, wall: f64, training: Training) -> Error {
    let summary = Summary {
        ended: Ended::Failed {
            error: e.to_string(),
        },
        end_reason: match e {
            Error::Diverged(_) => EndReason::Diverged,
            _ => EndReason::Failed,
        },
        run_id: run.id.clone(),
        job: spec.name().to_string(),
        wall_s: wall,
    };
    match run.write_summary(&summary) {
        Ok(()) => with_resume_hint(e, run, true),
        // The run's own error (a full disk writing metrics.csv, say) is the cause to show.
        Err(summary_error) => {
            let earlier = match training == Training::NotBegun && run.restore_summary() {
                true => "; the earlier summary.json is back",
                false => "",
            };
            let note =
                format!("summary.json could not be written either: {summary_error}{earlier}");
            with_resume_hint(e.with_note(&note), run, false)
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn run_in<B: Engine>(
    run: &RunDir,
    args: &RunArgs,
    began: Instant,
    spec: &JobSpec,
    data: Data,
    graph: Graph,
    backend: &B,
    start: Start,
    parallel: Option<Box<dyn DataParallel<B>>>,
    stop: &Stop,
    device: &str,
) -> Result<()> {
    let started = Instant::now();
    let memory = memory_plan(spec, &graph, &data, backend.free_memory());
    let layout = BatchLayout::of(spec);
    tracing::info!(
        "run {} ({}): {} parameters, {} training samples, device {device}, {}, batch {layout}, \
         planned memory {}{}",
        run.path.display(),
        spec.name(),
        graph.parameter_count(),
        data.train.len,
        spec.precision.mode.as_str(),
        bytes(memory.total()),
        if parallel.is_some() {
            " per replica"
        } else {
            ""
        }
    );
    let metrics_path = run.path.join("metrics.csv");
    let total = train::total_steps(spec, data.train.len) as u64;
    let finishing = match &start {
        Start::Resume(point, _) => nothing_left_to_train(&point.checkpoint, spec, total),
        Start::Fresh { .. } => false,
    };
    let fail = |e| {
        let wall = started.elapsed().as_secs_f64();
        record_failure(run, spec, e, wall, Training::Begun)
    };
    let (metrics, session) = match start {
        Start::Fresh { initial } => (
            MetricsWriter::create(&metrics_path),
            Session {
                initial,
                ..Session::default()
            },
        ),
        Start::Resume(point, _) => (
            MetricsWriter::resume(
                &metrics_path,
                point.checkpoint.state.metrics_rows,
                args.force,
            ),
            Session {
                resume: Some(point.checkpoint),
                ..Session::default()
            },
        ),
    };
    let mut metrics = metrics.map_err(fail)?;
    let resumed_from = session.resume.as_ref().map(|c| c.path.clone());
    let profile = (args.profile.clone()).map(|p| ProfileSteps {
        dir: run.path.clone(),
        planned_bytes: memory.total(),
        ..p
    });
    let session = Session {
        checkpoint_dir: Some(run.path.join(checkpoint::DIR)),
        stop: Some(stop),
        parallel,
        finishing,
        profile,
        ..session
    };
    let weights_graph = graph.clone();
    let preprocess = data.preprocess.to_json();
    let mut result = train::train_session(backend, spec, graph, data, &mut metrics, session);
    if let (Ok(outcome), true) = (result.as_mut(), finishing) {
        (outcome.last_train, outcome.last_eval) = final_rows(&metrics_path);
    }
    if let Ok(outcome) = &result {
        if outcome.interrupted.is_none() {
            let path = run.path.join(weights::MODEL_FILE);
            let written =
                weights::write(&path, &weights_graph, &outcome.final_weights, &preprocess);
            if let Err(e) = written {
                result = Err(e);
            }
        }
    }
    let wall = started.elapsed().as_secs_f64();
    let resumed_from = resumed_from.map(|p| p.display().to_string());
    let outcome = match result {
        Ok(outcome) => outcome,
        Err(e) => return Err(record_failure(run, spec, e, wall, Training::Begun)),
    };
    let ended = match outcome.interrupted {
        Some(_) => Ended::Interrupted(summary::Interrupted {
            signal: outcome.interrupted,
            steps: outcome.steps,
            checkpoint: outcome
                .last_checkpoint
                .as_ref()
                .map(|p| p.display().to_string()),
            resumed_from,
        }),
        None => {
            let mut finals = BTreeMap::new();
            for row in outcome.last_train.iter().chain(&outcome.last_eval) {
                let finite = |v: f64| v.is_finite().then_some(v);
                finals.insert(format!("{}_loss", row.split), finite(row.loss));
                if let Some(a) = row.accuracy {
                    finals.insert(format!("{}_accuracy", row.split), finite(a));
                }
            }
            let evaluated: String = outcome
                .last_eval
                .iter()
                .map(|r| {
                    let accuracy = r
                        .accuracy
                        .map_or(String::new(), |a| format!(" accuracy {:.2}%", 100.0 * a));
                    format!(", {} loss {:.4}{accuracy}", r.split, r.loss)
                })
                .collect();
            let done = format!(
                "done: {} steps in {:.2} s, {:.0} samples/s{evaluated}",
                outcome.steps,
                wall,
                outcome.samples_per_sec(),
            );
            tracing::info!("{done}");
            // --quiet keeps the outcome's line.
            if args.quiet {
                eprintln!("{done}");
            }
            Ended::Completed(summary::Completed {
                device: device.to_string(),
                steps: outcome.steps,
                skipped_steps: outcome.skipped_steps,
                epochs: outcome.epochs,
                train_s: outcome.train_seconds,
                samples_per_sec: outcome.samples_per_sec(),
                startup_s: outcome
                    .first_step_at
                    .map(|at| at.saturating_duration_since(began).as_secs_f64()),
                cuda_graph_recordings: outcome.step_recordings,
                cuda_graph_update_recordings: outcome.update_recordings,
                memory_planned_bytes: all_replicas_memory(spec, &weights_graph, &memory),
                device_memory_peak_bytes: backend.memory().map(|(_, peak)| peak),
                resumed_from,
                finals,
            })
        }
    };
    let summary = Summary {
        end_reason: match ended {
            Ended::Interrupted(_) => EndReason::Interrupted,
            _ => outcome.end_reason,
        },
        ended,
        run_id: run.id.clone(),
        job: spec.name().to_string(),
        wall_s: wall,
    };
    if let Err(summary_error) = run.write_summary(&summary) {
        // A resume completes a run from its final checkpoint: the hint applies.
        return Err(with_resume_hint(summary_error, run, false));
    }
    match outcome.interrupted {
        Some(signal) => {
            let name = crate::signals::name(signal);
            let checkpoint = outcome.last_checkpoint.map_or("no checkpoint".into(), |p| {
                format!("checkpoint {}", p.display())
            });
            Err(Error::Interrupted {
                signal,
                message: format!(
                    "stopped by {name} after step {}; {checkpoint} written; continue with: {}",
                    outcome.steps,
                    resume_command(&run.path)
                ),
            })
        }
        None => Ok(()),
    }
}

/// Prints `path` and a line end on stdout as its bytes (a path that is not UTF-8 too, so
/// that `R=$(trainer run ...)` names the directory).
pub(crate) fn print_path(path: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let mut out = std::io::stdout().lock();
    out.write_all(path.as_os_str().as_bytes())
        .and_then(|()| out.write_all(b"\n"))
        .and_then(|()| out.flush())
}
