//! The CUDA driver backend, on `cudarc`'s raw driver bindings.
//!
//! This is the only module that makes driver calls. The driver library is opened at run time
//! (`dlopen`), so the crate builds and the host backend runs where there is no driver; every symbol
//! this backend calls is looked up before the first call, so a missing one is an error, never a
//! panic. The batch copy entry point is resolved through `cuGetProcAddress` with the ABI version
//! the installed driver offers: `cuMemcpyBatchAsync` of CUDA 12.8 (with `failIdx`) or the 13.0
//! `_v2` ABI (without it). Never at compile time. A loop of `cuMemcpyAsync` is the fallback.
//!
//! Each direction has its own non-blocking stream (or a stream the caller names; never the legacy
//! default stream). After a transfer's copies the stream writes the transfer's sequence number into
//! mapped pinned memory (`cuStreamWriteValue64`), which polls read with an atomic load; where the
//! device has no stream memory operations, a ring of events is queried instead.

use std::collections::VecDeque;
use std::ffi::{c_void, CStr, CString};
use std::fmt;
use std::mem::ManuallyDrop;
use std::ptr;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;

use super::{
    kernel_split, staged_steps, take_injected, AddElapsed, Backend, BackendError, BackendInfo,
    HostAlloc, KernelBatch, KernelKind, KernelParam, KernelSpec, PageKernel, StagedRequest,
    SubmitRequest, Submitted,
};
use crate::direction::Direction;
use crate::region::MemoryKind;
use crate::slab::{SlabInner, SlabRef};

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
type ParamInfoFn =
    unsafe extern "C" fn(sys::CUfunction, usize, *mut usize, *mut usize) -> sys::CUresult;

/// The most parameters a kernel loaded for the staged plan may have.
const MAX_KERNEL_PARAMS: usize = 16;

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
enum Batch3dFn {
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
fn resolve_batch3d(driver_version: i32) -> Option<Batch3dFn> {
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
enum BatchFn {
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

/// Which copy call a transfer uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyPath {
    /// The batch call where the driver has one, else the loop.
    Auto,
    /// The batch call; an error where the driver has none.
    Batch,
    /// One `cuMemcpyAsync` per descriptor.
    Loop,
}

impl FromStr for CopyPath {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(CopyPath::Auto),
            "batch" => Ok(CopyPath::Batch),
            "loop" => Ok(CopyPath::Loop),
            _ => Err(format!(
                "copy_path must be 'auto', 'batch' or 'loop', not {s:?}"
            )),
        }
    }
}

/// When the copy engine may read a transfer's sources.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AccessOrder {
    /// In stream order: after everything issued before on the copy stream.
    Stream,
    /// Any time after the call, even before earlier stream work: only for sources nothing writes.
    Any,
}

impl FromStr for AccessOrder {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "stream" => Ok(AccessOrder::Stream),
            "any" => Ok(AccessOrder::Any),
            _ => Err(format!("access order must be 'stream' or 'any', not {s:?}")),
        }
    }
}

/// How completion is signalled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompletionMode {
    /// Stream memory operations where the device has them, else events.
    Auto,
    /// `cuStreamWriteValue64` into mapped pinned memory; polled with an atomic load.
    WriteValue,
    /// One event per transfer; polled with `cuEventQuery`.
    Event,
}

impl FromStr for CompletionMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(CompletionMode::Auto),
            "write_value" => Ok(CompletionMode::WriteValue),
            "event" => Ok(CompletionMode::Event),
            _ => Err(format!(
                "completion must be 'auto', 'write_value' or 'event', not {s:?}"
            )),
        }
    }
}

/// Settings of a [`CudaBackend`].
#[derive(Clone, Debug)]
pub struct CudaOptions {
    pub device: i32,
    pub copy_path: CopyPath,
    /// Descriptors per driver call; larger transfers are split (one 51,828-descriptor batch has
    /// been reported to crash a driver).
    pub max_batch: usize,
    /// Record timing events around each transfer, for device seconds in its result.
    pub timing: bool,
    /// Source access order per direction (lane order). Default: ANY for host sources (pinned
    /// memory nothing else writes), STREAM for device sources (live GPU memory).
    pub access_order: [AccessOrder; 4],
    pub completion: CompletionMode,
    /// A caller's stream per direction (raw `CUstream`), used instead of one of our own.
    pub streams: [Option<u64>; 4],
    /// Transfers in flight per direction the event rings hold (the engine's `max_in_flight`).
    pub max_in_flight: usize,
}

impl CudaOptions {
    pub fn new(device: i32) -> Self {
        CudaOptions {
            device,
            copy_path: CopyPath::Auto,
            max_batch: 16_384,
            timing: false,
            access_order: Direction::ALL.map(|d| match d.src_kind() {
                MemoryKind::Host => AccessOrder::Any,
                MemoryKind::Device => AccessOrder::Stream,
            }),
            completion: CompletionMode::Auto,
            streams: [None; 4],
            max_in_flight: 1024,
        }
    }
}

fn error_name(code: sys::CUresult) -> String {
    let mut p: *const std::ffi::c_char = ptr::null();
    // SAFETY: cuGetErrorName writes a pointer to a static string or leaves it null.
    let r = unsafe { sys::cuGetErrorName(code, &mut p) };
    if r == sys::CUresult::CUDA_SUCCESS && !p.is_null() {
        // SAFETY: the driver returns a NUL-terminated static string.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    } else {
        format!("{code:?}")
    }
}

fn check(call: &'static str, code: sys::CUresult) -> Result<(), BackendError> {
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
fn missing_symbol<'a>(lib: &libloading::Library, names: &[&'a str]) -> Option<&'a str> {
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
        sys::cuDriverGetVersion(&mut version)
    })?;
    Ok(version)
}

fn resolve(name: &str, version: i32) -> Option<*mut c_void> {
    let cname = CString::new(name).ok()?;
    let mut pfn: *mut c_void = ptr::null_mut();
    let mut status = sys::CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    // SAFETY: cuGetProcAddress_v2 writes the function pointer and status; symbols checked.
    let r = unsafe {
        sys::cuGetProcAddress_v2(
            cname.as_ptr(),
            &mut pfn,
            version,
            sys::CUdriverProcAddress_flags::CU_GET_PROC_ADDRESS_DEFAULT as u64,
            &mut status,
        )
    };
    (r == sys::CUresult::CUDA_SUCCESS
        && status == sys::CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SUCCESS
        && !pfn.is_null())
    .then_some(pfn)
}

/// The batch copy entry point of the installed driver, by the ABI it offers.
fn resolve_batch(driver_version: i32) -> Option<BatchFn> {
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
fn driver_error(call: &'static str, e: DriverError) -> BackendError {
    BackendError::Driver {
        call,
        code: e.0 as i32,
        name: error_name(e.0),
    }
}

/// Test hooks on the driver resources a thread creates: how many are alive, and a failure
/// injected into the n-th creation from now (a construction must then free all it made).
#[cfg(test)]
mod hooks {
    use std::cell::Cell;

    thread_local! {
        pub(super) static LIVE: Cell<i64> = const { Cell::new(0) };
        pub(super) static FAIL_AT: Cell<Option<usize>> = const { Cell::new(None) };
    }
}

/// Called before each driver resource is created: a test may make that creation fail.
fn may_create(call: &'static str) -> Result<(), BackendError> {
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
fn tally(_delta: i64) {
    #[cfg(test)]
    hooks::LIVE.with(|l| l.set(l.get() + _delta));
}

/// Makes `ctx` current on the calling thread until the guard drops, then puts back whatever was
/// current before (the caller's device, as torch set it).
fn bind(ctx: sys::CUcontext) -> Result<CtxGuard, BackendError> {
    let prev = result::ctx::get_current()
        .map_err(|e| driver_error("cuCtxGetCurrent", e))?
        .unwrap_or(ptr::null_mut());
    if prev != ctx {
        // SAFETY: `ctx` is a retained primary context, alive while its owner lives.
        unsafe { result::ctx::set_current(ctx) }.map_err(|e| driver_error("cuCtxSetCurrent", e))?;
    }
    Ok(CtxGuard {
        prev: (prev != ctx).then_some(prev),
    })
}

/// A reference to a device's primary context (the one torch uses), from `retain` until drop.
#[derive(Debug)]
struct PrimaryCtx {
    device: sys::CUdevice,
    raw: sys::CUcontext,
}

impl PrimaryCtx {
    fn retain(device: sys::CUdevice) -> Result<Self, BackendError> {
        may_create("cuDevicePrimaryCtxRetain")?;
        // SAFETY: `device` came from cuDeviceGet; the reference is released once, in Drop.
        let raw = unsafe { result::primary_ctx::retain(device) }
            .map_err(|e| driver_error("cuDevicePrimaryCtxRetain", e))?;
        tally(1);
        Ok(PrimaryCtx { device, raw })
    }
}

impl Drop for PrimaryCtx {
    fn drop(&mut self) {
        // SAFETY: retained once in `retain`, released once here. An error is ignored: Drop must
        // not panic, and no one is left to tell.
        let _ = unsafe { result::primary_ctx::release(self.device) };
        tally(-1);
    }
}

/// A lane's stream: one this backend created (destroyed on drop) or the caller's (left alone).
#[derive(Debug)]
struct Stream {
    raw: sys::CUstream,
    ctx: sys::CUcontext,
    owned: bool,
}

impl Stream {
    /// A non-blocking stream of `ctx`: it never synchronises with the legacy default stream.
    fn create(ctx: sys::CUcontext) -> Result<Self, BackendError> {
        may_create("cuStreamCreate")?;
        let _bound = bind(ctx)?;
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| driver_error("cuStreamCreate", e))?;
        tally(1);
        Ok(Stream {
            raw,
            ctx,
            owned: true,
        })
    }

    /// The caller's stream, used as it is and never destroyed here.
    fn borrowed(raw: u64, ctx: sys::CUcontext) -> Self {
        Stream {
            raw: raw as sys::CUstream,
            ctx,
            owned: false,
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        if let Ok(_bound) = bind(self.ctx) {
            // SAFETY: created by `create` and destroyed once, here. Work still queued on it is no
            // obstacle: the driver releases the stream once that work is done. Errors are
            // ignored: Drop must not panic.
            let _ = unsafe { result::stream::destroy(self.raw) };
        }
        tally(-1);
    }
}

/// An event, destroyed on drop.
#[derive(Debug)]
struct Event {
    raw: sys::CUevent,
    ctx: sys::CUcontext,
}

impl Event {
    fn create(ctx: sys::CUcontext, timing: bool) -> Result<Self, BackendError> {
        may_create("cuEventCreate")?;
        let _bound = bind(ctx)?;
        let flags = if timing {
            sys::CUevent_flags::CU_EVENT_DEFAULT
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
        };
        let raw = result::event::create(flags).map_err(|e| driver_error("cuEventCreate", e))?;
        tally(1);
        Ok(Event { raw, ctx })
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if let Ok(_bound) = bind(self.ctx) {
            // SAFETY: created by `create` and destroyed once, here. An event still pending in a
            // stream may be destroyed: the driver releases it once it completes.
            let _ = unsafe { result::event::destroy(self.raw) };
        }
        tally(-1);
    }
}

/// Device memory from `cuMemAlloc`, freed on drop.
#[derive(Debug)]
struct DeviceMem {
    ptr: sys::CUdeviceptr,
    ctx: sys::CUcontext,
}

impl DeviceMem {
    fn alloc(ctx: sys::CUcontext, len: usize) -> Result<Self, BackendError> {
        may_create("cuMemAlloc")?;
        let _bound = bind(ctx)?;
        let mut ptr = 0;
        // SAFETY: writes one device pointer.
        check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut ptr, len) })?;
        tally(1);
        Ok(DeviceMem { ptr, ctx })
    }
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        if let Ok(_bound) = bind(self.ctx) {
            // SAFETY: from cuMemAlloc, freed once, here; the owner drops it only once no work
            // that may reach it can run (see `CudaBackend`'s Drop).
            let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
        }
        tally(-1);
    }
}

/// A kernel the staged plan launches (see [`KernelSpec`]), checked against the driver's view of
/// its parameters when loaded.
#[derive(Clone, Debug)]
struct LoadedKernel {
    function: u64,
    spec: KernelSpec,
    kind: KernelKind,
    /// Parameters of the kernel in all: those of `spec.params`, then null pointers.
    total: usize,
}

/// What a staged kernel's launch reads besides its block entries: the group's geometry at slab
/// entry `table` (its header) with `segments` pages per block, the ring's offsets shifted by
/// `ring_base`, the ring the pages' source (`ring_src`, CPU -> GPU) or destination.
#[derive(Clone, Copy, Debug)]
struct StagedLaunch {
    table: usize,
    segments: u64,
    ring_base: u64,
    ring_src: bool,
}

