"""The core's driver queries and copy (cuda_memory_kind, cuda_device_pointer, cuda_memcpy) and the
Python code that asks them: the reference copy's host test and the zero-copy offloader's device
address; and page-locking from several threads at once (fill_and_pin's ``lock_threads``), which
the driver's answers check. Their answers without a driver library run everywhere there is none;
the GPU's, where there is one."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

import blockswap
from blockswap import BackendError, _core
from blockswap.kernels import copy as copy_mod
from blockswap.weights import OffloadDeviceError
from blockswap.weights.offloaders import _device_pointer

# The core found no driver library at all (not a driver without a GPU, which answers otherwise).
NO_DRIVER = "no NVIDIA driver library" in blockswap.cuda_status()[1]


def test_pageable_memory_is_unknown_to_the_driver_and_read_by_the_cpu() -> None:
    a = np.zeros(64, np.uint8)
    assert _core.cuda_memory_kind(a.ctypes.data) is None
    assert copy_mod._is_host_address(a.ctypes.data)


@pytest.mark.skipif(not NO_DRIVER, reason="the answers where there is no driver library")
def test_without_a_driver_every_address_is_host_memory_at_its_own_address() -> None:
    a = np.arange(64, dtype=np.uint8)
    b = np.zeros(64, np.uint8)
    for addr in (a.ctypes.data, 0x7F0000000000, 0):
        assert _core.cuda_memory_kind(addr) is None
        assert copy_mod._is_host_address(addr)
        assert _core.cuda_device_pointer(addr) is None
        assert _device_pointer(addr) == addr
    with pytest.raises(BackendError, match="no NVIDIA driver library"):
        _core.cuda_memcpy(b.ctypes.data, a.ctypes.data, 64)
    assert not b.any()
    # The reference copy needs no driver for host memory.
    copy_mod.copy_blocks_reference([a.ctypes.data + 8], [b.ctypes.data], [16])
    assert np.array_equal(b[:16], a[8:24]) and not b[16:].any()


@pytest.mark.cuda
def test_the_driver_names_pinned_and_device_memory() -> None:
    dev = torch.zeros(64, dtype=torch.uint8, device="cuda")  # makes torch's context current
    pinned = torch.zeros(64, dtype=torch.uint8).pin_memory()
    pageable = np.zeros(64, np.uint8)
    assert _core.cuda_memory_kind(dev.data_ptr()) == "device"
    assert _core.cuda_memory_kind(pinned.data_ptr()) == "host"
    assert _core.cuda_memory_kind(pageable.ctypes.data) is None
    assert not copy_mod._is_host_address(dev.data_ptr())
    assert copy_mod._is_host_address(pinned.data_ptr())
    assert copy_mod._is_host_address(pageable.ctypes.data)


@pytest.mark.cuda
def test_the_device_address_of_the_engines_pinned_memory_is_its_host_address() -> None:
    torch.zeros(1, device="cuda")  # makes torch's context (the engine's too) current
    eng = blockswap.Engine("cuda")
    try:
        host = eng.alloc_host(4096)
        addr = host.ctypes.data
        # Unified addressing: mapped pinned memory has one address on both sides.
        assert _core.cuda_device_pointer(addr) == addr
        assert _device_pointer(addr) == addr
        pageable = np.zeros(64, np.uint8)
        with pytest.raises(BackendError, match="cuMemHostGetDevicePointer"):
            _core.cuda_device_pointer(pageable.ctypes.data)
        with pytest.raises(OffloadDeviceError, match="not mapped into the device's address space"):
            _device_pointer(pageable.ctypes.data)
        eng.free_host(host)
    finally:
        eng.shutdown()


@pytest.mark.cuda
def test_the_driver_copies_between_host_and_device_memory() -> None:
    n = 1 << 20
    src = np.random.default_rng(5).integers(0, 256, n, dtype=np.uint8)
    dev = torch.zeros(n, dtype=torch.uint8, device="cuda")
    back = torch.zeros(n, dtype=torch.uint8).pin_memory()
    _core.cuda_memcpy(dev.data_ptr(), src.ctypes.data, n)
    _core.cuda_memcpy(back.data_ptr(), dev.data_ptr(), n)
    assert np.array_equal(back.numpy(), src)


@pytest.mark.cuda
@pytest.mark.parametrize("lock_threads", [1, 2, 5])
def test_pieces_are_page_locked_from_several_threads_all_or_nothing(lock_threads: int) -> None:
    """``fill_and_pin`` locks 64 pieces from ``lock_threads`` threads: each piece is page-locked
    after, and unlocked by ``cuda_unpin``. Where one piece is refused (it is locked already), the
    error names it and every other piece is left unlocked, whichever thread locked it."""
    torch.zeros(1, device="cuda")  # the context made before the pieces are locked
    page = mmap.PAGESIZE
    n = 64
    buf = mmap.mmap(-1, n * 4 * page)
    base = np.frombuffer(buf, np.uint8).ctypes.data
    pieces = [(base + k * 4 * page, 4 * page) for k in range(n)]
    try:
        _core.fill_and_pin([(base, n * 4 * page)], pieces, 0, lock_threads=lock_threads)
        assert all(_core.cuda_memory_kind(a + 4 * page - 1) == "host" for a, _ in pieces)
        for a, _ in pieces:
            _core.cuda_unpin(a, 0)
        assert all(_core.cuda_memory_kind(a) is None for a, _ in pieces)
        taken = pieces[41]
        _core.cuda_pin(taken[0], taken[1], 0)
        try:
            with pytest.raises(BackendError, match=rf"piece 41 of {n} \({4 * page} bytes at"):
                _core.fill_and_pin([], pieces, 0, lock_threads=lock_threads)
            assert all(_core.cuda_memory_kind(a) is None for a, _ in pieces if a != taken[0])
            assert _core.cuda_memory_kind(taken[0]) == "host"
        finally:
            _core.cuda_unpin(taken[0], 0)
    finally:
        buf.close()
