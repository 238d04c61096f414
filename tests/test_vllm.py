"""The vLLM plug-in's worker against vLLM's own types (``vllm.v1.kv_offload.base``), on the host
backend (CPU tensors stand in for the GPU KV cache) and, marked ``cuda``, on the GPU. Every byte is checked against a reference of
vLLM's block mapping (its ``compute_sub_block_ptrs``: sub-block ``j`` of chunk ``c`` is GPU-block
slot ``c * blocks_per_chunk + j``; per group, ``block_indices[g] % blocks_per_chunk`` sub-blocks
of the first chunk are skipped in both directions)."""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

base = pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed")
from vllm.v1.kv_offload.base import (  # noqa: E402
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    CanonicalPageMapping,
    CopyRun,
    GPULoadStoreSpec,
    TransferResult,
)

from blockswap import ConfigError  # noqa: E402
from blockswap.vllm import BlockswapOffloadingWorker  # noqa: E402
from blockswap_bench.models import MODELS as CATALOGUE  # noqa: E402

BPC = 4  # GPU blocks per CPU chunk
N_GPU = 24
N_CHUNKS = 10
#: Where the "GPU" KV cache lives, and the backend that moves it.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def backend_of(device: str) -> str:
    return "host" if device == "cpu" else "cuda"


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """vLLM's ``CPULoadStoreSpec`` (``vllm.v1.kv_offload.cpu.common``, whose module imports most
    of vLLM; ``tests/test_vllm_spec.py`` uses the real one): chunk ids in ``block_ids``."""


def caches(seed: int = 0, device: str = "cpu") -> tuple[CanonicalKVCaches, list[torch.Tensor]]:
    """Three tensors: two per-layer tensors of 256-byte rows whose pages are 192 bytes (padded),
    and one of 1,024-byte rows. Group 0 uses tensors 0 and 1; group 1 tensor 2 (a cross-layer
    page) and, like a hybrid model's shared tensor, tensor 1 again with a 128-byte page; group 2
    has no layer (an attention-free group)."""
    gen = torch.Generator().manual_seed(seed)
    rows = [256, 256, 1024]
    ts = [
        torch.randint(-128, 128, (N_GPU, r), dtype=torch.int8, generator=gen).to(device)
        for r in rows
    ]
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
    for g, refs in enumerate(PAGES):
        for i, (tt, p) in enumerate(refs):
            if tt == t and p == page:
                return sub_block_of(w, g, i, sub)
    raise AssertionError("no such page")


