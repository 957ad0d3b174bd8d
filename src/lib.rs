//! trainer: a declarative training-job runner. A TOML job spec is compiled into a static graph
//! on the project's own tensor engine and trained, writing a run directory with CSV metrics.
//!
//! Data flows one way: spec ▸ graph ▸ (data) ▸ train ▸ run. See ARCHITECTURE.md.

pub mod commands;
pub mod data;
pub mod error;
pub mod graph;
pub mod logging;
pub mod optim;
pub mod provenance;
pub mod results;
pub mod run;
pub mod spec;
pub mod sweep;
pub mod tensor;
pub mod train;

pub use error::{Error, Result};
