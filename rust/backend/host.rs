//! The host backend: `memcpy` on a worker thread.
//!
//! It runs the whole engine on machines without a GPU (CI, development, host-to-host moves) and
//! exercises the asynchronous contract for real: `submit` returns before the bytes move, a worker
//! thread copies in lane order and publishes each lane's completed sequence number with a Release
//! store, and pollers read it with Acquire. Failures can be injected for tests.

use crate::sync::{CondvarExt, MutexExt};
use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use super::{
    take_injected, thread_stopped, Backend, BackendError, BackendInfo, HostAlloc, KernelBatch,
    PageKernel, StagedRequest, SubmitRequest, Submitted,
};
use crate::affinity::Cpus;
use crate::direction::Direction;
use crate::plan::Plan;
use crate::region::MemoryKind;
use crate::slab::SlabRef;
use crate::table::staged_pages;

/// Alignment of host allocations: a page, like page-locked allocations on CUDA.
const HOST_ALIGN: usize = 4096;
/// The most jobs the worker's queue is ever handed: four lanes of [`Backend::max_in_flight`]
/// each. The queue itself grows as jobs come (an unbounded channel), so a backend costs no
/// memory for the jobs it may never get.
pub const QUEUE_DEPTH: usize = 1 << 16;

struct Job {
    lane: Direction,
    seq: u64,
    slab: SlabRef,
    /// Descriptors before this index were moved by a kernel already.
    first: usize,
    /// What the slab holds (see [`SubmitRequest::plan`]); a page kernel ran at submission.
    plan: Plan<(), (), StagedRequest>,
}

#[derive(Debug, Default)]
struct Shared {
    completed: [AtomicU64; 4],
    /// Threads inside `wait`; the worker only takes the lock to notify when this is non-zero.
    waiters: AtomicUsize,
    lock: Mutex<()>,
    cond: Condvar,
    /// Transfers still to fail on purpose, and at which descriptor.
    fail_next: AtomicU64,
    /// The worker panics at its next job, on purpose (tests).
    panic_next: AtomicBool,
    /// Set where the worker stopped with a panic: nothing left will be copied.
    stopped: OnceLock<BackendError>,
}

impl Shared {
    /// The worker stopped with `panic`: every lane fails with its message, and waiters wake.
    fn worker_stopped(&self, panic: &(dyn std::any::Any + Send)) {
        let _ = self
            .stopped
            .set(thread_stopped("the host backend's worker", panic));
        let _guard = self.lock.locked();
        self.cond.notify_all();
    }
}

/// Copies with `memcpy` on one worker thread.
#[derive(Debug)]
pub struct HostBackend {
    shared: std::sync::Arc<Shared>,
    sender: Mutex<Option<Sender<Job>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
    /// [`crate::fork::fork_generation`] when the worker was started.
    generation: u64,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Job({} #{})", self.lane, self.seq)
    }
}

impl Default for HostBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl HostBackend {
    /// The worker panics at its next job, as a defect would (tests): its transfers, and every
    /// later one, are then reported failed with the panic's message.
    #[doc(hidden)]
    pub fn inject_worker_panic(&self) {
        // Relaxed: a test hook, read by the worker at its next job.
        self.shared.panic_next.store(true, Ordering::Relaxed);
    }

    #[must_use]
    pub fn new() -> Self {
        Self::with_cpus(None)
    }

