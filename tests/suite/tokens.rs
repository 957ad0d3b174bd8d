//! Token files for language models: llm.c's shards and nanoGPT's uint16 .bin read as the ids
//! their text tokenizes to, shards by a glob, a validation file, and the errors for files
//! that are not what their format says.

use crate::common::{
    column, gpu_present, read_csv, run_job, spec, stderr, stdout, trainer, write_job,
};
use std::io::Write;
use std::path::Path;
use trainer::data;

const TEXT: &str = "to be, or not to be, that is the question: whether 'tis nobler in the mind";

fn job(data: &str) -> trainer::spec::JobSpec {
    spec(&format!(
        r#"
        [data]
        {data}
        block_size = 8
        [model]
        layers = [{{ type = "linear", out = 2 }}]
        [optimizer]
        type = "sgd"
        lr = 0.1
        "#
    ))
}

fn tokens_spec(path: &Path, extra: &str) -> trainer::spec::JobSpec {
    let mut s = job(&format!("source = \"tokens\"\npath = \"x\"\n{extra}"));
    s.data.path = Some(path.to_path_buf());
    s
}

/// An llm.c file: the header (magic, version, count, then zeros) and the ids.
fn llmc(ids: &[u32], version: i32) -> Vec<u8> {
    let mut header = vec![0i32; 256];
    header[..3].copy_from_slice(&[20240520, version, ids.len() as i32]);
    let mut bytes: Vec<u8> = header.iter().flat_map(|v| v.to_le_bytes()).collect();
    for &id in ids {
        match version {
            1 => bytes.extend((id as u16).to_le_bytes()),
            _ => bytes.extend(id.to_le_bytes()),
        }
    }
    bytes
}

fn uint16(ids: &[u32]) -> Vec<u8> {
    ids.iter()
        .flat_map(|&id| (id as u16).to_le_bytes())
        .collect()
}

/// The char ids of TEXT, as its text source reads them, and that source's data.
fn text_ids(dir: &Path) -> (Vec<u32>, data::Data) {
    let path = dir.join("t.txt");
    std::fs::write(&path, TEXT).unwrap();
    let mut s = job("source = \"text\"\npath = \"x\"\nval_fraction = 0.25");
    s.data.path = Some(path);
    let d = data::load(&s.data, 1).unwrap();
    let ids = [&d.train.tokens, &d.eval[0].1.tokens].map(|t| t.to_vec().unwrap());
    let ids = ids.concat();
    (ids, d)
}

#[test]
fn token_files_hold_the_ids_their_text_tokenizes_to() {
    let tmp = tempfile::tempdir().unwrap();
    let (ids, text) = text_ids(tmp.path());
    let split = ids.len() / 2;
    std::fs::write(tmp.path().join("one.bin"), llmc(&ids, 1)).unwrap();
    std::fs::write(tmp.path().join("wide.bin"), llmc(&ids, 2)).unwrap();
    std::fs::write(tmp.path().join("shard_000.bin"), llmc(&ids[..split], 1)).unwrap();
    std::fs::write(tmp.path().join("shard_001.bin"), llmc(&ids[split..], 1)).unwrap();
    std::fs::write(tmp.path().join("nanogpt.bin"), uint16(&ids)).unwrap();
    let cases = [
        ("one.bin", ""),
        ("wide.bin", ""),
        ("shard_*.bin", ""),
        ("nanogpt.bin", "token_format = \"uint16\""),
    ];
    for (file, extra) in cases {
        let s = tokens_spec(
            &tmp.path().join(file),
            &format!("val_fraction = 0.25\n{extra}"),
        );
        let d = data::load(&s.data, 1).unwrap();
        let ids = |t: &data::TokenIds| t.to_vec().unwrap();
        assert_eq!(ids(&d.train.tokens), ids(&text.train.tokens), "{file}");
        assert_eq!(
            ids(&d.eval[0].1.tokens),
            ids(&text.eval[0].1.tokens),
            "{file}"
        );
        assert_eq!(
            (
                d.train.len,
                d.eval[0].1.len,
                d.classes,
                d.sample_shape.clone()
            ),
            (text.train.len, text.eval[0].1.len, text.classes, vec![8]),
            "{file}"
        );
        assert!(d.preprocess.vocabulary.is_none());
    }

    // A validation file of its own; data.classes sets the vocabulary past the largest id.
    std::fs::write(tmp.path().join("val.bin"), llmc(&ids[..20], 1)).unwrap();
    let mut s = tokens_spec(&tmp.path().join("one.bin"), "classes = 50");
    s.data.val_path = Some(tmp.path().join("val.bin"));
    let d = data::load(&s.data, 1).unwrap();
    assert_eq!(d.train.tokens.len(), ids.len());
    assert_eq!(
        (&d.eval[0].1.tokens.to_vec().unwrap()[..], d.eval[0].1.len),
        (&ids[..20], 2)
    );
    assert_eq!(d.classes, Some(50));
}

