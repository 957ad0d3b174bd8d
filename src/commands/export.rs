//! `trainer export`: a GPT's weights as Hugging Face's GPT-2, for transformers'
//! `GPT2LMHeadModel.from_pretrained` and the tools built on it.

use super::evaluate::Trained;
use super::*;
use crate::checkpoint::hugging_face;

/// `trainer export`'s arguments.
#[derive(clap::Args)]
pub struct ExportArgs {
    /// The run directory of a GPT named as nanoGPT's (or a job file with model.init_from).
    pub run: PathBuf,
    /// The directory to write model.safetensors and config.json in. It is created; one that
    /// already holds a model.safetensors is refused.
    pub output: PathBuf,
    /// A training checkpoint of the run instead of its final weights: a file, `last` for
    /// the newest, or `best` for the one its checkpoint.keep_best keeps.
    #[arg(long, value_name = "FILE")]
    pub checkpoint: Option<PathBuf>,
}

/// Writes the run's model into `args.output`; returns that directory.
pub fn export(args: &ExportArgs) -> Result<PathBuf> {
    let trained = Trained::load(&args.run, args.checkpoint.as_deref())?;
    let gpt2 = hugging_face::gpt2_of(&trained.graph).map_err(|why| {
        Error::Job(format!(
            "{}: its model cannot be written as Hugging Face's GPT-2: {why}",
            args.run.display()
        ))
    })?;
    let target = args.output.join(weights::MODEL_FILE);
    if target.exists() {
        return Err(Error::Job(format!(
            "{} exists: export never overwrites a model; give another directory",
            target.display()
        )));
    }
    hugging_face::write(&args.output, &gpt2, &trained.graph, &trained.params)
        .map_err(|why| crate::runtime_err!("{why}"))?;
    Ok(args.output.clone())
}
