"""The low-level engine on the host backend: bytes, results, and every refusal."""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial

import numpy as np
import pytest

import blockswap
from blockswap import (
    BlockswapError,
    InvalidTransferError,
    PoolExhaustedError,
    ShutdownError,
)
from reliability_helpers import join_all

MiB = 1 << 20


def registered_pair(engine, nbytes, rng):
    """A random host source and a zeroed destination standing in for device memory."""
    src = rng.integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    engine.register(src, kind="host")
    engine.register(dst, kind="device")
    return src, dst


def test_ten_thousand_random_descriptors_every_byte(engine, rng):
    n = 10_000
    src = rng.integers(0, 256, 64 * MiB, dtype=np.uint8)
    engine.register(src, kind="host")
    # Sizes 1 B - 1 MiB: mostly small, some up to 1 MiB (log-uniform).
    sizes = np.exp(rng.uniform(0, np.log(1 * MiB), n)).astype(np.int64).clip(1, 1 * MiB)
    total = int(sizes.sum())
    dst = np.zeros(total + n * 64, dtype=np.uint8)
    engine.register(dst, kind="device")
    order = rng.permutation(n)
    gaps = rng.integers(0, 64, n, dtype=np.int64)
    starts = np.zeros(n, dtype=np.int64)
    starts[order] = np.cumsum(sizes[order] + gaps[order]) - sizes[order]
    src_off = rng.integers(0, src.nbytes - sizes, dtype=np.int64)
    engine.submit(7, src.ctypes.data + src_off, dst.ctypes.data + starts, sizes, "h2d")
    engine.wait([7])
    (res,) = engine.get_finished()
    assert res.job_id == 7 and res.success and res.bytes == total and res.error is None
    assert res.seconds > 0
    for s, d, z in zip(src_off.tolist(), starts.tolist(), sizes.tolist()):
        assert np.array_equal(dst[d : d + z], src[s : s + z])
    # The gaps were not written.
    written = np.zeros(dst.nbytes, dtype=bool)
    for d, z in zip(starts.tolist(), sizes.tolist()):
        written[d : d + z] = True
    assert not dst[~written].any()


def test_contiguous_blocks_are_coalesced_and_exact(engine, rng):
    src, dst = registered_pair(engine, 1 * MiB, rng)
    ids = np.arange(16)
    engine.submit(1, src.ctypes.data + ids * 8192, dst.ctypes.data + ids * 8192, [8192] * 16)
    engine.wait([1])
    assert engine.get_finished()[0].success
    assert np.array_equal(dst[: 16 * 8192], src[: 16 * 8192])


def test_results_are_reported_exactly_once_in_order(engine, rng):
    src, dst = registered_pair(engine, 1 * MiB, rng)
    for j in range(50):
        engine.submit(j, [src.ctypes.data + j * 100], [dst.ctypes.data + j * 100], [100])
    engine.wait(range(50))
    got = []
    while len(got) < 50:
        got += [r.job_id for r in engine.get_finished()]
    assert got == list(range(50))
    assert engine.get_finished() == []
    assert np.array_equal(dst[:5000], src[:5000])


