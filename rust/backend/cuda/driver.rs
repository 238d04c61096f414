//! Loading the driver library and resolving its entry points: the symbols this backend calls,
//! the batch copy ABIs, driver errors as [`BackendError`]s, and the test hooks on the driver
//! resources a thread makes.

use std::ffi::{c_void, CStr, CString};
use std::fmt;
use std::ptr;
use std::sync::OnceLock;

use cudarc::driver::result::DriverError;
use cudarc::driver::sys;

use crate::backend::BackendError;

/// Every driver symbol this backend calls, as `cudarc` loads it. Checked before the first call.
const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuCtxGetCurrent",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamQuery",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuStreamWriteValue64_v2",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventDestroy_v2",
    "cuEventElapsedTime_v2",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemHostGetDevicePointer_v2",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuPointerGetAttribute",
    "cuMemcpyAsync",
    "cuGetProcAddress_v2",
    "cuGetErrorName",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuLaunchKernel",
    "cuFuncGetAttribute",
];

/// `cuFuncGetParamInfo` (CUDA 12.4): the offset and size of a kernel's parameter.
pub(super) type ParamInfoFn =
    unsafe extern "C" fn(sys::CUfunction, usize, *mut usize, *mut usize) -> sys::CUresult;

/// The most parameters a kernel loaded for the staged plan may have.
pub(super) const MAX_KERNEL_PARAMS: usize = 16;

/// `cuMemcpyBatchAsync`, CUDA 12.8 ABI.
type BatchV12 = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut sys::CUmemcpyAttributes,
    *mut usize,
    usize,
    *mut usize,
    sys::CUstream,
) -> sys::CUresult;

/// `cuMemcpyBatchAsync_v2`, CUDA 13.0 ABI: no `failIdx`.
type BatchV13 = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut sys::CUmemcpyAttributes,
    *mut usize,
    usize,
    sys::CUstream,
) -> sys::CUresult;

/// `cuMemcpy3DBatchAsync`, CUDA 12.8 ABI: `failIdx` before the flags.
type Batch3dV12 = unsafe extern "C" fn(
    usize,
    *mut sys::CUDA_MEMCPY3D_BATCH_OP,
    *mut usize,
    std::ffi::c_ulonglong,
    sys::CUstream,
) -> sys::CUresult;

/// `cuMemcpy3DBatchAsync_v2`, CUDA 13.0 ABI: no `failIdx`.
type Batch3dV13 = unsafe extern "C" fn(
    usize,
    *mut sys::CUDA_MEMCPY3D_BATCH_OP,
    std::ffi::c_ulonglong,
    sys::CUstream,
) -> sys::CUresult;

/// The batched 3-D copy of the installed driver: a block plan's 2-D copies in one call.
#[derive(Clone, Copy)]
pub(super) enum Batch3dFn {
    V12(Batch3dV12),
    V13(Batch3dV13),
}

impl fmt::Debug for Batch3dFn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Batch3dFn::V12(_) => "cuMemcpy3DBatchAsync (12.8 ABI)",
            Batch3dFn::V13(_) => "cuMemcpy3DBatchAsync (13.0 ABI)",
        })
    }
}

/// The 3-D batch copy entry point of the installed driver, by the ABI it offers (as
/// [`resolve_batch`]).
pub(super) fn resolve_batch3d(driver_version: i32) -> Option<Batch3dFn> {
    if driver_version >= 13000 {
        let p = resolve("cuMemcpy3DBatchAsync", 13000)?;
        // SAFETY: asked at version 13.0, the driver hands out the `_v2` ABI (no failIdx), which
        // Batch3dV13 matches.
        Some(Batch3dFn::V13(unsafe {
            std::mem::transmute::<*mut c_void, Batch3dV13>(p)
        }))
    } else if driver_version >= 12080 {
        let p = resolve("cuMemcpy3DBatchAsync", 12080)?;
        // SAFETY: asked at version 12.8, the driver hands out the 12.8 ABI, which Batch3dV12
        // matches.
        Some(Batch3dFn::V12(unsafe {
            std::mem::transmute::<*mut c_void, Batch3dV12>(p)
        }))
    } else {
        None
    }
}

#[derive(Clone, Copy)]
pub(super) enum BatchFn {
    V12(BatchV12),
    V13(BatchV13),
}

impl fmt::Debug for BatchFn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BatchFn::V12(_) => "cuMemcpyBatchAsync (12.8 ABI)",
            BatchFn::V13(_) => "cuMemcpyBatchAsync (13.0 ABI)",
        })
    }
}

pub(super) fn error_name(code: sys::CUresult) -> String {
    let mut p: *const std::ffi::c_char = ptr::null();
    // SAFETY: cuGetErrorName writes a pointer to a static string or leaves it null.
    let r = unsafe { sys::cuGetErrorName(code, &raw mut p) };
    if r == sys::CUresult::CUDA_SUCCESS && !p.is_null() {
        // SAFETY: the driver returns a NUL-terminated static string.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    } else {
        format!("{code:?}")
    }
}

pub(super) fn check(call: &'static str, code: sys::CUresult) -> Result<(), BackendError> {
    code.result().map_err(|e| driver_error(call, e))
}

