//! Engine integration tests on the host backend: bytes, coalescing, results, refusals.

use std::sync::Arc;
use std::time::Duration;

use blockswap::backend::host::HostBackend;
use blockswap::engine::{Engine, EngineConfig, EngineError, GroupIds, Shape};
use blockswap::{Direction, MemoryKind, TransferResult};
use proptest::prelude::*;

struct Buffers {
    src: Vec<u8>,
    dst: Vec<u8>,
}

fn engine_with(buffers: &mut Buffers, config: EngineConfig) -> (Engine, Arc<HostBackend>) {
    let host = Arc::new(HostBackend::new());
    let engine = Engine::new(host.clone(), config);
    // SAFETY: both vectors outlive the engine in every test (dropped after it) and are not resized.
    unsafe {
        engine
            .register(
                buffers.src.as_ptr() as u64,
                buffers.src.len() as u64,
                MemoryKind::Host,
            )
            .unwrap();
        engine
            .register(
                buffers.dst.as_mut_ptr() as u64,
                buffers.dst.len() as u64,
                MemoryKind::Device,
            )
            .unwrap();
    }
    (engine, host)
}

fn finish(engine: &Engine, ids: &[u64]) -> Vec<TransferResult> {
    engine.wait(ids, Some(Duration::from_secs(30))).unwrap();
    let mut out = vec![];
    engine.get_finished(&mut out);
    out
}

fn checksum(b: &[u8]) -> u64 {
    // FNV-1a: order-sensitive, so a block landing in the wrong place changes it.
    b.iter().fold(0xcbf29ce484222325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x100000001b3)
    })
}

#[test]
fn scattered_blocks_arrive_with_matching_checksums() {
    // Miri interprets every byte: a smaller batch there, the same paths.
    let (n, block) = if cfg!(miri) { (48, 256) } else { (2560, 4096) };
    let mut b = Buffers {
        src: (0..2 * n * block)
            .map(|i| (i * 7 + i / 4096) as u8)
            .collect(),
        dst: vec![0; 2 * n * block],
    };
    let (engine, _) = engine_with(&mut b, EngineConfig::default());
    // A fixed permutation of source and destination blocks.
    let src_ids: Vec<usize> = (0..n).map(|i| (i * 769) % (2 * n)).collect();
    let dst_ids: Vec<usize> = (0..n).map(|i| (i * 1543 + 11) % (2 * n)).collect();
    let src: Vec<u64> = src_ids
        .iter()
        .map(|&i| b.src.as_ptr() as u64 + (i * block) as u64)
        .collect();
    let dst: Vec<u64> = dst_ids
        .iter()
        .map(|&i| b.dst.as_ptr() as u64 + (i * block) as u64)
        .collect();
    engine
        .submit(
            1,
            &src,
            &dst,
            &vec![block as u64; n],
            Direction::HostToDevice,
            None,
        )
        .unwrap();
    let results = finish(&engine, &[1]);
    assert_eq!(results.len(), 1);
    assert!(results[0].success);
    assert_eq!(results[0].bytes, (n * block) as u64);
    for (&s, &d) in src_ids.iter().zip(&dst_ids) {
        assert_eq!(
            checksum(&b.dst[d * block..(d + 1) * block]),
            checksum(&b.src[s * block..(s + 1) * block])
        );
    }
    drop(engine);
}

#[test]
fn failure_is_reported_once_and_the_lane_goes_on() {
    let mut b = Buffers {
        src: vec![1; 1 << 20],
        dst: vec![0; 1 << 20],
    };
    let (engine, _host) = engine_with(&mut b, EngineConfig::default());
    let (s, d) = (b.src.as_ptr() as u64, b.dst.as_ptr() as u64);
    engine.inject_failures(1);
    engine
        .submit(
            1,
            &[s, s + 4096],
            &[d, d + 8192],
            &[4096, 4096],
            Direction::HostToDevice,
            None,
        )
        .unwrap();
    engine
        .submit(
            2,
            &[s],
            &[d + 65536],
            &[4096],
            Direction::HostToDevice,
            None,
        )
        .unwrap();
    let results = finish(&engine, &[1, 2]);
    assert_eq!(
        results
            .iter()
            .map(|r| (r.job_id, r.success))
            .collect::<Vec<_>>(),
        [(1, false), (2, true)]
    );
    assert!(results[0]
        .error
        .as_deref()
        .unwrap()
        .contains("injected failure at descriptor 1"));
    let mut again = vec![];
    engine.get_finished(&mut again);
    assert!(again.is_empty(), "reported exactly once");
    let stats = engine.stats();
    assert_eq!(
        stats.pool.free, stats.pool.slabs,
        "every slab back in the pool"
    );
    drop(engine);
}

