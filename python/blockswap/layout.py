"""Per-block address tables for KV-cache tensors, and the CPU caches that mirror them.

Model
-----
Every supported KV-cache layout reduces to a list of *segments per block*: for block ``b``,
segment ``s`` is ``nbytes[s]`` contiguous bytes starting at ``bases[s] + b * strides[s]``.
A :class:`BlockTable` holds those three int64 arrays for one block-id space (one KV-cache group
on one side, GPU or CPU). It is built once, when a handler is built, from the torch tensors,
and handed to the engine (:meth:`blockswap.Engine.register_table`), which turns block ids into
copies per transfer.

Segments of one table are ordered tensor by tensor (in the order the tensors were given) and,
inside a tensor, by the row-major index of the dims before the block dim (for ``kv_split``:
K then V). The engine writes descriptors segment-major, block-minor, so runs of consecutive
block ids in both lists give byte-adjacent descriptors wherever the layout stores consecutive
blocks back to back, which it coalesces.

CPU side and ``block_size_factor``
----------------------------------
The offload (CPU) cache is allocated by :func:`make_cpu_cache_like` in the same layout as the
GPU cache, with ``num_cpu_blocks * block_size_factor`` GPU-sized *sub-blocks* in its block dim:
CPU block ``c`` is sub-blocks ``c * factor .. c * factor + factor - 1``. A CPU table built with
:meth:`BlockTable.from_tensors` counts sub-blocks; the engine maps CPU block ids to them
(:func:`expand_sub_blocks` shows the rule: expand, drop the first ``skip`` sub-blocks, take
``count``). :func:`make_block_major_cpu_cache` lays each sub-block's pages out contiguously.

Pinned caches are allocated by :class:`blockswap.hostmem.PinnedRows` unless the caller passes its
own ``allocate_rows``: exactly the bytes asked for (torch's pinned allocator rounds up to a power
of two), page-locked in pieces of whole pages (one driver registration of 512 GiB or more fails).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Union, cast, overload

import numpy as np
import numpy.typing as npt

from . import _optional

try:
    import torch
except ModuleNotFoundError as e:
    _optional.missing(e, __name__)

from ._checks import check_bool, check_int
from ._core import (
    InvalidTransferError,
    block_major_views,
    chunk_blocks,
    cuda_status,
    mirror_geometry,
    shown,
    table_incompatibility,
    table_spans,
    tensor_segments,
)
from .errors import ConfigError, ConfigTypeError, refuses_with_config_errors

__all__ = [
    "LAYOUTS",
    "BlockIds",
    "BlockTable",
    "Layout",
    "LayoutError",
    "RowsAllocator",
    "as_block_ids",
    "expand_sub_blocks",
    "make_block_major_cpu_cache",
    "make_cpu_cache_like",
]

Layout = Literal["kv_split", "kv_fused", "cross_layer", "mla"]
"""Named layouts and the block dim each implies:

* ``"kv_split"``: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` per layer
  (FlashAttention); block dim 1, two segments (K page, V page) per block per layer.
* ``"kv_fused"``: ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` per layer
  (FlashInfer); block dim 0, one segment per block per layer.
* ``"cross_layer"``: one tensor ``[num_blocks, num_layers, ...]`` whose block holds every layer;
  block dim 0, one segment per block.
* ``"mla"``: ``[num_blocks, block_size, kv_lora_rank + rope_dim]`` per layer; block dim 0,
  one segment per block per layer.
