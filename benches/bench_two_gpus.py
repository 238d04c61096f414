"""Two GPUs at once, as vLLM's tensor parallelism runs them: one offloading worker per device,
each in its own process, both moving at the same time.

    python benches/bench_two_gpus.py [--model llama-3.1-70b-tp4] [--blocks 32]
                                     [--path auto|staged|kernel|dma|blocks] [--option KEY=VALUE ...]
                                     [--json out.json]

Per device and per KV-cache layout (per-layer and cross-layer tensors, blocks_per_chunk 1),
each direction: the worker's bandwidth alone (the other process idle) and together (both
processes moving at once, started by one barrier), 8 transfers queued back to back, bytes over
wall time, best of 3; beside the link's ceiling per device, alone and together (4 pinned
copies of 256 MiB queued back to back, CUDA events, best of 3: ``blockswap_bench.kvblocks.
ceiling``), which tells whether the two GPUs share an upstream link. Every process first
checks a store and a load of random blocks byte for byte.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from blockswap_bench.cli import option, parser
from blockswap_bench.kvblocks import write_figures
from blockswap_bench.plugin import CPUSpec


def _bandwidth(issue: Any, wait: Any, nbytes: int) -> float:
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        tok = issue()
        wait(tok)
        best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def _turns(rank: int, barrier: Any, res: dict[str, Any], key: str, measure: Any) -> None:
    """``measure`` by each process alone (the other waiting), then by both at once."""
    for turn in (0, 1, None):
        barrier.wait()
        if turn is None or turn == rank:
            res[f"{key}_{'together' if turn is None else 'alone'}"] = measure()


def _layout(
    rank: int, barrier: Any, res: dict[str, Any], m: Any, layout: str, n_gpu: int,
    n_chunks: int, blocks: int, rng: np.random.Generator, path: str, options: dict[str, Any],
) -> None:  # fmt: skip
    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )

    from blockswap.vllm import BlockswapOffloadingWorker

    page = m.block_bytes(1)
    if layout == "cross-layer":
        ts = [torch.empty((n_gpu, m.layers * page), dtype=torch.int8, device="cuda")]
        refs = [[CanonicalKVCacheRef(0, m.layers * page)]]
    else:
        ts = [torch.empty((n_gpu, page), dtype=torch.int8, device="cuda") for _ in range(m.layers)]
        refs = [[CanonicalKVCacheRef(i, page) for i in range(m.layers)]]
    for t in ts:
        t.random_(-128, 127)
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(t, t.shape[1]) for t in ts], refs)
    w = BlockswapOffloadingWorker(kv, 1, n_chunks, backend="cuda", path=path, **options)
    nbytes = blocks * sum(r.page_size_bytes for r in refs[0])
    res[f"{layout}_routes"] = {d: r.reason for d, r in w.handlers[0].routes.items()}
    job = 0

    def submit(d: str) -> int:
        nonlocal job
        job += 1
        ids = rng.permutation(n_gpu)[:blocks].tolist()
        g, c = GPULoadStoreSpec(ids, [blocks], [0]), CPUSpec(rng.permutation(n_chunks)[:blocks])
        assert w.submit_store(job, g, c) if d == "d2h" else w.submit_load(job, c, g)
        return job

    try:
        # Byte-exact: store random blocks, load them back elsewhere.
        before = [t.clone() for t in ts]
        ids = rng.permutation(n_gpu)[: 2 * blocks].tolist()
        chunks = CPUSpec(rng.permutation(n_chunks)[:blocks])
        src, dst = ids[:blocks], ids[blocks:]
        assert w.submit_store(10**6, GPULoadStoreSpec(src, [blocks], [0]), chunks)
        w.wait({10**6})
        assert w.submit_load(10**6 + 1, chunks, GPULoadStoreSpec(dst, [blocks], [0]))
        w.wait({10**6 + 1})
        assert all(r.success for r in w.get_finished())
        torch.cuda.synchronize()
        p = refs[0][0].page_size_bytes
        res[f"{layout}_byte_exact"] = all(
            torch.equal(t[dst, :p], b[src, :p]) for t, b in zip(ts, before)
        )
        del before
        for d in ("d2h", "h2d"):
            for _ in range(3):  # warm-up
                w.wait({submit(d)})
            w.get_finished()

            def queued(d: str = d) -> float:
                bw = _bandwidth(lambda: {submit(d) for _ in range(8)}, w.wait, 8 * nbytes)
                assert all(r.success for r in w.get_finished())
                return bw

            _turns(rank, barrier, res, f"{layout}_{d}", queued)
    finally:
        w.shutdown()


def worker(rank: int, args: argparse.Namespace, barrier: Any, out: Any) -> None:
    import torch

    from blockswap_bench.kvblocks import LINK_BYTES, Copier, ceiling
    from blockswap_bench.models import MODELS

    torch.cuda.set_device(rank % torch.cuda.device_count())
    m = next(x for x in MODELS if x.key == args.model)
    rng = np.random.default_rng(rank)
    n_gpu, n_chunks, blocks = 256, 128, args.blocks
    res: dict[str, Any] = {"rank": rank, "gpu": torch.cuda.get_device_name(rank)}

    copier = Copier(LINK_BYTES, cuda=True)
    for d in ("h2d", "d2h"):
        # 4 copies queued per sample: long enough for the two processes' copies to overlap.
        one = {"reps": 3, "copier": copier, "directions": (d,), "copies": 4}
        _turns(rank, barrier, res, f"ceiling_{d}", lambda d=d, one=one: ceiling(**one)[d])
    del copier, one
    for layout in ("per-layer", "cross-layer"):
        _layout(rank, barrier, res, m, layout, n_gpu, n_chunks, blocks, rng, args.path,
                dict(args.option))  # fmt: skip
        torch.cuda.empty_cache()
    out.put(res)


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--model", default="llama-3.1-70b-tp4")
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--path", default="auto", help="the workers' copy path (default auto)")
    ap.add_argument("--option", action="append", default=[], type=option, metavar="KEY=VALUE",
                    help="a handler option for the workers (repeatable)")  # fmt: skip
    ap.add_argument(
        "--one-gpu",
        action="store_true",
        help="a check of this script where one GPU is all there is: both processes on it "
        "(its figures are not two GPUs')",
    )
    args = ap.parse_args()
    import torch

    if torch.cuda.device_count() < (1 if args.one_gpu else 2):
        print("bench_two_gpus: needs two GPUs (or --one-gpu)", file=sys.stderr)
        return 1
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2, timeout=180), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, barrier, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = sorted((out.get(timeout=500) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        print("bench_two_gpus: a worker process failed", file=sys.stderr)
        return 1
    print(f"# {results[0]['gpu']} x2; model {args.model}, {args.blocks} random blocks, "
          f"path={args.path}{''.join(f', {k}={v}' for k, v in args.option)}, 8 queued, GB/s "
          "(% of that GPU alone)")  # fmt: skip
    for layout in ("per-layer", "cross-layer"):
        print(f"# {layout} routes: {results[0][f'{layout}_routes']}")
    rows = []
    for what in ("ceiling", "per-layer", "cross-layer"):
        for d in ("h2d", "d2h"):
            r = [(x[f"{what}_{d}_alone"], x[f"{what}_{d}_together"]) for x in results]
            agg = sum(t for _, t in r)
            line = "  ".join(f"GPU{k}: {a:5.1f} alone, {t:5.1f} together ({100 * t / a:5.1f} %)"
                             for k, (a, t) in enumerate(r))  # fmt: skip
            exact = "" if what == "ceiling" else (
                "  byte-exact" if all(x[f"{what}_byte_exact"] for x in results) else "  NOT EXACT")  # fmt: skip
            print(f"{what:<11} {d}  {line}  aggregate {agg:5.1f}{exact}")
            rows.append({"what": what, "direction": d, "alone_together_gbps": r, "aggregate": agg})
    if args.json:
        write_figures(args.json, "bench_two_gpus.py", None, rows, processes=results)
    return (
        0 if all(x[f"{w}_byte_exact"] for x in results for w in ("per-layer", "cross-layer")) else 1
    )


if __name__ == "__main__":
    sys.exit(main())
