"""Tests of blockswap.layout: block tables and copy descriptors, on CPU tensors.

"GPU" tensors here are plain CPU tensors standing in; the copier is ctypes.memmove over the
three descriptor arrays. Expected contents are computed independently of the module, from
torch's own strided indexing: the byte positions of block ``b`` of a tensor are those of
``t.select(block_dim, b)``, so a round trip must move exactly those bytes and no others (in
particular no padding byte between pages is written).
"""

from __future__ import annotations

import ctypes
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockswap import BlockswapError, ConfigError, ConfigTypeError, Engine
from blockswap._core import chunk_blocks
from blockswap.handler import CpuGpuHandlers
from blockswap.layout import (
    LAYOUTS,
    BlockTable,
    LayoutError,
    expand_sub_blocks,
    make_cpu_cache_like,
)
from kv_helpers import apply_move, assert_storage, block_bytes, fill_random, raw, snapshot, strided

# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


class Transfer(NamedTuple):
    src_ptrs: npt.NDArray[np.int64]
    dst_ptrs: npt.NDArray[np.int64]
    sizes: npt.NDArray[np.int64]


def build_transfer(src: BlockTable, src_ids: Any, dst: BlockTable, dst_ids: Any) -> Transfer:
    """Reference descriptors of a table pair, by the definition: segment-major, block-minor,
    descriptor ``s * n + i`` copies segment ``s`` of block ``src_ids[i]`` (no checks)."""
    s_ids, d_ids = np.asarray(src_ids, dtype=np.int64), np.asarray(dst_ids, dtype=np.int64)
    assert src.is_compatible(dst) and s_ids.shape == d_ids.shape
    sp = (src.bases[:, None] + src.strides[:, None] * s_ids[None, :]).ravel()
    dp = (dst.bases[:, None] + dst.strides[:, None] * d_ids[None, :]).ravel()
    sz = np.repeat(src.nbytes, s_ids.shape[0])
    return Transfer(sp, dp, sz)


def memmove_copy(t: Transfer) -> None:
    """Reference copier: one memmove per descriptor."""
    for s, d, n in zip(t.src_ptrs.tolist(), t.dst_ptrs.tolist(), t.sizes.tolist()):
        ctypes.memmove(d, s, n)


def engine_copy(
    src: Sequence[BlockTable],
    src_ids: Sequence[Any],
    dst: Sequence[BlockTable],
    dst_ids: Sequence[Any],
    direction: str,
    skips: Sequence[int],
    factor: int,
) -> int:
    """Moves a transfer of several groups through a host engine's block tables, the CPU side
    named by CPU block ids (``factor`` sub-blocks each, from ``skips[g]``); returns its bytes."""
    with Engine("host") as eng:
        kinds = ("device", "host") if direction == "d2h" else ("host", "device")
        for tabs, kind in zip((src, dst), kinds):
            for t in tabs:
                for start, n in t.spans().tolist():
                    eng.register(start, n, kind)
        groups = []
        for g in range(len(src)):
            ids = []
            for t, kind in zip((src[g], dst[g]), kinds):
                unit = factor if kind == "host" else 1
                ids.append(eng.register_table(t.bases, t.strides, t.nbytes, t.num_blocks, kind,
                                              "CPU" if kind == "host" else "GPU", unit))  # fmt: skip
            s_ids = np.asarray(src_ids[g], dtype=np.int64)
            d_ids = np.asarray(dst_ids[g], dtype=np.int64)
            groups.append((ids[0], s_ids, ids[1], d_ids, skips[g]))
        eng.submit_groups(1, groups, direction)
        eng.wait([1])
        (r,) = eng.get_finished()
        assert r.success, r.error
        return r.bytes


def dim_order(t: torch.Tensor) -> list[int]:
    """Dims of ``t`` from outermost to innermost in memory."""
    return sorted(range(t.dim()), key=lambda k: (-t.stride()[k], k))


# --------------------------------------------------------------------------------------------
# Layout cases: builders of one KV-cache group ("GPU" tensors) and how to describe it
# --------------------------------------------------------------------------------------------

F8 = torch.float8_e4m3fn
N_GPU = 12  # GPU blocks per group
N_CPU = 10  # CPU blocks per group (each holds `factor` GPU-sized sub-blocks)


@dataclass
class Case:
    name: str
    build: Callable[[], list[torch.Tensor]]
    layout: str | None = None
    block_dim: int | None = None

    @property
    def kw(self) -> dict[str, Any]:
        return {"layout": self.layout, "block_dim": self.block_dim}

    @property
    def bd(self) -> int:
        return LAYOUTS[self.layout] if self.layout is not None else int(self.block_dim or 0)


def _kv_split(dtype: torch.dtype, pad: int = 0, interleaved: bool = False) -> Case:
    order = [1, 0, 2, 3, 4] if interleaved else None

    def build() -> list[torch.Tensor]:
        return [strided((2, N_GPU, 4, 2, 8), dtype, 1, pad=pad, order=order) for _ in range(3)]

    tag = f"kv_split-{dtype}".replace("torch.", "")
    tag += f"-pad{pad}" if pad else ""
    tag += "-interleaved" if interleaved else ""
    return Case(tag, build, layout="kv_split")


