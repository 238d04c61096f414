"""The low-level engine: numpy arrays of addresses in, results out.

A thin layer over the compiled core (``blockswap._core.Engine``): it turns array-likes into the
contiguous int64 arrays the core reads without copying, and keeps registered Python objects alive
for as long as their memory is registered. Every rule about descriptors lives in the core.

What the core decides on its own and a person may want to know (the copy path the CUDA backend
picked, a fallback from the batch call to a loop, a shutdown that timed out, pinned allocations
and their time) is asked of the core here and logged to the ``blockswap`` logger
(:mod:`logging`); the library prints nothing.
"""

from __future__ import annotations

import ctypes
import inspect
import logging
import math
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any, get_args

import numpy as np

from . import _core
from ._checks import Errors, check_int
from ._core import InvalidTransferError, Route, TransferResult
from ._types import (
    AccessOrder,
    BackendName,
    BlockswapInfo,
    CompletionMode,
    CopyPath,
    Direction,
    EngineInfo,
    EngineStats,
    MemoryKind,
)

log = logging.getLogger(__name__)

#: Registered objects of engines collected after a shutdown that timed out (see Engine.__del__).
_ABANDONED: list[Any] = []

_I64_MAX = np.iinfo(np.int64).max
_U64_END = 1 << 64
_STREAM = "a raw CUstream int"


class ArgumentTypeError(InvalidTransferError, TypeError):
    """An argument of the wrong type: refused before anything was issued, like any
    :class:`~blockswap.InvalidTransferError`, and a ``TypeError`` too, as Python's own are."""


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_bool(x: Any) -> bool:
    return isinstance(x, (bool, np.bool_))


def _is_str(x: Any) -> bool:
    return isinstance(x, str)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not _is_bool(x)


def _one_of(choices: Any) -> str:
    """``'a', 'b' or 'c'``: the strings of a Literal type."""
    names = [repr(c) for c in get_args(choices)]
    return ", ".join(names[:-1]) + " or " + names[-1]


def check_arg(
    name: str, value: Any, expected: str, ok: Callable[[Any], bool], *, optional: bool = False
) -> Any:
    """``value`` of argument ``name`` if ``ok(value)``, else an :class:`ArgumentTypeError` saying
    ``"<name> must be <expected>, not <value>"``. ``optional``: None passes too. Ints are checked
    by :func:`blockswap._checks.check_int` instead (with :data:`_ERRORS`).

    These two are where Python checks arguments: the limits that mean something (settings,
    addresses, block ids) and the strings the core parses are the core's.
    """
    if value is None and optional:
        return None
    if not ok(value):
        raise ArgumentTypeError(
            f"{name} must be {expected}{' or None' if optional else ''}, not {value!r}"
        )
    return value


def _seconds(name: str, value: Any) -> float:
    """A time in seconds as a float (an int past a float's range is infinite)."""
    check_arg(name, value, "a number of seconds", _is_number)
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


#: The errors of an int argument the engine refuses (:func:`blockswap._checks.check_int`): an
#: :class:`ArgumentTypeError` for another type, an :class:`~blockswap.InvalidTransferError` for
#: an int out of range.
_ERRORS: Errors = (ArgumentTypeError, InvalidTransferError)

# The ranges of the core's integer arguments (what PyO3 converts into): an int outside cannot
# reach the core's own checks.
_I32 = (-(1 << 31), (1 << 31) - 1)
_I128 = (-(1 << 127), (1 << 127) - 1)
_U64_MAX = _U64_END - 1


def check_int_arg(name: str, value: Any, hi: int, optional: bool) -> int | None:
    """``value`` of argument ``name`` as an int in ``[0, hi]`` (or None where ``optional``),
    else the typed error naming it: the core's constructors (``Route``) call this for a value
    they could not take."""
    if optional:
        return check_int(name, value, 0, hi, optional=True, errors=_ERRORS)
    return check_int(name, value, 0, hi, errors=_ERRORS)


def check_job_id(job_id: Any) -> int:
    """``job_id`` as an int in ``[0, 2**64)``; anything else is an InvalidTransferError."""
    return check_int("job_id", job_id, 0, _U64_MAX, errors=_ERRORS)


def check_job_ids(job_ids: Any) -> list[int]:
    """The job ids of a ``wait`` call, each checked as by :func:`check_job_id`."""
    if isinstance(job_ids, (str, bytes)) or not isinstance(job_ids, Iterable):
        raise InvalidTransferError(
            f"job_ids must be an iterable of job ids, not {type(job_ids).__name__}"
        )
    return [check_job_id(j) for j in job_ids]


