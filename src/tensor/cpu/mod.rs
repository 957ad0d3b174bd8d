//! The CPU backend: the reference every other backend is tested against, and the fast path
//! for users without a GPU. Matrix products go through the `gemm` crate (AVX2/AVX-512
//! kernels, threaded with rayon); large elementwise passes are split across the same threads.

mod cross_entropy;

use super::matmul::Parallelism;
use super::{
    cast, AdamStep, Backend, Capture, HalfKind, HostIds, IdsInto, LossFn, LossStats, Matrices,
    RowsAt, SgdStep, UpdatedParams,
};
use crate::error::Result;
use cross_entropy::CrossEntropyRows;
use rayon::prelude::*;

/// Elementwise passes shorter than this stay on one thread: splitting costs more than it saves.
const PARALLEL_MIN_LEN: usize = 1 << 16;
const CHUNK: usize = 1 << 14;

#[derive(Debug, Clone)]
pub struct CpuBackend {
    threads: usize,
}

/// "cpu (N threads)", for logs and config.toml.
pub fn threads_label(threads: usize) -> String {
    let plural = if threads == 1 { "" } else { "s" };
    format!("cpu ({threads} thread{plural})")
}

impl CpuBackend {
    /// A backend using `threads` threads; rayon's global pool must have at least that many.
    pub const fn new(threads: usize) -> Self {
        CpuBackend {
            threads: if threads == 0 { 1 } else { threads },
        }
    }

    /// The threads it computes on.
    pub(crate) fn threads(&self) -> usize {
        self.threads
    }

    pub(crate) fn parallelism(&self, m: usize, n: usize, k: usize) -> Parallelism {
        // Below ~a million multiply-adds, a second thread costs more than it saves.
        if self.threads > 1 && m * n * k >= 1 << 20 {
            Parallelism::Rayon(self.threads)
        } else {
            Parallelism::None
        }
    }

    /// Row-major dst[m, n] = (accumulate ? dst : 0) + lhs·rhs on this backend's threads
    /// (`gemm::matmul`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn matmul(
        &self,
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
        let threads = self.parallelism(m, n, k);
        super::matmul::matmul(
            dst,
            accumulate,
            lhs,
            lhs_strides,
            rhs,
            rhs_strides,
            (m, n, k),
            threads,
        );
    }
}

/// Runs `f` compiled for AVX2 where the CPU has it, so LLVM vectorises its loops 8 wide.
/// The arithmetic is the same IEEE operations either way (no FMA contraction), so results do
/// not depend on the CPU.
#[inline(always)]
pub(crate) fn vectorized<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        unsafe fn with_avx2<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { with_avx2(f) };
        }
    }
    f()
}

