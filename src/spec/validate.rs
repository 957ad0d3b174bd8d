//! Semantic checks that types cannot express: ranges, keys that only apply to some choices,
//! and combinations that cannot run. Every problem is collected, so a user fixes a job in
//! one round.

use super::*;

/// The problems found, as (key, message).
struct Problems {
    found: Vec<(String, String)>,
}

impl Problems {
    fn add(&mut self, key: &str, message: impl std::fmt::Display) {
        self.found.push((key.to_string(), message.to_string()));
    }
    fn check(&mut self, ok: bool, key: &str, message: impl std::fmt::Display) {
        if !ok {
            self.add(key, message);
        }
    }
}

pub(super) use crate::ops::{size_range, MAX_SIZE};

/// The largest batch a job may ask for: 16,777,216 samples, far beyond any that trains, and
/// small enough that batch × per-sample bytes cannot overflow.
pub(super) const MAX_BATCH: usize = 1 << 24;

/// The most CPU threads a job may ask for.
const MAX_THREADS: usize = 1024;

/// The most values a synthetic data set may hold (16 GiB of f32).
const MAX_SYNTHETIC_VALUES: usize = 1 << 32;

/// Every problem of the job, as (key, message); `validate` says where each key was set.
pub fn problems(spec: &JobSpec) -> Vec<(String, String)> {
    let mut p = Problems { found: Vec::new() };
    if let Some(name) = &spec.job.name {
        if let Err(why) = check_run_name(name) {
            p.add("job.name", why);
        }
    }
    validate_data(&spec.data, &mut p);
    validate_model(&spec.model, &mut p);
    validate_paths(spec, &mut p);
    validate_loss(spec, &mut p);
    validate_optimizer(&spec.optimizer, &mut p);
    validate_train(&spec.train, &mut p);
    validate_checkpoint(spec, &mut p);
    validate_precision(&spec.precision, &mut p);
    validate_parallel(spec, &mut p);
    for (key, message) in super::controls::problems(spec) {
        p.add(&key, message);
    }
    validate_device(spec, &mut p);
    p.found
}

/// A path given as "" would name the job file's directory.
fn validate_paths(spec: &JobSpec, p: &mut Problems) {
    let init_from = [("model.init_from", &spec.model.init_from)];
    for (key, path) in spec.data.path_keys().into_iter().chain(init_from) {
        p.check(
            path.as_ref()
                .is_none_or(|path| !path.as_os_str().is_empty()),
            key,
            "is empty; give a file's path (relative to the job file's directory), or leave \
             the key out",
        );
    }
}

