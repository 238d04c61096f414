"""The CUDA backend on a real GPU. Skipped where there is no GPU and driver."""

from __future__ import annotations

import gc
import multiprocessing as mp
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import blockswap
from blockswap import BackendError, InvalidTransferError, Route

pytestmark = pytest.mark.cuda

KiB, MiB = 1024, 1 << 20


@pytest.fixture(scope="module")
def torch():
    import torch

    return torch


def scattered(rng, sizes, capacity):
    """Disjoint, scattered ranges of the given sizes inside `capacity` bytes (256-aligned)."""
    n = len(sizes)
    slots = ((sizes + 255) // 256) * 256
    order = rng.permutation(n)
    starts = np.zeros(n, dtype=np.int64)
    starts[order] = np.cumsum(slots[order]) - slots[order]
    assert (starts + slots).max() <= capacity
    return starts


def roundtrip(torch, engine, rng, sizes):
    """h2d scattered blocks into device memory, then d2h into a second host buffer; checks both."""
    total = int(((sizes + 255) // 256 * 256).sum()) + MiB
    host = torch.randint(0, 256, (total,), dtype=torch.uint8).pin_memory()
    back = torch.zeros(total, dtype=torch.uint8).pin_memory()
    dev = torch.zeros(total, dtype=torch.uint8, device="cuda")
    for t in (host, back, dev):
        engine.register(t)
    h_off = scattered(rng, sizes, total)
    d_off = scattered(rng, sizes, total)
    engine.submit(1, host.data_ptr() + h_off, dev.data_ptr() + d_off, sizes, "h2d")
    engine.wait([1])
    engine.submit(2, dev.data_ptr() + d_off, back.data_ptr() + h_off, sizes, "d2h")
    engine.wait([2])
    results = {r.job_id: r for r in engine.get_finished()}
    assert results[1].success and results[2].success, results
    assert results[1].bytes == results[2].bytes == int(sizes.sum())
    dev_cpu = dev.cpu()
    for h, d, z in zip(h_off.tolist(), d_off.tolist(), sizes.tolist()):
        assert torch.equal(dev_cpu[d : d + z], host[h : h + z])
    # Every byte of every block came back to where it started; the rest of `back` is untouched.
    mask = torch.zeros(total, dtype=torch.bool)
    for h, z in zip(h_off.tolist(), sizes.tolist()):
        mask[h : h + z] = True
    assert torch.equal(back[mask], host[mask])
    assert not back[~mask].any()
    for t in (host, back, dev):
        engine.unregister(t)


SIZE_SETS = {
    "1B-4MiB log-uniform": lambda rng: np.exp(rng.uniform(0, np.log(4 * MiB), 500)).astype(
        np.int64
    ),
    "4KiB x 2560": lambda rng: np.full(2560, 4 * KiB, dtype=np.int64),
    "odd sizes": lambda rng: rng.integers(1, 100, 3000).astype(np.int64) * 2 + 1,
}


@pytest.mark.parametrize("sizes", list(SIZE_SETS), ids=list(SIZE_SETS))
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"copy_path": "loop"},
        {"h2d_order": "stream", "d2h_order": "stream"},
        {"h2d_order": "any", "d2h_order": "any"},
        {"completion": "event"},
        {"max_batch": 100, "timing": True},
    ],
    ids=["default", "loop", "stream-order", "any-order", "event-completion", "split-timing"],
)
def test_roundtrip_bytes(torch, sizes, options):
    rng = np.random.default_rng(7)
    with blockswap.Engine("cuda", **options) as eng:
        roundtrip(torch, eng, rng, SIZE_SETS[sizes](rng).clip(1, 4 * MiB))


def test_blockswap_can_use_the_gpu_torch_sees():
    ok, why = blockswap.cuda_status()
    assert ok and blockswap.info()["cuda"], why


def test_info_names_the_batch_abi(torch):
    with blockswap.Engine("cuda") as eng:
        i = eng.info()
        assert i["backend"] == "cuda" and i["driver_version"] >= 12000
        if i["driver_version"] >= 12080:
            assert "cuMemcpyBatchAsync" in i["copy_path"]
            want = "13.0" if i["driver_version"] >= 13000 else "12.8"
            assert want in i["copy_path"]
    with blockswap.Engine("cuda", copy_path="loop") as eng:
        assert eng.info()["copy_path"] == "cuMemcpyAsync loop"


