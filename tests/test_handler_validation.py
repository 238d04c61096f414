"""Tests of blockswap.handler's refusals: a bad transfer raises a typed error, issues nothing and
leaves earlier transfers unaffected; bad construction arguments are named."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

import blockswap
from blockswap import BlockswapError, ConfigError, InvalidTransferError
from blockswap.handler import CpuGpuHandlers, SingleDirectionHandler
from blockswap.layout import LayoutError
from kv_helpers import (
    CASES,
    N_CPU,
    N_GPU,
    apply_move,
    assert_storage,
    fill_random,
    kv_split,
    make,
    snapshot,
    strided,
)

# --------------------------------------------------------------------------------------------
# Validation: typed errors, nothing issued, earlier transfers unaffected
# --------------------------------------------------------------------------------------------


@dataclass
class SpecObj:
    """Stands in for vLLM's BlockIDsLoadStoreSpec."""

    block_ids: Any


BAD_D2H: list[tuple[str, Any, str]] = [
    # (name, spec, message) for the GPU -> CPU handler, factor 4 (GPU ids, CPU ids)
    ("gpu-out-of-range", ([0, N_GPU], [5]), "GPU block ids hold block id 16, out of range"),
    ("gpu-negative", ([-1, 2], [5]), "GPU block ids hold a negative block id"),
    ("cpu-out-of-range", ([0, 1], [N_CPU]), "CPU block ids hold block id 8, out of range"),
    ("cpu-negative", ([0, 1], [-2]), "CPU block ids hold a negative block id"),
    ("cpu-repeated", ([0, 1, 2, 3, 4], [5, 5]), "CPU block id 5 is a destination more than once"),
    (
        "too-many-cpu",
        ([0, 1], [4, 5]),
        r"2 GPU blocks from sub-block 0 of the first CPU block take "
        r"ceil\(\(0 \+ 2\) / 4\) = 1 CPU block ids \(4 sub-blocks each\), got 2",
    ),
    ("too-few-cpu", ([0, 1, 2, 3, 4], [5]), r"= 2 CPU block ids \(4 sub-blocks each\), got 1"),
    ("float", (np.array([0.0, 1.0]), [5]), "must hold integers"),
    ("bool", (np.array([True]), [5]), "must hold integers"),
    ("float-tensor", (torch.tensor([0.0]), [5]), "must hold integers"),
    ("2d", (np.zeros((1, 2), dtype=np.int64), [5]), "must be one-dimensional"),
    ("huge-uint", (np.array([2**64 - 1], dtype=np.uint64), [5]), r"past 2\*\*63 - 1"),
    ("empty", ([], []), "empty transfer"),
    ("not-a-pair", ([0], [5], [1]), r"spec must be a pair \(.*\), not a tuple of 3 items"),
    ("none", None, r"spec must be a pair \(.*\), not None"),
]
BAD_H2D: list[tuple[str, Any, str]] = [
    # (name, spec, message) for the CPU -> GPU handler, factor 4 (CPU ids, GPU ids)
    ("gpu-repeated", ([5], [8, 9, 8]), "GPU block id 8 is a destination more than once"),
    ("gpu-out-of-range", ([5], [8, 99]), "GPU block ids hold block id 99"),
    ("cpu-out-of-range", ([9], [8]), "CPU block ids hold block id 9"),
    ("lengths", ([5, 4], [8]), "1 GPU blocks from sub-block 3 of the first CPU block take"),
]


def _validation_handlers(factor: int = 4) -> tuple[CpuGpuHandlers, list[torch.Tensor]]:
    gpu = kv_split(torch.bfloat16)
    h = CpuGpuHandlers(gpu, N_CPU, layout="kv_split", block_size_factor=factor, backend="host")
    fill_random(gpu + h.cpu_caches[0], torch.Generator().manual_seed(3))
    return h, gpu


