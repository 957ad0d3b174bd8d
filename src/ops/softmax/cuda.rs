//! softmax on CUDA: the kernels of softmax.cu, one block per row.

use super::Kernels;
use crate::tensor::cuda::{per_item, CudaBackend, CudaBuf, Launch};

impl Kernels for CudaBackend {
    fn softmax_forward(&self, x: &CudaBuf, y: &mut CudaBuf, rows: usize, width: usize, log: bool) {
        let (xs, ys) = (x.storage(), y.storage());
        let (r, w, log) = (rows as u64, width as u64, i32::from(log));
        let mut l = Launch::new(self.stream(), self.kernel("softmax_forward"));
        l.arg(&x.mem).arg(&xs).arg(&mut y.mem).arg(&ys);
        l.arg(&r).arg(&w).arg(&log);
        // SAFETY: one block per row of width values.
        self.launch("softmax", unsafe { l.launch(per_item(rows)) });
    }

    fn softmax_backward(
        &self,
        y: &CudaBuf,
        dy: &CudaBuf,
        dx: &mut CudaBuf,
        rows: usize,
        width: usize,
        log: bool,
    ) {
        let [ys, dys, dxs] = [y, dy, &*dx].map(CudaBuf::storage);
        let (r, w, log) = (rows as u64, width as u64, i32::from(log));
        let mut l = Launch::new(self.stream(), self.kernel("softmax_backward"));
        l.arg(&y.mem).arg(&ys).arg(&dy.mem).arg(&dys);
        l.arg(&mut dx.mem).arg(&dxs).arg(&r).arg(&w).arg(&log);
        // SAFETY: one block per row of width values.
        self.launch("softmax backward", unsafe { l.launch(per_item(rows)) });
    }
}
