"""Canonical-layout fragments by SMs, addressed two ways, without the engine: a descriptor per
fragment (the kernel route today: ``(src, dst, size)`` columns in pinned host memory, read by the
kernel over the link, or copied to the device first), against the staged kernel run straight
over the host region ("direct": a word per block and one geometry per group, every fragment's two
addresses computed on the GPU, the other ranks' fragments as holes), its entries in pinned host
memory or on the device. Beside them one copy of the same bytes and the link's ceiling, in the
same run.

Rank 0 of ``--tp``, per-layer tensors, the canonical region as vLLM lays it (a chunk's cell holds
each layer's canonical page; a token's heads of every rank side by side), ``--blocks`` random
blocks and chunks, one launch of ``--ctas`` CTAs over the whole transfer. GPU time by CUDA
events behind a spin gate (no host time in it), median of ``--reps``: one transfer ("isolated")
and 8 back to back ("queued"), % of the link.

Variants with a size ("8M", "16M", "32M") launch the direct kernel over that many bytes of
the transfer at a time, as the engine's ``kernel_launch_bytes`` does; "2s" alternates two
streams; "pdl" chains the launches as the engine does (the staged kernel built with ``CHAINED``,
launched with programmatic dependent launch: each launch may start while the one before ends).
With ``--gemm``, instead of bandwidth: how much a bf16 8192^3 GEMM on another stream slows
beside continuous CPU->GPU transfers of each variant (the GEMM alone measured right before each).

    python benches/probe_direct.py [--models llama-3.1-70b-tp4,qwen2.5-7b] [--tp 2] [--reps 9]
                                   [--variants "one copy,direct dev 8M,direct dev 8M pdl"] [--gemm]

Printed, not saved.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from blockswap_bench.cli import need_cuda, parser
from blockswap_bench.common import gated_gpu_seconds
from blockswap_bench.kvblocks import ceiling, link_header
from blockswap_bench.models import MODELS

N_GPU = 256
N_CHUNKS = 128
QUEUED = 8
VARIANTS = ("one copy", "desc host", "desc host 8M", "desc host 8M 2s", "desc dev", "direct host",
            "direct dev", "direct dev 8M", "direct dev 8M 2s", "direct dev 8M pdl",
            "direct dev 16M", "direct dev 32M")  # fmt: skip
LAUNCH = 8 << 20  # the engine's kernel_launch_bytes


class Canonical:
    """One model's per-layer GPU pages of rank 0 and a canonical region, as flat arrays."""

    def __init__(self, m: Any, tp: int, blocks: int, rng: np.random.Generator) -> None:
        import torch

        frag = m.kv_heads * m.head_dim * m.dtype_bytes
        row, tokens = frag * tp, m.block_size
        self.frag, self.page, cpage = frag, 2 * tokens * frag, 2 * tokens * row
        self.gpu = [torch.empty((N_GPU, self.page), dtype=torch.int8, device="cuda")
                    for _ in range(m.layers)]  # fmt: skip
        self.stride = m.layers * cpage
        self.host = torch.empty(N_CHUNKS * self.stride, dtype=torch.int8, pin_memory=True)
        self.ids = rng.permutation(N_GPU)[:blocks].astype(np.int64)
        chunks = rng.permutation(N_CHUNKS)[:blocks].astype(np.int64)
        self.cells = self.host.data_ptr() + chunks * self.stride
        # Geometry in the cell's order: each fragment of rank 0, then the others' (a hole).
        bases, offsets = [], []
        for layer, t in enumerate(self.gpu):
            for run in range(2):
                for tok in range(tokens):
                    bases += [t.data_ptr() + run * tokens * frag + tok * frag, 0]
                    off = layer * cpage + run * tokens * row + tok * row
                    offsets += [off, off + frag]
        self.bases = np.asarray(bases, dtype=np.int64)
        self.strides = np.where(self.bases != 0, self.page, 0).astype(np.int64)
        self.offsets = np.asarray([*offsets, self.stride], dtype=np.int64)
        self.nbytes = blocks * m.layers * self.page
        real = self.bases != 0
        g = (self.bases[real][None, :] + self.ids[:, None] * self.page).ravel()
        c = (self.cells[:, None] + self.offsets[:-1][real][None, :]).ravel()
        self.g, self.c = g, c

    def variants(
        self, to_cpu: bool, streams: list[Any], ctas: int, block_bytes: int
    ) -> dict[str, Any]:
        import torch

        from blockswap._core import launch_plan
        from blockswap.kernels import copy_blocks_raw
        from blockswap.kernels.staged import _copy_staged_kernel, copy_staged_raw

        def cols(arrays: list[np.ndarray], device: str) -> list[torch.Tensor]:
            out = [torch.from_numpy(a) for a in arrays]
            return [t.pin_memory() if device == "host" else t.to("cuda") for t in out]

        turn = [0]

        def next_stream(lanes: int) -> Any:
            turn[0] += 1
            return streams[turn[0] % lanes]

        src, dst = (self.g, self.c) if to_cpu else (self.c, self.g)
        sizes = np.full(len(src), self.frag, dtype=np.int64)
        plain = torch.empty(self.nbytes, dtype=torch.int8, pin_memory=True)
        dev = torch.empty(self.nbytes, dtype=torch.int8, device="cuda")
        self.keep = [plain, dev]
        out: dict[str, Any] = {
            "one copy": (lambda: plain.copy_(dev, non_blocking=True)) if to_cpu
            else (lambda: dev.copy_(plain, non_blocking=True))
        }  # fmt: skip
        for where in ("host", "dev"):
            s, d, n = cols([src, dst, sizes], where)
            ids, rings, bases, strides, offsets = cols(
                [self.ids, self.cells, self.bases, self.strides, self.offsets], where
            )
            self.keep += [s, d, n, ids, rings, bases, strides, offsets]

            def desc(
                s: Any = s, d: Any = d, n: Any = n, per: int = len(src), lanes: int = 1
            ) -> None:
                for i in range(0, len(src), per):
                    with torch.cuda.stream(next_stream(lanes)):
                        copy_blocks_raw(s.data_ptr() + 8 * i, d.data_ptr() + 8 * i,
                                        n.data_ptr() + 8 * i, min(per, len(src) - i),
                                        max_ctas=ctas, max_size=self.frag,
                                        block_bytes=block_bytes)  # fmt: skip

            def direct(a: tuple[Any, ...] = (ids, rings, bases, strides, offsets),
                       per: int = len(self.ids), lanes: int = 1, pdl: bool = False) -> None:  # fmt: skip
                i0, r0, b, st, o = (t.data_ptr() for t in a)
                for i in range(0, len(self.ids), per):
                    n = min(per, len(self.ids) - i)
                    with torch.cuda.stream(next_stream(lanes)):
                        if not pdl:
                            copy_staged_raw(i0 + 8 * i, r0 + 8 * i, b, st, o, n,
                                            len(self.bases), 0, not to_cpu, max_size=self.frag,
                                            max_ctas=ctas, block_bytes=block_bytes)  # fmt: skip
                            continue
                        _, _, rows, row_bytes = launch_plan(1 << 20, ctas, block_bytes, self.frag)
                        grid = max(1, min(ctas, -(-n * len(self.bases) // rows)))
                        # The engine's chained launches: programmatic dependent launch.
                        _copy_staged_kernel[(grid,)](i0 + 8 * i, r0 + 8 * i, b, st, o, n,
                                                     len(self.bases), 0, int(not to_cpu),
                                                     ALIGNED16=False, ROWS=rows,
                                                     BLOCK_BYTES=row_bytes, CHAINED=True,
                                                     num_warps=4, launch_pdl=True)  # fmt: skip

            out[f"desc {where}"], out[f"direct {where}"] = desc, direct
            per_block = max(1, LAUNCH // (self.nbytes // len(self.ids)))
            for lanes, tag in ((1, ""), (2, " 2s")):
                out[f"desc {where} 8M{tag}"] = functools.partial(
                    desc, per=LAUNCH // self.frag, lanes=lanes
                )
                out[f"direct {where} 8M{tag}"] = functools.partial(
                    direct, per=per_block, lanes=lanes
                )
            out[f"direct {where} 8M pdl"] = functools.partial(direct, per=per_block, pdl=True)
            for mib in (16, 32):
                out[f"direct {where} {mib}M"] = functools.partial(
                    direct, per=max(1, (mib << 20) // (self.nbytes // len(self.ids)))
                )
        return out


def main() -> int:
    ap = parser(__doc__, json=False, reps=9)
    ap.add_argument("--models", default="llama-3.1-70b-tp4,qwen2.5-7b,llama-3.1-8b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--ctas", type=int, default=16)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="the variants to run, comma-separated (default: all)")  # fmt: skip
    ap.add_argument("--gemm", action="store_true",
                    help="instead: a bf16 8192^3 GEMM's slowdown beside CPU->GPU transfers")  # fmt: skip
    args = ap.parse_args()
    variants = [v for v in VARIANTS if v in args.variants.split(",")]
    if not need_cuda("probe_direct"):
        return 1
    import torch

    from blockswap.routing import KERNEL_BLOCK_BYTES

    ceil = ceiling()
    print(link_header(ceil, f"rank 0 of TP={args.tp}, {args.blocks} blocks, {args.ctas} CTAs"))
    print(f"{'model':<20} {'dir':<4} {'MiB':>5} " + " ".join(f"{v:>17}" for v in variants))
    print(f"{'':<20} {'':<4} {'':>5} " + " ".join(f"{'isol./queued':>17}" for _ in variants))
    rng = np.random.default_rng(0)
    keys = {m.key: m for m in MODELS}
    for key in args.models.split(","):
        case = Canonical(keys[key], args.tp, args.blocks, rng)
        for d in ("d2h", "h2d"):
            to_cpu = d == "d2h"
            streams = [torch.cuda.Stream(), torch.cuda.Stream()]
            stream = streams[0]
            fns = case.variants(to_cpu, streams, args.ctas, KERNEL_BLOCK_BYTES)
            verify(case, fns, to_cpu, stream, variants)
            if args.gemm:
                if not to_cpu:
                    slow = gemm_slowdown(fns, variants, stream, args.reps, case.nbytes)
                    print(f"{key:<20} GEMM slowdown beside {d}: "
                          + ", ".join(f"{v} {x:+.1f} %" for v, x in slow.items()), flush=True)  # fmt: skip
                continue
            cells = []
            for name in variants:
                fn = fns[name]
                res = []
                for count in (1, QUEUED):

                    def issue(fn: Any = fn, count: int = count, stream: Any = stream) -> None:
                        with torch.cuda.stream(stream):
                            for _ in range(count):
                                fn()

                    issue()  # compile, warm
                    ts = [gated_gpu_seconds(issue, streams) for _ in range(args.reps)]
                    gbps = count * case.nbytes / statistics.median(ts) / 1e9
                    res.append(100 * gbps / ceil[d])
                cells.append(f"{res[0]:>8.1f}/{res[1]:<8.1f}")
            print(f"{key:<20} {d:<4} {case.nbytes / 2**20:>5.1f} " + " ".join(cells), flush=True)
    return 0


def gemm_slowdown(
    fns: dict[str, Any], variants: list[str], stream: Any, reps: int, nbytes: int
) -> dict[str, float]:
    """Per variant, how much longer a bf16 8192^3 GEMM on a stream of its own takes (median of
    ``reps``) while that variant's transfers, queued first to outlast the GEMMs, run on
    ``stream``; % against the GEMM alone."""
    import torch

    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    compute = torch.cuda.Stream()

    def gemm_ms() -> float:
        times = []
        with torch.cuda.stream(compute):
            for _ in range(reps):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                a @ b
                e1.record()
                times.append((e0, e1))
        compute.synchronize()
        return statistics.median(e0.elapsed_time(e1) for e0, e1 in times)

    gemm_ms()  # warm
    out = {}
    for name in variants:
        # The GEMM alone right before each variant: its clocks drift over a run.
        alone = gemm_ms()
        # Transfers enough to outlast the GEMMs at ~50 GB/s, with a margin.
        count = max(8, int(2 * reps * alone * 1e-3 * 50e9 / nbytes))
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            for _ in range(count):
                fns[name]()
        beside = gemm_ms()
        torch.cuda.synchronize()
        out[name] = 100 * (beside / alone - 1)
    return out


def verify(
    case: Canonical, fns: dict[str, Any], to_cpu: bool, stream: Any, variants: list[str]
) -> None:
    """Each kernel variant moves exactly what the descriptors name (and nothing of the holes)."""
    import torch

    g, c = case.g, case.c
    frag = case.frag
    for name in (v for v in variants if v != "one copy"):
        for t in case.gpu:
            t.random_(-128, 127)
        case.host.random_(-128, 127)
        torch.cuda.synchronize()
        before_host = case.host.clone()
        before_gpu = [t.clone() for t in case.gpu]
        with torch.cuda.stream(stream):
            fns[name]()
        torch.cuda.synchronize()
        # Every fragment: destination equals source.
        host_base = case.host.data_ptr()
        hb = c - host_base
        ok = True
        for i in range(0, len(g), max(1, len(g) // 64)):
            off = int(hb[i])
            host_bytes = case.host[off : off + frag]
            ga = int(g[i])
            layer = next(j for j, t in enumerate(case.gpu)
                         if t.data_ptr() <= ga < t.data_ptr() + t.numel())  # fmt: skip
            lo = ga - case.gpu[layer].data_ptr()
            gpu_bytes = case.gpu[layer].view(-1)[lo : lo + frag].cpu()
            ok &= bool(torch.equal(host_bytes, gpu_bytes))
        # The holes on the host (other ranks' fragments) unchanged on a store; GPU pages of
        # blocks not moved unchanged on a load.
        if to_cpu:
            moved = np.zeros(case.host.numel(), dtype=bool)
            for off in hb:
                moved[off : off + frag] = True
            ok &= bool(torch.equal(case.host[~torch.from_numpy(moved)],
                                   before_host[~torch.from_numpy(moved)]))  # fmt: skip
        else:
            others = np.setdiff1d(np.arange(N_GPU), case.ids)
            ok &= all(torch.equal(t[others], b[others]) for t, b in zip(case.gpu, before_gpu))
        if not ok:
            raise SystemExit(f"{name} moved the wrong bytes ({'d2h' if to_cpu else 'h2d'})")


if __name__ == "__main__":
    sys.exit(main())
