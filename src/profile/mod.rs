//! A profile's report: the table by op (profile.txt), profile.csv and a Chrome trace
//! (trace.json, as torch.profiler's `export_chrome_trace`, for Perfetto or
//! chrome://tracing), from a `Profiler`'s timings (graph::profiler).

use crate::error::{Error, Result};
use crate::graph::profiler::{Part, Timings};
use crate::graph::Graph;
use crate::ops::numel;
use crate::tensor::{Backend, Matrices};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The optimizer steps to profile, A to B (both included), where the files go (the run
/// directory), and whether the table is printed on stdout (`trainer profile`).
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileSteps {
    pub first: u64,
    pub last: u64,
    pub dir: PathBuf,
    pub print: bool,
    /// The memory `trainer check` plans for one replica, which the table sets beside a
    /// device's measured peak.
    pub planned_bytes: usize,
}

impl ProfileSteps {
    /// "A..B", steps A to B, both included, from 1; the files go to the run directory.
    pub fn parse(text: &str) -> std::result::Result<ProfileSteps, String> {
        let range = text.split_once("..").and_then(|(a, b)| {
            let (first, last) = (a.trim().parse::<u64>().ok()?, b.trim().parse::<u64>().ok()?);
            (first >= 1 && last >= first).then_some((first, last))
        });
        let Some((first, last)) = range else {
            return Err(format!(
                "--profile-steps {text:?}: give A..B, the first and last optimizer steps to \
                 profile, with 1 <= A <= B (e.g. 10..20)"
            ));
        };
        Ok(ProfileSteps {
            first,
            last,
            dir: PathBuf::new(),
            print: false,
            planned_bytes: 0,
        })
    }

    pub fn covers(&self, step: u64) -> bool {
        (self.first..=self.last).contains(&step)
    }

    /// How many steps the range holds.
    pub fn count(&self) -> usize {
        (self.last - self.first + 1) as usize
    }
}

/// Writes profile.txt (the table), profile.csv and trace.json into `steps.dir`, and logs
/// where they are.
pub fn write(p: &Timings, cx: &Context, steps: &ProfileSteps) -> Result<()> {
    if p.steps.is_empty() {
        return Ok(());
    }
    let report = Report::new(p, cx);
    let table = report.table();
    if steps.print {
        print!("{table}");
    }
    let text = steps.dir.join("profile.txt");
    std::fs::write(&text, &table)
        .map_err(|e| Error::Runtime(format!("cannot write {}: {e}", text.display())))?;
    report.write_csv(&steps.dir.join("profile.csv"))?;
    write_trace(p, cx.graph, &cx.device, &steps.dir.join("trace.json"))?;
    let (first, last) = (p.steps[0].0, p.steps[p.steps.len() - 1].0);
    tracing::info!(
        "profile of steps {first}..{last} (each op timed by marks in the device's queue; CUDA \
         graphs off in them) \
         in {}: profile.txt, profile.csv, trace.json",
        steps.dir.display()
    );
    Ok(())
}

/// What utilisation (MFU) is measured against.
#[derive(Debug, Clone, PartialEq)]
pub struct Peak {
    pub flops: f64,
    /// Where the figure comes from, as the table says it.
    pub source: String,
}

/// The peak of the device's matrix products for the job's precision: a known GPU's datasheet
/// figure (dense, no sparsity), as llm.c and nanoGPT count MFU; else a measured f32 product.
pub fn peak<B: Backend>(backend: &B, half: bool) -> Result<Peak> {
    if let Some(peak) = datasheet_peak(&backend.describe(), half) {
        return Ok(peak);
    }
    Ok(Peak {
        flops: measured_peak(backend)?,
        source: "the device's measured f32 matrix product".into(),
    })
}

/// A known GPU's dense peak, TFLOP/s: (f32, TF32, bf16 and fp16) from NVIDIA's datasheets.
/// More specific names come first (an H100 PCIe is not an SXM H100).
const DATASHEETS: [(&str, [f64; 3]); 7] = [
    ("H100 PCIe", [51.0, 378.0, 756.0]),
    ("H100 NVL", [60.0, 417.5, 835.5]),
    ("H200 NVL", [60.0, 417.5, 835.5]),
    ("GH200", [67.0, 494.7, 989.4]),
    ("H100", [67.0, 494.7, 989.4]),
    ("H200", [67.0, 494.7, 989.4]),
    ("A100", [19.5, 156.0, 312.0]),
];

/// The datasheet peak of the card `description` names (`Backend::describe`), for half
/// precision products or f32 ones (TF32 where the description says it is allowed).
pub fn datasheet_peak(description: &str, half: bool) -> Option<Peak> {
    let (name, figures) = DATASHEETS
        .iter()
        .find(|(name, _)| description.contains(name))?;
    let (tflops, kind) = match (half, description.contains("TF32 allowed")) {
        (true, _) => (figures[2], "bf16/fp16"),
        (false, true) => (figures[1], "TF32"),
        (false, false) => (figures[0], "f32"),
    };
    Some(Peak {
        flops: tflops * 1e12,
        source: format!("the {name}'s datasheet {kind} peak (dense)"),
    })
}

/// The device's f32 matrix-product rate, FLOP/s: the best of a few 1024³ products.
pub fn measured_peak<B: Backend>(backend: &B) -> Result<f64> {
    const N: usize = 1024;
    let (a, b) = (backend.alloc(N * N)?, backend.alloc(N * N)?);
    let mut c = backend.alloc(N * N)?;
    let at = Matrices {
        offset: 0,
        batch_stride: N * N,
        row_stride: N,
        transposed: false,
    };
    let mut best = f64::INFINITY;
    for _ in 0..4 {
        backend.synchronize();
        let start = Instant::now();
        backend.batched_matmul((N, N, N), 1, &a, at, &b, at, &mut c, at, false);
        backend.synchronize();
        best = best.min(start.elapsed().as_secs_f64());
    }
    backend.status()?;
    Ok(2.0 * (N * N * N) as f64 / best)
}

/// Below this a call (seconds), a part's rates are not shown.
const RATED: f64 = 5e-6;

/// What the report needs besides the events.
pub struct Context<'a> {
    pub graph: &'a Graph,
    /// The device, as the log names it.
    pub device: String,
    /// Bytes an activation value takes (2 for half-width buffers, else 4).
    pub value_bytes: usize,
    /// The largest batch the buffers hold (a replica's share with data parallelism).
    pub max_batch: usize,
    /// Tokens in a sample, for sequence jobs (a loss at every position).
    pub tokens_per_sample: Option<usize>,
    /// What utilisation is measured against.
    pub peak: Peak,
    /// A device's peak memory so far, and what `trainer check` planned (bytes); None on
    /// the CPU, whose memory is the host's.
    pub memory: Option<(usize, usize)>,
}

