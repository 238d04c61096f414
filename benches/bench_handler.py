"""Handler level with real models' KV-cache shapes: the suite's handler section on its own.

    python benches/bench_handler.py [--json out.json] [--models llama-3.1-70b-tp4] [--reps 100]
    python benches/bench_handler.py --models all --paths auto,dma,kernel

By default Llama-3.1-70B at TP=4 per rank (80 layers, FlashAttention layout [2, blocks, 16, 2,
128] bf16: 8 KiB per K or V page). A transfer moves 32 scattered blocks of every layer (2,560
block copies, 5,120 page descriptors). Host time of `transfer_async` (perf_counter), then
`get_finished` polled until done; 5 warm-up + 100 measured, per direction; `get_finished` with
nothing finished; and one `copy_` per page in the same process as the baseline. The code and the
other models are in `blockswap_bench.handlers` and `blockswap_bench.models`; `benches/suite.py`
runs them all.
"""

from __future__ import annotations

import sys

from blockswap_bench import suite
from blockswap_bench.cli import parser
from blockswap_bench.common import GiB
from blockswap_bench.models import select
from blockswap_bench.report import format_summary, write_json


def main() -> int:
    ap = parser(__doc__, reps=100, reps_help="measured transfers per direction", backend=True,
                json_help="also write the results to this JSON file")  # fmt: skip
    ap.add_argument("--models", default="llama-3.1-70b-tp4", help="model keys, or 'all'")
    ap.add_argument("--paths", default="auto", help="handler paths: auto, dma, kernel")
    args = ap.parse_args()
    models = select("" if args.models == "all" else args.models)
    overrides = {
        "models": tuple(m.key for m in models),
        "handler_paths": tuple(p.strip() for p in args.paths.split(",")),
        "handler_reps": args.reps,
        "cap_bytes": 1 * GiB,  # buffers for the ceiling only
    }
    res = suite.run_suite(
        "full", backend=args.backend, sections=("handler",), overrides=overrides, argv=sys.argv
    )
    print(format_summary(res))
    if args.json:
        write_json(res, args.json)
    return 1 if suite.failures(res) else 0


if __name__ == "__main__":
    sys.exit(main())
