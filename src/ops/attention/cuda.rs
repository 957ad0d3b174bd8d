//! attention on CUDA: heads split into the workspace, cuBLAS strided-batched products over
//! n × heads matrices, and the kernels of attention.cu for the masked softmax; or, with
//! `device.flash_attention`, flash.cu's kernels, which never store the T×T matrix.
//!
//! The workspace, for n samples (E = n·T·C values a part, P = n·H·T·T; every query head has
//! its own copy of its keys and values there, as PyTorch's `repeat_kv`):
//! [q | k | v | y or dy heads | dp | dq | dk | dv], at 0, E, 2E, 3E, 4E, 4E+P, 5E+P, 6E+P.
//! Every product reads what lies before the part it writes, except that with dropout the
//! kept probabilities wait in dp's place for the product before it.

use super::{Kernels, ProbsDropout, MAX_FLASH_HEAD_DIM};
use crate::tensor::cuda::{grid, per_item, storage_id, CudaBackend, CudaBuf, Launch};
use crate::tensor::{Attention as Shape, HalfKind, Matrices};
use cudarc::driver::LaunchConfig;

/// Workspace values for `max_batch` samples; with `flash`, each row's delta (flash.cu).
pub fn workspace_len(shape: &Shape, max_batch: usize) -> usize {
    match shape.flash {
        true => max_batch * shape.heads * shape.len,
        false => max_batch * (7 * shape.len * shape.width() + shape.probs_len()),
    }
}

/// n·heads matrices of [T, head_dim] at `offset`.
fn heads(shape: &Shape, offset: usize) -> Matrices {
    Matrices {
        offset,
        batch_stride: shape.len * shape.head_dim,
        row_stride: shape.head_dim,
        transposed: false,
    }
}

/// n·heads matrices of [T, T] at `offset`.
fn scores(shape: &Shape, offset: usize) -> Matrices {
    Matrices {
        offset,
        batch_stride: shape.len * shape.len,
        row_stride: shape.len,
        transposed: false,
    }
}

fn transposed(m: Matrices) -> Matrices {
    Matrices {
        transposed: true,
        ..m
    }
}

impl Kernels for CudaBackend {
    fn attention_workspace_len(&self, shape: &Shape, max_batch: usize) -> usize {
        workspace_len(shape, max_batch)
    }

    fn attention_forward(
        &self,
        qkv: &CudaBuf,
        y: &mut CudaBuf,
        probs: &mut CudaBuf,
        workspace: &mut CudaBuf,
        n: usize,
        s: &Shape,
        dropout: Option<ProbsDropout>,
    ) {
        if !self.all_f32("attention", &[probs, workspace]) {
            return;
        }
        if s.flash {
            return self.flash_forward(qkv, y, probs, n, s, dropout);
        }
        let (t, d, e, batch) = (s.len, s.head_dim, n * s.len * s.width(), n * s.heads);
        self.split(qkv, workspace, 0, n, s, 3);
        {
            let (w, mut p) = (workspace.mem.as_view(), probs.mem.as_view_mut());
            let operands = [(&w, heads(s, 0)), (&w, transposed(heads(s, e)))];
            let out = (&mut p, scores(s, 0));
            self.strided_gemm("attention scores", (t, t, d), batch, operands, out, false);
        }
        let (rows, t64, scale, causal) = (batch * t, t as u64, s.scale(), i32::from(s.causal));
        let rows64 = rows as u64;
        let mut l = Launch::new(self.stream(), self.kernel("attention_softmax"));
        l.arg(&mut probs.mem)
            .arg(&rows64)
            .arg(&t64)
            .arg(&scale)
            .arg(&causal);
        // SAFETY: one block per row of T scores.
        self.launch("attention softmax", unsafe { l.launch(per_item(rows)) });
        if let Some(dropout) = dropout {
            self.drop_probs(probs, workspace, 4 * e, n * s.probs_len(), dropout);
        }
        {
            let (front, mut back) = workspace.mem.split_at_mut(3 * e);
            let (mut y_heads, kept) = back.split_at_mut(e);
            let (front, p, kept) = (front.as_view(), probs.mem.as_view(), kept.as_view());
            let weights = if dropout.is_some() { &kept } else { &p };
            let operands = [(weights, scores(s, 0)), (&front, heads(s, 2 * e))];
            let out = (&mut y_heads, heads(s, 0));
            self.strided_gemm("attention output", (t, d, t), batch, operands, out, false);
        }
        self.merge(workspace, 3 * e, y, n, s, 1);
    }

