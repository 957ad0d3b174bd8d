//! flatten and reshape: the input seen with another per-sample shape. A view shares its
//! input's buffers, gradient included, and runs nothing.

use super::Flops;
use super::{numel, shape_str, values, Backward, Build, Checks, Compute, Dx, Forward, Op};
use super::{size_range, NoSettings};
use super::{OpKind, ParamTensor, Properties, SavedState, Scratch, MAX_SIZE};
use crate::error::Result;
use crate::tensor::Backend;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::ops::Range;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReshapeSpec {
    /// The new per-sample shape; one entry may be -1.
    pub shape: Vec<i64>,
}

impl ReshapeSpec {
    pub(super) fn check(&self, c: &mut Checks) {
        if let Some(&d) = self.shape.iter().find(|&&d| d > MAX_SIZE as i64) {
            c.add("shape", format!("{d} given; {}", size_range(1)));
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct View;

pub fn flatten(_: &NoSettings, at: &mut Build) -> Result<(Op, Vec<usize>)> {
    Ok((Op::View(View), vec![numel(at.in_shape())]))
}

pub fn reshape(spec: &ReshapeSpec, at: &mut Build) -> Result<(Op, Vec<usize>)> {
    let in_shape = at.in_shape();
    let total = numel(in_shape);
    let err = || {
        Err(at.error(
            "reshape",
            format!(
                "shape {:?} cannot hold the {total} values of its input {} \
             (at most one -1, every other entry at least 1)",
                spec.shape,
                shape_str(in_shape)
            ),
        ))
    };
    let shape = &spec.shape;
    let inferred = shape.iter().filter(|&&d| d == -1).count();
    if inferred > 1 || shape.iter().any(|&d| d == 0 || d < -1) || shape.is_empty() {
        return err();
    }
    let known: Vec<usize> = shape
        .iter()
        .filter(|&&d| d > 0)
        .map(|&d| d as usize)
        .collect();
    // More than the input holds (as u128: no overflow) never fits.
    let known = match values(&known) {
        n if n > total as u128 => return err(),
        n => n as usize,
    };
    if (inferred == 0 && known != total) || (inferred == 1 && !total.is_multiple_of(known)) {
        return err();
    }
    let shape = shape
        .iter()
        .map(|&d| if d == -1 { total / known } else { d as usize })
        .collect();
    Ok((Op::View(View), shape))
}

impl OpKind for View {
    fn properties(&self) -> Properties {
        Properties {
            writes_in_place: false,
            backward_reads_input: false,
            backward_reads_output: false,
            forward_keeps_half: true,
            is_view: true,
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
        // A view computes nothing.
        Flops::per_value(&[], 0.0, 0.0)
    }
}

impl<B: Backend> Compute<B> for View {
    fn forward(&self, _: &mut Forward<'_, B>) {}

    fn backward(&self, _: &mut Backward<'_, B>) -> Dx {
        Dx::Done // the gradient is in its input's buffer already
    }
}
