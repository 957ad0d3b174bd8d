//! What `ls` and `compare` show of many runs: the runs a `--filter` keeps, in `--sort`'s
//! order, the `--columns` asked for, one table per job on a terminal, cut to its width.

use super::table::{Cell, Format, Table};
use super::{compare_table, flat_config, load_runs, warn_about_metrics, RunRecord};
use crate::error::{Error, Result};
use std::path::PathBuf;

/// `trainer ls` / `compare`'s options.
#[derive(Debug, Clone)]
pub struct ListOptions {
    pub format: Format,
    /// Columns to show after `run`, in this order (default: all).
    pub columns: Vec<String>,
    /// A column to order the runs by; `-column` for descending.
    pub sort: Option<String>,
    /// `KEY=VALUE`: only the runs whose KEY (a config key, status, end_reason, job, or a
    /// metric column) has VALUE.
    pub filters: Vec<String>,
}

/// The table (or tables) `ls` and `compare` print.
pub fn list(paths: &[PathBuf], options: &ListOptions) -> Result<String> {
    let runs = load_runs(paths)?;
    warn_about_metrics(&runs);
    if runs.is_empty() {
        let dirs: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
        tracing::warn!("no runs under {}", dirs.join(", "));
    }
    let runs = filtered(runs, &options.filters)?;
    // Grouped by job for people: another job's keys are not this one's differences.
    let groups = match options.format {
        Format::Table => by_job(runs),
        _ => vec![(String::new(), runs)],
    };
    let width = terminal_width().filter(|_| options.format == Format::Table);
    let mut out = String::new();
    for (i, (job, group)) in groups.iter().enumerate() {
        let mut table = compare_table(group);
        if let Some(key) = &options.sort {
            sort_rows(&mut table, key)?;
        }
        if !options.columns.is_empty() {
            table = picked(table, &options.columns)?;
        }
        if groups.len() > 1 {
            if i > 0 {
                out.push('\n');
            }
            let n = group.len();
            out += &format!("{job} ({n} run{})\n", if n == 1 { "" } else { "s" });
        }
        out += &match width {
            Some(width) => fitted(table, width),
            None => table.render(options.format),
        };
    }
    Ok(out)
}

/// A run's value of `key`, as text: a config key, `status`, `end_reason`, `job`, or a
/// metric column (`val_accuracy`, `best_val_loss`).
fn value_of(run: &RunRecord, key: &str) -> Option<String> {
    match key {
        "status" => Some(run.status.as_str().to_string()),
        "end_reason" => run.end_reason().map(String::from),
        "job" => Some(job_of(run)),
        _ => flat_config(&run.config)
            .get(key)
            .map(|v| match v {
                toml::Value::String(s) => s.clone(),
                other => other.to_string(),
            })
            .or_else(|| {
                let metrics = run.final_and_best();
                metrics
                    .iter()
                    .find(|(name, _)| name == key)
                    .map(|(_, v)| v.to_string())
            }),
    }
}

fn job_of(run: &RunRecord) -> String {
    run.config
        .get("job")
        .and_then(|j| j.get("name"))
        .and_then(|n| n.as_str())
        .unwrap_or("")
        .to_string()
}

/// The runs every `KEY=VALUE` filter keeps. A number matches as a number (`3e-4` is
/// `0.0003`). A key no run has is refused: it is likely misspelled.
fn filtered(runs: Vec<RunRecord>, filters: &[String]) -> Result<Vec<RunRecord>> {
    let mut wanted = Vec::new();
    for filter in filters {
        let Some((key, value)) = filter.split_once('=') else {
            return Err(Error::Job(format!(
                "--filter {filter}: give KEY=VALUE, e.g. --filter optimizer.lr=3e-4 or --filter \
                 status=completed"
            )));
        };
        let (key, value) = (key.trim(), value.trim());
        if !runs.is_empty() && runs.iter().all(|r| value_of(r, key).is_none()) {
            return Err(Error::Job(format!(
                "--filter {filter}: no run has `{key}` (a config key such as optimizer.lr, \
                 status, end_reason, job, or a metric column such as val_accuracy)"
            )));
        }
        wanted.push((key.to_string(), value.to_string()));
    }
    let same = |have: &str, want: &str| {
        have == want
            || matches!((have.parse::<f64>(), want.parse::<f64>()), (Ok(a), Ok(b)) if a == b)
    };
    Ok(runs
        .into_iter()
        .filter(|r| {
            wanted
                .iter()
                .all(|(k, v)| value_of(r, k).is_some_and(|have| same(&have, v)))
        })
        .collect())
}

