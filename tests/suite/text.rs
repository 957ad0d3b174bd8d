//! Text data for language models: the char and bytes tokenizers, windows whose targets are the
//! next tokens, the validation split at the text's end, the vocabulary saved with the run, and
//! the errors for text that cannot be read as asked.

use crate::common::{self, run_job, spec, stderr, stdout, trainer};
use std::path::{Path, PathBuf};
use trainer::data;
use trainer::data::vocabulary::Vocabulary;
use trainer::spec::{StateDictNames, Tokenizer};

fn text_spec(path: &Path, extra: &str) -> trainer::spec::JobSpec {
    let mut s = spec(&format!(
        r#"
        [data]
        source = "text"
        path = "{}"
        block_size = 4
        {extra}
        [model]
        layers = [{{ type = "linear", out = 2 }}]
        [optimizer]
        type = "sgd"
        lr = 0.1
        "#,
        path.display()
    ));
    s.data.path = Some(path.to_path_buf());
    s
}

#[test]
fn a_text_is_windows_of_char_ids_whose_targets_are_the_next_characters() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("t.txt");
    std::fs::write(&path, "abcabcabcab").unwrap();
    let d = data::load(&text_spec(&path, "val_fraction = 0.5").data, 1).unwrap();
    let vocabulary = d.preprocess.vocabulary.as_ref().unwrap();
    assert_eq!(vocabulary.chars, "abc");
    assert_eq!(
        (d.classes, d.target_dim, d.sample_shape.clone()),
        (Some(3), 4, vec![4])
    );
    // 11 characters: the first 5 train (one window of 4 and its next), the last 6 validate.
    assert_eq!(
        (d.train.len, d.train.tokens.to_vec().unwrap()),
        (1, vec![0, 1, 2, 0, 1])
    );
    assert_eq!(d.train.windows, Some(1));
    let (name, val) = &d.eval[0];
    assert_eq!((*name, val.len, val.windows), ("val", 1, Some(4)));
    assert_eq!(vocabulary.decode(&vocabulary.encode("cab").unwrap()), "cab");
    assert_eq!(vocabulary.encode("abd"), Err('d'));
}

#[test]
fn bytes_read_any_file_and_bad_text_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let bad = tmp.path().join("bad.txt");
    std::fs::write(&bad, [b'a', b'b', 0xff, b'c', b'd', b'e']).unwrap();
    let e = data::load(&text_spec(&bad, "").data, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not UTF-8 text: byte 2"), "{e}");
    let d = data::load(&text_spec(&bad, "tokenizer = \"bytes\"").data, 1).unwrap();
    assert_eq!((d.classes, d.train.len), (Some(256), 2));

    let empty = tmp.path().join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let e = data::load(&text_spec(&empty, "").data, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("the file is empty"), "{e}");

    let short = tmp.path().join("short.txt");
    std::fs::write(&short, "abcd").unwrap();
    let e = data::load(&text_spec(&short, "").data, 1)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("holds 4 tokens, fewer than data.block_size + 1 = 5"),
        "{e}"
    );
}

/// data.tokenizer = "gpt2" gives tiktoken's r50k_base ids (GPT-2's), reads
/// `<|endoftext|>` in a text as plain text, and decodes what it encodes.
#[test]
fn the_gpt2_tokenizer_gives_gpt2s_ids() {
    let v = Vocabulary::of(Tokenizer::Gpt2, "");
    assert_eq!(v.len(), 50_257);
    assert_eq!(v.encode("Hello world").unwrap(), [15496, 995]);
    let special = v.encode("a<|endoftext|>").unwrap();
    assert!(!special.contains(&50_256), "{special:?}");
    let text = "O Romeo, Romeo! wherefore art thou Romeo?\n\u{e9}t\u{e9} \u{1F600}";
    assert_eq!(v.decode(&v.encode(text).unwrap()), text);
    // Ids past the vocabulary (a padded output layer's) write nothing.
    assert_eq!(v.decode(&[15496, 50_300, 995]), "Hello world");
}

