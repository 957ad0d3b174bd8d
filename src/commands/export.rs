//! `trainer export`: a GPT's weights as Hugging Face's GPT-2, or a Llama's as its Llama, for
//! transformers' `from_pretrained` and the tools built on it.

use super::evaluate::Trained;
use super::*;
use crate::checkpoint::{hugging_face, llama};
use crate::spec::StateDictNames;

/// `trainer export`'s arguments.
#[derive(clap::Args)]
pub struct ExportArgs {
    /// The run directory of a GPT named as nanoGPT's, or of a Llama named as
    /// jobs/llama_char.toml's (or a job file with model.init_from).
    pub run: PathBuf,
    /// The directory to write model.safetensors and config.json in. It is created; one that
    /// already holds a model.safetensors is refused.
    pub output: PathBuf,
    /// A training checkpoint of the run instead of its final weights: a file, `last` for
    /// the newest, or `best` for the one its checkpoint.keep_best keeps.
    #[arg(long, value_name = "FILE")]
    pub checkpoint: Option<PathBuf>,
}

/// The model families export writes.
enum Family {
    Gpt2(hugging_face::Gpt2),
    Llama(llama::Llama),
}

/// Writes the run's model into `args.output`; returns that directory.
pub fn export(args: &ExportArgs) -> Result<PathBuf> {
    let trained = Trained::load(&args.run, args.checkpoint.as_deref())?;
    let graph = &trained.graph;
    // nanoGPT's names mark a GPT; any other model is read as a Llama.
    let family = match graph.names {
        StateDictNames::Nanogpt => hugging_face::gpt2_of(graph)
            .map(Family::Gpt2)
            .map_err(|why| format!("as Hugging Face's GPT-2: {why}")),
        _ => llama::llama_of(graph).map(Family::Llama).map_err(|why| {
            format!(
                "as Hugging Face's Llama: {why}. A GPT is written as GPT-2 when its tensors \
                 are named as nanoGPT's (model.state_dict_names = \"nanogpt\")"
            )
        }),
    };
    let family = family.map_err(|why| {
        Error::Job(format!(
            "{}: its model cannot be written {why}",
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
    let (dir, params) = (&args.output, &trained.params);
    match family {
        Family::Gpt2(gpt2) => hugging_face::write(dir, &gpt2, graph, params),
        Family::Llama(described) => llama::write(dir, &described, graph, params),
    }
    .map_err(|why| crate::runtime_err!("{why}"))?;
    Ok(args.output.clone())
}
