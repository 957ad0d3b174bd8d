//! batch norm on CUDA: the kernels of batchnorm.cu, launched without allocating.

use super::Kernels;
use crate::tensor::cuda::{per_item, CudaBackend, CudaBuf, Launch};

impl Kernels for CudaBackend {
    fn batchnorm_forward(
        &self,
        x: &CudaBuf,
        y: &mut CudaBuf,
        shape: (usize, usize, usize),
        params: &CudaBuf,
        gamma: usize,
        state: &mut CudaBuf,
        train: bool,
        momentum: f32,
        eps: f32,
    ) {
        if !self.all_f32("batch norm", &[params, state]) {
            return;
        }
        let (xs, ys) = (x.storage(), y.storage());
        let params = &params.mem;
        let (n, c, spatial) = shape;
        let (n64, c64, s64, train) = (n as u64, c as u64, spatial as u64, i32::from(train));
        let (g, b) = (
            params.slice(gamma..gamma + c),
            params.slice(gamma + c..gamma + 2 * c),
        );
        let mut l = Launch::new(self.stream(), self.kernel("batchnorm_forward"));
        l.arg(&x.mem).arg(&xs).arg(&mut y.mem).arg(&ys);
        l.arg(&n64).arg(&c64).arg(&s64).arg(&g).arg(&b);
        l.arg(&mut state.mem).arg(&train).arg(&momentum).arg(&eps);
        // SAFETY: one block per channel reads/writes that channel's n·spatial values and its
        // four state entries.
        self.launch("batch norm", unsafe { l.launch(per_item(c)) });
    }

    fn batchnorm_backward(
        &self,
        x: &CudaBuf,
        dy: &CudaBuf,
        dx: Option<&mut CudaBuf>,
        shape: (usize, usize, usize),
        params: &CudaBuf,
        grads: &mut CudaBuf,
        gamma: usize,
        state: &CudaBuf,
    ) {
        if !self.all_f32("batch norm backward", &[params, grads, state]) {
            return;
        }
        let params = &params.mem;
        let grads = &mut grads.mem;
        let (n, c, spatial) = shape;
        let (n64, c64, s64) = (n as u64, c as u64, spatial as u64);
        let write_dx = i32::from(dx.is_some());
        let g = params.slice(gamma..gamma + c);
        let mut both = grads.slice_mut(gamma..gamma + 2 * c);
        let (mut dg, mut db) = both.split_at_mut(c);
        // Without dx the kernel never writes it; it still needs a valid pointer.
        let dx_arg = dx.map_or(x, |d| &*d);
        let [xs, dys, dxs] = [x, dy, dx_arg].map(CudaBuf::storage);
        let mut l = Launch::new(self.stream(), self.kernel("batchnorm_backward"));
        l.arg(&x.mem).arg(&xs).arg(&dy.mem).arg(&dys);
        l.arg(&dx_arg.mem).arg(&dxs).arg(&write_dx);
        l.arg(&n64).arg(&c64).arg(&s64);
        l.arg(&g).arg(&state.mem).arg(&mut dg).arg(&mut db);
        // SAFETY: one block per channel; writes dx only when write_dx.
        self.launch("batch norm backward", unsafe { l.launch(per_item(c)) });
    }
}
