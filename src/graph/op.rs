//! The ops a layer can be, and what the graph, the buffer plan and the executor ask of
//! each. Every question is an exhaustive match: a new op answers each of them, and the
//! compiler names any it leaves out.

use super::numel;
use crate::tensor::{Activation, Conv2d, Pool2d, PoolKind};

#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// Parameters at `weight` ([out, inp] row-major) and `bias` (out) in the flat buffer.
    /// Over the last axis, as PyTorch's nn.Linear: a sample of [..., inp] is `rows` rows.
    Linear {
        inp: usize,
        out: usize,
        rows: usize,
        weight: usize,
        bias: Option<usize>,
    },
    Activation(Activation),
    Dropout {
        p: f32,
    },
    /// flatten, reshape: shares its input's buffer, only the shape changes.
    View,
    /// Parameters at `weight` ([o, c/groups, kh, kw]) and `bias` (o).
    Conv2d {
        geom: Conv2d,
        weight: usize,
        bias: Option<usize>,
    },
    Pool {
        kind: PoolKind,
        geom: Pool2d,
    },
    /// Over rows of `width` values; γ at `gamma`, β right after it.
    LayerNorm {
        width: usize,
        gamma: usize,
        eps: f32,
    },
    /// Per channel of [channels, spatial] samples; γ at `gamma`, β right after it. The
    /// running statistics are layer state (`Network::aux`), saved in checkpoints.
    BatchNorm {
        channels: usize,
        spatial: usize,
        gamma: usize,
        eps: f32,
        momentum: f32,
    },
    /// The sum of the inputs.
    Add,
    /// The inputs side by side in each sample: input k's `widths[k]` values per sample.
    Concat {
        widths: Vec<usize>,
    },
    /// (log_)softmax over rows of `width` values.
    Softmax {
        width: usize,
        log: bool,
    },
    /// Rows of the table at `weight` ([vocab, dim]) for the token ids in the data.
    Embedding {
        vocab: usize,
        dim: usize,
        weight: usize,
    },
}

impl Op {
    /// The parameters whose gradients the step's first backward pass writes instead of
    /// adding to (`GradWrite`): a linear or conv layer's weight, and its bias if any.
    pub fn written_params(&self) -> Vec<std::ops::Range<usize>> {
        let (weight, len, bias, out) = match *self {
            Op::Linear {
                inp,
                out,
                weight,
                bias,
                ..
            } => (weight, inp * out, bias, out),
            Op::Conv2d { geom, weight, bias } => (weight, geom.weight_len(), bias, geom.o),
            Op::Activation(_)
            | Op::Dropout { .. }
            | Op::View
            | Op::Pool { .. }
            | Op::LayerNorm { .. }
            | Op::BatchNorm { .. }
            | Op::Add
            | Op::Concat { .. }
            | Op::Softmax { .. }
            | Op::Embedding { .. } => return Vec::new(),
        };
        let bias = bias.map(|b| b..b + out);
        std::iter::once(weight..weight + len).chain(bias).collect()
    }

    /// Whether it can write its output over its input (see `buffers`).
    pub fn writes_in_place(&self) -> bool {
        match self {
            Op::Activation(Activation::Relu | Activation::Tanh | Activation::Sigmoid)
            | Op::Dropout { .. }
            | Op::Add => true,
            // GELU's backward reads its input.
            Op::Activation(Activation::Gelu | Activation::GeluTanh)
            | Op::Linear { .. }
            | Op::View
            | Op::Conv2d { .. }
            | Op::Pool { .. }
            | Op::LayerNorm { .. }
            | Op::BatchNorm { .. }
            | Op::Concat { .. }
            | Op::Softmax { .. }
            | Op::Embedding { .. } => false,
        }
    }

    /// Whether its backward step reads its output, which an in-place layer after it would
    /// overwrite.
    pub fn backward_reads_output(&self) -> bool {
        match self {
            Op::Activation(_) | Op::Pool { .. } | Op::Softmax { .. } => true,
            Op::Linear { .. }
            | Op::Dropout { .. }
            | Op::View
            | Op::Conv2d { .. }
            | Op::LayerNorm { .. }
            | Op::BatchNorm { .. }
            | Op::Add
            | Op::Concat { .. }
            | Op::Embedding { .. } => false,
        }
    }

    /// Whether its output is already a half value when its input is one (so rounding it
    /// again would change nothing): views, ReLU, concat, max pooling.
    pub fn forward_keeps_half(&self) -> bool {
        match self {
            Op::View
            | Op::Activation(Activation::Relu)
            | Op::Concat { .. }
            | Op::Pool {
                kind: PoolKind::Max,
                ..
            } => true,
            Op::Activation(Activation::Gelu | Activation::GeluTanh)
            | Op::Activation(Activation::Tanh | Activation::Sigmoid)
            | Op::Pool {
                kind: PoolKind::Avg,
                ..
            }
            | Op::Linear { .. }
            | Op::Dropout { .. }
            | Op::Conv2d { .. }
            | Op::LayerNorm { .. }
            | Op::BatchNorm { .. }
            | Op::Add
            | Op::Softmax { .. }
            | Op::Embedding { .. } => false,
        }
    }

    /// f32 values of the state it saves per layer at `max_batch` (`Network::aux`).
    pub fn aux_len(&self, out_shape: &[usize], max_batch: usize) -> usize {
        match self {
            // Each row's mean and inverse standard deviation.
            Op::LayerNorm { width, .. } => 2 * max_batch * numel(out_shape) / width.max(&1),
            // [running mean | running var | batch mean | batch invstd]
            Op::BatchNorm { channels, .. } => 4 * channels,
            Op::Linear { .. }
            | Op::Activation(_)
            | Op::Dropout { .. }
            | Op::View
            | Op::Conv2d { .. }
            | Op::Pool { .. }
            | Op::Add
            | Op::Concat { .. }
            | Op::Softmax { .. }
            | Op::Embedding { .. } => 0,
        }
    }

    /// The conv scratch it needs, given a backend's rule for one conv layer (values).
    pub fn workspace(&self, per_conv: impl Fn(&Conv2d) -> usize) -> Option<usize> {
        match self {
            Op::Conv2d { geom, .. } => Some(per_conv(geom)),
            Op::Linear { .. }
            | Op::Activation(_)
            | Op::Dropout { .. }
            | Op::View
            | Op::Pool { .. }
            | Op::LayerNorm { .. }
            | Op::BatchNorm { .. }
            | Op::Add
            | Op::Concat { .. }
            | Op::Softmax { .. }
            | Op::Embedding { .. } => None,
        }
    }
}
