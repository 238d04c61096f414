"""Copies per driver call (``max_batch``) against what they cost: the GPU rate and the lane
thread's driver time of one transfer of N scattered pinned CPU->GPU copies, and the host time of
a bf16 GEMM's launch made while the engine's thread issues that transfer.

    python benches/probe_max_batch.py [--max-batch 16384,256,32]

While the engine's thread is inside a driver call, another thread's driver calls wait (the
model's launches among them), and the GPU starts on a batch only once the call that carries it
returns. Medians of 10 transfers (6 for the launch); printed, not saved.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch

from blockswap import Engine
from blockswap_bench.cli import need_cuda, parser


def main() -> int:
    ap = parser(__doc__, json=False)
    ap.add_argument("--max-batch", default="16384,256,32")
    args = ap.parse_args()
    if not need_cuda("probe_max_batch"):
        return 1
    rng = np.random.default_rng(0)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")

    def launch_ms() -> float:
        t0 = time.perf_counter()
        torch.mm(a, b)
        t = time.perf_counter() - t0
        torch.cuda.synchronize()
        return t * 1e3

    for _ in range(5):
        launch_ms()
    print(f"# {torch.cuda.get_device_name()}; GEMM launch alone "
          f"{statistics.median(launch_ms() for _ in range(15)):.3f} ms")  # fmt: skip
    span = 1 << 30
    host = torch.empty(span, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(span, dtype=torch.uint8, device="cuda")
    for size, n in ((4096, 8192), (65536, 4096), (1 << 20, 512)):
        for mb in (int(x) for x in args.max_batch.split(",")):
            with Engine("cuda", timing=True, max_batch=mb) as eng:
                hb, db = eng.register(host), eng.register(dev)
                rates, issue, launches = [], [], []
                for job in range(12):
                    hs = hb + rng.permutation(span // size)[:n].astype(np.int64) * size
                    ds = db + rng.permutation(span // size)[:n].astype(np.int64) * size
                    d0 = eng.stats()["driver_ns"]
                    eng.submit(job, hs, ds, np.full(n, size, dtype=np.int64), "h2d")
                    if job % 2:
                        launches.append(launch_ms())
                    eng.wait([job])
                    (r,) = eng.get_finished()
                    assert r.success, r.error
                    if job >= 2:
                        rates.append(n * size / r.seconds / 1e9)
                        issue.append((eng.stats()["driver_ns"] - d0) / 1e3)
            print(f"{size >> 10:>5} KiB x {n}, max_batch {mb:>5}: {statistics.median(rates):5.1f} "
                  f"GB/s, driver {statistics.median(issue):7.0f} us per transfer, GEMM launch "
                  f"beside it {statistics.median(launches):.3f} ms", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