/// One line of the table: a part of the step, summed over the profiled steps.
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    /// The layer's index, for layer parts.
    pub layer: Option<usize>,
    pub name: String,
    /// The layer's type ("linear"), or "" for the other parts.
    pub op: &'static str,
    /// forward, backward, recompute, or what the part is (data, loss, ...).
    pub pass: &'static str,
    pub calls: usize,
    pub seconds: f64,
    pub flops: f64,
    pub bytes: f64,
    /// The layer's output for the largest batch, and what it keeps for backward.
    pub activation_bytes: usize,
    pub saved_bytes: usize,
}

/// The whole report.
#[derive(Debug, Clone)]
pub struct Report {
    pub steps: usize,
    /// Seconds of all profiled steps.
    pub seconds: f64,
    pub samples: usize,
    pub tokens: Option<usize>,
    pub lines: Vec<Line>,
    pub model_flops: f64,
    pub peak: Peak,
    pub device: String,
    /// A device's (peak, planned) memory in bytes.
    pub memory: Option<(usize, usize)>,
}

impl Report {
    pub fn new(p: &Timings, cx: &Context) -> Report {
        let mut parts: BTreeMap<Part, Line> = BTreeMap::new();
        let mut samples = 0;
        for e in &p.events {
            let line = parts
                .entry(e.part)
                .or_insert_with(|| empty_line(e.part, cx));
            line.calls += 1;
            line.seconds += e.duration.as_secs_f64();
            let (flops, bytes) = cost(e.part, e.samples, cx);
            line.flops += flops;
            line.bytes += bytes;
            if e.part == Part::Loss {
                samples += e.samples;
            }
        }
        let seconds: f64 = p.steps.iter().map(|s| s.2.as_secs_f64()).sum();
        let timed: f64 = parts.values().map(|l| l.seconds).sum();
        let mut lines: Vec<Line> = parts.into_values().collect();
        // The host's own work between the timed parts: the loop, logging, the schedule.
        let mut other = empty_line(Part::Data, cx);
        (other.name, other.pass) = ("other (host)".into(), "other");
        other.seconds = (seconds - timed).max(0.0);
        lines.push(other);
        // Recomputed forwards are not the model's FLOPs (`Graph::model_flops_per_sample`).
        let model_flops = (lines.iter())
            .filter(|l| l.pass != "recompute")
            .map(|l| l.flops)
            .sum();
        Report {
            steps: p.steps.len(),
            seconds,
            samples,
            tokens: cx.tokens_per_sample.map(|t| t * samples),
            lines,
            model_flops,
            peak: cx.peak.clone(),
            device: cx.device.clone(),
            memory: cx.memory,
        }
    }

