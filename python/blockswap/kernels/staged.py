"""The staged plan's copy kernel: the pages of a step's blocks between a device staging slot and
the GPU's layer tensors, each page's two addresses computed from its block's entry and its
group's geometry, as the Rust core lays them out (``rust/table/staged.rs``): a word per block and
one geometry per group, not a descriptor per page.

* ``_copy_staged_kernel`` -- the kernel, launched by the core (``cuLaunchKernel``) once per step
  and group; the copy itself is the batched copy kernel's (``blockswap.kernels.copy``).
* ``copy_staged_raw`` -- a launcher from Python, on the current stream or under Triton's
  interpreter: for tests against a reference.
"""

from __future__ import annotations

from blockswap import _optional
from blockswap._checks import check_int
from blockswap._core import launch_plan
from blockswap.kernels.copy import (
    DEFAULT_BLOCK_BYTES,
    DEFAULT_MAX_CTAS,
    DEFAULT_NUM_WARPS,
    _cdiv,
    _check_launch_params,
    _copy_items,
)

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ModuleNotFoundError as e:
    _optional.missing(e, "blockswap.kernels")

__all__ = ["copy_staged_raw"]


@triton.jit
def _load_pages(ids, rings, bases, strides, offsets, items, n_items, n_segs, ring_base, ring_src):
    """Pages of work items ``items`` [ROWS] of a staged step: (src, dst, size, part), zeros past
    the end. Item i is page ``i % n_segs`` of block ``i // n_segs``: on the GPU at ``bases[s] +
    ids[b] * strides[s]``, in the ring at ``ring_base + rings[b] + offsets[s]``, ``offsets[s + 1]
    - offsets[s]`` bytes (none where ``bases[s]`` is 0: a hole in the row); the ring is the
    source where ``ring_src`` (CPU -> GPU)."""
    valid = items < n_items
    blk = items // n_segs
    seg = items - blk * n_segs
    base = tl.load(bases + seg, mask=valid, other=0)
    gpu = base + tl.load(ids + blk, mask=valid, other=0) * tl.load(
        strides + seg, mask=valid, other=0
    )
    lo = tl.load(offsets + seg, mask=valid, other=0)
    hi = tl.load(offsets + seg + 1, mask=valid, other=0)
    ring = ring_base + tl.load(rings + blk, mask=valid, other=0) + lo
    src = tl.where(valid, tl.where(ring_src != 0, ring, gpu), 0)
    dst = tl.where(valid, tl.where(ring_src != 0, gpu, ring), 0)
    return src, dst, tl.where(base != 0, hi - lo, 0), tl.zeros_like(items)


@triton.jit(
    do_not_specialize=[
        "ids_addr", "rings_addr", "bases_addr", "strides_addr", "offsets_addr", "n_blocks",
        "n_segs", "ring_base", "ring_src",
    ]
)  # fmt: skip
def _copy_staged_kernel(
    ids_addr,
    rings_addr,
    bases_addr,
    strides_addr,
    offsets_addr,
    n_blocks,
    n_segs,
    ring_base,
    ring_src,
    ALIGNED16: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    CHAINED: tl.constexpr = False,
):
    """The staged plan's HBM side: move every page of ``n_blocks`` blocks between a staging slot
    and the GPU pages, each page's addresses computed from its block's entry and the group's
    geometry (``blockswap``'s core writes them: a word per block, not a descriptor per page).

    ids_addr, rings_addr: int64 arrays [n_blocks]: each block's GPU block id, and the offset of
        its row in the ring (``ring_base`` added).
    bases_addr, strides_addr: int64 arrays [n_segs]: page s of GPU block b is at
        ``bases[s] + b * strides[s]``; a base of 0 is a hole (row bytes no page owns).
    offsets_addr: int64 array [n_segs + 1]: page s lies at ``offsets[s]`` in a block's row and is
        ``offsets[s + 1] - offsets[s]`` bytes.
    ring_src: 1 where the ring is the source (CPU -> GPU), 0 where the GPU pages are.
    ALIGNED16, ROWS, BLOCK_BYTES: as ``_copy_blocks_kernel``; a page is never sliced.
    CHAINED: built for programmatic dependent launch (compute capability 9.0 on): each program
        lets the next launch on the stream start once it is on its last group of rows, and the
        kernel ends only after the launch before it (the core launches a direct transfer's
        launches after its first so; launched plainly, both are no-ops).
    grid: (G,) with G <= cdiv(n_blocks * n_segs, ROWS).
    """
    ids = ids_addr.to(tl.int64).to(tl.pointer_type(tl.int64))
    rings = rings_addr.to(tl.int64).to(tl.pointer_type(tl.int64))
    bases = bases_addr.to(tl.int64).to(tl.pointer_type(tl.int64))
    strides = strides_addr.to(tl.int64).to(tl.pointer_type(tl.int64))
    offsets = offsets_addr.to(tl.int64).to(tl.pointer_type(tl.int64))
    segs = n_segs.to(tl.int64)
    n_items = n_blocks.to(tl.int64) * segs
    n_groups = tl.cdiv(n_items, ROWS)
    nprog = tl.num_programs(0)
    rows = tl.arange(0, ROWS)
    group = tl.program_id(0).to(tl.int64)
    src, dst, size, part = _load_pages(
        ids, rings, bases, strides, offsets, group * ROWS + rows, n_items, segs, ring_base, ring_src
    )
    while group < n_groups:
        nxt = group + nprog
        if CHAINED:  # noqa: SIM102 -- a constexpr test, compiled out unless CHAINED
            if nxt >= n_groups:
                gdc_launch_dependents()
        nsrc, ndst, nsize, npart = _load_pages(
            ids, rings, bases, strides, offsets, nxt * ROWS + rows, n_items, segs, ring_base,
            ring_src,
        )  # fmt: skip
        _copy_items(src, dst, size, part, 1, rows, ALIGNED16, ROWS, BLOCK_BYTES)
        src = nsrc
        dst = ndst
        size = nsize
        part = npart
        group = nxt
    if CHAINED:
        gdc_wait()


def copy_staged_raw(
    ids_addr: int,
    rings_addr: int,
    bases_addr: int,
    strides_addr: int,
    offsets_addr: int,
    n_blocks: int,
    n_segs: int,
    ring_base: int,
    ring_src: bool,
    *,
    max_size: int,
    max_ctas: int = DEFAULT_MAX_CTAS,
    num_warps: int = DEFAULT_NUM_WARPS,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> None:
    """Launches the staged plan's kernel (what the core launches per step, see
    :func:`blockswap.kernels.core_kernel`) from Python on the current stream, or under Triton's interpreter: for
    tests of the kernel against a reference. Arguments as ``_copy_staged_kernel`` documents;
    ``max_size``: the largest page."""
    _check_launch_params(max_ctas, num_warps, block_bytes)
    check_int("max_size", max_size, 1, numpy=False)
    check_int("n_blocks", n_blocks, 0, numpy=False)
    check_int("n_segs", n_segs, 1, numpy=False)
    if n_blocks == 0:
        return
    # As the core launches it: a page per work item, never sliced.
    _, _, rows, row_bytes = launch_plan(1 << 20, max_ctas, block_bytes, max_size)
    grid = max(1, min(max_ctas, _cdiv(n_blocks * n_segs, rows)))
    _copy_staged_kernel[(grid,)](
        ids_addr, rings_addr, bases_addr, strides_addr, offsets_addr, n_blocks, n_segs,
        ring_base, int(bool(ring_src)),
        ALIGNED16=False, ROWS=rows, BLOCK_BYTES=row_bytes, num_warps=num_warps,
    )  # fmt: skip
