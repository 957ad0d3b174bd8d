//! attention: multi-head scaled dot-product attention, causal by default, as in nanoGPT's
//! CausalSelfAttention between its two projections. A sample of [T, 3·C] holds each
//! position's query, key and value side by side (a `linear` layer of 3·C outputs makes them);
//! the output is [T, C], the heads side by side (a `linear` layer of C outputs after it is
//! the output projection). With `kv_heads` below `heads` (grouped-query attention) a
//! position holds fewer keys and values than queries, [T, C + 2·C_kv], and each key and value
//! head serves heads / kv_heads query heads in turn.
//! Its kernels live here too: `cpu.rs`, `cuda.rs`, `attention.cu`.

pub mod cpu;
mod cuda;
mod decode;

pub use cuda::workspace_len as cuda_workspace_len;

use super::Flops;
use super::Pass;
use super::{shape_str, Backward, Build, Checks, Compute, Dx, Engine, Forward, Mask, Op, OpKind};
use super::{ParamTensor, Properties, SavedState, Scratch};
use crate::error::Result;
use crate::tensor::{Attention as Shape, Backend};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::ops::Range;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AttentionSpec {
    /// Attention heads; they split the width C evenly.
    #[schemars(range(min = 1, max = 2147483647))]
    pub heads: usize,
    /// Key and value heads, each shared by heads / kv_heads query heads: grouped-query
    /// attention, as in Llama 3 and Mistral. The input then holds heads + 2·kv_heads heads
    /// a position. Default: as many as `heads`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 2147483647))]
    pub kv_heads: Option<usize>,
    /// Each position attends to itself and earlier positions only (a language model's
    /// mask). Default true.
    #[serde(default = "yes")]
    pub causal: bool,
    /// Dropout on the attention probabilities in training, in [0, 1): nanoGPT's
    /// `attn_dropout`. Default 0.
    #[serde(default)]
    #[schemars(range(min = 0), extend("exclusiveMaximum" = 1))]
    pub dropout: f64,
}

/// The widest head `device.flash_attention` takes (its CUDA kernels keep a row in registers).
pub const MAX_FLASH_HEAD_DIM: usize = 128;

fn yes() -> bool {
    true
}

/// `kv_heads`, where given, is at least 1 and divides `heads`.
pub(super) fn check_kv_heads(c: &mut Checks, heads: usize, kv_heads: Option<usize>) {
    if let Some(kv) = kv_heads {
        let message = format!("{kv} given; must divide heads = {heads}");
        c.check(kv >= 1 && heads.is_multiple_of(kv), "kv_heads", message);
    }
}

impl AttentionSpec {
    pub(super) fn check(&self, c: &mut Checks) {
        c.size("heads", self.heads, 1);
        check_kv_heads(c, self.heads, self.kv_heads);
        let message = format!("{} given; must be in [0, 1)", self.dropout);
        c.check((0.0..1.0).contains(&self.dropout), "dropout", message);
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Attention {
    pub shape: Shape,
    /// Dropout's probability on the attention probabilities in training.
    pub dropout: f32,
    /// In a model that reads one token a step (`Graph::for_decoding`): the positions its
    /// key/value cache holds.
    pub cache: Option<usize>,
}

/// Dropout on the attention probabilities in one training pass, as nanoGPT's attn_dropout:
/// each is kept with probability 1 − p and then scaled by 1/(1 − p). The mask is drawn again
/// in backward, never stored: probability i of sample b (in [heads, T, T] order) is element
/// `first + b·probs_len + i` of the stream `key`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProbsDropout {
    pub p: f32,
    pub key: u64,
    pub first: u64,
}

impl ProbsDropout {
    /// What element `index` of the stream multiplies its probability by: 0 or 1/(1 − p).
    #[inline]
    pub fn factor(&self, index: u64) -> f32 {
        match crate::tensor::rng::uniform(self.key, self.first + index) >= self.p {
            true => 1.0 / (1.0 - self.p),
            false => 0.0,
        }
    }

