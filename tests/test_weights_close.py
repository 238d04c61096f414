"""Weight offloading (blockswap.weights): close, zero-copy, no-op."""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blockswap
from blockswap.weights import (
    NoopOffloader,
    OffloadConfigError,
    OffloadDeviceError,
    OffloaderStateError,
    PrefetchOffloader,
    WeightTransferError,
    ZeroCopyOffloader,
    create_offloader,
    get_offloader,
    select_layers,
    set_offloader,
)
from weights_helpers import OFFLOAD, _replay_slots, assert_untouched, make_stack, set_log, snapshot


def test_close_restores(x: torch.Tensor) -> None:
    model = make_stack(6)
    resident = copy.deepcopy(model)
    off = PrefetchOffloader(model.layers, group_size=3, num_in_group=2, prefetch_step=2)
    with torch.no_grad():
        model(x)
    off.close()
    off.close()  # idempotent
    assert off.closed
    assert_untouched(model, snapshot(model))  # no hooks, no marks
    for p, q in zip(model.parameters(), resident.parameters()):
        assert torch.equal(p, q)
    ptrs = {p.data_ptr() for p in model.parameters()}
    assert len(ptrs) == len(list(model.parameters()))  # every parameter owns its memory again
    with torch.no_grad():
        assert torch.equal(model(x), resident(x))
    with pytest.raises(OffloaderStateError, match="closed"):
        off.sync_prev_onload()

    off = PrefetchOffloader(model.layers, group_size=3, num_in_group=2)
    off.close(restore=False)
    assert model.layers[2].w13_weight.numel() == 0
    assert model.layers[0].w13_weight.numel() > 0


def test_zero_copy_host_mode(x: torch.Tensor) -> None:
    model = make_stack(6)
    resident = copy.deepcopy(model)
    off = ZeroCopyOffloader(model.layers, group_size=3, num_in_group=1, params=OFFLOAD)
    try:
        assert off.offloaded_layers == [2, 5]
        base = off._host.data_ptr()
        for i in off.offloaded_layers:
            for name in OFFLOAD:
                ptr = getattr(model.layers[i], name).data_ptr()
                assert base <= ptr < base + off.host_bytes
        off.sync_prev_onload()
        off.join_after_forward()
        with torch.no_grad():
            assert torch.equal(model(x), resident(x))
    finally:
        off.close()
    with torch.no_grad():
        assert torch.equal(model(x), resident(x))


def test_a_closed_zero_copy_offloader_frees_its_buffer_unless_a_view_keeps_it() -> None:
    """After close, the pinned buffer (its engine's) goes with the last view of it: at once
    where no tensor views it, even while the offloader itself is kept (set_offloader keeps
    it); not before a view taken from a parameter while offloaded is gone."""
    try:
        for keep_view in (False, True):
            model = make_stack(4)
            off = ZeroCopyOffloader(model.layers)
            set_offloader(off)
            engine = weakref.ref(off.engine)
            view = model.layers[1].w2_weight.data if keep_view else None
            want = None if view is None else view.clone()
            off.close()
            gc.collect()
            assert (engine() is not None) == keep_view
            if view is not None:
                assert torch.equal(view, want)  # still reads the buffer's bytes
                del view
                gc.collect()
                assert engine() is None
    finally:
        set_offloader(NoopOffloader())


def test_noop_and_current_offloader(x: torch.Tensor) -> None:
    assert isinstance(get_offloader(), NoopOffloader)
    model = make_stack(3)
    snap = snapshot(model)
    noop = create_offloader("none", model.layers)
    assert noop.offloaded_layers == [] and noop.offloaded_bytes == 0
    noop.sync_prev_onload()
    noop.join_after_forward()
    noop.close()
    assert_untouched(model, snap)

    off = create_offloader("prefetch", model.layers, group_size=3, num_in_group=1)
    old = get_offloader()
    try:
        set_offloader(off)
        assert get_offloader() is off
        get_offloader().sync_prev_onload()
        with pytest.raises(OffloadConfigError):
            set_offloader("nope")  # type: ignore[arg-type]
    finally:
        set_offloader(old)
        off.close()
    sync = create_offloader("sync", model.layers, group_size=3, num_in_group=1)
    assert isinstance(sync, PrefetchOffloader) and sync.synchronous
    sync.close()
    z = create_offloader("zero_copy", model.layers, group_size=3, num_in_group=1)
    assert isinstance(z, ZeroCopyOffloader)
    z.close()
    with pytest.raises(OffloadConfigError, match="kind must be"):
        create_offloader("uva", model.layers)


def test_errors_are_value_errors() -> None:
    assert issubclass(OffloadConfigError, ValueError)
    assert issubclass(OffloadDeviceError, OffloadConfigError)
    assert issubclass(WeightTransferError, blockswap.BlockswapError)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    n=st.integers(1, 9),
    group=st.integers(1, 4),
    data=st.data(),
)
def test_random_configurations(n: int, group: int, data: st.DataObject) -> None:
    num = data.draw(st.integers(1, group))
    chosen = select_layers(n, group, num)
    if not chosen:
        return
    step = data.draw(st.integers(1, len(chosen)))
    synchronous = data.draw(st.booleans())
    trace: list[Any] = []
    model = make_stack(n, hidden=8, inter=8, log=trace, seed=n)
    resident = copy.deepcopy(model)
    set_log(resident, None)
    off = PrefetchOffloader(
        model.layers,
        group_size=group,
        num_in_group=num,
        prefetch_step=step,
        synchronous=synchronous,
        trace=trace,
    )
    try:
        assert off.offloaded_layers == chosen
        assert off.layer_slots == {i: k % step for k, i in enumerate(chosen)}
        xi = torch.randn(2, 8)
        with torch.no_grad():
            for _ in range(2):
                before = off.submissions
                assert torch.equal(model(xi), resident(xi))
                assert off.submissions - before == len(chosen)
        _replay_slots(trace, off)
    finally:
        off.close()
