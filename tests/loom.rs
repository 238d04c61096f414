//! Model checks of the lock-free completion lane and slab pool, under loom.
//!
//! `make loom` builds the crate with `--cfg loom`: `completion.rs` and `pool.rs` then run on loom's
//! atomics and a loom-visible stand-in for crossbeam's `ArrayQueue` (see `rust/sync.rs`), and each
//! model below is run once per distinct interleaving (and per value a weakly ordered load may
//! read) that loom's partial-order reduction finds, within a bound on preemptions
//! (`LOOM_MAX_PREEMPTIONS`, 3 unless set). A plain `cargo test` compiles this file to nothing.
//!
//! The backend's side of a lane is played by the test: it "runs" a transfer by writing into its
//! slab (the device time) and then publishes the lane's completed sequence number with a Release
//! store, as both real backends do.
//!
//! One limit of loom 0.7 shapes the models: its partial-order reduction remembers one last access
//! per atomic, so when a thread loads an atomic and then writes it (every compare-and-swap loop
//! does), an earlier load of that atomic by another thread is forgotten and never moved after
//! the write (tokio-rs/loom#166, #392). Loom's first schedule runs the main thread first, then
//! the spawned ones in spawn order. So the main thread here only sets up and joins, and threads
//! that only observe are spawned after the ones that write: their loads come last in the first
//! schedule, and loom moves each load before the stores it depends on, a dependency it tracks
//! exactly. Built the other way round, the `in_flight` and push models ran one execution and
//! missed the two bugs they now catch.
#![cfg(loom)]

use std::collections::BTreeMap;
use std::sync::atomic::AtomicUsize as StdAtomicUsize;
use std::sync::Arc as StdArc;
use std::time::Instant;

use loom::sync::atomic::{AtomicU64, Ordering};
use loom::sync::{Arc, Mutex};
use loom::thread;

use blockswap::backend::host::HostBackend;
use blockswap::completion::{InFlight, Lane};
use blockswap::pool::{Pool, PoolError, Slab, DESCRIPTOR_BYTES, MIN_CLASS};
use blockswap::Backend;

/// Bytes of one slab of the smallest class.
const SLAB: usize = DESCRIPTOR_BYTES << MIN_CLASS;

/// Where slabs come from. Only `alloc_host` and `free_host` are used (plain heap memory); one
/// backend serves every iteration.
fn backend() -> StdArc<dyn Backend> {
    static BACKEND: std::sync::OnceLock<StdArc<HostBackend>> = std::sync::OnceLock::new();
    BACKEND
        .get_or_init(|| StdArc::new(HostBackend::new()))
        .clone()
}

/// Runs `model` under loom and reports how many executions loom explored.
fn check(name: &str, model: impl Fn() + Sync + Send + 'static) {
    let runs = StdArc::new(StdAtomicUsize::new(0));
    let counted = runs.clone();
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(3);
    }
    let bound = builder.preemption_bound;
    let start = Instant::now();
    builder.check(move || {
        counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        model();
    });
    println!(
        "loom model {name}: {} executions explored (preemption bound {bound:?}) in {:.1?}",
        runs.load(std::sync::atomic::Ordering::Relaxed),
        start.elapsed()
    );
}

fn record(seq: u64, slab: Slab) -> InFlight {
    InFlight {
        seq,
        job_id: 100 + seq,
        bytes: seq,
        submitted_at: Instant::now(),
        slab,
    }
}

/// The device time the test backend writes into transfer `seq`'s slab before completing it.
fn device_ns(seq: u64) -> u64 {
    1000 * seq
}

/// A pool of four smallest slabs, a lane of `depth` records and its completed sequence number.
fn setup(depth: usize) -> (Arc<Pool>, Arc<Lane>, Arc<AtomicU64>) {
    (
        Arc::new(Pool::new(backend(), 4 * SLAB)),
        Arc::new(Lane::new(depth)),
        Arc::new(AtomicU64::new(0)),
    )
}