def test_d2h_waits_for_the_compute_stream(torch):
    """A kernel on the compute stream is still writing the source when the transfer is submitted:
    with wait_stream the offloaded bytes are the final ones; without it they are not."""
    n = 64 * MiB
    src = torch.zeros(n, dtype=torch.uint8, device="cuda")
    out = torch.zeros(n, dtype=torch.uint8).pin_memory()
    compute = torch.cuda.Stream()
    sizes = np.full(n // (64 * KiB), 64 * KiB, dtype=np.int64)
    offs = np.arange(len(sizes), dtype=np.int64) * 64 * KiB
    with blockswap.Engine("cuda") as eng:
        eng.register(src)
        eng.register(out)
        outcomes = {}
        for job, wait in ((1, True), (2, False)):
            torch.cuda.synchronize()
            src.zero_()
            out.zero_()
            torch.cuda.synchronize()
            with torch.cuda.stream(compute):
                torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning before the write
                src.fill_(job)
            eng.submit(
                job,
                src.data_ptr() + offs,
                out.data_ptr() + offs,
                sizes,
                "d2h",
                wait_stream=compute.cuda_stream if wait else None,
            )
            eng.wait([job])
            assert eng.get_finished()[0].success
            torch.cuda.synchronize()
            outcomes[wait] = bool((out == job).all())
        assert outcomes[True], "with the compute-stream wait, the final bytes are offloaded"
        assert not outcomes[False], "without it the copy races the kernel (the test can tell)"


def test_a_transfer_follows_the_callers_work_queued_before_it_only(torch):
    """``wait_stream`` orders a transfer after the work on the caller's stream at submission: a
    stream whose work is done holds it back not at all (the core then records nothing there), and
    work queued after the submission does not either; work still queued does (above)."""
    n = 4 * MiB
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    caller = torch.cuda.Stream()
    with blockswap.Engine("cuda") as eng:
        eng.register(src)
        out = eng.alloc_host(n)
        with torch.cuda.stream(caller):
            src.add_(1)  # done before the submission: the transfer copies what it wrote
        caller.synchronize()
        want = src.cpu().numpy()
        eng.submit(
            1, [src.data_ptr()], [out.ctypes.data], [n], "d2h", wait_stream=caller.cuda_stream
        )
        with torch.cuda.stream(caller):
            torch.cuda._sleep(1_000_000_000)  # about half a second, queued after the submission
        eng.wait([1])
        assert eng.get_finished()[0].success
        assert not caller.query(), "the transfer waited for work queued after it"
        assert np.array_equal(out, want)
        caller.synchronize()


def test_unpinned_host_memory_is_refused(torch):
    with blockswap.Engine("cuda") as eng:
        pageable = np.zeros(MiB, dtype=np.uint8)
        with pytest.raises(BackendError, match="not page-locked"):
            eng.register(pageable)
        # Pinning it makes it usable.
        eng.pin(pageable)
        dev = torch.arange(MiB, device="cuda").to(torch.uint8)
        eng.register(dev)
        eng.submit(1, [dev.data_ptr()], [pageable.ctypes.data], [MiB], "d2h")
        eng.wait([1])
        assert eng.get_finished()[0].success
        assert np.array_equal(pageable, dev.cpu().numpy())
        eng.unregister(pageable)


def test_wrong_kinds_and_devices_are_refused(torch):
    with blockswap.Engine("cuda") as eng:
        dev = torch.zeros(MiB, dtype=torch.uint8, device="cuda")
        host = torch.zeros(MiB, dtype=torch.uint8).pin_memory()
        with pytest.raises(BackendError, match="not host memory"):
            eng.register(dev.data_ptr(), MiB, "host")
        with pytest.raises(BackendError, match="not device memory"):
            eng.register(host.data_ptr(), MiB, "device")
        eng.register(dev)
        eng.register(host)
        # A device address where a host one belongs, and the reverse.
        with pytest.raises(InvalidTransferError, match="registered host memory"):
            eng.submit(1, [dev.data_ptr()], [dev.data_ptr() + 4096], [16], "h2d")
        with pytest.raises(InvalidTransferError, match="registered device memory"):
            eng.submit(1, [host.data_ptr()], [host.data_ptr() + 4096], [16], "h2d")


def test_alloc_host_is_pinned_and_mapped(torch):
    with blockswap.Engine("cuda") as eng:
        buf = eng.alloc_host(4 * MiB)
        buf[:] = np.arange(buf.nbytes, dtype=np.uint64).astype(np.uint8)
        dev = torch.zeros(4 * MiB, dtype=torch.uint8, device="cuda")
        eng.register(dev)
        offs = np.arange(1024, dtype=np.int64) * 4096
        eng.submit(1, buf.ctypes.data + offs, dev.data_ptr() + offs[::-1].copy(), [4096] * 1024)
        eng.wait([1])
        assert eng.get_finished()[0].success
        got = dev.cpu().numpy().reshape(1024, 4096)
        assert np.array_equal(got[::-1], buf.reshape(1024, 4096))


def test_legacy_default_stream_is_refused_for_copies(torch):
    with pytest.raises(BackendError, match="legacy or per-thread default stream"):
        blockswap.Engine("cuda", h2d_stream=0)
    s = torch.cuda.Stream()
    with blockswap.Engine("cuda", h2d_stream=s.cuda_stream) as eng:
        roundtrip(torch, eng, np.random.default_rng(0), np.full(64, 4096, dtype=np.int64))


def _child(q):
    try:
        _ENGINE.submit(1, [0], [0], [1], "h2d")
        q.put("no error")
    except BackendError as e:
        q.put(str(e))


def test_forked_child_gets_a_clear_error(torch):
    global _ENGINE
    _ENGINE = blockswap.Engine("cuda")
    try:
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=_child, args=(q,))
        p.start()
        msg = q.get(timeout=60)
        p.join(60)
        assert "fork" in msg, msg
        assert p.exitcode == 0
    finally:
        _ENGINE.shutdown()


