"""KV-cache offloading handlers: the API a KV-cache offloading connector calls.

Modelled on vLLM's CPU offloading worker (``CpuGpuOffloadingHandlers`` with one
``SingleDirectionOffloadingHandler`` per direction), so a connector adopts it with a small change::

    from blockswap.handler import CpuGpuHandlers

    handlers = CpuGpuHandlers(gpu_kv_caches, num_cpu_blocks, layout="kv_split",
                              block_size_factor=cpu_block_size // gpu_block_size)
    offload, onload = handlers.gpu_to_cpu_handler, handlers.cpu_to_gpu_handler
    offload.transfer_async(job_id, (gpu_block_ids, cpu_block_ids))   # GPU -> CPU ("d2h")
    onload.transfer_async(job_id, (cpu_block_ids, gpu_block_ids))    # CPU -> GPU ("h2d")
    for r in handlers.get_finished():                 # blockswap.TransferResult
        ...  # r.job_id, r.success, r.bytes, r.seconds, r.error
    handlers.shutdown()

Everything that can be computed once is computed at construction: the per-block address tables
(:class:`~blockswap.layout.BlockTable`) of the GPU tensors and of the CPU cache, and the memory
registrations with one :class:`~blockswap.Engine`. Per transfer, ``transfer_async`` turns block
ids into ``(src_ptrs, dst_ptrs, sizes)`` with numpy only (no per-block Python loop) and submits
them; ``get_finished`` is the engine's own lock-free poll, bound directly.

Block ids and ``block_size_factor``
-----------------------------------
A CPU block holds ``f = block_size_factor`` GPU-sized *sub-blocks*: CPU block ``c`` is sub-blocks
``c * f .. c * f + f - 1``. A transfer of ``n`` GPU blocks names ``m = ceil(n / f)`` CPU blocks
``c_0 .. c_{m-1}``; the ``m * f`` sub-blocks they expand to, in order, form a run of which ``n``
are used, one per GPU block, in order:

* **GPU -> CPU (offload, store, "d2h")**: aligned to the **start** of the first CPU block
  (``skip = 0``): GPU block ``i`` goes to sub-block ``i % f`` of CPU block ``c_{i // f}``. When
  ``n % f != 0``, the last ``f - n % f`` sub-blocks of the last CPU block are not written.
* **CPU -> GPU (onload, load, "h2d")**: aligned to the **end** of the last CPU block: the first
  ``skip = (-n) % f`` sub-blocks of ``c_0`` are skipped and GPU block ``i`` receives sub-block
  ``(skip + i) % f`` of CPU block ``c_{(skip + i) // f}``. (vLLM's load semantics: the GPU already
  holds the leading part of the first CPU block, and the run ends with the last CPU block.)

When ``n`` is a multiple of ``f`` (vLLM's stores always are) both rules name the same
sub-blocks. The number of CPU blocks must be exactly ``ceil(n / f)``.

For hybrid models (several KV-cache groups, each with its own tensors, page size and block-id
space) each side of a spec is a sequence with one block-id array per group; the rules above apply
per group, and one transfer moves all groups in one batch.

Results
-------
Both handlers share one engine, so ``get_finished`` (of either handler, or of
:class:`CpuGpuHandlers`) returns the finished transfers of *both* directions, each exactly once
over all calls: poll them all and concatenate, as vLLM's ``OffloadingWorker`` does. Job ids are
one space across the two directions. A result is a :class:`blockswap.TransferResult`
(``job_id``, ``success``, ``bytes``, ``seconds``, ``error``: vLLM's job id, success, transfer
size and transfer time).

Host cost
---------
``transfer_async`` validates the ids and writes the descriptors with a handful of numpy calls
over precomputed per-segment bases (no per-block Python loop), in ascending destination order
within each KV-cache group, which lets the core prove the destinations disjoint in one linear
pass instead of a sort. Tables the vectorised form does not cover (per-layer strides that differ,
uneven K/V interleaving) fall back to :func:`~blockswap.layout.build_transfer`.

Ordering (CUDA)
---------------
Both directions share one engine; its ``d2h`` and ``h2d`` lanes each keep their own transfers in
order on their own stream, so the two directions overlap. A GPU -> CPU transfer waits for the work
issued on the current torch stream of the handlers' device *before* ``transfer_async`` was called
(``wait_stream=torch.cuda.current_stream(device)``), so the bytes offloaded are those the model
wrote; ``transfer_async`` itself never waits on the GPU. CPU -> GPU transfers do not wait for the
compute stream: as in vLLM, the connector consumes their blocks only after ``get_finished``
reported them. The engine runs on the tensors' device whatever torch's current device is, and
calls leave torch's current device as they found it.

``import blockswap`` does not import this module (torch is optional): import
``blockswap.handler``.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable, NamedTuple, Union, cast

import numpy as np
import numpy.typing as npt

from . import _optional

try:
    import torch
except ModuleNotFoundError as e:
    _optional.missing(e, __name__)

from ._core import BlockswapError, InvalidTransferError, ShutdownError, TransferResult, cuda_status
from ._types import Direction
from .engine import Engine, check_job_id, check_job_ids
from .layout import (
    LAYOUTS,
    BlockTable,
    Layout,
    LayoutError,
    build_group_transfer,
    build_transfer,
    expand_sub_blocks,
    make_block_major_cpu_cache,
    make_cpu_cache_like,
)

__all__ = [
    "CpuGpuHandlers",
    "KVCaches",
    "SingleDirectionHandler",
    "TransferResult",
    "load_sub_blocks",
    "store_sub_blocks",
]

KVCaches = Union[
    torch.Tensor,
    Sequence[torch.Tensor],
    Mapping[str, torch.Tensor],
    Sequence[Sequence[torch.Tensor]],
]
"""KV-cache tensors of one device: one tensor, a list of per-layer tensors, a ``{layer name:
tensor}`` dict (as vLLM holds them; values in order) -- all one KV-cache group -- or a sequence of
groups, each a list of tensors (hybrid models)."""

_SHORT = {"d2h": "GPU -> CPU", "h2d": "CPU -> GPU"}

#: Route choices, calibration results, descriptor-building fallbacks, the CPU cache's
#: allocation and shutdowns that timed out (see :mod:`blockswap.engine`).
log = logging.getLogger(__name__)


# torch's current CUDA device (``cudaGetDevice``), and setting it back without creating a context.
_get_device: Callable[[], int] = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


def _maybe_exchange_device(index: int) -> None:
    torch.cuda._maybe_exchange_device(index)


class _KeepDevice:
    """Keeps torch's current CUDA device across a call into the core, which makes the engine's
    device current on the calling thread (cold paths; ``transfer_async`` inlines the same)."""

    __slots__ = ("index", "prev")

    def __init__(self, index: int | None) -> None:
        self.index = index
        self.prev = -1

    def __enter__(self) -> None:
        if self.index is not None:
            self.prev = _get_device()

    def __exit__(self, *exc: object) -> None:
        if self.index is not None and self.prev != self.index:
            _maybe_exchange_device(self.prev)


# --------------------------------------------------------------------------------------------
# Construction helpers
# --------------------------------------------------------------------------------------------


def _as_groups(caches: Any, name: str) -> tuple[list[list[torch.Tensor]], bool]:
    """(groups of tensors, whether the input was given as groups)."""
    if isinstance(caches, torch.Tensor):
        return [[caches]], False
    if isinstance(caches, Mapping):
        caches = list(caches.values())
    if isinstance(caches, (str, bytes)) or not isinstance(caches, Iterable):
        raise TypeError(
            f"{name} must be a tensor, a list of tensors, a dict of tensors or a list of groups, "
            f"not {type(caches).__name__}"
        )
    items = list(caches)
    if not items:
        raise LayoutError(f"{name} is empty")
    if all(isinstance(t, torch.Tensor) for t in items):
        return [items], False
    groups = []
    for g, item in enumerate(items):
        if isinstance(item, torch.Tensor):
            raise TypeError(f"{name} mixes tensors and groups (entry {g} is a tensor)")
        if isinstance(item, Mapping):
            item = list(item.values())
        ts = list(item)
        if not ts:
            raise LayoutError(f"{name}: group {g} is empty")
        for i, t in enumerate(ts):
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"{name}: group {g} entry {i} is a {type(t).__name__}, not a tensor"
                )
        groups.append(ts)
    return groups, True


def _check_group_uniform(ts: Sequence[torch.Tensor], g: int, name: str) -> None:
    t0 = ts[0]
    for i, t in enumerate(ts[1:], 1):
        if t.shape != t0.shape or t.dtype != t0.dtype:
            raise LayoutError(
                f"{name}: group {g} tensor {i} (shape {tuple(t.shape)}, {t.dtype}) differs from "
                f"tensor 0 (shape {tuple(t0.shape)}, {t0.dtype}); the layers of one group must "
                "have one shape and dtype"
            )


def _union_spans(tables: Iterable[BlockTable]) -> list[tuple[int, int]]:
    """Byte ranges covering every segment of every table, overlapping ranges merged (ranges that
    only touch are kept apart: they may be separate allocations)."""
    spans = sorted((int(s), int(n)) for t in tables for s, n in t.spans().tolist())
    out: list[list[int]] = []
    for s, n in spans:
        if out and s < out[-1][0] + out[-1][1]:
            end = max(out[-1][0] + out[-1][1], s + n)
            out[-1][1] = end - out[-1][0]
        else:
            out.append([s, n])
    return [(s, n) for s, n in out]


def _stream_handle(s: Any, device_index: int | None, what: str) -> int:
    if isinstance(s, (int, np.integer)) and not isinstance(s, bool):
        return int(s)
    handle = getattr(s, "cuda_stream", None)
    if handle is None:
        raise TypeError(
            f"{what} must be a torch.cuda.Stream or a raw CUstream int, not {type(s).__name__}"
        )
    dev = getattr(s, "device", None)
    if device_index is not None and dev is not None and torch.device(dev).index != device_index:
        raise ValueError(f"{what} is a stream of {dev}, but the KV cache is on cuda:{device_index}")
    return int(handle)


_I64 = np.int64
_U64 = np.uint64
_I64_MAX = int(np.iinfo(np.int64).max)
_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.setflags(write=False)
_JOB_END = 1 << 64
_max = np.maximum.reduce
_count = np.count_nonzero


def _to_ids(x: Any, name: str) -> npt.NDArray[np.int64]:
    """One side's block ids as a 1-D int64 array (no copy where it already is one). Accepts
    integer numpy arrays, sequences of ints, integer CPU tensors and objects with ``block_ids``
    (vLLM's ``BlockIDsLoadStoreSpec``). Raises TypeError / ValueError / IndexError."""
    if type(x) is np.ndarray:
        a = x
    else:
        x = getattr(x, "block_ids", x)
        if isinstance(x, torch.Tensor):
            if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
                raise TypeError(f"{name} must hold integers, got torch dtype {x.dtype}")
            try:
                a = x.detach().cpu().numpy()
            except (RuntimeError, TypeError) as e:  # meta, sparse, nested tensors
                raise TypeError(f"{name}: cannot read ids from this tensor ({e})") from None
        else:
            a = np.asarray(x)
            if a.size == 0 and a.dtype.kind not in "iu":
                a = a.astype(_I64)
    if a.dtype != _I64:
        kind = a.dtype.kind
        if kind != "i" and kind != "u":
            raise TypeError(f"{name} must hold integers, got dtype {a.dtype}")
        if kind == "u" and a.size and int(a.max()) > _I64_MAX:
            raise IndexError(f"{name} hold block id {int(a.max())}, out of range")
        a = a.astype(_I64)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if not a.flags.c_contiguous:  # a strided view: the core reads ids in place
        a = np.ascontiguousarray(a)
    return a


def _range_error(a: npt.NDArray[np.int64], n: int, name: str) -> IndexError:
    lo = int(a.min())
    if lo < 0:
        return IndexError(f"{name} hold a negative block id ({lo})")
    return IndexError(f"{name} hold block id {int(a.max())}, out of range for {n} blocks")


_bad_job_id = check_job_id


class _Plan:
    """How one KV-cache group's descriptors are written fast, in ascending destination order.

    The destination table's segments are sorted by address and cut into *clusters*: segments
    whose runs over all blocks overlap (K/V interleaved inside a block, layer views of one
    cross-layer buffer) form one cluster and must all sit inside one block stride; segments
    whose runs are clear of each other (per-layer tensors, K and V regions) are clusters of
    their own. With every cluster of ``k`` segments and one stride and page size per side,
    descriptor ``(c, i, j)`` -- cluster ``c``, ``i``-th block in ascending destination id,
    ``j``-th segment of the cluster -- has addresses ``bases[c, j] + stride * id[i]``, ascending
    in that order: one broadcast add per side, and the core checks the destinations for overlap
    in one linear pass instead of a sort. Where a table does not fit (non-uniform strides or
    pages, uneven clusters), there is no plan and :func:`~blockswap.layout.build_transfer` is used.
    """

    __slots__ = ("dst_bases", "dst_stride", "per_block", "rep", "size", "src_bases", "src_stride")

    def __init__(self, src: BlockTable, dst: BlockTable) -> None:
        self.src_bases: npt.NDArray[np.int64]
        self.dst_bases: npt.NDArray[np.int64]
        st, dt, nb = src.strides, dst.strides, dst.nbytes
        if not ((st == st[0]).all() and (dt == dt[0]).all() and (nb == nb[0]).all()):
            raise _NoPlan
        if not np.array_equal(src.nbytes, nb):
            raise _NoPlan
        z, stride, nblk = int(nb[0]), int(dt[0]), dst.num_blocks
        order = np.argsort(dst.bases, kind="stable")
        b = dst.bases[order]
        end = b + max(nblk - 1, 0) * stride + z
        new = np.ones(b.shape[0], dtype=bool)
        new[1:] = b[1:] >= np.maximum.accumulate(end)[:-1]
        starts = np.flatnonzero(new)
        sizes = np.diff(np.append(starts, b.shape[0]))
        k = int(sizes[0])
        if not (sizes == k).all():
            raise _NoPlan
        c = starts.shape[0]
        bb = b.reshape(c, k)
        if k > 1:
            if nblk > 1 and (bb[:, -1] - bb[:, 0] + z > stride).any():
                raise _NoPlan
            if (np.diff(bb, axis=1) < z).any():
                raise _NoPlan
        plan = order.reshape(c, k)
        self.src_bases = np.ascontiguousarray(src.bases[plan].reshape(c, 1, k))
        self.dst_bases = np.ascontiguousarray(dst.bases[plan].reshape(c, 1, k))
        self.src_stride = int(st[0])
        self.dst_stride = stride
        self.size = z
        self.per_block = c * k
        self.rep: dict[int, tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]] = {}


