//! The CLI's commands as library functions: `run`, `check`, `devices`, `schema`.

use crate::data::{self, Data};
use crate::error::{Error, Result};
use crate::graph::{DataShape, Graph, MemoryPlan};
use crate::optim;
use crate::run::{MetricsWriter, RunDir};
use crate::spec::{self, parse_device, DeviceChoice, JobSpec};
use crate::tensor::cpu::CpuBackend;
use crate::tensor::cuda::{self, CudaBackend};
use crate::tensor::Backend;
use crate::train;
use std::path::{Path, PathBuf};
use std::time::Instant;

pub struct RunArgs {
    pub job: PathBuf,
    pub sets: Vec<String>,
    pub name: Option<String>,
    pub runs_dir: PathBuf,
    /// Create the run directory exactly here (a sweep point) instead of a new one under
    /// `<runs_dir>/<name>/`.
    pub dir: Option<PathBuf>,
}

/// A job loaded, with its data and graph: everything `check` shows and `run` needs.
struct Prepared {
    spec: JobSpec,
    data: Data,
    graph: Graph,
    threads: usize,
}

fn prepare(job: &Path, sets: &[String], name: Option<&str>) -> Result<Prepared> {
    let mut spec = spec::load_job(job, sets)?;
    if let Some(name) = name {
        spec.job.name = Some(name.to_string());
    }
    let threads = spec
        .train
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let data = data::load(&spec.data, spec.job.seed)?;
    let shape = DataShape {
        sample_shape: data.sample_shape.clone(),
        classes: data.classes,
        target_dim: data.target_dim,
    };
    let graph = Graph::build(&spec, &shape)?;
    Ok(Prepared {
        spec,
        data,
        graph,
        threads,
    })
}

/// The device a job runs on, after `auto` is resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Device {
    Cpu,
    Cuda(usize),
}

