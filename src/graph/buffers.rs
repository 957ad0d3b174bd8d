//! The buffer plan: where each activation lives, and what the backward pass recomputes.
//!
//! Without activation checkpointing every layer's output has its own buffer (a flatten's
//! output shares its input's). With it, the layers are split into segments of (nearly)
//! equal layer counts; only the activations at segment boundaries keep their own buffers.
//! The activations inside a segment live in scratch buffers that every segment reuses, so
//! the forward pass overwrites them, and the backward pass, segment by segment from the
//! last, first recomputes the segment's inner activations from its kept input and then
//! back-propagates through it. Memory: the boundaries plus one segment's worth of scratch
//! (the largest), for activations and their gradients alike. In a graph with skip
//! connections, a value read by a layer of another segment is kept too.
//!
//! Gradients: a value read by several layers (a residual branch point) gets the sum of their
//! gradients. Backward runs the layers in reverse, so the first of them to run writes the
//! gradient buffer and the others add to it (`accumulate`).

use super::{numel, Layer, Op};
use std::ops::Range;

#[derive(Debug, Clone, PartialEq)]
pub struct BufferPlan {
    /// node → buffer: node 0 is the input, node i+1 the output of layer i.
    pub slot: Vec<usize>,
    /// Values per sample in each buffer; buffer 0 is the input batch.
    pub sizes: Vec<usize>,
    /// Layer ranges the backward pass takes one at a time, from the last; a single range
    /// over all layers without activation checkpointing.
    pub segments: Vec<Range<usize>>,
    /// Per layer: its output lives in scratch, so backward recomputes it first.
    pub recompute: Vec<bool>,
    /// Per layer, per input: backward adds this input's gradient to what an earlier-run
    /// backward step wrote there, rather than writing it.
    pub accumulate: Vec<Vec<bool>>,
    /// Per layer, per input: the input is (a view of) the data, which needs no gradient.
    pub is_data: Vec<Vec<bool>>,
}

impl BufferPlan {
    /// The plan for `layers` after an input of `input_shape`; `segments` is None without
    /// activation checkpointing.
    pub fn new(input_shape: &[usize], layers: &[Layer], segments: Option<usize>) -> Self {
        let count = layers.len();
        // 1. Values: node → value, where a flatten's output is its input's value.
        let mut value_of_node = vec![0usize];
        let mut value_size = vec![numel(input_shape)];
        // The layer that computes each value (usize::MAX for the data).
        let mut producer = vec![usize::MAX];
        for (i, layer) in layers.iter().enumerate() {
            if layer.op == Op::View {
                value_of_node.push(value_of_node[layer.inputs[0]]);
            } else {
                producer.push(i);
                value_of_node.push(value_size.len());
                value_size.push(numel(&layer.out_shape));
            }
        }

        // 2. Segments of nearly equal layer counts; boundaries are nodes.
        let parts = segments.unwrap_or(1).clamp(1, count.max(1));
        let bounds: Vec<usize> = (0..=parts).map(|k| k * count / parts).collect();
        let ranges: Vec<Range<usize>> = bounds
            .windows(2)
            .map(|w| w[0]..w[1])
            .filter(|r| !r.is_empty())
            .collect();

        // 3. Kept values: all without checkpointing, else those at a boundary node (the
        //    input and the model's output are boundaries).
        let mut kept = vec![segments.is_none(); value_size.len()];
        for &b in &bounds {
            kept[value_of_node[b]] = true;
        }
        let segment_of = |layer: usize| ranges.iter().position(|r| r.contains(&layer));
        for (i, layer) in layers.iter().enumerate().filter(|(_, l)| l.op != Op::View) {
            for &n in &layer.inputs {
                let v = value_of_node[n];
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
            if kept[v] {
                buffer_of_value[v] = sizes.len();
                sizes.push(size);
            }
        }
        let first_scratch = sizes.len();
        let mut scratch: Vec<usize> = Vec::new();
        for range in &ranges {
            let mut j = 0;
            for i in range.clone() {
                let v = value_of_node[i + 1];
                if kept[v] || buffer_of_value[v] != usize::MAX {
                    continue; // kept, or a flatten of a value already placed
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
            .map(|(i, l)| l.op != Op::View && !kept[value_of_node[i + 1]])
            .collect();
        // The loss writes the output's gradient first; then layers from the last.
        let mut written = vec![false; value_size.len()];
        written[value_of_node[count]] = true;
        let mut accumulate: Vec<Vec<bool>> =
            layers.iter().map(|l| vec![false; l.inputs.len()]).collect();
        for (i, layer) in layers.iter().enumerate().rev() {
            if layer.op == Op::View {
                continue; // shares its input's buffer, gradient included
            }
            for (k, &n) in layer.inputs.iter().enumerate() {
                let v = value_of_node[n];
                accumulate[i][k] = written[v];
                written[v] = true;
            }
        }
        let is_data = layers
            .iter()
            .map(|l| l.inputs.iter().map(|&n| value_of_node[n] == 0).collect())
            .collect();
        BufferPlan {
            slot: value_of_node.iter().map(|&v| buffer_of_value[v]).collect(),
            sizes,
            segments: ranges,
            recompute,
            accumulate,
            is_data,
        }
    }

    /// The segment count that needs the least activation memory; on a tie the larger
    /// count, which recomputes less. This is what `activations = "all"` uses.
    pub fn best_segments(input_shape: &[usize], layers: &[Layer]) -> usize {
        let mut best = (usize::MAX, 1);
        for parts in 1..=layers.len().max(1) {
            let values = Self::new(input_shape, layers, Some(parts)).activation_values();
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

    /// Layers whose forward pass runs again in backward.
    pub fn recomputed_layers(&self) -> usize {
        self.recompute.iter().filter(|&&r| r).count()
    }
}
