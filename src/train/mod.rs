//! The training loop, readable top to bottom: for each optimizer step, `grad_accum_steps`
//! micro-batches of forward ▸ loss ▸ backward, then clipping and the optimizer; training rows
//! at log steps, evaluation rows at epoch ends.
//!
//! Gradient accumulation: the loss of each micro-batch is its mean over its samples, divided
//! by the number of micro-batches in the step. At an epoch's end fewer than
//! `grad_accum_steps` batches may remain: that last step averages over the ones there are.
//!
//! A run ends after its epochs, or earlier at `max_steps`, `max_time` or early stopping
//! (`stopping`); `Outcome::end_reason` says which.
//!
//! A non-finite loss ends the run as diverged at the next log row (`train.on_nonfinite =
//! "error"`, the default). With "skip", every step checks its gradient norm (Σg², summed in
//! f64, is finite exactly when every gradient is, and an inf/NaN loss always makes its
//! gradient inf/NaN): a step that fails the check is not applied, and the open log row's
//! loss statistics are put back to what they were before it, so a row's loss is the mean
//! over the steps applied in its window. `MAX_SKIPPED_IN_A_ROW` skipped steps in a row end
//! the run as diverged.
//!
//! Data parallelism (`parallel`): this loop drives rank 0's replica and leaves each
//! optimizer step to `DataParallel::step`, which runs every replica on its share of the
//! micro-batches; logging, evaluation and checkpoints stay rank 0's alone.

pub mod parallel;
mod samples;
pub use samples::fits_on_device;
mod stopping;

pub use parallel::processes::{serve, ProcessReplicas};
pub use parallel::replicas::{CpuReplicas, DataParallel, OneDeviceCollective};
pub use samples::{MicroBatches, Samples};

use crate::checkpoint::weights::Weights;
use crate::checkpoint::{self, Checkpoint, Saving, TrainState};
use crate::data::{batches_per_epoch, Data, DataReads, Dataset, EpochOrder};
use crate::error::{Error, Result};
use crate::graph::profiler::{Part, Profiler};
use crate::graph::{GradBuckets, GradientSync, Graph, Network};
use crate::ops::Engine;
use crate::optim::{clip_grad_norm, unscale_and_clip, LossScaler, Optimizer, Schedule};
use crate::profile::ProfileSteps;
use crate::run::{EndReason, MetricsRow, MetricsWriter};
use crate::signals::Stop;
use crate::spec::{EvaluateTest, JobSpec, OnNonFinite, PrecisionMode, MAX_SKIPPED_IN_A_ROW};
use crate::tensor::{HalfKind, LossStats};
use parallel::share;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::PathBuf;
use std::time::Instant;

/// What a finished (or interrupted) training run reports.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    pub steps: u64,
    pub epochs: usize,
    pub train_samples: u64,
    /// Seconds spent in training steps (evaluation excluded).
    pub train_seconds: f64,
    pub last_train: Option<MetricsRow>,
    /// The last evaluation row of each split.
    pub last_eval: Vec<MetricsRow>,
    /// The final parameters and batch-norm running statistics.
    pub final_weights: Weights,
    /// When this session's first training step began (start-up ends: data, kernels...).
    pub first_step_at: Option<Instant>,
    /// On devices that record (CUDA graphs): how many times the training step was recorded
    /// (0: never, every step ran op by op).
    pub step_recordings: Option<u64>,
    /// The same for the optimizer update (with clipping), recorded where nothing in it is
    /// read back (not with loss scaling or `on_nonfinite = "skip"`).
    pub update_recordings: Option<u64>,
    /// The newest checkpoint this run wrote.
    pub last_checkpoint: Option<PathBuf>,
    /// Steps skipped for inf/NaN (loss scaling, `train.on_nonfinite = "skip"`), the run's
    /// earlier sessions included.
    pub skipped_steps: u64,
    /// Set when a signal stopped the run early: the signal's number.
    pub interrupted: Option<i32>,
    pub end_reason: EndReason,
}

impl Outcome {
    pub fn samples_per_sec(&self) -> f64 {
        self.train_samples as f64 / self.train_seconds.max(1e-9)
    }
}

/// What a run starts from and what it may do besides training. `Session::default()` starts
/// from the seeded initialisation on one device and writes no checkpoint: that is `train`.
pub struct Session<'a, B: Engine> {
    /// Parameters to start from (model.init_from) instead of the seeded initialisation.
    pub initial: Option<Weights>,
    /// A checkpoint to continue from; it must belong to this job (see
    /// `checkpoint::incompatible_changes`).
    pub resume: Option<Checkpoint>,
    /// Where checkpoints go (`checkpoint.every_*`, a stop signal); None writes none.
    pub checkpoint_dir: Option<PathBuf>,
    /// Checked after every optimizer step: stop there, with a checkpoint.
    pub stop: Option<&'a Stop>,
    /// Data parallelism: the replicas besides this thread's (rank 0). None trains on one
    /// device, without any all-reduce.
    pub parallel: Option<Box<dyn DataParallel<B>>>,
    /// `resume` is the final checkpoint of a run that ended there but did not complete (it
    /// was stopped while writing its weights or summary): train and evaluate nothing, only
    /// give its outcome (the caller adds the final rows, which metrics.csv holds).
    pub finishing: bool,
    /// Steps to profile, and where the profile goes.
    pub profile: Option<ProfileSteps>,
}

impl<B: Engine> Default for Session<'_, B> {
    fn default() -> Self {
        Session {
            initial: None,
            resume: None,
            checkpoint_dir: None,
            stop: None,
            parallel: None,
            finishing: false,
            profile: None,
        }
    }
}

/// Optimizer steps the whole run will take.
pub fn total_steps(spec: &JobSpec, train_len: usize) -> usize {
    let all = steps_per_epoch(spec, train_len) * spec.train.epochs;
    spec.train.max_steps.map_or(all, |m| m.min(all))
}

fn steps_per_epoch(spec: &JobSpec, train_len: usize) -> usize {
    let batches = batches_per_epoch(train_len, spec.batch_size(), spec.data.drop_last);
    batches.div_ceil(spec.train.grad_accum_steps)
}

/// Trains from the job's seeded initialisation, writing no checkpoint.
pub fn train<B: Engine>(
    backend: &B,
    spec: &JobSpec,
    graph: Graph,
    data: Data,
    metrics: &mut MetricsWriter,
) -> Result<Outcome> {
    train_session(backend, spec, graph, data, metrics, Session::default())
}

