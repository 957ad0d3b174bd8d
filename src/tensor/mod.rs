//! The tensor engine: the `Backend` trait that every device implements over flat f32
//! buffers, and the CPU backend that is both the reference and the fast path without a GPU.
//!
//! The graph executor owns the buffers and calls these ops; a layer's parameters are spans
//! (offsets) into one flat parameter buffer, and their gradients the same spans of one flat
//! gradient buffer, so the optimizer is a single pass and a checkpoint a single write.

pub mod cast;
pub mod cpu;
pub mod cuda;
pub mod geometry;
pub mod matmul;
pub mod record;
pub mod rng;
pub mod vector_math;

use crate::error::Result;
pub use cast::HalfKind;
pub use geometry::{Attention, Conv2d, Pool2d};
pub use record::Capture;

/// Which pooling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolKind {
    /// Maximum over the window; padding counts as -inf.
    Max,
    /// Mean over the full window area (padding counts as 0: count_include_pad).
    Avg,
}

/// Elementwise activation functions, with PyTorch's definitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Relu,
    /// x·Φ(x), with the exact error function.
    Gelu,
    /// 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).
    GeluTanh,
    Tanh,
    Sigmoid,
    /// x·σ(x), PyTorch's SiLU (swish): the gate of Llama's SwiGLU.
    Silu,
}

/// The loss functions, each fused with its gradient.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LossFn {
    /// Softmax cross-entropy over `dim` logits with a class index per sample; rows whose
    /// class is `ignore_index` are not scored, and the mean is over the others.
    CrossEntropy {
        label_smoothing: f32,
        ignore_index: Option<u32>,
    },
    /// Mean squared error over `dim` targets per sample.
    Mse,
    /// Sigmoid + binary cross-entropy over `dim` logits with targets in [0, 1].
    BceWithLogits,
}

/// What an optimizer update writes: the f32 master parameters and, in mixed precision, their
/// copy rounded to a half format (`graph::Network`'s, which linear and conv layers read),
/// refreshed in the update's own pass rather than in a second pass over the parameters.
pub struct UpdatedParams<'a, Buf> {
    pub params: &'a mut Buf,
    pub half_copy: Option<(&'a mut Buf, HalfKind)>,
}

/// Adam/AdamW's hyper-parameters, with PyTorch's semantics: what stays the same from step to
/// step. What changes (the learning rate, the bias corrections) is `AdamStep::args`, which
/// the update reads from device memory, so that a recorded update (CUDA graphs) follows the
/// schedule.
#[derive(Debug, Clone, Copy)]
pub struct AdamStep {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// AdamW: weight decay multiplies the parameters instead of joining the gradient.
    pub decoupled: bool,
}

impl AdamStep {
    /// The values of step `step` (1-based) at learning rate `lr` that the update reads:
    /// [parameter decay, step size, √(bias correction 2)]. AdamW decays the parameters by
    /// 1 - lr·wd; Adam adds wd·p to the gradient instead (`l2`) and decays by 1 (x·1 is exact).
    pub fn args(&self, lr: f32, step: u64) -> [f32; 3] {
        let bias_correction1 = 1.0 - (self.beta1 as f64).powi(step as i32);
        let bias_correction2 = 1.0 - (self.beta2 as f64).powi(step as i32);
        let step_size = (lr as f64 / bias_correction1) as f32;
        let decay = if self.decoupled {
            1.0 - lr * self.weight_decay
        } else {
            1.0
        };
        [decay, step_size, bias_correction2.sqrt() as f32]
    }

    /// The L2 term's factor (Adam; 0 for AdamW, whose decay is in `args`).
    pub fn l2(&self) -> f32 {
        if self.decoupled {
            0.0
        } else {
            self.weight_decay
        }
    }
}

/// SGD's hyper-parameters, with PyTorch's semantics; what changes from step to step is
/// `SgdStep::args`.
#[derive(Debug, Clone, Copy)]
pub struct SgdStep {
    pub momentum: f32,
    pub dampening: f32,
    pub nesterov: bool,
    pub weight_decay: f32,
}

impl SgdStep {
    /// The values the update reads: [learning rate, 1 on the first step (the momentum buffer
    /// starts as the first gradient, undampened), else 0].
    pub fn args(lr: f32, first_step: bool) -> [f32; 2] {
        [lr, if first_step { 1.0 } else { 0.0 }]
    }
}

/// How a linear or conv layer's backward pass puts its weight and bias gradients into the
/// gradient buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradWrite {
    /// Adds to what is there (a later micro-batch of the step).
    Add,
    /// Writes them, without reading what is there (the step's first backward pass): no
    /// zero-fill before, and the weight's product reads no C (cuBLAS beta = 0), as with
    /// PyTorch's `zero_grad(set_to_none=True)`.
    Overwrite,
}

