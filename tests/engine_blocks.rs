//! Engine integration tests on the host backend for block tables: blocks moved by id, the block
//! and staged plans against page-by-page copies, KV-cache groups, and their refusals.

mod common;

use blockswap::engine::{Chunks, Engine, EngineConfig, EngineError, GroupIds, StagedRoute};
use blockswap::plan::Plan;
use blockswap::table::TableSpec;
use blockswap::{Direction, MemoryKind};
use common::{engine_with, finish, Buffers};
use proptest::prelude::*;

#[test]
fn block_tables_move_blocks_by_id_and_pin_their_regions() {
    // 16 blocks of two 64-byte segments (K and V) on each side.
    let mut b = Buffers {
        src: (0..4096u32).map(|i| (i * 13 + 5) as u8).collect(),
        dst: vec![0; 4096],
    };
    let (engine, _) = engine_with(&mut b, common::config());
    let (s, d) = (b.src.as_ptr() as u64, b.dst.as_ptr() as u64);
    let host = engine
        .register_table(
            TableSpec::new(
                vec![s, s + 1024],
                vec![64, 64],
                vec![64, 64],
                16,
                MemoryKind::Host,
            )
            .named("CPU", 1),
        )
        .unwrap();
    let dev = engine
        .register_table(
            TableSpec::new(
                vec![d, d + 1024],
                vec![64, 64],
                vec![64, 64],
                16,
                MemoryKind::Device,
            )
            .named("GPU", 1),
        )
        .unwrap();
    engine
        .submit_blocks(
            1,
            GroupIds::blocks(host, &[3, 4, 9], dev, &[0, 1, 15]),
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
            GroupIds::blocks(dev, &[0], host, &[0]),
            Direction::HostToDevice,
            None,
            None
        ),
        Err(EngineError::Table(_))
    ));
    let e = engine
        .submit_blocks(
            2,
            GroupIds::blocks(host, &[16], dev, &[0]),
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
    // A buffer of the engine's own is not freed under a table either, by either call.
    let buf = engine.alloc_host(4096).unwrap();
    let t = engine
        .register_table(TableSpec::new(
            vec![buf],
            vec![64],
            vec![64],
            64,
            MemoryKind::Host,
        ))
        .unwrap();
    for e in [engine.free_host(buf), engine.unregister(buf)] {
        assert!(matches!(
            e,
            Err(EngineError::Region(
                blockswap::region::RegionError::UsedByTable { table, .. }
            )) if table == t
        ));
    }
    engine.unregister_table(t).unwrap();
    engine.free_host(buf).unwrap();
    drop(engine);
}

