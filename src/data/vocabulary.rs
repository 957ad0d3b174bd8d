//! How text becomes token ids and back, for the text data source and for writing samples.
//! GPT-2's encoding comes from tiktoken-rs, whose tables are built into the binary.

use crate::spec::Tokenizer;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

/// How text becomes token ids and back; saved with a run (preprocess.json), so that
/// `trainer sample` writes with the vocabulary training read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Vocabulary {
    pub tokenizer: Tokenizer,
    /// char: the characters by id (sorted). Empty for bytes and gpt2.
    #[serde(default)]
    pub chars: String,
}

/// GPT-2's vocabulary: 50,000 merges, 256 bytes and `<|endoftext|>`.
pub const GPT2_VOCABULARY: usize = 50_257;

impl Vocabulary {
    /// The vocabulary of `text` (char: its characters; bytes and gpt2: their fixed ones).
    pub fn of(tokenizer: Tokenizer, text: &str) -> Vocabulary {
        let chars = match tokenizer {
            Tokenizer::Char => text
                .chars()
                .collect::<BTreeSet<char>>()
                .into_iter()
                .collect(),
            Tokenizer::Bytes | Tokenizer::Gpt2 => String::new(),
        };
        Vocabulary { tokenizer, chars }
    }

    /// The number of token ids.
    pub fn len(&self) -> usize {
        match self.tokenizer {
            Tokenizer::Char => self.chars.chars().count(),
            Tokenizer::Bytes => 256,
            Tokenizer::Gpt2 => GPT2_VOCABULARY,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The token ids of `text`; Err names the first character not in the vocabulary.
    pub fn encode(&self, text: &str) -> std::result::Result<Vec<u32>, char> {
        match self.tokenizer {
            Tokenizer::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Tokenizer::Gpt2 => Ok(tiktoken_rs::r50k_base_singleton().encode_ordinary(text)),
            Tokenizer::Char => {
                let chars: Vec<char> = self.chars.chars().collect();
                text.chars()
                    .map(|c| chars.binary_search(&c).map(|i| i as u32).map_err(|_| c))
                    .collect()
            }
        }
    }

    /// The text of token ids (bytes that are not UTF-8 are replaced, as Python's
    /// errors="replace"); ids past the vocabulary write nothing.
    pub fn decode(&self, ids: &[u32]) -> String {
        match self.tokenizer {
            Tokenizer::Bytes => {
                let bytes: Vec<u8> = ids.iter().map(|&i| i as u8).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            }
            Tokenizer::Gpt2 => {
                let known: Vec<u32> = ids
                    .iter()
                    .copied()
                    .filter(|&i| (i as usize) < GPT2_VOCABULARY)
                    .collect();
                let bytes = tiktoken_rs::r50k_base_singleton()
                    .decode_bytes(&known)
                    .unwrap_or_default();
                String::from_utf8_lossy(&bytes).into_owned()
            }
            Tokenizer::Char => {
                let chars: Vec<char> = self.chars.chars().collect();
                ids.iter().filter_map(|&i| chars.get(i as usize)).collect()
            }
        }
    }
}
