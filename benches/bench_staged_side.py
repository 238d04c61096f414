"""The staged plan beside the model and beside itself: a bf16 8192^3 GEMM's time alone and
while onloads run, and offload with onload at once against two large copies at once.

    python benches/bench_staged_side.py [--page-kib 16,2048] [--rounds 3]
                                        [--option KEY=VALUE ...] [--json out.json]

80 separately allocated layer tensors (where the handler takes the staged plan, or per-page DMA
where a block's row is past a slot), 64 GPU blocks, 32 random blocks per transfer; one transfer
each way first, to warm both directions.

GEMM, median of 20 each, in three situations taken in turns, ``--rounds`` times a page size
(each situation's median over the rounds counts; the GEMM's time beside the copies drifts by a
few tenths of a point between measurements minutes apart, the size of the difference asked
about): alone; right after queueing enough onloads to outlast it; right after queueing enough
256 MiB pinned CPU->GPU copies on a stream of their own (what PCIe traffic costs the GEMM on
this machine with no SM and no blockswap involved). Each
two ways: ``gpu``, the GEMM queued behind a spin kernel so that its launch is in place before the
GPU reaches it (the GPU's time alone: what the copies and kernels running beside it cost it), and
``launched``, timed from an event recorded just before its launch (the GPU's time plus however
long the launch took to arrive). ``launch``: the host time of the launch (two event records and
``torch.mm``), which grows where another thread is inside a long driver call.

Bidirectional: 16 offloads and 16 onloads queued at once, bytes of both over wall time, best of
3, against two ceilings measured in the same run, at its start and its end (the best of the two
counts): one 256 MiB pinned copy each way on two streams at once (best of 5:
``blockswap_bench.kvblocks.bidir_ceiling``), and the two one-way ceilings added (one 256 MiB
pinned copy a direction alone: ``blockswap_bench.kvblocks.ceiling``). The first line also says
what the link itself moves both ways at once as % of its two one-way ceilings added: no plan
moves more both ways than the link does. ``--option``: a handler or engine option
(``copy_path=loop``, ``max_batch=16384``), ints as ints.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from blockswap.handler import CpuGpuHandlers
from blockswap_bench.cli import option, parser
from blockswap_bench.kvblocks import bidir_ceiling, ceiling, write_figures

#: GPU cycles of the spin kernel a ``gpu`` GEMM waits behind (about 10 ms on an H100): longer
#: than any launch delay seen beside onloads.
SPIN_CYCLES = 20_000_000

#: What a situation queues before each GEMM; it returns the wait for what it queued.
Side = Callable[[], Callable[[], None]]


def gemm_once(a: torch.Tensor, b: torch.Tensor, hidden: bool) -> tuple[float, float]:
    """(GPU ms, launch host ms) of one ``a @ b`` on the current stream; ``hidden``: queued
    behind the spin kernel."""
    if hidden:
        torch.cuda._sleep(SPIN_CYCLES)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    s.record()
    torch.mm(a, b)
    e.record()
    launch = time.perf_counter() - t0
    e.synchronize()
    return s.elapsed_time(e), launch * 1e3


def gemm_stats(a: torch.Tensor, b: torch.Tensor, side: Side, n: int = 20) -> dict[str, float]:
    """Medians over ``n`` GEMMs each way, each right after ``side`` queued its work."""
    out = {}
    for hidden in (True, False):
        runs = []
        for _ in range(n):
            wait = side()
            runs.append(gemm_once(a, b, hidden))
            wait()
        key = "gpu" if hidden else "launched"
        out[f"{key}_ms"] = statistics.median(r[0] for r in runs)
        out[f"{key}_launch_ms"] = statistics.median(r[1] for r in runs)
    return out


def side_bytes() -> int:
    """Bytes to queue beside a GEMM so they outlast it and its spin kernel at 55 GB/s."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    torch.cuda._sleep(SPIN_CYCLES)
    e.record()
    e.synchronize()
    return int((s.elapsed_time(e) + 3.0) * 1e-3 * 55e9)