def test_many_transfers_in_order_both_directions(torch):
    """64 transfers per direction with both directions in flight at once, each direction
    reported in submission order, every byte where it belongs. The two directions are ordered
    with each other only by the caller: the device buffer is filled (and waited for) before
    the offloads read it, while onloads into a second buffer run beside them."""
    rng = np.random.default_rng(3)
    blocks, size = 4096, 4 * KiB
    host = torch.randint(0, 256, (blocks * size,), dtype=torch.uint8).pin_memory()
    dev = torch.zeros(blocks * size, dtype=torch.uint8, device="cuda")
    dev2 = torch.zeros(blocks * size, dtype=torch.uint8, device="cuda")
    back = torch.zeros(blocks * size, dtype=torch.uint8).pin_memory()
    with blockswap.Engine("cuda") as eng:
        for t in (host, dev, dev2, back):
            eng.register(t)
        full = np.arange(blocks, dtype=np.int64) * size
        eng.submit(1000, host.data_ptr() + full, dev.data_ptr() + full, [size] * blocks)
        eng.wait([1000])
        assert [r.success for r in eng.get_finished()] == [True]
        jobs = []
        for j in range(64):
            ids = rng.permutation(blocks)[:64] if j else np.arange(blocks)
            offs = ids.astype(np.int64) * size
            eng.submit(2 * j, host.data_ptr() + offs, dev2.data_ptr() + offs, [size] * len(ids))
            eng.submit(
                2 * j + 1, dev.data_ptr() + offs, back.data_ptr() + offs, [size] * len(ids), "d2h"
            )
            jobs += [2 * j, 2 * j + 1]
        eng.wait(jobs)
        seen = [r.job_id for r in eng.get_finished() if r.success]
        assert sorted(seen) == sorted(jobs)
        for parity in (0, 1):
            one = [j for j in seen if j % 2 == parity]
            assert one == sorted(one), "one direction finishes in submission order"
        assert torch.equal(back, host)
        assert torch.equal(dev2.cpu(), host)


