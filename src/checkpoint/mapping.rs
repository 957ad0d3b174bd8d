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
//!
//! A model built as jobs/llama_char.toml (its layer names) reads a Hugging Face Llama file,
//! transformers' `save_pretrained` of LlamaForCausalLM:
//!
//! - `model.layers.<i>.self_attn.q_proj.weight` is `layers<i>_self_attn_qkv_proj.weight`'s
//!   first rows; `k_proj`'s and `v_proj`'s rows follow, stacked. Qwen2's biases on them stack
//!   the same way into the fused projection's bias.
//! - The other names lose `model.` and write `_` for the dots inside a layer.
//! - Without `lm_head.weight` (`tie_word_embeddings`), the output matrix is the token
//!   embedding's.
//! - `rotary_emb.inv_freq` buffers, in older files, are skipped: the rotary layer computes
//!   its angles.

use super::llama;
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
    /// Several tensors' rows, one after another: Hugging Face Llama's q, k and v
    /// projections as the fused one.
    StackRows,
}

/// The file's tensors that fill one of the model's: one, or with `Change::StackRows`
/// several.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    pub names: Vec<String>,
    pub change: Change,
}

impl Source {
    /// The file's tensor, or the first of those stacked.
    pub fn name(&self) -> &str {
        &self.names[0]
    }

    /// The names, for messages: `a`, or `a`, `b` and `c` stacked.
    pub fn shown(&self) -> String {
        let quoted: Vec<String> = self.names.iter().map(|n| format!("`{n}`")).collect();
        match quoted.len() {
            1 => quoted[0].clone(),
            _ => format!("{} stacked", quoted.join(", ")),
        }
    }
}

/// Where each of the model's tensors comes from, by the model's name.
#[derive(Debug, Default)]
pub struct Mapping {
    pub sources: BTreeMap<String, Source>,
    /// The file's tensors that fill nothing, on purpose: attention masks.
    pub skipped: Vec<String>,
    /// Whether the file is a Hugging Face GPT-2 checkpoint.
    pub hugging_face: bool,
    /// Whether the file is a Hugging Face Llama checkpoint.
    pub hugging_face_llama: bool,
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
        if names != StateDictNames::Nanogpt && file.keys().any(|n| is_llama_qkv(n)) {
            return Mapping::llama(file, model);
        }
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

    /// A Hugging Face Llama file's tensors under the names of jobs/llama_char.toml's layers.
    fn llama(file: &BTreeMap<String, Vec<usize>>, model: &[StateDictEntry]) -> Mapping {
        let mut mapping = Mapping {
            hugging_face_llama: true,
            ..Mapping::default()
        };
        let mut fused: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for name in file.keys() {
            if name.ends_with("rotary_emb.inv_freq") {
                mapping.skipped.push(name.clone());
                continue;
            }
            match llama_name(name) {
                Some(LlamaName::Fused(ours)) => fused.entry(ours).or_default().push(name.clone()),
                Some(LlamaName::Own(ours)) => mapping.read(&ours, name, Change::None),
                // Not a Llama's: reported as unexpected.
                None => mapping.read(name, name, Change::None),
            }
        }
        for (ours, mut parts) in fused {
            // q_proj, k_proj, v_proj: the fused projection's order of rows.
            parts.sort_by_key(|p| ["q_proj", "k_proj", "v_proj"].map(|q| !p.contains(q)));
            match parts.len() {
                3 => {
                    let source = Source {
                        names: parts,
                        change: Change::StackRows,
                    };
                    mapping.sources.insert(ours, source);
                }
                // Without all three, the parts there are unexpected and the fused one missing.
                _ => parts.iter().for_each(|p| mapping.read(p, p, Change::None)),
            }
        }
        let needed = model.iter().any(|e| e.name == LM_HEAD);
        let embedding = mapping.sources.get("embed_tokens.weight").cloned();
        if let (true, Some(embedding)) = (needed, embedding) {
            mapping.sources.entry(LM_HEAD.into()).or_insert(embedding);
        }
        mapping
    }

    fn read(&mut self, ours: &str, theirs: &str, change: Change) {
        let source = Source {
            names: vec![theirs.to_string()],
            change,
        };
        self.sources.insert(ours.to_string(), source);
    }

