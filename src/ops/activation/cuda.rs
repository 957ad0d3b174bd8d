//! The activations on CUDA: the kernels of activation.cu.

use super::Kernels;
use crate::tensor::cuda::{grid_vec, half_id, CudaBackend, CudaBuf, Launch};
use crate::tensor::{Activation, HalfKind};

impl Kernels for CudaBackend {
    fn activation_forward(&self, f: Activation, x: &CudaBuf, y: &mut CudaBuf, len: usize) {
        let (id, n) = (activation_id(f), len as u64);
        let (xs, ys) = (x.storage(), y.storage());
        let mut l = Launch::new(self.stream(), self.kernel("activation_forward"));
        l.arg(&id)
            .arg(&x.mem)
            .arg(&xs)
            .arg(&mut y.mem)
            .arg(&ys)
            .arg(&n);
        // SAFETY: reads and writes len values.
        self.launch("activation", unsafe { l.launch(grid_vec(len)) });
    }

    fn activation_in_place(&self, f: Activation, buf: &mut CudaBuf, len: usize) {
        let (id, n, s) = (activation_id(f), len as u64, buf.storage());
        let mut l = Launch::new(self.stream(), self.kernel("activation_in_place"));
        l.arg(&id).arg(&mut buf.mem).arg(&s).arg(&n);
        // SAFETY: reads and writes len values.
        self.launch("activation", unsafe { l.launch(grid_vec(len)) });
    }

    /// One pass (kernels/elementwise.cu) for the default's three.
    fn activation_in_place_rounding(
        &self,
        kind: HalfKind,
        f: Activation,
        buf: &mut CudaBuf,
        len: usize,
    ) {
        let (id, kind, n, s) = (activation_id(f), half_id(kind), len as u64, buf.storage());
        let mut l = Launch::new(self.stream(), self.kernel("activation_in_place_rounding"));
        l.arg(&id).arg(&kind).arg(&mut buf.mem).arg(&s).arg(&n);
        // SAFETY: reads and writes len values.
        self.launch("activation", unsafe { l.launch(grid_vec(len)) });
    }

    fn activation_backward(
        &self,
        f: Activation,
        x: &CudaBuf,
        y: &CudaBuf,
        dy: &CudaBuf,
        dx: &mut CudaBuf,
        len: usize,
    ) {
        let (id, n) = (activation_id(f), len as u64);
        let [xs, ys, dys, dxs] = [x, y, dy, &*dx].map(CudaBuf::storage);
        let mut l = Launch::new(self.stream(), self.kernel("activation_backward"));
        l.arg(&id).arg(&x.mem).arg(&xs).arg(&y.mem).arg(&ys);
        l.arg(&dy.mem).arg(&dys).arg(&mut dx.mem).arg(&dxs).arg(&n);
        // SAFETY: reads and writes len values.
        self.launch("activation backward", unsafe { l.launch(grid_vec(len)) });
    }

    /// One pass for the default's three; dy is left as it was.
    fn activation_backward_rounding(
        &self,
        kind: HalfKind,
        f: Activation,
        x: &CudaBuf,
        y: &CudaBuf,
        dy: &mut CudaBuf,
        dx: &mut CudaBuf,
        len: usize,
    ) {
        let (id, kind, n) = (activation_id(f), half_id(kind), len as u64);
        let [xs, ys, dys, dxs] = [x, y, &*dy, &*dx].map(CudaBuf::storage);
        let mut l = Launch::new(self.stream(), self.kernel("activation_backward_rounding"));
        l.arg(&id)
            .arg(&kind)
            .arg(&x.mem)
            .arg(&xs)
            .arg(&y.mem)
            .arg(&ys);
        l.arg(&dy.mem).arg(&dys).arg(&mut dx.mem).arg(&dxs).arg(&n);
        // SAFETY: reads len values of x, y and dy, writes len of dx.
        self.launch("activation backward", unsafe { l.launch(grid_vec(len)) });
    }
}

fn activation_id(f: Activation) -> i32 {
    match f {
        Activation::Relu => 0,
        Activation::Gelu => 1,
        Activation::GeluTanh => 2,
        Activation::Tanh => 3,
        Activation::Sigmoid => 4,
        Activation::Silu => 5,
    }
}
