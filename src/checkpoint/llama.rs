//! Hugging Face's Llama, both ways; and Qwen2, a Llama with biases on its queries, keys and
//! values (the fused projection's bias).
//!
//! - Writing: a model built as jobs/llama_char.toml (RMSNorm, rotary embedding, the gated
//!   MLP with SiLU, no biases) saved as transformers' LlamaForCausalLM saves itself, so
//!   `from_pretrained` reads it; with the fused projection's bias, as Qwen2ForCausalLM.
//! - Reading (`model.init_from`, renamed by `mapping`): `check` compares the config.json
//!   beside the file with the model, for what the tensors' shapes cannot tell.
//!
//! - The model is recognised by its layer names, jobs/llama_char.toml's: `embed_tokens`,
//!   `layers<i>_input_layernorm` ... `layers<i>_mlp_down_proj`, `norm`, `lm_head`.
//! - The fused query, key and value projection is split into `q_proj`, `k_proj` and `v_proj`:
//!   its rows of the query heads, then of the key heads, then of the value heads (fewer
//!   than the query heads with `kv_heads`, as `num_key_value_heads`).
//! - Its rotary layers turn pairs (i, i + d/2), as transformers' `rotate_half`, so the
//!   matrices need no permutation.

use super::config::{config_beside, same_value};
use super::file::{self, TensorOut, Values};
use crate::graph::Graph;
use crate::ops::rotary::Llama3Scaling;
use crate::tensor::Activation;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::Path;

/// The parts of a block, as the job names them (after `layers<i>_`) and as
/// LlamaDecoderLayer does. The fused projection is written as three.
pub(super) const PARTS: [(&str, &str); 7] = [
    ("input_layernorm", "input_layernorm"),
    ("self_attn_qkv_proj", "self_attn.qkv_proj"),
    ("self_attn_o_proj", "self_attn.o_proj"),
    ("post_attention_layernorm", "post_attention_layernorm"),
    ("mlp_gate_proj", "mlp.gate_proj"),
    ("mlp_up_proj", "mlp.up_proj"),
    ("mlp_down_proj", "mlp.down_proj"),
];

/// What LlamaConfig says of a model.
#[derive(Debug)]
pub struct Llama {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    positions: usize,
    eps: f32,
    theta: f32,
    scaling: Option<Llama3Scaling>,
    /// Biases on the queries, keys and values, as Qwen2's: written as Qwen2ForCausalLM.
    qkv_bias: bool,
}