#[test]
fn a_host_cache_is_block_major_where_each_blocks_pages_are_one_chunk() {
    // 16 blocks; host tables over one 4 KiB buffer: K and V of a block side by side (a row of
    // 128 bytes at a 128-byte stride), mirrored (K of every block, then V), one page per block.
    let mut b = Buffers {
        src: vec![0; 4096],
        dst: vec![0; 4096],
    };
    let (engine, _) = engine_with(&mut b, common::config());
    let s = b.src.as_ptr() as u64;
    let host = |bases: Vec<u64>, strides: Vec<u64>, nbytes: Vec<u64>| {
        engine
            .register_table(
                TableSpec::new(bases, strides, nbytes, 16, MemoryKind::Host).named("CPU", 1),
            )
            .unwrap()
    };
    let rows = host(vec![s, s + 64], vec![128, 128], vec![64, 64]);
    let mirror = host(vec![s, s + 1024], vec![64, 64], vec![64, 64]);
    let single = host(vec![s], vec![64], vec![64]);
    let dev = engine
        .register_table(
            TableSpec::new(
                vec![b.dst.as_ptr() as u64],
                vec![64],
                vec![64],
                16,
                MemoryKind::Device,
            )
            .named("GPU", 1),
        )
        .unwrap();
    assert!(engine.block_major(&[rows]).unwrap());
    assert!(!engine.block_major(&[mirror]).unwrap());
    assert!(
        !engine.block_major(&[rows, mirror]).unwrap(),
        "every table, not one"
    );
    assert!(
        !engine.block_major(&[single]).unwrap(),
        "a row of one page is the page route's"
    );
    assert!(!engine.block_major(&[]).unwrap());
    assert!(matches!(
        engine.block_major(&[dev]),
        Err(EngineError::Table(_))
    ));
    assert!(matches!(
        engine.block_major(&[99]),
        Err(EngineError::Table(_))
    ));
    // The staged plan's own rule agrees where it takes the cache.
    assert_eq!(engine.staged_route(&[rows]).unwrap(), Ok(128));
    assert!(engine.staged_route(&[mirror]).unwrap().is_err());
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

/// Registers `buf` with `engine` as memory of `kind`.
///
/// # Safety
/// `buf` outlives the engine and is not resized while it lives.
unsafe fn register_as(engine: &Engine, buf: &mut [u8], kind: MemoryKind) {
    // SAFETY: the caller's guarantee.
    unsafe {
        engine
            .register(buf.as_mut_ptr() as u64, buf.len() as u64, kind)
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
    let (engine, _) = engine_with(&mut b, common::config());
    // SAFETY: `back` outlives the engine (dropped below, before it).
    unsafe { register_as(&engine, &mut back, MemoryKind::Device) };
    let nb = g.nblocks as u64;
    let nbytes = vec![g.page as u64; g.layers * g.kv];
    let (gb, gs) = g.gpu(b.src.as_ptr() as u64);
    let gpu = engine
        .register_table(
            TableSpec::new(gb, gs, nbytes.clone(), nb, MemoryKind::Host).named("GPU", 1),
        )
        .unwrap();
    let (cb, cs) = g.cpu(b.dst.as_ptr() as u64);
    let cpu = engine
        .register_table(
            TableSpec::new(cb, cs, nbytes.clone(), nb, MemoryKind::Device).named("CPU", 1),
        )
        .unwrap();
    let (bb, bs) = g.gpu(back.as_ptr() as u64);
    // The way back: the CPU side is the "device" buffer here, read as a source on d2h... so the
    // return leg is a d2d move from the CPU table into `back`.
    let back_t = engine
        .register_table(TableSpec::new(bb, bs, nbytes, nb, MemoryKind::Device).named("GPU", 1))
        .unwrap();
    let (s, d): (Vec<u64>, Vec<u64>) = pairs.iter().copied().unzip();
    let plan = engine
        .block_runs(gpu, cpu, Direction::HostToDevice)
        .unwrap()
        .expect("a block plan");
    let submit = |job, st, si: &[u64], dt, di: &[u64], dir| {
        if runs {
            engine.submit_block_runs(job, GroupIds::blocks(st, si, dt, di), dir, None)
        } else {
            engine.submit_blocks(job, GroupIds::blocks(st, si, dt, di), dir, None, None)
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
/// back into fresh GPU memory (CPU id -> GPU id), page by page (`staged` None) or by the staged
/// plan `staged` (direct or not) with `slot` bytes per staging slot; returns the CPU side and the
/// GPU side written back.
fn staged_both_ways(
    g: &Geometry,
    pairs: &[(u64, u64)],
    staged: Option<StagedRoute>,
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
        ..common::config()
    };
    let (engine, _) = engine_with(&mut b, config);
    // SAFETY: `back` outlives the engine (dropped below, before it).
    unsafe { register_as(&engine, &mut back, MemoryKind::Device) };
    let nb = g.nblocks as u64;
    let nbytes = vec![g.page as u64; n];
    let (gb, gs) = g.gpu(b.dst.as_ptr() as u64);
    let gpu = engine
        .register_table(
            TableSpec::new(gb, gs, nbytes.clone(), nb, MemoryKind::Device).named("GPU", 1),
        )
        .unwrap();
    let (bb, bs) = g.gpu(back.as_ptr() as u64);
    let back_t = engine
        .register_table(
            TableSpec::new(bb, bs, nbytes.clone(), nb, MemoryKind::Device).named("GPU", 1),
        )
        .unwrap();
    let cpu_g = Geometry {
        block_major: true,
        ..g.clone()
    };
    let (cb, cs) = cpu_g.cpu(b.src.as_ptr() as u64);
    let cpu = engine
        .register_table(
            TableSpec::new(cb, cs, nbytes.clone(), nb, MemoryKind::Host).named("CPU", 1),
        )
        .unwrap();
    // A second CPU side the same transfer goes to, queued right behind the first: the host
    // backend then takes the steps a transfer issued behind a running one takes (no ramps).
    let mut again = vec![0u8; b.src.len()];
    // SAFETY: `again` outlives the engine (dropped below, before it) and is not resized.
    unsafe { register_as(&engine, &mut again, MemoryKind::Host) };
    let (ab, as_) = cpu_g.cpu(again.as_ptr() as u64);
    let again_t = engine
        .register_table(TableSpec::new(ab, as_, nbytes, nb, MemoryKind::Host).named("CPU", 1))
        .unwrap();
    let (gi, ci): (Vec<u64>, Vec<u64>) = pairs.iter().copied().unzip();
    let shape = || staged.map_or(Plan::Pages(None), Plan::Staged);
    let groups = |st, si, dt, di| [GroupIds::blocks(st, si, dt, di)];
    for (job, to) in [(1, cpu), (3, again_t)] {
        engine
            .submit_groups(
                job,
                &groups(gpu, &gi, to, &ci),
                Direction::DeviceToHost,
                None,
                shape(),
            )
            .unwrap();
    }
    let r = finish(&engine, &[1, 3]);
    assert!(r.iter().all(|r| r.success), "{r:?}");
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
    assert!(
        again == b.src,
        "the transfer queued behind the first wrote other bytes"
    );
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
    /// one after the other (their rows then cross as joined copies); and so does the direct plan
    /// (the kernel on the host pages in place, launches of at most a slot's bytes of pages).
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
        let (cpu_pages, back_pages) = staged_both_ways(&g, &pairs, None, slot);
        let staged = StagedRoute::default();
        let (cpu_staged, back_staged) = staged_both_ways(&g, &pairs, Some(staged), slot);
        prop_assert_eq!(&cpu_pages, &cpu_staged);
        prop_assert_eq!(&back_pages, &back_staged);
        let direct = StagedRoute { direct: true, launch_bytes: Some(slot), ..staged };
        let (cpu_direct, back_direct) = staged_both_ways(&g, &pairs, Some(direct), slot);
        prop_assert_eq!(cpu_pages, cpu_direct);
        prop_assert_eq!(back_pages, back_direct);
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
        ..common::config()
    };
    let (engine, host) = engine_with(&mut b, config);
    let nbytes = vec![64u64; 4];
    let (gb, gs) = g.gpu(b.dst.as_ptr() as u64);
    let gpu = engine
        .register_table(
            TableSpec::new(gb, gs, nbytes.clone(), 4, MemoryKind::Device).named("GPU", 1),
        )
        .unwrap();
    let mirror = {
        let (cb, cs) = g.cpu(b.src.as_ptr() as u64);
        engine
            .register_table(
                TableSpec::new(cb, cs, nbytes.clone(), 4, MemoryKind::Host).named("CPU", 1),
            )
            .unwrap()
    };
    let major = {
        let (cb, cs) = Geometry {
            block_major: true,
            ..g.clone()
        }
        .cpu(b.src.as_ptr() as u64 + 2048);
        engine
            .register_table(TableSpec::new(cb, cs, nbytes, 4, MemoryKind::Host).named("CPU", 1))
            .unwrap()
    };
    let staged = || Plan::Staged(StagedRoute::default());
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
            ..common::config()
        },
    );
    let (gb, gs) = g.gpu(b.dst.as_ptr() as u64);
    let gpu = engine
        .register_table(TableSpec::new(gb, gs, vec![64; 4], 4, MemoryKind::Device).named("GPU", 1))
        .unwrap();
    let (cb, cs) = Geometry {
        block_major: true,
        ..g.clone()
    }
    .cpu(b.src.as_ptr() as u64);
    let cpu = engine
        .register_table(TableSpec::new(cb, cs, vec![64; 4], 4, MemoryKind::Host).named("CPU", 1))
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
    // The direct plan (no rows; launches of at least a block, one each here) both ways, an
    // injected failure reported as the staged plan's is.
    let direct = || {
        Plan::Staged(StagedRoute {
            direct: true,
            launch_bytes: Some(1),
            ..StagedRoute::default()
        })
    };
    let back = [GroupIds::blocks(cpu, &[0, 1, 2, 3], gpu, &[3, 2, 1, 0])];
    engine
        .submit_groups(5, &groups, Direction::DeviceToHost, None, direct())
        .unwrap();
    engine
        .submit_groups(6, &back, Direction::HostToDevice, None, direct())
        .unwrap();
    assert!(finish(&engine, &[5, 6]).iter().all(|r| r.success));
    blockswap::Backend::inject_failures(&*host, 1);
    engine
        .submit_groups(7, &groups, Direction::DeviceToHost, None, direct())
        .unwrap();
    let r = finish(&engine, &[7]);
    assert!(!r[0].success);
    assert!(r[0].error.as_deref().unwrap_or("").contains("injected"));
}

#[test]
fn block_plans_are_refused_where_a_table_pair_has_none() {
    // Pages of different sizes on the two sides: no 2-D copy moves them.
    let mut b = Buffers {
        src: vec![1; 4096],
        dst: vec![0; 4096],
    };
    let (engine, _) = engine_with(&mut b, common::config());
    let (s, d) = (b.src.as_ptr() as u64, b.dst.as_ptr() as u64);
    let src = engine
        .register_table(TableSpec::new(
            vec![s, s + 2048],
            vec![128, 128],
            vec![64, 64],
            8,
            MemoryKind::Host,
        ))
        .unwrap();
    let dst = engine
        .register_table(TableSpec::new(
            vec![d, d + 1024],
            vec![128, 128],
            vec![32, 32],
            8,
            MemoryKind::Device,
        ))
        .unwrap();
    assert_eq!(
        engine
            .block_runs(src, dst, Direction::HostToDevice)
            .unwrap(),
        None
    );
    let err = engine
        .submit_block_runs(
            1,
            GroupIds::blocks(src, &[0], dst, &[1]),
            Direction::HostToDevice,
            None,
        )
        .unwrap_err();
    assert!(err.to_string().contains("no block plan"), "{err}");
    // Bad ids are refused exactly as page by page.
    let dst2 = engine
        .register_table(
            TableSpec::new(
                vec![d + 2048, d + 3072],
                vec![64, 64],
                vec![64, 64],
                8,
                MemoryKind::Device,
            )
            .named("GPU", 1),
        )
        .unwrap();
    let err = engine
        .submit_block_runs(
            2,
            GroupIds::blocks(src, &[0, 1], dst2, &[3, 3]),
            Direction::HostToDevice,
            None,
        )
        .unwrap_err();
    assert!(err.to_string().contains("more than once"), "{err}");
    let err = engine
        .submit_block_runs(
            3,
            GroupIds::blocks(src, &[9], dst2, &[0]),
            Direction::HostToDevice,
            None,
        )
        .unwrap_err();
    assert!(err.to_string().contains("out of range"), "{err}");
    assert_eq!(engine.stats().in_flight, 0);
}

#[test]
fn every_plan_refuses_loads_into_layers_that_share_a_tensor_and_stores_them() {
    // Two layers of K and V pages (64 bytes, 4 blocks) viewing one GPU tensor (KV sharing), and
    // a block-major CPU cache of their 4 pages a block.
    let mut b = Buffers {
        src: vec![0; 4096],
        dst: (0..4096u32).map(|i| (i * 7 + 3) as u8).collect(),
    };
    let (engine, _) = engine_with(&mut b, common::config());
    let (c, g) = (b.src.as_ptr() as u64, b.dst.as_ptr() as u64);
    let gpu = engine
        .register_table(
            TableSpec::new(
                vec![g, g + 256, g, g + 256],
                vec![64; 4],
                vec![64; 4],
                4,
                MemoryKind::Device,
            )
            .named("GPU", 1),
        )
        .unwrap();
    let cpu = engine
        .register_table(
            TableSpec::new(
                vec![c, c + 64, c + 128, c + 192],
                vec![256; 4],
                vec![64; 4],
                4,
                MemoryKind::Host,
            )
            .named("CPU", 1),
        )
        .unwrap();
    let gpu_before = b.dst.clone();
    let shape = |name| match name {
        "pages" => Plan::Pages(None),
        "runs" => Plan::Runs(()),
        "direct" => Plan::Staged(StagedRoute {
            direct: true,
            ..StagedRoute::default()
        }),
        _ => Plan::Staged(StagedRoute::default()),
    };
    for (job, name) in (1u64..)
        .step_by(2)
        .zip(["pages", "runs", "staged", "direct"])
    {
        // Stores read each shared page twice: both layers' CPU pages hold the tensor's page.
        let store = [GroupIds::blocks(gpu, &[2, 0], cpu, &[1, 3])];
        engine
            .submit_groups(job, &store, Direction::DeviceToHost, None, shape(name))
            .unwrap();
        assert!(finish(&engine, &[job])[0].success, "{name}");
        for (gb, cb) in [(2usize, 1usize), (0, 3)] {
            for (seg, off) in [0usize, 256, 0, 256].into_iter().enumerate() {
                let page = &b.dst[off + gb * 64..off + gb * 64 + 64];
                let at = cb * 256 + seg * 64;
                assert_eq!(&b.src[at..at + 64], page, "{name}");
            }
        }
        // Loads are refused alike, whatever the plan, and write nothing.
        let load = [GroupIds::blocks(cpu, &[1, 3], gpu, &[0, 1])];
        let e = engine
            .submit_groups(job + 1, &load, Direction::HostToDevice, None, shape(name))
            .unwrap_err();
        assert!(
            e.to_string().starts_with(
                "destination pages overlap: segments 0 and 2 of the GPU table share memory"
            ),
            "{name}: {e}"
        );
        assert!(b.dst == gpu_before, "{name}");
        b.src.fill(0);
    }
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
    let (engine, _) = engine_with(&mut b, common::config());
    let (h, d) = (b.src.as_ptr() as u64, b.dst.as_ptr() as u64);
    let table = |base, page: u64, blocks, kind, name: &str, unit| {
        engine
            .register_table(
                TableSpec::new(vec![base], vec![page], vec![page], blocks, kind).named(name, unit),
            )
            .unwrap()
    };
    let gpu0 = table(d, 64, 16, MemoryKind::Device, "GPU", 1);
    let gpu1 = table(d + 1024, 32, 16, MemoryKind::Device, "GPU", 1);
    let cpu0 = table(h, 64, 16, MemoryKind::Host, "CPU", 4);
    let cpu1 = table(h + 1024, 32, 16, MemoryKind::Host, "CPU", 4);
    let group = |src_table, src_ids, dst_table, dst_ids, skip: Option<u64>| GroupIds {
        src_table,
        src_ids,
        dst_table,
        dst_ids,
        chunks: skip.map_or(Chunks::No, Chunks::Skip),
    };
    let store = [
        group(gpu0, &[3u64, 4, 5][..], cpu0, &[1u64, 0][..], Some(2)),
        group(gpu1, &[9], cpu1, &[2], Some(3)),
    ];
    engine
        .submit_groups(1, &store, Direction::DeviceToHost, None, Plan::Pages(None))
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

    // The same store with the skips worked out from the first blocks' indices in their requests
    // (6 and 3: sub-blocks 2 and 3 of the first chunk) moves the same bytes to the same places.
    let before = b.src.clone();
    b.src.fill(0);
    let by_index = [
        GroupIds {
            chunks: Chunks::Index(Some(6)),
            ..store[0]
        },
        GroupIds {
            chunks: Chunks::Index(Some(3)),
            ..store[1]
        },
    ];
    engine
        .submit_groups(
            4,
            &by_index,
            Direction::DeviceToHost,
            None,
            Plan::Pages(None),
        )
        .unwrap();
    assert!(finish(&engine, &[4])[0].success);
    assert_eq!(b.src, before);

    // Load group 1's sub-block 11 into GPU block 0, with group 0 empty, as the block plan.
    let load = [
        group(cpu0, &[], gpu0, &[], Some(0)),
        group(cpu1, &[2], gpu1, &[0], Some(3)),
    ];
    engine
        .submit_groups(2, &load, Direction::HostToDevice, None, Plan::Runs(()))
        .unwrap();
    assert!(finish(&engine, &[2])[0].success);
    assert_eq!(b.dst[1024..1024 + 32], b.src[c1..c1 + 32]);

    // Refusals name the group: a wrong chunk count, a repeated chunk sub-block.
    let bad = [
        group(gpu0, &[1], cpu0, &[0], Some(0)),
        group(gpu1, &[1, 2], cpu1, &[0], Some(3)),
    ];
    let err = engine
        .submit_groups(3, &bad, Direction::DeviceToHost, None, Plan::Pages(None))
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("group 1: 2 GPU blocks from sub-block 3 of the first CPU block take"),
        "{err}"
    );
    let err = engine
        .submit_groups(3, &[], Direction::DeviceToHost, None, Plan::Pages(None))
        .unwrap_err();
    assert!(err.to_string().contains("empty"), "{err}");
    drop(engine);
}

