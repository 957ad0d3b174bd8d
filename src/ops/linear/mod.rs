//! linear: y = x Wᵀ + b over the last axis, as PyTorch's nn.Linear (a sample of [..., in]
//! is `rows` rows of `in` values).
//! Its backend code lives here too: `cpu.rs`, `cuda.rs` (cuBLAS products; the bias kernels
//! are shared ones).

mod cpu;
mod cuda;

use super::Flops;
use super::{
    numel, Backward, Build, Checks, Compute, Dx, Engine, Forward, Init, OpKind, ParamTensor,
};
use super::{Op, Properties, SavedState, Scratch};
use crate::error::Result;
use crate::tensor::{Activation, Backend, GradWrite};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::ops::Range;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LinearSpec {
    /// Output features.
    #[schemars(range(min = 1, max = 2147483647))]
    pub out: usize,
    /// Input features; inferred from the previous layer, checked when given.
    #[serde(default, rename = "in", skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 2147483647))]
    pub in_features: Option<usize>,
    #[serde(default = "yes")]
    pub bias: bool,
    /// Use this earlier embedding layer's table as the weight (weight tying, as GPT-2's
    /// output layer shares the token embedding): its [num_embeddings, embedding_dim] must
    /// be [out, in]. The matrix is counted once; its gradient is the sum of both uses.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tied_to: Option<String>,
}

fn yes() -> bool {
    true
}

impl LinearSpec {
    pub(super) fn check(&self, c: &mut Checks) {
        c.size("out", self.out, 1);
        if let Some(n) = self.in_features {
            c.size("in", n, 1);
        }
    }
}

/// Parameters at `weight` ([out, inp] row-major) and `bias` (out) in the flat buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct Linear {
    pub inp: usize,
    pub out: usize,
    /// Rows per sample: the product of the input's leading dimensions.
    pub rows: usize,
    pub weight: usize,
    pub bias: Option<usize>,
}

pub fn build(spec: &LinearSpec, at: &mut Build) -> Result<(Op, Vec<usize>)> {
    let (&inp, leading) = at.in_shape().split_last().expect("a shape has an axis");
    let leading = leading.to_vec();
    if let Some(given) = spec.in_features {
        if given != inp {
            let why = format!("in = {given} given, but the previous layer outputs {inp} features");
            return Err(at.error("linear", why));
        }
    }
    let weight = match &spec.tied_to {
        Some(name) => tied_weight(name, (spec.out, inp), at)?,
        None => at.reserve(inp * spec.out),
    };
    let bias = spec.bias.then(|| at.reserve(spec.out));
    let mut out_shape = leading.clone();
    out_shape.push(spec.out);
    let rows = numel(&leading);
    let op = Linear {
        inp,
        out: spec.out,
        rows,
        weight,
        bias,
    };
    Ok((Op::Linear(op), out_shape))
}

/// The offset of the table of embedding layer `name`, which must be [out, inp].
fn tied_weight(name: &str, (out, inp): (usize, usize), at: &Build) -> Result<usize> {
    let fail = |why: String| Err(at.error("linear", format!("tied_to = \"{name}\": {why}")));
    let Some(op) = at.layer_named(name) else {
        return fail("no earlier layer has that name".into());
    };
    let Op::Embedding(table) = op else {
        return fail("that layer is not an embedding, whose table a weight is tied to".into());
    };
    if (table.vocab, table.dim) != (out, inp) {
        return fail(format!(
            "its table is [{}, {}], but this layer's weight is [out, in] = [{out}, {inp}]",
            table.vocab, table.dim
        ));
    }
    Ok(table.weight)
}

/// The backend's side of linear: a CPU and a CUDA implementation, in this folder.
pub trait Kernels: Backend {
    /// y[n, out] = then(x[n, inp] · Wᵀ (+ b)), with W = params[w..] as [out, inp] row-major,
    /// b = params[b..] of length out, and `then` an activation applied in place afterwards
    /// (`activation_in_place`), or in the product's own pass where the backend can.
    #[allow(clippy::too_many_arguments)]
    fn linear_forward(
        &self,
        x: &Self::Buf,
        params: &Self::Buf,
        w: usize,
        b: Option<usize>,
        y: &mut Self::Buf,
        n: usize,
        inp: usize,
        out: usize,
        then: Option<Activation>,
    );

    /// grads[W] += dyᵀ·x, grads[b] += Σₙ dy (both = with `GradWrite::Overwrite`), and
    /// dx = dy·W when `dx` is given.
    #[allow(clippy::too_many_arguments)]
    fn linear_backward(
        &self,
        x: &Self::Buf,
        dy: &Self::Buf,
        params: &Self::Buf,
        grads: &mut Self::Buf,
        dw_write: GradWrite,
        w: usize,
        b: Option<usize>,
        dx: Option<&mut Self::Buf>,
        n: usize,
        inp: usize,
        out: usize,
    );
}

impl OpKind for Linear {
    fn properties(&self) -> Properties {
        Properties {
            writes_in_place: false,
            backward_reads_input: true,
            backward_reads_output: false,
            forward_keeps_half: false,
            is_view: false,
            activation: None,
            applies_relu_after: true,
            takes_gradient_through_relu: false,
            multiplies_input: true,
            rounds_dx_after: true,
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
        // kaiming_uniform(a = √5) gives ±1/√fan_in; the bias uses the same bound.
        let init = Init::Uniform(1.0 / (self.inp as f64).sqrt());
        let weight = ParamTensor {
            name: "weight",
            shape: vec![self.out, self.inp],
            offset: self.weight,
            init,
        };
        let bias = self.bias.map(|offset| ParamTensor {
            name: "bias",
            shape: vec![self.out],
            offset,
            init,
        });
        std::iter::once(weight).chain(bias).collect()
    }
    fn written_params(&self) -> Vec<Range<usize>> {
        let weight = self.weight..self.weight + self.inp * self.out;
        let bias = self.bias.map(|b| b..b + self.out);
        std::iter::once(weight).chain(bias).collect()
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
        // Each output value is a dot product of the input row's features.
        Flops::product(numel(out) * self.inp)
    }
}

impl<B: Engine> Compute<B> for Linear {
    fn forward(&self, f: &mut Forward<'_, B>) {
        let (backend, m) = (f.backend, f.n * self.rows);
        // The ReLU after it, which it applies (`Fusion::by_product`).
        let then = f.relu_after.then_some(Activation::Relu);
        let io = f.io();
        let (inp, out, w, b) = (self.inp, self.out, self.weight, self.bias);
        backend.linear_forward(io.x, io.weights, w, b, io.y, m, inp, out, then);
    }

    fn backward(&self, b: &mut Backward<'_, B>) -> Dx {
        let (backend, m, dw) = (b.backend, b.n * self.rows, b.dw);
        let g = b.io();
        let (inp, out, w, bias) = (self.inp, self.out, self.weight, self.bias);
        backend.linear_backward(
            g.x, g.dy, g.weights, g.grads, dw, w, bias, g.dx, m, inp, out,
        );
        Dx::Written { exact: false }
    }
}
