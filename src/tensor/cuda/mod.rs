//! The CUDA backend: the same ops as the CPU backend on one GPU, through cudarc with dynamic
//! loading (no CUDA toolkit at build time; libcuda, libnvrtc and libcublas found at run time).
//! GEMMs go through cuBLAS, in fp32 (TF32 with `device.allow_tf32`) or in mixed precision on
//! tensor cores (`set_half_matmuls`), linear layers' forward products through cuBLASLt with
//! their bias and ReLU in its epilogue (`epilogue`); everything else is our own
//! kernels (kernels/*.cu). All work is queued on one stream; a failed call is recorded and
//! reported by `status()` (checked after every step), as CUDA's own errors are sticky.

mod epilogue;
pub mod kernels;
mod launch;

use super::{
    cast, Activation, AdamStep, Backend, Capture, Conv2d, HalfKind, HostIds, IdsInto, LossFn,
    LossStats, Matrices, Pool2d, RowsAt, SgdStep, UpdatedParams,
};
use crate::error::{Error, Result};
use cudarc::cublas::sys::{cublasMath_t, cublasOperation_t};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, StridedBatchedConfig};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaSlice, CudaStream, CudaView, CudaViewMut,
    DevicePtrMut, LaunchConfig, PinnedHostSlice,
};
pub(crate) use launch::Launch;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

/// Bytes of cuBLAS workspace we give it (PyTorch uses 32 MiB on Hopper): owned by us so every
/// byte the run uses is counted.
pub const CUBLAS_WORKSPACE: usize = 32 << 20;
const THREADS: u32 = 256;
/// Values a thread moves at once in the vectorised kernels (kernels/cast.cu's VEC).
const VEC: usize = 8;
/// The errors of a kernel that faulted, which CUDA reports at whatever call comes next.
const DEVICE_FAULTS: [&str; 6] = [
    "CUDA_ERROR_ILLEGAL_ADDRESS",
    "CUDA_ERROR_LAUNCH_FAILED",
    "CUDA_ERROR_MISALIGNED_ADDRESS",
    "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    "CUDA_ERROR_HARDWARE_STACK_ERROR",
    "CUDA_ERROR_ECC_UNCORRECTABLE",
];
/// Most blocks of the first pass of the gradient norm (its partials buffer's length).
const NORM_BLOCKS: u32 = 1024;
/// The bytes a backend allocates for itself as it starts, besides cuBLAS's workspace: the
/// gradient norm's per-block partials and its total, and the one-value buffers that the
/// batch's row indices (u64), the loss's per-row statistics (2 f64 and the rows scored) and
/// the two converted inputs of a matrix product (u16 each) grow from.
const START_BYTES: usize = NORM_BLOCKS as usize * 8 + 8 + 8 + 3 * 8 + 2 * 2;

/// The device memory a backend holds besides the buffers it is asked for, in a run of
/// batches of up to `batch` samples (a replica's micro-batch) gathered on the device from a
/// resident data set when `gathers`: cuBLAS's workspace, what it starts with
/// (`START_BYTES`), the row indices grown to the batch (replacing the first), the loss's
/// per-row statistics grown to it (a recorded step may still read the first, which stays),
/// and the loss statistics of the training and evaluation rows. `trainer check` plans
/// these bytes and a run counts them (`gpu_mem_*`), so the two can agree to the byte.
pub fn own_bytes(batch: usize, gathers: bool) -> usize {
    let row_indices = if gathers {
        8 * batch.saturating_sub(1)
    } else {
        0
    };
    let row_stats = if batch > 1 { 8 * (2 * batch + 1) } else { 0 };
    CUBLAS_WORKSPACE + START_BYTES + row_indices + row_stats + 2 * 8 * LOSS_STATS
}

/// A loss statistics buffer's values (`Backend::new_stats`): loss sum, hits, samples.
const LOSS_STATS: usize = 3;

/// Values per thread below which the gradient norm's first pass uses fewer blocks: a small
/// model's norm is not spread over 262,144 mostly idle threads.
const NORM_VALUES_PER_THREAD: usize = 16;
/// Columns per block of the bias gradient, and threads splitting the rows (kernels' BIAS_TILE).
pub(crate) const BIAS_TILE: usize = 32;
/// Pinned staging buffers of a streamed data set: inputs and targets of two batches.
const STAGING_SLOTS: usize = 4;

/// The pinned buffers `upload_rows` gathers batches into, and which one is next. Each slot
/// has an event recorded after the copy that reads it: the host waits on it before writing
/// the slot again. (cudarc's own per-buffer events are off, see `CudaBackend::new`, so
/// `PinnedHostSlice::as_mut_slice` would not wait.)
#[derive(Default)]
struct Staging {
    slots: Vec<(PinnedHostSlice<f32>, CudaEvent)>,
    next: usize,
}

/// One GPU as seen by `trainer devices`.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub memory_bytes: usize,
}

/// cuda:`ordinal` as the driver describes it, with the driver's and NVRTC's versions, where
/// the backend can open it: the driver, the device and the libraries the backend needs are
/// there (asked without opening it, so `check` and a sweep can tell before a run would).
pub fn usable(ordinal: usize) -> Result<(DeviceInfo, String)> {
    let (devices, versions) =
        probe().map_err(|why| Error::Job(format!("device cuda:{ordinal} requested, but {why}")))?;
    let Some(info) = devices.get(ordinal) else {
        return Err(Error::Job(format!(
            "device cuda:{ordinal} requested, but this machine has {} CUDA device(s)",
            devices.len()
        )));
    };
    if let Some(why) = libraries_missing() {
        return Err(Error::Job(format!(
            "device cuda:{ordinal} requested, but {why}"
        )));
    }
    Ok((info.clone(), versions))
}

