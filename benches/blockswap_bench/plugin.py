"""Timing the vLLM plug-in's worker and vLLM's own transfer paths the same way, for the scripts
that set them side by side (``bench_vllm.py``, ``bench_canonical.py``): "isolated" is one
transfer's GPU time (the worker's ``transfer_time``; CUDA events around a vLLM call), median of
``reps`` after three discarded; the worker's "wall" is the same transfers' wall clock from submit
to ``wait`` returning, median; "8 queued" is 8 transfers back to back, bytes over wall time, best
of 3.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from blockswap_bench.common import cuda_time_on


def time_worker(
    w: Any, submit: Callable[[], int], nbytes: int, reps: int, direction: str
) -> tuple[dict[str, float], str]:
    """The worker's figures for transfers of ``nbytes`` that ``submit`` starts (it returns the
    job id), and the route its first handler takes in ``direction`` (``"d2h"`` / ``"h2d"``).
    Every result must succeed and count ``nbytes``."""
    import torch

    iso, wall = [], []
    for i in range(reps + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        j = submit()
        w.wait({j})
        t1 = time.perf_counter()
        (r,) = w.get_finished()
        assert r.success and r.transfer_size == nbytes, (r.success, r.transfer_size, nbytes)
        if i >= 3:
            iso.append(r.transfer_time)
            wall.append(t1 - t0)
    queued = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        jobs = {submit() for _ in range(8)}
        w.wait(jobs)
        queued.append(8 * nbytes / (time.perf_counter() - t0) / 1e9)
        assert all(r.success for r in w.get_finished())
    return {
        "isolated_gbps": nbytes / statistics.median(iso) / 1e9,
        "wall_gbps": nbytes / statistics.median(wall) / 1e9,
        "queued_gbps": max(queued),
    }, w.handlers[0].routes[direction].reason


def time_calls(
    stream: Any, call: Callable[[], Callable[[], None]], nbytes: int, reps: int
) -> dict[str, float]:
    """A vLLM path's figures: ``call()`` prepares one transfer of ``nbytes`` and returns what
    issues it on ``stream``."""
    import torch

    iso = [cuda_time_on(stream, call()) for _ in range(reps + 3)][3:]
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
