//! metrics.csv: one header, stable columns, one row per log step and per evaluation, flushed
//! as it is written so `tail -f` works and a crash loses at most the row being written.

use crate::error::{Error, Result};
use std::fs::File;
use std::io::Write;
use std::path::Path;

/// The columns, in order. Documented in docs/metrics.md; new columns are only
/// ever appended.
pub const METRICS_COLUMNS: [&str; 17] = [
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
    "loss_scale",
    "skipped_steps",
    "global_batch",
    "tokens_per_sec",
    "flops_per_sec",
    "mfu",
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
    /// Mixed precision's loss scale after this step (empty without loss scaling).
    pub loss_scale: Option<f64>,
    /// Optimizer steps skipped so far for inf/NaN gradients (train rows).
    pub skipped_steps: Option<u64>,
    /// Samples per full optimizer step, all replicas and micro-batches (train rows).
    pub global_batch: Option<usize>,
    /// Target tokens a second, for jobs with a loss at every position (language models).
    pub tokens_per_sec: Option<f64>,
    /// The model's FLOPs a second, all replicas (`Graph::model_flops_per_sample`; train rows).
    pub flops_per_sec: Option<f64>,
    /// `flops_per_sec` over the devices' datasheet peak, where it is known (H100, H200,
    /// A100): model FLOPs utilisation, as llm.c and nanoGPT report it.
    pub mfu: Option<f64>,
}

