//! Data parallelism across processes and machines: the ranks of a run started by torchrun,
//! srun or a shell loop (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; `parallel::Rendezvous`).
//!
//! Rank 0 is the run. It alone runs the training loop, logs, evaluates and writes the run
//! directory and checkpoints, and drives the other ranks step by step over its links
//! (`ProcessReplicas`, a `DataParallel` like the threads of `CpuReplicas`). Every other rank
//! `serve`s: it trains its share of each micro-batch and applies the same update as rank 0,
//! so the loop's decisions (signals, `max_time`, early stopping, when to checkpoint) are
//! made in one place and the ranks need no agreement protocol beyond the step itself.
//!
//! A step: rank 0 sends the step (micro-step counter, learning rate, clipping, loss scale,
//! the micro-batches' sample indices; each rank holds the whole data set), every rank
//! computes the gradients of its share, the others send theirs bucket by bucket as their
//! backward pass finishes each (`SendOverLink`), then their loss statistics; rank 0 adds
//! each bucket in during its own backward pass (`GatherOverLinks`), in rank order (the sums
//! `CpuAllReduce` makes, so a multi-process run equals the same number of threaded replicas
//! bit for bit), and sends the mean back, and
//! every rank runs clipping and the optimizer on it. A gradient exchange through rank 0
//! moves 2 x (ranks - 1) x parameters through its link: right for the CPU models. On GPUs
//! (parallel.backend, "auto" where each rank has its own GPU) NCCL's all-reduce averages
//! the gradients on the devices instead: rank 0's greeting carries the NCCL id, and a
//! rank's Grads message then carries only its statistics and stop signal.
//!
//! Failure: every wait is bounded by parallel.timeout, a closed connection is noticed at
//! once, and errors name the rank. A rank that fails tells rank 0 why; rank 0 ending for any
//! reason tells the others how (completed, interrupted by a signal, failed), and they exit
//! with the matching code. A signal on any rank stops the whole run after the current step
//! with a checkpoint, as on one process.

use super::replicas::{DataParallel, DeviceSync};
use super::{connect, Link, Rendezvous, Tag};
use crate::checkpoint;
use crate::data::Data;
use crate::error::{Error, Result};
use crate::graph::{GradientSync, Graph, Network};
use crate::ops::Engine;
use crate::optim::Optimizer;
use crate::signals::Stop;
use crate::spec::{CollectiveBackend, JobSpec, ParallelDevices};
use crate::tensor::LossStats;
use crate::train::{
    accumulate_gradients, apply_gradients, Batch, MicroBatches, Rank, Samples, StepContext,
    StepResult, StepSettings,
};
use serde::{Deserialize, Serialize};
use std::marker::PhantomData;
use std::ops::Range;
use std::path::Path;

/// What rank 0 greets the other ranks with, for them to compare with their own job.
#[derive(Serialize, Deserialize)]
struct Greeting {
    version: String,
    world_size: usize,
    /// The resolved job, as checkpoints keep it (`checkpoint::spec_json`).
    job: serde_json::Value,
    data_hash: String,
    param_len: usize,
    /// The NCCL id every rank joins when gradients are averaged on the GPUs; None when they
    /// travel through rank 0's links.
    collective: Option<Vec<u8>>,
    /// Whether rank 0 continues from a checkpoint (it alone reads it and sends its state).
    #[serde(default)]
    resumes: bool,
}

/// How the run ended, as rank 0 tells the others.
#[derive(Serialize, Deserialize)]
struct Ending {
    /// Stopped by this signal, after a checkpoint.
    interrupted: Option<i32>,
    failed: bool,
}

/// Rank 0's view of the other ranks.
pub struct ProcessReplicas<B: Engine> {
    world: Rendezvous,
    /// What each process runs on, e.g. "1 thread" or "cuda:LOCAL_RANK".
    device: String,
    /// Links to ranks 1.., in rank order.
    links: Vec<Link>,
    /// Gradients are averaged on the devices (NCCL), not through the links.
    on_devices: bool,
    /// Rank 0's gradients, then the sum over the ranks, then their mean (host memory).
    mean: Vec<f32>,
    /// Another rank's gradients as they arrive.
    incoming: Vec<f32>,
    /// The step message, encoded (its buffer is reused).
    message: Vec<u8>,
    stop: Option<i32>,
    finished: bool,
    _backend: PhantomData<fn(&B)>,
}

