//! multiply on CUDA: the kernels of multiply.cu.

use super::Kernels;
use crate::tensor::cuda::{grid_vec, CudaBackend, CudaBuf, Launch};

impl Kernels for CudaBackend {
    fn multiply(&self, a: &CudaBuf, b: &CudaBuf, y: &mut CudaBuf, len: usize) {
        let n = len as u64;
        let [a_s, b_s, ys] = [a, b, &*y].map(CudaBuf::storage);
        let mut l = Launch::new(self.stream(), self.kernel("multiply"));
        l.arg(&a.mem).arg(&a_s).arg(&b.mem).arg(&b_s);
        l.arg(&mut y.mem).arg(&ys).arg(&n);
        // SAFETY: reads len values of a and b, writes len of y.
        self.launch("multiply", unsafe { l.launch(grid_vec(len)) });
    }

    fn multiply_backward(
        &self,
        dy: &CudaBuf,
        other: &CudaBuf,
        dx: &mut CudaBuf,
        len: usize,
        add: bool,
    ) {
        let (n, add) = (len as u64, add as i32);
        let [dys, os, dxs] = [dy, other, &*dx].map(CudaBuf::storage);
        let mut l = Launch::new(self.stream(), self.kernel("multiply_backward"));
        l.arg(&dy.mem).arg(&dys).arg(&other.mem).arg(&os);
        l.arg(&mut dx.mem).arg(&dxs).arg(&n).arg(&add);
        // SAFETY: reads len values of dy, other and dx, writes len of dx.
        self.launch("multiply backward", unsafe { l.launch(grid_vec(len)) });
    }
}
