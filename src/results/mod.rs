//! Reading finished (and unfinished) runs back: `trainer ls`, `trainer compare`, `trainer plot`
//! and sweep.csv all see a run through `RunRecord`: its resolved config, its status, its
//! metrics rows, and the final and best value of each metric.

pub mod plot;
mod select;
pub mod table;

pub use select::{list, ListOptions};

use crate::error::Result;
use crate::job_err;
use crate::run::summary::{Ended, Summary};
use crate::spec::JobSpec;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use table::{Cell, Table};

/// How a run stands, from summary.json, or from provenance.json when there is no summary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Completed,
    Failed,
    /// Stopped by SIGINT or SIGTERM (after a checkpoint, when the job writes them): a sweep
    /// resumes it.
    Interrupted,
    /// No summary yet, and the process that started it is alive on this host.
    Running,
    /// No summary, and its process is gone (killed, or the machine stopped).
    Killed,
    /// No summary and no provenance to tell which.
    Unfinished,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Completed => "completed",
            Status::Failed => "failed",
            Status::Interrupted => "interrupted",
            Status::Running => "running",
            Status::Killed => "killed",
            Status::Unfinished => "unfinished",
        }
    }
}

/// One row of metrics.csv: its position and every numeric column it has.
#[derive(Debug, Clone)]
pub struct MetricsPoint {
    pub step: u64,
    pub epoch: usize,
    pub split: String,
    pub values: BTreeMap<String, f64>,
}

#[derive(Debug, Clone)]
pub struct RunRecord {
    pub dir: PathBuf,
    /// config.toml's body: the resolved spec.
    pub config: toml::Table,
    pub summary: Option<Summary>,
    pub status: Status,
    pub points: Vec<MetricsPoint>,
}

/// Columns of metrics.csv that are metrics of the model, with best = min or max.
const SCORED: [(&str, bool); 2] = [("loss", false), ("accuracy", true)];

impl RunRecord {
    pub fn load(dir: &Path) -> Result<RunRecord> {
        let config_path = dir.join("config.toml");
        let text = std::fs::read_to_string(&config_path).map_err(|e| {
            if config_path.exists() {
                job_err!("{}: {e}", config_path.display())
            } else {
                job_err!("{} is not a run directory: {e}", dir.display())
            }
        })?;
        let config: toml::Table = toml::from_str(&text).map_err(|e| {
            let file = config_path.display().to_string();
            job_err!("{}", crate::spec::toml_error(&file, &text, &e, None))
        })?;
        // config.toml is written whole (atomically) with every section: one without the job's
        // required keys was cut short or emptied afterwards, and its blanks would read as
        // differences from every other run.
        let has = |section: &str, key: &str| {
            config
                .get(section)
                .and_then(|t| t.as_table())
                .is_some_and(|t| t.contains_key(key))
        };
        if let Some(key) = [("data", "source"), ("model", "layers"), ("optimizer", "lr")]
            .iter()
            .find(|(section, key)| !has(section, key))
            .map(|(section, key)| format!("{section}.{key}"))
        {
            return Err(job_err!(
                "{}: incomplete, without `{key}` (every run's config.toml has it): the file \
                 was cut short or emptied",
                config_path.display()
            ));
        }
        let summary_path = dir.join("summary.json");
        let had_summary = summary_path.exists();
        let mut summary = read_summary(&summary_path);
        let mut alive = Status::Unfinished;
        if summary.is_none() {
            alive = liveness(dir);
            if alive != Status::Running && !had_summary && summary_path.exists() {
                // The run ended between the two looks: it writes its summary before it lets
                // go of its lock.
                summary = read_summary(&summary_path);
            }
        }
        let status = match summary.as_ref().map(|s| &s.ended) {
            Some(Ended::Completed(_)) => Status::Completed,
            Some(Ended::Interrupted(_)) => Status::Interrupted,
            Some(Ended::Failed { .. }) => Status::Failed,
            None => alive,
        };
        Ok(RunRecord {
            dir: dir.to_path_buf(),
            config,
            summary,
            status,
            points: read_metrics(&dir.join("metrics.csv")),
        })
    }

