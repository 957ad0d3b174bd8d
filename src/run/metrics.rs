//! metrics.csv: one header, stable columns, one row per log step and per evaluation, flushed
//! as it is written so `tail -f` works and a crash loses at most the row being written.

use crate::error::{Error, Result};
use std::fs::File;
use std::path::Path;

/// The columns, in order. Documented in README ("Reading metrics.csv"); new columns are only
/// ever appended.
pub const METRICS_COLUMNS: [&str; 11] = [
    "step",
    "epoch",
    "split",
    "loss",
    "accuracy",
    "lr",
    "grad_norm",
    "samples_per_sec",
    "elapsed_s",
    "gpu_mem_allocated",
    "gpu_mem_peak",
];

/// One row; `None` leaves the cell empty (e.g. accuracy for a regression).
#[derive(Debug, Clone, Default)]
pub struct MetricsRow {
    pub step: u64,
    pub epoch: usize,
    pub split: &'static str,
    pub loss: f64,
    pub accuracy: Option<f64>,
    pub lr: Option<f64>,
    pub grad_norm: Option<f64>,
    pub samples_per_sec: Option<f64>,
    pub elapsed_s: f64,
    /// Device memory (allocated, peak) in bytes, on a GPU.
    pub gpu_mem: Option<(usize, usize)>,
}

pub struct MetricsWriter {
    writer: csv::Writer<File>,
    path: String,
}

impl MetricsWriter {
    pub fn create(path: &Path) -> Result<Self> {
        let name = path.display().to_string();
        let file =
            File::create(path).map_err(|e| Error::Runtime(format!("cannot create {name}: {e}")))?;
        let mut w = MetricsWriter {
            writer: csv::Writer::from_writer(file),
            path: name,
        };
        w.write_record(METRICS_COLUMNS.iter().map(|s| s.to_string()).collect())?;
        Ok(w)
    }

    pub fn write(&mut self, row: &MetricsRow) -> Result<()> {
        let opt = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v}"));
        self.write_record(vec![
            row.step.to_string(),
            row.epoch.to_string(),
            row.split.to_string(),
            format!("{}", row.loss),
            opt(row.accuracy),
            opt(row.lr),
            opt(row.grad_norm),
            opt(row.samples_per_sec.map(|s| s.round())),
            format!("{:.3}", row.elapsed_s),
            opt(row.gpu_mem.map(|(a, _)| a as f64)),
            opt(row.gpu_mem.map(|(_, p)| p as f64)),
        ])
    }

    fn write_record(&mut self, fields: Vec<String>) -> Result<()> {
        let err =
            |e: &dyn std::fmt::Display| Error::Runtime(format!("cannot write {}: {e}", self.path));
        self.writer.write_record(&fields).map_err(|e| err(&e))?;
        self.writer.flush().map_err(|e| err(&e))
    }
}
