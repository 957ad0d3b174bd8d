//! `trainer eval` and `trainer predict`: a trained model read back from its run directory
//! (its final weights or one of its checkpoints) and run on a split of its own data, on
//! another file of the same kind, or on inputs without labels. Both normalise new data with
//! the run's preprocess.json, never with statistics of their own.

use super::*;
use crate::data::{Dataset, Preprocess};
use crate::graph::Network;
use crate::spec::{DataSource, LossKind};
use crate::tensor::LossStats;
use crate::train::Samples;

/// `trainer eval`'s arguments.
#[derive(clap::Args)]
pub struct EvalArgs {
    /// The run directory, or a job file whose model.init_from gives the weights.
    pub run: PathBuf,
    /// train, val or test (default: val, else test).
    #[arg(long)]
    pub split: Option<String>,
    /// Another data file of the run's kind, normalised as the run's training data was: a
    /// CSV file with the run's columns, or IDX images (with --labels).
    #[arg(long, value_name = "FILE")]
    pub data: Option<PathBuf>,
    /// The IDX labels of --data's images.
    #[arg(long, value_name = "FILE", requires = "data")]
    pub labels: Option<PathBuf>,
    /// A training checkpoint of the run instead of its final weights: a file, `last` for
    /// the newest, or `best` for the one its checkpoint.keep_best keeps.
    #[arg(long, value_name = "FILE")]
    pub checkpoint: Option<PathBuf>,
    /// Write the metrics as CSV (split,metric,class,value).
    #[arg(long, short, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Write the confusion matrix as CSV (a row per true class).
    #[arg(long, value_name = "FILE")]
    pub confusion: Option<PathBuf>,
}

/// What `trainer eval` measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    /// The split's name, or the file evaluated.
    pub split: String,
    pub samples: usize,
    /// The weights evaluated: model.safetensors or a checkpoint.
    pub weights: PathBuf,
    /// (metric, value) in the order printed: loss, accuracy or the regression errors.
    pub metrics: Vec<(String, f64)>,
    /// Classification: each class's accuracy (None for a class without samples).
    pub class_accuracy: Vec<Option<f64>>,
    /// Classification: counts by [true class][predicted class].
    pub confusion: Vec<Vec<u64>>,
    /// Classification: each class's name (its text label, else its index).
    pub class_names: Vec<String>,
}

/// A trained model read back from its run directory, or a job's model.init_from weights,
/// on the CPU.
pub(super) struct Trained {
    pub spec: JobSpec,
    pub graph: Graph,
    pub params: Vec<f32>,
    pub running_stats: Vec<f32>,
    pub preprocess: Preprocess,
    /// The file the weights came from.
    weights: PathBuf,
}

/// `--checkpoint best`: the checkpoint the run's checkpoint.keep_best keeps.
const BEST: &str = "best";
/// `--checkpoint last`: the run's newest checkpoint, as Lightning's `ckpt_path="last"`.
const LAST: &str = "last";

/// The run's newest checkpoint.
fn last_checkpoint(run: &Path) -> Result<PathBuf> {
    let newest = checkpoint::list(&run.join("checkpoints")).pop();
    newest.map(|(_, path)| path).ok_or_else(|| {
        Error::Job(format!(
            "--checkpoint last: {} has no checkpoints (checkpoints/step-*.safetensors)",
            run.display()
        ))
    })
}

/// The run's checkpoint that its job's checkpoint.keep_best ranks first.
fn best_checkpoint(run: &Path, spec: &JobSpec) -> Result<PathBuf> {
    let Some(keep_best) = &spec.checkpoint.keep_best else {
        return Err(Error::Job(format!(
            "--checkpoint best: {} has no checkpoint.keep_best to rank its checkpoints by; \
             give a checkpoint file",
            run.display()
        )));
    };
    checkpoint::best(&run.join("checkpoints"), keep_best).ok_or_else(|| {
        Error::Job(format!(
            "--checkpoint best: no checkpoint of {} carries an evaluation of {}",
            run.display(),
            keep_best.metric.name()
        ))
    })
}

