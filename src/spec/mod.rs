//! What a job file may say: the serde types (which are also the JSON Schema), their defaults,
//! the layered loading (file, environment, `--set`) and the validation that runs before any work.

mod blocks;
mod controls;
mod env;
mod explain;
mod keys;
mod load;
mod messages;
mod sources;
mod validate;
mod world;

pub use controls::{
    eval_metrics, has_accuracy, parse_duration, EarlyStoppingSpec, EvaluateTest, OnNonFinite,
    StopMode, MAX_SKIPPED_IN_A_ROW,
};
pub use explain::explain;
pub use keys::{canonical_keys, parse_set_arg};
pub use load::validate;
pub use load::{load_job, JobSource};
pub(crate) use messages::toml_error;
pub use sources::KeySources;
pub use validate::{check_run_name, parse_device, DeviceChoice};
pub use world::Rendezvous;

use crate::ops::read;
pub use crate::ops::{
    BatchNormSpec, Conv2dSpec, DropoutSpec, EmbeddingSpec, GeluApproximation, GeluSpec,
    LayerNormSpec, LayerSpec, LinearSpec, NoSettings, PoolSpec, ReshapeSpec, Size2,
};

/// DDP's `bucket_cap_mb` default: gradient buckets of 25 MiB (`parallel.bucket_mb`).
pub const DEFAULT_BUCKET_MB: f64 = 25.0;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// A training job: what to train, on what data, how and where.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    #[serde(default)]
    pub job: JobSection,
    pub data: DataSpec,
    pub model: ModelSpec,
    #[serde(default)]
    pub loss: LossSpec,
    pub optimizer: OptimizerSpec,
    #[serde(default)]
    pub train: TrainSpec,
    #[serde(default)]
    pub device: DeviceSpec,
    #[serde(default)]
    pub precision: PrecisionSpec,
    #[serde(default)]
    pub checkpoint: CheckpointSpec,
    #[serde(default)]
    pub parallel: ParallelSpec,
}

/// The names of the top-level sections, in file order.
pub const SECTIONS: [&str; 10] = [
    "job",
    "data",
    "model",
    "loss",
    "optimizer",
    "train",
    "device",
    "precision",
    "checkpoint",
    "parallel",
];

#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct JobSection {
    /// Run name: runs go to `<runs-dir>/<name>/<run-id>/`. Defaults to the job file's stem.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Seed for initialisation, shuffling, splits, dropout and synthetic data.
    #[serde(default)]
    pub seed: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DataSource {
    /// The bundled UCI handwritten digits (1,797 8x8 images, 10 classes). No download.
    Digits,
    /// A CSV file: one sample per row, a label column and feature columns.
    Csv,
    /// IDX files (MNIST, Fashion-MNIST), gzip-compressed or raw.
    Idx,
    /// Seeded generated data, for classification or regression.
    Synthetic,
    /// A UTF-8 text file (plain or gzip) for a language model: samples are windows of
    /// block_size tokens, and their targets the next token at each position.
    Text,
    /// Token files for a language model (llm.c's shards or nanoGPT's uint16 .bin), in
    /// windows as `text`.
    Tokens,
}

/// How a token file stores its ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub enum TokenFormat {
    /// llm.c's: a header of 256 int32 (magic 20240520, version 1 for uint16 ids or 2 for
    /// uint32, the token count), then the ids.
    #[default]
    #[serde(rename = "llm.c")]
    LlmC,
    /// nanoGPT's train.bin and val.bin: uint16 ids, no header.
    #[serde(rename = "uint16")]
    Uint16,
}

/// How a text becomes token ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Tokenizer {
    /// One id per character: the vocabulary is the text's characters, sorted (nanoGPT's
    /// shakespeare_char).
    #[default]
    Char,
    /// One id per byte: 256 ids, any file.
    Bytes,
    /// GPT-2's byte-pair encoding (tiktoken's r50k_base, 50,257 ids), as nanoGPT's and
    /// llm.c's data scripts use it: `<|endoftext|>` in the text is read as plain text.
    Gpt2,
}

impl Tokenizer {
    /// Its name in a job file.
    pub fn name(self) -> &'static str {
        match self {
            Tokenizer::Char => "char",
            Tokenizer::Bytes => "bytes",
            Tokenizer::Gpt2 => "gpt2",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Normalize {
    /// Use the values as they are.
    None,
    /// Divide every feature by the largest absolute value in the training split.
    Scale,
    /// Per feature: subtract the training split's mean and divide by its standard deviation.
    Standardize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Task {
    /// Integer class labels `0..classes`.
    Classification,
    /// Real-valued targets.
    Regression,
}

/// A CSV column, by header name or by 0-based index.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(
    untagged,
    expecting = "expected a column's header name or its 0-based index"
)]
pub enum Column {
    Index(usize),
    Name(String),
}

/// Where the samples come from and how they are batched. Keys of one source are refused
/// with another source. Relative paths are relative to the job file's directory.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DataSpec {
    pub source: DataSource,
    /// Samples per micro-batch (default 64), shared equally by the data-parallel replicas.
    /// Give this or global_batch_size, not both.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 16777216))]
    pub batch_size: Option<usize>,
    /// Samples per optimizer step over all replicas and accumulated micro-batches, instead
    /// of batch_size: each replica's share of a micro-batch is then global_batch_size /
    /// (replicas x train.grad_accum_steps), which must divide.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 16777216))]
    pub global_batch_size: Option<usize>,
    /// Fraction of the training samples held out (seeded) for validation; 0 for none.
    /// text: the last fraction of the text (nanoGPT's 0.1).
    #[serde(default)]
    #[schemars(range(min = 0), extend("exclusiveMaximum" = 1))]
    pub val_fraction: f64,
    /// Reshuffle the training samples every epoch (seeded).
    #[serde(default = "yes")]
    pub shuffle: bool,
    /// Drop the last, smaller batch of an epoch.
    #[serde(default)]
    pub drop_last: bool,
    /// Feature normalisation, with statistics from the training split only.
    #[serde(default = "default_normalize")]
    pub normalize: Normalize,

    // csv
    /// csv: the file with the training samples. text: the text file. tokens: the token
    /// file, or shards by a glob in the file name (`train_*.bin`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// csv: a test file with the same columns (reported as split "test").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test_path: Option<PathBuf>,
    /// csv: whether the first row holds column names (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<bool>,
    /// csv: the label column (name or index; default: the last column).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<Column>,
    /// csv: the feature columns (default: every column but the label and `exclude`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub features: Option<Vec<Column>>,
    /// csv: columns that are not features (an id, a date), when `features` is not given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exclude: Option<Vec<Column>>,

    // idx
    /// idx: training images (IDX, u8, gzip or raw).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_images: Option<PathBuf>,
    /// idx: training labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_labels: Option<PathBuf>,
    /// idx: test images (reported as split "test").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test_images: Option<PathBuf>,
    /// idx: test labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test_labels: Option<PathBuf>,

    // csv and synthetic
    /// csv, synthetic: classification (integer labels) or regression (real targets).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<Task>,

