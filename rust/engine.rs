//! The engine: submit, poll, wait and shut down transfers over a [`Backend`].
//!
//! Submission is serialised by one lock (it orders each lane and guards the region table and the
//! live job ids); it validates and coalesces a batch into a pool slab, pushes the in-flight record,
//! then asks the backend to issue the copies. Polling ([`Engine::get_finished`]) takes no lock and
//! makes no blocking call: it reads each lane's completed sequence number and claims the records up
//! to it (see [`crate::completion`]). Finished job ids go back to the submit side through a
//! lock-free queue, so a job id becomes reusable once its result has been reported.

use crate::sync::MutexExt;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;

use crate::backend::{
    AddElapsed, Backend, BackendError, BackendInfo, HostAlloc, SubmitRequest, Submitted,
};
use crate::completion::{InFlight, Lane};
use crate::descriptor::{
    partition_small, prepare_into, Batch, Columns, DescriptorError, Prepared, Scratch,
};
use crate::direction::Direction;
use crate::fork::install_fork_hook;
use crate::hostmem;
use crate::kernel::{KernelBatch, PageKernel};
use crate::plan::Plan;
use crate::pool::{Pool, PoolStats};
use crate::region::RegionTable;
use crate::table::BlockTable;
use crate::table::StagedRequest;
use crate::transfer::{JobId, TransferResult};

mod blocks;
mod config;
mod error;
mod latency;
mod memory;
pub use crate::fork::{fork_generation, in_forked_child};
pub use blocks::{Chunks, GroupIds};
pub use config::{
    seconds, ConfigError, EngineConfig, DEFAULT_STAGE_BYTES, MAX_IN_FLIGHT, MIN_POOL_BYTES,
    MIN_STAGE_BYTES,
};
pub use error::EngineError;
pub use latency::LaneLatencyStats;

/// The deadline `timeout` from now; `None` (no deadline) where the clock cannot count that far.
fn deadline(timeout: Duration) -> Option<Instant> {
    Instant::now().checked_add(timeout)
}

/// Per-direction counters.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LaneStats {
    pub transfers: u64,
    pub failed: u64,
    pub bytes: u64,
    pub seconds: f64,
}

/// Counters of an engine.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineStats {
    pub lanes: [LaneStats; 4],
    pub in_flight: u64,
    pub pool: PoolStats,
    /// Nanoseconds the backend spent inside driver copy calls.
    pub driver_ns: u64,
    /// Nanoseconds spent in submissions (validated or refused), from entry to return, and the
    /// part of it spent validating, coalescing and writing descriptors.
    pub submit_ns: u64,
    pub prepare_ns: u64,
    /// Whether `shutdown` gave up waiting: transfers were still in flight at its timeout.
    pub shutdown_timed_out: bool,
}

#[derive(Debug, Default)]
struct LaneCounters {
    transfers: AtomicU64,
    failed: AtomicU64,
    bytes: AtomicU64,
    nanos: AtomicU64,
}

#[derive(Debug)]
struct SubmitState {
    regions: RegionTable,
    /// Host buffers allocated through the engine, by address, with their id in the process-wide
    /// table of host buffers (`hostmem::track`).
    buffers: HashMap<u64, (HostAlloc, u64)>,
    /// Host ranges page-locked through the engine, by address.
    pinned: std::collections::HashSet<u64>,
    /// Host registrations cut into several regions at the pieces of host buffers, or lying in
    /// one, by the address they were registered at (see [`crate::hostmem`]).
    parts: HashMap<u64, memory::Parts>,
    /// Block tables by id (a removed one leaves a hole that the next registration fills).
    tables: Vec<Option<BlockTable>>,
    /// Pairs of registered tables (the lower id first) whose spans overlap but whose pages share
    /// no byte whatever the blocks ([`BlockTable::apart_from`]), found at registration.
    apart: std::collections::HashSet<(u32, u32)>,
    scratch: Scratch,
    /// Chunk ids expanded to table blocks, per side (see [`crate::table::expand_groups_into`]).
    chunk_ids: [Vec<u64>; 2],
}

