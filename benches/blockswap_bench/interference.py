"""Section 4, interference: what an onload costs the model. A bf16 GEMM (8192^3 by default) on
the compute stream, alone and while scattered host -> device transfers run beside it, per path.

For each path, three rounds of: the GEMM timed alone, then enough transfers queued on the
engine's own stream to outlast the GEMMs and the GEMMs timed again (CUDA events on the compute
stream); medians over the rounds. The copies' bandwidth is read from the wall clock of the
queues. The DMA path uses copy engines only; the kernel path takes ``max_ctas`` SMs, one launch
per transfer or launches of at most ``launch_bytes`` each (a launch holds its SMs until it ends,
and the GEMM's CTAs wait for them); ``auto`` is the route the handler chooses for pages of the
block size. Needs a GPU.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from blockswap._bench import check_result
from blockswap.engine import Engine

from .common import fmt_bytes, fmt_count, handler_route, median
from .context import Context
from .sweep import KERNEL_ALL


def gemm_ms(a: Any, b: Any, reps: int) -> list[float]:
    """Milliseconds of ``reps`` back-to-back ``a @ b`` on the current stream (CUDA events)."""
    import torch

    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.mm(a, b)
        e.record()
        out.append((s, e))
    # The last end event, not the device: copies on other streams may still be running.
    out[-1][1].synchronize()
    return [s.elapsed_time(e) for s, e in out]


def auto_route(size: int) -> Any:
    """The route a handler picks for host -> device pages of ``size`` bytes."""
    import torch

    from blockswap.handler import CpuGpuHandlers

    gpu = torch.empty((8, 1, size), dtype=torch.uint8, device="cuda")
    h = CpuGpuHandlers(gpu, 8, layout="mla")
    try:
        return handler_route(h, "h2d")
    finally:
        h.shutdown()


def run(ctx: Context, ctas: tuple[int, ...] | None = None) -> dict[str, Any]:
    if not ctx.cuda:
        return {
            "skipped": "needs a GPU: the GEMM runs on the compute stream beside the copies",
            "rows": [],
        }
    import torch

    from blockswap.kernels import engine_launcher

    p = ctx.profile
    ctas = ctas or p.interference_ctas
    torch.manual_seed(0)
    a = torch.randn(p.gemm_n, p.gemm_n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(p.gemm_n, p.gemm_n, dtype=torch.bfloat16, device="cuda")
    gemm_ms(a, b, 5)
    size = p.interference_block
    n = min(p.interference_blocks, p.cap_bytes // (2 * size))
    host, dev = ctx.pools()
    rng = np.random.default_rng(ctx.seed)
    src = host.data_ptr() + rng.permutation(2 * n)[:n].astype(np.int64) * size
    dst = dev.data_ptr() + rng.permutation(2 * n)[:n].astype(np.int64) * size
    sizes = np.full(n, size, dtype=np.int64)
    paths: list[tuple[str, int | None, int | None, int, Any]] = [("dma", None, None, 0, None)]
    paths += [("kernel", c, None, KERNEL_ALL, engine_launcher(max_ctas=c)) for c in ctas]
    paths += [
        ("kernel", max(ctas), lb, KERNEL_ALL, engine_launcher(max_ctas=max(ctas), launch_bytes=lb))
        for lb in p.interference_launch_bytes
    ]
    route_note = None
    try:
        route = auto_route(size)
        # The handler's kernel runs from the core (no launcher) where it can: the same kernel
        # from Python here, as engine.submit takes it.
        launch = route.launcher
        if launch is None and route.kernel_below:
            launch = engine_launcher(max_ctas=16, launch_bytes=route.launch_bytes)
        paths.append(("auto", None, None, int(route.kernel_below), launch))
        route_note = str(route.reason)
    except Exception as e:
        route_note = f"the handler could not be built: {type(e).__name__}: {e}"
    rows = []
    eng = ctx.engine()  # its own streams: the copies run beside the compute stream
    try:
        for name, c, lb, below, launch in paths:
            row: dict[str, Any] = {
                "path": name,
                "ctas": c,
                "launch_bytes": lb,
                "block_bytes": size,
                "blocks": n,
                "status": "ok",
                "reason": None,
            }
            if name == "auto":
                row["route"] = route_note
            try:
                row.update(_one(ctx, eng, a, b, src, dst, sizes, below, launch))
            except Exception as e:
                row["status"], row["reason"] = "failed", f"{type(e).__name__}: {e}"
                ctx.log(f"interference {name}: failed ({row['reason']})")
            else:
                ctx.log(
                    f"interference {name}{f' {c} CTAs' if c else ''}"
                    f"{f', launches of {fmt_bytes(lb)}' if lb else ''}: GEMM "
                    f"{row['gemm_alone_ms']:.3f} ms alone, {row['gemm_with_copy_ms']:.3f} ms "
                    f"beside the copies ({row['slowdown_pct']:+.1f} %); copies "
                    f"{row['copy_gbps_wall']:.1f} GB/s"
                )
            rows.append(row)
    finally:
        eng.shutdown()
    return {
        "rows": rows,
        "gemm": f"{p.gemm_n}^3 bf16 torch.mm on the compute stream, medians of {p.gemm_reps}",
        "copies": f"{fmt_bytes(size)} x {fmt_count(n)} scattered blocks, host -> device",
        "auto_route": route_note,
    }


def _one(
    ctx: Context,
    eng: Engine,
    a: Any,
    b: Any,
    src: Any,
    dst: Any,
    sizes: Any,
    below: int,
    launch: Any,
) -> dict[str, Any]:
    p = ctx.profile
    nbytes = int(sizes.sum())
    # One transfer on its own (after a first one that may compile the kernel): how many to
    # queue so that they outlast the GEMMs.
    for _ in range(2):
        j = ctx.job()
        t0 = time.perf_counter()
        eng.submit(j, src, dst, sizes, "h2d", kernel_below=below, launcher=launch)
        eng.wait([j])
        check_result(eng.get_finished(), j)
        one = time.perf_counter() - t0
    # Alone and beside the copies alternate, three rounds: the GEMM's own speed drifts with the
    # GPU's clocks by several percent over seconds, more than the effect measured.
    alone_ms: list[float] = []
    busy_ms: list[float] = []
    outlasted = True
    walls = []
    count = 4
    for _ in range(3):
        alone_ms += gemm_ms(a, b, p.gemm_reps)
        alone = median(alone_ms)
        count = max(4, int(p.gemm_reps * alone / 1e3 / one * 1.5) + 2)
        jobs = []
        t_start = time.perf_counter()
        for _ in range(count):
            j = ctx.job()
            eng.submit(j, src, dst, sizes, "h2d", kernel_below=below, launcher=launch)
            jobs.append(j)
        busy_ms += gemm_ms(a, b, p.gemm_reps)
        results = eng.get_finished()
        outlasted = outlasted and len(results) < count  # copies still ran when the GEMMs ended
        eng.wait(jobs)
        walls.append((time.perf_counter() - t_start, count))
        results += eng.get_finished()
        failed = [r for r in results if not r.success]
        if len(results) != count or failed:
            raise RuntimeError(
                f"{len(results)} results for {count} transfers; failed: {failed[:1]}"
            )
    alone, busy = median(alone_ms), median(busy_ms)
    wall = sum(w for w, _ in walls)
    count = sum(c for _, c in walls)
    flops = 2 * p.gemm_n**3
    return {
        "gemm_alone_ms": alone,
        "gemm_with_copy_ms": busy,
        "slowdown_pct": 100 * (busy / alone - 1),
        "gemm_tflops_alone": flops / (alone / 1e3) / 1e12,
        "copy_gbps_wall": count * nbytes / wall / 1e9,
        "copies_queued": count,
        "copies_outlasted_gemms": outlasted,
    }
