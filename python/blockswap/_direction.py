"""One direction of the KV-cache handlers (:mod:`blockswap.handler`): the handler a connector
calls per transfer (:class:`SingleDirectionHandler`, made by
:class:`~blockswap.handler.CpuGpuHandlers`), the types of its block ids, and what keeps torch's
current device across a call into the core. Imported through :mod:`blockswap.handler`."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Callable, Protocol, Union

import numpy as np
import numpy.typing as npt

from . import _optional

try:
    import torch
except ModuleNotFoundError as e:
    _optional.missing(e, "blockswap.handler")

from ._checks import ENGINE_ERRORS, check_int
from ._core import (
    InvalidTransferError,
    Route,
    ShutdownError,
    TransferResult,
    chunk_skip,
)
from ._types import SHORT, Direction, LaneStats
from .errors import ConfigError
from .layout import as_block_ids

if TYPE_CHECKING:
    from .engine import Engine

#: The handlers' logger (failed transfers, as ``get_finished`` returns them).
log = logging.getLogger("blockswap.handler")

KVCaches = Union[
    torch.Tensor,
    Sequence[torch.Tensor],
    Mapping[str, torch.Tensor],
    Sequence[Sequence[torch.Tensor]],
]
"""KV-cache tensors of one device: one tensor, a list of per-layer tensors, a ``{layer name:
tensor}`` dict (as vLLM holds them; values in order) -- all one KV-cache group -- or a sequence of
groups, each a list of tensors (hybrid models)."""


class HasBlockIds(Protocol):
    """An object with a ``block_ids`` attribute (vLLM's ``BlockIDsLoadStoreSpec``)."""

    @property
    def block_ids(self) -> Any: ...


BlockIds = Union[npt.NDArray[np.integer[Any]], Sequence[int], torch.Tensor, HasBlockIds]
"""One side's block ids of one KV-cache group: a 1-D integer numpy array, a list of ints, a CPU
integer tensor, or an object with a ``block_ids`` attribute (vLLM's ``BlockIDsLoadStoreSpec``)."""

TransferSpec = Union[
    tuple[BlockIds, BlockIds],
    tuple[Sequence[BlockIds], Sequence[BlockIds]],
    tuple[HasBlockIds, HasBlockIds],
]
"""``(source ids, destination ids)``: GPU then CPU block ids for GPU -> CPU, CPU then GPU for
CPU -> GPU; with several KV-cache groups, each side a sequence with one :data:`BlockIds` per
group."""


# torch's current CUDA device (``cudaGetDevice``), and setting it back without creating a context.
_get_device: Callable[[], int] = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


def _maybe_exchange_device(index: int) -> None:
    torch.cuda._maybe_exchange_device(index)


class _KeepDevice:
    """Keeps torch's current CUDA device across a call into the core, which makes the engine's
    device current on the calling thread (cold paths; ``transfer_async`` inlines the same)."""

    __slots__ = ("index", "prev")

    def __init__(self, index: int | None) -> None:
        self.index = index
        self.prev = -1

    def __enter__(self) -> None:
        if self.index is not None:
            self.prev = _get_device()

    def __exit__(self, *exc: object) -> None:
        if self.index is not None and self.prev != self.index:
            _maybe_exchange_device(self.prev)


class _Owner(Protocol):
    """What a :class:`SingleDirectionHandler` uses of the
    :class:`~blockswap.handler.CpuGpuHandlers` that made it."""

    block_size_factor: int
    engine: Engine

    def shutdown(self) -> None: ...


_JOB_END = 1 << 64


#: Block ids and indices are int64 in the core; a Python int outside takes the checked path.
_I64_LIMIT = 1 << 63


def _pair(spec: Any, direction: str) -> tuple[Any, Any]:
    """``spec``'s two sides, or a ValueError naming the argument and the shape it must have."""
    sides = (
        "(GPU block ids, CPU block ids)" if direction == "d2h" else "(CPU block ids, GPU block ids)"
    )
    try:
        n = len(spec)
    except TypeError:
        n = -1
    if n != 2 or isinstance(spec, (str, bytes)) or hasattr(spec, "shape"):
        got = "None" if spec is None else f"a {type(spec).__name__}"
        got += f" of {n} items" if n >= 0 else ""
        if hasattr(spec, "shape"):
            got = f"a {type(spec).__name__} of shape {tuple(spec.shape)}"
        raise ValueError(f"spec must be a pair {sides}, not {got}")
    src, dst = spec
    return src, dst


def _logging_poll(
    poll: Callable[[], list[TransferResult]],
) -> Callable[[], list[TransferResult]]:
    """``poll`` (the engine's ``get_finished``) that also logs a warning for each failed transfer
    it returns: a result is returned once, so a failure is logged once, and never silently
    dropped by a caller that only counts results."""

    def get_finished() -> list[TransferResult]:
        results = poll()
        for r in results:
            if not r.success:
                log.warning("transfer job %d failed: %s", r.job_id, r.error)
        return results

    return get_finished


# --------------------------------------------------------------------------------------------
# One direction
# --------------------------------------------------------------------------------------------


class SingleDirectionHandler:
    """Moves KV-cache blocks in one direction: GPU -> CPU (``"d2h"``) or CPU -> GPU (``"h2d"``).

    Made by :class:`~blockswap.handler.CpuGpuHandlers`, never directly. vLLM's ``OffloadingHandler`` methods:
    :meth:`transfer_async`, :meth:`get_finished`, :meth:`wait`, plus :meth:`stats` and
    :meth:`shutdown`.

    The two handlers of a :class:`~blockswap.handler.CpuGpuHandlers` share one engine, so :meth:`get_finished` of
    either returns every finished transfer of the pair, both directions, each exactly once over
    all calls (vLLM's ``OffloadingWorker`` polls every handler and concatenates the lists, which
    gives each result once). Job ids must be unique among transfers in flight in both directions
    (a live job id is refused with :class:`~blockswap.InvalidTransferError`).
    """

    get_finished: Callable[[], list[TransferResult]]
    """Results (:class:`~blockswap.TransferResult`: ``job_id``, ``success``, ``bytes``,
    ``seconds``, ``error``) of the transfers of both directions finished since the last call.
    Lock-free, never blocks: the engine's own poll, with a warning logged for each failed
    transfer it returns."""

    def __init__(
        self,
        owner: _Owner,
        direction: str,
        tables: list[tuple[int, int]],
        wait_stream: Callable[[], int] | None,
        device_index: int | None,
        route: Route | None = None,
    ) -> None:
        if direction not in SHORT:
            raise ConfigError(f"direction must be 'd2h' or 'h2d', not {direction!r}")
        self._owner = owner
        self.direction: Direction = "d2h" if direction == "d2h" else "h2d"
        self._d2h = direction == "d2h"
        self._ngroups = len(tables)
        self._factor = owner.block_size_factor
        # (GPU table, CPU table) per group in the core, which maps CPU block ids to sub-blocks,
        # checks every id and writes the copies.
        self._tables = tables
        #: Group 0's ``(source table, destination table)``: :meth:`_issue_group`'s, which only
        #: a handler of one group takes.
        self._group0 = self._group_tables(0)
        self._wait_stream = wait_stream
        self._device_index = device_index
        self._use(route if route is not None else Route.pages().with_reason("dma"))
        self._closed = False
        core = owner.engine
        # Hot paths bound straight to the core.
        self._submit_groups = core.submit_groups
        self._submit_group = core.submit_group
        self._submit_spec = core.submit_spec
        self._wake = core.wake
        self.get_finished = _logging_poll(core.get_finished)
        self._core_wait = core.wait
        self._core_stats = core.stats

    def __repr__(self) -> str:
        return (
            f"SingleDirectionHandler({self.direction}: {SHORT[self.direction]}, "
            f"groups={self._ngroups}, block_size_factor={self._factor}"
            f"{', shut down' if self._closed else ''})"
        )

    def _use(self, route: Route) -> None:
        """Takes ``route`` for the transfers from now on (construction, calibration)."""
        #: The copy path of this direction (see :func:`~blockswap.routing.choose_routes`).
        self.route = route

    @property
    def gpu_to_cpu(self) -> bool:
        return self._d2h

    # ---- the hot path ----------------------------------------------------------------------

    def wake(self) -> None:
        """Announces a transfer about to be issued: the engine's thread for this direction, if
        asleep, wakes now rather than when :meth:`transfer_async` queues the transfer
        (``early_wake``, on by default; see :meth:`blockswap.Engine.wake`). ``transfer_async``
        announces itself; a caller with work of its own before it (reading a scheduler's specs,
        say) calls this first."""
        self._wake(self.direction)

    def transfer_async(
        self,
        job_id: int,
        spec: TransferSpec,
        *,
        block_indices: Sequence[int] | npt.NDArray[np.integer[Any]] | None = None,
    ) -> bool:
        """Issues the transfer ``spec`` under ``job_id`` and returns ``True`` at once (it never
        waits on the GPU); its result comes from :meth:`get_finished`.

        ``spec`` is ``(src_block_ids, dst_block_ids)``: GPU then CPU block ids for GPU -> CPU,
        CPU then GPU block ids for CPU -> GPU, each a 1-D integer numpy array, list of ints,
        CPU integer tensor or an object with a ``block_ids`` attribute (vLLM's
        ``BlockIDsLoadStoreSpec``). With several KV-cache groups, each side is a sequence with one
        such array per group (a group may be empty on both sides).

        ``block_indices``: per group, the position of the group's first GPU block in its request
        (vLLM's ``GPULoadStoreSpec.block_indices``); the transfer then starts ``block_indices[g] %
        block_size_factor`` sub-blocks into the first CPU block, in both directions, and the
        first and last CPU blocks may be partial. Without it, offloads start at the first CPU
        block's start and onloads end at the last one's end (see the module's documentation).
        ``n`` GPU blocks from sub-block ``skip`` take ``ceil((skip + n) / block_size_factor)``
        CPU blocks. Source ids may repeat; what the transfer writes may not: no GPU block twice,
        no CPU sub-block twice (a CPU block named twice is taken where the sub-blocks it stands
        for differ, as a partial first and last block can make them).

        Every refusal raises a :class:`~blockswap.BlockswapError` and issues nothing, leaving
        earlier transfers unaffected: :class:`~blockswap.InvalidTransferError` for bad input
        (non-integer, non-1-D or out-of-range block ids, a destination written twice, a wrong
        number of CPU blocks or groups, an empty transfer, a bad or live job id),
        :class:`~blockswap.PoolExhaustedError` when too many transfers are in flight,
        :class:`~blockswap.ShutdownError` after :meth:`shutdown`. It never returns ``False``
        (vLLM's ``OffloadingWorker`` turns an exception into ``False``).
        """
        if self._closed:
            raise ShutdownError("the offloading handlers are shut down")
        if type(job_id) is not int or not 0 <= job_id < _JOB_END:
            job_id = check_int("job_id", job_id, 0, _JOB_END - 1, errors=ENGINE_ERRORS)
        if self._ngroups == 1 and type(spec) is tuple and len(spec) == 2:
            # The usual call, one group as two 1-D arrays (and vLLM's one block index, a list):
            # one call into the core, which wakes the engine's thread, reads the ids and works
            # out the skip. Anything else takes the general path below, which names what is
            # wrong with it.
            src, dst = spec
            if (
                type(src) is np.ndarray
                and type(dst) is np.ndarray
                and src.ndim == 1
                and dst.ndim == 1
            ):
                if block_indices is None:
                    self._issue_group(job_id, src, dst, None)
                    return True
                if type(block_indices) is list and len(block_indices) == 1:
                    first = block_indices[0]  # read once: what is checked is what is used
                    if type(first) is int and 0 <= first < _I64_LIMIT:
                        self._issue_group(job_id, src, dst, first)
                        return True
        # The engine's thread for this direction wakes while the tables below are built.
        self._wake(self.direction)
        try:
            src, dst = _pair(spec, self.direction)
            groups = self._groups(src, dst, block_indices)
        except (IndexError, ValueError, TypeError) as e:
            raise InvalidTransferError(f"{self.direction} job {job_id}: {e}") from e
        self._issue(job_id, groups)
        return True

    def _issue(
        self, job_id: int, groups: Sequence[tuple[int, npt.ArrayLike, int, npt.ArrayLike, int]]
    ) -> None:
        """Hands the core's ``groups`` (see :meth:`_groups`) to the engine as job ``job_id``,
        after the work on the caller's stream: :meth:`transfer_async` once it has read a spec,
        and a caller that built the groups itself (the core checks every id and chunk count
        either way)."""
        if type(job_id) is not int or not 0 <= job_id < _JOB_END:
            job_id = check_int("job_id", job_id, 0, _JOB_END - 1, errors=ENGINE_ERRORS)
        self._issue_call(job_id, self._submit_groups, groups)

    def _issue_call(self, job_id: int, submit: Callable[..., None], *args: Any) -> None:
        """Calls one of the engine's submissions, ``submit(job_id, *args, direction,
        wait_stream, route)``, for job ``job_id`` after the work on the caller's stream: the
        general path's groups (:meth:`_issue`), or the vLLM worker's spec as vLLM gives it (the
        core's ``submit_spec``). Refusals are named as this direction's job's."""
        if self._closed:
            raise ShutdownError("the offloading handlers are shut down")
        ws = self._wait_stream
        prev = None if self._device_index is None else _get_device()
        try:
            submit(job_id, *args, self.direction, None if ws is None else ws(), self.route)
        except InvalidTransferError as e:
            raise InvalidTransferError(f"{self.direction} job {job_id}: {e}") from e
        finally:
            # The core makes the engine's device current on this thread: give torch its current
            # device back where it differs (a handler on cuda:1 called under cuda:0).
            if prev is not None and prev != self._device_index:
                _maybe_exchange_device(prev)

    def _issue_group(
        self, job_id: int, src_ids: Any, dst_ids: Any, block_index: int | None
    ) -> None:
        """Hands one group's ids to the engine as job ``job_id`` after the work on the caller's
        stream (the core's ``submit_group``: it wakes the engine's thread, reads and checks the
        ids, and works out the skip in the first CPU block from ``block_index``, the first GPU
        block's index in its request, as :meth:`transfer_async` documents): the usual transfer of
        one group in one call into the core. After an idle gap every Python statement on the
        way costs the caller's thread (docs/benchmarks.md, "a submission in one call"): the
        steps around the call are :meth:`_issue_call`'s written out again, not a helper's frame."""
        if self._closed:
            raise ShutdownError("the offloading handlers are shut down")
        ws = self._wait_stream
        prev = None if self._device_index is None else _get_device()
        src_table, dst_table = self._group0
        try:
            self._submit_group(
                job_id,
                src_table,
                src_ids,
                dst_table,
                dst_ids,
                block_index,
                self.direction,
                None if ws is None else ws(),
                self.route,
            )
        except InvalidTransferError as e:
            raise InvalidTransferError(f"{self.direction} job {job_id}: {e}") from e
        finally:
            if prev is not None and prev != self._device_index:
                _maybe_exchange_device(prev)

    def _group_tables(self, g: int) -> tuple[int, int]:
        """Group ``g``'s ``(source table, destination table)`` in the engine, as
        :meth:`_issue`'s groups name them."""
        gpu_table, cpu_table = self._tables[g]
        return (gpu_table, cpu_table) if self._d2h else (cpu_table, gpu_table)

    def _groups(
        self, src: Any, dst: Any, block_indices: Any
    ) -> list[tuple[int, npt.ArrayLike, int, npt.ArrayLike, int]]:
        """The core's ``(source table, ids, destination table, ids, skip)`` per group: 1-D numpy
        arrays as given (the core reads int32 and int64 ones in place, converts other integer
        ones and refuses the rest, naming the side), anything else through
        :func:`~blockswap.layout.as_block_ids` (CPU ids still block ids: the core maps them to
        sub-blocks). On a thread back from a step's other work that call costs 10-20 µs a side
        where the ids are already an array (the development machine's host backend)."""
        ng = self._ngroups
        if ng == 1:
            srcs, dsts = [src], [dst]
        else:
            srcs = list(getattr(src, "block_ids", src))
            dsts = list(getattr(dst, "block_ids", dst))
            if len(srcs) != ng or len(dsts) != ng:
                raise ValueError(
                    f"this cache has {ng} KV-cache groups: each side of the spec must hold one "
                    f"block-id array per group, got {len(srcs)} and {len(dsts)}"
                )
        if block_indices is not None:
            # Python ints: vLLM passes a list, and numpy's reductions on a few entries cost more
            # than the rest of the transfer's checks. A copy: what is checked is what is used,
            # whatever another thread does to the caller's list meanwhile.
            starts = block_indices.copy() if type(block_indices) is list else block_indices
            if type(starts) is not list or any(
                type(v) is not int or not -_I64_LIMIT <= v < _I64_LIMIT for v in starts
            ):
                starts = as_block_ids(starts, "block_indices").tolist()
            if len(starts) != ng:
                raise ValueError(
                    f"block_indices holds {len(starts)} entries for {ng} KV-cache group(s)"
                )
            if ng and min(starts) < 0:
                raise ValueError(f"block_indices must be >= 0, got {min(starts)}")
        f = self._factor
        d2h = self._d2h
        out = []
        for g in range(ng):
            where = f"group {g}: " if ng > 1 else ""
            s, d = srcs[g], dsts[g]
            if type(s) is not np.ndarray or s.ndim != 1:
                s = as_block_ids(s, f"{where}{'GPU' if d2h else 'CPU'} block ids", int32=True)
            if type(d) is not np.ndarray or d.ndim != 1:
                d = as_block_ids(d, f"{where}{'CPU' if d2h else 'GPU'} block ids", int32=True)
            first = None if block_indices is None else starts[g]
            skip = chunk_skip(f, (s if d2h else d).shape[0], first, d2h)
            gpu_table, cpu_table = self._tables[g]
            if d2h:
                out.append((gpu_table, s, cpu_table, d, skip))
            else:
                out.append((cpu_table, s, gpu_table, d, skip))
        return out

    # ---- everything else ---------------------------------------------------------------------

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        """Blocks until the listed transfers (of either direction) finished; their results still
        come from :meth:`get_finished`. Ids never submitted (or already reported) are not waited
        for. Raises :class:`~blockswap.WaitTimeoutError` after ``timeout`` seconds."""
        with _KeepDevice(self._device_index):
            self._core_wait(job_ids, timeout)

    def stats(self) -> LaneStats:
        """This direction's totals over finished transfers: ``transfers``, ``failed``, ``bytes``,
        ``seconds`` and ``gb_per_s`` (bytes / seconds / 1e9)."""
        s: LaneStats = self._core_stats()[self.direction]
        return s.copy()

    def shutdown(self) -> None:
        """Shuts down both directions (they share one engine): see
        :meth:`blockswap.handler.CpuGpuHandlers.shutdown`."""
        self._owner.shutdown()
