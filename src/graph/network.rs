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
//! accumulated in f32. One code path rounds explicitly, so the CPU and CUDA backends give the
//! same numbers; where every op touching a buffer can take the half format
//! (`BufferPlan::mixed`), the buffer comes from `Backend::alloc_half`, which CUDA stores in
//! that format (half the bytes, every write rounding) and the CPU as f32.

use super::profiler::{Part, Profiler};
use super::{numel, BufferPlan, GradBuckets, Graph, Layer};
use crate::data::DataReads;
use crate::error::Result;
use crate::ops::{round, Backward, Dx, Forward, Fusion, Mask, Pass};
use crate::ops::{Engine, Scratch};
use crate::tensor::record::Recorder;
use crate::tensor::rng::derive;
use crate::tensor::{Activation, GradWrite, HalfKind, LossFn, UpdatedParams};
use std::ops::Range;

pub struct Network<B: Engine> {
    /// Times each op while a step is profiled (`trainer profile`, `--profile-steps`).
    profiler: Option<Box<Profiler<B>>>,
    pub graph: Graph,
    pub params: B::Buf,
    pub grads: B::Buf,
    /// Activation buffers by slot; slot 0 is the input batch's values.
    acts: Vec<B::Buf>,
    /// The input batch's token ids, which embeddings read (empty where none does).
    ids: B::Ids,
    /// Gradients of the activations, by `plan.grad_slot` (buffers shared by values whose
    /// gradients are needed at different times in the backward pass).
    dacts: Vec<B::Buf>,
    /// Which buffer each node uses, the backward segments and what they recompute.
    plan: BufferPlan,
    targets: B::Buf,
    /// Scratch shared by every conv2d layer (im2col), sized for the largest.
    workspace: B::Buf,
    /// Where a layer's input gradient goes before it is added to the gradient other layers
    /// wrote for the same value (empty when no value is read twice).
    dscratch: B::Buf,
    /// Per layer: what its backward pass needs from the forward pass besides activations
    /// (layer norm: each row's mean and invstd); empty for the others.
    aux: Vec<B::Buf>,
    max_batch: usize,
    dropout_seed: u64,
    /// Where this batch's first sample stands in the micro-batch (see `set_sample_offset`).
    sample_offset: usize,
    /// The position the next forward pass reads, in a graph built `for_decoding`.
    position: usize,
    /// Mixed precision: the half format of activations and of `half_params`.
    half: Option<HalfKind>,
    /// The parameters rounded to `half`, which linear and conv layers compute with.
    half_params: Option<B::Buf>,
    /// Per layer: the rounding an in-place activation does for its neighbours (`Fusion`).
    fused: Vec<Fusion>,
    /// Records the training micro-step (forward, loss, backward) once and replays it (CUDA
    /// graphs), when enabled: one launch instead of one per op, which is what small models
    /// spend their time on.
    graphs: Recorder<B, Recorded>,
    /// Data parallelism: the gradient buckets handed to a `GradientSync` during the backward
    /// pass (None: the caller averages the gradients after it).
    buckets: Option<GradBuckets>,
    /// The gradients a step's first backward pass writes (linear and conv layers' weights
    /// and biases: nearly all of them), and the rest (normalisation and embedding layers'),
    /// which it zeroes first.
    written_grads: Vec<Range<usize>>,
    other_grads: Vec<Range<usize>>,
    /// The next backward pass is the step's first: it writes `written_grads` instead of
    /// adding to them (`GradWrite::Overwrite`), after zeroing `other_grads`.
    fresh_grads: bool,
}

/// Data parallelism's gradient averaging, driven by the backward pass of a step's last
/// micro-batch: `ready` with each bucket of the gradient buffer as soon as the gradients in
/// it are final (from the buffer's end down, the same order on every replica), `finished`
/// once the pass is over, before anything reads the gradients.
pub trait GradientSync<B: Engine> {
    fn ready(&mut self, backend: &B, grads: &mut B::Buf, bucket: std::ops::Range<usize>);
    fn finished(&mut self, _backend: &B, _grads: &mut B::Buf) {}
    /// Whether it may run inside the backward pass; else it gets the buckets after it.
    fn during_backward(&self) -> bool {
        true
    }
}