/// Trains as `session` says. Everything that decides the numbers (the data order, dropout
/// masks, the learning rate) is a pure function of (job.seed, epoch, step, micro-step), so
/// a run continued from a checkpoint computes exactly what the uninterrupted run would.
pub fn train_session<B: Engine>(
    backend: &B,
    spec: &JobSpec,
    graph: Graph,
    data: Data,
    metrics: &mut MetricsWriter,
    session: Session<B>,
) -> Result<Outcome> {
    let mut t = Training::start(backend, spec, graph, data, metrics, session)?;
    let (accum, batch_size, train_len) = (spec.train.grad_accum_steps, t.batch_size, t.train_len);
    // A step's samples, refilled each step.
    let step_samples = accum * batch_size;
    let mut rows = Vec::with_capacity(step_samples);
    'epochs: for epoch in t.first_epoch()..=spec.train.epochs {
        t.st.epoch = epoch;
        let order = EpochOrder::new(
            train_len,
            t.windows,
            spec.data.shuffle,
            spec.job.seed,
            epoch,
        );
        let batches = batches_per_epoch(train_len, batch_size, spec.data.drop_last);
        // All samples but a smaller last batch's where it is dropped.
        let epoch_samples = (batches * batch_size).min(train_len) as u64;
        let steps_in_this_epoch = batches.div_ceil(accum);
        // Early stopping may end the run at this epoch's evaluation: its last step then
        // writes a train row, so that the rows cover every step trained.
        let may_stop_here = t.early_stopping.is_some() && t.evaluates_after(epoch);
        // A resumed run continues where the checkpoint stood in this epoch's order.
        for step_in_epoch in t.st.steps_in_epoch..steps_in_this_epoch {
            if t.all_steps_done() {
                break 'epochs;
            }
            let step = t.st.step + 1;
            // Past the deadline, this step is the last one (and is logged).
            let out_of_time = t.deadline.is_some_and(|d| Instant::now() >= d);
            let epoch_ends = t.st.steps_in_epoch + 1 == steps_in_this_epoch;
            // At the last step the final evaluation follows the loop.
            let eval_due = (t.spec.train.eval_every_steps)
                .is_some_and(|n| step.is_multiple_of(n as u64))
                && (step as usize) < t.total;
            let logging = step.is_multiple_of(t.log_every)
                || step as usize == t.total
                || out_of_time
                || (may_stop_here && epoch_ends)
                || (t.early_stopping.is_some() && eval_due);

            let first = (step_in_epoch * step_samples) as u64;
            order.fill(
                first..epoch_samples.min(first + step_samples as u64),
                &mut rows,
            );
            let group = MicroBatches {
                rows: &rows,
                size: batch_size,
            };
            let (lr, result, samples) = t.optimizer_step(epoch, group, logging)?;
            if logging {
                t.log_train_row(epoch, lr, &result, samples)?;
            }

            let mut evaluation = BTreeMap::new();
            if eval_due {
                // eval_steps batches of the job's batch size, however many replicas share it.
                let samples = (t.spec.train.eval_steps).map(|s| s * t.spec.batch_size());
                evaluation = t.evaluate(0..t.periodic_sets, epoch, samples)?;
                // Early stopping counts these evaluations too, as Lightning's counts every
                // validation; its final checkpoint then carries this one.
                if t.stops_early() {
                    t.st.evaluation = evaluation;
                    break 'epochs;
                }
            }

            let signal = t.stop_signal();
            // At the last step the final checkpoint follows (after the final evaluation).
            let due = (t.spec.checkpoint.every_steps)
                .is_some_and(|n| step.is_multiple_of(n as u64))
                && (step as usize) < t.total;
            if due || signal.is_some() || out_of_time {
                // A checkpoint at an evaluated step carries it: keep_best ranks by it.
                t.st.evaluation = evaluation;
                t.checkpoint()?;
                t.st.evaluation.clear();
            }
            if let Some(signal) = signal {
                return Ok(t.interrupted(signal));
            }
            if out_of_time {
                tracing::info!("train.max_time reached after {step} steps");
                t.outcome.end_reason = EndReason::MaxTime;
                break 'epochs;
            }
        }
        if t.all_steps_done() || t.end_epoch(epoch)? == EpochEnd::Stop {
            break;
        }
    }
    t.finish()
}

/// The job's optimizer for `graph`'s parameters (weight decay on its matrices alone where
/// the job says so).
pub fn optimizer_for<B: crate::tensor::Backend>(
    backend: &B,
    spec: &JobSpec,
    graph: &Graph,
) -> Result<Optimizer<B>> {
    Optimizer::for_model(backend, spec, graph.param_len, &graph.matrix_ranges())
}

/// Whether training goes on after an epoch's evaluation.
#[derive(PartialEq, Eq)]
enum EpochEnd {
    Continue,
    Stop,
}

/// A training run under way: rank 0's network, optimizer and data, its state as
/// checkpoints keep it (`st`), what it reports (`outcome`), and the settings of its loop.
struct Training<'a, B: Engine> {
    /// Steps to profile (`trainer profile`, `--profile-steps`).
    profile: Option<ProfileSteps>,
    backend: &'a B,
    spec: &'a JobSpec,
    metrics: &'a mut MetricsWriter,
    net: Network<B>,
    optimizer: Optimizer<B>,
    schedule: Schedule,
    train_samples: Samples<B>,
    eval_sets: Vec<EvalSet<B>>,
    /// The first `periodic_sets` of `eval_sets` are evaluated between epochs; the rest (a
    /// test split kept for the end) only after training.
    periodic_sets: usize,
    train_stats: B::Stats,
    eval_stats: B::Stats,
    st: TrainState,
    outcome: Outcome,
    saver: Option<Saver<'a>>,
    parallel: Option<Box<dyn DataParallel<B>>>,
    stop: Option<&'a Stop>,
    finishing: bool,
    batch_size: usize,
    train_len: usize,
    /// The training samples are a language model's windows (`EpochOrder`).
    windows: bool,
    data_finite: bool,
    flops: ModelFlops,
    /// Optimizer steps of the whole run, and of all its epochs (more, when max_steps ends
    /// it first).
    total: usize,
    all_epochs_steps: usize,
    log_every: u64,
    deadline: Option<Instant>,
    early_stopping: Option<stopping::EarlyStopping>,
    started: Instant,
    /// Seconds earlier sessions of the run trained (a resumed run's elapsed_s goes on).
    elapsed_before: f64,
    progress: crate::logging::Progress,
    /// The first step of the train row being accumulated, and the first step (and its
    /// epoch) whose loss is not finite, where the backend can tell.
    window_first: u64,
    first_nonfinite: Option<(u64, usize, f64)>,
    /// Not in checkpoints: a resumed run starts counting again.
    skipped_in_a_row: u64,
}

