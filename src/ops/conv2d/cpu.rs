//! conv2d on the CPU (NCHW): im2col + GEMM, forward and backward, with PyTorch's zero
//! padding.
//!
//! Convolution runs samples in parallel, each thread with its own im2col scratch (a slice of
//! the caller's workspace, `conv_workspace_len` long), so nothing is allocated per step. With
//! one group, im2col unrolls only the kernel's columns and the GEMMs read each kernel row's
//! rows as a window of that matrix (`Conv2d::im2col_rows`); the input gradient of a
//! size-keeping convolution is itself a convolution (`Conv2d::input_gradient_conv`).

use super::{conv_rows, row_dots, Kernels};
use crate::tensor::cpu::CpuBackend;
use crate::tensor::matmul::matmul;
use crate::tensor::{Conv2d, GradWrite};
use rayon::prelude::*;

impl Kernels for CpuBackend {
    fn conv_workspace_len(&self, s: &Conv2d, max_batch: usize) -> usize {
        conv_workspace_len(s, self.threads(), max_batch)
    }

    fn conv2d_forward(
        &self,
        s: &Conv2d,
        x: &Vec<f32>,
        params: &Vec<f32>,
        w: usize,
        b: Option<usize>,
        y: &mut Vec<f32>,
        n: usize,
        workspace: &mut Vec<f32>,
    ) {
        let weight = &params[w..w + s.weight_len()];
        let bias = b.map(|b| &params[b..b + s.o]);
        conv2d_forward(s, x, weight, bias, y, n, workspace);
    }

    fn conv2d_backward(
        &self,
        s: &Conv2d,
        x: &Vec<f32>,
        dy: &Vec<f32>,
        params: &Vec<f32>,
        grads: &mut Vec<f32>,
        dw_write: GradWrite,
        w: usize,
        b: Option<usize>,
        dx: Option<&mut Vec<f32>>,
        n: usize,
        workspace: &mut Vec<f32>,
    ) {
        let weight = &params[w..w + s.weight_len()];
        // The bias follows the weight in the flat buffer (see graph::Graph::build).
        let (dw, rest) = grads[w..].split_at_mut(s.weight_len());
        let mut db = b.map(|b| &mut rest[b - w - s.weight_len()..][..s.o]);
        if dw_write == GradWrite::Overwrite {
            // The sums are added into them (a conv's parameters are few: no gain in more).
            dw.fill(0.0);
            if let Some(db) = db.as_deref_mut() {
                db.fill(0.0);
            }
        }
        conv2d_backward(
            s,
            x,
            weight,
            dy,
            dw,
            db,
            dx.map(|d| &mut d[..]),
            n,
            workspace,
        );
    }
}

impl Conv2d {
    /// The convolution whose forward pass is this one's input gradient, where im2col can run
    /// it: stride 1, one group, and padding that keeps the size ((k - 1)·d = 2·pad both ways).
    /// Then dx = conv(dy, W with in and out channels swapped and the kernel flipped): one GEMM
    /// with K = o·kh·kw that writes dx once, instead of a GEMM with K = o writing the
    /// c·kh·kw-row im2col matrix and col2im adding its rows into dx (twice the time).
    fn input_gradient_conv(&self) -> Option<Conv2d> {
        let keeps_size = |k: usize, d: usize, pad: usize| (k - 1) * d == 2 * pad;
        let usable = self.stride == (1, 1)
            && self.groups == 1
            && keeps_size(self.kh, self.dil.0, self.pad.0)
            && keeps_size(self.kw, self.dil.1, self.pad.1);
        usable.then_some(Conv2d {
            c: self.o,
            o: self.c,
            ..*self
        })
    }

    /// One group: then im2col need unroll only the kernel's columns (`im2col_rows`), and each
    /// kernel row's im2col rows are a window of that matrix, which the GEMM reads in place.
    fn unrolls_rows(&self) -> bool {
        self.groups == 1
    }

    /// Rows of each phase of `im2col_rows`'s matrix: the padded input's rows, dealt into
    /// `stride.0` phases.
    fn phase_rows(&self) -> usize {
        (self.h + 2 * self.pad.0).div_ceil(self.stride.0)
    }

    /// One row of `im2col_rows`'s matrix: every phase's rows of `ow` values.
    fn unrolled_row_len(&self) -> usize {
        self.stride.0 * self.phase_rows() * self.oh_ow().1
    }

    /// Where kernel row ki's window starts in each row of `im2col_rows`'s matrix: output row
    /// p reads padded row p·stride + ki·dil, which is row p + ⌊ki·dil / stride⌋ of phase
    /// ki·dil mod stride, so the oh·ow values from there are the window.
    fn window_start(&self, ki: usize) -> usize {
        let (r, stride) = (ki * self.dil.0, self.stride.0);
        ((r % stride) * self.phase_rows() + r / stride) * self.oh_ow().1
    }

