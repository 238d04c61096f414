"""Weight offloading (blockswap.weights): torch.compile (host mode)."""

from __future__ import annotations

import copy

import pytest
import torch

from blockswap.weights import PrefetchOffloader
from weights_helpers import OFFLOAD, make_stack


@pytest.mark.parametrize(("backend", "step"), [("aot_eager", 1), ("aot_eager", 2), ("inductor", 1)])
def test_torch_compile(x: torch.Tensor, backend: str, step: int) -> None:
    torch._dynamo.reset()
    resident = make_stack(6, seed=3)
    model = copy.deepcopy(resident)
    off = PrefetchOffloader(
        model.layers, group_size=2, num_in_group=1, prefetch_step=step, params=OFFLOAD
    )
    try:
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        ref = torch.compile(resident, backend=backend, fullgraph=True)
        with torch.no_grad():
            for trial in range(3):
                xi = x * (trial + 1)
                assert torch.equal(compiled(xi), ref(xi))
        assert off.submissions == 3 * 3 + step
    finally:
        off.close()
        torch._dynamo.reset()


def test_torch_compile_before_offload(x: torch.Tensor) -> None:
    """Code compiled before the offload (another instance of the class, or the same model) is
    not reused without the offloader's steps: Dynamo guards on the instance forward."""
    torch._dynamo.reset()
    try:
        resident = make_stack(6, seed=5)
        model = copy.deepcopy(resident)
        ref = torch.compile(resident, backend="aot_eager")
        compiled = torch.compile(model, backend="aot_eager")
        with torch.no_grad():
            want = resident(x)
            assert torch.equal(ref(x), want)
            assert torch.equal(compiled(x), want)  # compiled before the offload
            off = PrefetchOffloader(model.layers, group_size=2, num_in_group=1, params=OFFLOAD)
            try:
                for _ in range(2):
                    assert torch.equal(compiled(x), want)
                    assert torch.equal(ref(x), want)
                assert off.submissions == 1 + 2 * 3
            finally:
                off.close()
            assert torch.equal(compiled(x), want)  # and after close, without it again
    finally:
        torch._dynamo.reset()


def test_existing_instance_forward_is_restored(x: torch.Tensor) -> None:
    model = make_stack(4)
    layer = model.layers[1]
    seen: list[int] = []
    inner = layer.forward

    def traced(h: torch.Tensor) -> torch.Tensor:
        seen.append(1)
        return inner(h)

    layer.forward = traced
    resident = make_stack(4)
    off = PrefetchOffloader(model.layers, group_size=2, num_in_group=1, params=OFFLOAD)
    with torch.no_grad():
        assert torch.equal(model(x), resident(x))
    assert seen == [1]
    off.close()
    assert layer.__dict__["forward"] is traced
    assert "forward" not in model.layers[3].__dict__