def no_general_path(w: BlockswapOffloadingWorker) -> None:
    """Takes the general path (the handlers' ``transfer_async`` and the core's
    ``submit_groups``) away from ``w``'s handlers: every good spec with one writer a group
    reaches the core in one call (``submit_group`` for one handler group, else
    ``submit_spec``)."""

    def general(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the general path")

    for hs in w.handlers:
        for h in hs.handlers:
            h._submit_groups = general  # type: ignore[method-assign]
            h.transfer_async = general  # type: ignore[method-assign]


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


def two_ranks(target: Any, *args: Any, timeout: float = 180) -> list[tuple[Any, ...]]:
    """Runs ``target(rank, *args, barrier, out)`` for ranks 0 and 1, each in a spawned process
    sharing a two-party barrier; returns what each put on ``out`` (``(rank, error or None,
    ...)``), sorted by rank, once both exited cleanly without an error."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, barrier, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = sorted(out.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
    for rank, err, *_ in results:
        assert err is None, f"rank {rank}: {err}"
    assert all(p.exitcode == 0 for p in procs)
    return results


@pytest.mark.parametrize("device", DEVICES)
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(t=transfer(), expedited=st.booleans())
def test_store_then_load_moves_vllms_sub_blocks(
    device: str, t: tuple[list[list[int]], list[int], list[int]], expedited: bool
) -> None:
    ids, chunks, starts = t
    kv, ts = caches(device=device)
    w = BlockswapOffloadingWorker(kv, BPC, N_CHUNKS, backend=backend_of(device))
    try:
        no_general_path(w)  # three groups: the core cuts the spec (`submit_spec`)
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
                    want = before[tensor][b, :page].cpu()
                    assert torch.equal(stored(w, tensor, page, sub), want)

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


@pytest.mark.parametrize("device", DEVICES)
def test_a_bad_spec_is_a_false_return_not_an_exception(
    device: str, caplog: pytest.LogCaptureFixture
) -> None:
    kv, _ = caches(device=device)
    w = BlockswapOffloadingWorker(kv, BPC, N_CHUNKS, backend=backend_of(device))
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


def refuses_bad_specs_on_the_plain_path(
    w: BlockswapOffloadingWorker,
    bpc: int,
    n_chunks: int,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``w`` (one KV-cache group of 24 GPU blocks, ``bpc`` blocks a chunk, ``n_chunks`` chunks)
    takes the plain path, its handlers' ``transfer_async`` never called from here on, and
    refuses bad specs there with the general path's words."""
    assert w._map.plain is not None  # the path under test
    for h in w.handlers[0].handlers:

        def general(*args: Any, **kwargs: Any) -> bool:
            raise AssertionError("the plain path reads vLLM's specs itself")

        monkeypatch.setattr(h, "transfer_async", general)
    n = 2 * bpc
    ids = list(range(n))
    cases: list[tuple[Any, Any, str]] = [
        (GPULoadStoreSpec(ids, [n], [0]), CPULoadStoreSpec([0]), "CPU chunks"),
        (GPULoadStoreSpec(ids, [n], [0]), CPULoadStoreSpec([0, 1, 2]), "CPU chunks"),
        (GPULoadStoreSpec(ids, [n], [0]), CPULoadStoreSpec([0, n_chunks]), "range"),
        (GPULoadStoreSpec([0, 99], [2], [0]), CPULoadStoreSpec([0] * (1 + (bpc < 2))), "range"),
        (GPULoadStoreSpec([0], [1, 0], [0, 0]), CPULoadStoreSpec([0]), "2 group sizes"),
        (GPULoadStoreSpec([0], [1], [-1]), CPULoadStoreSpec([0]), "from block index -1"),
    ]
    for i, (gpu, cpu, why) in enumerate(cases):
        caplog.clear()
        assert w.submit_store(10 + i, gpu, cpu) is False, i
        assert why in caplog.text, (i, caplog.text)


@pytest.mark.parametrize("bpc", [1, 4])
def test_one_group_bad_specs_are_refused_on_the_plain_path(
    bpc: int, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One KV-cache group, one writer: the worker makes the core's one group from vLLM's specs
    itself (the ids go to the engine as vLLM gave them, int32), not through the handler's
    ``transfer_async``; the same specs are refused as on the general path, and a good one after
    them moves its blocks."""
    kv, ts = page_of_4_tensors(3, 24)
    w = BlockswapOffloadingWorker(kv, bpc, N_CHUNKS, backend="host")
    try:
        refuses_bad_specs_on_the_plain_path(w, bpc, N_CHUNKS, caplog, monkeypatch)
        n = 2 * bpc
        gpu = GPULoadStoreSpec(list(range(5, 5 + n)), [n], [0])
        assert w.submit_store(30, gpu, CPULoadStoreSpec([3, 1])) is True
        w.wait({30})
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(30, True)]
        for t in range(4):
            for k in range(n):
                chunk, sub = (3, 1)[k // bpc], k % bpc
                got = sub_block_of(w, 0, t, chunk * bpc + sub)
                assert torch.equal(got, ts[t][5 + k]), (t, k)
        # A spec naming no block: reported at once, nothing submitted.
        assert w.submit_store(31, GPULoadStoreSpec([], [0], [0]), CPULoadStoreSpec([])) is True
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(31, True)]
        # After shutdown the handler refuses, and the worker returns False.
        w.shutdown()
        caplog.clear()
        assert w.submit_store(32, gpu, CPULoadStoreSpec([3, 1])) is False
        assert "shut down" in caplog.text
    finally:
        w.shutdown()


@pytest.mark.parametrize("bpc", [1, 4])
def test_the_usual_spec_goes_to_the_core_in_one_call(
    bpc: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One KV-cache group, one writer, one block index: a store and a load reach the core's
    ``submit_group`` (which wakes the engine's thread and works out the skip), with the
    handlers' general entries taken away; partial first and last chunks included."""
    kv, ts = page_of_4_tensors(3, 24)
    w = BlockswapOffloadingWorker(kv, bpc, N_CHUNKS, backend="host")
    try:
        for h in w.handlers[0].handlers:

            def general(*args: Any) -> None:
                raise AssertionError("the general path")

            monkeypatch.setattr(h, "_submit_groups", general)
            monkeypatch.setattr(h, "wake", general)
        n = 2 * bpc + 1
        start = 1 if bpc > 1 else 0  # a request's block 1 on: the first chunk is partial
        chunks = [3, 1, 6][: math.ceil((start % bpc + n) / bpc)]
        gpu = GPULoadStoreSpec(list(range(5, 5 + n)), [n], [start])
        assert w.submit_store(40, gpu, CPULoadStoreSpec(chunks)) is True
        w.wait({40})
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(40, True)]
        for t in range(4):
            for k in range(n):
                chunk, sub = divmod(start % bpc + k, bpc)
                got = sub_block_of(w, 0, t, chunks[chunk] * bpc + sub)
                assert torch.equal(got, ts[t][5 + k]), (t, k)
        # And back into other GPU blocks, the same request positions.
        dst = GPULoadStoreSpec(list(range(24 - n, 24)), [n], [start])
        assert w.submit_load(41, CPULoadStoreSpec(chunks), dst) is True
        w.wait({41})
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(41, True)]
        for t in range(4):
            assert torch.equal(ts[t][24 - n :], ts[t][5 : 5 + n]), t
    finally:
        w.shutdown()


def test_references_with_canonical_mappings_keep_the_direct_layout() -> None:
    """vLLM 0.33's connector gives every layer it can certify a ``CanonicalPageMapping``,
    whatever layout was asked for (``derive_canonical_mappings`` in its offloading worker), and
    its CPU worker reads them only for ``canonical_layout``: the worker moves the same bytes to
    the same places with or without them."""
    ids, chunks, starts = [[3, 9, 4], [7, 1], []], [2, 5], [1, 2, 0]
    stores = []
    for mapped in (False, True):
        kv, ts = caches()
        if mapped:
            # Halves of each page swapped in a canonical page twice as large: where the mapping
            # read, the bytes would land elsewhere.
            for group in kv.group_data_refs:
                for i, r in enumerate(group):
                    half = r.page_size_bytes // 2
                    runs = (CopyRun(0, 3 * half, half, 1, half, half),
                            CopyRun(half, 0, half, 1, half, half))  # fmt: skip
                    m = CanonicalPageMapping(4 * half, 2 * half, runs, 1, 0, True)
                    group[i] = CanonicalKVCacheRef(r.tensor_idx, r.page_size_bytes, m)
        w = BlockswapOffloadingWorker(kv, BPC, N_CHUNKS, backend="host")
        try:
            assert w.submit_store(1, spec_of(ids, starts), CPULoadStoreSpec(chunks)) is True
            w.wait({1})
            assert [r.success for r in w.get_finished()] == [True]
            assert w.cpu_cache is not None
            stores.append(w.cpu_cache.clone())
            back = [[0, 2, 5], [6, 8], []]
            for x in ts:
                x.zero_()
            assert w.submit_load(2, CPULoadStoreSpec(chunks), spec_of(back, starts)) is True
            w.wait({2})
            assert [r.success for r in w.get_finished()] == [True]
            before = caches()[1]
            for g, refs in enumerate(PAGES):
                for tensor, page in refs:
                    for src, dst in zip(ids[g], back[g]):
                        assert torch.equal(ts[tensor][dst, :page], before[tensor][src, :page])
        finally:
            w.shutdown()
    assert stores[1].any() and torch.equal(stores[0], stores[1])


