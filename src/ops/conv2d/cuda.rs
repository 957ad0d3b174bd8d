//! conv2d on CUDA: im2col and col2im kernels (conv2d.cu) around cuBLAS's products.

use super::Kernels;
use crate::tensor::cuda::{
    grid, im2col_region, per_item, storage_id, ConvGeom, CudaBackend, CudaBuf, HalfOperand, Launch,
    Output,
};
use crate::tensor::{Conv2d, GradWrite};

impl Kernels for CudaBackend {
    fn conv_workspace_len(&self, s: &Conv2d, max_batch: usize) -> usize {
        conv_workspace_len(s, max_batch)
    }

    fn conv2d_forward(
        &self,
        s: &Conv2d,
        x: &CudaBuf,
        params: &CudaBuf,
        w: usize,
        b: Option<usize>,
        y: &mut CudaBuf,
        n: usize,
        workspace: &mut CudaBuf,
    ) {
        // x and y may be half-width, and the weights mixed precision's half copy. The
        // workspace (from `alloc`) holds col in the products' input format (`workspace_input`)
        // and their f32 output, to which the bias is added before y's single rounding.
        let (xs, ys) = (x.storage(), y.storage());
        let cs = storage_id(self.half_matmuls.get());
        let geom = ConvGeom::new(s, n);
        let (plane, ckk) = ((geom.oh * geom.ow) as usize, s.c * s.kh * s.kw);
        let cols = n * plane;
        let (mut col, mut ycn) = workspace.mem.split_at_mut(im2col_region(ckk * cols));
        let mut l = Launch::new(self.stream(), self.kernel("im2col"));
        l.arg(&x.mem).arg(&xs).arg(&geom).arg(&mut col).arg(&cs);
        // SAFETY: reads x [n, c, h, w], writes ckk·cols values of col (at most as many bytes
        // as ckk·cols f32).
        self.launch("im2col", unsafe { l.launch(grid(ckk * cols)) });
        let col = col.slice(..);
        let (og, rows) = (s.o / s.groups, ckk / s.groups);
        for g in 0..s.groups {
            let weight = w + g * og * rows..w + (g + 1) * og * rows;
            let out_g = ycn.slice_mut(g * og * cols..(g + 1) * og * cols);
            self.gemm(
                "conv forward",
                (og, cols, rows),
                self.input(params, weight, HalfOperand::Convert),
                false,
                self.workspace_input(&col, g * rows * cols..(g + 1) * rows * cols),
                false,
                Output::F32(out_g),
                false,
            );
        }
        let (n64, o64, p64) = (n as u64, s.o as u64, plane as u64);
        let has_bias = i32::from(b.is_some());
        let (bias_at, ps) = (b.unwrap_or(0) as u64, params.storage());
        let ycn = ycn.slice(..);
        let mut l = Launch::new(self.stream(), self.kernel("cn_to_nchw"));
        l.arg(&ycn)
            .arg(&params.mem)
            .arg(&ps)
            .arg(&bias_at)
            .arg(&has_bias)
            .arg(&n64)
            .arg(&o64)
            .arg(&p64)
            .arg(&mut y.mem)
            .arg(&ys);
        // SAFETY: reads o·n·p of ycn (and o biases when has_bias), writes n·o·p of y.
        self.launch("conv layout", unsafe { l.launch(grid(n * s.o * plane)) });
    }

