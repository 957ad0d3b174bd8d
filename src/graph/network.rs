//! The executor: a graph's buffers on one backend, planned once at the largest batch, and the
//! forward, loss and backward passes over them. The steady-state step allocates nothing.
//! With activation checkpointing (see `BufferPlan`), backward recomputes each segment's inner
//! activations before back-propagating through it; dropout redraws the same masks, since a
//! mask is a pure function of the seed, the layer and the micro-step.
//!
//! Mixed precision (`with_precision`): every activation and activation gradient holds
//! half-precision values (rounded to f16/bf16 after the op that writes it, which computes in
//! f32 from half inputs); linear and conv layers multiply by a half copy of their weights and
//! biases, refreshed from the fp32 master parameters after each optimizer step; normalisation
//! layers use the fp32 parameters and compute their statistics in f32; parameter gradients are
//! accumulated in f32. The buffers stay f32 arrays holding half values, so the CPU and CUDA
//! backends share one code path and give the same numbers.

use super::{numel, BufferPlan, Graph, Op};
use crate::error::Result;
use crate::tensor::rng::derive;
use crate::tensor::{Activation, Backend, HalfKind};

pub struct Network<B: Backend> {
    pub graph: Graph,
    pub params: B::Buf,
    pub grads: B::Buf,
    /// Activation buffers by slot; slot 0 is the input batch.
    acts: Vec<B::Buf>,
    /// Gradients of the activations, by the same slots (slot 0 is empty: the input needs none).
    dacts: Vec<B::Buf>,
    /// Which buffer each node uses, the backward segments and what they recompute.
    plan: BufferPlan,
    targets: B::Buf,
    /// Scratch shared by every conv2d layer (im2col), sized for the largest.
    workspace: B::Buf,
    /// Per layer: what its backward pass needs from the forward pass besides activations
    /// (layer norm: each row's mean and invstd); empty for the others.
    aux: Vec<B::Buf>,
    max_batch: usize,
    dropout_seed: u64,
    /// Where this batch's first sample stands in the micro-batch (see `set_sample_offset`).
    sample_offset: usize,
    /// Mixed precision: the half format of activations and of `half_params`.
    half: Option<HalfKind>,
    /// The parameters rounded to `half`, which linear and conv layers compute with.
    half_params: Option<B::Buf>,
}

/// Ops whose output is already a half value when their input is one (so rounding it again
/// would change nothing): views, ReLU, max pooling.
fn forward_keeps_half(op: &Op) -> bool {
    matches!(
        op,
        Op::View
            | Op::Activation(Activation::Relu)
            | Op::Pool {
                kind: crate::tensor::PoolKind::Max,
                ..
            }
    )
}

/// f32 values of per-layer saved state at `max_batch` (see `Network::aux`).
pub fn aux_len(op: &Op, out_shape: &[usize], max_batch: usize) -> usize {
    match op {
        Op::LayerNorm { width, .. } => 2 * max_batch * numel(out_shape) / width.max(&1),
        _ => 0,
    }
}

/// Two distinct elements of a slice, one shared and one mutable.
fn read_write<T>(v: &mut [T], read: usize, write: usize) -> (&T, &mut T) {
    assert_ne!(read, write, "a layer cannot read and write the same buffer");
    if read < write {
        let (a, b) = v.split_at_mut(write);
        (&a[read], &mut b[0])
    } else {
        let (a, b) = v.split_at_mut(read);
        (&b[0], &mut a[write])
    }
}