/// A slab whose transfer was reported while its backend may still read it, and what says when
/// it may not any more: the lane's completed sequence number reaching `seq`.
#[derive(Debug)]
struct Parked {
    direction: Direction,
    seq: u64,
    slab: crate::slab::Slab,
}

/// How the caller asks a transfer to move (see [`Plan`]): a descriptor per page, with
/// `Some((below, kernel))` those below `below` bytes (after coalescing) moved by the copy kernel
/// `kernel` and the rest by DMA; the 2-D copies of each table pair's block plan, copy engines
/// only; or the staged plan, each block's host row across `PCIe` as one copy into or out of a
/// device staging ring and its pages moved inside the GPU by the loaded kernel (see
/// [`StagedRoute`]).
pub type Route<'a> = Plan<Option<(u64, PageKernel<'a>)>, (), StagedRoute>;

/// The staged plan as the caller asks for it: its kernel (see [`Engine::load_kernel`]; `None` on
/// the host backend, which copies with memcpy), and whether the kernel moves the host pages in
/// place, with no row across `PCIe` by the copy engines ([`StagedRequest::direct`]), and then
/// the most page bytes one of its launches moves (`None`: a launch per run of one geometry; see
/// [`StagedRequest::launch_bytes`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StagedRoute {
    pub kernel: Option<u32>,
    pub direct: bool,
    pub launch_bytes: Option<u64>,
}

/// Moves batches of blocks over a backend. Shared between threads (`&self` everywhere).
#[derive(Debug)]
pub struct Engine {
    backend: Arc<dyn Backend>,
    pool: Pool,
    lanes: [Lane; 4],
    state: Mutex<SubmitState>,
    /// Job ids whose results have not been reported, with their lane and sequence number. A lock
    /// of its own, held only to look ids up or change the map (after the submit lock, where both
    /// are held): `wait` never queues behind a submission or a shutdown holding the submit lock.
    live: Mutex<HashMap<JobId, (Direction, u64)>>,
    retired: ArrayQueue<JobId>,
    counters: [LaneCounters; 4],
    latency: latency::Latency,
    failed_lanes: [OnceLock<BackendError>; 4],
    /// Slabs of transfers already reported (failed, with their lane) that the backend may still
    /// hold: kept out of the pool until the lane's completed sequence number passes them (see
    /// [`Engine::finish`]). Lock-free, as polling is.
    parked: ArrayQueue<Parked>,
    shut: AtomicBool,
    /// Held by `shutdown` from start to end: a second caller returns once the first is done.
    shutting: Mutex<()>,
    /// Set by a shutdown that reached its timeout with transfers in flight.
    shutdown_timed_out: AtomicBool,
    config: EngineConfig,
    /// [`fork_generation`] when the engine was made.
    generation: u64,
    /// Host time of submissions, whole and in `fill` (see [`EngineStats`]).
    submit_ns: AtomicU64,
    prepare_ns: AtomicU64,
}

impl Engine {
    /// An engine over `backend`.
    ///
    /// # Panics
    /// If `config` is outside its limits ([`EngineConfig::validate`]); [`Engine::try_new`]
    /// returns the error instead.
    pub fn new(backend: Arc<dyn Backend>, config: EngineConfig) -> Self {
        Self::try_new(backend, config).unwrap_or_else(|e| panic!("{e}"))
    }

