"""blockswap's vLLM worker on vLLM's shared offload region (``SharedOffloadRegion``): the bytes it
leaves there are the bytes vLLM's own worker would leave, at the same offsets.

Ported from vLLM 0.33's tests (``tests/v1/kv_offload/cpu/test_gpu_worker.py`` and the region's
``test_shared_offload_region.py``, read from vLLM's repository), their cases and assertions kept.
What changed, and why:

- ``CPUOffloadingWorker`` is :class:`~blockswap.vllm.BlockswapOffloadingWorker` (the worker under
  test); vLLM's ``handler.src_tensors`` / ``dst_tensors`` are the worker's ``cpu_tensors`` (vLLM's
  own region views, made by the region's ``create_next_worker_view`` as vLLM's worker makes them)
  and the KV-cache tensors; ``handler._transfers`` is not checked (blockswap's engine keeps its
  queue in the core).
- The region is built with vLLM 0.33's signature (``num_chunks``, ``kv_bytes_per_chunk``, the
  rank's ``cpu_page_size``), sized as ``CPUOffloadingSpec`` sizes it (a row rounded up to a page).
- The "GPU" tensors are CPU tensors on the host backend (no GPU in CI); the same tests run on the
  GPU with the ``cuda`` marker. ``transfer_time > 0`` becomes ``>= 0`` on the host backend, which
  does not time its memcpy.
- ``test_transfer``'s private-cache case (``use_shared_memory=False``) is ``tests/test_vllm.py``'s
  ``test_vllm_transfer``.
"""

from __future__ import annotations

import math
import mmap
import os
import traceback
import uuid
from typing import Any

import pytest
import torch

pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed")
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

from blockswap import _core
from blockswap.vllm import BlockswapOffloadingWorker
from test_vllm import (
    CASES,
    model_caches,
    no_general_path,
    page_of_4_tensors,
    refuses_bad_specs_on_the_plain_path,
    three_group_mapping,
    two_ranks,
)

PAGE = mmap.PAGESIZE
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def backend_of(device: str) -> str:
    return "host" if device == "cpu" else "cuda"


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """vLLM's ``CPULoadStoreSpec`` (its module imports most of vLLM): chunk ids."""


def round_up(x: int, to: int) -> int:
    return -(-x // to) * to


def make_region(
    kv: CanonicalKVCaches,
    bpc: int,
    n_chunks: int,
    *,
    world: int = 1,
    rank: int = 0,
    replicated: bool = False,
    engine_id: str | None = None,
    **kwargs: Any,
) -> SharedOffloadRegion:
    """The region ``CPUOffloadingSpec`` makes for these caches: a rank's cell is every tensor's
    ``bpc`` pages, a row one cell per rank (one with ``replicated``) rounded up to a page."""
    cell = sum(t.page_size_bytes for t in kv.tensors) * bpc
    copies = 1 if replicated else world
    return SharedOffloadRegion(
        engine_id=engine_id or str(uuid.uuid4()),
        num_chunks=n_chunks,
        rank=0 if replicated else rank,
        kv_bytes_per_chunk=round_up(cell * copies, SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT),
        cpu_page_size=cell,
        **kwargs,
    )


def wait_one(w: BlockswapOffloadingWorker, job: int) -> Any:
    w.wait({job})
    (r,) = w.get_finished()
    assert (r.job_id, r.success) == (job, True)
    return r


# ---- vLLM's test_transfer / test_transfer_multi_group on the shared region ------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("replicated_layout", [False, True])
@pytest.mark.parametrize("blocks_per_chunk", [1, 3])
@pytest.mark.parametrize("gpu_page_size_bytes", [512, 1024])
@pytest.mark.parametrize("gpu_to_cpu", [True, False])
def test_transfer(
    gpu_to_cpu: bool,
    gpu_page_size_bytes: int,
    blocks_per_chunk: int,
    replicated_layout: bool,
    device: str,
) -> None:
    """vLLM's ``test_transfer`` with ``use_shared_memory=True``: 4 tensors of one group in a
    region of a simulated world of 2 (rank 0), or replicated; 3 chunks, the first
    ``blocks_per_chunk - 1`` sub-blocks skipped."""
    torch.manual_seed(gpu_page_size_bytes + blocks_per_chunk)
    gen = torch.Generator().manual_seed(gpu_page_size_bytes * 7 + blocks_per_chunk)
    num_gpu_blocks, num_cpu_blocks, num_tensors, num_mappings = 64, 256, 4, 3
    page = gpu_page_size_bytes
    tensors = [
        torch.zeros((num_gpu_blocks, page), dtype=torch.int8, device=device)
        for _ in range(num_tensors)
    ]
    kv = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, page) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(i, page) for i in range(num_tensors)]],
    )
    region = make_region(
        kv, blocks_per_chunk, num_cpu_blocks, world=2, replicated=replicated_layout
    )
    worker = BlockswapOffloadingWorker(
        kv, blocks_per_chunk, num_cpu_blocks, mmap_region=region, backend=backend_of(device)
    )
    try:
        gpu_blocks = torch.randperm(num_gpu_blocks, generator=gen)[
            : num_mappings * blocks_per_chunk
        ].tolist()
        cpu_blocks = torch.randperm(num_cpu_blocks, generator=gen)[:num_mappings].tolist()
        expanded = [c * blocks_per_chunk + j for c in cpu_blocks for j in range(blocks_per_chunk)]
        skip = blocks_per_chunk - 1
        if skip > 0:
            gpu_blocks, expanded = gpu_blocks[skip:], expanded[skip:]
        gpu_spec = GPULoadStoreSpec(
            gpu_blocks, group_sizes=(len(gpu_blocks),), block_indices=(skip,)
        )
        cpu_spec = CPULoadStoreSpec(cpu_blocks)
        cpu_tensors = worker.cpu_tensors
        src_tensors, dst_tensors = (tensors, cpu_tensors) if gpu_to_cpu else (cpu_tensors, tensors)
        dst_to_src = dict(zip(expanded, gpu_blocks) if gpu_to_cpu else zip(gpu_blocks, expanded))
        num_dst_sub_blocks = num_cpu_blocks * blocks_per_chunk if gpu_to_cpu else num_gpu_blocks
        for t in (*src_tensors, *dst_tensors):
            t.random_()
        orig_src = [x.clone() for x in src_tensors]
        orig_dst = [x.clone() for x in dst_tensors]
        if gpu_to_cpu:
            assert worker.submit_store(1, gpu_spec, cpu_spec)
        else:
            assert worker.submit_load(1, cpu_spec, gpu_spec)
        r = wait_one(worker, 1)
        assert r.transfer_size == len(gpu_blocks) * sum(
            x.page_size_bytes for x in kv.group_data_refs[0]
        )
        assert r.transfer_time >= 0
        if device == "cuda":
            assert r.transfer_time > 0
            torch.cuda.synchronize()
        for o, t in zip(orig_src, src_tensors):
            assert torch.equal(o, t)
        for s, d, o in zip(src_tensors, dst_tensors, orig_dst):
            src_view = s.reshape(-1, page).cpu()
            dst_view = d.reshape(-1, page).cpu()
            orig_view = o.reshape(-1, page).cpu()
            for sub in range(num_dst_sub_blocks):
                src = dst_to_src.get(sub)
                want = src_view[src] if src is not None else orig_view[sub]
                assert torch.equal(dst_view[sub], want), sub
        # Past this rank's cell (the other rank's in a world of 2, and the row's padding) no
        # byte was written: the region is fresh, so it is all zero.
        cell = num_tensors * page * blocks_per_chunk
        assert not region.base_tensor.view(num_cpu_blocks, -1)[:, cell:].any()
    finally:
        del cpu_tensors, src_tensors, dst_tensors
        worker.shutdown()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("blocks_per_chunk", [1, 3])