/// What a recorded training micro-step computes besides the buffers' contents: a recording
/// replays the same kernels with the same arguments, so it stands for a micro-step only when
/// all of these are equal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Recorded {
    samples: usize,
    grad_scale_bits: u32,
    /// Where the loss statistics are (the recording holds their device address).
    stats_at: usize,
    /// Whether the backward pass averages the gradients (data parallelism, a step's last
    /// micro-batch): the recording then holds the all-reduce too.
    syncs: bool,
    /// How the weight gradients are written (the step's first micro-batch overwrites).
    dw_write: GradWrite,
}

/// `Fusion` for every layer of `graph` laid out by `plan`.
fn fusions(graph: &Graph, plan: &BufferPlan) -> Vec<Fusion> {
    let layers = &graph.layers;
    let readers = |node: usize| layers.iter().filter(|l| l.inputs.contains(&node)).count();
    // Whether a layer rounds its output (forward) / its input gradient (backward) in the
    // generic pass after it: the pass an activation beside it can take over.
    let rounds_output = |l: &Layer| {
        let is = l.op.properties();
        !is.forward_keeps_half && is.activation.is_none()
    };
    let rounds_dx = |i: usize| {
        layers[i].op.properties().rounds_dx_after && !plan.accumulate[i][0] && !plan.is_data[i][0]
    };
    layers
        .iter()
        .enumerate()
        .map(|(j, l)| {
            if l.op.properties().activation.is_none() || !plan.in_place[j] {
                return Fusion::default();
            }
            // Node j is layer j - 1's output; node j + 1 this layer's.
            let beside = j >= 1 && l.inputs[0] == j && readers(j) == 1;
            let by_product = beside
                && l.op.properties().activation == Some(Activation::Relu)
                && layers[j - 1].op.properties().applies_relu_after;
            let input = beside && !by_product && rounds_output(&layers[j - 1]);
            let grad = j + 1 < layers.len()
                && !plan.through_relu[j + 1]
                && readers(j + 1) == 1
                && layers[j + 1].inputs[0] == j + 1
                && rounds_dx(j + 1)
                && !plan.accumulate[j][0]
                && !plan.is_data[j][0];
            Fusion {
                input,
                grad,
                by_product,
            }
        })
        .collect()
}

impl<B: Engine> Network<B> {
    /// The network in fp32.
    pub fn new(
        backend: &B,
        graph: Graph,
        params: &[f32],
        max_batch: usize,
        seed: u64,
    ) -> Result<Self> {
        Self::with_precision(backend, graph, params, max_batch, seed, None)
    }

    /// The network in fp32 (`half` None) or in mixed precision with activations in `half`
    /// (see the module's comment). The buffers that every op touching them can take in the
    /// half format are allocated with `Backend::alloc_half` (`BufferPlan::mixed`).
    pub fn with_precision(
        backend: &B,
        graph: Graph,
        params: &[f32],
        max_batch: usize,
        seed: u64,
        half: Option<HalfKind>,
    ) -> Result<Self> {
        let plan = graph.buffer_plan_for(half.is_some());
        // A buffer of `len` values: in mixed precision, in the half format.
        let alloc = |len: usize| match half {
            Some(kind) => backend.alloc_half(kind, len),
            None => backend.alloc(len),
        };
        let acts = (plan.sizes.iter())
            .map(|&n| alloc(max_batch * n))
            .collect::<Result<Vec<_>>>()?;
        let dacts = (plan.grad_sizes.iter())
            .map(|&n| alloc(max_batch * n))
            .collect::<Result<Vec<_>>>()?;
        let ids = backend.upload_ids(vec![0; max_batch * plan.token_ids])?;
        let workspace_len = graph.workspace(&Scratch {
            conv: &|geom| backend.conv_workspace_len(geom, max_batch),
            attention: &|shape| backend.attention_workspace_len(shape, max_batch),
        });
        let mut aux = graph
            .layers
            .iter()
            .map(|l| backend.alloc(l.op.state_len(&l.out_shape, max_batch)))
            .collect::<Result<Vec<_>>>()?;
        // Saved state starts as PyTorch's (batch norm's running mean 0, variance 1).
        for (l, state) in graph.layers.iter().zip(&mut aux) {
            if let Some(saved) = l.op.saved_state() {
                backend.upload(&saved.initial, state);
            }
        }
        let scratch_len = max_batch * plan.added_scratch;
        let mut param_buf = backend.alloc(graph.param_len)?;
        backend.upload(params, &mut param_buf);
        let fused = fusions(&graph, &plan);
        // Only ever holds half values: a backend may store it in the half format.
        let half_params = match half {
            Some(kind) => Some(backend.alloc_half(kind, graph.param_len)?),
            None => None,
        };
        let (written_grads, other_grads) = split_gradients(&graph);
        let mut network = Network {
            written_grads,
            other_grads,
            fresh_grads: false,
            fused,
            grads: backend.alloc(graph.param_len)?,
            params: param_buf,
            acts,
            ids,
            dacts,
            plan,
            targets: backend.alloc(max_batch * graph.objective.target_dim)?,
            workspace: backend.alloc(workspace_len)?,
            dscratch: alloc(scratch_len)?,
            aux,
            max_batch,
            dropout_seed: derive(seed, 77),
            sample_offset: 0,
            position: 0,
            graph,
            half,
            half_params,
            graphs: Recorder::off(),
            buckets: None,
            profiler: None,
        };
        network.refresh_half_params(backend);
        Ok(network)
    }

