"""blockswap inside vLLM (0.33 and later): a KV-cache offloading backend vLLM loads by name.

vLLM's ``OffloadingConnector`` loads an out-of-tree backend from ``kv_connector_extra_config``::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "BlockswapOffloadingSpec",
        "spec_module_path": "blockswap.vllm", "cpu_bytes_to_use": 68719476736}}'

:class:`BlockswapOffloadingSpec` is vLLM's ``CPUOffloadingSpec`` (which sizes the CPU cache from
``cpu_bytes_to_use`` and runs the scheduler side) with its worker replaced by
:class:`BlockswapOffloadingWorker`: every transfer is one submission to a blockswap engine, which
turns vLLM's block ids into copies in its core (``CpuGpuHandlers``; no per-block Python).

The CPU cache is blockswap's and block-major: each GPU-sized sub-block of a CPU chunk holds the
pages of every KV-cache tensor it stores back to back (padding of the GPU pages is not copied
and takes no room). It is exactly the bytes vLLM sized it to (torch's pinned allocator would
round it up to a power of two), page-locked in pieces of whole sub-blocks of at most 256 GiB
(one driver registration of 512 GiB or more fails; :mod:`blockswap.hostmem`), and no copy
crosses from one piece into the next; one log line gives its size, pieces and time.

vLLM's block mapping is kept exactly: a CPU chunk holds ``blocks_per_chunk`` GPU blocks; per
KV-cache group, a transfer starts ``block_indices[g] % blocks_per_chunk`` sub-blocks into its
first chunk, in both directions, and its first and last chunk may be partial.
Stores and loads both wait for the work issued on the current compute stream; transfers of one
direction finish in submission order; expedited loads run on an engine of their own, so they
never queue behind regular loads. ``transfer_time`` is the copies' GPU time.

Options (``kv_connector_extra_config``, all optional): ``blockswap_path`` (``"auto"``,
``"blocks"``, ``"staged"``, ``"dma"`` or ``"kernel"``: the copy path, see
:class:`~blockswap.handler.CpuGpuHandlers`), ``blockswap_max_in_flight`` (transfers in flight per
direction, 1 to ``blockswap._core.MAX_IN_FLIGHT``) and ``blockswap_pin_piece_bytes`` (the largest
piece the CPU cache is page-locked in). All of them are checked when the spec is made, before
the CPU cache is sized or allocated (:mod:`blockswap._vllm_config`): an unknown ``blockswap_*``
key is refused with the list of known ones, a bad value with its key and the values it takes,
as a :class:`~blockswap.errors.ConfigError`. Not supported, and refused when the spec is made
with a message naming the option: ``canonical_layout`` (vLLM's parallelism-free CPU layout,
``CanonicalPageMapping``) and the shared offload region (``replicated_layout``).

Importing this module needs vLLM; ``import blockswap`` never imports it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from . import _optional, _vllm_config, _vllm_logging
from ._checks import check_int
from ._types import BackendName, HandlerPath
from .errors import ConfigError

try:
    import torch
except ModuleNotFoundError as e:
    _optional.missing(e, __name__)

try:
    from vllm.v1.kv_offload.base import (
        CanonicalKVCaches,
        GPULoadStoreSpec,
        LoadStoreSpec,
        OffloadingWorker,
    )
    from vllm.v1.kv_offload.base import TransferResult as VllmTransferResult
except ModuleNotFoundError as e:
    raise ModuleNotFoundError(
        f"blockswap.vllm is vLLM's offloading plug-in and needs vLLM 0.33 or later ({e}): "
        "pip install 'vllm>=0.33'",
        name=e.name,
    ) from e

from .handler import CpuGpuHandlers
from .hostmem import DEFAULT_PIECE_BYTES, PinnedRows

__all__ = ["BlockswapOffloadingSpec", "BlockswapOffloadingWorker"]  # noqa: F822 (made on first use)

#: Worker construction, the CPU cache's allocation, refused submissions.
log = logging.getLogger(__name__)

#: ``kv_connector_extra_config`` keys this backend reads, and the worker option each sets
#: (checked by :func:`blockswap._vllm_config.worker_options` when the spec is made).
OPTIONS = {key: opt.param for key, opt in _vllm_config.OPTIONS.items()}


class BlockswapOffloadingWorker(OffloadingWorker):
    """vLLM's ``OffloadingWorker`` for a CPU cache, on blockswap engines.

    ``kv_caches``: vLLM's ``CanonicalKVCaches`` (unique int8 tensors of ``(num_blocks,
    page_size_bytes)`` rows, and per KV-cache group the references to them with the page size
    each copies). ``blocks_per_chunk``: GPU blocks per CPU chunk. ``num_cpu_chunks``: chunks in
    the CPU cache (vLLM's ``CPULoadStoreSpec.block_ids`` index them). ``pin_piece_bytes``: the
    largest piece the CPU cache is page-locked (and registered) in, a whole number of sub-blocks
    each (see :class:`~blockswap.hostmem.PinnedRows`). ``backend``, ``path`` and the other keyword
    options go to :class:`~blockswap.handler.CpuGpuHandlers`.

    A failed submission returns ``False`` and logs why; it never raises into vLLM.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        num_cpu_chunks: int,
        *,
        backend: BackendName = "auto",
        path: HandlerPath = "auto",
        pin_piece_bytes: int = DEFAULT_PIECE_BYTES,
        **options: Any,
    ) -> None:
        check_int("blocks_per_chunk", blocks_per_chunk, 1)
        if num_cpu_chunks < 1:
            raise ValueError(
                f"the CPU cache holds {num_cpu_chunks} chunks: raise cpu_bytes_to_use (in "
                "kv_connector_extra_config) to at least one chunk per worker"
            )
        if not kv_caches.tensors:
            raise ValueError("kv_caches holds no tensor")
        refs = kv_caches.group_data_refs
        for g, group in enumerate(refs):
            for r in group:
                if r.mapping is not None:
                    raise ValueError(
                        f"KV-cache group {g} carries a CanonicalPageMapping: blockswap's worker "
                        "does not support canonical_layout; remove it from "
                        "kv_connector_extra_config"
                    )
        rows: list[torch.Tensor] = []
        for i, ct in enumerate(kv_caches.tensors):
            t = ct.tensor
            if not t.is_contiguous():
                raise ValueError(f"KV-cache tensor {i} is not contiguous")
            rows.append(t.view(torch.int8).view(-1, ct.page_size_bytes))
        # Per tensor, the bytes a CPU sub-block keeps: the largest page any reference copies.
        slot: dict[int, int] = {}
        for g, group in enumerate(refs):
            for r in group:
                if not 0 <= r.tensor_idx < len(rows):
                    raise ValueError(f"group {g} refers to tensor {r.tensor_idx} of {len(rows)}")
                row = rows[r.tensor_idx].shape[1]
                if not 0 < r.page_size_bytes <= row:
                    raise ValueError(
                        f"group {g}: a page of {r.page_size_bytes} bytes in tensor "
                        f"{r.tensor_idx}, whose rows are {row} bytes"
                    )
                slot[r.tensor_idx] = max(slot.get(r.tensor_idx, 0), r.page_size_bytes)
        offset: dict[int, int] = {}
        sub_block = 0
        for t in sorted(slot):
            offset[t] = sub_block
            sub_block += slot[t]

        device = rows[0].device
        on_cuda = device.type == "cuda" and backend != "host"
        self.blocks_per_chunk = int(blocks_per_chunk)
        self.num_cpu_chunks = int(num_cpu_chunks)
        if device.index is not None:
            index = device.index
        else:
            index = torch.cuda.current_device() if on_cuda else 0
        #: The CPU cache's memory: exactly its size, page-locked in pieces of whole sub-blocks.
        self.host_memory: PinnedRows | None = PinnedRows(
            self.num_cpu_chunks * self.blocks_per_chunk,
            max(sub_block, 1),
            piece_bytes=pin_piece_bytes,
            backend="cuda" if on_cuda else "host",
            device=index,
            log_line=False,
        )
        #: The CPU cache: ``num_cpu_chunks * blocks_per_chunk`` sub-blocks of every tensor's page.
        self.cpu_cache: torch.Tensor | None = self.host_memory.tensor()
        log.info(
            "CPU KV cache: %.2f GiB (%d chunks of %d blocks, %d bytes each) %s in %.2f s",
            self.host_memory.nbytes / 2**30,
            self.num_cpu_chunks,
            self.blocks_per_chunk,
            sub_block,
            self.host_memory.how(),
            self.host_memory.seconds,
        )

        # One handler group per vLLM group with pages; each (tensor, page) is a one-page layer.
        gpu_groups: list[list[torch.Tensor]] = []
        cpu_groups: list[list[torch.Tensor]] = []
        #: vLLM group index -> handler group index (None: a group without pages).
        self._groups: list[int | None] = []
        for group in refs:
            pages: dict[int, int] = {}
            for r in group:
                pages[r.tensor_idx] = max(pages.get(r.tensor_idx, 0), r.page_size_bytes)
            if not pages:
                self._groups.append(None)
                continue
            self._groups.append(len(gpu_groups))
            gpu_groups.append([rows[t][:, :p].unsqueeze(1) for t, p in pages.items()])
            cpu_groups.append(
                [
                    self.cpu_cache[:, offset[t] : offset[t] + p].unsqueeze(1)
                    for t, p in pages.items()
                ]
            )
        if not gpu_groups:
            raise ValueError("no KV-cache group refers to a tensor: nothing to offload")
        self._single = len(gpu_groups) == 1
        handler_options = dict(options)
        if on_cuda:
            handler_options.setdefault("timing", True)  # transfer_time: the copies' GPU time

        def handlers() -> CpuGpuHandlers:
            return CpuGpuHandlers(
                gpu_groups,
                self.num_cpu_chunks,
                layout="mla",
                block_size_factor=self.blocks_per_chunk,
                cpu_caches=cpu_groups,
                backend=backend,
                path=path,
                load_waits_for_compute=True,
                **handler_options,
            )

        #: Transfers that move no block (vLLM may submit them): done at once, reported next poll.
        self._empty: list[VllmTransferResult] = []
        try:
            self._main = handlers()
        except BaseException:
            self._free_cache()
            raise
        try:
            # Expedited loads on an engine of their own: they never queue behind regular loads.
            self._expedited = handlers()
        except BaseException:
            self._main.shutdown()
            self._free_cache()
            raise
        log.info(
            "blockswap offloading worker: %d KV-cache group(s), %d tensor(s); store %s; load %s",
            len(gpu_groups),
            len(rows),
            self._main.routes["d2h"].reason,
            self._main.routes["h2d"].reason,
        )

    @property
    def handlers(self) -> tuple[CpuGpuHandlers, CpuGpuHandlers]:
        """The handlers of regular transfers and of expedited loads."""
        return self._main, self._expedited

    # ---- vLLM's OffloadingWorker ---------------------------------------------------------------

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        """GPU -> CPU: ``src_spec`` names GPU blocks, ``dst_spec`` CPU chunks."""
        return self._submit(self._main.gpu_to_cpu_handler, job_id, src_spec, dst_spec, src_spec)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """CPU -> GPU: ``src_spec`` names CPU chunks, ``dst_spec`` GPU blocks."""
        h = (self._expedited if expedited else self._main).cpu_to_gpu_handler
        return self._submit(h, job_id, src_spec, dst_spec, dst_spec)

    def get_finished(self) -> list[VllmTransferResult]:
        out, self._empty = self._empty, []
        for h in (self._main, self._expedited):
            for r in h.get_finished():
                if not r.success:
                    log.warning("offloading job %d failed: %s", r.job_id, r.error)
                out.append(VllmTransferResult(r.job_id, r.success, r.bytes, r.seconds))
        return out

    def wait(self, job_ids: set[int]) -> None:
        ids = list(job_ids)
        self._main.wait(ids)
        self._expedited.wait(ids)

    def shutdown(self) -> None:
        """Drains both engines (every accepted transfer runs), then frees the CPU cache: unpinned
        once neither engine holds a registration in it, unmapped once no tensor views it."""
        for h in (self._expedited, self._main):
            h.shutdown()
        self._free_cache()

    def _free_cache(self) -> None:
        if self.host_memory is not None:
            try:
                self.host_memory.unpin()
            except Exception as e:  # an engine that timed out keeps it: never freed under a copy
                log.warning("the CPU KV cache stays pinned: %s", e)
        self.host_memory = None
        self.cpu_cache = None

    # ---- the mapping -----------------------------------------------------------------------------

    def _submit(
        self, handler: Any, job_id: int, src: Any, dst: Any, gpu_spec: GPULoadStoreSpec
    ) -> bool:
        try:
            cpu_spec = dst if gpu_spec is src else src
            gpu_ids, cpu_ids, starts = self._split(gpu_spec, cpu_spec)
            if not any(g.shape[0] for g in gpu_ids):
                # No data to move, so no order to keep: reported done by the next poll.
                self._empty.append(VllmTransferResult(job_id, True, 0, 0.0))
                return True
            sides: tuple[Any, Any] = (gpu_ids, cpu_ids) if gpu_spec is src else (cpu_ids, gpu_ids)
            if self._single:
                sides = (sides[0][0], sides[1][0])
            return bool(handler.transfer_async(job_id, sides, block_indices=starts))
        except Exception as e:  # vLLM turns False into a failed job; an exception would kill it
            log.warning("offloading job %d refused: %s", job_id, e)
            return False

    def _split(
        self, gpu_spec: GPULoadStoreSpec, cpu_spec: LoadStoreSpec
    ) -> tuple[list[npt.NDArray[np.int64]], list[npt.NDArray[np.int64]], list[int]]:
        """vLLM's flat ids cut per KV-cache group: ``(GPU ids, CPU chunk ids, first block
        indices)`` per handler group. A group takes ``ceil((skip + n) / blocks_per_chunk)`` chunks
        of the flat list (none for no block); the engine checks each group's count again."""
        gpu = np.asarray(gpu_spec.block_ids, dtype=np.int64)
        chunks = np.asarray(getattr(cpu_spec, "block_ids", cpu_spec), dtype=np.int64)
        sizes: Sequence[int] = gpu_spec.group_sizes
        starts: Sequence[int] = gpu_spec.block_indices
        if len(sizes) != len(self._groups) or len(starts) != len(self._groups):
            raise ValueError(
                f"the spec has {len(sizes)} group sizes and {len(starts)} block indices for "
                f"{len(self._groups)} KV-cache groups"
            )
        f = self.blocks_per_chunk
        out_gpu: list[npt.NDArray[np.int64]] = []
        out_cpu: list[npt.NDArray[np.int64]] = []
        out_start: list[int] = []
        o = c = 0
        for g, (n, start) in enumerate(zip(sizes, starts)):
            n, start = int(n), int(start)
            m = -(-(start % f + n) // f) if n else 0
            if self._groups[g] is None:
                if n:
                    raise ValueError(f"group {g} has no pages but the spec names {n} blocks")
                continue
            out_gpu.append(gpu[o : o + n])
            out_cpu.append(chunks[c : c + m])
            out_start.append(start)
            o, c = o + n, c + m
        if o != gpu.shape[0] or c != chunks.shape[0]:
            raise ValueError(
                f"the groups take {o} GPU blocks and {c} CPU chunks, the spec names "
                f"{gpu.shape[0]} and {chunks.shape[0]}"
            )
        return out_gpu, out_cpu, out_start


def _spec_class() -> type:
    """vLLM's ``CPUOffloadingSpec`` with blockswap's worker (built on first use: importing vLLM's
    CPU spec module pulls in most of vLLM)."""
    from vllm.v1.kv_offload.config import OffloadingConfig
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    class BlockswapOffloadingSpec(CPUOffloadingSpec):
        """vLLM's CPU offloading spec (cache sizing from ``cpu_bytes_to_use``, the scheduler's
        manager) with :class:`BlockswapOffloadingWorker` as its worker."""

        def __init__(self, config: OffloadingConfig) -> None:
            # blockswap's log lines in vLLM's log, in its format, at INFO.
            _vllm_logging.attach()
            # Every blockswap_* key checked before vLLM sizes or blockswap allocates anything.
            _vllm_config.worker_options(config.extra_config)
            if config.canonical_layout:
                raise ConfigError(
                    "blockswap's offloading worker does not support canonical_layout: remove it "
                    "from kv_connector_extra_config"
                )
            super().__init__(config)
            _vllm_config.check_fits(
                self.num_chunks * self.cpu_page_size_per_worker,
                config.extra_config,
                config.parallel.world_size,
            )

        def _uses_shared_region(self) -> bool:
            # The CPU cache is the worker's own (no shared mmap region, so no replicated_layout).
            return False

        def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
            worker: OffloadingWorker | None = self._worker  # type: ignore[has-type]
            if worker is None:
                options = {
                    name: self.extra_config[key]
                    for key, name in OPTIONS.items()
                    if key in self.extra_config
                }
                worker = BlockswapOffloadingWorker(
                    kv_caches, self.blocks_per_chunk, self.num_chunks, **options
                )
                self._worker = worker
            return worker

    BlockswapOffloadingSpec.__module__ = __name__
    return BlockswapOffloadingSpec


def __getattr__(name: str) -> Any:
    if name == "BlockswapOffloadingSpec":
        cls = _spec_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
