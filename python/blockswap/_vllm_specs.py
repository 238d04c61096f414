"""vLLM's transfer specs cut into the engine's groups for the plug-in's worker
(:class:`blockswap.vllm.BlockswapOffloadingWorker`): :class:`GroupMap` holds how vLLM's KV-cache
groups map to the handlers' groups, and cuts a spec the usual way (:meth:`GroupMap.plain_groups`,
the core's groups made here) or the general one (:meth:`GroupMap.split`, through the handler's
``transfer_async``). Where every group has one writer a spec goes to the core without either
(the worker's ``_submit``): one group that is one handler group through the core's
``submit_group``, any other through ``submit_spec``, which cuts it as
:meth:`GroupMap.plain_groups` does. A spec that names no block, or that the core refuses, is
read again by :meth:`GroupMap.plain_groups`, which names what is wrong."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from . import _vllm_region as _region
from ._core import chunk_blocks, chunk_count, chunk_skip
from .errors import ConfigError

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec, LoadStoreSpec


@dataclass(frozen=True)
class GroupMap:
    """How vLLM's KV-cache groups map to the handlers' groups."""

    #: Per vLLM group, its first handler group, or None for a group without pages.
    groups: list[int | None]
    #: Per vLLM group, its writer classes: ``(num_writers, writer_index, bytes vLLM counts per
    #: block)``, a handler group each per sub-block index.
    classes: list[list[tuple[int, int, int]]]
    #: Handler groups per vLLM group and writer class: ``blocks_per_chunk`` on a shared region
    #: (one per sub-block index of a chunk), else one.
    fanout: int
    blocks_per_chunk: int
    num_chunks: int

    @cached_property
    def plain(self) -> list[int] | None:
        """Where each vLLM group with pages has one writer class of one writer (every rank
        storing every block it names), mapped to one handler group, or with a shared region to
        one per sub-block index of a chunk: per vLLM group, the bytes vLLM counts per block (0
        for a group without pages), for :meth:`plain_groups`; None otherwise."""
        if all(len(c) == 1 and c[0][0] == 1 for c in self.classes if c):
            return [c[0][2] if c else 0 for c in self.classes]
        return None

    def plain_groups(
        self, handler: Any, gpu_spec: GPULoadStoreSpec, cpu_spec: LoadStoreSpec
    ) -> tuple[list[tuple[int, npt.ArrayLike, int, npt.ArrayLike, int]], int, int]:
        """The usual case (:attr:`plain`: one writer per group) as the core's groups for
        ``handler`` (:meth:`SingleDirectionHandler._issue`), the blocks they move and the bytes
        vLLM counts: vLLM's ids as vLLM gave them, cut per group (the core reads int32 and
        int64 arrays in place, converts anything else and checks every id), the sub-blocks
        skipped in a group's first chunk from vLLM's block index. The counts are checked as the
        general path checks them, to name them.

        A group is one handler group, unless a shared region holds ``blocks_per_chunk`` > 1
        blocks a chunk: then handler group ``j`` of it holds sub-block index ``j`` of every
        chunk (its pages in every cell), and block ``i``, at index ``(skip + i) % f`` of chunk
        ``(skip + i) // f``, goes to it with that chunk's id: strided views of vLLM's arrays,
        as :meth:`split` cuts them through the core's ``chunk_blocks`` (the core checks the
        chunk ids against the region's rows).

        The handler's :meth:`~SingleDirectionHandler.transfer_async` would read the same ids
        again, through a spec of any shape: on a thread back from a step's other work each
        Python call costs several µs, and this path makes two small ones into the core per
        group (``chunk_skip``, ``chunk_count``) and no other (docs/benchmarks.md: the plug-in's
        usual case; a submission's ids read once, in the core)."""
        sizes: Sequence[int] = gpu_spec.group_sizes
        starts: Sequence[int] = gpu_spec.block_indices
        plain = self.plain
        assert plain is not None  # the caller's test
        _check_groups(sizes, starts, len(plain))
        f, fan, d2h = self.blocks_per_chunk, self.fanout, handler.gpu_to_cpu
        gpu = gpu_spec.block_ids
        cpu = getattr(cpu_spec, "block_ids", cpu_spec)
        groups: list[tuple[int, npt.ArrayLike, int, npt.ArrayLike, int]] = []
        if len(plain) == 1 and fan == 1:
            # One group: vLLM's arrays whole, no slice (the loop below costs this usual case
            # about 0.8 µs more, warm, on the development machine).
            n, _, skip, m = _group_span(f, 0, sizes[0], starts[0])
            _check_taken(n, m, len(gpu), len(cpu))
            src, dst = handler._group_tables(0)
            groups.append((src, gpu, dst, cpu, skip) if d2h else (src, cpu, dst, gpu, skip))
            return groups, n, n * plain[0]
        if fan > 1:
            gpu, cpu = np.asarray(gpu), np.asarray(cpu)
        o = c = size = 0
        for g, (n_g, start_g) in enumerate(zip(sizes, starts)):
            n, _, skip, m = _group_span(f, g, n_g, start_g)
            base = self.groups[g]
            if base is None:
                if n:
                    raise ConfigError(f"group {g} has no pages but the spec names {n} blocks")
                continue
            ids, cs = gpu[o : o + n], cpu[c : c + m]
            o, c, size = o + n, c + m, size + n * plain[g]
            # (handler group after the first, GPU ids, chunk ids, sub-blocks skipped)
            if fan == 1:
                pieces = [(0, ids, cs, skip)]
            else:
                pieces = []
                for j in range(f):
                    first = (j - skip) % f  # the first block at sub-block index j of its chunk
                    gj = ids[first::f]
                    c0 = (skip + first) // f
                    pieces.append((j, gj, cs[c0 : c0 + len(gj)], 0))
            for j, gj, cj, sk in pieces:
                if len(gj):
                    src, dst = handler._group_tables(base + j)
                    groups.append((src, gj, dst, cj, sk) if d2h else (src, cj, dst, gj, sk))
        _check_taken(o, c, len(gpu), len(cpu))
        return groups, o, size

    def split(
        self, gpu_spec: GPULoadStoreSpec, cpu_spec: LoadStoreSpec, store: bool
    ) -> tuple[list[npt.NDArray[np.int64]], list[npt.NDArray[np.int64]], list[int] | None, int]:
        """vLLM's flat ids cut per KV-cache group: ``(GPU ids, CPU ids, first block indices,
        bytes vLLM counts)``, ids per handler group. A group takes ``ceil((skip + n) /
        blocks_per_chunk)`` chunks of the flat list (none for no block); the engine checks each
        group's count again. With a shared region the core maps each group's chunks to the
        sub-blocks its blocks use (``chunk_blocks``), and block ``i`` goes to handler group
        ``(g, sub-block index, writer class)`` with its chunk id. A ``store`` of a class with
        several writers keeps the blocks whose canonical page (``chunk * blocks_per_chunk +
        sub-block index``) is this rank's turn (vLLM's ``CanonicalPageMapping.is_writer``).
        The usual case takes :meth:`plain_groups` instead."""
        sizes: Sequence[int] = gpu_spec.group_sizes
        starts: Sequence[int] = gpu_spec.block_indices
        _check_groups(sizes, starts, len(self.groups))
        f = self.blocks_per_chunk
        gpu = np.asarray(gpu_spec.block_ids, dtype=np.int64)
        chunks = np.asarray(getattr(cpu_spec, "block_ids", cpu_spec), dtype=np.int64)
        fan = self.fanout
        out_gpu: list[npt.NDArray[np.int64]] = []
        out_cpu: list[npt.NDArray[np.int64]] = []
        out_start: list[int] = []
        o = c = size = 0
        for g, (n_g, start_g) in enumerate(zip(sizes, starts)):
            n, start, skip, m = _group_span(f, g, n_g, start_g)
            if self.groups[g] is None:
                if n:
                    raise ConfigError(f"group {g} has no pages but the spec names {n} blocks")
                continue
            ids, cs = gpu[o : o + n], chunks[c : c + m]
            o, c = o + n, c + m
            if fan == 1:
                # The private cache (one class), or one block per chunk: page id = chunk id.
                for nw, wi, nbytes in self.classes[g]:
                    gk, ck = _region.writer_blocks(ids, cs, cs, nw, wi, store)
                    out_gpu.append(gk)
                    out_cpu.append(ck)
                    out_start.append(start)
                    size += gk.shape[0] * nbytes
                continue
            # The chunk rule in the core: the sub-block (chunk * f + index) of each block.
            sub = chunk_blocks(cs, f, ids.shape[0], skip, self.num_chunks) if n else cs
            for j in range(fan):
                first = (j - skip) % f  # the first block at sub-block index j of its chunk
                gj, cj = ids[first::f], sub[first::f] // f
                for nw, wi, nbytes in self.classes[g]:
                    gk, ck = _region.writer_blocks(gj, cj, cj * f + j, nw, wi, store)
                    out_gpu.append(gk)
                    out_cpu.append(ck)
                    size += gk.shape[0] * nbytes
        _check_taken(o, c, gpu.shape[0], chunks.shape[0])
        return out_gpu, out_cpu, (out_start if fan == 1 else None), size


def _check_groups(sizes: Sequence[int], starts: Sequence[int], groups: int) -> None:
    """The spec names a size and a block index per KV-cache group, or a ConfigError."""
    if len(sizes) != groups or len(starts) != groups:
        raise ConfigError(
            f"the spec has {len(sizes)} group sizes and {len(starts)} block indices for "
            f"{groups} KV-cache group{'s' * (groups != 1)}"
        )


def _group_span(f: int, g: int, n: Any, start: Any) -> tuple[int, int, int, int]:
    """Group ``g``'s ``(blocks, first block index, sub-blocks skipped in its first chunk,
    chunks)`` from vLLM's group size and block index, ``f`` blocks per chunk."""
    n, start = int(n), int(start)
    if n < 0 or start < 0:
        raise ConfigError(f"group {g}: {n} blocks from block index {start}")
    skip = chunk_skip(f, n, start)
    return n, start, skip, chunk_count(f, n, skip)


def _check_taken(blocks: int, chunks: int, named_blocks: int, named_chunks: int) -> None:
    """The spec names as many GPU blocks and CPU chunks as its groups take, or a ConfigError."""
    if blocks != named_blocks or chunks != named_chunks:
        raise ConfigError(
            f"the groups take {blocks} GPU blocks and {chunks} CPU chunks, the spec names "
            f"{named_blocks} and {named_chunks}"
        )
