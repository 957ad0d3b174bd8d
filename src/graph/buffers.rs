//! The buffer plan: where each activation lives, and what the backward pass recomputes.
//!
//! Without activation checkpointing every layer's output has its own buffer (a flatten's
//! output shares its input's), except that a layer may write its output over its input
//! (`in_place`, as PyTorch's `inplace=True`): a ReLU, tanh, sigmoid, dropout or add (over its
//! first input) whose input is read by no other layer and was computed by a layer whose
//! backward step does not read its own output. These ops' backward steps need nothing but
//! their output (the activations) or nothing at all (dropout redraws its mask; add), so
//! the input's values are not needed once the layer has run.
//!
//! With activation checkpointing, the layers are split into segments of (nearly) equal layer
//! counts; only the activations at segment boundaries keep their own buffers.
//! The activations inside a segment live in scratch buffers that every segment reuses, so
//! the forward pass overwrites them, and the backward pass, segment by segment from the
//! last, first recomputes the segment's inner activations from its kept input and then
//! back-propagates through it. Memory: the boundaries plus one segment's worth of scratch
//! (the largest). In a graph with skip connections, a value read by a layer of another
//! segment is kept too. A value written in place over another is kept or recomputed with
//! it: it shares its buffer.
//!
//! Gradients: a value read by several layers (a residual branch point) gets the sum of their
//! gradients. Backward runs the layers in reverse, so the first of them to run writes the
//! gradient buffer and the others add to it (`accumulate`).
//!
//! A value's gradient is needed only from the backward step of its last reader (or the loss,
//! for the model's output) to that of its producer, which consumes it; so gradient buffers
//! are shared by values whose lifetimes do not overlap, as PyTorch frees a gradient once it
//! is used (`grad_slot`). A chain needs two, of the largest layer's size, however deep.
//!
//! A classifier's gradient is written over its logits (`loss_over_output`, as llm.c's fused
//! classifier): cross-entropy reads a row of logits and then writes the row's gradient in
//! its place, which the last layer's backward step reads. The logits' gradient, often the
//! largest of all (a language model's vocabulary at every position), then has a buffer of
//! no size. Only where nothing else needs the logits after the loss: the last layer's
//! backward does not read its output, no layer reads it, and it is not written in place.
//!
//! A pooling straight after a ReLU (conv, relu, maxpool: the usual block) that is the
//! ReLU's only reader takes the gradient back through both in its own step
//! (`through_relu`): it sends each input position's gradient on to the ReLU's input where
//! the position's value is positive, as the ReLU's step would, with one pass over the values
//! fewer. The ReLU's output then shares its input's gradient buffer, which the pooling
//! writes.

use super::{numel, Layer};
use crate::data::DataReads;
use crate::tensor::Activation;
use std::ops::Range;

#[derive(Debug, Clone, PartialEq)]
pub struct BufferPlan {
    /// node → buffer: node 0 is the input, node i+1 the output of layer i.
    pub slot: Vec<usize>,
    /// Values per sample in each buffer; buffer 0 is the input batch: the data's values, or
    /// nothing where only embeddings read the data (they read `token_ids`).
    pub sizes: Vec<usize>,
    /// The data's token ids per sample, where an embedding reads them (0 otherwise).
    pub token_ids: usize,
    /// Layer ranges the backward pass takes one at a time, from the last; a single range
    /// over all layers without activation checkpointing.
    pub segments: Vec<Range<usize>>,
    /// Per layer: its output lives in scratch, so backward recomputes it first.
    pub recompute: Vec<bool>,
    /// Per layer: it writes its output over its (first) input, in the same buffer.
    pub in_place: Vec<bool>,
    /// Per layer, per input: backward adds this input's gradient to what an earlier-run
    /// backward step wrote there, rather than writing it.
    pub accumulate: Vec<Vec<bool>>,
    /// Per layer, per input: the input is (a view of) the data, which needs no gradient.
    pub is_data: Vec<Vec<bool>>,
    /// node → the buffer holding its gradient in the backward pass (see the module's
    /// comment); the data's entry is unused.
    pub grad_slot: Vec<usize>,
    /// Per layer: a pooling whose backward step also takes the gradient back through the
    /// ReLU before it (see the module's comment); that ReLU's own step does nothing.
    pub through_relu: Vec<bool>,
    /// Values per sample in each gradient buffer.
    pub grad_sizes: Vec<usize>,
    /// Mixed precision (`BufferPlan::mixed`): a device may store every activation buffer and
    /// gradient buffer in the half format.
    pub half_width: bool,
    /// The loss writes the output's gradient over the output (see the module's comment);
    /// the output's gradient buffer is empty.
    pub loss_over_output: bool,
    /// Values per sample of the scratch a layer's input gradient goes through when it is
    /// added to another (`accumulate`): the largest such input; 0 when none is added.
    pub added_scratch: usize,
}

