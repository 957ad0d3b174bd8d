//! rotary: rotary position embedding (RoPE), as Llama applies it to queries and keys before
//! attention. A sample of [T, C + 2·C_kv] holds each position's queries, keys and values side
//! by side, as attention reads them (C_kv = C unless `kv_heads` is given). In each head of d
//! values, pair (i, i + d/2) of the query and of the key turns by the angle p·θ^(−2i/d) at
//! position p: Hugging Face's `rotate_half` convention. Values pass unchanged. `scaling`
//! stretches the frequencies θ^(−2i/d) as Llama 3.1 does.
//! Its kernels live here too: `cpu.rs`, `cuda.rs`, `rotary.cu`.

mod cpu;
mod cuda;

use super::Flops;
use super::{Backward, Build, Checks, Compute, Dx, Engine, Forward, Op, OpKind};
use super::{ParamTensor, Properties, SavedState, Scratch};
use crate::error::Result;
use crate::tensor::Backend;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::ops::Range;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RotarySpec {
    /// Attention heads, as the attention layer after it has (checked); they split the width
    /// C evenly, into heads of an even number of values.
    #[schemars(range(min = 1, max = 2147483647))]
    pub heads: usize,
    /// Key heads, as the attention layer after it has (checked). Default: as many as `heads`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 2147483647))]
    pub kv_heads: Option<usize>,
    /// The base θ of the angles: Llama's `rope_theta`. Default 10000.
    #[serde(default = "default_theta")]
    #[schemars(extend("exclusiveMinimum" = 1))]
    pub theta: f64,
    /// Frequencies stretched for a longer context, as Hugging Face's `rope_scaling`. Default:
    /// none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scaling: Option<ScalingSpec>,
}

/// How the frequencies stretch, by `type`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ScalingSpec {
    /// Llama 3.1's: frequencies whose wavelength is past original_max_position_embeddings /
    /// low_freq_factor are divided by `factor`; those below original_max_position_embeddings
    /// / high_freq_factor stay; those between blend the two.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        #[schemars(range(min = 1, max = 2147483647))]
        original_max_position_embeddings: usize,
    },
}

/// Llama 3.1's stretch of the frequencies (`ScalingSpec::Llama3`), in f32 as Hugging Face's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_context: f32,
}

impl Llama3Scaling {
    /// The stretched frequency of `f`, in the order of operations of transformers'
    /// `_compute_llama3_parameters`.
    pub fn stretch(&self, f: f32) -> f32 {
        let low_wavelen = self.original_context / self.low_freq_factor;
        let high_wavelen = self.original_context / self.high_freq_factor;
        let wavelen = (2.0 * std::f64::consts::PI) as f32 / f;
        let divided = match wavelen > low_wavelen {
            true => f / self.factor,
            false => f,
        };
        let smooth = (self.original_context / wavelen - self.low_freq_factor)
            / (self.high_freq_factor - self.low_freq_factor);
        // transformers' !(w < high) & !(w > low): the same for finite wavelengths.
        let medium = (high_wavelen..=low_wavelen).contains(&wavelen);
        match medium {
            true => (1.0 - smooth) * divided / self.factor + smooth * divided,
            false => divided,
        }
    }
}

fn default_theta() -> f64 {
    10_000.0
}

impl RotarySpec {
    pub(super) fn check(&self, c: &mut Checks) {
        c.size("heads", self.heads, 1);
        super::attention::check_kv_heads(c, self.heads, self.kv_heads);
        let message = format!("{} given; must be a finite number above 1", self.theta);
        c.check(self.theta.is_finite() && self.theta > 1.0, "theta", message);
        if let Some(ScalingSpec::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) = self.scaling
        {
            let message = format!(
                "factor = {factor}, low_freq_factor = {low_freq_factor}, high_freq_factor = \
                 {high_freq_factor}, original_max_position_embeddings = \
                 {original_max_position_embeddings} given; the factor must be at least 1, the \
                 low frequencies' factor positive and below the high ones', and the original \
                 positions at least 1"
            );
            let finite = [factor, low_freq_factor, high_freq_factor].map(f64::is_finite);
            let ok = finite.iter().all(|&f| f)
                && factor >= 1.0
                && low_freq_factor > 0.0
                && high_freq_factor > low_freq_factor
                && original_max_position_embeddings >= 1;
            c.check(ok, "scaling", message);
        }
    }
}

/// What the kernels need: the sequence length, the query and key heads and their width,
/// and θ.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rotation {
    pub len: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub theta: f32,
    pub scaling: Option<Llama3Scaling>,
}

impl Rotation {
    /// The values of one position: queries, keys and values.
    pub fn row_len(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }

