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

mod stopping;

pub use stopping::EndReason;

use crate::data::{batches_per_epoch, epoch_order, Data, Dataset};
use crate::error::{Error, Result};
use crate::graph::{Graph, Network};
use crate::optim::{clip_grad_norm, Optimizer, Schedule};
use crate::run::{MetricsRow, MetricsWriter};
use crate::spec::JobSpec;
use crate::tensor::{Backend, LossStats};
use std::time::Instant;

/// What a finished training run reports.
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
    pub final_params: Vec<f32>,
    pub end_reason: EndReason,
}

impl Outcome {
    pub fn samples_per_sec(&self) -> f64 {
        self.train_samples as f64 / self.train_seconds.max(1e-9)
    }
}

/// Optimizer steps the whole run will take.
pub fn total_steps(spec: &JobSpec, train_len: usize) -> usize {
    let batches = batches_per_epoch(train_len, spec.data.batch_size, spec.data.drop_last);
    let per_epoch = batches.div_ceil(spec.train.grad_accum_steps);
    let all = per_epoch * spec.train.epochs;
    spec.train.max_steps.map_or(all, |m| m.min(all))
}

pub fn train<B: Backend>(
    backend: &B,
    spec: &JobSpec,
    graph: Graph,
    data: Data,
    metrics: &mut MetricsWriter,
) -> Result<Outcome> {
    let batch_size = spec.data.batch_size;
    let row_len = data.row_len();
    let target_dim = data.target_dim;
    let has_accuracy = graph.objective.has_accuracy;
    let params = graph.init_params(spec.job.seed);
    let mut net = Network::new(backend, graph, &params, batch_size, spec.job.seed)?;
    let mut optimizer = Optimizer::new(backend, spec, params.len())?;

    let train_len = data.train.len;
    if spec.data.drop_last && train_len < batch_size {
        return Err(Error::Job(format!(
            "data.drop_last = true with batch_size {batch_size} leaves no batch: the training split \
             has only {train_len} samples"
        )));
    }
    let total = total_steps(spec, train_len);
    let schedule = Schedule::new(spec.optimizer.lr, &spec.optimizer.schedule, total);
    let train_x = backend.upload_vec(data.train.features)?;
    let train_y = backend.upload_vec(data.train.targets)?;
    let eval_sets = data
        .eval
        .into_iter()
        .map(|(name, d)| DeviceSet::new(backend, name, d))
        .collect::<Result<Vec<_>>>()?;

    let mut train_stats = backend.new_stats()?;
    let mut eval_stats = backend.new_stats()?;
    let start = Instant::now();
    let mut outcome = Outcome::default();
    let mut window = Window::new();
    let mut micro_step = 0u64;
    let accum = spec.train.grad_accum_steps;
    let clip = spec.train.clip_grad_norm;
    let log_every = spec.train.log_every as u64;
    let epoch_steps = batches_per_epoch(train_len, batch_size, spec.data.drop_last).div_ceil(accum)
        * spec.train.epochs;
    let deadline = stopping::deadline(spec, start);
    let mut early_stopping = stopping::EarlyStopping::new(spec);

    'epochs: for epoch in 1..=spec.train.epochs {
        outcome.epochs = epoch;
        let order = epoch_order(train_len, spec.data.shuffle, spec.job.seed, epoch);
        let mut batches: Vec<&[u32]> = order.chunks(batch_size).collect();
        if spec.data.drop_last && train_len % batch_size != 0 {
            batches.pop();
        }
        for group in batches.chunks(accum) {
            let step_start = Instant::now();
            let step = outcome.steps + 1;
            // Past the deadline, this step is the last one (and is logged).
            let out_of_time = deadline.is_some_and(|d| Instant::now() >= d);
            let logging = step % log_every == 0 || step as usize == total || out_of_time;
            let lr = schedule.lr(outcome.steps as usize);
            let batch = Batch {
                x: &train_x,
                y: &train_y,
                row_len,
                target_dim,
            };
            let grad_norm = optimizer_step(
                backend,
                &mut net,
                &mut optimizer,
                &batch,
                group,
                &mut micro_step,
                &mut train_stats,
                StepSettings {
                    lr,
                    clip,
                    want_grad_norm: logging,
                },
            );
            backend.status()?;
            window.samples += group.iter().map(|rows| rows.len() as u64).sum::<u64>();
            outcome.steps = step;
            window.seconds += step_start.elapsed().as_secs_f64();

            if logging {
                let stats = backend.take_stats(&mut train_stats);
                let row = MetricsRow {
                    step,
                    epoch,
                    split: "train",
                    loss: stats.loss_sum / stats.samples,
                    accuracy: has_accuracy.then(|| stats.correct / stats.samples),
                    lr: Some(lr),
                    grad_norm,
                    samples_per_sec: Some(window.samples as f64 / window.seconds.max(1e-9)),
                    elapsed_s: start.elapsed().as_secs_f64(),
                    gpu_mem: backend.memory(),
                };
                check_finite(&row)?;
                tracing::info!("{}", progress_line(&row, total));
                metrics.write(&row)?;
                outcome.train_samples += window.samples;
                outcome.train_seconds += window.seconds;
                window = Window::new();
                outcome.last_train = Some(row);
            }
            if step as usize >= total {
                if total < epoch_steps {
                    outcome.end_reason = EndReason::MaxSteps;
                }
                break 'epochs;
            }
            if out_of_time {
                tracing::info!("train.max_time reached after {step} steps");
                outcome.end_reason = EndReason::MaxTime;
                break 'epochs;
            }
        }
        let eval_every = spec.train.eval_every_epochs;
        if eval_every > 0 && epoch % eval_every == 0 && epoch < spec.train.epochs {
            evaluate(
                backend,
                &mut net,
                &eval_sets,
                &mut eval_stats,
                epoch,
                outcome.steps,
                start,
                metrics,
                &mut outcome,
            )?;
            if let Some(es) = early_stopping.as_mut() {
                if es.should_stop(&outcome.last_eval) {
                    outcome.end_reason = EndReason::EarlyStopped;
                    break 'epochs;
                }
            }
        }
    }
    // The final evaluation, also when max_steps or max_time ended the run mid-epoch; early
    // stopping has just evaluated.
    if spec.train.eval_every_epochs > 0 && outcome.end_reason != EndReason::EarlyStopped {
        evaluate(
            backend,
            &mut net,
            &eval_sets,
            &mut eval_stats,
            outcome.epochs,
            outcome.steps,
            start,
            metrics,
            &mut outcome,
        )?;
    }
    outcome.train_samples += window.samples;
    outcome.train_seconds += window.seconds;
    let mut final_params = vec![0.0; net.graph.param_count];
    backend.download(&net.params, &mut final_params);
    outcome.final_params = final_params;
    Ok(outcome)
}