#[test]
#[cfg_attr(miri, ignore = "a 128 MiB copy takes hours under Miri")]
fn a_shutdown_past_its_timeout_says_so_in_stats() {
    let n = 128 << 20;
    let mut b = Buffers {
        src: vec![1; n],
        dst: vec![0; n],
    };
    let config = EngineConfig {
        shutdown_timeout: Duration::ZERO,
        ..EngineConfig::default()
    };
    let (engine, _host) = engine_with(&mut b, config);
    let (s, d) = (b.src.as_ptr() as u64, b.dst.as_ptr() as u64);
    // 128 MiB takes milliseconds to copy: still in flight when a zero timeout runs out.
    engine
        .submit(1, &[s], &[d], &[n as u64], Direction::HostToDevice, None)
        .unwrap();
    engine.shutdown();
    assert!(engine.stats().shutdown_timed_out);
    drop(engine);

    let (engine, _host) = engine_with(&mut b, EngineConfig::default());
    engine
        .submit(1, &[s], &[d], &[4096], Direction::HostToDevice, None)
        .unwrap();
    finish(&engine, &[1]);
    engine.shutdown();
    assert!(!engine.stats().shutdown_timed_out, "nothing was in flight");
    drop(engine);
}

#[test]
fn refusals_are_typed_and_issue_nothing() {
    let mut b = Buffers {
        src: vec![1; 1 << 16],
        dst: vec![0; 1 << 16],
    };
    let (engine, _) = engine_with(
        &mut b,
        EngineConfig {
            max_descriptors: 4,
            ..Default::default()
        },
    );
    let (s, d) = (b.src.as_ptr() as u64, b.dst.as_ptr() as u64);
    let h2d = Direction::HostToDevice;
    assert!(matches!(
        engine.submit(1, &[s; 5], &[d; 5], &[1; 5], h2d, None),
        Err(EngineError::Descriptor(
            blockswap::descriptor::DescriptorError::TooLarge { len: 5, max: 4 }
        ))
    ));
    // Wrong direction: the "device" buffer is not host memory.
    assert!(matches!(
        engine.submit(1, &[d], &[s], &[1], h2d, None),
        Err(EngineError::Descriptor(_))
    ));
    engine.submit(1, &[s], &[d], &[1], h2d, None).unwrap();
    assert_eq!(
        engine.submit(1, &[s], &[d + 1], &[1], h2d, None),
        Err(EngineError::JobIdLive(1))
    );
    finish(&engine, &[1]);
    engine.shutdown();
    assert_eq!(
        engine.submit(2, &[s], &[d], &[1], h2d, None),
        Err(EngineError::ShutDown)
    );
    assert_eq!(b.dst[1], 0, "nothing refused was copied");
    drop(engine);
}

#[test]
fn pool_grows_reuses_and_refuses_at_its_cap() {
    let mut b = Buffers {
        src: vec![1; 1 << 20],
        dst: vec![0; 1 << 20],
    };
    // Room for two 256-descriptor slabs.
    let (engine, _) = engine_with(
        &mut b,
        EngineConfig {
            pool_bytes: 2 * 256 * 24,
            ..Default::default()
        },
    );
    let (s, d) = (b.src.as_ptr() as u64, b.dst.as_ptr() as u64);
    for round in 0..3u64 {
        engine
            .submit(10 * round, &[s], &[d], &[8], Direction::HostToDevice, None)
            .unwrap();
        engine
            .submit(
                10 * round + 1,
                &[s],
                &[d + 8],
                &[8],
                Direction::HostToDevice,
                None,
            )
            .unwrap();
        finish(&engine, &[10 * round, 10 * round + 1]);
    }
    let stats = engine.stats();
    assert_eq!(stats.pool.slabs, 2, "steady state allocates nothing new");
    // Hold both slabs in flight (results not polled), then ask for a third.
    engine
        .submit(100, &[s], &[d], &[8], Direction::HostToDevice, None)
        .unwrap();
    engine
        .submit(101, &[s], &[d + 8], &[8], Direction::HostToDevice, None)
        .unwrap();
    engine.wait(&[100, 101], None).unwrap();
    assert!(matches!(
        engine.submit(102, &[s], &[d + 16], &[8], Direction::HostToDevice, None),
        Err(EngineError::Pool(
            blockswap::pool::PoolError::Exhausted { .. }
        ))
    ));
    finish(&engine, &[]);
    engine
        .submit(102, &[s], &[d + 16], &[8], Direction::HostToDevice, None)
        .unwrap();
    finish(&engine, &[102]);
    drop(engine);
}

#[derive(Debug, Clone)]
struct Case {
    /// (src offset, block count, block size) runs; each run is contiguous in source and
    /// destination, so coalescing has something to merge.
    runs: Vec<(usize, usize, usize)>,
}

fn case() -> impl Strategy<Value = Case> {
    prop::collection::vec((0usize..60_000, 1usize..8, 1usize..300), 1..40)
        .prop_map(|runs| Case { runs })
}

