//! Matrix products whose bias and ReLU cuBLASLt applies as it writes the output (its
//! "epilogue"), in place of a pass that fills the output with the bias before the product
//! (which the product then reads back, beta = 1) and a pass that applies the ReLU after it:
//! each of those reads or writes the whole output. PyTorch's linear layers use the same
//! epilogue for their bias.
//!
//! A product is planned once per shape (descriptors, layouts, the heuristic's algorithm),
//! and the plan reused: the training step does no allocation or heuristic search. A shape
//! for which cuBLASLt has no algorithm is remembered, and the caller computes it as before.

use cudarc::cublaslt::result::{self, CublasError};
use cudarc::cublaslt::sys;
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;

/// A column-major product D[m, n] = op(A)·op(B) (+ bias[m], broadcast over columns) (then
/// ReLU), as cuBLAS sees a row-major product.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Product {
    pub transa: bool,
    pub transb: bool,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub lda: i64,
    pub ldb: i64,
    pub ldd: i64,
    /// The format of A and B.
    pub inputs: sys::cudaDataType,
    /// The format of D, and of the bias.
    pub output: sys::cudaDataType,
    /// f32 inputs multiplied as TensorFloat-32 (`device.allow_tf32`).
    pub tf32: bool,
    pub bias: bool,
    pub relu: bool,
    /// The largest power of two (up to 256) that divides A's, B's and D's addresses: the
    /// heuristic assumes 256 unless told, and an algorithm that needs more than a pointer
    /// has cannot run on it.
    pub alignment: [u32; 3],
}

impl std::fmt::Display for Product {
    /// "the [4096 x 784]·[784 x 256] CUDA_R_16BF product (bias, ReLU)", for warnings.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (m, n, k) = (self.m, self.n, self.k);
        let format = self.inputs;
        write!(f, "the [{m} x {k}]·[{k} x {n}] {format:?} product")?;
        match (self.bias, self.relu) {
            (true, true) => write!(f, " (bias, ReLU)"),
            (true, false) => write!(f, " (bias)"),
            (false, true) => write!(f, " (ReLU)"),
            (false, false) => Ok(()),
        }
    }
}

/// Device addresses of a product's operands.
pub struct Operands {
    pub a: u64,
    pub b: u64,
    pub d: u64,
    /// Ignored without `Product::bias`.
    pub bias: u64,
}

/// The bytes an epilogue's bias address must be a multiple of (cuBLASLt has no preference
/// for it; 16 is what its vectorised epilogues read, and what Marian found it needs).
pub const BIAS_ALIGNMENT: u64 = 16;

/// The largest power of two, up to 256, dividing `address`.
pub fn alignment(address: u64) -> u32 {
    1 << address.trailing_zeros().min(8)
}

/// A cuBLASLt handle and the products planned with it.
pub struct Epilogues {
    handle: sys::cublasLtHandle_t,
    /// None: cuBLASLt has no algorithm for the product.
    plans: RefCell<HashMap<Product, Option<Plan>>>,
    /// Whether a product it turned down has been warned of.
    warned: std::cell::Cell<bool>,
}

/// What `cublasLtMatmul` needs besides the operands' addresses.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created by `Plan::new`, destroyed once. Failures (after a sticky device
        // error) leave them to the process's exit.
        unsafe {
            let _ = result::destroy_matmul_desc(self.desc);
            for layout in self.layouts.into_iter().filter(|l| !l.is_null()) {
                let _ = result::destroy_matrix_layout(layout);
            }
        }
    }
}

impl Drop for Epilogues {
    fn drop(&mut self) {
        self.plans.borrow_mut().clear();
        // SAFETY: the handle is not used after this.
        let _ = unsafe { result::destroy_handle(self.handle) };
    }
}

