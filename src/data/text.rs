//! Text for language models: a UTF-8 file (plain or gzip) as token ids, one per character or
//! per byte. A sample is a window of block_size tokens; its targets are the tokens one
//! position on. Training windows start at every token (nanoGPT draws random offsets; an
//! epoch here visits each offset once, in a seeded order). Validation is the text's last
//! `val_fraction`, in windows a block apart.

use super::vocabulary::Vocabulary;
use super::{sources, Data, Dataset, Origin, Preprocess};
use crate::error::{Error, Result};
use crate::spec::{DataSource, DataSpec, Normalize, Task, Tokenizer};

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
            bytes.iter().map(|&b| f32::from(b)).collect::<Vec<f32>>(),
        ),
        Tokenizer::Char => {
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
            (vocabulary, ids.into_iter().map(|i| i as f32).collect())
        }
    };
    if ids.is_empty() {
        return Err(Error::Job(format!("{name}: the file is empty")));
    }
    let total = ids.len();
    let val_len = (total as f64 * spec.val_fraction).round() as usize;
    let train_len = total - val_len;
    let short = |what: &str, len: usize| {
        Error::Job(format!(
            "{name}: {what} holds {len} tokens, fewer than data.block_size + 1 = {}: a sample is \
             block_size tokens and the token after them",
            block + 1
        ))
    };
    if train_len < block + 1 {
        return Err(short("the training text", train_len));
    }
    if val_len > 0 && val_len < block + 1 {
        return Err(short(
            &format!(
                "the validation text (data.val_fraction = {})",
                spec.val_fraction
            ),
            val_len,
        ));
    }
    let origin = Origin::file(&name, None);
    let val = Dataset {
        features: ids[train_len..].to_vec(),
        targets: Vec::new(),
        len: val_len.saturating_sub(1) / block,
        origin: origin.clone(),
        windows: Some(block),
    };
    let mut features = ids;
    features.truncate(train_len);
    let train = Dataset {
        features,
        targets: Vec::new(),
        len: train_len - block,
        origin,
        windows: Some(1),
    };
    let classes = vocabulary.len();
    let preprocess = Preprocess {
        format: super::preprocess::FORMAT.into(),
        source: DataSource::Text,
        sample_shape: vec![block],
        task: Task::Classification,
        classes: Some(classes),
        target_dim: block,
        feature_columns: None,
        label_column: None,
        class_names: None,
        normalize: Normalize::None,
        shift: Vec::new(),
        scale: Vec::new(),
        vocabulary: Some(vocabulary),
    };
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
