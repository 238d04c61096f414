use crate::sync::MutexExt;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::driver::result;
use cudarc::driver::sys;

use super::backend::CudaBackend;
use super::driver::{check, driver_available, hooks, missing_symbol};
use super::options::{AccessOrder, CompletionMode, CopyPath, CudaOptions};
use super::query::{driver_has, host_device_pointer, memcpy, memory_kind};
use super::resources::{bind, DeviceMem, PinnedHost, PrimaryCtx, Stream};
use crate::backend::{Backend, BackendError};
use crate::direction::Direction;
use crate::engine::{Engine, EngineConfig};
use crate::region::MemoryKind;

/// The tests that make a backend share the device's primary context, whose state some check.
fn gpu() -> MutexGuard<'static, ()> {
    static GPU: Mutex<()> = Mutex::new(());
    GPU.locked()
}

/// Driver resources alive that this thread made.
fn live() -> i64 {
    hooks::LIVE.with(std::cell::Cell::get)
}

fn device0() -> sys::CUdevice {
    driver_available().expect("a CUDA driver");
    let mut dev = 0;
    // SAFETY: symbols checked; writes one handle.
    check("cuDeviceGet", unsafe { sys::cuDeviceGet(&raw mut dev, 0) }).expect("device 0");
    dev
}

/// Whether anyone holds a reference to device 0's primary context.
fn primary_ctx_active() -> bool {
    let (mut flags, mut active) = (0u32, 0i32);
    // SAFETY: writes two ints.
    check("cuDevicePrimaryCtxGetState", unsafe {
        sys::cuDevicePrimaryCtxGetState(device0(), &raw mut flags, &raw mut active)
    })
    .expect("primary context state");
    active != 0
}

/// Constructions failing at each driver resource in turn: `(step, error)` of each, then the
/// number of steps of the one that succeeds (dropped at once).
fn fail_at_each_step(opts: &CudaOptions) -> (Vec<(usize, BackendError)>, usize) {
    let mut failures = Vec::new();
    for step in 0.. {
        hooks::FAIL_AT.with(|f| f.set(Some(step)));
        let made = CudaBackend::new(opts.clone());
        hooks::FAIL_AT.with(|f| f.set(None));
        match made {
            Err(e) => failures.push((step, e)),
            Ok(b) => {
                drop(b);
                return (failures, step);
            }
        }
    }
    unreachable!()
}

#[test]
#[ignore = "needs CUDA"]
fn a_construction_failing_at_any_resource_frees_all_it_made() {
    let _gpu = gpu();
    // A reference of our own keeps the context alive across the attempts (a primary context
    // is slow to create); the next test checks the driver's own count.
    let held = PrimaryCtx::retain(device0()).expect("retain");
    let before = live();
    for completion in [CompletionMode::Event, CompletionMode::Auto] {
        let opts = CudaOptions {
            completion,
            timing: true,
            max_in_flight: 3,
            ..CudaOptions::new(0)
        };
        let (failures, steps) = fail_at_each_step(&opts);
        // The context, the counters, a stream per lane, and the rings of 6 (the events a
        // lane records callers' streams with are made on its first transfers).
        let rings = if completion == CompletionMode::Event {
            3
        } else {
            2
        };
        assert_eq!(steps, 2 + 4 + 4 * 6 * rings, "{completion:?}");
        assert_eq!(failures.len(), steps);
        for (step, e) in failures {
            assert!(e.to_string().contains("injected"), "{step}: {e}");
            assert_eq!(
                live(),
                before,
                "{completion:?}: step {step} left resources alive"
            );
        }
        assert_eq!(live(), before);
    }
    drop(held);
}

#[test]
#[ignore = "needs CUDA"]
fn a_failed_construction_releases_the_primary_context() {
    let _gpu = gpu();
    assert!(
        !primary_ctx_active(),
        "something else holds the primary context"
    );
    // A legacy default stream is refused before any driver resource exists.
    let mut opts = CudaOptions::new(0);
    opts.streams[Direction::DeviceToHost.lane()] = Some(1);
    let e = CudaBackend::new(opts).expect_err("stream 1 is refused");
    assert!(matches!(e, BackendError::InvalidArgument(_)), "{e}");
    assert!(!primary_ctx_active(), "the context reference leaked");
    // Failures after the context: at the counters, at the third lane's stream, mid-ring.
    let opts = CudaOptions {
        completion: CompletionMode::Event,
        max_in_flight: 3,
        ..CudaOptions::new(0)
    };
    for step in [1, 6, 20] {
        hooks::FAIL_AT.with(|f| f.set(Some(step)));
        let made = CudaBackend::new(opts.clone());
        hooks::FAIL_AT.with(|f| f.set(None));
        assert!(made.is_err(), "step {step}");
        assert!(
            !primary_ctx_active(),
            "step {step}: the context reference leaked"
        );
    }
    drop(CudaBackend::new(opts).expect("a backend"));
    assert!(
        !primary_ctx_active(),
        "a backend dropped keeps its context reference"
    );
}