@pytest.mark.parametrize("gpu_page_size_bytes", [512, 1024])
@pytest.mark.parametrize("gpu_to_cpu", [True, False])
def test_transfer_multi_group(
    gpu_to_cpu: bool, gpu_page_size_bytes: int, blocks_per_chunk: int, device: str
) -> None:
    """vLLM's ``test_transfer_multi_group`` on a region: three groups of two tensors; group 0
    aligned, group 1 empty, group 2 unaligned at both ends (its first and last chunk
    partial)."""
    gen = torch.Generator().manual_seed(gpu_page_size_bytes + blocks_per_chunk)
    num_gpu_blocks, num_cpu_blocks, per_group, n_map, page = 64, 256, 2, 2, gpu_page_size_bytes
    bpc = blocks_per_chunk
    tensors = [
        torch.zeros((num_gpu_blocks, page), dtype=torch.int8, device=device)
        for _ in range(3 * per_group)
    ]
    kv = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, page) for t in tensors],
        group_data_refs=[
            [CanonicalKVCacheRef(g * per_group + i, page) for i in range(per_group)]
            for g in range(3)
        ],
    )
    region = make_region(kv, bpc, num_cpu_blocks)
    worker = BlockswapOffloadingWorker(
        kv, bpc, num_cpu_blocks, mmap_region=region, backend=backend_of(device)
    )
    try:
        sizes = [n_map, 0, n_map]
        gpu_g, cpu_g, exp_g, skip = three_group_mapping(
            gen, sizes, bpc, num_gpu_blocks, num_cpu_blocks
        )
        group_sizes = [len(g) for g in gpu_g]
        gpu_spec = GPULoadStoreSpec([b for g in gpu_g for b in g], group_sizes, [0, 0, skip])
        cpu_spec = CPULoadStoreSpec([x for cs in cpu_g for x in cs])
        cpu_tensors = worker.cpu_tensors
        src_tensors, dst_tensors = (tensors, cpu_tensors) if gpu_to_cpu else (cpu_tensors, tensors)
        for t in (*src_tensors, *dst_tensors):
            t.random_()
        orig_src = [x.clone() for x in src_tensors]
        orig_dst = [x.clone() for x in dst_tensors]
        if gpu_to_cpu:
            assert worker.submit_store(1, gpu_spec, cpu_spec)
            maps = [dict(zip(e, g)) for e, g in zip(exp_g, gpu_g)]
            num_dst = num_cpu_blocks * bpc
        else:
            assert worker.submit_load(1, cpu_spec, gpu_spec)
            maps = [dict(zip(g, e)) for e, g in zip(exp_g, gpu_g)]
            num_dst = num_gpu_blocks
        r = wait_one(worker, 1)
        assert r.transfer_size == sum(
            n * sum(x.page_size_bytes for x in refs)
            for n, refs in zip(group_sizes, kv.group_data_refs)
        )
        if device == "cuda":
            torch.cuda.synchronize()
        for o, t in zip(orig_src, src_tensors):
            assert torch.equal(o, t)
        for g, m in enumerate(maps):
            for i in range(per_group):
                t = g * per_group + i
                src_view = src_tensors[t].reshape(-1, page).cpu()
                dst_view = dst_tensors[t].reshape(-1, page).cpu()
                orig_view = orig_dst[t].reshape(-1, page).cpu()
                for sub in range(num_dst):
                    src = m.get(sub)
                    want = src_view[src] if src is not None else orig_view[sub]
                    assert torch.equal(dst_view[sub], want), (g, i, sub)
    finally:
        del cpu_tensors, src_tensors, dst_tensors
        worker.shutdown()


