"""What an engine's threads pay where they share the caller's one CPU, and the engine option
``cpus`` that moves them.

    python benches/probe_cpus.py [--pages 4,16] [--reps 15] [--caller-cpu 0]

The caller's thread is bound to ``--caller-cpu``. Handlers over 80 separately allocated layers
(32 random blocks a transfer) are made three ways, their transfers taking turns: ``free``, made
before the caller was bound (the engine's threads run where the scheduler puts them);
``inherit``, made on the bound caller as a process pinned to one CPU would make them (their
threads start bound to that CPU, and the engine warns); ``cpus``, made there with ``cpus=`` two
other CPUs. Each transfer is isolated (the one before done, then 0.3 ms), its result polled in a
loop, as a busy caller keeps its CPU. Printed per page size and direction: medians of the wall
clock from the call to the result and of the GPU time, beside one copy of the same bytes timed
the same way (``synchronize``, ``copy_``, ``synchronize``) and the link's ceiling, measured in the
same run. Printed, not saved; CUDA only, two CPUs at least besides the caller's.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from blockswap_bench.cli import kib_list, need_cuda, parser
from blockswap_bench.kvblocks import LINK_BYTES, Copier, ceiling, link_header

LAYERS, GPU_BLOCKS, CPU_BLOCKS, BLOCKS = 80, 64, 36, 32
WAYS = ("free", "inherit", "cpus")


def main() -> int:
    ap = parser(__doc__, json=False, reps=15, seed=True)
    ap.add_argument("--pages", type=kib_list, default=[4, 16], help="KiB a page (4,16)")
    ap.add_argument("--caller-cpu", type=int, default=0, help="the caller's CPU (0)")
    args = ap.parse_args()
    if not need_cuda("probe_cpus"):
        return 1
    others = sorted(os.sched_getaffinity(0) - {args.caller_cpu})
    if args.caller_cpu not in os.sched_getaffinity(0) or len(others) < 2:
        print(f"probe_cpus: needs CPU {args.caller_cpu} and two others", file=sys.stderr)
        return 1
    import numpy as np
    import torch

    from blockswap.handler import CpuGpuHandlers

    rng = np.random.default_rng(args.seed)
    copier = Copier(max(LINK_BYTES, BLOCKS * LAYERS * max(args.pages) * 1024))
    ceil = ceiling(copier=copier)
    print(link_header(ceil, f"the caller on CPU {args.caller_cpu}; cpus={others[-2:]}"))
    allowed = os.sched_getaffinity(0)
    for kib in args.pages:
        layers = [
            torch.randint(0, 256, (GPU_BLOCKS, 1, kib * 1024), dtype=torch.uint8, device="cuda")
            for _ in range(LAYERS)
        ]

        def make(layers: list[Any] = layers, **options: Any) -> CpuGpuHandlers:
            return CpuGpuHandlers(layers, CPU_BLOCKS, layout="mla", timing=True, **options)

        hs = {"free": make()}
        os.sched_setaffinity(0, {args.caller_cpu})
        try:
            with warnings.catch_warnings(record=True) as warned:
                warnings.simplefilter("always")
                hs["inherit"] = make()
                hs["cpus"] = make(cpus=others[-2:])
            print(f"# {kib} KiB: warnings {[str(w.message)[:60] for w in warned]}")
            nbytes = BLOCKS * LAYERS * kib * 1024
            res: dict[tuple[str, str], list[tuple[float, float]]] = {}
            copies: dict[str, list[float]] = {}
            job = 0
            for rep in range(args.reps + 2):
                for d in ("h2d", "d2h"):
                    for way in WAYS if rep % 2 else WAYS[::-1]:
                        h = hs[way]
                        g = rng.permutation(GPU_BLOCKS)[:BLOCKS]
                        c = rng.permutation(CPU_BLOCKS)[:BLOCKS]
                        job += 1
                        torch.cuda.synchronize()
                        time.sleep(3e-4)
                        t0 = time.perf_counter()
                        side = h.d2h if d == "d2h" else h.h2d
                        side.transfer_async(job, (g, c) if d == "d2h" else (c, g))
                        while not (done := h.get_finished()):
                            pass
                        wall = time.perf_counter() - t0
                        assert done[0].success, done[0].error
                        if rep >= 2:
                            res.setdefault((d, way), []).append((wall, done[0].seconds))
                    copied = copier.seconds(d, nbytes)
                    if rep >= 2:
                        copies.setdefault(d, []).append(copied)
            for d in ("h2d", "d2h"):
                one = statistics.median(copies[d]) * 1e6
                print(f"{kib:4d} KiB {d}: one copy {one:7.1f} µs "
                      f"({100 * nbytes / ceil[d] / 1e3 / one:5.1f} % of the link)")  # fmt: skip
                for way in WAYS:
                    wall, gpu = (statistics.median(x) * 1e6 for x in zip(*res[(d, way)]))
                    print(f"{kib:4d} KiB {d} {way:8s}: wall {wall:8.1f} µs ({100 * one / wall:5.1f} %"
                          f" of one copy)  gpu {gpu:7.1f} µs", flush=True)  # fmt: skip
        finally:
            os.sched_setaffinity(0, allowed)
            for h in hs.values():
                h.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