/// A thread running [`submit_and_complete`] for transfers `1..=n`.
fn spawn_publisher(
    pool: &Arc<Pool>,
    lane: &Arc<Lane>,
    completed: &Arc<AtomicU64>,
    n: u64,
) -> thread::JoinHandle<()> {
    let (pool, lane, completed) = (pool.clone(), lane.clone(), completed.clone());
    thread::spawn(move || submit_and_complete(&pool, &lane, &completed, n))
}

/// Submits transfers `1..=n` on `lane` and completes each one: the submit lock's side (slab,
/// record, push) and the backend's (write the slab, publish `completed`).
fn submit_and_complete(pool: &Pool, lane: &Lane, completed: &AtomicU64, n: u64) {
    for seq in 1..=n {
        assert_eq!(lane.next_seq(), seq);
        let slab = pool.acquire(1).expect("the pool has room for every record");
        let handle = slab.share();
        lane.push(record(seq, slab))
            .expect("the lane has room for every record");
        // SAFETY: the record keeps the slab in flight until a poll observes `completed >= seq`,
        // which only happens after the store below.
        unsafe { handle.get() }.set_device_ns(device_ns(seq));
        completed.store(seq, Ordering::Release);
    }
}

/// What a poller saw: every record it was handed, checked to be complete (its slab shows the
/// backend's writes, which happen before completion is published) and given back to the pool.
fn take(pool: &Pool, record: InFlight, seen: &mut Vec<u64>) {
    assert_eq!(
        record.slab.device_ns(),
        device_ns(record.seq),
        "record {} handed out before its completion was visible",
        record.seq
    );
    assert_eq!(record.job_id, 100 + record.seq);
    seen.push(record.seq);
    pool.release(record.slab);
}

/// Pollers racing the publisher and each other: every record is handed out exactly once, only
/// once complete, in order within one poll, and every slab comes home.
#[test]
fn pollers_racing_the_publisher_hand_out_each_record_once() {
    const N: u64 = 3;
    check("completion: 2 pollers racing the publisher", || {
        let (pool, lane, completed) = setup(N as usize);
        let publisher = spawn_publisher(&pool, &lane, &completed, N);
        let pollers: Vec<_> = (0..2)
            .map(|_| {
                let (pool, lane, completed) = (pool.clone(), lane.clone(), completed.clone());
                thread::spawn(move || {
                    let mut seen = vec![];
                    lane.poll(completed.load(Ordering::Acquire), |r| {
                        take(&pool, r, &mut seen)
                    });
                    assert!(seen.windows(2).all(|w| w[0] < w[1]), "one poll, in order");
                    seen
                })
            })
            .collect();
        publisher.join().unwrap();
        let mut seen: Vec<u64> = pollers
            .into_iter()
            .flat_map(|p| p.join().unwrap())
            .collect();
        lane.poll(completed.load(Ordering::Acquire), |r| {
            take(&pool, r, &mut seen)
        });
        seen.sort_unstable();
        assert_eq!(
            seen,
            (1..=N).collect::<Vec<_>>(),
            "each record exactly once"
        );
        assert_eq!(lane.in_flight(), 0);
        let stats = pool.stats();
        assert_eq!(stats.free, stats.slabs, "every slab came home");
    });
}

/// `in_flight` read while records are pushed, completed and claimed: it must stay within the
/// records pushed and not yet handed out (the engine's `stats` reads it without the submit lock).
#[test]
fn in_flight_stays_within_bounds_while_records_come_and_go() {
    const N: u64 = 2;
    check("completion: in_flight read during push and poll", || {
        let (pool, lane, completed) = setup(N as usize);
        let publisher = spawn_publisher(&pool, &lane, &completed, N);
        let poller = {
            let (pool, lane, completed) = (pool.clone(), lane.clone(), completed.clone());
            thread::spawn(move || {
                let mut seen = vec![];
                for _ in 0..2 {
                    lane.poll(completed.load(Ordering::Acquire), |r| {
                        take(&pool, r, &mut seen)
                    });
                }
                seen
            })
        };
        // Spawned last, so that loom's first schedule runs it last (see the file's comment).
        let observer = {
            let lane = lane.clone();
            thread::spawn(move || {
                let n = lane.in_flight();
                assert!(n <= N, "in_flight read {n} with at most {N} records pushed");
            })
        };
        publisher.join().unwrap();
        let mut seen = poller.join().unwrap();
        observer.join().unwrap();
        lane.poll(completed.load(Ordering::Acquire), |r| {
            take(&pool, r, &mut seen)
        });
        assert_eq!(seen, (1..=N).collect::<Vec<_>>());
    });
}

