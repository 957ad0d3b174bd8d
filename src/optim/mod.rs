//! Optimizers over the flat parameter buffer, with PyTorch's exact update rules (torch.optim
//! SGD, Adam, AdamW), and learning-rate schedules.

mod scaler;
mod schedule;

pub use scaler::LossScaler;
pub use schedule::Schedule;

use crate::error::Result;
use crate::spec::{DecayOn, JobSpec, OptimizerKind};
use crate::tensor::record::Recorder;
use crate::tensor::{AdamStep, Backend, SgdStep, UpdatedParams};
use std::ops::Range;

/// torch.nn.utils.clip_grad_norm_: returns the global L2 norm of `grads` and, when a
/// `max_norm` is given and exceeded, scales them by max_norm / (norm + 1e-6).
pub fn clip_grad_norm<B: Backend>(backend: &B, grads: &mut B::Buf, max_norm: Option<f64>) -> f64 {
    match max_norm {
        Some(max_norm) => {
            let mut norm = 0.0;
            backend.clip_to_norm(grads, max_norm, Some(&mut norm));
            norm
        }
        None => backend.sum_squares(grads).sqrt(),
    }
}

/// GradScaler.unscale_ followed by clip_grad_norm_, in one pass over gradients that were
/// computed from a loss multiplied by `loss_scale`: returns the norm of the unscaled
/// gradients and leaves them unscaled (and clipped when over `max_norm`). When a gradient is
/// inf or NaN the norm is too, and the gradients are left as they are: the step is skipped.
pub fn unscale_and_clip<B: Backend>(
    backend: &B,
    grads: &mut B::Buf,
    loss_scale: f64,
    max_norm: Option<f64>,
) -> f64 {
    // Σ g² in f64 cannot overflow for finite f32 values: it is finite exactly when every
    // gradient is.
    let norm = backend.sum_squares(grads).sqrt() / loss_scale;
    if !norm.is_finite() {
        return norm;
    }
    let mut factor = 1.0 / loss_scale;
    if let Some(max_norm) = max_norm {
        let coef = max_norm / (norm + 1e-6);
        if coef < 1.0 {
            factor *= coef;
        }
    }
    backend.scale(grads, factor as f32);
    norm
}

/// The values of a step that the update reads from device memory (`AdamStep::args`, the
/// longest; SGD's use the first two).
pub const STEP_ARGS: usize = 3;

pub struct Optimizer<B: Backend> {
    kind: OptimizerKind,
    spec: crate::spec::OptimizerSpec,
    weight_decay: f32,
    /// sgd: the momentum buffer; adam: exp_avg.
    state1: B::Buf,
    /// adam: exp_avg_sq.
    state2: B::Buf,
    /// Optimizer steps taken.
    steps: u64,
    /// The names of the state buffers in use (state1, then state2).
    names: &'static [&'static str],
    /// This step's changing values (learning rate, bias corrections) in device memory,
    /// where the update reads them (written by `prepare`).
    args: B::Buf,
    /// Records the update (with clipping and the half-precision weights) once and replays
    /// it (CUDA graphs), keyed by the clipping threshold's bits.
    updates: Recorder<B, Option<u64>>,
    /// 1 where weight decay applies, 0 where not (`decay_only`); None: everywhere.
    decays: Option<B::Buf>,
}

/// State buffers of the size of the parameters that a job's optimizer keeps.
pub fn state_buffers(spec: &JobSpec) -> usize {
    match spec.optimizer.kind {
        OptimizerKind::Sgd if spec.optimizer.momentum == 0.0 => 0,
        OptimizerKind::Sgd => 1,
        OptimizerKind::Adam | OptimizerKind::Adamw => 2,
    }
}

/// PyTorch's names of the state buffers a job's optimizer keeps, in order.
pub fn state_names(spec: &JobSpec) -> &'static [&'static str] {
    match state_buffers(spec) {
        0 => &[],
        1 => &["momentum_buffer"],
        _ => &["exp_avg", "exp_avg_sq"],
    }
}

impl<B: Backend> Optimizer<B> {
    pub fn new(backend: &B, spec: &JobSpec, param_len: usize) -> Result<Self> {
        let buffers = state_buffers(spec);
        let size = |i: usize| if buffers > i { param_len } else { 0 };
        Ok(Optimizer {
            kind: spec.optimizer.kind,
            spec: spec.optimizer.clone(),
            weight_decay: spec.weight_decay() as f32,
            state1: backend.alloc(size(0))?,
            state2: backend.alloc(size(1))?,
            steps: 0,
            names: state_names(spec),
            args: backend.alloc(STEP_ARGS)?,
            updates: Recorder::new(spec.device.cuda_graphs),
            decays: None,
        })
    }

