"""vLLM's canonical layout through the plug-in, against vLLM's own canonical path, same GPU, same run.

    python benches/bench_canonical.py [--blocks 32] [--reps 9] [--tp 2] [--models ...]
                                      [--option KEY=VALUE ...] [--json out.json]

Needs a GPU, vLLM's Python sources on the path and cuda-bindings.

Per ``kv_split`` model of the benchmark catalogue (``blockswap_bench.models``), rank 0 of a
deployment at tensor parallelism ``--tp``: per-layer tensors of ``(blocks, page)`` int8 (the
catalogue's heads per rank, K then V, token-major), each layer's reference carrying the
head-shard ``CanonicalPageMapping`` vLLM derives for it (a K and a V run of ``block_size``
fragments of ``heads x head_dim x 2`` bytes each, into a canonical page holding ``--tp`` times the
heads); the CPU tier in vLLM's shared region laid out canonically (``create_next_canonical_view``),
``blocks_per_chunk`` 1, each direction:

* ``blockswap``: :class:`blockswap.vllm.BlockswapOffloadingWorker` with ``canonical_layout=True``
  through ``submit_store`` / ``submit_load``, the route its handler picks (``--option``: a handler
  option, e.g. ``kernel_ctas=32``);
* ``vllm dma``: what vLLM's canonical path (``_fill_canonical_ops``) issues: one
  ``cuMemcpyBatchAsync`` over one descriptor per fragment, here through cuda-bindings;
* ``kernel alone``: the same descriptors by blockswap's copy kernel without the engine, one
  launch on the worker's CTAs with the descriptors in device memory: what the SMs move these
  fragments at (the route's own ceiling; the engine launches at most ``kernel_launch_bytes`` at
  a time and its kernel reads the descriptors from pinned host memory).

A transfer moves ``--blocks`` random GPU blocks (per KV-cache group) to or from random chunks; the
bytes counted are the rank's fragments (vLLM's ``transfer_size``). "isolated": GPU time of one
transfer (blockswap: its ``transfer_time``; vLLM's path: CUDA events around the call), median of
``--reps``; blockswap's "wall": submit to ``wait`` returning, median; "8 queued": 8 transfers back
to back, bytes over wall time, best of 3. Percent of the link's ceiling measured in the same run
(one 256 MiB pinned copy per direction, best of 5).
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_dma import cuda_bindings_batch
from blockswap.routing import KERNEL_BLOCK_BYTES
from blockswap_bench.cli import need_cuda, option, parser
from blockswap_bench.kvblocks import ceiling, link_header, write_figures
from blockswap_bench.models import MODELS, KVModel
from blockswap_bench.plugin import time_calls, time_worker

N_GPU = 256
N_CHUNKS = 128


class Case:
    """One model's per-layer caches of rank 0 at ``tp``, their head-shard mappings and the
    canonical region (its views as the worker makes them)."""

    def __init__(self, m: KVModel, tp: int, device: str = "cuda") -> None:
        from vllm.v1.kv_offload.base import (
            CanonicalKVCacheRef,
            CanonicalKVCaches,
            CanonicalKVCacheTensor,
            CanonicalPageMapping,
            CopyRun,
        )
        from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

        self.m, self.tp = m, tp
        frag = m.kv_heads * m.head_dim * m.dtype_bytes  # a token's heads on this rank
        row = frag * tp  # a token's heads in the canonical page
        tokens = m.block_size
        self.page = 2 * tokens * frag
        self.canonical_page = 2 * tokens * row
        k = CopyRun(0, 0, frag, tokens, frag, row)
        v = CopyRun(tokens * frag, tokens * row, frag, tokens, frag, row)
        self.mapping = CanonicalPageMapping(self.canonical_page, self.page, (k, v), 1, 0, True)
        self.gpu = [
            torch.empty((N_GPU, self.page), dtype=torch.int8, device=device)
            for _ in range(m.layers)
        ]
        for t in self.gpu:
            t.random_(-128, 127)
        per = m.layers // m.groups
        self.refs = [
            [CanonicalKVCacheRef(i, self.page, self.mapping) for i in range(g * per, (g + 1) * per)]
            for g in range(m.groups)
        ]
        self.kv = CanonicalKVCaches(
            [CanonicalKVCacheTensor(t, self.page) for t in self.gpu], self.refs
        )
        align = SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT
        stride = -(-m.layers * self.canonical_page // align) * align
        self.region_args = {
            "num_chunks": N_CHUNKS,
            "rank": 0,
            "kv_bytes_per_chunk": stride,
            "cpu_page_size": stride // tp,
        }

    def region(self) -> Any:
        from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

        return SharedOffloadRegion(engine_id=str(uuid.uuid4()), **self.region_args)

    def spec(self, rng: np.random.Generator, blocks: int) -> tuple[list[list[int]], list[int]]:
        free = rng.permutation(N_GPU).tolist()
        ids = [free[g * blocks : (g + 1) * blocks] for g in range(len(self.refs))]
        return ids, rng.permutation(N_CHUNKS)[: blocks * len(ids)].tolist()

    def nbytes(self, blocks: int) -> int:
        return blocks * self.m.layers * self.page

    def descriptors(
        self, views: list[torch.Tensor], ids: list[list[int]], chunks: list[int], to_cpu: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """vLLM's canonical descriptors: one per (layer, block, run, fragment)."""
        src, dst = [], []
        c0 = 0
        for gids, refs in zip(ids, self.refs):
            g_ids = np.asarray(gids, dtype=np.int64)
            rows = np.asarray(chunks[c0 : c0 + len(gids)], dtype=np.int64)
            c0 += len(gids)
            for r in refs:
                view = views[r.tensor_idx]
                g_base = self.gpu[r.tensor_idx].data_ptr() + g_ids * self.page
                c_base = view.data_ptr() + rows * view.stride(0)
                for run in self.mapping.runs:
                    i = np.arange(run.num_fragments, dtype=np.int64)
                    g = (g_base[:, None] + run.local_offset + i * run.local_stride).ravel()
                    c = (c_base[:, None] + run.canonical_offset + i * run.canonical_stride).ravel()
                    src.append(g if to_cpu else c)
                    dst.append(c if to_cpu else g)
        s, d = np.concatenate(src), np.concatenate(dst)
        frag = self.mapping.runs[0].fragment_size
        return s, d, np.full(len(s), frag, dtype=np.int64)