    /// Scratch one sample's im2col takes.
    fn scratch_len(&self) -> usize {
        if self.unrolls_rows() {
            self.c * self.kw * self.unrolled_row_len()
        } else {
            self.col_len()
        }
    }

    /// The rows of phase φ of `im2col_rows`'s matrix that some window reads: from the first
    /// window start to the last window's end among the kernel rows of that phase (none: a
    /// strided 1x1 convolution reads one phase of its input's rows).
    fn phase_rows_read(&self, phase: usize) -> std::ops::Range<usize> {
        let (oh, stride) = (self.oh_ow().0, self.stride.0);
        let starts = (0..self.kh)
            .map(|ki| ki * self.dil.0)
            .filter(|r| r % stride == phase)
            .map(|r| r / stride);
        match (starts.clone().min(), starts.max()) {
            (Some(first), Some(last)) => first..last + oh,
            _ => 0..0,
        }
    }

    /// cols[(ci, kj), r, q] = x[ci, r - pad.0, q·stride.1 + kj·dil.1 - pad.1] (0 outside the
    /// input) for every padded row r, stored at row r / stride.0 of phase r mod stride.0:
    /// the input unrolled over the kernel's columns only. Kernel row ki's im2col matrix is
    /// then a window of every row of this one (`window_start`): a third of im2col's copying
    /// for a 3x3 kernel (which was a quarter of a ResNet step).
    fn im2col_rows(&self, x: &[f32], cols: &mut [f32]) {
        let (w, plane) = (self.w, self.h * self.w);
        let (_, ow) = self.oh_ow();
        let (len, phase_rows) = (self.unrolled_row_len(), self.phase_rows());
        let whole_planes = self.stride == (1, 1) && ow == w;
        for (ci, src) in x.chunks_exact(plane).take(self.c).enumerate() {
            for kj in 0..self.kw {
                let out = &mut cols[(ci * self.kw + kj) * len..][..len];
                if whole_planes {
                    self.shifted_plane(src, kj, out);
                    continue;
                }
                let (valid, offset) = self.valid_columns(kj, ow);
                let rows = (0..self.stride.0).flat_map(|phase| {
                    let read = self.phase_rows_read(phase);
                    read.map(move |a| (phase * phase_rows + a, a * self.stride.0 + phase))
                });
                for (at, r) in rows {
                    let dst = &mut out[at * ow..(at + 1) * ow];
                    let i = r as isize - self.pad.0 as isize;
                    if i < 0 || i >= self.h as isize || valid.is_empty() {
                        zero(dst);
                        continue;
                    }
                    let row = &src[i as usize * w..(i as usize + 1) * w];
                    zero(&mut dst[..valid.start]);
                    zero(&mut dst[valid.end..]);
                    let first = (valid.start as isize * self.stride.1 as isize + offset) as usize;
                    let (row, step) = (&row[first..], self.stride.1);
                    if step == 2 {
                        // Pairs, so that LLVM vectorises the gather (the usual downsampling).
                        for (d, pair) in dst[valid.clone()].iter_mut().zip(row.chunks(2)) {
                            *d = pair[0];
                        }
                    } else {
                        for (k, d) in dst[valid.clone()].iter_mut().enumerate() {
                            *d = row[k * step];
                        }
                    }
                }
            }
        }
    }

    /// `im2col_rows` of one plane and kernel column for stride 1 and an output as wide as the
    /// input: the padded plane shifted by kj·dil - pad.1 columns, one contiguous copy.
    fn shifted_plane(&self, src: &[f32], kj: usize, out: &mut [f32]) {
        let (w, plane, top) = (self.w, self.h * self.w, self.pad.0 * self.w);
        out[..top].fill(0.0);
        out[top + plane..].fill(0.0);
        let body = &mut out[top..top + plane];
        let dj = (kj * self.dil.1) as isize - self.pad.1 as isize;
        let shift = dj.unsigned_abs();
        if shift >= w {
            body.fill(0.0);
            return;
        }
        // body[t] = src[t + dj]: the values that wrap into the neighbouring row (and the
        // `shift` values no source covers) lie in the invalid columns zeroed below.
        let invalid = if dj >= 0 {
            body[..plane - shift].copy_from_slice(&src[shift..]);
            w - shift..w
        } else {
            body[shift..].copy_from_slice(&src[..plane - shift]);
            0..shift
        };
        for row in body.chunks_exact_mut(w) {
            zero(&mut row[invalid.clone()]);
        }
    }