#[test]
fn token_files_that_are_not_what_their_format_says_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let ids: Vec<u32> = (0..40).map(|i| i % 7).collect();
    let write = |name: &str, bytes: Vec<u8>| {
        let path = tmp.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        path
    };
    let error = |path: &Path, extra: &str| {
        let e = data::load(&tokens_spec(path, extra).data, 1).unwrap_err();
        e.to_string()
    };
    let raw = write("raw.bin", uint16(&ids));
    let e = error(&raw, "");
    assert!(
        e.contains("raw.bin: not an llm.c token file: its magic number is")
            && e.contains("data.token_format = \"uint16\""),
        "{e}"
    );
    let mut v3 = llmc(&ids, 1);
    v3[4] = 3;
    let e = error(&write("v3.bin", v3), "");
    assert!(e.contains("llm.c token file version 3"), "{e}");
    let mut cut = llmc(&ids, 1);
    cut.truncate(cut.len() - 2);
    let e = error(&write("cut.bin", cut), "");
    assert!(
        e.contains("header says 40 tokens (80 bytes after the header), but 78"),
        "{e}"
    );
    let e = error(&write("tiny.bin", llmc(&ids, 1)[..100].to_vec()), "");
    assert!(e.contains("100 bytes, shorter than llm.c's header"), "{e}");
    let e = error(
        &write("odd.bin", vec![1, 0, 2]),
        "token_format = \"uint16\"",
    );
    assert!(
        e.contains("3 bytes of ids is not a whole number of 2-byte tokens"),
        "{e}"
    );
    let e = error(&write("ok.bin", llmc(&ids, 1)), "classes = 5");
    assert!(
        e.contains("ok.bin: token 5 is 5, not below data.classes = 5"),
        "{e}"
    );
    let e = error(
        &write("big.bin", llmc(&[50, 50_257], 1)),
        "tokenizer = \"gpt2\"",
    );
    assert!(
        e.contains("token 1 is 50257, not below the 50257 tokens of data.tokenizer = \"gpt2\""),
        "{e}"
    );
    let e = error(&tmp.path().join("none_*.bin"), "");
    assert!(
        e.contains("no file in") && e.contains("matches none_*.bin"),
        "{e}"
    );
    std::fs::create_dir(tmp.path().join("shards")).unwrap();
    let e = error(&tmp.path().join("shards"), "");
    assert!(e.contains("shards is a folder, not a token file"), "{e}");
    assert!(e.contains("shards/*.bin"), "{e}");
    let short = write("short.bin", llmc(&ids[..8], 1));
    let e = error(&short, "");
    assert!(
        e.contains("the training tokens holds 8 tokens, fewer than"),
        "{e}"
    );
}