/// A value as the shortest text that reads back to it; from 1e16 up in exponent form (a
/// loss scale of 1e300 would otherwise be written out in 301 digits).
fn number(v: f64) -> String {
    if v.abs() >= 1e16 && v.is_finite() {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}

pub struct MetricsWriter {
    /// Appended to, a whole row at a time (no buffer of its own that could later add the
    /// rest of a row cut short).
    file: File,
    /// The row being written, as CSV text.
    line: Vec<u8>,
    path: String,
    /// Rows written, the header excluded (a checkpoint records it).
    rows: u64,
    /// The file's length after the last whole row: a row a full disk cut short is taken back
    /// to it, so the file never ends in half a row.
    whole: u64,
    /// The columns its header has: all of METRICS_COLUMNS, or the first ones where a run
    /// an earlier trainer started is resumed (its rows keep that shape).
    columns: usize,
}

impl MetricsWriter {
    pub fn create(path: &Path) -> Result<Self> {
        let name = path.display().to_string();
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .and_then(|f| f.set_len(0).map(|()| f))
            .map_err(|e| Error::Runtime(format!("cannot create {name}: {e}")))?;
        let mut w = MetricsWriter {
            file,
            line: Vec::new(),
            path: name,
            rows: 0,
            whole: 0,
            columns: METRICS_COLUMNS.len(),
        };
        w.write_record(METRICS_COLUMNS.iter().map(|s| s.to_string()).collect())?;
        Ok(w)
    }

    /// The length of a resumed run's metrics.csv up to its first `keep_rows` rows (those
    /// written before the checkpoint) and the rows it keeps, or why it cannot be continued (a
    /// bad resume, exit 2: checked before the run directory is touched). Rows missing (the
    /// file cut short by hand or by a disk) are an error, unless `force`: then the run goes
    /// on after the rows that are there, and the missing ones stay missing.
    /// A file that is gone, empty or cut inside its header has no rows: with `force` it
    /// starts again from its header (length 0). Also returns how many columns its header has.
    pub fn resumable_len(path: &Path, keep_rows: u64, force: bool) -> Result<(u64, u64, usize)> {
        let all = METRICS_COLUMNS.len();
        let name = path.display().to_string();
        let header = METRICS_COLUMNS.join(",");
        let text = match std::fs::read_to_string(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && (force || keep_rows == 0) => {
                return Ok((0, 0, all))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::Job(format!(
                    "{name} is gone, with the {keep_rows} rows written before the checkpoint: \
                     restore it, or pass --force to go on without them (a new metrics.csv)"
                )))
            }
            Err(e) => {
                return Err(Error::Job(format!(
                    "cannot read {name} to resume its run: {e}"
                )))
            }
            Ok(text) => text,
        };
        if header.starts_with(text.trim_end_matches('\n')) && text.len() < header.len() {
            return match force || keep_rows == 0 {
                true => Ok((0, 0, all)),
                false => Err(Error::Job(format!(
                    "{name} is empty or cut inside its header: the {keep_rows} rows written \
                     before the checkpoint are missing (restore the file, or pass --force to go \
                     on without them)"
                ))),
            };
        }
        // An earlier trainer's header is the first of today's columns.
        let first_line = text.lines().next().unwrap_or("");
        let Some(columns) = (1..=all).find(|&n| METRICS_COLUMNS[..n].join(",") == first_line)
        else {
            return Err(Error::Job(format!(
                "{name} does not start with the header `{header}`; it is not this run's metrics"
            )));
        };
        // Cells are numbers and split names: a row never spans lines.
        let mut end = (first_line.len() + 1).min(text.len());
        for row in 0..keep_rows {
            match text[end..].find('\n') {
                Some(i) => end += i + 1,
                None if force => return Ok((end as u64, row, columns)),
                None => {
                    return Err(Error::Job(format!(
                        "{name} has {row} rows but the checkpoint was written after row \
                         {keep_rows}: rows are missing, so it cannot be continued as it was \
                         (restore the file, or pass --force to go on after the rows there are)"
                    )))
                }
            }
        }
        Ok((end as u64, keep_rows, columns))
    }

    /// Reopens a resumed run's metrics.csv: keeps the header and the first `keep_rows`
    /// rows, drops the rest, and appends after them (`force`: see `resumable_len`).
    pub fn resume(path: &Path, keep_rows: u64, force: bool) -> Result<Self> {
        let (end, keep_rows, columns) = Self::resumable_len(path, keep_rows, force)?;
        if end == 0 {
            return Self::create(path);
        }
        let name = path.display().to_string();
        // A header that lost its line end (the file cut right after it) gets it back, or the
        // first row would join the header line.
        let header_alone = end == METRICS_COLUMNS[..columns].join(",").len() as u64;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .and_then(|f| f.set_len(end).map(|()| f))
            .and_then(|mut f| match header_alone {
                true => f.write_all(b"\n").map(|()| f),
                false => Ok(f),
            })
            .map_err(|e| Error::Runtime(format!("cannot reopen {name}: {e}")))?;
        Ok(MetricsWriter {
            file,
            line: Vec::new(),
            path: name,
            rows: keep_rows,
            whole: end + u64::from(header_alone),
            columns,
        })
    }

    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Puts the rows written so far on disk. A checkpoint records how many rows there are,
    /// so it is taken only after they are durable: after a power loss, a resume from it
    /// would otherwise find fewer rows than it expects and be refused.
    pub fn sync(&self) -> Result<()> {
        self.file
            .sync_data()
            .map_err(|e| Error::Runtime(format!("cannot write {} to disk: {e}", self.path)))
    }

    pub fn write(&mut self, row: &MetricsRow) -> Result<()> {
        let opt = |v: Option<f64>| v.map_or(String::new(), number);
        self.write_record(vec![
            row.step.to_string(),
            row.epoch.to_string(),
            row.split.to_string(),
            number(row.loss),
            opt(row.accuracy),
            opt(row.lr),
            opt(row.grad_norm),
            opt(row.samples_per_sec.map(|s| s.round())),
            format!("{:.3}", row.elapsed_s),
            opt(row.gpu_mem.map(|(a, _)| a as f64)),
            opt(row.gpu_mem.map(|(_, p)| p as f64)),
            opt(row.loss_scale),
            row.skipped_steps.map_or(String::new(), |s| s.to_string()),
            row.global_batch.map_or(String::new(), |b| b.to_string()),
            opt(row.tokens_per_sec.map(|s| s.round())),
            opt(row.flops_per_sec.map(|s| s.round())),
            opt(row.mfu.map(|m| (m * 1e4).round() / 1e4)),
        ])?;
        self.rows += 1;
        Ok(())
    }

    fn write_record(&mut self, mut fields: Vec<String>) -> Result<()> {
        fields.truncate(self.columns);
        self.line.clear();
        {
            let mut line = csv::Writer::from_writer(&mut self.line);
            line.write_record(&fields)
                .and_then(|()| line.flush().map_err(csv::Error::from))
                .map_err(|e| Error::Runtime(format!("cannot write {}: {e}", self.path)))?;
        }
        match self.file.write_all(&self.line) {
            Ok(()) => {
                self.whole += self.line.len() as u64;
                Ok(())
            }
            Err(e) => {
                // Best effort: the disk that cut the row may refuse this too.
                let _ = self.file.set_len(self.whole);
                Err(Error::Runtime(format!("cannot write {}: {e}", self.path)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::number;

    #[test]
    fn a_header_cut_before_its_line_end_gets_it_back_on_resume() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.csv");
        let header = super::METRICS_COLUMNS.join(",");
        std::fs::write(&path, &header).unwrap();
        drop(super::MetricsWriter::resume(&path, 0, false).unwrap());
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            format!("{header}\n")
        );
    }

    /// A metrics.csv that is gone, emptied or cut inside its header lost every row: a resume
    /// is refused unless --force, which starts the file again from its header.
    #[test]
    fn a_lost_or_emptied_file_resumes_only_with_force_from_a_new_header() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.csv");
        let header = super::METRICS_COLUMNS.join(",");
        for damaged in [None, Some(""), Some("step,ep")] {
            match damaged {
                None => drop(std::fs::remove_file(&path)),
                Some(text) => std::fs::write(&path, text).unwrap(),
            }
            let refused = super::MetricsWriter::resume(&path, 3, false).err().unwrap();
            assert!(refused.to_string().contains("--force"), "{refused}");
            let writer = super::MetricsWriter::resume(&path, 3, true).unwrap();
            assert_eq!(writer.rows(), 0);
            drop(writer);
            assert_eq!(
                std::fs::read_to_string(&path).unwrap(),
                format!("{header}\n")
            );
        }
        // Nothing written before the checkpoint: nothing is missing.
        std::fs::remove_file(&path).unwrap();
        assert!(super::MetricsWriter::resume(&path, 0, false).is_ok());
    }

    #[test]
    fn numbers_read_back_exactly_and_huge_ones_stay_short() {
        for v in [
            0.1,
            65536.0,
            2.5e-9,
            1e30,
            1e300,
            -3e17,
            f64::INFINITY,
            f64::NAN,
        ] {
            let text = number(v);
            assert!(text.len() <= 24, "{text}");
            let back: f64 = text.parse().unwrap();
            assert!(back == v || (v.is_nan() && back.is_nan()), "{v} -> {text}");
        }
        assert_eq!(number(65536.0), "65536");
        assert_eq!(number(1e300), "1e300");
    }
}