def test_worker_isolation_two_ranks_in_one_region() -> None:
    """The region's ``test_create_next_worker_view_worker_isolation`` through two workers (ranks
    0 and 1 of one region): each rank's stores land in its own cell of each row, at
    ``rank * cpu_page_size``, and never touch the other rank's."""
    n_gpu, n_chunks, page, bpc = 8, 4, 1024, 2
    engine = str(uuid.uuid4())
    gens = [torch.Generator().manual_seed(r) for r in (0, 1)]
    kvs, tss = [], []
    for gen in gens:
        ts = [torch.randint(-128, 128, (n_gpu, page), dtype=torch.int8, generator=gen)]
        tss.append(ts)
        kvs.append(CanonicalKVCaches([CanonicalKVCacheTensor(ts[0], page)],
                                     [[CanonicalKVCacheRef(0, page)]]))  # fmt: skip
    regions = [
        make_region(kvs[r], bpc, n_chunks, world=2, rank=r, engine_id=engine) for r in (0, 1)
    ]
    workers = [
        BlockswapOffloadingWorker(kvs[r], bpc, n_chunks, mmap_region=regions[r], backend="host")
        for r in (0, 1)
    ]
    try:
        for w in workers:
            spec = GPULoadStoreSpec(list(range(n_chunks * bpc)), (n_chunks * bpc,), (0,))
            assert w.submit_store(1, spec, CPULoadStoreSpec(list(range(n_chunks))))
            wait_one(w, 1)
        raw = regions[0].base_tensor.view(n_chunks, -1)
        cell = page * bpc
        for c in range(n_chunks):
            for r in (0, 1):
                want = tss[r][0][c * bpc : (c + 1) * bpc].reshape(-1)
                assert torch.equal(raw[c, r * cell : (r + 1) * cell], want), (c, r)
    finally:
        del raw
        for w in workers:
            w.shutdown()


# ---- the region's bytes equal vLLM's ------------------------------------------------------------