/// The runs by job name, each job where its first run is.
fn by_job(runs: Vec<RunRecord>) -> Vec<(String, Vec<RunRecord>)> {
    let mut groups: Vec<(String, Vec<RunRecord>)> = Vec::new();
    for run in runs {
        let job = job_of(&run);
        match groups.iter_mut().find(|(name, _)| *name == job) {
            Some((_, group)) => group.push(run),
            None => groups.push((job, vec![run])),
        }
    }
    groups
}

/// Orders the rows by the column `key` (`-key`: descending); empty cells last.
fn sort_rows(table: &mut Table, key: &str) -> Result<()> {
    let (name, descending) = match key.strip_prefix('-') {
        Some(name) => (name, true),
        None => (key, false),
    };
    let Some(i) = table.columns.iter().position(|c| c == name) else {
        return Err(Error::Job(format!(
            "--sort {key}: no column `{name}`; columns: {}",
            table.columns.join(", ")
        )));
    };
    let number = |c: &Cell| match c {
        Cell::Int(v) => Some(*v as f64),
        Cell::Float(v) => Some(*v),
        Cell::Setting(toml::Value::Integer(v)) => Some(*v as f64),
        Cell::Setting(toml::Value::Float(v)) => Some(*v),
        _ => None,
    };
    let text = |c: &Cell| match c {
        Cell::Text(t) => t.clone(),
        Cell::Setting(toml::Value::String(s)) => s.clone(),
        Cell::Setting(v) => v.to_string(),
        _ => String::new(),
    };
    table.rows.sort_by(|a, b| {
        let (a, b) = (&a[i], &b[i]);
        match (a, b) {
            (Cell::Empty, Cell::Empty) => std::cmp::Ordering::Equal,
            (Cell::Empty, _) => std::cmp::Ordering::Greater,
            (_, Cell::Empty) => std::cmp::Ordering::Less,
            _ => {
                let order = match (number(a), number(b)) {
                    (Some(x), Some(y)) => x.total_cmp(&y),
                    _ => text(a).cmp(&text(b)),
                };
                if descending {
                    order.reverse()
                } else {
                    order
                }
            }
        }
    });
    Ok(())
}

/// `run`, then the `columns` asked for, in their order.
fn picked(table: Table, columns: &[String]) -> Result<Table> {
    let mut at = vec![0];
    for name in columns.iter().filter(|c| *c != "run") {
        match table.columns.iter().position(|c| c == name) {
            Some(i) => at.push(i),
            None => {
                return Err(Error::Job(format!(
                    "--columns: no column `{name}`; columns: {}",
                    table.columns.join(", ")
                )))
            }
        }
    }
    Ok(Table {
        columns: at.iter().map(|&i| table.columns[i].clone()).collect(),
        rows: table
            .rows
            .iter()
            .map(|r| at.iter().map(|&i| r[i].clone()).collect())
            .collect(),
    })
}

/// The aligned table cut to `width` characters: columns go, least telling first (the end
/// reason, the run's size, then the config keys from the right, then metrics from the
/// right), and a last line names them.
fn fitted(mut table: Table, width: usize) -> String {
    let mut left_out = Vec::new();
    loop {
        let text = table.render(Format::Table);
        let widest = text.lines().map(|l| l.chars().count()).max().unwrap_or(0);
        if widest <= width || table.columns.len() <= 2 {
            if left_out.is_empty() {
                return text;
            }
            return format!(
                "{text}({} column(s) left out to fit the terminal: {}; --columns picks columns, \
                 --format csv has them all)\n",
                left_out.len(),
                left_out.join(", ")
            );
        }
        let i = drop_order(&table.columns);
        left_out.push(table.columns.remove(i));
        for row in &mut table.rows {
            row.remove(i);
        }
    }
}

