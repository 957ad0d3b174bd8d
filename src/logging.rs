//! Logging: tracing to stderr (RUST_LOG respected, `--quiet` keeps warnings and errors only)
//! and the same lines without colours to the run's train.log, those said before its run
//! directory exists included. On a terminal, training shows a progress bar (`Progress`),
//! above which the log lines print.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;
use tracing_subscriber::filter::{EnvFilter, LevelFilter};
use tracing_subscriber::prelude::*;

/// Where train.log lines go: kept until the run directory exists (so the log also has what
/// was said while the job was being prepared: the device picked, warnings about the job),
/// then the file.
enum Target {
    Pending(Vec<u8>),
    File(File),
}

/// The most kept before a run directory exists: a process that never makes one (`check`,
/// `ls`) keeps no more than this.
const PENDING_LIMIT: usize = 64 * 1024;

/// Where the kept lines stop when they reach `PENDING_LIMIT`.
const NOT_KEPT: &[u8] = b"(later lines from before the run directory existed were not kept)\n";

static RUN_LOG: Mutex<Target> = Mutex::new(Target::Pending(Vec::new()));

/// The progress bar being drawn, if any: stderr's log lines are written above it.
static BAR: Mutex<Option<indicatif::ProgressBar>> = Mutex::new(None);

/// Whether `--quiet` was given: no progress bar then.
static QUIET: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// stderr, with a progress bar moved out of the way of each line.
struct Stderr;

impl Write for Stderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let bar = BAR.lock().ok().and_then(|bar| bar.clone());
        match bar {
            Some(bar) => bar
                .suspend(|| std::io::stderr().write_all(buf))
                .map(|()| buf.len()),
            None => std::io::stderr().write(buf),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

/// A training run's progress bar: steps done of all, the epoch, the last logged loss,
/// samples/s and the time left. Drawn only on a terminal and without --quiet; elsewhere
/// every method does nothing.
pub struct Progress {
    bar: Option<indicatif::ProgressBar>,
}

impl Progress {
    /// A bar for `total` steps, `done` of them already (a resumed run).
    pub fn start(total: u64, done: u64) -> Progress {
        let quiet = QUIET.load(std::sync::atomic::Ordering::Relaxed);
        if quiet || !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            return Progress { bar: None };
        }
        let bar = indicatif::ProgressBar::new(total).with_position(done);
        let style =
            indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}  ETA {eta}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
        bar.set_style(style);
        bar.reset_eta();
        if let Ok(mut current) = BAR.lock() {
            *current = Some(bar.clone());
        }
        Progress { bar: Some(bar) }
    }

    /// `step` steps done.
    pub fn set(&self, step: u64) {
        if let Some(bar) = &self.bar {
            bar.set_position(step);
        }
    }

    /// What the bar says beside the count: the epoch, loss and speed of the last log row.
    pub fn say(&self, message: impl FnOnce() -> String) {
        if let Some(bar) = &self.bar {
            bar.set_message(message());
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
            if let Ok(mut current) = BAR.lock() {
                *current = None;
            }
        }
    }
}

/// Writes to the current run's train.log, or keeps the lines for it until it exists.
struct RunLog;

impl Write for RunLog {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Ok(mut target) = RUN_LOG.lock() {
            match &mut *target {
                Target::File(file) => file.write_all(buf)?,
                // Past the limit, one marker and nothing after it: no silent holes.
                Target::Pending(kept) if kept.ends_with(NOT_KEPT) => {}
                Target::Pending(kept) if kept.len() + buf.len() <= PENDING_LIMIT => {
                    kept.extend_from_slice(buf)
                }
                Target::Pending(kept) => kept.extend_from_slice(NOT_KEPT),
            }
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        if let Ok(mut target) = RUN_LOG.lock() {
            if let Target::File(file) = &mut *target {
                file.flush()?;
            }
        }
        Ok(())
    }
}

pub fn init(quiet: bool) {
    QUIET.store(quiet, std::sync::atomic::Ordering::Relaxed);
    let stderr_filter = if quiet {
        EnvFilter::new("warn")
    } else {
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"))
    };
    // Colours only on a terminal: logs redirected to a file (srun, nohup, CI) stay plain.
    let stderr = tracing_subscriber::fmt::layer()
        .with_writer(|| Stderr)
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

/// From now on, log lines also go to `path` (appended: a resumed run continues its log),
/// after those said since the last run log was detached.
pub fn attach_run_log(path: &Path) -> std::io::Result<()> {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    if let Ok(mut target) = RUN_LOG.lock() {
        if let Target::Pending(kept) = &*target {
            file.write_all(kept)?;
        }
        *target = Target::File(file);
    }
    Ok(())
}

/// Writes `text` to the current run's train.log only (not to stderr, which shows it anyway).
pub fn append_to_run_log(text: &str) {
    let _ = RunLog.write_all(text.as_bytes());
}

/// Drops the lines kept for a run log not attached yet (see `Target::Pending`).
pub fn forget_pending() {
    if let Ok(mut target) = RUN_LOG.lock() {
        if let Target::Pending(kept) = &mut *target {
            kept.clear();
        }
    }
}

pub fn detach_run_log() {
    if let Ok(mut target) = RUN_LOG.lock() {
        *target = Target::Pending(Vec::new());
    }
}