    /// The layers whose rounding an in-place activation does in its own pass, forward and
    /// backward (counted in any precision, used in mixed precision), and the ReLUs that the
    /// linear layer before applies (`Fusion`).
    pub fn fusions(&self) -> (usize, usize, usize) {
        let count = |pick: fn(&Fusion) -> bool| self.fused.iter().filter(|f| pick(f)).count();
        (
            count(|f| f.input),
            count(|f| f.grad),
            count(|f| f.by_product),
        )
    }

    /// Every rounding and activation in a pass of its own, as before the fusions: for
    /// comparing (the values are the same either way).
    pub fn without_fusion(mut self) -> Self {
        self.fused.fill(Fusion::default());
        self
    }

    /// What an optimizer update writes (the parameters, and their half copy, which it
    /// refreshes), and the gradients it reads.
    pub fn update_buffers(&mut self) -> (UpdatedParams<'_, B::Buf>, &B::Buf) {
        let half_copy = self
            .half
            .zip(self.half_params.as_mut())
            .map(|(k, h)| (h, k));
        let out = UpdatedParams {
            params: &mut self.params,
            half_copy,
        };
        (out, &self.grads)
    }

    /// Rounds the half copy of the parameters from the master parameters, once they are
    /// set; from then on every optimizer update refreshes it (`update_buffers`).
    fn refresh_half_params(&mut self, backend: &B) {
        if let (Some(kind), Some(half)) = (self.half, self.half_params.as_mut()) {
            // Into a half-width buffer the copy itself rounds; round_to_half is then nothing.
            backend.copy(&self.params, half, self.graph.param_len);
            backend.round_to_half(kind, half, self.graph.param_len);
        }
    }

    /// Records the training micro-step once and replays it (CUDA graphs; the CPU backend
    /// cannot record and runs every step), unless something in the step changes from step
    /// to step: then the reason is returned and every step runs op by op.
    pub fn enable_step_graphs(&mut self) -> std::result::Result<(), String> {
        // Dropout draws a new mask every micro-step from a key passed by value.
        let layers = &self.graph.layers;
        if let Some(i) = layers.iter().position(|l| l.op.properties().draws_masks) {
            let (key, kind) = (&layers[i].key, layers[i].kind);
            return Err(format!(
                "{key} ({kind}) draws a new dropout mask every step"
            ));
        }
        self.graphs.enable();
        Ok(())
    }

    /// Averages the gradients bucket by bucket during the backward pass when `train_step` is
    /// given a `GradientSync` (None: all at once, by the caller, after it).
    pub fn set_grad_buckets(&mut self, buckets: Option<GradBuckets>) {
        self.buckets = buckets;
    }

    pub fn grad_buckets(&self) -> Option<&GradBuckets> {
        self.buckets.as_ref()
    }

