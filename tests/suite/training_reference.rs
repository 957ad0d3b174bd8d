//! Whole training runs against PyTorch's: the same model, loss, optimizer, schedule,
//! clipping and gradient accumulation, from the same initial weights (model.init_from) over
//! the same batches, give the same loss at every optimizer step, the same final weights,
//! and the same evaluation of the final model.
//! tests/fixtures/make_training_reference.py ran them in PyTorch
//! (tests/fixtures/training_reference.json); each case's job is run here by the binary.

use crate::common;

use common::{column, ok, read_csv, stdout, trainer, write_job};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn fixture() -> Value {
    let path = common::root().join("tests/fixtures/training_reference.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn shape_of(tensor: &Value) -> Vec<usize> {
    let dims = tensor["shape"].as_array().unwrap();
    dims.iter().map(|d| d.as_u64().unwrap() as usize).collect()
}

/// A tensor's values, as f32.
fn f32s(tensor: &Value) -> Vec<f32> {
    numbers(&tensor["values"])
}

/// A JSON list of numbers, as f32.
fn numbers(list: &Value) -> Vec<f32> {
    let list = list.as_array().unwrap();
    list.iter().map(|v| v.as_f64().unwrap() as f32).collect()
}

/// PyTorch's initial state_dict as a safetensors file, for model.init_from.
fn write_state_dict(state: &Value, path: &Path) {
    let state = state.as_object().unwrap();
    let bytes: Vec<(String, Vec<usize>, Dtype, Vec<u8>)> = state
        .iter()
        .map(|(name, t)| {
            let (dtype, bytes) = if name.ends_with("num_batches_tracked") {
                let n = t["values"][0].as_i64().unwrap();
                (Dtype::I64, n.to_le_bytes().to_vec())
            } else {
                (Dtype::F32, bytemuck::cast_slice(&f32s(t)).to_vec())
            };
            (name.clone(), shape_of(t), dtype, bytes)
        })
        .collect();
    let views = bytes.iter().map(|(name, shape, dtype, b)| {
        let view = TensorView::new(*dtype, shape.clone(), b).unwrap();
        (name.as_str(), view)
    });
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

/// Runs a case's job from PyTorch's initial weights on `device`, with `extra` arguments;
/// returns the run directory.
fn run_case(case: &Value, dir: &Path, device: &str, extra: &[&str]) -> PathBuf {
    let init = dir.join("init.safetensors");
    write_state_dict(&case["init"], &init);
    let digits = common::root().join("jobs/data/digits.csv.gz");
    std::fs::copy(digits, dir.join("digits.csv.gz")).unwrap();
    for (name, text) in case["files"].as_object().unwrap() {
        std::fs::write(dir.join(name), text.as_str().unwrap()).unwrap();
    }
    let job = write_job(dir, case["job"].as_str().unwrap());
    let runs = dir.join("runs");
    let init_from = format!("model.init_from={:?}", init.to_str().unwrap());
    let device = format!("device.type={device:?}");
    let args = [
        "run",
        job.to_str().unwrap(),
        "--set",
        &init_from,
        "--set",
        &device,
        "--runs-dir",
        runs.to_str().unwrap(),
        "-q",
    ];
    let out = ok(trainer(&[&args[..], extra].concat()));
    PathBuf::from(stdout(&out).trim())
}

/// metrics.csv's train rows: one per optimizer step (the jobs log every step).
fn train_rows<'a>(header: &[String], rows: &'a [Vec<String>]) -> Vec<&'a Vec<String>> {
    let train = rows
        .iter()
        .filter(|r| column(header, r, "split") == "train");
    train.collect()
}

fn losses(header: &[String], train: &[&Vec<String>]) -> Vec<f32> {
    let loss = |r: &&Vec<String>| column(header, r, "loss").parse().unwrap();
    train.iter().map(loss).collect()
}

/// The largest |ours - torch| / (|torch| + floor) over the values.
fn worst_relative(ours: &[f32], torch: &[f32], floor: f32) -> f32 {
    assert_eq!(ours.len(), torch.len());
    let err = |(a, b): (&f32, &f32)| (a - b).abs() / (b.abs() + floor);
    ours.iter().zip(torch).map(err).fold(0.0, f32::max)
}

/// How close a run must come to PyTorch's: relative to the loss, and to the weights (plus
/// 0.01, for weights near zero).
#[derive(Clone, Copy)]
struct Tolerance {
    loss: f32,
    weights: f32,
}

