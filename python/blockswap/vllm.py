"""blockswap inside vLLM (0.33 and later): a KV-cache offloading backend vLLM loads by name.

vLLM's ``OffloadingConnector`` loads an out-of-tree backend from ``kv_connector_extra_config``::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "BlockswapOffloadingSpec",
        "spec_module_path": "blockswap.vllm", "cpu_bytes_to_use": 68719476736}}'

:class:`BlockswapOffloadingSpec` is vLLM's ``CPUOffloadingSpec`` (which sizes the CPU cache from
``cpu_bytes_to_use`` and runs the scheduler side) with its worker replaced by
:class:`BlockswapOffloadingWorker`: every transfer is one submission to a blockswap engine, which
turns vLLM's block ids into copies in its core (``CpuGpuHandlers``; no per-block Python).
:class:`BlockswapTieringOffloadingSpec` is vLLM's ``TieringOffloadingSpec`` (the CPU tier with
secondary tiers: ``fs``, ``obj``, ``p2p``, out-of-tree ones) with the same worker.

The CPU cache is where vLLM keeps it. Where vLLM's own spec uses its ``SharedOffloadRegion`` (on
CUDA, and always for tiering), blockswap's spec makes the same region the same way (engine id,
rank, world size, ``replicated_layout``, segments, pre-faulting, the barrier) and the worker
moves the bytes in vLLM's layout: a row per chunk, a cell per rank in each row (one cell for all
ranks with ``replicated_layout``), and in a cell every KV-cache tensor's ``blocks_per_chunk``
pages of its ``page_size_bytes``, tensor after tensor. After a store the region holds exactly the
bytes vLLM's worker would have written, at the same offsets, so the scheduler, a secondary tier
or a vLLM worker reads them unchanged. The core sees the cells as block tables (per sub-block
index ``j`` of a chunk, each tensor's ``j``-th page at the row stride); the region is registered
with the engines (and on CUDA page-locked) in pieces, each a region of its own, so no copy
crosses from one piece into the next: as vLLM's worker does, a rank takes only its own cells, a
cell a row, where that spares at least 3 MiB a row (several ranks, no ``replicated_layout``, no
``canonical_layout``), and whole rows otherwise. Where vLLM keeps no region, the CPU cache is
blockswap's own and block-major: each GPU-sized sub-block of a CPU chunk holds the pages of every
KV-cache tensor it stores back to back, exactly the bytes vLLM sized it to, page-locked in pieces
of whole sub-blocks of at most 4 GiB (:mod:`blockswap.hostmem`); one log line gives its size,
pieces and time.

vLLM's block mapping is kept exactly: a CPU chunk holds ``blocks_per_chunk`` GPU blocks; per
KV-cache group, a transfer starts ``block_indices[g] % blocks_per_chunk`` sub-blocks into its
first chunk, in both directions, and its first and last chunk may be partial (a store writes only
the sub-blocks it owns). Stores and loads both wait for the work issued on the current compute
stream; transfers of one direction finish, and are reported, in submission order (a job with no
block included); expedited loads run on an engine of their own, so they never queue behind
regular loads. ``transfer_time`` is the copies' GPU time; ``transfer_size`` is vLLM's count
(per group, blocks times the sum of its references' pages, a tensor two references name counted
twice though its bytes move once).

Options (``kv_connector_extra_config``, all optional): ``blockswap_path`` (``"auto"``,
``"blocks"``, ``"staged"``, ``"dma"`` or ``"kernel"``: the copy path, see
:class:`~blockswap.handler.CpuGpuHandlers`), ``blockswap_max_in_flight`` (transfers in flight per
direction, 1 to ``blockswap._core.MAX_IN_FLIGHT``), ``blockswap_pin_piece_bytes`` (the largest
piece the CPU cache is page-locked in; a piece holds at least one block's row),
``blockswap_idle_issue`` (``true``: a transfer that finds its direction idle issues its first
step on vLLM's thread, which pays those driver calls;
see docs/tuning.md, ``idle_issue``) and ``blockswap_keep_warm`` (seconds a direction's thread
stays ready after a transfer, 0.1 by default; see docs/tuning.md, ``keep_warm``). All of them are
checked when the spec is made, before the CPU cache is sized or allocated
(:mod:`blockswap._vllm_config`): an unknown ``blockswap_*`` key is refused with the list of known
ones, a bad value with its key and the values it takes, as a
:class:`~blockswap.errors.ConfigError`. ``canonical_layout`` (vLLM's parallelism-free CPU
layout, each rank's ``CanonicalPageMapping`` naming its fragments of the shared pages) is laid
out by ``BlockswapTieringOffloadingSpec``, as vLLM 0.33's tiering spec lays it out;
``BlockswapOffloadingSpec`` refuses it when the spec is made (vLLM's CPU spec ignores it).

Importing this module needs vLLM; ``import blockswap`` never imports it.
"""

