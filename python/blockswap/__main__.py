"""``python -m blockswap`` (also the ``blockswap`` command).

    blockswap                      (the same as ``blockswap info``)
    blockswap --version
    blockswap info [--json]
    blockswap bench [--quick | --tiny] [--backend auto|cuda|host]

``info`` says what blockswap would use on this machine: whether CUDA can be used (and why not),
the torch and Triton versions and whether the copy kernel can run here, the backend, driver and
batch-copy ABI an engine gets, and the copy path the offloading handler would take per
direction. ``bench`` runs a short transfer benchmark (:mod:`blockswap._bench`): the
link's ceiling and a few block sizes, one table. Neither writes a file (the full benchmark suite
is ``benches/suite.py`` in the source repository). Errors are one line on stderr and a non-zero
exit status.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import inspect
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from . import __version__, _core
from .engine import Engine, info
from .routing import HOST_ROUTE


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (argparse prints the usage above them otherwise)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _driver(version: int) -> str:
    """The driver's CUDA version, as ``cuDriverGetVersion`` encodes it (12080 -> ``12.8``)."""
    return f"CUDA {version // 1000}.{version % 1000 // 10} ({version})" if version else "-"


def _routes(backend: str, copy_path: str | None) -> dict[str, str]:
    """Per direction, the copy path ``CpuGpuHandlers(path="auto")`` would take here."""
    if backend != "cuda":
        return {d: HOST_ROUTE for d in ("d2h", "h2d")}
    try:
        from . import handler, routing
    except ImportError as e:
        why = f"unknown: blockswap.handler needs torch ({e})"
        return {d: why for d in ("d2h", "h2d")}
    ctas = inspect.signature(handler.CpuGpuHandlers).parameters["kernel_ctas"].default
    dma = copy_path or "DMA"
    kernel = (
        f"Triton copy kernel ({ctas} CTAs, at most {routing.KERNEL_LAUNCH_BYTES >> 20} MiB "
        "per launch)"
    )
    staged = "the staged plan (rows through a device ring, pages placed in HBM by a kernel)"
    if importlib.util.find_spec("triton") is None:
        kernel = "DMA: triton is not installed (the copy kernel needs it)"
        staged = "per-page DMA (triton is not installed: the staged plan's kernel needs it)"
    blocks = (
        "block-major CPU cache (the default): the block plan (a 2-D copy a block, no SM) where "
        f"a block's GPU pages lie at one pitch and are >= {_core.BLOCK_MIN_PAGE >> 10} KiB, "
        f"else {staged}"
    )
    return {
        d: f"{blocks}; mirrored CPU cache: pages < {routing.KERNEL_BELOW[d] >> 10} KiB: "
        f"{kernel}; larger pages: {dma}"
        for d in ("d2h", "h2d")
    }


def _version(package: str) -> str | None:
    """The installed version of ``package`` (without importing it), or None."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def copy_kernel_status(cuda: bool) -> tuple[bool, str]:
    """Whether the Triton copy kernel (the handler's kernel route and the staged plan's gather
    and scatter) can run here, and why not: it needs torch and Triton, and a CUDA GPU, or Triton's
    CPU interpreter (``TRITON_INTERPRET=1`` set before blockswap's kernels are imported; slow, for
    tests). Without a GPU, Triton itself imports fine and fails only at the first launch."""
    missing = [p for p in ("torch", "triton") if importlib.util.find_spec(p) is None]
    if missing:
        return False, (f"{' and '.join(missing)} not installed (pip install 'blockswap[torch]')")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True, "under Triton's CPU interpreter (TRITON_INTERPRET=1): slow, for tests"
    if not cuda:
        return False, (
            "no CUDA GPU here (see CUDA above): Triton compiles for a GPU; TRITON_INTERPRET=1 "
            "runs the kernel on the CPU, slowly"
        )
    return True, "on the GPU"


def describe() -> dict[str, Any]:
    """Everything ``blockswap info`` reports, as one dict."""
    out: dict[str, Any] = dict(info())
    out["torch"] = _version("torch")
    out["triton"] = _version("triton")
    can, why = copy_kernel_status(bool(out["cuda"]))
    out["copy_kernel"] = {"can_run": can, "why": why}
    try:
        eng = Engine(out["default_backend"])
    except Exception as e:
        out["engine"] = {"error": f"{type(e).__name__}: {e}"}
        return out
    try:
        out["engine"] = dict(eng.info())
    finally:
        eng.shutdown()
    ei = out["engine"]
    out["routes"] = _routes(ei["backend"], ei["copy_path"] if ei["backend"] == "cuda" else None)
    return out


def format_info(d: dict[str, Any]) -> str:
    e = d.get("engine", {})
    lines = [
        f"blockswap {d['version']}",
        f"CUDA:            {'yes' if d['cuda'] else 'no'} ({d['cuda_status']})",
        f"torch:           {d.get('torch') or 'not installed'}",
        f"triton:          {d.get('triton') or 'not installed'}",
        f"copy kernel:     {'yes' if d['copy_kernel']['can_run'] else 'no'} "
        f"({d['copy_kernel']['why']})",
        f"default backend: {d['default_backend']}",
    ]
    if "error" in e:
        lines.append(f"engine:          could not start: {e['error']}")
        return "\n".join(lines)
    lines += [
        f"device:          {e.get('device') or 'host memory only'}",
        f"driver:          {_driver(e.get('driver_version') or 0)}",
        f"copy path:       {e.get('copy_path')}",
        f"completion:      {e.get('completion')}",
        "handler routes (path='auto'):",
    ]
    names = {"d2h": "GPU->CPU (d2h)", "h2d": "CPU->GPU (h2d)"}
    for k, v in d.get("routes", {}).items():
        head = f"  {names[k]}: "
        lines += [
            (head if i == 0 else " " * len(head)) + part for i, part in enumerate(v.split("; "))
        ]
    return "\n".join(lines)


def _info(args: argparse.Namespace) -> int:
    d = describe()
    print(json.dumps(d, indent=1) if args.json else format_info(d))
    return 1 if "error" in d.get("engine", {}) else 0


def _run_bench(args: argparse.Namespace) -> int:
    from . import _bench

    return _bench.main(args)


def build_parser() -> argparse.ArgumentParser:
    from . import _bench

    ap = _Parser(
        prog="blockswap",
        description="Move KV-cache blocks between pinned host memory and GPU memory.",
    )
    ap.add_argument("--version", action="version", version=f"blockswap {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser(
        "info",
        help="what blockswap would use here: CUDA, driver, batch-copy ABI, handler routes",
        description="What blockswap would use on this machine (writes nothing).",
    )
    p.add_argument("--json", action="store_true", help="print it as JSON")
    p.set_defaults(func=_info)
    p = sub.add_parser(
        "bench",
        help="a short transfer benchmark: the link's ceiling and a few block sizes",
        description=_bench.DESCRIPTION,
    )
    _bench.add_arguments(p)
    p.set_defaults(func=_run_bench)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(args_list)
    if args.command is None:  # bare `blockswap`: what a person most likely wants to know
        args = ap.parse_args(["info"])
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("blockswap: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`... | head`): what is left to print goes nowhere, and the
        # interpreter's own flush at exit must not raise it again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a command a closed pipe stopped


if __name__ == "__main__":
    sys.exit(main())