@pytest.mark.parametrize(
    ("direction", "spec", "match"),
    [("d2h", s, m) for _, s, m in BAD_D2H] + [("h2d", s, m) for _, s, m in BAD_H2D],
    ids=[f"d2h-{n}" for n, _, _ in BAD_D2H] + [f"h2d-{n}" for n, _, _ in BAD_H2D],
)
def test_bad_transfer_raises_typed_error_and_issues_nothing(
    direction: str, spec: Any, match: str
) -> None:
    h, gpu = _validation_handlers()
    try:
        (cpu,) = h.cpu_caches
        handler = h.d2h if direction == "d2h" else h.h2d
        dst = cpu if direction == "d2h" else gpu
        src = gpu if direction == "d2h" else cpu
        s0, d0 = snapshot(src), snapshot(dst)
        # an earlier transfer, in flight or done, into other destination blocks
        early = ([0, 1, 2, 3], [0]) if direction == "d2h" else ([0], [12, 13, 14, 15])
        handler.transfer_async(1, early)
        with pytest.raises(InvalidTransferError, match=match) as e:
            handler.transfer_async(2, spec)
        assert isinstance(e.value, BlockswapError)
        assert f"{direction} job 2" in str(e.value)
        h.wait([1])
        assert [(r.job_id, r.success) for r in h.get_finished()] == [(1, True)]
        want = {k: v.clone() for k, v in d0.items()}
        if direction == "d2h":
            apply_move(want, s0, src, [0, 1, 2, 3], dst, [0, 1, 2, 3], 1)
        else:
            apply_move(want, s0, src, [0, 1, 2, 3], dst, [12, 13, 14, 15], 1)
        assert_storage(dst, want)  # only the earlier transfer wrote anything
        # the refused job id was never live: a valid transfer under it works
        ok = ([4, 5], [3]) if direction == "d2h" else ([3], [6, 7])
        assert handler.transfer_async(2, ok)
        h.wait([2])
        assert [(r.job_id, r.success) for r in h.get_finished()] == [(2, True)]
    finally:
        h.shutdown()


def test_bad_job_ids_and_live_job_id() -> None:
    h, _ = _validation_handlers(factor=1)
    try:
        for bad in (-1, 1.5, True, "3", None, 2**64):
            with pytest.raises(InvalidTransferError, match="job_id"):
                h.d2h.transfer_async(bad, ([0], [0]))
        h.d2h.transfer_async(np.int64(5), ([0], [0]))  # numpy ints are fine
        # job id 5 is live until get_finished reported it, in either direction
        with pytest.raises(InvalidTransferError, match="job id 5 is still live"):
            h.h2d.transfer_async(5, ([1], [1]))
        h.wait([5])
        assert [r.job_id for r in h.get_finished()] == [5]
        h.h2d.transfer_async(5, ([1], [1]))
        h.wait({5})  # vLLM passes a set
        assert [r.job_id for r in h.get_finished()] == [5]
    finally:
        h.shutdown()


def test_hybrid_spec_needs_one_entry_per_group() -> None:
    case = next(c for c in CASES if c.grouped)
    h, _ = make(case, 1)
    try:
        with pytest.raises(InvalidTransferError, match="2 KV-cache groups"):
            h.d2h.transfer_async(1, ([[0]], [[0]]))
        with pytest.raises(InvalidTransferError, match="group 1: GPU block ids hold block id 13"):
            h.d2h.transfer_async(1, ([[0], [13]], [[0], [0]]))
        # a group may be empty; all empty is an empty transfer
        h.d2h.transfer_async(1, ([[], [12]], [[], [5]]))
        with pytest.raises(InvalidTransferError, match="empty transfer"):
            h.d2h.transfer_async(2, ([[], []], [[], []]))
        h.wait([1])
        (r,) = h.get_finished()
        assert r.success and r.bytes == h.gpu_tables[1].page_bytes
    finally:
        h.shutdown()


