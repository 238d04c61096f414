"""Tests of blockswap.handler: the offloading handlers a KV-cache connector calls -- round trips
through every layout, the sub-block rules, both directions in flight, shutdown. Refusals, CUDA
model configs, the block and staged plans and a CPU cache in pieces are in the other
tests/test_handler_*.py files; their shared helpers in tests/kv_helpers.py.

On the host backend, CPU tensors stand in for the GPU side, and expected contents are computed
independently of the module, from torch's own strided indexing (the bytes of block ``b`` of a
tensor are those of ``t.select(block_dim, b)``) and from the sub-block rules written out here by
hand. Tests marked ``cuda`` (tests/test_handler_cuda.py) run the same round trips with real CUDA
tensors shaped like the KV caches of published model configs; the conftest skips them where
there is no GPU.
"""

from __future__ import annotations

import gc
import math
import time
import weakref

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockswap import ConfigError, ShutdownError
from blockswap.handler import CpuGpuHandlers, load_sub_blocks, store_sub_blocks
from blockswap.layout import LAYOUTS
from kv_helpers import (
    CASES,
    FACTORS,
    ID_TYPES,
    N_CPU,
    Case,
    all_tensors,
    apply_move,
    assert_storage,
    block_bytes,
    fill_random,
    kv_split,
    make,
    plan,
    raw,
    ref_load_subs,
    ref_subs_from,
    snapshot,
    spec_of,
)

# --------------------------------------------------------------------------------------------
# Round trips: GPU -> CPU -> other GPU blocks, every layout, factors 1 and 4
# --------------------------------------------------------------------------------------------


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
    # Counts are checked by name (the core's rule takes unsigned ints: OverflowError before).
    for helper in (store_sub_blocks, load_sub_blocks):
        with pytest.raises(ConfigError, match="block_index must be an int >= 0, not -1"):
            helper([0], 2, 4, block_index=-1)
        with pytest.raises(ConfigError, match="num_gpu_blocks must be an int >= 0, not -1"):
            helper([0], -1, 4)
        with pytest.raises(ConfigError, match="block_size_factor must be an int >= 1, not 0"):
            helper([0], 1, 0)


def test_factor_4_partial_blocks_at_start_and_end() -> None:
    gpu = kv_split(torch.bfloat16)
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