    // synthetic
    /// synthetic: number of samples to generate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 2))]
    pub samples: Option<usize>,
    /// synthetic: features per sample.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub num_features: Option<usize>,
    /// csv, idx, synthetic: number of classes; labels must lie in 0..classes
    /// (csv and idx default: the largest label + 1; synthetic default: 4).
    /// tokens: the vocabulary's size; ids must lie below it (default: the largest + 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 2))]
    pub classes: Option<usize>,
    /// synthetic regression: number of targets per sample.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub targets: Option<usize>,
    /// synthetic: standard deviation of the noise added to each sample.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub noise: Option<f64>,

    // text
    /// text: how the text becomes token ids, "char" (default), "bytes" or "gpt2".
    /// tokens: the tokenizer that made the files ("gpt2" or "bytes"), so that `trainer
    /// sample` can read a prompt and write text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<Tokenizer>,
    /// text, tokens: tokens per sample, the context length (nanoGPT's block_size).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 16777216))]
    pub block_size: Option<usize>,

    // tokens
    /// tokens: how the files store their ids, "llm.c" (default) or "uint16".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_format: Option<TokenFormat>,
    /// tokens: the validation file, or shards by a glob in the file name (`val_*.bin`),
    /// instead of data.val_fraction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_path: Option<PathBuf>,
}

/// The data keys' defaults, in one place: the loaders, validation and config.toml read them
/// here.
impl DataSpec {
    /// The keys that name data files, with their values.
    pub fn path_keys(&self) -> [(&'static str, &Option<PathBuf>); 7] {
        [
            ("data.path", &self.path),
            ("data.val_path", &self.val_path),
            ("data.test_path", &self.test_path),
            ("data.train_images", &self.train_images),
            ("data.train_labels", &self.train_labels),
            ("data.test_images", &self.test_images),
            ("data.test_labels", &self.test_labels),
        ]
    }

    /// csv, synthetic: classification unless given.
    pub fn task(&self) -> Task {
        self.task.unwrap_or(Task::Classification)
    }

    /// csv: whether the first row holds column names.
    pub fn header(&self) -> bool {
        self.header.unwrap_or(true)
    }

    /// text: the tokenizer.
    pub fn tokenizer(&self) -> Tokenizer {
        self.tokenizer.unwrap_or_default()
    }

    /// synthetic: samples to generate.
    pub fn samples(&self) -> usize {
        self.samples.unwrap_or(1000)
    }

    /// synthetic: features per sample.
    pub fn num_features(&self) -> usize {
        self.num_features.unwrap_or(16)
    }

    /// synthetic classification: the classes generated (csv and idx take theirs from the
    /// labels).
    pub fn synthetic_classes(&self) -> usize {
        self.classes.unwrap_or(4)
    }

    /// synthetic regression: targets per sample.
    pub fn targets(&self) -> usize {
        self.targets.unwrap_or(1)
    }

    /// synthetic: the noise's standard deviation, wide blobs for classes and a small error
    /// for regression.
    pub fn noise(&self) -> f64 {
        self.noise.unwrap_or(match self.task() {
            Task::Classification => 1.0,
            Task::Regression => 0.1,
        })
    }
}

/// The model graph: a list of layers, applied in order.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// The layers, in order. Each takes the previous layer's output unless it names its
    /// `inputs`; a plain list is a sequential model.
    pub layers: Vec<ModelLayer>,
    /// Shape of one input sample; defaults to the data's shape.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_shape: Option<Vec<usize>>,
    /// Start from the weights in this safetensors file (PyTorch nn.Sequential state_dict
    /// names: `<layer index>.weight` [out, in], `<layer index>.bias` [out]), e.g. a previous
    /// run's model.safetensors. Names and shapes are checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_from: Option<PathBuf>,
    /// How the parameters start: "pytorch" (each layer's PyTorch default) or "gpt2".
    #[serde(default)]
    pub init: InitScheme,
    /// Named lists of layers that `repeat` layers write out in their place.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub blocks: BTreeMap<String, Vec<ModelLayer>>,
    /// The tensor names in model.safetensors (and what init_from reads): "sequential"
    /// (`<layer name or index>.weight`, as nn.Sequential) or "nanogpt" (nanoGPT's GPT module:
    /// wte → transformer.wte, h3_attn_c_attn → transformer.h.3.attn.c_attn, lm_head).
    #[serde(default)]
    pub state_dict_names: StateDictNames,
    /// Where each layer is written in the job, once `repeat` layers are written out:
    /// `model.layers[i]`, or `model.blocks.NAME[j]` for a block's layer. Errors name these.
    #[serde(skip)]
    #[schemars(skip)]
    pub layer_keys: Vec<String>,
}

impl ModelSpec {
    /// The job's key of layer `i` (`layer_keys`), or `model.layers[i]`.
    pub fn layer_key(&self, i: usize) -> String {
        (self.layer_keys.get(i).cloned()).unwrap_or_else(|| format!("model.layers[{i}]"))
    }
}

/// How parameter tensors are named in a state_dict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum StateDictNames {
    /// `<layer name, else its index>.<tensor>`, as nn.Sequential and named modules.
    #[default]
    Sequential,
    /// nanoGPT's GPT module, from trainer's layer names: `lm_head` stays; `h<i>_<part>`
    /// becomes `transformer.h.<i>.<part>` with `attn_` and `mlp_` read as `attn.` and `mlp.`;
    /// any other name `transformer.<name>`.
    Nanogpt,
}

impl StateDictNames {
    /// The state_dict prefix of a layer whose own prefix (name or index) is `layer`.
    pub fn prefix(self, layer: &str) -> String {
        match self {
            StateDictNames::Sequential => layer.to_string(),
            StateDictNames::Nanogpt => nanogpt_prefix(layer),
        }
    }
}

fn nanogpt_prefix(layer: &str) -> String {
    if layer == "lm_head" {
        return layer.to_string();
    }
    let block = layer.strip_prefix('h').and_then(|rest| {
        let (index, part) = rest.split_once('_')?;
        index
            .bytes()
            .all(|b| b.is_ascii_digit())
            .then_some((index, part))
    });
    match block {
        Some((index, part)) => {
            let part = match part.split_once('_') {
                Some((module @ ("attn" | "mlp"), inner)) => format!("{module}.{inner}"),
                _ => part.to_string(),
            };
            format!("transformer.h.{index}.{part}")
        }
        None => format!("transformer.{layer}"),
    }
}

#[cfg(test)]
mod state_dict_names_tests {
    use super::StateDictNames::Nanogpt;

    #[test]
    fn nanogpt_names_are_its_gpt_modules() {
        for (ours, theirs) in [
            ("wte", "transformer.wte"),
            ("wpe", "transformer.wpe"),
            ("ln_f", "transformer.ln_f"),
            ("lm_head", "lm_head"),
            ("h0_ln_1", "transformer.h.0.ln_1"),
            ("h11_attn_c_attn", "transformer.h.11.attn.c_attn"),
            ("h3_attn_c_proj", "transformer.h.3.attn.c_proj"),
            ("h3_mlp_c_fc", "transformer.h.3.mlp.c_fc"),
            ("h3_mlp_c_proj", "transformer.h.3.mlp.c_proj"),
            ("head_x", "transformer.head_x"),
            ("7", "transformer.7"),
        ] {
            assert_eq!(Nanogpt.prefix(ours), theirs);
        }
    }
}