/// One lane's staging resources, made on its first staged transfer: a ring of two slots in
/// device memory, a stream for the kernels (the lane's stream does the copies across PCIe) and
/// the events that hand each slot between the two.
#[derive(Debug)]
struct Stage {
    ring: DeviceMem,
    slot: u64,
    stream: Stream,
    /// Recorded on the lane's stream before a CPU -> GPU transfer's completion marker goes on
    /// the kernel stream (see [`CudaBackend::marker_stream`]).
    lane_done: Event,
    /// Per slot: its copy (CPU -> GPU) or kernel (GPU -> CPU) is done; the other stream goes on.
    ready: [Event; 2],
    /// Per slot: the last work on it is done; it may be filled again.
    free: [Event; 2],
    /// Recorded on the kernel stream after a transfer's last step; the lane's stream waits for
    /// it before a completion marker it writes, so a transfer completes only once its kernels
    /// have.
    join: Event,
    /// The lane's last completion marker went on the kernel stream: the next one written on
    /// the lane's stream waits for it (`join`), so markers stay in order.
    marker_on_stage: bool,
    /// Steps issued on the lane so far: the next takes slot `steps % 2`.
    steps: u64,
    /// Device memory the transfer's block entries and geometries are copied into before its
    /// first kernel, so the kernels read them from HBM, not across the PCIe link the rows are crossing. One
    /// per lane: the copy goes on the kernel stream, after every kernel of the lane's earlier
    /// transfers.
    desc: Option<DeviceMem>,
    desc_bytes: usize,
    /// Descriptor buffers outgrown while kernels may still read them: freed with the stage.
    retired: Vec<DeviceMem>,
    /// The step's row copies, handed to the batch call.
    src: Vec<u64>,
    dst: Vec<u64>,
    size: Vec<u64>,
}

/// The smallest device descriptor buffer a stage makes (it grows by powers of two).
const MIN_DESC_BYTES: usize = 64 << 10;

impl Stage {
    /// A device buffer of at least `bytes` for the descriptors of the transfer being issued. A
    /// buffer outgrown is kept until the stage goes: an earlier transfer's kernel may still
    /// read it.
    fn desc_buffer(&mut self, ctx: sys::CUcontext, bytes: usize) -> Result<u64, BackendError> {
        if self.desc.is_none() || self.desc_bytes < bytes {
            let want = bytes.max(MIN_DESC_BYTES).next_power_of_two();
            let new = DeviceMem::alloc(ctx, want)?;
            if let Some(old) = self.desc.replace(new) {
                self.retired.push(old);
            }
            self.desc_bytes = want;
        }
        Ok(self.desc.as_ref().expect("made above").ptr)
    }

    fn new(ctx: sys::CUcontext, slot: u64) -> Result<Self, BackendError> {
        let bytes = usize::try_from(slot.saturating_mul(2)).unwrap_or(usize::MAX);
        Ok(Stage {
            ring: DeviceMem::alloc(ctx, bytes)?,
            slot,
            stream: Stream::create(ctx)?,
            lane_done: Event::create(ctx, false)?,
            ready: [Event::create(ctx, false)?, Event::create(ctx, false)?],
            free: [Event::create(ctx, false)?, Event::create(ctx, false)?],
            join: Event::create(ctx, false)?,
            marker_on_stage: false,
            steps: 0,
            desc: None,
            desc_bytes: 0,
            retired: Vec::new(),
            src: Vec::new(),
            dst: Vec::new(),
            size: Vec::new(),
        })
    }
}

/// `cuEventRecord` then `cuStreamWaitEvent`: `waiter` goes on only after the work queued on
/// `on` so far.
fn order(event: &Event, on: sys::CUstream, waiter: sys::CUstream) -> Result<(), BackendError> {
    // SAFETY: valid event and streams of the current context. Re-recording an event is safe
    // once a wait has been queued on it: the wait takes the event's state at the call.
    check("cuEventRecord", unsafe {
        sys::cuEventRecord(event.raw, on)
    })?;
    // SAFETY: as above.
    check("cuStreamWaitEvent", unsafe {
        sys::cuStreamWaitEvent(waiter, event.raw, 0)
    })
}

/// Page-locked, device-mapped, cached host memory from `cuMemHostAlloc`, zeroed; freed on drop.
#[derive(Debug)]
struct PinnedHost {
    ptr: ptr::NonNull<u8>,
    ctx: sys::CUcontext,
}

impl PinnedHost {
    fn alloc(ctx: sys::CUcontext, len: usize) -> Result<Self, BackendError> {
        may_create("cuMemHostAlloc")?;
        let _bound = bind(ctx)?;
        // SAFETY: portable, device-mapped, cached memory (not write-combined: the CPU reads it).
        let p = unsafe {
            result::malloc_host(
                len,
                sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
            )
        }
        .map_err(|e| driver_error("cuMemHostAlloc", e))?;
        let ptr =
            ptr::NonNull::new(p as *mut u8).ok_or(BackendError::OutOfMemory { bytes: len })?;
        // SAFETY: `len` bytes just allocated, not shared yet.
        unsafe { ptr::write_bytes(ptr.as_ptr(), 0, len) };
        tally(1);
        Ok(PinnedHost { ptr, ctx })
    }

    fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        if let Ok(_bound) = bind(self.ctx) {
            // SAFETY: allocated by `alloc` and freed once, here; the owner drops it only once no
            // stream can write it. Errors are ignored: Drop must not panic.
            let _ = unsafe { result::free_host(self.ptr.as_ptr() as *mut c_void) };
        }
        tally(-1);
    }
}

/// Page-locks `[start, start + len)` for every context (portable) and maps it into the device
/// address space (device-mapped): how blockswap registers host memory. A context is current.
///
/// # Safety
/// The range must be mapped host memory that stays mapped until [`unregister_host`].
unsafe fn register_host(start: u64, len: u64) -> Result<(), BackendError> {
    // SAFETY: the caller guarantees the range is mapped host memory outliving the registration.
    check("cuMemHostRegister", unsafe {
        sys::cuMemHostRegister_v2(
            start as *mut c_void,
            len as usize,
            sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP,
        )
    })
}

/// Undoes [`register_host`] of the range starting at `start`. A context is current.
///
/// # Safety
/// No copy may reach the range any more.
unsafe fn unregister_host(start: u64) -> Result<(), BackendError> {
    // SAFETY: registered by `register_host`; the caller guarantees nothing reaches it.
    check("cuMemHostUnregister", unsafe {
        sys::cuMemHostUnregister(start as *mut c_void)
    })
}

/// Page-locks the pieces of a [`crate::hostmem::HostBuffer`] with the driver, in the primary
/// context of a device (retained while the pinner lives); the registrations are portable, so
/// every context of the process, any engine's, reaches them.
#[derive(Debug)]
pub struct HostPinner {
    ctx: PrimaryCtx,
}

// SAFETY: the context handle is a driver object the driver lets any thread use; the pinner holds
// no other state.
unsafe impl Send for HostPinner {}
// SAFETY: as above; every method makes the context current on the calling thread first.
unsafe impl Sync for HostPinner {}

impl HostPinner {
    /// A pinner in the primary context of device `device`.
    pub fn new(device: i32) -> Result<Self, BackendError> {
        driver_available()?;
        let mut dev = 0;
        // SAFETY: symbols checked by `driver_available`; cuDeviceGet writes one handle.
        check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut dev, device) })?;
        Ok(HostPinner {
            ctx: PrimaryCtx::retain(dev)?,
        })
    }
}

impl crate::hostmem::Pinner for HostPinner {
    unsafe fn pin(&self, start: u64, len: u64) -> Result<(), BackendError> {
        let _bound = bind(self.ctx.raw)?;
        // SAFETY: the caller guarantees the range stays mapped until unpinned.
        unsafe { register_host(start, len) }
    }

    unsafe fn unpin(&self, start: u64) -> Result<(), BackendError> {
        let _bound = bind(self.ctx.raw)?;
        // SAFETY: pinned by `pin`; the caller guarantees no copy reaches it.
        unsafe { unregister_host(start) }
    }
}

/// One direction's stream and completion state.
#[derive(Debug)]
struct CudaLane {
    /// Event ring, indexed by `seq % len`: completion (event mode).
    done_events: Vec<Event>,
    /// Timing event pairs, indexed by `seq % len` (timing on).
    timing_events: Vec<(Event, Event)>,
    /// Events recorded on callers' streams, free for the next transfer (see [`Job::dep`]).
    deps: Mutex<Vec<Event>>,
    /// Transfers handed to the lane's issuing thread, in order.
    queue: Mutex<VecDeque<Job>>,
    /// Signalled when a job is queued or the backend stops.
    work: Condvar,
    /// Signalled when the issuing thread has nothing left (`pending` is 0).
    drained: Condvar,
    /// Transfers accepted and not yet issued (or dropped, on a failed lane) by the issuing
    /// thread: while it is not 0, the thread may still read their slabs.
    pending: AtomicU64,
    /// The highest sequence number accepted.
    accepted: AtomicU64,
    /// Dropped after the events recorded on it.
    stream: Stream,
    /// The staged plan's resources, made on the lane's first staged transfer. Whoever issues
    /// the lane's transfers (its thread, or `submit` once the thread has drained) takes the
    /// lock; `lane_idle` only tries it.
    stage: Mutex<Option<Stage>>,
    /// Mapped pinned u64 the stream writes completed sequence numbers into (write-value mode),
    /// inside the backend's `counters`.
    counter: *mut u64,
    counter_dev: sys::CUdeviceptr,
    submitted: AtomicU64,
    /// Highest sequence number known complete (event mode).
    known: AtomicU64,
    /// Set once copies may be queued with no completion marker after them (the marker failed to
    /// enqueue): then only the stream itself says when this lane's work is done.
    unmarked: AtomicBool,
    error: OnceLock<BackendError>,
    /// Nanoseconds since `CudaBackend::epoch` of the last stream health check.
    last_check: AtomicU64,
}

impl CudaLane {
    /// Lane `i`: counter `i` of `counters`, the caller's `stream` or a new one, its dependency
    /// event. `ctx` is current.
    fn new(
        ctx: sys::CUcontext,
        counters: &PinnedHost,
        i: usize,
        stream: Option<u64>,
    ) -> Result<Self, BackendError> {
        // SAFETY: inside the 4 * 64-byte allocation, 8-byte aligned.
        let counter = unsafe { counters.as_ptr().add(i * 64) } as *mut u64;
        let mut counter_dev = 0;
        // SAFETY: `counter` lies in mapped pinned memory; the driver writes one device pointer.
        check("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut counter_dev, counter as *mut c_void, 0)
        })?;
        let stream = match stream {
            Some(s) => Stream::borrowed(s, ctx),
            None => Stream::create(ctx)?,
        };
        Ok(CudaLane {
            done_events: Vec::new(),
            timing_events: Vec::new(),
            deps: Mutex::new(Vec::new()),
            queue: Mutex::new(VecDeque::new()),
            work: Condvar::new(),
            drained: Condvar::new(),
            pending: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            stream,
            stage: Mutex::new(None),
            counter,
            counter_dev,
            submitted: AtomicU64::new(0),
            known: AtomicU64::new(0),
            unmarked: AtomicBool::new(false),
            error: OnceLock::new(),
            last_check: AtomicU64::new(0),
        })
    }

    /// Whether `cuStreamWriteValue64` works here: one write, then a synchronize.
    fn probe_write_value(&self) -> bool {
        // SAFETY: the counter is mapped pinned memory of the backend being built; the stream is
        // ours or the caller's, valid for the backend's life.
        unsafe {
            sys::cuStreamWriteValue64_v2(self.stream.raw, self.counter_dev, 0, 0)
                == sys::CUresult::CUDA_SUCCESS
                && sys::cuStreamSynchronize(self.stream.raw) == sys::CUresult::CUDA_SUCCESS
        }
    }
}

/// Copies with the CUDA driver.
///
/// `submit` checks and records what must happen on the caller's thread (the caller's stream, as
/// it is at the call) and hands the transfer to the lane's issuing thread, which makes every
/// driver call of it, in order: the caller's host time does not grow with the copies the
/// driver has to write. A transfer with a Python kernel launcher, or on a lane that runs on a
/// stream the caller gave, is the exception: it waits for the lane's thread to go idle and is
/// issued on the caller's thread (a caller's stream holds the copies when `submit` returns).
#[derive(Debug)]
pub struct CudaBackend {
    shared: Arc<Shared>,
    /// Per lane, its issuing thread, started on the lane's first transfer.
    workers: Mutex<[Option<std::thread::JoinHandle<()>>; 4]>,
}

impl std::ops::Deref for CudaBackend {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.shared
    }
}

impl CudaBackend {
    /// See [`Shared::new`].
    pub fn new(opts: CudaOptions) -> Result<Self, BackendError> {
        Ok(CudaBackend {
            shared: Arc::new(Shared::new(opts)?),
            workers: Mutex::new([None, None, None, None]),
        })
    }

