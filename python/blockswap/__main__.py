"""``python -m blockswap`` (also the ``blockswap`` command): info, and the benchmark suite.

    python -m blockswap info
    python -m blockswap bench [--full | --tiny] [--out DIR] [--only sweep,handler,bidir,interference]

``bench`` runs the suite's short version unless ``--full`` is given (``bench --help`` lists the
options; see :mod:`blockswap.bench.suite`). With no command, ``bench`` is run.
"""

from __future__ import annotations

import json
import sys

from .engine import info


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["info"]:
        print(json.dumps(info(), indent=1))
        return 0
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if args[:1] == ["bench"]:
        args = args[1:]
    elif args and not args[0].startswith("-"):
        print(f"blockswap: unknown command {args[0]!r} (info, bench)", file=sys.stderr)
        return 2
    from .bench import suite

    return suite.main(args, prog="blockswap bench", default_profile="quick")


if __name__ == "__main__":
    sys.exit(main())
