"""What the reliability tests (``tests/test_reliability_*.py``) share: job ids and sizes, the
threads of this process, polling, the engine and handler scenes around a bad call, a fresh
interpreter for code that may crash.

The reliability tests run on the host backend: bad input, injected faults, shutdown, threads,
load, and property tests of the Python entry points. ``docs/reliability.md`` lists every case,
the error a user gets and the command that reproduces it.

Every refusal is checked between two transfers that must come through intact: one submitted
before the bad call (in flight or finished, its result not yet reported) and one after it under
the job id the bad call used (so the refused call left nothing live behind), with every byte of
the destination memory accounted for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from blockswap import Engine
from blockswap.handler import CpuGpuHandlers
from kv_helpers import block_bytes, fill_random, raw, strided

KiB = 1 << 10
MiB = 1 << 20
BEFORE, BAD = 1, 7  # job ids: the transfer before the bad call; the bad call's (reused after)
# A wait this long means a deadlock or a leak (what it waits for takes well under a second).
DEADLOCK = 300.0


def threads() -> frozenset[int]:
    """Task ids of this process's OS threads (the host backend runs one worker thread per
    engine). Ids, not a count: a thread of an earlier test may leave while a test measures.

    torch starts its intra-op thread pool at the first operation large enough to split (a
    block-major CPU cache is one such tensor): it is started here first, so that its threads are
    part of every baseline rather than counted as threads a test left behind (once: the RSS
    tests call this in their loops)."""
    if not _POOL_STARTED:
        torch.ones(1 << 20).add_(1)
        _POOL_STARTED.append(True)
    return frozenset(int(t) for t in os.listdir("/proc/self/task"))


_POOL_STARTED: list[bool] = []


def threads_settle(base: frozenset[int]) -> frozenset[int]:
    """The threads that are not in ``base`` once none is left, or after a deadlock-length wait:
    a joined thread leaves /proc/self/task a moment after the join returns."""
    deadline = time.monotonic() + DEADLOCK
    extra = threads() - base
    while extra and time.monotonic() < deadline:
        time.sleep(0.001)
        extra = threads() - base
    return extra


def drain(poll: Callable[[], list[Any]], want: int) -> list[Any]:
    """Polls until ``want`` results came (the caller waited for them first)."""
    out: list[Any] = []
    while len(out) < want:
        got = poll()
        assert got or len(out) < want, "results missing"
        out += got
    return out


class Scene:
    """An engine (at most 16 descriptors per transfer) with a 1 MiB random host source and a
    zeroed 1 MiB "device" destination; the upper halves also carry block tables (64 blocks of
    4 KiB each side). :meth:`before` and :meth:`after` are the transfers around the bad call."""

    def __init__(self) -> None:
        self.eng = Engine("host", max_descriptors=16)
        rng = np.random.default_rng(5)
        self.src = rng.integers(1, 256, MiB, dtype=np.uint8)
        self.dst = np.zeros(MiB, dtype=np.uint8)
        self.eng.register(self.src, kind="host")
        self.eng.register(self.dst, kind="device")
        self.s, self.d = self.src.ctypes.data, self.dst.ctypes.data
        half = MiB // 2
        self.host_table = self.eng.register_table(
            [self.s + half], [4 * KiB], [4 * KiB], 64, "host", "CPU"
        )
        self.dev_table = self.eng.register_table(
            [self.d + half], [4 * KiB], [4 * KiB], 64, "device", "GPU"
        )

    def ids(self, *values: Any) -> np.ndarray:
        return np.array(values, dtype=np.int64)

    def before(self) -> None:
        self.eng.submit(BEFORE, [self.s], [self.d], [64 * KiB], "h2d")

    def after(self) -> None:
        """The job id of the bad call works now; both transfers report once, with their bytes;
        nothing else in the destination changed."""
        eng, s, d = self.eng, self.s, self.d
        eng.submit(BAD, [s + 64 * KiB], [d + 128 * KiB], [64 * KiB], "h2d")
        eng.wait([BEFORE, BAD])
        results = drain(eng.get_finished, 2)
        assert sorted((r.job_id, r.success, r.bytes) for r in results) == [
            (BEFORE, True, 64 * KiB),
            (BAD, True, 64 * KiB),
        ]
        assert eng.get_finished() == []
        assert np.array_equal(self.dst[: 64 * KiB], self.src[: 64 * KiB])
        assert np.array_equal(self.dst[128 * KiB : 192 * KiB], self.src[64 * KiB : 128 * KiB])
        assert not self.dst[64 * KiB : 128 * KiB].any(), "the bad call wrote"
        assert not self.dst[192 * KiB :].any(), "the bad call wrote"
        stats = eng.stats()
        assert stats["in_flight"] == 0
        assert stats["pool"]["free"] == stats["pool"]["slabs"], "a slab did not come home"
        # the block tables still work
        eng.submit_blocks(BAD, self.host_table, self.ids(3), self.dev_table, self.ids(5))
        eng.wait([BAD])
        assert [(r.job_id, r.success) for r in eng.get_finished()] == [(BAD, True)]
        half = MiB // 2
        got = self.dst[half + 5 * 4 * KiB : half + 6 * 4 * KiB]
        assert np.array_equal(got, self.src[half + 3 * 4 * KiB : half + 4 * 4 * KiB])


class StreamLike:
    """Stands in for a torch.cuda.Stream (an object, not the raw handle the core takes)."""

    cuda_stream = 12345


N_GPU, N_CPU = 16, 8


def kv_cache(layers: int = 2, blocks: int = N_GPU) -> list[torch.Tensor]:
    return [strided((2, blocks, 4, 2, 8), torch.bfloat16, 1) for _ in range(layers)]


@dataclass
class HandlerScene:
    """Handlers over a small kv_split cache with random bytes; ``grouped`` makes two KV-cache
    groups (the Python descriptor path) instead of one (the core's block tables)."""

    h: CpuGpuHandlers
    gpu: list[list[torch.Tensor]]
    grouped: bool

    @classmethod
    def make(cls, factor: int, grouped: bool) -> HandlerScene:
        gpu = [kv_cache(), kv_cache(3)] if grouped else [kv_cache()]
        arg: Any = gpu if grouped else gpu[0]
        h = CpuGpuHandlers(arg, N_CPU, layout="kv_split", block_size_factor=factor, backend="host")
        fill_random([t for g in gpu + h.cpu_caches for t in g], torch.Generator().manual_seed(9))
        return cls(h, gpu, grouped)

    def spec(self, src: Any, dst: Any) -> Any:
        """The spec naming ``src`` / ``dst`` in the last group (the first group moves nothing)."""
        return ([[], src], [[], dst]) if self.grouped else (src, dst)

    def all_tensors(self) -> list[torch.Tensor]:
        return [t for g in self.gpu + self.h.cpu_caches for t in g]

    def expect_stored(
        self, want: dict[int, Any], group: int, pairs: Sequence[tuple[int, int]]
    ) -> None:
        """Writes into ``want`` (a snapshot) what storing GPU block ``gb`` into CPU block ``cb``,
        for each ``(gb, cb)`` of ``pairs``, does to group ``group``'s CPU cache."""
        for t, c in zip(self.gpu[group], self.h.cpu_caches[group]):
            for gb, cb in pairs:
                want[raw(c).data_ptr()][block_bytes(c, 1, cb)] = want[raw(t).data_ptr()][
                    block_bytes(t, 1, gb)
                ]


def run_isolated(code: str, timeout: float = DEADLOCK) -> dict[str, Any]:
    """Runs ``code`` in a fresh interpreter (a crash or a hang there, killed after
    ``timeout`` seconds, fails this test, not the run) and returns the JSON object its last
    output line holds."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "panicked" not in proc.stderr, proc.stderr
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def join_all(ts: list[threading.Thread]) -> None:
    for t in ts:
        t.join(DEADLOCK)
        assert not t.is_alive(), f"{t.name} deadlocked"