    /// A host backend whose worker thread runs on `cpus` only (see [`crate::affinity`]).
    #[must_use]
    pub fn with_cpus(cpus: Option<Cpus>) -> Self {
        let shared = std::sync::Arc::new(Shared::default());
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let worker_shared = shared.clone();
        let worker = std::thread::Builder::new()
            .name("blockswap-host".into())
            .spawn(move || {
                let work = std::panic::AssertUnwindSafe(|| worker_loop(&rx, &worker_shared));
                // A panic (a defect) would otherwise leave every waiter waiting for copies no
                // thread makes. What it unwinds holds nothing a later call reads: the jobs'
                // slabs stay the engine's, parked until a completion that never comes. The
                // queue goes only after the lanes say why (a submission that finds it gone
                // names the panic, not a shutdown).
                if let Err(panic) = std::panic::catch_unwind(work) {
                    worker_shared.worker_stopped(&*panic);
                }
                drop(rx);
            })
            .expect("spawning the host backend worker");
        crate::affinity::bind_started(cpus.as_ref(), &worker);
        HostBackend {
            shared,
            sender: Mutex::new(Some(tx)),
            worker: Mutex::new(Some(worker)),
            generation: crate::fork::fork_generation(),
        }
    }
}

/// How long the worker keeps polling its queue after a job before it sleeps. A sleeping worker
/// costs each submit a futex wake (~5-10 us measured on the development machine: the
/// `engine submit/ascending dst/16` bench went from 10.7 us to below 1 us with this spin);
/// a short spin keeps back-to-back transfers off that path.
const SPIN: Duration = Duration::from_micros(50);

/// The next job, and whether it was already queued when the worker looked: it followed the
/// job before it back to back, the host's counterpart of a transfer the CUDA backend issues
/// while an earlier one of its lane still runs (a staged one then takes its steps without ramps,
/// and the host backend takes the same steps).
fn next_job(rx: &Receiver<Job>) -> Option<(Job, bool)> {
    let start = Instant::now();
    let mut waiting = false;
    loop {
        match rx.try_recv() {
            Ok(job) => return Some((job, !waiting)),
            Err(crossbeam_channel::TryRecvError::Disconnected) => return None,
            Err(crossbeam_channel::TryRecvError::Empty) if start.elapsed() < SPIN => {
                waiting = true;
                std::hint::spin_loop();
            }
            Err(crossbeam_channel::TryRecvError::Empty) => {
                return rx.recv().ok().map(|j| (j, false))
            }
        }
    }
}

/// Runs a staged plan (see [`StagedRequest`]) with memcpy through `ring`, one slot: per step,
/// CPU -> GPU the rows into the slot, then the pages out of it; GPU -> CPU the reverse. The
/// same steps and offsets as the CUDA backend, so the plan's layout is exercised without a GPU.
/// A direct plan has no rows: its pages' ring side is their host address. Stops at step
/// `fail_at` (an injected failure), reporting it. `behind`: the job followed another back to
/// back (see [`next_job`]).
///
/// # Safety
/// The slab's rows and pages lie in registered memory (checked at submission), destinations
/// pairwise disjoint, and nothing else writes them while this runs.
unsafe fn run_staged(
    slab: &crate::slab::SlabInner,
    req: StagedRequest,
    host_src: bool,
    ring: &mut Vec<u8>,
    injected: bool,
    behind: bool,
) {
    let (src, dst, size) = (slab.src(), slab.dst(), slab.size());
    let (r, first) = (req.rows, req.first_block);
    let (row_addr, row_ring, row_bytes) = (&src[..r], &dst[..r], &size[..r]);
    let steps = req.steps(src, dst, size, behind);
    let fail_at = injected.then_some(steps.len() / 2);
    if !req.direct && ring.len() < req.slot_bytes as usize {
        // The slot is the engine's option (`stage_bytes`), which memory may not hold: the
        // transfer fails, where `vec!` would abort the process.
        let Some(slot) = zeroed(req.slot_bytes as usize) else {
            let bytes = req.slot_bytes as usize;
            slab.set_failed(BackendError::OutOfMemory { bytes }.to_string());
            return;
        };
        *ring = slot;
    }
    let base = ring.as_mut_ptr() as u64;
    for (k, step) in steps.iter().enumerate() {
        if Some(k) == fail_at {
            let index = step.rows.start;
            slab.set_failed(BackendError::Injected { index }.to_string());
            return;
        }
        // The slot's address minus the step's first ring offset: offsets become addresses
        // (a direct plan's are addresses already).
        let shift = if req.direct {
            0
        } else {
            base.wrapping_sub(step.ring_start)
        };
        let rows = || {
            step.rows.clone().map(|i| {
                let at = row_ring[i].wrapping_add(shift);
                let (s, d) = if host_src {
                    (row_addr[i], at)
                } else {
                    (at, row_addr[i])
                };
                (s, d, row_bytes[i])
            })
        };
        // Each page's addresses from its block entry and geometry, as the CUDA backend's
        // kernel computes them.
        let pages = || {
            let blocks = (first + step.blocks.start)..(first + step.blocks.end);
            blocks.flat_map(|i| {
                staged_pages(src, dst, size, i).map(|(ring, gpu, n)| {
                    let ring = ring.wrapping_add(shift);
                    if host_src {
                        (ring, gpu, n)
                    } else {
                        (gpu, ring, n)
                    }
                })
            })
        };
        let copy = |(s, d, n): (u64, u64, u64)| {
            // SAFETY: host rows and GPU pages are registered memory (the caller's contract); ring
            // addresses lie in the slot, whose rows fit it (`staged_steps` cuts at the slot), or
            // in a direct plan are the host table's pages, registered memory as well.
            unsafe { std::ptr::copy(s as *const u8, d as *mut u8, n as usize) }
        };
        if host_src {
            rows().for_each(copy);
            pages().for_each(copy);
        } else {
            pages().for_each(copy);
            rows().for_each(copy);
        }
    }
}

