//! `trainer tokenize`: text files into llm.c token shards, once, as nanoGPT's prepare.py and
//! llm.c's dev/data scripts do. A run then reads the shards where they lie
//! (`data.source = "tokens"`) instead of tokenizing its text at every start.

use super::*;
use crate::data::vocabulary::Vocabulary;
use crate::spec::Tokenizer;
use rayon::prelude::*;

/// GPT-2's `<|endoftext|>`: llm.c's fineweb.py puts it before each document.
const END_OF_TEXT: u16 = 50_256;

/// `trainer tokenize`'s arguments.
#[derive(clap::Args)]
pub struct TokenizeArgs {
    /// Text files (UTF-8, plain or gzip), each one document, in the order given.
    #[arg(required = true, value_name = "TEXT")]
    pub inputs: Vec<PathBuf>,
    /// The folder for the shards; created if missing. Shards already there are never
    /// overwritten.
    #[arg(long, short, value_name = "DIR")]
    pub output: PathBuf,
    /// gpt2: GPT-2's byte-pair encoding, with <|endoftext|> before each document (llm.c's
    /// fineweb.py). bytes: one id per byte.
    #[arg(long, default_value = "gpt2")]
    pub tokenizer: String,
    /// Tokens a shard holds at most (llm.c's shards hold 100M).
    #[arg(long, default_value_t = 100_000_000)]
    pub shard_tokens: usize,
    /// The share of the tokens, from the end, written as validation shards (as
    /// data.val_fraction splits a text); 0 writes none.
    #[arg(long, default_value_t = 0.1)]
    pub val_fraction: f64,
}

/// What `trainer tokenize` wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct Tokenized {
    pub train: crate::data::Shards,
    pub val: crate::data::Shards,
    pub tokenizer: Tokenizer,
}

impl Tokenized {
    /// What it wrote, and the `[data]` keys that train on it.
    pub fn report(&self, dir: &Path) -> String {
        let shards = |s: &crate::data::Shards, what: &str| {
            let n = s.paths.len();
            let plural = if n == 1 { "" } else { "s" };
            format!("{n} {what} shard{plural} ({} tokens)", s.tokens)
        };
        let mut out = format!(
            "wrote {} and {} in {}\n[data]\nsource = \"tokens\"\npath = \"{}/train_*.bin\"\n",
            shards(&self.train, "train"),
            shards(&self.val, "validation"),
            dir.display(),
            dir.display()
        );
        if !self.val.paths.is_empty() {
            out += &format!("val_path = \"{}/val_*.bin\"\n", dir.display());
        }
        out + &format!("tokenizer = \"{}\"\n", self.tokenizer.name())
    }
}

/// Tokenizes `args.inputs` and writes their shards into `args.output`.
pub fn tokenize(args: &TokenizeArgs) -> Result<Tokenized> {
    let tokenizer = tokenizer_named(&args.tokenizer)?;
    if !(0.0..1.0).contains(&args.val_fraction) {
        return Err(Error::Job(format!(
            "--val-fraction {}: must be at least 0 and below 1",
            args.val_fraction
        )));
    }
    if args.shard_tokens == 0 || args.shard_tokens > i32::MAX as usize {
        return Err(Error::Job(format!(
            "--shard-tokens {}: must be from 1 to {} (llm.c's header holds the count as int32)",
            args.shard_tokens,
            i32::MAX
        )));
    }
    refuse_existing_shards(&args.output)?;
    let vocabulary = Vocabulary::of(tokenizer, "");
    // Each file on a thread of its own; the documents stay in the order given. Both
    // vocabularies fit in 16 bits (50,257 and 256 ids).
    let documents = (args.inputs.par_iter())
        .map(|path| {
            let text = crate::data::read_text(path)?;
            let ids: Vec<u16> = (vocabulary.encode(&text))
                .expect("gpt2 and bytes take any text")
                .into_iter()
                .map(|id| id as u16)
                .collect();
            tracing::info!("{}: {} tokens", path.display(), ids.len());
            Ok(ids)
        })
        .collect::<Result<Vec<Vec<u16>>>>()?;
    let mut ids: Vec<u16> = Vec::with_capacity(documents.iter().map(|d| d.len() + 1).sum());
    for document in documents {
        if tokenizer == Tokenizer::Gpt2 {
            ids.push(END_OF_TEXT);
        }
        ids.extend(document);
    }
    let val_len = (ids.len() as f64 * args.val_fraction).round() as usize;
    if ids.len() - val_len < 2 || (args.val_fraction > 0.0 && val_len < 2) {
        return Err(Error::Job(format!(
            "{} tokens in all: too few to split by --val-fraction {} into train and validation",
            ids.len(),
            args.val_fraction
        )));
    }
    std::fs::create_dir_all(&args.output)
        .map_err(|e| Error::Runtime(format!("cannot create {}: {e}", args.output.display())))?;
    let (train, val) = ids.split_at(ids.len() - val_len);
    let write =
        |prefix, ids| crate::data::write_shards(&args.output, prefix, ids, args.shard_tokens);
    Ok(Tokenized {
        train: write("train", train)?,
        val: write("val", val)?,
        tokenizer,
    })
}

/// The tokenizer `--tokenizer` names: one whose vocabulary token files can stand for.
fn tokenizer_named(name: &str) -> Result<Tokenizer> {
    match name {
        "gpt2" => Ok(Tokenizer::Gpt2),
        "bytes" => Ok(Tokenizer::Bytes),
        "char" => Err(Error::Job(
            "--tokenizer char: a char vocabulary is the text's own characters, which token \
             files do not record; train on the text itself (data.source = \"text\")"
                .into(),
        )),
        other => Err(Error::Job(format!(
            "--tokenizer {other}: not a tokenizer; allowed: gpt2, bytes"
        ))),
    }
}

/// Nothing is overwritten: a folder that holds shards already is refused.
fn refuse_existing_shards(dir: &Path) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    let taken = entries.flatten().map(|e| e.file_name()).find(|name| {
        let name = name.to_string_lossy();
        (name.starts_with("train_") || name.starts_with("val_")) && name.ends_with(".bin")
    });
    match taken {
        Some(name) => Err(Error::Job(format!(
            "{}: holds {} already; tokenize never overwrites shards: give another folder",
            dir.display(),
            name.to_string_lossy()
        ))),
        None => Ok(()),
    }
}
