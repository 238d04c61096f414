"""Tests of blockswap.handler: the offloading handlers a KV-cache connector calls.

On the host backend, CPU tensors stand in for the GPU side, and expected contents are computed
independently of the module, from torch's own strided indexing (the bytes of block ``b`` of a
tensor are those of ``t.select(block_dim, b)``) and from the sub-block rules written out here by
hand. Tests marked ``cuda`` run the same round trips with real CUDA tensors shaped like the KV
caches of published model configs; the conftest skips them where there is no GPU.
"""

from __future__ import annotations

import gc
import math
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blockswap
from blockswap import BlockswapError, InvalidTransferError, ShutdownError
from blockswap.handler import (
    CpuGpuHandlers,
    SingleDirectionHandler,
    load_sub_blocks,
    store_sub_blocks,
)
from blockswap.layout import LAYOUTS, LayoutError
from kv_helpers import assert_storage, block_bytes, fill_random, raw, snapshot, strided

F8 = torch.float8_e4m3fn
N_GPU = 16  # GPU blocks per group
N_CPU = 8  # CPU blocks per group (each of `factor` sub-blocks)
FACTORS = [1, 4]

# --------------------------------------------------------------------------------------------
# Reference helpers (independent of blockswap)
# --------------------------------------------------------------------------------------------


def apply_move(
    expected: dict[int, torch.Tensor],
    src_snap: dict[int, torch.Tensor],
    src: Sequence[torch.Tensor],
    src_ids: Sequence[int],
    dst: Sequence[torch.Tensor],
    dst_ids: Sequence[int],
    block_dim: int,
) -> None:
    """What moving blocks src_ids -> dst_ids must do, computed with torch indexing."""
    for ts, td in zip(src, dst):
        for bs, bd in zip(src_ids, dst_ids):
            ps = block_bytes(ts, block_dim % ts.dim(), bs)
            pd = block_bytes(td, block_dim % td.dim(), bd)
            expected[raw(td).data_ptr()][pd] = src_snap[raw(ts).data_ptr()][ps]