/// Initial parameter values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum InitScheme {
    /// Each layer's PyTorch default (linear: kaiming-uniform; embedding: N(0, 1); ...).
    #[default]
    Pytorch,
    /// GPT-2's, as nanoGPT: every matrix (linear, conv, embedding tables) N(0, 0.02), biases
    /// 0, norm scales 1; layers whose name ends in `c_proj` (the projections into the
    /// residual stream) N(0, 0.02/√P), P the number of such layers (2 per GPT block).
    Gpt2,
}

/// One layer of the model: its kind and settings, and optionally a name and its inputs.
// Deserialised by hand (below), so that an error names the key at fault.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
pub struct ModelLayer {
    /// A name for `inputs` of later layers to refer to; also the prefix of the layer's
    /// tensors in model.safetensors (instead of its index).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The names of the layers whose outputs this layer takes ("input" is the data); by
    /// default the previous layer's output. add and concat take two or more.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inputs: Option<Vec<String>>,
    #[serde(flatten)]
    pub layer: LayerSpec,
}

/// serde reads a tagged enum (and a flattened field) into a buffer before it reads the
/// variant's fields, so its errors name only the layer (`model.layers[1]`), not the key
/// (`kernel_size`) or what a size may be. Here each part is read on its own instead, and an
/// error below the layer says its key first: "key `kernel_size`: ...", which the error
/// printers in spec::load join to the layer's path.
impl<'de> Deserialize<'de> for ModelLayer {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let mut table = toml::Table::deserialize(deserializer)?;
        let mut take = |key: &str| table.remove(key);
        let kind = match take("type") {
            None => return Err(D::Error::missing_field("type")),
            Some(toml::Value::String(kind)) => kind,
            Some(other) => {
                return Err(D::Error::custom(format!(
                    "key `type`: {}",
                    read::<String>(other).expect_err("not a string")
                )))
            }
        };
        let name = take("name").map(read::<String>).transpose();
        let inputs = take("inputs").map(read::<Vec<String>>).transpose();
        let layer = LayerSpec::from_settings(&kind, table);
        let keyed = |key: &str, e: String| D::Error::custom(format!("key `{key}`: {e}"));
        Ok(ModelLayer {
            name: name.map_err(|e| keyed("name", e))?,
            inputs: inputs.map_err(|e| keyed("inputs", e))?,
            layer: match layer {
                Ok(layer) => layer,
                Err(None) => {
                    let kinds: Vec<String> =
                        LayerSpec::KINDS.iter().map(|k| format!("`{k}`")).collect();
                    let known = kinds.join(", ");
                    let e = format!("unknown variant `{kind}`, expected one of {known}");
                    return Err(keyed("type", e));
                }
                Err(Some(e)) => {
                    // serde's words for a kind without settings of its own.
                    let none = format!(
                        ": a {kind} layer has no settings besides `type`, `name` and `inputs`"
                    );
                    let e = e.replace(", there are no fields", &none);
                    return Err(D::Error::custom(with_common_keys(&e)));
                }
            },
        })
    }
}

/// serde's "unknown field `x`, expected one of `out`, `in`, `bias`" for a layer's own
/// settings, with the keys every layer has (`type` is read already), so that the list is
/// whole and a near miss of `inputs` is suggested as that.
fn with_common_keys(message: &str) -> String {
    let Some((unknown, expected)) = message.split_once(", expected ") else {
        return message.to_string();
    };
    // (After the key read's own "key `x`: ", when it names one.)
    if !unknown.contains("unknown field `") {
        return message.to_string();
    }
    let own = expected.strip_prefix("one of ").unwrap_or(expected);
    format!("{unknown}, expected one of {own}, `name`, `inputs`")
}