#[test]
fn groups_whose_layers_alternate_move_as_one_transfer_and_a_reused_id_is_checked_again() {
    // Two KV-cache groups whose layers alternate in one GPU allocation (layers 0 and 2, layers 1
    // and 3: 4 blocks of 128 bytes each), and CPU cells holding both groups' pages of a block:
    // the groups' tables overlap by span but never share a byte, which registration finds.
    let mut b = Buffers {
        src: (0..2048u32).map(|i| (i * 11 % 255 + 1) as u8).collect(), // no zero byte
        dst: vec![0; 2048],
    };
    let (engine, _) = engine_with(&mut b, common::config());
    let (h, d) = (b.src.as_ptr() as u64, b.dst.as_ptr() as u64);
    let table = |bases: Vec<u64>, stride: u64, kind, name: &str| {
        engine
            .register_table(
                TableSpec::new(bases, vec![stride; 2], vec![128; 2], 4, kind).named(name, 1),
            )
            .unwrap()
    };
    let gpu0 = table(vec![d, d + 1024], 128, MemoryKind::Device, "GPU");
    let gpu1 = table(vec![d + 512, d + 1536], 128, MemoryKind::Device, "GPU");
    let cpu0 = table(vec![h, h + 128], 512, MemoryKind::Host, "CPU");
    let cpu1 = table(vec![h + 256, h + 384], 512, MemoryKind::Host, "CPU");
    let shape = |name| match name {
        "pages" => Plan::Pages(None),
        "runs" => Plan::Runs(()),
        "direct" => Plan::Staged(StagedRoute {
            direct: true,
            ..StagedRoute::default()
        }),
        _ => Plan::Staged(StagedRoute::default()),
    };
    let mut job = 0;
    // One plan under Miri (each costs minutes there; the others share the rule and the code).
    let plans: &[&str] = if cfg!(miri) {
        &["pages"]
    } else {
        &["pages", "runs", "staged", "direct"]
    };
    for &name in plans {
        b.dst.fill(0);
        job += 1;
        let load = [
            GroupIds::blocks(cpu0, &[1, 2], gpu0, &[3, 0]),
            GroupIds::blocks(cpu1, &[1, 3], gpu1, &[3, 1]),
        ];
        engine
            .submit_groups(job, &load, Direction::HostToDevice, None, shape(name))
            .unwrap();
        assert!(finish(&engine, &[job])[0].success, "{name}");
        // GPU page (layer base, block) <- CPU cell offset of the same layer in block `cb`.
        let moved = [
            (0usize, 3usize, 0usize, 1usize),
            (1024, 3, 128, 1),
            (0, 0, 0, 2),
            (1024, 0, 128, 2),
            (512, 3, 256, 1),
            (1536, 3, 384, 1),
            (512, 1, 256, 3),
            (1536, 1, 384, 3),
        ];
        for (layer, gb, off, cb) in moved {
            let (g, c) = (layer + gb * 128, cb * 512 + off);
            assert_eq!(b.dst[g..g + 128], b.src[c..c + 128], "{name}: GPU byte {g}");
        }
        // Nothing else written.
        assert_eq!(b.dst.iter().filter(|&&x| x != 0).count(), 8 * 128, "{name}");
    }
    // A table registered in group 1's freed id over group 0's pages is not apart from it: a
    // transfer writing the same page from both groups is refused and writes nothing.
    engine.unregister_table(gpu1).unwrap();
    let over = table(vec![d, d + 1024], 128, MemoryKind::Device, "GPU");
    assert_eq!(over, gpu1);
    b.dst.fill(0);
    let load = [
        GroupIds::blocks(cpu0, &[1], gpu0, &[2]),
        GroupIds::blocks(cpu1, &[3], over, &[2]),
    ];
    let e = engine
        .submit_groups(
            job + 1,
            &load,
            Direction::HostToDevice,
            None,
            Plan::Pages(None),
        )
        .unwrap_err();
    assert!(
        matches!(e, EngineError::Table(_)) && e.to_string().contains("overlap"),
        "{e}"
    );
    assert!(b.dst.iter().all(|&x| x == 0));
    drop(engine);
}
