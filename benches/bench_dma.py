"""DMA path on the GPU: blockswap's batched copies beside the link's ceiling and beside the same
batch submitted through NVIDIA's cuda-bindings, all in one process.

    python benches/bench_dma.py [--quick] [--json out.json]

For each block size, N and direction: GPU time (CUDA events on the copy stream) of
  - one large pinned copy of the same total bytes (the ceiling, best of --reps:
    ``blockswap._bench.measure_ceiling``),
  - blockswap's engine (cuMemcpyBatchAsync),
  - cuda.bindings.driver.cuMemcpyBatchAsync with the same arrays, attributes and stream kind,
  - blockswap's kernel route (the Triton copy kernel on 8 and 16 CTAs, descriptors read from
    the pinned slab), for blocks up to 256 KiB,
and host submission time (perf_counter, median): blockswap's submit split into the driver call
and blockswap's own work (validation, coalescing, slab, record), and the cuda-bindings call.
Own work is split again, from the engine's counters: the call into the compiled core and back,
validating and writing the descriptors, and the engine and backend around the driver call.
blockswap's submissions and the cuda-bindings calls alternate rep by rep (which of the two goes
first alternates too), and the ratio of the two is taken per rep, so that the driver's own drift
falls on both; pairs go on for --pair-seconds at each point (at least --reps of them), and the
median ratio comes with a distribution-free 95 % confidence interval. cuda-bindings' call less
blockswap's driver time in the same rep estimates what cuda-bindings spends around the same
driver call.
Blocks are scattered (random permutations); host buffers are pinned.
"""

from __future__ import annotations

import json
import sys
import time
from math import nan

import numpy as np
import torch

import blockswap
from blockswap._bench import measure_ceiling
from blockswap.kernels import engine_launcher
from blockswap_bench.cli import parser
from blockswap_bench.common import GiB, KiB, MiB, run_metadata
from blockswap_bench.common import median as med
from blockswap_bench.report import write_json


def median_ci95(xs: list[float]) -> tuple[float, float]:
    """A distribution-free 95 % confidence interval of the median: the order statistics at
    ranks n/2 -+ 0.98 sqrt(n) (the binomial(n, 1/2) quantiles, normal approximation)."""
    s = sorted(xs)
    n = len(s)
    half = 0.98 * n**0.5
    return s[max(0, int(n / 2 - half))], s[min(n - 1, int(n / 2 + half + 1) - 1)]


