"""Tests of blockswap.kernels.copy: the batched block copy kernel against its reference.

Without a GPU the kernel runs under Triton's interpreter: TRITON_INTERPRET=1 is set below
before the kernel module is imported (Triton decides at ``@triton.jit`` time). Then all
buffers are ordinary CPU memory. With a GPU the same byte-exactness tests run compiled, on
pinned host memory (host->host through UVA), and the ``cuda`` tests add pinned-host <->
device copies at scale.
"""

from __future__ import annotations

import importlib
import os
import random
import sys

import numpy as np
import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from blockswap import _core  # noqa: E402
from blockswap._core import launch_plan  # noqa: E402
from blockswap.errors import ConfigError, ConfigTypeError  # noqa: E402
from blockswap.kernels import copy as copy_mod  # noqa: E402
from blockswap.kernels import staged as staged_mod  # noqa: E402

if not HAS_CUDA and not copy_mod.interpreter_mode():
    # Imported earlier in this process without the interpreter: rebuild the kernels.
    copy_mod = importlib.reload(copy_mod)
    staged_mod = importlib.reload(staged_mod)
assert copy_mod.interpreter_mode() == (not HAS_CUDA), "kernel mode does not match the machine"

copy_blocks = copy_mod.copy_blocks
copy_blocks_raw = copy_mod.copy_blocks_raw
copy_blocks_reference = copy_mod.copy_blocks_reference

INTERPRET = copy_mod.interpreter_mode()
needs_cuda = pytest.mark.skipif(
    not HAS_CUDA or INTERPRET, reason="needs a CUDA GPU (compiled Triton kernels)"
)

Job = tuple[int, int, int]  # (src offset, dst offset, size) in bytes, within two buffers


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------


def host_buffer(nbytes: int, seed: int | None = None, fill: int = 0) -> torch.Tensor:
    """uint8 host buffer the kernel can reach: pinned when compiled, plain under interpreter."""
    if seed is None:
        t = torch.full((nbytes,), fill, dtype=torch.uint8)
    else:
        g = torch.Generator().manual_seed(seed)
        t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return t if INTERPRET else t.pin_memory()


