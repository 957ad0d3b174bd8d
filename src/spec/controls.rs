//! Training controls that end a run early: `train.early_stopping`, `train.max_time`, and
//! what a non-finite loss does (`train.on_nonfinite`). The types, and the checks that tie
//! them to what the job will actually produce, so that a metric the run never writes is
//! refused before anything trains.

use super::{DataSource, JobSpec, LossKind};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Stop when an evaluation metric has not improved for `patience` evaluations in a row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EarlyStoppingSpec {
    /// `<split>_<column>` of an evaluation split: val_loss, val_accuracy, test_loss,
    /// test_accuracy (only those the job produces).
    pub metric: String,
    /// Whether lower ("min") or higher ("max") is better. Default: min for a loss, max for an
    /// accuracy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<StopMode>,
    /// Evaluations without improvement before the run stops.
    #[serde(default = "default_patience")]
    #[schemars(range(min = 1))]
    pub patience: usize,
    /// The smallest change that counts as an improvement.
    #[serde(default)]
    pub min_delta: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum StopMode {
    /// Lower is better.
    Min,
    /// Higher is better.
    Max,
}

/// What a step with an inf or NaN loss or gradient does (`train.on_nonfinite`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OnNonFinite {
    /// Stop the run as diverged (exit 1, `end_reason = "diverged"`); the checkpoints written
    /// before stay, the newest is the last good state.
    #[default]
    Error,
    /// Do not apply the step: parameters and optimizer state stay as they were, the step is
    /// counted in `skipped_steps`, and its loss is left out of the train row. The run fails
    /// as diverged after `MAX_SKIPPED_IN_A_ROW` (100) skipped steps in a row.
    Skip,
}

/// When the test split is evaluated (`train.evaluate_test`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum EvaluateTest {
    /// At every evaluation, beside the validation split.
    #[default]
    EveryEvaluation,
    /// Only once, after training: nothing is chosen by the test set (early stopping and
    /// keep_best cannot use it).
    AtEnd,
}

impl EvaluateTest {
    /// Left out of config.toml at its default, as `OnNonFinite`.
    pub fn is_default(&self) -> bool {
        *self == EvaluateTest::default()
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            EvaluateTest::EveryEvaluation => "every_evaluation",
            EvaluateTest::AtEnd => "at_end",
        }
    }
}

/// This many skipped steps in a row (on_nonfinite = "skip", or loss scaling's overflow
/// checks) end the run as diverged: by then the parameters are beyond repair, or a fixed loss
/// scale overflows every step, and going on would only waste the budget.
pub const MAX_SKIPPED_IN_A_ROW: u64 = 100;

impl OnNonFinite {
    /// Left out of config.toml (and of the spec hash and checkpoints' job) at its default,
    /// so jobs and checkpoints from before the key existed resolve to the same spec.
    pub fn is_default(&self) -> bool {
        *self == OnNonFinite::default()
    }
}

fn default_patience() -> usize {
    5
}

impl EarlyStoppingSpec {
    /// The split and column of `metric`, e.g. ("val", "loss"). Valid after validation.
    pub fn split_column(&self) -> (&str, &str) {
        self.metric.split_once('_').unwrap_or((&self.metric, ""))
    }

    pub fn effective_mode(&self) -> StopMode {
        self.mode.unwrap_or(match self.split_column().1 {
            "accuracy" => StopMode::Max,
            _ => StopMode::Min,
        })
    }
}

/// Whether the job's rows have an accuracy: the classification losses'.
pub fn has_accuracy(spec: &JobSpec) -> bool {
    matches!(
        spec.loss.kind,
        LossKind::CrossEntropy | LossKind::BceWithLogits
    )
}

