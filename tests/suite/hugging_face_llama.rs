//! model.init_from reads Hugging Face Llama files, transformers' `save_pretrained` of
//! LlamaForCausalLM: names under `model.`, q_proj, k_proj and v_proj stacked into the fused
//! projection, no lm_head where it is tied, config.json checked against the model. The model
//! then computes transformers' own logits (tests/fixtures/make_hf_llama.py wrote both).

use crate::common::{self, root, stderr, trainer};
use crate::hugging_face::{assert_close, model_logits};
use safetensors::SafeTensors;
use std::path::{Path, PathBuf};
use trainer::checkpoint::weights;
use trainer::graph::{DataShape, Graph};

const FIXTURE: &str = "tests/fixtures/hf_llama";
/// The fixture's model: 2 layers of width 32, 4 query heads and 2 key and value heads of 8
/// values, Llama 3.1's rotary embedding (θ = 500000, stretched), a tied lm_head. The job's
/// block is 16 positions.
const VOCABULARY: usize = 256;
const BLOCK: usize = 16;
/// Its rotary embedding's stretch, as the job writes it.
const SCALING: &str = "{ type = \"llama3\", factor = 8.0, low_freq_factor = 1.0, \
                       high_freq_factor = 16.0, original_max_position_embeddings = 1024 }";

/// jobs/llama_char.toml's layers at the fixture's size, on the bundled Shakespeare as bytes.
fn job(init_from: &Path) -> String {
    format!(
        r#"[job]
name = "hf_llama"
seed = 1
[data]
source = "text"
path = "{data}"
tokenizer = "bytes"
block_size = {BLOCK}
batch_size = 4
val_fraction = 0.1
[model]
init_from = "{init_from}"
layers = [
  {{ type = "embedding", num_embeddings = {VOCABULARY}, embedding_dim = 32, name = "embed_tokens" }},
  {{ type = "repeat", block = "layers", times = 2 }},
  {{ type = "rmsnorm", eps = 1e-5, name = "norm" }},
  {{ type = "linear", out = {VOCABULARY}, bias = false, tied_to = "embed_tokens", name = "lm_head" }},
]
[model.blocks]
layers = [
  {{ type = "rmsnorm", eps = 1e-5, name = "input_layernorm" }},
  {{ type = "linear", out = 64, bias = false, name = "self_attn_qkv_proj" }},
  {{ type = "rotary", heads = 4, kv_heads = 2, theta = 500000.0, scaling = {SCALING} }},
  {{ type = "attention", heads = 4, kv_heads = 2 }},
  {{ type = "linear", out = 32, bias = false, name = "self_attn_o_proj" }},
  {{ type = "add", inputs = ["block_input", "self_attn_o_proj"], name = "attn_out" }},
  {{ type = "rmsnorm", eps = 1e-5, name = "post_attention_layernorm" }},
  {{ type = "linear", out = 64, bias = false, name = "mlp_gate_proj" }},
  {{ type = "silu", name = "act" }},
  {{ type = "linear", out = 64, bias = false, inputs = ["post_attention_layernorm"], name = "mlp_up_proj" }},
  {{ type = "multiply", inputs = ["act", "mlp_up_proj"], name = "gated" }},
  {{ type = "linear", out = 32, bias = false, name = "mlp_down_proj" }},
  {{ type = "add", inputs = ["attn_out", "mlp_down_proj"] }},
]
[loss]
type = "cross_entropy"
[optimizer]
type = "adamw"
lr = 3e-5
[train]
max_steps = 1
log_every = 1
"#,
        data = root().join("jobs/data/shakespeare.txt.gz").display(),
        init_from = init_from.display(),
    )
}

/// The fixture's job, written in `dir` as `edit` changes it, reading `init_from`.
fn write_job(dir: &Path, init_from: &Path, edit: impl Fn(String) -> String) -> PathBuf {
    let path = dir.join("job.toml");
    std::fs::write(&path, edit(job(init_from))).unwrap();
    path
}

fn fixture() -> PathBuf {
    root().join(FIXTURE).join("model.safetensors")
}

