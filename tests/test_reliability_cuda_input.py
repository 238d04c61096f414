"""Reliability: unpinned host memory and streams of the wrong kind on CUDA (run on a GPU
machine)."""

from __future__ import annotations

import pytest
import torch

from blockswap import BackendError, Engine
from reliability_helpers import BAD, BEFORE, KiB, MiB, drain


@pytest.mark.cuda
def test_cuda_unpinned_and_misplaced_memory_is_refused_and_transfers_around_it_work() -> None:
    eng = Engine("cuda")
    try:
        host = torch.randint(0, 256, (1 * MiB,), dtype=torch.uint8).pin_memory()
        dev = torch.zeros(1 * MiB, dtype=torch.uint8, device="cuda")
        eng.register(host)
        eng.register(dev)
        eng.submit(BEFORE, [host.data_ptr()], [dev.data_ptr()], [64 * KiB], "h2d")
        with pytest.raises(BackendError, match="not page-locked host memory"):
            eng.register(torch.zeros(4096, dtype=torch.uint8))  # pageable
        with pytest.raises(BackendError, match="not host memory"):
            eng.register(torch.zeros(4096, dtype=torch.uint8, device="cuda"), kind="host")
        with pytest.raises(BackendError, match="not device memory"):
            eng.register(torch.zeros(4096, dtype=torch.uint8).pin_memory(), kind="device")
        eng.submit(BAD, [host.data_ptr() + 64 * KiB], [dev.data_ptr() + 64 * KiB], [64 * KiB])
        eng.wait([BEFORE, BAD])
        assert sorted((r.job_id, r.success) for r in drain(eng.get_finished, 2)) == [
            (BEFORE, True),
            (BAD, True),
        ]
        assert torch.equal(dev[: 128 * KiB].cpu(), host[: 128 * KiB])
        assert not dev[128 * KiB :].any()
    finally:
        eng.shutdown()


@pytest.mark.cuda
def test_cuda_streams_of_the_wrong_kind() -> None:
    with pytest.raises(BackendError, match="legacy or per-thread default stream"):
        Engine("cuda", h2d_stream=0)
    with pytest.raises(BackendError, match="legacy or per-thread default stream"):
        Engine("cuda", d2h_stream=2)
