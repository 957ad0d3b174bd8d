//! `trainer check` (a job's graph, shapes, parameters and memory) and `trainer devices`.

use super::memory::{activation_storage, all_replicas_memory, group_digits, Need};
use super::*;

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

/// What `trainer check` found: its report, and whether `run` would start the job here.
pub struct Checked {
    pub report: String,
    /// run's refusal of a job that is valid but does not fit this machine (exit 1).
    pub runnable_here: Result<()>,
}

/// Validates a job and describes its graph, shapes, parameters and memory.
pub fn check(job: &Path, sets: &[String]) -> Result<Checked> {
    let Prepared { spec, data, graph } = prepare(job, sets, None)?;
    // What `run` reads before it trains: a bad file is the job's fault.
    if let Some(path) = &spec.model.init_from {
        read_init_from(job, sets, path, &graph)?;
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
        "job {} ({}): ok\ndata: {}, train {}{}{}\nbatch: {}{processes}\n\n",
        spec.name(),
        job.display(),
        // As the job writes it: `csv`, not the type's `Csv`.
        serde_json::to_value(spec.data.source)
            .ok()
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_default(),
        data.train.len,
        if eval.is_empty() {
            String::new()
        } else {
            format!(", {}", eval.join(", "))
        },
        data.classes.map_or(String::new(), |c| {
            let from = match data.classes_from {
                Some(_) => " (from the labels: data.classes is not set)",
                None => "",
            };
            format!(", {c} classes{from}")
        }),
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
    // The longest type, with " *" for an in-place layer.
    let kind_width = graph
        .layers
        .iter()
        .map(|l| l.kind.len() + 2)
        .max()
        .unwrap_or(0)
        .max(15);
    let row = |layer: &str, kind: &str, inputs: &str, shape: &str, params: &str| {
        let inputs = if sequential {
            String::new()
        } else {
            format!("{inputs:<inputs_width$}  ")
        };
        format!("{layer:<name_width$}  {kind:<kind_width$} {inputs}{shape:<16} {params:>10}\n")
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
    let (per_sample, layout) = (graph.model_flops_per_sample(), BatchLayout::of(&spec));
    let step_samples = layout.micro_batch * layout.accumulation;
    out += &format!(
        "model FLOPs (forward, backward and loss): {} a sample, {} an optimizer step of {} \
         {}\n",
        flops(per_sample),
        flops(per_sample * step_samples as f64),
        group_digits(step_samples),
        if step_samples == 1 {
            "sample"
        } else {
            "samples"
        }
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
    // On a GPU, planned for its whole memory: what "auto" would find free when nothing else
    // runs there.
    let need = Need::of(&spec, &graph, &data, gpu);
    let m = &need.plan;
    let device = if on_gpu {
        spec.device.kind.replace("auto", "cuda:0")
    } else {
        crate::tensor::cpu::threads_label(replica_threads(&spec))
    };
    let replicas = match spec.parallel.replicas() {
        Some(n) => format!(", per replica ({n} replicas)"),
        None => String::new(),
    };
    let buffer_rows = layout.buffer_rows(data.largest_split());
    let batch = match buffer_rows < layout.per_replica() {
        true if layout.replicas > 1 => {
            format!("{buffer_rows} (a share of the largest split; batch_size is larger)")
        }
        true => format!("{buffer_rows} (the largest split; batch_size is larger)"),
        false => buffer_rows.to_string(),
    };
    out += &format!("memory on {device}, batch {batch}{replicas}:\n");
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
    let on_disk = data.on_disk_bytes();
    if on_gpu && m.data == 0 {
        let why = match spec.device.data {
            DataPlacement::Streamed => "device.data = \"streamed\"",
            _ if on_disk > 0 => "device.data = \"auto\": token files stay where they lie",
            _ => "device.data = \"auto\": it does not fit beside the rest",
        };
        out += &format!(
            "  data set ({}) streamed from pinned host memory ({why})\n",
            bytes(data.bytes() + on_disk)
        );
    }
    if spec.parallel.launches_processes(&spec.device.kind) {
        let n = spec.parallel.replicas().unwrap_or(1);
        out += &format!("  (each of the {n} processes, one per replica)\n");
    } else if let Some(replicas) = spec.parallel.thread_replicas(&spec.device.kind) {
        out += &format!(
            "  {:<24} {:>12}\n",
            format!("{replicas} replicas + all-reduce"),
            bytes(all_replicas_memory(&spec, &graph, m))
        );
    }
    let usable = gpus_usable(&spec, gpu);
    if let Err(e) = &usable {
        out += &format!("  {e}: `trainer run` would refuse it here\n");
    }
    let fits = need.fits();
    if fits.is_err() {
        let place = if on_gpu {
            "the GPU has"
        } else {
            "this machine has free"
        };
        out += &format!("  more than {place}: `trainer run` would refuse it here\n");
    }
    // The GPU first: a job this machine cannot open is refused before its memory is measured.
    let runnable_here = usable.and(fits);
    if !on_gpu || spec.device.data == DataPlacement::Streamed {
        let streamed = if on_gpu { ", streamed" } else { "" };
        out += &format!(
            "  {:<24} {:>12}\n",
            format!("data set (host memory{streamed})"),
            bytes(data.bytes())
        );
        if on_disk > 0 {
            out += &format!("  {:<24} {:>12}\n", "token files (on disk)", bytes(on_disk));
        }
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
            let with = buffer_rows * graph.activation_bytes(Some(best), storage).1;
            out += &format!(
                "activation checkpointing: off; with checkpoint.activations = \"all\" ({} \
                 segments) activations would take {}\n",
                best,
                bytes(with)
            );
        }
    }
    Ok(Checked {
        report: out,
        runnable_here,
    })
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

/// FLOPs in the largest unit they reach: "332.2 MFLOP", "448.3 TFLOP".
fn flops(n: f64) -> String {
    let units = [
        (1e15, "PFLOP"),
        (1e12, "TFLOP"),
        (1e9, "GFLOP"),
        (1e6, "MFLOP"),
        (1e3, "kFLOP"),
    ];
    match units.iter().find(|(scale, _)| n >= *scale) {
        Some((scale, unit)) => format!("{:.1} {unit}", n / scale),
        None => format!("{n:.0} FLOP"),
    }
}
