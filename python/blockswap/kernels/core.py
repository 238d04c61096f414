"""The copy kernels compiled for launches by the Rust core (:meth:`blockswap.Engine.load_kernel`):
the batched copy kernel for the kernel route, the staged kernel for the staged plan."""

from __future__ import annotations

from typing import Any

from blockswap import _optional
from blockswap._checks import check_int
from blockswap._core import launch_plan
from blockswap.kernels.copy import (
    DEFAULT_BLOCK_BYTES,
    DEFAULT_MAX_CTAS,
    DEFAULT_NUM_WARPS,
    _check_launch_params,
    _copy_blocks_kernel,
    interpreter_mode,
)
from blockswap.kernels.staged import _copy_staged_kernel

try:
    import torch
except ModuleNotFoundError as e:
    _optional.missing(e, "blockswap.kernels")

__all__ = ["CORE_KERNEL_PARAMS", "CORE_STAGED_PARAMS", "core_kernel"]

#: The copy kernel's leading parameters as :meth:`blockswap.Engine.load_kernel` names them.
CORE_KERNEL_PARAMS = ("srcs", "dsts", "sizes", "count", "split", "src_base", "dst_base")
#: The staged kernel's (``_copy_staged_kernel``).
CORE_STAGED_PARAMS = (
    "ids", "rings", "bases", "strides", "offsets", "count", "segments", "ring_base", "ring_src",
)  # fmt: skip


def core_kernel(
    device: int,
    *,
    max_size: int,
    staged: bool = False,
    max_ctas: int = DEFAULT_MAX_CTAS,
    num_warps: int = DEFAULT_NUM_WARPS,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> dict[str, Any] | None:
    """A copy kernel compiled for launches by the core (:meth:`blockswap.Engine.load_kernel`):
    the arguments ``load_kernel`` takes, for pages of at most ``max_size`` bytes, on CUDA device
    ``device``. The page kernel (the kernel route: a descriptor per page), or with ``staged`` the
    staged plan's kernel, which computes each page's addresses from block ids and the tables'
    geometry. The any-alignment build (every row checked at run time), every integer parameter
    64-bit. ``None`` under Triton's interpreter (the host backend copies with memcpy) or where
    Triton's build of the kernel needs scratch memory the core would not pass.
    """
    _check_launch_params(max_ctas, num_warps, block_bytes)
    check_int("max_size", max_size, 1, numpy=False)
    if interpreter_mode():
        return None
    _, _, rows, row_bytes = launch_plan(1 << 20, max_ctas, block_bytes, max_size)
    big = 1 << 40  # every integer argument typed int64 by the compiler
    fn, params = (
        (_copy_staged_kernel, CORE_STAGED_PARAMS)
        if staged
        else (_copy_blocks_kernel, CORE_KERNEL_PARAMS)
    )
    # The staged kernel chains its launches where the GPU has programmatic dependent launch.
    chained = staged and torch.cuda.get_device_capability(device) >= (9, 0)
    extra = {"CHAINED": True, "launch_pdl": True} if chained else {}
    with torch.cuda.device(device):
        kernel = fn.warmup(
            *([big] * len(params)),
            ALIGNED16=False, ROWS=rows, BLOCK_BYTES=row_bytes, num_warps=num_warps, grid=(1,),
            **extra,
        )  # fmt: skip
        kernel._init_handles()
    meta = kernel.metadata
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        return None
    return {
        "function": int(kernel.function),
        "threads": 32 * int(meta.num_warps),
        "shared": int(meta.shared),
        "params": list(params),
        "rows": rows,
        "ctas": max_ctas,
        "row_bytes": row_bytes,
        "chained": chained,
        # Kept alive with the handler: the module holding the function stays loaded.
        "compiled": kernel,
    }
