//! A backend that fails while it still holds earlier transfers: their slabs stay out of the pool
//! until the backend completes past them, and shutdown does not call a failed lane a timeout.
//! A host backend whose worker panics fails its lanes rather than leaving waits hanging.

// `config` and `engine_with` are used here.
#[allow(dead_code)]
mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blockswap::backend::host::HostBackend;
use blockswap::backend::{HostAlloc, SubmitRequest, Submitted};
use blockswap::engine::{Engine, EngineConfig, EngineError};
use blockswap::slab::SlabRef;
use blockswap::{Backend, BackendError, BackendInfo, Direction, MemoryKind, TransferResult};

/// Holds every transfer it is given (copies nothing, completes nothing until `complete` says
/// so) and refuses the submission of sequence number `fail_seq` of the host-to-device lane, as a
/// driver error would.
#[derive(Debug)]
struct Holding {
    host: HostBackend,
    fail_seq: u64,
    completed: [AtomicU64; 4],
    /// The slab (its first column's address) of each transfer, by lane and sequence number.
    slabs: Mutex<Vec<(Direction, u64, u64)>>,
}

impl Holding {
    fn new(fail_seq: u64) -> Self {
        Holding {
            host: HostBackend::new(),
            fail_seq,
            completed: Default::default(),
            slabs: Mutex::new(Vec::new()),
        }
    }

    fn slab_of(&self, lane: Direction, seq: u64) -> u64 {
        let slabs = self.slabs.lock().unwrap();
        slabs
            .iter()
            .find(|&&(l, s, _)| l == lane && s == seq)
            .map(|&(_, _, a)| a)
            .expect("submitted")
    }

    fn complete(&self, lane: Direction, seq: u64) {
        self.completed[lane.lane()].store(seq, Ordering::Release);
    }
}

