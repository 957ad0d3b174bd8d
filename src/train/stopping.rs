//! Why a run ends, and the controls that end it early: early stopping on an evaluation
//! metric (as Lightning's EarlyStopping: an improvement must beat the best by more than
//! min_delta) and a wall-time budget.

use crate::checkpoint::StoppingProgress;
use crate::run::MetricsRow;
use crate::spec::{parse_duration, JobSpec, StopMode};
use std::time::{Duration, Instant};

/// Tracks the monitored metric across evaluations.
pub struct EarlyStopping {
    split: String,
    column: String,
    patience: usize,
    min_delta: f64,
    progress: StoppingProgress,
}

impl EarlyStopping {
    /// The monitor of `spec`, continuing from `saved` (a checkpoint's) when that counted the
    /// same metric in the same direction.
    pub fn new(spec: &JobSpec, saved: Option<&StoppingProgress>) -> Option<Self> {
        let es = spec.train.early_stopping.as_ref()?;
        let (split, column) = es.split_column();
        let fresh = StoppingProgress {
            metric: es.metric.clone(),
            mode: es.effective_mode(),
            best: None,
            evals_without_improvement: 0,
        };
        let progress = match saved {
            Some(s) if s.metric == fresh.metric && s.mode == fresh.mode => s.clone(),
            Some(s) => {
                let mode = |m: StopMode| match m {
                    StopMode::Min => "min",
                    StopMode::Max => "max",
                };
                tracing::info!(
                    "early stopping: the checkpoint counted {} ({}), this job monitors {} ({}): \
                     counting starts again",
                    s.metric,
                    mode(s.mode),
                    fresh.metric,
                    mode(fresh.mode)
                );
                fresh
            }
            None => fresh,
        };
        Some(EarlyStopping {
            split: split.to_string(),
            column: column.to_string(),
            patience: es.patience,
            min_delta: es.min_delta,
            progress,
        })
    }

    /// What a checkpoint keeps.
    pub fn progress(&self) -> &StoppingProgress {
        &self.progress
    }

    /// Takes the rows of one evaluation; true when patience has run out.
    pub fn should_stop(&mut self, rows: &[MetricsRow]) -> bool {
        let Some(row) = rows.iter().find(|r| r.split == self.split) else {
            return false;
        };
        let value = match self.column.as_str() {
            "accuracy" => row.accuracy.unwrap_or(f64::NAN),
            _ => row.loss,
        };
        let p = &mut self.progress;
        let improved = !value.is_nan()
            && match (p.best, p.mode) {
                (None, _) => true,
                (Some(best), StopMode::Min) => value < best - self.min_delta,
                (Some(best), StopMode::Max) => value > best + self.min_delta,
            };
        if improved {
            p.best = Some(value);
            p.evals_without_improvement = 0;
        } else {
            p.evals_without_improvement += 1;
        }
        let stop = p.evals_without_improvement >= self.patience;
        if stop {
            tracing::info!(
                "early stopping: {}_{} has not improved on {:.6} for {} evaluations",
                self.split,
                self.column,
                p.best.unwrap_or(f64::NAN),
                self.patience
            );
        }
        stop
    }
}

/// `train.max_time` as a deadline from the start of training.
pub fn deadline(spec: &JobSpec, start: Instant) -> Option<Instant> {
    let text = spec.train.max_time.as_deref()?;
    // Validated at load time; an unparsable value here would be a bug, so it only disables.
    let budget: Duration = parse_duration(text).ok()?;
    Some(start + budget)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(early_stopping: &str) -> JobSpec {
        toml::from_str(&format!(
            "[data]\nsource = \"synthetic\"\nval_fraction = 0.2\n\
             [model]\nlayers = [{{ type = \"linear\", out = 3 }}]\n\
             [optimizer]\ntype = \"sgd\"\nlr = 0.1\n\
             [train]\nearly_stopping = {early_stopping}\n"
        ))
        .unwrap()
    }

    fn val(loss: f64) -> Vec<MetricsRow> {
        vec![MetricsRow {
            step: 1,
            epoch: 1,
            split: "val",
            loss,
            ..Default::default()
        }]
    }

    #[test]
    fn a_nan_is_never_the_best_and_counts_as_no_improvement() {
        let job = spec("{ metric = \"val_loss\", patience = 2 }");
        let mut es = EarlyStopping::new(&job, None).unwrap();
        assert!(!es.should_stop(&val(f64::NAN)));
        assert_eq!(es.progress().best, None);
        assert!(!es.should_stop(&val(0.5)));
        assert_eq!(es.progress().best, Some(0.5));
        assert!(!es.should_stop(&val(f64::NAN)));
        assert!(es.should_stop(&val(0.6)));
    }

    #[test]
    fn saved_progress_continues_only_for_the_same_metric_and_mode() {
        let saved = StoppingProgress {
            metric: "val_loss".into(),
            mode: StopMode::Min,
            best: Some(0.5),
            evals_without_improvement: 1,
        };
        let same = spec("{ metric = \"val_loss\", patience = 2 }");
        let mut es = EarlyStopping::new(&same, Some(&saved)).unwrap();
        assert!(es.should_stop(&val(0.7)), "the second evaluation in a row");

        let other_mode = spec("{ metric = \"val_loss\", mode = \"max\", patience = 2 }");
        let es = EarlyStopping::new(&other_mode, Some(&saved)).unwrap();
        assert_eq!(es.progress().best, None);
        assert_eq!(es.progress().evals_without_improvement, 0);
    }
}
