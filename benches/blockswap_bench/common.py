"""Pieces every benchmark shares: units and formatting, progress with elapsed time, repetition
with a time budget, CUDA-event timing, scattered block ids, and the run's metadata. Those that
``blockswap bench`` uses too live in :mod:`blockswap._bench` and are imported from there.

Nothing here imports torch at module import: the package works without it (host backend).
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from blockswap._bench import (
    GiB,
    KiB,
    MiB,
    address,
    cuda_ready,
    fmt_bytes,
    gpu_timed,
    handler_route,
    median,
    repeat,
    route_choice,
    scatter,
    wall_timed,
)
from blockswap.engine import info

__all__ = [
    "GiB",
    "KiB",
    "MiB",
    "Progress",
    "address",
    "cuda_ready",
    "cuda_time_on",
    "fmt_bytes",
    "fmt_count",
    "gated_gpu_seconds",
    "gpu_timed",
    "handler_route",
    "median",
    "p90",
    "repeat",
    "route_choice",
    "run_metadata",
    "scatter",
    "slug",
    "wall_timed",
]


# ---- formatting -------------------------------------------------------------------------------


def fmt_count(n: int) -> str:
    return f"{n:,}"


def p90(xs: Sequence[float]) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), 90))


def slug(text: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``h100-80gb-hbm3``: for folder names."""
    s = re.sub(r"^nvidia\s+", "", text.strip(), flags=re.IGNORECASE)
    s = re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-")
    return s or "unknown"


# ---- progress ---------------------------------------------------------------------------------


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


# ---- CUDA -------------------------------------------------------------------------------------


def cuda_time_on(stream: Any, fn: Callable[[], Any]) -> float:
    """GPU seconds of ``fn()`` issued on ``stream`` (CUDA events on that stream)."""
    import torch

    def issue() -> None:
        with torch.cuda.stream(stream):
            fn()

    return gpu_timed(stream, issue)[0]


def gated_gpu_seconds(
    issue: Callable[[], Any], streams: Sequence[Any], spin_cycles: int = 3_000_000
) -> float:
    """GPU seconds of what ``issue()`` queues on ``streams``, with no host time in it: the
    streams wait behind a gate (a spin kernel of ``spin_cycles`` on a stream of its own, long
    enough for the whole queue to be in place before it ends) while Python issues; from the
    gate's end to the last of ``streams`` done."""
    import torch

    torch.cuda.synchronize()
    gate = torch.cuda.Stream()
    start = torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(gate):
        torch.cuda._sleep(spin_cycles)
        start.record()
    for s in streams:
        s.wait_event(start)
    issue()
    ends = []
    for s in streams:
        e = torch.cuda.Event(enable_timing=True)
        e.record(s)
        ends.append(e)
    for e in ends:
        e.synchronize()
    return max(start.elapsed_time(e) for e in ends) * 1e-3


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