def measure_vllm(
    case: Case,
    to_cpu: bool,
    blocks: int,
    reps: int,
    rng: np.random.Generator,
    kernel_ctas: int | None = None,
) -> dict[str, float]:
    """vLLM's canonical DMA path over a canonical region of its own (pinned as vLLM pins it);
    with ``kernel_ctas``, the same descriptors by blockswap's copy kernel alone instead, one
    launch on that many CTAs, descriptors in device memory: what the SMs move these fragments
    at with no engine around them (no launch boundary, no descriptor read over PCIe)."""
    region = case.region()
    views = [region.create_next_canonical_view(case.canonical_page) for _ in case.gpu]
    base, total = region.base_tensor.data_ptr(), region.total_size_bytes
    from blockswap import _core

    _core.cuda_pin(base, total, torch.cuda.current_device())
    stream = torch.cuda.Stream()
    prepare = cuda_bindings_batch() if kernel_ctas is None else kernel_alone(kernel_ctas)
    try:

        def call() -> Callable[[], None]:
            ids, chunks = case.spec(rng, blocks)
            return prepare(*case.descriptors(views, ids, chunks, to_cpu), False, stream)  # type: ignore[misc]

        return time_calls(stream, call, case.nbytes(blocks), reps)
    finally:
        torch.cuda.synchronize()
        _core.cuda_unpin(base, torch.cuda.current_device())
        views.clear()
        region.cleanup()


def kernel_alone(ctas: int) -> Callable[..., Callable[[], None]]:
    """``prepare(src, dst, sizes, _, stream)`` for :func:`time_calls`: the descriptors copied to
    the device once, then one launch of the copy kernel over all of them (as the engine's
    kernel route launches it: 32 KiB steps, the fragment size as ``max_size``)."""
    from blockswap.kernels import copy_blocks

    def prepare(
        src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, _: bool, stream: Any
    ) -> Callable[[], None]:
        cols = [torch.from_numpy(a).to("cuda") for a in (src, dst, sizes)]
        size = int(sizes.max())

        def issue() -> None:
            copy_blocks(*cols, max_ctas=ctas, block_bytes=KERNEL_BLOCK_BYTES, stream=stream,
                        max_size=size, alignment=16, check_values=False)  # fmt: skip

        return issue

    return prepare