def _kv_fused(dtype: torch.dtype, pad: int = 0, hnd: bool = False) -> Case:
    # hnd: memory order [blocks, 2, heads, block_size, head_dim] behind the NHD logical view
    order = [0, 1, 3, 2, 4] if hnd else None

    def build() -> list[torch.Tensor]:
        return [strided((N_GPU, 2, 4, 2, 8), dtype, 0, pad=pad, order=order) for _ in range(2)]

    tag = f"kv_fused-{dtype}".replace("torch.", "")
    tag += f"-pad{pad}" if pad else ""
    tag += "-hnd" if hnd else ""
    return Case(tag, build, layout="kv_fused")


def _cross_layer(dtype: torch.dtype) -> Case:
    return Case(
        f"cross_layer-{dtype}".replace("torch.", ""),
        lambda: [strided((N_GPU, 3, 2, 4, 2, 8), dtype, 0)],
        layout="cross_layer",
    )


def _layer_views_of_cross_layer_buffer() -> Case:
    # vLLM-style per-layer views into one cross-layer buffer: block stride = all layers' pages.
    def build() -> list[torch.Tensor]:
        buf = strided((N_GPU, 3, 2, 4, 2, 8), torch.bfloat16, 0)
        return [buf[:, i] for i in range(3)]

    return Case("kv_fused-views-of-cross-layer", build, layout="kv_fused")


def _mla(dtype: torch.dtype, pad: int = 0) -> Case:
    def build() -> list[torch.Tensor]:
        return [strided((N_GPU, 4, 40), dtype, 0, pad=pad) for _ in range(3)]

    tag = f"mla-{dtype}".replace("torch.", "") + (f"-pad{pad}" if pad else "")
    return Case(tag, build, layout="mla")


def _explicit_block_dim() -> Case:
    # [layers, 2, blocks, block_size, head_dim]: block dim 2, 2 x layers segments per block
    return Case(
        "block_dim2",
        lambda: [strided((3, 2, N_GPU, 4, 8), torch.float16, 2, pad=5)],
        block_dim=2,
    )


def _mixed_pages() -> Case:
    # one group whose tensors differ in dtype, page size and padding (non-uniform segments)
    def build() -> list[torch.Tensor]:
        return [
            strided((N_GPU, 4, 16), torch.bfloat16, 0, pad=3),
            strided((N_GPU, 4, 8), F8, 0),
            strided((N_GPU, 2, 4, 6), torch.float32, 0, pad=1),
        ]

    return Case("mixed-pages", build, block_dim=0)


CASES = [
    _kv_split(torch.bfloat16),
    _kv_split(torch.float16),
    _kv_split(F8),
    _kv_split(torch.bfloat16, pad=24),
    _kv_split(F8, pad=7),
    _kv_split(torch.float16, interleaved=True),
    _kv_fused(torch.float16),
    _kv_fused(torch.bfloat16, pad=16),
    _kv_fused(F8, hnd=True),
    _cross_layer(torch.bfloat16),
    _cross_layer(F8),
    _layer_views_of_cross_layer_buffer(),
    _mla(torch.bfloat16),
    _mla(F8, pad=13),
    _explicit_block_dim(),
    _mixed_pages(),
]

FACTORS = [1, 4]


# --------------------------------------------------------------------------------------------
# Round trips: GPU -> CPU (store, with skip) -> other GPU blocks (load)
# --------------------------------------------------------------------------------------------


@st.composite
def transfer_plan(draw: st.DrawFn, factor: int, n_gpu: int = N_GPU, n_cpu: int = N_CPU):
    """(gpu source ids, cpu block ids, skip, gpu destination ids) for one group."""
    n = draw(st.integers(1, 6))
    src = draw(st.lists(st.integers(0, n_gpu - 1), min_size=n, max_size=n))
    skip = draw(st.integers(0, factor - 1))
    m = math.ceil((skip + n) / factor)
    cpu = draw(st.permutations(range(n_cpu)))[:m]
    free = [b for b in range(n_gpu) if b not in set(src)]
    dst = draw(st.permutations(free))[:n]
    return src, cpu, skip, dst