/// Identifies the training data: every rank must hold the same samples.
fn data_hash(data: &Data) -> Result<String> {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(bytemuck::cast_slice(&data.train.features));
    data.train.tokens.hash_into(&mut h)?;
    h.update(bytemuck::cast_slice(&data.train.targets));
    Ok(format!("{:016x}", h.digest()))
}

impl<B: Engine> ProcessReplicas<B> {
    /// Rank 0's side of the rendezvous: waits for every rank, greets it with the job and
    /// waits until each has found the job and data the same as its own (a rank that does
    /// not is an `Error::Job` naming the differences).
    pub fn connect(
        backend: &B,
        spec: &JobSpec,
        data: &Data,
        param_len: usize,
        device: String,
        resumes: bool,
    ) -> Result<Self> {
        let world = spec.parallel.world.clone().expect("a multi-process run");
        let collective = collective_id(backend, spec, &world)?;
        let on_devices = collective.is_some();
        let greeting = Greeting {
            version: env!("CARGO_PKG_VERSION").into(),
            world_size: world.world_size,
            job: checkpoint::spec_json(spec).0,
            data_hash: data_hash(data)?,
            param_len,
            collective,
            resumes,
        };
        let payload = serde_json::to_vec(&greeting).expect("a greeting serialises");
        let (mut links, _) = connect(&world, payload)?;
        for link in &mut links {
            link.expect(Tag::Ready)?;
        }
        if let Some(id) = &greeting.collective {
            join_collective(backend, id, &world)?;
        }
        tracing::info!(
            "all {} ranks joined; gradients averaged {}",
            world.world_size,
            if on_devices {
                "by NCCL on the GPUs"
            } else {
                "through rank 0 (tcp)"
            }
        );
        // Through the links, rank 0 sums in host memory; NCCL needs no room for another
        // rank's gradients here.
        let incoming = if on_devices { 0 } else { param_len };
        Ok(ProcessReplicas {
            world,
            device,
            links,
            on_devices,
            mean: vec![0.0; param_len],
            incoming: vec![0.0; incoming],
            message: Vec::new(),
            stop: None,
            finished: false,
            _backend: PhantomData,
        })
    }

    /// Tells every other rank how the run ended (best effort: some may be gone).
    fn tell_the_others(&mut self, ending: &Ending) {
        let text = serde_json::to_vec(ending).expect("an ending serialises");
        for link in &mut self.links {
            let _ = link.send(Tag::Done, &[&text]);
        }
    }
}

impl<B: Engine> Drop for ProcessReplicas<B> {
    fn drop(&mut self) {
        if !self.finished {
            self.tell_the_others(&Ending {
                interrupted: None,
                failed: true,
            });
        }
    }
}

/// Rank 0: the NCCL id the ranks will join, when parallel.backend (and for "auto", this
/// machine) says gradients are averaged on the GPUs; None for the tcp path.
fn collective_id<B: Engine>(
    backend: &B,
    spec: &JobSpec,
    world: &Rendezvous,
) -> Result<Option<Vec<u8>>> {
    match spec.parallel.backend {
        CollectiveBackend::Tcp => Ok(None),
        CollectiveBackend::Nccl => match backend.collective_id()? {
            Some(id) => Ok(Some(id)),
            None => Err(Error::Job(format!(
                "parallel.backend = \"nccl\" needs CUDA devices, and this run is on {}; \
                 use \"tcp\" or \"auto\"",
                backend.describe()
            ))),
        },
        CollectiveBackend::Auto => {
            if let Some(why) = ranks_share_a_gpu(spec, world) {
                tracing::info!(
                    "parallel.backend auto: tcp ({why}, and NCCL does not allow two ranks on one \
                     GPU)"
                );
                return Ok(None);
            }
            match backend.collective_id() {
                Ok(id) => Ok(id),
                Err(e) => {
                    tracing::warn!("parallel.backend auto: tcp, not NCCL: {e}");
                    Ok(None)
                }
            }
        }
    }
}

