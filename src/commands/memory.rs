//! What a run will hold in memory, and the refusal of a job that does not fit the machine
//! or the GPU before anything is allocated.

use super::*;

/// What the run (one replica of it, with data parallelism) will hold: the graph's buffers,
/// and on a GPU (`gpu_memory`: the bytes it has for this run) also the cuBLAS workspace and
/// the data set, unless it is streamed (device.data = "streamed", or "auto" with a data set
/// that does not fit beside the rest: `samples::fits_on_device`).
pub(super) fn memory_plan(
    spec: &JobSpec,
    graph: &Graph,
    data: &Data,
    gpu_memory: Option<usize>,
) -> MemoryPlan {
    let on_gpu = gpu_memory.is_some();
    let batch = BatchLayout::of(spec).buffer_rows(data.largest_split());
    let threads = replica_threads(spec);
    let mixed = spec.precision.mode != PrecisionMode::Fp32;
    let (data_bytes, workspace) = if on_gpu {
        let conv = graph.workspace(&Scratch {
            conv: &|s| ops::conv2d::cuda_workspace_len(s, batch),
            attention: &|s| ops::attention::cuda_workspace_len(s, batch),
        });
        // With the row indices of a resident data set; taken out below if it is streamed.
        let own = cuda::own_bytes(batch, true);
        (
            data.held_bytes(graph.buffer_plan().data_reads()),
            own + 4 * conv,
        )
    } else {
        let conv = graph.workspace(&Scratch {
            conv: &|s| ops::conv2d::cpu::conv_workspace_len(s, threads, batch),
            attention: &|s| ops::attention::cpu::workspace_len(s, batch),
        });
        (0, 4 * conv)
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
    let resident = match (data.placement(spec.device.data), gpu_memory) {
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
pub(super) fn activation_storage(spec: &JobSpec, on_gpu: bool) -> ActivationStorage {
    match (spec.precision.mode, on_gpu) {
        (PrecisionMode::Fp32, _) => ActivationStorage::F32,
        (_, false) => ActivationStorage::HalfValues,
        (_, true) => ActivationStorage::HalfWidth,
    }
}

/// A run's planned memory over all its data-parallel replicas: each holds its own buffers
/// (the data set is shared), and the all-reduce its exchange buffers.
pub(super) fn all_replicas_memory(spec: &JobSpec, graph: &Graph, one: &MemoryPlan) -> usize {
    let replicas = spec
        .parallel
        .thread_replicas(&spec.device.kind)
        .unwrap_or(1);
    (one.total().saturating_mul(replicas))
        .saturating_add(4 * CpuAllReduce::exchange_len(replicas, graph.param_len))
}

/// Refuses a CPU job that plans more memory than this machine has free, before anything is
/// allocated or a run directory made: the allocation would abort the process instead.
pub(super) fn check_host_memory(spec: &JobSpec, graph: &Graph, data: &Data) -> Result<()> {
    Need::of(spec, graph, data, None).fits()
}

/// Refuses a GPU job (this process's replica) that plans more memory than the device has
/// free, before a run directory is made, in the CPU's terms rather than as the first
/// allocation that fails. The measured peak is the plan or slightly above it (BENCHMARKS.md),
/// so nothing refused here would have fitted.
pub(super) fn check_device_memory(
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

/// Where a run's memory is: the host's (a CPU run) or a GPU's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    Host,
    Gpu(usize),
}

impl std::fmt::Display for Place {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self {
            Place::Host => f.write_str("this machine"),
            Place::Gpu(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// What a run plans to hold where it trains, and the room there: a CPU run (all its
/// replicas) against this machine's free memory, a GPU run against its GPU's whole memory
/// (what a run finds free when nothing else runs there). `room` is None where it cannot be
/// read (no /proc/meminfo, a driver that cannot say).
pub struct Need {
    pub place: Place,
    /// One replica's plan (on a GPU, for the room it has).
    pub plan: MemoryPlan,
    /// The whole run's: all replicas in threads, with their all-reduce.
    pub bytes: usize,
    pub room: Option<usize>,
}

impl Need {
    pub(super) fn of(spec: &JobSpec, graph: &Graph, data: &Data, gpu: Option<usize>) -> Need {
        match gpu {
            None => {
                let plan = memory_plan(spec, graph, data, None);
                let bytes = all_replicas_memory(spec, graph, &plan);
                Need {
                    place: Place::Host,
                    plan,
                    bytes,
                    room: host_memory_free(),
                }
            }
            Some(n) => {
                let room = Some(gpu_whole_memory(n)).filter(|&m| m != usize::MAX);
                let plan = memory_plan(spec, graph, data, Some(room.unwrap_or(usize::MAX)));
                Need {
                    place: Place::Gpu(n),
                    bytes: plan.total(),
                    plan,
                    room,
                }
            }
        }
    }

    /// Whether `run` would start the job here, predicted before anything is allocated.
    pub(super) fn fits(&self) -> Result<()> {
        match (self.room, self.place) {
            (None, _) => Ok(()),
            (Some(room), Place::Host) => fits(self.bytes, room, "this machine"),
            (Some(room), Place::Gpu(n)) => fits(
                self.bytes,
                room,
                &format!("cuda:{n}, with nothing else on it,"),
            ),
        }
    }
}

/// cuda:`n`'s whole memory; usize::MAX where the driver cannot say.
pub(super) fn gpu_whole_memory(n: usize) -> usize {
    match cuda::probe() {
        Ok((devices, _)) => devices.get(n).map_or(usize::MAX, |d| d.memory_bytes),
        Err(_) => usize::MAX,
    }
}

pub(super) fn fits(needed: usize, free: usize, place: &str) -> Result<()> {
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

pub(super) fn group_digits(n: usize) -> String {
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
