//! attention's tests. The library does not compile this file: tests/suite/ops.rs does, so
//! that its CUDA tests run on the emulated GPU with the rest.

use crate::common::{expect_error, random_vec, spec, stderr, stdout, trainer, trainer_with_env};
use crate::cuda_parity::{
    assert_within, down, gpu, loss_curve, poisoned_in, stored, tolerance, up_in, STORAGES,
};
use crate::gradients::{check_gradients, sequence_job, sequences};
use crate::text::{losses, small_gpt};
use trainer::graph::Graph;
use trainer::ops::attention::{Kernels, ProbsDropout};
use trainer::tensor::cpu::CpuBackend;
use trainer::tensor::{Attention, Backend, HalfKind};

/// Where value e of query head h's part (0 its queries, 1 its keys, 2 its values) lies at
/// position i of sample b: query head h reads key and value head h / (heads / kv_heads).
fn qkv_index(s: &Attention, b: usize, i: usize, part: usize, h: usize, e: usize) -> usize {
    let d = s.head_dim;
    let head = match part {
        0 => h,
        _ => s.heads + (part - 1) * s.kv_heads + h / (s.heads / s.kv_heads),
    };
    (b * s.len + i) * s.qkv_width() + head * d + e
}

/// Attention by its definition, in f64: per sample and head, dropout(softmax(q·kᵀ/√d +
/// mask))·v, the probabilities returned before dropout.
fn reference(
    qkv: &[f32],
    n: usize,
    s: &Attention,
    dropout: Option<ProbsDropout>,
) -> (Vec<f64>, Vec<f64>) {
    let (t, c, d) = (s.len, s.width(), s.head_dim);
    let value = |b: usize, i: usize, part: usize, h: usize, e: usize| {
        qkv[qkv_index(s, b, i, part, h, e)] as f64
    };
    let (mut y, mut probs) = (vec![0.0; n * t * c], vec![0.0; n * s.probs_len()]);
    for b in 0..n {
        for h in 0..s.heads {
            for i in 0..t {
                let scores: Vec<f64> = (0..t)
                    .map(|j| match s.causal && j > i {
                        true => f64::NEG_INFINITY,
                        false => {
                            let dot: f64 = (0..d)
                                .map(|e| value(b, i, 0, h, e) * value(b, j, 1, h, e))
                                .sum();
                            dot / (d as f64).sqrt()
                        }
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let total: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                for (j, score) in scores.iter().enumerate() {
                    let p = (score - max).exp() / total;
                    let at = ((b * s.heads + h) * t + i) * t + j;
                    probs[at] = p;
                    let kept = p * dropout.map_or(1.0, |d| d.factor(at as u64) as f64);
                    for e in 0..d {
                        y[(b * t + i) * c + h * d + e] += kept * value(b, j, 2, h, e);
                    }
                }
            }
        }
    }
    (y, probs)
}

/// The input gradient by its definition, in f64: with P the probabilities and K the kept
/// ones (P times the dropout factors), dV = Kᵀ·dY, dP = (dY·Vᵀ) times the factors,
/// dS = P∘(dP − rowsum(P∘dP))/√d, dQ = dS·K, dK = dSᵀ·Q.
fn reference_backward(
    qkv: &[f32],
    dy: &[f32],
    n: usize,
    s: &Attention,
    dropout: Option<ProbsDropout>,
) -> Vec<f64> {
    let (t, c, d) = (s.len, s.width(), s.head_dim);
    let (_, probs) = reference(qkv, n, s, dropout);
    let at = |b: usize, i: usize, part: usize, h: usize, e: usize| qkv_index(s, b, i, part, h, e);
    let mut dx = vec![0.0f64; qkv.len()];
    for b in 0..n {
        for h in 0..s.heads {
            let p_at = |i: usize, j: usize| ((b * s.heads + h) * t + i) * t + j;
            let factor =
                |i: usize, j: usize| dropout.map_or(1.0, |dr| dr.factor(p_at(i, j) as u64) as f64);
            let g = |i: usize, e: usize| dy[(b * t + i) * c + h * d + e] as f64;
            for i in 0..t {
                let dp: Vec<f64> = (0..t)
                    .map(|j| {
                        let dot: f64 = (0..d)
                            .map(|e| g(i, e) * qkv[at(b, j, 2, h, e)] as f64)
                            .sum();
                        dot * factor(i, j)
                    })
                    .collect();
                let total: f64 = (0..t).map(|j| probs[p_at(i, j)] * dp[j]).sum();
                for j in 0..t {
                    let p = probs[p_at(i, j)];
                    let ds = p * (dp[j] - total) / (d as f64).sqrt();
                    for e in 0..d {
                        dx[at(b, j, 2, h, e)] += p * factor(i, j) * g(i, e);
                        dx[at(b, i, 0, h, e)] += ds * qkv[at(b, j, 1, h, e)] as f64;
                        dx[at(b, j, 1, h, e)] += ds * qkv[at(b, i, 0, h, e)] as f64;
                    }
                }
            }
        }
    }
    dx
}

/// Three bands of query rows on the CPU (64, 64 and 22 rows).
fn banded_shape(causal: bool) -> Attention {
    Attention {
        len: 150,
        heads: 2,
        kv_heads: 2,
        head_dim: 8,
        causal,
        flash: false,
    }
}

/// Grouped-query attention: 4 query heads, 2 key and value heads, over two of flash.cu's
/// 64-row blocks.
fn grouped_shape(causal: bool) -> Attention {
    Attention {
        len: 70,
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
        causal,
        flash: false,
    }
}

/// One key and value head for three query heads (multi-query attention), over three of
/// the CPU's bands.
fn one_kv_head_shape(causal: bool) -> Attention {
    Attention {
        len: 150,
        heads: 3,
        kv_heads: 1,
        head_dim: 8,
        causal,
        flash: false,
    }
}

/// Forward (its output and kept probabilities) and backward, with and without flash and
/// dropout, causal or not, on one band and on several, with as many key and value heads as
/// query heads or fewer, against the definitions in f64.
#[test]
fn attention_and_its_gradient_are_their_definitions() {
    for s in [
        shape(true),
        shape(false),
        long_shape(true),
        banded_shape(true),
        banded_shape(false),
        grouped_shape(true),
        grouped_shape(false),
        one_kv_head_shape(true),
    ] {
        for flash in [false, true] {
            for dropout in [None, Some(DROPOUT)] {
                let (s, n) = (Attention { flash, ..s }, 2);
                let at = format!("{s:?} {dropout:?}");
                let qkv = random_vec(n * s.len * s.qkv_width(), 6);
                let dy = random_vec(n * s.len * s.width(), 7);
                let (y, saved, dx) = cpu_pass(&s, n, &qkv, &dy, dropout);
                let (y_ref, probs_ref) = reference(&qkv, n, &s, dropout);
                let dx_ref = reference_backward(&qkv, &dy, n, &s, dropout);
                let mut compared = vec![("y", &y, &y_ref), ("dqkv", &dx, &dx_ref)];
                if !flash {
                    // Without flash forward keeps the probabilities, before dropout.
                    compared.push(("probs", &saved, &probs_ref));
                }
                for (what, got, want) in compared {
                    for (i, (&g, &w)) in got.iter().zip(want.iter()).enumerate() {
                        assert!(
                            (g as f64 - w).abs() <= 2e-5 * (1.0 + w.abs()),
                            "{at}: {what}[{i}] = {g}, by definition {w}"
                        );
                    }
                }
            }
        }
    }
}

fn shape(causal: bool) -> Attention {
    Attention {
        len: 6,
        heads: 3,
        kv_heads: 3,
        head_dim: 5,
        causal,
        flash: false,
    }
}

/// Longer than flash.cu's 64 rows a block, and heads wider than its narrowest kernel.
fn long_shape(causal: bool) -> Attention {
    Attention {
        len: 70,
        heads: 2,
        kv_heads: 2,
        head_dim: 40,
        causal,
        flash: false,
    }
}

/// GPT-2's heads, 64 wide, over three tiles of flash_mma.cu's 64 rows, the last partial.
fn gpt2_head_shape(causal: bool) -> Attention {
    Attention {
        len: 130,
        heads: 2,
        kv_heads: 2,
        head_dim: 64,
        causal,
        flash: true,
    }
}

/// Heads 128 wide, as Llama's, over two tiles, the last partial: flash_mma.cu's widest
/// kernels, which take a tile's rows in chunks of 16 in the backward passes.
fn wide_head_shape(causal: bool) -> Attention {
    Attention {
        len: 70,
        heads: 1,
        kv_heads: 1,
        head_dim: 128,
        causal,
        flash: true,
    }
}

/// Dropout on the probabilities, as a training pass of sample 5 on would draw it.
const DROPOUT: ProbsDropout = ProbsDropout {
    p: 0.3,
    key: 0x5eed_cafe,
    first: 5 * 90,
};

/// Dropout drops about p of the attended probabilities, a new set in each step.
#[test]
fn attention_dropout_drops_p_of_the_probabilities() {
    let s = Attention {
        len: 32,
        heads: 4,
        kv_heads: 4,
        head_dim: 8,
        causal: false,
        flash: false,
    };
    let n = 8;
    let dropped = |key: u64| -> Vec<bool> {
        let d = ProbsDropout { key, ..DROPOUT };
        (0..(n * s.probs_len()) as u64)
            .map(|i| d.factor(i) == 0.0)
            .collect()
    };
    let (a, b) = (dropped(1), dropped(2));
    let share = a.iter().filter(|&&d| d).count() as f64 / a.len() as f64;
    assert!((share - 0.3).abs() < 0.01, "dropped {share}, p = 0.3");
    assert_ne!(a, b, "two steps drew the same mask");
    let kept = DROPOUT.factor(a.iter().position(|&d| !d).unwrap() as u64);
    assert_eq!(kept, 1.0 / 0.7);
}

/// One forward and backward pass on the CPU: (y, what forward saved, dqkv).
fn cpu_pass(
    s: &Attention,
    n: usize,
    qkv: &[f32],
    dy: &[f32],
    dropout: Option<ProbsDropout>,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let b = CpuBackend::new(2);
    let qkv = qkv.to_vec();
    let mut y = vec![f32::NAN; n * s.len * s.width()];
    let mut saved = vec![f32::NAN; n * s.saved_len()];
    let mut w = vec![f32::NAN; b.attention_workspace_len(s, n)];
    b.attention_forward(&qkv, &mut y, &mut saved, &mut w, n, s, dropout);
    let mut dx = vec![f32::NAN; qkv.len()];
    b.attention_backward(&qkv, &saved, &dy.to_vec(), &mut dx, &mut w, n, s, dropout);
    (y, saved, dx)
}

/// With flash, the CPU keeps y and each row's log-sum-exp instead of the probabilities and
/// computes them again in backward: the same y, the same gradients within rounding.
#[test]
fn flash_attention_keeps_log_sum_exps_and_gives_the_same_gradients() {
    for s in [
        shape(true),
        shape(false),
        long_shape(true),
        grouped_shape(true),
    ] {
        for dropout in [None, Some(DROPOUT)] {
            let n = 2;
            let qkv = random_vec(n * s.len * s.qkv_width(), 4);
            let dy = random_vec(n * s.len * s.width(), 5);
            let flash = Attention { flash: true, ..s };
            let (y, probs, dx) = cpu_pass(&s, n, &qkv, &dy, dropout);
            let (y_flash, saved, dx_flash) = cpu_pass(&flash, n, &qkv, &dy, dropout);
            let at = format!("{s:?} {dropout:?}");
            assert_eq!(y, y_flash, "{at}: y");
            // Per sample: its output [T, C], then its rows' log-sum-exps [heads, T].
            let (t, c, d) = (s.len, s.width(), s.head_dim);
            assert_eq!(saved.len(), n * (t * c + s.heads * t));
            let per_sample = saved.chunks(t * c + s.heads * t);
            for (b, (own, y)) in per_sample.zip(y.chunks(t * c)).enumerate() {
                assert_eq!(&own[..t * c], y, "{at}: sample {b}'s output kept");
            }
            // exp(score·scale − lse) is the probability the first pass kept: compared at
            // each row's first key, which every row attends to.
            for r in 0..n * s.heads * t {
                let (b, h, i) = (r / (s.heads * t), r / t % s.heads, r % t);
                let l = saved[b * (t * c + s.heads * t) + t * c + h * t + i];
                let q = |e: usize| qkv[qkv_index(&s, b, i, 0, h, e)];
                let k = |e: usize| qkv[qkv_index(&s, b, 0, 1, h, e)];
                let score: f32 = (0..d).map(|e| q(e) * k(e)).sum::<f32>() * s.scale();
                let p = probs[((b * s.heads + h) * t + i) * t];
                assert!(
                    ((score - l).exp() - p).abs() <= 1e-5,
                    "{at}: row {r}: exp(s − lse) = {}, p = {p}",
                    (score - l).exp()
                );
            }
            assert_within(&dx_flash, &dx, 1e-5, &format!("{at}: dqkv"));
        }
    }
}

#[test]
fn attention_gradients() {
    for causal in [true, false] {
        let middle = format!(
            r#"{{ type = "linear", out = 12 }}, {{ type = "attention", heads = 2, causal = {causal} }}"#
        );
        check_gradients(&sequence_job(&middle), sequences());
    }
    let middle =
        r#"{ type = "linear", out = 12 }, { type = "attention", heads = 2, dropout = 0.3 }"#;
    check_gradients(&sequence_job(middle), sequences());
    let flash = sequence_job(middle) + "\n[device]\nflash_attention = true\n";
    check_gradients(&flash, sequences());
    // Grouped-query: two query heads share one key and value head, with a rotary layer.
    let grouped = r#"{ type = "linear", out = 16 }, { type = "rotary", heads = 2, kv_heads = 1 },
        { type = "attention", heads = 2, kv_heads = 1, dropout = 0.3 }"#;
    check_gradients(&sequence_job(grouped), sequences());
}

#[test]
fn attention_refuses_heads_that_do_not_divide_the_width_and_inputs_that_are_not_qkv() {
    let cases = [
        (
            r#"{ type = "linear", out = 12 }, { type = "attention", heads = 3 }"#,
            "heads = 3 does not divide the width 4",
        ),
        (
            r#"{ type = "linear", out = 10 }, { type = "attention", heads = 1 }"#,
            "3 does not divide",
        ),
        (
            r#"{ type = "flatten" }, { type = "attention", heads = 1 }"#,
            "it reads [length, 3·width] samples",
        ),
        (
            r#"{ type = "linear", out = 14 }, { type = "attention", heads = 2, kv_heads = 1 }"#,
            "2 query heads, then 1 key and 1 value heads (kv_heads), 4 heads of equal width, \
             but it has 14 values, which 4 does not divide",
        ),
    ];
    let job = sequence_job(
        r#"{ type = "linear", out = 12 }, { type = "attention", heads = 2, dropout = 1.0 }"#,
    );
    let needles = ["model.layers[2].dropout", "1 given; must be in [0, 1)"];
    expect_error(&job, &["check", "JOB"], 2, &needles);
    let job = sequence_job(
        r#"{ type = "linear", out = 12 }, { type = "attention", heads = 2, kv_heads = 3 }"#,
    );
    let needles = ["model.layers[2].kv_heads", "3 given; must divide heads = 2"];
    expect_error(&job, &["check", "JOB"], 2, &needles);
    for (middle, expected) in cases {
        let job = spec(&sequence_job(middle));
        let e = Graph::build(&job, &sequences()).unwrap_err().to_string();
        assert!(
            e.contains(expected) && e.contains("model.layers[2] (attention)"),
            "{e}"
        );
    }
}

/// CUDA against the CPU on random inputs, with activations in f32 and in each half format;
/// with flash, flash.cu's kernels against the CPU's, on more rows than a block holds too. In
/// bf16 with heads a multiple of 8 wide (40, 64 and 128 here), flash attention runs on tensor
/// cores (flash_mma.cu).
#[test]
fn attention_on_cuda_matches_the_cpu() {
    let Some(g) = gpu() else {
        return;
    };
    let (g, cpu) = (&g, CpuBackend::new(2));
    let cases = [
        (shape(true), None),
        (shape(false), None),
        (shape(true), Some(DROPOUT)),
        (
            Attention {
                flash: true,
                ..shape(true)
            },
            None,
        ),
        (
            Attention {
                flash: true,
                ..shape(false)
            },
            Some(DROPOUT),
        ),
        (
            Attention {
                flash: true,
                ..long_shape(true)
            },
            Some(DROPOUT),
        ),
        (
            Attention {
                flash: true,
                ..long_shape(false)
            },
            None,
        ),
        (gpt2_head_shape(true), Some(DROPOUT)),
        (gpt2_head_shape(false), None),
        (wide_head_shape(true), Some(DROPOUT)),
        (wide_head_shape(false), None),
        (grouped_shape(true), Some(DROPOUT)),
        (one_kv_head_shape(false), None),
        (
            Attention {
                flash: true,
                ..grouped_shape(true)
            },
            Some(DROPOUT),
        ),
        (
            Attention {
                flash: true,
                ..one_kv_head_shape(false)
            },
            None,
        ),
    ];
    for storage in STORAGES {
        for (s, dropout) in cases {
            let (causal, n) = (s.causal, 3);
            // On tensor cores P and dS are rounded to bf16 for their products, as
            // FlashAttention rounds them: y and dqkv then differ by up to two units of bf16's
            // last place at the largest values (1.5 measured), not one.
            let tensor_cores =
                s.flash && storage == Some(HalfKind::Bf16) && s.head_dim.is_multiple_of(8);
            let tol = if tensor_cores {
                2f32.powi(-6)
            } else {
                tolerance(storage)
            };
            let at = format!("{storage:?} causal {causal} flash {} {dropout:?}", s.flash);
            let (x_len, y_len) = (n * s.len * s.qkv_width(), n * s.len * s.width());
            let x = stored(storage, &random_vec(x_len, 2));
            let dy = stored(storage, &random_vec(y_len, 3));
            let mut y = vec![f32::NAN; y_len];
            let mut probs = vec![f32::NAN; n * s.saved_len()];
            let mut w = vec![0.0; cpu.attention_workspace_len(&s, n)];
            cpu.attention_forward(&x, &mut y, &mut probs, &mut w, n, &s, dropout);
            let mut dx = vec![f32::NAN; x_len];
            cpu.attention_backward(&x, &probs, &dy, &mut dx, &mut w, n, &s, dropout);

            let xg = up_in(g, storage, &x);
            let (mut yg, mut probs_g) = (
                poisoned_in(g, storage, y_len),
                g.alloc(n * s.saved_len()).unwrap(),
            );
            let mut wg = g.alloc(g.attention_workspace_len(&s, n)).unwrap();
            g.attention_forward(&xg, &mut yg, &mut probs_g, &mut wg, n, &s, dropout);
            let mut dxg = poisoned_in(g, storage, x_len);
            g.attention_backward(
                &xg,
                &probs_g,
                &up_in(g, storage, &dy),
                &mut dxg,
                &mut wg,
                n,
                &s,
                dropout,
            );
            // The probabilities, or the outputs (as the buffer stores them) and log-sum-exps.
            let probs_gpu = down(g, &probs_g, n * s.saved_len());
            let tol_saved = if s.flash { tol.max(1e-5) } else { 1e-5 };
            assert_within(&probs_gpu, &probs, tol_saved, &format!("{at} saved"));
            let y_gpu = down(g, &yg, y_len);
            assert_within(&y_gpu, &stored(storage, &y), tol, &format!("{at} y"));
            let dx_gpu = down(g, &dxg, x_len);
            assert_within(&dx_gpu, &stored(storage, &dx), tol, &format!("{at} dqkv"));
        }
    }
}

/// A small transformer block over [8, 8] samples trains on CUDA as on the CPU.
#[test]
fn an_attention_job_on_cuda_follows_the_cpu_loss_curve() {
    if gpu().is_none() {
        return;
    }
    let layers = "model.layers=[{type=\"linear\",out=24},{type=\"attention\",heads=2},\
                  {type=\"linear\",out=8},{type=\"layernorm\"},{type=\"gelu\"},\
                  {type=\"flatten\"},{type=\"linear\",out=10}]";
    let extra = ["--set", "model.input_shape=[8,8]", "--set", layers];
    let cpu = loss_curve("cpu", &extra);
    let flash = [&extra[..], &["--set", "device.flash_attention=true"]].concat();
    assert_eq!(cpu.len(), 100);
    for extra in [&extra[..], &flash[..]] {
        let cuda = loss_curve("cuda", extra);
        for ((step, a), (_, b)) in cpu.iter().zip(&cuda) {
            assert!(
                (a - b).abs() <= 1e-4 * a.abs(),
                "step {step}: cpu loss {a} vs cuda {b} ({extra:?})"
            );
        }
    }
}

/// A small GPT (heads 8 wide) trains in bf16 on CUDA with flash attention on tensor cores
/// (the emulated GPU's trace shows flash_mma.cu's kernels, not flash.cu's) and follows the
/// CPU's fp32 run: every loss within 2%, as bf16 on the CPU does.
#[test]
fn a_gpt_with_flash_attention_on_tensor_cores_follows_the_cpu() {
    if gpu().is_none() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let job = small_gpt(tmp.path());
    let runs = tmp.path().join("runs");
    let cpu = losses(&crate::common::run_job(&job, &runs, &[]));
    let trace = tmp.path().join("trace");
    let sets = [
        "precision.mode=\"bf16\"",
        "device.type=\"cuda\"",
        "device.flash_attention=true",
    ];
    let mut args = vec!["run", job.to_str().unwrap(), "-q", "--runs-dir"];
    args.push(runs.to_str().unwrap());
    args.extend(sets.iter().flat_map(|s| ["--set", *s]));
    let out = trainer_with_env(
        &args,
        &[("TRAINER_EMULATED_TRACE", trace.to_str().unwrap())],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let kernels = std::fs::read_to_string(&trace).unwrap();
    for name in [
        "flash_mma_forward_32",
        "flash_mma_backward_kv_32",
        "flash_mma_backward_q_32",
    ] {
        assert!(
            kernels.lines().any(|l| l == format!("kernel {name}")),
            "{name} not launched"
        );
    }
    assert!(
        !kernels.contains("kernel flash_forward"),
        "flash.cu's kernel launched"
    );
    let cuda = losses(std::path::Path::new(stdout(&out).trim()));
    assert_eq!(cpu.len(), cuda.len());
    for (x, y) in cpu.iter().zip(&cuda) {
        assert!((x - y).abs() <= 0.02 * x.abs(), "{cpu:?}\n{cuda:?}");
    }
}

/// `trainer check`'s plan of jobs/gpt_shakespeare.toml (6 layers, batch 64, 6 heads, T 256,
/// C 384): with flash attention each layer keeps its outputs and log-sum-exps, 64 × (256 ×
/// 384 + 6 × 256) values, instead of 64 × 6 × 256 × 256 probabilities.
#[test]
fn flash_attention_plans_less_layer_state() {
    let layer_state_mib = |extra: &[&str]| -> f64 {
        let args = [
            "check",
            "jobs/gpt_shakespeare.toml",
            "--set",
            "device.type='cpu'",
        ];
        let out = trainer(&[&args[..], extra].concat());
        assert!(out.status.success(), "{}", stderr(&out));
        let text = stdout(&out);
        let line = (text.lines())
            .find(|l| l.trim_start().starts_with("layer state"))
            .unwrap_or_else(|| panic!("no layer state in {text}"));
        let words: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(words[3], "MiB", "{line}");
        words[2].parse().unwrap()
    };
    let probs = layer_state_mib(&[]);
    let flash = layer_state_mib(&["--set", "device.flash_attention=true"]);
    let values_per_layer = 64.0 * (6.0 * 256.0 * 256.0 - (256.0 * 384.0 + 6.0 * 256.0));
    let saved_mib = 6.0 * values_per_layer * 4.0 / (1u64 << 20) as f64;
    assert!(
        (probs - flash - saved_mib).abs() < 0.1,
        "layer state {probs} MiB, with flash {flash} MiB: {saved_mib} MiB saved expected"
    );
}

/// Flash attention's CUDA kernels hold a head in registers: a wider one is refused.
#[test]
fn flash_attention_refuses_heads_wider_than_its_kernels() {
    let job = sequence_job(r#"{ type = "linear", out = 387 }, { type = "attention", heads = 1 }"#)
        + "\n[device]\nflash_attention = true\n";
    let e = Graph::build(&spec(&job), &sequences())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model.layers[2] (attention)") && e.contains("a head's 129 values"),
        "{e}"
    );
}
