//! The CUDA backend against the CPU backend: every op on random inputs (never zeros), with
//! output buffers poisoned (NaN) first so unwritten elements show; fp32 relative error (max
//! |gpu - cpu| / max |cpu|) at most 1e-5. Then whole jobs: the loss curve of jobs/mlp.toml on
//! cuda follows the CPU's within 1e-4 relative over 100 steps from the same seed.
//! Skips, with the reason, without a GPU; fails when TRAINER_REQUIRE_CUDA=1.

use crate::common;

use common::random_vec;
use trainer::ops::activation::Kernels as _;
use trainer::ops::conv2d::Kernels as _;
use trainer::ops::dropout::Kernels as _;
use trainer::ops::embedding::Kernels as _;
use trainer::ops::linear::Kernels as _;
use trainer::tensor::cpu::CpuBackend;
use trainer::tensor::cuda::CudaBackend;
use trainer::tensor::cuda::{CudaBuf, CudaIds};
use trainer::tensor::{
    Activation, AdamStep, Backend, GradWrite, HalfKind, IdsInto, LossFn, RowsAt, SgdStep,
    UpdatedParams,
};

pub(crate) fn gpu() -> Option<CudaBackend> {
    if !common::gpu_present() {
        return None;
    }
    match CudaBackend::new(0, false) {
        Ok(backend) => Some(backend),
        Err(e) => {
            common::skip_without_gpu(&e.to_string());
            None
        }
    }
}

const CPU: CpuBackend = CpuBackend::new(1);

pub(crate) fn up(g: &CudaBackend, v: &[f32]) -> CudaBuf {
    g.upload_vec(v.to_vec()).unwrap()
}

/// A device buffer of `len` NaNs.
pub(crate) fn poisoned(g: &CudaBackend, len: usize) -> CudaBuf {
    let mut b = g.alloc(len).unwrap();
    g.fill(&mut b, f32::NAN);
    b
}

pub(crate) fn down(g: &CudaBackend, b: &CudaBuf, len: usize) -> Vec<f32> {
    let mut v = vec![0.0; len];
    g.download(b, &mut v);
    g.status().unwrap();
    v
}

pub(crate) fn assert_close(gpu: &[f32], cpu: &[f32], what: &str) {
    assert_within(gpu, cpu, 1e-5, what);
}

/// Every |gpu - cpu| within `relative` of the largest |cpu|.
pub(crate) fn assert_within(gpu: &[f32], cpu: &[f32], relative: f32, what: &str) {
    assert_eq!(gpu.len(), cpu.len(), "{what}: lengths");
    let scale = cpu.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-30);
    let worst = gpu
        .iter()
        .zip(cpu)
        .map(|(a, b)| (a - b).abs())
        .fold(
            0.0f32,
            |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
        );
    assert!(
        worst / scale <= relative,
        "{what}: max error {worst} against max |cpu| {scale} (relative {})",
        worst / scale
    );
}

/// Gradients a backward pass starts from: with `GradWrite::Overwrite` the first `written`
/// (the weight's and bias's) are NaN, which it must not read.
pub(crate) fn stale_grads(mut grads: Vec<f32>, written: usize, dw_write: GradWrite) -> Vec<f32> {
    if dw_write == GradWrite::Overwrite {
        grads[..written].fill(f32::NAN);
    }
    grads
}

#[test]
fn losses_and_statistics_match_the_cpu() {
    let Some(g) = gpu() else { return };
    let cross_entropy = |label_smoothing, ignore_index| LossFn::CrossEntropy {
        label_smoothing,
        ignore_index,
    };
    let cases: [(LossFn, usize, usize); 8] = [
        (cross_entropy(0.0, None), 300, 10),
        (cross_entropy(0.1, None), 77, 1000),
        (cross_entropy(0.0, None), 5, 3),
        // Some rows ignored; then every row.
        (cross_entropy(0.0, Some(3)), 300, 10),
        (cross_entropy(0.1, Some(0)), 77, 1000),
        (cross_entropy(0.0, Some(0)), 1, 3),
        (LossFn::Mse, 129, 3),
        (LossFn::BceWithLogits, 257, 2),
    ];
    for (f, n, dim) in cases {
        let out: Vec<f32> = random_vec(n * dim, 8).iter().map(|v| v * 4.0).collect();
        let targets: Vec<f32> = match f {
            LossFn::CrossEntropy { .. } => (0..n).map(|i| ((i * 7919) % dim) as f32).collect(),
            LossFn::Mse => random_vec(n * dim, 9),
            LossFn::BceWithLogits => random_vec(n * dim, 9)
                .iter()
                .map(|v| (v.tanh() + 1.0) / 2.0)
                .collect(),
        };
        for with_grad in [true, false] {
            let mut stats_cpu = CPU.new_stats().unwrap();
            let mut d_cpu = vec![f32::NAN; n * dim];
            CPU.loss(
                f,
                &out,
                &targets,
                n,
                dim,
                0.25,
                with_grad.then_some(&mut d_cpu),
                &mut stats_cpu,
            );
            let mut stats_gpu = g.new_stats().unwrap();
            let mut dg = poisoned(&g, n * dim);
            g.loss(
                f,
                &up(&g, &out),
                &up(&g, &targets),
                n,
                dim,
                0.25,
                with_grad.then_some(&mut dg),
                &mut stats_gpu,
            );
            let s = g.take_stats(&mut stats_gpu);
            g.status().unwrap();
            let what = format!("{f:?} n={n} dim={dim}");
            assert!(
                (s.loss_sum - stats_cpu.loss_sum).abs() <= 1e-5 * stats_cpu.loss_sum.abs(),
                "{what}: loss {} vs {}",
                s.loss_sum,
                stats_cpu.loss_sum
            );
            assert!(
                (s.correct - stats_cpu.correct).abs() < 1e-9,
                "{what}: correct {} vs {}",
                s.correct,
                stats_cpu.correct
            );
            assert_eq!(s.samples, stats_cpu.samples, "{what}: rows scored");
            if let LossFn::CrossEntropy {
                ignore_index: Some(_),
                ..
            } = f
            {
                assert!(stats_cpu.samples < n as f64, "{what}: nothing ignored");
            }
            if let (
                true,
                LossFn::CrossEntropy {
                    label_smoothing,
                    ignore_index,
                },
            ) = (with_grad, f)
            {
                // Written over the logits (the fused classifier): the same bits as into a
                // buffer of its own, on each device.
                let mut over = out.clone();
                let mut stats_over = CPU.new_stats().unwrap();
                let (smoothing, ignore) = (label_smoothing, ignore_index);
                CPU.cross_entropy_over_output(
                    smoothing,
                    ignore,
                    &mut over,
                    &targets,
                    n,
                    dim,
                    0.25,
                    &mut stats_over,
                );
                assert_eq!(over, d_cpu, "{what}: the CPU's gradient over the logits");
                assert_eq!(stats_over, stats_cpu, "{what}: the CPU's statistics");
                let mut over_g = up(&g, &out);
                let mut stats_over_g = g.new_stats().unwrap();
                g.cross_entropy_over_output(
                    smoothing,
                    ignore,
                    &mut over_g,
                    &up(&g, &targets),
                    n,
                    dim,
                    0.25,
                    &mut stats_over_g,
                );
                let got = down(&g, &over_g, n * dim);
                assert_eq!(
                    got,
                    down(&g, &dg, n * dim),
                    "{what}: the GPU's over the logits"
                );
                assert_eq!(
                    g.take_stats(&mut stats_over_g),
                    s,
                    "{what}: the GPU's statistics"
                );
            }
            if with_grad {
                assert_close(&down(&g, &dg, n * dim), &d_cpu, &format!("{what} gradient"));
            } else {
                assert!(
                    down(&g, &dg, n * dim).iter().all(|v| v.is_nan()),
                    "{what}: evaluation wrote a gradient"
                );
            }
        }
    }
}

