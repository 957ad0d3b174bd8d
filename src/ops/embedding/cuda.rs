//! embedding on CUDA: the kernels of embedding.cu.

use super::Kernels;
use crate::tensor::cuda::{grid, CudaBackend, CudaBuf, CudaIds, Launch};

impl Kernels for CudaBackend {
    fn embedding_forward(
        &self,
        ids: &CudaIds,
        params: &CudaBuf,
        w: usize,
        y: &mut CudaBuf,
        count: usize,
        dim: usize,
    ) {
        if !self.all_f32("embedding", &[params]) {
            return;
        }
        let (c, d, ys) = (count as u64, dim as u64, y.storage());
        let table = params.mem.slice(w..);
        let mut l = Launch::new(self.stream(), self.kernel("embedding_forward"));
        l.arg(&ids.mem).arg(&table).arg(&mut y.mem).arg(&ys);
        l.arg(&c).arg(&d);
        // SAFETY: ids were checked to lie in [0, vocab) before training.
        self.launch("embedding", unsafe { l.launch(grid(count * dim)) });
    }

    fn embedding_backward(
        &self,
        ids: &CudaIds,
        dy: &CudaBuf,
        grads: &mut CudaBuf,
        w: usize,
        count: usize,
        dim: usize,
    ) {
        if !self.all_f32("embedding backward", &[grads]) {
            return;
        }
        let (c, d, dys) = (count as u64, dim as u64, dy.storage());
        let mut table = grads.mem.slice_mut(w..);
        let mut l = Launch::new(self.stream(), self.kernel("embedding_backward"));
        l.arg(&ids.mem).arg(&dy.mem).arg(&dys).arg(&mut table);
        l.arg(&c).arg(&d);
        // SAFETY: as in embedding_forward.
        self.launch("embedding backward", unsafe { l.launch(grid(dim)) });
    }
}
