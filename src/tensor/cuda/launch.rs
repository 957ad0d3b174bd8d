//! Kernel launches whose arguments live in the launch itself. cudarc's `LaunchArgs` collects
//! them in a `Vec`, one host allocation (or two, as it grows) per launch, and a step run op by
//! op (a model with dropout, loss scaling, CUDA graphs off) launches a hundred kernels: the
//! training step must allocate nothing. The backend's context does not track events
//! (`disable_event_tracking`), so an argument is its value or its device address, nothing
//! more, and the stream orders the work.

use cudarc::driver::{
    result, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DriverError,
    LaunchConfig,
};
use std::ffi::c_void;
use std::marker::PhantomData;

/// More than any kernel of ours takes.
const MAX_ARGS: usize = 20;

/// A launch of `func` on `stream` being given its arguments in the kernel's order.
pub struct Launch<'a> {
    stream: &'a CudaStream,
    func: &'a CudaFunction,
    /// What each parameter pointer points at: a scalar of the caller's, or an address kept in
    /// `addresses` (pointed at in `launch`, once `self` no longer moves).
    args: [*mut c_void; MAX_ARGS],
    addresses: [Option<u64>; MAX_ARGS],
    len: usize,
    /// The scalars pointed at outlive the launch.
    scalars: PhantomData<&'a ()>,
}

/// A kernel argument: a scalar passed by value or device memory passed by address.
pub trait KernelArg<'a> {
    fn push(self, launch: &mut Launch<'a>);
}

macro_rules! scalar_args {
    ($($t:ty),*) => {$(
        impl<'a> KernelArg<'a> for &'a $t {
            fn push(self, launch: &mut Launch<'a>) {
                launch.push(self as *const $t as *mut c_void, None);
            }
        }
    )*};
}
// The geometries are #[repr(C)] structs of u64s, field for field the kernels'.
scalar_args!(i32, u32, u64, f32, f64, super::ConvGeom, super::PoolGeom);

macro_rules! memory_args {
    ($($t:ty),*) => {$(
        impl<'a, 'm, T> KernelArg<'a> for $t {
            fn push(self, launch: &mut Launch<'a>) {
                let address = self.device_ptr(launch.stream).0;
                launch.push(std::ptr::null_mut(), Some(address));
            }
        }
    )*};
}
// `&mut` for the memory a kernel writes, as cudarc's builder asks, so that the borrow checker
// still sees the writes.
memory_args!(
    &'m CudaSlice<T>,
    &'m mut CudaSlice<T>,
    &'m CudaView<'_, T>,
    &'m mut CudaViewMut<'_, T>
);

impl<'a> Launch<'a> {
    pub fn new(stream: &'a CudaStream, func: &'a CudaFunction) -> Self {
        Launch {
            stream,
            func,
            args: [std::ptr::null_mut(); MAX_ARGS],
            addresses: [None; MAX_ARGS],
            len: 0,
            scalars: PhantomData,
        }
    }

    /// The next argument.
    pub fn arg(&mut self, value: impl KernelArg<'a>) -> &mut Self {
        value.push(self);
        self
    }

    fn push(&mut self, scalar: *mut c_void, address: Option<u64>) {
        assert!(
            self.len < MAX_ARGS,
            "a kernel with more than {MAX_ARGS} arguments"
        );
        self.args[self.len] = scalar;
        self.addresses[self.len] = address;
        self.len += 1;
    }

    /// Queues the kernel.
    ///
    /// # Safety
    /// As cudarc's `LaunchArgs::launch`: the arguments must be the kernel's parameters, in
    /// order and of their types, and the kernel must stay within the memory it is given.
    pub unsafe fn launch(&mut self, cfg: LaunchConfig) -> Result<(), DriverError> {
        self.stream.context().bind_to_thread()?;
        for (arg, address) in self.args.iter_mut().zip(&mut self.addresses) {
            if let Some(address) = address {
                *arg = (address as *mut u64).cast();
            }
        }
        let (func, stream) = (self.func.cu_function(), self.stream.cu_stream());
        // SAFETY: every pointer in args[..len] points at a live value of the parameter's type:
        // the caller's scalars (borrowed for 'a) or this launch's addresses.
        unsafe {
            result::launch_kernel(
                func,
                cfg.grid_dim,
                cfg.block_dim,
                cfg.shared_mem_bytes,
                stream,
                &mut self.args[..self.len],
            )
        }
    }
}
