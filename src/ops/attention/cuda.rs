//! attention on CUDA: heads split into the workspace, cuBLAS strided-batched products over
//! n × heads matrices, and the kernels of attention.cu for the masked softmax.
//!
//! The workspace, for n samples (E = n·T·C values a part, P = n·H·T·T):
//! [q | k | v | y or dy heads | dp | dq | dk | dv], at 0, E, 2E, 3E, 4E, 4E+P, 5E+P, 6E+P.
//! Every product reads what lies before the part it writes, except that with dropout the
//! kept probabilities wait in dp's place for the product before it.

use super::{Kernels, ProbsDropout};
use crate::tensor::cuda::{grid, per_item, CudaBackend, CudaBuf, Launch};
use crate::tensor::{Attention as Shape, Matrices};

/// Workspace values for `max_batch` samples.
pub fn workspace_len(shape: &Shape, max_batch: usize) -> usize {
    max_batch * (7 * shape.len * shape.width() + shape.probs_len())
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
            // p = 0 keeps every probability: no dropout.
            let d = dropout.unwrap_or(ProbsDropout {
                p: 0.0,
                key: 0,
                first: 0,
            });
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

impl CudaBackend {
    /// The kept probabilities, p ∘ mask / (1 − p), into the workspace at `at`.
    fn drop_probs(&self, p: &CudaBuf, w: &mut CudaBuf, at: usize, len: usize, d: ProbsDropout) {
        let (at, len64) = (at as u64, len as u64);
        let mut l = Launch::new(self.stream(), self.kernel("attention_dropout"));
        l.arg(&p.mem).arg(&mut w.mem).arg(&at).arg(&len64);
        l.arg(&d.p).arg(&d.key).arg(&d.first);
        // SAFETY: grid-stride over the len probabilities.
        self.launch("attention dropout", unsafe { l.launch(grid(len)) });
    }

    /// `parts` parts of x's rows ([n, T, parts, H, hd]) as heads into the workspace at `at`.
    fn split(&self, x: &CudaBuf, w: &mut CudaBuf, at: usize, n: usize, s: &Shape, parts: usize) {
        let xs = x.storage();
        let [at, n64, t, h, d, p] = [at, n, s.len, s.heads, s.head_dim, parts].map(|v| v as u64);
        let mut l = Launch::new(self.stream(), self.kernel("attention_split"));
        l.arg(&x.mem).arg(&xs).arg(&mut w.mem).arg(&at);
        l.arg(&n64).arg(&t).arg(&h).arg(&d).arg(&p);
        // SAFETY: grid-stride over the n·T·parts·C values.
        let len = n * s.len * s.width() * parts;
        self.launch("attention split", unsafe { l.launch(grid(len)) });
    }

    /// The inverse of `split`: heads at `at` in the workspace into y's rows.
    fn merge(&self, w: &CudaBuf, at: usize, y: &mut CudaBuf, n: usize, s: &Shape, parts: usize) {
        let ys = y.storage();
        let [at, n64, t, h, d, p] = [at, n, s.len, s.heads, s.head_dim, parts].map(|v| v as u64);
        let mut l = Launch::new(self.stream(), self.kernel("attention_merge"));
        l.arg(&w.mem).arg(&at).arg(&mut y.mem).arg(&ys);
        l.arg(&n64).arg(&t).arg(&h).arg(&d).arg(&p);
        // SAFETY: grid-stride over the n·T·parts·C values.
        let len = n * s.len * s.width() * parts;
        self.launch("attention merge", unsafe { l.launch(grid(len)) });
    }
}