impl BufferPlan {
    /// `new` for mixed precision, where every activation and activation gradient holds a
    /// half value, the data's values included (see graph::Network): a device may store them
    /// in the half format itself (`half_width`). Token ids are u32 in any precision.
    pub fn mixed(
        input_shape: &[usize],
        layers: &[Layer],
        segments: Option<usize>,
        classifier: bool,
    ) -> Self {
        let mut plan = Self::new(input_shape, layers, segments, classifier);
        plan.half_width = true;
        plan
    }

    /// The plan for `layers` after an input of `input_shape`; `segments` is None without
    /// activation checkpointing; `classifier`: the loss is cross-entropy, which may write
    /// its gradient over the output.
    pub fn new(
        input_shape: &[usize],
        layers: &[Layer],
        segments: Option<usize>,
        classifier: bool,
    ) -> Self {
        let count = layers.len();
        // 1. Values: node → value, where a flatten's output is its input's value.
        let mut value_of_node = vec![0usize];
        let mut value_size = vec![numel(input_shape)];
        // The layer that computes each value (usize::MAX for the data).
        let mut producer = vec![usize::MAX];
        for (i, layer) in layers.iter().enumerate() {
            if layer.is_view() {
                value_of_node.push(value_of_node[layer.inputs[0]]);
            } else {
                producer.push(i);
                value_of_node.push(value_size.len());
                value_size.push(numel(&layer.out_shape));
            }
        }

        // 1b. In-place layers: their output is stored in their input's buffer (`stored`:
        //     value → the value whose buffer holds it).
        let mut readers = vec![0usize; value_size.len()];
        for layer in layers.iter().filter(|l| !l.is_view()) {
            for &n in &layer.inputs {
                readers[value_of_node[n]] += 1;
            }
        }
        // 1c. The data: token ids where an embedding reads it; values where another layer
        //     reads it, or it is the output.
        let reads_ids = |l: &Layer| l.op.properties().token_vocab.is_some();
        let reads_data =
            |l: &&Layer| !l.is_view() && l.inputs.iter().any(|&n| value_of_node[n] == 0);
        let token_ids = match layers.iter().filter(reads_data).any(reads_ids) {
            true => value_size[0],
            false => 0,
        };
        let reads_values = layers.iter().filter(reads_data).any(|l| !reads_ids(l));
        if !reads_values && value_of_node[count] != 0 {
            value_size[0] = 0;
        }
        let mut stored: Vec<usize> = (0..value_size.len()).collect();
        let in_place: Vec<bool> = layers
            .iter()
            .enumerate()
            .map(|(i, layer)| {
                let input = value_of_node[layer.inputs[0]];
                let eligible = layer.op.properties().writes_in_place
                    && input != 0
                    && readers[input] == 1
                    && !layers[producer[input]]
                        .op
                        .properties()
                        .backward_reads_output;
                if eligible {
                    stored[value_of_node[i + 1]] = stored[input];
                }
                eligible
            })
            .collect();
        let store_of_node = |n: usize| stored[value_of_node[n]];

        // 2. Segments of nearly equal layer counts; boundaries are nodes.
        let parts = segments.unwrap_or(1).clamp(1, count.max(1));
        let bounds: Vec<usize> = (0..=parts).map(|k| k * count / parts).collect();
        let ranges: Vec<Range<usize>> = bounds
            .windows(2)
            .map(|w| w[0]..w[1])
            .filter(|r| !r.is_empty())
            .collect();

        // 3. Kept values: all without checkpointing, else those at a boundary node (the
        //    input and the model's output are boundaries). A value stored over another is
        //    kept with it (in-place layers), and `producer` is the first layer writing it.
        let mut kept = vec![segments.is_none(); value_size.len()];
        for &b in &bounds {
            kept[store_of_node(b)] = true;
        }
        let segment_of = |layer: usize| ranges.iter().position(|r| r.contains(&layer));
        for (i, layer) in layers.iter().enumerate().filter(|(_, l)| !l.is_view()) {
            for &n in &layer.inputs {
                let v = store_of_node(n);
                if producer[v] != usize::MAX && segment_of(producer[v]) != segment_of(i) {
                    kept[v] = true;
                }
            }
        }

        // 4. Buffers: one per kept value, then scratch buffers; a segment's j-th inner value
        //    takes scratch buffer j, sized for the largest of them over all segments.
        let mut buffer_of_value = vec![usize::MAX; value_size.len()];
        let mut sizes = Vec::new();
        for (v, &size) in value_size.iter().enumerate() {
            if kept[v] && stored[v] == v {
                buffer_of_value[v] = sizes.len();
                sizes.push(size);
            }
        }
        let first_scratch = sizes.len();
        let mut scratch: Vec<usize> = Vec::new();
        for range in &ranges {
            let mut j = 0;
            for i in range.clone() {
                let v = store_of_node(i + 1);
                if kept[v] || buffer_of_value[v] != usize::MAX {
                    continue; // kept, or a flatten or in-place output of a value placed
                }
                if j == scratch.len() {
                    scratch.push(0);
                }
                scratch[j] = scratch[j].max(value_size[v]);
                buffer_of_value[v] = first_scratch + j;
                j += 1;
            }
        }
        sizes.extend(scratch);

        let recompute = layers
            .iter()
            .enumerate()
            .map(|(i, l)| !l.is_view() && !kept[store_of_node(i + 1)])
            .collect();
        // The loss writes the output's gradient first; then layers from the last.
        let mut written = vec![false; value_size.len()];
        written[value_of_node[count]] = true;
        let mut accumulate: Vec<Vec<bool>> =
            layers.iter().map(|l| vec![false; l.inputs.len()]).collect();
        for (i, layer) in layers.iter().enumerate().rev() {
            if layer.is_view() {
                continue; // shares its input's buffer, gradient included
            }
            for (k, &n) in layer.inputs.iter().enumerate() {
                let v = value_of_node[n];
                accumulate[i][k] = written[v];
                written[v] = true;
            }
        }
        let is_data: Vec<Vec<bool>> = layers
            .iter()
            .map(|l| l.inputs.iter().map(|&n| value_of_node[n] == 0).collect())
            .collect();
        let through_relu: Vec<bool> = layers
            .iter()
            .enumerate()
            .map(|(i, layer)| {
                i >= 1
                    && layer.op.properties().takes_gradient_through_relu
                    && layers[i - 1].op.properties().activation == Some(Activation::Relu)
                    && layer.inputs[0] == i
                    && readers[value_of_node[i]] == 1
                    && !is_data[i - 1][0]
                    && !accumulate[i - 1][0]
            })
            .collect();
        // The gradient of a ReLU output that its pooling takes through is its input's.
        let grad_value_of_node: Vec<usize> = (0..=count)
            .map(|n| match n.checked_sub(1) {
                Some(relu) if through_relu.get(n).copied().unwrap_or(false) => {
                    value_of_node[layers[relu].inputs[0]]
                }
                _ => value_of_node[n],
            })
            .collect();
        let added_scratch = (layers.iter().zip(&accumulate))
            .filter(|(_, added)| added[0])
            .map(|(l, _)| value_size[value_of_node[l.inputs[0]]])
            .max()
            .unwrap_or(0);
        let output = value_of_node[count];
        let loss_over_output = classifier
            && count > 0
            && !layers[count - 1].is_view()
            && !in_place[count - 1]
            && !layers[count - 1].op.properties().backward_reads_output
            && readers[output] == 0;
        let over_output = loss_over_output.then_some(output);
        let (grad_of_value, grad_sizes) =
            gradient_buffers(layers, &grad_value_of_node, &value_size, over_output);
        BufferPlan {
            slot: value_of_node
                .iter()
                .map(|&v| buffer_of_value[stored[v]])
                .collect(),
            grad_slot: grad_value_of_node
                .iter()
                .map(|&v| grad_of_value[v])
                .collect(),
            through_relu,
            grad_sizes,
            sizes,
            segments: ranges,
            recompute,
            in_place,
            accumulate,
            is_data,
            token_ids,
            half_width: false,
            loss_over_output,
            added_scratch,
        }
    }