def test_the_callers_context_is_restored(torch):
    """The engine makes its context current for its own calls and puts the caller's back."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    current = ctypes.c_void_p()
    host = torch.ones(MiB, dtype=torch.uint8).pin_memory()
    dev = torch.zeros(MiB, dtype=torch.uint8, device="cuda")
    with blockswap.Engine("cuda") as eng:
        eng.register(host)
        eng.register(dev)
        assert cuda.cuCtxSetCurrent(None) == 0  # the caller has no current context
        eng.submit(1, [host.data_ptr()], [dev.data_ptr()], [MiB])
        eng.wait([1])
        assert eng.get_finished()[0].success
        assert cuda.cuCtxGetCurrent(ctypes.byref(current)) == 0
        assert current.value is None, "the engine left its context current"
    torch.cuda.synchronize()  # torch's runtime makes its own context current again
    assert torch.equal(dev.cpu(), host)


@pytest.mark.parametrize("options", [{}, {"copy_path": "loop"}], ids=["batch", "loop"])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("kernel", [False, True], ids=["dma", "hybrid"])
def test_a_driver_fault_mid_batch_fails_that_transfer_only(torch, options, direction, kernel):
    """A descriptor the driver refuses, in the middle of a batch (the CUDA test hook hands the
    driver a null address there): that transfer completes with success=False naming the
    descriptor, its slab returns to the pool, the transfers before and after move every byte,
    and each result is reported exactly once."""
    from blockswap.kernels import engine_launcher

    n, size = 64, 64 * KiB
    rng = np.random.default_rng(11)
    host = torch.randint(0, 256, (4 * n * size,), dtype=torch.uint8).pin_memory()
    dev = torch.randint(0, 256, (4 * n * size,), dtype=torch.uint8, device="cuda")
    src_t, dst_t = (host, dev) if direction == "h2d" else (dev, host)
    # Hybrid: 16 small descriptors go to the copy kernel first, the 64 large ones to DMA.
    small = 16 if kernel else 0
    sizes = np.array([4 * KiB] * small + [size] * n, dtype=np.int64)
    launch = engine_launcher(max_ctas=16) if kernel else None
    with blockswap.Engine("cuda", **options) as eng:
        eng.register(host)
        eng.register(dev)
        offsets = []
        for job in (1, 2, 3):
            s_off = rng.permutation(4 * n)[: len(sizes)].astype(np.int64) * size
            d_off = rng.permutation(4 * n)[: len(sizes)].astype(np.int64) * size
            if job == 2:
                eng.inject_failures(1)
            eng.submit(
                job,
                src_t.data_ptr() + s_off,
                dst_t.data_ptr() + d_off,
                sizes,
                direction,
                kernel_below=64 * KiB if kernel else 0,
                launcher=launch,
            )
            offsets.append((s_off, d_off))
            if job != 2:
                # The bytes of jobs 1 and 3 are checked against the source as it was.
                eng.wait([job])
                src_c, dst_c = src_t.cpu(), dst_t.cpu()
                for s, d, z in zip(s_off.tolist(), d_off.tolist(), sizes.tolist()):
                    assert torch.equal(dst_c[d : d + z], src_c[s : s + z]), (job, s, d)
        eng.wait([1, 2, 3])
        results = eng.get_finished()
        assert sorted(r.job_id for r in results) == [1, 2, 3]
        by_id = {r.job_id: r for r in results}
        assert by_id[1].success and by_id[3].success
        assert not by_id[2].success
        # The middle of the DMA part, counted over the whole transfer's descriptors.
        mid = small + n // 2
        assert f"descriptor {mid}" in by_id[2].error, by_id[2].error
        assert "INVALID_VALUE" in by_id[2].error, by_id[2].error
        assert eng.get_finished() == []
        stats = eng.stats()
        assert stats[direction]["failed"] == 1 and stats[direction]["transfers"] == 3
        assert stats["in_flight"] == 0
        assert stats["pool"]["free"] == stats["pool"]["slabs"], stats["pool"]
        # Still usable afterwards: a fourth transfer moves its bytes.
        s_off, d_off = offsets[0]
        eng.submit(4, src_t.data_ptr() + s_off, dst_t.data_ptr() + d_off, sizes, direction)
        eng.wait([4])
        (r,) = eng.get_finished()
        assert r.success
        torch.cuda.synchronize()


def test_stress_random_transfers_every_byte_verified(torch):
    """The host backend's stress run on the GPU (shorter here; the recorded run is 100,000):
    random directions, sizes and scatter, every byte checked, each result reported once, the
    pool whole at the end."""
    from reliability_stress import run_stress

    rep = run_stress(20_000, backend="cuda")
    assert rep.transfers == 20_000 and rep.rounds == 5
    assert all(rep.by_direction[d] > 4000 for d in ("h2d", "d2h", "h2h", "d2d"))
    assert rep.pool["free"] == rep.pool["slabs"]


def run_python(code: str, timeout: float = 120) -> str:
    """Runs ``code`` in a fresh interpreter (no torch, nothing holding the GPU); its stdout."""
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_shutdown_keeps_its_timeout_and_fails_what_it_left(torch):
    """Transfers still held back by the compute stream when ``shutdown_timeout`` passes: shutdown
    returns on time, each is reported failed once, and an engine collected with them still queued
    frees nothing they use: they run later, into memory that is still there."""
    n = MiB
    host = torch.randint(0, 256, (n,), dtype=torch.uint8).pin_memory()
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    dev = torch.zeros(n, dtype=torch.uint8, device="cuda")
    busy = torch.cuda.Stream()
    eng = blockswap.Engine("cuda", shutdown_timeout=0.2)
    for t in (host, src, dev):
        eng.register(t)
    back = eng.alloc_host(n)
    with torch.cuda.stream(busy):
        torch.cuda._sleep(4_000_000_000)  # about two seconds of GPU clock
    eng.submit(1, [host.data_ptr()], [dev.data_ptr()], [n], "h2d", wait_stream=busy.cuda_stream)
    eng.submit(2, [src.data_ptr()], [back.ctypes.data], [n], "d2h", wait_stream=busy.cuda_stream)
    started = time.perf_counter()
    eng.shutdown()
    took = time.perf_counter() - started
    assert not busy.query(), "the compute stream finished early: nothing was left in flight"
    assert 0.2 <= took < 1.0, f"shutdown took {took:.2f} s with shutdown_timeout=0.2"
    results = eng.get_finished()
    assert sorted(r.job_id for r in results) == [1, 2]
    for r in results:
        assert not r.success and "shut down" in r.error, r
    assert eng.get_finished() == []
    # The engine, its slabs and `back` go while both copies are still queued behind the sleep.
    del eng, back
    gc.collect()
    torch.cuda.synchronize()  # raises if a copy or a completion write hit freed memory
    assert torch.equal(dev.cpu(), host), "the h2d copy ran after the shutdown"


def test_a_refused_engine_holds_no_context_reference():
    """An engine refused after the driver was reached keeps nothing of it: the device's primary
    context is released (a fresh process, where nothing else holds it)."""
    out = run_python(
        """
        import ctypes, gc
        import blockswap

        cu = ctypes.CDLL("libcuda.so.1")
        assert cu.cuInit(0) == 0
        dev = ctypes.c_int()
        assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0

        def active():
            flags, on = ctypes.c_uint(), ctypes.c_int()
            assert cu.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(on)) == 0
            return on.value

        assert not active(), "something else holds the primary context"
        for bad in ({"d2h_stream": 1}, {"h2d_stream": 2}):
            try:
                blockswap.Engine("cuda", **bad)
            except blockswap.BlockswapError as e:
                assert "default stream" in str(e), e
            else:
                raise AssertionError(f"{bad} was accepted")
            assert not active(), f"{bad}: the context reference leaked"
        eng = blockswap.Engine("cuda")
        assert active()
        eng.shutdown()
        del eng
        gc.collect()
        assert not active(), "a collected engine kept its context reference"
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_the_event_ring_is_sized_by_the_clamped_max_in_flight():
    """``max_in_flight`` at its limit: the CUDA backend sizes its event ring by the same value
    (it used to create two events per unclamped transfer); past the limit it is refused."""
    out = run_python(
        """
        import time
        import blockswap

        try:
            blockswap.Engine("cuda", completion="event", max_in_flight=2**40)
            raise AssertionError("max_in_flight=2**40 accepted")
        except blockswap.InvalidTransferError as e:
            assert "max_in_flight" in str(e), e
        started = time.perf_counter()
        with blockswap.Engine("cuda", completion="event", max_in_flight=16384) as eng:
            took = time.perf_counter() - started
            info = eng.info()
            assert info["completion"] == "event query", info
            n = 1 << 20
            a, b = eng.alloc_host(n), eng.alloc_host(n)
            a[:] = 7
            for job in range(3):
                eng.submit(job, [a.ctypes.data], [b.ctypes.data], [n], "h2h")
            eng.wait(range(3))
            assert all(r.success for r in eng.get_finished())
            assert (b == 7).all()
        print(info["max_in_flight"], f"{took:.1f}")
        """,
        timeout=300,
    )
    clamped, took = out.split()
    assert int(clamped) == 16384
    assert float(took) < 60


