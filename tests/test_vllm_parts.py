"""A vLLM job the engine cannot take as one transfer (more copies than ``max_descriptors``) is
issued in parts and reported once, with the bytes an unsplit job moves (``_vllm_parts.py``)."""

from __future__ import annotations

import math
import random

import pytest
import torch

pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed")
from vllm.v1.kv_offload.base import GPULoadStoreSpec

from blockswap._vllm_parts import halves
from blockswap.vllm import BlockswapOffloadingWorker
from test_vllm import (
    BPC,
    DEVICES,
    N_CHUNKS,
    N_GPU,
    CPULoadStoreSpec,
    backend_of,
    caches,
    per_group,
)


def jobs(seed: int, count: int) -> list[tuple[list[list[int]], list[int], list[int]]]:
    """Random jobs over the three groups of ``caches()`` (the third has no layer): per group
    distinct GPU blocks, a first block index, and the groups' CPU chunks."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        free = rng.sample(range(N_GPU), N_GPU)
        n0, n1 = rng.randint(1, 9), rng.randint(0, 9)
        ids = [free[:n0], free[n0 : n0 + n1], []]
        starts = [rng.randint(0, 50) for _ in range(3)]
        need = sum(math.ceil((s % BPC + len(i)) / BPC) if i else 0 for i, s in zip(ids, starts))
        out.append((ids, starts, rng.sample(range(N_CHUNKS), need)))
    return out


def gpu_spec(ids: list[list[int]], starts: list[int]) -> GPULoadStoreSpec:
    return GPULoadStoreSpec([b for g in ids for b in g], [len(g) for g in ids], starts)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["dma", "auto"])
def test_a_job_past_max_descriptors_moves_in_parts_as_one_job(path: str, device: str) -> None:
    """Stores and loads of up to 18 blocks of three tensors (one named by two groups) through a
    worker whose engine carries 4 copies a transfer, beside one that carries them whole: every
    job is accepted and reported once, successful, with vLLM's byte count, and the CPU cache and
    the GPU tensors end byte for byte as the unsplit worker's."""
    kv_a, ts_a = caches(seed=3, device=device)
    kv_b, ts_b = caches(seed=3, device=device)
    backend = backend_of(device)
    small = BlockswapOffloadingWorker(kv_a, BPC, N_CHUNKS, backend=backend, path=path,
                                      max_descriptors=4)  # fmt: skip
    whole = BlockswapOffloadingWorker(kv_b, BPC, N_CHUNKS, backend=backend, path=path)
    try:
        work = jobs(seed=5, count=12)
        for job, (ids, starts, chunks) in enumerate(work):
            for w in (small, whole):
                assert w.submit_store(job, gpu_spec(ids, starts), CPULoadStoreSpec(chunks))
        for w in (small, whole):
            w.wait(set(range(len(work))))
        assert small.cpu_cache is not None and whole.cpu_cache is not None
        assert torch.equal(small.cpu_cache, whole.cpu_cache)
        for t in ts_a + ts_b:
            t.zero_()
        for job, (ids, starts, chunks) in enumerate(work):
            for w in (small, whole):
                assert w.submit_load(100 + job, CPULoadStoreSpec(chunks), gpu_spec(ids, starts))
        for w in (small, whole):
            w.wait({100 + j for j in range(len(work))})
        for a, b in zip(ts_a, ts_b):
            assert torch.equal(a, b)
        results = [{r.job_id: r for r in w.get_finished()} for w in (small, whole)]
        assert sorted(results[0]) == sorted(results[1])
        assert len(results[0]) == 2 * len(work)
        for job, r in results[0].items():
            assert r.success and r.transfer_size == results[1][job].transfer_size > 0, job
        stats = small.handlers[0].engine.stats()
        issued = stats["d2h"]["transfers"] + stats["h2d"]["transfers"]
        assert issued > 2 * len(work), "no job was cut in parts"
        assert small._split.jobs == {} and small._split.part_of == {}
        assert small.get_finished() == []
    finally:
        small.shutdown()
        whole.shutdown()


def test_a_job_whose_least_part_cannot_fit_is_refused_and_forgotten() -> None:
    """Where one block's copies pass ``max_descriptors`` no part can be issued: the job is
    refused (False), nothing of it is reported or kept, and the worker goes on."""
    kv, _ = caches(seed=1)
    w = BlockswapOffloadingWorker(kv, BPC, N_CHUNKS, backend="host", path="dma", max_descriptors=1)
    try:
        ids, starts = [[0, 1, 2, 3, 4], [], []], [0, 0, 0]
        assert not w.submit_store(7, gpu_spec(ids, starts), CPULoadStoreSpec([0, 1]))
        assert w.get_finished() == [] and w._split.jobs == {} and w._split.part_of == {}
        assert w.submit_store(8, GPULoadStoreSpec([], [0, 0, 0], [0, 0, 0]), CPULoadStoreSpec([]))
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(8, True)]
    finally:
        w.shutdown()


def test_halves_cut_each_group_near_its_middle_as_vllm_maps_chunks() -> None:
    """A group is cut at the chunk boundary nearest its middle, else at its middle block (both
    parts then name the chunk cut); each part names exactly the chunks its blocks lie in
    (vLLM's rule); groups of one block are split between the parts; one block has no halves."""
    ids, starts = [[10, 11, 12, 13, 14, 15, 16], [20, 21], []], [3, 6, 0]
    chunks = per_group(ids, [0, 1, 2, 3], starts)  # sub-blocks 3-9 in 3 chunks; 6-7 in 1
    first, second = halves(gpu_spec(ids, starts), [c for g in chunks for c in g], BPC) or ()
    assert first[0].block_ids.tolist() == [10, 11, 12, 13, 14, 20]
    assert (first[0].group_sizes, first[0].block_indices) == ([5, 1, 0], [3, 6, 0])
    assert first[1].tolist() == [0, 1, 3]
    assert second[0].block_ids.tolist() == [15, 16, 21]
    assert (second[0].group_sizes, second[0].block_indices[:2]) == ([2, 1, 0], [8, 7])
    assert second[1].tolist() == [2, 3]
    one_each = halves(gpu_spec([[1], [3], []], [4, 1, 0]), [0, 1], BPC)
    assert one_each is not None
    assert [p[0].group_sizes for p in one_each] == [[1, 0, 0], [0, 1, 0]]
    assert [p[1].tolist() for p in one_each] == [[0], [1]]
    assert halves(gpu_spec([[1], [], []], [4, 0, 0]), [0], BPC) is None
