"""Timing the vLLM plug-in's worker and vLLM's own transfer paths side by side, for the scripts
that compare them (``bench_vllm.py``, ``bench_canonical.py``). "Isolated" is one transfer's GPU
time, median of ``reps`` after three discarded: the worker's ``transfer_time`` (events the
engine's thread records on the lane's stream, the first before it issues the transfer's first
copy: no host time before it, the host's between a staged transfer's steps inside), and for a
vLLM path or the rows floor the copies' time behind a gate (:func:`gated_gpu_seconds`: the call
is issued while the stream waits, so none of its host time is inside, and its copies run back to
back: the best case of that path, never worse than the worker is timed). The worker's "wall" is
the same transfers' wall clock from submit to ``wait`` returning, median. "8 queued" is 8
transfers back to back, bytes over wall time from the first submission to the last result, best
of 3 rounds, for all of them. Each transfer's vLLM specs are built before its clock starts, as
vLLM hands them in (and as each vLLM path's descriptors are built before its call).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from blockswap_bench.common import gated_gpu_seconds

#: The gate before a vLLM path's isolated call: 60 M cycles (about 30 ms on an H100 or H200),
#: longer than the slowest call's host time (vLLM's DMA path held its caller up to 14 ms).
GATE_CYCLES = 60_000_000


class CPUSpec:
    """vLLM's ``CPULoadStoreSpec`` as the worker reads it: chunk ids in ``block_ids`` (its module,
    ``vllm.v1.kv_offload.cpu.common``, imports most of vLLM)."""

    def __init__(self, ids: Any) -> None:
        import numpy as np

        self.block_ids = np.asarray(ids, dtype=np.int64)


def time_worker(
    w: Any,
    spec: Callable[[], tuple[list[list[int]], list[int]]],
    to_cpu: bool,
    nbytes: int,
    reps: int,
) -> tuple[dict[str, float], str]:
    """The worker's figures for transfers of ``nbytes``, each of the GPU block ids per group and
    the chunks ``spec()`` gives (first sub-block 0), stored (``to_cpu``) or loaded; its host time
    per submit (median, µs); and the route its first handler takes that way. Every result must
    succeed and count ``nbytes``."""
    import torch
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    job = 0
    host: list[float] = []

    def make() -> tuple[Any, CPUSpec]:
        # vLLM hands the worker specs it built: building them is no part of a transfer's time,
        # as preparing vLLM's own calls is none of theirs (``time_calls``).
        ids, chunks = spec()
        gspec = GPULoadStoreSpec([b for g in ids for b in g], [len(g) for g in ids], [0] * len(ids))
        return gspec, CPUSpec(chunks)

    def submit(specs: tuple[Any, CPUSpec]) -> int:
        nonlocal job
        job += 1
        gspec, cspec = specs
        t0 = time.perf_counter()
        ok = w.submit_store(job, gspec, cspec) if to_cpu else w.submit_load(job, cspec, gspec)
        host.append(time.perf_counter() - t0)
        assert ok
        return job

    iso, wall = [], []
    for i in range(reps + 3):
        one = make()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        j = submit(one)
        w.wait({j})
        t1 = time.perf_counter()
        (r,) = w.get_finished()
        assert r.success and r.transfer_size == nbytes, (r.success, r.transfer_size, nbytes)
        if i >= 3:
            iso.append(r.transfer_time)
            wall.append(t1 - t0)
    host_us = statistics.median(host[3:]) * 1e6
    queued = []
    for _ in range(3):
        eight = [make() for _ in range(8)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        jobs = {submit(s) for s in eight}
        w.wait(jobs)
        queued.append(8 * nbytes / (time.perf_counter() - t0) / 1e9)
        assert all(r.success for r in w.get_finished())
    return {
        "isolated_gbps": nbytes / statistics.median(iso) / 1e9,
        "wall_gbps": nbytes / statistics.median(wall) / 1e9,
        "queued_gbps": max(queued),
        "host_us": host_us,
    }, w.handlers[0].routes["d2h" if to_cpu else "h2d"].reason


def time_calls(
    stream: Any, call: Callable[[], Callable[[], None]], nbytes: int, reps: int
) -> dict[str, float]:
    """A vLLM path's figures: ``call()`` prepares one transfer of ``nbytes`` and returns what
    issues it on ``stream``."""
    import torch

    def gated(issue: Callable[[], None]) -> float:
        def on_stream() -> None:
            with torch.cuda.stream(stream):
                issue()

        return gated_gpu_seconds(on_stream, [stream], GATE_CYCLES)

    iso = [gated(call()) for _ in range(reps + 3)][3:]
    queued = []
    for _ in range(3):
        calls = [call() for _ in range(8)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            for c in calls:
                c()
        stream.synchronize()
        queued.append(8 * nbytes / (time.perf_counter() - t0) / 1e9)
    return {"isolated_gbps": nbytes / statistics.median(iso) / 1e9, "queued_gbps": max(queued)}
