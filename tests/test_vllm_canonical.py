"""vLLM's canonical layout (``canonical_layout``) through blockswap's worker: pages stored
parallelism-free in cells of vLLM's shared offload region that every rank shares, each rank moving
the fragments its ``CanonicalPageMapping`` names, ranks holding identical bytes taking turns.

Ported from vLLM 0.33's ``tests/v1/kv_offload/cpu/test_canonical_layout.py`` (read from vLLM's
repository), the worker-level cases and their assertions kept. What changed, and why:

- vLLM's ``SingleDirectionOffloadingHandler(canonical_layout=True)`` is
  :class:`~blockswap.vllm.BlockswapOffloadingWorker` with ``canonical_layout=True`` over a
  ``SharedOffloadRegion`` (blockswap's worker takes vLLM's region, as vLLM's does in production);
  its transfers are ``submit_store`` / ``submit_load`` with vLLM's specs.
- The "GPU" tensors are CPU tensors on the host backend (no GPU in CI); marked ``cuda``, the same
  cases run on the GPU.
- The unit tests of vLLM's private helpers (``_build_copy_plan``, ``_canonical_page_ids``,
  ``_canonical_block_sizes``) are covered by what they compute: the bytes in the region, the
  writer rotation and the canonical page size a tensor's view gets.
- Added: writer rotation through the worker (vLLM tests its page-id helper only), the
  refusals, the tiering spec built by vLLM's factory with ``canonical_layout``, and a
  cross-topology round trip in launches of one block each.
"""

from __future__ import annotations

import traceback
import uuid
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed")
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    CanonicalPageMapping,
    CopyRun,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

from blockswap import _core
from blockswap.errors import ConfigError
from blockswap.vllm import BlockswapOffloadingWorker

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]

# 4-token NHD page, 4 total heads of 64 bytes: canonical page holds
# [K: token x head][V: token x head] = 2048 bytes per block (vLLM's test's geometry).
TOTAL_HEADS = 4
HEAD_BYTES = 64
BLOCK_TOKENS = 4
CANONICAL_PAGE = 2 * BLOCK_TOKENS * TOTAL_HEADS * HEAD_BYTES


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """vLLM's ``CPULoadStoreSpec`` (its module imports most of vLLM): chunk ids."""


def backend_of(device: str) -> str:
    return "host" if device == "cpu" else "cuda"


def shard_mapping(tp: int, rank: int) -> CanonicalPageMapping:
    """A rank's head-shard mapping into the canonical NHD page at tensor parallelism ``tp``."""
    local_heads = TOTAL_HEADS // tp
    frag = local_heads * HEAD_BYTES
    row = TOTAL_HEADS * HEAD_BYTES
    k_run = CopyRun(0, rank * frag, frag, BLOCK_TOKENS, frag, row)
    v_run = CopyRun(BLOCK_TOKENS * frag, BLOCK_TOKENS * row + rank * frag, frag, BLOCK_TOKENS,
                    frag, row)  # fmt: skip
    return CanonicalPageMapping(CANONICAL_PAGE, 2 * BLOCK_TOKENS * frag, (k_run, v_run), 1, 0, True)


def whole_page_mapping() -> CanonicalPageMapping:
    identity = CopyRun(0, 0, CANONICAL_PAGE, 1, CANONICAL_PAGE, CANONICAL_PAGE)
    return CanonicalPageMapping(CANONICAL_PAGE, CANONICAL_PAGE, (identity,), 1, 0, True)


def head_shard(full_kv: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """A rank's local page rows out of the ``(blocks, 2, tokens, heads, head bytes)`` truth."""
    local_heads = TOTAL_HEADS // tp
    shard = full_kv[:, :, :, rank * local_heads : (rank + 1) * local_heads, :]
    return shard.reshape(full_kv.shape[0], -1).contiguous()


def caches_of(gpu: torch.Tensor, mapping: CanonicalPageMapping) -> CanonicalKVCaches:
    page = mapping.local_page_size_bytes
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=gpu, page_size_bytes=page)],
        group_data_refs=[
            [CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=page, mapping=mapping)]
        ],
    )


