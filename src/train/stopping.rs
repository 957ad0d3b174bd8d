//! Why a run ends, and the controls that end it early: early stopping on an evaluation
//! metric (as Lightning's EarlyStopping: an improvement must beat the best by more than
//! min_delta) and a wall-time budget.

use crate::run::MetricsRow;
use crate::spec::{parse_duration, JobSpec, StopMode};
use std::time::{Duration, Instant};

/// The reason a run ended, written to summary.json as `end_reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EndReason {
    /// Every epoch ran.
    #[default]
    Completed,
    EarlyStopped,
    MaxTime,
    MaxSteps,
    /// The loss became NaN or infinite.
    Diverged,
    /// Any other error.
    Failed,
}

impl EndReason {
    pub fn as_str(self) -> &'static str {
        match self {
            EndReason::Completed => "completed",
            EndReason::EarlyStopped => "early_stopped",
            EndReason::MaxTime => "max_time",
            EndReason::MaxSteps => "max_steps",
            EndReason::Diverged => "diverged",
            EndReason::Failed => "failed",
        }
    }
}

/// Tracks the monitored metric across evaluations.
pub struct EarlyStopping {
    split: String,
    column: String,
    mode: StopMode,
    patience: usize,
    min_delta: f64,
    best: Option<f64>,
    evals_without_improvement: usize,
}

impl EarlyStopping {
    pub fn new(spec: &JobSpec) -> Option<Self> {
        let es = spec.train.early_stopping.as_ref()?;
        let (split, column) = es.split_column();
        Some(EarlyStopping {
            split: split.to_string(),
            column: column.to_string(),
            mode: es.effective_mode(),
            patience: es.patience,
            min_delta: es.min_delta,
            best: None,
            evals_without_improvement: 0,
        })
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
        let improved = match (self.best, self.mode) {
            (None, _) => true,
            (Some(best), StopMode::Min) => value < best - self.min_delta,
            (Some(best), StopMode::Max) => value > best + self.min_delta,
        };
        if improved {
            self.best = Some(value);
            self.evals_without_improvement = 0;
        } else {
            self.evals_without_improvement += 1;
        }
        let stop = self.evals_without_improvement >= self.patience;
        if stop {
            tracing::info!(
                "early stopping: {}_{} has not improved on {:.6} for {} evaluations",
                self.split,
                self.column,
                self.best.unwrap_or(f64::NAN),
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