/// Defines a function whose body is compiled three times, for AVX-512 (F and DQ: DQ
/// multiplies 64-bit lanes, as the dropout mask's hash does), AVX2 and the baseline, and run
/// in the widest the CPU has. Its slices arrive as arguments, so LLVM knows they do not
/// alias and vectorises the loops (a closure's captured slices it does not, and
/// `vectorized` cannot force a large closure inline). The arithmetic is the same IEEE
/// operations at every width, so results do not depend on the CPU.
macro_rules! simd_fn {
    ($(#[$doc:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$doc])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name($($arg: $ty),*) {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            fn body($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512dq")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn avx512($($arg: $ty),*) {
                    body($($arg),*)
                }
                #[target_feature(enable = "avx2")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn avx2($($arg: $ty),*) {
                    body($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512dq")
                {
                    // SAFETY: the CPU supports AVX-512F and DQ, checked just above.
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU supports AVX2, checked just above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}
pub(crate) use simd_fn;

/// Rows per parallel task of a row-wise op (a normalisation): at least 16k values, so that
/// a task outweighs its scheduling.
pub(crate) fn rows_per_band(width: usize) -> usize {
    (16_384 / width.max(1)).max(1)
}

/// `f(rows, band)` for bands of whole rows of `out` ([rows, width]) in parallel, each with
/// its range of rows.
pub(crate) fn row_bands(
    out: &mut [f32],
    width: usize,
    f: impl Fn(std::ops::Range<usize>, &mut [f32]) + Sync,
) {
    let band = rows_per_band(width);
    (out.par_chunks_mut(band * width))
        .enumerate()
        .for_each(|(i, out)| f(i * band..i * band + out.len() / width, out));
}

/// `map2` over a single buffer, updated in place.
pub(crate) fn map1(out: &mut [f32], f: impl Fn(&mut [f32], usize) + Sync) {
    if out.len() < PARALLEL_MIN_LEN {
        vectorized(|| f(out, 0));
    } else {
        out.par_chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(i, o)| vectorized(|| f(o, i * CHUNK)));
    }
}

/// Runs `f` over matching chunks of `out` and `a`, in parallel when long enough.
pub(crate) fn map2(out: &mut [f32], a: &[f32], f: impl Fn(&mut [f32], &[f32], usize) + Sync) {
    if out.len() < PARALLEL_MIN_LEN {
        vectorized(|| f(out, a, 0));
    } else {
        out.par_chunks_mut(CHUNK)
            .zip(a.par_chunks(CHUNK))
            .enumerate()
            .for_each(|(i, (o, a))| vectorized(|| f(o, a, i * CHUNK)));
    }
}

/// The CPU runs every op as it comes: nothing to record.
impl Capture for CpuBackend {
    type Graph = ();
}

impl Backend for CpuBackend {
    type Buf = Vec<f32>;
    type Ids = Vec<u32>;
    type Stats = LossStats;
    type Mark = std::time::Instant;

    fn new_mark(&self) -> Result<std::time::Instant> {
        Ok(std::time::Instant::now())
    }

    /// Every op has returned when done: now is after the queued work.
    fn set_mark(&self, mark: &mut std::time::Instant) {
        *mark = std::time::Instant::now();
    }

    fn between(&self, from: &std::time::Instant, to: &std::time::Instant) -> std::time::Duration {
        to.saturating_duration_since(*from)
    }

    fn describe(&self) -> String {
        threads_label(self.threads)
    }

    fn alloc(&self, len: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; len])
    }

    fn upload_vec(&self, data: Vec<f32>) -> Result<Vec<f32>> {
        Ok(data)
    }

    fn upload(&self, src: &[f32], dst: &mut Vec<f32>) {
        dst[..src.len()].copy_from_slice(src);
    }

    fn download_at(&self, src: &Vec<f32>, start: usize, dst: &mut [f32]) {
        dst.copy_from_slice(&src[start..start + dst.len()]);
    }

    fn fill(&self, buf: &mut Vec<f32>, value: f32) {
        buf.fill(value);
    }

    fn fill_range(&self, buf: &mut Vec<f32>, range: std::ops::Range<usize>, value: f32) {
        buf[range].fill(value);
    }

    fn copy(&self, src: &Vec<f32>, dst: &mut Vec<f32>, len: usize) {
        dst[..len].copy_from_slice(&src[..len]);
    }

    fn gather_rows(&self, src: &Vec<f32>, rows: &[u64], at: RowsAt, dst: &mut Vec<f32>) {
        self.upload_rows(src, rows, at, dst);
    }

    /// Host memory is this device's memory: the rows go straight into `dst`.
    fn upload_rows(&self, src: &[f32], rows: &[u64], at: RowsAt, dst: &mut Vec<f32>) {
        for (out, &r) in dst.chunks_exact_mut(at.len).zip(rows) {
            out.copy_from_slice(&src[at.start(r)..][..at.len]);
        }
    }

    fn upload_ids(&self, ids: Vec<u32>) -> Result<Vec<u32>> {
        Ok(ids)
    }

    fn write_ids(&self, src: &[u32], dst: &mut Vec<u32>) {
        dst[..src.len()].copy_from_slice(src);
    }

    fn gather_ids(&self, src: &Vec<u32>, rows: &[u64], at: RowsAt, dst: IdsInto<'_, Self>) {
        self.upload_id_rows(src, rows, at, dst);
    }

    fn upload_id_rows(&self, src: &dyn HostIds, rows: &[u64], at: RowsAt, dst: IdsInto<'_, Self>) {
        match dst {
            IdsInto::Ids(ids) => {
                for (out, &r) in ids.chunks_exact_mut(at.len).zip(rows) {
                    src.copy_ids(at.start(r), out);
                }
            }
            // Class indices: each id copied into its value's bits, then converted there.
            IdsInto::Values(values) => {
                for (out, &r) in values.chunks_exact_mut(at.len).zip(rows) {
                    src.copy_ids(at.start(r), bytemuck::cast_slice_mut(out));
                    out.iter_mut().for_each(|v| *v = v.to_bits() as f32);
                }
            }
        }
    }

    fn loss(
        &self,
        f: LossFn,
        out: &Vec<f32>,
        targets: &Vec<f32>,
        n: usize,
        dim: usize,
        grad_scale: f32,
        mut dout: Option<&mut Vec<f32>>,
        stats: &mut LossStats,
    ) {
        if let LossFn::CrossEntropy {
            label_smoothing,
            ignore_index,
        } = f
        {
            let rows = CrossEntropyRows::new(targets, n, dim, label_smoothing, ignore_index);
            rows.score_into(out, dout.map(|d| &mut d[..]), grad_scale, stats);
            return;
        }
        let g = grad_scale as f64 / n.max(1) as f64;
        for s in 0..n {
            let x = &out[s * dim..(s + 1) * dim];
            let mut grad = dout.as_deref_mut().map(|d| &mut d[s * dim..(s + 1) * dim]);
            let t = &targets[s * dim..(s + 1) * dim];
            let (loss, correct) = match f {
                LossFn::CrossEntropy { .. } => unreachable!("scored above"),
                LossFn::Mse => {
                    let mut sum = 0.0f64;
                    for j in 0..dim {
                        let diff = (x[j] - t[j]) as f64;
                        sum += diff * diff;
                        if let Some(d) = grad.as_deref_mut() {
                            d[j] = (2.0 * diff * g / dim as f64) as f32;
                        }
                    }
                    (sum / dim as f64, 0.0)
                }
                LossFn::BceWithLogits => {
                    let (mut sum, mut hits) = (0.0f64, 0.0f64);
                    for j in 0..dim {
                        let (xj, tj) = (x[j] as f64, t[j] as f64);
                        sum += xj.max(0.0) - xj * tj + (-xj.abs()).exp().ln_1p();
                        hits += f64::from((xj > 0.0) == (tj >= 0.5));
                        if let Some(d) = grad.as_deref_mut() {
                            let sigmoid = 1.0 / (1.0 + (-xj).exp());
                            d[j] = ((sigmoid - tj) * g / dim as f64) as f32;
                        }
                    }
                    (sum / dim as f64, hits / dim as f64)
                }
            };
            stats.loss_sum += loss;
            stats.correct += correct;
        }
        stats.samples += n as f64;
    }

    fn cross_entropy_over_output(
        &self,
        label_smoothing: f32,
        ignore_index: Option<u32>,
        out: &mut Vec<f32>,
        targets: &Vec<f32>,
        n: usize,
        dim: usize,
        grad_scale: f32,
        stats: &mut LossStats,
    ) {
        let rows = CrossEntropyRows::new(targets, n, dim, label_smoothing, ignore_index);
        rows.score_in_place(out, grad_scale, stats);
    }

    fn new_stats(&self) -> Result<LossStats> {
        Ok(LossStats::default())
    }

    fn take_stats(&self, stats: &mut LossStats) -> LossStats {
        std::mem::take(stats)
    }

    fn set_stats(&self, stats: &mut LossStats, value: LossStats) {
        *stats = value;
    }

    fn loss_sum_now(&self, stats: &LossStats) -> Option<f64> {
        Some(stats.loss_sum)
    }

    fn sum_squares(&self, buf: &Vec<f32>) -> f64 {
        // A fixed reduction order, so the gradient norm (and clipping) is the same in every
        // run: each chunk is summed in order, then the chunks' sums in order. (A rayon
        // `.sum()` combines in a tree shaped by work stealing, which varies from run to run.)
        // At most PARTS chunks, their sums on the stack: no allocation.
        const PARTS: usize = 64;
        let chunk = CHUNK.max(buf.len().div_ceil(PARTS));
        let mut partial = [0.0f64; PARTS];
        buf.par_chunks(chunk)
            .zip(partial.par_iter_mut())
            .for_each(|(c, p)| *p = c.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>());
        partial.iter().sum()
    }

    fn scale(&self, buf: &mut Vec<f32>, factor: f32) {
        buf.par_chunks_mut(CHUNK)
            .for_each(|c| c.iter_mut().for_each(|v| *v *= factor));
    }

    fn add_assign(&self, src: &Vec<f32>, dst: &mut Vec<f32>, len: usize) {
        dst[..len]
            .par_chunks_mut(CHUNK)
            .zip(src[..len].par_chunks(CHUNK))
            .for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, s)| *d += s));
    }

    fn copy_rows(
        &self,
        src: &Vec<f32>,
        (src_stride, src_offset): (usize, usize),
        dst: &mut Vec<f32>,
        (dst_stride, dst_offset): (usize, usize),
        width: usize,
        rows: usize,
        add: bool,
    ) {
        for r in 0..rows {
            let s = &src[r * src_stride + src_offset..][..width];
            let d = &mut dst[r * dst_stride + dst_offset..][..width];
            if add {
                d.iter_mut().zip(s).for_each(|(d, s)| *d += s);
            } else {
                d.copy_from_slice(s);
            }
        }
    }

    fn batched_matmul(
        &self,
        (m, n, k): (usize, usize, usize),
        batch: usize,
        a: &Vec<f32>,
        a_at: Matrices,
        b: &Vec<f32>,
        b_at: Matrices,
        c: &mut Vec<f32>,
        c_at: Matrices,
        accumulate: bool,
    ) {
        assert!(
            c_at.row_stride == n && !c_at.transposed,
            "a batched product writes C's rows n apart"
        );
        let strides = |at: Matrices| match at.transposed {
            false => (at.row_stride, 1),
            true => (1, at.row_stride),
        };
        for i in 0..batch {
            let at = |m: Matrices| m.offset + i * m.batch_stride;
            self.matmul(
                &mut c[at(c_at)..],
                accumulate,
                &a[at(a_at)..],
                strides(a_at),
                &b[at(b_at)..],
                strides(b_at),
                m,
                n,
                k,
            );
        }
    }

    fn round_to_half(&self, kind: HalfKind, buf: &mut Vec<f32>, len: usize) {
        buf[..len]
            .par_chunks_mut(CHUNK)
            .for_each(|c| cast::round_to_half(kind, c));
    }

    fn sgd_step(
        &self,
        out: UpdatedParams<'_, Vec<f32>>,
        grads: &Vec<f32>,
        momentum: &mut Vec<f32>,
        h: &SgdStep,
        args: &Vec<f32>,
        decays: Option<&Vec<f32>>,
    ) {
        let params = out.params;
        let (lr, first_step, wd) = (args[0], args[1] != 0.0, h.weight_decay);
        let chunk_of = |c: usize, len: usize| decays.map(|k| &k[c * CHUNK..c * CHUNK + len]);
        if h.momentum == 0.0 {
            // No momentum buffer is kept (it is empty).
            params
                .par_chunks_mut(CHUNK)
                .zip(grads.par_chunks(CHUNK))
                .enumerate()
                .for_each(|(c, (p, g))| {
                    let decays = chunk_of(c, p.len());
                    vectorized(|| {
                        for i in 0..p.len() {
                            p[i] -= lr * (g[i] + decay_at(decays, i, wd) * p[i]);
                        }
                    })
                });
            return refresh_half_copy(params, out.half_copy);
        }
        let (mu, keep) = (h.momentum, 1.0 - h.dampening);
        params
            .par_chunks_mut(CHUNK)
            .zip(grads.par_chunks(CHUNK))
            .zip(momentum.par_chunks_mut(CHUNK))
            .enumerate()
            .for_each(|(c, ((p, g), b))| {
                let decays = chunk_of(c, p.len());
                vectorized(|| {
                    for i in 0..p.len() {
                        let d = g[i] + decay_at(decays, i, wd) * p[i];
                        b[i] = if first_step { d } else { mu * b[i] + keep * d };
                        p[i] -= lr * if h.nesterov { d + mu * b[i] } else { b[i] };
                    }
                })
            });
        refresh_half_copy(params, out.half_copy);
    }

    fn adam_step(
        &self,
        out: UpdatedParams<'_, Vec<f32>>,
        grads: &Vec<f32>,
        exp_avg: &mut Vec<f32>,
        exp_avg_sq: &mut Vec<f32>,
        h: &AdamStep,
        args: &Vec<f32>,
        decays: Option<&Vec<f32>>,
    ) {
        let params = out.params;
        let (decay, step_size, bias_correction2_sqrt) = (args[0], args[1], args[2]);
        let constants = [
            decay,
            h.l2(),
            h.beta1,
            h.beta2,
            h.eps,
            step_size,
            bias_correction2_sqrt,
        ];
        params
            .par_chunks_mut(CHUNK)
            .zip(grads.par_chunks(CHUNK))
            .zip(
                exp_avg
                    .par_chunks_mut(CHUNK)
                    .zip(exp_avg_sq.par_chunks_mut(CHUNK)),
            )
            .enumerate()
            .for_each(|(c, ((p, g), (m, v)))| {
                let k = decays.map(|k| &k[c * CHUNK..c * CHUNK + p.len()]);
                adam_update(p, g, m, v, k, constants);
            });
        refresh_half_copy(params, out.half_copy);
    }
}

