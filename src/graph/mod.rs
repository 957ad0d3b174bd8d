//! Spec → static graph: each layer with its input and output shapes (per sample) and its
//! parameters' place in the flat parameter buffer. Everything is known before the first step,
//! so `trainer check` can print it and the executor can plan every buffer once.

mod buckets;
mod buffers;
mod image;
mod network;
mod op;
pub mod wiring;

pub use buckets::GradBuckets;
pub use buffers::{BufferPlan, HalfWidth};
pub use network::{GradientSync, Network};
pub use op::Op;

use crate::error::{layer_error, Error, Result};
use crate::spec::{
    ActivationCheckpointing, ActivationMode, GeluApproximation, JobSpec, LayerSpec, LossKind,
};
use crate::tensor::rng::{derive, Rng};
use crate::tensor::{Activation, Conv2d, LossFn, PoolKind};

#[derive(Debug, Clone)]
pub struct Layer {
    /// "linear", "relu"...: the spec's type name.
    pub kind: &'static str,
    /// The spec's `name`, if any.
    pub name: Option<String>,
    /// The nodes it reads (see `wiring`): node 0 is the data, node i+1 layer i's output.
    pub inputs: Vec<usize>,
    pub op: Op,
    pub in_shape: Vec<usize>,
    pub out_shape: Vec<usize>,
    pub param_count: usize,
}

impl Layer {
    /// Its tensors' prefix in a state_dict: the layer's name, else its index.
    pub fn prefix(&self, index: usize) -> String {
        self.name.clone().unwrap_or_else(|| index.to_string())
    }
}

/// What the loss needs to know, checked against the model's output at build time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Objective {
    pub loss: LossFn,
    /// Values per sample in the targets buffer: 1 (a class index) or the output width.
    pub target_dim: usize,
    /// Whether accuracy is meaningful (classification, or binary targets with bce).
    pub has_accuracy: bool,
}

#[derive(Debug, Clone)]
pub struct Graph {
    pub input_shape: Vec<usize>,
    pub layers: Vec<Layer>,
    /// Values in the flat parameter buffer: every parameter, and the gaps that align each
    /// tensor (`PARAM_ALIGN`).
    pub param_len: usize,
    pub objective: Objective,
    /// Activation checkpointing: the number of segments, or None for none.
    pub checkpoint_segments: Option<usize>,
}

/// What the data provides that the graph is checked against.
#[derive(Debug, Clone, PartialEq)]
pub struct DataShape {
    pub sample_shape: Vec<usize>,
    /// Some(classes) for class labels, None for real-valued targets.
    pub classes: Option<usize>,
    /// Where the number of classes came from when the job does not give it (`Data::classes_from`).
    pub classes_from: Option<String>,
    pub target_dim: usize,
}

impl DataShape {
    /// The shape of loaded data.
    pub fn of(data: &crate::data::Data) -> DataShape {
        DataShape {
            sample_shape: data.sample_shape.clone(),
            classes: data.classes,
            classes_from: data.classes_from.clone(),
            target_dim: data.target_dim,
        }
    }
}

pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// The most values per sample a model's layer outputs may hold together (16 GiB of f32),
/// and a convolution's unrolled input: beyond any model that trains, and small enough that
/// batch × bytes per sample cannot overflow.
pub(crate) const MAX_SAMPLE_VALUES: u128 = 1 << 32;

/// The most parameters a model may have (256 GiB of f32).
const MAX_PARAMS: u128 = 1 << 36;

/// Each layer's parameters, and every weight and bias of a linear, conv or embedding layer,
/// start at a multiple of this many values in the flat buffer: 16 bytes in half precision,
/// 32 in f32. cuBLAS uses its vectorised tensor-core kernels, and cuBLASLt's epilogue takes
/// a bias, only at 16-byte aligned addresses; PyTorch's tensors, each an allocation of its
/// own, always are. (A norm layer's β follows its γ directly: its kernels find both from one
/// offset, and read them one value at a time.) The gaps hold zeros that no layer reads;
/// the step's first backward pass zeroes their gradient, so no optimizer moves them.
pub const PARAM_ALIGN: usize = 8;

