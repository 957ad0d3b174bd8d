//! The ops, one folder each: its settings as a job writes them (serde, the schema), its
//! output shape and parameters, what it saves for backward, and its forward and backward
//! passes over a backend. This file is the registry: the one place that lists them.
//!
//! The graph, the buffer plan and the executor ask an op through `OpKind` and `Compute`,
//! traits without default methods, so a new op answers every question.

mod checks;
mod context;
mod kind;
mod shape;

pub mod activation;
pub mod add;
pub mod attention;
pub mod batchnorm;
pub mod concat;
pub mod conv2d;
pub mod dropout;
pub mod embedding;
pub mod layernorm;
pub mod linear;
pub mod multiply;
pub mod pool;
pub mod position_embedding;
pub mod repeat;
pub mod rmsnorm;
pub mod rotary;
pub mod softmax;
pub mod view;

pub use checks::{size_range, Checks, MAX_SIZE};
pub use context::{round, Backward, Dx, Forward, Fusion, Grads, Io, Mask, Pass};
pub use kind::{Build, Compute, Flops, Init, OpKind, ParamTensor, Properties, SavedState, Scratch};
pub use shape::{numel, reserve, shape_str, values, MAX_SAMPLE_VALUES, PARAM_ALIGN};

pub use activation::{GeluApproximation, GeluSpec};
pub use attention::AttentionSpec;
pub use batchnorm::BatchNormSpec;
pub use conv2d::{Conv2dSpec, Size2};
pub use dropout::DropoutSpec;
pub use embedding::EmbeddingSpec;
pub use layernorm::LayerNormSpec;
pub use linear::LinearSpec;
pub use pool::PoolSpec;
pub use position_embedding::PositionEmbeddingSpec;
pub use repeat::RepeatSpec;
pub use rmsnorm::RmsNormSpec;
pub use rotary::RotarySpec;
pub use view::ReshapeSpec;

use crate::error::Result;
use crate::tensor::Backend;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

// Settings of a layer kind that has none besides `type`, `name` and `inputs`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NoSettings {}