/// Why a run without final weights cannot be read as it is, and what it has instead: a run
/// that stopped before its end has only its checkpoints.
fn unfinished(run: &Path) -> Error {
    let hint = match checkpoint::list(&run.join("checkpoints")).pop() {
        Some((step, _)) => format!(
            "its newest checkpoint is from step {step}: pass --checkpoint last (or a \
             checkpoint file), or finish it with `trainer run --resume {}`",
            run.display()
        ),
        None => "it has no checkpoints either".to_string(),
    };
    Error::Job(format!(
        "{}: no final weights ({}), which a run writes when it finishes; {hint}",
        run.display(),
        weights::MODEL_FILE
    ))
}

impl Trained {
    /// `run`'s model: a run directory's final weights or `checkpoint`, or a job file's
    /// model.init_from. A checkpoint named `best` is the one checkpoint.keep_best keeps;
    /// one named `last` is the newest.
    pub fn load(run: &Path, checkpoint: Option<&Path>) -> Result<Trained> {
        if run.is_file() && run.extension().is_some_and(|e| e == "toml") {
            return Trained::from_job(run, checkpoint);
        }
        let config = run.join("config.toml");
        if !config.is_file() {
            return Err(Error::Job(format!(
                "{}: not a run directory (no config.toml)",
                run.display()
            )));
        }
        // Quietly: the run's log has the job's warnings.
        let quiet = tracing::subscriber::NoSubscriber::default();
        let spec = tracing::subscriber::with_default(quiet, || spec::load_job(&config, &[]))?;
        let preprocess = Preprocess::read(run)?;
        let shape = DataShape {
            sample_shape: preprocess.sample_shape.clone(),
            classes: preprocess.classes,
            classes_from: None,
            target_dim: preprocess.target_dim,
        };
        let graph = Graph::build(&spec, &shape)
            .map_err(|e| e.with_note(&format!("building the model of {}", config.display())))?;
        let named;
        let checkpoint = match checkpoint {
            Some(name) if name == Path::new(BEST) && !name.exists() => {
                named = best_checkpoint(run, &spec)?;
                Some(named.as_path())
            }
            Some(name) if name == Path::new(LAST) && !name.exists() => {
                named = last_checkpoint(run)?;
                Some(named.as_path())
            }
            other => other,
        };
        let (params, running_stats, weights) = match checkpoint {
            Some(path) => {
                let c = checkpoint::load(path).map_err(|why| {
                    Error::Job(format!("cannot read checkpoint {}: {why}", path.display()))
                })?;
                let params = match c.params.len() == graph.param_len {
                    true => c.params,
                    false => graph.from_packed_layout(&c.params).ok_or_else(|| {
                        Error::Job(format!(
                            "checkpoint {}: {} parameter values, the run's model needs {}",
                            path.display(),
                            c.params.len(),
                            graph.param_len
                        ))
                    })?,
                };
                (params, c.running_stats, path.to_path_buf())
            }
            None => {
                let path = run.join(weights::MODEL_FILE);
                if !path.exists() {
                    return Err(unfinished(run));
                }
                let w = weights::read_as(&path, &graph, "the run's final weights ")?;
                (w.params, w.running_stats, path)
            }
        };
        Ok(Trained {
            spec,
            graph,
            params,
            running_stats,
            preprocess,
            weights,
        })
    }

    /// A job's model before training: the weights model.init_from names (GPT-2's, say), the
    /// vocabulary and preprocessing of the job's data (read only where the vocabulary is the
    /// data's).
    fn from_job(job: &Path, checkpoint: Option<&Path>) -> Result<Trained> {
        let shown = job.display();
        if checkpoint.is_some() {
            return Err(Error::Job(format!(
                "--checkpoint: {shown} is a job file; a checkpoint belongs to a run directory"
            )));
        }
        let spec = spec::load_job(job, &[])?;
        let Some(init_from) = spec.model.init_from.clone() else {
            return Err(Error::Job(format!(
                "{shown}: a job file's model is its model.init_from weights, and this job has \
                 none: give a run directory, or a job that starts from weights"
            )));
        };
        // GPT-2's vocabulary is the tokenizer's: `sample` need not read a corpus for it.
        let preprocess = match data::text::fixed_preprocess(&spec.data) {
            Some(preprocess) => preprocess,
            None => {
                let data = data::load(&spec.data, spec.job.seed);
                data.map_err(|e| with_data_key(job, &[], &spec, e))?
                    .preprocess
            }
        };
        let shape = DataShape {
            sample_shape: preprocess.sample_shape.clone(),
            classes: preprocess.classes,
            classes_from: None,
            target_dim: preprocess.target_dim,
        };
        let graph = Graph::build(&spec, &shape)?;
        let weights = read_init_from(job, &[], &init_from, &graph)?;
        Ok(Trained {
            spec,
            graph,
            params: weights.params,
            running_stats: weights.running_stats,
            preprocess,
            weights: init_from,
        })
    }

