"""Weight offloading (blockswap.weights), correctness: every offloaded layer's forward sees its
own weights."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from blockswap import PoolExhaustedError
from blockswap.weights import OffloaderStateError, PrefetchOffloader, WeightTransferError
from weights_helpers import OFFLOAD, _replay_slots, make_stack, set_log


def _weight_checker(expected: dict[int, dict[str, torch.Tensor]], bad: list[Any]) -> Any:
    """Called as a layer's forward starts (after the offloader's wait): are the weights the
    layer's own?"""

    def check(module: nn.Module) -> None:
        for name, val in expected[module.index].items():
            if not torch.equal(getattr(module, name).detach(), val):
                bad.append((module.index, name))

    return check


@pytest.mark.parametrize("synchronous", [False, True], ids=["prefetch", "sync"])
@pytest.mark.parametrize(
    ("n", "group", "num", "step"),
    [
        (8, 2, 1, 1),
        (8, 2, 1, 2),
        (7, 2, 1, 2),  # 3 offloaded layers, 2 slots: the wrap-around does not line up
        (9, 3, 2, 2),
        (6, 1, 1, 3),
        (5, 5, 1, 1),  # a single offloaded layer
    ],
)
def test_outputs_bit_identical(
    x: torch.Tensor, n: int, group: int, num: int, step: int, synchronous: bool
) -> None:
    resident = make_stack(n, seed=n)
    model = copy.deepcopy(resident)
    expected = {
        i: {name: getattr(layer, name).detach().clone() for name in OFFLOAD}
        for i, layer in enumerate(model.layers)
    }
    off = PrefetchOffloader(
        model.layers,
        group_size=group,
        num_in_group=num,
        prefetch_step=step,
        params=OFFLOAD,
        synchronous=synchronous,
    )
    bad: list[Any] = []
    for layer in model.layers:
        layer.check = _weight_checker(expected, bad)
    try:
        with torch.no_grad():
            for trial in range(3):
                xi = x * (trial + 1)
                assert torch.equal(model(xi), resident(xi))
        assert not bad
        assert off.submissions == 3 * len(off.offloaded_layers) + (0 if synchronous else step)
    finally:
        off.close()


def test_one_submission_per_layer_per_forward(x: torch.Tensor) -> None:
    model = make_stack(8)
    off = PrefetchOffloader(
        model.layers, group_size=2, num_in_group=1, prefetch_step=2, params=OFFLOAD
    )
    calls: list[tuple[int, int, int, str]] = []
    submit = off.engine.submit

    def spy(job_id: int, src: Any, dst: Any, sizes: Any, direction: str = "h2d", **kw: Any) -> None:
        calls.append((len(src), int(sizes.sum()), int(dst[0]), direction))
        submit(job_id, src, dst, sizes, direction, **kw)

    off.engine.submit = spy  # type: ignore[method-assign]
    layer_bytes = sum(
        p.numel() * 4 for p in (model.layers[1].w13_weight, model.layers[1].w2_weight)
    )
    slot_ptr = {
        0: model.layers[1].w13_weight.data_ptr(),
        1: model.layers[3].w13_weight.data_ptr(),
    }
    try:
        with torch.no_grad():
            for _ in range(3):
                calls.clear()
                model(x)
                # 4 offloaded layers: exactly 4 submissions, each one whole layer (both tensors).
                assert len(calls) == 4
                for n_desc, nbytes, dst0, direction in calls:
                    assert direction == "h2d"
                    assert n_desc == 2
                    assert nbytes >= layer_bytes
                    assert dst0 in (
                        slot_ptr[0],
                        slot_ptr[1],
                        model.layers[1].w2_weight.data_ptr(),
                        model.layers[3].w2_weight.data_ptr(),
                    )
    finally:
        off.close()


@pytest.mark.parametrize("step", [1, 2, 3])
def test_hook_order(x: torch.Tensor, step: int) -> None:
    trace: list[Any] = []
    model = make_stack(7, log=trace)
    resident = copy.deepcopy(model)
    set_log(resident, None)
    off = PrefetchOffloader(
        model.layers, group_size=2, num_in_group=1, prefetch_step=step, params=OFFLOAD, trace=trace
    )
    try:
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(model(x), resident(x))
        _replay_slots(trace, off)
        # Per forward: wait k, forward, onload of the next occupant of k's slot.
        n = len(off.offloaded_layers)
        onloads = [e for e in trace if e[0] == "onload"]
        assert [e[1] for e in onloads[:step]] == list(range(step))  # initial prefetch
        assert [(e[1], e[4]) for e in onloads[step : step + n]] == [
            (k + step if k + step < n else k % step, k) for k in range(n)
        ]
        assert all(e[3] == "engine" for e in onloads)
        assert {e[2] for e in trace if e[0] == "wait"} == {"event"}
    finally:
        off.close()


def test_wrap_around_is_not_vllm_rule() -> None:
    """3 offloaded layers, 2 slots: after layer 1 the slot-1 layer is layer 3 of this forward
    would be wrong; the rule sends each layer's slot to its next occupant (layer 0 of the next
    forward goes into slot 0 only after layer 2, slot 0's last reader, has run)."""
    trace: list[Any] = []
    model = make_stack(6, log=trace)
    off = PrefetchOffloader(
        model.layers, group_size=2, num_in_group=1, prefetch_step=2, params=OFFLOAD, trace=trace
    )
    try:
        with torch.no_grad():
            model(torch.randn(2, 16))
        nexts = [(e[4], e[1]) for e in trace if e[0] == "onload" and e[4] is not None]
        assert nexts == [(0, 2), (1, 1), (2, 0)]
        _replay_slots(trace, off)
    finally:
        off.close()


def test_out_of_order_forward_is_refused_then_reset(x: torch.Tensor) -> None:
    model = make_stack(6)
    resident = copy.deepcopy(model)
    off = PrefetchOffloader(model.layers, group_size=2, num_in_group=1, params=OFFLOAD)
    try:
        with torch.no_grad():
            h = x
            for layer in list(model.layers)[:3]:  # a partial forward
                h = layer(h)
            with pytest.raises(OffloaderStateError, match="expected"):
                model(x)
            off.reset()
            assert torch.equal(model(x), resident(x))
    finally:
        off.close()


@pytest.mark.parametrize("how", ["failed", "refused"])
def test_a_failed_or_refused_onload_stops_forwards_until_reset(
    x: torch.Tensor, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """An onload that failed is raised, and forwards are refused until ``reset()``. One the
    engine refused (here a full pool) leaves its slot holding the layer it held: the next forward
    is refused too, not run on those weights. After ``reset()`` forwards are exact again."""
    model = make_stack(6)
    resident = copy.deepcopy(model)
    off = PrefetchOffloader(model.layers, group_size=2, num_in_group=1, params=OFFLOAD)
    try:
        with torch.no_grad():
            assert torch.equal(model(x), resident(x))
            if how == "failed":
                off.engine.inject_failures(1)
                with pytest.raises(WeightTransferError, match="failed"):
                    for _ in range(2):
                        model(x)
            else:

                def refuse(*args: object, **kwargs: object) -> None:
                    raise PoolExhaustedError("no slab free (injected)")

                monkeypatch.setattr(off.engine, "submit", refuse)
                with pytest.raises(PoolExhaustedError, match="injected"):
                    model(x)
                monkeypatch.undo()
                with pytest.raises(WeightTransferError, match="call reset"):
                    model(x)
            off.reset()
            assert torch.equal(model(x), resident(x))
            assert torch.equal(model(x), resident(x))
    finally:
        off.close()
