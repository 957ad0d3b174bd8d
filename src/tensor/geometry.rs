//! The geometry of convolutions and pooling windows over [c, h, w] samples: shapes the
//! graph, the memory plan and the kernels share.

use rayon::prelude::*;

/// A 2-D convolution's geometry, for one sample of [c, h, w] into [o, oh, ow].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv2d {
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub o: usize,
    pub kh: usize,
    pub kw: usize,
    pub stride: (usize, usize),
    pub pad: (usize, usize),
    pub dil: (usize, usize),
    pub groups: usize,
}

impl Conv2d {
    /// Output height; None when the kernel does not fit.
    pub fn out_hw(&self) -> Option<(usize, usize)> {
        let span = |size: usize, pad: usize, dil: usize, k: usize, stride: usize| {
            (size + 2 * pad)
                .checked_sub(dil * (k - 1) + 1)
                .map(|d| d / stride + 1)
        };
        Some((
            span(self.h, self.pad.0, self.dil.0, self.kh, self.stride.0)?,
            span(self.w, self.pad.1, self.dil.1, self.kw, self.stride.1)?,
        ))
    }

    pub fn oh_ow(&self) -> (usize, usize) {
        self.out_hw().expect("validated geometry")
    }

    /// Rows of one group's im2col matrix: its input channels times the kernel area.
    pub fn group_rows(&self) -> usize {
        self.c / self.groups * self.kh * self.kw
    }

    /// Elements of one sample's im2col matrix [c·kh·kw, oh·ow].
    pub fn col_len(&self) -> usize {
        let (oh, ow) = self.oh_ow();
        self.c * self.kh * self.kw * oh * ow
    }

    pub fn weight_len(&self) -> usize {
        self.o * self.group_rows()
    }
}

/// Pooling geometry over [c, h, w] planes (PyTorch: stride defaults to the kernel size).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pool2d {
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub k: (usize, usize),
    pub stride: (usize, usize),
    pub pad: (usize, usize),
}

impl Pool2d {
    pub fn out_hw(&self) -> Option<(usize, usize)> {
        let span = |size: usize, pad: usize, k: usize, stride: usize| {
            (size + 2 * pad).checked_sub(k).map(|d| d / stride + 1)
        };
        Some((
            span(self.h, self.pad.0, self.k.0, self.stride.0)?,
            span(self.w, self.pad.1, self.k.1, self.stride.1)?,
        ))
    }

    /// The in-bounds input rows and columns of output (p, q)'s window.
    #[inline]
    pub(crate) fn window(
        &self,
        p: usize,
        q: usize,
    ) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
        let clamp = |start: isize, k: usize, size: usize| {
            let lo = start.max(0) as usize;
            let hi = (start + k as isize).clamp(0, size as isize) as usize;
            lo..hi.max(lo)
        };
        let i0 = (p * self.stride.0) as isize - self.pad.0 as isize;
        let j0 = (q * self.stride.1) as isize - self.pad.1 as isize;
        (clamp(i0, self.k.0, self.h), clamp(j0, self.k.1, self.w))
    }

    /// Runs `f(input plane, output plane)` for each of the n·c planes, in parallel.
    pub(crate) fn planes<A: Sync, B: Send>(
        &self,
        n: usize,
        input: &[A],
        output: &mut [B],
        f: impl Fn(usize, &[A], &mut [B]) + Sync + Send,
    ) {
        let (oh, ow) = self.out_hw().expect("validated geometry");
        let count = n * self.c;
        input[..count * self.h * self.w]
            .par_chunks(self.h * self.w)
            .zip(output[..count * oh * ow].par_chunks_mut(oh * ow))
            .enumerate()
            .for_each(|(plane, (i, o))| f(plane, i, o));
    }
}

impl Pool2d {
    /// Windows that tile the input without overlap or padding (the common 2x2, stride 2):
    /// their rows can be read straight, with no clamping.
    pub(crate) fn tiles(&self) -> bool {
        self.stride == self.k && self.pad == (0, 0)
    }
}

/// Multi-head attention's shape for one sample: `len` positions of `heads` query heads of
/// `head_dim` values (width = heads × head_dim), and `kv_heads` key and value heads, each
/// shared by `heads / kv_heads` query heads (grouped-query attention; as many as the query
/// heads in plain multi-head attention).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attention {
    pub len: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Each position attends to itself and the positions before it only.
    pub causal: bool,
    /// Keeps each row's output and log-sum-exp, not its probabilities: backward computes
    /// them again, as FlashAttention does (`device.flash_attention`).
    pub flash: bool,
}

impl Attention {
    /// The queries' width, and the output's.
    pub fn width(&self) -> usize {
        self.heads * self.head_dim
    }

    /// The keys' width, and the values'.
    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// An input row: its queries, keys and values side by side.
    pub fn qkv_width(&self) -> usize {
        self.width() + 2 * self.kv_width()
    }

    /// The key and value head that query head `h` reads.
    pub fn kv_head(&self, h: usize) -> usize {
        h / (self.heads / self.kv_heads)
    }

    /// The scores' scale, 1/√head_dim (PyTorch's scaled_dot_product_attention).
    pub fn scale(&self) -> f32 {
        (1.0 / (self.head_dim as f64).sqrt()) as f32
    }

    /// The attention probabilities of one sample: heads × len × len.
    pub fn probs_len(&self) -> usize {
        self.heads * self.len * self.len
    }

    /// What one sample keeps for backward: its probabilities, or with `flash` its output
    /// [T, C] and each row's log-sum-exp [heads, T].
    pub fn saved_len(&self) -> usize {
        match self.flash {
            true => self.len * self.width() + self.heads * self.len,
            false => self.probs_len(),
        }
    }

    /// The positions row `i` attends to: 0..=i when causal, else all.
    pub fn attended(&self, i: usize) -> usize {
        if self.causal {
            i + 1
        } else {
            self.len
        }
    }
}
