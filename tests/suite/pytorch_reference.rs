//! The CPU backend against PyTorch's own numbers: optimizers, losses, activations, learning-
//! rate schedules and gradient clipping, from tests/fixtures/pytorch_reference.json (made by
//! tests/fixtures/make_pytorch_reference.py with PyTorch 2.15 on the CPU, float32).

use crate::common;

use serde_json::Value;
use trainer::ops::activation::Kernels;
use trainer::optim::{clip_grad_norm, Optimizer, Schedule};
use trainer::spec::ScheduleSpec;
use trainer::tensor::cpu::CpuBackend;
use trainer::tensor::{Activation, Backend, LossFn, UpdatedParams};

fn fixture() -> Value {
    let path = common::root().join("tests/fixtures/pytorch_reference.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn assert_close(ours: &[f32], torch: &[f32], rel: f32, abs: f32, what: &str) {
    assert_eq!(ours.len(), torch.len(), "{what}: lengths differ");
    for (i, (a, b)) in ours.iter().zip(torch).enumerate() {
        assert!(
            (a - b).abs() <= abs + rel * b.abs(),
            "{what}[{i}]: ours {a} vs PyTorch {b}"
        );
    }
}

#[test]
fn optimizers_match_pytorch_step_by_step() {
    let b = CpuBackend::new(1);
    let cases = fixture()["optimizers"].as_array().unwrap().clone();
    assert!(cases.len() >= 7);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let f = |k: &str| case[k].as_f64().unwrap();
        let betas = floats(&case["betas"]);
        let mut job = format!(
            "[data]\nsource = \"digits\"\n[model]\nlayers = []\n[optimizer]\ntype = \"{}\"\nlr = {:e}\nweight_decay = {:e}\n",
            case["type"].as_str().unwrap(),
            f("lr"),
            f("weight_decay"),
        );
        if case["type"] == "sgd" {
            job += &format!(
                "momentum = {:e}\ndampening = {:e}\nnesterov = {}\n",
                f("momentum"),
                f("dampening"),
                case["nesterov"]
            );
        } else {
            job += &format!(
                "betas = [{:e}, {:e}]\neps = {:e}\n",
                betas[0],
                betas[1],
                f("eps")
            );
        }
        let spec = common::spec(&job);
        let mut params = floats(&case["params0"]);
        let mut optimizer = Optimizer::new(&b, &spec, params.len()).unwrap();
        for (step, (grads, expected)) in case["grads"]
            .as_array()
            .unwrap()
            .iter()
            .zip(case["params"].as_array().unwrap())
            .enumerate()
        {
            let out = UpdatedParams {
                params: &mut params,
                half_copy: None,
            };
            optimizer.step(&b, out, &floats(grads), f("lr"));
            assert_close(
                &params,
                &floats(expected),
                2e-6,
                1e-7,
                &format!("{name} step {}", step + 1),
            );
        }
    }
}

#[test]
fn losses_and_their_gradients_match_pytorch() {
    let b = CpuBackend::new(1);
    for case in fixture()["losses"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let (n, dim) = (
            case["n"].as_u64().unwrap() as usize,
            case["dim"].as_u64().unwrap() as usize,
        );
        let f = match case["type"].as_str().unwrap() {
            "cross_entropy" => LossFn::CrossEntropy {
                label_smoothing: case["label_smoothing"].as_f64().unwrap() as f32,
                ignore_index: case["ignore_index"].as_u64().map(|i| i as u32),
            },
            "mse" => LossFn::Mse,
            "bce_with_logits" => LossFn::BceWithLogits,
            other => panic!("unknown loss {other}"),
        };
        let outputs = floats(&case["outputs"]);
        let targets = floats(&case["targets"]);
        let mut grad = vec![f32::NAN; n * dim];
        let mut stats = b.new_stats().unwrap();
        b.loss(
            f,
            &outputs,
            &targets,
            n,
            dim,
            1.0,
            Some(&mut grad),
            &mut stats,
        );
        let loss = (stats.loss_sum / stats.samples) as f32;
        assert_close(
            &[loss],
            &[case["loss"].as_f64().unwrap() as f32],
            1e-6,
            1e-6,
            name,
        );
        assert_close(
            &grad,
            &floats(&case["grad"]),
            1e-5,
            1e-7,
            &format!("{name} gradient"),
        );
    }
}

#[test]
fn activations_and_derivatives_match_pytorch() {
    for case in fixture()["activations"].as_array().unwrap() {
        let f = match case["type"].as_str().unwrap() {
            "relu" => Activation::Relu,
            "gelu" => Activation::Gelu,
            "gelu_tanh" => Activation::GeluTanh,
            "tanh" => Activation::Tanh,
            "sigmoid" => Activation::Sigmoid,
            "silu" => Activation::Silu,
            other => panic!("unknown activation {other}"),
        };
        let x = floats(&case["x"]);
        let (len, cpu) = (x.len(), CpuBackend::new(1));
        let (mut y, mut d) = (vec![0.0; len], vec![0.0; len]);
        cpu.activation_forward(f, &x, &mut y, len);
        cpu.activation_backward(f, &x, &y, &vec![1.0; len], &mut d, len);
        assert_close(&y, &floats(&case["y"]), 2e-6, 1e-7, &format!("{f:?}"));
        assert_close(
            &d,
            &floats(&case["dydx"]),
            2e-6,
            1e-6,
            &format!("{f:?} derivative"),
        );
    }
}

#[test]
fn schedules_match_pytorch_schedulers() {
    for case in fixture()["schedules"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let mut fields = serde_json::Map::new();
        for key in [
            "type",
            "step_size",
            "milestones",
            "gamma",
            "min_lr",
            "warmup_steps",
            "warmup_start_factor",
        ] {
            if !case[key].is_null() {
                fields.insert(key.to_string(), case[key].clone());
            }
        }
        let spec: ScheduleSpec = serde_json::from_value(Value::Object(fields)).unwrap();
        let total = case["total_steps"].as_u64().unwrap() as usize;
        let schedule = Schedule::new(case["lr"].as_f64().unwrap(), &spec, total);
        for (t, expected) in case["lrs"].as_array().unwrap().iter().enumerate() {
            let (ours, torch) = (schedule.lr(t), expected.as_f64().unwrap());
            assert!(
                (ours - torch).abs() <= 1e-9 + 1e-9 * torch.abs(),
                "{name} step {t}: ours {ours} vs PyTorch {torch}"
            );
        }
    }
}

#[test]
fn gradient_clipping_matches_clip_grad_norm() {
    let b = CpuBackend::new(1);
    for case in fixture()["clipping"].as_array().unwrap() {
        let mut grads: Vec<f32> = case["grads"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(floats)
            .collect();
        let expected: Vec<f32> = case["clipped"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(floats)
            .collect();
        let norm = clip_grad_norm(&b, &mut grads, case["max_norm"].as_f64());
        assert!(
            (norm - case["total_norm"].as_f64().unwrap()).abs() < 1e-5,
            "norm {norm}"
        );
        assert_close(&grads, &expected, 1e-6, 1e-7, "clipped gradients");
    }
}
