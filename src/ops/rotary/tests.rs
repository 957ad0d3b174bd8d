//! rotary's tests. The library does not compile this file: tests/suite/ops.rs does, so that
//! its CUDA tests run on the emulated GPU with the rest.

use crate::common::{expect_error, random_vec, run_job, spec};
use crate::cuda_parity::{assert_within, down, gpu, poisoned_in, stored, tolerance, up_in};
use crate::cuda_parity::{up, STORAGES};
use crate::gradients::{check_gradients, sequence_job, sequences};
use crate::text::{losses, small_models};
use trainer::graph::Graph;
use trainer::ops::rotary::{Kernels, Llama3Scaling, Rotation};
use trainer::tensor::cpu::CpuBackend;

const CPU: CpuBackend = CpuBackend::new(1);

fn floats(v: &serde_json::Value) -> Vec<f32> {
    let values = v.as_array().unwrap().iter();
    values.map(|x| x.as_f64().unwrap() as f32).collect()
}

fn assert_near(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= 2e-6 * b.abs().max(1.0),
            "{what} [{i}]: {a} vs {b}"
        );
    }
}

/// Forward and backward against Hugging Face's Llama rotary embedding in PyTorch
/// (tests/fixtures/make_rotary_reference.py), at two widths, thetas and lengths.
#[test]
fn rotary_matches_hugging_faces_llama() {
    let path = crate::common::root().join("tests/fixtures/rotary_reference.json");
    let fixture: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    for case in fixture["cases"].as_array().unwrap() {
        let size = |key: &str| case[key].as_u64().unwrap() as usize;
        let r = Rotation {
            len: size("length"),
            heads: size("heads"),
            kv_heads: size("heads"),
            head_dim: size("head_dim"),
            theta: case["theta"].as_f64().unwrap() as f32,
            scaling: None,
        };
        let (n, x, dy) = (size("batch"), floats(&case["x"]), floats(&case["dy"]));
        let mut table = vec![f32::NAN; r.table_len()];
        let mut y = vec![f32::NAN; x.len()];
        CPU.rotary(&x, &mut y, &mut table, n, &r, 0, false);
        let what = format!("{r:?}");
        assert_near(&y, &floats(&case["y"]), &format!("{what} forward"));
        let mut in_place = x.clone();
        CPU.rotary_in_place(&mut in_place, &mut table, n, &r, 0);
        assert_eq!(in_place, y, "{what}: in place");
        let mut dx = vec![f32::NAN; x.len()];
        CPU.rotary(&dy, &mut dx, &mut table, n, &r, 0, true);
        assert_near(&dx, &floats(&case["dx"]), &format!("{what} backward"));
    }
}

/// One position at a time from position p (`trainer sample`'s key/value cache) gives the
/// bits of position p in the whole sequence.
#[test]
fn a_position_alone_turns_as_in_its_sequence() {
    let whole = Rotation {
        len: 9,
        heads: 2,
        kv_heads: 2,
        head_dim: 6,
        theta: 10_000.0,
        scaling: None,
    };
    let row = whole.row_len();
    let x = random_vec(whole.len * row, 1);
    let mut table = vec![0.0; whole.table_len()];
    let mut y = vec![0.0; x.len()];
    CPU.rotary(&x, &mut y, &mut table, 1, &whole, 0, false);
    let one = Rotation { len: 1, ..whole };
    for p in 0..whole.len {
        let mut alone = x[p * row..][..row].to_vec();
        CPU.rotary_in_place(&mut alone, &mut table, 1, &one, p);
        assert_eq!(alone, y[p * row..][..row], "position {p}");
    }
}

#[test]
fn rotary_gradients() {
    let middle = r#"{ type = "linear", out = 12 }, { type = "rotary", heads = 1, theta = 20.0 },
        { type = "attention", heads = 1 }"#;
    check_gradients(&sequence_job(middle), sequences());
}

