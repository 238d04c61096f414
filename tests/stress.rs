//! Stress: random transfers through the engine on the host backend, from several threads that
//! submit and poll at once, every byte checked.
//!
//! Each submitting thread owns a few destination slots in host and in "device" memory (host memory
//! registered as device memory, as on any machine without a GPU) and keeps a transfer in flight per
//! slot: a random direction, batch (sizes from 1 byte to 8 KiB, runs contiguous in source and
//! destination so that they coalesce, destinations in ascending or shuffled order) or block-id
//! transfer, now and then with its small descriptors moved by a "kernel" launcher. Sources are
//! read-only patterns. Results are polled by every thread, submitting or not, and routed to the
//! owner, which checks the result is reported exactly once, compares the whole slot with what it
//! must hold (copied bytes, untouched poison in between), and poisons it again. Some transfers
//! fail on purpose (injected faults); they must be reported failed, once.
//!
//! At the end: no result lost or repeated, nothing left in flight, every slab back in the pool,
//! the engine's counters agree, sources unchanged and every destination byte back to poison.
//!
//! `cargo test` runs 20,000 transfers; `make stress-rust` runs 1,000,000 in release
//! (`STRESS_TRANSFERS` sets the number).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use blockswap::backend::host::HostBackend;
use blockswap::descriptor::Batch;
use blockswap::engine::{Engine, EngineConfig, EngineError, GroupIds};
use blockswap::kernel::{KernelBatch, PageKernel};
use blockswap::table::TableSpec;
use blockswap::{Backend, Direction, MemoryKind, TransferResult};

/// Threads that submit (and poll).
const SUBMITTERS: usize = 4;
/// Threads that only poll.
const POLLERS: usize = 2;
/// Transfers in flight per submitting thread: one per destination slot.
const WINDOW: usize = 8;
/// Bytes of a destination slot.
const SLOT: usize = 16 << 10;
/// Bytes of each source region.
const SRC: usize = 4 << 20;
/// Block size of the block-id transfers.
const BLOCK: usize = 256;
/// Every destination byte not written by a transfer in flight.
const POISON: u8 = 0xa5;
/// One transfer in this many is made to fail.
const FAIL_EVERY: u64 = 5_000;

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(131) ^ (i >> 8).wrapping_mul(7) ^ (i >> 16)) as u8
}

/// Heap memory used only through raw pointers: the copy worker writes it while test threads read
/// other parts of it, so no Rust reference to the whole buffer may exist.
struct Buffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a plain heap allocation; who touches which byte when is coordinated by the engine's
// completion (a slot is read only after its transfer's result was polled) and by slot ownership.
unsafe impl Send for Buffer {}
// SAFETY: as above.
unsafe impl Sync for Buffer {}

impl Buffer {
    fn new(len: usize, fill: impl Fn(usize) -> u8) -> Self {
        let v: Vec<u8> = (0..len).map(fill).collect();
        Buffer {
            ptr: Box::into_raw(v.into_boxed_slice()).cast::<u8>(),
            len,
        }
    }

    fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// # Safety
    /// Nothing may be writing `[off, off + len)` while the slice lives.
    unsafe fn slice(&self, off: usize, len: usize) -> &[u8] {
        assert!(off + len <= self.len);
        // SAFETY: in bounds; the caller rules out writers.
        unsafe { std::slice::from_raw_parts(self.ptr.add(off), len) }
    }