/// A small GPT on text through GPT-2's tokenizer, its output layer padded to 50,304 as
/// llm.c's: it trains, saves the tokenizer, and `trainer sample` continues a prompt in it.
/// data.classes below the vocabulary is refused; a padded output layer without it is told
/// to set it.
#[test]
fn a_gpt_on_gpt2_tokens_trains_and_samples() {
    let tmp = tempfile::tempdir().unwrap();
    let job = small_gpt(tmp.path());
    let text = "The king is dead. Long live the king! The queen is dead. ".repeat(40);
    std::fs::write(tmp.path().join("t.txt"), text).unwrap();
    let runs = tmp.path().join("runs");
    let sets = [
        "data.tokenizer='gpt2'",
        "data.classes=50304",
        "model.layers[0].num_embeddings=50304",
        "model.layers[4].out=50304",
        "train.max_steps=4",
        "train.eval_every_steps=4",
    ];
    let args: Vec<&str> = sets.iter().flat_map(|s| ["--set", *s]).collect();
    let dir = run_job(&job, &runs, &args);
    let preprocess = std::fs::read_to_string(dir.join("preprocess.json")).unwrap();
    assert!(
        preprocess.contains("\"tokenizer\": \"gpt2\""),
        "{preprocess}"
    );
    let run = dir.to_str().unwrap();
    let out = trainer(&["sample", run, "--prompt", "The king", "--tokens", "5"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let written = stdout(&out);
    let v = Vocabulary::of(Tokenizer::Gpt2, "");
    let ids = v.encode(&written).unwrap();
    assert!(
        written.starts_with("The king") && ids.len() >= 6,
        "{written:?} is {ids:?}"
    );

    let mut args = vec!["run", job.to_str().unwrap(), "--runs-dir"];
    args.push(runs.to_str().unwrap());
    args.extend([
        "--set",
        "data.tokenizer='gpt2'",
        "--set",
        "data.classes=1000",
    ]);
    let out = trainer(&args);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(
            "data.classes = 1000 is smaller than the vocabulary of data.tokenizer = \"gpt2\""
        ),
        "{}",
        stderr(&out)
    );

    let padded = [
        "data.tokenizer='gpt2'",
        "model.layers[0].num_embeddings=50304",
        "model.layers[4].out=50304",
    ];
    let mut args = vec!["run", job.to_str().unwrap(), "--runs-dir"];
    args.push(runs.to_str().unwrap());
    args.extend(padded.iter().flat_map(|s| ["--set", *s]));
    let out = trainer(&args);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(
            "outputs [8, 50304]: 50304 logits at each of 8 positions, but the data has 50257 \
             classes; set data.classes = 50304 to pad the vocabulary, or make the last layer's \
             out 50257"
        ),
        "{}",
        stderr(&out)
    );
}

