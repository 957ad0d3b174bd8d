//! What turns raw input into the model's input: the normalisation statistics of the training
//! split, and what the input and targets are. A run saves it as preprocess.json (and in
//! model.safetensors' metadata), so that `trainer eval` and `predict` apply to new data what
//! training applied, without the training data.

use super::vocabulary::Vocabulary;
use crate::error::{Error, Result};
use crate::spec::{DataSource, Normalize, Task};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The file a run directory holds it in.
pub const FILE: &str = "preprocess.json";
/// Its `format` field.
pub const FORMAT: &str = "trainer-preprocess-1";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Preprocess {
    pub format: String,
    pub source: DataSource,
    /// One sample's shape, e.g. [784] for a CSV row or [1, 28, 28] for an image.
    pub sample_shape: Vec<usize>,
    pub task: Task,
    /// The number of classes (classification).
    pub classes: Option<usize>,
    /// Values per sample in the targets: 1 (a class index) or the output width.
    pub target_dim: usize,
    /// CSV: the feature columns read, in order (header names, or indices without a header).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub feature_columns: Option<Vec<String>>,
    /// CSV: the label column.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label_column: Option<String>,
    /// CSV classification with text labels: the class names, by class index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class_names: Option<Vec<String>>,
    pub normalize: Normalize,
    /// Per feature, the model's input is (x - shift) * scale; both empty for "none".
    pub shift: Vec<f32>,
    pub scale: Vec<f32>,
    /// text: how text becomes token ids and back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vocabulary: Option<Vocabulary>,
}

impl Preprocess {
    /// The statistics of `mode` over the training features (`row_len` values a sample).
    /// Statistics count finite values only (as scikit-learn's scalers treat NaN): a bad
    /// value spoils only its own samples' steps, not every value of its column.
    pub fn statistics(mode: Normalize, row_len: usize, features: &[f32]) -> (Vec<f32>, Vec<f32>) {
        match mode {
            Normalize::None => (Vec::new(), Vec::new()),
            Normalize::Scale => {
                let finite = features.iter().filter(|v| v.is_finite());
                let max = finite.fold(0.0f32, |m, v| m.max(v.abs()));
                let s = if max > 0.0 { 1.0 / max } else { 1.0 };
                (vec![0.0; row_len], vec![s; row_len])
            }
            Normalize::Standardize => {
                let mut n = vec![0.0f64; row_len];
                let mut mean = vec![0.0f64; row_len];
                let mut sq = vec![0.0f64; row_len];
                for row in features.chunks_exact(row_len) {
                    for j in (0..row_len).filter(|&j| row[j].is_finite()) {
                        n[j] += 1.0;
                        mean[j] += row[j] as f64;
                        sq[j] += (row[j] as f64).powi(2);
                    }
                }
                let mut shift = Vec::with_capacity(row_len);
                let mut scale = Vec::with_capacity(row_len);
                for j in 0..row_len {
                    let n = n[j].max(1.0);
                    let m = mean[j] / n;
                    let var = (sq[j] / n - m * m).max(0.0);
                    let std = var.sqrt();
                    shift.push(m as f32);
                    // A constant feature (a border pixel) carries no information: centre it.
                    scale.push(if std > 1e-8 { (1.0 / std) as f32 } else { 1.0 });
                }
                (shift, scale)
            }
        }
    }

    /// No normalisation, for samples made in memory (`source` "synthetic"). A language
    /// model's windows take it with their own source and vocabulary.
    pub fn identity(sample_shape: Vec<usize>, classes: Option<usize>, target_dim: usize) -> Self {
        Preprocess {
            format: FORMAT.into(),
            source: DataSource::Synthetic,
            sample_shape,
            task: match classes {
                Some(_) => Task::Classification,
                None => Task::Regression,
            },
            classes,
            target_dim,
            feature_columns: None,
            label_column: None,
            class_names: None,
            normalize: Normalize::None,
            shift: Vec::new(),
            scale: Vec::new(),
            vocabulary: None,
        }
    }

    /// Normalises `features` (rows of `shift.len()` values) in place.
    pub fn apply(&self, features: &mut [f32]) {
        let row_len = self.shift.len();
        if row_len == 0 {
            return;
        }
        for row in features.chunks_exact_mut(row_len) {
            for ((v, &shift), &scale) in row.iter_mut().zip(&self.shift).zip(&self.scale) {
                let x = *v;
                *v = (x - shift) * scale;
                // A difference beyond f32's range (values near ±3.4e38 on both sides of the
                // mean) is taken in f64: the standardised value itself is small.
                if !v.is_finite() && x.is_finite() {
                    *v = ((f64::from(x) - f64::from(shift)) * f64::from(scale)) as f32;
                }
            }
        }
    }

    /// Class `k`'s name: its text label, else its index.
    pub fn class_name(&self, k: usize) -> String {
        self.class_names
            .as_ref()
            .and_then(|names| names.get(k).cloned())
            .unwrap_or_else(|| k.to_string())
    }

    /// One sample's values.
    pub fn row_len(&self) -> usize {
        self.sample_shape.iter().product()
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("it serialises") + "\n"
    }

    /// Reads a run's preprocess.json.
    pub fn read(run: &Path) -> Result<Preprocess> {
        let path = run.join(FILE);
        let text = std::fs::read_to_string(&path).map_err(|e| {
            Error::Job(format!(
                "cannot read {}: {e} (runs of trainer before 0.1 did not write it; train the \
                 job again to evaluate it)",
                path.display()
            ))
        })?;
        let p: Preprocess = serde_json::from_str(&text)
            .map_err(|e| Error::Job(format!("{}: not a preprocess file: {e}", path.display())))?;
        if p.format != FORMAT {
            return Err(Error::Job(format!(
                "{}: format {:?}, where this version reads {FORMAT:?}",
                path.display(),
                p.format
            )));
        }
        let n = p.row_len();
        if !(p.shift.len() == p.scale.len() && (p.shift.is_empty() || p.shift.len() == n)) {
            return Err(Error::Job(format!(
                "{}: shift and scale need {n} values each (or none)",
                path.display()
            )));
        }
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values near f32's limits standardise as smaller ones do, not to ±inf (their
    /// difference from the mean is beyond f32).
    #[test]
    fn standardising_values_near_the_f32_limit_stays_finite() {
        let mut features = vec![3e38, 3e38, 3e38, -3e38];
        let (shift, scale) = Preprocess::statistics(Normalize::Standardize, 1, &features);
        let p = Preprocess {
            format: FORMAT.into(),
            source: DataSource::Csv,
            sample_shape: vec![1],
            task: Task::Regression,
            classes: None,
            target_dim: 1,
            feature_columns: None,
            label_column: None,
            class_names: None,
            normalize: Normalize::Standardize,
            shift,
            scale,
            vocabulary: None,
        };
        p.apply(&mut features);
        // Mean 1.5e38, standard deviation 1.5e38·√3: -3e38 lies 4.5e38 below the mean.
        let (above, below) = (1.0 / 3f32.sqrt(), -3f32.sqrt());
        for (v, want) in features.iter().zip([above, above, above, below]) {
            assert!((v - want).abs() < 1e-6, "{features:?}");
        }
        let back: Preprocess = serde_json::from_str(&p.to_json()).unwrap();
        assert_eq!(back, p, "the statistics read back exactly");
    }
}
