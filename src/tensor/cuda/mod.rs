//! The CUDA backend: the same ops as the CPU backend on one GPU, through cudarc with dynamic
//! loading (no CUDA toolkit at build time; libcuda, libnvrtc and libcublas found at run time).
//! GEMMs go through cuBLAS in full fp32 unless `device.allow_tf32`; everything else is our own
//! kernels (kernels/*.cu). All work is queued on one stream; a failed call is recorded and
//! reported by `status()` (checked after every step), as CUDA's own errors are sticky.

pub mod kernels;

use super::{Activation, AdamStep, Backend, LossFn, LossStats, SgdStep};
use crate::error::{Error, Result};
use cudarc::cublas::sys::{cublasMath_t, cublasOperation_t};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use std::cell::{Cell, RefCell};
use std::sync::Arc;

/// Bytes of cuBLAS workspace we give it (PyTorch uses 32 MiB on Hopper): owned by us so every
/// byte the run uses is counted.
pub const CUBLAS_WORKSPACE: usize = 32 << 20;
const THREADS: u32 = 256;
/// Blocks of the first pass of the gradient norm (a fixed count keeps the sum's order fixed).
const NORM_BLOCKS: u32 = 1024;

/// One GPU as seen by `trainer devices`.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub memory_bytes: usize,
}

/// Why CUDA cannot be used here, or the devices it has.
pub fn probe() -> std::result::Result<(Vec<DeviceInfo>, String), String> {
    // SAFETY: only asks the dynamic loader whether libcuda exists; nothing is called before.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("no CUDA driver (libcuda.so) found".into());
    }
    let count = CudaContext::device_count()
        .map_err(|e| format!("the CUDA driver reports an error: {e:?}"))?;
    let mut devices = Vec::new();
    for ordinal in 0..count.max(0) as usize {
        let ctx =
            CudaContext::new(ordinal).map_err(|e| format!("cannot open cuda:{ordinal}: {e:?}"))?;
        devices.push(DeviceInfo {
            ordinal,
            name: ctx.name().unwrap_or_else(|_| "unknown".into()),
            compute_capability: ctx.compute_capability().unwrap_or((0, 0)),
            memory_bytes: ctx.total_mem().unwrap_or(0),
        });
    }
    let mut driver = 0;
    // SAFETY: the driver writes one int.
    let _ = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) };
    let nvrtc = if kernels::nvrtc_available() {
        kernels::nvrtc_version().map_or("unknown".into(), |(a, b)| format!("{a}.{b}"))
    } else {
        "not found".into()
    };
    Ok((
        devices,
        format!(
            "driver CUDA {}.{}, NVRTC {nvrtc}",
            driver / 1000,
            driver % 1000 / 10
        ),
    ))
}

struct Functions {
    fill: CudaFunction,
    scale: CudaFunction,
    gather_rows: CudaFunction,
    broadcast_rows: CudaFunction,
    bias_grad: CudaFunction,
    activation_forward: CudaFunction,
    activation_backward: CudaFunction,
    dropout: CudaFunction,
    cross_entropy: CudaFunction,
    elementwise_loss: CudaFunction,
    reduce_stats: CudaFunction,
    sum_squares_partial: CudaFunction,
    sum_partials: CudaFunction,
    sgd_step: CudaFunction,
    adam_step: CudaFunction,
}

pub struct CudaBackend {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    f: Functions,
    /// Row indices of the batch being gathered, grown to the largest batch once.
    rows: RefCell<CudaSlice<u32>>,
    /// Per-sample loss and hit of the last loss call, [2, batch], grown to the largest batch.
    row_stats: RefCell<CudaSlice<f64>>,
    /// Per-block partial sums of the gradient norm, then the norm itself.
    partials: RefCell<CudaSlice<f64>>,
    norm: RefCell<CudaSlice<f64>>,
    /// The cuBLAS workspace, kept alive for the handle's lifetime.
    _workspace: CudaSlice<u8>,
    allocated: Cell<usize>,
    peak: Cell<usize>,
    error: RefCell<Option<String>>,
    description: String,
}

