"""What the suite's sections share: the profile (sizes, counts, caps, repetitions), the backend,
the big buffers, the copy stream, job ids, and the link's ceiling measured once per run."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from blockswap._bench import buffers, engine_over, measure_ceiling
from blockswap._types import HandlerPath

from .common import GiB, KiB, MiB, Progress, fmt_bytes, repeat

SECTIONS = ("sweep", "handler", "bidir", "interference")


@dataclass(frozen=True)
class Profile:
    """Every size, count and repetition of one run. See :func:`profile`."""

    name: str
    # Sweep: block sizes x blocks per transfer x direction x path.
    sizes: tuple[int, ...]
    counts: tuple[int, ...]
    cap_bytes: int
    """Bytes one transfer may move (per side); larger points are recorded as skipped. The
    host and device buffers are this large."""
    min_reps: int = 3
    max_reps: int = 20
    budget_s: float = 0.25
    """Time one path at one point aims at (more repetitions where they are cheap)."""
    warmup: int = 1
    ceiling_bytes: int = 1 * GiB
    section_budget_s: float = 300.0
    """A section past this many seconds takes only ``min_reps`` from then on."""
    kernel_ctas: int = 16
    interpreter_max_bytes: int = 64 * KiB
    """Host backend: the Triton interpreter's kernel runs only up to this many bytes."""
    # Handler level.
    models: tuple[str, ...] = ()
    """Model keys (:mod:`blockswap_bench.models`); empty: all."""
    handler_blocks: int = 32
    handler_cache_bytes: int = 2 * GiB
    handler_max_blocks: int = 1024
    handler_warmup: int = 5
    handler_reps: int = 100
    handler_paths: tuple[HandlerPath, ...] = ("auto", "dma", "kernel")
    handler_forced_reps: int = 30
    """Repetitions of the forced paths (``dma``, ``kernel``) beside ``auto``."""
    handler_max_layers: int | None = None
    """Tiny runs: only this many layers per model (recorded in the rows)."""
    baseline_max_reps: int = 10
    # Bidirectional.
    bidir_sizes: tuple[int, ...] = (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 2 * MiB)
    bidir_blocks: int = 2560
    bidir_bytes: int = 512 * MiB
    """Bytes per direction at most: large blocks move fewer than ``bidir_blocks``."""
    # Interference.
    gemm_n: int = 8192
    gemm_reps: int = 30
    interference_ctas: tuple[int, ...] = (4, 8, 16)
    interference_block: int = 16 * KiB
    interference_blocks: int = 8192
    interference_launch_bytes: tuple[int, ...] = (16 * MiB, 4 * MiB, 1 * MiB)
    """Kernel rows with launches of at most this many bytes each (on the most CTAs)."""


def _pow2(lo: int, hi: int) -> tuple[int, ...]:
    out = []
    s = lo
    while s <= hi:
        out.append(s)
        s *= 2
    return tuple(out)


def profile(name: str, backend: str) -> Profile:
    """``full``: what ``benches/suite.py`` runs; ``quick``: the short version (``make run``);
    ``tiny``: seconds, for tests. The host backend gets smaller buffers than a GPU."""
    cuda = backend == "cuda"
    if name == "full" and cuda:
        return Profile(
            name="full",
            sizes=_pow2(1 * KiB, 4 * MiB),
            counts=(16, 256, 2560, 10_000),
            cap_bytes=4 * GiB,
        )
    if name == "full":
        return Profile(
            name="full",
            sizes=_pow2(1 * KiB, 4 * MiB),
            counts=(16, 256, 2560, 10_000),
            cap_bytes=256 * MiB,
            ceiling_bytes=256 * MiB,
            handler_cache_bytes=256 * MiB,
            handler_paths=("auto",),
            bidir_sizes=(4 * KiB, 64 * KiB, 2 * MiB),
            bidir_bytes=64 * MiB,
        )
    if name == "quick" and cuda:
        return Profile(
            name="quick",
            sizes=(4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB),
            counts=(256, 2560),
            cap_bytes=1 * GiB,
            max_reps=8,
            budget_s=0.1,
            ceiling_bytes=256 * MiB,
            section_budget_s=60.0,
            handler_cache_bytes=512 * MiB,
            handler_warmup=5,
            handler_reps=30,
            handler_paths=("auto",),
            baseline_max_reps=3,
            bidir_sizes=(16 * KiB, 256 * KiB),
            bidir_bytes=256 * MiB,
            gemm_reps=10,
            interference_ctas=(16,),
            interference_launch_bytes=(),
        )
    if name == "quick":
        return Profile(
            name="quick",
            sizes=(1 * KiB, 4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB),
            counts=(16, 256, 2560),
            cap_bytes=64 * MiB,
            max_reps=6,
            budget_s=0.05,
            ceiling_bytes=64 * MiB,
            section_budget_s=20.0,
            handler_blocks=16,
            handler_cache_bytes=64 * MiB,
            handler_warmup=2,
            handler_reps=10,
            handler_paths=("auto",),
            baseline_max_reps=3,
            bidir_sizes=(16 * KiB, 256 * KiB),
            bidir_blocks=2560,
            bidir_bytes=32 * MiB,
        )
    if name == "tiny":
        return Profile(
            name="tiny",
            sizes=(1 * KiB, 64 * KiB),
            counts=(16, 256),
            cap_bytes=4 * MiB,
            min_reps=1,
            max_reps=2,
            budget_s=0.0,
            ceiling_bytes=4 * MiB,
            section_budget_s=10.0,
            handler_blocks=4,
            handler_cache_bytes=1 * MiB,
            handler_max_blocks=8,
            handler_warmup=1,
            handler_reps=3,
            handler_paths=("auto",),
            handler_forced_reps=2,
            handler_max_layers=2,
            baseline_max_reps=1,
            bidir_sizes=(4 * KiB,),
            bidir_blocks=64,
            bidir_bytes=1 * MiB,
            gemm_n=1024,
            gemm_reps=3,
            interference_ctas=(16,),
            interference_blocks=256,
            interference_launch_bytes=(64 * KiB,),
        )
    raise ValueError(f"unknown profile {name!r}: full, quick or tiny")