/// Why CUDA cannot be used here, or the devices it has.
pub fn probe() -> std::result::Result<(Vec<DeviceInfo>, String), String> {
    // SAFETY: only asks the dynamic loader whether libcuda exists; nothing is called before.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("no CUDA driver (libcuda.so) found".into());
    }
    let count = CudaContext::device_count()
        .map_err(|e| format!("the CUDA driver reports an error: {e:?}"))?;
    // Device queries only: a context on every GPU would cost each process memory there, and
    // fail on a GPU in exclusive-process mode that another rank holds.
    use cudarc::driver::{result::device, sys::CUdevice_attribute as Attribute};
    let mut devices = Vec::new();
    for ordinal in 0..count.max(0) as usize {
        let dev = device::get(ordinal as i32)
            .map_err(|e| format!("cannot query cuda:{ordinal}: {e:?}"))?;
        // SAFETY: `dev` is a device handle the driver just returned.
        let attribute = |a| unsafe { device::get_attribute(dev, a) }.unwrap_or(0);
        devices.push(DeviceInfo {
            ordinal,
            name: device::get_name(dev).unwrap_or_else(|_| "unknown".into()),
            compute_capability: (
                attribute(Attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                attribute(Attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
            ),
            // SAFETY: as above.
            memory_bytes: unsafe { device::total_mem(dev) }.unwrap_or(0),
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
    round_to_half: CudaFunction,
    add_assign: CudaFunction,
    convert_values: CudaFunction,
    copy_rows: CudaFunction,
    gather_rows: CudaFunction,
    gather_ids: CudaFunction,
    cross_entropy: CudaFunction,
    elementwise_loss: CudaFunction,
    reduce_stats: CudaFunction,
    count_scored: CudaFunction,
    sum_squares_partial: CudaFunction,
    sum_partials: CudaFunction,
    clip_by_norm: CudaFunction,
    sgd_step: CudaFunction,
    adam_step: CudaFunction,
}

/// Where a matrix product gets one of its inputs in the half format, in mixed precision.
#[derive(Clone, Copy)]
pub(crate) enum HalfOperand {
    /// Converts the f32 view (which holds half values already) into a scratch buffer.
    Convert,
    /// The caller vouches that the view is unchanged since the previous product converted
    /// it in this position: no second conversion (checked: else it is converted).
    Again,
}

/// One input of a matrix product: f32 values (converted in mixed precision as their
/// `HalfOperand` says), or values stored in the half format at a device address (a
/// half-width buffer: activations, or mixed precision's half copy of the weights).
pub(crate) enum Input<'a> {
    F32(CudaView<'a, f32>, HalfOperand),
    Half(u64, HalfKind),
}

/// Where a matrix product writes: f32 values, or a half-width buffer at a device address.
pub(crate) enum Output<'a> {
    F32(CudaViewMut<'a, f32>),
    Half(u64, HalfKind),
}

/// A buffer of the CUDA backend: f32 values, or values that are always in a half format
/// (`Backend::alloc_half`: mixed precision's activations and their gradients), stored in
/// that format, 2 bytes each, so that every write rounds to it. The kernels read and write
/// activations and their gradients through `load` and `store` (kernels/cast.cu), given each
/// buffer's `storage`. Parameters, their gradients, layer state,
/// workspaces and data sets are always f32.
pub struct CudaBuf {
    /// `len` f32 values, or `len` halves packed two to an element.
    pub(crate) mem: CudaSlice<f32>,
    len: usize,
    pub(crate) half: Option<HalfKind>,
}

impl CudaBuf {
    /// Values the buffer holds.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The kernels' storage id of its values (`storage_id`).
    pub(crate) fn storage(&self) -> i32 {
        storage_id(self.half)
    }
}

/// Token ids on the device (`Backend::Ids`): `len` u32 values.
pub struct CudaIds {
    pub(crate) mem: CudaSlice<u32>,
    len: usize,
}

impl CudaIds {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// kernels/spatial.cu's ConvGeom, field for field.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct ConvGeom {
    n: u64,
    c: u64,
    h: u64,
    w: u64,
    o: u64,
    kh: u64,
    kw: u64,
    sh: u64,
    sw: u64,
    ph: u64,
    pw: u64,
    dh: u64,
    dw: u64,
    pub(crate) oh: u64,
    pub(crate) ow: u64,
}

impl ConvGeom {
    pub(crate) fn new(s: &Conv2d, n: usize) -> Self {
        let (oh, ow) = s.out_hw().expect("validated geometry");
        let u = |v: usize| v as u64;
        ConvGeom {
            n: u(n),
            c: u(s.c),
            h: u(s.h),
            w: u(s.w),
            o: u(s.o),
            kh: u(s.kh),
            kw: u(s.kw),
            sh: u(s.stride.0),
            sw: u(s.stride.1),
            ph: u(s.pad.0),
            pw: u(s.pad.1),
            dh: u(s.dil.0),
            dw: u(s.dil.1),
            oh: u(oh),
            ow: u(ow),
        }
    }
}

/// kernels/spatial.cu's PoolGeom.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct PoolGeom {
    n: u64,
    c: u64,
    h: u64,
    w: u64,
    kh: u64,
    kw: u64,
    sh: u64,
    sw: u64,
    ph: u64,
    pw: u64,
    oh: u64,
    ow: u64,
}

impl PoolGeom {
    /// Output values of the whole batch.
    pub(crate) fn outputs(&self) -> usize {
        (self.n * self.c * self.oh * self.ow) as usize
    }

    pub(crate) fn new(s: &Pool2d, n: usize) -> Self {
        let (oh, ow) = s.out_hw().expect("validated geometry");
        let u = |v: usize| v as u64;
        PoolGeom {
            n: u(n),
            c: u(s.c),
            h: u(s.h),
            w: u(s.w),
            kh: u(s.k.0),
            kw: u(s.k.1),
            sh: u(s.stride.0),
            sw: u(s.stride.1),
            ph: u(s.pad.0),
            pw: u(s.pad.1),
            oh: u(oh),
            ow: u(ow),
        }
    }
}

/// The f32 values a conv workspace gives its im2col matrix of `len` values: rounded up to 256
/// bytes, so the [o, n·p] region after it starts as aligned as the allocation whatever the
/// batch (an odd last batch of an odd plane would put it off 16 bytes, and cuBLAS then runs
/// its kernels for unaligned operands).
pub(crate) fn im2col_region(len: usize) -> usize {
    len.next_multiple_of(64)
}

/// One block per item (channel or row), 256 threads reducing together.
pub(crate) fn per_item(items: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (items.max(1) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub struct CudaBackend {
    stream: Arc<CudaStream>,
    /// Every kernel of the program by name, for the ops that keep theirs in their own
    /// folder (`kernel`).
    by_name: HashMap<&'static str, CudaFunction>,
    /// Dropped by hand (see `Drop`): cudarc panics when the handle cannot be destroyed.
    blas: std::mem::ManuallyDrop<CudaBlas>,
    f: Functions,
    /// Row indices of the batch being gathered, grown to the largest batch once.
    rows: RefCell<CudaSlice<u64>>,
    /// A streamed data set's batches are gathered on the host into these pinned buffers, used
    /// in turn (inputs and targets of two batches), so the host fills one while the copy from
    /// the previous one may still be queued.
    staging: RefCell<Staging>,
    /// Per-sample loss and hit of the last loss call, [2, batch], grown to the largest batch.
    row_stats: RefCell<CudaSlice<f64>>,
    /// Scratch buffers replaced by larger ones, kept alive because a recorded graph may still
    /// read them (a graph holds device addresses).
    retired: RefCell<Vec<CudaSlice<f64>>>,
    /// Per-block partial sums of the gradient norm, then the norm itself.
    partials: RefCell<CudaSlice<f64>>,
    norm: RefCell<CudaSlice<f64>>,
    /// Mixed precision: matrix products take their inputs as this half format (tensor
    /// cores), accumulating and writing f32 (`set_half_matmuls`).
    pub(crate) half_matmuls: Cell<Option<HalfKind>>,
    /// The two inputs of a half matrix product, converted; grown to the largest.
    half_inputs: RefCell<[CudaSlice<u16>; 2]>,
    /// The (address, length) of the f32 values last converted into each of `half_inputs`,
    /// for `HalfOperand::Again`.
    half_inputs_hold: Cell<[Option<(u64, usize)>; 2]>,
    retired_halves: RefCell<Vec<CudaSlice<u16>>>,
    /// The NCCL communicator of a multi-process run, once joined (`join_collective`).
    collective: RefCell<Option<Collective>>,
    /// The cuBLAS workspace, kept alive for the handle's lifetime; cuBLASLt's too (the same
    /// stream orders their uses).
    workspace: CudaSlice<u8>,
    /// Products whose bias and ReLU cuBLASLt applies (`epilogue`); None without cuBLASLt.
    /// Dropped by hand, as `blas`.
    epilogues: std::mem::ManuallyDrop<Option<epilogue::Epilogues>>,
    /// `device.fused_epilogues`: whether linear layers use `epilogues`.
    fused_epilogues: Cell<bool>,
    /// `device.allow_tf32`, which cuBLASLt's descriptors take per product.
    allow_tf32: bool,
    allocated: Cell<usize>,
    peak: Cell<usize>,
    error: RefCell<Option<String>>,
    description: String,
    compute_capability: (i32, i32),
}

/// `values` rounded to `kind`, packed two to an f32 element as a half-width `CudaBuf` holds
/// them.
fn pack_halves(kind: HalfKind, values: &[f32]) -> Vec<f32> {
    let mut packed = vec![0.0f32; values.len().div_ceil(2)];
    let halves: &mut [u16] = bytemuck::cast_slice_mut(&mut packed);
    cast::to_half(kind, values, halves);
    packed
}

/// The values of packed halves (two to an element).
fn unpack_halves(kind: HalfKind, packed: &[f32]) -> Vec<f32> {
    let halves: &[u16] = bytemuck::cast_slice(packed);
    let mut values = vec![0.0f32; halves.len()];
    cast::from_half(kind, halves, &mut values);
    values
}

/// Why NCCL cannot be used here (None when libnccl loads), with what to do about it. cudarc
/// looks for `libnccl.so` (and a few versioned names) but not NCCL's own soname
/// `libnccl.so.2`, which is what packages and PyTorch's wheels ship.
pub fn nccl_missing() -> Option<String> {
    // SAFETY: only asks the dynamic loader whether the library exists.
    if unsafe { cudarc::nccl::sys::is_culib_present() } {
        return None;
    }
    let mut dirs: Vec<std::path::PathBuf> = std::env::var_os("LD_LIBRARY_PATH")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default();
    dirs.extend(
        [
            "/usr/lib/x86_64-linux-gnu",
            "/usr/local/lib",
            "/usr/lib64",
            "/usr/local/cuda/lib64",
        ]
        .map(std::path::PathBuf::from),
    );
    let found = dirs
        .iter()
        .map(|d| d.join("libnccl.so.2"))
        .find(|p| p.exists());
    Some(match found {
        Some(lib) => format!(
            "NCCL is needed but libnccl.so cannot be loaded; {} exists: link it under the name \
             the loader looks for, e.g. `mkdir -p ~/.local/lib/nccl && ln -s {} \
             ~/.local/lib/nccl/libnccl.so` and add that directory to LD_LIBRARY_PATH",
            lib.display(),
            lib.display()
        ),
        None => "NCCL is needed but libnccl.so cannot be loaded: install NCCL (e.g. the \
                 libnccl2 package, or PyTorch's nvidia-nccl wheel) and make libnccl.so \
                 findable through LD_LIBRARY_PATH, or set parallel.backend = \"tcp\""
            .into(),
    })
}

/// Why the CUDA libraries besides the driver cannot be used (None when they load): cudarc
/// panics on the first call into a library it cannot load, so this is asked first.
pub fn libraries_missing() -> Option<String> {
    if !kernels::nvrtc_available() {
        return Some(
            "CUDA needs libnvrtc (NVRTC) to compile its kernels, and none was found".into(),
        );
    }
    // SAFETY: only asks the dynamic loader whether the library exists.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Some("CUDA needs libcublas for its matrix products, and none was found".into());
    }
    None
}

/// Whether the work queued before `event` was recorded finishes within `timeout`. Polled
/// rather than waited for: a wait inside the driver could not be given up.
fn finished_within(
    event: &CudaEvent,
    timeout: std::time::Duration,
) -> std::result::Result<bool, cudarc::driver::DriverError> {
    let started = std::time::Instant::now();
    loop {
        if event.try_is_complete()? {
            return Ok(true);
        }
        let waited = started.elapsed();
        if waited > timeout {
            return Ok(false);
        }
        // Spin briefly (a step's end is near), then sleep between polls.
        if waited < std::time::Duration::from_millis(20) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

fn cuda_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Runtime(format!("CUDA: {what} failed: {e:?}"))
}

/// The column-major cuBLAS product for row-major C[m, n] (+)= op(A)·op(B), where `a_t`/`b_t`
/// say whether A is stored as [k, m] / B as [n, k]: it computes Cᵀ = op(B)ᵀ·op(A)ᵀ, so
/// cuBLAS's A is our B (see `CudaBackend::gemm`).
fn column_major(
    (m, n, k): (usize, usize, usize),
    a_t: bool,
    b_t: bool,
    accumulate: bool,
) -> GemmConfig<f32> {
    let op = |t: bool| {
        if t {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        }
    };
    // Column-major view: C' [n, m] = B' [n, k] · A' [k, m], with B' = B row-major as stored.
    GemmConfig {
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
    }
}

/// For the kernels that go through `map_values` (kernels/cast.cu): a thread for every VEC
/// values.
pub(crate) fn grid_vec(n: usize) -> LaunchConfig {
    grid(n.div_ceil(VEC))
}

pub(crate) fn grid(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(THREADS as usize).clamp(1, 1 << 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl CudaBackend {
    /// The device's (major, minor) compute capability.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }

    /// Opens `cuda:ordinal`: context, stream, cuBLAS (fp32 unless `allow_tf32`), kernels.
    pub fn new(ordinal: usize, allow_tf32: bool) -> Result<Self> {
        let (info, versions) = usable(ordinal)?;
        let info = &info;
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda_err("opening the device", e))?;
        // One stream orders everything: cudarc's per-buffer event tracking is not needed.
        // SAFETY: the one other stream, NCCL's (`join_collective`), is ordered with this one
        // by events of our own; so are pinned staging buffers and the host (`Staging`).
        unsafe { ctx.disable_event_tracking() };
        // A stream of our own, not the legacy default stream, which cannot be recorded into
        // a CUDA graph.
        let stream = ctx
            .new_stream()
            .map_err(|e| cuda_err("creating a stream", e))?;
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
        let by_name = kernels::kernel_names()
            .map(|name| Ok((name, load(name)?)))
            .collect::<Result<HashMap<_, _>>>()?;
        let f = Functions {
            fill: load("fill_values")?,
            scale: load("scale_f32")?,
            round_to_half: load("round_to_half")?,
            add_assign: load("add_assign")?,
            convert_values: load("convert_values")?,
            copy_rows: load("copy_rows")?,
            gather_rows: load("gather_rows")?,
            gather_ids: load("gather_ids")?,
            cross_entropy: load("cross_entropy")?,
            elementwise_loss: load("elementwise_loss")?,
            reduce_stats: load("reduce_stats")?,
            count_scored: load("count_scored")?,
            sum_squares_partial: load("sum_squares_partial")?,
            sum_partials: load("sum_partials")?,
            clip_by_norm: load("clip_by_norm")?,
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
        let epilogues = match epilogue::Epilogues::new() {
            Ok(epilogues) => Some(epilogues),
            Err(why) => {
                tracing::info!(
                    "{why}: linear layers add their bias and ReLU in passes of their own"
                );
                None
            }
        };
        let rows = stream
            .alloc_zeros::<u64>(1)
            .map_err(|e| cuda_err("allocating", e))?;
        let row_stats = stream
            .alloc_zeros::<f64>(3)
            .map_err(|e| cuda_err("allocating", e))?;
        let (half_a, half_b) = (
            stream
                .alloc_zeros::<u16>(1)
                .map_err(|e| cuda_err("allocating", e))?,
            stream
                .alloc_zeros::<u16>(1)
                .map_err(|e| cuda_err("allocating", e))?,
        );
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
            by_name,
            stream,
            blas: std::mem::ManuallyDrop::new(blas),
            f,
            rows: RefCell::new(rows),
            staging: RefCell::new(Staging::default()),
            row_stats: RefCell::new(row_stats),
            retired: RefCell::new(Vec::new()),
            half_matmuls: Cell::new(None),
            half_inputs: RefCell::new([half_a, half_b]),
            half_inputs_hold: Cell::new([None; 2]),
            retired_halves: RefCell::new(Vec::new()),
            collective: RefCell::new(None),
            partials: RefCell::new(partials),
            norm: RefCell::new(norm),
            workspace,
            epilogues: std::mem::ManuallyDrop::new(epilogues),
            fused_epilogues: Cell::new(true),
            allow_tf32,
            allocated: Cell::new(CUBLAS_WORKSPACE + START_BYTES),
            peak: Cell::new(CUBLAS_WORKSPACE + START_BYTES),
            compute_capability: (major, minor),
            error: RefCell::new(None),
            description,
        })
    }

    /// Mixed precision (`Some`): every matrix product from now on multiplies `kind` inputs on
    /// tensor cores with f32 accumulation (cublasGemmEx, CUBLAS_COMPUTE_32F), as autocast
    /// does: a half-width input is read where it is, an f32 one (holding `kind` values, so
    /// exactly) converted into scratch; the output is f32, or half-width rounded once.
    pub fn set_half_matmuls(&self, kind: Option<HalfKind>) {
        self.half_matmuls.set(kind);
    }

    /// `device.fused_epilogues`: whether a linear layer's bias, and the ReLU after it, are
    /// applied by its product (cuBLASLt's epilogue) rather than in passes of their own.
    pub fn set_fused_epilogues(&self, on: bool) {
        self.fused_epilogues.set(on);
    }

    /// Remembers the first failure; later calls keep going (the stream is likely broken) and
    /// `status()` reports it.
    fn record<T>(&self, what: &str, r: std::result::Result<T, impl std::fmt::Debug>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                let mut slot = self.error.borrow_mut();
                if slot.is_none() {
                    let e = format!("{e:?}");
                    // A kernel's fault surfaces at a later call, which is not the culprit.
                    let blocking = std::env::var("CUDA_LAUNCH_BLOCKING").is_ok_and(|v| v == "1");
                    let hint = if !blocking && DEVICE_FAULTS.iter().any(|name| e.contains(name)) {
                        " (a fault of earlier GPU work, which CUDA reports at a later call: \
                         rerun with CUDA_LAUNCH_BLOCKING=1 and --set device.cuda_graphs=false \
                         for the operation that caused it)"
                    } else {
                        ""
                    };
                    *slot = Some(format!("CUDA: {what} failed: {e}{hint}"));
                }
                None
            }
        }
    }

    /// Σ buf[i]² into `self.norm` on the device: per-block partials, then one block adds
    /// them in order (no atomics: the same bits every run).
    fn sum_squares_on_device(&self, buf: &CudaSlice<f32>) {
        let (mut partials, mut norm) = (self.partials.borrow_mut(), self.norm.borrow_mut());
        let n = buf.len() as u64;
        // The count depends on the length alone, so the sum's order is fixed for a model.
        let blocks = (buf
            .len()
            .div_ceil(THREADS as usize * NORM_VALUES_PER_THREAD) as u32)
            .clamp(1, NORM_BLOCKS);
        let mut l = Launch::new(&self.stream, &self.f.sum_squares_partial);
        l.arg(buf).arg(&n).arg(&mut *partials);
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: reads n elements; block b writes partials[b], b < NORM_BLOCKS = its length.
        self.launch("gradient norm", unsafe { l.launch(cfg) });
        let count = blocks as u64;
        let mut l = Launch::new(&self.stream, &self.f.sum_partials);
        l.arg(&*partials).arg(&count).arg(&mut *norm);
        let one_block = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: reads `blocks` doubles (at most NORM_BLOCKS), writes one.
        self.launch("gradient norm", unsafe { l.launch(one_block) });
    }

    /// Reads the sum `sum_squares_on_device` left (waits for the stream to get there).
    fn read_sum_squares(&self) -> f64 {
        let mut host = [0.0f64];
        let read = self.stream.memcpy_dtoh(&*self.norm.borrow(), &mut host[..]);
        self.record("reading the gradient norm", read);
        host[0]
    }

    /// The next staging buffer, holding `len` values, once no queued copy reads it any more,
    /// with the event to record after the copy that will read it.
    /// The batch's row indices on the device, for a gather.
    fn batch_rows(&self, rows: &[u64]) -> Option<std::cell::RefMut<'_, CudaSlice<u64>>> {
        let mut index = self.rows.borrow_mut();
        if index.len() < rows.len() {
            match self.stream.alloc_zeros::<u64>(rows.len()) {
                Ok(grown) => {
                    self.count((grown.len() - index.len()) * 8);
                    *index = grown;
                }
                Err(e) => return self.record("allocating batch indices", Err(e)),
            }
        }
        let r = (self.stream).memcpy_htod(rows, &mut index.slice_mut(..rows.len()));
        self.record("copying batch indices", r)?;
        Some(index)
    }

    /// Records the event of a staging buffer's copy `r` (`next_staging`).
    fn batch_copied(
        &self,
        r: std::result::Result<(), cudarc::driver::DriverError>,
        copied: &CudaEvent,
    ) {
        if self.record("copying a batch to the device", r).is_some() {
            let r = copied.record(&self.stream);
            self.record("recording a batch copy's event", r);
        }
    }

    fn next_staging(
        &self,
        len: usize,
    ) -> Option<std::cell::RefMut<'_, (PinnedHostSlice<f32>, CudaEvent)>> {
        let mut staging = self.staging.borrow_mut();
        let slot = staging.next;
        staging.next = (slot + 1) % STAGING_SLOTS;
        if let Some((_, copied)) = staging.slots.get(slot) {
            // Before the host writes the slot again, or frees it.
            self.record("waiting for a batch copy", copied.synchronize())?;
        }
        if staging.slots.get(slot).is_none_or(|(s, _)| s.len() != len) {
            // SAFETY: the pinned memory is written by the host only after the event of the
            // copy that last read it, and read only by those copies.
            let fresh = unsafe { self.stream.context().alloc_pinned::<f32>(len) };
            let fresh = self.record("allocating pinned host memory", fresh)?;
            let event = self.stream.context().new_event(None);
            let event = self.record("creating an event", event)?;
            match staging.slots.get_mut(slot) {
                Some(old) => *old = (fresh, event),
                None => staging.slots.push((fresh, event)),
            }
        }
        Some(std::cell::RefMut::map(staging, |s| &mut s.slots[slot]))
    }

    fn count(&self, bytes: usize) {
        let now = self.allocated.get() + bytes;
        self.allocated.set(now);
        self.peak.set(self.peak.get().max(now));
    }

    /// A buffer's device address (the stream's events are off: nothing is recorded).
    fn address<T>(&self, buf: &impl cudarc::driver::DevicePtr<T>) -> u64 {
        buf.device_ptr(&self.stream).0
    }

    /// A zero-filled buffer of `len` values, stored in `half` (packed two to an element) or
    /// as f32.
    fn alloc_buf(&self, len: usize, half: Option<HalfKind>) -> Result<CudaBuf> {
        let elements = match half {
            None => len,
            Some(_) => len.div_ceil(2),
        };
        let mem = self
            .stream
            .alloc_zeros::<f32>(elements.max(1))
            .map_err(|e| {
                Error::Runtime(format!(
                    "CUDA: cannot allocate {} bytes on {}: {e:?}",
                    elements * 4,
                    self.description
                ))
            })?;
        // An empty buffer holds one placeholder value (CUDA allocates no 0 bytes); it is
        // counted as the nothing it was asked for, as the memory plan counts it.
        self.count(if len == 0 { 0 } else { mem.len() * 4 });
        Ok(CudaBuf { mem, len, half })
    }

    /// `buf[range]` as an input of a matrix product; `f32_source`: where its half form comes
    /// from in mixed precision when it is an f32 buffer.
    pub(crate) fn input<'a>(
        &self,
        buf: &'a CudaBuf,
        range: Range<usize>,
        f32_source: HalfOperand,
    ) -> Input<'a> {
        match buf.half {
            None => Input::F32(buf.mem.slice(range), f32_source),
            Some(kind) => Input::Half(self.address(&buf.mem) + 2 * range.start as u64, kind),
        }
    }

    /// `range` of a workspace region that a kernel wrote in the products' input format (the
    /// storage of `half_matmuls`, packed; f32 without), as an input of a matrix product: read
    /// in place either way.
    pub(crate) fn workspace_input<'a>(
        &self,
        region: &'a CudaView<'_, f32>,
        range: Range<usize>,
    ) -> Input<'a> {
        match self.half_matmuls.get() {
            Some(kind) => Input::Half(self.address(region) + 2 * range.start as u64, kind),
            None => Input::F32(region.slice(range), HalfOperand::Convert),
        }
    }

    /// `buf[range]` as the output of a matrix product.
    pub(crate) fn output<'a>(&self, buf: &'a mut CudaBuf, range: Range<usize>) -> Output<'a> {
        match buf.half {
            None => Output::F32(buf.mem.slice_mut(range)),
            Some(kind) => Output::Half(self.address(&buf.mem) + 2 * range.start as u64, kind),
        }
    }

    /// Row-major C[m, n] (+)= op(A)·op(B) through column-major cuBLAS: computes Cᵀ = op(B)ᵀ·op(A)ᵀ.
    /// `a_t`/`b_t`: whether A is stored as [k, m] / B as [n, k] (row-major). In fp32 every
    /// operand is f32; in mixed precision (`set_half_matmuls`) each may be either.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm(
        &self,
        what: &str,
        (m, n, k): (usize, usize, usize),
        a: Input,
        a_t: bool,
        b: Input,
        b_t: bool,
        c: Output,
        accumulate: bool,
    ) {
        let cfg = column_major((m, n, k), a_t, b_t, accumulate);
        if let Some(kind) = self.half_matmuls.get() {
            return self.gemm_half(what, kind, &cfg, [b, a], c);
        }
        let (Input::F32(a, _), Input::F32(b, _), Output::F32(mut c)) = (a, b, c) else {
            return self.launch_error(what, "a half-width operand of an fp32 matrix product");
        };
        // SAFETY: the views hold at least the m·k, k·n and m·n elements the config reads/writes.
        let r = unsafe { self.blas.gemm(cfg, &b, &a, &mut c) };
        self.record(what, r);
    }

    /// `Backend::batched_matmul` over views of f32 values, for an op whose operands share
    /// one buffer (its workspace). The layouts' offsets count from each view's start.
    pub(crate) fn strided_gemm(
        &self,
        what: &str,
        (m, n, k): (usize, usize, usize),
        batch: usize,
        [(a, a_at), (b, b_at)]: [(&CudaView<f32>, Matrices); 2],
        (c, c_at): (&mut CudaViewMut<f32>, Matrices),
        accumulate: bool,
    ) {
        assert!(
            c_at.row_stride == n && !c_at.transposed,
            "a batched product writes C's rows n apart"
        );
        let op = |t: bool| match t {
            true => cublasOperation_t::CUBLAS_OP_T,
            false => cublasOperation_t::CUBLAS_OP_N,
        };
        // Column-major, as in `column_major`: C' [n, m] = B' · A', B first.
        let cfg = StridedBatchedConfig {
            gemm: GemmConfig {
                transa: op(b_at.transposed),
                transb: op(a_at.transposed),
                m: n as i32,
                n: m as i32,
                k: k as i32,
                alpha: 1.0f32,
                lda: b_at.row_stride as i32,
                ldb: a_at.row_stride as i32,
                beta: if accumulate { 1.0 } else { 0.0 },
                ldc: n as i32,
            },
            batch_size: batch as i32,
            stride_a: b_at.batch_stride as i64,
            stride_b: a_at.batch_stride as i64,
            stride_c: c_at.batch_stride as i64,
        };
        let (a, b) = (a.slice(a_at.offset..), b.slice(b_at.offset..));
        let mut c = c.slice_mut(c_at.offset..);
        // SAFETY: the views hold every matrix the strides reach (the caller's layout).
        let r = unsafe { self.blas.gemm_strided_batched(cfg, &b, &a, &mut c) };
        self.record(what, r);
    }

    /// `cfg`'s column-major product C = op(A)·op(B) with A and B in `kind` (f32 inputs
    /// converted into `half_inputs` unless their `HalfOperand` says otherwise), f32
    /// accumulation, and C in f32 (so gradients still accumulate into f32 with beta = 1) or
    /// in `kind` (a half-width buffer: cuBLAS rounds the f32 result once, as the rounding
    /// pass after an f32 product would).
    fn gemm_half(
        &self,
        what: &str,
        kind: HalfKind,
        cfg: &GemmConfig<f32>,
        inputs: [Input; 2],
        c: Output,
    ) {
        use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cudaDataType};
        // cuBLAS is told one format for both inputs (and a half C): a buffer in the other
        // one would be read as garbage.
        let formats = inputs.iter().filter_map(|input| match input {
            Input::Half(_, format) => Some(*format),
            Input::F32(..) => None,
        });
        let out_format = match &c {
            Output::Half(_, format) => Some(*format),
            Output::F32(_) => None,
        };
        if formats.chain(out_format).any(|format| format != kind) {
            return self.launch_error(what, "a half-width buffer in another half format");
        }
        let Some(pointers) = self.half_pointers(kind, inputs) else {
            return;
        };
        let dtype = match kind {
            HalfKind::F16 => cudaDataType::CUDA_R_16F,
            HalfKind::Bf16 => cudaDataType::CUDA_R_16BF,
        };
        let (pc, c_type) = match c {
            Output::F32(mut view) => {
                let (pc, _rc) = view.device_ptr_mut(&self.stream);
                (pc, cudaDataType::CUDA_R_32F)
            }
            Output::Half(ptr, _) => (ptr, dtype),
        };
        // SAFETY: the inputs hold the elements the config reads (as the f32 views did), C
        // the ones it writes; alpha and beta are read from the host during the call.
        let r = unsafe {
            cudarc::cublas::sys::cublasGemmEx(
                *self.blas.handle(),
                cfg.transa,
                cfg.transb,
                cfg.m,
                cfg.n,
                cfg.k,
                (&cfg.alpha as *const f32).cast(),
                pointers[0] as *const std::ffi::c_void,
                dtype,
                cfg.lda,
                pointers[1] as *const std::ffi::c_void,
                dtype,
                cfg.ldb,
                (&cfg.beta as *const f32).cast(),
                pc as *mut std::ffi::c_void,
                c_type,
                cfg.ldc,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .result();
        self.record(what, r);
    }

    /// The device addresses of a half product's two inputs: a half-width input where it is,
    /// an f32 one converted into `half_inputs` (unless its `HalfOperand` says that is done).
    /// None after a failed allocation (recorded).
    fn half_pointers(&self, kind: HalfKind, inputs: [Input; 2]) -> Option<[u64; 2]> {
        let mut halves = self.half_inputs.borrow_mut();
        let mut hold = self.half_inputs_hold.get();
        let mut pointers = [0u64; 2];
        for (slot, input) in inputs.into_iter().enumerate() {
            let (src, operand) = match input {
                Input::Half(ptr, _) => {
                    pointers[slot] = ptr;
                    continue;
                }
                Input::F32(src, operand) => (src, operand),
            };
            let source = (self.address(&src), src.len());
            let dst = &mut halves[slot];
            pointers[slot] = match operand {
                HalfOperand::Again if hold[slot] == Some(source) => self.address(&*dst),
                HalfOperand::Again | HalfOperand::Convert => {
                    if dst.len() < src.len() {
                        match self.stream.alloc_zeros::<u16>(src.len()) {
                            Ok(grown) => {
                                self.count(grown.len() * 2);
                                // A recorded graph may still read the old one.
                                let old = std::mem::replace(dst, grown);
                                self.retired_halves.borrow_mut().push(old);
                            }
                            Err(e) => {
                                self.launch("allocating half matmul inputs", Err(e));
                                return None;
                            }
                        }
                    }
                    let n = src.len() as u64;
                    let (from, to) = (storage_id(None), storage_id(Some(kind)));
                    let mut l = Launch::new(&self.stream, &self.f.convert_values);
                    l.arg(&src).arg(&from).arg(&mut *dst).arg(&to).arg(&n);
                    // SAFETY: reads n floats of src, writes n halves of dst (at least n long).
                    self.launch("half cast", unsafe { l.launch(grid_vec(n as usize)) });
                    hold[slot] = Some(source);
                    self.address(&*dst)
                }
            };
        }
        self.half_inputs_hold.set(hold);
        Some(pointers)
    }

    /// `linear_forward` as one cuBLASLt product with the bias and the ReLU in its epilogue
    /// (`epilogue`), where that can run: true when it was queued (or failed, recorded).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn linear_by_epilogue(
        &self,
        x: &CudaBuf,
        params: &CudaBuf,
        w: usize,
        b: Option<usize>,
        y: &mut CudaBuf,
        (n, inp, out): (usize, usize, usize),
        then: Option<Activation>,
    ) -> bool {
        let relu = then == Some(Activation::Relu);
        let Some(epilogues) = self.epilogues.as_ref() else {
            return false;
        };
        if !self.fused_epilogues.get() || (then.is_some() && !relu) || (b.is_none() && !relu) {
            return false;
        }
        // The bias is read in the output's format: mixed precision's half copy with a
        // half-width output (autocast adds a bf16 bias too), f32 with f32 in fp32. Other
        // mixes take the other way.
        let half = self.half_matmuls.get();
        if params.half != half || y.half != half {
            return false;
        }
        let bytes = if half.is_some() { 2 } else { 4 };
        let bias = b.map_or(0, |b| self.address(&params.mem) + (bytes * b) as u64);
        if !bias.is_multiple_of(epilogue::BIAS_ALIGNMENT) {
            return false;
        }
        let cfg = column_major((n, out, inp), false, true, false);
        let inputs = [
            self.input(params, w..w + out * inp, HalfOperand::Convert),
            self.input(x, 0..n * inp, HalfOperand::Convert),
        ];
        let pointers = match half {
            Some(kind) => match self.half_pointers(kind, inputs) {
                Some(pointers) => pointers,
                None => return true,
            },
            None => inputs.map(|input| match input {
                Input::F32(view, _) => self.address(&view),
                Input::Half(at, _) => at,
            }),
        };
        let d = self.address(&y.mem);
        use cudarc::cublaslt::sys::cudaDataType_t as T;
        let format = match half {
            None => T::CUDA_R_32F,
            Some(HalfKind::F16) => T::CUDA_R_16F,
            Some(HalfKind::Bf16) => T::CUDA_R_16BF,
        };
        let product = epilogue::Product {
            transa: cfg.transa == cublasOperation_t::CUBLAS_OP_T,
            transb: cfg.transb == cublasOperation_t::CUBLAS_OP_T,
            m: cfg.m as u64,
            n: cfg.n as u64,
            k: cfg.k as u64,
            lda: cfg.lda as i64,
            ldb: cfg.ldb as i64,
            ldd: cfg.ldc as i64,
            inputs: format,
            output: format,
            tf32: half.is_none() && self.allow_tf32,
            bias: b.is_some(),
            relu,
            alignment: [pointers[0], pointers[1], d].map(epilogue::alignment),
        };
        let operands = epilogue::Operands {
            a: pointers[0],
            b: pointers[1],
            d,
            bias,
        };
        let workspace = (self.address(&self.workspace), CUBLAS_WORKSPACE);
        let stream = self.stream.cu_stream() as _;
        match epilogues.matmul(&product, &operands, workspace, stream) {
            Ok(queued) => queued,
            Err(e) => {
                self.record::<()>("linear forward (cuBLASLt)", Err(e));
                true
            }
        }
    }

    pub(crate) fn launch_error(&self, what: &str, why: &str) {
        self.record::<()>(what, Err(why));
    }

    /// Whether every one of `bufs` holds f32 values, as `what` reads them (parameters, their
    /// gradients, optimizer and layer state, targets: never half-width); else records why not.
    pub(crate) fn all_f32(&self, what: &str, bufs: &[&CudaBuf]) -> bool {
        let f32 = bufs.iter().all(|buf| buf.half.is_none());
        if !f32 {
            self.launch_error(what, "a half-width buffer where f32 values are read");
        }
        f32
    }

    /// An optimizer update's parameters, and where its kernel stores their half copy: the
    /// device address of a half-width buffer as long as the parameters and its storage, or
    /// (no copy) 0 and storage 0. Records why not and returns None for a copy that is not
    /// such a buffer.
    fn update_targets<'a>(
        &self,
        what: &str,
        out: UpdatedParams<'a, CudaBuf>,
    ) -> Option<(&'a mut CudaBuf, u64, i32)> {
        let UpdatedParams { params, half_copy } = out;
        match half_copy {
            None => Some((params, 0, 0)),
            Some((copy, kind)) if copy.half == Some(kind) && copy.len >= params.len => {
                Some((params, self.address(&copy.mem), copy.storage()))
            }
            Some(_) => {
                let why = "a half copy that is not a half-width buffer of the parameters' length";
                self.launch_error(what, why);
                None
            }
        }
    }

    /// Records a launch's failure, which the step reports (`status`).
    pub(crate) fn launch(
        &self,
        what: &str,
        r: std::result::Result<(), cudarc::driver::DriverError>,
    ) {
        self.record(what, r);
    }

    /// The stream every launch goes to.
    pub(crate) fn stream(&self) -> &CudaStream {
        &self.stream
    }

    /// The kernel `name` of the program (kernels::SOURCES), loaded when the backend opened.
    pub(crate) fn kernel(&self, name: &str) -> &CudaFunction {
        &self.by_name[name]
    }
}