def measure_vllm_or_none(
    case: Case, to_cpu: bool, blocks: int, reps: int, rng: np.random.Generator
) -> dict[str, float] | None:
    """:func:`measure_vllm`, or None where the driver refuses the batch (printed)."""
    try:
        return measure_vllm(case, to_cpu, blocks, reps, rng)
    except RuntimeError as e:
        print(f"# vllm dma, {case.m.name}: {e}", flush=True)
        return None


def measure_worker(
    case: Case,
    to_cpu: bool,
    blocks: int,
    reps: int,
    rng: np.random.Generator,
    options: dict[str, Any],
) -> tuple[dict[str, float], str]:
    from blockswap.vllm import BlockswapOffloadingWorker

    w = BlockswapOffloadingWorker(
        case.kv,
        1,
        N_CHUNKS,
        mmap_region=case.region(),
        canonical_layout=True,
        backend="cuda",
        **options,
    )  # the worker owns the region from here, and releases it at shutdown
    try:
        return time_worker(w, lambda: case.spec(rng, blocks), to_cpu, case.nbytes(blocks), reps)
    finally:
        w.shutdown()


def main() -> int:
    ap = parser(__doc__, reps=9)
    ap.add_argument("--blocks", type=int, default=32, help="GPU blocks per group per transfer")
    ap.add_argument("--tp", type=int, default=2, help="tensor parallelism of the deployment")
    ap.add_argument("--models", default=",".join(m.key for m in MODELS if m.layout == "kv_split"))
    ap.add_argument("--option", action="append", default=[], type=option, metavar="KEY=VALUE",
                    help="a handler option for blockswap's worker (repeatable)")  # fmt: skip
    args = ap.parse_args()
    if not need_cuda("bench_canonical"):
        return 1
    if cuda_bindings_batch() is None:
        print("bench_canonical: needs cuda-bindings (vLLM's DMA path)", file=sys.stderr)
        return 1
    options = dict(args.option)
    rng = np.random.default_rng(0)
    ceil = ceiling()
    print(link_header(ceil, f"rank 0 of TP={args.tp}, {args.blocks} random blocks per group; "
                            "isolated/queued %, blockswap's wall clock isolated %"))  # fmt: skip
    print(f"{'model':<20} {'page':>7} {'frag':>6} {'dir':>4} {'blockswap':>13} {'wall':>6} "
          f"{'kernel alone':>13} {'vllm dma':>13}  route")  # fmt: skip
    rows = []
    wanted = set(args.models.split(","))
    for m in (m for m in MODELS if m.key in wanted and m.layout == "kv_split"):
        case = Case(m, args.tp)
        frag = case.mapping.runs[0].fragment_size
        for to_cpu in (True, False):
            d = "d2h" if to_cpu else "h2d"
            bs, route = measure_worker(case, to_cpu, args.blocks, args.reps, rng, options)
            dma = measure_vllm_or_none(case, to_cpu, args.blocks, args.reps, rng)
            ctas = int(options.get("kernel_ctas", 16))
            alone = measure_vllm(case, to_cpu, args.blocks, args.reps, rng, kernel_ctas=ctas)
            rows.append({
                "model": m.name, "tp": args.tp, "page_bytes": case.page, "fragment_bytes": frag,
                "direction": d, "ceiling_gbps": ceil[d], "blockswap": bs,
                "blockswap_route": route, "vllm_dma": dma, "kernel_alone": alone,
                "kernel_alone_ctas": ctas,
            })  # fmt: skip

            def pct(r: dict[str, float] | None, d: str = d) -> str:
                if r is None:
                    return f"{'-':>13}"
                i, q = (100 * r[k] / ceil[d] for k in ("isolated_gbps", "queued_gbps"))
                return f"{i:>5.1f}/{q:>5.1f} %"

            print(f"{m.name[:20]:<20} {case.page // 1024:>5}Ki {frag:>6} {d:>4} {pct(bs)} "
                  f"{100 * bs['wall_gbps'] / ceil[d]:>5.1f}% {pct(alone)} {pct(dma)}  "
                  f"{route[:50]}")  # fmt: skip
        del case
        torch.cuda.empty_cache()
    if args.json:
        write_figures(
            args.json, "bench_canonical.py", ceil, rows, blocks=args.blocks, tp=args.tp,
            options=options,
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