def test_job_id_is_reusable_only_after_its_result(engine, rng):
    src, dst = registered_pair(engine, 1 * MiB, rng)
    engine.submit(5, [src.ctypes.data], [dst.ctypes.data], [64])
    with pytest.raises(InvalidTransferError, match="job id 5 is still live"):
        engine.submit(5, [src.ctypes.data + 64], [dst.ctypes.data + 64], [64])
    engine.wait([5])
    assert [r.job_id for r in engine.get_finished()] == [5]
    engine.submit(5, [src.ctypes.data + 64], [dst.ctypes.data + 64], [64])
    engine.wait([5])
    assert [r.job_id for r in engine.get_finished()] == [5]


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("mismatched", "differ in length"),
        ("zero", r"sizes\[1\] is zero"),
        ("negative", r"sizes\[0\] is negative \(-8\)"),
        ("overlap", "destinations overlap"),
        ("unregistered", "not inside registered host memory"),
        ("device_as_host", "not inside registered host memory"),
        ("host_as_device", "not inside registered device memory"),
        ("past_the_end", "not inside registered device memory"),
        ("overflow", "overflows"),
        ("float", "must hold integers"),
        ("empty", "no descriptor"),
        ("direction", "direction must be"),
        ("job_id", r"job_id must be an int from 0 to 2\*\*64 - 1, not -1"),
    ],
)
def test_bad_input_raises_and_leaves_earlier_transfers_intact(engine, rng, case, match):
    src, dst = registered_pair(engine, 1 * MiB, rng)
    s, d = src.ctypes.data, dst.ctypes.data
    # An earlier transfer, in flight or done, must be unaffected.
    engine.submit(1, [s], [d], [4096])
    args = {
        "mismatched": dict(src_ptrs=[s, s + 8], dst_ptrs=[d], sizes=[8, 8]),
        "zero": dict(src_ptrs=[s, s + 8], dst_ptrs=[d + 8192, d + 8300], sizes=[8, 0]),
        "negative": dict(src_ptrs=[s], dst_ptrs=[d + 8192], sizes=[-8]),
        "overlap": dict(src_ptrs=[s, s + 64], dst_ptrs=[d + 8192, d + 8200], sizes=[16, 16]),
        "unregistered": dict(src_ptrs=[12345678], dst_ptrs=[d + 8192], sizes=[8]),
        "device_as_host": dict(src_ptrs=[d + 100], dst_ptrs=[d + 8192], sizes=[8]),
        "host_as_device": dict(src_ptrs=[s], dst_ptrs=[s + 8192], sizes=[8]),
        "past_the_end": dict(src_ptrs=[s], dst_ptrs=[d + dst.nbytes - 4], sizes=[8]),
        "overflow": dict(src_ptrs=[-4], dst_ptrs=[d + 8192], sizes=[8]),
        "float": dict(src_ptrs=np.array([float(s)]), dst_ptrs=[d + 8192], sizes=[8]),
        "empty": dict(src_ptrs=[], dst_ptrs=[], sizes=[]),
    }.get(case)
    engine.wait([1])
    before = dst.copy()
    if case == "direction":
        with pytest.raises(InvalidTransferError, match=match):
            engine.submit(2, [s], [d + 8192], [8], "sideways")
    elif case == "job_id":
        with pytest.raises(InvalidTransferError, match=match):
            engine.submit(-1, [s], [d + 8192], [8])
    else:
        with pytest.raises(InvalidTransferError, match=match):
            engine.submit(2, direction="h2d", **args)
    assert isinstance(InvalidTransferError("x"), BlockswapError)
    # Nothing was issued, and the earlier transfer's result and bytes are intact.
    assert np.array_equal(dst, before)
    results = engine.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(1, True)]
    assert np.array_equal(dst[:4096], src[:4096])
    # The refused job id was never live: it can be used now.
    engine.submit(2, [s], [d + 8192], [8])
    engine.wait([2])
    assert [r.job_id for r in engine.get_finished()] == [2]


def test_use_after_shutdown(rng):
    engine = blockswap.Engine("host")
    src, dst = registered_pair(engine, 1 * MiB, rng)
    engine.submit(1, [src.ctypes.data], [dst.ctypes.data], [1 * MiB])
    engine.shutdown()
    engine.shutdown()  # idempotent
    assert engine.is_shut_down
    # The transfer in flight at shutdown finished and its result is still reported.
    assert [(r.job_id, r.success) for r in engine.get_finished()] == [(1, True)]
    assert np.array_equal(dst, src)
    with pytest.raises(ShutdownError, match="shut down"):
        engine.submit(2, [src.ctypes.data], [dst.ctypes.data], [8])
    with pytest.raises(ShutdownError):
        engine.register(np.zeros(8, dtype=np.uint8))


