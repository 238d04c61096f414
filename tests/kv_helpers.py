"""Helpers shared by the layout and handler tests: whole storages, random fills, the byte
positions of a block, tensors with chosen strides and padding; for the handler tests
(tests/test_handler*.py), the reference of what a move must do (computed independently of
blockswap), the layout cases they build KV caches from and the transfer plans they draw."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from hypothesis import strategies as st

from blockswap.handler import CpuGpuHandlers


def raw(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t`` (padding included) as a 1-D uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def fill_random(tensors: Sequence[torch.Tensor], gen: torch.Generator) -> None:
    seen = set()
    for t in tensors:
        r = raw(t)
        if r.data_ptr() not in seen:
            seen.add(r.data_ptr())
            r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8, generator=gen))


def block_bytes(t: torch.Tensor, block_dim: int, b: int) -> torch.Tensor:
    """Byte positions (in ``raw(t)``) of block ``b``, in logical element order."""
    isz = t.element_size()
    elems = t.untyped_storage().nbytes() // isz
    idx = torch.arange(elems).as_strided(t.shape, t.stride(), t.storage_offset())
    e = idx.select(block_dim, b).reshape(-1)
    return (e[:, None] * isz + torch.arange(isz)).reshape(-1)


def strided(
    shape: Sequence[int],
    dtype: torch.dtype,
    block_dim: int,
    *,
    pad: int = 0,
    order: Sequence[int] | None = None,
) -> torch.Tensor:
    """A tensor of logical ``shape`` over a fresh buffer, dims laid out outermost-first in
    ``order`` (default: row-major), with ``pad`` extra elements per block (padding)."""
    nd = len(shape)
    order = list(range(nd)) if order is None else list(order)
    strides = [0] * nd
    acc = 1
    for k in reversed(order):
        strides[k] = acc + (pad if k == block_dim else 0)
        acc = strides[k] * shape[k]
    isz = torch.empty(0, dtype=dtype).element_size()
    buf = torch.empty(acc * isz, dtype=torch.uint8)
    return buf.view(dtype).as_strided(tuple(shape), tuple(strides))


def snapshot(tensors: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
    return {raw(t).data_ptr(): raw(t).clone() for t in tensors}


def assert_storage(tensors: Sequence[torch.Tensor], expected: dict[int, torch.Tensor]) -> None:
    for t in tensors:
        got = raw(t)
        want = expected[got.data_ptr()]
        if not torch.equal(got, want):
            bad = torch.nonzero(got != want).reshape(-1)
            raise AssertionError(f"{bad.numel()} bytes differ, first at byte {int(bad[0])}")


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


def kv_split(dtype: torch.dtype, pad: int = 0, interleaved: bool = False, n: int = N_GPU):
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
    Case("kv_split-bf16", lambda: [kv_split(torch.bfloat16)], ["kv_split"]),
    Case("kv_split-fp8-padded", lambda: [kv_split(F8, pad=7)], ["kv_split"]),
    Case(
        "kv_split-f16-interleaved",
        lambda: [kv_split(torch.float16, interleaved=True)],
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
        lambda: [kv_split(torch.bfloat16, pad=8), _mla(F8, n=N_GPU - 3)],
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
