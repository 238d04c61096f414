//! The backend: [`CudaBackend`], the owner of the issuing threads, and its [`Backend`]
//! implementation.

use crate::sync::{MutexExt, RwLockExt};
use std::ffi::c_void;
use std::ptr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::result;
use cudarc::driver::sys;

use super::driver::{check, MAX_KERNEL_PARAMS};
use super::lane::Job;
use super::options::CudaOptions;
use super::query::{device_ordinal, memory_type, pointer_u64};
use super::resources::{register_host, unregister_host};
use super::shared::Shared;
use super::stage::LoadedKernel;
use crate::backend::{Backend, BackendError, BackendInfo, HostAlloc, SubmitRequest, Submitted};
use crate::direction::Direction;
use crate::kernel::KernelSpec;
use crate::plan::Plan;
use crate::region::MemoryKind;
use crate::slab::SlabRef;

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
    /// Per lane, its issuing thread: CPU -> GPU and GPU -> CPU started with the backend, any
    /// lane's on its first transfer where it is not running.
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
    ///
    /// The issuing threads of the two directions across `PCIe` start here: a lane's first
    /// transfer started its thread and held 76-191 µs longer than the next for the spawn and
    /// the thread's first driver calls (H200, 2026-11-30). A thread that cannot be started here
    /// is the first transfer's to start, or to report.
    pub fn new(opts: CudaOptions) -> Result<Self, BackendError> {
        let backend = CudaBackend {
            shared: Arc::new(Shared::new(opts)?),
            workers: Mutex::new([None, None, None, None]),
        };
        for lane in [Direction::HostToDevice, Direction::DeviceToHost] {
            let _ = backend.start_worker(lane);
        }
        Ok(backend)
    }

    /// Whether `lane`'s issuing thread has been started.
    #[cfg(test)]
    pub(super) fn worker_started(&self, lane: Direction) -> bool {
        self.workers.locked()[lane.lane()].is_some()
    }

    /// Starts `lane`'s issuing thread if it is not running.
    fn start_worker(&self, lane: Direction) -> Result<(), BackendError> {
        let mut w = self.workers.locked();
        if w[lane.lane()].is_some() {
            return Ok(());
        }
        let shared = Arc::clone(&self.shared);
        let handle = std::thread::Builder::new()
            .name(format!("blockswap-{}", lane.as_str()))
            .spawn(move || shared.work_or_fail(lane))
            .map_err(|e| BackendError::Unavailable(format!("cannot start a thread: {e}")))?;
        crate::affinity::bind_started(self.shared.opts.cpus.as_ref(), &handle);
        w[lane.lane()] = Some(handle);
        Ok(())
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        let workers = std::mem::take(self.workers.value_mut());
        if crate::fork::fork_generation() != self.generation {
            // A forked child has none of the parent's threads.
            std::mem::forget(workers);
            return;
        }
        self.stopping.store(true, Ordering::Release);
        for l in self.lanes.iter() {
            // Under the queue's lock: a worker between its check and its wait sees the flag.
            let _q = l.queue.locked();
            l.work.notify_all();
        }
        // Each thread issues what it was handed, then ends: an accepted transfer runs.
        for h in workers.into_iter().flatten() {
            let _ = h.join();
        }
    }
}

/// How long between stream health checks while transfers are outstanding.
const HEALTH_CHECK: Duration = Duration::from_millis(20);

/// How long a wait polls without sleeping.
const SPIN: Duration = Duration::from_millis(20);

/// The longest sleep between two polls of a long wait.
const MAX_SLEEP: Duration = Duration::from_micros(500);