    /// Runs the model over `set` in batches of `batch` (evaluation mode: no dropout, batch
    /// norm's running statistics): the loss statistics, as training's evaluation sums them,
    /// and, if `keep`, every sample's outputs (else none).
    fn outputs(self, set: &Dataset, batch: usize, keep: bool) -> Result<(LossStats, Vec<f32>)> {
        let backend = CpuBackend::new(cpu_threads(&self.spec));
        let half = train::half_kind(self.spec.precision.mode);
        let (row_len, target_dim) = (self.preprocess.row_len(), self.graph.objective.target_dim);
        let width: usize = self.graph.output_shape().iter().product();
        let batch = batch.clamp(1, set.len.max(1));
        let mut net = Network::with_precision(
            &backend,
            self.graph,
            &self.params,
            batch,
            self.spec.job.seed,
            half,
        )?;
        net.set_running_stats(&backend, &self.running_stats)?;
        let mut stats = backend.new_stats()?;
        let mut outputs = vec![0.0; if keep { set.len * width } else { 0 }];
        let shape = (row_len, target_dim);
        // Token files stay where they lie, as in training.
        let resident = set.tokens.on_disk_bytes() == 0;
        let samples = Samples::new(&backend, set.clone(), shape, net.data_reads(), resident)?;
        let mut rows: Vec<u64> = Vec::with_capacity(batch);
        for first in (0..set.len).step_by(batch) {
            let n = batch.min(set.len - first);
            rows.clear();
            rows.extend(first as u64..(first + n) as u64);
            samples.load(&backend, &rows, &mut net);
            net.forward(&backend, n, false, 0);
            // Before the loss, which may write its gradient over the outputs.
            if keep {
                let out = &mut outputs[first * width..(first + n) * width];
                backend.download(net.output(), out);
            }
            net.loss(&backend, n, None, &mut stats);
        }
        samples.check_reads()?;
        Ok((backend.take_stats(&mut stats), outputs))
    }
}