def test_empty_caches_are_refused_by_name() -> None:
    kv, _ = caches()
    with pytest.raises(ValueError, match="cpu_bytes_to_use"):
        BlockswapOffloadingWorker(kv, BPC, 0, backend="host")
    kv.group_data_refs = [[], []]
    with pytest.raises(ValueError, match="nothing to offload"):
        BlockswapOffloadingWorker(kv, BPC, N_CHUNKS, backend="host")


def test_strided_layer_views_are_refused_with_their_strides() -> None:
    """A packed layout under HiSparse: vLLM hands over each layer as a strided view of the
    blocks that interleave all layers. Not taken yet: refused, saying so, before anything is
    allocated."""
    packed = torch.zeros(N_GPU, 2, 256, dtype=torch.int8)  # two layers interleaved per block
    views = [packed[:, j] for j in range(2)]
    kv = CanonicalKVCaches(
        [CanonicalKVCacheTensor(v, 256) for v in views],
        [[CanonicalKVCacheRef(0, 256), CanonicalKVCacheRef(1, 256)]],
    )
    with pytest.raises(ValueError, match=r"tensor 0 is not contiguous \(strides \(512, 1\)\)"):
        BlockswapOffloadingWorker(kv, BPC, N_CHUNKS, backend="host")


def test_a_tensor_of_no_whole_number_of_pages_is_refused_by_name() -> None:
    kv = CanonicalKVCaches(
        [CanonicalKVCacheTensor(torch.zeros(8, 300, dtype=torch.int8), 256)],
        [[CanonicalKVCacheRef(0, 256)]],
    )
    with pytest.raises(ConfigError, match="KV-cache tensor 0 holds 2400 bytes, not a whole"):
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


# ---- vLLM's own worker tests (tests/v1/kv_offload/cpu/test_gpu_worker.py), ported ---------------


def sub_block_of(w: BlockswapOffloadingWorker, group: int, ref: int, sub: int) -> torch.Tensor:
    """The CPU cache's copy of the page of ``group``'s ``ref``-th tensor in sub-block ``sub``
    (a tensor appears at most once per group in these tests)."""
    hg = w._groups[group]
    assert hg is not None
    return w.handlers[0].cpu_caches[hg][ref][sub, 0]  # type: ignore[index]


def run(
    w: BlockswapOffloadingWorker, kv: CanonicalKVCaches, job: int, store: bool, gpu: Any, cpu: Any
) -> None:
    """One store or load, waited for; its result is checked against the spec."""
    ok = w.submit_store(job, gpu, cpu) if store else w.submit_load(job, cpu, gpu)
    assert ok is True
    w.wait({job})
    (r,) = w.get_finished()
    assert (r.job_id, r.success) == (job, True)
    assert r.transfer_size == sum(
        n * sum(ref.page_size_bytes for ref in refs)
        for n, refs in zip(gpu.group_sizes, kv.group_data_refs)
    )
    assert r.transfer_time >= 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gpu_to_cpu", [True, False])
@pytest.mark.parametrize("page", [512, 1024])
@pytest.mark.parametrize("bpc", [1, 3])
def test_vllm_transfer(device: str, gpu_to_cpu: bool, page: int, bpc: int) -> None:
    """vLLM's ``test_transfer``: 4 tensors of one group, 3 chunks of ``bpc`` blocks, the first
    ``bpc - 1`` sub-blocks skipped (reading or writing from the middle of a CPU chunk)."""
    gen = torch.Generator().manual_seed(page * 10 + bpc)
    n_gpu, n_cpu, n_tensors, n_map = 64, 256, 4, 3
    ts = [
        torch.randint(-128, 128, (n_gpu, page), dtype=torch.int8, generator=gen).to(device)
        for _ in range(n_tensors)
    ]
    kv = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, page) for t in ts],
        group_data_refs=[[CanonicalKVCacheRef(i, page) for i in range(n_tensors)]],
    )
    w = BlockswapOffloadingWorker(kv, bpc, n_cpu, backend=backend_of(device))
    try:
        perm = torch.randperm(n_gpu, generator=gen).tolist()
        gpu_blocks = perm[: n_map * bpc]
        cpu_blocks = torch.randperm(n_cpu, generator=gen)[:n_map].tolist()
        expanded = [c * bpc + j for c in cpu_blocks for j in range(bpc)]
        skip = bpc - 1
        gpu_blocks, expanded = gpu_blocks[skip:], expanded[skip:]
        spec = GPULoadStoreSpec(gpu_blocks, group_sizes=(len(gpu_blocks),), block_indices=(skip,))
        cpu = w.handlers[0].cpu_caches[0]
        # The CPU cache holds random bytes too, so a copy that lands nowhere would show.
        for layer in cpu:  # type: ignore[union-attr]
            layer.copy_(torch.randint(-128, 128, layer.shape, dtype=torch.int8, generator=gen))
        cpu_before = [x.clone() for x in cpu]  # type: ignore[union-attr]
        gpu_before = [t.clone() for t in ts]
        run(w, kv, 1, gpu_to_cpu, spec, CPULoadStoreSpec(cpu_blocks))
        if gpu_to_cpu:
            dst_to_src = dict(zip(expanded, gpu_blocks))
            for i in range(n_tensors):
                assert torch.equal(ts[i], gpu_before[i])  # the source is untouched
                for sub in range(n_cpu * bpc):
                    src = dst_to_src.get(sub)
                    want = gpu_before[i][src].cpu() if src is not None else cpu_before[i][sub, 0]
                    assert torch.equal(sub_block_of(w, 0, i, sub), want), (i, sub)
        else:
            dst_to_src = dict(zip(gpu_blocks, expanded))
            for i in range(n_tensors):
                assert torch.equal(cpu[i], cpu_before[i])  # type: ignore[index]
                got = ts[i].cpu()
                for b in range(n_gpu):
                    src = dst_to_src.get(b)
                    want = cpu_before[i][src, 0] if src is not None else gpu_before[i][b].cpu()
                    assert torch.equal(got[b], want), (i, b)
    finally:
        w.shutdown()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gpu_to_cpu", [True, False])
