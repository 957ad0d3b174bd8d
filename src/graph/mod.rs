//! Spec → static graph: each layer with its input and output shapes (per sample) and its
//! parameters' place in the flat parameter buffer. Everything is known before the first step,
//! so `trainer check` can print it and the executor can plan every buffer once.

mod buckets;
mod buffers;
mod network;
pub mod profiler;
pub mod wiring;

pub use crate::ops::{numel, Op, PARAM_ALIGN};
pub use buckets::GradBuckets;
pub use buffers::BufferPlan;
pub use network::{GradientSync, Network};

use crate::error::{layer_error, Error, Result};
use crate::ops::{shape_str, values, Build, Init, Scratch, MAX_SAMPLE_VALUES};
use crate::spec::{
    ActivationCheckpointing, ActivationMode, InitScheme, JobSpec, LossKind, StateDictNames,
};
use crate::tensor::rng::{derive, Rng};
use crate::tensor::LossFn;

#[derive(Debug, Clone)]
pub struct Layer {
    /// "linear", "relu"...: the spec's type name.
    pub kind: &'static str,
    /// The spec's `name`, if any.
    pub name: Option<String>,
    /// Where the job writes it (`ModelSpec::layer_key`): errors name it.
    pub key: String,
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

    /// Whether it is a view of its input (`Properties::is_view`).
    pub fn is_view(&self) -> bool {
        self.op.properties().is_view
    }
}

/// What the loss needs to know, checked against the model's output at build time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Objective {
    pub loss: LossFn,
    /// Values per sample in the targets buffer: 1 (a class index), a class index per
    /// position (sequences), or the output width.
    pub target_dim: usize,
    /// Rows of the output per sample that the loss scores each on its own: the positions of
    /// a sequence of class labels (a language model's next tokens), 1 otherwise. The loss
    /// is the mean over the batch's rows.
    pub rows: usize,
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
    /// How `init_params` starts the parameters.
    pub init: InitScheme,
    /// How model.safetensors names the tensors.
    pub names: StateDictNames,
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

/// The most parameters a model may have (256 GiB of f32).
const MAX_PARAMS: u128 = 1 << 36;

impl Graph {
    /// Builds the graph for a job and its data, inferring every shape; errors name the layer.
    pub fn build(spec: &JobSpec, data: &DataShape) -> Result<Graph> {
        Self::build_with(spec, data, None)
    }

    /// The graph of a language model that reads one token a step, each attention layer
    /// keeping the keys and values of up to `positions` earlier ones (a key/value cache).
    /// `data` holds one token per sample. The parameters are laid out as in `build`'s.
    pub fn for_decoding(spec: &JobSpec, data: &DataShape, positions: usize) -> Result<Graph> {
        Self::build_with(spec, data, Some(positions))
    }

