"""The staged plan beside the model and beside itself: a bf16 8192^3 GEMM's time alone and
while staged onloads run, and offload with onload at once against two large copies at once.

    python benches/bench_staged_side.py [--page-kib 16,2048] [--option KEY=VALUE ...]
                                        [--json out.json]

80 separately allocated layer tensors (where the handler takes the staged plan), 64 GPU blocks,
32 random blocks per transfer; one transfer each way first, to warm both directions. GEMM:
median of 20, each timed on the compute stream right after queueing enough onloads to outlast
it, against the median of 20 alone and against the median of 20 beside plain copies (a 256 MiB
pinned copy CPU->GPU queued on a stream of its own until it outlasts the GEMM: what PCIe
traffic costs the GEMM on this machine with no SM and no blockswap involved). Bidirectional: 16 offloads and 16 onloads queued at once,
bytes of both over wall time, best of 3, against one 256 MiB pinned copy each way on two
streams at once (best of 5), measured in the same run. ``--option``: a handler or engine
option (``copy_path=loop``), ints as ints.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

from bench_blocks import option
from blockswap.handler import CpuGpuHandlers
from blockswap_bench.interference import gemm_ms


def gemm_median_ms(a: torch.Tensor, b: torch.Tensor, n: int = 10) -> float:
    """Median of ``n`` GEMMs, each timed on its own (the device idle between them)."""
    return statistics.median(gemm_ms(a, b, 1)[0] for _ in range(n))


def bidir_ceiling() -> float:
    n = 256 << 20
    host = [torch.empty(n, dtype=torch.uint8).pin_memory() for _ in range(2)]
    dev = [torch.empty(n, dtype=torch.uint8, device="cuda") for _ in range(2)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    best = 0.0
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(streams[0]):
            dev[0].copy_(host[0], non_blocking=True)
        with torch.cuda.stream(streams[1]):
            host[1].copy_(dev[1], non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, 2 * n / (time.perf_counter() - t0) / 1e9)
    return best


def gemm_beside_copies_ms(a: torch.Tensor, b: torch.Tensor, n: int = 20) -> float:
    """Median of ``n`` GEMMs, each beside 256 MiB pinned CPU->GPU copies on a stream of their
    own, queued to outlast it: the control for the GEMM beside onloads."""
    size = 256 << 20
    host = torch.empty(size, dtype=torch.uint8).pin_memory()
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    per = -(-int(2e-3 * 55e9) // size) + 1
    out = []
    for _ in range(n):
        with torch.cuda.stream(side):
            for _ in range(per):
                dev.copy_(host, non_blocking=True)
        out.append(gemm_ms(a, b, 1)[0])
        side.synchronize()
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--page-kib", default="16,2048")
    ap.add_argument("--option", action="append", default=[], type=option)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    options = dict(args.option)
    rng = np.random.default_rng(0)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    gemm_median_ms(a, b)
    ceil = bidir_ceiling()
    control = gemm_beside_copies_ms(a, b)
    rows = []
    print(f"# {torch.cuda.get_device_name()}; bidirectional ceiling {ceil:.1f} GB/s; options "
          f"{options}")  # fmt: skip
    for kib in (int(x) for x in args.page_kib.split(",")):
        layers = [
            torch.zeros((64, 1, kib * 1024), dtype=torch.uint8, device="cuda") for _ in range(80)
        ]
        h = CpuGpuHandlers(layers, 32, layout="mla", **options)
        job = 0

        def spec(d2h: bool) -> tuple[np.ndarray, np.ndarray]:
            g, c = rng.permutation(64)[:32], rng.permutation(32)
            return (g, c) if d2h else (c, g)

        try:
            nbytes = 32 * 80 * kib * 1024
            for d2h in (True, False):  # warm both directions: rings, first launches
                job += 1
                (h.d2h if d2h else h.h2d).transfer_async(job, spec(d2h))
                h.wait([job])
            assert all(r.success for r in h.get_finished())
            alone = gemm_median_ms(a, b, 20)
            # Enough onloads queued before each GEMM to outlast it at the link's rate.
            per = -(-int(2e-3 * 55e9) // nbytes) + 1
            beside_t = []
            for _ in range(20):
                ids = []
                for _ in range(per):
                    job += 1
                    ids.append(job)
                    h.h2d.transfer_async(job, spec(False))
                beside_t.append(gemm_ms(a, b, 1)[0])
                h.wait(ids)
            beside = statistics.median(beside_t)
            assert all(r.success for r in h.get_finished())
            bidir = 0.0
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                ids = []
                for _ in range(16):
                    for d2h in (True, False):
                        job += 1
                        ids.append(job)
                        (h.d2h if d2h else h.h2d).transfer_async(job, spec(d2h))
                h.wait(ids)
                bidir = max(bidir, 32 * nbytes / (time.perf_counter() - t0) / 1e9)
                assert all(r.success for r in h.get_finished())
            row = {"page_kib": kib, "route": h.routes["h2d"].reason, "options": options,
                   "gemm_alone_ms": alone, "gemm_beside_ms": beside,
                   "gemm_beside_copies_ms": control, "bidir_gbps": bidir,
                   "bidir_ceiling_gbps": ceil}  # fmt: skip
            rows.append(row)
            print(f"{kib:>5} KiB {h.routes['h2d'].plan}: GEMM {alone:.3f} ms alone, "
                  f"{beside:.3f} ms beside onloads ({100 * (beside / alone - 1):+.1f} %), "
                  f"{control:.3f} ms beside plain copies ({100 * (control / alone - 1):+.1f} %); "
                  f"offload + onload {bidir:.1f} GB/s = {100 * bidir / ceil:.0f} % of both ways")  # fmt: skip
        finally:
            h.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                       "command": " ".join(["python benches/bench_staged_side.py",
                                        *(os.path.basename(a) for a in sys.argv[1:])]),
                   "rows": rows}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
