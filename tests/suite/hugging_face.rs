//! model.init_from reads Hugging Face GPT-2 files as nanoGPT's from_pretrained does: Conv1D
//! matrices transposed, names with or without `transformer.`, attention masks and a tied
//! lm_head skipped, and a longer position table cropped to the block. The model then computes
//! transformers' own logits (tests/fixtures/make_hf_gpt2.py wrote both).

use crate::common::{self, root, stderr, trainer};
use safetensors::SafeTensors;
use std::path::{Path, PathBuf};
use trainer::checkpoint::weights;
use trainer::graph::{DataShape, Graph, Network};
use trainer::tensor::cpu::CpuBackend;

const FIXTURE: &str = "tests/fixtures/hf_gpt2";
/// The fixture's model: GPT-2's shape, small. Its position table has 32 rows; the job's
/// block is 16.
const VOCABULARY: usize = 256;
const BLOCK: usize = 16;

/// GPT-2's architecture at the fixture's size, on the bundled Shakespeare as bytes.
fn job(init_from: &Path) -> String {
    format!(
        r#"[job]
name = "hf"
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
state_dict_names = "nanogpt"
layers = [
  {{ type = "embedding", num_embeddings = {VOCABULARY}, embedding_dim = 32, name = "wte" }},
  {{ type = "position_embedding", num_positions = {BLOCK}, name = "wpe" }},
  {{ type = "repeat", block = "h", times = 2 }},
  {{ type = "layernorm", name = "ln_f" }},
  {{ type = "linear", out = {VOCABULARY}, bias = false, tied_to = "wte", name = "lm_head" }},
]
[model.blocks]
h = [
  {{ type = "layernorm", name = "ln_1" }},
  {{ type = "linear", out = 96, name = "attn_c_attn" }},
  {{ type = "attention", heads = 2 }},
  {{ type = "linear", out = 32, name = "attn_c_proj" }},
  {{ type = "add", inputs = ["block_input", "attn_c_proj"], name = "attn_out" }},
  {{ type = "layernorm", name = "ln_2" }},
  {{ type = "linear", out = 128, name = "mlp_c_fc" }},
  {{ type = "gelu", approximate = "tanh" }},
  {{ type = "linear", out = 32, name = "mlp_c_proj" }},
  {{ type = "add", inputs = ["attn_out", "mlp_c_proj"] }},
]
[loss]
type = "cross_entropy"
[optimizer]
type = "adamw"
lr = 3e-5
[train]
max_steps = 2
log_every = 1
"#,
        data = root().join("jobs/data/shakespeare.txt.gz").display(),
        init_from = init_from.display(),
    )
}

/// The fixture's job, written in `dir` as `edit` changes it.
fn write_job(dir: &Path, edit: impl Fn(String) -> String) -> PathBuf {
    let path = dir.join("job.toml");
    let text = edit(job(&root().join(FIXTURE).join("model.safetensors")));
    std::fs::write(&path, text).unwrap();
    path
}

/// `out` is a refusal, exit 2, whose message holds `said`.
fn assert_refused(out: &std::process::Output, said: &str) {
    assert_eq!(out.status.code(), Some(2), "{}", stderr(out));
    assert!(stderr(out).contains(said), "{said}: {}", stderr(out));
}

fn graph(dir: &Path, init_from: &Path) -> Graph {
    let path = dir.join("job.toml");
    std::fs::write(&path, job(init_from)).unwrap();
    let spec = trainer::spec::load_job(&path, &[]).unwrap();
    let data = DataShape {
        sample_shape: vec![BLOCK],
        classes: Some(VOCABULARY),
        classes_from: None,
        target_dim: BLOCK,
    };
    Graph::build(&spec, &data).unwrap()
}

