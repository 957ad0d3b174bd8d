//! Weights interchange with PyTorch: model.safetensors holds the parameters under the names
//! and layouts of the equivalent `nn.Sequential`'s state_dict. A layer's name is its index
//! in `model.layers` (every layer counts, also those without parameters), so a model of
//! `flatten, linear(128), relu, linear(10)` has `1.weight` [128, 64], `1.bias` [128],
//! `3.weight` [10, 128] and `3.bias` [10], exactly as
//! `nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))` names
//! them; `load_state_dict` (or safetensors.torch.load_model) reads the file as it is.
//! `model.init_from` reads such a file back, checking every name and shape.

use super::file::{self, TensorOut, Values};
use crate::error::{Error, Result};
use crate::graph::Graph;
use std::collections::BTreeMap;
use std::path::Path;

/// The file a finished run writes its final weights to, in the run directory.
pub const MODEL_FILE: &str = "model.safetensors";

/// Writes the parameters under their PyTorch names; returns the file's size.
pub fn write(path: &Path, graph: &Graph, params: &[f32]) -> Result<u64> {
    let tensors: Vec<TensorOut> = graph
        .state_dict_entries()
        .into_iter()
        .map(|e| TensorOut {
            values: Values::F32(&params[e.offset..e.offset + e.len()]),
            name: e.name,
            shape: e.shape,
        })
        .collect();
    // "format": "pt" is what Hugging Face's loaders look for in a PyTorch state_dict file.
    let metadata = BTreeMap::from([
        ("format".to_string(), "pt".to_string()),
        ("producer".to_string(), "trainer".to_string()),
    ]);
    file::write(path, &tensors, metadata).map_err(Error::Runtime)
}

/// Reads a state_dict file into a flat parameter buffer for `graph`. Every parameter of the
/// model must be there with its shape, and nothing else: errors name the file, the tensor,
/// and what was expected (a bad file is a bad job, exit 2).
pub fn read(path: &Path, graph: &Graph) -> Result<Vec<f32>> {
    let shown = path.display();
    let bad = |why: String| Error::Job(format!("model.init_from = \"{shown}\": {why}"));
    let f = file::read(path).map_err(bad)?;
    let entries = graph.state_dict_entries();
    let expected: Vec<String> = entries
        .iter()
        .map(|e| format!("{} {:?}", e.name, e.shape))
        .collect();
    let names = f.names();
    let missing: Vec<&str> = entries
        .iter()
        .map(|e| e.name.as_str())
        .filter(|n| !names.iter().any(|m| m == n))
        .collect();
    let unexpected: Vec<&str> = names
        .iter()
        .map(String::as_str)
        .filter(|n| !entries.iter().any(|e| e.name == *n))
        .collect();
    if !missing.is_empty() || !unexpected.is_empty() {
        let mut why = String::new();
        if !missing.is_empty() {
            why += &format!("missing tensors {}; ", missing.join(", "));
        }
        if !unexpected.is_empty() {
            why += &format!("unexpected tensors {}; ", unexpected.join(", "));
        }
        return Err(bad(format!(
            "{why}the model needs exactly: {} (PyTorch nn.Sequential names: the layer's \
             index in model.layers)",
            expected.join(", ")
        )));
    }
    let mut params = vec![0.0f32; graph.param_count];
    for e in &entries {
        let shape = f.shape(&e.name).unwrap_or_default();
        if shape != e.shape.as_slice() {
            return Err(bad(format!(
                "tensor `{}` has shape {shape:?}, the model needs {:?} (model.layers[{}])",
                e.name,
                e.shape,
                e.name.split('.').next().unwrap_or("?")
            )));
        }
        let values = f.f32s(&e.name).map_err(bad)?;
        params[e.offset..e.offset + e.len()].copy_from_slice(&values);
    }
    Ok(params)
}