fn run_case(c: &Case, coalesce: bool) -> Vec<u8> {
    let mut b = Buffers {
        src: (0..65536u32).map(|i| (i * 31 + 7) as u8).collect(),
        dst: vec![0; 1 << 20],
    };
    let (engine, _) = engine_with(
        &mut b,
        EngineConfig {
            coalesce,
            ..Default::default()
        },
    );
    let (mut src, mut dst, mut size) = (vec![], vec![], vec![]);
    let mut next_dst = 0u64;
    for &(off, count, blk) in &c.runs {
        for k in 0..count {
            let s = (off + k * blk) % (65536 - blk);
            src.push(b.src.as_ptr() as u64 + s as u64);
            dst.push(b.dst.as_ptr() as u64 + next_dst);
            size.push(blk as u64);
            next_dst += blk as u64;
        }
        next_dst += 3; // a gap: runs never merge with each other
    }
    engine
        .submit(1, &src, &dst, &size, Direction::HostToDevice, None)
        .unwrap();
    assert!(finish(&engine, &[1])[0].success);
    drop(engine);
    b.dst
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(if cfg!(miri) { 2 } else { 64 }))]

    #[test]
    #[cfg_attr(miri, ignore = "pure coalescing logic, hours of interpretation under Miri")]
    fn coalesced_batches_copy_the_same_bytes(c in case()) {
        prop_assert_eq!(run_case(&c, true), run_case(&c, false));
    }
}

#[test]
fn block_tables_move_blocks_by_id_and_pin_their_regions() {
    // 16 blocks of two 64-byte segments (K and V) on each side.
    let mut b = Buffers {
        src: (0..4096u32).map(|i| (i * 13 + 5) as u8).collect(),
        dst: vec![0; 4096],
    };
    let (engine, _) = engine_with(&mut b, EngineConfig::default());
    let (s, d) = (b.src.as_ptr() as u64, b.dst.as_ptr() as u64);
    let host = engine
        .register_table(
            vec![s, s + 1024],
            vec![64, 64],
            vec![64, 64],
            16,
            MemoryKind::Host,
            "CPU",
            1,
        )
        .unwrap();
    let dev = engine
        .register_table(
            vec![d, d + 1024],
            vec![64, 64],
            vec![64, 64],
            16,
            MemoryKind::Device,
            "GPU",
            1,
        )
        .unwrap();
    engine
        .submit_blocks(
            1,
            host,
            &[3, 4, 9],
            dev,
            &[0, 1, 15],
            Direction::HostToDevice,
            None,
            None,
        )
        .unwrap();
    assert!(finish(&engine, &[1])[0].success);
    for (sb, db) in [(3usize, 0usize), (4, 1), (9, 15)] {
        for seg in [0usize, 1024] {
            assert_eq!(
                b.dst[seg + db * 64..seg + db * 64 + 64],
                b.src[seg + sb * 64..seg + sb * 64 + 64]
            );
        }
    }
    // The direction's kinds are enforced, ids are checked, and a table pins its region.
    assert!(matches!(
        engine.submit_blocks(
            2,
            dev,
            &[0],
            host,
            &[0],
            Direction::HostToDevice,
            None,
            None
        ),
        Err(EngineError::Table(_))
    ));
    let e = engine
        .submit_blocks(
            2,
            host,
            &[16],
            dev,
            &[0],
            Direction::HostToDevice,
            None,
            None,
        )
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "CPU block ids hold block id 16, out of range (at position 0; there are 16 blocks)"
    );
    assert!(matches!(
        engine.unregister(d),
        Err(EngineError::Region(
            blockswap::region::RegionError::UsedByTable { .. }
        ))
    ));
    engine.unregister_table(dev).unwrap();
    engine.unregister(d).unwrap();
    drop(engine);
}