class _NoPlan(Exception):
    pass


def _make_plan(src: BlockTable, dst: BlockTable) -> _Plan | None:
    try:
        return _Plan(src, dst)
    except _NoPlan:
        return None


# --------------------------------------------------------------------------------------------
# One direction
# --------------------------------------------------------------------------------------------


#: Pages below this many bytes go to the copy kernel, the rest to DMA, when ``path="auto"``,
#: per direction. Chosen on an H200 (driver 580, 2026-11-21) from the suite's sweep
#: (`python benches/suite.py`, docs/benchmarks.md), one transfer of N scattered blocks at a
#: time, as fractions of the link's ceiling measured in the same run:
#:
#: - CPU -> GPU, N = 2,560: kernel 74-91 % from 4 to 128 KiB against DMA 8-87 % (the batch
#:   call's host cost, ~0.3-1.9 us per descriptor, holds DMA back); at 256 KiB DMA 93 %, kernel
#:   92 %. With 8 transfers queued back to back DMA catches up earlier (95 % at 64 KiB) because
#:   its submission then overlaps the copies; the threshold follows the isolated case.
#: - GPU -> CPU, N = 2,560: kernel 74-94 % from 4 to 128 KiB against DMA 18-85 %; at 256 KiB
#:   DMA 91 %, kernel 94 % (N = 256: both 93 %), and DMA, which takes no SM, is kept.
#:
#: With few blocks (N = 16) DMA is ahead of the kernel from 4 KiB, but such transfers move
#: little and are latency-bound either way.
KERNEL_BELOW: dict[str, int] = {"h2d": 256 * 1024, "d2h": 256 * 1024}

