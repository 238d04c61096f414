"""A rank registers (and on CUDA page-locks) only its own cells of vLLM's shared offload region,
a cell a row, where vLLM's worker does (``pin_mmap_region(worker_slot_only=True)`` in vLLM 0.33's
``gpu_worker.py``: several ranks' cells in a row, at least 3 MiB a row spared); whole rows
otherwise. The bytes it moves are vLLM's either way, and no byte of another rank's cell is
registered, locked or written."""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed")
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)

from blockswap import Engine, InvalidTransferError
from blockswap import _vllm_region as vr
from blockswap.vllm import BlockswapOffloadingWorker
from test_vllm_region import (
    DEVICES,
    CPULoadStoreSpec,
    backend_of,
    make_region,
    random_transfer,
    vllm_store,
    wait_one,
)

MIB = 1 << 20


def two_tensors(cell: int, bpc: int, n_gpu: int, device: str, seed: int) -> CanonicalKVCaches:
    """Two KV-cache tensors whose ``bpc`` pages each fill a rank's cell of ``cell`` bytes (the
    second tensor's page a quarter of the first's), one group naming both."""
    big = cell // bpc * 4 // 5
    small = cell // bpc - big
    gen = torch.Generator().manual_seed(seed)
    ts = [
        torch.randint(-128, 128, (n_gpu, p), dtype=torch.int8, generator=gen).to(device)
        for p in (big, small)
    ]
    return CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, t.shape[1]) for t in ts],
        [[CanonicalKVCacheRef(0, big), CanonicalKVCacheRef(1, small)]],
    )


@pytest.mark.parametrize(
    ("world", "replicated", "cells"),
    [(4, False, True), (2, False, False), (4, True, False)],
    ids=["4-ranks-cells", "2-ranks-1MiB-spared-whole-rows", "replicated-whole-rows"],
)
def test_a_rank_registers_its_cells_only_where_vllm_does(
    world: int, replicated: bool, cells: bool
) -> None:
    """1 MiB cells: four ranks spare 3 MiB a row, so rank 2 registers its cell of each row
    (exactly vLLM's slot ranges); two ranks spare 1 MiB and ``replicated_layout`` none, so the
    rows stay whole (in pieces of at most ``pin_piece_bytes``)."""
    n_chunks, bpc = 6, 1
    kv = two_tensors(MIB, bpc, 4, "cpu", 0)
    rank = min(2, world - 1)
    region = make_region(kv, bpc, n_chunks, world=world, rank=rank, replicated=replicated)
    assert vr.own_cells_only(region) is cells
    assert not vr.own_cells_only(region, whole_rows=True)
    row, base = region._row_stride, region.base_tensor.data_ptr()
    w = BlockswapOffloadingWorker(
        kv, bpc, n_chunks, mmap_region=region, backend="host", pin_piece_bytes=4 * row
    )
    try:
        if cells:
            at = rank * MIB
            assert w.region_pieces == [(base + c * row + at, MIB) for c in range(n_chunks)]
            assert w.region_pieces == sorted(
                (base + o, n) for o, n in region.iter_worker_slot_ranges()
            )
        else:
            assert w.region_pieces == [(base, 4 * row), (base + 4 * row, 2 * row)]
    finally:
        w.shutdown()