/// Why ranks of this machine share a GPU, if they do: device.type = "cuda:N" for all of
/// them, or a GPU listed twice in parallel.devices.
fn ranks_share_a_gpu(spec: &JobSpec, world: &Rendezvous) -> Option<String> {
    if let Some(ParallelDevices::List(devices)) = &spec.parallel.devices {
        let twice = devices
            .iter()
            .enumerate()
            .find(|(i, d)| devices[..*i].contains(d))?;
        return Some(format!("parallel.devices lists {} twice", twice.1));
    }
    (spec.device.kind.starts_with("cuda:") && world.local_world_size > 1).then(|| {
        format!(
            "device.type = \"{}\" puts the {} ranks of this machine on one GPU",
            spec.device.kind, world.local_world_size
        )
    })
}

/// Joins the NCCL communicator. NCCL's initialisation waits for every rank with no timeout
/// of its own, so a watchdog ends this process if it takes longer than parallel.timeout.
fn join_collective<B: Engine>(backend: &B, id: &[u8], world: &Rendezvous) -> Result<()> {
    let what = format!(
        "rank {}: joining the NCCL communicator of {} ranks",
        world.rank, world.world_size
    );
    with_watchdog(world.timeout, &what, || {
        backend.join_collective(id, world.rank, world.world_size)
    })
}

/// Runs `f`, which may block where no timeout reaches (inside NCCL); if it has not returned
/// after `timeout`, the process logs `what` and exits with status 1 rather than hang.
fn with_watchdog<T>(timeout: std::time::Duration, what: &str, f: impl FnOnce() -> T) -> T {
    let (done, wait) = std::sync::mpsc::channel::<()>();
    let what = what.to_string();
    std::thread::spawn(move || {
        if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = wait.recv_timeout(timeout) {
            tracing::error!(
                "{what} did not finish within parallel.timeout ({}s): a rank is gone or stuck; \
                 exiting",
                timeout.as_secs_f64()
            );
            std::process::exit(1);
        }
    });
    let out = f();
    drop(done);
    out
}

/// The step message: micro-step, lr, clip, loss scale (NaN for none), skip_nonfinite, the
/// micro-batch size, then every micro-batch's sample indices (all but the last micro-batch
/// of a step are full).
fn encode_step(out: &mut Vec<u8>, micro_step: u64, s: &StepSettings, micro_batches: MicroBatches) {
    out.clear();
    out.extend_from_slice(&micro_step.to_le_bytes());
    out.extend_from_slice(&s.lr.to_le_bytes());
    out.extend_from_slice(&s.clip.unwrap_or(f64::NAN).to_le_bytes());
    out.extend_from_slice(&s.loss_scale.unwrap_or(f64::NAN).to_le_bytes());
    out.push(u8::from(s.skip_nonfinite));
    out.extend_from_slice(&(micro_batches.size as u32).to_le_bytes());
    for row in micro_batches.rows {
        out.extend_from_slice(&row.to_le_bytes());
    }
}

/// A decoded step message; `rows` is reused from step to step.
struct StepOrder {
    micro_step: u64,
    settings: StepSettings,
    chunk: usize,
}

const STEP_HEADER: usize = 8 * 4 + 1 + 4;