fn validate_data(d: &DataSpec, p: &mut Problems) {
    for (key, size) in [
        ("data.batch_size", d.batch_size),
        ("data.global_batch_size", d.global_batch_size),
    ] {
        if let Some(n) = size {
            p.check(n >= 1, key, format!("{n} given; must be at least 1"));
            p.check(
                n <= MAX_BATCH,
                key,
                format!("{n} given; must be at most {MAX_BATCH}"),
            );
        }
    }
    p.check(
        (0.0..1.0).contains(&d.val_fraction),
        "data.val_fraction",
        format!("{} given; must be in [0, 1)", d.val_fraction),
    );
    let source = d.source;
    let name = serde_json::to_string(&source).unwrap_or_default();
    let mut only = |present: bool, key: &str, sources: &[DataSource]| {
        if present && !sources.contains(&source) {
            let allowed: Vec<String> = sources
                .iter()
                .map(|s| serde_json::to_string(s).unwrap_or_default())
                .collect();
            p.add(
                &format!("data.{key}"),
                format!(
                    "only applies to source = {} (source is {name})",
                    allowed.join(" or ")
                ),
            );
        }
    };
    use DataSource::*;
    only(d.path.is_some(), "path", &[Csv, Text, Tokens]);
    only(d.tokenizer.is_some(), "tokenizer", &[Text, Tokens]);
    only(d.block_size.is_some(), "block_size", &[Text, Tokens]);
    only(d.token_format.is_some(), "token_format", &[Tokens]);
    only(d.val_path.is_some(), "val_path", &[Tokens]);
    only(d.test_path.is_some(), "test_path", &[Csv]);
    only(d.header.is_some(), "header", &[Csv]);
    only(d.label.is_some(), "label", &[Csv]);
    only(d.features.is_some(), "features", &[Csv]);
    only(d.exclude.is_some(), "exclude", &[Csv]);
    only(d.train_images.is_some(), "train_images", &[Idx]);
    only(d.train_labels.is_some(), "train_labels", &[Idx]);
    only(d.test_images.is_some(), "test_images", &[Idx]);
    only(d.test_labels.is_some(), "test_labels", &[Idx]);
    only(d.task.is_some(), "task", &[Csv, Synthetic]);
    only(d.samples.is_some(), "samples", &[Synthetic]);
    only(d.num_features.is_some(), "num_features", &[Synthetic]);
    only(
        d.classes.is_some(),
        "classes",
        &[Csv, Idx, Synthetic, Text, Tokens],
    );
    only(d.targets.is_some(), "targets", &[Synthetic]);
    only(d.noise.is_some(), "noise", &[Synthetic]);
    if d.features.is_some() && d.exclude.is_some() {
        p.add(
            "data.exclude",
            "give data.features (the columns to read) or data.exclude (the columns to leave \
             out), not both"
                .to_string(),
        );
    }
    p.check(
        d.task() == Task::Classification || d.classes.is_none(),
        "data.classes",
        "only applies to task = \"classification\"",
    );
    // (A single class has nothing to learn, and labels are checked against 0..classes.)
    p.check(
        d.classes.unwrap_or(2) >= 2,
        "data.classes",
        "must be at least 2",
    );

    match source {
        Csv => p.check(
            d.path.is_some(),
            "data.path",
            "missing: source = \"csv\" needs a file path",
        ),
        Tokens => {
            p.check(
                d.path.is_some(),
                "data.path",
                "missing: source = \"tokens\" needs a token file's path (or a glob of shards)",
            );
            p.check(
                d.block_size.is_some(),
                "data.block_size",
                "missing: source = \"tokens\" needs the tokens per sample (the context length)",
            );
            p.check(
                d.val_path.is_none() || d.val_fraction == 0.0,
                "data.val_fraction",
                "give data.val_path (a validation file) or data.val_fraction (the last part of \
                 the training tokens), not both",
            );
            p.check(
                d.tokenizer != Some(crate::spec::Tokenizer::Char),
                "data.tokenizer",
                "\"char\" builds its vocabulary from a text, which token files do not hold; \
                 allowed here: \"gpt2\" or \"bytes\"",
            );
        }
        Text => {
            p.check(
                d.path.is_some(),
                "data.path",
                "missing: source = \"text\" needs a text file's path",
            );
            p.check(
                d.block_size.is_some(),
                "data.block_size",
                "missing: source = \"text\" needs the tokens per sample (the context length)",
            );
        }
        Idx => {
            p.check(
                d.train_images.is_some(),
                "data.train_images",
                "missing: source = \"idx\" needs it",
            );
            p.check(
                d.train_labels.is_some(),
                "data.train_labels",
                "missing: source = \"idx\" needs it",
            );
            p.check(
                d.test_images.is_some() == d.test_labels.is_some(),
                "data.test_images",
                "test_images and test_labels go together: give both or neither",
            );
        }
        Synthetic => {
            let task = d.task();
            p.check(d.samples() >= 2, "data.samples", "must be at least 2");
            p.check(
                d.num_features() >= 1,
                "data.num_features",
                "must be at least 1",
            );
            p.check(
                task == Task::Regression || d.targets.is_none(),
                "data.targets",
                "only applies to task = \"regression\"",
            );
            p.check(d.targets() >= 1, "data.targets", "must be at least 1");
            // What generating the set allocates, in values.
            let (n, width) = (d.samples(), d.num_features());
            // Class centres or the regression's weights: one row of `width` each.
            let (rows, targets) = match task {
                Task::Classification => (d.synthetic_classes(), 1),
                Task::Regression => (d.targets(), d.targets()),
            };
            let (samples, centres) = (
                n as u128 * (width as u128 + targets as u128),
                rows as u128 * width as u128,
            );
            // The key the user most likely set too large.
            let key = match task {
                _ if samples < centres => match task {
                    Task::Classification => "data.classes",
                    Task::Regression => "data.targets",
                },
                _ if width > n => "data.num_features",
                _ => "data.samples",
            };
            p.check(
                samples + centres <= MAX_SYNTHETIC_VALUES as u128,
                key,
                format!(
                    "{n} samples of {width} features{} given: more than the {} values a \
                     synthetic data set may hold",
                    match task {
                        Task::Classification => format!(" in {rows} classes"),
                        Task::Regression => format!(" with {rows} targets"),
                    },
                    MAX_SYNTHETIC_VALUES
                ),
            );
            p.check(
                d.noise() >= 0.0 && d.noise().is_finite(),
                "data.noise",
                format!("{} given; must be a finite number, at least 0", d.noise()),
            );
        }
        Digits => {}
    }
}