/// Running sums a loss adds to: loss summed over samples, correct predictions, samples.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LossStats {
    pub loss_sum: f64,
    pub correct: f64,
    /// The rows scored: samples, or positions of a sequence, less those ignored.
    pub samples: f64,
}

/// Another replica's sums added to these (data parallelism).
impl std::ops::AddAssign for LossStats {
    fn add_assign(&mut self, other: LossStats) {
        self.loss_sum += other.loss_sum;
        self.correct += other.correct;
        self.samples += other.samples;
    }
}

/// Where the matrices of a batched product lie in a buffer: the first at `offset`, each next
/// one `batch_stride` values on, rows `row_stride` values apart. `transposed` reads each one
/// as its transpose (a row of the stored matrix is then a column of the operand).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Matrices {
    pub offset: usize,
    pub batch_stride: usize,
    pub row_stride: usize,
    pub transposed: bool,
}

/// Where row r of a data set lies: `len` values from r·stride + offset. Samples one after
/// another are `packed`; a text's windows of tokens overlap (stride 1, or a block apart) and
/// their targets are the same tokens one on (offset 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowsAt {
    pub len: usize,
    pub stride: usize,
    pub offset: usize,
}

impl RowsAt {
    /// Rows of `len` values one after another.
    pub fn packed(len: usize) -> RowsAt {
        RowsAt {
            len,
            stride: len,
            offset: 0,
        }
    }

    /// Where row `r` starts.
    pub fn start(&self, r: u64) -> usize {
        r as usize * self.stride + self.offset
    }
}

/// Token ids in host memory, where a streamed batch copies its windows from: a vector, or
/// token files read where they lie (`data::TokenIds`).
pub trait HostIds: Sync {
    /// Ids `start..start + out.len()` into `out`.
    fn copy_ids(&self, start: usize, out: &mut [u32]);
}

impl HostIds for Vec<u32> {
    fn copy_ids(&self, start: usize, out: &mut [u32]) {
        out.copy_from_slice(&self[start..start + out.len()]);
    }
}