fn cuda_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Runtime(format!("CUDA: {what} failed: {e:?}"))
}

fn grid(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(THREADS as usize).clamp(1, 1 << 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl CudaBackend {
    /// Opens `cuda:ordinal`: context, stream, cuBLAS (fp32 unless `allow_tf32`), kernels.
    pub fn new(ordinal: usize, allow_tf32: bool) -> Result<Self> {
        let (devices, versions) = probe()
            .map_err(|why| Error::Job(format!("device cuda:{ordinal} requested, but {why}")))?;
        let Some(info) = devices.get(ordinal) else {
            return Err(Error::Job(format!(
                "device cuda:{ordinal} requested, but this machine has {} CUDA device(s)",
                devices.len()
            )));
        };
        if !kernels::nvrtc_available() {
            return Err(Error::Job(
                "CUDA needs libnvrtc (NVRTC) to compile its kernels, and none was found".into(),
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda_err("opening the device", e))?;
        // One stream orders everything: cudarc's per-buffer event tracking is not needed.
        // SAFETY: no other stream is ever created on this context.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let (major, minor) = info.compute_capability;
        let started = std::time::Instant::now();
        let (ptx, cached) = kernels::load_or_compile(major, minor)?;
        let module = ctx
            .load_module(ptx)
            .map_err(|e| cuda_err("loading the kernels", e))?;
        tracing::info!(
            "cuda:{ordinal} kernels {} in {:.0} ms",
            if cached {
                "loaded from cache"
            } else {
                "compiled by NVRTC"
            },
            started.elapsed().as_secs_f64() * 1e3
        );
        let load = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| cuda_err(&format!("loading kernel {name}"), e))
        };
        let f = Functions {
            fill: load("fill_f32")?,
            scale: load("scale_f32")?,
            gather_rows: load("gather_rows")?,
            broadcast_rows: load("broadcast_rows")?,
            bias_grad: load("bias_grad")?,
            activation_forward: load("activation_forward")?,
            activation_backward: load("activation_backward")?,
            dropout: load("dropout")?,
            cross_entropy: load("cross_entropy")?,
            elementwise_loss: load("elementwise_loss")?,
            reduce_stats: load("reduce_stats")?,
            sum_squares_partial: load("sum_squares_partial")?,
            sum_partials: load("sum_partials")?,
            sgd_step: load("sgd_step")?,
            adam_step: load("adam_step")?,
        };
        let blas =
            CudaBlas::new(stream.clone()).map_err(|e| cuda_err("creating the cuBLAS handle", e))?;
        let mut workspace = stream
            .alloc_zeros::<u8>(CUBLAS_WORKSPACE)
            .map_err(|e| cuda_err("allocating", e))?;
        let math = if allow_tf32 {
            cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH
        } else {
            cublasMath_t::CUBLAS_DEFAULT_MATH
        };
        {
            use cudarc::driver::DevicePtrMut;
            let (ptr, _record) = workspace.device_ptr_mut(&stream);
            // SAFETY: the handle is valid; the workspace outlives it (both owned by self, the
            // workspace dropped after `blas` by field order).
            unsafe {
                cudarc::cublas::sys::cublasSetMathMode(*blas.handle(), math)
                    .result()
                    .map_err(|e| cuda_err("cublasSetMathMode", e))?;
                cudarc::cublas::sys::cublasSetWorkspace_v2(
                    *blas.handle(),
                    ptr as *mut _,
                    CUBLAS_WORKSPACE,
                )
                .result()
                .map_err(|e| cuda_err("cublasSetWorkspace", e))?;
            }
        }
        let rows = stream
            .alloc_zeros::<u32>(1)
            .map_err(|e| cuda_err("allocating", e))?;
        let row_stats = stream
            .alloc_zeros::<f64>(2)
            .map_err(|e| cuda_err("allocating", e))?;
        let partials = stream
            .alloc_zeros::<f64>(NORM_BLOCKS as usize)
            .map_err(|e| cuda_err("allocating", e))?;
        let norm = stream
            .alloc_zeros::<f64>(1)
            .map_err(|e| cuda_err("allocating", e))?;
        let description = format!(
            "cuda:{ordinal} ({}, sm_{major}{minor}, {:.1} GiB, {versions}{})",
            info.name,
            info.memory_bytes as f64 / (1u64 << 30) as f64,
            if allow_tf32 { ", TF32 allowed" } else { "" }
        );
        Ok(CudaBackend {
            stream,
            blas,
            f,
            rows: RefCell::new(rows),
            row_stats: RefCell::new(row_stats),
            partials: RefCell::new(partials),
            norm: RefCell::new(norm),
            _workspace: workspace,
            allocated: Cell::new(CUBLAS_WORKSPACE),
            peak: Cell::new(CUBLAS_WORKSPACE),
            error: RefCell::new(None),
            description,
        })
    }

    /// Remembers the first failure; later calls keep going (the stream is likely broken) and
    /// `status()` reports it.
    fn record<T>(&self, what: &str, r: std::result::Result<T, impl std::fmt::Debug>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                let mut slot = self.error.borrow_mut();
                if slot.is_none() {
                    *slot = Some(format!("CUDA: {what} failed: {e:?}"));
                }
                None
            }
        }
    }

    fn count(&self, bytes: usize) {
        let now = self.allocated.get() + bytes;
        self.allocated.set(now);
        self.peak.set(self.peak.get().max(now));
    }

    /// Row-major C[m, n] (+)= op(A)·op(B) through column-major cuBLAS: computes Cᵀ = op(B)ᵀ·op(A)ᵀ.
    /// `a_t`/`b_t`: whether A is stored as [k, m] / B as [n, k] (row-major).
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        what: &str,
        (m, n, k): (usize, usize, usize),
        a: &cudarc::driver::CudaView<f32>,
        a_t: bool,
        b: &cudarc::driver::CudaView<f32>,
        b_t: bool,
        c: &mut cudarc::driver::CudaViewMut<f32>,
        accumulate: bool,
    ) {
        let op = |t: bool| {
            if t {
                cublasOperation_t::CUBLAS_OP_T
            } else {
                cublasOperation_t::CUBLAS_OP_N
            }
        };
        // Column-major view: C' [n, m] = B' [n, k] · A' [k, m], with B' = B row-major as stored.
        let cfg = GemmConfig {
            transa: op(b_t),
            transb: op(a_t),
            m: n as i32,
            n: m as i32,
            k: k as i32,
            alpha: 1.0f32,
            lda: if b_t { k } else { n } as i32,
            ldb: if a_t { m } else { k } as i32,
            beta: if accumulate { 1.0 } else { 0.0 },
            ldc: n as i32,
        };
        // SAFETY: the views hold at least the m·k, k·n and m·n elements the config reads/writes.
        let r = unsafe { self.blas.gemm(cfg, b, a, c) };
        self.record(what, r);
    }

    fn launch(&self, what: &str, r: std::result::Result<(), cudarc::driver::DriverError>) {
        self.record(what, r);
    }
}