    /// The table, as `trainer profile` prints it. A part that takes under `RATED` a call
    /// gets no rates: it did next to nothing (a ReLU whose gradient the layer before it
    /// applies), and its time is mostly the timer's.
    pub fn table(&self) -> String {
        let per_step = |s: f64| 1e3 * s / self.steps.max(1) as f64;
        let rate = |x: f64, s: f64| if s > 0.0 && x > 0.0 { x / s } else { 0.0 };
        let rated = |l: &Line, x: f64| match l.seconds >= RATED * l.calls as f64 {
            true => rate(x, l.seconds) / 1e9,
            false => 0.0,
        };
        let mut out = format!(
            "{:<26} {:<18} {:<10} {:>9} {:>7} {:>9} {:>8} {:>11} {:>11}\n",
            "part", "op", "pass", "ms/step", "share", "GFLOP/s", "GB/s", "activations", "saved"
        );
        for l in &self.lines {
            let mib = |b: usize| match b {
                0 => "-".to_string(),
                b => format!("{:.2} MiB", b as f64 / (1 << 20) as f64),
            };
            let number = |v: f64| match v {
                0.0 => "-".to_string(),
                v => format!("{v:.1}"),
            };
            out += &format!(
                "{:<26} {:<18} {:<10} {:>9.3} {:>6.1}% {:>9} {:>8} {:>11} {:>11}\n",
                truncate(&l.name, 26),
                l.op,
                l.pass,
                per_step(l.seconds),
                100.0 * l.seconds / self.seconds.max(1e-12),
                number(rated(l, l.flops)),
                number(rated(l, l.bytes)),
                mib(l.activation_bytes),
                mib(l.saved_bytes),
            );
        }
        let step_s = self.seconds / self.steps.max(1) as f64;
        out += &format!(
            "step: {:.3} ms, {:.0} samples/s",
            1e3 * step_s,
            rate(self.samples as f64, self.seconds)
        );
        if let Some(tokens) = self.tokens {
            out += &format!(", {:.0} tokens/s", rate(tokens as f64, self.seconds));
        }
        let achieved = rate(self.model_flops, self.seconds);
        out += &format!(
            " on {}\nmodel FLOPs: {:.3} GFLOP a step, {:.1} GFLOP/s; {}: {:.1} GFLOP/s; \
             utilisation (MFU) {:.1}%\n",
            self.device,
            self.model_flops / self.steps.max(1) as f64 / 1e9,
            achieved / 1e9,
            self.peak.source,
            self.peak.flops / 1e9,
            100.0 * achieved / self.peak.flops.max(1.0),
        );
        if let Some((peak, planned)) = self.memory {
            let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
            out += &format!(
                "device memory: peak {:.1} MiB, planned {:.1} MiB (trainer check)\n",
                mib(peak),
                mib(planned)
            );
        }
        out
    }

