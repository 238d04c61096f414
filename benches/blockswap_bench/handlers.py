"""Section 2, handler level: :class:`~blockswap.handler.CpuGpuHandlers` built with the KV-cache
shapes of real models (:mod:`blockswap_bench.models`), measured as a connector uses it.

Per model and direction: ``transfer_async`` of ``handler_blocks`` scattered blocks (every layer,
K and V pages), timed with ``perf_counter``, then ``get_finished`` polled until the result comes
(end to end, wall clock); ``handler_warmup`` warm-up + ``handler_reps`` measured transfers, new
random block ids each time, the GPU idle before each. ``path="auto"`` is the handler's own
choice; the full profile also forces ``"dma"`` and ``"kernel"``. ``get_finished`` with nothing
finished is timed too.

Two baselines, in the same process and over the same tensors (``non_blocking=True`` on a side
stream, then a synchronise): one ``Tensor.copy_`` per page (per layer, K and V separately, per
block: every copy contiguous, the fastest such a loop gets), and one ``copy_`` per block (per
layer, ``t[:, b]``: a block's K and V pages in one strided copy where the layout splits them,
which torch stages through a contiguous buffer). On the host backend the handler runs on CPU
tensors and the baselines are numpy copies.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from blockswap._types import BackendName

from .common import fmt_bytes, handler_route, median, p90, repeat, route_choice
from .context import Context
from .models import KVModel, select


def run(ctx: Context) -> dict[str, Any]:
    try:
        import torch  # noqa: F401
    except ImportError as e:
        return {"skipped": f"needs torch ({e})", "rows": []}
    p = ctx.profile
    rows: list[dict[str, Any]] = []
    ceiling = {d: ctx.ceiling(d) for d in ("h2d", "d2h")}
    for model in select(",".join(p.models)):
        try:
            rows.extend(_model(ctx, model, ceiling))
        except Exception as e:  # building its cache, say: the other models still run
            reason = f"{type(e).__name__}: {e}"
            ctx.log(f"handler {model.name}: failed ({reason})")
            rows.extend(
                {
                    "model": model.key,
                    "name": model.name,
                    "direction": d,
                    "path": "auto",
                    "status": "failed",
                    "reason": reason,
                }
                for d in ("d2h", "h2d")
            )
    return {
        "rows": rows,
        "baseline": (
            "one Tensor.copy_ per page (per layer, K and V separately, per block)"
            if ctx.cuda
            else "one numpy copy per page (per layer, K and V separately, per block)"
        ),
        "baseline_block": (
            "one Tensor.copy_ per block (per layer; K and V of a block in one strided copy)"
            if ctx.cuda
            else "one numpy copy per block (per layer; K and V of a block in one strided copy)"
        ),
        "timing": "wall clock (perf_counter): transfer_async to the result from get_finished",
    }


def _flat(cache: Any) -> list[Any]:
    """Per-layer tensors of a cache given as a list or as groups of lists."""
    if cache and isinstance(cache[0], list):
        return [t for g in cache for t in g]
    return list(cache)


def _pages(
    t: Any, layout: str, ids: list[int], as_numpy: bool, per_block: bool = False
) -> list[Any]:
    """The page views of blocks ``ids`` of one layer tensor: K then V pages for ``kv_split``
    (``per_block``: one view per block, ``t[:, b]``, K and V together). ``as_numpy``: as numpy
    byte arrays over the same memory (CPU tensors)."""
    import torch

    if layout == "kv_split":
        pages = [t[:, b] for b in ids] if per_block else [t[k, b] for k in (0, 1) for b in ids]
    else:
        pages = [t[b] for b in ids]
    if as_numpy:
        return [p.view(torch.uint8).numpy() for p in pages]
    return pages


def _model(ctx: Context, model: KVModel, ceiling: dict[str, float]) -> list[dict[str, Any]]:
    import torch

    from blockswap.handler import CpuGpuHandlers
    from blockswap.layout import make_cpu_cache_like

    p = ctx.profile
    layers = min(model.layers, p.handler_max_layers or model.layers)
    if model.groups > 1:
        layers = max(layers, model.groups)
    per_block = model.block_bytes(layers)
    per = p.handler_blocks
    num_blocks = max(2 * per, min(p.handler_max_blocks, p.handler_cache_bytes // per_block))
    device = "cuda" if ctx.cuda else "cpu"
    gpu = model.make_cache(num_blocks, device, layers)
    groups = gpu if model.groups > 1 else [gpu]
    for t in _flat(gpu):
        t.zero_()
    cpu_groups = [
        make_cpu_cache_like(g, num_blocks, layout=model.layout, pin_memory=ctx.cuda) for g in groups
    ]
    for t in _flat(cpu_groups):
        t.zero_()  # touched once here, not by the first transfers
    cpu = cpu_groups if model.groups > 1 else cpu_groups[0]
    nbytes = per * per_block
    ctx.log(
        f"handler {model.name}: {layers} layers, {len(groups)} group(s), "
        f"{fmt_bytes(model.page_bytes)} pages, {per} blocks = {fmt_bytes(nbytes)} per transfer, "
        f"cache of {num_blocks} blocks ({fmt_bytes(num_blocks * per_block)} per side)"
    )
    base = {
        "model": model.key,
        "name": model.name,
        "config": model.config,
        "layers": layers,
        "groups": len(groups),
        "layout": model.layout,
        "page_bytes": model.page_bytes,
        "pages_per_transfer": per * layers * model.pages_per_layer,
        "blocks_per_transfer": per,
        "bytes_per_transfer": nbytes,
        "cache_blocks": num_blocks,
    }
    baseline = _baseline(ctx, model, gpu, cpu, num_blocks, nbytes)
    rows: list[dict[str, Any]] = []
    backend: BackendName = "cuda" if ctx.cuda else "host"
    for path in p.handler_paths:
        if not ctx.cuda and path != "auto":
            for direction in ("d2h", "h2d"):
                rows.append(
                    {
                        **base,
                        "direction": direction,
                        "path": path,
                        "status": "skipped",
                        "reason": "the host backend has one path (memcpy); auto measures it",
                    }
                )
            continue
        try:
            h = CpuGpuHandlers(
                gpu, num_blocks, layout=model.layout, cpu_caches=cpu, backend=backend, path=path
            )
        except Exception as e:
            for direction in ("d2h", "h2d"):
                rows.append(
                    {
                        **base,
                        "direction": direction,
                        "path": path,
                        "status": "failed",
                        "reason": f"{type(e).__name__}: {e}",
                    }
                )
            continue
        try:
            reps = p.handler_reps if path == "auto" else p.handler_forced_reps
            poll_us = _poll_empty(h) if path == "auto" else None
            for direction in ("d2h", "h2d"):
                route = handler_route(h, direction)
                row = {
                    **base,
                    "direction": direction,
                    "path": path,
                    "chosen": route_choice(route, model.page_bytes),
                    "route": None if route is None else str(route.reason),
                    "status": "ok",
                    "reason": None,
                    "ceiling_gbps": ceiling[direction],
                    "get_finished_empty_us": poll_us,
                    **{f"baseline_{k}": v for k, v in baseline[direction].items()},
                }
                try:
                    row.update(_transfers(ctx, h, model, direction, num_blocks, nbytes, reps))
                except Exception as e:
                    row["status"], row["reason"] = "failed", f"{type(e).__name__}: {e}"
                else:
                    row["fraction_of_ceiling"] = row["gbps"] / ceiling[direction]
                    bl = row.get("baseline_gbps")
                    row["speedup_vs_baseline"] = row["gbps"] / bl if bl else None
                    blk = row.get("baseline_block_gbps")
                    row["speedup_vs_block_loop"] = row["gbps"] / blk if blk else None
                    ctx.log(
                        f"handler {model.name} {direction} {path}"
                        f"{' -> ' + row['chosen'] if path == 'auto' else ''}: transfer_async "
                        f"{row['transfer_async_us_median']:.1f} us, {row['gbps']:.2f} GB/s "
                        f"({100 * row['fraction_of_ceiling']:.0f} % of ceiling), baseline "
                        f"{bl or float('nan'):.2f} GB/s, "
                        f"{row['speedup_vs_baseline'] or float('nan'):.1f}x"
                    )
                rows.append(row)
        finally:
            h.shutdown()
    del gpu, cpu, groups, cpu_groups
    if ctx.cuda:
        torch.cuda.empty_cache()
        # Pinned blocks go back to torch's caching host allocator; give them to the OS, where
        # this torch can, so that six models' caches are not all held at once.
        host_empty = getattr(torch._C, "_host_emptyCache", None)
        if host_empty is not None:
            host_empty()
    return rows


def _ids(ctx: Context, model: KVModel, num_blocks: int, per: int) -> tuple[Any, Any]:
    """``(GPU ids, CPU ids)`` of one transfer: distinct random blocks on each side, one array
    per group for a hybrid model."""
    rng = ctx.rng
    if model.groups == 1:
        return (
            rng.choice(num_blocks, per, replace=False).astype(np.int64),
            rng.choice(num_blocks, per, replace=False).astype(np.int64),
        )
    g = [rng.choice(num_blocks, per, replace=False).astype(np.int64) for _ in range(model.groups)]
    c = [rng.choice(num_blocks, per, replace=False).astype(np.int64) for _ in range(model.groups)]
    return g, c


def _transfers(
    ctx: Context,
    h: Any,
    model: KVModel,
    direction: str,
    num_blocks: int,
    nbytes: int,
    reps: int,
) -> dict[str, Any]:
    p = ctx.profile
    one = h.gpu_to_cpu_handler if direction == "d2h" else h.cpu_to_gpu_handler
    submit_s: list[float] = []
    total_s: list[float] = []
    engine_s: list[float] = []
    sync = _cuda_sync if ctx.cuda else _no_sync
    for i in range(p.handler_warmup + reps):
        gpu_ids, cpu_ids = _ids(ctx, model, num_blocks, p.handler_blocks)
        spec = (gpu_ids, cpu_ids) if direction == "d2h" else (cpu_ids, gpu_ids)
        j = ctx.job()
        sync()
        t0 = time.perf_counter()
        one.transfer_async(j, spec)
        t1 = time.perf_counter()
        done: list[Any] = []
        while not done:
            done = h.get_finished()
        t2 = time.perf_counter()
        (r,) = done
        if r.job_id != j or not r.success:
            raise RuntimeError(f"transfer {j}: {r}")
        if i >= p.handler_warmup:
            submit_s.append(t1 - t0)
            total_s.append(t2 - t0)
            engine_s.append(float(r.seconds))
    return {
        "reps": reps,
        "warmup": p.handler_warmup,
        "transfer_async_us_median": median(submit_s) * 1e6,
        "transfer_async_us_p90": p90(submit_s) * 1e6,
        "end_to_end_ms_median": median(total_s) * 1e3,
        "gbps": nbytes / median(total_s) / 1e9,
        "engine_seconds_median": median(engine_s),
    }


def _cuda_sync() -> None:
    import torch

    torch.cuda.synchronize()


def _no_sync() -> None:
    return None


def _poll_empty(h: Any, n: int = 2000) -> float:
    """Median µs of ``get_finished()`` with nothing in flight (the Python call included)."""
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        h.get_finished()
        ts.append(time.perf_counter() - t0)
    return median(ts) * 1e6


def _baseline(
    ctx: Context, model: KVModel, gpu: Any, cpu: Any, num_blocks: int, nbytes: int
) -> dict[str, dict[str, Any]]:
    """The two copy_ loops (per page, and per block), both directions: GB/s end to end (wall,
    to the synchronise) and the host time of the loop; the per-block figures under ``block_``."""
    import torch

    p = ctx.profile
    g_layers, c_layers = _flat(gpu), _flat(cpu)
    out: dict[str, dict[str, Any]] = {}
    stream = torch.cuda.Stream() if ctx.cuda else None
    for direction in ("d2h", "h2d"):
        gpu_ids, cpu_ids = (
            ctx.rng.choice(num_blocks, p.handler_blocks, replace=False).tolist() for _ in (0, 1)
        )
        out[direction] = {}
        for prefix, per_block in (("", False), ("block_", True)):
            if per_block and model.layout != "kv_split":
                continue  # a block is one page there: the same loop
            pairs: list[tuple[Any, Any]] = []
            for g, c in zip(g_layers, c_layers):
                gp = _pages(g, model.layout, gpu_ids, not ctx.cuda, per_block)
                cp = _pages(c, model.layout, cpu_ids, not ctx.cuda, per_block)
                pairs.extend(zip(gp, cp) if direction == "d2h" else zip(cp, gp))

            def loop(pairs: list[tuple[Any, Any]] = pairs) -> tuple[float, float]:
                if stream is not None:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    with torch.cuda.stream(stream):
                        for s, d in pairs:
                            d.copy_(s, non_blocking=True)
                    t1 = time.perf_counter()
                    stream.synchronize()
                else:
                    # numpy, one thread: torch's CPU copy_ of a page may wake its thread pool,
                    # which then competes with the engine's worker for the cores.
                    t0 = time.perf_counter()
                    for s, d in pairs:
                        np.copyto(d, s)
                    t1 = time.perf_counter()
                return time.perf_counter() - t0, t1 - t0

            samples = repeat(loop, warmup=1, min_reps=1, max_reps=p.baseline_max_reps, budget_s=0.3)
            t = median([s[0] for s in samples])
            out[direction].update(
                {
                    f"{prefix}gbps": nbytes / t / 1e9,
                    f"{prefix}copies": len(pairs),
                    f"{prefix}loop_us_median": median([s[1] for s in samples]) * 1e6,
                    f"{prefix}reps": len(samples),
                }
            )
        if "block_gbps" not in out[direction]:
            for k in ("gbps", "copies", "loop_us_median", "reps"):
                out[direction][f"block_{k}"] = out[direction][k]
    return out
