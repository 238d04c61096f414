//! The driver resources, each freed by its own `Drop`: the primary context, streams, events,
//! device and pinned host memory, host registrations, and the guard a bound context is undone by;
//! and the safe calls on them, cudarc's way (its `result` layer keeps raw handles behind `unsafe`,
//! its types give the rest safe methods): [`StreamHandle`] (query, synchronize, wait for an
//! event, write a [`Counter`]), [`Event::record`], [`Event::query`], [`Event::elapsed_ms`] and
//! [`order`]. The lanes and the staged pipeline order their streams through these without
//! `unsafe`; what stays `unsafe` outside this file is where a caller's handle enters
//! ([`Stream::borrowed`], [`StreamHandle::caller`]) and the copies and launches, whose addresses
//! their callers vouch for.

use std::ffi::c_void;
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::result;
use cudarc::driver::sys;

use super::driver::{check, driver_available, driver_error, may_create, tally};
use crate::backend::BackendError;

/// Makes `ctx` current on the calling thread until the guard drops, then puts back whatever was
/// current before (the caller's device, as torch set it).
pub(super) fn bind(ctx: sys::CUcontext) -> Result<CtxGuard, BackendError> {
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
pub(super) struct PrimaryCtx {
    device: sys::CUdevice,
    pub(super) raw: sys::CUcontext,
}

impl PrimaryCtx {
    pub(super) fn retain(device: sys::CUdevice) -> Result<Self, BackendError> {
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
pub(super) struct Stream {
    pub(super) raw: sys::CUstream,
    pub(super) ctx: sys::CUcontext,
    pub(super) owned: bool,
}

impl Stream {
    /// A non-blocking stream of `ctx`: it never synchronises with the legacy default stream.
    pub(super) fn create(ctx: sys::CUcontext) -> Result<Self, BackendError> {
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
    ///
    /// # Safety
    /// `raw` must be a stream of `ctx` (or 0, the legacy default stream) that outlives this
    /// value: the caller's promise for a lane's stream (`h2d_stream=`, `d2h_stream=`).
    pub(super) unsafe fn borrowed(raw: u64, ctx: sys::CUcontext) -> Self {
        Stream {
            raw: raw as sys::CUstream,
            ctx,
            owned: false,
        }
    }

    /// A handle to the stream for the driver calls on it, valid as long as the stream.
    pub(super) fn handle(&self) -> StreamHandle {
        StreamHandle(self.raw)
    }
}

/// A stream the work goes on: a lane's or a stage's (which live as long as the backend and are
/// never replaced), or a caller's a transfer waits for ([`StreamHandle::caller`]). The stream and
/// event calls on it are safe: each takes handles only, and the driver answers a bad one with an
/// error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct StreamHandle(sys::CUstream);

impl StreamHandle {
    /// The caller's stream a transfer waits for (`wait_stream`).
    ///
    /// # Safety
    /// `raw` must be a stream of the current context, or 0 (the legacy default stream), that
    /// outlives the calls made with the handle.
    pub(super) unsafe fn caller(raw: u64) -> Self {
        StreamHandle(raw as sys::CUstream)
    }

    /// The raw handle, for the copies and launches whose addresses their callers vouch for.
    pub(super) fn raw(self) -> sys::CUstream {
        self.0
    }

    /// `cuStreamQuery`: `CUDA_SUCCESS` once the stream's work is done, `CUDA_ERROR_NOT_READY`
    /// before, or the stream's error. Never blocks.
    pub(super) fn query(self) -> sys::CUresult {
        // SAFETY: a stream handle (see the type's docs); cuStreamQuery reads nothing else.
        unsafe { sys::cuStreamQuery(self.0) }
    }

    /// `cuStreamSynchronize`: blocks until the stream's work is done.
    pub(super) fn synchronize(self) -> Result<(), BackendError> {
        // SAFETY: as in `query`.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.0)
        })
    }

    /// `cuStreamWaitEvent`: work queued on the stream from now on waits for `event`'s last
    /// record (at once where it was never recorded).
    pub(super) fn wait(self, event: &Event) -> Result<(), BackendError> {
        // SAFETY: a stream handle and a live event; the wait takes the event's state now.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(self.0, event.raw, 0)
        })
    }

    /// `cuStreamWriteValue64`: writes `value` into `counter` once the work queued before it is
    /// done, with the memory barrier (flags 0): the bytes copied before are visible first.
    pub(super) fn write_value(self, counter: &Counter, value: u64) -> Result<(), BackendError> {
        // SAFETY: `counter.dev` is the device address of mapped pinned memory the backend keeps
        // until its streams are done (see `Counter`); the driver writes 8 bytes there.
        check("cuStreamWriteValue64", unsafe {
            sys::cuStreamWriteValue64_v2(self.0, counter.dev, value, 0)
        })
    }
}