#[test]
fn reductions_fills_gathers_and_copies_match_the_cpu() {
    let Some(g) = gpu() else { return };
    let v = random_vec(1_000_003, 10);
    let cpu = CPU.sum_squares(&v);
    let gpu_sum = g.sum_squares(&up(&g, &v));
    assert!(
        (gpu_sum - cpu).abs() <= 1e-9 * cpu,
        "sum of squares {gpu_sum} vs {cpu}"
    );

    // Clipping decided on the device: the CPU's bits, over, under and at a NaN norm.
    let norm = cpu.sqrt();
    for max_norm in [norm / 3.0, norm * 2.0] {
        let (mut on_gpu, mut on_cpu) = (up(&g, &v), v.clone());
        let (mut read_gpu, mut read_cpu) = (0.0, 0.0);
        g.clip_to_norm(&mut on_gpu, max_norm, Some(&mut read_gpu));
        CPU.clip_to_norm(&mut on_cpu, max_norm, Some(&mut read_cpu));
        // The norms are sums in other orders (1e-16 apart); the f32 factor rounds that away.
        assert!(
            (read_gpu - read_cpu).abs() <= 1e-12 * read_cpu,
            "clip: norm {read_gpu} vs {read_cpu}"
        );
        assert_eq!(down(&g, &on_gpu, v.len()), on_cpu, "clip to {max_norm}");
        g.clip_to_norm(&mut on_gpu, max_norm, None);
    }
    let mut with_nan = v.clone();
    with_nan[17] = f32::NAN;
    let mut on_gpu = up(&g, &with_nan);
    g.clip_to_norm(&mut on_gpu, 1e-3, None);
    let after = down(&g, &on_gpu, v.len());
    assert!(
        after[17].is_nan() && after[..17] == with_nan[..17],
        "NaN norm: untouched"
    );

    let mut a = up(&g, &v);
    g.scale(&mut a, 0.37);
    let mut c = v.clone();
    CPU.scale(&mut c, 0.37);
    assert_close(&down(&g, &a, v.len()), &c, "scale");
    g.fill(&mut a, 2.5);
    assert!(down(&g, &a, v.len()).iter().all(|&x| x == 2.5));
    // A range at an odd offset (not 16-byte aligned: the kernel's scalar path).
    g.fill_range(&mut a, 3..v.len() - 5, -1.0);
    let mut want = vec![2.5; v.len()];
    CPU.fill_range(&mut want, 3..v.len() - 5, -1.0);
    assert_eq!(down(&g, &a, v.len()), want, "fill_range");

    let src = random_vec(100 * 13, 11);
    let rows: Vec<u64> = (0..64).map(|i| i * 37 % 100).collect();
    let mut dst_cpu = vec![f32::NAN; 64 * 13];
    CPU.gather_rows(&src, &rows, RowsAt::packed(13), &mut dst_cpu);
    let mut dst_gpu = poisoned(&g, 64 * 13);
    g.gather_rows(&up(&g, &src), &rows, RowsAt::packed(13), &mut dst_gpu);
    assert_eq!(down(&g, &dst_gpu, 64 * 13), dst_cpu, "gather");
    // The same rows from host memory (a streamed data set), through every pinned staging
    // buffer in turn and round again, each batch queued before the previous was read back.
    let mut batches: Vec<(Vec<u64>, CudaBuf)> = Vec::new();
    for k in 0..9u64 {
        let rows: Vec<u64> = (0..64).map(|i| (i * 37 + k * 11) % 100).collect();
        let mut dst = poisoned(&g, 64 * 13);
        g.upload_rows(&src, &rows, RowsAt::packed(13), &mut dst);
        batches.push((rows, dst));
    }
    for (rows, dst) in &batches {
        let mut expected = vec![f32::NAN; 64 * 13];
        CPU.gather_rows(&src, rows, RowsAt::packed(13), &mut expected);
        assert_eq!(down(&g, dst, 64 * 13), expected, "upload_rows");
    }

    let mut copy = poisoned(&g, 500);
    g.copy(&up(&g, &src), &mut copy, 500);
    assert_eq!(down(&g, &copy, 500), src[..500].to_vec(), "copy");

    // Mixed precision's rounding, bit for bit, over magnitudes that overflow fp16 too.
    let wide: Vec<f32> = v.iter().map(|x| x * 3e4).collect();
    for kind in [HalfKind::F16, HalfKind::Bf16] {
        let mut on_gpu = up(&g, &wide);
        g.round_to_half(kind, &mut on_gpu, wide.len() - 3);
        let mut on_cpu = wide.clone();
        CPU.round_to_half(kind, &mut on_cpu, wide.len() - 3);
        let (a, b) = (down(&g, &on_gpu, wide.len()), on_cpu);
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "round_to_half {kind:?}"
        );
    }
}

/// A half-width device buffer (mixed precision's activations) holding `v`, rounded.
pub(crate) fn up_half(g: &CudaBackend, kind: HalfKind, v: &[f32]) -> CudaBuf {
    let mut b = g.alloc_half(kind, v.len()).unwrap();
    g.upload(v, &mut b);
    b
}

pub(crate) fn poisoned_half(g: &CudaBackend, kind: HalfKind, len: usize) -> CudaBuf {
    let mut b = g.alloc_half(kind, len).unwrap();
    g.fill(&mut b, f32::NAN);
    b
}

pub(crate) fn rounded(kind: HalfKind, v: &[f32]) -> Vec<f32> {
    let mut v = v.to_vec();
    let len = v.len();
    CPU.round_to_half(kind, &mut v, len);
    v
}

pub(crate) fn assert_bits(gpu: &[f32], cpu: &[f32], what: &str) {
    let same =
        gpu.len() == cpu.len() && gpu.iter().zip(cpu).all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(same, "{what}: not the CPU's bits");
}

/// How a buffer of activations or their gradients is stored: f32, or half-width (mixed
/// precision).
pub(crate) const STORAGES: [Option<HalfKind>; 3] =
    [None, Some(HalfKind::F16), Some(HalfKind::Bf16)];

pub(crate) fn up_in(g: &CudaBackend, storage: Option<HalfKind>, v: &[f32]) -> CudaBuf {
    match storage {
        None => up(g, v),
        Some(kind) => up_half(g, kind, v),
    }
}

pub(crate) fn poisoned_in(g: &CudaBackend, storage: Option<HalfKind>, len: usize) -> CudaBuf {
    match storage {
        None => poisoned(g, len),
        Some(kind) => poisoned_half(g, kind, len),
    }
}

/// What a buffer in `storage` holds of `v`.
pub(crate) fn stored(storage: Option<HalfKind>, v: &[f32]) -> Vec<f32> {
    match storage {
        None => v.to_vec(),
        Some(kind) => rounded(kind, v),
    }
}

/// The agreement of results stored in `storage` (relative to the largest): f32's, or one
/// unit in the half format's last place, as two f32 results that agree to 1e-5 may round
/// to neighbouring halves.
pub(crate) fn tolerance(storage: Option<HalfKind>) -> f32 {
    match storage {
        None => 1e-5,
        Some(HalfKind::F16) => 2f32.powi(-10),
        Some(HalfKind::Bf16) => 2f32.powi(-7),
    }
}