/// Opens the driver library and checks every symbol this backend calls. Never panics.
fn load_driver() -> Result<(), BackendError> {
    static LOADED: OnceLock<Result<(), BackendError>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            // SAFETY: `is_culib_present` only tries `dlopen` on the candidate names.
            if !unsafe { sys::is_culib_present() } {
                return Err(BackendError::Unavailable(
                    "no NVIDIA driver library (libcuda.so) found on this machine".into(),
                ));
            }
            // SAFETY: the library is present (checked above), so `culib` opens it without panicking.
            let lib = unsafe { sys::culib() };
            missing_symbol(lib, REQUIRED_SYMBOLS).map_or(Ok(()), |name| {
                Err(BackendError::Unavailable(format!(
                    "the installed NVIDIA driver lacks {name}; blockswap needs a CUDA 12 or newer driver"
                )))
            })
        })
        .clone()
}

/// The first of `names` that `lib` does not export.
pub(super) fn missing_symbol<'a>(lib: &libloading::Library, names: &[&'a str]) -> Option<&'a str> {
    names.iter().copied().find(|name| {
        // SAFETY: only the symbol's presence is tested; the pointer is never called.
        unsafe { lib.get::<*const c_void>(name.as_bytes()) }.is_err()
    })
}

/// The driver version (e.g. 13000) if the CUDA backend can start here, else why not.
pub fn driver_available() -> Result<i32, BackendError> {
    load_driver()?;
    // SAFETY: symbols checked by `load_driver`.
    check("cuInit", unsafe { sys::cuInit(0) })?;
    let mut version = 0;
    // SAFETY: as above; writes one int.
    check("cuDriverGetVersion", unsafe {
        sys::cuDriverGetVersion(&raw mut version)
    })?;
    Ok(version)
}

pub(super) fn resolve(name: &str, version: i32) -> Option<*mut c_void> {
    let cname = CString::new(name).ok()?;
    let mut pfn: *mut c_void = ptr::null_mut();
    let mut status = sys::CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    // SAFETY: cuGetProcAddress_v2 writes the function pointer and status; symbols checked.
    let r = unsafe {
        sys::cuGetProcAddress_v2(
            cname.as_ptr(),
            &raw mut pfn,
            version,
            sys::CUdriverProcAddress_flags::CU_GET_PROC_ADDRESS_DEFAULT as u64,
            &raw mut status,
        )
    };
    (r == sys::CUresult::CUDA_SUCCESS
        && status == sys::CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SUCCESS
        && !pfn.is_null())
    .then_some(pfn)
}

/// The batch copy entry point of the installed driver, by the ABI it offers.
pub(super) fn resolve_batch(driver_version: i32) -> Option<BatchFn> {
    if driver_version >= 13000 {
        let p = resolve("cuMemcpyBatchAsync", 13000)?;
        // SAFETY: asked at version 13.0, the driver hands out the `_v2` ABI, which BatchV13 matches.
        Some(BatchFn::V13(unsafe {
            std::mem::transmute::<*mut c_void, BatchV13>(p)
        }))
    } else if driver_version >= 12080 {
        let p = resolve("cuMemcpyBatchAsync", 12080)?;
        // SAFETY: asked at version 12.8, the driver hands out the 12.8 ABI, which BatchV12 matches.
        Some(BatchFn::V12(unsafe {
            std::mem::transmute::<*mut c_void, BatchV12>(p)
        }))
    } else {
        None
    }
}

/// A driver error as a [`BackendError`] naming the call.
pub(super) fn driver_error(call: &'static str, e: DriverError) -> BackendError {
    BackendError::Driver {
        call,
        code: e.0 as i32,
        name: error_name(e.0),
    }
}

/// Called before each driver resource is created: a test may make that creation fail.
#[allow(clippy::unnecessary_wraps)] // fails only in tests, where a hook says so
pub(super) fn may_create(call: &'static str) -> Result<(), BackendError> {
    #[cfg(test)]
    {
        let fail = hooks::FAIL_AT.with(|f| match f.get() {
            Some(0) => {
                f.set(None);
                true
            }
            Some(n) => {
                f.set(Some(n - 1));
                false
            }
            None => false,
        });
        if fail {
            return Err(BackendError::Driver {
                call,
                code: sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY as i32,
                name: "CUDA_ERROR_OUT_OF_MEMORY (injected)".into(),
            });
        }
    }
    #[cfg(not(test))]
    let _ = call;
    Ok(())
}

/// Counts driver resources made (+1) and dropped (-1), for the tests.
#[cfg_attr(not(test), allow(clippy::needless_pass_by_value, unused_variables))]
pub(super) fn tally(delta: i64) {
    #[cfg(test)]
    hooks::LIVE.with(|l| l.set(l.get() + delta));
}

/// Test hooks on the driver resources a thread creates: how many are alive, and a failure
/// injected into the n-th creation from now (a construction must then free all it made).
#[cfg(test)]
pub(super) mod hooks {
    use std::cell::Cell;

    thread_local! {
        pub(in super::super) static LIVE: Cell<i64> = const { Cell::new(0) };
        pub(in super::super) static FAIL_AT: Cell<Option<usize>> = const { Cell::new(None) };
    }
}