def vllm_store(
    views: list[torch.Tensor],
    kv: CanonicalKVCaches,
    bpc: int,
    ids: list[list[int]],
    chunks: list[list[int]],
    starts: list[int],
) -> None:
    """What vLLM's worker writes for a store, by torch indexing on vLLM's own region views: per
    group, per reference, GPU block ``i`` to sub-block ``(skip + i) % bpc`` of chunk
    ``chunks[(skip + i) // bpc]``, ``ref.page_size_bytes`` bytes at ``sub * tensor page``."""
    for g, refs in enumerate(kv.group_data_refs):
        skip = starts[g] % bpc
        for ref in refs:
            t, p = ref.tensor_idx, ref.page_size_bytes
            tp = kv.tensors[t].page_size_bytes
            src = kv.tensors[t].tensor.view(torch.int8).view(-1, tp)
            for i, b in enumerate(ids[g]):
                c, j = chunks[g][(skip + i) // bpc], (skip + i) % bpc
                views[t][c, j * tp : j * tp + p] = src[b, :p].cpu()


def random_transfer(
    gen: torch.Generator, groups: int, n_gpu: int, n_chunks: int, bpc: int, per: int
) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Per group: distinct GPU blocks, a random first block index (partial first and last chunks
    where bpc > 1) and the chunks they take, all chunks distinct."""
    perm = torch.randperm(n_gpu, generator=gen).tolist()
    ids = [perm[g * per : (g + 1) * per] for g in range(groups)]
    starts = [int(torch.randint(0, 50, (1,), generator=gen)) for _ in range(groups)]
    need = [math.ceil((s % bpc + len(i)) / bpc) for i, s in zip(ids, starts)]
    flat = torch.randperm(n_chunks, generator=gen)[: sum(need)].tolist()
    chunks, k = [], 0
    for m in need:
        chunks.append(flat[k : k + m])
        k += m
    return ids, chunks, starts


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bpc", [1, 4])
@pytest.mark.parametrize(
    ("model", "cross_layer"),
    CASES,
    ids=[f"{m[0]}-{'cross-layer' if x else 'per-layer'}" for m, x in CASES],
)
def test_region_bytes_equal_vllms(
    model: tuple[str, int, int, int, int], cross_layer: bool, bpc: int, device: str
) -> None:
    """Random stores of the catalogue's models, per-layer and cross-layer, partial first and last
    chunks: after each, the whole region (every rank's cells, padding, untouched sub-blocks)
    equals a reference region written by torch indexing on the views vLLM's own
    ``SharedOffloadRegion`` hands its worker; loads bring the pages back byte for byte and write
    nothing else."""
    name, layers, page, groups, pad = model
    n_gpu, n_chunks = (48, 16) if device == "cuda" else (12, 6)
    per = 5 if groups == 1 else 3
    torch.manual_seed(layers * bpc)
    kv, ts = model_caches(layers, page, groups, cross_layer, n_gpu, pad, device=device)
    region = make_region(kv, bpc, n_chunks, world=2, rank=1)
    ref = make_region(kv, bpc, n_chunks, world=2, rank=1)
    gen = torch.Generator().manual_seed(layers + bpc)
    fill = torch.randint(-128, 128, (region.total_size_bytes,), dtype=torch.int8, generator=gen)
    region.base_tensor.copy_(fill)
    ref.base_tensor.copy_(fill)
    del fill
    ref_views = [ref.create_next_worker_view(t.page_size_bytes * bpc) for t in kv.tensors]
    w = BlockswapOffloadingWorker(kv, bpc, n_chunks, mmap_region=region, backend=backend_of(device))
    try:
        # One writer per group: every spec reaches the core in one call, which cuts it.
        assert w._map.plain is not None
        no_general_path(w)
        # A per-layer cache moves rows (block or staged plan), not pages: a chunk of one block
        # is one row per block in its cell (every tensor's page, tensor after tensor); with more
        # blocks per chunk, a block's pages lie in the cell with the other blocks' between them
        # (the cell plan: a whole chunk one row). A cross-layer cache (a row of one page) or
        # padded rows (the pad is no tensor's: a row per page): the page route, or on the GPU,
        # where the kernel takes every page, the direct plan (the kernel on the cells in place).
        rows = not cross_layer and not pad
        pages = ("pages", "direct") if device == "cuda" else ("pages",)
        for d in ("d2h", "h2d"):
            plan = w.handlers[0].routes[d].plan
            assert plan in (("blocks", "staged") if rows else pages), (d, plan)
        for job in range(3):
            ids, chunks, starts = random_transfer(gen, groups, n_gpu, n_chunks, bpc, per)
            spec = GPULoadStoreSpec([b for g in ids for b in g], [len(g) for g in ids], starts)
            cpu = CPULoadStoreSpec([c for cs in chunks for c in cs])
            assert w.submit_store(job, spec, cpu) is True
            wait_one(w, job)
            vllm_store(ref_views, kv, bpc, ids, chunks, starts)
            assert torch.equal(region.base_tensor, ref.base_tensor), (name, job)
        # Load the last store back into other blocks of a cleared cache.
        taken = {b for g in ids for b in g}
        others = [b for b in range(n_gpu) if b not in taken]
        back = [others[g * per : (g + 1) * per] for g in range(groups)]
        before = [t.clone() for t in ts]
        for t in ts:
            t.zero_()
        spec = GPULoadStoreSpec([b for g in back for b in g], [len(g) for g in back], starts)
        assert w.submit_load(9, cpu, spec) is True
        wait_one(w, 9)
        if device == "cuda":
            torch.cuda.synchronize()
        p = layers * page if cross_layer else page
        dsts = {d: s for g in range(groups) for s, d in zip(ids[g], back[g])}
        for t, b0 in zip(ts, before):
            got, want = t.cpu(), b0.cpu()
            for b in range(n_gpu):
                if b in dsts:
                    assert torch.equal(got[b, :p], want[dsts[b], :p]), (name, b)
                    assert not got[b, p:].any()
                else:
                    assert not got[b].any(), (name, b)
        assert torch.equal(region.base_tensor, ref.base_tensor)  # a load writes no host byte
    finally:
        del ref_views
        w.shutdown()
        ref.cleanup()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bpc", [1, 3, 4])
def test_one_group_on_a_region_takes_the_plain_path(
    bpc: int, device: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One KV-cache group, one writer, vLLM's region: the worker cuts vLLM's specs into the
    core's groups itself (one per sub-block index of a chunk), not through the handler's
    ``transfer_async``. Bad specs are refused with the general path's words; stores with partial
    first and last chunks leave the region as vLLM's worker would (a reference written by torch
    indexing on vLLM's own views, every other byte as it was), and a load brings the pages
    back."""
    n_gpu, n_chunks = 24, 8
    kv, ts = page_of_4_tensors(bpc, n_gpu, page=512, device=device)
    region = make_region(kv, bpc, n_chunks, world=2, rank=1)
    ref = make_region(kv, bpc, n_chunks, world=2, rank=1)
    fill = torch.randint(-128, 128, (region.total_size_bytes,), dtype=torch.int8)
    region.base_tensor.copy_(fill)
    ref.base_tensor.copy_(fill)
    ref_views = [ref.create_next_worker_view(t.page_size_bytes * bpc) for t in kv.tensors]
    w = BlockswapOffloadingWorker(kv, bpc, n_chunks, mmap_region=region, backend=backend_of(device))
    try:
        refuses_bad_specs_on_the_plain_path(w, bpc, n_chunks, caplog, monkeypatch)
        # Stores from every first sub-block, so that each index of a chunk leads in turn.
        gen = torch.Generator().manual_seed(bpc)
        for job, start in enumerate(range(bpc + 1)):
            blocks = torch.randperm(n_gpu, generator=gen)[:5].tolist()
            m = math.ceil((start % bpc + len(blocks)) / bpc)
            chunks = torch.randperm(n_chunks, generator=gen)[:m].tolist()
            spec = GPULoadStoreSpec(blocks, [len(blocks)], [start])
            assert w.submit_store(30 + job, spec, CPULoadStoreSpec(chunks)) is True
            wait_one(w, 30 + job)
            vllm_store(ref_views, kv, bpc, [blocks], [chunks], [start])
            assert torch.equal(region.base_tensor, ref.base_tensor), start
        # The last store loaded back into other blocks of a cleared cache.
        others = [b for b in range(n_gpu) if b not in blocks][: len(blocks)]
        before = [t.clone() for t in ts]
        for t in ts:
            t.zero_()
        spec = GPULoadStoreSpec(others, [len(others)], [start])
        assert w.submit_load(50, CPULoadStoreSpec(chunks), spec) is True
        wait_one(w, 50)
        for t, b0 in zip(ts, before):
            got, want = t.cpu(), b0.cpu()
            for b in range(n_gpu):
                if b in others:
                    assert torch.equal(got[b], want[blocks[others.index(b)]]), b
                else:
                    assert not got[b].any(), b
        assert torch.equal(region.base_tensor, ref.base_tensor)  # a load writes no host byte
    finally:
        del ref_views
        w.shutdown()
        ref.cleanup()


# ---- replicated layout: two processes, one copy ------------------------------------------------


def _replicated_rank(rank: int, engine: str, barrier: Any, out: Any) -> None:
    """One rank of a world of 2 with ``replicated_layout``: the region as ``CPUOffloadingSpec``
    makes it (rank 0's cell for both, each rank pre-faulting its share, the barrier); identical
    KV on both ranks (as MLA under TP); rank ``r`` stores chunks of its own, then each rank loads
    the other's chunks back."""
    try:
        n_gpu, n_chunks, bpc, page = 16, 8, 2, 4096
        gen = torch.Generator().manual_seed(5)  # the same KV on both ranks
        ts = [torch.randint(-128, 128, (n_gpu, page), dtype=torch.int8, generator=gen)
              for _ in range(2)]  # fmt: skip
        kv = CanonicalKVCaches([CanonicalKVCacheTensor(t, page) for t in ts],
                               [[CanonicalKVCacheRef(0, page), CanonicalKVCacheRef(1, page)]])  # fmt: skip
        region = make_region(
            kv,
            bpc,
            n_chunks,
            world=2,
            rank=rank,
            replicated=True,
            engine_id=engine,
            barrier=lambda: barrier.wait(60),
            populate_shard=(rank, 2),
        )
        st = os.fstat(region.fd)  # type: ignore[arg-type]
        w = BlockswapOffloadingWorker(kv, bpc, n_chunks, mmap_region=region, backend="host")
        try:
            mine = [rank * 4 + k for k in range(4)]  # chunks 0-3 for rank 0, 4-7 for rank 1
            blocks = list(range(rank * 8, rank * 8 + 8))
            spec = GPULoadStoreSpec(blocks, (8,), (0,))
            assert w.submit_store(1, spec, CPULoadStoreSpec(mine))
            wait_one(w, 1)
            barrier.wait(60)
            theirs = [(1 - rank) * 4 + k for k in range(4)]
            src = list(range((1 - rank) * 8, (1 - rank) * 8 + 8))
            before = [t.clone() for t in ts]
            for t in ts:
                t.zero_()
            back = list(range(8, 16)) if rank == 0 else list(range(8))
            assert w.submit_load(2, CPULoadStoreSpec(theirs), GPULoadStoreSpec(back, (8,), (0,)))
            wait_one(w, 2)
            exact = all(torch.equal(t[back], b[src]) for t, b in zip(ts, before))
            untouched = all(not t[[x for x in range(n_gpu) if x not in back]].any() for t in ts)
            out.put((rank, None, st.st_ino, st.st_size, region.total_size_bytes, exact, untouched))
            barrier.wait(60)
        finally:
            w.shutdown()
    except Exception:  # reported to the parent, which fails the test with it
        out.put((rank, traceback.format_exc(), 0, 0, 0, False, False))
        barrier.abort()


def test_replicated_layout_two_processes_share_one_copy() -> None:
    """Ranks 0 and 1 (world size 2) in two processes with ``replicated_layout``: one region of
    one copy (``num_chunks`` rows of one cell, not two), the same file in both; each rank's
    stores are read back byte for byte by the other rank's loads."""
    engine = str(uuid.uuid4())
    results = two_ranks(_replicated_rank, engine, timeout=120)
    (_, _, ino0, size0, total0, exact0, clean0), (_, _, ino1, size1, total1, exact1, clean1) = (
        results
    )
    cell = 2 * 4096 * 2  # two tensors' two pages
    assert total0 == total1 == 8 * cell  # one copy: a world of 2 without it holds 2 * 8 * cell
    assert size0 == size1 == total0 and ino0 == ino1  # one file, mapped by both ranks
    assert exact0 and exact1 and clean0 and clean1
    assert not os.path.exists(f"/dev/shm/vllm_offload_{engine}.mmap")  # unlinked after the barrier


@pytest.mark.parametrize("bpc", [1, 4])
def test_a_region_in_pieces_moves_the_bytes_of_one_registered_whole(bpc: int) -> None:
    """The region registered with the engines in pieces of 3 rows (``pin_piece_bytes``; on the
    host backend nothing is page-locked, but the registrations are cut the same way): the pieces
    tile the region in whole rows, and stores across piece boundaries, partial at both ends,
    leave the bytes a worker over one piece leaves, which are vLLM's."""
    n_gpu, n_chunks, page = 32, 10, 1024
    gen = torch.Generator().manual_seed(bpc)
    ts = [
        torch.randint(-128, 128, (n_gpu, page), dtype=torch.int8, generator=gen) for _ in range(3)
    ]
    kv = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, page) for t in ts],
        [
            [CanonicalKVCacheRef(0, page), CanonicalKVCacheRef(2, page)],
            [CanonicalKVCacheRef(1, 512)],
        ],
    )
    regions = [make_region(kv, bpc, n_chunks) for _ in range(3)]
    row = regions[0]._row_stride
    whole = BlockswapOffloadingWorker(kv, bpc, n_chunks, mmap_region=regions[0], backend="host")
    pieces = BlockswapOffloadingWorker(
        kv, bpc, n_chunks, mmap_region=regions[1], backend="host", pin_piece_bytes=3 * row + 100
    )
    ref_views = [regions[2].create_next_worker_view(t.page_size_bytes * bpc) for t in kv.tensors]
    try:
        assert len(whole.region_pieces) == 1
        base = regions[1].base_tensor.data_ptr()
        assert pieces.region_pieces == [
            (base + k * 3 * row, min(3, n_chunks - 3 * k) * row) for k in range(4)
        ]
        for job in range(4):
            # Consecutive chunks from 1 or 2, over a boundary at chunk 3 or 6, partial at both ends.
            first = 1 + job % 2 + 3 * (job // 2)
            skip = (bpc - 1) if bpc > 1 else 0
            n0 = 3 * bpc - 2 * skip
            ids = [list(range(job, job + n0)), list(range(16 + job, 16 + job + bpc))]
            need = [math.ceil((skip + len(ids[0])) / bpc), 1]
            chunks = [list(range(first, first + need[0])), [9 * (job % 2)]]
            spec = GPULoadStoreSpec(ids[0] + ids[1], [len(g) for g in ids], [skip, 0])
            cpu = CPULoadStoreSpec(chunks[0] + chunks[1])
            for w in (whole, pieces):
                assert w.submit_store(job, spec, cpu)
                wait_one(w, job)
            vllm_store(ref_views, kv, bpc, ids, chunks, [skip, 0])
            assert torch.equal(regions[0].base_tensor, regions[1].base_tensor), job
            assert torch.equal(regions[1].base_tensor, regions[2].base_tensor), job
        assert regions[1].base_tensor.any()
    finally:
        del ref_views
        whole.shutdown()
        pieces.shutdown()
        regions[2].cleanup()


@pytest.mark.parametrize("world", [1, 2])
def test_the_worker_fills_its_slots_from_threads_as_it_pins_the_region(
    monkeypatch: pytest.MonkeyPatch, world: int
) -> None:
    """A region made by blockswap's specs (``new_region``) leaves pre-faulting this rank's slots
    to the worker, which fills exactly them (vLLM's ranges, joined) from several threads while it
    locks the region in pieces (of at most ``pin_piece_bytes``); the bytes moved afterwards are
    those of a region vLLM filled itself."""
    from blockswap import _vllm_region as vr

    n_gpu, n_chunks, page = 8, 12, 4096
    gen = torch.Generator().manual_seed(world)
    t = torch.randint(-128, 128, (n_gpu, page), dtype=torch.int8, generator=gen)
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(t, page)], [[CanonicalKVCacheRef(0, page)]])
    cell = page
    kwargs = {
        "num_chunks": n_chunks,
        "rank": world - 1,
        "kv_bytes_per_chunk": round_up(cell * world, SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT),
        "cpu_page_size": cell,
    }
    region = vr.new_region(engine_id=str(uuid.uuid4()), **kwargs)
    vllms = SharedOffloadRegion(engine_id=str(uuid.uuid4()), **kwargs)
    assert region._blockswap_fill_pending and not hasattr(vllms, "_blockswap_fill_pending")
    base = region.base_tensor.data_ptr()
    slots = [(base + o, n) for o, n in region.iter_worker_slot_ranges()]
    row = region._row_stride
    calls: list[tuple[Any, ...]] = []
    real = vr._core.fill_and_pin

    def spy(ranges: Any, pieces: Any, device: Any = None, **kw: Any) -> None:
        # Each range's file: the segment mapped there, at the range's offset in it.
        files = [(os.readlink(f"/proc/self/fd/{fd}"), at) for fd, at in kw["files"]]
        calls.append((ranges, pieces, device, files))
        real(ranges, pieces, device, **kw)
        # The region's descriptors are open until the fill is done.
        assert all(os.fstat(fd) for fd, _ in kw["files"])

    monkeypatch.setattr(vr._core, "fill_and_pin", spy)
    workers = [
        BlockswapOffloadingWorker(
            kv, 1, n_chunks, mmap_region=r, backend="host", pin_piece_bytes=4 * row
        )
        for r in (region, vllms)
    ]
    try:
        ((ranges, pieces, device, files),) = calls  # the region vLLM filled needs nothing
        assert pieces == [] and device is None  # the host backend locks nothing
        assert ranges == vr.merged(slots)
        # One segment file here (a region under 1 GiB): every range in it, at its own offset.
        assert files == [(region.mmap_path, a - base) for a, _ in ranges]
        # One range where the rank's slots are the whole region, else one slot per chunk.
        assert sum(n for _, n in ranges) == n_chunks * cell
        assert len(ranges) == (1 if world == 1 else n_chunks)
        assert not region._blockswap_fill_pending
        assert region._blockswap_files == []  # closed once filled
        assert workers[0].region_pieces == [(base + k * 4 * row, 4 * row) for k in range(3)]
        ids = list(range(n_gpu))
        spec = GPULoadStoreSpec(ids, (n_gpu,), (0,))
        for w in workers:
            assert w.submit_store(1, spec, CPULoadStoreSpec(list(range(n_gpu))))
            wait_one(w, 1)
        assert torch.equal(region.base_tensor, vllms.base_tensor) and region.base_tensor.any()
    finally:
        for w in workers:
            w.shutdown()


