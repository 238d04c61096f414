"""Weight offloading (blockswap.weights): CUDA graph hooks, emulated on the host."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from blockswap.weights import OffloaderStateError, PrefetchOffloader
from weights_helpers import OFFLOAD, _replay_slots, make_stack, set_log


@pytest.mark.parametrize("step", [1, 2])
def test_capture_hook_order(x: torch.Tensor, step: int) -> None:
    trace: list[Any] = []
    model = make_stack(8, log=trace)
    resident = copy.deepcopy(model)
    set_log(resident, None)
    off = PrefetchOffloader(
        model.layers, group_size=2, num_in_group=1, prefetch_step=step, params=OFFLOAD, trace=trace
    )
    n = len(off.offloaded_layers)
    calls: list[int] = []
    submit = off.engine.submit

    def spy(job_id: int, *args: Any, **kw: Any) -> None:
        calls.append(job_id)
        submit(job_id, *args, **kw)

    off.engine.submit = spy  # type: ignore[method-assign]
    try:
        with torch.no_grad():
            assert torch.equal(model(x), resident(x))  # warm-up
            # The runner: sync the previous onload, capture the forward, join, end the capture.
            off.sync_prev_onload()
            start = len(trace)
            before = len(calls)
            with off.emulate_capture():
                out = model(x)
                off.join_after_forward()
            assert torch.equal(out, resident(x))
            assert len(calls) == before, "the engine was used during a capture"
            cap = trace[start:]
            waits = {e[1]: e[2] for e in cap if e[0] == "wait"}
            # Layers loaded before the capture are not waited on inside it; the others wait
            # on copy events recorded inside it.
            assert waits == {k: "skip" if k < step else "captured-event" for k in range(n)}
            onloads = [e for e in cap if e[0] == "onload"]
            assert [e[3] for e in onloads] == ["capture"] * n
            # The prefetches of the next replay's first layers are joined before the end.
            joins = [e[1] for e in cap if e[0] == "join"]
            assert joins == list(range(step))
            assert cap.index(("capture_end",)) > max(i for i, e in enumerate(cap) if e[0] == "join")
            _replay_slots(trace, off)

            # "Replay": the runner syncs the previous onload first.
            off.sync_prev_onload()
            assert trace[-1] == ("sync_prev", "stream")

            # An eager forward after the capture: layers whose last copy event was recorded in
            # the capture are waited for through the whole copy stream.
            start = len(trace)
            assert torch.equal(model(x), resident(x))
            waits = {e[1]: e[2] for e in trace[start:] if e[0] == "wait"}
            assert waits == {k: "stream" if k < step else "event" for k in range(n)}
            assert len(calls) == before + n
            assert torch.equal(model(x), resident(x))

            # A second capture, and sync mode's own capture behaviour is covered below.
            off.sync_prev_onload()
            with off.emulate_capture():
                out = model(x)
                off.join_after_forward()
            assert torch.equal(out, resident(x))
            assert torch.equal(model(x), resident(x))
    finally:
        off.close()


def test_capture_without_join_fails(x: torch.Tensor) -> None:
    model = make_stack(4)
    off = PrefetchOffloader(model.layers, group_size=2, num_in_group=1, params=OFFLOAD)
    try:
        with torch.no_grad():
            model(x)
            off.sync_prev_onload()
            with pytest.raises(RuntimeError, match="join_after_forward"), off.emulate_capture():
                model(x)
            off.sync_prev_onload()  # recovers: everything issued so far is ordered
            with off.emulate_capture():
                model(x)
                off.join_after_forward()
    finally:
        off.close()


def test_hooks_outside_and_inside_capture_are_safe(x: torch.Tensor) -> None:
    model = make_stack(4)
    off = PrefetchOffloader(model.layers, group_size=2, num_in_group=1, params=OFFLOAD, trace=[])
    try:
        off.join_after_forward()  # outside a capture: nothing
        with torch.no_grad(), off.emulate_capture():
            off.sync_prev_onload()  # inside a capture: nothing (no isolation error)
            assert off.trace is not None and off.trace[-1] == ("sync_prev", "capturing")
            model(x)
            off.join_after_forward()
        with pytest.raises(OffloaderStateError, match="cannot run during"), off.emulate_capture():
            off.reset()
    finally:
        off.close()


def test_sync_mode_capture(x: torch.Tensor) -> None:
    trace: list[Any] = []
    model = make_stack(6, log=trace)
    resident = copy.deepcopy(model)
    set_log(resident, None)
    off = PrefetchOffloader(
        model.layers,
        group_size=2,
        num_in_group=1,
        prefetch_step=1,
        params=OFFLOAD,
        synchronous=True,
        trace=trace,
    )
    try:
        with torch.no_grad():
            assert torch.equal(model(x), resident(x))
            off.sync_prev_onload()
            start = len(trace)
            with off.emulate_capture():
                assert torch.equal(model(x), resident(x))
                off.join_after_forward()
            cap = trace[start:]
            assert [e[2] for e in cap if e[0] == "wait"] == ["captured-event"] * 3
            assert not [e for e in cap if e[0] == "join"]
            _replay_slots(trace, off)
    finally:
        off.close()
