//! The `trainer` command line: parses arguments, calls a command, maps errors to exit codes
//! (0 success, 2 bad job or usage, 1 failure while running).

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;
use trainer::commands;

const AFTER_HELP: &str = "\
Examples:
  trainer run jobs/mlp.toml
  trainer run jobs/mlp.toml --set optimizer.lr=3e-4 --set train.epochs=5 --name lr-3e-4
  TRAINER_OPTIMIZER__LR=3e-4 trainer run jobs/mlp.toml
  trainer check jobs/mlp.toml
  for lr in 1e-4 3e-4 1e-3; do trainer run jobs/mlp.toml --set optimizer.lr=$lr --name lr-$lr; done

Overrides, lowest to highest: the job file, TRAINER_SECTION__KEY environment variables, --set.

Resuming:
  trainer run jobs/mlp.toml --resume runs/mlp/20261122-160622-ebbc
  trainer run jobs/mlp.toml --resume runs/mlp/20261122-160622-ebbc/checkpoints/step-00000200.safetensors

Exit codes: 0 success; 2 bad job spec, data, checkpoint or usage (nothing was trained); 1
failure while running (the run directory's summary.json says \"failed\" and why); 130 / 143
stopped by SIGINT / SIGTERM after writing a checkpoint (summary.json says \"interrupted\").";

#[derive(Parser)]
#[command(name = "trainer", version, about = "Declarative training-job runner: a TOML job in, a trained model and CSV metrics out.", after_help = AFTER_HELP)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a job; writes <runs-dir>/<name>/<run-id>/ and prints its path on stdout.
    Run {
        /// The job file (TOML).
        job: PathBuf,
        /// Override a key of the job, e.g. --set optimizer.lr=3e-4 (repeatable; values are TOML).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
        /// Run name (default: job.name, else the job file's stem).
        #[arg(long)]
        name: Option<String>,
        /// Where run directories go.
        #[arg(long, value_name = "DIR", default_value = "runs")]
        runs_dir: PathBuf,
        /// Only print warnings and errors.
        #[arg(long, short)]
        quiet: bool,
        /// Continue a run: a run directory (its newest checkpoint) or a checkpoint file
        /// (RUN/checkpoints/step-NNNNNNNN.safetensors). The run goes on in that directory.
        #[arg(long, value_name = "RUN_DIR|CHECKPOINT")]
        resume: Option<PathBuf>,
        /// With --resume (or checkpoint.resume = "auto"): when the checkpoint fails its
        /// integrity check, use the newest intact earlier one instead of stopping.
        #[arg(long)]
        resume_fallback: bool,
        /// With --resume: continue even though the job changed keys that alter training
        /// (model, data, loss, optimizer...), which is refused otherwise.
        #[arg(long)]
        force: bool,
    },
    /// Validate a job and print its layers, output shapes, parameter counts and memory.
    Check {
        job: PathBuf,
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
    },
    /// Print the job file's JSON Schema (schemas/job.schema.json).
    Schema,
    /// List the devices this machine can train on.
    Devices,
}

fn main() -> ExitCode {
    trainer::process_start();
    let cli = Cli::parse();
    let quiet = matches!(cli.command, Command::Run { quiet: true, .. });
    trainer::logging::init(quiet);
    let result = match cli.command {
        Command::Run {
            job,
            sets,
            name,
            runs_dir,
            resume,
            resume_fallback,
            force,
            ..
        } => commands::run(&commands::RunArgs {
            job,
            sets,
            name,
            runs_dir,
            resume,
            resume_fallback,
            force,
        })
        .map(|dir| println!("{}", dir.display())),
        Command::Check { job, sets } => {
            commands::check(&job, &sets).map(|report| print!("{report}"))
        }
        Command::Schema => {
            print!("{}", trainer::spec::json_schema());
            Ok(())
        }
        Command::Devices => {
            print!("{}", commands::devices());
            Ok(())
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e @ trainer::Error::Interrupted { .. }) => {
            eprintln!("{e}");
            ExitCode::from(e.exit_code() as u8)
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code() as u8)
        }
    }
}