/// The registry. Each line: the job's `type` name, the `LayerSpec` variant with its
/// settings, and the function that builds the op from them.
macro_rules! layer_kinds {
    ($($(#[$doc:meta])* $name:literal => $variant:ident($settings:ty) by $build:path,)*) => {
        /// A layer's kind. `type` picks it; the other keys are that kind's settings.
        #[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
        #[serde(tag = "type", rename_all = "snake_case")]
        pub enum LayerSpec {
            $($(#[$doc])* $variant($settings),)*
        }

        impl LayerSpec {
            /// Every `type`, as `kind` names them.
            pub const KINDS: &[&str] = &[$($name),*];

            /// The layer of type `kind` with `settings`, the layer's other keys. None: no
            /// such type.
            pub fn from_settings(
                kind: &str,
                settings: toml::Table,
            ) -> std::result::Result<LayerSpec, Option<String>> {
                let settings = toml::Value::Table(settings);
                match kind {
                    $($name => read(settings).map(LayerSpec::$variant).map_err(Some),)*
                    _ => Err(None),
                }
            }

            /// The `type` name.
            pub fn kind(&self) -> &'static str {
                match self {
                    $(LayerSpec::$variant(_) => $name,)*
                }
            }

            /// The op, its output shape, and its parameters placed in the flat buffer.
            pub fn build(&self, at: &mut Build) -> Result<(Op, Vec<usize>)> {
                match self {
                    $(LayerSpec::$variant(settings) => $build(settings, at),)*
                }
            }

            /// Its settings' problems that types cannot express, as (key, message).
            pub fn problems(&self) -> Checks {
                let mut checks = Checks::default();
                match self {
                    $(LayerSpec::$variant(settings) => settings.check(&mut checks),)*
                }
                checks
            }
        }
    };
}

layer_kinds! {
    /// y = x Wᵀ + b, with PyTorch's initialisation (kaiming-uniform, a = √5).
    "linear" => Linear(LinearSpec) by linear::build,
    "relu" => Relu(NoSettings) by activation::relu,
    "gelu" => Gelu(GeluSpec) by activation::gelu,
    "tanh" => Tanh(NoSettings) by activation::tanh,
    "sigmoid" => Sigmoid(NoSettings) by activation::sigmoid,
    /// x·sigmoid(x), PyTorch's SiLU.
    "silu" => Silu(NoSettings) by activation::silu,
    /// Zeroes each element with probability p in training and scales the rest by 1/(1-p).
    "dropout" => Dropout(DropoutSpec) by dropout::build,
    /// Collapses every dimension but the batch into one.
    "flatten" => Flatten(NoSettings) by view::flatten,
    /// Gives each sample a new shape with the same number of values (one -1 is inferred).
    "reshape" => Reshape(ReshapeSpec) by view::reshape,
    /// 2-D convolution over [channels, height, width] samples, PyTorch's Conv2d.
    "conv2d" => Conv2d(Conv2dSpec) by conv2d::build,
    /// Maximum over windows (padding counts as -inf), PyTorch's MaxPool2d.
    "maxpool2d" => Maxpool2d(PoolSpec) by pool::max,
    /// Mean over windows (padding counts as 0: count_include_pad), PyTorch's AvgPool2d.
    "avgpool2d" => Avgpool2d(PoolSpec) by pool::avg,
    /// Mean over each channel's whole plane: [c, h, w] → [c, 1, 1] (AdaptiveAvgPool2d(1)).
    "global_avg_pool" => GlobalAvgPool(NoSettings) by pool::global_avg,
    /// Normalises over the last dimension, with learned scale and shift (PyTorch's LayerNorm).
    "layernorm" => Layernorm(LayerNormSpec) by layernorm::build,
    /// Divides each row of the last dimension by its root mean square, with a learned scale
    /// (PyTorch's RMSNorm).
    "rmsnorm" => Rmsnorm(RmsNormSpec) by rmsnorm::build,
    /// Batch normalisation of [features] samples (PyTorch's BatchNorm1d): batch statistics in
    /// training, running statistics in evaluation.
    "batchnorm1d" => Batchnorm1d(BatchNormSpec) by batchnorm::build_1d,
    /// Batch normalisation over each channel of [channels, height, width] samples
    /// (PyTorch's BatchNorm2d).
    "batchnorm2d" => Batchnorm2d(BatchNormSpec) by batchnorm::build_2d,
    /// The elementwise sum of its inputs, which must have the same shape (residual
    /// connections).
    "add" => Add(NoSettings) by add::build,
    /// The elementwise product of its two inputs, which must have the same shape (Llama's
    /// gated MLP).
    "multiply" => Multiply(NoSettings) by multiply::build,
    /// Its inputs joined along the first per-sample dimension (channels for images, features
    /// for vectors); the other dimensions must agree.
    "concat" => Concat(NoSettings) by concat::build,
    /// Softmax over the last dimension.
    "softmax" => Softmax(NoSettings) by softmax::softmax,
    /// log(softmax) over the last dimension, computed stably.
    "log_softmax" => LogSoftmax(NoSettings) by softmax::log_softmax,
    /// A learned vector per token id (PyTorch's Embedding): reads whole-number ids in
    /// [0, num_embeddings) from the data; [length] → [length, embedding_dim].
    "embedding" => Embedding(EmbeddingSpec) by embedding::build,
    /// Multi-head scaled dot-product attention, causal by default: [T, 3·C] (queries, keys
    /// and values side by side, from a linear layer) → [T, C].
    "attention" => Attention(AttentionSpec) by attention::build,
    /// Rotary position embedding (RoPE) of the queries and keys in [T, 3·C] samples, before
    /// attention: Llama's, in Hugging Face's `rotate_half` convention.
    "rotary" => Rotary(RotarySpec) by rotary::build,
    /// Adds a learned vector per position to [T, C] samples (GPT's position embedding).
    "position_embedding" => PositionEmbedding(PositionEmbeddingSpec) by position_embedding::build,
    /// The layers of model.blocks.BLOCK, `times` copies in a row (transformer blocks). A
    /// copy's layer `x` is named BLOCK<i>_x, and its last layer BLOCK<i> unless named;
    /// `"block_input"` in `inputs` is the copy's input.
    "repeat" => Repeat(RepeatSpec) by repeat::build,
}

impl LayerSpec {
    /// How many inputs the layer takes: add and concat two or more, multiply two, the
    /// others one.
    pub fn inputs_taken(&self) -> std::ops::RangeInclusive<usize> {
        match self {
            LayerSpec::Add(_) | LayerSpec::Concat(_) => 2..=usize::MAX,
            LayerSpec::Multiply(_) => 2..=2,
            _ => 1..=1,
        }
    }
}

impl NoSettings {
    fn check(&self, _: &mut Checks) {}
}

/// The registry of built ops: each variant holds one op's struct.
macro_rules! ops {
    ($($variant:ident($op:ty),)*) => {
        /// A built layer's op, with its shapes and parameters' places.
        #[derive(Debug, Clone, PartialEq)]
        pub enum Op {
            $($variant($op),)*
        }

        impl Op {
            /// The questions every op answers.
            pub fn kind(&self) -> &(dyn OpKind + 'static) {
                match self {
                    $(Op::$variant(op) => op,)*
                }
            }

            /// Its forward and backward passes on backend `B`.
            pub fn compute<B: Engine>(&self) -> &dyn Compute<B> {
                match self {
                    $(Op::$variant(op) => op,)*
                }
            }
        }
    };
}

ops! {
    Linear(linear::Linear),
    Activation(activation::Activation),
    Dropout(dropout::Dropout),
    View(view::View),
    Conv2d(conv2d::Conv2d),
    Pool(pool::Pool),
    LayerNorm(layernorm::LayerNorm),
    RmsNorm(rmsnorm::RmsNorm),
    BatchNorm(batchnorm::BatchNorm),
    Add(add::Add),
    Multiply(multiply::Multiply),
    Concat(concat::Concat),
    Softmax(softmax::Softmax),
    Embedding(embedding::Embedding),
    Attention(attention::Attention),
    Rotary(rotary::Rotary),
    PositionEmbedding(position_embedding::PositionEmbedding),
}

/// The ops that keep kernels of their own (each one's `Kernels`, implemented in its folder
/// for the CPU and CUDA backends).
macro_rules! engine {
    ($($op:ident),* $(,)?) => {
        /// What the executor runs on: `tensor::Backend`'s building blocks, and the kernels of the
        /// ops that keep their own (each such op's `Kernels`, implemented in its folder for the CPU
        /// and CUDA backends).
        pub trait Engine: Backend $(+ $op::Kernels)* {}

        impl<B: Backend $(+ $op::Kernels)*> Engine for B {}
    };
}

engine!(
    activation,
    attention,
    batchnorm,
    conv2d,
    dropout,
    embedding,
    layernorm,
    linear,
    multiply,
    pool,
    position_embedding,
    rmsnorm,
    rotary,
    softmax,
);

impl std::ops::Deref for Op {
    type Target = dyn OpKind;
    fn deref(&self) -> &Self::Target {
        self.kind()
    }
}

/// A value read as `T`; an error says what was wrong below the value (`[2]: ...`) first.
pub(crate) fn read<T: serde::de::DeserializeOwned>(
    value: toml::Value,
) -> std::result::Result<T, String> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let message = e.inner().message().trim_end().to_string();
        match e.path().to_string() {
            path if path == "." => message,
            path => format!("key `{path}`: {message}"),
        }
    })
}