fn validate_model(m: &ModelSpec, p: &mut Problems) {
    p.check(
        !m.layers.is_empty(),
        "model.layers",
        "is empty; a model needs at least one layer",
    );
    // A block's layer is checked once, not once a copy.
    let mut checked = std::collections::HashSet::new();
    for (i, layer) in m.layers.iter().enumerate() {
        let key = m.layer_key(i);
        if checked.insert(key.clone()) {
            for (name, message) in layer.layer.problems().found {
                p.add(&format!("{key}.{name}"), message);
            }
        }
    }
    if let Some(shape) = &m.input_shape {
        p.check(
            !shape.is_empty() && shape.iter().all(|&d| (1..=MAX_SIZE).contains(&d)),
            "model.input_shape",
            format!("{shape:?} given; every dimension {}", size_range(1)),
        );
    }
}

fn validate_loss(spec: &JobSpec, p: &mut Problems) {
    let l = &spec.loss;
    p.check(
        (0.0..=1.0).contains(&l.label_smoothing),
        "loss.label_smoothing",
        format!("{} given; must be in [0, 1]", l.label_smoothing),
    );
    p.check(
        l.label_smoothing == 0.0 || l.kind == LossKind::CrossEntropy,
        "loss.label_smoothing",
        "only applies to type = \"cross_entropy\"",
    );
    p.check(
        l.ignore_index.is_none() || l.kind == LossKind::CrossEntropy,
        "loss.ignore_index",
        "only applies to type = \"cross_entropy\"",
    );
}

fn validate_optimizer(o: &OptimizerSpec, p: &mut Problems) {
    p.check(
        o.lr.is_finite() && o.lr > 0.0,
        "optimizer.lr",
        format!("{} given; must be a positive number", o.lr),
    );
    if let Some(wd) = o.weight_decay {
        p.check(
            wd >= 0.0,
            "optimizer.weight_decay",
            format!("{wd} given; must be at least 0"),
        );
    }
    let is_sgd = o.kind == OptimizerKind::Sgd;
    if is_sgd {
        p.check(
            o.momentum >= 0.0,
            "optimizer.momentum",
            format!("{} given; must be at least 0", o.momentum),
        );
        p.check(
            (0.0..=1.0).contains(&o.dampening),
            "optimizer.dampening",
            format!("{} given; must be in [0, 1]", o.dampening),
        );
        p.check(
            !o.nesterov || (o.momentum > 0.0 && o.dampening == 0.0),
            "optimizer.nesterov",
            "needs momentum > 0 and dampening = 0 (as in PyTorch)",
        );
        p.check(
            o.betas == default_betas(),
            "optimizer.betas",
            "only applies to adam and adamw",
        );
        p.check(
            o.eps == default_eps(),
            "optimizer.eps",
            "only applies to adam and adamw",
        );
    } else {
        for (i, b) in o.betas.iter().enumerate() {
            p.check(
                (0.0..1.0).contains(b),
                &format!("optimizer.betas[{i}]"),
                format!("{b} given; must be in [0, 1)"),
            );
        }
        p.check(
            o.eps > 0.0,
            "optimizer.eps",
            format!("{} given; must be positive", o.eps),
        );
        p.check(
            o.momentum == 0.0,
            "optimizer.momentum",
            "only applies to sgd",
        );
        p.check(
            o.dampening == 0.0,
            "optimizer.dampening",
            "only applies to sgd",
        );
        p.check(!o.nesterov, "optimizer.nesterov", "only applies to sgd");
    }

    let s = &o.schedule;
    use ScheduleKind::*;
    let applies = |present: bool, key: &str, kinds: &[ScheduleKind], p: &mut Problems| {
        if present && !kinds.contains(&s.kind) {
            let names: Vec<String> = kinds
                .iter()
                .map(|k| serde_json::to_string(k).unwrap_or_default())
                .collect();
            p.add(
                &format!("optimizer.schedule.{key}"),
                format!("only applies to type = {}", names.join(" or ")),
            );
        }
    };
    applies(s.step_size.is_some(), "step_size", &[Step], p);
    applies(s.milestones.is_some(), "milestones", &[Multistep], p);
    applies(
        s.gamma.is_some(),
        "gamma",
        &[Step, Multistep, Exponential],
        p,
    );
    applies(s.min_lr.is_some(), "min_lr", &[Cosine], p);
    match s.kind {
        Step => p.check(
            s.step_size.is_some_and(|n| n >= 1),
            "optimizer.schedule.step_size",
            "type = \"step\" needs step_size of at least 1",
        ),
        Multistep => p.check(
            s.milestones
                .as_ref()
                .is_some_and(|m| !m.is_empty() && m.windows(2).all(|w| w[0] < w[1])),
            "optimizer.schedule.milestones",
            "type = \"multistep\" needs a non-empty, increasing list of steps",
        ),
        Exponential => p.check(
            s.gamma.is_some(),
            "optimizer.schedule.gamma",
            "type = \"exponential\" needs gamma",
        ),
        _ => {}
    }
    if let Some(g) = s.gamma {
        p.check(
            g > 0.0,
            "optimizer.schedule.gamma",
            format!("{g} given; must be positive"),
        );
    }
    if let Some(m) = s.min_lr {
        p.check(
            m >= 0.0,
            "optimizer.schedule.min_lr",
            format!("{m} given; must be at least 0"),
        );
    }
    if let Some(f) = s.warmup_start_factor {
        p.check(
            (0.0..=1.0).contains(&f),
            "optimizer.schedule.warmup_start_factor",
            format!("{f} given; must be in [0, 1]"),
        );
        p.check(
            s.warmup_steps > 0,
            "optimizer.schedule.warmup_start_factor",
            "only applies with warmup_steps > 0",
        );
    }
}

