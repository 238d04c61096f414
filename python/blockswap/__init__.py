"""blockswap: move KV-cache blocks and model weights between pinned host memory and GPU memory at
the speed of the PCIe link.

The low-level API is :class:`Engine`: register memory, submit batches of ``(src, dst, size)``
descriptors under a job id, and poll ``get_finished()``. The Rust core validates every address
against registered memory before any copy is issued.
"""

from __future__ import annotations

from ._core import (
    BackendError,
    BlockswapError,
    InvalidTransferError,
    PoolExhaustedError,
    ShutdownError,
    TransferResult,
    TransferStateError,
    WaitTimeoutError,
    __version__,
    cuda_status,
)
from .engine import Engine, info

__all__ = [
    "BackendError",
    "BlockswapError",
    "Engine",
    "InvalidTransferError",
    "PoolExhaustedError",
    "ShutdownError",
    "TransferResult",
    "TransferStateError",
    "WaitTimeoutError",
    "__version__",
    "cuda_status",
    "info",
]