    fn build_with(spec: &JobSpec, data: &DataShape, decoding: Option<usize>) -> Result<Graph> {
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
        let wiring = wiring::resolve(&spec.model)?;
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
            let named: Vec<(&str, &Op)> = (layers.iter())
                .filter_map(|l: &Layer| Some((l.name.as_deref()?, &l.op)))
                .collect();
            let offset_before = offset;
            let key = spec.model.layer_key(i);
            let mut at = Build {
                key: &key,
                in_shapes: &in_shapes,
                reads_data: reads_data[inputs[0]],
                offset: &mut offset,
                named: &named,
                input_op: inputs[0].checked_sub(1).map(|l| &layers[l].op),
                decoding,
                flash_attention: spec.device.flash_attention,
            };
            let (op, out_shape) = entry.layer.build(&mut at)?;
            if decoding.is_some() && !op.properties().one_position_at_a_time {
                let why = "it reads the whole sequence at once; a model that reads one token a \
                           step (a key/value cache) needs layers that read one position at a time";
                return Err(layer_error(&key, kind, why));
            }
            // Only the tensors it holds itself: a tied weight is its earlier layer's.
            let own = |t: &&crate::ops::ParamTensor| t.offset >= offset_before;
            let param_count = op
                .parameters()
                .iter()
                .filter(own)
                .map(|t| numel(&t.shape))
                .sum();
            sample_values += values(&out_shape);
            let too_large = |what: String| Err(layer_error(&key, kind, what));
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
            reads_data.push(op.properties().is_view && reads_data[inputs[0]]);
            layers.push(Layer {
                kind,
                name: entry.name.clone(),
                key,
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
        let last = layers.last().expect("a layer with parameters");
        let objective = objective(spec, data, output_shape, &last.key)?;
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
            init: spec.model.init,
            names: spec.model.state_dict_names,
        })
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
        let (shape, layers) = (&self.input_shape, &self.layers);
        let classifier = matches!(self.objective.loss, LossFn::CrossEntropy { .. });
        match mixed {
            true => BufferPlan::mixed(shape, layers, segments, classifier),
            false => BufferPlan::new(shape, layers, segments, classifier),
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
        plan.bytes_per_sample(storage == ActivationStorage::HalfWidth)
    }

    /// The largest scratch of any layer, by a backend's `rules` (values, not bytes).
    pub fn workspace(&self, rules: &Scratch) -> usize {
        let scratch = |l: &Layer| l.op.workspace(rules);
        self.layers.iter().filter_map(scratch).max().unwrap_or(0)
    }

    /// Layer `index`'s prefix in model.safetensors: its name or index, as `names` spells it.
    pub fn state_dict_prefix(&self, index: usize) -> String {
        self.names.prefix(&self.layers[index].prefix(index))
    }

    /// PyTorch state_dict names of every parameter tensor: the layer's prefix (its `name`,
    /// else its index in model.layers, as nn.Sequential numbers them), then `.weight`
    /// ([out, in] for linear) or `.bias`.
    pub fn state_dict_entries(&self) -> Vec<StateDictEntry> {
        self.parameter_tensors()
            .into_iter()
            .map(|t| StateDictEntry {
                name: format!("{}.{}", self.state_dict_prefix(t.layer), t.name),
                shape: t.shape,
                offset: t.offset,
            })
            .collect()
    }

    /// Where the matrices lie in the flat buffer: the tensors of two or more dimensions
    /// (linear and conv weights, embedding tables), which nanoGPT's AdamW decays.
    pub fn matrix_ranges(&self) -> Vec<std::ops::Range<usize>> {
        (self.parameter_tensors().into_iter())
            .filter(|t| t.shape.len() >= 2)
            .map(|t| t.offset..t.offset + numel(&t.shape))
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
            for t in l.op.parameters() {
                tensors.push(ParameterTensor {
                    layer,
                    name: t.name,
                    shape: t.shape,
                    offset: t.offset,
                    init: t.init,
                });
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
            let Some(state) = l.op.saved_state() else {
                continue;
            };
            for name in state.names {
                entries.push(StateDictEntry {
                    name: format!("{}.{name}", self.state_dict_prefix(i)),
                    shape: vec![state.len],
                    offset,
                });
                offset += state.len;
            }
        }
        entries
    }

    /// Values of `Network::running_stats`.
    pub fn running_stats_len(&self) -> usize {
        self.running_stat_entries().iter().map(|e| e.len()).sum()
    }

    /// The prefixes of layers that count their batches (batch norm's
    /// `num_batches_tracked`).
    pub fn batchnorm_prefixes(&self) -> Vec<String> {
        let counts = |l: &Layer| l.op.saved_state().is_some_and(|s| s.counts_batches);
        let bn = |(i, l): (usize, &Layer)| counts(l).then(|| self.state_dict_prefix(i));
        self.layers.iter().enumerate().filter_map(bn).collect()
    }

    /// Each embedding layer: its index and vocabulary size (the data's ids are checked
    /// against it before training).
    pub fn embeddings(&self) -> Vec<(usize, usize)> {
        let table = |(i, l): (usize, &Layer)| l.op.properties().token_vocab.map(|v| (i, v));
        self.layers.iter().enumerate().filter_map(table).collect()
    }

    /// The FLOPs of training on one sample, as MFU counts them (llm.c, nanoGPT): every
    /// layer's forward and backward, and the loss. Activation checkpointing's recomputed
    /// forwards are the hardware's work, not the model's: not counted.
    pub fn model_flops_per_sample(&self) -> f64 {
        let layers: f64 = (self.layers.iter())
            .map(|l| l.op.kind().flops(&l.in_shape, &l.out_shape))
            .map(|f| f.forward + f.backward)
            .sum();
        layers + self.loss_flops_per_sample()
    }

    /// The loss's FLOPs a sample: about four an output value (softmax, log, gradient).
    pub fn loss_flops_per_sample(&self) -> f64 {
        4.0 * crate::ops::numel(self.output_shape()) as f64
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

    /// The initial parameters by the model's scheme (`InitScheme`), from the job's seed (a
    /// stream per layer, so adding a layer does not change the others' initial values).
    pub fn init_params(&self, seed: u64) -> Vec<f32> {
        let mut params = vec![0.0f32; self.param_len];
        let mut rngs: Vec<Option<Rng>> = vec![None; self.layers.len()];
        let projections = self.layers.iter().filter(|l| into_residual(l)).count();
        for t in self.parameter_tensors() {
            let values = &mut params[t.offset..t.offset + numel(&t.shape)];
            match self.init_of(&t, projections) {
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

impl Graph {
    /// A tensor's initialisation under the model's scheme, with `projections` layers that
    /// project into the residual stream.
    fn init_of(&self, t: &ParameterTensor, projections: usize) -> Init {
        match self.init {
            InitScheme::Pytorch => t.init,
            InitScheme::Gpt2 if t.shape.len() >= 2 => match into_residual(&self.layers[t.layer]) {
                true => Init::Normal(0.02 / (projections as f64).sqrt()),
                false => Init::Normal(0.02),
            },
            InitScheme::Gpt2 if t.name == "bias" => Init::Constant(0.0),
            InitScheme::Gpt2 => t.init,
        }
    }
}

/// Whether GPT-2's initialisation scales the layer down: its name ends in `c_proj`, as
/// nanoGPT's attention and MLP output projections.
fn into_residual(layer: &Layer) -> bool {
    layer.name.as_deref().is_some_and(|n| n.ends_with("c_proj"))
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
    last_key: &str,
) -> Result<Objective> {
    let width = numel(out_shape);
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
            key: last_key.to_string(),
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
            let loss = LossFn::CrossEntropy {
                label_smoothing: spec.loss.label_smoothing as f32,
                ignore_index: spec.loss.ignore_index,
            };
            if let Some(ignored) = spec.loss.ignore_index.filter(|&i| i as usize >= classes) {
                return Err(Error::AtKey {
                    key: "loss.ignore_index".into(),
                    message: format!(
                        "loss.ignore_index = {ignored} is no class: the data has {classes} \
                         (0..{}){classes_from}",
                        classes - 1
                    ),
                });
            }
            // A class label per position: [T, classes] logits against T labels.
            let (&last, leading) = out_shape.split_last().expect("a shape has an axis");
            let positions = numel(leading);
            if !leading.is_empty() && data.target_dim == positions && last == classes {
                return Ok(Objective {
                    loss,
                    target_dim: positions,
                    rows: positions,
                    has_accuracy: true,
                });
            }
            if !leading.is_empty() && data.target_dim == positions {
                // A label per position, but not a logit per class at each: the hint is the
                // vocabulary's size, not a flatten.
                let fix = if last > classes {
                    format!("set data.classes = {last} to pad the vocabulary, or make the last layer's out {classes}")
                } else {
                    format!("make the last layer's out {classes}")
                };
                return Err(Error::AtKey {
                    message: format!(
                        "{last_key} (the last layer) outputs {}: {last} logits at each of \
                         {positions} positions, but the data has {classes} classes{classes_from}; {fix}",
                        shape_str(out_shape)
                    ),
                    key: last_key.to_string(),
                });
            }
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
            Ok(Objective {
                loss,
                target_dim: 1,
                rows: 1,
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
                rows: 1,
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
                .map(|l| l.op.state_len(&l.out_shape, batch_size) * f)
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