/// Mixed precision's half-width buffers hold what the CPU's f32 buffers hold after the
/// network's rounding: every op that takes them, with each operand stored either way.
/// Elementwise ops whose f32 results are the CPU's give its bits; products and
/// transcendental functions agree to half a unit in the half format's last place.
#[test]
fn half_width_buffers_hold_what_rounded_f32_buffers_hold() {
    let Some(g) = gpu() else { return };
    for kind in [HalfKind::F16, HalfKind::Bf16] {
        let ulp = match kind {
            HalfKind::F16 => 2f32.powi(-10),
            HalfKind::Bf16 => 2f32.powi(-7),
        };
        let len = 10_007;
        let x = rounded(kind, &random_vec(len, 21));
        let dy = rounded(kind, &random_vec(len, 22));
        // Upload, download and fill round trip (odd lengths and offsets: packed halves).
        let xh = up_half(&g, kind, &random_vec(len, 21));
        assert_bits(&down(&g, &xh, len), &x, &format!("{kind:?} upload"));
        let mut part = vec![0.0; 333];
        g.download_at(&xh, 4001, &mut part);
        assert_bits(&part, &x[4001..4334], &format!("{kind:?} download_at"));
        let mut filled = poisoned_half(&g, kind, 7);
        g.fill(&mut filled, 0.1);
        assert_bits(&down(&g, &filled, 7), &rounded(kind, &[0.1; 7]), "fill");

        // Elementwise: the CPU's op, then its rounding.
        let mut add_cpu = x.clone();
        CPU.add_assign(&dy, &mut add_cpu, len);
        let mut add_gpu = up_half(&g, kind, &x);
        g.add_assign(&up(&g, &dy), &mut add_gpu, len);
        assert_bits(
            &down(&g, &add_gpu, len),
            &rounded(kind, &add_cpu),
            "add f32 into half",
        );
        let mut into_f32 = up(&g, &x);
        g.add_assign(&up_half(&g, kind, &dy), &mut into_f32, len);
        assert_bits(&down(&g, &into_f32, len), &add_cpu, "add half into f32");
        let mut copied = poisoned(&g, len);
        g.copy(&xh, &mut copied, len);
        assert_bits(&down(&g, &copied, len), &x, "copy half to f32");
        let mut copied = poisoned_half(&g, kind, len);
        g.copy(&up(&g, &random_vec(len, 21)), &mut copied, len);
        assert_bits(&down(&g, &copied, len), &x, "copy f32 to half");
        let (mut rows_cpu, mut rows_gpu) = (dy.clone(), up_half(&g, kind, &dy));
        CPU.copy_rows(&x, (11, 3), &mut rows_cpu, (13, 5), 7, 700, true);
        g.copy_rows(&xh, (11, 3), &mut rows_gpu, (13, 5), 7, 700, true);
        assert_bits(
            &down(&g, &rows_gpu, len),
            &rounded(kind, &rows_cpu),
            "copy_rows",
        );
        let (p, key) = (0.3, 99);
        let mut drop_cpu = vec![0.0; len];
        CPU.dropout_forward(p, key, 5, &x, &mut drop_cpu, len);
        let mut drop_gpu = poisoned_half(&g, kind, len);
        g.dropout_forward(p, key, 5, &xh, &mut drop_gpu, len);
        assert_bits(
            &down(&g, &drop_gpu, len),
            &rounded(kind, &drop_cpu),
            "dropout",
        );
        let mut in_place = up_half(&g, kind, &x);
        g.dropout_in_place(p, key, 5, &mut in_place, len);
        assert_bits(
            &down(&g, &in_place, len),
            &rounded(kind, &drop_cpu),
            "dropout in place",
        );

        for f in [
            Activation::Relu,
            Activation::Gelu,
            Activation::Tanh,
            Activation::Sigmoid,
            Activation::Silu,
        ] {
            let what = format!("{kind:?} {f:?}");
            let mut y_cpu = vec![0.0; len];
            CPU.activation_forward(f, &x, &mut y_cpu, len);
            let y_cpu = rounded(kind, &y_cpu);
            let mut yh = poisoned_half(&g, kind, len);
            g.activation_forward(f, &xh, &mut yh, len);
            assert_within(&down(&g, &yh, len), &y_cpu, ulp, &format!("{what} forward"));
            let mut in_place = up_half(&g, kind, &x);
            g.activation_in_place_rounding(kind, f, &mut in_place, len);
            assert_within(
                &down(&g, &in_place, len),
                &y_cpu,
                ulp,
                &format!("{what} in place"),
            );
            let mut dx_cpu = vec![0.0; len];
            CPU.activation_backward(f, &x, &y_cpu, &dy, &mut dx_cpu, len);
            let mut dxh = poisoned_half(&g, kind, len);
            let mut dyh = up_half(&g, kind, &dy);
            g.activation_backward_rounding(kind, f, &xh, &yh, &mut dyh, &mut dxh, len);
            let dx_cpu = rounded(kind, &dx_cpu);
            assert_within(
                &down(&g, &dxh, len),
                &dx_cpu,
                2.0 * ulp,
                &format!("{what} backward"),
            );
        }

        // The batch gather, from device and from host memory, rounds as the CPU does.
        let data = random_vec(100 * 13, 23);
        let rows: Vec<u64> = (0..64).map(|i| i * 37 % 100).collect();
        let mut expected = vec![0.0; 64 * 13];
        CPU.gather_rows(&data, &rows, RowsAt::packed(13), &mut expected);
        let expected = rounded(kind, &expected);
        let mut gathered = poisoned_half(&g, kind, 64 * 13);
        g.gather_rows(&up(&g, &data), &rows, RowsAt::packed(13), &mut gathered);
        assert_bits(&down(&g, &gathered, 64 * 13), &expected, "gather into half");
        let mut streamed = poisoned_half(&g, kind, 64 * 13);
        g.upload_rows(&data, &rows, RowsAt::packed(13), &mut streamed);
        assert_bits(
            &down(&g, &streamed, 64 * 13),
            &expected,
            "upload_rows into half",
        );

        // Products on tensor cores reading and writing half-width buffers.
        g.set_half_matmuls(Some(kind));
        let (n, inp, out) = (96, 200, 72);
        let params = rounded(kind, &random_vec(out * inp + out, 24));
        let (px, pdy) = (
            rounded(kind, &random_vec(n * inp, 25)),
            rounded(kind, &random_vec(n * out, 26)),
        );
        let b = Some(out * inp);
        let params_gpu = up(&g, &params);
        let scale = 2.0 * ulp;
        // The weights f32 (converted for the product), or the half copy as mixed precision
        // keeps them: then the bias and ReLU are applied in cuBLASLt's epilogue, the bias in
        // the half format, as autocast adds it.
        let params_half = up_half(&g, kind, &params);
        for (weights, then) in [
            (&params_gpu, None),
            (&params_half, None),
            (&params_half, Some(Activation::Relu)),
        ] {
            let mut y_cpu = vec![0.0; n * out];
            CPU.linear_forward(&px, &params, 0, b, &mut y_cpu, n, inp, out, then);
            let mut yh = poisoned_half(&g, kind, n * out);
            let xh = up_half(&g, kind, &px);
            g.linear_forward(&xh, weights, 0, b, &mut yh, n, inp, out, then);
            let what = format!("linear forward, then {then:?}");
            assert_within(
                &down(&g, &yh, n * out),
                &rounded(kind, &y_cpu),
                scale,
                &what,
            );
        }
        // As a step's first backward pass writes them.
        let overwrite = GradWrite::Overwrite;
        let grads0 = stale_grads(random_vec(params.len(), 27), params.len(), overwrite);
        let (mut grads_cpu, mut dx_cpu) = (grads0.clone(), vec![0.0; n * inp]);
        let dx = Some(&mut dx_cpu);
        let grads = &mut grads_cpu;
        CPU.linear_backward(&px, &pdy, &params, grads, overwrite, 0, b, dx, n, inp, out);
        let (mut grads_gpu, mut dxh) = (up(&g, &grads0), poisoned_half(&g, kind, n * inp));
        let (xh, dyh) = (up_half(&g, kind, &px), up_half(&g, kind, &pdy));
        let dx = Some(&mut dxh);
        g.linear_backward(
            &xh,
            &dyh,
            &params_gpu,
            &mut grads_gpu,
            overwrite,
            0,
            b,
            dx,
            n,
            inp,
            out,
        );
        assert_close(
            &down(&g, &grads_gpu, params.len()),
            &grads_cpu,
            "linear dW/db",
        );
        assert_within(
            &down(&g, &dxh, n * inp),
            &rounded(kind, &dx_cpu),
            scale,
            "linear dx",
        );
        g.set_half_matmuls(None);

        // The loss reads half-width logits and writes a half-width gradient.
        let (rows, classes) = (50, 10);
        let logits = rounded(kind, &random_vec(rows * classes, 28));
        let labels: Vec<f32> = (0..rows).map(|r| (r * 7 % classes) as f32).collect();
        let f = LossFn::CrossEntropy {
            label_smoothing: 0.1,
            ignore_index: Some(4),
        };
        let (mut stats_cpu, mut dout_cpu) = (CPU.new_stats().unwrap(), vec![0.0; rows * classes]);
        CPU.loss(
            f,
            &logits,
            &labels,
            rows,
            classes,
            0.5,
            Some(&mut dout_cpu),
            &mut stats_cpu,
        );
        let (mut stats_gpu, mut douth) = (
            g.new_stats().unwrap(),
            poisoned_half(&g, kind, rows * classes),
        );
        let (logits_gpu, labels_gpu) = (up_half(&g, kind, &logits), up(&g, &labels));
        g.loss(
            f,
            &logits_gpu,
            &labels_gpu,
            rows,
            classes,
            0.5,
            Some(&mut douth),
            &mut stats_gpu,
        );
        let dout = down(&g, &douth, rows * classes);
        assert_within(
            &dout,
            &rounded(kind, &dout_cpu),
            ulp,
            "cross-entropy gradient",
        );
        let (a, b) = (CPU.take_stats(&mut stats_cpu), g.take_stats(&mut stats_gpu));
        assert!(
            (a.loss_sum - b.loss_sum).abs() <= 1e-5 * a.loss_sum,
            "loss {a:?} vs {b:?}"
        );
        g.status().unwrap();
    }
}

/// An optimizer update's targets: the parameters, and their half copy when one is given.
fn targets<'a, Buf>(
    params: &'a mut Buf,
    copy: Option<&'a mut (Buf, HalfKind)>,
) -> UpdatedParams<'a, Buf> {
    UpdatedParams {
        params,
        half_copy: copy.map(|(buf, kind)| (buf, *kind)),
    }
}

/// The GPU's half copy holds its own parameters rounded, bit for bit (the refresh fused into
/// the update), and the CPU's its own.
fn assert_half_copies(
    g: &CudaBackend,
    gpu: (&CudaBuf, Option<&(CudaBuf, HalfKind)>),
    cpu: (&[f32], Option<&(Vec<f32>, HalfKind)>),
    what: &str,
) {
    let n = cpu.0.len();
    if let (Some((copy_gpu, kind)), Some((copy_cpu, _))) = (gpu.1, cpu.1) {
        let p_gpu = down(g, gpu.0, n);
        assert_bits(&down(g, copy_gpu, n), &rounded(*kind, &p_gpu), what);
        assert_bits(copy_cpu, &rounded(*kind, cpu.0), what);
    }
}