@pytest.mark.parametrize("page", [512, 1024])
@pytest.mark.parametrize("bpc", [1, 3])
def test_vllm_transfer_multi_group(device: str, gpu_to_cpu: bool, page: int, bpc: int) -> None:
    """vLLM's ``test_transfer_multi_group``: three groups of two tensors; group 0 aligned,
    group 1 empty, group 2 offset at both ends (its first and last chunk partial)."""
    gen = torch.Generator().manual_seed(page + bpc)
    n_gpu, n_cpu, per_group, n_map = 64, 256, 2, 2
    ts = [
        torch.randint(-128, 128, (n_gpu, page), dtype=torch.int8, generator=gen).to(device)
        for _ in range(3 * per_group)
    ]
    kv = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, page) for t in ts],
        group_data_refs=[
            [CanonicalKVCacheRef(g * per_group + i, page) for i in range(per_group)]
            for g in range(3)
        ],
    )
    w = BlockswapOffloadingWorker(kv, bpc, n_cpu, backend=backend_of(device))
    try:
        sizes = [n_map, 0, n_map]  # in chunks
        gpu_g, cpu_g, exp_g, skip = three_group_mapping(gen, sizes, bpc, n_gpu, n_cpu)
        spec = GPULoadStoreSpec(
            [b for g in gpu_g for b in g], [len(g) for g in gpu_g], [0, 0, skip]
        )
        cpu_spec = CPULoadStoreSpec([x for cs in cpu_g for x in cs])
        cpu_views = {
            (g, i): w.handlers[0].cpu_caches[hg][i]  # type: ignore[index]
            for g, hg in enumerate(w._groups)
            if hg is not None
            for i in range(per_group)
        }
        for v in cpu_views.values():
            v.copy_(torch.randint(-128, 128, v.shape, dtype=torch.int8, generator=gen))
        cpu_before = {k: v.clone() for k, v in cpu_views.items()}
        gpu_before = [t.clone() for t in ts]
        run(w, kv, 1, gpu_to_cpu, spec, cpu_spec)
        for g in (0, 2):
            for i in range(per_group):
                t = g * per_group + i
                if gpu_to_cpu:
                    m = dict(zip(exp_g[g], gpu_g[g]))
                    for sub in range(n_cpu * bpc):
                        src = m.get(sub)
                        want = (
                            gpu_before[t][src].cpu()
                            if src is not None
                            else cpu_before[g, i][sub, 0]
                        )
                        assert torch.equal(cpu_views[g, i][sub, 0], want), (g, i, sub)
                else:
                    m = dict(zip(gpu_g[g], exp_g[g]))
                    got = ts[t].cpu()
                    for b in range(n_gpu):
                        src = m.get(b)
                        want = (
                            cpu_before[g, i][src, 0] if src is not None else gpu_before[t][b].cpu()
                        )
                        assert torch.equal(got[b], want), (g, i, b)
        # Group 1 (no block in this transfer) is untouched on both sides.
        for i in range(per_group):
            assert torch.equal(ts[per_group + i], gpu_before[per_group + i])
            assert torch.equal(cpu_views[1, i], cpu_before[1, i])
    finally:
        w.shutdown()


# ---- GPU only: ordering against the compute stream, real models' caches ----------------------


@pytest.mark.cuda
def test_load_waits_for_pending_compute_stream_writes() -> None:
    """vLLM's test of the same name: a load lands after the writes already queued on the compute
    stream to its GPU blocks (a delayed zeroing of freshly allocated blocks), not before them."""
    page, n, loaded, sentinel = 128 * 1024, 64, list(range(32)), 0x5A
    gpu = torch.zeros((n, page), dtype=torch.int8, device="cuda")
    ids = torch.tensor(loaded, dtype=torch.long, device="cuda")
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(gpu, page)], [[CanonicalKVCacheRef(0, page)]])
    w = BlockswapOffloadingWorker(kv, 1, n, backend="cuda")
    try:
        assert w.cpu_cache is not None
        w.cpu_cache.fill_(sentinel)
        for trial in range(3):
            gpu.fill_(0x11)
            torch.cuda.synchronize()
            torch.cuda._sleep(50_000_000)
            gpu.index_fill_(0, ids, 0)
            spec = GPULoadStoreSpec(loaded, group_sizes=(len(loaded),), block_indices=(0,))
            assert w.submit_load(trial + 1, CPULoadStoreSpec(loaded), spec)
            w.wait({trial + 1})
            (r,) = w.get_finished()
            assert r.success
            torch.cuda.synchronize()
            got = gpu.cpu()
            assert (got[loaded] == sentinel).all(), f"trial {trial}: the zeroing overwrote the load"
            assert (got[32:] == 0x11).all()
    finally:
        w.shutdown()


