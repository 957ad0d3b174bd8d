//! The `trainer` command line: parses arguments, calls a command, maps errors to exit codes
//! (0 success, 2 bad job or usage, 1 failure while running).

use clap::{CommandFactory, Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;
use trainer::commands;
use trainer::results::{self, plot::XAxis, table::Format};
use trainer::sweep::{self, SweepArgs};

const AFTER_HELP: &str = "\
Examples:
  trainer run jobs/mlp.toml
  trainer run jobs/mlp.toml --set optimizer.lr=3e-4 --set train.epochs=5 --name lr-3e-4
  TRAINER_OPTIMIZER__LR=3e-4 trainer run jobs/mlp.toml
  trainer check jobs/mlp.toml --explain
  trainer sweep jobs/mlp.toml --grid optimizer.lr=1e-4,3e-4,1e-3 --grid data.batch_size=64,128
  trainer sweep jobs/mlp.toml --grid optimizer.lr=1e-4,3e-4,1e-3 --devices cuda:0,cuda:1
  trainer eval runs/mlp/20261122-160622-ebbc --split val --confusion confusion.csv
  trainer predict runs/mlp/20261122-160622-ebbc inputs.csv -o predictions.csv --keep-columns id
  trainer sample runs/gpt_char/20261128-123045-d53a --prompt \"ROMEO:\" --tokens 200 --top-k 40
  trainer ls
  trainer compare runs/mlp/sweep-1a2b3c4d --format markdown
  trainer plot runs/mlp/sweep-1a2b3c4d --metric loss,val_accuracy --x epoch -o curves.png
  for lr in 1e-4 3e-4 1e-3; do trainer run jobs/mlp.toml --set optimizer.lr=$lr --name lr-$lr; done

Overrides, lowest to highest: the job file, TRAINER_SECTION__KEY environment variables, --set.

Resuming (the run's own config.toml is the job; --set changes it):
  trainer run --resume runs/mlp/20261122-160622-ebbc --set train.epochs=60
  trainer run --resume RUN_DIR/checkpoints/step-00000200.safetensors --force

Exit codes: 0 success; 2 bad job spec, data, checkpoint or usage (nothing was trained); 1
failure while running (the run directory's summary.json says \"failed\" and why); 130 / 143
stopped by SIGINT / SIGTERM after writing a checkpoint (summary.json says \"interrupted\"),
or by a second one at once, without a summary or a checkpoint of that step.";

#[derive(Parser)]
#[command(name = "trainer", version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("TRAINER_GIT_COMMIT"), ")"), about = "Declarative training-job runner: a TOML job in, a trained model and CSV metrics out.", after_help = AFTER_HELP)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a job; writes <runs-dir>/<name>/<run-id>/ and prints its path on stdout as soon
    /// as it exists (a script has it however the run ends).
    Run {
        /// The job file (TOML). With --resume it may be left out: the run's own config.toml
        /// is the job then.
        job: Option<PathBuf>,
        /// Override a key of the job, e.g. --set optimizer.lr=3e-4 or, for one layer,
        /// --set model.layers[1].out=256 (by position from 0, or [NAME] by its name).
        /// Repeatable (a key given again takes the later value, so scripts can append
        /// overrides); values are TOML.
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
        /// (model, data, loss, optimizer...), or from a checkpoint older than what the run
        /// recorded since (what the resume replaces moves to RUN_DIR/superseded/); both are
        /// refused otherwise.
        #[arg(long)]
        force: bool,
        /// Create the run directory at exactly this path (it must not exist yet) instead of
        /// <runs-dir>/<name>/<run-id>/; `sweep --devices` starts its points this way.
        #[arg(long, value_name = "DIR", conflicts_with = "resume")]
        run_dir: Option<PathBuf>,
        /// Profile optimizer steps A to B (both included): each op timed on its own, written
        /// to the run directory as profile.txt, profile.csv and trace.json (Chrome trace).
        #[arg(long, value_name = "A..B", value_parser = trainer::profile::ProfileSteps::parse)]
        profile_steps: Option<trainer::profile::ProfileSteps>,
    },
    /// Profile a job: run warm-up steps, then time each op of the measured steps and print
    /// the table (time, share, GFLOP/s, GB/s, memory by layer); the run directory keeps it
    /// with profile.csv and a Chrome trace, trace.json.
    Profile(commands::ProfileArgs),
    /// Validate a job and print its layers, output shapes, parameter counts and memory.
    Check {
        /// The job file (TOML).
        job: PathBuf,
        /// Override a key of the job, as for `trainer run` (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
        /// Print every resolved value instead, and where it came from (default, file,
        /// environment, --set).
        #[arg(long)]
        explain: bool,
    },
    /// Train one run per point of a grid of overrides, one after another (or side by side
    /// with --devices), in <runs-dir>/<name>/<sweep-id>/ with sweep.csv indexing the points.
    /// Running the same sweep again skips the points that finished and resumes (from their
    /// checkpoint) or restarts the others.
    Sweep {
        /// The job file (TOML) every point starts from.
        job: PathBuf,
        /// Sweep a key over values (TOML, as for --set); every combination of the --grid keys
        /// is a point. Repeatable. Values split on commas outside brackets and quotes.
        #[arg(long, value_name = "KEY=V1,V2,...")]
        grid: Vec<String>,
        /// Keys that move together: the i-th values of every --zip key form one point of this
        /// axis (all need the same number of values). Repeatable.
        #[arg(long, value_name = "KEY=V1,V2,...")]
        zip: Vec<String>,
        /// Override a key for every point (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
        /// Name (default: job.name, else the job file's stem).
        #[arg(long)]
        name: Option<String>,
        #[arg(long, value_name = "DIR", default_value = "runs")]
        runs_dir: PathBuf,
        /// The sweep's directory name (default: sweep-<hash of the resolved job and grid>).
        #[arg(long, value_name = "ID")]
        sweep_id: Option<String>,
        /// Run points that failed before again (default: a failed point is final).
        #[arg(long)]
        retry_failed: bool,
        /// Run points side by side, one per listed device at a time, each in its own process
        /// with device.type set to its device: cpu,cpu (CPU points split the cores:
        /// train.threads = cores / CPU slots, or the job's own if fewer) or cuda:0,cuda:1.
        /// Names as for device.type: auto, cpu, cuda, cuda:N.
        #[arg(long, value_name = "DEVICE,...")]
        devices: Option<String>,
        /// Only print warnings and errors.
        #[arg(long, short)]
        quiet: bool,
    },
    /// Evaluate a run's model (its final weights, or --checkpoint) on a split of its own data
    /// or on another file of the same kind; prints the metrics.
    Eval(commands::EvalArgs),
    /// Predict with a run's model: one CSV row per input row (a CSV file of the run's columns,
    /// the label left out or not, or IDX images), with the class and its probabilities, or the
    /// predicted values.
    Predict(commands::PredictArgs),
    /// Write text with a run's language model: the prompt and the tokens drawn after it.
    Sample(commands::SampleArgs),
    /// Write a GPT run's model as Hugging Face's GPT-2 (model.safetensors and config.json),
    /// which transformers' GPT2LMHeadModel.from_pretrained reads; prints the directory.
    Export(commands::ExportArgs),
    /// Tokenize text files into llm.c token shards (train_*.bin, val_*.bin) for
    /// data.source = "tokens"; prints the [data] keys that read them.
    Tokenize(commands::TokenizeArgs),
    /// List the runs under a runs directory: keys that differ, status, final and best metrics.
    Ls {
        /// The runs directory to list (every run and sweep under it).
        #[arg(default_value = "runs")]
        runs_dir: PathBuf,
        #[command(flatten)]
        shown: Shown,
    },
    /// Compare runs side by side; each argument is a run, a sweep, or a directory of runs.
    Compare {
        /// Run directories, sweep directories, or directories of runs.
        #[arg(required = true, value_name = "RUN_OR_SWEEP")]
        runs: Vec<PathBuf>,
        #[command(flatten)]
        shown: Shown,
    },
    /// Plot learning curves of runs (train and evaluation splits) to a PNG or SVG file.
    Plot {
        /// Run directories, sweep directories, or directories of runs.
        #[arg(required = true, value_name = "RUN_OR_SWEEP")]
        runs: Vec<PathBuf>,
        /// Metrics, one panel each: a column for every split (loss, accuracy, lr, grad_norm)
        /// or one split's (val_accuracy). Default: loss, and accuracy when there is one.
        #[arg(long, value_delimiter = ',', value_name = "METRIC,...")]
        metric: Vec<String>,
        #[arg(long, value_enum, default_value = "step")]
        x: XAxis,
        /// The image; .png or .svg.
        #[arg(long, short, default_value = "curves.png")]
        output: PathBuf,
    },
    /// Print a shell completion script, e.g. `trainer completions bash > ~/.local/share/bash-completion/completions/trainer`.
    Completions { shell: clap_complete::Shell },
    /// Print the job file's JSON Schema (schemas/job.schema.json).
    Schema,
    /// List the devices this machine can train on.
    Devices,
}

/// What `ls` and `compare` show.
#[derive(clap::Args)]
struct Shown {
    /// table for people (one table per job, cut to the terminal's width); csv, json and
    /// markdown for tools and reports.
    #[arg(long, value_enum, default_value = "table")]
    format: Format,
    /// Only these columns after `run`, in this order.
    #[arg(long, value_delimiter = ',', value_name = "COLUMN,...")]
    columns: Vec<String>,
    /// Order the runs by a column; -COLUMN for descending (--sort=-val_accuracy).
    #[arg(long, value_name = "COLUMN", allow_hyphen_values = true)]
    sort: Option<String>,
    /// Only runs whose KEY (a config key, status, end_reason, job, or a metric column) has
    /// VALUE. Repeatable.
    #[arg(long, value_name = "KEY=VALUE")]
    filter: Vec<String>,
}

impl Shown {
    fn options(self) -> results::ListOptions {
        results::ListOptions {
            format: self.format,
            columns: self.columns,
            sort: self.sort,
            filters: self.filter,
        }
    }
}

/// Tells the other ranks of a multi-process run (RANK and WORLD_SIZE set) why this one
/// stopped before it could join them, as `trainer run` does for a bad job.
fn tell_waiting_ranks(usage_error: &str) {
    use trainer::train::parallel::{tell_stopped, Rendezvous};
    if let Some(Ok(world)) = Rendezvous::from_env(|k| std::env::var(k).ok()) {
        let first_line = usage_error.lines().next().unwrap_or_default();
        let why = first_line.trim_start_matches("error: ");
        tell_stopped(
            &world,
            &trainer::error::Error::Job(format!("a bad command line: {why}")),
        );
    }
}

fn main() -> ExitCode {
    trainer::process_start();
    trainer::signals::report_file_size_limit_as_error();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            // A rank of a multi-process run with a bad command line: the others would wait
            // for it until their timeout.
            if e.use_stderr() {
                tell_waiting_ranks(&e.to_string());
            }
            std::process::exit(e.exit_code());
        }
    };
    let quiet = matches!(
        cli.command,
        Command::Run { quiet: true, .. }
            | Command::Sweep { quiet: true, .. }
            | Command::Profile(commands::ProfileArgs { quiet: true, .. })
    );
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
            run_dir,
            quiet,
            profile_steps,
        } => {
            let job_given = job.is_some();
            commands::job_of(job, resume.as_deref()).and_then(|job| {
                commands::run(&commands::RunArgs {
                    job,
                    job_given,
                    sets,
                    name,
                    runs_dir,
                    resume,
                    resume_fallback,
                    force,
                    dir: run_dir,
                    quiet,
                    print_run_dir: true,
                    profile: profile_steps,
                })
            })
        }
        // The report is printed even for a job too large for this machine, or whose GPU this
        // machine cannot open: run's refusal (exit 1, or 2) follows it.
        Command::Check { job, sets, explain } => commands::check(&job, &sets).and_then(|checked| {
            // Quietly: loading the job again would repeat check's warnings.
            let quiet = tracing::subscriber::NoSubscriber::default();
            match explain {
                true => print_out(&tracing::subscriber::with_default(quiet, || {
                    trainer::spec::explain(&job, &sets)
                })?)?,
                false => print_out(&checked.report)?,
            }
            checked.runnable_here
        }),
        Command::Sweep {
            job,
            grid,
            zip,
            sets,
            name,
            runs_dir,
            sweep_id,
            retry_failed,
            devices,
            quiet,
        } => sweep::sweep(&SweepArgs {
            job,
            sets,
            grid,
            zip,
            name,
            runs_dir,
            sweep_id,
            retry_failed,
            devices,
            quiet,
        }),
        Command::Eval(args) => {
            commands::evaluate(&args).and_then(|e| print_out(&commands::report(&e)))
        }
        Command::Predict(args) => commands::predict(&args).and_then(|rows| {
            print_out(&format!("{}: {rows} predictions\n", args.output.display()))
        }),
        Command::Sample(args) => commands::sample(&args),
        Command::Export(args) => {
            commands::export(&args).and_then(|dir| print_out(&format!("{}\n", dir.display())))
        }
        Command::Tokenize(args) => {
            commands::tokenize(&args).and_then(|t| print_out(&t.report(&args.output)))
        }
        Command::Profile(args) => commands::profile(&args),
        Command::Ls { runs_dir, shown } => {
            results::list(&[runs_dir], &shown.options()).and_then(|t| print_out(&t))
        }
        Command::Compare { runs, shown } => {
            results::list(&runs, &shown.options()).and_then(|t| print_out(&t))
        }
        Command::Plot {
            runs,
            metric,
            x,
            output,
        } => results::load_runs(&runs)
            .and_then(|r| results::plot::plot(&r, &metric, x, &output))
            .and_then(|()| print_out(&format!("{}\n", output.display()))),
        Command::Completions { shell } => {
            // Into memory first: clap_complete panics on a failed write (a closed stdout).
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "trainer", &mut script);
            print_out(&String::from_utf8_lossy(&script))
        }
        Command::Schema => print_out(&trainer::spec::json_schema()),
        Command::Devices => print_out(&commands::devices()),
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

/// Writes a command's output to stdout. A reader that has gone (`trainer ls | head`) is no
/// failure: Rust ignores SIGPIPE, so `print!` would panic there instead.
fn print_out(text: &str) -> trainer::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(trainer::runtime_err!("cannot write to stdout: {e}"))
        }
        _ => Ok(()),
    }
}