    /// How many times the training micro-step was recorded (0 without graphs).
    pub fn step_recordings(&self) -> u64 {
        self.graphs.recordings()
    }

    /// One training micro-step on the first `n` samples of the input and targets: forward,
    /// loss (statistics into `stats`, its gradient times `grad_scale`) and backward into
    /// `grads` (writing the linear and conv gradients after `start_gradients`, adding
    /// otherwise). With step graphs, a micro-step like the previous ones replays their
    /// recording (same results: the same kernels on the same buffers).
    ///
    /// With `sync` and gradient buckets (`set_grad_buckets`), the backward pass hands each
    /// bucket to `sync` as soon as it is final; returns whether it did (else the caller
    /// averages the gradients).
    pub fn train_step(
        &mut self,
        backend: &B,
        n: usize,
        grad_scale: f32,
        stats: &mut B::Stats,
        step_key: u64,
        mut sync: Option<&mut dyn GradientSync<B>>,
    ) -> bool {
        if sync.as_ref().is_some_and(|s| !s.during_backward()) {
            sync = None;
        }
        let syncs = sync.is_some() && self.buckets.is_some();
        let this = Recorded {
            samples: n,
            grad_scale_bits: grad_scale.to_bits(),
            stats_at: stats as *const B::Stats as usize,
            syncs,
            dw_write: self.dw_write(),
        };
        // Decided here, once, and passed down: a replay runs none of the host code below,
        // and a failed recording runs it twice.
        let (dw, at) = (this.dw_write, (n, grad_scale, step_key));
        // A smaller last batch (or a replica's smaller share) runs op by op: recording it
        // would replace the full batch's recording for one step. (The sample offset matters
        // only to dropout, which step graphs exclude.)
        // A profiled step runs op by op, to time each.
        let profiled = self.profiler.as_ref().is_some_and(|p| p.in_step());
        if !self.graphs.enabled() || n != self.max_batch || profiled {
            self.run_train_step(backend, at, stats, dw, sync);
        } else {
            let mut graphs = std::mem::replace(&mut self.graphs, Recorder::off());
            graphs.run(backend, this, || {
                let sync = sync.as_mut().map(|s| &mut **s as &mut dyn GradientSync<B>);
                self.run_train_step(backend, at, stats, dw, sync)
            });
            self.graphs = graphs;
        }
        self.fresh_grads = false;
        syncs
    }

    fn run_train_step(
        &mut self,
        backend: &B,
        (n, grad_scale, step_key): (usize, f32, u64),
        stats: &mut B::Stats,
        dw: GradWrite,
        sync: Option<&mut dyn GradientSync<B>>,
    ) {
        self.forward(backend, n, true, step_key);
        self.loss(backend, n, Some(grad_scale), stats);
        self.backward_syncing(backend, n, step_key, dw, sync);
    }

    /// Rounds the first `len` values of a buffer to the half format, in mixed precision.
    fn round(backend: &B, half: Option<HalfKind>, buf: &mut B::Buf, len: usize) {
        round(backend, half, buf, len);
    }

    /// Every batch-norm layer's running mean and variance, layer by layer (the layout of
    /// `Graph::running_stat_entries`): state that is not a parameter but is saved with them.
    pub fn running_stats(&self, backend: &B) -> Vec<f32> {
        let mut out = Vec::new();
        for (l, state) in self.graph.layers.iter().zip(&self.aux) {
            if let Some(saved) = l.op.saved_state() {
                let mut all = vec![0.0; saved.initial.len()];
                backend.download(state, &mut all);
                out.extend_from_slice(&all[..saved.names.len() * saved.len]);
            }
        }
        out
    }

    /// Restores `running_stats` (from a checkpoint or a weights file).
    pub fn set_running_stats(&mut self, backend: &B, values: &[f32]) -> Result<()> {
        let expected = self.graph.running_stats_len();
        if values.len() != expected {
            return Err(crate::error::Error::Job(format!(
                "{} batch-norm running statistics given, the model has {expected}",
                values.len()
            )));
        }
        let mut at = 0;
        for (l, state) in self.graph.layers.iter().zip(&mut self.aux) {
            if let Some(saved) = l.op.saved_state() {
                let (mut all, len) = (saved.initial, saved.names.len() * saved.len);
                all[..len].copy_from_slice(&values[at..at + len]);
                backend.upload(&all, state);
                at += len;
            }
        }
        Ok(())
    }