/// Resolves `device.type`. `auto` takes cuda:0 when a usable GPU (driver, device, NVRTC) is
/// present, else the CPU, and logs why.
fn pick_device(spec: &JobSpec) -> Result<Device> {
    let device = match parse_device(&spec.device.kind) {
        Some(DeviceChoice::Cpu) => Device::Cpu,
        Some(DeviceChoice::Cuda(n)) => Device::Cuda(n),
        Some(DeviceChoice::Auto) => match cuda::probe() {
            Ok((devices, _)) if !devices.is_empty() && cuda::kernels::nvrtc_available() => {
                tracing::info!("device auto: cuda:0 ({})", devices[0].name);
                Device::Cuda(0)
            }
            Ok((devices, _)) if devices.is_empty() => {
                tracing::info!("device auto: cpu (the CUDA driver sees no GPU)");
                Device::Cpu
            }
            Ok(_) => {
                tracing::info!("device auto: cpu (a GPU is present but libnvrtc was not found)");
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
    if device == Device::Cpu && spec.device.allow_tf32 {
        tracing::warn!("device.allow_tf32 has no effect on the CPU, which computes in full fp32");
    }
    Ok(device)
}

/// Trains a job; returns the run directory.
pub fn run(args: &RunArgs) -> Result<PathBuf> {
    let Prepared {
        spec,
        data,
        graph,
        threads,
    } = prepare(&args.job, &args.sets, args.name.as_deref())?;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| Error::Runtime(format!("cannot start {threads} CPU threads: {e}")))?;
    match pick_device(&spec)? {
        Device::Cpu => {
            // The loop runs on the pool's threads, so the engine's parallel work is forked from
            // a worker rather than injected from outside (on two cores that halves wake-ups).
            let backend = CpuBackend::new(threads);
            pool.install(|| run_on(args, &spec, data, graph, &backend))
        }
        Device::Cuda(ordinal) => {
            // The GPU does the work; the loop stays on this thread, bound to the CUDA context.
            let backend = CudaBackend::new(ordinal, spec.device.allow_tf32)?;
            run_on(args, &spec, data, graph, &backend)
        }
    }
}

/// Creates the run directory and trains in it.
fn run_on<B: Backend>(
    args: &RunArgs,
    spec: &JobSpec,
    data: Data,
    graph: Graph,
    backend: &B,
) -> Result<PathBuf> {
    let run = match &args.dir {
        Some(dir) => RunDir::create_at(dir)?,
        None => RunDir::create(&args.runs_dir, spec.name())?,
    };
    let header =
        format!(
        "# trainer run {} {}\n# resolved spec: defaults filled in, overrides applied\n# device: {}",
        args.job.display(),
        args.sets.iter().map(|s| format!("--set {s}")).collect::<Vec<_>>().join(" "),
        backend.describe(),
    );
    run.write_config(spec, &header)?;
    crate::provenance::write(&run, spec, &backend.describe())?;
    let log = run.path.join("train.log");
    crate::logging::attach_run_log(&log)
        .map_err(|e| Error::Runtime(format!("cannot create {}: {e}", log.display())))?;
    let result = run_in(&run, spec, data, graph, backend);
    crate::logging::detach_run_log();
    result.map(|()| run.path)
}

fn run_in<B: Backend>(
    run: &RunDir,
    spec: &JobSpec,
    data: Data,
    graph: Graph,
    backend: &B,
) -> Result<()> {
    let started = Instant::now();
    let memory = memory_plan(spec, &graph, &data, backend.memory().is_some());
    tracing::info!(
        "run {} ({}): {} parameters, {} training samples, device {}, planned memory {}",
        run.path.display(),
        spec.name(),
        graph.param_count,
        data.train.len,
        backend.describe(),
        bytes(memory.total())
    );
    let mut metrics = MetricsWriter::create(&run.path.join("metrics.csv"))?;
    let result = train::train(backend, spec, graph, data, &mut metrics);
    let wall = started.elapsed().as_secs_f64();
    let summary = match &result {
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
                "device": backend.describe(),
                "steps": outcome.steps,
                "epochs": outcome.epochs,
                "wall_s": wall,
                "train_s": outcome.train_seconds,
                "samples_per_sec": outcome.samples_per_sec(),
                "memory_planned_bytes": memory.total(),
                "device_memory_peak_bytes": backend.memory().map(|(_, peak)| peak),
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
    run.write_summary(&summary)?;
    result.map(|_| ())
}

/// What the run will hold: the graph's buffers, and on a GPU also the data set and the cuBLAS
/// workspace.
fn memory_plan(spec: &JobSpec, graph: &Graph, data: &Data, on_gpu: bool) -> MemoryPlan {
    let (data_bytes, workspace) = if on_gpu {
        (data_set_bytes(data), cuda::CUBLAS_WORKSPACE)
    } else {
        (0, 0)
    };
    MemoryPlan::new(
        graph,
        spec.data.batch_size,
        optim::state_buffers(spec),
        data_bytes,
        workspace,
    )
}

fn data_set_bytes(data: &Data) -> usize {
    let sets = std::iter::once(&data.train).chain(data.eval.iter().map(|(_, d)| d));
    sets.map(|d| (d.features.len() + d.targets.len()) * 4).sum()
}

/// Validates a job and describes its graph, shapes, parameters and memory.
pub fn check(job: &Path, sets: &[String]) -> Result<String> {
    let Prepared {
        spec,
        data,
        graph,
        threads,
    } = prepare(job, sets, None)?;
    let mut out = String::new();
    let eval: Vec<String> = data
        .eval
        .iter()
        .map(|(n, d)| format!("{n} {}", d.len))
        .collect();
    out += &format!(
        "job {} ({}): ok\ndata: {:?}, train {}{}{}, batch {}\n\n",
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
        spec.data.batch_size
    );
    out += &format!(
        "{:<8} {:<10} {:<16} {:>12}\n",
        "layer", "type", "output", "params"
    );
    out += &format!(
        "{:<8} {:<10} {:<16} {:>12}\n",
        "input",
        "",
        format!("{:?}", graph.input_shape),
        ""
    );
    for (i, layer) in graph.layers.iter().enumerate() {
        out += &format!(
            "{:<8} {:<10} {:<16} {:>12}\n",
            i,
            layer.kind,
            format!("{:?}", layer.out_shape),
            group_digits(layer.param_count)
        );
    }
    out += &format!("total parameters: {}\n\n", group_digits(graph.param_count));
    // Predict for the device the job names; `auto` is resolved as `run` would resolve it.
    let on_gpu = pick_device(&spec)? != Device::Cpu;
    let m = memory_plan(&spec, &graph, &data, on_gpu);
    let device = if on_gpu {
        spec.device.kind.replace("auto", "cuda:0")
    } else {
        format!("cpu ({threads} threads)")
    };
    out += &format!("memory on {device}, batch {}:\n", spec.data.batch_size);
    let mut rows = vec![
        ("parameters", m.params),
        ("gradients", m.grads),
        ("optimizer state", m.optimizer_state),
        ("activations", m.activations),
        ("activation gradients", m.activation_grads),
        ("batch (inputs, targets)", m.batch),
    ];
    if on_gpu {
        rows.push(("data set on the device", m.data));
        rows.push(("cuBLAS workspace", m.workspace));
    }
    for (what, b) in rows {
        out += &format!("  {what:<24} {:>12}\n", bytes(b));
    }
    out += &format!("  {:<24} {:>12}\n", "total", bytes(m.total()));
    if !on_gpu {
        out += &format!(
            "  {:<24} {:>12}\n",
            "data set (host memory)",
            bytes(data_set_bytes(&data))
        );
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
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}