"""

LAYOUTS: dict[str, int] = {"kv_split": 1, "kv_fused": 0, "cross_layer": 0, "mla": 0}
"""Block dim of each named layout."""

BlockIds = Union[npt.NDArray[np.integer], Sequence[int], torch.Tensor]
"""Block ids: a 1-D integer numpy array (any int/uint dtype), a sequence of ints, or a 1-D
integer CPU torch tensor."""

_I64 = np.int64
_I32 = np.int32
_I64_MAX = np.iinfo(np.int64).max

#: The CPU-cache makers refuse a bad count with a ConfigError (a ValueError), whatever its type.
_VALUE_ERRORS = (ConfigError, ConfigError)


class LayoutError(ConfigError):
    """A tensor does not fit the layout, or two tables cannot be copied between (a
    :class:`~blockswap.errors.ConfigError`: a :class:`~blockswap.BlockswapError` and a
    ``ValueError``)."""


# --------------------------------------------------------------------------------------------
# Table building (once per handler)
# --------------------------------------------------------------------------------------------


def check_layout(layout: Any) -> Layout:
    """``layout`` if it names a layout of :data:`LAYOUTS`, else the typed error saying so."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        kind = ConfigError if isinstance(layout, str) else ConfigTypeError
        raise kind(f"unknown layout {layout!r:.80}; expected one of {sorted(LAYOUTS)}")
    return cast("Layout", layout)


def _resolve_block_dim(layout: str | None, block_dim: int | None) -> int:
    if layout is None and block_dim is None:
        raise ConfigError(f"give a layout (one of {sorted(LAYOUTS)}) or an explicit block_dim")
    if layout is not None:
        check_layout(layout)
        if block_dim is not None and (
            isinstance(block_dim, bool) or not isinstance(block_dim, (int, np.integer))
        ):
            check_int("block_dim", block_dim)
        if block_dim is not None and block_dim != LAYOUTS[layout]:
            raise ConfigError(
                f"layout {layout!r} has block dim {LAYOUTS[layout]}, but block_dim={block_dim} "
                "was given; give one or the other"
            )
        return LAYOUTS[layout]
    assert block_dim is not None
    # A dim index (negative from the last): bounded, as no tensor has more dims than torch's 64.
    return check_int("block_dim", block_dim, -64, 63)


def _as_tensor_list(tensors: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    out = list(tensors)
    if not out:
        raise LayoutError("no tensors given")
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor):
            raise ConfigTypeError(f"tensor {i} is a {type(t).__name__}, not a torch.Tensor")
    return out


def _describe(index: int, t: torch.Tensor) -> str:
    return (
        f"tensor {index} (shape {tuple(t.shape)}, stride {tuple(t.stride())}, dtype {t.dtype}, "
        f"device {t.device})"
    )


def _segments(
    index: int, t: torch.Tensor, layout: str | None, block_dim: int
) -> tuple[list[int], int, int, int, int]:
    """One tensor's segments, the core's rule (:func:`blockswap._core.tensor_segments`): block
    0's page of each (byte offsets from the data pointer), the block stride and page bytes, the
    number of blocks and the block dim; else :class:`LayoutError` naming the tensor and why (a
    shape that is not ``layout``'s, a page not dense in memory, pages sharing bytes)."""
    got = tensor_segments(layout, list(t.shape), list(t.stride()), t.element_size(), block_dim)
    if isinstance(got, str):
        raise LayoutError(f"{_describe(index, t)}: {got}")
    return got


_TABLE_ARRAYS = ("bases", "strides", "nbytes")


def _table_array(name: str, value: Any) -> npt.NDArray[np.int64]:
    """``value``, a :class:`BlockTable`'s ``bases``, ``strides`` or ``nbytes``, as a read-only
    int64 copy, by the rule of :func:`as_block_ids` (integers only, each within int64, 1-D: a
    float address is refused, not truncated). Else a
    :class:`~blockswap.errors.ConfigTypeError` (not integers) or :class:`LayoutError` naming
    ``name``."""
    try:
        a = np.array(as_block_ids(value, name), copy=True)
    except (TypeError, ValueError, IndexError, OverflowError, RuntimeError) as e:
        # numpy's own (a ragged list) and those of an object's __array__ do not name the field.
        why = str(e) if str(e).startswith(name) else f"{name}: {e}"
        raise (ConfigTypeError if isinstance(e, TypeError) else LayoutError)(why) from e
    a.setflags(write=False)
    return a


