"""vLLM's offloading specs with blockswap's worker, made on first use by
:mod:`blockswap.vllm` (importing vLLM's CPU spec module pulls in most of vLLM):
``BlockswapOffloadingSpec`` (vLLM's ``CPUOffloadingSpec``) and ``BlockswapTieringOffloadingSpec``
(vLLM's ``TieringOffloadingSpec``), each making vLLM's region exactly as vLLM's spec makes it and
:class:`~blockswap.vllm.BlockswapOffloadingWorker` over it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import _vllm_config
from . import _vllm_region as _region

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    from .vllm import BlockswapOffloadingWorker


def _spec_class() -> type:
    """vLLM's ``CPUOffloadingSpec`` with blockswap's worker (built on first use: importing vLLM's
    CPU spec module pulls in most of vLLM)."""
    from vllm.v1.kv_offload.config import OffloadingConfig
    from vllm.v1.kv_offload.cpu import spec as cpu_spec
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    class BlockswapOffloadingSpec(CPUOffloadingSpec):
        """vLLM's CPU offloading spec (cache sizing from ``cpu_bytes_to_use``, the scheduler's
        manager, the shared offload region where vLLM keeps one, ``replicated_layout``) with
        :class:`BlockswapOffloadingWorker` as its worker."""

        def __init__(self, config: OffloadingConfig) -> None:
            _vllm_config.init_spec(self, config, super().__init__, canonical=False)

        def create_worker(self, kv_caches: CanonicalKVCaches) -> BlockswapOffloadingWorker:
            # The region as CPUOffloadingSpec.create_worker makes it, and checked against the
            # host's memory by the worker that creates it; a private cache by each worker.
            region: SharedOffloadRegion | None = None
            if not (self._uses_shared_region() and self.num_chunks > 0):
                _vllm_config.check_worker_fits(self)
            else:
                world_size = self.config.parallel.world_size
                worker_index = self.config.parallel.rank
                region = _region.new_region(
                    engine_id=self.config.engine_id,
                    num_chunks=self.num_chunks,
                    rank=0 if self.replicated_layout else worker_index,
                    kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                    cpu_page_size=self.cpu_page_size_per_worker,
                    barrier=cpu_spec._all_workers_barrier,
                    num_segments=cpu_spec._REGION_SEGMENTS,
                    populate_shard=((worker_index, world_size) if self.replicated_layout else None),
                    creator_memory_check=_vllm_config.region_check(self),
                )
            return _new_worker(self, kv_caches, region)

        def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
            return _get_worker(self, kv_caches)

    BlockswapOffloadingSpec.__module__ = "blockswap.vllm"
    return BlockswapOffloadingSpec


def _tiering_spec_class() -> type:
    """vLLM's ``TieringOffloadingSpec`` with blockswap's worker (built on first use)."""
    from vllm.v1.kv_offload.config import OffloadingConfig
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    class BlockswapTieringOffloadingSpec(TieringOffloadingSpec):
        """vLLM's tiering spec (the CPU tier in the shared offload region, its eviction, the
        secondary tiers ``fs``, ``obj``, ``p2p`` and out-of-tree ones reading and writing the CPU
        tier through the region) with :class:`BlockswapOffloadingWorker` as its worker."""

        def __init__(self, config: OffloadingConfig) -> None:
            _vllm_config.init_spec(self, config, super().__init__, canonical=True)

        def create_worker(self, kv_caches: CanonicalKVCaches) -> BlockswapOffloadingWorker:
            _vllm_config.check_chunks(self.num_chunks)
            # The region exactly as TieringOffloadingSpec.create_worker makes it (checked
            # against the host's memory by the worker that creates it), and the canonical
            # layout's references certified by vLLM's own check.
            region = _region.new_region(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=0 if self.replicated_layout else self.config.parallel.rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
                creator_memory_check=_vllm_config.region_check(self),
            )
            canonical = bool(self.config.canonical_layout)
            if canonical:
                try:
                    self._validate_canonical_refs(kv_caches)
                except Exception:
                    region.cleanup()
                    raise
            return _new_worker(self, kv_caches, region, canonical_layout=canonical)

        def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
            return _get_worker(self, kv_caches)

    BlockswapTieringOffloadingSpec.__module__ = "blockswap.vllm"
    return BlockswapTieringOffloadingSpec


def _new_worker(
    spec: Any,
    kv_caches: CanonicalKVCaches,
    region: SharedOffloadRegion | None,
    *,
    canonical_layout: bool = False,
) -> BlockswapOffloadingWorker:
    """The worker over ``region`` (released here if the worker cannot be built, as vLLM's
    ``create_worker`` does)."""
    from .vllm import BlockswapOffloadingWorker

    try:
        return BlockswapOffloadingWorker(
            kv_caches,
            spec.blocks_per_chunk,
            spec.num_chunks,
            mmap_region=region,
            canonical_layout=canonical_layout,
            **_vllm_config.worker_options(spec.extra_config),
        )
    except Exception:
        if region is not None:
            region.cleanup()
        raise


def _get_worker(spec: Any, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
    """One worker per spec, made on first use (blockswap's host backend runs without a GPU, so
    vLLM's platform check is not repeated here)."""
    worker: OffloadingWorker | None = spec._worker
    if worker is None:
        worker = spec.create_worker(kv_caches)
        spec._worker = worker
    return worker


MADE = {
    "BlockswapOffloadingSpec": _spec_class,
    "BlockswapTieringOffloadingSpec": _tiering_spec_class,
}