    pub fn end_reason(&self) -> Option<&str> {
        Some(self.summary.as_ref()?.end_reason.as_str())
    }

    /// Every `<split>_<column>` series in the run, in the order first seen.
    pub fn metric_names(&self) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for p in &self.points {
            for column in p.values.keys() {
                let name = format!("{}_{column}", p.split);
                if !names.contains(&name) {
                    names.push(name);
                }
            }
        }
        names
    }

    /// summary.json's `final`: a completed run's last value of each `<split>_<column>`,
    /// written once when it ended. JSON has no NaN: serde_json writes one as null.
    fn summary_finals(&self) -> Option<BTreeMap<String, f64>> {
        let finals = &self.summary.as_ref()?.completed()?.finals;
        Some(
            finals
                .iter()
                .map(|(name, v)| (name.clone(), v.unwrap_or(f64::NAN)))
                .collect(),
        )
    }

    /// The scored metrics (loss, accuracy): the last value of each split's series, and for
    /// evaluation splits the best, as (`val_loss`, x) and (`best_val_loss`, y).
    ///
    /// A completed run's final values are summary.json's (metrics.csv can have lost rows
    /// since: cut short, deleted; `metrics_warning` says so). The best is over the finite
    /// values (the rows' and the final one): NaN when there are none, as for a run whose
    /// every evaluation was NaN, rather than the starting value of the search (inf).
    pub fn final_and_best(&self) -> Vec<(String, f64)> {
        let finals = self.summary_finals().unwrap_or_default();
        let mut out = Vec::new();
        let mut splits: BTreeSet<&str> = self.points.iter().map(|p| p.split.as_str()).collect();
        for name in finals.keys() {
            if let Some((split, _)) = SCORED
                .iter()
                .find_map(|(c, _)| name.strip_suffix(&format!("_{c}")).map(|split| (split, c)))
            {
                splits.insert(split);
            }
        }
        for split in order_splits(splits) {
            for (column, higher_is_better) in SCORED {
                let name = format!("{split}_{column}");
                let series: Vec<f64> = self
                    .points
                    .iter()
                    .filter(|p| p.split == split)
                    .filter_map(|p| p.values.get(column).copied())
                    .collect();
                let last_row = series.last().copied();
                let last = match finals.get(&name) {
                    // null: a NaN or an infinity, which JSON cannot hold; the row says which.
                    Some(f) if f.is_nan() => last_row.filter(|r| !r.is_finite()).unwrap_or(*f),
                    Some(&f) => f,
                    None => match last_row {
                        Some(r) => r,
                        None => continue,
                    },
                };
                out.push((name.clone(), last));
                if split != "train" {
                    let best = series
                        .iter()
                        .chain([&last])
                        .copied()
                        .filter(|v| v.is_finite())
                        .reduce(|a, b| if higher_is_better { a.max(b) } else { a.min(b) })
                        .unwrap_or(f64::NAN);
                    out.push((format!("best_{name}"), best));
                }
            }
        }
        out
    }

    /// Why this run's metrics.csv cannot be trusted for its best values, when it is a
    /// completed run whose summary.json says how it ended: the file is missing, or its last
    /// rows are not the final values (rows lost, a line cut short). The final columns then
    /// come from summary.json alone.
    pub fn metrics_warning(&self) -> Option<String> {
        let finals = self.summary_finals()?;
        let metrics = self.dir.join("metrics.csv");
        if self.points.is_empty() && !finals.is_empty() {
            return Some(format!(
                "{}: no metrics rows in a completed run (missing or damaged); its final \
                 metrics are summary.json's, and its best_* only those final values",
                metrics.display()
            ));
        }
        // (A final null, read as NaN, stands for any non-finite value.)
        let same = |row: f64, last: f64| row == last || (last.is_nan() && !row.is_finite());
        let differing: Vec<&str> = finals
            .iter()
            .filter(|(name, &value)| {
                let (split, column) = name.rsplit_once('_').unwrap_or((name, ""));
                let last = self
                    .points
                    .iter()
                    .rev()
                    .find(|p| p.split == split && p.values.contains_key(column))
                    .map(|p| p.values[column]);
                !last.is_some_and(|last| same(last, value))
            })
            .map(|(name, _)| name.as_str())
            .collect();
        (!differing.is_empty()).then(|| {
            format!(
                "{}: its last rows do not hold the run's final {} (rows lost or cut short?); \
                 the final metrics are summary.json's, and the best_* are over the rows it has",
                metrics.display(),
                differing.join(", ")
            )
        })
    }
}

