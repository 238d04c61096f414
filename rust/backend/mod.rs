//! Backends: what actually moves bytes.
//!
//! A backend enqueues the copies of one transfer on an ordered lane (one per [`Direction`]) and
//! makes that lane's completed sequence number reach the transfer's sequence number once the
//! copies are done. The engine reads completed sequence numbers without locks; the backend decides
//! how they are produced (a worker thread's atomic store on the host backend, a stream writing into
//! mapped pinned memory on CUDA).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::direction::Direction;
use crate::kernel::{KernelBatch, KernelSpec, PageKernel};
use crate::plan::Plan;
use crate::region::MemoryKind;
use crate::slab::SlabRef;
use crate::table::StagedRequest;

pub use crate::slab::HostAlloc;

pub mod cuda;
pub mod host;

/// Adds the time from [`AddElapsed::start`] to its drop to a counter, on every way out: the
/// host-time statistics of the engine (`submit_ns`, `prepare_ns`) and of the CUDA backend
/// (`driver_ns`).
pub(crate) struct AddElapsed<'a>(&'a AtomicU64, Instant);

impl<'a> AddElapsed<'a> {
    pub(crate) fn start(counter: &'a AtomicU64) -> Self {
        AddElapsed(counter, Instant::now())
    }
}

impl Drop for AddElapsed<'_> {
    fn drop(&mut self) {
        // Relaxed: a statistic.
        self.0
            .fetch_add(self.1.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
}

/// A failure of the machinery below the engine: the driver, the worker, or an injected fault.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BackendError {
    /// The backend cannot run here (no driver, no device, a missing symbol), with the cause.
    Unavailable(String),
    /// A driver call failed.
    Driver {
        call: &'static str,
        code: i32,
        name: String,
    },
    /// A copy failed; `index` is the failing descriptor where the backend knows it.
    CopyFailed {
        index: Option<usize>,
        reason: String,
    },
    /// A fault injected on request (tests).
    Injected { index: usize },
    /// The memory cannot be used the way it was registered.
    BadMemory(String),
    /// Out of host memory for slabs or buffers.
    OutOfMemory { bytes: usize },
    /// The backend was shut down.
    ShutDown,
    /// The process forked after the backend was created; the CUDA context does not survive fork.
    Forked,
    /// An argument the backend cannot use (a legacy default stream for copies, say).
    InvalidArgument(String),
    /// Transfers the backend stopped waiting for (shutdown's deadline passed, or their lane
    /// failed): the device may still run them, so the memory they may reach is kept.
    StillInFlight { transfers: u64 },
}

impl fmt::Display for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BackendError::Unavailable(why) => write!(f, "backend unavailable: {why}"),
            BackendError::Driver { call, code, name } => {
                write!(f, "{call} failed: {name} ({code})")
            }
            BackendError::CopyFailed {
                index: Some(i),
                reason,
            } => {
                write!(f, "copy failed at descriptor {i}: {reason}")
            }
            BackendError::CopyFailed {
                index: None,
                reason,
            } => write!(f, "copy failed: {reason}"),
            BackendError::Injected { index } => write!(f, "injected failure at descriptor {index}"),
            BackendError::BadMemory(why) | BackendError::InvalidArgument(why) => f.write_str(why),
            BackendError::OutOfMemory { bytes } => {
                write!(f, "could not allocate {bytes} bytes of host memory")
            }
            BackendError::ShutDown => f.write_str("the backend is shut down"),
            BackendError::StillInFlight { transfers } => write!(
                f,
                "{transfers} transfers were still in flight when the backend stopped waiting for \
                 them; the memory they may reach stays allocated"
            ),
            BackendError::Forked => f.write_str(
                "this engine was created in another process: a CUDA context does not survive \
                 fork(); create a new engine in the child",
            ),
        }
    }
}

impl std::error::Error for BackendError {}