/// A submit that passed the shutdown check before `shutdown` stopped the backend used to be
/// accepted and then reported failed ("the backend is shut down"): about one round in 150 with two
/// submitting threads. The contract: each submit either is refused with `ShutDown` or its
/// transfer runs.
#[test]
fn a_transfer_accepted_during_shutdown_runs() {
    let rounds = if cfg!(miri) { 2 } else { 600 };
    for round in 0..rounds {
        let mut b = Buffers {
            src: vec![7; 1 << 16],
            dst: vec![0; 1 << 16],
        };
        let (engine, _) = engine_with(&mut b, EngineConfig::default());
        let (src, dst) = (b.src.as_ptr() as u64, b.dst.as_mut_ptr() as u64);
        let accepted: Vec<Vec<u64>> = std::thread::scope(|s| {
            let submitters: Vec<_> = (0..2u64)
                .map(|t| {
                    let engine = &engine;
                    s.spawn(move || {
                        let mut accepted = vec![];
                        for i in 0..512u64 {
                            let job = t << 32 | i;
                            let at = (t * 512 + i) * 64;
                            match engine.submit(
                                job,
                                &[src + at],
                                &[dst + at],
                                &[64],
                                Direction::HostToDevice,
                                None,
                            ) {
                                Ok(()) => accepted.push(job),
                                Err(EngineError::ShutDown) => break,
                                Err(EngineError::TooManyInFlight { .. }) => {
                                    std::thread::yield_now()
                                }
                                Err(e) => panic!("round {round}: unexpected refusal {e}"),
                            }
                        }
                        accepted
                    })
                })
                .collect();
            std::thread::sleep(Duration::from_micros(200 + 7 * (round % 50)));
            engine.shutdown();
            submitters.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut out = vec![];
        engine.get_finished(&mut out);
        let failed: Vec<_> = out.iter().filter(|r| !r.success).collect();
        assert!(
            failed.is_empty(),
            "round {round}: accepted and failed: {failed:?}"
        );
        let accepted: usize = accepted.iter().map(Vec::len).sum();
        assert_eq!(
            out.len(),
            accepted,
            "round {round}: a result per accepted job"
        );
        for r in &out {
            let at = ((r.job_id >> 32) * 512 + (r.job_id & 0xffff_ffff)) as usize * 64;
            assert_eq!(
                &b.dst[at..at + 64],
                &[7; 64],
                "round {round}: job {}",
                r.job_id
            );
        }
    }
}

/// An idle engine accepts every batch a fresh one would: a free slab of the wrong size is freed to
/// make room. A batch larger than the whole pool is refused as such, not as "poll and retry".
#[test]
fn an_idle_engine_accepts_what_a_fresh_one_would() {
    let mut b = Buffers {
        src: vec![3; 1 << 16],
        dst: vec![0; 1 << 16],
    };
    let config = EngineConfig {
        pool_bytes: 16384,
        coalesce: false,
        ..EngineConfig::default()
    };
    let (engine, _) = engine_with(&mut b, config);
    let (src, dst) = (b.src.as_ptr() as u64, b.dst.as_mut_ptr() as u64);
    engine
        .submit(1, &[src], &[dst], &[8], Direction::HostToDevice, None)
        .unwrap();
    assert!(finish(&engine, &[1])[0].success);
    assert_eq!(engine.stats().pool.free, 1);
    // 300 descriptors take a 512-entry slab (12 KiB): with the idle 256-entry slab (6 KiB) kept,
    // 18 KiB would pass the 16 KiB cap.
    let n = 300u64;
    let s: Vec<u64> = (0..n).map(|i| src + 16 * i).collect();
    let d: Vec<u64> = (0..n).map(|i| dst + 16 * i).collect();
    engine
        .submit(
            2,
            &s,
            &d,
            &vec![8; n as usize],
            Direction::HostToDevice,
            None,
        )
        .expect("an idle engine refused a batch a fresh one accepts");
    assert!(finish(&engine, &[2])[0].success);
    assert_eq!(
        engine.stats().pool.slabs,
        1,
        "the idle small slab was freed"
    );

    // 700 descriptors need a 1024-entry slab (24 KiB): more than the whole 16 KiB pool.
    let n = 700u64;
    let s: Vec<u64> = (0..n).map(|i| src + 16 * i).collect();
    let d: Vec<u64> = (0..n).map(|i| dst + 16 * i).collect();
    let err = engine
        .submit(
            3,
            &s,
            &d,
            &vec![8; n as usize],
            Direction::HostToDevice,
            None,
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::Pool(blockswap::pool::PoolError::ExceedsCap { .. })
        ),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("more than the whole") && !msg.contains("poll"),
        "{msg}"
    );
}

/// A KV-cache geometry for the block-plan tests: `layers` x `kv` pages of `page` bytes per block.
/// The "GPU" side keeps each (layer, K/V) page array in its own span of `nblocks` pages (layer
/// tensors one after another in one allocation, `gap` bytes between layers); the "CPU" side is
/// either block-major (a block's pages in one chunk) or a mirror of the GPU layout.
#[derive(Clone, Debug)]
struct Geometry {
    layers: usize,
    kv: usize,
    page: usize,
    nblocks: usize,
    gap: usize,
    block_major: bool,
    /// Segment order: (kv, layer) when true, so every K page forms one run, every V page another.
    kv_outer: bool,
}

impl Geometry {
    fn segments(&self) -> Vec<(usize, usize)> {
        let mut v: Vec<(usize, usize)> = vec![];
        for a in 0..if self.kv_outer { self.kv } else { self.layers } {
            for b in 0..if self.kv_outer { self.layers } else { self.kv } {
                v.push(if self.kv_outer { (b, a) } else { (a, b) });
            }
        }
        v
    }

    fn gpu_bytes(&self) -> usize {
        self.layers * (self.kv * self.nblocks * self.page + self.gap)
    }

    /// (bases, strides) of the GPU side, segments in `segments()` order.
    fn gpu(&self, base: u64) -> (Vec<u64>, Vec<u64>) {
        let layer = self.kv * self.nblocks * self.page + self.gap;
        self.segments()
            .iter()
            .map(|&(l, k)| {
                let off = l * layer + k * self.nblocks * self.page;
                (base + off as u64, self.page as u64)
            })
            .unzip()
    }

    /// (bases, strides) of the CPU side.
    fn cpu(&self, base: u64) -> (Vec<u64>, Vec<u64>) {
        let n = self.layers * self.kv;
        if self.block_major {
            (0..n)
                .map(|i| (base + (i * self.page) as u64, (n * self.page) as u64))
                .unzip()
        } else {
            self.gpu(base)
        }
    }
}

fn geometry() -> impl Strategy<Value = Geometry> {
    (
        1usize..6,
        1usize..3,
        prop::sample::select(vec![8usize, 24, 64, 96]),
        2usize..12,
        prop::sample::select(vec![0usize, 8, 40]),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(
            |(layers, kv, page, nblocks, gap, block_major, kv_outer)| Geometry {
                layers,
                kv,
                page,
                nblocks,
                gap,
                block_major,
                kv_outer,
            },
        )
}

/// Registers `buf` with `engine` as device memory.
///
/// # Safety
/// `buf` outlives the engine and is not resized while it lives.
unsafe fn register_device(engine: &Engine, buf: &mut [u8]) {
    // SAFETY: the caller's guarantee.
    unsafe {
        engine
            .register(
                buf.as_mut_ptr() as u64,
                buf.len() as u64,
                MemoryKind::Device,
            )
            .unwrap();
    }
}

/// Moves `pairs` of (source id, destination id) GPU -> CPU and back to fresh GPU memory, once
/// page by page and once by the block plan, and returns the two results of both legs.
fn both_ways(g: &Geometry, pairs: &[(u64, u64)], runs: bool) -> (Vec<u8>, Vec<u8>, usize) {
    let mut b = Buffers {
        src: (0..g.gpu_bytes())
            .map(|i| (i * 131 + i / 7) as u8)
            .collect(),
        dst: vec![0; g.gpu_bytes().max(g.layers * g.kv * g.nblocks * g.page)],
    };
    let mut back = vec![0u8; g.gpu_bytes()];
    let (engine, _) = engine_with(&mut b, EngineConfig::default());
    // SAFETY: `back` outlives the engine (dropped below, before it).
    unsafe { register_device(&engine, &mut back) };
    let nb = g.nblocks as u64;
    let nbytes = vec![g.page as u64; g.layers * g.kv];
    let (gb, gs) = g.gpu(b.src.as_ptr() as u64);
    let gpu = engine
        .register_table(gb, gs, nbytes.clone(), nb, MemoryKind::Host, "GPU", 1)
        .unwrap();
    let (cb, cs) = g.cpu(b.dst.as_ptr() as u64);
    let cpu = engine
        .register_table(cb, cs, nbytes.clone(), nb, MemoryKind::Device, "CPU", 1)
        .unwrap();
    let (bb, bs) = g.gpu(back.as_ptr() as u64);
    // The way back: the CPU side is the "device" buffer here, read as a source on d2h... so the
    // return leg is a d2d move from the CPU table into `back`.
    let back_t = engine
        .register_table(bb, bs, nbytes, nb, MemoryKind::Device, "GPU", 1)
        .unwrap();
    let (s, d): (Vec<u64>, Vec<u64>) = pairs.iter().copied().unzip();
    let plan = engine
        .block_runs(gpu, cpu, Direction::HostToDevice)
        .unwrap()
        .expect("a block plan");
    let submit = |job, st, si: &[u64], dt, di: &[u64], dir| {
        if runs {
            engine.submit_block_runs(job, st, si, dt, di, dir, None)
        } else {
            engine.submit_blocks(job, st, si, dt, di, dir, None, None)
        }
    };
    submit(1, gpu, &s, cpu, &d, Direction::HostToDevice).unwrap();
    assert!(finish(&engine, &[1])[0].success);
    submit(2, cpu, &d, back_t, &s, Direction::DeviceToDevice).unwrap();
    let r = finish(&engine, &[2]);
    assert!(r[0].success);
    assert_eq!(r[0].bytes as usize, pairs.len() * g.layers * g.kv * g.page);
    drop(engine);
    (b.dst, back, plan.len())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(if cfg!(miri) { 1 } else { 96 }))]

    /// The block plan writes exactly the bytes the page-by-page route writes, both ways, for
    /// block-major and mirrored CPU sides, any segment order, gaps between layers.
    #[test]
    fn block_plans_copy_what_pages_copy(
        g in geometry(),
        seed in any::<u64>(),
        n in 1usize..6,
    ) {
        let n = n.min(g.nblocks);
        // n distinct destination ids and any source ids, from the seed.
        let mut d: Vec<u64> = (0..g.nblocks as u64).collect();
        let mut x = seed | 1;
        for i in (1..d.len()).rev() {
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;
            d.swap(i, (x % (i as u64 + 1)) as usize);
        }
        let pairs: Vec<(u64, u64)> = (0..n)
            .map(|i| ((seed >> (i * 4)) % g.nblocks as u64, d[i]))
            .collect();
        // Sources may repeat on the GPU side, but the way back writes them: keep them distinct.
        let mut seen = std::collections::HashSet::new();
        let pairs: Vec<_> = pairs.into_iter().filter(|p| seen.insert(p.0)).collect();
        let (cpu_pages, back_pages, _) = both_ways(&g, &pairs, false);
        let (cpu_runs, back_runs, runs) = both_ways(&g, &pairs, true);
        prop_assert_eq!(cpu_pages, cpu_runs);
        prop_assert_eq!(back_pages, back_runs);
        let segments = g.layers * g.kv;
        // Block-major against layers at one pitch: one run (kv outer: one per K/V, or per
        // layer where the gap breaks the pitch).
        if g.block_major && g.gap == 0 && (g.kv == 1 || g.kv_outer) {
            prop_assert_eq!(runs, if g.layers == 1 { 1 } else { g.kv });
        }
        prop_assert!(runs <= segments);
    }
}

