//! The lanes: each direction's stream and completion state and the transfers handed to its
//! issuing thread (that thread's work is in `worker`).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Condvar, Mutex, OnceLock};

use cudarc::driver::sys;

use super::resources::{Counter, Event, PinnedHost, Stream};
use super::stage::{Stage, StagedRun};
use crate::backend::{BackendError, Issue};
use crate::plan::Plan;
use crate::slab::SlabRef;

/// One direction's stream and completion state.
#[derive(Debug)]
pub(super) struct CudaLane {
    /// Event ring, indexed by `seq % len`: completion (event mode).
    pub(super) done_events: Vec<Event>,
    /// Timing event pairs, indexed by `seq % len` (timing on).
    pub(super) timing_events: Vec<(Event, Event)>,
    /// Events recorded on callers' streams, free for the next transfer (see [`Job::dep`]).
    pub(super) deps: Mutex<Vec<Event>>,
    /// Transfers handed to the lane's issuing thread, in order.
    pub(super) queue: Mutex<VecDeque<Job<'static>>>,
    /// Signalled when a job is queued or the backend stops, or to wake the thread early.
    pub(super) work: Condvar,
    /// Set (under the queue's lock) where the thread is woken ahead of a job (`submit` issuing
    /// a job's start on the caller, or `wake_ahead` for a transfer announced): the thread then
    /// polls for it a while before it sleeps. `wake_ahead` reads it first without the lock.
    pub(super) nudged: AtomicBool,
    /// Set (under the queue's lock) while the issuing thread sleeps on `work`.
    pub(super) asleep: AtomicBool,
    /// Signalled when the issuing thread has nothing left (`pending` is 0).
    pub(super) drained: Condvar,
    /// Transfers accepted and not yet issued (or dropped, on a failed lane) by the issuing
    /// thread: while it is not 0, the thread may still read their slabs.
    pub(super) pending: AtomicU64,
    /// The highest sequence number accepted.
    pub(super) accepted: AtomicU64,
    /// Dropped after the events recorded on it.
    pub(super) stream: Stream,
    /// The staged plan's resources, made on the lane's first staged transfer. Whoever issues
    /// the lane's transfers (its thread, or `submit` once the thread has drained) takes the
    /// lock; `lane_idle` only tries it.
    pub(super) stage: Mutex<Option<Stage>>,
    /// Mapped pinned u64 the stream writes completed sequence numbers into (write-value mode),
    /// inside the backend's `counters`.
    pub(super) counter: Counter,
    pub(super) submitted: AtomicU64,
    /// Highest sequence number known complete (event mode).
    pub(super) known: AtomicU64,
    /// Set once copies may be queued with no completion marker after them (the marker failed to
    /// enqueue): then only the stream itself says when this lane's work is done.
    pub(super) unmarked: AtomicBool,
    pub(super) error: OnceLock<BackendError>,
    /// Nanoseconds since `CudaBackend::epoch` of the last stream health check.
    pub(super) last_check: AtomicU64,
    /// The driver calls the lane's thread made to stay warm (`CudaOptions::keep_warm`).
    #[cfg(test)]
    pub(super) warm_polls: AtomicU64,
    /// The lane's thread panics at its next job, as a defect would.
    #[cfg(test)]
    pub(super) panic_next: AtomicBool,
}

impl CudaLane {
    /// Lane `i`: counter `i` of `counters`, the caller's `stream` or a new one, its dependency
    /// event. `ctx` is current.
    pub(super) fn new(
        ctx: sys::CUcontext,
        counters: &PinnedHost,
        i: usize,
        stream: Option<u64>,
    ) -> Result<Self, BackendError> {
        let counter = Counter::new(counters, i)?;
        let stream = match stream {
            // SAFETY: the caller's stream for this lane, which the caller keeps alive while the
            // backend lives (`h2d_stream=` / `d2h_stream=`).
            Some(s) => unsafe { Stream::borrowed(s, ctx) },
            None => Stream::create(ctx)?,
        };
        Ok(CudaLane {
            done_events: Vec::new(),
            timing_events: Vec::new(),
            deps: Mutex::new(Vec::new()),
            queue: Mutex::new(VecDeque::new()),
            work: Condvar::new(),
            nudged: AtomicBool::new(false),
            asleep: AtomicBool::new(false),
            drained: Condvar::new(),
            pending: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            stream,
            stage: Mutex::new(None),
            counter,
            submitted: AtomicU64::new(0),
            known: AtomicU64::new(0),
            unmarked: AtomicBool::new(false),
            error: OnceLock::new(),
            last_check: AtomicU64::new(0),
            #[cfg(test)]
            warm_polls: AtomicU64::new(0),
            #[cfg(test)]
            panic_next: AtomicBool::new(false),
        })
    }

    /// Whether `cuStreamWriteValue64` works here: one write, then a synchronize.
    pub(super) fn probe_write_value(&self) -> bool {
        let s = self.stream.handle();
        s.write_value(&self.counter, 0).is_ok() && s.synchronize().is_ok()
    }
}

/// A transfer to issue on a lane: by its issuing thread (`Job<'static>`, whose page kernel, if
/// any, is a loaded one), or on the caller's thread.
#[derive(Debug)]
pub(super) struct Job<'a> {
    pub(super) seq: u64,
    pub(super) slab: SlabRef,
    /// What the slab holds and what moves it.
    pub(super) plan: Issue<'a>,
    /// Recorded on the caller's stream at submission: the copies wait for it. Given back to the
    /// lane's pool once the waits on it are queued.
    pub(super) dep: Option<Event>,
    /// Why the transfer fails before any copy is issued (the caller's stream could not be
    /// recorded): only its completion marker goes in.
    pub(super) failed: Option<BackendError>,
    /// What of it was issued on the caller's thread (its start and a staged transfer's first
    /// step), where the lane's thread goes on from.
    pub(super) progress: Option<Progress>,
}

/// How far a job's issuing got: what went wrong so far, and a staged transfer's steps.
#[derive(Debug)]
pub(super) struct Progress {
    pub(super) outcome: Result<(), BackendError>,
    pub(super) staged: Option<StagedRun>,
}

impl<'a> Job<'a> {
    /// The job as one a lane's thread may take: `Err(self)` where its page kernel is a launcher
    /// the caller lent, which runs on the caller's thread.
    // Both variants are the job itself, moved once per submission: boxing it would only add an
    // allocation to the submit path.
    #[allow(clippy::result_large_err)]
    pub(super) fn into_owned(self) -> Result<Job<'static>, Job<'a>> {
        let plan = match self.plan {
            Plan::Pages(Some((batch, kernel))) => match kernel.owned() {
                Some(kernel) => Plan::Pages(Some((batch, kernel))),
                None => return Err(self),
            },
            Plan::Pages(None) => Plan::Pages(None),
            Plan::Runs(()) => Plan::Runs(()),
            Plan::Staged(req) => Plan::Staged(req),
        };
        Ok(Job {
            seq: self.seq,
            slab: self.slab,
            plan,
            dep: self.dep,
            failed: self.failed,
            progress: self.progress,
        })
    }
}