    /// W[o, c, ki, kj] as [ki][o, c, kj]: kernel row ki's GEMM operand for `im2col_rows`.
    fn weights_by_kernel_row(&self, w: &[f32], by_row: &mut [f32]) {
        let (c, kh, kw) = (self.c, self.kh, self.kw);
        for (o, w_o) in w.chunks_exact(c * kh * kw).take(self.o).enumerate() {
            for (ci, w_oc) in w_o.chunks_exact(kh * kw).enumerate() {
                for (ki, src) in w_oc.chunks_exact(kw).enumerate() {
                    by_row[((ki * self.o + o) * c + ci) * kw..][..kw].copy_from_slice(src);
                }
            }
        }
    }

    /// dW[o, c, ki, kj] += by_row[ki][o, c, kj]: the adjoint layout change.
    fn add_from_kernel_rows(&self, by_row: &[f32], dw: &mut [f32]) {
        let (c, kh, kw) = (self.c, self.kh, self.kw);
        for (o, dw_o) in dw.chunks_exact_mut(c * kh * kw).take(self.o).enumerate() {
            for (ci, dw_oc) in dw_o.chunks_exact_mut(kh * kw).enumerate() {
                for (ki, dst) in dw_oc.chunks_exact_mut(kw).enumerate() {
                    let src = &by_row[((ki * self.o + o) * c + ci) * kw..][..kw];
                    for (d, v) in dst.iter_mut().zip(src) {
                        *d += v;
                    }
                }
            }
        }
    }

    /// W[o, c, ki, kj] as the weights of `input_gradient_conv`: [c, o, kh-1-ki, kw-1-kj].
    fn flip_weights(&self, w: &[f32], flipped: &mut [f32]) {
        let area = self.kh * self.kw;
        for o in 0..self.o {
            for c in 0..self.c {
                let src = &w[(o * self.c + c) * area..][..area];
                let dst = &mut flipped[(c * self.o + o) * area..][..area];
                for (d, s) in dst.iter_mut().zip(src.iter().rev()) {
                    *d = *s;
                }
            }
        }
    }

    /// The output columns q whose input column q·stride - pad + kj·dil lies inside [0, w),
    /// and that input column for q = 0 (possibly negative).
    #[inline]
    fn valid_columns(&self, kj: usize, ow: usize) -> (std::ops::Range<usize>, isize) {
        let (stride, offset) = (
            self.stride.1 as isize,
            (kj * self.dil.1) as isize - self.pad.1 as isize,
        );
        // q·stride + offset >= 0  and  q·stride + offset < w
        let lo = if offset >= 0 {
            0
        } else {
            ((-offset + stride - 1) / stride) as usize
        };
        let hi = if (self.w as isize) <= offset {
            0
        } else {
            ((self.w as isize - offset + stride - 1) / stride) as usize
        };
        (lo.min(ow)..hi.min(ow).max(lo.min(ow)), offset)
    }

    /// col[(ci, ki, kj), (p, q)] = x[ci, p·s - pad + ki·d, q·s - pad + kj·d] (0 outside).
    fn im2col(&self, x: &[f32], col: &mut [f32]) {
        let (oh, ow) = self.oh_ow();
        if self.is_plane_shift() {
            let plane_len = self.h * self.w;
            for (ki, kj, shift) in self.plane_shifts() {
                for (ci, plane) in x.chunks_exact(plane_len).take(self.c).enumerate() {
                    let row = (ci * self.kh + ki) * self.kw + kj;
                    shift.copy(plane, &mut col[row * oh * ow..(row + 1) * oh * ow]);
                }
            }
            return;
        }
        let mut row = 0;
        for ci in 0..self.c {
            let plane = &x[ci * self.h * self.w..(ci + 1) * self.h * self.w];
            for ki in 0..self.kh {
                for kj in 0..self.kw {
                    let out = &mut col[row * oh * ow..(row + 1) * oh * ow];
                    let (valid, offset) = self.valid_columns(kj, ow);
                    for p in 0..oh {
                        let i =
                            (p * self.stride.0 + ki * self.dil.0) as isize - self.pad.0 as isize;
                        // Rows are short (a strided convolution's output): zeros by single
                        // stores, since a `fill` is a memset call.
                        let dst = &mut out[p * ow..(p + 1) * ow];
                        if i < 0 || i >= self.h as isize || valid.is_empty() {
                            zero(dst);
                            continue;
                        }
                        let src = &plane[i as usize * self.w..(i as usize + 1) * self.w];
                        zero(&mut dst[..valid.start]);
                        zero(&mut dst[valid.end..]);
                        let first =
                            (valid.start as isize * self.stride.1 as isize + offset) as usize;
                        let (src, stride) = (&src[first..], self.stride.1);
                        for (k, d) in dst[valid.clone()].iter_mut().enumerate() {
                            *d = src[k * stride];
                        }
                    }
                    row += 1;
                }
            }
        }
    }