#[test]
#[ignore = "needs CUDA"]
fn the_event_ring_holds_what_the_engine_lets_into_flight() {
    let _gpu = gpu();
    let opts = CudaOptions {
        completion: CompletionMode::Event,
        max_in_flight: usize::MAX,
        ..CudaOptions::new(0)
    };
    let backend = Arc::new(CudaBackend::new(opts).expect("a backend"));
    // The engine refuses a setting past the limit; the backend, given one, clamps it.
    let engine = Engine::new(
        backend.clone(),
        EngineConfig {
            max_in_flight: super::super::MAX_IN_FLIGHT,
            ..EngineConfig::default()
        },
    );
    let clamped = engine.config().max_in_flight;
    assert_eq!(clamped, super::super::MAX_IN_FLIGHT);
    assert_eq!(backend.opts.max_in_flight, clamped);
    for l in backend.lanes.iter() {
        assert_eq!(l.done_events.len(), 2 * clamped);
    }
}

/// A stream of the caller's held back until `open`: the transfers that wait for it cannot
/// finish before then.
struct Gate {
    flag: PinnedHost,
    stream: Stream,
}

impl Gate {
    fn new(ctx: sys::CUcontext) -> Gate {
        let _bound = bind(ctx).expect("bind");
        let flag = PinnedHost::alloc(ctx, 64).expect("flag");
        let mut flag_dev = 0;
        // SAFETY: the flag is mapped pinned memory; writes one device pointer.
        check("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&raw mut flag_dev, flag.as_ptr().cast::<c_void>(), 0)
        })
        .expect("device pointer");
        let stream = Stream::create(ctx).expect("stream");
        // SAFETY: valid stream and mapped address, alive until the gate drops (after `open`).
        check("cuStreamWaitValue32", unsafe {
            sys::cuStreamWaitValue32_v2(
                stream.raw,
                flag_dev,
                1,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
        })
        .expect("wait value");
        Gate { flag, stream }
    }

    fn raw(&self) -> u64 {
        self.stream.raw as u64
    }

    /// The flag's address, for a thread that opens the gate while it lives.
    fn flag(&self) -> usize {
        self.flag.as_ptr() as usize
    }

    fn open(&self) {
        open_flag(self.flag());
    }

    /// Opens the gate and waits for its stream.
    fn drain(&self) {
        self.open();
        let _bound = bind(self.stream.ctx).expect("bind");
        // SAFETY: a valid stream; the gate is open, so this returns.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.stream.raw)
        })
        .expect("the gated stream ran");
    }
}

fn open_flag(flag: usize) {
    // SAFETY: 4 aligned bytes of a live gate's flag; the device only reads them.
    unsafe { AtomicU32::from_ptr(flag as *mut u32) }.store(1, Ordering::Release);
}

/// An engine on `backend` whose h2d and d2h transfers (job ids 1 and 2, one MiB each between
/// an engine buffer and device memory) wait for a closed gate.
fn held_transfers(backend: &Arc<CudaBackend>, timeout: Duration) -> (Engine, Gate, u64) {
    let gate = Gate::new(backend.ctx.raw);
    let engine = Engine::new(
        backend.clone(),
        EngineConfig {
            shutdown_timeout: timeout,
            ..EngineConfig::default()
        },
    );
    let n = 1u64 << 20;
    let (host, dev) = host_and_device(&engine, backend, n); // freed by the caller after the drain
    let w = Some(gate.raw());
    engine
        .submit(1, &[host], &[dev], &[n], Direction::HostToDevice, w)
        .expect("submit h2d");
    engine
        .submit(2, &[dev], &[host], &[n], Direction::DeviceToHost, w)
        .expect("submit d2h");
    (engine, gate, dev)
}

