"""The command line every script in ``benches/`` builds on: one parser base with the options they
share (``--json``, ``--reps``, ``--backend``, ``--quick``, ``--seed``), the script's docstring as
its ``--help``, and the argument types more than one script reads (``KEY=VALUE`` options, comma
lists of KiB, of ints and of names). Each script adds its own options to the parser it gets here;
an option it did not take before is not added to it.

Nothing here imports torch: ``--help`` works on any machine.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

#: Backends a ``--backend`` option takes.
BACKENDS = ("auto", "cuda", "host")


class Parser(argparse.ArgumentParser):
    """The parser of every script in ``benches/`` (made by :func:`parser`; the tests check that
    each script's ``--help`` comes from one)."""


def parser(
    doc: str | None,
    *,
    json: bool = True,
    json_help: str = "write the figures to this file",
    reps: int | None = None,
    reps_help: str | None = None,
    backend: bool = False,
    quick: str | None = None,
    seed: bool = False,
    prog: str | None = None,
) -> argparse.ArgumentParser:
    """A script's parser: its docstring ``doc`` as the description of ``--help`` (laid out as
    written), and the shared options it asks for. ``json``: ``--json PATH`` (default none);
    ``reps``: ``--reps N`` with that default; ``backend``: ``--backend auto|cuda|host``
    (default auto); ``quick``: ``--quick`` (a flag, ``quick`` its help); ``seed``: ``--seed N``
    (default 0). ``prog``: the program's name in ``--help`` (default: the script's). A ``doc`` of
    one line is wrapped; a docstring keeps its lines."""
    if doc is not None and "\n" not in doc.strip():
        doc = textwrap.fill(doc.strip(), 79)
    ap = Parser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if quick is not None:
        ap.add_argument("--quick", action="store_true", help=quick)
    if reps is not None:
        ap.add_argument("--reps", type=int, default=reps,
                        help=f"{reps_help or 'repetitions'} (default {reps})")  # fmt: skip
    if backend:
        ap.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="auto (the default): the GPU where there is one, the host backend "
                             "otherwise")  # fmt: skip
    if seed:
        ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    if json:
        ap.add_argument("--json", default=None, metavar="PATH", help=json_help)
    return ap


def need_cuda(script: str) -> bool:
    """Whether torch sees a CUDA GPU; where it does not, one line on stderr saying that
    ``script`` needs one (its ``main`` then returns 1)."""
    import torch

    if torch.cuda.is_available():
        return True
    print(f"{script}: needs a CUDA GPU", file=sys.stderr)
    return False


# ---- argument types ---------------------------------------------------------------------------


def option(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` from the command line: ints as ints, true/false as bools, ``none`` as None."""
    key, sep, value = text.partition("=")
    if not key or not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    if value in ("true", "false"):
        return key, value == "true"
    if value == "none":
        return key, None
    return key, int(value) if value.lstrip("-").isdigit() else value


def int_list(text: str) -> list[int]:
    """``1,2,4`` as a list of ints."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"integers, comma separated: {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError(f"integers, comma separated: {text!r}")
    return out


def kib_list(text: str) -> list[int]:
    """``4,16,1024`` (KiB) as a list of ints."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"page sizes in KiB, comma separated: {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"page sizes in KiB, each >= 1: {text!r}")
    return out


def choices(allowed: Sequence[str]) -> Any:
    """An argparse type: a comma list of names out of ``allowed``."""

    def parse(text: str) -> list[str]:
        out = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in out if x not in allowed]
        if bad or not out:
            raise argparse.ArgumentTypeError(
                f"{text!r}: a comma list of {', '.join(allowed)} (not {', '.join(bad)})"
            )
        return out

    return parse