/// The columns `final_and_best` will give a run of `spec`, in its order, known before the run
/// has a row: sweep.csv has them from its first writing, so its header does not grow as
/// points finish. The splits and columns are those `spec::controls::eval_metrics` checks
/// early stopping against (train's, then val when part of the data is held out, test when
/// the data has a test set; accuracy for the classification losses).
pub fn metric_columns(spec: &JobSpec) -> Vec<String> {
    let evaluated = crate::spec::eval_metrics(spec);
    let train = SCORED
        .iter()
        .filter(|(column, _)| *column != "accuracy" || crate::spec::has_accuracy(spec))
        .map(|(column, _)| format!("train_{column}"));
    let eval = evaluated
        .iter()
        .flat_map(|metric| [metric.clone(), format!("best_{metric}")]);
    train.chain(eval).collect()
}

/// train first, then val, then test, then anything else.
fn order_splits(splits: BTreeSet<&str>) -> Vec<&str> {
    let rank = |s: &str| {
        ["train", "val", "test"]
            .iter()
            .position(|&k| k == s)
            .unwrap_or(3)
    };
    let mut v: Vec<&str> = splits.into_iter().collect();
    v.sort_by_key(|s| (rank(s), s.to_string()));
    v
}

/// A run's summary.json, if it has a readable one. It is written atomically: one that does
/// not parse, or has no known status, was damaged afterwards, and is warned about.
fn read_summary(path: &Path) -> Option<Summary> {
    let text = std::fs::read_to_string(path).ok()?;
    let why = match serde_json::from_str::<serde_json::Value>(&text) {
        Err(e) => format!("not JSON: {e}"),
        Ok(v) if !v["status"].is_string() => "no \"status\" string in it".to_string(),
        Ok(v)
            if !matches!(
                v["status"].as_str(),
                Some("completed" | "interrupted" | "failed")
            ) =>
        {
            format!(
                "\"status\": {} is none of \"completed\", \"interrupted\", \"failed\"",
                v["status"]
            )
        }
        Ok(v) => match serde_json::from_value::<Summary>(v) {
            Ok(summary) => return Some(summary),
            Err(e) => format!("not a summary this version reads: {e}"),
        },
    };
    tracing::warn!(
        "{}: {why}; the run is shown as if it had no summary",
        path.display()
    );
    None
}

/// Whether a process still trains the run: one holds its lock (on this host); a run whose
/// lock is free was killed. Runs without a lock file (older versions) are judged by whether
/// the process named in provenance.json is alive, which a reused pid can fool.
fn liveness(dir: &Path) -> Status {
    use crate::run::LockState;
    // The lock first: a run that has just started holds it before its provenance.json is
    // written.
    let lock = crate::run::lock_state(dir);
    if let Some(LockState::HeldBy(_)) = lock {
        return Status::Running;
    }
    let Some(prov) = std::fs::read_to_string(dir.join("provenance.json"))
        .ok()
        .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
    else {
        return Status::Unfinished;
    };
    let same_host = prov["host"].as_str() == Some(crate::provenance::hostname().as_str());
    // Another host's lock is not in this one's table.
    if let (Some(LockState::Free), true) = (lock, same_host) {
        return Status::Killed;
    }
    match prov["pid"].as_u64() {
        Some(pid) if same_host => {
            if Path::new(&format!("/proc/{pid}")).exists() {
                Status::Running
            } else {
                Status::Killed
            }
        }
        _ => Status::Unfinished,
    }
}