#[test]
fn optimizer_updates_match_the_cpu() {
    let Some(g) = gpu() else { return };
    let n = 123_457;
    let p0 = random_vec(n, 12);
    let grads: Vec<Vec<f32>> = (0..3).map(|s| random_vec(n, 13 + s)).collect();
    // Each case with no half copy, or one in f16 or bf16 (poisoned: every value is written).
    let copies = |kind: Option<HalfKind>| {
        kind.map(|k| ((vec![f32::NAN; n], k), (poisoned_half(&g, k, n), k)))
            .unzip()
    };
    for (momentum, dampening, nesterov, wd, copy) in [
        (0.0, 0.0, false, 0.0, None),
        (0.9, 0.1, false, 0.01, Some(HalfKind::F16)),
        (0.9, 0.0, true, 0.001, Some(HalfKind::Bf16)),
        (0.0, 0.0, false, 0.01, Some(HalfKind::Bf16)),
    ] {
        let (mut p_cpu, mut m_cpu) = (p0.clone(), vec![0.0; if momentum > 0.0 { n } else { 0 }]);
        let (mut p_gpu, mut m_gpu) = (up(&g, &p0), g.alloc(m_cpu.len()).unwrap());
        let (mut copy_cpu, mut copy_gpu) = copies(copy);
        for (step, grad) in grads.iter().enumerate() {
            let h = SgdStep {
                momentum,
                dampening,
                nesterov,
                weight_decay: wd,
            };
            let args = SgdStep::args(0.05, step == 0);
            let out = targets(&mut p_cpu, copy_cpu.as_mut());
            CPU.sgd_step(out, grad, &mut m_cpu, &h, &args.to_vec(), None);
            let out = targets(&mut p_gpu, copy_gpu.as_mut());
            g.sgd_step(out, &up(&g, grad), &mut m_gpu, &h, &up(&g, &args), None);
        }
        let what = format!("sgd momentum={momentum} nesterov={nesterov} half copy={copy:?}");
        assert_close(&down(&g, &p_gpu, n), &p_cpu, &what);
        let gpu = (&p_gpu, copy_gpu.as_ref());
        assert_half_copies(&g, gpu, (&p_cpu, copy_cpu.as_ref()), &what);
    }
    for (decoupled, copy) in [
        (false, None),
        (true, Some(HalfKind::Bf16)),
        (false, Some(HalfKind::F16)),
    ] {
        let (mut p_cpu, mut m_cpu, mut v_cpu) = (p0.clone(), vec![0.0; n], vec![0.0; n]);
        let (mut p_gpu, mut m_gpu, mut v_gpu) =
            (up(&g, &p0), g.alloc(n).unwrap(), g.alloc(n).unwrap());
        let (mut copy_cpu, mut copy_gpu) = copies(copy);
        for (step, grad) in grads.iter().enumerate() {
            let h = AdamStep {
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.01,
                decoupled,
            };
            let args = h.args(1e-3, step as u64 + 1);
            let out = targets(&mut p_cpu, copy_cpu.as_mut());
            CPU.adam_step(out, grad, &mut m_cpu, &mut v_cpu, &h, &args.to_vec(), None);
            let out = targets(&mut p_gpu, copy_gpu.as_mut());
            let (grad, args) = (up(&g, grad), up(&g, &args));
            g.adam_step(out, &grad, &mut m_gpu, &mut v_gpu, &h, &args, None);
        }
        let what = format!("adam decoupled={decoupled} half copy={copy:?}");
        assert_close(&down(&g, &p_gpu, n), &p_cpu, &format!("{what} params"));
        assert_close(&down(&g, &v_gpu, n), &v_cpu, &format!("{what} exp_avg_sq"));
        let gpu = (&p_gpu, copy_gpu.as_ref());
        assert_half_copies(&g, gpu, (&p_cpu, copy_cpu.as_ref()), &what);
    }
    // A half copy in the wrong format is refused, not written as if it were right.
    let mut wrong = (g.alloc_half(HalfKind::F16, n).unwrap(), HalfKind::Bf16);
    let h = SgdStep {
        momentum: 0.0,
        dampening: 0.0,
        nesterov: false,
        weight_decay: 0.0,
    };
    let (mut p, grad) = (up(&g, &p0), up(&g, &grads[0]));
    let args = up(&g, &SgdStep::args(0.05, true));
    g.sgd_step(
        targets(&mut p, Some(&mut wrong)),
        &grad,
        &mut g.alloc(0).unwrap(),
        &h,
        &args,
        None,
    );
    let err = g.status().unwrap_err().to_string();
    assert!(err.contains("half copy"), "{err}");
}

/// Train rows (step, loss) of a job run through the CLI on a device, one row per step.
pub(crate) fn loss_curve(device: &str, extra: &[&str]) -> Vec<(u64, f64)> {
    train_rows(&run_mlp_job(device, extra).path().join("run"))
}

/// A run directory (under the returned temporary directory, as "run") of jobs/mlp.toml
/// for 100 steps on a device, logging every step.
fn run_mlp_job(device: &str, extra: &[&str]) -> tempfile::TempDir {
    let runs = tempfile::tempdir().unwrap();
    let mut args = vec!["--runs-dir", runs.path().to_str().unwrap()];
    args.extend_from_slice(extra);
    let dir = mlp_job(device, &args);
    std::fs::rename(dir, runs.path().join("run")).unwrap();
    runs
}

/// `trainer run jobs/mlp.toml` for 100 steps on a device, a row per step, with `extra`
/// arguments; it must succeed. Returns the run directory it printed.
fn mlp_job(device: &str, extra: &[&str]) -> std::path::PathBuf {
    let device_set = format!("device.type=\"{device}\"");
    let mut args = vec!["run", "jobs/mlp.toml", "-q", "--set", &device_set];
    args.extend(["--set", "train.max_steps=100", "--set", "train.log_every=1"]);
    args.extend_from_slice(extra);
    let out = std::process::Command::new(common::trainer_bin())
        .args(&args)
        .current_dir(common::root())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{device} {extra:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::path::PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

fn train_rows(run: &std::path::Path) -> Vec<(u64, f64)> {
    let metrics = std::fs::read_to_string(run.join("metrics.csv")).unwrap();
    metrics
        .lines()
        .skip(1)
        .map(|l| l.split(',').collect::<Vec<_>>())
        .filter(|r| r[2] == "train")
        .map(|r| (r[0].parse().unwrap(), r[3].parse().unwrap()))
        .collect()
}

#[test]
fn mlp_job_on_cuda_follows_the_cpu_loss_curve() {
    if gpu().is_none() {
        return;
    }
    // A model over sequences: each 8x8 digit as 8 rows of 8, linear and layer norm per row.
    let sequence = [
        "--set",
        "model.input_shape=[8,8]",
        "--set",
        "model.layers=[{type=\"linear\",out=16},{type=\"gelu\"},{type=\"layernorm\"},{type=\"linear\",out=8},{type=\"flatten\"},{type=\"linear\",out=10}]",
    ];
    for extra in [&[][..], &["--set", "model.layers=[{type=\"flatten\"},{type=\"linear\",out=64},{type=\"gelu\"},{type=\"dropout\",p=0.2},{type=\"linear\",out=10}]"][..], &sequence[..]] {
        let cpu = loss_curve("cpu", extra);
        let cuda = loss_curve("cuda", extra);
        assert_eq!(cpu.len(), 100);
        assert_eq!(cpu.iter().map(|r| r.0).collect::<Vec<_>>(), cuda.iter().map(|r| r.0).collect::<Vec<_>>());
        for ((step, a), (_, b)) in cpu.iter().zip(&cuda) {
            assert!((a - b).abs() <= 1e-4 * a.abs(), "step {step}: cpu loss {a} vs cuda {b} ({extra:?})");
        }
    }
}

/// CUDA graphs replay the same kernels on the same buffers: the same bits as running op by
/// op, for plain fp32, gradient accumulation, fp16 with dynamic loss scaling (a recording per
/// scale) and batch norm (running statistics updated by every replay).
#[test]
fn cuda_graphs_give_the_same_bits_as_op_by_op_and_are_used() {
    if gpu().is_none() {
        return;
    }
    let batch_norm = "model.layers=[{type=\"flatten\"},{type=\"linear\",out=64},\
        {type=\"batchnorm1d\"},{type=\"relu\"},{type=\"linear\",out=10}]";
    let cases: [&[&str]; 4] = [
        &[],
        &["--set", "train.grad_accum_steps=2"],
        &[
            "--set",
            "precision.mode=\"fp16\"",
            "--set",
            "precision.growth_interval=20",
        ],
        &["--set", batch_norm],
    ];
    for extra in cases {
        let graphs = run_mlp_job("cuda", extra);
        let mut op_by_op_args = extra.to_vec();
        op_by_op_args.extend(["--set", "device.cuda_graphs=false"]);
        let op_by_op = run_mlp_job("cuda", &op_by_op_args);
        let (a, b) = (graphs.path().join("run"), op_by_op.path().join("run"));
        assert_eq!(train_rows(&a), train_rows(&b), "{extra:?}");
        assert_eq!(
            std::fs::read(a.join("model.safetensors")).unwrap(),
            std::fs::read(b.join("model.safetensors")).unwrap(),
            "{extra:?}"
        );
        let recordings = |run: &std::path::Path, what: &str| {
            let s: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap())
                    .unwrap();
            s[what].as_u64().unwrap()
        };
        let (step, update) = ("cuda_graph_recordings", "cuda_graph_update_recordings");
        assert!(
            recordings(&a, step) >= 1,
            "{extra:?}: the step was never recorded"
        );
        // fp16 reads the norm back every step (the inf check): its update runs op by op.
        let fp16 = extra.contains(&"precision.mode=\"fp16\"");
        assert_eq!(
            recordings(&a, update) >= 1,
            !fp16,
            "{extra:?}: update recordings"
        );
        assert_eq!(
            recordings(&b, step) + recordings(&b, update),
            0,
            "{extra:?}"
        );
    }
    // Dropout draws a new mask every step: no recording, and the log says why.
    let dropout = "model.layers=[{type=\"flatten\"},{type=\"linear\",out=64},\
        {type=\"dropout\",p=0.2},{type=\"linear\",out=10}]";
    let run = run_mlp_job("cuda", &["--set", dropout]);
    let log = std::fs::read_to_string(run.path().join("run/train.log")).unwrap();
    assert!(
        log.contains("CUDA graphs off: model.layers[2] (dropout)"),
        "{log}"
    );
}

/// A data set streamed from pinned host memory puts the same values in the same buffers as
/// one gathered on the device: the same bits, with CUDA graphs on and off, and when the host
/// runs ahead of the GPU (rare log steps, three micro-batches a step: every staging buffer
/// is refilled while copies are queued, so it must wait for the copy that read it).
#[test]
fn a_streamed_data_set_trains_what_a_resident_one_trains() {
    if gpu().is_none() {
        return;
    }
    let cases: [&[&str]; 3] = [
        &["--set", "device.cuda_graphs=true"],
        &["--set", "device.cuda_graphs=false"],
        &[
            "--set",
            "train.log_every=50",
            "--set",
            "train.grad_accum_steps=3",
        ],
    ];
    for case in cases {
        let what = case.join(" ");
        let resident = run_mlp_job("cuda", case);
        let streamed_sets = [case, &["--set", "device.data=\"streamed\""]].concat();
        let streamed = run_mlp_job("cuda", &streamed_sets);
        let (a, b) = (resident.path().join("run"), streamed.path().join("run"));
        assert_eq!(train_rows(&a), train_rows(&b), "{what}");
        assert_eq!(
            std::fs::read(a.join("model.safetensors")).unwrap(),
            std::fs::read(b.join("model.safetensors")).unwrap(),
            "{what}"
        );
        let log = std::fs::read_to_string(b.join("train.log")).unwrap();
        assert!(
            log.contains("data: streamed from pinned host memory"),
            "{log}"
        );
    }
}

#[test]
fn mixed_precision_jobs_on_cuda_follow_the_cpu_loss_curve() {
    if gpu().is_none() {
        return;
    }
    for mode in ["fp16", "bf16"] {
        let set = format!("precision.mode=\"{mode}\"");
        let cpu = loss_curve("cpu", &["--set", &set]);
        let cuda = loss_curve("cuda", &["--set", &set]);
        assert_eq!(cpu.len(), 100);
        // GEMMs sum in another order, so a value can round to the other neighbouring half:
        // the curves agree to the half format's precision, not to fp32's.
        for ((step, a), (_, b)) in cpu.iter().zip(&cuda) {
            assert!(
                (a - b).abs() <= 2e-2 * a.abs(),
                "{mode} step {step}: cpu loss {a} vs cuda {b}"
            );
        }
    }
}

/// Conv, pooling and the norms, with activations and their gradients in f32 buffers and in
/// mixed precision's half-width ones (the CPU's inputs and results then rounded as the
/// network rounds them, and conv's products on tensor cores from half-width weights).
#[test]
fn conv2d_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    for storage in STORAGES {
        conv2d_in(&g, storage);
    }
}