impl Backend for Holding {
    fn info(&self) -> BackendInfo {
        self.host.info()
    }
    fn check_region(&self, _start: u64, _len: u64, _kind: MemoryKind) -> Result<(), BackendError> {
        Ok(())
    }
    fn alloc_host(&self, bytes: usize) -> Result<HostAlloc, BackendError> {
        self.host.alloc_host(bytes)
    }
    unsafe fn free_host(&self, alloc: HostAlloc) {
        // SAFETY: forwarded from our caller.
        unsafe { self.host.free_host(alloc) }
    }
    fn submit(
        &self,
        lane: Direction,
        seq: u64,
        slab: SlabRef,
        _request: SubmitRequest<'_>,
    ) -> Result<Submitted, BackendError> {
        // SAFETY: inside the in-flight window of `slab` (this call).
        let addr = unsafe { slab.get() }.column_addr(0);
        self.slabs.lock().unwrap().push((lane, seq, addr));
        if lane == Direction::HostToDevice && seq == self.fail_seq {
            return Err(BackendError::Unavailable("injected submit failure".into()));
        }
        Ok(Submitted::Ok)
    }
    fn completed(&self, lane: Direction) -> u64 {
        self.completed[lane.lane()].load(Ordering::Acquire)
    }
    fn wait(
        &self,
        lane: Direction,
        seq: u64,
        timeout: Option<Duration>,
    ) -> Result<bool, BackendError> {
        let end = Instant::now() + timeout.unwrap_or(Duration::from_secs(5));
        while self.completed(lane) < seq {
            if Instant::now() >= end {
                return Ok(false);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(true)
    }
    fn inject_failures(&self, _count: u64) {}
    fn shutdown(&self, _deadline: Option<Instant>) -> u64 {
        0
    }
}

struct Setup {
    engine: Engine,
    backend: Arc<Holding>,
    src: Vec<u8>,
    dst: Vec<u8>,
}

fn setup(fail_seq: u64, shutdown_timeout: Duration) -> Setup {
    let backend = Arc::new(Holding::new(fail_seq));
    let config = EngineConfig {
        shutdown_timeout,
        // Small rings: Miri builds every slot of them (and of the pool, which `config` sizes).
        max_in_flight: 16,
        ..common::config()
    };
    let engine = Engine::new(backend.clone(), config);
    let (src, mut dst) = (vec![1u8; 1 << 16], vec![0u8; 1 << 16]);
    // SAFETY: both vectors outlive the engine (the engine is dropped first in every test: it is
    // the first field of Setup) and are never resized.
    unsafe {
        engine
            .register(src.as_ptr() as u64, src.len() as u64, MemoryKind::Host)
            .unwrap();
        engine
            .register(
                dst.as_mut_ptr() as u64,
                dst.len() as u64,
                MemoryKind::Device,
            )
            .unwrap();
    }
    Setup {
        engine,
        backend,
        src,
        dst,
    }
}

fn submit(s: &Setup, job: u64, direction: Direction) {
    let (from, to) = match direction {
        Direction::HostToDevice => (s.src.as_ptr() as u64, s.dst.as_ptr() as u64),
        _ => (s.dst.as_ptr() as u64, s.src.as_ptr() as u64),
    };
    let at = (job % 8) * 4096;
    s.engine
        .submit(job, &[from + at], &[to + at], &[4096], direction, None)
        .unwrap();
}

fn poll(engine: &Engine) -> Vec<TransferResult> {
    let mut out = Vec::new();
    engine.get_finished(&mut out);
    out
}

#[test]
fn a_failed_lane_keeps_the_slabs_its_backend_still_holds() {
    let s = setup(2, Duration::from_secs(1));
    submit(&s, 1, Direction::HostToDevice); // held by the backend
    submit(&s, 2, Direction::HostToDevice); // the backend's submit fails: the lane fails
    let results = poll(&s.engine);
    let mut ids: Vec<(u64, bool)> = results.iter().map(|r| (r.job_id, r.success)).collect();
    ids.sort_unstable();
    assert_eq!(ids, [(1, false), (2, false)], "both reported, failed, once");
    assert!(poll(&s.engine).is_empty());
    let held = s.backend.slab_of(Direction::HostToDevice, 1);
    // Another lane's transfer must not be given the slab the backend still reads.
    submit(&s, 3, Direction::DeviceToHost);
    assert_ne!(s.backend.slab_of(Direction::DeviceToHost, 1), held);
    assert_eq!(s.engine.stats().pool.free, 0, "no slab at home yet");
    // Once the backend completes past the held transfers, their slabs come home.
    s.backend.complete(Direction::HostToDevice, 2);
    s.backend.complete(Direction::DeviceToHost, 1);
    let results = poll(&s.engine);
    assert_eq!(results.len(), 1);
    assert_eq!((results[0].job_id, results[0].success), (3, true));
    let stats = s.engine.stats();
    assert_eq!(
        stats.pool.free, stats.pool.slabs,
        "every slab home: {stats:?}"
    );
    assert_eq!(stats.pool.slabs, 3);
}

#[test]
fn a_slab_the_backend_never_releases_is_never_reused() {
    let s = setup(2, Duration::from_secs(1));
    submit(&s, 1, Direction::HostToDevice);
    submit(&s, 2, Direction::HostToDevice);
    assert_eq!(poll(&s.engine).len(), 2);
    let held = s.backend.slab_of(Direction::HostToDevice, 1);
    let rounds = if cfg!(miri) { 4 } else { 30 };
    for job in 10..10 + rounds {
        submit(&s, job, Direction::DeviceToHost);
        let seq = job - 9;
        assert_ne!(s.backend.slab_of(Direction::DeviceToHost, seq), held);
        s.backend.complete(Direction::DeviceToHost, seq);
        assert_eq!(poll(&s.engine).len(), 1);
    }
}

#[test]
fn shutdown_with_a_failed_lane_is_not_a_timeout() {
    let s = setup(1, common::secs(30));
    submit(&s, 1, Direction::HostToDevice); // fails the lane at once
    let start = Instant::now();
    s.engine.shutdown();
    assert!(
        start.elapsed() < common::secs(10),
        "shutdown waited for a lane that had failed"
    );
    assert!(!s.engine.stats().shutdown_timed_out);
    let results = poll(&s.engine);
    assert_eq!(results.len(), 1);
    assert!(!results[0].success);
}

#[test]
fn shutdown_past_its_timeout_says_so_and_keeps_the_slab() {
    let s = setup(u64::MAX, Duration::from_millis(50));
    submit(&s, 1, Direction::HostToDevice); // held past the timeout
    s.engine.shutdown();
    assert!(s.engine.stats().shutdown_timed_out);
    let results = poll(&s.engine);
    assert_eq!((results.len(), results[0].success), (1, false));
    assert_eq!(s.engine.stats().pool.free, 0, "the held slab stays out");
}

#[test]
fn a_block_table_is_not_removed_under_a_transfer_and_says_which() {
    let s = setup(u64::MAX, Duration::from_secs(1));
    let src = s.src.as_ptr() as u64;
    let table = s
        .engine
        .register_table(blockswap::table::TableSpec::new(
            vec![src],
            vec![4096],
            vec![4096],
            4,
            MemoryKind::Host,
        ))
        .unwrap();
    submit(&s, 1, Direction::HostToDevice); // held in flight
    let e = s.engine.unregister_table(table).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("block table {table} cannot be removed while 1 transfers are in flight")
    );
    s.backend.complete(Direction::HostToDevice, 1);
    assert_eq!(poll(&s.engine).len(), 1);
    s.engine.unregister_table(table).unwrap();
}

#[test]
fn wait_keeps_its_timeout_and_a_second_shutdown_waits_while_one_drains() {
    let s = setup(u64::MAX, common::secs(60));
    submit(&s, 1, Direction::HostToDevice); // held until completed below
    let ended = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for name in ["first", "second"] {
            let (engine, ended) = (&s.engine, &ended);
            scope.spawn(move || {
                engine.shutdown();
                ended.lock().unwrap().push((name, Instant::now()));
            });
        }
        // The first shutdown drains with the submit lock held; a wait for the transfer keeps
        // its own timeout, and neither shutdown returns while the transfer is held.
        std::thread::sleep(Duration::from_millis(50));
        let start = Instant::now();
        let waited = s.engine.wait(&[1], Some(Duration::from_millis(20)));
        assert!(
            matches!(waited, Err(blockswap::engine::EngineError::Timeout { .. })),
            "{waited:?}"
        );
        assert!(
            start.elapsed() < common::secs(30),
            "wait queued behind the drain"
        );
        assert!(
            ended.lock().unwrap().is_empty(),
            "a shutdown returned before the drain"
        );
        let completed = Instant::now();
        s.backend.complete(Direction::HostToDevice, 1);
        // Both return after the transfer completed.
        while ended.lock().unwrap().len() < 2 {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(ended.lock().unwrap().iter().all(|&(_, at)| at >= completed));
    });
    assert!(!s.engine.stats().shutdown_timed_out);
    let results = poll(&s.engine);
    assert_eq!((results.len(), results[0].success), (1, true));
}

