//! How text becomes token ids and back, for the text data source and for writing samples.

use crate::spec::Tokenizer;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

/// How text becomes token ids and back; saved with a run (preprocess.json), so that
/// `trainer sample` writes with the vocabulary training read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Vocabulary {
    pub tokenizer: Tokenizer,
    /// char: the characters by id (sorted). Empty for bytes.
    #[serde(default)]
    pub chars: String,
}

impl Vocabulary {
    /// The vocabulary of `text` (char: its characters; bytes: all 256).
    pub fn of(tokenizer: Tokenizer, text: &str) -> Vocabulary {
        let chars = match tokenizer {
            Tokenizer::Char => text
                .chars()
                .collect::<BTreeSet<char>>()
                .into_iter()
                .collect(),
            Tokenizer::Bytes => String::new(),
        };
        Vocabulary { tokenizer, chars }
    }

    /// The number of token ids.
    pub fn len(&self) -> usize {
        match self.tokenizer {
            Tokenizer::Char => self.chars.chars().count(),
            Tokenizer::Bytes => 256,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The token ids of `text`; Err names the first character not in the vocabulary.
    pub fn encode(&self, text: &str) -> std::result::Result<Vec<u32>, char> {
        match self.tokenizer {
            Tokenizer::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Tokenizer::Char => {
                let chars: Vec<char> = self.chars.chars().collect();
                text.chars()
                    .map(|c| chars.binary_search(&c).map(|i| i as u32).map_err(|_| c))
                    .collect()
            }
        }
    }

    /// The text of token ids (bytes that are not UTF-8 are replaced, as Python's
    /// errors="replace").
    pub fn decode(&self, ids: &[u32]) -> String {
        match self.tokenizer {
            Tokenizer::Bytes => {
                let bytes: Vec<u8> = ids.iter().map(|&i| i as u8).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            }
            Tokenizer::Char => {
                let chars: Vec<char> = self.chars.chars().collect();
                ids.iter().filter_map(|&i| chars.get(i as usize)).collect()
            }
        }
    }
}