/// The `<split>_<column>` metrics evaluation rows of this job will carry.
pub fn eval_metrics(spec: &JobSpec) -> Vec<String> {
    let d = &spec.data;
    let mut splits = Vec::new();
    if d.val_fraction > 0.0 || d.val_path.is_some() {
        splits.push("val");
    }
    let has_test = match d.source {
        DataSource::Csv => d.test_path.is_some(),
        DataSource::Idx => d.test_images.is_some(),
        DataSource::Digits | DataSource::Synthetic | DataSource::Text | DataSource::Tokens => false,
    };
    if has_test {
        splits.push("test");
    }
    let mut columns = vec!["loss"];
    if has_accuracy(spec) {
        columns.push("accuracy");
    }
    splits
        .iter()
        .flat_map(|s| columns.iter().map(move |c| format!("{s}_{c}")))
        .collect()
}

/// Parses a duration such as "90s", "30m", "2h", "1.5h" or "1h30m".
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let allowed =
        "allowed: a number with a unit s, m or h, e.g. \"90s\", \"30m\", \"2h\", \"1h30m\"";
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(format!("\"{text}\" given; {allowed}"));
    }
    let mut seconds = 0.0;
    // Units in falling order, each once ("1h30m"); "1m1h" or "5m5m" is a typo.
    let mut previous_scale = f64::INFINITY;
    while !rest.is_empty() {
        let split = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, after) = rest.split_at(split);
        let unit_len = after
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(after.len());
        let (unit, after) = after.split_at(unit_len);
        let scale = match unit.trim() {
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return Err(format!("\"{text}\" given; {allowed}")),
        };
        if scale >= previous_scale {
            return Err(format!(
                "\"{text}\" given; the units must come in the order h, m, s, each once"
            ));
        }
        previous_scale = scale;
        let value: f64 = number
            .parse()
            .map_err(|_| format!("\"{text}\" given; {allowed}"))?;
        seconds += value * scale;
        rest = after.trim_start();
    }
    if !(seconds.is_finite() && seconds > 0.0) {
        return Err(format!("\"{text}\" given; must be longer than zero"));
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// Problems with the training controls, as (key, message).
pub(super) fn problems(spec: &JobSpec) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let t = &spec.train;
    if let Some(text) = &t.max_time {
        if let Err(why) = parse_duration(text) {
            out.push(("train.max_time".into(), why));
        }
    }
    if t.eval_every_steps.is_some() && eval_metrics(spec).is_empty() {
        out.push((
            "train.eval_every_steps".to_string(),
            "this job has no evaluation split: set data.val_fraction (or a test set) first"
                .to_string(),
        ));
    }
    if let Some(es) = &t.early_stopping {
        let key = "train.early_stopping.metric".to_string();
        let produced = eval_metrics(spec);
        if !produced.contains(&es.metric) {
            let allowed = if produced.is_empty() {
                "this job has no evaluation split: set data.val_fraction (or a test set) first"
                    .to_string()
            } else {
                format!("allowed for this job: {}", produced.join(", "))
            };
            out.push((
                key.clone(),
                format!(
                    "\"{}\" given, which this job never produces; {allowed}",
                    es.metric
                ),
            ));
        }
        if es.metric.starts_with("test_") && t.evaluate_test == EvaluateTest::AtEnd {
            out.push((
                key.clone(),
                format!(
                    "\"{}\" given, but train.evaluate_test = \"at_end\" evaluates the test \
                     split only after training; stop on a val_ metric",
                    es.metric
                ),
            ));
        }
        if t.eval_every_epochs == 0 && t.eval_every_steps.is_none() {
            out.push((
                key,
                "needs evaluations, but train.eval_every_epochs = 0 and train.eval_every_steps \
                 is not set"
                    .into(),
            ));
        }
        if es.patience == 0 {
            out.push((
                "train.early_stopping.patience".into(),
                "0 given; must be at least 1".into(),
            ));
        }
        if !(es.min_delta.is_finite() && es.min_delta >= 0.0) {
            out.push((
                "train.early_stopping.min_delta".into(),
                format!("{} given; must be at least 0", es.min_delta),
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::parse_duration;
    use std::time::Duration;

    #[test]
    fn durations_read_like_people_write_them() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("30m"), Ok(Duration::from_secs(1800)));
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("1.5h"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("1h 5m 30s"), Ok(Duration::from_secs(3930)));
        for bad in ["", "2", "2 hours", "h", "0s", "1d", "1m1h", "5m5m", "30s1m"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
    }
}
