//! Weights interchange with PyTorch: model.safetensors holds the parameters under the names
//! and layouts of the equivalent `nn.Sequential`'s state_dict. A layer's name is its index
//! in `model.layers` (every layer counts, also those without parameters), so a model of
//! `flatten, linear(128), relu, linear(10)` has `1.weight` [128, 64], `1.bias` [128],
//! `3.weight` [10, 128] and `3.bias` [10], exactly as
//! `nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))` names
//! them; `load_state_dict` (or safetensors.torch.load_model) reads the file as it is.
//! `model.init_from` reads such a file back, checking every name and shape. A layer with a
//! `name` uses it instead of its index (`block1.weight`). Batch norm also has PyTorch's
//! buffers: `running_mean`, `running_var` and `num_batches_tracked` (int64, a scalar; a run
//! from `init_from` counts on from the file's).

use super::file::{self, TensorOut, Values};
use super::hugging_face;
use super::llama;
use super::mapping::{Change, Mapping};
use crate::error::{Error, Result};
use crate::graph::{Graph, StateDictEntry};
use crate::spec::StateDictNames;
use std::collections::BTreeMap;
use std::path::Path;

/// The file a finished run writes its final weights to, in the run directory.
pub const MODEL_FILE: &str = "model.safetensors";

/// A model's state: the parameters and batch norm's running statistics and counts.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Weights {
    pub params: Vec<f32>,
    /// `Network::running_stats` (empty without batch norm).
    pub running_stats: Vec<f32>,
    /// Each batch-norm layer's `num_batches_tracked` (training forward passes), in
    /// `Graph::batchnorm_prefixes` order; empty: all 0.
    pub batches_tracked: Vec<u64>,
}

/// Writes the parameters and buffers under their PyTorch names. Returns the file's size.
pub fn write(path: &Path, graph: &Graph, weights: &Weights, preprocess: &str) -> Result<u64> {
    let tracked: Vec<[i64; 1]> = (0..graph.batchnorm_prefixes().len())
        .map(|i| [weights.batches_tracked.get(i).copied().unwrap_or(0) as i64])
        .collect();
    let entries = graph.state_dict_entries();
    let stats = graph.running_stat_entries();
    let mut tensors: Vec<TensorOut> = entries
        .into_iter()
        .map(|e| TensorOut {
            values: Values::F32(&weights.params[e.offset..e.offset + e.len()]),
            name: e.name,
            shape: e.shape,
        })
        .collect();
    tensors.extend(stats.into_iter().map(|e| TensorOut {
        values: Values::F32(&weights.running_stats[e.offset..e.offset + e.len()]),
        name: e.name,
        shape: e.shape,
    }));
    tensors.extend(
        graph
            .batchnorm_prefixes()
            .into_iter()
            .zip(&tracked)
            .map(|(p, count)| TensorOut {
                name: format!("{p}.num_batches_tracked"),
                shape: vec![],
                values: Values::I64(count),
            }),
    );
    // "format": "pt" is what Hugging Face's loaders look for in a PyTorch state_dict file.
    let metadata = BTreeMap::from([
        ("format".to_string(), "pt".to_string()),
        ("producer".to_string(), "trainer".to_string()),
        // preprocess.json: what turns raw input into the model's input travels with it.
        ("preprocess".to_string(), preprocess.to_string()),
    ]);
    file::write(path, &tensors, metadata).map_err(Error::Runtime)
}

/// Reads a state_dict file into a flat parameter buffer and running statistics for `graph`.
/// Every tensor of the model must be there with its shape, and nothing else: errors name the
/// file, the tensor, and what was expected (a bad file is a bad job, exit 2).
pub fn read(path: &Path, graph: &Graph) -> Result<Weights> {
    read_as(path, graph, "model.init_from = ")
}