    /// The segment count that needs the least activation memory; on a tie the larger
    /// count, which recomputes less. This is what `activations = "all"` uses.
    pub fn best_segments(input_shape: &[usize], layers: &[Layer]) -> usize {
        let mut best = (usize::MAX, 1);
        for parts in 1..=layers.len().max(1) {
            let values = Self::new(input_shape, layers, Some(parts), false).activation_values();
            if values <= best.0 {
                best = (values, parts);
            }
        }
        best.1
    }

    /// Activation values per sample held by the plan (the input batch excluded).
    pub fn activation_values(&self) -> usize {
        self.sizes[1..].iter().sum()
    }

    /// Activation-gradient values per sample held by the plan, the scratch that a gradient
    /// added to another goes through included.
    pub fn gradient_values(&self) -> usize {
        self.grad_sizes.iter().sum::<usize>() + self.added_scratch
    }

    /// Layers whose forward pass runs again in backward.
    pub fn recomputed_layers(&self) -> usize {
        self.recompute.iter().filter(|&&r| r).count()
    }

    /// What of the data the layers read.
    pub fn data_reads(&self) -> DataReads {
        DataReads {
            values: self.sizes[0] > 0,
            ids: self.token_ids > 0,
        }
    }

    /// Bytes per sample of (the input batch: its values and token ids, the activations,
    /// their gradients with the scratch), with values at 2 bytes where `half` (a device
    /// storing the half format) and at 4 otherwise; token ids at 4.
    pub fn bytes_per_sample(&self, half: bool) -> (usize, usize, usize) {
        let width = if half { 2 } else { 4 };
        (
            self.sizes[0] * width + self.token_ids * 4,
            self.activation_values() * width,
            self.gradient_values() * width,
        )
    }
}