    /// The same mask for the samples from `sample` on.
    pub fn from_sample(self, sample: usize, shape: &Shape) -> Self {
        let first = self.first + (sample * shape.probs_len()) as u64;
        ProbsDropout { first, ..self }
    }
}

/// The length and head width of the samples a layer of `kind` reads (attention, rotary):
/// each position's queries (`heads` heads), keys and values (`kv_heads` heads each) side by
/// side, [T, (heads + 2·kv_heads)·head_dim]. Err names what it was given instead.
pub(super) fn qkv_shape(
    kind: &str,
    at: &Build,
    heads: usize,
    kv_heads: usize,
) -> Result<(usize, usize)> {
    let shape = at.in_shape();
    let [len, fused] = shape[..] else {
        let why = format!(
            "it reads [length, 3·width] samples (queries, keys and values side by side, from a \
             linear layer of 3·width outputs), but the previous layer outputs {}",
            shape_str(shape)
        );
        return Err(at.error(kind, why));
    };
    let parts = heads + 2 * kv_heads;
    if kv_heads == heads && fused % 3 != 0 {
        let why = format!(
            "its input's last axis holds queries, keys and values side by side, 3·width values, \
             but it has {fused}, which 3 does not divide"
        );
        return Err(at.error(kind, why));
    }
    if kv_heads == heads && fused % parts != 0 {
        let why = format!("heads = {heads} does not divide the width {}", fused / 3);
        return Err(at.error(kind, why));
    }
    if fused % parts != 0 {
        let why = format!(
            "its input's last axis holds {heads} query heads, then {kv_heads} key and \
             {kv_heads} value heads (kv_heads), {parts} heads of equal width, but it has \
             {fused} values, which {parts} does not divide"
        );
        return Err(at.error(kind, why));
    }
    Ok((len, fused / parts))
}

pub fn build(spec: &AttentionSpec, at: &mut Build) -> Result<(Op, Vec<usize>)> {
    let kv_heads = spec.kv_heads.unwrap_or(spec.heads);
    let rotary = at.input_op.and_then(|op| op.properties().rotary);
    if let Some(r) = rotary.filter(|r| (r.heads, r.kv_heads) != (spec.heads, kv_heads)) {
        let why = format!(
            "the rotary layer before it turns heads = {} and kv_heads = {}, and it has \
             heads = {} and kv_heads = {kv_heads}: give both the same heads",
            r.heads, r.kv_heads, spec.heads
        );
        return Err(at.error("attention", why));
    }
    let (len, head_dim) = qkv_shape("attention", at, spec.heads, kv_heads)?;
    let width = spec.heads * head_dim;
    if at.flash_attention && head_dim > MAX_FLASH_HEAD_DIM {
        let why = format!(
            "device.flash_attention holds a head's {head_dim} values in registers, at most \
             {MAX_FLASH_HEAD_DIM}: use more heads, or device.flash_attention = false"
        );
        return Err(at.error("attention", why));
    }
    let shape = Shape {
        len,
        heads: spec.heads,
        kv_heads,
        head_dim,
        causal: spec.causal,
        // A key/value cache keeps no probabilities either way.
        flash: at.flash_attention && at.decoding.is_none(),
    };
    let dropout = spec.dropout as f32;
    if at.decoding.is_some() && !(len == 1 && spec.causal) {
        let why = "a key/value cache needs causal attention that reads one position a step";
        return Err(at.error("attention", why));
    }
    let cache = at.decoding;
    Ok((
        Op::Attention(Attention {
            shape,
            dropout,
            cache,
        }),
        vec![len, width],
    ))
}

/// The backend's side of attention: a CPU and a CUDA implementation, in this folder.
pub trait Kernels: Backend {
    /// The scratch `attention_forward` and `attention_backward` need for `max_batch` samples.
    fn attention_workspace_len(&self, shape: &Shape, max_batch: usize) -> usize;