    /// Starts `lane`'s issuing thread if it is not running.
    fn start_worker(&self, lane: Direction) -> Result<(), BackendError> {
        let mut w = self.workers.lock().unwrap_or_else(|e| e.into_inner());
        if w[lane.lane()].is_some() {
            return Ok(());
        }
        let shared = Arc::clone(&self.shared);
        let handle = std::thread::Builder::new()
            .name(format!("blockswap-{}", lane.as_str()))
            .spawn(move || shared.work(lane))
            .map_err(|e| BackendError::Unavailable(format!("cannot start a thread: {e}")))?;
        w[lane.lane()] = Some(handle);
        Ok(())
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        let workers = std::mem::take(self.workers.get_mut().unwrap_or_else(|e| e.into_inner()));
        if crate::fork::fork_generation() != self.generation {
            // A forked child has none of the parent's threads.
            std::mem::forget(workers);
            return;
        }
        self.stopping.store(true, Ordering::Release);
        for l in self.lanes.iter() {
            // Under the queue's lock: a worker between its check and its wait sees the flag.
            let _q = l.queue.lock().unwrap_or_else(|e| e.into_inner());
            l.work.notify_all();
        }
        // Each thread issues what it was handed, then ends: an accepted transfer runs.
        for h in workers.into_iter().flatten() {
            let _ = h.join();
        }
    }
}

/// A transfer handed to a lane's issuing thread.
#[derive(Debug)]
struct Job {
    seq: u64,
    slab: SlabRef,
    pitched: bool,
    staged: Option<StagedRequest>,
    /// Recorded on the caller's stream at submission: the copies wait for it. Given back to the
    /// lane's pool once the waits on it are queued.
    dep: Option<Event>,
    /// Why the transfer fails before any copy is issued (the caller's stream could not be
    /// recorded): only its completion marker goes in.
    failed: Option<BackendError>,
    /// The kernel route's batch and its loaded kernel (`PageKernel::Loaded`): kernel id and
    /// bytes a launch.
    kernel: Option<(KernelBatch, u32, u64)>,
}

/// The driver state of a [`CudaBackend`], shared with its issuing threads.
///
/// Every driver resource is owned by a value that frees it on drop (the context reference, the
/// counters, each stream and event), so a construction that fails midway frees what it made.
/// The backend drops them by hand (see its `Drop`): in a forked child, or while a lane the
/// engine gave up on may still run, the memory the device may write is leaked, never freed.
#[derive(Debug)]
pub struct Shared {
    ordinal: i32,
    name: String,
    driver_version: i32,
    batch: Option<BatchFn>,
    /// The batched 3-D copy for block plans; `None`: one cuMemcpy2DAsync per copy.
    batch3d: Option<Batch3dFn>,
    opts: CudaOptions,
    write_value: bool,
    epoch: Instant,
    /// Nanoseconds inside copy calls (cuMemcpyBatchAsync / cuMemcpyAsync), for profiling.
    driver_ns: AtomicU64,
    /// Transfers still to fail on purpose (`Backend::inject_failures`, a test hook).
    fail_next: AtomicU64,
    /// [`crate::fork::fork_generation`] when the backend was made: in a child forked since,
    /// its context and handles are the parent's and must not be touched.
    generation: u64,
    /// Set by `shutdown`: from then on host memory is freed only once every lane is idle.
    shut: AtomicBool,
    /// Host memory handed back while a lane might still reach it: freed once every lane is idle,
    /// else leaked.
    deferred: Mutex<Vec<HostAlloc>>,
    /// `cuFuncGetParamInfo`, where the driver has it: [`Backend::load_kernel`] needs it.
    param_info: Option<ParamInfoFn>,
    /// Kernels loaded for staged plans, by id.
    kernels: std::sync::RwLock<Vec<LoadedKernel>>,
    /// Set when the backend goes: the issuing threads end once their queues are empty.
    stopping: AtomicBool,
    // The driver resources, dropped in this order in `Drop`.
    lanes: ManuallyDrop<Vec<CudaLane>>,
    /// One cache line per lane's completion counter: the device writes them independently.
    counters: ManuallyDrop<PinnedHost>,
    ctx: ManuallyDrop<PrimaryCtx>,
}

// SAFETY: driver handles (context, streams, events) may be used from any thread once the context is
// made current there, which every entry point does first; `counter` is only read atomically on the
// host and written by the device.
unsafe impl Send for Shared {}
// SAFETY: as above; mutation goes through atomics, OnceLocks and Mutexes, and a lane's
// transfers are issued by one thread at a time (its issuing thread, or `submit` under the
// engine's submit lock once that thread has drained).
unsafe impl Sync for Shared {}

/// How long between stream health checks while transfers are outstanding.
const HEALTH_CHECK: Duration = Duration::from_millis(20);