/// `n` bytes of the engine's host memory, and `n` bytes of device memory registered with it,
/// which the caller frees ([`free_device`]) once the engine copies to it no more.
fn host_and_device(engine: &Engine, backend: &CudaBackend, n: u64) -> (u64, sys::CUdeviceptr) {
    let host = engine.alloc_host(n as usize).expect("host buffer");
    let dev = {
        let _bound = bind(backend.ctx.raw).expect("bind");
        // SAFETY: a plain device allocation, freed by the caller with `free_device`.
        unsafe { result::malloc_sync(n as usize) }.expect("device memory")
    };
    // SAFETY: device memory of `n` bytes, which the caller frees only once the engine's
    // transfers are done.
    unsafe { engine.register(dev, n, MemoryKind::Device) }.expect("register");
    (host, dev)
}

fn free_device(backend: &CudaBackend, dev: sys::CUdeviceptr) {
    let _bound = bind(backend.ctx.raw).expect("bind");
    // SAFETY: from malloc_sync; the gate is drained, so no copy uses it.
    unsafe { result::free_sync(dev) }.expect("free device memory");
}

#[test]
#[ignore = "needs CUDA"]
fn shutdown_keeps_its_deadline_and_frees_nothing_the_device_may_reach() {
    let _gpu = gpu();
    let backend = Arc::new(CudaBackend::new(CudaOptions::new(0)).expect("a backend"));
    let (engine, gate, dev) = held_transfers(&backend, Duration::from_millis(200));
    let (stop, stopped) = mpsc::channel::<()>();
    let flag = gate.flag();
    std::thread::scope(|s| {
        // A watchdog: a shutdown that waits for the gate fails the timing check, not hangs.
        // Scoped: it ends before the gate does.
        s.spawn(move || {
            if stopped.recv_timeout(Duration::from_secs(5)).is_err() {
                open_flag(flag);
            }
        });
        let started = Instant::now();
        engine.shutdown();
        let took = started.elapsed();
        let _ = stop.send(());
        assert!(
            took >= Duration::from_millis(200) && took < Duration::from_secs(2),
            "shutdown took {took:?} with a 200 ms timeout"
        );
    });
    let mut results = Vec::new();
    engine.get_finished(&mut results);
    results.sort_by_key(|r| r.job_id);
    assert_eq!(results.iter().map(|r| r.job_id).collect::<Vec<_>>(), [1, 2]);
    for r in &results {
        assert!(!r.success, "{r:?}");
        assert!(
            r.error.as_deref().unwrap_or("").contains("shut down"),
            "{r:?}"
        );
    }
    assert_eq!(
        backend.shutdown(Some(Instant::now())),
        2,
        "both left in flight"
    );
    for d in [Direction::HostToDevice, Direction::DeviceToHost] {
        assert_eq!(
            backend.lane_error(d),
            Some(BackendError::StillInFlight { transfers: 1 })
        );
    }
    // The engine goes while the device may still read its slabs: they wait in the backend.
    drop(engine);
    let waiting = backend.deferred.lock().unwrap().len();
    assert!(waiting > 0, "the pool's slabs were freed under the device");
    // The transfers run once the gate opens, and what they use is still there. (`wait` says
    // no at once for a lane shutdown gave up on: the context's synchronize waits instead.)
    gate.drain();
    {
        let _bound = bind(backend.ctx.raw).unwrap();
        // SAFETY: no argument; reports a fault of any work in the context.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() }).expect("no fault");
    }
    for d in [Direction::HostToDevice, Direction::DeviceToHost] {
        assert_eq!(backend.completed(d), 1, "{d:?} ran after the shutdown");
    }
    free_device(&backend, dev);
    drop(gate);
    let before = live();
    let backend = Arc::into_inner(backend).expect("the last reference");
    drop(backend);
    // 4 streams, the 2 events the transfers' lanes recorded the gate's stream with, the
    // counters and the context: every lane is idle now.
    assert_eq!(live(), before - 8, "an idle backend frees everything");
}

