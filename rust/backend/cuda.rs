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

use std::ffi::{c_void, CStr, CString};
use std::fmt;
use std::ptr;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use cudarc::driver::sys;

use super::{
    take_injected, AddElapsed, Backend, BackendError, BackendInfo, HostAlloc, KernelBatch,
    SubmitRequest, Submitted,
};
use crate::descriptor::Direction;
use crate::pool::{SlabInner, SlabRef};
use crate::region::MemoryKind;

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
];

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
    if code == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(BackendError::Driver {
            call,
            code: code as i32,
            name: error_name(code),
        })
    }
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

/// One direction's stream and completion state.
#[derive(Debug)]
struct CudaLane {
    stream: sys::CUstream,
    owns_stream: bool,
    /// Mapped pinned u64 the stream writes completed sequence numbers into (write-value mode).
    counter: *mut u64,
    counter_dev: sys::CUdeviceptr,
    /// Event ring, indexed by `seq % len`: completion (event mode).
    done_events: Vec<sys::CUevent>,
    /// Timing event pairs, indexed by `seq % len` (timing on).
    timing_events: Vec<(sys::CUevent, sys::CUevent)>,
    /// Recorded on the caller's stream and waited for by ours.
    dep_event: sys::CUevent,
    submitted: AtomicU64,
    /// Highest sequence number known complete (event mode).
    known: AtomicU64,
    error: OnceLock<BackendError>,
    /// Nanoseconds since `CudaBackend::epoch` of the last stream health check.
    last_check: AtomicU64,
}

/// Copies with the CUDA driver.
#[derive(Debug)]
pub struct CudaBackend {
    device: sys::CUdevice,
    ordinal: i32,
    ctx: sys::CUcontext,
    name: String,
    driver_version: i32,
    batch: Option<BatchFn>,
    opts: CudaOptions,
    write_value: bool,
    counters: *mut c_void,
    lanes: Vec<CudaLane>,
    epoch: Instant,
    /// Nanoseconds inside copy calls (cuMemcpyBatchAsync / cuMemcpyAsync), for profiling.
    driver_ns: AtomicU64,
    /// Transfers still to fail on purpose (`Backend::inject_failures`, a test hook).
    fail_next: AtomicU64,
    /// [`crate::engine::fork_generation`] when the backend was made: in a child forked since,
    /// its context and handles are the parent's and must not be touched.
    generation: u64,
}

// SAFETY: driver handles (context, streams, events) may be used from any thread once the context is
// made current there, which every entry point does first; `counter` is only read atomically on the
// host and written by the device.
unsafe impl Send for CudaBackend {}
// SAFETY: as above; mutation goes through atomics and OnceLocks, and submissions are serialised by
// the engine's submit lock.
unsafe impl Sync for CudaBackend {}

/// How long between stream health checks while transfers are outstanding.
const HEALTH_CHECK: Duration = Duration::from_millis(20);

