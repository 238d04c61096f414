"""Reliability, 2. Injected faults."""

from __future__ import annotations

from collections import Counter

import numpy as np

from blockswap import Engine
from reliability_helpers import MiB, Scene, drain


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