/// `bytes` zeroed bytes, or None where they cannot be allocated. Zeroed by the allocator, not by
/// `resize`, which writes a byte at a time in an unoptimised build (minutes of a Miri run for a
/// 16 MiB slot).
fn zeroed(bytes: usize) -> Option<Vec<u8>> {
    if bytes == 0 {
        return Some(Vec::new());
    }
    let layout = Layout::array::<u8>(bytes).ok()?;
    // SAFETY: the layout's size is not zero.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return None;
    }
    let slice = std::ptr::slice_from_raw_parts_mut(ptr, bytes);
    // SAFETY: `ptr` was allocated by the global allocator with the layout of `[u8; bytes]`, and
    // every byte is initialised (zero): a boxed slice, which now owns it.
    Some(unsafe { Box::from_raw(slice) }.into_vec())
}

fn worker_loop(rx: &Receiver<Job>, shared: &Shared) {
    let mut ring = Vec::new();
    let mut after_one = false;
    while let Some((job, queued)) = next_job(rx) {
        let behind = std::mem::replace(&mut after_one, true) && queued;
        // Relaxed: a test hook.
        assert!(
            !shared.panic_next.swap(false, Ordering::Relaxed),
            "a panic injected into the host backend's worker"
        );
        // SAFETY: the engine keeps the slab in flight until it observes `completed >= job.seq`,
        // which only happens after the store below.
        let slab = unsafe { job.slab.get() };
        let start = Instant::now();
        let (src, dst, size) = (slab.src(), slab.dst(), slab.size());
        // A kernel that failed already leaves nothing for the worker to do.
        let first = if slab.failure().is_some() {
            src.len()
        } else {
            job.first
        };
        let injected = take_injected(&shared.fail_next);
        match job.plan {
            _ if first >= src.len() => {
                // Nothing left to copy (the kernel moved every descriptor, or failed): an
                // injected failure still fails the transfer, as it would midway.
                if injected && slab.failure().is_none() {
                    slab.set_failed(BackendError::Injected { index: first }.to_string());
                }
            }
            Plan::Staged(req) => {
                let host_src = job.lane == Direction::HostToDevice;
                // SAFETY: the slab was checked at submission (see `run_staged`); this worker is the
                // only writer of its transfers' destinations.
                unsafe { run_staged(slab, req, host_src, &mut ring, injected, behind) };
            }
            Plan::Runs(()) => {
                let ops = src.len() / crate::table::PITCHED_ENTRIES;
                let fail_at = injected.then_some(ops / 2);
                let mut failed = false;
                crate::table::for_each_row(src, dst, size, |op, s, d, n| {
                    if failed || Some(op) == fail_at {
                        if !failed {
                            slab.set_failed(BackendError::Injected { index: op }.to_string());
                        }
                        failed = true;
                        return;
                    }
                    // SAFETY: every row is a page of a registered block table (checked at
                    // registration, ids checked at submission), destinations pairwise disjoint.
                    unsafe { std::ptr::copy(s as *const u8, d as *mut u8, n as usize) };
                });
            }
            Plan::Pages(()) => {
                let fail_at = injected.then_some(first + (src.len() - first) / 2);
                for i in first..src.len() {
                    if Some(i) == fail_at {
                        slab.set_failed(BackendError::Injected { index: i }.to_string());
                        break;
                    }
                    // SAFETY: the engine checked before submission that every range lies inside
                    // memory registered for this direction, and that destinations are pairwise
                    // disjoint. `copy` (memmove) stays correct even if a source overlaps its own
                    // destination.
                    unsafe {
                        std::ptr::copy(src[i] as *const u8, dst[i] as *mut u8, size[i] as usize);
                    }
                }
            }
        }
        slab.set_device_ns(start.elapsed().as_nanos() as u64);
        // Release: the copied bytes, the slab's status and time are visible to whoever reads this
        // value with Acquire (pollers, waiters).
        shared.completed[job.lane.lane()].store(job.seq, Ordering::Release);
        // SeqCst pairs with the waiter's SeqCst increment: either it sees our store, or we see it.
        std::sync::atomic::fence(Ordering::SeqCst);
        if shared.waiters.load(Ordering::SeqCst) > 0 {
            let _guard = shared.lock.locked();
            shared.cond.notify_all();
        }
    }
}