def _group_roundtrip(cases: Sequence[Case], factor: int, data: st.DataObject) -> None:
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    gpus = [c.build() for c in cases]
    cpus = [
        make_cpu_cache_like(g, N_CPU, block_size_factor=factor, **c.kw) for g, c in zip(gpus, cases)
    ]
    for ts in [*gpus, *cpus]:
        fill_random(ts, gen)
    gtab = [BlockTable.from_tensors(g, **c.kw) for g, c in zip(gpus, cases)]
    ctab = [BlockTable.from_tensors(t, **c.kw) for t, c in zip(cpus, cases)]
    for g, t in zip(gtab, ctab):
        assert t.num_blocks == N_CPU * factor and g.num_blocks == N_GPU
        assert g.is_compatible(t)
    plans = [data.draw(transfer_plan(factor)) for _ in cases]
    subs = [expand_sub_blocks(cpu, factor, skip, len(src)) for src, cpu, skip, _ in plans]
    skips = [p[2] for p in plans]

    # store: GPU -> CPU, through the engine's block tables (CPU side by CPU block ids)
    gpu0 = [snapshot(g) for g in gpus]
    cpu_expected = [snapshot(t) for t in cpus]
    for i, c in enumerate(cases):
        apply_move(cpu_expected[i], gpu0[i], gpus[i], plans[i][0], cpus[i], subs[i].tolist(), c.bd)
    moved = engine_copy(gtab, [p[0] for p in plans], ctab, [p[1] for p in plans], "d2h", skips,
                        factor)  # fmt: skip
    assert moved == sum(t.page_bytes * len(p[0]) for t, p in zip(gtab, plans))
    for i in range(len(cases)):
        assert_storage(cpus[i], cpu_expected[i])
        assert_storage(gpus[i], gpu0[i])  # the source is untouched

    # load: CPU -> different GPU blocks
    cpu1 = [snapshot(t) for t in cpus]
    gpu_expected = [snapshot(g) for g in gpus]
    for i, c in enumerate(cases):
        apply_move(gpu_expected[i], cpu1[i], cpus[i], subs[i].tolist(), gpus[i], plans[i][3], c.bd)
    engine_copy(ctab, [p[1] for p in plans], gtab, [p[3] for p in plans], "h2d", skips, factor)
    for i, (src, _, _, dst) in enumerate(plans):
        assert_storage(gpus[i], gpu_expected[i])
        assert_storage(cpus[i], cpu1[i])
        # end to end: GPU block dst[j] now holds what GPU block src[j] held
        for t in gpus[i]:
            bd = cases[i].bd % t.dim()
            for s, d in zip(src, dst):
                before = gpu0[i][raw(t).data_ptr()][block_bytes(t, bd, s)]
                assert torch.equal(raw(t)[block_bytes(t, bd, d)], before)


