"""Pieces every benchmark shares: units and formatting, progress with elapsed time, repetition
with a time budget, CUDA-event timing, scattered block ids, and the run's metadata.

Nothing here imports torch at module import: the package works without it (host backend).
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from ..engine import info

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

T = TypeVar("T")


# ---- formatting -------------------------------------------------------------------------------


def fmt_bytes(n: int) -> str:
    """``4 KiB``, ``2 MiB``, ``2.5 GiB``: binary units, no decimals where the value is whole."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.3g} {unit}"
    return f"{n} B"


def fmt_count(n: int) -> str:
    return f"{n:,}"


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def p90(xs: Sequence[float]) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), 90))


def slug(text: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``h100-80gb-hbm3``: for folder names."""
    s = re.sub(r"^nvidia\s+", "", text.strip(), flags=re.IGNORECASE)
    s = re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-")
    return s or "unknown"


# ---- progress and repetition ------------------------------------------------------------------


class Progress:
    """Prints one line per step with the seconds elapsed since the run began."""

    def __init__(self, enabled: bool = True, stream: Any = None) -> None:
        self.t0 = time.perf_counter()
        self.enabled = enabled
        self.stream = stream

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def __call__(self, msg: str) -> None:
        if self.enabled:
            print(f"[{self.elapsed():7.1f} s] {msg}", file=self.stream or sys.stdout, flush=True)


def repeat(
    measure: Callable[[], T],
    *,
    warmup: int = 1,
    min_reps: int = 3,
    max_reps: int = 20,
    budget_s: float = 0.25,
    hurry: bool = False,
) -> list[T]:
    """Samples of ``measure()``: ``warmup`` discarded calls, then as many as fit in ``budget_s``
    (judged from the first measured call's wall time), at least ``min_reps`` and at most
    ``max_reps``. ``hurry``: only ``min_reps`` (a section past its time budget)."""
    for _ in range(warmup):
        measure()
    t0 = time.perf_counter()
    first = measure()
    cost = time.perf_counter() - t0
    reps = min_reps if hurry else max(min_reps, min(max_reps, int(budget_s / max(cost, 1e-9))))
    return [first] + [measure() for _ in range(max(0, reps - 1))]


def address(buf: Any) -> int:
    """Address of a torch tensor's or a numpy array's first byte."""
    return int(buf.data_ptr()) if hasattr(buf, "data_ptr") else int(buf.ctypes.data)


def scatter(rng: np.random.Generator, n: int, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Source and destination block ids: ``n`` distinct slots out of ``slots`` on each side, in
    random order (consecutive descriptors are not contiguous, so nothing coalesces)."""
    if n > slots:
        raise ValueError(f"{n} blocks do not fit in {slots} slots")
    return (
        rng.permutation(slots)[:n].astype(np.int64),
        rng.permutation(slots)[:n].astype(np.int64),
    )


# ---- CUDA -------------------------------------------------------------------------------------


def cuda_ready() -> bool:
    """Whether blockswap's CUDA backend and torch's CUDA can both be used here."""
    if not info()["cuda"]:
        return False
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def gpu_timed(
    stream: Any, issue: Callable[[], None], finish: Callable[[], None] | None = None
) -> tuple[float, float]:
    """``(GPU seconds, host seconds)`` of one piece of work issued on ``stream``: CUDA events
    recorded on ``stream`` before and after ``issue()`` (the events time what the stream ran,
    including any wait for the host to submit), ``perf_counter`` around ``issue()`` alone (the
    host's submission). ``finish()`` then waits for the work by its own means (an engine's
    ``wait``), before the end event is synchronised."""
    import torch

    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record(stream)
    t0 = time.perf_counter()
    issue()
    t1 = time.perf_counter()
    end.record(stream)
    if finish is not None:
        finish()
    end.synchronize()
    return start.elapsed_time(end) / 1e3, t1 - t0


def cuda_time_on(stream: Any, fn: Callable[[], Any]) -> float:
    """GPU seconds of ``fn()`` issued on ``stream`` (CUDA events on that stream)."""
    import torch

    def issue() -> None:
        with torch.cuda.stream(stream):
            fn()

    return gpu_timed(stream, issue)[0]


def wall_timed(issue: Callable[[], None], finish: Callable[[], None]) -> tuple[float, float]:
    """``(wall seconds of issue + finish, host seconds of issue)``: the host backend's timing."""
    t0 = time.perf_counter()
    issue()
    t1 = time.perf_counter()
    finish()
    return time.perf_counter() - t0, t1 - t0


# ---- the handler's choice ---------------------------------------------------------------------


def handler_route(h: Any, direction: str) -> Any:
    """The route (``kernel_below``, ``launcher``, ``reason``) a
    :class:`~blockswap.handler.CpuGpuHandlers` took for ``direction``."""
    return (h.gpu_to_cpu_handler if direction == "d2h" else h.cpu_to_gpu_handler).route


def route_choice(route: Any, page_bytes: int) -> str:
    """``"kernel"`` or ``"dma"``: what ``route`` does with pages of ``page_bytes``."""
    if route is None:
        return "unknown"
    if not route.kernel_below:
        return "dma"
    return "kernel" if page_bytes < route.kernel_below else "dma"


# ---- metadata ---------------------------------------------------------------------------------


def _nvidia_smi() -> dict[str, str]:
    fields = [
        "name",
        "driver_version",
        "pcie.link.gen.current",
        "pcie.link.gen.max",
        "pcie.link.width.current",
        "pcie.link.width.max",
    ]
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    first = out.strip().splitlines()[0] if out.strip() else ""
    values = [v.strip() for v in first.split(",")]
    return dict(zip(fields, values)) if len(values) == len(fields) else {}


def run_metadata(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Date, command line, versions (Python, numpy, torch, CUDA, Triton, blockswap), the host,
    and the GPU with its driver and PCIe link where there is one."""
    now = datetime.datetime.now().astimezone()
    argv = list(sys.argv if argv is None else argv)
    meta: dict[str, Any] = {
        "date": now.strftime("%Y-%m-%d"),
        "time": now.isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in argv),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "numpy": np.__version__,
        "blockswap": info(),
    }
    try:
        import torch
    except ImportError:
        meta["torch"] = None
        return meta
    meta["torch"] = torch.__version__
    meta["torch_cuda"] = torch.version.cuda
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        meta["gpu"] = torch.cuda.get_device_name()
        meta["gpu_memory_bytes"] = int(props.total_memory)
        meta["gpu_sms"] = int(props.multi_processor_count)
        meta["gpu_capability"] = f"{props.major}.{props.minor}"
        smi = _nvidia_smi()
        meta["driver"] = smi.get("driver_version")
        meta["nvidia_smi"] = smi
    else:
        meta["gpu"] = None
    return meta
