//! A lane's work on the shared state: its issuing thread's loop, a job's copies and completion
//! marker, the completion queries and the stream health checks.

use crate::sync::{CondvarExt, MutexExt};
use std::sync::atomic::Ordering;

use cudarc::driver::sys;

use super::driver::error_name;
use super::lane::{CudaLane, Job, Progress};
use super::options::{AccessOrder, KEEP_WARM_EVERY};
use super::query::memory_type;
use super::resources::{Event, StreamHandle};
use super::shared::Shared;
use crate::backend::{thread_stopped, AddElapsed, BackendError, Submitted};
use crate::direction::Direction;
use crate::kernel::{KernelBatch, PageKernel};
use crate::plan::Plan;

/// How long a thread woken ahead of a job (see `CudaLane::nudged`) polls for it before it sleeps:
/// longer than the caller's start of a staged transfer takes after an idle gap.
const NUDGE_POLL: std::time::Duration = std::time::Duration::from_millis(1);

impl Shared {
    /// Wakes the lane's thread ahead of a job that `submit` is issuing the start of (the thread
    /// holds no job): it wakes while the caller's driver calls run, and polls for the job.
    pub(super) fn nudge(&self, lane: Direction) {
        let l = self.lane(lane);
        let _q = l.queue.locked();
        // Relaxed: read and written under the queue's lock.
        l.nudged.store(true, Ordering::Relaxed);
        l.work.notify_one();
    }

    /// Wakes the lane's thread where it sleeps with nothing to issue, ahead of a transfer the
    /// caller is about to submit: the thread's wake-up (tens of µs after an idle gap) overlaps
    /// the caller's preparing the transfer instead of following it. Woken, the thread polls
    /// for the job (`NUDGE_POLL`) before it sleeps again.
    pub(super) fn wake_ahead(&self, lane: Direction) {
        let l = self.lane(lane);
        // Relaxed: hints, read without the lock; a stale one costs one wake-up or misses one.
        if l.asleep.load(Ordering::Relaxed) && !l.nudged.load(Ordering::Relaxed) {
            self.nudge(lane);
        }
    }

    pub(super) fn lane(&self, d: Direction) -> &CudaLane {
        &self.lanes[d.lane()]
    }

    /// Whether nothing this backend accepted on `lane` can still run: every completion marker
    /// reached, or, where a marker may be missing, nothing left to issue and the streams idle.
    /// Never blocks; the context is current.
    pub(super) fn lane_idle(&self, lane: Direction) -> bool {
        let l = self.lane(lane);
        // Acquire: pairs with the Release stores in `submit` and `issue_job`, and the
        // decrement in `work`.
        if l.unmarked.load(Ordering::Acquire) {
            if l.pending.load(Ordering::Acquire) != 0 {
                return false;
            }
            let kernels = l
                .stage
                .try_locked()
                .map(|st| st.as_ref().map(|st| st.stream.handle()));
            let idle = |s: StreamHandle| s.query() == sys::CUresult::CUDA_SUCCESS;
            // A stage held by a submission in progress is not idle.
            return idle(l.stream.handle()) && kernels.is_some_and(|k| k.is_none_or(idle));
        }
        self.completed_seq(lane) >= l.accepted.load(Ordering::Acquire)
    }

    /// Whether host memory may be freed now. Until shutdown, and while no lane has failed, the
    /// engine frees only what no transfer in flight uses; after either, only once every lane is
    /// idle. The context is current.
    pub(super) fn may_free(&self) -> bool {
        // Acquire: pairs with the store in `shutdown`.
        let trusted = !self.shut.load(Ordering::Acquire)
            && self.lanes.iter().all(|l| l.error.get().is_none());
        trusted || Direction::ALL.into_iter().all(|d| self.lane_idle(d))
    }

    /// The transfers not known complete on lanes that are not idle.
    pub(super) fn left(&self) -> u64 {
        Direction::ALL
            .into_iter()
            .filter(|&d| !self.lane_idle(d))
            .map(|d| self.left_on(d))
            .sum()
    }

    /// The transfers of `lane` not known complete (at least 1 where the lane is not idle).
    pub(super) fn left_on(&self, lane: Direction) -> u64 {
        let l = self.lane(lane);
        l.accepted
            .load(Ordering::Acquire)
            .saturating_sub(self.completed_seq(lane))
            .max(1)
    }

    pub(super) fn attrs(&self, lane: Direction) -> sys::CUmemcpyAttributes {
        // SAFETY: CUmemcpyAttributes is a plain C struct; all-zero is a valid (no hints) value.
        let mut a: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
        a.srcAccessOrder = match self.opts.access_order[lane.lane()] {
            AccessOrder::Any => sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_ANY,
            AccessOrder::Stream => sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        };
        a
    }