/// The engine pushes a record only after `in_flight() < capacity` under its submit lock. That
/// push must find room even while a poller has claimed records it has not popped yet: otherwise a
/// submission below the limit is refused.
#[test]
fn a_push_below_the_in_flight_limit_finds_room() {
    check("completion: push racing a poller's claim", || {
        let (pool, lane, completed) = setup(1);
        submit_and_complete(&pool, &lane, &completed, 1);
        let poller = {
            let (pool, lane, completed) = (pool.clone(), lane.clone(), completed.clone());
            thread::spawn(move || {
                let mut seen = vec![];
                lane.poll(completed.load(Ordering::Acquire), |r| {
                    take(&pool, r, &mut seen)
                });
                seen
            })
        };
        // The submit side: check the limit, then push (the engine holds its lock over both).
        let submitter = {
            let (pool, lane, completed) = (pool.clone(), lane.clone(), completed.clone());
            thread::spawn(move || {
                if lane.in_flight() >= 1 {
                    return false;
                }
                let slab = pool.acquire(1).unwrap();
                let handle = slab.share();
                if let Err(r) = lane.push(record(2, slab)) {
                    panic!(
                        "in_flight() was below the capacity, yet the push of {} failed",
                        r.seq
                    );
                }
                // SAFETY: as in `submit_and_complete`.
                unsafe { handle.get() }.set_device_ns(device_ns(2));
                completed.store(2, Ordering::Release);
                true
            })
        };
        let mut seen = poller.join().unwrap();
        let pushed = submitter.join().unwrap();
        lane.poll(completed.load(Ordering::Acquire), |r| {
            take(&pool, r, &mut seen)
        });
        seen.sort_unstable();
        assert_eq!(seen, (1..=1 + pushed as u64).collect::<Vec<_>>());
        assert_eq!(lane.in_flight(), 0);
    });
}

/// A lane whose backend failed: one thread polls the completed prefix while another drains
/// everything pushed (what two concurrent `get_finished` calls do). Each record still comes out
/// exactly once.
#[test]
fn draining_a_failed_lane_races_a_poll_without_loss_or_duplicates() {
    check("completion: drain racing poll", || {
        let (pool, lane, completed) = setup(3);
        submit_and_complete(&pool, &lane, &completed, 1);
        // Record 2 is pushed but never completes: the backend failed.
        lane.push(record(2, pool.acquire(1).unwrap())).unwrap();
        let seen = Arc::new(Mutex::new(vec![]));
        let spawn = |drain: bool| {
            let (pool, lane, completed, seen) =
                (pool.clone(), lane.clone(), completed.clone(), seen.clone());
            thread::spawn(move || {
                let on_done = |r: InFlight| {
                    seen.lock().unwrap().push(r.seq);
                    pool.release(r.slab);
                };
                if drain {
                    lane.drain(on_done)
                } else {
                    lane.poll(completed.load(Ordering::Acquire), on_done)
                }
            })
        };
        let (poller, drainer) = (spawn(false), spawn(true));
        poller.join().unwrap();
        drainer.join().unwrap();
        let mut seen = seen.lock().unwrap().clone();
        seen.sort_unstable();
        assert_eq!(seen, vec![1, 2]);
        assert_eq!(lane.in_flight(), 0);
        let stats = pool.stats();
        assert_eq!(stats.free, stats.slabs);
    });
}

