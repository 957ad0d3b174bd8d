//! summary.json: how a run ended, written once at its end (atomically) and read back by
//! `ls`, `compare`, sweeps and resumes.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// The reason a run ended, written to summary.json as `end_reason` (and to the final
/// checkpoint's state).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
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
    /// Stopped by SIGINT or SIGTERM, after writing a checkpoint.
    Interrupted,
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
            EndReason::Interrupted => "interrupted",
        }
    }
}

/// summary.json. The fields every run has, then those of how it ended (`status`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    #[serde(flatten)]
    pub ended: Ended,
    pub end_reason: EndReason,
    pub run_id: String,
    pub job: String,
    /// Seconds this attempt ran, from its start to the summary.
    pub wall_s: f64,
}

/// How a run ended, as summary.json's `status` and the fields that go with it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Ended {
    Completed(Completed),
    /// Stopped by a signal after writing a checkpoint: it can be resumed.
    Interrupted(Interrupted),
    /// An error ended it; `error` says which.
    Failed {
        error: String,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Completed {
    pub device: String,
    pub steps: u64,
    #[serde(default)]
    pub skipped_steps: u64,
    pub epochs: usize,
    pub train_s: f64,
    pub samples_per_sec: f64,
    /// From the process's start to the first step.
    pub startup_s: Option<f64>,
    /// CUDA graph recordings of the step and of the optimizer's update (none on the CPU).
    pub cuda_graph_recordings: Option<u64>,
    pub cuda_graph_update_recordings: Option<u64>,
    pub memory_planned_bytes: usize,
    pub device_memory_peak_bytes: Option<usize>,
    pub resumed_from: Option<String>,
    /// The last value of each `<split>_<column>`. JSON has no NaN: a value that is not
    /// finite is written as null.
    #[serde(rename = "final")]
    pub finals: BTreeMap<String, Option<f64>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Interrupted {
    /// The signal's number (2: SIGINT, 15: SIGTERM).
    pub signal: Option<i32>,
    pub steps: u64,
    /// The checkpoint it wrote on its way out, to resume from.
    pub checkpoint: Option<String>,
    pub resumed_from: Option<String>,
}

impl Summary {
    /// The run's summary.json, if it has a readable one. It is written atomically: one that
    /// does not read is not the trainer's.
    pub fn read(run: &Path) -> Option<Summary> {
        let text = std::fs::read_to_string(run.join(FILE)).ok()?;
        serde_json::from_str(&text).ok()
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a summary is always JSON") + "\n"
    }

    pub fn completed(&self) -> Option<&Completed> {
        match &self.ended {
            Ended::Completed(c) => Some(c),
            _ => None,
        }
    }

    pub fn status(&self) -> &'static str {
        match self.ended {
            Ended::Completed(_) => "completed",
            Ended::Interrupted(_) => "interrupted",
            Ended::Failed { .. } => "failed",
        }
    }

    /// The optimizer steps it recorded (none for a failed run).
    pub fn steps(&self) -> Option<u64> {
        match &self.ended {
            Ended::Completed(c) => Some(c.steps),
            Ended::Interrupted(i) => Some(i.steps),
            Ended::Failed { .. } => None,
        }
    }
}

/// The file's name in the run directory.
pub const FILE: &str = "summary.json";

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A completed run's summary, or with `failed` a failed one's.
    pub(crate) fn example(failed: bool) -> Summary {
        let completed = Summary {
            ended: Ended::Completed(Completed {
                device: "cpu".into(),
                steps: 10,
                skipped_steps: 0,
                epochs: 1,
                train_s: 0.5,
                samples_per_sec: 100.0,
                startup_s: Some(0.1),
                cuda_graph_recordings: None,
                cuda_graph_update_recordings: None,
                memory_planned_bytes: 1 << 20,
                device_memory_peak_bytes: None,
                resumed_from: None,
                finals: [
                    ("val_loss".to_string(), Some(0.25)),
                    ("train_loss".into(), None),
                ]
                .into(),
            }),
            end_reason: EndReason::EarlyStopped,
            run_id: "20261128-000000-abcd".into(),
            job: "tiny".into(),
            wall_s: 1.5,
        };
        let failed_one = Summary {
            ended: Ended::Failed {
                error: "no space left".into(),
            },
            end_reason: EndReason::Failed,
            ..completed.clone()
        };
        if failed {
            failed_one
        } else {
            completed
        }
    }

    #[test]
    fn a_summary_reads_back_as_written() {
        for summary in [example(false), example(true)] {
            let text = summary.to_json();
            let json: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(json["status"], summary.status());
            assert_eq!(json["end_reason"], summary.end_reason.as_str());
            assert_eq!(serde_json::from_str::<Summary>(&text).unwrap(), summary);
        }
    }
}