    fn attention_backward(
        &self,
        qkv: &CudaBuf,
        probs: &CudaBuf,
        dy: &CudaBuf,
        dqkv: &mut CudaBuf,
        workspace: &mut CudaBuf,
        n: usize,
        s: &Shape,
        dropout: Option<ProbsDropout>,
    ) {
        if !self.all_f32("attention backward", &[probs, workspace]) {
            return;
        }
        if s.flash {
            return self.flash_backward(qkv, probs, dy, dqkv, workspace, n, s, dropout);
        }
        let (t, d, e, batch) = (s.len, s.head_dim, n * s.len * s.width(), n * s.heads);
        let (dp, dq) = (4 * e, 4 * e + n * s.probs_len());
        let (dk, dv) = (dq + e, dq + 2 * e);
        self.split(qkv, workspace, 0, n, s, 3);
        self.split(dy, workspace, 3 * e, n, s, 1);
        // Each product writes past what it reads in the workspace.
        if let Some(dropout) = dropout {
            self.drop_probs(probs, workspace, dp, n * s.probs_len(), dropout);
        }
        {
            // dv = pᵀ·dy, p the kept probabilities with dropout
            let (front, mut back) = workspace.mem.split_at_mut(dv);
            let (front, p) = (front.as_view(), probs.mem.as_view());
            let (weights, at) = match dropout {
                Some(_) => (&front, dp),
                None => (&p, 0),
            };
            let operands = [
                (weights, transposed(scores(s, at))),
                (&front, heads(s, 3 * e)),
            ];
            let out = (&mut back, heads(s, 0));
            self.strided_gemm("attention dv", (t, d, t), batch, operands, out, false);
        }
        {
            // dp = dy·vᵀ
            let (front, mut back) = workspace.mem.split_at_mut(dp);
            let front = front.as_view();
            let operands = [
                (&front, heads(s, 3 * e)),
                (&front, transposed(heads(s, 2 * e))),
            ];
            let out = (&mut back, scores(s, 0));
            self.strided_gemm("attention dp", (t, t, d), batch, operands, out, false);
        }
        let (rows, t64, scale) = (batch * t, t as u64, s.scale());
        let rows64 = rows as u64;
        {
            let d = dropout_args(dropout);
            let (_, mut ds) = workspace.mem.split_at_mut(dp);
            let mut l = Launch::new(self.stream(), self.kernel("attention_softmax_backward"));
            l.arg(&probs.mem)
                .arg(&mut ds)
                .arg(&rows64)
                .arg(&t64)
                .arg(&scale)
                .arg(&d.p)
                .arg(&d.key)
                .arg(&d.first);
            // SAFETY: one block per row of T values.
            self.launch("attention softmax backward", unsafe {
                l.launch(per_item(rows))
            });
        }
        // dq = ds·k, dk = dsᵀ·q
        let products = [
            ("attention dq", scores(s, dp), heads(s, e), dq),
            ("attention dk", transposed(scores(s, dp)), heads(s, 0), dk),
        ];
        for (what, a, b, c) in products {
            let (front, mut back) = workspace.mem.split_at_mut(c);
            let front = front.as_view();
            let out = (&mut back, heads(s, 0));
            self.strided_gemm(
                what,
                (t, d, t),
                batch,
                [(&front, a), (&front, b)],
                out,
                false,
            );
        }
        self.merge(workspace, dq, dqkv, n, s, 3);
    }
}