/// 16 KiB of sevens to copy into 16 KiB of zeros, for the worker-panic tests.
fn sevens() -> common::Buffers {
    common::Buffers {
        src: vec![7u8; 1 << 14],
        dst: vec![0u8; 1 << 14],
    }
}

#[test]
fn a_worker_that_panics_fails_its_transfers_and_never_leaves_a_wait_hanging() {
    let mut bufs = sevens();
    let (engine, host) = common::engine_with(&mut bufs, common::config());
    let engine = Arc::new(engine);
    let (s, d) = (bufs.src.as_ptr() as u64, bufs.dst.as_ptr() as u64);
    engine
        .submit(1, &[s], &[d], &[4096], Direction::HostToDevice, None)
        .unwrap();
    engine.wait(&[1], None).unwrap();
    host.inject_worker_panic();
    engine
        .submit(2, &[s], &[d + 4096], &[4096], Direction::HostToDevice, None)
        .unwrap();
    // A wait with no timeout returns: nothing will copy the transfer, and the lane says why.
    // (On its own thread, so that a wait that hangs fails the test rather than hangs it.)
    let (tx, rx) = std::sync::mpsc::channel();
    let other = Arc::clone(&engine);
    let waiting = std::thread::spawn(move || tx.send(other.wait(&[2], None)).unwrap());
    let answer = rx.recv_timeout(common::secs(30)).expect("wait returned");
    assert!(answer.is_ok(), "{answer:?}");
    waiting.join().unwrap(); // its reference to the engine is gone
    let mut results = poll(&engine);
    results.sort_by_key(|r| r.job_id);
    assert_eq!(results.len(), 2, "{results:?}");
    assert!(results[0].success, "{:?}", results[0]);
    let error = results[1].error.as_deref().unwrap_or("");
    assert!(
        !results[1].success && error.contains("a panic injected into the host backend's worker"),
        "{:?}",
        results[1]
    );
    // Every later transfer, either way, is refused with the same reason.
    for direction in [Direction::HostToDevice, Direction::DeviceToHost] {
        let (from, to) = match direction {
            Direction::HostToDevice => (s, d),
            _ => (d, s),
        };
        let refused = engine.submit(3, &[from], &[to], &[64], direction, None);
        assert!(
            refused
                .as_ref()
                .is_err_and(|e| e.to_string().contains("worker stopped")),
            "{refused:?}"
        );
    }
    engine.shutdown();
    assert!(!engine.stats().shutdown_timed_out);
    drop(Arc::into_inner(engine).expect("the last reference"));
    assert_eq!(bufs.dst[..4096], [7u8; 4096]);
}

