"""Probe of the staged block plan, before it is built into the core.

    python benches/probe_staged.py [--pages 4,8,16,32,64,256] [--layers 80] [--blocks 32]
                                   [--step-mib 16] [--min-steps 4] [--ctas 32] [--json out.json]

Separately allocated layer tensors (no block plan joins them: a 2-D copy may not span two
allocations), a block-major pinned CPU cache (a CPU block's pages, every layer, in one row), a
transfer of ``--blocks`` random GPU blocks to or from random CPU blocks. The staged plan moves a
block's host row across PCIe as one DMA into a device staging ring and moves its pages inside HBM
with one kernel launch per step, addresses computed in the kernel from the block ids and the
layers' bases:

* CPU->GPU: per step, ``cuMemcpyBatchAsync`` of the step's host rows into a ring slot (copy
  stream), then the scatter kernel from the slot into the layers (kernel stream, after the DMA);
* GPU->CPU: the gather kernel into a slot, then the DMA of the slot to the host rows.

Two slots: step ``s + 1``'s DMA overlaps step ``s``'s kernel; a slot is reused after the work
that read it. A transfer is cut into at least ``--min-steps`` steps of at most ``--step-mib``
(whole blocks); the kernel runs ``--ctas`` programs over tiles of pages. Measured beside the link's ceiling (one
256 MiB pinned copy, best of 5) and beside the per-page route blockswap runs today for this
layout (its copy kernel on 16 CTAs over one descriptor per page): "isolated" is one transfer's
GPU time (events from the first DMA or kernel to the last), "8 queued" eight transfers back to
back; and a bf16 8192^3 GEMM's time alone and beside continuous staged onloads (does the scatter
kernel's brief use of SMs slow the model?). Python issues every step here, so host time is not
the plan's: the core would issue the same calls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from blockswap_bench.cli import need_cuda, parser
from blockswap_bench.common import gated_gpu_seconds
from blockswap_bench.kvblocks import ceiling, link_header, write_figures

KiB = 1024
CTAS = 32  # programs of the scatter / gather kernel (--ctas)


@triton.jit
def _staged_kernel(
    ring,  # int64 pointer: the slot, block-major (block j's page of layer l at (j*L + l)*PAGE)
    bases,  # int64[L]: each layer tensor's address
    ids,  # int64[n]: the step's GPU block ids
    n_pages,  # n * L
    L: tl.constexpr,
    PAGE: tl.constexpr,  # bytes, a multiple of 8
    STRIDE: tl.constexpr,  # bytes between blocks in a layer tensor
    TO_LAYERS: tl.constexpr,  # True: scatter (ring -> layers), False: gather
    CHUNK: tl.constexpr,  # int64 words per page per load
    ROWS: tl.constexpr,  # pages per tile
):
    """A persistent loop over tiles of ROWS pages x CHUNK words: page addresses computed from
    the block ids and the layers' bases, many loads in flight per program."""
    words = PAGE // 8
    cols = tl.arange(0, CHUNK)
    for t in range(tl.program_id(0), tl.cdiv(n_pages, ROWS), tl.num_programs(0)):
        rows = t * ROWS + tl.arange(0, ROWS)
        live = rows < n_pages
        j = rows // L
        layer = rows - j * L
        block = tl.load(ids + j, mask=live, other=0)
        base = tl.load(bases + layer, mask=live, other=0)
        page_ptr = (base + block * STRIDE).to(tl.pointer_type(tl.int64))
        ring_ptr = ring + rows.to(tl.int64) * words
        for start in range(0, words, CHUNK):
            idx = start + cols
            m = live[:, None] & (idx[None, :] < words)
            if TO_LAYERS:
                x = tl.load(ring_ptr[:, None] + idx[None, :], mask=m)
                tl.store(page_ptr[:, None] + idx[None, :], x, mask=m)
            else:
                x = tl.load(page_ptr[:, None] + idx[None, :], mask=m)
                tl.store(ring_ptr[:, None] + idx[None, :], x, mask=m)


