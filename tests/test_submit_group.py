"""A transfer of one group in one call into the core: ``Engine.submit_group``, the path the
handler's ``transfer_async`` and the vLLM worker take for the usual spec (one KV-cache group, two
1-D id arrays, at most one block index).

``submit_group`` works out the skip in the first chunk from the first block's index itself, as
the general path (``submit_groups`` with the skip ``chunk_skip`` gives) does: the two must move
the same bytes for every direction, unit and index. The handler and the plug-in must take it for
the usual call (checked by taking the general path away), and anything else must still take the
general path, which names what is wrong in its own words. Byte-exact round trips of the handler
through both paths against references computed from torch indexing are in tests/test_handler.py
(``test_roundtrip``: numpy ids take this path, lists and tensors the general one).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import blockswap
from blockswap import InvalidTransferError
from blockswap._core import chunk_count, chunk_skip
from blockswap.handler import CpuGpuHandlers

SEG = 256  # bytes of a page; two segments a block
N = 32  # GPU blocks
UNIT = 4  # sub-blocks of a chunk


class Pair:
    """Two engines on the host backend with the same tables over buffers of their own: one takes
    ``submit_group``, the other ``submit_groups`` with the skip worked out in Python."""

    def __init__(self, unit: int) -> None:
        self.unit = unit
        self.sides = []
        for _ in range(2):
            eng = blockswap.Engine("host")
            chunks = N // unit + 2
            host = np.zeros(chunks * unit * 2 * SEG, np.uint8)
            dev = np.zeros(2 * N * SEG, np.uint8)
            eng.register(host, kind="host")
            eng.register(dev, kind="device")
            h, d = host.ctypes.data, dev.ctypes.data
            # A chunk of `unit` sub-blocks, each a page of two segments.
            ht = eng.register_table(
                [h, h + SEG], [2 * SEG] * 2, [SEG] * 2, chunks * unit, "host", unit=unit
            )
            dt = eng.register_table([d, d + N * SEG], [SEG] * 2, [SEG] * 2, N, "device")
            self.sides.append((eng, host, dev, ht, dt))
        self.jobs = iter(range(1, 1 << 20))

    def close(self) -> None:
        for eng, *_ in self.sides:
            eng.shutdown()

    def run(self, d2h: bool, gpu: np.ndarray, chunks: np.ndarray, index: int | None) -> None:
        """One transfer through each engine; both must move the same bytes."""
        direction = "d2h" if d2h else "h2d"
        skip = chunk_skip(self.unit, len(gpu), index, d2h)
        for k, (eng, _, _, ht, dt) in enumerate(self.sides):
            job = next(self.jobs)
            src = (dt, gpu, ht, chunks) if d2h else (ht, chunks, dt, gpu)
            if k == 0:
                eng.submit_group(job, *src, index, direction)
            else:
                eng.submit_groups(job, [(*src, skip)], direction)
            eng.wait([job])
            (r,) = eng.get_finished()
            assert r.success, r.error


@pytest.fixture(params=[1, UNIT], ids=["unit1", "unit4"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    p = Pair(request.param)
    try:
        yield p
    finally:
        p.close()


@pytest.mark.parametrize("index", [None, 0, 1, 2, 3, 5, 6, 2**40 + 3])
@pytest.mark.parametrize("n", [1, 3, 4, 9])
def test_submit_group_moves_what_submit_groups_moves_with_the_skip(
    pair: Pair, n: int, index: int | None
) -> None:
    rng = np.random.default_rng(n * 1000 + (index or 0) % 997)
    dev0 = pair.sides[0][2]
    dev0[:] = rng.integers(1, 256, dev0.size, dtype=np.uint8)
    pair.sides[1][2][:] = dev0
    skip = chunk_skip(pair.unit, n, index, True)
    m = chunk_count(pair.unit, n, skip)
    gpu = rng.permutation(N)[:n].astype(np.int32)
    chunks = rng.permutation(N // pair.unit)[:m].astype(np.int64)
    # A store of n blocks from sub-block `skip` of the first chunk...
    pair.run(True, gpu, chunks, index)
    (_, host0, *_), (_, host1, *_) = pair.sides
    assert host0.any() and np.array_equal(host0, host1)
    # ...and a load of n blocks back into other GPU blocks from the same chunks (without an
    # index it ends at the last chunk's end, from a skip of its own).
    back = rng.permutation(N)[:n].astype(np.int64)
    assert chunk_count(pair.unit, n, chunk_skip(pair.unit, n, index, False)) == m
    host0[:] = rng.integers(1, 256, host0.size, dtype=np.uint8)
    host1[:] = host0
    for _, _, dev, *_ in pair.sides:
        dev[:] = 0
    pair.run(False, back, chunks, index)
    (_, _, dev0, *_), (_, _, dev1, *_) = pair.sides
    assert dev0.any() and np.array_equal(dev0, dev1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_index": -1}, "block_index must be an int from 0"),
        ({"block_index": True}, "block_index must be an int"),
        ({"block_index": 1.0}, "block_index must be an int"),
        ({"block_index": 2**64}, "block_index must be an int from 0"),
        ({"chunks": 3}, r"take ceil\(\(2 \+ 5\) / 4\) = 2 destination block ids .*, got 3"),
        ({"gpu": [0, 1, 2, 3, 99]}, "out of range"),
        ({"route": "staged"}, "route must be a blockswap.Route or None"),
        ({"direction": "sideways"}, "direction"),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else "",
)
def test_submit_group_refusals_are_typed_and_issue_nothing(
    kwargs: dict[str, Any], match: str
) -> None:
    p = Pair(UNIT)
    try:
        eng, host, dev, ht, dt = p.sides[0]
        dev[:] = 7
        gpu = np.asarray(kwargs.pop("gpu", [0, 1, 2, 3, 4]), np.int64)
        chunks = np.arange(kwargs.pop("chunks", 2), dtype=np.int64)
        call = {"block_index": 2, "direction": "d2h", **kwargs}
        with pytest.raises(InvalidTransferError, match=match):
            eng.submit_group(1, dt, gpu, ht, chunks, **call)
        assert not host.any()  # nothing issued
        # The job id is free, and a good transfer under it runs.
        eng.submit_group(1, dt, gpu[:4], ht, chunks[:2], 2, "d2h")
        eng.wait([1])
        assert [r.success for r in eng.get_finished()] == [True]
        assert host.any()
    finally:
        p.close()


def _handlers(factor: int) -> tuple[CpuGpuHandlers, list[torch.Tensor]]:
    layers = [torch.randint(0, 255, (N, 1, SEG), dtype=torch.uint8) for _ in range(3)]
    return CpuGpuHandlers(
        layers, 16, layout="mla", block_size_factor=factor, backend="host"
    ), layers


def _general_only(h: CpuGpuHandlers, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Takes the one-call path away from ``h``'s handlers: each use of it is recorded."""
    used: list[str] = []
    for d in (h.d2h, h.h2d):

        def one(*args: Any, _d: str = d.direction) -> None:
            used.append(_d)
            raise AssertionError("the one-call path")

        monkeypatch.setattr(d, "_submit_group", one)
    return used