fn decode_step(bytes: &[u8], rows: &mut Vec<u64>) -> Option<StepOrder> {
    if bytes.len() < STEP_HEADER || !(bytes.len() - STEP_HEADER).is_multiple_of(8) {
        return None;
    }
    let f64_at = |i: usize| f64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
    let optional = |v: f64| (!v.is_nan()).then_some(v);
    let settings = StepSettings {
        lr: f64_at(8),
        clip: optional(f64_at(16)),
        want_grad_norm: false,
        loss_scale: optional(f64_at(24)),
        skip_nonfinite: bytes[32] != 0,
    };
    let chunk = u32::from_le_bytes(bytes[33..37].try_into().expect("4 bytes")) as usize;
    rows.clear();
    rows.extend(
        bytes[STEP_HEADER..]
            .chunks_exact(8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes"))),
    );
    (chunk > 0 || rows.is_empty()).then_some(StepOrder {
        micro_step: u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")),
        settings,
        chunk: chunk.max(1),
    })
}

/// The Grads message's fixed part: a stop signal (0 for none) and the loss statistics.
const GRADS_HEADER: usize = 4 + 3 * 8;

fn encode_grads_header(signal: Option<i32>, s: LossStats) -> [u8; GRADS_HEADER] {
    let mut head = [0u8; GRADS_HEADER];
    head[..4].copy_from_slice(&signal.unwrap_or(0).to_le_bytes());
    for (i, v) in [s.loss_sum, s.correct, s.samples].into_iter().enumerate() {
        head[4 + 8 * i..12 + 8 * i].copy_from_slice(&v.to_le_bytes());
    }
    head
}

fn decode_grads_header(head: &[u8; GRADS_HEADER]) -> (Option<i32>, LossStats) {
    let signal = i32::from_le_bytes(head[..4].try_into().expect("4 bytes"));
    let f64_at = |i: usize| f64::from_le_bytes(head[4 + 8 * i..12 + 8 * i].try_into().expect("8"));
    let stats = LossStats {
        loss_sum: f64_at(0),
        correct: f64_at(1),
        samples: f64_at(2),
    };
    ((signal != 0).then_some(signal), stats)
}

fn params_hash<B: Engine>(backend: &B, params: &B::Buf, host: &mut [f32]) -> u64 {
    backend.download(params, host);
    xxhash_rust::xxh3::xxh3_64(bytemuck::cast_slice(host))
}

impl<B: Engine> DataParallel<B> for ProcessReplicas<B> {
    fn replicas(&self) -> usize {
        self.world.world_size
    }

    fn broadcast(
        &mut self,
        _spec: &JobSpec,
        net: &Network<B>,
        optimizer: &Optimizer<B>,
        backend: &B,
    ) -> Result<()> {
        let n = net.graph.param_len;
        let mut state: Vec<(&str, Vec<f32>)> = Vec::new();
        for (name, buf) in optimizer.state() {
            let mut values = vec![0.0; n];
            backend.download(buf, &mut values);
            state.push((name, values));
        }
        backend.download(&net.params, &mut self.mean);
        let mut head = Vec::new();
        head.extend_from_slice(&(n as u64).to_le_bytes());
        head.extend_from_slice(&optimizer.steps().to_le_bytes());
        head.extend_from_slice(&(state.len() as u32).to_le_bytes());
        for (name, _) in &state {
            head.extend_from_slice(&(name.len() as u32).to_le_bytes());
            head.extend_from_slice(name.as_bytes());
        }
        let mut parts: Vec<&[u8]> = vec![&head, bytemuck::cast_slice(&self.mean)];
        parts.extend(
            state
                .iter()
                .map(|(_, v)| bytemuck::cast_slice::<f32, u8>(v)),
        );
        for link in &mut self.links {
            link.send(Tag::State, &parts)?;
        }
        Ok(())
    }

    fn step(
        &mut self,
        mut cx: StepContext<B>,
        batch: &Batch<B>,
        micro_batches: MicroBatches,
        settings: StepSettings,
    ) -> Result<StepResult> {
        let backend = cx.backend;
        encode_step(&mut self.message, *cx.micro_step, &settings, micro_batches);
        for link in &mut self.links {
            link.send(Tag::Step, &[&self.message])?;
        }
        let place = Rank {
            rank: 0,
            replicas: self.world.world_size,
        };
        let rows = micro_batches.iter();
        let scale = settings.loss_scale;
        // Averaged bucket by bucket during the backward pass: by NCCL on the devices, or
        // summed here as the other ranks send their buckets.
        {
            let mut gather = GatherOverLinks {
                links: &mut self.links,
                sum: &mut self.mean,
                incoming: &mut self.incoming,
                error: None,
            };
            let sync: &mut dyn GradientSync<B> = if self.on_devices {
                &mut DeviceSync
            } else {
                &mut gather
            };
            let sync = Some(sync);
            accumulate_gradients(&mut cx, batch, rows, place, scale, sync);
            if let Some(e) = gather.error {
                return Err(e);
            }
        }
        // NCCL waits for every rank without a timeout of its own.
        backend
            .finish_collectives(self.world.timeout)
            .map_err(|e| Error::Runtime(format!("rank 0: {e}")))?;
        // The whole micro-batches' statistics, added in rank order as CpuReplicas does.
        let mut window = backend.take_stats(cx.stats);
        for link in &mut self.links {
            let len = link.expect(Tag::Grads)?;
            if len != GRADS_HEADER {
                return Err(Error::Runtime(format!(
                    "rank {} sent a malformed Grads message ({len} bytes)",
                    link.peer()
                )));
            }
            let mut head = [0u8; GRADS_HEADER];
            link.read(&mut head)?;
            let (signal, theirs) = decode_grads_header(&head);
            if let (Some(signal), None) = (signal, self.stop) {
                tracing::warn!("rank {} received signal {signal}: stopping", link.peer());
                self.stop = Some(signal);
            }
            window += theirs;
        }
        backend.set_stats(cx.stats, window);
        if !self.on_devices {
            let inv = 1.0 / self.world.world_size as f32;
            self.mean.iter_mut().for_each(|v| *v *= inv);
            for link in &mut self.links {
                link.send(Tag::Mean, &[bytemuck::cast_slice(&self.mean)])?;
            }
            backend.upload(&self.mean, &mut cx.net.grads);
        }
        Ok(apply_gradients(&mut cx, settings))
    }

    fn verify(&mut self, backend: &B, params: &B::Buf) -> Result<()> {
        let ours = params_hash(backend, params, &mut self.mean);
        for link in &mut self.links {
            link.send(Tag::Verify, &[])?;
        }
        for link in &mut self.links {
            link.expect(Tag::Hash)?;
            let mut theirs = [0u8; 8];
            link.read(&mut theirs)?;
            if u64::from_le_bytes(theirs) != ours {
                return Err(Error::Runtime(format!(
                    "data parallelism: rank {} holds parameters different from rank 0's; the \
                     ranks no longer train one model",
                    link.peer()
                )));
            }
        }
        Ok(())
    }

    fn describe(&self) -> String {
        let n = self.world.world_size;
        format!("{n} processes (rank 0 of {n}) x {} each", self.device)
    }

    fn stop_requested(&self) -> Option<i32> {
        self.stop
    }

    fn finish(&mut self, interrupted: Option<i32>) {
        self.finished = true;
        self.tell_the_others(&Ending {
            interrupted,
            failed: false,
        });
    }
}

/// Rank 0's side of the tcp all-reduce, driven by its backward pass: a bucket's sum in host
/// memory is its own gradients, then each other rank's in rank order as they arrive (a rank
/// sends a bucket as soon as its own backward pass has it): the sums `CpuAllReduce` makes.
struct GatherOverLinks<'a> {
    links: &'a mut [Link],
    sum: &'a mut [f32],
    incoming: &'a mut [f32],
    /// The first failure (a rank lost): the step ends with it.
    error: Option<Error>,
}