/// Token files are read where they lie: they take no heap, and a run on them computes what
/// a run on the same ids held in memory computes, bit for bit. A gzip file is read into
/// memory.
#[test]
fn token_files_read_where_they_lie_train_as_the_same_ids_held() {
    let tmp = tempfile::tempdir().unwrap();
    let (ids, text) = text_ids(tmp.path());
    let split = ids.len() / 3;
    std::fs::write(tmp.path().join("s_0.bin"), llmc(&ids[..split], 1)).unwrap();
    std::fs::write(tmp.path().join("s_1.bin"), llmc(&ids[split..], 2)).unwrap();
    let s = tokens_spec(&tmp.path().join("s_*.bin"), "val_fraction = 0.25");
    let d = data::load(&s.data, 1).unwrap();
    let train = |d: &data::Data| d.train.tokens.to_vec().unwrap();
    assert_eq!((train(&d), d.bytes()), (train(&text), 0));
    assert_eq!(d.on_disk_bytes(), 2 * split + 4 * (ids.len() - split));

    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&llmc(&ids, 1)).unwrap();
    std::fs::write(tmp.path().join("g.bin"), gz.finish().unwrap()).unwrap();
    let s = tokens_spec(&tmp.path().join("g.bin"), "val_fraction = 0.25");
    let d = data::load(&s.data, 1).unwrap();
    assert_eq!((train(&d), d.on_disk_bytes()), (train(&text), 0));
    assert!(d.bytes() > 0);

    let job = |data: &str| {
        format!(
            r#"
            [data]
            {data}
            val_fraction = 0.25
            classes = 32
            block_size = 8
            batch_size = 4
            [model]
            layers = [{{ type = "embedding", num_embeddings = 32, embedding_dim = 8 }},
                      {{ type = "linear", out = 32 }}]
            [optimizer]
            type = "adam"
            lr = 0.01
            [train]
            max_steps = 12
            log_every = 3
            eval_every_steps = 6
            "#
        )
    };
    let losses = |data: &str, device: &str| {
        let dir = tmp.path().join(format!("{device}{}", data.len()));
        std::fs::create_dir(&dir).unwrap();
        let job = write_job(tmp.path(), &job(data));
        let run = run_job(&job, &dir, &["--set", &format!("device.type={device}")]);
        let (header, rows) = read_csv(&run.join("metrics.csv"));
        let row =
            |r: &Vec<String>| ["step", "split", "loss"].map(|c| column(&header, r, c).to_string());
        let log = std::fs::read_to_string(run.join("train.log")).unwrap();
        // `trainer eval` reads the training split's windows a block apart. Its first line
        // names the run.
        let eval = trainer(&["eval", run.to_str().unwrap(), "--split", "train"]);
        assert!(eval.status.success(), "{}", stderr(&eval));
        let eval = stdout(&eval).split_once('\n').unwrap().1.to_string();
        let rows = rows.iter().map(row).collect::<Vec<_>>();
        (rows, eval, log)
    };
    let (held, on_disk) = (
        "source = \"text\"\npath = \"t.txt\"",
        "source = \"tokens\"\npath = \"s_*.bin\"",
    );
    let (cpu_held, cpu_eval, _) = losses(held, "cpu");
    assert_eq!(cpu_held.len(), 6, "{cpu_held:?}");
    let (cpu_on_disk, cpu_on_disk_eval, _) = losses(on_disk, "cpu");
    assert_eq!((cpu_held, cpu_eval), (cpu_on_disk, cpu_on_disk_eval));
    // On a GPU the held ids are gathered on the device, the files' copied in each batch.
    if gpu_present() {
        let (gpu_held, gpu_eval, _) = losses(held, "cuda");
        let (gpu_on_disk, gpu_on_disk_eval, log) = losses(on_disk, "cuda");
        assert_eq!((gpu_held, gpu_eval), (gpu_on_disk, gpu_on_disk_eval));
        assert!(
            log.contains("streamed from pinned host memory (token files stay where they lie)"),
            "{log}"
        );
    }
}