impl<'a, B: Engine> Training<'a, B> {
    /// The network, optimizer, data on the device and state to start from: the seeded
    /// initialisation, init_from's weights or a checkpoint.
    fn start(
        backend: &'a B,
        spec: &'a JobSpec,
        graph: Graph,
        data: Data,
        metrics: &'a mut MetricsWriter,
        session: Session<'a, B>,
    ) -> Result<Self> {
        let Session {
            initial,
            resume,
            checkpoint_dir,
            stop,
            mut parallel,
            finishing,
            profile,
        } = session;
        let batch_size = spec.batch_size();
        let param_len = graph.param_len;
        // init_from's num_batches_tracked, which this run counts on from.
        let mut tracked_before = Vec::new();
        let (params, running_stats, resume) = match resume {
            Some(mut c) => (
                std::mem::take(&mut c.params),
                Some(std::mem::take(&mut c.running_stats)),
                Some(c),
            ),
            None => match initial {
                Some(w) => {
                    tracked_before = w.batches_tracked;
                    (w.params, Some(w.running_stats), None)
                }
                None => (graph.init_params(spec.job.seed), None, None),
            },
        };
        if params.len() != param_len {
            return Err(Error::Job(format!(
                "the starting parameters have {} values but the model's parameter buffer has \
                 {param_len}",
                params.len()
            )));
        }
        // A replica's buffers hold its share of a micro-batch (`BatchLayout::buffer_rows`).
        let rows = batch_size.min(data.largest_split());
        let replica_batch = parallel
            .as_ref()
            .map_or(rows, |p| rows.div_ceil(p.replicas()));
        let mut net = training_network(backend, graph, &params, replica_batch, spec)?;
        drop(params);
        if let Some(stats) = running_stats {
            net.set_running_stats(backend, &stats)?;
        }
        let mut optimizer = optimizer_for(backend, spec, &net.graph)?;
        let replicas = parallel.as_ref().map_or(1, |p| p.replicas());
        let half = net.half().is_some();
        let flops = ModelFlops::new(&net.graph, &backend.describe(), half, replicas);

        let (shape, data_finite) = ((data.row_len(), data.target_dim), data.all_finite());
        let (train_len, windows) = (data.train.len, data.train.windows.is_some());
        let total = total_steps(spec, train_len);
        let schedule = Schedule::new(spec.optimizer.lr, &spec.optimizer.schedule, total);
        let reads = net.data_reads();
        let held = data.held_bytes(reads);
        let resident = samples::resident(backend, spec.device.data, &data, held);
        let train_samples = Samples::new(backend, data.train, shape, reads, resident)?;
        let eval_sets = data
            .eval
            .into_iter()
            .map(|(name, d)| EvalSet::new(backend, name, d, (shape, reads), resident))
            .collect::<Result<Vec<_>>>()?;
        // The test split waits for the end when asked to (it comes last in the data's
        // evaluation splits).
        let periodic_sets = match spec.train.evaluate_test {
            EvaluateTest::EveryEvaluation => eval_sets.len(),
            EvaluateTest::AtEnd => eval_sets.iter().filter(|s| s.name != "test").count(),
        };

        let mut train_stats = backend.new_stats()?;
        let eval_stats = backend.new_stats()?;
        let mut st = TrainState::start(spec.job.seed);
        st.batches_tracked_before = tracked_before;
        if let Some(c) = resume {
            optimizer
                .restore(backend, &c.optimizer, c.state.optimizer_steps, param_len)
                .map_err(|e| Error::Job(format!("{}: {e}", c.path.display())))?;
            backend.set_stats(&mut train_stats, c.window);
            st = c.state;
            st.finished = false;
            st.evaluation.clear();
        }
        // A resumed run keeps its scaler's state (a forced resume may have changed the
        // scaling).
        match LossScaler::from_spec(&spec.precision) {
            None => st.loss_scaler = None,
            Some(fresh) => {
                st.loss_scaler.get_or_insert(fresh);
            }
        }
        if let Some(p) = parallel.as_mut() {
            p.broadcast(spec, &net, &optimizer, backend)?;
            p.verify(backend, &net.params)?;
            if net.graph.running_stats_len() > 0 {
                tracing::info!(
                    "batch norm: each replica normalises with its own share's statistics and \
                     keeps its own running statistics (no sync); rank 0's are evaluated and saved"
                );
            }
        }
        let started = Instant::now();
        let mut outcome = Outcome::default();
        if finishing {
            outcome.end_reason = st.end_reason.unwrap_or_default();
        }
        Ok(Training {
            backend,
            spec,
            metrics,
            net,
            optimizer,
            schedule,
            train_samples,
            eval_sets,
            periodic_sets,
            train_stats,
            eval_stats,
            outcome,
            saver: checkpoint_dir.map(|dir| Saver { dir, spec }),
            parallel,
            stop,
            finishing,
            batch_size,
            train_len,
            windows,
            data_finite,
            flops,
            total,
            all_epochs_steps: steps_per_epoch(spec, train_len) * spec.train.epochs,
            log_every: spec.train.log_every as u64,
            deadline: stopping::deadline(spec, started),
            early_stopping: stopping::EarlyStopping::new(spec, st.early_stopping.as_ref()),
            started,
            elapsed_before: st.elapsed_s,
            progress: crate::logging::Progress::start(total as u64, st.step),
            window_first: st.step + 1,
            first_nonfinite: None,
            skipped_in_a_row: 0,
            profile,
            st,
        })
    }

    /// Finishing, the loop has nothing to do: the run ended at its checkpoint.
    fn first_epoch(&self) -> usize {
        if self.finishing {
            self.spec.train.epochs + 1
        } else {
            self.st.epoch
        }
    }

    fn all_steps_done(&self) -> bool {
        self.st.step as usize >= self.total
    }

    /// Seconds the run has trained, its earlier sessions included.
    fn elapsed(&self) -> f64 {
        self.elapsed_before + self.started.elapsed().as_secs_f64()
    }

    /// Whether an evaluation follows this epoch (the final one follows the loop).
    fn evaluates_after(&self, epoch: usize) -> bool {
        let every = self.spec.train.eval_every_epochs;
        every > 0 && epoch.is_multiple_of(every) && epoch < self.spec.train.epochs
    }

    /// One optimizer step on every replica, and its accounting: skipped steps, the first
    /// non-finite loss, the open train row's samples and seconds. Returns the step's
    /// learning rate, its result and its samples (all replicas').
    fn optimizer_step(
        &mut self,
        epoch: usize,
        group: MicroBatches,
        logging: bool,
    ) -> Result<(f64, StepResult, usize)> {
        let backend = self.backend;
        let step_start = Instant::now();
        self.outcome.first_step_at.get_or_insert(step_start);
        let step = self.st.step + 1;
        let profiled = self.start_profiled_step(step)?;
        // Skipped steps (mixed precision) do not advance the schedule, as with GradScaler.
        let lr = self
            .schedule
            .lr((self.st.step - self.st.skipped_steps) as usize);
        let skip_nonfinite = self.spec.train.on_nonfinite == OnNonFinite::Skip;
        let settings = StepSettings {
            lr,
            clip: self.spec.train.clip_grad_norm,
            want_grad_norm: logging,
            loss_scale: self.st.loss_scaler.as_ref().map(|s| s.scale),
            skip_nonfinite,
        };
        // The open row's loss statistics before this step, to put back if it is skipped.
        let window_before = skip_nonfinite.then(|| peek_stats(backend, &mut self.train_stats));
        let batch = Batch {
            samples: &self.train_samples,
        };
        let cx = StepContext {
            backend,
            net: &mut self.net,
            optimizer: &mut self.optimizer,
            stats: &mut self.train_stats,
            micro_step: &mut self.st.micro_step,
        };
        let result = match self.parallel.as_mut() {
            None => optimizer_step(cx, &batch, group, settings),
            Some(p) => p.step(cx, &batch, group, settings)?,
        };
        backend.status()?;
        self.train_samples.check_reads()?;
        if let Some(scaler) = self.st.loss_scaler.as_mut() {
            scaler.update(result.skipped);
        }
        if result.skipped {
            self.skipped(step, epoch, window_before)?;
        } else {
            self.skipped_in_a_row = 0;
        }
        // The first step whose loss is not finite, where that can be seen without
        // waiting (the CPU): a log row averages several steps.
        if let Some(sum) = backend
            .loss_sum_now(&self.train_stats)
            .filter(|sum| self.first_nonfinite.is_none() && !sum.is_finite())
        {
            self.first_nonfinite = Some((step, epoch, sum));
        }
        // All replicas' and micro-batches' samples: fewer on an epoch's short last step.
        let samples = group.rows.len();
        let st = &mut self.st;
        st.window_samples += samples as u64;
        st.step = step;
        st.steps_in_epoch += 1;
        self.progress.set(step);
        st.window_seconds += step_start.elapsed().as_secs_f64();
        if profiled {
            self.finish_profiled_step(step)?;
        }
        Ok((lr, result, samples))
    }