fn validate_train(t: &TrainSpec, p: &mut Problems) {
    p.check(
        t.epochs >= 1,
        "train.epochs",
        format!("{} given; must be at least 1", t.epochs),
    );
    p.check(
        t.grad_accum_steps >= 1,
        "train.grad_accum_steps",
        format!("{} given; must be at least 1", t.grad_accum_steps),
    );
    for (key, value) in [
        ("train.eval_every_steps", t.eval_every_steps),
        ("train.eval_steps", t.eval_steps),
    ] {
        let v = value.unwrap_or(1);
        p.check(v >= 1, key, format!("{v} given; must be at least 1"));
    }
    p.check(
        t.eval_steps.is_none() || t.eval_every_steps.is_some(),
        "train.eval_steps",
        "only applies with train.eval_every_steps",
    );
    p.check(
        t.log_every >= 1,
        "train.log_every",
        format!("{} given; must be at least 1", t.log_every),
    );
    if let Some(m) = t.max_steps {
        p.check(
            m >= 1,
            "train.max_steps",
            format!("{m} given; must be at least 1"),
        );
    }
    if let Some(c) = t.clip_grad_norm {
        p.check(
            c.is_finite() && c > 0.0,
            "train.clip_grad_norm",
            format!("{c} given; must be a positive number"),
        );
    }
    if let Some(n) = t.threads {
        p.check(
            (1..=MAX_THREADS).contains(&n),
            "train.threads",
            format!("{n} given; must be at least 1 and at most {MAX_THREADS}"),
        );
    }
}

