//! Text for language models: a UTF-8 file (plain or gzip) as token ids, one per character,
//! per byte or per GPT-2 token. A sample is a window of block_size tokens; its targets are the tokens one
//! position on. Training windows start at every token (nanoGPT draws random offsets; an
//! epoch here visits each offset once, in a seeded order). Validation is the text's last
//! `val_fraction`, in windows a block apart.

use super::vocabulary::Vocabulary;
use super::{sources, Data, Dataset, Origin, Preprocess, TokenIds};
use crate::error::{Error, Result};
use crate::spec::{DataSource, DataSpec, Tokenizer};

/// The text of `spec.path` as a data set: token ids, split into training and validation.
pub fn load(spec: &DataSpec) -> Result<Data> {
    let (Some(path), Some(block)) = (&spec.path, spec.block_size) else {
        return Err(Error::Job(
            "source = \"text\" needs data.path and data.block_size".into(),
        ));
    };
    let name = path.display().to_string();
    let bytes = sources::read_bytes(path)?;
    let tokenizer = spec.tokenizer();
    let (vocabulary, ids) = match tokenizer {
        Tokenizer::Bytes => (
            Vocabulary::of(tokenizer, ""),
            bytes.iter().map(|&b| u32::from(b)).collect::<Vec<u32>>(),
        ),
        Tokenizer::Char | Tokenizer::Gpt2 => {
            let text = std::str::from_utf8(&bytes).map_err(|e| {
                Error::Job(format!(
                    "{name}: not UTF-8 text: byte {} starts no character (data.tokenizer = \
                     \"bytes\" reads any file)",
                    e.valid_up_to()
                ))
            })?;
            let vocabulary = Vocabulary::of(tokenizer, text);
            let ids = vocabulary
                .encode(text)
                .expect("every character is in its own vocabulary");
            (vocabulary, ids)
        }
    };
    if ids.is_empty() {
        return Err(Error::Job(format!("{name}: the file is empty")));
    }
    let splits = Splits::at_end(&name, "text", TokenIds::Held(ids), spec.val_fraction);
    let classes = classes(spec, &vocabulary)?;
    windows(splits, block, classes, DataSource::Text, Some(vocabulary))
}

/// The model's classes: the vocabulary's size, or `data.classes` where that pads it (GPT-2's
/// 50,257 tokens to 50,304, a multiple of 64, as llm.c and nanoGPT do).
pub(super) fn classes(spec: &DataSpec, vocabulary: &Vocabulary) -> Result<usize> {
    match spec.classes {
        Some(c) if c < vocabulary.len() => Err(Error::Job(format!(
            "data.classes = {c} is smaller than the vocabulary of data.tokenizer = \"{}\", {} \
             tokens; it may only pad the vocabulary",
            vocabulary.tokenizer.name(),
            vocabulary.len()
        ))),
        Some(c) => Ok(c),
        None => Ok(vocabulary.len()),
    }
}

/// A language model's token ids: the training split's and the validation split's (empty
/// for none), each with the words that name it in an error.
pub(super) struct Splits {
    pub origin: Origin,
    pub train: (String, TokenIds),
    pub val: (String, TokenIds),
}

impl Splits {
    /// The last `fraction` of `ids` validates, the rest trains; `what` is "text" or
    /// "tokens", for errors.
    pub fn at_end(name: &str, what: &str, mut ids: TokenIds, fraction: f64) -> Self {
        let val_len = (ids.len() as f64 * fraction).round() as usize;
        let val = ids.split_off_end(val_len);
        Splits {
            origin: Origin::file(name, None),
            train: (format!("{name}: the training {what}"), ids),
            val: (
                format!("{name}: the validation {what} (data.val_fraction = {fraction})"),
                val,
            ),
        }
    }
}

/// Token ids as samples: windows of `block` tokens whose targets are the next tokens. The
/// training windows start at every token; the validation windows a block apart.
pub(super) fn windows(
    splits: Splits,
    block: usize,
    classes: usize,
    source: DataSource,
    vocabulary: Option<Vocabulary>,
) -> Result<Data> {
    let short = |what: &str, len: usize| {
        Error::Job(format!(
            "{what} holds {len} tokens, fewer than data.block_size + 1 = {}: a sample is \
             block_size tokens and the token after them",
            block + 1
        ))
    };
    let Splits {
        origin,
        train: (train_what, train),
        val: (val_what, val),
    } = splits;
    if train.len() < block + 1 {
        return Err(short(&train_what, train.len()));
    }
    if !val.is_empty() && val.len() < block + 1 {
        return Err(short(&val_what, val.len()));
    }
    let val_len = val.len();
    let val = Dataset {
        tokens: val,
        origin: origin.clone(),
        ..Dataset::default()
    }
    .a_block_apart(block);
    let train = Dataset {
        len: train.len() - block,
        tokens: train,
        origin,
        windows: Some(1),
        ..Dataset::default()
    };
    let preprocess = preprocess(source, block, classes, vocabulary);
    let eval = if val_len > 0 {
        vec![("val", val)]
    } else {
        Vec::new()
    };
    Ok(Data {
        sample_shape: vec![block],
        classes: Some(classes),
        classes_from: None,
        target_dim: block,
        train,
        eval,
        preprocess,
    })
}

/// A language model's preprocess.json: windows of `block` tokens, `classes` logits each.
fn preprocess(
    source: DataSource,
    block: usize,
    classes: usize,
    vocabulary: Option<Vocabulary>,
) -> Preprocess {
    Preprocess {
        source,
        vocabulary,
        ..Preprocess::identity(vec![block], Some(classes), block)
    }
}

/// The preprocess.json of a language model whose vocabulary the job fixes (the gpt2 and
/// bytes tokenizers), without reading its data: what `trainer sample` needs from a job. None
/// where the vocabulary comes from the data (char, or token files without a tokenizer).
pub fn fixed_preprocess(spec: &DataSpec) -> Option<Preprocess> {
    let tokenizer = match spec.source {
        DataSource::Text => spec.tokenizer(),
        DataSource::Tokens => spec.tokenizer?,
        _ => return None,
    };
    if tokenizer == Tokenizer::Char {
        return None;
    }
    let vocabulary = Vocabulary::of(tokenizer, "");
    let classes = classes(spec, &vocabulary).ok()?;
    Some(preprocess(
        spec.source,
        spec.block_size?,
        classes,
        Some(vocabulary),
    ))
}