/// jobs/gpt_char.toml, shortened, trains on the bundled text: its loss falls from ln(73), the
/// run keeps the vocabulary, and `trainer sample` writes with it.
#[test]
fn the_char_gpt_job_trains_and_samples_with_its_vocabulary() {
    let tmp = tempfile::tempdir().unwrap();
    let sets = [
        "train.max_steps=30",
        "train.log_every=10",
        "data.val_fraction=0.001",
        "optimizer.schedule.warmup_steps=5",
        "train.eval_every_steps=10",
        "train.eval_steps=1",
    ];
    let args: Vec<&str> = sets.iter().flat_map(|s| ["--set", *s]).collect();
    let dir = run_job(Path::new("jobs/gpt_char.toml"), tmp.path(), &args);
    let metrics = std::fs::read_to_string(dir.join("metrics.csv")).unwrap();
    let losses: Vec<f64> = metrics
        .lines()
        .skip(1)
        .filter(|l| l.contains(",train,"))
        .map(|l| l.split(',').nth(3).unwrap().parse().unwrap())
        .collect();
    assert_eq!(losses.len(), 3, "{metrics}");
    // Evaluations every 10 steps (of one batch), and the final one after step 30.
    let val_steps: Vec<&str> = (metrics.lines())
        .filter(|l| l.contains(",val,"))
        .map(|l| l.split(',').next().unwrap())
        .collect();
    assert_eq!(val_steps, ["10", "20", "30"], "{metrics}");
    // A loss at each of the 64 positions: tokens/s is 64 × samples/s (both rounded).
    let rows: Vec<Vec<String>> = (metrics.lines())
        .map(|l| l.split(',').map(str::to_string).collect())
        .collect();
    for row in rows[1..].iter().filter(|r| r[2] == "train") {
        let per_sec = |name| common::column(&rows[0], row, name).parse::<f64>().unwrap();
        let (samples, tokens) = (per_sec("samples_per_sec"), per_sec("tokens_per_sec"));
        assert!((tokens - 64.0 * samples).abs() <= 32.0, "{row:?}");
        // The model's FLOPs a sample (`trainer check` prints 332.2 MFLOP), times samples/s
        // (rounded to a whole number in the file).
        let flops = per_sec("flops_per_sec");
        assert!(
            (flops - 332.2e6 * samples).abs() <= 0.5 * 332.2e6 + 0.001 * flops,
            "{row:?}"
        );
        assert_eq!(
            common::column(&rows[0], row, "mfu"),
            "",
            "no datasheet peak on a CPU"
        );
    }
    assert!(losses[2] < 0.85 * 73f64.ln(), "{losses:?}");
    let preprocess = std::fs::read_to_string(dir.join("preprocess.json")).unwrap();
    assert!(
        preprocess.contains("\"tokenizer\": \"char\""),
        "{preprocess}"
    );

    let run = dir.to_str().unwrap();
    // Evaluation reads the split's windows, as training's evaluation does.
    let out = trainer(&["eval", run]);
    assert!(out.status.success(), "{}", stderr(&out));
    let metric = |name: &str| -> f64 {
        let text = stdout(&out);
        let line = text.lines().find(|l| l.trim_start().starts_with(name));
        let value = line.and_then(|l| l.split_whitespace().nth(1));
        value
            .unwrap_or_else(|| panic!("no {name}: {text}"))
            .parse()
            .unwrap()
    };
    let loss = metric("loss");
    assert!(loss > 0.0 && loss < 73f64.ln(), "{}", stdout(&out));
    assert!((metric("perplexity") - loss.exp()).abs() < 1e-4 * loss.exp());
    assert!(
        !stdout(&out).contains("accuracy by class"),
        "{}",
        stdout(&out)
    );

    let out = trainer(&["predict", run, "x.csv", "--output", "y.csv"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("is a language model's run (data.source = \"text\")")
            && stderr(&out).contains("trainer sample"),
        "{}",
        stderr(&out)
    );

    let sample = |extra: &[&str]| {
        let mut args = vec!["sample", run, "--tokens", "40"];
        args.extend_from_slice(extra);
        trainer(&args)
    };
    let out = sample(&["--prompt", "KING", "--seed", "7", "--top-k", "10"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.starts_with("KING") && text.chars().count() >= 44,
        "{text:?}"
    );
    let again = sample(&["--prompt", "KING", "--seed", "7", "--top-k", "10"]);
    assert_eq!(stdout(&again), text, "the same seed, the same text");
    let nucleus = sample(&["--prompt", "KING", "--seed", "7", "--top-p", "0.9"]);
    assert!(nucleus.status.success(), "{}", stderr(&nucleus));
    assert!(stdout(&nucleus).starts_with("KING"), "{}", stdout(&nucleus));
    for p in ["0", "1.5"] {
        let out = sample(&["--top-p", p]);
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        let want = format!("--top-p {p}: must be above 0 and at most 1");
        assert!(stderr(&out).contains(&want), "{}", stderr(&out));
    }
    let out = sample(&["--temperature", "0"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("pass --top-k 1"), "{}", stderr(&out));
    let out = sample(&["--samples", "0"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("--samples 0: must be at least 1"),
        "{}",
        stderr(&out)
    );
    let out = sample(&["--prompt", "KING\u{e9}"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("is not in the run's vocabulary"),
        "{}",
        stderr(&out)
    );
    let out = sample(&["--device", "tpu"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("--device tpu: not a device; allowed: cpu, cuda, cuda:N"),
        "{}",
        stderr(&out)
    );
}

/// jobs/gpt_shakespeare.toml is nanoGPT's shakespeare_char model (10.65M parameters there
/// without the position table and with 65 characters; 73 here), and trains with its dropout:
/// two short steps on the CPU, in bf16 as the job asks.
#[test]
fn the_shakespeare_gpt_job_is_nanogpts_and_trains_with_dropout() {
    let out = trainer(&[
        "check",
        "jobs/gpt_shakespeare.toml",
        "--set",
        "device.type='cpu'",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let without_wpe_with_65 = 10_748_160 - 256 * 384 - (73 - 65) * 384;
    assert_eq!(without_wpe_with_65, 10_646_784);
    assert!(text.contains("total parameters: 10,748,160"), "{text}");
    let tmp = tempfile::tempdir().unwrap();
    let sets = [
        "device.type='cpu'",
        "train.max_steps=2",
        "data.batch_size=2",
        "train.eval_every_steps=2",
        "train.eval_steps=1",
        "train.log_every=1",
    ];
    let args: Vec<&str> = sets.iter().flat_map(|s| ["--set", *s]).collect();
    let dir = run_job(Path::new("jobs/gpt_shakespeare.toml"), tmp.path(), &args);
    let losses = losses(&dir);
    assert_eq!(losses.len(), 3, "two steps and an evaluation: {losses:?}");
    assert!(
        losses.iter().all(|l| (l - 73f64.ln()).abs() < 1.0),
        "{losses:?}"
    );
}

/// model.init = "gpt2": matrices N(0, 0.02), the projections into the residual stream
/// N(0, 0.02/√P) with P of them (2·L in a GPT of L blocks), biases 0, norm scales 1
/// (nanoGPT's _init_weights).
#[test]
fn gpt2_initialisation_is_nanogpts() {
    let job = spec(
        r#"
        [data]
        source = "synthetic"
        [model]
        init = "gpt2"
        layers = [
          { type = "layernorm", name = "ln" },
          { type = "linear", out = 384, name = "c_attn" },
          { type = "attention", heads = 2 },
          { type = "linear", out = 128, name = "c_proj" },
          { type = "linear", out = 384, bias = false },
          { type = "attention", heads = 1 },
          { type = "linear", out = 128, name = "mlp_c_proj" },
        ]
        [loss]
        type = "mse"
        [optimizer]
        type = "sgd"
        lr = 0.1
        "#,
    );
    let data = trainer::graph::DataShape {
        sample_shape: vec![8, 128],
        classes: None,
        classes_from: None,
        target_dim: 1024,
    };
    let graph = trainer::graph::Graph::build(&job, &data).unwrap();
    let params = graph.init_params(3);
    let tensor = |name: &str| {
        let e = graph
            .state_dict_entries()
            .into_iter()
            .find(|e| e.name == name)
            .unwrap();
        let len: usize = e.shape.iter().product();
        params[e.offset..e.offset + len].to_vec()
    };
    let std =
        |v: &[f32]| (v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / v.len() as f64).sqrt();
    assert!((std(&tensor("c_attn.weight")) - 0.02).abs() < 0.001);
    // Two projections, c_proj and mlp_c_proj: 0.02/√2.
    assert!((std(&tensor("c_proj.weight")) - 0.02 / 2f64.sqrt()).abs() < 0.0007);
    assert!(tensor("c_attn.bias").iter().all(|&b| b == 0.0));
    assert!(tensor("ln.weight").iter().all(|&g| g == 1.0));
}

/// `init_values` of tests/fixtures/make_gpt_reference.py: tensor `index`'s stream of a
/// 64-bit LCG, each value its top 24 bits scaled to about ±0.035, exact in f32.
fn init_values(index: usize, n: usize) -> Vec<f32> {
    let mut state = (index as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (((state >> 40) as f64 / 16_777_216.0 * 2.0 - 1.0) * 0.0346) as f32
        })
        .collect()
}

/// jobs/gpt_char.toml's first 50 steps give PyTorch's losses (nanoGPT's model and AdamW
/// groups, tests/fixtures/make_gpt_reference.py) within 1e-4, from the same initial weights
/// over the same batches; with device.flash_attention too.
#[test]
fn the_char_gpt_follows_pytorch_for_50_steps() {
    // The initial weights, in PyTorch's order of its tensors (the output layer is tied).
    let mut names = vec!["wte".to_string(), "wpe".to_string()];
    for i in 0..4 {
        for part in [
            "ln_1",
            "attn_c_attn",
            "attn_c_proj",
            "ln_2",
            "mlp_c_fc",
            "mlp_c_proj",
        ] {
            names.push(format!("h{i}_{part}"));
        }
    }
    names.push("ln_f".into());
    let shape = |name: &str| match name {
        "wte" => vec![73, 128],
        "wpe" => vec![64, 128],
        n if n.contains("ln_") => vec![128],
        n if n.ends_with("c_attn") => vec![384, 128],
        n if n.ends_with("c_fc") => vec![512, 128],
        n if n.ends_with("mlp_c_proj") => vec![128, 512],
        _ => vec![128, 128],
    };
    // The job names its tensors as nanoGPT does, which init_from reads.
    let mut tensors = initial_tensors(&names, shape, |name| StateDictNames::Nanogpt.prefix(name));
    assert_eq!(tensors[3].0, "transformer.h.0.attn.c_attn.weight");
    tensors.push(("lm_head.weight".into(), vec![73, 128], tensors[0].2.clone()));
    follows_pytorch("gpt_char", "gpt_reference.json", &tensors, &[]);
}

/// jobs/llama_char.toml's first 50 steps give PyTorch's losses (Hugging Face's Llama layer
/// written out, tests/fixtures/make_llama_reference.py) within 1e-4, as the GPT's: RMSNorm,
/// rotary embedding, the gated MLP with SiLU, untied embeddings.
#[test]
fn the_char_llama_follows_pytorch_for_50_steps() {
    let tensors = llama_char_tensors(384);
    follows_pytorch("llama_char", "llama_reference.json", &tensors, &[]);
}

/// The same with grouped-query attention: two key and value heads of 32 values, each shared
/// by two of the four query heads, so the fused projection has 128 + 2·64 outputs.
#[test]
fn the_char_llama_with_grouped_query_attention_follows_pytorch_for_50_steps() {
    let tensors = llama_char_tensors(256);
    let sets = [
        "model.blocks.layers[1].out=256",
        "model.blocks.layers[2].kv_heads=2",
        "model.blocks.layers[3].kv_heads=2",
    ];
    follows_pytorch("llama_char", "llama_gqa_reference.json", &tensors, &sets);
}

/// jobs/llama_char.toml's initial tensors as the fixtures' script makes them, its fused
/// projection `qkv_rows` high.
fn llama_char_tensors(qkv_rows: usize) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut names = vec!["embed_tokens".to_string()];
    for i in 0..4 {
        for part in [
            "input_layernorm",
            "self_attn_qkv_proj",
            "self_attn_o_proj",
            "post_attention_layernorm",
            "mlp_gate_proj",
            "mlp_up_proj",
            "mlp_down_proj",
        ] {
            names.push(format!("layers{i}_{part}"));
        }
    }
    names.extend(["norm".into(), "lm_head".into()]);
    let shape = |name: &str| match name {
        "embed_tokens" | "lm_head" => vec![73, 128],
        n if n.ends_with("norm") => vec![128],
        n if n.ends_with("qkv_proj") => vec![qkv_rows, 128],
        n if n.ends_with("o_proj") => vec![128, 128],
        n if n.ends_with("down_proj") => vec![128, 352],
        _ => vec![352, 128],
    };
    initial_tensors(&names, shape, |name| name.to_string())
}

/// Each layer's weight, named by `name`: 1 for the 1-D scales, else `init_values` of its
/// index, as the fixtures' scripts initialise.
fn initial_tensors(
    layers: &[String],
    shape: impl Fn(&str) -> Vec<usize>,
    name: impl Fn(&str) -> String,
) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    (layers.iter().enumerate())
        .map(|(index, layer)| {
            let shape = shape(layer);
            let n = shape.iter().product();
            let values = match shape.len() {
                1 => vec![1.0; n],
                _ => init_values(index, n),
            };
            (format!("{}.weight", name(layer)), shape, values)
        })
        .collect()
}

/// jobs/JOB.toml's first 50 steps from `tensors`, without shuffling and with `sets` (each a
/// `--set`), give the losses of tests/fixtures/FIXTURE within 1e-4 relative, with and without
/// flash attention (whose backward computes the probabilities again).
fn follows_pytorch(
    job: &str,
    fixture: &str,
    tensors: &[(String, Vec<usize>, Vec<f32>)],
    sets: &[&str],
) {
    let path = crate::common::root().join("tests/fixtures").join(fixture);
    let fixture: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let want: Vec<f64> = (fixture["losses"].as_array().unwrap().iter())
        .map(|v| v.as_f64().unwrap())
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    let init = tmp.path().join("init.safetensors");
    let views: Vec<(&str, &[f32], Vec<usize>)> = (tensors.iter())
        .map(|(name, shape, values)| (name.as_str(), values.as_slice(), shape.clone()))
        .collect();
    common::write_f32_safetensors(&init, &views);

    let init_from = format!("model.init_from={:?}", init.to_str().unwrap());
    let job = format!("jobs/{job}.toml");
    for flash in ["false", "true"] {
        let flash_set = format!("device.flash_attention={flash}");
        let mut args = vec![
            "run",
            &job,
            "-q",
            "--runs-dir",
            tmp.path().to_str().unwrap(),
            "--set",
            &init_from,
            "--set",
            "data.shuffle=false",
            "--set",
            "train.max_steps=50",
            "--set",
            "train.log_every=1",
            "--set",
            "optimizer.schedule.warmup_steps=10",
            "--set",
            "device.type=\"cpu\"",
            "--set",
            &flash_set,
        ];
        args.extend(sets.iter().flat_map(|s| ["--set", *s]));
        let out = trainer(&args);
        assert!(out.status.success(), "{}", stderr(&out));
        let dir = std::path::PathBuf::from(stdout(&out).trim());
        let metrics = std::fs::read_to_string(dir.join("metrics.csv")).unwrap();
        let got: Vec<f64> = (metrics.lines().skip(1))
            .filter(|l| l.contains(",train,"))
            .map(|l| l.split(',').nth(3).unwrap().parse().unwrap())
            .collect();
        assert_eq!(got.len(), want.len());
        let mut largest = 0.0f64;
        for (step, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-4 * w,
                "{job}, flash {flash}: step {}: trainer {g}, PyTorch {w}",
                step + 1
            );
            largest = largest.max((g - w).abs() / w);
        }
        println!("{job}, flash {flash}: largest relative difference over 50 steps: {largest:.1e}");
    }
}

/// An embedding smaller than the text's vocabulary: the first token past it is named by its
/// place in the text.
#[test]
fn a_token_past_the_embedding_table_is_named_by_its_place_in_the_text() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("t.txt"), "abcabcabcabcd").unwrap();
    let job = tmp.path().join("job.toml");
    std::fs::write(
        &job,
        r#"
        [data]
        source = "text"
        path = "t.txt"
        block_size = 4
        [model]
        layers = [{ type = "embedding", num_embeddings = 3, embedding_dim = 2 },
                  { type = "linear", out = 4 }]
        [optimizer]
        type = "sgd"
        lr = 0.1
        "#,
    )
    .unwrap();
    let out = trainer(&["check", job.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let e = stderr(&out);
    assert!(
        e.contains("the train data holds 3 (") && e.contains("t.txt: token 12)"),
        "{e}"
    );
    assert!(!e.contains("normalize"), "{e}");
}

/// A small GPT: two repeated blocks of attention and an MLP, on a generated text.
const SMALL_GPT: &str = r#"
[job]
seed = 7
[data]
source = "text"
path = "t.txt"
block_size = 8
batch_size = 4
val_fraction = 0.1
[model]
init = "gpt2"
layers = [
  { type = "embedding", num_embeddings = 12, embedding_dim = 16, name = "wte" },
  { type = "position_embedding", num_positions = 8, name = "wpe" },
  { type = "repeat", block = "h", times = 2 },
  { type = "layernorm", name = "ln_f" },
  { type = "linear", out = 12, bias = false, tied_to = "wte", name = "lm_head" },
]
[model.blocks]
h = [
  { type = "layernorm", name = "ln_1" },
  { type = "linear", out = 48, name = "attn_c_attn" },
  { type = "attention", heads = 2 },
  { type = "linear", out = 16, name = "attn_c_proj" },
  { type = "add", inputs = ["block_input", "attn_c_proj"], name = "attn_out" },
  { type = "layernorm", name = "ln_2" },
  { type = "linear", out = 64, name = "mlp_c_fc" },
  { type = "gelu" },
  { type = "linear", out = 16, name = "mlp_c_proj" },
  { type = "add", inputs = ["attn_out", "mlp_c_proj"] },
]
[loss]
type = "cross_entropy"
[optimizer]
type = "adamw"
lr = 3e-3
weight_decay = 0.1
weight_decay_on = "matrices"
[train]
max_steps = 30
log_every = 5
eval_every_steps = 10
eval_steps = 2
clip_grad_norm = 1.0
[checkpoint]
every_steps = 10
"#;

/// The small GPT's model with Llama's layers: RMSNorm, rotary embedding, grouped-query
/// attention (two query heads of 8 values share one key and value head), a SiLU-gated MLP,
/// untied embeddings.
const SMALL_LLAMA_MODEL: &str = r#"[model]
init = "gpt2"
layers = [
  { type = "embedding", num_embeddings = 12, embedding_dim = 16, name = "embed_tokens" },
  { type = "repeat", block = "h", times = 2 },
  { type = "rmsnorm", name = "norm" },
  { type = "linear", out = 12, bias = false, name = "lm_head" },
]
[model.blocks]
h = [
  { type = "rmsnorm", name = "input_layernorm" },
  { type = "linear", out = 32, bias = false, name = "qkv_proj" },
  { type = "rotary", heads = 2, kv_heads = 1 },
  { type = "attention", heads = 2, kv_heads = 1 },
  { type = "linear", out = 16, bias = false, name = "o_proj" },
  { type = "add", inputs = ["block_input", "o_proj"], name = "attn_out" },
  { type = "rmsnorm", name = "post_attention_layernorm" },
  { type = "linear", out = 24, bias = false, name = "gate_proj" },
  { type = "silu", name = "act" },
  { type = "linear", out = 24, bias = false, inputs = ["post_attention_layernorm"], name = "up_proj" },
  { type = "multiply", inputs = ["act", "up_proj"], name = "gated" },
  { type = "linear", out = 16, bias = false, name = "down_proj" },
  { type = "add", inputs = ["attn_out", "down_proj"] },
]
"#;

/// The small GPT, and the same with Llama's layers, each with the `--set` arguments that
/// drop its attention probabilities (0.2).
pub(crate) fn small_models(dir: &Path) -> [(&'static str, PathBuf, [&'static str; 2]); 2] {
    let gpt = small_gpt(dir);
    let (head, rest) = SMALL_GPT.split_once("[model]").unwrap();
    let (_, training) = rest.split_once("[loss]").unwrap();
    let llama = dir.join("llama.toml");
    std::fs::write(&llama, format!("{head}{SMALL_LLAMA_MODEL}[loss]{training}")).unwrap();
    [
        ("gpt", gpt, ATTENTION_DROPOUT),
        ("llama", llama, ["--set", "model.blocks.h[3].dropout=0.2"]),
    ]
}

/// The small GPT's job file and text in `dir`.
pub(crate) fn small_gpt(dir: &Path) -> std::path::PathBuf {
    let text: String = (0..3000)
        .map(|i| (b'a' + ((i * 7 + i / 13) % 12) as u8) as char)
        .collect();
    std::fs::write(dir.join("t.txt"), text).unwrap();
    let job = dir.join("job.toml");
    std::fs::write(&job, SMALL_GPT).unwrap();
    job
}

/// The loss of every metrics.csv row, train and val.
pub(crate) fn losses(dir: &Path) -> Vec<f64> {
    (metrics_without_timing(dir).iter().skip(1))
        .map(|l| l.split(',').nth(3).unwrap().parse().unwrap())
        .collect()
}

/// metrics.csv without its timing columns.
fn metrics_without_timing(dir: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(dir.join("metrics.csv")).unwrap();
    let header: Vec<&str> = text.lines().next().unwrap().split(',').collect();
    (text.lines())
        .map(|l| {
            (l.split(',').zip(&header))
                .filter(|(_, h)| !common::TIMING_COLUMNS.contains(h))
                .map(|(v, _)| v)
                .collect::<Vec<_>>()
                .join(",")
        })
        .collect()
}

/// An error in a repeated block's layer names the block's key, as the job writes it, and
/// where the bad value came from: not the layer's place once the copies are written out.
#[test]
fn errors_in_a_repeated_block_name_the_blocks_key() {
    let tmp = tempfile::tempdir().unwrap();
    let job = small_gpt(tmp.path());
    let refused = |set: &str, want: &str| {
        let out = trainer(&["check", job.to_str().unwrap(), "--set", set]);
        assert_eq!(out.status.code(), Some(2), "{set}: {}", stderr(&out));
        assert!(stderr(&out).contains(want), "{set}: {}", stderr(&out));
        assert!(
            !stderr(&out).contains("model.layers[4]"),
            "{}",
            stderr(&out)
        );
        stderr(&out)
    };
    refused(
        "model.blocks.h[2].heads=3",
        "--set model.blocks.h[2].heads: model.blocks.h[2] (attention): ",
    );
    let copies = refused("model.blocks.h[2].heads=0", "model.blocks.h[2].heads");
    let once = "key `model.blocks.h[2].heads`: 0 given";
    assert_eq!(copies.matches(once).count(), 1, "not once a copy: {copies}");
    refused(
        "model.blocks.h[4].inputs=['nowhere', 'attn_c_proj']",
        "model.blocks.h[4] (add \"h0_attn_out\"): input \"nowhere\" is not the name",
    );
}

/// Dropout on the small GPT's attention probabilities, as `--set` arguments.
const ATTENTION_DROPOUT: [&str; 2] = ["--set", "model.blocks.h[2].dropout=0.2"];

/// `trainer eval` reads a text's splits in windows a block apart, the training split's too
/// (training reads one at every token), and reports perplexity beside the loss.
#[test]
fn eval_reads_a_texts_splits_a_block_apart() {
    let tmp = tempfile::tempdir().unwrap();
    let job = small_gpt(tmp.path());
    let dir = run_job(
        &job,
        &tmp.path().join("runs"),
        &["--set", "train.max_steps=10"],
    );
    let run = dir.to_str().unwrap();
    // 3,000 characters: 2,700 train and 300 validate, in windows of 8 and the token after.
    for (split, windows) in [("train", 2699 / 8), ("val", 299 / 8)] {
        let out = trainer(&["eval", run, "--split", split]);
        assert!(out.status.success(), "{}", stderr(&out));
        let text = stdout(&out);
        assert!(
            text.starts_with(&format!("{split} ({windows} samples)")),
            "{text}"
        );
        let metric = |name: &str| -> f64 {
            let line = text
                .lines()
                .find(|l| l.trim_start().starts_with(name))
                .unwrap();
            line.split_whitespace().nth(1).unwrap().parse().unwrap()
        };
        let loss = metric("loss");
        assert!(loss > 0.0 && loss < 12f64.ln(), "{text}");
        assert!(
            (metric("perplexity") - loss.exp()).abs() < 1e-4 * loss.exp(),
            "{text}"
        );
    }
}

/// A GPT run resumed from its step-20 checkpoint, with gradient accumulation, activation
/// checkpointing and attention dropout, ends as the uninterrupted run: the same windows in
/// the same order, the same masks, the same losses and the same final weights, bit for bit.
/// So does a Llama's.
#[test]
fn a_resumed_gpt_or_llama_run_gives_the_uninterrupted_run_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    for (model, job, dropout) in small_models(tmp.path()) {
        let runs = tmp.path().join(model);
        let sets = [
            "--set",
            "train.grad_accum_steps=2",
            "--set",
            "checkpoint.activations=\"all\"",
            dropout[0],
            dropout[1],
        ];
        let full = run_job(&job, &runs, &sets);
        let crashed = tmp.path().join(format!("{model}-crashed"));
        std::fs::create_dir_all(crashed.join("checkpoints")).unwrap();
        for name in ["metrics.csv", "config.toml", "train.log"] {
            std::fs::copy(full.join(name), crashed.join(name)).unwrap();
        }
        for step in ["step-00000010.safetensors", "step-00000020.safetensors"] {
            let (from, to) = (full.join("checkpoints"), crashed.join("checkpoints"));
            std::fs::copy(from.join(step), to.join(step)).unwrap();
        }
        let resume = [&sets[..], &["--resume", crashed.to_str().unwrap()]].concat();
        run_job(&job, &runs, &resume);
        assert_eq!(
            metrics_without_timing(&crashed),
            metrics_without_timing(&full),
            "{model}"
        );
        assert_eq!(
            std::fs::read(crashed.join("model.safetensors")).unwrap(),
            std::fs::read(full.join("model.safetensors")).unwrap(),
            "{model}"
        );
    }
}

/// Activation checkpointing recomputes a segment's forward pass in backward: a GPT and a
/// Llama train to the same bits with it as without it.
#[test]
fn activation_checkpointing_trains_a_gpt_and_a_llama_to_the_same_bits() {
    let tmp = tempfile::tempdir().unwrap();
    for (model, job, dropout) in small_models(tmp.path()) {
        let runs = tmp.path().join(model);
        let plain = run_job(&job, &runs, &dropout);
        let all = ["--set", "checkpoint.activations=\"all\""];
        let recomputed = run_job(&job, &runs, &[&dropout[..], &all].concat());
        assert_eq!(
            std::fs::read(plain.join("model.safetensors")).unwrap(),
            std::fs::read(recomputed.join("model.safetensors")).unwrap(),
            "{model}"
        );
    }
}

/// Two replicas in threads train the small GPT as one device does: each takes half of every
/// micro-batch's windows and draws the attention dropout masks one device would for them,
/// and the averaged gradients give the same losses up to rounding. So do a Llama's.
#[test]
fn a_gpt_or_llama_on_two_replicas_follows_one_device() {
    let tmp = tempfile::tempdir().unwrap();
    for (model, job, dropout) in small_models(tmp.path()) {
        let runs = tmp.path().join(model);
        let one = run_job(&job, &runs, &dropout);
        let two = run_job(
            &job,
            &runs,
            &[&dropout[..], &["--set", "parallel.replicas=2"]].concat(),
        );
        let (a, b) = (losses(&one), losses(&two));
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-5 * x.abs(), "{model}: {a:?}\n{b:?}");
        }
        let without_dropout = losses(&run_job(&job, &runs, &[]));
        assert_ne!(without_dropout, a, "{model}: the dropout was not applied");
    }
}

