//! dropout on CUDA: the kernels of dropout.cu, the same mask as the CPU's.

use super::Kernels;
use crate::tensor::cuda::{grid_vec, CudaBackend, CudaBuf, Launch};

impl Kernels for CudaBackend {
    fn dropout_forward(
        &self,
        p: f32,
        key: u64,
        first: u64,
        x: &CudaBuf,
        y: &mut CudaBuf,
        len: usize,
    ) {
        let (n, xs, ys) = (len as u64, x.storage(), y.storage());
        let mut l = Launch::new(self.stream(), self.kernel("dropout"));
        l.arg(&p).arg(&key).arg(&first);
        l.arg(&x.mem).arg(&xs).arg(&mut y.mem).arg(&ys).arg(&n);
        // SAFETY: reads and writes len values.
        self.launch("dropout", unsafe { l.launch(grid_vec(len)) });
    }

    fn dropout_backward(
        &self,
        p: f32,
        key: u64,
        first: u64,
        dy: &CudaBuf,
        dx: &mut CudaBuf,
        len: usize,
    ) {
        self.dropout_forward(p, key, first, dy, dx, len);
    }

    fn dropout_in_place(&self, p: f32, key: u64, first: u64, buf: &mut CudaBuf, len: usize) {
        let (n, s) = (len as u64, buf.storage());
        let mut l = Launch::new(self.stream(), self.kernel("dropout_in_place"));
        l.arg(&p)
            .arg(&key)
            .arg(&first)
            .arg(&mut buf.mem)
            .arg(&s)
            .arg(&n);
        // SAFETY: reads and writes len values.
        self.launch("dropout", unsafe { l.launch(grid_vec(len)) });
    }
}