#[test]
fn submitters_racing_a_worker_panic_each_end_with_its_refusal_and_lose_no_result() {
    let mut bufs = sevens();
    let (engine, host) = common::engine_with(&mut bufs, common::config());
    let (s, d) = (bufs.src.as_ptr() as u64, bufs.dst.as_ptr() as u64);
    let accepted = Mutex::new(Vec::new());
    let reported = Mutex::new(Vec::new());
    // Two threads submit, one each way, polling as they go, while the worker is made to panic
    // part-way: each ends with the lane's refusal, and every transfer accepted is reported once.
    std::thread::scope(|scope| {
        for (t, direction) in [Direction::HostToDevice, Direction::DeviceToHost]
            .into_iter()
            .enumerate()
        {
            let (engine, host, accepted, reported) = (&engine, &host, &accepted, &reported);
            scope.spawn(move || {
                let (from, to) = match direction {
                    Direction::HostToDevice => (s, d),
                    _ => (d, s),
                };
                let deadline = Instant::now() + common::secs(30);
                for i in 0u64.. {
                    assert!(
                        Instant::now() < deadline,
                        "{direction:?}: still accepting after {:?}",
                        common::secs(30)
                    );
                    if t == 0 && i == 20 {
                        host.inject_worker_panic();
                    }
                    let job = 2 * i + t as u64;
                    let at = (i % 4) * 4096;
                    match engine.submit(job, &[from + at], &[to + at], &[64], direction, None) {
                        Ok(()) => accepted.lock().unwrap().push(job),
                        // Ahead of the worker (or of the other thread's polls), or the worker
                        // stopped but not yet said so: poll, let it run, go on.
                        Err(EngineError::TooManyInFlight { .. }) => std::thread::yield_now(),
                        Err(e) => {
                            assert!(e.to_string().contains("worker stopped"), "{e}");
                            return;
                        }
                    }
                    reported.lock().unwrap().extend(poll(engine));
                }
            });
        }
    });
    let mut accepted = accepted.into_inner().unwrap();
    engine
        .wait(&accepted, Some(common::secs(30)))
        .expect("nothing left waiting");
    let mut reported = reported.into_inner().unwrap();
    reported.extend(poll(&engine));
    let mut ids: Vec<u64> = reported.iter().map(|r| r.job_id).collect();
    ids.sort_unstable();
    accepted.sort_unstable();
    assert_eq!(ids, accepted, "each accepted transfer reported once");
    let failed: Vec<_> = reported.iter().filter(|r| !r.success).collect();
    assert!(!failed.is_empty());
    for r in failed {
        let error = r.error.as_deref().unwrap_or("");
        assert!(error.contains("a panic injected"), "{r:?}");
    }
    engine.shutdown();
    assert!(!engine.stats().shutdown_timed_out);
}
