"""What the staged plan's pipeline costs the GPU, with no host time in it.

    python benches/probe_pipeline.py [--reps 9]

The staged plan's choreography in torch: per step, a copy across PCIe on one stream into one
of two slots and a copy inside HBM on another, events between them (a slot is reused once the
step two back has left it). Everything is queued behind a spin kernel, so the host's issuing is
over before the GPU starts and only the GPU's own cost per step shows. 10 and 40 MiB in 1-16
steps, with and without the HBM side, each direction, against the link's ceiling (one 256 MiB
pinned copy, best of 5: ``blockswap_bench.kvblocks.ceiling``) and one copy of the same bytes,
measured in the same run; medians of ``--reps``.
"""

from __future__ import annotations

import statistics
import sys

import torch

from blockswap_bench.cli import need_cuda, parser
from blockswap_bench.common import gated_gpu_seconds
from blockswap_bench.kvblocks import ceiling

MIB = 1 << 20


def run(total: int, steps: int, d2h: bool, staged: bool = True, reps: int = 9) -> float:
    """GB/s of ``total`` bytes in ``steps`` copies (``staged``: with the HBM side and events)."""
    host = torch.empty(total, dtype=torch.uint8).pin_memory()
    per = total // steps
    ring = torch.empty(2 * per, dtype=torch.uint8, device="cuda")
    dest = torch.empty(total, dtype=torch.uint8, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def issue() -> None:
        free = [torch.cuda.Event() for _ in range(2)]
        for k in range(steps):
            slot = ring[(k % 2) * per : (k % 2 + 1) * per]
            h, g = host[k * per : (k + 1) * per], dest[k * per : (k + 1) * per]
            ready = torch.cuda.Event()
            if not d2h:
                if staged and k >= 2:
                    s1.wait_event(free[k % 2])
                with torch.cuda.stream(s1):
                    slot.copy_(h, non_blocking=True)
                if staged:
                    ready.record(s1)
                    s2.wait_event(ready)
                    with torch.cuda.stream(s2):
                        g.copy_(slot, non_blocking=True)
                    free[k % 2].record(s2)
            else:
                if staged:
                    if k >= 2:
                        s2.wait_event(free[k % 2])
                    with torch.cuda.stream(s2):
                        slot.copy_(g, non_blocking=True)
                    ready.record(s2)
                    s1.wait_event(ready)
                with torch.cuda.stream(s1):
                    h.copy_(slot, non_blocking=True)
                if staged:
                    free[k % 2].record(s1)

    out = [total / gated_gpu_seconds(issue, [s1, s2]) / 1e9 for _ in range(reps + 1)]
    return statistics.median(out[1:])


def main() -> int:
    ap = parser(__doc__, json=False, reps=9, reps_help="repetitions of each point, median")
    args = ap.parse_args()
    if not need_cuda("probe_pipeline"):
        return 1
    print(f"# {torch.cuda.get_device_name()}; % of the ceiling; steps: copies only / staged")
    link = ceiling()
    for d2h in (False, True):
        ceil = link["d2h" if d2h else "h2d"]
        print(f"{'d2h' if d2h else 'h2d'}: ceiling {ceil:.1f} GB/s")
        reps = args.reps
        for total in (10 * MIB, 40 * MIB):
            row = [f"one copy {100 * run(total, 1, d2h, staged=False, reps=reps) / ceil:.1f}"]
            for steps in (1, 2, 4, 8, 16):
                plain = run(total, steps, d2h, staged=False, reps=reps)
                staged = run(total, steps, d2h, reps=reps)
                row.append(f"{steps}: {100 * plain / ceil:.1f}/{100 * staged / ceil:.1f}")
            print(f"  {total >> 20} MiB: " + "  ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
