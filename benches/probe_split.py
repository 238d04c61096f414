"""A staged transfer with part of its rows moved by SMs beside it, without blockswap: can a few
CTAs reading (or writing) host memory fill the copy engines' step gaps and the pipeline's tail?

One transfer of ``--mib`` MiB in rows of ``--row-kib`` KiB at random host places (a KV block's
row: one page of every layer), as the staged plan moves it: ``--steps`` steps through two device
slots, each step one ``cuMemcpyBatchAsync`` of its rows (cuda-bindings) and an HBM-only kernel
placing (or gathering) the slot, events between the streams. ``split F/C``: the last F of the
rows are not staged; blockswap's Triton copy kernel on C CTAs moves their ``--page-kib`` pages
straight between host memory and their places, on a stream of its own, issued first. Beside it:
one copy of the same bytes, the rows alone (nothing placed), the staged steps alone, and the
kernel alone over every page (16 CTAs).

Two clocks: ``wall``: from a synchronised device to the last work seen done by polling events,
everything issued from the caller's thread with every argument built first (median of
``--reps``, variants interleaved), as % of one copy timed the same way; ``gpu``: GPU time with
everything issued behind a sleep kernel (median), as % of one copy behind the same sleep.

    python benches/probe_split.py [--mib 10] [--row-kib 320] [--page-kib 4] [--steps 4]
                                  [--splits 0.125/2,0.125/4,0.25/4,0.25/8] [--reps 25]

Printed, not saved.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from blockswap_bench.cli import need_cuda, parser
from blockswap_bench.common import gated_gpu_seconds
from blockswap_bench.kvblocks import ceiling, link_header


def split_list(text: str) -> list[tuple[float, int]]:
    """``0.125/2,0.25/8``: (share of the rows, CTAs) pairs."""
    out = []
    for item in text.split(","):
        f, sep, c = item.partition("/")
        try:
            pair = (float(f), int(c))
        except ValueError:
            pair = (-1.0, 0)
        if not sep or not 0 < pair[0] < 1 or pair[1] < 1:
            raise argparse.ArgumentTypeError(
                f"expected SHARE/CTAS with 0 < SHARE < 1, got {item!r}"
            )
        out.append(pair)
    return out


def main() -> int:
    ap = parser(__doc__, json=False, reps=25)
    ap.add_argument("--mib", type=int, default=10, help="MiB a transfer (default 10)")
    ap.add_argument("--row-kib", type=int, default=320, help="KiB a row (default 320)")
    ap.add_argument("--page-kib", type=int, default=4, help="KiB a page (default 4)")
    ap.add_argument("--steps", type=int, default=4, help="staged steps (default 4)")
    ap.add_argument("--splits", type=split_list, default=split_list("0.125/2,0.125/4,0.25/4,0.25/8"),
                    help="SHARE/CTAS,...: the share of rows the kernel moves, on CTAS CTAs")  # fmt: skip
    args = ap.parse_args()
    if (args.mib << 20) % (args.row_kib << 10) or (args.row_kib << 10) % (args.page_kib << 10):
        ap.error("--mib must cut into whole rows of --row-kib, and a row into whole pages")
    if not need_cuda("probe_split"):
        return 1
    import torch
    from cuda.bindings import driver

    from blockswap.kernels.copy import copy_blocks_raw

    ceil = ceiling()
    print(link_header(ceil))
    t, row, page = args.mib << 20, args.row_kib << 10, args.page_kib << 10
    n = t // row
    host = torch.empty(t, dtype=torch.uint8, pin_memory=True)
    pages = torch.empty(t, dtype=torch.uint8, device="cuda")
    perm = torch.randperm(n).tolist()  # row j of the pages at host row perm[j]
    ks, rs, ss = (torch.cuda.Stream() for _ in range(3))
    attr = driver.CUmemcpyAttributes()
    attr.srcAccessOrder = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    hb, pb = host.data_ptr(), pages.data_ptr()

    def rows_args(to_cpu: bool, js: list[int], dev: int) -> tuple[Any, ...]:
        at = [(dev + i * row, hb + perm[j] * row) for i, j in enumerate(js)]
        pairs = [(h, g) for g, h in at] if to_cpu else at
        return ([driver.CUdeviceptr(a) for a, _ in pairs],
                [driver.CUdeviceptr(b) for _, b in pairs], [row] * len(pairs))  # fmt: skip

    def issue(a: tuple[Any, ...], stream: Any) -> None:
        dsts, srcs, sizes = a
        (err, *_) = driver.cuMemcpyBatchAsync(
            dsts, srcs, sizes, len(sizes), [attr], [0], 1, driver.CUstream(stream.cuda_stream)
        )
        assert err == driver.CUresult.CUDA_SUCCESS, err

    def kernel_args(to_cpu: bool, js: list[int]) -> tuple[Any, ...]:
        src, dst = [], []
        for j in js:
            for p in range(0, row, page):
                h, g = hb + perm[j] * row + p, pb + j * row + p
                src.append(g if to_cpu else h)
                dst.append(h if to_cpu else g)
        dev = torch.tensor([src, dst, [page] * len(src)], dtype=torch.int64, device="cuda")
        return dev, len(src)

    def launch(k: tuple[Any, int], ctas: int) -> None:
        dev, m = k
        copy_blocks_raw(dev[0].data_ptr(), dev[1].data_ptr(), dev[2].data_ptr(), m,
                        max_ctas=ctas, max_size=page, alignment=16, stream=ss)  # fmt: skip

    def build(to_cpu: bool, frac: float, ctas: int, staged: bool = True) -> tuple[Any, list]:
        """``(go, streams)``: the staged steps over the first rows and the kernel over the
        last ``frac`` of them."""
        k_rows = round(n * frac)
        js = list(range(n - k_rows))
        groups = [js[i * len(js) // args.steps : (i + 1) * len(js) // args.steps]
                  for i in range(args.steps)] if js else []  # fmt: skip
        groups = [g for g in groups if g]
        s = max((len(g) for g in groups), default=0) * row
        slots = torch.empty(max(2 * s, 16), dtype=torch.uint8, device="cuda")
        sl = [slots[i * s : (i + 1) * s] for i in range(2)]
        ra = [rows_args(to_cpu, g, slots.data_ptr() + (i % 2) * s) for i, g in enumerate(groups)]
        dst = [pages[g[0] * row : (g[-1] + 1) * row].view(torch.float32) for g in groups]
        slot_f = [sl[i % 2][: len(g) * row].view(torch.float32) for i, g in enumerate(groups)]
        ready = [torch.cuda.Event() for _ in groups]
        free = [torch.cuda.Event(), torch.cuda.Event()]
        kern = kernel_args(to_cpu, list(range(n - k_rows, n))) if k_rows else None

        def go() -> None:
            if kern is not None:
                launch(kern, ctas)
            if not staged:
                return
            for i in range(len(groups)):
                if to_cpu:
                    if i >= 2:
                        ks.wait_event(free[i % 2])
                    with torch.cuda.stream(ks):
                        torch.mul(dst[i], 1.0, out=slot_f[i])
                    ready[i].record(ks)
                    rs.wait_event(ready[i])
                    issue(ra[i], rs)
                    free[i % 2].record(rs)
                else:
                    if i >= 2:
                        rs.wait_event(free[i % 2])
                    issue(ra[i], rs)
                    ready[i].record(rs)
                    ks.wait_event(ready[i])
                    with torch.cuda.stream(ks):
                        torch.mul(slot_f[i], 1.0, out=dst[i])
                    free[i % 2].record(ks)

        return go, [ss] + ([ks, rs] if groups else [])

    def one_copy(to_cpu: bool) -> tuple[Any, list]:
        def go() -> None:
            with torch.cuda.stream(rs):
                host.copy_(pages, non_blocking=True) if to_cpu else pages.copy_(
                    host, non_blocking=True
                )

        return go, [rs]

    def rows_alone(to_cpu: bool) -> tuple[Any, list]:
        a = rows_args(to_cpu, list(range(n)), pb)

        def go() -> None:
            issue(a, rs)

        return go, [rs]

    def alone(go: Any, streams: list) -> float:
        evs = [torch.cuda.Event() for _ in streams]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        go()
        for e, s in zip(evs, streams):
            e.record(s)
        while not all(e.query() for e in evs):
            pass
        return time.perf_counter() - t0

    def gated(go: Any, streams: list) -> float:
        return gated_gpu_seconds(go, [ks, rs, ss])

    names = ["rows", "staged", "kernel16"] + [f"split {f}/{c}" for f, c in args.splits]
    print(f"one transfer of {args.mib} MiB, {n} rows of {args.row_kib} KiB at random host places, "
          f"{args.page_kib} KiB pages, {args.steps} steps; % of one copy (wall: as a caller waits; "
          f"gpu: behind a sleep), median of {args.reps}")  # fmt: skip
    print(
        f"{'dir':<4} {'clock':<5} {'copy µs':>8} {'copy %':>7} "
        + " ".join(f"{v:>12}" for v in names)
    )
    for d in ("h2d", "d2h"):
        to_cpu = d == "d2h"
        built = [one_copy(to_cpu), rows_alone(to_cpu), build(to_cpu, 0.0, 16),
                 build(to_cpu, 1.0, 16, staged=False)]  # fmt: skip
        built += [build(to_cpu, f, c) for f, c in args.splits]
        for go, st in built:  # warm
            alone(go, st)
            gated(go, st)
        for clock, fn in (("wall", alone), ("gpu", gated)):
            secs: list[list[float]] = [[] for _ in built]
            for i in range(args.reps):
                for k in range(len(built)):
                    j = (i + k) % len(built)
                    secs[j].append(fn(*built[j]))
            med = [statistics.median(x) for x in secs]
            pct = 100 * t / med[0] / 1e9 / ceil[d]
            print(f"{d:<4} {clock:<5} {med[0] * 1e6:>8.1f} {pct:>6.1f}% "
                  + " ".join(f"{100 * med[0] / m:>11.1f}%" for m in med[1:]))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
