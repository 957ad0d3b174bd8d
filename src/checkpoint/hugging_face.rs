//! Hugging Face's GPT-2, both ways.
//!
//! - Reading: transformers' config.json beside a GPT-2 file tells what the tensors' shapes
//!   cannot. A model with 12 heads reads a 16-head file's tensors without a shape error, and
//!   computes something else; so do GELU's two forms and layer norm's epsilon. (`mapping`
//!   renames and transposes the tensors.)
//! - Writing: `write` saves a GPT as transformers' GPT2LMHeadModel saves itself, so
//!   `from_pretrained` reads it: model.safetensors (Conv1D matrices, [in, out]) and
//!   config.json.

use super::config::{config_beside, same_value};
use super::file::{self, TensorOut, Values};
use super::mapping::{Change, Mapping, CONV1D};
use crate::graph::Graph;
use crate::spec::StateDictNames;
use crate::tensor::Activation as Function;
use serde::Deserialize;
use std::collections::BTreeMap;
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

fn is_gelu(f: Function) -> bool {
    matches!(f, Function::Gelu | Function::GeluTanh)
}

/// Where `weights` has a config.json beside it: Ok(true) when the model computes what it
/// says; Err says how the model differs. Ok(false): no config.json to check against.
pub fn check(weights: &Path, graph: &Graph) -> Result<bool, String> {
    let Some((path, config)) = config_beside::<Gpt2Config>(weights, "GPT-2")? else {
        return Ok(false);
    };
    let differs = |what: String| Err(format!("{} beside it says {what}", path.display()));
    let gelu = match config.activation_function.as_str() {
        "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Function::GeluTanh,
        "gelu" => Function::Gelu,
        other => {
            let allowed = "trainer's GELU is \"gelu\", or \"gelu_new\" for the tanh form";
            return differs(format!("activation_function = {other:?}; {allowed}"));
        }
    };
    if config.scale_attn_by_inverse_layer_idx {
        let why = "trainer's attention scales by 1/sqrt(head_dim) only";
        return differs(format!("scale_attn_by_inverse_layer_idx = true; {why}"));
    }
    for layer in &graph.layers {
        let ops = layer.op.kind().properties();
        if let Some(heads) = ops
            .attention
            .map(|a| a.heads)
            .filter(|&h| h != config.n_head)
        {
            return differs(format!(
                "n_head = {}, and the model's attention has {heads} heads: set heads = {}",
                config.n_head, config.n_head
            ));
        }
        if ops.activation.is_some_and(|f| is_gelu(f) && f != gelu) {
            let (theirs, ours) = match gelu {
                Function::GeluTanh => ("the tanh form", "approximate = \"tanh\""),
                _ => ("the exact form", "approximate = \"none\""),
            };
            return differs(format!(
                "activation_function = {:?}, GELU's {theirs}: set the gelu layer's {ours}",
                config.activation_function
            ));
        }
        if let Some(eps) = ops
            .layer_norm_eps
            .filter(|&e| !same_value(e, config.layer_norm_epsilon))
        {
            return differs(format!(
                "layer_norm_epsilon = {}, and the model's layer norm has eps = {eps}",
                config.layer_norm_epsilon
            ));
        }
    }
    Ok(true)
}

/// What GPT2Config says of a model: its sizes, and what `check` reads back.
pub struct Gpt2 {
    vocab_size: usize,
    n_positions: usize,
    n_embd: usize,
    n_layer: usize,
    n_head: usize,
    n_inner: usize,
    gelu: Function,
    eps: f32,
}

