"""Section 3, bidirectional: an offload (device -> host) and an onload (host -> device) at once,
beside each direction alone and beside the link's ceiling both ways.

Per block size (``bidir_blocks`` scattered blocks, fewer for large blocks so that a direction
moves at most ``bidir_bytes``) and path (``dma``, ``kernel``): the onload alone, the offload
alone, and both submitted together on the engine's two lanes (its own stream each). "ceiling" is
one large pinned copy each way, alone and together. On a GPU every time is CUDA events: one
start event the two copy streams wait on, one end event per stream; "both" lasts until the later
end. ``duplex_gain`` is the aggregate over the faster direction alone: 2 where the link carries
both directions in full, 1 where they share it. On the host backend (memcpy) times are wall clock
and only the aggregate of "both" is known.

Path ``handler``, per block size as a page size: the default
:class:`~blockswap.handler.CpuGpuHandlers` over separately allocated layer tensors (vLLM's
per-layer layout; on a GPU the staged plan at small pages), 32 random GPU blocks to or from 32
random CPU blocks a transfer, the onload submitted first; wall clock from a synchronised device
to both results seen, as a caller waits. Its route keeps each direction's work off the other's
copy engine queue: where a GPU -> CPU transfer's first kernel waited for a copy queued behind the
onload's rows, both at once moved one direction's worth (H200, 2026-11-30), which this row shows
and the engine-level rows above, which take no handler route, do not.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from blockswap._bench import check_result, one_copy
from blockswap._types import Direction
from blockswap.engine import Engine

from .common import address, fmt_bytes, fmt_count, median, scatter
from .context import Context
from .sweep import KERNEL_ALL, kernel_launchers

DIRS: tuple[Direction, Direction] = ("h2d", "d2h")


def run(ctx: Context) -> dict[str, Any]:
    p = ctx.profile
    ceiling = {d: ctx.ceiling(d) for d in DIRS}
    host, dev = ctx.pools()
    half = p.cap_bytes // 2
    # The onload reads the first half of the host buffer into the first half of the device
    # buffer; the offload writes the second half of the device buffer into the second half of
    # the host buffer: no byte is read by one direction and written by the other.
    bufs = {"h2d": (host[:half], dev[:half]), "d2h": (dev[half:], host[half:])}
    streams: dict[str, Any] = {}
    if ctx.cuda:
        import torch

        streams = {d: torch.cuda.Stream() for d in DIRS}
    eng = ctx.engine(
        h2d_stream=streams["h2d"].cuda_stream if streams else None,
        d2h_stream=streams["d2h"].cuda_stream if streams else None,
    )
    launchers, kernel_note, _ = kernel_launchers(ctx)
    rows: list[dict[str, Any]] = []
    try:
        big = min(p.ceiling_bytes, half)
        rows.append(_measure(ctx, "ceiling", _copiers(ctx, bufs, streams, big), streams, big, 1))
        for size in p.bidir_sizes:
            n = min(p.bidir_blocks, p.bidir_bytes // size, half // size)
            for path in ("dma", "kernel"):
                if path == "kernel" and (
                    kernel_note is not None or (not ctx.cuda and n * size > p.interpreter_max_bytes)
                ):
                    rows.append(
                        {
                            "path": path,
                            "block_bytes": size,
                            "blocks": n,
                            "bytes_per_direction": n * size,
                            "status": "skipped",
                            "reason": kernel_note
                            or "no GPU: the Triton interpreter is too slow for this size",
                        }
                    )
                    continue
                issuers = _submitters(
                    ctx, eng, bufs, size, n, launchers if path == "kernel" else None
                )
                rows.append(_measure(ctx, path, issuers, streams, n * size, n, size))
    finally:
        eng.shutdown()
    for size in p.bidir_sizes:
        if size <= HANDLER_MAX_PAGE:
            rows.append(_handler_row(ctx, size))
    for r in rows:
        if r["status"] != "ok":
            continue
        r["aggregate_fraction_of_ceiling"] = r["aggregate_gbps"] / (ceiling["h2d"] + ceiling["d2h"])
        r["duplex_gain"] = r["aggregate_gbps"] / max(r["h2d_alone_gbps"], r["d2h_alone_gbps"])
    return {
        "rows": rows,
        "ceiling_gbps": ceiling,
        "timing": "cuda_events" if ctx.cuda else "wall",
    }


Issuer = tuple[Callable[[], None], Callable[[], None]]
"""``(issue, finish)``: enqueue one direction's transfer; wait for it."""


