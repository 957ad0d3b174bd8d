//! What the graph, the buffer plan and the executor ask of an op. No method has a default:
//! a new op answers every question, and the compiler names any it leaves out.

use super::{reserve, Backward, Dx, Forward};
use crate::error::{layer_error, Error};
use crate::tensor::{Activation, Attention, Backend, Conv2d};
use std::ops::Range;

/// The questions about an op that do not depend on the backend.
pub trait OpKind: std::fmt::Debug {
    /// The yes/no answers, as one struct literal: every field must be given.
    fn properties(&self) -> Properties;

    /// Its parameter tensors: PyTorch names, shapes, places in the flat buffer and
    /// PyTorch's default initialisation.
    fn parameters(&self) -> Vec<ParamTensor>;

    /// The parameters whose gradients the step's first backward pass writes instead of
    /// adding to (`GradWrite`): a product's weight and bias. The others are zeroed first.
    fn written_params(&self) -> Vec<Range<usize>>;

    /// f32 values of the state it keeps per layer at `max_batch` (`Network`'s state
    /// buffers): what backward needs besides activations, and running statistics.
    fn state_len(&self, out_shape: &[usize], max_batch: usize) -> usize;

    /// State that is not a parameter but is saved with them (batch norm's running
    /// statistics).
    fn saved_state(&self) -> Option<SavedState>;

    /// The scratch it needs, by its backend's `rules` (values).
    fn workspace(&self, rules: &Scratch) -> Option<usize>;

    /// Its floating-point operations on one sample, for profiles: a multiply-add is two.
    fn flops(&self, in_shape: &[usize], out_shape: &[usize]) -> Flops;
}

/// An op's floating-point operations on one sample, forward and backward.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Flops {
    pub forward: f64,
    pub backward: f64,
}

impl Flops {
    /// `forward` and `backward` operations for each value of `shape`: an elementwise op.
    pub fn per_value(shape: &[usize], forward: f64, backward: f64) -> Flops {
        let n = super::numel(shape) as f64;
        Flops {
            forward: forward * n,
            backward: backward * n,
        }
    }

    /// A matrix product of `macs` multiply-adds: backward is two more (dx and dw).
    pub fn product(macs: usize) -> Flops {
        Flops {
            forward: 2.0 * macs as f64,
            backward: 4.0 * macs as f64,
        }
    }
}

/// A backend's rules for the scratch of the ops that need some (`OpKind::workspace`), in
/// values for the largest batch. The layers share one workspace, as long as the largest.
pub struct Scratch<'a> {
    pub conv: &'a dyn Fn(&Conv2d) -> usize,
    pub attention: &'a dyn Fn(&Attention) -> usize,
}

/// What the buffer plan, the executor and other programs' weight files need to know of an op.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Properties {
    /// It can write its output over its input (see `BufferPlan`).
    pub writes_in_place: bool,
    /// Its backward step reads its input.
    pub backward_reads_input: bool,
    /// Its backward step reads its output, which an in-place layer after it would
    /// overwrite.
    pub backward_reads_output: bool,
    /// Its output is already a half value when its input is one (so rounding it again
    /// would change nothing).
    pub forward_keeps_half: bool,
    /// Its output is its input seen with another shape (flatten, reshape): it shares the
    /// input's buffers, gradient included, and runs nothing.
    pub is_view: bool,
    /// The elementwise activation it is: running in place, it may round its neighbours'
    /// values in its own pass (`Fusion`).
    pub activation: Option<Activation>,
    /// It can apply a ReLU after it in its own product (cuBLASLt's epilogue).
    pub applies_relu_after: bool,
    /// Its backward takes the gradient through a ReLU before it, so that the ReLU's own
    /// backward step does nothing (pooling).
    pub takes_gradient_through_relu: bool,
    /// It multiplies its input in a matrix product, which mixed precision feeds a half
    /// copy of the data (as autocast casts a product's input).
    pub multiplies_input: bool,
    /// Its input gradient is rounded in the generic pass after its backward, which an
    /// in-place activation before it can take over. Views, add and concat round their own;
    /// an activation's own rounding may be fused already.
    pub rounds_dx_after: bool,
    /// The vocabulary of the token ids it reads from the data (embedding).
    pub token_vocab: Option<usize>,
    /// It draws a random mask every step (dropout), which a recorded CUDA graph would
    /// replay unchanged.
    pub draws_masks: bool,
    /// It normalises with batch statistics over one value per channel, which a batch of
    /// one sample cannot train (variance 0; PyTorch refuses it).
    pub one_value_per_channel: bool,
    /// It can read a sequence one position a step (`Graph::for_decoding`): its output at a
    /// position depends on its inputs at that position, or, as causal attention's, at the
    /// positions up to it.
    pub one_position_at_a_time: bool,
    /// Its shape (attention): heads are what a GPT-2 config.json calls n_head.
    pub attention: Option<crate::tensor::Attention>,
    /// The epsilon it normalises with (layer norm): GPT-2's layer_norm_epsilon.
    pub layer_norm_eps: Option<f32>,
    /// The epsilon it normalises with (RMSNorm): a Llama config.json's rms_norm_eps.
    pub rms_norm_eps: Option<f32>,
    /// The turn it gives queries and keys (rotary): a Llama config.json's rope_theta.
    pub rotary: Option<super::rotary::Rotation>,
}

