"""Triton kernels of blockswap (one file per op, each with a plain torch reference)."""

from blockswap.kernels.copy import (
    copy_blocks,
    copy_blocks_raw,
    copy_blocks_reference,
    engine_launcher,
    interpreter_mode,
    kernel_unavailable,
)
from blockswap.kernels.core import core_kernel

__all__ = [
    "copy_blocks",
    "copy_blocks_raw",
    "copy_blocks_reference",
    "core_kernel",
    "engine_launcher",
    "interpreter_mode",
    "kernel_unavailable",
]