def _table_device(device: Any) -> torch.device:
    """``device`` of a :class:`BlockTable` as a ``torch.device``, else the typed error naming it
    (torch's own is an untyped ``RuntimeError`` for a device string it does not know)."""
    try:
        return torch.device(device)
    except TypeError as e:
        raise ConfigTypeError(
            f"device must be a torch.device, a str or an int, not {shown(device)}"
        ) from e
    except (ValueError, OverflowError, RuntimeError) as e:
        raise LayoutError(f"device {shown(device)} is not one torch knows: {e}") from e


@dataclass(frozen=True, eq=False, repr=False)
class BlockTable:
    """Segment table for one block-id space (one KV-cache group on one device).

    For block ``b`` (``0 <= b < num_blocks``), segment ``s`` is ``nbytes[s]`` contiguous bytes
    at address ``bases[s] + b * strides[s]``. Arrays are read-only int64 of equal length.
    ``owners`` keeps the tensors the addresses point into alive.
    """

    bases: npt.NDArray[np.int64]
    strides: npt.NDArray[np.int64]
    nbytes: npt.NDArray[np.int64]
    num_blocks: int
    device: torch.device
    owners: tuple[torch.Tensor, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        arrays = {name: _table_array(name, getattr(self, name)) for name in _TABLE_ARRAYS}
        n = arrays["bases"].shape[0]
        if n == 0 or arrays["strides"].shape[0] != n or arrays["nbytes"].shape[0] != n:
            raise LayoutError(
                "bases, strides and nbytes must be non-empty and of equal length, got "
                f"{[a.shape[0] for a in arrays.values()]}"
            )
        if (arrays["nbytes"] <= 0).any():
            raise LayoutError("every segment must have nbytes > 0")
        if (arrays["strides"] < 0).any() or (arrays["bases"] < 0).any():
            raise LayoutError("bases and strides must be non-negative")
        num_blocks = check_int(
            "num_blocks", self.num_blocks, 0, errors=(ConfigTypeError, LayoutError)
        )
        device = _table_device(self.device)
        if isinstance(self.owners, (str, bytes)) or not isinstance(self.owners, Iterable):
            raise ConfigTypeError(f"owners must be a sequence of tensors, not {shown(self.owners)}")
        for name, a in arrays.items():
            object.__setattr__(self, name, a)
        object.__setattr__(self, "num_blocks", num_blocks)
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "owners", tuple(self.owners))

    @classmethod
    @refuses_with_config_errors
    def from_tensors(
        cls,
        tensors: torch.Tensor | Sequence[torch.Tensor],
        layout: Layout | None = None,
        *,
        block_dim: int | None = None,
    ) -> BlockTable:
        """Build the table of one KV-cache group from its tensors (one per layer, or one).

        Give either a named ``layout`` (see :data:`Layout`) or an explicit ``block_dim``. The
        general rule: the dims before the block dim enumerate separate segments (row-major), and
        the dims after it form the page, which must be dense in memory (in any dim order; a
        block stride larger than the page, i.e. padding, is fine: only the page is copied).
        All tensors must be on one device and have the same number of blocks; dtypes may
        differ (everything is bytes).

        Raises :class:`LayoutError` naming the offending tensor index and shape.
        """
        bd0 = _resolve_block_dim(layout, block_dim)
        ts = _as_tensor_list(tensors)
        device = ts[0].device
        bases: list[int] = []
        strides: list[int] = []
        nbytes: list[int] = []
        num_blocks = None
        for i, t in enumerate(ts):
            if t.device != device:
                raise LayoutError(f"{_describe(i, t)}: not on {device} like tensor 0")
            if t.device.type == "meta":
                raise LayoutError(f"{_describe(i, t)}: meta tensors have no memory")
            offsets, bstride, nb, nblk, _ = _segments(i, t, layout, bd0)
            if nblk == 0:
                raise LayoutError(f"{_describe(i, t)}: holds no block (its block dim is empty)")
            if num_blocks is None:
                num_blocks = nblk
            elif nblk != num_blocks:
                raise LayoutError(
                    f"{_describe(i, t)}: has {nblk} blocks but tensor 0 has {num_blocks}"
                )
            ptr = t.data_ptr()
            bases.extend(ptr + o for o in offsets)
            strides.extend([bstride] * len(offsets))
            nbytes.extend([nb] * len(offsets))
        assert num_blocks is not None
        return cls(
            bases=np.asarray(bases, dtype=_I64),
            strides=np.asarray(strides, dtype=_I64),
            nbytes=np.asarray(nbytes, dtype=_I64),
            num_blocks=num_blocks,
            device=device,
            owners=tuple(ts),
        )

    def __repr__(self) -> str:
        return (
            f"BlockTable(num_segments={self.num_segments}, num_blocks={self.num_blocks}, "
            f"page_bytes={self.page_bytes}, device={self.device})"
        )

    @property
    def num_segments(self) -> int:
        return int(self.bases.shape[0])

    @property
    def page_bytes(self) -> int:
        """Bytes one block holds over all segments (what one block's transfer moves)."""
        return int(self.nbytes.sum())

    def geometry(self) -> tuple[Any, Any, Any, int]:
        """``(bases, strides, nbytes, num_blocks)``, as the core takes a table."""
        return self.bases, self.strides, self.nbytes, self.num_blocks

    def spans(self) -> npt.NDArray[np.int64]:
        """Byte ranges the segments of all blocks fall in, as an int64 ``[R, 2]`` array of
        ``(start, nbytes)`` rows, sorted, overlapping ranges merged (ranges that only touch are
        kept apart). Padding between pages lies inside a range. For registering memory: the
        core's rule (:func:`blockswap._core.table_spans`)."""
        rows = table_spans([self.geometry()])
        return np.array(rows, dtype=_I64).reshape(-1, 2)

    def is_compatible(self, other: BlockTable) -> bool:
        """Whether blocks can be copied between the two tables (same segment count and sizes):
        the core's rule (:func:`blockswap._core.table_incompatibility`)."""
        return table_incompatibility(self.nbytes, other.nbytes) is None

    def check_compatible(self, other: BlockTable) -> None:
        """Raise :class:`LayoutError` unless :meth:`is_compatible`, with the core's reason (this
        table the source, ``other`` the destination)."""
        why = table_incompatibility(self.nbytes, other.nbytes)
        if why is not None:
            raise LayoutError(why)


