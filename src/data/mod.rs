//! Data sources (digits, csv, idx, synthetic), the train/validation split, normalisation, and
//! the seeded batch order. Everything is loaded and checked before a run directory exists:
//! bad data is a bad job (exit 2) with the file and the row or byte offset named.

pub mod order;
pub mod preprocess;
mod sources;
pub mod text;
mod token_ids;
mod tokens;
pub mod vocabulary;

pub use order::EpochOrder;
pub use preprocess::Preprocess;
pub(crate) use sources::{idx_images, read_text};
pub use token_ids::TokenIds;
pub use tokens::{read_shard, ShardWriter, Shards};

use crate::error::{Error, Result};
use crate::spec::{DataPlacement, DataSource, DataSpec, Task};
use crate::tensor::rng::{derive, Rng};
use sources::MAX_CLASS_INDEX;
use std::path::Path;

/// Samples as flat rows: `features` is [len, numel(shape)], `targets` is [len, target_dim]
/// (a class index stored as f32 for classification). A text's samples are windows of its
/// `tokens` instead.
#[derive(Debug, Clone, Default)]
pub struct Dataset {
    pub features: Vec<f32>,
    pub targets: Vec<f32>,
    /// A text's token ids (empty for other data).
    pub tokens: TokenIds,
    pub len: usize,
    pub origin: Origin,
    /// A text's samples: windows of `tokens`, this many tokens apart, whose targets are the
    /// tokens one on (`features` and `targets` are empty). None: a row of features and of
    /// targets each.
    pub windows: Option<usize>,
}

/// What of the data a model reads: its values, its token ids (which embeddings read), or
/// both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataReads {
    pub values: bool,
    pub ids: bool,
}

impl Dataset {
    /// The bytes of host memory its features, targets and tokens take (4 each; token
    /// files read where they lie take none).
    pub fn bytes(&self) -> usize {
        (self.features.len() + self.targets.len()) * 4 + self.tokens.heap_bytes()
    }

    /// A text's windows a block apart, as evaluation reads them: each token is read once.
    /// Training's start at every token.
    pub fn a_block_apart(self, block: usize) -> Dataset {
        Dataset {
            len: self.tokens.len().saturating_sub(1) / block,
            windows: Some(block),
            ..self
        }
    }

    /// The bytes of what a model that `reads` so keeps of it while training
    /// (`train::Samples`): the values and the ids it reads, and the targets. A text's tokens
    /// are its ids and its targets.
    pub fn held_bytes(&self, reads: DataReads) -> usize {
        let inputs = match self.windows {
            Some(_) => self.tokens.len(),
            None => self.features.len(),
        };
        let ids = self.windows.is_none() && reads.ids;
        let copies = usize::from(reads.values) + usize::from(ids);
        (inputs * copies + self.targets.len() + self.tokens.len()) * 4
    }

    fn select(&self, rows: &[usize], row_len: usize, target_dim: usize) -> Dataset {
        let mut out = Dataset {
            len: rows.len(),
            windows: None,
            origin: self.origin.select(rows),
            ..Default::default()
        };
        for &r in rows {
            out.features
                .extend_from_slice(&self.features[r * row_len..(r + 1) * row_len]);
            out.targets
                .extend_from_slice(&self.targets[r * target_dim..(r + 1) * target_dim]);
        }
        out
    }
}

/// Where a split's samples came from, for errors that name one: the files of its features
/// and of its labels (one file but for IDX), and each sample's place there.
#[derive(Debug, Clone, Default)]
pub struct Origin {
    pub features: String,
    pub labels: String,
    /// Each sample's line in a CSV file; elsewhere a sample's place is its index.
    pub lines: Option<Vec<u64>>,
    /// Each sample's index in its file, where the split holds some of them (val_fraction).
    pub rows: Option<Vec<usize>>,
}

impl Origin {
    /// One file's samples, at their index or (CSV) their `lines`.
    pub fn file(name: &str, lines: Option<Vec<u64>>) -> Origin {
        Origin {
            features: name.to_string(),
            labels: name.to_string(),
            lines,
            rows: None,
        }
    }

