"""Blocks, not pages: the handler's block plan against the per-page route, beside the link.

    python benches/bench_blocks.py [--pages 4,16,64,256,1024] [--layers 80] [--blocks 32]
                                   [--reps 20] [--handlers auto,staged] [--option KEY=VALUE]
                                   [--cpu-blocks random,adjacent,reversed] [--json out.json]

A KV cache of ``--layers`` layer tensors, one page of P bytes per block per layer (the page a
serving engine moves per layer), 64 GPU blocks; a transfer moves ``--blocks`` random GPU blocks
to (or from) random CPU blocks, no two consecutive ones adjacent (``--cpu-blocks adjacent``: CPU
blocks one after the other, as a fresh cache hands them out; their rows then cross PCIe joined;
``reversed``: the same from the last one down, as vLLM's CPU manager hands a request the chunks
one eviction freed, joined too; ``random,adjacent``: both, one row each). GPU layer tensors either views
of one allocation ("one alloc") or allocated one by one ("separate"). Handlers per case:

* ``auto``: the default CpuGpuHandlers (block-major CPU cache; the route ``path="auto"`` picks);
* ``blocks`` (one allocation only): ``path="blocks"``, the block plan whatever the page size, its
  2-D copies batched into one ``cuMemcpy3DBatchAsync`` per transfer;
* ``blocks-loop``: the same plan with ``copy_path="loop"``: one ``cuMemcpy2DAsync`` per block;
* ``staged``: ``path="staged"``: each block's host row as one copy through the core's device
  staging ring, its pages moved inside the GPU by the copy kernel the core launches;
* ``pages``: ``cpu_layout="mirror"`` (a CPU cache laid out like the GPU one): the per-page route
  (copy kernel below 256 KiB pages, DMA above).

Per direction: the isolated transfer (GPU time of the copies, CUDA events: ``timing=True``), 8
transfers queued back to back (bytes / wall time from the first submit to the last completion)
as % of the link's ceiling measured in the same run (one 256 MiB pinned copy per direction,
best of 5: ``blockswap_bench.kvblocks.ceiling``), beside one contiguous copy of the transfer's
bytes (``1 copy``: what a transfer of that size can reach at all, isolated; median of 9) and the
transfer's block rows alone (``rows``: the 32 host rows of 80 pages each, scattered, to or from
one contiguous device buffer, as one ``Engine.submit`` of 32 descriptors, GPU time by events,
median of 9: what the copy engines make of a block row per copy, the staged plan's copies
without its kernels). Host time of ``transfer_async``, median:
``host us`` for isolated transfers after the calling thread slept in ``wait`` for the last one
(for as long as that transfer took: its caches and core go cold), ``poll us`` for isolated
transfers after it polled ``get_finished`` until the last one was done (a serving loop's way),
``busy us`` for the 7 later calls of each queued batch (submitting back to back). ``issue us``:
the time the engine's lane thread spent issuing each queued transfer (its copies, kernels and
events; ``stats()["driver_ns"]``), which bounds how fast transfers can follow each other.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from blockswap import Engine
from blockswap.handler import CpuGpuHandlers
from blockswap_bench.cli import need_cuda
from blockswap_bench.kvblocks import (
    ENGINE_OPTIONS,
    Copier,
    ceiling,
    cpu_block_ids,
    link_header,
    parser,
    write_figures,
)


def rows_only(row: int, n: int, reps: int = 9, **options: Any) -> dict[str, float]:
    """GB/s of ``n`` scattered host rows of ``row`` bytes to (or from) one contiguous device
    buffer, one engine transfer of ``n`` descriptors per direction, GPU-timed, median."""
    host = torch.empty(2 * n * row, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n * row, dtype=torch.uint8, device="cuda")
    rng = np.random.default_rng(1)
    out = {}
    with Engine("cuda", timing=True, **options) as eng:
        hb, db = eng.register(host), eng.register(dev)
        for d in ("h2d", "d2h"):
            speeds = []
            for job in range(reps + 1):
                hs = hb + rng.permutation(2 * n)[:n].astype(np.int64) * row
                ds = db + np.arange(n, dtype=np.int64) * row
                src, dst = (hs, ds) if d == "h2d" else (ds, hs)
                eng.submit(job, src, dst, np.full(n, row, dtype=np.int64), d)
                eng.wait([job])
                (r,) = eng.get_finished()
                assert r.success, r.error
                speeds.append(n * row / r.seconds / 1e9)
            out[d] = statistics.median(speeds[1:])
    return out


def gpu_layers(layers: int, nb: int, page: int, one_alloc: bool) -> list[torch.Tensor]:
    if one_alloc:
        buf = torch.empty((layers, nb, 1, page), dtype=torch.uint8, device="cuda")
        return [buf[i] for i in range(layers)]
    return [torch.empty((nb, 1, page), dtype=torch.uint8, device="cuda") for _ in range(layers)]


def measure(
    h: CpuGpuHandlers,
    blocks: int,
    reps: int,
    rng: np.random.Generator,
    order: str = "random",
) -> dict:
    nb = h.gpu_tables[0].num_blocks
    nbytes = blocks * int(h.gpu_tables[0].nbytes.sum())
    job = 0
    out = {}
    for d, handler in (("d2h", h.d2h), ("h2d", h.h2d)):
        gpu_s: list[float] = []
        host_s: list[float] = []

        def spec(d: str = d) -> tuple[np.ndarray, np.ndarray]:
            g = rng.permutation(nb)[:blocks]
            c = cpu_block_ids(rng, blocks, h.num_cpu_blocks, order)
            return (g, c) if d == "d2h" else (c, g)

        polled_s: list[float] = []
        for i in range(2 * reps + 3):  # isolated
            job += 1
            s = spec()
            t0 = time.perf_counter()
            handler.transfer_async(job, s)
            t1 = time.perf_counter()
            if i % 2 == 0:
                handler.wait([job])  # the thread sleeps until the transfer is done
                results = h.get_finished()
            else:
                results = []  # the thread polls, as a serving loop's step does
                while not results:
                    results = h.get_finished()
            (r,) = results
            assert r.success, r.error
            if i >= 3:
                gpu_s.append(r.seconds)
                (host_s if i % 2 == 0 else polled_s).append(t1 - t0)
        queued, busy_s = [], []
        issued = h.engine.stats()["driver_ns"]
        rounds, depth = 3, 8
        for _ in range(rounds):  # 8 queued
            specs = [spec() for _ in range(depth)]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ids = []
            for k, s in enumerate(specs):
                job += 1
                ids.append(job)
                t1 = time.perf_counter()
                handler.transfer_async(job, s)
                if k:
                    busy_s.append(time.perf_counter() - t1)
            handler.wait(ids)
            queued.append(depth * nbytes / (time.perf_counter() - t0) / 1e9)
            assert all(r.success for r in h.get_finished())
        out[d] = {
            "isolated_gbps": nbytes / statistics.median(gpu_s) / 1e9,
            "queued_gbps": max(queued),
            "host_us": statistics.median(host_s) * 1e6,
            "polled_host_us": statistics.median(polled_s) * 1e6,
            "busy_host_us": statistics.median(busy_s) * 1e6,
            # The engine's time in the driver's copy calls (its lane thread), per queued transfer.
            "issue_us": (h.engine.stats()["driver_ns"] - issued) / (rounds * depth) / 1e3,
        }
    return out


def main() -> int:
    ap = parser(__doc__, pages="4,8,16,32,64,256,1024", reps=20)
    ap.add_argument("--handlers", default=None, help="only these handlers (comma list)")
    args = ap.parse_args()
    options = dict(args.option)
    only = set(args.handlers.split(",")) if args.handlers else None
    if not need_cuda("bench_blocks"):
        return 1
    rng = np.random.default_rng(0)
    ceil = ceiling()
    rows = []
    cpu = "/".join(args.cpu_blocks)
    print(link_header(ceil, f"{args.layers} layers x {args.blocks} random GPU blocks, {cpu} CPU "
                            f"blocks; options {options}"))  # fmt: skip
    print(f"{'page':>6} {'GPU layers':>10} {'CPU blks':>8} {'handler':>11} {'route':<34} "
          f"{'dir':>4} {'isol %':>7} {'8 q %':>6} {'1 copy':>6} {'rows':>6} {'host us':>8} "
          f"{'poll us':>8} {'busy us':>8} {'issue us':>8}")  # fmt: skip
    for kib in args.pages:
        for one_alloc in (True, False):
            gpu = gpu_layers(args.layers, 64, kib * 1024, one_alloc)
            nbytes = args.layers * args.blocks * kib * 1024
            same = Copier(nbytes).gbps(nbytes, wall=False)
            engine_options = {k: v for k, v in options.items() if k in ENGINE_OPTIONS}
            rows_alone = rows_only(args.layers * kib * 1024, args.blocks, **engine_options)
            variants: list[tuple[str, dict]] = [("auto", {})]
            if one_alloc:
                variants += [
                    ("blocks", {"path": "blocks"}),
                    ("blocks-loop", {"path": "blocks", "copy_path": "loop"}),
                ]
            variants.append(("staged", {"path": "staged"}))
            variants.append(("pages", {"cpu_layout": "mirror"}))
            for name, kw in variants:
                if only is not None and name not in only:
                    continue
                try:
                    h = CpuGpuHandlers(gpu, args.blocks, layout="mla", timing=True, **kw, **options)
                except ValueError as e:  # path="staged" where a row outgrows the slots
                    print(f"{kib:>5}K {name}: {e}")
                    continue
                try:
                    for order in args.cpu_blocks:
                        res = measure(h, args.blocks, args.reps, rng, order)
                        for d, m in res.items():
                            route = h.routes[d].reason.split(" (")[0]
                            row = {
                                "page_kib": kib,
                                "gpu_layers": "one alloc" if one_alloc else "separate",
                                "cpu_blocks": order,
                                "handler": name,
                                "route": h.routes[d].reason,
                                "plan": h.routes[d].plan,
                                "direction": d,
                                "ceiling_gbps": ceil[d],
                                "one_copy_gbps": same[d],
                                "rows_only_gbps": rows_alone[d],
                                **m,
                            }
                            rows.append(row)
                            print(f"{kib:>5}K {row['gpu_layers']:>10} {order:>8} {name:>11} "
                                  f"{route[:34]:<34} "
                                  f"{d:>4} {100 * m['isolated_gbps'] / ceil[d]:>6.1f}% "
                                  f"{100 * m['queued_gbps'] / ceil[d]:>5.1f}% "
                                  f"{100 * same[d] / ceil[d]:>5.1f}% "
                                  f"{100 * rows_alone[d] / ceil[d]:>5.1f}% "
                                  f"{m['host_us']:>8.1f} {m['polled_host_us']:>8.1f} "
                                  f"{m['busy_host_us']:>8.1f} {m['issue_us']:>8.1f}",
                                  flush=True)  # fmt: skip
                finally:
                    h.shutdown()
            del gpu
            torch.cuda.empty_cache()
    if args.json:
        write_figures(args.json, "bench_blocks.py", ceil, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