    /// An engine over `backend`, or the setting of `config` that is outside its limits.
    pub fn try_new(backend: Arc<dyn Backend>, config: EngineConfig) -> Result<Self, EngineError> {
        config.validate()?;
        install_fork_hook();
        let generation = fork_generation();
        // Within the limits by `validate`; no lane holds more than the backend does.
        let max_in_flight = config.max_in_flight.clamp(1, backend.max_in_flight());
        Ok(Engine {
            pool: Pool::new(backend.clone(), config.pool_bytes),
            backend,
            lanes: std::array::from_fn(|_| Lane::new(max_in_flight)),
            state: Mutex::new(SubmitState {
                regions: RegionTable::default(),
                buffers: HashMap::new(),
                pinned: std::collections::HashSet::default(),
                parts: HashMap::new(),
                tables: Vec::new(),
                apart: std::collections::HashSet::new(),
                scratch: Scratch::default(),
                chunk_ids: [Vec::new(), Vec::new()],
            }),
            live: Mutex::new(HashMap::with_capacity(4 * max_in_flight)),
            retired: ArrayQueue::new(4 * max_in_flight),
            counters: Default::default(),
            latency: latency::Latency::default(),
            failed_lanes: Default::default(),
            // At most every lane's records at once: a failed lane takes no new transfer.
            parked: ArrayQueue::new(4 * max_in_flight),
            shut: AtomicBool::new(false),
            shutting: Mutex::new(()),
            shutdown_timed_out: AtomicBool::new(false),
            config,
            generation,
            submit_ns: AtomicU64::new(0),
            prepare_ns: AtomicU64::new(0),
        })
    }

    /// Whether this engine was made in a parent of this process (then nothing of it works here).
    fn forked(&self) -> bool {
        fork_generation() != self.generation
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    pub fn backend_info(&self) -> BackendInfo {
        self.backend.info()
    }

    /// Test hook: the next `count` transfers fail in the middle of their copies, as a real fault
    /// would (see [`Backend::inject_failures`]).
    pub fn inject_failures(&self, count: u64) {
        self.backend.inject_failures(count);
    }

    fn lock(&self) -> MutexGuard<'_, SubmitState> {
        // A panic while holding the lock leaves consistent data (every mutation is a single call),
        // so a poisoned lock is taken over rather than propagated.
        self.state.locked()
    }