def test_spec_objects_dicts_and_id_types() -> None:
    layers = {f"model.layers.{i}.attn": t for i, t in enumerate(kv_split(torch.float16))}
    h = CpuGpuHandlers(layers, N_CPU, layout="kv_split", backend="host")
    try:
        assert all(a is b for a, b in zip(h.gpu_caches[0], layers.values()))
        h.d2h.transfer_async(1, (SpecObj(np.array([3, 4])), SpecObj(np.array([0, 1]))))
        h.h2d.transfer_async(2, (torch.tensor([0, 1]), np.array([7, 8], dtype=np.uint16)))
        h.wait([1, 2])
        assert sorted(r.job_id for r in h.get_finished()) == [1, 2]
        for t in layers.values():
            assert torch.equal(t[:, [7, 8]].view(torch.int16), t[:, [3, 4]].view(torch.int16))
    finally:
        h.shutdown()


def test_ids_in_packed_record_fields_move_the_blocks_they_name() -> None:
    """Block ids in a field of a packed record array (its stride, 12 bytes, no whole number of
    ids) and in an unaligned view: each id is read as the caller wrote it."""
    layers = kv_split(torch.float16)
    fill_random(layers, torch.Generator().manual_seed(5))
    h = CpuGpuHandlers(layers, N_CPU, layout="kv_split", backend="host")
    try:
        rec = np.zeros(2, dtype=[("gpu", "i8"), ("cpu", "i4")])
        rec["gpu"], rec["cpu"] = [5, 0], [1, 2]
        assert rec["gpu"].strides == (12,)
        h.d2h.transfer_async(1, (rec["gpu"], rec["cpu"]))
        h.wait([1])
        cpu_ids = np.frombuffer(b"\0" + np.array([1, 2], np.int64).tobytes(), np.int64, offset=1)
        assert not cpu_ids.flags.aligned
        h.h2d.transfer_async(2, (cpu_ids, np.array([4, 6])))
        h.wait([2])
        assert sorted((r.job_id, r.success) for r in h.get_finished()) == [(1, True), (2, True)]
        for t in layers:
            # CPU blocks 1 and 2 hold GPU blocks 5 and 0, loaded back into GPU blocks 4 and 6.
            assert not torch.equal(t[:, 5].view(torch.int16), t[:, 0].view(torch.int16))
            assert torch.equal(t[:, 4].view(torch.int16), t[:, 5].view(torch.int16))
            assert torch.equal(t[:, 6].view(torch.int16), t[:, 0].view(torch.int16))
    finally:
        h.shutdown()


# --------------------------------------------------------------------------------------------
# Construction-time validation
# --------------------------------------------------------------------------------------------


