"""blockswap's benchmark suite, one command: a sweep of block size x blocks per transfer x
direction x path, the offloading handler with real models' KV-cache shapes, both directions at
once, and a GEMM beside an onload, each beside the link's ceiling measured in the same run.

    python benches/suite.py                      # the full suite (a few minutes on a GPU)
    python benches/suite.py --quick              # the short version (`make run`)
    python benches/suite.py --out results/x --only sweep,handler,bidir,interference

Tables are printed and saved with the JSON and the PNG plots under ``--out`` (default
``results/<date>-<gpu>``). Without a GPU it runs on the host backend. The code is the
``blockswap_bench`` package beside this file; what it shares with ``blockswap bench`` (the
installed package's short transfer benchmark) it imports from :mod:`blockswap._bench`.
"""

from __future__ import annotations

import sys

from blockswap_bench.suite import main

if __name__ == "__main__":
    sys.exit(main(prog="benches/suite.py", default_profile="full"))