    /// Stride 1 and an output as wide as the input (padding (k - 1)·d / 2, the usual 3x3
    /// "same" convolution): then an im2col row is the whole input plane shifted by
    /// (ki·d - pad) rows and (kj·d - pad) columns, so it is one contiguous copy plus zeros
    /// for the rows and columns that fall outside, instead of a short copy per output row.
    fn is_plane_shift(&self) -> bool {
        self.stride == (1, 1) && self.oh_ow().1 == self.w
    }

    /// How im2col row (ki, kj) maps onto its input plane, for `is_plane_shift` geometries.
    fn plane_shift(&self, ki: usize, kj: usize) -> PlaneShift {
        let (oh, w) = (self.oh_ow().0 as isize, self.w as isize);
        let di = (ki * self.dil.0) as isize - self.pad.0 as isize;
        let dj = (kj * self.dil.1) as isize - self.pad.1 as isize;
        // Output rows p whose input row p + di exists.
        let (p_lo, p_hi) = ((-di).clamp(0, oh), (self.h as isize - di).clamp(0, oh));
        let (lo, hi) = ((p_lo * w) as usize, (p_hi.max(p_lo) * w) as usize);
        // Within them, out[t] = plane[t + shift] wherever that source exists; the t it
        // cannot cover lie in invalid columns.
        let shift = di * w + dj;
        let plane_len = (self.h * self.w) as isize;
        let first = ((lo as isize).max(-shift) as usize).min(hi);
        let last = ((hi as isize).min(plane_len - shift).max(first as isize)) as usize;
        PlaneShift {
            rows: lo..hi,
            covered: first..last,
            // (Nothing covered: no source, e.g. a one-row plane's out-of-range kernel row.)
            source: if first < last {
                (first as isize + shift) as usize
            } else {
                0
            },
            // Output columns q whose input column q + dj exists.
            columns: (-dj).clamp(0, w) as usize..(w - dj).clamp(0, w) as usize,
            width: self.w,
        }
    }