def plain_copies(nbytes: int) -> Side:
    """256 MiB pinned CPU->GPU copies on a stream of their own, ``nbytes`` in all: the control
    for the GEMM beside onloads."""
    size = 256 << 20
    host = torch.empty(size, dtype=torch.uint8).pin_memory()
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()

    def side() -> Callable[[], None]:
        with torch.cuda.stream(stream):
            for _ in range(-(-nbytes // size)):
                dev.copy_(host, non_blocking=True)
        return stream.synchronize

    return side


def onloads(h: CpuGpuHandlers, n: int, spec: Callable[[], Any]) -> Side:
    """``n`` onloads of ``spec()`` through ``h`` (job ids from 1 << 40 up)."""
    jobs = iter(range(1 << 40, 1 << 41))

    def side() -> Callable[[], None]:
        ids = [next(jobs) for _ in range(n)]
        for job in ids:
            h.h2d.transfer_async(job, spec())

        def wait() -> None:
            h.wait(ids)
            assert all(r.success for r in h.get_finished())

        return wait

    return side


def pct(x: float, base: float) -> str:
    return f"{100 * (x / base - 1):+.1f} %"


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--page-kib", default="16,2048")
    ap.add_argument("--rounds", type=int, default=3,
                    help="the GEMM's three situations in turns, this many times (3)")  # fmt: skip
    ap.add_argument("--option", action="append", default=[], type=option, metavar="KEY=VALUE",
                    help="a handler or engine option (repeatable)")  # fmt: skip
    args = ap.parse_args()
    options = dict(args.option)
    rng = np.random.default_rng(0)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for hidden in (False, True):  # warm cuBLAS and the spin kernel
        gemm_once(a, b, hidden)
    ceilings = [(bidir_ceiling(), sum(ceiling().values()))]
    beside = side_bytes()
    copies = plain_copies(beside)
    rows: list[dict[str, Any]] = []
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

            sides = {
                "gemm_alone": lambda: lambda: None,
                "gemm_beside_onloads": onloads(h, -(-beside // nbytes), lambda: spec(False)),
                "gemm_beside_copies": copies,
            }
            turns = [{k: gemm_stats(a, b, side) for k, side in sides.items()}
                     for _ in range(args.rounds)]  # fmt: skip
            gemm = {k: {m: statistics.median(t[k][m] for t in turns) for m in turns[0][k]}
                    for k in sides}  # fmt: skip
            alone, loads, beside_copies = gemm.values()
            # Per round, points of the GEMM's time beside onloads over beside the copies.
            over = [100 * (t["gemm_beside_onloads"]["gpu_ms"] - t["gemm_beside_copies"]["gpu_ms"])
                    / t["gemm_alone"]["gpu_ms"] for t in turns]  # fmt: skip
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
            row: dict[str, Any] = {"page_kib": kib, "route": h.routes["h2d"].reason, "options": options,
                   **gemm, "gemm_rounds": turns, "onloads_over_copies_points": over,
                   "bidir_gbps": bidir}  # fmt: skip
            rows.append(row)
            print(f"{kib:>5} KiB {h.routes['h2d'].plan}: GEMM on the GPU "
                  f"{alone['gpu_ms']:.3f} ms alone, {pct(loads['gpu_ms'], alone['gpu_ms'])} "
                  f"beside onloads, {pct(beside_copies['gpu_ms'], alone['gpu_ms'])} beside plain "
                  f"copies (onloads over copies, round by round: "
                  f"{', '.join(f'{x:+.2f}' for x in over)} points); as launched "
                  f"{pct(loads['launched_ms'], alone['launched_ms'])} / "
                  f"{pct(beside_copies['launched_ms'], alone['launched_ms'])}; its launch "
                  f"{alone['launched_launch_ms']:.3f} ms alone, "
                  f"{loads['launched_launch_ms']:.3f} beside onloads, "
                  f"{beside_copies['launched_launch_ms']:.3f} beside plain copies; offload + "
                  f"onload {bidir:.1f} GB/s")  # fmt: skip
        finally:
            h.shutdown()
    ceilings.append((bidir_ceiling(), sum(ceiling().values())))
    both, added = (max(c[i] for c in ceilings) for i in (0, 1))
    print(f"# {torch.cuda.get_device_name()}; the link both ways at once {both:.1f} GB/s, its "
          f"one-way ceilings added {added:.1f} GB/s (best of the start and the end: "
          f"{', '.join(f'{c[0]:.1f} / {c[1]:.1f}' for c in ceilings)}): the link moves "
          f"{100 * both / added:.0f} % of its one-way ceilings added both ways at once; "
          f"options {options}")  # fmt: skip
    for row in rows:
        row["bidir_ceiling_gbps"], row["one_way_added_gbps"] = both, added
        kib, gbps = row["page_kib"], row["bidir_gbps"]
        print(f"{kib:>5} KiB: offload + onload {gbps:.1f} GB/s = {100 * gbps / both:.0f} % of "
              f"both ways at once, {100 * gbps / added:.0f} % of the one-way ceilings added")  # fmt: skip
    if args.json:
        write_figures(args.json, "bench_staged_side.py", None, rows, bidir_ceiling_gbps=both,
                      one_way_added_gbps=added, ceilings=ceilings)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
