"""Reliability, 2. Injected faults."""

from __future__ import annotations

from collections import Counter

import numpy as np

from blockswap import Engine
from reliability_helpers import MiB, Scene, drain, run_isolated


def test_injected_faults_in_a_stream_of_transfers() -> None:
    """Rounds of 24 transfers (all four directions, 2-9 scattered descriptors each), the first
    0-3 of each round failed on purpose: each failed job is reported once with success=False
    and its error, every other job once with its bytes; a failed job's descriptors are each
    copied whole or not at all, and nothing outside the destinations changes; the slabs of
    failed jobs go home, and the statistics count them."""
    rng = np.random.default_rng(11)
    eng = Engine("host")
    mem = {
        "hs": rng.integers(1, 256, MiB, dtype=np.uint8),
        "ds": rng.integers(1, 256, MiB, dtype=np.uint8),
        "hd": np.zeros(MiB, dtype=np.uint8),
        "dd": np.zeros(MiB, dtype=np.uint8),
    }
    for k, a in mem.items():
        eng.register(a, kind="host" if k[0] == "h" else "device")
    routes = {"h2d": ("hs", "dd"), "d2h": ("ds", "hd"), "h2h": ("hs", "hd"), "d2d": ("ds", "dd")}
    failed_total = 0
    job = 0
    try:
        for _ in range(40):
            mem["hd"].fill(0)
            mem["dd"].fill(0)
            k = int(rng.integers(0, 4))
            eng.inject_failures(k)  # nothing in flight: the next k transfers fail
            jobs = []
            cursor = {"hd": 0, "dd": 0}
            for _ in range(24):
                direction = str(rng.choice(list(routes)))
                sk, dk = routes[direction]
                n = int(rng.integers(2, 10))
                sizes = rng.integers(1, 2048, n)
                dst_off = cursor[dk] + np.cumsum(sizes + 16) - sizes  # gaps: no coalescing
                cursor[dk] = int(dst_off[-1] + sizes[-1])
                src_off = rng.integers(0, MiB - 2048, n)
                job += 1
                eng.submit(
                    job,
                    mem[sk].ctypes.data + src_off,
                    mem[dk].ctypes.data + dst_off,
                    sizes,
                    direction,
                )
                jobs.append((job, sk, dk, src_off, dst_off, sizes))
            eng.wait([j[0] for j in jobs])
            results = drain(eng.get_finished, len(jobs))
            assert eng.get_finished() == []
            assert Counter(r.job_id for r in results) == Counter(j[0] for j in jobs)
            by_id = {r.job_id: r for r in results}
            written = {"hd": np.zeros(MiB, bool), "dd": np.zeros(MiB, bool)}
            for i, (j, sk, dk, so, do, z) in enumerate(jobs):
                r = by_id[j]
                assert r.bytes == int(z.sum())
                if i < k:
                    assert not r.success and "injected failure at descriptor" in r.error
                else:
                    assert r.success and r.error is None, r
                copied = 0
                for a, b, n in zip(so.tolist(), do.tolist(), z.tolist()):
                    got = mem[dk][b : b + n]
                    whole = np.array_equal(got, mem[sk][a : a + n])
                    assert whole or (not r.success and not got.any()), (j, i, r)
                    copied += whole
                    written[dk][b : b + n] = True
                assert r.success or copied < len(z), "a failed transfer copied everything"
            for dk in ("hd", "dd"):
                assert not mem[dk][~written[dk]].any(), "a write outside the destinations"
            failed_total += k
            stats = eng.stats()
            assert stats["in_flight"] == 0
            assert stats["pool"]["free"] == stats["pool"]["slabs"], "a failed job's slab is out"
            assert sum(stats[d]["failed"] for d in routes) == failed_total
        assert sum(eng.stats()[d]["transfers"] for d in routes) == job
    finally:
        eng.shutdown()


