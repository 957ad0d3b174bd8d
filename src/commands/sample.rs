//! `trainer sample`: text from a run's language model. The prompt, in the run's vocabulary,
//! then one token at a time: the model reads the last block_size tokens, and the next token
//! is drawn from its last position's logits (divided by the temperature, cut to the top k
//! and to the top p).
//!
//! While the text fits in the block, a `Decoder` reads one token a step and its attention
//! layers keep the earlier positions' keys and values (a key/value cache). Past the block
//! the context slides, every position moves, and the model reads the context again for each
//! token: in a window of the next power of two at or above its length (`window`). So does a
//! model with a layer that mixes positions other than causal attention.

use super::evaluate::Trained;
use super::*;
use crate::data::vocabulary::{TextStream, Vocabulary};
use crate::graph::Network;
use crate::tensor::rng::Rng;
use crate::tensor::HalfKind;

/// `trainer sample`'s arguments.
#[derive(clap::Args)]
pub struct SampleArgs {
    /// The run directory of a model trained on text, or a job file whose model.init_from
    /// gives the weights (GPT-2's, say).
    pub run: PathBuf,
    /// A training checkpoint of the run instead of its final weights: a file, `last` for
    /// the newest, or `best` for the one its checkpoint.keep_best keeps.
    #[arg(long, value_name = "FILE")]
    pub checkpoint: Option<PathBuf>,
    /// The text to continue (default: a new line).
    #[arg(long, default_value = "\n")]
    pub prompt: String,
    /// Read the text to continue from this file instead (UTF-8).
    #[arg(long, value_name = "FILE", conflicts_with = "prompt")]
    pub prompt_file: Option<PathBuf>,
    /// How many tokens to generate.
    #[arg(long, default_value_t = 200)]
    pub tokens: usize,
    /// How many texts to draw from the prompt, one after another, with a line of dashes
    /// between them (nanoGPT's num_samples).
    #[arg(long, default_value_t = 1)]
    pub samples: usize,
    /// Divides the logits: below 1 sharper, above 1 flatter.
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f64,
    /// Draw from the k likeliest tokens only.
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,
    /// Draw from the likeliest tokens whose probabilities add up to P or more (nucleus
    /// sampling, after --top-k).
    #[arg(long, value_name = "P")]
    pub top_p: Option<f64>,
    /// The seed of the draws.
    #[arg(long, default_value_t = 1337)]
    pub seed: u64,
    /// Where the model runs: cpu, cuda or cuda:N. On CUDA it computes in fp32.
    #[arg(long, default_value = "cpu")]
    pub device: String,
}

/// Writes the prompt, then each drawn token as soon as it is drawn.
pub fn sample(args: &SampleArgs) -> Result<()> {
    if !(args.temperature > 0.0 && args.temperature.is_finite()) {
        let greedy = match args.temperature == 0.0 {
            true => "; for the likeliest token at each step (greedy decoding), pass --top-k 1",
            false => "",
        };
        return Err(Error::Job(format!(
            "--temperature {}: must be a positive number{greedy}",
            args.temperature
        )));
    }
    if args.samples == 0 {
        return Err(Error::Job("--samples 0: must be at least 1".into()));
    }
    if args.top_k == Some(0) {
        return Err(Error::Job("--top-k 0: must be at least 1".into()));
    }
    if let Some(p) = args.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
        return Err(Error::Job(format!(
            "--top-p {p}: must be above 0 and at most 1"
        )));
    }
    let trained = Trained::load(&args.run, args.checkpoint.as_deref())?;
    let Some(vocabulary) = trained.preprocess.vocabulary.clone() else {
        return Err(Error::Job(format!(
            "{}: its model was not trained on text (data.source = \"text\") or on token \
             files with a data.tokenizer, so it has no vocabulary to write with",
            args.run.display()
        )));
    };
    let (prompt, flag) = match &args.prompt_file {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| {
                Error::Job(format!(
                    "--prompt-file {}: cannot read it: {e}",
                    path.display()
                ))
            })?;
            (text, "--prompt-file")
        }
        None => (args.prompt.clone(), "--prompt"),
    };
    let ids = vocabulary.encode(&prompt).map_err(|c| {
        Error::Job(format!(
            "{flag}: the character {c:?} is not in the run's vocabulary of {} tokens",
            vocabulary.len()
        ))
    })?;
    if ids.is_empty() {
        return Err(Error::Job(format!(
            "{flag}: empty; give at least one character"
        )));
    }
    let texts = Texts {
        prompt: &prompt,
        ids: &ids,
        known: vocabulary.len(),
    };
    let mut out = Output::new(&vocabulary);
    match parse_device(&args.device) {
        Some(DeviceChoice::Cpu) => {
            let backend = CpuBackend::new(cpu_threads(&trained.spec));
            let half = train::half_kind(trained.spec.precision.mode);
            texts.write(&backend, half, &trained, args, &mut out)?;
        }
        Some(DeviceChoice::Cuda(n)) => {
            let backend = CudaBackend::new(n, false)?;
            // fp32: the key/value cache's products take f32 buffers.
            texts.write(&backend, None, &trained, args, &mut out)?;
            backend.status()?;
        }
        _ => {
            return Err(Error::Job(format!(
                "--device {}: not a device; allowed: cpu, cuda, cuda:N",
                args.device
            )))
        }
    };
    out.finish()
}

