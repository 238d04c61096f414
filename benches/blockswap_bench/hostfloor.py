"""What a submission costs the caller without blockswap: the references ``bench_wall.py`` times
``transfer_async`` against after the caller slept.

* :class:`Addresses`: numpy computing a transfer's per-page addresses, as a per-page DMA path
  would (``numpy us``, the reference of the host-time target).
* :class:`Steps`: the steps any engine that copies off the caller's thread takes for a transfer,
  done as cheaply as Python can: the addresses as above, one event recorded on the caller's
  current stream through the driver (the transfer must start after the caller's work; on CUDA
  only), and a token handed to a thread asleep on a queue (the thread that issues the copies).
  Nothing of blockswap's runs in it.
"""

from __future__ import annotations

import ctypes
import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np


class Addresses:
    """numpy computing a transfer's per-page addresses, as a per-page DMA path would: per layer,
    ``bases + ids * strides`` on both sides, and the sizes, into arrays allocated once."""

    def __init__(self, tables: tuple[Any, Any], n: int) -> None:
        gpu, cpu = tables
        self.side = {
            "gpu": (gpu.bases[:, None].copy(), gpu.strides[:, None].copy()),
            "cpu": (cpu.bases[:, None].copy(), cpu.strides[:, None].copy()),
        }
        layers = gpu.bases.shape[0]
        self.nbytes = gpu.nbytes[:, None].copy()
        self.src = np.empty((layers, n), dtype=np.int64)
        self.dst = np.empty((layers, n), dtype=np.int64)
        self.sizes = np.empty((layers, n), dtype=np.int64)

    def __call__(self, d: str, g: np.ndarray, c: np.ndarray) -> None:
        (sb, ss), sid = (self.side["gpu"], g) if d == "d2h" else (self.side["cpu"], c)
        (db, ds), did = (self.side["cpu"], c) if d == "d2h" else (self.side["gpu"], g)
        np.multiply(sid, ss, out=self.src)
        np.add(self.src, sb, out=self.src)
        np.multiply(did, ds, out=self.dst)
        np.add(self.dst, db, out=self.dst)
        self.sizes[...] = self.nbytes


class Steps:
    """A transfer's unavoidable host steps without blockswap (see the module): :class:`Addresses`,
    then ``cuEventRecord`` on the caller's current stream (``cuda``), then a token to a thread
    asleep on a queue. :meth:`close` ends the thread."""

    def __init__(self, addresses: Addresses, cuda: bool) -> None:
        self.addresses = addresses
        #: ``cuEventRecord`` on the caller's current stream (nothing on the host backend).
        self.record: Callable[[], None] = lambda: None
        if cuda:
            import torch

            ev = torch.cuda.Event()
            ev.record()  # torch makes the event on its first record
            torch.cuda.synchronize()
            driver = ctypes.CDLL("libcuda.so.1")
            record = driver.cuEventRecord
            record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            record.restype = ctypes.c_int
            stream = torch._C._cuda_getCurrentRawStream
            handle, index = ev.cuda_event, torch.cuda.current_device()
            self._event = ev  # kept alive with its handle

            def on_caller() -> None:
                if record(handle, stream(index)) != 0:
                    raise RuntimeError("cuEventRecord failed")

            self.record = on_caller
        self._queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._drain, name="steps-floor", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while self._queue.get() is not None:
            pass

    def hand_off(self) -> None:
        """A token to the thread asleep on the queue."""
        self._queue.put(0)

    def __call__(self, d: str, g: np.ndarray, c: np.ndarray) -> None:
        self.addresses(d, g, c)
        self.record()
        self._queue.put(0)  # not through hand_off: a Python call fewer

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