@pytest.mark.parametrize("factor", FACTORS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_roundtrip(case: Case, factor: int, data: st.DataObject) -> None:
    _group_roundtrip([case], factor, data)


@pytest.mark.parametrize("factor", FACTORS)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_roundtrip_hybrid_groups(factor: int, data: st.DataObject) -> None:
    # two KV-cache groups with different page sizes, dtypes and block-id spaces, one batch
    _group_roundtrip([_kv_split(torch.bfloat16, pad=8), _mla(F8)], factor, data)


# --------------------------------------------------------------------------------------------
# Descriptor shape: order, contiguity, tables
# --------------------------------------------------------------------------------------------


def test_segments_are_ordered_tensor_by_tensor_then_k_v() -> None:
    gpu = [strided((2, N_GPU, 4, 2, 8), torch.bfloat16, 1, pad=8) for _ in range(2)]
    cpu = make_cpu_cache_like(gpu, N_CPU, layout="kv_split")
    g = BlockTable.from_tensors(gpu, "kv_split")
    c = BlockTable.from_tensors(cpu, "kv_split")
    assert g.num_segments == c.num_segments == 4  # layer0 K, layer0 V, layer1 K, layer1 V
    page = 4 * 2 * 8 * 2
    np.testing.assert_array_equal(g.nbytes, [page] * 4)
    np.testing.assert_array_equal(g.strides, [page + 16] * 4)
    k0, k1 = gpu[0].data_ptr(), gpu[1].data_ptr()
    v_off = gpu[0].stride(0) * 2
    np.testing.assert_array_equal(g.bases, [k0, k0 + v_off, k1, k1 + v_off])
    assert c.is_compatible(g) and (c.nbytes == page).all()


@pytest.mark.parametrize(
    "layout,shape",
    [
        ("kv_fused", (N_GPU, 2, 4, 2, 8)),
        ("kv_split", (2, N_GPU, 4, 2, 8)),
        ("mla", (N_GPU, 4, 40)),
        ("cross_layer", (N_GPU, 3, 2, 4, 8)),
    ],
)
@pytest.mark.parametrize("factor", FACTORS)
def test_consecutive_blocks_give_contiguous_descriptors(
    layout: str, shape: tuple[int, ...], factor: int
) -> None:
    gpu = [torch.empty(shape, dtype=torch.float16) for _ in range(2)]
    cpu = make_cpu_cache_like(gpu, N_CPU, layout=layout, block_size_factor=factor)
    g = BlockTable.from_tensors(gpu, layout)
    c = BlockTable.from_tensors(cpu, layout)
    src = np.arange(3, 9)
    skip = 1 % factor
    dst = expand_sub_blocks(np.arange(2, 2 + math.ceil((skip + 6) / factor)), factor, skip, 6)
    t = build_transfer(g, src, c, dst)
    n = len(src)
    for seg in range(g.num_segments):
        sl = slice(seg * n, (seg + 1) * n)
        s, d, z = t.src_ptrs[sl], t.dst_ptrs[sl], t.sizes[sl]
        np.testing.assert_array_equal(s[:-1] + z[:-1], s[1:])
        np.testing.assert_array_equal(d[:-1] + z[:-1], d[1:])


def test_padded_pages_are_not_contiguous_but_copy_only_the_page() -> None:
    gpu = [strided((N_GPU, 2, 4, 8), torch.float16, 0, pad=4)]
    g = BlockTable.from_tensors(gpu, block_dim=0)
    assert int(g.nbytes[0]) == 2 * 4 * 8 * 2
    assert int(g.strides[0]) == (2 * 4 * 8 + 4) * 2


def test_table_basics() -> None:
    gpu = [torch.zeros(2, N_GPU, 4, 2, 8, dtype=torch.bfloat16) for _ in range(3)]
    g = BlockTable.from_tensors(gpu, "kv_split")
    assert g.num_segments == 6 and g.num_blocks == N_GPU
    assert g.page_bytes == 6 * 4 * 2 * 8 * 2
    assert g.device == torch.device("cpu")
    assert all(a is b for a, b in zip(g.owners, gpu))  # keeps the memory alive
    assert "num_segments=6" in repr(g)
    with pytest.raises(ValueError):
        g.bases[0] = 0  # read-only
    one = BlockTable.from_tensors(gpu[0], "kv_split")  # a single tensor is fine too
    assert one.num_segments == 2
    assert BlockTable.from_tensors(gpu, block_dim=1).is_compatible(g)
    direct = BlockTable(bases=[4096], strides=[64], nbytes=[32], num_blocks=8, device="cpu")
    t = build_transfer(direct, [0, 1], direct, [3, 4])
    assert t.src_ptrs.tolist() == [4096, 4160] and t.dst_ptrs.tolist() == [4288, 4352]


# --------------------------------------------------------------------------------------------
# make_cpu_cache_like
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("factor", FACTORS)
def test_make_cpu_cache_like(factor: int) -> None:
    gpu = [
        strided((2, N_GPU, 4, 2, 8), F8, 1, pad=5, order=[1, 0, 3, 2, 4]),
        strided((2, N_GPU, 4, 2, 8), F8, 1),
    ]
    cpu = make_cpu_cache_like(gpu, 3, layout="kv_split", block_size_factor=factor)
    assert len(cpu) == 2
    for g, c in zip(gpu, cpu):
        assert c.shape == (2, 3 * factor, 4, 2, 8) and c.dtype == F8 and c.device.type == "cpu"
        assert not c.is_pinned()
        # same dim order in memory, dense (no padding)
        assert dim_order(g) == dim_order(c)
        assert c.untyped_storage().nbytes() == c.numel() * c.element_size()
    assert BlockTable.from_tensors(cpu, "kv_split").is_compatible(
        BlockTable.from_tensors(gpu, "kv_split")
    )
    assert make_cpu_cache_like(gpu, 0, layout="kv_split")[0].shape[1] == 0


def test_make_cpu_cache_like_validates() -> None:
    gpu = [torch.empty(2, N_GPU, 4, 2, 8)]
    with pytest.raises(ValueError, match="block_size_factor"):
        make_cpu_cache_like(gpu, 3, layout="kv_split", block_size_factor=0)
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        make_cpu_cache_like(gpu, -1, layout="kv_split")
    with pytest.raises(LayoutError, match="tensor 0"):
        make_cpu_cache_like(gpu, 3, layout="kv_fused")


# --------------------------------------------------------------------------------------------
# expand_sub_blocks
# --------------------------------------------------------------------------------------------


def test_expand_sub_blocks_examples() -> None:
    assert expand_sub_blocks([0, 1, 3], 4).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15]
    assert expand_sub_blocks([0, 1, 3], 4, skip=1, count=9).tolist() == [
        *[1, 2, 3, 4, 5, 6, 7],
        *[12, 13],
    ]
    assert expand_sub_blocks([5], 4, skip=2, count=1).tolist() == [22]
    assert expand_sub_blocks([5, 2], 1).tolist() == [5, 2]
    assert expand_sub_blocks([], 4).tolist() == []
    # vLLM loads align the run to the end of the last CPU block: skip = (-n) % factor
    n = 6
    assert expand_sub_blocks([3, 8], 4, skip=(-n) % 4, count=n).tolist() == [
        *[14, 15],
        *[32, 33, 34, 35],
    ]
    ids = np.array([1, 2])
    out = expand_sub_blocks(ids, 1)
    out[0] = 99
    assert ids[0] == 1  # never aliases the input
    # Ids in an unaligned view, and strided ones handed to the core's rule directly (as the vLLM
    # worker hands it a spec's CPU ids): read as written.
    unaligned = np.frombuffer(b"\0" + np.array([3, 1], np.int64).tobytes(), np.int64, offset=1)
    assert not unaligned.flags.aligned
    assert expand_sub_blocks(unaligned, 2).tolist() == [6, 7, 2, 3]
    assert chunk_blocks(np.arange(8)[::3], 2, 6).tolist() == [0, 1, 6, 7, 12, 13]
    assert chunk_blocks(unaligned, 2, 3, 1).tolist() == [7, 2, 3]