/// The texts `sample` draws: each the prompt and what follows it.
struct Texts<'a> {
    prompt: &'a str,
    ids: &'a [u32],
    /// The vocabulary's size: ids at or past it are never drawn.
    known: usize,
}

impl Texts<'_> {
    /// Draws `args.samples` texts, one seeded stream of draws for all, and writes them to
    /// `out` as they come.
    fn write<B: Engine>(
        &self,
        backend: &B,
        half: Option<HalfKind>,
        trained: &Trained,
        args: &SampleArgs,
        out: &mut Output,
    ) -> Result<()> {
        let mut rng = Rng::new(args.seed);
        for sample in 0..args.samples {
            if sample > 0 {
                out.end_text();
                out.write("\n---------------\n");
            }
            out.write(self.prompt);
            let mut ids = self.ids.to_vec();
            let how = How {
                backend,
                half,
                cached: true,
                shorter: true,
            };
            let mut emit = |id| out.token(id);
            generate_with(
                how, trained, &mut ids, self.known, args, &mut rng, &mut emit,
            )?;
            if !out.open() {
                break;
            }
        }
        Ok(())
    }
}

/// Standard output, written token by token. A reader that goes away (`| head`) stops the
/// drawing, quietly.
struct Output<'a> {
    vocabulary: &'a Vocabulary,
    text: TextStream,
    stdout: std::io::StdoutLock<'static>,
    failed: Option<std::io::Error>,
}

impl<'a> Output<'a> {
    fn new(vocabulary: &'a Vocabulary) -> Self {
        Output {
            vocabulary,
            text: TextStream::default(),
            stdout: std::io::stdout().lock(),
            failed: None,
        }
    }

    /// Whether the text still goes somewhere.
    fn write(&mut self, text: &str) -> bool {
        use std::io::Write;
        if self.failed.is_none() {
            let written =
                (self.stdout.write_all(text.as_bytes())).and_then(|()| self.stdout.flush());
            self.failed = written.err();
        }
        self.failed.is_none()
    }

    /// Writes what token `id` completes; whether to draw on.
    fn token(&mut self, id: u32) -> bool {
        let text = self.text.push(&self.vocabulary.token_bytes(id));
        self.write(&text)
    }

    /// Whether the reader is still there.
    fn open(&self) -> bool {
        self.failed.is_none()
    }

    /// Writes what is left of the text's last character.
    fn end_text(&mut self) {
        let rest = std::mem::take(&mut self.text).finish();
        self.write(&rest);
    }

    fn finish(mut self) -> Result<()> {
        self.end_text();
        match self.failed {
            Some(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                Err(crate::runtime_err!("cannot write to stdout: {e}"))
            }
            _ => Ok(()),
        }
    }
}