/// The Llama that `graph` is; Err says why it is none.
pub fn llama_of(graph: &Graph) -> Result<Llama, String> {
    let (mut heads, mut lens, mut eps, mut rotations) = (vec![], vec![], vec![], vec![]);
    for layer in &graph.layers {
        let ops = layer.op.properties();
        if ops.layer_norm_eps.is_some() {
            let why = format!("Llama has no {}: it normalises with rmsnorm", layer.kind);
            return Err(why);
        }
        if ops.activation.is_some_and(|f| f != Activation::Silu) {
            return Err(format!("Llama's MLP gates with silu, not {}", layer.kind));
        }
        if let Some(a) = ops.attention {
            if !a.causal {
                return Err("Llama's attention is causal".into());
            }
            heads.push((a.heads, a.kv_heads, a.head_dim));
            lens.push(a.len);
        }
        eps.extend(ops.rms_norm_eps);
        rotations.extend(ops.rotary.map(|r| (r.theta, r.scaling)));
    }
    let same = |v: &[f32]| v.windows(2).all(|w| w[0] == w[1]);
    let one_heads = heads.windows(2).all(|w| w[0] == w[1]);
    if rotations.is_empty() {
        return Err("a Llama has attention layers, each after a rotary layer".into());
    }
    let one_rotation = rotations.windows(2).all(|w| w[0] == w[1]);
    if !one_heads || !same(&eps) || !one_rotation || rotations.len() != heads.len() {
        return Err(
            "LlamaConfig has one number of heads, one rms_norm_eps and one rope_theta and \
             rope_scaling, and a rotary layer before every attention layer with its heads"
                .into(),
        );
    }
    let shapes: BTreeMap<String, Vec<usize>> = (graph.state_dict_entries().into_iter())
        .map(|e| (e.name, e.shape))
        .collect();
    let shape = |name: &str| shapes.get(name).cloned().unwrap_or_default();
    let (embedding, gate) = (
        shape("embed_tokens.weight"),
        shape("layers0_mlp_gate_proj.weight"),
    );
    let (&[vocab_size, hidden_size], &[intermediate_size, _]) =
        (embedding.as_slice(), gate.as_slice())
    else {
        return Err(
            "a Llama has the layers of jobs/llama_char.toml, named as it names them: \
             embed_tokens, layers0_mlp_gate_proj ..."
                .into(),
        );
    };
    let (heads, kv_heads, head_dim) = heads[0];
    let described = Llama {
        vocab_size,
        hidden_size,
        intermediate_size,
        layers: rotations.len(),
        heads,
        kv_heads,
        head_dim,
        positions: lens[0],
        eps: eps.first().copied().unwrap_or(1e-6),
        theta: rotations[0].0,
        scaling: rotations[0].1,
        qkv_bias: shapes.contains_key("layers0_self_attn_qkv_proj.bias"),
    };
    let mut wanted = vec!["embed_tokens.weight", "norm.weight", "lm_head.weight"]
        .into_iter()
        .map(String::from)
        .collect::<Vec<_>>();
    for i in 0..described.layers {
        wanted.extend(
            PARTS
                .iter()
                .map(|(ours, _)| format!("layers{i}_{ours}.weight")),
        );
        if described.qkv_bias {
            wanted.push(format!("layers{i}_self_attn_qkv_proj.bias"));
        }
    }
    let missing: Vec<&String> = wanted.iter().filter(|n| !shapes.contains_key(*n)).collect();
    let extra: Vec<&String> = shapes.keys().filter(|n| !wanted.contains(n)).collect();
    if !missing.is_empty() || !extra.is_empty() {
        let list = |names: Vec<&String>| match names.len() {
            0 => "none".to_string(),
            _ => (names.iter().map(|n| n.as_str()).collect::<Vec<_>>()).join(", "),
        };
        return Err(format!(
            "a Llama's tensors are those of jobs/llama_char.toml, without biases (or, as \
             Qwen2's, with biases on every fused projection), and the \
             model differs: missing {}; not in a Llama {}",
            list(missing),
            list(extra),
        ));
    }
    Ok(described)
}