    /// "digits.csv: line 14" or "train-images-idx3-ubyte: sample 12" for sample `i`, in
    /// `file` (its features' or its labels').
    pub fn place(&self, file: &str, i: usize) -> String {
        if let Some(lines) = &self.lines {
            return format!("{file}: line {}", lines[i]);
        }
        let index = self.rows.as_ref().map_or(i, |rows| rows[i]);
        format!("{file}: sample {index}")
    }

    fn select(&self, rows: &[usize]) -> Origin {
        let index = |r: usize| self.rows.as_ref().map_or(r, |all| all[r]);
        Origin {
            features: self.features.clone(),
            labels: self.labels.clone(),
            lines: self
                .lines
                .as_ref()
                .map(|l| rows.iter().map(|&r| l[r]).collect()),
            rows: Some(rows.iter().map(|&r| index(r)).collect()),
        }
    }
}

/// A loaded data set, split and normalised.
#[derive(Debug, Clone)]
pub struct Data {
    pub sample_shape: Vec<usize>,
    /// Some(classes) for classification.
    pub classes: Option<usize>,
    /// Where the number of classes came from when data.classes does not give it (the largest
    /// label and its place), for errors about it.
    pub classes_from: Option<String>,
    pub target_dim: usize,
    pub train: Dataset,
    /// Evaluation splits by name: "val" (held out from train), "test" (an explicit set).
    pub eval: Vec<(&'static str, Dataset)>,
    /// The normalisation applied, and what the samples are: saved with the run.
    pub preprocess: Preprocess,
}

/// What a source produces before splitting.
pub(crate) struct Raw {
    pub sample_shape: Vec<usize>,
    pub task: Task,
    pub train: Dataset,
    pub test: Option<Dataset>,
    /// CSV: the columns read, features then the label.
    pub columns: Option<Vec<String>>,
    /// CSV classification with text labels: the class names, sorted (a target is an index).
    pub class_names: Option<Vec<String>>,
}

impl Data {
    pub fn row_len(&self) -> usize {
        self.sample_shape.iter().product()
    }

    /// The most samples of any split: no batch (training's or an evaluation's) holds more,
    /// however large data.batch_size is (a larger one is the whole split, once per epoch).
    pub fn largest_split(&self) -> usize {
        let evals = self.eval.iter().map(|(_, d)| d.len);
        evals.fold(self.train.len, usize::max).max(1)
    }

    /// Every split: training, then the evaluation splits.
    fn splits(&self) -> impl Iterator<Item = &Dataset> {
        std::iter::once(&self.train).chain(self.eval.iter().map(|(_, d)| d))
    }

    /// Whether every feature of every split is a finite number (loading warns of the others).
    pub fn features_are_finite(&self) -> bool {
        self.splits()
            .flat_map(|d| &d.features)
            .all(|v| v.is_finite())
    }

    /// Whether every feature and target of every split is a finite number: where one is not,
    /// a diverged run's error says so before suggesting a lower learning rate.
    pub fn all_finite(&self) -> bool {
        self.features_are_finite()
            && self
                .splits()
                .flat_map(|d| &d.targets)
                .all(|v| v.is_finite())
    }

    /// The bytes of every split, features, targets and tokens.
    pub fn bytes(&self) -> usize {
        self.splits().map(Dataset::bytes).sum()
    }

    /// The bytes of the token files that every split reads where they lie (0 for none).
    pub fn on_disk_bytes(&self) -> usize {
        self.splits().map(|d| d.tokens.on_disk_bytes()).sum()
    }

    /// Where a run keeps the data set, as `device.data` asks: "auto" leaves token files
    /// where they lie, since a batch copies a few hundred KB and the files may outgrow any
    /// memory.
    pub fn placement(&self, asked: DataPlacement) -> DataPlacement {
        match asked {
            DataPlacement::Auto if self.on_disk_bytes() > 0 => DataPlacement::Streamed,
            _ => asked,
        }
    }