/// metrics.csv as points; a missing or partly written file gives what could be read (a
/// killed run's last line may be cut).
pub(crate) fn read_metrics(path: &Path) -> Vec<MetricsPoint> {
    let Ok(mut reader) = csv::Reader::from_path(path) else {
        return Vec::new();
    };
    let Ok(header) = reader.headers().cloned() else {
        return Vec::new();
    };
    if header.is_empty() {
        tracing::warn!("{} is empty: the run's rows are lost", path.display());
        return Vec::new();
    }
    if ["step", "epoch", "split"]
        .iter()
        .any(|c| !header.iter().any(|h| h == *c))
    {
        // (A cut last row, from a crash mid-write, is only skipped: that is normal.)
        tracing::warn!(
            "{}: its header has no step, epoch and split columns: not a metrics file of \
             trainer's; its rows are left out",
            path.display()
        );
        return Vec::new();
    }
    let mut points = Vec::new();
    // Lines that are not rows, and the last line that is: a bad line before a good one is
    // damage in the file (said, and the rows after it still read); a cut last row is not.
    let (mut bad_lines, mut last_good) = (Vec::new(), 0);
    for record in reader.records() {
        let record = match record {
            Ok(record) => record,
            Err(e) => {
                bad_lines.push(e.position().map_or(0, |p| p.line()));
                continue;
            }
        };
        let line = record.position().map_or(0, |p| p.line());
        let field = |name: &str| {
            header
                .iter()
                .position(|h| h == name)
                .and_then(|i| record.get(i))
        };
        let (Some(step), Some(epoch), Some(split)) = (
            field("step").and_then(|s| s.parse().ok()),
            field("epoch").and_then(|s| s.parse().ok()),
            field("split"),
        ) else {
            bad_lines.push(line);
            continue;
        };
        last_good = line;
        let values = header
            .iter()
            .zip(record.iter())
            .filter(|(h, _)| !["step", "epoch", "split"].contains(h))
            .filter_map(|(h, v)| v.parse::<f64>().ok().map(|v| (h.to_string(), v)))
            .collect();
        points.push(MetricsPoint {
            step,
            epoch,
            split: split.to_string(),
            values,
        });
    }
    bad_lines.retain(|&line| line < last_good);
    if !bad_lines.is_empty() {
        let lines: Vec<String> = bad_lines.iter().map(u64::to_string).collect();
        tracing::warn!(
            "{}: line(s) {} are not metrics rows (the file was damaged); they are left out",
            path.display(),
            lines.join(", ")
        );
    }
    points
}

/// The run directories at or under `path` (a run, a sweep, a job's runs, a whole runs
/// directory), sorted by path, which sorts runs by start time and sweep points by index.
pub fn find_runs(path: &Path) -> Result<Vec<PathBuf>> {
    if !path.is_dir() {
        let what = if path.exists() {
            "not a directory"
        } else {
            "no such directory"
        };
        return Err(job_err!(
            "{}: {what} (expected a run directory, a sweep or a runs directory)",
            path.display()
        ));
    }
    let mut found = Vec::new();
    walk(path, 0, &mut found);
    found.sort();
    Ok(found)
}

fn walk(dir: &Path, depth: usize, found: &mut Vec<PathBuf>) {
    if dir.join("config.toml").is_file() {
        found.push(dir.to_path_buf());
        return;
    }
    // runs/<name>/<sweep>/<point>/ is the deepest layout; a little slack for nesting.
    if depth >= 5 {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            walk(&entry.path(), depth + 1, found);
        }
    }
}

