"""Strided fragments CPU->GPU by SMs and copy engines at once: can the copy engines carry part of
a canonical load beside the SMs and lift it past what SMs reading host memory reach alone?

A rank's canonical fragments (``--frag`` bytes, one in every ``--tp`` in pinned host memory, the
other ranks' between them) to a contiguous GPU buffer, ``--mib`` MiB of them, without the engine:

* ``sm``: blockswap's copy kernel over one descriptor per fragment (descriptors in device
  memory, ``--ctas`` CTAs, one launch): the direct plan's way;
* ``ce``: one ``cuMemcpy2DAsync`` (width a fragment, source pitch ``tp`` fragments), or with
  ``--run N`` one per ``N`` fragments (a canonical ``CopyRun`` is a block's tokens, 16: blocks
  at random places share no stride): the copy engines' way;
* ``hybrid F``: the first ``F`` of the fragments by the 2-D copy on one stream while the kernel
  moves the rest on another, both gated to start together.

GPU time from the gate's end to both streams done, median of ``--reps``, % of the link's
ceiling measured in the same run (and in GB/s). Needs a GPU and cuda-bindings.

    python benches/probe_hybrid.py [--frag 512,1024,2048] [--tp 2] [--mib 32] [--reps 9]
                                   [--ctas 16] [--run 16]

Printed, not saved.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from blockswap_bench.cli import need_cuda, parser
from blockswap_bench.common import gated_gpu_seconds
from blockswap_bench.kvblocks import ceiling, link_header

SHARES = (0.1, 0.2, 0.3, 0.4, 0.5)


def copy_2d(driver: Any, src: int, src_pitch: int, dst: int, width: int, height: int,
            stream: Any) -> None:  # fmt: skip
    """One 2-D copy of ``height`` rows of ``width`` bytes (``cuMemcpy2DAsync``, unified
    addresses: the pinned host side is mapped)."""
    c = driver.CUDA_MEMCPY2D()
    c.srcMemoryType = driver.CUmemorytype.CU_MEMORYTYPE_UNIFIED
    c.srcDevice = driver.CUdeviceptr(src)
    c.srcPitch = src_pitch
    c.dstMemoryType = driver.CUmemorytype.CU_MEMORYTYPE_UNIFIED
    c.dstDevice = driver.CUdeviceptr(dst)
    c.dstPitch = width
    c.WidthInBytes = width
    c.Height = height
    (err,) = driver.cuMemcpy2DAsync(c, driver.CUstream(stream.cuda_stream))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemcpy2DAsync: {err}")


def probe(frag: int, args: Any, ceil: dict[str, float], streams: tuple[Any, Any]) -> None:
    """Prints each variant's figure for fragments of ``frag`` bytes."""
    import torch
    from cuda.bindings import driver

    from blockswap.kernels import copy_blocks
    from blockswap.routing import KERNEL_BLOCK_BYTES

    sm_stream, ce_stream = streams
    nbytes = args.mib << 20
    rows = nbytes // frag
    host = torch.randint(0, 256, (rows * args.tp * frag,), dtype=torch.uint8).pin_memory()
    dev = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    r = torch.arange(rows, dtype=torch.int64)
    src = (host.data_ptr() + r * args.tp * frag).to("cuda")
    dst = (dev.data_ptr() + r * frag).to("cuda")
    sizes = torch.full((rows,), frag, dtype=torch.int64, device="cuda")

    def issue(share: float) -> None:
        ce_rows = int(rows * share)
        run = args.run or ce_rows
        for r0 in range(0, ce_rows, max(run, 1)):
            copy_2d(driver, host.data_ptr() + r0 * args.tp * frag, args.tp * frag,
                    dev.data_ptr() + r0 * frag, frag, min(run, ce_rows - r0),
                    ce_stream)  # fmt: skip
        if ce_rows < rows:
            copy_blocks(src[ce_rows:], dst[ce_rows:], sizes[ce_rows:], max_ctas=args.ctas,
                        block_bytes=KERNEL_BLOCK_BYTES, stream=sm_stream, max_size=frag,
                        alignment=16, check_values=False)  # fmt: skip

    variants = {"sm": 0.0, "ce": 1.0} | {f"hybrid {s:.1f}": s for s in SHARES}
    want = host.view(rows, args.tp * frag)[:, :frag].reshape(-1)
    for name, share in variants.items():
        dev.zero_()
        issue(share)
        torch.cuda.synchronize()
        assert torch.equal(dev.cpu(), want), f"{name}: bytes differ"
        # A gate long enough for every 2-D copy to be queued behind it (a few µs each).
        copies = -(-int(rows * share) // args.run) if args.run else 1
        times = [
            gated_gpu_seconds(functools.partial(issue, share), [sm_stream, ce_stream],
                              spin_cycles=3_000_000 + 40_000 * copies)
            for _ in range(args.reps)
        ]  # fmt: skip
        gbps = nbytes / statistics.median(times) / 1e9
        print(f"frag {frag:5d}  {name:11s} {gbps:6.1f} GB/s  {100 * gbps / ceil['h2d']:5.1f} %",
              flush=True)  # fmt: skip


def main() -> int:
    ap = parser(__doc__, json=False, reps=9)
    ap.add_argument("--frag", default="512,1024,2048", help="fragment bytes, comma-separated")
    ap.add_argument("--tp", type=int, default=2, help="ranks whose fragments share a row")
    ap.add_argument("--mib", type=int, default=32, help="MiB of this rank's fragments")
    ap.add_argument("--ctas", type=int, default=16, help="the kernel's CTAs (the engine's: 16)")
    ap.add_argument("--run", type=int, default=0,
                    help="fragments per 2-D copy (a canonical CopyRun: a block's tokens, 16); "
                         "0: one copy for all")  # fmt: skip
    args = ap.parse_args()
    if not need_cuda("probe_hybrid.py"):
        return 1
    import torch

    ceil = ceiling()
    print(
        link_header(
            ceil,
            f"{args.mib} MiB of fragments, 1 in {args.tp}, {args.ctas} CTAs, "
            f"2-D copies of {args.run or 'all'} rows",
        )
    )
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    for frag in (int(f) for f in args.frag.split(",")):
        probe(frag, args, ceil, streams)
    print(f"ceiling again: {ceiling()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