def as_int64(name: str, values: Any) -> np.ndarray:
    """``values`` as a contiguous 1-D int64 array, without a copy where it already is one.

    Refuses non-integral input (floats, bools, objects other than ints) rather than truncating
    it, and ints outside int64.
    """
    if isinstance(values, np.ndarray) and values.dtype == np.int64 and values.ndim == 1:
        return values if values.flags.c_contiguous else np.ascontiguousarray(values)
    a = np.asarray(values)
    if a.size == 0:
        return np.zeros(0, dtype=np.int64)
    if a.ndim != 1:
        raise InvalidTransferError(f"{name} must be one-dimensional, not of shape {a.shape}")
    if a.dtype == object and all(_is_int(v) for v in a):
        # Python ints (as numpy makes of a list with one past 64 bits, or dtype=object).
        outside = [int(v) for v in a if not -(1 << 63) <= v < 1 << 63]
        if outside:
            raise InvalidTransferError(f"{name} holds {outside[0]}, outside int64 [-2**63, 2**63)")
        return np.array(a.tolist(), dtype=np.int64)
    if a.dtype.kind not in "iu":
        raise InvalidTransferError(f"{name} must hold integers, not {a.dtype}")
    if a.dtype == np.uint64 and bool((a > _I64_MAX).any()):
        raise InvalidTransferError(f"{name} holds values past 2**63 - 1")
    return np.ascontiguousarray(a, dtype=np.int64)


def _address_of(obj: Any, what: str = "register") -> tuple[int, int, MemoryKind]:
    """(address, nbytes, kind) of a numpy array or a torch tensor (contiguous, of the CPU or a
    CUDA device)."""
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise InvalidTransferError("a registered array must be contiguous")
        return obj.ctypes.data, obj.nbytes, "host"
    data_ptr = getattr(obj, "data_ptr", None)
    device = getattr(obj, "device", None)
    if callable(data_ptr) and device is not None:  # a torch tensor
        dev = getattr(device, "type", str(device))
        if dev not in ("cpu", "cuda"):
            raise InvalidTransferError(
                f"cannot {what} a tensor on {device}: only CPU and CUDA tensors have memory "
                "blockswap can copy"
            )
        if not obj.is_contiguous():
            raise InvalidTransferError("a registered tensor must be contiguous")
        nbytes = obj.numel() * obj.element_size()
        ptr = int(data_ptr())
        if ptr == 0 and nbytes:
            raise InvalidTransferError(f"cannot {what} a tensor without storage (data_ptr 0)")
        return ptr, int(nbytes), "device" if dev == "cuda" else "host"
    hint = {
        "register": "a numpy array, a torch tensor, or a raw address with nbytes and kind",
        "pin": "a numpy array or a CPU tensor",
    }.get(what, "the registered array or tensor, or its address")
    raise InvalidTransferError(f"cannot {what} {type(obj).__name__}: pass {hint}")


