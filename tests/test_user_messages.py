"""What a user reads: refusals that say what happened and what to do, one wording of the host
route wherever it is shown, and the README's claims as the code behaves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from blockswap import InvalidTransferError, PoolExhaustedError
from blockswap.__main__ import _routes, describe
from blockswap._bench import route_choice
from blockswap.handler import CpuGpuHandlers
from blockswap.routing import HOST_ROUTE

ROOT = Path(__file__).resolve().parent.parent


def handlers(**kw: object) -> CpuGpuHandlers:
    caches = [torch.zeros(2, 8, 4, 2, 8) for _ in range(2)]
    return CpuGpuHandlers(caches, 8, layout="kv_split", backend="host", **kw)


def test_finished_but_unpolled_transfers_are_not_called_in_flight() -> None:
    with handlers(max_in_flight=2) as h:
        h.d2h.transfer_async(1, ([0], [0]))
        h.d2h.transfer_async(2, ([1], [1]))
        h.wait([1, 2])  # both finished; neither polled
        with pytest.raises(PoolExhaustedError) as info:
            h.d2h.transfer_async(3, ([2], [2]))
        msg = str(info.value)
        assert "2 d2h transfers are in flight or finished but not yet polled" in msg
        assert "call get_finished" in msg
        assert sorted(r.job_id for r in h.get_finished()) == [1, 2]
        assert h.d2h.transfer_async(3, ([2], [2]))


@pytest.mark.parametrize(
    "spec,got",
    [
        (([1], [2], [3]), "a tuple of 3 items"),
        (([1],), "a tuple of 1 items"),
        (5, "a int"),
        (torch.zeros(2, 3, dtype=torch.int64), "a Tensor of shape (2, 3)"),
    ],
)
def test_a_spec_of_the_wrong_shape_names_the_argument_and_the_shape(spec: object, got: str) -> None:
    with handlers() as h:
        with pytest.raises(InvalidTransferError) as info:
            h.d2h.transfer_async(1, spec)
        assert str(info.value) == (
            f"d2h job 1: spec must be a pair (GPU block ids, CPU block ids), not {got}"
        )
        with pytest.raises(InvalidTransferError, match=r"pair \(CPU block ids, GPU block ids\)"):
            h.h2d.transfer_async(2, spec)


def test_the_host_route_is_said_one_way_by_info_bench_and_the_handler() -> None:
    with handlers() as h:
        # The handler says its plan (staged, for this block-major cache) and then the host route.
        assert all(h.routes[d].reason.endswith(HOST_ROUTE) for d in ("d2h", "h2d"))
        # What `blockswap info` prints for the host backend (on a GPU machine its default is CUDA).
        assert set(_routes("host", None).values()) == {HOST_ROUTE}
        d = describe()
        if d["engine"]["backend"] == "host":
            assert set(d["routes"].values()) == {HOST_ROUTE}
        assert {route_choice(h.routes[d], 64) for d in ("d2h", "h2d")} == {"memcpy"}
    readme = (ROOT / "README.md").read_text()
    assert f"GPU->CPU (d2h): {HOST_ROUTE}" in readme


def test_the_readme_says_which_spec_takes_canonical_layout() -> None:
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (
        "`BlockswapOffloadingSpec` refuses it when the spec is made, naming the tiering" in readme
    )
    assert "not supported yet" not in readme
