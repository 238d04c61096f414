"""What an onload costs the model: an 8192^3 bf16 GEMM on the compute stream, alone and while
scattered-block host->device transfers run beside it, per copy path. The suite's interference
section on its own (`blockswap_bench.interference`).

    python benches/bench_interference.py [--json out.json] [--block 16384] [--reps 30] [--ctas 4,8,16]

The copies are queued first (enough to outlast the GEMMs), then the GEMMs are timed with CUDA
events on the compute stream; medians. The DMA path uses copy engines only; the kernel path
takes `max_ctas` SMs; `auto` is the handler's route for pages of the block size.
"""

from __future__ import annotations

import sys

from blockswap_bench import suite
from blockswap_bench.cli import parser
from blockswap_bench.report import format_summary, write_json


def main() -> int:
    ap = parser(__doc__, reps=30, reps_help="GEMMs timed per measurement",
                json_help="also write the results to this JSON file")  # fmt: skip
    ap.add_argument("--block", type=int, default=16 * 1024, help="block size in bytes")
    ap.add_argument("--blocks", type=int, default=8192, help="blocks per transfer")
    ap.add_argument("--ctas", default="4,8,16", help="kernel CTA counts")
    args = ap.parse_args()
    overrides = {
        "interference_block": args.block,
        "interference_blocks": args.blocks,
        "gemm_reps": args.reps,
        "interference_ctas": tuple(int(c) for c in args.ctas.split(",")),
        "cap_bytes": 2 * args.block * args.blocks,
    }
    res = suite.run_suite(
        "full", backend="cuda", sections=("interference",), overrides=overrides, argv=sys.argv
    )
    print(format_summary(res))
    if args.json:
        write_json(res, args.json)
    return 1 if suite.failures(res) else 0


if __name__ == "__main__":
    sys.exit(main())