/// `read`, its errors naming the file after `what` ("model.init_from = ", "final weights ").
pub fn read_as(path: &Path, graph: &Graph, what: &str) -> Result<Weights> {
    let shown = path.display();
    let bad = |why: String| Error::Job(format!("{what}\"{shown}\": {why}"));
    // Names and shapes first, from the header: a file that does not fit is refused without
    // reading its data.
    let shapes = file::tensor_shapes(path).map_err(bad)?;
    let params = graph.state_dict_entries();
    let stats = graph.running_stat_entries();
    let tracked: Vec<String> = graph
        .batchnorm_prefixes()
        .iter()
        .map(|p| format!("{p}.num_batches_tracked"))
        .collect();
    let expected: Vec<String> = params
        .iter()
        .chain(&stats)
        .map(|e| format!("{} {:?}", e.name, e.shape))
        .chain(tracked.iter().map(|n| format!("{n} []")))
        .collect();
    let wanted: Vec<&str> = params
        .iter()
        .chain(&stats)
        .map(|e| e.name.as_str())
        .chain(tracked.iter().map(String::as_str))
        .collect();
    let mapping = Mapping::new(&shapes, &params, graph.names);
    // The model's names of the file's tensors.
    let names: Vec<&str> = mapping.sources.keys().map(String::as_str).collect();
    let missing: Vec<&str> = wanted
        .iter()
        .copied()
        .filter(|n| !names.iter().any(|m| m == n))
        .collect();
    let unexpected: Vec<&str> = names
        .iter()
        .copied()
        .filter(|n| !wanted.contains(n))
        .collect();
    if !missing.is_empty() || !unexpected.is_empty() {
        let mut why = String::new();
        if !missing.is_empty() {
            why += &format!("missing tensors {}; ", missing.join(", "));
        }
        if !unexpected.is_empty() {
            why += &format!("unexpected tensors {}; ", unexpected.join(", "));
        }
        if names.contains(&"params") && names.iter().any(|n| n.starts_with("window.")) {
            return Err(bad(
                "it is a training checkpoint (a run's checkpoints/), not a model's weights: \
                 continue that run with --resume, or start from its model.safetensors"
                    .into(),
            ));
        }
        let gpt = graph.names == StateDictNames::Sequential
            && names.iter().any(|n| n.ends_with("wte.weight"));
        let hint = match (gpt, mapping.hugging_face_llama) {
            (true, _) => {
                "; a GPT's file (nanoGPT's or Hugging Face's) reads into a model with \
                     model.state_dict_names = \"nanogpt\""
            }
            (_, true) => {
                "; a Hugging Face Llama file reads into a model whose layers are built and \
                 named as jobs/llama_char.toml's"
            }
            _ => "",
        };
        return Err(bad(format!(
            "{why}the model needs exactly: {} (PyTorch state_dict names: the layer's name, else \
             its index in model.layers){hint}",
            expected.join(", ")
        )));
    }
    for e in params.iter().chain(&stats) {
        let source = &mapping.sources[&e.name];
        let shape = Mapping::shape_after(source, &shapes, &e.shape);
        if shape != e.shape {
            let read_as = match source.name() == e.name {
                true => String::new(),
                false => format!(" (read as `{}`)", e.name),
            };
            let layout = match source.change {
                Change::Transpose => ", Conv1D's [in, out] of",
                _ => "",
            };
            let theirs: Vec<String> = (source.names.iter())
                .map(|n| format!("{:?}", shapes[n]))
                .collect();
            return Err(bad(format!(
                "{} {}{read_as} {} {}{layout}, the model needs {:?}",
                if theirs.len() == 1 {
                    "tensor"
                } else {
                    "tensors"
                },
                source.shown(),
                if theirs.len() == 1 {
                    "has shape"
                } else {
                    "have shapes"
                },
                theirs.join(", "),
                e.shape
            )));
        }
    }
    // What the shapes cannot tell: heads, GELU's form, layer norm's epsilon; a Llama's key
    // and value heads, its rotary θ and RMSNorm's epsilon.
    let config_checked = match (mapping.hugging_face, mapping.hugging_face_llama) {
        (true, _) => hugging_face::check(path, graph).map_err(bad)?,
        (_, true) => llama::check(path, graph).map_err(bad)?,
        _ => false,
    };
    let f = file::read(path).map_err(bad)?;
    let fill = |entries: &[StateDictEntry], out: &mut [f32]| -> Result<()> {
        for e in entries {
            let source = &mapping.sources[&e.name];
            let mut values = Vec::with_capacity(e.len());
            for name in &source.names {
                values.extend(f.f32s(name).map_err(bad)?);
            }
            let shape = &shapes[source.name()];
            let values = Mapping::values_after(source.change, values, shape, e.len());
            // A NaN would only show as a diverged loss or a NaN evaluation, far from its cause.
            if let Some((i, v)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
                return Err(bad(format!(
                    "tensor `{}` holds {v} (at flat index {i}); every value must be finite",
                    e.name
                )));
            }
            // Below 0 it could only be a damaged file, or the mean and variance swapped; every
            // evaluation would be NaN.
            if e.name.ends_with(".running_var") {
                if let Some((i, v)) = values.iter().enumerate().find(|(_, v)| **v < 0.0) {
                    return Err(bad(format!(
                        "tensor `{}` holds {v} (at flat index {i}); a variance cannot be \
                         negative",
                        e.name
                    )));
                }
            }
            out[e.offset..e.offset + e.len()].copy_from_slice(&values);
        }
        Ok(())
    };
    let mut weights = Weights {
        params: vec![0.0; graph.param_len],
        running_stats: vec![0.0; graph.running_stats_len()],
        batches_tracked: tracked
            .iter()
            .map(|n| f.count(mapping.sources[n].name()).map_err(bad))
            .collect::<Result<_>>()?,
    };
    fill(&params, &mut weights.params)?;
    fill(&stats, &mut weights.running_stats)?;
    let file = format!("{what}\"{shown}\"");
    log_changes(&file, &mapping, &shapes, &params, config_checked);
    Ok(weights)
}