def test_a_fill_is_cut_where_the_files_meet() -> None:
    """A fill range across vLLM's segment files is cut at each file's end, and each piece names
    its file's descriptor and its offset there; without segments the ranges stay whole."""
    from blockswap import _vllm_region as vr

    b = 1 << 40
    segments = [(0, 100, 7), (100, 100, 8), (200, 50, 9)]
    ranges, files = vr.in_files([(b + 10, 20), (b + 90, 120), (b + 240, 10)], b, segments)
    assert ranges == [(b + 10, 20), (b + 90, 10), (b + 100, 100), (b + 200, 10), (b + 240, 10)]
    assert files == [(7, 10), (7, 90), (8, 0), (9, 0), (9, 40)]
    assert vr.in_files([(b, 8)], b, []) == ([(b, 8)], [])


def test_the_fill_allocates_a_segmented_region_in_its_files_after_vllm_unlinked_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM maps a large region from several files and unlinks them after its barrier: the
    region ``new_region`` makes opens them while they have names, and the worker's fill gets
    each range's descriptor and offset, allocates the pages there (the files' blocks counted)
    and faults them in; ``close_files`` (or ``cleanup``) closes the descriptors."""
    from vllm.v1.kv_offload.cpu import shared_offload_region as sor

    from blockswap import _vllm_region as vr

    page, n_chunks = mmap.PAGESIZE, 12
    row = 4 * page
    # Files of four rows (vLLM's least segment is 1 GiB; lowered to keep the test small).
    monkeypatch.setattr(sor, "_MIN_SEGMENT_BYTES", 4 * row)
    kwargs = {"num_chunks": n_chunks, "rank": 0, "kv_bytes_per_chunk": row, "cpu_page_size": row}
    region = vr.new_region(
        engine_id=str(uuid.uuid4()), barrier=lambda: None, num_segments=32, **kwargs
    )
    try:
        assert len(region._segments) == 3
        assert not any(os.path.exists(p) for p, _, _ in region._segments)  # unlinked
        assert [(o, n) for o, n, _ in region._blockswap_files] == [
            (o, n) for _, o, n in region._segments
        ]
        base = region.base_tensor.data_ptr()
        pieces, fill, files = vr.pieces_and_fill(region, 1 << 30)
        assert pieces == [(base, n_chunks * row)]
        assert fill == [(base + k * 4 * row, 4 * row) for k in range(3)]
        fds = [fd for _, _, fd in region._blockswap_files]
        assert files == [(fd, 0) for fd in fds]
        # Nothing allocated yet but the page vLLM populates to see whether the kernel can.
        assert sum(os.fstat(fd).st_blocks * 512 for fd in fds) <= page
        assert vr.pin_region([], 0, fill, files) == []
        for fd in fds:
            assert os.fstat(fd).st_blocks * 512 >= 4 * row  # allocated in the file
        region.base_tensor[:] = 3  # the mapping and the files are one memory
        assert os.pread(fds[2], 4, 5) == b"\x03" * 4
        vr.close_files(region)
        assert region._blockswap_files == []
        for fd in fds:
            with pytest.raises(OSError):
                os.fstat(fd)
    finally:
        region.cleanup()
    # A second region closed by cleanup alone.
    region = vr.new_region(
        engine_id=str(uuid.uuid4()), barrier=lambda: None, num_segments=32, **kwargs
    )
    fds = [fd for _, _, fd in region._blockswap_files]
    assert len(fds) == 3
    region.cleanup()
    assert region._blockswap_files == []
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_each_rank_fills_from_the_file_where_vllms_order_of_its_slots_starts(
    monkeypatch: pytest.MonkeyPatch, rank: int
) -> None:
    """vLLM starts each rank's slots of a segmented region at a file of its own, so that ranks
    pre-faulting at once fill different files: the worker's fill keeps that start (its ranges
    rotated to begin at vLLM's first slot, then in address order, wrapping round), each range
    with its own file and offset, every slot once."""
    from vllm.v1.kv_offload.cpu import shared_offload_region as sor

    from blockswap import _vllm_region as vr

    page, n_chunks, world = mmap.PAGESIZE, 12, 4
    row = world * page
    monkeypatch.setattr(sor, "_MIN_SEGMENT_BYTES", 4 * row)  # files of four rows
    region = vr.new_region(
        engine_id=str(uuid.uuid4()),
        barrier=lambda: None,
        num_segments=32,
        num_chunks=n_chunks,
        rank=rank,
        kv_bytes_per_chunk=row,
        cpu_page_size=page,
    )
    try:
        assert len(region._segments) == 3
        base = region.base_tensor.data_ptr()
        first = next(region.iter_worker_slot_ranges())[0]
        _, fill, files = vr.pieces_and_fill(region, 1 << 30)
        assert fill[0] == (base + first, page)
        start = first // row  # the row vLLM starts this rank at
        rows = [*range(start, n_chunks), *range(start)]
        assert fill == [(base + r * row + rank * page, page) for r in rows]
        fds = [fd for _, _, fd in region._blockswap_files]
        assert files == [(fds[r // 4], (r % 4) * row + rank * page) for r in rows]
        # Ranks 0 and 3 of 4 start in the first and the last file.
        if rank in (0, 3):
            assert files[0][0] == fds[0 if rank == 0 else 2]
        assert vr.pin_region([], 0, fill, files) == []
        for fd in fds:
            assert os.fstat(fd).st_blocks * 512 >= 4 * page  # this rank's pages allocated
    finally:
        region.cleanup()


def test_ranges_start_at_the_one_that_holds_or_follows_an_address() -> None:
    from blockswap import _vllm_region as vr

    ranges, files = [(0, 10), (20, 10), (40, 10)], [(7, 0), (8, 0), (9, 0)]
    assert vr.starting_at(ranges, files, 25) == (
        [(20, 10), (40, 10), (0, 10)],
        files[1:] + files[:1],
    )
    assert vr.starting_at(ranges, files, 30)[0] == [(40, 10), (0, 10), (20, 10)]  # a gap
    assert vr.starting_at(ranges, files, 0) == (ranges, files)
    assert vr.starting_at(ranges, files, 99) == (ranges, files)  # past the end: as they are
    assert vr.starting_at(ranges, [], 45) == ([(40, 10), (0, 10), (20, 10)], [])


def test_the_fill_takes_a_file_for_every_range_or_none() -> None:
    """Files that do not pair with the ranges one to one are refused, by count, before any
    page is touched."""
    from blockswap import InvalidTransferError, _core

    buf = mmap.mmap(-1, 2 * mmap.PAGESIZE)
    addr = ctypes_addr(buf)
    ranges = [(addr, mmap.PAGESIZE), (addr + mmap.PAGESIZE, mmap.PAGESIZE)]
    with pytest.raises(
        InvalidTransferError, match=r"1 files for 2 ranges \(one per range, or none\)"
    ):
        _core.fill_and_pin(ranges, [], None, files=[(0, 0)])
    buf.close()


def test_a_filled_range_of_a_file_is_allocated_in_it_and_keeps_its_bytes(tmp_path: Any) -> None:
    """``pin_region`` with the ranges' files: the pages are allocated in the file (its size
    kept) and what it held stays."""
    from blockswap import _vllm_region as vr

    page = mmap.PAGESIZE
    n = 64 * page
    path = str(tmp_path / "segment")
    with open(path, "wb") as f:
        f.truncate(n)
    fd = os.open(path, os.O_RDWR)
    buf = mmap.mmap(fd, n, mmap.MAP_SHARED)
    try:
        buf[5 * page + 3] = 0x5A
        addr = ctypes_addr(buf)
        assert vr.pin_region([], 0, [(addr + 4 * page, 32 * page)], [(fd, 4 * page)]) == []
        st = os.stat(path)
        assert st.st_size == n
        assert st.st_blocks * 512 >= 32 * page  # allocated, not a hole
        assert buf[5 * page + 3] == 0x5A and buf[5 * page + 4] == 0
    finally:
        buf.close()
        os.close(fd)


def test_pinning_the_region_counts_progress_and_fails_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``pin_region`` hands the core an ``AllocProgress`` that a ``PinProgress`` reports every
    ``PROGRESS_SECONDS`` (here: the bytes filled, counted by the core), and a failure is one
    error naming the region's size and the driver's reason."""
    from blockswap import _vllm_region as vr
    from blockswap import hostmem

    n = 8 << 20
    buf = mmap.mmap(-1, n)
    addr = ctypes_addr(buf)
    seen: list[Any] = []
    real = vr._core.fill_and_pin

    def spy(ranges: Any, pieces: Any, device: Any = None, *, progress: Any, files: Any) -> None:
        assert files is None  # no file named: the ranges are faulted in alone
        seen.append(progress)
        real(ranges, pieces, device, progress=progress, files=files)

    monkeypatch.setattr(vr._core, "fill_and_pin", spy)
    assert vr.pin_region([], 0, [(addr, n)]) == []
    (progress,) = seen
    assert progress.get() == (n, n, 0, 0)
    # Nothing to page-lock here (no device): the line says so, and the fill is the whole of it
    # (it stopped at 50 %, of a page-locking that never came).
    line = hostmem.PinProgress(progress).line()
    assert line.startswith(f"faulting in {hostmem.size_text(n)} of host memory: 100% ")
    assert f"({hostmem.size_text(n)} faulted in; " in line and "page-locked" not in line

    def refuse(ranges: Any, pieces: Any, device: Any = None, **kw: Any) -> None:
        raise vr.BlockswapError("could not page-lock piece 1 of 2: out of memory")

    monkeypatch.setattr(vr._core, "fill_and_pin", refuse)
    with pytest.raises(vr.BackendError, match=r"4\.00 GiB in 2 pieces.*piece 1 of 2: out of mem"):
        vr.pin_region([(addr, 2 << 30), (addr + (2 << 30), 2 << 30)], 0)
    buf.close()