    /// The values it turns at the start of a row: the queries and the keys.
    pub fn turned_len(&self) -> usize {
        (self.heads + self.kv_heads) * self.head_dim
    }

    /// The table of the CPU's cosines and sines: d/2 of each for each position.
    pub fn table_len(&self) -> usize {
        self.len * self.head_dim
    }

    /// Angle i's frequency θ^(−2i/d), stretched by the scaling, in f32 as Hugging Face's
    /// `inv_freq`.
    pub fn frequency(&self, i: usize) -> f32 {
        let f = 1.0 / self.theta.powf((2 * i) as f32 / self.head_dim as f32);
        self.scaling.map_or(f, |s| s.stretch(f))
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rotary {
    pub rotation: Rotation,
}

pub fn build(spec: &RotarySpec, at: &mut Build) -> Result<(Op, Vec<usize>)> {
    let kv_heads = spec.kv_heads.unwrap_or(spec.heads);
    let (len, head_dim) = super::attention::qkv_shape("rotary", at, spec.heads, kv_heads)?;
    if !head_dim.is_multiple_of(2) {
        let why = format!(
            "its heads are {head_dim} values wide: it turns pairs of values, so a head's width \
             must be even"
        );
        return Err(at.error("rotary", why));
    }
    let rotation = Rotation {
        len,
        heads: spec.heads,
        kv_heads,
        head_dim,
        theta: spec.theta as f32,
        scaling: spec.scaling.as_ref().map(
            |ScalingSpec::Llama3 {
                 factor,
                 low_freq_factor,
                 high_freq_factor,
                 original_max_position_embeddings,
             }| Llama3Scaling {
                factor: *factor as f32,
                low_freq_factor: *low_freq_factor as f32,
                high_freq_factor: *high_freq_factor as f32,
                original_context: *original_max_position_embeddings as f32,
            },
        ),
    };
    let row_len = rotation.row_len();
    Ok((Op::Rotary(Rotary { rotation }), vec![len, row_len]))
}

/// The backend's side of rotary: a CPU and a CUDA implementation, in this folder.
pub trait Kernels: Backend {
    /// y = x with the queries and keys of n samples turned, the first position at
    /// `position`; `inverse` turns them back, which is backward (the transpose of a
    /// rotation is its inverse). The CPU keeps each position's cosines and sines in
    /// `workspace` (`Rotation::table_len`); CUDA computes them where it needs them.
    #[allow(clippy::too_many_arguments)]
    fn rotary(
        &self,
        x: &Self::Buf,
        y: &mut Self::Buf,
        workspace: &mut Self::Buf,
        n: usize,
        rotation: &Rotation,
        position: usize,
        inverse: bool,
    );

    /// `rotary` forward, writing over its input.
    fn rotary_in_place(
        &self,
        buf: &mut Self::Buf,
        workspace: &mut Self::Buf,
        n: usize,
        rotation: &Rotation,
        position: usize,
    );
}

impl OpKind for Rotary {
    fn properties(&self) -> Properties {
        Properties {
            // Backward reads neither its input nor its output: the turn is linear.
            writes_in_place: true,
            backward_reads_input: false,
            backward_reads_output: false,
            forward_keeps_half: false,
            is_view: false,
            activation: None,
            applies_relu_after: false,
            takes_gradient_through_relu: false,
            multiplies_input: false,
            rounds_dx_after: true,
            token_vocab: None,
            draws_masks: false,
            one_value_per_channel: false,
            one_position_at_a_time: true,
            attention: None,
            layer_norm_eps: None,
            rms_norm_eps: None,
            rotary: Some(self.rotation),
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
        Some(self.rotation.table_len())
    }

    fn flops(&self, _: &[usize], out: &[usize]) -> Flops {
        // Three operations for each query and key value, two thirds of the output (more
        // with fewer key heads); none for the values: about two a value, forward and
        // backward.
        Flops::per_value(out, 2.0, 2.0)
    }
}

impl<B: Engine> Compute<B> for Rotary {
    fn forward(&self, f: &mut Forward<'_, B>) {
        let (backend, n, r, position) = (f.backend, f.n, &self.rotation, f.position);
        if f.in_place {
            let (buf, workspace) = f.output_and_workspace();
            backend.rotary_in_place(buf, workspace, n, r, position);
            return;
        }
        let io = f.io();
        backend.rotary(io.x, io.y, io.workspace, n, r, position, false);
    }

    fn backward(&self, b: &mut Backward<'_, B>) -> Dx {
        let (backend, n, r) = (b.backend, b.n, &self.rotation);
        let g = b.io();
        if let Some(dx) = g.dx {
            // Only training runs backward, whose sequences start at position 0.
            backend.rotary(g.dy, dx, g.workspace, n, r, 0, true);
        }
        Dx::Written { exact: false }
    }
}