/// A u64 in mapped pinned memory that a stream writes and the host reads: a lane's completion
/// counter. Lives inside the backend's `PinnedHost`, which outlives every stream that writes it.
#[derive(Debug)]
pub(super) struct Counter {
    host: ptr::NonNull<u64>,
    dev: sys::CUdeviceptr,
}

impl Counter {
    /// Counter `i` of `counters` (64-byte slots), with its device address.
    pub(super) fn new(counters: &PinnedHost, i: usize) -> Result<Self, BackendError> {
        assert!(
            (i + 1) * 64 <= counters.len,
            "counter {i} past the allocation"
        );
        #[allow(clippy::cast_ptr_alignment)] // 64-byte slots of a page-aligned allocation
        // SAFETY: inside the allocation (checked above), 8-byte aligned.
        let host = unsafe { counters.ptr.add(i * 64) }.cast::<u64>();
        let mut dev = 0;
        // SAFETY: `host` lies in mapped pinned memory; the driver writes one device pointer.
        check("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&raw mut dev, host.as_ptr().cast::<c_void>(), 0)
        })?;
        Ok(Counter { host, dev })
    }

    /// The last value written, read with Acquire: what the stream copied before it is visible.
    pub(super) fn load(&self) -> u64 {
        // SAFETY: 8-byte aligned mapped pinned memory that lives as long as the backend (see the
        // type's docs); the device writes it only as a whole u64.
        unsafe { AtomicU64::from_ptr(self.host.as_ptr()) }.load(Ordering::Acquire)
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
pub(super) struct Event {
    pub(super) raw: sys::CUevent,
    ctx: sys::CUcontext,
}

impl Event {
    pub(super) fn create(ctx: sys::CUcontext, timing: bool) -> Result<Self, BackendError> {
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

    /// `cuEventRecord`: the event completes once the work queued on `stream` so far is done.
    /// Re-recording is safe once the waits on the previous record are queued: a wait takes the
    /// event's state at its call.
    pub(super) fn record(&self, stream: StreamHandle) -> Result<(), BackendError> {
        // SAFETY: a live event and a stream handle (see `StreamHandle`).
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.raw, stream.raw())
        })
    }

    /// `cuEventQuery`: `CUDA_SUCCESS` once the recorded work is done. Never blocks.
    pub(super) fn query(&self) -> sys::CUresult {
        // SAFETY: a live event.
        unsafe { sys::cuEventQuery(self.raw) }
    }

    /// Milliseconds from `self` to `end`, both recorded with timing and complete; `None`
    /// otherwise.
    pub(super) fn elapsed_ms(&self, end: &Event) -> Option<f32> {
        let mut ms = 0f32;
        // SAFETY: two live events; the driver writes one float.
        let r = unsafe { sys::cuEventElapsedTime_v2(&raw mut ms, self.raw, end.raw) };
        (r == sys::CUresult::CUDA_SUCCESS).then_some(ms)
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
pub(super) struct DeviceMem {
    pub(super) ptr: sys::CUdeviceptr,
    ctx: sys::CUcontext,
}

impl DeviceMem {
    pub(super) fn alloc(ctx: sys::CUcontext, len: usize) -> Result<Self, BackendError> {
        may_create("cuMemAlloc")?;
        let _bound = bind(ctx)?;
        let mut ptr = 0;
        // SAFETY: writes one device pointer.
        check("cuMemAlloc", unsafe {
            sys::cuMemAlloc_v2(&raw mut ptr, len)
        })?;
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

/// `cuEventRecord` then `cuStreamWaitEvent`: `waiter` goes on only after the work queued on
/// `on` so far.
pub(super) fn order(
    event: &Event,
    on: StreamHandle,
    waiter: StreamHandle,
) -> Result<(), BackendError> {
    event.record(on)?;
    waiter.wait(event)
}

/// Page-locked, device-mapped, cached host memory from `cuMemHostAlloc`, zeroed; freed on drop.
#[derive(Debug)]
pub(super) struct PinnedHost {
    ptr: ptr::NonNull<u8>,
    len: usize,
    ctx: sys::CUcontext,
}

impl PinnedHost {
    pub(super) fn alloc(ctx: sys::CUcontext, len: usize) -> Result<Self, BackendError> {
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
            ptr::NonNull::new(p.cast::<u8>()).ok_or(BackendError::OutOfMemory { bytes: len })?;
        // SAFETY: `len` bytes just allocated, not shared yet.
        unsafe { ptr::write_bytes(ptr.as_ptr(), 0, len) };
        tally(1);
        Ok(PinnedHost { ptr, len, ctx })
    }

    #[cfg(test)]
    pub(super) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        if let Ok(_bound) = bind(self.ctx) {
            // SAFETY: allocated by `alloc` and freed once, here; the owner drops it only once no
            // stream can write it. Errors are ignored: Drop must not panic.
            let _ = unsafe { result::free_host(self.ptr.as_ptr().cast::<c_void>()) };
        }
        tally(-1);
    }
}

/// Page-locks `[start, start + len)` for every context (portable) and maps it into the device
/// address space (device-mapped): how blockswap registers host memory. A context is current.
///
/// # Safety
/// The range must be mapped host memory that stays mapped until [`unregister_host`].
pub(super) unsafe fn register_host(start: u64, len: u64) -> Result<(), BackendError> {
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
pub(super) unsafe fn unregister_host(start: u64) -> Result<(), BackendError> {
    // SAFETY: registered by `register_host`; the caller guarantees nothing reaches it.
    check("cuMemHostUnregister", unsafe {
        sys::cuMemHostUnregister(start as *mut c_void)
    })
}

/// Page-locks the pieces of a large host buffer (`hostmem`'s) with the driver, in the primary
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
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&raw mut dev, device)
        })?;
        Ok(HostPinner {
            ctx: PrimaryCtx::retain(dev)?,
        })
    }
}

impl HostPinner {
    /// Page-locks `[start, start + len)` (`cuMemHostRegister`, portable).
    ///
    /// # Safety
    /// The range must be mapped host memory that stays mapped until [`HostPinner::unpin`].
    pub unsafe fn pin(&self, start: u64, len: u64) -> Result<(), BackendError> {
        let _bound = bind(self.ctx.raw)?;
        // SAFETY: the caller guarantees the range stays mapped until unpinned.
        unsafe { register_host(start, len) }
    }

    /// Undoes [`HostPinner::pin`] of the range starting at `start`.
    ///
    /// # Safety
    /// No copy may reach the range any more.
    pub unsafe fn unpin(&self, start: u64) -> Result<(), BackendError> {
        let _bound = bind(self.ctx.raw)?;
        // SAFETY: pinned by `pin`; the caller guarantees no copy reaches it.
        unsafe { unregister_host(start) }
    }
}

/// Restores the calling thread's previous context on drop (see [`bind`]).
#[must_use]
pub(super) struct CtxGuard {
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