class Ranks:
    """Workers of one engine's ranks over one shared region (each rank's own mapping of it, as
    vLLM's ranks map it), kept alive until the test ends: the region's file lives as long."""

    def __init__(self, num_chunks: int, bpc: int = 1) -> None:
        self.engine_id = str(uuid.uuid4())
        self.num_chunks = num_chunks
        self.bpc = bpc
        self.workers: list[BlockswapOffloadingWorker] = []

    def worker(
        self,
        kv: CanonicalKVCaches,
        rank: int,
        world: int,
        device: str,
        *,
        replicated: bool = False,
        **options: Any,
    ) -> BlockswapOffloadingWorker:
        row = SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT
        assert row >= CANONICAL_PAGE * self.bpc
        region = SharedOffloadRegion(
            engine_id=self.engine_id,
            num_chunks=self.num_chunks,
            rank=0 if replicated else rank,
            kv_bytes_per_chunk=row,
            cpu_page_size=row if replicated else row // world,
        )
        try:
            w = BlockswapOffloadingWorker(
                kv, self.bpc, self.num_chunks, mmap_region=region, canonical_layout=True,
                backend=backend_of(device), **options,
            )  # fmt: skip
        except BaseException:
            region.cleanup()  # the caller's until the worker is built, as with vLLM's worker
            raise
        self.workers.append(w)
        if device == "cuda":
            # A rank's fragments take the direct plan (the staged kernel on the region in
            # place); a whole canonical page (one rank) is a block's row: the staged plan.
            want = {"direct"} if world > 1 and not replicated else {"direct", "staged"}
            for h in w.handlers:
                assert {r.plan for r in h.routes.values()} <= want, h.routes
        return w

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()