impl Drop for CudaBackend {
    /// After a sticky CUDA error (an illegal address, say) nothing can be destroyed, and
    /// cudarc's cuBLAS and NCCL handles panic when their destruction fails: they are left to
    /// the process's exit then, so that the error already reported is what the user sees.
    /// The same when the queued work does not drain within seconds (an all-reduce waiting
    /// for a rank that is gone): the process ends rather than wait for it.
    fn drop(&mut self) {
        let ten_seconds = std::time::Duration::from_secs(10);
        let healthy = (self.stream.record_event(None))
            .is_ok_and(|queued| matches!(finished_within(&queued, ten_seconds), Ok(true)));
        let collective = self.collective.borrow_mut().take();
        if healthy {
            drop(collective);
            // SAFETY: `blas` and `epilogues` are not used after this.
            unsafe {
                std::mem::ManuallyDrop::drop(&mut self.blas);
                std::mem::ManuallyDrop::drop(&mut self.epilogues);
            }
        } else {
            std::mem::forget(collective);
        }
    }
}

/// A joined NCCL communicator (on a stream of its own) and the events that order its
/// all-reduces with the compute stream.
struct Collective {
    comm: cudarc::nccl::Comm,
    /// The mean's reduction: ncclAvg, or ncclSum for a communicator of one rank, where the
    /// mean is the values themselves. NCCL runs its one-rank kernel for ncclAvg (a scaling
    /// pass over the bucket) but nothing for an in-place ncclSum: 6% of a step of the
    /// launch-bound MLP 784-1024-1024-10 on an H100.
    mean: cudarc::nccl::ReduceOp,
    /// Recorded on the compute stream before a bucket's all-reduce, which waits for it.
    grads_ready: CudaEvent,
    /// Recorded on the communication stream by `all_reduce_wait`; the compute stream waits.
    averaged: CudaEvent,
    /// Recorded on the compute stream by `finish_collectives`, which polls it.
    finished: CudaEvent,
}

