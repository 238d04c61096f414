//! Tests of host buffers: the piece plan, the pieces' table and cut registrations.

use super::*;
use crate::table::TableSpec;
use std::sync::{Arc, Mutex as StdMutex};

#[test]
fn pieces_are_whole_rows_ending_on_pages() {
    const G: u64 = 1 << 30;
    // Fits: one piece, whatever the alignment.
    assert_eq!(plan_pieces(10, 100, 1000, 4096).unwrap(), vec![(0, 1000)]);
    assert_eq!(plan_pieces(3, 4096, 3 * 4096, 4096).unwrap().len(), 1);
    // 10 rows of a page, 3 per piece.
    let p = plan_pieces(10, 4096, 3 * 4096 + 100, 4096).unwrap();
    assert_eq!(
        p,
        vec![
            (0, 3 * 4096),
            (3 * 4096, 3 * 4096),
            (6 * 4096, 3 * 4096),
            (9 * 4096, 4096)
        ]
    );
    // Rows of 1,536 bytes end on a 4,096-byte page every 8 rows (12 KiB): 19 rows fit in
    // 30,000 bytes, 16 are taken.
    let p = plan_pieces(20, 1536, 30_000, 4096).unwrap();
    assert_eq!(p, vec![(0, 24576), (24576, 6144)]);
    let e = plan_pieces(20, 1536, 10_000, 4096).unwrap_err().to_string();
    assert!(e.contains("every 8 rows"), "{e}");
    // 6 GiB of 2 MiB rows in 1 GiB pieces: six of 512 rows, no rounding.
    let p = plan_pieces(3072, 2 << 20, G, 4096).unwrap();
    assert_eq!(p.len(), 6);
    assert!(p.iter().all(|&(_, n)| n == G));
    // The limits.
    let e = plan_pieces(4, 100, 99, 4096).unwrap_err().to_string();
    assert!(e.contains("does not fit in a piece"), "{e}");
    assert!(plan_pieces(0, 100, G, 4096).is_err());
    assert!(plan_pieces(4, 0, G, 4096).is_err());
    assert!(plan_pieces(u64::MAX, 2, G, 4096).is_err());
    assert!(plan_pieces(4, 100, 0, 4096).is_err());
    let e = plan_pieces(4, 100, REGISTRATION_LIMIT, 4096)
        .unwrap_err()
        .to_string();
    assert!(e.contains("or more fails"), "{e}");
    // A terabyte of 2 MiB rows: 256 pieces of 4 GiB by default, each under the limit.
    let p = plan_pieces(1 << 19, 2 << 20, DEFAULT_PIECE_BYTES, 4096).unwrap();
    assert_eq!(p.len(), 256);
    assert!(p.iter().all(|&(_, n)| n < REGISTRATION_LIMIT));
}

proptest::proptest! {
    /// Pieces tile the buffer in order, each of whole rows, at most the piece size (where
    /// there is more than one), every boundary on a page.
    #[test]
    fn pieces_tile_the_buffer(
        rows in 1u64..5000,
        row in 1u64..20_000,
        piece in 1u64..400_000,
        page in proptest::sample::select(vec![1u64, 4096, 65536]),
    ) {
        let Ok(p) = plan_pieces(rows, row, piece, page) else {
            // Refused only where no page-aligned whole number of rows fits.
            let q = page / gcd(row, page);
            proptest::prop_assert!(rows * row > piece && q * row > piece);
            return Ok(());
        };
        let mut at = 0;
        for &(o, n) in &p {
            proptest::prop_assert_eq!(o, at);
            proptest::prop_assert!(n > 0 && n % row == 0);
            if p.len() > 1 {
                proptest::prop_assert!(n <= piece);
                proptest::prop_assert_eq!(o % page, 0);
            }
            at += n;
        }
        proptest::prop_assert_eq!(at, rows * row);
    }
}

/// Records pins and unpins; fails the `fail_at`-th pin (from 0).
#[derive(Debug, Default)]
struct Recorder {
    log: StdMutex<Vec<(char, u64)>>,
    fail_at: Option<usize>,
}

impl Pinner for Arc<Recorder> {
    unsafe fn pin(&self, start: u64, _len: u64) -> Result<(), BackendError> {
        let mut log = self.log.lock().unwrap();
        if self.fail_at == Some(log.iter().filter(|e| e.0 == 'p').count()) {
            return Err(BackendError::Driver {
                call: "cuMemHostRegister",
                code: 2,
                name: "CUDA_ERROR_OUT_OF_MEMORY".into(),
            });
        }
        log.push(('p', start));
        Ok(())
    }