/// Reserves `len` values of the flat parameter buffer at its next aligned offset.
fn reserve(offset: &mut usize, len: usize) -> usize {
    let at = offset.next_multiple_of(PARAM_ALIGN);
    *offset = at + len;
    at
}

/// A shape's number of values, without overflow for shapes no job may have.
fn values(shape: &[usize]) -> u128 {
    shape
        .iter()
        .fold(1, |n: u128, &d| n.saturating_mul(d as u128))
}

fn shape_str(shape: &[usize]) -> String {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("[{}]", dims.join(", "))
}

impl Graph {
    /// Builds the graph for a job and its data, inferring every shape; errors name the layer.
    pub fn build(spec: &JobSpec, data: &DataShape) -> Result<Graph> {
        let input_shape = match &spec.model.input_shape {
            Some(shape) if values(shape) != values(&data.sample_shape) => {
                return Err(Error::AtKey {
                    key: "model.input_shape".into(),
                    message: format!(
                        "model.input_shape {} has {} values per sample but the data has {} ({})",
                        shape_str(shape),
                        values(shape),
                        numel(&data.sample_shape),
                        shape_str(&data.sample_shape)
                    ),
                })
            }
            Some(shape) => shape.clone(),
            None => data.sample_shape.clone(),
        };
        let wiring = wiring::resolve(&spec.model.layers)?;
        let mut node_shapes = vec![input_shape.clone()];
        // Per node: the data itself, or a view of it.
        let mut reads_data = vec![true];
        let mut layers = Vec::new();
        let mut offset = 0;
        let mut sample_values = values(&input_shape);
        for ((i, entry), inputs) in spec.model.layers.iter().enumerate().zip(wiring) {
            let in_shapes: Vec<&[usize]> = inputs.iter().map(|&n| &node_shapes[n][..]).collect();
            let in_shape = in_shapes[0].to_vec();
            let kind = entry.layer.kind();
            let (op, out_shape) = match &entry.layer {
                LayerSpec::Linear(l) => {
                    let (&inp, leading) = in_shape.split_last().expect("a shape has an axis");
                    if let Some(given) = l.in_features {
                        if given != inp {
                            return Err(layer_error(
                                i,
                                "linear",
                                format!(
                                    "in = {given} given, but the previous \
                                 layer outputs {inp} features"
                                ),
                            ));
                        }
                    }
                    let weight = reserve(&mut offset, inp * l.out);
                    let bias = l.bias.then(|| reserve(&mut offset, l.out));
                    let mut out_shape = leading.to_vec();
                    out_shape.push(l.out);
                    (
                        Op::Linear {
                            inp,
                            out: l.out,
                            rows: numel(leading),
                            weight,
                            bias,
                        },
                        out_shape,
                    )
                }
                LayerSpec::Relu(_) => (Op::Activation(Activation::Relu), in_shape.clone()),
                LayerSpec::Gelu(g) => {
                    let f = match g.approximate {
                        GeluApproximation::None => Activation::Gelu,
                        GeluApproximation::Tanh => Activation::GeluTanh,
                    };
                    (Op::Activation(f), in_shape.clone())
                }
                LayerSpec::Tanh(_) => (Op::Activation(Activation::Tanh), in_shape.clone()),
                LayerSpec::Sigmoid(_) => (Op::Activation(Activation::Sigmoid), in_shape.clone()),
                LayerSpec::Dropout(d) => (Op::Dropout { p: d.p as f32 }, in_shape.clone()),
                LayerSpec::Flatten(_) => (Op::View, vec![numel(&in_shape)]),
                LayerSpec::Reshape(r) => image::reshape(i, r, &in_shape)?,
                LayerSpec::Conv2d(c) => image::conv2d(i, c, &in_shape, &mut offset)?,
                LayerSpec::Maxpool2d(p) => image::pool(i, PoolKind::Max, p, &in_shape)?,
                LayerSpec::Avgpool2d(p) => image::pool(i, PoolKind::Avg, p, &in_shape)?,
                LayerSpec::GlobalAvgPool(_) => image::global_avg_pool(i, &in_shape)?,
                LayerSpec::Layernorm(l) => image::layernorm(l, &in_shape, &mut offset),
                LayerSpec::Batchnorm1d(b) => image::batchnorm(i, false, b, &in_shape, &mut offset)?,
                LayerSpec::Batchnorm2d(b) => image::batchnorm(i, true, b, &in_shape, &mut offset)?,
                LayerSpec::Add(_) => {
                    if let Some(other) = in_shapes.iter().find(|s| **s != in_shape) {
                        return Err(layer_error(
                            i,
                            "add",
                            format!(
                                "its inputs must have the same shape, but \
                             they are {} and {}",
                                shape_str(&in_shape),
                                shape_str(other)
                            ),
                        ));
                    }
                    (Op::Add, in_shape.clone())
                }
                LayerSpec::Concat(_) => image::concat(i, &in_shapes)?,
                LayerSpec::Embedding(e) => {
                    // Token ids come from the data (through flatten/reshape at most).
                    if !reads_data[inputs[0]] {
                        return Err(layer_error(
                            i,
                            "embedding",
                            "it reads token ids, which only the data holds; make it read \
                             \"input\" (the first layer, or inputs = [\"input\"])",
                        ));
                    }
                    let weight = reserve(&mut offset, e.num_embeddings * e.embedding_dim);
                    let mut out = in_shape.clone();
                    out.push(e.embedding_dim);
                    let (vocab, dim) = (e.num_embeddings, e.embedding_dim);
                    (Op::Embedding { vocab, dim, weight }, out)
                }
                LayerSpec::Softmax(_) | LayerSpec::LogSoftmax(_) => {
                    let width = *in_shape.last().unwrap_or(&1);
                    let log = matches!(entry.layer, LayerSpec::LogSoftmax(_));
                    (Op::Softmax { width, log }, in_shape.clone())
                }
            };
            let param_count = match &op {
                Op::Linear { inp, out, bias, .. } => {
                    inp * out + if bias.is_some() { *out } else { 0 }
                }
                Op::Conv2d { geom, bias, .. } => {
                    geom.weight_len() + if bias.is_some() { geom.o } else { 0 }
                }
                Op::LayerNorm { width, .. } => 2 * width,
                Op::BatchNorm { channels, .. } => 2 * channels,
                Op::Embedding { vocab, dim, .. } => vocab * dim,
                _ => 0,
            };
            sample_values += values(&out_shape);
            let too_large = |what: String| Err(layer_error(i, kind, what));
            if sample_values > MAX_SAMPLE_VALUES {
                return too_large(format!(
                    "the layers up to this one output {sample_values} values per sample (this \
                     one {}); at most {MAX_SAMPLE_VALUES} are allowed",
                    shape_str(&out_shape)
                ));
            }
            if offset as u128 > MAX_PARAMS {
                return too_large(format!(
                    "the layers up to this one have {offset} parameters; at most {MAX_PARAMS} \
                     are allowed"
                ));
            }
            node_shapes.push(out_shape.clone());
            reads_data.push(op == Op::View && reads_data[inputs[0]]);
            layers.push(Layer {
                kind,
                name: entry.name.clone(),
                inputs,
                op,
                in_shape,
                out_shape,
                param_count,
            });
        }
        if offset == 0 {
            return Err(Error::AtKey {
                key: "model.layers".into(),
                message: "model.layers: the model has no parameters to train; add a linear layer"
                    .into(),
            });
        }
        let output_shape = node_shapes.last().expect("the input node");
        let objective = objective(spec, data, output_shape, layers.len())?;
        let checkpoint_segments = match &spec.checkpoint.activations {
            None | Some(ActivationCheckpointing::Mode(ActivationMode::None)) => None,
            Some(ActivationCheckpointing::Mode(ActivationMode::All)) => {
                Some(BufferPlan::best_segments(&input_shape, &layers))
            }
            Some(ActivationCheckpointing::Segments(s)) => Some(s.segments),
        };
        Ok(Graph {
            input_shape,
            layers,
            param_len: offset,
            objective,
            checkpoint_segments,
        })
    }