/// Gradient buffers shared by values whose gradients are never needed at the same time:
/// returns the buffer of each value (usize::MAX for the data, which needs no gradient, and
/// for a value no node takes its gradient from: a ReLU output that its pooling takes the
/// gradient through) and each buffer's size in values per sample. `value_of_node` maps each
/// node to the value whose gradient it has.
///
/// Time runs through the backward pass: the loss at 0, layer i at `layers.len() - i`. A
/// value's gradient is live from the step of its first writer (the loss for the model's
/// output, else its reader that runs backward first) to that of its producer, which reads it
/// and writes its own input's gradient at the same step: a buffer is free again only from
/// the next step. Values are placed in the order their gradients appear, each into the
/// smallest free buffer that holds it, else the largest free one (grown), else a new one.
/// `over_output`: the output's value, whose gradient lies over it; its buffer is an empty one
/// of its own, last.
fn gradient_buffers(
    layers: &[Layer],
    value_of_node: &[usize],
    value_size: &[usize],
    over_output: Option<usize>,
) -> (Vec<usize>, Vec<usize>) {
    let count = layers.len();
    let time = |layer: usize| count - layer;
    let values = value_size.len();
    let mut born = vec![usize::MAX; values];
    let mut dies = vec![0; values];
    born[value_of_node[count]] = 0;
    for (i, layer) in layers.iter().enumerate() {
        if value_of_node[i + 1] == value_of_node[layer.inputs[0]] {
            continue; // its output's gradient is its input's (a view; a ReLU taken through)
        }
        dies[value_of_node[i + 1]] = time(i);
        for &n in &layer.inputs {
            let v = value_of_node[n];
            born[v] = born[v].min(time(i));
        }
    }
    let mut used = vec![false; values];
    value_of_node.iter().for_each(|&v| used[v] = true);
    let mut order: Vec<usize> = (1..values)
        .filter(|&v| used[v] && Some(v) != over_output)
        .collect();
    order.sort_by_key(|&v| born[v]);
    let mut buffer_of = vec![usize::MAX; values];
    let mut sizes: Vec<usize> = Vec::new();
    let mut busy_until: Vec<usize> = Vec::new();
    for v in order {
        let free = (0..sizes.len()).filter(|&b| busy_until[b] < born[v]);
        let fits = free.clone().filter(|&b| sizes[b] >= value_size[v]);
        let b = match fits.min_by_key(|&b| sizes[b]) {
            Some(b) => b,
            None => match free.max_by_key(|&b| sizes[b]) {
                Some(b) => b,
                None => {
                    sizes.push(0);
                    busy_until.push(0);
                    sizes.len() - 1
                }
            },
        };
        sizes[b] = sizes[b].max(value_size[v]);
        busy_until[b] = dies[v];
        buffer_of[v] = b;
    }
    if let Some(v) = over_output {
        buffer_of[v] = sizes.len();
        sizes.push(0);
    }
    (buffer_of, sizes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{DataShape, Graph};
    use crate::spec::JobSpec;
    use std::collections::HashMap;

    fn graph(spec: &str, sample: Vec<usize>) -> Graph {
        let spec: JobSpec = toml::from_str(spec).unwrap();
        let shape = DataShape {
            sample_shape: sample,
            classes: Some(10),
            classes_from: None,
            target_dim: 1,
        };
        Graph::build(&spec, &shape).unwrap()
    }

    fn job(layers: &str, activations: &str) -> String {
        format!(
            "[data]\nsource = \"synthetic\"\n[model]\nlayers = [{layers}]\n\
             [optimizer]\ntype = \"sgd\"\nlr = 0.1\n[checkpoint]\nactivations = {activations}\n"
        )
    }

    fn mlp(depth: usize, activations: &str) -> Graph {
        let hidden = "{ type = \"linear\", out = 1024 }, { type = \"relu\" }, ".repeat(depth);
        let layers = format!("{hidden}{{ type = \"linear\", out = 10 }}");
        graph(&job(&layers, activations), vec![784])
    }

    /// node → the node whose value it is (a flatten's output is its input's value).
    fn node_values(layers: &[Layer]) -> Vec<usize> {
        let mut value = vec![0usize];
        for (i, l) in layers.iter().enumerate() {
            value.push(if l.is_view() {
                value[l.inputs[0]]
            } else {
                i + 1
            });
        }
        value
    }

    /// Runs the backward pass's gradient traffic over the plan: the loss writes the output's
    /// gradient, then each layer from the last reads its output's and writes (or adds to) its
    /// inputs'. Fails where a write would land in a buffer that holds another value's gradient
    /// still to be read, a read finds another value's, or a buffer is too small.
    fn check_gradient_lifetimes(g: &Graph, plan: &BufferPlan) {
        let layers = &g.layers;
        let value = node_values(layers);
        let size = |node: usize| {
            numel(&if node == 0 {
                g.input_shape.clone()
            } else {
                layers[node - 1].out_shape.clone()
            })
        };
        // A ReLU that its pooling takes the gradient through: its output's gradient is its
        // input's, and its own step does nothing.
        let taken_through = |i: usize| plan.through_relu.get(i + 1) == Some(&true);
        let value: Vec<usize> = (0..value.len())
            .map(|n| match n.checked_sub(1) {
                Some(relu) if taken_through(relu) => value[layers[relu].inputs[0]],
                _ => value[n],
            })
            .collect();
        let mut holder: HashMap<usize, usize> = HashMap::new();
        let out = layers.len();
        holder.insert(plan.grad_slot[out], value[out]);
        for (i, l) in layers.iter().enumerate().rev() {
            if l.is_view() || taken_through(i) {
                continue;
            }
            let dy = plan.grad_slot[i + 1];
            assert_eq!(holder.get(&dy), Some(&value[i + 1]), "layer {i} reads dy");
            for &n in l.inputs.iter().filter(|&&n| value[n] != 0) {
                let dx = plan.grad_slot[n];
                assert_ne!(dx, dy, "layer {i} writes dx over its dy");
                let held = holder.insert(dx, value[n]);
                assert!(
                    held.is_none() || held == Some(value[n]),
                    "layer {i} writes over the live gradient of node {held:?}"
                );
                assert!(
                    plan.grad_sizes[dx] >= size(n),
                    "layer {i}: buffer too small"
                );
            }
            holder.remove(&dy);
        }
        assert!(holder.is_empty(), "gradients left unread: {holder:?}");
    }

    /// Runs the forward pass, then the backward pass with its recomputations, over the plan's
    /// activation buffers, and fails where a layer would read a buffer that no longer (or
    /// not yet) holds the value it needs: its inputs in forward, and in backward what that
    /// op's backward step reads (its input, its output, or neither).
    fn check_activation_lifetimes(g: &Graph, plan: &BufferPlan) {
        let layers = &g.layers;
        let value = node_values(layers);
        let reads_input = |op: &crate::ops::Op| op.properties().backward_reads_input;
        let reads_output = |op: &crate::ops::Op| op.properties().backward_reads_output;
        let mut holds: HashMap<usize, usize> = HashMap::from([(plan.slot[0], 0)]);
        let expect = |holds: &HashMap<usize, usize>, node: usize, what: &str| {
            assert_eq!(holds.get(&plan.slot[node]), Some(&value[node]), "{what}");
        };
        let run = |holds: &mut HashMap<usize, usize>, i: usize| {
            for &n in &layers[i].inputs {
                expect(holds, n, &format!("forward of layer {i} reads node {n}"));
            }
            holds.insert(plan.slot[i + 1], value[i + 1]);
        };
        for (i, l) in layers.iter().enumerate() {
            if !l.is_view() {
                run(&mut holds, i);
            }
        }
        for range in plan.segments.iter().rev() {
            for i in range.clone().filter(|&i| plan.recompute[i]) {
                run(&mut holds, i);
            }
            for i in range.clone().rev() {
                let op = &layers[i].op;
                if reads_input(op) && !op.properties().is_view {
                    expect(
                        &holds,
                        layers[i].inputs[0],
                        &format!("backward of layer {i}: x"),
                    );
                }
                if reads_output(op) {
                    expect(&holds, i + 1, &format!("backward of layer {i}: y"));
                }
            }
        }
    }

    #[test]
    fn in_place_layers_are_those_whose_input_nothing_else_needs() {
        let g = graph(
            &job(
                "{ type = \"conv2d\", out = 4, kernel_size = 3, padding = 1 }, \
                 { type = \"relu\" }, { type = \"relu\" }, { type = \"maxpool2d\", kernel_size = 2 }, \
                 { type = \"sigmoid\" }, { type = \"batchnorm2d\", name = \"bn\" }, \
                 { type = \"dropout\", p = 0.1, name = \"drop\" }, \
                 { type = \"add\", inputs = [\"bn\", \"drop\"] }, \
                 { type = \"tanh\" }, { type = \"gelu\" }, { type = \"flatten\" }, \
                 { type = \"linear\", out = 10 }",
                "\"none\"",
            ),
            vec![1, 8, 8],
        );
        let plan = g.buffer_plan();
        // conv, relu (over the conv's output), relu (not over a ReLU's output, which its
        // backward reads), maxpool, sigmoid (not over max pooling's output), batch norm,
        // dropout (not over a value the add reads too), add (not: the batch norm's output
        // has two readers), tanh (over the add's output), gelu (its backward reads its
        // input), flatten, linear.
        let expected = [
            false, true, false, false, false, false, false, false, true, false, false, false,
        ];
        assert_eq!(plan.in_place, expected);
        assert_eq!(plan.slot[2], plan.slot[1]);
        assert_ne!(plan.slot[3], plan.slot[2]);
        check_activation_lifetimes(&g, &plan);
        // A chain of linear and ReLU layers stores the linear layers' outputs alone.
        let g = mlp(3, "\"none\"");
        let plan = g.buffer_plan();
        assert_eq!(
            plan.in_place,
            [false, true, false, true, false, true, false]
        );
        assert_eq!(plan.activation_values(), 3 * 1024 + 10);
    }

    #[test]
    fn a_chain_needs_two_gradient_buffers_however_deep() {
        for depth in [1, 3, 7] {
            let g = mlp(depth, "\"none\"");
            let plan = g.buffer_plan();
            // The logits' gradient lies over the logits: its buffer is the empty last one.
            assert_eq!(plan.grad_sizes, [1024, 1024, 0]);
            check_gradient_lifetimes(&g, &plan);
        }
    }

    /// Cross-entropy writes its gradient over the logits: they need no gradient buffer.
    /// Not where the last layer's backward reads its output, nor for another loss.
    #[test]
    fn the_classifier_gradient_lies_over_the_logits() {
        let layers = "{ type = \"linear\", out = 64 }, { type = \"relu\" }, \
                      { type = \"linear\", out = 10 }";
        let plan = graph(&job(layers, "\"none\""), vec![784]).buffer_plan();
        assert!(plan.loss_over_output);
        assert_eq!(plan.grad_slot[3], plan.grad_sizes.len() - 1);
        assert_eq!(plan.grad_sizes, [64, 64, 0]);

        let softmax_last = format!("{layers}, {{ type = \"log_softmax\" }}");
        let plan = graph(&job(&softmax_last, "\"none\""), vec![784]).buffer_plan();
        assert!(
            !plan.loss_over_output,
            "log_softmax's backward reads its output"
        );
        assert_eq!(plan.grad_sizes, [64, 64]);

        let mut regression = graph(&job(layers, "\"none\""), vec![784]);
        regression.objective.loss = crate::tensor::LossFn::Mse;
        let plan = regression.buffer_plan();
        assert!(!plan.loss_over_output, "mse");
        assert_eq!(plan.grad_sizes, [64, 64]);
    }

    #[test]
    fn a_pooling_after_a_relu_takes_the_gradient_through_it() {
        let cnn = graph(
            include_str!("../../jobs/fashion_mnist_cnn.toml"),
            vec![1, 28, 28],
        );
        let plan = cnn.buffer_plan();
        // conv, relu, maxpool, conv, relu, maxpool, flatten, linear, relu, linear
        let (f, t) = (false, true);
        assert_eq!(plan.through_relu, [f, f, t, f, f, t, f, f, f, f]);
        // The ReLU output's gradient is its input's: the chain still needs two buffers
        // (and the logits' gradient, over the logits, an empty one).
        assert_eq!(plan.grad_slot[2], plan.grad_slot[1]);
        assert_eq!(plan.grad_sizes.len(), 3);
        assert_eq!(plan.grad_sizes[2], 0);
        check_gradient_lifetimes(&cnn, &plan);

        let conv = "{ type = \"conv2d\", out = 2, kernel_size = 3, padding = 1 }";
        let two_readers = format!(
            "{conv}, {{ type = \"relu\", name = \"r\" }}, \
             {{ type = \"maxpool2d\", kernel_size = 2, name = \"a\" }}, \
             {{ type = \"avgpool2d\", kernel_size = 2, inputs = [\"r\"], name = \"b\" }}, \
             {{ type = \"add\", inputs = [\"a\", \"b\"] }}, {{ type = \"flatten\" }}, \
             {{ type = \"linear\", out = 10 }}"
        );
        let on_the_data = "{ type = \"relu\" }, { type = \"maxpool2d\", kernel_size = 2 }, \
             { type = \"flatten\" }, { type = \"linear\", out = 10 }";
        for layers in [two_readers.as_str(), on_the_data] {
            let g = graph(&job(layers, "\"none\""), vec![2, 8, 8]);
            let plan = g.buffer_plan();
            assert!(!plan.through_relu.contains(&true), "{layers}");
            check_gradient_lifetimes(&g, &plan);
        }
    }

    #[test]
    fn shared_buffers_hold_every_value_while_it_is_needed() {
        let resnet = include_str!("../../jobs/resnet_small.toml");
        let branches = "{ type = \"linear\", out = 32, name = \"a\" }, { type = \"relu\" }, \
             { type = \"linear\", out = 16, name = \"b\" }, \
             { type = \"linear\", out = 16, inputs = [\"a\"], name = \"c\" }, \
             { type = \"concat\", inputs = [\"b\", \"c\", \"a\"] }, { type = \"tanh\" }, \
             { type = \"linear\", out = 64 }, { type = \"dropout\", p = 0.2, name = \"d\" }, \
             { type = \"linear\", out = 64, name = \"e\" }, { type = \"add\", inputs = [\"e\", \"d\"] }, \
             { type = \"sigmoid\", name = \"s\" }, { type = \"add\", inputs = [\"s\", \"s\"] }, \
             { type = \"linear\", out = 10 }";
        let cnn = include_str!("../../jobs/fashion_mnist_cnn.toml");
        let mut graphs = vec![graph(resnet, vec![1, 28, 28]), graph(cnn, vec![1, 28, 28])];
        let cnn_layers = "{ type = \"conv2d\", out = 4, kernel_size = 3, padding = 1 }, \
             { type = \"relu\" }, { type = \"maxpool2d\", kernel_size = 2 }, \
             { type = \"conv2d\", out = 4, kernel_size = 3, padding = 1 }, \
             { type = \"relu\" }, { type = \"avgpool2d\", kernel_size = 2 }, \
             { type = \"flatten\" }, { type = \"linear\", out = 10 }";
        for activations in ["\"none\"", "\"all\"", "{ segments = 3 }"] {
            graphs.push(graph(&job(branches, activations), vec![20]));
            graphs.push(mlp(4, activations));
            graphs.push(graph(&job(cnn_layers, activations), vec![1, 8, 8]));
        }
        for g in &graphs {
            let plan = g.buffer_plan();
            check_activation_lifetimes(g, &plan);
            check_gradient_lifetimes(g, &plan);
            let layers = g.layers.iter().filter(|l| !l.is_view());
            let separate: usize = layers.map(|l| numel(&l.out_shape)).sum();
            assert!(plan.grad_sizes.iter().sum::<usize>() < separate);
        }
    }

    #[test]
    fn mixed_precision_keeps_activations_and_gradients_at_half_the_bytes() {
        let cnn = graph(
            &job(
                "{ type = \"conv2d\", out = 4, kernel_size = 3, padding = 1 }, \
                 { type = \"relu\" }, { type = \"maxpool2d\", kernel_size = 2 }, \
                 { type = \"flatten\" }, { type = \"linear\", out = 32, name = \"a\" }, \
                 { type = \"relu\", name = \"r\" }, { type = \"linear\", out = 32, name = \"b\" }, \
                 { type = \"add\", inputs = [\"r\", \"b\"] }, { type = \"layernorm\" }, \
                 { type = \"linear\", out = 10 }",
                "\"none\"",
            ),
            vec![1, 8, 8],
        );
        for (g, activations) in [
            (mlp(3, "\"none\""), "none"),
            (mlp(3, "\"all\""), "all"),
            (cnn, "cnn"),
        ] {
            let plan = g.buffer_plan_for(true);
            assert!(plan.half_width, "{activations}");
            let (input, acts, grads) = plan.bytes_per_sample(true);
            let (input32, acts32, grads32) = plan.bytes_per_sample(false);
            assert_eq!((2 * input, 2 * acts, 2 * grads), (input32, acts32, grads32));
            assert_eq!(acts32, 4 * plan.activation_values());
            assert_eq!(grads32, 4 * plan.gradient_values());
            // The same buffers as in fp32.
            let fp32 = BufferPlan {
                half_width: false,
                ..plan.clone()
            };
            assert_eq!(fp32, g.buffer_plan());
        }
    }

    #[test]
    fn token_ids_are_u32_beside_the_data_values() {
        let embedding = "{ type = \"embedding\", num_embeddings = 50, embedding_dim = 8 }";
        let ids_only = graph(
            &job(
                &format!(
                    "{embedding}, {{ type = \"flatten\" }}, {{ type = \"linear\", out = 10 }}"
                ),
                "\"none\"",
            ),
            vec![4],
        );
        for mixed in [false, true] {
            let plan = ids_only.buffer_plan_for(mixed);
            assert_eq!((plan.sizes[0], plan.token_ids), (0, 4));
            let (input, acts, _) = plan.bytes_per_sample(mixed);
            let width = if mixed { 2 } else { 4 };
            assert_eq!((input, acts), (4 * 4, width * plan.activation_values()));
        }
        // A linear layer reads the data's values beside the embedding's ids.
        let both = graph(
            &job(
                &format!(
                    "{embedding}, {{ type = \"flatten\", name = \"e\" }}, \
                     {{ type = \"linear\", out = 32, inputs = [\"input\"], name = \"v\" }}, \
                     {{ type = \"concat\", inputs = [\"e\", \"v\"] }}, \
                     {{ type = \"linear\", out = 10 }}"
                ),
                "\"none\"",
            ),
            vec![4],
        );
        let plan = both.buffer_plan_for(true);
        assert_eq!((plan.sizes[0], plan.token_ids), (4, 4));
        assert_eq!(plan.bytes_per_sample(true).0, 4 * 2 + 4 * 4);
        assert_eq!(both.buffer_plan().sizes[0], 4);
    }
}