fn conv2d_in(g: &CudaBackend, storage: Option<HalfKind>) {
    use trainer::tensor::Conv2d;
    let cpu = CpuBackend::new(2);
    let (tol, at) = (tolerance(storage), format!("{storage:?}"));
    let convs = [
        Conv2d {
            c: 3,
            h: 13,
            w: 11,
            o: 8,
            kh: 3,
            kw: 3,
            stride: (1, 1),
            pad: (1, 1),
            dil: (1, 1),
            groups: 1,
        },
        Conv2d {
            c: 4,
            h: 9,
            w: 9,
            o: 6,
            kh: 3,
            kw: 2,
            stride: (2, 1),
            pad: (1, 0),
            dil: (1, 2),
            groups: 2,
        },
        Conv2d {
            c: 32,
            h: 14,
            w: 14,
            o: 64,
            kh: 3,
            kw: 3,
            stride: (1, 1),
            pad: (1, 1),
            dil: (1, 1),
            groups: 1,
        },
    ];
    let n = 5;
    // As in mixed precision: products on tensor cores, weights from the half copy (itself
    // half-width).
    g.set_half_matmuls(storage);
    for s in convs {
        let (oh, ow) = s.out_hw().unwrap();
        let (in_len, out_len) = (n * s.c * s.h * s.w, n * s.o * oh * ow);
        let params = stored(storage, &random_vec(s.weight_len() + s.o, 20));
        let bias = Some(s.weight_len());
        let (x, dy) = (random_vec(in_len, 21), random_vec(out_len, 22));
        let (x, dy) = (stored(storage, &x), stored(storage, &dy));
        let mut ws_cpu = vec![0.0; cpu.conv_workspace_len(&s, n)];
        let mut ws_gpu = g.alloc(g.conv_workspace_len(&s, n)).unwrap();
        let mut y_cpu = vec![f32::NAN; out_len];
        cpu.conv2d_forward(&s, &x, &params, 0, bias, &mut y_cpu, n, &mut ws_cpu);
        let (xg, pg) = (up_in(g, storage, &x), up_in(g, storage, &params));
        let mut yg = poisoned_in(g, storage, out_len);
        g.conv2d_forward(&s, &xg, &pg, 0, bias, &mut yg, n, &mut ws_gpu);
        assert_within(
            &down(g, &yg, out_len),
            &stored(storage, &y_cpu),
            tol,
            &format!("{at} conv {s:?} forward"),
        );
        for dw_write in [GradWrite::Add, GradWrite::Overwrite] {
            let grads0 = stale_grads(random_vec(params.len(), 23), params.len(), dw_write);
            let (mut gr_cpu, mut dx_cpu) = (grads0.clone(), vec![f32::NAN; in_len]);
            cpu.conv2d_backward(
                &s,
                &x,
                &dy,
                &params,
                &mut gr_cpu,
                dw_write,
                0,
                bias,
                Some(&mut dx_cpu),
                n,
                &mut ws_cpu,
            );
            let (mut gr_gpu, mut dxg) = (up(g, &grads0), poisoned_in(g, storage, in_len));
            g.conv2d_backward(
                &s,
                &xg,
                &up_in(g, storage, &dy),
                &pg,
                &mut gr_gpu,
                dw_write,
                0,
                bias,
                Some(&mut dxg),
                n,
                &mut ws_gpu,
            );
            assert_close(
                &down(g, &gr_gpu, params.len()),
                &gr_cpu,
                &format!("{at} conv {s:?} {dw_write:?} dW/db"),
            );
            assert_within(
                &down(g, &dxg, in_len),
                &stored(storage, &dx_cpu),
                tol,
                &format!("{at} conv {s:?} dx"),
            );
        }
    }
    g.set_half_matmuls(None);
}

#[test]
fn graph_ops_match_the_cpu() {
    let Some(g) = gpu() else { return };
    // add_assign over a length that is not a multiple of the block size.
    let (a, b) = (random_vec(10_007, 30), random_vec(10_007, 31));
    let mut on_gpu = up(&g, &b);
    g.add_assign(&up(&g, &a), &mut on_gpu, 10_000);
    let mut on_cpu = b.clone();
    CPU.add_assign(&a, &mut on_cpu, 10_000);
    assert_eq!(down(&g, &on_gpu, b.len()), on_cpu, "add_assign");

    // copy_rows as concat forward (into columns 5..12 of rows of 20) and backward (added).
    let (rows, width) = (37, 7);
    let src = random_vec(rows * width, 32);
    let dst = random_vec(rows * 20, 33);
    for add in [false, true] {
        let mut on_gpu = up(&g, &dst);
        g.copy_rows(
            &up(&g, &src),
            (width, 0),
            &mut on_gpu,
            (20, 5),
            width,
            rows,
            add,
        );
        let mut on_cpu = dst.clone();
        CPU.copy_rows(&src, (width, 0), &mut on_cpu, (20, 5), width, rows, add);
        assert_eq!(down(&g, &on_gpu, dst.len()), on_cpu, "copy_rows add={add}");
    }
}

/// jobs/mlp.toml's model as a small residual conv net on the 8x8 digits: batch norm, an add,
/// a concat, global average pooling.
const RESIDUAL_NET: &str =
    "model.layers=[{type=\"conv2d\",out=8,kernel_size=3,padding=1,bias=false},\
    {type=\"batchnorm2d\"},{type=\"relu\",name=\"x\"},\
    {type=\"conv2d\",out=8,kernel_size=3,padding=1,name=\"c\"},{type=\"batchnorm2d\",name=\"bn\"},\
    {type=\"add\",inputs=[\"bn\",\"x\"]},{type=\"relu\",name=\"y\"},\
    {type=\"concat\",inputs=[\"y\",\"x\"]},{type=\"global_avg_pool\"},{type=\"flatten\"},\
    {type=\"linear\",out=10},{type=\"log_softmax\"}]";

