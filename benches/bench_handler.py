"""Handler-level host cost and bandwidth with a real model's KV-cache shape.

    python benches/bench_handler.py [--json out.json]

Llama-3.1-70B at TP=4 per rank: 80 layers, FlashAttention layout [2, blocks, 16, 2, 128] bf16
(8 KiB per K or V page). A transfer moves 32 scattered blocks of every layer: 2,560 block copies,
5,120 page descriptors. Host time of `transfer_async` (perf_counter), then polling `get_finished`
until done; 5 warm-up + 100 measured, per direction; `get_finished` with nothing finished; and
the one-`copy_`-per-page loop in the same process as the baseline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from blockswap.handler import CpuGpuHandlers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args()
    layers, blocks, per = 80, 1024, 32
    gpu = [
        torch.randn(2, blocks, 16, 2, 128, dtype=torch.bfloat16, device="cuda")
        for _ in range(layers)
    ]
    h = CpuGpuHandlers(gpu, blocks, layout="kv_split")
    rng = np.random.default_rng(0)
    rows = {}
    job = 0
    for name, handler in (("d2h", h.gpu_to_cpu_handler), ("h2d", h.cpu_to_gpu_handler)):
        submit_us, total_s = [], []
        for i in range(5 + args.reps):
            src = rng.choice(blocks, per, replace=False)
            dst = rng.choice(blocks, per, replace=False)
            job += 1
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            handler.transfer_async(job, (src, dst))
            t1 = time.perf_counter()
            done = []
            while not done:
                done = h.get_finished()
            t2 = time.perf_counter()
            assert done[0].success, done[0].error
            if i >= 5:
                submit_us.append((t1 - t0) * 1e6)
                total_s.append(t2 - t0)
        nbytes = layers * 2 * per * 16 * 2 * 128 * 2
        rows[name] = {
            "transfer_async_us_median": statistics.median(submit_us),
            "transfer_async_us_p90": float(np.percentile(submit_us, 90)),
            "end_to_end_gbps": nbytes / statistics.median(total_s) / 1e9,
        }
    polls = []
    for _ in range(2000):
        t0 = time.perf_counter()
        h.get_finished()
        polls.append(time.perf_counter() - t0)
    rows["get_finished_empty_us_median"] = statistics.median(polls) * 1e6

    # Baseline: one copy_ per page, the loop the offloading connector used before batching.
    cpu = h.cpu_caches[0]
    stream = torch.cuda.Stream()
    base = {}
    for name in ("d2h", "h2d"):
        ts = []
        for _ in range(5):
            src = rng.choice(blocks, per, replace=False).tolist()
            dst = rng.choice(blocks, per, replace=False).tolist()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.cuda.stream(stream):
                for g, c in zip(gpu, cpu):
                    for s, d in zip(src, dst):
                        if name == "d2h":
                            c[:, d].copy_(g[:, s], non_blocking=True)
                        else:
                            g[:, d].copy_(c[:, s], non_blocking=True)
            stream.synchronize()
            ts.append(time.perf_counter() - t0)
        nbytes = layers * 2 * per * 16 * 2 * 128 * 2
        base[name] = nbytes / statistics.median(ts) / 1e9
        rows[name]["copy_loop_gbps"] = base[name]
        rows[name]["speedup_vs_loop"] = rows[name]["end_to_end_gbps"] / base[name]
    h.shutdown()
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "model": "Llama-3.1-70B TP=4 (80 layers, 2 KV heads/rank, head_dim 128, block 16)",
    }
    print(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