def test_construction_errors() -> None:
    gpu = kv_split(torch.bfloat16)
    kw: dict[str, Any] = {"layout": "kv_split", "backend": "host"}
    with pytest.raises(ValueError, match="unknown layout"):
        CpuGpuHandlers(gpu, 4, layout="paged", backend="host")
    with pytest.raises(LayoutError, match="expects \\[num_blocks, 2"):
        CpuGpuHandlers(gpu, 4, layout="kv_fused", backend="host")
    with pytest.raises(LayoutError, match="one shape and dtype"):
        CpuGpuHandlers([*gpu, strided((2, N_GPU, 4, 2, 4), torch.bfloat16, 1)], 4, **kw)
    with pytest.raises(LayoutError, match="one shape and dtype"):
        CpuGpuHandlers([*gpu, strided((2, N_GPU, 4, 2, 8), torch.float16, 1)], 4, **kw)
    with pytest.raises(ValueError, match="num_cpu_blocks must be an int >= 1, not 0"):
        CpuGpuHandlers(gpu, 0, **kw)
    with pytest.raises(TypeError, match="num_cpu_blocks must be an int, not True"):
        CpuGpuHandlers(gpu, True, **kw)
    with pytest.raises(ValueError, match="block_size_factor must be an int >= 1, not 0"):
        CpuGpuHandlers(gpu, 4, block_size_factor=0, **kw)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        CpuGpuHandlers(gpu, 4, layout="kv_split", backend="cuda")
    with pytest.raises(ValueError, match="backend must be"):
        CpuGpuHandlers(gpu, 4, layout="kv_split", backend="gpu")
    with pytest.raises(ValueError, match="copy_streams needs the CUDA backend"):
        CpuGpuHandlers(gpu, 4, copy_streams=12345, **kw)
    with pytest.raises(TypeError, match="'device' is set by CpuGpuHandlers"):
        CpuGpuHandlers(gpu, 4, device=0, **kw)
    with pytest.raises(ValueError, match="2 layouts given for 1"):
        CpuGpuHandlers(gpu, 4, layout=["kv_split", "mla"], backend="host")
    with pytest.raises(LayoutError, match="empty"):
        CpuGpuHandlers([], 4, **kw)
    with pytest.raises(TypeError, match="must be a tensor"):
        CpuGpuHandlers(42, 4, **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="meta"):
        CpuGpuHandlers([torch.empty(2, 4, 4, 2, 8, device="meta")], 4, **kw)
    with pytest.raises(ValueError, match="prepare's directions must be 'd2h' or 'h2d', not 'h2h'"):
        CpuGpuHandlers(gpu, 4, prepare=("h2h",), **kw)
    with pytest.raises(ValueError, match="prepare names a direction twice"):
        CpuGpuHandlers(gpu, 4, prepare=["h2d", "h2d"], **kw)
    with pytest.raises(TypeError, match="prepare must be a list or tuple"):
        CpuGpuHandlers(gpu, 4, prepare="h2d", **kw)
    with pytest.raises(TypeError, match="prepare's directions must be"):
        CpuGpuHandlers(gpu, 4, prepare=(1,), **kw)
    for prepare in ((), ["h2d"], ("d2h", "h2d")):  # the host backend has nothing to make
        CpuGpuHandlers(gpu, 4, prepare=prepare, **kw).shutdown()


def test_given_cpu_cache_must_match() -> None:
    gpu = kv_split(torch.bfloat16)
    kw: dict[str, Any] = {"layout": "kv_split", "backend": "host"}

    def cpu(n: int = 8, dtype: torch.dtype = torch.bfloat16, layers: int = 3):
        return [torch.zeros(2, n, 4, 2, 8, dtype=dtype) for _ in range(layers)]

    CpuGpuHandlers(gpu, 2, block_size_factor=4, cpu_caches=cpu(8), **kw).shutdown()
    with pytest.raises(LayoutError, match=r"needs \(2, 12, 4, 2, 8\)"):
        CpuGpuHandlers(gpu, 3, block_size_factor=4, cpu_caches=cpu(8), **kw)
    with pytest.raises(LayoutError, match=r"is torch\.float16, the GPU tensor torch\.bfloat16"):
        CpuGpuHandlers(gpu, 8, cpu_caches=cpu(dtype=torch.float16), **kw)
    with pytest.raises(LayoutError, match="has 2 tensors"):
        CpuGpuHandlers(gpu, 8, cpu_caches=cpu(layers=2), **kw)
    with pytest.raises(LayoutError, match="same structure"):
        CpuGpuHandlers(gpu, 8, cpu_caches=[cpu(), cpu()], **kw)
    # the GPU tensors themselves cannot be the CPU cache (registered twice)
    with pytest.raises(ConfigError, match=r"CpuGpuHandlers: .* overlaps"):
        CpuGpuHandlers(gpu, N_GPU, cpu_caches=gpu, **kw)


