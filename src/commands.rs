//! The CLI's commands as library functions: `run`, `check`, `devices`, `schema`.

use crate::checkpoint::weights::{self, Weights};
use crate::checkpoint::{self, ResumePoint};
use crate::data::{self, Data};
use crate::error::{Error, Result};
use crate::graph::{ActivationStorage, DataShape, GradBuckets, Graph, MemoryPlan};
use crate::optim;
use crate::parallel::{BatchLayout, CpuAllReduce, Rendezvous};
use crate::run::{MetricsRow, MetricsWriter, RunDir};
use crate::signals::Stop;
use crate::spec::{
    self, parse_device, CollectiveBackend, DataPlacement, DeviceChoice, JobSpec, ParallelDevices,
    PrecisionFallback, PrecisionMode, ResumeMode,
};
use crate::tensor::cpu::CpuBackend;
use crate::tensor::cuda::{self, CudaBackend};
use crate::tensor::{spatial, Backend};
use crate::train::{
    self, CpuReplicas, DataParallel, OneDeviceCollective, ProcessReplicas, Session,
};
use std::path::{Path, PathBuf};
use std::time::Instant;

pub struct RunArgs {
    pub job: PathBuf,
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
}

/// How a run begins: fresh (from the seeded initialisation or model.init_from), or from a
/// checkpoint, in that checkpoint's run directory.
enum Start {
    Fresh { initial: Option<Weights> },
    Resume(Box<ResumePoint>),
}

