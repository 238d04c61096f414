from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import settings

# Without a GPU, Triton kernels run under the interpreter over host memory. Triton decides at
# `@triton.jit` time, so this must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import blockswap

# The benchmark suite lives in benches/, not in the package: its tests (and the vLLM tests, which
# use its model catalogue) import `blockswap_bench` from there. Appended, so that nothing in
# benches/ shadows an installed module.
sys.path.append(str(Path(__file__).resolve().parents[1] / "benches"))

# Hypothesis profiles. "ci" (the default under CI=true, and what `make test` uses) is derandomised:
# the same examples every run, so CI passes or fails deterministically. "random" draws new examples
# each run and is how property tests look for new failures (`make test-random`); a failure it finds
# prints the example to add as an `@example` regression.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("random", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# Whether this machine has a GPU. Where it has one, GPU tests run: a driver or library that
# blockswap cannot use there is a failure to report, not a reason to skip.
HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # GPU tests skip only where no GPU exists.
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU and driver")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _blockswap_logger_restored():
    """Each test starts with the ``blockswap`` logger as the package leaves it: a test that makes
    the vLLM plug-in's spec attaches it to vLLM's logging (``blockswap._vllm_logging.attach``,
    which turns its propagation off), and the tests after it must still see its records."""
    log = logging.getLogger("blockswap")
    saved = (list(log.handlers), log.level, log.propagate)
    yield
    log.handlers[:], log.level, log.propagate = saved


@pytest.fixture
def engine():
    eng = blockswap.Engine("host")
    yield eng
    eng.shutdown()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


# The input of the weight offloading tests (tests/test_weights_*.py): 5 tokens of hidden size 16.
@pytest.fixture
def x() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(5, 16, generator=g)