    /// Attaches a profiler when `step` is the first profiled one; in a profiled step, starts
    /// its timing. Whether `step` is profiled.
    fn start_profiled_step(&mut self, step: u64) -> Result<bool> {
        let Some(steps) = self.profile.as_ref().filter(|p| p.covers(step)) else {
            return Ok(false);
        };
        if self.net.profiler_mut().is_none() {
            let events_per_step = 3 * self.net.graph.layers.len() + 8;
            let profiler = Profiler::new(self.backend, steps.count(), events_per_step)?;
            self.net.set_profiler(Some(Box::new(profiler)));
        }
        if let Some(p) = self.net.profiler_mut() {
            p.start_step(self.backend, step);
        }
        Ok(true)
    }

    fn finish_profiled_step(&mut self, step: u64) -> Result<()> {
        if let Some(p) = self.net.profiler_mut() {
            p.finish_step(self.backend)?;
        }
        match self.profile.as_ref() {
            Some(p) if p.last == step => self.write_profile(),
            _ => Ok(()),
        }
    }

    /// Writes the profile of the steps profiled (all asked for, or those the run reached)
    /// and detaches the profiler.
    fn write_profile(&mut self) -> Result<()> {
        let (Some(steps), Some(profiler)) = (self.profile.as_ref(), self.net.set_profiler(None))
        else {
            return Ok(());
        };
        let positions = self.net.graph.objective.rows;
        // Activations are half values, 2 bytes, in a device's half-width buffers; the CPU
        // (no device memory of its own) keeps them in f32.
        let half_width = self.net.half().is_some() && self.backend.memory().is_some();
        let cx = crate::profile::Context {
            graph: &self.net.graph,
            device: self.backend.describe(),
            value_bytes: if half_width { 2 } else { 4 },
            max_batch: self.net.max_batch(),
            tokens_per_sample: (positions > 1).then_some(positions),
            // Read before `peak`, whose measured product allocates.
            memory: (self.backend.memory()).map(|(_, peak)| (peak, steps.planned_bytes)),
            peak: crate::profile::peak(self.backend, self.net.half().is_some())?,
        };
        crate::profile::write(&profiler.timings, &cx, steps)
    }

    /// A step that was not applied (inf/NaN gradients): counted, its loss taken out of the
    /// open row, and too many in a row end the run.
    fn skipped(&mut self, step: u64, epoch: usize, window_before: Option<LossStats>) -> Result<()> {
        self.st.skipped_steps += 1;
        self.skipped_in_a_row += 1;
        if let Some(before) = window_before {
            self.backend.set_stats(&mut self.train_stats, before);
        }
        let scale = self.st.loss_scaler.as_ref().map(|s| s.scale);
        let in_a_row = self.skipped_in_a_row;
        check_skipped_in_a_row(in_a_row, step, epoch, scale, self.data_finite)?;
        // With a loss scaler, skipping is how the scale finds its level: routine.
        if self.st.loss_scaler.is_some() {
            tracing::debug!("step {step} skipped: inf/NaN gradients");
        } else {
            tracing::warn!(
                "step {step} skipped: the loss or gradients are inf/NaN \
                 (train.on_nonfinite = \"skip\"; {in_a_row} in a row, {} in all)",
                self.st.skipped_steps
            );
        }
        Ok(())
    }

    /// Writes the train row for the steps since the last one. With on_nonfinite = "skip" a
    /// window whose every step was skipped has no loss to report: it stays open, and the
    /// next row covers it.
    fn log_train_row(
        &mut self,
        epoch: usize,
        lr: f64,
        result: &StepResult,
        step_samples: usize,
    ) -> Result<()> {
        let stats = self.backend.take_stats(&mut self.train_stats);
        if stats.samples <= 0.0 {
            return Ok(());
        }
        let st = &self.st;
        let samples_per_sec = st.window_samples as f64 / st.window_seconds.max(1e-9);
        // A language model's loss is at every position: its speed is also in tokens.
        let positions = self.net.graph.objective.rows;
        let flops_per_sec = samples_per_sec * self.flops.per_sample;
        let row = MetricsRow {
            step: st.step,
            epoch,
            split: "train",
            loss: stats.loss_sum / stats.samples,
            accuracy: (self.net.graph.objective.has_accuracy)
                .then(|| stats.correct / stats.samples),
            lr: Some(lr),
            grad_norm: result.grad_norm,
            samples_per_sec: Some(samples_per_sec),
            elapsed_s: self.elapsed(),
            gpu_mem: self.backend.memory(),
            loss_scale: st.loss_scaler.as_ref().map(|s| s.scale),
            skipped_steps: Some(st.skipped_steps),
            global_batch: Some(step_samples),
            tokens_per_sec: (positions > 1).then_some(samples_per_sec * positions as f64),
            flops_per_sec: Some(flops_per_sec),
            mfu: self.flops.peak.map(|peak| flops_per_sec / peak),
        };
        check_finite(
            &row,
            self.window_first,
            self.first_nonfinite,
            self.data_finite,
        )?;
        tracing::info!("{}", progress_line(&row, self.total));
        self.progress.say(|| {
            let speed = row.samples_per_sec.unwrap_or(0.0);
            format!("epoch {epoch}  loss {:.4}  {speed:.0} samples/s", row.loss)
        });
        self.metrics.write(&row)?;
        self.close_window();
        self.window_first = row.step + 1;
        self.outcome.last_train = Some(row);
        Ok(())
    }

    /// The open train row's samples and seconds go into the run's totals.
    fn close_window(&mut self) {
        let st = &mut self.st;
        st.train_samples += st.window_samples;
        st.train_seconds += st.window_seconds;
        st.window_samples = 0;
        st.window_seconds = 0.0;
    }

    /// A stop signal this process (or another replica's) received.
    fn stop_signal(&self) -> Option<i32> {
        (self.stop.and_then(Stop::requested))
            .or_else(|| self.parallel.as_ref().and_then(|p| p.stop_requested()))
    }

    /// Writes a checkpoint of the state as it stands, when the run writes any.
    fn checkpoint(&mut self) -> Result<()> {
        let elapsed_s = self.elapsed();
        if let Some(saver) = self.saver.as_mut() {
            self.st.elapsed_s = elapsed_s;
            let (net, optimizer, metrics) = (&self.net, &self.optimizer, &*self.metrics);
            let path = saver.save(
                self.backend,
                net,
                optimizer,
                &mut self.train_stats,
                &self.st,
                metrics,
            )?;
            self.outcome.last_checkpoint = Some(path);
        }
        Ok(())
    }

    /// A signal stopped the run (its checkpoint written): the other replicas stop too.
    fn interrupted(mut self, signal: i32) -> Outcome {
        self.outcome.interrupted = Some(signal);
        if let Some(p) = self.parallel.as_mut() {
            p.finish(Some(signal));
        }
        finish(self.outcome, &self.st, None)
    }

