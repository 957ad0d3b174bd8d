//! Logging: tracing to stderr (RUST_LOG respected, `--quiet` keeps warnings and errors only)
//! and, once a run directory exists, the same lines without colours to its train.log.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;
use tracing_subscriber::filter::{EnvFilter, LevelFilter};
use tracing_subscriber::prelude::*;

static RUN_LOG: Mutex<Option<File>> = Mutex::new(None);

/// Writes to the current run's train.log, or nowhere before a run directory exists.
struct RunLog;

impl Write for RunLog {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Ok(mut guard) = RUN_LOG.lock() {
            if let Some(file) = guard.as_mut() {
                file.write_all(buf)?;
            }
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        if let Ok(mut guard) = RUN_LOG.lock() {
            if let Some(file) = guard.as_mut() {
                file.flush()?;
            }
        }
        Ok(())
    }
}

pub fn init(quiet: bool) {
    let stderr_filter = if quiet {
        EnvFilter::new("warn")
    } else {
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"))
    };
    // Colours only on a terminal: logs redirected to a file (srun, nohup, CI) stay plain.
    let stderr = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .without_time()
        .with_filter(stderr_filter);
    let file = tracing_subscriber::fmt::layer()
        .with_writer(|| RunLog)
        .with_ansi(false)
        .with_target(false)
        .with_filter(LevelFilter::INFO);
    // A second init (tests calling the library twice) keeps the first subscriber.
    let _ = tracing_subscriber::registry()
        .with(stderr)
        .with(file)
        .try_init();
}

/// From now on, log lines also go to `path` (appended: a resumed run continues its log).
pub fn attach_run_log(path: &Path) -> std::io::Result<()> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    if let Ok(mut guard) = RUN_LOG.lock() {
        *guard = Some(file);
    }
    Ok(())
}

/// Writes `text` to the current run's train.log only (not to stderr, which shows it anyway).
pub fn append_to_run_log(text: &str) {
    let _ = RunLog.write_all(text.as_bytes());
}

pub fn detach_run_log() {
    if let Ok(mut guard) = RUN_LOG.lock() {
        *guard = None;
    }
}
