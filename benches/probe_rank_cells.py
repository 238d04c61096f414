"""How long does vLLM's shared offload region take to be ready when every rank page-locks whole
rows, against each rank its own cells (vLLM's rule, and the plug-in's since)? A probe:
``--world`` processes on one GPU, each one rank of one region, started together.

    python benches/probe_rank_cells.py [--gib 32] [--world 8] [--cell-mib 2] [--json out.json]

Each rank makes the region as blockswap's spec does (``new_region``: its slots left to it), fills
its slots from threads and page-locks its pieces (``pieces_and_fill``, ``pin_region``: what the
worker's constructor does before any transfer), once with whole rows (``whole_rows=True``, what
every rank did before) and once with its cells only. Printed per mode: the seconds from the common
start until the last rank is ready (what a TP deployment waits for), the slowest and fastest rank,
the bytes each rank locks and the GPU memory the locking took (free memory before and after, rank
0). Whole rows are locked first.
"""

from __future__ import annotations

import os
import time
from typing import Any

from blockswap_bench.cli import parser
from blockswap_bench.kvblocks import write_figures
from blockswap_bench.ranks import region_kwargs, run_ranks


def rank_main(rank: int, engine: str, start: Any, out: Any, a: dict[str, Any], whole: bool) -> None:
    import torch

    from blockswap import _vllm_region as vr

    torch.cuda.init()
    device = torch.cuda.current_device()
    torch.cuda.mem_get_info(device)  # the runtime's context made before the clock starts
    kwargs = region_kwargs(a["size"], a["world"], a["cell"], rank, engine, start.wait)
    start.wait()  # every rank's context made: the clock starts
    t0 = time.perf_counter()
    free0 = torch.cuda.mem_get_info(device)[0]
    region = vr.new_region(**kwargs)
    try:
        pieces, fill, files = vr.pieces_and_fill(region, 4 << 30, whole_rows=whole)
        pinned = vr.pin_region(pieces, device, fill, files)
        vr.close_files(region)
        t1 = time.perf_counter()
        free1 = torch.cuda.mem_get_info(device)[0]
        start.wait()  # every rank ready before any unlocks
        vr.unpin_region(pinned, device)
    finally:
        region.cleanup()
    out.put(
        {
            "rank": rank,
            "t0": t0,
            "t1": t1,
            "pieces": len(pieces),
            "locked_bytes": sum(n for _, n in pieces),
            "gpu_bytes": free0 - free1,
        }
    )


def one_mode(a: dict[str, Any], whole: bool) -> dict[str, Any]:
    ranks = run_ranks(rank_main, a["world"], a, whole)
    first = min(r["t0"] for r in ranks)
    each = [r["t1"] - r["t0"] for r in ranks]
    return {
        "whole_rows": whole,
        "ready_s": max(r["t1"] for r in ranks) - first,
        "slowest_rank_s": max(each),
        "fastest_rank_s": min(each),
        "pieces_per_rank": ranks[0]["pieces"],
        "locked_gib_per_rank": ranks[0]["locked_bytes"] / (1 << 30),
        "gpu_mib_rank0": ranks[0]["gpu_bytes"] / (1 << 20),
    }


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--gib", type=int, default=32, help="the region's size")
    ap.add_argument("--world", type=int, default=8, help="ranks (processes on one GPU)")
    ap.add_argument("--cell-mib", type=int, default=2, help="a rank's cell of a row")
    args = ap.parse_args()
    a = {"size": args.gib << 30, "world": args.world, "cell": args.cell_mib << 20}
    rows = []
    for whole in (True, False):
        r = one_mode(a, whole)
        rows.append(r)
        how = "whole rows" if whole else "own cells "
        print(
            f"{args.gib} GiB, {args.world} ranks, cells of {args.cell_mib} MiB, {how}: all ready "
            f"in {r['ready_s']:.2f} s (ranks {r['fastest_rank_s']:.2f}-{r['slowest_rank_s']:.2f} s), "
            f"{r['locked_gib_per_rank']:.1f} GiB locked a rank in {r['pieces_per_rank']} pieces, "
            f"GPU memory taken (rank 0): {r['gpu_mib_rank0']:.0f} MiB",
            flush=True,
        )
    if args.json:
        write_figures(args.json, "probe_rank_cells.py", None, rows, **a)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
