"""Completion signalling on the GPU: `cuStreamWriteValue64` into mapped pinned memory (polled
with an atomic load) against one event per transfer (polled with `cuEventQuery`).

    python benches/bench_completion.py [--json out.json]

For each mode: the host cost of `get_finished()` while a transfer is in flight (nothing
finished yet), and the latency from submitting a 4 KiB host->device copy to seeing its result
(busy polling), medians of many.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

import blockswap
from blockswap_bench.cli import parser
from blockswap_bench.common import run_metadata
from blockswap_bench.report import write_json


def main() -> None:
    ap = parser(__doc__, reps=500)
    args = ap.parse_args()
    host = torch.ones(1 << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    rows = {}
    for mode in ("write_value", "event"):
        with blockswap.Engine("cuda", completion=mode) as eng:
            core = eng
            eng.register(host)
            eng.register(dev)
            assert mode.split("_")[0] in eng.info()["completion"].lower().replace(
                "writevalue", "write"
            )
            polls, latency = [], []
            src = np.array([host.data_ptr()], dtype=np.int64)
            dst = np.array([dev.data_ptr()], dtype=np.int64)
            size = np.array([4096], dtype=np.int64)
            for j in range(args.reps):
                t0 = time.perf_counter()
                core.submit(j, src, dst, size, "h2d")
                got = []
                while not got:
                    p0 = time.perf_counter()
                    got = core.get_finished()
                    if not got:
                        polls.append(time.perf_counter() - p0)
                latency.append(time.perf_counter() - t0)
            rows[mode] = {
                "poll_in_flight_ns": statistics.median(polls) * 1e9 if polls else None,
                "submit_to_result_us": statistics.median(latency) * 1e6,
                "info": eng.info()["completion"],
            }
            print(mode, rows[mode], flush=True)
    meta = run_metadata()
    if args.json:
        write_json({"meta": meta, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
