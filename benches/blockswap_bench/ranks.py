"""Ranks of vLLM's shared offload region as processes on one machine, started together: what the
probes of a tensor-parallel deployment's region share (``probe_rank_cells.py``,
``probe_pin_threads.py``). Each rank runs in a process of its own (spawned), so the region's
memory goes with the processes."""

from __future__ import annotations

import multiprocessing as mp
import uuid
from collections.abc import Callable
from typing import Any


def run_ranks(target: Callable[..., None], world: int, *args: Any) -> list[dict[str, Any]]:
    """``target(rank, engine_id, start, out, *args)`` in ``world`` spawned processes; returns what
    each put on ``out`` (one dict a rank, with its ``"rank"``), in rank order. ``start``: a
    barrier of the ranks; ``engine_id``: a fresh one for the region they share."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(world), ctx.Queue()
    engine = f"probe_ranks_{uuid.uuid4().hex[:8]}"
    procs = [ctx.Process(target=target, args=(r, engine, start, out, *args)) for r in range(world)]
    for p in procs:
        p.start()
    ranks = sorted((out.get(timeout=600) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise RuntimeError(f"a rank exited with {p.exitcode}")
    return ranks


def region_kwargs(
    size: int, world: int, cell: int, rank: int, engine: str, barrier: Callable[[], Any]
) -> dict[str, Any]:
    """What vLLM's ``CPUOffloadingSpec`` gives its ``SharedOffloadRegion`` for a region of
    ``size`` bytes, ``world`` ranks and ``cell`` bytes a rank's cell of a row."""
    from vllm.v1.kv_offload.cpu import spec as cpu_spec

    return {
        "engine_id": engine,
        "num_chunks": size // (cell * world),
        "rank": rank,
        "kv_bytes_per_chunk": cell * world,
        "cpu_page_size": cell,
        "barrier": barrier,
        "num_segments": cpu_spec._REGION_SEGMENTS,
    }