/// On the CPU: the same sums as PyTorch's but for their order.
const CPU: Tolerance = Tolerance {
    loss: 1e-5,
    weights: 1e-4,
};

#[test]
fn whole_runs_follow_pytorch_step_by_step() {
    for case in fixture()["cases"].as_array().unwrap() {
        follows_pytorch(case, "cpu", &[], CPU);
    }
}

/// On a GPU: cuBLAS's fp32 products (no TF32) and the kernels' reductions sum in other orders
/// than the CPU's, step after step. Skips without a GPU, with the reason; fails then when
/// TRAINER_REQUIRE_CUDA=1.
#[test]
fn whole_runs_on_cuda_follow_pytorch() {
    if !common::gpu_present() {
        return;
    }
    let gpu = Tolerance {
        loss: 1e-4,
        weights: 1e-3,
    };
    for case in fixture()["cases"].as_array().unwrap() {
        follows_pytorch(case, "cuda", &[], gpu);
    }
}

/// Every case in bf16 and in fp16 (dynamic loss scaling) on a GPU, where activations and
/// their gradients live in half-width buffers (conv, pooling, the norms, concat, softmax,
/// the embedding), against the same mode on the CPU, whose f32 buffers hold the same half
/// values: the curves agree to the half format's precision (a product summed in another
/// order may round to the neighbouring half), and the loss scaler skips the same steps.
#[test]
fn mixed_precision_runs_on_cuda_follow_the_cpu() {
    if !common::gpu_present() {
        return;
    }
    for case in fixture()["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        for mode in ["bf16", "fp16"] {
            let precision = format!("precision.mode={mode:?}");
            let run = |device: &str| {
                let tmp = tempfile::tempdir().unwrap();
                let run = run_case(case, tmp.path(), device, &["--set", &precision]);
                let (header, rows) = read_csv(&run.join("metrics.csv"));
                let train = train_rows(&header, &rows);
                let skipped = column(&header, train[train.len() - 1], "skipped_steps").to_string();
                (losses(&header, &train), skipped)
            };
            let ((cpu, cpu_skipped), (cuda, cuda_skipped)) = (run("cpu"), run("cuda"));
            let err = worst_relative(&cuda, &cpu, 0.0);
            println!("{name} {mode}: cuda against cpu, worst relative loss difference {err:.2e}");
            assert!(
                err < 2e-2,
                "{name} {mode}: losses\n cuda {cuda:?}\n cpu  {cpu:?}"
            );
            assert_eq!(cuda_skipped, cpu_skipped, "{name} {mode}: skipped steps");
        }
    }
}

/// Data-parallel replicas average their gradients into the full batch's: the same run as
/// PyTorch's on one device (a model without batch norm, whose statistics are per replica as
/// in DDP).
#[test]
fn two_replicas_follow_pytorch_on_one_device() {
    let cases = fixture()["cases"].as_array().unwrap().clone();
    let mlp = cases
        .iter()
        .find(|c| c["name"] == "mlp_adamw_cosine_clip_smoothing");
    follows_pytorch(mlp.unwrap(), "cpu", &["--set", "parallel.replicas=2"], CPU);
}