impl CudaBackend {
    pub fn new(opts: CudaOptions) -> Result<Self, BackendError> {
        let driver_version = driver_available()?;
        let mut device = 0;
        // SAFETY: symbols checked by `driver_available`; cuDeviceGet writes one handle.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut device, opts.device)
        })?;
        let mut ctx = ptr::null_mut();
        // SAFETY: retains the device's primary context (the one torch uses); released in Drop.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, device)
        })?;
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
        for s in opts.streams.iter().flatten() {
            if *s <= 2 {
                return Err(BackendError::InvalidArgument(format!(
                    "stream {s:#x} is a legacy or per-thread default stream; copies need a created stream"
                )));
            }
        }
        let mut backend = CudaBackend {
            device,
            ordinal: opts.device,
            ctx,
            name,
            driver_version,
            batch,
            write_value: opts.completion != CompletionMode::Event,
            opts,
            counters: ptr::null_mut(),
            lanes: Vec::new(),
            epoch: Instant::now(),
            driver_ns: AtomicU64::new(0),
            fail_next: AtomicU64::new(0),
            generation: crate::engine::fork_generation(),
        };
        let ctx_guard = backend.make_current()?;
        backend.init_lanes()?;
        if backend.opts.completion == CompletionMode::Auto && !backend.probe_write_value() {
            backend.write_value = false;
        } else if backend.opts.completion == CompletionMode::WriteValue
            && !backend.probe_write_value()
        {
            return Err(BackendError::Unavailable(
                "this device or driver has no 64-bit stream memory operations (completion='write_value')".into(),
            ));
        }
        drop(ctx_guard);
        Ok(backend)
    }

    /// Makes this backend's context current on the calling thread until the guard drops, then
    /// puts back whatever was current before (the caller's device, as torch set it).
    fn make_current(&self) -> Result<CtxGuard, BackendError> {
        let mut prev = ptr::null_mut();
        // SAFETY: writes the calling thread's current context (possibly null).
        check("cuCtxGetCurrent", unsafe {
            sys::cuCtxGetCurrent(&mut prev)
        })?;
        if prev != self.ctx {
            // SAFETY: the context is retained for the life of the backend.
            check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.ctx) })?;
        }
        Ok(CtxGuard {
            prev: (prev != self.ctx).then_some(prev),
        })
    }

    fn init_lanes(&mut self) -> Result<(), BackendError> {
        // One cache line per lane's counter: the device writes them independently.
        let mut p = ptr::null_mut();
        // SAFETY: allocates 4 * 64 bytes of page-locked, device-mapped, cached (not write-combined:
        // the CPU reads these) host memory; freed in Drop.
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(
                &mut p,
                4 * 64,
                sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
            )
        })?;
        // SAFETY: 256 bytes just allocated.
        unsafe { ptr::write_bytes(p as *mut u8, 0, 4 * 64) };
        self.counters = p;
        let ring = 2 * self.opts.max_in_flight.max(1);
        for (i, dir) in Direction::ALL.into_iter().enumerate() {
            // SAFETY: inside the 256-byte allocation.
            let counter = unsafe { (p as *mut u8).add(i * 64) } as *mut u64;
            let mut counter_dev = 0;
            // SAFETY: `counter` lies in mapped pinned memory; the driver writes one device pointer.
            check("cuMemHostGetDevicePointer", unsafe {
                sys::cuMemHostGetDevicePointer_v2(&mut counter_dev, counter as *mut c_void, 0)
            })?;
            let (stream, owns_stream) = match self.opts.streams[dir.lane()] {
                Some(s) => (s as sys::CUstream, false),
                None => {
                    let mut s = ptr::null_mut();
                    // SAFETY: creates a non-blocking stream (never synchronises with the legacy
                    // default stream); destroyed in Drop.
                    check("cuStreamCreate", unsafe {
                        sys::cuStreamCreate(
                            &mut s,
                            sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                        )
                    })?;
                    (s, true)
                }
            };
            let mut lane = CudaLane {
                stream,
                owns_stream,
                counter,
                counter_dev,
                done_events: Vec::new(),
                timing_events: Vec::new(),
                dep_event: ptr::null_mut(),
                submitted: AtomicU64::new(0),
                known: AtomicU64::new(0),
                error: OnceLock::new(),
                last_check: AtomicU64::new(0),
            };
            lane.dep_event = new_event(false)?;
            if !self.write_value || self.opts.completion == CompletionMode::Auto {
                // Kept for the event fallback (and auto mode before the probe decides).
                lane.done_events = (0..ring)
                    .map(|_| new_event(false))
                    .collect::<Result<_, _>>()?;
            }
            if self.opts.timing {
                lane.timing_events = (0..ring)
                    .map(|_| Ok((new_event(true)?, new_event(true)?)))
                    .collect::<Result<_, BackendError>>()?;
            }
            self.lanes.push(lane);
        }
        Ok(())
    }

    /// Whether `cuStreamWriteValue64` works here: one write, then a synchronize.
    fn probe_write_value(&self) -> bool {
        let lane = &self.lanes[0];
        // SAFETY: the counter is mapped pinned memory owned by this backend; the stream is ours or
        // the caller's, valid for the backend's life.
        unsafe {
            sys::cuStreamWriteValue64_v2(lane.stream, lane.counter_dev, 0, 0)
                == sys::CUresult::CUDA_SUCCESS
                && sys::cuStreamSynchronize(lane.stream) == sys::CUresult::CUDA_SUCCESS
        }
    }

    fn lane(&self, d: Direction) -> &CudaLane {
        &self.lanes[d.lane()]
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
        let stream = self.lane(lane).stream;
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
        let stream = self.lane(lane).stream;
        let (src, dst, size) = (slab.src(), slab.dst(), slab.size());
        let ops = src.len() / crate::table::PITCHED_ENTRIES;
        // The injected fault: a null destination in the middle copy, which the driver refuses.
        let poison = take_injected(&self.fail_next).then_some(ops / 2);
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

    /// After a failed batch whose ABI does not say which descriptor failed: the first one whose
    /// source or destination the driver does not know.
    fn find_bad_descriptor(&self, src: &[u64], dst: &[u64]) -> Option<usize> {
        (0..src.len()).find(|&i| memory_type(src[i]).is_none() || memory_type(dst[i]).is_none())
    }

    fn signal(&self, lane: Direction, seq: u64) -> Result<(), BackendError> {
        let l = self.lane(lane);
        if self.write_value {
            // SAFETY: writes one u64 into our mapped pinned counter, after the preceding copies
            // (flags 0 keeps the memory barrier: the copied bytes are visible before the value).
            check("cuStreamWriteValue64", unsafe {
                sys::cuStreamWriteValue64_v2(l.stream, l.counter_dev, seq, 0)
            })
        } else {
            let ev = l.done_events[(seq as usize) % l.done_events.len()];
            // SAFETY: the event and stream are valid; re-recording a ring slot is safe because the
            // engine never has more than half the ring in flight.
            check("cuEventRecord", unsafe { sys::cuEventRecord(ev, l.stream) })
        }
    }

    fn check_stream(&self, lane: Direction) {
        let l = self.lane(lane);
        if l.error.get().is_some() {
            return;
        }
        // SAFETY: the stream is valid for the backend's life; cuStreamQuery never blocks.
        let r = unsafe { sys::cuStreamQuery(l.stream) };
        if r != sys::CUresult::CUDA_SUCCESS && r != sys::CUresult::CUDA_ERROR_NOT_READY {
            let _ = l.error.set(BackendError::Driver {
                call: "cuStreamQuery",
                code: r as i32,
                name: error_name(r),
            });
        }
    }
}

