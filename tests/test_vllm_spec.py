"""The entry point vLLM users name in ``--kv-transfer-config``: ``BlockswapOffloadingSpec``,
loaded by vLLM 0.33's own factory. vLLM's CPU spec module imports most of vLLM, so this needs
vLLM's import dependencies (``make setup`` installs them, without vLLM's compiled ops or its
pinned torch)."""

from __future__ import annotations

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


def offloading_config(canonical_layout: bool = False) -> OffloadingConfig:
    """The OffloadingConfig vLLM 0.33 builds for ``--kv-transfer-config`` with
    ``spec_name: BlockswapOffloadingSpec``: one group of two layers, one worker."""
    extra: dict[str, Any] = {
        "spec_name": "BlockswapOffloadingSpec",
        "spec_module_path": "blockswap.vllm",
        "cpu_bytes_to_use": 64 << 10,
        "blockswap_max_in_flight": 8,
    }
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layers.0", "layers.1"), 0),),
        worker_kv_bytes_per_block=2 * 256,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id="engine-0",
        model=OffloadingModelConfig("test-model", "bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=2),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False),
        canonical_layout=canonical_layout,
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
    gen = torch.Generator().manual_seed(7)
    ts = [torch.randint(-128, 128, (16, 256), dtype=torch.int8, generator=gen) for _ in range(2)]
    kv = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, 256) for t in ts],
        [[CanonicalKVCacheRef(0, 256), CanonicalKVCacheRef(1, 256)]],
    )
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
