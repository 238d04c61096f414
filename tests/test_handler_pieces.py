"""Tests of blockswap.handler with a CPU cache registered in small pieces: the bytes move as they
do through one registration of the whole."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from blockswap.handler import CpuGpuHandlers
from kv_helpers import FACTORS

# --------------------------------------------------------------------------------------------
# A CPU cache registered in pieces
# --------------------------------------------------------------------------------------------


def _kv_pages_of_1_kib(layers: int, n: int, device: str = "cpu", seed: int = 0) -> list:
    """Layer tensors of K and V pages of 1 KiB (fp16, 4 tokens x 2 heads x 64), views of one
    allocation: a block-major CPU sub-block is ``layers`` x 2 KiB."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randint(0, 256, (layers, 2, n, 4, 2, 128), dtype=torch.uint8, generator=gen)
    buf = buf.to(device)
    return [buf[i].view(torch.float16) for i in range(layers)]


def _same_moves(a: CpuGpuHandlers, b: CpuGpuHandlers, factor: int, n_cpu: int) -> None:
    """Runs one sequence of transfers on both handlers (consecutive CPU blocks across piece
    boundaries, partial first and last CPU blocks, scattered ids) and checks that both caches
    and both GPU sides hold the same bytes after each."""
    n_gpu = a.gpu_tables[0].num_blocks
    rng = np.random.default_rng(factor)
    skip = 1 % factor
    moves: list[tuple[str, Any, Any, int]] = [
        # Three consecutive CPU blocks from sub-block `skip`, then the same from the end.
        ("d2h", np.arange(3 * factor - skip), [1, 2, 3], skip),
        ("d2h", np.arange(n_gpu - 2 * factor, n_gpu), [n_cpu - 2, n_cpu - 1], 0),
        ("d2h", rng.permutation(n_gpu)[: 2 * factor], rng.permutation(n_cpu)[:2], 0),
        ("h2d", [1, 2, 3], np.arange(n_gpu - 3 * factor + skip, n_gpu), skip),
        ("h2d", [n_cpu - 1, n_cpu - 2, 0], rng.permutation(n_gpu)[: 3 * factor - skip], skip),
    ]
    for job, (direction, src, dst, start) in enumerate(moves):
        for h in (a, b):
            handler = h.d2h if direction == "d2h" else h.h2d
            assert handler.transfer_async(job, (src, dst), block_indices=[start]) is True
            h.wait([job])
            assert [(r.job_id, r.success) for r in h.get_finished()] == [(job, True)], job
        for ta, tb in zip(a.cpu_caches[0], b.cpu_caches[0]):
            assert torch.equal(ta.view(torch.uint8).cpu(), tb.view(torch.uint8).cpu()), job
        for ta, tb in zip(a.gpu_caches[0], b.gpu_caches[0]):
            assert torch.equal(ta.view(torch.uint8).cpu(), tb.view(torch.uint8).cpu()), job


@pytest.mark.parametrize("factor", FACTORS)
@pytest.mark.parametrize(
    ("cpu_layout", "path"), [("block_major", "dma"), ("block_major", "blocks"), ("mirror", "dma")]
)
def test_a_cache_in_small_pieces_moves_the_bytes_of_one_registered_whole(
    cpu_layout: str, path: str, factor: int, caplog: pytest.LogCaptureFixture
) -> None:
    """The handler's own CPU cache in pieces of 3 sub-blocks (a mirrored one: 12 pages) against
    the same cache in one piece: the same transfers leave the same bytes on both sides."""
    layers, n_cpu = 2, 12
    row = layers * 2 * 1024  # a block-major sub-block: one page-sized piece row
    common: dict[str, Any] = {
        "layout": "kv_split",
        "block_size_factor": factor,
        "backend": "host",
        "path": path,
        "cpu_layout": cpu_layout,
    }
    # The same bytes in two allocations of the same layout.
    whole = CpuGpuHandlers(_kv_pages_of_1_kib(layers, 48), n_cpu, **common)
    with caplog.at_level("INFO", logger="blockswap.handler"):
        pieces = CpuGpuHandlers(
            _kv_pages_of_1_kib(layers, 48), n_cpu, pin_piece_bytes=3 * row, **common
        )
    try:
        assert [len(m.pieces) for m in whole.host_memory] == [1] * len(whole.host_memory)
        sub_blocks = n_cpu * factor
        if cpu_layout == "block_major":
            (m,) = pieces.host_memory
            assert m.nbytes == sub_blocks * row  # exactly the cache, no rounding
            assert [n for _, n in m.pieces] == [3 * row] * (sub_blocks // 3)
            assert f"in {sub_blocks // 3} pieces (1 allocation)" in caplog.text
            if path == "blocks":
                # Pieces of whole sub-blocks leave every block one 2-D copy.
                assert pieces.block_plans == whole.block_plans
        else:
            assert [len(m.pieces) for m in pieces.host_memory] == [sub_blocks * 2 // 12] * layers
        _same_moves(whole, pieces, factor, n_cpu)
    finally:
        whole.shutdown()
        pieces.shutdown()
    assert pieces.host_memory == () and pieces.cpu_chunks is None


@pytest.mark.cuda
@pytest.mark.parametrize("factor", FACTORS)
@pytest.mark.parametrize("path", ["dma", "kernel", "blocks"])
def test_cuda_a_cache_in_small_pieces_moves_the_bytes_of_one_registered_whole(
    path: str, factor: int
) -> None:
    """On the GPU, the handler's own CPU cache page-locked in pieces of 3 sub-blocks (separate
    driver registrations) against one piece: the same bytes both ways, by every copy path."""
    layers, n_cpu = 4, 24
    row = layers * 2 * 1024
    common: dict[str, Any] = {"layout": "kv_split", "block_size_factor": factor, "path": path}
    whole = CpuGpuHandlers(_kv_pages_of_1_kib(layers, 96, device="cuda"), n_cpu, **common)
    pieces = CpuGpuHandlers(
        _kv_pages_of_1_kib(layers, 96, device="cuda"), n_cpu, pin_piece_bytes=3 * row, **common
    )
    try:
        assert pieces.backend == "cuda"
        (m,) = pieces.host_memory
        assert m.pinned and len(m.pieces) == n_cpu * factor // 3
        assert all(t.is_pinned() for t in pieces.cpu_caches[0])
        _same_moves(whole, pieces, factor, n_cpu)
    finally:
        whole.shutdown()
        pieces.shutdown()
    assert not m.pinned