impl From<LayerSpec> for ModelLayer {
    fn from(layer: LayerSpec) -> Self {
        ModelLayer {
            name: None,
            inputs: None,
            layer,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum LossKind {
    /// Softmax cross-entropy over logits with integer class labels (fused, stable).
    #[default]
    CrossEntropy,
    /// Mean squared error.
    Mse,
    /// Sigmoid + binary cross-entropy over logits, with targets in [0, 1].
    BceWithLogits,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LossSpec {
    #[serde(rename = "type", default)]
    pub kind: LossKind,
    /// cross_entropy: mixes the one-hot target with the uniform distribution, in [0, 1]
    /// (PyTorch's bounds; 1 is the uniform distribution alone).
    #[serde(default)]
    #[schemars(range(min = 0, max = 1))]
    pub label_smoothing: f64,
    /// cross_entropy: targets of this class are not scored: they add nothing to the loss,
    /// its mean, the accuracy or the gradient (PyTorch's ignore_index). A class index, e.g.
    /// a padding token's id. Default: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 16777215))]
    pub ignore_index: Option<u32>,
}

/// Which parameters weight decay applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DecayOn {
    /// Every parameter (PyTorch's one parameter group).
    #[default]
    All,
    /// Tensors of two or more dimensions only: linear and conv weights, embedding tables;
    /// not biases or norm scales (nanoGPT's configure_optimizers).
    Matrices,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerKind {
    Sgd,
    Adam,
    Adamw,
}

/// The optimizer, with PyTorch's formulas and defaults.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct OptimizerSpec {
    #[serde(rename = "type")]
    pub kind: OptimizerKind,
    /// Base learning rate.
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub lr: f64,
    /// Weight decay: L2 added to the gradient (sgd, adam) or decoupled (adamw).
    /// Defaults: 0 for sgd and adam, 0.01 for adamw.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub weight_decay: Option<f64>,
    /// sgd: momentum factor.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub momentum: f64,
    /// sgd: dampening for momentum.
    #[serde(default)]
    #[schemars(range(min = 0, max = 1))]
    pub dampening: f64,
    /// sgd: Nesterov momentum (needs momentum > 0 and dampening = 0).
    #[serde(default)]
    pub nesterov: bool,
    /// adam, adamw: coefficients of the running averages of the gradient and its square.
    #[serde(default = "default_betas", deserialize_with = "exactly_two")]
    pub betas: [f64; 2],
    /// adam, adamw: added to the denominator for numerical stability.
    #[serde(default = "default_eps")]
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub eps: f64,
    /// Which parameters weight decay applies to: "all" or "matrices" (nanoGPT's).
    #[serde(default)]
    pub weight_decay_on: DecayOn,
    #[serde(default)]
    pub schedule: ScheduleSpec,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleKind {
    #[default]
    Constant,
    /// Multiply by gamma every step_size steps.
    Step,
    /// Multiply by gamma at each milestone step.
    Multistep,
    /// Multiply by gamma every step.
    Exponential,
    /// Cosine from lr down to min_lr over the steps after warm-up.
    Cosine,
}

/// Learning-rate schedule, counted in optimizer steps, with an optional linear warm-up
/// before it (the schedule then starts at the end of the warm-up).
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ScheduleSpec {
    #[serde(rename = "type", default)]
    pub kind: ScheduleKind,
    /// step: period in optimizer steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub step_size: Option<usize>,
    /// multistep: the optimizer steps at which lr is multiplied by gamma.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub milestones: Option<Vec<usize>>,
    /// step, multistep, exponential: the decay factor (default 0.1; exponential has no default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gamma: Option<f64>,
    /// cosine: the final learning rate (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_lr: Option<f64>,
    /// Steps of linear warm-up from warmup_start_factor·lr to lr.
    #[serde(default)]
    pub warmup_steps: usize,
    /// Fraction of lr at the first warm-up step (default 0: PyTorch LinearLR uses 1/3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup_start_factor: Option<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TrainSpec {
    /// Passes over the training data.
    #[serde(default = "default_epochs")]
    #[schemars(range(min = 1))]
    pub epochs: usize,
    /// Stop after this many optimizer steps, even mid-epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_steps: Option<usize>,
    /// Micro-batches per optimizer step; the loss is averaged over them.
    #[serde(default = "one")]
    #[schemars(range(min = 1))]
    pub grad_accum_steps: usize,
    /// Clip gradients to this global L2 norm (the pre-clip norm is logged).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub clip_grad_norm: Option<f64>,
    /// Write a training row to metrics.csv every this many optimizer steps.
    #[serde(default = "default_log_every")]
    #[schemars(range(min = 1))]
    pub log_every: usize,
    /// Evaluate on the validation and test splits every this many epochs (0: never).
    #[serde(default = "one")]
    pub eval_every_epochs: usize,
    /// Also evaluate every this many optimizer steps (runs measured in steps, as a language
    /// model's): nanoGPT's eval_interval.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub eval_every_steps: Option<usize>,
    /// An evaluation every eval_every_steps reads at most this many batches of each split
    /// (nanoGPT's eval_iters); the evaluations after epochs and at the end read it all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub eval_steps: Option<usize>,
    /// When the test split is evaluated: "every_evaluation" (beside val) or "at_end" (once,
    /// after training, so that nothing is chosen by it).
    #[serde(default, skip_serializing_if = "EvaluateTest::is_default")]
    #[schemars(extend("default" = "every_evaluation"))]
    pub evaluate_test: EvaluateTest,
    /// CPU threads (default: every core).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1024))]
    pub threads: Option<usize>,
    /// Stop when an evaluation metric stops improving.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub early_stopping: Option<EarlyStoppingSpec>,
    /// Stop training after this much wall time, e.g. "90s", "30m", "2h", "1h30m"; the final
    /// evaluation still runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_time: Option<String>,
    /// What a step with a non-finite (inf or NaN) loss or gradient does: "error" stops the run
    /// as diverged (its last checkpoint stays); "skip" leaves the parameters and optimizer
    /// state untouched, counts the step in skipped_steps and goes on, failing only after
    /// 100 skipped steps in a row.
    #[serde(default, skip_serializing_if = "OnNonFinite::is_default")]
    #[schemars(extend("default" = "error"))]
    pub on_nonfinite: OnNonFinite,
}

impl Default for TrainSpec {
    fn default() -> Self {
        TrainSpec {
            epochs: default_epochs(),
            max_steps: None,
            grad_accum_steps: 1,
            clip_grad_norm: None,
            log_every: default_log_every(),
            eval_every_epochs: 1,
            eval_every_steps: None,
            eval_steps: None,
            evaluate_test: EvaluateTest::EveryEvaluation,
            threads: None,
            early_stopping: None,
            max_time: None,
            on_nonfinite: OnNonFinite::Error,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DeviceSpec {
    /// "auto", "cpu", "cuda" or "cuda:N".
    #[serde(rename = "type", default = "default_device")]
    pub kind: String,
    /// Allow TensorFloat-32 matmuls on CUDA (PyTorch's default is off).
    #[serde(default)]
    pub allow_tf32: bool,
    /// CUDA: record the training step (forward, loss, backward) once as a CUDA graph and
    /// replay it, where nothing in the step changes from step to step (no dropout).
    #[serde(default = "yes")]
    pub cuda_graphs: bool,
    /// CUDA: a linear layer's product adds its bias, and applies the ReLU after it, as it
    /// writes its output (cuBLASLt's epilogue), instead of in passes of their own.
    #[serde(default = "yes")]
    pub fused_epilogues: bool,
    /// Where the data set lives on a GPU: "resident" (uploaded once; a batch is gathered on
    /// the device), "streamed" (kept in host memory; each batch is gathered on the host into
    /// pinned memory and copied asynchronously), or "auto" (the default): resident when it
    /// fits beside the training's own memory, else streamed. "auto" streams token files,
    /// which stay where they lie. On the CPU the data are in host memory either way
    /// ("streamed" runs the streaming code).
    #[serde(default)]
    pub data: DataPlacement,
    /// Attention keeps each row's output and log-sum-exp instead of its T×T probabilities,
    /// and backward computes them again, as FlashAttention: on CUDA fused kernels that never
    /// store a T×T matrix; on the CPU the probabilities again, a head at a time. Saves
    /// memory; the same results within rounding. Default false.
    #[serde(default)]
    pub flash_attention: bool,
}

impl Default for DeviceSpec {
    fn default() -> Self {
        DeviceSpec {
            kind: default_device(),
            allow_tf32: false,
            cuda_graphs: true,
            fused_epilogues: true,
            data: DataPlacement::Auto,
            flash_attention: false,
        }
    }
}

/// Where the data set lives (device.data).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DataPlacement {
    #[default]
    Auto,
    Resident,
    Streamed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PrecisionMode {
    #[default]
    Fp32,
    Fp16,
    Bf16,
}

impl PrecisionMode {
    /// As the job file spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            PrecisionMode::Fp32 => "fp32",
            PrecisionMode::Fp16 => "fp16",
            PrecisionMode::Bf16 => "bf16",
        }
    }
}

/// Mixed precision with autocast's and GradScaler's semantics (docs/mixed-precision.md).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PrecisionSpec {
    /// "fp32", or "fp16" / "bf16": matmul and conv inputs and stored activations in half
    /// precision, with fp32 master weights, optimizer state and reductions.
    #[serde(default)]
    pub mode: PrecisionMode,
    /// Loss scaling: "dynamic" (GradScaler), "none", or a fixed number. Default: "dynamic"
    /// for fp16, "none" for bf16 and fp32.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<LossScale>,
    /// The first scale of dynamic loss scaling (GradScaler: 2^16).
    #[serde(default = "default_init_scale")]
    #[schemars(extend("exclusiveMinimum" = 0, "exclusiveMaximum" = 3.4028235677973366e38))]
    pub init_scale: f64,
    /// Multiplies the scale after `growth_interval` consecutive steps with finite gradients.
    #[serde(default = "default_growth_factor")]
    #[schemars(extend("exclusiveMinimum" = 1))]
    pub growth_factor: f64,
    /// Multiplies the scale after a step with an inf or NaN gradient (that step is skipped).
    #[serde(default = "default_backoff_factor")]
    #[schemars(extend("exclusiveMinimum" = 0, "exclusiveMaximum" = 1))]
    pub backoff_factor: f64,
    #[serde(default = "default_growth_interval")]
    #[schemars(range(min = 1))]
    pub growth_interval: u64,
    /// When the device cannot compute in `mode`: "error" (default) or "fp32" (train in fp32
    /// and say so in the log).
    #[serde(default)]
    pub fallback: PrecisionFallback,
}

impl Default for PrecisionSpec {
    fn default() -> Self {
        PrecisionSpec {
            mode: PrecisionMode::Fp32,
            loss_scale: None,
            init_scale: default_init_scale(),
            growth_factor: default_growth_factor(),
            backoff_factor: default_backoff_factor(),
            growth_interval: default_growth_interval(),
            fallback: PrecisionFallback::Error,
        }
    }
}

impl PrecisionSpec {
    /// The loss scaling in effect: the given one, else the mode's default.
    pub fn scaling(&self) -> Scaling {
        match self.loss_scale {
            Some(LossScale::Named(LossScaleKind::Dynamic)) => Scaling::Dynamic,
            Some(LossScale::Named(LossScaleKind::None)) => Scaling::None,
            Some(LossScale::Fixed(s)) => Scaling::Fixed(s),
            None if self.mode == PrecisionMode::Fp16 => Scaling::Dynamic,
            None => Scaling::None,
        }
    }
}

fn default_init_scale() -> f64 {
    65536.0
}
fn default_growth_factor() -> f64 {
    2.0
}
fn default_backoff_factor() -> f64 {
    0.5
}
fn default_growth_interval() -> u64 {
    2000
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged, expecting = "expected \"dynamic\", \"none\" or a number")]
pub enum LossScale {
    /// "dynamic" or "none".
    Named(LossScaleKind),
    /// A fixed scale.
    Fixed(
        #[schemars(extend("exclusiveMinimum" = 0, "exclusiveMaximum" = 3.4028235677973366e38))] f64,
    ),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum LossScaleKind {
    Dynamic,
    None,
}

/// The loss scaling a job trains with, resolved from `precision.loss_scale` and the mode.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scaling {
    None,
    Dynamic,
    Fixed(f64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PrecisionFallback {
    #[default]
    Error,
    Fp32,
}

/// Training-state checkpoints (runs/<name>/<id>/checkpoints/step-NNNNNNNN.safetensors),
/// resuming, and activation checkpointing.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSpec {
    /// Write a training checkpoint every this many optimizer steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub every_steps: Option<usize>,
    /// Write a training checkpoint every this many epochs (after that epoch's evaluation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub every_epochs: Option<usize>,
    /// Keep only the newest N checkpoints (default: keep all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub keep_last: Option<usize>,
    /// Also keep the checkpoint with the best evaluation, among those written right after an
    /// evaluation of their own parameters (every_epochs ones, and the final one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_best: Option<KeepBestSpec>,
    /// "auto": continue the newest unfinished run of the same job name under the runs
    /// directory, from its latest checkpoint (a new run when there is none). Default "never".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume: Option<ResumeMode>,
    /// Activation checkpointing: "none", "all", or { segments = N }.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activations: Option<ActivationCheckpointing>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ResumeMode {
    /// Always start a new run (unless `trainer run --resume` says otherwise).
    Never,
    /// Continue the newest unfinished run of this job name when it has a checkpoint.
    Auto,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KeepBestSpec {
    /// An evaluation column of metrics.csv: the split and the value.
    pub metric: BestMetric,
    /// Whether smaller or larger is better (default: min for a loss, max for an accuracy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<BestMode>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum BestMetric {
    ValLoss,
    ValAccuracy,
    TestLoss,
    TestAccuracy,
}

impl BestMetric {
    /// The name as written in the job and in a checkpoint's evaluation: "val_loss"...
    pub fn name(self) -> &'static str {
        match self {
            BestMetric::ValLoss => "val_loss",
            BestMetric::ValAccuracy => "val_accuracy",
            BestMetric::TestLoss => "test_loss",
            BestMetric::TestAccuracy => "test_accuracy",
        }
    }
    /// The metrics.csv split it is read from.
    pub fn split(self) -> &'static str {
        match self {
            BestMetric::ValLoss | BestMetric::ValAccuracy => "val",
            BestMetric::TestLoss | BestMetric::TestAccuracy => "test",
        }
    }
    pub fn is_accuracy(self) -> bool {
        matches!(self, BestMetric::ValAccuracy | BestMetric::TestAccuracy)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum BestMode {
    Min,
    Max,
}

impl KeepBestSpec {
    pub fn mode(&self) -> BestMode {
        self.mode.unwrap_or(if self.metric.is_accuracy() {
            BestMode::Max
        } else {
            BestMode::Min
        })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged, expecting = "expected \"none\", \"all\" or { segments = N }")]
pub enum ActivationCheckpointing {
    Mode(ActivationMode),
    Segments(SegmentsSpec),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ActivationMode {
    /// Keep every activation (no recomputation).
    None,
    /// Recompute every layer's forward pass during the backward pass, with the number of
    /// segments that needs the least activation memory (about √layers).
    All,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SegmentsSpec {
    /// Split the layers into this many segments of (nearly) equal layer counts; keep only
    /// the segment boundaries in the forward pass and recompute each segment in backward.
    #[schemars(range(min = 1))]
    pub segments: usize,
}

/// Data parallelism: replicas of the model, each computing the gradients of an equal share
/// of every micro-batch, averaged before every optimizer step. The result is the one device's
/// (up to rounding), whatever the number of replicas.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ParallelSpec {
    /// One replica per listed device: ["cpu", "cpu"] runs two replicas in threads of this
    /// process; ["cuda:0", "cuda:1"] or "all" (every visible GPU) runs one `trainer run`
    /// process per GPU, started by this one. In a multi-process run started by another
    /// launcher (RANK and WORLD_SIZE set), the devices of this machine's processes, one per
    /// LOCAL_RANK.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices: Option<ParallelDevices>,
    /// This many replicas on the job's device (device.type), instead of listing devices. 1
    /// runs the data-parallel path with one replica. On CUDA, more than one needs
    /// launch = "processes" ("cuda" then means each process's own GPU, LOCAL_RANK).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub replicas: Option<usize>,
    /// How the replicas run: "threads" of this process (CPU only), "processes" (one `trainer
    /// run` per replica, started by this one, meeting over loopback TCP like torchrun's
    /// ranks), or "auto" (the default): processes for GPUs, threads for CPU replicas.
    #[serde(default)]
    pub launch: Launch,
    /// Multi-process runs (RANK and WORLD_SIZE set): how long a rank waits for another (to
    /// connect, or for its part of a step) before failing with an error naming it, e.g.
    /// "90s", "10m" (the default). Evaluation and checkpoint writing on rank 0 must fit in it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<String>,
    /// Multi-process runs: how the ranks average gradients. "nccl": NCCL's all-reduce on the
    /// GPUs (each rank needs its own GPU, and libnccl); "tcp": through host memory and rank
    /// 0's connections (any device); "auto" (the default): NCCL on CUDA when libnccl loads
    /// and every rank on this machine has its own GPU, else tcp.
    #[serde(default)]
    pub backend: CollectiveBackend,
    /// Average the gradients bucket by bucket while the backward pass is still running, as
    /// PyTorch's DistributedDataParallel does, so that a device's all-reduce (NCCL) overlaps
    /// the rest of the backward pass (over tcp, a rank's buckets travel to rank 0 while both
    /// compute); false: the whole gradient buffer after it.
    #[serde(default = "yes")]
    pub overlap: bool,
    /// The size of a gradient bucket in MiB (DDP's bucket_cap_mb, default 25); the first
    /// bucket, the last layers', is at most 1 MiB so that the first all-reduce starts early.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub bucket_mb: Option<f64>,
    /// This process's place in a multi-process run, from the environment (RANK, WORLD_SIZE,
    /// MASTER_ADDR, MASTER_PORT as torchrun and SLURM set them); not a job key.
    #[serde(skip)]
    #[schemars(skip)]
    pub world: Option<Rendezvous>,
}

impl Default for ParallelSpec {
    fn default() -> Self {
        ParallelSpec {
            devices: None,
            replicas: None,
            launch: Launch::default(),
            timeout: None,
            backend: CollectiveBackend::default(),
            overlap: true,
            bucket_mb: None,
            world: None,
        }
    }
}

impl ParallelSpec {
    /// Bytes per gradient bucket (parallel.bucket_mb).
    pub fn bucket_bytes(&self) -> usize {
        let mb = self.bucket_mb.unwrap_or(DEFAULT_BUCKET_MB);
        (mb * (1 << 20) as f64) as usize
    }
}

/// parallel.timeout when not given.
pub const DEFAULT_PARALLEL_TIMEOUT: &str = "10m";

impl ParallelSpec {
    /// The number of replicas in the whole run (one per process in a multi-process run);
    /// None without data parallelism, or while devices = "all" is not resolved yet.
    pub fn replicas(&self) -> Option<usize> {
        match &self.world {
            Some(world) => Some(world.world_size),
            None => self.requested(),
        }
    }

    /// The replicas the keys ask for: one per listed device, or parallel.replicas.
    fn requested(&self) -> Option<usize> {
        match (&self.devices, self.replicas) {
            (Some(ParallelDevices::List(devices)), _) => Some(devices.len()),
            (_, Some(n)) => Some(n),
            _ => None,
        }
    }

    /// Whether the devices are GPUs ("all", or a list naming cuda devices), or, without a
    /// list, whether `device_type` is.
    pub fn on_gpus(&self, device_type: &str) -> bool {
        match &self.devices {
            Some(ParallelDevices::All(_)) => true,
            Some(ParallelDevices::List(devices)) => devices
                .iter()
                .any(|d| matches!(parse_device(d), Some(DeviceChoice::Cuda(_)))),
            None => matches!(parse_device(device_type), Some(DeviceChoice::Cuda(_))),
        }
    }

    /// Whether this process starts the replicas as processes of their own (it is not one
    /// of them, and there is more than one).
    pub fn launches_processes(&self, device_type: &str) -> bool {
        let processes = match self.launch {
            Launch::Processes => true,
            Launch::Threads => false,
            Launch::Auto => self.on_gpus(device_type),
        };
        processes && self.world.is_none() && self.requested().is_some_and(|n| n > 1)
    }

    /// The replicas this process runs in threads, as parallel.devices or parallel.replicas
    /// ask; None without them, in a multi-process run, or when they are processes.
    pub fn thread_replicas(&self, device_type: &str) -> Option<usize> {
        if self.world.is_some() || self.launches_processes(device_type) {
            return None;
        }
        self.requested()
    }

    /// The device this process trains on when the devices are listed: in a multi-process
    /// run its LOCAL_RANK's, else the first (the others are other processes' or threads'
    /// with the same kind).
    pub fn listed_device(&self) -> Option<&str> {
        let Some(ParallelDevices::List(devices)) = &self.devices else {
            return None;
        };
        let local = self.world.as_ref().map_or(0, |w| w.local_rank);
        devices.get(local).map(String::as_str)
    }
}

/// How data-parallel replicas run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Launch {
    #[default]
    Auto,
    Threads,
    Processes,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveBackend {
    #[default]
    Auto,
    Nccl,
    Tcp,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(
    untagged,
    expecting = "expected \"all\" or a list of devices such as [\"cuda:0\", \"cuda:1\"]"
)]
pub enum ParallelDevices {
    /// "all": every visible GPU.
    All(AllDevices),
    /// Explicit devices, such as ["cuda:0", "cuda:1"].
    List(Vec<String>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum AllDevices {
    All,
}

fn yes() -> bool {
    true
}
fn one() -> usize {
    1
}
/// data.batch_size when neither it nor data.global_batch_size is given.
pub const DEFAULT_BATCH_SIZE: usize = 64;
fn default_normalize() -> Normalize {
    Normalize::Standardize
}
fn default_betas() -> [f64; 2] {
    [0.9, 0.999]
}

/// A pair given as a list. serde reads a fixed-size array's first elements and leaves the
/// rest to the format, and figment ignores them: [0.9, 0.99, 0.5] would pass as [0.9, 0.99].
fn exactly_two<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<[f64; 2], D::Error> {
    let values = Vec::<f64>::deserialize(deserializer)?;
    <[f64; 2]>::try_from(values.as_slice()).map_err(|_| {
        serde::de::Error::custom(format!(
            "{values:?} given; expected a list of exactly 2 numbers"
        ))
    })
}
fn default_eps() -> f64 {
    1e-8
}
fn default_epochs() -> usize {
    10
}
fn default_log_every() -> usize {
    10
}
fn default_device() -> String {
    "auto".into()
}

impl ScheduleSpec {
    /// step, multistep: the decay factor (exponential's has no default: validation requires it).
    pub fn gamma(&self) -> f64 {
        self.gamma.unwrap_or(0.1)
    }

    /// cosine: the final learning rate.
    pub fn min_lr(&self) -> f64 {
        self.min_lr.unwrap_or(0.0)
    }

    /// The fraction of lr the warm-up starts from.
    pub fn warmup_start_factor(&self) -> f64 {
        self.warmup_start_factor.unwrap_or(0.0)
    }
}

/// A pool's stride defaults to its kernel size: config.toml writes it into each pool layer.
fn record_pool_strides(table: &mut toml::Table, layers: &[ModelLayer]) {
    let Some(toml::Value::Array(recorded)) = table
        .get_mut("model")
        .and_then(|model| model.get_mut("layers"))
    else {
        return;
    };
    for (layer, recorded) in layers.iter().zip(recorded) {
        if let (LayerSpec::Maxpool2d(pool) | LayerSpec::Avgpool2d(pool), Some(recorded)) =
            (&layer.layer, recorded.as_table_mut())
        {
            if let Ok(stride) = toml::Value::try_from(pool.stride()) {
                recorded.entry("stride").or_insert(stride);
            }
        }
    }
}

impl JobSpec {
    /// config.toml's body: the spec with the defaults it leaves unset filled in, so that the
    /// file says every value the run used. They stay unset in the spec itself because they
    /// depend on other keys (gamma on the schedule, a mode on the metric), or because its
    /// serialised form is what checkpoints compare, and a key that appears would refuse the
    /// resume of a checkpoint written before it existed. The machine's own values (threads)
    /// stay out: a config.toml must train the same job on another machine.
    pub fn recorded(&self) -> Result<toml::Table, toml::ser::Error> {
        let count = |n: usize| toml::Value::Integer(n as i64);
        let mut table = toml::Table::try_from(self)?;
        let mut fill = |path: &[&str], value: toml::Value| {
            let (key, sections) = path.split_last().expect("a key");
            let mut at = &mut table;
            for section in sections {
                let entry = at
                    .entry(section.to_string())
                    .or_insert_with(|| toml::Value::Table(toml::Table::new()));
                let Some(inner) = entry.as_table_mut() else {
                    return;
                };
                at = inner;
            }
            at.entry(key.to_string()).or_insert(value);
        };
        fill(&["optimizer", "weight_decay"], self.weight_decay().into());
        let schedule = &self.optimizer.schedule;
        if schedule.warmup_steps > 0 {
            fill(
                &["optimizer", "schedule", "warmup_start_factor"],
                schedule.warmup_start_factor().into(),
            );
        }
        match schedule.kind {
            ScheduleKind::Step | ScheduleKind::Multistep => {
                fill(&["optimizer", "schedule", "gamma"], schedule.gamma().into())
            }
            ScheduleKind::Cosine => fill(
                &["optimizer", "schedule", "min_lr"],
                schedule.min_lr().into(),
            ),
            ScheduleKind::Constant | ScheduleKind::Exponential => {}
        }
        let on_nonfinite = match self.train.on_nonfinite {
            OnNonFinite::Error => "error",
            OnNonFinite::Skip => "skip",
        };
        fill(&["train", "on_nonfinite"], on_nonfinite.into());
        fill(
            &["train", "evaluate_test"],
            self.train.evaluate_test.as_str().into(),
        );
        if let Some(stopping) = &self.train.early_stopping {
            let mode = match stopping.effective_mode() {
                StopMode::Min => "min",
                StopMode::Max => "max",
            };
            fill(&["train", "early_stopping", "mode"], mode.into());
        }
        let loss_scale = match self.precision.scaling() {
            Scaling::None => "none".into(),
            Scaling::Dynamic => "dynamic".into(),
            Scaling::Fixed(scale) => scale.into(),
        };
        fill(&["precision", "loss_scale"], loss_scale);
        if let Some(best) = &self.checkpoint.keep_best {
            let mode = match best.mode() {
                BestMode::Min => "min",
                BestMode::Max => "max",
            };
            fill(&["checkpoint", "keep_best", "mode"], mode.into());
        }
        let task = |task: Task| match task {
            Task::Classification => "classification",
            Task::Regression => "regression",
        };
        let data = &self.data;
        match data.source {
            DataSource::Csv => {
                fill(&["data", "header"], data.header().into());
                fill(&["data", "task"], task(data.task()).into());
            }
            DataSource::Synthetic => {
                fill(&["data", "task"], task(data.task()).into());
                fill(&["data", "samples"], count(data.samples()));
                fill(&["data", "num_features"], count(data.num_features()));
                match data.task() {
                    Task::Classification => {
                        fill(&["data", "classes"], count(data.synthetic_classes()))
                    }
                    Task::Regression => fill(&["data", "targets"], count(data.targets())),
                }
                fill(&["data", "noise"], data.noise().into());
            }
            DataSource::Text => {
                fill(&["data", "tokenizer"], data.tokenizer().name().into());
            }
            DataSource::Tokens => {
                let format = match data.token_format.unwrap_or_default() {
                    TokenFormat::LlmC => "llm.c",
                    TokenFormat::Uint16 => "uint16",
                };
                fill(&["data", "token_format"], format.into());
            }
            DataSource::Digits | DataSource::Idx => {}
        }
        fill(&["checkpoint", "activations"], "none".into());
        fill(&["checkpoint", "resume"], "never".into());
        // Every process of a multi-process run is one replica: recorded, so that the run's
        // config.toml run alone trains as many (in threads on the CPU).
        if let (Some(world), None) = (&self.parallel.world, &self.parallel.devices) {
            fill(&["parallel", "replicas"], count(world.world_size));
        }
        if self.parallel.replicas().is_some() || self.parallel.devices.is_some() {
            for (key, value) in parallel_defaults() {
                fill(&["parallel", key], value);
            }
        }
        record_pool_strides(&mut table, &self.model.layers);
        Ok(table)
    }

    /// The run name: `job.name`, set from the file stem at load time when absent.
    pub fn name(&self) -> &str {
        self.job.name.as_deref().unwrap_or("job")
    }

    /// Samples per micro-batch, all data-parallel replicas together: data.batch_size, or
    /// data.global_batch_size / train.grad_accum_steps, or the default.
    pub fn batch_size(&self) -> usize {
        match (self.data.batch_size, self.data.global_batch_size) {
            (Some(b), _) => b,
            (None, Some(g)) => g / self.train.grad_accum_steps.max(1),
            (None, None) => DEFAULT_BATCH_SIZE,
        }
    }

    /// The effective weight decay (PyTorch's defaults differ between optimizers).
    pub fn weight_decay(&self) -> f64 {
        self.optimizer
            .weight_decay
            .unwrap_or(match self.optimizer.kind {
                OptimizerKind::Adamw => 0.01,
                _ => 0.0,
            })
    }
}

/// The `[parallel]` defaults config.toml records only for a run with data parallelism
/// (elsewhere they do nothing): a run without is not different in them.
pub fn parallel_defaults() -> [(&'static str, toml::Value); 2] {
    [
        ("timeout", DEFAULT_PARALLEL_TIMEOUT.into()),
        ("bucket_mb", DEFAULT_BUCKET_MB.into()),
    ]
}

/// The JSON Schema of a job file, as written to schemas/job.schema.json.
pub fn json_schema() -> String {
    let mut schema = schemars::schema_for!(JobSpec);
    // A layer's keys are its kind's settings (the `oneOf` branch of its type) and the keys
    // every layer has: an editor then flags a misspelled one, as loading the job does.
    if let Some(layer) = schema
        .pointer_mut("/$defs/ModelLayer")
        .and_then(|l| l.as_object_mut())
    {
        layer.insert("unevaluatedProperties".into(), false.into());
    }
    serde_json::to_string_pretty(&schema).expect("a schema always serialises") + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layers(text: &str) -> Vec<ModelLayer> {
        #[derive(Deserialize)]
        struct Model {
            layers: Vec<ModelLayer>,
        }
        toml::from_str::<Model>(text).unwrap().layers
    }

    /// The schema refuses what loading refuses where JSON Schema can say it: a layer key
    /// its kind does not have, and the counts that must be at least 1.
    #[test]
    fn the_schema_holds_layer_keys_and_lower_bounds() {
        let schema: serde_json::Value = serde_json::from_str(&json_schema()).unwrap();
        let at = |pointer: &str| schema.pointer(pointer).cloned().unwrap_or_default();
        assert_eq!(at("/$defs/ModelLayer/unevaluatedProperties"), false);
        for (section, key) in [
            ("TrainSpec", "epochs"),
            ("TrainSpec", "log_every"),
            ("TrainSpec", "grad_accum_steps"),
            ("CheckpointSpec", "every_steps"),
            ("DataSpec", "batch_size"),
            ("PrecisionSpec", "growth_interval"),
        ] {
            let bound = at(&format!("/$defs/{section}/properties/{key}/minimum"));
            assert_eq!(bound, 1, "{section}.{key}");
        }
        assert_eq!(at("/$defs/OptimizerSpec/properties/lr/exclusiveMinimum"), 0);
        // Layer settings are in ModelLayer's oneOf, one entry per kind.
        let layer = |kind: &str| {
            let kinds = at("/$defs/ModelLayer/oneOf");
            let found =
                kinds.as_array().unwrap().iter().find(|k| {
                    k.pointer("/properties/type/const") == Some(&serde_json::json!(kind))
                });
            found
                .cloned()
                .unwrap_or_else(|| panic!("no {kind} in the schema"))
        };
        for (kind, key) in [
            ("linear", "out"),
            ("linear", "in"),
            ("conv2d", "out"),
            ("conv2d", "in"),
            ("conv2d", "groups"),
            ("embedding", "num_embeddings"),
            ("embedding", "embedding_dim"),
        ] {
            let bounds = layer(kind)["properties"][key].clone();
            assert_eq!(bounds["minimum"], 1, "{kind}.{key}");
            assert_eq!(bounds["maximum"], validate::MAX_SIZE, "{kind}.{key}");
        }
        for (section, key, least) in [
            ("ScheduleSpec", "step_size", 1),
            ("DataSpec", "classes", 2),
            ("DataSpec", "samples", 2),
            ("DataSpec", "num_features", 1),
            ("DataSpec", "targets", 1),
        ] {
            let bound = at(&format!("/$defs/{section}/properties/{key}/minimum"));
            assert_eq!(bound, least, "{section}.{key}");
        }
        assert_eq!(
            at("/$defs/DataSpec/properties/batch_size/maximum"),
            validate::MAX_BATCH
        );
    }

    #[test]
    fn every_layer_type_reads_and_writes_back_unchanged() {
        let read = layers(
            r#"layers = [
              { type = "linear", out = 3, bias = false, name = "a" },
              { type = "relu", inputs = ["a"] }, { type = "gelu", approximate = "tanh" },
              { type = "tanh" }, { type = "sigmoid" }, { type = "silu" }, { type = "dropout", p = 0.25 },
              { type = "flatten" }, { type = "reshape", shape = [1, -1] },
              { type = "conv2d", out = 4, kernel_size = [3, 5], padding = 1, groups = 2 },
              { type = "maxpool2d", kernel_size = 2 }, { type = "avgpool2d", kernel_size = 3, stride = 1 },
              { type = "global_avg_pool" }, { type = "layernorm", eps = 1e-6 },
              { type = "rmsnorm", eps = 1e-6 },
              { type = "batchnorm1d" }, { type = "batchnorm2d", momentum = 0.2 },
              { type = "add", inputs = ["a", "b"] }, { type = "multiply", inputs = ["a", "b"] },
              { type = "concat", inputs = ["a", "b"] },
              { type = "softmax" }, { type = "log_softmax" },
              { type = "embedding", num_embeddings = 20, embedding_dim = 8 },
              { type = "attention", heads = 4, causal = false },
              { type = "rotary", heads = 4, theta = 500.0 },
              { type = "position_embedding", num_positions = 64 },
              { type = "repeat", block = "h", times = 2 },
            ]"#,
        );
        let kinds: Vec<&str> = read.iter().map(|l| l.layer.kind()).collect();
        assert_eq!(kinds, LayerSpec::KINDS);
        assert_eq!(read[0].name.as_deref(), Some("a"));
        assert_eq!(read[1].inputs, Some(vec!["a".to_string()]));
        let LayerSpec::Conv2d(conv) = &read[9].layer else {
            panic!("{:?}", read[9]);
        };
        assert_eq!(
            (conv.out, conv.kernel_size, conv.padding, conv.groups),
            (4, Size2::HeightWidth([3, 5]), Size2::Square(1), 2)
        );
        // config.toml writes layers back with serde's derived Serialize.
        #[derive(Serialize)]
        struct Model<'a> {
            layers: &'a [ModelLayer],
        }
        let written = toml::to_string(&Model { layers: &read }).unwrap();
        assert_eq!(layers(&written), read);
    }

    #[test]
    fn the_recorded_job_writes_out_the_defaults_the_loaders_and_layers_use() {
        let job = |text: &str| toml::from_str::<JobSpec>(text).unwrap().recorded().unwrap();
        let model = r#"
            [model]
            layers = [{ type = "maxpool2d", kernel_size = [2, 3] },
                      { type = "avgpool2d", kernel_size = 2, stride = 1 }, { type = "flatten" }]
            [optimizer]
            type = "sgd"
            lr = 0.1"#;
        let synthetic = job(&format!("[data]\nsource = \"synthetic\"\n{model}"));
        let data = synthetic["data"].as_table().unwrap();
        for (key, value) in [
            ("task", "\"classification\""),
            ("samples", "1000"),
            ("num_features", "16"),
            ("classes", "4"),
            ("noise", "1.0"),
        ] {
            assert_eq!(data[key].to_string(), value, "data.{key}");
        }
        assert!(!data.contains_key("targets"));
        let strides: Vec<String> = synthetic["model"]["layers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|layer| layer.get("stride").map_or("-".into(), |s| s.to_string()))
            .collect();
        assert_eq!(strides, ["[2, 3]", "1", "-"]);

        let regression = job(&format!(
            "[data]\nsource = \"synthetic\"\ntask = \"regression\"\n{model}"
        ));
        assert_eq!(regression["data"]["targets"].as_integer(), Some(1));
        assert_eq!(regression["data"]["noise"].as_float(), Some(0.1));
        assert!(!regression["data"]
            .as_table()
            .unwrap()
            .contains_key("classes"));

        let csv = job(&format!(
            "[data]\nsource = \"csv\"\npath = \"a.csv\"\n{model}"
        ));
        assert_eq!(csv["data"]["header"].as_bool(), Some(true));
        assert_eq!(csv["data"]["task"].as_str(), Some("classification"));
        // The label's default, the last column, is the file's: not written.
        assert!(!csv["data"].as_table().unwrap().contains_key("label"));
    }

    #[test]
    fn a_layer_error_names_the_key_below_the_layer() {
        let error = |text: &str| {
            let text = format!("layers = [{text}]");
            #[derive(Debug, Deserialize)]
            #[allow(dead_code)]
            struct Model {
                layers: Vec<ModelLayer>,
            }
            toml::from_str::<Model>(&text)
                .unwrap_err()
                .message()
                .to_string()
        };
        assert_eq!(
            error(r#"{ type = "conv2d", out = 4, kernel_size = "3" }"#),
            "key `kernel_size`: expected a size: a number, or [height, width]"
        );
        assert_eq!(
            error(r#"{ type = "reshape", shape = [1, "a"] }"#),
            "key `shape[1]`: invalid type: string \"a\", expected i64"
        );
        assert_eq!(
            error(r#"{ type = "relu", name = 3 }"#),
            "key `name`: invalid type: integer `3`, expected a string"
        );
        assert!(error(r#"{ type = "lienar" }"#)
            .starts_with("key `type`: unknown variant `lienar`, expected one of `linear`, "));
        assert_eq!(error(r#"{ out = 3 }"#), "missing field `type`");
        assert_eq!(error(r#"{ type = "linear" }"#), "missing field `out`");
    }
}