    /// profile.csv: the table's lines, unrounded.
    pub fn write_csv(&self, path: &Path) -> Result<()> {
        let fail = |e: &dyn std::fmt::Display| {
            Error::Runtime(format!("cannot write {}: {e}", path.display()))
        };
        let mut w = csv::Writer::from_path(path).map_err(|e| fail(&e))?;
        let header = [
            "layer",
            "part",
            "op",
            "pass",
            "calls",
            "ms_per_step",
            "share",
            "flops_per_step",
            "gflops_per_sec",
            "bytes_per_step",
            "gb_per_sec",
            "activation_bytes",
            "saved_bytes",
        ];
        w.write_record(header).map_err(|e| fail(&e))?;
        let steps = self.steps.max(1) as f64;
        for l in &self.lines {
            let rate = |x: f64| {
                if l.seconds > 0.0 {
                    x / l.seconds / 1e9
                } else {
                    0.0
                }
            };
            let record = [
                l.layer.map_or(String::new(), |i| i.to_string()),
                l.name.clone(),
                l.op.to_string(),
                l.pass.to_string(),
                l.calls.to_string(),
                (1e3 * l.seconds / steps).to_string(),
                (l.seconds / self.seconds.max(1e-12)).to_string(),
                (l.flops / steps).to_string(),
                rate(l.flops).to_string(),
                (l.bytes / steps).to_string(),
                rate(l.bytes).to_string(),
                l.activation_bytes.to_string(),
                l.saved_bytes.to_string(),
            ];
            w.write_record(&record).map_err(|e| fail(&e))?;
        }
        w.flush().map_err(|e| fail(&e))
    }
}

/// trace.json: every step and every timed part as a complete event ("ph": "X"), in
/// microseconds, one thread row for the device's queue.
pub fn write_trace(p: &Timings, graph: &Graph, device: &str, path: &Path) -> Result<()> {
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let mut events = vec![
        json!({"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
               "args": {"name": format!("trainer on {device}")}}),
        json!({"name": "thread_name", "ph": "M", "pid": 0, "tid": 0,
               "args": {"name": "training step"}}),
    ];
    for &(step, start, duration) in &p.steps {
        events.push(
            json!({"name": format!("step {step}"), "cat": "step", "ph": "X",
                           "ts": us(start), "dur": us(duration), "pid": 0, "tid": 0}),
        );
    }
    for e in &p.events {
        let (name, pass) = part_name(e.part, graph);
        events.push(
            json!({"name": format!("{name} {pass}"), "cat": pass, "ph": "X",
                           "ts": us(e.start), "dur": us(e.duration), "pid": 0, "tid": 0,
                           "args": {"step": e.step, "samples": e.samples}}),
        );
    }
    let trace = json!({"traceEvents": events, "displayTimeUnit": "ms"});
    std::fs::write(path, trace.to_string())
        .map_err(|e| Error::Runtime(format!("cannot write {}: {e}", path.display())))
}

fn truncate(s: &str, width: usize) -> String {
    match s.char_indices().nth(width) {
        Some((at, _)) => s[..at].to_string(),
        None => s.to_string(),
    }
}

/// A part's name (the layer's, or what the part is) and its pass.
fn part_name(part: Part, graph: &Graph) -> (String, &'static str) {
    let layer = |i: usize| graph.layers[i].prefix(i);
    match part {
        Part::Data => ("data".into(), "data"),
        Part::Forward(i) => (layer(i), "forward"),
        Part::Recompute(i) => (layer(i), "recompute"),
        Part::Loss => ("loss".into(), "loss"),
        Part::Backward(i) => (layer(i), "backward"),
        Part::AllReduce => ("all-reduce".into(), "all-reduce"),
        Part::Clip => ("clip_grad_norm".into(), "clip"),
        Part::Update => ("optimizer".into(), "update"),
    }
}

