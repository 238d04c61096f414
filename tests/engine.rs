//! Engine integration tests on the host backend: bytes, coalescing, results, refusals.

use std::sync::Arc;
use std::time::Duration;

use blockswap::backend::host::HostBackend;
use blockswap::engine::{Engine, EngineConfig, EngineError};
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
    let n = 2560usize;
    let block = 4096usize;
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
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
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
