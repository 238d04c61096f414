"""The vLLM worker's submission, host time only, per model and blocks per chunk: what
``submit_store`` and ``submit_load`` hold the caller, with vLLM's shared region as
``bench_vllm.py`` makes it. Per case, ``--reps`` transfers of ``--blocks`` random GPU blocks per
group into random chunks, each waited for before the next (``b2b``: the call right after the
previous result was seen) and, with ``slept``, one more after the caller slept ``--sleep-ms``
(its caches and core gone cold). Printed, not saved: the median µs per case and way, and which
entry the worker took (``one group``: the core's ``submit_group``; ``spec``: ``submit_spec``;
``general``: the Python cut of the spec); beside it the median µs of the engine's counters over
the same calls: ``core``, its submission under the lock (``submit_ns``), and ``check``, the part
of it that checks the ids and writes the plan (``prepare_ns``).

    python benches/probe_plugin_submit.py [--models llama-3.1-70b-tp4,qwen2.5-7b,gpt-oss-120b]
                                          [--bpc 1,4] [--reps 200] [--ways b2b,slept]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from blockswap_bench.cli import choices, int_list, need_cuda, parser

WAYS = ("b2b", "slept")


def main() -> int:
    ap = parser(__doc__, json=False, reps=200, reps_help="transfers per case and direction")
    ap.add_argument("--models", default="llama-3.1-70b-tp4,qwen2.5-7b,gpt-oss-120b")
    ap.add_argument("--bpc", type=int_list, default=[1, 4], help="blocks per chunk (1,4)")
    ap.add_argument("--blocks", type=int, default=32, help="GPU blocks per group per transfer")
    ap.add_argument("--sleep-ms", type=float, default=20.0)
    ap.add_argument("--ways", type=choices(WAYS), default=list(WAYS))
    args = ap.parse_args()
    if not need_cuda("probe_plugin_submit"):
        return 1
    import numpy as np
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    import bench_vllm as bv
    from blockswap_bench.models import MODELS
    from blockswap_bench.plugin import CPUSpec

    keys = args.models.split(",")
    print(f"# python benches/probe_plugin_submit.py {' '.join(sys.argv[1:])}")
    print(
        f"{'model':22s} {'bpc':>3s} {'groups':>6s} {'entry':>9s} {'dir':>4s} {'way':>6s} {'us':>7s}"
        f" {'core':>7s} {'check':>7s}"
    )
    for m in (m for m in MODELS if m.key in keys):
        for bpc in args.bpc:
            case = bv.Case(m, False, bpc)
            w = bv.make_worker(case, "region")
            engine = w.handlers[0].engine
            entry = (
                "one group"
                if w._one_group
                else "spec"
                if getattr(w, "_spec_tables", None) is not None
                else "general"
            )
            rng = np.random.default_rng(0)
            job = 0
            try:
                for store in (True, False):
                    times: dict[str, list[tuple[float, int, int]]] = {way: [] for way in args.ways}
                    for i in range(args.reps + 10):
                        for way in args.ways:
                            ids, chunks = case.spec(rng, args.blocks)
                            gpu = GPULoadStoreSpec(
                                [b for g in ids for b in g], [len(g) for g in ids], [0] * len(ids)
                            )
                            cpu = CPUSpec(chunks)
                            job += 1
                            if way == "slept":
                                time.sleep(args.sleep_ms / 1e3)
                            s0 = engine.stats()
                            t0 = time.perf_counter()
                            ok = (
                                w.submit_store(job, gpu, cpu)
                                if store
                                else w.submit_load(job, cpu, gpu)
                            )
                            t = time.perf_counter() - t0
                            s1 = engine.stats()
                            assert ok
                            w.wait({job})
                            assert all(r.success for r in w.get_finished())
                            if i >= 10:  # the first calls warm the path
                                core = s1["submit_ns"] - s0["submit_ns"]
                                times[way].append((t, core, s1["prepare_ns"] - s0["prepare_ns"]))
                    for way, ts in times.items():
                        wall, core, check = (statistics.median(c) for c in zip(*ts))
                        print(
                            f"{m.name:22s} {bpc:>3d} {len(ids):>6d} {entry:>9s} "
                            f"{'d2h' if store else 'h2d':>4s} {way:>6s} "
                            f"{1e6 * wall:7.1f} {core / 1e3:7.1f} {check / 1e3:7.1f}",
                            flush=True,
                        )
            finally:
                w.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
