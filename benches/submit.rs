//! Host cost of submitting transfers, on the host backend: build + validate + coalesce + pool
//! acquire/release + submit + poll, per transfer and (throughput) per descriptor, for
//! N = 16, 2,560 and 10,000 descriptors; and the check and plan of a vLLM worker's transfer on
//! its shared region's cells (32 blocks of an 80-layer model, four blocks a chunk).
//!
//! `cargo bench --bench submit`; the figures are recorded in docs/benchmarks.md.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use blockswap::backend::host::HostBackend;
use blockswap::descriptor::{prepare_into, Columns, Scratch};
use blockswap::engine::{Engine, EngineConfig, DEFAULT_STAGE_BYTES};
use blockswap::plan::Plan;
use blockswap::pool::Pool;
use blockswap::region::RegionTable;
use blockswap::table::{
    expand_groups_into, BlockTable, Group, StagedExpansion, STAGED_TABLE_EXTRA,
};
use blockswap::{Direction, MemoryKind};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

const SIZES: [usize; 3] = [16, 2_560, 10_000];
const BLOCK: u64 = 16;

/// Scattered blocks: sources in a shuffled order, destinations in one of three orders.
struct Batch {
    src: Vec<u64>,
    dst: Vec<u64>,
    size: Vec<u64>,
}

#[derive(Clone, Copy)]
enum Dst {
    /// Ascending (the common case: the validation proves disjointness in one pass).
    Ascending,
    /// Shuffled slots of a pool twice the transfer (the overlap check's bucket pass).
    Shuffled,
    /// Shuffled slots of a pool 100 times the transfer (a large CPU cache; its sparse pass).
    Sparse,
}

impl Dst {
    fn name(self) -> &'static str {
        match self {
            Dst::Ascending => "ascending dst",
            Dst::Shuffled => "shuffled dst",
            Dst::Sparse => "sparse shuffled dst",
        }
    }
}

fn shuffled(n: usize, salt: usize, spread: usize) -> Vec<usize> {
    // A fixed permutation with no two neighbours contiguous: i * p mod (spread * n) for p a prime
    // not dividing it.
    let m = spread * n;
    let p = [7919usize, 104_729][salt % 2];
    (0..n).map(|i| (i * p + salt) % m).collect()
}

fn batch(n: usize, src_base: u64, dst_base: u64, order: Dst) -> Batch {
    let s = shuffled(n, 1, 2);
    let d: Vec<usize> = match order {
        Dst::Ascending => (0..n).map(|i| 2 * i).collect(),
        Dst::Shuffled => shuffled(n, 2, 2),
        Dst::Sparse => shuffled(n, 2, 100),
    };
    Batch {
        src: s.iter().map(|&i| src_base + i as u64 * BLOCK).collect(),
        dst: d.iter().map(|&i| dst_base + i as u64 * BLOCK).collect(),
        size: vec![BLOCK; n],
    }
}

fn bench_prepare(c: &mut Criterion) {
    let mut g = c.benchmark_group("prepare (validate + coalesce into slab)");
    let src_base = 1u64 << 32;
    let dst_base = 1u64 << 40;
    let mut regions = RegionTable::default();
    regions.insert(src_base, 1 << 30, MemoryKind::Host).unwrap();
    regions
        .insert(dst_base, 1 << 30, MemoryKind::Device)
        .unwrap();
    for &n in &SIZES {
        for order in [Dst::Ascending, Dst::Shuffled, Dst::Sparse] {
            let b = batch(n, src_base, dst_base, order);
            let (mut s, mut d, mut z) = (vec![0; n], vec![0; n], vec![0; n]);
            let mut scratch = Scratch::default();
            g.throughput(Throughput::Elements(n as u64));
            g.bench_with_input(BenchmarkId::new(order.name(), n), &n, |bench, _| {
                bench.iter(|| {
                    prepare_into(
                        blockswap::descriptor::Batch {
                            src: &b.src,
                            dst: &b.dst,
                            size: &b.size,
                        },
                        Direction::HostToDevice,
                        &regions,
                        true,
                        Columns {
                            src: &mut s,
                            dst: &mut d,
                            size: &mut z,
                        },
                        &mut scratch,
                    )
                    .unwrap()
                });
            });
        }
    }
    g.finish();
}

