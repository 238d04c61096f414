"""Section 1, the sweep: block size x blocks per transfer x direction x path, each point beside
the link's ceiling of the same run.

Paths, at every point (``N`` blocks of one size, scattered: random slots of a buffer four times
the transfer, so nothing coalesces):

``one_copy``        one copy of the same total bytes, contiguous: what the bytes cost without
                    the blocks (the ceiling at this transfer size).
``per_block_copy``  one copy per block: ``Tensor.copy_(non_blocking=True)`` on the copy stream
                    (GPU), one numpy copy per block (host backend). The loop KV offloading used
                    before batching.
``dma``             blockswap's engine, every descriptor to the copy engines in one
                    ``cuMemcpyBatchAsync`` (memcpy on a worker thread on the host backend).
``kernel``          blockswap's engine, every descriptor to the Triton copy kernel, launched
                    as the handler's ``path="kernel"`` configures it for the direction; it
                    reads the descriptors from the pinned slab in place. On the host backend the
                    kernel runs under Triton's interpreter, at a few MB/s: only tiny points.
``auto``            a :class:`~blockswap.handler.CpuGpuHandlers` over the same buffers, pages of
                    the block size, ``path="auto"``: the path the handler chooses, through its
                    ``transfer_async``. Its rows name the choice.

GPU time is measured with CUDA events on the copy stream (from before the submission to after
it, so a slow submission shows), host submission time with ``perf_counter``; on the host backend
both are wall time. Points whose transfer exceeds the profile's cap are recorded as skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from blockswap._bench import AutoHandler, address, engine_measure, one_copy, scatter, timer
from blockswap._types import Direction
from blockswap.engine import Engine

from .common import fmt_bytes, fmt_count, handler_route, median
from .context import Context

PATHS = ("one_copy", "per_block_copy", "dma", "kernel", "auto")
LABELS = {
    "one_copy": "one copy, same bytes",
    "per_block_copy": "copy_ per block",
    "dma": "DMA batch",
    "kernel": "kernel",
    "auto": "auto (handler)",
}
SHORT = {
    "one_copy": "one",
    "per_block_copy": "copy_",
    "dma": "dma",
    "kernel": "kernel",
    "auto": "auto",
}
KERNEL_ALL = 1 << 62  # kernel_below: every descriptor to the kernel
DIRS: tuple[Direction, Direction] = ("h2d", "d2h")


def run(ctx: Context) -> dict[str, Any]:
    p = ctx.profile
    ceiling = {d: ctx.ceiling(d) for d in ("h2d", "d2h")}
    lane = ctx.stream.cuda_stream if ctx.cuda else None
    eng = ctx.engine(h2d_stream=lane, d2h_stream=lane)
    launchers, kernel_note, kernel_what = kernel_launchers(ctx)
    rows: list[dict[str, Any]] = []
    try:
        for size in p.sizes:
            host, dev = ctx.pools()
            handler = AutoHandler(host, dev, size, ctx.stream)
            try:
                for n in p.counts:
                    for direction in DIRS:
                        launcher = launchers[direction] if launchers else None
                        point = _point(ctx, eng, launcher, kernel_note, handler, direction, size, n)
                        for r in point:
                            r["ceiling_gbps"] = ceiling[direction]
                            if r["gbps"] is not None:
                                r["fraction_of_ceiling"] = r["gbps"] / ceiling[direction]
                        rows.extend(point)
                        ctx.log(_progress_line(point))
            finally:
                handler.shutdown()
    finally:
        eng.shutdown()
    return {
        "rows": rows,
        "paths": {k: LABELS[k] for k in PATHS},
        "timing": "cuda_events" if ctx.cuda else "wall",
        "cap_bytes": p.cap_bytes,
        "kernel": kernel_what or kernel_note,
        "scatter": "N distinct random slots out of min(cap / block, 4 N) on each side",
        "per_block_copy": (
            "Tensor.copy_(non_blocking=True), one per block, on the copy stream"
            if ctx.cuda
            else "numpy copyto, one per block"
        ),
    }


def kernel_launchers(ctx: Context) -> tuple[dict[str, Any] | None, str | None, dict[str, str]]:
    """The copy kernel's launcher per direction, as the handler configures it for
    ``path="kernel"`` (its engine's defaults where that cannot be read), or ``None`` and why the
    kernel cannot run here; and a description per direction."""
    try:
        import torch

        from blockswap.handler import CpuGpuHandlers
        from blockswap.kernels import engine_launcher, interpreter_mode
    except ImportError as e:
        return None, f"needs torch and triton ({e})", {}
    if not ctx.cuda and not interpreter_mode():
        return (
            None,
            (
                "no GPU, and the Triton kernels were built for one: set TRITON_INTERPRET=1 before "
                "blockswap.kernels is imported"
            ),
            {},
        )
    try:
        gpu = torch.zeros((8, 1, 4096), dtype=torch.uint8, device="cuda" if ctx.cuda else "cpu")
        h = CpuGpuHandlers(
            gpu, 8, layout="mla", path="kernel", backend="cuda" if ctx.cuda else "host"
        )
        try:
            routes = {d: handler_route(h, d) for d in DIRS}
        finally:
            h.shutdown()
        if all(r is not None and r.launcher is not None for r in routes.values()):
            launchers: dict[str, Any] = {d: r.launcher for d, r in routes.items()}
            return (
                launchers,
                None,
                {
                    d: f"the handler's path='kernel', {str(r.reason).split(':')[0]}"
                    for d, r in routes.items()
                },
            )
    except Exception:
        pass
    launch = engine_launcher(max_ctas=ctx.profile.kernel_ctas)
    what = f"engine_launcher(max_ctas={ctx.profile.kernel_ctas})"
    return {d: launch for d in DIRS}, None, {d: what for d in DIRS}


def _row(direction: str, size: int, n: int, path: str) -> dict[str, Any]:
    return {
        "direction": direction,
        "block_bytes": size,
        "blocks": n,
        "total_bytes": size * n,
        "path": path,
        "status": "ok",
        "reason": None,
        "gbps": None,
        "fraction_of_ceiling": None,
        "time_s": None,
        "submit_us": None,
        "reps": 0,
    }


def _point(
    ctx: Context,
    eng: Engine,
    launcher: Any,
    kernel_note: str | None,
    handler: AutoHandler,
    direction: Direction,
    size: int,
    n: int,
) -> list[dict[str, Any]]:
    p = ctx.profile
    total = size * n
    rows = {path: _row(direction, size, n, path) for path in PATHS}
    if total > p.cap_bytes:
        for r in rows.values():
            r["status"] = "skipped"
            r["reason"] = (
                f"{fmt_bytes(total)} per transfer is over the {fmt_bytes(p.cap_bytes)} cap"
            )
        return list(rows.values())

    src_t, dst_t = ctx.src_dst(direction)
    slots = min(p.cap_bytes // size, 4 * n)
    s_ids, d_ids = scatter(ctx.rng, n, slots)
    src = (address(src_t) + s_ids * size).astype(np.int64)
    dst = (address(dst_t) + d_ids * size).astype(np.int64)
    szs = np.full(n, size, dtype=np.int64)
    stream = ctx.stream
    timed = timer(stream)

    if ctx.cuda:
        import torch

        s_rows = src_t[: slots * size].view(slots, size)
        d_rows = dst_t[: slots * size].view(slots, size)
        pairs = [(s_rows[i], d_rows[j]) for i, j in zip(s_ids.tolist(), d_ids.tolist())]

        def per_block() -> None:
            with torch.cuda.stream(stream):
                for s, d in pairs:
                    d.copy_(s, non_blocking=True)

    else:
        s_rows = src_t[: slots * size].reshape(slots, size)
        d_rows = dst_t[: slots * size].reshape(slots, size)
        pairs = [(s_rows[i], d_rows[j]) for i, j in zip(s_ids.tolist(), d_ids.tolist())]

        def per_block() -> None:
            for s, d in pairs:
                np.copyto(d, s)

    def engine_path(kernel: bool) -> Callable[[], Any]:
        below, launch = (KERNEL_ALL, launcher) if kernel else (0, None)
        return engine_measure(
            eng, ctx.job, timed, src, dst, szs, direction, kernel_below=below, launcher=launch
        )

    copy = one_copy(src_t, dst_t, total, stream)
    measures: dict[str, Callable[[], Any] | str] = {
        "one_copy": lambda: timed(copy),
        "per_block_copy": lambda: timed(per_block),
        "dma": engine_path(False),
    }
    if kernel_note is not None:
        measures["kernel"] = f"kernel skipped: {kernel_note}"
    elif not ctx.cuda and total > p.interpreter_max_bytes:
        measures["kernel"] = (
            "no GPU: the Triton interpreter copies at a few MB/s, so it runs only up to "
            f"{fmt_bytes(p.interpreter_max_bytes)} per transfer"
        )
    else:
        measures["kernel"] = engine_path(True)
    measures["auto"] = handler.error or handler.measure(ctx.job, timed, direction, (s_ids, d_ids))

    for path, m in measures.items():
        r = rows[path]
        if isinstance(m, str):
            r["status"], r["reason"] = "skipped", m
            continue
        try:
            samples = ctx.repeat(m)
        except Exception as e:
            r["status"], r["reason"] = "failed", f"{type(e).__name__}: {e}"
            continue
        t = median([s[0] for s in samples])
        r["time_s"] = t
        r["submit_us"] = median([s[1] for s in samples]) * 1e6
        r["gbps"] = total / t / 1e9 if t > 0 else None
        r["reps"] = len(samples)
    rows["auto"]["chosen"] = handler.chosen.get(direction)
    rows["auto"]["route"] = handler.route.get(direction)
    return list(rows.values())


def _progress_line(point: list[dict[str, Any]]) -> str:
    r0 = point[0]
    head = (
        f"sweep {r0['direction']} {fmt_bytes(r0['block_bytes']):>7} x {fmt_count(r0['blocks']):>6}:"
    )
    if all(r["status"] == "skipped" for r in point) and point[0]["reason"]:
        return f"{head} skipped ({point[0]['reason']})"
    parts = []
    for r in point:
        v = f"{r['gbps']:.2f}" if r["gbps"] is not None else r["status"]
        if r["path"] == "auto" and r.get("chosen"):
            v += f" ({r['chosen']})"
        parts.append(f"{SHORT[r['path']]} {v}")
    return f"{head} " + " | ".join(parts) + " GB/s"