def page_locked(t: torch.Tensor) -> bool:
    """Whether the driver takes the first and last byte of ``t`` for page-locked host memory
    (``CU_POINTER_ATTRIBUTE_MEMORY_TYPE`` is host). Not ``Tensor.is_pinned``: torch asks about
    the storage's start, the region's first cell, whoever locked it."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    kind = ctypes.c_uint(0)
    ends = (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size() - 1)
    # 2: CU_POINTER_ATTRIBUTE_MEMORY_TYPE; 1: CU_MEMORYTYPE_HOST.
    return all(cuda.cuPointerGetAttribute(ctypes.byref(kind), 2, a) == 0 and kind.value == 1
               for a in ends)  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bpc", [1, 4])
def test_a_rank_on_its_cells_moves_vllms_bytes_and_no_other_ranks(device: str, bpc: int) -> None:
    """Rank 1 of 4 on its 1 MiB cells, registered a cell each: random stores (partial first and
    last chunks) leave the region's bytes those of vLLM's worker on vLLM's views, every other
    rank's cell untouched (zero); loads bring them back byte-exact. On CUDA only this rank's
    cells are page-locked."""
    n_gpu, n_chunks, world, rank = 24, 10, 4, 1
    kv = two_tensors(MIB, bpc, n_gpu, device, bpc)
    engine = str(uuid.uuid4())
    region = make_region(kv, bpc, n_chunks, world=world, rank=rank, engine_id=engine)
    # vLLM's own views of a second region laid out the same: the reference.
    ref = make_region(kv, bpc, n_chunks, world=world, rank=rank)
    ref_views = [ref.create_next_worker_view(t.page_size_bytes * bpc) for t in kv.tensors]
    w = BlockswapOffloadingWorker(kv, bpc, n_chunks, mmap_region=region, backend=backend_of(device))
    row = region._row_stride
    raw = region.base_tensor.view(n_chunks, row)
    try:
        assert len(w.region_pieces) == n_chunks
        if device == "cuda":
            for c in range(n_chunks):
                assert page_locked(raw[c, rank * MIB : (rank + 1) * MIB]), c
                assert not page_locked(raw[c, (rank + 1) * MIB :]), c
                assert not page_locked(raw[c, : rank * MIB]), c
        gen = torch.Generator().manual_seed(7 + bpc)
        for job in range(6):
            ids, chunks, starts = random_transfer(gen, 1, n_gpu, n_chunks, bpc, 5)
            spec = GPULoadStoreSpec(ids[0], (len(ids[0]),), (starts[0],))
            assert w.submit_store(job, spec, CPULoadStoreSpec(chunks[0]))
            wait_one(w, job)
            vllm_store(ref_views, kv, bpc, ids, chunks, starts)
            assert torch.equal(region.base_tensor, ref.base_tensor), job
        mine = raw[:, rank * MIB : (rank + 1) * MIB]
        assert mine.any()
        assert not raw[:, : rank * MIB].any() and not raw[:, (rank + 1) * MIB :].any()
        # Loads: the stored chunks back into zeroed GPU blocks, byte-exact.
        saved = [t.tensor.clone() for t in kv.tensors]
        ids, chunks, starts = random_transfer(gen, 1, n_gpu, n_chunks, bpc, 5)
        spec = GPULoadStoreSpec(ids[0], (len(ids[0]),), (starts[0],))
        assert w.submit_store(90, spec, CPULoadStoreSpec(chunks[0]))
        wait_one(w, 90)
        for t in kv.tensors:
            t.tensor.view(torch.int8)[ids[0]] = 0
        assert w.submit_load(91, CPULoadStoreSpec(chunks[0]), spec)
        wait_one(w, 91)
        for t, s in zip(kv.tensors, saved):
            assert torch.equal(t.tensor, s)
    finally:
        del raw, ref_views
        w.shutdown()
        ref.cleanup()


def test_a_table_over_cells_names_the_page_no_cell_holds() -> None:
    """The core's rule under the worker: a block table may lie in cells registered one by one,
    a page in each, and is refused, naming the page, where a cell is not registered."""
    row, cell, rows = 4096, 1024, 8
    buf = np.zeros(row * rows, dtype=np.uint8)
    base = buf.ctypes.data
    eng = Engine("host")
    try:
        for r in range(rows):
            if r != 5:
                eng.register(base + r * row + cell, cell, "host")
        with pytest.raises(InvalidTransferError) as err:
            eng.register_table([base + cell], [row], [cell // 2], rows, "host")
        page = base + 5 * row + cell
        assert f"the page [{page:#x}, +{cell // 2}) is not inside registered host memory" in str(
            err.value
        )
        eng.register(base + 5 * row + cell, cell, "host")
        table: Any = eng.register_table([base + cell], [row], [cell // 2], rows, "host")
        assert table >= 0
    finally:
        eng.shutdown()


@pytest.mark.cuda
@pytest.mark.parametrize("locked", [True, False])
def test_cuda_pieces_the_caller_gives_are_each_checked_page_locked(locked: bool) -> None:
    """With ``host_pieces`` the handler leaves the pinned check to the engine (torch asks about
    a tensor's storage, whose start may be another rank's cell): this rank's cells (the second
    of two a row) are taken where they are page-locked, and refused by name where they are
    not."""
    from blockswap import BlockswapError
    from blockswap.handler import CpuGpuHandlers

    n, page = 4, 1 << 16
    gpu = [torch.zeros(n, 16, page // 16, dtype=torch.uint8, device="cuda")]
    host = torch.zeros(n, 2, 16, page // 16, dtype=torch.uint8)
    if locked:
        host = host.pin_memory()
    cells = [(host[r, 1].data_ptr(), page) for r in range(n)]
    options: dict[str, Any] = {"layout": "mla", "backend": "cuda", "path": "dma"}
    if locked:
        h = CpuGpuHandlers(gpu, n, cpu_caches=[host[:, 1]], host_pieces=cells, **options)
        h.shutdown()
    else:
        with pytest.raises(BlockswapError, match="not page-locked host memory"):
            CpuGpuHandlers(gpu, n, cpu_caches=[host[:, 1]], host_pieces=cells, **options)
