"""The entry point vLLM users name in ``--kv-transfer-config``: ``BlockswapOffloadingSpec``,
loaded by vLLM 0.33's own factory. vLLM's CPU spec module imports most of vLLM, so this needs
vLLM's import dependencies (``make setup`` installs them, without vLLM's compiled ops or its
pinned torch)."""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch

pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed")
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from blockswap.vllm import BlockswapOffloadingWorker


@pytest.fixture(autouse=True)
def _one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests run one worker in one process, without vLLM's distributed groups: vLLM's CPU
    spec's barrier for its shared region (made on a GPU machine) has nothing to wait for."""
    from vllm.v1.kv_offload.cpu import spec as cpu_spec

    monkeypatch.setattr(cpu_spec, "_all_workers_barrier", lambda: None)


def offloading_config(
    canonical_layout: bool = False,
    *,
    spec_name: str = "BlockswapOffloadingSpec",
    engine_id: str = "engine-0",
    rank: int = 0,
    world_size: int = 1,
    replicated_layout: bool = False,
    **more: Any,
) -> OffloadingConfig:
    """The OffloadingConfig vLLM 0.33 builds for ``--kv-transfer-config`` with
    ``spec_name: BlockswapOffloadingSpec``: one group of two layers, one worker (by default)."""
    extra: dict[str, Any] = {
        "spec_name": spec_name,
        "spec_module_path": "blockswap.vllm",
        "cpu_bytes_to_use": 64 << 10,
        "blockswap_max_in_flight": 8,
        **more,
    }
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layers.0", "layers.1"), 0),),
        worker_kv_bytes_per_block=2 * 256,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id=engine_id,
        model=OffloadingModelConfig("test-model", "bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=2),
        parallel=OffloadingParallelConfig(rank, world_size, world_size, 1, 1, 1, 0, 1, None, False),
        canonical_layout=canonical_layout,
        replicated_layout=replicated_layout,
    )


def test_vllms_factory_builds_the_spec_and_its_worker_by_name() -> None:
    """vLLM's factory imports ``blockswap.vllm`` and builds ``BlockswapOffloadingSpec`` (vLLM's
    CPU spec: cache sizing, the scheduler's manager) whose worker is blockswap's; a store and a
    load through it move the bytes; ``canonical_layout`` is refused by name."""
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    spec = OffloadingSpecFactory.create_spec(offloading_config())
    assert type(spec).__name__ == "BlockswapOffloadingSpec"
    assert isinstance(spec, CPUOffloadingSpec)
    assert spec.get_manager() is not None  # the scheduler side is vLLM's own
    kv, ts = two_tensors(7)
    w = spec.get_worker(kv)
    try:
        assert isinstance(w, BlockswapOffloadingWorker)
        assert spec.get_worker(kv) is w  # one worker per spec
        assert w.num_cpu_chunks == spec.num_chunks > 0  # vLLM's sizing of cpu_bytes_to_use
        assert w.blocks_per_chunk == 2
        before = [t.clone() for t in ts]
        assert w.submit_store(1, GPULoadStoreSpec([3, 5, 7], [3], [1]), CPULoadStoreSpec([4, 2]))
        w.wait({1})
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True)]
        for t in ts:
            t.zero_()
        assert w.submit_load(2, CPULoadStoreSpec([4, 2]), GPULoadStoreSpec([0, 1, 2], [3], [1]))
        w.wait({2})
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(2, True)]
        for t, b in zip(ts, before):
            assert torch.equal(t[[0, 1, 2]], b[[3, 5, 7]])
            assert not t[3:].any()
    finally:
        w.shutdown()
    with pytest.raises(ValueError, match="canonical_layout"):
        OffloadingSpecFactory.create_spec(offloading_config(canonical_layout=True))