/// Between two polls of a wait that has waited `waited` so far (and may wait `left` more).
/// For the first [`SPIN`] it polls again at once, handing the core to any other runnable thread
/// in between (as CUDA's own synchronize does where the host has cores to spare): a transfer is
/// seen done within about a microsecond of its marker. An interrupt-driven event wait returned
/// 17-138 µs after a polling loop, a thread sleeping between polls up to 370 µs (an H200 host,
/// `benches/probe_wake.py`): 1-5 % of a step's worth of transfers. Past [`SPIN`], it sleeps 1 %
/// of what it waited (at most [`MAX_SLEEP`]), which keeps a long wait's overshoot near 1 % and
/// its core mostly free.
fn pause(waited: Duration, left: Option<Duration>) {
    if waited < SPIN {
        std::thread::yield_now();
    } else {
        let nap = (waited / 100).min(MAX_SLEEP);
        std::thread::sleep(left.map_or(nap, |l| nap.min(l)));
    }
}

impl CudaBackend {
    /// Issues `job` on the caller's thread, after everything queued before it: a Python launcher
    /// runs here, and a caller that gave its own stream finds the copies on it when this returns.
    fn issue_on_caller(&self, lane: Direction, job: Job<'_>) -> Result<Submitted, BackendError> {
        // Release: pairs with Acquire loads in `lane_idle` and `left_on`.
        self.lane(lane).accepted.store(job.seq, Ordering::Release);
        self.wait_drained(lane);
        self.issue_job(lane, job)
    }
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
            if unsafe { info(f, sizes.len(), &raw mut offset, &raw mut size) }
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
                &raw mut most,
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
        let mut kernels = self.kernels.write_locked();
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
        let r = unsafe { sys::cuMemGetAddressRange_v2(&raw mut base, &raw mut size, addr) };
        (r == sys::CUresult::CUDA_SUCCESS).then_some(base)
    }

    fn prepare_staged(
        &self,
        lane: Direction,
        slot_bytes: u64,
        ring: bool,
    ) -> Result<(), BackendError> {
        let _ctx = self.make_current()?;
        self.shared.prepare_stage(lane, slot_bytes, ring)
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
                &raw mut p,
                bytes.max(1),
                sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
            )
        })?;
        let p = ptr::NonNull::new(p.cast::<u8>()).ok_or(BackendError::OutOfMemory { bytes })?;
        // SAFETY: `p` owns `bytes` bytes until free_host.
        Ok(unsafe { HostAlloc::from_raw(p, bytes.max(1)) })
    }

    unsafe fn free_host(&self, alloc: HostAlloc) {
        let Ok(_ctx) = self.make_current() else {
            // Nothing can be checked or freed without the context: leaked.
            return;
        };
        let mut deferred = self.deferred.locked();
        if !self.may_free() {
            // A lane the engine gave up on may still reach it: freed once every lane is idle.
            deferred.push(alloc);
            return;
        }
        for a in deferred.drain(..).chain([alloc]) {
            // SAFETY: allocated by cuMemHostAlloc; the caller guarantees nothing touches it again
            // and, for memory deferred, every lane is idle now. Errors are ignored: freeing must
            // not panic, and there is nothing left to do.
            let _ = unsafe { result::free_host(a.as_ptr().cast::<c_void>()) };
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
        let l = self.lane(lane);
        // An `Err` fails the lane (the engine reports its transfers failed and takes no more):
        // recorded here too, so that its issuing thread issues nothing more from slabs that are
        // no longer promised to it.
        let fail = |e: BackendError| {
            let _ = l.error.set(e.clone());
            e
        };
        let _ctx = self.make_current().map_err(fail)?;
        // The caller's stream as it is now: recorded here, waited for when the job is issued
        // (nothing to wait for where its work is all done).
        let (dep, failed) = match request.wait_stream {
            None => (None, None),
            Some(s) => match self.record_dep(lane, s) {
                Ok(ev) => (ev, None),
                Err(e) => (None, Some(e)),
            },
        };
        let job = Job {
            seq,
            slab,
            plan: request.plan,
            dep,
            failed,
            progress: None,
        };
        let mut job = match job.into_owned() {
            Ok(job) if l.stream.owned => job,
            // A Python launcher, or a stream the caller gave.
            other => return self.issue_on_caller(lane, other.unwrap_or_else(|job| job)),
        };
        // The lane's thread holds no job (Acquire: pairs with the Release decrement in `work`),
        // and no other submit can queue one before this returns (the engine's submit lock): the
        // copies issued from here go in in order.
        if self.opts.idle_issue && l.pending.load(Ordering::Acquire) == 0 {
            if matches!(job.plan, Plan::Staged(_)) {
                // A staged transfer's start and first step: its copies start without the
                // thread's wake-up in the way, which these driver calls and the first step's
                // copy hide (the thread is woken first); the thread issues the rest.
                self.start_worker(lane).map_err(fail)?;
                self.nudge(lane);
                l.accepted.store(seq, Ordering::Release);
                let mut progress = self.job_head(lane, &job);
                self.job_steps(lane, &job, &mut progress, 1);
                job.progress = Some(progress);
            } else if !self.earlier_running(lane, seq) {
                // Every earlier transfer complete: the whole transfer here. Transfers that
                // follow busy ones still go to the thread, and their callers pay no driver call.
                l.accepted.store(seq, Ordering::Release);
                return self.issue_job(lane, job);
            }
        }
        self.start_worker(lane).map_err(fail)?;
        let mut q = l.queue.locked();
        if let Some(e) = l.error.get() {
            // Set under this lock by a thread that stopped (see `work_or_fail`): nothing would
            // take the job. A thread that lives drains a failed lane's jobs without issuing
            // them; refused here, the transfer fails the same way.
            return Err(e.clone());
        }
        // Release: as above.
        l.accepted.store(seq, Ordering::Release);
        l.pending.fetch_add(1, Ordering::AcqRel);
        q.push_back(job);
        // Relaxed: written under the queue's lock, held here. A thread not asleep on `work` (busy
        // issuing, polling after a wake, or between two jobs) takes the lock and looks at the
        // queue before it next waits, so only a sleeping one needs the notification, and its
        // futex call is left out of every other submission.
        let asleep = l.asleep.load(Ordering::Relaxed);
        drop(q);
        if asleep {
            l.work.notify_one();
        }
        Ok(Submitted::Ok)
    }

    fn wake(&self, lane: Direction) {
        if self.opts.early_wake {
            self.wake_ahead(lane);
        }
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
        let start = Instant::now();
        let deadline = timeout.map(|t| start + t);
        let mut last_check = start;
        loop {
            if self.completed(lane) >= seq {
                return Ok(true);
            }
            let now = Instant::now();
            if now.duration_since(last_check) >= HEALTH_CHECK {
                let _ctx = self.make_current()?;
                self.check_stream(lane);
                last_check = now;
            }
            if self.failed(lane).is_some() {
                return Ok(false);
            }
            if deadline.is_some_and(|d| now >= d) {
                return Ok(false);
            }
            pause(now.duration_since(start), deadline.map(|d| d - now));
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
        // Both events were recorded for this (complete) transfer; the call never blocks.
        let (start, end) = self.timing(lane, seq)?;
        start.elapsed_ms(end).map(|ms| (f64::from(ms) * 1e6) as u64)
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
        // Waits as `wait` does and never inside the driver (a stream synchronize has no bound),
        // for every lane that can still finish: a failed lane never does.
        let start = Instant::now();
        let mut last_check = start;
        loop {
            let running: Vec<Direction> = Direction::ALL
                .into_iter()
                .filter(|&d| self.failed(d).is_none() && !self.lane_idle(d))
                .collect();
            if running.is_empty() {
                break;
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                break;
            }
            if now.duration_since(last_check) >= HEALTH_CHECK {
                for &d in &running {
                    self.check_stream(d);
                }
                last_check = now;
            }
            pause(now.duration_since(start), deadline.map(|d| d - now));
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
