//! `trainer sample`: text from a run's language model. The prompt, in the run's vocabulary,
//! then one token at a time: the model reads the last block_size tokens, and the next token
//! is drawn from its last position's logits (divided by the temperature, cut to the top k).
//! The whole context is recomputed for each token (no key/value cache yet).

use super::evaluate::Trained;
use super::*;
use crate::graph::Network;
use crate::tensor::rng::Rng;

/// `trainer sample`'s arguments.
#[derive(clap::Args)]
pub struct SampleArgs {
    /// The run directory of a model trained on text.
    pub run: PathBuf,
    /// A training checkpoint of the run instead of its final weights.
    #[arg(long, value_name = "FILE")]
    pub checkpoint: Option<PathBuf>,
    /// The text to continue (default: a new line).
    #[arg(long, default_value = "\n")]
    pub prompt: String,
    /// How many tokens to generate.
    #[arg(long, default_value_t = 200)]
    pub tokens: usize,
    /// Divides the logits: below 1 sharper, above 1 flatter.
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f64,
    /// Draw from the k likeliest tokens only.
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,
    /// The seed of the draws.
    #[arg(long, default_value_t = 1337)]
    pub seed: u64,
}

/// The prompt and the generated text.
pub fn sample(args: &SampleArgs) -> Result<String> {
    if !(args.temperature > 0.0 && args.temperature.is_finite()) {
        return Err(Error::Job(format!(
            "--temperature {}: must be a positive number",
            args.temperature
        )));
    }
    if args.top_k == Some(0) {
        return Err(Error::Job("--top-k 0: must be at least 1".into()));
    }
    let trained = Trained::load(&args.run, args.checkpoint.as_deref())?;
    let Some(vocabulary) = trained.preprocess.vocabulary.clone() else {
        return Err(Error::Job(format!(
            "{}: its model was not trained on text (data.source = \"text\") or on token \
             files with a data.tokenizer, so it has no vocabulary to write with",
            args.run.display()
        )));
    };
    let mut ids = vocabulary.encode(&args.prompt).map_err(|c| {
        Error::Job(format!(
            "--prompt: the character {c:?} is not in the run's vocabulary of {} tokens",
            vocabulary.len()
        ))
    })?;
    if ids.is_empty() {
        return Err(Error::Job(
            "--prompt: empty; give at least one character".into(),
        ));
    }
    let generated = generate(trained, &mut ids, vocabulary.len(), args)?;
    Ok(args.prompt.clone() + &vocabulary.decode(&generated))
}

/// Appends `args.tokens` drawn tokens to `ids`; returns them. Tokens are drawn from the
/// vocabulary's `known` ids only: a padded output layer (GPT-2's 50,304 logits for 50,257
/// tokens) has logits for ids no text holds.
fn generate(
    trained: Trained,
    ids: &mut Vec<u32>,
    known: usize,
    args: &SampleArgs,
) -> Result<Vec<u32>> {
    let backend = CpuBackend::new(cpu_threads(&trained.spec));
    let block = trained.preprocess.sample_shape.iter().product::<usize>();
    let vocab = trained.preprocess.classes.unwrap_or(0);
    let half = train::half_kind(trained.spec.precision.mode);
    let seed = trained.spec.job.seed;
    let mut net = Network::with_precision(&backend, trained.graph, &trained.params, 1, seed, half)?;
    net.set_running_stats(&backend, &trained.running_stats)?;
    let mut rng = Rng::new(args.seed);
    let (mut input, mut logits) = (vec![0.0f32; block], vec![0.0f32; block * vocab]);
    let mut drawn = Vec::with_capacity(args.tokens);
    for _ in 0..args.tokens {
        // The last `block` tokens, padded after them: causal attention keeps later positions
        // from the ones read.
        let context = &ids[ids.len().saturating_sub(block)..];
        input.fill(0.0);
        for (x, &id) in input.iter_mut().zip(context) {
            *x = id as f32;
        }
        backend.upload(&input, net.input_mut());
        net.forward(&backend, 1, false, 0);
        backend.download(net.output(), &mut logits);
        let last = &logits[(context.len() - 1) * vocab..][..known.min(vocab)];
        let next = draw(last, args.temperature, args.top_k, &mut rng);
        ids.push(next);
        drawn.push(next);
    }
    Ok(drawn)
}

/// A token drawn from softmax(logits / temperature) over the `top_k` largest logits.
fn draw(logits: &[f32], temperature: f64, top_k: Option<usize>, rng: &mut Rng) -> u32 {
    let scaled: Vec<f64> = logits.iter().map(|&l| l as f64 / temperature).collect();
    let cutoff = match top_k {
        Some(k) if k < scaled.len() => {
            let mut sorted = scaled.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            sorted[k - 1]
        }
        _ => f64::NEG_INFINITY,
    };
    let max = scaled.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let weights: Vec<f64> = scaled
        .iter()
        .map(|&s| if s >= cutoff { (s - max).exp() } else { 0.0 })
        .collect();
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::vocabulary::Vocabulary;

    #[test]
    fn top_k_one_is_the_largest_logit_and_draws_follow_the_probabilities() {
        let mut rng = Rng::new(3);
        let logits = [0.1, 2.0, -1.0, 1.9];
        for _ in 0..20 {
            assert_eq!(draw(&logits, 1.0, Some(1), &mut rng), 1);
        }
        let mut counts = [0usize; 4];
        for _ in 0..20_000 {
            counts[draw(&logits, 1.0, Some(2), &mut rng) as usize] += 1;
        }
        assert_eq!((counts[0], counts[2]), (0, 0));
        // e^2 / (e^2 + e^1.9) = 0.525
        let share = counts[1] as f64 / 20_000.0;
        assert!((share - 0.525).abs() < 0.015, "{share}");
    }

    #[test]
    fn a_vocabulary_writes_back_what_it_read() {
        let v = Vocabulary::of(crate::spec::Tokenizer::Char, "hello world");
        assert_eq!(v.decode(&v.encode("low").unwrap()), "low");
    }
}
