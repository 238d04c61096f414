"""The KV caches of :class:`~blockswap.handler.CpuGpuHandlers`: the GPU tensors it is given, as
KV-cache groups, checked; the CPU cache it allocates for them (block-major or a mirror of the
GPU tensors, in pinned pieces), or the one given, checked against them; the block tables of both
sides and the byte spans the handler registers with its engine.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from . import _optional

try:
    import torch
except ModuleNotFoundError as e:
    _optional.missing(e, __name__)

from ._checks import check_choice
from ._core import BlockswapError, cuda_status, table_spans
from .errors import ConfigError, ConfigTypeError
from .hostmem import PinnedRows, size_text
from .layout import (
    LAYOUTS,
    BlockTable,
    Layout,
    LayoutError,
    check_layout,
    make_block_major_cpu_cache,
    make_cpu_cache_like,
)

#: The handler's logger: the CPU cache's allocation is part of what a handler logs.
log = logging.getLogger("blockswap.handler")


def as_groups(caches: Any, name: str) -> tuple[list[list[torch.Tensor]], bool]:
    """(groups of tensors, whether the input was given as groups)."""
    if isinstance(caches, torch.Tensor):
        return [[caches]], False
    if isinstance(caches, Mapping):
        caches = list(caches.values())
    if isinstance(caches, (str, bytes)) or not isinstance(caches, Iterable):
        raise ConfigTypeError(
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
            raise ConfigTypeError(f"{name} mixes tensors and groups (entry {g} is a tensor)")
        if isinstance(item, Mapping):
            item = list(item.values())
        if isinstance(item, (str, bytes)) or not isinstance(item, Iterable):
            raise ConfigTypeError(
                f"{name}: group {g} is a {type(item).__name__}, not a list or dict of tensors"
            )
        ts = list(item)
        if not ts:
            raise LayoutError(f"{name}: group {g} is empty")
        for i, t in enumerate(ts):
            if not isinstance(t, torch.Tensor):
                raise ConfigTypeError(
                    f"{name}: group {g} entry {i} is a {type(t).__name__}, not a tensor"
                )
        groups.append(ts)
    return groups, True


def keyed_like(cpu_caches: Any, gpu_caches: Any) -> Any:
    """``cpu_caches`` in the order of ``gpu_caches`` wherever both name their tensors (dicts, as
    vLLM keys its KV caches by layer name: at the top, or per group), so that tensors pair by
    name, not by position; names that differ are refused. Anything else as it is."""

    def align(cpu: Any, gpu: Any, where: str) -> Any:
        if not (isinstance(cpu, Mapping) and isinstance(gpu, Mapping)):
            return cpu
        if set(cpu) != set(gpu):
            missing = [k for k in gpu if k not in cpu]
            extra = [k for k in cpu if k not in gpu]
            raise LayoutError(
                f"cpu_caches{where} names other tensors than gpu_caches{where}: missing "
                f"{missing}, unknown {extra}"
            )
        return {k: cpu[k] for k in gpu}

    out = align(cpu_caches, gpu_caches, "")
    gpu, names = gpu_caches, None
    if (
        isinstance(out, Mapping)
        and isinstance(gpu, Mapping)
        and any(isinstance(g, Mapping) for g in gpu.values())
    ):
        # Groups by name (a dict of dicts), now in the GPU dict's order: each group's tensors
        # by name as below.
        names = [repr(k) for k in gpu]
        out, gpu = list(out.values()), list(gpu.values())
    if isinstance(out, Sequence) and isinstance(gpu, Sequence) and len(out) == len(gpu):
        names = names or [str(i) for i in range(len(out))]
        out = [align(c, g, f" group {n}") for c, g, n in zip(out, gpu, names)]
    return out


def _memory_order(t: torch.Tensor, skip: int) -> list[int]:
    """``t``'s dims but ``skip`` from the outermost in memory to the innermost (larger strides
    first), dims of size 1 left out: where they lie says nothing."""
    strides = t.stride()
    dims = [d for d in range(t.dim()) if d != skip and t.shape[d] > 1]
    return sorted(dims, key=lambda d: (-strides[d], d))


def _named(e: Exception, where: str) -> Exception:
    """``e`` again with ``where`` in front of its message: of its own kind where that is a
    blockswap error, else a :class:`~blockswap.errors.ConfigTypeError` (a ``TypeError`` from
    torch, say)."""
    kind = type(e) if isinstance(e, BlockswapError) else ConfigTypeError
    return kind(f"{where}: {e}")


def check_group_uniform(ts: Sequence[torch.Tensor], g: int, name: str) -> None:
    t0 = ts[0]
    for i, t in enumerate(ts[1:], 1):
        if t.shape != t0.shape or t.dtype != t0.dtype:
            raise LayoutError(
                f"{name}: group {g} tensor {i} (shape {tuple(t.shape)}, {t.dtype}) differs from "
                f"tensor 0 (shape {tuple(t0.shape)}, {t0.dtype}); the layers of one group must "
                "have one shape and dtype"
            )


def union_spans(tables: Iterable[BlockTable]) -> list[tuple[int, int]]:
    """Byte ranges covering every segment of every table, overlapping ranges merged (ranges that
    only touch are kept apart: they may be separate allocations)."""
    return table_spans([t.geometry() for t in tables])


def layouts_of(layout: Any, ng: int) -> list[Layout]:
    """One layout name per KV-cache group: ``layout`` for all of them, or one per group."""
    if isinstance(layout, str):
        layouts = [layout] * ng
    else:
        if not isinstance(layout, Iterable):
            raise ConfigTypeError(
                f"layout must be a layout name or one per KV-cache group, not {layout!r:.80}"
            )
        layouts = list(layout)
        if len(layouts) != ng:
            raise ConfigError(f"{len(layouts)} layouts given for {ng} KV-cache groups")
    return [check_layout(lay) for lay in layouts]


def device_of(
    gpu_groups: Sequence[Sequence[torch.Tensor]], backend: str
) -> tuple[torch.device, str, int | None]:
    """``(device, backend, device index)`` of the GPU tensors, all on one device: ``backend``
    ("auto", "cuda" or "host") resolved and checked against it; the index is None on the host
    backend."""
    device = gpu_groups[0][0].device
    for g, ts in enumerate(gpu_groups):
        for i, t in enumerate(ts):
            if t.device != device:
                raise ConfigError(
                    f"gpu_caches: group {g} tensor {i} is on {t.device}, but group 0 tensor 0 "
                    f"is on {device}; all KV-cache tensors must be on one device"
                )
    if device.type not in ("cuda", "cpu"):
        raise ConfigError(f"gpu_caches are on {device}: blockswap moves CUDA (or CPU) memory")
    check_choice("backend", backend, ("auto", "cuda", "host"))
    if backend == "auto":
        backend = "cuda" if device.type == "cuda" and cuda_status()[0] else "host"
    if backend == "host" and device.type != "cpu":
        raise ConfigError(
            f"the host backend copies host memory only, but gpu_caches are on {device}; use "
            "backend='cuda' (or 'auto')"
        )
    if backend == "cuda" and device.type != "cuda":
        raise ConfigError(f"backend='cuda' needs CUDA tensors, but gpu_caches are on {device}")
    device_index: int | None = None
    if backend == "cuda":
        device_index = device.index if device.index is not None else torch.cuda.current_device()
        device = torch.device("cuda", device_index)
    return device, backend, device_index


def gpu_tables_of(
    gpu_groups: Sequence[Sequence[torch.Tensor]], layouts: Sequence[Layout], *, uniform: bool
) -> list[BlockTable]:
    """The block table of each group of GPU tensors (validates the layouts); ``uniform``: the
    layers of one group must share one shape (where the CPU cache is made here)."""
    gpu_tables = []
    for g, (ts, lay) in enumerate(zip(gpu_groups, layouts)):
        if uniform:
            check_group_uniform(ts, g, "gpu_caches")
        try:
            gpu_tables.append(BlockTable.from_tensors(ts, lay))
        except (LayoutError, TypeError) as e:
            raise _named(e, f"gpu_caches group {g}") from e
    return gpu_tables


def allocate_cpu_cache(
    gpu_groups: Sequence[Sequence[torch.Tensor]],
    layouts: Sequence[Layout],
    num_cpu_blocks: int,
    factor: int,
    host_memory: list[PinnedRows],
    *,
    cpu_layout: str,
    pin_piece_bytes: int,
    on_cuda: bool,
    device_index: int | None,
) -> tuple[list[torch.Tensor] | None, list[list[torch.Tensor]]]:
    """The CPU cache of ``num_cpu_blocks`` blocks of ``factor`` sub-blocks for ``gpu_groups``,
    allocated by :class:`~blockswap.hostmem.PinnedRows` in pieces of at most
    ``pin_piece_bytes`` (each appended to ``host_memory`` as it is made): ``(the block-major
    chunk of each group, or None for cpu_layout="mirror"; the per-layer tensors of each group)``.
    """
    t0 = time.perf_counter()

    def allocate(rows: int, row_bytes: int) -> torch.Tensor:
        buf = PinnedRows(
            rows,
            row_bytes,
            piece_bytes=pin_piece_bytes,
            backend="cuda" if on_cuda else "host",
            device=device_index or 0,
            log_line=False,
        )
        host_memory.append(buf)
        return buf.tensor()

    block_major = cpu_layout == "block_major"
    make = make_block_major_cpu_cache if block_major else make_cpu_cache_like
    with torch.cuda.device(device_index) if on_cuda else contextlib.nullcontext():
        made: list[Any] = [
            make(ts, num_cpu_blocks, layout=lay, block_size_factor=factor, allocate_rows=allocate)
            for ts, lay in zip(gpu_groups, layouts)
        ]
    chunks = [c for c, _ in made] if block_major else None
    cpu_groups = [v for _, v in made] if block_major else made
    pieces = sum(len(b.pieces) for b in host_memory)
    log.info(
        "CPU cache: %s of %s host memory in %d piece%s (%d allocation%s) for %d blocks in %.3f s",
        size_text(sum(b.nbytes for b in host_memory)),
        "pinned" if on_cuda else "unpinned (host backend)",
        pieces,
        "" if pieces == 1 else "s",
        len(host_memory),
        "" if len(host_memory) == 1 else "s",
        num_cpu_blocks,
        time.perf_counter() - t0,
    )
    return chunks, cpu_groups


def given_cpu_cache(
    cpu_caches: Any,
    gpu_groups: Sequence[Sequence[torch.Tensor]],
    grouped: bool,
    layouts: Sequence[Layout],
    num_cpu_blocks: int,
    factor: int,
    check_pinned: bool,
) -> list[list[torch.Tensor]]:
    """The caller's CPU cache as groups of tensors, checked against the GPU tensors: the same
    structure (``grouped``: whether ``gpu_caches`` was given as groups), dtypes and shapes but
    the block dim, on the CPU, and pinned where ``check_pinned`` (on CUDA, where the engine
    registers the tensors' spans; torch asks about a tensor's storage, so where the caller gives
    the pieces it locked, the engine checks each as it registers it instead: a rank's cells of
    a shared region lie in a storage whose start another rank locks)."""
    ng = len(gpu_groups)
    cpu_groups, cpu_grouped = as_groups(cpu_caches, "cpu_caches")
    if len(cpu_groups) != ng or cpu_grouped != grouped:
        raise LayoutError(
            f"cpu_caches has {len(cpu_groups)} group(s), gpu_caches {ng}: give them in "
            "the same structure"
        )
    for g, (cts, gts, lay) in enumerate(zip(cpu_groups, gpu_groups, layouts)):
        _check_cpu_group(g, cts, gts, lay, check_pinned, num_cpu_blocks, factor)
    return cpu_groups


def _check_cpu_group(
    g: int,
    cts: Sequence[torch.Tensor],
    gts: Sequence[torch.Tensor],
    lay: str,
    check_pinned: bool,
    num_cpu_blocks: int,
    factor: int,
) -> None:
    if len(cts) != len(gts):
        raise LayoutError(
            f"cpu_caches group {g} has {len(cts)} tensors, gpu_caches group {g} {len(gts)}"
        )
    bd = LAYOUTS[lay]
    want_blocks = num_cpu_blocks * factor
    for i, (c, t) in enumerate(zip(cts, gts)):
        if c.device.type != "cpu":
            raise ConfigError(f"cpu_caches group {g} tensor {i} is on {c.device}, not the CPU")
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
                f"{tuple(t.shape)} with num_cpu_blocks={num_cpu_blocks} x "
                f"block_size_factor={factor} needs {tuple(want)}"
            )
        cpu_order, gpu_order = _memory_order(c, bd % c.dim()), _memory_order(t, bd % t.dim())
        if cpu_order != gpu_order:
            # A page's bytes are copied as they lie: the CPU tensor's values would come out
            # permuted (a round trip would still restore the GPU's).
            raise LayoutError(
                f"cpu_caches group {g} tensor {i} lays its dims out in memory in another order "
                f"than the GPU tensor (outermost first, the block dim left out: {cpu_order} "
                f"against {gpu_order}): a page's bytes are copied as they lie, so its values "
                "would read permuted; give a CPU tensor laid out as the GPU one"
            )
        if check_pinned and not c.is_pinned():
            raise ConfigError(
                f"cpu_caches group {g} tensor {i} is not pinned: the CUDA backend needs "
                "page-locked memory (pin_memory=True)"
            )


def cpu_tables_of(
    cpu_groups: Sequence[Sequence[torch.Tensor]], layouts: Sequence[Layout]
) -> list[BlockTable]:
    """The block table of each group of the CPU cache. Its pages are those of the GPU table of
    its group, over ``num_cpu_blocks * block_size_factor`` sub-blocks: the cache was made here
    from the GPU tensors, or :func:`given_cpu_cache` checked each tensor's dtype and shape
    against them (and the core checks every transfer's pair of tables again)."""
    cpu_tables = []
    for g, (ts, lay) in enumerate(zip(cpu_groups, layouts)):
        try:
            cpu_tables.append(BlockTable.from_tensors(ts, lay))
        except (LayoutError, TypeError) as e:
            raise _named(e, f"cpu_caches group {g}") from e
    return cpu_tables