@pytest.mark.cuda
def test_store_waits_for_a_kernel_still_writing_its_blocks() -> None:
    """A store submitted while the compute stream is still writing its GPU blocks copies what
    that write leaves, not what was there before."""
    page, n = 128 * 1024, 64
    gpu = torch.zeros((n, page), dtype=torch.int8, device="cuda")
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(gpu, page)], [[CanonicalKVCacheRef(0, page)]])
    w = BlockswapOffloadingWorker(kv, 1, n, backend="cuda")
    try:
        assert w.cpu_cache is not None
        for trial in range(3):
            gpu.fill_(0x11)
            torch.cuda.synchronize()
            torch.cuda._sleep(50_000_000)
            gpu.fill_(0x22 + trial)  # still queued behind the sleep when the store is submitted
            blocks = list(range(trial, 32 + trial))
            spec = GPULoadStoreSpec(blocks, group_sizes=(32,), block_indices=(0,))
            assert w.submit_store(trial + 1, spec, CPULoadStoreSpec(blocks))
            w.wait({trial + 1})
            (r,) = w.get_finished()
            assert r.success
            assert (w.cpu_cache[blocks] == 0x22 + trial).all(), f"trial {trial}: stale bytes"
    finally:
        w.shutdown()


#: (name, layers, page bytes per layer and block, groups, row padding): the per-rank KV caches
#: of the benchmark catalogue's six models (``blockswap_bench.models``) in vLLM's canonical form
#: (a layer's K and V pages of one block are one page), and one with padded rows. A model with two
#: groups (sliding window and full attention) shares each tensor between one layer of each group,
#: as vLLM's hybrid allocation does.
MODELS = [(m.name, m.layers, m.block_bytes(1), m.groups, 0) for m in CATALOGUE] + [
    ("DeepSeek-V3 (MLA), rows padded by 1 KiB", 61, 64 * 576 * 2, 1, 1024)
]


def model_caches(
    layers: int,
    page: int,
    groups: int,
    cross_layer: bool,
    n_gpu: int,
    pad: int,
    device: str = "cuda",
) -> tuple[CanonicalKVCaches, list[torch.Tensor]]:
    row = page + pad
    if cross_layer:
        t = torch.randint(-128, 128, (n_gpu, layers * page + pad), dtype=torch.int8, device=device)
        return CanonicalKVCaches(
            [CanonicalKVCacheTensor(t, layers * page + pad)],
            [[CanonicalKVCacheRef(0, layers * page)]],
        ), [t]
    n_t = layers // groups
    ts = [
        torch.randint(-128, 128, (n_gpu, row), dtype=torch.int8, device=device) for _ in range(n_t)
    ]
    refs = [[CanonicalKVCacheRef(i, page) for i in range(n_t)] for _ in range(groups)]
    return CanonicalKVCaches([CanonicalKVCacheTensor(t, row) for t in ts], refs), ts


#: Every model per-layer and cross-layer, but a hybrid model (two groups) per-layer only: its
#: groups cannot share one cross-layer tensor.
CASES = [(m, x) for m in MODELS for x in (False, True) if not (x and m[3] > 1)]


@pytest.mark.cuda
@pytest.mark.parametrize("bpc", [1, 4])
@pytest.mark.parametrize(
    ("model", "cross_layer"),
    CASES,
    ids=[f"{m[0]}-{'cross-layer' if x else 'per-layer'}" for m, x in CASES],
)
def test_real_models_caches_round_trip_byte_exact(
    model: tuple[str, int, int, int, int], cross_layer: bool, bpc: int
) -> None:
    """Store random blocks of each group at an offset into random chunks, clear the GPU cache,
    load them into other blocks: every page comes back byte for byte, nothing else is written."""
    name, layers, page, groups, pad = model
    n_gpu, n_chunks = 48, 16
    kv, ts = model_caches(layers, page, groups, cross_layer, n_gpu, pad)
    w = BlockswapOffloadingWorker(kv, bpc, n_chunks, backend="cuda")
    try:
        gen = torch.Generator().manual_seed(layers * bpc)
        perm = torch.randperm(n_gpu, generator=gen).tolist()
        per = 5 if groups == 1 else 4
        ids = [perm[g * per : (g + 1) * per] for g in range(groups)]
        starts = [1 + g for g in range(groups)]
        need = [math.ceil((s % bpc + len(i)) / bpc) for i, s in zip(ids, starts)]
        chunks = torch.randperm(n_chunks, generator=gen)[: sum(need)].tolist()
        before = [t.clone() for t in ts]
        spec = spec_of(ids, starts)
        assert w.submit_store(1, spec, CPULoadStoreSpec(chunks)) is True
        w.wait({1})
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True)]
        taken = {b for g in ids for b in g}
        others = [b for b in range(n_gpu) if b not in taken]
        back = [others[g * per : (g + 1) * per] for g in range(groups)]
        for t in ts:
            t.zero_()
        assert w.submit_load(2, CPULoadStoreSpec(chunks), spec_of(back, starts)) is True
        w.wait({2})
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(2, True)]
        torch.cuda.synchronize()
        p = layers * page if cross_layer else page
        for t, b0 in zip(ts, before):
            got, want = t.cpu(), b0.cpu()
            dsts = {d: s for g in range(groups) for s, d in zip(ids[g], back[g])}
            for b in range(t.shape[0]):
                if b in dsts:
                    assert torch.equal(got[b, :p], want[dsts[b], :p]), (name, b)
                    assert not got[b, p:].any()  # padding is not copied
                else:
                    assert not got[b].any(), (name, b)
    finally:
        w.shutdown()


# ---- the CPU cache in pieces ------------------------------------------------------------------


