//! Which tensor of a weights file fills each of the model's tensors, and how its values change
//! on the way. Most files hold the model's own names and layouts. Two others are read as
//! nanoGPT reads them (its `from_pretrained` and `crop_block_size`), for models with
//! `state_dict_names = "nanogpt"`:
//!
//! - A Hugging Face GPT-2 file: transformers' `save_pretrained` of GPT2LMHeadModel, or the
//!   hub's openai-community/gpt2 `model.safetensors`.
//!   - Its attention and MLP matrices are Conv1D's, [in, out]: they are transposed to
//!     nn.Linear's [out, in].
//!   - Its names may lack the `transformer.` prefix.
//!   - Its attention masks (`attn.bias`, `attn.masked_bias`) are buffers, not weights: skipped.
//!   - Without `lm_head.weight` (GPT2LMHeadModel ties it), the output matrix is the token
//!     embedding's.
//! - A position table longer than the model's block: its first rows are read.

use crate::graph::StateDictEntry;
use crate::spec::StateDictNames;
use std::collections::BTreeMap;

/// How a model tensor's values come out of the file's tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// As they are.
    None,
    /// A Conv1D matrix, [in, out], transposed to nn.Linear's [out, in].
    Transpose,
    /// The first rows of a longer table: positions past the model's block are dropped.
    FirstRows,
}

/// The file's tensor that fills one of the model's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    pub name: String,
    pub change: Change,
}

/// Where each of the model's tensors comes from, by the model's name.
#[derive(Debug, Default)]
pub struct Mapping {
    pub sources: BTreeMap<String, Source>,
    /// The file's tensors that fill nothing, on purpose: attention masks.
    pub skipped: Vec<String>,
    /// Whether the file is a Hugging Face GPT-2 checkpoint.
    pub hugging_face: bool,
}

const LM_HEAD: &str = "lm_head.weight";

/// The Conv1D layers of GPT-2, as nanoGPT's `from_pretrained` lists them.
pub const CONV1D: [&str; 4] = [
    "attn.c_attn.weight",
    "attn.c_proj.weight",
    "mlp.c_fc.weight",
    "mlp.c_proj.weight",
];

impl Mapping {
    /// How the file's tensors (`file`: name → shape) fill `model`'s, named as `names` says.
    pub fn new(
        file: &BTreeMap<String, Vec<usize>>,
        model: &[StateDictEntry],
        names: StateDictNames,
    ) -> Mapping {
        let mut mapping = Mapping::default();
        if names != StateDictNames::Nanogpt {
            for name in file.keys() {
                mapping.read(name, name, Change::None);
            }
            return mapping;
        }
        let needed = |name: &str| model.iter().find(|e| e.name == name).map(|e| &e.shape);
        mapping.hugging_face = file.iter().any(|(name, shape)| is_conv1d_qkv(name, shape));
        for (name, shape) in file {
            let ours = match mapping.hugging_face {
                true if is_attention_mask(name, shape) => {
                    mapping.skipped.push(name.clone());
                    continue;
                }
                true if name.starts_with("transformer.") || name == LM_HEAD => name.clone(),
                true => format!("transformer.{name}"),
                false => name.clone(),
            };
            let conv1d = mapping.hugging_face && CONV1D.iter().any(|c| ours.ends_with(c));
            let change = match needed(&ours) {
                _ if conv1d && shape.len() == 2 => Change::Transpose,
                Some(want) if ours == "transformer.wpe.weight" && is_longer(shape, want) => {
                    Change::FirstRows
                }
                _ => Change::None,
            };
            mapping.read(&ours, name, change);
        }
        // GPT2LMHeadModel's output matrix is the token embedding's, and its files leave it out.
        let wte = mapping.sources.get("transformer.wte.weight").cloned();
        if let (true, Some(wte), Some(_)) = (mapping.hugging_face, wte, needed(LM_HEAD)) {
            mapping.sources.entry(LM_HEAD.into()).or_insert(wte);
        }
        mapping
    }

    fn read(&mut self, ours: &str, theirs: &str, change: Change) {
        let source = Source {
            name: theirs.to_string(),
            change,
        };
        self.sources.insert(ours.to_string(), source);
    }

    /// The shape a file tensor of shape `theirs` gives the model's tensor, which needs `want`.
    pub fn shape_after(change: Change, theirs: &[usize], want: &[usize]) -> Vec<usize> {
        match change {
            Change::None => theirs.to_vec(),
            Change::Transpose => theirs.iter().rev().copied().collect(),
            Change::FirstRows => [&want[..1], &theirs[1..]].concat(),
        }
    }

    /// The model tensor's values from the file's, `theirs` of shape `shape`, of which the model
    /// needs `len` values.
    pub fn values_after(change: Change, theirs: Vec<f32>, shape: &[usize], len: usize) -> Vec<f32> {
        match change {
            Change::None => theirs,
            Change::Transpose => {
                let (rows, cols) = (shape[0], shape[1]);
                let mut out = vec![0.0; theirs.len()];
                for (r, row) in theirs.chunks_exact(cols).enumerate() {
                    for (c, &v) in row.iter().enumerate() {
                        out[c * rows + r] = v;
                    }
                }
                out
            }
            Change::FirstRows => {
                let mut out = theirs;
                out.truncate(len);
                out
            }
        }
    }
}