@given(
    ids=st.lists(st.integers(0, 1000), min_size=1, max_size=20),
    factor=st.integers(1, 8),
    data=st.data(),
)
def test_expand_sub_blocks_matches_reference(ids: list[int], factor: int, data: Any) -> None:
    skip = data.draw(st.integers(0, factor - 1))
    avail = len(ids) * factor - skip
    count = data.draw(st.integers(max(1, avail - factor + 1), avail))
    ref = [b * factor + j for b in ids for j in range(factor)][skip : skip + count]
    got = expand_sub_blocks(np.array(ids), factor, skip, count)
    assert got.dtype == np.int64 and got.tolist() == ref


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"block_ids": [1], "factor": 0}, ValueError, "factor"),
        ({"block_ids": [1], "factor": 4, "skip": 4}, ValueError, "skip"),
        ({"block_ids": [1], "factor": 4, "skip": -1}, ValueError, "skip"),
        (
            {"block_ids": [1, 2], "factor": 4, "skip": 1, "count": 8},
            ValueError,
            r"ceil\(\(1 \+ 8\) / 4\) = 3 CPU block ids",
        ),
        ({"block_ids": [1, 2], "factor": 4, "count": 4}, ValueError, "= 1 CPU block ids .* got 2"),
        ({"block_ids": [1], "factor": 4, "count": 0}, ValueError, "= 0 CPU block ids .* got 1"),
        ({"block_ids": [1], "factor": 4, "count": -1}, ValueError, "count must be an int >= 0"),
        ({"block_ids": [2**62], "factor": 4}, IndexError, "out of range"),
        ({"block_ids": [-1], "factor": 4}, IndexError, "negative"),
        ({"block_ids": [1.0], "factor": 4}, TypeError, "integers"),
        # more ids than memory can hold: an error to catch, not an abort of the process
        ({"block_ids": [0], "factor": 2**61}, MemoryError, "cannot hold 2305843009213693952"),
    ],
)
def test_expand_sub_blocks_errors(kwargs: dict[str, Any], exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        expand_sub_blocks(**kwargs)


# --------------------------------------------------------------------------------------------
# Validation errors
# --------------------------------------------------------------------------------------------


def _kv_split_tensors(n: int = 2) -> list[torch.Tensor]:
    return [torch.zeros(2, N_GPU, 4, 2, 8, dtype=torch.float16) for _ in range(n)]


def test_from_tensors_layout_argument_errors() -> None:
    ts = _kv_split_tensors()
    with pytest.raises(ValueError, match="layout"):
        BlockTable.from_tensors(ts)
    with pytest.raises(ValueError, match="unknown layout"):
        BlockTable.from_tensors(ts, "paged")
    with pytest.raises(ValueError, match="block dim 1"):
        BlockTable.from_tensors(ts, "kv_split", block_dim=0)
    with pytest.raises(LayoutError, match="out of range"):
        BlockTable.from_tensors(ts, block_dim=5)
    with pytest.raises(LayoutError, match="no tensors"):
        BlockTable.from_tensors([], "kv_split")
    with pytest.raises(TypeError, match="tensor 1"):
        BlockTable.from_tensors([ts[0], np.zeros(3)], "kv_split")


GOOD_SHAPE = {
    "kv_split": (2, N_GPU, 4, 2, 8),
    "kv_fused": (N_GPU, 2, 4, 2, 8),
    "mla": (N_GPU, 4, 40),
    "cross_layer": (N_GPU, 3, 2, 4, 8),
}


@pytest.mark.parametrize(
    "layout,shape",
    [
        ("kv_split", (3, N_GPU, 4, 2, 8)),
        ("kv_split", (2, N_GPU)),
        ("kv_fused", (N_GPU, 3, 4, 2, 8)),
        ("mla", (N_GPU, 4, 2, 8)),
        ("cross_layer", (N_GPU,)),
    ],
)
def test_shape_does_not_match_layout(layout: str, shape: tuple[int, ...]) -> None:
    good = torch.zeros(GOOD_SHAPE[layout])
    with pytest.raises(LayoutError, match=rf"tensor 1 \(shape {re.escape(str(shape))}.*{layout}"):
        BlockTable.from_tensors([good, torch.zeros(shape)], layout)


def test_non_contiguous_page_is_rejected_with_tensor_index_and_shape() -> None:
    ok = torch.zeros(2, N_GPU, 4, 2, 8, dtype=torch.float16)
    sliced = torch.zeros(2, N_GPU, 4, 2, 16, dtype=torch.float16)[..., ::2]
    with pytest.raises(LayoutError, match=r"tensor 1 \(shape \(2, 12, 4, 2, 8\).*not contiguous"):
        BlockTable.from_tensors([ok, sliced], "kv_split")
    narrowed = torch.zeros(N_GPU, 2, 4, 2, 16)[:, :, :, :, :8]
    with pytest.raises(LayoutError, match=r"tensor 0.*not contiguous"):
        BlockTable.from_tensors([narrowed], "kv_fused")
    expanded = torch.zeros(N_GPU, 1, 40).expand(N_GPU, 4, 40)
    with pytest.raises(LayoutError, match="not contiguous"):
        BlockTable.from_tensors([expanded], "mla")


def test_overlapping_blocks_are_rejected() -> None:
    buf = torch.zeros(4096, dtype=torch.float16)
    overlap = buf.as_strided((N_GPU, 4, 40), (100, 40, 1))  # block stride < page
    with pytest.raises(LayoutError, match="overlap"):
        BlockTable.from_tensors([overlap], "mla")
    same_kv = buf.as_strided((2, N_GPU, 4, 8), (0, 32, 8, 1))  # K and V alias
    with pytest.raises(LayoutError, match="overlap"):
        BlockTable.from_tensors([same_kv], "kv_split")
    interleaved_bad = buf.as_strided((2, N_GPU, 4, 8), (16, 64, 8, 1))  # K/V pages overlap
    with pytest.raises(LayoutError, match="overlap"):
        BlockTable.from_tensors([interleaved_bad], "kv_split")
    # Segments counted before they are listed: a view expanded to 2**33 segments of one page
    # is refused, not listed until the process runs out of memory; so are 2**25 real ones.
    expanded = torch.zeros(1, 2, 16, dtype=torch.float16).expand(1 << 33, 2, 16)
    with pytest.raises(LayoutError, match="has stride 0: its segments overlap"):
        BlockTable.from_tensors([expanded], block_dim=1)
    many = torch.zeros(1 << 25, dtype=torch.uint8).view(1 << 13, 1 << 12, 1, 1)
    with pytest.raises(LayoutError, match="more than 16777216 segments"):
        BlockTable.from_tensors([many], block_dim=2)


def test_tensors_must_agree() -> None:
    a = torch.zeros(2, N_GPU, 4, 2, 8)
    b = torch.zeros(2, N_GPU + 1, 4, 2, 8)
    with pytest.raises(LayoutError, match=r"tensor 1 .*13 blocks but tensor 0 has 12"):
        BlockTable.from_tensors([a, b], "kv_split")
    m = torch.zeros(2, N_GPU, 4, 2, 8, device="meta")
    with pytest.raises(LayoutError, match=r"tensor 1 .*not on cpu"):
        BlockTable.from_tensors([a, m], "kv_split")
    with pytest.raises(LayoutError, match="meta"):
        BlockTable.from_tensors([m], "kv_split")
    with pytest.raises(LayoutError, match="empty"):
        BlockTable.from_tensors([torch.zeros(N_GPU, 0, 8)], "mla")


def test_direct_construction_is_validated() -> None:
    with pytest.raises(LayoutError, match="equal length"):
        BlockTable(bases=[0, 64], strides=[64], nbytes=[32], num_blocks=2, device="cpu")
    with pytest.raises(LayoutError, match="nbytes > 0"):
        BlockTable(bases=[0], strides=[64], nbytes=[0], num_blocks=2, device="cpu")
    with pytest.raises(LayoutError, match="non-empty"):
        BlockTable(bases=[], strides=[], nbytes=[], num_blocks=2, device="cpu")
    with pytest.raises(LayoutError, match="num_blocks"):
        BlockTable(bases=[0], strides=[64], nbytes=[8], num_blocks=-1, device="cpu")
    # Integer arrays of any int dtype, integer tensors and tuples are taken, as int64.
    t = BlockTable(
        bases=np.array([4096], dtype=np.uint32),
        strides=torch.tensor([64]),
        nbytes=(64,),
        num_blocks=2,
        device=torch.device("cpu"),
    )
    assert [a.dtype for a in t.geometry()[:3]] == [np.int64] * 3
    assert t.bases.tolist() == [4096] and not t.bases.flags.writeable


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        # Float addresses were truncated (4096.5 taken as 4096); now refused.
        ({"bases": [4096.5]}, ConfigTypeError, "bases must hold integers, not float64"),
        ({"strides": torch.tensor([64.0])}, ConfigTypeError, "strides must hold integers"),
        ({"nbytes": [True]}, ConfigTypeError, "nbytes must hold integers, not bool"),
        # These leaked a plain ValueError, OverflowError, TypeError or RuntimeError.
        ({"bases": ["a"]}, ConfigTypeError, "bases must hold integers"),
        ({"bases": None}, ConfigTypeError, "bases must hold integers"),
        ({"bases": [2**64]}, LayoutError, r"bases holds integers outside \[-2\*\*63"),
        ({"bases": [2**63]}, LayoutError, r"bases holds values past 2\*\*63 - 1"),
        ({"strides": [[64], [64, 1]]}, LayoutError, "strides: setting an array element"),
        ({"bases": [[4096]]}, LayoutError, "bases must be one-dimensional"),
        ({"device": "bogus"}, LayoutError, "device 'bogus' is not one torch knows"),
        ({"device": None}, ConfigTypeError, "device must be a torch.device, a str or an int"),
        ({"owners": 5}, ConfigTypeError, "owners must be a sequence of tensors, not 5"),
    ],
)
def test_direct_construction_refuses_with_typed_errors_naming_the_field(
    change: dict[str, object], error: type[Exception], match: str
) -> None:
    args: dict[str, object] = {
        "bases": [4096],
        "strides": [64],
        "nbytes": [64],
        "num_blocks": 2,
        "device": "cpu",
    }
    with pytest.raises(error, match=match) as e:
        BlockTable(**{**args, **change})
    assert isinstance(e.value, BlockswapError)


