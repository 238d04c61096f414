"""Byte-level helpers shared by the layout and handler tests: whole storages, random fills,
the byte positions of a block, tensors with chosen strides and padding."""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
