"""``python -m blockswap`` (also the ``blockswap`` command): info and a short benchmark."""

from __future__ import annotations

import argparse
import json
import sys

from . import bench
from .engine import info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="blockswap", description=__doc__)
    sub = p.add_subparsers(dest="cmd")
    b = sub.add_parser("bench", help="scattered-block bandwidth beside the link's ceiling")
    b.add_argument("--backend", default="auto", choices=["auto", "host", "cuda"])
    b.add_argument("--full", action="store_true", help="more block sizes, more repetitions")
    b.add_argument("--blocks", type=int, default=None, help="blocks per transfer (default 2560)")
    b.add_argument("--json", default=None, help="also write the rows to this JSON file")
    sub.add_parser("info", help="version, CUDA availability, default backend")
    args = p.parse_args(argv)
    if args.cmd == "info":
        print(json.dumps(info(), indent=1))
        return 0
    if args.cmd is None:
        args = p.parse_args(["bench", *(argv or [])])
    i = info()
    print(f"blockswap {i['version']}: {i['cuda_status']}")
    rows = bench.run(backend=args.backend, full=args.full, json_path=args.json, n=args.blocks)
    print(bench.format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