/// Says in train.log what reading a file changed: a Hugging Face layout, a cropped table.
fn log_changes(
    file: &str,
    mapping: &Mapping,
    shapes: &BTreeMap<String, Vec<usize>>,
    model: &[StateDictEntry],
    config_checked: bool,
) {
    let changed = |change| mapping.sources.values().filter(move |s| s.change == change);
    if mapping.hugging_face {
        let skipped = match mapping.skipped.len() {
            0 => String::new(),
            n => format!("; {n} attention masks skipped"),
        };
        let config = match config_checked {
            true => "; the model matches its config.json",
            false => {
                "; no config.json beside it, so the job's heads, GELU and layer norm \
                      epsilon are taken on trust"
            }
        };
        tracing::info!(
            "{file}: a Hugging Face GPT-2 file: {} Conv1D matrices transposed to nn.Linear's \
             [out, in]{skipped}{config}",
            changed(Change::Transpose).count()
        );
    }
    if mapping.hugging_face_llama {
        let config = match config_checked {
            true => "; the model matches its config.json",
            false => {
                "; no config.json beside it, so the job's heads, key and value heads, \
                 rope_theta and rms_norm_eps are taken on trust"
            }
        };
        let tied = match mapping.sources.get("lm_head.weight") {
            Some(s) if s.name() == "model.embed_tokens.weight" => "; lm_head is embed_tokens",
            _ => "",
        };
        tracing::info!(
            "{file}: a Hugging Face Llama file: {} layers' q_proj, k_proj and v_proj stacked \
             into the fused projection{tied}{config}",
            changed(Change::StackRows).count()
        );
    }
    for e in model {
        let source = &mapping.sources[&e.name];
        if source.change == Change::FirstRows {
            tracing::info!(
                "{file}: `{}` has {} positions; the model reads the first {}, as nanoGPT's \
                 crop_block_size",
                source.name(),
                shapes[source.name()][0],
                e.shape[0]
            );
        }
    }
}
