"""What the KV-block benchmarks per page size share (``benches/bench_blocks.py``,
``benches/bench_wall.py`` and the probes beside them): the link's ceiling, one contiguous copy of
a transfer's bytes, CPU block ids in the orders a cache hands out, the command line, and the JSON.

The link's ceiling is measured here and nowhere else in ``benches/``: :func:`ceiling` (one
256 MiB pinned copy per direction, best of a few, through :func:`blockswap._bench.measure_ceiling`,
which ``blockswap bench`` and the suite use too), :func:`bidir_ceiling` (both ways at once),
:class:`Ceilings` when a run measures it again at its start, middle and end and keeps the best.
The command line's base and argument types are :mod:`blockswap_bench.cli`'s.

On the host backend (no GPU) a copy is one ``memcpy`` (numpy ``copyto``) between two host
buffers, timed by the wall clock. torch is imported only where CUDA is used.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from blockswap import Engine
from blockswap._bench import measure_ceiling, median, one_copy

from .cli import choices, kib_list, option
from .cli import parser as base_parser
from .common import run_metadata

#: Bytes of the copy that measures the link's ceiling.
LINK_BYTES = 256 << 20

#: Directions, each as its ``(source, destination)`` sides.
DIRECTIONS = ("h2d", "d2h")

#: CPU block orders: ``random`` (no two consecutive ids adjacent), ``adjacent`` (one after the
#: other, as a fresh cache hands them out), ``reversed`` (adjacent from the last one down, as
#: vLLM's CPU manager hands a request the chunks one eviction freed).
ORDERS = ("random", "adjacent", "reversed")

#: Options of the engine (the rest of ``--option`` goes to the handlers only).
ENGINE_OPTIONS = set(inspect.signature(Engine).parameters) - {"backend"}


def cuda_available() -> bool:
    """Whether torch sees a CUDA GPU (blockswap's CUDA backend is then used)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


# ---- copies -----------------------------------------------------------------------------------


class Copier:
    """A host buffer and a device buffer of ``nbytes`` each (pinned host memory, exactly that size,
    and device memory on CUDA; two numpy arrays on the host backend, the second standing in for
    the device), and one contiguous copy of their first bytes either way, timed."""

    def __init__(self, nbytes: int, cuda: bool | None = None) -> None:
        self.cuda = cuda_available() if cuda is None else cuda
        self.nbytes = int(nbytes)
        self._pinned: Any = None
        if self.cuda:
            import torch

            from blockswap.hostmem import PinnedRows

            # Exactly the bytes asked for (torch's pinned allocator rounds up to a power of 2).
            self._pinned = PinnedRows(1, self.nbytes, backend="cuda", log_line=False)
            self.host: Any = torch.from_numpy(self._pinned.array.reshape(-1))
            self.dev: Any = torch.empty(self.nbytes, dtype=torch.uint8, device="cuda")
            self.host.fill_(1)
            self.dev.fill_(2)
            torch.cuda.synchronize()
        else:
            self.host = np.full(self.nbytes, 1, dtype=np.uint8)
            self.dev = np.full(self.nbytes, 2, dtype=np.uint8)

    def sides(self, direction: str) -> tuple[Any, Any]:
        return (self.host, self.dev) if direction == "h2d" else (self.dev, self.host)

    def seconds(self, direction: str, nbytes: int, *, wall: bool = True) -> float:
        """One copy of ``nbytes`` in ``direction``. ``wall``: the wall clock from a synchronised
        device to the copy seen done (``synchronize``, ``copy_``, ``synchronize``: what a caller
        waits for, fixed latency included); else its GPU time (CUDA events around it). The host
        backend has only the wall clock."""
        if nbytes > self.nbytes:
            raise ValueError(f"a copy of {nbytes} bytes over buffers of {self.nbytes}")
        src, dst = self.sides(direction)
        if not self.cuda:
            t0 = time.perf_counter()
            one_copy(src, dst, nbytes, None)()
            return time.perf_counter() - t0
        import torch

        if wall:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst[:nbytes].copy_(src[:nbytes], non_blocking=True)
            torch.cuda.synchronize()
            return time.perf_counter() - t0
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        dst[:nbytes].copy_(src[:nbytes], non_blocking=True)
        b.record()
        b.synchronize()
        return float(a.elapsed_time(b)) * 1e-3

    def gbps(self, nbytes: int, reps: int = 9, *, wall: bool = True) -> dict[str, float]:
        """GB/s of one copy of ``nbytes`` per direction, isolated, median of ``reps`` (after one
        discarded)."""
        out = {}
        for d in DIRECTIONS:
            times = [self.seconds(d, nbytes, wall=wall) for _ in range(reps + 1)][1:]
            out[d] = nbytes / median(times) / 1e9
        return out


def ceiling(
    nbytes: int = LINK_BYTES,
    reps: int = 5,
    *,
    copier: Copier | None = None,
    directions: Sequence[str] = DIRECTIONS,
    copies: int = 1,
) -> dict[str, float]:
    """The link's ceiling in GB/s per direction: one ``nbytes`` copy between pinned host memory
    and the GPU, GPU time by CUDA events (the host backend: one memcpy, wall clock), best of
    ``reps`` after two discarded (:func:`blockswap._bench.measure_ceiling`, the one measurement
    of it). ``copier``: buffers of at least ``nbytes`` to use (else allocated here);
    ``directions``: those to measure; ``copies``: copies queued back to back per sample."""
    c = copier if copier is not None and copier.nbytes >= nbytes else Copier(nbytes)
    stream = None
    if c.cuda:
        import torch

        stream = torch.cuda.current_stream()
    return {
        d: float(
            measure_ceiling(*c.sides(d), nbytes, stream, reps, max_reps=reps, copies=copies)["gbps"]
        )
        for d in directions
    }


def link_header(ceil: dict[str, float], detail: str = "") -> str:
    """The first line a script prints: the GPU and the link's ceiling each way (as
    :func:`ceiling` gave it), then ``detail`` where given."""
    import torch

    line = (
        f"# {torch.cuda.get_device_name()}; ceiling h2d {ceil['h2d']:.1f} GB/s, "
        f"d2h {ceil['d2h']:.1f} GB/s"
    )
    return f"{line}; {detail}" if detail else line


def bidir_ceiling(nbytes: int = LINK_BYTES, reps: int = 5) -> float:
    """The link's ceiling both ways at once, GB/s in all: one ``nbytes`` pinned copy each way,
    on two streams (the host backend: one after the other), wall clock from a synchronised
    device to both seen done, best of ``reps`` after one discarded. The onload reads the first
    half of the buffers, the offload the second: no byte is read by one and written by the
    other."""
    c = Copier(2 * nbytes)
    lo, hi = slice(0, nbytes), slice(nbytes, 2 * nbytes)
    if not c.cuda:
        streams: list[Any] = [None, None]
        sync: Any = lambda: None  # noqa: E731
    else:
        import torch

        streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        sync = torch.cuda.synchronize
    copies = [
        one_copy(c.host[lo], c.dev[lo], nbytes, streams[0]),
        one_copy(c.dev[hi], c.host[hi], nbytes, streams[1]),
    ]
    times = []
    for _ in range(reps + 1):
        sync()
        t0 = time.perf_counter()
        for copy in copies:
            copy()
        sync()
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / min(times[1:]) / 1e9


class Ceilings:
    """The link's ceiling measured more than once in a run (its start, middle and end), the best
    of each direction kept, and which measurement gave it."""

    def __init__(self, nbytes: int = LINK_BYTES, copier: Copier | None = None) -> None:
        self.nbytes = nbytes
        self.copier = copier
        self.measured: list[dict[str, Any]] = []

    def measure(self, when: str) -> dict[str, float]:
        c = ceiling(self.nbytes, copier=self.copier)
        self.measured.append({"when": when, **c})
        return c

    def best(self, direction: str) -> float:
        """The best so far (``nan`` before the first measurement)."""
        return max((m[direction] for m in self.measured), default=float("nan"))

    @property
    def gbps(self) -> dict[str, float]:
        return {d: self.best(d) for d in DIRECTIONS}

    def best_from(self) -> dict[str, str]:
        """Per direction, when the best was measured (``start``, ``middle``, ``end``)."""
        out = {}
        for d in DIRECTIONS:
            best = max(self.measured, key=lambda m: float(m[d]), default=None)
            out[d] = "-" if best is None else str(best["when"])
        return out

    def describe(self) -> str:
        """``h2d 55.1 GB/s (best of start 54.9, middle 55.1, end 55.0), d2h ...``."""
        parts = []
        for d in DIRECTIONS:
            each = ", ".join(f"{m['when']} {m[d]:.1f}" for m in self.measured)
            parts.append(f"{d} {self.best(d):.1f} GB/s (best of {each})")
        return "; ".join(parts)


# ---- block ids --------------------------------------------------------------------------------


def cpu_block_ids(rng: np.random.Generator, n: int, num_cpu_blocks: int, order: str) -> np.ndarray:
    """``n`` distinct CPU block ids out of ``num_cpu_blocks``: ``adjacent``, one after the other
    from a random first; ``reversed``, the same from the last one down; ``random``, in random
    order with no two consecutive ids adjacent in memory (``|c[i + 1] - c[i]| != 1``: no rows
    that could be joined)."""
    if n > num_cpu_blocks:
        raise ValueError(f"{n} CPU blocks do not fit in {num_cpu_blocks}")
    if order in ("adjacent", "reversed"):
        first = int(rng.integers(0, num_cpu_blocks - n + 1))
        ids = np.arange(first, first + n, dtype=np.int64)
        return ids if order == "adjacent" else ids[::-1].copy()
    if order != "random":
        raise ValueError(f"CPU block order must be one of {ORDERS}, not {order!r}")
    for _ in range(10_000):
        c = rng.permutation(num_cpu_blocks)[:n].astype(np.int64)
        if n < 2 or bool((np.abs(np.diff(c)) != 1).all()):
            return c
    raise ValueError(f"no order of {n} of {num_cpu_blocks} CPU blocks without adjacent ones")


# ---- the command line -------------------------------------------------------------------------


def parser(
    doc: str | None, *, pages: str, reps: int, cpu_blocks: str = "random", **shared: Any
) -> argparse.ArgumentParser:
    """The arguments every KV-block benchmark takes: ``--pages`` (KiB), ``--layers``, ``--blocks``
    (per transfer), ``--reps``, ``--cpu-blocks`` (orders), ``--option KEY=VALUE`` (repeatable, to
    the handler and its engine) and ``--json``, on :func:`blockswap_bench.cli.parser` (``shared``:
    its other options, e.g. ``backend=True``). ``doc``: the script's docstring, for ``--help``."""
    ap = base_parser(doc, reps=reps, **shared)
    ap.add_argument("--pages", type=kib_list, default=kib_list(pages),
                    help=f"page sizes in KiB, comma list (default {pages})")  # fmt: skip
    ap.add_argument("--layers", type=int, default=80, help="layer tensors (default 80)")
    ap.add_argument("--blocks", type=int, default=32, help="blocks per transfer (default 32)")
    ap.add_argument("--cpu-blocks", type=choices(ORDERS), default=choices(ORDERS)(cpu_blocks),
                    help="CPU block orders, comma list: random (no two adjacent), adjacent "
                         f"(one after the other) (default {cpu_blocks})")  # fmt: skip
    ap.add_argument("--option", action="append", default=[], type=option, metavar="KEY=VALUE",
                    help="a handler or engine option (repeatable): ints as ints, "
                         "true/false as bools")  # fmt: skip
    return ap


# ---- the figures ------------------------------------------------------------------------------


_META: dict[str, Any] = {}


def write_figures(
    path: str, script: str, ceil: dict[str, float] | None, rows: list[Any], **extra: Any
) -> None:
    """A benchmark's figures as JSON: GPU, driver, date, the command that made them (without the
    output folder, which is the machine's), the ceiling measured in the same run (``None``: a
    script that records its own in ``extra``), the rows, the run's metadata (versions, host), and
    ``extra``. Written to a temporary file first, then renamed: a run cut short leaves the last
    complete file."""
    args = [os.path.basename(a) if a == path else a for a in sys.argv[1:]]
    if not _META:
        _META.update(run_metadata())  # once per run: it asks nvidia-smi
    meta = dict(_META)
    figures = {
        "gpu": meta.get("gpu") or "none (host backend)",
        "driver": meta.get("driver"),
        "date": time.strftime("%Y-%m-%d"),
        "time": meta.get("time"),
        "command": " ".join(["python", f"benches/{script}", *args]),
        **({} if ceil is None else {"ceiling_gbps": ceil}),
        **extra,
        "meta": meta,
        "rows": rows,
    }
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(figures, f, indent=1, default=str)
    os.replace(tmp, path)