/// `trainer eval`: the metrics of the run's model on one split or file; written as CSV when
/// asked.
pub fn evaluate(args: &EvalArgs) -> Result<Evaluation> {
    let trained = Trained::load(&args.run, args.checkpoint.as_deref())?;
    let (name, set, batch) = match &args.data {
        Some(path) => {
            if args.split.is_some() {
                return Err(Error::Job(
                    "--split and --data: give one (a split of the run's data, or a file)".into(),
                ));
            }
            let set = data::load_other(
                &trained.spec.data,
                &trained.preprocess,
                path,
                args.labels.as_deref(),
            )?;
            (path.display().to_string(), set, trained.spec.batch_size())
        }
        None => {
            let (name, set, largest) = own_split(&args.run, &trained, args.split.as_deref())?;
            // Batches as training's evaluation made them (a replica's rows), so the sums are
            // the same.
            let batch = BatchLayout::of(&trained.spec).buffer_rows(largest);
            (name, set, batch)
        }
    };
    let loss = trained.spec.loss.kind;
    let (classes, has_accuracy) = (
        trained.preprocess.classes,
        trained.graph.objective.has_accuracy,
    );
    let preprocess = trained.preprocess.clone();
    let width: usize = trained.graph.output_shape().iter().product();
    let weights = trained.weights.clone();
    // A language model's outputs are a vocabulary's logits at every position: too many to
    // keep, and its vocabulary too large for a confusion matrix.
    let text = set.windows.is_some();
    let (stats, outputs) = trained.outputs(&set, batch, !text)?;
    let mut evaluation = Evaluation {
        split: name,
        samples: set.len,
        weights,
        metrics: vec![("loss".into(), stats.loss_sum / stats.samples)],
        class_accuracy: Vec::new(),
        confusion: Vec::new(),
        class_names: Vec::new(),
    };
    if has_accuracy {
        evaluation
            .metrics
            .push(("accuracy".into(), stats.correct / stats.samples));
    }
    match (loss, classes) {
        (LossKind::CrossEntropy, Some(_)) if text => {
            let loss = stats.loss_sum / stats.samples;
            evaluation.metrics.push(("perplexity".into(), loss.exp()));
        }
        (LossKind::CrossEntropy, Some(classes)) => {
            let mut confusion = vec![vec![0u64; classes]; classes];
            for (row, &target) in outputs.chunks_exact(width).zip(&set.targets) {
                confusion[target as usize][argmax(row)] += 1;
            }
            evaluation.class_accuracy = confusion
                .iter()
                .enumerate()
                .map(|(k, row)| {
                    let n: u64 = row.iter().sum();
                    (n > 0).then(|| row[k] as f64 / n as f64)
                })
                .collect();
            evaluation.confusion = confusion;
            evaluation.class_names = (0..classes).map(|k| preprocess.class_name(k)).collect();
        }
        (LossKind::Mse, _) => {
            evaluation
                .metrics
                .extend(regression_errors(&outputs, &set.targets, width));
        }
        _ => {}
    }
    if let Some(path) = &args.output {
        write_text(path, &metrics_csv(&evaluation))?;
    }
    if let Some(path) = &args.confusion {
        if evaluation.confusion.is_empty() {
            return Err(Error::Job(
                "--confusion: the run's model does not classify (cross_entropy over classes)"
                    .into(),
            ));
        }
        write_text(path, &confusion_csv(&evaluation))?;
    }
    Ok(evaluation)
}

/// The run's own split `name` (default: val, else test), loaded and split as the run did,
/// and the largest split's size (training's evaluation batches depend on it).
fn own_split(
    run: &Path,
    trained: &Trained,
    name: Option<&str>,
) -> Result<(String, Dataset, usize)> {
    let quiet = tracing::subscriber::NoSubscriber::default();
    let data = tracing::subscriber::with_default(quiet, || {
        data::load(&trained.spec.data, trained.spec.job.seed)
    })?;
    if data.preprocess != trained.preprocess {
        return Err(Error::Job(format!(
            "the run's data reads differently now than when it trained (its file changed?), so \
             its split is not the one it evaluated: give the file with --data, which is \
             normalised as {} says",
            run.join(data::preprocess::FILE).display()
        )));
    }
    let largest = data.largest_split();
    let available: Vec<&str> = std::iter::once("train")
        .chain(data.eval.iter().map(|(n, _)| *n))
        .collect();
    let wanted = match name {
        Some(n) => n,
        None => available
            .iter()
            .copied()
            .find(|n| *n != "train")
            .ok_or_else(|| {
                Error::Job(
                    "the run has no val or test split: give --split train, or --data FILE".into(),
                )
            })?,
    };
    let Data {
        train, mut eval, ..
    } = data;
    let set = match wanted {
        // Its windows a block apart, as the validation split's, not at every token.
        "train" if train.windows.is_some() => {
            train.a_block_apart(trained.preprocess.sample_shape.iter().product())
        }
        "train" => train,
        other => match eval.iter().position(|(n, _)| *n == other) {
            Some(i) => eval.swap_remove(i).1,
            None => {
                return Err(Error::Job(format!(
                    "--split {other}: the run's data has the splits {}",
                    available.join(", ")
                )))
            }
        },
    };
    Ok((wanted.to_string(), set, largest))
}

fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        // The first of equal values, as torch.argmax; a NaN is never the largest.
        if *v > row[best] || row[best].is_nan() && !v.is_nan() {
            best = i;
        }
    }
    best
}

