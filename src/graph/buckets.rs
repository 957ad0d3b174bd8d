//! Gradient buckets: how data parallelism averages the gradients while the backward pass is
//! still running, as PyTorch's DistributedDataParallel does. The backward pass visits the
//! layers last to first, so the flat gradient buffer becomes final from its end down; the
//! buffer is cut at layer boundaries into buckets of about `parallel.bucket_mb`, and a
//! bucket is handed to the all-reduce as soon as the last layer holding part of it is done,
//! while the earlier layers' backward runs on.

use super::Graph;
use std::ops::Range;

/// DDP's first bucket (the last layers', the first to be ready) is at most 1 MiB, so that the
/// first all-reduce starts early.
const FIRST_BUCKET_BYTES: usize = 1 << 20;

#[derive(Debug, Clone, PartialEq)]
pub struct GradBuckets {
    /// Per layer: the bucket whose gradients are final once this layer's backward is done.
    after_layer: Vec<Option<Range<usize>>>,
}

impl GradBuckets {
    /// Buckets of at least `cap_bytes` of f32 gradients each (the first at most 1 MiB), ending
    /// at layer boundaries; the last holds whatever remains.
    pub fn new(graph: &Graph, cap_bytes: usize) -> Self {
        let values = |bytes: usize| (bytes / 4).max(1);
        let spans = graph.parameter_spans();
        // The end of the parameters of the layers before each layer: a region above it
        // holds none of theirs.
        let mut below_end = Vec::with_capacity(spans.len());
        let mut end = 0;
        for span in &spans {
            below_end.push(end);
            end = end.max(span.as_ref().map_or(0, |s| s.end));
        }
        let mut after_layer = vec![None; spans.len()];
        let (mut top, mut cap) = (graph.param_len, values(FIRST_BUCKET_BYTES.min(cap_bytes)));
        let mut final_from = graph.param_len;
        for i in (0..spans.len()).rev() {
            if let Some(span) = &spans[i] {
                final_from = final_from.min(span.start);
            }
            let ready = below_end[i] <= final_from && final_from < top;
            if ready && (top - final_from >= cap || i == 0) {
                after_layer[i] = Some(final_from..top);
                top = final_from;
                cap = values(cap_bytes);
            }
        }
        debug_assert_eq!(top, 0, "the buckets cover every parameter");
        GradBuckets { after_layer }
    }

    /// The bucket that is final once layer `i`'s backward is done, if any.
    pub fn after_layer(&self, i: usize) -> Option<Range<usize>> {
        self.after_layer.get(i).cloned().flatten()
    }

    /// Every bucket, in the order the backward pass completes them (from the buffer's end).
    pub fn in_backward_order(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        self.after_layer.iter().rev().flatten().cloned()
    }

    /// The number of buckets.
    pub fn len(&self) -> usize {
        self.after_layer.iter().flatten().count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::DataShape;
    use crate::spec::JobSpec;

    fn graph(layers: &str, sample: Vec<usize>) -> Graph {
        let spec: JobSpec = toml::from_str(&format!(
            "[data]\nsource = \"synthetic\"\n[model]\nlayers = [{layers}]\n\
             [optimizer]\ntype = \"sgd\"\nlr = 0.1\n"
        ))
        .unwrap();
        let shape = DataShape {
            sample_shape: sample,
            classes: Some(10),
            classes_from: None,
            target_dim: 1,
        };
        Graph::build(&spec, &shape).unwrap()
    }

    /// 784-1024-1024-10: 803,840 + 1,049,600 + 10,250 parameters.
    fn mlp() -> Graph {
        graph(
            "{ type = \"linear\", out = 1024 }, { type = \"relu\" }, \
             { type = \"linear\", out = 1024 }, { type = \"relu\" }, \
             { type = \"linear\", out = 10 }",
            vec![784],
        )
    }

    #[test]
    fn buckets_tile_the_buffer_from_its_end_at_layer_boundaries() {
        let g = mlp();
        let n = g.param_len;
        assert_eq!(n, 803_840 + 1_049_600 + 10_250);
        // DDP's defaults: the first bucket fills at 1 MiB (262,144 values), so it takes the
        // last two linear layers; the rest fits in 25 MiB and ends at the first layer.
        let b = GradBuckets::new(&g, 25 << 20);
        let buckets: Vec<_> = b.in_backward_order().collect();
        assert_eq!(buckets, vec![803_840..n, 0..803_840]);
        assert_eq!(b.after_layer(2), Some(803_840..n));
        assert_eq!(b.after_layer(0), Some(0..803_840));
        assert_eq!(b.after_layer(4), None);
        // Small buckets: one per layer with parameters, relu layers end none.
        let b = GradBuckets::new(&g, 4);
        let buckets: Vec<_> = b.in_backward_order().collect();
        assert_eq!(buckets, vec![1_853_440..n, 803_840..1_853_440, 0..803_840]);
        assert_eq!((b.after_layer(1), b.after_layer(3)), (None, None));
        // One bucket when the cap exceeds the model.
        let b = GradBuckets::new(&g, 1 << 40);
        assert_eq!(b.len(), 2, "the 1 MiB first bucket still comes first");
    }

    #[test]
    fn a_graph_with_branches_still_covers_every_parameter_once() {
        let g = graph(
            "{ type = \"conv2d\", out = 4, kernel_size = 3, padding = 1, name = \"a\" }, \
             { type = \"batchnorm2d\" }, { type = \"relu\" }, \
             { type = \"conv2d\", out = 4, kernel_size = 3, padding = 1, name = \"c\" }, \
             { type = \"add\", inputs = [\"c\", \"a\"] }, { type = \"flatten\" }, \
             { type = \"linear\", out = 10 }",
            vec![1, 6, 6],
        );
        for cap in [4, 64, 1 << 20] {
            let b = GradBuckets::new(&g, cap);
            let mut covered = vec![0u8; g.param_len];
            let mut previous_start = g.param_len;
            for r in b.in_backward_order() {
                assert_eq!(
                    r.end, previous_start,
                    "buckets are adjacent, from the end down"
                );
                previous_start = r.start;
                covered[r].iter_mut().for_each(|c| *c += 1);
            }
            assert!(covered.iter().all(|&c| c == 1), "cap {cap}");
        }
    }
}
