//! rotary on CUDA: the kernels of rotary.cu, which compute their cosines and sines where
//! they need them (no table).

use super::{Kernels, Rotation};
use crate::tensor::cuda::{grid, CudaBackend, CudaBuf, Launch};

impl Kernels for CudaBackend {
    fn rotary(
        &self,
        x: &CudaBuf,
        y: &mut CudaBuf,
        _: &mut CudaBuf,
        n: usize,
        r: &Rotation,
        position: usize,
        inverse: bool,
    ) {
        let (xs, ys, inverse) = (x.storage(), y.storage(), inverse as i32);
        let a = Args::new(n, r, position);
        let mut l = Launch::new(self.stream(), self.kernel("rotary"));
        l.arg(&x.mem).arg(&xs).arg(&mut y.mem).arg(&ys);
        a.push(&mut l).arg(&inverse);
        // SAFETY: reads and writes the n·T rows of queries, keys and values.
        self.launch("rotary", unsafe { l.launch(grid(a.pairs())) });
    }

    fn rotary_in_place(
        &self,
        buf: &mut CudaBuf,
        _: &mut CudaBuf,
        n: usize,
        r: &Rotation,
        position: usize,
    ) {
        let s = buf.storage();
        let a = Args::new(n, r, position);
        let mut l = Launch::new(self.stream(), self.kernel("rotary_in_place"));
        l.arg(&mut buf.mem).arg(&s);
        a.push(&mut l);
        // SAFETY: reads and writes the queries and keys of n·T rows.
        self.launch("rotary", unsafe { l.launch(grid(a.pairs())) });
    }
}

/// The kernels' arguments after their buffers, as they take them.
struct Args {
    rows: u64,
    len: u64,
    /// The queries' and the keys' heads.
    turned: i32,
    kv_heads: i32,
    head_dim: i32,
    theta: f32,
    /// Llama3Scaling's factor (0 for none), low and high factors and original context.
    stretch: [f32; 4],
    position: u64,
}

impl Args {
    fn new(n: usize, r: &Rotation, position: usize) -> Self {
        Args {
            rows: (n * r.len) as u64,
            len: r.len as u64,
            turned: (r.heads + r.kv_heads) as i32,
            kv_heads: r.kv_heads as i32,
            head_dim: r.head_dim as i32,
            theta: r.theta,
            stretch: r.scaling.map_or([0.0; 4], |s| {
                [
                    s.factor,
                    s.low_freq_factor,
                    s.high_freq_factor,
                    s.original_context,
                ]
            }),
            position: position as u64,
        }
    }

    /// One thread for each turned pair, half a row's queries and keys.
    fn pairs(&self) -> usize {
        (self.rows * self.turned as u64 * self.head_dim as u64 / 2) as usize
    }

    fn push<'l, 'a>(&'a self, l: &'l mut Launch<'a>) -> &'l mut Launch<'a> {
        l.arg(&self.rows).arg(&self.len).arg(&self.turned);
        l.arg(&self.kv_heads).arg(&self.head_dim).arg(&self.theta);
        let [factor, low, high, original] = &self.stretch;
        l.arg(factor).arg(low).arg(high).arg(original);
        l.arg(&self.position)
    }
}