#[test]
#[ignore = "needs CUDA"]
fn a_backend_dropped_under_running_copies_leaks_rather_than_frees() {
    let _gpu = gpu();
    let backend = Arc::new(CudaBackend::new(CudaOptions::new(0)).expect("a backend"));
    let ctx = backend.ctx.raw;
    let (engine, gate, dev) = held_transfers(&backend, Duration::ZERO);
    engine.shutdown();
    drop(engine);
    let before = live();
    drop(Arc::into_inner(backend).expect("the last reference"));
    // Streams and events go (the driver releases them after their work); the counters the
    // streams will write, and the context reference, stay.
    assert_eq!(live(), before - 6);
    assert!(primary_ctx_active());
    gate.drain();
    let bound = bind(ctx).unwrap();
    // SAFETY: no argument; reports a fault of any work in the context.
    check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
        .expect("the copies and completion writes ran into memory still allocated");
    // SAFETY: from malloc_sync; the context is idle.
    unsafe { result::free_sync(dev) }.unwrap();
    drop(gate);
    drop(bound);
    // Give back the reference the backend kept, for the tests after this one.
    // SAFETY: one reference was leaked by the drop above.
    unsafe { result::primary_ctx::release(device0()) }.unwrap();
}

#[test]
fn a_staged_transfer_copies_only_the_entries_it_uses() {
    // A transfer of 600 block entries from entry 40, in a slab of 1,024 entries a column.
    let (first, n, cap) = (40usize, 600usize, 1024usize);
    let copy = super::stage::EntryCopy::new(first, n, cap);
    assert_eq!(
        copy.device_bytes(),
        3 * 8 * n,
        "only the entries in use cross"
    );
    assert_eq!(
        (copy.src_offset, copy.src_pitch),
        (8 * first as u64, 8 * cap)
    );
    // Entry i of column c is found where the packed copy put it.
    let dev = 1 << 40;
    for c in 0..3 {
        for i in [first, first + 1, first + n - 1] {
            let at = copy.column(dev, c) + 8 * i as u64;
            assert_eq!(at, dev + (8 * (c * n + i - first)) as u64);
        }
    }
}

#[test]
fn parses_settings() {
    assert_eq!("loop".parse::<CopyPath>(), Ok(CopyPath::Loop));
    assert!("fast".parse::<CopyPath>().is_err());
    assert_eq!("any".parse::<AccessOrder>(), Ok(AccessOrder::Any));
    assert_eq!("event".parse::<CompletionMode>(), Ok(CompletionMode::Event));
    let o = CudaOptions::new(0);
    assert_eq!(
        o.access_order[Direction::HostToDevice.lane()],
        AccessOrder::Any
    );
    assert_eq!(
        o.access_order[Direction::DeviceToHost.lane()],
        AccessOrder::Stream
    );
}

#[test]
fn a_missing_symbol_is_named_not_a_panic() {
    // libc stands in for a driver library that lacks the CUDA entry points.
    // SAFETY: opening libc has no initialisation side effects.
    let lib = unsafe { libloading::Library::new("libc.so.6") }.expect("libc");
    assert_eq!(
        missing_symbol(&lib, &["malloc", "cuMemcpyBatchAsync"]),
        Some("cuMemcpyBatchAsync")
    );
    assert_eq!(missing_symbol(&lib, &["malloc", "free"]), None);
}

#[test]
fn without_a_driver_the_backend_reports_why() {
    let _gpu = gpu();
    match CudaBackend::new(CudaOptions::new(0)) {
        Ok(b) => assert_eq!(b.info().name, "cuda"), // a machine with a GPU
        Err(e) => {
            let msg = e.to_string();
            assert!(
                matches!(
                    e,
                    BackendError::Unavailable(_) | BackendError::Driver { .. }
                ),
                "{msg}"
            );
            assert!(!msg.is_empty());
        }
    }
}

#[test]
fn the_queries_answer_for_memory_no_driver_knows() {
    // Pageable memory of this process: no driver knows it, where there is a driver at all.
    let local = [0u8; 64];
    let addr = local.as_ptr() as u64;
    assert_eq!(memory_kind(addr), None);
    if !driver_has("cuMemcpy") {
        assert_eq!(host_device_pointer(addr), Ok(None));
        let mut out = [0u8; 64];
        // SAFETY: two live local arrays of 64 bytes.
        let e = unsafe { memcpy(out.as_mut_ptr() as u64, addr, 64) }.unwrap_err();
        assert!(matches!(e, BackendError::Unavailable(_)), "{e}");
    }
}