impl Epilogues {
    /// A cuBLASLt handle, or why there is none (no libcublasLt: the products then run as
    /// before).
    pub fn new() -> Result<Self, String> {
        // SAFETY: only loads the library.
        if !unsafe { sys::is_culib_present() } {
            return Err("libcublasLt was not found".into());
        }
        let handle = result::create_handle().map_err(|e| format!("cublasLtCreate: {e:?}"))?;
        Ok(Epilogues {
            handle,
            plans: RefCell::new(HashMap::new()),
            warned: std::cell::Cell::new(false),
        })
    }

    /// Queues `product` on `stream`, using `workspace` (bytes at a device address). Ok(false):
    /// cuBLASLt could not describe it, has no algorithm for it, or refused the one its
    /// heuristic offered (NOT_SUPPORTED or INVALID_VALUE, answers it gives before queuing
    /// anything): nothing was queued, and the caller computes the product its own way, as it
    /// will every later time. Err: a failure after cuBLASLt accepted the product.
    pub fn matmul(
        &self,
        product: &Product,
        operands: &Operands,
        workspace: (u64, usize),
        stream: sys::cudaStream_t,
    ) -> Result<bool, CublasError> {
        let mut plans = self.plans.borrow_mut();
        if !plans.contains_key(product) {
            let plan = Plan::new(self.handle, product, workspace.1).unwrap_or_else(|e| {
                self.fall_back(format!("could not plan {product} ({:?})", e.0));
                None
            });
            plans.insert(*product, plan);
        }
        let Some(plan) = &plans[product] else {
            return Ok(false);
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the plan's descriptors are live; the caller vouches for the addresses
        // (each holds the elements the layouts describe) and the workspace; alpha, beta and
        // the bias address are read during the calls.
        let status = unsafe {
            if product.bias {
                set_desc(
                    plan.desc,
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    &operands.bias,
                )?;
            }
            let [a, b, d] = plan.layouts;
            sys::cublasLtMatmul(
                self.handle,
                plan.desc,
                (&alpha as *const f32).cast(),
                operands.a as *const c_void,
                a,
                operands.b as *const c_void,
                b,
                (&beta as *const f32).cast(),
                operands.d as *const c_void,
                d,
                operands.d as *mut c_void,
                d,
                &plan.algo,
                workspace.0 as *mut c_void,
                workspace.1,
                stream,
            )
            .result()
        };
        use sys::cublasStatus_t::{CUBLAS_STATUS_INVALID_VALUE, CUBLAS_STATUS_NOT_SUPPORTED};
        match status {
            Err(CublasError(why @ (CUBLAS_STATUS_NOT_SUPPORTED | CUBLAS_STATUS_INVALID_VALUE))) => {
                self.fall_back(format!(
                    "refused {product} ({why:?}), which it had planned (alignments {:?})",
                    product.alignment
                ));
                plans.insert(*product, None);
                Ok(false)
            }
            status => status.map(|()| true),
        }
    }

    /// Says why cuBLASLt does not compute a product (`what` it did): a warning the first
    /// time, then at debug level, since a cause such as a missing feature refuses every
    /// shape alike.
    fn fall_back(&self, what: String) {
        let consequence = "it runs through cuBLAS and a bias pass from now on";
        if self.warned.replace(true) {
            tracing::debug!("cuBLASLt {what}; {consequence}");
        } else {
            tracing::warn!(
                "cuBLASLt {what}; {consequence} (other products it turns down are logged at \
                 debug level)"
            );
        }
    }
}

/// Sets a descriptor attribute to `value`'s bytes.
///
/// # Safety
/// `desc` must be live, and `T` the attribute's type.
unsafe fn set_desc<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> Result<(), CublasError> {
    let size = std::mem::size_of::<T>();
    result::set_matmul_desc_attribute(desc, attr, (value as *const T).cast(), size)
}

impl Plan {
    /// Descriptors and the heuristic's first algorithm for `p`; None if it has none. Err: a
    /// descriptor could not be made or set, or the heuristic failed.
    fn new(
        handle: sys::cublasLtHandle_t,
        p: &Product,
        workspace: usize,
    ) -> Result<Option<Self>, CublasError> {
        use sys::cublasLtEpilogue_t as E;
        use sys::cublasLtMatmulDescAttributes_t as D;
        use sys::cublasLtMatmulPreferenceAttributes_t as P;
        let compute = if p.tf32 {
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
        } else {
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
        };
        let mut plan = Plan {
            desc: result::create_matmul_desc(compute, sys::cudaDataType_t::CUDA_R_32F)?,
            layouts: [std::ptr::null_mut(); 3],
            algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] },
        };
        // Owned by `plan` from here: an error below destroys what was made.
        let (a_rows, a_cols) = if p.transa { (p.k, p.m) } else { (p.m, p.k) };
        let (b_rows, b_cols) = if p.transb { (p.n, p.k) } else { (p.k, p.n) };
        let shapes = [
            (p.inputs, a_rows, a_cols, p.lda),
            (p.inputs, b_rows, b_cols, p.ldb),
            (p.output, p.m, p.n, p.ldd),
        ];
        for (slot, (format, rows, cols, ld)) in plan.layouts.iter_mut().zip(shapes) {
            *slot = result::create_matrix_layout(format, rows, cols, ld)?;
        }
        let (desc, layouts) = (plan.desc, plan.layouts);
        let op = |t: bool| i32::from(t); // CUBLAS_OP_T = 1, CUBLAS_OP_N = 0
        let epilogue = match (p.bias, p.relu) {
            (true, true) => E::CUBLASLT_EPILOGUE_RELU_BIAS,
            (true, false) => E::CUBLASLT_EPILOGUE_BIAS,
            (false, true) => E::CUBLASLT_EPILOGUE_RELU,
            (false, false) => E::CUBLASLT_EPILOGUE_DEFAULT,
        };
        let pref = result::create_matmul_pref()?;
        // SAFETY: descriptors live (the preference destroyed below); each value has the
        // attribute's type (i32 operations, u32 epilogue and alignments, u64 workspace).
        let found = unsafe {
            let set = || -> Result<(), CublasError> {
                set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSA, &op(p.transa))?;
                set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSB, &op(p.transb))?;
                set_desc(desc, D::CUBLASLT_MATMUL_DESC_EPILOGUE, &(epilogue as u32))?;
                let workspace = workspace as u64;
                let bytes = std::mem::size_of::<u64>();
                let at = (&workspace as *const u64).cast();
                result::set_matmul_pref_attribute(
                    pref,
                    P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    at,
                    bytes,
                )?;
                let [a, b, d] = p.alignment;
                for (attr, bytes) in [
                    (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, a),
                    (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, b),
                    (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, d),
                    (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, d),
                ] {
                    let at = (&bytes as *const u32).cast();
                    result::set_matmul_pref_attribute(pref, attr, at, 4)?;
                }
                Ok(())
            };
            let outcome = set().and_then(|()| {
                let mut found =
                    std::mem::MaybeUninit::<sys::cublasLtMatmulHeuristicResult_t>::zeroed();
                let mut count = 0;
                let status = sys::cublasLtMatmulAlgoGetHeuristic(
                    handle,
                    desc,
                    layouts[0],
                    layouts[1],
                    layouts[2],
                    layouts[2],
                    pref,
                    1,
                    found.as_mut_ptr(),
                    &mut count,
                );
                // No algorithm, or none that can run: this product runs the other way
                // (NOT_SUPPORTED is cuBLASLt's answer for shapes it lacks).
                let found = found.assume_init();
                match status.result().and_then(|()| found.state.result()) {
                    Ok(()) => Ok((count > 0).then_some(found.algo)),
                    Err(CublasError(sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED)) => Ok(None),
                    Err(e) => Err(e),
                }
            });
            let _ = result::destroy_matmul_pref(pref);
            outcome?
        };
        Ok(found.map(|algo| {
            plan.algo = algo;
            plan
        }))
    }
}