# --------------------------------------------------------------------------------------------
# Per-transfer work (vectorised)
# --------------------------------------------------------------------------------------------


#: Block ids as the core's ``submit_groups`` takes them.
SubmitIds = Union[npt.NDArray[np.int64], npt.NDArray[np.int32]]


@overload
def as_block_ids(x: Any, name: str, *, int32: Literal[False] = False) -> npt.NDArray[np.int64]: ...
@overload
def as_block_ids(x: Any, name: str, *, int32: Literal[True]) -> SubmitIds: ...
def as_block_ids(x: Any, name: str, *, int32: bool = False) -> SubmitIds:
    """One side's block ids as a 1-D C-contiguous int64 array (no copy where it already is one),
    for the engine, which checks their range. Accepts integer numpy arrays, sequences of ints,
    integer CPU tensors and objects with ``block_ids`` (vLLM's ``BlockIDsLoadStoreSpec``).
    Raises ``TypeError`` for non-integers, ``ValueError`` for other than 1-D, ``IndexError`` for
    unsigned ids beyond int64. ``int32``: an int32 array is returned as it is (the core's
    ``submit_groups`` takes those too: vLLM's specs hold int32 ids)."""
    if type(x) is np.ndarray:
        a = x
    else:
        x = getattr(x, "block_ids", x)
        if isinstance(x, torch.Tensor):
            if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
                raise TypeError(f"{name} must hold integers, not {x.dtype}")
            try:
                a = x.detach().cpu().numpy()
            except (RuntimeError, TypeError) as e:  # meta, sparse, nested tensors
                raise TypeError(f"{name}: cannot read ids from this tensor ({e})") from None
        else:
            a = np.asarray(x)
            if a.size == 0 and a.dtype.kind not in "iu":
                a = a.astype(_I64)
    if a.dtype != _I64 and not (int32 and a.dtype == _I32):
        kind = a.dtype.kind
        if kind == "O" and a.size and all(type(v) is int for v in a.flat):
            # Python ints (numpy keeps them as objects where one does not fit in 64 bits): an
            # id out of range, not a type; ints that all fit are ids like any others.
            if not all(-(2**63) <= v <= _I64_MAX for v in a.flat):
                raise IndexError(f"{name} holds integers outside [-2**63, 2**63)")
            kind = "i"
        if kind != "i" and kind != "u":
            raise TypeError(f"{name} must hold integers, not {a.dtype}")
        if kind == "u" and a.size and int(a.max()) > _I64_MAX:
            raise IndexError(f"{name} holds values past 2**63 - 1")
        a = a.astype(_I64)
    if a.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, not of shape {a.shape}")
    if not a.flags.c_contiguous:  # a strided view: the core reads ids in place
        a = np.ascontiguousarray(a)
    return cast("SubmitIds", a)