@pytest.mark.parametrize("early_wake", [True, False])
def test_threads_announce_and_submit_on_one_direction_as_its_thread_sleeps_and_wakes(
    torch, early_wake
):
    """Four threads announce (``wake``) and submit onloads on one direction, with pauses around
    the issuing thread's poll (1 ms) so that it is by turns asleep, polling after an announcement
    and busy: an announcement without a transfer, two in a row, a transfer without one. The
    thread is notified of a queued transfer only where it sleeps; a missed notification would
    leave a transfer unissued, and its wait would time out. Every transfer completes, its bytes
    in place, each reported once."""
    import threading

    from reliability_helpers import join_all

    nthreads, rounds, size = 4, 60, 64 * KiB
    n = nthreads * rounds
    host = torch.randint(0, 256, (n * size,), dtype=torch.uint8).pin_memory()
    dev = torch.zeros(n * size, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    eng = blockswap.Engine("cuda", early_wake=early_wake)
    eng.register(host)
    eng.register(dev)
    errors: list[BaseException] = []
    go = threading.Barrier(nthreads)

    def worker(t: int) -> None:
        try:
            rng = np.random.default_rng(t)
            go.wait()
            for i in range(rounds):
                job = t * rounds + i
                time.sleep(float(rng.choice([0.0, 0.0003, 0.0009, 0.0011, 0.002])))
                for _ in range(int(rng.integers(0, 3))):
                    eng.wake("h2d")
                if rng.random() < 0.2:
                    time.sleep(0.0015)  # announced, then past the poll before the transfer
                off = job * size
                eng.submit(job, [host.data_ptr() + off], [dev.data_ptr() + off], [size], "h2d")
                if rng.random() < 0.5:
                    eng.wait([job], timeout=30)
        except BaseException as e:  # reported by the test below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(nthreads)]
    for th in threads:
        th.start()
    join_all(threads)
    assert not errors, errors[:3]
    eng.wait(range(n), timeout=30)
    results = eng.get_finished()
    assert sorted(r.job_id for r in results) == list(range(n))
    assert all(r.success for r in results)
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), host)
    eng.shutdown()


