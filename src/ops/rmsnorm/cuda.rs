//! rmsnorm on CUDA: the kernels of rmsnorm.cu, launched without allocating.

use super::Kernels;
use crate::tensor::cuda::{grid, per_item, CudaBackend, CudaBuf, Launch};

impl Kernels for CudaBackend {
    fn rmsnorm_forward(
        &self,
        x: &CudaBuf,
        y: &mut CudaBuf,
        (rows, width): (usize, usize),
        params: &CudaBuf,
        gamma: usize,
        saved: &mut CudaBuf,
        eps: f32,
    ) {
        if !self.all_f32("rms norm", &[params, saved]) {
            return;
        }
        let (xs, ys) = (x.storage(), y.storage());
        let (r64, w64) = (rows as u64, width as u64);
        let g = params.mem.slice(gamma..gamma + width);
        let mut l = Launch::new(self.stream(), self.kernel("rmsnorm_forward"));
        l.arg(&x.mem).arg(&xs).arg(&mut y.mem).arg(&ys);
        l.arg(&r64).arg(&w64).arg(&g).arg(&mut saved.mem).arg(&eps);
        // SAFETY: one block per row.
        self.launch("rms norm", unsafe { l.launch(per_item(rows)) });
    }

    fn rmsnorm_backward(
        &self,
        x: &CudaBuf,
        dy: &CudaBuf,
        dx: Option<&mut CudaBuf>,
        (rows, width): (usize, usize),
        params: &CudaBuf,
        grads: &mut CudaBuf,
        gamma: usize,
        saved: &CudaBuf,
    ) {
        if !self.all_f32("rms norm backward", &[params, grads, saved]) {
            return;
        }
        let (xs, dys) = (x.storage(), dy.storage());
        let (r64, w64) = (rows as u64, width as u64);
        if let Some(dx) = dx {
            let dxs = dx.storage();
            let g = params.mem.slice(gamma..gamma + width);
            let mut l = Launch::new(self.stream(), self.kernel("rmsnorm_backward"));
            l.arg(&x.mem).arg(&xs).arg(&dy.mem).arg(&dys);
            l.arg(&mut dx.mem).arg(&dxs);
            l.arg(&r64).arg(&w64).arg(&g).arg(&saved.mem);
            // SAFETY: one block per row writes its dx.
            self.launch("rms norm backward", unsafe { l.launch(per_item(rows)) });
        }
        let mut dg = grads.mem.slice_mut(gamma..gamma + width);
        let mut l = Launch::new(self.stream(), self.kernel("rmsnorm_param_grads"));
        l.arg(&x.mem).arg(&xs).arg(&dy.mem).arg(&dys);
        l.arg(&r64).arg(&w64).arg(&saved.mem).arg(&mut dg);
        // SAFETY: one thread per column.
        self.launch("rms norm parameter gradients", unsafe {
            l.launch(grid(width))
        });
    }
}