@pytest.mark.filterwarnings("ignore:this engine runs on the host backend")
def test_a_blockswap_key_reaches_the_engines_of_vllms_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``blockswap_idle_issue`` in ``kv_connector_extra_config`` is an option of the engine of
    every handler the worker vLLM's factory builds makes (main and expedited); without the key,
    none is set."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    import blockswap.handler as handler_module

    made: list[dict[str, Any]] = []
    engine = handler_module.Engine

    def recording(backend: str, **options: Any) -> Any:
        made.append(options)
        return engine(backend, **options)

    monkeypatch.setattr(handler_module, "Engine", recording)
    for extra, want in (({"blockswap_idle_issue": True}, [True, True]), ({}, [None, None])):
        made.clear()
        spec = OffloadingSpecFactory.create_spec(offloading_config(**extra))
        w = spec.get_worker(two_tensors(3)[0])
        try:
            assert [o.get("idle_issue") for o in made] == want, made
        finally:
            w.shutdown()


def two_tensors(seed: int) -> tuple[CanonicalKVCaches, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    ts = [torch.randint(-128, 128, (16, 256), dtype=torch.int8, generator=gen) for _ in range(2)]
    kv = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, 256) for t in ts],
        [[CanonicalKVCacheRef(0, 256), CanonicalKVCacheRef(1, 256)]],
    )
    return kv, ts


@pytest.mark.parametrize(
    ("rank", "world", "replicated"), [(0, 1, False), (1, 2, False), (1, 2, True)]
)
def test_the_spec_makes_vllms_region_where_vllms_spec_does(
    monkeypatch: pytest.MonkeyPatch, rank: int, world: int, replicated: bool
) -> None:
    """On a platform where vLLM's CPU spec keeps its tier in a shared region (CUDA, stood in for
    here), blockswap's spec makes the same region (size, row, cell, rank, segments, file name)
    and its worker's views of it are vLLM's worker's: same offsets and strides. A store lands in
    the region."""
    import uuid

    from vllm.v1.kv_offload.cpu import spec as cpu_spec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    monkeypatch.setattr(cpu_spec.current_platform, "is_cuda_alike", lambda: True)
    monkeypatch.setattr(cpu_spec.current_platform, "is_rocm", lambda: False)
    made: list[Any] = []

    class VllmWorker:  # vLLM's CPUOffloadingWorker, which needs vLLM's compiled ops: the region
        def __init__(self, mmap_region: Any = None, **_: Any) -> None:
            made.append(mmap_region)

    monkeypatch.setattr(cpu_spec, "CPUOffloadingWorker", VllmWorker)
    ids = [str(uuid.uuid4()) for _ in range(2)]
    kw: dict[str, Any] = {"rank": rank, "world_size": world, "replicated_layout": replicated}
    vllm_cfg = offloading_config(spec_name="CPUOffloadingSpec", engine_id=ids[0], **kw)
    vllm_cfg = OffloadingConfig(**{**vllm_cfg.__dict__, "extra_config": {
        k: v for k, v in vllm_cfg.extra_config.items() if k != "spec_module_path"}})  # fmt: skip
    ours = OffloadingSpecFactory.create_spec(offloading_config(engine_id=ids[1], **kw))
    theirs = OffloadingSpecFactory.create_spec(vllm_cfg)
    assert type(theirs) is cpu_spec.CPUOffloadingSpec
    kv, ts = two_tensors(3)
    theirs.create_worker(kv)
    (vr,) = made
    w = ours.get_worker(kv)
    try:
        r = w.mmap_region
        assert isinstance(w, BlockswapOffloadingWorker) and r is not None
        assert w.cpu_cache is None and w.host_memory is None  # no private cache
        for a in ("num_chunks", "total_size_bytes", "_row_stride", "cpu_page_size", "rank"):
            assert getattr(r, a) == getattr(vr, a), a
        assert r.mmap_path == vr.mmap_path.replace(ids[0], ids[1])
        assert [n for _, _, n in r._segments] == [n for _, _, n in vr._segments]
        assert r.rank == (0 if replicated else rank)
        views = [vr.create_next_worker_view(t.page_size_bytes * 2) for t in kv.tensors]
        for mine, theirs_v in zip(w.cpu_tensors, views):
            assert mine.shape == theirs_v.shape and mine.stride() == theirs_v.stride()
            assert (
                mine.data_ptr() - r.base_tensor.data_ptr()
                == theirs_v.data_ptr() - vr.base_tensor.data_ptr()
            )
        assert w.submit_store(1, GPULoadStoreSpec([3, 5], [2], [0]), CPULoadStoreSpec([1]))
        w.wait({1})
        assert [(x.job_id, x.success) for x in w.get_finished()] == [(1, True)]
        assert torch.equal(w.cpu_tensors[0][1], ts[0][[3, 5]].reshape(-1))
        del mine, theirs_v, views
    finally:
        w.shutdown()
        vr.cleanup()


