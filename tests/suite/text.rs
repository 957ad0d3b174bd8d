//! Text data for language models: the char and bytes tokenizers, windows whose targets are the
//! next tokens, the validation split at the text's end, the vocabulary saved with the run, and
//! the errors for text that cannot be read as asked.

use crate::common::{spec, stderr, stdout, trainer};
use std::path::Path;
use trainer::data;

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
        (d.train.len, d.train.features.clone()),
        (1, vec![0., 1., 2., 0., 1.])
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

/// jobs/gpt_char.toml, shortened, trains on the bundled text: its loss falls from ln(73), the
/// run keeps the vocabulary, and `trainer sample` writes with it.
#[test]
fn the_char_gpt_job_trains_and_samples_with_its_vocabulary() {
    let tmp = tempfile::tempdir().unwrap();
    let runs = tmp.path().to_str().unwrap();
    let out = trainer(&[
        "run",
        "jobs/gpt_char.toml",
        "-q",
        "--runs-dir",
        runs,
        "--set",
        "train.max_steps=30",
        "--set",
        "train.log_every=10",
        "--set",
        "data.val_fraction=0.001",
        "--set",
        "optimizer.schedule.warmup_steps=5",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let dir = std::path::PathBuf::from(stdout(&out).trim());
    let metrics = std::fs::read_to_string(dir.join("metrics.csv")).unwrap();
    let losses: Vec<f64> = metrics
        .lines()
        .skip(1)
        .filter(|l| l.contains(",train,"))
        .map(|l| l.split(',').nth(3).unwrap().parse().unwrap())
        .collect();
    assert_eq!(losses.len(), 3, "{metrics}");
    assert!(losses[2] < 0.85 * 73f64.ln(), "{losses:?}");
    let preprocess = std::fs::read_to_string(dir.join("preprocess.json")).unwrap();
    assert!(
        preprocess.contains("\"tokenizer\": \"char\""),
        "{preprocess}"
    );

    let run = dir.to_str().unwrap();
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
    let out = sample(&["--prompt", "KING\u{e9}"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("is not in the run's vocabulary"),
        "{}",
        stderr(&out)
    );
}

/// model.init = "gpt2": matrices N(0, 0.02), the projections into the residual stream
/// N(0, 0.02/√(2·L)), biases 0, norm scales 1 (nanoGPT's _init_weights).
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
    // Two attention layers: 0.02/√4.
    assert!((std(&tensor("c_proj.weight")) - 0.01).abs() < 0.0005);
    assert!(tensor("c_attn.bias").iter().all(|&b| b == 0.0));
    assert!(tensor("ln.weight").iter().all(|&g| g == 1.0));
}
