//! linear on CUDA: cuBLAS's products, with the bias and a ReLU in cuBLASLt's epilogue where
//! it can, else the bias kernels of kernels/elementwise.cu.

use super::super::activation::Kernels as _;
use super::Kernels;
use crate::tensor::cuda::{grid_vec, CudaBackend, CudaBuf, HalfOperand, Launch, Output, BIAS_TILE};
use crate::tensor::{Activation, GradWrite};
use cudarc::driver::LaunchConfig;

impl Kernels for CudaBackend {
    fn linear_forward(
        &self,
        x: &CudaBuf,
        params: &CudaBuf,
        w: usize,
        b: Option<usize>,
        y: &mut CudaBuf,
        n: usize,
        inp: usize,
        out: usize,
        then: Option<Activation>,
    ) {
        if self.linear_by_epilogue(x, params, w, b, y, (n, inp, out), then) {
            return;
        }
        if let Some(b) = b {
            let (at, rows, width) = (b as u64, n as u64, out as u64);
            let (ps, ys) = (params.storage(), y.storage());
            let mut l = Launch::new(self.stream(), self.kernel("broadcast_rows"));
            l.arg(&params.mem).arg(&ps).arg(&at).arg(&rows).arg(&width);
            l.arg(&mut y.mem).arg(&ys);
            // SAFETY: reads `out` bias values, writes n·out values of y.
            self.launch("bias", unsafe { l.launch(grid_vec(n * out)) });
        }
        // y[n, out] = x[n, inp] · Wᵀ, W stored [out, inp] (so Wᵀ is "transposed storage").
        self.gemm(
            "linear forward",
            (n, out, inp),
            self.input(x, 0..n * inp, HalfOperand::Convert),
            false,
            self.input(params, w..w + out * inp, HalfOperand::Convert),
            true,
            self.output(y, 0..n * out),
            b.is_some(),
        );
        if let Some(f) = then {
            self.activation_in_place(f, y, n * out);
        }
    }

    fn linear_backward(
        &self,
        x: &CudaBuf,
        dy: &CudaBuf,
        params: &CudaBuf,
        grads: &mut CudaBuf,
        dw_write: GradWrite,
        w: usize,
        b: Option<usize>,
        dx: Option<&mut CudaBuf>,
        n: usize,
        inp: usize,
        out: usize,
    ) {
        let grads = &mut grads.mem;
        // dW[out, inp] (+)= dyᵀ · x: dy stored [n, out] is dyᵀ's transposed storage.
        self.gemm(
            "linear dW",
            (out, inp, n),
            self.input(dy, 0..n * out, HalfOperand::Convert),
            true,
            self.input(x, 0..n * inp, HalfOperand::Convert),
            false,
            Output::F32(grads.slice_mut(w..w + out * inp)),
            dw_write == GradWrite::Add,
        );
        if let Some(b) = b {
            let (rows, width, dys) = (n as u64, out as u64, dy.storage());
            let mut db = grads.slice_mut(b..b + out);
            let add = i32::from(dw_write == GradWrite::Add);
            let mut l = Launch::new(self.stream(), self.kernel("bias_grad"));
            l.arg(&dy.mem)
                .arg(&dys)
                .arg(&rows)
                .arg(&width)
                .arg(&mut db)
                .arg(&add);
            // A block per BIAS_TILE columns, BIAS_TILE × BIAS_TILE threads (kernels/elementwise.cu).
            let tiles = LaunchConfig {
                grid_dim: (out.div_ceil(BIAS_TILE) as u32, 1, 1),
                block_dim: (BIAS_TILE as u32, BIAS_TILE as u32, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: reads n·out values of dy, adds into (or writes) `out` elements of db.
            self.launch("bias gradient", unsafe { l.launch(tiles) });
        }
        if let Some(dx) = dx {
            // dx[n, inp] = dy[n, out] · W[out, inp]. In mixed precision an f32 dy is where
            // dW's product converted it (only the bias gradient, reading it, ran since).
            self.gemm(
                "linear dx",
                (n, inp, out),
                self.input(dy, 0..n * out, HalfOperand::Again),
                false,
                self.input(params, w..w + out * inp, HalfOperand::Convert),
                false,
                self.output(dx, 0..n * inp),
                false,
            );
        }
    }
}