def _one_only(h: CpuGpuHandlers, monkeypatch: pytest.MonkeyPatch) -> None:
    """Takes the general path (the core's ``submit_groups`` and the early ``wake``) away."""
    for d in (h.d2h, h.h2d):

        def general(*args: Any) -> None:
            raise AssertionError("the general path")

        monkeypatch.setattr(d, "_submit_groups", general)
        monkeypatch.setattr(d, "_wake", general)


@pytest.mark.parametrize("factor", [1, UNIT])
def test_the_handler_takes_one_call_for_the_usual_spec(
    factor: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    h, layers = _handlers(factor)
    try:
        _one_only(h, monkeypatch)
        gpu = np.array([5, 9, 2, 30, 11], np.int32)
        chunks = np.array([3, 1], np.int64) if factor > 1 else np.array([3, 1, 7, 0, 2])
        before = [t[gpu.astype(np.int64)].clone() for t in layers]
        assert h.d2h.transfer_async(1, (gpu, chunks), block_indices=[6]) is True
        assert h.d2h.transfer_async(2, (gpu[:1], chunks[:1])) is True
        h.wait([1, 2])
        assert [r.success for r in h.get_finished()] == [True, True]
        dst = np.array([0, 1, 4, 8, 12], np.int64)
        assert h.h2d.transfer_async(3, (chunks, dst), block_indices=[6]) is True
        h.wait([3])
        assert [r.success for r in h.get_finished()] == [True]
        for t, b in zip(layers, before):
            assert torch.equal(t[dst], b)
    finally:
        h.shutdown()


@pytest.mark.parametrize(
    "call",
    [
        {"ids": list},
        {"ids": torch.tensor},
        {"block_indices": np.array([6])},
        {"block_indices": (6,)},
        {"block_indices": [6, 7]},
        {"block_indices": [-1]},
        {"block_indices": [True]},
    ],
    ids=lambda c: next(f"{k}={getattr(v, '__name__', v)!r}" for k, v in c.items()),
)
def test_anything_else_takes_the_general_path(
    call: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    h, _ = _handlers(UNIT)
    try:
        used = _general_only(h, monkeypatch)
        as_ids = call.get("ids", np.asarray)
        starts = call.get("block_indices", [6])
        spec = (as_ids([5, 9, 2]), as_ids([3, 1]))
        try:
            ok = h.d2h.transfer_async(1, spec, block_indices=starts)
        except InvalidTransferError as e:  # refused there, in the general path's words
            assert "block_indices" in str(e)
        else:
            assert ok is True
            h.wait([1])
            assert [r.success for r in h.get_finished()] == [True]
        assert used == []
    finally:
        h.shutdown()


# ---- a connector's spec in one call: Engine.submit_spec -------------------------------------

CELLS = 12  # chunks of the fanned host side


class Fanned:
    """An engine on the host backend whose host side is laid out as vLLM's shared region lays a
    chunk's cell: two tensors, each with its ``unit`` sub-block pages after each other; a host
    table per sub-block index (table ``j`` holds sub-block ``j`` of every chunk), and the GPU
    side of two segments a block."""

    def __init__(self, unit: int) -> None:
        self.unit = unit
        self.cell = 2 * unit * SEG
        self.eng = blockswap.Engine("host")
        self.host = np.zeros(CELLS * self.cell, np.uint8)
        self.dev = np.zeros(2 * N * SEG, np.uint8)
        self.eng.register(self.host, kind="host")
        self.eng.register(self.dev, kind="device")
        h, d = self.host.ctypes.data, self.dev.ctypes.data
        self.fan = [
            self.eng.register_table(
                [h + j * SEG, h + (unit + j) * SEG], [self.cell] * 2, [SEG] * 2, CELLS, "host"
            )
            for j in range(unit)
        ]
        self.gpu = self.eng.register_table([d, d + N * SEG], [SEG] * 2, [SEG] * 2, N, "device")

    def pairs(self, d2h: bool) -> tuple[tuple[int, int], ...]:
        return tuple((self.gpu, t) if d2h else (t, self.gpu) for t in self.fan)

    def host_page(self, chunk: int, seg: int, sub: int) -> np.ndarray:
        at = chunk * self.cell + (seg * self.unit + sub) * SEG
        return self.host[at : at + SEG]

    def dev_page(self, block: int, seg: int) -> np.ndarray:
        at = (seg * N + block) * SEG
        return self.dev[at : at + SEG]


def _spec(
    rng: np.random.Generator, unit: int, sizes: list[int]
) -> tuple[np.ndarray, np.ndarray, list[int], list[tuple[int, int, int]]]:
    """Flat GPU ids and chunk ids for groups of ``sizes`` blocks from random block indices, and
    where each block goes: ``(GPU block, chunk, sub-block)``."""
    starts = [int(s) for s in rng.integers(0, 50, len(sizes))]
    need = [chunk_count(unit, n, s % unit) for n, s in zip(sizes, starts)]
    gpu = rng.permutation(N)[: sum(sizes)].astype(np.int32)
    chunks = rng.permutation(CELLS)[: sum(need)].astype(np.int64)
    where, o, c = [], 0, 0
    for n, s, m in zip(sizes, starts, need):
        for i in range(n):
            p = s % unit + i
            where.append((int(gpu[o + i]), int(chunks[c + p // unit]), p % unit))
        o, c = o + n, c + m
    return gpu, chunks, starts, where


@pytest.mark.parametrize("unit", [1, 3, 4])
@pytest.mark.parametrize("sizes", [[5], [1], [7, 3], [2, 0, 6]], ids=str)
def test_submit_spec_puts_each_block_at_its_sub_block(unit: int, sizes: list[int]) -> None:
    """A store of several groups from random block indices (partial first and last chunks)
    writes each GPU block's pages at its sub-block of its chunk and nothing else; a load brings
    them back into other GPU blocks and writes nothing else."""
    f = Fanned(unit)
    rng = np.random.default_rng(unit * 100 + sum(sizes))
    try:
        f.dev[:] = rng.integers(1, 256, f.dev.size, dtype=np.uint8)
        gpu, chunks, starts, where = _spec(rng, unit, sizes)
        tables = [f.pairs(True)] * len(sizes)
        f.eng.submit_spec(1, gpu, chunks, sizes, starts, tables, unit, "d2h")
        f.eng.wait([1])
        assert [r.success for r in f.eng.get_finished()] == [True]
        want = np.zeros_like(f.host)
        for b, c, j in where:
            for s in range(2):
                at = c * f.cell + (s * unit + j) * SEG
                want[at : at + SEG] = f.dev_page(b, s)
        assert np.array_equal(f.host, want)
        # Back into other GPU blocks: the same positions in the same chunks.
        back = np.setdiff1d(np.arange(N), gpu)[: len(gpu)][::-1].copy()
        moved = dict(zip((b for b, _, _ in where), back.tolist()))
        f.dev[:] = 0
        f.eng.submit_spec(2, back, chunks, sizes, starts, [f.pairs(False)] * len(sizes), unit)
        f.eng.wait([2])
        assert [r.success for r in f.eng.get_finished()] == [True]
        for b, c, j in where:
            for s in range(2):
                assert np.array_equal(f.dev_page(moved[b], s), f.host_page(c, s, j))
        assert np.count_nonzero(f.dev.reshape(-1, SEG).any(axis=1)) == 2 * len(where)
        assert np.array_equal(f.host, want)  # a load writes no host byte
    finally:
        f.eng.shutdown()


@pytest.mark.parametrize("index", [0, 2, 5])
def test_submit_spec_on_a_table_that_counts_chunks_moves_what_submit_group_moves(
    pair: Pair, index: int
) -> None:
    """One pair for a group: its chunk ids go as given to a table that counts chunks, with the
    skip from its block index, as ``submit_group`` does; a group without pages names none."""
    rng = np.random.default_rng(index)
    dev0 = pair.sides[0][2]
    dev0[:] = rng.integers(1, 256, dev0.size, dtype=np.uint8)
    pair.sides[1][2][:] = dev0
    n = 6
    skip = chunk_skip(pair.unit, n, index, True)
    gpu = rng.permutation(N)[:n].astype(np.int64)
    chunks = rng.permutation(N // pair.unit)[: chunk_count(pair.unit, n, skip)].astype(np.int64)
    (e0, host0, _, ht0, dt0), (e1, host1, _, ht1, dt1) = pair.sides
    e0.submit_group(1, dt0, gpu, ht0, chunks, index, "d2h")
    e1.submit_spec(1, gpu, chunks, [0, n], [0, index], [(), ((dt1, ht1),)], pair.unit, "d2h")
    for e in (e0, e1):
        e.wait([1])
        assert [r.success for r in e.get_finished()] == [True]
    assert host0.any() and np.array_equal(host0, host1)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"sizes": [3, 2]}, "2 group sizes and 1 block indices for 1 KV-cache group"),
        ({"sizes": [4]}, "the groups take 4 GPU blocks and 2 CPU chunks, the spec names 3 and 1"),
        (
            {"chunks": [0, 1]},
            "the groups take 3 GPU blocks and 1 CPU chunks, the spec names 3 and 2",
        ),
        ({"sizes": [-3]}, "group_sizes must be a sequence of ints >= 0"),
        ({"starts": [None]}, "block_indices must be a sequence of ints >= 0"),
        ({"tables": [[1, 2]]}, "tables must hold, per group, a sequence of"),
        ({"tables": [()]}, "group 0 has no pages but the spec names 3 blocks"),
        ({"tables": "fan2"}, "group 0 has 2 table pairs: one, or one per sub-block"),
        ({"tables": "unknown"}, "table"),
        ({"gpu": [0, 1, 99]}, "out of range"),
        ({"chunks": [CELLS]}, "out of range"),
        ({"unit": 0}, "blocks_per_chunk must be an int from 1"),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else "",
)
def test_submit_spec_refusals_are_typed_and_issue_nothing(
    change: dict[str, Any], match: str
) -> None:
    f = Fanned(4)
    try:
        f.dev[:] = 7
        tables: Any = [f.pairs(True)]
        if change.get("tables") == "fan2":
            tables = [f.pairs(True)[:2]]
        elif change.get("tables") == "unknown":
            tables = [((f.gpu, 999),) * 4]
        elif "tables" in change:
            tables = change["tables"]
        call = (
            np.asarray(change.get("gpu", [0, 1, 2]), np.int64),
            np.asarray(change.get("chunks", [0]), np.int64),
            change.get("sizes", [3]),
            change.get("starts", [1]),
            tables,
            change.get("unit", 4),
        )
        with pytest.raises(InvalidTransferError, match=match):
            f.eng.submit_spec(1, *call, "d2h")
        assert not f.host.any()  # nothing issued
        # The job id is free, and a good transfer under it runs.
        f.eng.submit_spec(1, np.arange(3), np.arange(1), [3], [1], [f.pairs(True)], 4, "d2h")
        f.eng.wait([1])
        assert [r.success for r in f.eng.get_finished()] == [True]
        assert f.host.any()
    finally:
        f.eng.shutdown()


@pytest.mark.parametrize(
    ("unit", "pairs", "match"),
    [
        (2, 1, "the host table counts chunks of 4 blocks, but the spec names chunks of 2"),
        (1, 1, "the host table counts chunks of 4 blocks, but the spec names chunks of 1"),
        (4, 4, "one table pair per sub-block: each host table counts single blocks"),
    ],
)
def test_submit_spec_refuses_chunks_its_host_table_does_not_count(
    unit: int, pairs: int, match: str
) -> None:
    """``blocks_per_chunk`` cuts the spec; a host table counting chunks of another size would
    map its chunk ids to other blocks (it moved them, reported successful): refused, nothing
    issued, in both directions."""
    p = Pair(UNIT)
    try:
        eng, host, dev, ht, dt = p.sides[0]
        dev[:] = 7
        for direction, pair in (("d2h", (dt, ht)), ("h2d", (ht, dt))):
            with pytest.raises(InvalidTransferError, match=match):
                chunks = np.arange(-(-2 // unit))  # 2 blocks from a chunk's start
                eng.submit_spec(
                    1, np.arange(2), chunks, [2], [0], [(pair,) * pairs], unit, direction
                )
        assert not host.any() and (dev == 7).all()
    finally:
        p.close()


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("step", [2, -1, -3])
def test_strided_ids_move_what_their_contiguous_copies_move(
    pair: Pair, dtype: type, step: int
) -> None:
    """Ids given as a strided view (every f-th id of a spec, as the vLLM worker cuts a chunk's
    sub-blocks, or a reversed one) are read through their strides, as their copies are."""
    rng = np.random.default_rng(abs(step))
    dev0 = pair.sides[0][2]
    dev0[:] = rng.integers(1, 256, dev0.size, dtype=np.uint8)
    pair.sides[1][2][:] = dev0
    n = 5
    m = chunk_count(pair.unit, n, 0)
    gpu = np.repeat(rng.permutation(N)[:n], abs(step)).astype(dtype)[:: abs(step)]
    chunks = np.repeat(rng.permutation(N // pair.unit)[:m], abs(step)).astype(dtype)[:: abs(step)]
    if step < 0:
        gpu, chunks = gpu[::-1], chunks[::-1]
    assert not gpu.flags.c_contiguous or abs(step) == 1
    (e0, host0, _, ht0, dt0), (e1, host1, _, ht1, dt1) = pair.sides
    e0.submit_group(1, dt0, gpu, ht0, chunks, 0, "d2h")
    e1.submit_group(1, dt1, gpu.copy(), ht1, chunks.copy(), 0, "d2h")
    for e in (e0, e1):
        e.wait([1])
        assert [r.success for r in e.get_finished()] == [True]
    assert host0.any() and np.array_equal(host0, host1)


def test_submit_spec_refuses_a_gpu_block_loaded_from_two_sub_blocks() -> None:
    """A load naming one GPU block twice puts it in two sub-block groups, each writing one GPU
    table: refused (what lands there would depend on the copies' order), nothing written."""
    f = Fanned(4)
    try:
        f.host[:] = 9
        with pytest.raises(InvalidTransferError, match="overlap"):
            f.eng.submit_spec(1, np.array([5, 5]), np.array([0]), [2], [0], [f.pairs(False)], 4)
        assert not f.dev.any()
        f.eng.submit_spec(1, np.array([5, 6]), np.array([0]), [2], [0], [f.pairs(False)], 4)
        f.eng.wait([1])
        assert [r.success for r in f.eng.get_finished()] == [True]
        assert f.dev.any()
    finally:
        f.eng.shutdown()