#[test]
#[ignore = "needs CUDA"]
fn the_queries_name_pinned_and_device_memory_and_copy_between_them() {
    let _gpu = gpu();
    let backend = CudaBackend::new(CudaOptions::new(0)).expect("a backend");
    let ctx = backend.ctx.raw;
    let host = PinnedHost::alloc(ctx, 64).expect("pinned memory");
    let dev = DeviceMem::alloc(ctx, 64).expect("device memory");
    let mut local = [7u8; 64];
    let (pinned, pageable) = (host.as_ptr() as u64, local.as_mut_ptr() as u64);
    let _bound = bind(ctx).expect("bind");
    assert_eq!(memory_kind(pinned), Some(MemoryKind::Host));
    assert_eq!(memory_kind(dev.ptr), Some(MemoryKind::Device));
    assert_eq!(memory_kind(pageable), None);
    // Unified addressing: the device reaches mapped pinned memory at its host address.
    assert_eq!(host_device_pointer(pinned), Ok(Some(pinned)));
    let refused = host_device_pointer(pageable);
    assert!(
        matches!(
            refused,
            Err(BackendError::Driver {
                call: "cuMemHostGetDevicePointer",
                ..
            })
        ),
        "{refused:?}"
    );
    // SAFETY: 64 bytes in each of three live allocations, none overlapping; both copies
    // touch host memory, so each is done when it returns.
    unsafe {
        memcpy(dev.ptr, pageable, 64).expect("host to device");
        memcpy(pinned, dev.ptr, 64).expect("device to host");
    }
    // SAFETY: the 64 bytes of pinned memory the second copy wrote.
    let back = unsafe { std::slice::from_raw_parts(host.as_ptr(), 64) };
    assert_eq!(back, &[7u8; 64]);
}

#[test]
#[ignore = "needs CUDA"]
fn a_prepared_stage_is_made_once_whatever_failed_before_and_keeps_its_slot_size() {
    let _gpu = gpu();
    let held = PrimaryCtx::retain(device0()).expect("retain");
    let (h2d, d2h) = (Direction::HostToDevice, Direction::DeviceToHost);
    let slot = 1 << 20;
    // CPU -> GPU with its ring: a stream, 8 events, the ring, two descriptor buffers;
    // GPU -> CPU without: the stream and the events.
    let (with_ring, bare): (i64, i64) = (12, 9);
    for step in 0..12 {
        let backend = CudaBackend::new(CudaOptions::new(0)).expect("a backend");
        let before = live();
        hooks::FAIL_AT.with(|f| f.set(Some(step)));
        let e = backend
            .prepare_staged(h2d, slot, true)
            .expect_err("injected");
        hooks::FAIL_AT.with(|f| f.set(None));
        assert!(e.to_string().contains("injected"), "{step}: {e}");
        // What was made before the failure may stay for the next call, but only one stage.
        backend.prepare_staged(h2d, slot, true).expect("prepared");
        assert_eq!(
            live() - before,
            with_ring,
            "{step}: one stage after a failure"
        );
    }
    let backend = CudaBackend::new(CudaOptions::new(0)).expect("a backend");
    let before = live();
    backend.prepare_staged(h2d, slot, true).expect("prepared");
    backend
        .prepare_staged(h2d, slot, true)
        .expect("prepared again");
    assert_eq!(
        live() - before,
        with_ring,
        "a prepared stage is kept, not made again"
    );
    let e = backend
        .prepare_staged(h2d, 2 * slot, true)
        .expect_err("another slot size");
    assert!(
        matches!(&e, BackendError::InvalidArgument(m) if m.contains("staging slots are 1048576 bytes, not the 2097152 asked for")),
        "{e}"
    );
    backend.prepare_staged(d2h, slot, false).expect("prepared");
    assert_eq!(live() - before, with_ring + bare);
    backend.prepare_staged(d2h, slot, true).expect("its ring");
    assert_eq!(live() - before, with_ring + bare + 1);
    drop(backend);
    drop(held);
}

#[test]
#[ignore = "needs CUDA"]
fn the_threads_across_pcie_start_with_the_backend() {
    let _gpu = gpu();
    let backend = CudaBackend::new(CudaOptions::new(0)).expect("a backend");
    let started = Direction::ALL.map(|d| backend.worker_started(d));
    for d in Direction::ALL {
        assert_eq!(started[d.lane()], d.crosses(), "{d:?}");
    }
    drop(backend);
}