class Engine:
    """Moves batches of ``(src, dst, size)`` blocks on a backend.

    ``backend`` is ``"auto"`` (CUDA where a driver is present, else host), ``"cuda"`` or
    ``"host"`` (``memcpy`` on a worker thread: runs anywhere, and stands in for the GPU in tests).

    Options of every backend:

    - ``max_in_flight``: transfers in flight per direction before :meth:`submit` refuses
      (1 to 16,384);
    - ``pool_bytes``: byte cap of the descriptor slab pool (at least 6,144: one slab);
    - ``max_descriptors``: descriptors one transfer may carry (1 to 2**20, the default);
    - ``coalesce``: merge descriptors whose source and destination both continue the previous one;
    - ``shutdown_timeout``: seconds :meth:`shutdown` waits for transfers in flight before failing
      them (``math.inf``: as long as they take).

    Options of the CUDA backend (the host backend ignores them, with a warning where one is not
    the default): ``device``; ``copy_path`` (``"auto"``, ``"batch"``, ``"loop"``); ``max_batch``
    (descriptors per driver call, 64 by default: another thread's driver calls, the model's
    launches among them, wait while one is in progress); ``timing`` (device time from events);
    ``completion`` (``"auto"``, ``"write_value"``, ``"event"``); ``h2d_order`` / ``d2h_order`` (source access
    order, ``"any"`` or ``"stream"``); ``h2d_stream`` / ``d2h_stream`` (a raw ``CUstream`` to use
    instead of the engine's own); ``idle_issue`` (where the engine's thread for a direction
    holds no transfer, :meth:`submit` issues a staged transfer's first step on the caller's
    thread and wakes that thread for the rest, and, where every earlier transfer of the direction
    is complete, any other transfer whole: an isolated transfer starts sooner, and the caller
    pays those driver calls; see docs/tuning.md); ``early_wake`` (on by default: a direction's
    sleeping thread is woken when a handler starts building a transfer, not when the transfer is
    queued, and polls for it a while; see docs/tuning.md).

    Every address a transfer names must lie in memory registered with :meth:`register`,
    :meth:`pin` or :meth:`alloc_host`; anything else is refused before a copy is issued.

    Every refusal is a :class:`~blockswap.BlockswapError`; an argument of the wrong type is an
    :class:`ArgumentTypeError` naming it (an ``InvalidTransferError`` and a ``TypeError``; an
    unknown keyword option is Python's own ``TypeError``). An engine that is garbage-collected
    first waits for its transfers in flight, so registered objects are never freed under a copy.
    """

    def __init__(
        self,
        backend: BackendName = "auto",
        *,
        device: int = 0,
        max_in_flight: int = 1024,
        pool_bytes: int = 256 << 20,
        max_descriptors: int | None = None,
        coalesce: bool = True,
        shutdown_timeout: float = 60.0,
        copy_path: CopyPath = "auto",
        max_batch: int | None = None,
        timing: bool = False,
        completion: CompletionMode = "auto",
        h2d_order: AccessOrder = "any",
        d2h_order: AccessOrder = "stream",
        h2d_stream: int | None = None,
        d2h_stream: int | None = None,
        stage_bytes: int = 16 << 20,
        idle_issue: bool = False,
        early_wake: bool = True,
    ) -> None:
        self._core = _core.Engine(
            check_arg("backend", backend, _one_of(BackendName), _is_str),
            device=check_int("device", device, *_I32, errors=_ERRORS),
            max_in_flight=check_int("max_in_flight", max_in_flight, *_I128, errors=_ERRORS),
            pool_bytes=check_int("pool_bytes", pool_bytes, *_I128, errors=_ERRORS),
            max_descriptors=check_int(
                "max_descriptors", max_descriptors, *_I128, optional=True, errors=_ERRORS
            ),
            coalesce=check_arg("coalesce", coalesce, "a bool", _is_bool),
            shutdown_timeout=_seconds("shutdown_timeout", shutdown_timeout),
            copy_path=check_arg("copy_path", copy_path, _one_of(CopyPath), _is_str),
            max_batch=check_int("max_batch", max_batch, 0, _U64_MAX, optional=True, errors=_ERRORS),
            timing=check_arg("timing", timing, "a bool", _is_bool),
            completion=check_arg("completion", completion, _one_of(CompletionMode), _is_str),
            h2d_order=check_arg("h2d_order", h2d_order, _one_of(AccessOrder), _is_str),
            d2h_order=check_arg("d2h_order", d2h_order, _one_of(AccessOrder), _is_str),
            h2d_stream=check_int(
                "h2d_stream", h2d_stream, 0, _U64_MAX, optional=True, what=_STREAM, errors=_ERRORS
            ),
            d2h_stream=check_int(
                "d2h_stream", d2h_stream, 0, _U64_MAX, optional=True, what=_STREAM, errors=_ERRORS
            ),
            stage_bytes=check_int("stage_bytes", stage_bytes, *_I128, errors=_ERRORS),
            idle_issue=check_arg("idle_issue", idle_issue, "a bool", _is_bool),
            early_wake=check_arg("early_wake", early_wake, "a bool", _is_bool),
        )
        self._kept: dict[int, Any] = {}
        # The hot paths bound straight to the core (no Python frame in between), shadowing the
        # methods of the same names, which document them.
        self.__dict__.update(
            get_finished=self._core.get_finished, stats=self._core.stats, info=self._core.info
        )
        self._backend = _log_start(self._core.info(), copy_path)
        if self._backend == "host":
            _warn_ignored(locals())

    def get_finished(self) -> list[TransferResult]:
        """The results of the transfers finished since the last call, each reported once.
        Lock-free; never blocks."""
        return self._core.get_finished()

    def stats(self) -> EngineStats:
        """Counters: bytes, seconds and GB/s per direction, transfers in flight, host time spent
        submitting (``submit_ns``), validating (``prepare_ns``) and in driver copy calls
        (``driver_ns``), and the descriptor pool."""
        return self._core.stats()

    def info(self) -> EngineInfo:
        """The backend, driver, device, copy path and completion mechanism in use, and the
        engine's settings."""
        return self._core.info()

    def __del__(self) -> None:
        # Drain before the registered objects in ``_kept`` go: the instance dict is cleared in no
        # particular order, and the bound methods above keep the core alive past ``_kept``.
        # Shutdown returns once the backend has stopped, its copies done (the host worker is
        # joined, CUDA streams synchronised).
        core = self.__dict__.get("_core")
        if core is not None:
            core.shutdown()
            if core.stats().get("shutdown_timed_out"):
                # Copies the shutdown gave up on may still read or write the registered objects:
                # they are kept for the life of the process rather than freed under the device.
                _ABANDONED.append(self.__dict__.get("_kept"))

    def submit(
        self,
        job_id: int,
        src_ptrs: Any,
        dst_ptrs: Any,
        sizes: Any,
        direction: Direction = "h2d",
        *,
        wait_stream: int | None = None,
        kernel_below: int = 0,
        launcher: Callable[[int, int, int, int, int, int, int], None] | None = None,
    ) -> None:
        """Issues one transfer and returns at once; its result comes from :meth:`get_finished`.

        ``direction`` is ``"h2d"``, ``"d2h"``, ``"h2h"`` or ``"d2d"``. ``wait_stream`` (a raw
        ``CUstream`` such as ``torch.cuda.current_stream().cuda_stream``) makes the copies wait
        for the work issued on that stream so far.

        With ``launcher`` (e.g. :func:`blockswap.kernels.engine_launcher`), descriptors smaller
        than ``kernel_below`` bytes (after coalescing) are moved by the copy kernel it launches
        on the engine's stream, reading the descriptors from the pinned slab in place; the rest
        go to DMA, in the same transfer.
        """
        if type(job_id) is not int or not 0 <= job_id < _U64_END:
            job_id = check_job_id(job_id)
        if launcher is not None and not callable(launcher):  # the check off the hot path
            check_arg("launcher", launcher, "callable", callable, optional=True)
        args = (
            as_int64("src_ptrs", src_ptrs),
            as_int64("dst_ptrs", dst_ptrs),
            as_int64("sizes", sizes),
        )
        try:
            self._core.submit(job_id, *args, direction, wait_stream, kernel_below, launcher)
        except (OverflowError, TypeError) as e:
            raise _submit_argument_error(e, direction, wait_stream, kernel_below) from None

    def wake(self, direction: Direction) -> None:
        """Announces a transfer about to be submitted on ``direction``: with ``early_wake`` (the
        default) the engine's sleeping thread for that direction wakes now, while the caller
        builds the transfer, rather than when it is queued. Every submission announces itself;
        call this first where building the descriptors takes a while. Does nothing on the host
        backend or after :meth:`shutdown`; never waits for copies."""
        self._core.wake(check_arg("direction", direction, _one_of(Direction), _is_str))

    def register_table(
        self,
        bases: Any,
        strides: Any,
        nbytes: Any,
        num_blocks: int,
        kind: MemoryKind,
        name: str = "",
        unit: int = 1,
    ) -> int:
        """Registers a block table: one side of a KV cache, where segment ``s`` of block ``b``
        is ``nbytes[s]`` bytes at ``bases[s] + b * strides[s]``. The core checks every segment's
        span, over all ``num_blocks`` blocks, against registered ``kind`` memory (``"host"`` or
        ``"device"``) once, here: one region, or adjacent ones (memory registered in pieces, see
        :mod:`blockswap.hostmem`) where no page crosses from one into the next. ``name`` names
        the table's blocks in errors. ``unit``: table blocks per block the caller names (a CPU
        block of ``unit`` GPU-sized sub-blocks), used where :meth:`submit_groups` names this side
        by chunk ids, and in errors. Returns the table's id for :meth:`submit_blocks` and
        :meth:`submit_groups`."""
        b = as_int64("bases", bases)
        st = as_int64("strides", strides)
        nb = as_int64("nbytes", nbytes)
        for col_name, col in (("bases", b), ("strides", st), ("nbytes", nb)):
            if col.size and int(col.min()) < 0:
                raise InvalidTransferError(f"{col_name} holds a negative value ({int(col.min())})")
        blocks = check_int("num_blocks", num_blocks, 1, _U64_MAX, errors=_ERRORS)
        check_arg("kind", kind, _one_of(MemoryKind), _is_str)
        check_arg("name", name, "a str", _is_str)
        u = check_int("unit", unit, 1, _U64_MAX, errors=_ERRORS)
        return int(self._core.register_table(b, st, nb, blocks, kind, name, u))

    def unregister_table(self, table: int) -> None:
        """Removes a block table (refused while transfers are in flight)."""
        self._core.unregister_table(_table_id(table))

    def submit_blocks(
        self,
        job_id: int,
        src_table: int,
        src_ids: Any,
        dst_table: int,
        dst_ids: Any,
        direction: Direction = "h2d",
        *,
        wait_stream: int | None = None,
        kernel_below: int = 0,
        launcher: Callable[[int, int, int, int, int, int, int], None] | None = None,
    ) -> None:
        """Issues the transfer of blocks ``src_ids`` of table ``src_table`` to blocks
        ``dst_ids`` of ``dst_table`` (see :meth:`register_table`): the core checks each id
        against its table (negative ids included) and that destination ids are distinct, then
        writes the descriptors itself. Otherwise as :meth:`submit`."""
        job_id = check_job_id(job_id)
        if launcher is not None and not callable(launcher):  # the check off the hot path
            check_arg("launcher", launcher, "callable", callable, optional=True)
        src_table, dst_table = _table_id(src_table), _table_id(dst_table)
        s = as_int64("src_ids", src_ids)
        d = as_int64("dst_ids", dst_ids)
        try:
            self._core.submit_blocks(
                job_id,
                src_table,
                s,
                dst_table,
                d,
                direction,
                wait_stream,
                kernel_below,
                launcher,
            )
        except (OverflowError, TypeError) as e:
            raise _submit_argument_error(e, direction, wait_stream, kernel_below) from None

    def submit_block_runs(
        self,
        job_id: int,
        src_table: int,
        src_ids: Any,
        dst_table: int,
        dst_ids: Any,
        direction: Direction = "h2d",
        *,
        wait_stream: int | None = None,
    ) -> None:
        """:meth:`submit_blocks`, each block moved by the pair's block plan (see
        :meth:`block_runs`): one 2-D copy per run of its pages instead of a descriptor per page,
        on the copy engines only. Refused where the pair has no block plan."""
        job_id = check_job_id(job_id)
        src_table, dst_table = _table_id(src_table), _table_id(dst_table)
        s = as_int64("src_ids", src_ids)
        d = as_int64("dst_ids", dst_ids)
        try:
            self._core.submit_block_runs(job_id, src_table, s, dst_table, d, direction, wait_stream)
        except (OverflowError, TypeError) as e:
            raise _submit_argument_error(e, direction, wait_stream, 0) from None

    def submit_groups(
        self,
        job_id: int,
        groups: Iterable[tuple[int, Any, int, Any, int | None]],
        direction: Direction = "h2d",
        *,
        wait_stream: int | None = None,
        route: Route | None = None,
    ) -> None:
        """Issues one transfer of several KV-cache groups as one batch with one result.

        ``groups``: one ``(src_table, src_ids, dst_table, dst_ids, skip)`` per group. With
        ``skip=None`` both sides are named by table blocks, as in :meth:`submit_blocks`. With an
        int, the side whose table was registered with ``unit`` > 1 is named by *chunk* ids (a
        CPU block of ``unit`` sub-blocks): the group moves ``len(other side's ids)`` blocks, from
        sub-block ``skip`` of the first chunk on, so it needs ``ceil((skip + n) / unit)`` chunk
        ids (the first and the last chunk may be partial). A group may be empty on both sides.
        The core checks every id, every chunk count and that destinations are distinct, across
        groups too.

        ``route`` (a :class:`blockswap.Route`; ``None``: ``Route.pages()``) says how it moves:
        ``Route.pages(...)`` a descriptor per page as :meth:`submit`, the small ones by a copy
        kernel where it names one (the core's, from :meth:`load_kernel`, launched with no
        Python on the way; on the host backend, which loads none, by memcpy);
        ``Route.blocks()`` each pair's block plan (:meth:`block_runs`, copy engines only);
        ``Route.staged(kernel)`` the staged plan (a host side that is block-major, see
        :meth:`staged_row`): each block's row crosses PCIe as one copy into or out of a device
        staging ring of two ``stage_bytes`` slots, and the staged kernel moves its pages
        between the ring and the GPU pages; ``Route.staged(kernel, direct=True,
        launch_bytes=n)`` the direct plan (a host side in chunks or cells): the staged kernel
        moves every page between host memory and the GPU in place, at most ``n`` bytes of pages
        a launch."""
        job_id = check_job_id(job_id)
        core_groups = []
        for g, group in enumerate(groups):
            try:
                src_table, src_ids, dst_table, dst_ids, skip = group
            except (TypeError, ValueError):
                raise InvalidTransferError(
                    f"groups[{g}] must be (src_table, src_ids, dst_table, dst_ids, skip)"
                ) from None
            if skip is not None:
                skip = check_int(f"groups[{g}] skip", skip, 0, _U64_MAX, errors=_ERRORS)
            core_groups.append(
                (
                    _table_id(src_table),
                    as_int64(f"groups[{g}] src_ids", src_ids),
                    _table_id(dst_table),
                    as_int64(f"groups[{g}] dst_ids", dst_ids),
                    skip,
                )
            )
        try:
            self._core.submit_groups(job_id, core_groups, direction, wait_stream, route)
        except (OverflowError, TypeError) as e:
            if route is not None and not isinstance(route, Route):
                check_arg("route", route, "a blockswap.Route or None", lambda _: False)
            raise _submit_argument_error(e, direction, wait_stream, 0) from None

    def staged_row(self, table: int) -> int | None:
        """The bytes of one block's row where ``table`` is block-major (every page of a block in
        one chunk inside one registered region): what the staged plan moves across PCIe per
        block, at most :attr:`stage_bytes`. ``None`` for any other layout."""
        return self._core.staged_row(_table_id(table))

    @property
    def stage_bytes(self) -> int:
        """Bytes of each of the two slots of a direction's staging ring (the ``stage_bytes``
        option), allocated in device memory on the direction's first staged transfer."""
        return self._core.stage_bytes

    def load_kernel(self, kernel: dict[str, Any]) -> int | None:
        """Makes a compiled copy kernel launchable by the core: ``kernel`` as
        :func:`blockswap.kernels.core_kernel` returns it (which keeps the compiled module, and
        must be kept alive as long as the engine may launch it), a page kernel for the kernel
        route (``Route.pages(below, kernel=id)``), or (``staged=True``) the staged plan's
        (``Route.staged(id)``). Returns the id for :meth:`submit_groups`' route, or ``None``
        on the host backend. A
        kernel whose parameters are neither kind's raises :class:`blockswap.BackendError`."""
        return self._core.load_kernel(
            kernel["function"],
            kernel["threads"],
            kernel["shared"],
            kernel["params"],
            kernel["rows"],
            kernel["ctas"],
            kernel.get("row_bytes", 0),
            kernel.get("chained", False),
        )

    def block_runs(
        self, src_table: int, dst_table: int, direction: str = "h2d"
    ) -> list[tuple[int, int, int, int, int]] | None:
        """The block plan of two block tables: one ``(first segment, rows, width, source pitch,
        destination pitch)`` per 2-D copy a block takes (consecutive segments whose pages lie
        at one pitch on both sides), or ``None`` where the pair has none (pages that differ,
        destination pages that may share bytes). A block-major CPU table against layer tensors
        at one pitch is one copy per block."""
        src_table, dst_table = _table_id(src_table), _table_id(dst_table)
        if not isinstance(direction, str):
            raise InvalidTransferError(f"direction must be a str, not {direction!r}")
        return self._core.block_runs(src_table, dst_table, direction)

    def staged_route(self, host_tables: Iterable[int]) -> tuple[int | None, str]:
        """Whether a cache whose KV-cache groups have the host tables ``host_tables`` takes the
        staged plan (``Route.staged(...)``) with this engine's slots: every table block-major
        (:meth:`staged_row`) with rows no larger than :attr:`stage_bytes`. Returns ``(the
        largest row, "")``, or ``(None, why not)``."""
        return self._core.staged_route([_table_id(t) for t in host_tables])

    def block_route(
        self, pairs: Iterable[tuple[int, int]], direction: str = "h2d", *, insist: bool = False
    ) -> tuple[bool, str]:
        """Whether a cache whose KV-cache groups are the table pairs ``pairs`` (source,
        destination as ``direction`` moves them) takes the block route (``Route.blocks()``):
        by default where each group's plan (:meth:`block_runs`) is at most
        ``blockswap._core.BLOCK_MAX_COPIES`` 2-D copies of pages of at least
        ``BLOCK_MIN_PAGE`` bytes, with ``insist`` wherever it saves a copy, never where two
        groups share memory. Returns ``(taken, why)``."""
        ids = [(_table_id(s), _table_id(d)) for s, d in pairs]
        if not isinstance(direction, str):
            raise InvalidTransferError(f"direction must be a str, not {direction!r}")
        check_arg("insist", insist, "a bool", _is_bool)
        return self._core.block_route(ids, direction, insist)

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        """Blocks until the listed jobs finished; their results still come from get_finished.
        Ids never submitted (or already reported) are not waited for. ``timeout`` in seconds
        (None or ``math.inf``: no limit); past it, a :class:`~blockswap.WaitTimeoutError`."""
        ids = check_job_ids(job_ids)
        self._core.wait(ids, None if timeout is None else _seconds("timeout", timeout))

    def shutdown(self) -> None:
        """Waits for transfers in flight and stops the backend. Results stay available.

        Transfers still in flight after the engine's ``shutdown_timeout`` are reported failed,
        and a warning is logged."""
        first = not self._core.is_shut_down
        self._core.shutdown()
        if first and self._core.stats().get("shutdown_timed_out"):
            log.warning(
                "engine shutdown timed out with transfers in flight: they are reported failed, "
                "and their memory may still be copied to or from (raise shutdown_timeout, or "
                "wait for the transfers before shutting down)"
            )

    @property
    def is_shut_down(self) -> bool:
        return bool(self._core.is_shut_down)

    def register(self, obj: Any, nbytes: int | None = None, kind: MemoryKind | None = None) -> int:
        """Registers memory transfers may use; returns its address.

        ``obj`` is a numpy array or a torch tensor (kept alive until unregistered), or a raw
        address with ``nbytes`` and ``kind`` (``"host"`` or ``"device"``), which the caller
        vouches for. On CUDA, host memory must be page-locked and device memory must be this
        engine's device; both are checked here, once. Host memory of a
        :class:`~blockswap.hostmem.PinnedRows` is registered as one region per piece it covers
        (no copy crosses from one piece into the next), all removed by one :meth:`unregister` of
        the address returned here.
        """
        if _is_int(obj):
            if nbytes is None or kind is None:
                raise InvalidTransferError("a raw address needs nbytes and kind")
            ptr = check_int("ptr", obj, 0, _U64_MAX, errors=_ERRORS)
        else:
            ptr, size, found_kind = _address_of(obj)
            nbytes = size if nbytes is None else nbytes
            kind = found_kind if kind is None else kind
            if _is_int(nbytes) and nbytes > size:
                raise InvalidTransferError(f"nbytes={nbytes} is larger than the object ({size})")
        check_arg("kind", kind, _one_of(MemoryKind), _is_str)
        self._core.register(ptr, check_int("nbytes", nbytes, 1, _U64_MAX, errors=_ERRORS), kind)
        if not _is_int(obj):
            self._kept[ptr] = obj
        return ptr

    def pin(self, obj: Any) -> int:
        """Page-locks an existing host array or CPU tensor (``cuMemHostRegister``) and registers
        it; returns its address. :meth:`unregister` unpins it."""
        ptr, nbytes, kind = _address_of(obj, "pin")
        if kind != "host":
            raise InvalidTransferError("only host memory can be pinned")
        t0 = time.perf_counter()
        self._core.pin(ptr, check_int("nbytes", nbytes, 1, _U64_MAX, errors=_ERRORS))
        _log_alloc("pin", nbytes, time.perf_counter() - t0, self._backend)
        self._kept[ptr] = obj
        return ptr

    def unregister(self, obj_or_ptr: Any) -> None:
        """Removes a registration (refused while transfers are in flight)."""
        if _is_int(obj_or_ptr):
            ptr = check_int("ptr", obj_or_ptr, 0, _U64_MAX, errors=_ERRORS)
        else:
            ptr = _address_of(obj_or_ptr, "unregister")[0]
        self._core.unregister(ptr)
        self._kept.pop(ptr, None)

    def alloc_host(self, nbytes: int) -> np.ndarray:
        """A registered host buffer of ``nbytes`` (page-locked, device-mapped on CUDA), as a
        uint8 numpy array over blockswap's memory. Valid until :meth:`free_host`; the array
        keeps the engine's memory alive (the buffer outlives a collected engine)."""
        n = check_int("nbytes", nbytes, 1, _U64_MAX, errors=_ERRORS)
        t0 = time.perf_counter()
        ptr = self._core.alloc_host(n)
        _log_alloc("alloc_host", n, time.perf_counter() - t0, self._backend)
        buf = (ctypes.c_uint8 * n).from_address(ptr)
        # The core frees its buffers when it is dropped: the array keeps it alive.
        buf._blockswap_core = self._core  # type: ignore[attr-defined]
        arr = np.ctypeslib.as_array(buf)
        self._kept[ptr] = buf
        return arr

    def free_host(self, arr: np.ndarray) -> None:
        """Frees a buffer from :meth:`alloc_host` (refused while transfers are in flight). The
        array must not be used afterwards."""
        if not isinstance(arr, np.ndarray):
            raise InvalidTransferError(
                f"free_host takes an array from alloc_host, not {type(arr).__name__}"
            )
        ptr = arr.ctypes.data
        self._core.free_host(ptr)
        self._kept.pop(ptr, None)

    def inject_failures(self, count: int) -> None:
        """Host backend: the next ``count`` transfers fail halfway (for tests)."""
        self._core.inject_failures(check_int("count", count, 0, _U64_MAX, errors=_ERRORS))

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