/// Writes `params` of `graph`, the Llama `described`, into `dir` as transformers'
/// LlamaForCausalLM saves itself: model.safetensors under its names (no lm_head where it is
/// the embedding's) and config.json. Err says what could not be written.
pub fn write(dir: &Path, described: &Llama, graph: &Graph, params: &[f32]) -> Result<(), String> {
    let entries = graph.state_dict_entries();
    let entry = |name: &str| entries.iter().find(|e| e.name == name);
    let tied =
        entry("lm_head.weight").map(|e| e.offset) == entry("embed_tokens.weight").map(|e| e.offset);
    let mut tensors: Vec<(String, &[f32], Vec<usize>)> = Vec::new();
    let mut add = |theirs: String, ours: &str| {
        let e = entry(ours).expect("llama_of checked every name");
        let values = &params[e.offset..e.offset + e.len()];
        if !ours.contains("qkv_proj.") {
            tensors.push((theirs, values, e.shape.clone()));
            return;
        }
        // The fused projection's rows (of its matrix, or of its bias): the query heads', then
        // the key heads', then the value heads'.
        let d = described;
        let kv_rows = d.kv_heads * d.head_dim;
        let rows = [d.heads * d.head_dim, kv_rows, kv_rows];
        let row_len: usize = e.shape[1..].iter().product();
        let mut first = 0;
        for (rows, name) in rows.into_iter().zip(["q_proj", "k_proj", "v_proj"]) {
            let part = &values[first * row_len..(first + rows) * row_len];
            let shape = [&[rows][..], &e.shape[1..]].concat();
            tensors.push((theirs.replace("qkv_proj", name), part, shape));
            first += rows;
        }
    };
    add("model.embed_tokens.weight".into(), "embed_tokens.weight");
    for i in 0..described.layers {
        for (ours, theirs) in PARTS {
            add(
                format!("model.layers.{i}.{theirs}.weight"),
                &format!("layers{i}_{ours}.weight"),
            );
        }
        if described.qkv_bias {
            add(
                format!("model.layers.{i}.self_attn.qkv_proj.bias"),
                &format!("layers{i}_self_attn_qkv_proj.bias"),
            );
        }
    }
    add("model.norm.weight".into(), "norm.weight");
    if !tied {
        add("lm_head.weight".into(), "lm_head.weight");
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
    // The f32 values as they read in the job (1e-5, 10000), not their f64 widenings.
    let widen = |v: f32| v.to_string().parse::<f64>().unwrap_or(f64::from(v));
    let (architecture, model_type) = match d.qkv_bias {
        true => ("Qwen2ForCausalLM", "qwen2"),
        false => ("LlamaForCausalLM", "llama"),
    };
    let mut config = serde_json::json!({
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": d.vocab_size,
        "hidden_size": d.hidden_size,
        "intermediate_size": d.intermediate_size,
        "num_hidden_layers": d.layers,
        "num_attention_heads": d.heads,
        "num_key_value_heads": d.kv_heads,
        "head_dim": d.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": d.positions,
        "rms_norm_eps": widen(d.eps),
        "rope_theta": widen(d.theta),
        "rope_scaling": d.scaling.map(|s| serde_json::json!({
            "rope_type": "llama3",
            "factor": widen(s.factor),
            "low_freq_factor": widen(s.low_freq_factor),
            "high_freq_factor": widen(s.high_freq_factor),
            "original_max_position_embeddings": s.original_context as usize,
        })),
        "attention_bias": false,
        "attention_dropout": 0.0,
        "mlp_bias": false,
        "tie_word_embeddings": tied,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
    });
    if let (true, Some(fields)) = (d.qkv_bias, config.as_object_mut()) {
        // Qwen2's config has no attention_bias (its biases are always there) and may attend
        // to a window only; this model attends to every position before.
        fields.remove("attention_bias");
        fields.insert("use_sliding_window".into(), false.into());
    }
    let text = serde_json::to_string_pretty(&config).expect("a JSON value") + "\n";
    let path = dir.join("config.json");
    std::fs::write(&path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// The fields of LlamaConfig that change what the model computes but not its tensors' shapes.
/// Absent fields take transformers' defaults. transformers 5 writes θ and the rotary kind
/// under `rope_parameters`; earlier versions `rope_theta` and `rope_scaling`.
#[derive(Debug, Deserialize)]
struct LlamaConfig {
    #[serde(default = "default_heads")]
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    rope_theta: Option<f64>,
    #[serde(default)]
    rope_scaling: Option<RopeParameters>,
    #[serde(default)]
    rope_parameters: Option<RopeParameters>,
    #[serde(default = "default_act")]
    hidden_act: String,
    /// Qwen2's: attention over a window of positions only, in all layers or in those whose
    /// type says so.
    #[serde(default)]
    use_sliding_window: bool,
    #[serde(default)]
    layer_types: Vec<String>,
}

#[derive(Debug, Deserialize)]
struct RopeParameters {
    #[serde(default, alias = "type")]
    rope_type: Option<String>,
    rope_theta: Option<f64>,
    factor: Option<f64>,
    low_freq_factor: Option<f64>,
    high_freq_factor: Option<f64>,
    original_max_position_embeddings: Option<f64>,
}

fn default_heads() -> usize {
    32
}
fn default_eps() -> f64 {
    1e-6
}
fn default_act() -> String {
    "silu".into()
}

/// Where `weights` has a config.json beside it: Ok(true) when the Llama `graph` computes
/// what it says; Err says how they differ. Ok(false): no config.json to check against.
pub fn check(weights: &Path, graph: &Graph) -> Result<bool, String> {
    let ours = llama_of(graph)
        .map_err(|why| format!("it is a Hugging Face Llama file, and the model is not: {why}"))?;
    let Some((path, config)) = config_beside::<LlamaConfig>(weights, "Llama")? else {
        return Ok(false);
    };
    let differs = |what: String| Err(format!("{} beside it says {what}", path.display()));
    let rope = config
        .rope_parameters
        .as_ref()
        .or(config.rope_scaling.as_ref());
    let kind = rope
        .and_then(|r| r.rope_type.as_deref())
        .unwrap_or("default");
    let scaling = match (kind, rope) {
        ("default", _) => None,
        ("llama3", Some(r)) => Some(llama3_scaling(r).ok_or_else(|| {
            format!(
                "{} beside it has rope_type \"llama3\" without its factor, low_freq_factor, \
                 high_freq_factor and original_max_position_embeddings",
                path.display()
            )
        })?),
        _ => {
            return differs(format!(
                "its rotary embedding is {kind:?}; trainer's rotary layer turns by θ alone \
                 (\"default\") or with Llama 3.1's scaling (\"llama3\")"
            ))
        }
    };
    if scaling != ours.scaling {
        return differs(format!(
            "rope scaling {}, and the model's rotary has scaling {}",
            shown(scaling),
            shown(ours.scaling)
        ));
    }
    let theta = (rope.and_then(|r| r.rope_theta))
        .or(config.rope_theta)
        .unwrap_or(10_000.0);
    let kv_heads = config
        .num_key_value_heads
        .unwrap_or(config.num_attention_heads);
    let checks = [
        (
            !config.use_sliding_window && config.layer_types.iter().all(|t| t == "full_attention"),
            "use_sliding_window = true or a layer of another type than \"full_attention\"; \
             trainer's attention reads every position before"
                .to_string(),
        ),
        (
            config.hidden_act == "silu",
            format!(
                "hidden_act = {:?}; trainer's Llama gates with silu",
                config.hidden_act
            ),
        ),
        (
            config.num_attention_heads == ours.heads,
            format!(
                "num_attention_heads = {}, and the model's attention has heads = {}",
                config.num_attention_heads, ours.heads
            ),
        ),
        (
            kv_heads == ours.kv_heads,
            format!(
                "num_key_value_heads = {kv_heads}, and the model's attention has kv_heads = {}",
                ours.kv_heads
            ),
        ),
        (
            same_value(ours.eps, config.rms_norm_eps),
            format!(
                "rms_norm_eps = {}, and the model's rmsnorm has eps = {}",
                config.rms_norm_eps, ours.eps
            ),
        ),
        (
            same_value(ours.theta, theta),
            format!(
                "rope_theta = {theta}, and the model's rotary has theta = {}",
                ours.theta
            ),
        ),
    ];
    match checks.into_iter().find(|(ok, _)| !ok) {
        Some((_, what)) => differs(what),
        None => Ok(true),
    }
}

/// The config's Llama 3.1 scaling, in f32 as the rotary layer holds it; None if a field is
/// missing.
fn llama3_scaling(r: &RopeParameters) -> Option<Llama3Scaling> {
    Some(Llama3Scaling {
        factor: r.factor? as f32,
        low_freq_factor: r.low_freq_factor? as f32,
        high_freq_factor: r.high_freq_factor? as f32,
        original_context: r.original_max_position_embeddings? as f32,
    })
}

/// A scaling as a job writes it, or "none".
fn shown(scaling: Option<Llama3Scaling>) -> String {
    match scaling {
        None => "none".into(),
        Some(s) => format!(
            "{{ type = \"llama3\", factor = {}, low_freq_factor = {}, high_freq_factor = {}, \
             original_max_position_embeddings = {} }}",
            s.factor, s.low_freq_factor, s.high_freq_factor, s.original_context
        ),
    }
}