/// GPT-2's fused query, key and value matrix as Conv1D holds it: [C, 3C]. nn.Linear's is
/// [3C, C], so the shape tells the layouts apart.
fn is_conv1d_qkv(name: &str, shape: &[usize]) -> bool {
    name.ends_with("attn.c_attn.weight") && matches!(shape, [c, three_c] if *three_c == 3 * c)
}

/// GPT-2's causal mask, a [1, 1, positions, positions] buffer named like a bias.
fn is_attention_mask(name: &str, shape: &[usize]) -> bool {
    (name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias")) && shape.len() != 1
}

/// Whether a table of shape `theirs` holds more rows of the same width than `want`.
fn is_longer(theirs: &[usize], want: &[usize]) -> bool {
    match (theirs, want) {
        ([rows, width], [want_rows, want_width]) => rows > want_rows && width == want_width,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, shape: &[usize]) -> StateDictEntry {
        StateDictEntry {
            name: name.into(),
            shape: shape.to_vec(),
            offset: 0,
        }
    }

    fn shapes(list: &[(&str, &[usize])]) -> BTreeMap<String, Vec<usize>> {
        list.iter()
            .map(|(n, s)| (n.to_string(), s.to_vec()))
            .collect()
    }

    fn model() -> Vec<StateDictEntry> {
        vec![
            entry("transformer.wte.weight", &[10, 4]),
            entry("transformer.wpe.weight", &[8, 4]),
            entry("transformer.h.0.attn.c_attn.weight", &[12, 4]),
            entry("transformer.h.0.attn.c_attn.bias", &[12]),
            entry("transformer.h.0.attn.c_proj.weight", &[4, 4]),
            entry("lm_head.weight", &[10, 4]),
        ]
    }

    #[test]
    fn the_hubs_gpt2_file_is_renamed_transposed_and_cropped() {
        let file = shapes(&[
            ("wte.weight", &[10, 4]),
            ("wpe.weight", &[16, 4]),
            ("h.0.attn.bias", &[1, 1, 16, 16]),
            ("h.0.attn.c_attn.weight", &[4, 12]),
            ("h.0.attn.c_attn.bias", &[12]),
            ("h.0.attn.c_proj.weight", &[4, 4]),
            ("lm_head.weight", &[10, 4]),
        ]);
        let m = Mapping::new(&file, &model(), StateDictNames::Nanogpt);
        assert!(m.hugging_face);
        assert_eq!(m.skipped, ["h.0.attn.bias"]);
        assert_eq!(m.sources["lm_head.weight"].name, "lm_head.weight");
        let change = |n: &str| m.sources[n].change;
        assert_eq!(
            change("transformer.h.0.attn.c_attn.weight"),
            Change::Transpose
        );
        assert_eq!(
            change("transformer.h.0.attn.c_proj.weight"),
            Change::Transpose
        );
        assert_eq!(change("transformer.h.0.attn.c_attn.bias"), Change::None);
        assert_eq!(change("transformer.wpe.weight"), Change::FirstRows);
        assert_eq!(m.sources["transformer.wte.weight"].name, "wte.weight");
        assert_eq!(m.sources.len(), 6);
    }

    #[test]
    fn without_lm_head_the_output_matrix_is_the_embeddings() {
        let file = shapes(&[
            ("transformer.wte.weight", &[10, 4]),
            ("transformer.h.0.attn.c_attn.weight", &[4, 12]),
        ]);
        let m = Mapping::new(&file, &model(), StateDictNames::Nanogpt);
        assert_eq!(m.sources["lm_head.weight"].name, "transformer.wte.weight");
    }

    #[test]
    fn nanogpts_own_layout_is_read_as_it_is() {
        let file = shapes(&[
            ("transformer.h.0.attn.c_attn.weight", &[12, 4]),
            ("transformer.h.0.attn.c_proj.weight", &[4, 4]),
            ("transformer.wpe.weight", &[8, 4]),
        ]);
        let m = Mapping::new(&file, &model(), StateDictNames::Nanogpt);
        assert!(!m.hugging_face);
        assert!(m.skipped.is_empty());
        assert!(m.sources.values().all(|s| s.change == Change::None));
        assert!(
            !m.sources.contains_key("lm_head.weight"),
            "a missing tensor is an error"
        );
    }

    #[test]
    fn sequential_names_are_never_changed() {
        let file = shapes(&[("transformer.h.0.attn.c_attn.weight", &[4, 12])]);
        let m = Mapping::new(&file, &model(), StateDictNames::Sequential);
        assert_eq!(m.sources.values().next().unwrap().change, Change::None);
    }

    #[test]
    fn values_are_transposed_and_cropped() {
        let t = Mapping::values_after(Change::Transpose, vec![1., 2., 3., 4., 5., 6.], &[2, 3], 6);
        assert_eq!(t, [1., 4., 2., 5., 3., 6.]);
        assert_eq!(
            Mapping::shape_after(Change::Transpose, &[2, 3], &[3, 2]),
            [3, 2]
        );
        let c = Mapping::values_after(Change::FirstRows, vec![1., 2., 3., 4.], &[4, 1], 2);
        assert_eq!(c, [1., 2.]);
        assert_eq!(
            Mapping::shape_after(Change::FirstRows, &[4, 1], &[2, 1]),
            [2, 1]
        );
    }
}