# The options only the CUDA backend reads.
_CUDA_ONLY = (
    "device",
    "copy_path",
    "max_batch",
    "timing",
    "completion",
    "h2d_order",
    "d2h_order",
    "h2d_stream",
    "d2h_stream",
    "idle_issue",
    "early_wake",
)


def _warn_ignored(arguments: dict[str, Any]) -> None:
    """Warns of the CUDA options among an engine's ``arguments`` that differ from their defaults
    (the engine is on the host backend, which ignores them)."""
    params = inspect.signature(Engine).parameters
    ignored = [f"{k}={arguments[k]!r}" for k in _CUDA_ONLY if arguments[k] != params[k].default]
    if ignored:
        warnings.warn(
            "this engine runs on the host backend, which ignores the CUDA option"
            f"{'s' if len(ignored) > 1 else ''} {', '.join(ignored)}",
            UserWarning,
            stacklevel=3,
        )


def _table_id(table: Any) -> int:
    """A block table id as the core takes it; anything else names no table."""
    if not _is_int(table) or not 0 <= table < 1 << 32:
        raise InvalidTransferError(f"no block table {table!r}")
    return int(table)


def _log_start(info: Any, copy_path: Any) -> str:
    """Logs what the core chose for a new engine; returns its backend's name."""
    backend = str(info["backend"])
    log.info(
        "engine: %s backend%s, copy path %s, completion by %s",
        backend,
        f" on {info['device']}" if info.get("device") else "",
        info["copy_path"],
        info["completion"],
    )
    if backend == "cuda" and "loop" in str(info["copy_path"]) and copy_path != "loop":
        v = int(info.get("driver_version") or 0)
        log.warning(
            "the CUDA driver (%d.%d) has no batch copy (cuMemcpyBatchAsync, CUDA 12.8+): each "
            "descriptor is one cuMemcpyAsync call, which is slow for small blocks; a newer "
            "driver gives the batch call",
            v // 1000,
            v % 1000 // 10,
        )
    return backend