    /// Whether a transfer of `lane` issued before the one numbered `seq` is not yet known
    /// complete: that one follows it on the GPU rather than starting an idle lane.
    pub(super) fn earlier_running(&self, lane: Direction, seq: u64) -> bool {
        self.completed_seq(lane) + 1 < seq
    }

    /// The highest sequence number of `lane` known complete.
    pub(super) fn completed_seq(&self, lane: Direction) -> u64 {
        let l = self.lane(lane);
        if self.write_value {
            // The device writes it with the stream's memory barrier before the value; read with
            // Acquire, the copies' bytes are read only after seeing their sequence number.
            let written = l.counter.load();
            // Acquire: pairs with the Release store in `issue_job`, after what it recorded in
            // the slab (a failure): a transfer is complete once its marker is both queued and
            // reached.
            return written.min(l.submitted.load(Ordering::Acquire));
        }
        let submitted = l.submitted.load(Ordering::Acquire);
        let mut known = l.known.load(Ordering::Acquire);
        while known < submitted {
            let ev = &l.done_events[((known + 1) as usize) % l.done_events.len()];
            if ev.query() != sys::CUresult::CUDA_SUCCESS {
                break;
            }
            known += 1;
        }
        // fetch_max: racing pollers only ever move it forward.
        l.known.fetch_max(known, Ordering::AcqRel);
        known
    }

    /// What a transfer waits for on the caller's stream: nothing where the stream has no work
    /// left (`cuStreamQuery`: the work a transfer must follow is the work there now, all of it
    /// done), else an event of the lane's pool (made if the pool is empty) recorded there.
    pub(super) fn record_dep(
        &self,
        lane: Direction,
        stream: u64,
    ) -> Result<Option<Event>, BackendError> {
        // SAFETY: `stream` is the caller's stream handle (`wait_stream`: a stream of this
        // device that outlives the submission, or 0, the legacy default stream).
        let caller = unsafe { StreamHandle::caller(stream) };
        // Any other answer (not ready, or the stream's error) records the event, as before.
        if caller.query() == sys::CUresult::CUDA_SUCCESS {
            return Ok(None);
        }
        let l = self.lane(lane);
        let pooled = l.deps.locked().pop();
        let ev = match pooled {
            Some(ev) => ev,
            None => Event::create(self.ctx.raw, false)?,
        };
        match ev.record(caller) {
            Ok(()) => Ok(Some(ev)),
            Err(e) => {
                l.deps.locked().push(ev);
                Err(e)
            }
        }
    }

    /// Blocks until the lane's issuing thread has issued everything handed to it.
    pub(super) fn wait_drained(&self, lane: Direction) {
        let l = self.lane(lane);
        let mut q = l.queue.locked();
        // Acquire: pairs with the Release decrement in `work`.
        while l.pending.load(Ordering::Acquire) != 0 {
            q = l.drained.wait_locked(q);
        }
    }

    /// [`Self::work`], where a panic (a defect) fails the lane with its message instead of
    /// leaving its jobs to nobody: their transfers are reported failed, not waited for forever,
    /// and later submissions on the lane are refused with the same error. What the thread had
    /// issued still runs; with no marker promised after it, only the streams say when the lane
    /// is idle (what the engine frees waits for that).
    pub(super) fn work_or_fail(&self, lane: Direction) {
        let work = std::panic::AssertUnwindSafe(|| self.work(lane));
        let Err(panic) = std::panic::catch_unwind(work) else {
            return;
        };
        let l = self.lane(lane);
        let mut q = l.queue.locked();
        let _ = l.error.set(thread_stopped(
            &format!("the {lane} issuing thread"),
            &*panic,
        ));
        // Release: pairs with the Acquire load in `lane_idle`.
        l.unmarked.store(true, Ordering::Release);
        q.clear();
        // Release: nothing is held any more (pairs with the Acquire loads in `failed` and
        // `wait_drained`).
        l.pending.store(0, Ordering::Release);
        l.drained.notify_all();
    }

