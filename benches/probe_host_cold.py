"""What a submission costs after the caller did something else: the handler's Python part and
the core's ``submit_groups`` of a staged CPU->GPU transfer (80 separately allocated layers, 32
random blocks), right after the previous transfer was polled to its end (``warm``), after a
12 ms busy spin, a 12 ms sleep, 640 MiB of DMA either way (polled), or a 640 MiB host memcpy;
at 4 KiB pages, and at 256 KiB right after the transfer's own 640 MiB.

    python benches/probe_host_cold.py [--rounds 2]

Medians of 15 per situation and round; printed, not saved.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from blockswap.handler import CpuGpuHandlers
from blockswap_bench.cli import need_cuda, parser

MiB = 1 << 20


def probe(
    kib: int,
    situations: dict[str, Callable[[], None]],
    rounds: int,
    rng: np.random.Generator,
) -> None:
    """Prints the medians of each situation at ``kib`` KiB pages."""
    layers = [torch.empty((64, 1, kib * 1024), dtype=torch.uint8, device="cuda") for _ in range(80)]
    h = CpuGpuHandlers(layers, 32, layout="mla", path="staged")
    hd = h.h2d
    job = 0

    def poll() -> None:
        res: list = []
        while not res:
            res = h.get_finished()
        assert all(r.success for r in res)

    def one(before: Callable[[], None]) -> tuple[float, float]:
        nonlocal job
        c, g = rng.permutation(32), rng.permutation(64)[:32]
        job += 1
        hd.transfer_async(job, (c, g))
        poll()
        before()
        t0 = time.perf_counter()
        groups = hd._groups(c, g, None)
        t1 = time.perf_counter()
        job += 1
        hd._submit_groups(job, groups, "h2d", None, hd.route)
        t2 = time.perf_counter()
        poll()
        return t1 - t0, t2 - t1

    try:
        for _ in range(3):
            one(lambda: None)
        for _ in range(rounds):
            for name, before in situations.items():
                runs = [one(before) for _ in range(15)]
                py = statistics.median(r[0] for r in runs) * 1e6
                core = statistics.median(r[1] for r in runs) * 1e6
                print(f"{kib:>3} KiB, after {name:<24}: python {py:6.1f} us, core submit "
                      f"{core:6.1f} us", flush=True)  # fmt: skip
    finally:
        h.shutdown()
    del layers
    torch.cuda.empty_cache()


def main() -> int:
    ap = parser(__doc__, json=False)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if not need_cuda("probe_host_cold"):
        return 1
    rng = np.random.default_rng(0)
    big_h = torch.empty(640 * MiB, dtype=torch.uint8, pin_memory=True)
    big_d = torch.empty(640 * MiB, dtype=torch.uint8, device="cuda")
    na, nb = np.ones(640 * MiB, dtype=np.uint8), np.zeros(640 * MiB, dtype=np.uint8)

    def spin(s: float) -> None:
        end = time.perf_counter() + s
        while time.perf_counter() < end:
            pass

    def dma(h2d: bool) -> None:
        ev = torch.cuda.Event()
        if h2d:
            big_d.copy_(big_h, non_blocking=True)
        else:
            big_h.copy_(big_d, non_blocking=True)
        ev.record()
        while not ev.query():
            pass

    situations: dict[str, Callable[[], None]] = {
        "warm": lambda: None,
        "a 12 ms busy spin": lambda: spin(0.012),
        "a 12 ms sleep": lambda: time.sleep(0.012),
        "640 MiB CPU->GPU DMA": lambda: dma(True),
        "640 MiB GPU->CPU DMA": lambda: dma(False),
        "a 640 MiB host memcpy": lambda: np.copyto(nb, na),
    }
    print(f"# {torch.cuda.get_device_name()}")
    for kib in (4, 256):
        probe(kib, situations if kib == 4 else {"its own transfer": lambda: None}, args.rounds, rng)
    return 0


if __name__ == "__main__":
    sys.exit(main())