def page_of_4_tensors(seed: int, n_gpu: int, page: int = 1024, device: str = "cpu") -> Any:
    """Four tensors of one group with pages of ``page`` bytes: a CPU sub-block of ``4 * page``."""
    gen = torch.Generator().manual_seed(seed)
    ts = [
        torch.randint(-128, 128, (n_gpu, page), dtype=torch.int8, generator=gen).to(device)
        for _ in range(4)
    ]
    kv = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, page) for t in ts],
        group_data_refs=[[CanonicalKVCacheRef(i, page) for i in range(4)]],
    )
    return kv, ts


@pytest.mark.parametrize("bpc", [1, 4])
def test_a_cache_in_small_pieces_moves_the_bytes_of_one_registered_whole(
    bpc: int, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker's CPU cache page-locked (on the host backend: recorded) in pieces of 3
    sub-blocks, against one in one piece: stores and loads of consecutive chunks across piece
    boundaries, with offsets at both ends, leave the same bytes in both caches and on both GPUs."""
    n_gpu, n_chunks, row = 48, 10, 4 * 1024
    kv_a, ts_a = page_of_4_tensors(bpc, n_gpu)
    kv_b, ts_b = page_of_4_tensors(bpc, n_gpu)
    whole = BlockswapOffloadingWorker(kv_a, bpc, n_chunks, backend="host")
    with caplog.at_level("INFO", logger="blockswap.vllm"):
        pieces = BlockswapOffloadingWorker(
            kv_b, bpc, n_chunks, backend="host", pin_piece_bytes=3 * row
        )
    try:
        rows = n_chunks * bpc
        assert whole.host_memory is not None and len(whole.host_memory.pieces) == 1
        m = pieces.host_memory
        assert m is not None and m.nbytes == rows * row == pieces.cpu_cache.nbytes  # type: ignore[union-attr]
        assert [n for _, n in m.pieces] == [3 * row] * (rows // 3) + [row] * (rows % 3)
        assert m.users == 2  # the worker's two engines
        n_pieces = -(-rows // 3)
        assert f"in {n_pieces} pieces of at most" in caplog.text
        skip = bpc - 1
        perm = torch.randperm(n_gpu, generator=torch.Generator().manual_seed(7)).tolist()
        moves = [
            # Consecutive chunks over piece boundaries, partial at both ends where bpc > 1.
            (True, list(range(3 * bpc - 2 * skip)), [2, 3, 4], skip),
            (True, perm[: 2 * bpc], [n_chunks - 1, 0], 0),
            (False, perm[10 : 10 + 3 * bpc - 2 * skip], [2, 3, 4], skip),
            (False, perm[20 : 20 + 2 * bpc], [0, n_chunks - 1], 0),
        ]
        for job, (store, gpu, chunks, start) in enumerate(moves):
            spec = GPULoadStoreSpec(gpu, (len(gpu),), (start,))
            for w, kv in ((whole, kv_a), (pieces, kv_b)):
                run(w, kv, job, store, spec, CPULoadStoreSpec(chunks))
            assert torch.equal(whole.cpu_cache, pieces.cpu_cache), job  # type: ignore[arg-type]
            for a, b in zip(ts_a, ts_b):
                assert torch.equal(a, b), job
        # The chunks really hold the stored pages (the comparison is not of two empty caches).
        assert whole.cpu_cache is not None and whole.cpu_cache.any()
        # A piece smaller than a row holds one row, as in vLLM's region.
        kv_c, _ = page_of_4_tensors(bpc, n_gpu)
        small = BlockswapOffloadingWorker(kv_c, bpc, n_chunks, backend="host", pin_piece_bytes=1)
        try:
            assert small.host_memory is not None
            assert [n for _, n in small.host_memory.pieces] == [row] * rows
        finally:
            small.shutdown()
    finally:
        whole.shutdown()
        pieces.shutdown()
    assert pieces.cpu_cache is None and pieces.host_memory is None and m.users == 0


@pytest.mark.cuda
def test_a_6_gib_cache_is_pinned_in_1_gib_pieces_without_rounding(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A CPU cache of 6 GiB page-locked in six registrations of 1 GiB (512 sub-blocks of 2 MiB):
    exactly 6 GiB (torch's pinned allocator would take 8), one log line with the size, the
    pieces and the time; blocks stored into consecutive chunks across a piece boundary come back
    byte for byte."""
    page, n_gpu, bpc = 2 << 20, 64, 4
    n_chunks = (6 << 30) // (page * bpc)  # 768 chunks of 8 MiB
    gen = torch.Generator().manual_seed(6)
    t = torch.randint(-128, 128, (n_gpu, page), dtype=torch.int8, generator=gen).to("cuda")
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(t, page)], [[CanonicalKVCacheRef(0, page)]])
    host_stats = getattr(torch.cuda, "host_memory_stats", None)
    before = host_stats() if host_stats else None
    with caplog.at_level("INFO", logger="blockswap.vllm"):
        w = BlockswapOffloadingWorker(kv, bpc, n_chunks, backend="cuda", pin_piece_bytes=1 << 30)
    try:
        m = w.host_memory
        assert m is not None and w.cpu_cache is not None
        assert m.nbytes == 6 << 30 and w.cpu_cache.nbytes == 6 << 30
        assert w.cpu_cache.shape == (n_chunks * bpc, page)
        assert m.pinned and w.cpu_cache.is_pinned()
        assert [n for _, n in m.pieces] == [1 << 30] * 6
        assert [a for a, _ in m.pieces] == [m.addr + k * (1 << 30) for k in range(6)]
        assert m.users == 2
        if host_stats is not None:
            # Not from torch's pinned allocator (which rounds up to a power of two).
            after = host_stats()
            key = "allocated_bytes.current"
            assert after.get(key, 0) == (before or {}).get(key, 0)
        (line,) = [r.getMessage() for r in caplog.records if "CPU KV cache" in r.getMessage()]
        assert line.startswith("CPU KV cache: 6.00 GiB (768 chunks of 4 blocks, 2097152 bytes")
        assert "pinned in 6 pieces of at most 1.00 GiB in" in line
        # Chunks 126-129 are sub-blocks 504-519: across the boundary at 512 (1 GiB). With a skip of
        # 2 the first and the last chunk are partial.
        blocks = list(range(0, 14))
        chunks = [126, 127, 128, 129]
        before_gpu = t.clone()
        spec = GPULoadStoreSpec(blocks, (len(blocks),), (2,))
        run(w, kv, 1, True, spec, CPULoadStoreSpec(chunks))
        torch.cuda.synchronize()
        subs = [chunks[(2 + i) // bpc] * bpc + (2 + i) % bpc for i in range(len(blocks))]
        cpu = w.cpu_cache
        for b, s in zip(blocks, subs):
            assert torch.equal(cpu[s], before_gpu[b].cpu()), (b, s)
        t.zero_()
        back = list(range(32, 46))
        run(w, kv, 2, False, GPULoadStoreSpec(back, (len(back),), (2,)), CPULoadStoreSpec(chunks))
        torch.cuda.synchronize()
        for src, dst in zip(blocks, back):
            assert torch.equal(t[dst], before_gpu[src]), (src, dst)
        assert not t[: back[0]].any() and not t[back[-1] + 1 :].any()
    finally:
        w.shutdown()
    assert w.host_memory is None and not m.pinned


# ---- vLLM's counts and order ----------------------------------------------------------------


def test_a_tensor_named_twice_in_a_group_moves_once_and_reports_vllms_count() -> None:
    """Two references of one group name one tensor (vLLM's own worker test does): the worker
    copies the larger page once, and reports what vLLM counts, ``group_size *
    sum(ref.page_size_bytes)`` (2 blocks x (1,024 + 512) = 3,072 bytes, not the 2,048 moved)."""
    gen = torch.Generator().manual_seed(3)
    t = torch.randint(-128, 128, (8, 1024), dtype=torch.int8, generator=gen)
    kv = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, 1024)],
        [[CanonicalKVCacheRef(0, 1024), CanonicalKVCacheRef(0, 512)]],
    )
    w = BlockswapOffloadingWorker(kv, 1, 4, backend="host")
    try:
        before = t.clone()
        assert w.submit_store(1, GPULoadStoreSpec([2, 5], (2,), (0,)), CPULoadStoreSpec([0, 3]))
        w.wait({1})
        (r,) = w.get_finished()
        assert (r.job_id, r.success, r.transfer_size) == (1, True, 3072)
        assert w.handlers[0].stats()["d2h"]["bytes"] == 2048  # the bytes moved: once
        t.zero_()
        assert w.submit_load(2, CPULoadStoreSpec([0, 3]), GPULoadStoreSpec([0, 1], (2,), (0,)))
        w.wait({2})
        (r,) = w.get_finished()
        assert (r.job_id, r.transfer_size) == (2, 3072)
        assert torch.equal(t[[0, 1]], before[[2, 5]]) and not t[2:].any()
    finally:
        w.shutdown()