/// Moves `pairs` of (GPU id, CPU id) GPU -> CPU into a block-major CPU side, then CPU -> GPU
/// back into fresh GPU memory (CPU id -> GPU id), once page by page and once by the staged plan
/// with `slot` bytes per staging slot; returns the CPU side and the GPU side written back.
fn staged_both_ways(
    g: &Geometry,
    pairs: &[(u64, u64)],
    staged: bool,
    slot: u64,
) -> (Vec<u8>, Vec<u8>) {
    let n = g.layers * g.kv;
    let mut b = Buffers {
        src: vec![0; n * g.nblocks * g.page],
        dst: (0..g.gpu_bytes())
            .map(|i| (i * 131 + i / 7) as u8)
            .collect(),
    };
    let mut back = vec![0u8; g.gpu_bytes()];
    let config = EngineConfig {
        stage_bytes: slot,
        ..EngineConfig::default()
    };
    let (engine, _) = engine_with(&mut b, config);
    // SAFETY: `back` outlives the engine (dropped below, before it).
    unsafe { register_device(&engine, &mut back) };
    let nb = g.nblocks as u64;
    let nbytes = vec![g.page as u64; n];
    let (gb, gs) = g.gpu(b.dst.as_ptr() as u64);
    let gpu = engine
        .register_table(gb, gs, nbytes.clone(), nb, MemoryKind::Device, "GPU", 1)
        .unwrap();
    let (bb, bs) = g.gpu(back.as_ptr() as u64);
    let back_t = engine
        .register_table(bb, bs, nbytes.clone(), nb, MemoryKind::Device, "GPU", 1)
        .unwrap();
    let cpu_g = Geometry {
        block_major: true,
        ..g.clone()
    };
    let (cb, cs) = cpu_g.cpu(b.src.as_ptr() as u64);
    let cpu = engine
        .register_table(cb, cs, nbytes, nb, MemoryKind::Host, "CPU", 1)
        .unwrap();
    let (gi, ci): (Vec<u64>, Vec<u64>) = pairs.iter().copied().unzip();
    let shape = || {
        if staged {
            Shape::Staged { kernel: None }
        } else {
            Shape::Pages(None)
        }
    };
    let groups = |st, si, dt, di| [GroupIds::blocks(st, si, dt, di)];
    engine
        .submit_groups(
            1,
            &groups(gpu, &gi, cpu, &ci),
            Direction::DeviceToHost,
            None,
            shape(),
        )
        .unwrap();
    let r = finish(&engine, &[1]);
    assert!(r[0].success, "{:?}", r[0]);
    engine
        .submit_groups(
            2,
            &groups(cpu, &ci, back_t, &gi),
            Direction::HostToDevice,
            None,
            shape(),
        )
        .unwrap();
    let r = finish(&engine, &[2]);
    assert!(r[0].success, "{:?}", r[0]);
    assert_eq!(r[0].bytes as usize, pairs.len() * n * g.page);
    drop(engine);
    // Every moved page came back to where it started.
    let (gb, _) = g.gpu(0);
    for &(id, _) in pairs {
        for &base in &gb {
            let at = base as usize + id as usize * g.page;
            assert_eq!(back[at..at + g.page], b.dst[at..at + g.page]);
        }
    }
    (b.src, back)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(if cfg!(miri) { 1 } else { 64 }))]

    /// The staged plan writes exactly the bytes the page-by-page route writes, both ways, for any
    /// segment order and gaps between layers, with staging slots from one row (one block per
    /// step, the slots reused many times in a transfer) to many, and CPU blocks scattered or
    /// one after the other (their rows then cross as joined copies).
    #[test]
    fn staged_plans_copy_what_pages_copy(
        g in geometry(),
        seed in any::<u64>(),
        n in 1usize..12,
        rows_per_slot in 1u64..5,
        spare in 0u64..3,
        adjacent in any::<bool>(),
    ) {
        let n = n.min(g.nblocks);
        let mut ids: Vec<u64> = (0..g.nblocks as u64).collect();
        let mut x = seed | 1;
        for i in (1..ids.len()).rev() {
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;
            ids.swap(i, (x % (i as u64 + 1)) as usize);
        }
        let first = seed % (g.nblocks - n + 1) as u64;
        let cpu_ids: Vec<u64> = if adjacent {
            (first..first + n as u64).collect()
        } else {
            ids.iter().rev().copied().collect()
        };
        let pairs: Vec<(u64, u64)> = (0..n).map(|i| (ids[i], cpu_ids[i])).collect();
        let row = (g.layers * g.kv * g.page) as u64;
        let slot = rows_per_slot * row + spare * 8;
        let (cpu_pages, back_pages) = staged_both_ways(&g, &pairs, false, slot);
        let (cpu_staged, back_staged) = staged_both_ways(&g, &pairs, true, slot);
        prop_assert_eq!(cpu_pages, cpu_staged);
        prop_assert_eq!(back_pages, back_staged);
    }
}