def ctypes_addr(buf: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def test_the_worker_owns_the_region_once_built_and_releases_it_at_shutdown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As with vLLM's worker (``test_worker_shutdown_releases_region_and_runs_both_handlers``):
    the caller owns the region until the constructor returns (a failed construction leaves it
    mapped, for the caller's ``cleanup``); after a successful one the worker releases it once
    both directions are drained -- unless an engine still had copies in flight, when it stays
    mapped for the process."""
    import blockswap.handler as handler_module
    import blockswap.vllm as plugin

    kv = CanonicalKVCaches(
        [CanonicalKVCacheTensor(torch.zeros(8, 512, dtype=torch.int8), 512)],
        [[CanonicalKVCacheRef(0, 512)]],
    )
    region = make_region(kv, 2, 4)
    with pytest.raises(ValueError, match="blocks_per_chunk"):
        BlockswapOffloadingWorker(kv, 0, 4, mmap_region=region, backend="host")
    with pytest.raises(ValueError, match="path must be"):
        BlockswapOffloadingWorker(kv, 2, 4, mmap_region=region, backend="host", path="nope")
    big = CanonicalKVCaches(
        [CanonicalKVCacheTensor(torch.zeros(8, 1024, dtype=torch.int8), 1024)],
        [[CanonicalKVCacheRef(0, 1024)]],
    )
    with pytest.raises(ValueError, match="a cell of the shared offload region holds 1024"):
        BlockswapOffloadingWorker(big, 2, 4, mmap_region=region, backend="host")
    assert region.mmap_obj is not None and os.path.exists(region.mmap_path)  # still the caller's
    region.cleanup()
    assert not os.path.exists(region.mmap_path)

    region = make_region(kv, 2, 4)
    w = BlockswapOffloadingWorker(kv, 2, 4, mmap_region=region, backend="host")
    w.shutdown()
    assert w.mmap_region is None and w.cpu_tensors == []
    assert region.mmap_obj is None and not os.path.exists(region.mmap_path)

    region = make_region(kv, 2, 4)
    w = BlockswapOffloadingWorker(kv, 2, 4, mmap_region=region, backend="host")
    real = handler_module.CpuGpuHandlers.shutdown

    def timed_out(self: Any) -> None:
        real(self)
        self.memory_kept = True

    monkeypatch.setattr(handler_module.CpuGpuHandlers, "shutdown", timed_out)
    w.shutdown()
    assert region.mmap_obj is not None and region in plugin._kept_regions
    plugin._kept_regions.remove(region)
    region.cleanup()


@pytest.mark.cuda
def test_load_waits_for_pending_compute_stream_writes() -> None:
    """vLLM's test of the same name, on a shared region: a load lands after the writes already
    queued on the compute stream to its GPU blocks (a delayed zeroing of freshly allocated
    blocks), not before them."""
    page, n, loaded, sentinel = 128 * 1024, 64, list(range(32)), 0x5A
    gpu = torch.zeros((n, page), dtype=torch.int8, device="cuda")
    ids = torch.tensor(loaded, dtype=torch.long, device="cuda")
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(gpu, page)], [[CanonicalKVCacheRef(0, page)]])
    region = make_region(kv, 1, n)
    w = BlockswapOffloadingWorker(kv, 1, n, mmap_region=region, backend="cuda")
    base = region.base_tensor.data_ptr()
    try:
        # Page-locked by the worker through the driver (vLLM's own flag stays unset: its
        # cleanup unpins only what vLLM pinned).
        assert _core.cuda_memory_kind(base) == "host"
        w.cpu_tensors[0].fill_(sentinel)
        for trial in range(3):
            gpu.fill_(0x11)
            torch.cuda.synchronize()
            torch.cuda._sleep(50_000_000)
            gpu.index_fill_(0, ids, 0)
            spec = GPULoadStoreSpec(loaded, group_sizes=(len(loaded),), block_indices=(0,))
            assert w.submit_load(trial + 1, CPULoadStoreSpec(loaded), spec)
            wait_one(w, trial + 1)
            torch.cuda.synchronize()
            got = gpu.cpu()
            assert (got[loaded] == sentinel).all(), f"trial {trial}: the zeroing overwrote the load"
            assert (got[32:] == 0x11).all()
    finally:
        w.shutdown()
    assert region.mmap_obj is None  # released as vLLM releases it, unpinned first