    /// `plane_shift` for every (ki, kj), in im2col's order.
    fn plane_shifts(&self) -> impl Iterator<Item = (usize, usize, PlaneShift)> + '_ {
        (0..self.kh)
            .flat_map(move |ki| (0..self.kw).map(move |kj| (ki, kj, self.plane_shift(ki, kj))))
    }

    /// The adjoint of im2col: adds every column entry back into its input position. `col` is
    /// scratch: entries that map outside the input may be overwritten.
    fn col2im(&self, col: &mut [f32], dx: &mut [f32]) {
        let (oh, ow) = self.oh_ow();
        if self.is_plane_shift() {
            // Each input plane receives its rows in im2col's (ki, kj) order, as below.
            let plane_len = self.h * self.w;
            for (ki, kj, shift) in self.plane_shifts() {
                for (ci, plane) in dx.chunks_exact_mut(plane_len).take(self.c).enumerate() {
                    let row = (ci * self.kh + ki) * self.kw + kj;
                    shift.add(&mut col[row * oh * ow..(row + 1) * oh * ow], plane);
                }
            }
            return;
        }
        let mut row = 0;
        for ci in 0..self.c {
            let plane = &mut dx[ci * self.h * self.w..(ci + 1) * self.h * self.w];
            for ki in 0..self.kh {
                for kj in 0..self.kw {
                    let src = &col[row * oh * ow..(row + 1) * oh * ow];
                    let (valid, offset) = self.valid_columns(kj, ow);
                    row += 1;
                    if valid.is_empty() {
                        continue;
                    }
                    let first = (valid.start as isize * self.stride.1 as isize + offset) as usize;
                    for p in 0..oh {
                        let i =
                            (p * self.stride.0 + ki * self.dil.0) as isize - self.pad.0 as isize;
                        if i < 0 || i >= self.h as isize {
                            continue;
                        }
                        let dst = &mut plane[i as usize * self.w..(i as usize + 1) * self.w];
                        let values = &src[p * ow + valid.start..p * ow + valid.end];
                        if self.stride.1 == 1 {
                            for (d, v) in dst[first..first + values.len()].iter_mut().zip(values) {
                                *d += v;
                            }
                        } else {
                            for (j, v) in (first..).step_by(self.stride.1).zip(values) {
                                dst[j] += v;
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Sets a few values to zero with plain stores (no memset call).
fn zero(values: &mut [f32]) {
    for v in values {
        *v = 0.0;
    }
}

/// im2col row (ki, kj) of a plane-shift geometry (`Conv2d::is_plane_shift`) against its input
/// plane: entries `covered` are plane[source..], the other entries of `rows` and everything
/// outside `rows` are zeros, as are the entries of invalid `columns` (in every row).
struct PlaneShift {
    rows: std::ops::Range<usize>,
    covered: std::ops::Range<usize>,
    source: usize,
    columns: std::ops::Range<usize>,
    width: usize,
}

impl PlaneShift {
    /// The im2col row of one input plane.
    fn copy(&self, plane: &[f32], out: &mut [f32]) {
        out[..self.rows.start].fill(0.0);
        out[self.rows.end..].fill(0.0);
        let n = self.covered.len();
        out[self.covered.clone()].copy_from_slice(&plane[self.source..self.source + n]);
        out[self.rows.start..self.covered.start].fill(0.0);
        out[self.covered.end..self.rows.end].fill(0.0);
        self.zero_invalid_columns(&mut out[self.rows.clone()]);
    }

    /// The adjoint of `copy`: adds the im2col row back into the input plane in one pass over
    /// its valid rows, after zeroing its entries of invalid columns (which that pass adds
    /// into neighbouring positions). The same additions, in the same order, as row by row.
    fn add(&self, src: &mut [f32], plane: &mut [f32]) {
        self.zero_invalid_columns(&mut src[self.rows.clone()]);
        let n = self.covered.len();
        for (d, v) in plane[self.source..self.source + n]
            .iter_mut()
            .zip(&src[self.covered.clone()])
        {
            *d += v;
        }
    }

    /// Zeroes the entries of output columns whose input column lies outside the plane. Those
    /// are a padding's width at one edge of each row, so single stores: a `fill` per row
    /// would be two memset calls for a value or two (they took 5% of a ResNet step).
    fn zero_invalid_columns(&self, rows: &mut [f32]) {
        for row in rows.chunks_exact_mut(self.width) {
            zero(&mut row[..self.columns.start]);
            zero(&mut row[self.columns.end..]);
        }
    }
}

/// Scratch the convolution of `threads` threads needs.
pub fn conv_workspace_len(s: &Conv2d, threads: usize, max_batch: usize) -> usize {
    let chunks = max_batch.div_ceil(DW_CHUNK);
    let slots = threads.max(chunks).max(1);
    // One sample's scratch: the forward pass's (and dW's); dx's, as a convolution of dy or
    // through col2im, which needs the whole im2col matrix.
    let dx = match s.input_gradient_conv() {
        Some(t) => t.scratch_len(),
        None => s.col_len(),
    };
    let scratch = s.scratch_len().max(dx);
    // [flipped weights | dW partials per chunk | weights by kernel row | scratch per slot]
    (chunks + 2) * s.weight_len() + slots * scratch
}

/// Samples whose weight gradients one task sums: the batch is cut into chunks of this size
/// (not into one run per thread), so the order of the sum, and the result, does not depend on
/// the number of threads (a resumed run may use another `train.threads`).
const DW_CHUNK: usize = 16;

/// Runs `f(sample, its output, scratch)` for the first `n` samples of `out` (`out_len` values
/// each), in parallel: each thread takes a contiguous run of samples and a `scratch_len` slot
/// of the workspace.
fn each_sample(
    out: &mut [f32],
    out_len: usize,
    n: usize,
    workspace: &mut [f32],
    scratch_len: usize,
    f: impl Fn(usize, &mut [f32], &mut [f32]) + Sync,
) {
    let slots = (workspace.len() / scratch_len.max(1)).max(1);
    let per = n.div_ceil(slots).max(1);
    out[..n * out_len]
        .par_chunks_mut(per * out_len)
        .zip(workspace.par_chunks_mut(scratch_len.max(1)))
        .enumerate()
        .for_each(|(t, (outs, scratch))| {
            for (j, out_n) in outs.chunks_mut(out_len).enumerate() {
                f(t * per + j, out_n, scratch);
            }
        });
}

/// Sets every output plane to its channel's bias (the GEMMs then add to it).
fn fill_bias(y: &mut [f32], b: Option<&[f32]>, plane: usize) {
    if let Some(b) = b {
        for (out, &bias) in y.chunks_mut(plane).zip(b) {
            out.fill(bias);
        }
    }
}

/// Kernel heights `conv_rows` takes (taller kernels go through the general GEMM).
const MAX_KERNEL_ROWS: usize = 16;

/// y[n, o, oh, ow] = conv(x[n, c, h, w], W[o, c/g, kh, kw]) + b. Where the input is
/// unrolled by kernel rows, the products are `conv_rows`'s one pass (on AVX-512), else a
/// bias fill and one GEMM per kernel row.
#[allow(clippy::too_many_arguments)]
pub fn conv2d_forward(
    s: &Conv2d,
    x: &[f32],
    w: &[f32],
    b: Option<&[f32]>,
    y: &mut [f32],
    n: usize,
    workspace: &mut [f32],
) {
    let (oh, ow) = s.oh_ow();
    let (in_len, out_len) = (s.c * s.h * s.w, s.o * oh * ow);
    if s.unrolls_rows() {
        // y += W[ki] · (kernel row ki's window of the unrolled input), for every ki.
        let (by_row, workspace) = workspace.split_at_mut(s.weight_len());
        s.weights_by_kernel_row(w, by_row);
        let (k, len) = (s.c * s.kw, s.unrolled_row_len());
        // The kernel rows' windows, for `conv_rows` (on the stack: the step allocates nothing).
        let mut starts = [0usize; MAX_KERNEL_ROWS];
        for (ki, start) in starts.iter_mut().enumerate().take(s.kh) {
            *start = s.window_start(ki);
        }
        let starts = &starts[..s.kh.min(MAX_KERNEL_ROWS)];
        each_sample(y, out_len, n, workspace, s.scratch_len(), |i, y_n, cols| {
            s.im2col_rows(&x[i * in_len..(i + 1) * in_len], cols);
            let shape = (s.o, oh * ow, k);
            if s.kh <= MAX_KERNEL_ROWS
                && conv_rows::conv_rows(y_n, oh * ow, b, by_row, cols, starts, len, shape)
            {
                return;
            }
            fill_bias(y_n, b, oh * ow);
            for (ki, w_ki) in by_row.chunks_exact(s.o * k).enumerate() {
                let window = &cols[s.window_start(ki)..];
                let add = b.is_some() || ki > 0;
                serial_matmul(y_n, add, w_ki, (k, 1), window, (len, 1), s.o, oh * ow, k);
            }
        });
        return;
    }
    let (og, rows) = (s.o / s.groups, s.group_rows());
    each_sample(y, out_len, n, workspace, s.col_len(), |i, y_n, col| {
        s.im2col(&x[i * in_len..(i + 1) * in_len], col);
        fill_bias(y_n, b, oh * ow);
        for g in 0..s.groups {
            let y_g = &mut y_n[g * og * oh * ow..(g + 1) * og * oh * ow];
            let w_g = &w[g * og * rows..(g + 1) * og * rows];
            let col_g = &col[g * rows * oh * ow..(g + 1) * rows * oh * ow];
            let add = b.is_some();
            serial_matmul(
                y_g,
                add,
                w_g,
                (rows, 1),
                col_g,
                (oh * ow, 1),
                og,
                oh * ow,
                rows,
            );
        }
    });
}

/// dW += Σₙ dyₙ·colₙᵀ, db += Σ dy, and when asked dx: the convolution of dy with the flipped
/// kernel where `input_gradient_conv` applies, else col2im(Wᵀ·dyₙ).
#[allow(clippy::too_many_arguments)]
pub fn conv2d_backward(
    s: &Conv2d,
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    dw: &mut [f32],
    db: Option<&mut [f32]>,
    dx: Option<&mut [f32]>,
    n: usize,
    workspace: &mut [f32],
) {
    let (oh, ow) = s.oh_ow();
    let (in_len, out_len, col_len) = (s.c * s.h * s.w, s.o * oh * ow, s.col_len());
    let (og, rows) = (s.o / s.groups, s.group_rows());
    if let Some(db) = db {
        for dy_n in dy[..n * out_len].chunks(out_len) {
            for (oc, plane) in dy_n.chunks(oh * ow).enumerate() {
                db[oc] += plane.iter().sum::<f32>();
            }
        }
    }
    // dW: each chunk of samples into its own partial sum, in parallel; then the partials in
    // chunk order (see `conv_workspace_len` for the workspace's layout).
    let chunks = n.div_ceil(DW_CHUNK);
    let (flipped, workspace) = workspace.split_at_mut(dw.len());
    let (partials, workspace) = workspace.split_at_mut(chunks * dw.len());
    let unrolled = s.unrolls_rows();
    {
        let cols = &mut workspace[dw.len()..];
        let scratch = if unrolled { s.scratch_len() } else { col_len };
        let (k, len) = (s.c * s.kw, s.unrolled_row_len());
        partials
            .par_chunks_mut(dw.len())
            .zip(cols.par_chunks_mut(scratch))
            .enumerate()
            .for_each(|(chunk, (part, col))| {
                part.fill(0.0);
                for i in chunk * DW_CHUNK..((chunk + 1) * DW_CHUNK).min(n) {
                    let (x_n, dy_n) = (&x[i * in_len..][..in_len], &dy[i * out_len..][..out_len]);
                    if unrolled {
                        // dW[ki] += dy · (kernel row ki's window)ᵀ, in `weights_by_kernel_row`'s
                        // layout.
                        s.im2col_rows(x_n, col);
                        for (ki, part_ki) in part.chunks_exact_mut(s.o * k).enumerate() {
                            let window = &col[s.window_start(ki)..];
                            let ohw = oh * ow;
                            add_row_dots(part_ki, (dy_n, ohw), (window, len), s.o, k, ohw);
                        }
                        continue;
                    }
                    s.im2col(x_n, col);
                    for g in 0..s.groups {
                        let dy_g = &dy_n[g * og * oh * ow..(g + 1) * og * oh * ow];
                        let col_g = &col[g * rows * oh * ow..(g + 1) * rows * oh * ow];
                        let part_g = &mut part[g * og * rows..(g + 1) * og * rows];
                        // dW_g[og, rows] += dy_g[og, ohw] · col_gᵀ[ohw, rows]
                        let ohw = oh * ow;
                        add_row_dots(part_g, (dy_g, ohw), (col_g, ohw), og, rows, ohw);
                    }
                }
            });
    }
    for part in partials.chunks(dw.len()) {
        if unrolled {
            s.add_from_kernel_rows(part, dw);
        } else {
            for (d, p) in dw.iter_mut().zip(part) {
                *d += p;
            }
        }
    }
    let Some(dx) = dx else { return };
    if let Some(t) = s.input_gradient_conv() {
        s.flip_weights(w, flipped);
        return conv2d_forward(&t, dy, flipped, None, dx, n, workspace);
    }
    let cols = &mut workspace[dw.len()..];
    each_sample(dx, in_len, n, cols, col_len, |i, dx_n, col| {
        let dy_n = &dy[i * out_len..(i + 1) * out_len];
        for g in 0..s.groups {
            let w_g = &w[g * og * rows..(g + 1) * og * rows];
            let dy_g = &dy_n[g * og * oh * ow..(g + 1) * og * oh * ow];
            let col_g = &mut col[g * rows * oh * ow..(g + 1) * rows * oh * ow];
            // dcol_g[rows, ohw] = W_gᵀ[rows, og] · dy_g[og, ohw]
            serial_matmul(
                col_g,
                false,
                w_g,
                (1, rows),
                dy_g,
                (oh * ow, 1),
                rows,
                oh * ow,
                og,
            );
        }
        dx_n.fill(0.0);
        s.col2im(col, dx_n);
    });
}

/// `matmul` on the calling thread: the conv loops already run one sample per thread.
#[allow(clippy::too_many_arguments)]
fn serial_matmul(
    dst: &mut [f32],
    accumulate: bool,
    lhs: &[f32],
    lhs_strides: (usize, usize),
    rhs: &[f32],
    rhs_strides: (usize, usize),
    m: usize,
    n: usize,
    k: usize,
) {
    let (lhs_s, rhs_s) = (lhs_strides, rhs_strides);
    matmul(
        dst,
        accumulate,
        lhs,
        lhs_s,
        rhs,
        rhs_s,
        (m, n, k),
        crate::tensor::matmul::Parallelism::None,
    );
}

/// dst[m, n] += a·bᵀ for `m` rows of `a` and `n` rows of `b` (each `k` long, at the given
/// row strides): a weight gradient's dot products, in place where the CPU can
/// (`row_dots`) and that is faster, else through the general GEMM. Each of row_dots's sums
/// ends in a reduction across its lanes, which short rows do not amortise: with k = 196 the
/// GEMM is ahead from m·n = 64 × 96 on (`cargo run --release --example row_dots`).
fn add_row_dots(
    dst: &mut [f32],
    (a, lda): (&[f32], usize),
    (b, ldb): (&[f32], usize),
    m: usize,
    n: usize,
    k: usize,
) {
    let in_place = k >= 512 || m * n <= 4096;
    if !(in_place && row_dots::add_row_dots(dst, n, a, lda, b, ldb, (m, n, k))) {
        serial_matmul(dst, true, a, (lda, 1), b, (1, ldb), m, n, k);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// im2col by its definition, one entry at a time.
    fn im2col_by_definition(s: &Conv2d, x: &[f32]) -> Vec<f32> {
        let (oh, ow) = s.oh_ow();
        let mut col = Vec::new();
        for ci in 0..s.c {
            for ki in 0..s.kh {
                for kj in 0..s.kw {
                    for p in 0..oh {
                        for q in 0..ow {
                            let i = (p * s.stride.0 + ki * s.dil.0) as isize - s.pad.0 as isize;
                            let j = (q * s.stride.1 + kj * s.dil.1) as isize - s.pad.1 as isize;
                            let inside =
                                (0..s.h as isize).contains(&i) && (0..s.w as isize).contains(&j);
                            col.push(if inside {
                                x[(ci * s.h + i as usize) * s.w + j as usize]
                            } else {
                                0.0
                            });
                        }
                    }
                }
            }
        }
        col
    }

    /// col2im by its definition, in im2col's order.
    fn col2im_by_definition(s: &Conv2d, col: &[f32]) -> Vec<f32> {
        let (oh, ow) = s.oh_ow();
        let mut dx = vec![0.0; s.c * s.h * s.w];
        let mut entries = col.iter();
        for ci in 0..s.c {
            for ki in 0..s.kh {
                for kj in 0..s.kw {
                    for p in 0..oh {
                        for q in 0..ow {
                            let v = entries.next().unwrap();
                            let i = (p * s.stride.0 + ki * s.dil.0) as isize - s.pad.0 as isize;
                            let j = (q * s.stride.1 + kj * s.dil.1) as isize - s.pad.1 as isize;
                            if (0..s.h as isize).contains(&i) && (0..s.w as isize).contains(&j) {
                                dx[(ci * s.h + i as usize) * s.w + j as usize] += v;
                            }
                        }
                    }
                }
            }
        }
        dx
    }

    #[test]
    fn im2col_and_col2im_match_their_definitions_for_shifted_planes_unrolled_and_strided_rows() {
        let geometries = [
            // (h, w, k, stride, pad, dilation): plane shifts first, then the row-by-row path.
            (6, 5, 3, 1, 1, 1),
            (5, 7, 5, 1, 2, 1),
            (7, 6, 3, 1, 2, 2),
            (4, 4, 1, 1, 0, 1),
            (2, 3, 3, 1, 1, 1),
            (1, 4, 3, 1, 1, 1),
            (3, 1, 3, 1, 1, 1),
            (7, 7, 3, 2, 1, 1),
            (6, 5, 3, 1, 0, 1),
            (5, 8, 3, 1, 0, 2),
            (9, 8, 1, 2, 0, 1),
            (8, 9, 3, 3, 2, 2),
            (10, 10, 5, 2, 2, 1),
        ];
        for (h, w, k, stride, pad, dil) in geometries {
            let s = Conv2d {
                c: 2,
                h,
                w,
                o: 1,
                kh: k,
                kw: k,
                stride: (stride, stride),
                pad: (pad, pad),
                dil: (dil, dil),
                groups: 1,
            };
            let x: Vec<f32> = (0..2 * h * w)
                .map(|i| (i as f32 * 0.37).sin() + 1.5)
                .collect();
            // Also with no padding on the rows: fewer output rows, the same width.
            let unpadded_rows = Conv2d { pad: (0, pad), ..s };
            for s in [s, unpadded_rows]
                .into_iter()
                .filter(|s| s.out_hw().is_some())
            {
                let mut col = vec![f32::NAN; s.col_len()];
                s.im2col(&x, &mut col);
                let by_definition = im2col_by_definition(&s, &x);
                assert_eq!(col, by_definition, "{s:?}");
                if s.unrolls_rows() {
                    // Every im2col row (ci, ki, kj) is a window of the row-unrolled matrix.
                    let mut cols = vec![f32::NAN; s.scratch_len()];
                    s.im2col_rows(&x, &mut cols);
                    let (oh, ow) = s.oh_ow();
                    let rows = by_definition.chunks_exact(oh * ow).enumerate();
                    for (row, expected) in rows {
                        let (ci, ki, kj) = (row / (k * k), row / k % k, row % k);
                        let at = (ci * k + kj) * s.unrolled_row_len() + s.window_start(ki);
                        assert_eq!(&cols[at..at + oh * ow], expected, "{s:?} row {row}");
                    }
                }
                // The adjoint: every column entry added back into its input position.
                let mut dcol: Vec<f32> =
                    (0..s.col_len()).map(|i| (i as f32 * 0.11).cos()).collect();
                let expected = col2im_by_definition(&s, &dcol);
                let mut dx = vec![0.0; x.len()];
                s.col2im(&mut dcol, &mut dx);
                assert_eq!(dx, expected, "{s:?}");
            }
        }
    }
}