    /// `new` for a model whose matrices lie at `matrices` in the flat buffer: weight decay
    /// then applies to them alone where the job says so (`optimizer.weight_decay_on`).
    pub fn for_model(
        backend: &B,
        spec: &JobSpec,
        param_len: usize,
        matrices: &[Range<usize>],
    ) -> Result<Self> {
        let mut optimizer = Self::new(backend, spec, param_len)?;
        if spec.optimizer.weight_decay_on == DecayOn::Matrices {
            let mut decays = vec![0.0f32; param_len];
            for range in matrices {
                decays[range.clone()].fill(1.0);
            }
            optimizer.decays = Some(backend.upload_vec(decays)?);
        }
        Ok(optimizer)
    }

    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The state buffers with their names (see `state_names`), for a checkpoint.
    pub fn state(&self) -> Vec<(&'static str, &B::Buf)> {
        self.names
            .iter()
            .zip([&self.state1, &self.state2])
            .map(|(n, b)| (*n, b))
            .collect()
    }

    /// Continues from a checkpoint's state: the buffers by name and the step count. The
    /// error says which buffer is missing or has the wrong size.
    pub fn restore(
        &mut self,
        backend: &B,
        state: &[(String, Vec<f32>)],
        steps: u64,
        param_len: usize,
    ) -> std::result::Result<(), String> {
        let given: Vec<&str> = state.iter().map(|(n, _)| n.as_str()).collect();
        if given != self.names {
            return Err(format!(
                "the checkpoint's optimizer state is [{}], this optimizer keeps [{}]",
                given.join(", "),
                self.names.join(", ")
            ));
        }
        for ((name, values), buf) in state.iter().zip([&mut self.state1, &mut self.state2]) {
            if values.len() != param_len {
                return Err(format!(
                    "optimizer state `{name}` has {} values, the model's parameter buffer {param_len}",
                    values.len()
                ));
            }
            backend.upload(values, buf);
        }
        self.steps = steps;
        Ok(())
    }

    /// One update of the parameters in `out` from `grads` at learning rate `lr`.
    pub fn step(&mut self, backend: &B, out: UpdatedParams<'_, B::Buf>, grads: &B::Buf, lr: f64) {
        self.prepare(backend, lr);
        self.update(backend, out, grads);
    }

    /// Counts the next step and writes its values at learning rate `lr` where `update`
    /// reads them: outside any recording, so a recorded update follows the schedule.
    pub fn prepare(&mut self, backend: &B, lr: f64) {
        self.steps += 1;
        let lr = lr as f32;
        match self.kind {
            OptimizerKind::Sgd => {
                backend.upload(&SgdStep::args(lr, self.steps == 1), &mut self.args)
            }
            OptimizerKind::Adam | OptimizerKind::Adamw => {
                backend.upload(&self.adam().args(lr, self.steps), &mut self.args)
            }
        }
    }

    /// The update `prepare` wrote the values of: one fused kernel over the flat buffers.
    pub fn update(&mut self, backend: &B, out: UpdatedParams<'_, B::Buf>, grads: &B::Buf) {
        match self.kind {
            OptimizerKind::Sgd => {
                let h = self.sgd();
                let decays = self.decays.as_ref();
                backend.sgd_step(out, grads, &mut self.state1, &h, &self.args, decays);
            }
            OptimizerKind::Adam | OptimizerKind::Adamw => {
                let h = self.adam();
                let (m, v) = (&mut self.state1, &mut self.state2);
                backend.adam_step(out, grads, m, v, &h, &self.args, self.decays.as_ref());
            }
        }
    }

    /// Runs `update` (this optimizer's `update` and what goes with it: clipping) after
    /// `prepare`, recorded once and replayed where the
    /// device records (CUDA graphs); `key` names what the recording depends on besides the
    /// buffers (the clipping threshold). `update` must read nothing back from the device.
    pub fn run_update(&mut self, backend: &B, key: Option<u64>, mut update: impl FnMut(&mut Self)) {
        let mut updates = std::mem::replace(&mut self.updates, Recorder::off());
        updates.run(backend, key, || update(self));
        self.updates = updates;
    }

    /// Whether `run_update` records (CUDA graphs on, on a device that records).
    pub fn records_updates(&self) -> bool {
        self.updates.enabled()
    }

    /// How many times the update was recorded.
    pub fn update_recordings(&self) -> u64 {
        self.updates.recordings()
    }

    fn sgd(&self) -> SgdStep {
        let o = &self.spec;
        SgdStep {
            momentum: o.momentum as f32,
            dampening: o.dampening as f32,
            nesterov: o.nesterov,
            weight_decay: self.weight_decay,
        }
    }

    fn adam(&self) -> AdamStep {
        let o = &self.spec;
        AdamStep {
            beta1: o.betas[0] as f32,
            beta2: o.betas[1] as f32,
            eps: o.eps as f32,
            weight_decay: self.weight_decay,
            decoupled: self.kind == OptimizerKind::Adamw,
        }
    }
}
