//! position_embedding on CUDA: the kernels of position_embedding.cu.

use super::Kernels;
use crate::tensor::cuda::{grid, CudaBackend, CudaBuf, Launch};

impl Kernels for CudaBackend {
    fn position_embedding_forward(
        &self,
        x: &CudaBuf,
        params: &CudaBuf,
        w: usize,
        y: &mut CudaBuf,
        n: usize,
        len: usize,
    ) {
        if !self.all_f32("position embedding", &[params]) {
            return;
        }
        let (xs, ys, n64, len64) = (x.storage(), y.storage(), n as u64, len as u64);
        let table = params.mem.slice(w..w + len);
        let mut l = Launch::new(self.stream(), self.kernel("position_embedding_forward"));
        l.arg(&x.mem).arg(&xs).arg(&table).arg(&mut y.mem).arg(&ys);
        l.arg(&n64).arg(&len64);
        // SAFETY: grid-stride over the n·len values.
        self.launch("position embedding", unsafe { l.launch(grid(n * len)) });
    }

    fn position_embedding_backward(
        &self,
        dy: &CudaBuf,
        grads: &mut CudaBuf,
        w: usize,
        n: usize,
        len: usize,
    ) {
        if !self.all_f32("position embedding backward", &[grads]) {
            return;
        }
        let (dys, n64, len64) = (dy.storage(), n as u64, len as u64);
        let mut table = grads.mem.slice_mut(w..w + len);
        let mut l = Launch::new(self.stream(), self.kernel("position_embedding_backward"));
        l.arg(&dy.mem)
            .arg(&dys)
            .arg(&mut table)
            .arg(&n64)
            .arg(&len64);
        // SAFETY: grid-stride over the table's len values.
        self.launch("position embedding backward", unsafe {
            l.launch(grid(len))
        });
    }
}