    /// Whether mixed precision rounds the data to the half format: not token ids (whole
    /// numbers, which fp16 would move above 2048).
    pub fn rounds_input(&self) -> bool {
        self.embeddings().is_empty()
    }

    /// Where the activations live, with this graph's activation checkpointing.
    pub fn buffer_plan(&self) -> BufferPlan {
        self.buffer_plan_for(false)
    }

    /// The buffer plan in fp32, or in mixed precision (`BufferPlan::mixed`).
    pub fn buffer_plan_for(&self, mixed: bool) -> BufferPlan {
        self.plan_with(self.checkpoint_segments, mixed)
    }

    /// The buffer plan with `segments` of activation checkpointing (None: off).
    fn plan_with(&self, segments: Option<usize>, mixed: bool) -> BufferPlan {
        let shape = &self.input_shape;
        match mixed {
            true => BufferPlan::mixed(shape, &self.layers, segments, self.rounds_input()),
            false => BufferPlan::new(shape, &self.layers, segments),
        }
    }

    /// Bytes per sample of (the input batch, the activations, their gradients) with
    /// `segments` of activation checkpointing (None: off), stored as `storage` says.
    pub fn activation_bytes(
        &self,
        segments: Option<usize>,
        storage: ActivationStorage,
    ) -> (usize, usize, usize) {
        let plan = self.plan_with(segments, storage != ActivationStorage::F32);
        let half_width = plan.half_width.as_ref();
        plan.bytes_per_sample(half_width.filter(|_| storage == ActivationStorage::HalfWidth))
    }