    /// The submit lock, for a call that is not refused after `shutdown` (unregistering, a
    /// table's queries), or the refusal of an engine inherited across `fork`: a thread of the
    /// parent may have held the lock when it forked, and nothing of the engine works here.
    fn lock_here(&self) -> Result<MutexGuard<'_, SubmitState>, EngineError> {
        if self.forked() {
            return Err(BackendError::Forked.into());
        }
        Ok(self.lock())
    }

    fn live(&self) -> MutexGuard<'_, HashMap<JobId, (Direction, u64)>> {
        // Every change is one call on the map: a poisoned lock leaves it consistent.
        self.live.locked()
    }

    fn check_usable(&self) -> Result<(), EngineError> {
        if self.forked() {
            return Err(BackendError::Forked.into());
        }
        if self.shut.load(Ordering::Acquire) {
            return Err(EngineError::ShutDown);
        }
        Ok(())
    }

    /// Announces a transfer about to be submitted on `direction`: the backend may wake the
    /// thread that will issue it now, so that its wake-up overlaps the caller's preparing the
    /// transfer ([`Backend::wake`]). Every submission announces itself; a caller with work of its
    /// own before the submission (building block ids, say) calls this first. Never blocks on
    /// copies; nothing happens on an engine that is shut down or inherited across `fork`.
    pub fn wake(&self, direction: Direction) {
        if self.check_usable().is_ok() {
            self.backend.wake(direction);
        }
    }

    /// Validates, coalesces and issues one transfer under `job_id`; returns once the copies are
    /// enqueued. Its result comes from [`Engine::get_finished`].
    ///
    /// With `wait_stream` (a raw `CUstream`; `0` is the legacy default stream) the copies start
    /// only after the work issued on that stream so far: how device-to-host transfers wait for
    /// the model's compute stream.
    pub fn submit(
        &self,
        job_id: JobId,
        src: &[u64],
        dst: &[u64],
        size: &[u64],
        direction: Direction,
        wait_stream: Option<u64>,
    ) -> Result<(), EngineError> {
        let batch = Batch { src, dst, size };
        self.submit_routed(job_id, batch, direction, wait_stream, None)
    }

    /// [`Engine::submit`], with the descriptors smaller than `kernel.0` (after coalescing) moved
    /// by the copy kernel `kernel.1` (a launcher, or a kernel the backend loaded), and the rest by
    /// DMA: one submission, one completion.
    pub fn submit_routed(
        &self,
        job_id: JobId,
        batch: Batch<'_>,
        direction: Direction,
        wait_stream: Option<u64>,
        kernel: Option<(u64, PageKernel<'_>)>,
    ) -> Result<(), EngineError> {
        let coalesce = self.config.coalesce;
        self.submit_with(
            job_id,
            |_| Ok((batch.src.len(), ())),
            direction,
            wait_stream,
            Plan::Pages(kernel),
            |state, cols, ()| {
                let SubmitState {
                    regions, scratch, ..
                } = state;
                prepare_into(batch, direction, regions, coalesce, cols, scratch)
                    .map_err(EngineError::from)
            },
        )
    }

    /// The common part of every submission, under one hold of the submit lock: job id, in-flight
    /// and size limits, a slab of the entries `size(state)` counts, `fill` (validate and write
    /// the descriptors, with what `size` worked out: both run under the same hold of the lock,
    /// so the tables cannot change in between), the kernel split, the record, the backend. Timed
    /// into `submit_ns`, and `fill` into `prepare_ns`.
    fn submit_with<S>(
        &self,
        job_id: JobId,
        size: impl FnOnce(&SubmitState) -> Result<(usize, S), EngineError>,
        direction: Direction,
        wait_stream: Option<u64>,
        route: Route<'_>,
        fill: impl FnOnce(&mut SubmitState, Columns<'_>, S) -> Result<Prepared, EngineError>,
    ) -> Result<(), EngineError> {
        let _timed = AddElapsed::start(&self.submit_ns);
        let mut timing = self.latency.submission(direction);
        self.check_usable()?;
        self.backend.wake(direction);
        if let Some(e) = self.failed_lanes[direction.lane()].get() {
            return Err(e.clone().into());
        }
        let mut state = self.lock();
        // Again under the lock: `shutdown` raises the flag before it takes the lock, so either
        // this submit holds the lock first (and shutdown waits for its transfer) or it sees the
        // flag here. Checked only before the lock, a submit could pass the check, wait for the
        // lock while shutdown stops the backend, and be accepted onto a stopped backend.
        if self.shut.load(Ordering::Acquire) {
            return Err(EngineError::ShutDown);
        }
        {
            let mut live = self.live();
            while let Some(id) = self.retired.pop() {
                live.remove(&id);
            }
            if live.contains_key(&job_id) {
                return Err(EngineError::JobIdLive(job_id));
            }
        }
        let lane = &self.lanes[direction.lane()];
        if lane.in_flight() >= self.config.max_in_flight as u64 {
            return Err(EngineError::TooManyInFlight {
                direction,
                max: self.config.max_in_flight,
            });
        }
        let (descriptors, sizing) = size(&state)?;
        if descriptors > self.config.max_descriptors {
            return Err(DescriptorError::TooLarge {
                len: descriptors,
                max: self.config.max_descriptors,
            }
            .into());
        }

        let mut slab = self.pool.acquire(descriptors)?;
        let filled = {
            let _timed = AddElapsed::start(&self.prepare_ns);
            fill(&mut state, slab.columns(), sizing)
        };
        let prepared = match filled {
            Ok(p) => p,
            Err(e) => {
                // Never issued: the slab goes straight home.
                self.pool.release(slab);
                return Err(e);
            }
        };
        slab.set_len(prepared.len);
        let plan = match route {
            Plan::Pages(None) => Plan::Pages(None),
            Plan::Pages(Some((below, launch))) => {
                // Every descriptor small (the usual KV-cache case): no partition pass.
                let (len, max_size, alignment) = if prepared.max_size < below {
                    (prepared.len, prepared.max_size, prepared.alignment)
                } else {
                    partition_small(slab.columns(), prepared.len, below)
                };
                let batch = KernelBatch {
                    src: slab.column_addr(0),
                    dst: slab.column_addr(1),
                    size: slab.column_addr(2),
                    len,
                    max_size,
                    alignment,
                    stream: 0,
                };
                Plan::Pages((len > 0).then_some((batch, launch)))
            }
            Plan::Runs(()) => Plan::Runs(()),
            Plan::Staged(StagedRoute {
                kernel,
                direct,
                launch_bytes,
            }) => Plan::Staged(StagedRequest {
                rows: prepared.staged_rows,
                first_block: prepared.staged_blocks_at,
                blocks: prepared.staged_blocks,
                slot_bytes: self.config.stage_bytes,
                step_bytes: self.config.stage_step_bytes,
                kernel,
                direct,
                launch_bytes: launch_bytes.unwrap_or(u64::MAX),
            }),
        };
        let request = SubmitRequest { wait_stream, plan };
        let seq = lane.next_seq();
        let handle = slab.share();
        let record = InFlight {
            seq,
            job_id,
            bytes: prepared.bytes,
            submitted_at: Instant::now(),
            slab,
        };
        if let Err(record) = lane.push(record) {
            // Cannot happen: in_flight was checked under the same lock.
            self.pool.release(record.slab);
            return Err(EngineError::TooManyInFlight {
                direction,
                max: self.config.max_in_flight,
            });
        }
        // Under the submit lock still, which no other submit passes: the id checked above is
        // not live.
        self.live().insert(job_id, (direction, seq));
        let submitted = self.backend.submit(direction, seq, handle, request);
        timing.issued(submitted.is_ok());
        match submitted {
            Ok(Submitted::Ok | Submitted::CopyFailed) => Ok(()),
            Err(e) => {
                // Nothing can be promised about this lane any more: its transfers are reported
                // failed by the next poll, and later submits on it are refused.
                let _ = self.failed_lanes[direction.lane()].set(e);
                Ok(())
            }
        }
    }

    /// Appends the results of transfers finished since the last call. Lock-free, non-blocking.
    /// Appends nothing in a child forked after the engine was made: its transfers are the
    /// parent's, and the completion counters the backend reads may not be mapped here (CUDA's
    /// page-locked memory is not inherited across `fork`).
    pub fn get_finished(&self, out: &mut Vec<TransferResult>) {
        if self.forked() {
            return;
        }
        for direction in Direction::ALL {
            let lane = &self.lanes[direction.lane()];
            let completed = self.backend.completed(direction);
            lane.poll(completed, |record| {
                self.finish(direction, record, None, out);
            });
            if self.failed_lanes[direction.lane()].get().is_none() {
                if let Some(e) = self.backend.lane_error(direction) {
                    let _ = self.failed_lanes[direction.lane()].set(e);
                }
            }
            if let Some(e) = self.failed_lanes[direction.lane()].get() {
                lane.drain(|record| self.finish(direction, record, Some(e), out));
            }
        }
        self.unpark();
    }

    /// Brings home the parked slabs whose lane has completed past them.
    fn unpark(&self) {
        // Each parked slab is looked at once per call: those still held go back to the queue
        // (pollers racing here pop disjoint slabs).
        for _ in 0..self.parked.len() {
            let Some(p) = self.parked.pop() else { break };
            if p.seq <= self.backend.completed(p.direction) {
                self.pool.release(p.slab);
            } else {
                // Room: this call took it out. Were there none, the slab would be dropped, which
                // leaks it (a Slab has no Drop): the safe way out while the backend may read it.
                let _ = self.parked.push(p);
            }
        }
    }

    fn finish(
        &self,
        direction: Direction,
        record: InFlight,
        lane_error: Option<&BackendError>,
        out: &mut Vec<TransferResult>,
    ) {
        let error = match (record.slab.failure(), lane_error) {
            (Some(reason), _) => Some(reason.to_string()),
            (None, Some(e)) => Some(e.to_string()),
            (None, None) => None,
        };
        let ok = error.is_none();
        let nanos = match record.slab.device_ns() {
            0 => self
                .backend
                .device_ns(direction, record.seq)
                .unwrap_or_else(|| record.submitted_at.elapsed().as_nanos() as u64),
            ns => ns,
        };
        self.latency
            .transferred(direction, record.submitted_at.elapsed());
        let c = &self.counters[direction.lane()];
        // Relaxed: statistics only.
        c.transfers.fetch_add(1, Ordering::Relaxed);
        if ok {
            c.bytes.fetch_add(record.bytes, Ordering::Relaxed);
            c.nanos.fetch_add(nanos, Ordering::Relaxed);
        } else {
            c.failed.fetch_add(1, Ordering::Relaxed);
        }
        out.push(TransferResult {
            job_id: record.job_id,
            success: ok,
            bytes: record.bytes,
            seconds: nanos as f64 * 1e-9,
            error,
        });
        // Room is guaranteed: retired ids are a subset of live ids, which submit bounds.
        let _ = self.retired.push(record.job_id);
        // A slab goes home only once the backend no longer holds it: its lane completed past the
        // transfer. A record drained from a failed lane may still be held (a backend whose
        // `submit` failed, or that shutdown stopped waiting for, may still be issuing or running
        // its copies): its result is reported now, its slab waits.
        if record.seq <= self.backend.completed(direction) {
            self.pool.release(record.slab);
        } else {
            let parked = Parked {
                direction,
                seq: record.seq,
                slab: record.slab,
            };
            // The queue holds every record the lanes may have; were it full, the slab would be
            // dropped, which leaks it (a Slab has no Drop) rather than reusing it while read.
            let _ = self.parked.push(parked);
        }
    }

    /// Blocks until every listed job has finished (its result is still reported by
    /// `get_finished`). Ids that are not live are already finished. Polls as the backend's
    /// `wait` says (seen within about a microsecond of the copies' end for the first 20 ms).
    pub fn wait(&self, job_ids: &[JobId], timeout: Option<Duration>) -> Result<(), EngineError> {
        if self.forked() {
            return Err(BackendError::Forked.into());
        }
        let deadline = timeout.and_then(deadline);
        let targets: Vec<(JobId, Direction, u64)> = {
            let live = self.live();
            job_ids
                .iter()
                .filter_map(|id| live.get(id).map(|&(d, s)| (*id, d, s)))
                .collect()
        };
        let mut pending = vec![];
        for (id, direction, seq) in targets {
            if self.failed_lanes[direction.lane()].get().is_some() {
                continue;
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if !self.backend.wait(direction, seq, left)? {
                if let Some(e) = self.backend.lane_error(direction) {
                    let _ = self.failed_lanes[direction.lane()].set(e);
                    continue;
                }
                pending.push(id);
            }
        }
        if pending.is_empty() {
            Ok(())
        } else {
            Err(EngineError::Timeout { pending })
        }
    }

    /// Refuses new work, waits for transfers in flight (up to the configured timeout; past it
    /// they are failed), and stops the backend. Results stay available to `get_finished`.
    /// Idempotent and safe from any thread: a call while another is draining returns once that
    /// one is done. On an engine inherited across `fork` it only refuses new work: the
    /// transfers and the backend are the parent's, and a lock the parent held at the fork is
    /// never released here.
    pub fn shutdown(&self) {
        if self.forked() {
            self.shut.store(true, Ordering::Release);
            return;
        }
        // Poisoned only by a panic in a shutdown, which leaves nothing half-done to protect.
        let _shutting = self.shutting.locked();
        if self.shut.swap(true, Ordering::AcqRel) {
            return;
        }
        // Take the lock so no submit is half-way through.
        let _state = self.lock();
        let deadline = deadline(self.config.shutdown_timeout);
        for direction in Direction::ALL {
            if self.lane_failed(direction) {
                // Nothing on it will complete as asked: its transfers are reported failed
                // with the lane's error, and no timeout passed.
                continue;
            }
            let last = self.lanes[direction.lane()].next_seq() - 1;
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            // A wait the backend refuses (its lane failed) has nothing more to wait for: its
            // transfers are reported failed with its error, which is not a timeout.
            let Ok(reached) = self.backend.wait(direction, last, left) else {
                continue;
            };
            if reached || self.lane_failed(direction) {
                continue;
            }
            // Relaxed: a flag read by `stats` only, after `shutdown` returned.
            self.shutdown_timed_out.store(true, Ordering::Relaxed);
            let _ = self.failed_lanes[direction.lane()].set(BackendError::CopyFailed {
                index: None,
                reason: "still in flight when the engine shut down".into(),
            });
        }
        self.backend.shutdown(deadline);
    }

    /// Whether `direction`'s lane has failed, as the engine or its backend saw it.
    fn lane_failed(&self, direction: Direction) -> bool {
        if self.failed_lanes[direction.lane()].get().is_some() {
            return true;
        }
        match self.backend.lane_error(direction) {
            Some(e) => {
                let _ = self.failed_lanes[direction.lane()].set(e);
                true
            }
            None => false,
        }
    }

    pub fn is_shut_down(&self) -> bool {
        self.shut.load(Ordering::Acquire)
    }

    /// Per direction (indexed by `Direction::lane`): p50 and p99 of transfers' wall-clock time
    /// and of submissions' host time, refused and failed submissions.
    pub fn latency(&self) -> [LaneLatencyStats; 4] {
        self.latency.stats()
    }

    pub fn stats(&self) -> EngineStats {
        let lanes = std::array::from_fn(|i| {
            let c = &self.counters[i];
            LaneStats {
                transfers: c.transfers.load(Ordering::Relaxed),
                failed: c.failed.load(Ordering::Relaxed),
                bytes: c.bytes.load(Ordering::Relaxed),
                seconds: c.nanos.load(Ordering::Relaxed) as f64 * 1e-9,
            }
        });
        EngineStats {
            lanes,
            in_flight: self
                .lanes
                .iter()
                .map(super::completion::Lane::in_flight)
                .sum(),
            pool: self.pool.stats(),
            driver_ns: self.backend.driver_ns(),
            submit_ns: self.submit_ns.load(Ordering::Relaxed),
            prepare_ns: self.prepare_ns.load(Ordering::Relaxed),
            shutdown_timed_out: self.shutdown_timed_out.load(Ordering::Relaxed),
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
        if self.forked() {
            // The parent's memory and driver state are not ours to free: dropping a HostAlloc
            // frees nothing, so the buffers are simply left alone.
            return;
        }
        // Bring every completed slab home so the pool frees it.
        let mut sink = Vec::new();
        self.get_finished(&mut sink);
        // The parked ones too: the engine goes, so none is handed out again, and the pool frees
        // them through the backend, whose `free_host` keeps what its device may still read until
        // the device is done (the CUDA backend defers such frees; the host backend's worker has
        // stopped by now).
        while let Some(p) = self.parked.pop() {
            self.pool.release(p.slab);
        }
        let buffers = std::mem::take(&mut self.lock().buffers);
        let pinned = std::mem::take(&mut self.lock().pinned);
        let parts = std::mem::take(&mut self.lock().parts);
        let all_done = self.unfinished() == 0;
        if all_done {
            // Nothing in flight: the host buffers registered here may be unpinned now. Otherwise
            // this engine stays their user for the life of the process.
            for p in parts.into_values() {
                hostmem::release(&p.buffers);
            }
        }
        if all_done {
            for start in pinned {
                // SAFETY: nothing in flight; the engine is going away.
                let _ = unsafe { self.backend.unpin_host(start) };
            }
        }
        for (_, (alloc, id)) in buffers {
            let _ = hostmem::untrack(id, true);
            if all_done {
                // SAFETY: nothing is in flight and the engine is going away: no copy can touch it.
                unsafe { self.backend.free_host(alloc) };
            }
            // Otherwise a device that never finished may still write it: dropping a HostAlloc
            // frees nothing, so it is leaked rather than freed.
        }
    }
}