def ref_store_subs(cpu: Sequence[int], n: int, f: int) -> list[int]:
    """GPU -> CPU: GPU block i goes to sub-block i % f of CPU block cpu[i // f]."""
    assert len(cpu) == math.ceil(n / f)
    return [cpu[i // f] * f + i % f for i in range(n)]


def ref_load_subs(cpu: Sequence[int], n: int, f: int) -> list[int]:
    """CPU -> GPU: end-aligned, skipping the first (-n) % f sub-blocks of cpu[0]."""
    assert len(cpu) == math.ceil(n / f)
    skip = len(cpu) * f - n
    return [cpu[(skip + i) // f] * f + (skip + i) % f for i in range(n)]


def ref_subs_from(cpu: Sequence[int], n: int, f: int, skip: int) -> list[int]:
    """Either direction with block_indices: n sub-blocks from sub-block skip of cpu[0]."""
    assert len(cpu) == math.ceil((skip + n) / f)
    return [cpu[(skip + i) // f] * f + (skip + i) % f for i in range(n)]


def all_tensors(groups: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    return [t for g in groups for t in g]


# --------------------------------------------------------------------------------------------
# Layout cases: builders of the "GPU" KV cache (one or more groups)
# --------------------------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    build: Callable[[], list[list[torch.Tensor]]]
    layouts: list[str]
    grouped: bool = False

    def gpu_arg(self, groups: list[list[torch.Tensor]]) -> Any:
        return groups if self.grouped else groups[0]

    def layout_arg(self) -> Any:
        return self.layouts if self.grouped else self.layouts[0]


def _kv_split(dtype: torch.dtype, pad: int = 0, interleaved: bool = False, n: int = N_GPU):
    order = [1, 0, 2, 3, 4] if interleaved else None
    return [strided((2, n, 4, 2, 8), dtype, 1, pad=pad, order=order) for _ in range(3)]


def _kv_fused(dtype: torch.dtype, pad: int = 0, hnd: bool = False):
    order = [0, 1, 3, 2, 4] if hnd else None
    return [strided((N_GPU, 2, 4, 2, 8), dtype, 0, pad=pad, order=order) for _ in range(2)]


def _mla(dtype: torch.dtype, pad: int = 0, n: int = N_GPU):
    return [strided((n, 4, 40), dtype, 0, pad=pad) for _ in range(3)]


def _views_of_cross_layer_buffer():
    buf = strided((N_GPU, 3, 2, 4, 2, 8), torch.bfloat16, 0)
    return [buf[:, i] for i in range(3)]


def _uneven_padding():
    # same shape and dtype, different padding per layer: no uniform stride (fallback path)
    return [strided((2, N_GPU, 4, 2, 8), torch.float16, 1, pad=p) for p in (0, 8, 3)]


CASES = [
    Case("kv_split-bf16", lambda: [_kv_split(torch.bfloat16)], ["kv_split"]),
    Case("kv_split-fp8-padded", lambda: [_kv_split(F8, pad=7)], ["kv_split"]),
    Case(
        "kv_split-f16-interleaved",
        lambda: [_kv_split(torch.float16, interleaved=True)],
        ["kv_split"],
    ),
    Case("kv_split-uneven-padding", lambda: [_uneven_padding()], ["kv_split"]),
    Case("kv_fused-f16", lambda: [_kv_fused(torch.float16)], ["kv_fused"]),
    Case("kv_fused-bf16-padded", lambda: [_kv_fused(torch.bfloat16, pad=16)], ["kv_fused"]),
    Case("kv_fused-fp8-hnd", lambda: [_kv_fused(F8, hnd=True)], ["kv_fused"]),
    Case(
        "cross_layer-bf16",
        lambda: [[strided((N_GPU, 3, 2, 4, 2, 8), torch.bfloat16, 0)]],
        ["cross_layer"],
    ),
    Case("kv_fused-views-of-cross-layer", lambda: [_views_of_cross_layer_buffer()], ["kv_fused"]),
    Case("mla-bf16", lambda: [_mla(torch.bfloat16)], ["mla"]),
    Case("mla-fp8-padded", lambda: [_mla(F8, pad=13)], ["mla"]),
    # hybrid: two KV-cache groups with different page sizes, dtypes, layouts and block counts
    Case(
        "hybrid-kv_split-mla",
        lambda: [_kv_split(torch.bfloat16, pad=8), _mla(F8, n=N_GPU - 3)],
        ["kv_split", "mla"],
        grouped=True,
    ),
]

ID_TYPES: list[Callable[[list[int]], Any]] = [
    lambda x: np.asarray(x, dtype=np.int64),
    lambda x: list(x),
    lambda x: np.asarray(x, dtype=np.int32),
    lambda x: torch.tensor(x, dtype=torch.int64),
]


def make(case: Case, factor: int, **kw: Any) -> tuple[CpuGpuHandlers, list[list[torch.Tensor]]]:
    groups = case.build()
    h = CpuGpuHandlers(
        case.gpu_arg(groups),
        N_CPU,
        layout=case.layout_arg(),
        block_size_factor=factor,
        backend="host",
        **kw,
    )
    return h, groups


def spec_of(case: Case, per_group: list[Any]) -> Any:
    return per_group if case.grouped else per_group[0]


# --------------------------------------------------------------------------------------------
# Round trips: GPU -> CPU -> other GPU blocks, every layout, factors 1 and 4
# --------------------------------------------------------------------------------------------


@st.composite
def plan(
    draw: st.DrawFn, factor: int, n_gpu: int, skip: int = 0
) -> tuple[list[int], list[int], int, list[int]]:
    """(GPU source ids, CPU block ids of the store, load count k, GPU destination ids); the store
    starts ``skip`` sub-blocks into its first CPU block."""
    n = draw(st.integers(1, 8))
    src = draw(st.lists(st.integers(0, n_gpu - 1), min_size=n, max_size=n))
    cpu = draw(st.permutations(range(N_CPU)))[: math.ceil((skip + n) / factor)]
    free = [b for b in range(n_gpu) if b not in set(src)]
    k = draw(st.integers(1, min(n, len(free))))
    dst = draw(st.permutations(free))[:k]
    return src, cpu, k, dst


@pytest.mark.parametrize("factor", FACTORS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_roundtrip(case: Case, factor: int, data: st.DataObject) -> None:
    h, gpus = make(case, factor)
    try:
        cpus = h.cpu_caches
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
        fill_random(all_tensors(gpus) + all_tensors(cpus), gen)
        bds = [LAYOUTS[lay] for lay in case.layouts]
        # vLLM 0.33's block_indices (the first GPU block's position in its request, per group):
        # both directions start block_indices[g] % factor sub-blocks into the first CPU block.
        # Without them, stores start-align and loads end-align.
        starts = data.draw(
            st.none() | st.lists(st.integers(0, 99), min_size=len(gpus), max_size=len(gpus)),
            label="block_indices",
        )
        skips = [0] * len(gpus) if starts is None else [b % factor for b in starts]
        plans = [
            data.draw(plan(factor, g[0].shape[bd], skip), label=f"plan of group {i}")
            for i, (g, bd, skip) in enumerate(zip(gpus, bds, skips))
        ]
        as_ids = data.draw(st.sampled_from(ID_TYPES))
        page = [t.page_bytes for t in h.gpu_tables]

        # store: GPU -> CPU
        gpu0 = [snapshot(g) for g in gpus]
        want_cpu = [snapshot(c) for c in cpus]
        stored = [
            ref_subs_from(cpu, len(src), factor, skip)
            for (src, cpu, _, _), skip in zip(plans, skips)
        ]
        for i, (src, _, _, _) in enumerate(plans):
            apply_move(want_cpu[i], gpu0[i], gpus[i], src, cpus[i], stored[i], bds[i])
        spec = (
            spec_of(case, [as_ids(p[0]) for p in plans]),
            spec_of(case, [as_ids(p[1]) for p in plans]),
        )
        assert h.gpu_to_cpu_handler.transfer_async(11, spec, block_indices=starts) is True
        h.gpu_to_cpu_handler.wait([11])
        (r,) = h.get_finished()
        assert (r.job_id, r.success, r.error) == (11, True, None)
        assert r.bytes == sum(pg * len(p[0]) for pg, p in zip(page, plans))
        for i in range(len(gpus)):
            assert_storage(cpus[i], want_cpu[i])
            assert_storage(gpus[i], gpu0[i])  # the source is untouched

        # load: CPU -> other GPU blocks: the first k blocks of the same request position, or
        # (without block_indices) end-aligned to the last CPU block
        cpu1 = [snapshot(c) for c in cpus]
        want_gpu = [snapshot(g) for g in gpus]
        loads = []
        for i, (_, cpu, k, dst) in enumerate(plans):
            if starts is None:
                cpu_load = cpu[len(cpu) - math.ceil(k / factor) :]
                subs = ref_load_subs(cpu_load, k, factor)
            else:
                cpu_load = cpu[: math.ceil((skips[i] + k) / factor)]
                subs = ref_subs_from(cpu_load, k, factor, skips[i])
            loads.append((cpu_load, subs))
            apply_move(want_gpu[i], cpu1[i], cpus[i], subs, gpus[i], dst, bds[i])
        spec = (
            spec_of(case, [as_ids(c) for c, _ in loads]),
            spec_of(case, [as_ids(p[3]) for p in plans]),
        )
        assert h.cpu_to_gpu_handler.transfer_async(12, spec, block_indices=starts) is True
        h.wait([12])
        (r,) = h.cpu_to_gpu_handler.get_finished()
        assert (r.job_id, r.success) == (12, True)
        assert r.bytes == sum(pg * p[2] for pg, p in zip(page, plans))
        for i in range(len(gpus)):
            assert_storage(gpus[i], want_gpu[i])
            assert_storage(cpus[i], cpu1[i])
        # end to end: a GPU block loaded from a sub-block the store wrote holds the source's bytes
        for i, (src, _, _, dst) in enumerate(plans):
            _, subs = loads[i]
            for t in gpus[i]:
                bd = bds[i] % t.dim()
                for d, sub in zip(dst, subs):
                    if sub in stored[i]:
                        s = src[stored[i].index(sub)]
                        before = gpu0[i][raw(t).data_ptr()][block_bytes(t, bd, s)]
                        assert torch.equal(raw(t)[block_bytes(t, bd, d)], before)
        assert h.get_finished() == []
    finally:
        h.shutdown()


# --------------------------------------------------------------------------------------------
# The sub-block rules of block_size_factor, by hand
# --------------------------------------------------------------------------------------------


def test_sub_block_helpers_match_the_documented_rules() -> None:
    # store: start-aligned; the last CPU block is partly written when n % f != 0
    assert store_sub_blocks([4, 1], 6, 4).tolist() == [16, 17, 18, 19, 4, 5]
    assert store_sub_blocks([2], 1, 4).tolist() == [8]
    # load: end-aligned, skip = (-n) % f sub-blocks of the first CPU block
    assert load_sub_blocks([1], 3, 4).tolist() == [5, 6, 7]
    assert load_sub_blocks([4, 1], 5, 4).tolist() == [19, 4, 5, 6, 7]
    assert load_sub_blocks([4, 1], 8, 4).tolist() == store_sub_blocks([4, 1], 8, 4).tolist()
    assert store_sub_blocks([3, 0], 2, 1).tolist() == load_sub_blocks([3, 0], 2, 1).tolist()


def test_factor_4_partial_blocks_at_start_and_end() -> None:
    gpu = _kv_split(torch.bfloat16)
    h = CpuGpuHandlers(gpu, N_CPU, layout="kv_split", block_size_factor=4, backend="host")
    try:
        (cpu,) = h.cpu_caches
        assert all(c.shape[1] == N_CPU * 4 for c in cpu)
        gen = torch.Generator().manual_seed(5)
        fill_random(gpu + cpu, gen)
        g0, c0 = snapshot(gpu), snapshot(cpu)

        # store 6 GPU blocks into CPU blocks 4, 1: sub-blocks 16..19 and 4, 5 (ends mid-block)
        h.d2h.transfer_async(1, ([3, 0, 7, 5, 1, 9], [4, 1]))
        h.wait([1])
        assert [r.success for r in h.get_finished()] == [True]
        want = {k: v.clone() for k, v in c0.items()}
        apply_move(want, g0, gpu, [3, 0, 7, 5, 1, 9], cpu, [16, 17, 18, 19, 4, 5], 1)
        assert_storage(cpu, want)  # sub-blocks 6, 7 of CPU block 1 (and all else) untouched

        # load 3 GPU blocks from CPU block 1: starts mid-block (skip 1) -> sub-blocks 5, 6, 7
        c1 = snapshot(cpu)
        h.h2d.transfer_async(2, ([1], [10, 11, 12]))
        h.wait([2])
        want_g = {k: v.clone() for k, v in g0.items()}
        apply_move(want_g, c1, cpu, [5, 6, 7], gpu, [10, 11, 12], 1)
        assert_storage(gpu, want_g)
        # GPU block 10 now holds what GPU block 9 held (the 6th stored, into sub-block 5)
        for t in gpu:
            assert torch.equal(t[:, 10].view(torch.int16), g0_block(g0, t, 9))

        # load 5 from CPU blocks 4, 1: skip 3 -> sub-blocks 19, 4, 5, 6, 7
        h.h2d.transfer_async(3, (np.array([4, 1]), np.array([13, 14, 15, 2, 4])))
        h.wait([3])
        apply_move(want_g, c1, cpu, [19, 4, 5, 6, 7], gpu, [13, 14, 15, 2, 4], 1)
        assert_storage(gpu, want_g)
        assert [r.job_id for r in h.get_finished()] == [2, 3]
    finally:
        h.shutdown()


def g0_block(snap: dict[int, torch.Tensor], t: torch.Tensor, b: int) -> torch.Tensor:
    """Block ``b`` of ``t`` (kv_split) as it was in ``snap``, as int16."""
    pos = block_bytes(t, 1, b)
    return snap[raw(t).data_ptr()][pos].view(torch.int16).reshape(t[:, b].shape)


# --------------------------------------------------------------------------------------------
# Both directions in flight, results exactly once, stats
# --------------------------------------------------------------------------------------------


def _big_cache(layers: int = 8, blocks: int = 32, page: tuple[int, ...] = (16, 4, 128)):
    return [torch.randint(0, 1000, (2, blocks, *page), dtype=torch.int16) for _ in range(layers)]


def test_both_directions_in_flight_results_once_and_stats() -> None:
    gpu = _big_cache()
    h = CpuGpuHandlers(gpu, 32, layout="kv_split", backend="host")
    try:
        (cpu,) = h.cpu_caches
        for c in cpu:
            c.copy_(torch.randint(0, 1000, c.shape, dtype=torch.int16))
        g0 = [t.clone() for t in gpu]
        c0 = [c.clone() for c in cpu]
        page = h.gpu_tables[0].page_bytes
        assert page == 8 * 2 * (16 * 4 * 128 * 2)  # 8 layers x (K, V) x one int16 page
        # Store GPU blocks 0..15 -> CPU 16..31 while loading CPU 0..15 -> GPU 16..31, repeatedly,
        # polling from both handlers: every result arrives once, from either handler.
        jobs = {}
        for j in range(0, 40, 2):
            h.d2h.transfer_async(j, (np.arange(16), np.arange(16, 32)))
            h.h2d.transfer_async(j + 1, (np.arange(16), np.arange(16, 32)))
            jobs[j], jobs[j + 1] = "d2h", "h2d"
        assert h.engine.stats()["in_flight"] >= 0
        seen: list[int] = []
        deadline = time.monotonic() + 30
        while len(seen) < len(jobs) and time.monotonic() < deadline:
            seen += [r.job_id for r in h.d2h.get_finished()]
            seen += [r.job_id for r in h.h2d.get_finished()]
        assert sorted(seen) == sorted(jobs)
        assert h.get_finished() == [] and h.d2h.get_finished() == []
        for t, t0, c, c_0 in zip(gpu, g0, cpu, c0):
            assert torch.equal(c[:, 16:], t0[:, :16])
            assert torch.equal(t[:, 16:], c_0[:, :16])
        st_all = h.stats()
        for direction, handler in (("d2h", h.d2h), ("h2d", h.h2d)):
            s = handler.stats()
            assert s == st_all[direction]
            assert s["transfers"] == 20 and s["failed"] == 0
            assert s["bytes"] == 20 * 16 * page
            assert s["seconds"] > 0 and s["gb_per_s"] > 0
    finally:
        h.shutdown()


def test_failed_transfer_is_reported_once_and_later_ones_work() -> None:
    gpu = _big_cache(layers=2)
    h = CpuGpuHandlers(gpu, 32, layout="kv_split", backend="host")
    try:
        h.engine.inject_failures(1)
        h.d2h.transfer_async(1, ([0, 1], [0, 1]))
        h.d2h.transfer_async(2, ([2], [2]))
        h.wait([1, 2])
        res = {r.job_id: r for r in h.get_finished()}
        assert not res[1].success and res[1].error
        assert res[2].success
        assert h.d2h.stats()["failed"] == 1
        assert torch.equal(h.cpu_caches[0][0][:, 2], gpu[0][:, 2])
    finally:
        h.shutdown()


# --------------------------------------------------------------------------------------------
# Shutdown
# --------------------------------------------------------------------------------------------


def test_shutdown_with_transfers_in_flight_is_idempotent_and_reports_results() -> None:
    gpu = _big_cache(layers=16, blocks=64)
    h = CpuGpuHandlers(gpu, 64, layout="kv_split", backend="host")
    owned = weakref.ref(h.cpu_caches[0][0])
    for c in h.cpu_caches[0]:
        c.fill_(7)
    del c
    g0 = [t.clone() for t in gpu]
    # stores of GPU 0..31 into CPU 0..31 / 32..63, and a load into GPU 40..63, all in flight
    for j in range(6):
        h.d2h.transfer_async(j, (np.arange(32), np.arange(32) + 32 * (j % 2)))
    h.h2d.transfer_async(100, (np.arange(40, 64), np.arange(40, 64)))
    h.shutdown()  # drains everything in flight
    h.shutdown()  # no-op
    h.d2h.shutdown()  # no-op too (both directions share the engine)
    assert h.is_shut_down and h.engine.is_shut_down
    res = h.get_finished()
    assert sorted(r.job_id for r in res) == [0, 1, 2, 3, 4, 5, 100]
    assert all(r.success for r in res)
    assert h.get_finished() == []
    for t, t0 in zip(gpu, g0):
        assert torch.equal(t[:, :40], t0[:, :40])  # not a destination
    with pytest.raises(ShutdownError):
        h.d2h.transfer_async(7, ([0], [0]))
    with pytest.raises(ShutdownError):
        h.h2d.transfer_async(8, ([0], [0]))
    with pytest.raises(ShutdownError):
        _ = h.cpu_caches
    gc.collect()
    assert owned() is None, "the CPU cache allocated by the handlers was freed"
    assert "shut down" in repr(h)


def test_shutdown_keeps_a_given_cpu_cache_and_its_contents() -> None:
    gpu = _big_cache(layers=4, blocks=16)
    cpu = [torch.zeros(2, 32, 16, 4, 128, dtype=torch.int16) for _ in range(4)]
    with CpuGpuHandlers(gpu, 32, layout="kv_split", cpu_caches=cpu, backend="host") as h:
        assert h.cpu_caches[0][0] is cpu[0]
        h.d2h.transfer_async(1, (np.arange(16), np.arange(16, 32)))
    assert h.is_shut_down
    assert [r.job_id for r in h.get_finished()] == [1]
    for t, c in zip(gpu, cpu):
        assert torch.equal(c[:, 16:], t)
        assert not c[:, :16].any()


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
    ("2d", (np.zeros((1, 2), dtype=np.int64), [5]), "must be 1-D"),
    ("huge-uint", (np.array([2**64 - 1], dtype=np.uint64), [5]), "out of range"),
    ("empty", ([], []), "empty transfer"),
    ("not-a-pair", ([0], [5], [1]), "too many values to unpack"),
    ("none", None, "cannot unpack"),
]
BAD_H2D: list[tuple[str, Any, str]] = [
    # (name, spec, message) for the CPU -> GPU handler, factor 4 (CPU ids, GPU ids)
    ("gpu-repeated", ([5], [8, 9, 8]), "GPU block id 8 is a destination more than once"),
    ("gpu-out-of-range", ([5], [8, 99]), "GPU block ids hold block id 99"),
    ("cpu-out-of-range", ([9], [8]), "CPU block ids hold block id 9"),
    ("lengths", ([5, 4], [8]), "1 GPU blocks from sub-block 3 of the first CPU block take"),
]


def _validation_handlers(factor: int = 4) -> tuple[CpuGpuHandlers, list[torch.Tensor]]:
    gpu = _kv_split(torch.bfloat16)
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
    layers = {f"model.layers.{i}.attn": t for i, t in enumerate(_kv_split(torch.float16))}
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


# --------------------------------------------------------------------------------------------
# Construction-time validation
# --------------------------------------------------------------------------------------------


def test_construction_errors() -> None:
    gpu = _kv_split(torch.bfloat16)
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


def test_given_cpu_cache_must_match() -> None:
    gpu = _kv_split(torch.bfloat16)
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
    with pytest.raises(InvalidTransferError, match="overlaps"):
        CpuGpuHandlers(gpu, N_GPU, cpu_caches=gpu, **kw)


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


# --------------------------------------------------------------------------------------------
# CUDA: KV caches shaped like published model configs (run by the lead on a GPU machine)
# --------------------------------------------------------------------------------------------

BLOCK_SIZE = 16
GPU_BLOCKS = 64
CPU_BLOCKS = 64


@dataclass
class Model:
    name: str
    layers: int
    kv_heads: int = 0
    head_dim: int = 0
    mla_dim: int = 0  # kv_lora_rank + qk_rope_head_dim (MLA)
    dtype: torch.dtype = torch.bfloat16
    groups: int = 1  # KV-cache groups (gpt-oss: sliding window + full attention)

    @property
    def layout(self) -> str:
        return "mla" if self.mla_dim else "kv_split"

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        if self.mla_dim:
            return (num_blocks, BLOCK_SIZE, self.mla_dim)
        return (2, num_blocks, BLOCK_SIZE, self.kv_heads, self.head_dim)


MODELS = [
    Model("llama-3.1-8b", 32, 8, 128),
    Model("llama-3.1-70b-tp4", 80, 2, 128),  # 8 KV heads / TP 4
    Model("qwen2.5-7b", 28, 4, 128),
    Model("mistral-7b", 32, 8, 128),
    Model("deepseek-v3-mla", 61, mla_dim=512 + 64),
    Model("gpt-oss-120b", 36, 8, 64, groups=2),
    Model("llama-3.1-8b-fp8", 32, 8, 128, dtype=F8),
]


def cuda_cache(m: Model, device: torch.device | str = "cuda") -> list[list[torch.Tensor]]:
    """Random per-layer KV tensors (bytes drawn as uint8, viewed as the model's dtype)."""
    isz = torch.empty(0, dtype=m.dtype).element_size()
    shape = list(m.shape(GPU_BLOCKS))
    shape[-1] *= isz
    layers = [
        torch.randint(0, 256, shape, dtype=torch.uint8, device=device).view(m.dtype)
        for _ in range(m.layers)
    ]
    # hybrid: alternate layers in two groups (gpt-oss: sliding window / full attention)
    return [layers[g :: m.groups] for g in range(m.groups)]


def sel(t: torch.Tensor, layout: str, ids: Sequence[int]) -> torch.Tensor:
    """Blocks ``ids`` of ``t`` as uint8 (on t's device)."""
    idx = torch.as_tensor(list(ids), device=t.device)
    u = t.view(torch.uint8)
    return u[:, idx] if layout == "kv_split" else u[idx]


@pytest.mark.cuda
@pytest.mark.parametrize("factor", FACTORS)
@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
def test_cuda_model_roundtrip(model: Model, factor: int) -> None:
    groups = cuda_cache(model)
    arg = groups if model.groups > 1 else groups[0]
    h = CpuGpuHandlers(arg, CPU_BLOCKS, layout=model.layout, block_size_factor=factor)
    try:
        assert h.backend == "cuda" and h.device == groups[0][0].device
        assert h.engine.info()["backend"] == "cuda"
        assert all(c.is_pinned() and c.device.type == "cpu" for c in all_tensors(h.cpu_caches))
        rng = np.random.default_rng(len(model.name) * 10 + factor)
        n = 32
        perm = [rng.permutation(GPU_BLOCKS) for _ in groups]
        srcs = [p[:n] for p in perm]  # GPU blocks offloaded
        dsts = [p[n : 2 * n] for p in perm]  # other GPU blocks, onloaded into
        cpus = [rng.permutation(CPU_BLOCKS)[: n // factor] for _ in groups]
        before = [[sel(t, model.layout, s).clone() for t in g] for g, s in zip(groups, srcs)]
        spec = (srcs, cpus) if model.groups > 1 else (srcs[0], cpus[0])
        assert h.gpu_to_cpu_handler.transfer_async(1, spec) is True
        h.wait([1])
        (r,) = h.get_finished()
        assert r.success, r.error
        assert r.bytes == n * sum(t.page_bytes for t in h.gpu_tables)
        for g, cg in enumerate(h.cpu_caches):
            subs = ref_store_subs(cpus[g].tolist(), n, factor)
            for t_cpu, b in zip(cg, before[g]):
                assert torch.equal(sel(t_cpu, model.layout, subs), b.cpu())
        spec = (cpus, dsts) if model.groups > 1 else (cpus[0], dsts[0])
        assert h.cpu_to_gpu_handler.transfer_async(2, spec) is True
        h.wait([2])
        (r,) = h.get_finished()
        assert r.success, r.error
        for g, ts in enumerate(groups):
            for t, b in zip(ts, before[g]):
                assert torch.equal(sel(t, model.layout, dsts[g].tolist()), b)
        s = h.stats()
        assert s["d2h"]["bytes"] == s["h2d"]["bytes"] > 0
        assert s["d2h"]["gb_per_s"] > 0 and s["h2d"]["gb_per_s"] > 0
    finally:
        h.shutdown()


@pytest.mark.cuda
def test_cuda_partial_cpu_blocks_factor_4() -> None:
    m = Model("llama-3.1-8b", 4, 8, 128)
    (gpu,) = cuda_cache(m)
    h = CpuGpuHandlers(gpu, CPU_BLOCKS, layout="kv_split", block_size_factor=4)
    try:
        src = [3, 0, 7, 5, 1, 9]
        h.d2h.transfer_async(1, (src, [4, 1]))  # sub-blocks 16..19, 4, 5
        h.wait([1])
        assert h.get_finished()[0].success
        for t, c in zip(gpu, h.cpu_caches[0]):
            assert torch.equal(
                sel(c, "kv_split", [16, 17, 18, 19, 4, 5]), sel(t, "kv_split", src).cpu()
            )
        h.h2d.transfer_async(2, ([4, 1], [20, 21, 22, 23, 24]))  # skip 3: 19, 4, 5, 6, 7
        h.wait([2])
        assert h.get_finished()[0].success
        for t, c in zip(gpu, h.cpu_caches[0]):
            want = sel(c, "kv_split", [19, 4, 5, 6, 7])
            assert torch.equal(sel(t, "kv_split", [20, 21, 22, 23, 24]).cpu(), want)
    finally:
        h.shutdown()


@pytest.mark.cuda
@pytest.mark.parametrize("side_stream", [False, True], ids=["default-stream", "side-stream"])
def test_cuda_offload_waits_for_the_compute_stream(side_stream: bool) -> None:
    m = Model("llama-3.1-8b", 8, 8, 128)
    (gpu,) = cuda_cache(m)
    src = list(range(8, 40))
    idx = torch.tensor(src, device="cuda")
    for t in gpu:
        t.view(torch.uint8).fill_(0x11)
    torch.cuda.synchronize()
    h = CpuGpuHandlers(gpu, CPU_BLOCKS, layout="kv_split")
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    try:
        with torch.cuda.stream(stream):
            # The model still computing: a long matmul chain and a spin, then the KV write.
            a = torch.randn(4096, 4096, device="cuda")
            for _ in range(8):
                a = torch.tanh(a @ a)
            torch.cuda._sleep(200_000_000)
            for t in gpu:
                # index_fill_ takes the value as a kernel argument: a Python scalar assigned
                # through indexing would be copied from pageable host memory, which syncs the
                # stream and defeats the test.
                t.view(torch.uint8).index_fill_(1, idx, 0x5A)
            h.d2h.transfer_async(1, (np.asarray(src), np.arange(32)))
            still_running = not stream.query()
        h.wait([1], timeout=120)
        (r,) = h.get_finished()
        assert r.success, r.error
        assert still_running, "the compute finished before transfer_async: the test proves nothing"
        for c in h.cpu_caches[0]:
            got = c.view(torch.uint8)[:, :32]
            assert bool((got == 0x5A).all()), "offloaded bytes predate the compute stream's writes"
        torch.cuda.synchronize()
        assert bool(torch.isfinite(a).all())
    finally:
        h.shutdown()


@pytest.mark.cuda
def test_cuda_both_directions_in_flight_and_copy_streams() -> None:
    m = Model("qwen2.5-7b", 28, 4, 128)
    (gpu,) = cuda_cache(m)
    s_h2d, s_d2h = torch.cuda.Stream(), torch.cuda.Stream()
    h = CpuGpuHandlers(
        gpu, CPU_BLOCKS, layout="kv_split", copy_streams={"h2d": s_h2d, "d2h": s_d2h}
    )
    try:
        (cpu,) = h.cpu_caches
        for c in cpu:
            c.view(torch.uint8).copy_(
                torch.randint(0, 256, c.view(torch.uint8).shape, dtype=torch.uint8)
            )
        c0 = [c.clone() for c in cpu]
        g0 = [t.clone() for t in gpu]
        h.d2h.transfer_async(1, (np.arange(32), np.arange(32, 64)))
        h.h2d.transfer_async(2, (np.arange(32), np.arange(32, 64)))
        s_h2d.synchronize()  # the onload ran on the given stream
        for t, c in zip(gpu, c0):
            assert torch.equal(
                sel(t, "kv_split", range(32, 64)).cpu(), sel(c, "kv_split", range(32))
            )
        h.wait([1, 2])
        assert sorted((r.job_id, r.success) for r in h.get_finished()) == [(1, True), (2, True)]
        for t0, c in zip(g0, cpu):
            assert torch.equal(
                sel(c, "kv_split", range(32, 64)), sel(t0, "kv_split", range(32)).cpu()
            )
    finally:
        h.shutdown()


@pytest.mark.cuda
def test_cuda_shutdown_with_transfers_in_flight() -> None:
    m = Model("llama-3.1-70b-tp4", 80, 2, 128)
    (gpu,) = cuda_cache(m)
    h = CpuGpuHandlers(gpu, CPU_BLOCKS, layout="kv_split")
    g0 = [t.clone() for t in gpu]
    torch.cuda.synchronize()
    for j in range(3):  # GPU 0..47 -> CPU 0..47, while CPU 48..63 -> GPU 48..63
        h.d2h.transfer_async(j, (np.arange(16 * j, 16 * j + 16), np.arange(16 * j, 16 * j + 16)))
    h.h2d.transfer_async(10, (np.arange(48, 64), np.arange(48, 64)))
    h.shutdown()
    h.shutdown()
    res = h.get_finished()
    assert sorted(r.job_id for r in res) == [0, 1, 2, 10] and all(r.success for r in res)
    with pytest.raises(ShutdownError):
        h.d2h.transfer_async(20, ([0], [0]))
    torch.cuda.synchronize()
    for t, t0 in zip(gpu, g0):  # the offloaded blocks are untouched
        assert torch.equal(sel(t, "kv_split", range(48)), sel(t0, "kv_split", range(48)))


@pytest.mark.cuda
def test_cuda_refuses_unpinned_cpu_cache_and_host_backend() -> None:
    (gpu,) = cuda_cache(Model("mistral-7b", 2, 8, 128))
    cpu = [torch.empty(2, CPU_BLOCKS, BLOCK_SIZE, 8, 128, dtype=torch.bfloat16) for _ in gpu]
    with pytest.raises(ValueError, match="not pinned"):
        CpuGpuHandlers(gpu, CPU_BLOCKS, layout="kv_split", cpu_caches=cpu)
    with pytest.raises(ValueError, match="host backend copies host memory only"):
        CpuGpuHandlers(gpu, CPU_BLOCKS, layout="kv_split", backend="host")
    pinned = [c.pin_memory() for c in cpu]
    h = CpuGpuHandlers(gpu, CPU_BLOCKS, layout="kv_split", cpu_caches=pinned)
    try:
        h.d2h.transfer_async(1, ([5, 6], [0, 1]))
        h.wait([1])
        assert h.get_finished()[0].success
        assert torch.equal(
            sel(pinned[1], "kv_split", [0, 1]), sel(gpu[1], "kv_split", [5, 6]).cpu()
        )
    finally:
        h.shutdown()


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
def test_cuda_tensors_on_another_device_than_the_current_one() -> None:
    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    (gpu,) = cuda_cache(Model("llama-3.1-8b", 4, 8, 128), device=dev)
    with torch.cuda.device(0):
        h = CpuGpuHandlers(gpu, CPU_BLOCKS, layout="kv_split")
        try:
            assert h.device == dev
            assert torch.cuda.current_device() == 0
            h.d2h.transfer_async(1, ([1, 2], [3, 4]))
            assert torch.cuda.current_device() == 0
            h.wait([1])
            h.h2d.transfer_async(2, ([3, 4], [10, 11]))
            assert torch.cuda.current_device() == 0
            h.wait([2])
            assert all(r.success for r in h.get_finished())
            for t in gpu:
                assert torch.equal(sel(t, "kv_split", [10, 11]), sel(t, "kv_split", [1, 2]))
        finally:
            h.shutdown()


# --------------------------------------------------------------------------------------------
# The block-major CPU cache and the block plan
# --------------------------------------------------------------------------------------------

#: (layout, per-layer shape with block dim of N blocks) for layer tensors that are views of one
#: allocation, as serving engines allocate them.
ONE_ALLOCATION = {
    "kv_split": lambda n: (2, n, 4, 2, 8),
    "kv_fused": lambda n: (n, 2, 4, 2, 8),
    "mla": lambda n: (n, 4, 24),
}


def one_allocation(layout: str, layers: int, n: int, device: str = "cpu") -> list[torch.Tensor]:
    shape = ONE_ALLOCATION[layout](n)
    buf = torch.randint(0, 256, (layers, *shape), dtype=torch.uint8, device=device)
    return [buf[i].view(torch.float16) for i in range(layers)]


def page_of(t: torch.Tensor, layout: str, b: int) -> list[torch.Tensor]:
    """The pages of block ``b`` of one layer tensor as uint8, in block-table order."""
    u = t.view(torch.uint8)
    return [u[0, b], u[1, b]] if layout == "kv_split" else [u[b]]


@pytest.mark.parametrize("factor", FACTORS)
@pytest.mark.parametrize("layout", sorted(ONE_ALLOCATION))
def test_block_major_cache_moves_blocks_as_one_copy_each(layout: str, factor: int) -> None:
    layers = 5
    gpu = one_allocation(layout, layers, N_GPU)
    h = CpuGpuHandlers(
        gpu, N_CPU, layout=layout, block_size_factor=factor, backend="host", path="blocks"
    )
    mirror = CpuGpuHandlers(
        [t.clone() for t in gpu],
        N_CPU,
        layout=layout,
        block_size_factor=factor,
        backend="host",
        cpu_layout="mirror",
    )
    try:
        # One 2-D copy per block, both directions: every page of a layer at one pitch.
        for d in ("d2h", "h2d"):
            assert h.routes[d].plan == "blocks", h.routes[d]
            (plan,) = h.block_plans[d]
            assert plan is not None and len(plan) == 1
        assert mirror.cpu_chunks is None and mirror.routes["d2h"].plan == "pages"
        (chunks,) = h.cpu_chunks
        segs = len(page_of(gpu[0], layout, 0))
        assert chunks.shape[:2] == (N_CPU * factor, layers * segs)
        assert chunks.is_contiguous()
        rng = np.random.default_rng(factor)
        n = 8
        perm = rng.permutation(N_GPU)
        src, dst = perm[:n], perm[n : 2 * n]
        cpu = rng.permutation(N_CPU)[: -(-n // factor)]
        for k, hh in enumerate((h, mirror)):
            assert hh.d2h.transfer_async(10 + k, (src, cpu)) is True
            hh.wait([10 + k])
            assert [r.success for r in hh.get_finished()] == [True]
        # The views read what a per-layer cache holds, and the chunk of sub-block s holds the
        # block's pages in table order, one after another.
        stored = ref_store_subs(cpu.tolist(), n, factor)
        for tv, tm in zip(h.cpu_caches[0], mirror.cpu_caches[0]):
            for s in stored:
                for a, b in zip(page_of(tv, layout, s), page_of(tm, layout, s)):
                    assert torch.equal(a, b)
        flat = chunks.view(torch.uint8).reshape(N_CPU * factor, -1)
        for i, s in enumerate(ref_store_subs(cpu.tolist(), n, factor)):
            pages = [p for t in gpu for p in page_of(t, layout, int(src[i]))]
            assert torch.equal(flat[s], torch.cat([p.reshape(-1) for p in pages]))
        # Back into other GPU blocks (end-aligned when n is not a multiple of the factor).
        n2 = n - 1 if factor > 1 else n
        for k, hh in enumerate((h, mirror)):
            assert hh.h2d.transfer_async(20 + k, (cpu, dst[:n2])) is True
            hh.wait([20 + k])
            assert [r.success for r in hh.get_finished()] == [True]
        for ta, tb in zip(gpu, mirror.gpu_caches[0]):
            assert torch.equal(ta.view(torch.uint8), tb.view(torch.uint8))
        subs = ref_load_subs(cpu.tolist(), n2, factor)
        for t in gpu:
            for i, s in enumerate(subs):
                j = ref_store_subs(cpu.tolist(), n, factor).index(s)
                for a, b in zip(page_of(t, layout, int(dst[i])), page_of(t, layout, int(src[j]))):
                    assert torch.equal(a, b)
        # A failed block-plan transfer is reported failed, once; the next one works.
        h.engine.inject_failures(1)
        assert h.d2h.transfer_async(30, (src, cpu)) is True
        h.wait([30])
        (r,) = h.get_finished()
        assert not r.success and "injected" in (r.error or "")
        assert h.d2h.transfer_async(31, (src, cpu)) is True
        h.wait([31])
        assert [r.success for r in h.get_finished()] == [True]
        # Bad ids are refused as on the page route, naming the block.
        with pytest.raises(InvalidTransferError, match="out of range"):
            h.d2h.transfer_async(32, ([N_GPU], [0]))
    finally:
        h.shutdown()
        mirror.shutdown()


def test_auto_takes_the_block_plan_for_pages_of_16_kib_and_more() -> None:
    from blockswap.handler import BLOCK_MIN_PAGE

    def route(page: int, layers: int = 4) -> str:
        buf = torch.zeros((layers, N_GPU, 1, page), dtype=torch.uint8)
        gpu = [buf[i] for i in range(layers)]
        h = CpuGpuHandlers(gpu, N_CPU, layout="mla", backend="host")
        try:
            assert h.routes["d2h"].plan == h.routes["h2d"].plan
            return h.routes["d2h"].plan
        finally:
            h.shutdown()

    assert route(BLOCK_MIN_PAGE) == "blocks"
    # Below it, the staged plan: a copy per block row through the staging ring.
    assert route(BLOCK_MIN_PAGE // 4) == "staged"
    # The mirrored CPU cache keeps the page route.
    gpu = [torch.zeros((N_GPU, 1, BLOCK_MIN_PAGE), dtype=torch.uint8)]
    h = CpuGpuHandlers(gpu, N_CPU, layout="mla", backend="host", cpu_layout="mirror")
    try:
        assert h.routes["d2h"].plan == "pages"
    finally:
        h.shutdown()


def test_block_route_is_chosen_only_where_it_saves_copies_and_path_blocks_insists() -> None:
    # Two KV-cache groups, each its own allocation: a plan per group; pages of 128 bytes take the
    # page route by default, path="blocks" takes the plans, and moves both groups in one batch.
    g = [one_allocation("kv_fused", 2, N_GPU), one_allocation("kv_fused", 3, N_GPU)]
    h = CpuGpuHandlers(g, N_CPU, layout="kv_fused", backend="host")
    try:
        assert h.routes["d2h"].plan == "staged"
        assert [len(p or []) for p in h.block_plans["d2h"]] == [1, 1]
    finally:
        h.shutdown()
    h = CpuGpuHandlers(
        g, N_CPU, layout="kv_fused", backend="host", path="blocks", block_size_factor=2
    )
    try:
        assert h.routes["d2h"].plan == h.routes["h2d"].plan == "blocks"
        assert h.routes["d2h"].reason.startswith("group 0: blocks: 1 2-D copy per block")
        before = [[page_of(t, "kv_fused", b)[0].clone() for b in (1, 2, 3)] for t in g[1]]
        h.d2h.transfer_async(1, ([[4], [1, 2, 3]], [[0], [5, 6]]), block_indices=[0, 3])
        h.wait([1])  # the directions run on their own lanes
        h.h2d.transfer_async(2, ([[], [5, 6]], [[], [7, 8, 9]]),
                             block_indices=[0, 3])  # fmt: skip
        h.wait([1, 2])
        assert [r.success for r in h.get_finished()] == [True, True]
        # Group 1 stored blocks 1, 2, 3 from sub-block 1 of CPU block 5 and loaded them back.
        for t, pages in zip(g[1], before):
            for b, page in zip((7, 8, 9), pages):
                assert torch.equal(page_of(t, "kv_fused", b)[0], page)
    finally:
        h.shutdown()
    # Groups sharing memory (the same tensors twice): no block plan can prove their 2-D copies
    # disjoint, so path="blocks" is refused; the staged plan checks its pages as the page route
    # does, and a transfer writing one page twice is refused.
    shared = [g[0], g[0]]
    h = CpuGpuHandlers(shared, N_CPU, layout="kv_fused", backend="host")
    try:
        assert h.routes["d2h"].plan == "staged"
        with pytest.raises(InvalidTransferError, match="overlap"):
            h.h2d.transfer_async(3, ([[1], [2]], [[5], [5]]))
        h.h2d.transfer_async(4, ([[1], [2]], [[5], [6]]))
        h.wait([4])
        assert [r.success for r in h.get_finished()] == [True]
    finally:
        h.shutdown()
    with pytest.raises(ValueError, match="path='blocks'"):
        CpuGpuHandlers(shared, N_CPU, layout="kv_fused", backend="host", path="blocks")
    # path="dma" keeps the page route even where a block plan exists.
    h = CpuGpuHandlers(one_allocation("mla", 3, N_GPU), N_CPU, layout="mla", path="dma",
                       backend="host")  # fmt: skip
    try:
        assert h.routes["h2d"].plan == "pages" and h.block_plans["h2d"][0] is not None
    finally:
        h.shutdown()
    with pytest.raises(ValueError, match="cpu_layout"):
        CpuGpuHandlers(one_allocation("mla", 1, N_GPU), N_CPU, layout="mla", cpu_layout="x")


def _roundtrip_on_gpu(
    h: CpuGpuHandlers,
    gpu: list,
    layout: str,
    factor: int,
    seed: int,
    pieces: int,
    adjacent: bool = False,
) -> None:
    """Moves 32 random GPU blocks to random CPU blocks (``adjacent``: CPU blocks one after the
    other, from a random first one) and back to 32 other GPU blocks, each way as ``pieces``
    queued transfers, and checks every result, the bytes reported and the pages."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(64)
    n = 32
    src, dst = perm[:n], perm[n:]
    if adjacent:
        first = int(rng.integers(0, 32 - n // factor + 1))
        cpu = np.arange(first, first + n // factor)
    else:
        cpu = rng.permutation(32)[: n // factor]
    before = [torch.stack([p for p in page_of(t, layout, int(b))]) for t in gpu for b in src]
    per, cper = n // pieces, n // pieces // factor
    for j in range(pieces):
        s, c = src[j * per : (j + 1) * per], cpu[j * cper : (j + 1) * cper]
        assert h.d2h.transfer_async(1 + j, (s, c)) is True
    h.wait(range(1, pieces + 1))
    res = h.get_finished()
    assert [r.success for r in res] == [True] * pieces, [r.error for r in res]
    assert sum(r.bytes for r in res) == n * int(h.gpu_tables[0].nbytes.sum())
    for j in range(pieces):
        c, d = cpu[j * cper : (j + 1) * cper], dst[j * per : (j + 1) * per]
        assert h.h2d.transfer_async(1 + pieces + j, (c, d)) is True
    h.wait(range(pieces + 1, 2 * pieces + 1))
    res = h.get_finished()
    assert [r.success for r in res] == [True] * pieces, [r.error for r in res]
    after = [torch.stack([p for p in page_of(t, layout, int(b))]) for t in gpu for b in dst]
    for a, b in zip(after, before):
        assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("factor", FACTORS)
@pytest.mark.parametrize("layout", sorted(ONE_ALLOCATION))
def test_cuda_block_plan_roundtrip(layout: str, factor: int) -> None:
    """On the GPU: one cuMemcpy2DAsync per block both ways, byte-exact, 80 layers."""
    gpu = one_allocation(layout, 80, 64, device="cuda")
    h = CpuGpuHandlers(gpu, 32, layout=layout, block_size_factor=factor, path="blocks")
    try:
        assert h.backend == "cuda" and h.routes["d2h"].plan == "blocks"
        assert h.routes["h2d"].plan == "blocks"
        _roundtrip_on_gpu(h, gpu, layout, factor, 7 + factor, 1)
    finally:
        h.shutdown()


@pytest.mark.cuda
@pytest.mark.parametrize("adjacent", [False, True])
@pytest.mark.parametrize("slot_rows", [None, 3])
@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.parametrize("factor", FACTORS)
@pytest.mark.parametrize("layout", sorted(ONE_ALLOCATION))
def test_cuda_staged_roundtrip(
    layout: str, factor: int, separate: bool, slot_rows: int | None, adjacent: bool
) -> None:
    """On the GPU: the staged plan both ways, byte-exact, 80 layers one allocation or each its
    own; with slots of 3 rows a transfer of 8 blocks takes 3 steps and four queued transfers
    cycle the two slots many times (more blocks in flight than the ring holds); with adjacent
    CPU blocks their rows cross PCIe joined."""
    gpu = one_allocation(layout, 80, 64, device="cuda")
    if separate:
        gpu = [t.clone() for t in gpu]
    kw: dict = {}
    if slot_rows is not None:
        row = 80 * sum(p.numel() for p in page_of(gpu[0], layout, 0))
        kw["stage_bytes"] = slot_rows * row
    h = CpuGpuHandlers(gpu, 32, layout=layout, block_size_factor=factor, path="staged", **kw)
    try:
        assert h.backend == "cuda" and h.routes["d2h"].plan == h.routes["h2d"].plan == "staged"
        assert h.routes["h2d"].kernel is not None
        _roundtrip_on_gpu(h, gpu, layout, factor, 11 + factor, 4, adjacent)
    finally:
        h.shutdown()


@pytest.mark.cuda
@pytest.mark.parametrize("launch_bytes", [None, 20000])
@pytest.mark.parametrize("factor", FACTORS)
@pytest.mark.parametrize("layout", sorted(ONE_ALLOCATION))
def test_cuda_kernel_route_launched_by_the_core(
    layout: str, factor: int, launch_bytes: int | None
) -> None:
    """On the GPU: the per-page kernel route (a mirrored CPU cache, every page by the copy
    kernel) launched by the core, not from Python, both ways, byte-exact, 8 layers; with
    ``kernel_launch_bytes=20000`` each transfer takes many launches one after the other."""
    gpu = one_allocation(layout, 8, 64, device="cuda")
    h = CpuGpuHandlers(
        gpu,
        32,
        layout=layout,
        block_size_factor=factor,
        cpu_layout="mirror",
        path="kernel",
        kernel_launch_bytes=launch_bytes,
    )
    try:
        for r in h.routes.values():
            assert r.plan == "pages" and r.kernel_below > 0
            assert r.launcher is None and r.kernel is not None, r
            assert r.launch_bytes == launch_bytes and "launched by the core" in r.reason
        _roundtrip_on_gpu(h, gpu, layout, factor, 3 + factor, 4)
    finally:
        h.shutdown()


@pytest.mark.cuda
@pytest.mark.parametrize(("page", "blocks"), [(4100, 4), (1 << 20, 1)])
def test_cuda_core_kernel_route_odd_and_large_pages(page: int, blocks: int) -> None:
    """On the GPU: the core's kernel route for pages that are no multiple of 16 bytes (the
    any-alignment path) and for a few 1 MiB pages (each cut into slices across CTAs), byte-exact
    both ways."""
    layers = 3
    gpu = [
        torch.randint(0, 256, (8, 1, page), dtype=torch.uint8, device="cuda") for _ in range(layers)
    ]
    h = CpuGpuHandlers(gpu, 8, layout="mla", cpu_layout="mirror", path="kernel")
    try:
        assert all(r.kernel is not None and r.launcher is None for r in h.routes.values())
        rng = np.random.default_rng(page)
        perm = rng.permutation(8)
        src, dst = perm[:blocks], perm[blocks : 2 * blocks]
        cpu = rng.permutation(8)[:blocks]
        before = [t[torch.as_tensor(src, device="cuda")].clone() for t in gpu]
        assert h.d2h.transfer_async(1, (src, cpu)) is True
        h.wait([1])
        assert all(r.success for r in h.get_finished())
        for t in gpu:  # what comes back must come from the CPU cache
            t[torch.as_tensor(dst, device="cuda")] = 0
        assert h.h2d.transfer_async(2, (cpu, dst)) is True
        h.wait([2])
        assert all(r.success for r in h.get_finished())
        for t, b in zip(gpu, before):
            assert torch.equal(t[torch.as_tensor(dst, device="cuda")], b)
    finally:
        h.shutdown()


@pytest.mark.cuda
def test_cuda_staged_results_keep_their_order_beside_plain_transfers() -> None:
    """On the GPU: a staged CPU->GPU transfer ends with kernels on the stage's stream while the
    direction's copy stream goes on to the next transfer; a plain transfer queued behind it on
    one engine is never reported before it. Each staged transfer (40 MiB, 16 KiB pages, slots
    of 3 rows: many steps) is followed by a 4 KiB plain copy; waiting for the plain one alone,
    the staged one must be reported too, its bytes already in place. Both directions, queued."""
    layers, pages, kib = 80, 64, 16
    gpu = [
        torch.randint(0, 256, (pages, 1, kib * 1024), dtype=torch.uint8, device="cuda")
        for _ in range(layers)
    ]
    h = CpuGpuHandlers(gpu, 32, layout="mla", path="staged", stage_bytes=3 * layers * kib * 1024)
    host = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8).pin_memory()
    dev = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda")
    try:
        assert h.routes["h2d"].plan == h.routes["d2h"].plan == "staged"
        e = h.engine
        hp, dp = e.register(host), e.register(dev)
        rng = np.random.default_rng(5)
        job = 0
        for rnd in range(4):
            src = rng.permutation(pages)[:32]
            before = torch.stack([t[int(b)] for t in gpu for b in src])
            job += 1
            assert h.d2h.transfer_async(job, (src, np.arange(32))) is True
            e.submit(job + 1, [dp + 4096 * (12 + rnd)], [hp + 4096 * (12 + rnd)], [4096], "d2h")
            job += 1
            h.wait([job])
            assert sorted(r.job_id for r in h.get_finished()) == [job - 1, job]
            dst = rng.permutation(pages)[:32]
            job += 1
            assert h.h2d.transfer_async(job, (np.arange(32), dst)) is True
            e.submit(job + 1, [hp + 4096 * rnd], [dp + 4096 * (rnd + 8)], [4096], "h2d")
            job += 1
            h.wait([job])
            res = h.get_finished()
            assert sorted(r.job_id for r in res) == [job - 1, job]
            assert all(r.success for r in res), [r.error for r in res]
            # Read at once, on torch's stream: the staged bytes must have landed.
            after = torch.stack([t[int(b)] for t in gpu for b in dst])
            assert torch.equal(after, before)
        torch.cuda.synchronize()
        assert torch.equal(dev[8 * 4096 : 12 * 4096].cpu(), host[: 4 * 4096])
    finally:
        h.shutdown()


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
