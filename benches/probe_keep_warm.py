"""What keeping a direction's issuing thread warm after a transfer (the engine's ``keep_warm``)
does to the next transfer after a gap, and what it costs the host.

    python benches/probe_keep_warm.py [--pages 4,16] [--gaps-ms 3,20] [--reps 12]
                                      [--keep 0,0.1] [--idle]

80 separately allocated layer tensors, 32 random blocks a transfer, the default handlers, one
per ``--keep`` value (seconds), taking turns transfer by transfer. Before each transfer the
caller spends the gap as a serving loop does: it launches a 40 µs kernel on a stream of its own
every ~50 µs and spins in between, so the GPU and the caller stay busy while the engine's thread
has nothing to issue (``--idle``: the caller sleeps instead, the GPU idles). Then one
``transfer_async``, polled to its result. Printed per page size, direction, gap and ``keep``:
medians of the call (µs), of the wall clock from the call to the result, of the transfer's GPU
time (its timing events) and of the rest (the wall clock less the GPU time: the call, the
hand-off to the engine's thread, its calls before the first GPU work, the result seen), the wall
clock as % of the link and of one contiguous pinned copy of the same bytes after the same gap
(``synchronize``, ``copy_``, ``synchronize``; a turn of its own). The link's ceiling (one 256
MiB pinned copy a direction) is measured first, in the same process. Then, per
``keep``, the CPU time the engine threads took over a second of transfers 20 ms apart (busy
gaps), read from ``/proc/self/task/*/schedstat`` (threads named ``blockswap-*``). Printed, not
saved; CUDA only.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from blockswap_bench.cli import kib_list, need_cuda, parser
from blockswap_bench.kvblocks import LINK_BYTES, Copier, ceiling, link_header

LAYERS, GPU_BLOCKS, CPU_BLOCKS, BLOCKS = 80, 64, 36, 32


def engine_cpu_ns() -> int:
    """Nanoseconds on a CPU of this process's threads named ``blockswap-*`` so far."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if not f.read().startswith("blockswap-"):
                    continue
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:  # a thread that ended meanwhile
            continue
    return total


def main() -> int:
    ap = parser(__doc__, json=False, reps=12, seed=True)
    ap.add_argument("--pages", type=kib_list, default=[4, 16], help="KiB a page (4,16)")
    ap.add_argument("--gaps-ms", default="3,20", help="gaps before a transfer, ms (3,20)")
    ap.add_argument("--keep", default="0,0.1", help="keep_warm values to compare, s (0,0.1)")
    ap.add_argument("--idle", action="store_true", help="the caller sleeps through the gap")
    args = ap.parse_args()
    if not need_cuda("probe_keep_warm"):
        return 1
    import numpy as np
    import torch

    from blockswap.handler import CpuGpuHandlers

    gaps = [float(g) for g in args.gaps_ms.split(",")]
    keeps = [float(k) for k in args.keep.split(",")]
    side = torch.cuda.Stream()

    def gap(ms: float) -> None:
        if args.idle:
            torch.cuda.synchronize()
            time.sleep(ms / 1e3)
            return
        end = time.perf_counter() + ms / 1e3
        with torch.cuda.stream(side):
            while time.perf_counter() < end:
                torch.cuda._sleep(80_000)  # about 40 µs of one SM
                t = time.perf_counter() + 50e-6
                while time.perf_counter() < t:
                    pass

    rng = np.random.default_rng(args.seed)
    copier = Copier(max(LINK_BYTES, BLOCKS * LAYERS * max(args.pages) * 1024))
    ceil = ceiling(copier=copier)
    print(link_header(ceil))
    print(f"# {LAYERS} layers x {BLOCKS} random blocks; gaps "
          f"{'idle (the caller sleeps)' if args.idle else 'busy (kernels and a spinning caller)'}"
          "; median µs")  # fmt: skip
    for kib in args.pages:
        layers = [
            torch.randint(0, 256, (GPU_BLOCKS, 1, kib * 1024), dtype=torch.uint8, device="cuda")
            for _ in range(LAYERS)
        ]
        hs = [
            CpuGpuHandlers(layers, CPU_BLOCKS, layout="mla", timing=True, keep_warm=k)
            for k in keeps
        ]
        job = 0

        def transfer(h: Any, d: str) -> tuple[float, float, float]:
            nonlocal job
            job += 1
            g, c = rng.permutation(GPU_BLOCKS)[:BLOCKS], rng.permutation(CPU_BLOCKS)[:BLOCKS]
            side_h = h.d2h if d == "d2h" else h.h2d
            t0 = time.perf_counter()
            side_h.transfer_async(job, (g, c) if d == "d2h" else (c, g))
            t1 = time.perf_counter()
            h.wait([job])
            t2 = time.perf_counter()
            (r,) = h.get_finished()
            assert r.success, r.error
            return t1 - t0, t2 - t0, r.seconds

        try:
            nbytes = BLOCKS * LAYERS * kib * 1024
            res: dict[tuple[float, str, int], list[tuple[float, float, float]]] = {}
            copies: dict[tuple[float, str], list[float]] = {}
            for rep in range(args.reps + 2):
                for g_ms in gaps:
                    for d in ("h2d", "d2h"):
                        for i, h in enumerate(hs):
                            gap(g_ms)
                            took = transfer(h, d)
                            if rep >= 2:
                                res.setdefault((g_ms, d, i), []).append(took)
                        gap(g_ms)
                        copied = copier.seconds(d, nbytes)
                        if rep >= 2:
                            copies.setdefault((g_ms, d), []).append(copied)
            for g_ms in gaps:
                for d in ("h2d", "d2h"):
                    base = None
                    one = statistics.median(copies[(g_ms, d)]) * 1e6
                    link = nbytes / ceil[d] / 1e3  # µs at the ceiling
                    print(f"{kib:4d} KiB {d} gap {g_ms:5.1f} ms  one copy {one:7.1f} µs "
                          f"({100 * link / one:5.1f} % of the link)", flush=True)  # fmt: skip
                    for i, k in enumerate(keeps):
                        call, wall, gpu = (
                            statistics.median(x) * 1e6 for x in zip(*res[(g_ms, d, i)])
                        )
                        base = wall if base is None else base
                        print(f"{kib:4d} KiB {d} gap {g_ms:5.1f} ms  keep_warm {k:5.3f} s: call "
                              f"{call:6.1f}  wall {wall:7.1f} ({wall - base:+6.1f})  gpu {gpu:7.1f}"
                              f"  rest {wall - gpu:6.1f}  {100 * link / wall:5.1f} % of the link"
                              f"  {100 * one / wall:5.1f} % of one copy", flush=True)  # fmt: skip
            if kib == args.pages[0]:
                for k, h in zip(keeps, hs):
                    time.sleep(max(keeps) + 0.2)  # every thread asleep again
                    n, t0, c0 = 0, time.perf_counter(), engine_cpu_ns()
                    while time.perf_counter() - t0 < 1.0:
                        gap(20.0)
                        transfer(h, ("h2d", "d2h")[n % 2])
                        n += 1
                    ms = (engine_cpu_ns() - c0) / 1e6 / (time.perf_counter() - t0)
                    print(f"# keep_warm {k:5.3f} s: the engine threads took {ms:5.1f} ms of CPU a "
                          f"second, {n} transfers 20 ms apart", flush=True)  # fmt: skip
        finally:
            for h in hs:
                h.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