def expand_sub_blocks(
    block_ids: BlockIds,
    factor: int,
    skip: int = 0,
    count: int | None = None,
) -> npt.NDArray[np.int64]:
    """Sub-block ids of CPU blocks holding ``factor`` GPU-sized sub-blocks each: the engine's
    rule for a transfer that names CPU blocks (:func:`blockswap._core.chunk_blocks`).

    The ``count`` sub-blocks (default: all after ``skip``) that follow the first ``skip``
    (``0 <= skip < factor``) of the given blocks expanded in order, ``c -> c * factor +
    arange(factor)``. Every given block must be used: ``len(block_ids)`` must be
    ``ceil((skip + count) / factor)``. For example ``expand_sub_blocks([0, 1, 3], 4, skip=1,
    count=9)`` is ``[1, 2, 3, 4, 5, 6, 7, 12, 13]``.

    vLLM's semantics: a store of ``n`` GPU blocks writes sub-blocks starting ``skip`` into the
    first CPU block (``count=n``); its loads align the run to the end of the last CPU block
    (``skip = (-n) % factor``), or, given the first block's position in the request (vLLM 0.33's
    ``block_indices``), both start ``block_index % factor`` into the first CPU block.
    """
    factor = check_int("factor", factor, 1)
    skip = check_int("skip", skip, 0, factor - 1)
    count = check_int("count", count, 0, optional=True)
    ids = as_block_ids(block_ids, "block_ids")
    if count is None:
        count = max(ids.shape[0] * factor - skip, 0)
    try:
        return chunk_blocks(ids, factor, count, skip)
    except InvalidTransferError as e:
        raise (IndexError if "out of range" in str(e) or "negative" in str(e) else ValueError)(
            str(e)
        ) from None


# --------------------------------------------------------------------------------------------
# CPU cache allocation
# --------------------------------------------------------------------------------------------

RowsAllocator = Callable[[int, int], "torch.Tensor"]
"""Allocates a CPU cache's memory: ``allocate(rows, row_bytes)`` returns a contiguous ``(rows,
row_bytes)`` int8 CPU tensor. A row holds whole pages, and pages never cross rows: memory
registered in pieces of whole rows moves as memory registered whole
(:class:`blockswap.hostmem.PinnedRows`)."""