impl Shared {
    /// `opts.max_in_flight` is clamped as the engine clamps it for this backend, which keeps the
    /// default [`Backend::max_in_flight`] ([`super::clamp_in_flight`]): the event rings hold twice
    /// that.
    pub fn new(mut opts: CudaOptions) -> Result<Self, BackendError> {
        opts.max_in_flight = super::clamp_in_flight(opts.max_in_flight);
        // Arguments first, before any driver resource exists.
        for s in opts.streams.iter().flatten() {
            if *s <= 2 {
                return Err(BackendError::InvalidArgument(format!(
                    "stream {s:#x} is a legacy or per-thread default stream; copies need a created stream"
                )));
            }
        }
        let driver_version = driver_available()?;
        let mut device = 0;
        // SAFETY: symbols checked by `driver_available`; cuDeviceGet writes one handle.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut device, opts.device)
        })?;
        // From here on every resource is owned by a local: an early return drops them in reverse
        // order (lanes, counters, the binding, the context).
        let ctx = PrimaryCtx::retain(device)?;
        let _bound = bind(ctx.raw)?;
        let mut name_buf = [0 as std::ffi::c_char; 256];
        // SAFETY: writes at most 256 bytes, NUL-terminated.
        let name = if unsafe { sys::cuDeviceGetName(name_buf.as_mut_ptr(), 256, device) }
            == sys::CUresult::CUDA_SUCCESS
        {
            // SAFETY: NUL-terminated by the driver.
            unsafe { CStr::from_ptr(name_buf.as_ptr()) }
                .to_string_lossy()
                .into_owned()
        } else {
            String::from("unknown")
        };
        let batch = match opts.copy_path {
            CopyPath::Loop => None,
            CopyPath::Auto => resolve_batch(driver_version),
            CopyPath::Batch => Some(resolve_batch(driver_version).ok_or_else(|| {
                BackendError::Unavailable(format!(
                    "copy_path='batch' needs cuMemcpyBatchAsync (CUDA 12.8+ driver); this driver is {driver_version}"
                ))
            })?),
        };
        // Block plans follow the 1-D choice: batched where the driver has the call, unless the
        // loop was asked for.
        let batch3d = match opts.copy_path {
            CopyPath::Loop => None,
            CopyPath::Auto | CopyPath::Batch => resolve_batch3d(driver_version),
        };
        let counters = PinnedHost::alloc(ctx.raw, Direction::ALL.len() * 64)?;
        let mut lanes = Vec::with_capacity(Direction::ALL.len());
        for (i, dir) in Direction::ALL.into_iter().enumerate() {
            debug_assert_eq!(dir.lane(), i, "lanes are indexed by Direction::lane");
            lanes.push(CudaLane::new(ctx.raw, &counters, i, opts.streams[i])?);
        }
        let write_value = match opts.completion {
            CompletionMode::Event => false,
            CompletionMode::Auto => lanes[0].probe_write_value(),
            CompletionMode::WriteValue => {
                if !lanes[0].probe_write_value() {
                    return Err(BackendError::Unavailable(
                        "this device or driver has no 64-bit stream memory operations (completion='write_value')".into(),
                    ));
                }
                true
            }
        };
        // Twice the transfers the engine lets into flight: a slot is recorded again only once
        // the transfer that used it is complete.
        let ring = 2 * opts.max_in_flight;
        for lane in &mut lanes {
            if !write_value {
                lane.done_events = (0..ring)
                    .map(|_| Event::create(ctx.raw, false))
                    .collect::<Result<_, _>>()?;
            }
            if opts.timing {
                lane.timing_events = (0..ring)
                    .map(|_| Ok((Event::create(ctx.raw, true)?, Event::create(ctx.raw, true)?)))
                    .collect::<Result<_, BackendError>>()?;
            }
        }
        Ok(Shared {
            ordinal: opts.device,
            name,
            driver_version,
            batch,
            batch3d,
            opts,
            write_value,
            epoch: Instant::now(),
            driver_ns: AtomicU64::new(0),
            fail_next: AtomicU64::new(0),
            generation: crate::fork::fork_generation(),
            shut: AtomicBool::new(false),
            deferred: Mutex::new(Vec::new()),
            // SAFETY: the symbol's ABI is that of CUDA 12.4, the version asked for.
            param_info: resolve("cuFuncGetParamInfo", 12040)
                .map(|p| unsafe { std::mem::transmute::<*mut c_void, ParamInfoFn>(p) }),
            kernels: std::sync::RwLock::new(Vec::new()),
            stopping: AtomicBool::new(false),
            lanes: ManuallyDrop::new(lanes),
            counters: ManuallyDrop::new(counters),
            ctx: ManuallyDrop::new(ctx),
        })
    }

    /// Makes this backend's context current on the calling thread until the guard drops.
    fn make_current(&self) -> Result<CtxGuard, BackendError> {
        bind(self.ctx.raw)
    }

    fn lane(&self, d: Direction) -> &CudaLane {
        &self.lanes[d.lane()]
    }

    /// Whether nothing this backend accepted on `lane` can still run: every completion marker
    /// reached, or, where a marker may be missing, nothing left to issue and the streams idle.
    /// Never blocks; the context is current.
    fn lane_idle(&self, lane: Direction) -> bool {
        let l = self.lane(lane);
        // Acquire: pairs with the Release stores in `submit` and `issue_job`, and the
        // decrement in `work`.
        if l.unmarked.load(Ordering::Acquire) {
            if l.pending.load(Ordering::Acquire) != 0 {
                return false;
            }
            let kernels = l
                .stage
                .try_lock()
                .ok()
                .map(|st| st.as_ref().map(|st| st.stream.raw));
            let idle = |s: sys::CUstream| {
                // SAFETY: the stream is valid for the backend's life; cuStreamQuery never blocks.
                (unsafe { sys::cuStreamQuery(s) }) == sys::CUresult::CUDA_SUCCESS
            };
            // A stage held by a submission in progress is not idle.
            return idle(l.stream.raw) && kernels.is_some_and(|k| k.is_none_or(idle));
        }
        self.completed_seq(lane) >= l.accepted.load(Ordering::Acquire)
    }

    /// Whether host memory may be freed now. Until shutdown, and while no lane has failed, the
    /// engine frees only what no transfer in flight uses; after either, only once every lane is
    /// idle. The context is current.
    fn may_free(&self) -> bool {
        // Acquire: pairs with the store in `shutdown`.
        let trusted = !self.shut.load(Ordering::Acquire)
            && self.lanes.iter().all(|l| l.error.get().is_none());
        trusted || Direction::ALL.into_iter().all(|d| self.lane_idle(d))
    }

    /// The transfers not known complete on lanes that are not idle.
    fn left(&self) -> u64 {
        Direction::ALL
            .into_iter()
            .filter(|&d| !self.lane_idle(d))
            .map(|d| self.left_on(d))
            .sum()
    }

    /// The transfers of `lane` not known complete (at least 1 where the lane is not idle).
    fn left_on(&self, lane: Direction) -> u64 {
        let l = self.lane(lane);
        l.accepted
            .load(Ordering::Acquire)
            .saturating_sub(self.completed_seq(lane))
            .max(1)
    }

    fn attrs(&self, lane: Direction) -> sys::CUmemcpyAttributes {
        // SAFETY: CUmemcpyAttributes is a plain C struct; all-zero is a valid (no hints) value.
        let mut a: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
        a.srcAccessOrder = match self.opts.access_order[lane.lane()] {
            AccessOrder::Any => sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_ANY,
            AccessOrder::Stream => sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        };
        a
    }

    /// Issues the DMA copies of descriptors `[first, len)` of one transfer on the lane's stream.
    /// On failure, the index of the failing descriptor where it is known.
    fn issue_copies(
        &self,
        lane: Direction,
        slab: &SlabInner,
        first: usize,
    ) -> Result<(), BackendError> {
        let (src, size) = (&slab.src()[first..], &slab.size()[first..]);
        let poisoned;
        let dst = if take_injected(&self.fail_next) {
            // The injected fault: a copy of the destinations with a null address in the middle,
            // which the driver refuses (CUDA_ERROR_INVALID_VALUE, measured on driver 580 for the
            // batch call and the loop) before touching memory. The slab itself is not modified.
            let mut d = slab.dst()[first..].to_vec();
            let mid = d.len() / 2;
            if let Some(x) = d.get_mut(mid) {
                *x = 0;
            }
            poisoned = d;
            &poisoned[..]
        } else {
            &slab.dst()[first..]
        };
        self.copy_arrays(lane, src, dst, size, first)
    }

    /// Issues the 1-D copies `(src[i], dst[i], size[i])` on the lane's stream, batched where the
    /// driver can; errors name descriptor `first + i`.
    fn copy_arrays(
        &self,
        lane: Direction,
        src: &[u64],
        dst: &[u64],
        size: &[u64],
        first: usize,
    ) -> Result<(), BackendError> {
        let stream = self.lane(lane).stream.raw;
        let Some(batch) = self.batch else {
            for i in 0..src.len() {
                // SAFETY: every range was checked against registered memory before submission;
                // unified addressing lets cuMemcpyAsync infer each direction.
                let r = unsafe { sys::cuMemcpyAsync(dst[i], src[i], size[i] as usize, stream) };
                if r != sys::CUresult::CUDA_SUCCESS {
                    return Err(BackendError::CopyFailed {
                        index: Some(first + i),
                        reason: format!("cuMemcpyAsync: {}", error_name(r)),
                    });
                }
            }
            return Ok(());
        };
        let mut attrs = self.attrs(lane);
        let mut attr_idx = 0usize;
        let chunk = self.opts.max_batch.max(1);
        let mut start = 0;
        while start < src.len() {
            let n = chunk.min(src.len() - start);
            // The driver takes mutable pointers but only reads the arrays during the call.
            let (d, s, z) = (
                dst[start..].as_ptr() as *mut sys::CUdeviceptr,
                src[start..].as_ptr() as *mut sys::CUdeviceptr,
                size[start..].as_ptr() as *mut usize,
            );
            let mut fail_idx = usize::MAX;
            // SAFETY: d, s, z point at n valid u64 descriptors (u64 == CUdeviceptr == usize on
            // 64-bit), read only during the call; one attribute applies to all from index 0; the
            // ranges were checked against registered memory; the stream is valid.
            let r = unsafe {
                match batch {
                    BatchFn::V12(f) => f(
                        d,
                        s,
                        z,
                        n,
                        &mut attrs,
                        &mut attr_idx,
                        1,
                        &mut fail_idx,
                        stream,
                    ),
                    BatchFn::V13(f) => f(d, s, z, n, &mut attrs, &mut attr_idx, 1, stream),
                }
            };
            if r != sys::CUresult::CUDA_SUCCESS {
                let index = if fail_idx < n {
                    Some(first + start + fail_idx)
                } else {
                    self.find_bad_descriptor(&src[start..start + n], &dst[start..start + n])
                        .map(|i| first + start + i)
                };
                return Err(BackendError::CopyFailed {
                    index,
                    reason: format!("cuMemcpyBatchAsync: {}", error_name(r)),
                });
            }
            start += n;
        }
        Ok(())
    }

    /// Issues the 2-D copies of a pitched transfer (see [`crate::table::expand_runs_into`]) on
    /// the lane's stream, one `cuMemcpy2DAsync` each: rows of pages at one pitch per side, copy
    /// engines only. On failure, the index of the failing copy.
    fn issue_pitched(&self, lane: Direction, slab: &SlabInner) -> Result<(), BackendError> {
        let stream = self.lane(lane).stream.raw;
        let (src, dst, size) = (slab.src(), slab.dst(), slab.size());
        let ops = src.len() / crate::table::PITCHED_ENTRIES;
        // The injected fault: a null destination in the middle copy, which the driver refuses.
        let poison = take_injected(&self.fail_next).then_some(ops / 2);
        if let Some(batch3d) = self.batch3d {
            return self.issue_pitched_batch(lane, batch3d, slab, poison);
        }
        for k in 0..ops {
            let e = crate::table::PITCHED_ENTRIES * k;
            // Unified addressing: the driver finds each side's kind (pinned host or device) from
            // the address, as cuMemcpyAsync does. (Not `mem::zeroed`: the memory-type enum has no
            // zero value.)
            let c = sys::CUDA_MEMCPY2D {
                srcXInBytes: 0,
                srcY: 0,
                srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
                srcHost: std::ptr::null(),
                srcDevice: src[e],
                srcArray: std::ptr::null_mut(),
                srcPitch: src[e + 1] as usize,
                dstXInBytes: 0,
                dstY: 0,
                dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
                dstHost: std::ptr::null_mut(),
                dstDevice: if poison == Some(k) { 0 } else { dst[e] },
                dstArray: std::ptr::null_mut(),
                dstPitch: dst[e + 1] as usize,
                WidthInBytes: size[e] as usize,
                Height: size[e + 1] as usize,
            };
            // SAFETY: every row lies in a registered block table's pages (checked at registration
            // and submission); the struct is read during the call only; the stream is valid.
            let r = unsafe { sys::cuMemcpy2DAsync_v2(&c, stream) };
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(BackendError::CopyFailed {
                    index: Some(k),
                    reason: format!("cuMemcpy2DAsync: {}", error_name(r)),
                });
            }
        }
        Ok(())
    }

    /// The 2-D copies of a pitched transfer as `cuMemcpy3DBatchAsync` calls (depth 1), up to
    /// `max_batch` copies a call: one driver call per transfer instead of one per block.
    fn issue_pitched_batch(
        &self,
        lane: Direction,
        batch3d: Batch3dFn,
        slab: &SlabInner,
        poison: Option<usize>,
    ) -> Result<(), BackendError> {
        let stream = self.lane(lane).stream.raw;
        let (src, dst, size) = (slab.src(), slab.dst(), slab.size());
        let ops = src.len() / crate::table::PITCHED_ENTRIES;
        let order = self.attrs(lane).srcAccessOrder;
        let operand = |ptr: u64, pitch: u64, rows: u64| sys::CUmemcpy3DOperand {
            type_: sys::CUmemcpy3DOperandType::CU_MEMCPY_OPERAND_TYPE_POINTER,
            op: sys::CUmemcpy3DOperand_st__bindgen_ty_1 {
                // Pointer operands count in bytes (element size 1): a row is `pitch` bytes, a
                // layer `rows` rows.
                ptr: sys::CUmemcpy3DOperand_st__bindgen_ty_1__bindgen_ty_1 {
                    ptr,
                    rowLength: pitch as usize,
                    layerHeight: rows as usize,
                    locHint: sys::CUmemLocation {
                        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_INVALID,
                        id: 0,
                    },
                },
            },
        };
        let mut list: Vec<sys::CUDA_MEMCPY3D_BATCH_OP> = (0..ops)
            .map(|k| {
                let e = crate::table::PITCHED_ENTRIES * k;
                let rows = size[e + 1];
                let d = if poison == Some(k) { 0 } else { dst[e] };
                sys::CUDA_MEMCPY3D_BATCH_OP {
                    src: operand(src[e], src[e + 1], rows),
                    dst: operand(d, dst[e + 1], rows),
                    extent: sys::CUextent3D {
                        width: size[e] as usize,
                        height: rows as usize,
                        depth: 1,
                    },
                    srcAccessOrder: order,
                    flags: 0,
                }
            })
            .collect();
        let chunk = self.opts.max_batch.max(1);
        let mut start = 0;
        while start < ops {
            let n = chunk.min(ops - start);
            let list = list[start..].as_mut_ptr();
            let mut fail_idx = usize::MAX;
            // SAFETY: `list` holds n valid ops, read during the call only; every row lies in a
            // registered block table's pages, inside one driver allocation per side (block plans
            // keep to one); the stream is valid.
            let r = unsafe {
                match batch3d {
                    Batch3dFn::V12(f) => f(n, list, &mut fail_idx, 0, stream),
                    Batch3dFn::V13(f) => f(n, list, 0, stream),
                }
            };
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(BackendError::CopyFailed {
                    index: (fail_idx < n).then_some(start + fail_idx),
                    reason: format!("cuMemcpy3DBatchAsync: {}", error_name(r)),
                });
            }
            start += n;
        }
        Ok(())
    }

    /// After a failed batch whose ABI does not say which descriptor failed: the first one whose
    /// source or destination the driver does not know.
    /// Issues a staged transfer (see [`StagedRequest`]): per step, CPU -> GPU, the step's rows
    /// copied into a ring slot on the lane's stream, then the kernel moving its pages from the
    /// slot into the GPU pages on the stage's stream; GPU -> CPU the kernel into the slot, then
    /// the rows out of it. Two slots: a step's copy across PCIe overlaps the previous step's
    /// kernel, also across transfers (the lane's stream never waits for a kernel of an earlier
    /// transfer, only for its slot). The completion marker goes where
    /// [`CudaBackend::marker_stream`] says: after every kernel issued, whatever failed, so a
    /// slab is never handed back while a kernel may read it. `dep`: an event holding the
    /// caller's stream, which the kernels gathering GPU pages wait for.
    fn issue_staged(
        &self,
        lane: Direction,
        slab: &SlabInner,
        req: StagedRequest,
        dep: Option<sys::CUevent>,
    ) -> Result<(), BackendError> {
        let l = self.lane(lane);
        let Some(kernel) = req
            .kernel
            .and_then(|k| self.kernels.read().ok()?.get(k as usize).cloned())
            .filter(|k| k.kind == KernelKind::Staged)
        else {
            return Err(BackendError::InvalidArgument(format!(
                "the staged plan needs a staged kernel loaded by this engine (load_kernel), got \
                 {:?}",
                req.kernel
            )));
        };
        let mut stage = l.stage.lock().unwrap_or_else(|e| e.into_inner());
        if stage.as_ref().is_some_and(|st| st.slot != req.slot_bytes) {
            return Err(BackendError::InvalidArgument(format!(
                "this lane's staging slots are {} bytes, the transfer asks for {}",
                stage.as_ref().map_or(0, |st| st.slot),
                req.slot_bytes
            )));
        }
        if stage.is_none() {
            *stage = Some(Stage::new(self.ctx.raw, req.slot_bytes)?);
        }
        let st = stage.as_mut().expect("made above");
        let host_src = lane == Direction::HostToDevice;
        let (src, dst, size) = (slab.src(), slab.dst(), slab.size());
        let (r, first) = (req.rows, req.first_block);
        let steps = staged_steps(
            &dst[..r],
            &size[..r],
            &dst[first..2 * first],
            req.slot_bytes,
        );
        let fail_at = take_injected(&self.fail_next).then_some(steps.len() / 2);
        let kstream = st.stream.raw;
        let ctx = self.ctx.raw;
        let wait_dep = || {
            match dep {
                Some(ev) if !host_src => {
                    // SAFETY: valid event and stream; the event holds the caller's stream (CPU
                    // -> GPU kernels follow the lane's stream, which waits for it).
                    check("cuStreamWaitEvent", unsafe {
                        sys::cuStreamWaitEvent(kstream, ev, 0)
                    })
                }
                _ => Ok(()),
            }
        };
        let issued = wait_dep().and_then(|()| {
            // The block entries and geometries go to device memory in one copy, on the kernel
            // stream after the earlier transfers' kernels; `cols[c] + 8 * i` is then where the
            // kernels read entry i of column c.
            let cols = if src.len() > first {
                let lo = slab.column_addr(0) + 8 * first as u64;
                let hi = slab.column_addr(2) + 8 * src.len() as u64;
                let bytes = (hi - lo) as usize;
                let dev = st.desc_buffer(ctx, bytes)?;
                // SAFETY: `[lo, hi)` lies in the slab's pinned allocation (columns 0 to 2),
                // which outlives the copy (the lane's marker waits for the kernel stream); `dev`
                // holds at least `bytes`, and the kernels of earlier transfers that read it come
                // before this copy on the same stream.
                check("cuMemcpyAsync", unsafe {
                    sys::cuMemcpyAsync(dev, lo, bytes, kstream)
                })?;
                [0, 1, 2].map(|c| dev.wrapping_add(slab.column_addr(c)).wrapping_sub(lo))
            } else {
                [0, 1, 2].map(|c| slab.column_addr(c))
            };
            for (k, step) in steps.iter().enumerate() {
                let slot_i = (st.steps % 2) as usize;
                st.steps += 1;
                let slot_addr = st.ring.ptr + slot_i as u64 * st.slot;
                // The slot's address minus the step's first ring offset: offsets become addresses.
                let shift = slot_addr.wrapping_sub(step.ring_start);
                st.src.clear();
                st.dst.clear();
                st.size.clear();
                for i in step.rows.clone() {
                    let at = dst[i].wrapping_add(shift);
                    let (a, b) = if host_src { (src[i], at) } else { (at, src[i]) };
                    st.src.push(a);
                    st.dst.push(b);
                    st.size.push(size[i]);
                }
                if Some(k) == fail_at {
                    // The injected fault: a null address the driver refuses, as in
                    // `issue_copies`.
                    let mid = st.dst.len() / 2;
                    st.dst[mid] = 0;
                }
                // The step's blocks, a launch for each run of blocks of one group (one
                // geometry): the kernel computes every page's addresses from the block entries,
                // read from the stage's device copy of the slab (not overwritten before the
                // kernel ends: the next transfer's copy comes after it on the same stream); the
                // ids were checked at submission, the slot is this lane's.
                let blocks = (first + step.blocks.start)..(first + step.blocks.end);
                let launch = || {
                    let mut b = blocks.start;
                    while b < blocks.end {
                        let table = size[b];
                        let end = (b..blocks.end)
                            .find(|&i| size[i] != table)
                            .unwrap_or(blocks.end);
                        let at = StagedLaunch {
                            table: table as usize,
                            segments: src[table as usize],
                            ring_base: shift,
                            ring_src: host_src,
                        };
                        self.launch(&kernel, kstream, cols, (b, (end - b) as u64, 1), Some(at))?;
                        b = end;
                    }
                    Ok::<(), BackendError>(())
                };
                let (copy, ready, free) = (&st.src, &st.ready[slot_i], &st.free[slot_i]);
                let rows_first = step.rows.start;
                if host_src {
                    // SAFETY: valid event and stream; a never-recorded event is waited for at once.
                    check("cuStreamWaitEvent", unsafe {
                        sys::cuStreamWaitEvent(l.stream.raw, free.raw, 0)
                    })?;
                    self.copy_arrays(lane, copy, &st.dst, &st.size, rows_first)?;
                    order(ready, l.stream.raw, kstream)?;
                    launch()?;
                    // SAFETY: valid event and stream.
                    check("cuEventRecord", unsafe {
                        sys::cuEventRecord(free.raw, kstream)
                    })?;
                } else {
                    // SAFETY: as above.
                    check("cuStreamWaitEvent", unsafe {
                        sys::cuStreamWaitEvent(kstream, free.raw, 0)
                    })?;
                    launch()?;
                    order(ready, kstream, l.stream.raw)?;
                    self.copy_arrays(lane, copy, &st.dst, &st.size, rows_first)?;
                    // SAFETY: valid event and stream.
                    check("cuEventRecord", unsafe {
                        sys::cuEventRecord(free.raw, l.stream.raw)
                    })?;
                }
            }
            Ok(())
        });
        issued
    }

    /// The stream the completion marker of a transfer goes on, ordered after all of the
    /// transfer's work and after the lane's earlier markers. A staged CPU -> GPU transfer ends
    /// with kernels: its marker goes on the kernel stream, after the lane's stream (so the
    /// lane's stream goes on to the next transfer's rows at once), unless the lane's stream is
    /// the caller's, who expects the whole transfer on it. Any other marker goes on the lane's
    /// stream, after the kernel stream where a staged transfer or marker went there last.
    /// Where an ordering call fails, this waits for the kernel stream instead.
    fn marker_stream(&self, lane: Direction, staged: bool) -> sys::CUstream {
        let l = self.lane(lane);
        let mut stage = l.stage.lock().unwrap_or_else(|e| e.into_inner());
        let Some(st) = stage.as_mut() else {
            return l.stream.raw;
        };
        let kstream = st.stream.raw;
        if staged
            && lane == Direction::HostToDevice
            && l.stream.owned
            && order(&st.lane_done, l.stream.raw, kstream).is_ok()
        {
            st.marker_on_stage = true;
            return kstream;
        }
        if staged || st.marker_on_stage {
            if order(&st.join, kstream, l.stream.raw).is_err() {
                // SAFETY: a valid stream; blocks until its work is done.
                let _ = unsafe { sys::cuStreamSynchronize(kstream) };
            }
            st.marker_on_stage = false;
        }
        l.stream.raw
    }

    /// Launches `k` on `stream` over entries `[p0, p0 + n)` of a transfer whose columns (src,
    /// dst, size) hold entry 0 at `cols`: a page kernel's descriptors, each cut in `split`
    /// slices, or (with `staged`) a staged kernel's block entries. The caller vouches that the
    /// kernel may read `cols` until it ends and that every address the entries name may be
    /// written or read as they say.
    fn launch(
        &self,
        k: &LoadedKernel,
        stream: sys::CUstream,
        cols: [u64; 3],
        (p0, n, split): (usize, u64, u64),
        staged: Option<StagedLaunch>,
    ) -> Result<(), BackendError> {
        if n == 0 {
            return Ok(());
        }
        let at = |c: usize, i: usize| cols[c].wrapping_add(8 * i as u64);
        // A geometry's segments start after its header (see `crate::table::staged`).
        let seg = staged.map_or(0, |g| g.table + 1);
        let mut vals = [0u64; MAX_KERNEL_PARAMS];
        for (v, p) in vals.iter_mut().zip(&k.spec.params) {
            *v = match p {
                KernelParam::Srcs | KernelParam::Ids => at(0, p0),
                KernelParam::Dsts | KernelParam::Rings => at(1, p0),
                KernelParam::Sizes => at(2, p0),
                KernelParam::Count => n,
                KernelParam::Split => split,
                KernelParam::SrcBase | KernelParam::DstBase => 0,
                KernelParam::Bases => at(0, seg),
                KernelParam::Strides => at(1, seg),
                KernelParam::Offsets => at(2, seg),
                KernelParam::Segments => staged.map_or(0, |g| g.segments),
                KernelParam::RingBase => staged.map_or(0, |g| g.ring_base),
                KernelParam::RingSrc => u64::from(staged.is_some_and(|g| g.ring_src)),
            };
        }
        // Work items: a descriptor's slices, or a block's pages.
        let items = n.saturating_mul(staged.map_or(split, |g| g.segments));
        let mut ptrs = [ptr::null_mut::<c_void>(); MAX_KERNEL_PARAMS];
        for (p, v) in ptrs.iter_mut().zip(vals.iter_mut()).take(k.total) {
            *p = (v as *mut u64).cast();
        }
        let grid = items
            .div_ceil(u64::from(k.spec.rows))
            .min(u64::from(k.spec.ctas))
            .max(1) as u32;
        // SAFETY: `function` was checked at load to take `total` 8-byte parameters, each read
        // from `vals` during the call; what the kernel reads and writes, the caller vouches for
        // (see above and the two callers: the staged plan's steps, `launch_pages`).
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                k.function as sys::CUfunction,
                grid,
                1,
                1,
                k.spec.threads,
                1,
                1,
                k.spec.shared,
                stream,
                ptrs.as_mut_ptr(),
                ptr::null_mut(),
            )
        })
    }

    /// The kernel route with a loaded kernel: `batch`'s descriptors by `kernel` on `stream`,
    /// at most `launch_bytes` (as descriptors of the batch's largest size, at least one) per
    /// launch, one launch after the other.
    fn launch_pages(
        &self,
        stream: sys::CUstream,
        batch: KernelBatch,
        kernel: u32,
        launch_bytes: u64,
    ) -> Result<(), BackendError> {
        let Some(k) = self
            .kernels
            .read()
            .ok()
            .and_then(|ks| ks.get(kernel as usize).cloned())
            .filter(|k| k.kind == KernelKind::Pages)
        else {
            return Err(BackendError::InvalidArgument(format!(
                "the kernel route needs a page kernel loaded by this engine (load_kernel), got \
                 {kernel}"
            )));
        };
        let per = (launch_bytes / batch.max_size.max(1)).max(1);
        let cols = [batch.src, batch.dst, batch.size];
        let mut p0 = 0usize;
        while p0 < batch.len {
            let n = per.min((batch.len - p0) as u64);
            let split = kernel_split(&k.spec, n, batch.max_size);
            // The kernel reads the descriptors from the slab's pinned columns in place (mapped
            // memory, alive until the lane's marker after this launch is seen); every address
            // they name was checked against registered memory at submission.
            self.launch(&k, stream, cols, (p0, n, split), None)?;
            p0 += n as usize;
        }
        Ok(())
    }

    /// The highest sequence number of `lane` known complete.
    fn completed_seq(&self, lane: Direction) -> u64 {
        let l = self.lane(lane);
        if self.write_value {
            // SAFETY: `counter` is 8-byte aligned mapped pinned memory that lives as long as the
            // backend; the device writes it with the stream's memory barrier before the value.
            // Acquire: the copies' bytes are read only after seeing their sequence number.
            let written = unsafe { AtomicU64::from_ptr(l.counter) }.load(Ordering::Acquire);
            // Acquire: pairs with the Release store in `issue_job`, after what it recorded in
            // the slab (a failure): a transfer is complete once its marker is both queued and
            // reached.
            return written.min(l.submitted.load(Ordering::Acquire));
        }
        let submitted = l.submitted.load(Ordering::Acquire);
        let mut known = l.known.load(Ordering::Acquire);
        while known < submitted {
            let ev = l.done_events[((known + 1) as usize) % l.done_events.len()].raw;
            // SAFETY: valid event; cuEventQuery never blocks.
            if unsafe { sys::cuEventQuery(ev) } != sys::CUresult::CUDA_SUCCESS {
                break;
            }
            known += 1;
        }
        // fetch_max: racing pollers only ever move it forward.
        l.known.fetch_max(known, Ordering::AcqRel);
        known
    }

    /// An event of the lane's pool (made if the pool is empty) recorded on the caller's stream.
    fn record_dep(&self, lane: Direction, stream: u64) -> Result<Event, BackendError> {
        let l = self.lane(lane);
        let pooled = l.deps.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let ev = match pooled {
            Some(ev) => ev,
            None => Event::create(self.ctx.raw, false)?,
        };
        // SAFETY: `stream` is the caller's stream handle (0 is the legacy default stream, which
        // may be recorded on); a bad handle comes back as an error, failing this transfer only.
        let r = check("cuEventRecord", unsafe {
            sys::cuEventRecord(ev.raw, stream as sys::CUstream)
        });
        match r {
            Ok(()) => Ok(ev),
            Err(e) => {
                l.deps.lock().unwrap_or_else(|e| e.into_inner()).push(ev);
                Err(e)
            }
        }
    }

    /// Blocks until the lane's issuing thread has issued everything handed to it.
    fn wait_drained(&self, lane: Direction) {
        let l = self.lane(lane);
        let mut q = l.queue.lock().unwrap_or_else(|e| e.into_inner());
        // Acquire: pairs with the Release decrement in `work`.
        while l.pending.load(Ordering::Acquire) != 0 {
            q = l.drained.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// The issuing thread of `lane`: issues the jobs handed to it, in order, until the backend
    /// stops and the queue is empty. On a lane that failed it issues nothing more: the engine
    /// reports those transfers failed once `pending` is 0.
    fn work(&self, lane: Direction) {
        let l = self.lane(lane);
        loop {
            let job = {
                let mut q = l.queue.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    if let Some(job) = q.pop_front() {
                        break job;
                    }
                    // Acquire: pairs with the Release store in `CudaBackend`'s Drop.
                    if self.stopping.load(Ordering::Acquire) {
                        return;
                    }
                    q = l.work.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            if l.error.get().is_none() {
                match self.make_current() {
                    Ok(_ctx) => {
                        let kernel = job.kernel.map(|(batch, kernel, launch_bytes)| {
                            let k = PageKernel::Loaded {
                                kernel,
                                launch_bytes,
                            };
                            (batch, k)
                        });
                        let _ = self.issue_job(lane, job, kernel);
                    }
                    Err(e) => {
                        let _ = l.error.set(e);
                    }
                }
            }
            let _q = l.queue.lock().unwrap_or_else(|e| e.into_inner());
            // Release: the slab is not touched after this (pairs with Acquire loads in
            // `wait_drained` and `failed`).
            if l.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
                l.drained.notify_all();
            }
        }
    }

    /// Issues one transfer on the lane's streams: the wait for the caller's stream, its copies
    /// (and kernels), then its completion marker, which goes in whatever happened to the copies,
    /// so the lane stays ordered. The context is current. `Err` where the marker could not be
    /// queued: the lane has failed.
    fn issue_job(
        &self,
        lane: Direction,
        job: Job,
        launch: Option<(KernelBatch, PageKernel<'_>)>,
    ) -> Result<Submitted, BackendError> {
        let l = self.lane(lane);
        let seq = job.seq;
        // SAFETY: the engine keeps the slab in flight until completion of `seq` is observed,
        // which needs the marker queued below (or, on a failed lane, `pending` back at 0).
        let slab = unsafe { job.slab.get() };
        let mut outcome = job.failed.map_or(Ok(()), Err);
        if let Some(dep) = &job.dep {
            // SAFETY: both handles valid; our stream waits for the caller's work at submission.
            outcome = check("cuStreamWaitEvent", unsafe {
                sys::cuStreamWaitEvent(l.stream.raw, dep.raw, 0)
            });
        }
        let timing = (!l.timing_events.is_empty()).then(|| {
            let (start, end) = &l.timing_events[(seq as usize) % l.timing_events.len()];
            (start.raw, end.raw)
        });
        if let (Ok(()), Some((start, _))) = (&outcome, timing) {
            // SAFETY: valid event and stream. A failed timing record only loses the timing.
            let _ = unsafe { sys::cuEventRecord(start, l.stream.raw) };
        }
        // Copies are issued only when the ordering they depend on is in place.
        let mut first = 0;
        if let (Ok(()), Some((batch, kernel))) = (&outcome, launch) {
            // The small descriptors first, by the copy kernel on this lane's stream; it reads them
            // from the slab in place. Then DMA for the rest, then the completion marker: one
            // submission, one completion.
            first = batch.len;
            outcome = match kernel {
                PageKernel::Launcher(launch) => launch(KernelBatch {
                    stream: l.stream.raw as u64,
                    ..batch
                })
                .map_err(|reason| BackendError::CopyFailed {
                    index: None,
                    reason: format!("copy kernel: {reason}"),
                }),
                PageKernel::Loaded {
                    kernel,
                    launch_bytes,
                } => self.launch_pages(l.stream.raw, batch, kernel, launch_bytes),
            };
        }
        if outcome.is_ok() && first < slab.len() {
            let _timed = AddElapsed::start(&self.driver_ns);
            let dep = job.dep.as_ref().map(|e| e.raw);
            outcome = if let Some(req) = job.staged {
                self.issue_staged(lane, slab, req, dep)
            } else if job.pitched {
                self.issue_pitched(lane, slab)
            } else {
                self.issue_copies(lane, slab, first)
            };
        }
        if let Some(dep) = job.dep {
            // Every wait on it is queued: it may be recorded again.
            l.deps.lock().unwrap_or_else(|e| e.into_inner()).push(dep);
        }
        let tail = self.marker_stream(lane, job.staged.is_some());
        if let (Ok(()), Some((_, end))) = (&outcome, timing) {
            // SAFETY: as above.
            let _ = unsafe { sys::cuEventRecord(end, tail) };
        }
        if let Err(e) = &outcome {
            slab.set_failed(e.to_string());
        }
        if let Err(e) = self.signal(lane, seq, tail) {
            // Release: pairs with the Acquire load in `lane_idle`.
            l.unmarked.store(true, Ordering::Release);
            let _ = l.error.set(e.clone());
            return Err(e);
        }
        // Release: pairs with Acquire loads in `completed` (event mode) and health checks.
        l.submitted.store(seq, Ordering::Release);
        Ok(if outcome.is_ok() {
            Submitted::Ok
        } else {
            Submitted::CopyFailed
        })
    }

    /// The lane's error, once its issuing thread holds no slab any more (before that, the
    /// engine must not hand the slabs of its transfers back).
    fn failed(&self, lane: Direction) -> Option<&BackendError> {
        let l = self.lane(lane);
        // Acquire: pairs with the Release decrement in `work`.
        l.error
            .get()
            .filter(|_| l.pending.load(Ordering::Acquire) == 0)
    }

    fn find_bad_descriptor(&self, src: &[u64], dst: &[u64]) -> Option<usize> {
        (0..src.len()).find(|&i| memory_type(src[i]).is_none() || memory_type(dst[i]).is_none())
    }

    /// Queues the completion marker of `seq` on `stream` (see [`Self::marker_stream`]).
    fn signal(&self, lane: Direction, seq: u64, stream: sys::CUstream) -> Result<(), BackendError> {
        let l = self.lane(lane);
        if self.write_value {
            // SAFETY: writes one u64 into our mapped pinned counter, after the preceding copies
            // (flags 0 keeps the memory barrier: the copied bytes are visible before the value).
            check("cuStreamWriteValue64", unsafe {
                sys::cuStreamWriteValue64_v2(stream, l.counter_dev, seq, 0)
            })
        } else {
            let ev = l.done_events[(seq as usize) % l.done_events.len()].raw;
            // SAFETY: the event and stream are valid; re-recording a ring slot is safe because the
            // engine never has more than half the ring in flight.
            check("cuEventRecord", unsafe { sys::cuEventRecord(ev, stream) })
        }
    }

    fn check_stream(&self, lane: Direction) {
        let l = self.lane(lane);
        if l.error.get().is_some() {
            return;
        }
        // SAFETY: the stream is valid for the backend's life; cuStreamQuery never blocks.
        let r = unsafe { sys::cuStreamQuery(l.stream.raw) };
        if r != sys::CUresult::CUDA_SUCCESS && r != sys::CUresult::CUDA_ERROR_NOT_READY {
            let _ = l.error.set(BackendError::Driver {
                call: "cuStreamQuery",
                code: r as i32,
                name: error_name(r),
            });
        }
    }
}

/// Restores the calling thread's previous context on drop (see [`bind`]).
#[must_use]
struct CtxGuard {
    prev: Option<sys::CUcontext>,
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        if let Some(prev) = self.prev {
            // SAFETY: `prev` was current on this thread a moment ago (or null, which unsets).
            // A failure leaves our context current, which is harmless; Drop must not panic.
            let _ = unsafe { result::ctx::set_current(prev) };
        }
    }
}

/// The driver's memory type of `addr`, or `None` where the driver does not know the address.
fn memory_type(addr: u64) -> Option<sys::CUmemorytype> {
    let mut t: u32 = 0;
    // SAFETY: writes one u32 (CUmemorytype) for a pointer attribute query; any address is allowed.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            &mut t as *mut u32 as *mut c_void,
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

fn pointer_u64(addr: u64, attr: sys::CUpointer_attribute) -> Option<u64> {
    let mut v: u64 = 0;
    // SAFETY: the range attributes are pointer-sized (CUdeviceptr / size_t).
    let r = unsafe { sys::cuPointerGetAttribute(&mut v as *mut u64 as *mut c_void, attr, addr) };
    (r == sys::CUresult::CUDA_SUCCESS).then_some(v)
}

fn device_ordinal(addr: u64) -> Option<i32> {
    let mut v: i32 = -1;
    // SAFETY: the ordinal attribute is an int.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            &mut v as *mut i32 as *mut c_void,
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
fn driver_has(symbol: &str) -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: `is_culib_present` only tries `dlopen` on the candidate names.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
        // SAFETY: the library is present (checked first), so `culib` opens it without panicking.
        && missing_symbol(unsafe { sys::culib() }, &[symbol]).is_none()
}

/// What the driver says `addr` is: `Host` for page-locked host memory, `Device` for any other
/// memory it knows (the CPU cannot read it directly). `None` where it does not know the address
/// (ordinary pageable host memory) and where there is no driver to ask.
pub(crate) fn memory_kind(addr: u64) -> Option<MemoryKind> {
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
pub(crate) fn host_device_pointer(host: u64) -> Result<Option<u64>, BackendError> {
    if !driver_has("cuMemHostGetDevicePointer_v2") {
        return Ok(None);
    }
    let mut dev: sys::CUdeviceptr = 0;
    // SAFETY: the symbol is present (checked above); the driver writes one device pointer and only
    // looks `host` up, never dereferences it.
    check("cuMemHostGetDevicePointer", unsafe {
        sys::cuMemHostGetDevicePointer_v2(&mut dev, host as *mut c_void, 0)
    })?;
    Ok(Some(dev))
}

/// Copies `len` bytes from `src` to `dst` with `cuMemcpy` (the direction inferred from the
/// addresses under unified addressing; synchronous except between device addresses).
///
/// # Safety
/// Both ranges must be allocated, `dst` writable and not overlapping `src`, for the whole copy:
/// the driver copies host memory it does not know with the CPU.
pub(crate) unsafe fn memcpy(dst: u64, src: u64, len: usize) -> Result<(), BackendError> {
    if !driver_has("cuMemcpy") {
        return Err(BackendError::Unavailable(
            "no NVIDIA driver library (libcuda.so) with cuMemcpy found on this machine".into(),
        ));
    }
    // SAFETY: the symbol is present (checked above); the ranges are the caller's guarantee.
    check("cuMemcpy", unsafe { sys::cuMemcpy(dst, src, len) })
}

impl Backend for CudaBackend {
    fn info(&self) -> BackendInfo {
        BackendInfo {
            name: "cuda",
            driver_version: self.driver_version,
            device: Some(format!("cuda:{} ({})", self.ordinal, self.name)),
            copy_path: match self.batch {
                Some(b) => format!("{b:?}"),
                None => "cuMemcpyAsync loop".into(),
            },
            completion: if self.write_value {
                "cuStreamWriteValue64 into mapped pinned memory"
            } else {
                "event query"
            },
        }
    }

    fn load_kernel(&self, spec: KernelSpec) -> Result<Option<u32>, BackendError> {
        let bad = |why: String| Err(BackendError::InvalidArgument(why));
        if spec.function == 0 {
            return bad("the kernel's function handle is null".into());
        }
        if !(1..=1024).contains(&spec.threads) || spec.rows == 0 || spec.ctas == 0 {
            return bad(format!(
                "a kernel needs 1-1024 threads, rows and ctas >= 1; got {}, {}, {}",
                spec.threads, spec.rows, spec.ctas
            ));
        }
        let Some(info) = self.param_info else {
            return Err(BackendError::Unavailable(format!(
                "launching kernels from the core needs cuFuncGetParamInfo (CUDA 12.4+ driver); \
                 this driver is {}",
                self.driver_version
            )));
        };
        let _ctx = self.make_current()?;
        let f = spec.function as sys::CUfunction;
        let mut sizes = Vec::new();
        while sizes.len() <= MAX_KERNEL_PARAMS {
            let (mut offset, mut size) = (0usize, 0usize);
            // SAFETY: `f` is a CUfunction of this context (the caller's contract); the driver
            // writes two integers, or fails past the last parameter.
            if unsafe { info(f, sizes.len(), &mut offset, &mut size) }
                != sys::CUresult::CUDA_SUCCESS
            {
                break;
            }
            sizes.push(size);
        }
        if sizes.len() > MAX_KERNEL_PARAMS || sizes.len() < spec.params.len() {
            return bad(format!(
                "the kernel takes {} parameters; {} named, at most {MAX_KERNEL_PARAMS} in all",
                sizes.len(),
                spec.params.len()
            ));
        }
        if let Some(i) = sizes.iter().position(|&z| z != 8) {
            return bad(format!(
                "parameter {i} of the kernel is {} bytes; every parameter must be 8 (int64 or \
                 a pointer)",
                sizes[i]
            ));
        }
        let mut most = 0;
        // SAFETY: writes one int.
        check("cuFuncGetAttribute", unsafe {
            sys::cuFuncGetAttribute(
                &mut most,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
                f,
            )
        })?;
        if spec.threads > most as u32 {
            return bad(format!(
                "the kernel runs at most {most} threads per CTA, not {}",
                spec.threads
            ));
        }
        let kind = match spec.kind() {
            Ok(kind) => kind,
            Err(why) => return bad(why),
        };
        let mut kernels = self.kernels.write().unwrap_or_else(|e| e.into_inner());
        let id = kernels.len() as u32;
        kernels.push(LoadedKernel {
            function: spec.function,
            total: sizes.len(),
            spec,
            kind,
        });
        Ok(Some(id))
    }

    fn allocation_base(&self, addr: u64) -> Option<u64> {
        let _ctx = self.make_current().ok()?;
        let (mut base, mut size) = (0 as sys::CUdeviceptr, 0usize);
        // SAFETY: two out-pointers to locals; the driver only looks the address up.
        let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) };
        (r == sys::CUresult::CUDA_SUCCESS).then_some(base)
    }

    fn check_region(&self, start: u64, len: u64, kind: MemoryKind) -> Result<(), BackendError> {
        let _ctx = self.make_current()?;
        let last = start
            .checked_add(len.saturating_sub(1))
            .ok_or_else(|| BackendError::BadMemory(format!("range at {start:#x} overflows")))?;
        let want = match kind {
            MemoryKind::Host => sys::CUmemorytype::CU_MEMORYTYPE_HOST,
            MemoryKind::Device => sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        };
        for addr in [start, last] {
            match memory_type(addr) {
                Some(t) if t == want => {}
                Some(t) => {
                    return Err(BackendError::BadMemory(format!(
                        "{addr:#x} is {t:?} memory, not {kind} memory"
                    )))
                }
                None if kind == MemoryKind::Host => {
                    return Err(BackendError::BadMemory(format!(
                        "{addr:#x} is not page-locked host memory: allocate it with alloc_host or \
                         pin it (pin_memory=True, or Engine.pin) first"
                    )))
                }
                None => {
                    return Err(BackendError::BadMemory(format!(
                        "{addr:#x} is not device memory the driver knows"
                    )))
                }
            }
        }
        if kind == MemoryKind::Device {
            for addr in [start, last] {
                if let Some(o) = device_ordinal(addr) {
                    if o != self.ordinal {
                        return Err(BackendError::BadMemory(format!(
                            "{addr:#x} is memory of cuda:{o}, this engine is on cuda:{}",
                            self.ordinal
                        )));
                    }
                }
            }
        }
        let range = sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR;
        if let (Some(a), Some(b)) = (pointer_u64(start, range), pointer_u64(last, range)) {
            if a != b {
                return Err(BackendError::BadMemory(format!(
                    "[{start:#x}, +{len}) spans more than one allocation"
                )));
            }
        }
        Ok(())
    }

    fn alloc_host(&self, bytes: usize) -> Result<HostAlloc, BackendError> {
        let _ctx = self.make_current()?;
        let mut p = ptr::null_mut();
        // SAFETY: page-locked, device-mapped, portable, cached memory (not write-combined: the CPU
        // reads device->host results from it).
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(
                &mut p,
                bytes.max(1),
                sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
            )
        })?;
        let p = ptr::NonNull::new(p as *mut u8).ok_or(BackendError::OutOfMemory { bytes })?;
        // SAFETY: `p` owns `bytes` bytes until free_host.
        Ok(unsafe { HostAlloc::from_raw(p, bytes.max(1)) })
    }

    unsafe fn free_host(&self, alloc: HostAlloc) {
        let Ok(_ctx) = self.make_current() else {
            // Nothing can be checked or freed without the context: leaked.
            return;
        };
        let mut deferred = self.deferred.lock().unwrap_or_else(|e| e.into_inner());
        if !self.may_free() {
            // A lane the engine gave up on may still reach it: freed once every lane is idle.
            deferred.push(alloc);
            return;
        }
        for a in deferred.drain(..).chain([alloc]) {
            // SAFETY: allocated by cuMemHostAlloc; the caller guarantees nothing touches it again
            // and, for memory deferred, every lane is idle now. Errors are ignored: freeing must
            // not panic, and there is nothing left to do.
            let _ = unsafe { result::free_host(a.as_ptr() as *mut c_void) };
        }
    }

    unsafe fn pin_host(&self, start: u64, len: u64) -> Result<(), BackendError> {
        let _ctx = self.make_current()?;
        // SAFETY: the caller guarantees the range is allocated host memory outliving the pin.
        unsafe { register_host(start, len) }
    }

    unsafe fn unpin_host(&self, start: u64) -> Result<(), BackendError> {
        let _ctx = self.make_current()?;
        if !self.may_free() {
            // The device may still reach the range through a lane the engine gave up on.
            return Err(BackendError::StillInFlight {
                transfers: self.left(),
            });
        }
        // SAFETY: registered by pin_host; nothing in flight (the caller's guarantee).
        unsafe { unregister_host(start) }
    }

    fn submit(
        &self,
        lane: Direction,
        seq: u64,
        slab: SlabRef,
        request: SubmitRequest<'_>,
    ) -> Result<Submitted, BackendError> {
        let _ctx = self.make_current()?;
        let l = self.lane(lane);
        // The caller's stream as it is now: recorded here, waited for when the job is issued.
        let (dep, failed) = match request.wait_stream {
            None => (None, None),
            Some(s) => match self.record_dep(lane, s) {
                Ok(ev) => (Some(ev), None),
                Err(e) => (None, Some(e)),
            },
        };
        let loaded = match request.kernel {
            Some((
                batch,
                PageKernel::Loaded {
                    kernel,
                    launch_bytes,
                },
            )) => Some((batch, kernel, launch_bytes)),
            _ => None,
        };
        let job = Job {
            seq,
            slab,
            pitched: request.pitched,
            staged: request.staged,
            dep,
            failed,
            kernel: loaded,
        };
        let launcher = matches!(request.kernel, Some((_, PageKernel::Launcher(_))));
        if launcher || !l.stream.owned {
            // Release: pairs with Acquire loads in `lane_idle` and `left_on`.
            l.accepted.store(seq, Ordering::Release);
            // Issued on the caller's thread, after everything queued before: a Python launcher
            // runs here, and a caller that gave its own stream finds the copies on it when
            // this returns.
            self.wait_drained(lane);
            return self.issue_job(lane, job, request.kernel);
        }
        self.start_worker(lane)?;
        // Release: as above.
        l.accepted.store(seq, Ordering::Release);
        l.pending.fetch_add(1, Ordering::AcqRel);
        l.queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(job);
        l.work.notify_one();
        Ok(Submitted::Ok)
    }

    fn completed(&self, lane: Direction) -> u64 {
        self.completed_seq(lane)
    }

    fn wait(
        &self,
        lane: Direction,
        seq: u64,
        timeout: Option<Duration>,
    ) -> Result<bool, BackendError> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut sleep = Duration::from_micros(10);
        let mut last_check = Instant::now();
        loop {
            if self.completed(lane) >= seq {
                return Ok(true);
            }
            if last_check.elapsed() >= HEALTH_CHECK {
                let _ctx = self.make_current()?;
                self.check_stream(lane);
                last_check = Instant::now();
            }
            if self.failed(lane).is_some() {
                return Ok(false);
            }
            if let Some(d) = deadline {
                let now = Instant::now();
                if now >= d {
                    return Ok(false);
                }
                sleep = sleep.min(d - now);
            }
            // Sleeps, growing to 500 us: no core is spun, and a finished copy is seen within
            // about one sleep.
            std::thread::sleep(sleep);
            sleep = (sleep * 2).min(Duration::from_micros(500));
        }
    }

    fn lane_error(&self, lane: Direction) -> Option<BackendError> {
        let l = self.lane(lane);
        if let Some(e) = self.failed(lane) {
            return Some(e.clone());
        }
        // A rate-limited, non-blocking health check while work is outstanding: a faulted stream
        // never writes its sequence numbers, and polls must still report its transfers.
        let now = self.epoch.elapsed().as_nanos() as u64;
        let last = l.last_check.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= HEALTH_CHECK.as_nanos() as u64
            && l.submitted.load(Ordering::Acquire) > self.completed(lane)
            && l.last_check
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            if let Ok(_ctx) = self.make_current() {
                self.check_stream(lane);
            }
        }
        self.failed(lane).cloned()
    }

    fn driver_ns(&self) -> u64 {
        self.driver_ns.load(Ordering::Relaxed)
    }

    fn device_ns(&self, lane: Direction, seq: u64) -> Option<u64> {
        let l = self.lane(lane);
        if l.timing_events.is_empty() {
            return None;
        }
        let (start, end) = &l.timing_events[(seq as usize) % l.timing_events.len()];
        let mut ms = 0f32;
        // SAFETY: both events were recorded for this (complete) transfer; the call never blocks.
        let r = unsafe { sys::cuEventElapsedTime_v2(&mut ms, start.raw, end.raw) };
        (r == sys::CUresult::CUDA_SUCCESS).then_some((ms as f64 * 1e6) as u64)
    }

    fn inject_failures(&self, count: u64) {
        self.fail_next.store(count, Ordering::Relaxed);
    }

    fn shutdown(&self, deadline: Option<Instant>) -> u64 {
        // Release: pairs with the Acquire load in `may_free`.
        self.shut.store(true, Ordering::Release);
        // Every accepted transfer is issued first (driver calls only, no wait on the device):
        // it runs, whatever the deadline says about waiting for it.
        for d in Direction::ALL {
            self.wait_drained(d);
        }
        // Without the context the queries below fail, and every lane counts as still running.
        let _ctx = self.make_current();
        // Waits without spinning a core and never inside the driver (a stream synchronize has no
        // bound), for every lane that can still finish: a failed lane never does.
        let mut sleep = Duration::from_micros(10);
        let mut last_check = Instant::now();
        loop {
            let running: Vec<Direction> = Direction::ALL
                .into_iter()
                .filter(|&d| self.failed(d).is_none() && !self.lane_idle(d))
                .collect();
            if running.is_empty() {
                break;
            }
            if let Some(d) = deadline {
                let now = Instant::now();
                if now >= d {
                    break;
                }
                sleep = sleep.min(d - now);
            }
            if last_check.elapsed() >= HEALTH_CHECK {
                for &d in &running {
                    self.check_stream(d);
                }
                last_check = Instant::now();
            }
            std::thread::sleep(sleep);
            sleep = (sleep * 2).min(Duration::from_micros(500));
        }
        let mut left = 0;
        for d in Direction::ALL {
            if self.lane_idle(d) {
                continue;
            }
            let transfers = self.left_on(d);
            left += transfers;
            // Every transfer of the lane not complete yet is reported failed with this (unless the
            // lane already failed), and the memory it may reach stays allocated.
            let _ = self
                .lane(d)
                .error
                .set(BackendError::StillInFlight { transfers });
        }
        left
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Never panics: driver errors during teardown are ignored (there is no one left to tell).
        if crate::fork::fork_generation() != self.generation {
            // A forked child: the handles are the parent's. The fields are never dropped.
            return;
        }
        let idle = match self.make_current() {
            Ok(_ctx) => {
                let idle = Direction::ALL.into_iter().all(|d| self.lane_idle(d));
                if idle {
                    let deferred = self.deferred.get_mut().unwrap_or_else(|e| e.into_inner());
                    for a in deferred.drain(..) {
                        // SAFETY: from cuMemHostAlloc, handed back by its owner, and every lane
                        // is idle: nothing can reach it any more.
                        let _ = unsafe { result::free_host(a.as_ptr() as *mut c_void) };
                    }
                }
                idle
            }
            Err(_) => false,
        };
        if !idle {
            // A staging ring a kernel or copy may still reach is leaked with its stream and
            // events, never freed under the device.
            for l in self.lanes.iter_mut() {
                std::mem::forget(l.stage.get_mut().unwrap_or_else(|e| e.into_inner()).take());
            }
        }
        // SAFETY: each field is dropped at most once, here, and the backend is not used again.
        // Streams and events may go with work still queued: the driver releases them after it.
        unsafe { ManuallyDrop::drop(&mut self.lanes) };
        if idle {
            // SAFETY: as above. No stream writes the counters any more, and nothing made in the
            // context is left.
            unsafe {
                ManuallyDrop::drop(&mut self.counters);
                ManuallyDrop::drop(&mut self.ctx);
            }
        }
        // Otherwise a lane the engine gave up on may still write its counter or reach memory
        // handed back: the counters, that memory and the context reference are leaked, never
        // freed under the device.
    }
}

