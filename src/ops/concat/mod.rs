//! concat: its inputs joined along the first per-sample dimension (channels for images,
//! features for vectors); the other dimensions must agree.

use super::Flops;
use super::{numel, round, shape_str, Backward, Build, Compute, Dx, Forward, NoSettings, Op};
use super::{OpKind, ParamTensor, Properties, SavedState, Scratch};
use crate::error::Result;
use crate::tensor::Backend;
use std::ops::Range;

/// Input k's `widths[k]` values per sample, side by side in each output sample.
#[derive(Debug, Clone, PartialEq)]
pub struct Concat {
    pub widths: Vec<usize>,
}

pub fn build(_: &NoSettings, at: &mut Build) -> Result<(Op, Vec<usize>)> {
    let shapes = at.in_shapes;
    let first = shapes[0];
    for s in &shapes[1..] {
        let how = if s.len() != first.len() {
            "have different numbers of dimensions; concat joins inputs of the same rank (a \
             flatten or reshape first makes them so)"
        } else if s[1..] != first[1..] {
            "differ in more than their first dimension, the one concat joins"
        } else {
            continue;
        };
        let why = format!("its inputs {} and {} {how}", shape_str(first), shape_str(s));
        return Err(at.error("concat", why));
    }
    let mut out = first.to_vec();
    out[0] = shapes.iter().map(|s| s[0]).sum();
    let widths = shapes.iter().map(|s| numel(s)).collect();
    Ok((Op::Concat(Concat { widths }), out))
}

impl OpKind for Concat {
    fn properties(&self) -> Properties {
        Properties {
            writes_in_place: false,
            backward_reads_input: false,
            backward_reads_output: false,
            // Copies of half values.
            forward_keeps_half: true,
            is_view: false,
            activation: None,
            applies_relu_after: false,
            takes_gradient_through_relu: false,
            multiplies_input: false,
            rounds_dx_after: false,
            token_vocab: None,
            draws_masks: false,
            one_value_per_channel: false,
            one_position_at_a_time: false,
            attention: None,
            layer_norm_eps: None,
            rms_norm_eps: None,
            rotary: None,
        }
    }
    fn parameters(&self) -> Vec<ParamTensor> {
        Vec::new()
    }
    fn written_params(&self) -> Vec<Range<usize>> {
        Vec::new()
    }
    fn state_len(&self, _: &[usize], _: usize) -> usize {
        0
    }
    fn saved_state(&self) -> Option<SavedState> {
        None
    }
    fn workspace(&self, _: &Scratch) -> Option<usize> {
        None
    }

    fn flops(&self, _: &[usize], _: &[usize]) -> Flops {
        // Copies only.
        Flops::per_value(&[], 0.0, 0.0)
    }
}

impl<B: Backend> Compute<B> for Concat {
    fn forward(&self, f: &mut Forward<'_, B>) {
        let (backend, n) = (f.backend, f.n);
        let total: usize = self.widths.iter().sum();
        let mut offset = 0;
        for (k, &width) in self.widths.iter().enumerate() {
            let (x, y) = f.input_and_output(k);
            backend.copy_rows(x, (width, 0), y, (total, offset), width, n, false);
            offset += width;
        }
    }

    /// Input k's columns of dy to it, added where it is read by other layers too.
    fn backward(&self, b: &mut Backward<'_, B>) -> Dx {
        let (backend, n, half, total) = (b.backend, b.n, b.half, b.sample_len);
        let mut offset = 0;
        for (k, &width) in self.widths.iter().enumerate() {
            if let Some((dy, dx, add)) = b.dy_and_input_grad(k) {
                backend.copy_rows(dy, (total, offset), dx, (width, 0), width, n, add);
                if add {
                    round(backend, half, dx, n * width);
                }
            }
            offset += width;
        }
        Dx::Done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn concat(shapes: &[&[usize]]) -> Result<Vec<usize>> {
        let mut offset = 0;
        let mut at = Build {
            key: "model.layers[3]",
            in_shapes: shapes,
            reads_data: false,
            offset: &mut offset,
            named: &[],
            input_op: None,
            decoding: None,
            flash_attention: false,
        };
        build(&NoSettings {}, &mut at).map(|(_, out)| out)
    }

    #[test]
    fn concat_joins_the_first_dimension_and_names_what_else_differs() {
        assert_eq!(concat(&[&[2, 4, 4], &[5, 4, 4]]).unwrap(), [7, 4, 4]);
        let e = concat(&[&[2, 4, 4], &[2, 4, 5]]).unwrap_err().to_string();
        assert!(
            e.contains("differ in more than their first dimension"),
            "{e}"
        );
        let e = concat(&[&[3, 1, 1], &[3]]).unwrap_err().to_string();
        assert!(e.contains("have different numbers of dimensions"), "{e}");
    }
}
