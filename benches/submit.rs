//! Host cost of submitting transfers, on the host backend: build + validate + coalesce + pool
//! acquire/release + submit + poll, per transfer and (throughput) per descriptor, for
//! N = 16, 2,560 and 10,000 descriptors.
//!
//! `cargo bench --bench submit`; the figures are recorded in docs/benchmarks.md.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use blockswap::backend::host::HostBackend;
use blockswap::descriptor::{prepare_into, Columns, Scratch};
use blockswap::engine::{Engine, EngineConfig};
use blockswap::pool::Pool;
use blockswap::region::RegionTable;
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

criterion_group!(benches, bench_prepare, bench_pool, bench_submit);
criterion_main!(benches);