    /// The largest conv2d scratch, given a backend's rule for one layer (values, not bytes).
    pub fn conv_workspace(&self, per_layer: impl Fn(&Conv2d) -> usize) -> usize {
        let conv = |l: &Layer| l.op.workspace(&per_layer);
        self.layers.iter().filter_map(conv).max().unwrap_or(0)
    }

    /// Mixed precision where the data holds token ids, which stay f32 (`rounds_input`):
    /// the values per sample of the data's rounded copy, which the linear and conv layers
    /// reading the data compute with, as autocast casts their input. 0 where no such layer
    /// reads it, or the data is rounded itself.
    pub fn rounded_data_len(&self) -> usize {
        let plan = self.buffer_plan_for(true);
        let reads_data = |l: &Layer| {
            matches!(l.op, Op::Linear { .. } | Op::Conv2d { .. }) && plan.slot[l.inputs[0]] == 0
        };
        if self.rounds_input() || !self.layers.iter().any(reads_data) {
            0
        } else {
            numel(&self.input_shape)
        }
    }

    /// PyTorch state_dict names of every parameter tensor: the layer's prefix (its `name`,
    /// else its index in model.layers, as nn.Sequential numbers them), then `.weight`
    /// ([out, in] for linear) or `.bias`.
    pub fn state_dict_entries(&self) -> Vec<StateDictEntry> {
        self.parameter_tensors()
            .into_iter()
            .map(|t| StateDictEntry {
                name: format!("{}.{}", self.layers[t.layer].prefix(t.layer), t.name),
                shape: t.shape,
                offset: t.offset,
            })
            .collect()
    }

    /// Per layer, where its parameters lie in the flat buffer (None for a layer without).
    pub fn parameter_spans(&self) -> Vec<Option<std::ops::Range<usize>>> {
        let mut spans: Vec<Option<std::ops::Range<usize>>> = vec![None; self.layers.len()];
        for t in self.parameter_tensors() {
            let tensor = t.offset..t.offset + numel(&t.shape);
            let span = &mut spans[t.layer];
            *span = Some(match span.take() {
                Some(s) => s.start.min(tensor.start)..s.end.max(tensor.end),
                None => tensor,
            });
        }
        spans
    }