def _cpu_rows(
    rows: int, row_bytes: int, pin_memory: bool, allocate: RowsAllocator | None
) -> torch.Tensor:
    """The memory of a CPU cache: ``allocate``'s, else pinned rows of
    :class:`~blockswap.hostmem.PinnedRows` (``pin_memory``) or plain torch memory."""
    check_bool("pin_memory", pin_memory)
    if allocate is not None and not callable(allocate):
        raise ConfigTypeError(f"allocate_rows must be a callable or None, not {allocate!r:.80}")
    if pin_memory and allocate is None and not cuda_status()[0]:
        raise ConfigError(f"pin_memory=True needs CUDA: {cuda_status()[1]}")
    if allocate is not None and rows * row_bytes > 0:
        t = allocate(rows, row_bytes)
        ok = (
            isinstance(t, torch.Tensor)
            and t.dtype == torch.int8
            and tuple(t.shape) == (rows, row_bytes)
            and t.device.type == "cpu"
            and t.is_contiguous()
        )
        if not ok:
            raise ConfigTypeError(
                f"allocate_rows({rows}, {row_bytes}) must return a contiguous int8 CPU tensor of "
                f"shape ({rows}, {row_bytes}), not {t!r:.80}"
            )
        return t
    if pin_memory and rows * row_bytes > 0:
        from .hostmem import PinnedRows

        return PinnedRows(
            rows, row_bytes, backend="cuda", device=torch.cuda.current_device()
        ).tensor()
    return torch.empty((rows, row_bytes), dtype=torch.int8, pin_memory=pin_memory)