@dataclass
class Context:
    """State of one run, shared by its sections."""

    profile: Profile
    backend: str
    """``"cuda"`` or ``"host"``."""
    log: Progress = field(default_factory=Progress)
    seed: int = 0
    ceilings: dict[str, dict[str, Any]] = field(default_factory=dict)
    rng: np.random.Generator = field(init=False)
    stream: Any = field(init=False, default=None)
    _job: int = field(init=False, default=0)
    _pools: tuple[Any, Any] | None = field(init=False, default=None)
    _section_t0: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        if self.cuda:
            import torch

            self.stream = torch.cuda.Stream()

    @property
    def cuda(self) -> bool:
        return self.backend == "cuda"

    def job(self) -> int:
        self._job += 1
        return self._job

    # ---- time budget of the section in progress ----------------------------------------------

    def start_section(self) -> None:
        self._section_t0 = time.perf_counter()

    @property
    def hurry(self) -> bool:
        return time.perf_counter() - self._section_t0 > self.profile.section_budget_s

    def repeat(self, measure: Any, **kw: Any) -> list[Any]:
        p = self.profile
        opts: dict[str, Any] = {
            "warmup": p.warmup,
            "min_reps": p.min_reps,
            "max_reps": p.max_reps,
            "budget_s": p.budget_s,
            "hurry": self.hurry,
        }
        opts.update(kw)
        return repeat(measure, **opts)

    # ---- buffers ------------------------------------------------------------------------------

    def pools(self) -> tuple[Any, Any]:
        """``(host, device)`` buffers of ``cap_bytes`` each: pinned host memory and device memory
        as uint8 tensors on CUDA; two numpy arrays on the host backend (the second stands in for
        device memory)."""
        if self._pools is None:
            n = self.profile.cap_bytes
            self.log(
                f"allocating 2 x {fmt_bytes(n)} ({'pinned host + device' if self.cuda else 'host'})"
            )
            self._pools = buffers(n, self.cuda)
        return self._pools

    def engine(self, h2d_stream: int | None = None, d2h_stream: int | None = None) -> Any:
        """An engine with :meth:`pools` registered: on CUDA with the given raw lane streams
        (``None``: its own), on the host backend with the second pool standing in for device
        memory."""
        host, dev = self.pools()
        return engine_over(host, dev, self.cuda, h2d_stream, d2h_stream)

    def free_pools(self) -> None:
        self._pools = None
        if self.cuda:
            import torch

            torch.cuda.empty_cache()

    def src_dst(self, direction: str) -> tuple[Any, Any]:
        host, dev = self.pools()
        return (host, dev) if direction == "h2d" else (dev, host)

    # ---- the link's ceiling -------------------------------------------------------------------

    def measure_ceiling(self, direction: str) -> dict[str, Any]:
        """One large copy in ``direction``: a pinned ``copy_`` timed by CUDA events, or one
        ``memcpy`` (numpy ``copyto``) on the host backend."""
        src, dst = self.src_dst(direction)
        nbytes = min(self.profile.ceiling_bytes, self.profile.cap_bytes)
        stream = self.stream if self.cuda else None
        return measure_ceiling(src, dst, nbytes, stream, min(5, self.profile.max_reps))

    def ceiling(self, direction: str) -> float:
        """The link's ceiling in GB/s for ``direction``, measured the first time it is asked."""
        if direction not in self.ceilings:
            c = self.measure_ceiling(direction)
            self.ceilings[direction] = c
            self.log(f"ceiling {direction}: {c['gbps']:.2f} GB/s ({c['what']})")
        return float(self.ceilings[direction]["gbps"])