/// MSE, MAE, RMSE and R² (the mean of each output's, as scikit-learn's r2_score) of
/// `outputs` against `targets`, `width` values a sample.
fn regression_errors(outputs: &[f32], targets: &[f32], width: usize) -> Vec<(String, f64)> {
    let n = (outputs.len() / width.max(1)) as f64;
    let (mut squared, mut absolute) = (0.0f64, 0.0f64);
    let mut r2 = 0.0;
    for j in 0..width {
        let column = |values: &[f32]| -> Vec<f64> {
            values
                .iter()
                .skip(j)
                .step_by(width)
                .map(|&v| f64::from(v))
                .collect()
        };
        let (y, p) = (column(targets), column(outputs));
        let mean = y.iter().sum::<f64>() / n;
        let residual: f64 = y.iter().zip(&p).map(|(y, p)| (y - p).powi(2)).sum();
        let total: f64 = y.iter().map(|y| (y - mean).powi(2)).sum();
        squared += residual;
        absolute += y.iter().zip(&p).map(|(y, p)| (y - p).abs()).sum::<f64>();
        // A constant target: R² is 1 for an exact fit, else 0 (scikit-learn's convention).
        r2 += match total > 0.0 {
            true => 1.0 - residual / total,
            false => f64::from(u8::from(residual == 0.0)),
        };
    }
    let values = n * width as f64;
    let mse = squared / values;
    vec![
        ("mse".into(), mse),
        ("mae".into(), absolute / values),
        ("rmse".into(), mse.sqrt()),
        ("r2".into(), r2 / width as f64),
    ]
}

/// split,metric,class,value: one metric a row; `class` only for a class's accuracy.
fn metrics_csv(e: &Evaluation) -> String {
    let mut text = String::from("split,metric,class,value\n");
    let split = csv_field(&e.split);
    text += &format!("{split},samples,,{}\n", e.samples);
    for (metric, value) in &e.metrics {
        text += &format!("{split},{metric},,{value}\n");
    }
    for (a, class) in e.class_accuracy.iter().zip(&e.class_names) {
        let value = a.map_or(String::new(), |a| a.to_string());
        text += &format!("{split},class_accuracy,{},{value}\n", csv_field(class));
    }
    text
}

/// A CSV field, quoted where it needs to be.
fn csv_field(text: &str) -> String {
    match text.contains([',', '"', '\n', '\r']) {
        true => format!("\"{}\"", text.replace('"', "\"\"")),
        false => text.to_string(),
    }
}

/// One row per true class, one column per predicted class.
fn confusion_csv(e: &Evaluation) -> String {
    let mut text = String::from("true_class");
    for class in &e.class_names {
        text += &format!(",{}", csv_field(&format!("predicted_{class}")));
    }
    text.push('\n');
    for (row, class) in e.confusion.iter().zip(&e.class_names) {
        text += &csv_field(class);
        for count in row {
            text += &format!(",{count}");
        }
        text.push('\n');
    }
    text
}

fn write_text(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text)
        .map_err(|e| Error::Runtime(format!("cannot write {}: {e}", path.display())))
}

/// The report `trainer eval` prints.
pub fn report(e: &Evaluation) -> String {
    let mut text = format!(
        "{} ({} samples), weights {}\n",
        e.split,
        e.samples,
        e.weights.display()
    );
    for (metric, value) in &e.metrics {
        text += &format!("  {metric:<10} {value:.6}\n");
    }
    if !e.class_accuracy.is_empty() {
        text += "  accuracy by class:";
        for (a, class) in e.class_accuracy.iter().zip(&e.class_names) {
            text += &match a {
                Some(a) => format!(" {class}: {a:.4}"),
                None => format!(" {class}: -"),
            };
        }
        text.push('\n');
    }
    text
}

/// `trainer predict`'s arguments.
#[derive(clap::Args)]
pub struct PredictArgs {
    /// The run directory, or a job file whose model.init_from gives the weights.
    pub run: PathBuf,
    /// The inputs: a CSV file of the run's columns (the label may be left out), or IDX
    /// images.
    pub input: PathBuf,
    /// Where the predictions go (CSV).
    #[arg(long, short, value_name = "FILE")]
    pub output: PathBuf,
    /// A training checkpoint of the run instead of its final weights: a file, `last` for
    /// the newest, or `best` for the one its checkpoint.keep_best keeps.
    #[arg(long, value_name = "FILE")]
    pub checkpoint: Option<PathBuf>,
    /// Input columns copied to each output row first, e.g. an id (by header name, or by
    /// index in a file without a header).
    #[arg(long, value_delimiter = ',', value_name = "COLUMN,...")]
    pub keep_columns: Vec<String>,
}

