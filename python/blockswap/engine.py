"""The low-level engine: numpy arrays of addresses in, results out.

:class:`Engine` is the compiled core's engine (``blockswap._core.Engine``, ``rust/py/engine.rs``),
which checks and converts every argument itself (an :class:`ArgumentTypeError` for a value of the
wrong type, an :class:`~blockswap.InvalidTransferError` for one out of range) and releases the GIL
while it works. What needs Python objects is added here: registering a numpy array or a torch
tensor and keeping it alive for as long as its memory is registered, and the log lines.

What the core decides on its own and a person may want to know (the copy path the CUDA backend
picked, a fallback from the batch call to a loop, a shutdown that timed out, pinned allocations
and their time) is asked of the core here and logged to the ``blockswap`` logger
(:mod:`logging`); the library prints nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time
from typing import Any

import numpy as np

from . import _core
from ._core import ArgumentTypeError, InvalidTransferError
from ._types import BlockswapInfo, MemoryKind

__all__ = ["ArgumentTypeError", "Engine", "info"]

log = logging.getLogger(__name__)

#: Registered objects of engines collected after a shutdown that timed out (see Engine.__del__).
_ABANDONED: list[Any] = []


def _address_of(obj: Any, what: str = "register") -> tuple[int, int, MemoryKind]:
    """(address, nbytes, kind) of a numpy array or a torch tensor (contiguous, of the CPU or a
    CUDA device)."""
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise InvalidTransferError("a registered array must be contiguous")
        if what in ("register", "pin") and obj.dtype.hasobject:
            # Its bytes are pointers to Python objects: a copy into them would hand the
            # interpreter addresses it never allocated (numpy exports no buffer for it either).
            raise InvalidTransferError(
                f"cannot {what} an array of Python objects (dtype {obj.dtype}): its bytes are "
                "the interpreter's pointers; register an array of numbers"
            )
        if what in ("register", "pin") and not obj.flags.writeable:
            # Transfers may write any byte of registered memory, and the core cannot tell a
            # source from a destination when memory is registered.
            raise InvalidTransferError(
                f"cannot {what} a read-only array: transfers may write any byte of registered "
                "memory (copy it into a writeable array, such as one from alloc_host, first)"
            )
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
        layout = str(getattr(obj, "layout", "torch.strided"))
        if layout != "torch.strided":
            raise InvalidTransferError(
                f"cannot {what} a tensor of layout {layout}: only a dense (torch.strided) tensor "
                "is one range of memory"
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


class Engine(_core.Engine):
    __doc__ = _core.Engine.__doc__

    @property
    def _kept(self) -> dict[int, Any]:
        """The objects whose memory is registered, by address: kept alive until unregistered."""
        kept: dict[int, Any] = self.__dict__.setdefault("_objects", {})
        return kept

    def _registering(self) -> contextlib.AbstractContextManager[Any]:
        """Held across a registration's change in the core and in :attr:`_kept`, so that the
        two agree whichever threads register and unregister at once: the core never holds a
        registration whose object the engine let go, nor the engine an object the core does
        not hold. Not taken inside a kernel launcher (this engine's or another's), where the
        core refuses the call anyway and another thread holding the lock may wait for the
        launcher's own submission."""
        if _core.in_launcher():
            return contextlib.nullcontext()
        pid = os.getpid()
        held: tuple[int, threading.Lock] = self.__dict__.setdefault(
            "_registration_lock", (pid, threading.Lock())
        )
        if held[0] != pid:
            # A child forked from the process that made it (where another thread may have
            # held it at the fork): a lock of its own. The core refuses the call there anyway.
            held = self.__dict__["_registration_lock"] = (pid, threading.Lock())
        return held[1]

    def __del__(self) -> None:
        # Drain before the registered objects in ``_kept`` go: the instance dict is cleared in no
        # particular order. Shutdown returns once the backend has stopped, its copies done (the
        # host worker is joined, CUDA streams synchronised).
        if _core.in_launcher():
            # Collected inside a kernel launcher (another engine's), where the core refuses every
            # call that waits: the core's drop drains the engine after the dict is gone, so the
            # objects its copies may reach are kept for the life of the process.
            _ABANDONED.append((self.__dict__.get("_objects"), self.__dict__.get("_held")))
            return
        _core.Engine.shutdown(self)
        if self.stats().get("shutdown_timed_out"):
            # Copies the shutdown gave up on may still read or write the registered objects:
            # they are kept for the life of the process rather than freed under the device.
            _ABANDONED.append((self.__dict__.get("_objects"), self.__dict__.get("_held")))

    def _hold(self, owner: Any) -> None:
        """Keeps ``owner`` (what memory registered by raw address belongs to) alive as long as
        the engine: a caller who keeps only the engine (a handler's ``get_finished``) cannot let
        memory its copies reach be freed under them; the engine's collection drains before its
        dict goes. A mutable ``owner`` (a list) is emptied by its giver once nothing of the
        engine's reaches its memory."""
        self.__dict__.setdefault("_held", []).append(owner)

    def shutdown(self) -> None:
        """Waits for transfers in flight and stops the backend. Results stay available.

        Where transfers are still in flight when the engine's ``shutdown_timeout`` passes, a
        warning is logged and each is reported as it ended: successful if its copies completed
        before its result was collected, else failed (on CUDA the streams may still run them;
        the host backend's worker finishes the memcpy it is in, which nothing can stop)."""
        first = not self.is_shut_down
        super().shutdown()
        if first and self.stats().get("shutdown_timed_out"):
            log.warning(
                "engine shutdown timed out with transfers in flight: they may be reported "
                "failed, and their memory may still be copied to or from (raise "
                "shutdown_timeout, or wait for the transfers before shutting down)"
            )

    def register(self, obj: Any, nbytes: int | None = None, kind: MemoryKind | None = None) -> int:
        """Registers memory transfers may use; returns its address.

        ``obj`` is a numpy array or a torch tensor (kept alive until unregistered), or a raw
        address with ``nbytes`` and ``kind`` (``"host"`` or ``"device"``), which the caller
        vouches for. A read-only numpy array is refused: transfers may write any byte of
        registered memory. On CUDA, host memory must be page-locked and device memory must be this
        engine's device; both are checked here, once. Host memory of a
        :class:`~blockswap.hostmem.PinnedRows` is registered as one region per piece it covers
        (no copy crosses from one piece into the next), all removed by one :meth:`unregister` of
        the address returned here.
        """
        if _is_int(obj):
            if nbytes is None or kind is None:
                raise InvalidTransferError("a raw address needs nbytes and kind")
            ptr = obj  # checked by the core, as nbytes and kind are
        else:
            ptr, size, found_kind = _address_of(obj)
            nbytes = size if nbytes is None else nbytes
            kind = found_kind if kind is None else kind
            if _is_int(nbytes) and nbytes > size:
                raise InvalidTransferError(f"nbytes={nbytes} is larger than the object ({size})")
        with self._registering():
            self._register(ptr, nbytes, kind)
            if not _is_int(obj):
                self._kept[ptr] = obj
        return int(ptr)

    def pin(self, obj: Any) -> int:
        """Page-locks an existing host array or CPU tensor (``cuMemHostRegister``) and registers
        it; returns its address. :meth:`unregister` unpins it."""
        ptr, nbytes, kind = _address_of(obj, "pin")
        if kind != "host":
            raise InvalidTransferError("only host memory can be pinned")
        t0 = time.perf_counter()
        with self._registering():
            self._pin(ptr, nbytes)
            self._kept[ptr] = obj
        _log_alloc("pin", nbytes, time.perf_counter() - t0, self.info()["backend"])
        return ptr

    def unregister(self, obj_or_ptr: Any) -> None:
        """Removes a registration (refused while transfers are in flight)."""
        ptr = obj_or_ptr if _is_int(obj_or_ptr) else _address_of(obj_or_ptr, "unregister")[0]
        with self._registering():
            self._unregister(ptr)
            self._kept.pop(ptr, None)

    def alloc_host(self, nbytes: int) -> np.ndarray:
        """A registered host buffer of ``nbytes`` (page-locked, device-mapped on CUDA), as a
        uint8 numpy array over blockswap's memory. Valid until :meth:`free_host`; the array
        keeps the engine, and so its memory, alive."""
        t0 = time.perf_counter()
        ptr = self._alloc_host(nbytes)
        _log_alloc("alloc_host", nbytes, time.perf_counter() - t0, self.info()["backend"])
        buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
        # The engine frees its buffers when it is dropped: the array keeps it alive (and the
        # engine does not keep the array: no cycle for the collector to find).
        buf._blockswap_core = self  # type: ignore[attr-defined]
        return np.ctypeslib.as_array(buf)

    def free_host(self, arr: np.ndarray) -> None:
        """Frees a buffer from :meth:`alloc_host` (refused while transfers are in flight). The
        array must not be used afterwards."""
        if not isinstance(arr, np.ndarray):
            raise InvalidTransferError(
                f"free_host takes an array from alloc_host, not {type(arr).__name__}"
            )
        self._free_host(arr.ctypes.data)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _log_start(info: Any, copy_path: Any) -> None:
    """Logs what the core chose for a new engine (called by the core as it makes one)."""
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


def _log_alloc(call: str, nbytes: int, seconds: float, backend: str) -> None:
    """Pinned allocations are slow (the driver page-locks every page): their size and time."""
    how = "pinned" if backend == "cuda" else "(host backend: not pinned)"
    log.info("%s: %.1f MiB of host memory %s in %.3f s", call, nbytes / 2**20, how, seconds)


def info() -> BlockswapInfo:
    """What blockswap would use here: version, CUDA availability (and why not), default backend."""
    cuda_ok, cuda_why = _core.cuda_status()
    return {
        "version": _core.__version__,
        "cuda": cuda_ok,
        "cuda_status": cuda_why,
        "default_backend": "cuda" if cuda_ok else "host",
    }