/// Loads every run at or under each path, each once. A run named itself that cannot be read
/// is an error; one found under a named directory is skipped with a warning, so one damaged
/// run does not hide the others.
pub fn load_runs(paths: &[PathBuf]) -> Result<Vec<RunRecord>> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    for p in paths {
        for d in find_runs(p)? {
            if !dirs.contains(&d) {
                dirs.push(d);
            }
        }
    }
    let mut runs = Vec::with_capacity(dirs.len());
    for dir in dirs {
        match RunRecord::load(&dir) {
            Ok(run) => runs.push(run),
            Err(e) if !paths.contains(&dir) => tracing::warn!("skipping a run: {e}"),
            Err(e) => return Err(e),
        }
    }
    Ok(runs)
}

/// The table of every run at or under `paths`, rendered.
/// Says which completed runs' metrics.csv lost rows (their final metrics then come from
/// summary.json, their best ones from what is left).
pub fn warn_about_metrics(runs: &[RunRecord]) {
    for warning in runs.iter().filter_map(RunRecord::metrics_warning) {
        tracing::warn!("{warning}");
    }
}

/// The resolved config as dotted keys and their values; tables are walked into, and so are
/// lists of tables (model.layers: `model.layers[1].out`, so that a sweep over one layer's
/// width shows that key, as sweep.csv does); other lists are one value.
pub(crate) fn flat_config(table: &toml::Table) -> BTreeMap<String, toml::Value> {
    fn walk(prefix: &str, table: &toml::Table, out: &mut BTreeMap<String, toml::Value>) {
        for (k, v) in table {
            let key = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            match v {
                toml::Value::Table(t) => walk(&key, t, out),
                toml::Value::Array(items)
                    if !items.is_empty() && items.iter().all(|i| i.is_table()) =>
                {
                    for (i, item) in items.iter().enumerate() {
                        if let toml::Value::Table(t) = item {
                            walk(&format!("{key}[{i}]"), t, out);
                        }
                    }
                }
                v => {
                    out.insert(key, v.clone());
                }
            }
        }
    }
    let mut out = BTreeMap::new();
    walk("", table, &mut out);
    out
}

/// The config keys whose values are not the same in every run, in key order (positions as
/// numbers: `model.layers[2]` before `model.layers[10]`). A `[parallel]` default a run
/// without data parallelism does not record is not a difference.
pub fn differing_keys(runs: &[RunRecord]) -> Vec<String> {
    let compared = |r: &RunRecord| {
        let mut flat = flat_config(&r.config);
        if r.config.contains_key("parallel") {
            for (key, value) in crate::spec::parallel_defaults() {
                flat.entry(format!("parallel.{key}")).or_insert(value);
            }
        }
        flat
    };
    let flats: Vec<BTreeMap<String, toml::Value>> = runs.iter().map(compared).collect();
    let keys: BTreeSet<&String> = flats.iter().flat_map(|f| f.keys()).collect();
    let mut keys: Vec<String> = keys
        .into_iter()
        .filter(|k| flats.iter().any(|f| f.get(*k) != flats[0].get(*k)))
        .cloned()
        .collect();
    keys.sort_by_cached_key(|k| natural_order(k));
    keys
}

/// A key's text with its runs of digits as numbers, to sort by.
fn natural_order(key: &str) -> Vec<(String, Option<u64>)> {
    let mut parts = Vec::new();
    let mut rest = key;
    while !rest.is_empty() {
        let text_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let (text, after) = rest.split_at(text_len);
        let digits_len = after
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(after.len());
        let (digits, after) = after.split_at(digits_len);
        parts.push((text.to_string(), digits.parse().ok()));
        rest = after;
    }
    parts
}