#[test]
#[ignore = "needs CUDA"]
fn a_lanes_thread_stays_warm_for_keep_warm_after_a_transfer_then_sleeps() {
    let _gpu = gpu();
    let polls = |b: &CudaBackend, d: Direction| b.lane(d).warm_polls.load(Ordering::Relaxed);
    for keep in [Duration::ZERO, Duration::from_millis(40)] {
        let mut opts = CudaOptions::new(0);
        opts.keep_warm = keep;
        let backend = Arc::new(CudaBackend::new(opts).expect("a backend"));
        let engine = Engine::new(backend.clone(), EngineConfig::default());
        let n = 4096u64;
        let (host, dev) = host_and_device(&engine, &backend, n); // freed below once drained
                                                                 // A thread never stays warm before its first transfer.
        std::thread::sleep(Duration::from_millis(10));
        assert_eq!(polls(&backend, Direction::HostToDevice), 0, "{keep:?}");
        for job in 1..=2 {
            engine
                .submit(job, &[host], &[dev], &[n], Direction::HostToDevice, None)
                .expect("submit");
            engine
                .wait(&[job], Some(Duration::from_secs(5)))
                .expect("done");
            // The second transfer comes while the thread is kept warm.
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut results = Vec::new();
        engine.get_finished(&mut results);
        assert!(
            results.len() == 2 && results.iter().all(|r| r.success),
            "{results:?}"
        );
        let (h2d, d2h) = (
            polls(&backend, Direction::HostToDevice),
            polls(&backend, Direction::DeviceToHost),
        );
        if keep.is_zero() {
            assert_eq!(h2d, 0, "no keep_warm: the thread sleeps");
        } else {
            // 20 ms after each of two transfers, a call every 100 µs, timers' slack allowed for.
            assert!(h2d >= 20, "kept warm: {h2d} calls");
        }
        assert_eq!(d2h, 0, "a lane that issued nothing stays asleep");
        // Past the window the thread sleeps: no more calls.
        std::thread::sleep(keep + Duration::from_millis(20));
        let settled = polls(&backend, Direction::HostToDevice);
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(
            polls(&backend, Direction::HostToDevice),
            settled,
            "{keep:?}"
        );
        engine.shutdown();
        drop(engine);
        free_device(&backend, dev);
    }
}

#[test]
#[ignore = "needs CUDA"]
fn a_lanes_thread_that_panics_fails_its_transfers_and_never_leaves_a_wait_hanging() {
    let _gpu = gpu();
    let mut opts = CudaOptions::new(0);
    opts.idle_issue = false; // every transfer goes to the lane's thread
    let backend = Arc::new(CudaBackend::new(opts).expect("a backend"));
    let engine = Arc::new(Engine::new(backend.clone(), EngineConfig::default()));
    let n = 1u64 << 16;
    let (host, dev) = host_and_device(&engine, &backend, n); // freed below once shut down
    let h2d = Direction::HostToDevice;
    engine
        .submit(1, &[host], &[dev], &[n], h2d, None)
        .expect("submit");
    engine.wait(&[1], None).expect("done");
    backend.lane(h2d).panic_next.store(true, Ordering::Relaxed);
    engine
        .submit(2, &[host], &[dev], &[n], h2d, None)
        .expect("submit");
    // On its own thread, so that a wait that hangs fails the test rather than hangs it.
    let (tx, rx) = mpsc::channel();
    let other = Arc::clone(&engine);
    let waiting = std::thread::spawn(move || tx.send(other.wait(&[2], None)).unwrap());
    let answer = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("wait returned");
    assert!(answer.is_ok(), "{answer:?}");
    waiting.join().unwrap(); // its reference to the engine is gone
    let mut results = Vec::new();
    engine.get_finished(&mut results);
    results.sort_by_key(|r| r.job_id);
    assert_eq!(results.len(), 2, "{results:?}");
    assert!(results[0].success, "{:?}", results[0]);
    let error = results[1].error.as_deref().unwrap_or("");
    assert!(
        !results[1].success && error.contains("a panic injected into the lane's thread"),
        "{:?}",
        results[1]
    );
    let refused = engine.submit(3, &[host], &[dev], &[n], h2d, None);
    assert!(
        refused
            .as_ref()
            .is_err_and(|e| e.to_string().contains("issuing thread stopped")),
        "{refused:?}"
    );
    // The other direction's thread goes on.
    engine
        .submit(4, &[dev], &[host], &[n], Direction::DeviceToHost, None)
        .expect("submit d2h");
    engine.wait(&[4], None).expect("done");
    results.clear();
    engine.get_finished(&mut results);
    assert!(results.len() == 1 && results[0].success, "{results:?}");
    engine.shutdown();
    assert!(!engine.stats().shutdown_timed_out);
    drop(Arc::into_inner(engine).expect("the last reference"));
    free_device(&backend, dev);
}
