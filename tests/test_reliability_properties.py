"""Reliability, 6. Property tests of the entry points: accepted exactly when valid, typed
refusals, and the bytes of every accepted transfer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from blockswap import Engine, InvalidTransferError
from blockswap.handler import CpuGpuHandlers
from kv_helpers import assert_storage, block_bytes, fill_random, raw, snapshot, strided
from reliability_helpers import KiB, drain

REGION = 8 * KiB


class Arena:
    """One engine over four registered arrays (two host, two "device") and one unregistered
    one, with a model of what a transfer over them may do."""

    kinds: ClassVar[dict[str, str]] = {"HA": "host", "HB": "host", "DA": "device", "DB": "device"}

    def __init__(self) -> None:
        self.eng = Engine("host", max_descriptors=32)
        rng = np.random.default_rng(8)
        self.init = {k: rng.integers(1, 256, REGION, dtype=np.uint8) for k in [*self.kinds, "UN"]}
        self.mem = {k: v.copy() for k, v in self.init.items()}
        for k, kind in self.kinds.items():
            self.eng.register(self.mem[k], kind=kind)
        self.base = {k: a.ctypes.data for k, a in self.mem.items()}
        self.next_job = 1

    def reset(self) -> None:
        for k, a in self.mem.items():
            a[:] = self.init[k]
        assert self.eng.get_finished() == []
        assert self.eng.stats()["in_flight"] == 0

    def region_of(self, addr: int, size: int, kind: str) -> str | None:
        """The registered array of ``kind`` holding [addr, addr + size), if one does."""
        for k, kd in self.kinds.items():
            if kd == kind and self.base[k] <= addr and addr + size <= self.base[k] + REGION:
                return k
        return None

    def snapshot(self) -> dict[str, np.ndarray]:
        return {k: a.copy() for k, a in self.mem.items()}

    def locate(self, addr: int) -> tuple[str, int]:
        for k in self.mem:
            if self.base[k] <= addr < self.base[k] + REGION:
                return k, addr - self.base[k]
        raise AssertionError(f"{addr:#x} is in no array")

    def expect_copies(self, copies: list[tuple[int, int, int]]) -> dict[str, np.ndarray] | None:
        """The arrays after ``(src, dst, size)`` copies (None when a source overlaps a
        destination: the order of the copies would matter, and nothing promises one)."""
        spans = [(d, d + z) for _, d, z in copies]
        for s, _, z in copies:
            if any(s < e and b < s + z for b, e in spans):
                return None
        want = self.snapshot()
        before = self.snapshot()
        for s, d, z in copies:
            (ks, os_), (kd, od) = self.locate(s), self.locate(d)
            want[kd][od : od + z] = before[ks][os_ : os_ + z]
        return want

    def check(self, want: dict[str, np.ndarray]) -> None:
        for k, a in self.mem.items():
            assert np.array_equal(a, want[k]), f"{k} differs"

    def run(self, job: Any, call: Callable[[], None], copies: list[tuple[int, int, int]] | None,
            nbytes: int) -> None:  # fmt: skip
        """``call`` must be accepted iff ``copies`` is not None (the model's verdict), and then
        move exactly those bytes; a refusal must be an InvalidTransferError that changed
        nothing."""
        before = self.snapshot()
        want = None if copies is None else self.expect_copies(copies)
        try:
            call()
        except InvalidTransferError:
            event("refused")
            assert copies is None, "a valid transfer was refused"
            self.check(before)
            assert self.eng.stats()["in_flight"] == 0
            return
        event("accepted" if want is not None else "accepted (sources overlap destinations)")
        assert copies is not None, "an invalid transfer was accepted"
        self.eng.wait([job])
        (r,) = drain(self.eng.get_finished, 1)
        assert (r.job_id, r.success, r.bytes) == (job, True, nbytes)
        if want is not None:
            self.check(want)


@pytest.fixture(scope="module")
def arena() -> Any:
    a = Arena()
    yield a
    a.eng.shutdown()


KINDS = {"h2d": ("host", "device"), "d2h": ("device", "host"), "h2h": ("host", "host"),
         "d2d": ("device", "device")}  # fmt: skip


def as_container(values: list[int], how: str) -> Any:
    if how == "list":
        return values
    if how == "float64":
        return np.asarray(values, dtype=np.float64)
    if how == "uint64" and all(v >= 0 for v in values):
        return np.asarray(values, dtype=np.uint64)
    if how == "strided":
        return np.repeat(np.asarray(values, dtype=np.int64), 2)[::2]
    return np.asarray(values, dtype=np.int64)


ENGINE_MUTATIONS = [
    "src-wrong-kind", "src-unregistered", "dst-past-end", "src-before-start", "size-zero",
    "size-negative", "size-huge", "dst-overlap", "raw-address", "direction", "lengths", "float",
    "empty",
]  # fmt: skip


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_engine_submit(arena: Arena, data: st.DataObject) -> None:
    """A well-formed random batch, or one with a random defect: accepted exactly when the model
    says it is valid (then every byte as the model says), otherwise an InvalidTransferError
    that changed nothing."""
    arena.reset()
    direction = data.draw(st.sampled_from(list(KINDS)), label="direction")
    sk, dk = KINDS[direction]
    src_arrays = [k for k, v in Arena.kinds.items() if v == sk]
    dst_arrays = [k for k, v in Arena.kinds.items() if v == dk]
    n = data.draw(st.integers(1, 6), label="descriptors")
    zs = data.draw(st.lists(st.integers(1, 600), min_size=n, max_size=n), label="sizes")
    slots = data.draw(st.permutations(range(16)), label="slots")[:n]  # 8 x 1 KiB per array
    src: list[int] = []
    dst: list[int] = []
    for z, slot in zip(zs, slots):
        k = data.draw(st.sampled_from(src_arrays))
        src.append(arena.base[k] + data.draw(st.integers(0, REGION - z)))
        k = dst_arrays[slot % len(dst_arrays)] if len(dst_arrays) > 1 else dst_arrays[0]
        dst.append(arena.base[k] + (slot // 2) * KiB + data.draw(st.integers(0, KiB - z)))
    hows = data.draw(st.lists(st.sampled_from(["list", "int64", "uint64", "strided"]),
                              min_size=3, max_size=3), label="containers")  # fmt: skip
    mutation = data.draw(st.sampled_from([None] * len(ENGINE_MUTATIONS) + ENGINE_MUTATIONS))
    i = data.draw(st.integers(0, n - 1), label="mutated descriptor")
    other = {"host": ["DA", "DB"], "device": ["HA", "HB"]}[sk]
    if mutation == "src-wrong-kind":
        src[i] = arena.base[data.draw(st.sampled_from(other))] + 16
    elif mutation == "src-unregistered":
        src[i] = arena.base["UN"] + 16
    elif mutation == "dst-past-end":
        base = max(b for b in arena.base.values() if b <= dst[i])
        dst[i] = base + REGION - zs[i] + data.draw(st.integers(1, 64))
    elif mutation == "src-before-start":
        base = max(b for b in arena.base.values() if b <= src[i])
        src[i] = base - data.draw(st.integers(1, 64))
    elif mutation == "size-zero":
        zs[i] = 0
    elif mutation == "size-negative":
        zs[i] = -data.draw(st.integers(1, 2**63))
    elif mutation == "size-huge":
        zs[i] = data.draw(st.sampled_from([REGION + 1, 2**62, 2**63 - 1]))
    elif mutation == "dst-overlap" and n > 1:
        j = (i + 1) % n
        dst[i] = dst[j] + data.draw(st.integers(-zs[i] + 1, zs[j] - 1))
    elif mutation == "raw-address":
        src[i] = data.draw(st.sampled_from([0, 8, 2**63 - 1]))
    elif mutation == "direction":
        direction = data.draw(st.sampled_from(["H2D", "sideways", ""]))
    elif mutation == "float":
        hows[data.draw(st.integers(0, 2))] = "float64"
    elif mutation == "empty":
        src, dst, zs, n = [], [], [], 0
    cols = [src, dst, list(zs)]
    if mutation == "lengths":
        c = data.draw(st.integers(0, 2))
        cols[c] = cols[c][:-1] if data.draw(st.booleans()) else [*cols[c], cols[c][-1] + 4096]
    # the model
    copies: list[tuple[int, int, int]] | None = []
    lengths = {len(c) for c in cols}
    if "float64" in hows or direction not in KINDS or lengths != {n} or n == 0:
        copies = None
    else:
        for s_, d_, z in zip(src, dst, zs):
            if z <= 0 or arena.region_of(s_, z, sk) is None or arena.region_of(d_, z, dk) is None:
                copies = None
                break
            copies.append((s_, d_, z))
        if copies is not None:
            spans = sorted((d_, d_ + z) for _, d_, z in copies)
            if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
                copies = None  # destinations overlap
    job = arena.next_job
    arena.next_job += 1
    args = [as_container(c, h) for c, h in zip(cols, hows)]
    arena.run(job, lambda: arena.eng.submit(job, *args, direction),
              copies, sum(z for _, _, z in copies or []))  # fmt: skip


TABLE_MUTATIONS = ["zero-page", "stride-below-page", "past-end", "unregistered", "wrong-kind"]
ID_MUTATIONS = ["out-of-range", "negative", "duplicate", "lengths", "empty", "float", "swap",
                "incompatible"]  # fmt: skip


@st.composite
def table_specs(draw: st.DrawFn, kind: str, nbytes: list[int] | None = None) -> dict[str, Any]:
    """A block table over the arrays of ``kind``, valid unless a mutation was drawn. Bases are
    (array, offset) pairs."""
    if nbytes is None:
        nbytes = draw(st.lists(st.integers(1, 96), min_size=1, max_size=3))
    nb = draw(st.integers(1, 8))
    strides = [z + draw(st.sampled_from([0, 16, 64])) for z in nbytes]
    where = [k for k, v in Arena.kinds.items() if v == kind]
    bases = []
    for z, st_ in zip(nbytes, strides):
        span = (nb - 1) * st_ + z
        bases.append((draw(st.sampled_from(where)), draw(st.integers(0, REGION - span))))
    spec = {"bases": bases, "strides": strides, "nbytes": list(nbytes), "num_blocks": nb,
            "kind": kind}  # fmt: skip
    mutation = draw(st.sampled_from([None] * 20 + TABLE_MUTATIONS))
    s = draw(st.integers(0, len(nbytes) - 1))
    if mutation == "zero-page":
        spec["nbytes"][s] = 0
    elif mutation == "stride-below-page":
        spec["strides"][s] = max(spec["nbytes"][s] - draw(st.integers(1, 8)), 0)
    elif mutation == "past-end":
        k, _ = bases[s]
        span = (nb - 1) * strides[s] + nbytes[s]
        bases[s] = (k, REGION - span + draw(st.integers(1, 64)))
    elif mutation == "unregistered":
        bases[s] = ("UN", 0)
    elif mutation == "wrong-kind":
        bases[s] = ({"host": "DA", "device": "HA"}[kind], 0)
    return spec


def table_valid(arena: Arena, t: dict[str, Any]) -> bool:
    nb = t["num_blocks"]
    for (k, off), stride, z in zip(t["bases"], t["strides"], t["nbytes"]):
        if z <= 0 or (nb > 1 and stride < z):
            return False
        if arena.region_of(arena.base[k] + off, (nb - 1) * stride + z, t["kind"]) is None:
            return False
    return True


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_block_tables(arena: Arena, data: st.DataObject) -> None:
    """register_table accepts a table exactly when it is valid; submit_blocks over two tables
    accepts exactly the valid block-id transfers and moves the bytes the model says."""
    arena.reset()
    ids: list[int] = []
    tables: list[dict[str, Any]] = []
    try:
        for kind in ("host", "device"):
            spec = data.draw(table_specs(kind, tables[0]["nbytes"] if tables else None),
                             label=f"{kind} table")  # fmt: skip
            t = {**spec, "bases": [arena.base[k] + off for k, off in spec["bases"]]}
            try:
                tid = arena.eng.register_table(t["bases"], t["strides"], t["nbytes"],
                                               t["num_blocks"], t["kind"])  # fmt: skip
            except InvalidTransferError:
                event("table refused")
                assert not table_valid(arena, spec), f"a valid table was refused: {spec}"
                return
            assert table_valid(arena, spec), f"an invalid table was accepted: {spec}"
            tables.append(t)
            ids.append(tid)
        direction = data.draw(st.sampled_from(["h2d", "d2h"]), label="direction")
        (src_t, dst_t), (sid, did) = (
            (tables, ids) if direction == "h2d" else (tables[::-1], ids[::-1])
        )
        mutation = data.draw(st.sampled_from([None] * 8 + ID_MUTATIONS), label="id mutation")
        if mutation == "incompatible":
            other = {**src_t, "nbytes": [z + 1 for z in src_t["nbytes"]]}
            other["strides"] = [max(s_, z) for s_, z in zip(other["strides"], other["nbytes"])]
            try:
                sid = arena.eng.register_table(other["bases"], other["strides"], other["nbytes"],
                                               other["num_blocks"], other["kind"])  # fmt: skip
            except InvalidTransferError:
                return  # the larger pages ran past the memory: no table to try
            ids.append(sid)
            src_t = other
        n = data.draw(st.integers(1, 6), label="blocks")
        s_ids = data.draw(st.lists(st.integers(0, src_t["num_blocks"] - 1), min_size=n,
                                   max_size=n))  # fmt: skip
        d_ids = data.draw(st.permutations(range(dst_t["num_blocks"])))[:n]
        n = len(d_ids)
        s_ids = s_ids[:n]
        how = data.draw(st.sampled_from(["list", "int64", "strided"]), label="ids as")
        j = data.draw(st.integers(0, n - 1))
        if mutation == "out-of-range":
            s_ids[j] = src_t["num_blocks"] + data.draw(st.integers(0, 2**40))
        elif mutation == "negative":
            d_ids[j] = -data.draw(st.integers(1, 2**62))
        elif mutation == "duplicate":
            d_ids.append(d_ids[j])
            s_ids.append(s_ids[j])
        elif mutation == "lengths":
            d_ids = d_ids[:-1]
        elif mutation == "empty":
            s_ids, d_ids = [], []
        elif mutation == "float":
            how = "float64"
        a, b = (did, sid) if mutation == "swap" else (sid, did)
        # the model
        copies: list[tuple[int, int, int]] | None = []
        if (mutation == "swap" or how == "float64" or len(s_ids) != len(d_ids) or not s_ids
                or src_t["nbytes"] != dst_t["nbytes"]
                or not all(0 <= i < src_t["num_blocks"] for i in s_ids)
                or not all(0 <= i < dst_t["num_blocks"] for i in d_ids)
                or len(set(d_ids)) != len(d_ids)):  # fmt: skip
            copies = None
        else:
            for seg, z in enumerate(src_t["nbytes"]):
                for x, y in zip(s_ids, d_ids):
                    copies.append((src_t["bases"][seg] + x * src_t["strides"][seg],
                                   dst_t["bases"][seg] + y * dst_t["strides"][seg], z))  # fmt: skip
            spans = sorted((d_, d_ + z) for _, d_, z in copies)
            if any(p[1] > q[0] for p, q in zip(spans, spans[1:])):
                copies = None  # pages of different segments overlap
        job = arena.next_job
        arena.next_job += 1
        si, di = as_container(s_ids, how), as_container(d_ids, how)
        arena.run(job, lambda: arena.eng.submit_blocks(job, a, si, b, di, direction),
                  copies, sum(z for _, _, z in copies or []))  # fmt: skip
    finally:
        for tid in ids:
            arena.eng.unregister_table(tid)


HN_GPU, HN_CPU = 12, 6


@pytest.fixture(scope="module")
def handler_pair() -> Any:
    hs = {}
    for f in (1, 4):
        gpu = [strided((2, HN_GPU, 2, 2, 8), torch.float16, 1, pad=3) for _ in range(2)]
        hs[f] = (CpuGpuHandlers(gpu, HN_CPU, layout="kv_split", block_size_factor=f,
                                backend="host"), gpu)  # fmt: skip
    yield hs
    for h, _ in hs.values():
        h.shutdown()


ID_FORMS = ["list", "int64", "int32", "uint8", "tensor", "strided", "float64", "none-in-list"]


def id_container(values: list[int], how: str) -> Any:
    # A narrow dtype only where every value fits it: the out-of-range mutations draw ids up to
    # 2**40, which numpy refuses to put in an int32 (this once failed about one run in five).
    if how == "int32" and all(-(2**31) <= v < 2**31 for v in values):
        return np.asarray(values, dtype=np.int32)
    if how == "uint8" and all(0 <= v < 256 for v in values):
        return np.asarray(values, dtype=np.uint8)
    if how == "tensor":
        return torch.tensor(values, dtype=torch.int64)
    if how == "none-in-list":
        return [*values, None]
    return as_container(values, how)


HANDLER_MUTATIONS = ["gpu-out-of-range", "cpu-out-of-range", "negative", "duplicate-dest",
                     "cpu-count", "empty", "float", "none-in-list", "job-id"]  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_handler_transfer_async(handler_pair: Any, data: st.DataObject) -> None:
    """transfer_async with a random spec (block ids in any accepted form, or with a random
    defect), factor 1 and 4, both directions: accepted exactly when valid, and then the bytes of
    the blocks as the sub-block rules say; otherwise an InvalidTransferError and no change."""
    f = data.draw(st.sampled_from([1, 4]), label="block_size_factor")
    h, gpu = handler_pair[f]
    (cpu,) = h.cpu_caches
    assert h.get_finished() == []
    fill_random(gpu + cpu, torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1))))
    d2h = data.draw(st.booleans(), label="GPU -> CPU")
    n = data.draw(st.integers(1, 6), label="GPU blocks")
    if d2h:  # sources may repeat, destinations (CPU blocks) may not
        g_ids = data.draw(st.lists(st.integers(0, HN_GPU - 1), min_size=n, max_size=n))
    else:
        g_ids = data.draw(st.permutations(range(HN_GPU)))[:n]
    c_ids = data.draw(st.permutations(range(HN_CPU)))[: -(-n // f)]
    forms = list(data.draw(st.tuples(st.sampled_from(ID_FORMS[:6]), st.sampled_from(ID_FORMS[:6]))))
    job: Any = data.draw(st.integers(0, 2**64 - 1), label="job id")
    mutation = data.draw(st.sampled_from([None] * 9 + HANDLER_MUTATIONS), label="mutation")
    if mutation == "gpu-out-of-range":
        g_ids[data.draw(st.integers(0, n - 1))] = HN_GPU + data.draw(st.integers(0, 2**40))
    elif mutation == "cpu-out-of-range":
        c_ids[data.draw(st.integers(0, len(c_ids) - 1))] = HN_CPU + data.draw(st.integers(0, 9))
    elif mutation == "negative":
        side = g_ids if data.draw(st.booleans()) else c_ids
        side[data.draw(st.integers(0, len(side) - 1))] = -data.draw(st.integers(1, 2**40))
    elif mutation == "duplicate-dest":
        if d2h:
            c_ids = [*c_ids, c_ids[0]]
            g_ids = g_ids + g_ids[: f * (len(c_ids)) - len(g_ids)] if f > 1 else [*g_ids, 0]
        else:
            g_ids = [*g_ids[:-1], g_ids[0]] if n > 1 else g_ids
    elif mutation == "cpu-count":
        c_ids = [*c_ids, (c_ids[-1] + 1) % HN_CPU] if data.draw(st.booleans()) else c_ids[:-1]
    elif mutation == "empty":
        g_ids, c_ids = [], []
    elif mutation == "float":
        forms[data.draw(st.integers(0, 1))] = "float64"
    elif mutation == "none-in-list":
        forms[data.draw(st.integers(0, 1))] = "none-in-list"
    elif mutation == "job-id":
        job = data.draw(st.sampled_from([-1, 2**64, None, 1.0, True]))
    # the model
    n = len(g_ids)
    valid = (
        isinstance(job, int) and not isinstance(job, bool) and 0 <= job < 2**64
        and not {"float64", "none-in-list"} & set(forms) and n > 0
        and len(c_ids) == -(-n // f) and all(0 <= i < HN_GPU for i in g_ids)
        and all(0 <= c < HN_CPU for c in c_ids)
    )  # fmt: skip
    subs: list[int] = []
    if valid:
        skip = 0 if d2h else -n % f
        subs = [c_ids[(skip + i) // f] * f + (skip + i) % f for i in range(n)]
        dests = subs if d2h else g_ids
        valid = len(set(dests)) == len(dests)
    src_ids, dst_ids = (g_ids, c_ids) if d2h else (c_ids, g_ids)
    spec = (id_container(src_ids, forms[0]), id_container(dst_ids, forms[1]))
    handler = h.d2h if d2h else h.h2d
    before = snapshot(gpu + cpu)
    try:
        assert handler.transfer_async(job, spec) is True
    except InvalidTransferError:
        event("refused")
        assert not valid, "a valid transfer was refused"
        assert_storage(gpu + cpu, before)
        return
    event("accepted")
    assert valid, "an invalid transfer was accepted"
    h.wait([job])
    (r,) = drain(h.get_finished, 1)
    assert (r.job_id, r.success, r.bytes) == (job, True, n * h.gpu_tables[0].page_bytes)
    want = {k: v.clone() for k, v in before.items()}
    pairs = list(zip(g_ids, subs)) if d2h else list(zip(subs, g_ids))
    ts, td = (gpu, cpu) if d2h else (cpu, gpu)
    for a, b in zip(ts, td):
        for sb, db in pairs:
            want[raw(b).data_ptr()][block_bytes(b, 1, db)] = before[raw(a).data_ptr()][
                block_bytes(a, 1, sb)
            ]
    assert_storage(gpu + cpu, want)