    /// An epoch's end: its evaluation (and early stopping's decision), then the epoch's
    /// checkpoint.
    fn end_epoch(&mut self, epoch: usize) -> Result<EpochEnd> {
        let mut evaluation = BTreeMap::new();
        if self.evaluates_after(epoch) {
            evaluation = self.evaluate(0..self.periodic_sets, epoch, None)?;
            if self.stops_early() {
                self.st.evaluation = evaluation;
                return Ok(EpochEnd::Stop);
            }
        }
        // The epoch is done, evaluation included: a checkpoint from here starts the next.
        self.st.epoch = epoch + 1;
        self.st.steps_in_epoch = 0;
        let every = self.spec.checkpoint.every_epochs;
        if every.is_some_and(|n| epoch.is_multiple_of(n)) && self.saver.is_some() {
            self.st.evaluation = evaluation;
            self.checkpoint()?;
            self.st.evaluation.clear();
        }
        Ok(EpochEnd::Continue)
    }

    /// Early stopping's verdict on the evaluation just made (its count goes into the
    /// checkpoints); true ends the run.
    fn stops_early(&mut self) -> bool {
        let Some(es) = self.early_stopping.as_mut() else {
            return false;
        };
        let stop = es.should_stop(&self.outcome.last_eval);
        self.st.early_stopping = Some(es.progress().clone());
        if stop {
            self.outcome.end_reason = EndReason::EarlyStopped;
        }
        stop
    }

    /// Evaluates `sets` of the evaluation splits (at most `batches` batches of each),
    /// writing a row for each.
    fn evaluate(
        &mut self,
        sets: Range<usize>,
        epoch: usize,
        samples: Option<usize>,
    ) -> Result<BTreeMap<String, f64>> {
        let elapsed_s = self.elapsed();
        evaluate(
            self.backend,
            &mut self.net,
            (&self.eval_sets[sets], samples),
            &mut self.eval_stats,
            (epoch, self.st.step, elapsed_s),
            self.metrics,
            &mut self.outcome,
        )
    }

    /// After the loop: why the run ended, the final evaluation and checkpoint, and the
    /// final weights.
    fn finish(mut self) -> Result<Outcome> {
        // The run ended before the last profiled step: the steps it profiled.
        self.write_profile()?;
        let early_stopped = self.outcome.end_reason == EndReason::EarlyStopped;
        if self.outcome.end_reason == EndReason::Completed
            && self.all_steps_done()
            && self.total < self.all_epochs_steps
        {
            self.outcome.end_reason = EndReason::MaxSteps;
        }
        self.report_skipped_steps();
        // The epoch the loop ended in (it stands at the next one's start after a full epoch).
        let last_epoch = if self.st.steps_in_epoch == 0 {
            self.st.epoch.saturating_sub(1).max(1)
        } else {
            self.st.epoch
        };
        // The final evaluation, always (also when max_steps ended the run mid-epoch).
        // Early stopping has just evaluated all but a test split kept for the end.
        let first = if early_stopped { self.periodic_sets } else { 0 };
        let sets = first..self.eval_sets.len();
        if self.spec.train.eval_every_epochs > 0 && !sets.is_empty() && !self.finishing {
            let evaluation = self.evaluate(sets, last_epoch, None)?;
            if early_stopped {
                self.st.evaluation.extend(evaluation);
            } else {
                self.st.evaluation = evaluation;
            }
        }
        self.close_window();
        let spec = self.spec;
        let policy = &spec.checkpoint;
        let checkpointing = policy.every_steps.is_some() || policy.every_epochs.is_some();
        if checkpointing && !self.finishing && self.saver.is_some() {
            self.st.finished = true;
            self.st.end_reason = Some(self.outcome.end_reason);
            if self.st.steps_in_epoch == steps_per_epoch(spec, self.train_len) {
                self.st.epoch += 1;
                self.st.steps_in_epoch = 0;
            }
            self.checkpoint()?;
        }
        let backend = self.backend;
        if let Some(p) = self.parallel.as_mut() {
            p.verify(backend, &self.net.params)?;
            p.finish(None);
        }
        let weights = self.final_weights();
        // The last steps, the evaluations and these downloads ran without a check since the
        // last step's: a device fault there fails the run rather than report garbage weights.
        backend.status()?;
        let mut outcome = finish(self.outcome, &self.st, Some(weights));
        outcome.epochs = last_epoch;
        outcome.step_recordings = B::RECORDS.then(|| self.net.step_recordings());
        outcome.update_recordings = B::RECORDS.then(|| self.optimizer.update_recordings());
        if let Some(n) = outcome.step_recordings.filter(|&n| n > 0) {
            let update = match outcome.update_recordings {
                Some(0) | None => "; the update ran op by op".to_string(),
                Some(u) => format!(", the optimizer update {u} time(s)"),
            };
            tracing::info!(
                "CUDA graphs: the training micro-step was recorded {n} time(s){update}, and \
                 replayed"
            );
        }
        Ok(outcome)
    }

    /// The last skipped steps may be in no row (a window with no applied step writes none):
    /// the log says how many there were.
    fn report_skipped_steps(&self) {
        let st = &self.st;
        if st.skipped_steps == 0 {
            return;
        }
        let (why, hint) = match &st.loss_scaler {
            Some(scaler) => (
                format!(
                    "for inf/NaN gradients (loss scaling; the scale is now {:e})",
                    scaler.scale as f32
                ),
                "a fixed precision.loss_scale may be too large (\"dynamic\" finds one), or \
                 precision.init_scale too large to back off from in so few steps",
            ),
            None => (
                "for an inf/NaN loss or gradients (train.on_nonfinite = \"skip\")".to_string(),
                "look for inf/NaN values in the data",
            ),
        };
        if st.skipped_steps == st.step {
            tracing::warn!(
                "all {} steps were skipped {why}: nothing was trained; {hint}",
                st.step
            );
        } else {
            tracing::info!(
                "{} of {} steps were skipped {why}",
                st.skipped_steps,
                st.step
            );
        }
    }

    /// The parameters and batch norm's running statistics, from the device.
    fn final_weights(&self) -> Weights {
        let mut params = vec![0.0; self.net.graph.param_len];
        self.backend.download(&self.net.params, &mut params);
        // Every training forward pass counts, as in PyTorch (micro-batches, skipped steps
        // too).
        let st = &self.st;
        let batches_tracked = (0..self.net.graph.batchnorm_prefixes().len())
            .map(|i| st.batches_tracked_before.get(i).copied().unwrap_or(0) + st.micro_step)
            .collect();
        Weights {
            params,
            running_stats: self.net.running_stats(self.backend),
            batches_tracked,
        }
    }
}

/// The network a replica trains: buffers for `batch` samples, the job's precision, and its
/// training step recorded and replayed (CUDA graphs) unless `device.cuda_graphs = false` or
/// something in the step changes every step.
pub(crate) fn training_network<B: Engine>(
    backend: &B,
    graph: Graph,
    params: &[f32],
    batch: usize,
    spec: &JobSpec,
) -> Result<Network<B>> {
    let half = half_kind(spec.precision.mode);
    let mut net = Network::with_precision(backend, graph, params, batch, spec.job.seed, half)?;
    if spec.parallel.overlap {
        let buckets = GradBuckets::new(&net.graph, spec.parallel.bucket_bytes());
        net.set_grad_buckets(Some(buckets));
    }
    if B::RECORDS && spec.device.cuda_graphs {
        if let Err(why) = net.enable_step_graphs() {
            tracing::info!("CUDA graphs off: {why}; every step launches op by op");
        }
    }
    Ok(net)
}