// Miri cannot dlopen a driver (or probe for one).
#[cfg(all(test, not(miri)))]
mod tests {
    use std::sync::atomic::AtomicU32;
    use std::sync::{mpsc, Arc, MutexGuard};

    use super::*;
    use crate::engine::{Engine, EngineConfig};

    /// The tests that make a backend share the device's primary context, whose state some check.
    fn gpu() -> MutexGuard<'static, ()> {
        static GPU: Mutex<()> = Mutex::new(());
        GPU.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Driver resources alive that this thread made.
    fn live() -> i64 {
        hooks::LIVE.with(|l| l.get())
    }

    fn device0() -> sys::CUdevice {
        driver_available().expect("a CUDA driver");
        let mut dev = 0;
        // SAFETY: symbols checked; writes one handle.
        check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut dev, 0) }).expect("device 0");
        dev
    }

    /// Whether anyone holds a reference to device 0's primary context.
    fn primary_ctx_active() -> bool {
        let (mut flags, mut active) = (0u32, 0i32);
        // SAFETY: writes two ints.
        check("cuDevicePrimaryCtxGetState", unsafe {
            sys::cuDevicePrimaryCtxGetState(device0(), &mut flags, &mut active)
        })
        .expect("primary context state");
        active != 0
    }

    /// Constructions failing at each driver resource in turn: `(step, error)` of each, then the
    /// number of steps of the one that succeeds (dropped at once).
    fn fail_at_each_step(opts: &CudaOptions) -> (Vec<(usize, BackendError)>, usize) {
        let mut failures = Vec::new();
        for step in 0.. {
            hooks::FAIL_AT.with(|f| f.set(Some(step)));
            let made = CudaBackend::new(opts.clone());
            hooks::FAIL_AT.with(|f| f.set(None));
            match made {
                Err(e) => failures.push((step, e)),
                Ok(b) => {
                    drop(b);
                    return (failures, step);
                }
            }
        }
        unreachable!()
    }

    #[test]
    #[ignore = "needs CUDA"]
    fn a_construction_failing_at_any_resource_frees_all_it_made() {
        let _gpu = gpu();
        // A reference of our own keeps the context alive across the attempts (a primary context
        // is slow to create); the next test checks the driver's own count.
        let held = PrimaryCtx::retain(device0()).expect("retain");
        let before = live();
        for completion in [CompletionMode::Event, CompletionMode::Auto] {
            let opts = CudaOptions {
                completion,
                timing: true,
                max_in_flight: 3,
                ..CudaOptions::new(0)
            };
            let (failures, steps) = fail_at_each_step(&opts);
            // The context, the counters, a stream per lane, and the rings of 6 (the events a
            // lane records callers' streams with are made on its first transfers).
            let rings = if completion == CompletionMode::Event {
                3
            } else {
                2
            };
            assert_eq!(steps, 2 + 4 + 4 * 6 * rings, "{completion:?}");
            assert_eq!(failures.len(), steps);
            for (step, e) in failures {
                assert!(e.to_string().contains("injected"), "{step}: {e}");
                assert_eq!(
                    live(),
                    before,
                    "{completion:?}: step {step} left resources alive"
                );
            }
            assert_eq!(live(), before);
        }
        drop(held);
    }

    #[test]
    #[ignore = "needs CUDA"]
    fn a_failed_construction_releases_the_primary_context() {
        let _gpu = gpu();
        assert!(
            !primary_ctx_active(),
            "something else holds the primary context"
        );
        // A legacy default stream is refused before any driver resource exists.
        let mut opts = CudaOptions::new(0);
        opts.streams[Direction::DeviceToHost.lane()] = Some(1);
        let e = CudaBackend::new(opts).expect_err("stream 1 is refused");
        assert!(matches!(e, BackendError::InvalidArgument(_)), "{e}");
        assert!(!primary_ctx_active(), "the context reference leaked");
        // Failures after the context: at the counters, at the third lane's stream, mid-ring.
        let opts = CudaOptions {
            completion: CompletionMode::Event,
            max_in_flight: 3,
            ..CudaOptions::new(0)
        };
        for step in [1, 6, 20] {
            hooks::FAIL_AT.with(|f| f.set(Some(step)));
            let made = CudaBackend::new(opts.clone());
            hooks::FAIL_AT.with(|f| f.set(None));
            assert!(made.is_err(), "step {step}");
            assert!(
                !primary_ctx_active(),
                "step {step}: the context reference leaked"
            );
        }
        drop(CudaBackend::new(opts).expect("a backend"));
        assert!(
            !primary_ctx_active(),
            "a backend dropped keeps its context reference"
        );
    }

    #[test]
    #[ignore = "needs CUDA"]
    fn the_event_ring_holds_what_the_engine_lets_into_flight() {
        let _gpu = gpu();
        let opts = CudaOptions {
            completion: CompletionMode::Event,
            max_in_flight: usize::MAX,
            ..CudaOptions::new(0)
        };
        let backend = Arc::new(CudaBackend::new(opts).expect("a backend"));
        // The engine refuses a setting past the limit; the backend, given one, clamps it.
        let engine = Engine::new(
            backend.clone(),
            EngineConfig {
                max_in_flight: super::super::MAX_IN_FLIGHT,
                ..EngineConfig::default()
            },
        );
        let clamped = engine.config().max_in_flight;
        assert_eq!(clamped, super::super::MAX_IN_FLIGHT);
        assert_eq!(backend.opts.max_in_flight, clamped);
        for l in backend.lanes.iter() {
            assert_eq!(l.done_events.len(), 2 * clamped);
        }
    }

    /// A stream of the caller's held back until `open`: the transfers that wait for it cannot
    /// finish before then.
    struct Gate {
        flag: PinnedHost,
        stream: Stream,
    }

    impl Gate {
        fn new(ctx: sys::CUcontext) -> Gate {
            let _bound = bind(ctx).expect("bind");
            let flag = PinnedHost::alloc(ctx, 64).expect("flag");
            let mut flag_dev = 0;
            // SAFETY: the flag is mapped pinned memory; writes one device pointer.
            check("cuMemHostGetDevicePointer", unsafe {
                sys::cuMemHostGetDevicePointer_v2(&mut flag_dev, flag.as_ptr() as *mut c_void, 0)
            })
            .expect("device pointer");
            let stream = Stream::create(ctx).expect("stream");
            // SAFETY: valid stream and mapped address, alive until the gate drops (after `open`).
            check("cuStreamWaitValue32", unsafe {
                sys::cuStreamWaitValue32_v2(
                    stream.raw,
                    flag_dev,
                    1,
                    sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
                )
            })
            .expect("wait value");
            Gate { flag, stream }
        }

        fn raw(&self) -> u64 {
            self.stream.raw as u64
        }

        /// The flag's address, for a thread that opens the gate while it lives.
        fn flag(&self) -> usize {
            self.flag.as_ptr() as usize
        }

        fn open(&self) {
            open_flag(self.flag());
        }

        /// Opens the gate and waits for its stream.
        fn drain(&self) {
            self.open();
            let _bound = bind(self.stream.ctx).expect("bind");
            // SAFETY: a valid stream; the gate is open, so this returns.
            check("cuStreamSynchronize", unsafe {
                sys::cuStreamSynchronize(self.stream.raw)
            })
            .expect("the gated stream ran");
        }
    }

    fn open_flag(flag: usize) {
        // SAFETY: 4 aligned bytes of a live gate's flag; the device only reads them.
        unsafe { AtomicU32::from_ptr(flag as *mut u32) }.store(1, Ordering::Release);
    }

    /// An engine on `backend` whose h2d and d2h transfers (job ids 1 and 2, one MiB each between
    /// an engine buffer and device memory) wait for a closed gate.
    fn held_transfers(backend: &Arc<CudaBackend>, timeout: Duration) -> (Engine, Gate, u64) {
        let gate = Gate::new(backend.ctx.raw);
        let engine = Engine::new(
            backend.clone(),
            EngineConfig {
                shutdown_timeout: timeout,
                ..EngineConfig::default()
            },
        );
        let n = 1u64 << 20;
        let host = engine.alloc_host(n as usize).expect("host buffer");
        let dev = {
            let _bound = bind(backend.ctx.raw).expect("bind");
            // SAFETY: a plain device allocation, freed by the caller after the gate's drain.
            unsafe { result::malloc_sync(n as usize) }.expect("device memory")
        };
        // SAFETY: device memory of `n` bytes that outlives the engine.
        unsafe { engine.register(dev, n, MemoryKind::Device) }.expect("register");
        let w = Some(gate.raw());
        engine
            .submit(1, &[host], &[dev], &[n], Direction::HostToDevice, w)
            .expect("submit h2d");
        engine
            .submit(2, &[dev], &[host], &[n], Direction::DeviceToHost, w)
            .expect("submit d2h");
        (engine, gate, dev)
    }

    fn free_device(backend: &CudaBackend, dev: sys::CUdeviceptr) {
        let _bound = bind(backend.ctx.raw).expect("bind");
        // SAFETY: from malloc_sync; the gate is drained, so no copy uses it.
        unsafe { result::free_sync(dev) }.expect("free device memory");
    }

    #[test]
    #[ignore = "needs CUDA"]
    fn shutdown_keeps_its_deadline_and_frees_nothing_the_device_may_reach() {
        let _gpu = gpu();
        let backend = Arc::new(CudaBackend::new(CudaOptions::new(0)).expect("a backend"));
        let (engine, gate, dev) = held_transfers(&backend, Duration::from_millis(200));
        let (stop, stopped) = mpsc::channel::<()>();
        let flag = gate.flag();
        std::thread::scope(|s| {
            // A watchdog: a shutdown that waits for the gate fails the timing check, not hangs.
            // Scoped: it ends before the gate does.
            s.spawn(move || {
                if stopped.recv_timeout(Duration::from_secs(5)).is_err() {
                    open_flag(flag);
                }
            });
            let started = Instant::now();
            engine.shutdown();
            let took = started.elapsed();
            let _ = stop.send(());
            assert!(
                took >= Duration::from_millis(200) && took < Duration::from_secs(2),
                "shutdown took {took:?} with a 200 ms timeout"
            );
        });
        let mut results = Vec::new();
        engine.get_finished(&mut results);
        results.sort_by_key(|r| r.job_id);
        assert_eq!(results.iter().map(|r| r.job_id).collect::<Vec<_>>(), [1, 2]);
        for r in &results {
            assert!(!r.success, "{r:?}");
            assert!(
                r.error.as_deref().unwrap_or("").contains("shut down"),
                "{r:?}"
            );
        }
        assert_eq!(
            backend.shutdown(Some(Instant::now())),
            2,
            "both left in flight"
        );
        for d in [Direction::HostToDevice, Direction::DeviceToHost] {
            assert_eq!(
                backend.lane_error(d),
                Some(BackendError::StillInFlight { transfers: 1 })
            );
        }
        // The engine goes while the device may still read its slabs: they wait in the backend.
        drop(engine);
        let waiting = backend.deferred.lock().unwrap().len();
        assert!(waiting > 0, "the pool's slabs were freed under the device");
        // The transfers run once the gate opens, and what they use is still there. (`wait` says
        // no at once for a lane shutdown gave up on: the context's synchronize waits instead.)
        gate.drain();
        {
            let _bound = bind(backend.ctx.raw).unwrap();
            // SAFETY: no argument; reports a fault of any work in the context.
            check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() }).expect("no fault");
        }
        for d in [Direction::HostToDevice, Direction::DeviceToHost] {
            assert_eq!(backend.completed(d), 1, "{d:?} ran after the shutdown");
        }
        free_device(&backend, dev);
        drop(gate);
        let before = live();
        let backend = Arc::into_inner(backend).expect("the last reference");
        drop(backend);
        // 4 streams, the 2 events the transfers' lanes recorded the gate's stream with, the
        // counters and the context: every lane is idle now.
        assert_eq!(live(), before - 8, "an idle backend frees everything");
    }

    #[test]
    #[ignore = "needs CUDA"]
    fn a_backend_dropped_under_running_copies_leaks_rather_than_frees() {
        let _gpu = gpu();
        let backend = Arc::new(CudaBackend::new(CudaOptions::new(0)).expect("a backend"));
        let ctx = backend.ctx.raw;
        let (engine, gate, dev) = held_transfers(&backend, Duration::ZERO);
        engine.shutdown();
        drop(engine);
        let before = live();
        drop(Arc::into_inner(backend).expect("the last reference"));
        // Streams and events go (the driver releases them after their work); the counters the
        // streams will write, and the context reference, stay.
        assert_eq!(live(), before - 6);
        assert!(primary_ctx_active());
        gate.drain();
        let _bound = bind(ctx).unwrap();
        // SAFETY: no argument; reports a fault of any work in the context.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
            .expect("the copies and completion writes ran into memory still allocated");
        // SAFETY: from malloc_sync; the context is idle.
        unsafe { result::free_sync(dev) }.unwrap();
        drop(gate);
        drop(_bound);
        // Give back the reference the backend kept, for the tests after this one.
        // SAFETY: one reference was leaked by the drop above.
        unsafe { result::primary_ctx::release(device0()) }.unwrap();
    }

    #[test]
    fn parses_settings() {
        assert_eq!("loop".parse::<CopyPath>(), Ok(CopyPath::Loop));
        assert!("fast".parse::<CopyPath>().is_err());
        assert_eq!("any".parse::<AccessOrder>(), Ok(AccessOrder::Any));
        assert_eq!("event".parse::<CompletionMode>(), Ok(CompletionMode::Event));
        let o = CudaOptions::new(0);
        assert_eq!(
            o.access_order[Direction::HostToDevice.lane()],
            AccessOrder::Any
        );
        assert_eq!(
            o.access_order[Direction::DeviceToHost.lane()],
            AccessOrder::Stream
        );
    }

    #[test]
    fn a_missing_symbol_is_named_not_a_panic() {
        // libc stands in for a driver library that lacks the CUDA entry points.
        // SAFETY: opening libc has no initialisation side effects.
        let lib = unsafe { libloading::Library::new("libc.so.6") }.expect("libc");
        assert_eq!(
            missing_symbol(&lib, &["malloc", "cuMemcpyBatchAsync"]),
            Some("cuMemcpyBatchAsync")
        );
        assert_eq!(missing_symbol(&lib, &["malloc", "free"]), None);
    }

    #[test]
    fn without_a_driver_the_backend_reports_why() {
        let _gpu = gpu();
        match CudaBackend::new(CudaOptions::new(0)) {
            Ok(b) => assert_eq!(b.info().name, "cuda"), // a machine with a GPU
            Err(e) => {
                let msg = e.to_string();
                assert!(
                    matches!(
                        e,
                        BackendError::Unavailable(_) | BackendError::Driver { .. }
                    ),
                    "{msg}"
                );
                assert!(!msg.is_empty());
            }
        }
    }

    #[test]
    fn the_queries_answer_for_memory_no_driver_knows() {
        // Pageable memory of this process: no driver knows it, where there is a driver at all.
        let local = [0u8; 64];
        let addr = local.as_ptr() as u64;
        assert_eq!(memory_kind(addr), None);
        if !driver_has("cuMemcpy") {
            assert_eq!(host_device_pointer(addr), Ok(None));
            let mut out = [0u8; 64];
            // SAFETY: two live local arrays of 64 bytes.
            let e = unsafe { memcpy(out.as_mut_ptr() as u64, addr, 64) }.unwrap_err();
            assert!(matches!(e, BackendError::Unavailable(_)), "{e}");
        }
    }

    #[test]
    #[ignore = "needs CUDA"]
    fn the_queries_name_pinned_and_device_memory_and_copy_between_them() {
        let _gpu = gpu();
        let backend = CudaBackend::new(CudaOptions::new(0)).expect("a backend");
        let ctx = backend.ctx.raw;
        let host = PinnedHost::alloc(ctx, 64).expect("pinned memory");
        let dev = DeviceMem::alloc(ctx, 64).expect("device memory");
        let mut local = [7u8; 64];
        let (pinned, pageable) = (host.as_ptr() as u64, local.as_mut_ptr() as u64);
        let _bound = bind(ctx).expect("bind");
        assert_eq!(memory_kind(pinned), Some(MemoryKind::Host));
        assert_eq!(memory_kind(dev.ptr), Some(MemoryKind::Device));
        assert_eq!(memory_kind(pageable), None);
        // Unified addressing: the device reaches mapped pinned memory at its host address.
        assert_eq!(host_device_pointer(pinned), Ok(Some(pinned)));
        let refused = host_device_pointer(pageable);
        assert!(
            matches!(
                refused,
                Err(BackendError::Driver {
                    call: "cuMemHostGetDevicePointer",
                    ..
                })
            ),
            "{refused:?}"
        );
        // SAFETY: 64 bytes in each of three live allocations, none overlapping; both copies
        // touch host memory, so each is done when it returns.
        unsafe {
            memcpy(dev.ptr, pageable, 64).expect("host to device");
            memcpy(pinned, dev.ptr, 64).expect("device to host");
        }
        // SAFETY: the 64 bytes of pinned memory the second copy wrote.
        let back = unsafe { std::slice::from_raw_parts(host.as_ptr(), 64) };
        assert_eq!(back, &[7u8; 64]);
    }
}