def test_a_given_cpu_cache_must_lay_its_pages_out_as_the_gpu_tensors_do() -> None:
    """A page's bytes are copied as they lie: a CPU tensor whose page dims lie in memory in
    another order (heads and head dim swapped) would read permuted values; it is refused. Where
    only the block dim lies elsewhere (a block-major CPU cache), the pages read the same."""
    kw: dict[str, Any] = {"layout": "kv_split", "backend": "host"}
    gpu = torch.randn(2, 8, 4, 8, 2).permute(0, 1, 2, 4, 3)  # (2, 8, 4, 2, 8), HND in memory
    with pytest.raises(LayoutError, match=r"in another order .* \[0, 2, 3, 4\] against"):
        CpuGpuHandlers([gpu], 8, cpu_caches=[torch.zeros(2, 8, 4, 2, 8)], **kw)
    block_major = torch.zeros(8, 2, 4, 8, 2).permute(1, 0, 2, 4, 3)  # the block dim outermost
    h = CpuGpuHandlers([gpu], 8, cpu_caches=[block_major], **kw)
    try:
        h.d2h.transfer_async(1, ([3], [5]))
        h.wait([1])
        assert h.get_finished()[0].success
        assert torch.equal(block_major[:, 5], gpu[:, 3])
    finally:
        h.shutdown()


def test_caches_given_by_name_pair_by_name() -> None:
    """vLLM keys its KV caches by layer name: a CPU cache keyed the same way pairs by name
    whatever the order of its keys (it paired by position), at the top, in a list of groups or
    in a dict of groups, and other names are refused."""
    kw: dict[str, Any] = {"layout": "kv_split", "backend": "host"}
    gpu = {f"layer.{i}": torch.full((2, 8, 4, 2, 8), float(i)) for i in range(3)}
    cpu = {f"layer.{i}": torch.full((2, 8, 4, 2, 8), -1.0) for i in (2, 0, 1)}
    for given, gpu_given in ((cpu, gpu), ([cpu], [gpu]), ({"full": cpu}, {"full": gpu})):
        h = CpuGpuHandlers(gpu_given, 8, cpu_caches=given, **kw)
        try:
            h.d2h.transfer_async(1, ([0], [0]))
            h.wait([1])
            assert h.get_finished()[0].success
            for name, t in gpu.items():
                assert torch.equal(cpu[name][:, 0], t[:, 0]), name
        finally:
            h.shutdown()
    renamed = {("x" if k == "layer.1" else k): v for k, v in cpu.items()}
    with pytest.raises(LayoutError, match=r"missing \['layer.1'\], unknown \['x'\]"):
        CpuGpuHandlers(gpu, 8, cpu_caches=renamed, **kw)
    with pytest.raises(LayoutError, match=r"cpu_caches group 0 names other tensors"):
        CpuGpuHandlers([gpu], 8, cpu_caches=[renamed], **kw)
    # Groups by name too (a dict of dicts), each group's tensors by name.
    with pytest.raises(LayoutError, match=r"cpu_caches group 'full' names other tensors"):
        CpuGpuHandlers({"full": gpu}, 8, cpu_caches={"full": renamed}, **kw)


def test_public_surface() -> None:
    h, _ = _validation_handlers()
    try:
        assert isinstance(h.gpu_to_cpu_handler, SingleDirectionHandler)
        assert h.gpu_to_cpu_handler is h.d2h and h.cpu_to_gpu_handler is h.h2d
        assert h.handlers == (h.d2h, h.h2d)
        assert h.d2h.gpu_to_cpu and not h.h2d.gpu_to_cpu
        assert h.d2h.direction == "d2h" and h.h2d.direction == "h2d"
        assert h.backend == "host" and h.device == torch.device("cpu")
        assert h.num_groups == 1 and h.num_cpu_blocks == N_CPU and h.block_size_factor == 4
        assert h.engine.info()["backend"] == "host"
        assert "d2h" in repr(h.d2h) and "CpuGpuHandlers" in repr(h)
        assert h.get_finished() == [] and h.d2h.get_finished() == []
        assert blockswap.TransferResult is blockswap.handler.TransferResult
    finally:
        h.shutdown()
