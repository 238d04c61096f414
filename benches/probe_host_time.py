"""Where transfer_async's host time goes: the handler's Python, the core's submit, and what a
thread that slept before it pays.

    python benches/probe_host_time.py [--pages 4,64,256]

80 separately allocated layer tensors, 64 GPU blocks, the staged plan, 32 random blocks per
transfer, each direction: the Python part of ``transfer_async`` (block ids per group) and the
core's ``submit_groups`` timed apart, the thread polling ``get_finished`` until each transfer is
done (warm); then the core's submit of CPU -> GPU after the thread slept 0.1, 5 and 30 ms.
Medians.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch

import blockswap
from blockswap.handler import CpuGpuHandlers
from blockswap_bench.cli import need_cuda, parser


def poll(h: CpuGpuHandlers) -> None:
    results: list = []
    while not results:
        results = h.get_finished()
    assert all(r.success for r in results)


def main() -> int:
    ap = parser(__doc__, json=False)
    ap.add_argument("--pages", default="4,64,256", help="page sizes in KiB")
    args = ap.parse_args()
    if not need_cuda("probe_host_time"):
        return 1
    rng = np.random.default_rng(0)
    print(f"# {torch.cuda.get_device_name()}")
    for kib in (int(x) for x in args.pages.split(",")):
        layers = [
            torch.empty((64, 1, kib * 1024), dtype=torch.uint8, device="cuda") for _ in range(80)
        ]
        h = CpuGpuHandlers(layers, 32, layout="mla", path="staged")
        try:
            for hd in (h.h2d, h.d2h):
                py_s, core_s = [], []
                for i in range(40):
                    g, c = rng.permutation(64)[:32], rng.permutation(32)
                    spec = (g, c) if hd.gpu_to_cpu else (c, g)
                    t0 = time.perf_counter()
                    groups = hd._groups(*spec, None)
                    ws = hd._wait_stream() if hd._wait_stream else None
                    t1 = time.perf_counter()
                    hd._submit_groups(i + 1, groups, hd.direction, ws, hd.route)
                    t2 = time.perf_counter()
                    poll(h)
                    py_s.append(t1 - t0)
                    core_s.append(t2 - t1)
                print(f"{kib:>4} KiB {hd.direction}: python {statistics.median(py_s[5:]) * 1e6:.1f}"
                      f" us, core submit {statistics.median(core_s[5:]) * 1e6:.1f} us")  # fmt: skip
            for gap in (1e-4, 5e-3, 3e-2):
                core_s = []
                for i in range(20):
                    g, c = rng.permutation(64)[:32], rng.permutation(32)
                    groups = h.h2d._groups(c, g, None)
                    time.sleep(gap)
                    t1 = time.perf_counter()
                    staged = blockswap.Route.staged(h.h2d.route.kernel)
                    h.h2d._submit_groups(1000 + i, groups, "h2d", None, staged)
                    core_s.append(time.perf_counter() - t1)
                    poll(h)
                print(f"          h2d core submit after sleeping {gap * 1e3:.1f} ms: "
                      f"{statistics.median(core_s[3:]) * 1e6:.1f} us")  # fmt: skip
        finally:
            h.shutdown()
        del layers
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