    /// # Safety
    /// Nothing else may touch `[off, off + len)` meanwhile.
    unsafe fn fill(&self, off: usize, len: usize, byte: u8) {
        assert!(off + len <= self.len);
        // SAFETY: in bounds; the caller owns the range.
        unsafe { std::ptr::write_bytes(self.ptr.add(off), byte, len) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: made by `Box::into_raw` of a boxed slice of this length.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}

/// splitmix64: small, fast, and seedable per thread.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

struct World {
    engine: Engine,
    host: Arc<HostBackend>,
    /// Sources and destinations by kind: index 0 host, 1 device.
    src: [Buffer; 2],
    dst: [Buffer; 2],
    /// Block tables: source tables by kind, destination tables by (thread, kind).
    src_tables: [u32; 2],
    dst_tables: Vec<[u32; 2]>,
    /// Each result's owner gets it through its channel.
    routes: Vec<Sender<TransferResult>>,
    results: AtomicU64,
    injected: AtomicU64,
    /// Transfers submitted by path (address batch, block ids, kernel-routed batch), and the
    /// descriptors (block pairs for block-id transfers) they carried.
    paths: [AtomicU64; 3],
    descriptors: AtomicU64,
}

fn kind_index(kind: MemoryKind) -> usize {
    match kind {
        MemoryKind::Host => 0,
        MemoryKind::Device => 1,
    }
}

/// A transfer in flight: where it writes and what the slot must hold once it is done.
struct Pending {
    slot: usize,
    kind: usize,
    bytes: u64,
    /// (offset in the slot, source kind, source offset, length) of every copied range.
    copies: Vec<(usize, usize, usize, usize)>,
}

impl World {
    fn new() -> Self {
        let host = Arc::new(HostBackend::new());
        let backend: Arc<dyn Backend> = host.clone();
        let engine = Engine::new(backend, EngineConfig::default());
        let src = [
            Buffer::new(SRC, pattern),
            Buffer::new(SRC, |i| pattern(i + 7)),
        ];
        let dst_len = SUBMITTERS * WINDOW * SLOT;
        let dst = [
            Buffer::new(dst_len, |_| POISON),
            Buffer::new(dst_len, |_| POISON),
        ];
        let kinds = [MemoryKind::Host, MemoryKind::Device];
        for k in 0..2 {
            // SAFETY: the buffers outlive the engine (fields dropped after it) and are never
            // resized.
            unsafe {
                engine
                    .register(src[k].addr(), SRC as u64, kinds[k])
                    .unwrap();
                engine
                    .register(dst[k].addr(), dst_len as u64, kinds[k])
                    .unwrap();
            }
        }
        let table = |base: u64, blocks: usize, kind| {
            engine
                .register_table(TableSpec::new(
                    vec![base],
                    vec![BLOCK as u64],
                    vec![BLOCK as u64],
                    blocks as u64,
                    kind,
                ))
                .unwrap()
        };
        let src_tables = [0, 1].map(|k| table(src[k].addr(), SRC / BLOCK, kinds[k]));
        let area = WINDOW * SLOT;
        let dst_tables = (0..SUBMITTERS)
            .map(|t| {
                [0, 1].map(|k| table(dst[k].addr() + (t * area) as u64, area / BLOCK, kinds[k]))
            })
            .collect();
        World {
            engine,
            host,
            src,
            dst,
            src_tables,
            dst_tables,
            routes: vec![],
            results: AtomicU64::new(0),
            injected: AtomicU64::new(0),
            paths: Default::default(),
            descriptors: AtomicU64::new(0),
        }
    }

    /// Polls once and routes what finished to its owners. Returns how many results came.
    fn poll(&self, buf: &mut Vec<TransferResult>) -> usize {
        buf.clear();
        self.engine.get_finished(buf);
        let n = buf.len();
        self.results.fetch_add(n as u64, Ordering::Relaxed);
        for r in buf.drain(..) {
            // A thread that failed a check is gone; its results go nowhere.
            let _ = self.routes[(r.job_id >> 32) as usize].send(r);
        }
        n
    }

    fn slot_offset(thread: usize, slot: usize) -> usize {
        (thread * WINDOW + slot) * SLOT
    }
}

/// The "kernel" of routed transfers: copies descriptors `[0, len)` reading the slab in place.
#[allow(clippy::unnecessary_wraps)] // a launcher's signature: a real one may fail
fn kernel(b: KernelBatch) -> Result<(), String> {
    for i in 0..b.len {
        // SAFETY: the engine hands the launcher the slab's columns, valid for `len` entries, and
        // ranges it checked against registered memory; the host backend runs the launcher before
        // the worker touches the transfer.
        unsafe {
            let s = *(b.src as *const u64).add(i);
            let d = *(b.dst as *const u64).add(i);
            let z = *(b.size as *const u64).add(i);
            std::ptr::copy_nonoverlapping(s as *const u8, d as *mut u8, z as usize);
        }
    }
    Ok(())
}

/// Submits one random transfer into `slot` of `thread`. `Ok(None)`: the engine is busy (too many
/// in flight, or the pool is full): poll and try again.
fn submit(
    w: &World,
    thread: usize,
    slot: usize,
    job_id: u64,
    rng: &mut Rng,
) -> Result<Option<Pending>, EngineError> {
    let direction = Direction::ALL[rng.below(4) as usize];
    let (sk, dk) = (
        kind_index(direction.src_kind()),
        kind_index(direction.dst_kind()),
    );
    let base = World::slot_offset(thread, slot);
    let mut copies = vec![];
    let mut path = 0;
    let result = if rng.chance(20) {
        path = 1;
        // By block ids: a run of slot blocks (consecutive or scattered) from random source blocks.
        let slot_blocks = SLOT / BLOCK;
        let k = 1 + rng.below(32) as usize;
        // The thread's table covers its slots; this slot's blocks start here.
        let first = slot * slot_blocks;
        let mut dst_ids: Vec<u64> = if rng.chance(50) {
            let start = rng.below((slot_blocks - k + 1) as u64) as usize;
            (start..start + k).map(|b| (first + b) as u64).collect()
        } else {
            let mut all: Vec<usize> = (0..slot_blocks).collect();
            for i in 0..k {
                let j = i + rng.below((slot_blocks - i) as u64) as usize;
                all.swap(i, j);
            }
            all[..k].iter().map(|&b| (first + b) as u64).collect()
        };
        dst_ids.truncate(k);
        let mut src_ids = Vec::with_capacity(k);
        for i in 0..k {
            let id = if i > 0 && rng.chance(60) {
                (src_ids[i - 1] + 1) % (SRC / BLOCK) as u64
            } else {
                rng.below((SRC / BLOCK) as u64)
            };
            src_ids.push(id);
        }
        for (s, d) in src_ids.iter().zip(&dst_ids) {
            let off = (*d as usize - first) * BLOCK;
            copies.push((off, sk, *s as usize * BLOCK, BLOCK));
        }
        w.engine.submit_blocks(
            job_id,
            GroupIds::blocks(
                w.src_tables[sk],
                &src_ids,
                w.dst_tables[thread][dk],
                &dst_ids,
            ),
            direction,
            None,
            None,
        )
    } else {
        let n = if rng.chance(5) {
            1 + rng.below(200)
        } else {
            1 + rng.below(16)
        } as usize;
        let mut at = 0usize;
        let mut src_at = rng.below(SRC as u64) as usize;
        for _ in 0..n {
            let size = match rng.below(100) {
                0..=69 => 1 + rng.below(256),
                70..=94 => 257 + rng.below(1792),
                _ => 2049 + rng.below(6144),
            } as usize;
            let gap = if rng.chance(50) {
                0
            } else {
                1 + rng.below(64) as usize
            };
            if at + gap + size > SLOT {
                break;
            }
            at += gap;
            if !rng.chance(50) || src_at + size > SRC {
                src_at = rng.below((SRC - size) as u64) as usize;
            }
            copies.push((at, sk, src_at, size));
            at += size;
            src_at += size;
        }
        if copies.is_empty() {
            copies.push((0, sk, 0, 1));
        }
        if rng.chance(20) {
            // Destinations out of order: the overlap check sorts.
            for i in (1..copies.len()).rev() {
                let j = rng.below(i as u64 + 1) as usize;
                copies.swap(i, j);
            }
        }
        let src: Vec<u64> = copies
            .iter()
            .map(|c| w.src[c.1].addr() + c.2 as u64)
            .collect();
        let dst: Vec<u64> = copies
            .iter()
            .map(|c| w.dst[dk].addr() + (base + c.0) as u64)
            .collect();
        let size: Vec<u64> = copies.iter().map(|c| c.3 as u64).collect();
        if rng.chance(2) {
            path = 2;
            w.engine.submit_routed(
                job_id,
                Batch {
                    src: &src,
                    dst: &dst,
                    size: &size,
                },
                direction,
                None,
                Some((1024, PageKernel::Launcher(&kernel))),
            )
        } else {
            w.engine.submit(job_id, &src, &dst, &size, direction, None)
        }
    };
    match result {
        Ok(()) => {
            w.paths[path].fetch_add(1, Ordering::Relaxed);
            w.descriptors
                .fetch_add(copies.len() as u64, Ordering::Relaxed);
            Ok(Some(Pending {
                slot,
                kind: dk,
                bytes: copies.iter().map(|c| c.3 as u64).sum(),
                copies,
            }))
        }
        Err(
            EngineError::TooManyInFlight { .. }
            | EngineError::Pool(blockswap::pool::PoolError::Exhausted { .. }),
        ) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Checks a finished transfer's slot byte by byte, then poisons it again.
fn check(w: &World, thread: usize, p: &Pending, r: &TransferResult, image: &mut [u8]) -> bool {
    let (buffer, at) = (&w.dst[p.kind], World::slot_offset(thread, p.slot));
    // SAFETY: the transfer writing this slot has completed (its result was polled), and the slot
    // belongs to this thread until it submits into it again.
    let slot = unsafe { buffer.slice(at, SLOT) };
    assert_eq!(r.bytes, p.bytes, "job {:#x}: bytes", r.job_id);
    if !r.success {
        let why = r.error.as_deref().unwrap_or("");
        assert!(
            why.contains("injected"),
            "job {:#x} failed: {why}",
            r.job_id
        );
        // SAFETY: as above.
        unsafe { buffer.fill(at, SLOT, POISON) };
        return false;
    }
    image.fill(POISON);
    for &(off, sk, src_off, len) in &p.copies {
        // SAFETY: sources are never written.
        image[off..off + len].copy_from_slice(unsafe { w.src[sk].slice(src_off, len) });
    }
    if slot != image {
        let first = (0..SLOT).find(|&i| slot[i] != image[i]).unwrap();
        panic!(
            "job {:#x}: slot byte {first} is {:#x}, expected {:#x}",
            r.job_id, slot[first], image[first]
        );
    }
    // SAFETY: as above.
    unsafe { buffer.fill(at, SLOT, POISON) };
    true
}

fn submitter(w: &World, thread: usize, quota: u64, rx: Receiver<TransferResult>) -> (u64, u64) {
    let mut rng = Rng(0x5eed ^ (thread as u64) << 20);
    let mut pending: HashMap<u64, Pending> = HashMap::new();
    let mut free: Vec<usize> = (0..WINDOW).rev().collect();
    let mut generation = [0u64; WINDOW];
    let mut injected_at = None;
    let (mut submitted, mut ok, mut failed) = (0u64, 0u64, 0u64);
    let mut image = vec![0u8; SLOT];
    let mut buf = Vec::new();
    while submitted < quota || !pending.is_empty() {
        while submitted < quota {
            let Some(&slot) = free.last() else { break };
            // Job ids are reused: (thread, slot, generation), so an id comes back once its
            // result has been reported.
            let job_id = (thread as u64) << 32 | (generation[slot] % 4) << 8 | slot as u64;
            if thread == 0
                && submitted % FAIL_EVERY == FAIL_EVERY - 1
                && injected_at != Some(submitted)
            {
                injected_at = Some(submitted);
                w.host.inject_failures(1);
                w.injected.fetch_add(1, Ordering::Relaxed);
            }
            match submit(w, thread, slot, job_id, &mut rng).unwrap() {
                Some(p) => {
                    free.pop();
                    generation[slot] += 1;
                    assert!(pending.insert(job_id, p).is_none());
                    submitted += 1;
                }
                None => break,
            }
        }
        let mut progressed = w.poll(&mut buf) > 0;
        while let Ok(r) = rx.try_recv() {
            progressed = true;
            let p = pending
                .remove(&r.job_id)
                .unwrap_or_else(|| panic!("job {:#x} reported twice or never submitted", r.job_id));
            if check(w, thread, &p, &r, &mut image) {
                ok += 1;
            } else {
                failed += 1;
            }
            free.push(p.slot);
        }
        if !progressed && !pending.is_empty() {
            if rng.chance(10) {
                // Block (without spinning) on one of ours, then poll again.
                let id = *pending.keys().next().unwrap();
                w.engine.wait(&[id], Some(Duration::from_secs(30))).unwrap();
            } else {
                std::thread::yield_now();
            }
        }
    }
    (ok, failed)
}

fn run(transfers: u64) {
    let mut world = World::new();
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..SUBMITTERS)
        .map(|_| crossbeam_channel::unbounded())
        .unzip();
    world.routes = txs;
    let w = &world;
    let stop = AtomicBool::new(false);
    let start = Instant::now();
    let per = transfers / SUBMITTERS as u64;
    let (ok, failed) = std::thread::scope(|s| {
        let pollers: Vec<_> = (0..POLLERS)
            .map(|_| {
                s.spawn(|| {
                    let mut buf = Vec::new();
                    while !stop.load(Ordering::Acquire) {
                        if w.poll(&mut buf) == 0 {
                            std::thread::yield_now();
                        }
                    }
                })
            })
            .collect();
        let workers: Vec<_> = rxs
            .into_iter()
            .enumerate()
            .map(|(t, rx)| {
                let quota = per + u64::from(t == 0) * (transfers % SUBMITTERS as u64);
                s.spawn(move || submitter(w, t, quota, rx))
            })
            .collect();
        // Joined before anything is unwrapped: a failed check stops the pollers too.
        let outcomes: Vec<_> = workers
            .into_iter()
            .map(std::thread::ScopedJoinHandle::join)
            .collect();
        stop.store(true, Ordering::Release);
        for p in pollers {
            p.join().unwrap();
        }
        outcomes.into_iter().fold((0, 0), |a, o| match o {
            Ok(b) => (a.0 + b.0, a.1 + b.1),
            Err(panic) => std::panic::resume_unwind(panic),
        })
    });
    let elapsed = start.elapsed();

    assert_eq!(ok + failed, transfers, "every transfer reported");
    assert_eq!(
        w.results.load(Ordering::Relaxed),
        transfers,
        "and only once"
    );
    let mut more = Vec::new();
    w.engine.get_finished(&mut more);
    assert!(more.is_empty(), "nothing left to report");
    let stats = w.engine.stats();
    assert_eq!(stats.in_flight, 0);
    assert_eq!(
        stats.pool.free, stats.pool.slabs,
        "every slab back in the pool"
    );
    let lanes = stats.lanes.iter().fold((0, 0, 0), |a, l| {
        (a.0 + l.transfers, a.1 + l.failed, a.2 + l.bytes)
    });
    assert_eq!((lanes.0, lanes.1), (transfers, failed));
    // Injected faults hit whichever transfer the worker copies next; all were used up unless
    // the last ones came after the final transfer.
    assert!(failed <= w.injected.load(Ordering::Relaxed));
    assert!(failed + 1 >= w.injected.load(Ordering::Relaxed));
    for k in 0..2 {
        // SAFETY: nothing is in flight any more.
        let src = unsafe { w.src[k].slice(0, SRC) };
        assert!(
            src.iter()
                .enumerate()
                .all(|(i, &b)| b == pattern(i + 7 * k)),
            "a source changed"
        );
        // SAFETY: as above.
        let dst = unsafe { w.dst[k].slice(0, w.dst[k].len) };
        assert!(dst.iter().all(|&b| b == POISON), "a stray write");
    }
    let paths = w.paths.each_ref().map(|p| p.load(Ordering::Relaxed));
    let directions = stats.lanes.each_ref().map(|l| l.transfers);
    println!(
        "stress: {transfers} transfers ({failed} failed on purpose), {} descriptors, {:.2} GB \
         in {:.2?}: {:.0} transfers/s; {SUBMITTERS} submitting and {POLLERS} polling threads; \
         {} address batches, {} block-id, {} kernel-routed; h2d/d2h/h2h/d2d {directions:?}",
        w.descriptors.load(Ordering::Relaxed),
        lanes.2 as f64 / 1e9,
        elapsed,
        transfers as f64 / elapsed.as_secs_f64(),
        paths[0],
        paths[1],
        paths[2],
    );
    drop(world);
}

#[test]
fn stress_short() {
    run(20_000);
}

/// `make stress-rust`: a million transfers (or `STRESS_TRANSFERS`), in release.
#[test]
#[ignore = "a million transfers: `make stress-rust`"]
fn stress_long() {
    let n = std::env::var("STRESS_TRANSFERS")
        .ok()
        .map_or(1_000_000, |v| {
            v.parse().expect("STRESS_TRANSFERS is a number")
        });
    run(n);
}