/// Where gathered token ids go: an embedding's ids, or values (class indices for the loss;
/// exact below 2^24).
pub enum IdsInto<'a, B: Backend + ?Sized> {
    Ids(&'a mut B::Ids),
    Values(&'a mut B::Buf),
}

/// The ops a device implements. Buffers are flat f32 arrays; every op gets its sizes
/// explicitly, and uses only the prefix it needs (a smaller last batch reuses the buffers).
/// Recording ops and replaying them (CUDA graphs) is `Capture`'s part.
pub trait Backend: Capture {
    /// Device memory holding f32 values (or, from `alloc_half`, half values in a format the
    /// backend chooses).
    type Buf;
    /// Device memory holding token ids (u32), which an embedding reads.
    type Ids;
    /// Where a loss accumulates its statistics (kept on the device until read).
    type Stats;
    /// A point in the device's queued work, for the profiler: a CUDA event, an instant on
    /// the CPU. Marks time each op without waiting for the device after it.
    type Mark;

    /// A short description for logs, e.g. "cpu (2 threads)".
    fn describe(&self) -> String;
    /// A zero-filled buffer.
    fn alloc(&self, len: usize) -> Result<Self::Buf>;
    /// A zero-filled buffer for `len` values that are always `kind` values (mixed
    /// precision's activations): a backend may store them in that format, 2 bytes each, so
    /// that every write rounds (CUDA does). The CPU stores f32, which the network rounds
    /// itself, so both give the same numbers.
    fn alloc_half(&self, _kind: HalfKind, len: usize) -> Result<Self::Buf> {
        self.alloc(len)
    }
    /// A buffer holding `data` (the CPU backend keeps the vector itself: no copy).
    fn upload_vec(&self, data: Vec<f32>) -> Result<Self::Buf>;
    fn upload(&self, src: &[f32], dst: &mut Self::Buf);
    /// The first `dst.len()` values of `src`.
    fn download(&self, src: &Self::Buf, dst: &mut [f32]) {
        self.download_at(src, 0, dst);
    }
    /// `dst.len()` values of `src` from `start` on.
    fn download_at(&self, src: &Self::Buf, start: usize, dst: &mut [f32]);
    fn fill(&self, buf: &mut Self::Buf, value: f32);
    /// Sets `buf[range]` of an f32 buffer to `value`.
    fn fill_range(&self, buf: &mut Self::Buf, range: std::ops::Range<usize>, value: f32);
    fn copy(&self, src: &Self::Buf, dst: &mut Self::Buf, len: usize);
    /// dst's row i = the row `rows[i]` of src (laid out as `at` says): assembles a batch from
    /// a data set held on the device.
    fn gather_rows(&self, src: &Self::Buf, rows: &[u64], at: RowsAt, dst: &mut Self::Buf);
    /// The same from a data set in host memory (device.data = "streamed"): a GPU gathers the
    /// rows on the host into pinned memory and copies them asynchronously, queued before the
    /// work that reads them. `src` may change once this returns.
    fn upload_rows(&self, src: &[f32], rows: &[u64], at: RowsAt, dst: &mut Self::Buf);
    /// Token ids on the device (the CPU keeps the vector itself: no copy).
    fn upload_ids(&self, ids: Vec<u32>) -> Result<Self::Ids>;
    /// dst[..src.len()] = src.
    fn write_ids(&self, src: &[u32], dst: &mut Self::Ids);
    /// `gather_rows` for token ids: into ids, or into values (a text's targets, the next
    /// tokens, which the loss reads as class indices).
    fn gather_ids(&self, src: &Self::Ids, rows: &[u64], at: RowsAt, dst: IdsInto<'_, Self>);
    /// `upload_rows` for token ids.
    fn upload_id_rows(&self, src: &dyn HostIds, rows: &[u64], at: RowsAt, dst: IdsInto<'_, Self>);
    /// Device memory not in use by anyone (None on the CPU): whether the data set fits.
    fn free_memory(&self) -> Option<usize> {
        None
    }

    /// The loss of `out` [n, dim] against `targets`, added to `stats`; when `dout` is given,
    /// also its gradient d(mean loss)/d(out) times `grad_scale`.
    #[allow(clippy::too_many_arguments)]
    fn loss(
        &self,
        f: LossFn,
        out: &Self::Buf,
        targets: &Self::Buf,
        n: usize,
        dim: usize,
        grad_scale: f32,
        dout: Option<&mut Self::Buf>,
        stats: &mut Self::Stats,
    );
    /// `loss` for `LossFn::CrossEntropy { label_smoothing, ignore_index }` with its gradient
    /// written over `out`, each row read before it is written (llm.c's fused classifier):
    /// the same values, and no gradient buffer.
    #[allow(clippy::too_many_arguments)]
    fn cross_entropy_over_output(
        &self,
        label_smoothing: f32,
        ignore_index: Option<u32>,
        out: &mut Self::Buf,
        targets: &Self::Buf,
        n: usize,
        dim: usize,
        grad_scale: f32,
        stats: &mut Self::Stats,
    );
    fn new_stats(&self) -> Result<Self::Stats>;
    /// Reads the statistics and resets them to zero.
    fn take_stats(&self, stats: &mut Self::Stats) -> LossStats;
    /// Sets the statistics (a checkpoint saves and restores a partly accumulated log row).
    fn set_stats(&self, stats: &mut Self::Stats, value: LossStats);
    /// The loss sum accumulated so far, where reading it waits for nothing (the CPU's);
    /// None where it would (a GPU's, which a step does not wait for).
    fn loss_sum_now(&self, _stats: &Self::Stats) -> Option<f64> {
        None
    }

    /// dst[..len] += src[..len] (residual sums, gradients of a value read by several layers).
    fn add_assign(&self, src: &Self::Buf, dst: &mut Self::Buf, len: usize);
    /// For each of `rows` rows, `width` values from src[r·stride + offset..] to
    /// dst[r·stride + offset..] (layouts as (stride, offset)); with `add`, added to dst.
    #[allow(clippy::too_many_arguments)]
    fn copy_rows(
        &self,
        src: &Self::Buf,
        src_layout: (usize, usize),
        dst: &mut Self::Buf,
        dst_layout: (usize, usize),
        width: usize,
        rows: usize,
        add: bool,
    );

    /// Σ buf[i]², for the global gradient norm.
    /// `batch` row-major products C = op(A)·op(B), or C += op(A)·op(B) with `accumulate`:
    /// op(A) is [m, k], op(B) [k, n], C [m, n] with rows n apart and not transposed. The
    /// building block of attention (scores Q·Kᵀ and their weighted values, head by head).
    /// f32 buffers only: a half-width operand is a launch error.
    #[allow(clippy::too_many_arguments)]
    fn batched_matmul(
        &self,
        shape: (usize, usize, usize),
        batch: usize,
        a: &Self::Buf,
        a_at: Matrices,
        b: &Self::Buf,
        b_at: Matrices,
        c: &mut Self::Buf,
        c_at: Matrices,
        accumulate: bool,
    );

    fn sum_squares(&self, buf: &Self::Buf) -> f64;
    /// PyTorch's clip_grad_norm_: scales the gradients by max_norm / (norm + 1e-6) when that
    /// is below 1 (not when the norm is NaN), and writes the norm to `read` when given. A GPU
    /// decides on the device, so the host reads nothing back (and does not wait for the
    /// step) unless asked.
    fn clip_to_norm(&self, grads: &mut Self::Buf, max_norm: f64, read: Option<&mut f64>) {
        let norm = self.sum_squares(grads).sqrt();
        let coef = max_norm / (norm + 1e-6);
        if coef < 1.0 {
            self.scale(grads, coef as f32);
        }
        if let Some(out) = read {
            *out = norm;
        }
    }
    /// The norm the last `clip_to_norm` computed, read back now: for a recorded clip, which
    /// cannot read it (devices that record; None elsewhere).
    fn last_clip_norm(&self) -> Option<f64> {
        None
    }
    fn scale(&self, buf: &mut Self::Buf, factor: f32);
    /// Rounds the first `len` values to the nearest `kind` value (ties to even), keeping them
    /// as f32: mixed precision's half-precision tensors, in f32 buffers (see graph::Network).
    /// Nothing to do in a buffer that stores `kind` (`alloc_half`).
    fn round_to_half(&self, kind: HalfKind, buf: &mut Self::Buf, len: usize);
    /// One SGD update; `args` holds `SgdStep::args` (uploaded by the caller).
    /// `decays`: 1 where weight decay applies and 0 where not (None: everywhere).
    #[allow(clippy::too_many_arguments)]
    fn sgd_step(
        &self,
        out: UpdatedParams<'_, Self::Buf>,
        grads: &Self::Buf,
        momentum: &mut Self::Buf,
        h: &SgdStep,
        args: &Self::Buf,
        decays: Option<&Self::Buf>,
    );
    /// One Adam/AdamW update; `args` holds `AdamStep::args` (uploaded by the caller).
    /// `decays` as `sgd_step`'s.
    #[allow(clippy::too_many_arguments)]
    fn adam_step(
        &self,
        out: UpdatedParams<'_, Self::Buf>,
        grads: &Self::Buf,
        exp_avg: &mut Self::Buf,
        exp_avg_sq: &mut Self::Buf,
        h: &AdamStep,
        args: &Self::Buf,
        decays: Option<&Self::Buf>,
    );

    /// Data parallelism across processes, rank 0: a new id for a device-side collective
    /// (NCCL) that the ranks join with `join_collective`. None where this device has none
    /// (the CPU): gradients then travel through host memory and rank 0's links.
    fn collective_id(&self) -> Result<Option<Vec<u8>>> {
        Ok(None)
    }
    /// Joins rank 0's collective as `rank` of `world`; returns once every rank has joined.
    fn join_collective(&self, _id: &[u8], _rank: usize, _world: usize) -> Result<()> {
        Err(crate::error::Error::Runtime(format!(
            "{} has no device-side collective",
            self.describe()
        )))
    }
    /// Starts replacing `range` of `buf` by its mean over every rank's (after
    /// `join_collective`): queued after the ops before it, on a stream of its own, so that
    /// the ops queued after it (the rest of a backward pass) run meanwhile. They must not
    /// touch `range`; `all_reduce_wait` makes the ops after it wait for every average
    /// started.
    fn all_reduce_mean_start(&self, _buf: &mut Self::Buf, _range: std::ops::Range<usize>) {}
    fn all_reduce_wait(&self) {}
    /// Waits until everything queued, the all-reduces included, has run; an error if that
    /// takes longer than `timeout`: another rank is gone or stuck, and an all-reduce would
    /// wait for it forever. The communicator is then torn down, so that nothing queued
    /// waits any more.
    fn finish_collectives(&self, _timeout: std::time::Duration) -> Result<()> {
        Ok(())
    }

    /// The first failure of any op so far (devices report errors late); checked every step.
    fn status(&self) -> Result<()> {
        Ok(())
    }

    /// Device memory (allocated, peak) in bytes, for devices whose memory is not the host's.
    fn memory(&self) -> Option<(usize, usize)> {
        None
    }

    /// Waits until the device has done the work queued so far (nothing to wait for on the
    /// CPU, whose ops return when done): a profile times each op on its own.
    fn synchronize(&self) {}

    /// A mark for `set_mark` to place (made ahead: placing one allocates nothing).
    fn new_mark(&self) -> Result<Self::Mark>;

    /// Places `mark` after the work queued so far.
    fn set_mark(&self, mark: &mut Self::Mark);

    /// The device's time from one placed mark to a later one, once it has passed both
    /// (after `synchronize`).
    fn between(&self, from: &Self::Mark, to: &Self::Mark) -> std::time::Duration;
}