    /// y [n, T, C] from qkv [n, T, C + 2·C_kv]: per head, dropout(softmax(q·kᵀ/√d,
    /// masked))·v, with the key and value head that the query head shares.
    /// Keeps the probabilities [n, heads, T, T], before dropout, in `probs` for backward (0
    /// where masked); with `shape.flash`, per sample its y [T, C] in f32 and then each row's
    /// log-sum-exp of its scaled scores [heads, T].
    #[allow(clippy::too_many_arguments)]
    fn attention_forward(
        &self,
        qkv: &Self::Buf,
        y: &mut Self::Buf,
        probs: &mut Self::Buf,
        workspace: &mut Self::Buf,
        n: usize,
        shape: &Shape,
        dropout: Option<ProbsDropout>,
    );

    /// dqkv [n, T, C + 2·C_kv] from dy [n, T, C], the input and the kept probabilities (a
    /// shared key's or value's gradient sums over its query heads); `dropout` as in the
    /// forward pass.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        qkv: &Self::Buf,
        probs: &Self::Buf,
        dy: &Self::Buf,
        dqkv: &mut Self::Buf,
        workspace: &mut Self::Buf,
        n: usize,
        shape: &Shape,
        dropout: Option<ProbsDropout>,
    );
}

impl OpKind for Attention {
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
            rounds_dx_after: true,
            token_vocab: None,
            draws_masks: self.dropout > 0.0,
            one_value_per_channel: false,
            one_position_at_a_time: true,
            attention: Some(self.shape),
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
    fn state_len(&self, _: &[usize], max_batch: usize) -> usize {
        match self.cache {
            Some(positions) => decode::state_len(&self.shape, positions, max_batch),
            // The probabilities, which backward reads; with flash, outputs and log-sum-exps.
            None => max_batch * self.shape.saved_len(),
        }
    }
    fn saved_state(&self) -> Option<SavedState> {
        None
    }
    fn workspace(&self, rules: &Scratch) -> Option<usize> {
        let decoding = self
            .cache
            .map_or(0, |p| decode::workspace_len(&self.shape, p));
        Some((rules.attention)(&self.shape).max(decoding))
    }

    fn flops(&self, _: &[usize], _: &[usize]) -> Flops {
        // Per head, Q·Kᵀ and P·V, each T·T·d multiply-adds over the whole square, as
        // nanoGPT's MFU counts them, though the CPU's bands skip most of the masked half;
        // backward has four such products.
        let s = &self.shape;
        let macs = (2 * s.len * s.len * s.width()) as f64;
        Flops {
            forward: 2.0 * macs,
            backward: 4.0 * macs,
        }
    }
}

impl Attention {
    /// The probabilities' dropout in this pass: none in evaluation or at p = 0.
    fn dropout(&self, pass: Pass, mask: Mask) -> Option<ProbsDropout> {
        (pass != Pass::Eval && self.dropout > 0.0).then(|| ProbsDropout {
            p: self.dropout,
            key: mask.key,
            first: mask.sample * self.shape.probs_len() as u64,
        })
    }
}

impl<B: Engine> Compute<B> for Attention {
    fn forward(&self, f: &mut Forward<'_, B>) {
        let (backend, n, s, position) = (f.backend, f.n, &self.shape, f.position);
        let dropout = self.dropout(f.pass, f.mask);
        let io = f.io();
        match self.cache {
            Some(positions) => {
                let cache = decode::Cache {
                    positions,
                    position,
                };
                decode::forward(backend, io.x, io.y, io.state, io.workspace, n, s, cache);
            }
            None => backend.attention_forward(io.x, io.y, io.state, io.workspace, n, s, dropout),
        }
    }

    fn backward(&self, b: &mut Backward<'_, B>) -> Dx {
        let (backend, n, s) = (b.backend, b.n, &self.shape);
        let dropout = self.dropout(Pass::Train, b.mask);
        let g = b.io();
        if let Some(dx) = g.dx {
            backend.attention_backward(g.x, g.state, g.dy, dx, g.workspace, n, s, dropout);
        }
        Dx::Written { exact: false }
    }
}