def two_paged_tensors(n: int, page: int, seed: int) -> tuple[CanonicalKVCaches, list[torch.Tensor]]:
    """One group over two random int8 tensors of ``n`` pages of ``page`` bytes."""
    gen = torch.Generator().manual_seed(seed)
    ts = [torch.randint(-128, 128, (n, page), dtype=torch.int8, generator=gen) for _ in range(2)]
    kv = CanonicalKVCaches(
        [CanonicalKVCacheTensor(x, page) for x in ts],
        [[CanonicalKVCacheRef(0, page), CanonicalKVCacheRef(1, page)]],
    )
    return kv, ts


def test_an_empty_job_is_reported_after_the_jobs_before_it_in_its_direction() -> None:
    """Transfers of one direction finish in submission order, so vLLM may take a job's result as
    proof that the earlier ones finished: an empty store submitted behind a store in flight is
    reported after it (in the same poll or a later one), never before; an empty load behind no
    load is reported by the next poll."""
    page, n = 1 << 20, 48
    kv, _ = two_paged_tensors(n, page, seed=4)
    w = BlockswapOffloadingWorker(kv, 1, n, backend="host")
    try:
        empty = GPULoadStoreSpec([], (0,), (0,))
        big = GPULoadStoreSpec(list(range(n)), (n,), (0,))
        assert w.submit_store(1, big, CPULoadStoreSpec(list(range(n))))
        assert w.submit_store(2, empty, CPULoadStoreSpec([]))
        assert w.submit_store(3, empty, CPULoadStoreSpec([]))
        assert w.submit_load(4, CPULoadStoreSpec([]), empty)
        order: list[int] = []
        first = w.get_finished()
        assert 4 in [r.job_id for r in first]  # nothing before it in its lane
        order += [r.job_id for r in first if r.job_id != 4]
        w.wait({1})
        order += [r.job_id for r in w.get_finished()]
        assert order == [1, 2, 3]
        # With nothing in flight, an empty job is reported by the next poll.
        assert w.submit_store(5, empty, CPULoadStoreSpec([]))
        assert [(r.job_id, r.success, r.transfer_size) for r in w.get_finished()] == [(5, True, 0)]
    finally:
        w.shutdown()


