"""Reliability, 3. Shutdown with transfers in flight, from other threads, twice; memory freed
once."""

from __future__ import annotations

import gc
import itertools
import logging
import os
import threading
import weakref
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

from blockswap import Engine, PoolExhaustedError, ShutdownError
from blockswap.handler import CpuGpuHandlers
from kv_helpers import fill_random
from reliability_helpers import (
    DEADLOCK,
    KiB,
    MiB,
    join_all,
    kv_cache,
    run_isolated,
    threads,
    threads_settle,
)
from reliability_stress import rss_bytes


def two_lane_buffers(
    eng: Engine, rng: np.random.Generator, nbytes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random host and "device" sources and a zeroed "device" destination of ``nbytes`` each,
    registered with ``eng``: transfers from either source (h2d, d2d) run on two lanes."""
    src = rng.integers(1, 256, nbytes, dtype=np.uint8)
    dsrc = rng.integers(1, 256, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    eng.register(src, kind="host")
    eng.register(dsrc, kind="device")
    eng.register(dst, kind="device")
    return src, dsrc, dst


def test_shutdown_from_two_threads_twice_while_transfers_are_in_flight() -> None:
    base = threads()
    eng = Engine("host")
    src, dsrc, dst = two_lane_buffers(eng, np.random.default_rng(3), 64 * MiB)
    s, d = src.ctypes.data, dst.ctypes.data
    for j in range(64):  # 64 MiB queued in 1 MiB transfers on two lanes
        off = j * MiB
        if j % 2:
            eng.submit(j, [s + off], [d + off], [MiB], "h2d")
        else:
            eng.submit(j, [dsrc.ctypes.data + off], [d + off], [MiB], "d2d")
    assert eng.stats()["in_flight"] > 0, "nothing was in flight: the test proves nothing"
    errors: list[BaseException] = []
    seen: list[int] = []

    def stop() -> None:
        try:
            eng.shutdown()
            eng.shutdown()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    def poll() -> None:
        while not eng.is_shut_down or eng.stats()["in_flight"]:
            seen.extend(r.job_id for r in eng.get_finished() if r.success)

    ts = [threading.Thread(target=stop, name=f"stop{i}") for i in range(2)]
    ts.append(threading.Thread(target=poll, name="poll"))
    for t in ts:
        t.start()
    eng.shutdown()
    join_all(ts)
    assert not errors
    seen.extend(r.job_id for r in eng.get_finished() if r.success)
    assert sorted(seen) == list(range(64)), "a result lost or reported twice"
    want = np.where((np.arange(64 * MiB) // MiB) % 2 == 1, src, dsrc)
    assert np.array_equal(dst, want)
    with pytest.raises(ShutdownError):
        eng.submit(99, [s], [d], [8])
    stats = eng.stats()
    assert stats["in_flight"] == 0 and stats["pool"]["free"] == stats["pool"]["slabs"]
    assert not threads_settle(base), "the worker thread outlived shutdown"


def test_submitters_racing_shutdown_get_their_results_or_a_shutdown_error() -> None:
    """Four threads submit (two lanes) while a fifth polls and the main thread shuts the engine
    down: each submit either returns (its result is reported once, successful, its bytes there)
    or raises ShutdownError (nothing of it is reported or written)."""
    eng = Engine("host")
    src, dsrc, dst = two_lane_buffers(eng, np.random.default_rng(4), 16 * MiB)
    d = dst.ctypes.data
    accepted: dict[int, list[int]] = {t: [] for t in range(4)}
    refused: Counter[int] = Counter()
    reported: list[Any] = []
    started = threading.Barrier(6)
    enough = threading.Event()
    stop_polling = threading.Event()

    def submit(t: int) -> None:
        s, direction = (src.ctypes.data, "h2d") if t % 2 else (dsrc.ctypes.data, "d2d")
        started.wait()
        for i in itertools.count():  # until the shutdown stops it
            j = (t << 32) + i
            k = t * 4096 + i % 4096  # the thread's slots, rewritten with the same bytes
            while True:
                try:
                    eng.submit(j, [s + k * 1024], [d + k * 1024], [1024], direction)
                    break
                except PoolExhaustedError:
                    continue  # the poller catches up
                except ShutdownError:
                    refused[t] += 1
                    return
            accepted[t].append(j)
            if len(accepted[t]) == 256:
                enough.set()

    def poll() -> None:
        started.wait()
        while not stop_polling.is_set():
            reported.extend(eng.get_finished())

    ts = [threading.Thread(target=submit, args=(t,), name=f"submit{t}") for t in range(4)]
    ts.append(threading.Thread(target=poll, name="poll"))
    for t in ts:
        t.start()
    started.wait()
    enough.wait(DEADLOCK)
    eng.shutdown()
    join_all(ts[:4])
    stop_polling.set()
    join_all(ts[4:])
    reported.extend(eng.get_finished())
    assert refused == dict.fromkeys(range(4), 1)
    every = {j for a in accepted.values() for j in a}
    assert Counter(r.job_id for r in reported) == Counter(every), "lost or reported twice"
    assert all(r.success and r.bytes == 1024 for r in reported)
    want = np.zeros(16 * MiB, dtype=np.uint8)
    for t, jobs in accepted.items():
        slots = np.unique(t * 4096 + np.asarray(jobs, dtype=np.int64) % (1 << 32) % 4096)
        pos = (slots[:, None] * 1024 + np.arange(1024)).reshape(-1)
        want[pos] = (src if t % 2 else dsrc)[pos]
    assert np.array_equal(dst, want)


def test_handler_shutdown_from_other_threads_while_transferring(
    caplog: pytest.LogCaptureFixture,
) -> None:
    base = threads()
    # Warnings only, from the start: a vLLM spec made earlier in the process leaves blockswap's
    # logger at INFO (vLLM's logging), and the handler logs its CPU cache at INFO when made.
    caplog.set_level(logging.WARNING, logger="blockswap")
    gpu = kv_cache(layers=8, blocks=64)
    h = CpuGpuHandlers(gpu, 64, layout="kv_split", backend="host")
    fill_random(gpu + h.cpu_caches[0], torch.Generator().manual_seed(2))
    g0 = [t.clone() for t in gpu]
    owned = weakref.ref(h.cpu_caches[0][0])
    accepted: list[int] = []
    refused: list[int] = []
    go = threading.Barrier(3)

    def offload() -> None:
        go.wait()
        for j in range(100_000):
            try:
                h.d2h.transfer_async(j, (np.arange(j % 64, j % 64 + 1), np.array([j % 64])))
            except ShutdownError:
                refused.append(j)
                return
            except PoolExhaustedError:
                continue  # too many in flight: the poller catches up
            accepted.append(j)

    polled: list[int] = []

    def poll_then_stop() -> None:
        go.wait()
        while len(accepted) < 200:
            polled.extend(r.job_id for r in h.get_finished() if r.success)
        h.shutdown()
        h.shutdown()

    ts = [threading.Thread(target=offload), threading.Thread(target=poll_then_stop)]
    for t in ts:
        t.start()
    go.wait()
    join_all(ts)
    h.shutdown()
    polled.extend(r.job_id for r in h.get_finished() if r.success)
    assert [r.getMessage() for r in caplog.records] == [], "memory left registered at shutdown"
    assert refused, "shutdown did not stop the offloading thread"
    assert sorted(polled) == sorted(accepted), "a result lost or reported twice"
    for t, t0 in zip(gpu, g0):
        assert torch.equal(t.view(torch.int16), t0.view(torch.int16))  # sources untouched
    del t
    gc.collect()
    assert owned() is None, "the CPU cache was not freed"
    assert not threads_settle(base)


ALLOC_ONCE = """
import gc, json, threading
import numpy as np
from blockswap import Engine, InvalidTransferError
from reliability_stress import rss_bytes

MiB = 1 << 20
out = {}
eng = Engine("host")
r0 = rss_bytes()
buf = eng.alloc_host(256 * MiB)
buf[:] = 1  # resident now
pinned = np.ones(64 * MiB, np.uint8)
eng.pin(pinned)
dev = np.zeros(256 * MiB, np.uint8)
eng.register(dev, kind="device")
keep = eng.alloc_host(128 * MiB)  # freed with the engine, below
keep[:] = 2
gone = eng.alloc_host(128 * MiB)
gone[:] = 3
for j in range(8):  # in flight while two threads shut down, twice each
    eng.submit(j, [buf.ctypes.data + j * 32 * MiB], [dev.ctypes.data + j * 32 * MiB], [32 * MiB])
ts = [threading.Thread(target=lambda: (eng.shutdown(), eng.shutdown())) for _ in range(2)]
for t in ts:
    t.start()
for t in ts:
    t.join()
out["results"] = sorted([r.job_id, r.success] for r in eng.get_finished())
out["copied"] = bool((dev == 1).all())
r1 = rss_bytes()
eng.free_host(buf)
r2 = rss_bytes()
try:
    eng.free_host(buf)
    out["second_free"] = "accepted"
except InvalidTransferError as e:
    out["second_free"] = str(e)
eng.unregister(pinned)
try:
    eng.unregister(pinned)
    out["second_unpin"] = "accepted"
except InvalidTransferError as e:
    out["second_unpin"] = str(e)
del buf
# buffers still allocated when the engine goes are freed with it, once; one whose array is
# still held keeps the engine's memory alive until the array goes
del gone, eng, dev
gc.collect()
r3 = rss_bytes()
keep[:] = 4  # still valid memory
out["kept_valid"] = bool((keep == 4).all())
del keep
gc.collect()
r4 = rss_bytes()
out["rss_mib"] = [round(x / MiB) for x in (r0, r1, r2, r3, r4)]
print(json.dumps(out))
"""


def test_host_memory_is_freed_exactly_once_after_shutdown_from_threads() -> None:
    out = run_isolated(
        f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})\n" + ALLOC_ONCE
    )
    assert out["results"] == [[j, True] for j in range(8)] and out["copied"]
    assert "no registered region" in out["second_free"]
    assert "no registered region" in out["second_unpin"]
    assert out["kept_valid"]
    r0, r1, r2, r3, r4 = out["rss_mib"]
    assert r1 - r0 >= 700, out  # buffers of 256 + 2 x 128 MiB, 256 MiB destination, 64 pinned
    assert r1 - r2 >= 200, f"free_host did not give the 256 MiB back: {out}"
    assert r3 - r4 >= 100, f"the kept buffer was not freed with its array: {out}"


GC_IN_FLIGHT = """
import gc, json
import numpy as np
import torch
import blockswap
from blockswap.handler import CpuGpuHandlers

# An engine collected with a 512 MiB copy in flight: its registered arrays must outlive the copy.
eng = blockswap.Engine("host")
n = 512 << 20
src = np.ones(n, np.uint8)
dst = np.zeros(n, np.uint8)
eng.register(src, kind="host")
eng.register(dst, kind="device")
eng.submit(1, [src.ctypes.data], [dst.ctypes.data], [n])
del src, dst, eng
gc.collect()
filler = [np.full(1 << 20, 9, np.uint8) for _ in range(600)]  # reuse the freed pages
# Handlers collected (never shut down) with offloads in flight.
gpu = [torch.ones(2, 64, 64, 8, 128, dtype=torch.bfloat16) for _ in range(16)]
h = CpuGpuHandlers(gpu, 64, layout="kv_split", backend="host")
for j in range(8):
    h.d2h.transfer_async(j, (np.arange(64), np.arange(64)))
del h
gc.collect()
filler += [np.full(1 << 20, 9, np.uint8) for _ in range(600)]
print(json.dumps({"ok": all(int(f[0]) == 9 for f in filler)}))
"""


def test_collecting_an_engine_or_handlers_with_transfers_in_flight_is_safe() -> None:
    """Both used to free the registered memory under the copy (SIGSEGV)."""
    assert run_isolated(GC_IN_FLIGHT) == {"ok": True}


def test_engines_made_and_shut_down_repeatedly_leak_no_thread_or_memory() -> None:
    src = np.ones(MiB, np.uint8)
    dst = np.zeros(MiB, np.uint8)

    def cycle(j: int) -> None:
        eng = Engine("host")
        eng.register(src, kind="host")
        eng.register(dst, kind="device")
        eng.register_table([src.ctypes.data], [4096], [4096], 256, "host")
        buf = eng.alloc_host(64 * KiB)
        for k in range(8):
            eng.submit(k, [src.ctypes.data + k * 4096], [dst.ctypes.data + k * 4096], [4096])
        if j % 2:
            eng.wait(range(8))
            eng.get_finished()
            eng.free_host(buf)
        eng.shutdown()  # with transfers in flight or their results unpolled
        eng.shutdown()

    base = threads()
    for j in range(20):
        cycle(j)
    gc.collect()
    r0 = rss_bytes()
    for j in range(300):
        cycle(j)
        assert not threads_settle(base)
    gc.collect()
    grown = rss_bytes() - r0
    assert grown < 8 * MiB, f"RSS grew {grown / MiB:.1f} MiB over 300 engines"


def test_a_shutdown_past_its_timeout_reports_each_transfer_as_it_ended(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Copies still running when ``shutdown_timeout`` passes: the shutdown returns and warns,
    and every accepted transfer is still reported exactly once: successful, with its bytes, if
    its copies completed before its result was collected (the host backend's worker finishes
    the memcpy it is in, which nothing can stop), else failed as still in flight."""
    rng = np.random.default_rng(11)
    eng = Engine("host", shutdown_timeout=0.001)
    src = rng.integers(1, 256, 64 * MiB, dtype=np.uint8)
    dst = np.zeros(64 * MiB, np.uint8)
    eng.register(src, kind="host")
    eng.register(dst, kind="device")
    size = 16 * MiB
    for job in range(4):
        at = np.array([job * size], np.int64)
        eng.submit(job, src.ctypes.data + at, dst.ctypes.data + at, np.array([size]), "h2d")
    with caplog.at_level(logging.WARNING, logger="blockswap"):
        eng.shutdown()
    results = eng.get_finished()
    assert sorted(r.job_id for r in results) == [0, 1, 2, 3]
    for r in results:
        part = slice(r.job_id * size, (r.job_id + 1) * size)
        if r.success:
            assert np.array_equal(dst[part], src[part]), r.job_id
        else:
            assert "still in flight when the engine shut down" in str(r.error), r
    if eng.stats()["shutdown_timed_out"]:
        assert any("may be reported failed" in m for m in caplog.messages), caplog.messages
    assert eng.get_finished() == []


@pytest.mark.parametrize("shut", [False, True], ids=["dropped", "shut-down"])
def test_handlers_collected_while_their_transfers_run_leave_the_memory_to_the_engine(
    shut: bool,
) -> None:
    """Handlers dropped without shutdown() while transfers run, the caller keeping only
    get_finished (to collect the results): the GPU tensors the copies write were held by the
    handlers alone (registered by address), and the garbage collector freed them under the
    copies (a segmentation fault). The engine holds them until it is collected, which drains
    first; every transfer is reported. After a shutdown that drained, the engine lets them go."""
    gpu = [torch.zeros(2, 64, 16, 8, 64) for _ in range(2)]
    alive = [weakref.ref(t) for t in gpu]
    h = CpuGpuHandlers(gpu, 64, layout="kv_split")
    del gpu
    ids = np.arange(64)
    for j in range(16):
        assert h.cpu_to_gpu_handler.transfer_async(j, (ids, ids))
    poll = h.get_finished
    if shut:
        h.shutdown()
    del h
    gc.collect()
    # Dropped: held by the engine while copies may still write them; shut down: let go.
    assert all((r() is None) is shut for r in alive)
    got = []
    for _ in range(3000):
        got += poll()
        if len(got) == 16:
            break
        threading.Event().wait(0.01)
    assert sorted(r.job_id for r in got) == list(range(16))
    assert all(r.success for r in got)
    del poll, got
    gc.collect()
    assert all(r() is None for r in alive)  # the engine went, and with it the memory