def test_prepare_staged_is_checked_and_changes_no_transfer(rng):
    """``Engine.prepare_staged`` makes a lane's staging resources ahead of its first staged
    transfer: refused for a direction the staged plan never takes, a non-bool ``ring`` and after
    shutdown; repeated, it keeps what is made; transfers after it are exact."""
    engine = blockswap.Engine("host")
    src, dst = registered_pair(engine, 1 * MiB, rng)
    for _ in range(2):
        engine.prepare_staged("h2d")
        engine.prepare_staged("d2h", ring=False)
    with pytest.raises(blockswap.BackendError, match="h2d or d2h"):
        engine.prepare_staged("h2h")
    with pytest.raises(InvalidTransferError, match="direction must be"):
        engine.prepare_staged("up")
    with pytest.raises(blockswap.ArgumentTypeError, match="ring must be a bool"):
        engine.prepare_staged("h2d", ring=1)  # type: ignore[arg-type]
    engine.submit(1, [src.ctypes.data], [dst.ctypes.data], [1 * MiB])
    engine.wait([1])
    assert [(r.job_id, r.success) for r in engine.get_finished()] == [(1, True)]
    assert np.array_equal(dst, src)
    engine.shutdown()
    with pytest.raises(blockswap.ShutdownError):
        engine.prepare_staged("h2d")


def test_wake_is_a_hint_that_changes_no_transfer(rng):
    """``Engine.wake`` announces a transfer: checked like a submission's direction, a no-op
    after shutdown, and a transfer after any number of announcements (or none) is exact."""
    engine = blockswap.Engine("host")
    src, dst = registered_pair(engine, 1 * MiB, rng)
    for _ in range(3):
        engine.wake("h2d")
    engine.wake("d2h")  # announced, never submitted
    engine.submit(1, [src.ctypes.data], [dst.ctypes.data], [1 * MiB])
    engine.wait([1])
    assert [(r.job_id, r.success) for r in engine.get_finished()] == [(1, True)]
    assert np.array_equal(dst, src)
    with pytest.raises(InvalidTransferError, match="direction must be"):
        engine.wake("up")
    with pytest.raises(blockswap.ArgumentTypeError, match="direction must be"):
        engine.wake(1)  # type: ignore[arg-type]
    engine.shutdown()
    engine.wake("h2d")  # nothing to wake: no error


def test_injected_failure_is_reported_failed_and_later_jobs_unaffected(engine, rng):
    src, dst = registered_pair(engine, 1 * MiB, rng)
    s, d = src.ctypes.data, dst.ctypes.data
    engine.inject_failures(1)
    engine.submit(1, s + np.arange(8) * 4096, d + np.arange(8) * 4096, [4096] * 8)
    engine.submit(2, [s + 65536], [d + 65536], [4096])
    engine.wait([1, 2])
    results = {r.job_id: r for r in engine.get_finished()}
    assert not results[1].success and "injected failure at descriptor" in results[1].error
    assert results[2].success
    assert np.array_equal(dst[65536 : 65536 + 4096], src[65536 : 65536 + 4096])
    stats = engine.stats()
    assert stats["h2d"]["failed"] == 1 and stats["h2d"]["transfers"] == 2
    assert stats["pool"]["free"] == stats["pool"]["slabs"], "failed job's slab came home"


def test_host_time_counters_split_each_submission(engine, rng):
    src, dst = registered_pair(engine, 1 * MiB, rng)
    s, d = src.ctypes.data, dst.ctypes.data
    before = engine.stats()
    assert before["submit_ns"] == before["prepare_ns"] == 0
    engine.submit(1, s + np.arange(64) * 4096, d + np.arange(64) * 4096, [4096] * 64)
    mid = engine.stats()
    assert mid["submit_ns"] > mid["prepare_ns"] > 0, "validation is part of the submission"
    with pytest.raises(InvalidTransferError):
        engine.submit(2, [s], [d + 4 * MiB], [8])  # outside the registered destination
    after = engine.stats()
    assert after["submit_ns"] > mid["submit_ns"], "a refused submission is host time too"
    assert after["prepare_ns"] > mid["prepare_ns"] and after["submit_ns"] > after["prepare_ns"]
    engine.wait([1])
    assert engine.stats()["driver_ns"] == 0, "the host backend makes no driver calls"