def descriptors(
    src: torch.Tensor, dst: torch.Tensor, jobs: list[Job], device: str = "host"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int64 descriptor tensors [N] for jobs between buffers ``src`` and ``dst``."""
    s = torch.tensor([src.data_ptr() + j[0] for j in jobs], dtype=torch.int64)
    d = torch.tensor([dst.data_ptr() + j[1] for j in jobs], dtype=torch.int64)
    n = torch.tensor([j[2] for j in jobs], dtype=torch.int64)
    if device == "cuda":
        return s.cuda(), d.cuda(), n.cuda()
    if not INTERPRET:
        return s.pin_memory(), d.pin_memory(), n.pin_memory()
    return s, d, n


def expected_bytes(src: np.ndarray, dst: np.ndarray, jobs: list[Job]) -> np.ndarray:
    out = dst.copy()
    for so, do, n in jobs:
        out[do : do + n] = src[so : so + n]
    return out


def run_and_check(src: torch.Tensor, dst_len: int, jobs: list[Job], **kwargs) -> None:
    """Copy ``jobs`` with the kernel and the reference; both must equal the numpy result."""
    dst = host_buffer(dst_len, fill=0xA5)
    ref = host_buffer(dst_len, fill=0xA5)
    want = expected_bytes(src.numpy(), dst.numpy(), jobs)
    copy_blocks(*descriptors(src, dst, jobs), **kwargs)
    if not INTERPRET:
        torch.cuda.synchronize()
    copy_blocks_reference(*descriptors(src, ref, jobs))
    np.testing.assert_array_equal(ref.numpy(), want)
    np.testing.assert_array_equal(dst.numpy(), want)


def packed_jobs(
    sizes: list[int],
    rng: random.Random,
    src_offsets: list[int] | None = None,
    dst_offsets: list[int] | None = None,
    gap: int = 16,
    shuffle_dst: bool = True,
) -> tuple[list[Job], int, int]:
    """Lay jobs out without overlap; return (jobs, src buffer length, dst buffer length)."""
    n = len(sizes)
    src_offsets = src_offsets or [0] * n
    dst_offsets = dst_offsets or [0] * n
    slot = [((sz + 15) // 16) * 16 + 16 + gap for sz in sizes]
    s_pos, pos = [], 0
    for k in range(n):
        s_pos.append(pos + src_offsets[k])
        pos += slot[k]
    src_len = pos
    order = list(range(n))
    if shuffle_dst:
        rng.shuffle(order)
    d_pos, pos = [0] * n, 0
    for k in order:
        d_pos[k] = pos + dst_offsets[k]
        pos += slot[k]
    return [(s_pos[k], d_pos[k], sizes[k]) for k in range(n)], src_len, pos


# --------------------------------------------------------------------------------------
# Byte exactness (interpreter on CPU, or compiled on pinned host memory)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_ctas", [1, 16])
def test_uniform_4k_blocks(max_ctas):
    rng = random.Random(1)
    jobs, src_len, dst_len = packed_jobs([4096] * 48, rng, gap=0)
    src = host_buffer(src_len, seed=1)
    run_and_check(src, dst_len, jobs, max_ctas=max_ctas)


@pytest.mark.parametrize("block_bytes", [256, 1024, 16384])
def test_sizes_not_multiple_of_8_or_16(block_bytes):
    sizes = [1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 23, 31, 33, 100, 255, 1000, 4095, 4097]
    jobs, src_len, dst_len = packed_jobs(sizes, random.Random(2))
    src = host_buffer(src_len, seed=2)
    run_and_check(src, dst_len, jobs, block_bytes=block_bytes)


def test_unaligned_addresses():
    rng = random.Random(3)
    sizes, so, do = [], [], []
    for s_off in range(16):
        # same misalignment (head/body/tail path), a different one (narrow path), aligned dst
        for d_off in (s_off, (s_off + 4) % 16, (s_off + 8) % 16, (s_off + 1) % 16, 0):
            so.append(s_off)
            do.append(d_off)
            sizes.append(rng.choice([1, 15, 17, 64, 100, 333, 1024, 1031]))
    jobs, src_len, dst_len = packed_jobs(sizes, rng, so, do)
    src = host_buffer(src_len, seed=3)
    run_and_check(src, dst_len, jobs, block_bytes=256)


@pytest.mark.parametrize("max_ctas", [1, 3, 16])
def test_mixed_sizes(max_ctas):
    rng = random.Random(4 + max_ctas)
    sizes = [rng.choice([rng.randint(1, 64), rng.randint(1, 3000), 4096]) for _ in range(40)]
    so = [rng.choice([0, 0, 8, rng.randint(0, 15)]) for _ in sizes]
    do = [rng.choice([0, 0, 8, rng.randint(0, 15)]) for _ in sizes]
    jobs, src_len, dst_len = packed_jobs(sizes, rng, so, do)
    src = host_buffer(src_len, seed=4)
    run_and_check(src, dst_len, jobs, max_ctas=max_ctas, block_bytes=512)


@pytest.mark.parametrize("max_ctas", [1, 3])
def test_rows_mixing_aligned_and_unaligned_jobs(max_ctas):
    """Small jobs go 16 to a step; the misaligned ones among them take the bytewise path."""
    rng = random.Random(13)
    sizes = [rng.choice([16, 32, 256, 1008, 1, 7, 100]) for _ in range(80)]
    so = [rng.choice([0, 0, 0, rng.randint(1, 15)]) for _ in sizes]
    do = [rng.choice([0, 0, 0, rng.randint(1, 15)]) for _ in sizes]
    jobs, src_len, dst_len = packed_jobs(sizes, rng, so, do)
    assert launch_plan(len(jobs), max_ctas, 16384, max(sizes))[2] == 16
    src = host_buffer(src_len, seed=13)
    run_and_check(src, dst_len, jobs, max_ctas=max_ctas)


@pytest.mark.parametrize(
    ("size", "s_off", "d_off"), [(1, 0, 0), (13, 3, 5), (4096, 0, 0), (20000, 0, 0), (9999, 7, 7)]
)
def test_single_job(size, s_off, d_off):
    # N = 1 with a small chunk size: the job is sliced across all programs.
    jobs = [(s_off, d_off, size)]
    src = host_buffer(size + 32, seed=5)
    run_and_check(src, size + 32, jobs, max_ctas=16, block_bytes=1024)


@pytest.mark.parametrize("max_ctas", [1, 16])
def test_scatter_between_two_buffers(max_ctas):
    """Blocks of two big buffers, gathered from and scattered to random permutations."""
    n_slots, block = 256, 1024
    rng = np.random.default_rng(6)
    src_slots = rng.permutation(n_slots)[:200]
    dst_slots = rng.permutation(n_slots)[:200]
    jobs = [(int(s) * block, int(d) * block, block) for s, d in zip(src_slots, dst_slots)]
    src = host_buffer(n_slots * block, seed=6)
    run_and_check(src, n_slots * block, jobs, max_ctas=max_ctas)


def test_hints_and_aligned16_kernel():
    rng = random.Random(7)
    sizes = [rng.choice([16, 32, 4096, 1008]) for _ in range(30)]
    jobs, src_len, dst_len = packed_jobs(sizes, rng)
    assert all(j[0] % 16 == 0 and j[1] % 16 == 0 and j[2] % 16 == 0 for j in jobs)
    src = host_buffer(src_len, seed=7)
    run_and_check(src, dst_len, jobs, alignment=16, max_size=4096, block_bytes=1024)
    run_and_check(src, dst_len, jobs, alignment=1, max_size=8192)  # generic kernel
    run_and_check(src, dst_len, jobs, check_values=False, num_warps=1)


@pytest.mark.parametrize("max_size", [16, 1000, 1 << 30])
@pytest.mark.parametrize("alignment", [16, 1])
def test_max_size_hint_only_tunes(max_size, alignment):
    """A wrong max_size hint changes how work is cut (rows, slices), never the bytes."""
    rng = random.Random(12)
    sizes = [rng.choice([16, 48, 1024, 3008, 8192]) for _ in range(24)]
    jobs, src_len, dst_len = packed_jobs(sizes, rng)
    src = host_buffer(src_len, seed=12)
    kw = {"max_size": max_size, "alignment": alignment, "block_bytes": 1024}
    run_and_check(src, dst_len, jobs, max_ctas=4, **kw)


@pytest.mark.parametrize("hints", [{}, {"max_size": 5000, "alignment": 1}])
def test_raw_addresses(hints):
    rng = random.Random(8)
    sizes = [rng.randint(1, 5000) for _ in range(25)]
    so = [rng.randint(0, 15) for _ in sizes]
    jobs, src_len, dst_len = packed_jobs(sizes, rng, so, None)
    src = host_buffer(src_len, seed=8)
    dst = host_buffer(dst_len, fill=0x5A)
    want = expected_bytes(src.numpy(), dst.numpy(), jobs)
    s, d, n = descriptors(src, dst, jobs)
    copy_blocks_raw(s.data_ptr(), d.data_ptr(), n.data_ptr(), len(jobs), max_ctas=5, **hints)
    if not INTERPRET:
        torch.cuda.synchronize()
    np.testing.assert_array_equal(dst.numpy(), want)


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
@given(
    batch=st.lists(
        st.tuples(st.integers(1, 600), st.integers(0, 15), st.integers(0, 15)),
        min_size=1,
        max_size=10,
    ),
    max_ctas=st.integers(1, 16),
    block_bytes=st.sampled_from([16, 64, 256, 16384]),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_batches(batch, max_ctas, block_bytes, seed):
    sizes = [b[0] for b in batch]
    jobs, src_len, dst_len = packed_jobs(
        sizes, random.Random(seed), [b[1] for b in batch], [b[2] for b in batch]
    )
    src = host_buffer(src_len, seed=seed)
    run_and_check(src, dst_len, jobs, max_ctas=max_ctas, block_bytes=block_bytes)


# --------------------------------------------------------------------------------------
# Validation: bad input raises the named error and copies nothing
# --------------------------------------------------------------------------------------


def _valid_batch():
    src = host_buffer(256, seed=9)
    dst = host_buffer(256, fill=0)
    s, d, n = descriptors(src, dst, [(0, 0, 64), (64, 128, 32)])
    return src, dst, s, d, n


def _bad_inputs():
    def mk(name, fn, exc, match):
        return pytest.param(fn, exc, match, id=name)

    def host(t):
        return t if INTERPRET else t.pin_memory()

    return [
        mk("dtype", lambda s, d, n: (s.to(torch.int32), d, n), ConfigTypeError, "src_ptrs.*int64"),
        mk("not_tensor", lambda s, d, n: (s.tolist(), d, n), ConfigTypeError, "src_ptrs.*Tensor"),
        mk("length", lambda s, d, n: (s, d[:1], n), ConfigError, "length mismatch"),
        mk("zero_size", lambda s, d, n: (s, d, host(n * 0)), ConfigError, "sizes.*positive"),
        mk("neg_size", lambda s, d, n: (s, d, host(-n)), ConfigError, "sizes.*positive"),
        mk("null", lambda s, d, n: (s, host(d * 0), n), ConfigError, "dst_ptrs.*null"),
        mk("2d", lambda s, d, n: (s.reshape(1, 2), d, n), ConfigError, "src_ptrs.*1-D"),
        mk(
            "strided",
            lambda s, d, n: (s, d, host(torch.stack([n, n], 1)).reshape(-1)[::2]),
            ConfigError,
            "sizes.*contiguous",
        ),
    ]


@pytest.mark.parametrize(("mutate", "exc", "match"), _bad_inputs())
def test_bad_input_raises_and_copies_nothing(mutate, exc, match):
    _, dst, s, d, n = _valid_batch()
    with pytest.raises(exc, match=match):
        copy_blocks(*mutate(s, d, n))
    assert not dst.any()


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"max_ctas": 0}, ConfigError),
        ({"max_ctas": 2**62}, ConfigError),  # past a grid's limit: refused, not a core panic
        ({"max_ctas": 2.0}, ConfigTypeError),
        ({"num_warps": 3}, ConfigError),
        ({"block_bytes": 8}, ConfigError),
        ({"block_bytes": 1000}, ConfigError),
        ({"alignment": 12}, ConfigError),
        ({"max_size": 0}, ConfigError),
    ],
)
def test_bad_parameters(kwargs, exc):
    _, dst, s, d, n = _valid_batch()
    with pytest.raises(exc):
        copy_blocks(s, d, n, **kwargs)
    assert not dst.any()


def test_empty_is_noop():
    e = torch.empty(0, dtype=torch.int64)
    copy_blocks(e, e, e)
    copy_blocks_raw(0, 0, 0, 0)
    copy_blocks_reference(e, e, e)


def test_raw_bad_input():
    _, dst, s, d, n = _valid_batch()
    with pytest.raises(ConfigTypeError, match="srcs_addr"):
        copy_blocks_raw(s, d.data_ptr(), n.data_ptr(), 2)
    with pytest.raises(ConfigError, match="n must be"):
        copy_blocks_raw(s.data_ptr(), d.data_ptr(), n.data_ptr(), -1)
    with pytest.raises(ConfigError, match="sizes_addr"):
        copy_blocks_raw(s.data_ptr(), d.data_ptr(), 0, 2)
    with pytest.raises(ConfigError, match="alignment"):
        copy_blocks_raw(s.data_ptr(), d.data_ptr(), n.data_ptr(), 2, alignment=3)
    assert not dst.any()


def test_reference_validates():
    with pytest.raises(ConfigError, match="length mismatch"):
        copy_blocks_reference([1, 2], [3], [4, 5])
    with pytest.raises(ConfigError, match="positive"):
        copy_blocks_reference([1], [3], [0])
    with pytest.raises(ConfigTypeError, match="int64"):
        copy_blocks_reference(torch.zeros(1, dtype=torch.int32), [3], [1])


def test_reference_reports_a_driver_failure_as_a_backend_error(monkeypatch):
    # The driver's refusal of one job (here faked: no GPU is needed to check the wrapping) is
    # the core's BackendError, naming the job, not a plain RuntimeError.
    def refuse(dst, src, n):
        raise _core.BackendError("cuMemcpy failed: CUDA_ERROR_INVALID_VALUE (1)")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(copy_mod, "_is_host_address", lambda addr: False)
    monkeypatch.setattr(copy_mod._core, "cuda_memcpy", refuse)
    with pytest.raises(_core.BackendError, match=r"copying 8 bytes from 0x10 to 0x20"):
        copy_blocks_reference([0x10], [0x20], [8])


@pytest.mark.skipif(INTERPRET, reason="compiled mode only: pageable memory is not GPU-visible")
def test_pageable_descriptors_rejected():
    s = torch.ones(2, dtype=torch.int64)
    with pytest.raises(ConfigError, match="pageable"):
        copy_blocks(s, s, s)


def test_plan():
    plan = launch_plan  # (n, max_ctas, block_bytes, max_size, total_bytes)
    # -> (grid, split, rows, row_bytes)
    assert plan(10_000, 16, 16384, 65536, None) == (16, 1, 1, 16384)  # one job per step
    assert plan(10_000, 16, 16384, 4096, None) == (16, 1, 4, 4096)  # 4 small jobs per step
    assert plan(10_000, 16, 16384, 3000, None) == (16, 1, 4, 4096)
    assert plan(10_000, 16, 32768, 512, None) == (16, 1, 64, 512)  # 512 B: 32 KiB in flight
    assert plan(10_000, 16, 16384, 16, None) == (16, 1, 64, 256)  # at most 64 rows
    assert plan(10_000, 16, 16384, None, None) == (16, 1, 4, 4096)  # sizes unknown
    assert plan(10, 16, 16384, 4096, None) == (3, 1, 4, 4096)
    assert plan(1, 16, 16384, 1 << 30, None) == (16, 64, 1, 16384)  # one big job: 64 slices
    assert plan(1, 16, 16384, 100, None) == (1, 1, 64, 256)  # one small job: one program
    assert plan(1, 16, 16384, None, None) == (16, 256, 4, 4096)  # unknown: assume large
    assert plan(3, 1, 16, 10**6, None) == (1, 2, 1, 16)
    assert plan(100, 16, 16384, 1 << 20, 1 << 20) == (16, 64, 1, 16384)  # one big, 99 tiny
    for n in (1, 2, 7, 64, 1000):
        for max_size in (None, 1, 17, 4096, 1 << 24):
            for block_bytes in (16, 1024, 16384):
                grid, split, rows, row_bytes = plan(n, 16, block_bytes, max_size, None)
                assert 1 <= grid <= min(16, -(-n * split // rows)) and split >= 1
                assert rows * row_bytes == block_bytes and row_bytes >= 16


# --------------------------------------------------------------------------------------
# GPU: pinned host <-> device, compiled kernels
# --------------------------------------------------------------------------------------


def _rand_sizes(rng: np.random.Generator, n: int, max_size: int) -> np.ndarray:
    """Mostly KV-block-like sizes (multiples of 16), some odd ones, up to max_size."""
    aligned = rng.integers(1, max_size // 16 + 1, n) * 16
    odd = rng.integers(1, max_size + 1, n)
    return np.where(rng.random(n) < 0.8, aligned, odd).astype(np.int64)


@pytest.mark.cuda
@needs_cuda
def test_cuda_h2d_d2h_100k_jobs():
    n, max_size = 100_000, 64 * 1024
    rng = np.random.default_rng(10)
    sizes = _rand_sizes(rng, n, max_size)
    sizes[rng.random(n) < 0.5] = max_size // 4  # bias the total down to ~1.2 GB
    slots = (sizes + 15) // 16 * 16
    host_off = np.concatenate([[0], np.cumsum(slots)[:-1]])
    perm = rng.permutation(n)  # device layout: slots in another order
    dev_off = np.empty(n, np.int64)
    dev_off[perm] = np.concatenate([[0], np.cumsum(slots[perm])[:-1]])
    total = int(slots.sum())

    host = torch.randint(0, 256, (total,), dtype=torch.uint8).pin_memory()
    dev = torch.zeros(total, dtype=torch.uint8, device="cuda")
    back = torch.zeros(total, dtype=torch.uint8).pin_memory()

    def desc(base_src, off_src, base_dst, off_dst):
        return (
            torch.from_numpy(base_src + off_src).pin_memory(),
            torch.from_numpy(base_dst + off_dst).pin_memory(),
            torch.from_numpy(sizes).pin_memory(),
        )

    h2d = desc(host.data_ptr(), host_off, dev.data_ptr(), dev_off)
    d2h = desc(dev.data_ptr(), dev_off, back.data_ptr(), host_off)
    copy_blocks(*h2d)  # descriptors in pinned host memory, read by the kernel through UVA
    copy_blocks(*d2h)
    torch.cuda.synchronize()
    # gaps between jobs (sizes not multiple of 16) must stay untouched
    mask = torch.zeros(total, dtype=torch.bool)
    for o, s in zip(host_off[sizes % 16 != 0], sizes[sizes % 16 != 0]):
        mask[int(o) + int(s) : int(o) + (int(s) + 15) // 16 * 16] = True
    assert torch.equal(back[~mask], host[~mask])
    assert not back[mask].any()

    ref = torch.zeros_like(dev)
    copy_blocks_reference(*desc(host.data_ptr(), host_off, ref.data_ptr(), dev_off))
    assert torch.equal(ref, dev)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("desc_device", ["host", "cuda"])
@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
def test_cuda_directions_unaligned(direction, desc_device):
    rng = random.Random(11)
    sizes = [rng.choice([1, 7, 17, 4097, 65536, rng.randint(1, 65536)]) for _ in range(3000)]
    so = [rng.choice([0, 0, rng.randint(0, 15)]) for _ in sizes]
    do = [rng.choice([0, so[k], rng.randint(0, 15)]) for k in range(len(sizes))]
    jobs, src_len, dst_len = packed_jobs(sizes, rng, so, do)
    src_host = host_buffer(src_len, seed=11)
    src = src_host if direction == "h2d" else src_host.cuda()
    want = expected_bytes(src_host.numpy(), np.full(dst_len, 0xA5, np.uint8), jobs)

    def fresh_dst():
        t = host_buffer(dst_len, fill=0xA5)
        return t.cuda() if direction != "d2h" else t

    dst, ref = fresh_dst(), fresh_dst()
    copy_blocks(*descriptors(src, dst, jobs, desc_device))
    copy_blocks_reference(*descriptors(src, ref, jobs))
    torch.cuda.synchronize()
    np.testing.assert_array_equal(dst.cpu().numpy(), want)
    np.testing.assert_array_equal(ref.cpu().numpy(), want)


@pytest.mark.cuda
@needs_cuda
def test_cuda_raw_on_side_stream():
    n, size = 4096, 16 * 1024
    host = torch.randint(0, 256, (n * size,), dtype=torch.uint8).pin_memory()
    dev = torch.zeros(n * size, dtype=torch.uint8, device="cuda")
    perm = torch.randperm(n)
    slab = torch.empty(3, n, dtype=torch.int64).pin_memory()  # one pinned descriptor slab
    slab[0] = host.data_ptr() + torch.arange(n) * size
    slab[1] = dev.data_ptr() + perm * size
    slab[2] = size
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # dev's zero fill
    a = slab.data_ptr()
    copy_blocks_raw(a, a + 8 * n, a + 16 * n, n, max_size=size, alignment=16, stream=stream)
    stream.synchronize()
    got = dev.view(n, size)[perm].cpu()
    assert torch.equal(got, host.view(n, size))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


# --------------------------------------------------------------------------------------
# The staged plan's kernel: page addresses computed from block ids and a geometry
# --------------------------------------------------------------------------------------


def _i64(values: list[int]) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.int64)
    return t if INTERPRET else t.pin_memory()


@pytest.mark.parametrize("holes", [False, True], ids=["no-holes", "holes"])
@pytest.mark.parametrize("ring_src", [True, False])
@pytest.mark.parametrize(
    "pages", [[64, 64], [4096] * 6, [48, 16, 100, 4], [16384, 4096, 32]], ids=str
)
def test_staged_kernel_moves_the_pages_its_block_entries_name(
    pages: list[int], ring_src: bool, holes: bool
) -> None:
    """The staged kernel's pages (GPU page s of block b at ``bases[s] + b * strides[s]``, in
    the ring at ``ring_base + rings[i] + offsets[s]``) against a byte-by-byte reference, both
    ways, with pages of any size and alignment and GPU segments at strides of their own; with
    ``holes``, a segment of GPU base 0 after each page but the last (bytes of the row no page
    owns, as the cell plan writes them), whose bytes nothing moves."""
    rng = random.Random(len(pages) * 2 + ring_src + 4 * holes)
    num_blocks, n = 12, 7
    # The row's segments: (page index, bytes); a hole has no page.
    segs: list[tuple[int | None, int]] = []
    for s, p in enumerate(pages):
        segs.append((s, p))
        if holes and s + 1 < len(pages):
            segs.append((None, 16 * rng.randrange(1, 4) + rng.randrange(2)))
    row = sum(n_ for _, n_ in segs)
    offsets = [sum(n_ for _, n_ in segs[:k]) for k in range(len(segs) + 1)]
    # "GPU" segments: each its own region, its own stride (page padded by 0-3 x 16 bytes + 1).
    strides = [p + 16 * rng.randrange(4) + 1 for p in pages]
    seg_at, pos = [], 0
    for st_ in strides:
        seg_at.append(pos)
        pos += st_ * num_blocks + 64
    gpu = host_buffer(pos, seed=1 + ring_src)
    ring = host_buffer(row * n + 64, seed=3)
    gpu_ids = rng.sample(range(num_blocks), n)
    # The ring rows in some order, one after the other from a base offset.
    ring_base = ring.data_ptr() + 32
    rings = [row * k for k in rng.sample(range(n), n)]
    want_gpu, want_ring = gpu.numpy().copy(), ring.numpy().copy()
    for b, r in zip(gpu_ids, rings):
        for k, (s, p) in enumerate(segs):
            if s is None:
                continue
            g = seg_at[s] + b * strides[s]
            q = 32 + r + offsets[k]
            if ring_src:
                want_gpu[g : g + p] = want_ring[q : q + p]
            else:
                want_ring[q : q + p] = want_gpu[g : g + p]
    ids_t, rings_t = _i64(gpu_ids), _i64(rings)
    bases_t = _i64([0 if s is None else gpu.data_ptr() + seg_at[s] for s, _ in segs])
    strides_t = _i64([0 if s is None else strides[s] for s, _ in segs])
    offsets_t = _i64(offsets)
    staged_mod.copy_staged_raw(
        ids_t.data_ptr(), rings_t.data_ptr(), bases_t.data_ptr(), strides_t.data_ptr(),
        offsets_t.data_ptr(), n, len(segs), ring_base, ring_src,
        max_size=max(pages), max_ctas=3,
    )  # fmt: skip
    if not INTERPRET:
        torch.cuda.synchronize()
    np.testing.assert_array_equal(gpu.numpy(), want_gpu)
    np.testing.assert_array_equal(ring.numpy(), want_ring)