    /// Attaches a profiler (None detaches it); returns the one attached before.
    pub fn set_profiler(&mut self, profiler: Option<Box<Profiler<B>>>) -> Option<Box<Profiler<B>>> {
        std::mem::replace(&mut self.profiler, profiler)
    }

    pub fn profiler_mut(&mut self) -> Option<&mut Profiler<B>> {
        self.profiler.as_deref_mut()
    }

    /// With a profiler inside a profiled step: a span starts here (a mark in the device's
    /// queue).
    pub fn profile_start(&mut self, backend: &B) -> Option<usize> {
        self.profiler.as_mut().and_then(|p| p.start(backend))
    }

    /// The span from `start` (`profile_start`'s) to here is `part` on `samples`.
    pub fn profile_end(&mut self, backend: &B, start: Option<usize>, part: Part, samples: usize) {
        if let (Some(p), Some(start)) = (self.profiler.as_mut(), start) {
            p.record(backend, start, part, samples);
        }
    }

    /// The half format of the activations, in mixed precision.
    pub fn half(&self) -> Option<HalfKind> {
        self.half
    }

    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// The input batch's values, [max_batch, input numel]; empty where only embeddings read
    /// the data (`data_reads`).
    pub fn input_mut(&mut self) -> &mut B::Buf {
        &mut self.acts[0]
    }

    /// The input batch's token ids, [max_batch, input numel]; empty where no embedding reads
    /// the data (`data_reads`).
    pub fn ids_mut(&mut self) -> &mut B::Ids {
        &mut self.ids
    }

    /// Puts samples of data `values` in the input batch: the values where layers read them,
    /// and as token ids where embeddings do (whole numbers in [0, vocab), which loading
    /// checks). For a few samples: training gathers its batches with `train::Samples`.
    pub fn set_input(&mut self, backend: &B, values: &[f32]) {
        let reads = self.data_reads();
        if reads.values {
            backend.upload(values, &mut self.acts[0]);
        }
        if reads.ids {
            let ids: Vec<u32> = values.iter().map(|&v| v as u32).collect();
            backend.write_ids(&ids, &mut self.ids);
        }
    }

    /// Puts samples of token `ids` in the input batch: as ids where embeddings read them, and
    /// as values where other layers do.
    pub fn set_ids(&mut self, backend: &B, ids: &[u32]) {
        let reads = self.data_reads();
        if reads.ids {
            backend.write_ids(ids, &mut self.ids);
        }
        if reads.values {
            let values: Vec<f32> = ids.iter().map(|&id| id as f32).collect();
            backend.upload(&values, &mut self.acts[0]);
        }
    }

    /// What of the data the layers read: its values (`input_mut`), its token ids
    /// (`ids_mut`), or both.
    pub fn data_reads(&self) -> DataReads {
        self.plan.data_reads()
    }

    /// The targets buffer, [max_batch, target_dim].
    pub fn targets_mut(&mut self) -> &mut B::Buf {
        &mut self.targets
    }

    /// The model's output for the last forward pass. After a loss with a gradient, where
    /// the plan writes that gradient over the output (`BufferPlan::loss_over_output`), it
    /// holds the gradient instead.
    pub fn output(&self) -> &B::Buf {
        &self.acts[self.plan.slot[self.graph.layers.len()]]
    }

    /// Says that the batch in the input buffer starts at sample `first` of the micro-batch
    /// (a data-parallel replica's share), so dropout draws the masks the whole micro-batch
    /// would draw for these samples. 0, the default, is a whole micro-batch.
    pub fn set_sample_offset(&mut self, first: usize) {
        self.sample_offset = first;
    }

    /// The position of the token the next forward pass reads, in a graph built
    /// `Graph::for_decoding`: each attention layer adds its key and value there, and
    /// attends to the positions up to it.
    pub fn set_position(&mut self, position: usize) {
        self.position = position;
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
        Self::round(
            backend,
            self.half,
            &mut self.acts[0],
            n * self.plan.sizes[0],
        );
        for i in 0..self.graph.layers.len() {
            let pass = if train { Pass::Train } else { Pass::Eval };
            let t = self.profile_start(backend);
            self.forward_layer(backend, i, n, pass, step_key);
            self.profile_end(backend, t, Part::Forward(i), n);
        }
    }

