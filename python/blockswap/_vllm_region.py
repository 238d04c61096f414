"""vLLM's shared offload region as blockswap's vLLM worker (:mod:`blockswap.vllm`) uses it: made
as vLLM makes it but with this rank's pre-faulting left to the worker, cut into the pieces the
engines register, faulted in and page-locked from several threads, unlocked at the end; and the
canonical layout's geometry in it (a mapping's fragments, the writers' turns).

Importing this module needs vLLM only where a region is made."""

from __future__ import annotations

import functools
import logging
import mmap
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from . import _core
from ._core import BackendError, BlockswapError
from .errors import ConfigError
from .hostmem import PinProgress

if TYPE_CHECKING:
    import torch
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

#: The worker's logger: what happens to its region is part of what the worker logs.
log = logging.getLogger("blockswap.vllm")


#: The least a row must save for a rank to register only its own cells of the region, a cell a
#: row, rather than whole rows (vLLM's ``MIN_HOST_REGISTER_SAVED_BYTES``): each registration
#: costs a driver call per engine, so a few saved bytes are not worth one.
MIN_SAVED_BYTES = 3 << 20


def own_cells_only(region: SharedOffloadRegion, whole_rows: bool = False) -> bool:
    """Whether this rank registers only its cells of ``region`` (vLLM's rule for its own
    worker): a rank's cells (no ``replicated_layout``, which gives one cell to all, nor
    ``whole_rows``: the canonical layout's pages start each row for every rank) leaving at
    least :data:`MIN_SAVED_BYTES` and a page of each row to the other ranks."""
    if whole_rows or region.rank is None:
        return False
    saved = region._row_stride - region.cpu_page_size
    return saved >= max(region.page_size, MIN_SAVED_BYTES)


