"""How late a waiting thread sees a finished copy: the wall clock from issuing a copy (or a GPU
spin of a known length) to the waiter's return, per way of waiting, beside polling in a loop.

    python benches/probe_wake.py [--reps 200]

Ways of waiting: ``spin`` (``Event.query`` in a loop), ``yield`` (the same with a yield of the
core between queries), ``block`` (an event made with blocking sync: the driver puts the thread to
sleep until the GPU's interrupt), ``default`` (``Event.synchronize`` on an event without the flag:
what CUDA's scheduling flags say, a spin where the host has cores to spare) and ``poll`` (sleeps
growing from 10 to 500 µs between queries: what blockswap's ``wait`` did before 2026-11-27).
Median and 90th percentile in µs; the difference to ``spin`` is the waiter's own lateness.
Printed, not saved.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from blockswap_bench.cli import need_cuda, parser

MODES = ("spin", "yield", "block", "default", "poll")


def main() -> int:
    args = parser(__doc__, json=False, reps=200).parse_args()
    if not need_cuda("probe_wake"):
        return 1
    import torch

    stream = torch.cuda.Stream()
    host = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")

    def work(kind: str, n: int) -> None:
        if kind == "sleep":
            torch.cuda._sleep(n)
        else:
            dev[:n].copy_(host[:n], non_blocking=True)

    def once(kind: str, n: int, mode: str) -> float:
        torch.cuda.synchronize()
        ev: Any = torch.cuda.Event(blocking=mode == "block")
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            work(kind, n)
            ev.record()
        if mode in ("spin", "yield"):
            while not ev.query():
                if mode == "yield":
                    time.sleep(0)
        elif mode == "poll":
            nap = 10e-6
            while not ev.query():
                time.sleep(nap)
                nap = min(2 * nap, 500e-6)
        else:
            ev.synchronize()
        return time.perf_counter() - t0

    print(f"# {torch.cuda.get_device_name()}; µs from issue to the waiter's return, p50 / p90")
    cases = [("copy", 256 << 10), ("copy", 10 << 20), ("copy", 40 << 20), ("sleep", 200_000),
             ("sleep", 2_000_000)]  # fmt: skip
    for kind, n in cases:
        cells = []
        for mode in MODES:
            ts = sorted(once(kind, n, mode) for _ in range(args.reps))
            p50, p90 = statistics.median(ts) * 1e6, ts[int(0.9 * len(ts))] * 1e6
            cells.append(f"{mode} {p50:.0f} / {p90:.0f}")
        what = f"H2D copy {n >> 10} KiB" if kind == "copy" else f"GPU spin {n} cycles"
        print(f"{what:<24} " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