fn bench_pool(c: &mut Criterion) {
    let pool = Pool::new(Arc::new(HostBackend::new()), 256 << 20);
    let mut g = c.benchmark_group("pool acquire + release");
    for &n in &SIZES {
        pool.release(pool.acquire(n).unwrap()); // warm
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |bench, &n| {
            bench.iter(|| pool.release(black_box(pool.acquire(n).unwrap())));
        });
    }
    g.finish();
}

/// The whole submission as a caller sees it: `Engine::submit` (validate, coalesce, slab, record,
/// enqueue). Only the submit call is timed; the copies and the poll that frees the slot are not.
fn bench_submit(c: &mut Criterion) {
    let mut g = c.benchmark_group("engine submit (host backend)");
    g.measurement_time(Duration::from_secs(4));
    let n_max = *SIZES.iter().max().unwrap();
    let src_buf = vec![1u8; 2 * n_max * BLOCK as usize];
    let mut dst_buf = vec![0u8; 2 * n_max * BLOCK as usize];
    let engine = Engine::new(Arc::new(HostBackend::new()), EngineConfig::default());
    // SAFETY: the buffers outlive the engine (dropped at the end of this function, after it).
    unsafe {
        engine
            .register(
                src_buf.as_ptr() as u64,
                src_buf.len() as u64,
                MemoryKind::Host,
            )
            .unwrap();
        engine
            .register(
                dst_buf.as_mut_ptr() as u64,
                dst_buf.len() as u64,
                MemoryKind::Device,
            )
            .unwrap();
    }
    let mut results = Vec::new();
    let mut job = 0u64;
    for &n in &SIZES {
        // Sparse destinations need a pool 100x the transfer: the prepare group measures them.
        for order in [Dst::Ascending, Dst::Shuffled] {
            let b = batch(n, src_buf.as_ptr() as u64, dst_buf.as_ptr() as u64, order);
            g.throughput(Throughput::Elements(n as u64));
            g.bench_with_input(BenchmarkId::new(order.name(), n), &n, |bench, _| {
                bench.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        job += 1;
                        let t = Instant::now();
                        engine
                            .submit(job, &b.src, &b.dst, &b.size, Direction::HostToDevice, None)
                            .unwrap();
                        total += t.elapsed();
                        engine.wait(&[job], None).unwrap();
                        results.clear();
                        engine.get_finished(&mut results);
                    }
                    total
                });
            });
        }
    }
    g.finish();

    let mut g = c.benchmark_group("engine poll");
    g.bench_function("get_finished, nothing finished", |bench| {
        bench.iter(|| {
            results.clear();
            engine.get_finished(black_box(&mut results));
        });
    });
    g.finish();
    drop(engine);
    drop((src_buf, dst_buf));
}