def test_incompatible_tables() -> None:
    g = BlockTable.from_tensors(_kv_split_tensors(2), "kv_split")
    fewer = BlockTable.from_tensors(_kv_split_tensors(1), "kv_split")
    bigger = BlockTable.from_tensors(
        [torch.zeros(2, N_GPU, 4, 2, 8, dtype=torch.float16), torch.zeros(2, N_GPU, 4, 2, 8)],
        "kv_split",
    )
    assert not g.is_compatible(fewer) and not g.is_compatible(bigger)
    with pytest.raises(LayoutError, match=r"4 source segments, 2 destination segments$"):
        g.check_compatible(fewer)
    with pytest.raises(LayoutError, match="segment 2 has 128 source bytes per page and 256 dest"):
        g.check_compatible(bigger)


# --------------------------------------------------------------------------------------------
# GPU (only where one is present)
# --------------------------------------------------------------------------------------------


def _cuda_driver() -> Any:
    """The CUDA driver library. Only GPU tests ask for it, so where a GPU is present its absence
    is a broken machine: a failure, never a skip. (The driver, not the runtime: libcudart ships
    inside torch's wheels and need not be on the loader's path.)"""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        pytest.fail(f"a GPU is present but the CUDA driver library is not: {e}")


def test_a_missing_cuda_library_fails_the_gpu_test(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str, *args: Any, **kwargs: Any) -> Any:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    with pytest.raises(pytest.fail.Exception, match="CUDA driver library"):
        _cuda_driver()