#[test]
fn staged_plans_are_refused_where_they_cannot_run() {
    let g = Geometry {
        layers: 2,
        kv: 2,
        page: 64,
        nblocks: 4,
        gap: 0,
        block_major: false,
        kv_outer: false,
    };
    let mut b = Buffers {
        src: vec![0; 4096],
        dst: vec![1; 4096],
    };
    let config = EngineConfig {
        stage_bytes: 128,
        ..EngineConfig::default()
    };
    let (engine, host) = engine_with(&mut b, config);
    let nbytes = vec![64u64; 4];
    let (gb, gs) = g.gpu(b.dst.as_ptr() as u64);
    let gpu = engine
        .register_table(gb, gs, nbytes.clone(), 4, MemoryKind::Device, "GPU", 1)
        .unwrap();
    let mirror = {
        let (cb, cs) = g.cpu(b.src.as_ptr() as u64);
        engine
            .register_table(cb, cs, nbytes.clone(), 4, MemoryKind::Host, "CPU", 1)
            .unwrap()
    };
    let major = {
        let (cb, cs) = Geometry {
            block_major: true,
            ..g.clone()
        }
        .cpu(b.src.as_ptr() as u64 + 2048);
        engine
            .register_table(cb, cs, nbytes, 4, MemoryKind::Host, "CPU", 1)
            .unwrap()
    };
    let staged = || Shape::Staged { kernel: None };
    let submit = |job, cpu, dir| {
        let (gi, ci) = ([0u64, 1], [2u64, 3]);
        let groups = if dir == Direction::DeviceToHost {
            [GroupIds::blocks(gpu, &gi, cpu, &ci)]
        } else {
            [GroupIds::blocks(cpu, &ci, gpu, &gi)]
        };
        engine.submit_groups(job, &groups, dir, None, staged())
    };
    // A CPU side that mirrors the GPU layout has no host row.
    let err = submit(1, mirror, Direction::DeviceToHost).unwrap_err();
    assert!(err.to_string().contains("not block-major"), "{err}");
    // A row (4 pages of 64 bytes) larger than a 128-byte slot.
    let err = submit(2, major, Direction::HostToDevice).unwrap_err();
    assert!(err.to_string().contains("stage_bytes = 128"), "{err}");
    assert_eq!(engine.stats().in_flight, 0);
    drop(engine);
    drop(host);

    // With room, an injected failure stops the transfer halfway and reports it failed.
    let mut b = Buffers {
        src: vec![0; 4096],
        dst: vec![1; 4096],
    };
    let (engine, host) = engine_with(
        &mut b,
        EngineConfig {
            stage_bytes: 256,
            ..EngineConfig::default()
        },
    );
    let (gb, gs) = g.gpu(b.dst.as_ptr() as u64);
    let gpu = engine
        .register_table(gb, gs, vec![64; 4], 4, MemoryKind::Device, "GPU", 1)
        .unwrap();
    let (cb, cs) = Geometry {
        block_major: true,
        ..g.clone()
    }
    .cpu(b.src.as_ptr() as u64);
    let cpu = engine
        .register_table(cb, cs, vec![64; 4], 4, MemoryKind::Host, "CPU", 1)
        .unwrap();
    blockswap::Backend::inject_failures(&*host, 1);
    let groups = [GroupIds::blocks(gpu, &[0, 1, 2, 3], cpu, &[0, 1, 2, 3])];
    engine
        .submit_groups(3, &groups, Direction::DeviceToHost, None, staged())
        .unwrap();
    let r = finish(&engine, &[3]);
    assert!(!r[0].success);
    assert!(
        r[0].error.as_deref().unwrap_or("").contains("injected"),
        "{:?}",
        r[0]
    );
    engine
        .submit_groups(4, &groups, Direction::DeviceToHost, None, staged())
        .unwrap();
    assert!(finish(&engine, &[4])[0].success);
}

