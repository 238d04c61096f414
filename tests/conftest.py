from __future__ import annotations

import os

import numpy as np
import pytest
import torch

# Without a GPU, Triton kernels run under the interpreter over host memory. Triton decides at
# `@triton.jit` time, so this must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import blockswap

# Whether this machine has a GPU. Where it has one, GPU tests run: a driver or library that
# blockswap cannot use there is a failure to report, not a reason to skip.
HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # GPU tests skip only where no GPU exists.
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU and driver")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture
def engine():
    eng = blockswap.Engine("host")
    yield eng
    eng.shutdown()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)