fn finish(mut outcome: Outcome, st: &TrainState, final_weights: Option<Weights>) -> Outcome {
    outcome.steps = st.step;
    outcome.epochs = st.epoch;
    outcome.train_samples = st.train_samples;
    outcome.train_seconds = st.train_seconds;
    outcome.skipped_steps = st.skipped_steps;
    outcome.final_weights = final_weights.unwrap_or_default();
    outcome
}

/// Writes training checkpoints for one run.
struct Saver<'a> {
    dir: PathBuf,
    spec: &'a JobSpec,
}

impl Saver<'_> {
    /// Downloads the state, writes it crash-safely, and applies keep_last / keep_best.
    fn save<B: Engine>(
        &mut self,
        backend: &B,
        net: &Network<B>,
        optimizer: &Optimizer<B>,
        stats: &mut B::Stats,
        st: &TrainState,
        metrics: &MetricsWriter,
    ) -> Result<PathBuf> {
        let started = Instant::now();
        let n = net.graph.param_len;
        let mut params = vec![0.0; n];
        backend.download(&net.params, &mut params);
        let optimizer_state: Vec<(&'static str, Vec<f32>)> = optimizer
            .state()
            .into_iter()
            .map(|(name, buf)| {
                let mut values = vec![0.0; n];
                backend.download(buf, &mut values);
                (name, values)
            })
            .collect();
        let window = peek_stats(backend, stats);
        let running_stats = net.running_stats(backend);
        // A device fault makes downloads fail (CUDA records the error and leaves the host
        // buffers as they were): such a checkpoint must not be written.
        backend.status()?;
        // Nor one that has gone inf/NaN since the last train row (where the loss is checked):
        // the newest checkpoint is always a state to go back to.
        if let Some(what) = nonfinite_state(&params, &optimizer_state, &running_stats, &window) {
            let fix = if what.starts_with("batch norm") {
                "remove the inf/NaN values from the data"
            } else if self.spec.train.on_nonfinite == OnNonFinite::Skip {
                "try a lower optimizer.lr or train.clip_grad_norm"
            } else {
                "try a lower optimizer.lr or train.clip_grad_norm, or train.on_nonfinite = \
                 \"skip\" to skip such steps"
            };
            return Err(Error::Diverged(format!(
                "training diverged: {what} at step {}, so no checkpoint was written there; \
                 {fix}",
                st.step
            )));
        }
        metrics.sync()?;
        let state = TrainState {
            optimizer_steps: optimizer.steps(),
            metrics_rows: metrics.rows(),
            ..st.clone()
        };
        let (path, size) = checkpoint::save(
            &self.dir,
            Saving {
                state: &state,
                spec: self.spec,
                params: &params,
                running_stats: &running_stats,
                optimizer: &optimizer_state,
                window,
            },
        )?;
        checkpoint::prune(&self.dir, &self.spec.checkpoint)?;
        tracing::info!(
            "checkpoint {} ({:.1} MiB in {:.3} s)",
            path.display(),
            size as f64 / (1024.0 * 1024.0),
            started.elapsed().as_secs_f64()
        );
        Ok(path)
    }
}

/// What in a checkpoint's state is inf/NaN, if anything.
fn nonfinite_state(
    params: &[f32],
    optimizer: &[(&str, Vec<f32>)],
    running_stats: &[f32],
    window: &LossStats,
) -> Option<String> {
    let nonfinite = |values: &[f32]| values.iter().any(|v| !v.is_finite());
    if !window.loss_sum.is_finite() {
        Some(format!(
            "the loss since the last train row is {}",
            window.loss_sum
        ))
    } else if nonfinite(params) {
        Some("the parameters hold inf/NaN".into())
    } else if let Some((name, _)) = optimizer.iter().find(|(_, v)| nonfinite(v)) {
        Some(format!("the optimizer's {name} holds inf/NaN"))
    } else if nonfinite(running_stats) {
        Some(
            "batch norm's running statistics hold inf/NaN (a training batch holding inf/NaN \
             updates them, even in a step that is then skipped)"
                .into(),
        )
    } else {
        None
    }
}

/// Where the training samples are.
pub struct Batch<'a, B: Engine> {
    pub samples: &'a Samples<B>,
}

#[derive(Debug, Clone, Copy)]
pub struct StepSettings {
    pub lr: f64,
    pub clip: Option<f64>,
    /// Compute the gradient norm even without clipping (for a log row).
    pub want_grad_norm: bool,
    /// Mixed precision's loss scale: each micro-batch's loss is multiplied by it before
    /// backward, the gradients divided by it before clipping, and a step with an inf or NaN
    /// gradient is skipped. None: no scaling, no check (as in fp32 PyTorch).
    pub loss_scale: Option<f64>,
    /// Skip the step (parameters and optimizer state untouched) when a gradient is inf or
    /// NaN, also without a loss scale: train.on_nonfinite = "skip".
    pub skip_nonfinite: bool,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepResult {
    /// The pre-clip global norm of the (unscaled) gradients, when it was computed.
    pub grad_norm: Option<f64>,
    /// The gradients were not all finite: parameters and optimizer state are untouched.
    pub skipped: bool,
}

/// What a replica's optimizer step works on: its device, network and optimizer, the open
/// train row's loss statistics, and the micro-step count (dropout masks are keyed by it).
pub struct StepContext<'a, B: Engine> {
    pub backend: &'a B,
    pub net: &'a mut Network<B>,
    pub optimizer: &'a mut Optimizer<B>,
    pub stats: &'a mut B::Stats,
    pub micro_step: &'a mut u64,
}

/// One optimizer step: forward, loss and backward over each micro-batch (rows of `batch`),
/// gradients averaged over them, then unscaling, clipping and the update. With gradient
/// accumulation the loss scale applies to every micro-batch and the inf/NaN check is made
/// once, on the summed gradients. Allocates nothing.
pub fn optimizer_step<B: Engine>(
    mut cx: StepContext<B>,
    batch: &Batch<B>,
    micro_batches: MicroBatches,
    settings: StepSettings,
) -> StepResult {
    let rows = micro_batches.iter();
    accumulate_gradients(&mut cx, batch, rows, Rank::WHOLE, settings.loss_scale, None);
    apply_gradients(&mut cx, settings)
}

/// A train row's speed in model FLOPs: a sample's FLOPs, and all the replicas' devices'
/// datasheet peak where it is known (MFU).
#[derive(Debug, Clone, Copy, PartialEq)]
struct ModelFlops {
    per_sample: f64,
    peak: Option<f64>,
}

impl ModelFlops {
    /// `graph`'s, on `replicas` devices like the one `device` describes, computing in half
    /// precision or not.
    fn new(graph: &Graph, device: &str, half: bool, replicas: usize) -> Self {
        ModelFlops {
            per_sample: graph.model_flops_per_sample(),
            peak: crate::profile::datasheet_peak(device, half).map(|p| p.flops * replicas as f64),
        }
    }
}

/// A replica's place among the data-parallel replicas.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rank {
    pub rank: usize,
    pub replicas: usize,
}

impl Rank {
    /// One replica computing whole micro-batches.
    pub const WHOLE: Rank = Rank {
        rank: 0,
        replicas: 1,
    };
}