/// How `generate_with` runs the model: on `backend` with activations in `half` (None:
/// fp32), with the key/value cache where `cached`, and reading windows shorter than the
/// block where `shorter` (else always the block).
struct How<'a, B: Engine> {
    backend: &'a B,
    half: Option<HalfKind>,
    cached: bool,
    shorter: bool,
}

/// Appends `args.tokens` tokens to `ids`, drawn with `rng` from the model run as `how` says;
/// returns them. Each is passed to `emit` as it is drawn; `emit` returning false stops the
/// drawing. Tokens are drawn from the vocabulary's `known` ids only: a padded output layer
/// (GPT-2's 50,304 logits for 50,257 tokens) has logits for ids no text holds.
fn generate_with<B: Engine>(
    how: How<B>,
    trained: &Trained,
    ids: &mut Vec<u32>,
    known: usize,
    args: &SampleArgs,
    rng: &mut Rng,
    emit: &mut dyn FnMut(u32) -> bool,
) -> Result<Vec<u32>> {
    let (backend, half, shorter) = (how.backend, how.half, how.shorter);
    let block = trained.preprocess.sample_shape.iter().product::<usize>();
    let vocab = trained.preprocess.classes.unwrap_or(0);
    let mut shorter = shorter;
    let mut model: Option<Window<B>> = None;
    let mut decoder = match how.cached {
        true => Decoder::new(backend, trained, block, half)
            .inspect_err(|why| tracing::debug!("no key/value cache: {why}"))
            .ok(),
        false => None,
    };
    let mut drawn = Vec::with_capacity(args.tokens);
    let draw = Draw::of(args);
    for _ in 0..args.tokens {
        if let Some(decoder) = decoder.as_mut().filter(|_| ids.len() <= block) {
            let logits = decoder.logits(backend, ids, vocab);
            let next = draw.draw(&logits[..known.min(vocab)], rng);
            ids.push(next);
            drawn.push(next);
            match emit(next) {
                true => continue,
                false => break,
            }
        }
        let context = &ids[ids.len().saturating_sub(block)..];
        let len = match shorter {
            true => window(context.len(), block),
            false => block,
        };
        if model.as_ref().is_none_or(|m| m.len != len) {
            model = match Window::new(backend, trained, len, half) {
                Ok(m) => Some(m),
                // A layer fixes the length: read the whole block from now on.
                Err(_) if len != block => {
                    shorter = false;
                    Some(Window::new(backend, trained, block, half)?)
                }
                Err(e) => return Err(e),
            };
        }
        let model = model.as_mut().expect("built above");
        let logits = model.logits(backend, context, vocab);
        let last = &logits[(context.len() - 1) * vocab..][..known.min(vocab)];
        let next = draw.draw(last, rng);
        ids.push(next);
        drawn.push(next);
        if !emit(next) {
            break;
        }
    }
    Ok(drawn)
}

/// The model reading one token a step (`Graph::for_decoding`), the keys and values of the
/// tokens before kept by its attention layers.
struct Decoder<B: Engine> {
    net: Network<B>,
    /// Tokens read so far: the positions the cache holds.
    read: usize,
    input: Vec<u32>,
    logits: Vec<f32>,
}

impl<B: Engine> Decoder<B> {
    /// Fails for a model with a layer that needs the whole context (then `Window`s serve).
    fn new(backend: &B, trained: &Trained, block: usize, half: Option<HalfKind>) -> Result<Self> {
        let shape = DataShape {
            sample_shape: vec![1],
            classes: trained.preprocess.classes,
            classes_from: None,
            target_dim: 1,
        };
        let graph = Graph::for_decoding(&trained.spec, &shape, block)?;
        if graph.param_len != trained.graph.param_len {
            return Err(crate::runtime_err!(
                "the model's parameters depend on its length"
            ));
        }
        let seed = trained.spec.job.seed;
        let mut net = Network::with_precision(backend, graph, &trained.params, 1, seed, half)?;
        net.set_running_stats(backend, &trained.running_stats)?;
        let vocab = trained.preprocess.classes.unwrap_or(0);
        Ok(Self {
            net,
            read: 0,
            input: vec![0],
            logits: vec![0.0; vocab],
        })
    }