    /// Every parameter tensor: its layer, PyTorch name and shape, place in the flat buffer,
    /// and PyTorch's default initialisation.
    fn parameter_tensors(&self) -> Vec<ParameterTensor> {
        let mut tensors = Vec::new();
        for (layer, l) in self.layers.iter().enumerate() {
            let mut push = |name, shape: Vec<usize>, offset, init| {
                tensors.push(ParameterTensor {
                    layer,
                    name,
                    shape,
                    offset,
                    init,
                });
            };
            match l.op {
                Op::Linear {
                    inp,
                    out,
                    weight,
                    bias,
                    ..
                } => {
                    // kaiming_uniform(a = √5) gives ±1/√fan_in; the bias uses the same bound.
                    let bound = 1.0 / (inp as f64).sqrt();
                    push("weight", vec![out, inp], weight, Init::Uniform(bound));
                    if let Some(b) = bias {
                        push("bias", vec![out], b, Init::Uniform(bound));
                    }
                }
                Op::Conv2d {
                    geom: g,
                    weight,
                    bias,
                } => {
                    let fan_in = g.c / g.groups * g.kh * g.kw;
                    let bound = 1.0 / (fan_in as f64).sqrt();
                    push(
                        "weight",
                        vec![g.o, g.c / g.groups, g.kh, g.kw],
                        weight,
                        Init::Uniform(bound),
                    );
                    if let Some(b) = bias {
                        push("bias", vec![g.o], b, Init::Uniform(bound));
                    }
                }
                Op::LayerNorm { width, gamma, .. }
                | Op::BatchNorm {
                    channels: width,
                    gamma,
                    ..
                } => {
                    push("weight", vec![width], gamma, Init::Constant(1.0));
                    push("bias", vec![width], gamma + width, Init::Constant(0.0));
                }
                Op::Activation(_)
                | Op::Dropout { .. }
                | Op::View
                | Op::Pool { .. }
                | Op::Add
                | Op::Concat { .. }
                | Op::Softmax { .. } => {}
                Op::Embedding { vocab, dim, weight } => {
                    push("weight", vec![vocab, dim], weight, Init::Normal(1.0));
                }
            }
        }
        tensors
    }

    /// Batch-norm running statistics under their PyTorch names (`<prefix>.running_mean`,
    /// `<prefix>.running_var`), with offsets into `Network::running_stats`.
    pub fn running_stat_entries(&self) -> Vec<StateDictEntry> {
        let mut entries = Vec::new();
        let mut offset = 0;
        for (i, l) in self.layers.iter().enumerate() {
            if let Op::BatchNorm { channels: c, .. } = l.op {
                for name in ["running_mean", "running_var"] {
                    entries.push(StateDictEntry {
                        name: format!("{}.{name}", l.prefix(i)),
                        shape: vec![c],
                        offset,
                    });
                    offset += c;
                }
            }
        }
        entries
    }

    /// Values of `Network::running_stats`.
    pub fn running_stats_len(&self) -> usize {
        self.running_stat_entries().iter().map(|e| e.len()).sum()
    }

    /// The prefixes of batch-norm layers (for their `num_batches_tracked`).
    pub fn batchnorm_prefixes(&self) -> Vec<String> {
        let bn =
            |(i, l): (usize, &Layer)| matches!(l.op, Op::BatchNorm { .. }).then(|| l.prefix(i));
        self.layers.iter().enumerate().filter_map(bn).collect()
    }

    /// Each embedding layer: its index and vocabulary size (the data's ids are checked
    /// against it before training).
    pub fn embeddings(&self) -> Vec<(usize, usize)> {
        let table = |(i, l): (usize, &Layer)| match l.op {
            Op::Embedding { vocab, .. } => Some((i, vocab)),
            _ => None,
        };
        self.layers.iter().enumerate().filter_map(table).collect()
    }

    pub fn output_shape(&self) -> &[usize] {
        self.layers
            .last()
            .map_or(&self.input_shape, |l| &l.out_shape)
    }

    /// The model's number of parameters (`param_len` less the alignment gaps).
    pub fn parameter_count(&self) -> usize {
        self.layers.iter().map(|l| l.param_count).sum()
    }

    /// A flat buffer written before parameters were aligned (`PARAM_ALIGN`: checkpoints of
    /// earlier versions, whose tensors lie back to back in the same order) in this layout;
    /// None if `packed` is not of that length.
    pub fn from_packed_layout(&self, packed: &[f32]) -> Option<Vec<f32>> {
        if packed.len() != self.parameter_count() {
            return None;
        }
        let mut aligned = vec![0.0; self.param_len];
        let mut from = 0;
        for t in self.parameter_tensors() {
            let len = numel(&t.shape);
            aligned[t.offset..t.offset + len].copy_from_slice(&packed[from..from + len]);
            from += len;
        }
        Some(aligned)
    }

