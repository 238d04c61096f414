"""Whether a transfer's block rows cross PCIe faster spread over several streams.

    python benches/probe_rows_streams.py [--rows-kib 320,640,1280] [--streams 1,2,3,4]

The staged plan's DMA alone: 32 rows of ``rows-kib`` KiB (80 layers' pages of 4, 8 and 16 KiB
by default), taken at random from 64 rows of a pinned buffer, to or from one contiguous device
buffer, one ``copy_`` per row, handed out round-robin to 1-4 streams. Everything is queued
behind a spin kernel, so no host time enters: the copy engines' own cost per copy, and whether
copies on several streams (several copy engines) hide it. Against the link's ceiling (one
256 MiB pinned copy, best of 5: ``blockswap_bench.kvblocks.ceiling``) and one copy of the same
bytes, measured in the same run; medians of 9.
"""

from __future__ import annotations

import statistics
import sys

import torch

from blockswap_bench.cli import need_cuda, parser
from blockswap_bench.common import gated_gpu_seconds
from blockswap_bench.kvblocks import ceiling

KIB = 1 << 10


def run(row: int, streams: int, d2h: bool, rows: int = 32, reps: int = 9) -> float:
    """GB/s of ``rows`` copies of ``row`` bytes over ``streams`` streams (``rows == 1``: one
    copy of ``row`` bytes)."""
    host = torch.empty(2 * rows * row, dtype=torch.uint8).pin_memory()
    dev = torch.empty(rows * row, dtype=torch.uint8, device="cuda")
    pick = torch.randperm(2 * rows)[:rows].tolist()
    ss = [torch.cuda.Stream() for _ in range(streams)]

    def issue() -> None:
        for i, b in enumerate(pick):
            h, d = host[b * row : (b + 1) * row], dev[i * row : (i + 1) * row]
            with torch.cuda.stream(ss[i % streams]):
                (h if d2h else d).copy_(d if d2h else h, non_blocking=True)

    out = [rows * row / gated_gpu_seconds(issue, ss) / 1e9 for _ in range(reps + 1)]
    return statistics.median(out[1:])


def main() -> int:
    ap = parser(__doc__, json=False)
    ap.add_argument("--rows-kib", default="320,640,1280")
    ap.add_argument("--streams", default="1,2,3,4")
    args = ap.parse_args()
    if not need_cuda("probe_rows_streams"):
        return 1
    counts = [int(x) for x in args.streams.split(",")]
    print(f"# {torch.cuda.get_device_name()}; 32 scattered rows, % of the ceiling")
    link = ceiling()
    for d2h in (False, True):
        name = "d2h" if d2h else "h2d"
        ceil = link[name]
        print(f"{name}: ceiling {ceil:.1f} GB/s")
        for kib in (int(x) for x in args.rows_kib.split(",")):
            one = run(32 * kib * KIB, 1, d2h, rows=1)
            got = [run(kib * KIB, n, d2h) for n in counts]
            cells = "  ".join(f"{n}: {g / ceil:6.1%}" for n, g in zip(counts, got))
            print(f"  rows of {kib:>5} KiB: one copy {one / ceil:6.1%}; a copy_ each on n streams"
                  f" {cells}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