def cuda_bindings_batch():
    """A callable submitting one batch through cuda-bindings, or None where it is missing."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return None

    def prepare(src, dst, sizes, any_order, stream):
        attr = driver.CUmemcpyAttributes()
        attr.srcAccessOrder = (
            driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_ANY
            if any_order
            else driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        )
        t0 = time.perf_counter()
        dsts = [driver.CUdeviceptr(int(x)) for x in dst]
        srcs = [driver.CUdeviceptr(int(x)) for x in src]
        szs = [int(x) for x in sizes]
        build_s = time.perf_counter() - t0  # building the argument lists, per transfer
        hstream = driver.CUstream(stream.cuda_stream)

        def call():
            (err, *_) = driver.cuMemcpyBatchAsync(
                dsts, srcs, szs, len(szs), [attr], [0], 1, hstream
            )
            if err != driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuda-bindings cuMemcpyBatchAsync: {err}")

        call.build_s = build_s  # type: ignore[attr-defined]
        return call

    return prepare


def main() -> None:
    ap = parser(__doc__, reps=15, quick="two block sizes, one N")
    ap.add_argument(
        "--pair-seconds",
        type=float,
        default=6.0,
        help="blockswap / cuda-bindings pairs go on for at least this long at each point "
        "(at least --reps pairs, at most --pair-max)",
    )
    ap.add_argument("--pair-max", type=int, default=401)
    ap.add_argument("--kernel-ctas", type=int, nargs="*", default=[8, 16])
    ap.add_argument("--h2d-order", default="any", choices=["any", "stream"])
    ap.add_argument("--kernel-warps", type=int, default=4)
    ap.add_argument("--kernel-block-bytes", type=int, default=16384)
    ap.add_argument("--sizes", default=None, help="comma-separated block sizes in KiB")
    ap.add_argument(
        "--kernel-max", type=int, default=256 * KiB, help="largest block for the kernel rows"
    )
    args = ap.parse_args()
    sizes = (
        [4 * KiB, 64 * KiB]
        if args.quick
        else [4 * KiB, 8 * KiB, 16 * KiB, 32 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 2 * MiB]
    )
    counts = [2560] if args.quick else [2560, 10_000]
    if args.sizes:
        sizes = [int(k) * KiB for k in args.sizes.split(",")]
    cap = 2 * GiB
    rng = np.random.default_rng(0)
    prepare_cb = cuda_bindings_batch()
    host = torch.empty(cap, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(cap, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(2 * cap, dtype=torch.uint8, device="cuda")
    host.fill_(3)
    dev.fill_(5)
    stream = torch.cuda.Stream()
    # Both lanes on the benchmark's stream: blockswap, cuda-bindings and the ceiling are all timed
    # by the same events on the same stream.
    eng = blockswap.Engine(
        "cuda",
        h2d_stream=stream.cuda_stream,
        d2h_stream=stream.cuda_stream,
        h2d_order=args.h2d_order,
    )
    core = eng

    def submit(j, src, dst, sizes, direction, wait_stream=None, kernel_below=0, launcher=None):
        core.submit(
            j, src, dst, sizes, direction,
            wait_stream=wait_stream, kernel_below=kernel_below, launcher=launcher,
        )  # fmt: skip

    for t in (host, host2, dev):
        eng.register(t)
    rows = []
    job = 0
    launchers: dict = {}

    def events_around(issue, sync=False):
        """(start event, end event, host seconds) of ``issue()`` on the copy stream; with
        ``sync``, after the end event has passed."""
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
        t0 = time.perf_counter()
        issue()
        t1 = time.perf_counter()
        with torch.cuda.stream(stream):
            end.record()
        if sync:
            end.synchronize()
        return start, end, t1 - t0

    def blockswap_rep(j, args):
        """One blockswap submission of ``args`` as job ``j``, waited for: its events, host
        seconds, and the engine's counters before and after."""
        s0 = core.stats()
        start, end, host_s = events_around(lambda: submit(j, *args))
        s1 = core.stats()
        core.wait([j], None)
        (r,) = core.get_finished()
        assert r.success, r.error
        end.synchronize()
        return start, end, host_s, s0, s1

    def pipelined(submit, total, depth=8):
        """Bandwidth with `depth` transfers queued back to back (steady state: host work of
        one transfer overlaps the copies of the previous ones), median of a few runs."""
        nonlocal job
        runs = []
        for _ in range(4):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record()
            ids = []
            for _ in range(depth):
                job += 1
                submit(job)
                ids.append(job)
            with torch.cuda.stream(stream):
                end.record()
            core.wait(ids, None)
            assert all(r.success for r in core.get_finished())
            end.synchronize()
            runs.append(start.elapsed_time(end) / 1e3)
        return depth * total / med(runs[1:]) / 1e9

    for n in counts:
        for size in sizes:
            blocks = min(n, cap // size)
            for direction in ("h2d", "d2h"):
                if direction == "h2d":
                    src_t, dst_t, dst_cap = host, dev, 2 * cap
                else:
                    src_t, dst_t, dst_cap = dev, host2, cap
                slots_src = (2 * cap if direction == "d2h" else cap) // size
                slots_dst = dst_cap // size
                s_ids = rng.choice(slots_src, blocks, replace=False)
                d_ids = rng.choice(slots_dst, blocks, replace=False)
                src = (src_t.data_ptr() + s_ids * size).astype(np.int64)
                dst = (dst_t.data_ptr() + d_ids * size).astype(np.int64)
                szs = np.full(blocks, size, dtype=np.int64)
                total = blocks * size

                ceil = measure_ceiling(src_t, dst_t, total, stream, args.reps, max_reps=args.reps)[
                    "gbps"
                ]
                gpu, sub, drv = [], [], []
                kernel = {}
                for max_ctas in args.kernel_ctas if size <= args.kernel_max else []:
                    launch = launchers.setdefault(
                        max_ctas,
                        engine_launcher(
                            max_ctas=max_ctas,
                            num_warps=args.kernel_warps,
                            block_bytes=args.kernel_block_bytes,
                        ),
                    )
                    kt = []
                    for i in range(args.reps + 3):
                        job += 1
                        start, end, *_ = blockswap_rep(
                            job, (src, dst, szs, direction, None, 1 << 62, launch)
                        )
                        if i >= 3:
                            kt.append(start.elapsed_time(end) / 1e3)
                    kernel[max_ctas] = total / med(kt) / 1e9
                    kernel[f"{max_ctas}_pipelined"] = pipelined(
                        lambda j, a=(src, dst, szs, direction, None, 1 << 62, launch): submit(
                            j, *a
                        ),
                        total,
                    )
                # blockswap and cuda-bindings alternate rep by rep on the same stream, so that
                # drift of the driver's own cost (several percent over seconds) falls on both.
                call = None
                if prepare_cb is not None:
                    call = prepare_cb(
                        src, dst, szs, direction == "h2d" and args.h2d_order == "any", stream
                    )
                cb_gpu, cb_sub = [], []

                own, parts, cb_own = [], [], []
                # Where the driver's cost jitters by a few percent from call to call (small
                # host->device copies, which it moves itself) a ratio near 1 needs hundreds of
                # pairs to resolve: pairs go on for a while, not for a fixed count.
                t_end = time.perf_counter() + args.pair_seconds
                i = -1
                while True:
                    i += 1
                    done = i >= args.reps + 3 and time.perf_counter() >= t_end
                    if done or i >= args.pair_max + 3:
                        break
                    job += 1
                    # The two alternate which goes first, so that neither always finds the
                    # source in the CPU's caches after the other (the driver reads it for small
                    # host->device copies).
                    a = (src, dst, szs, direction, None)
                    if call is not None and i % 2:
                        cb = events_around(call, sync=True)
                        start, end, host_s, s0, s1 = blockswap_rep(job, a)
                    else:
                        start, end, host_s, s0, s1 = blockswap_rep(job, a)
                        cb = events_around(call, sync=True) if call is not None else None
                    d0, d1 = s0["driver_ns"], s1["driver_ns"]
                    # Own work in three parts (seconds): the call into the compiled core and
                    # back (argument conversion, the GIL), validating and writing descriptors,
                    # and the rest of the engine and backend around the driver call.
                    engine_s = (s1["submit_ns"] - s0["submit_ns"]) * 1e-9
                    prep_s = (s1["prepare_ns"] - s0["prepare_ns"]) * 1e-9
                    part = (host_s - engine_s, prep_s, engine_s - prep_s - (d1 - d0) * 1e-9)
                    if i >= 3:
                        gpu.append(start.elapsed_time(end) / 1e3)
                        sub.append(host_s)
                        drv.append((d1 - d0) * 1e-9)
                        own.append(host_s - (d1 - d0) * 1e-9)
                        parts.append(part)
                        if cb is not None:
                            cb_gpu.append(cb[0].elapsed_time(cb[1]) / 1e3)
                            cb_sub.append(cb[2])
                            # The same driver call made by blockswap in this rep stands in for
                            # cuda-bindings' own: what is left is its argument conversion.
                            cb_own.append(cb[2] - (d1 - d0) * 1e-9)
                row = {
                    "direction": direction,
                    "block_bytes": size,
                    "blocks": blocks,
                    "ceiling_gbps": ceil,
                    "blockswap_gbps": total / med(gpu) / 1e9,
                    "blockswap_submit_us": med(sub) * 1e6,
                    "driver_call_us": med(drv) * 1e6,
                    # Per rep: the whole submission less the driver call, then the median.
                    "own_ns_per_desc": med(own) * 1e9 / blocks,
                    "driver_ns_per_desc": med(drv) * 1e9 / blocks,
                    # Medians of the three parts of own work, microseconds per submission.
                    "own_call_us": med([p[0] for p in parts]) * 1e6,
                    "own_prepare_us": med([p[1] for p in parts]) * 1e6,
                    "own_engine_us": med([p[2] for p in parts]) * 1e6,
                }
                row["dma_pipelined_gbps"] = pipelined(
                    lambda j, a=(src, dst, szs, direction, None): submit(j, *a), total
                )
                for ctas, gbps in kernel.items():
                    row[f"kernel_{ctas}cta_gbps"] = gbps
                if call is not None:
                    row["cuda_bindings_gbps"] = total / med(cb_gpu) / 1e9
                    row["cuda_bindings_submit_us"] = med(cb_sub) * 1e6
                    row["cuda_bindings_build_lists_us"] = call.build_s * 1e6
                    # Rep by rep: blockswap's whole submission over the cuda-bindings call.
                    ratios = [a / b for a, b in zip(sub, cb_sub)]
                    row["submit_ratio_vs_cuda_bindings"] = med(ratios)
                    row["submit_ratio_ci95"] = median_ci95(ratios)
                    row["pairs"] = len(ratios)
                    # Rep by rep: blockswap's bandwidth over cuda-bindings' (GPU time, inverted).
                    row["gbps_ratio_vs_cuda_bindings"] = med([b / a for a, b in zip(gpu, cb_gpu)])
                    # cuda-bindings' call less blockswap's driver time in the same rep, median:
                    # an estimate of its own work around the same driver call.
                    row["cuda_bindings_own_ns_per_desc"] = med(cb_own) * 1e9 / blocks
                rows.append(row)
                print(
                    f"{direction} {size // KiB:>5} KiB x {blocks:>5}: ceiling {row['ceiling_gbps']:6.2f} "
                    f"blockswap {row['blockswap_gbps']:6.2f} GB/s "
                    f"({100 * row['blockswap_gbps'] / row['ceiling_gbps']:5.1f}%) "
                    f"cuda-bindings {row.get('cuda_bindings_gbps', float('nan')):6.2f} "
                    f"(ratio {row.get('gbps_ratio_vs_cuda_bindings', float('nan')):.3f}) | submit us: "
                    f"blockswap {row['blockswap_submit_us']:8.1f} (driver {row['driver_call_us']:8.1f}, "
                    f"own {row['own_ns_per_desc']:5.1f} ns/desc = call {row['own_call_us']:.1f} + "
                    f"prepare {row['own_prepare_us']:.1f} + engine {row['own_engine_us']:.1f} us, "
                    f"driver {row['driver_ns_per_desc']:6.1f} ns/desc) "
                    f"cuda-bindings {row.get('cuda_bindings_submit_us', float('nan')):8.1f} "
                    f"(own ~{row.get('cuda_bindings_own_ns_per_desc', float('nan')):5.1f} ns/desc, "
                    f"ratio {row.get('submit_ratio_vs_cuda_bindings', float('nan')):.3f} "
                    f"[{row.get('submit_ratio_ci95', (nan, nan))[0]:.3f}, "
                    f"{row.get('submit_ratio_ci95', (nan, nan))[1]:.3f}], "
                    f"{row.get('pairs', 0)} pairs)"
                    + f" | pipelined: dma {row['dma_pipelined_gbps']:6.2f}"
                    + "".join(f" | kernel {c} CTAs {g:6.2f} GB/s" for c, g in kernel.items()),
                    flush=True,
                )
    eng.shutdown()
    meta = {
        **run_metadata(["python", *sys.argv]),
        "info": eng.info(),
    }
    print(json.dumps(meta))
    if args.json:
        write_json({"meta": meta, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
