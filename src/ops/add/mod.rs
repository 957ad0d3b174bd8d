//! add: the elementwise sum of two or more inputs of one shape (residual connections).

use super::Flops;
use super::{round, shape_str, Backward, Build, Compute, Dx, Forward, NoSettings, Op, OpKind};
use super::{ParamTensor, Properties, SavedState, Scratch};
use crate::error::Result;
use crate::tensor::Backend;
use std::ops::Range;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Add;

pub fn build(_: &NoSettings, at: &mut Build) -> Result<(Op, Vec<usize>)> {
    let first = at.in_shape();
    if let Some(other) = at.in_shapes.iter().find(|s| **s != first) {
        let why = format!(
            "its inputs must have the same shape, but they are {} and {}",
            shape_str(first),
            shape_str(other)
        );
        return Err(at.error("add", why));
    }
    Ok((Op::Add(Add), first.to_vec()))
}

impl OpKind for Add {
    fn properties(&self) -> Properties {
        Properties {
            writes_in_place: true,
            backward_reads_input: false,
            backward_reads_output: false,
            forward_keeps_half: false,
            is_view: false,
            activation: None,
            applies_relu_after: false,
            takes_gradient_through_relu: false,
            multiplies_input: false,
            rounds_dx_after: false,
            token_vocab: None,
            draws_masks: false,
            one_value_per_channel: false,
            one_position_at_a_time: true,
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

    fn flops(&self, _: &[usize], out: &[usize]) -> Flops {
        Flops::per_value(out, 1.0, 0.0)
    }
}

impl<B: Backend> Compute<B> for Add {
    /// The first input is in the output buffer already when it runs in place. In mixed
    /// precision each sum is rounded, as PyTorch rounds a + b + c in bf16 twice (and as a
    /// half-width buffer rounds every write); the last by the executor's rounding.
    fn forward(&self, f: &mut Forward<'_, B>) {
        let (backend, len, half, count) = (f.backend, f.out_len, f.half, f.inputs());
        if !f.in_place {
            let (x, y) = f.input_and_output(0);
            backend.copy(x, y, len);
        }
        for k in 1..count {
            let (x, y) = f.input_and_output(k);
            backend.add_assign(x, y, len);
            if k + 1 < count {
                round(backend, half, y, len);
            }
        }
    }

    /// All of dy to each input, added where an input is read by other layers too.
    fn backward(&self, b: &mut Backward<'_, B>) -> Dx {
        let (backend, n, half, width) = (b.backend, b.n, b.half, b.sample_len);
        for k in 0..b.inputs() {
            if let Some((dy, dx, add)) = b.dy_and_input_grad(k) {
                backend.copy_rows(dy, (width, 0), dx, (width, 0), width, n, add);
                if add {
                    round(backend, half, dx, n * width);
                }
            }
        }
        Dx::Done
    }
}