def three_group_mapping(
    gen: torch.Generator, sizes: list[int], bpc: int, n_gpu: int, n_cpu: int
) -> tuple[list[list[int]], list[list[int]], list[list[int]], int]:
    """vLLM's three-group worker test's block mapping: per group (``sizes`` in chunks) random GPU
    blocks, random CPU chunks, and the sub-blocks each GPU block maps to; the last group starts
    and ends ``bpc - 1`` sub-blocks inside its first and last chunk. Returns ``(gpu blocks, CPU
    chunks, sub-blocks, skip)`` per group."""
    gpu_all = torch.randperm(n_gpu, generator=gen)[: sum(sizes) * bpc].tolist()
    cpu_all = torch.randperm(n_cpu, generator=gen)[: sum(sizes)].tolist()
    gpu_g: list[list[int]] = []
    cpu_g: list[list[int]] = []
    o = c = 0
    for n in sizes:
        gpu_g.append(gpu_all[o : o + n * bpc])
        cpu_g.append(cpu_all[c : c + n])
        o, c = o + n * bpc, c + n
    exp_g = [[x * bpc + j for x in cs for j in range(bpc)] for cs in cpu_g]
    skip = bpc - 1
    if skip:
        gpu_g[2], exp_g[2] = gpu_g[2][skip:-skip], exp_g[2][skip:-skip]
    return gpu_g, cpu_g, exp_g, skip


def test_a_full_engine_makes_room_rather_than_refuse_a_job() -> None:
    """vLLM asserts that every submission succeeds (its own worker refuses none), and a step may
    defer more stores than an engine keeps in flight: with ``max_in_flight`` 2, twelve stores
    and loads without a poll between them are all accepted (finished ones collected for the next
    poll, the oldest waited for where none had finished), and each is reported once, in
    submission order per direction, every byte in place; the empty jobs ride behind theirs."""
    page, n = 64 << 10, 24
    kv, ts = two_paged_tensors(n, page, seed=9)
    w = BlockswapOffloadingWorker(kv, 1, n, backend="host", max_in_flight=2)
    try:
        before = [x.clone() for x in ts]
        empty = GPULoadStoreSpec([], (0,), (0,))
        stores = [(j, [j, j + 12]) for j in range(12)]  # GPU block j to chunk j, j+12 to j+12
        for j, blocks in stores:
            spec = GPULoadStoreSpec(blocks, (2,), (0,))
            assert w.submit_store(j, spec, CPULoadStoreSpec(blocks)) is True
            if j == 5:
                assert w.submit_store(100, empty, CPULoadStoreSpec([])) is True
        # Loads of the stored chunks into other GPU blocks, the GPU's copies zeroed first.
        w.wait({j for j, _ in stores})
        for x in ts:
            x.zero_()
        for j, blocks in stores:
            spec = GPULoadStoreSpec(blocks, (2,), (0,))
            assert w.submit_load(50 + j, CPULoadStoreSpec(blocks), spec) is True
        w.wait({50 + j for j, _ in stores})
        got = [(r.job_id, r.success, r.transfer_size) for r in w.get_finished()]
        got += [(r.job_id, r.success, r.transfer_size) for r in w.get_finished()]
        store_order = [j for j, ok, _ in got if j < 50 or j == 100]
        assert store_order == [0, 1, 2, 3, 4, 5, 100, 6, 7, 8, 9, 10, 11]
        assert [j for j, _, _ in got if 50 <= j < 100] == [50 + j for j in range(12)]
        assert all(ok for _, ok, _ in got)
        assert {j: size for j, _, size in got if j != 100} == {
            **{j: 4 * page for j in range(12)},
            **{50 + j: 4 * page for j in range(12)},
        }
        for x, b in zip(ts, before):
            assert x.equal(b)
        assert w.get_finished() == []
    finally:
        w.shutdown()


def test_a_load_waits_for_a_store_holding_the_engines_only_slab() -> None:
    """The two directions of the main engine share its descriptor pool: with room for one
    transfer's descriptors, a load submitted while a store holds them (its own lane empty) waits
    for the store rather than being refused, and both move their bytes."""
    page, n = 64 << 10, 8
    kv, ts = two_paged_tensors(n, page, seed=10)
    w = BlockswapOffloadingWorker(kv, 1, n, backend="host", pool_bytes=6144)
    try:
        want = [x[0].clone() for x in ts]
        for j in range(6):
            store = GPULoadStoreSpec([0], (1,), (0,))
            assert w.submit_store(2 * j, store, CPULoadStoreSpec([j])) is True
            load = GPULoadStoreSpec([j + 1], (1,), (0,))
            assert w.submit_load(2 * j + 1, CPULoadStoreSpec([j]), load) is True
        w.wait(set(range(12)))
        got = w.get_finished() + w.get_finished()
        assert sorted((r.job_id, r.success) for r in got) == [(j, True) for j in range(12)]
        for x, b in zip(ts, want):
            for j in range(1, 7):
                assert x[j].equal(b)
    finally:
        w.shutdown()


def test_a_refused_worker_leaves_its_cpu_cache_registered_nowhere(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A path that cannot run here refuses the worker after its engine registered the CPU cache:
    the refused construction unregisters it, so the cache is freed (unpinned) and not kept
    pinned for an engine that is gone."""
    import blockswap.handler as handler_module
    from blockswap import routing
    from blockswap.hostmem import PinnedRows
    from blockswap.routing import RouteUnavailableError

    unpinned: list[bool] = []
    unpin = PinnedRows.unpin

    def recorded(self: PinnedRows) -> None:
        unpin(self)
        unpinned.append(True)

    monkeypatch.setattr(PinnedRows, "unpin", recorded)
    assert handler_module.PinnedRows is PinnedRows
    # No GPU and no Triton interpreter: the copy kernel cannot run here.
    monkeypatch.setattr(routing, "_kernel_unavailable", lambda: "no kernel in this test")
    kv, _ = caches()
    caplog.set_level("INFO", logger="blockswap")
    with pytest.raises(RouteUnavailableError, match="path='kernel' cannot run here"):
        BlockswapOffloadingWorker(kv, BPC, N_CHUNKS, backend="host", path="kernel")
    assert unpinned == [True]
    assert "stays pinned" not in caplog.text