def test_pool_exhaustion_is_a_typed_error_not_a_hang(rng):
    # One 256-descriptor slab fits the cap: a second transfer in flight finds the pool empty.
    engine = blockswap.Engine("host", pool_bytes=256 * 24)
    src, dst = registered_pair(engine, 4 * MiB, rng)
    s, d = src.ctypes.data, dst.ctypes.data
    engine.submit(1, [s], [d], [4 * MiB])
    try:
        engine.submit(2, [s], [d], [8])
        # The first transfer may already be done and its slab home only after a poll: either
        # outcome is fine, but a refusal must be typed.
    except PoolExhaustedError as e:
        assert "pool exhausted" in str(e)
    engine.wait([1, 2])
    engine.shutdown()


def test_in_flight_limit_is_typed(rng):
    engine = blockswap.Engine("host", max_in_flight=1)
    src, dst = registered_pair(engine, 64 * MiB, rng)
    engine.submit(1, [src.ctypes.data], [dst.ctypes.data], [64 * MiB])
    with pytest.raises(PoolExhaustedError, match="in flight or finished but not yet polled"):
        engine.submit(2, [src.ctypes.data], [dst.ctypes.data], [8])
    engine.wait([1])
    engine.get_finished()
    engine.submit(2, [src.ctypes.data], [dst.ctypes.data], [8])
    engine.shutdown()


def test_registration_rules(engine):
    a = np.zeros(4096, dtype=np.uint8)
    engine.register(a)
    with pytest.raises(InvalidTransferError, match="overlaps"):
        engine.register(a[100:200], kind="device")
    with pytest.raises(InvalidTransferError, match="no registered region"):
        engine.unregister(a.ctypes.data + 1)
    with pytest.raises(InvalidTransferError, match="contiguous"):
        engine.register(np.zeros((8, 8), dtype=np.uint8)[:, ::2])
    with pytest.raises(InvalidTransferError, match="kind must be"):
        engine.register(np.zeros(8, dtype=np.uint8), kind="gpu")
    engine.unregister(a)


def test_unregister_is_refused_while_in_flight(rng):
    engine = blockswap.Engine("host")
    src, dst = registered_pair(engine, 64 * MiB, rng)
    engine.submit(1, [src.ctypes.data], [dst.ctypes.data], [64 * MiB])
    try:
        engine.unregister(dst)
    except InvalidTransferError as e:
        assert "in flight" in str(e)
    engine.wait([1])
    engine.shutdown()


def test_alloc_host_buffers(engine, rng):
    a = engine.alloc_host(1 * MiB)
    b = engine.alloc_host(1 * MiB)
    a[:] = rng.integers(0, 256, a.nbytes, dtype=np.uint8)
    engine.unregister(b.ctypes.data)  # frees b
    dev = np.zeros(1 * MiB, dtype=np.uint8)
    engine.register(dev, kind="device")
    engine.submit(1, [a.ctypes.data], [dev.ctypes.data], [a.nbytes])
    engine.wait([1])
    assert engine.get_finished()[0].success
    assert np.array_equal(dev, a)
    engine.free_host(a)
    with pytest.raises(InvalidTransferError):
        engine.free_host(a)


def test_an_alloc_host_buffer_is_not_freed_under_another_engines_registration() -> None:
    """Engine B registers an array engine A allocated: A's ``free_host`` (and ``unregister``) is
    refused while B holds it (B's copies would write freed memory, which the allocator hands
    out again), and goes through once B let go."""
    with blockswap.Engine("host") as a, blockswap.Engine("host") as b:
        buf = a.alloc_host(64 * 1024)
        buf[:] = 0
        b.register(buf)
        src = np.full(4096, 7, np.uint8)
        b.register(src, kind="device")
        for free in (a.free_host, a.unregister):
            with pytest.raises(InvalidTransferError, match="registered with 1 other engine"):
                free(buf)
        b.submit(1, [src.ctypes.data], [buf.ctypes.data], [4096], "d2h")
        b.wait([1])
        assert [r.success for r in b.get_finished()] == [True]
        assert (buf[:4096] == 7).all() and not buf[4096:].any()
        b.unregister(buf)
        a.free_host(buf)
        with pytest.raises(InvalidTransferError):
            a.free_host(buf)


