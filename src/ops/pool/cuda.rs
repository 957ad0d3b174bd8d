//! pooling on CUDA: the kernels of pool.cu.

use super::Kernels;
use crate::tensor::cuda::{grid, CudaBackend, CudaBuf, Launch, PoolGeom};
use crate::tensor::{Pool2d, PoolKind};

impl Kernels for CudaBackend {
    fn pool2d_forward(&self, kind: PoolKind, s: &Pool2d, x: &CudaBuf, y: &mut CudaBuf, n: usize) {
        let (geom, kind) = (PoolGeom::new(s, n), i32::from(kind == PoolKind::Avg));
        let (xs, ys) = (x.storage(), y.storage());
        let mut l = Launch::new(self.stream(), self.kernel("pool2d_forward"));
        l.arg(&kind)
            .arg(&x.mem)
            .arg(&xs)
            .arg(&geom)
            .arg(&mut y.mem)
            .arg(&ys);
        let outputs = geom.outputs();
        // SAFETY: one thread per output reads its window.
        self.launch("pooling", unsafe { l.launch(grid(outputs)) });
    }

    fn pool2d_backward(
        &self,
        kind: PoolKind,
        s: &Pool2d,
        x: &CudaBuf,
        y: &CudaBuf,
        dy: &CudaBuf,
        dx: &mut CudaBuf,
        n: usize,
        through_relu: bool,
    ) {
        let (geom, kind) = (PoolGeom::new(s, n), i32::from(kind == PoolKind::Avg));
        let [xs, ys, dys, dxs] = [x, y, dy, &*dx].map(CudaBuf::storage);
        let relu = i32::from(through_relu);
        let mut l = Launch::new(self.stream(), self.kernel("pool2d_backward"));
        l.arg(&kind).arg(&x.mem).arg(&xs).arg(&y.mem).arg(&ys);
        l.arg(&dy.mem)
            .arg(&dys)
            .arg(&geom)
            .arg(&relu)
            .arg(&mut dx.mem)
            .arg(&dxs);
        // SAFETY: one thread per input element gathers from the windows containing it.
        self.launch("pooling backward", unsafe {
            l.launch(grid(n * s.c * s.h * s.w))
        });
    }
}