@pytest.mark.cuda
def test_cuda_roundtrip_through_pinned_cpu_cache() -> None:
    cuda = _cuda_driver()
    cuda.cuMemcpy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t]

    def copy(t: Transfer) -> None:
        for s, d, n in zip(t.src_ptrs.tolist(), t.dst_ptrs.tolist(), t.sizes.tolist()):
            # Unified addressing: the driver infers each direction. torch's allocations below
            # make its primary context current on this thread.
            assert cuda.cuMemcpy(d, s, n) == 0

    gen = torch.Generator().manual_seed(0)
    gpu = [
        torch.randint(0, 256, (2, N_GPU, 4, 2, 8), dtype=torch.uint8, generator=gen).view(F8).cuda()
        for _ in range(2)
    ]
    g = BlockTable.from_tensors(gpu, "kv_split")
    assert g.device.type == "cuda" and int(g.bases[0]) == gpu[0].data_ptr()
    cpu = make_cpu_cache_like(gpu, 4, layout="kv_split", block_size_factor=2, pin_memory=True)
    assert all(c.is_pinned() and c.shape[1] == 8 for c in cpu)
    c = BlockTable.from_tensors(cpu, "kv_split")
    assert c.device.type == "cpu" and g.is_compatible(c)
    src, dst = [3, 0, 7], [5, 9, 1]
    sub = expand_sub_blocks([2, 0], 2, skip=1, count=3)  # sub-blocks 5, 0, 1
    before = [t.clone() for t in gpu]
    copy(build_transfer(g, src, c, sub))
    copy(build_transfer(c, sub, g, dst))
    torch.cuda.synchronize()
    for t, t0 in zip(gpu, before):
        want = t0.view(torch.uint8).clone()
        want[:, dst] = t0.view(torch.uint8)[:, src]
        assert torch.equal(t.view(torch.uint8), want)
    for t, t0 in zip(cpu, before):
        assert torch.equal(
            t.view(torch.uint8)[:, sub.tolist()].cuda(), t0.view(torch.uint8)[:, src]
        )


def test_spans_cover_every_segment_of_every_block() -> None:
    pad = 6
    a = strided((2, N_GPU, 4, 8), torch.float16, 1, pad=pad)
    b = strided((N_GPU, 4, 8), F8, 0)
    g = BlockTable.from_tensors([a, b], block_dim=-3)
    spans = g.spans()
    assert spans.dtype == np.int64 and spans.shape[1] == 2
    assert (np.diff(spans[:, 0]) > 0).all()
    for s in range(g.num_segments):
        for blk in range(g.num_blocks):
            lo = int(g.bases[s] + blk * g.strides[s])
            hi = lo + int(g.nbytes[s])
            assert any(st <= lo and hi <= st + n for st, n in spans.tolist())
    # a's K and V regions are two ranges (padding after the last K page); b is its own
    page = 4 * 8 * 2
    ka = a.data_ptr()
    ends = {st: n for st, n in spans.tolist()}
    assert ends[ka] == (N_GPU - 1) * (page + pad * 2) + page
    assert ends[b.data_ptr()] == N_GPU * 4 * 8
    overlapping = BlockTable(
        bases=[1000, 1010, 5000],
        strides=[100, 100, 8],
        nbytes=[20, 20, 8],
        num_blocks=3,
        device="cpu",
    )
    assert overlapping.spans().tolist() == [[1000, 230], [5000, 24]]
    empty = BlockTable(bases=[0], strides=[8], nbytes=[8], num_blocks=0, device="cpu")
    assert empty.spans().shape == (0, 2)


# --------------------------------------------------------------------------------------------
# CPU caches: the block-major chunk and the mirror (the core's geometry rules)
# --------------------------------------------------------------------------------------------


def test_block_major_views_put_every_page_of_a_sub_block_in_one_chunk() -> None:
    from blockswap.layout import make_block_major_cpu_cache

    # kv_split layers (K and V a segment each) and a factor of 2: 6 sub-blocks.
    gpu = [torch.zeros(2, 5, 4, 2, 8, dtype=torch.float16) for _ in range(3)]
    chunks, views = make_block_major_cpu_cache(gpu, 3, layout="kv_split", block_size_factor=2)
    assert tuple(chunks.shape) == (6, 6, 64) and chunks.dtype == torch.float16
    assert [tuple(v.shape) for v in views] == [(2, 6, 4, 2, 8)] * 3
    for layer, v in enumerate(views):
        for kv in range(2):
            for b in range(6):
                v[kv, b] = 100 * layer + 10 * kv + b
    for b in range(6):
        for layer in range(3):
            for kv in range(2):
                page = chunks[b, 2 * layer + kv]
                assert torch.all(page == 100 * layer + 10 * kv + b), (b, layer, kv)
    # Tables over the views are those of the GPU tensors, block for block.
    assert BlockTable.from_tensors(views, "kv_split").is_compatible(
        BlockTable.from_tensors(gpu, "kv_split")
    )