#[test]
fn resnet_with_batch_norm_on_cuda_follows_the_cpu_loss_curve() {
    if gpu().is_none() {
        return;
    }
    let cpu = loss_curve("cpu", &["--set", RESIDUAL_NET]);
    let cuda = loss_curve("cuda", &["--set", RESIDUAL_NET]);
    assert_eq!(cpu.len(), 100);
    for ((step, a), (_, b)) in cpu.iter().zip(&cuda) {
        assert!(
            (a - b).abs() <= 1e-3 * a.abs(),
            "step {step}: cpu loss {a} vs cuda {b}"
        );
    }
}

/// `trainer check`'s plan of device memory is what a run uses: summary.json's
/// device_memory_peak_bytes (every byte the run allocated on the GPU: cuBLAS's workspace,
/// the backend's statistics and indices, every buffer) is memory_planned_bytes to the
/// byte, for an MLP and a residual conv net, in fp32 and bf16, with activation
/// checkpointing and with gradient accumulation. The plan decides whether a job fits and
/// whether its data set stays on the device: a buffer left out of it would make both wrong.
#[test]
fn the_planned_device_memory_is_what_a_run_uses() {
    if gpu().is_none() {
        return;
    }
    let bf16 = "precision.mode=\"bf16\"";
    let attention = [
        "--set",
        "model.input_shape=[8,8]",
        "--set",
        "model.layers=[{type=\"linear\",out=24},{type=\"attention\",heads=2},\
         {type=\"flatten\"},{type=\"linear\",out=10}]",
    ];
    let flash = [&attention[..], &["--set", "device.flash_attention=true"]].concat();
    let cases: [(&str, &[&str]); 8] = [
        ("attention", &attention),
        ("flash attention", &flash),
        ("mlp fp32", &[]),
        ("mlp bf16", &["--set", bf16]),
        ("conv net fp32", &["--set", RESIDUAL_NET]),
        ("conv net bf16", &["--set", RESIDUAL_NET, "--set", bf16]),
        (
            "conv net, 2 segments recomputed",
            &[
                "--set",
                RESIDUAL_NET,
                "--set",
                "checkpoint.activations={segments=2}",
            ],
        ),
        (
            "mlp, 3 micro-batches",
            &["--set", "train.grad_accum_steps=3"],
        ),
    ];
    for (what, extra) in cases {
        let mut args = vec!["--set", "train.max_steps=10"];
        args.extend_from_slice(extra);
        let runs = run_mlp_job("cuda", &args);
        let text = std::fs::read_to_string(runs.path().join("run/summary.json")).unwrap();
        let summary: serde_json::Value = serde_json::from_str(&text).unwrap();
        let bytes = |key: &str| {
            summary[key]
                .as_f64()
                .unwrap_or_else(|| panic!("{what}: {key}"))
        };
        let (planned, used) = (
            bytes("memory_planned_bytes"),
            bytes("device_memory_peak_bytes"),
        );
        assert_eq!(planned, used, "{what}: planned bytes, used");
    }
}

/// Issue 4 on CUDA: a run resumed from a mid-run checkpoint (the rows after it still in
/// metrics.csv, as a crash leaves them) gives the uninterrupted run's rows and bit-identical
/// final weights: every kernel is deterministic (fixed-order reductions, no atomics), and
/// the CUDA graph replays what ran op by op. With dropout, so the RNG state is restored too.
#[test]
fn a_resumed_cuda_run_gives_the_uninterrupted_run_exactly() {
    if gpu().is_none() {
        return;
    }
    let dropout = "model.layers=[{type=\"flatten\"},{type=\"linear\",out=64},\
        {type=\"relu\"},{type=\"dropout\",p=0.2},{type=\"linear\",out=10}]";
    for extra in [&[][..], &["--set", dropout][..]] {
        let mut args = extra.to_vec();
        args.extend([
            "--set",
            "checkpoint.every_steps=30",
            "--set",
            "checkpoint.keep_last=10",
        ]);
        let reference = run_mlp_job("cuda", &args);
        let whole = reference.path().join("run");
        let crashed = tempfile::tempdir().unwrap();
        let dir = crashed.path().join("run");
        std::fs::create_dir_all(dir.join("checkpoints")).unwrap();
        for name in ["metrics.csv", "config.toml", "train.log"] {
            std::fs::copy(whole.join(name), dir.join(name)).unwrap();
        }
        let name = "step-00000060.safetensors";
        let checkpoint = dir.join("checkpoints").join(name);
        std::fs::copy(whole.join("checkpoints").join(name), &checkpoint).unwrap();
        let mut resume = vec!["--resume", checkpoint.to_str().unwrap()];
        resume.extend_from_slice(&args);
        assert_eq!(
            mlp_job("cuda", &resume),
            dir,
            "a resumed run continues in its directory"
        );
        assert_eq!(train_rows(&dir), train_rows(&whole), "{extra:?}");
        assert!(
            std::fs::read(dir.join("model.safetensors")).unwrap()
                == std::fs::read(whole.join("model.safetensors")).unwrap(),
            "{extra:?}: final weights differ"
        );
    }
}

/// Mixed precision on a GPU older than its format (bf16 needs compute capability 8.0, fp16
/// 7.0): refused with exit 2, naming the mode, the GPU and the way out, or with
/// precision.fallback = "fp32" trained in fp32 with a warning (the resolved config says so).
/// The older GPU is the emulated one (TRAINER_EMULATED_CC); a real one skips.
#[test]
fn half_precision_on_an_older_gpu_is_refused_or_falls_back_to_fp32() {
    if !common::on_emulated_gpu("a GPU posing as compute capability 7.5") {
        return;
    }
    let runs = tempfile::tempdir().unwrap();
    let turing = [("TRAINER_EMULATED_CC", "7.5")];
    let run = |extra: &[&str]| {
        let mut args = vec!["run", "jobs/mlp.toml", "-q", "--runs-dir"];
        args.push(runs.path().to_str().unwrap());
        args.extend([
            "--set",
            "device.type=\"cuda\"",
            "--set",
            "train.max_steps=5",
        ]);
        args.extend_from_slice(extra);
        common::trainer_with_env(&args, &turing)
    };
    let refused = run(&["--set", "precision.mode=\"bf16\""]);
    let err = common::stderr(&refused);
    assert_eq!(refused.status.code(), Some(2), "{err}");
    assert!(
        err.contains("precision.mode = \"bf16\" needs a GPU of compute capability 8.0 or newer")
            && err.contains("is 7.5")
            && err.contains("precision.fallback = \"fp32\""),
        "{err}"
    );
    let fallback = [
        "--set",
        "precision.mode=\"bf16\"",
        "--set",
        "precision.fallback=\"fp32\"",
    ];
    let fell_back = run(&fallback);
    let err = common::stderr(&fell_back);
    assert!(fell_back.status.success(), "{err}");
    assert!(
        err.contains("training in fp32 (precision.fallback = \"fp32\")"),
        "{err}"
    );
    let dir = String::from_utf8_lossy(&fell_back.stdout)
        .trim()
        .to_string();
    let config = std::fs::read_to_string(std::path::Path::new(&dir).join("config.toml")).unwrap();
    assert!(config.contains("[precision]\nmode = \"fp32\""), "{config}");
    // fp16 is within a 7.5 GPU's reach.
    let fp16 = run(&["--set", "precision.mode=\"fp16\""]);
    assert!(fp16.status.success(), "{}", common::stderr(&fp16));
}