impl Capture for CudaBackend {
    type Graph = CudaGraph;
    const RECORDS: bool = true;

    fn begin_capture(&self) -> bool {
        if self.error.borrow().is_some() {
            return false;
        }
        match self
            .stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!("cannot record a CUDA graph ({e:?}); running without graphs");
                false
            }
        }
    }

    fn end_capture(&self) -> Option<CudaGraph> {
        let graph = self.stream.end_capture(CUgraphInstantiate_flags(0));
        // An op that failed while recording failed only the recording (nothing ran): the
        // caller runs the ops again unrecorded, and a real failure is reported then.
        let failed_op = self.error.borrow_mut().take();
        let why = match (graph, failed_op) {
            (Ok(Some(graph)), None) => match graph.upload() {
                Ok(()) => return Some(graph),
                Err(e) => format!("uploading it failed: {e:?}"),
            },
            (_, Some(op)) => op,
            (Ok(None), None) => "nothing was recorded".into(),
            (Err(e), None) => format!("{e:?}"),
        };
        tracing::warn!("cannot record a CUDA graph ({why}); running without graphs");
        None
    }

    fn replay(&self, graph: &CudaGraph) {
        self.record("replaying the CUDA graph", graph.launch());
    }

    fn release(&self, graph: CudaGraph) {
        // A queued replay must finish before its graph is destroyed.
        self.record("waiting for the GPU", self.stream.synchronize());
        drop(graph);
    }
}