@pytest.mark.parametrize("options", [{}, {"idle_issue": True}], ids=["lanes", "idle_issue"])
@pytest.mark.parametrize("route", ["dma", "core_kernel", "staged"])
def test_threads_submit_while_another_shuts_down(torch, route, options):
    """Two threads submit (onloads and offloads, which each direction's issuing thread puts on
    the device) while a third shuts the engine down: every transfer the engine accepted is
    reported exactly once and succeeds, its bytes in place (shutdown issues everything accepted
    before its deadline); a submission after the shutdown is refused. ``core_kernel``: block
    transfers whose pages the copy kernel moves, launched by the core from the issuing threads;
    ``staged``: block transfers by the staged plan (rows through the ring, the staged kernel).
    ``idle_issue``: a transfer that finds its direction's thread idle is started on the
    submitting thread (a staged one's first step, the thread woken for the rest)."""
    import threading

    from blockswap.kernels import core_kernel

    n, size = 400, 256 * KiB
    host = torch.randint(0, 256, (n * size,), dtype=torch.uint8).pin_memory()
    dev = torch.zeros(n * size, dtype=torch.uint8, device="cuda")
    src = torch.randint(0, 256, (n * size,), dtype=torch.uint8, device="cuda")
    back = torch.zeros(n * size, dtype=torch.uint8).pin_memory()
    torch.cuda.synchronize()
    eng = blockswap.Engine("cuda", **options)
    for t in (host, dev, src, back):
        eng.register(t)
    kind = {id(host): "host", id(back): "host", id(dev): "device", id(src): "device"}
    tables = {
        id(t): eng.register_table([t.data_ptr()], [size], [size], n, kind[id(t)])
        for t in (host, dev, src, back)
    }
    compiled = None if route == "dma" else core_kernel(0, max_size=size, staged=route == "staged")
    kernel = None if compiled is None else eng.load_kernel(compiled)
    assert (kernel is None) == (route == "dma")
    accepted: dict[str, list[int]] = {"h2d": [], "d2h": []}
    refused: list[str] = []
    go = threading.Barrier(3)

    def submit(job: int, a, b, i: int, direction: str) -> None:
        if kernel is None:
            off = i * size
            eng.submit(job, [a.data_ptr() + off], [b.data_ptr() + off], [size], direction)
        else:
            group = (tables[id(a)], [i], tables[id(b)], [i], None)
            if route == "staged":
                eng.submit_groups(job, [group], direction, route=Route.staged(kernel))
            else:
                pages = Route.pages(1 << 40, kernel=kernel)
                eng.submit_groups(job, [group], direction, route=pages)

    def submitter(direction: str) -> None:
        a, b = (host, dev) if direction == "h2d" else (src, back)
        go.wait()
        for i in range(n):
            job = i if direction == "h2d" else n + i
            while True:
                try:
                    submit(job, a, b, i, direction)
                    accepted[direction].append(i)
                    break
                except blockswap.PoolExhaustedError:
                    continue
                except blockswap.ShutdownError:
                    refused.append(direction)
                    return

    def stopper() -> None:
        go.wait()
        time.sleep(0.002)
        eng.shutdown()

    threads = [threading.Thread(target=submitter, args=(d,)) for d in ("h2d", "d2h")]
    threads.append(threading.Thread(target=stopper))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results = eng.get_finished()
    ids = sorted(r.job_id for r in results)
    want = sorted(accepted["h2d"] + [n + i for i in accepted["d2h"]])
    assert ids == want, "every accepted transfer is reported once, nothing else"
    assert all(r.success for r in results), [r.error for r in results if not r.success][:3]
    torch.cuda.synchronize()
    dev_h, src_h = dev.cpu(), src.cpu()
    for i in accepted["h2d"]:
        assert torch.equal(dev_h[i * size : (i + 1) * size], host[i * size : (i + 1) * size])
    for i in accepted["d2h"]:
        assert torch.equal(back[i * size : (i + 1) * size], src_h[i * size : (i + 1) * size])
    with pytest.raises(blockswap.ShutdownError):
        eng.submit(10 * n, [host.data_ptr()], [dev.data_ptr()], [size])
    del compiled  # loaded until here: the engine may launch it until it is shut down


