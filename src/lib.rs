//! trainer: a declarative training-job runner. A TOML job spec is compiled into a static graph
//! on the project's own tensor engine and trained, writing a run directory with CSV metrics.
//!
//! Data flows one way: spec ▸ graph ▸ (data) ▸ train ▸ run. See ARCHITECTURE.md.

pub mod checkpoint;
pub mod commands;
pub mod data;
pub mod error;
pub mod graph;
pub mod logging;
pub mod ops;
pub mod optim;
pub mod profile;
pub mod provenance;
pub mod results;
pub mod run;
pub mod signals;
pub mod spec;
pub mod sweep;
pub mod tensor;
pub mod train;

pub use error::{Error, Result};

/// When the process started (main calls this first), for start-up time in summaries.
pub fn process_start() -> std::time::Instant {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    *START.get_or_init(std::time::Instant::now)
}