/// The inputs read for `predict`: features (raw), how many, and the kept columns' header
/// and values.
struct Inputs {
    features: Vec<f32>,
    len: usize,
    kept_header: Vec<String>,
    kept: Vec<Vec<String>>,
}

/// `trainer predict`: one output row per input row; returns how many.
pub fn predict(args: &PredictArgs) -> Result<usize> {
    let trained = Trained::load(&args.run, args.checkpoint.as_deref())?;
    if let source @ (DataSource::Text | DataSource::Tokens) = trained.preprocess.source {
        let run = args.run.display();
        return Err(Error::Job(format!(
            "{run} is a language model's run (data.source = {}): predict reads rows of a CSV \
             or IDX file; write text with `trainer sample {run} --prompt TEXT`",
            serde_json::to_value(source).unwrap_or_default()
        )));
    }
    let mut inputs = read_inputs(&trained, &args.input, &args.keep_columns)?;
    trained.preprocess.apply(&mut inputs.features);
    let target_dim = trained.graph.objective.target_dim;
    let set = Dataset {
        targets: vec![0.0; inputs.len * target_dim],
        features: std::mem::take(&mut inputs.features),
        len: inputs.len,
        ..Dataset::default()
    };
    let loss = trained.spec.loss.kind;
    let width: usize = trained.graph.output_shape().iter().product();
    let batch = trained.spec.batch_size();
    let preprocess = trained.preprocess.clone();
    let (_, outputs) = trained.outputs(&set, batch, true)?;
    let io = |e: csv::Error| Error::Runtime(format!("cannot write {}: {e}", args.output.display()));
    let mut out = csv::Writer::from_path(&args.output).map_err(io)?;
    let mut header = inputs.kept_header.clone();
    let numbered = |name: &str| -> Vec<String> {
        match width {
            1 => vec![name.to_string()],
            _ => (0..width).map(|j| format!("{name}_{j}")).collect(),
        }
    };
    match loss {
        LossKind::CrossEntropy => {
            header.push("predicted_class".into());
            header.extend((0..width).map(|k| format!("prob_{}", preprocess.class_name(k))));
        }
        LossKind::BceWithLogits => {
            header.extend(numbered("predicted"));
            header.extend(numbered("prob"));
        }
        LossKind::Mse => header.extend(numbered("prediction")),
    }
    out.write_record(&header).map_err(io)?;
    for (i, row) in outputs.chunks_exact(width).enumerate() {
        let mut record = inputs.kept.get(i).cloned().unwrap_or_default();
        match loss {
            LossKind::CrossEntropy => {
                record.push(preprocess.class_name(argmax(row)));
                record.extend(softmax(row).iter().map(|p| p.to_string()));
            }
            LossKind::BceWithLogits => {
                let probs: Vec<f64> = row
                    .iter()
                    .map(|&z| 1.0 / (1.0 + (-f64::from(z)).exp()))
                    .collect();
                record.extend(probs.iter().map(|&p| u8::from(p > 0.5).to_string()));
                record.extend(probs.iter().map(|p| p.to_string()));
            }
            LossKind::Mse => record.extend(row.iter().map(|v| v.to_string())),
        }
        out.write_record(&record).map_err(io)?;
    }
    out.flush()
        .map_err(|e| Error::Runtime(format!("cannot write {}: {e}", args.output.display())))?;
    Ok(inputs.len)
}

/// Softmax in f64, as probabilities that sum to 1.
fn softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits
        .iter()
        .fold(f64::NEG_INFINITY, |m, &z| m.max(f64::from(z)));
    let exp: Vec<f64> = logits.iter().map(|&z| (f64::from(z) - max).exp()).collect();
    let sum: f64 = exp.iter().sum();
    exp.iter().map(|e| e / sum).collect()
}