impl Backend for CudaBackend {
    type Buf = CudaSlice<f32>;
    type Stats = CudaSlice<f64>;

    fn describe(&self) -> String {
        self.description.clone()
    }

    fn alloc(&self, len: usize) -> Result<CudaSlice<f32>> {
        let buf = self.stream.alloc_zeros::<f32>(len.max(1)).map_err(|e| {
            Error::Runtime(format!(
                "CUDA: cannot allocate {} bytes on {}: {e:?}",
                len * 4,
                self.description
            ))
        })?;
        self.count(buf.len() * 4);
        Ok(buf)
    }

    fn upload_vec(&self, data: Vec<f32>) -> Result<CudaSlice<f32>> {
        let mut buf = self.alloc(data.len())?;
        self.upload(&data, &mut buf);
        Ok(buf)
    }

    fn upload(&self, src: &[f32], dst: &mut CudaSlice<f32>) {
        if src.is_empty() {
            return;
        }
        let r = self
            .stream
            .memcpy_htod(src, &mut dst.slice_mut(..src.len()));
        self.record("copy to the device", r);
    }

    fn download(&self, src: &CudaSlice<f32>, dst: &mut [f32]) {
        if dst.is_empty() {
            return;
        }
        let r = self.stream.memcpy_dtoh(&src.slice(..dst.len()), dst);
        self.record("copy from the device", r);
    }

