"""A vLLM job the engine cannot take as one transfer, moved in parts.

vLLM sizes its own worker's descriptor buffers to each job and asserts that every submission
succeeds. blockswap's engine carries at most ``max_descriptors`` copies a transfer (2**20 at
most) in a descriptor pool of ``pool_bytes``; a plan of one copy a page (``path="dma"``, a
mirrored cache) can need more for one long prompt: 64 layers of 16,400 blocks are 1,049,600
pages. Such a job is cut in halves at chunk boundaries, again where a half is still too large,
and each part is issued as a transfer of its own; vLLM hears of the job once, when its last
part is done (failed if any part failed).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ._core import InvalidTransferError, PoolExhaustedError

#: What the engine's refusal of a transfer for its descriptor count says (``rust/descriptor.rs``).
_TOO_MANY = "descriptors in one transfer; at most"


def too_large(e: BaseException) -> bool:
    """Whether ``e`` refused a transfer for its size alone: more copies than one transfer may
    carry, or a descriptor pool with nothing in flight that still has no room for it."""
    if isinstance(e, InvalidTransferError):
        return _TOO_MANY in str(e)
    return isinstance(e, PoolExhaustedError)


@dataclass
class Spec:
    """A part of a vLLM ``GPULoadStoreSpec``: the same three fields, which the worker reads."""

    block_ids: np.ndarray
    group_sizes: list[int]
    block_indices: list[int]


Part = tuple[Spec, np.ndarray]
"""A part of a job: its GPU spec, and the CPU chunk ids it moves to or from."""


def halves(gpu_spec: Any, cpu_spec: Any, blocks_per_chunk: int) -> tuple[Part, Part] | None:
    """The job of ``gpu_spec`` and ``cpu_spec`` (a spec or its chunk ids) in two parts, each
    naming the chunks its blocks lie in (vLLM's rule, partial first and last chunks included):
    each KV-cache group of two blocks or more cut at the chunk boundary nearest its middle (at
    its middle block where no boundary lies inside it: both parts then name the chunk cut, each
    moving its own sub-blocks of it), the first part holding the blocks before the cut; where
    every group holds one block at most, the groups split between the parts. None for a job of
    one block, or a spec that does not add up (the worker then names what is wrong with it)."""
    f = blocks_per_chunk
    sizes = [int(n) for n in gpu_spec.group_sizes]
    starts = [int(s) for s in gpu_spec.block_indices]
    gpu = np.asarray(gpu_spec.block_ids, dtype=np.int64)
    cpu = np.asarray(getattr(cpu_spec, "block_ids", cpu_spec), dtype=np.int64)
    if len(sizes) != len(starts) or sum(sizes) != len(gpu) or min(starts, default=0) < 0:
        return None
    groups = []  # per group: (gpu ids, size, start, chunk ids)
    g_at = c_at = 0
    for n, s in zip(sizes, starts):
        chunks = -(-(n + s % f) // f) if n else 0
        groups.append((gpu[g_at : g_at + n], n, s, cpu[c_at : c_at + chunks]))
        g_at, c_at = g_at + n, c_at + chunks
    if c_at != len(cpu):
        return None
    pieces: tuple[list[Any], list[Any]] = ([], [])
    if max(sizes, default=0) >= 2:
        for g, n, s, c in groups:
            if n < 2:
                pieces[0].append((g, n, s, c))
                pieces[1].append((g[:0], 0, s, c[:0]))
                continue
            cut = (2 * s + n + f) // (2 * f) * f
            a = cut - s if s < cut < s + n else n // 2
            pieces[0].append((g[:a], a, s, c[: -(-(s % f + a) // f)]))
            pieces[1].append((g[a:], n - a, s + a, c[(s % f + a) // f :]))
    else:
        held = [k for k, n in enumerate(sizes) if n]
        if len(held) < 2:
            return None
        second = set(held[len(held) // 2 :])
        for k, (g, n, s, c) in enumerate(groups):
            empty = (g[:0], 0, s, c[:0])
            pieces[0].append(empty if k in second else (g, n, s, c))
            pieces[1].append((g, n, s, c) if k in second else empty)
    first, second_part = (
        (
            Spec(np.concatenate([p[0] for p in part]), [p[1] for p in part], [p[2] for p in part]),
            np.concatenate([p[3] for p in part]),
        )
        for part in pieces
    )
    return first, second_part


@dataclass
class Job:
    """A job issued in parts: the parts' transfer ids, how many have not been reported (one
    more while its parts are being issued), and what the reported ones came to."""

    parts: list[int] = field(default_factory=list)
    left: int = 1
    ok: bool = True
    seconds: float = 0.0
    size: int = 0


Result = tuple[int, bool, int, float]
"""A job's result in vLLM's terms: job id, success, bytes, seconds."""


class Split:
    """The jobs a worker issued in parts, each part a transfer of its own under an id past any
    vLLM job id."""

    def __init__(self) -> None:
        self.jobs: dict[int, Job] = {}
        self.part_of: dict[int, int] = {}
        self._ids = itertools.count(1 << 63)

    def issue(
        self,
        job_id: int,
        todo: list[Part],
        issue: Callable[[int, Part], int | None],
        blocks_per_chunk: int,
    ) -> tuple[Job, BaseException | None]:
        """Issues ``todo``'s parts of job ``job_id`` with ``issue(part id, part)`` (the bytes it
        moves, or None where it moves none), halving again a part still too large; stops at the
        first other refusal, which it returns. Until :meth:`issued`, the job is not reported
        whatever its parts do."""
        job = self.jobs[job_id] = Job()
        while todo:
            part, pid = todo.pop(0), next(self._ids)
            try:
                size = issue(pid, part)
            except Exception as e:
                again = too_large(e) and halves(part[0], part[1], blocks_per_chunk)
                if not again:
                    return job, e
                todo[:0] = again
                continue
            if size is not None:
                job.parts.append(pid)
                job.left += 1
                job.size += size
                self.part_of[pid] = job_id
        return job, None

    def issued(self, job_id: int, ok: bool) -> Result | None:
        """The issuing of job ``job_id`` over (``ok``: every part issued): its result where its
        parts were all reported meanwhile, else None. A job none of whose parts were issued is
        forgotten."""
        job = self.jobs[job_id]
        if not job.parts:
            del self.jobs[job_id]
            return None
        return self._done(job_id, ok, 0.0)

    def reported(self, job_id: int, ok: bool, size: int, seconds: float) -> Result | None:
        """A transfer's result: the result of the job it is (not a part), or of the job it was
        the last part of, else None."""
        job = self.part_of.pop(job_id, None)
        if job is None:
            return job_id, ok, size, seconds
        return self._done(job, ok, seconds)

    def _done(self, job_id: int, ok: bool, seconds: float) -> Result | None:
        job = self.jobs[job_id]
        job.left -= 1
        job.ok = job.ok and ok
        job.seconds += seconds
        if job.left:
            return None
        del self.jobs[job_id]
        return job_id, job.ok, job.size, job.seconds

    def in_flight(self, job_ids: Iterable[int]) -> list[int]:
        """The transfers of ``job_ids`` not yet reported: a job's, or its parts'."""
        out: list[int] = []
        for j in job_ids:
            job = self.jobs.get(j)
            out.extend([j] if job is None else [p for p in job.parts if p in self.part_of])
        return out