/// The GPT-2 that `graph` is; Err says why it is none.
pub fn gpt2_of(graph: &Graph) -> Result<Gpt2, String> {
    if graph.names != StateDictNames::Nanogpt {
        return Err(
            "its tensors are not named as nanoGPT's GPT (model.state_dict_names = \
                    \"nanogpt\"), whose names GPT-2's follow"
                .into(),
        );
    }
    let shapes: BTreeMap<String, Vec<usize>> = (graph.state_dict_entries().into_iter())
        .map(|e| (e.name, e.shape))
        .collect();
    let shape = |name: &str| shapes.get(name).cloned().unwrap_or_default();
    let mut heads = Vec::new();
    let (mut gelus, mut eps) = (Vec::new(), Vec::new());
    for layer in &graph.layers {
        let ops = layer.op.kind().properties();
        heads.extend(ops.attention.map(|a| a.heads));
        gelus.extend(ops.activation.filter(|&f| is_gelu(f)));
        eps.extend(ops.layer_norm_eps);
    }
    let (wte, wpe, c_fc) = (
        shape("transformer.wte.weight"),
        shape("transformer.wpe.weight"),
        shape("transformer.h.0.mlp.c_fc.weight"),
    );
    let (&[vocab_size, n_embd], &[n_positions, _], &[n_inner, _]) =
        (wte.as_slice(), wpe.as_slice(), c_fc.as_slice())
    else {
        return Err(
            "GPT-2 has transformer.wte, transformer.wpe and transformer.h.0.mlp.c_fc \
                    matrices"
                .into(),
        );
    };
    let described = Gpt2 {
        vocab_size,
        n_positions,
        n_embd,
        n_layer: heads.len(),
        n_head: heads.first().copied().unwrap_or(0),
        n_inner,
        gelu: gelus.first().copied().unwrap_or(Function::GeluTanh),
        eps: eps.first().copied().unwrap_or(1e-5),
    };
    let one_heads = heads.iter().all(|&h| h == described.n_head);
    let one_gelu = gelus.iter().all(|&g| g == described.gelu);
    if !one_heads || !one_gelu || !eps.iter().all(|&e| e == described.eps) {
        return Err(
            "GPT2Config has one number of heads, one GELU and one layer norm \
                    epsilon for every block"
                .into(),
        );
    }
    let mut wanted: Vec<String> = ["wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"]
        .iter()
        .map(|n| format!("transformer.{n}"))
        .collect();
    for i in 0..described.n_layer {
        for part in [
            "ln_1",
            "attn.c_attn",
            "attn.c_proj",
            "ln_2",
            "mlp.c_fc",
            "mlp.c_proj",
        ] {
            for tensor in ["weight", "bias"] {
                wanted.push(format!("transformer.h.{i}.{part}.{tensor}"));
            }
        }
    }
    let ours: Vec<&String> = shapes.keys().filter(|n| *n != "lm_head.weight").collect();
    let missing: Vec<&String> = wanted.iter().filter(|n| !shapes.contains_key(*n)).collect();
    let extra: Vec<&&String> = ours.iter().filter(|n| !wanted.contains(n)).collect();
    if !missing.is_empty() || !extra.is_empty() {
        let list = |names: Vec<String>| match names.len() {
            0 => "none".to_string(),
            _ => names.join(", "),
        };
        return Err(format!(
            "GPT-2's tensors are these of nanoGPT's with every bias, and the model differs: \
             missing {}; not in GPT-2 {}",
            list(missing.into_iter().cloned().collect()),
            list(extra.into_iter().map(|n| n.to_string()).collect()),
        ));
    }
    Ok(described)
}

/// Writes `params` of `graph`, the GPT-2 `described`, into `dir` as transformers'
/// GPT2LMHeadModel saves itself: model.safetensors under its names (Conv1D matrices
/// [in, out], no lm_head where it is the embedding's) and config.json. Err says what could
/// not be written.
pub fn write(dir: &Path, described: &Gpt2, graph: &Graph, params: &[f32]) -> Result<(), String> {
    let entries = graph.state_dict_entries();
    let offset = |name: &str| entries.iter().find(|e| e.name == name).map(|e| e.offset);
    let tied = offset("lm_head.weight").is_none_or(|o| Some(o) == offset("transformer.wte.weight"));
    let mut tensors = Vec::new();
    for e in &entries {
        if e.name == "lm_head.weight" && tied {
            continue;
        }
        let values = &params[e.offset..e.offset + e.len()];
        let conv1d = CONV1D.iter().any(|c| e.name.ends_with(c));
        let (values, shape) = match conv1d {
            true => (
                Mapping::values_after(Change::Transpose, values.to_vec(), &e.shape, e.len()),
                vec![e.shape[1], e.shape[0]],
            ),
            false => (values.to_vec(), e.shape.clone()),
        };
        tensors.push((e.name.clone(), values, shape));
    }
    let out: Vec<TensorOut> = (tensors.iter())
        .map(|(name, values, shape)| TensorOut {
            name: name.clone(),
            shape: shape.clone(),
            values: Values::F32(values),
        })
        .collect();
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    file::write(&dir.join("model.safetensors"), &out, metadata)?;
    let d = described;
    // GPT-2's end-of-text token, where the vocabulary is GPT-2's.
    let end_of_text = (d.vocab_size > 50256).then_some(50256);
    // The f32 epsilon as it reads in the job (1e-5), not its f64 widening.
    let eps: f64 = d.eps.to_string().parse().unwrap_or(f64::from(d.eps));
    let config = serde_json::json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": d.vocab_size,
        "n_positions": d.n_positions,
        "n_ctx": d.n_positions,
        "n_embd": d.n_embd,
        "n_layer": d.n_layer,
        "n_head": d.n_head,
        "n_inner": (d.n_inner != 4 * d.n_embd).then_some(d.n_inner),
        "activation_function": match d.gelu {
            Function::Gelu => "gelu",
            _ => "gelu_new",
        },
        "layer_norm_epsilon": eps,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": true,
        "scale_attn_by_inverse_layer_idx": false,
        "tie_word_embeddings": tied,
        "bos_token_id": end_of_text,
        "eos_token_id": end_of_text,
        "torch_dtype": "float32",
    });
    let text = serde_json::to_string_pretty(&config).expect("a JSON value") + "\n";
    let path = dir.join("config.json");
    std::fs::write(&path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
}
