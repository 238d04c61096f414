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
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from . import _core
from ._core import InvalidTransferError

log = logging.getLogger(__name__)

_I64_MAX = np.iinfo(np.int64).max
_U64_END = 1 << 64


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def check_job_id(job_id: Any) -> int:
    """``job_id`` as an int in ``[0, 2**64)``; anything else is an InvalidTransferError."""
    if _is_int(job_id) and 0 <= job_id < _U64_END:
        return int(job_id)
    if _is_int(job_id) and job_id >= _U64_END:
        raise InvalidTransferError(f"job_id {job_id} does not fit in 64 bits")
    raise InvalidTransferError(f"job_id must be a non-negative int, not {job_id!r}")


def check_job_ids(job_ids: Any) -> list[int]:
    """The job ids of a ``wait`` call, each checked as by :func:`check_job_id`."""
    if isinstance(job_ids, (str, bytes)) or not isinstance(job_ids, Iterable):
        raise InvalidTransferError(
            f"job_ids must be an iterable of job ids, not {type(job_ids).__name__}"
        )
    return [check_job_id(j) for j in job_ids]


def _check_u64(name: str, value: Any, *, positive: bool = False) -> int:
    if not _is_int(value):
        raise InvalidTransferError(f"{name} must be an int, not {value!r}")
    lo = 1 if positive else 0
    if not lo <= value < _U64_END:
        what = "a positive" if positive else "a non-negative"
        raise InvalidTransferError(f"{name} must be {what} int below 2**64, not {value}")
    return int(value)


def as_int64(name: str, values: Any) -> np.ndarray:
    """``values`` as a contiguous 1-D int64 array, without a copy where it already is one.

    Refuses non-integral input (floats, bools, objects) rather than truncating it.
    """
    if isinstance(values, np.ndarray) and values.dtype == np.int64 and values.ndim == 1:
        return values if values.flags.c_contiguous else np.ascontiguousarray(values)
    a = np.asarray(values)
    if a.size == 0:
        return np.zeros(0, dtype=np.int64)
    if a.ndim != 1:
        raise InvalidTransferError(f"{name} must be one-dimensional, not of shape {a.shape}")
    if a.dtype.kind not in "iu":
        if a.dtype == object and all(_is_int(v) for v in a):
            raise InvalidTransferError(f"{name} holds integers outside [-2**63, 2**63)")
        raise InvalidTransferError(f"{name} must hold integers, not {a.dtype}")
    if a.dtype == np.uint64 and bool((a > _I64_MAX).any()):
        raise InvalidTransferError(f"{name} holds values past 2**63 - 1")
    return np.ascontiguousarray(a, dtype=np.int64)