impl CudaBackend {
    /// The loss kernels: each row's loss and hit, and the gradient into `dout` (its memory
    /// and storage) when given; `dout` may be `out`'s own memory (cross-entropy only).
    #[allow(clippy::too_many_arguments)]
    fn run_loss(
        &self,
        f: LossFn,
        out: &CudaBuf,
        targets: &CudaBuf,
        n: usize,
        dim: usize,
        grad_scale: f32,
        dout: Option<(&CudaSlice<f32>, i32)>,
        stats: &mut CudaSlice<f64>,
    ) {
        if !self.all_f32("loss", &[targets]) {
            return;
        }
        let write_grad = i32::from(dout.is_some());
        // Without a gradient the kernel never writes `dout`; it still needs a valid pointer.
        let (dout_ptr, ds) = dout.unwrap_or((&out.mem, out.storage()));
        let (targets, os) = (&targets.mem, out.storage());
        let (rows, width) = (n as u64, dim as u64);
        // Each row's loss and hit, then the number of rows scored.
        let mut row_stats = self.row_stats.borrow_mut();
        if row_stats.len() < 2 * n + 1 {
            match self.stream.alloc_zeros::<f64>(2 * n + 1) {
                Ok(grown) => {
                    self.count(grown.len() * 8);
                    let old = std::mem::replace(&mut *row_stats, grown);
                    self.retired.borrow_mut().push(old);
                }
                Err(e) => return self.launch("allocating loss statistics", Err(e)),
            }
        }
        // Rows with an ignored class: counted on the device first, so that the gradient is
        // the mean's over the others with nothing read back.
        let ignore = match f {
            LossFn::CrossEntropy {
                ignore_index: Some(i),
                ..
            } => Some(i as f32),
            _ => None,
        };
        let (counted, ignored_label) = (i32::from(ignore.is_some()), ignore.unwrap_or(0.0));
        if ignore.is_some() {
            let mut l = Launch::new(&self.stream, &self.f.count_scored);
            l.arg(targets)
                .arg(&rows)
                .arg(&ignored_label)
                .arg(&mut *row_stats);
            let one_block = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (1024, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: reads n labels, writes row_stats[2n].
            self.launch("loss rows scored", unsafe { l.launch(one_block) });
        }
        match f {
            LossFn::CrossEntropy {
                label_smoothing, ..
            } => {
                let mut l = Launch::new(&self.stream, &self.f.cross_entropy);
                l.arg(&out.mem)
                    .arg(&os)
                    .arg(targets)
                    .arg(&rows)
                    .arg(&width)
                    .arg(&label_smoothing)
                    .arg(&grad_scale)
                    .arg(&write_grad)
                    .arg(dout_ptr)
                    .arg(&ds)
                    .arg(&mut *row_stats)
                    .arg(&counted)
                    .arg(&ignored_label);
                let warps_per_block = (THREADS / 32) as usize;
                let cfg = LaunchConfig {
                    grid_dim: (n.div_ceil(warps_per_block).max(1) as u32, 1, 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: one warp per row reads `dim` logits and a label, writes `dim`
                // gradients when asked, and two doubles of row_stats.
                self.launch("cross-entropy", unsafe { l.launch(cfg) });
            }
            LossFn::Mse | LossFn::BceWithLogits => {
                let kind = i32::from(f == LossFn::BceWithLogits);
                let mut l = Launch::new(&self.stream, &self.f.elementwise_loss);
                l.arg(&kind)
                    .arg(&out.mem)
                    .arg(&os)
                    .arg(targets)
                    .arg(&rows)
                    .arg(&width)
                    .arg(&grad_scale)
                    .arg(&write_grad)
                    .arg(dout_ptr)
                    .arg(&ds)
                    .arg(&mut *row_stats);
                let cfg = LaunchConfig {
                    grid_dim: (n.div_ceil(THREADS as usize).max(1) as u32, 1, 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: one thread per sample reads/writes its `dim` values and two doubles
                // of row_stats.
                self.launch("loss", unsafe { l.launch(cfg) });
            }
        }
        let mut l = Launch::new(&self.stream, &self.f.reduce_stats);
        l.arg(&*row_stats).arg(&rows).arg(&counted).arg(&mut *stats);
        let one_block = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: reads 2n + 1 doubles of row_stats, adds to the three of stats.
        self.launch("loss statistics", unsafe { l.launch(one_block) });
    }
}

impl Backend for CudaBackend {
    type Buf = CudaBuf;
    type Ids = CudaIds;
    type Stats = CudaSlice<f64>;
    type Mark = CudaEvent;

    /// An event with timing (cudarc's default turns it off).
    fn new_mark(&self) -> Result<CudaEvent> {
        let flags = cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        (self.stream.context().new_event(Some(flags)))
            .map_err(|e| cuda_err("creating a timing event", e))
    }

    fn set_mark(&self, mark: &mut CudaEvent) {
        self.record("recording a timing event", mark.record(&self.stream));
    }

    fn between(&self, from: &CudaEvent, to: &CudaEvent) -> std::time::Duration {
        let ms = self.record("reading a timing event", from.elapsed_ms(to));
        std::time::Duration::from_secs_f64(f64::from(ms.unwrap_or(0.0)).max(0.0) / 1e3)
    }

    fn collective_id(&self) -> Result<Option<Vec<u8>>> {
        if let Some(why) = nccl_missing() {
            return Err(Error::Job(why));
        }
        let id = cudarc::nccl::Id::new()
            .map_err(|e| Error::Runtime(format!("NCCL: creating a unique id failed: {:?}", e.0)))?;
        Ok(Some(id.internal().iter().map(|&c| c as u8).collect()))
    }

    fn join_collective(&self, id: &[u8], rank: usize, world: usize) -> Result<()> {
        if let Some(why) = nccl_missing() {
            return Err(Error::Job(format!("rank {rank}: {why}")));
        }
        let mut internal = [0 as std::ffi::c_char; 128];
        if id.len() != internal.len() {
            return Err(Error::Runtime(format!(
                "rank {rank}: rank 0 sent an NCCL id of {} bytes, not 128",
                id.len()
            )));
        }
        for (c, &b) in internal.iter_mut().zip(id) {
            *c = b as std::ffi::c_char;
        }
        // NCCL takes the device from the calling thread's context.
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the context", e))?;
        // The all-reduces run on a stream of their own, so that they overlap the backward
        // pass; events order them after the gradients they read and before what reads
        // the averages.
        let comm_stream =
            (self.stream.fork()).map_err(|e| cuda_err("creating the communication stream", e))?;
        let event = || {
            (self.stream.context().new_event(None)).map_err(|e| cuda_err("creating an event", e))
        };
        let (grads_ready, averaged, finished) = (event()?, event()?, event()?);
        let comm = cudarc::nccl::Comm::from_rank(
            comm_stream,
            rank,
            world,
            cudarc::nccl::Id::uninit(internal),
        )
        .map_err(|e| {
            Error::Runtime(format!(
                "NCCL: joining the communicator as rank {rank} of {world} failed ({:?}); \
                 ranks sharing one GPU cannot use NCCL: give each rank its own GPU \
                 (device.type = \"cuda\" takes LOCAL_RANK's) or set parallel.backend = \"tcp\"",
                e.0
            ))
        })?;
        let mean = if world == 1 {
            cudarc::nccl::ReduceOp::Sum
        } else {
            cudarc::nccl::ReduceOp::Avg
        };
        *self.collective.borrow_mut() = Some(Collective {
            comm,
            mean,
            grads_ready,
            averaged,
            finished,
        });
        Ok(())
    }

    fn all_reduce_mean_start(&self, buf: &mut CudaBuf, range: std::ops::Range<usize>) {
        if !self.all_f32("NCCL all-reduce", &[buf]) {
            return;
        }
        let buf = &mut buf.mem;
        let collective = self.collective.borrow();
        let Some(c) = collective.as_ref() else {
            self.record::<()>("NCCL all-reduce", Err("no communicator was joined"));
            return;
        };
        let comm_stream = c.comm.stream();
        let ordered =
            (c.grads_ready.record(&self.stream)).and_then(|()| comm_stream.wait(&c.grads_ready));
        if self
            .record("ordering the all-reduce after the backward pass", ordered)
            .is_none()
        {
            return;
        }
        let mut bucket = buf.slice_mut(range);
        let r = c.comm.all_reduce_in_place(&mut bucket, &c.mean);
        self.record("NCCL all-reduce", r.map_err(|e| e.0));
    }

    fn all_reduce_wait(&self) {
        let collective = self.collective.borrow();
        let Some(c) = collective.as_ref() else {
            return;
        };
        let joined =
            (c.averaged.record(&c.comm.stream())).and_then(|()| self.stream.wait(&c.averaged));
        self.record("waiting for the all-reduce", joined);
    }

    fn finish_collectives(&self, timeout: std::time::Duration) -> Result<()> {
        let collective = self.collective.borrow();
        let Some(c) = collective.as_ref() else {
            return Ok(());
        };
        (c.finished.record(&self.stream)).map_err(|e| cuda_err("recording an event", e))?;
        let finished = finished_within(&c.finished, timeout)
            .map_err(|e| cuda_err("waiting for the all-reduce", e))?;
        if finished {
            return Ok(());
        }
        drop(collective);
        // ncclCommAbort (the communicator's drop) ends the all-reduces still waiting.
        drop(self.collective.borrow_mut().take());
        Err(Error::Runtime(format!(
            "NCCL: an all-reduce of the gradients did not finish within parallel.timeout \
             ({}s): another rank is gone or stuck",
            timeout.as_secs_f64()
        )))
    }

    fn describe(&self) -> String {
        self.description.clone()
    }

    fn alloc(&self, len: usize) -> Result<CudaBuf> {
        self.alloc_buf(len, None)
    }

    /// Stored in `kind` (`CudaBuf`): half the bytes, and every write rounds.
    fn alloc_half(&self, kind: HalfKind, len: usize) -> Result<CudaBuf> {
        self.alloc_buf(len, Some(kind))
    }

    fn upload_vec(&self, data: Vec<f32>) -> Result<CudaBuf> {
        let mut buf = self.alloc(data.len())?;
        self.upload(&data, &mut buf);
        Ok(buf)
    }

    fn upload(&self, src: &[f32], dst: &mut CudaBuf) {
        if src.is_empty() {
            return;
        }
        if let Some(kind) = dst.half {
            // Whole packed elements: an odd-length upload also zeroes the value after it.
            let packed = pack_halves(kind, src);
            let r = (self.stream).memcpy_htod(&packed, &mut dst.mem.slice_mut(..packed.len()));
            return self.launch("copy to the device", r);
        }
        let r = self
            .stream
            .memcpy_htod(src, &mut dst.mem.slice_mut(..src.len()));
        self.record("copy to the device", r);
    }

    fn download_at(&self, src: &CudaBuf, start: usize, dst: &mut [f32]) {
        if dst.is_empty() {
            return;
        }
        let Some(kind) = src.half else {
            let r = (self.stream).memcpy_dtoh(&src.mem.slice(start..start + dst.len()), dst);
            return self.launch("copy from the device", r);
        };
        // The packed elements that hold values start..start + len.
        let (first, last) = (start / 2, (start + dst.len()).div_ceil(2));
        let mut packed = vec![0.0f32; last - first];
        let r = (self.stream).memcpy_dtoh(&src.mem.slice(first..last), &mut packed[..]);
        if self.record("copy from the device", r).is_some() {
            let values = unpack_halves(kind, &packed);
            dst.copy_from_slice(&values[start - 2 * first..][..dst.len()]);
        }
    }

    fn fill(&self, buf: &mut CudaBuf, value: f32) {
        let (n, storage) = (buf.len as u64, buf.storage());
        let mut b = Launch::new(&self.stream, &self.f.fill);
        b.arg(&mut buf.mem).arg(&storage).arg(&n).arg(&value);
        // SAFETY: writes the n values of buf in its storage.
        self.launch("fill", unsafe { b.launch(grid_vec(n as usize)) });
    }

    fn fill_range(&self, buf: &mut CudaBuf, range: Range<usize>, value: f32) {
        if !self.all_f32("fill", &[buf]) || range.is_empty() {
            return;
        }
        let (n, storage) = (range.len() as u64, storage_id(None));
        let mut part = buf.mem.slice_mut(range);
        let mut b = Launch::new(&self.stream, &self.f.fill);
        b.arg(&mut part).arg(&storage).arg(&n).arg(&value);
        // SAFETY: writes the n f32 values of the view.
        self.launch("fill", unsafe { b.launch(grid_vec(n as usize)) });
    }

    fn copy(&self, src: &CudaBuf, dst: &mut CudaBuf, len: usize) {
        if len == 0 {
            return;
        }
        if src.half.is_some() || dst.half.is_some() {
            let (n, ss, ds) = (len as u64, src.storage(), dst.storage());
            let mut l = Launch::new(&self.stream, &self.f.convert_values);
            l.arg(&src.mem).arg(&ss).arg(&mut dst.mem).arg(&ds).arg(&n);
            // SAFETY: len <= both lengths (the trait's contract).
            return self.launch("convert", unsafe { l.launch(grid_vec(len)) });
        }
        let r = (self.stream).memcpy_dtod(&src.mem.slice(..len), &mut dst.mem.slice_mut(..len));
        self.record("device copy", r);
    }

    fn gather_rows(&self, src: &CudaBuf, rows: &[u64], at: RowsAt, dst: &mut CudaBuf) {
        if rows.is_empty() {
            return;
        }
        if src.half.is_some() {
            return self.launch_error("gather", "a data set in a half-width buffer");
        }
        let Some(index) = self.batch_rows(rows) else {
            return;
        };
        let (n_rows, ds) = (rows.len() as u64, dst.storage());
        let [row_len, stride, offset] = [at.len, at.stride, at.offset].map(|v| v as u64);
        let mut b = Launch::new(&self.stream, &self.f.gather_rows);
        b.arg(&src.mem).arg(&*index).arg(&n_rows).arg(&row_len);
        b.arg(&stride).arg(&offset).arg(&mut dst.mem).arg(&ds);
        // SAFETY: reads src rows named by index (validated < dataset length by the loader),
        // writes n_rows·row_len elements of dst.
        self.launch("gather", unsafe {
            b.launch(grid((n_rows * row_len) as usize))
        });
    }

    fn upload_rows(&self, src: &[f32], rows: &[u64], at: RowsAt, dst: &mut CudaBuf) {
        if rows.is_empty() {
            return;
        }
        // A staging buffer is as long as `dst`: a pinned buffer is copied whole, and the
        // values past this batch's rows are never read.
        let Some(mut slot) = self.next_staging(dst.mem.len()) else {
            return;
        };
        let (staged, copied) = &mut *slot;
        // The slot's previous copy is done (`next_staging` waited for its event).
        let Some(host) = self.record("writing a staging buffer", staged.as_mut_slice()) else {
            return;
        };
        let (row_len, batch) = (at.len, rows.iter().map(|&r| at.start(r)));
        match dst.half {
            None => {
                for (out, start) in host.chunks_exact_mut(row_len).zip(batch) {
                    out.copy_from_slice(&src[start..start + row_len]);
                }
            }
            // A half-width input: rounded on the host (as the gather kernel would), packed
            // as the device stores it.
            Some(kind) => {
                let halves: &mut [u16] = bytemuck::cast_slice_mut(host);
                for (out, start) in halves.chunks_exact_mut(row_len).zip(batch) {
                    cast::to_half(kind, &src[start..start + row_len], out);
                }
            }
        }
        let r = self.stream.memcpy_htod(&*staged, &mut dst.mem);
        self.batch_copied(r, copied);
    }

    fn upload_ids(&self, ids: Vec<u32>) -> Result<CudaIds> {
        let len = ids.len();
        let mem = self.stream.alloc_zeros::<u32>(len.max(1)).map_err(|e| {
            Error::Runtime(format!(
                "CUDA: cannot allocate {} bytes on {}: {e:?}",
                len * 4,
                self.description
            ))
        })?;
        // As `alloc_buf` counts an empty buffer: as nothing.
        self.count(len * 4);
        let mut out = CudaIds { mem, len };
        self.write_ids(&ids, &mut out);
        Ok(out)
    }

    fn write_ids(&self, src: &[u32], dst: &mut CudaIds) {
        if src.is_empty() {
            return;
        }
        let r = (self.stream).memcpy_htod(src, &mut dst.mem.slice_mut(..src.len()));
        self.record("copying token ids to the device", r);
    }

    fn gather_ids(&self, src: &CudaIds, rows: &[u64], at: RowsAt, dst: IdsInto<'_, Self>) {
        if rows.is_empty() {
            return;
        }
        let Some(index) = self.batch_rows(rows) else {
            return;
        };
        let n_rows = rows.len() as u64;
        let [row_len, stride, offset] = [at.len, at.stride, at.offset].map(|v| v as u64);
        let mut b = Launch::new(&self.stream, &self.f.gather_ids);
        b.arg(&src.mem).arg(&*index).arg(&n_rows).arg(&row_len);
        b.arg(&stride).arg(&offset);
        // The kernel's storage id -1: u32 ids.
        let ds = match dst {
            IdsInto::Ids(ids) => {
                b.arg(&mut ids.mem);
                -1
            }
            IdsInto::Values(values) => {
                b.arg(&mut values.mem);
                values.storage()
            }
        };
        b.arg(&ds);
        // SAFETY: reads src rows named by index (validated < the data's length by the
        // loader), writes n_rows·row_len elements of dst.
        self.launch("gather token ids", unsafe {
            b.launch(grid((n_rows * row_len) as usize))
        });
    }

    fn upload_id_rows(&self, src: &dyn HostIds, rows: &[u64], at: RowsAt, dst: IdsInto<'_, Self>) {
        if rows.is_empty() {
            return;
        }
        let elements = match &dst {
            IdsInto::Ids(ids) => ids.mem.len(),
            IdsInto::Values(values) => values.mem.len(),
        };
        let Some(mut slot) = self.next_staging(elements) else {
            return;
        };
        let (staged, copied) = &mut *slot;
        // The slot's previous copy is done (`next_staging` waited for its event).
        let Some(host) = self.record("writing a staging buffer", staged.as_mut_slice()) else {
            return;
        };
        let (row_len, starts) = (at.len, rows.iter().map(|&r| at.start(r)));
        let r = match dst {
            IdsInto::Ids(ids) => {
                let words: &mut [u32] = bytemuck::cast_slice_mut(host);
                for (out, start) in words.chunks_exact_mut(row_len).zip(starts) {
                    src.copy_ids(start, out);
                }
                // SAFETY: the staging buffer holds u32 words, as many as ids.mem.
                let Some(mut words) = (unsafe { ids.mem.transmute_mut::<f32>(elements) }) else {
                    return self.launch_error("upload token ids", "a staging buffer's length");
                };
                self.stream.memcpy_htod(&*staged, &mut words)
            }
            IdsInto::Values(values) => {
                if values.half.is_some() {
                    return self.launch_error("upload token ids", "values in a half-width buffer");
                }
                // Each id copied into its value's bits, then converted there.
                for (out, start) in host.chunks_exact_mut(row_len).zip(starts) {
                    src.copy_ids(start, bytemuck::cast_slice_mut(out));
                    out.iter_mut().for_each(|v| *v = v.to_bits() as f32);
                }
                self.stream.memcpy_htod(&*staged, &mut values.mem)
            }
        };
        self.batch_copied(r, copied);
    }

    fn free_memory(&self) -> Option<usize> {
        let bound = self.stream.context().bind_to_thread();
        let info = bound.and_then(|()| cudarc::driver::result::mem_get_info());
        self.record("asking for free memory", info)
            .map(|(free, _)| free)
    }

    fn loss(
        &self,
        f: LossFn,
        out: &CudaBuf,
        targets: &CudaBuf,
        n: usize,
        dim: usize,
        grad_scale: f32,
        dout: Option<&mut CudaBuf>,
        stats: &mut CudaSlice<f64>,
    ) {
        let dout = dout.map(|d| (&d.mem, d.storage()));
        self.run_loss(f, out, targets, n, dim, grad_scale, dout, stats);
    }

    fn cross_entropy_over_output(
        &self,
        label_smoothing: f32,
        ignore_index: Option<u32>,
        out: &mut CudaBuf,
        targets: &CudaBuf,
        n: usize,
        dim: usize,
        grad_scale: f32,
        stats: &mut CudaSlice<f64>,
    ) {
        let f = LossFn::CrossEntropy {
            label_smoothing,
            ignore_index,
        };
        // The kernel reads a row's logits before it writes their gradient.
        let dout = Some((&out.mem, out.storage()));
        self.run_loss(f, out, targets, n, dim, grad_scale, dout, stats);
    }

    fn new_stats(&self) -> Result<CudaSlice<f64>> {
        let s = self
            .stream
            .alloc_zeros::<f64>(LOSS_STATS)
            .map_err(|e| cuda_err("allocating", e))?;
        self.count(8 * LOSS_STATS);
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

    fn set_stats(&self, stats: &mut CudaSlice<f64>, value: LossStats) {
        let host = [value.loss_sum, value.correct, value.samples];
        let r = self.stream.memcpy_htod(&host[..], stats);
        self.record("restoring loss statistics", r);
    }

    fn sum_squares(&self, buf: &CudaBuf) -> f64 {
        if !self.all_f32("gradient norm", &[buf]) {
            return f64::NAN;
        }
        let buf = &buf.mem;
        self.sum_squares_on_device(buf);
        self.read_sum_squares()
    }

    fn clip_to_norm(&self, grads: &mut CudaBuf, max_norm: f64, read: Option<&mut f64>) {
        if !self.all_f32("clipping", &[grads]) {
            return;
        }
        let grads = &mut grads.mem;
        self.sum_squares_on_device(grads);
        {
            let sum_sq = self.norm.borrow();
            let n = grads.len() as u64;
            let mut l = Launch::new(&self.stream, &self.f.clip_by_norm);
            l.arg(&mut *grads).arg(&n).arg(&*sum_sq).arg(&max_norm);
            // SAFETY: scales n elements of grads in place; reads one double.
            self.launch("clipping", unsafe { l.launch(grid(n as usize)) });
        }
        if let Some(out) = read {
            *out = self.read_sum_squares().sqrt();
        }
    }

    fn last_clip_norm(&self) -> Option<f64> {
        Some(self.read_sum_squares().sqrt())
    }

    fn scale(&self, buf: &mut CudaBuf, factor: f32) {
        if !self.all_f32("scale", &[buf]) {
            return;
        }
        let buf = &mut buf.mem;
        let n = buf.len() as u64;
        let mut l = Launch::new(&self.stream, &self.f.scale);
        l.arg(&mut *buf).arg(&n).arg(&factor);
        // SAFETY: scales n elements in place.
        self.launch("scale", unsafe { l.launch(grid_vec(n as usize)) });
    }

    fn add_assign(&self, src: &CudaBuf, dst: &mut CudaBuf, len: usize) {
        let (n, ss, ds) = (len as u64, src.storage(), dst.storage());
        let mut l = Launch::new(&self.stream, &self.f.add_assign);
        l.arg(&src.mem).arg(&ss).arg(&mut dst.mem).arg(&ds).arg(&n);
        // SAFETY: n <= both lengths.
        self.launch("add", unsafe { l.launch(grid_vec(len)) });
    }

    fn copy_rows(
        &self,
        src: &CudaBuf,
        (src_stride, src_offset): (usize, usize),
        dst: &mut CudaBuf,
        (dst_stride, dst_offset): (usize, usize),
        width: usize,
        rows: usize,
        add: bool,
    ) {
        let [ss, so, ds, dof, w, r] =
            [src_stride, src_offset, dst_stride, dst_offset, width, rows].map(|v| v as u64);
        let (add, src_storage, dst_storage) = (i32::from(add), src.storage(), dst.storage());
        let mut l = Launch::new(&self.stream, &self.f.copy_rows);
        l.arg(&src.mem).arg(&src_storage).arg(&ss).arg(&so);
        l.arg(&mut dst.mem).arg(&dst_storage).arg(&ds).arg(&dof);
        l.arg(&w).arg(&r).arg(&add);
        // SAFETY: the rows lie inside both buffers (the graph's shapes).
        self.launch("copy rows", unsafe { l.launch(grid(rows * width)) });
    }

    fn batched_matmul(
        &self,
        shape: (usize, usize, usize),
        batch: usize,
        a: &CudaBuf,
        a_at: Matrices,
        b: &CudaBuf,
        b_at: Matrices,
        c: &mut CudaBuf,
        c_at: Matrices,
        accumulate: bool,
    ) {
        if !self.all_f32("batched matrix product", &[a, b, c]) {
            return;
        }
        let (a, b, mut c) = (a.mem.as_view(), b.mem.as_view(), c.mem.as_view_mut());
        let what = "batched matrix product";
        let operands = [(&a, a_at), (&b, b_at)];
        self.strided_gemm(what, shape, batch, operands, (&mut c, c_at), accumulate);
    }

    fn round_to_half(&self, kind: HalfKind, buf: &mut CudaBuf, len: usize) {
        if let Some(stored) = buf.half {
            // Every write rounded already.
            if stored != kind {
                self.launch_error("round_to_half", "a buffer stored in the other half format");
            }
            return;
        }
        let (n, kind) = (len as u64, half_id(kind));
        let mut l = Launch::new(&self.stream, &self.f.round_to_half);
        l.arg(&mut buf.mem).arg(&n).arg(&kind);
        // SAFETY: rounds the first len <= buf.len() elements in place.
        self.launch("round_to_half", unsafe { l.launch(grid_vec(len)) });
    }

    fn sgd_step(
        &self,
        out: UpdatedParams<'_, CudaBuf>,
        grads: &CudaBuf,
        momentum: &mut CudaBuf,
        h: &SgdStep,
        args: &CudaBuf,
        decays: Option<&CudaBuf>,
    ) {
        let Some((params, half_copy, half_s)) = self.update_targets("sgd step", out) else {
            return;
        };
        if !self.all_f32("sgd step", &[params, grads, momentum, args]) {
            return;
        }
        let params = &mut params.mem;
        let grads = &grads.mem;
        let momentum = &mut momentum.mem;
        let args = &args.mem;
        let n = params.len() as u64;
        let nesterov = i32::from(h.nesterov);
        let mut l = Launch::new(&self.stream, &self.f.sgd_step);
        l.arg(&mut *params)
            .arg(grads)
            .arg(&mut *momentum)
            .arg(&n)
            .arg(&h.momentum)
            .arg(&h.dampening)
            .arg(&nesterov)
            .arg(&h.weight_decay)
            .arg(args)
            .arg(&half_copy)
            .arg(&half_s);
        // Without a mask the kernel is told so, and given `args` to hold instead.
        let has_decays = i32::from(decays.is_some());
        l.arg(decays.map_or(args, |k| &k.mem)).arg(&has_decays);
        // SAFETY: updates n parameters; the momentum buffer (n long when momentum != 0) is only
        // touched when momentum != 0; the half copy (n long) only when half_s != 0.
        self.launch("sgd step", unsafe { l.launch(grid(n as usize)) });
    }

    fn adam_step(
        &self,
        out: UpdatedParams<'_, CudaBuf>,
        grads: &CudaBuf,
        exp_avg: &mut CudaBuf,
        exp_avg_sq: &mut CudaBuf,
        h: &AdamStep,
        args: &CudaBuf,
        decays: Option<&CudaBuf>,
    ) {
        let Some((params, half_copy, half_s)) = self.update_targets("adam step", out) else {
            return;
        };
        if !self.all_f32("adam step", &[params, grads, exp_avg, exp_avg_sq, args]) {
            return;
        }
        let params = &mut params.mem;
        let grads = &grads.mem;
        let exp_avg = &mut exp_avg.mem;
        let exp_avg_sq = &mut exp_avg_sq.mem;
        let args = &args.mem;
        let n = params.len() as u64;
        let l2 = h.l2();
        let mut l = Launch::new(&self.stream, &self.f.adam_step);
        l.arg(&mut *params)
            .arg(grads)
            .arg(&mut *exp_avg)
            .arg(&mut *exp_avg_sq)
            .arg(&n)
            .arg(&h.beta1)
            .arg(&h.beta2)
            .arg(&h.eps)
            .arg(&l2)
            .arg(args)
            .arg(&half_copy)
            .arg(&half_s);
        // Without a mask the kernel is told so, and given `args` to hold instead.
        let has_decays = i32::from(decays.is_some());
        l.arg(decays.map_or(args, |k| &k.mem)).arg(&has_decays);
        // SAFETY: updates n elements of each buffer (of the half copy only when half_s != 0).
        self.launch("adam step", unsafe { l.launch(grid(n as usize)) });
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

    fn synchronize(&self) {
        self.record("waiting for the GPU", self.stream.synchronize());
    }
}

/// The kernels' storage id of values in `half` (kernels/cast.cu's `load`): 0 f32, 1 f16,
/// 2 bf16.
pub(crate) fn storage_id(half: Option<HalfKind>) -> i32 {
    match half {
        None => 0,
        Some(HalfKind::F16) => 1,
        Some(HalfKind::Bf16) => 2,
    }
}

/// The kernels' half format (`round_to_half` and the `*_rounding` kernels): 0 f16, 1 bf16.
pub(crate) fn half_id(kind: HalfKind) -> i32 {
    i32::from(kind == HalfKind::Bf16)
}