    unsafe fn unpin(&self, start: u64) -> Result<(), BackendError> {
        self.log.lock().unwrap().push(('u', start));
        Ok(())
    }
}

#[test]
fn a_buffer_pins_its_pieces_and_unpins_them_once() {
    let rec = Arc::new(Recorder::default());
    let b = HostBuffer::new(10, 4096, 3 * 4096, Some(Box::new(rec.clone()))).unwrap();
    assert_eq!(b.len(), 10 * 4096);
    assert_eq!(b.pieces().len(), 4);
    assert!(b.is_pinned());
    // Zeroed, and every byte writable.
    // SAFETY: the buffer's own mapping, alive until `b` drops.
    let bytes = unsafe { std::slice::from_raw_parts_mut(b.addr() as *mut u8, 10 * 4096) };
    assert!(bytes.iter().all(|&x| x == 0));
    bytes.fill(7);
    let starts: Vec<u64> = b.pieces().iter().map(|p| p.0).collect();
    let pins: Vec<(char, u64)> = starts.iter().map(|&s| ('p', s)).collect();
    assert_eq!(*rec.log.lock().unwrap(), pins);
    b.unpin().unwrap();
    b.unpin().unwrap();
    assert!(!b.is_pinned());
    drop(b);
    let log = rec.log.lock().unwrap();
    let unpins: Vec<(char, u64)> = starts.iter().map(|&s| ('u', s)).collect();
    assert_eq!(log[4..], unpins[..], "each piece unpinned once: {log:?}");
}

#[test]
fn progress_counts_the_faulted_and_the_locked_bytes() {
    let progress = AllocProgress::default();
    let rec = Arc::new(Recorder::default());
    let b = HostBuffer::with_progress(10, 4096, 3 * 4096, Some(Box::new(rec)), Some(&progress))
        .unwrap();
    assert_eq!(progress.get(), (10 * 4096, 10 * 4096, 10 * 4096, 10 * 4096));
    drop(b);
    // Without a pinner nothing is faulted in or locked, nor to be: only the size is known.
    let progress = AllocProgress::default();
    let _b = HostBuffer::with_progress(10, 4096, 3 * 4096, None, Some(&progress)).unwrap();
    assert_eq!(progress.get(), (10 * 4096, 0, 0, 0));
}

#[test]
fn a_mapping_that_fails_says_gib_errno_and_what_the_host_has() {
    // 2^47 bytes: the whole of x86-64's user address space, refused whatever the overcommit
    // policy.
    let e = HostBuffer::new(1 << 20, 1 << 27, DEFAULT_PIECE_BYTES, None).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.starts_with("could not map 131072.00 GiB (140737488355328 bytes) of host memory"),
        "{msg}"
    );
    assert!(msg.contains("errno 12 (Cannot allocate memory)"), "{msg}");
    assert!(available_memory().is_some_and(|a| a > 0));
    assert!(msg.contains("; the host has "), "{msg}");
    assert!(msg.ends_with(" GiB available (MemAvailable)"), "{msg}");
}

#[test]
fn a_failed_pin_says_the_size_the_piece_and_what_the_host_has() {
    let rec = Arc::new(Recorder {
        fail_at: Some(1),
        ..Default::default()
    });
    let msg = HostBuffer::new(10, 4096, 3 * 4096, Some(Box::new(rec)))
        .unwrap_err()
        .to_string();
    assert!(msg.starts_with("could not page-lock 0.00 GiB (40960 bytes) of host memory: piece 1 (0.00 GiB at most) failed: cuMemHostRegister failed: CUDA_ERROR_OUT_OF_MEMORY (2); the host has "), "{msg}");
    assert!(msg.ends_with(" available (MemAvailable)"), "{msg}");
}

#[test]
fn a_failed_pin_undoes_the_pieces_before_it() {
    let rec = Arc::new(Recorder {
        fail_at: Some(2),
        ..Default::default()
    });
    let e = HostBuffer::new(10, 4096, 3 * 4096, Some(Box::new(rec.clone()))).unwrap_err();
    assert!(e.to_string().contains("cuMemHostRegister"), "{e}");
    let log = rec.log.lock().unwrap();
    let (a, b) = (log[0].1, log[1].1);
    assert_eq!(*log, vec![('p', a), ('p', b), ('u', b), ('u', a)]);
}