    /// The dropout mask stream of layer `i` in micro-step `step_key`.
    fn mask(&self, i: usize, step_key: u64) -> Mask {
        Mask {
            key: self.dropout_key(i, step_key),
            first: self.dropout_first(i),
            sample: self.sample_offset as u64,
        }
    }

    fn forward_layer(&mut self, backend: &B, i: usize, n: usize, pass: Pass, step_key: u64) {
        let mask = self.mask(i, step_key);
        let layer = &self.graph.layers[i];
        let len = n * numel(&layer.out_shape);
        let mut f = Forward {
            backend,
            n,
            pass,
            out_len: len,
            half: self.half,
            in_place: self.plan.in_place[i],
            fusion: self.fused[i],
            relu_after: self.fused.get(i + 1).is_some_and(|f| f.by_product),
            mask,
            position: self.position,
            params: &self.params,
            // Products compute with the half copy of the parameters, if any.
            weights: self.half_params.as_ref().unwrap_or(&self.params),
            state: &mut self.aux[i],
            workspace: &mut self.workspace,
            acts: &mut self.acts,
            inputs: &layer.inputs,
            slot: &self.plan.slot,
            out_slot: self.plan.slot[i + 1],
            ids: &self.ids,
        };
        layer.op.compute().forward(&mut f);
        // Not where an in-place activation rounds it (this one, or the next: `Fusion`).
        let next_rounds = self.fused.get(i + 1).is_some_and(|f| f.input);
        if !layer.op.properties().forward_keeps_half && !self.fused[i].input && !next_rounds {
            let dst = self.plan.slot[i + 1];
            Self::round(backend, self.half, &mut self.acts[dst], len);
        }
    }

    /// The loss of the last forward pass against the first `n` targets, added to `stats`.
    /// With `grad_scale`, also seeds the backward pass with d(mean loss)/d(output) · scale.
    pub fn loss(&mut self, backend: &B, n: usize, grad_scale: Option<f32>, stats: &mut B::Stats) {
        let t = self.profile_start(backend);
        self.loss_unprofiled(backend, n, grad_scale, stats);
        self.profile_end(backend, t, Part::Loss, n);
    }

    fn loss_unprofiled(
        &mut self,
        backend: &B,
        n: usize,
        grad_scale: Option<f32>,
        stats: &mut B::Stats,
    ) {
        let out_slot = self.plan.slot[self.graph.layers.len()];
        let dout_slot = self.plan.grad_slot[self.graph.layers.len()];
        let len = numel(self.graph.output_shape());
        // A sequence's positions are rows of their own.
        let (rows, dim) = (
            n * self.graph.objective.rows,
            len / self.graph.objective.rows,
        );
        let f = self.graph.objective.loss;
        let scale = grad_scale.unwrap_or(0.0);
        let over_output = grad_scale.is_some() && self.plan.loss_over_output;
        match f {
            LossFn::CrossEntropy {
                label_smoothing,
                ignore_index,
            } if over_output => {
                // The gradient goes over the logits, which then wait in the (empty) gradient
                // buffer's place for the last layer's backward step (`BufferPlan`).
                let out = &mut self.acts[out_slot];
                backend.cross_entropy_over_output(
                    label_smoothing,
                    ignore_index,
                    out,
                    &self.targets,
                    rows,
                    dim,
                    scale,
                    stats,
                );
                Self::round(backend, self.half, out, n * len);
            }
            _ => {
                let dout = grad_scale.map(|_| &mut self.dacts[dout_slot]);
                let out = &self.acts[out_slot];
                backend.loss(f, out, &self.targets, rows, dim, scale, dout, stats);
                // The loss runs in f32 on the (half) output; its gradient flows back in half.
                if grad_scale.is_some() {
                    Self::round(backend, self.half, &mut self.dacts[dout_slot], n * len);
                }
            }
        }
    }

