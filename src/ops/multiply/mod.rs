//! multiply: the elementwise product of two inputs of one shape, as `a * b` in PyTorch. With
//! silu it makes the gated MLP of Llama (SwiGLU): `down(silu(gate(x)) * up(x))`.
//! Its kernels live here too: `cpu.rs`, `cuda.rs`, `multiply.cu`.

mod cpu;
mod cuda;

use super::Flops;
use super::{round, shape_str, Backward, Build, Compute, Dx, Engine, Forward, NoSettings, Op};
use super::{OpKind, ParamTensor, Properties, SavedState, Scratch};
use crate::error::Result;
use crate::tensor::Backend;
use std::ops::Range;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Multiply;

pub fn build(_: &NoSettings, at: &mut Build) -> Result<(Op, Vec<usize>)> {
    let [a, b] = at.in_shapes[..] else {
        unreachable!("the wiring gives multiply exactly two inputs")
    };
    if a != b {
        let why = format!(
            "its two inputs must have the same shape, but they are {} and {}",
            shape_str(a),
            shape_str(b)
        );
        return Err(at.error("multiply", why));
    }
    Ok((Op::Multiply(Multiply), a.to_vec()))
}

/// The backend's side of multiply: a CPU and a CUDA implementation, in this folder.
pub trait Kernels: Backend {
    /// y = a · b, elementwise over `len` values.
    fn multiply(&self, a: &Self::Buf, b: &Self::Buf, y: &mut Self::Buf, len: usize);

    /// da = dy · b, one input's gradient from the other input; with `add`, added to what da
    /// holds (an input that other layers read too).
    fn multiply_backward(
        &self,
        dy: &Self::Buf,
        other: &Self::Buf,
        dx: &mut Self::Buf,
        len: usize,
        add: bool,
    );
}

impl OpKind for Multiply {
    fn properties(&self) -> Properties {
        Properties {
            writes_in_place: false,
            backward_reads_input: true,
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
        // One product a value forward, one per input in backward.
        Flops::per_value(out, 1.0, 2.0)
    }
}

impl<B: Engine> Compute<B> for Multiply {
    /// The executor rounds y in mixed precision, as autocast's bf16 product rounds.
    fn forward(&self, f: &mut Forward<'_, B>) {
        let (backend, len) = (f.backend, f.out_len);
        let (a, b, y) = f.two_inputs_and_output();
        backend.multiply(a, b, y, len);
    }

    /// Each input's gradient is dy times the other input. In mixed precision it is rounded
    /// after each write: a product added to another layer's gradient is rounded once, where
    /// PyTorch rounds the product and then the sum.
    fn backward(&self, b: &mut Backward<'_, B>) -> Dx {
        let (backend, len, half) = (b.backend, b.out_len, b.half);
        for k in 0..2 {
            let other = b.input(1 - k);
            if let Some((dy, dx, add)) = b.dy_and_input_grad(k) {
                backend.multiply_backward(dy, other, dx, len, add);
                round(backend, half, dx, len);
            }
        }
        Dx::Done
    }
}