def _log_alloc(call: str, nbytes: int, seconds: float, backend: str) -> None:
    """Pinned allocations are slow (the driver page-locks every page): their size and time."""
    how = "pinned" if backend == "cuda" else "(host backend: not pinned)"
    log.info("%s: %.1f MiB of host memory %s in %.3f s", call, nbytes / 2**20, how, seconds)


def _submit_argument_error(
    e: Exception, direction: Any, wait_stream: Any, kernel_below: Any
) -> Exception:
    """The typed error for a submission argument the core could not convert (slow path)."""
    stream = f"{_STREAM} (e.g. torch.cuda.current_stream().cuda_stream)"
    try:
        check_arg("direction", direction, _one_of(Direction), _is_str)
        check_int(
            "wait_stream", wait_stream, 0, _U64_MAX, optional=True, what=stream, errors=_ERRORS
        )
        check_int("kernel_below", kernel_below, 0, _U64_MAX, errors=_ERRORS)
    except InvalidTransferError as refused:
        return refused
    return e


def info() -> BlockswapInfo:
    """What blockswap would use here: version, CUDA availability (and why not), default backend."""
    cuda_ok, cuda_why = _core.cuda_status()
    return {
        "version": _core.__version__,
        "cuda": cuda_ok,
        "cuda_status": cuda_why,
        "default_backend": "cuda" if cuda_ok else "host",
    }
