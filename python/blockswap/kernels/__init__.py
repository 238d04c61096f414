"""Triton kernels of blockswap (one file per op, each with a plain torch reference)."""

from blockswap.kernels.copy import (
    copy_blocks,
    copy_blocks_raw,
    copy_blocks_reference,
    core_kernel,
    engine_launcher,
    interpreter_mode,
)

__all__ = [
    "copy_blocks",
    "copy_blocks_raw",
    "copy_blocks_reference",
    "core_kernel",
    "engine_launcher",
    "interpreter_mode",
]
