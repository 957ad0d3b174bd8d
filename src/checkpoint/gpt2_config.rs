//! transformers' config.json beside a Hugging Face GPT-2 file: what the tensors' shapes cannot
//! tell. A model with 12 heads reads a 16-head file's tensors without a shape error, and
//! computes something else; so do GELU's two forms and layer norm's epsilon.

use crate::graph::Graph;
use crate::ops::Op;
use crate::tensor::Activation as Function;
use serde::Deserialize;
use std::path::Path;

/// The fields of GPT2Config that change what the model computes but not its tensors' shapes.
/// Absent fields take transformers' defaults.
#[derive(Debug, Deserialize)]
struct Gpt2Config {
    #[serde(default = "default_heads")]
    n_head: usize,
    #[serde(default = "default_activation")]
    activation_function: String,
    #[serde(default = "default_eps")]
    layer_norm_epsilon: f64,
    #[serde(default)]
    scale_attn_by_inverse_layer_idx: bool,
}

fn default_heads() -> usize {
    12
}
fn default_activation() -> String {
    "gelu_new".into()
}
fn default_eps() -> f64 {
    1e-5
}

/// Where `weights` has a config.json beside it: Ok(true) when the model computes what it
/// says; Err says how the model differs. Ok(false): no config.json to check against.
pub fn check(weights: &Path, graph: &Graph) -> Result<bool, String> {
    let path = weights.with_file_name("config.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(false);
    };
    let config: Gpt2Config = serde_json::from_str(&text)
        .map_err(|e| format!("{} beside it is not a GPT-2 config: {e}", path.display()))?;
    let differs = |what: String| Err(format!("{} beside it says {what}", path.display()));
    let gelu = match config.activation_function.as_str() {
        "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Function::GeluTanh,
        "gelu" => Function::Gelu,
        other => return differs(format!(
            "activation_function = {other:?}; trainer's GELU is \"gelu\" or tanh's \"gelu_new\""
        )),
    };
    if config.scale_attn_by_inverse_layer_idx {
        return differs("scale_attn_by_inverse_layer_idx = true; trainer's attention scales by 1/sqrt(head_dim) only".into());
    }
    for layer in &graph.layers {
        match &layer.op {
            Op::Attention(a) if a.shape.heads != config.n_head => {
                return differs(format!(
                    "n_head = {}, and the model's attention has {} heads: set heads = {}",
                    config.n_head, a.shape.heads, config.n_head
                ))
            }
            Op::Activation(a)
                if matches!(a.f, Function::Gelu | Function::GeluTanh) && a.f != gelu =>
            {
                let (theirs, ours) = match gelu {
                    Function::GeluTanh => ("the tanh form", "approximate = \"tanh\""),
                    _ => ("the exact form", "approximate = \"none\""),
                };
                return differs(format!(
                    "activation_function = {:?}, GELU's {theirs}: set the gelu layer's {ours}",
                    config.activation_function
                ));
            }
            Op::LayerNorm(n)
                if (f64::from(n.eps) / config.layer_norm_epsilon - 1.0).abs() > 1e-6 =>
            {
                return differs(format!(
                    "layer_norm_epsilon = {}, and the model's layer norm has eps = {}",
                    config.layer_norm_epsilon, n.eps
                ))
            }
            _ => {}
        }
    }
    Ok(true)
}
