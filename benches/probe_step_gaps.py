"""What a staged step's boundary costs the link, without blockswap: 8 transfers of ``--mib`` MiB
cut into steps, each step's bytes through one of two device slots the way the staged plan moves
them (GPU->CPU: an SM kernel gathers the step into a slot on a kernel stream, the rows stream
waits for it and copies the slot to host, then records the slot free; CPU->GPU the mirror), all
of it queued behind a spin kernel so that the host's issuing is out of the figure (GPU time by
CUDA events, median of ``--reps``). Variants: ``plain``: the steps' copies on one stream, no
slot, no events; ``slots``: the pipeline above, rows on one stream; ``slots-2s``: the rows of
even and odd steps on two streams (a step's copy may then start before the previous one ends);
``rows`` and ``rows+slots``: ``plain`` and ``slots`` with each step's bytes as rows of
``--row-kib`` at random places of the host buffer (a KV block's row: a page of every layer),
one ``cuMemcpyBatchAsync`` a step (cuda-bindings), as the staged plan issues them. Beside them
one copy of all the bytes and the link's ceiling, in the same run.

``--isolated``: one transfer at a time, nothing queued before it, timed as a caller waits: the
wall clock from a synchronised device to the transfer's last work seen done by polling an event,
every call's arguments built before the clock starts and everything issued from the caller's
thread. Beside one copy of the same bytes timed the same way: ``rows`` (the rows alone, one
batch a step, nothing placed on the GPU: what the copy engines allow for those host places) and
``rows+slots`` (the staged steps above). The floor of an isolated transfer for any plan that
moves those rows on the copy engines, and for the staged plan, without an engine's thread.

    python benches/probe_step_gaps.py [--mib 28] [--steps 2,4,8] [--row-kib 896] [--reps 15]
    python benches/probe_step_gaps.py --isolated --mib 40 --row-kib 1280 --steps 1,4 --reps 25

Printed, not saved.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from blockswap_bench.cli import int_list, need_cuda, parser
from blockswap_bench.kvblocks import ceiling, link_header

TRANSFERS = 8
VARIANTS = ("one copy", "plain", "slots", "slots-2s", "rows", "rows+slots")
#: ``--isolated``: one copy (the reference), the rows alone, and the staged steps with rows.
ISOLATED = ("one copy", "rows", "rows+slots")


def main() -> int:
    ap = parser(__doc__, json=False, reps=15)
    ap.add_argument("--mib", type=int, default=28, help="MiB a transfer (default 28)")
    ap.add_argument("--steps", type=int_list, default=[2, 4, 8], help="steps a transfer (2,4,8)")
    ap.add_argument("--row-kib", type=int, default=896, help="KiB a row (default 896)")
    ap.add_argument("--isolated", action="store_true",
                    help="one transfer at a time, wall clock as a caller waits (see above)")  # fmt: skip
    args = ap.parse_args()
    if not need_cuda("probe_step_gaps"):
        return 1
    import torch

    ceil = ceiling()
    print(link_header(ceil))
    t = args.mib << 20
    count = 1 if args.isolated else TRANSFERS
    host = torch.empty(count * t, dtype=torch.uint8, pin_memory=True)
    pages = torch.empty(count * t, dtype=torch.uint8, device="cuda")
    row = args.row_kib << 10
    if any(t % (row * n) for n in args.steps):
        ap.error(f"each of --steps must cut {args.mib} MiB into whole rows of {args.row_kib} KiB")
    perm = torch.randperm(count * t // row).tolist()  # row j of the pages at host row perm[j]
    streams = (torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream())
    if args.isolated:
        variants = ISOLATED
        print(f"one transfer of {args.mib} MiB at a time, rows of {args.row_kib} KiB; wall clock "
              f"(median of {args.reps}, interleaved) as % of one copy of the same bytes timed the "
              "same way, and that copy's µs and % of the link")  # fmt: skip
        print(f"{'direction':<9} {'steps':>5} {'step MiB':>8} {'copy µs':>8} {'copy %':>7} "
              + " ".join(f"{v:>10}" for v in variants[1:]))  # fmt: skip
    else:
        variants = VARIANTS
        print(f"{TRANSFERS} transfers of {args.mib} MiB; GPU time as % of the link (median of "
              f"{args.reps})")  # fmt: skip
        print(f"{'direction':<9} {'steps':>5} {'step MiB':>8} "
              + " ".join(f"{v:>9}" for v in variants))  # fmt: skip
    for d in ("d2h", "h2d"):
        for steps in args.steps:
            s = t // steps
            slots = torch.empty(2 * s, dtype=torch.uint8, device="cuda")
            rows = Rows(d == "d2h", host, perm, row)
            built = [build(torch, v, d == "d2h", host, pages, slots, s, rows, streams)
                     for v in variants]  # fmt: skip
            head = f"{d:<9} {steps:>5} {s / 2**20:>8.2f}"
            if args.isolated:
                for go, last in built:  # warm: the kernels, the driver's paths
                    alone(torch, go, last)
                secs: list[list[float]] = [[] for _ in variants]
                for i in range(args.reps):
                    for k in range(len(variants)):
                        j = (i + k) % len(variants)
                        secs[j].append(alone(torch, *built[j]))
                med = [statistics.median(x) for x in secs]
                copy_pct = 100 * t / med[0] / 1e9 / ceil[d]
                print(f"{head} {med[0] * 1e6:>8.1f} {copy_pct:>6.1f}% "
                      + " ".join(f"{100 * med[0] / m:>9.1f}%" for m in med[1:]))  # fmt: skip
                continue
            pct = []
            for go, _ in built:
                ms = statistics.median(run(torch, go, streams) for _ in range(args.reps))
                pct.append(100 * count * t / (ms / 1e3) / 1e9 / ceil[d])
            print(f"{head} " + " ".join(f"{p:>8.1f}%" for p in pct))
    return 0


class Rows:
    """One ``cuMemcpyBatchAsync`` of the rows of a byte range of the pages (at ``dev``, or at a
    slot standing for it) to or from their random places in the host buffer: :meth:`prepare`
    builds the call's arguments, :meth:`issue` makes it."""

    def __init__(self, to_cpu: bool, host: Any, perm: list[int], row: int) -> None:
        from cuda.bindings import driver

        self.driver, self.to_cpu, self.perm, self.row = driver, to_cpu, perm, row
        self.host = host.data_ptr()
        self.attr = driver.CUmemcpyAttributes()
        self.attr.srcAccessOrder = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM

    def prepare(self, dev: int, start: int, nbytes: int) -> tuple[Any, ...]:
        d, r = self.driver, self.row
        at = [(dev + i, self.host + self.perm[(start + i) // r] * r) for i in range(0, nbytes, r)]
        pairs = [(h, g) for g, h in at] if self.to_cpu else at
        dsts = [d.CUdeviceptr(a) for a, _ in pairs]
        srcs = [d.CUdeviceptr(b) for _, b in pairs]
        return dsts, srcs, [r] * len(pairs)

    def issue(self, args: tuple[Any, ...], stream: Any) -> None:
        d = self.driver
        dsts, srcs, sizes = args
        (err, *_) = d.cuMemcpyBatchAsync(
            dsts, srcs, sizes, len(sizes), [self.attr], [0], 1, d.CUstream(stream.cuda_stream)
        )
        assert err == d.CUresult.CUDA_SUCCESS, err


def build(
    torch: Any,
    variant: str,
    to_cpu: bool,
    host: Any,
    pages: Any,
    slots: Any,
    s: int,
    rows: Rows,
    streams: tuple[Any, Any, Any],
) -> tuple[Any, Any]:
    """``(go, last)``: ``go()`` issues one variant's work on ``streams`` (the kernel stream and
    two row streams), every argument of it built beforehand; ``last`` is the stream whose work
    ends last (the one to wait on when the variant ran alone)."""
    ks, r0, r1 = streams
    n = host.numel() // s
    f32 = [slots[i * s : (i + 1) * s].view(torch.float32) for i in range(2)]
    hs = [host[k * s : (k + 1) * s] for k in range(n)]
    ps = [pages[k * s : (k + 1) * s] for k in range(n)]
    if variant == "one copy":

        def go() -> None:
            with torch.cuda.stream(r0):
                (host.copy_(pages, non_blocking=True) if to_cpu
                 else pages.copy_(host, non_blocking=True))  # fmt: skip

        return go, r0
    if variant == "plain":

        def go() -> None:
            with torch.cuda.stream(r0):
                for h, p in zip(hs, ps):
                    h.copy_(p, non_blocking=True) if to_cpu else p.copy_(h, non_blocking=True)

        return go, r0
    if variant == "rows":
        args = [rows.prepare(pages.data_ptr() + k * s, k * s, s) for k in range(n)]

        def go() -> None:
            for a in args:
                rows.issue(a, r0)

        return go, r0
    rs_of = [r1 if variant == "slots-2s" and k % 2 else r0 for k in range(n)]
    slot_rows = [rows.prepare(slots.data_ptr() + (k % 2) * s, k * s, s) for k in range(n)]
    slot = [slots[(k % 2) * s : (k % 2 + 1) * s] for k in range(n)]
    pf = [p.view(torch.float32) for p in ps]
    ready = [torch.cuda.Event() for _ in range(n)]
    free = [torch.cuda.Event(), torch.cuda.Event()]
    as_rows = variant == "rows+slots"  # the slot's bytes as rows at their random host places

    def go() -> None:
        for k in range(n):
            rs = rs_of[k]
            if to_cpu:
                if k >= 2:
                    ks.wait_event(free[k % 2])
                with torch.cuda.stream(ks):
                    torch.mul(pf[k], 1.0, out=f32[k % 2])
                ready[k].record(ks)
                rs.wait_event(ready[k])
                if as_rows:
                    rows.issue(slot_rows[k], rs)
                else:
                    with torch.cuda.stream(rs):
                        hs[k].copy_(slot[k], non_blocking=True)
                free[k % 2].record(rs)
            else:
                if k >= 2:
                    rs.wait_event(free[k % 2])
                if as_rows:
                    rows.issue(slot_rows[k], rs)
                else:
                    with torch.cuda.stream(rs):
                        slot[k].copy_(hs[k], non_blocking=True)
                ready[k].record(rs)
                ks.wait_event(ready[k])
                with torch.cuda.stream(ks):
                    torch.mul(f32[k % 2], 1.0, out=pf[k])
                free[k % 2].record(ks)

    return go, (r0 if to_cpu else ks)


def run(torch: Any, go: Any, streams: tuple[Any, ...]) -> float:
    """Milliseconds of GPU time of ``go()``'s work, all of it issued before the GPU starts."""
    main_s = torch.cuda.current_stream()
    torch.cuda.synchronize()
    torch.cuda._sleep(20_000_000)  # about 10 ms: everything below is issued before it ends
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(main_s)
    for st in streams:
        st.wait_event(start)
    go()
    for st in streams:
        ev = torch.cuda.Event()
        ev.record(st)
        main_s.wait_event(ev)
    end.record(main_s)
    end.synchronize()
    return start.elapsed_time(end)


def alone(torch: Any, go: Any, last: Any) -> float:
    """Seconds of wall clock from a synchronised device to ``go()``'s work seen done by polling an
    event on ``last`` (as a caller waits for one transfer, nothing queued before it)."""
    done = torch.cuda.Event()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    go()
    done.record(last)
    while not done.query():
        pass
    return time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main())