def test_tiering_spec_round_trip_through_the_fs_tier(tmp_path: Any) -> None:
    """``BlockswapTieringOffloadingSpec`` built by vLLM's factory with vLLM's ``fs`` secondary
    tier in a temporary directory: blocks stored to the CPU tier by blockswap's worker, written
    to files by the fs tier (reading the scheduler's view of the same region), evicted from the
    CPU tier (their chunks overwritten), read back from the files into other chunks, loaded into
    other GPU blocks: byte-exact, and nothing else written."""
    import time
    import uuid

    import numpy as np
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    cfg = offloading_config(
        spec_name="BlockswapTieringOffloadingSpec",
        engine_id=str(uuid.uuid4()),
        secondary_tiers=[
            {"type": "fs", "root_dir": str(tmp_path), "n_read_threads": 2, "n_write_threads": 2}
        ],
    )
    spec = OffloadingSpecFactory.create_spec(cfg)
    assert type(spec).__name__ == "BlockswapTieringOffloadingSpec"
    assert isinstance(spec, TieringOffloadingSpec)
    manager = spec.get_manager()  # the scheduler's region (rank None) and the fs tier
    (fs,) = manager.secondary_tiers  # type: ignore[attr-defined]
    kv, ts = two_tensors(11)
    w = spec.get_worker(kv)
    try:
        assert isinstance(w, BlockswapOffloadingWorker) and w.mmap_region is not None
        n = spec.num_chunks
        assert n >= 4
        before = [t.clone() for t in ts]
        # 1. Store GPU blocks 3, 5, 7, 9 into chunks 0 and 1 (two blocks a chunk).
        assert w.submit_store(1, GPULoadStoreSpec([3, 5, 7, 9], [4], [0]), CPULoadStoreSpec([0, 1]))
        w.wait({1})
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True)]
        ctx = ReqContext(req_id="r0")
        keys = [make_offload_key(bytes([k]) * 32, 0) for k in (1, 2)]

        def finish(job: int) -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                done = list(fs.get_finished_jobs())
                if done:
                    assert [(r.job_id, r.success) for r in done] == [(job, True)]
                    return
                time.sleep(0.01)
            raise AssertionError(f"fs job {job} did not finish")

        # 2. The fs tier writes chunks 0 and 1 to files.
        fs.submit_store(TransferJob(10, keys, np.array([0, 1]), False, ctx))
        finish(10)
        assert len(list(tmp_path.rglob("*.bin"))) == 2
        # 3. Evicted from the CPU tier: the chunks are reused by other blocks.
        assert w.submit_store(2, GPULoadStoreSpec([0, 1, 2, 4], [4], [0]), CPULoadStoreSpec([0, 1]))
        w.wait({2})
        assert [r.job_id for r in w.get_finished()] == [2]
        # 4. Promoted back from the files into chunks n-2 and n-1, loaded into blocks 10-13.
        fs.submit_load(TransferJob(11, keys, np.array([n - 2, n - 1]), True, ctx))
        finish(11)
        for t in ts:
            t.zero_()
        back = GPULoadStoreSpec([10, 11, 12, 13], [4], [0])
        assert w.submit_load(3, CPULoadStoreSpec([n - 2, n - 1]), back)
        w.wait({3})
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(3, True)]
        for t, b in zip(ts, before):
            assert torch.equal(t[10:14], b[[3, 5, 7, 9]])
            assert not t[:10].any() and not t[14:].any()
    finally:
        w.shutdown()
        manager.shutdown()