fn empty_line(part: Part, cx: &Context) -> Line {
    let (name, pass) = part_name(part, cx.graph);
    let layer = match part {
        Part::Forward(i) | Part::Recompute(i) | Part::Backward(i) => Some(i),
        _ => None,
    };
    let (op, activation_bytes, saved_bytes) = match layer {
        Some(i) => {
            let l = &cx.graph.layers[i];
            let out = numel(&l.out_shape) * cx.max_batch * cx.value_bytes;
            let saved = l.op.kind().state_len(&l.out_shape, cx.max_batch) * 4;
            (l.kind, out, saved)
        }
        None => ("", 0, 0),
    };
    Line {
        layer,
        name,
        op,
        pass,
        calls: 0,
        seconds: 0.0,
        flops: 0.0,
        bytes: 0.0,
        activation_bytes,
        saved_bytes,
    }
}

/// The FLOPs and the bytes read and written (an estimate: each tensor once) of a part on
/// `samples` samples.
fn cost(part: Part, samples: usize, cx: &Context) -> (f64, f64) {
    let layer = |i: usize| &cx.graph.layers[i];
    // A view (flatten, reshape) moves nothing.
    let values = |l: &crate::graph::Layer| match l.is_view() {
        true => (0.0, 0.0, 0.0),
        false => (
            (numel(&l.in_shape) * samples * cx.value_bytes) as f64,
            (numel(&l.out_shape) * samples * cx.value_bytes) as f64,
            (l.param_count * 4) as f64,
        ),
    };
    match part {
        Part::Forward(i) | Part::Recompute(i) => {
            let l = layer(i);
            let (x, y, w) = values(l);
            let flops = l.op.kind().flops(&l.in_shape, &l.out_shape).forward;
            (flops * samples as f64, x + y + w)
        }
        Part::Backward(i) => {
            let l = layer(i);
            let (x, y, w) = values(l);
            let flops = l.op.kind().flops(&l.in_shape, &l.out_shape).backward;
            // dy and x read, dx written; the weights read and their gradients written.
            (flops * samples as f64, 2.0 * x + y + 2.0 * w)
        }
        Part::Loss => {
            let out = numel(cx.graph.output_shape()) * samples;
            let flops = cx.graph.loss_flops_per_sample() * samples as f64;
            (flops, (2 * out * cx.value_bytes) as f64)
        }
        Part::Data | Part::AllReduce | Part::Clip | Part::Update => (0.0, 0.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_known_card_is_measured_against_its_datasheet_peak_for_the_precision() {
        let peak = |description: &str, half: bool| {
            datasheet_peak(description, half).map(|p| (p.flops / 1e12, p.source))
        };
        let h100 = "cuda:0 (NVIDIA H100 80GB HBM3, sm_90, 79.2 GiB, driver 13.0)";
        assert_eq!(
            peak(h100, true),
            Some((989.4, "the H100's datasheet bf16/fp16 peak (dense)".into()))
        );
        assert_eq!(peak(h100, false).unwrap().0, 67.0);
        assert_eq!(
            peak(&format!("{h100}, TF32 allowed"), false).unwrap().0,
            494.7
        );
        assert_eq!(
            peak("cuda:0 (NVIDIA H100 PCIe, sm_90)", true).unwrap().0,
            756.0
        );
        assert_eq!(peak("cuda:1 (NVIDIA H200, sm_90)", true).unwrap().0, 989.4);
        assert_eq!(
            peak("cuda:0 (NVIDIA A100-SXM4-80GB, sm_80)", true)
                .unwrap()
                .0,
            312.0
        );
        // Anything else is measured.
        assert_eq!(peak("cuda:0 (NVIDIA GeForce RTX 4090, sm_89)", true), None);
        assert_eq!(peak("cpu (2 threads)", false), None);
    }
}
