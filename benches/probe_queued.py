"""Where "8 queued" through the vLLM plug-in goes below the link: 8 transfers back to back on the
worker (vLLM's region, one block per chunk, per-layer tensors), beside 8 contiguous copies of the
same bytes timed the same way (synchronize, issue, wait), at queue depths 8 and 32, the same 8
copies each after an event recorded on the caller's current stream (``ref8-caller``: the steps
blockswap takes for a transfer that waits for the caller's stream, without it), and one run of
8 under CUDA's profiling interface (``torch.profiler``): the time from the first submit to the
first copy, the copy engine's busy share of the span, its gaps, and the time from the last copy to
``wait`` returning.

"bs8" follows "ref32", 32 copies of another buffer; "bs8 wait" and "bs8 poll" follow 8 of
blockswap's own transfers, waited for with ``wait`` or seen by polling ``get_finished`` (the two
in turn). The first burst after other traffic pays for its start: 1-4 points of the link on an
H200 (2026-11-28), whichever way it is waited for (docs/benchmarks.md).

    python benches/probe_queued.py [--models llama-3.1-70b-tp4,qwen2.5-7b] [--reps 3]
                                   [--caller-stream default|side]

A timeline without the profiler follows: when each submit returned and when each transfer's
result was seen (``get_finished`` polled), from the first submit, median over ``--reps`` runs
of 8. ``--caller-stream side``: the caller's current stream is one it made. The profiled run
also lists each thread's CUDA calls of its first 400 us that the profiler sees (kernel launches
by the engine's thread; the caller's synchronize).

Printed, not saved. The profiler slows the host's driver calls: its run's rate is not the figure,
its GPU durations and gaps are.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_vllm import Case, make_worker
from blockswap_bench.cli import need_cuda, parser
from blockswap_bench.kvblocks import ceiling, link_header
from blockswap_bench.models import MODELS
from blockswap_bench.plugin import CPUSpec


def main() -> int:
    ap = parser(__doc__, json=False, reps=3)
    ap.add_argument("--models", default="llama-3.1-70b-tp4,qwen2.5-7b")
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--caller-stream", choices=("default", "side"), default="default")
    args = ap.parse_args()
    if not need_cuda("probe_queued"):
        return 1
    if args.caller_stream == "side":
        torch.cuda.set_stream(torch.cuda.Stream())
    rng = np.random.default_rng(0)
    ceil = ceiling()
    print(link_header(ceil))
    wanted = set(args.models.split(","))
    for m in (m for m in MODELS if m.key in wanted):
        one_model(m, args.blocks, args.reps, ceil, rng)
        torch.cuda.empty_cache()
    return 0


def one_model(m: Any, blocks: int, reps: int, ceil: dict[str, float], rng: Any) -> None:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    case = Case(m, False, 1)
    nbytes = case.nbytes(blocks)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    w = make_worker(case, "region")
    job = 0
    try:
        for to_cpu in (True, False):
            d = "d2h" if to_cpu else "h2d"
            stream = torch.cuda.Stream()

            def ref(n: int, to_cpu: bool = to_cpu, stream: Any = stream) -> float:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.cuda.stream(stream):
                    for _ in range(n):
                        (host.copy_(dev, non_blocking=True) if to_cpu
                         else dev.copy_(host, non_blocking=True))  # fmt: skip
                stream.synchronize()
                return n * nbytes / (time.perf_counter() - t0) / 1e9

            def ref_after(n: int, to_cpu: bool = to_cpu, stream: Any = stream) -> list[float]:
                # The steps blockswap takes for each transfer, without it: an event recorded on
                # the caller's current stream (vLLM's: the legacy default stream), the copy
                # stream waiting for it, one copy of the transfer's bytes, an event after it;
                # completions seen by polling the events. Seconds from the first submit.
                caller = torch.cuda.current_stream()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                done = []
                for _ in range(n):
                    before = torch.cuda.Event()
                    before.record(caller)
                    stream.wait_event(before)
                    with torch.cuda.stream(stream):
                        (host.copy_(dev, non_blocking=True) if to_cpu
                         else dev.copy_(host, non_blocking=True))  # fmt: skip
                    after = torch.cuda.Event()
                    after.record(stream)
                    done.append(after)
                seen: list[float] = []
                while done:
                    if done[0].query():
                        done.pop(0)
                        seen.append(time.perf_counter() - t0)
                return seen

            def make() -> tuple[Any, CPUSpec]:
                ids, chunks = case.spec(rng, blocks)
                g = GPULoadStoreSpec([b for x in ids for b in x], [len(x) for x in ids],
                                     [0] * len(ids))  # fmt: skip
                return g, CPUSpec(chunks)

            def submit(specs: tuple[Any, CPUSpec], to_cpu: bool = to_cpu) -> int:
                nonlocal job
                job += 1
                g, c = specs
                ok = w.submit_store(job, g, c) if to_cpu else w.submit_load(job, c, g)
                assert ok
                return job

            def queued(n: int) -> float:
                # The specs built first, as vLLM hands them in (bench_vllm times them alike).
                specs = [make() for _ in range(n)]
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with record_function("submit"):
                    jobs = {submit(s) for s in specs}
                with record_function("wait"):
                    w.wait(jobs)
                rate = n * nbytes / (time.perf_counter() - t0) / 1e9
                assert all(r.success for r in w.get_finished())
                return rate

            def queued_timeline(n: int) -> tuple[list[float], list[float]]:
                specs = [make() for _ in range(n)]
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                back = []
                for s in specs:
                    submit(s)
                    back.append(time.perf_counter() - t0)
                seen: list[float] = []
                while len(seen) < n:
                    for r in w.get_finished():
                        assert r.success
                        seen.append(time.perf_counter() - t0)
                return back, seen

            for _ in range(3):
                queued(8)
                ref(8)
            # "bs8": 8 right after ref32's copies of another buffer, as the other rows are;
            # "bs8 wait" / "bs8 poll": 8 after 8 of blockswap's, the two ways of waiting in
            # turn (which goes first alternates).
            hows = ["wait", "poll"]
            pct = {k: 0.0 for k in ("ref8", "ref8-caller", "ref32", "bs8", "bs8 wait",
                                    "bs8 poll", "bs32")}  # fmt: skip
            for i in range(reps):
                pct["ref8"] = max(pct["ref8"], ref(8))
                pct["ref8-caller"] = max(pct["ref8-caller"], 8 * nbytes / ref_after(8)[-1] / 1e9)
                pct["ref32"] = max(pct["ref32"], ref(32))
                pct["bs8"] = max(pct["bs8"], queued(8))
                for how in hows[i % 2 :] + hows[: i % 2]:
                    rate = (
                        queued(8) if how == "wait" else 8 * nbytes / queued_timeline(8)[1][-1] / 1e9
                    )
                    pct[f"bs8 {how}"] = max(pct[f"bs8 {how}"], rate)
                pct["bs32"] = max(pct["bs32"], queued(32))
            print(f"{m.name[:20]:<20} {case.page // 1024:>3} KiB {d} {nbytes >> 20} MiB a "
                  "transfer; % of the link: " + ", ".join(
                      f"{k} {100 * v / ceil[d]:.1f}" for k, v in pct.items()))  # fmt: skip
            timeline(queued_timeline, reps, nbytes, ceil[d])
            print("    the same steps without blockswap (ref8-caller):", end="")
            timeline(lambda n: ([0.0] * n, ref_after(n)), reps, nbytes, ceil[d])
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                queued(8)
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "trace.json")
                prof.export_chrome_trace(path)
                with open(path) as f:
                    events = json.load(f)["traceEvents"]
            report(events, nbytes, to_cpu)
    finally:
        w.shutdown()


def timeline(run: Any, reps: int, nbytes: int, link: float) -> None:
    runs = [run(8) for _ in range(reps)]
    back = np.median([r[0] for r in runs], axis=0) * 1e6
    seen = np.median([r[1] for r in runs], axis=0) * 1e6
    one = nbytes / link / 1e3  # us of one transfer at the link's ceiling
    print(f"    timeline (us from the first submit; one transfer at the link {one:.0f}): "
          f"submits returned {' '.join(f'{t:.0f}' for t in back)}; results seen "
          f"{' '.join(f'{t:.0f}' for t in seen)}; apart {' '.join(f'{t:.0f}' for t in np.diff(seen))}")  # fmt: skip


def report(events: list[dict[str, Any]], nbytes: int, to_cpu: bool) -> None:
    marks = {e["name"]: e for e in events if e.get("cat") == "user_annotation"}
    t_submit, t_wait = marks["submit"], marks["wait"]
    t0 = t_submit["ts"]
    t_end = t_wait["ts"] + t_wait["dur"]
    gpu = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy") and "ts" in e),
        key=lambda e: e["ts"],
    )
    want = "DtoH" if to_cpu else "HtoD"
    pcie = [e for e in gpu if want in e["name"] and e.get("args", {}).get("bytes", 0) > 65536]
    kern = [e for e in gpu if e.get("cat") == "kernel"]
    first, last = gpu[0]["ts"], max(e["ts"] + e["dur"] for e in gpu)
    busy = 0.0
    gaps: list[float] = []
    end = pcie[0]["ts"]
    wide: list[str] = []
    for i, e in enumerate(pcie):
        if e["ts"] > end:
            gaps.append(e["ts"] - end)
            if gaps[-1] > 15:
                # What else ran on the GPU while the rows paused.
                inside = [
                    f"{g['name'][:24]} {g['dur']:.0f}"
                    for g in gpu
                    if g["ts"] < e["ts"] and g["ts"] + g["dur"] > end and g is not e
                ]
                wide.append(f"before copy {i} ({gaps[-1]:.0f} us): {'; '.join(inside) or '-'}")
        busy += min(e["dur"], e["ts"] + e["dur"] - end) if e["ts"] < end else e["dur"]
        end = max(end, e["ts"] + e["dur"])
    span = end - pcie[0]["ts"]
    pbytes = sum(e["args"]["bytes"] for e in pcie)
    big = sorted(gaps, reverse=True)[:6]
    print(f"    profiled: submit {t_submit['dur']:.0f} us, first GPU work at +{first - t0:.0f}, "
          f"first row copy at +{pcie[0]['ts'] - t0:.0f}, rows busy {busy:.0f} of {span:.0f} us "
          f"({pbytes / busy / 1e3:.1f} GB/s while busy, {len(pcie)} copies, {len(gaps)} gaps, "
          f"largest {', '.join(f'{g:.0f}' for g in big)}), last GPU end +{last - t0:.0f}, "
          f"wait returns +{t_end - t0:.0f} us; {len(kern)} kernels "
          f"{sum(e['dur'] for e in kern):.0f} us; rows {pbytes} of {8 * nbytes} bytes")  # fmt: skip
    for w in wide:
        print(f"      gap {w}")
    # The driver calls of the first 400 us, thread by thread (the caller's and the engine's).
    calls = sorted(
        (e for e in events if e.get("cat") in ("cuda_driver", "cuda_runtime") and "ts" in e),
        key=lambda e: e["ts"],
    )
    threads: dict[Any, list[str]] = {}
    for e in calls:
        if e["ts"] - t0 < 400:
            threads.setdefault(e.get("tid"), []).append(
                f"{e['name']} +{e['ts'] - t0:.0f}/{e['dur']:.0f}"
            )
    for tid, names in threads.items():
        print(f"      thread {tid}: {'; '.join(names[:24])}")


if __name__ == "__main__":
    sys.exit(main())