/// Where the training samples live on the device.
pub struct Batch<'a, B: Backend> {
    pub x: &'a B::Buf,
    pub y: &'a B::Buf,
    pub row_len: usize,
    pub target_dim: usize,
}

#[derive(Debug, Clone, Copy)]
pub struct StepSettings {
    pub lr: f64,
    pub clip: Option<f64>,
    /// Compute the gradient norm even without clipping (for a log row).
    pub want_grad_norm: bool,
}

/// One optimizer step: forward, loss and backward over each micro-batch (rows of `batch`),
/// gradients averaged over them, then clipping and the update. Returns the pre-clip global
/// gradient norm when it was computed. Allocates nothing.
#[allow(clippy::too_many_arguments)]
pub fn optimizer_step<B: Backend>(
    backend: &B,
    net: &mut Network<B>,
    optimizer: &mut Optimizer<B>,
    batch: &Batch<B>,
    micro_batches: &[&[u32]],
    micro_step: &mut u64,
    stats: &mut B::Stats,
    settings: StepSettings,
) -> Option<f64> {
    backend.fill(&mut net.grads, 0.0);
    let scale = 1.0 / micro_batches.len() as f32;
    for rows in micro_batches {
        let n = rows.len();
        backend.gather_rows(batch.x, rows, batch.row_len, net.input_mut());
        backend.gather_rows(batch.y, rows, batch.target_dim, net.targets_mut());
        net.forward(backend, n, true, *micro_step);
        net.loss(backend, n, Some(scale), stats);
        net.backward(backend, n, *micro_step);
        *micro_step += 1;
    }
    let grad_norm = (settings.clip.is_some() || settings.want_grad_norm)
        .then(|| clip_grad_norm(backend, &mut net.grads, settings.clip));
    optimizer.step(backend, &mut net.params, &net.grads, settings.lr);
    grad_norm
}

/// Samples and training seconds since the last log row.
struct Window {
    samples: u64,
    seconds: f64,
}

impl Window {
    fn new() -> Self {
        Window {
            samples: 0,
            seconds: 0.0,
        }
    }
}

/// An evaluation split, held on the device.
struct DeviceSet<B: Backend> {
    name: &'static str,
    x: B::Buf,
    y: B::Buf,
    len: usize,
}

impl<B: Backend> DeviceSet<B> {
    fn new(backend: &B, name: &'static str, d: Dataset) -> Result<Self> {
        Ok(DeviceSet {
            name,
            len: d.len,
            x: backend.upload_vec(d.features)?,
            y: backend.upload_vec(d.targets)?,
        })
    }
}

#[allow(clippy::too_many_arguments)]
fn evaluate<B: Backend>(
    backend: &B,
    net: &mut Network<B>,
    sets: &[DeviceSet<B>],
    stats: &mut B::Stats,
    epoch: usize,
    step: u64,
    start: Instant,
    metrics: &mut MetricsWriter,
    outcome: &mut Outcome,
) -> Result<()> {
    let row_len: usize = net.graph.input_shape.iter().product();
    let target_dim = net.graph.objective.target_dim;
    let batch = net.max_batch();
    let mut rows: Vec<u32> = Vec::with_capacity(batch);
    for set in sets {
        for first in (0..set.len).step_by(batch) {
            let n = batch.min(set.len - first);
            rows.clear();
            rows.extend(first as u32..(first + n) as u32);
            backend.gather_rows(&set.x, &rows, row_len, net.input_mut());
            backend.gather_rows(&set.y, &rows, target_dim, net.targets_mut());
            net.forward(backend, n, false, 0);
            net.loss(backend, n, None, stats);
        }
        let s: LossStats = backend.take_stats(stats);
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
            elapsed_s: start.elapsed().as_secs_f64(),
            gpu_mem: backend.memory(),
            ..Default::default()
        };
        tracing::info!("{}", progress_line(&row, 0));
        metrics.write(&row)?;
        outcome.last_eval.retain(|r| r.split != set.name);
        outcome.last_eval.push(row);
    }
    Ok(())
}

fn check_finite(row: &MetricsRow) -> Result<()> {
    if row.loss.is_finite() {
        return Ok(());
    }
    Err(Error::Diverged(format!(
        "training diverged: the loss is {} at step {} (epoch {}); try a lower optimizer.lr or \
         train.clip_grad_norm",
        row.loss, row.step, row.epoch
    )))
}

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
    line
}
