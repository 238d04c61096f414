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

    python benches/probe_step_gaps.py [--mib 28] [--steps 2,4,8] [--row-kib 896] [--reps 15]

Printed, not saved.
"""

from __future__ import annotations

import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from blockswap_bench.cli import int_list, need_cuda, parser
from blockswap_bench.kvblocks import ceiling, link_header

TRANSFERS = 8
VARIANTS = ("one copy", "plain", "slots", "slots-2s", "rows", "rows+slots")


def main() -> int:
    ap = parser(__doc__, json=False, reps=15)
    ap.add_argument("--mib", type=int, default=28, help="MiB a transfer (default 28)")
    ap.add_argument("--steps", type=int_list, default=[2, 4, 8], help="steps a transfer (2,4,8)")
    ap.add_argument("--row-kib", type=int, default=896, help="KiB a row (default 896)")
    args = ap.parse_args()
    if not need_cuda("probe_step_gaps"):
        return 1
    import torch

    ceil = ceiling()
    print(link_header(ceil))
    t = args.mib << 20
    host = torch.empty(TRANSFERS * t, dtype=torch.uint8, pin_memory=True)
    pages = torch.empty(TRANSFERS * t, dtype=torch.uint8, device="cuda")
    row = args.row_kib << 10
    if any(t % (row * n) for n in args.steps):
        ap.error(f"each of --steps must cut {args.mib} MiB into whole rows of {args.row_kib} KiB")
    perm = torch.randperm(TRANSFERS * t // row).tolist()  # row j of the pages at host row perm[j]
    print(f"{TRANSFERS} transfers of {args.mib} MiB; GPU time as % of the link (median of "
          f"{args.reps})")  # fmt: skip
    print(f"{'direction':<9} {'steps':>5} {'step MiB':>8} " + " ".join(f"{v:>9}" for v in VARIANTS))
    for d in ("d2h", "h2d"):
        for steps in args.steps:
            s = t // steps
            slots = torch.empty(2 * s, dtype=torch.uint8, device="cuda")
            rows = Rows(d == "d2h", host, perm, row)
            pct = []
            for v in VARIANTS:
                ms = statistics.median(
                    run(torch, v, d == "d2h", host, pages, slots, s, rows) for _ in range(args.reps)
                )
                pct.append(100 * TRANSFERS * t / (ms / 1e3) / 1e9 / ceil[d])
            print(f"{d:<9} {steps:>5} {s / 2**20:>8.2f} " + " ".join(f"{p:>8.1f}%" for p in pct))
    return 0


class Rows:
    """One ``cuMemcpyBatchAsync`` of the rows of a byte range of the pages (at ``dev``, or at a
    slot standing for it) to or from their random places in the host buffer."""

    def __init__(self, to_cpu: bool, host: Any, perm: list[int], row: int) -> None:
        from cuda.bindings import driver

        self.driver, self.to_cpu, self.perm, self.row = driver, to_cpu, perm, row
        self.host = host.data_ptr()
        self.attr = driver.CUmemcpyAttributes()
        self.attr.srcAccessOrder = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM

    def copy(self, dev: int, start: int, nbytes: int, stream: Any) -> None:
        d, r = self.driver, self.row
        at = [(dev + i, self.host + self.perm[(start + i) // r] * r) for i in range(0, nbytes, r)]
        pairs = [(h, g) for g, h in at] if self.to_cpu else at
        dsts = [d.CUdeviceptr(a) for a, _ in pairs]
        srcs = [d.CUdeviceptr(b) for _, b in pairs]
        sizes = [r] * len(pairs)
        (err, *_) = d.cuMemcpyBatchAsync(
            dsts, srcs, sizes, len(sizes), [self.attr], [0], 1, d.CUstream(stream.cuda_stream)
        )
        assert err == d.CUresult.CUDA_SUCCESS, err


def run(
    torch: Any,
    variant: str,
    to_cpu: bool,
    host: Any,
    pages: Any,
    slots: Any,
    s: int,
    rows: Rows,
) -> float:
    """Milliseconds of GPU time of one variant (all of it issued before the GPU starts)."""
    main_s = torch.cuda.current_stream()
    ks, r0, r1 = (torch.cuda.Stream() for _ in range(3))
    torch.cuda.synchronize()
    torch.cuda._sleep(20_000_000)  # about 10 ms: everything below is issued before it ends
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(main_s)
    used = [ks, r0, r1]
    for st in used:
        st.wait_event(start)
    n = host.numel() // s
    f32 = [slots[i * s : (i + 1) * s].view(torch.float32) for i in range(2)]
    if variant == "one copy":
        with torch.cuda.stream(r0):
            (host.copy_(pages, non_blocking=True) if to_cpu
             else pages.copy_(host, non_blocking=True))  # fmt: skip
    elif variant == "plain":
        with torch.cuda.stream(r0):
            for k in range(n):
                h, p = host[k * s : (k + 1) * s], pages[k * s : (k + 1) * s]
                h.copy_(p, non_blocking=True) if to_cpu else p.copy_(h, non_blocking=True)
    elif variant == "rows":
        for k in range(n):
            rows.copy(pages.data_ptr() + k * s, k * s, s, r0)
    else:
        free = [torch.cuda.Event(), torch.cuda.Event()]
        for k in range(n):
            rs = r1 if variant == "slots-2s" and k % 2 else r0
            h, p = host[k * s : (k + 1) * s], pages[k * s : (k + 1) * s].view(torch.float32)
            slot, ready = slots[(k % 2) * s : (k % 2 + 1) * s], torch.cuda.Event()
            if variant == "rows+slots":
                # The slot's bytes as rows at their random host places (the copy itself).
                h = None
            if to_cpu:
                if k >= 2:
                    ks.wait_event(free[k % 2])
                with torch.cuda.stream(ks):
                    torch.mul(p, 1.0, out=f32[k % 2])
                ready.record(ks)
                rs.wait_event(ready)
                if h is None:
                    rows.copy(slot.data_ptr(), k * s, s, rs)
                else:
                    with torch.cuda.stream(rs):
                        h.copy_(slot, non_blocking=True)
                free[k % 2].record(rs)
            else:
                if k >= 2:
                    rs.wait_event(free[k % 2])
                if h is None:
                    rows.copy(slot.data_ptr(), k * s, s, rs)
                else:
                    with torch.cuda.stream(rs):
                        slot.copy_(h, non_blocking=True)
                ready.record(rs)
                ks.wait_event(ready)
                with torch.cuda.stream(ks):
                    torch.mul(f32[k % 2], 1.0, out=p)
                free[k % 2].record(ks)
    for st in used:
        ev = torch.cuda.Event()
        ev.record(st)
        main_s.wait_event(ev)
    end.record(main_s)
    end.synchronize()
    return start.elapsed_time(end)


if __name__ == "__main__":
    sys.exit(main())