/// Mixed precision on the CPU against torch.autocast (with GradScaler's defaults for fp16):
/// the same roundings of activations and products, so the first step's loss is autocast's
/// (where fp32's differs), the losses stay within 1% of autocast's over the run (bf16 itself
/// moves PyTorch's loss 0.24% from its fp32 run here), and the same steps are skipped, except
/// where the documented deviation shows: PyTorch rounds weight gradients to fp16, trainer
/// accumulates them in f32 (docs/mixed-precision.md).
#[test]
fn mixed_precision_follows_pytorch_autocast() {
    for case in fixture()["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        for (mode, want) in case["autocast"].as_object().unwrap() {
            let tmp = tempfile::tempdir().unwrap();
            let precision = format!("precision.mode={mode:?}");
            let run = run_case(case, tmp.path(), "cpu", &["--set", &precision]);
            let (header, rows) = read_csv(&run.join("metrics.csv"));
            let train = train_rows(&header, &rows);
            let ours = losses(&header, &train);
            let torch = numbers(&want["losses"]);
            // The first step's loss comes from the same weights: only the roundings differ
            // from fp32, by 2e-5 to 3e-4 here, and they are autocast's to 2e-7.
            let first = worst_relative(&ours[..1], &torch[..1], 0.0);
            let fp32 = numbers(&case["losses"]);
            let rounding = worst_relative(&fp32[..1], &torch[..1], 0.0);
            println!(
                "{name} {mode}: first loss {first:.1e} from autocast's (fp32's: {rounding:.1e})"
            );
            assert!(
                first < 1e-6 && rounding > 1e-5,
                "{name} {mode}: {first:e}, {rounding:e}"
            );
            if mode == "fp16" {
                // The scaler's state after the last step: metrics.csv against GradScaler's.
                let last = train[train.len() - 1];
                let read = |key: &str| -> f64 { column(&header, last, key).parse().unwrap() };
                let scaler = (read("skipped_steps"), read("loss_scale"));
                let torch_scaler = (
                    want["skipped_steps"].as_f64().unwrap(),
                    want["loss_scale"].as_f64().unwrap(),
                );
                println!(
                    "{name} fp16: (skipped steps, scale) {scaler:?}, PyTorch's {torch_scaler:?}"
                );
                if name == "mlp_adamw_cosine_clip_smoothing" {
                    // Raw pixel values up to 16, summed over 64 samples at a scale of 2^16: the
                    // first two steps' weight gradients overflow fp16 in PyTorch (skipped, the
                    // scale quartered), not in f32. From there the runs part.
                    assert_eq!(torch_scaler, (2.0, 16384.0), "{name}: PyTorch's scaler");
                    assert_eq!(scaler, (0.0, 65536.0), "{name}: ours");
                    continue;
                }
                assert_eq!(scaler, torch_scaler, "{name}: the scaler");
            }
            let err = worst_relative(&ours, &torch, 0.0);
            println!("{name} {mode}: worst relative loss difference {err:.2e}");
            assert!(
                err < 1e-2,
                "{name} {mode}: losses\n ours  {ours:?}\n torch {torch:?}"
            );
        }
    }
}

/// Runs `case` on `device` with `extra` arguments and compares it with PyTorch's run.
fn follows_pytorch(case: &Value, device: &str, extra: &[&str], within: Tolerance) {
    let name = case["name"].as_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let run = run_case(case, tmp.path(), device, extra);

    // Every optimizer step's mean training loss (log_every = 1).
    let (header, rows) = read_csv(&run.join("metrics.csv"));
    let ours = losses(&header, &train_rows(&header, &rows));
    let torch = numbers(&case["losses"]);
    assert_eq!(ours.len(), torch.len(), "{name}: optimizer steps");
    let loss_err = worst_relative(&ours, &torch, 0.0);
    println!(
        "{name}: {} steps, worst relative loss difference {loss_err:.2e}",
        ours.len()
    );
    assert!(
        loss_err < within.loss,
        "{name}: losses\n ours  {ours:?}\n torch {torch:?}"
    );

    // The final model evaluated on the training file (the job's test set), in evaluation
    // mode (batch norm's running statistics). An accuracy may differ by one sample of the
    // digits' 1,797, whose top two logits would be within rounding of each other.
    let test = rows.iter().rfind(|r| column(&header, r, "split") == "test");
    let test = test.unwrap_or_else(|| panic!("{name}: no test row"));
    for (metric, want) in case["test"].as_object().unwrap() {
        let got: f64 = column(&header, test, metric).parse().unwrap();
        let want = want.as_f64().unwrap();
        println!("  test {metric}: {got} (PyTorch {want})");
        let close = match metric.as_str() {
            "accuracy" => (got - want).abs() <= 1e-3,
            _ => (got - want).abs() <= within.loss as f64 * want.abs(),
        };
        assert!(close, "{name}: test {metric} {got}, PyTorch's {want}");
    }

    // The final weights, every tensor of the state_dict.
    let bytes = std::fs::read(run.join("model.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    for (tensor, want) in case["final"].as_object().unwrap() {
        let got = file.tensor(tensor).unwrap();
        assert_eq!(got.shape(), shape_of(want), "{name}: {tensor}");
        if got.dtype() == Dtype::I64 {
            let n = i64::from_le_bytes(got.data().try_into().unwrap());
            assert_eq!(n, want["values"][0].as_i64().unwrap(), "{name}: {tensor}");
            continue;
        }
        let got: Vec<f32> = bytemuck::pod_collect_to_vec(got.data());
        let err = worst_relative(&got, &f32s(want), 1e-2);
        println!("  {tensor}: worst relative difference {err:.2e}");
        assert!(
            err < within.weights,
            "{name}: {tensor} differs from PyTorch's by {err:.2e}"
        );
    }
}