@pytest.mark.parametrize("given", ["never loaded", "of the other kind"])
def test_a_kernel_the_plan_cannot_launch_fails_the_transfer(torch, given: str) -> None:
    """A kernel id the engine never loaded, or a kernel of the other kind (a staged kernel on the
    kernel route, a page kernel for the staged plan): the transfer is reported failed, naming
    why, and the engine goes on (the next transfer, by DMA, succeeds)."""
    from blockswap.kernels import core_kernel

    size = 64 * KiB
    host = torch.randint(0, 256, (4 * size,), dtype=torch.uint8).pin_memory()
    dev = torch.zeros(4 * size, dtype=torch.uint8, device="cuda")
    compiled = [core_kernel(0, max_size=size, staged=s) for s in (True, False)]
    with blockswap.Engine("cuda") as eng:
        eng.register(host)
        eng.register(dev)
        th = eng.register_table([host.data_ptr()], [size], [size], 4, "host")
        td = eng.register_table([dev.data_ptr()], [size], [size], 4, "device")
        staged_kernel, page_kernel = (eng.load_kernel(k) for k in compiled)
        wrong = {"never loaded": (7, 7), "of the other kind": (staged_kernel, page_kernel)}
        on_route, on_staged = wrong[given]
        eng.submit_groups(
            1, [(th, [0, 1], td, [0, 1], None)], "h2d", route=Route.pages(1 << 40, kernel=on_route)
        )
        eng.submit_groups(3, [(th, [0, 1], td, [0, 1], None)], "h2d", route=Route.staged(on_staged))
        eng.wait([1, 3])
        results = sorted(eng.get_finished(), key=lambda r: r.job_id)
        assert [r.success for r in results] == [False, False]
        assert "needs a page kernel loaded by this engine" in (results[0].error or "")
        assert "needs a staged kernel loaded by this engine" in (results[1].error or "")
        eng.submit_groups(2, [(th, [2, 3], td, [2, 3], None)], "h2d")
        eng.wait([2])
        (r,) = eng.get_finished()
        assert r.success, r.error
        torch.cuda.synchronize()
        assert torch.equal(dev[2 * size :].cpu(), host[2 * size :])
    del compiled  # loaded until here
