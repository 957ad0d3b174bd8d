//! Training semantics through the library: gradient accumulation, the data sources, and
//! that regression and binary jobs learn.

use crate::common;

use std::io::Write;
use trainer::data;
use trainer::graph::{DataShape, Graph};
use trainer::run::MetricsWriter;
use trainer::spec::JobSpec;
use trainer::tensor::cpu::CpuBackend;
use trainer::train::{train, Outcome};

fn run(spec: &JobSpec) -> Outcome {
    let data = data::load(&spec.data, spec.job.seed).unwrap();
    let shape = DataShape {
        sample_shape: data.sample_shape.clone(),
        classes: data.classes,
        classes_from: None,
        target_dim: data.target_dim,
    };
    let graph = Graph::build(spec, &shape).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut metrics = MetricsWriter::create(&dir.path().join("metrics.csv")).unwrap();
    train(&CpuBackend::new(1), spec, graph, data, &mut metrics).unwrap()
}

fn synthetic_job(batch: usize, accum: usize, optimizer: &str) -> JobSpec {
    common::spec(&format!(
        r#"
        [job]
        seed = 5
        [data]
        source = "synthetic"
        samples = 256
        num_features = 12
        classes = 3
        batch_size = {batch}
        [model]
        layers = [{{ type = "linear", out = 32 }}, {{ type = "tanh" }}, {{ type = "linear", out = 3 }}]
        [optimizer]
        {optimizer}
        [train]
        epochs = 3
        grad_accum_steps = {accum}
        "#
    ))
}

fn max_relative_difference(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / x.abs().max(y.abs()).max(1e-3))
        .fold(0.0, f32::max)
}

#[test]
fn accumulating_four_micro_batches_equals_one_batch_four_times_larger() {
    for optimizer in [
        "type = \"sgd\"\nlr = 0.05\nmomentum = 0.9",
        "type = \"adamw\"\nlr = 0.003",
    ] {
        let small = run(&synthetic_job(8, 4, optimizer));
        let large = run(&synthetic_job(32, 1, optimizer));
        assert_eq!(small.steps, large.steps);
        assert_eq!(small.steps, 24);
        let diff =
            max_relative_difference(&small.final_weights.params, &large.final_weights.params);
        assert!(diff < 1e-5, "{optimizer}: max relative difference {diff}");
    }
}

#[test]
fn an_epoch_remainder_becomes_a_shorter_accumulation_step() {
    // 256 samples in batches of 24 -> 11 batches (the last of 16); with 4 micro-batches per
    // step: steps of 4, 4 and 3 batches each epoch.
    let outcome = run(&synthetic_job(24, 4, "type = \"sgd\"\nlr = 0.05"));
    assert_eq!(outcome.steps, 9);
    assert_eq!(outcome.train_samples, 3 * 256);
}

#[test]
fn max_steps_stops_mid_epoch() {
    let mut spec = synthetic_job(8, 1, "type = \"sgd\"\nlr = 0.05");
    spec.train.max_steps = Some(7);
    assert_eq!(run(&spec).steps, 7);
}

#[test]
fn regression_with_mse_learns_a_linear_map() {
    let spec = common::spec(
        r#"
        [data]
        source = "synthetic"
        task = "regression"
        samples = 512
        num_features = 8
        targets = 2
        noise = 0.01
        val_fraction = 0.25
        normalize = "none"
        [model]
        layers = [{ type = "linear", out = 2 }]
        [loss]
        type = "mse"
        [optimizer]
        type = "adam"
        lr = 0.02
        [train]
        epochs = 40
        "#,
    );
    let outcome = run(&spec);
    let val = outcome.last_eval.iter().find(|r| r.split == "val").unwrap();
    assert!(val.loss < 0.01, "val mse {}", val.loss);
    assert!(val.accuracy.is_none());
}