/// Reads `predict`'s input: IDX images (recognised by their magic number) or CSV.
fn read_inputs(trained: &Trained, path: &Path, keep: &[String]) -> Result<Inputs> {
    let name = path.display().to_string();
    if let Some((shape, features)) = data::idx_images(path)? {
        if !keep.is_empty() {
            return Err(Error::Job(format!(
                "--keep-columns: {name} holds IDX images, which have no columns"
            )));
        }
        if shape[1..] != trained.preprocess.sample_shape[..] {
            return Err(Error::Job(format!(
                "{name}: images of shape {:?}, the model's input is {:?}",
                &shape[1..],
                trained.preprocess.sample_shape
            )));
        }
        return Ok(Inputs {
            len: shape[0],
            features,
            kept_header: Vec::new(),
            kept: Vec::new(),
        });
    }
    let text = data::read_text(path)?;
    let p = &trained.preprocess;
    // A CSV job's header setting; other runs' inputs have a header when the first line is
    // not all numbers.
    let has_header = match p.feature_columns {
        Some(_) => trained.spec.data.header(),
        None => text
            .lines()
            .next()
            .is_some_and(|l| l.split(',').any(|f| f.trim().parse::<f64>().is_err())),
    };
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(has_header)
        .from_reader(text.as_bytes());
    let headers: Vec<String> = match has_header {
        true => reader
            .headers()
            .map_err(|e| Error::Job(format!("{name}: {e}")))?
            .iter()
            .map(|h| h.trim().to_string())
            .collect(),
        false => Vec::new(),
    };
    let find = |column: &str| -> Result<usize> {
        match has_header {
            true => headers.iter().position(|h| h == column).ok_or_else(|| {
                Error::Job(format!(
                    "{name}: no column `{column}`; its columns: {}",
                    headers.join(", ")
                ))
            }),
            false => column.parse().map_err(|_| {
                Error::Job(format!(
                    "{name}: `{column}` is not a column index (the file is read without a \
                     header, as the run's data was)"
                ))
            }),
        }
    };
    let kept_columns: Vec<usize> = keep.iter().map(|c| find(c)).collect::<Result<_>>()?;
    let feature_columns: Option<Vec<usize>> = match &p.feature_columns {
        Some(columns) => Some(columns.iter().map(|c| find(c)).collect::<Result<_>>()?),
        None => None,
    };
    let row_len = p.row_len();
    let mut inputs = Inputs {
        features: Vec::new(),
        len: 0,
        kept_header: match has_header {
            true => keep.to_vec(),
            false => keep.iter().map(|c| format!("column_{c}")).collect(),
        },
        kept: Vec::new(),
    };
    for (i, record) in reader.records().enumerate() {
        let record = record.map_err(|e| Error::Job(format!("{name}: {e}")))?;
        let line = record.position().map_or(i + 1, |at| at.line() as usize);
        // Without named columns (a digits or IDX run given a CSV file), every column but
        // the kept ones is a feature, in order.
        let columns: Vec<usize> = match &feature_columns {
            Some(columns) => columns.clone(),
            None => (0..record.len())
                .filter(|c| !kept_columns.contains(c))
                .collect(),
        };
        if columns.len() != row_len {
            return Err(Error::Job(format!(
                "{name}: line {line}: {} feature values, the model takes {row_len}",
                columns.len()
            )));
        }
        for &c in &columns {
            let field = record
                .get(c)
                .ok_or_else(|| Error::Job(format!("{name}: line {line}: no column {c}")))?;
            let value: f32 = field.trim().parse().map_err(|_| {
                Error::Job(format!(
                    "{name}: line {line}, column {c}: `{field}` is not a number"
                ))
            })?;
            inputs.features.push(value);
        }
        inputs.kept.push(
            kept_columns
                .iter()
                .map(|&c| record.get(c).unwrap_or_default().to_string())
                .collect(),
        );
        inputs.len += 1;
    }
    if inputs.len == 0 {
        return Err(Error::Job(format!("{name}: no rows to predict")));
    }
    Ok(inputs)
}