    /// The issuing thread of `lane`: issues the jobs handed to it, in order, until the backend
    /// stops and the queue is empty. On a lane that failed it issues nothing more: the engine
    /// reports those transfers failed once `pending` is 0.
    pub(super) fn work(&self, lane: Direction) {
        let l = self.lane(lane);
        // The context stays current on this thread for its life, so each job's `make_current`
        // finds it so: the thread's first driver calls happen here, not in its first job. A
        // failure is the first job's to report.
        let _home = self.make_current();
        // When the thread last finished issuing a job: it stays ready until `keep_warm` after.
        let mut last_job: Option<std::time::Instant> = None;
        loop {
            let job = {
                let mut q = l.queue.locked();
                loop {
                    if let Some(job) = q.pop_front() {
                        break job;
                    }
                    // Acquire: pairs with the Release store in `CudaBackend`'s Drop.
                    if self.stopping.load(Ordering::Acquire) {
                        return;
                    }
                    // Relaxed: read and written under the queue's lock.
                    if l.nudged.swap(false, Ordering::Relaxed) {
                        // Woken ahead of a job: polled for (the lock let go in between) rather
                        // than slept on, so the thread is awake when it comes.
                        drop(q);
                        let start = std::time::Instant::now();
                        // Acquire: pairs with the increment in `submit`.
                        while l.pending.load(Ordering::Acquire) == 0 && start.elapsed() < NUDGE_POLL
                        {
                            std::thread::yield_now();
                        }
                        q = l.queue.locked();
                        continue;
                    }
                    // Relaxed: read and written under the queue's lock (`wake_ahead` reads it
                    // first without, as a hint).
                    l.asleep.store(true, Ordering::Relaxed);
                    let warm = last_job.is_some_and(|t| t.elapsed() < self.opts.keep_warm);
                    if !warm {
                        q = l.work.wait_locked(q);
                        l.asleep.store(false, Ordering::Relaxed);
                        continue;
                    }
                    // Kept warm: a short sleep, then one cheap driver call with the queue's
                    // lock let go (submitters take it), unless a job came meanwhile.
                    q = l.work.wait_timeout_locked(q, KEEP_WARM_EVERY);
                    l.asleep.store(false, Ordering::Relaxed);
                    if q.is_empty() {
                        drop(q);
                        // Acquire: pairs with the increment in `submit`.
                        if l.pending.load(Ordering::Acquire) == 0 {
                            let _ = l.stream.handle().query();
                            #[cfg(test)]
                            l.warm_polls.fetch_add(1, Ordering::Relaxed);
                        }
                        q = l.queue.locked();
                    }
                }
            };
            #[cfg(test)]
            // Relaxed: a test hook.
            assert!(
                !l.panic_next.swap(false, Ordering::Relaxed),
                "a panic injected into the lane's thread"
            );
            if l.error.get().is_none() {
                match self.make_current() {
                    Ok(_ctx) => {
                        let _ = self.issue_job(lane, job);
                    }
                    Err(e) => {
                        let _ = l.error.set(e);
                    }
                }
            }
            last_job = Some(std::time::Instant::now());
            let _q = l.queue.locked();
            // Release: the slab is not touched after this (pairs with Acquire loads in
            // `wait_drained` and `failed`).
            if l.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
                l.drained.notify_all();
            }
        }
    }

    /// Issues one transfer on the lane's streams: the wait for the caller's stream, its copies
    /// (and kernels), then its completion marker, which goes in whatever happened to the copies,
    /// so the lane stays ordered; a job whose first step the caller issued goes on from there.
    /// The context is current. `Err` where the marker could not be queued: the lane has failed.
    pub(super) fn issue_job(
        &self,
        lane: Direction,
        mut job: Job<'_>,
    ) -> Result<Submitted, BackendError> {
        let mut progress = match job.progress.take() {
            Some(p) => p,
            None => self.job_head(lane, &job),
        };
        self.job_steps(lane, &job, &mut progress, usize::MAX);
        self.job_tail(lane, job, progress)
    }

    /// The start of a job: the wait for the caller's stream, the timing event, and its copies
    /// (and kernels), except a staged transfer's steps, which [`Self::job_steps`] issues.
    pub(super) fn job_head(&self, lane: Direction, job: &Job<'_>) -> Progress {
        let l = self.lane(lane);
        // SAFETY: the engine keeps the slab in flight until completion of `seq` is observed,
        // which needs the marker queued by `job_tail` (or, on a failed lane, `pending` back at
        // 0).
        let slab = unsafe { job.slab.get() };
        let mut outcome = job.failed.clone().map_or(Ok(()), Err);
        let stream = l.stream.handle();
        if let Some(dep) = &job.dep {
            // Our stream waits for the caller's work at submission.
            outcome = stream.wait(dep);
        }
        if let (Ok(()), Some((start, _))) = (&outcome, self.timing(lane, job.seq)) {
            // A failed timing record only loses the timing.
            let _ = start.record(stream);
        }
        let mut staged = None;
        // Copies are issued only when the ordering they depend on is in place.
        let mut first = 0;
        if let (Ok(()), Plan::Pages(Some((batch, kernel)))) = (&outcome, &job.plan) {
            // The small descriptors first, by the copy kernel on this lane's stream; it reads them
            // from the slab in place. Then DMA for the rest, then the completion marker: one
            // submission, one completion.
            first = batch.len;
            outcome = match kernel {
                PageKernel::Launcher(launch) => launch(KernelBatch {
                    stream: stream.raw() as u64,
                    ..*batch
                })
                .map_err(|reason| BackendError::CopyFailed {
                    index: None,
                    reason: format!("copy kernel: {reason}"),
                }),
                PageKernel::Loaded {
                    kernel,
                    launch_bytes,
                } => self.launch_pages(stream, *batch, *kernel, *launch_bytes),
            };
        }
        if outcome.is_ok() && first < slab.len() {
            let _timed = AddElapsed::start(&self.driver_ns);
            outcome = match &job.plan {
                Plan::Staged(req) => {
                    // An earlier transfer of the lane still on the GPU: this one's first steps
                    // overlap its last ones.
                    let behind = self.earlier_running(lane, job.seq);
                    self.staged_begin(lane, slab, *req, job.dep.as_ref(), behind)
                        .map(|run| staged = Some(run))
                }
                Plan::Runs(()) => self.issue_pitched(lane, slab),
                Plan::Pages(_) => self.issue_copies(lane, slab, first),
            };
        }
        Progress { outcome, staged }
    }

    /// A staged job's steps up to `until` (exclusive), after those issued before; nothing once
    /// something of the job failed.
    pub(super) fn job_steps(
        &self,
        lane: Direction,
        job: &Job<'_>,
        progress: &mut Progress,
        until: usize,
    ) {
        if let (Ok(()), Some(run), Plan::Staged(req)) =
            (&progress.outcome, &mut progress.staged, &job.plan)
        {
            let _timed = AddElapsed::start(&self.driver_ns);
            // SAFETY: as in `job_head`.
            let slab = unsafe { job.slab.get() };
            progress.outcome = self.staged_steps(lane, slab, req, run, until);
        }
    }

    /// The end of a job: the completion marker after everything issued for it.
    fn job_tail(
        &self,
        lane: Direction,
        job: Job<'_>,
        progress: Progress,
    ) -> Result<Submitted, BackendError> {
        let l = self.lane(lane);
        let seq = job.seq;
        if let Some(run) = &progress.staged {
            self.staged_end(lane, run);
        }
        if let Some(dep) = job.dep {
            // Every wait on it is queued: it may be recorded again.
            l.deps.locked().push(dep);
        }
        let whole =
            progress.outcome.is_ok() && progress.staged.as_ref().is_some_and(|r| r.whole(lane));
        let outcome = progress.outcome;
        // A direct transfer ran on the lane's stream alone, as the page route does.
        let staged = matches!(job.plan, Plan::Staged(r) if !r.direct);
        let tail = self.marker_stream(lane, staged, whole);
        if let (Ok(()), Some((_, end))) = (&outcome, self.timing(lane, seq)) {
            let _ = end.record(tail);
        }
        if let Err(e) = &outcome {
            // SAFETY: as in `job_head`.
            unsafe { job.slab.get() }.set_failed(e.to_string());
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

    /// The timing events of `seq` (timing on).
    pub(super) fn timing(&self, lane: Direction, seq: u64) -> Option<&(Event, Event)> {
        let t = &self.lane(lane).timing_events;
        (!t.is_empty()).then(|| &t[(seq as usize) % t.len()])
    }

    /// The lane's error, once its issuing thread holds no slab any more (before that, the
    /// engine must not hand the slabs of its transfers back).
    pub(super) fn failed(&self, lane: Direction) -> Option<&BackendError> {
        let l = self.lane(lane);
        // Acquire: pairs with the Release decrement in `work`.
        l.error
            .get()
            .filter(|_| l.pending.load(Ordering::Acquire) == 0)
    }

    /// After a failed batch whose ABI does not say which descriptor failed: the first one whose
    /// source or destination the driver does not know.
    pub(super) fn find_bad_descriptor(src: &[u64], dst: &[u64]) -> Option<usize> {
        (0..src.len()).find(|&i| memory_type(src[i]).is_none() || memory_type(dst[i]).is_none())
    }

    /// Queues the completion marker of `seq` on `stream` (see [`Self::marker_stream`]).
    fn signal(&self, lane: Direction, seq: u64, stream: StreamHandle) -> Result<(), BackendError> {
        let l = self.lane(lane);
        if self.write_value {
            stream.write_value(&l.counter, seq)
        } else {
            // Re-recording a ring slot is safe: the engine never has more than half the ring in
            // flight.
            l.done_events[(seq as usize) % l.done_events.len()].record(stream)
        }
    }

    pub(super) fn check_stream(&self, lane: Direction) {
        let l = self.lane(lane);
        if l.error.get().is_some() {
            return;
        }
        let r = l.stream.handle().query();
        if r != sys::CUresult::CUDA_SUCCESS && r != sys::CUresult::CUDA_ERROR_NOT_READY {
            let _ = l.error.set(BackendError::Driver {
                call: "cuStreamQuery",
                code: r as i32,
                name: error_name(r),
            });
        }
    }
}
