"""A short transfer benchmark: scattered blocks through blockswap beside the link's ceiling.

On a machine with an NVIDIA GPU (and torch) it moves blocks between pinned host memory and device
memory; elsewhere it runs the host backend over host memory. Every row is measured beside the
ceiling of the same run: one large copy of the same total bytes (one pinned ``copy_`` on the GPU,
one ``memcpy`` on the host).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .engine import Engine, info

KiB = 1024
MiB = 1024 * KiB


@dataclass
class Row:
    direction: str
    block_bytes: int
    blocks: int
    path: str
    gb_per_s: float
    ceiling_gb_per_s: float
    submit_us: float

    @property
    def fraction(self) -> float:
        return self.gb_per_s / self.ceiling_gb_per_s if self.ceiling_gb_per_s else 0.0


def _median(f: Callable[[], float], warmup: int, reps: int) -> float:
    for _ in range(warmup):
        f()
    return statistics.median(f() for _ in range(reps))


def _scatter(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Source and destination block ids: n distinct blocks out of 2n on each side."""
    return rng.permutation(2 * n)[:n], rng.permutation(2 * n)[:n]


def _cuda_ready() -> bool:
    if not info()["cuda"]:
        return False
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def bench_host(sizes: Sequence[int], n: int, reps: int, budget: int, seed: int = 0) -> list[Row]:
    rng = np.random.default_rng(seed)
    rows = []
    with Engine("host") as eng:
        job = 0
        for size in sizes:
            blocks = max(1, min(n, budget // (2 * size)))
            a = np.ones(2 * blocks * size, dtype=np.uint8)
            b = np.zeros_like(a)
            eng.register(a, kind="host")
            eng.register(b, kind="device")
            for direction, (src_buf, dst_buf) in (("h2d", (a, b)), ("d2h", (b, a))):
                s_ids, d_ids = _scatter(rng, blocks)
                src = src_buf.ctypes.data + s_ids * size
                dst = dst_buf.ctypes.data + d_ids * size
                sizes_arr = np.full(blocks, size, dtype=np.int64)
                total = blocks * size
                submit_times: list[float] = []

                def one(
                    src=src,
                    dst=dst,
                    sizes_arr=sizes_arr,
                    direction=direction,
                    submit_times=submit_times,
                ) -> float:
                    nonlocal job
                    job += 1
                    t0 = time.perf_counter()
                    eng.submit(job, src, dst, sizes_arr, direction)
                    t1 = time.perf_counter()
                    eng.wait([job])
                    t2 = time.perf_counter()
                    eng.get_finished()
                    submit_times.append(t1 - t0)
                    return t2 - t0

                t = _median(one, 2, reps)

                def ceiling(src_buf=src_buf, dst_buf=dst_buf, total=total) -> float:
                    t0 = time.perf_counter()
                    np.copyto(dst_buf[:total], src_buf[:total])
                    return time.perf_counter() - t0

                c = _median(ceiling, 2, reps)
                rows.append(
                    Row(
                        direction,
                        size,
                        blocks,
                        "blockswap host",
                        total / t / 1e9,
                        total / c / 1e9,
                        statistics.median(submit_times) * 1e6,
                    )
                )
            eng.unregister(a)
            eng.unregister(b)
    return rows


def bench_cuda(
    sizes: Sequence[int], n: int, reps: int, budget: int, loop_baseline: bool, seed: int = 0
) -> list[Row]:
    import torch

    rng = np.random.default_rng(seed)
    rows = []
    stream = torch.cuda.Stream()
    with Engine("cuda", timing=True) as eng:
        job = 0
        for size in sizes:
            blocks = max(1, min(n, budget // (2 * size)))
            host = torch.empty(2 * blocks * size, dtype=torch.uint8, pin_memory=True)
            dev = torch.empty(2 * blocks * size, dtype=torch.uint8, device="cuda")
            host.fill_(1)
            dev.fill_(2)
            eng.register(host)
            eng.register(dev)
            for direction in ("h2d", "d2h"):
                src_t, dst_t = (host, dev) if direction == "h2d" else (dev, host)
                s_ids, d_ids = _scatter(rng, blocks)
                src = src_t.data_ptr() + s_ids * size
                dst = dst_t.data_ptr() + d_ids * size
                sizes_arr = np.full(blocks, size, dtype=np.int64)
                total = blocks * size
                submit_times: list[float] = []

                def dma(
                    src=src,
                    dst=dst,
                    sizes_arr=sizes_arr,
                    direction=direction,
                    submit_times=submit_times,
                ) -> float:
                    nonlocal job
                    job += 1
                    t0 = time.perf_counter()
                    eng.submit(job, src, dst, sizes_arr, direction)
                    submit_times.append(time.perf_counter() - t0)
                    eng.wait([job])
                    (r,) = eng.get_finished()
                    assert r.success, r.error
                    return r.seconds

                t = _median(dma, 3, reps)

                def ceiling(src_t=src_t, dst_t=dst_t, total=total) -> float:
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    with torch.cuda.stream(stream):
                        start.record()
                        dst_t[:total].copy_(src_t[:total], non_blocking=True)
                        end.record()
                    end.synchronize()
                    return start.elapsed_time(end) / 1e3

                c = _median(ceiling, 3, reps)
                rows.append(
                    Row(
                        direction,
                        size,
                        blocks,
                        "blockswap dma",
                        total / t / 1e9,
                        total / c / 1e9,
                        statistics.median(submit_times) * 1e6,
                    )
                )
                if loop_baseline:
                    s_views = [src_t[i * size : (i + 1) * size] for i in s_ids.tolist()]
                    d_views = [dst_t[i * size : (i + 1) * size] for i in d_ids.tolist()]

                    def loop(s_views=s_views, d_views=d_views) -> float:
                        start = torch.cuda.Event(enable_timing=True)
                        end = torch.cuda.Event(enable_timing=True)
                        with torch.cuda.stream(stream):
                            start.record()
                            for s, d in zip(s_views, d_views):
                                d.copy_(s, non_blocking=True)
                            end.record()
                        end.synchronize()
                        return start.elapsed_time(end) / 1e3

                    lt = _median(loop, 1, max(3, reps // 4))
                    rows.append(
                        Row(
                            direction,
                            size,
                            blocks,
                            "copy_ per block",
                            total / lt / 1e9,
                            total / c / 1e9,
                            0.0,
                        )
                    )
            eng.unregister(host)
            eng.unregister(dev)
            del host, dev
    return rows


def format_table(rows: Sequence[Row]) -> str:
    head = f"{'dir':<4} {'block':>8} {'N':>6} {'path':<16} {'GB/s':>7} {'ceiling':>8} {'of ceil':>7} {'submit us':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        blk = (
            f"{r.block_bytes // KiB} KiB" if r.block_bytes < MiB else f"{r.block_bytes // MiB} MiB"
        )
        lines.append(
            f"{r.direction:<4} {blk:>8} {r.blocks:>6} {r.path:<16} {r.gb_per_s:>7.2f} "
            f"{r.ceiling_gb_per_s:>8.2f} {100 * r.fraction:>6.1f}% {r.submit_us:>10.1f}"
        )
    return "\n".join(lines)


def run(
    *,
    backend: str = "auto",
    full: bool = False,
    json_path: str | None = None,
    sizes: Sequence[int] | None = None,
    n: int | None = None,
) -> list[Row]:
    use_cuda = backend == "cuda" or (backend == "auto" and _cuda_ready())
    if sizes is None:
        sizes = (
            [4 * KiB, 8 * KiB, 16 * KiB, 32 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 2 * MiB]
            if full
            else [4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB]
        )
    n = n or 2560
    reps = 30 if full else 10
    budget = (1 << 31) if full else (256 * MiB)
    if use_cuda:
        rows = bench_cuda(sizes, n, reps, budget, loop_baseline=True)
    else:
        rows = bench_host(sizes, n, reps, budget)
    if json_path:
        meta: dict[str, Any] = {"info": info(), "date": time.strftime("%Y-%m-%d")}
        with open(json_path, "w") as f:
            json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return rows
