"""Scattered host rows on one, two or four streams: does spreading a staged transfer's block rows
over several copy engines beat one stream's cost per copy? ``--rows`` rows of R bytes (a block's
row: 80 layers x a 1-16 KiB page) at random, mostly non-adjacent places of a pinned buffer, to or
from one contiguous device buffer, one ``copy_`` (``cudaMemcpyAsync``) per row, rows dealt to the
streams in turn; queued behind a spin kernel, so that every copy is issued before the GPU starts
any (GPU time by CUDA events, median of ``--reps``). Beside it one contiguous copy of the same
bytes, as % of the link's ceiling measured in the same run.

    python benches/probe_row_streams.py [--rows 32] [--reps 15]

Printed, not saved. These are one call per row; the engine issues a step's rows in one
``cuMemcpyBatchAsync``, whose cost per copy is lower (``bench_blocks.py``'s ``rows`` column).
"""

from __future__ import annotations

import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from blockswap_bench.cli import need_cuda, parser
from blockswap_bench.kvblocks import DIRECTIONS, Copier, ceiling, link_header

KiB = 1024
ROW_KIB = (80, 160, 320, 640, 1280)
STREAMS = (1, 2, 4)


def main() -> int:
    ap = parser(__doc__, json=False, reps=15)
    ap.add_argument("--rows", type=int, default=32, help="rows a transfer (default 32)")
    args = ap.parse_args()
    if not need_cuda("probe_row_streams"):
        return 1
    import torch

    n = args.rows
    size = 2 * n * max(ROW_KIB) * KiB
    copier = Copier(size)
    ceil = ceiling(copier=copier)
    print(link_header(ceil, f"{n} rows a transfer, GPU time, % of the link"))
    streams = [torch.cuda.Stream() for _ in range(max(STREAMS))]
    main_stream = torch.cuda.current_stream()

    def timed(copies: list[tuple[Any, Any]], k: int) -> float:
        """Median GPU µs of ``copies`` dealt over ``k`` streams."""
        out = []
        for _ in range(args.reps + 2):
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(30_000_000)  # ~17 ms: every copy is issued before any starts
            start.record(main_stream)
            for s in streams[:k]:
                s.wait_event(start)
            for i, (dst, src) in enumerate(copies):
                with torch.cuda.stream(streams[i % k]):
                    dst.copy_(src, non_blocking=True)
            for s in streams[:k]:
                done = torch.cuda.Event()
                done.record(s)
                main_stream.wait_event(done)
            end.record(main_stream)
            end.synchronize()
            out.append(start.elapsed_time(end) * 1e3)
        return statistics.median(out[2:])

    gen = torch.Generator().manual_seed(0)
    print(f"{'row KiB':>8} {'dir':>4} {'1 copy':>7}" + "".join(f" {k} stream(s)" for k in STREAMS))
    for rk in ROW_KIB:
        r = rk * KiB
        slots = torch.randperm(2 * n, generator=gen)[:n].tolist()
        for d in DIRECTIONS:
            host, dev = copier.host, copier.dev
            pairs = [
                (host[s * r : (s + 1) * r], dev[i * r : (i + 1) * r]) for i, s in enumerate(slots)
            ]
            rows = [(dv, h) if d == "h2d" else (h, dv) for h, dv in pairs]
            nb = n * r
            one = [(dev[:nb], host[:nb]) if d == "h2d" else (host[:nb], dev[:nb])]

            def pct(us: float, d: str = d, nb: int = nb) -> float:
                return 100 * nb / us / 1e3 / ceil[d]

            figures = [pct(timed(one, 1))] + [pct(timed(rows, k)) for k in STREAMS]
            print(f"{rk:8d} {d:>4} " + " ".join(f"{x:10.1f}" for x in figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