/// Forward, loss and backward over this replica's share of each micro-batch (all of it for
/// a single replica), into the gradients (the first backward pass writes them,
/// `Network::start_gradients`), each micro-batch's loss multiplied by
/// `loss_scale` (mixed precision). The loss gradient of a share is weighted by replicas x
/// share / micro-batch, so that the mean over the replicas is the gradient of each
/// micro-batch's mean loss, also when the shares differ (a smaller last batch); an equal
/// share's weight is exactly 1.
pub(crate) fn accumulate_gradients<'r, B: Engine>(
    cx: &mut StepContext<B>,
    batch: &Batch<B>,
    micro_batches: impl ExactSizeIterator<Item = &'r [u64]>,
    replica: Rank,
    loss_scale: Option<f64>,
    mut sync: Option<&mut dyn GradientSync<B>>,
) {
    let (backend, net) = (cx.backend, &mut *cx.net);
    net.start_gradients();
    let scale = (loss_scale.unwrap_or(1.0) / micro_batches.len() as f64) as f32;
    let last = micro_batches.len().saturating_sub(1);
    let mut synced = false;
    for (k, all_rows) in micro_batches.enumerate() {
        let mine = share(all_rows.len(), replica.rank, replica.replicas);
        let (n, weight) = (
            mine.len(),
            (mine.len() * replica.replicas) as f32 / all_rows.len() as f32,
        );
        if n > 0 {
            net.set_sample_offset(mine.start);
            let rows = &all_rows[mine];
            let t = net.profile_start(backend);
            batch.samples.load(backend, rows, net);
            net.profile_end(backend, t, Part::Data, n);
            // Only the last micro-batch's backward pass averages (accumulation steps
            // exchange nothing).
            let sync = match &mut sync {
                Some(s) if k == last => Some(&mut **s as &mut dyn GradientSync<B>),
                _ => None,
            };
            let key = *cx.micro_step;
            synced = net.train_step(backend, n, scale * weight, cx.stats, key, sync);
        }
        *cx.micro_step += 1;
    }
    net.finish_gradients(backend);
    if let (Some(sync), false) = (sync, synced) {
        // This replica had no samples in the last micro-batch, the sync cannot run inside
        // the backward pass, or there are no buckets (parallel.overlap = false).
        net.sync_after_backward(backend, sync);
    }
}

/// Unscaling, clipping and the update, from the (averaged) gradients. With a loss scale or
/// `skip_nonfinite`, a step whose gradients are not all finite is skipped; after a
/// data-parallel all-reduce the gradients are the same on every replica, so one replica's
/// inf or NaN makes every replica skip.
pub(crate) fn apply_gradients<B: Engine>(
    cx: &mut StepContext<B>,
    settings: StepSettings,
) -> StepResult {
    let (backend, net, optimizer) = (cx.backend, &mut *cx.net, &mut *cx.optimizer);
    let check = settings.loss_scale.is_some() || settings.skip_nonfinite;
    let t = net.profile_start(backend);
    // A profiled step times clipping and the update apart, so it replays no recording.
    if !check && optimizer.records_updates() && t.is_none() {
        // Nothing decided on the host: clipping, the update and the half-precision weights
        // are recorded once and replayed (CUDA graphs); only this step's values are copied.
        // A log row reads the norm before (no clipping) or after (the clip's) the replay.
        let (clip, want) = (settings.clip, settings.want_grad_norm);
        let mut grad_norm =
            (want && clip.is_none()).then(|| clip_grad_norm(backend, &mut net.grads, None));
        optimizer.prepare(backend, settings.lr);
        optimizer.run_update(backend, clip.map(f64::to_bits), |optimizer| {
            if let Some(max_norm) = clip {
                backend.clip_to_norm(&mut net.grads, max_norm, None);
            }
            let (out, grads) = net.update_buffers();
            optimizer.update(backend, out, grads);
        });
        if want && clip.is_some() {
            grad_norm = backend.last_clip_norm();
        }
        return StepResult {
            grad_norm,
            skipped: false,
        };
    }
    let grad_norm = match (settings.loss_scale, settings.clip) {
        (Some(s), _) => Some(unscale_and_clip(backend, &mut net.grads, s, settings.clip)),
        // (With an inf norm, clipping scales the gradients by 0; the step is skipped anyway.)
        (None, _) if check => Some(clip_grad_norm(backend, &mut net.grads, settings.clip)),
        // Nothing here needs the norm but a log row: a GPU clips without waiting for it.
        (None, Some(max_norm)) => {
            let mut norm = 0.0;
            let read = settings.want_grad_norm.then_some(&mut norm);
            backend.clip_to_norm(&mut net.grads, max_norm, read);
            settings.want_grad_norm.then_some(norm)
        }
        (None, None) => settings
            .want_grad_norm
            .then(|| clip_grad_norm(backend, &mut net.grads, None)),
    };
    net.profile_end(backend, t, Part::Clip, 0);
    let skipped = check && !grad_norm.is_some_and(f64::is_finite);
    if !skipped {
        let t = net.profile_start(backend);
        let (out, grads) = net.update_buffers();
        optimizer.step(backend, out, grads, settings.lr);
        net.profile_end(backend, t, Part::Update, 0);
    }
    StepResult { grad_norm, skipped }
}

/// The half format of a precision mode (None for fp32).
pub fn half_kind(mode: PrecisionMode) -> Option<HalfKind> {
    match mode {
        PrecisionMode::Fp32 => None,
        PrecisionMode::Fp16 => Some(HalfKind::F16),
        PrecisionMode::Bf16 => Some(HalfKind::Bf16),
    }
}

/// An evaluation split.
struct EvalSet<B: Engine> {
    name: &'static str,
    samples: Samples<B>,
    len: usize,
}

impl<B: Engine> EvalSet<B> {
    fn new(
        backend: &B,
        name: &'static str,
        d: Dataset,
        (shape, reads): ((usize, usize), DataReads),
        resident: bool,
    ) -> Result<Self> {
        Ok(EvalSet {
            name,
            len: d.len,
            samples: Samples::new(backend, d, shape, reads, resident)?,
        })
    }
}

/// Evaluates on `sets` (at most `samples` samples of each), writing a row for each, at
/// (epoch, step, elapsed seconds).
fn evaluate<B: Engine>(
    backend: &B,
    net: &mut Network<B>,
    (sets, samples): (&[EvalSet<B>], Option<usize>),
    stats: &mut B::Stats,
    (epoch, step, elapsed_s): (usize, u64, f64),
    metrics: &mut MetricsWriter,
    outcome: &mut Outcome,
) -> Result<BTreeMap<String, f64>> {
    let mut evaluation = BTreeMap::new();
    let batch = net.max_batch();
    let mut rows: Vec<u64> = Vec::with_capacity(batch);
    for set in sets {
        let end = set.len.min(samples.unwrap_or(usize::MAX));
        for first in (0..end).step_by(batch) {
            let n = batch.min(end - first);
            rows.clear();
            rows.extend(first as u64..(first + n) as u64);
            set.samples.load(backend, &rows, net);
            net.forward(backend, n, false, 0);
            net.loss(backend, n, None, stats);
        }
        let s: LossStats = backend.take_stats(stats);
        backend.status()?; // no row from a faulted device
        set.samples.check_reads()?;
        let row = MetricsRow {
            step,
            epoch,
            split: set.name,
            loss: s.loss_sum / s.samples,
            accuracy: net
                .graph
                .objective
                .has_accuracy
                .then(|| s.correct / s.samples),
            elapsed_s,
            gpu_mem: backend.memory(),
            ..Default::default()
        };
        // Only finite values: the checkpoint's JSON would hold a NaN as null, which does not
        // read back as a number (the checkpoint was unreadable), and keep_best cannot rank it.
        if row.loss.is_finite() {
            evaluation.insert(format!("{}_loss", set.name), row.loss);
        } else {
            tracing::warn!(
                "the {} loss is {} at step {step}: the model's outputs are not finite there",
                set.name,
                row.loss
            );
        }
        if let Some(a) = row.accuracy {
            evaluation.insert(format!("{}_accuracy", set.name), a);
        }
        tracing::info!("{}", progress_line(&row, 0));
        metrics.write(&row)?;
        outcome.last_eval.retain(|r| r.split != set.name);
        outcome.last_eval.push(row);
    }
    Ok(evaluation)
}