impl<B: Engine> GradientSync<B> for GatherOverLinks<'_> {
    fn ready(&mut self, backend: &B, grads: &mut B::Buf, bucket: Range<usize>) {
        if self.error.is_some() {
            return;
        }
        backend.download_at(grads, bucket.start, &mut self.sum[bucket.clone()]);
        for link in self.links.iter_mut() {
            let incoming = &mut self.incoming[bucket.clone()];
            let received = (link.expect(Tag::Bucket)).and_then(|len| link.read_f32s(incoming, len));
            if let Err(e) = received {
                self.error = Some(e);
                return;
            }
            for (sum, g) in self.sum[bucket.clone()].iter_mut().zip(&*incoming) {
                *sum += g;
            }
        }
    }

    /// A recorded step (a CUDA graph) cannot wait for sockets: after the backward pass.
    fn during_backward(&self) -> bool {
        !B::RECORDS
    }
}

/// A rank's side of the tcp all-reduce: each bucket goes to rank 0 as soon as the backward
/// pass has it.
struct SendOverLink<'a> {
    link: &'a mut Link,
    host: &'a mut [f32],
    error: Option<Error>,
}

impl<B: Engine> GradientSync<B> for SendOverLink<'_> {
    fn ready(&mut self, backend: &B, grads: &mut B::Buf, bucket: Range<usize>) {
        if self.error.is_some() {
            return;
        }
        let host = &mut self.host[bucket.clone()];
        backend.download_at(grads, bucket.start, host);
        if let Err(e) = self.link.send(Tag::Bucket, &[bytemuck::cast_slice(host)]) {
            self.error = Some(e);
        }
    }

    fn during_backward(&self) -> bool {
        !B::RECORDS
    }
}