def pieces_and_fill(
    region: SharedOffloadRegion, pin_piece_bytes: int, whole_rows: bool = False
) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
    """``region`` cut into the ``(address, bytes)`` pieces the engines register: this rank's
    cells, one a row (rounded out to pages, as vLLM's worker registers them), where
    :func:`own_cells_only`, else whole rows of at most ``pin_piece_bytes``, at least one row (a
    page lies inside one cell, so no copy crosses a piece); this rank's slots still to be
    faulted in, where the region left that to the worker (:func:`new_region`; then no longer
    pending), joined into ranges, cut where its segment files meet and taken from the file where
    vLLM's own order of the slots starts (each rank at a file of its own, as vLLM pre-faults
    them: :func:`starting_at`); and each range's file,
    ``(descriptor, offset in the file)``, where the region opened them (the region's until
    :func:`close_files`)."""
    row = region._row_stride
    per_piece = max(pin_piece_bytes // row, 1) * row
    base, total = region.base_tensor.data_ptr(), region.total_size_bytes
    if own_cells_only(region, whole_rows):
        pieces = merged((base + o, n) for o, n in region.iter_worker_slot_ranges())
    else:
        pieces = [(base + o, min(per_piece, total - o)) for o in range(0, total, per_piece)]
    fill: list[tuple[int, int]] = []
    files: list[tuple[int, int]] = []
    if getattr(region, "_blockswap_fill_pending", False):
        region._blockswap_fill_pending = False
        slots = list(region.iter_worker_slot_ranges())
        joined = merged((base + o, n) for o, n in slots)
        fill, files = in_files(joined, base, region._blockswap_files)
        if slots:
            fill, files = starting_at(fill, files, base + slots[0][0])
    return pieces, fill, files


def starting_at(
    ranges: Sequence[tuple[int, int]], files: Sequence[tuple[int, int]], address: int
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``ranges`` (in address order) and their ``files`` (none, or one a range) rotated to start
    at the range that holds or follows ``address``. The fill takes them in this order, a file a
    thread (``rust/hostmem/fill.rs``); vLLM starts each rank's slots at a file of its own
    (``iter_worker_slot_ranges``), so ranks filling at once fill different files."""
    k = next((i for i, (a, n) in enumerate(ranges) if a + n > address), 0)
    return [*ranges[k:], *ranges[:k]], [*files[k:], *files[:k]]


def in_files(
    ranges: Sequence[tuple[int, int]], base: int, segments: Sequence[tuple[int, int, int]]
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``ranges`` (addresses of a region at ``base``, in address order) cut where its
    ``segments`` meet (``(offset in the region, bytes, descriptor)``, vLLM's files mapped back
    to back, in order), and each piece's ``(descriptor, offset in the file)``; the ranges whole,
    and no files, without segments."""
    if not segments:
        return list(ranges), []
    out: list[tuple[int, int]] = []
    files: list[tuple[int, int]] = []
    # Both in address order: one pass over each (a rank's slots are a range per chunk).
    k = 0
    for a, n in ranges:
        lo, hi = a - base, a - base + n
        while k < len(segments) and segments[k][0] + segments[k][1] <= lo:
            k += 1
        for j in range(k, len(segments)):
            at, length, fd = segments[j]
            if at >= hi:
                break
            s, e = max(lo, at), min(hi, at + length)
            out.append((base + s, e - s))
            files.append((fd, s - at))
    return out, files


def close_files(region: SharedOffloadRegion) -> None:
    """Closes the descriptors of ``region``'s files that :func:`new_region` opened for the fill
    (a region vLLM made has none)."""
    files = getattr(region, "_blockswap_files", [])
    while files:
        os.close(files.pop()[2])


def pin_region(
    pieces: list[tuple[int, int]],
    device: int,
    fill: Sequence[tuple[int, int]] = (),
    files: Sequence[tuple[int, int]] = (),
) -> list[int]:
    """Faults in the ``fill`` ranges from several threads and page-locks the ``pieces`` with the
    driver as each is in (:func:`pieces_and_fill`), with a progress line every
    ``hostmem.PROGRESS_SECONDS`` while it runs; returns the pieces' addresses for
    :func:`unpin_region`. ``files``: each fill range's file
    (:func:`pieces_and_fill`), where its pages are allocated before they are faulted in and the
    threads take a file each (see ``rust/hostmem/fill.rs``). blockswap pins it itself rather than
    through vLLM's ``host_register``, which pins only where vLLM's platform says CUDA and reports a
    failure as a warning: the engine moves page-locked memory only, so a failure here is an
    error, with the driver's reason, and no piece stays locked."""
    note = huge_pages_note(files)
    if note is not None:
        log.info(note)
    counts = _core.AllocProgress()
    progress = PinProgress(counts).start()
    try:
        _core.fill_and_pin(
            list(fill),
            pieces,
            device if pieces else None,
            progress=counts,
            files=list(files) or None,
        )
    except BlockswapError as e:
        total = sum(n for _, n in pieces)
        raise BackendError(
            f"could not page-lock the CPU offload region ({total / (1 << 30):.2f} GiB in "
            f"{len(pieces)} pieces): {e}. blockswap's CUDA engine moves page-locked memory only: "
            "lower cpu_bytes_to_use or raise the memlock limit"
        ) from e
    finally:
        progress.stop()
    return [a for a, _ in pieces]


def merged(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(start, bytes)`` ranges in address order, overlapping or touching ones joined."""
    out: list[tuple[int, int]] = []
    for a, n in sorted(ranges):
        if out and a <= out[-1][0] + out[-1][1]:
            s, m = out[-1]
            out[-1] = (s, max(m, a + n - s))
        else:
            out.append((a, n))
    return out


def new_region(**kwargs: Any) -> SharedOffloadRegion:
    """vLLM's ``SharedOffloadRegion`` made with ``kwargs`` exactly as vLLM makes it, except that
    where vLLM pre-faults this rank's slots in the constructor (one ``MADV_POPULATE_WRITE`` per
    chunk from one thread: a 48 GiB region took 20 s, H200 machine) the worker fills them from
    several threads while it page-locks the region (``pin_region``: 4.2 s, docs/benchmarks.md).
    With ``populate_shard`` (replicated layout) vLLM's own shards and barrier stay as they are."""
    return _deferred_region_class()(**kwargs)


@functools.cache
def _deferred_region_class() -> type:
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    class _DeferredFillRegion(SharedOffloadRegion):
        # True while vLLM's constructor runs: its loop over this rank's slots finds none.
        _blockswap_defer = True

        def __init__(self, **kwargs: Any) -> None:
            #: This rank's slots are left to the worker (its fill allocates them in their files).
            self._blockswap_fill_pending = (
                kwargs.get("populate_shard") is None and kwargs.get("rank") is not None
            )
            #: ``(offset in the region, bytes, descriptor)`` of each file of the region, opened
            #: for the fill (vLLM closes its own, and unlinks the files after the barrier).
            self._blockswap_files: list[tuple[int, int, int]] = []
            try:
                super().__init__(**kwargs)
                if len(self._segments) == 1:
                    # One file, mapped by vLLM's constructor (``_map_segments`` advises the rest).
                    advise_huge_pages(self)
                    if self._blockswap_fill_pending:
                        # vLLM's descriptor, kept open until its cleanup.
                        self._blockswap_files = [(0, self.total_size_bytes, os.dup(self.fd))]
            except BaseException:
                close_files(self)
                raise
            self._blockswap_defer = False

        def _map_segments(self) -> None:
            super()._map_segments()
            # Before any slot is faulted in, by the worker or by vLLM's shards.
            advise_huge_pages(self)
            if self._blockswap_fill_pending:
                for path, offset, length in self._segments:
                    self._blockswap_files.append((offset, length, os.open(path, os.O_RDWR)))

        def iter_worker_slot_ranges(self) -> Iterator[tuple[int, int]]:
            return iter(()) if self._blockswap_defer else super().iter_worker_slot_ranges()

        def cleanup(self) -> None:
            close_files(self)
            super().cleanup()

    return _DeferredFillRegion


def advise_huge_pages(region: SharedOffloadRegion) -> None:
    """Advises ``region``'s whole mapping ``MADV_HUGEPAGE``: on a tmpfs mounted ``huge=advise``
    the faults then allocate 2 MiB pages, which the worker fills 2-3x as fast as 4 KiB pages
    (docs/benchmarks.md, "vLLM's region in huge pages"); elsewhere the advice changes nothing. A
    kernel that refuses it (no transparent huge pages) leaves the region as it is. A region of one
    file under ``replicated_layout`` is advised only after vLLM's constructor faulted its shard
    in: there the advice comes too late for those pages."""
    try:
        region.mmap_obj.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError) as e:  # no MADV_HUGEPAGE here, or the kernel refused it
        log.debug("vLLM's region: no MADV_HUGEPAGE (%s)", e)


def huge_pages_note(files: Sequence[tuple[int, int]]) -> str | None:
    """A line for the worker's log on the pages the region's files get, from the ``huge=``
    policy of their tmpfs (``_core.shmem_huge``); ``None`` without files or off a tmpfs."""
    policy = _core.shmem_huge(files[0][0]) if files else None
    if policy is None:
        return None
    if policy == "never":
        return (
            "vLLM's region is in 4 KiB pages (its tmpfs is mounted huge=never); with "
            "`mount -o remount,huge=advise /dev/shm` the worker fills it in 2 MiB pages, "
            "2-3x as fast (docs/tuning.md)"
        )
    return f"vLLM's region is in 2 MiB pages where they fit (its tmpfs: huge={policy})"


def unpin_region(addresses: list[int], device: int) -> None:
    """Undoes :func:`pin_region` (no copy reaches the region any more)."""
    for addr in reversed(addresses):
        try:
            _core.cuda_unpin(addr, device)
        except BlockswapError as e:  # nothing left to do but say so: the pages stay locked
            log.warning("could not unpin the CPU offload region's piece at %#x: %s", addr, e)


def fragments(
    g: int, per_tensor: dict[int, Any], rows: list[torch.Tensor], canon: list[int]
) -> list[tuple[int, int, int, int]]:
    """``(tensor, local offset, canonical offset, bytes)`` of every fragment of the mappings'
    runs, each checked to lie in its tensor's GPU row and canonical page."""
    out = []
    for t, r in per_tensor.items():
        for run in r.mapping.runs:
            n = int(run.fragment_size)
            for i in range(int(run.num_fragments)):
                lo = int(run.local_offset) + i * int(run.local_stride)
                co = int(run.canonical_offset) + i * int(run.canonical_stride)
                if n <= 0 or lo < 0 or co < 0:
                    raise ConfigError(f"canonical_layout: group {g} has a run {run}")
                if lo + n > rows[t].shape[1] or co + n > canon[t]:
                    raise ConfigError(
                        f"canonical_layout: group {g}'s run {run} reaches past tensor {t}'s "
                        f"page ({rows[t].shape[1]} bytes) or canonical page ({canon[t]})"
                    )
                out.append((t, lo, co, n))
    if not out:
        raise ConfigError(f"canonical_layout: group {g}'s mappings have no fragment")
    return out


def writer_blocks(
    gpu: npt.NDArray[np.int64],
    cpu: npt.NDArray[np.int64],
    pages: npt.NDArray[np.int64],
    num_writers: int,
    writer_index: int,
    store: bool,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The blocks a transfer moves for a writer class: on a store with several writers, those
    whose canonical page id (``pages``) is this rank's turn (vLLM's ``is_writer``: ``page %
    num_writers == writer_index``); every block otherwise (a load reads every page)."""
    if not store or num_writers == 1:
        return gpu, cpu
    mine = pages % num_writers == writer_index
    return gpu[mine], cpu[mine]
