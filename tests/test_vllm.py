"""The vLLM plug-in's worker against vLLM's own types (``vllm.v1.kv_offload.base``), on the host
backend: CPU tensors stand in for the GPU KV cache. Every byte is checked against a reference of
vLLM's block mapping (its ``compute_sub_block_ptrs``: sub-block ``j`` of chunk ``c`` is GPU-block
slot ``c * blocks_per_chunk + j``; per group, ``block_indices[g] % blocks_per_chunk`` sub-blocks
of the first chunk are skipped in both directions)."""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

base = pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed")
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    CanonicalPageMapping,
    GPULoadStoreSpec,
    TransferResult,
)

from blockswap.vllm import BlockswapOffloadingWorker  # noqa: E402

BPC = 4  # GPU blocks per CPU chunk
N_GPU = 24
N_CHUNKS = 10


class CPULoadStoreSpec:
    """vLLM's ``CPULoadStoreSpec`` (``vllm.v1.kv_offload.cpu.common``) as the worker reads it:
    chunk ids in ``block_ids``. (Its module imports most of vLLM.)"""

    def __init__(self, block_ids: list[int]) -> None:
        self.block_ids = np.array(block_ids, dtype=np.int32)


def caches(seed: int = 0) -> tuple[CanonicalKVCaches, list[torch.Tensor]]:
    """Three tensors: two per-layer tensors of 256-byte rows whose pages are 192 bytes (padded),
    and one of 1,024-byte rows. Group 0 uses tensors 0 and 1; group 1 tensor 2 (a cross-layer
    page) and, like a hybrid model's shared tensor, tensor 1 again with a 128-byte page; group 2
    has no layer (an attention-free group)."""
    gen = torch.Generator().manual_seed(seed)
    rows = [256, 256, 1024]
    ts = [torch.randint(-128, 128, (N_GPU, r), dtype=torch.int8, generator=gen) for r in rows]
    kv = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, r) for t, r in zip(ts, rows)],
        group_data_refs=[
            [CanonicalKVCacheRef(0, 192), CanonicalKVCacheRef(1, 192)],
            [CanonicalKVCacheRef(2, 1024), CanonicalKVCacheRef(1, 128)],
            [],
        ],
    )
    return kv, ts


PAGES = [[(0, 192), (1, 192)], [(2, 1024), (1, 128)], []]