/// What a backend reports about itself (`blockswap.info()`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BackendInfo {
    pub name: &'static str,
    /// Driver version as the driver reports it (e.g. 13000), 0 on the host backend.
    pub driver_version: i32,
    pub device: Option<String>,
    /// The copy path in use: `memcpy`, `cuMemcpyBatchAsync (12.8 ABI)`, `... (13.0 ABI)`,
    /// `cuMemcpyAsync loop`.
    pub copy_path: String,
    /// How completion is signalled.
    pub completion: &'static str,
}

/// What the slab of a submission holds and how the backend issues it (see [`Plan`]):
/// `(src, dst, size)` descriptors, those `[0, batch.len)` to the copy kernel where one is given
/// and the rest to DMA; the 2-D copies of block plans, two entries each (see
/// [`crate::table::expand_runs_into`]); or a staged plan.
pub type Issue<'a> = Plan<Option<(KernelBatch, PageKernel<'a>)>, (), StagedRequest>;

/// What a submission asks of the backend besides the copies.
#[derive(Clone, Copy, Debug)]
pub struct SubmitRequest<'a> {
    /// A raw `CUstream` of the caller (`0` is the legacy default stream): the copies start only
    /// after the work issued on it so far.
    pub wait_stream: Option<u64>,
    /// What the slab holds.
    pub plan: Issue<'a>,
}

impl Default for SubmitRequest<'_> {
    /// Descriptors, all by DMA, after nothing.
    fn default() -> Self {
        SubmitRequest {
            wait_stream: None,
            plan: Plan::Pages(None),
        }
    }
}

/// How [`Backend::submit`] went.
#[derive(Debug, PartialEq, Eq)]
pub enum Submitted {
    /// Every copy and the completion marker are enqueued.
    Ok,
    /// The copies failed to enqueue (the slab records why) but the completion marker is enqueued:
    /// the transfer completes, as failed, in order.
    CopyFailed,
}

/// Moves bytes for the engine. Implementations are shared between threads.
pub trait Backend: Send + Sync + fmt::Debug {
    fn info(&self) -> BackendInfo;

    /// The most transfers one lane of this backend holds in flight, at least 1. The engine sizes
    /// its lanes by its `max_in_flight` setting clamped to this. The default, [`MAX_IN_FLIGHT`],
    /// is the most any setting may ask for
    /// ([`EngineConfig::validate`](crate::engine::EngineConfig::validate)), so a backend keeping
    /// it holds whatever an engine lets into flight.
    fn max_in_flight(&self) -> usize {
        MAX_IN_FLIGHT
    }

    /// The start of the driver allocation holding `addr`, where the backend knows allocations:
    /// one 2-D copy must stay inside one allocation (the CUDA driver refuses a pitched copy whose
    /// rows lie in different ones), so block plans keep a run of pages to one. `None`: no such
    /// bound (host memory under `memcpy`).
    fn allocation_base(&self, _addr: u64) -> Option<u64> {
        None
    }

    /// Makes `spec` launchable by this backend's staged plans; returns its id for
    /// [`StagedRequest::kernel`]. The host backend copies pages with memcpy and keeps no kernel.
    fn load_kernel(&self, _spec: KernelSpec) -> Result<Option<u32>, BackendError> {
        Ok(None)
    }

    /// Makes `lane`'s staging resources now rather than on its first staged transfer: its kernel
    /// stream and events, with `ring` the ring of two `slot_bytes` slots in device memory, and
    /// CPU -> GPU its two descriptor buffers. A fresh CUDA engine's first staged transfer each
    /// way made them and took 0.3-0.7 ms longer than the next (H200, 2026-11-30). What is made
    /// already stays; slots of another size are refused, as a transfer asking for them is. The
    /// host backend keeps nothing to make.
    fn prepare_staged(
        &self,
        _lane: Direction,
        _slot_bytes: u64,
        _ring: bool,
    ) -> Result<(), BackendError> {
        Ok(())
    }

