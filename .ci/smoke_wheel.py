"""Smoke test of an installed wheel in an environment with numpy only (no torch, no triton).

Run by ``.ci/check-wheel`` with the fresh virtual environment's Python, from an empty folder::

    python .ci/smoke_wheel.py

Checks that the package imports from site-packages, that ``python -m blockswap --version``,
``python -m blockswap info`` and the ``blockswap`` console script work, that ``blockswap bench``
(the short transfer benchmark) runs without torch and writes nothing, that a host-to-host
transfer on the host backend moves the right bytes, and that ``import blockswap.handler``
without torch fails with an ImportError (and nothing stranger).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import traceback
from typing import Callable

import numpy as np

import blockswap

CHECKS: list[Callable[[], None]] = []


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS.append(fn)
    return fn


def run(*args: str) -> str:
    p = subprocess.run(args, capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {p.returncode}: {p.stderr.strip()}")
    return p.stdout


@check
def installed_not_source() -> None:
    path = os.path.realpath(blockswap.__file__)
    assert "site-packages" in path, f"blockswap imported from {path}, not the installed wheel"
    assert importlib.util.find_spec("torch") is None, "torch is installed: not a numpy-only venv"


@check
def version() -> None:
    out = run(sys.executable, "-m", "blockswap", "--version").strip()
    assert out == f"blockswap {blockswap.__version__}", out
    script = os.path.join(os.path.dirname(sys.executable), "blockswap")
    assert run(script, "--version").strip() == out


@check
def info() -> None:
    out = run(sys.executable, "-m", "blockswap", "info")
    assert "host" in out and blockswap.__version__ in out, out


@check
def bench() -> None:
    before = sorted(os.listdir("."))
    out = run(sys.executable, "-m", "blockswap", "bench", "--tiny", "--backend", "host")
    assert "ceiling" in out and "DMA batch" in out and "GPU->CPU (d2h)" in out, out
    assert "needs torch" in out, out  # the handler's column says why it is empty
    assert sorted(os.listdir(".")) == before, "blockswap bench wrote files"


@check
def host_transfer() -> None:
    rng = np.random.default_rng(0)
    block, n = 4096, 64
    src = rng.integers(0, 256, size=block * n, dtype=np.uint8)
    dst = np.zeros_like(src)
    order = rng.permutation(n)  # block i of src goes to block order[i] of dst
    with blockswap.Engine("host") as eng:
        eng.register(src)
        eng.register(dst)
        idx = np.arange(n, dtype=np.int64)
        eng.submit(
            7,
            src.ctypes.data + idx * block,
            dst.ctypes.data + order * block,
            np.full(n, block, dtype=np.int64),
            "h2h",
        )
        eng.wait([7], timeout=30)
        (res,) = eng.get_finished()
    assert res.job_id == 7 and res.success and res.bytes == block * n, res
    want = np.empty_like(src)
    want.reshape(n, block)[order] = src.reshape(n, block)
    assert np.array_equal(dst, want), "bytes differ after the transfer"


@check
def handler_without_torch() -> None:
    try:
        import blockswap.handler  # noqa: F401
    except ImportError as e:
        print(f"  import blockswap.handler without torch: ImportError: {e}")
    else:
        raise AssertionError("blockswap.handler imported without torch")


def main() -> int:
    print(f"blockswap {blockswap.__version__} from {os.path.dirname(blockswap.__file__)}")
    failed = 0
    for fn in CHECKS:
        try:
            fn()
        except Exception:
            failed += 1
            print(f"FAILED {fn.__name__}")
            traceback.print_exc()
        else:
            print(f"ok {fn.__name__}")
    print(f"wheel smoke test: {len(CHECKS) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