#[test]
fn binary_classification_with_bce_reports_accuracy() {
    let spec = common::spec(
        r#"
        [data]
        source = "synthetic"
        classes = 2
        samples = 400
        num_features = 6
        val_fraction = 0.25
        [model]
        layers = [{ type = "linear", out = 16 }, { type = "relu" }, { type = "dropout", p = 0.1 }, { type = "linear", out = 1 }]
        [loss]
        type = "bce_with_logits"
        [optimizer]
        type = "sgd"
        lr = 0.1
        momentum = 0.9
        nesterov = true
        [train]
        epochs = 10
        "#,
    );
    let outcome = run(&spec);
    let val = outcome.last_eval.iter().find(|r| r.split == "val").unwrap();
    assert!(
        val.accuracy.unwrap() > 0.9,
        "val accuracy {:?}",
        val.accuracy
    );
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

fn idx(magic: u8, dims: &[u32], data: &[u8]) -> Vec<u8> {
    let mut out = vec![0, 0, 8, magic];
    for d in dims {
        out.extend(d.to_be_bytes());
    }
    out.extend_from_slice(data);
    out
}

#[test]
fn idx_files_load_raw_or_gzipped_with_a_test_split() {
    let dir = tempfile::tempdir().unwrap();
    let pixels: Vec<u8> = (0..4 * 9).map(|i| (i * 7 % 256) as u8).collect();
    std::fs::write(
        dir.path().join("train-images.gz"),
        gzip(&idx(3, &[4, 3, 3], &pixels)),
    )
    .unwrap();
    std::fs::write(dir.path().join("train-labels"), idx(1, &[4], &[0, 1, 2, 1])).unwrap();
    std::fs::write(
        dir.path().join("test-images"),
        idx(3, &[2, 3, 3], &pixels[..18]),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("test-labels.gz"),
        gzip(&idx(1, &[2], &[2, 0])),
    )
    .unwrap();
    let p = |n: &str| dir.path().join(n).display().to_string();
    let spec = common::spec(&format!(
        "[data]\nsource = \"idx\"\nnormalize = \"none\"\ntrain_images = \"{}\"\ntrain_labels = \"{}\"\ntest_images = \"{}\"\ntest_labels = \"{}\"\n[model]\nlayers = []\n[optimizer]\ntype = \"sgd\"\nlr = 0.1\n",
        p("train-images.gz"), p("train-labels"), p("test-images"), p("test-labels.gz")
    ));
    let d = data::load(&spec.data, 0).unwrap();
    assert_eq!(d.sample_shape, [1, 3, 3]);
    assert_eq!(d.classes, Some(3));
    assert_eq!(d.train.len, 4);
    assert_eq!(d.train.features[..3], [0.0, 7.0, 14.0]);
    assert_eq!(d.train.targets, [0.0, 1.0, 2.0, 1.0]);
    assert_eq!(d.eval[0].0, "test");
    assert_eq!(d.eval[0].1.targets, [2.0, 0.0]);
}

#[test]
fn csv_columns_by_name_and_standardisation_from_the_training_split() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("d.csv"),
        "x,kind,y\n1,0,10\n2,1,10\n3,0,10\n4,1,10\n",
    )
    .unwrap();
    let spec = common::spec(&format!(
        "[data]\nsource = \"csv\"\npath = \"{}\"\nlabel = \"kind\"\nfeatures = [\"x\", 2]\n[model]\nlayers = []\n[optimizer]\ntype = \"sgd\"\nlr = 0.1\n",
        dir.path().join("d.csv").display()
    ));
    let d = data::load(&spec.data, 0).unwrap();
    assert_eq!(d.sample_shape, [2]);
    assert_eq!(d.train.targets, [0.0, 1.0, 0.0, 1.0]);
    let xs: Vec<f32> = d.train.features.chunks(2).map(|r| r[0]).collect();
    let mean: f32 = xs.iter().sum::<f32>() / 4.0;
    let var: f32 = xs.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / 4.0;
    assert!(mean.abs() < 1e-6 && (var - 1.0).abs() < 1e-5);
    // A constant column is centred, not divided by zero.
    assert!(d.train.features.chunks(2).all(|r| r[1] == 0.0));
}

#[test]
fn validation_split_is_seeded_and_disjoint() {
    let spec = common::spec("[data]\nsource = \"digits\"\nval_fraction = 0.25\nnormalize = \"none\"\n[model]\nlayers = []\n[optimizer]\ntype = \"sgd\"\nlr = 0.1\n");
    let a = data::load(&spec.data, 1).unwrap();
    let b = data::load(&spec.data, 1).unwrap();
    let c = data::load(&spec.data, 2).unwrap();
    assert_eq!(a.train.len + a.eval[0].1.len, 1797);
    assert_eq!(a.eval[0].1.len, 449);
    assert_eq!(a.eval[0].1.features, b.eval[0].1.features);
    assert_ne!(a.eval[0].1.features, c.eval[0].1.features);
}