/// An op's forward and backward passes on backend `B`.
pub trait Compute<B: Backend> {
    /// Writes the output of the first `f.n` samples.
    fn forward(&self, f: &mut Forward<'_, B>);

    /// Adds the parameter gradients (or writes them, `f.dw`) and computes the input
    /// gradient where one is needed. `Dx::Written` leaves the input gradient's rounding
    /// and accumulation to the executor.
    fn backward(&self, b: &mut Backward<'_, B>) -> Dx;
}

/// A parameter tensor of an op.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamTensor {
    /// Its PyTorch name after the layer's prefix: "weight", "bias".
    pub name: &'static str,
    pub shape: Vec<usize>,
    pub offset: usize,
    pub init: Init,
}

/// PyTorch's default initialisation of a parameter tensor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Uniform in ±bound.
    Uniform(f64),
    /// Normal with mean 0 and this standard deviation.
    Normal(f64),
    Constant(f32),
}

/// State an op keeps across steps and saves with the parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct SavedState {
    /// Its tensors' PyTorch names after the layer's prefix, each `len` values, at the start
    /// of the layer's state buffer.
    pub names: &'static [&'static str],
    pub len: usize,
    /// The whole state buffer's first values.
    pub initial: Vec<f32>,
    /// Whether PyTorch's module also counts its batches (`num_batches_tracked`).
    pub counts_batches: bool,
}

/// Where an op is built: its layer's place, its inputs' shapes, and the flat parameter
/// buffer so far.
pub struct Build<'a> {
    /// Its key in the job (`ModelSpec::layer_key`), which errors name.
    pub key: &'a str,
    /// The per-sample shape of each input.
    pub in_shapes: &'a [&'a [usize]],
    /// Whether its first input is the data itself, or a view of it.
    pub reads_data: bool,
    /// The flat parameter buffer's length so far.
    pub offset: &'a mut usize,
    /// The earlier layers that have a name, with their ops (weight tying).
    pub named: &'a [(&'a str, &'a super::Op)],
    /// The op of the layer its first input comes from; None for the data.
    pub input_op: Option<&'a super::Op>,
    /// A model that reads one position a step, keeping each attention layer's keys and
    /// values for this many positions (`trainer sample`); None when training.
    pub decoding: Option<usize>,
    /// `device.flash_attention`: attention keeps log-sum-exps, not probabilities.
    pub flash_attention: bool,
}

impl Build<'_> {
    /// The first input's shape.
    pub fn in_shape(&self) -> &[usize] {
        self.in_shapes[0]
    }

    /// Reserves `len` parameters at the buffer's next aligned offset.
    pub fn reserve(&mut self, len: usize) -> usize {
        reserve(self.offset, len)
    }

    /// The op of the earlier layer called `name`, if any.
    pub fn layer_named(&self, name: &str) -> Option<&super::Op> {
        self.named
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, op)| *op)
    }

    /// An error naming this layer and its kind.
    pub fn error(&self, kind: &str, message: impl std::fmt::Display) -> Error {
        layer_error(self.key, kind, message)
    }
}