    /// PyTorch's default initialisation for every parameter, from the job's seed (a stream
    /// per layer, so adding a layer does not change the others' initial values).
    pub fn init_params(&self, seed: u64) -> Vec<f32> {
        let mut params = vec![0.0f32; self.param_len];
        let mut rngs: Vec<Option<Rng>> = vec![None; self.layers.len()];
        for t in self.parameter_tensors() {
            let values = &mut params[t.offset..t.offset + numel(&t.shape)];
            match t.init {
                Init::Uniform(bound) => {
                    let rng = rngs[t.layer]
                        .get_or_insert_with(|| Rng::new(derive(seed, 1000 + t.layer as u64)));
                    values
                        .iter_mut()
                        .for_each(|v| *v = rng.uniform(-bound, bound) as f32);
                }
                Init::Normal(std) => {
                    let rng = rngs[t.layer]
                        .get_or_insert_with(|| Rng::new(derive(seed, 1000 + t.layer as u64)));
                    values
                        .iter_mut()
                        .for_each(|v| *v = (rng.normal() * std) as f32);
                }
                Init::Constant(c) => values.fill(c),
            }
        }
        params
    }
}

/// How PyTorch initialises a parameter tensor by default.
#[derive(Debug, Clone, Copy)]
enum Init {
    /// Uniform in ±bound.
    Uniform(f64),
    /// Normal with mean 0 and this standard deviation.
    Normal(f64),
    Constant(f32),
}

#[derive(Debug, Clone)]
struct ParameterTensor {
    layer: usize,
    name: &'static str,
    shape: Vec<usize>,
    offset: usize,
    init: Init,
}

fn objective(
    spec: &JobSpec,
    data: &DataShape,
    out_shape: &[usize],
    layers: usize,
) -> Result<Objective> {
    let width = numel(out_shape);
    let last_key = format!("model.layers[{}]", layers.saturating_sub(1));
    let values = match width {
        1 => "1 value".to_string(),
        n => format!("{n} values"),
    };
    // How the class count was found, when the job does not give it, and how to give it.
    let classes_from = data
        .classes_from
        .as_ref()
        .map_or(String::new(), |from| format!("; {from}"));
    let mismatch = |what: String| {
        // A linear layer applies over the last axis: flattening first gives one row a sample.
        let flatten = match out_shape.len() {
            1 => "",
            _ => "; add { type = \"flatten\" } before the last linear layer",
        };
        Err(Error::AtKey {
            message: format!(
                "{last_key} (the last layer) outputs {} ({values} per sample) but {what}{flatten}",
                shape_str(out_shape)
            ),
            key: last_key.clone(),
        })
    };
    match spec.loss.kind {
        LossKind::CrossEntropy => {
            let Some(classes) = data.classes else {
                return Err(Error::AtKey {
                    key: "loss.type".into(),
                    message: "loss.type = \"cross_entropy\" needs class labels, but the data has \
                              real-valued targets (data.task = \"regression\"); use loss.type = \"mse\""
                        .into(),
                });
            };
            if out_shape.len() != 1 || width != classes {
                // More outputs than labels found: classes without samples, which data.classes
                // can name; fewer: the model is too narrow for the labels there are.
                let hint = match data.classes_from {
                    Some(_) if out_shape.len() == 1 && width > classes => {
                        format!("; set data.classes = {width} if some classes have no samples")
                    }
                    _ => String::new(),
                };
                return mismatch(format!(
                    "cross_entropy needs one logit per class ({classes} classes{classes_from}{hint})"
                ));
            }
            let label_smoothing = spec.loss.label_smoothing as f32;
            Ok(Objective {
                loss: LossFn::CrossEntropy { label_smoothing },
                target_dim: 1,
                has_accuracy: true,
            })
        }
        LossKind::Mse | LossKind::BceWithLogits => {
            let is_bce = spec.loss.kind == LossKind::BceWithLogits;
            // Class labels with mse/bce are read as one-hot targets only for two classes
            // with a single output: the label itself is the target.
            let target_dim = match data.classes {
                Some(2) if width == 1 => 1,
                Some(c) => {
                    return mismatch(format!(
                        "the data has {c} classes{classes_from}; {} needs real-valued targets \
                         (data.task = \"regression\") or two classes and one output",
                        if is_bce { "bce_with_logits" } else { "mse" }
                    ))
                }
                None => data.target_dim,
            };
            if width != target_dim {
                return mismatch(format!("the data has {target_dim} targets per sample"));
            }
            let loss = if is_bce {
                LossFn::BceWithLogits
            } else {
                LossFn::Mse
            };
            Ok(Objective {
                loss,
                target_dim,
                has_accuracy: is_bce,
            })
        }
    }
}