simd_fn! {
    /// One chunk of Adam(W): `decays` (0 or 1 per parameter) picks which take the decay.
    /// Branch-free, the mask a select: AdamW decays the parameters (decay < 1, no L2 term),
    /// Adam adds the L2 term to the gradient (decay = 1); x·1 and g + 0·x are exact.
    fn adam_update(
        p: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        decays: Option<&[f32]>,
        h: [f32; 7],
    ) {
        let [decay, l2, beta1, beta2, eps, step_size, bias_correction2_sqrt] = h;
        let update = |p: &mut f32, g: f32, m: &mut f32, v: &mut f32, decay, l2| {
            let grad = g + l2 * *p;
            *p *= decay;
            *m += (grad - *m) * (1.0 - beta1);
            *v = *v * beta2 + (1.0 - beta2) * grad * grad;
            let denom = v.sqrt() / bias_correction2_sqrt + eps;
            *p -= step_size * *m / denom;
        };
        let each = (p.iter_mut().zip(g)).zip(m.iter_mut().zip(v.iter_mut()));
        match decays {
            Some(k) => {
                for (((p, &g), (m, v)), &k) in each.zip(k) {
                    let (decay, l2) = if k == 0.0 { (1.0, 0.0) } else { (decay, l2) };
                    update(p, g, m, v, decay, l2);
                }
            }
            None => {
                for ((p, &g), (m, v)) in each {
                    update(p, g, m, v, decay, l2);
                }
            }
        }
    }
}

