"""What an onload costs the model: an 8192^3 bf16 GEMM on the compute stream, alone and while
scattered-block host->device transfers run beside it, per copy path.

    python benches/bench_interference.py [--json out.json]

The copies are queued first (enough to outlast the GEMMs), then the GEMMs are timed with CUDA
events on the compute stream; medians. The DMA path uses copy engines only; the kernel path
takes `max_ctas` SMs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

import blockswap
from blockswap.kernels import engine_launcher

KiB = 1024


def gemm_times(a, b, reps):
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.mm(a, b)
        e.record()
        out.append((s, e))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in out]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--block", type=int, default=16 * KiB)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    torch.manual_seed(0)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    gemm_times(a, b, 5)
    alone = statistics.median(gemm_times(a, b, args.reps))
    n = 8192
    size = args.block
    host = torch.ones(2 * n * size, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(2 * n * size, dtype=torch.uint8, device="cuda")
    rng = np.random.default_rng(0)
    rows = []
    eng = blockswap.Engine("cuda")
    eng.register(host)
    eng.register(dev)
    src = host.data_ptr() + rng.permutation(2 * n)[:n].astype(np.int64) * size
    dst = dev.data_ptr() + rng.permutation(2 * n)[:n].astype(np.int64) * size
    sizes = np.full(n, size, dtype=np.int64)
    job = 0
    paths = [("dma", 0, None)] + [
        (f"kernel {c} CTAs", 1 << 62, engine_launcher(max_ctas=c)) for c in (4, 8, 16)
    ]
    for name, below, launch in paths:
        # Queue enough copies to run for longer than the GEMMs (~ reps x GEMM time).
        t0 = time.perf_counter()
        job += 1
        eng.submit(job, src, dst, sizes, "h2d", kernel_below=below, launcher=launch)
        eng.wait([job])
        eng.get_finished()
        one = time.perf_counter() - t0
        count = max(4, int(args.reps * alone / 1e3 / one * 1.5) + 2)
        jobs = []
        t_start = time.perf_counter()
        for _ in range(count):
            job += 1
            eng.submit(job, src, dst, sizes, "h2d", kernel_below=below, launcher=launch)
            jobs.append(job)
        busy = statistics.median(gemm_times(a, b, args.reps))
        eng.wait(jobs)
        gbps = count * n * size / (time.perf_counter() - t_start) / 1e9
        results = eng.get_finished()
        assert len(results) == count and all(r.success for r in results)
        rows.append(
            {
                "path": name,
                "gemm_alone_ms": alone,
                "gemm_with_copy_ms": busy,
                "slowdown_pct": 100 * (busy / alone - 1),
                "copy_gbps_wall": gbps,
            }
        )
        print(
            f"{name:<16} GEMM {alone:6.3f} ms alone, {busy:6.3f} ms beside the copy "
            f"({100 * (busy / alone - 1):+5.1f} %); copies {gbps:5.1f} GB/s (all queued copies, wall clock)",
            flush=True,
        )
    eng.shutdown()
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "block_bytes": size,
        "blocks": n,
    }
    print(json.dumps(meta))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
