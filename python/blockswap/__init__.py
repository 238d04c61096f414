"""blockswap: move KV-cache blocks and model weights between pinned host memory and GPU memory at
the speed of the PCIe link.

The low-level API is :class:`Engine`: register memory, submit batches of ``(src, dst, size)``
descriptors under a job id, and poll ``get_finished()``. The Rust core validates every address
against registered memory before any copy is issued.

Every error the engine, the handlers, the constructors and the vLLM plug-in raise is a
:class:`BlockswapError` (:mod:`blockswap.errors`); the block-id helpers of
:mod:`blockswap.layout` (``as_block_ids``, ``expand_sub_blocks``) raise Python's ``TypeError``,
``ValueError`` and ``IndexError``, which the handlers turn into
:class:`~blockswap.InvalidTransferError`.
"""

from __future__ import annotations

import logging

from ._core import (
    BackendError,
    BlockswapError,
    InvalidTransferError,
    PoolExhaustedError,
    Route,
    ShutdownError,
    TransferResult,
    WaitTimeoutError,
    __version__,
    cuda_status,
)
from ._types import EngineInfo, EngineStats, LaneStats, PoolStats
from .engine import ArgumentTypeError, Engine, info
from .errors import ConfigError, ConfigTypeError

# The library prints nothing on its own: its lines go where the application's logging sends them
# (inside vLLM, to vLLM's log: blockswap._vllm_logging).
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "ArgumentTypeError",
    "BackendError",
    "BlockswapError",
    "ConfigError",
    "ConfigTypeError",
    "Engine",
    "EngineInfo",
    "EngineStats",
    "InvalidTransferError",
    "LaneStats",
    "PoolExhaustedError",
    "PoolStats",
    "Route",
    "ShutdownError",
    "TransferResult",
    "WaitTimeoutError",
    "__version__",
    "cuda_status",
    "info",
]