def _at_once(**calls: Callable[[], object]) -> dict[str, BaseException | None]:
    """Runs ``calls`` on a thread each, released together; what each raised, or ``None``."""
    start = threading.Barrier(len(calls))
    out: dict[str, BaseException | None] = {}

    def run(name: str, call: Callable[[], object]) -> None:
        start.wait()
        try:
            call()
            out[name] = None
        except BaseException as e:
            out[name] = e

    threads = [threading.Thread(target=run, args=item) for item in calls.items()]
    for t in threads:
        t.start()
    join_all(threads)
    return out


def test_free_host_racing_another_engines_register_settles_one_way() -> None:
    """Engine A frees an ``alloc_host`` buffer while, on another thread, engine B registers it.
    Whichever comes first, the two agree: B's registration made first refuses the free (and the
    buffer frees once B lets go); a free made first leaves B's registration counting no user of a
    buffer, and the buffer is gone from A. Neither call fails for any other reason (both orders
    come up in 300 rounds: the free was refused 46-84 times in three runs)."""
    with blockswap.Engine("host") as a, blockswap.Engine("host") as b:
        for _ in range(300):
            buf = a.alloc_host(64 * 1024)
            out = _at_once(register=partial(b.register, buf), free=partial(a.free_host, buf))
            assert out["register"] is None, out["register"]
            if out["free"] is not None:
                assert isinstance(out["free"], InvalidTransferError), out["free"]
                assert "registered with 1 other engine" in str(out["free"])
                b.unregister(buf)
                a.free_host(buf)
            else:
                b.unregister(buf)  # counted no user: nothing to release
                with pytest.raises(InvalidTransferError, match="no registered region starts at"):
                    a.free_host(buf)  # the free was whole


def test_threads_submit_and_poll_one_engine(engine, rng):
    src, dst = registered_pair(engine, 8 * MiB, rng)
    s, d = src.ctypes.data, dst.ctypes.data
    per_thread, threads = 200, 4
    seen: list[int] = []
    lock = threading.Lock()
    done = threading.Event()

    def submitter(t):
        for i in range(per_thread):
            j = t * per_thread + i
            off = j * 1024
            while True:
                try:
                    engine.submit(j, [s + off], [d + off], [1024], "h2d")
                    break
                except PoolExhaustedError:
                    pass

    def poller():
        while not done.is_set() or engine.stats()["in_flight"]:
            rs = engine.get_finished()
            with lock:
                seen.extend(r.job_id for r in rs if r.success)

    polls = [threading.Thread(target=poller) for _ in range(2)]
    subs = [threading.Thread(target=submitter, args=(t,)) for t in range(threads)]
    for t in polls + subs:
        t.start()
    for t in subs:
        t.join()
    engine.wait(range(per_thread * threads))
    done.set()
    for t in polls:
        t.join()
    seen.extend(r.job_id for r in engine.get_finished())
    assert sorted(seen) == list(range(per_thread * threads))
    n = per_thread * threads * 1024
    assert np.array_equal(dst[:n], src[:n])


def test_wait_timeout_and_unknown_ids(engine, rng):
    engine.wait([424242])  # never submitted: nothing to wait for
    src, dst = registered_pair(engine, 1 * MiB, rng)
    engine.submit(1, [src.ctypes.data], [dst.ctypes.data], [8])
    engine.wait([1], timeout=10)
    with pytest.raises(InvalidTransferError, match="timeout"):
        engine.wait([1], timeout=-1)


def test_info_and_cuda_without_driver():
    i = blockswap.info()
    assert i["version"] == blockswap.__version__
    if not i["cuda"]:
        assert i["default_backend"] == "host"
        with pytest.raises(blockswap.BackendError, match="backend unavailable"):
            blockswap.Engine("cuda")
    e = blockswap.Engine("host")
    assert e.info()["backend"] == "host"
    e.shutdown()