    /// The logits after the last of `ids` (at most the block), reading those not read yet.
    fn logits(&mut self, backend: &B, ids: &[u32], vocab: usize) -> &[f32] {
        for &id in &ids[self.read..] {
            self.net.set_position(self.read);
            self.input[0] = id;
            self.net.set_ids(backend, &self.input);
            self.net.forward(backend, 1, false, 0);
            self.read += 1;
        }
        backend.download(self.net.output(), &mut self.logits);
        &self.logits[..vocab]
    }
}

/// The window a context of `len` tokens is read in: the next power of two, at least 16 and
/// at most the block.
fn window(len: usize, block: usize) -> usize {
    len.next_power_of_two().clamp(16, block.max(16)).min(block)
}

/// The model built for sequences of `len` tokens, with the run's weights.
struct Window<B: Engine> {
    len: usize,
    net: Network<B>,
    input: Vec<u32>,
    logits: Vec<f32>,
}

impl<B: Engine> Window<B> {
    /// Fails where the model cannot read `len` tokens with the same parameters (a layer that
    /// fixes the length); the caller keeps the window it has.
    fn new(backend: &B, trained: &Trained, len: usize, half: Option<HalfKind>) -> Result<Self> {
        let block = trained.preprocess.sample_shape.iter().product::<usize>();
        let graph = if len == block {
            trained.graph.clone()
        } else {
            let shape = DataShape {
                sample_shape: vec![len],
                classes: trained.preprocess.classes,
                classes_from: None,
                target_dim: len,
            };
            let graph = Graph::build(&trained.spec, &shape)?;
            if graph.param_len != trained.graph.param_len {
                return Err(crate::runtime_err!(
                    "the model's parameters depend on its length"
                ));
            }
            graph
        };
        let seed = trained.spec.job.seed;
        let mut net = Network::with_precision(backend, graph, &trained.params, 1, seed, half)?;
        net.set_running_stats(backend, &trained.running_stats)?;
        let vocab = trained.preprocess.classes.unwrap_or(0);
        Ok(Self {
            len,
            net,
            input: vec![0; len],
            logits: vec![0.0; len * vocab],
        })
    }

    /// The logits at every position for `context` (at most `len` tokens), padded after it:
    /// causal attention keeps the padding from the positions read.
    fn logits(&mut self, backend: &B, context: &[u32], vocab: usize) -> &[f32] {
        self.input.fill(0);
        self.input[..context.len()].copy_from_slice(context);
        self.net.set_ids(backend, &self.input);
        self.net.forward(backend, 1, false, 0);
        backend.download(self.net.output(), &mut self.logits);
        &self.logits[..context.len() * vocab]
    }
}

/// How a token is drawn from the logits: softmax(logits / temperature), cut to the `top_k`
/// largest logits, then to the likeliest tokens whose probabilities add up to `top_p`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Draw {
    temperature: f64,
    top_k: Option<usize>,
    top_p: Option<f64>,
}

impl Draw {
    fn of(args: &SampleArgs) -> Draw {
        Draw {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
        }
    }

    fn draw(&self, logits: &[f32], rng: &mut Rng) -> u32 {
        let scaled: Vec<f64> = logits
            .iter()
            .map(|&l| l as f64 / self.temperature)
            .collect();
        let cutoff = match self.top_k {
            Some(k) if k < scaled.len() => {
                let mut sorted = scaled.clone();
                sorted.sort_by(|a, b| b.total_cmp(a));
                sorted[k - 1]
            }
            _ => f64::NEG_INFINITY,
        };
        let max = scaled.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let mut weights: Vec<f64> = scaled
            .iter()
            .map(|&s| if s >= cutoff { (s - max).exp() } else { 0.0 })
            .collect();
        if let Some(p) = self.top_p.filter(|&p| p < 1.0) {
            keep_nucleus(&mut weights, p);
        }
        let mut target = rng.next_f64() * weights.iter().sum::<f64>();
        for (i, &w) in weights.iter().enumerate() {
            if target < w {
                return i as u32;
            }
            target -= w;
        }
        // Rounding left the target past the last weight: the last token with any.
        weights.iter().rposition(|&w| w > 0.0).unwrap_or(0) as u32
    }
}