    fn fill(&self, buf: &mut CudaSlice<f32>, value: f32) {
        let n = buf.len() as u64;
        let mut b = self.stream.launch_builder(&self.f.fill);
        b.arg(&mut *buf).arg(&n).arg(&value);
        // SAFETY: fill_f32(float*, u64, float) writes n elements of buf.
        self.launch("fill", unsafe { b.launch(grid(n as usize)) }.map(|_| ()));
    }

    fn copy(&self, src: &CudaSlice<f32>, dst: &mut CudaSlice<f32>, len: usize) {
        if len == 0 {
            return;
        }
        let r = self
            .stream
            .memcpy_dtod(&src.slice(..len), &mut dst.slice_mut(..len));
        self.record("device copy", r);
    }

    fn gather_rows(
        &self,
        src: &CudaSlice<f32>,
        rows: &[u32],
        row_len: usize,
        dst: &mut CudaSlice<f32>,
    ) {
        if rows.is_empty() {
            return;
        }
        let mut index = self.rows.borrow_mut();
        if index.len() < rows.len() {
            match self.stream.alloc_zeros::<u32>(rows.len()) {
                Ok(grown) => {
                    self.count((grown.len() - index.len()) * 4);
                    *index = grown;
                }
                Err(e) => return self.launch("allocating batch indices", Err(e)),
            }
        }
        let r = self
            .stream
            .memcpy_htod(rows, &mut index.slice_mut(..rows.len()));
        if self.record("copying batch indices", r).is_none() {
            return;
        }
        let (n_rows, row_len) = (rows.len() as u64, row_len as u64);
        let mut b = self.stream.launch_builder(&self.f.gather_rows);
        b.arg(src)
            .arg(&*index)
            .arg(&n_rows)
            .arg(&row_len)
            .arg(&mut *dst);
        // SAFETY: reads src rows named by index (validated < dataset length by the loader),
        // writes n_rows·row_len elements of dst.
        self.launch(
            "gather",
            unsafe { b.launch(grid((n_rows * row_len) as usize)) }.map(|_| ()),
        );
    }

    fn linear_forward(
        &self,
        x: &CudaSlice<f32>,
        params: &CudaSlice<f32>,
        w: usize,
        b: Option<usize>,
        y: &mut CudaSlice<f32>,
        n: usize,
        inp: usize,
        out: usize,
    ) {
        if let Some(b) = b {
            let bias = params.slice(b..b + out);
            let (rows, width) = (n as u64, out as u64);
            let mut l = self.stream.launch_builder(&self.f.broadcast_rows);
            l.arg(&bias).arg(&rows).arg(&width).arg(&mut *y);
            // SAFETY: reads `out` bias values, writes n·out elements of y.
            self.launch("bias", unsafe { l.launch(grid(n * out)) }.map(|_| ()));
        }
        let weight = params.slice(w..w + out * inp);
        // y[n, out] = x[n, inp] · Wᵀ, W stored [out, inp] (so Wᵀ is "transposed storage").
        self.gemm(
            "linear forward",
            (n, out, inp),
            &x.slice(..n * inp),
            false,
            &weight,
            true,
            &mut y.slice_mut(..n * out),
            b.is_some(),
        );
    }