def slots(ids: list[int], chunks: list[int], start: int) -> list[int]:
    """vLLM's sub-block of each GPU block: ``len(ids)`` from ``start % BPC`` into ``chunks``."""
    skip = start % BPC
    assert len(chunks) == (math.ceil((skip + len(ids)) / BPC) if ids else 0)
    return [chunks[(skip + i) // BPC] * BPC + (skip + i) % BPC for i in range(len(ids))]


def stored(w: BlockswapOffloadingWorker, t: int, page: int, sub: int) -> torch.Tensor:
    """The bytes the worker's CPU cache holds for tensor ``t``'s page in sub-block ``sub``."""
    handlers = w.handlers[0]
    for g, refs in enumerate(PAGES):
        for i, (tt, p) in enumerate(refs):
            if tt == t and p == page:
                return handlers.cpu_caches[w._groups[g] or 0][i][sub, 0]  # type: ignore[index]
    raise AssertionError("no such page")


@st.composite
def transfer(draw: st.DrawFn) -> tuple[list[list[int]], list[int], list[int]]:
    """Per group, distinct GPU blocks (group 2: none); the groups' chunks; first block
    indices."""
    free = draw(st.permutations(range(N_GPU)))
    n0, n1 = draw(st.integers(0, 6)), draw(st.integers(0, 6))
    ids = [list(free[:n0]), list(free[n0 : n0 + n1]), []]
    starts = [draw(st.integers(0, 50)) for _ in range(3)]
    need = [math.ceil((s % BPC + len(i)) / BPC) if i else 0 for i, s in zip(ids, starts)]
    chunks = draw(st.permutations(range(N_CHUNKS)))[: sum(need)]
    return ids, list(chunks), starts


def spec_of(ids: list[list[int]], starts: list[int]) -> GPULoadStoreSpec:
    return GPULoadStoreSpec([b for g in ids for b in g], [len(g) for g in ids], starts)


def per_group(ids: list[list[int]], chunks: list[int], starts: list[int]) -> list[list[int]]:
    out, c = [], 0
    for g, s in zip(ids, starts):
        m = math.ceil((s % BPC + len(g)) / BPC) if g else 0
        out.append(chunks[c : c + m])
        c += m
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(t=transfer(), expedited=st.booleans())
def test_store_then_load_moves_vllms_sub_blocks(
    t: tuple[list[list[int]], list[int], list[int]], expedited: bool
) -> None:
    ids, chunks, starts = t
    kv, ts = caches()
    w = BlockswapOffloadingWorker(kv, BPC, N_CHUNKS, backend="host")
    try:
        before = [x.clone() for x in ts]
        assert w.submit_store(1, spec_of(ids, starts), CPULoadStoreSpec(chunks)) is True
        w.wait({1})
        (r,) = w.get_finished()
        assert isinstance(r, TransferResult) and (r.job_id, r.success) == (1, True)
        assert r.transfer_size == sum(p * len(g) for g, refs in zip(ids, PAGES) for _, p in refs)
        subs = [slots(g, c, s) for g, c, s in zip(ids, per_group(ids, chunks, starts), starts)]
        for g, refs in enumerate(PAGES):
            for tensor, page in refs:
                for b, sub in zip(ids[g], subs[g]):
                    assert torch.equal(stored(w, tensor, page, sub), before[tensor][b, :page])

        # Load them back into other blocks (the model's blocks cleared first).
        taken = {b for g in ids for b in g}
        others = [b for b in range(N_GPU) if b not in taken]
        back, k = [], 0
        for g in ids:
            back.append(others[k : k + len(g)])
            k += len(g)
        for x in ts:
            x.zero_()
        ok = w.submit_load(2, CPULoadStoreSpec(chunks), spec_of(back, starts), expedited=expedited)
        assert ok is True
        w.wait({2})
        (r,) = w.get_finished()
        assert (r.job_id, r.success) == (2, True)
        for g, refs in enumerate(PAGES):
            for tensor, page in refs:
                for src, dst in zip(ids[g], back[g]):
                    assert torch.equal(ts[tensor][dst, :page], before[tensor][src, :page])
        # Only the pages were written: padding and every other block are still zero.
        written = {
            (tensor, b) for g, refs in enumerate(PAGES) for tensor, _ in refs for b in back[g]
        }
        for tensor, x in enumerate(ts):
            for b in range(N_GPU):
                page = max((p for g, refs in enumerate(PAGES) for tt, p in refs
                            if tt == tensor and b in back[g]), default=0)  # fmt: skip
                assert not x[b, page:].any()
                if (tensor, b) not in written:
                    assert not x[b].any()
    finally:
        w.shutdown()


def test_a_bad_spec_is_a_false_return_not_an_exception(caplog: pytest.LogCaptureFixture) -> None:
    kv, _ = caches()
    w = BlockswapOffloadingWorker(kv, BPC, N_CHUNKS, backend="host")
    try:
        good = spec_of([[0, 1], [2], []], [0, 0, 0])
        cases: list[tuple[Any, Any]] = [
            (good, CPULoadStoreSpec([0])),  # one chunk short (group 1 needs its own)
            (good, CPULoadStoreSpec([0, 1, 2])),  # one too many
            (good, CPULoadStoreSpec([0, N_CHUNKS])),  # out of range
            (spec_of([[0, 0], [2], []], [0, 0, 0]), CPULoadStoreSpec([0, 1])),  # store: fine
            (GPULoadStoreSpec([0], [1], [0]), CPULoadStoreSpec([0])),  # one group of three
            (spec_of([[0], [], [5]], [0, 0, 0]), CPULoadStoreSpec([0, 1])),  # pages in group 2
        ]
        results = [w.submit_store(10 + i, gpu, cpu) for i, (gpu, cpu) in enumerate(cases)]
        assert results == [False, False, False, True, False, False]
        # A load into one GPU block twice is refused; one into distinct blocks runs.
        twice = spec_of([[3, 3], [], []], [0, 0, 0])
        assert w.submit_load(20, CPULoadStoreSpec([0]), twice) is False
        assert "more than once" in caplog.text and "out of range" in caplog.text
        w.wait({13})
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(13, True)]
    finally:
        w.shutdown()


def test_canonical_layout_and_empty_caches_are_refused_by_name() -> None:
    kv, _ = caches()
    mapping = CanonicalPageMapping(192, 192, (), 1, 0, True)
    kv.group_data_refs[0][0] = CanonicalKVCacheRef(0, 192, mapping)
    with pytest.raises(ValueError, match="canonical_layout"):
        BlockswapOffloadingWorker(kv, BPC, N_CHUNKS, backend="host")
    kv, _ = caches()
    with pytest.raises(ValueError, match="cpu_bytes_to_use"):
        BlockswapOffloadingWorker(kv, BPC, 0, backend="host")
    kv.group_data_refs = [[], []]
    with pytest.raises(ValueError, match="nothing to offload"):
        BlockswapOffloadingWorker(kv, BPC, N_CHUNKS, backend="host")


def test_expedited_loads_run_on_their_own_engine() -> None:
    kv, _ = caches()
    w = BlockswapOffloadingWorker(kv, BPC, N_CHUNKS, backend="host")
    try:
        main, expedited = w.handlers
        assert main.engine is not expedited.engine
        spec = spec_of([[4], [], []], [0, 0, 0])
        assert w.submit_load(1, CPULoadStoreSpec([2]), spec, expedited=True) is True
        w.wait({1})
        assert [r.job_id for r in w.get_finished()] == [1]
        assert main.stats()["h2d"]["transfers"] == 0
        assert expedited.stats()["h2d"]["transfers"] == 1
    finally:
        w.shutdown()


def test_without_vllm_the_import_names_the_install_command() -> None:
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "try:\n    import blockswap.vllm\nexcept ModuleNotFoundError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install 'vllm>=0.33'" in out.stdout