/// One parameter tensor under its PyTorch name, and where it lies in the flat buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct StateDictEntry {
    pub name: String,
    pub shape: Vec<usize>,
    pub offset: usize,
}

impl StateDictEntry {
    pub fn len(&self) -> usize {
        numel(&self.shape)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// How a backend stores activations and their gradients: what `MemoryPlan` counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActivationStorage {
    F32,
    /// Mixed precision's half values in f32 buffers (the CPU backend).
    HalfValues,
    /// Mixed precision in half-width buffers where every op touching them can take them
    /// (`BufferPlan::mixed`; CUDA, through `Backend::alloc_half`).
    HalfWidth,
}

/// Bytes the run needs, by kind, for `trainer check` and the run log.
#[derive(Debug, Clone, Default)]
pub struct MemoryPlan {
    pub params: usize,
    pub grads: usize,
    pub optimizer_state: usize,
    pub activations: usize,
    pub activation_grads: usize,
    pub batch: usize,
    /// The data set, when it is held in device memory (GPU).
    pub data: usize,
    /// Scratch: the conv2d workspace (im2col), and on a GPU the backend's own (cuBLAS's
    /// workspace, the loss and gradient-norm statistics, row indices: `cuda::own_bytes`).
    pub workspace: usize,
    /// What layers keep from forward for backward besides activations (layer-norm statistics).
    pub layer_state: usize,
    /// Activations without activation checkpointing; equal to `activations` when it is off.
    pub activations_without_checkpointing: usize,
    /// Layers whose forward pass backward recomputes (0 without checkpointing).
    pub recomputed_layers: usize,
    /// Mixed precision: the half-rounded copy of the parameters (0 in fp32).
    pub half_params: usize,
}

impl MemoryPlan {
    /// `device_data` is the data set when a GPU holds it (0 on the CPU, where it is ordinary
    /// host memory); `workspace` the scratch bytes of the backend (see `conv_workspace`);
    /// `storage`: how the backend stores activations.
    pub fn new(
        graph: &Graph,
        batch_size: usize,
        optimizer_buffers: usize,
        device_data: usize,
        workspace: usize,
        storage: ActivationStorage,
    ) -> Self {
        let f = std::mem::size_of::<f32>();
        let plan = graph.buffer_plan();
        let (input, activations, activation_grads) =
            graph.activation_bytes(graph.checkpoint_segments, storage);
        MemoryPlan {
            params: graph.param_len * f,
            grads: graph.param_len * f,
            // With the step's values the update reads (learning rate, bias corrections).
            optimizer_state: (graph.param_len * optimizer_buffers + crate::optim::STEP_ARGS) * f,
            activations: batch_size * activations,
            activation_grads: batch_size * activation_grads,
            batch: batch_size * (input + graph.objective.target_dim * f),
            data: device_data,
            workspace,
            layer_state: graph
                .layers
                .iter()
                .map(|l| l.op.aux_len(&l.out_shape, batch_size) * f)
                .sum(),
            activations_without_checkpointing: batch_size * graph.activation_bytes(None, storage).1,
            recomputed_layers: plan.recomputed_layers(),
            half_params: 0,
        }
    }

    pub fn total(&self) -> usize {
        [
            self.params,
            self.half_params,
            self.grads,
            self.optimizer_state,
            self.activations,
            self.activation_grads,
            self.batch,
            self.layer_state,
            self.data,
            self.workspace,
        ]
        .into_iter()
        .fold(0, usize::saturating_add)
    }
}