impl Backend for HostBackend {
    /// A quarter of the worker queue: the four lanes full never hold more jobs than it has room
    /// for.
    fn max_in_flight(&self) -> usize {
        QUEUE_DEPTH / 4
    }

    /// The next `count` transfers fail halfway: the first half of their descriptors is copied,
    /// then the transfer is reported failed.
    fn inject_failures(&self, count: u64) {
        self.shared.fail_next.store(count, Ordering::Relaxed);
    }

    fn lane_error(&self, _lane: Direction) -> Option<BackendError> {
        self.shared.stopped.get().cloned()
    }

    fn info(&self) -> BackendInfo {
        BackendInfo {
            name: "host",
            driver_version: 0,
            device: None,
            copy_path: "memcpy on a worker thread".into(),
            completion: "atomic sequence number",
        }
    }

    fn check_region(&self, _start: u64, _len: u64, _kind: MemoryKind) -> Result<(), BackendError> {
        // Host memory stands in for both kinds; the caller vouches for the range when registering.
        Ok(())
    }

    fn alloc_host(&self, bytes: usize) -> Result<HostAlloc, BackendError> {
        let layout = Layout::from_size_align(bytes.max(1), HOST_ALIGN)
            .map_err(|_| BackendError::OutOfMemory { bytes })?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        let ptr = NonNull::new(ptr).ok_or(BackendError::OutOfMemory { bytes })?;
        // SAFETY: `ptr` owns `layout.size()` bytes until `free_host`.
        Ok(unsafe { HostAlloc::from_raw(ptr, layout.size()) })
    }

    unsafe fn free_host(&self, alloc: HostAlloc) {
        let layout =
            Layout::from_size_align(alloc.len(), HOST_ALIGN).expect("layout of an allocation");
        // SAFETY: allocated by `alloc_host` with this layout; the caller guarantees no further use.
        unsafe { std::alloc::dealloc(alloc.as_ptr(), layout) };
    }