def _finisher(waiter: Any, done: dict[int, Any], j: int) -> Callable[[], None]:
    """Waits for job ``j`` on ``waiter`` (an engine or handlers: ``wait`` and ``get_finished``)
    and checks its result; results polled meanwhile for the other direction's job wait in
    ``done``."""

    def finish() -> None:
        waiter.wait([j])
        for r in waiter.get_finished():
            done[r.job_id] = r
        check_result([done.pop(j)] if j in done else [], j)

    return finish


#: Layer tensors of the ``handler`` row (fewer where the profile caps a handler's layers), and
#: its blocks a transfer.
HANDLER_LAYERS = 80
HANDLER_BLOCKS = 32
#: The ``handler`` row's largest page: past it a layer's page is a large copy of its own, which
#: the ``dma`` rows cover.
HANDLER_MAX_PAGE = 64 * 1024


def _handler_row(ctx: Context, page: int) -> dict[str, Any]:
    """The ``handler`` path at ``page``-byte pages (see the module's doc)."""
    import torch

    from blockswap.handler import CpuGpuHandlers

    layers = min(HANDLER_LAYERS, ctx.profile.handler_max_layers or HANDLER_LAYERS)
    n = HANDLER_BLOCKS
    device = "cuda" if ctx.cuda else "cpu"
    gpu = [torch.zeros((2 * n, 1, page), dtype=torch.uint8, device=device) for _ in range(layers)]
    try:
        h = CpuGpuHandlers(gpu, 2 * n, layout="mla", backend="cuda" if ctx.cuda else "host")
    except Exception as e:
        return {"path": "handler", "block_bytes": page, "blocks": n,
                "bytes_per_direction": n * layers * page, "status": "failed",
                "reason": f"{type(e).__name__}: {e}"}  # fmt: skip
    done: dict[int, Any] = {}

    def make(concurrent: bool) -> dict[str, Issuer]:
        out: dict[str, Issuer] = {}
        for d in DIRS:
            j = ctx.job()
            g, c = ctx.rng.permutation(2 * n)[:n], ctx.rng.permutation(2 * n)[:n]
            ids = (c, g) if d == "h2d" else (g, c)
            lane = h.h2d if d == "h2d" else h.d2h

            def issue(j: int = j, ids: Any = ids, lane: Any = lane) -> None:
                lane.transfer_async(j, ids)

            out[d] = (issue, _finisher(h, done, j))
        return out

    try:
        row = _measure(ctx, "handler", make, {}, n * layers * page, n, page, wall=True)
        row["route"] = {d: str(h.routes[d].reason) for d in DIRS}
        row["layers"] = layers
        return row
    finally:
        h.shutdown()


def _copiers(
    ctx: Context, bufs: dict[str, tuple[Any, Any]], streams: dict[str, Any], nbytes: int
) -> Callable[[bool], dict[str, Issuer]]:
    """The ceiling: one large copy per direction (on the host backend, ``concurrent``: the
    copies on threads, which numpy lets run at once; else on the calling thread)."""

    def make(concurrent: bool) -> dict[str, Issuer]:
        return {d: _copier(ctx, *bufs[d], streams.get(d), nbytes, concurrent) for d in DIRS}

    return make


def _copier(ctx: Context, src: Any, dst: Any, stream: Any, nbytes: int, threaded: bool) -> Issuer:
    if ctx.cuda or not threaded:
        return one_copy(src, dst, nbytes, stream if ctx.cuda else None), _nothing
    box: list[threading.Thread] = []

    def start() -> None:
        box.append(threading.Thread(target=np.copyto, args=(dst[:nbytes], src[:nbytes])))
        box[-1].start()

    def join() -> None:
        box.pop().join()

    return start, join


def _nothing() -> None:
    return None


