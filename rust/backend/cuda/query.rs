//! Queries for code outside the backends (the Python package's reference copy and zero-copy
//! weights).

use std::ffi::c_void;
use std::sync::OnceLock;

use cudarc::driver::sys;

use super::driver::{check, missing_symbol};
use crate::backend::BackendError;
use crate::region::MemoryKind;

/// The driver's memory type of `addr`, or `None` where the driver does not know the address.
pub(super) fn memory_type(addr: u64) -> Option<sys::CUmemorytype> {
    let mut t: u32 = 0;
    // SAFETY: writes one u32 (CUmemorytype) for a pointer attribute query; any address is allowed.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&raw mut t).cast::<c_void>(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            addr,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return None;
    }
    match t {
        1 => Some(sys::CUmemorytype::CU_MEMORYTYPE_HOST),
        2 => Some(sys::CUmemorytype::CU_MEMORYTYPE_DEVICE),
        3 => Some(sys::CUmemorytype::CU_MEMORYTYPE_ARRAY),
        4 => Some(sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED),
        _ => None,
    }
}

pub(super) fn pointer_u64(addr: u64, attr: sys::CUpointer_attribute) -> Option<u64> {
    let mut v: u64 = 0;
    // SAFETY: the range attributes are pointer-sized (CUdeviceptr / size_t).
    let r = unsafe { sys::cuPointerGetAttribute((&raw mut v).cast::<c_void>(), attr, addr) };
    (r == sys::CUresult::CUDA_SUCCESS).then_some(v)
}

pub(super) fn device_ordinal(addr: u64) -> Option<i32> {
    let mut v: i32 = -1;
    // SAFETY: the ordinal attribute is an int.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&raw mut v).cast::<c_void>(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            addr,
        )
    };
    (r == sys::CUresult::CUDA_SUCCESS).then_some(v)
}

// Queries for code outside the backends (the Python package's reference copy and zero-copy
// weights). They use the calling thread's current context and never initialise the driver: an
// address asked about before anything in the process did is unknown to it. Each needs only its
// own entry point, not every symbol `load_driver` asks of a driver for the backend.

/// Whether the driver library is installed and exports `symbol`.
pub(super) fn driver_has(symbol: &str) -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: `is_culib_present` only tries `dlopen` on the candidate names.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
        // SAFETY: the library is present (checked first), so `culib` opens it without panicking.
        && missing_symbol(unsafe { sys::culib() }, &[symbol]).is_none()
}

/// What the driver says `addr` is: `Host` for page-locked host memory, `Device` for any other
/// memory it knows (the CPU cannot read it directly). `None` where it does not know the address
/// (ordinary pageable host memory) and where there is no driver to ask.
#[must_use]
pub fn memory_kind(addr: u64) -> Option<MemoryKind> {
    if !driver_has("cuPointerGetAttribute") {
        return None;
    }
    match memory_type(addr)? {
        sys::CUmemorytype::CU_MEMORYTYPE_HOST => Some(MemoryKind::Host),
        _ => Some(MemoryKind::Device),
    }
}

/// The address through which the device reaches mapped page-locked host memory at `host`
/// (`cuMemHostGetDevicePointer`; the same address under unified addressing). `Ok(None)` where
/// there is no driver to ask; an error where the driver refuses (memory it has not mapped, no
/// current context).
pub fn host_device_pointer(host: u64) -> Result<Option<u64>, BackendError> {
    if !driver_has("cuMemHostGetDevicePointer_v2") {
        return Ok(None);
    }
    let mut dev: sys::CUdeviceptr = 0;
    // SAFETY: the symbol is present (checked above); the driver writes one device pointer and only
    // looks `host` up, never dereferences it.
    check("cuMemHostGetDevicePointer", unsafe {
        sys::cuMemHostGetDevicePointer_v2(&raw mut dev, host as *mut c_void, 0)
    })?;
    Ok(Some(dev))
}

/// Copies `len` bytes from `src` to `dst` with `cuMemcpy` (the direction inferred from the
/// addresses under unified addressing; synchronous except between device addresses).
///
/// # Safety
/// Both ranges must be allocated, `dst` writable and not overlapping `src`, for the whole copy:
/// the driver copies host memory it does not know with the CPU.
pub unsafe fn memcpy(dst: u64, src: u64, len: usize) -> Result<(), BackendError> {
    if !driver_has("cuMemcpy") {
        return Err(BackendError::Unavailable(
            "no NVIDIA driver library (libcuda.so) with cuMemcpy found on this machine".into(),
        ));
    }
    // SAFETY: the symbol is present (checked above); the ranges are the caller's guarantee.
    check("cuMemcpy", unsafe { sys::cuMemcpy(dst, src, len) })
}