/// Reads the open log row's loss statistics without resetting them (reading resets them on
/// the device, so they are put straight back).
fn peek_stats<B: Engine>(backend: &B, stats: &mut B::Stats) -> LossStats {
    let window = backend.take_stats(stats);
    backend.set_stats(stats, window);
    window
}

/// With on_nonfinite = "skip": too many skipped steps in a row is divergence after all.
/// Skipped steps leave the parameters as they were: many in a row mean the run is no longer
/// training (diverged, or a loss scale every gradient overflows at), however it skips them
/// (train.on_nonfinite = "skip", or mixed precision's loss scaling).
fn check_skipped_in_a_row(
    in_a_row: u64,
    step: u64,
    epoch: usize,
    loss_scale: Option<f64>,
    data_finite: bool,
) -> Result<()> {
    if in_a_row < MAX_SKIPPED_IN_A_ROW {
        return Ok(());
    }
    let fix = match data_finite {
        true => "try a lower optimizer.lr or train.clip_grad_norm",
        false => DATA_NOT_FINITE,
    };
    let steps = format!(
        "{in_a_row} steps in a row (steps {}..={step}, epoch {epoch})",
        step + 1 - in_a_row
    );
    Err(Error::Diverged(match loss_scale {
        Some(scale) => format!(
            "training diverged: {steps} had inf/NaN gradients at loss scale {:e} and were \
             skipped, so the parameters stopped changing; a fixed precision.loss_scale may be \
             too large (\"dynamic\" finds one), else {fix}",
            // The scale is an f32: shown as one, 1e30 rather than 1.0000000150474662e30.
            scale as f32
        ),
        None => format!(
            "training diverged: {steps} had an inf/NaN loss or gradients and were skipped; \
             train.on_nonfinite = \"skip\" gives up after {MAX_SKIPPED_IN_A_ROW} in a row; {fix}"
        ),
    }))
}

/// A train row whose loss is not finite ends the run. It names the first step whose loss
/// was not, where the backend could tell (`first`), else the steps the row averages (from
/// `window_first`).
fn check_finite(
    row: &MetricsRow,
    window_first: u64,
    first: Option<(u64, usize, f64)>,
    data_finite: bool,
) -> Result<()> {
    if row.loss.is_finite() {
        return Ok(());
    }
    let fix = match data_finite {
        true => "try a lower optimizer.lr or train.clip_grad_norm",
        false => DATA_NOT_FINITE,
    };
    let at = match first {
        Some((step, epoch, loss)) => format!("{loss} at step {step} (epoch {epoch})"),
        None if window_first < row.step => format!(
            "{} in the train row of step {} (epoch {}), which averages steps {window_first} to {}",
            row.loss, row.step, row.epoch, row.step
        ),
        None => format!("{} at step {} (epoch {})", row.loss, row.step, row.epoch),
    };
    Err(Error::Diverged(format!(
        "training diverged: the loss is {at}; {fix}, or train.on_nonfinite = \"skip\" to skip \
         such steps"
    )))
}

/// A diverged run's likeliest cause when the data holds an inf or NaN (which loading warns
/// about, naming the first): the steps that read one.
const DATA_NOT_FINITE: &str = "the data holds values that are not finite numbers (the log's \
    warning at loading names the first): remove them";

fn progress_line(row: &MetricsRow, total_steps: usize) -> String {
    let mut line = if row.split == "train" {
        format!(
            "epoch {} step {}/{} loss {:.4}",
            row.epoch, row.step, total_steps, row.loss
        )
    } else {
        format!("epoch {} {} loss {:.4}", row.epoch, row.split, row.loss)
    };
    if let Some(a) = row.accuracy {
        line += &format!(" acc {:.2}%", 100.0 * a);
    }
    if let Some(lr) = row.lr {
        line += &format!(" lr {lr:.3e}");
    }
    if let Some(g) = row.grad_norm {
        line += &format!(" grad_norm {g:.3}");
    }
    if let Some(s) = row.samples_per_sec {
        line += &format!(" {s:.0} samples/s");
    }
    if let Some(t) = row.tokens_per_sec {
        line += &format!(" {t:.0} tokens/s");
    }
    if let Some(m) = row.mfu {
        line += &format!(" MFU {:.1}%", 100.0 * m);
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    /// MFU is measured against all the replicas' datasheet peak, where it is known; a
    /// train row's log line gives it.
    #[test]
    fn mfu_is_against_every_replicas_datasheet_peak() {
        let spec: JobSpec = toml::from_str(
            "[data]\nsource = \"synthetic\"\n[model]\nlayers = [{ type = \"linear\", out = 3 }]\n\
             [optimizer]\ntype = \"sgd\"\nlr = 0.1\n",
        )
        .unwrap();
        let shape = crate::graph::DataShape {
            sample_shape: vec![4],
            classes: Some(3),
            classes_from: None,
            target_dim: 1,
        };
        let graph = Graph::build(&spec, &shape).unwrap();
        let flops = |device: &str, half, replicas| ModelFlops::new(&graph, device, half, replicas);
        let h100 = flops("cuda:0 (NVIDIA H100 80GB HBM3, TF32 allowed)", true, 2);
        assert_eq!(h100.peak, Some(2.0 * 989.4e12));
        assert_eq!(flops("cpu (2 threads)", false, 1).peak, None);
        assert_eq!(h100.per_sample, graph.model_flops_per_sample());
        let row = MetricsRow {
            split: "train",
            mfu: Some(0.4523),
            ..Default::default()
        };
        assert!(
            progress_line(&row, 10).ends_with(" MFU 45.2%"),
            "{}",
            progress_line(&row, 10)
        );
    }

    /// Where the backend cannot see each step's loss (a GPU), the error names the steps the
    /// row averages; where it can, the first step whose loss was not finite.
    #[test]
    fn a_diverged_row_names_its_first_bad_step_or_else_its_steps() {
        let row = MetricsRow {
            step: 10,
            epoch: 2,
            loss: f64::NAN,
            ..Default::default()
        };
        let message = |first| check_finite(&row, 6, first, true).unwrap_err().to_string();
        assert!(
            message(None).contains(
                "the loss is NaN in the train row of step 10 (epoch 2), which averages steps 6 to 10"
            ),
            "{}",
            message(None)
        );
        let seen = message(Some((8, 2, f64::INFINITY)));
        assert!(
            seen.contains("the loss is inf at step 8 (epoch 2)"),
            "{seen}"
        );
        let fine = MetricsRow { loss: 0.5, ..row };
        assert!(check_finite(&fine, 6, None, true).is_ok());
    }
}