    /// Starts a step's gradients, as PyTorch's `zero_grad(set_to_none=True)` does: the next
    /// backward pass writes the linear and conv layers' gradients instead of adding them
    /// into zeros (no zero-fill of most of the buffer, and no product reads the old values),
    /// after zeroing the others (inside the recorded step, with CUDA graphs).
    /// `finish_gradients` after the step's backward passes.
    pub fn start_gradients(&mut self) {
        self.fresh_grads = true;
    }

    /// After the step's backward passes: zeroes the gradients when no backward pass ran
    /// since `start_gradients` (a replica with no samples in any micro-batch).
    pub fn finish_gradients(&mut self, backend: &B) {
        if std::mem::take(&mut self.fresh_grads) {
            for range in self.written_grads.iter().chain(&self.other_grads) {
                backend.fill_range(&mut self.grads, range.clone(), 0.0);
            }
        }
    }

    fn dw_write(&self) -> GradWrite {
        if self.fresh_grads {
            GradWrite::Overwrite
        } else {
            GradWrite::Add
        }
    }

    /// Back-propagates the loss gradient into `grads`: adds the parameter gradients, or
    /// after `start_gradients` writes the linear and conv layers' (zeroing the others
    /// first). Segment by segment from the last: recompute its inner activations (activation
    /// checkpointing; nothing without it), then go back through its layers.
    pub fn backward(&mut self, backend: &B, n: usize, step_key: u64) {
        let dw = self.dw_write();
        self.backward_syncing(backend, n, step_key, dw, None);
        self.fresh_grads = false;
    }

    /// `backward`, writing or adding the linear and conv gradients as `dw` says, and
    /// handing each gradient bucket to `sync` once the layers writing it are done (where the
    /// network has buckets).
    fn backward_syncing(
        &mut self,
        backend: &B,
        n: usize,
        step_key: u64,
        dw: GradWrite,
        mut sync: Option<&mut dyn GradientSync<B>>,
    ) {
        if dw == GradWrite::Overwrite {
            for range in &self.other_grads {
                backend.fill_range(&mut self.grads, range.clone(), 0.0);
            }
        }
        let buckets = self.buckets.take();
        for s in (0..self.plan.segments.len()).rev() {
            let layers = self.plan.segments[s].clone();
            for i in layers.clone() {
                if self.plan.recompute[i] {
                    let t = self.profile_start(backend);
                    self.forward_layer(backend, i, n, Pass::Recompute, step_key);
                    self.profile_end(backend, t, Part::Recompute(i), n);
                }
            }
            for i in layers.rev() {
                let t = self.profile_start(backend);
                self.backward_layer(backend, i, n, step_key, dw);
                self.profile_end(backend, t, Part::Backward(i), n);
                let ready = buckets.as_ref().and_then(|b| b.after_layer(i));
                if let (Some(sync), Some(bucket)) = (sync.as_mut(), ready) {
                    let t = self.profile_start(backend);
                    sync.ready(backend, &mut self.grads, bucket);
                    self.profile_end(backend, t, Part::AllReduce, 0);
                }
            }
        }
        if let (Some(sync), Some(_)) = (sync, &buckets) {
            let t = self.profile_start(backend);
            sync.finished(backend, &mut self.grads);
            self.profile_end(backend, t, Part::AllReduce, 0);
        }
        self.buckets = buckets;
    }

    /// Hands the gradients to `sync` after the backward pass, in the buckets other replicas'
    /// backward passes hand over (all at once without buckets), so that every replica issues
    /// the same all-reduces in the same order.
    pub fn sync_after_backward(&mut self, backend: &B, sync: &mut dyn GradientSync<B>) {
        let t = self.profile_start(backend);
        self.sync_after_backward_unprofiled(backend, sync);
        self.profile_end(backend, t, Part::AllReduce, 0);
    }

    fn sync_after_backward_unprofiled(&mut self, backend: &B, sync: &mut dyn GradientSync<B>) {
        match self.buckets.take() {
            Some(buckets) => {
                for bucket in buckets.in_backward_order() {
                    sync.ready(backend, &mut self.grads, bucket);
                }
                self.buckets = Some(buckets);
            }
            None => sync.ready(backend, &mut self.grads, 0..self.graph.param_len),
        }
        sync.finished(backend, &mut self.grads);
    }