/// The small GPT in bf16 (emulated on the CPU: half-width values, f32 master weights)
/// follows its fp32 run: every loss within 2%. So does the Llama.
#[test]
fn a_gpt_or_llama_in_bf16_follows_its_fp32_run() {
    let tmp = tempfile::tempdir().unwrap();
    for (model, job, _) in small_models(tmp.path()) {
        let runs = tmp.path().join(model);
        let fp32 = run_job(&job, &runs, &[]);
        let bf16 = run_job(&job, &runs, &["--set", "precision.mode=\"bf16\""]);
        let (a, b) = (losses(&fp32), losses(&bf16));
        assert_eq!(a.len(), b.len());
        assert!(a != b, "{model}: bf16 gave fp32's bits: was it applied?");
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 0.02 * x.abs(), "{model}: {a:?}\n{b:?}");
        }
    }
}

/// A model that reads one token a step takes only layers that read one position at a time:
/// a flatten, which mixes the positions, is refused by name; a GPT's layers are taken.
#[test]
fn decoding_refuses_a_layer_that_reads_the_whole_sequence() {
    use trainer::graph::{DataShape, Graph};
    let job = |layers: &str| {
        common::spec(&format!(
            "[data]\nsource = \"text\"\npath = \"x.txt\"\nblock_size = 8\n\
             [model]\nlayers = [{layers}]\n[optimizer]\ntype = \"adam\"\nlr = 1e-3\n"
        ))
    };
    let one_token = DataShape {
        sample_shape: vec![1],
        classes: Some(10),
        classes_from: None,
        target_dim: 1,
    };
    let embedding = "{ type = \"embedding\", num_embeddings = 10, embedding_dim = 8 }";
    let flat = job(&format!(
        "{embedding}, {{ type = \"flatten\" }}, {{ type = \"linear\", out = 10 }}"
    ));
    let err = Graph::for_decoding(&flat, &one_token, 8)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("flatten") && err.contains("one position at a time"),
        "{err}"
    );
    let gpt = job(&format!(
        "{embedding}, {{ type = \"position_embedding\", num_positions = 8 }}, \
         {{ type = \"linear\", out = 24 }}, {{ type = \"attention\", heads = 2 }}, \
         {{ type = \"layernorm\" }}, {{ type = \"linear\", out = 10 }}"
    ));
    assert!(Graph::for_decoding(&gpt, &one_token, 8).is_ok());
}

/// A GPT's model FLOPs, as `trainer check` prints them (and train rows' flops_per_sec and
/// MFU count them), are nanoGPT's `estimate_mfu`: 6N + 12·L·H·Q·T a token, N the
/// parameters but the position table, over T tokens a sample.
#[test]
fn a_gpts_model_flops_are_nanogpts_estimate() {
    let out = trainer(&["check", "jobs/gpt_char.toml"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let (n, (l, h, q, t)) = (805_120.0 - 64.0 * 128.0, (4.0, 4.0, 32.0, 64.0));
    let nanogpt = (6.0 * n + 12.0 * l * h * q * t) * t;
    let ours = common::flops_a_sample(&text);
    assert!(
        (ours / nanogpt - 1.0).abs() < 0.01,
        "{ours} against {nanogpt}: {text}"
    );
    assert!(
        text.contains("332.2 MFLOP a sample, 4.0 GFLOP an optimizer step of 12 samples"),
        "{text}"
    );
}