#[test]
fn rotary_refuses_odd_heads_inputs_that_are_not_qkv_and_other_heads_after_it() {
    let cases = [
        (
            r#"{ type = "linear", out = 12 }, { type = "rotary", heads = 3 }"#,
            "heads = 3 does not divide the width 4",
        ),
        (
            r#"{ type = "linear", out = 12 }, { type = "rotary", heads = 4 }"#,
            "its heads are 1 values wide: it turns pairs of values, so a head's width must be even",
        ),
        (
            r#"{ type = "linear", out = 10 }, { type = "rotary", heads = 1 }"#,
            "3 does not divide",
        ),
        (
            r#"{ type = "flatten" }, { type = "rotary", heads = 1 }"#,
            "it reads [length, 3·width] samples",
        ),
    ];
    let job = sequence_job(
        r#"{ type = "linear", out = 12 }, { type = "rotary", heads = 1, theta = 1.0 }"#,
    );
    let needles = [
        "model.layers[2].theta",
        "1 given; must be a finite number above 1",
    ];
    expect_error(&job, &["check", "JOB"], 2, &needles);
    let scaling = "{ type = \"llama3\", factor = 0.5, low_freq_factor = 1.0, high_freq_factor \
                   = 4.0, original_max_position_embeddings = 8 }";
    let job = sequence_job(&format!(
        r#"{{ type = "linear", out = 12 }}, {{ type = "rotary", heads = 1, scaling = {scaling} }}"#
    ));
    let needles = [
        "model.layers[2].scaling",
        "factor = 0.5, low_freq_factor = 1, high_freq_factor = 4, \
         original_max_position_embeddings = 8 given; the factor must be at least 1",
    ];
    expect_error(&job, &["check", "JOB"], 2, &needles);
    for (middle, expected) in cases {
        let job = spec(&sequence_job(middle));
        let e = Graph::build(&job, &sequences()).unwrap_err().to_string();
        assert!(e.contains(expected) && e.contains("model.layers[2]"), "{e}");
    }
    let middle = r#"{ type = "linear", out = 24 }, { type = "rotary", heads = 2 },
        { type = "attention", heads = 4 }"#;
    let e = Graph::build(&spec(&sequence_job(middle)), &sequences()).unwrap_err();
    let want = "model.layers[3] (attention): the rotary layer before it turns heads = 2 and \
                kv_heads = 2, and it has heads = 4 and kv_heads = 4: give both the same heads";
    assert!(e.to_string().contains(want), "{e}");
    let middle = r#"{ type = "linear", out = 32 }, { type = "rotary", heads = 4, kv_heads = 2 },
        { type = "attention", heads = 4 }"#;
    let e = Graph::build(&spec(&sequence_job(middle)), &sequences()).unwrap_err();
    assert!(
        e.to_string()
            .contains("kv_heads = 2, and it has heads = 4 and kv_heads = 4"),
        "{e}"
    );
}

/// CUDA against the CPU on random inputs, in f32 and in each half format: forward, in
/// place, from a later position, and backward; with as many key heads as query heads, and
/// with fewer.
#[test]
fn rotary_on_cuda_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    let r = Rotation {
        len: 37,
        heads: 3,
        kv_heads: 3,
        head_dim: 16,
        theta: 10_000.0,
        scaling: None,
    };
    let grouped = Rotation {
        heads: 4,
        kv_heads: 2,
        ..r
    };
    // Llama 3.1's stretch: with θ = 10000 and 16 values a head, wavelengths of 6 to 18,000
    // positions, some under 64 (kept), some past 1024 (divided), some between (blended).
    let stretched = Rotation {
        scaling: Some(Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 16.0,
            original_context: 1024.0,
        }),
        ..grouped
    };
    let n = 3;
    let rotations = [r, grouped, stretched];
    for (r, storage) in rotations.into_iter().flat_map(|r| STORAGES.map(|s| (r, s))) {
        let len = n * r.len * r.row_len();
        let (x, dy) = (
            stored(storage, &random_vec(len, 1)),
            stored(storage, &random_vec(len, 2)),
        );
        let tol = tolerance(storage);
        let mut table = vec![0.0; r.table_len()];
        let mut gpu_workspace = up(&g, &[0.0]);
        for (position, inverse) in [(0, false), (5, false), (0, true)] {
            let at = format!("{r:?} {storage:?} from {position}, inverse {inverse}");
            let input = if inverse { &dy } else { &x };
            let mut y = vec![0.0; len];
            CPU.rotary(input, &mut y, &mut table, n, &r, position, inverse);
            let mut yg = poisoned_in(&g, storage, len);
            let xg = up_in(&g, storage, input);
            g.rotary(&xg, &mut yg, &mut gpu_workspace, n, &r, position, inverse);
            assert_within(&down(&g, &yg, len), &stored(storage, &y), tol, &at);
            if !inverse {
                let mut in_place = up_in(&g, storage, input);
                g.rotary_in_place(&mut in_place, &mut gpu_workspace, n, &r, position);
                let what = format!("{at}, in place");
                assert_within(&down(&g, &in_place, len), &stored(storage, &y), tol, &what);
            }
        }
    }
}

/// The small Llama (rotary, silu and multiply on the device) trains on CUDA as on the CPU:
/// in fp32 every loss within 1e-4; in bf16 with flash attention within 2% of the CPU's fp32,
/// as bf16 on the CPU does.
#[test]
fn a_llama_on_cuda_follows_the_cpu() {
    if gpu().is_none() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let [_, (_, job, _)] = small_models(tmp.path());
    let runs = tmp.path().join("runs");
    let cpu = losses(&run_job(&job, &runs, &[]));
    for (sets, within) in [
        (&["device.type=\"cuda\""][..], 1e-4),
        (
            &[
                "device.type=\"cuda\"",
                "precision.mode=\"bf16\"",
                "device.flash_attention=true",
            ][..],
            0.02,
        ),
    ] {
        let args: Vec<&str> = sets.iter().flat_map(|s| ["--set", *s]).collect();
        let cuda = losses(&run_job(&job, &runs, &args));
        assert_eq!(cpu.len(), cuda.len());
        for (x, y) in cpu.iter().zip(&cuda) {
            assert!(
                (x - y).abs() <= within * x.abs(),
                "{sets:?}\n{cpu:?}\n{cuda:?}"
            );
        }
    }
}