    /// Checks that `[start, start + len)` is memory of `kind` this backend can copy from and to.
    /// Called once per registration, never per copy.
    fn check_region(&self, start: u64, len: u64, kind: MemoryKind) -> Result<(), BackendError>;

    /// Allocates host memory for descriptor slabs and buffers: page-locked, device-mapped and not
    /// write-combined on CUDA (the CPU reads results back from it).
    fn alloc_host(&self, bytes: usize) -> Result<HostAlloc, BackendError>;

    /// # Safety
    /// `alloc` came from [`Backend::alloc_host`] of this backend and nothing (host or device) will
    /// touch it again.
    unsafe fn free_host(&self, alloc: HostAlloc);

    /// Enqueues the copies described by `slab` on `lane`, then arranges for
    /// [`Backend::completed`]`(lane)` to reach `seq` once they are done. Sequence numbers of one
    /// lane are submitted in increasing order, one at a time (the engine holds its submit lock).
    ///
    /// The copies may be enqueued later, in order, by a thread of the backend's (the CUDA
    /// backend's issuing threads; the caller's stream is recorded here, at the call).
    ///
    /// `slab` stays valid and unmodified until `completed(lane) >= seq` has been observed, or
    /// [`Backend::lane_error`] has reported the lane failed. The backend records a failure and
    /// the GPU time in the slab before its completion is visible, and touches no slab of the
    /// lane once it reports the lane failed. An `Err` means nothing can be promised about `seq`
    /// (the engine fails the lane).
    /// `request` adds the ordering on a caller's stream and the kernel part of the transfer: the
    /// kernel moves descriptors `[0, kernel.len)`, DMA the rest, in one submission with one
    /// completion.
    fn submit(
        &self,
        lane: Direction,
        seq: u64,
        slab: SlabRef,
        request: SubmitRequest<'_>,
    ) -> Result<Submitted, BackendError>;

    /// A hint that a transfer on `lane` is about to be submitted: a backend whose issuing thread
    /// sleeps may wake it now, so that its wake-up overlaps the caller's preparing the transfer.
    /// Never blocks on copies and never fails.
    fn wake(&self, _lane: Direction) {}

    /// The highest sequence number of `lane` whose copies are done. Lock-free and never blocking:
    /// this is read by every poll.
    fn completed(&self, lane: Direction) -> u64;

    /// Blocks until `completed(lane) >= seq` or `timeout` passes (polling, yielding the core
    /// between polls, then sleeping once a wait grows long: the CUDA backend's `pause`). Returns
    /// whether the sequence number was reached.
    fn wait(
        &self,
        lane: Direction,
        seq: u64,
        timeout: Option<Duration>,
    ) -> Result<bool, BackendError>;

    /// A fatal, asynchronous error of `lane`, if the backend has seen one (a faulted stream, a
    /// dead context): every transfer not yet complete on that lane has failed.
    fn lane_error(&self, _lane: Direction) -> Option<BackendError> {
        None
    }

    /// Device time of transfer `seq` of `lane`, once complete, where the backend measures it.
    fn device_ns(&self, _lane: Direction, _seq: u64) -> Option<u64> {
        None
    }

    /// Nanoseconds spent inside the driver's copy calls so far (0 where there is no driver): lets
    /// a benchmark split submission time into the driver's share and blockswap's own.
    fn driver_ns(&self) -> u64 {
        0
    }

    /// Page-locks existing host memory so the device can reach it (`cuMemHostRegister`).
    ///
    /// # Safety
    /// The range must be allocated host memory that outlives the registration.
    unsafe fn pin_host(&self, _start: u64, _len: u64) -> Result<(), BackendError> {
        Ok(())
    }

    /// Undoes [`Backend::pin_host`].
    ///
    /// # Safety
    /// No transfer may be in flight on the range.
    unsafe fn unpin_host(&self, _start: u64) -> Result<(), BackendError> {
        Ok(())
    }