/// Slabs handed out, by address: a second holder of one slab is caught at once.
struct Holders(Mutex<BTreeMap<u64, usize>>);

impl Holders {
    fn new() -> Self {
        Holders(Mutex::new(BTreeMap::new()))
    }

    fn hold(&self, slab: &Slab, who: usize) {
        let prev = self.0.lock().unwrap().insert(slab.column_addr(0), who);
        assert_eq!(prev, None, "slab handed out twice");
    }

    fn give_back(&self, slab: &Slab) {
        self.0.lock().unwrap().remove(&slab.column_addr(0));
    }
}

/// Acquire and release racing on a pool with room for two small slabs: no slab is ever held by
/// two threads, growth never passes the cap, a recycled slab carries nothing of its last
/// transfer, and afterwards every slab is home and the pool still serves up to its cap.
#[test]
fn pool_acquire_and_release_racing_never_hand_out_a_slab_twice() {
    check("pool: 2 threads acquiring and releasing", || {
        let pool = Arc::new(Pool::new(backend(), 2 * SLAB));
        let holders = Arc::new(Holders::new());
        let workers: Vec<_> = (0..2)
            .map(|who| {
                let (pool, holders) = (pool.clone(), holders.clone());
                thread::spawn(move || {
                    for round in 0..2 {
                        match pool.acquire(1 + 10 * who) {
                            Ok(slab) => {
                                holders.hold(&slab, who);
                                assert_eq!(slab.failure(), None, "a recycled slab forgot");
                                assert_eq!(slab.device_ns(), 0);
                                slab.set_failed(format!("{who}/{round}"));
                                slab.set_device_ns(7);
                                assert!(pool.stats().bytes <= 2 * SLAB, "past the cap");
                                holders.give_back(&slab);
                                pool.release(slab);
                            }
                            Err(PoolError::Exhausted { .. }) => {}
                            Err(e) => panic!("{e}"),
                        }
                    }
                })
            })
            .collect();
        workers.into_iter().for_each(|w| w.join().unwrap());
        let stats = pool.stats();
        assert_eq!(stats.free, stats.slabs, "every slab came home");
        assert_eq!(stats.bytes, stats.slabs * SLAB);
        assert!(stats.slabs <= 2);
        let a = pool.acquire(1).unwrap();
        let b = pool.acquire(1).unwrap();
        assert_ne!(a.column_addr(0), b.column_addr(0));
        assert!(matches!(pool.acquire(1), Err(PoolError::Exhausted { .. })));
        pool.release(a);
        pool.release(b);
    });
}

/// At the cap, a small request falls back to a free larger slab while another thread releases
/// and re-acquires it: still one holder per slab, and everything comes home.
#[test]
fn pool_fallback_to_a_larger_slab_races_its_owner() {
    check("pool: fallback to a larger class", || {
        // Room for exactly one slab of 512 descriptors.
        let pool = Arc::new(Pool::new(backend(), 2 * SLAB));
        let holders = Arc::new(Holders::new());
        let big = pool.acquire(512).unwrap();
        assert_eq!(big.capacity(), 512);
        let owner = {
            let (pool, holders) = (pool.clone(), holders.clone());
            thread::spawn(move || {
                holders.hold(&big, 0);
                holders.give_back(&big);
                pool.release(big);
                if let Ok(again) = pool.acquire(300) {
                    holders.hold(&again, 0);
                    holders.give_back(&again);
                    pool.release(again);
                }
            })
        };
        let small = {
            let (pool, holders) = (pool.clone(), holders.clone());
            thread::spawn(move || match pool.acquire(1) {
                Ok(slab) => {
                    holders.hold(&slab, 1);
                    holders.give_back(&slab);
                    pool.release(slab);
                }
                Err(PoolError::Exhausted { .. }) => {}
                Err(e) => panic!("{e}"),
            })
        };
        owner.join().unwrap();
        small.join().unwrap();
        let stats = pool.stats();
        assert_eq!((stats.slabs, stats.free), (1, 1));
    });
}