/// A device fault mid-run (an illegal address, which CUDA makes sticky) fails the run with
/// exit 1, an error that says the fault is earlier work's and how to find the culprit, and
/// how to continue: the checkpoints remain, and resuming from them gives the uninterrupted
/// run. With CUDA_LAUNCH_BLOCKING=1 and no CUDA graphs the error names the failing op. The
/// fault is injected by the emulated GPU (tests/emulated_cuda, TRAINER_EMULATED_FAULT); on a
/// real one this test skips.
#[test]
fn a_device_fault_fails_the_run_and_its_checkpoints_resume() {
    if !common::on_emulated_gpu("injected device faults") {
        return;
    }
    let keep = [
        "--set",
        "checkpoint.every_steps=30",
        "--set",
        "checkpoint.keep_last=10",
    ];
    let reference = run_mlp_job("cuda", &keep);
    let runs = tempfile::tempdir().unwrap();
    let runs_dir = runs.path().to_str().unwrap();
    let mut args = vec!["run", "jobs/mlp.toml", "-q", "--runs-dir", runs_dir];
    args.extend([
        "--set",
        "device.type=\"cuda\"",
        "--set",
        "train.max_steps=100",
    ]);
    args.extend(["--set", "train.log_every=1"]);
    args.extend(keep);
    // The fault hits step 75's loss kernel: found in the trace of a run op by op, whose
    // kernels are the ones a run with CUDA graphs executes, in the same order.
    let traced = tempfile::tempdir().unwrap();
    let trace = traced.path().join("trace");
    let mut op_by_op = args.clone();
    let at = args.iter().position(|a| *a == runs_dir).unwrap();
    op_by_op[at] = traced.path().to_str().unwrap();
    op_by_op.extend(["--set", "device.cuda_graphs=false"]);
    let out = common::trainer_with_env(
        &op_by_op,
        &[("TRAINER_EMULATED_TRACE", trace.to_str().unwrap())],
    );
    assert!(out.status.success(), "{}", common::stderr(&out));
    let trace = std::fs::read_to_string(trace).unwrap();
    let kernels = trace.lines().filter(|l| l.starts_with("kernel "));
    let losses = kernels
        .enumerate()
        .filter(|(_, l)| *l == "kernel cross_entropy");
    let nth = losses
        .map(|(at, _)| at + 1)
        .nth(74)
        .expect("100 steps of losses")
        .to_string();
    let fault = [("TRAINER_EMULATED_FAULT", nth.as_str())];
    let failed = common::trainer_with_env(&args, &fault);
    let err = common::stderr(&failed);
    assert_eq!(failed.status.code(), Some(1), "{err}");
    assert!(err.contains("CUDA_ERROR_ILLEGAL_ADDRESS"), "{err}");
    assert!(err.contains("rerun with CUDA_LAUNCH_BLOCKING=1"), "{err}");
    assert!(
        err.contains("(the newest at step 60); continue with: trainer run --resume"),
        "{err}"
    );
    let run = std::fs::read_dir(runs.path().join("mlp"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let summary = std::fs::read_to_string(run.join("summary.json")).unwrap();
    assert!(summary.contains("\"status\": \"failed\""), "{summary}");

    let mut resume = vec!["--resume", run.to_str().unwrap()];
    resume.extend(keep);
    assert_eq!(
        mlp_job("cuda", &resume),
        run,
        "a resumed run continues in its directory"
    );
    let whole = reference.path().join("run");
    assert_eq!(train_rows(&run), train_rows(&whole));
    assert!(
        std::fs::read(run.join("model.safetensors")).unwrap()
            == std::fs::read(whole.join("model.safetensors")).unwrap(),
        "final weights differ"
    );

    // Every call waiting for its work, op by op: the error names the op that faulted.
    let blocking = tempfile::tempdir().unwrap();
    let mut args: Vec<&str> = args.clone();
    args[at] = blocking.path().to_str().unwrap();
    args.extend(["--set", "device.cuda_graphs=false"]);
    let failed = common::trainer_with_env(&args, &[fault[0], ("CUDA_LAUNCH_BLOCKING", "1")]);
    let err = common::stderr(&failed);
    assert_eq!(failed.status.code(), Some(1), "{err}");
    // Op by op, the faulting kernel is the loss's.
    assert!(
        err.contains("kernel cross_entropy: an illegal address (injected"),
        "{err}"
    );
    assert!(err.contains("error: CUDA: cross-entropy failed"), "{err}");
    assert!(!err.contains("rerun with"), "{err}");
}

/// A linear layer's product adds its bias, and applies the ReLU after it, in cuBLASLt's
/// epilogue: the forward pass queues no bias fill and no ReLU pass, in fp32 and bf16, and
/// `device.fused_epilogues = false` queues them again, with the same losses; so does a
/// cuBLASLt that has no algorithm for a product, or refuses the one it offered (a warning
/// says so). The emulated GPU's trace (TRAINER_EMULATED_TRACE) shows what a job queues, and
/// TRAINER_EMULATED_CUBLASLT makes its cuBLASLt fail; on a real GPU this skips (there
/// `bench/gpu.sh` measures the difference).
#[test]
fn linear_layers_add_their_bias_and_relu_in_the_products_epilogue() {
    if !common::on_emulated_gpu("a trace of the work queued and a failing cuBLASLt") {
        return;
    }
    for mode in ["fp32", "bf16"] {
        // The queued work, the losses and stderr of 20 steps of jobs/mlp.toml.
        let run_model = |layers: Option<&str>, fused: bool, cublaslt: &str| {
            let runs = tempfile::tempdir().unwrap();
            let trace = runs.path().join("trace");
            let precision = format!("precision.mode=\"{mode}\"");
            let fused = format!("device.fused_epilogues={fused}");
            let mut args = vec!["run", "jobs/mlp.toml", "-q"];
            args.extend(["--runs-dir", runs.path().to_str().unwrap()]);
            args.extend([
                "--set",
                "device.type=\"cuda\"",
                "--set",
                "train.max_steps=20",
            ]);
            args.extend([
                "--set",
                "train.log_every=1",
                "--set",
                &precision,
                "--set",
                &fused,
            ]);
            if let Some(layers) = layers {
                args.extend(["--set", layers]);
            }
            let env = [
                ("TRAINER_EMULATED_TRACE", trace.to_str().unwrap()),
                ("TRAINER_EMULATED_CUBLASLT", cublaslt),
            ];
            let out = common::trainer_with_env(&args, &env);
            let err = common::stderr(&out);
            assert!(out.status.success(), "{err}");
            let run = String::from_utf8(out.stdout).unwrap();
            let losses = train_rows(std::path::Path::new(run.trim()));
            (std::fs::read_to_string(trace).unwrap(), losses, err)
        };
        let run = |fused: bool, cublaslt: &str| run_model(None, fused, cublaslt);
        let count = |trace: &str, what: &str| trace.lines().filter(|l| l.starts_with(what)).count();
        let passes = ["kernel broadcast_rows", "kernel activation_in_place"];
        let (fused, losses, err) = run(true, "");
        assert!(!err.contains("cuBLASLt"), "{mode}: {err}");
        // The hidden layer's product with its bias and the ReLU, the output layer's with its bias.
        assert!(
            count(&fused, "cublasLtMatmul RELU_BIAS") > 0,
            "{mode}: {fused}"
        );
        assert!(count(&fused, "cublasLtMatmul BIAS") > 0, "{mode}: {fused}");
        for pass in passes {
            assert_eq!(count(&fused, pass), 0, "{mode}: {pass} queued");
        }
        assert_eq!(losses.len(), 20);
        let failing = ["no-algorithm", "refuses", "invalid", "bad-attribute"];
        let cases = std::iter::once((false, "")).chain(failing.map(|f| (true, f)));
        for (fused, cublaslt) in cases {
            let case = format!("{mode}, fused_epilogues = {fused}, cuBLASLt {cublaslt:?}");
            let (plain, plain_losses, err) = run(fused, cublaslt);
            assert_eq!(count(&plain, "cublasLtMatmul"), 0, "{case}");
            for pass in passes {
                assert!(count(&plain, pass) > 0, "{case}: no {pass}");
            }
            assert_eq!(losses, plain_losses, "{case}: the losses");
            // Finding no algorithm is normal for some shapes; the rest are said.
            let warned = match cublaslt {
                "refuses" | "invalid" => err.contains("cuBLASLt refused the [128 x 64]·[64 x "),
                _ => err.contains("cuBLASLt could not plan the [128 x 64]·[64 x "),
            };
            assert_eq!(warned, fused && cublaslt != "no-algorithm", "{case}: {err}");
            assert_eq!(
                err.matches("cuBLASLt").count(),
                usize::from(warned),
                "{case}: {err}"
            );
        }
        // Widths that are not multiples of 8: packed back to back, the second layer's
        // bias would sit 8 bytes past a 16-byte boundary in bf16 and take the old passes;
        // each parameter tensor starts aligned, so every layer gets its epilogue.
        let odd = "model.layers=[{type=\"flatten\"},{type=\"linear\",out=100},{type=\"relu\"},\
            {type=\"linear\",out=30},{type=\"relu\"},{type=\"linear\",out=10}]";
        let (fused, _, err) = run_model(Some(odd), true, "");
        assert!(!err.contains("cuBLASLt"), "{mode}: {err}");
        for pass in passes {
            assert_eq!(count(&fused, pass), 0, "{mode}, odd widths: {pass} queued");
        }
    }
}

/// A convolution's products read and write 16-byte aligned operands at any batch size: its
/// workspace holds the im2col matrix, then the products' output, and at an odd batch of an odd
/// plane the second would start off 16 bytes unless the first is padded; cuBLAS then runs its
/// kernels for unaligned data. The emulated GPU's trace marks such a product.
#[test]
fn conv_products_read_aligned_operands_at_an_odd_batch() {
    if !common::on_emulated_gpu("a trace of the operands' alignment") {
        return;
    }
    // 63 rows of 3 channels of 7x7 into a 3x3 kernel: 63 · 49 · 27 values of im2col, an odd
    // count, in fp32 and bf16.
    let odd = "model.layers=[{type=\"conv2d\",out=3,kernel_size=2},{type=\"relu\"},\
        {type=\"conv2d\",out=4,kernel_size=3,padding=1},{type=\"relu\"},{type=\"flatten\"},\
        {type=\"linear\",out=10}]";
    for mode in ["fp32", "bf16"] {
        let runs = tempfile::tempdir().unwrap();
        let trace = runs.path().join("trace");
        let precision = format!("precision.mode=\"{mode}\"");
        let mut args = vec!["run", "jobs/mlp.toml", "-q"];
        args.extend(["--runs-dir", runs.path().to_str().unwrap()]);
        args.extend(["--set", "device.type=\"cuda\"", "--set", odd]);
        args.extend(["--set", "data.batch_size=63", "--set", "train.max_steps=24"]);
        args.extend(["--set", &precision]);
        let env = [("TRAINER_EMULATED_TRACE", trace.to_str().unwrap())];
        let out = common::trainer_with_env(&args, &env);
        assert!(out.status.success(), "{}", common::stderr(&out));
        let trace = std::fs::read_to_string(trace).unwrap();
        let products = trace.lines().filter(|l| l.starts_with("cublas"));
        let unaligned = products
            .clone()
            .filter(|l| l.ends_with(" unaligned"))
            .count();
        assert!(products.count() > 0, "{mode}: {trace}");
        assert_eq!(unaligned, 0, "{mode}: products on unaligned operands");
    }
}

/// Issue 4's activation checkpointing on CUDA: recomputing the segments in the backward pass
/// gives the same bits as keeping every activation (same kernels on the same inputs), with
/// dropout's masks replayed.
#[test]
fn activation_checkpointing_on_cuda_gives_the_same_bits() {
    if gpu().is_none() {
        return;
    }
    let deep = "model.layers=[{type=\"flatten\"},{type=\"linear\",out=64},{type=\"relu\"},\
        {type=\"linear\",out=64},{type=\"gelu\"},{type=\"dropout\",p=0.1},\
        {type=\"linear\",out=64},{type=\"tanh\"},{type=\"linear\",out=10}]";
    let plain = run_mlp_job("cuda", &["--set", deep]);
    for mode in ["\"all\"", "{segments=2}"] {
        let setting = format!("checkpoint.activations={mode}");
        let recomputed = run_mlp_job("cuda", &["--set", deep, "--set", &setting]);
        let (a, b) = (plain.path().join("run"), recomputed.path().join("run"));
        assert_eq!(train_rows(&a), train_rows(&b), "{mode}");
        assert!(
            std::fs::read(a.join("model.safetensors")).unwrap()
                == std::fs::read(b.join("model.safetensors")).unwrap(),
            "{mode}: final weights differ"
        );
    }
}

/// optimizer.weight_decay_on = "matrices": after one step the matrices are where an optimizer
/// decaying everything puts them, and the biases and norm scales where one without weight
/// decay puts them, bit for bit, on the CPU and on CUDA.
#[test]
fn weight_decay_on_matrices_leaves_biases_and_norm_scales_undecayed() {
    use trainer::graph::{DataShape, Graph};
    let job = |kind: &str, wd: f64, on: &str| {
        common::spec(&format!(
            "[data]\nsource = \"synthetic\"\n[model]\nlayers = [{{ type = \"linear\", out = 6 }}, \
             {{ type = \"layernorm\" }}, {{ type = \"linear\", out = 3 }}]\n[optimizer]\n\
             type = \"{kind}\"\nlr = 0.1\nmomentum = {}\nweight_decay = {wd}\nweight_decay_on = \"{on}\"\n",
            if kind == "sgd" { 0.9 } else { 0.0 }
        ))
    };
    let data = DataShape {
        sample_shape: vec![4],
        classes: Some(3),
        classes_from: None,
        target_dim: 1,
    };
    fn one_step<B: Backend>(b: &B, spec: &trainer::spec::JobSpec, graph: &Graph) -> Vec<f32> {
        let n = graph.param_len;
        let mut params = b.upload_vec(random_vec(n, 1)).unwrap();
        let grads = b.upload_vec(random_vec(n, 2)).unwrap();
        let mut optimizer = trainer::train::optimizer_for(b, spec, graph).unwrap();
        optimizer.step(b, targets(&mut params, None), &grads, 0.1);
        let mut out = vec![0.0; n];
        b.download(&params, &mut out);
        out
    }
    let gpu = gpu();
    for kind in ["adamw", "adam", "sgd"] {
        let graph = Graph::build(&job(kind, 0.1, "matrices"), &data).unwrap();
        let matrices = graph.matrix_ranges();
        let is_matrix = |i: usize| matrices.iter().any(|r| r.contains(&i));
        assert!(matrices.len() == 2 && (0..graph.param_len).any(|i| !is_matrix(i)));
        let runs = |b: &dyn Fn(&trainer::spec::JobSpec) -> Vec<f32>| {
            let spec = |wd, on| job(kind, wd, on);
            (
                b(&spec(0.1, "matrices")),
                b(&spec(0.1, "all")),
                b(&spec(0.0, "all")),
            )
        };
        let cpu = CpuBackend::new(1);
        let mut results = vec![runs(&|s| one_step(&cpu, s, &graph))];
        if let Some(g) = &gpu {
            results.push(runs(&|s| one_step(g, s, &graph)));
        }
        for (matrices_only, all, none) in results {
            for i in 0..graph.param_len {
                let want = if is_matrix(i) { all[i] } else { none[i] };
                assert_eq!(
                    matrices_only[i].to_bits(),
                    want.to_bits(),
                    "{kind} parameter {i}"
                );
            }
            assert_ne!(all, none, "{kind}: weight decay changed nothing");
        }
    }
}

/// `trainer sample --device cuda` (the key/value cache from the backend's products and
/// softmax, then windows past the block) writes the CPU's greedy text: 80 tokens after a
/// 1-token prompt, through the block of 64 and past it. So does a Llama, whose rotary layer
/// turns each new token by its position, with and without grouped-query attention.
#[test]
fn sample_on_cuda_writes_what_the_cpu_writes() {
    if !common::gpu_present() {
        return;
    }
    let grouped = [
        "model.blocks.layers[1].out=256",
        "model.blocks.layers[2].kv_heads=2",
        "model.blocks.layers[3].kv_heads=2",
    ];
    for (job, model) in [
        ("gpt_char", &[][..]),
        ("llama_char", &[]),
        ("llama_char", &grouped),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let sets = ["train.max_steps=40", "train.log_every=40"];
        let mut extra: Vec<&str> = (sets.iter().chain(model))
            .flat_map(|s| ["--set", *s])
            .collect();
        extra.extend(["--set", "device.type=\"cpu\""]);
        let job_path = common::root().join(format!("jobs/{job}.toml"));
        let run = common::run_job(&job_path, tmp.path(), &extra);
        let text = |device: &str| {
            let args = [
                "sample",
                run.to_str().unwrap(),
                "--prompt",
                "K",
                "--tokens",
                "80",
                "--top-k",
                "1",
                "--device",
                device,
            ];
            let out = common::trainer(&args);
            assert!(out.status.success(), "{}", common::stderr(&out));
            common::stdout(&out)
        };
        let cpu = text("cpu");
        assert!(cpu.chars().count() >= 81, "{job} {model:?}: {cpu:?}");
        assert_eq!(text("cuda"), cpu, "{job} {model:?}");
    }
}

/// Token ids gathered on the device and from host memory, into ids and into values (a
/// text's targets), against the CPU: windows one token apart, their targets one on. The ids
/// are read back through an embedding whose row i holds i.
#[test]
fn token_id_gathers_match_the_cpu() {
    let Some(g) = gpu() else {
        return;
    };
    let vocab = 50_304;
    let tokens: Vec<u32> = (0..700u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % vocab)
        .collect();
    let table: Vec<f32> = (0..vocab).map(|i| i as f32).collect();
    let (len, batch) = (13, 40);
    let at = |offset| RowsAt {
        len,
        stride: 1,
        offset,
    };
    let on_gpu = g.upload_ids(tokens.clone()).unwrap();
    let gpu_table = up(&g, &table);
    // The ids `ids` holds, as the embedding reads them.
    let read_back = |ids: &CudaIds| {
        let mut y = poisoned(&g, batch * len);
        g.embedding_forward(ids, &gpu_table, 0, &mut y, batch * len, 1);
        down(&g, &y, batch * len)
    };
    for k in 0..9u64 {
        let rows: Vec<u64> = (0..batch as u64).map(|i| (i * 37 + k * 11) % 680).collect();
        let mut want_ids = vec![0u32; batch * len];
        CPU.gather_ids(&tokens, &rows, at(0), IdsInto::Ids(&mut want_ids));
        let want_ids: Vec<f32> = want_ids.iter().map(|&id| id as f32).collect();
        let mut want_targets = vec![f32::NAN; batch * len];
        CPU.gather_ids(&tokens, &rows, at(1), IdsInto::Values(&mut want_targets));

        let mut ids = g.upload_ids(vec![0; batch * len]).unwrap();
        g.gather_ids(&on_gpu, &rows, at(0), IdsInto::Ids(&mut ids));
        assert_eq!(read_back(&ids), want_ids, "gather_ids, round {k}");
        let mut targets = poisoned(&g, batch * len);
        g.gather_ids(&on_gpu, &rows, at(1), IdsInto::Values(&mut targets));
        assert_eq!(
            down(&g, &targets, batch * len),
            want_targets,
            "as values, round {k}"
        );

        // From host memory, through the pinned staging buffers in turn.
        let mut ids = g.upload_ids(vec![0; batch * len]).unwrap();
        g.upload_id_rows(&tokens, &rows, at(0), IdsInto::Ids(&mut ids));
        assert_eq!(read_back(&ids), want_ids, "upload_id_rows, round {k}");
        let mut targets = poisoned(&g, batch * len);
        g.upload_id_rows(&tokens, &rows, at(1), IdsInto::Values(&mut targets));
        assert_eq!(
            down(&g, &targets, batch * len),
            want_targets,
            "uploaded as values, round {k}"
        );
    }
}