/// Restores the calling thread's previous context on drop (see `CudaBackend::make_current`).
#[must_use]
struct CtxGuard {
    prev: Option<sys::CUcontext>,
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        if let Some(prev) = self.prev {
            // SAFETY: `prev` was current on this thread a moment ago (or null, which unsets).
            // A failure leaves our context current, which is harmless; Drop must not panic.
            let _ = unsafe { sys::cuCtxSetCurrent(prev) };
        }
    }
}

fn new_event(timing: bool) -> Result<sys::CUevent, BackendError> {
    let flags = if timing {
        sys::CUevent_flags::CU_EVENT_DEFAULT as u32
    } else {
        sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
    };
    let mut ev = ptr::null_mut();
    // SAFETY: creates one event in the current context; destroyed in Drop.
    check("cuEventCreate", unsafe {
        sys::cuEventCreate(&mut ev, flags)
    })?;
    Ok(ev)
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
        let _ctx = self.make_current();
        // SAFETY: allocated by cuMemHostAlloc; the caller guarantees nothing touches it again.
        // Errors are ignored: freeing must not panic, and there is nothing left to do.
        let _ = unsafe { sys::cuMemFreeHost(alloc.as_ptr() as *mut c_void) };
    }

    unsafe fn pin_host(&self, start: u64, len: u64) -> Result<(), BackendError> {
        let _ctx = self.make_current()?;
        // SAFETY: the caller guarantees the range is allocated host memory outliving the pin.
        check("cuMemHostRegister", unsafe {
            sys::cuMemHostRegister_v2(
                start as *mut c_void,
                len as usize,
                sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP,
            )
        })
    }

    unsafe fn unpin_host(&self, start: u64) -> Result<(), BackendError> {
        let _ctx = self.make_current()?;
        // SAFETY: registered by pin_host; nothing in flight (the caller's guarantee).
        check("cuMemHostUnregister", unsafe {
            sys::cuMemHostUnregister(start as *mut c_void)
        })
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
        let wait_stream = request.wait_stream;
        // SAFETY: the engine keeps the slab in flight until completion of `seq` is observed.
        let slab = unsafe { slab.get() };
        let mut outcome = Ok(());
        if let Some(s) = wait_stream {
            // SAFETY: `s` is the caller's stream handle (0 is the legacy default stream, which
            // may be recorded on); a bad handle comes back as an error, failing this transfer only.
            outcome = check("cuEventRecord", unsafe {
                sys::cuEventRecord(l.dep_event, s as sys::CUstream)
            })
            .and_then(|_| {
                // SAFETY: both handles valid; our stream waits for the caller's work so far.
                check("cuStreamWaitEvent", unsafe {
                    sys::cuStreamWaitEvent(l.stream, l.dep_event, 0)
                })
            });
        }
        let timing = (!l.timing_events.is_empty())
            .then(|| l.timing_events[(seq as usize) % l.timing_events.len()]);
        if let (Ok(()), Some((start, _))) = (&outcome, timing) {
            // SAFETY: valid event and stream. A failed timing record only loses the timing.
            let _ = unsafe { sys::cuEventRecord(start, l.stream) };
        }
        // Copies are issued only when the ordering they depend on is in place.
        let mut first = 0;
        if let (Ok(()), Some((batch, launch))) = (&outcome, request.kernel) {
            // The small descriptors first, by the copy kernel on this lane's stream; it reads them
            // from the slab in place. Then DMA for the rest, then the completion marker: one
            // submission, one completion.
            first = batch.len;
            outcome = launch(KernelBatch {
                stream: l.stream as u64,
                ..batch
            })
            .map_err(|reason| BackendError::CopyFailed {
                index: None,
                reason: format!("copy kernel: {reason}"),
            });
        }
        if outcome.is_ok() && first < slab.len() {
            let _timed = AddElapsed::start(&self.driver_ns);
            outcome = if request.pitched {
                self.issue_pitched(lane, slab)
            } else {
                self.issue_copies(lane, slab, first)
            };
        }
        if let (Ok(()), Some((_, end))) = (&outcome, timing) {
            // SAFETY: as above.
            let _ = unsafe { sys::cuEventRecord(end, l.stream) };
        }
        if let Err(e) = &outcome {
            slab.set_failed(e.to_string());
        }
        // The completion marker goes in whatever happened to the copies, so the lane stays ordered.
        if let Err(e) = self.signal(lane, seq) {
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

    fn completed(&self, lane: Direction) -> u64 {
        let l = self.lane(lane);
        if self.write_value {
            // SAFETY: `counter` is 8-byte aligned mapped pinned memory that lives as long as the
            // backend; the device writes it with the stream's memory barrier before the value.
            // Acquire: the copies' bytes are read only after seeing their sequence number.
            return unsafe { AtomicU64::from_ptr(l.counter) }.load(Ordering::Acquire);
        }
        let submitted = l.submitted.load(Ordering::Acquire);
        let mut known = l.known.load(Ordering::Acquire);
        while known < submitted {
            let ev = l.done_events[((known + 1) as usize) % l.done_events.len()];
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
            if self.lane(lane).error.get().is_some() {
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
        if let Some(e) = l.error.get() {
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
        l.error.get().cloned()
    }

    fn driver_ns(&self) -> u64 {
        self.driver_ns.load(Ordering::Relaxed)
    }

    fn device_ns(&self, lane: Direction, seq: u64) -> Option<u64> {
        let l = self.lane(lane);
        if l.timing_events.is_empty() {
            return None;
        }
        let (start, end) = l.timing_events[(seq as usize) % l.timing_events.len()];
        let mut ms = 0f32;
        // SAFETY: both events were recorded for this (complete) transfer; the call never blocks.
        let r = unsafe { sys::cuEventElapsedTime_v2(&mut ms, start, end) };
        (r == sys::CUresult::CUDA_SUCCESS).then_some((ms as f64 * 1e6) as u64)
    }

    fn inject_failures(&self, count: u64) {
        self.fail_next.store(count, Ordering::Relaxed);
    }

    fn shutdown(&self) {
        let Ok(_ctx) = self.make_current() else {
            return;
        };
        for l in &self.lanes {
            // SAFETY: valid streams; waiting for our own work before teardown.
            let _ = unsafe { sys::cuStreamSynchronize(l.stream) };
        }
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Never panics: driver errors during teardown are ignored (there is no one left to tell).
        if crate::engine::fork_generation() != self.generation {
            return;
        }
        let Ok(_ctx) = self.make_current() else {
            return;
        };
        for l in &self.lanes {
            // SAFETY: each handle was created by this backend and is destroyed once; streams are
            // synchronised first so no queued work refers to the events or the counter.
            unsafe {
                let _ = sys::cuStreamSynchronize(l.stream);
                for &e in l.done_events.iter().chain([&l.dep_event]) {
                    let _ = sys::cuEventDestroy_v2(e);
                }
                for &(a, b) in &l.timing_events {
                    let _ = sys::cuEventDestroy_v2(a);
                    let _ = sys::cuEventDestroy_v2(b);
                }
                if l.owns_stream {
                    let _ = sys::cuStreamDestroy_v2(l.stream);
                }
            }
        }
        if !self.counters.is_null() {
            // SAFETY: allocated by cuMemHostAlloc in init_lanes; no stream writes it any more.
            let _ = unsafe { sys::cuMemFreeHost(self.counters) };
        }
        // SAFETY: retained in `new`.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
    }
}

// Miri cannot dlopen a driver (or probe for one).
#[cfg(all(test, not(miri)))]
mod tests {
    use super::*;

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
}