def _submitters(
    ctx: Context,
    eng: Engine,
    bufs: dict[str, tuple[Any, Any]],
    size: int,
    n: int,
    launchers: dict[str, Any] | None,
) -> Callable[[bool], dict[str, Issuer]]:
    """The engine: one transfer of ``n`` scattered blocks per direction, by DMA or (with
    ``launchers``, one per direction) by the copy kernel."""
    half = ctx.profile.cap_bytes // 2
    slots = min(half // size, 4 * n)
    arrays = {}
    for d in DIRS:
        src, dst = bufs[d]
        s_ids, d_ids = scatter(ctx.rng, n, slots)
        arrays[d] = (
            (address(src) + s_ids * size).astype(np.int64),
            (address(dst) + d_ids * size).astype(np.int64),
        )
    szs = np.full(n, size, dtype=np.int64)
    below = KERNEL_ALL if launchers is not None else 0
    done: dict[int, Any] = {}  # results polled while waiting for the other direction

    def make(concurrent: bool) -> dict[str, Issuer]:
        out: dict[str, Issuer] = {}
        for d in DIRS:
            j = ctx.job()
            src, dst = arrays[d]

            launch = launchers[d] if launchers is not None else None

            def issue(
                j: int = j, src: Any = src, dst: Any = dst, d: Direction = d, launch: Any = launch
            ) -> None:
                eng.submit(j, src, dst, szs, d, kernel_below=below, launcher=launch)

            out[d] = (issue, _finisher(eng, done, j))
        return out

    return make


def _run_once(
    ctx: Context,
    make: Callable[[bool], dict[str, Issuer]],
    streams: dict[str, Any],
    dirs: tuple[str, ...],
    wall: bool = False,
) -> dict[str, float]:
    """Seconds per direction (``"all"``: until the last one ended) of one run of ``dirs``;
    ``wall``: wall clock on a GPU too (from a synchronised device to the last result), only
    ``"all"`` known for "both"."""
    issuers = make(len(dirs) > 1)
    if ctx.cuda and wall:
        import torch

        torch.cuda.synchronize()
    if ctx.cuda and not wall:
        import torch

        start = torch.cuda.Event(enable_timing=True)
        start.record()
        for d in dirs:
            streams[d].wait_event(start)
        ends = {}
        for d in dirs:
            issuers[d][0]()
        for d in dirs:
            ends[d] = torch.cuda.Event(enable_timing=True)
            ends[d].record(streams[d])
        for d in dirs:
            issuers[d][1]()
        out = {}
        for d in dirs:
            ends[d].synchronize()
            out[d] = start.elapsed_time(ends[d]) / 1e3
        out["all"] = max(out[d] for d in dirs)
    else:
        t0 = time.perf_counter()
        for d in dirs:
            issuers[d][0]()
        for d in dirs:
            issuers[d][1]()
        out = {"all": time.perf_counter() - t0}
        if len(dirs) == 1:
            out[dirs[0]] = out["all"]
    return out


def _measure(
    ctx: Context,
    path: str,
    make: Callable[[bool], dict[str, Issuer]],
    streams: dict[str, Any],
    nbytes: int,
    n: int,
    size: int | None = None,
    wall: bool = False,
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "path": path,
        "block_bytes": size,
        "blocks": n,
        "bytes_per_direction": nbytes,
        "status": "ok",
        "reason": None,
    }
    try:
        for label, dirs in (("h2d_alone", ("h2d",)), ("d2h_alone", ("d2h",)), ("both", DIRS)):
            samples = ctx.repeat(lambda dirs=dirs: _run_once(ctx, make, streams, dirs, wall))
            if label == "both":
                row["aggregate_gbps"] = 2 * nbytes / median([s["all"] for s in samples]) / 1e9
                for d in DIRS:
                    ts = [s[d] for s in samples if d in s]
                    row[f"both_{d}_gbps"] = nbytes / median(ts) / 1e9 if ts else None
            else:
                row[f"{label}_gbps"] = nbytes / median([s["all"] for s in samples]) / 1e9
            row["reps"] = len(samples)
    except Exception as e:
        row["status"], row["reason"] = "failed", f"{type(e).__name__}: {e}"
    what = "ceiling (one large copy each way)" if path == "ceiling" else path
    head = f"bidir {what}" + (
        f" {fmt_bytes(size)} x {fmt_count(n)}" if size else f" {fmt_bytes(nbytes)}"
    )
    if row["status"] == "ok":
        ctx.log(
            f"{head}: h2d alone {row['h2d_alone_gbps']:.2f}, d2h alone {row['d2h_alone_gbps']:.2f}, "
            f"both {row['aggregate_gbps']:.2f} GB/s aggregate"
        )
    else:
        ctx.log(f"{head}: {row['status']} ({row['reason']})")
    return row
