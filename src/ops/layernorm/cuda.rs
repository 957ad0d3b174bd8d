//! layer norm on CUDA: the kernels of layernorm.cu, launched without allocating.

use super::Kernels;
use crate::tensor::cuda::{grid, per_item, CudaBackend, CudaBuf, Launch};

impl Kernels for CudaBackend {
    fn layernorm_forward(
        &self,
        x: &CudaBuf,
        y: &mut CudaBuf,
        shape: (usize, usize),
        params: &CudaBuf,
        (gamma, bias): (usize, bool),
        saved: &mut CudaBuf,
        eps: f32,
    ) {
        if !self.all_f32("layer norm", &[params, saved]) {
            return;
        }
        let (xs, ys) = (x.storage(), y.storage());
        let params = &params.mem;
        let (rows, width) = shape;
        let (r64, w64) = (rows as u64, width as u64);
        // Without β the kernel is told so, and given γ's address to hold instead.
        let (g, has_beta) = (params.slice(gamma..gamma + width), i32::from(bias));
        let b = match bias {
            true => params.slice(gamma + width..gamma + 2 * width),
            false => params.slice(gamma..gamma + width),
        };
        let mut l = Launch::new(self.stream(), self.kernel("layernorm_forward"));
        l.arg(&x.mem).arg(&xs).arg(&mut y.mem).arg(&ys);
        l.arg(&r64).arg(&w64).arg(&g).arg(&b).arg(&has_beta);
        l.arg(&mut saved.mem).arg(&eps);
        // SAFETY: one block per row.
        self.launch("layer norm", unsafe { l.launch(per_item(rows)) });
    }

    fn layernorm_backward(
        &self,
        x: &CudaBuf,
        dy: &CudaBuf,
        dx: Option<&mut CudaBuf>,
        shape: (usize, usize),
        params: &CudaBuf,
        grads: &mut CudaBuf,
        (gamma, bias): (usize, bool),
        saved: &CudaBuf,
    ) {
        if !self.all_f32("layer norm backward", &[params, grads, saved]) {
            return;
        }
        let (xs, dys) = (x.storage(), dy.storage());
        let params = &params.mem;
        let grads = &mut grads.mem;
        let (rows, width) = shape;
        let (r64, w64) = (rows as u64, width as u64);
        let g = params.slice(gamma..gamma + width);
        if let Some(dx) = dx {
            let dxs = dx.storage();
            let mut l = Launch::new(self.stream(), self.kernel("layernorm_backward"));
            l.arg(&x.mem).arg(&xs).arg(&dy.mem).arg(&dys);
            l.arg(&mut dx.mem).arg(&dxs);
            l.arg(&r64).arg(&w64).arg(&g).arg(&saved.mem);
            // SAFETY: one block per row writes its dx.
            self.launch("layer norm backward", unsafe { l.launch(per_item(rows)) });
        }
        // Without β, dβ is an empty view the kernel does not write.
        let (has_beta, len) = (i32::from(bias), if bias { 2 * width } else { width });
        let mut both = grads.slice_mut(gamma..gamma + len);
        let (mut dg, mut db) = both.split_at_mut(width);
        let mut l = Launch::new(self.stream(), self.kernel("layernorm_param_grads"));
        l.arg(&x.mem).arg(&xs).arg(&dy.mem).arg(&dys);
        l.arg(&r64).arg(&w64).arg(&saved.mem);
        l.arg(&mut dg).arg(&mut db).arg(&has_beta);
        // SAFETY: one thread per column.
        self.launch("layer norm parameter gradients", unsafe {
            l.launch(grid(width))
        });
    }
}