def test_an_engine_collected_after_a_timed_out_shutdown_keeps_its_registered_objects():
    """A shutdown that gave up on copies in flight (``shutdown_timeout``) leaves them running on
    a GPU: the objects registered with the engine must then outlive it, never be freed under the
    device. Here a 256 MiB host copy outlasts a zero timeout."""
    import gc
    import weakref

    from blockswap import engine as engine_module

    eng = blockswap.Engine("host", shutdown_timeout=0.0)
    src = np.ones(256 << 20, np.uint8)
    dst = np.zeros(256 << 20, np.uint8)
    eng.register(src, kind="host")
    eng.register(dst, kind="device")
    alive = weakref.ref(dst)
    eng.submit(1, [src.ctypes.data], [dst.ctypes.data], [src.nbytes])
    eng.shutdown()
    timed_out = eng.stats()["shutdown_timed_out"]
    del eng, src, dst
    gc.collect()
    try:
        if timed_out:
            assert alive() is not None, "a registered object was freed after a timed-out shutdown"
        else:  # the copy won the race against the zero timeout: nothing to keep
            assert alive() is None
    finally:
        engine_module._ABANDONED.clear()


def test_register_table_refuses_a_unit_past_its_blocks() -> None:
    """A table counting more blocks to a caller's block (``unit``) than it holds is refused by
    name, not registered to report "there are 0 blocks" on every transfer."""
    mem = np.zeros(4096, np.uint8)
    with blockswap.Engine("host") as eng:
        eng.register(mem, kind="host")
        base = [mem.ctypes.data]
        too_many = "unit 32 is more than the table's 16 blocks"
        with pytest.raises(blockswap.InvalidTransferError, match=too_many):
            eng.register_table(base, [64], [64], 16, "host", "CPU", 32)
        assert eng.register_table(base, [64], [64], 16, "host", "CPU", 16) >= 0


def test_submit_groups_refuses_malformed_groups_by_name() -> None:
    """Engine.submit_groups: a group that is not a 5-tuple, a negative skip, float ids, and a
    wrong chunk count are typed errors naming the problem; nothing is issued."""
    src = np.zeros(4096, np.uint8)
    dst = np.zeros(4096, np.uint8)
    with blockswap.Engine("host") as eng:
        eng.register(src, kind="host")
        eng.register(dst, kind="device")
        cpu = eng.register_table([src.ctypes.data], [64], [64], 16, "host", "CPU", 4)
        gpu = eng.register_table([dst.ctypes.data], [64], [64], 16, "device", "GPU", 1)
        with pytest.raises(blockswap.InvalidTransferError, match=r"groups\[0\] must be"):
            eng.submit_groups(1, [(cpu, [0], gpu)], "h2d")
        with pytest.raises(blockswap.InvalidTransferError, match="skip"):
            eng.submit_groups(1, [(cpu, [0], gpu, [0], -1)], "h2d")
        # Ids refused before their tables are read are named by the memory their side is in.
        with pytest.raises(blockswap.InvalidTransferError, match=r"^CPU block ids must hold integ"):
            eng.submit_groups(1, [(cpu, [0.5], gpu, [0], 0)], "h2d")
        with pytest.raises(blockswap.InvalidTransferError, match=r"^GPU block ids must be one-dim"):
            eng.submit_groups(1, [(gpu, np.zeros((1, 1), np.int64), cpu, [0], 0)], "d2h")
        two = [(cpu, [0], gpu, [0], 0), (cpu, [1], gpu, np.array([1.0]), 0)]
        with pytest.raises(blockswap.InvalidTransferError, match=r"^group 1: GPU block ids must"):
            eng.submit_groups(1, two, "h2d")
        with pytest.raises(blockswap.InvalidTransferError, match=r"= 1 CPU block ids .* got 2"):
            eng.submit_groups(1, [(cpu, [0, 1], gpu, [0, 1], 0)], "h2d")
        eng.submit_groups(2, [(cpu, [1, 2], gpu, [0, 1], 3)], "h2d")  # sub-blocks 7, 8
        eng.wait([2])
        assert [(r.job_id, r.success, r.bytes) for r in eng.get_finished()] == [(2, True, 128)]
