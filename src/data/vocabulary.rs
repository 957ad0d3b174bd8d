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

thread_local! {
    /// GPT-2's encoder, one a thread: threads sharing tiktoken-rs's singleton queue for its
    /// regex's scratch space (two threads took up to twice the time of one, measured in
    /// `trainer tokenize`).
    static GPT2: tiktoken_rs::CoreBPE =
        tiktoken_rs::r50k_base().expect("tiktoken-rs's built-in GPT-2 tables load");
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
            Tokenizer::Gpt2 => Ok(GPT2.with(|bpe| bpe.encode_ordinary(text))),
            Tokenizer::Char => {
                let chars: Vec<char> = self.chars.chars().collect();
                text.chars()
                    .map(|c| chars.binary_search(&c).map(|i| i as u32).map_err(|_| c))
                    .collect()
            }
        }
    }

    /// The bytes of one token id; an id past the vocabulary has none.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        match self.tokenizer {
            Tokenizer::Bytes => vec![id as u8],
            Tokenizer::Gpt2 if (id as usize) < GPT2_VOCABULARY => {
                GPT2.with(|bpe| bpe.decode_bytes(&[id])).unwrap_or_default()
            }
            Tokenizer::Gpt2 => Vec::new(),
            Tokenizer::Char => match self.chars.chars().nth(id as usize) {
                Some(c) => c.to_string().into_bytes(),
                None => Vec::new(),
            },
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
                let bytes = GPT2
                    .with(|bpe| bpe.decode_bytes(&known))
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

/// Text from token bytes as they come, the same as decoding them all at once: a character
/// cut between two tokens waits for its end, and bytes that cannot be UTF-8 are replaced.
#[derive(Debug, Default)]
pub struct TextStream {
    /// The start of a character whose end has not come yet.
    pending: Vec<u8>,
}

impl TextStream {
    /// The text that `bytes`, after those before, complete.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut text = String::new();
        loop {
            let error = match std::str::from_utf8(&self.pending) {
                Ok(valid) => {
                    text.push_str(valid);
                    self.pending.clear();
                    return text;
                }
                Err(e) => e,
            };
            let (valid, rest) = self.pending.split_at(error.valid_up_to());
            text.push_str(std::str::from_utf8(valid).expect("checked up to here"));
            match error.error_len() {
                Some(invalid) => {
                    text.push(char::REPLACEMENT_CHARACTER);
                    self.pending = rest[invalid..].to_vec();
                }
                // Cut short: the rest of the character may come with the next token.
                None => {
                    self.pending = rest.to_vec();
                    return text;
                }
            }
        }
    }

    /// What is left: a character cut short at the end is replaced.
    pub fn finish(self) -> String {
        String::from_utf8_lossy(&self.pending).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Token by token, the stream writes what `decode` writes for all the ids at once.
    fn streamed(v: &Vocabulary, ids: &[u32]) -> String {
        let mut stream = TextStream::default();
        let mut text: String = ids
            .iter()
            .map(|&id| stream.push(&v.token_bytes(id)))
            .collect();
        text += &stream.finish();
        text
    }

    #[test]
    fn a_stream_of_tokens_writes_what_decoding_them_all_writes() {
        let gpt2 = Vocabulary::of(Tokenizer::Gpt2, "");
        let ids = gpt2.encode("héllo 世界 🎉 naïve").unwrap();
        assert_eq!(streamed(&gpt2, &ids), gpt2.decode(&ids));
        assert_eq!(streamed(&gpt2, &ids), "héllo 世界 🎉 naïve");
        let bytes = Vocabulary::of(Tokenizer::Bytes, "");
        // Bytes that are not UTF-8: a lone continuation byte, a cut character, a bad lead.
        let ids = [
            104, 0x80, 0xe4, 0xb8, 105, 0xff, 0xf0, 0x9f, 0x8e, 0x89, 0xe4,
        ];
        assert_eq!(streamed(&bytes, &ids), bytes.decode(&ids));
        let chars = Vocabulary::of(Tokenizer::Char, "ab€");
        assert_eq!(streamed(&chars, &[2, 0, 1, 9]), chars.decode(&[2, 0, 1, 9]));
    }
}
