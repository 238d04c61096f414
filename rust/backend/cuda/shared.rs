//! [`Shared`]: the driver state a [`CudaBackend`](super::CudaBackend) shares with its issuing
//! threads (context, lanes, counters, resolved entry points), and its teardown.

use crate::sync::MutexExt;
use std::ffi::c_void;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Mutex;
use std::time::Instant;

use cudarc::driver::result;

use super::driver::{
    driver_available, driver_error, resolve, resolve_batch, resolve_batch3d, Batch3dFn, BatchFn,
    ParamInfoFn,
};
use super::lane::CudaLane;
use super::options::{CompletionMode, CopyPath, CudaOptions};
use super::resources::{bind, CtxGuard, Event, PinnedHost, PrimaryCtx};
use super::stage::LoadedKernel;
use crate::backend::{BackendError, HostAlloc};
use crate::direction::Direction;

/// The driver state of a [`CudaBackend`](super::CudaBackend), shared with its issuing threads.
///
/// Every driver resource is owned by a value that frees it on drop (the context reference, the
/// counters, each stream and event), so a construction that fails midway frees what it made.
/// The backend drops them by hand (see its `Drop`): in a forked child, or while a lane the
/// engine gave up on may still run, the memory the device may write is leaked, never freed.
#[derive(Debug)]
pub struct Shared {
    pub(super) ordinal: i32,
    pub(super) name: String,
    pub(super) driver_version: i32,
    pub(super) batch: Option<BatchFn>,
    /// The batched 3-D copy for block plans; `None`: one cuMemcpy2DAsync per copy.
    pub(super) batch3d: Option<Batch3dFn>,
    pub(super) opts: CudaOptions,
    pub(super) write_value: bool,
    pub(super) epoch: Instant,
    /// Nanoseconds inside copy calls (cuMemcpyBatchAsync / cuMemcpyAsync), for profiling.
    pub(super) driver_ns: AtomicU64,
    /// Transfers still to fail on purpose (`Backend::inject_failures`, a test hook).
    pub(super) fail_next: AtomicU64,
    /// [`crate::fork::fork_generation`] when the backend was made: in a child forked since,
    /// its context and handles are the parent's and must not be touched.
    pub(super) generation: u64,
    /// Set by `shutdown`: from then on host memory is freed only once every lane is idle.
    pub(super) shut: AtomicBool,
    /// Host memory handed back while a lane might still reach it: freed once every lane is idle,
    /// else leaked.
    pub(super) deferred: Mutex<Vec<HostAlloc>>,
    /// `cuFuncGetParamInfo`, where the driver has it: [`crate::backend::Backend::load_kernel`] needs it.
    pub(super) param_info: Option<ParamInfoFn>,
    /// Kernels loaded for staged plans, by id.
    pub(super) kernels: std::sync::RwLock<Vec<LoadedKernel>>,
    /// Set when the backend goes: the issuing threads end once their queues are empty.
    pub(super) stopping: AtomicBool,
    // The driver resources, dropped in this order in `Drop`.
    pub(super) lanes: ManuallyDrop<Vec<CudaLane>>,
    /// One cache line per lane's completion counter: the device writes them independently.
    pub(super) counters: ManuallyDrop<PinnedHost>,
    pub(super) ctx: ManuallyDrop<PrimaryCtx>,
}

// SAFETY: driver handles (context, streams, events) may be used from any thread once the context is
// made current there, which every entry point does first; `counter` is only read atomically on the
// host and written by the device.
unsafe impl Send for Shared {}
// SAFETY: as above; mutation goes through atomics, OnceLocks and Mutexes, and a lane's
// transfers are issued by one thread at a time (its issuing thread, or `submit` under the
// engine's submit lock once that thread has drained).
unsafe impl Sync for Shared {}

impl Shared {
    /// `opts.max_in_flight` is clamped as the engine clamps it for this backend, which keeps the
    /// default [`crate::backend::Backend::max_in_flight`] ([`crate::backend::clamp_in_flight`]): the event rings
    /// hold twice that.
    pub fn new(mut opts: CudaOptions) -> Result<Self, BackendError> {
        opts.max_in_flight = crate::backend::clamp_in_flight(opts.max_in_flight);
        // Arguments first, before any driver resource exists.
        for s in opts.streams.iter().flatten() {
            if *s <= 2 {
                return Err(BackendError::InvalidArgument(format!(
                    "stream {s:#x} is a legacy or per-thread default stream; copies need a created stream"
                )));
            }
        }
        let driver_version = driver_available()?;
        let device =
            result::device::get(opts.device).map_err(|e| driver_error("cuDeviceGet", e))?;
        // From here on every resource is owned by a local: an early return drops them in reverse
        // order (lanes, counters, the binding, the context).
        let ctx = PrimaryCtx::retain(device)?;
        let _bound = bind(ctx.raw)?;
        let name = result::device::get_name(device).unwrap_or_else(|_| String::from("unknown"));
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
    pub(super) fn make_current(&self) -> Result<CtxGuard, BackendError> {
        bind(self.ctx.raw)
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
                    let deferred = self.deferred.value_mut();
                    for a in deferred.drain(..) {
                        // SAFETY: from cuMemHostAlloc, handed back by its owner, and every lane
                        // is idle: nothing can reach it any more.
                        let _ = unsafe { result::free_host(a.as_ptr().cast::<c_void>()) };
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
                std::mem::forget(l.stage.value_mut().take());
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
