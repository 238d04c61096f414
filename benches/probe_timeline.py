"""The GPU's timeline of isolated staged transfers: every copy and kernel with its start and
length, from CUDA's profiling interface (CUPTI, through ``torch.profiler``), which sees the
engine's own driver calls too.

    python benches/probe_timeline.py [--page-kib 4]

80 separately allocated layer tensors, 64 GPU blocks, 32 random blocks per transfer, three
transfers each way, 2 ms apart. Printed, not saved. The profiler slows the host's driver calls,
so gaps that wait on the host read longer than without it; the GPU's own durations do not.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from blockswap.handler import CpuGpuHandlers
from blockswap_bench.cli import need_cuda, parser


def main() -> int:
    ap = parser(__doc__, json=False)
    ap.add_argument("--page-kib", type=int, default=4)
    args = ap.parse_args()
    if not need_cuda("probe_timeline"):
        return 1
    kib = args.page_kib
    rng = np.random.default_rng(0)
    layers = [torch.empty((64, 1, kib * 1024), dtype=torch.uint8, device="cuda") for _ in range(80)]
    h = CpuGpuHandlers(layers, 32, layout="mla", path="staged")
    nbytes = 32 * 80 * kib * 1024
    jobs = iter(range(1, 1 << 30))

    def transfer(d2h: bool) -> None:
        g, c = rng.permutation(64)[:32], rng.permutation(32)
        job = next(jobs)
        (h.d2h if d2h else h.h2d).transfer_async(job, (g, c) if d2h else (c, g))
        h.wait([job])
        assert all(r.success for r in h.get_finished())

    try:
        for d2h in (True, False, True, False):  # warm: rings, kernels
            transfer(d2h)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for d2h in (False, False, False, True, True, True):
                transfer(d2h)
                time.sleep(0.002)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f)["traceEvents"]
    finally:
        h.shutdown()
    gpu = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy") and "ts" in e),
        key=lambda e: e["ts"],
    )
    transfers: list[list[dict]] = []
    for e in gpu:  # a gap of over 1 ms starts the next transfer
        if not transfers or e["ts"] - max(x["ts"] + x["dur"] for x in transfers[-1]) > 1000:
            transfers.append([])
        transfers[-1].append(e)
    print(f"# {torch.cuda.get_device_name()}; {kib} KiB pages, {nbytes} bytes a transfer")
    for i, acts in enumerate(transfers):
        t0 = acts[0]["ts"]
        span = max(e["ts"] + e["dur"] for e in acts) - t0
        print(f"--- transfer {i}: {span:.1f} us from first start to last end "
              f"({nbytes / span / 1e3:.1f} GB/s)")  # fmt: skip
        for e in acts:
            size = e.get("args", {}).get("bytes", "")
            rate = f"{size / e['dur'] / 1e3:5.1f} GB/s" if size and e["dur"] else ""
            print(f"  {e['ts'] - t0:8.1f} +{e['dur']:6.1f} us  stream {e['args'].get('stream', '?'):<4} "
                  f"{e['name'][:36]:<36} {size:>9} {rate}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