/// flash.cu's launch: a block for each of a sample's `heads` heads' FLASH_ROWS rows (query
/// heads, or key and value heads for dk and dv), of FLASH_ROWS threads (a row each), or with
/// tensor cores of four warps (16 rows each).
fn flash_blocks(n: usize, heads: usize, s: &Shape, tensor_cores: bool) -> LaunchConfig {
    const FLASH_ROWS: usize = 64;
    LaunchConfig {
        grid_dim: ((n * heads * s.len.div_ceil(FLASH_ROWS)) as u32, 1, 1),
        block_dim: (if tensor_cores { 128 } else { FLASH_ROWS as u32 }, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The flash kernel `name` for the narrowest head width that holds `head_dim`: flash.cu's,
/// or with tensor cores flash_mma.cu's.
fn flash_kernel(name: &str, head_dim: usize, tensor_cores: bool) -> String {
    let width = [32, 64, 128].into_iter().find(|&w| head_dim <= w);
    let name = match tensor_cores {
        true => name.replacen("flash_", "flash_mma_", 1),
        false => name.to_string(),
    };
    format!("{name}_{}", width.unwrap_or(MAX_FLASH_HEAD_DIM))
}

/// Dropout's arguments: p = 0 keeps every probability.
fn dropout_args(d: Option<ProbsDropout>) -> ProbsDropout {
    d.unwrap_or(ProbsDropout {
        p: 0.0,
        key: 0,
        first: 0,
    })
}

impl CudaBackend {
    /// Whether flash attention runs on tensor cores (flash_mma.cu): with bf16 activations,
    /// heads a multiple of 8 wide, on compute capability 8.0 or later. Otherwise flash.cu's
    /// kernels compute in f32.
    fn flash_on_tensor_cores(&self, qkv: &CudaBuf, s: &Shape) -> bool {
        qkv.storage() == storage_id(Some(HalfKind::Bf16))
            && s.head_dim.is_multiple_of(8)
            && self.compute_capability().0 >= 8
    }

    /// y and `saved` (outputs, then log-sum-exps) from qkv, in one kernel.
    fn flash_forward(
        &self,
        qkv: &CudaBuf,
        y: &mut CudaBuf,
        saved: &mut CudaBuf,
        n: usize,
        s: &Shape,
        dropout: Option<ProbsDropout>,
    ) {
        let (xs, ys, d) = (qkv.storage(), y.storage(), dropout_args(dropout));
        let [n64, t, h, g, hd] = [n, s.len, s.heads, s.kv_heads, s.head_dim].map(|v| v as u64);
        let (scale, causal) = (s.scale(), i32::from(s.causal));
        let tensor_cores = self.flash_on_tensor_cores(qkv, s);
        let name = flash_kernel("flash_forward", s.head_dim, tensor_cores);
        let mut l = Launch::new(self.stream(), self.kernel(&name));
        l.arg(&qkv.mem).arg(&xs).arg(&mut y.mem).arg(&ys);
        l.arg(&mut saved.mem)
            .arg(&n64)
            .arg(&t)
            .arg(&h)
            .arg(&g)
            .arg(&hd);
        l.arg(&scale)
            .arg(&causal)
            .arg(&d.p)
            .arg(&d.key)
            .arg(&d.first);
        // SAFETY: the blocks and threads the kernel's file lays out.
        let blocks = flash_blocks(n, s.heads, s, tensor_cores);
        self.launch("flash attention", unsafe { l.launch(blocks) });
    }

    /// dqkv from dy and what `flash_forward` saved: the rows' deltas into the workspace,
    /// then dk and dv, then dq.
    #[allow(clippy::too_many_arguments)]
    fn flash_backward(
        &self,
        qkv: &CudaBuf,
        saved: &CudaBuf,
        dy: &CudaBuf,
        dqkv: &mut CudaBuf,
        workspace: &mut CudaBuf,
        n: usize,
        s: &Shape,
        dropout: Option<ProbsDropout>,
    ) {
        let (xs, dys, dxs, d) = (
            qkv.storage(),
            dy.storage(),
            dqkv.storage(),
            dropout_args(dropout),
        );
        let [n64, t, h, g, hd] = [n, s.len, s.heads, s.kv_heads, s.head_dim].map(|v| v as u64);
        let (scale, causal) = (s.scale(), i32::from(s.causal));
        let mut l = Launch::new(self.stream(), self.kernel("flash_backward_delta"));
        l.arg(&dy.mem)
            .arg(&dys)
            .arg(&saved.mem)
            .arg(&mut workspace.mem);
        l.arg(&n64).arg(&t).arg(&h).arg(&hd);
        // SAFETY: grid-stride over the n·H·T rows.
        self.launch("flash attention delta", unsafe {
            l.launch(grid(n * s.heads * s.len))
        });
        let tensor_cores = self.flash_on_tensor_cores(qkv, s);
        for (name, heads) in [
            ("flash_backward_kv", s.kv_heads),
            ("flash_backward_q", s.heads),
        ] {
            let kernel = flash_kernel(name, s.head_dim, tensor_cores);
            let mut l = Launch::new(self.stream(), self.kernel(&kernel));
            l.arg(&qkv.mem).arg(&xs).arg(&dy.mem).arg(&dys);
            l.arg(&saved.mem)
                .arg(&workspace.mem)
                .arg(&mut dqkv.mem)
                .arg(&dxs);
            l.arg(&n64).arg(&t).arg(&h).arg(&g).arg(&hd);
            l.arg(&scale)
                .arg(&causal)
                .arg(&d.p)
                .arg(&d.key)
                .arg(&d.first);
            // SAFETY: the blocks and threads the kernel's file lays out; the two write
            // dqkv's disjoint parts (k and v, then q).
            let blocks = flash_blocks(n, heads, s, tensor_cores);
            self.launch("flash attention backward", unsafe { l.launch(blocks) });
        }
    }

    /// The kept probabilities, p ∘ mask / (1 − p), into the workspace at `at`.
    fn drop_probs(&self, p: &CudaBuf, w: &mut CudaBuf, at: usize, len: usize, d: ProbsDropout) {
        let (at, len64) = (at as u64, len as u64);
        let mut l = Launch::new(self.stream(), self.kernel("attention_dropout"));
        l.arg(&p.mem).arg(&mut w.mem).arg(&at).arg(&len64);
        l.arg(&d.p).arg(&d.key).arg(&d.first);
        // SAFETY: grid-stride over the len probabilities.
        self.launch("attention dropout", unsafe { l.launch(grid(len)) });
    }

    /// The heads of x's rows (qkv with `parts` 3, dy with 1) into the workspace at `at`, as
    /// `parts` parts of n·H matrices [T, hd]: each query head with its own keys and values.
    fn split(&self, x: &CudaBuf, w: &mut CudaBuf, at: usize, n: usize, s: &Shape, parts: usize) {
        let xs = x.storage();
        let [at, n64, t, h, g, d, p] =
            [at, n, s.len, s.heads, s.kv_heads, s.head_dim, parts].map(|v| v as u64);
        let mut l = Launch::new(self.stream(), self.kernel("attention_split"));
        l.arg(&x.mem).arg(&xs).arg(&mut w.mem).arg(&at);
        l.arg(&n64).arg(&t).arg(&h).arg(&g).arg(&d).arg(&p);
        // SAFETY: grid-stride over the workspace's n·T·parts·C values.
        let len = n * s.len * s.width() * parts;
        self.launch("attention split", unsafe { l.launch(grid(len)) });
    }

    /// The inverse of `split`: heads at `at` in the workspace into y's rows, a key or value
    /// head the sum of its query heads' copies.
    fn merge(&self, w: &CudaBuf, at: usize, y: &mut CudaBuf, n: usize, s: &Shape, parts: usize) {
        let ys = y.storage();
        let [at, n64, t, h, g, d, p] =
            [at, n, s.len, s.heads, s.kv_heads, s.head_dim, parts].map(|v| v as u64);
        let mut l = Launch::new(self.stream(), self.kernel("attention_merge"));
        l.arg(&w.mem).arg(&at).arg(&mut y.mem).arg(&ys);
        l.arg(&n64).arg(&t).arg(&h).arg(&g).arg(&d).arg(&p);
        // SAFETY: grid-stride over y's n·T rows.
        let row = if parts == 3 { s.qkv_width() } else { s.width() };
        self.launch("attention merge", unsafe {
            l.launch(grid(n * s.len * row))
        });
    }
}
