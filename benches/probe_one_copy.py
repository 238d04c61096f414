"""The floor under the plug-in's isolated figures: one transfer through the worker (vLLM's region,
per-layer tensors, one block per chunk, 32 random blocks per group) beside one contiguous pinned
copy of the same bytes, both GPU time by CUDA events, median of ``--reps``, in the same process as
the link's ceiling (one 256 MiB copy, best of 5). A transfer of tens of MiB is one copy's worth of
DMA start and end: where one copy of the same bytes stays under the ceiling, so does any plan.

    python benches/probe_one_copy.py [--models llama-3.1-70b-tp4,qwen2.5-7b] [--reps 25]

Printed, not saved: per model and direction the worker's isolated GPU time (% of the link, % of
one copy), the one copy's (% of the link), the worker's wall clock and 8 queued (as
``bench_vllm.py`` times them).
"""

from __future__ import annotations

import os
import statistics
import sys
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_vllm import Case, make_worker
from blockswap_bench.cli import need_cuda, parser
from blockswap_bench.common import cuda_time_on
from blockswap_bench.kvblocks import ceiling, link_header
from blockswap_bench.models import MODELS
from blockswap_bench.plugin import time_worker

DEFAULT_MODELS = "llama-3.1-8b,llama-3.1-70b-tp4,qwen2.5-7b,gpt-oss-120b"


def main() -> int:
    ap = parser(__doc__, json=False, reps=25)
    ap.add_argument("--models", default=DEFAULT_MODELS)
    args = ap.parse_args()
    if not need_cuda("probe_one_copy"):
        return 1
    rng = np.random.default_rng(0)
    ceil = ceiling()
    print(link_header(ceil))
    wanted = set(args.models.split(","))
    stream = torch.cuda.Stream()
    for m in (m for m in MODELS if m.key in wanted):
        one_model(m, args.reps, ceil, rng, stream)
        torch.cuda.empty_cache()
    return 0


def one_model(m: Any, reps: int, ceil: dict[str, float], rng: Any, stream: Any) -> None:
    case = Case(m, False, 1)
    nbytes = case.nbytes(32)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    w = make_worker(case, "region")
    try:
        for to_cpu in (True, False):
            d = "d2h" if to_cpu else "h2d"
            f, _ = time_worker(w, lambda: case.spec(rng, 32), to_cpu, nbytes, reps)

            def one(to_cpu: bool = to_cpu) -> None:
                (host.copy_(dev, non_blocking=True) if to_cpu
                 else dev.copy_(host, non_blocking=True))  # fmt: skip

            t = [cuda_time_on(stream, one) for _ in range(reps + 3)][3:]
            ref = nbytes / statistics.median(t) / 1e9
            iso = f["isolated_gbps"]
            print(f"{m.key[:18]:<18} {d} {nbytes >> 20} MiB: isolated {iso:.1f} GB/s "
                  f"({100 * iso / ceil[d]:.1f} % of the link, {100 * iso / ref:.1f} % of one "
                  f"copy); one copy {ref:.1f} GB/s ({100 * ref / ceil[d]:.1f} %); wall "
                  f"{f['wall_gbps']:.1f}, 8 queued {f['queued_gbps']:.1f} GB/s "
                  f"({100 * f['queued_gbps'] / ceil[d]:.1f} %)")  # fmt: skip
    finally:
        w.shutdown()


if __name__ == "__main__":
    sys.exit(main())