#: Bytes one kernel program keeps in flight per step on the handler's kernel route: 32 KiB
#: took CPU -> GPU 16 KiB pages from 90 to 92 % of the link with transfers queued back to back
#: (H200, 2026-11-21; 64 KiB was worse at 4 KiB pages, 87 %); the kernel's own default
#: (16 KiB) suits device-side callers.
KERNEL_BLOCK_BYTES = 32 * 1024

#: The most one launch of the handler's copy kernel moves (``kernel_launch_bytes``). A launch
#: holds the SMs of its CTAs until it ends, and a model kernel that wants every SM waits for
#: them: cuBLAS's bf16 8192^3 GEMM on H100/H200 is one persistent CTA per SM using the whole
#: register file, and one CTA of another long kernel slowed it by 14-18 % (H100), a copy launch
#: per 128 MiB transfer on 16 CTAs by 15-18 %. Shorter launches bound that wait but each costs
#: ~5 us of pipeline refill. Measured on an H200, 2026-11-21 (16 KiB x 8,192 onloads beside the
#: GEMM, two runs; then isolated transfers, 4-64 KiB pages): GEMM slowdown / bandwidth lost
#: against one launch (+15-21 %): 16 MiB +11-14 % / 0-2 points; 8 MiB +9-10 % / 0-4 points;
#: 4 MiB +5-12 % / 1-9 points; 1 MiB +1 % / 10-25 points (docs/benchmarks.md, "Kernel
#: launches and the model's SMs").
KERNEL_LAUNCH_BYTES = 8 * 1024 * 1024


class Route(NamedTuple):
    """How a handler's transfers move. ``plan="blocks"``: each block as the 2-D copies of the
    table pair's block plan (:meth:`blockswap.Engine.block_runs`), copy engines only.
    ``plan="pages"``: a descriptor per page, those below ``kernel_below`` bytes by the copy
    kernel ``launcher`` launches (0 and ``None``: DMA only)."""

    kernel_below: int
    launcher: Callable[..., None] | None
    reason: str
    plan: str = "pages"


