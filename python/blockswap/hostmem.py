"""Host memory for large CPU caches: exactly the bytes asked for, page-locked in pieces.

A CPU KV cache is ``rows`` rows of ``row_bytes`` bytes (a row: a CPU sub-block or chunk, every
page it holds). Allocated as one pinned torch tensor it costs more than it holds at serving sizes:
torch's pinned allocator rounds the request up to a power of two (a 40 GiB cache takes 64 GiB),
and the CUDA driver fails one registration of 512 GiB or more. :class:`PinnedRows` maps exactly
``rows * row_bytes`` bytes (one contiguous range, zeroed) and page-locks it with
``cuMemHostRegister`` in pieces: each a whole number of rows, at most ``piece_bytes``
(:data:`DEFAULT_PIECE_BYTES`, 4 GiB) and ending on an OS page. The memory is faulted in from
several threads while the pieces are page-locked, from two threads, each as soon as it is in.

An :class:`~blockswap.Engine` registering memory of such a buffer registers one region per piece it
covers: a block table may span the pieces, but no copy crosses from one into the next (a table
whose page would is refused by name). The buffer is not unpinned while an engine holds a
registration in it, and its memory is unmapped once the buffer and every array or tensor over it
are gone. On the host backend nothing is page-locked, but the pieces are recorded and
registrations cut at them all the same.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from typing import TYPE_CHECKING, Protocol

import numpy as np

from . import _core
from ._checks import check_bool
from ._types import BackendName
from .errors import refuses_with_config_errors

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_PIECE_BYTES", "REGISTRATION_LIMIT", "PinnedRows"]

#: The largest piece by default (4 GiB): a large buffer's pieces are page-locked while the next
#: ones are faulted in (far below :data:`REGISTRATION_LIMIT`).
DEFAULT_PIECE_BYTES: int = _core.DEFAULT_PIECE_BYTES

#: One driver registration of this many bytes or more fails (512 GiB): no piece may be this large.
REGISTRATION_LIMIT: int = _core.REGISTRATION_LIMIT

#: One line per allocation (size, pieces, seconds), unless the caller writes its own; while a
#: buffer is pinned, a progress line every :data:`PROGRESS_SECONDS`.
log = logging.getLogger(__name__)

#: Seconds between progress lines while a buffer is faulted in and page-locked (tens of GiB take
#: minutes): the first comes after this long, so a quick allocation logs none.
PROGRESS_SECONDS = 10.0


class _Counts(Protocol):
    def get(self) -> tuple[int, int, int, int]: ...


class PinProgress:
    """Logs, every ``interval`` seconds until :meth:`stop`, how far pinning a buffer got: the
    share done, the bytes faulted in and page-locked of the total, and the rate (the buffer's
    bytes times the share done, per second since ``start``). ``counts.get()`` gives ``(total,
    faulted, locked, to_lock)`` bytes (:class:`blockswap._core.AllocProgress`, which the core
    counts up while the constructor runs with the GIL released); where nothing is to be
    page-locked (``to_lock`` 0: the host backend, a region vLLM locked itself) the line says
    so, and the share is of the faulting in alone."""

    def __init__(self, counts: _Counts, interval: float | None = None) -> None:
        self.counts = counts
        self.interval = PROGRESS_SECONDS if interval is None else interval
        self.lines = 0
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(
            target=self._run, name="blockswap-pin-progress", daemon=True
        )

    def start(self) -> PinProgress:
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def line(self) -> str:
        """The progress line now."""
        total, faulted, locked, to_lock = self.counts.get()
        elapsed = time.perf_counter() - self._t0
        share = (faulted + locked) / (total + to_lock) if total else 0.0
        rate = share * total / elapsed / 2**30 if elapsed > 0 else 0.0
        head = f"of host memory: {share:.0%} after {elapsed:.0f} s ({size_text(faulted)} faulted in"
        if not to_lock:
            return f"faulting in {size_text(total)} {head}; {rate:.2f} GiB/s)"
        return (
            f"pinning {size_text(total)} {head}, {size_text(locked)} page-locked; {rate:.2f} GiB/s)"
        )

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self.counts.get()[0] == 0:
                continue  # the core has not said how much it will pin yet: nothing to report
            log.info("%s", self.line())
            self.lines += 1


def size_text(nbytes: int) -> str:
    """``"6.00 GiB"``, ``"12.0 MiB"`` or ``"4096 bytes"``."""
    if nbytes >= 1 << 30:
        return f"{nbytes / 2**30:.2f} GiB"
    if nbytes >= 1 << 20:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{nbytes} bytes"


class PinnedRows:
    """``rows`` rows of ``row_bytes`` bytes of host memory, exactly that size, page-locked in
    pieces of whole rows of at most ``piece_bytes`` (see the module's documentation).

    ``backend``: ``"cuda"`` (page-locked in the primary context of ``device``, portable: every
    engine of the process can use it), ``"host"`` (nothing pinned; the pieces are recorded for
    the host backend's engines) or ``"auto"`` (CUDA where a driver is present). ``log_line``:
    log one line with the size, the pieces and the seconds the allocation took (off where the
    caller writes its own).

    :attr:`array` is a ``(rows, row_bytes)`` uint8 array over the memory and :meth:`tensor` the
    same as an int8 torch tensor; either keeps the memory mapped. :meth:`unpin` page-unlocks it
    now (refused while an engine holds a registration in it); otherwise that happens when the
    buffer and every array over it are collected.
    """

    @refuses_with_config_errors
    def __init__(
        self,
        rows: int,
        row_bytes: int,
        *,
        piece_bytes: int = DEFAULT_PIECE_BYTES,
        backend: BackendName = "auto",
        device: int = 0,
        log_line: bool = True,
    ) -> None:
        check_bool("log_line", log_line)
        t0 = time.perf_counter()
        counts = _core.AllocProgress()
        report = PinProgress(counts).start() if backend != "host" else None
        try:
            # The core checks every argument (an ArgumentTypeError or InvalidTransferError
            # naming it).
            self._buf = _core.HostBuffer(rows, row_bytes, piece_bytes, backend, device, counts)
        finally:
            if report is not None:
                report.stop()
        #: Seconds the mapping and the page-locking took.
        self.seconds = time.perf_counter() - t0
        n = self._buf.nbytes
        raw = (ctypes.c_uint8 * n).from_address(self._buf.addr)
        # The array keeps the buffer, and so the mapping, alive.
        raw._blockswap_buffer = self._buf  # type: ignore[attr-defined]
        #: The memory as a ``(rows, row_bytes)`` uint8 array.
        self.array: np.ndarray = np.ctypeslib.as_array(raw).reshape(rows, row_bytes)
        if log_line:
            log.info("host memory: %s", self.describe())

    @property
    def addr(self) -> int:
        return int(self._buf.addr)

    @property
    def nbytes(self) -> int:
        """``rows * row_bytes``: what was asked for, with no rounding."""
        return int(self._buf.nbytes)

    @property
    def rows(self) -> int:
        return int(self._buf.rows)

    @property
    def row_bytes(self) -> int:
        return int(self._buf.row_bytes)

    @property
    def pieces(self) -> list[tuple[int, int]]:
        """``(address, bytes)`` of each piece, in address order."""
        return list(self._buf.pieces)

    @property
    def pinned(self) -> bool:
        """Whether the pieces are page-locked now (never on the host backend)."""
        return bool(self._buf.pinned)

    @property
    def backend(self) -> str:
        return str(self._buf.backend)

    @property
    def users(self) -> int:
        """Engine registrations in the buffer now."""
        return int(self._buf.users)

    def describe(self) -> str:
        """``"6.00 GiB (3072 rows of 2097152 bytes) pinned in 6 pieces of at most 1.00 GiB in
        2.41 s (2.49 GiB/s)"``: what the allocation's log line says."""
        rate = ""
        if self.pinned and self.seconds > 0:
            rate = f" ({self.nbytes / self.seconds / 2**30:.2f} GiB/s)"
        return (
            f"{size_text(self.nbytes)} ({self.rows} rows of {self.row_bytes} bytes) "
            f"{self.how()} in {self.seconds:.2f} s{rate}"
        )

    def how(self) -> str:
        """``"pinned in 6 pieces of at most 1.00 GiB"`` (or ``"not pinned (host backend) in
        ..."``, ``"unpinned in ..."`` after :meth:`unpin` on CUDA)."""
        pieces = self.pieces
        state = "pinned" if self.pinned else "not pinned (host backend)"
        if not self.pinned and self.backend != "host":
            state = "unpinned"
        return (
            f"{state} in {len(pieces)} piece{'s' if len(pieces) != 1 else ''} of at most "
            f"{size_text(max(n for _, n in pieces))}"
        )

    def tensor(self) -> torch.Tensor:
        """The memory as a ``(rows, row_bytes)`` int8 torch tensor (it keeps the memory
        mapped)."""
        import torch

        return torch.from_numpy(self.array).view(torch.int8)

    def unpin(self) -> None:
        """Page-unlocks every piece now and forgets them; the memory stays mapped while an array
        over it lives. Refused (:class:`~blockswap.InvalidTransferError`) while an engine holds a
        registration in it: unregister it first (an engine that is shut down keeps its
        registrations until then, or until it is dropped). Idempotent."""
        self._buf.unpin()

    def __repr__(self) -> str:
        return f"PinnedRows({self.describe()})"