/// A rank other than 0: joins the run, checks that its job and data are rank 0's, then
/// trains its share of every step rank 0 sends until rank 0 says the run is over. Returns
/// Ok when the run completed; an interrupted or failed run is the matching error.
/// `resume` is this rank's --resume, which only rank 0's decides.
pub fn serve<B: Engine>(
    backend: &B,
    spec: &JobSpec,
    graph: Graph,
    data: Data,
    resume: Option<&Path>,
) -> Result<()> {
    let world = spec.parallel.world.clone().expect("a multi-process run");
    let (mut links, greeting) = connect(&world, Vec::new())?;
    // A signal before the rendezvous ends this process at once (as a launcher stopping a
    // run that never started expects), one during it ends the wait (`connect`); from here
    // on it stops the run after the current step, with rank 0's checkpoint.
    let stop = Stop::install()
        .map_err(|e| Error::Runtime(format!("cannot install the SIGINT/SIGTERM handlers: {e}")))?;
    let stop = &stop;
    let link = &mut links[0];
    let result = (|| {
        let collective = check_greeting(spec, &data, &graph, &world, &greeting, resume)?;
        link.send(Tag::Ready, &[])?;
        if let Some(id) = &collective {
            join_collective(backend, id, &world)?;
        }
        let on_devices = collective.is_some();
        follow(backend, spec, graph, data, &world, link, stop, on_devices)
    })();
    if let Err(e) = &result {
        // Rank 0 hears why (unless it is the one that went away).
        link.send_failure(e);
    }
    result
}

/// Checks rank 0's greeting against this rank's job and data; returns the NCCL id to join,
/// if rank 0 chose NCCL.
fn check_greeting(
    spec: &JobSpec,
    data: &Data,
    graph: &Graph,
    world: &Rendezvous,
    greeting: &[u8],
    resume: Option<&Path>,
) -> Result<Option<Vec<u8>>> {
    let g: Greeting = serde_json::from_slice(greeting).map_err(|e| {
        Error::Runtime(format!(
            "rank {}: rank 0's greeting is not understood ({e}); do all ranks run the same \
             trainer version?",
            world.rank
        ))
    })?;
    let ours = env!("CARGO_PKG_VERSION");
    if g.version != ours {
        return Err(Error::Job(format!(
            "rank {} runs trainer {ours}, rank 0 runs {}: every rank must run the same version",
            world.rank, g.version
        )));
    }
    if g.world_size != world.world_size {
        return Err(Error::Job(format!(
            "rank {0}: WORLD_SIZE is {1} on rank {0} and {2} on rank 0",
            world.rank, world.world_size, g.world_size
        )));
    }
    let changes = checkpoint::incompatible_changes(&g.job, &checkpoint::spec_json(spec).0);
    if !changes.is_empty() {
        return Err(Error::Job(format!(
            "rank {}'s job differs from rank 0's in keys that change training (rank 0's value \
             first):\n  {}\nevery rank must run the same job with the same --set overrides",
            world.rank,
            changes
                .join("\n  ")
                .replace(" in the checkpoint, ", " on rank 0, ")
                .replace(" now", &format!(" on rank {}", world.rank))
        )));
    }
    if let (Some(path), false) = (resume, g.resumes) {
        return Err(Error::Job(format!(
            "rank {} was given --resume {}, but rank 0 starts a new run: only rank 0 reads \
             the checkpoint (and sends the others its state), so give --resume to rank 0 too",
            world.rank,
            path.display()
        )));
    }
    // Rank 0 alone decides when to stop, log, evaluate and checkpoint: a different value
    // here is not an error (as on a resume), but it is not this rank's to use.
    let ignored = checkpoint::differences_in(
        &checkpoint::DECIDED_BY_RANK_ZERO,
        &g.job,
        &checkpoint::spec_json(spec).0,
    );
    for (key, zero, here) in ignored {
        tracing::warn!(
            "rank {0}: {key} is {here} here and {zero} on rank 0; rank 0 decides how long to \
             train and when to log, evaluate and checkpoint, so its value is used",
            world.rank
        );
    }
    if g.param_len != graph.param_len || g.data_hash != data_hash(data)? {
        return Err(Error::Job(format!(
            "rank {0}'s training data differ from rank 0's ({1} samples on rank {0}): every \
             rank must read the same data",
            world.rank, data.train.len
        )));
    }
    Ok(g.collective)
}