/// (input ids, transformers' logits) from the fixture.
fn expected() -> (Vec<f32>, Vec<f32>) {
    let bytes = std::fs::read(root().join(FIXTURE).join("logits.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let f32s = |name: &str| -> Vec<f32> {
        let t = file.tensor(name).unwrap();
        bytemuck::pod_collect_to_vec(t.data())
    };
    (f32s("input"), f32s("logits"))
}

/// Our logits for the fixture's input, from `file` read as model.init_from.
fn logits(file: &Path) -> Vec<f32> {
    let dir = tempfile::tempdir().unwrap();
    let graph = graph(dir.path(), file);
    let w = weights::read(file, &graph).unwrap();
    let (input, _) = expected();
    model_logits(graph, &w.params, &input)
}

/// The logits of a language model `graph` with `params` for `input`, a window of ids a
/// sample, on the CPU.
pub(crate) fn model_logits(graph: Graph, params: &[f32], input: &[f32]) -> Vec<f32> {
    let [block, vocabulary] = graph.output_shape()[..] else {
        panic!("a language model outputs [T, vocabulary]")
    };
    let n = input.len() / block;
    let backend = CpuBackend::new(1);
    let mut net = Network::new(&backend, graph, params, n, 0).unwrap();
    net.set_input(&backend, input);
    net.forward(&backend, n, false, 0);
    net.output()[..n * block * vocabulary].to_vec()
}

/// Our logits are transformers' within 1e-4 relative; returns the largest difference.
pub(crate) fn assert_close(ours: &[f32], theirs: &[f32]) -> f32 {
    assert_eq!(ours.len(), theirs.len());
    let worst = (ours.iter().zip(theirs))
        .map(|(a, b)| (a - b).abs() / (1.0 + b.abs()))
        .fold(0.0f32, f32::max);
    assert!(worst < 1e-4, "logits differ from transformers' by {worst}");
    worst
}

/// save_pretrained's own file: `transformer.` names, Conv1D layouts, no lm_head.
#[test]
fn a_transformers_gpt2_file_gives_transformers_logits() {
    let (_, theirs) = expected();
    assert_close(
        &logits(&root().join(FIXTURE).join("model.safetensors")),
        &theirs,
    );
}

/// The fixture rewritten as the hub's openai-community/gpt2 file is: names without
/// `transformer.`, a causal mask `h.<i>.attn.bias` in each block, and lm_head.weight.
fn hub_style(dir: &Path) -> PathBuf {
    let bytes = std::fs::read(root().join(FIXTURE).join("model.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Vec<f32>, Vec<usize>)> = (file.tensors().into_iter())
        .map(|(name, t)| {
            let name = name.strip_prefix("transformer.").unwrap().to_string();
            (
                name,
                bytemuck::pod_collect_to_vec(t.data()),
                t.shape().to_vec(),
            )
        })
        .collect();
    let wte = tensors
        .iter()
        .find(|t| t.0 == "wte.weight")
        .unwrap()
        .clone();
    tensors.push(("lm_head.weight".into(), wte.1, wte.2));
    let mask: Vec<f32> = (0..32 * 32).map(|i| f32::from(i % 32 <= i / 32)).collect();
    for block in 0..2 {
        tensors.push((
            format!("h.{block}.attn.bias"),
            mask.clone(),
            vec![1, 1, 32, 32],
        ));
    }
    let path = dir.join("hub.safetensors");
    let list: Vec<(&str, &[f32], Vec<usize>)> = (tensors.iter())
        .map(|(n, v, s)| (n.as_str(), v.as_slice(), s.clone()))
        .collect();
    common::write_f32_safetensors(&path, &list);
    path
}

#[test]
fn the_hubs_gpt2_layout_gives_the_same_logits() {
    let dir = tempfile::tempdir().unwrap();
    let (_, theirs) = expected();
    assert_close(&logits(&hub_style(dir.path())), &theirs);
}

/// Fine-tuning from the file: the run starts, says what it read, trains and samples.
#[test]
fn a_run_fine_tunes_a_gpt2_file_and_samples() {
    let dir = tempfile::tempdir().unwrap();
    let job_path = dir.path().join("job.toml");
    let init_from = hub_style(dir.path());
    std::fs::write(&job_path, job(&init_from)).unwrap();
    let run = common::run_job(&job_path, &dir.path().join("runs"), &[]);
    let log = std::fs::read_to_string(run.join("train.log")).unwrap();
    for said in [
        "a Hugging Face GPT-2 file: 8 Conv1D matrices transposed",
        "2 attention masks skipped; no config.json beside it",
        "`wpe.weight` has 32 positions; the model reads the first 16",
    ] {
        assert!(log.contains(said), "train.log lacks {said:?}:\n{log}");
    }
    let out = trainer(&[
        "sample",
        run.to_str().unwrap(),
        "--prompt",
        "ROMEO:",
        "--tokens",
        "8",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("ROMEO:"));
}

/// GPT-2's vocabulary is 50,257: a job padded to 50,304 says which shape the file has.
#[test]
fn a_file_of_another_vocabulary_is_refused_naming_both_shapes() {
    let dir = tempfile::tempdir().unwrap();
    let job_path = write_job(dir.path(), |text| {
        let padded = "tokenizer = \"bytes\"\nclasses = 320";
        (text.replace("= 256", "= 320")).replace("tokenizer = \"bytes\"", padded)
    });
    let runs = dir.path().join("runs");
    let out = trainer(&[
        "run",
        job_path.to_str().unwrap(),
        "-q",
        "--runs-dir",
        runs.to_str().unwrap(),
    ]);
    let said = "tensor `transformer.wte.weight` has shape [256, 32], the model needs [320, 32]";
    assert_refused(&out, said);
    assert!(!runs.join("hf").exists(), "nothing is written");
}

/// The hub's openai-community/gpt2 model.safetensors, its values all 0: its names and shapes
/// (Conv1D matrices, a causal mask in each block, no lm_head), and a sparse data section.
fn gpt2_small_hub_file(path: &Path) {
    let (vocabulary, positions, width) = (50257, 1024, 768);
    let mut shapes: Vec<(String, Vec<usize>)> = vec![
        ("wte.weight".into(), vec![vocabulary, width]),
        ("wpe.weight".into(), vec![positions, width]),
        ("ln_f.weight".into(), vec![width]),
        ("ln_f.bias".into(), vec![width]),
    ];
    for i in 0..12 {
        for (name, shape) in [
            ("ln_1.weight", vec![width]),
            ("ln_1.bias", vec![width]),
            ("attn.bias", vec![1, 1, positions, positions]),
            ("attn.c_attn.weight", vec![width, 3 * width]),
            ("attn.c_attn.bias", vec![3 * width]),
            ("attn.c_proj.weight", vec![width, width]),
            ("attn.c_proj.bias", vec![width]),
            ("ln_2.weight", vec![width]),
            ("ln_2.bias", vec![width]),
            ("mlp.c_fc.weight", vec![width, 4 * width]),
            ("mlp.c_fc.bias", vec![4 * width]),
            ("mlp.c_proj.weight", vec![4 * width, width]),
            ("mlp.c_proj.bias", vec![width]),
        ] {
            shapes.push((format!("h.{i}.{name}"), shape));
        }
    }
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut end = 0;
    for (name, shape) in shapes {
        let start = end;
        end += shape.iter().product::<usize>() * 4;
        let entry =
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [start, end]});
        header.insert(name, entry);
    }
    let mut header = serde_json::to_vec(&header).unwrap();
    header.resize(header.len().next_multiple_of(8), b' ');
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header);
    std::fs::write(path, &bytes).unwrap();
    let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    file.set_len((bytes.len() + end) as u64).unwrap();
}

/// jobs/gpt2_finetune.toml is GPT-2 small, 124,439,808 parameters, and reads the hub's file.
#[test]
fn the_finetune_job_reads_the_hubs_gpt2_small() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    gpt2_small_hub_file(&file);
    let out = trainer(&[
        "check",
        "jobs/gpt2_finetune.toml",
        "--set",
        &format!("model.init_from='{}'", file.display()),
        "--set",
        "device.type='cpu'",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("total parameters: 124,439,808"), "{text}");
}

/// A model under nn.Sequential's names is told how to read a GPT's file.
#[test]
fn a_gpt_file_without_nanogpt_names_says_which_key_reads_it() {
    let dir = tempfile::tempdir().unwrap();
    let job_path = write_job(dir.path(), |text| {
        text.replace("state_dict_names = \"nanogpt\"\n", "")
    });
    let out = trainer(&["check", job_path.to_str().unwrap()]);
    assert_refused(&out, "with model.state_dict_names = \"nanogpt\"");
}

/// sample and eval read a job file as GPT-2 before training: its init_from weights, its
/// data's vocabulary.
#[test]
fn sample_and_eval_take_a_job_file_for_its_init_from_weights() {
    let dir = tempfile::tempdir().unwrap();
    let job_path = write_job(dir.path(), |text| text);
    let job_arg = job_path.to_str().unwrap();
    let sample = |seed: &str| {
        let out = trainer(&[
            "sample", job_arg, "--prompt", "KING", "--tokens", "20", "--seed", seed,
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let text = sample("3");
    assert!(text.starts_with("KING") && text.len() > 4, "{text:?}");
    assert_eq!(sample("3"), text, "the same seed draws the same text");

    let out = trainer(&["eval", job_arg]);
    assert!(out.status.success(), "{}", stderr(&out));
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(report.contains("perplexity"), "{report}");

    let out = trainer(&["sample", job_arg, "--checkpoint", job_arg]);
    assert_refused(&out, "is a job file");

    let untrained = dir.path().join("untrained.toml");
    let text = job(Path::new("x")).replace("init_from = \"x\"\n", "");
    std::fs::write(&untrained, text).unwrap();
    let out = trainer(&["sample", untrained.to_str().unwrap()]);
    assert_refused(&out, "this job has none");
}

/// sample writes each token as it is drawn, and stops when its reader goes away: a pipe
/// closed after the first bytes ends a draw of ten million tokens, quietly.
#[test]
fn sample_streams_and_stops_when_the_reader_goes() {
    use std::io::Read;
    use std::process::{Command, Stdio};
    let dir = tempfile::tempdir().unwrap();
    let job_path = write_job(dir.path(), |text| text);
    let mut child = Command::new(common::trainer_bin())
        .args(["sample", job_path.to_str().unwrap(), "--prompt", "KING"])
        .args(["--tokens", "10000000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut first = [0u8; 12];
    child.stdout.take().unwrap().read_exact(&mut first).unwrap();
    assert!(first.starts_with(b"KING"), "{first:?}");
    // The pipe is closed now. Without the stop, the draw would take many minutes.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            panic!("sample drew on after its reader went away");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
}

/// `--samples N` draws N texts from one seeded stream, a line of dashes between them, the
/// first the text one sample draws; `--prompt-file` reads the prompt from a file.
#[test]
fn sample_draws_several_texts_and_reads_its_prompt_from_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let job_path = write_job(dir.path(), |text| text);
    let prompt_file = dir.path().join("prompt.txt");
    std::fs::write(&prompt_file, "KING").unwrap();
    let sample = |extra: &[&str]| {
        let mut args = vec!["sample", job_path.to_str().unwrap(), "--tokens", "12"];
        args.extend(extra);
        trainer(&args)
    };
    let text = |out: std::process::Output| {
        assert!(out.status.success(), "{}", stderr(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let one = text(sample(&["--prompt", "KING"]));
    let three = text(sample(&["--prompt", "KING", "--samples", "3"]));
    let texts: Vec<&str> = three.split("\n---------------\n").collect();
    assert_eq!(texts.len(), 3, "{three:?}");
    assert_eq!(texts[0], one);
    assert!(texts.iter().all(|t| t.starts_with("KING")), "{texts:?}");
    assert!(
        texts[1] != texts[2],
        "the draws go on from one text to the next"
    );
    let from_file = text(sample(&["--prompt-file", prompt_file.to_str().unwrap()]));
    assert_eq!(from_file, one);

    let missing = dir.path().join("none.txt");
    let out = sample(&["--prompt-file", missing.to_str().unwrap()]);
    assert_refused(&out, "--prompt-file");
    let out = sample(&[
        "--prompt",
        "A",
        "--prompt-file",
        prompt_file.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
}

/// config.json beside the file tells what the shapes cannot: the heads, GELU's form, layer
/// norm's epsilon. A model that differs is refused, saying which key to set.
#[test]
fn a_gpt2_config_beside_the_file_is_checked() {
    let dir = tempfile::tempdir().unwrap();
    let weights = dir.path().join("model.safetensors");
    std::fs::copy(root().join(FIXTURE).join("model.safetensors"), &weights).unwrap();
    let config = std::fs::read_to_string(root().join(FIXTURE).join("config.json")).unwrap();
    let job_path = dir.path().join("job.toml");
    std::fs::write(&job_path, job(&weights)).unwrap();
    let check = |config: &str| {
        std::fs::write(dir.path().join("config.json"), config).unwrap();
        trainer(&["check", job_path.to_str().unwrap()])
    };
    let out = check(&config);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("the model matches its config.json"),
        "{}",
        stderr(&out)
    );
    for (from, to, said) in [
        (
            "\"n_head\": 2",
            "\"n_head\": 4",
            "n_head = 4, and the model's attention has 2 heads: set heads = 4",
        ),
        (
            "\"gelu_new\"",
            "\"gelu\"",
            "GELU's the exact form: set the gelu layer's approximate = \"none\"",
        ),
        (
            "\"layer_norm_epsilon\": 1e-05",
            "\"layer_norm_epsilon\": 1e-06",
            "layer_norm_epsilon = 0.000001",
        ),
    ] {
        assert!(config.contains(from), "{from}");
        let out = check(&config.replace(from, to));
        assert_refused(&out, said);
    }
}

/// sample from a job whose tokenizer fixes the vocabulary (bytes, gpt2) reads no data: a
/// corpus of gigabytes would be tokenized for nothing. eval reads it, and says when it is
/// missing.
#[test]
fn sampling_from_a_job_with_a_fixed_vocabulary_reads_no_data() {
    let dir = tempfile::tempdir().unwrap();
    let gone = dir.path().join("gone.txt");
    let job_path = write_job(dir.path(), |text| {
        let data = root().join("jobs/data/shakespeare.txt.gz");
        text.replace(&data.display().to_string(), &gone.display().to_string())
    });
    let job_arg = job_path.to_str().unwrap();
    let out = trainer(&["sample", job_arg, "--prompt", "KING", "--tokens", "5"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = trainer(&["eval", job_arg]);
    assert_refused(&out, "gone.txt");
}

/// `trainer export` writes a run's GPT-2 as transformers saves it. Read back with init_from,
/// it gives the run's own weights, bit for bit; transformers, where installed, computes the
/// run's logits from it.
#[test]
fn export_writes_what_init_from_and_transformers_read() {
    let dir = tempfile::tempdir().unwrap();
    let job_path = write_job(dir.path(), |text| text);
    let runs = dir.path().join("runs");
    let out = trainer(
        &["run", job_path.to_str().unwrap(), "-q", "--runs-dir"]
            .into_iter()
            .chain([runs.to_str().unwrap()])
            .collect::<Vec<_>>(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let run = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
    let exported = dir.path().join("hf");
    let out = trainer(&["export", run.to_str().unwrap(), exported.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let config = std::fs::read_to_string(exported.join("config.json")).unwrap();
    for field in [
        "\"n_head\": 2",
        "\"n_layer\": 2",
        "\"n_embd\": 32",
        "\"gelu_new\"",
    ] {
        assert!(config.contains(field), "{field}: {config}");
    }

    let graph = graph(dir.path(), &exported.join("model.safetensors"));
    let ours = weights::read(&run.join("model.safetensors"), &graph).unwrap();
    let back = weights::read(&exported.join("model.safetensors"), &graph).unwrap();
    assert!(
        ours.params == back.params,
        "the round trip changes the weights"
    );

    let out = trainer(&["export", run.to_str().unwrap(), exported.to_str().unwrap()]);
    assert_refused(&out, "never overwrites");

    let (input, _) = expected();
    transformers_computes_the_logits(&exported, graph, &ours.params, &input);
}

/// transformers' AutoModelForCausalLM, reading `exported`, computes the logits `graph` with
/// `params` computes for `input`, a window of ids a sample (tests/fixtures/
/// hf_from_pretrained.py). Skipped without a Python with torch, and without transformers.
fn transformers_computes_the_logits(exported: &Path, graph: Graph, params: &[f32], input: &[f32]) {
    let Some(python) = common::torch_python() else {
        println!("skipped transformers' half: no Python with torch");
        return;
    };
    let [block, vocabulary] = graph.output_shape()[..] else {
        panic!("a language model outputs [T, vocabulary]")
    };
    let n = input.len() / block;
    let logits = model_logits(graph, params, input);
    let dir = tempfile::tempdir().unwrap();
    let case = dir.path().join("case.safetensors");
    common::write_f32_safetensors(
        &case,
        &[
            ("input", input, vec![n, block]),
            ("expected", &logits, vec![n, block, vocabulary]),
        ],
    );
    let out = std::process::Command::new(&python)
        .arg(root().join("tests/fixtures/hf_from_pretrained.py"))
        .args([exported.to_str().unwrap(), case.to_str().unwrap()])
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), stderr(&out));
    println!("{python}: {text}");
    assert!(
        matches!(out.status.code(), Some(0 | 3)),
        "transformers disagrees:\n{text}"
    );
}

/// A GPT without GPT-2's biases, or a model not named as nanoGPT's, is not exported.
#[test]
fn export_refuses_a_model_gpt2_cannot_hold() {
    let dir = tempfile::tempdir().unwrap();
    let job_path = write_job(dir.path(), |text| {
        let text = text.replace("init_from = ", "init = \"gpt2\"\n# init_from = ");
        text.replace(
            "{ type = \"layernorm\", name = \"ln_f\" }",
            "{ type = \"layernorm\", bias = false, name = \"ln_f\" }",
        )
    });
    let run = common::run_job(&job_path, &dir.path().join("runs"), &[]);
    let run = run.to_str().unwrap();
    let out = trainer(&["export", run, dir.path().join("hf").to_str().unwrap()]);
    assert_refused(&out, "missing transformer.ln_f.bias");
    assert!(!dir.path().join("hf").exists(), "nothing is written");
}

/// jobs/llama_char.toml's run, exported, is transformers' LlamaForCausalLM: its config, the
/// fused projection split into q_proj, k_proj and v_proj, and, where transformers is
/// installed, the run's logits; model.init_from reads it back. With grouped-query
/// attention too: two key and value heads, `num_key_value_heads`, their projections 64 rows
/// each. With Llama 3.1's stretched rotary frequencies, `rope_scaling`. And with biases on
/// the fused projection, as Qwen2ForCausalLM.
#[test]
fn export_writes_a_llama_that_transformers_reads() {
    let grouped = [
        "model.blocks.layers[1].out=256",
        "model.blocks.layers[2].kv_heads=2",
        "model.blocks.layers[3].kv_heads=2",
    ];
    let stretched = [
        "model.blocks.layers[2].scaling = { type = \"llama3\", factor = 8.0, \
                      low_freq_factor = 1.0, high_freq_factor = 4.0, \
                      original_max_position_embeddings = 32 }",
    ];
    let biased = ["model.blocks.layers[1].bias=true"];
    for (sets, kv_heads) in [
        (&[][..], 4),
        (&grouped[..], 2),
        (&stretched[..], 4),
        (&biased[..], 4),
    ] {
        exports_a_llama(sets, kv_heads);
    }
}

/// jobs/llama_char.toml with `sets`, whose attention has `kv_heads`, exported and read back.
fn exports_a_llama(sets: &[&str], kv_heads: usize) {
    let dir = tempfile::tempdir().unwrap();
    let runs = dir.path().join("runs");
    let job = root().join("jobs/llama_char.toml");
    let base = ["train.max_steps=3", "device.type=\"cpu\""];
    let sets: Vec<String> = base.iter().chain(sets).map(|s| s.to_string()).collect();
    let args: Vec<&str> = sets.iter().flat_map(|s| ["--set", s.as_str()]).collect();
    let run = common::run_job(&job, &runs, &args);
    let exported = dir.path().join("hf");
    let out = trainer(&["export", run.to_str().unwrap(), exported.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let config = std::fs::read_to_string(exported.join("config.json")).unwrap();
    let kv_field = format!("\"num_key_value_heads\": {kv_heads}");
    // Biases on the fused projection make a Qwen2.
    let biased = sets.iter().any(|s| s.contains("bias=true"));
    let architecture = match biased {
        true => "\"Qwen2ForCausalLM\"",
        false => "\"LlamaForCausalLM\"",
    };
    for field in [
        architecture,
        "\"num_hidden_layers\": 4",
        "\"num_attention_heads\": 4",
        &kv_field,
        "\"head_dim\": 32",
        "\"intermediate_size\": 352",
        "\"rms_norm_eps\": 0.00001",
        "\"rope_theta\": 10000.0",
        "\"max_position_embeddings\": 64",
        "\"tie_word_embeddings\": false",
    ] {
        assert!(config.contains(field), "{field}: {config}");
    }
    let scaled = sets.iter().any(|s| s.contains("scaling"));
    assert_eq!(
        config.contains("\"rope_type\": \"llama3\""),
        scaled,
        "{config}"
    );

    let read = |path: &Path| std::fs::read(path).unwrap();
    let (ours, theirs) = (
        read(&run.join("model.safetensors")),
        read(&exported.join("model.safetensors")),
    );
    let (ours, theirs) = (
        SafeTensors::deserialize(&ours).unwrap(),
        SafeTensors::deserialize(&theirs).unwrap(),
    );
    let values = |file: &SafeTensors, name: &str| -> Vec<f32> {
        bytemuck::pod_collect_to_vec(file.tensor(name).unwrap().data())
    };
    // embed_tokens, norm and lm_head; nine a layer, the fused projection three (and its
    // bias three).
    assert_eq!(theirs.len(), 3 + 4 * (9 + 3 * usize::from(biased)));
    let fused = values(&ours, "layers2_self_attn_qkv_proj.weight");
    let mut first = 0;
    for (part, rows) in [
        ("q_proj", 128),
        ("k_proj", kv_heads * 32),
        ("v_proj", kv_heads * 32),
    ] {
        let name = format!("model.layers.2.self_attn.{part}.weight");
        assert_eq!(theirs.tensor(&name).unwrap().shape(), [rows, 128]);
        assert_eq!(values(&theirs, &name), fused[first * 128..][..rows * 128]);
        first += rows;
    }
    assert_eq!(first * 128, fused.len());
    assert_eq!(
        values(&theirs, "model.layers.3.mlp.down_proj.weight"),
        values(&ours, "layers3_mlp_down_proj.weight")
    );

    let spec = trainer::spec::load_job(&job, &sets).unwrap();
    let (block, vocabulary) = (64, 73);
    let data = DataShape {
        sample_shape: vec![block],
        classes: Some(vocabulary),
        classes_from: None,
        target_dim: block,
    };
    let graph = Graph::build(&spec, &data).unwrap();
    let w = weights::read(&run.join("model.safetensors"), &graph).unwrap();
    // model.init_from reads the exported file back to the same bits.
    let back = weights::read(&exported.join("model.safetensors"), &graph).unwrap();
    assert!(
        back.params == w.params,
        "the exported Llama reads back otherwise"
    );
    let input: Vec<f32> = (0..3 * block)
        .map(|i| ((i * 31 + 7) % vocabulary) as f32)
        .collect();
    transformers_computes_the_logits(&exported, graph, &w.params, &input);
}

/// A model that is neither a GPT named as nanoGPT's nor a Llama is refused, naming what a
/// Llama lacks; nothing is written.
#[test]
fn export_refuses_a_model_neither_gpt2_nor_llama_holds() {
    let dir = tempfile::tempdir().unwrap();
    let runs = dir.path().join("runs");
    let sets = [
        "--set",
        "train.max_steps=2",
        "--set",
        "model.state_dict_names=\"sequential\"",
    ];
    let run = common::run_job(&root().join("jobs/gpt_char.toml"), &runs, &sets);
    let hf = dir.path().join("hf");
    let out = trainer(&["export", run.to_str().unwrap(), hf.to_str().unwrap()]);
    assert_refused(
        &out,
        "cannot be written as Hugging Face's Llama: Llama has no layernorm",
    );
    assert_refused(&out, "model.state_dict_names = \"nanogpt\"");
    assert!(!hf.exists(), "nothing is written");
}