/// Zeroes every weight but the largest ones that make up a share `p` of the total: the
/// smallest such set, as Hugging Face's top_p. The likeliest token always stays.
fn keep_nucleus(weights: &mut [f64], p: f64) {
    let total: f64 = weights.iter().sum();
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by(|&a, &b| weights[b].total_cmp(&weights[a]).then(a.cmp(&b)));
    let mut kept = 0.0;
    for &i in &order {
        if kept >= p * total {
            weights[i] = 0.0;
        } else {
            kept += weights[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::vocabulary::Vocabulary;

    #[test]
    fn top_k_one_is_the_largest_logit_and_draws_follow_the_probabilities() {
        let mut rng = Rng::new(3);
        let logits = [0.1, 2.0, -1.0, 1.9];
        let top = |k| Draw {
            temperature: 1.0,
            top_k: Some(k),
            top_p: None,
        };
        for _ in 0..20 {
            assert_eq!(top(1).draw(&logits, &mut rng), 1);
        }
        let mut counts = [0usize; 4];
        for _ in 0..20_000 {
            counts[top(2).draw(&logits, &mut rng) as usize] += 1;
        }
        assert_eq!((counts[0], counts[2]), (0, 0));
        // e^2 / (e^2 + e^1.9) = 0.525
        let share = counts[1] as f64 / 20_000.0;
        assert!((share - 0.525).abs() < 0.015, "{share}");
    }

    /// Top p keeps the likeliest tokens until their probabilities reach p, and draws from
    /// them in proportion, as Hugging Face's TopPLogitsWarper.
    #[test]
    fn top_p_keeps_the_smallest_set_that_reaches_p() {
        // Probabilities 0.5, 0.3, 0.15, 0.05.
        let logits = [0.5f32, 0.3, 0.15, 0.05].map(f32::ln);
        let nucleus = |p| {
            let mut w = [0.5, 0.3, 0.15, 0.05];
            keep_nucleus(&mut w, p);
            w.map(|w| w > 0.0)
        };
        assert_eq!(nucleus(0.5), [true, false, false, false]);
        assert_eq!(nucleus(0.6), [true, true, false, false]);
        assert_eq!(nucleus(0.79), [true, true, false, false]);
        assert_eq!(nucleus(0.81), [true, true, true, false]);
        assert_eq!(nucleus(0.01), [true, false, false, false]);
        let draw = Draw {
            temperature: 1.0,
            top_k: None,
            top_p: Some(0.7),
        };
        let mut rng = Rng::new(9);
        let mut counts = [0usize; 4];
        for _ in 0..20_000 {
            counts[draw.draw(&logits, &mut rng) as usize] += 1;
        }
        assert_eq!((counts[2], counts[3]), (0, 0));
        // 0.5 / (0.5 + 0.3)
        let share = counts[0] as f64 / 20_000.0;
        assert!((share - 0.625).abs() < 0.015, "{share}");
        // Top p of 1 and no top p draw the same tokens.
        let (mut a, mut b) = (Rng::new(4), Rng::new(4));
        let all = Draw {
            top_p: Some(1.0),
            ..draw
        };
        let none = Draw {
            top_p: None,
            ..draw
        };
        for _ in 0..100 {
            assert_eq!(all.draw(&logits, &mut a), none.draw(&logits, &mut b));
        }
    }

    #[test]
    fn windows_are_powers_of_two_within_the_block() {
        let got: Vec<usize> = [1, 16, 17, 33, 64, 100].map(|n| window(n, 64)).to_vec();
        assert_eq!(got, [16, 16, 32, 64, 64, 64]);
        assert_eq!(window(3, 8), 8);
    }

    /// A run of jobs/JOB.toml, 3 steps, in `dir`.
    fn tiny_run(dir: &std::path::Path, (job, extra): (&str, &[&str])) -> PathBuf {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let run = dir.join("run");
        let sets = [
            "train.max_steps=3",
            "train.log_every=3",
            "device.type=\"cpu\"",
        ];
        crate::commands::run(&RunArgs {
            job: root.join(format!("jobs/{job}.toml")),
            job_given: true,
            sets: sets.iter().chain(extra).map(|s| s.to_string()).collect(),
            name: None,
            runs_dir: dir.to_path_buf(),
            resume: None,
            resume_fallback: false,
            force: false,
            dir: Some(run.clone()),
            quiet: true,
            print_run_dir: false,
            profile: None,
        })
        .unwrap();
        run
    }

    /// 90 tokens drawn after the token 3 on the CPU in fp32, as `How` says.
    fn draws(run: &std::path::Path, cached: bool, shorter: bool) -> Vec<u32> {
        let args = SampleArgs {
            run: run.to_path_buf(),
            checkpoint: None,
            prompt: "K".into(),
            prompt_file: None,
            tokens: 90,
            samples: 1,
            temperature: 1.0,
            top_k: None,
            top_p: None,
            seed: 5,
            device: "cpu".into(),
        };
        let trained = Trained::load(run, None).unwrap();
        let known = trained.preprocess.vocabulary.as_ref().unwrap().len();
        let backend = CpuBackend::new(1);
        let how = How {
            backend: &backend,
            half: None,
            cached,
            shorter,
        };
        let mut rng = Rng::new(args.seed);
        generate_with(
            how,
            &trained,
            &mut vec![3],
            known,
            &args,
            &mut rng,
            &mut |_| true,
        )
        .unwrap()
    }

    /// The jobs the sampling tests train for three steps, each with its `--set`s: a GPT, a
    /// Llama, and a Llama with grouped-query attention (two key and value heads for four
    /// query heads).
    const MODELS: [(&str, &[&str]); 3] = [
        ("gpt_char", &[]),
        ("llama_char", &[]),
        (
            "llama_char",
            &[
                "model.blocks.layers[1].out=256",
                "model.blocks.layers[2].kv_heads=2",
                "model.blocks.layers[3].kv_heads=2",
            ],
        ),
    ];

    /// The key/value cache gives each position the logits the whole block gives it (to
    /// rounding: its softmax scales before the exponent), and draws the same tokens, through
    /// the block and past it: for a GPT, and for a Llama, whose rotary embedding turns each
    /// position's query and key by its own position, with grouped-query attention too.
    #[test]
    fn the_key_value_cache_reads_what_the_whole_block_reads() {
        for job in MODELS {
            let tmp = tempfile::tempdir().unwrap();
            let run = tiny_run(tmp.path(), job);
            let trained = Trained::load(&run, None).unwrap();
            let backend = CpuBackend::new(1);
            let (block, vocab) = (64, trained.preprocess.classes.unwrap());
            let ids: Vec<u32> = (0..block as u32)
                .map(|i| (i * 7 + 3) % vocab as u32)
                .collect();
            let half = train::half_kind(trained.spec.precision.mode);
            let mut whole = Window::new(&backend, &trained, block, half).unwrap();
            let all = whole.logits(&backend, &ids, vocab).to_vec();
            let mut decoder = Decoder::new(&backend, &trained, block, half).unwrap();
            for t in 0..block {
                let got = decoder.logits(&backend, &ids[..=t], vocab);
                let want = &all[t * vocab..][..vocab];
                for (g, w) in got.iter().zip(want) {
                    assert!(
                        (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
                        "{job:?}, position {t}: {g} {w}"
                    );
                }
            }
            assert_eq!(
                draws(&run, true, false),
                draws(&run, false, false),
                "{job:?}"
            );
        }
    }

    /// Reading shorter windows draws the same tokens as reading the whole block each time:
    /// through contexts of every window and past the block (the context then slides).
    #[test]
    fn shorter_windows_draw_what_the_whole_block_draws() {
        for job in MODELS {
            let tmp = tempfile::tempdir().unwrap();
            let run = tiny_run(tmp.path(), job);
            assert_eq!(
                draws(&run, false, true),
                draws(&run, false, false),
                "{job:?}"
            );
        }
    }

    #[test]
    fn a_vocabulary_writes_back_what_it_read() {
        let v = Vocabulary::of(crate::spec::Tokenizer::Char, "hello world");
        assert_eq!(v.decode(&v.encode("low").unwrap()), "low");
    }
}