/// `trainer check` of the job as `edit` changes it, reading `init_from`, is refused (exit
/// 2) with a message that holds `said`.
fn refused(init_from: &Path, edit: impl Fn(String) -> String, said: &str) {
    let dir = tempfile::tempdir().unwrap();
    let job = write_job(dir.path(), init_from, edit);
    let out = trainer(&["check", job.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains(said), "{said}: {}", stderr(&out));
}

/// save_pretrained's own file gives transformers' logits: every name renamed, the three
/// projections stacked, the embedding read as lm_head too.
#[test]
fn a_transformers_llama_file_gives_transformers_logits() {
    gives_transformers_logits(FIXTURE, |j| j);
}

/// So does a Qwen2's (tests/fixtures/hf_qwen2): biases on the queries, keys and values,
/// stacked into the fused projection's bias; θ = 1000000 without a stretch.
#[test]
fn a_transformers_qwen2_file_gives_transformers_logits() {
    gives_transformers_logits("tests/fixtures/hf_qwen2", as_qwen2);
}

/// The fixture's job as the Qwen2 of tests/fixtures/hf_qwen2.
fn as_qwen2(job: String) -> String {
    (job.replace(
        "bias = false, name = \"self_attn_qkv_proj\"",
        "name = \"self_attn_qkv_proj\"",
    ))
    .replace(
        &format!("theta = 500000.0, scaling = {SCALING}"),
        "theta = 1000000.0",
    )
}

/// The model of `fixture`, read by the fixture's job as `edit` changes it, computes the
/// logits transformers wrote beside it.
fn gives_transformers_logits(fixture: &str, edit: impl Fn(String) -> String) {
    let dir = tempfile::tempdir().unwrap();
    let file = root().join(fixture).join("model.safetensors");
    let path = write_job(dir.path(), &file, edit);
    let spec = trainer::spec::load_job(&path, &[]).unwrap();
    let data = DataShape {
        sample_shape: vec![BLOCK],
        classes: Some(VOCABULARY),
        classes_from: None,
        target_dim: BLOCK,
    };
    let graph = Graph::build(&spec, &data).unwrap();
    let w = weights::read(&file, &graph).unwrap();

    let bytes = std::fs::read(root().join(fixture).join("logits.safetensors")).unwrap();
    let logits = SafeTensors::deserialize(&bytes).unwrap();
    let f32s = |name: &str| -> Vec<f32> {
        bytemuck::pod_collect_to_vec(logits.tensor(name).unwrap().data())
    };
    let (input, theirs) = (f32s("input"), f32s("logits"));
    let worst = assert_close(&model_logits(graph, &w.params, &input), &theirs);
    println!("{fixture}: largest difference from transformers' logits: {worst:.1e}");
}

/// A run from the file trains, and its train.log says what reading it changed.
#[test]
fn a_run_from_a_llama_file_says_how_it_read_it() {
    let dir = tempfile::tempdir().unwrap();
    let job = write_job(dir.path(), &fixture(), |j| j);
    let run = common::run_job(&job, &dir.path().join("runs"), &[]);
    let log = std::fs::read_to_string(run.join("train.log")).unwrap();
    let said = "a Hugging Face Llama file: 2 layers' q_proj, k_proj and v_proj stacked into \
                the fused projection; lm_head is embed_tokens; the model matches its \
                config.json";
    assert!(log.contains(said), "{log}");
}

/// What the shapes cannot tell is read from config.json and refused where the model
/// differs: θ, RMSNorm's epsilon, the rotary stretch, a rotary embedding of another kind,
/// attention over a sliding window.
#[test]
fn a_llama_file_whose_config_differs_from_the_model_is_refused() {
    refused(
        &fixture(),
        |j| j.replace("theta = 500000.0", "theta = 10000.0"),
        "config.json beside it says rope_theta = 500000, and the model's rotary has theta = \
         10000",
    );
    refused(
        &fixture(),
        |j| j.replace("rmsnorm\", eps = 1e-5", "rmsnorm\", eps = 1e-6"),
        "rms_norm_eps = 0.00001, and the model's rmsnorm has eps = 0.000001",
    );
    refused(
        &fixture(),
        |j| j.replace(", scaling = { type", ", unused = { type"),
        "unknown field `unused`",
    );
    refused(
        &fixture(),
        |j| j.replace(&format!(", scaling = {SCALING}"), ""),
        "rope scaling { type = \"llama3\", factor = 8, low_freq_factor = 1, high_freq_factor \
         = 16, original_max_position_embeddings = 1024 }, and the model's rotary has scaling \
         none",
    );
    refused(
        &fixture(),
        |j| j.replace("factor = 8.0", "factor = 4.0"),
        "and the model's rotary has scaling { type = \"llama3\", factor = 4,",
    );
    let dir = tempfile::tempdir().unwrap();
    for name in ["model.safetensors", "config.json"] {
        std::fs::copy(root().join(FIXTURE).join(name), dir.path().join(name)).unwrap();
    }
    let config = dir.path().join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replace("\"llama3\"", "\"yarn\"")).unwrap();
    refused(
        &dir.path().join("model.safetensors"),
        |j| j,
        "its rotary embedding is \"yarn\"; trainer's rotary layer turns by θ alone",
    );
    // A Qwen2 that attends to a window of positions only.
    let qwen2 = tempfile::tempdir().unwrap();
    for name in ["model.safetensors", "config.json"] {
        let from = root().join("tests/fixtures/hf_qwen2").join(name);
        std::fs::copy(from, qwen2.path().join(name)).unwrap();
    }
    let config = qwen2.path().join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    let windowed = text.replace(
        "\"use_sliding_window\": false",
        "\"use_sliding_window\": true",
    );
    std::fs::write(&config, windowed).unwrap();
    refused(
        &qwen2.path().join("model.safetensors"),
        as_qwen2,
        "use_sliding_window = true or a layer of another type than \"full_attention\"; \
         trainer's attention reads every position before",
    );
}

/// Shapes that do not fit name the file's tensors stacked, and the model's; a model built
/// otherwise is told how a Llama file reads.
#[test]
fn a_llama_file_that_does_not_fit_the_model_is_refused() {
    refused(
        &fixture(),
        |j| {
            (j.replace(
                "out = 64, bias = false, name = \"self_attn_qkv_proj\"",
                "out = 96, bias = false, name = \"self_attn_qkv_proj\"",
            ))
            .replace(", kv_heads = 2", "")
        },
        "tensors `model.layers.0.self_attn.q_proj.weight`, \
         `model.layers.0.self_attn.k_proj.weight`, `model.layers.0.self_attn.v_proj.weight` \
         stacked (read as `layers0_self_attn_qkv_proj.weight`) have shapes [32, 32], [16, 32], \
         [16, 32], the model needs [96, 32]",
    );
    refused(
        &fixture(),
        |j| j.replace("\"embed_tokens\"", "\"wte\""),
        "a Hugging Face Llama file reads into a model whose layers are built and named as \
         jobs/llama_char.toml's",
    );
}