def test_injected_faults_on_block_table_transfers_and_reset() -> None:
    sc = Scene()
    eng = sc.eng
    try:
        eng.inject_failures(5)  # more than will be used: reset to 0 below
        eng.submit_blocks(10, sc.host_table, sc.ids(0, 2, 4, 6), sc.dev_table, sc.ids(1, 3, 5, 7))
        eng.submit_blocks(11, sc.host_table, sc.ids(8), sc.dev_table, sc.ids(9))
        eng.wait([10, 11])
        res = {r.job_id: r for r in drain(eng.get_finished, 2)}
        assert not res[10].success and not res[11].success
        eng.inject_failures(0)
        sc.dst[MiB // 2 :] = 0
        sc.before()
        sc.after()  # transfers and tables work again; every slab home
        assert eng.stats()["h2d"]["failed"] == 2
    finally:
        eng.shutdown()


def test_an_injected_fault_fails_a_transfer_its_launcher_moved_whole() -> None:
    """Every descriptor below ``kernel_below`` goes to the launcher: with nothing left for the
    worker's copies, an injected fault still fails the transfer (it was dropped, and the next
    transfer took none), and is not carried over to the next one."""
    eng = Engine("host")
    src = np.random.default_rng(2).integers(1, 256, 4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    eng.register(src, kind="host")
    eng.register(dst, kind="device")
    launched: list[int] = []

    def launcher(*args: int) -> None:
        launched.append(args[3])  # the number of descriptors it moves

    try:
        eng.inject_failures(1)
        eng.submit(1, [src.ctypes.data], [dst.ctypes.data], [64], kernel_below=1 << 20,
                   launcher=launcher)  # fmt: skip
        eng.wait([1])
        (r,) = drain(eng.get_finished, 1)
        assert (r.job_id, r.success) == (1, False) and "injected failure" in (r.error or "")
        eng.submit(2, [src.ctypes.data], [dst.ctypes.data], [4096])
        eng.wait([2])
        (r,) = drain(eng.get_finished, 1)
        assert (r.job_id, r.success) == (2, True)
        assert launched == [1] and np.array_equal(src, dst)
    finally:
        eng.shutdown()


STAGE_TOO_LARGE = """
import json
import numpy as np
import blockswap
from blockswap import Route

seg, n = 4096, 8
host = np.random.default_rng(6).integers(1, 256, 2 * n * seg, dtype=np.uint8)
dev = np.zeros(2 * n * seg, np.uint8)
eng = blockswap.Engine("host", stage_bytes=1 << 40)  # the largest slot the option takes
eng.register(host, kind="host")
eng.register(dev, kind="device")
h, d = host.ctypes.data, dev.ctypes.data
ht = eng.register_table([h, h + seg], [2 * seg] * 2, [seg] * 2, n, "host")
dt = eng.register_table([d, d + n * seg], [seg] * 2, [seg] * 2, n, "device")
ids = np.arange(4, dtype=np.int64)
eng.submit_groups(1, [(ht, ids, dt, ids, None)], "h2d", route=Route.staged())
eng.wait([1], timeout=60)
(r,) = eng.get_finished()
moved = all(
    np.array_equal(dev[s * n * seg + b * seg:][:seg], host[(2 * b + s) * seg:][:seg])
    for b in range(4) for s in range(2)
)
eng.shutdown()
print(json.dumps({"success": r.success, "error": r.error, "moved": bool(moved)}))
"""


def test_a_staging_slot_the_host_cannot_hold_fails_the_transfer_not_the_process() -> None:
    """On the host backend the slot is allocated by the engine's thread at the first staged
    transfer: where memory cannot hold it, that transfer fails with the size, and the process
    lives (where the system overcommits, the slot is mapped and the transfer moves its bytes)."""
    out = run_isolated(STAGE_TOO_LARGE)
    if out["success"]:
        assert out["moved"], out
    else:
        assert out["error"] == "could not allocate 1099511627776 bytes of host memory", out