    fn submit(
        &self,
        lane: Direction,
        seq: u64,
        slab: SlabRef,
        request: SubmitRequest<'_>,
    ) -> Result<Submitted, BackendError> {
        if let Some(e) = self.shared.stopped.get() {
            return Err(e.clone());
        }
        // There is no device stream to wait for: host work is already done when submit is called.
        let first = match request.plan {
            Plan::Pages(Some((batch, PageKernel::Launcher(launch)))) => {
                // The kernel runs here, synchronously (Triton's interpreter on host memory), once
                // the lane's earlier transfers are done, so the lane stays ordered. The worker
                // then copies the rest and publishes completion as usual.
                self.wait(lane, seq - 1, None)?;
                if let Err(reason) = launch(KernelBatch { stream: 0, ..batch }) {
                    // SAFETY: the engine keeps the slab in flight until completion of `seq`.
                    unsafe { slab.get() }.set_failed(format!("copy kernel: {reason}"));
                }
                batch.len
            }
            // This backend loads no kernel (`load_kernel` gives None): the worker copies those
            // descriptors with the rest.
            Plan::Pages(Some((_, PageKernel::Loaded { .. })) | None)
            | Plan::Runs(())
            | Plan::Staged(_) => 0,
        };
        let sender = self.sender.locked();
        let tx = sender.as_ref().ok_or(BackendError::ShutDown)?;
        // An unbounded channel never blocks a send; it fails only once the worker is gone.
        tx.send(Job {
            lane,
            seq,
            slab,
            first,
            plan: request.plan.map(|_| (), |()| (), |s| s),
        })
        .map_err(|_| {
            // The worker is gone: stopped by a panic (which it records first), or shut down.
            self.shared
                .stopped
                .get()
                .cloned()
                .unwrap_or(BackendError::ShutDown)
        })?;
        Ok(Submitted::Ok)
    }

    fn completed(&self, lane: Direction) -> u64 {
        // Acquire: pairs with the worker's Release store; the copies up to this number are visible.
        self.shared.completed[lane.lane()].load(Ordering::Acquire)
    }

    fn wait(
        &self,
        lane: Direction,
        seq: u64,
        timeout: Option<Duration>,
    ) -> Result<bool, BackendError> {
        if self.completed(lane) >= seq {
            return Ok(true);
        }
        let deadline = timeout.map(|t| Instant::now() + t);
        self.shared.waiters.fetch_add(1, Ordering::SeqCst);
        let mut guard = self.shared.lock.locked();
        let reached = loop {
            if self.shared.completed[lane.lane()].load(Ordering::SeqCst) >= seq {
                break true;
            }
            if self.shared.stopped.get().is_some() {
                break false; // nothing will complete: the lane's error says why
            }
            // Bounded sleeps: a safety net, not a spin; the worker notifies on every completion.
            let mut step = Duration::from_millis(50);
            if let Some(d) = deadline {
                let now = Instant::now();
                if now >= d {
                    break false;
                }
                step = step.min(d - now);
            }
            guard = self.shared.cond.wait_timeout_locked(guard, step);
        };
        drop(guard);
        self.shared.waiters.fetch_sub(1, Ordering::SeqCst);
        Ok(reached)
    }

    /// The worker finishes what is queued, whatever the deadline: it copies with the CPU, and
    /// memory it may still copy cannot be handed back before it has. So nothing is left (0).
    fn shutdown(&self, _deadline: Option<Instant>) -> u64 {
        // Dropping the sender lets the worker finish what is queued, then exit.
        self.sender.locked().take();
        if let Some(worker) = self.worker.locked().take() {
            if crate::fork::fork_generation() == self.generation {
                let _ = worker.join();
            } else {
                // A forked child's copy of the handle: the thread exists only in the parent, and
                // joining (or detaching) it here fails.
                std::mem::forget(worker);
            }
        }
        0
    }
}

impl Drop for HostBackend {
    fn drop(&mut self) {
        self.shutdown(None);
    }
}