impl Start {
    fn resumes(&self) -> bool {
        matches!(self, Start::Resume(_))
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
    let data = data::load(&spec.data, spec.job.seed)?;
    let (batch_size, train_len) = (spec.batch_size(), data.train.len);
    if spec.data.drop_last && train_len < batch_size {
        return Err(Error::Job(format!(
            "{}: data.drop_last = true with batch_size {batch_size} leaves no batch: the \
             training split has only {train_len} samples",
            job.display()
        )));
    }
    let shape = DataShape {
        sample_shape: data.sample_shape.clone(),
        classes: data.classes,
        target_dim: data.target_dim,
    };
    // The model's errors say which layer; this says where the layers came from.
    let graph = Graph::build(&spec, &shape).map_err(|e| match e {
        Error::Job(m) => {
            let Ok(sources) = spec::KeySources::new(job, sets) else {
                return Error::Job(format!("{}: {m}", job.display()));
            };
            let layers = sources.of("model.layers");
            // The shape the layers are given may come from elsewhere (a --set).
            let shape_from = sources.of("model.input_shape");
            let note = match &spec.model.input_shape {
                Some(shape) if shape_from != layers => {
                    format!(" (model.input_shape = {shape:?} is from {shape_from})")
                }
                _ => String::new(),
            };
            Error::Job(format!("{layers}: {m}{note}"))
        }
        e => e,
    })?;
    check_token_ids(&graph, &data)?;
    check_batch_norm_batches(job, &spec, &graph, data.train.len)?;
    Ok(Prepared { spec, data, graph })
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
    let one_per_channel = graph
        .layers
        .iter()
        .enumerate()
        .find(|(_, l)| matches!(l.op, crate::graph::Op::BatchNorm { spatial: 1, .. }));
    let Some((i, layer)) = one_per_channel else {
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
        "{}: model.layers[{i}] ({}) would train on {which}, {n} sample{}{share}: one value per \
         channel, whose variance is 0 (PyTorch refuses to train on it); {fix} ({train_len} \
         training samples)",
        job.display(),
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
fn check_token_ids(graph: &Graph, data: &Data) -> Result<()> {
    let embeddings = graph.embeddings();
    let Some(&(layer, vocab)) = embeddings.iter().min_by_key(|&&(_, v)| v) else {
        return Ok(());
    };
    let row = data.row_len();
    let sets =
        std::iter::once(("train", &data.train)).chain(data.eval.iter().map(|(n, d)| (*n, d)));
    for (split, set) in sets {
        if let Some((i, v)) = set
            .features
            .iter()
            .enumerate()
            .find(|(_, v)| !(v.fract() == 0.0 && (0.0..vocab as f32).contains(*v)))
        {
            return Err(Error::Job(format!(
                "model.layers[{layer}] (embedding): the {split} data holds {v} (sample {}, \
                 feature {}), but token ids must be whole numbers in [0, {vocab}) \
                 (num_embeddings{}); set data.normalize = \"none\" for token data",
                i / row,
                i % row,
                if embeddings.len() > 1 {
                    ", the smallest of the embeddings'"
                } else {
                    ""
                }
            )));
        }
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

/// Trains a job, or continues one from a checkpoint; returns the run directory (None on the
/// ranks but 0 of a multi-process run: rank 0 writes the run directory).
pub fn run(args: &RunArgs) -> Result<Option<PathBuf>> {
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
        crate::parallel::tell_stopped(&world, error);
    }
}

fn run_job(args: &RunArgs) -> Result<Option<PathBuf>> {
    let began = run_began();
    let Prepared { spec, data, graph } = prepare(&args.job, &args.sets, args.name.as_deref())?;
    if spec.parallel.launches_processes(&spec.device.kind) {
        // This process only starts and watches the replicas' processes.
        drop((data, graph));
        return crate::launch::run(args, &spec);
    }
    let rank = spec.parallel.world.as_ref().map_or(0, |w| w.rank);
    // Only rank 0 reads checkpoints and init_from files: it sends the others its state.
    let start = match rank {
        0 => Some(plan_start(args, &spec, &graph, data.train.len)?),
        _ => None,
    };
    match pick_device(&args.job, &args.sets, &spec)? {
        Device::Cpu => {
            check_host_memory(&spec, &graph, &data)?;
            // With data parallelism every replica gets a pool of its own part of the threads
            // (train::replicas); rank 0's is this one.
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
                    return train::serve(&backend, &spec, graph, data, args.resume.as_deref())
                        .map(|()| None);
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
                run_on(args, began, &spec, data, graph, &backend, start, parallel).map(Some)
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
                return train::serve(&backend, &spec, graph, data, args.resume.as_deref())
                    .map(|()| None);
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
            run_on(args, began, &spec, data, graph, &backend, start, parallel).map(Some)
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
fn process_replicas<B: Backend + 'static>(
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
fn run_on<B: Backend>(
    args: &RunArgs,
    began: Instant,
    spec: &JobSpec,
    data: Data,
    graph: Graph,
    backend: &B,
    start: Start,
    parallel: Option<Box<dyn DataParallel<B>>>,
) -> Result<PathBuf> {
    let run = match &start {
        Start::Fresh { .. } => match &args.dir {
            Some(dir) => RunDir::create_at(dir)?,
            None => RunDir::create(&args.runs_dir, spec.name())?,
        },
        Start::Resume(point) => {
            let run = RunDir::open(&point.run_dir)?;
            // Until this attempt finishes, the run must not look finished.
            let _ = std::fs::remove_file(run.path.join("summary.json"));
            let (dir, step) = (run.path.join(checkpoint::DIR), point.checkpoint.state.step);
            let moved = checkpoint::set_aside_after(&dir, step)?;
            if moved > 0 {
                tracing::info!(
                    "{moved} checkpoint(s) after step {step}, of the continuation this resume \
                     replaces, moved to {}",
                    dir.join(checkpoint::SUPERSEDED_DIR).display()
                );
            }
            run
        }
    };
    let resumed = match &start {
        Start::Resume(point) => {
            format!(
                "\n# resumed from {} (step {})",
                point.checkpoint.path.display(),
                point.checkpoint.state.step
            )
        }
        Start::Fresh { .. } => String::new(),
    };
    let device = parallel
        .as_ref()
        .map_or_else(|| backend.describe(), |p| p.describe());
    let header = format!(
        "# trainer run {} {}\n# resolved spec: defaults filled in, overrides applied\n# device: {device}\n# batch: {}{resumed}",
        args.job.display(),
        args.sets.iter().map(|s| format!("--set {s}")).collect::<Vec<_>>().join(" "),
        BatchLayout::of(spec),
    );
    run.write_config(spec, &header)?;
    crate::provenance::write(&run, spec, &device)?;
    let log = run.path.join("train.log");
    crate::logging::attach_run_log(&log)
        .map_err(|e| Error::Runtime(format!("cannot create {}: {e}", log.display())))?;
    let result = run_in(
        &run, args, began, spec, data, graph, backend, start, parallel,
    );
    if let Err(e) = &result {
        // The log of a failed run ends with why (summary.json has it too).
        crate::logging::append_to_run_log(&format!("error: {e}\n"));
    }
    crate::logging::detach_run_log();
    result.map(|()| run.path)
}

/// Decides how the run begins, and checks everything about it that can be wrong before a
/// run directory is touched: the checkpoint (found, intact, of this job, not past the end)
/// or the model.init_from file.
fn plan_start(args: &RunArgs, spec: &JobSpec, graph: &Graph, train_len: usize) -> Result<Start> {
    let target = match (&args.resume, spec.checkpoint.resume) {
        (Some(path), _) => Some(path.clone()),
        (None, Some(ResumeMode::Auto)) => checkpoint::find_auto_resume(&args.runs_dir, spec.name()),
        _ => None,
    };
    let Some(target) = target else {
        let resumes_auto = spec.checkpoint.resume == Some(ResumeMode::Auto);
        if (args.force || args.resume_fallback) && !resumes_auto {
            // Without anything to resume, the flag would be ignored: likely a script that
            // lost its --resume, about to start over instead of continuing.
            let flag = if args.force {
                "--force"
            } else {
                "--resume-fallback"
            };
            return Err(Error::Job(format!(
                "{flag} applies to a resumed run: give --resume RUN_DIR|CHECKPOINT (or set \
                 checkpoint.resume = \"auto\"), or leave {flag} out to start afresh"
            )));
        }
        let initial = match &spec.model.init_from {
            Some(path) => Some(weights::read(path, graph)?),
            None => None,
        };
        return Ok(Start::Fresh { initial });
    };
    let loading = Instant::now();
    let mut point = checkpoint::locate(&target, args.resume_fallback)?;
    let c = &mut point.checkpoint;
    let name = c.path.display().to_string();
    tracing::info!(
        "read and verified checkpoint {name} ({:.1} MiB) in {:.3} s",
        std::fs::metadata(&c.path).map_or(0, |m| m.len()) as f64 / (1024.0 * 1024.0),
        loading.elapsed().as_secs_f64()
    );
    let (job, _) = checkpoint::spec_json(spec);
    let changes = checkpoint::incompatible_changes(&c.spec, &job);
    if !changes.is_empty() {
        if !args.force {
            return Err(Error::Job(format!(
                "cannot resume from {name}: the job differs from the checkpoint's in keys that \
                 change training:\n  {}\n(only {} may change; pass --force to resume anyway)",
                changes.join("\n  "),
                checkpoint::changeable_keys()
            )));
        }
        tracing::warn!(
            "--force: resuming from {name} although the job changed: {}",
            changes.join("; ")
        );
    }
    if c.params.len() != graph.param_len {
        // Written before each parameter tensor was aligned in the flat buffer: the same
        // values, back to back.
        if let Some(params) = graph.from_packed_layout(&c.params) {
            c.params = params;
            for (_, state) in &mut c.optimizer {
                if let Some(aligned) = graph.from_packed_layout(state) {
                    *state = aligned;
                }
            }
        }
    }
    if c.params.len() != graph.param_len {
        return Err(Error::Job(format!(
            "cannot resume from {name}: it holds {} parameter values, the job's model needs {} \
             ({} parameters)",
            c.params.len(),
            graph.param_len,
            graph.parameter_count()
        )));
    }
    if c.running_stats.len() != graph.running_stats_len() {
        return Err(Error::Job(format!(
            "cannot resume from {name}: it holds {} batch-norm running statistics, the job's \
             model has {}",
            c.running_stats.len(),
            graph.running_stats_len()
        )));
    }
    let kept: Vec<&str> = c.optimizer.iter().map(|(n, _)| n.as_str()).collect();
    if kept != optim::state_names(spec) {
        // Only reachable with --force: the optimizer changed kind.
        tracing::warn!("--force: the optimizer changed; its state starts afresh");
        c.optimizer.clear();
        c.state.optimizer_steps = 0;
    }
    let total = train::total_steps(spec, train_len) as u64;
    let step = c.state.step;
    let finishing = nothing_left_to_train(c, spec, total);
    if finishing && run_completed(&point.run_dir) {
        let why = if c.state.end_reason == Some(train::EndReason::EarlyStopped) {
            "early stopping ended it there; change train.early_stopping (its patience, say) or \
             remove it to train further"
                .to_string()
        } else {
            format!(
                "this job trains {total} steps (train.epochs = {}{}); raise train.epochs or \
                 train.max_steps to train further",
                spec.train.epochs,
                spec.train
                    .max_steps
                    .map_or(String::new(), |m| format!(", train.max_steps = {m}"))
            )
        };
        return Err(Error::Job(format!(
            "cannot resume from {name}: it is at step {step}, where the run completed, and \
             {why}"
        )));
    }
    if step > total && !c.state.finished {
        return Err(Error::Job(format!(
            "cannot resume from {name}: it is at step {step} and this job trains {total} steps \
             (train.epochs = {}{}); raise train.epochs or train.max_steps to train further",
            spec.train.epochs,
            spec.train
                .max_steps
                .map_or(String::new(), |m| format!(", train.max_steps = {m}"))
        )));
    }
    // Its rows up to the checkpoint must be there before anything of the run is rewritten.
    let metrics = point.run_dir.join("metrics.csv");
    MetricsWriter::resumable_len(&metrics, c.state.metrics_rows)?;
    if finishing {
        tracing::info!(
            "{name} is the final checkpoint of {}, which stopped before it completed: writing \
             its weights and summary (nothing is trained)",
            point.run_dir.display()
        );
    } else {
        tracing::info!(
            "resuming {} from {name} (step {step})",
            point.run_dir.display()
        );
    }
    Ok(Start::Resume(Box::new(point)))
}

/// A final checkpoint (`finished`) with nothing left to train for `spec`: its run ended
/// at the job's last step, or early stopping ended it and the job stops early as it did.
fn nothing_left_to_train(c: &checkpoint::Checkpoint, spec: &JobSpec, total: u64) -> bool {
    let same_early_stopping =
        || c.spec["train"]["early_stopping"] == serde_json::json!(spec.train.early_stopping);
    c.state.finished
        && (c.state.step >= total
            || (c.state.end_reason == Some(train::EndReason::EarlyStopped)
                && same_early_stopping()))
}

/// Whether the run in `dir` completed: its summary says so and its final weights are there
/// (a run stopped while writing them has its final checkpoint, but not these).
fn run_completed(dir: &Path) -> bool {
    let summary = std::fs::read_to_string(dir.join("summary.json"))
        .ok()
        .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok());
    summary.is_some_and(|s| s["status"] == "completed") && dir.join(weights::MODEL_FILE).is_file()
}

/// The rows a finished run ended with, read back from its metrics.csv (for a run that is
/// only finishing): its last train row and each evaluated split's last row.
fn final_rows(metrics: &Path) -> (Option<MetricsRow>, Vec<MetricsRow>) {
    let mut last_train = None;
    let mut last_eval: Vec<MetricsRow> = Vec::new();
    for point in crate::results::read_metrics(metrics) {
        let split = match point.split.as_str() {
            "train" => "train",
            "val" => "val",
            "test" => "test",
            _ => continue,
        };
        let row = MetricsRow {
            step: point.step,
            epoch: point.epoch,
            split,
            loss: point.values.get("loss").copied().unwrap_or(f64::NAN),
            accuracy: point.values.get("accuracy").copied(),
            ..Default::default()
        };
        if split == "train" {
            last_train = Some(row);
        } else {
            last_eval.retain(|r| r.split != split);
            last_eval.push(row);
        }
    }
    (last_train, last_eval)
}

#[allow(clippy::too_many_arguments)]
fn run_in<B: Backend>(
    run: &RunDir,
    args: &RunArgs,
    began: Instant,
    spec: &JobSpec,
    data: Data,
    graph: Graph,
    backend: &B,
    start: Start,
    parallel: Option<Box<dyn DataParallel<B>>>,
) -> Result<()> {
    let started = Instant::now();
    let memory = memory_plan(spec, &graph, &data, backend.free_memory());
    let layout = BatchLayout::of(spec);
    let device = parallel
        .as_ref()
        .map_or_else(|| backend.describe(), |p| p.describe());
    tracing::info!(
        "run {} ({}): {} parameters, {} training samples, device {device}, batch {layout}, \
         planned memory {}{}",
        run.path.display(),
        spec.name(),
        graph.parameter_count(),
        data.train.len,
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
        Start::Resume(point) => nothing_left_to_train(&point.checkpoint, spec, total),
        Start::Fresh { .. } => false,
    };
    let (mut metrics, session) = match start {
        Start::Fresh { initial } => (
            MetricsWriter::create(&metrics_path)?,
            Session {
                initial,
                ..Session::default()
            },
        ),
        Start::Resume(point) => (
            MetricsWriter::resume(&metrics_path, point.checkpoint.state.metrics_rows)?,
            Session {
                resume: Some(point.checkpoint),
                ..Session::default()
            },
        ),
    };
    let resumed_from = session.resume.as_ref().map(|c| c.path.clone());
    let stop = Stop::install()
        .map_err(|e| Error::Runtime(format!("cannot install the SIGINT/SIGTERM handlers: {e}")))?;
    let session = Session {
        checkpoint_dir: Some(run.path.join(checkpoint::DIR)),
        stop: Some(&stop),
        parallel,
        finishing,
        ..session
    };
    let weights_graph = graph.clone();
    let mut result = train::train_session(backend, spec, graph, data, &mut metrics, session);
    if let (Ok(outcome), true) = (result.as_mut(), finishing) {
        (outcome.last_train, outcome.last_eval) = final_rows(&metrics_path);
    }
    if let Ok(outcome) = &result {
        if outcome.interrupted.is_none() {
            let path = run.path.join(weights::MODEL_FILE);
            if let Err(e) = weights::write(&path, &weights_graph, &outcome.final_weights) {
                result = Err(e);
            }
        }
    }
    let wall = started.elapsed().as_secs_f64();
    let resumed_from = resumed_from.map(|p| p.display().to_string());
    let summary = match &result {
        Ok(outcome) if outcome.interrupted.is_some() => serde_json::json!({
            "status": "interrupted",
            "run_id": run.id,
            "job": spec.name(),
            "signal": outcome.interrupted,
            "steps": outcome.steps,
            "checkpoint": outcome.last_checkpoint.as_ref().map(|p| p.display().to_string()),
            "resumed_from": resumed_from,
            "wall_s": wall,
        }),
        Ok(outcome) => {
            let mut finals = serde_json::Map::new();
            for row in outcome.last_train.iter().chain(&outcome.last_eval) {
                finals.insert(format!("{}_loss", row.split), row.loss.into());
                if let Some(a) = row.accuracy {
                    finals.insert(format!("{}_accuracy", row.split), a.into());
                }
            }
            tracing::info!(
                "done: {} steps in {:.2} s, {:.0} samples/s{}",
                outcome.steps,
                wall,
                outcome.samples_per_sec(),
                outcome
                    .last_eval
                    .iter()
                    .filter_map(|r| r.accuracy.map(|a| format!(
                        ", {} accuracy {:.2}%",
                        r.split,
                        100.0 * a
                    )))
                    .collect::<String>()
            );
            serde_json::json!({
                "status": "completed",
                "end_reason": outcome.end_reason.as_str(),
                "run_id": run.id,
                "job": spec.name(),
                "device": device,
                "steps": outcome.steps,
                "epochs": outcome.epochs,
                "wall_s": wall,
                "train_s": outcome.train_seconds,
                "samples_per_sec": outcome.samples_per_sec(),
                "startup_s": outcome
                    .first_step_at
                    .map(|at| at.saturating_duration_since(began).as_secs_f64()),
                "cuda_graph_recordings": outcome.step_recordings,
                "cuda_graph_update_recordings": outcome.update_recordings,
                "memory_planned_bytes": all_replicas_memory(spec, &weights_graph, &memory),
                "device_memory_peak_bytes": backend.memory().map(|(_, peak)| peak),
                "resumed_from": resumed_from,
                "final": finals,
            })
        }
        Err(e) => serde_json::json!({
            "status": "failed",
            "end_reason": match e {
                Error::Diverged(_) => train::EndReason::Diverged,
                _ => train::EndReason::Failed,
            }
            .as_str(),
            "run_id": run.id,
            "job": spec.name(),
            "error": e.to_string(),
            "wall_s": wall,
        }),
    };
    if let Err(summary_error) = run.write_summary(&summary) {
        // The run's own error (a full disk writing metrics.csv, say) is the cause to show.
        // Either way the resume hint applies: a resume completes a run from its final
        // checkpoint.
        let error = match result {
            Ok(_) => summary_error,
            Err(e) => e.with_note(&format!(
                "summary.json could not be written either: {summary_error}"
            )),
        };
        return Err(with_resume_hint(error, args, run));
    }
    let outcome = result.map_err(|e| with_resume_hint(e, args, run))?;
    match outcome.interrupted {
        Some(signal) => {
            let name = if signal == crate::signals::SIGTERM {
                "SIGTERM"
            } else {
                "SIGINT"
            };
            let checkpoint = outcome.last_checkpoint.map_or("no checkpoint".into(), |p| {
                format!("checkpoint {}", p.display())
            });
            Err(Error::Interrupted {
                signal,
                message: format!(
                    "stopped by {name} after step {}; {checkpoint} written; continue with: {}",
                    outcome.steps,
                    resume_command(args, &run.path)
                ),
            })
        }
        None => Ok(()),
    }
}

/// A run that failed says where it is, and, after writing checkpoints, how to continue
/// from the newest.
fn with_resume_hint(e: Error, args: &RunArgs, run: &RunDir) -> Error {
    let e = match e {
        Error::Runtime(_) | Error::Diverged(_) => e.with_note(&format!(
            "the run: {} (its summary.json and train.log say so too)",
            run.path.display()
        )),
        other => return other,
    };
    let Error::Runtime(message) = e else {
        return e;
    };
    let Some((step, _)) = checkpoint::list(&run.path.join(checkpoint::DIR)).pop() else {
        return Error::Runtime(message);
    };
    Error::Runtime(format!(
        "{message}\nthe run's checkpoints remain (the newest at step {step}); continue with: {}",
        resume_command(args, &run.path)
    ))
}

/// The command that continues `run`: the job and its `--set` overrides (without them the
/// resume would be refused, or quietly train another length), shell-quoted.
fn resume_command(args: &RunArgs, run: &Path) -> String {
    let quote = |s: &str| {
        let plain = |b: u8| b.is_ascii_alphanumeric() || b"._-/=:".contains(&b);
        if !s.is_empty() && s.bytes().all(plain) {
            s.to_string()
        } else {
            format!("'{}'", s.replace('\'', r"'\''"))
        }
    };
    let mut command = format!(
        "trainer run {} --resume {}",
        quote(&args.job.display().to_string()),
        quote(&run.display().to_string())
    );
    for set in &args.sets {
        command += &format!(" --set {}", quote(set));
    }
    command
}

/// What the run (one replica of it, with data parallelism) will hold: the graph's buffers,
/// and on a GPU (`gpu_memory`: the bytes it has for this run) also the cuBLAS workspace and
/// the data set, unless it is streamed (device.data = "streamed", or "auto" with a data set
/// that does not fit beside the rest: `samples::fits_on_device`).
fn memory_plan(
    spec: &JobSpec,
    graph: &Graph,
    data: &Data,
    gpu_memory: Option<usize>,
) -> MemoryPlan {
    let on_gpu = gpu_memory.is_some();
    let (batch, threads) = (BatchLayout::of(spec).per_replica(), replica_threads(spec));
    let mixed = spec.precision.mode != PrecisionMode::Fp32;
    // Mixed precision with token ids: the data's rounded copy (`Graph::rounded_data_len`),
    // half-width on a GPU.
    let rounded_data = if mixed {
        batch * graph.rounded_data_len() * if on_gpu { 2 } else { 4 }
    } else {
        0
    };
    let (data_bytes, workspace) = if on_gpu {
        let conv = graph.conv_workspace(|s| cuda::conv_workspace_len(s, batch));
        // With the row indices of a resident data set; taken out below if it is streamed.
        let own = cuda::own_bytes(batch, true);
        (data.bytes(), own + 4 * conv + rounded_data)
    } else {
        let conv = graph.conv_workspace(|s| spatial::conv_workspace_len(s, threads, batch));
        (0, 4 * conv + rounded_data)
    };
    let mut plan = MemoryPlan::new(
        graph,
        batch,
        optim::state_buffers(spec),
        data_bytes,
        workspace,
        activation_storage(spec, on_gpu),
    );
    // The half copy of the parameters: half-width on a GPU.
    if mixed {
        plan.half_params = if on_gpu { plan.params / 2 } else { plan.params };
    }
    let resident = match (spec.device.data, gpu_memory) {
        (_, None) | (DataPlacement::Resident, _) => true,
        (DataPlacement::Streamed, _) => false,
        (DataPlacement::Auto, Some(memory)) => {
            let rest = plan.total() - plan.data;
            crate::train::fits_on_device(plan.data, memory.saturating_sub(rest))
        }
    };
    if !resident {
        plan.data = 0;
        plan.workspace -= cuda::own_bytes(batch, true) - cuda::own_bytes(batch, false);
    }
    plan
}

/// How the run's backend stores activations: `Backend::alloc_half` stores half values in the
/// half format on a GPU only.
fn activation_storage(spec: &JobSpec, on_gpu: bool) -> ActivationStorage {
    match (spec.precision.mode, on_gpu) {
        (PrecisionMode::Fp32, _) => ActivationStorage::F32,
        (_, false) => ActivationStorage::HalfValues,
        (_, true) => ActivationStorage::HalfWidth,
    }
}

/// A run's planned memory over all its data-parallel replicas: each holds its own buffers
/// (the data set is shared), and the all-reduce its exchange buffers.
fn all_replicas_memory(spec: &JobSpec, graph: &Graph, one: &MemoryPlan) -> usize {
    let replicas = spec
        .parallel
        .thread_replicas(&spec.device.kind)
        .unwrap_or(1);
    (one.total().saturating_mul(replicas))
        .saturating_add(4 * CpuAllReduce::exchange_len(replicas, graph.param_len))
}

/// Refuses a CPU job that plans more memory than this machine has free, before anything is
/// allocated or a run directory made: the allocation would abort the process instead.
fn check_host_memory(spec: &JobSpec, graph: &Graph, data: &Data) -> Result<()> {
    let needed = all_replicas_memory(spec, graph, &memory_plan(spec, graph, data, None));
    match host_memory_free() {
        Some(free) => fits(needed, free, "this machine"),
        None => Ok(()),
    }
}

/// Refuses a GPU job (this process's replica) that plans more memory than the device has
/// free, before a run directory is made, in the CPU's terms rather than as the first
/// allocation that fails. The measured peak is the plan or slightly above it (BENCHMARKS.md),
/// so nothing refused here would have fitted.
fn check_device_memory(
    spec: &JobSpec,
    graph: &Graph,
    data: &Data,
    backend: &CudaBackend,
    ordinal: usize,
) -> Result<()> {
    let Some(free) = backend.free_memory() else {
        return Ok(());
    };
    let needed = memory_plan(spec, graph, data, Some(free)).total();
    fits(needed, free, &format!("cuda:{ordinal}"))
}

fn fits(needed: usize, free: usize, place: &str) -> Result<()> {
    if needed <= free {
        return Ok(());
    }
    Err(Error::Runtime(format!(
        "not enough memory: this job plans {} (`trainer check` shows where it goes) but \
         {place} has {} free; lower data.batch_size or the model's sizes",
        bytes(needed),
        bytes(free)
    )))
}

/// What the host can still allocate: available memory and free swap (/proc/meminfo); None
/// where that cannot be read.
fn host_memory_free() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = |key: &str| {
        info.lines().find_map(|line| {
            let rest = line.strip_prefix(key)?.trim().strip_suffix("kB")?;
            rest.trim().parse::<usize>().ok()
        })
    };
    Some((kib("MemAvailable:")? + kib("SwapFree:").unwrap_or(0)) * 1024)
}

/// How data parallelism averages the gradients on the resolved device (`on_gpus`): bucket by
/// bucket during the backward pass (parallel.overlap) or after it. None without data
/// parallelism.
fn gradient_averaging(spec: &JobSpec, graph: &Graph, on_gpus: bool) -> Option<String> {
    spec.parallel.replicas()?;
    let processes =
        spec.parallel.world.is_some() || spec.parallel.launches_processes(&spec.device.kind);
    let through_links = spec.parallel.backend == CollectiveBackend::Tcp || (processes && !on_gpus);
    let route = if through_links {
        " through rank 0 over tcp"
    } else {
        ""
    };
    if !spec.parallel.overlap {
        return Some(format!(
            "averaged{route} after the backward pass (parallel.overlap = false)"
        ));
    }
    if through_links && on_gpus {
        return Some(format!(
            "averaged{route} after the backward pass (a CUDA graph cannot wait for sockets)"
        ));
    }
    let buckets = GradBuckets::new(graph, spec.parallel.bucket_bytes());
    let sizes: Vec<String> = buckets
        .in_backward_order()
        .map(|b| bytes(4 * b.len()))
        .collect();
    let n = sizes.len();
    Some(format!(
        "averaged{route} in {n} bucket{} during the backward pass, from the last layers: {}",
        if n == 1 { "" } else { "s" },
        sizes.join(", ")
    ))
}

/// Validates a job and describes its graph, shapes, parameters and memory.
pub fn check(job: &Path, sets: &[String]) -> Result<String> {
    let Prepared { spec, data, graph } = prepare(job, sets, None)?;
    // What `run` reads before it trains: a bad file is the job's fault.
    if let Some(path) = &spec.model.init_from {
        weights::read(path, &graph)?;
    }
    let mut out = String::new();
    let eval: Vec<String> = data
        .eval
        .iter()
        .map(|(n, d)| format!("{n} {}", d.len))
        .collect();
    let processes = spec.parallel.world.as_ref().map_or(String::new(), |w| {
        format!(
            " (processes: this is rank {} of {}, meeting at {}:{})",
            w.rank, w.world_size, w.master_addr, w.master_port
        )
    });
    out += &format!(
        "job {} ({}): ok\ndata: {:?}, train {}{}{}\nbatch: {}{processes}\n\n",
        spec.name(),
        job.display(),
        spec.data.source,
        data.train.len,
        if eval.is_empty() {
            String::new()
        } else {
            format!(", {}", eval.join(", "))
        },
        data.classes
            .map_or(String::new(), |c| format!(", {c} classes")),
        BatchLayout::of(&spec)
    );
    // The inputs column appears when some layer reads other than the previous output.
    let sequential = graph
        .layers
        .iter()
        .enumerate()
        .all(|(i, l)| l.inputs == [i]);
    let node_name = |n: usize| match n {
        0 => "input".to_string(),
        n => graph.layers[n - 1].prefix(n - 1),
    };
    let inputs: Vec<String> = graph
        .layers
        .iter()
        .map(|l| {
            let names: Vec<String> = l.inputs.iter().map(|&n| node_name(n)).collect();
            names.join(", ")
        })
        .collect();
    let name_width = (0..=graph.layers.len())
        .map(|n| node_name(n).len())
        .max()
        .unwrap_or(0);
    let inputs_width = inputs.iter().map(String::len).max().unwrap_or(0);
    let row = |layer: &str, kind: &str, inputs: &str, shape: &str, params: &str| {
        let inputs = if sequential {
            String::new()
        } else {
            format!("{inputs:<inputs_width$}  ")
        };
        format!("{layer:<name_width$}  {kind:<15} {inputs}{shape:<16} {params:>10}\n")
    };
    out += &row("layer", "type", "inputs", "output", "params");
    out += &row("input", "", "", &format!("{:?}", graph.input_shape), "");
    let in_place = graph.buffer_plan().in_place;
    for (i, layer) in graph.layers.iter().enumerate() {
        let kind = match in_place[i] {
            true => format!("{} *", layer.kind),
            false => layer.kind.to_string(),
        };
        out += &row(
            &layer.prefix(i),
            &kind,
            &inputs[i],
            &format!("{:?}", layer.out_shape),
            &group_digits(layer.param_count),
        );
    }
    out += &format!(
        "total parameters: {}\n",
        group_digits(graph.parameter_count())
    );
    if in_place.contains(&true) {
        out += "* in place: writes its output over its input, which no other layer needs\n";
    }
    // Predict for the device the job names; `auto` is resolved as `run` would resolve it.
    let gpu = match pick_device(job, sets, &spec)? {
        Device::Cpu => None,
        Device::Cuda(n) => Some(n),
    };
    let on_gpu = gpu.is_some();
    if let Some(how) = gradient_averaging(&spec, &graph, on_gpu) {
        out += &format!("all-reduce: gradients {how}\n");
    }
    out += "\n";
    // The GPU's whole memory: what "auto" would find free when nothing else runs there.
    let gpu_memory = gpu.map(|n| match cuda::probe() {
        Ok((devices, _)) => devices.get(n).map_or(usize::MAX, |d| d.memory_bytes),
        Err(_) => usize::MAX,
    });
    let m = memory_plan(&spec, &graph, &data, gpu_memory);
    let device = if on_gpu {
        spec.device.kind.replace("auto", "cuda:0")
    } else {
        format!("cpu ({} threads)", replica_threads(&spec))
    };
    let layout = BatchLayout::of(&spec);
    let replicas = match spec.parallel.replicas() {
        Some(n) => format!(", per replica ({n} replicas)"),
        None => String::new(),
    };
    out += &format!(
        "memory on {device}, batch {}{replicas}:\n",
        layout.per_replica()
    );
    let mut rows = vec![
        ("parameters", m.params),
        ("gradients", m.grads),
        ("half-precision weights", m.half_params),
        ("optimizer state", m.optimizer_state),
        ("activations", m.activations),
        ("activation gradients", m.activation_grads),
        ("batch (inputs, targets)", m.batch),
        ("layer state", m.layer_state),
        ("scratch and statistics", m.workspace),
    ];
    if m.data > 0 {
        rows.push(("data set on the device", m.data));
    }
    rows.retain(|&(what, b)| b > 0 || what != "half-precision weights");
    for (what, b) in rows {
        out += &format!("  {what:<24} {:>12}\n", bytes(b));
    }
    out += &format!("  {:<24} {:>12}\n", "total", bytes(m.total()));
    if on_gpu && m.data == 0 {
        let why = match spec.device.data {
            DataPlacement::Streamed => "device.data = \"streamed\"",
            _ => "device.data = \"auto\": it does not fit beside the rest",
        };
        out += &format!(
            "  data set ({}) streamed from pinned host memory ({why})\n",
            bytes(data.bytes())
        );
    }
    if spec.parallel.launches_processes(&spec.device.kind) {
        let n = spec.parallel.replicas().unwrap_or(1);
        out += &format!("  (each of the {n} processes, one per replica)\n");
    } else if let Some(replicas) = spec.parallel.thread_replicas(&spec.device.kind) {
        out += &format!(
            "  {:<24} {:>12}\n",
            format!("{replicas} replicas + all-reduce"),
            bytes(all_replicas_memory(&spec, &graph, &m))
        );
    }
    if !on_gpu {
        let needed = all_replicas_memory(&spec, &graph, &m);
        if let Some(free) = host_memory_free().filter(|&free| needed > free) {
            out += &format!(
                "  more than the {} this machine has free: `trainer run` would refuse it here\n",
                bytes(free)
            );
        }
    }
    if !on_gpu || spec.device.data == DataPlacement::Streamed {
        let streamed = if on_gpu { ", streamed" } else { "" };
        out += &format!(
            "  {:<24} {:>12}\n",
            format!("data set (host memory{streamed})"),
            bytes(data.bytes())
        );
    }
    match graph.checkpoint_segments {
        Some(segments) => {
            let saved = 1.0 - m.activations as f64 / m.activations_without_checkpointing as f64;
            out += &format!(
                "activation checkpointing: {segments} segments, {} layers recomputed in \
                 backward; activations {} ({} without, {:.0}% less)\n",
                m.recomputed_layers,
                bytes(m.activations),
                bytes(m.activations_without_checkpointing),
                100.0 * saved
            );
        }
        None => {
            let best = crate::graph::BufferPlan::best_segments(&graph.input_shape, &graph.layers);
            let storage = activation_storage(&spec, on_gpu);
            let with = layout.per_replica() * graph.activation_bytes(Some(best), storage).1;
            out += &format!(
                "activation checkpointing: off; with checkpoint.activations = \"all\" ({} \
                 segments) activations would take {}\n",
                best,
                bytes(with)
            );
        }
    }
    Ok(out)
}

/// What this machine can run on.
pub fn devices() -> String {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let model = crate::provenance::cpu_model();
    let mut out = format!("cpu: {model}, {threads} threads\n");
    match cuda::probe() {
        Ok((devices, versions)) if devices.is_empty() => {
            out += &format!("cuda: no GPU ({versions})\n")
        }
        Ok((devices, versions)) => {
            for d in devices {
                let (major, minor) = d.compute_capability;
                out += &format!(
                    "cuda:{}: {}, compute capability {major}.{minor}, {}, {versions}\n",
                    d.ordinal,
                    d.name,
                    bytes(d.memory_bytes)
                );
            }
        }
        Err(why) => out += &format!("cuda: not available ({why})\n"),
    }
    out
}

pub fn bytes(n: usize) -> String {
    let n = n as f64;
    if n < 1024.0 {
        format!("{n} B")
    } else if n < 1024.0 * 1024.0 {
        format!("{:.1} KiB", n / 1024.0)
    } else if n < 1024.0 * 1024.0 * 1024.0 {
        format!("{:.1} MiB", n / (1024.0 * 1024.0))
    } else {
        format!("{:.2} GiB", n / (1024.0 * 1024.0 * 1024.0))
    }
}

fn group_digits(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The command an interrupted or failed run prints keeps the job's overrides, quoted
    /// for a shell: without them the resume would be refused or train another length.
    #[test]
    fn the_resume_command_keeps_the_overrides_quoted() {
        let args = RunArgs {
            job: "jobs/mlp.toml".into(),
            sets: vec![
                "train.epochs=30".into(),
                r#"optimizer.schedule={type="step", step_size=5}"#.into(),
                "job.name='x'".into(),
            ],
            name: None,
            runs_dir: "runs".into(),
            resume: None,
            resume_fallback: false,
            force: false,
            dir: None,
            quiet: false,
        };
        let run = Path::new("runs/mlp/20261124-1");
        let want = r#"trainer run jobs/mlp.toml --resume runs/mlp/20261124-1 --set train.epochs=30 --set 'optimizer.schedule={type="step", step_size=5}' --set 'job.name='\''x'\'''"#;
        assert_eq!(resume_command(&args, run), want);
    }

    /// `check` predicts where a GPU run keeps its data set: "auto" streams it exactly when it
    /// does not fit beside the run's buffers, as the run decides.
    #[test]
    fn gpu_memory_plan_keeps_the_data_set_only_where_it_fits() {
        let job = Path::new("jobs/mlp.toml");
        let Prepared {
            mut spec,
            data,
            graph,
        } = prepare(job, &[], None).unwrap();
        let data_bytes = data.bytes();
        let plan = |spec: &JobSpec, memory| memory_plan(spec, &graph, &data, memory);
        assert_eq!(
            plan(&spec, None).data,
            0,
            "the CPU holds the data set already"
        );
        let roomy = plan(&spec, Some(1 << 40));
        assert_eq!(roomy.data, data_bytes);
        let rest = roomy.total() - roomy.data;
        // Just enough: the data set, the rest, and auto's margin.
        let enough = rest + data_bytes + (256 << 20) + (data_bytes + (256 << 20)) / 9 + 1024;
        assert_eq!(plan(&spec, Some(enough)).data, data_bytes);
        assert_eq!(
            plan(&spec, Some(rest + data_bytes)).data,
            0,
            "no margin left"
        );
        spec.device.data = DataPlacement::Resident;
        assert_eq!(
            plan(&spec, Some(rest)).data,
            data_bytes,
            "resident is obeyed"
        );
        spec.device.data = DataPlacement::Streamed;
        assert_eq!(plan(&spec, Some(1 << 40)).data, 0, "streamed is obeyed");
    }
}