/// Builds this rank's replica from rank 0's state and follows rank 0's orders; gradients
/// are averaged by NCCL when `on_devices`, else through rank 0.
#[allow(clippy::too_many_arguments)]
fn follow<B: Engine>(
    backend: &B,
    spec: &JobSpec,
    graph: Graph,
    data: Data,
    world: &Rendezvous,
    link: &mut Link,
    stop: &Stop,
    on_devices: bool,
) -> Result<()> {
    let n = graph.param_len;
    let bad = |what: &str| {
        Error::Runtime(format!(
            "rank {}: rank 0 sent a malformed {what} message",
            world.rank
        ))
    };
    // The starting state: parameters and optimizer state.
    let len = link.expect(Tag::State)?;
    let bytes = link.read_vec(len)?;
    let u64_at = |i: usize| {
        bytes
            .get(i..i + 8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
    };
    let u32_at = |i: usize| {
        bytes
            .get(i..i + 4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
    };
    if u64_at(0) != Some(n as u64) {
        return Err(bad("state"));
    }
    let optimizer_steps = u64_at(8).ok_or_else(|| bad("state"))?;
    let count = u32_at(16).ok_or_else(|| bad("state"))? as usize;
    let mut at = 20;
    let mut names = Vec::new();
    for _ in 0..count {
        let name_len = u32_at(at).ok_or_else(|| bad("state"))? as usize;
        let name = bytes
            .get(at + 4..at + 4 + name_len)
            .ok_or_else(|| bad("state"))?;
        names.push(String::from_utf8_lossy(name).into_owned());
        at += 4 + name_len;
    }
    let floats = |k: usize| -> Result<Vec<f32>> {
        let start = at + 4 * n * k;
        let b = bytes
            .get(start..start + 4 * n)
            .ok_or_else(|| bad("state"))?;
        Ok(b.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect())
    };
    let params = floats(0)?;
    let state = (names.into_iter().enumerate())
        .map(|(k, name)| Ok((name, floats(k + 1)?)))
        .collect::<Result<Vec<_>>>()?;
    drop(bytes);

    let rows = spec.batch_size().min(data.largest_split());
    let replica_batch = rows.div_ceil(world.world_size);
    let mut net = crate::train::training_network(backend, graph, &params, replica_batch, spec)?;
    let mut optimizer = crate::train::optimizer_for(backend, spec, &net.graph)?;
    optimizer
        .restore(backend, &state, optimizer_steps, n)
        .map_err(Error::Runtime)?;
    drop((params, state));
    let held = data.train.held_bytes(net.data_reads());
    let resident = crate::train::samples::resident(backend, spec.device.data, &data, held);
    let shape = (data.row_len(), data.target_dim);
    let samples = Samples::new(backend, data.train, shape, net.data_reads(), resident)?;
    let batch = Batch { samples: &samples };
    let mut stats = backend.new_stats()?;
    let place = Rank {
        rank: world.rank,
        replicas: world.world_size,
    };
    // Buffers reused by every step.
    let mut message = Vec::new();
    let mut rows = Vec::new();
    let mut host = vec![0.0f32; n];
    loop {
        let (tag, len) = link.receive()?;
        match tag {
            Tag::Step => {
                message.resize(len, 0);
                link.read(&mut message)?;
                let order = decode_step(&message, &mut rows).ok_or_else(|| bad("step"))?;
                let mut micro_step = order.micro_step;
                let micro_batches = MicroBatches {
                    rows: &rows,
                    size: order.chunk,
                };
                let scale = order.settings.loss_scale;
                {
                    let mut send = SendOverLink {
                        link: &mut *link,
                        host: &mut host,
                        error: None,
                    };
                    let sync: &mut dyn GradientSync<B> = if on_devices {
                        &mut DeviceSync
                    } else {
                        &mut send
                    };
                    let mut cx = StepContext {
                        backend,
                        net: &mut net,
                        optimizer: &mut optimizer,
                        stats: &mut stats,
                        micro_step: &mut micro_step,
                    };
                    accumulate_gradients(
                        &mut cx,
                        &batch,
                        micro_batches.iter(),
                        place,
                        scale,
                        Some(sync),
                    );
                    if let Some(e) = send.error {
                        return Err(e);
                    }
                }
                backend
                    .finish_collectives(world.timeout)
                    .map_err(|e| Error::Runtime(format!("rank {}: {e}", world.rank)))?;
                backend.status()?;
                let head = encode_grads_header(stop.requested(), backend.take_stats(&mut stats));
                link.send(Tag::Grads, &[&head])?;
                if !on_devices {
                    let len = link.expect(Tag::Mean)?;
                    link.read_f32s(&mut host, len)?;
                    backend.upload(&host, &mut net.grads);
                }
                let mut cx = StepContext {
                    backend,
                    net: &mut net,
                    optimizer: &mut optimizer,
                    stats: &mut stats,
                    micro_step: &mut micro_step,
                };
                apply_gradients(&mut cx, order.settings);
                backend.status()?;
            }
            Tag::Verify => {
                let hash = params_hash(backend, &net.params, &mut host);
                link.send(Tag::Hash, &[&hash.to_le_bytes()])?;
            }
            Tag::Done => {
                let ending: Ending =
                    serde_json::from_slice(&link.read_vec(len)?).map_err(|_| bad("done"))?;
                return match ending {
                    Ending { failed: true, .. } => Err(Error::Runtime(format!(
                        "rank {}: rank 0 failed, so this rank stops too (rank 0's log says why)",
                        world.rank
                    ))),
                    Ending {
                        interrupted: Some(signal),
                        ..
                    } => Err(Error::Interrupted {
                        signal,
                        message: format!(
                            "rank {}: the run stopped on signal {signal}; rank 0 wrote a \
                             checkpoint to resume from",
                            world.rank
                        ),
                    }),
                    Ending { .. } => {
                        tracing::info!("rank {}: the run completed", world.rank);
                        Ok(())
                    }
                };
            }
            other => {
                return Err(Error::Runtime(format!(
                    "rank {}: rank 0 sent {other:?}, which this rank does not expect",
                    world.rank
                )))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_message_round_trips() {
        let settings = StepSettings {
            lr: 3e-4,
            clip: None,
            want_grad_norm: true,
            loss_scale: Some(65536.0),
            skip_nonfinite: true,
        };
        // Three micro-batches of 3, 3 and 1 samples, one index past u32.
        let sent = [4, 9, 2, 7, 1, 1 << 33, 5];
        let mut bytes = Vec::new();
        let micro_batches = MicroBatches {
            rows: &sent,
            size: 3,
        };
        encode_step(&mut bytes, 42, &settings, micro_batches);
        let mut rows = Vec::new();
        let order = decode_step(&bytes, &mut rows).unwrap();
        assert_eq!(order.micro_step, 42);
        assert_eq!((order.settings.lr, order.settings.clip), (3e-4, None));
        assert_eq!(order.settings.loss_scale, Some(65536.0));
        assert!(order.settings.skip_nonfinite && !order.settings.want_grad_norm);
        assert_eq!((&rows[..], order.chunk), (&sent[..], 3));
        assert!(decode_step(&bytes[..bytes.len() - 1], &mut rows).is_none());
    }

    #[test]
    fn a_gradient_header_round_trips() {
        let stats = LossStats {
            loss_sum: 12.5,
            correct: 7.0,
            samples: 16.0,
        };
        for signal in [None, Some(15)] {
            assert_eq!(
                decode_grads_header(&encode_grads_header(signal, stats)),
                (signal, stats)
            );
        }
    }
}