    /// `Dataset::held_bytes` of every split.
    pub fn held_bytes(&self, reads: DataReads) -> usize {
        self.splits().map(|d| d.held_bytes(reads)).sum()
    }
}

pub fn load(spec: &DataSpec, seed: u64) -> Result<Data> {
    let raw = match spec.source {
        DataSource::Text => return text::load(spec),
        DataSource::Tokens => return tokens::load(spec),
        DataSource::Digits => sources::digits()?,
        DataSource::Csv => sources::csv(spec, None)?,
        DataSource::Idx => sources::idx(spec)?,
        DataSource::Synthetic => sources::synthetic(spec, seed),
    };
    let row_len: usize = raw.sample_shape.iter().product();
    let Some(target_dim) = raw.train.targets.len().checked_div(raw.train.len) else {
        return Err(Error::Job(format!(
            "{}: no training samples",
            raw.train.origin.features
        )));
    };
    let (classes, classes_from) = match raw.task {
        Task::Regression => (None, None),
        Task::Classification => {
            // Only csv and idx data leave the number to the labels.
            let given = match spec.source {
                DataSource::Digits => Some(10),
                DataSource::Synthetic => Some(spec.synthetic_classes()),
                // Named classes: as many as names (at least 2, as for class indices).
                DataSource::Csv | DataSource::Idx | DataSource::Text | DataSource::Tokens => spec
                    .classes
                    .or(raw.class_names.as_ref().map(|n| n.len().max(2))),
            };
            let (classes, from) = check_labels(&raw, given)?;
            (Some(classes), from)
        }
    };

    let mut train = raw.train;
    let mut eval = Vec::new();
    if spec.val_fraction > 0.0 {
        let val_len = (train.len as f64 * spec.val_fraction).round() as usize;
        if val_len == 0 || val_len == train.len {
            return Err(Error::Job(format!(
                "data.val_fraction = {} of {} samples leaves {} for validation and {} for training; \
                 both need at least one",
                spec.val_fraction,
                train.len,
                val_len,
                train.len - val_len
            )));
        }
        let mut order: Vec<usize> = (0..train.len).collect();
        Rng::new(derive(seed, 11)).shuffle(&mut order);
        let (val_rows, train_rows) = order.split_at(val_len);
        let (mut val_rows, mut train_rows) = (val_rows.to_vec(), train_rows.to_vec());
        val_rows.sort_unstable();
        train_rows.sort_unstable();
        let val = train.select(&val_rows, row_len, target_dim);
        train = train.select(&train_rows, row_len, target_dim);
        eval.push(("val", val));
    }
    if let Some(test) = raw.test {
        eval.push(("test", test));
    }

    let (shift, scale) = Preprocess::statistics(spec.normalize, row_len, &train.features);
    let (feature_columns, label_column) = match raw.columns {
        Some(mut columns) => {
            let label = columns.pop();
            (Some(columns), label)
        }
        None => (None, None),
    };
    let preprocess = Preprocess {
        format: preprocess::FORMAT.into(),
        source: spec.source,
        sample_shape: raw.sample_shape.clone(),
        task: raw.task,
        classes,
        target_dim,
        feature_columns,
        label_column,
        class_names: raw.class_names,
        normalize: spec.normalize,
        shift,
        scale,
        vocabulary: None,
    };
    for set in std::iter::once(&mut train).chain(eval.iter_mut().map(|(_, d)| d)) {
        preprocess.apply(&mut set.features);
    }
    Ok(Data {
        sample_shape: raw.sample_shape,
        classes,
        classes_from,
        target_dim,
        train,
        eval,
        preprocess,
    })
}

/// Another file of the job's kind (`data.path` of a CSV job; the images and labels of an IDX
/// one), read as the job reads its data and normalised as training was (`preprocess`): for
/// evaluating a trained model on new data.
pub fn load_other(
    spec: &DataSpec,
    preprocess: &Preprocess,
    path: &Path,
    labels: Option<&Path>,
) -> Result<Dataset> {
    let mut spec = spec.clone();
    spec.test_path = None;
    spec.test_images = None;
    spec.test_labels = None;
    let raw = match (spec.source, labels) {
        (DataSource::Csv, None) => {
            spec.path = Some(path.to_path_buf());
            sources::csv(&spec, preprocess.class_names.as_deref())?
        }
        (DataSource::Idx, Some(labels)) => {
            spec.train_images = Some(path.to_path_buf());
            spec.train_labels = Some(labels.to_path_buf());
            sources::idx(&spec)?
        }
        (DataSource::Csv, Some(_)) => {
            return Err(Error::Job(
                "--labels is for IDX data; a CSV file holds its labels in a column".into(),
            ))
        }
        (DataSource::Idx, None) => {
            return Err(Error::Job(format!(
                "{}: IDX images need their labels: give --labels FILE",
                path.display()
            )))
        }
        (other, _) => {
            return Err(Error::Job(format!(
                "--data: the run's data.source is {}, which has no files to swap; evaluate \
                 its own splits with --split",
                serde_json::to_value(other).unwrap_or_default()
            )))
        }
    };
    if raw.sample_shape != preprocess.sample_shape {
        return Err(Error::Job(format!(
            "{}: its samples have shape {:?}, the model's input {:?}",
            path.display(),
            raw.sample_shape,
            preprocess.sample_shape
        )));
    }
    if let Some(classes) = preprocess.classes {
        check_labels(&raw, Some(classes))?;
    }
    let mut set = raw.train;
    preprocess.apply(&mut set.features);
    Ok(set)
}

/// Class labels must be whole numbers in 0..classes; returns the number of classes, and
/// where it came from when `classes` (data.classes) does not give it.
fn check_labels(raw: &Raw, classes: Option<usize>) -> Result<(usize, Option<String>)> {
    let mut largest = 0usize;
    let mut largest_at = None;
    let mut smallest = usize::MAX;
    for set in std::iter::once(&raw.train).chain(&raw.test) {
        for (row, &label) in set.targets.iter().enumerate() {
            let place = || set.origin.place(&set.origin.labels, row);
            if !(label >= 0.0 && label.fract() == 0.0 && f64::from(label) <= MAX_CLASS_INDEX) {
                return Err(Error::Job(format!(
                    "{}: label {label} is not a class index (a whole number from 0 to \
                     {MAX_CLASS_INDEX})",
                    place()
                )));
            }
            let label = label as usize;
            if let Some(c) = classes {
                if label >= c {
                    return Err(Error::Job(format!(
                        "{}: label {label} is out of range for data.classes = {c} (allowed: \
                         0..{})",
                        place(),
                        c - 1
                    )));
                }
            }
            smallest = smallest.min(label);
            if largest_at.is_none() || label > largest {
                largest = label;
                largest_at = Some((set, row));
            }
        }
    }
    if let Some(c) = classes {
        return Ok((c, None));
    }
    if smallest > 0 && smallest != usize::MAX {
        // Counted from 1 (as R and some data sets count), class 0 would be one the model
        // learns never to predict, and accuracy would still read right.
        tracing::warn!(
            "{}: no label is 0 (the smallest is {smallest}); classes count from 0, as in \
             PyTorch, so class 0 has no samples: if the labels count from 1, subtract 1 \
             from them",
            raw.train.origin.labels
        );
    }
    let at = largest_at.map_or(String::new(), |(set, row)| {
        format!(", at {}", set.origin.place(&set.origin.labels, row))
    });
    let from = match largest {
        0 => format!("data.classes is not set and every label is 0{at}; classes are at least 2"),
        _ => format!("data.classes is not set and the largest label is {largest}{at}"),
    };
    Ok(((largest + 1).max(2), Some(from)))
}

/// Batches per epoch for `n` samples: the last smaller batch counts unless dropped.
pub fn batches_per_epoch(n: usize, batch_size: usize, drop_last: bool) -> usize {
    if drop_last {
        n / batch_size
    } else {
        n.div_ceil(batch_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A split of a split still names each sample's place in its file.
    #[test]
    fn a_sample_is_named_by_its_place_in_the_file_after_any_split() {
        let set = |origin: Origin| Dataset {
            features: (0..6).map(|v| v as f32).collect(),
            targets: vec![0.0; 6],
            len: 6,
            origin,
            ..Dataset::default()
        };
        let idx = set(Origin {
            features: "images".into(),
            labels: "labels".into(),
            ..Origin::default()
        });
        let part = idx.select(&[1, 3, 5], 1, 1).select(&[2], 1, 1);
        assert_eq!(part.features, [5.0]);
        assert_eq!(
            part.origin.place(&part.origin.labels, 0),
            "labels: sample 5"
        );
        let csv = set(Origin::file("a.csv", Some(vec![2, 3, 5, 6, 7, 9])));
        let part = csv.select(&[4, 5], 1, 1);
        assert_eq!(part.origin.place(&part.origin.features, 1), "a.csv: line 9");
    }
}