    fn conv2d_backward(
        &self,
        s: &Conv2d,
        x: &CudaBuf,
        dy: &CudaBuf,
        params: &CudaBuf,
        grads: &mut CudaBuf,
        dw_write: GradWrite,
        w: usize,
        b: Option<usize>,
        dx: Option<&mut CudaBuf>,
        n: usize,
        workspace: &mut CudaBuf,
    ) {
        // As in the forward pass: x, dy and dx may be half-width; col and dy's [o, n·p]
        // layout are written in the products' input format, dcol in f32 (col2im sums it
        // before dx's single rounding), over col once dW has read it.
        let (xs, dys) = (x.storage(), dy.storage());
        let ws = storage_id(self.half_matmuls.get());
        let grads = &mut grads.mem;
        let geom = ConvGeom::new(s, n);
        let (plane, ckk) = ((geom.oh * geom.ow) as usize, s.c * s.kh * s.kw);
        let cols = n * plane;
        let (n64, o64, p64) = (n as u64, s.o as u64, plane as u64);
        let (mut col, mut dycn) = workspace.mem.split_at_mut(im2col_region(ckk * cols));
        let mut l = Launch::new(self.stream(), self.kernel("nchw_to_cn"));
        l.arg(&dy.mem).arg(&dys).arg(&n64).arg(&o64).arg(&p64);
        l.arg(&mut dycn).arg(&ws);
        // SAFETY: reads n·o·p of dy, writes o·n·p values of dycn.
        self.launch("conv layout", unsafe { l.launch(grid(n * s.o * plane)) });
        let dycn = dycn.slice(..);
        let add = i32::from(dw_write == GradWrite::Add);
        if let Some(b) = b {
            let cols64 = cols as u64;
            let mut db = grads.slice_mut(b..b + s.o);
            let mut l = Launch::new(self.stream(), self.kernel("row_sums_add"));
            l.arg(&dycn)
                .arg(&ws)
                .arg(&o64)
                .arg(&cols64)
                .arg(&mut db)
                .arg(&add);
            // SAFETY: reads o rows of cols values, adds into (or writes) o biases.
            self.launch("conv bias gradient", unsafe {
                l.launch(per_item(s.o.min(65_535)))
            });
        }
        let mut l = Launch::new(self.stream(), self.kernel("im2col"));
        l.arg(&x.mem).arg(&xs).arg(&geom).arg(&mut col).arg(&ws);
        // SAFETY: as in the forward pass.
        self.launch("im2col", unsafe { l.launch(grid(ckk * cols)) });
        let (og, rows) = (s.o / s.groups, ckk / s.groups);
        let dy_g = |g: usize| self.workspace_input(&dycn, g * og * cols..(g + 1) * og * cols);
        {
            let col = col.slice(..);
            for g in 0..s.groups {
                // dW_g[og, rows] (+)= dY_g[og, cols] · col_gᵀ (col_g stored [rows, cols])
                let col_g = self.workspace_input(&col, g * rows * cols..(g + 1) * rows * cols);
                let dw = grads.slice_mut(w + g * og * rows..w + (g + 1) * og * rows);
                let dims = (og, rows, cols);
                self.gemm(
                    "conv dW",
                    dims,
                    dy_g(g),
                    false,
                    col_g,
                    true,
                    Output::F32(dw),
                    dw_write == GradWrite::Add,
                );
            }
        }
        let Some(dx) = dx else { return };
        for g in 0..s.groups {
            // dcol_g[rows, cols] = W_gᵀ (W_g stored [og, rows]) · dY_g[og, cols]
            let weight = w + g * og * rows..w + (g + 1) * og * rows;
            let col_g = col.slice_mut(g * rows * cols..(g + 1) * rows * cols);
            self.gemm(
                "conv dcol",
                (rows, cols, og),
                self.input(params, weight, HalfOperand::Convert),
                true,
                dy_g(g),
                false,
                Output::F32(col_g),
                false,
            );
        }
        let (col, dxs) = (col.slice(..), dx.storage());
        let mut l = Launch::new(self.stream(), self.kernel("col2im"));
        l.arg(&col).arg(&geom).arg(&mut dx.mem).arg(&dxs);
        // SAFETY: reads col, writes every element of dx [n, c, h, w].
        self.launch("col2im", unsafe { l.launch(grid(n * s.c * s.h * s.w)) });
    }
}

/// f32 values of scratch a conv2d layer needs on the GPU: its im2col matrix [c·kh·kw, n·p] and
/// its output in GEMM layout [o, n·p].
pub fn conv_workspace_len(s: &Conv2d, max_batch: usize) -> usize {
    let (oh, ow) = s.out_hw().expect("validated geometry");
    im2col_region(s.c * s.kh * s.kw * max_batch * oh * ow) + s.o * max_batch * oh * ow
}