from __future__ import annotations

import logging
import operator
from collections import deque
from typing import TYPE_CHECKING, Any

from . import _optional, _vllm_config
from . import _vllm_parts as _parts
from . import _vllm_region as _region
from ._checks import check_int
from ._core import InvalidTransferError, PoolExhaustedError
from ._types import BackendName, HandlerPath
from ._vllm_specs import GroupMap
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

from ._core import stage_slot
from .handler import CpuGpuHandlers
from .hostmem import DEFAULT_PIECE_BYTES, PinnedRows

if TYPE_CHECKING:
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

__all__ = [  # noqa: F822 (the specs are made on first use)
    "BlockswapOffloadingSpec",
    "BlockswapOffloadingWorker",
    "BlockswapTieringOffloadingSpec",
]

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
    the CPU cache (vLLM's ``CPULoadStoreSpec.block_ids`` index them).

    ``mmap_region``: vLLM's ``SharedOffloadRegion`` the CPU cache lives in, laid out as vLLM's own
    worker lays it out (see the module's documentation); the worker owns it once built and
    releases it at :meth:`shutdown`. ``None``: a private block-major cache, allocated here, where
    vLLM itself keeps none. ``pin_piece_bytes``: the largest piece the CPU cache is page-locked
    (and registered) in, a whole number of sub-blocks (of the region: chunk rows) each, at least
    one; a region registered a cell at a time takes no larger pieces.
    ``backend``, ``path`` and the other keyword options go to
    :class:`~blockswap.handler.CpuGpuHandlers`.

    A submission is never refused for room (vLLM asserts that every one succeeds): where its
    direction already holds ``max_in_flight`` transfers not yet polled, the finished ones are
    collected for the next :meth:`get_finished`, or the direction's oldest transfer is waited
    for. A spec that cannot be moved returns ``False`` and is logged; it never raises into
    vLLM.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        num_cpu_chunks: int,
        *,
        mmap_region: SharedOffloadRegion | None = None,
        canonical_layout: bool = False,
        backend: BackendName = "auto",
        path: HandlerPath = "auto",
        pin_piece_bytes: int = DEFAULT_PIECE_BYTES,
        **options: Any,
    ) -> None:
        check_int("blocks_per_chunk", blocks_per_chunk, 1)
        check_int("pin_piece_bytes", pin_piece_bytes, 1)
        _vllm_config.check_chunks(num_cpu_chunks)
        if not kv_caches.tensors:
            raise ConfigError("kv_caches holds no tensor")
        # A reference's CanonicalPageMapping (vLLM 0.33 derives one for every layer it can
        # certify, whatever the layout asked for) is read only by the canonical layout: without
        # it, as in vLLM's worker, the cache keeps the direct layout.
        refs = kv_caches.group_data_refs
        if canonical_layout:
            if mmap_region is None:
                raise ConfigError(
                    "canonical_layout keeps the CPU tier in vLLM's shared offload region: the "
                    "worker needs mmap_region"
                )
            for g, group in enumerate(refs):
                for i, r in enumerate(group):
                    if r.mapping is None:
                        raise ConfigError(
                            f"canonical_layout: reference {i} of KV-cache group {g} carries no "
                            "CanonicalPageMapping (vLLM could not certify its layout: offload "
                            "workers must be exactly the TP group, and packed / cross-layer KV "
                            "layouts are not supported); remove canonical_layout from "
                            "kv_connector_extra_config"
                        )
        rows: list[torch.Tensor] = []
        for i, ct in enumerate(kv_caches.tensors):
            t = ct.tensor
            if not t.is_contiguous():
                # vLLM 0.33 hands over strided layer views of a packed layout (all layers
                # interleaved in each block, as DeepSeek-V4's) where HiSparse keeps them apart.
                raise ConfigError(
                    f"KV-cache tensor {i} is not contiguous (strides {tuple(t.stride())}): "
                    "blockswap takes contiguous KV-cache tensors; a packed layout with HiSparse "
                    "(hisparse_host_num_blocks) gives strided layer views, which it does not "
                    "take yet"
                )
            nbytes, page = t.numel() * t.element_size(), int(ct.page_size_bytes)
            if page <= 0 or nbytes % page:
                raise ConfigError(
                    f"KV-cache tensor {i} holds {nbytes} bytes, not a whole number of its pages "
                    f"of {page} bytes (page_size_bytes)"
                )
            rows.append(t.view(torch.int8).view(-1, page))
        # Per group, each tensor it copies with the largest page any of its references copies:
        # references of one group naming one tensor copy the same bytes from the same offset.
        group_pages: list[dict[int, int]] = []
        for g, group in enumerate(refs):
            pages: dict[int, int] = {}
            for r in group:
                if not 0 <= r.tensor_idx < len(rows):
                    raise ConfigError(f"group {g} refers to tensor {r.tensor_idx} of {len(rows)}")
                row = rows[r.tensor_idx].shape[1]
                if not 0 < r.page_size_bytes <= row:
                    raise ConfigError(
                        f"group {g}: a page of {r.page_size_bytes} bytes in tensor "
                        f"{r.tensor_idx}, whose rows are {row} bytes"
                    )
                pages[r.tensor_idx] = max(pages.get(r.tensor_idx, 0), r.page_size_bytes)
            group_pages.append(pages)
        if not any(group_pages):
            raise ConfigError("no KV-cache group refers to a tensor: nothing to offload")
        #: Per vLLM group, the bytes vLLM counts per GPU block: every reference's page, a tensor
        #: named twice counted twice (its ``transfer_size``), though the bytes move once.
        self._block_bytes = [sum(r.page_size_bytes for r in group) for group in refs]

        device = rows[0].device
        on_cuda = device.type == "cuda" and backend != "host"
        self.blocks_per_chunk = f = int(blocks_per_chunk)
        self.num_cpu_chunks = int(num_cpu_chunks)
        if device.index is not None:
            index = device.index
        else:
            index = torch.cuda.current_device() if on_cuda else 0
        #: The private CPU cache's memory (None with a shared region).
        self.host_memory: PinnedRows | None = None
        #: The private CPU cache: ``num_cpu_chunks * blocks_per_chunk`` sub-blocks of every
        #: tensor's page (None with a shared region).
        self.cpu_cache: torch.Tensor | None = None
        #: vLLM's shared offload region holding the CPU cache, owned by the worker once built.
        self.mmap_region: SharedOffloadRegion | None = mmap_region
        #: The ``(address, bytes)`` pieces of the region registered with the engines.
        self.region_pieces: list[tuple[int, int]] = []
        # Pieces of the shared region this worker page-locked, and the device it did so on.
        self._region_pinned: list[int] = []
        self._pin_device = 0
        #: vLLM's views of the region, one per KV-cache tensor (its worker's ``cpu_tensors``:
        #: ``(num_cpu_chunks, blocks_per_chunk * page_size_bytes)`` at the row stride).
        self.cpu_tensors: list[torch.Tensor] = []

        gpu_groups: list[list[torch.Tensor]] = []
        cpu_groups: list[list[torch.Tensor]] = []
        #: vLLM group index -> its first handler group (None: a group without pages). With a
        #: shared region a group has ``blocks_per_chunk`` handler groups, one per sub-block
        #: index in a chunk (times its writer classes, below); otherwise one.
        self._groups: list[int | None] = []
        #: Per vLLM group, its writer classes: ``(num_writers, writer_index, bytes vLLM counts per
        #: block)``, a handler group each per sub-block index. One class ``(1, 0, ...)`` outside
        #: the canonical layout, where every rank stores every block it names.
        self._classes: list[list[tuple[int, int, int]]] = []
        #: The canonical layout (vLLM's ``canonical_layout``): pages parallelism-free in cells
        #: shared by the ranks, each rank moving its fragments of them.
        self.canonical_layout = bool(canonical_layout)
        handler_options = dict(options)
        if mmap_region is None:
            self._fanout = 1
            factor = f
            cpu_groups = self._private_cache(group_pages, rows, on_cuda, index, pin_piece_bytes)
        else:
            self._fanout = f
            factor = 1
            if canonical_layout:
                gpu_groups, cpu_groups = self._canonical_cells(
                    kv_caches, rows, on_cuda, index, pin_piece_bytes
                )
            else:
                cpu_groups, cell = self._region_cells(
                    kv_caches, group_pages, on_cuda, index, pin_piece_bytes
                )
                # The staged plan moves a chunk's cell (every tensor's pages of its blocks) as
                # one cluster: a slot holds one cell.
                handler_options.setdefault("stage_bytes", stage_slot(cell))
            handler_options["host_pieces"] = self.region_pieces
        if not canonical_layout:
            for g, pages in enumerate(group_pages):
                if not pages:
                    self._groups.append(None)
                    self._classes.append([])
                    continue
                self._groups.append(len(gpu_groups))
                self._classes.append([(1, 0, self._block_bytes[g])])
                for _ in range(self._fanout):
                    gpu_groups.append([rows[t][:, :p].unsqueeze(1) for t, p in pages.items()])
        self._single = len(gpu_groups) == 1
        #: How vLLM's groups map to the handlers' groups, and the cut of its specs (the usual
        #: case, every group with one writer, where `GroupMap.plain` is not None).
        self._map = GroupMap(self._groups, self._classes, self._fanout, f, self.num_cpu_chunks)
        plain = self._map.plain
        #: The bytes vLLM counts per block where its one group is one handler group with one
        #: writer (the usual case: a spec goes to the core in one call, see `_submit`), else 0.
        self._one_group = (
            plain[0] if plain is not None and len(plain) == 1 and self._fanout == 1 else 0
        )
        if on_cuda:
            handler_options.setdefault("timing", True)  # transfer_time: the copies' GPU time

        def handlers(prepare: tuple[str, ...]) -> CpuGpuHandlers:
            return CpuGpuHandlers(
                gpu_groups,
                self.num_cpu_chunks,
                layout="mla",
                block_size_factor=factor,
                cpu_caches=cpu_groups,
                backend=backend,
                path=path,
                load_waits_for_compute=True,
                prepare=prepare,
                **handler_options,
            )

        #: Per lane (stores, loads, expedited loads), the jobs in flight in submission order,
        #: each with the empty jobs submitted after it: reported right after it, as transfers of
        #: one direction finish in submission order.
        self._lanes: dict[str, deque[list[int]]] = {k: deque() for k in _LANES}
        #: job id -> its lane, while in flight.
        self._lane_of: dict[int, str] = {}
        #: job id -> the bytes vLLM counts for it, while in flight.
        self._sizes: dict[int, int] = {}
        #: Results for the next poll: empty jobs with nothing before them in their lane, and
        #: those a submission collected to make room (see :meth:`_make_room`).
        self._ready: list[VllmTransferResult] = []
        #: Jobs too large for one transfer, issued in parts (see :mod:`._vllm_parts`).
        self._split = _parts.Split()
        # Until the constructor returns, a shared region stays the caller's (as with vLLM's
        # worker): a failure here releases only what the worker made.
        try:
            self._main = handlers(("d2h", "h2d"))
        except BaseException:
            self._free_cache(release_region=False)
            raise
        try:
            # Expedited loads on an engine of their own: they never queue behind regular loads
            # (it moves nothing GPU -> CPU, so makes no staging ring that way).
            self._expedited = handlers(("h2d",))
        except BaseException:
            self._main.shutdown()
            self._free_cache(release_region=False)
            raise
        #: Per lane, where every group has one writer but the spec is not one handler group
        #: (several blocks a chunk on a shared region, or several KV-cache groups): per vLLM
        #: group its handler's table pairs, one per sub-block of a chunk (none for a group
        #: without pages), for the core's ``submit_spec`` (see `_submit`); else None.
        self._spec_tables: dict[str, tuple[tuple[tuple[int, int], ...], ...]] | None = None
        #: The bytes vLLM counts per block of each group, on that path.
        self._spec_bytes: list[int] = plain or []
        if plain is not None and not self._one_group:
            lanes = {
                "store": self._main.gpu_to_cpu_handler,
                "load": self._main.cpu_to_gpu_handler,
                "expedited": self._expedited.cpu_to_gpu_handler,
            }
            self._spec_tables = {
                lane: tuple(
                    ()
                    if base is None
                    else tuple(h._group_tables(base + j) for j in range(self._fanout))
                    for base in self._groups
                )
                for lane, h in lanes.items()
            }
        log.info(
            "blockswap offloading worker: %d KV-cache group(s), %d tensor(s), CPU cache %s; "
            "store %s; load %s",
            sum(p is not None for p in self._groups),
            len(rows),
            "private" if mmap_region is None else "in vLLM's shared offload region",
            self._main.routes["d2h"].reason,
            self._main.routes["h2d"].reason,
        )

    def _private_cache(
        self,
        group_pages: list[dict[int, int]],
        rows: list[torch.Tensor],
        on_cuda: bool,
        index: int,
        pin_piece_bytes: int,
    ) -> list[list[torch.Tensor]]:
        """Allocates the private block-major cache; returns its views per handler group."""
        # Per tensor, the bytes a CPU sub-block keeps: the largest page any reference copies.
        slot: dict[int, int] = {}
        for pages in group_pages:
            for t, p in pages.items():
                slot[t] = max(slot.get(t, 0), p)
        offset: dict[int, int] = {}
        sub_block = 0
        for t in sorted(slot):
            offset[t] = sub_block
            sub_block += slot[t]
        self.host_memory = PinnedRows(
            self.num_cpu_chunks * self.blocks_per_chunk,
            max(sub_block, 1),
            # At least one row, as in vLLM's region (a row is never split across pieces).
            piece_bytes=max(pin_piece_bytes, sub_block),
            backend="cuda" if on_cuda else "host",
            device=index,
            log_line=False,
        )
        self.cpu_cache = cache = self.host_memory.tensor()
        log.info(
            "CPU KV cache: %.2f GiB (%d chunks of %d blocks, %d bytes each) %s in %.2f s",
            self.host_memory.nbytes / 2**30,
            self.num_cpu_chunks,
            self.blocks_per_chunk,
            sub_block,
            self.host_memory.how(),
            self.host_memory.seconds,
        )
        return [
            [cache[:, offset[t] : offset[t] + p].unsqueeze(1) for t, p in pages.items()]
            for pages in group_pages
            if pages
        ]

    def _region_cells(
        self,
        kv_caches: CanonicalKVCaches,
        group_pages: list[dict[int, int]],
        on_cuda: bool,
        index: int,
        pin_piece_bytes: int,
    ) -> tuple[list[list[torch.Tensor]], int]:
        """vLLM's views of the shared region, made as vLLM's worker makes them (one per KV-cache
        tensor, in order: ``blocks_per_chunk`` pages of the tensor's ``page_size_bytes`` in each
        chunk's cell); the region page-locked on CUDA and cut into the pieces the engines
        register. Returns per handler group ``(g, j)`` the ``j``-th page of each tensor of group
        ``g``, a ``(num_cpu_chunks, 1, page)`` view at the region's row stride, and the bytes of
        this worker's cell of a chunk."""
        region = self._region_chunks()
        f = self.blocks_per_chunk
        need = sum(ct.page_size_bytes for ct in kv_caches.tensors) * f
        if need > region.cpu_page_size:
            raise ConfigError(
                f"the KV-cache tensors take {need} bytes per chunk ({f} blocks of every "
                f"tensor's page), but a cell of the shared offload region holds "
                f"{region.cpu_page_size}: the region was sized for other KV caches"
            )
        self.cpu_tensors = views = [
            region.create_next_worker_view(ct.page_size_bytes * f) for ct in kv_caches.tensors
        ]
        self._register_region(on_cuda, index, pin_piece_bytes)
        page_of = [ct.page_size_bytes for ct in kv_caches.tensors]
        return [
            [
                views[t][:, j * page_of[t] : j * page_of[t] + p].unsqueeze(1)
                for t, p in pages.items()
            ]
            for pages in group_pages
            if pages
            for j in range(f)
        ], need

    def _region_chunks(self) -> SharedOffloadRegion:
        region = self.mmap_region
        assert region is not None
        if region.num_chunks != self.num_cpu_chunks:
            raise ConfigError(
                f"the shared offload region holds {region.num_chunks} chunks, the worker was "
                f"given num_cpu_chunks={self.num_cpu_chunks}"
            )
        return region

    def _register_region(
        self, on_cuda: bool, index: int, pin_piece_bytes: int, whole_rows: bool = False
    ) -> None:
        """The region cut into the pieces the engines register (this rank's cells, or whole
        rows: a page lies inside one cell, so no copy crosses a piece), page-locked on CUDA
        unless vLLM did it."""
        region = self.mmap_region
        assert region is not None
        # This rank's slots, where the region left pre-faulting them to the worker: filled from
        # several threads while the pieces are locked.
        self.region_pieces, fill, files = _region.pieces_and_fill(
            region, pin_piece_bytes, whole_rows
        )
        pin = on_cuda and not region.is_pinned
        try:
            if fill or pin:
                # Portable registrations, in the primary context of the engines' device.
                pieces = self.region_pieces if pin else []
                self._region_pinned = _region.pin_region(pieces, index, fill, files)
                self._pin_device = index
        finally:
            _region.close_files(region)

    def _canonical_cells(
        self,
        kv_caches: CanonicalKVCaches,
        rows: list[torch.Tensor],
        on_cuda: bool,
        index: int,
        pin_piece_bytes: int,
    ) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
        """The canonical layout on vLLM's region, as vLLM's worker lays it out: per tensor a
        view of ``blocks_per_chunk`` canonical pages (the largest ``canonical_page_size_bytes``
        of its references) from the start of each row, shared by every rank
        (``create_next_canonical_view``). Per handler group ``(g, j, writer class)``, the GPU
        and CPU sides of every fragment of the class's references (a tensor named twice: its
        larger page), each fragment a ``(blocks, 1, fragment bytes)`` view: the core moves a
        fragment per page of its table. Returns ``(GPU groups, CPU groups)``."""
        region = self._region_chunks()
        f = self.blocks_per_chunk
        refs = kv_caches.group_data_refs
        canon = [0] * len(rows)
        for group in refs:
            for r in group:
                assert r.mapping is not None  # checked by the constructor
                t = r.tensor_idx
                canon[t] = max(canon[t], r.mapping.canonical_page_size_bytes)
        if not all(canon):
            t = canon.index(0)
            raise ConfigError(f"canonical_layout: no reference names KV-cache tensor {t}")
        need = sum(canon) * f
        if need > region._row_stride:
            raise ConfigError(
                f"canonical_layout: the canonical pages take {need} bytes per chunk ({f} of "
                f"each tensor's), but a row of the shared offload region holds "
                f"{region._row_stride}"
            )
        self.cpu_tensors = views = [region.create_next_canonical_view(c * f) for c in canon]
        gpu_groups: list[list[torch.Tensor]] = []
        cpu_groups: list[list[torch.Tensor]] = []
        for g, group in enumerate(refs):
            if not group:
                self._groups.append(None)
                self._classes.append([])
                continue
            # Per writer class, each tensor's reference (the larger page) and vLLM's count.
            classes: dict[tuple[int, int], dict[int, Any]] = {}
            counted: dict[tuple[int, int], int] = {}
            for r in group:
                m = r.mapping
                key = (int(m.num_writers), int(m.writer_index))
                if not 0 <= key[1] < key[0]:
                    raise ConfigError(
                        f"canonical_layout: group {g} names writer {key[1]} of {key[0]}"
                    )
                per = classes.setdefault(key, {})
                cur = per.get(r.tensor_idx)
                if cur is None or r.page_size_bytes > cur.page_size_bytes:
                    per[r.tensor_idx] = r
                counted[key] = counted.get(key, 0) + r.page_size_bytes
            self._groups.append(len(gpu_groups))
            self._classes.append([(nw, wi, counted[nw, wi]) for nw, wi in classes])
            fragments = [_region.fragments(g, per, rows, canon) for per in classes.values()]
            for j in range(f):
                for frags in fragments:
                    gpu_groups.append(
                        [rows[t][:, lo : lo + n].unsqueeze(1) for t, lo, _, n in frags]
                    )
                    cpu_groups.append([
                        views[t][:, j * canon[t] + co : j * canon[t] + co + n].unsqueeze(1)
                        for t, _, co, n in frags
                    ])  # fmt: skip
        # Page-locked once every mapping is checked: a refused layout leaves nothing locked.
        # Whole rows: every rank reads every rank's canonical pages.
        self._register_region(on_cuda, index, pin_piece_bytes, whole_rows=True)
        return gpu_groups, cpu_groups

    @property
    def handlers(self) -> tuple[CpuGpuHandlers, CpuGpuHandlers]:
        """The handlers of regular transfers and of expedited loads."""
        return self._main, self._expedited

    # ---- vLLM's OffloadingWorker ---------------------------------------------------------------

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        """GPU -> CPU: ``src_spec`` names GPU blocks, ``dst_spec`` CPU chunks."""
        h = self._main.gpu_to_cpu_handler
        return self._submit(h, "store", job_id, src_spec, dst_spec, src_spec)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """CPU -> GPU: ``src_spec`` names CPU chunks, ``dst_spec`` GPU blocks."""
        h = (self._expedited if expedited else self._main).cpu_to_gpu_handler
        lane = "expedited" if expedited else "load"
        return self._submit(h, lane, job_id, src_spec, dst_spec, dst_spec)

    def get_finished(self) -> list[VllmTransferResult]:
        lanes = self._lanes
        for h, busy in (
            (self._main, lanes["store"] or lanes["load"]),
            (self._expedited, lanes["expedited"]),
        ):
            if busy:
                # Else nothing of this handler's is in flight, so nothing to report: vLLM polls
                # every step, and each call into the core costs the caller's thread.
                self._collect(h)
        out, self._ready = self._ready, []
        return out

    def _collect(self, handlers: CpuGpuHandlers) -> None:
        """The results ``handlers`` has, in vLLM's terms, added to :attr:`_ready`: each job's,
        then the empty jobs submitted right after it in its lane."""
        # A failed job is logged once, by the handler that reports it.
        for r in handlers.get_finished():
            done = self._split.reported(r.job_id, r.success, r.bytes, r.seconds)
            if done is not None:
                self._finish(*done)

    def _finish(self, job_id: int, ok: bool, size: int, seconds: float) -> None:
        """Job ``job_id``'s result added to :attr:`_ready`, then the empty jobs submitted right
        after it in its lane."""
        size = self._sizes.pop(job_id, size)
        self._ready.append(VllmTransferResult(job_id, ok, size, seconds))
        lane = self._lane_of.pop(job_id, None)
        if lane is None:
            return
        jobs = self._lanes[lane]
        for k, entry in enumerate(jobs):
            if entry[0] == job_id:
                del jobs[k]
                self._ready.extend(VllmTransferResult(e, True, 0, 0.0) for e in entry[1:])
                break

    def _make_room(self, lane: str) -> bool:
        """Room for one more transfer in ``lane``'s direction, whose engine refused one for want
        of it (``max_in_flight`` transfers in flight or finished but not yet polled, or the
        descriptor pool spent): the finished ones are collected for the next poll, and where
        that frees nothing, the lane's oldest transfer is waited for (or, where the lane has
        none, the oldest of the other direction, which shares the engine's pool). vLLM's own
        worker never refuses a submission, and vLLM asserts that every one succeeds. False where
        there was nothing to collect or wait for."""
        handlers, lanes = (
            (self._expedited, (lane,)) if lane == "expedited" else (self._main, ("store", "load"))
        )
        before = len(self._ready)
        self._collect(handlers)
        if len(self._ready) > before:
            return True
        waiting = [self._lanes[lane]] + [self._lanes[other] for other in lanes if other != lane]
        oldest = next(
            (ids for jobs in waiting if jobs and (ids := self._split.in_flight([jobs[0][0]]))), None
        )
        if oldest is None:
            return False  # nothing in flight to wait for: the transfer cannot fit
        handlers.wait(oldest)
        self._collect(handlers)
        return True

    def wait(self, job_ids: set[int]) -> None:
        """Blocks until the listed jobs in flight finished (ids never submitted, already
        reported or with nothing to move are not waited for); their results still come from
        :meth:`get_finished`. Only the handlers holding them are waited on: vLLM waits for its
        expedited loads before the step that needs them, and for flushed stores, and a wait on
        the other handler would come after them."""
        lanes = [(j, self._lane_of.get(j)) for j in job_ids]
        main = [j for j, lane in lanes if lane == "store" or lane == "load"]
        expedited = [j for j, lane in lanes if lane == "expedited"]
        if main:
            self._main.wait(self._split.in_flight(main))
        if expedited:
            self._expedited.wait(self._split.in_flight(expedited))

    def shutdown(self) -> None:
        """Drains both engines (every accepted transfer runs), then frees the CPU cache: a private
        one unpinned once neither engine holds a registration in it, unmapped once no tensor views
        it; a shared region released as vLLM's worker releases it (``cleanup``), unless an engine
        still had copies in flight when its shutdown timed out (then it stays mapped and
        page-locked for the process: never unmapped under a copy)."""
        for h in (self._expedited, self._main):
            h.shutdown()
        kept = self._main.memory_kept or self._expedited.memory_kept
        if kept and self.mmap_region is not None:
            log.warning(
                "transfers still in flight after shutdown: the CPU offload region %s stays mapped",
                self.mmap_region.mmap_path,
            )
            _kept_regions.append(self.mmap_region)
            self.mmap_region = None
            self._region_pinned = []  # page-locked for the life of the process, as it is mapped
        self._free_cache()

    def _free_cache(self, release_region: bool = True) -> None:
        if self.host_memory is not None:
            try:
                self.host_memory.unpin()
            except Exception as e:  # an engine that timed out keeps it: never freed under a copy
                log.warning("the CPU KV cache stays pinned: %s", e)
        self.host_memory = None
        self.cpu_cache = None
        self.cpu_tensors = []  # views of the region: the mapping closes once none is left
        region, self.mmap_region = self.mmap_region, None
        # What this worker page-locked in the region, undone before the region goes (vLLM's
        # cleanup unpins only what vLLM pinned) or back to the caller.
        _region.unpin_region(self._region_pinned, self._pin_device)
        self._region_pinned = []
        if region is not None and release_region:
            region.cleanup()

    # ---- the mapping -----------------------------------------------------------------------------

    def _submit(
        self,
        handler: Any,
        lane: str,
        job_id: int,
        src: Any,
        dst: Any,
        gpu_spec: GPULoadStoreSpec,
    ) -> bool:
        try:
            size = self._issue_fitting(handler, lane, job_id, src, dst, gpu_spec)
        except Exception as e:
            store = gpu_spec is src
            parts = _parts.too_large(e) and _parts.halves(
                gpu_spec, dst if store else src, self.blocks_per_chunk
            )
            if parts:
                return self._submit_parts(handler, lane, job_id, store, list(parts))
            # A spec vLLM would not send (vLLM asserts that every submission succeeds: its own
            # worker refuses none); an exception would kill vLLM's worker, False names the job.
            log.warning("offloading job %d refused: %s", job_id, e)
            return False
        if size is None:
            self._empty(lane, job_id)
            return True
        self._lanes[lane].append([job_id])
        self._lane_of[job_id] = lane
        self._sizes[job_id] = size
        return True

    def _empty(self, lane: str, job_id: int) -> None:
        """A job with nothing to move: reported right after the jobs before it in its lane."""
        jobs = self._lanes[lane]
        if jobs:
            jobs[-1].append(job_id)
        else:
            self._ready.append(VllmTransferResult(job_id, True, 0, 0.0))

    def _issue_fitting(self, handler: Any, lane: str, *args: Any) -> int | None:
        """:meth:`_issue_spec`, after room was made in the engine where it had none."""
        while True:
            try:
                return self._issue_spec(handler, lane, *args)
            except PoolExhaustedError:
                if not self._make_room(lane):
                    raise

    def _submit_parts(
        self, handler: Any, lane: str, job_id: int, store: bool, todo: list[_parts.Part]
    ) -> bool:
        """A job too large for one transfer issued in parts (see :mod:`._vllm_parts`): reported
        once, when its last part is."""
        self._lanes[lane].append([job_id])
        self._lane_of[job_id] = lane

        def issue(part: int, piece: _parts.Part) -> int | None:
            spec, cpu = piece
            sides = (spec, cpu) if store else (cpu, spec)
            return self._issue_fitting(handler, lane, part, *sides, spec)

        job, refused = self._split.issue(job_id, todo, issue, self.blocks_per_chunk)
        if refused is not None:
            log.warning(
                "offloading job %d refused after %d parts: %s", job_id, len(job.parts), refused
            )
        # Its size is the split's (the bytes of its parts), not in _sizes.
        done = self._split.issued(job_id, refused is None)
        if not job.parts:
            self._lanes[lane].pop()
            del self._lane_of[job_id]
            if refused is not None:
                return False
            self._empty(lane, job_id)  # parts this rank writes nothing of
        if done is not None:
            self._finish(*done)
        return True

    def _issue_spec(
        self,
        handler: Any,
        lane: str,
        job_id: int,
        src: Any,
        dst: Any,
        gpu_spec: GPULoadStoreSpec,
    ) -> int | None:
        """Issues the spec (see :meth:`_submit`): the bytes vLLM counts for it, or None for a
        spec that names no block. Raises what is wrong with it, and
        :class:`~blockswap.PoolExhaustedError`, having issued nothing, where its engine has no
        room for it now."""
        cpu_spec = dst if gpu_spec is src else src
        size = 0  # the bytes vLLM counts, once a path below issued the spec
        if self._one_group:
            # The usual spec, one group from one block index: straight to the core (which
            # wakes the engine's thread, checks the ids and the chunk count, and works out
            # the skip). Anything else, an empty spec included, and a spec the core refuses
            # (which issued nothing) take the general path, which names what is wrong with
            # it in vLLM's words.
            starts = gpu_spec.block_indices
            gpu = gpu_spec.block_ids
            n = len(gpu)
            if n and len(starts) == 1 and type(first := starts[0]) is int and first >= 0:
                cpu = getattr(cpu_spec, "block_ids", cpu_spec)
                try:
                    if gpu_spec is src:
                        handler._issue_group(job_id, gpu, cpu, first)
                    else:
                        handler._issue_group(job_id, cpu, gpu, first)
                except InvalidTransferError:
                    pass
                else:
                    size = n * self._one_group
        elif self._spec_tables is not None:
            # Every other spec where each group has one writer: cut in the core, in one
            # call (`cut_spec`'s rule, as `GroupMap.plain_groups` cuts it), unless it is
            # empty or refused (then the general path names what is wrong in vLLM's words).
            counted = sum(map(operator.mul, gpu_spec.group_sizes, self._spec_bytes))
            if counted:
                cpu = getattr(cpu_spec, "block_ids", cpu_spec)
                try:
                    handler._issue_call(
                        job_id,
                        handler._submit_spec,
                        gpu_spec.block_ids,
                        cpu,
                        gpu_spec.group_sizes,
                        gpu_spec.block_indices,
                        self._spec_tables[lane],
                        self.blocks_per_chunk,
                    )
                except InvalidTransferError:
                    pass
                else:
                    size = counted
        if size:
            return size
        return self._submit_general(handler, lane, job_id, gpu_spec is src, gpu_spec, cpu_spec)

    def _submit_general(
        self,
        handler: Any,
        lane: str,
        job_id: int,
        store: bool,
        gpu_spec: GPULoadStoreSpec,
        cpu_spec: Any,
    ) -> int | None:
        """A spec cut in Python (:meth:`GroupMap.plain_groups`, or :meth:`GroupMap.split` where a
        group has several writers) and issued: the bytes vLLM counts for it, or None for a spec
        that names no block (recorded to be reported right after the jobs submitted before it
        in its lane). Raises what is wrong with the spec, in vLLM's words."""
        handler.wake()  # the engine's thread wakes while the specs are read
        if self._map.plain is not None:
            groups, n, size = self._map.plain_groups(handler, gpu_spec, cpu_spec)
        else:
            gpu_ids, cpu_ids, starts, size = self._map.split(gpu_spec, cpu_spec, lane == "store")
            n = sum(g.shape[0] for g in gpu_ids)
        if not n:
            return None
        if self._map.plain is not None:
            handler._issue(job_id, groups)
        else:
            sides: tuple[Any, Any] = (gpu_ids, cpu_ids) if store else (cpu_ids, gpu_ids)
            if self._single:
                sides = (sides[0][0], sides[1][0])
            handler.transfer_async(job_id, sides, block_indices=starts)
        return size


#: Regions an engine could still copy into when its shutdown timed out: kept for the process.
_kept_regions: list[SharedOffloadRegion] = []

#: The lanes of a worker's transfers: each keeps its jobs in submission order.
_LANES = ("store", "load", "expedited")


def __getattr__(name: str) -> Any:
    from ._vllm_spec_classes import MADE

    make = MADE.get(name)
    if make is not None:
        cls = make()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