/// The check and plan of a vLLM worker's transfer on its shared region (the engine's fill, run
/// under its submit lock): 32 random GPU blocks of an 80-layer model (a 16 KiB page per layer
/// and block, separately allocated tensors) to or from 8 random chunks of four blocks, one group
/// per sub-block index (the cell plan: rows of each chunk's cell moved whole). The GPU side is
/// registered once per group, as the worker registers it.
fn bench_region_cells(c: &mut Criterion) {
    const LAYERS: usize = 80;
    const PAGE: u64 = 16 << 10;
    const UNIT: u64 = 4;
    const CHUNKS: u64 = 128;
    const GPU_BLOCKS: u64 = 512;
    let cell = PAGE * LAYERS as u64 * UNIT;
    let (host_base, gpu_base) = (1u64 << 40, 1u64 << 44);
    let tensor_bytes = PAGE * GPU_BLOCKS + (1 << 20); // allocations apart, as torch's are
    let mut regions = RegionTable::default();
    regions
        .insert(host_base, cell * CHUNKS, MemoryKind::Host)
        .unwrap();
    regions
        .insert(gpu_base, tensor_bytes * LAYERS as u64, MemoryKind::Device)
        .unwrap();
    let hosts: Vec<BlockTable> = (0..UNIT)
        .map(|j| {
            let bases = (0..LAYERS as u64)
                .map(|t| host_base + t * PAGE * UNIT + j * PAGE)
                .collect();
            BlockTable::new(
                bases,
                vec![cell; LAYERS],
                vec![PAGE; LAYERS],
                CHUNKS,
                MemoryKind::Host,
                &regions,
            )
            .unwrap()
        })
        .collect();
    let gpus: Vec<BlockTable> = (0..UNIT)
        .map(|_| {
            let bases = (0..LAYERS as u64)
                .map(|t| gpu_base + t * tensor_bytes)
                .collect();
            BlockTable::new(
                bases,
                vec![PAGE; LAYERS],
                vec![PAGE; LAYERS],
                GPU_BLOCKS,
                MemoryKind::Device,
                &regions,
            )
            .unwrap()
        })
        .collect();
    // 32 GPU blocks (a fixed shuffle) into chunks 0, 16, 32, ... (apart, as a used cache's are),
    // block k of the transfer at sub-block k % 4 of chunk k / 4.
    let gpu_ids: Vec<u64> = shuffled(32, 1, 8).into_iter().map(|i| i as u64).collect();
    let ids: Vec<(Vec<u64>, Vec<u64>)> = (0..UNIT as usize)
        .map(|j| {
            let g = gpu_ids
                .iter()
                .skip(j)
                .step_by(UNIT as usize)
                .copied()
                .collect();
            let c = (0..8).map(|k| k * 16).collect();
            (g, c)
        })
        .collect();
    let blocks = gpu_ids.len();
    let rows = blocks * LAYERS;
    let len = rows + blocks + UNIT as usize * (2 * LAYERS + STAGED_TABLE_EXTRA);
    let (mut a, mut b, mut z) = (vec![0; len], vec![0; len], vec![0; len]);
    let mut scratch = Scratch::default();
    let mut bufs = [Vec::new(), Vec::new()];
    let mut g = c.benchmark_group("vLLM region cells (32 blocks, 80 layers, 4 a chunk)");
    for store in [true, false] {
        let groups: Vec<Group<'_>> = ids
            .iter()
            .zip(hosts.iter().zip(&gpus))
            .map(|((g, c), (host, gpu))| {
                if store {
                    Group {
                        src: gpu,
                        src_ids: g,
                        dst: host,
                        dst_ids: c,
                        chunks: None,
                    }
                } else {
                    Group {
                        src: host,
                        src_ids: c,
                        dst: gpu,
                        dst_ids: g,
                        chunks: None,
                    }
                }
            })
            .collect();
        let plan = Plan::Staged(StagedExpansion {
            rows,
            blocks,
            host_src: !store,
            merge: 1 << 20,
            cells: true,
            slot: DEFAULT_STAGE_BYTES,
            direct: false,
        });
        g.bench_function(if store { "store" } else { "load" }, |bench| {
            bench.iter(|| {
                let cols = Columns {
                    src: &mut a,
                    dst: &mut b,
                    size: &mut z,
                };
                expand_groups_into(&groups, plan, cols, &mut scratch, &mut bufs, false).unwrap()
            });
        });
    }
    g.finish();
}

criterion_group!(
    benches,
    bench_prepare,
    bench_pool,
    bench_submit,
    bench_region_cells
);
criterion_main!(benches);