/// A job reads its shards by a glob relative to the job file, trains, writes the token
/// format into config.toml, and refuses a validation file given with val_fraction.
#[test]
fn a_job_trains_on_token_shards() {
    let tmp = tempfile::tempdir().unwrap();
    let (ids, _) = text_ids(tmp.path());
    std::fs::create_dir(tmp.path().join("shards")).unwrap();
    let split = ids.len() / 2;
    std::fs::write(
        tmp.path().join("shards/train_0.bin"),
        llmc(&ids[..split], 1),
    )
    .unwrap();
    std::fs::write(
        tmp.path().join("shards/train_1.bin"),
        llmc(&ids[split..], 1),
    )
    .unwrap();
    std::fs::write(tmp.path().join("shards/val_0.bin"), llmc(&ids[..20], 1)).unwrap();
    let job = tmp.path().join("job.toml");
    let text = r#"
        [data]
        source = "tokens"
        path = "shards/train_*.bin"
        val_path = "shards/val_*.bin"
        classes = 32
        block_size = 8
        batch_size = 4
        [model]
        layers = [{ type = "embedding", num_embeddings = 32, embedding_dim = 8 },
                  { type = "linear", out = 32 }]
        [optimizer]
        type = "adam"
        lr = 0.01
        [train]
        max_steps = 6
        log_every = 3
        "#;
    std::fs::write(&job, text).unwrap();
    let runs = tmp.path().join("runs");
    let out = trainer(&[
        "run",
        job.to_str().unwrap(),
        "-q",
        "--runs-dir",
        runs.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let dir = std::path::PathBuf::from(stdout(&out).trim());
    let metrics = std::fs::read_to_string(dir.join("metrics.csv")).unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("6,") && l.contains(",val,")),
        "{metrics}"
    );
    let config = std::fs::read_to_string(dir.join("config.toml")).unwrap();
    assert!(config.contains("token_format = \"llm.c\""), "{config}");

    std::fs::write(
        &job,
        text.replace("block_size = 8", "block_size = 8\nval_fraction = 0.1"),
    )
    .unwrap();
    let out = trainer(&["check", job.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("give data.val_path"),
        "{}",
        stderr(&out)
    );
    // The char tokenizer's vocabulary comes from a text, which token files do not hold.
    std::fs::write(
        &job,
        text.replace("block_size = 8", "block_size = 8\ntokenizer = \"char\""),
    )
    .unwrap();
    let out = trainer(&["check", job.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("data.tokenizer") && stderr(&out).contains("allowed here: \"gpt2\""),
        "{}",
        stderr(&out)
    );
}

/// jobs/gpt2_124m.toml builds GPT-2 small with the parameter count llm.c reports for it
/// (the padded vocabulary, tied), on llm.c's token shards.
#[test]
fn the_gpt2_124m_job_is_gpt2_small() {
    let tmp = tempfile::tempdir().unwrap();
    let ids: Vec<u32> = (0..3000).map(|i| i * 17 % 50257).collect();
    std::fs::write(tmp.path().join("fineweb_train_000001.bin"), llmc(&ids, 1)).unwrap();
    std::fs::write(tmp.path().join("fineweb_val_000000.bin"), llmc(&ids, 1)).unwrap();
    let dir = tmp.path().display();
    let out = trainer(&[
        "check",
        "jobs/gpt2_124m.toml",
        "--set",
        &format!("data.path='{dir}/fineweb_train_*.bin'"),
        "--set",
        &format!("data.val_path='{dir}/fineweb_val_*.bin'"),
        "--set",
        "device.type='cpu'",
        "--set",
        "data.batch_size=1",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("total parameters: 124,475,904"), "{text}");
    assert!(text.contains("h11_mlp_c_proj"), "{text}");
    // nanoGPT's estimate_mfu: 6N + 12·L·H·Q·T a token, N without the position table.
    let (n, (l, h, q, t)) = (124_475_904.0 - 1024.0 * 768.0, (12.0, 12.0, 64.0, 1024.0));
    let nanogpt = (6.0 * n + 12.0 * l * h * q * t) * t;
    let ours = crate::common::flops_a_sample(&text);
    assert!(
        (ours / nanogpt - 1.0).abs() < 0.01,
        "{ours} against {nanogpt}: {text}"
    );
}

/// A token file cut short while a run reads it (a preparation script run again, say) fails
/// the run with exit 1 and a message naming the file; the summary says so and the earlier
/// checkpoints stay. A memory-mapped file would have ended the process with SIGBUS.
#[test]
fn a_token_file_cut_short_under_a_run_fails_it_by_name() {
    use std::time::{Duration, Instant};
    let tmp = tempfile::tempdir().unwrap();
    let ids: Vec<u32> = (0..200_000).map(|i| (i * 7 + i / 13) % 64).collect();
    let shard = tmp.path().join("shard.bin");
    std::fs::write(&shard, llmc(&ids, 1)).unwrap();
    let job = write_job(
        tmp.path(),
        r#"
        [job]
        name = "cut"
        [data]
        source = "tokens"
        path = "shard.bin"
        classes = 64
        block_size = 16
        batch_size = 4
        [model]
        layers = [{ type = "embedding", num_embeddings = 64, embedding_dim = 8 },
                  { type = "linear", out = 64 }]
        [optimizer]
        type = "sgd"
        lr = 0.01
        [train]
        max_steps = 100_000_000
        log_every = 1000
        [checkpoint]
        every_steps = 20
        "#,
    );
    let runs = tmp.path().join("runs");
    let mut child = std::process::Command::new(crate::common::trainer_bin())
        .args([
            "run",
            job.to_str().unwrap(),
            "--runs-dir",
            runs.to_str().unwrap(),
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let checkpoint = loop {
        let found = (std::fs::read_dir(runs.join("cut")).ok())
            .and_then(|mut d| d.next()?.ok())
            .map(|e| e.path().join("checkpoints/step-00000020.safetensors"))
            .filter(|c| c.exists());
        if let Some(c) = found {
            break c;
        }
        assert!(Instant::now() < deadline, "no checkpoint after 120 s");
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        std::thread::sleep(Duration::from_millis(5));
    };
    std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap()
        .set_len(2048)
        .unwrap();
    let ended = child.wait_with_output().unwrap();
    let e = stderr(&ended);
    assert_eq!(ended.status.code(), Some(1), "{e}");
    assert!(
        e.contains(&format!("{}: cannot read its ids", shard.display())),
        "{e}"
    );
    assert!(
        e.contains("is 2048 bytes now, 401024 when the run opened it"),
        "{e}"
    );
    let run = checkpoint.parent().unwrap().parent().unwrap();
    assert_eq!(crate::common::summary(run)["status"], "failed");
    assert!(checkpoint.exists());
}

/// `trainer tokenize` writes llm.c shards: the GPT-2 ids of each document after an
/// `<|endoftext|>`, split into train and validation as data.val_fraction splits a text. The
/// `[data]` keys it prints read them; it never overwrites shards.
#[test]
fn tokenize_writes_the_shards_its_data_keys_read() {
    use trainer::data::vocabulary::Vocabulary;
    use trainer::spec::Tokenizer;
    let tmp = tempfile::tempdir().unwrap();
    let first: String = (0..300)
        .map(|i| format!("The quick brown fox {i} jumps over the lazy dog.\n"))
        .collect();
    let second = "ROMEO: But soft, what light through yonder window breaks?\n".repeat(40);
    std::fs::write(tmp.path().join("a.txt"), &first).unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(second.as_bytes()).unwrap();
    std::fs::write(tmp.path().join("b.txt.gz"), gz.finish().unwrap()).unwrap();
    let dir = tmp.path().join("shards");
    let (a, b) = (tmp.path().join("a.txt"), tmp.path().join("b.txt.gz"));
    let tokenize = |extra: &[&str]| {
        let mut args = vec!["tokenize", a.to_str().unwrap(), b.to_str().unwrap()];
        args.extend_from_slice(&["-o", dir.to_str().unwrap()]);
        if !extra.contains(&"--shard-tokens") {
            args.extend_from_slice(&["--shard-tokens", "1000"]);
        }
        args.extend_from_slice(extra);
        trainer(&args)
    };
    let out = tokenize(&[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let keys = stdout(&out);
    let d = dir.display();
    let want = format!(
        "[data]\nsource = \"tokens\"\npath = \"{d}/train_*.bin\"\nval_path = \"{d}/val_*.bin\"\n\
         tokenizer = \"gpt2\"\n"
    );
    assert!(keys.ends_with(&want), "{keys}");

    let gpt2 = Vocabulary::of(Tokenizer::Gpt2, "");
    let ids: Vec<u32> = [first.as_str(), second.as_str()]
        .iter()
        .flat_map(|text| std::iter::once(50_256).chain(gpt2.encode(text).unwrap()))
        .collect();
    let val_len = (ids.len() as f64 * 0.1).round() as usize;
    let mut s = tokens_spec(&dir.join("train_*.bin"), "");
    s.data.val_path = Some(dir.join("val_*.bin"));
    let loaded = data::load(&s.data, 1).unwrap();
    let read = |t: &data::TokenIds| t.to_vec().unwrap();
    let (train, val) = ids.split_at(ids.len() - val_len);
    assert_eq!(read(&loaded.train.tokens), train);
    assert_eq!(read(&loaded.eval[0].1.tokens), val);
    let shards = std::fs::read_dir(&dir).unwrap().count();
    assert_eq!(shards, train.len().div_ceil(1000) + val_len.div_ceil(1000));
    assert!(
        keys.starts_with(&format!(
            "wrote {} train shards ({} tokens) and 1 validation shard ({val_len} tokens)",
            train.len().div_ceil(1000),
            train.len()
        )),
        "{keys}"
    );

    // The same folder again: refused, and the shards are as they were.
    let before = std::fs::read(dir.join("train_000000.bin")).unwrap();
    let again = tokenize(&[]);
    assert_eq!(again.status.code(), Some(2), "{}", stderr(&again));
    assert!(
        stderr(&again).contains("tokenize never overwrites shards"),
        "{}",
        stderr(&again)
    );
    assert_eq!(std::fs::read(dir.join("train_000000.bin")).unwrap(), before);

    let refused = |extra: &[&str], want: &str| {
        let out = tokenize(extra);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(want), "{extra:?}: {}", stderr(&out));
    };
    std::fs::remove_dir_all(&dir).unwrap();
    refused(
        &["--tokenizer", "char"],
        "--tokenizer char: a char vocabulary is the text's own",
    );
    refused(
        &["--tokenizer", "bpe"],
        "--tokenizer bpe: not a tokenizer; allowed: gpt2, bytes",
    );
    refused(
        &["--val-fraction", "1"],
        "--val-fraction 1: must be at least 0 and below 1",
    );
    refused(
        &["--shard-tokens", "0"],
        "--shard-tokens 0: must be from 1 to 2147483647",
    );
    std::fs::write(&a, b"caf\xe9").unwrap();
    refused(&[], "a.txt: not UTF-8 text (byte 3)");
    assert!(!dir.exists(), "a refused tokenize writes nothing");
}