    /// A test hook: the next `count` transfers fail at a descriptor in the middle of their copy
    /// list (on CUDA, of their DMA part), the way a real fault would: the host backend stops its
    /// worker there; the CUDA backend hands the driver a null address there, which it refuses.
    /// The transfer must then complete as failed, in order, with its slab returned.
    fn inject_failures(&self, count: u64);

    /// Stops the backend once everything submitted is done, waiting no later than `deadline`
    /// (`None`: no bound). Past it, every transfer still in flight is reported failed through
    /// [`Backend::lane_error`], and no memory it may reach is freed or unpinned, then or later,
    /// while it may still run. Returns how many transfers were left in flight (0 when all
    /// finished). Idempotent.
    fn shutdown(&self, deadline: Option<Instant>) -> u64;
}

/// The most transfers in flight per direction an engine setting may ask for, whatever the
/// backend, and the default of [`Backend::max_in_flight`]: the host backend's one queue holds the
/// jobs of all four lanes.
pub const MAX_IN_FLIGHT: usize = host::QUEUE_DEPTH / 4;

/// `max_in_flight` as a backend keeping the default [`Backend::max_in_flight`] takes it: at
/// least 1, at most [`MAX_IN_FLIGHT`], as the engine clamps it for such a backend. A backend
/// sizing rings by it (the CUDA backend) holds every transfer the engine lets into flight, and no
/// more.
#[must_use]
pub fn clamp_in_flight(max_in_flight: usize) -> usize {
    max_in_flight.clamp(1, MAX_IN_FLIGHT)
}

/// Whether the backend named `name` is the CUDA one: `"cuda"`, or `"auto"` where a CUDA driver
/// can be loaded; `"host"` is the memcpy backend. Any other name is refused by name.
pub fn is_cuda(name: &str) -> Result<bool, String> {
    match name {
        "host" => Ok(false),
        "cuda" => Ok(true),
        "auto" => Ok(cuda::driver_available().is_ok()),
        other => Err(format!(
            "backend must be 'auto', 'host' or 'cuda', not {other:?}"
        )),
    }
}

/// The error of a lane whose issuing thread (`thread`) stopped with a panic (a defect of the
/// backend): the panic's message, so that the transfers it will never issue are reported failed
/// with it rather than waited for.
pub(crate) fn thread_stopped(thread: &str, panic: &(dyn std::any::Any + Send)) -> BackendError {
    let why = panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic with no message");
    BackendError::Unavailable(format!(
        "{thread} stopped ({why}); its transfers were not run: make a new engine"
    ))
}

/// Takes one injected failure from `counter`, if any is left.
pub(crate) fn take_injected(counter: &std::sync::atomic::AtomicU64) -> bool {
    use std::sync::atomic::Ordering;
    // Relaxed: a test hook counter, ordered by nothing else.
    counter
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backend_is_named_auto_host_or_cuda() {
        assert_eq!(is_cuda("host"), Ok(false));
        assert_eq!(is_cuda("cuda"), Ok(true));
        assert_eq!(is_cuda("auto"), Ok(cuda::driver_available().is_ok()));
        assert!(is_cuda("gpu").unwrap_err().contains("not \"gpu\""));
    }

    #[test]
    fn max_in_flight_is_clamped_in_one_place() {
        assert_eq!(clamp_in_flight(0), 1);
        assert_eq!(clamp_in_flight(7), 7);
        assert_eq!(clamp_in_flight(usize::MAX), MAX_IN_FLIGHT);
        assert_eq!(MAX_IN_FLIGHT, host::QUEUE_DEPTH / 4);
    }

    #[test]
    fn the_host_backend_holds_what_any_setting_may_ask_for() {
        assert_eq!(host::HostBackend::new().max_in_flight(), MAX_IN_FLIGHT);
    }
}