    /// Layer `i`'s backward step. Where the loss wrote the output's gradient over the
    /// output, the last layer's step reads it there: that buffer stands in for the (empty)
    /// gradient buffer during the step.
    fn backward_layer(&mut self, backend: &B, i: usize, n: usize, step_key: u64, dw: GradWrite) {
        let last = self.graph.layers.len() - 1;
        if i != last || !self.plan.loss_over_output {
            return self.backward_layer_unswapped(backend, i, n, step_key, dw);
        }
        let (out, dout) = (self.plan.slot[last + 1], self.plan.grad_slot[last + 1]);
        std::mem::swap(&mut self.acts[out], &mut self.dacts[dout]);
        self.backward_layer_unswapped(backend, i, n, step_key, dw);
        std::mem::swap(&mut self.acts[out], &mut self.dacts[dout]);
    }

    fn backward_layer_unswapped(
        &mut self,
        backend: &B,
        i: usize,
        n: usize,
        step_key: u64,
        dw: GradWrite,
    ) {
        let mask = self.mask(i, step_key);
        let layer = &self.graph.layers[i];
        let plan = &self.plan;
        let sample_len = numel(&layer.out_shape);
        let mut b = Backward {
            backend,
            n,
            sample_len,
            out_len: n * sample_len,
            half: self.half,
            dw,
            fusion: self.fused[i],
            mask,
            through_relu: plan.through_relu[i],
            taken_through: plan.through_relu.get(i + 1) == Some(&true),
            params: &self.params,
            weights: self.half_params.as_ref().unwrap_or(&self.params),
            grads: &mut self.grads,
            state: &self.aux[i],
            workspace: &mut self.workspace,
            acts: &self.acts,
            dacts: &mut self.dacts,
            dscratch: &mut self.dscratch,
            ids: &self.ids,
            inputs: &layer.inputs,
            slot: &plan.slot,
            grad_slot: &plan.grad_slot,
            out_slot: plan.slot[i + 1],
            out_grad_slot: plan.grad_slot[i + 1],
            accumulate: &plan.accumulate[i],
            is_data: &plan.is_data[i],
        };
        let Dx::Written { exact } = layer.op.compute().backward(&mut b) else {
            return;
        };
        if plan.is_data[i][0] {
            return;
        }
        // Where dx went: its buffer, or scratch to be added to it. The activation before
        // may round dx in its own pass (`Fusion`).
        let in_len = n * numel(&layer.in_shape);
        let dsrc = plan.grad_slot[layer.inputs[0]];
        let rounded_by_activation = i >= 1 && self.fused[i - 1].grad;
        if plan.accumulate[i][0] {
            Self::round(backend, self.half, &mut self.dscratch, in_len);
            backend.add_assign(&self.dscratch, &mut self.dacts[dsrc], in_len);
            Self::round(backend, self.half, &mut self.dacts[dsrc], in_len);
        } else if !(exact || rounded_by_activation) {
            Self::round(backend, self.half, &mut self.dacts[dsrc], in_len);
        }
    }
}

/// The gradient buffer's ranges that a step's first backward pass writes
/// (`Op::written_params`), and the ranges between them, each in order and merged where they
/// touch. The ranges between include the alignment padding between tensors (`PARAM_ALIGN`):
/// zeroed each step like the rest, as a non-finite step's scaling (0 · inf) could have
/// left NaN there, which the next step's inf/NaN check would see.
fn split_gradients(graph: &Graph) -> (Vec<Range<usize>>, Vec<Range<usize>>) {
    let mut written: Vec<Range<usize>> = graph
        .layers
        .iter()
        .flat_map(|l| l.op.written_params())
        .collect();
    written.sort_by_key(|r| r.start);
    let (mut merged, mut others) = (Vec::<Range<usize>>::new(), Vec::new());
    for r in written {
        match merged.last_mut() {
            Some(last) if last.end == r.start => last.end = r.end,
            _ => merged.push(r),
        }
    }
    let mut at = 0;
    for r in merged
        .iter()
        .chain(std::iter::once(&(graph.param_len..graph.param_len)))
    {
        if r.start > at {
            others.push(at..r.start);
        }
        at = r.end;
    }
    (merged, others)
}