def _check_positive_int(name: str, value: Any, alternative: str = "") -> None:
    """Raises ``TypeError`` unless ``value`` is an int (numpy's included, bool not), and
    ``ValueError`` unless it is >= 1; ``alternative`` names what else is accepted."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int{alternative}, not {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1{alternative}, got {value}")


def choose_route(
    gpu_tables: Sequence[BlockTable],
    *,
    on_cuda: bool,
    direction: str = "h2d",
    path: str = "auto",
    kernel_ctas: int = 16,
    below: int | None = None,
    launch_bytes: int | None = KERNEL_LAUNCH_BYTES,
) -> Route:
    """Picks the copy path of one direction once, from the page sizes the handler will move.

    ``"dma"``: copy engines only (no SM is taken from the model). ``"kernel"``: every page by
    the Triton copy kernel on at most ``kernel_ctas`` CTAs. ``"auto"``: pages below
    ``below`` (default :data:`KERNEL_BELOW` of ``direction``) to the kernel and larger ones to
    DMA, in the same transfer where a model mixes both (hybrid groups). On the host backend,
    ``"auto"`` is DMA (memcpy): there is no GPU to run a kernel on. ``launch_bytes``: the most
    one kernel launch moves (:data:`KERNEL_LAUNCH_BYTES`; ``None``: one launch per transfer).
    """
    if direction not in KERNEL_BELOW:
        raise ValueError(f"direction must be 'h2d' or 'd2h', not {direction!r}")
    if launch_bytes is not None:
        _check_positive_int("kernel_launch_bytes", launch_bytes, " or None")
    if path == "dma" or (path == "auto" and not on_cuda):
        return Route(0, None, "dma" if path == "dma" else "host backend: memcpy")
    default = KERNEL_BELOW[direction]
    threshold = (1 << 62) if path == "kernel" else (default if below is None else below)
    sizes = sorted({int(n) for t in gpu_tables for n in t.nbytes.tolist()})
    if not any(n < threshold for n in sizes):
        return Route(0, None, f"dma: every page is >= {threshold} bytes")
    from .kernels import engine_launcher

    launcher = engine_launcher(
        max_ctas=kernel_ctas,
        block_bytes=KERNEL_BLOCK_BYTES,
        launch_bytes=None if launch_bytes is None else int(launch_bytes),
    )
    if all(n < threshold for n in sizes):
        return Route(threshold, launcher, f"kernel ({kernel_ctas} CTAs): pages {sizes} bytes")
    return Route(
        threshold, launcher, f"hybrid: pages < {threshold} bytes by kernel, the rest by DMA"
    )


#: The block plan is taken where a block moves in at most this many 2-D copies: each copy costs
#: the host ~3 us and runs a few rows, and with 10-40 copies per block (layer tensors allocated
#: one by one, a run per driver allocation) it fell to 19-74 % of the link where the page route
#: held 81-91 % (H100, 2026-11-23, `python benches/bench_blocks.py`, docs/benchmarks.md).
BLOCK_MAX_COPIES = 2

#: ...and where pages are at least this large: at 4 KiB one 2-D copy per block reached 69-75 %
#: of the link against the copy kernel's 83-86 %; from 16 KiB it leads (91 / 98 / 100 % at 16 /
#: 64 / 256 KiB, against 88-90 / 88-91 / 83-85 %), on the copy engines alone. Same run.
BLOCK_MIN_PAGE = 16 * 1024


def block_route(
    runs: Sequence[tuple[int, int, int, int, int]] | None,
    segments: int,
    direction: str,
    *,
    insist: bool = False,
) -> Route | None:
    """The block-plan route of one direction, or None where the page route measured faster (see
    :data:`BLOCK_MAX_COPIES`, :data:`BLOCK_MIN_PAGE`) or the plan saves no copy. ``insist``
    (``path="blocks"``): wherever the plan saves a copy."""
    if runs is None or len(runs) >= segments:
        return None
    if not insist and (len(runs) > BLOCK_MAX_COPIES or runs[0][2] < BLOCK_MIN_PAGE):
        return None
    rows = [r[1] for r in runs]
    gpu_pitch = {r[3] if direction == "d2h" else r[4] for r in runs}
    return Route(
        0,
        None,
        f"blocks: {len(runs)} 2-D cop{'y' if len(runs) == 1 else 'ies'} per block "
        f"({'+'.join(map(str, rows))} pages of {runs[0][2]} B, GPU pitch "
        f"{', '.join(map(str, sorted(gpu_pitch)))} B), copy engines only",
        "blocks",
    )


class SingleDirectionHandler:
    """Moves KV-cache blocks in one direction: GPU -> CPU (``"d2h"``) or CPU -> GPU (``"h2d"``).

    Made by :class:`CpuGpuHandlers`, never directly. vLLM's ``OffloadingHandler`` methods:
    :meth:`transfer_async`, :meth:`get_finished`, :meth:`wait`, plus :meth:`stats` and
    :meth:`shutdown`.

    The two handlers of a :class:`CpuGpuHandlers` share one engine, so :meth:`get_finished` of
    either returns every finished transfer of the pair, both directions, each exactly once over
    all calls (vLLM's ``OffloadingWorker`` polls every handler and concatenates the lists, which
    gives each result once). Job ids must be unique among transfers in flight in both directions
    (a live job id is refused with :class:`~blockswap.InvalidTransferError`).
    """

    get_finished: Callable[[], list[TransferResult]]
    """Results (:class:`~blockswap.TransferResult`: ``job_id``, ``success``, ``bytes``,
    ``seconds``, ``error``) of the transfers of both directions finished since the last call.
    Lock-free, never blocks: the engine's own poll."""

    def __init__(
        self,
        owner: CpuGpuHandlers,
        direction: str,
        src_tables: list[BlockTable],
        dst_tables: list[BlockTable],
        wait_stream: Callable[[], int] | None,
        device_index: int | None,
        route: Route | None = None,
        table_ids: tuple[int, int] | None = None,
    ) -> None:
        if direction not in _SHORT:
            raise ValueError(f"direction must be 'd2h' or 'h2d', not {direction!r}")
        self._owner = owner
        self.direction: Direction = "d2h" if direction == "d2h" else "h2d"
        self._d2h = d2h = direction == "d2h"
        self._ngroups = len(src_tables)
        self._factor = f = owner.block_size_factor
        self._arange = np.arange(f, dtype=_I64)
        self._num_cpu = owner.num_cpu_blocks
        gpu_tables = src_tables if d2h else dst_tables
        self._num_gpu = [t.num_blocks for t in gpu_tables]
        self._src_tables = src_tables
        self._dst_tables = dst_tables
        plans = [_make_plan(s, d) for s, d in zip(src_tables, dst_tables)]
        self._plans: list[_Plan] | None = (
            cast("list[_Plan]", plans) if all(p is not None for p in plans) else None
        )
        if self._plans is None and table_ids is None:
            log.info(
                "%s: the KV-cache tables' strides or K/V interleaving have no vectorised plan: "
                "descriptors are built by blockswap.layout.build_transfer (more host time per "
                "transfer)",
                _SHORT[direction],
            )
        # Groups in the order of their lowest destination address (the whole batch ascends
        # where the groups' memory does not interleave).
        lo = [int(t.bases.min()) for t in dst_tables]
        self._group_order = sorted(range(self._ngroups), key=lo.__getitem__)
        sizes = {p.size for p in self._plans} if self._plans is not None else set()
        self._uniform_size = sizes.pop() if len(sizes) == 1 else None
        self._sizes_buf = _EMPTY
        self._wait_stream = wait_stream
        self._device_index = device_index
        #: The copy path of this direction (see :func:`choose_route`).
        self.route = route if route is not None else Route(0, None, "dma")
        self._kernel_below = self.route.kernel_below
        self._launcher = self.route.launcher
        self._blocks = self.route.plan == "blocks" and table_ids is not None
        self._closed = False
        self._build = self._build1 if self._ngroups == 1 else self._build_groups
        core = owner.engine._core
        # (source table, destination table) in the core, where the core expands block ids.
        self._tables = table_ids
        # Hot paths bound straight to the core.
        self._submit = core.submit
        self._submit_blocks = core.submit_blocks
        self._submit_block_runs = core.submit_block_runs
        self.get_finished = core.get_finished
        self._core_wait = core.wait
        self._core_stats = core.stats

    def __repr__(self) -> str:
        return (
            f"SingleDirectionHandler({self.direction}: {_SHORT[self.direction]}, "
            f"groups={self._ngroups}, block_size_factor={self._factor}"
            f"{', shut down' if self._closed else ''})"
        )

    @property
    def gpu_to_cpu(self) -> bool:
        return self._d2h

    # ---- the hot path ----------------------------------------------------------------------

    def transfer_async(self, job_id: int, spec: Any) -> bool:
        """Issues the transfer ``spec`` under ``job_id`` and returns ``True`` at once (it never
        waits on the GPU); its result comes from :meth:`get_finished`.

        ``spec`` is ``(src_block_ids, dst_block_ids)``: GPU then CPU block ids for GPU -> CPU,
        CPU then GPU block ids for CPU -> GPU, each a 1-D integer numpy array, list of ints,
        CPU integer tensor or an object with a ``block_ids`` attribute (vLLM's
        ``BlockIDsLoadStoreSpec``). With several KV-cache groups, each side is a sequence with one
        such array per group. ``n`` GPU blocks take ``ceil(n / block_size_factor)`` CPU blocks,
        mapped to sub-blocks as the module documents (offload: start-aligned, onload:
        end-aligned). Source ids may repeat; destination ids may not.

        Every refusal raises a :class:`~blockswap.BlockswapError` and issues nothing, leaving
        earlier transfers unaffected: :class:`~blockswap.InvalidTransferError` for bad input
        (non-integer, non-1-D, out-of-range or repeated destination block ids, a wrong number of
        CPU blocks or groups, an empty transfer, a bad or live job id),
        :class:`~blockswap.PoolExhaustedError` when too many transfers are in flight,
        :class:`~blockswap.ShutdownError` after :meth:`shutdown`. It never returns ``False``
        (vLLM's ``OffloadingWorker`` turns an exception into ``False``).
        """
        if self._closed:
            raise ShutdownError("the offloading handlers are shut down")
        if type(job_id) is not int or not 0 <= job_id < _JOB_END:
            job_id = _bad_job_id(job_id)
        tables = self._tables
        if tables is not None:
            # One group: the core checks the ids against its tables (in range, distinct
            # destinations) and writes the descriptors; only CPU sub-blocks are expanded here.
            try:
                src, dst = spec
                s_ids, d_ids = self._ids(src, dst)
            except (IndexError, ValueError, TypeError) as e:
                raise InvalidTransferError(f"{self.direction} job {job_id}: {e}") from e
            ws = self._wait_stream
            prev = None if self._device_index is None else _get_device()
            try:
                if self._blocks:
                    self._submit_block_runs(
                        job_id,
                        tables[0],
                        s_ids,
                        tables[1],
                        d_ids,
                        self.direction,
                        None if ws is None else ws(),
                    )
                else:
                    self._submit_blocks(
                        job_id,
                        tables[0],
                        s_ids,
                        tables[1],
                        d_ids,
                        self.direction,
                        None if ws is None else ws(),
                        self._kernel_below,
                        self._launcher,
                    )
            except InvalidTransferError as e:
                raise InvalidTransferError(f"{self.direction} job {job_id}: {e}") from e
            finally:
                if prev is not None and prev != self._device_index:
                    _maybe_exchange_device(prev)
            return True
        try:
            src, dst = spec
            sp, dp, sz = self._build(src, dst)
        except (IndexError, ValueError, TypeError) as e:
            raise InvalidTransferError(f"{self.direction} job {job_id}: {e}") from e
        if sz.shape[0] == 0:
            raise InvalidTransferError(
                f"{self.direction} job {job_id}: empty transfer (no blocks in any group)"
            )
        if self._device_index is None:  # host backend
            self._submit(
                job_id, sp, dp, sz, self.direction, None, self._kernel_below, self._launcher
            )
            return True
        # CUDA. The core makes the engine's device current on this thread: give torch its
        # current device back where it differs (a handler on cuda:1 called under cuda:0).
        prev = _get_device()
        ws = self._wait_stream
        try:
            self._submit(
                job_id,
                sp,
                dp,
                sz,
                self.direction,
                None if ws is None else ws(),
                self._kernel_below,
                self._launcher,
            )
        finally:
            if prev != self._device_index:
                _maybe_exchange_device(prev)
        return True

    def _gpu_cpu(self, src: Any, dst: Any) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """(GPU ids, CPU sub-block ids) of one transfer: CPU block ids range-checked, then
        expanded (offload start-aligned, onload end-aligned)."""
        f = self._factor
        d2h = self._d2h
        gpu = _to_ids(src if d2h else dst, "GPU block ids")
        cpu = _to_ids(dst if d2h else src, "CPU block ids")
        n = gpu.shape[0]
        m = cpu.shape[0]
        if m != -(-n // f):
            if f == 1:
                raise ValueError(f"{n} GPU block ids but {m} CPU block ids")
            raise ValueError(
                f"{n} GPU blocks take ceil({n} / block_size_factor {f}) = {-(-n // f)} CPU "
                f"blocks, got {m}"
            )
        if f != 1 and n:
            # Range-check CPU ids before scaling them (no overflow into valid ids).
            if _max(cpu.view(_U64)) >= self._num_cpu:
                raise _range_error(cpu, self._num_cpu, "CPU block ids")
            sub = (cpu[:, None] * f + self._arange).reshape(-1)
            skip = 0 if d2h else -n % f
            cpu = sub[skip : skip + n]
        return gpu, cpu

    def _ids(self, src: Any, dst: Any) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """(source ids, destination ids) for the core's block tables. Range and uniqueness checks
        are the core's."""
        gpu, cpu = self._gpu_cpu(src, dst)
        return (gpu, cpu) if self._d2h else (cpu, gpu)

    def _pairs(
        self, g: int, src: Any, dst: Any
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Validated (source ids, destination ids) of group ``g``, CPU ids expanded to sub-block
        ids, in ascending destination order."""
        f = self._factor
        d2h = self._d2h
        gpu, cpu = self._gpu_cpu(src, dst)
        n = gpu.shape[0]
        if n == 0:
            return _EMPTY, _EMPTY
        num_cpu = self._num_cpu * f
        if d2h:
            s, d, s_max, d_max, s_name = gpu, cpu, self._num_gpu[g], num_cpu, "GPU block ids"
        else:
            s, d, s_max, d_max, s_name = cpu, gpu, num_cpu, self._num_gpu[g], "CPU block ids"
        if _max(s.view(_U64)) >= s_max:  # negative ids wrap to huge ones
            raise _range_error(s, s_max, s_name)
        if n > 1 and _count(d[1:] <= d[:-1]):  # not strictly ascending: sort
            order = d.argsort()
            d = d[order]
            s = s[order]
            if _count(d[1:] == d[:-1]):
                x = int(d[1:][d[1:] == d[:-1]][0])
                what = f"CPU block id {x // f}" if d2h else f"GPU block id {x}"
                raise ValueError(f"{what} is a destination more than once")
        if d[0] < 0 or d[-1] >= d_max:  # d is ascending
            raise _range_error(d, d_max, "CPU block ids" if d2h else "GPU block ids")
        return s, d

    def _sizes(self, total: int, size: int) -> npt.NDArray[np.int64]:
        buf = self._sizes_buf
        if buf.shape[0] < total:
            buf = np.full(max(total, 2 * buf.shape[0]), size, dtype=_I64)
            buf.setflags(write=False)
            self._sizes_buf = buf
        return buf[:total]

    def _fill(
        self, p: _Plan, s: npt.NDArray[np.int64], d: npt.NDArray[np.int64], out: np.ndarray
    ) -> None:
        """Write group plan ``p``'s descriptors for ids ``s`` -> ``d`` into ``out[0]`` / ``out[1]``
        (each of ``p.per_block * n`` elements)."""
        n = s.shape[0]
        c, _, k = p.src_bases.shape
        if k == 1:
            # Contiguous passes only (a broadcast add over short rows costs 3x): the ids' offsets
            # copied into every row, plus the segment bases repeated n times (cached per n).
            rep = p.rep.get(n)
            if rep is None:
                if len(p.rep) > 64:
                    p.rep.clear()
                rep = p.rep[n] = (
                    np.repeat(p.src_bases.ravel(), n),
                    np.repeat(p.dst_bases.ravel(), n),
                )
            o = out[0]
            np.copyto(o.reshape(c, n), s * p.src_stride)
            np.add(o, rep[0], out=o)
            o = out[1]
            np.copyto(o.reshape(c, n), d * p.dst_stride)
            np.add(o, rep[1], out=o)
        else:
            np.add(p.src_bases, (s * p.src_stride)[:, None], out=out[0].reshape(c, n, k))
            np.add(p.dst_bases, (d * p.dst_stride)[:, None], out=out[1].reshape(c, n, k))

    def _build1(self, src: Any, dst: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        s, d = self._pairs(0, src, dst)
        plans = self._plans
        if plans is None:
            return self._fallback([s], [d])
        p = plans[0]
        total = p.per_block * s.shape[0]
        out = np.empty((2, total), dtype=_I64)
        self._fill(p, s, d, out)
        return out[0], out[1], self._sizes(total, p.size)

    def _build_groups(self, src: Any, dst: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ng = self._ngroups
        src = list(getattr(src, "block_ids", src))
        dst = list(getattr(dst, "block_ids", dst))
        if len(src) != ng or len(dst) != ng:
            raise ValueError(
                f"this cache has {ng} KV-cache groups: each side of the spec must hold one "
                f"block-id array per group, got {len(src)} and {len(dst)}"
            )
        pairs = []
        for g in range(ng):
            try:
                pairs.append(self._pairs(g, src[g], dst[g]))
            except (IndexError, ValueError, TypeError) as e:
                raise type(e)(f"group {g}: {e}") from e
        plans = self._plans
        if plans is None:
            return self._fallback([p[0] for p in pairs], [p[1] for p in pairs])
        total = sum(plans[g].per_block * pairs[g][0].shape[0] for g in range(ng))
        out = np.empty((2, total), dtype=_I64)
        size = self._uniform_size
        sz = self._sizes(total, size) if size is not None else np.empty(total, dtype=_I64)
        lo = 0
        for g in self._group_order:
            s, d = pairs[g]
            if s.shape[0] == 0:
                continue
            p = plans[g]
            hi = lo + p.per_block * s.shape[0]
            self._fill(p, s, d, out[:, lo:hi])
            if size is None:
                sz[lo:hi] = p.size
            lo = hi
        return out[0], out[1], sz

    def _fallback(
        self, s: list[npt.NDArray[np.int64]], d: list[npt.NDArray[np.int64]]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Tables without a plan: the layout module's descriptors (ids already validated)."""
        if not self._src_tables:  # shut down by another thread
            raise ShutdownError("the offloading handlers are shut down")
        if len(s) == 1:
            t = build_transfer(self._src_tables[0], s[0], self._dst_tables[0], d[0])
        else:
            t = build_group_transfer(self._src_tables, s, self._dst_tables, d)
        return t.src_ptrs, t.dst_ptrs, t.sizes

    # ---- everything else ---------------------------------------------------------------------

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        """Blocks until the listed transfers (of either direction) finished; their results still
        come from :meth:`get_finished`. Ids never submitted (or already reported) are not waited
        for. Raises :class:`~blockswap.WaitTimeoutError` after ``timeout`` seconds."""
        ids = check_job_ids(job_ids)
        with _KeepDevice(self._device_index):
            self._core_wait(ids, timeout)

    def stats(self) -> dict[str, Any]:
        """This direction's totals over finished transfers: ``transfers``, ``failed``, ``bytes``,
        ``seconds`` and ``gb_per_s`` (bytes / seconds / 1e9)."""
        return dict(self._core_stats()[self.direction])

    def shutdown(self) -> None:
        """Shuts down both directions (they share one engine): see
        :meth:`CpuGpuHandlers.shutdown`."""
        self._owner.shutdown()


# --------------------------------------------------------------------------------------------
# Both directions of one device
# --------------------------------------------------------------------------------------------


class CpuGpuHandlers:
    """A GPU -> CPU and a CPU -> GPU handler for the KV cache of one device, over one engine.

    ``gpu_caches``: the KV-cache tensors (see :data:`KVCaches`): a list of per-layer tensors, a
    dict of them, one cross-layer tensor, or a list of KV-cache groups (hybrid models). On the
    host backend, CPU tensors stand in for the GPU side.

    ``num_cpu_blocks``: CPU blocks per group, each of ``block_size_factor`` GPU-sized
    sub-blocks (vLLM: ``cpu_block_size // gpu_block_size``).

    ``layout``: the layout name of :mod:`blockswap.layout` (``"kv_split"``, ``"kv_fused"``,
    ``"cross_layer"``, ``"mla"``), one for all groups or one per group. The layers of one group
    must share one shape and dtype; any dtype works (bytes are bytes), pages may be padded.

    ``cpu_caches``: the CPU cache, in the structure of ``gpu_caches``; by default it is allocated
    here (:func:`~blockswap.layout.make_cpu_cache_like`, page-locked on CUDA) and freed by
    :meth:`shutdown`. A given one must match the GPU tensors (dtype, and shape except the block
    dim, which holds ``num_cpu_blocks * block_size_factor`` sub-blocks) and, on CUDA, be pinned;
    it stays the caller's.

    ``backend``: ``"auto"`` (CUDA when the GPU tensors are on a CUDA device and a driver is
    present, else the host backend), ``"cuda"`` or ``"host"``. On CUDA the engine runs on the
    tensors' device (whatever torch's current device is).

    ``copy_streams``: CUDA streams the copies run on instead of the engine's own: one stream for
    both directions, or a ``{"h2d": stream, "d2h": stream}`` mapping (either key may be left
    out); ``torch.cuda.Stream`` objects (kept alive here) or raw ``CUstream`` ints.

    ``path``, ``kernel_ctas``, ``kernel_below``, ``kernel_launch_bytes``: the copy path per
    direction, chosen here once (:func:`choose_route`; ``handlers.routes`` says what was chosen
    and why). ``kernel_launch_bytes`` bounds what one launch of the copy kernel moves, and so how
    long it holds its SMs from the model (:data:`KERNEL_LAUNCH_BYTES`; ``None``: one launch per
    transfer, the most bandwidth).

    ``engine_options``: more options of :class:`~blockswap.Engine` (``max_in_flight``,
    ``pool_bytes``, ``copy_path``, ``timing``, ...).

    Construction validates everything, builds the block tables once and registers the GPU tensors
    as ``"device"`` memory and the CPU cache as ``"host"`` memory; errors are ``ValueError`` /
    ``TypeError`` subclasses (:class:`~blockswap.layout.LayoutError`) or blockswap errors.
    """

    def __init__(
        self,
        gpu_caches: KVCaches,
        num_cpu_blocks: int,
        *,
        layout: Layout | Sequence[Layout],
        block_size_factor: int = 1,
        cpu_caches: KVCaches | None = None,
        backend: str = "auto",
        copy_streams: Any = None,
        path: str = "auto",
        kernel_ctas: int = 16,
        kernel_below: int | None = None,
        kernel_launch_bytes: int | None = KERNEL_LAUNCH_BYTES,
        calibrate: bool = False,
        cpu_layout: str = "block_major",
        **engine_options: Any,
    ) -> None:
        self._lock = threading.Lock()
        if path not in ("auto", "blocks", "dma", "kernel"):
            raise ValueError(f"path must be 'auto', 'blocks', 'dma' or 'kernel', not {path!r}")
        self._shut = False
        _check_positive_int("num_cpu_blocks", num_cpu_blocks)
        _check_positive_int("block_size_factor", block_size_factor)
        for key in ("device", "h2d_stream", "d2h_stream"):
            if key in engine_options:
                raise TypeError(
                    f"{key!r} is set by CpuGpuHandlers (the tensors' device; copy_streams=)"
                )
        self.num_cpu_blocks = int(num_cpu_blocks)
        self.block_size_factor = f = int(block_size_factor)

        gpu_groups, grouped = _as_groups(gpu_caches, "gpu_caches")
        ng = len(gpu_groups)
        layouts = self._layouts(layout, ng)

        # Devices: every GPU tensor on one device.
        device = gpu_groups[0][0].device
        for g, ts in enumerate(gpu_groups):
            for i, t in enumerate(ts):
                if t.device != device:
                    raise ValueError(
                        f"gpu_caches: group {g} tensor {i} is on {t.device}, but group 0 tensor 0 "
                        f"is on {device}; all KV-cache tensors must be on one device"
                    )
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"gpu_caches are on {device}: blockswap moves CUDA (or CPU) memory")
        if backend == "auto":
            backend = "cuda" if device.type == "cuda" and cuda_status()[0] else "host"
        if backend not in ("cuda", "host"):
            raise ValueError(f"backend must be 'auto', 'cuda' or 'host', not {backend!r}")
        if backend == "host" and device.type != "cpu":
            raise ValueError(
                f"the host backend copies host memory only, but gpu_caches are on {device}; use "
                "backend='cuda' (or 'auto')"
            )
        if backend == "cuda" and device.type != "cuda":
            raise ValueError(f"backend='cuda' needs CUDA tensors, but gpu_caches are on {device}")
        on_cuda = backend == "cuda"
        device_index: int | None = None
        if on_cuda:
            device_index = device.index if device.index is not None else torch.cuda.current_device()
            device = torch.device("cuda", device_index)
        self.device = device
        self.backend = backend

        # GPU tables (validate layouts and uniform layers).
        gpu_tables = []
        for g, (ts, lay) in enumerate(zip(gpu_groups, layouts)):
            _check_group_uniform(ts, g, "gpu_caches")
            try:
                gpu_tables.append(BlockTable.from_tensors(ts, lay))
            except (LayoutError, TypeError) as e:
                raise type(e)(f"gpu_caches group {g}: {e}") from e

        # CPU cache: allocated here, or the caller's, checked against the GPU tensors.
        self._owns_cpu = cpu_caches is None
        #: The block-major CPU cache, one ``(num_cpu_blocks * block_size_factor, pages, page
        #: elements)`` tensor per group (see :func:`~blockswap.layout.make_block_major_cpu_cache`),
        #: where it was allocated here block-major; ``cpu_caches`` are per-layer views into it.
        self.cpu_chunks: list[torch.Tensor] | None = None
        if cpu_layout not in ("block_major", "mirror"):
            raise ValueError(f"cpu_layout must be 'block_major' or 'mirror', not {cpu_layout!r}")
        if cpu_caches is None:
            t0 = time.perf_counter()
            with torch.cuda.device(device_index) if on_cuda else contextlib.nullcontext():
                if cpu_layout == "block_major":
                    made = [
                        make_block_major_cpu_cache(
                            ts,
                            self.num_cpu_blocks,
                            layout=lay,
                            block_size_factor=f,
                            pin_memory=on_cuda,
                        )
                        for ts, lay in zip(gpu_groups, layouts)
                    ]
                    self.cpu_chunks = [c for c, _ in made]
                    cpu_groups = [v for _, v in made]
                else:
                    cpu_groups = [
                        make_cpu_cache_like(
                            ts,
                            self.num_cpu_blocks,
                            layout=lay,
                            block_size_factor=f,
                            pin_memory=on_cuda,
                        )
                        for ts, lay in zip(gpu_groups, layouts)
                    ]
            log.info(
                "CPU cache: %.1f MiB of %s host memory for %d blocks in %.3f s",
                sum(t.numel() * t.element_size() for ts in cpu_groups for t in ts) / 2**20,
                "pinned" if on_cuda else "unpinned (host backend)",
                self.num_cpu_blocks,
                time.perf_counter() - t0,
            )
        else:
            cpu_groups, cpu_grouped = _as_groups(cpu_caches, "cpu_caches")
            if len(cpu_groups) != ng or cpu_grouped != grouped:
                raise LayoutError(
                    f"cpu_caches has {len(cpu_groups)} group(s), gpu_caches {ng}: give them in "
                    "the same structure"
                )
            for g, (cts, gts, lay) in enumerate(zip(cpu_groups, gpu_groups, layouts)):
                self._check_cpu_group(g, cts, gts, lay, on_cuda)
        cpu_tables = []
        for g, (ts, lay) in enumerate(zip(cpu_groups, layouts)):
            try:
                tab = BlockTable.from_tensors(ts, lay)
                gpu_tables[g].check_compatible(tab)
            except (LayoutError, TypeError) as e:
                raise type(e)(f"cpu_caches group {g}: {e}") from e
            if tab.num_blocks != self.num_cpu_blocks * f:
                raise LayoutError(
                    f"cpu_caches group {g} has {tab.num_blocks} blocks in its block dim; "
                    f"num_cpu_blocks={self.num_cpu_blocks} x block_size_factor={f} needs "
                    f"{self.num_cpu_blocks * f}"
                )
            cpu_tables.append(tab)

        # Streams and the engine.
        self._streams: list[Any] = []
        options = dict(engine_options)
        if copy_streams is not None:
            if not on_cuda:
                raise ValueError("copy_streams needs the CUDA backend")
            if isinstance(copy_streams, Mapping):
                unknown = set(copy_streams) - {"h2d", "d2h"}
                if unknown:
                    raise ValueError(f"copy_streams keys must be 'h2d' / 'd2h', not {unknown}")
                per = dict(copy_streams)
            else:
                per = {"h2d": copy_streams, "d2h": copy_streams}
            for key, s in per.items():
                if s is not None:
                    options[f"{key}_stream"] = _stream_handle(
                        s, device_index, f"copy_streams[{key!r}]"
                    )
                    self._streams.append(s)
        if on_cuda:
            options["device"] = device_index
        self._device_index = device_index
        self._registered: list[int] = []
        with _KeepDevice(device_index):
            self.engine = Engine("cuda" if on_cuda else "host", **options)
            try:
                for start, n in _union_spans(gpu_tables):
                    self.engine.register(start, n, "device")
                    self._registered.append(start)
                for start, n in _union_spans(cpu_tables):
                    self.engine.register(start, n, "host")
                    self._registered.append(start)
                # One group: the core expands block ids itself (see transfer_async), from
                # tables it checked once against the memory registered above.
                self._table_ids: tuple[int, int] | None = None
                if ng == 1:
                    core = self.engine._core
                    gt, ct = gpu_tables[0], cpu_tables[0]
                    self._table_ids = (
                        core.register_table(
                            gt.bases, gt.strides, gt.nbytes, gt.num_blocks, "device", "GPU", 1
                        ),
                        core.register_table(
                            ct.bases, ct.strides, ct.nbytes, ct.num_blocks, "host", "CPU", f
                        ),
                    )
            except BaseException:
                self.engine.shutdown()
                raise

        self._gpu_caches: list[list[torch.Tensor]] | None = gpu_groups
        self._cpu_caches: list[list[torch.Tensor]] | None = cpu_groups
        self.gpu_tables: list[BlockTable] = gpu_tables
        self.cpu_tables: list[BlockTable] = cpu_tables
        self.num_groups = ng
        self.layouts = layouts

        wait_stream: Callable[[], int] | None = None
        if on_cuda:
            assert device_index is not None
            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            idx = device_index
            if raw is not None:
                wait_stream = lambda: raw(idx)  # noqa: E731
            else:  # pragma: no cover - older torch
                wait_stream = lambda: torch.cuda.current_stream(idx).cuda_stream  # noqa: E731
        # Path selection, once, here: which descriptors a copy kernel moves (see choose_route).
        self.routes: dict[str, Route] = {
            d: choose_route(
                gpu_tables,
                on_cuda=on_cuda,
                direction=d,
                path="auto" if path == "blocks" else path,
                kernel_ctas=kernel_ctas,
                below=kernel_below,
                launch_bytes=kernel_launch_bytes,
            )
            for d in ("d2h", "h2d")
        }
        tids = self._table_ids
        #: The block plan of each direction (:meth:`blockswap.Engine.block_runs`: one ``(first
        #: page, pages, page bytes, source pitch, destination pitch)`` per 2-D copy of a block),
        #: or None where the geometry gives none (several KV-cache groups included).
        self.block_plans: dict[str, list[tuple[int, int, int, int, int]] | None] = {
            "d2h": None,
            "h2d": None,
        }
        if tids is not None:
            for d, (a, b) in (("d2h", tids), ("h2d", (tids[1], tids[0]))):
                self.block_plans[d] = self.engine.block_runs(a, b, d)
        if path == "blocks" or (path == "auto" and self.cpu_chunks is not None):
            # The block plan, where the two sides' geometry gives one (see block_route). A CPU
            # cache laid out as a mirror of the GPU (the caller's, or cpu_layout="mirror") keeps
            # the page route by default: pitched copies into it measured 10-25 % slower below
            # 32 KiB pages than into a block-major cache (H100, 2026-11-23).
            segments = len(gpu_tables[0].nbytes)
            for d, runs in self.block_plans.items():
                blk = block_route(runs, segments, d, insist=path == "blocks")
                if blk is not None:
                    self.routes[d] = blk
        for d, r in self.routes.items():
            log.info("%s route (path=%r): %s", _SHORT[d], path, r.reason)
        if path == "blocks" and any(r.plan != "blocks" for r in self.routes.values()):
            raise ValueError(
                "path='blocks' needs one KV-cache group whose pages lie at one pitch on both "
                f"sides; here: {self.routes['d2h'].reason}"
            )
        tids = self._table_ids
        self.gpu_to_cpu_handler = SingleDirectionHandler(
            self, "d2h", gpu_tables, cpu_tables, wait_stream, device_index, self.routes["d2h"], tids
        )
        self.cpu_to_gpu_handler = SingleDirectionHandler(
            self,
            "h2d",
            cpu_tables,
            gpu_tables,
            None,
            device_index,
            self.routes["h2d"],
            None if tids is None else (tids[1], tids[0]),
        )
        self.get_finished = self.engine._core.get_finished
        self.calibration: dict[str, dict[str, Any]] | None = None
        if calibrate:
            self.calibration = self._calibrate(kernel_ctas)

    # ---- construction helpers ------------------------------------------------------------------

    @staticmethod
    def _layouts(layout: Any, ng: int) -> list[Layout]:
        if isinstance(layout, str):
            layouts = [layout] * ng
        else:
            layouts = list(layout)
            if len(layouts) != ng:
                raise ValueError(f"{len(layouts)} layouts given for {ng} KV-cache groups")
        for lay in layouts:
            if lay not in LAYOUTS:
                raise ValueError(f"unknown layout {lay!r}; expected one of {sorted(LAYOUTS)}")
        return cast("list[Layout]", layouts)

    def _check_cpu_group(
        self,
        g: int,
        cts: Sequence[torch.Tensor],
        gts: Sequence[torch.Tensor],
        lay: str,
        on_cuda: bool,
    ) -> None:
        if len(cts) != len(gts):
            raise LayoutError(
                f"cpu_caches group {g} has {len(cts)} tensors, gpu_caches group {g} {len(gts)}"
            )
        bd = LAYOUTS[lay]
        want_blocks = self.num_cpu_blocks * self.block_size_factor
        for i, (c, t) in enumerate(zip(cts, gts)):
            if c.device.type != "cpu":
                raise ValueError(f"cpu_caches group {g} tensor {i} is on {c.device}, not the CPU")
            if c.dtype != t.dtype:
                raise LayoutError(
                    f"cpu_caches group {g} tensor {i} is {c.dtype}, the GPU tensor {t.dtype}"
                )
            want = list(t.shape)
            if c.dim() == t.dim():
                want[bd % t.dim()] = want_blocks
            if list(c.shape) != want:
                raise LayoutError(
                    f"cpu_caches group {g} tensor {i} has shape {tuple(c.shape)}; the GPU tensor "
                    f"{tuple(t.shape)} with num_cpu_blocks={self.num_cpu_blocks} x "
                    f"block_size_factor={self.block_size_factor} needs {tuple(want)}"
                )
            if on_cuda and not c.is_pinned():
                raise ValueError(
                    f"cpu_caches group {g} tensor {i} is not pinned: the CUDA backend needs "
                    "page-locked memory (pin_memory=True)"
                )

    # ---- the API ----------------------------------------------------------------------------------

    @property
    def d2h(self) -> SingleDirectionHandler:
        """Alias of :attr:`gpu_to_cpu_handler`."""
        return self.gpu_to_cpu_handler

    @property
    def h2d(self) -> SingleDirectionHandler:
        """Alias of :attr:`cpu_to_gpu_handler`."""
        return self.cpu_to_gpu_handler

    @property
    def handlers(self) -> tuple[SingleDirectionHandler, SingleDirectionHandler]:
        """``(gpu_to_cpu_handler, cpu_to_gpu_handler)``."""
        return self.gpu_to_cpu_handler, self.cpu_to_gpu_handler

    @property
    def is_shut_down(self) -> bool:
        return self._shut

    @property
    def cpu_caches(self) -> list[list[torch.Tensor]]:
        """The CPU cache, one list of tensors per KV-cache group (even for one group)."""
        if self._cpu_caches is None:
            raise ShutdownError("the offloading handlers are shut down: the CPU cache is freed")
        return self._cpu_caches

    @property
    def gpu_caches(self) -> list[list[torch.Tensor]]:
        """The GPU tensors, one list per KV-cache group (even for one group)."""
        if self._gpu_caches is None:
            raise ShutdownError("the offloading handlers are shut down")
        return self._gpu_caches

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        """Blocks until the listed transfers (either direction) finished; see
        :meth:`SingleDirectionHandler.wait`."""
        self.gpu_to_cpu_handler.wait(job_ids, timeout)

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per-direction totals: ``{"d2h": {...}, "h2d": {...}}`` with ``transfers``, ``failed``,
        ``bytes``, ``seconds``, ``gb_per_s``."""
        s = self.engine.stats()
        return {"d2h": dict(s["d2h"]), "h2d": dict(s["h2d"])}

    def _calibrate(self, kernel_ctas: int, reps: int = 5) -> dict[str, dict[str, Any]]:
        """Measures DMA against the copy kernel on this machine, per direction, and keeps the
        faster: other GPUs, links and drivers need other thresholds than the built-in one.

        Runs a GPU -> CPU transfer of up to 256 scattered blocks, then CPU -> GPU of the same
        blocks back into place, so the KV cache's bytes are unchanged. Needs one KV-cache group
        (the page sizes are then one size class).
        """
        from .kernels import engine_launcher

        if self.num_groups != 1:
            raise ValueError("calibrate=True needs a single KV-cache group")
        f = self.block_size_factor
        num_gpu = self.gpu_tables[0].num_blocks
        # Whole CPU blocks (the load then reads back exactly the sub-blocks the store wrote), and
        # scattered GPU blocks: consecutive ones would coalesce and flatter DMA.
        n = max(f, min(num_gpu, self.num_cpu_blocks * f, 256) // f * f)
        n = min(n, num_gpu)
        gpu_ids = np.random.default_rng(0).permutation(num_gpu)[:n].astype(_I64)
        cpu_ids = np.arange(-(-n // f), dtype=_I64)
        nbytes = n * int(self.gpu_tables[0].nbytes.sum())
        launcher = next(
            (r.launcher for r in self.routes.values() if r.launcher is not None), None
        ) or engine_launcher(max_ctas=kernel_ctas, block_bytes=KERNEL_BLOCK_BYTES)
        report: dict[str, dict[str, Any]] = {}
        job = _JOB_END - 1
        for h, spec in (
            (self.gpu_to_cpu_handler, (gpu_ids, cpu_ids)),
            (self.cpu_to_gpu_handler, (cpu_ids, gpu_ids)),
        ):
            speeds: dict[str, float] = {}
            candidates: list[tuple[str, int, Any, bool]] = [
                ("dma", 0, None, False),
                ("kernel", 1 << 62, launcher, False),
            ]
            plan = self.block_plans[h.direction]
            if block_route(plan, len(self.gpu_tables[0].nbytes), h.direction, insist=True):
                candidates.append(("blocks", 0, None, True))
            for name, below, launch, blocks in candidates:
                h._kernel_below, h._launcher, h._blocks = below, launch, blocks
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    h.transfer_async(job, spec)
                    h.wait([job])
                    times.append(time.perf_counter() - t0)
                    results = self.get_finished()
                    if not all(r.success for r in results):
                        raise BlockswapError(f"calibration transfer failed: {results}")
                speeds[name] = nbytes / statistics.median(times[1:]) / 1e9
            chosen = max(speeds, key=speeds.__getitem__)
            h._kernel_below, h._launcher = (1 << 62, launcher) if chosen == "kernel" else (0, None)
            h._blocks = chosen == "blocks"
            h.route = self.routes[h.direction] = Route(
                h._kernel_below,
                h._launcher,
                f"calibrated: {chosen}",
                "blocks" if h._blocks else "pages",
            )
            report[h.direction] = {
                "blocks": n,
                "chosen": chosen,
                **{f"{k}_gbps": v for k, v in speeds.items()},
            }
            log.info(
                "calibration %s, %d blocks: DMA %.2f GB/s, kernel %.2f GB/s: %s",
                _SHORT[h.direction],
                n,
                speeds["dma"],
                speeds["kernel"],
                chosen,
            )
        return report

    def shutdown(self) -> None:
        """Drains the transfers in flight (both directions), then unregisters the memory and frees
        the CPU cache allocated here, exactly once: a second call is a no-op. Results of every
        transfer, including those in flight at the call, are still returned by ``get_finished``;
        ``transfer_async`` raises :class:`~blockswap.ShutdownError` afterwards."""
        with self._lock:
            if self._shut:
                return
            self._shut = True
            self.gpu_to_cpu_handler._closed = True
            self.cpu_to_gpu_handler._closed = True
            failed: list[str] = []
            with _KeepDevice(self._device_index):
                self.engine.shutdown()  # waits for every transfer in flight
                if self._table_ids is not None:
                    for tid in self._table_ids:
                        try:
                            self.engine._core.unregister_table(tid)
                        except BlockswapError as e:
                            failed.append(str(e))
                    self._table_ids = None
                for start in self._registered:
                    try:
                        self.engine.unregister(start)
                    except BlockswapError as e:
                        failed.append(str(e))
            if failed:
                # Copies may still touch the memory (shutdown timed out): keep it alive rather
                # than free memory a copy could write.
                log.warning(
                    "transfers still in flight after shutdown (shutdown_timeout): the KV-cache "
                    "memory is kept allocated (%s)",
                    failed[0],
                )
                _leaked.append(
                    (self._gpu_caches, self._cpu_caches, self.gpu_tables, self.cpu_tables)
                )
            self._registered = []
            for h in self.handlers:
                h._src_tables = h._dst_tables = []
                h._plans = None
            self.gpu_tables = []
            self.cpu_tables = []
            self._gpu_caches = None
            self._cpu_caches = None  # frees the CPU cache allocated here
            self._streams = []

    def __enter__(self) -> CpuGpuHandlers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return (
            f"CpuGpuHandlers(device={self.device}, backend={self.backend!r}, "
            f"groups={self.num_groups}, num_cpu_blocks={self.num_cpu_blocks}, "
            f"block_size_factor={self.block_size_factor}"
            f"{', shut down' if self._shut else ''})"
        )


_leaked: list[Any] = []
"""Memory a timed-out shutdown could not release safely (kept alive for the process)."""


def store_sub_blocks(
    cpu_block_ids: Any, num_gpu_blocks: int, block_size_factor: int
) -> npt.NDArray[np.int64]:
    """The CPU sub-block ids a GPU -> CPU transfer of ``num_gpu_blocks`` blocks into
    ``cpu_block_ids`` writes, in GPU-block order (start-aligned)."""
    return expand_sub_blocks(cpu_block_ids, block_size_factor, 0, num_gpu_blocks)


def load_sub_blocks(
    cpu_block_ids: Any, num_gpu_blocks: int, block_size_factor: int
) -> npt.NDArray[np.int64]:
    """The CPU sub-block ids a CPU -> GPU transfer of ``num_gpu_blocks`` blocks from
    ``cpu_block_ids`` reads, in GPU-block order (end-aligned: ``skip = (-n) % f``)."""
    f = block_size_factor
    return expand_sub_blocks(cpu_block_ids, f, -num_gpu_blocks % f, num_gpu_blocks)