/// The next column to leave out of a table too wide for the terminal.
fn drop_order(columns: &[String]) -> usize {
    let size = ["end_reason", "wall_s", "epochs", "steps"];
    if let Some(i) = size
        .iter()
        .find_map(|name| columns.iter().position(|c| c == name))
    {
        return i;
    }
    let is_metric = |c: &str| {
        c.starts_with("best_") || ["train_", "val_", "test_"].iter().any(|p| c.starts_with(p))
    };
    // Config keys (between status and the metrics) from the right; then the best values,
    // the training split's, and the other metrics, each from the right.
    let from_right =
        |keep: &dyn Fn(&str) -> bool| (2..columns.len()).rev().find(|&i| keep(&columns[i]));
    from_right(&|c| !is_metric(c) && c != "status")
        .or_else(|| from_right(&|c| c.starts_with("best_")))
        .or_else(|| from_right(&|c| c.starts_with("train_")))
        .unwrap_or(columns.len() - 1)
}

/// The terminal's width in characters when stdout is one (COLUMNS first, as shells set it).
fn terminal_width() -> Option<usize> {
    if !std::io::IsTerminal::is_terminal(&std::io::stdout()) {
        return None;
    }
    if let Some(n) = std::env::var("COLUMNS").ok().and_then(|c| c.parse().ok()) {
        return Some(n);
    }
    // SAFETY: TIOCGWINSZ fills the winsize we pass; stdout is a terminal.
    let mut size: libc::winsize = unsafe { std::mem::zeroed() };
    let ok = unsafe { libc::ioctl(libc::STDOUT_FILENO, libc::TIOCGWINSZ, &mut size) } == 0;
    (ok && size.ws_col > 0).then_some(size.ws_col as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Table {
        let columns = [
            "run",
            "status",
            "end_reason",
            "optimizer.lr",
            "epochs",
            "steps",
        ];
        let columns = columns.iter().map(|c| c.to_string());
        let metrics = ["wall_s", "val_loss", "val_accuracy"].map(String::from);
        Table {
            columns: columns.chain(metrics).collect(),
            rows: vec![
                vec![
                    Cell::Text("a".into()),
                    Cell::Text("completed".into()),
                    Cell::Text("completed".into()),
                    Cell::Setting(toml::Value::Float(0.001)),
                    Cell::Int(3),
                    Cell::Int(60),
                    Cell::Float(1.5),
                    Cell::Float(0.3),
                    Cell::Float(0.91),
                ],
                vec![
                    Cell::Text("b".into()),
                    Cell::Text("failed".into()),
                    Cell::Empty,
                    Cell::Setting(toml::Value::Float(0.1)),
                    Cell::Int(1),
                    Cell::Int(20),
                    Cell::Float(0.5),
                    Cell::Empty,
                    Cell::Empty,
                ],
            ],
        }
    }

    #[test]
    fn a_narrow_terminal_keeps_the_run_and_its_metrics_longest() {
        let wide = table().render(Format::Table);
        assert_eq!(fitted(table(), 1000), wide);
        let narrow = fitted(table(), 50);
        let first = narrow.lines().next().unwrap();
        assert!(first.starts_with("run  status"), "{narrow}");
        assert!(first.contains("val_loss  val_accuracy"), "{narrow}");
        assert!(
            narrow.lines().take(3).all(|l| l.chars().count() <= 50),
            "{narrow}"
        );
        assert!(
            narrow.contains("left out to fit the terminal: end_reason, wall_s"),
            "{narrow}"
        );
    }

    #[test]
    fn sort_and_columns_reorder_and_pick() {
        let mut t = table();
        sort_rows(&mut t, "-optimizer.lr").unwrap();
        assert_eq!(t.rows[0][0], Cell::Text("b".into()));
        sort_rows(&mut t, "val_loss").unwrap();
        assert_eq!(t.rows[0][0], Cell::Text("a".into()), "empty cells go last");
        let t = picked(t, &["val_accuracy".into(), "status".into()]).unwrap();
        assert_eq!(t.columns, ["run", "val_accuracy", "status"]);
        assert!(sort_rows(&mut table(), "lr").is_err());
        assert!(picked(table(), &["nope".into()]).is_err());
    }
}