/// The weight decay of parameter `i` of a chunk: `wd`, or 0 where `decays` says it has none.
#[inline(always)]
fn decay_at(decays: Option<&[f32]>, i: usize, wd: f32) -> f32 {
    match decays {
        Some(k) if k[i] == 0.0 => 0.0,
        _ => wd,
    }
}

/// Refreshes the half copy of updated parameters (`UpdatedParams`), a chunk at a time: on
/// the CPU it is an f32 buffer holding half values.
fn refresh_half_copy(params: &[f32], half_copy: Option<(&mut Vec<f32>, HalfKind)>) {
    if let Some((half, kind)) = half_copy {
        half[..params.len()]
            .par_chunks_mut(CHUNK)
            .zip(params.par_chunks(CHUNK))
            .for_each(|(h, p)| {
                h.copy_from_slice(p);
                cast::round_to_half(kind, h);
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A long loss is scored on threads, a block of rows at a time: the same bits as one row
    /// at a time in order, with label smoothing, into a buffer and over the logits.
    #[test]
    fn a_long_loss_on_threads_gives_a_row_at_a_times_bits() {
        let b = CpuBackend::new(2);
        // 70 rows of 1,000 logits: past LOGITS_PER_TASK, and two blocks.
        let (n, dim) = (70, 1000);
        let out: Vec<f32> = (0..n * dim)
            .map(|i| (i * 7919 % 1000) as f32 / 100.0 - 5.0)
            .collect();
        let targets: Vec<f32> = (0..n).map(|s| (s * 37 % dim) as f32).collect();
        let f = LossFn::CrossEntropy {
            label_smoothing: 0.1,
            ignore_index: None,
        };
        // A gradient scale of n: each row's gradient is scaled by exactly 1 both ways.
        let (mut grad, mut stats) = (vec![0.0; n * dim], LossStats::default());
        b.loss(
            f,
            &out,
            &targets,
            n,
            dim,
            n as f32,
            Some(&mut grad),
            &mut stats,
        );
        let (mut by_rows, mut row_stats) = (vec![0.0; n * dim], LossStats::default());
        for s in 0..n {
            let x = out[s * dim..(s + 1) * dim].to_vec();
            let mut d = vec![0.0; dim];
            b.loss(
                f,
                &x,
                &vec![targets[s]],
                1,
                dim,
                1.0,
                Some(&mut d),
                &mut row_stats,
            );
            by_rows[s * dim..(s + 1) * dim].copy_from_slice(&d);
        }
        assert_eq!((&grad, stats), (&by_rows, row_stats));
        let (mut over, mut over_stats) = (out.clone(), LossStats::default());
        b.cross_entropy_over_output(
            0.1,
            None,
            &mut over,
            &targets,
            n,
            dim,
            n as f32,
            &mut over_stats,
        );
        assert_eq!((&over, over_stats), (&grad, stats));
    }
}