class Staged:
    def __init__(
        self,
        layers: list[torch.Tensor],
        host: torch.Tensor,
        step_bytes: int,
        ctas: int,
        min_steps: int,
    ) -> None:
        from cuda.bindings import driver

        self.ctas = ctas
        self.driver = driver
        self.layers = layers
        self.L = len(layers)
        self.page = layers[0].shape[1]
        self.stride = layers[0].stride(0)
        self.row = self.L * self.page
        self.host = host  # (cpu blocks, row) pinned
        self.step_bytes = step_bytes
        self.min_steps = min_steps
        self.per_step = max(1, step_bytes // self.row)
        self.slots = [
            torch.empty(self.per_step * self.row, dtype=torch.uint8, device="cuda")
            for _ in range(2)
        ]
        self.bases = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64, device="cuda")
        self.copy_s, self.kern_s = torch.cuda.Stream(), torch.cuda.Stream()
        # Per slot: the event after which it may be written again.
        self.free = [torch.cuda.Event() for _ in range(2)]
        for e in self.free:
            e.record(self.copy_s)
        self.k = 0  # steps issued (slot = k % 2)
        self.keep: list[torch.Tensor] = []  # pinned ids until their copy has run
        attr = driver.CUmemcpyAttributes()
        attr.srcAccessOrder = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        self.attr = attr

    def _dma(self, dst: list[int], src: list[int], stream: torch.cuda.Stream) -> None:
        d = self.driver
        n = len(dst)
        (err, *_) = d.cuMemcpyBatchAsync(
            [d.CUdeviceptr(x) for x in dst],
            [d.CUdeviceptr(x) for x in src],
            [self.row] * n,
            n,
            [self.attr],
            [0],
            1,
            d.CUstream(stream.cuda_stream),
        )
        assert err == d.CUresult.CUDA_SUCCESS, err

    def _kernel(self, slot: torch.Tensor, ids: torch.Tensor, to_layers: bool) -> None:
        n = ids.numel()
        chunk = min(self.page // 8, 1024)
        rows = max(1, 2048 // chunk)
        _staged_kernel[(min(self.ctas, -(-n * self.L // rows)),)](
            slot.view(torch.int64),
            self.bases,
            ids,
            n * self.L,
            L=self.L,
            PAGE=self.page,
            STRIDE=self.stride,
            TO_LAYERS=to_layers,
            CHUNK=chunk,
            ROWS=rows,
            num_warps=8,
        )

    def transfer(self, gpu_ids: np.ndarray, cpu_ids: np.ndarray, h2d: bool) -> None:
        """Issues one transfer (no wait)."""
        pinned = torch.from_numpy(gpu_ids.astype(np.int64)).pin_memory()
        with torch.cuda.stream(self.kern_s):  # the kernels read them on this stream
            ids_dev = pinned.to("cuda", non_blocking=True)
        self.keep.append(pinned)
        if len(self.keep) > 4096:
            self.sync()
            self.keep.clear()
        rows = self.host.data_ptr() + cpu_ids.astype(np.int64) * self.row
        per = min(self.per_step, max(1, -(-len(gpu_ids) // self.min_steps)))
        for s in range(0, len(gpu_ids), per):
            slot_i = self.k % 2
            slot = self.slots[slot_i]
            self.k += 1
            n = min(per, len(gpu_ids) - s)
            ring = [slot.data_ptr() + j * self.row for j in range(n)]
            host = [int(x) for x in rows[s : s + n]]
            ids = ids_dev[s : s + n]
            done = torch.cuda.Event()
            if h2d:
                self.copy_s.wait_event(self.free[slot_i])
                self._dma(ring, host, self.copy_s)
                done.record(self.copy_s)
                self.kern_s.wait_event(done)
                with torch.cuda.stream(self.kern_s):
                    self._kernel(slot, ids, True)
                self.free[slot_i].record(self.kern_s)
            else:
                self.kern_s.wait_event(self.free[slot_i])
                with torch.cuda.stream(self.kern_s):
                    self._kernel(slot, ids, False)
                done.record(self.kern_s)
                self.copy_s.wait_event(done)
                self._dma(host, ring, self.copy_s)
                self.free[slot_i].record(self.copy_s)

    def sync(self) -> None:
        self.copy_s.synchronize()
        self.kern_s.synchronize()


def timed(issue: Any, sync: Any, starts: list[torch.cuda.Stream]) -> float:
    """GPU time of what ``issue`` queues on ``starts`` after ``sync()``: the streams wait behind
    a gate (a 5 ms spin on another stream) while Python issues, so the time is the GPU's, not
    Python's."""
    sync()
    return gated_gpu_seconds(issue, starts, 10_000_000)


def one_page(
    kib: int, args: argparse.Namespace, ceil: dict[str, float], rng: np.random.Generator,
    a: torch.Tensor, b: torch.Tensor, copy_blocks_raw: Any,
) -> list[dict[str, Any]]:  # fmt: skip
    n_gpu, n_cpu = 64, 64
    rows: list[dict[str, Any]] = []
    page = kib * KiB
    layers = [
        torch.randint(0, 255, (n_gpu, page), dtype=torch.uint8, device="cuda")
        for _ in range(args.layers)
    ]
    host = torch.randint(0, 255, (n_cpu, args.layers * page), dtype=torch.uint8).pin_memory()
    st = Staged(layers, host, args.step_mib << 20, args.ctas, args.min_steps)
    nbytes = args.blocks * args.layers * page
    kstream = torch.cuda.Stream()

    def pick() -> tuple[np.ndarray, np.ndarray]:
        return rng.permutation(n_gpu)[: args.blocks], rng.permutation(n_cpu)[: args.blocks]

    def exact(h2d: bool) -> bool:
        """One transfer, then every page of its blocks compared on both sides."""
        g, c = pick()
        st.transfer(g, c, h2d)
        st.sync()
        return all(
            torch.equal(layers[k][g].cpu(), host[c, k * page : (k + 1) * page])
            for k in range(args.layers)
        )

    exact_h2d, exact_d2h = exact(True), exact(False)

    def per_page(h2d: bool) -> Any:
        """Today's route for this layout: the copy kernel, one descriptor per page."""
        g, c = pick()
        src, dst = [], []
        for j in range(args.blocks):
            for k in range(args.layers):
                hp = host.data_ptr() + int(c[j]) * args.layers * page + k * page
                gp = layers[k].data_ptr() + int(g[j]) * page
                src.append(hp if h2d else gp)
                dst.append(gp if h2d else hp)
        s = torch.tensor(src, dtype=torch.int64, device="cuda")
        d = torch.tensor(dst, dtype=torch.int64, device="cuda")
        z = torch.full((len(src),), page, dtype=torch.int64, device="cuda")

        def run() -> None:
            copy_blocks_raw(
                s.data_ptr(), d.data_ptr(), z.data_ptr(), len(src),
                max_ctas=16, max_size=page, stream=kstream,
            )  # fmt: skip

        return run

    for h2d in (True, False):
        d = "h2d" if h2d else "d2h"
        iso = []
        for i in range(args.reps + 3):
            g, c = pick()
            t = timed(
                lambda g=g, c=c, h2d=h2d: st.transfer(g, c, h2d), st.sync, [st.copy_s, st.kern_s]
            )
            if i >= 3:
                iso.append(t)
        q = []
        for _ in range(3):
            specs = [pick() for _ in range(8)]
            q.append(
                timed(
                    lambda specs=specs, h2d=h2d: [st.transfer(g, c, h2d) for g, c in specs],
                    st.sync,
                    [st.copy_s, st.kern_s],
                )
            )
        pp_iso = []
        for i in range(args.reps + 3):
            run = per_page(h2d)
            t = timed(run, kstream.synchronize, [kstream])
            if i >= 3:
                pp_iso.append(t)
        runs = [per_page(h2d) for _ in range(8)]
        pp_q = timed(lambda runs=runs: [r() for r in runs], kstream.synchronize, [kstream])
        row = {
            "page_kib": kib,
            "direction": d,
            "ceiling_gbps": ceil[d],
            "staged_isolated_gbps": nbytes / statistics.median(iso) / 1e9,
            "staged_queued_gbps": 8 * nbytes / min(q) / 1e9,
            "per_page_kernel_isolated_gbps": nbytes / statistics.median(pp_iso) / 1e9,
            "per_page_kernel_queued_gbps": 8 * nbytes / pp_q / 1e9,
            "byte_exact": exact_h2d if h2d else exact_d2h,
        }
        rows.append(row)
        pct = {k: 100 * v / ceil[d] for k, v in row.items() if k.endswith("gbps")}
        print(f"{kib:>4} KiB {d}  staged {pct['staged_isolated_gbps']:5.1f} / "
              f"{pct['staged_queued_gbps']:5.1f} %   per-page kernel "
              f"{pct['per_page_kernel_isolated_gbps']:5.1f} / "
              f"{pct['per_page_kernel_queued_gbps']:5.1f} %   "
              f"{'byte-exact' if row['byte_exact'] else 'NOT EXACT'}")  # fmt: skip
    # The model's GEMM beside continuous staged onloads.
    gemm = torch.cuda.Stream()

    def gemms(n: int = 50) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(gemm):
            e0.record()
            for _ in range(n):
                torch.mm(a, b)
            e1.record()
        return e0, e1

    gemms(5)  # warm-up (cuBLAS's first call)
    torch.cuda.synchronize()
    e0, e1 = gemms()
    torch.cuda.synchronize()
    alone = e0.elapsed_time(e1)
    e0, e1 = gemms()  # again, now beside onloads queued for longer than the GEMMs take
    for _ in range(400):  # at most ~0.3 s of onloads queued
        if e1.query():
            break
        g, c = pick()
        st.transfer(g, c, True)
    torch.cuda.synchronize()
    beside = e0.elapsed_time(e1)
    rows[-1]["gemm_slowdown"] = beside / alone - 1
    print(f"         GEMM beside staged onloads: {100 * (beside / alone - 1):+.1f} %")
    return rows


def main() -> int:
    ap = parser(__doc__, reps=15)
    ap.add_argument("--pages", default="4,8,16,32,64,256", help="KiB")
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--step-mib", type=int, default=16)
    ap.add_argument("--ctas", type=int, default=CTAS, help="programs of the scatter kernel")
    ap.add_argument("--min-steps", type=int, default=4, help="steps a transfer is cut into")
    args = ap.parse_args()
    if not need_cuda("probe_staged"):
        return 1
    from blockswap.kernels.copy import copy_blocks_raw

    rng = np.random.default_rng(0)
    ceil = ceiling()
    print(link_header(ceil, f"{args.layers} separate layer tensors x {args.blocks} random "
                            f"blocks, steps of {args.step_mib} MiB"))  # fmt: skip
    rows: list[dict[str, Any]] = []
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for kib in (int(x) for x in args.pages.split(",")):
        rows += one_page(kib, args, ceil, rng, a, b, copy_blocks_raw)
        torch.cuda.empty_cache()
    if args.json:
        write_figures(args.json, "probe_staged.py", ceil, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