#[test]
fn registrations_are_cut_at_pieces_and_counted() {
    let b = HostBuffer::new(10, 4096, 3 * 4096, None).unwrap();
    assert!(!b.is_pinned());
    let a = b.addr();
    let (parts, ids) = acquire(a + 100, 7 * 4096);
    assert_eq!(
        parts,
        vec![
            (a + 100, 3 * 4096 - 100, false),
            (a + 3 * 4096, 3 * 4096, true),
            (a + 6 * 4096, 4096 + 100, true)
        ]
    );
    assert_eq!(b.users(), 1);
    assert!(matches!(
        b.unpin(),
        Err(HostBufferError::InUse { users: 1 })
    ));
    release(&ids);
    assert_eq!(b.users(), 0);
    // A range outside every buffer is whole; one from a piece's start begins at a seam.
    let (parts, ids) = acquire(8, 16);
    assert_eq!((parts, ids.len()), (vec![(8, 16, false)], 0));
    let (parts, ids) = acquire(a + 3 * 4096, 4096);
    assert_eq!(parts, vec![(a + 3 * 4096, 4096, true)]);
    release(&ids);
    // Dropped while registered: released by the last user.
    let (_, ids) = acquire(a, 4096);
    drop(b);
    assert!(live().iter().any(|l| l.id == ids[0] && l.orphan.is_some()));
    release(&ids);
    assert!(!live().iter().any(|l| l.id == ids[0]));
}

#[test]
fn the_owner_and_the_last_user_letting_go_at_once_release_the_memory_once() {
    // The buffer dropped on one thread while its last registration is released on another:
    // whichever comes second unpins and unmaps, exactly once.
    for _ in 0..300 {
        let rec = Arc::new(Recorder::default());
        let b = HostBuffer::new(4, 4096, 2 * 4096, Some(Box::new(rec.clone()))).unwrap();
        let (_, ids) = acquire(b.addr(), 3 * 4096);
        let id = ids[0];
        let go = Arc::new(std::sync::Barrier::new(2));
        let user = {
            let go = go.clone();
            std::thread::spawn(move || {
                go.wait();
                release(&ids);
            })
        };
        go.wait();
        drop(b);
        user.join().unwrap();
        let log = rec.log.lock().unwrap();
        assert_eq!(log.iter().filter(|e| e.0 == 'u').count(), 2, "{log:?}");
        assert!(!live().iter().any(|l| l.id == id));
    }
}

/// A driver's view of one pinned range: unpinning takes a while, and a registration attempted
/// meanwhile (another thread) notes whether it found the range in no buffer while the driver
/// still held it pinned, which is what lets such a registration through.
#[derive(Debug, Default)]
struct SlowUnpin {
    pinned: std::sync::atomic::AtomicBool,
    racer: StdMutex<Option<std::thread::JoinHandle<(usize, bool)>>>,
}

impl Pinner for Arc<SlowUnpin> {
    unsafe fn pin(&self, _start: u64, _len: u64) -> Result<(), BackendError> {
        self.pinned.store(true, Ordering::SeqCst);
        Ok(())
    }

    unsafe fn unpin(&self, start: u64) -> Result<(), BackendError> {
        let me = self.clone();
        // A registration of the buffer's first page, as `Engine::register` makes it: the
        // buffers it lies in, then the driver's word on the memory (`check_region`).
        *self.racer.lock().unwrap() = Some(std::thread::spawn(move || {
            let (_, ids) = acquire(start, 4096);
            let pinned = me.pinned.load(Ordering::SeqCst);
            release(&ids);
            (ids.len(), pinned)
        }));
        std::thread::sleep(std::time::Duration::from_millis(50));
        self.pinned.store(false, Ordering::SeqCst);
        Ok(())
    }
}

#[test]
fn a_registration_racing_unpin_never_finds_the_memory_pinned_and_unowned() {
    let driver = Arc::new(SlowUnpin::default());
    let b = HostBuffer::new(4, 4096, 4 * 4096, Some(Box::new(driver.clone()))).unwrap();
    b.unpin().unwrap();
    let racer = driver.racer.lock().unwrap().take().expect("unpin ran");
    let (buffers, pinned) = racer.join().unwrap();
    // Either it counted as the buffer's user (then unpin would have been refused) or it saw
    // the memory as the driver leaves it: pageable, so its registration is refused.
    assert!(
        buffers == 1 || !pinned,
        "a registration found no buffer while the memory was still page-locked"
    );
    assert!(!b.is_pinned());
}