@refuses_with_config_errors
def make_block_major_cpu_cache(
    gpu_tensors: torch.Tensor | Sequence[torch.Tensor],
    num_cpu_blocks: int,
    *,
    layout: Layout | None = None,
    block_dim: int | None = None,
    block_size_factor: int = 1,
    pin_memory: bool = False,
    allocate_rows: RowsAllocator | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Allocate a block-major CPU cache for one KV-cache group: ``(chunks, views)``.

    ``chunks`` is one dense tensor of shape ``(num_cpu_blocks * block_size_factor, S, P)``
    (the GPU tensors' dtype; ``S`` pages of ``P`` elements per GPU-sized sub-block): every page
    of a sub-block -- each layer's, each segment's, in the order of the GPU block table -- lies in
    one contiguous chunk, and so does every CPU block of ``block_size_factor`` sub-blocks. A block
    crosses PCIe as one large range on the host side, and against GPU pages at one pitch as one
    2-D copy (see :meth:`blockswap.Engine.block_runs`).

    ``views`` are tensors shaped like the GPU tensors (block dim ``num_cpu_blocks *
    block_size_factor``), strided views into ``chunks``: they read and write the same bytes as
    per-layer tensors would, for tests, debugging and code written against per-layer caches.
    Uninitialised (zeroed where the memory is new); pinned only when ``pin_memory`` (which needs
    CUDA), by :class:`~blockswap.hostmem.PinnedRows`: exactly the size asked for, registered in
    pieces of whole sub-blocks. ``allocate_rows`` (see :data:`RowsAllocator`) allocates the
    ``num_cpu_blocks * block_size_factor`` rows of one sub-block each instead.
    """
    # The same checks, shapes and dim orders as the mirrored cache; only the strides differ.
    meta = _cpu_like_meta(gpu_tensors, num_cpu_blocks, layout, block_dim, block_size_factor)
    bd0 = _resolve_block_dim(layout, block_dim)
    ts = _as_tensor_list(gpu_tensors)
    # The core's rule: each view's strides and offset in (sub-blocks, segments, page elements).
    got = block_major_views([(list(m.shape), list(m.stride()), bd0 % m.dim()) for m in meta])
    odd = [i for i, t in enumerate(ts) if t.dtype != ts[0].dtype]
    if isinstance(got, int) or odd:
        bad = min([got, *odd] if isinstance(got, int) else odd)
        raise LayoutError(
            f"{_describe(bad, ts[bad])}: a block-major cache needs one page size and dtype per group"
        )
    segments, page_elems, placed = got
    blocks = num_cpu_blocks * block_size_factor
    row_bytes = segments * page_elems * ts[0].element_size()
    rows = _cpu_rows(blocks, row_bytes, pin_memory, allocate_rows)
    chunks = rows.view(ts[0].dtype).view(blocks, segments, page_elems)
    views = [chunks.as_strided(m.shape, st, off) for m, (st, off) in zip(meta, placed)]
    return chunks, views


def _cpu_like_meta(
    gpu_tensors: torch.Tensor | Sequence[torch.Tensor],
    num_cpu_blocks: int,
    layout: Layout | None,
    block_dim: int | None,
    block_size_factor: int,
) -> list[torch.Tensor]:
    """The tensors :func:`make_cpu_cache_like` would allocate, on the meta device."""
    return make_cpu_cache_like(
        gpu_tensors,
        num_cpu_blocks,
        layout=layout,
        block_dim=block_dim,
        block_size_factor=block_size_factor,
        _device="meta",
    )


@refuses_with_config_errors
def make_cpu_cache_like(
    gpu_tensors: torch.Tensor | Sequence[torch.Tensor],
    num_cpu_blocks: int,
    *,
    layout: Layout | None = None,
    block_dim: int | None = None,
    block_size_factor: int = 1,
    pin_memory: bool = False,
    allocate_rows: RowsAllocator | None = None,
    _device: str = "cpu",
) -> list[torch.Tensor]:
    """Allocate CPU tensors matching ``gpu_tensors`` (one KV-cache group), uninitialised.

    Each CPU tensor has the GPU tensor's shape, dtype and dim order in memory (the same
    permutation of dims, so page bytes match one to one), except that its block dim holds
    ``num_cpu_blocks * block_size_factor`` GPU-sized sub-blocks and it has no padding (dense).
    Pinned only when ``pin_memory`` (which needs CUDA), by
    :class:`~blockswap.hostmem.PinnedRows` (exactly the size asked for, in pieces of whole pages);
    ``allocate_rows`` (see :data:`RowsAllocator`) allocates each tensor's rows of one page instead.
    The GPU tensors are validated as by :meth:`BlockTable.from_tensors`, so a table built over the
    result is compatible.
    """
    block_size_factor = check_int("block_size_factor", block_size_factor, 1, errors=_VALUE_ERRORS)
    num_cpu_blocks = check_int("num_cpu_blocks", num_cpu_blocks, 0, errors=_VALUE_ERRORS)
    bd0 = _resolve_block_dim(layout, block_dim)
    ts = _as_tensor_list(gpu_tensors)
    out = []
    for i, t in enumerate(ts):
        # The core's rule: the GPU tensor's dim order, dense, and rows of whole pages.
        bd = _segments(i, t, layout, bd0)[4]
        blocks = num_cpu_blocks * block_size_factor
        shape, strides, row = mirror_geometry(list(t.shape), list(t.stride()), bd, blocks)
        # Checked before any tensor is made, on the meta device too (torch's own overflow
        # check is an untyped RuntimeError).
        elements = math.prod(shape)
        if elements * t.element_size() >= 1 << 63:
            raise ConfigError(
                f"a CPU copy of {_describe(i, t)} with {blocks} blocks takes "
                f"{elements * t.element_size()} bytes, more than the address space: lower "
                "num_cpu_blocks"
            )
        if _device != "cpu":
            out.append(torch.empty_strided(shape, strides, dtype=t.dtype, device=_device))
            continue
        rows = _cpu_rows(elements // row, row * t.element_size(), pin_memory, allocate_rows)
        out.append(rows.view(t.dtype).view(-1).as_strided(shape, strides))
    return out