def test_tiering_manager_stores_cascades_evicts_and_promotes_through_blockswaps_worker(
    tmp_path: Any,
) -> None:
    """The same round trip driven by vLLM's own tiering manager, as its scheduler drives it:
    ``prepare_store`` picks the chunks, blockswap's worker stores into them, ``complete_store``
    cascades them to the ``fs`` tier; stores of other blocks evict them from the CPU tier (LRU);
    a lookup finds them in the ``fs`` tier and promotes them into the CPU tier; ``prepare_load``
    names the chunks and the worker loads them into other GPU blocks: byte-exact."""
    import time
    import uuid

    from vllm.v1.kv_offload.base import (
        LookupResult,
        ReqContext,
        ScheduleEndContext,
        make_offload_key,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    cfg = offloading_config(
        spec_name="BlockswapTieringOffloadingSpec",
        engine_id=str(uuid.uuid4()),
        secondary_tiers=[
            {"type": "fs", "root_dir": str(tmp_path), "n_read_threads": 2, "n_write_threads": 2}
        ],
    )
    spec = OffloadingSpecFactory.create_spec(cfg)
    manager = spec.get_manager()
    kv, ts = two_tensors(12)
    w = spec.get_worker(kv)
    ctx = ReqContext(req_id="r0")
    manager.on_new_request(ctx)
    step = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    job = iter(range(1, 1000))

    def store(keys: list[Any], blocks: list[int]) -> list[Any]:
        out = manager.prepare_store(keys, ctx)
        assert out is not None and list(out.keys_to_store) == keys
        j = next(job)
        assert w.submit_store(j, GPULoadStoreSpec(blocks, [len(blocks)], [0]), out.store_spec)
        w.wait({j})
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(j, True)]
        manager.complete_store(keys, ctx, success=True)
        return list(out.evicted_keys)

    def settle(until: Any) -> None:
        deadline = time.monotonic() + 30
        while not until():
            assert time.monotonic() < deadline, "the tiering manager did not settle"
            manager.on_schedule_end(step)
            time.sleep(0.01)

    try:
        n = spec.num_chunks
        before = [t.clone() for t in ts]
        keys = [make_offload_key(bytes([1, k]) * 16, 0) for k in range(2)]
        store(keys, [3, 5, 7, 9])  # two chunks of two blocks
        settle(lambda: len(list(tmp_path.rglob("*.bin"))) == 2 and not manager.has_pending_work())
        # Fill the CPU tier with other blocks until both chunks are evicted.
        evicted: set[Any] = set()
        for k in range(n):
            other = [make_offload_key(bytes([2, k]) * 16, 0)]
            evicted.update(store(other, [0, 1]))
            settle(lambda: not manager.has_pending_work())
            if set(keys) <= evicted:
                break
        assert set(keys) <= evicted
        assert manager.lookup(keys[0], ctx) is not LookupResult.HIT

        # Promotion from the fs tier, then a load into blocks 10-13.
        def promoted() -> bool:
            return all(manager.lookup(k, ctx) is LookupResult.HIT for k in keys)

        settle(promoted)
        load_spec = manager.prepare_load(keys, ctx)
        for t in ts:
            t.zero_()
        j = next(job)
        assert w.submit_load(j, load_spec, GPULoadStoreSpec([10, 11, 12, 13], [4], [0]))
        w.wait({j})
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(j, True)]
        manager.complete_load(keys, ctx)
        for t, b in zip(ts, before):
            assert torch.equal(t[10:14], b[[3, 5, 7, 9]])
            assert not t[:10].any() and not t[14:].any()
    finally:
        w.shutdown()
        manager.shutdown()


# ---- two ranks of one host, each its own process, from vLLM's factory -------------------------