#[test]
fn an_engine_registers_a_buffer_piece_by_piece_and_moves_blocks_across_pieces() {
    use crate::backend::host::HostBackend;
    use crate::direction::Direction;
    use crate::engine::{Engine, EngineConfig, EngineError, GroupIds};
    use crate::region::{MemoryKind, RegionError};
    use std::time::Duration;

    // A CPU cache of 10 rows of two 2 KiB pages in pieces of 3 rows, and a "GPU" of 10
    // blocks.
    let (rows, page) = (10u64, 2048u64);
    let cpu = HostBuffer::new(rows, 2 * page, 3 * 2 * page, None).unwrap();
    let mut gpu: Vec<u8> = (0..rows * 2 * page)
        .map(|i| (i * 31 + i / 7) as u8)
        .collect();
    let g = gpu.as_mut_ptr() as u64;
    let engine = Engine::new(Arc::new(HostBackend::new()), EngineConfig::default());
    let c = cpu.addr();
    // SAFETY: both outlive the engine's registrations (unregistered below, then dropped).
    unsafe {
        engine.register(c, cpu.len(), MemoryKind::Host).unwrap();
        engine
            .register(g, gpu.len() as u64, MemoryKind::Device)
            .unwrap();
    }
    assert_eq!(cpu.users(), 1);
    assert!(matches!(
        cpu.unpin(),
        Err(HostBufferError::InUse { users: 1 })
    ));
    // A piece is not a registration of its own.
    assert!(matches!(
        engine.unregister(c + 3 * 2 * page),
        Err(EngineError::Region(RegionError::PartOf { registration, .. })) if registration == c
    ));
    // Block-major: segment s of block b at c + b * row + s * page; layers of the GPU side.
    let cpu_t = engine
        .register_table(
            TableSpec::new(
                vec![c, c + page],
                vec![2 * page; 2],
                vec![page; 2],
                rows,
                MemoryKind::Host,
            )
            .named("CPU", 1),
        )
        .unwrap();
    let gpu_t = engine
        .register_table(
            TableSpec::new(
                vec![g, g + rows * page],
                vec![page; 2],
                vec![page; 2],
                rows,
                MemoryKind::Device,
            )
            .named("GPU", 1),
        )
        .unwrap();
    // Consecutive blocks across both piece boundaries, then back into other blocks.
    let (there, back) = ([1u64, 2, 3, 4, 5, 6, 7], [3u64, 4, 5, 6, 7, 8, 9]);
    engine
        .submit_blocks(
            1,
            GroupIds::blocks(gpu_t, &there, cpu_t, &there),
            Direction::DeviceToHost,
            None,
            None,
        )
        .unwrap();
    engine.wait(&[1], Some(Duration::from_secs(30))).unwrap();
    let want = gpu.clone();
    gpu.fill(0);
    engine
        .submit_block_runs(
            2,
            GroupIds::blocks(cpu_t, &there, gpu_t, &back),
            Direction::HostToDevice,
            None,
        )
        .unwrap();
    engine.wait(&[2], Some(Duration::from_secs(30))).unwrap();
    let mut results = Vec::new();
    engine.get_finished(&mut results);
    assert!(results.iter().all(|r| r.success), "{results:?}");
    for (&s, &d) in there.iter().zip(&back) {
        for l in 0..2 {
            let at = |b: u64| ((l * rows + b) * page) as usize;
            assert_eq!(
                gpu[at(d)..at(d) + page as usize],
                want[at(s)..at(s) + page as usize]
            );
        }
    }
    // Unregistered as one, and the buffer is free to unpin.
    engine.unregister_table(cpu_t).unwrap();
    engine.unregister(c).unwrap();
    assert_eq!(cpu.users(), 0);
    cpu.unpin().unwrap();
    // Registered again after unpinning: one region, no pieces any more.
    // SAFETY: as above.
    unsafe { engine.register(c, cpu.len(), MemoryKind::Host).unwrap() };
    engine.unregister(c).unwrap();
    drop(engine);
    drop(gpu);
}

#[test]
fn an_engine_dropped_with_a_registration_lets_go_of_the_buffer() {
    use crate::backend::host::HostBackend;
    use crate::engine::{Engine, EngineConfig};
    use crate::region::MemoryKind;

    let buf = HostBuffer::new(8, 4096, 2 * 4096, None).unwrap();
    let engine = Engine::new(Arc::new(HostBackend::new()), EngineConfig::default());
    // SAFETY: the buffer outlives the engine.
    unsafe {
        engine
            .register(buf.addr(), buf.len(), MemoryKind::Host)
            .unwrap();
    };
    assert_eq!(buf.users(), 1);
    drop(engine);
    assert_eq!(buf.users(), 0);
    buf.unpin().unwrap();
}