def transfer(w: BlockswapOffloadingWorker, store: bool, job: int, n: int) -> Any:
    """Blocks ``0..n-1`` to or from chunks ``0..n/bpc-1``; the result."""
    gpu = GPULoadStoreSpec(list(range(n)), (n,), (0,))
    cpu = CPULoadStoreSpec(list(range(-(-n // w.blocks_per_chunk))))
    ok = w.submit_store(job, gpu, cpu) if store else w.submit_load(job, cpu, gpu)
    assert ok is True
    w.wait({job})
    (r,) = w.get_finished()
    assert (r.job_id, r.success) == (job, True)
    return r


@pytest.mark.parametrize("device", DEVICES)
def test_roundtrip_assembles_canonical_page_across_ranks(device: str) -> None:
    """Two TP2 ranks scatter into one shared canonical page such that each rank reloads
    bit-exact and a whole-page (TP1) reader sees both shards: the cross-topology contract."""
    torch.manual_seed(0)
    num_blocks = 4
    gpu_rank = [torch.randint(-128, 128, (num_blocks, 1024), dtype=torch.int8).to(device)
                for _ in range(2)]  # fmt: skip
    ranks = Ranks(num_blocks)
    try:
        for rank in (0, 1):
            w = ranks.worker(caches_of(gpu_rank[rank], shard_mapping(2, rank)), rank, 2, device)
            r = transfer(w, True, 1, num_blocks)
            assert r.transfer_size == num_blocks * 1024  # vLLM's count: the fragments' bytes
        canonical = ranks.workers[0].cpu_tensors[0]
        assert tuple(canonical.shape) == (num_blocks, CANONICAL_PAGE)
        # An independent oracle: each rank's runs replayed in numpy.
        expected = np.zeros((num_blocks, CANONICAL_PAGE), dtype=np.int8)
        for rank in (0, 1):
            local = gpu_rank[rank].cpu().numpy()
            for run in shard_mapping(2, rank).runs:
                for i in range(run.num_fragments):
                    lo = run.local_offset + i * run.local_stride
                    co = run.canonical_offset + i * run.canonical_stride
                    expected[:, co : co + run.fragment_size] = local[:, lo : lo + run.fragment_size]
        assert np.array_equal(canonical.numpy(), expected)

        # Each rank reloads its shard bit-exact.
        back = torch.zeros(num_blocks, 1024, dtype=torch.int8, device=device)
        transfer(ranks.worker(caches_of(back, shard_mapping(2, 0)), 0, 2, device), False, 2, 4)
        assert torch.equal(back, gpu_rank[0])
        # A whole-page reader (TP1) sees the assembled page.
        full = torch.zeros(num_blocks, CANONICAL_PAGE, dtype=torch.int8, device=device)
        transfer(ranks.worker(caches_of(full, whole_page_mapping()), 0, 1, device), False, 3, 4)
        assert np.array_equal(full.cpu().numpy(), expected)
    finally:
        ranks.close()


def roundtrip_across(
    ranks: Ranks, writer_tp: int, reader_tp: int, num_blocks: int, device: str, **options: Any
) -> None:
    """``num_blocks`` blocks of random KV stored by ``writer_tp`` ranks and loaded by
    ``reader_tp`` ranks, each reader's bytes checked against the writers' ground truth."""
    full_kv = torch.randint(-128, 128, (num_blocks, 2, BLOCK_TOKENS, TOTAL_HEADS, HEAD_BYTES),
                            dtype=torch.int8)  # fmt: skip
    for rank in range(writer_tp):
        gpu = head_shard(full_kv, writer_tp, rank).to(device)
        w = ranks.worker(caches_of(gpu, shard_mapping(writer_tp, rank)), rank, writer_tp,
                         device, **options)  # fmt: skip
        transfer(w, True, 1, num_blocks)
    for rank in range(reader_tp):
        expected = head_shard(full_kv, reader_tp, rank)
        out = torch.zeros_like(expected, device=device)
        w = ranks.worker(caches_of(out, shard_mapping(reader_tp, rank)), rank, reader_tp,
                         device, **options)  # fmt: skip
        transfer(w, False, 2, num_blocks)
        assert torch.equal(out.cpu(), expected), (
            f"reader tp={reader_tp} rank={rank} bytes diverge from the tp={writer_tp} "
            "writers' ground truth"
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(2, 4), (4, 2), (2, 1), (4, 4)])
def test_cross_topology_roundtrip(writer_tp: int, reader_tp: int, device: str) -> None:
    """KV written at one tp is readable at another: writer ranks scatter head shards into the
    shared canonical region, reader ranks gather their own shards, and every reader sees the
    writers' ground-truth bytes."""
    torch.manual_seed(0)
    ranks = Ranks(3)
    try:
        roundtrip_across(ranks, writer_tp, reader_tp, 3, device)
    finally:
        ranks.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_round_trip_in_launches_of_one_block_each_moves_every_fragment(device: str) -> None:
    """The direct plan with ``kernel_launch_bytes=1``: a launch per block, on the GPU each after
    the first started while the one before it ends (chained launches); written at TP=4 and read
    at TP=2 (every rank of both a worker whose routes carry the bound), every reader's bytes are
    the writers'."""
    torch.manual_seed(1)
    ranks = Ranks(24)
    try:
        roundtrip_across(ranks, 4, 2, 24, device, kernel_launch_bytes=1)
        if device == "cuda":
            bounds = {r.launch_bytes for w in ranks.workers for h in w.handlers
                      for r in h.routes.values()}  # fmt: skip
            assert bounds == {1}, bounds
    finally:
        ranks.close()


@pytest.mark.parametrize("device", DEVICES[1:])
def test_a_worker_whose_transfers_are_all_direct_holds_no_staging_ring(device: str) -> None:
    """A rank's fragments take the direct plan both ways, which stages no row: its lanes make
    no staging slots, however large ``stage_bytes`` (here 4 x 512 MiB if they did)."""
    torch.manual_seed(2)
    gpu = torch.randint(-128, 128, (4, 1024), dtype=torch.int8, device=device)
    ranks = Ranks(4)
    try:
        torch.cuda.synchronize()
        free = torch.cuda.mem_get_info()[0]
        w = ranks.worker(caches_of(gpu, shard_mapping(2, 0)), 0, 2, device,
                         stage_bytes=512 << 20)  # fmt: skip
        transfer(w, True, 1, 4)
        back = torch.zeros_like(gpu)
        w2 = ranks.worker(caches_of(back, shard_mapping(2, 0)), 0, 2, device,
                          stage_bytes=512 << 20)  # fmt: skip
        transfer(w2, False, 2, 4)
        assert torch.equal(back, gpu)
        torch.cuda.synchronize()
        assert free - torch.cuda.mem_get_info()[0] < 256 << 20
    finally:
        ranks.close()


@pytest.mark.parametrize("device", DEVICES)
def test_ranks_holding_identical_bytes_take_turns_writing(device: str) -> None:
    """Two ranks holding the same page (an MLA latent under TP=2): rank ``w`` writes the
    canonical pages ``p`` with ``p % 2 == w`` (vLLM's ``is_writer``, ``p = chunk *
    blocks_per_chunk + sub-block``), reports the bytes it moved, and loads read every page."""
    torch.manual_seed(1)
    bpc, n_chunks, page = 2, 4, 512
    n = n_chunks * bpc
    data = torch.randint(-128, 128, (n, page), dtype=torch.int8)
    identity = (CopyRun(0, 0, page, 1, page, page),)
    ranks = Ranks(n_chunks, bpc)
    try:
        workers = []
        for rank in (0, 1):
            m = CanonicalPageMapping(page, page, identity, 2, rank, True)
            kv = caches_of(data.clone().to(device), m)
            workers.append(ranks.worker(kv, rank, 2, device, replicated=True))
        view = workers[0].cpu_tensors[0]
        assert tuple(view.shape) == (n_chunks, bpc * page)

        def pages() -> torch.Tensor:  # page id = chunk * bpc + sub-block (a copy: rows strided)
            return view.reshape(n_chunks, bpc, page).reshape(n, page)

        r = transfer(workers[0], True, 1, n)
        assert r.transfer_size == n // 2 * page
        even = torch.arange(n) % 2 == 0
        assert torch.equal(pages()[even], data[even]) and not pages()[~even].any()
        transfer(workers[1], True, 1, n)
        assert torch.equal(pages(), data)
        # A non-writer's share of a store may be empty: it still reports, and moves nothing.
        only_mine = GPULoadStoreSpec([0], (1,), (0,))
        assert workers[1].submit_store(2, only_mine, CPULoadStoreSpec([0])) is True
        (r,) = workers[1].get_finished()
        assert (r.job_id, r.success, r.transfer_size) == (2, True, 0)
        # Loads read every page, whoever wrote it.
        back = torch.zeros(n, page, dtype=torch.int8, device=device)
        m = CanonicalPageMapping(page, page, identity, 2, 1, True)
        transfer(ranks.worker(caches_of(back, m), 1, 2, device, replicated=True), False, 3, n)
        assert torch.equal(back.cpu(), data)
    finally:
        ranks.close()


def test_canonical_layout_refuses_what_it_cannot_lay_out() -> None:
    gpu = torch.zeros(4, 1024, dtype=torch.int8)
    kv = caches_of(gpu, shard_mapping(2, 0))
    with pytest.raises(ConfigError, match="shared offload region"):
        BlockswapOffloadingWorker(kv, 1, 4, canonical_layout=True, backend="host")
    uncertified = CanonicalKVCaches(kv.tensors, [[CanonicalKVCacheRef(0, 1024)]])
    ranks = Ranks(4)
    try:
        with pytest.raises(ConfigError, match="carries no CanonicalPageMapping"):
            ranks.worker(uncertified, 0, 2, "cpu")
        past = CanonicalPageMapping(2048, 1024, (CopyRun(512, 0, 1024, 1, 1024, 1024),), 1, 0,
                                    True)  # fmt: skip
        with pytest.raises(ConfigError, match="reaches past"):
            ranks.worker(caches_of(gpu, past), 0, 2, "cpu")
    finally:
        ranks.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_refused_canonical_layout_leaves_the_region_unlocked(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mapping whose run reaches past its page is refused before the region is page-locked:
    the region goes back to the caller as it came (it was left page-locked for the process)."""
    gpu = torch.zeros(4, 1024, dtype=torch.int8, device=device)
    past = CanonicalPageMapping(2048, 1024, (CopyRun(512, 0, 1024, 1, 1024, 1024),), 1, 0, True)
    registered: list[bool] = []
    monkeypatch.setattr(
        BlockswapOffloadingWorker,
        "_register_region",
        lambda self, on_cuda, *a: registered.append(on_cuda),
    )
    row = SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT
    region = SharedOffloadRegion(
        engine_id=str(uuid.uuid4()), num_chunks=4, rank=0, kv_bytes_per_chunk=row,
        cpu_page_size=row // 2,
    )  # fmt: skip
    try:
        with pytest.raises(ConfigError, match="reaches past"):
            BlockswapOffloadingWorker(
                caches_of(gpu, past), 1, 4, mmap_region=region, canonical_layout=True,
                backend=backend_of(device),
            )  # fmt: skip
        assert registered == []
        if device == "cuda":
            assert _core.cuda_memory_kind(region.base_tensor.data_ptr()) is None
        monkeypatch.undo()
        # The same region then takes a worker whose mapping fits, and it is locked on CUDA.
        w = BlockswapOffloadingWorker(
            caches_of(gpu, shard_mapping(2, 0)), 1, 4, mmap_region=region,
            canonical_layout=True, backend=backend_of(device),
        )  # fmt: skip
        region = None  # the worker's now
        try:
            if device == "cuda":
                base = w.mmap_region.base_tensor.data_ptr()
                assert _core.cuda_memory_kind(base) == "host"
        finally:
            w.shutdown()
    finally:
        if region is not None:
            region.cleanup()


def test_the_tiering_spec_lays_out_the_canonical_layout_and_the_cpu_spec_names_it() -> None:
    """vLLM 0.33 lays the canonical layout out in its tiering spec (its CPU spec ignores the
    option): ``BlockswapTieringOffloadingSpec`` certifies the references with vLLM's own check
    and builds a canonical worker; ``BlockswapOffloadingSpec`` refuses the option naming the
    tiering spec."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from test_vllm_spec import offloading_config

    with pytest.raises(ValueError, match="BlockswapTieringOffloadingSpec"):
        OffloadingSpecFactory.create_spec(offloading_config(canonical_layout=True))
    cfg = offloading_config(
        canonical_layout=True, spec_name="BlockswapTieringOffloadingSpec",
        engine_id=str(uuid.uuid4()),
    )  # fmt: skip
    spec = OffloadingSpecFactory.create_spec(cfg)
    gpu = torch.randint(-128, 128, (16, 256), dtype=torch.int8)
    m = CanonicalPageMapping(256, 256, (CopyRun(0, 0, 256, 1, 256, 256),), 1, 0, True)
    with pytest.raises(RuntimeError, match="could not be certified"):
        spec.create_worker(CanonicalKVCaches([CanonicalKVCacheTensor(gpu, 256)],
                                             [[CanonicalKVCacheRef(0, 256)]]))  # fmt: skip
    w = spec.get_worker(caches_of(gpu, m))
    try:
        assert isinstance(w, BlockswapOffloadingWorker) and w.canonical_layout
        assert spec.all_layers_portable is True
        f = w.blocks_per_chunk
        transfer(w, True, 1, 2 * f)
        assert torch.equal(w.cpu_tensors[0][:2].reshape(2 * f, 256), gpu[: 2 * f])
    finally:
        w.shutdown()


def _tp2_rank(rank: int, engine_id: str, barrier: Any, out: Any) -> None:
    """Rank ``rank`` of TP=2 in its own process: ``BlockswapTieringOffloadingSpec`` from vLLM's
    factory with ``canonical_layout``, two per-layer tensors of one head of two, each rank's
    ``CanonicalPageMapping`` scattering its head into the shared canonical pages; stores on both
    ranks at once, then every canonical page checked whole, then each rank's loads."""
    try:
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        from test_vllm_spec import offloading_config

        cfg = offloading_config(
            canonical_layout=True, spec_name="BlockswapTieringOffloadingSpec",
            engine_id=engine_id, rank=rank, world_size=2,
        )  # fmt: skip
        spec = OffloadingSpecFactory.create_spec(cfg)
        gen = torch.Generator().manual_seed(3)  # the same truth in both processes
        # Per tensor: (blocks, K/V, 2 tokens, 2 heads, 64 bytes); a rank holds one head.
        full = [torch.randint(-128, 128, (16, 2, 2, 2, 64), dtype=torch.int8, generator=gen)
                for _ in range(2)]  # fmt: skip
        shards = [f[:, :, :, rank : rank + 1, :].reshape(16, 256).contiguous() for f in full]
        k = CopyRun(0, rank * 64, 64, 2, 64, 128)
        v = CopyRun(128, 256 + rank * 64, 64, 2, 64, 128)
        m = CanonicalPageMapping(512, 256, (k, v), 1, 0, True)
        kv = CanonicalKVCaches([CanonicalKVCacheTensor(s, 256) for s in shards],
                               [[CanonicalKVCacheRef(0, 256, m), CanonicalKVCacheRef(1, 256, m)]])  # fmt: skip
        before = [s.clone() for s in shards]
        w = spec.get_worker(kv)
        try:
            assert isinstance(w, BlockswapOffloadingWorker) and w.canonical_layout
            barrier.wait(60)
            transfer(w, True, 1, 8)  # blocks 0-7 into chunks 0-3, both ranks at once
            barrier.wait(60)
            whole = all(
                torch.equal(view[c], f[2 * c : 2 * c + 2].reshape(-1))
                for view, f in zip(w.cpu_tensors, full)
                for c in range(4)
            )
            for s in shards:
                s.zero_()
            transfer(w, False, 2, 8)
            exact = all(
                torch.equal(s[:8], b[:8]) and not s[8:].any() for s, b in zip(shards, before)
            )
            out.put((rank, None, whole, exact))
            barrier.wait(60)
        finally:
            w.shutdown()
    except Exception:  # reported to the parent, which fails the test with it
        out.put((rank, traceback.format_exc(), False, False))
        barrier.abort()


def test_two_tp_ranks_from_vllms_factory_assemble_canonical_pages() -> None:
    """TP=2 in two processes, each built by vLLM's factory from the same
    ``kv_connector_extra_config`` with ``canonical_layout``: both ranks' stores at once fill
    every canonical page whole (each rank its head), and each rank loads its own back."""
    from test_vllm import two_ranks

    results = two_ranks(_tp2_rank, str(uuid.uuid4()))
    assert all(whole and exact for _, _, whole, exact in results), results