@pytest.mark.parametrize(
    "second",
    [torch.zeros(2, 5, 4, 2, 4, dtype=torch.float16), torch.zeros(2, 5, 4, 2, 8)],
    ids=["page-size", "dtype"],
)
def test_a_block_major_cache_needs_one_page_size_and_dtype(second: torch.Tensor) -> None:
    from blockswap.layout import make_block_major_cpu_cache

    first = torch.zeros(2, 5, 4, 2, 8, dtype=torch.float16)
    with pytest.raises(LayoutError, match=r"tensor 1 .*one page size and dtype per group"):
        make_block_major_cpu_cache([first, second], 2, layout="kv_split")


def test_a_mirror_keeps_the_gpu_dim_order_without_padding() -> None:
    from blockswap.layout import make_cpu_cache_like

    # Blocks outermost in memory though dim 1, and padding between blocks on the GPU side.
    store = torch.zeros(7, 2, 4, 8, dtype=torch.bfloat16)  # [blocks + 1, K/V, 4, 8]
    gpu = store[:6].permute(1, 0, 2, 3)  # [2, 6, 4, 8], block stride 64 elements
    (cpu,) = make_cpu_cache_like(gpu, 3, layout="kv_split", block_size_factor=3)
    assert tuple(cpu.shape) == (2, 9, 4, 8) and cpu.stride() == (32, 64, 8, 1)
    assert cpu.is_contiguous() is False and cpu.untyped_storage().nbytes() == 2 * 9 * 32 * 2
    # Contiguous GPU tensors give contiguous mirrors.
    (flat,) = make_cpu_cache_like(torch.zeros(2, 6, 4, 8), 2, layout="kv_split")
    assert flat.is_contiguous() and tuple(flat.shape) == (2, 2, 4, 8)


def test_the_cores_cache_geometry_refuses_a_block_dim_it_cannot_index() -> None:
    from blockswap import InvalidTransferError, _core

    with pytest.raises(InvalidTransferError, match="block_dim 3 and 2 strides for a shape of 2"):
        _core.mirror_geometry([2, 4], [4, 1], 3, 5)
    with pytest.raises(InvalidTransferError, match="a block dim in range and a stride per dim"):
        _core.block_major_views([([2, 4], [4, 1], 2)])
    with pytest.raises(InvalidTransferError, match="a block dim in range and a stride per dim"):
        _core.block_major_views([([2, 4], [4], 0)])
    # Columns of different lengths are named, not indexed past (which would panic).
    assert _core.tensor_segments(None, [4, 16], [16], 2, 0) == "1 strides for a shape of 2 dims"
    col = np.array([0, 100], np.int64)
    with pytest.raises(InvalidTransferError, match="2 bases, 1 strides, 2 nbytes"):
        _core.table_spans([(col, col[:1].copy(), col, 4)])
    for blocks in (2**70, -1):
        with pytest.raises(ValueError, match=rf"^{blocks} blocks: not a number of blocks a tensor"):
            _core.mirror_geometry([2, 4], [4, 1], 0, blocks)


def test_sizes_are_refused_in_the_callers_terms() -> None:
    """A tensor with no block, and a CPU copy past the address space, are named as such (the
    core's words named a num_blocks or a rows count the caller never gave)."""
    with pytest.raises(LayoutError, match=r"tensor 0 .*holds no block"):
        BlockTable.from_tensors([torch.zeros(2, 0, 4, 2, 8)], "kv_split")
    with pytest.raises(ConfigError, match="more than the address space: lower num_cpu_blocks"):
        make_cpu_cache_like([torch.zeros(2, 8, 4, 2, 8)], 1 << 62, layout="kv_split")
    # The block-major cache sizes itself on the meta device first: the same refusal (torch's
    # RuntimeError before), and for handlers, which allocate one.
    from blockswap.layout import make_block_major_cpu_cache

    for blocks in (1 << 60, 1 << 62):
        with pytest.raises(ConfigError, match="more than the address space"):
            make_block_major_cpu_cache([torch.zeros(3, 4, 5)], blocks, block_dim=0)
        with pytest.raises(ConfigError, match="more than the address space"):
            CpuGpuHandlers([torch.zeros(2, 8, 4, 2, 8)], blocks, layout="kv_split", backend="host")
    # A block dim past any tensor's dims is refused by name (an OverflowError before).
    for call in (
        lambda: BlockTable.from_tensors([torch.zeros(3, 4)], block_dim=2**70),
        lambda: make_cpu_cache_like([torch.zeros(3, 4)], 2, block_dim=2**70),
    ):
        with pytest.raises(ConfigError, match=r"block_dim must be an int from -64 to 63"):
            call()