    fn linear_backward(
        &self,
        x: &CudaSlice<f32>,
        dy: &CudaSlice<f32>,
        params: &CudaSlice<f32>,
        grads: &mut CudaSlice<f32>,
        w: usize,
        b: Option<usize>,
        dx: Option<&mut CudaSlice<f32>>,
        n: usize,
        inp: usize,
        out: usize,
    ) {
        let dy_view = dy.slice(..n * out);
        // dW[out, inp] += dyᵀ · x: dy stored [n, out] is dyᵀ's transposed storage.
        self.gemm(
            "linear dW",
            (out, inp, n),
            &dy_view,
            true,
            &x.slice(..n * inp),
            false,
            &mut grads.slice_mut(w..w + out * inp),
            true,
        );
        if let Some(b) = b {
            let (rows, width) = (n as u64, out as u64);
            let mut db = grads.slice_mut(b..b + out);
            let mut l = self.stream.launch_builder(&self.f.bias_grad);
            l.arg(&dy_view).arg(&rows).arg(&width).arg(&mut db);
            // SAFETY: reads n·out of dy, adds into `out` elements of db.
            self.launch("bias gradient", unsafe { l.launch(grid(out)) }.map(|_| ()));
        }
        if let Some(dx) = dx {
            // dx[n, inp] = dy[n, out] · W[out, inp]
            self.gemm(
                "linear dx",
                (n, inp, out),
                &dy_view,
                false,
                &params.slice(w..w + out * inp),
                false,
                &mut dx.slice_mut(..n * inp),
                false,
            );
        }
    }

    fn activation_forward(
        &self,
        f: Activation,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        len: usize,
    ) {
        let (id, n) = (activation_id(f), len as u64);
        let mut l = self.stream.launch_builder(&self.f.activation_forward);
        l.arg(&id).arg(x).arg(&mut *y).arg(&n);
        // SAFETY: reads and writes len elements.
        self.launch("activation", unsafe { l.launch(grid(len)) }.map(|_| ()));
    }

    fn activation_backward(
        &self,
        f: Activation,
        x: &CudaSlice<f32>,
        y: &CudaSlice<f32>,
        dy: &CudaSlice<f32>,
        dx: &mut CudaSlice<f32>,
        len: usize,
    ) {
        let (id, n) = (activation_id(f), len as u64);
        let mut l = self.stream.launch_builder(&self.f.activation_backward);
        l.arg(&id).arg(x).arg(y).arg(dy).arg(&mut *dx).arg(&n);
        // SAFETY: reads and writes len elements.
        self.launch(
            "activation backward",
            unsafe { l.launch(grid(len)) }.map(|_| ()),
        );
    }

    fn dropout_forward(
        &self,
        p: f32,
        key: u64,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        len: usize,
    ) {
        let n = len as u64;
        let mut l = self.stream.launch_builder(&self.f.dropout);
        l.arg(&p).arg(&key).arg(x).arg(&mut *y).arg(&n);
        // SAFETY: reads and writes len elements.
        self.launch("dropout", unsafe { l.launch(grid(len)) }.map(|_| ()));
    }

    fn dropout_backward(
        &self,
        p: f32,
        key: u64,
        dy: &CudaSlice<f32>,
        dx: &mut CudaSlice<f32>,
        len: usize,
    ) {
        self.dropout_forward(p, key, dy, dx, len);
    }

