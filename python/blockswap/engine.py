"""The low-level engine: numpy arrays of addresses in, results out.

A thin layer over the compiled core (``blockswap._core.Engine``): it turns array-likes into the
contiguous int64 arrays the core reads without copying, and keeps registered Python objects alive
for as long as their memory is registered. Every rule about descriptors lives in the core.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from . import _core
from ._core import InvalidTransferError

_I64_MAX = np.iinfo(np.int64).max


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
        raise InvalidTransferError(f"{name} must hold integers, not {a.dtype}")
    if a.dtype == np.uint64 and bool((a > _I64_MAX).any()):
        raise InvalidTransferError(f"{name} holds values past 2**63 - 1")
    return np.ascontiguousarray(a, dtype=np.int64)


def _address_of(obj: Any) -> tuple[int, int, str]:
    """(address, nbytes, kind) of a numpy array or a torch tensor (contiguous)."""
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise InvalidTransferError("a registered array must be contiguous")
        return obj.ctypes.data, obj.nbytes, "host"
    data_ptr = getattr(obj, "data_ptr", None)
    if callable(data_ptr):  # a torch tensor
        if not obj.is_contiguous():
            raise InvalidTransferError("a registered tensor must be contiguous")
        nbytes = obj.numel() * obj.element_size()
        kind = "device" if obj.device.type == "cuda" else "host"
        return int(data_ptr()), int(nbytes), kind
    raise InvalidTransferError(
        f"cannot register {type(obj).__name__}: pass a numpy array, a torch tensor, or ptr + nbytes"
    )


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
    """

    def __init__(self, backend: str = "auto", **options: Any) -> None:
        self._core = _core.Engine(backend, **options)
        self._kept: dict[int, Any] = {}
        # Hot paths bound straight to the core: no Python frame in between.
        self.get_finished = self._core.get_finished
        self.stats = self._core.stats
        self.info = self._core.info

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
        if isinstance(job_id, bool) or not isinstance(job_id, (int, np.integer)) or job_id < 0:
            raise InvalidTransferError(f"job_id must be a non-negative int, not {job_id!r}")
        self._core.submit(
            int(job_id),
            as_int64("src_ptrs", src_ptrs),
            as_int64("dst_ptrs", dst_ptrs),
            as_int64("sizes", sizes),
            direction,
            wait_stream,
            kernel_below,
            launcher,
        )

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        """Blocks until the listed jobs finished; their results still come from get_finished."""
        self._core.wait([int(j) for j in job_ids], timeout)

    def shutdown(self) -> None:
        """Waits for transfers in flight and stops the backend. Results stay available."""
        self._core.shutdown()

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
        if isinstance(obj, (int, np.integer)) and not isinstance(obj, bool):
            if nbytes is None or kind is None:
                raise InvalidTransferError("a raw address needs nbytes and kind")
            ptr = int(obj)
        else:
            ptr, size, found_kind = _address_of(obj)
            nbytes = size if nbytes is None else nbytes
            kind = found_kind if kind is None else kind
            if nbytes > size:
                raise InvalidTransferError(f"nbytes={nbytes} is larger than the object ({size})")
        self._core.register(ptr, int(nbytes), kind)
        if not isinstance(obj, (int, np.integer)):
            self._kept[ptr] = obj
        return ptr

    def pin(self, obj: Any) -> int:
        """Page-locks an existing host array or CPU tensor (``cuMemHostRegister``) and registers
        it; returns its address. :meth:`unregister` unpins it."""
        ptr, nbytes, kind = _address_of(obj)
        if kind != "host":
            raise InvalidTransferError("only host memory can be pinned")
        self._core.pin(ptr, nbytes)
        self._kept[ptr] = obj
        return ptr

    def unregister(self, obj_or_ptr: Any) -> None:
        """Removes a registration (refused while transfers are in flight)."""
        if isinstance(obj_or_ptr, (int, np.integer)):
            ptr = int(obj_or_ptr)
        else:
            ptr = _address_of(obj_or_ptr)[0]
        self._core.unregister(ptr)
        self._kept.pop(ptr, None)

    def alloc_host(self, nbytes: int) -> np.ndarray:
        """A registered host buffer of ``nbytes`` (page-locked, device-mapped on CUDA), as a
        uint8 numpy array over blockswap's memory. Valid until :meth:`free_host` or the engine
        goes away."""
        ptr = self._core.alloc_host(int(nbytes))
        buf = (ctypes.c_uint8 * int(nbytes)).from_address(ptr)
        arr = np.ctypeslib.as_array(buf)
        self._kept[ptr] = buf
        return arr

    def free_host(self, arr: np.ndarray) -> None:
        """Frees a buffer from :meth:`alloc_host` (refused while transfers are in flight)."""
        ptr = arr.ctypes.data
        self._core.free_host(ptr)
        self._kept.pop(ptr, None)

    def inject_failures(self, count: int) -> None:
        """Host backend: the next ``count`` transfers fail halfway (for tests)."""
        self._core.inject_failures(count)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def info() -> dict[str, Any]:
    """What blockswap would use here: version, CUDA availability (and why not), default backend."""
    cuda_ok, cuda_why = _core.cuda_status()
    return {
        "version": _core.__version__,
        "cuda": cuda_ok,
        "cuda_status": cuda_why,
        "default_backend": "cuda" if cuda_ok else "host",
    }
