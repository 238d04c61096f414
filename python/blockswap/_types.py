"""The types of the engine's arguments and of the dicts it returns (for type checkers and help()).

The literal types list the strings the core accepts; the core checks them (an unknown one is an
:class:`~blockswap.InvalidTransferError`), these only let a type checker see them.
"""

from __future__ import annotations

from typing import Literal, TypedDict

BackendName = Literal["auto", "host", "cuda"]
"""``"auto"``: CUDA where a driver is present, else the host backend."""

Direction = Literal["h2d", "d2h", "h2h", "d2d"]
"""Where a transfer reads and writes: host to device, device to host, host to host, device to
device."""

SHORT: dict[str, str] = {"d2h": "GPU -> CPU", "h2d": "CPU -> GPU"}
"""The KV-cache handlers' two directions, as their logs and reprs name them."""

MemoryKind = Literal["host", "device"]
"""What registered memory is."""

CopyPath = Literal["auto", "batch", "loop"]
"""CUDA: ``cuMemcpyBatchAsync`` where the driver has it (``"auto"``), always (``"batch"``), or one
``cuMemcpyAsync`` per descriptor (``"loop"``)."""

CompletionMode = Literal["auto", "write_value", "event"]
"""CUDA: how completions are signalled (``cuStreamWriteValue`` or events)."""

HandlerPath = Literal["auto", "blocks", "staged", "dma", "kernel"]
"""The copy path of :class:`~blockswap.handler.CpuGpuHandlers`: chosen per direction from the
caches' geometry (``"auto"``), or insisted on (see :func:`~blockswap.routing.choose_routes`)."""

CpuLayout = Literal["block_major", "mirror"]
"""The CPU cache :class:`~blockswap.handler.CpuGpuHandlers` allocates: block-major (a block's
pages in one chunk) or a mirror of the GPU tensors."""

AccessOrder = Literal["any", "stream"]
"""CUDA: the source access order of batched copies (``CU_MEMCPY_SRC_ACCESS_ORDER_*``)."""


class LaneStats(TypedDict):
    """Counters of one direction: transfers reported (``failed`` of them failed), their bytes and
    ``seconds`` (on CUDA GPU time where the engine records events, ``timing=True`` as the vLLM
    worker sets it, else the time from submission to the poll that saw it done; the worker's
    memcpy time on the host backend) and ``gb_per_s``; the p50 and
    p99 of a transfer's wall-clock time from its submission to the poll that reported it
    (``wall_p50``, ``wall_p99``) and of a submission's host time in the core (``submit_p50``,
    ``submit_p99``), in seconds, None before the first; submissions the core ``refused`` before
    anything was issued (bad input, too many in flight, the pool exhausted, shut down) and those
    the backend failed to issue (``submit_failed``). Percentiles are within 1/32 of the true
    value (log-linear buckets), over the engine's life."""

    transfers: int
    failed: int
    bytes: int
    seconds: float
    gb_per_s: float
    wall_p50: float | None
    wall_p99: float | None
    submit_p50: float | None
    submit_p99: float | None
    refused: int
    submit_failed: int


class PoolStats(TypedDict):
    """The descriptor slab pool."""

    slabs: int
    free: int
    bytes: int
    cap: int


class EngineStats(TypedDict):
    """What :meth:`Engine.stats` returns: counters per direction, transfers in flight, host time
    in submissions (``submit_ns``), in validation (``prepare_ns``) and in driver copy calls
    (``driver_ns``), the descriptor pool, and whether a shutdown gave up on transfers still in
    flight (``shutdown_timed_out``: those not completed when their results are collected are
    reported failed)."""

    h2d: LaneStats
    d2h: LaneStats
    h2h: LaneStats
    d2d: LaneStats
    in_flight: int
    driver_ns: int
    submit_ns: int
    prepare_ns: int
    pool: PoolStats
    shutdown_timed_out: bool


class EngineInfo(TypedDict):
    """What :meth:`Engine.info` returns: the backend in use and the engine's settings."""

    backend: str
    driver_version: int
    device: str | None
    copy_path: str
    completion: str
    max_in_flight: int
    pool_bytes: int
    max_descriptors: int
    coalesce: bool


class BlockswapInfo(TypedDict):
    """What :func:`blockswap.info` returns."""

    version: str
    cuda: bool
    cuda_status: str
    default_backend: Literal["cuda", "host"]