/// A short label for each run: its path below the runs' common ancestor.
pub fn labels(runs: &[RunRecord]) -> Vec<String> {
    let common = runs
        .iter()
        .map(|r| r.dir.parent().unwrap_or(&r.dir).to_path_buf())
        .reduce(|a, b| {
            a.components()
                .zip(b.components())
                .take_while(|(x, y)| x == y)
                .map(|(x, _)| x)
                .collect()
        })
        .unwrap_or_default();
    runs.iter()
        .map(|r| {
            r.dir
                .strip_prefix(&common)
                .unwrap_or(&r.dir)
                .display()
                .to_string()
        })
        .collect()
}

/// The comparison table: one row per run with the keys that differ, status, size of the
/// run, and the final and best metrics.
pub fn compare_table(runs: &[RunRecord]) -> Table {
    let keys = differing_keys(runs);
    let mut metric_columns: Vec<String> = Vec::new();
    let per_run: Vec<Vec<(String, f64)>> = runs.iter().map(|r| r.final_and_best()).collect();
    for (name, _) in per_run.iter().flatten() {
        if !metric_columns.contains(name) {
            metric_columns.push(name.clone());
        }
    }
    let mut columns: Vec<String> = vec!["run".into(), "status".into(), "end_reason".into()];
    columns.extend(keys.iter().cloned());
    columns.extend(["epochs", "steps", "wall_s"].map(String::from));
    columns.extend(metric_columns.iter().cloned());

    let labels = labels(runs);
    let rows = runs
        .iter()
        .zip(&labels)
        .zip(&per_run)
        .map(|((run, label), metrics)| {
            let flat = flat_config(&run.config);
            let summary = run.summary.as_ref();
            let last = run.points.last();
            let mut row = vec![
                Cell::Text(label.clone()),
                Cell::Text(run.status.as_str().into()),
                run.end_reason()
                    .map_or(Cell::Empty, |r| Cell::Text(r.into())),
            ];
            row.extend(keys.iter().map(|k| {
                flat.get(k)
                    .map_or(Cell::Empty, |v| Cell::Setting(v.clone()))
            }));
            let int = |value: Option<u64>, fallback: Option<u64>| {
                value
                    .or(fallback)
                    .map_or(Cell::Empty, |v| Cell::Int(v as i64))
            };
            let completed = summary.and_then(|s| s.completed());
            row.push(int(
                completed.map(|c| c.epochs as u64),
                last.map(|p| p.epoch as u64),
            ));
            row.push(int(summary.and_then(|s| s.steps()), last.map(|p| p.step)));
            row.push(summary.map_or(Cell::Empty, |s| Cell::Float(s.wall_s)));
            row.extend(metric_columns.iter().map(|c| {
                metrics
                    .iter()
                    .find(|(n, _)| n == c)
                    .map_or(Cell::Empty, |(_, v)| Cell::Float(*v))
            }));
            row
        })
        .collect();
    Table { columns, rows }
}

#[cfg(test)]
mod tests {
    #[test]
    fn keys_sort_with_positions_as_numbers() {
        let mut keys = [
            "model.layers[10].out",
            "model.layers[2].out",
            "data.batch_size",
        ];
        keys.sort_by_cached_key(|k| super::natural_order(k));
        assert_eq!(
            keys,
            [
                "data.batch_size",
                "model.layers[2].out",
                "model.layers[10].out"
            ]
        );
    }

    #[test]
    fn summary_numbers_read_back_exactly() {
        // serde_json without float_roundtrip read this wall_s one unit in the last place off.
        let text = r#"{"wall_s": 1.2965268939999999, "x": -2.5e-7}"#;
        let value: serde_json::Value = serde_json::from_str(text).unwrap();
        assert_eq!(value["wall_s"].as_f64(), Some(1.2965268939999999));
        assert_eq!(value["wall_s"].to_string(), "1.2965268939999999");
        assert_eq!(value["x"].as_f64(), Some(-2.5e-7));
    }
}