fn validate_checkpoint(spec: &JobSpec, p: &mut Problems) {
    let c = &spec.checkpoint;
    for (key, value) in [
        ("checkpoint.every_steps", c.every_steps),
        ("checkpoint.every_epochs", c.every_epochs),
        ("checkpoint.keep_last", c.keep_last),
    ] {
        if let Some(n) = value {
            p.check(n >= 1, key, format!("{n} given; must be at least 1"));
        }
    }
    if let Some(best) = &c.keep_best {
        // A checkpoint is compared by the evaluation of its own parameters: every_epochs
        // checkpoints after evaluated epochs, every_steps ones at evaluated steps (and the
        // final one) have it.
        let by_epochs = c.every_epochs.is_some() && spec.train.eval_every_epochs > 0;
        let by_steps = c
            .every_steps
            .is_some_and(|n| (spec.train.eval_every_steps).is_some_and(|e| n.is_multiple_of(e)));
        p.check(
            by_epochs || by_steps,
            "checkpoint.keep_best",
            format!(
                "metric \"{}\" needs checkpoints at evaluations: checkpoint.every_epochs with \
                 train.eval_every_epochs > 0, or checkpoint.every_steps a multiple of \
                 train.eval_every_steps",
                best.metric.name()
            ),
        );
        let split = best.metric.split();
        let has_split = match split {
            "val" => spec.data.val_fraction > 0.0 || spec.data.val_path.is_some(),
            _ => spec.data.test_path.is_some() || spec.data.test_images.is_some(),
        };
        p.check(
            has_split,
            "checkpoint.keep_best.metric",
            format!(
                "\"{}\" given, but the job has no {split} split ({})",
                best.metric.name(),
                if split == "val" {
                    "set data.val_fraction"
                } else {
                    "give data.test_path or data.test_images"
                }
            ),
        );
        p.check(
            split != "test" || spec.train.evaluate_test != crate::spec::EvaluateTest::AtEnd,
            "checkpoint.keep_best.metric",
            format!(
                "\"{}\" given, but train.evaluate_test = \"at_end\" evaluates the test split \
                 only after training; keep the best by a val_ metric",
                best.metric.name()
            ),
        );
        p.check(
            !best.metric.is_accuracy() || spec.loss.kind != LossKind::Mse,
            "checkpoint.keep_best.metric",
            format!(
                "\"{}\" given, but loss.type = \"mse\" has no accuracy; use a loss metric",
                best.metric.name()
            ),
        );
    }
    if let Some(ActivationCheckpointing::Segments(s)) = &c.activations {
        let layers = spec.model.layers.len();
        p.check(
            (1..=layers.max(1)).contains(&s.segments),
            "checkpoint.activations.segments",
            format!(
                "{} given; must be between 1 and the number of layers ({layers})",
                s.segments
            ),
        );
    }
}

fn validate_precision(s: &PrecisionSpec, p: &mut Problems) {
    // The scale is an f32, as GradScaler's: one that rounds to inf or to 0 there is no scale.
    let an_f32 = |v: f64| (v as f32).is_finite() && v as f32 > 0.0;
    let shown = |v: f64| match v.abs() {
        a if a >= 1e16 || (a > 0.0 && a < 1e-6) => format!("{v:e}"),
        _ => v.to_string(),
    };
    if let Some(LossScale::Fixed(v)) = s.loss_scale {
        p.check(
            an_f32(v),
            "precision.loss_scale",
            format!(
                "{} given; must be \"dynamic\", \"none\" or a positive number that an f32 \
                 holds (1.4e-45 to 3.4028235e38)",
                shown(v)
            ),
        );
    }
    p.check(
        an_f32(s.init_scale),
        "precision.init_scale",
        format!(
            "{} given; must be a positive number that an f32 holds (1.4e-45 to 3.4028235e38)",
            shown(s.init_scale)
        ),
    );
    p.check(
        // As GradScaler: a factor of 1 would never grow the scale back after a backoff.
        s.growth_factor.is_finite() && s.growth_factor > 1.0,
        "precision.growth_factor",
        format!("{} given; must be greater than 1", s.growth_factor),
    );
    p.check(
        s.backoff_factor > 0.0 && s.backoff_factor < 1.0,
        "precision.backoff_factor",
        format!("{} given; must be in (0, 1)", s.backoff_factor),
    );
    p.check(
        s.growth_interval >= 1,
        "precision.growth_interval",
        format!("{} given; must be at least 1", s.growth_interval),
    );
    if s.mode == PrecisionMode::Fp32 && s.scaling() != Scaling::None {
        p.add(
            "precision.loss_scale",
            "loss scaling only applies to precision.mode = \"fp16\" or \"bf16\"; fp32 \
             gradients do not underflow",
        );
    }
    if s.scaling() != Scaling::Dynamic {
        // The dynamic scaler's settings would be ignored: a user who sets them believes
        // the scale moves. (At their defaults they are what config.toml records.)
        let defaults = PrecisionSpec::default();
        let scaler_keys = [
            ("init_scale", s.init_scale, defaults.init_scale),
            ("growth_factor", s.growth_factor, defaults.growth_factor),
            ("backoff_factor", s.backoff_factor, defaults.backoff_factor),
            (
                "growth_interval",
                s.growth_interval as f64,
                defaults.growth_interval as f64,
            ),
        ];
        for (key, value, default) in scaler_keys {
            if value != default {
                let scaling = match s.loss_scale {
                    Some(LossScale::Fixed(v)) => format!("a fixed precision.loss_scale = {v}"),
                    Some(_) => "precision.loss_scale = \"none\"".to_string(),
                    None => format!(
                        "precision.mode = \"{}\", which scales no loss unless asked",
                        format!("{:?}", s.mode).to_lowercase()
                    ),
                };
                p.add(
                    &format!("precision.{key}"),
                    format!(
                        "{value} given, but it only applies to dynamic loss scaling, and this \
                         job has {scaling}: set precision.loss_scale = \"dynamic\", or leave \
                         {key} out"
                    ),
                );
            }
        }
    }
}

