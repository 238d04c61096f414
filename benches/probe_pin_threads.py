"""Does page-locking a rank's cells of vLLM's shared region go faster from several threads? A
probe: ``--world`` processes on one GPU, each one rank of one region, started together; each
fills its own cells first (from threads, as the worker does), then registers them with the driver
(``cuMemHostRegister``, one a cell, as the worker does) from 1, 2, 4 ... ``--max-threads``
threads, unregistering between (steps ``fill``, ``pinN``, ``unpinN``). Then, each on a region of
its own, the worker's whole step (``fill_and_pin``: filling and locking at once) with
``FILL/LOCK[/nofiles][/sorted]`` threads (steps ``ready-16/1`` ...; ``nofiles``: pages faulted in
without first allocating them in the region's files; ``sorted``: every rank fills its ranges in
address order, rather than from the file where vLLM starts its slots).

    python benches/probe_pin_threads.py [--gib 32] [--world 8] [--cell-mib 2] [--json out.json]

Printed per step: the seconds from the common start until the last rank is done (what a TP
deployment waits for), and the region's bytes over that time.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from blockswap_bench.cli import parser
from blockswap_bench.kvblocks import write_figures
from blockswap_bench.ranks import region_kwargs, run_ranks


def in_threads(fn: Any, pieces: list[tuple[int, int]], threads: int) -> None:
    """``fn(piece)`` for every piece, ``threads`` threads taking every ``threads``-th piece."""

    def run(k: int) -> None:
        for p in pieces[k::threads]:
            fn(p)

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(run, range(threads)))


def rank_main(
    rank: int, engine: str, start: Any, out: Any, a: dict[str, Any], mode: str | None
) -> None:
    import torch

    from blockswap import _core
    from blockswap import _vllm_region as vr

    torch.cuda.init()
    device = torch.cuda.current_device()
    torch.cuda.mem_get_info(device)  # the runtime's context made before the clock starts

    def meet() -> None:
        start.wait(300)  # a rank that fails breaks the barrier rather than hanging the others

    region = vr.new_region(**region_kwargs(a["size"], a["world"], a["cell"], rank, engine, meet))
    times: dict[str, tuple[float, float]] = {}
    try:
        pieces, fill, files = vr.pieces_and_fill(region, 4 << 30, whole_rows=False)
        meet()
        t0 = time.perf_counter()
        if mode is None:
            _core.fill_and_pin(list(fill), [], None, files=list(files) or None)
            times["fill"] = (t0, time.perf_counter())
            vr.close_files(region)
            for threads in a["threads"]:
                meet()
                t0 = time.perf_counter()
                in_threads(lambda p: _core.cuda_pin(p[0], p[1], device), pieces, threads)
                times[f"pin{threads}"] = (t0, time.perf_counter())
                meet()
                t0 = time.perf_counter()
                in_threads(lambda p: _core.cuda_unpin(p[0], device), pieces, threads)
                times[f"unpin{threads}"] = (t0, time.perf_counter())
        else:
            fill_threads, lock_threads, *flags = mode.split("/")
            if "sorted" in flags and files:
                by_address = sorted(range(len(fill)), key=lambda i: fill[i][0])
                fill, files = [fill[i] for i in by_address], [files[i] for i in by_address]
            _core.fill_and_pin(
                list(fill),
                pieces,
                device,
                threads=int(fill_threads),
                files=None if "nofiles" in flags else list(files) or None,
                lock_threads=int(lock_threads),
            )
            times[f"ready-{mode}"] = (t0, time.perf_counter())
            vr.close_files(region)
            in_threads(lambda p: _core.cuda_unpin(p[0], device), pieces, 2)
    finally:
        meet()
        region.cleanup()
    out.put(
        {"rank": rank, "times": times, "pieces": len(pieces), "bytes": sum(n for _, n in pieces)}
    )


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--gib", type=int, default=32, help="the region's size")
    ap.add_argument("--world", type=int, default=8, help="ranks (processes on one GPU)")
    ap.add_argument("--cell-mib", type=int, default=2, help="a rank's cell of a row")
    ap.add_argument("--max-threads", type=int, default=8, help="the most threads that register")
    ap.add_argument(
        "--modes",
        default="16/1,16/2",
        help="the worker's whole step: FILL/LOCK[/nofiles][/sorted] threads, comma-separated",
    )
    args = ap.parse_args()
    threads = [t for t in (1, 2, 4, 8, 16, 32) if t <= args.max_threads]
    a = {
        "size": args.gib << 30,
        "world": args.world,
        "cell": args.cell_mib << 20,
        "threads": threads,
        "modes": [m for m in args.modes.split(",") if m],
    }
    rows = []
    for mode in [None, *a["modes"]]:
        ranks = run_ranks(rank_main, args.world, a, mode)
        for step in ranks[0]["times"]:
            spans = [r["times"][step] for r in ranks]
            wall = max(t1 for _, t1 in spans) - min(t0 for t0, _ in spans)
            rows.append({"step": step, "all_done_s": wall, "region_gib_s": args.gib / wall})
            print(
                f"{args.gib} GiB, {args.world} ranks, {ranks[0]['pieces']} pieces of "
                f"{ranks[0]['bytes'] / ranks[0]['pieces'] / (1 << 20):.0f} MiB a rank, {step}: "
                f"all done in {wall:.2f} s "
                f"({args.gib / wall:.1f} GiB/s of region)",
                flush=True,
            )
    if args.json:
        write_figures(args.json, "probe_pin_threads.py", None, rows, **a)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
