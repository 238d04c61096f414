"""The vLLM plug-in's worker against vLLM 0.33's own transfer paths, same GPU, same run.

    python benches/bench_vllm.py [--blocks 32] [--reps 15] [--models llama-3.1-8b,...]
                                 [--bpc 1,4] [--cache region|private] [--option KEY=VALUE ...]
                                 [--json out.json]

Needs a GPU, vLLM's Python sources on the path (``vllm/v1/kv_offload/cpu/swap_blocks_triton.py``
is run from its source; vLLM's compiled ops are not needed) and cuda-bindings.

Per model of the benchmark catalogue (``blockswap_bench.models``), in vLLM's canonical form (one
int8 tensor per layer of ``(num_blocks, page)``, K and V of a block one page; or one cross-layer
tensor whose page is every layer's), ``blocks_per_chunk`` 1 and 4 (``--bpc``), each direction:

* ``blockswap``: :class:`blockswap.vllm.BlockswapOffloadingWorker` through ``submit_store`` /
  ``submit_load``, the route its handler picks, its CPU cache in vLLM's ``SharedOffloadRegion``
  laid out as ``CPUOffloadingSpec`` lays it out on CUDA (``--cache region``, the default: what a
  vLLM user gets) or its own block-major cache (``--cache private``); ``--option``: a handler
  option for it (repeatable, as vLLM's ``kv_connector_extra_config`` would pass one);
* ``vllm dma``: what vLLM's ``CpuGpuOffloadingHandlers`` issues on its DMA path: one
  ``cuMemcpyBatchAsync`` over one descriptor per (layer, block) between the GPU tensors and a CPU
  cache that mirrors them (one pinned tensor per GPU tensor), here through cuda-bindings;
* ``vllm triton`` (CPU->GPU only, pages under 28 KiB, as vLLM picks it): vLLM's own Triton copy
  kernel (``_swap_blocks_kernel``, 12 CTAs) over the same descriptors;
* ``rows``: the floor of any plan with these random chunks, timed as vLLM's paths are (behind a
  gate, below): one copy
  per chunk of every byte the transfer moves in it (a row of the chunk's ``bpc`` pages of every
  tensor, contiguous as in vLLM's region cell; here in one pinned buffer of such rows) to or
  from one contiguous device buffer, one ``cuMemcpyBatchAsync``: the fewest copies across
  ``PCIe`` the chunks allow, and no page placed on the GPU.

A transfer moves ``--blocks`` random GPU blocks (per KV-cache group) to or from random CPU chunks.
"isolated": GPU time of one transfer, median of ``--reps`` (blockswap: its ``transfer_time``,
CUDA events the engine's thread records around its copies, the host's time between a staged
transfer's steps inside; vLLM's paths and the rows floor: their copies behind a gate, issued
while the stream waits, so none of their calls' host time is inside: their best case, see
``blockswap_bench.plugin``); blockswap's "wall": the same transfers' wall clock from
``submit_*`` to ``wait`` returning, median; "8 queued": 8 transfers back to back, bytes over
wall time from the first call to the last result, best of 3 rounds (every path). Copies read
their source in any order CPU -> GPU and in stream order GPU -> CPU, as vLLM's worker and
blockswap set it. vLLM's specs (blockswap) and descriptors (vLLM's paths) are built before the
clock starts. Percent of the link's ceiling measured in the same
run (one 256 MiB pinned copy per direction, best of 5) at its start and its end: the rows
printed as the run goes use the start's, the table printed at the end (and the JSON) the best of
both, so that a ceiling measured low once does not inflate every figure.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_dma import cuda_bindings_batch
from blockswap_bench.cli import int_list, need_cuda, option, parser
from blockswap_bench.kvblocks import Ceilings, link_header, write_figures
from blockswap_bench.models import MODELS, KVModel
from blockswap_bench.plugin import time_calls, time_worker

N_GPU = 256
N_CHUNKS = 128


@functools.cache
def vllm_triton() -> Any:
    """vLLM's ``swap_blocks_triton`` module, run from its source with its two vLLM imports
    replaced (same line count, so Triton reads the kernel's source where it is)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("bench_vllm: vLLM's Python sources are not on the path")
    path = os.path.join(
        spec.submodule_search_locations[0], "v1", "kv_offload", "cpu", "swap_blocks_triton.py"
    )
    with open(path) as f:
        src = f.read()
    src = src.replace("from vllm import _custom_ops as ops", "ops = None")
    src = src.replace(
        "from vllm.triton_utils import tl, triton",
        "import triton; import triton.language as tl  # noqa",
    )
    mod: dict[str, Any] = {"__name__": "vllm_swap_blocks_triton", "__file__": path}
    exec(compile(src, path, "exec"), mod)
    return mod


class Case:
    """One model's canonical KV caches on the GPU and the descriptors vLLM's handler would build
    for a transfer (its CPU cache: one pinned tensor per GPU tensor, ``bpc`` pages a row)."""

    def __init__(self, m: KVModel, cross_layer: bool, bpc: int) -> None:
        from vllm.v1.kv_offload.base import (
            CanonicalKVCacheRef,
            CanonicalKVCaches,
            CanonicalKVCacheTensor,
        )

        self.m, self.cross_layer, self.bpc = m, cross_layer, bpc
        page = m.block_bytes(1)
        if cross_layer:
            self.gpu = [torch.empty((N_GPU, m.layers * page), dtype=torch.int8, device="cuda")]
            refs = [[CanonicalKVCacheRef(0, m.layers * page)]]
        else:
            n_t = m.layers // m.groups
            self.gpu = [
                torch.empty((N_GPU, page), dtype=torch.int8, device="cuda") for _ in range(n_t)
            ]
            refs = [[CanonicalKVCacheRef(i, page) for i in range(n_t)] for _ in range(m.groups)]
        for t in self.gpu:
            t.random_(-128, 127)
        self.page = self.gpu[0].shape[1]
        self.kv = CanonicalKVCaches([CanonicalKVCacheTensor(t, self.page) for t in self.gpu], refs)
        self.refs = refs
        # vLLM's own CPU cache (pinned, a mirror of the GPU tensors), in one buffer that the
        # rows floor reads as N_CHUNKS rows of every tensor's bpc pages.
        self.host = torch.zeros(
            (len(self.gpu), N_CHUNKS, self.page * bpc), dtype=torch.int8, pin_memory=True
        )
        self.cpu = list(self.host)
        self.row = len(self.gpu) * self.page * bpc
        self.dev_rows: torch.Tensor | None = None

    def spec(self, rng: np.random.Generator, blocks: int) -> tuple[list[list[int]], list[int]]:
        """Per group ``blocks`` random GPU blocks, and the chunks they take (first index 0)."""
        free = rng.permutation(N_GPU).tolist()
        ids = [free[g * blocks : (g + 1) * blocks] for g in range(len(self.refs))]
        need = sum(-(-blocks // self.bpc) for _ in ids)
        return ids, rng.permutation(N_CHUNKS)[:need].tolist()

    def nbytes(self, blocks: int) -> int:
        return blocks * sum(r.page_size_bytes for g in self.refs for r in g)

    def rows(
        self, chunks: list[int], gpu_to_cpu: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The rows floor's descriptors (see the module): a chunk's row each, to or from
        consecutive rows of one device buffer."""
        n = len(chunks)
        if self.dev_rows is None or self.dev_rows.numel() < n * self.row:
            self.dev_rows = torch.empty(n * self.row, dtype=torch.int8, device="cuda")
        host = self.host.data_ptr() + np.asarray(chunks, dtype=np.int64) * self.row
        dev = self.dev_rows.data_ptr() + np.arange(n, dtype=np.int64) * self.row
        size = np.full(n, self.row, dtype=np.int64)
        return (dev, host, size) if gpu_to_cpu else (host, dev, size)

    def descriptors(
        self, ids: list[list[int]], chunks: list[int], gpu_to_cpu: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """vLLM's direct-layout descriptors: one per (group, ref, block)."""
        src, dst, size = [], [], []
        c0 = 0
        for gids, refs in zip(ids, self.refs):
            n = len(gids)
            subs = np.arange(n)
            rows = np.asarray(chunks[c0 : c0 + -(-n // self.bpc)])
            c0 += len(rows)
            for r in refs:
                g_addr = self.gpu[r.tensor_idx].data_ptr() + np.asarray(gids) * self.page
                cpu_sub = rows[subs // self.bpc] * self.bpc + subs % self.bpc
                c_addr = self.cpu[r.tensor_idx].data_ptr() + cpu_sub * self.page
                s, d = (g_addr, c_addr) if gpu_to_cpu else (c_addr, g_addr)
                src.append(s)
                dst.append(d)
                size.append(np.full(n, r.page_size_bytes))
        return (
            np.concatenate(src).astype(np.int64),
            np.concatenate(dst).astype(np.int64),
            np.concatenate(size).astype(np.int64),
        )


def measure_vllm(
    case: Case, path: str, gpu_to_cpu: bool, blocks: int, reps: int, rng: np.random.Generator
) -> dict[str, float]:
    """vLLM's DMA path (cuda-bindings' cuMemcpyBatchAsync), its Triton kernel or the rows
    floor (``path``: ``dma``, ``triton``, ``rows``)."""
    stream = torch.cuda.Stream()
    prepare = cuda_bindings_batch()
    tri = vllm_triton() if path == "triton" else None

    def call(gpu_to_cpu: bool = gpu_to_cpu) -> Callable[[], None]:
        ids, chunks = case.spec(rng, blocks)
        # Source access order "any" CPU -> GPU, "stream" GPU -> CPU, as vLLM 0.33's worker sets
        # it (gpu_worker.py: is_src_access_order_any = not gpu_to_cpu) and blockswap's default.
        any_order = not gpu_to_cpu
        if path == "rows":
            return prepare(*case.rows(chunks, gpu_to_cpu), any_order, stream)  # type: ignore[misc]
        s, d, z = case.descriptors(ids, chunks, gpu_to_cpu)
        if tri is None:
            return prepare(s, d, z, any_order, stream)  # type: ignore[misc]
        ts, td, tz = (torch.from_numpy(x).pin_memory() for x in (s, d, z))
        chunk = min(1 << (int(z.max()) - 1).bit_length(), 8192)
        return lambda: tri["swap_blocks_batch"](ts, td, tz, bytes_per_chunk=chunk)

    return time_calls(stream, call, case.nbytes(blocks), reps)


def make_worker(case: Case, cache: str, **options: Any) -> Any:
    """The plug-in's worker on CUDA for ``case``, its CPU cache in vLLM's region laid out as
    ``CPUOffloadingSpec`` lays it out for one rank (``cache="region"``) or its own; ``options``
    go to its handlers."""
    from blockswap.vllm import BlockswapOffloadingWorker

    region = None
    if cache == "region":
        from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

        # As CPUOffloadingSpec makes it on CUDA for one rank: a row per chunk, one cell of every
        # tensor's bpc pages, rounded up to the region's alignment.
        cell = sum(t.page_size_bytes for t in case.kv.tensors) * case.bpc
        align = SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT
        region = SharedOffloadRegion(
            engine_id=str(uuid.uuid4()),
            num_chunks=N_CHUNKS,
            rank=0,
            kv_bytes_per_chunk=-(-cell // align) * align,
            cpu_page_size=cell,
        )
    # The worker owns the region from here, and releases it at shutdown.
    return BlockswapOffloadingWorker(
        case.kv, case.bpc, N_CHUNKS, mmap_region=region, backend="cuda", **options
    )


def measure_worker(
    case: Case,
    gpu_to_cpu: bool,
    blocks: int,
    reps: int,
    rng: np.random.Generator,
    cache: str,
    options: dict[str, Any],
) -> tuple[dict[str, float], str]:
    w = make_worker(case, cache, **options)
    try:
        return time_worker(w, lambda: case.spec(rng, blocks), gpu_to_cpu, case.nbytes(blocks), reps)
    finally:
        w.shutdown()


def main() -> int:
    ap = parser(__doc__, reps=15)
    ap.add_argument("--blocks", type=int, default=32, help="GPU blocks per group per transfer")
    ap.add_argument("--models", default=",".join(m.key for m in MODELS))
    ap.add_argument("--cache", choices=("region", "private"), default="region",
                    help="the worker's CPU cache: vLLM's shared region (as on CUDA) or its own")  # fmt: skip
    ap.add_argument("--bpc", type=int_list, default=[1, 4], help="blocks per chunk (1,4)")
    ap.add_argument("--option", action="append", default=[], type=option, metavar="KEY=VALUE",
                    help="a handler option for blockswap's worker (repeatable)")  # fmt: skip
    args = ap.parse_args()
    if not need_cuda("bench_vllm"):
        return 1
    if cuda_bindings_batch() is None:
        print("bench_vllm: needs cuda-bindings (vLLM's DMA path)", file=sys.stderr)
        return 1
    options = dict(args.option)
    rng = np.random.default_rng(0)
    ceilings = Ceilings()
    ceil = ceilings.measure("start")
    print(link_header(ceil, f"{args.blocks} random blocks per group; blockswap's cache: "
                            f"{args.cache}{f', options {options}' if options else ''}; "
                            "isolated/queued %, blockswap's wall clock isolated %"))  # fmt: skip
    print(HEAD)
    rows = []
    wanted = set(args.models.split(","))
    for m in (m for m in MODELS if m.key in wanted):
        for cross_layer in (False, True):
            if cross_layer and m.groups > 1:
                continue  # a hybrid model's groups cannot share one cross-layer tensor
            for bpc in args.bpc:
                case = Case(m, cross_layer, bpc)
                for gpu_to_cpu in (True, False):
                    d = "d2h" if gpu_to_cpu else "h2d"
                    bs, route = measure_worker(
                        case, gpu_to_cpu, args.blocks, args.reps, rng, args.cache, options
                    )
                    floor = measure_vllm(case, "rows", gpu_to_cpu, args.blocks, args.reps, rng)
                    dma = measure_vllm(case, "dma", gpu_to_cpu, args.blocks, args.reps, rng)
                    tri = None
                    if not gpu_to_cpu and case.page < 28 * 1024 and case.page % 8 == 0:
                        tri = measure_vllm(case, "triton", False, args.blocks, args.reps, rng)
                    row = {
                        "model": m.name,
                        "tensors": "cross-layer" if cross_layer else "per-layer",
                        "blocks_per_chunk": bpc,
                        "page_bytes": case.page,
                        "direction": d,
                        "ceiling_gbps": ceil[d],
                        "blockswap": bs,
                        "blockswap_cache": args.cache,
                        "blockswap_options": options,
                        "blockswap_route": route,
                        "rows_floor": floor,
                        "vllm_dma": dma,
                        "vllm_triton": tri,
                    }
                    rows.append(row)
                    print(line(row, ceil[d]), flush=True)
                del case
                torch.cuda.empty_cache()
    ceilings.measure("end")
    best = ceilings.gbps
    print(f"\n# every row, % of the best ceiling of the run: {ceilings.describe()}")
    print(HEAD)
    for row in rows:
        row["ceiling_gbps"] = best[row["direction"]]
        print(line(row, row["ceiling_gbps"]))
    if args.json:
        write_figures(args.json, "bench_vllm.py", best, rows, ceilings=ceilings.measured,
                      best_from=ceilings.best_from())  # fmt: skip
    return 0


HEAD = (
    f"{'model':<20} {'tensors':<11} {'bpc':>3} {'page':>8} {'dir':>4} {'blockswap':>13} "
    f"{'wall':>6} {'host us':>7} {'rows':>13} {'vllm dma':>13} {'vllm triton':>13}  route"
)


def line(row: dict[str, Any], ceil: float) -> str:
    """A row of the table: each path's isolated / queued GB/s and blockswap's wall clock as % of
    ``ceil``, blockswap's host time and route."""

    def pct(r: dict[str, float] | None) -> str:
        if r is None:
            return f"{'-':>13}"
        i, q = (100 * r[k] / ceil for k in ("isolated_gbps", "queued_gbps"))
        return f"{i:>5.1f}/{q:>5.1f} %"

    bs = row["blockswap"]
    return (
        f"{row['model'][:20]:<20} {row['tensors']:<11} {row['blocks_per_chunk']:>3} "
        f"{row['page_bytes'] // 1024:>6}Ki {row['direction']:>4} {pct(bs)} "
        f"{100 * bs['wall_gbps'] / ceil:>5.1f}% {bs['host_us']:>7.0f} "
        f"{pct(row['rows_floor'])} {pct(row['vllm_dma'])} {pct(row['vllm_triton'])}  "
        f"{row['blockswap_route'][:60]}"
    )


if __name__ == "__main__":
    sys.exit(main())
