//! `trainer profile`: a job's warm-up steps, then measured steps with each op timed on its
//! own; prints the table and keeps it in the run directory with profile.csv and trace.json.

use super::{run, RunArgs};
use crate::error::Result;
use crate::profile::ProfileSteps;
use std::path::PathBuf;

/// `trainer profile`'s arguments.
#[derive(clap::Args)]
pub struct ProfileArgs {
    /// The job file (TOML).
    pub job: PathBuf,
    /// Override a key of the job, as for `trainer run` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Steps measured.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub steps: u64,
    /// Steps run first and not measured (caches, allocations, CUDA graphs' recording).
    #[arg(long, default_value_t = 3)]
    pub warmup: u64,
    /// Where the run directory goes.
    #[arg(long, value_name = "DIR", default_value = "runs")]
    pub runs_dir: PathBuf,
    /// Only print warnings and errors (and the table).
    #[arg(long, short)]
    pub quiet: bool,
}

/// Runs the job for `warmup + steps` steps (enough epochs for them, one train row), the
/// last `steps` profiled.
pub fn profile(args: &ProfileArgs) -> Result<()> {
    let total = args.warmup + args.steps;
    let mut sets = args.sets.clone();
    sets.extend([
        format!("train.max_steps={total}"),
        format!("train.epochs={total}"),
        format!("train.log_every={total}"),
    ]);
    run(&RunArgs {
        job: args.job.clone(),
        job_given: true,
        sets,
        name: None,
        runs_dir: args.runs_dir.clone(),
        resume: None,
        resume_fallback: false,
        force: false,
        dir: None,
        quiet: args.quiet,
        print_run_dir: false,
        profile: Some(ProfileSteps {
            first: args.warmup + 1,
            last: total,
            dir: PathBuf::new(),
            print: true,
            planned_bytes: 0,
        }),
    })
}