#[test]
fn block_plans_are_refused_where_a_table_pair_has_none() {
    // Destination segments whose pages overlap (32 bytes apart, 64 long): their disjointness is
    // proven per descriptor, so no block plan.
    let mut b = Buffers {
        src: vec![1; 4096],
        dst: vec![0; 4096],
    };
    let (engine, _) = engine_with(&mut b, EngineConfig::default());
    let (s, d) = (b.src.as_ptr() as u64, b.dst.as_ptr() as u64);
    let src = engine
        .register_table(
            vec![s, s + 2048],
            vec![128, 128],
            vec![64, 64],
            8,
            MemoryKind::Host,
            "",
            1,
        )
        .unwrap();
    let dst = engine
        .register_table(
            vec![d, d + 32],
            vec![128, 128],
            vec![64, 64],
            8,
            MemoryKind::Device,
            "",
            1,
        )
        .unwrap();
    assert_eq!(
        engine
            .block_runs(src, dst, Direction::HostToDevice)
            .unwrap(),
        None
    );
    let err = engine
        .submit_block_runs(1, src, &[0], dst, &[1], Direction::HostToDevice, None)
        .unwrap_err();
    assert!(err.to_string().contains("no block plan"), "{err}");
    // Bad ids are refused exactly as page by page.
    let dst2 = engine
        .register_table(
            vec![d + 2048, d + 3072],
            vec![64, 64],
            vec![64, 64],
            8,
            MemoryKind::Device,
            "GPU",
            1,
        )
        .unwrap();
    let err = engine
        .submit_block_runs(
            2,
            src,
            &[0, 1],
            dst2,
            &[3, 3],
            Direction::HostToDevice,
            None,
        )
        .unwrap_err();
    assert!(err.to_string().contains("more than once"), "{err}");
    let err = engine
        .submit_block_runs(3, src, &[9], dst2, &[0], Direction::HostToDevice, None)
        .unwrap_err();
    assert!(err.to_string().contains("out of range"), "{err}");
    assert_eq!(engine.stats().in_flight, 0);
}