impl<B: Backend> Network<B> {
    pub fn new(
        backend: &B,
        graph: Graph,
        params: &[f32],
        max_batch: usize,
        seed: u64,
    ) -> Result<Self> {
        let plan = graph.buffer_plan();
        let sizes: Vec<usize> = plan.sizes.iter().map(|&n| max_batch * n).collect();
        let acts = sizes
            .iter()
            .map(|&n| backend.alloc(n))
            .collect::<Result<Vec<_>>>()?;
        let dacts = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| backend.alloc(if i == 0 { 0 } else { n }))
            .collect::<Result<Vec<_>>>()?;
        let workspace_len = graph
            .layers
            .iter()
            .filter_map(|l| match &l.op {
                Op::Conv2d { geom, .. } => Some(backend.conv_workspace_len(geom, max_batch)),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        let aux = graph
            .layers
            .iter()
            .map(|l| backend.alloc(aux_len(&l.op, &l.out_shape, max_batch)))
            .collect::<Result<Vec<_>>>()?;
        let mut param_buf = backend.alloc(graph.param_count)?;
        backend.upload(params, &mut param_buf);
        Ok(Network {
            grads: backend.alloc(graph.param_count)?,
            params: param_buf,
            acts,
            dacts,
            plan,
            targets: backend.alloc(max_batch * graph.objective.target_dim)?,
            workspace: backend.alloc(workspace_len)?,
            aux,
            max_batch,
            dropout_seed: derive(seed, 77),
            sample_offset: 0,
            graph,
            half: None,
            half_params: None,
        })
    }

    /// Switches the network to mixed precision in `half` (see the module's comment); `None`
    /// keeps fp32.
    pub fn with_precision(mut self, backend: &B, half: Option<HalfKind>) -> Result<Self> {
        self.half = half;
        self.half_params = match half {
            Some(_) => Some(backend.alloc(self.graph.param_count)?),
            None => None,
        };
        self.refresh_half_params(backend);
        Ok(self)
    }

    /// Re-rounds the half copy of the parameters from the master parameters: after every
    /// change of `params` (an optimizer step, a restore).
    pub fn refresh_half_params(&mut self, backend: &B) {
        if let (Some(kind), Some(half)) = (self.half, self.half_params.as_mut()) {
            let n = self.graph.param_count;
            backend.copy(&self.params, half, n);
            backend.round_to_half(kind, half, n);
        }
    }

    /// Rounds the first `len` values of a buffer to the half format, in mixed precision.
    fn round(backend: &B, half: Option<HalfKind>, buf: &mut B::Buf, len: usize) {
        if let Some(kind) = half {
            backend.round_to_half(kind, buf, len);
        }
    }

    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// The input batch buffer, [max_batch, input numel].
    pub fn input_mut(&mut self) -> &mut B::Buf {
        &mut self.acts[0]
    }

    /// The targets buffer, [max_batch, target_dim].
    pub fn targets_mut(&mut self) -> &mut B::Buf {
        &mut self.targets
    }

    /// The model's output for the last forward pass.
    pub fn output(&self) -> &B::Buf {
        &self.acts[self.plan.slot[self.graph.layers.len()]]
    }

    /// Says that the batch in the input buffer starts at sample `first` of the micro-batch
    /// (a data-parallel replica's share), so dropout draws the masks the whole micro-batch
    /// would draw for these samples. 0, the default, is a whole micro-batch.
    pub fn set_sample_offset(&mut self, first: usize) {
        self.sample_offset = first;
    }

    fn dropout_key(&self, layer: usize, step_key: u64) -> u64 {
        derive(derive(self.dropout_seed, layer as u64), step_key)
    }

    /// The mask stream position of layer `i`'s first output element.
    fn dropout_first(&self, i: usize) -> u64 {
        (self.sample_offset * numel(&self.graph.layers[i].out_shape)) as u64
    }

    /// Runs the layers on the first `n` samples of the input. `step_key` identifies the
    /// micro-step, so dropout draws a fresh mask each step and the same one in backward.
    pub fn forward(&mut self, backend: &B, n: usize, train: bool, step_key: u64) {
        let input_len = n * numel(&self.graph.input_shape);
        Self::round(backend, self.half, &mut self.acts[0], input_len);
        for i in 0..self.graph.layers.len() {
            self.forward_layer(backend, i, n, train, step_key);
        }
    }

    fn forward_layer(&mut self, backend: &B, i: usize, n: usize, train: bool, step_key: u64) {
        let layer = &self.graph.layers[i];
        let (src, dst) = (self.plan.slot[i], self.plan.slot[i + 1]);
        let len = n * numel(&layer.out_shape);
        // Linear and conv layers compute with the half copy of their weights, if any.
        let weights = self.half_params.as_ref().unwrap_or(&self.params);
        match layer.op {
            Op::View => {}
            Op::Linear {
                inp,
                out,
                weight,
                bias,
            } => {
                let (x, y) = read_write(&mut self.acts, src, dst);
                backend.linear_forward(x, weights, weight, bias, y, n, inp, out);
            }
            Op::Activation(f) => {
                let (x, y) = read_write(&mut self.acts, src, dst);
                backend.activation_forward(f, x, y, len);
            }
            Op::Dropout { p } => {
                let (key, first) = (self.dropout_key(i, step_key), self.dropout_first(i));
                let (x, y) = read_write(&mut self.acts, src, dst);
                if train && p > 0.0 {
                    backend.dropout_forward(p, key, first, x, y, len);
                } else {
                    backend.copy(x, y, len);
                }
            }
            Op::Conv2d { geom, weight, bias } => {
                let (x, y) = read_write(&mut self.acts, src, dst);
                backend.conv2d_forward(&geom, x, weights, weight, bias, y, n, &mut self.workspace);
            }
            Op::Pool { kind, geom } => {
                let (x, y) = read_write(&mut self.acts, src, dst);
                backend.pool2d_forward(kind, &geom, x, y, n);
            }
            Op::LayerNorm { width, gamma, eps } => {
                let (x, y) = read_write(&mut self.acts, src, dst);
                backend.layernorm_forward(
                    x,
                    y,
                    (len / width, width),
                    &self.params,
                    gamma,
                    &mut self.aux[i],
                    eps,
                );
            }
        }
        if !forward_keeps_half(&layer.op) {
            Self::round(backend, self.half, &mut self.acts[dst], len);
        }
    }

    /// The loss of the last forward pass against the first `n` targets, added to `stats`.
    /// With `grad_scale`, also seeds the backward pass with d(mean loss)/d(output) · scale.
    pub fn loss(&mut self, backend: &B, n: usize, grad_scale: Option<f32>, stats: &mut B::Stats) {
        let out_slot = self.plan.slot[self.graph.layers.len()];
        let dim = numel(self.graph.output_shape());
        let f = self.graph.objective.loss;
        let dout = grad_scale.map(|_| &mut self.dacts[out_slot]);
        let scale = grad_scale.unwrap_or(0.0);
        backend.loss(
            f,
            &self.acts[out_slot],
            &self.targets,
            n,
            dim,
            scale,
            dout,
            stats,
        );
        // The loss runs in f32 on the (half) output; its gradient flows back in half.
        if grad_scale.is_some() {
            Self::round(backend, self.half, &mut self.dacts[out_slot], n * dim);
        }
    }

    /// Back-propagates the loss gradient, adding the parameter gradients into `grads`.
    /// Segment by segment from the last: recompute its inner activations (activation
    /// checkpointing; nothing without it), then go back through its layers.
    pub fn backward(&mut self, backend: &B, n: usize, step_key: u64) {
        for s in (0..self.plan.segments.len()).rev() {
            let layers = self.plan.segments[s].clone();
            for i in layers.clone() {
                if self.plan.recompute[i] {
                    self.forward_layer(backend, i, n, true, step_key);
                }
            }
            for i in layers.rev() {
                self.backward_layer(backend, i, n, step_key);
            }
        }
    }

    fn backward_layer(&mut self, backend: &B, i: usize, n: usize, step_key: u64) {
        let layer = &self.graph.layers[i];
        let (src, dst) = (self.plan.slot[i], self.plan.slot[i + 1]);
        // Slot 0 is the data: nothing upstream needs its gradient.
        let need_dx = src != 0;
        let len = n * numel(&layer.out_shape);
        let weights = self.half_params.as_ref().unwrap_or(&self.params);
        match layer.op {
            Op::View => {}
            Op::Linear {
                inp,
                out,
                weight,
                bias,
            } => {
                let (dy, dx) = read_write(&mut self.dacts, dst, src);
                let dx = need_dx.then_some(dx);
                let x = &self.acts[src];
                backend.linear_backward(
                    x,
                    dy,
                    weights,
                    &mut self.grads,
                    weight,
                    bias,
                    dx,
                    n,
                    inp,
                    out,
                );
            }
            Op::Activation(f) if need_dx => {
                let (dy, dx) = read_write(&mut self.dacts, dst, src);
                backend.activation_backward(f, &self.acts[src], &self.acts[dst], dy, dx, len);
            }
            Op::Dropout { p } if need_dx => {
                let (key, first) = (self.dropout_key(i, step_key), self.dropout_first(i));
                let (dy, dx) = read_write(&mut self.dacts, dst, src);
                if p > 0.0 {
                    backend.dropout_backward(p, key, first, dy, dx, len);
                } else {
                    backend.copy(dy, dx, len);
                }
            }
            Op::Conv2d { geom, weight, bias } => {
                let (dy, dx) = read_write(&mut self.dacts, dst, src);
                let dx = need_dx.then_some(dx);
                let x = &self.acts[src];
                let ws = &mut self.workspace;
                backend.conv2d_backward(
                    &geom,
                    x,
                    dy,
                    weights,
                    &mut self.grads,
                    weight,
                    bias,
                    dx,
                    n,
                    ws,
                );
            }
            Op::Pool { kind, geom } if need_dx => {
                let (dy, dx) = read_write(&mut self.dacts, dst, src);
                backend.pool2d_backward(kind, &geom, &self.acts[src], &self.acts[dst], dy, dx, n);
            }
            Op::LayerNorm { width, gamma, .. } => {
                let (dy, dx) = read_write(&mut self.dacts, dst, src);
                let dx = need_dx.then_some(dx);
                let shape = (len / width, width);
                let x = &self.acts[src];
                backend.layernorm_backward(
                    x,
                    dy,
                    dx,
                    shape,
                    &self.params,
                    &mut self.grads,
                    gamma,
                    &self.aux[i],
                );
            }
            Op::Activation(_) | Op::Dropout { .. } | Op::Pool { .. } => {}
        }
        // ReLU's dx is dy or 0; max pooling may add several dy into one dx.
        let exact = matches!(layer.op, Op::View | Op::Activation(Activation::Relu));
        if need_dx && !exact {
            let in_len = n * numel(&layer.in_shape);
            Self::round(backend, self.half, &mut self.dacts[src], in_len);
        }
    }
}