/// A run's name becomes one directory under the runs directory: it must not reach outside
/// it or hide.
pub fn check_run_name(name: &str) -> std::result::Result<(), String> {
    let ok = !name.is_empty()
        && !name.starts_with('.')
        && !name
            .chars()
            .any(|c| c == '/' || c == '\\' || c.is_control());
    match ok {
        true => Ok(()),
        false => Err(format!(
            "{name:?} given; a name is one directory: not empty, not starting with '.', \
             without '/', '\\' or control characters (tabs, line ends)"
        )),
    }
}

/// device.type names a device.
fn validate_device(spec: &JobSpec, p: &mut Problems) {
    let device = spec.device.kind.as_str();
    match parse_device(device) {
        Some(_) => {}
        None => p.add(
            "device.type",
            format!("\"{device}\" given; allowed: \"auto\", \"cpu\", \"cuda\" or \"cuda:N\""),
        ),
    }
}

/// Data parallelism: which devices, and batches that divide among the replicas.
fn validate_parallel(spec: &JobSpec, p: &mut Problems) {
    let parallel = &spec.parallel;
    let device_type = spec.device.kind.as_str();
    let on_cuda = matches!(parse_device(device_type), Some(DeviceChoice::Cuda(_)));
    if parallel.devices.is_some() && parallel.replicas.is_some() {
        p.add(
            "parallel.replicas",
            "given together with parallel.devices; give one of them (devices lists one device \
             per replica, replicas counts replicas on device.type)",
        );
    }
    let threads_on_gpus = "\"threads\" given, but the replicas are on GPUs, and one process \
                           drives one GPU (as DDP recommends); use \"processes\" or \"auto\"";
    if let Some(ParallelDevices::List(devices)) = &parallel.devices {
        let mut kinds = Vec::new();
        for (i, d) in devices.iter().enumerate() {
            match parse_device(d) {
                Some(kind @ (DeviceChoice::Cpu | DeviceChoice::Cuda(_))) => kinds.push(kind),
                _ => p.add(
                    &format!("parallel.devices[{i}]"),
                    format!("\"{d}\" given; allowed: \"cpu\" or \"cuda:N\""),
                ),
            }
        }
        let cpus = kinds.iter().filter(|k| **k == DeviceChoice::Cpu).count();
        let given = format!("{devices:?}");
        if devices.is_empty() {
            p.add(
                "parallel.devices",
                "is empty; list one device per replica, e.g. [\"cpu\", \"cpu\"] or \
                 [\"cuda:0\", \"cuda:1\"]",
            );
        } else if cpus > 0 && cpus < kinds.len() {
            p.add(
                "parallel.devices",
                format!("{given} given: mixes cpu and cuda; all replicas must be of one kind"),
            );
        } else if cpus == 0 && parse_device(device_type) == Some(DeviceChoice::Cpu) {
            p.add(
                "device.type",
                "\"cpu\" given, but parallel.devices lists GPUs; set \"auto\" or \"cuda\"",
            );
        } else if cpus == 0 && on_cuda && device_type != "cuda" {
            p.add(
                "device.type",
                format!(
                    "\"{device_type}\" given, but parallel.devices lists the GPUs; set \"auto\" \
                     or \"cuda\""
                ),
            );
        } else if cpus > 0 && on_cuda {
            p.add(
                "device.type",
                format!(
                    "\"{device_type}\" given, but parallel.devices lists CPU replicas; set \
                     \"cpu\" or \"auto\""
                ),
            );
        }
    }
    let several = matches!(parallel.devices, Some(ParallelDevices::All(_)))
        || parallel.requested().is_some_and(|n| n > 1);
    if parallel.launch == Launch::Threads && parallel.on_gpus(device_type) && several {
        p.add("parallel.launch", threads_on_gpus);
    }
    if let Some(n) = parallel.replicas {
        p.check(
            n >= 1,
            "parallel.replicas",
            format!("{n} given; must be at least 1"),
        );
    }
    if let Some(mb) = parallel.bucket_mb {
        p.check(
            mb.is_finite() && mb > 0.0,
            "parallel.bucket_mb",
            format!("{mb} given; must be a size in MiB above 0 (DDP's default: 25)"),
        );
    }
    if let Some(timeout) = &parallel.timeout {
        if let Err(why) = super::controls::parse_duration(timeout) {
            p.add("parallel.timeout", why);
        }
    }
    if let Some(world) = &parallel.world {
        let env = format!(
            "RANK={}, WORLD_SIZE={}, LOCAL_WORLD_SIZE={} in the environment",
            world.rank, world.world_size, world.local_world_size
        );
        match (&parallel.devices, parallel.replicas) {
            (Some(ParallelDevices::List(devices)), _)
                if devices.len() != world.local_world_size =>
            {
                p.add(
                    "parallel.devices",
                    format!(
                        "{} device(s) given in a multi-process run ({env}), where it lists the \
                         devices of this machine's processes, one per LOCAL_RANK; list {}, or \
                         remove the key",
                        devices.len(),
                        world.local_world_size
                    ),
                )
            }
            (_, Some(n)) if n != world.world_size => p.add(
                "parallel.replicas",
                format!(
                    "{n} replica(s) given in a multi-process run ({env}), where every process \
                     is one replica; remove the key, or unset RANK and WORLD_SIZE to run the \
                     replicas as threads of one process"
                ),
            ),
            _ => {}
        }
    }
    // In a multi-process run the replicas are the processes: the job is validated again once
    // the environment's world is in the spec (`commands::prepare`), and until then a
    // parallel.devices list of the wrong length would be counted as the replicas.
    let world_pending = parallel.world.is_none()
        && crate::spec::Rendezvous::from_env(|k| std::env::var(k).ok()).is_some();
    if world_pending {
        return;
    }
    let replicas = parallel.replicas().unwrap_or(1).max(1);
    let accum = spec.train.grad_accum_steps.max(1);
    match (spec.data.batch_size, spec.data.global_batch_size) {
        (Some(b), Some(g)) => p.add(
            "data.global_batch_size",
            format!(
                "{g} given together with data.batch_size = {b}; give one of them (batch_size: \
                 samples per micro-batch; global_batch_size: samples per optimizer step, \
                 divided into train.grad_accum_steps micro-batches)"
            ),
        ),
        (None, Some(g)) => p.check(
            g % (replicas * accum) == 0,
            "data.global_batch_size",
            format!(
                "{g} given; must be a multiple of {replicas} replica(s) x {accum} accumulation \
                 step(s) = {} (train.grad_accum_steps), so that every replica gets an equal \
                 share of every micro-batch",
                replicas * accum
            ),
        ),
        (batch, None) => {
            let b = spec.batch_size();
            p.check(
                b.is_multiple_of(replicas),
                "data.batch_size",
                format!(
                    "{b} {} with {replicas} data-parallel replicas; must be a multiple of \
                     {replicas}, so that every replica gets an equal share of every micro-batch",
                    if batch.is_some() {
                        "given"
                    } else {
                        "(the default)"
                    }
                ),
            );
        }
    }
}

/// A parsed `device.type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    Auto,
    Cpu,
    Cuda(usize),
}

pub fn parse_device(s: &str) -> Option<DeviceChoice> {
    match s {
        "auto" => Some(DeviceChoice::Auto),
        "cpu" => Some(DeviceChoice::Cpu),
        "cuda" => Some(DeviceChoice::Cuda(0)),
        _ => s
            .strip_prefix("cuda:")?
            .parse()
            .ok()
            .map(DeviceChoice::Cuda),
    }
}