    /// The shape `source`'s tensors (shapes in `shapes`) give the model's tensor, which needs
    /// `want`.
    pub fn shape_after(
        source: &Source,
        shapes: &BTreeMap<String, Vec<usize>>,
        want: &[usize],
    ) -> Vec<usize> {
        let theirs = &shapes[source.name()];
        match source.change {
            Change::None => theirs.to_vec(),
            Change::Transpose => theirs.iter().rev().copied().collect(),
            Change::FirstRows => [&want[..1], &theirs[1..]].concat(),
            Change::StackRows => {
                let all: Vec<&Vec<usize>> = source.names.iter().map(|n| &shapes[n]).collect();
                let rest = theirs.get(1..).unwrap_or_default();
                match all.iter().all(|s| !s.is_empty() && s[1..] == *rest) {
                    true => [&[all.iter().map(|s| s[0]).sum()][..], rest].concat(),
                    // Unequal widths stack into nothing the model has.
                    false => all.iter().flat_map(|s| s.iter().copied()).collect(),
                }
            }
        }
    }

    /// The model tensor's values from the file's, `theirs` of shape `shape` (stacked, for
    /// `StackRows`), of which the model needs `len` values.
    pub fn values_after(change: Change, theirs: Vec<f32>, shape: &[usize], len: usize) -> Vec<f32> {
        match change {
            Change::None | Change::StackRows => theirs,
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

/// A Hugging Face Llama name, as the model names it.
enum LlamaName {
    /// The model's tensor of the same values.
    Own(String),
    /// Part of the model's fused projection.
    Fused(String),
}

/// Whether `name` is a Hugging Face Llama layer's query projection.
fn is_llama_qkv(name: &str) -> bool {
    name.starts_with("model.layers.") && name.ends_with(".self_attn.q_proj.weight")
}

/// The model's name for a Hugging Face Llama tensor; None when a Llama has no such tensor.
fn llama_name(name: &str) -> Option<LlamaName> {
    let own = |ours: &str| Some(LlamaName::Own(ours.to_string()));
    match name {
        "model.embed_tokens.weight" => return own("embed_tokens.weight"),
        "model.norm.weight" => return own("norm.weight"),
        LM_HEAD => return own(LM_HEAD),
        _ => {}
    }
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, part) = rest.split_once('.')?;
    layer.parse::<usize>().ok()?;
    // Qwen2's biases on the queries, keys and values: the fused projection's bias.
    if let Some(part) = part.strip_suffix(".bias") {
        let qkv = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"].contains(&part);
        return qkv.then(|| LlamaName::Fused(format!("layers{layer}_self_attn_qkv_proj.bias")));
    }
    let part = part.strip_suffix(".weight")?;
    if ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"].contains(&part) {
        return Some(LlamaName::Fused(format!(
            "layers{layer}_self_attn_qkv_proj.weight"
        )));
    }
    let (ours, _) = llama::PARTS.iter().find(|(_, theirs)| *theirs == part)?;
    own(&format!("layers{layer}_{ours}.weight"))
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
        assert_eq!(m.sources["lm_head.weight"].name(), "lm_head.weight");
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
        assert_eq!(m.sources["transformer.wte.weight"].name(), "wte.weight");
        assert_eq!(m.sources.len(), 6);
    }

    #[test]
    fn without_lm_head_the_output_matrix_is_the_embeddings() {
        let file = shapes(&[
            ("transformer.wte.weight", &[10, 4]),
            ("transformer.h.0.attn.c_attn.weight", &[4, 12]),
        ]);
        let m = Mapping::new(&file, &model(), StateDictNames::Nanogpt);
        assert_eq!(m.sources["lm_head.weight"].name(), "transformer.wte.weight");
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
        let one = |change| Source {
            names: vec!["t".into()],
            change,
        };
        let t_shape = |shape: &[usize]| shapes(&[("t", shape)]);
        let after = Mapping::shape_after(&one(Change::Transpose), &t_shape(&[2, 3]), &[3, 2]);
        assert_eq!(after, [3, 2]);
        let c = Mapping::values_after(Change::FirstRows, vec![1., 2., 3., 4.], &[4, 1], 2);
        assert_eq!(c, [1., 2.]);
        let after = Mapping::shape_after(&one(Change::FirstRows), &t_shape(&[4, 1]), &[2, 1]);
        assert_eq!(after, [2, 1]);
    }