#[test]
fn groups_move_as_one_transfer_with_chunk_ids_and_skips() {
    // Two KV-cache groups: GPU tables of 64-byte and 32-byte pages (16 blocks each, in "device"
    // memory), CPU tables of 4 chunks of 4 sub-blocks each. Group 0 stores GPU blocks 3, 4, 5
    // from sub-block 2 of chunk 1 (chunks 1 and 0: sub-blocks 6, 7, 0); group 1 stores block 9
    // into sub-block 3 of chunk 2, and group 1 then loads it back into block 0 by chunk id.
    let mut b = Buffers {
        src: vec![0; 2048],
        dst: (0..2048).map(|i| (i % 251) as u8).collect(),
    };
    let (engine, _) = engine_with(&mut b, EngineConfig::default());
    let (h, d) = (b.src.as_ptr() as u64, b.dst.as_ptr() as u64);
    let table = |base, page: u64, blocks, kind, name: &str, unit| {
        engine
            .register_table(vec![base], vec![page], vec![page], blocks, kind, name, unit)
            .unwrap()
    };
    let gpu0 = table(d, 64, 16, MemoryKind::Device, "GPU", 1);
    let gpu1 = table(d + 1024, 32, 16, MemoryKind::Device, "GPU", 1);
    let cpu0 = table(h, 64, 16, MemoryKind::Host, "CPU", 4);
    let cpu1 = table(h + 1024, 32, 16, MemoryKind::Host, "CPU", 4);
    let group = |src_table, src_ids, dst_table, dst_ids, chunks| GroupIds {
        src_table,
        src_ids,
        dst_table,
        dst_ids,
        chunks,
    };
    let store = [
        group(gpu0, &[3u64, 4, 5][..], cpu0, &[1u64, 0][..], Some(2)),
        group(gpu1, &[9], cpu1, &[2], Some(3)),
    ];
    engine
        .submit_groups(1, &store, Direction::DeviceToHost, None, Shape::Pages(None))
        .unwrap();
    let r = finish(&engine, &[1]);
    assert!(r[0].success);
    assert_eq!(r[0].bytes, 3 * 64 + 32);
    for (gpu_block, sub) in [(3, 6), (4, 7), (5, 0)] {
        assert_eq!(
            b.src[sub * 64..sub * 64 + 64],
            b.dst[gpu_block * 64..gpu_block * 64 + 64]
        );
    }
    let (c1, g1) = (1024 + 11 * 32, 1024 + 9 * 32);
    assert_eq!(b.src[c1..c1 + 32], b.dst[g1..g1 + 32]);

    // Load group 1's sub-block 11 into GPU block 0, with group 0 empty, as the block plan.
    let load = [
        group(cpu0, &[], gpu0, &[], Some(0)),
        group(cpu1, &[2], gpu1, &[0], Some(3)),
    ];
    engine
        .submit_groups(2, &load, Direction::HostToDevice, None, Shape::Runs)
        .unwrap();
    assert!(finish(&engine, &[2])[0].success);
    assert_eq!(b.dst[1024..1024 + 32], b.src[c1..c1 + 32]);

    // Refusals name the group: a wrong chunk count, a repeated chunk sub-block.
    let bad = [
        group(gpu0, &[1], cpu0, &[0], Some(0)),
        group(gpu1, &[1, 2], cpu1, &[0], Some(3)),
    ];
    let err = engine
        .submit_groups(3, &bad, Direction::DeviceToHost, None, Shape::Pages(None))
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("group 1: 2 GPU blocks from sub-block 3 of the first CPU block take"),
        "{err}"
    );
    let err = engine
        .submit_groups(3, &[], Direction::DeviceToHost, None, Shape::Pages(None))
        .unwrap_err();
    assert!(err.to_string().contains("empty"), "{err}");
    drop(engine);
}