def _factory_rank(
    rank: int, engine_id: str, replicated: bool, device: str, barrier: Any, out: Any
) -> None:
    """Rank ``rank`` of a world of 2: ``BlockswapOffloadingSpec`` from vLLM's factory with the
    same extra config as the other rank, on a platform where vLLM keeps the CPU tier in the
    shared region (CUDA; stood in for on the CPU), its barrier across the two processes, the KV
    cache on GPU ``rank`` with ``device="cuda"``. Stores and loads run on both ranks at once;
    reports what it saw to the parent."""
    try:
        import os

        from vllm.v1.kv_offload.cpu import spec as cpu_spec
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        # vLLM keeps the region where its platform is CUDA: stood in for where vLLM does not
        # detect one (on the CPU; on a GPU where vLLM runs without its compiled parts and NVML).
        if not cpu_spec.current_platform.is_cuda_alike():
            cpu_spec.current_platform.is_cuda_alike = lambda: True  # type: ignore[method-assign]
            cpu_spec.current_platform.is_rocm = lambda: False  # type: ignore[method-assign]
        if device == "cuda":
            torch.cuda.set_device(rank)
        cpu_spec._all_workers_barrier = lambda: barrier.wait(60)
        cfg = offloading_config(
            engine_id=engine_id, rank=rank, world_size=2, replicated_layout=replicated
        )
        spec = OffloadingSpecFactory.create_spec(cfg)
        # Replicated (an MLA latent under TP): the same KV on both ranks; else each rank's own.
        kv, ts = two_tensors(7 if replicated else rank)
        if device == "cuda":
            ts = [t.to(f"cuda:{rank}") for t in ts]
            kv = CanonicalKVCaches([CanonicalKVCacheTensor(t, 256) for t in ts],
                                   kv.group_data_refs)  # fmt: skip
        before = [t.clone() for t in ts]
        w = spec.get_worker(kv)
        try:
            region = w.mmap_region
            assert isinstance(w, BlockswapOffloadingWorker) and region is not None
            st = os.fstat(region.fd)  # type: ignore[arg-type]
            chunks = CPULoadStoreSpec([0, 1, 2, 3])
            barrier.wait(60)
            # vLLM's connector stores from every rank, or with replicated_layout from rank 0.
            if not replicated or rank == 0:
                assert w.submit_store(1, GPULoadStoreSpec(list(range(8)), [8], [0]), chunks)
                w.wait({1})
                if device == "cuda":
                    torch.cuda.synchronize()
                assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True)]
            barrier.wait(60)
            cells_ok = True
            if not replicated:
                # The other rank's cell of each row holds its bytes: [tensor 0's two pages |
                # tensor 1's two pages] (vLLM's layout), written at the same time as ours.
                _, theirs = two_tensors(1 - rank)
                cell = region.cpu_page_size
                raw = region.base_tensor.as_strided(
                    (4, cell), (region._row_stride, 1), (1 - rank) * cell
                )
                for c in range(4):
                    want = torch.cat([t[2 * c : 2 * c + 2].reshape(-1) for t in theirs])
                    cells_ok &= torch.equal(raw[c], want)
                del raw
            for t in ts:
                t.zero_()
            back = GPULoadStoreSpec(list(range(8, 16)), [8], [0])
            assert w.submit_load(2, chunks, back)
            w.wait({2})
            assert [(r.job_id, r.success) for r in w.get_finished()] == [(2, True)]
            if device == "cuda":
                torch.cuda.synchronize()
            exact = all(torch.equal(t[8:], b[:8]) and not t[:8].any() for t, b in zip(ts, before))
            out.put((rank, None, st.st_ino, region.total_size_bytes, exact, cells_ok))
            barrier.wait(60)
        finally:
            w.shutdown()
    except Exception:  # reported to the parent, which fails the test with it
        out.put((rank, traceback.format_exc(), 0, 0, False, False))
        barrier.abort()


TWO_GPUS = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, TWO_GPUS])]
)
@pytest.mark.parametrize("replicated", [False, True], ids=["per-layer", "mla-replicated"])
def test_two_ranks_from_vllms_factory_share_one_region(replicated: bool, device: str) -> None:
    """Ranks 0 and 1 of one host, each in its own process (on its own GPU with ``cuda``), built
    by vLLM's factory from the same ``kv_connector_extra_config``: one region file mapped by
    both, stores and loads on both at once, byte-exact; each rank's cell holds its bytes, or
    with ``replicated_layout`` one copy that both ranks load. On the CPU, the host backend's run
    of the two-GPU test."""
    import uuid

    from test_vllm import two_ranks

    results = two_ranks(_factory_rank, str(uuid.uuid4()), replicated, device)
    (_, _, ino0, total0, exact0, cells0), (_, _, ino1, total1, exact1, cells1) = results
    assert ino0 == ino1  # one file, mapped by both ranks
    # 16 rows of 4 KiB: one 1 KiB cell per rank, or one for both (replicated).
    assert total0 == total1 == 16 * 4096
    assert exact0 and exact1 and cells0 and cells1