def _address_of(obj: Any, what: str = "register") -> tuple[int, int, str]:
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
    Keyword options go to the core: ``device``, ``max_in_flight``, ``pool_bytes``,
    ``max_descriptors``, ``coalesce``, ``shutdown_timeout``, and on CUDA ``copy_path``
    (``"auto"``, ``"batch"``, ``"loop"``), ``max_batch``, ``timing``, ``completion``,
    ``h2d_order`` / ``d2h_order`` (``"any"`` or ``"stream"``), ``h2d_stream`` / ``d2h_stream``.

    Every address a transfer names must lie in memory registered with :meth:`register`,
    :meth:`pin` or :meth:`alloc_host`; anything else is refused before a copy is issued.

    Every refusal is a :class:`~blockswap.BlockswapError` (an unknown keyword option is a
    ``TypeError``, as for any Python call). An engine that is garbage-collected first waits for
    its transfers in flight, so registered objects are never freed under a copy.
    """

    def __init__(self, backend: str = "auto", **options: Any) -> None:
        try:
            self._core = _core.Engine(backend, **options)
        except OverflowError as e:
            bad = {k: v for k, v in options.items() if _is_int(v) and v < 0}
            raise InvalidTransferError(
                f"engine options out of range ({bad or options}): {e}"
            ) from None
        self._kept: dict[int, Any] = {}
        # Hot paths bound straight to the core: no Python frame in between.
        self.get_finished = self._core.get_finished
        self.stats = self._core.stats
        self.info = self._core.info
        self._backend = _log_start(self._core.info(), options.get("copy_path", "auto"))

    def __del__(self) -> None:
        # Drain before the registered objects in ``_kept`` go: the instance dict is cleared in no
        # particular order, and the bound methods above keep the core alive past ``_kept``.
        # Shutdown returns once the backend has stopped, its copies done (the host worker is
        # joined, CUDA streams synchronised).
        core = self.__dict__.get("_core")
        if core is not None:
            core.shutdown()

    def submit(
        self,
        job_id: int,
        src_ptrs: Any,
        dst_ptrs: Any,
        sizes: Any,
        direction: str = "h2d",
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
        if launcher is not None and not callable(launcher):
            raise _not_callable(launcher)
        args = (
            as_int64("src_ptrs", src_ptrs),
            as_int64("dst_ptrs", dst_ptrs),
            as_int64("sizes", sizes),
        )
        try:
            self._core.submit(job_id, *args, direction, wait_stream, kernel_below, launcher)
        except (OverflowError, TypeError) as e:
            raise _submit_argument_error(e, direction, wait_stream, kernel_below) from None

    def register_table(
        self,
        bases: Any,
        strides: Any,
        nbytes: Any,
        num_blocks: int,
        kind: str,
        name: str = "",
        unit: int = 1,
    ) -> int:
        """Registers a block table: one side of a KV cache, where segment ``s`` of block ``b``
        is ``nbytes[s]`` bytes at ``bases[s] + b * strides[s]``. The core checks every segment's
        span, over all ``num_blocks`` blocks, against registered ``kind`` memory (``"host"`` or
        ``"device"``) once, here. ``name`` and ``unit`` only shape error messages (``unit`` table
        blocks per block the caller names). Returns the table's id for :meth:`submit_blocks`."""
        b = as_int64("bases", bases)
        st = as_int64("strides", strides)
        nb = as_int64("nbytes", nbytes)
        for col_name, col in (("bases", b), ("strides", st), ("nbytes", nb)):
            if col.size and int(col.min()) < 0:
                raise InvalidTransferError(f"{col_name} holds a negative value ({int(col.min())})")
        blocks = _check_u64("num_blocks", num_blocks, positive=True)
        if not isinstance(kind, str) or not isinstance(name, str):
            raise InvalidTransferError(f"kind and name must be str, not {kind!r} and {name!r}")
        u = _check_u64("unit", unit, positive=True)
        return int(self._core.register_table(b, st, nb, blocks, kind, name, u))

    def unregister_table(self, table: int) -> None:
        """Removes a block table (refused while transfers are in flight)."""
        if not _is_int(table) or not 0 <= table < 1 << 32:
            raise InvalidTransferError(f"no block table {table!r}")
        self._core.unregister_table(int(table))

    def submit_blocks(
        self,
        job_id: int,
        src_table: int,
        src_ids: Any,
        dst_table: int,
        dst_ids: Any,
        direction: str = "h2d",
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
        if launcher is not None and not callable(launcher):
            raise _not_callable(launcher)
        for t in (src_table, dst_table):
            if not _is_int(t) or not 0 <= t < 1 << 32:
                raise InvalidTransferError(f"no block table {t!r}")
        s = as_int64("src_ids", src_ids)
        d = as_int64("dst_ids", dst_ids)
        try:
            self._core.submit_blocks(
                job_id,
                int(src_table),
                s,
                int(dst_table),
                d,
                direction,
                wait_stream,
                kernel_below,
                launcher,
            )
        except (OverflowError, TypeError) as e:
            raise _submit_argument_error(e, direction, wait_stream, kernel_below) from None

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        """Blocks until the listed jobs finished; their results still come from get_finished.
        Ids never submitted (or already reported) are not waited for."""
        self._core.wait(check_job_ids(job_ids), timeout)

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

    def register(self, obj: Any, nbytes: int | None = None, kind: str | None = None) -> int:
        """Registers memory transfers may use; returns its address.

        ``obj`` is a numpy array or a torch tensor (kept alive until unregistered), or a raw
        address with ``nbytes`` and ``kind`` (``"host"`` or ``"device"``), which the caller
        vouches for. On CUDA, host memory must be page-locked and device memory must be this
        engine's device; both are checked here, once.
        """
        if _is_int(obj):
            if nbytes is None or kind is None:
                raise InvalidTransferError("a raw address needs nbytes and kind")
            ptr = _check_u64("ptr", obj)
        else:
            ptr, size, found_kind = _address_of(obj)
            nbytes = size if nbytes is None else nbytes
            kind = found_kind if kind is None else kind
            if _is_int(nbytes) and nbytes > size:
                raise InvalidTransferError(f"nbytes={nbytes} is larger than the object ({size})")
        if not isinstance(kind, str):
            raise InvalidTransferError(f"kind must be 'host' or 'device', not {kind!r}")
        self._core.register(ptr, _check_u64("nbytes", nbytes, positive=True), kind)
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
        self._core.pin(ptr, _check_u64("nbytes", nbytes, positive=True))
        _log_alloc("pin", nbytes, time.perf_counter() - t0, self._backend)
        self._kept[ptr] = obj
        return ptr

    def unregister(self, obj_or_ptr: Any) -> None:
        """Removes a registration (refused while transfers are in flight)."""
        if _is_int(obj_or_ptr):
            ptr = _check_u64("ptr", obj_or_ptr)
        else:
            ptr = _address_of(obj_or_ptr, "unregister")[0]
        self._core.unregister(ptr)
        self._kept.pop(ptr, None)

    def alloc_host(self, nbytes: int) -> np.ndarray:
        """A registered host buffer of ``nbytes`` (page-locked, device-mapped on CUDA), as a
        uint8 numpy array over blockswap's memory. Valid until :meth:`free_host`; the array
        keeps the engine's memory alive (the buffer outlives a collected engine)."""
        n = _check_u64("nbytes", nbytes, positive=True)
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
        self._core.inject_failures(_check_u64("count", count))

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


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
    if not isinstance(direction, str):
        return InvalidTransferError(
            f"direction must be 'h2d', 'd2h', 'h2h' or 'd2d', not {direction!r}"
        )
    if wait_stream is not None and not (_is_int(wait_stream) and 0 <= wait_stream < _U64_END):
        return InvalidTransferError(
            "wait_stream must be a raw CUstream int (e.g. "
            f"torch.cuda.current_stream().cuda_stream) or None, not {wait_stream!r}"
        )
    if not (_is_int(kernel_below) and 0 <= kernel_below < _U64_END):
        return InvalidTransferError(
            f"kernel_below must be a non-negative int below 2**64, not {kernel_below!r}"
        )
    return e


def _not_callable(launcher: Any) -> InvalidTransferError:
    return InvalidTransferError(f"launcher must be callable or None, not {launcher!r}")


def info() -> dict[str, Any]:
    """What blockswap would use here: version, CUDA availability (and why not), default backend."""
    cuda_ok, cuda_why = _core.cuda_status()
    return {
        "version": _core.__version__,
        "cuda": cuda_ok,
        "cuda_status": cuda_why,
        "default_backend": "cuda" if cuda_ok else "host",
    }