    fn loss(
        &self,
        f: LossFn,
        out: &CudaSlice<f32>,
        targets: &CudaSlice<f32>,
        n: usize,
        dim: usize,
        grad_scale: f32,
        dout: Option<&mut CudaSlice<f32>>,
        stats: &mut CudaSlice<f64>,
    ) {
        let write_grad = i32::from(dout.is_some());
        // Without a gradient the kernel never writes `dout`; it still needs a valid pointer.
        let dout_ptr: &CudaSlice<f32> = match &dout {
            Some(d) => d,
            None => out,
        };
        let (rows, width) = (n as u64, dim as u64);
        let mut row_stats = self.row_stats.borrow_mut();
        if row_stats.len() < 2 * n {
            match self.stream.alloc_zeros::<f64>(2 * n) {
                Ok(grown) => {
                    self.count((grown.len() - row_stats.len()) * 8);
                    *row_stats = grown;
                }
                Err(e) => return self.launch("allocating loss statistics", Err(e)),
            }
        }
        match f {
            LossFn::CrossEntropy { label_smoothing } => {
                let mut l = self.stream.launch_builder(&self.f.cross_entropy);
                l.arg(out)
                    .arg(targets)
                    .arg(&rows)
                    .arg(&width)
                    .arg(&label_smoothing)
                    .arg(&grad_scale)
                    .arg(&write_grad)
                    .arg(dout_ptr)
                    .arg(&mut *row_stats);
                let warps_per_block = (THREADS / 32) as usize;
                let cfg = LaunchConfig {
                    grid_dim: (n.div_ceil(warps_per_block).max(1) as u32, 1, 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: one warp per row reads `dim` logits and a label, writes `dim`
                // gradients when asked, and two doubles of row_stats.
                self.launch("cross-entropy", unsafe { l.launch(cfg) }.map(|_| ()));
            }
            LossFn::Mse | LossFn::BceWithLogits => {
                let kind = i32::from(f == LossFn::BceWithLogits);
                let mut l = self.stream.launch_builder(&self.f.elementwise_loss);
                l.arg(&kind)
                    .arg(out)
                    .arg(targets)
                    .arg(&rows)
                    .arg(&width)
                    .arg(&grad_scale)
                    .arg(&write_grad)
                    .arg(dout_ptr)
                    .arg(&mut *row_stats);
                let cfg = LaunchConfig {
                    grid_dim: (n.div_ceil(THREADS as usize).max(1) as u32, 1, 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: one thread per sample reads/writes its `dim` values and two doubles
                // of row_stats.
                self.launch("loss", unsafe { l.launch(cfg) }.map(|_| ()));
            }
        }
        let mut l = self.stream.launch_builder(&self.f.reduce_stats);
        l.arg(&*row_stats).arg(&rows).arg(&mut *stats);
        let one_block = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: reads 2n doubles of row_stats, adds to the three of stats.
        self.launch(
            "loss statistics",
            unsafe { l.launch(one_block) }.map(|_| ()),
        );
    }

    fn new_stats(&self) -> Result<CudaSlice<f64>> {
        let s = self
            .stream
            .alloc_zeros::<f64>(3)
            .map_err(|e| cuda_err("allocating", e))?;
        self.count(24);
        Ok(s)
    }

    fn take_stats(&self, stats: &mut CudaSlice<f64>) -> LossStats {
        let mut host = [0.0f64; 3];
        let read = self.stream.memcpy_dtoh(&*stats, &mut host[..]);
        self.record("reading loss statistics", read);
        let zero = self.stream.memset_zeros(stats);
        self.record("resetting loss statistics", zero);
        LossStats {
            loss_sum: host[0],
            correct: host[1],
            samples: host[2],
        }
    }

    fn sum_squares(&self, buf: &CudaSlice<f32>) -> f64 {
        let (mut partials, mut norm) = (self.partials.borrow_mut(), self.norm.borrow_mut());
        let n = buf.len() as u64;
        let mut l = self.stream.launch_builder(&self.f.sum_squares_partial);
        l.arg(buf).arg(&n).arg(&mut *partials);
        let cfg = LaunchConfig {
            grid_dim: (NORM_BLOCKS, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: reads n elements; block b writes partials[b], b < NORM_BLOCKS = its length.
        self.launch("gradient norm", unsafe { l.launch(cfg) }.map(|_| ()));
        let count = NORM_BLOCKS as u64;
        let mut l = self.stream.launch_builder(&self.f.sum_partials);
        l.arg(&*partials).arg(&count).arg(&mut *norm);
        let one_block = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: reads NORM_BLOCKS doubles, writes one.
        self.launch("gradient norm", unsafe { l.launch(one_block) }.map(|_| ()));
        let mut host = [0.0f64];
        let read = self.stream.memcpy_dtoh(&*norm, &mut host[..]);
        self.record("reading the gradient norm", read);
        host[0]
    }

    fn scale(&self, buf: &mut CudaSlice<f32>, factor: f32) {
        let n = buf.len() as u64;
        let mut l = self.stream.launch_builder(&self.f.scale);
        l.arg(&mut *buf).arg(&n).arg(&factor);
        // SAFETY: scales n elements in place.
        self.launch("scale", unsafe { l.launch(grid(n as usize)) }.map(|_| ()));
    }

    fn sgd_step(
        &self,
        params: &mut CudaSlice<f32>,
        grads: &CudaSlice<f32>,
        momentum: &mut CudaSlice<f32>,
        h: &SgdStep,
    ) {
        let n = params.len() as u64;
        let (nesterov, first) = (i32::from(h.nesterov), i32::from(h.first_step));
        let mut l = self.stream.launch_builder(&self.f.sgd_step);
        l.arg(&mut *params)
            .arg(grads)
            .arg(&mut *momentum)
            .arg(&n)
            .arg(&h.lr)
            .arg(&h.momentum)
            .arg(&h.dampening)
            .arg(&nesterov)
            .arg(&h.weight_decay)
            .arg(&first);
        // SAFETY: updates n parameters; the momentum buffer (n long when momentum != 0) is only
        // touched when momentum != 0.
        self.launch(
            "sgd step",
            unsafe { l.launch(grid(n as usize)) }.map(|_| ()),
        );
    }

    fn adam_step(
        &self,
        params: &mut CudaSlice<f32>,
        grads: &CudaSlice<f32>,
        exp_avg: &mut CudaSlice<f32>,
        exp_avg_sq: &mut CudaSlice<f32>,
        h: &AdamStep,
    ) {
        let n = params.len() as u64;
        let bias_correction1 = 1.0 - (h.beta1 as f64).powi(h.step as i32);
        let bias_correction2 = 1.0 - (h.beta2 as f64).powi(h.step as i32);
        let step_size = (h.lr as f64 / bias_correction1) as f32;
        let bc2_sqrt = bias_correction2.sqrt() as f32;
        let (decay, l2) = if h.decoupled {
            (1.0 - h.lr * h.weight_decay, 0.0f32)
        } else {
            (1.0f32, h.weight_decay)
        };
        let mut l = self.stream.launch_builder(&self.f.adam_step);
        l.arg(&mut *params)
            .arg(grads)
            .arg(&mut *exp_avg)
            .arg(&mut *exp_avg_sq)
            .arg(&n)
            .arg(&h.beta1)
            .arg(&h.beta2)
            .arg(&h.eps)
            .arg(&l2)
            .arg(&decay)
            .arg(&step_size)
            .arg(&bc2_sqrt);
        // SAFETY: updates n elements of each buffer.
        self.launch(
            "adam step",
            unsafe { l.launch(grid(n as usize)) }.map(|_| ()),
        );
    }

    fn status(&self) -> Result<()> {
        match self.error.borrow().as_ref() {
            Some(e) => Err(Error::Runtime(e.clone())),
            None => Ok(()),
        }
    }

    fn memory(&self) -> Option<(usize, usize)> {
        Some((self.allocated.get(), self.peak.get()))
    }
}

fn activation_id(f: Activation) -> i32 {
    match f {
        Activation::Relu => 0,
        Activation::Gelu => 1,
        Activation::GeluTanh => 2,
        Activation::Tanh => 3,
        Activation::Sigmoid => 4,
    }
}