    fn llama_model() -> Vec<StateDictEntry> {
        vec![
            entry("embed_tokens.weight", &[10, 8]),
            entry("layers0_input_layernorm.weight", &[8]),
            entry("layers0_self_attn_qkv_proj.weight", &[16, 8]),
            entry("layers0_self_attn_o_proj.weight", &[8, 8]),
            entry("layers0_mlp_down_proj.weight", &[8, 12]),
            entry("norm.weight", &[8]),
            entry("lm_head.weight", &[10, 8]),
        ]
    }

    /// q, k and v stack into the fused projection in that order, whatever the file's order;
    /// the other names lose `model.`; without lm_head the embedding is read twice.
    #[test]
    fn a_hugging_face_llama_file_is_renamed_and_its_projections_stacked() {
        let file = shapes(&[
            ("model.embed_tokens.weight", &[10, 8]),
            ("model.layers.0.input_layernorm.weight", &[8]),
            ("model.layers.0.self_attn.v_proj.weight", &[4, 8]),
            ("model.layers.0.self_attn.q_proj.weight", &[8, 8]),
            ("model.layers.0.self_attn.k_proj.weight", &[4, 8]),
            ("model.layers.0.self_attn.o_proj.weight", &[8, 8]),
            ("model.layers.0.self_attn.rotary_emb.inv_freq", &[2]),
            ("model.layers.0.mlp.down_proj.weight", &[8, 12]),
            ("model.norm.weight", &[8]),
        ]);
        let m = Mapping::new(&file, &llama_model(), StateDictNames::Sequential);
        assert!(m.hugging_face_llama && !m.hugging_face);
        assert_eq!(m.skipped, ["model.layers.0.self_attn.rotary_emb.inv_freq"]);
        let fused = &m.sources["layers0_self_attn_qkv_proj.weight"];
        assert_eq!(fused.change, Change::StackRows);
        let layer = "model.layers.0.self_attn";
        let parts = ["q_proj", "k_proj", "v_proj"].map(|p| format!("{layer}.{p}.weight"));
        assert_eq!(fused.names, parts);
        assert_eq!(Mapping::shape_after(fused, &file, &[16, 8]), [16, 8]);
        let name = |ours: &str| m.sources[ours].name().to_string();
        assert_eq!(name("lm_head.weight"), "model.embed_tokens.weight");
        assert_eq!(
            name("layers0_mlp_down_proj.weight"),
            "model.layers.0.mlp.down_proj.weight"
        );
        assert_eq!(m.sources.len(), 7);
    }

    /// Qwen2's biases on q, k and v stack into the fused projection's bias.
    #[test]
    fn qwen2s_projection_biases_stack_into_the_fused_bias() {
        let layer = "model.layers.0.self_attn";
        let file = shapes(&[
            (&format!("{layer}.k_proj.bias"), &[4]),
            (&format!("{layer}.q_proj.bias"), &[8]),
            (&format!("{layer}.q_proj.weight"), &[8, 8]),
            (&format!("{layer}.v_proj.bias"), &[4]),
        ]);
        let mut model = llama_model();
        model.push(entry("layers0_self_attn_qkv_proj.bias", &[16]));
        let m = Mapping::new(&file, &model, StateDictNames::Sequential);
        let bias = &m.sources["layers0_self_attn_qkv_proj.bias"];
        assert_eq!(bias.change, Change::StackRows);
        let parts = ["q_proj", "k_proj", "v_proj"].map(|p| format!("{layer}.{p}.bias"));
        assert_eq!(bias.names, parts);
        assert_eq!(Mapping::shape_after(bias, &file, &[16]), [16]);
    }

    /// Without all three projections the fused one is missing, and the parts there are
    /// unexpected.
    #[test]
    fn a_llama_layer_without_its_keys_leaves_the_fused_projection_missing() {
        let file = shapes(&[
            ("model.layers.0.self_attn.q_proj.weight", &[8, 8]),
            ("model.layers.0.self_attn.v_proj.weight", &[4, 8]),
        ]);
        let m = Mapping::new(&file, &llama_model(), StateDictNames::Sequential);
        assert!(!m.sources.contains_key("layers0_self_attn_qkv_proj.weight"));
        assert!(m
            .sources
            .contains_key("model.layers.0.self_attn.q_proj.weight"));
    }
}
