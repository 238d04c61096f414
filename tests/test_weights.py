"""Weight offloading (blockswap.weights).

Without a GPU the offloaders run in their host test mode (``Engine("host")``, CPU tensors as
slots, host stand-ins for streams and events): selection, slot assignment, validation, hook
order, one batched submission per layer, emulated capture rules, torch.compile. The ``cuda``
tests check bit-identical outputs of a 32-layer bf16 SwiGLU stack on the GPU in eager,
CUDA-graph and torch.compile modes.
"""

from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import blockswap
from blockswap import weights as weights_mod
from blockswap.weights import (
    NoopOffloader,
    OffloadConfigError,
    OffloadDeviceError,
    PrefetchOffloader,
    WeightTransferError,
    ZeroCopyOffloader,
    create_offloader,
    get_offloader,
    matches_segment,
    select_layers,
    set_offloader,
)

OFFLOAD = ["w13_weight", "w2_weight"]


# ---------------------------------------------------------------------------------------------
# The model: a SwiGLU MLP stack (residual, then RMS norm at the end of each layer)
# ---------------------------------------------------------------------------------------------


def _rms_norm(y: torch.Tensor) -> torch.Tensor:
    v = y.float()
    v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
    return v.to(y.dtype)


class SwiGLU(nn.Module):
    """``x -> norm(x + W2 (silu(W1 x) * W3 x))`` with ``w13 = [W1; W3]``.

    The norm ends the layer so that a layer starts with a matmul: under torch.compile no
    elementwise work fuses across a layer boundary, in the resident model or the offloaded one.
    """

    def __init__(
        self,
        hidden: int,
        inter: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: Any = "cpu",
        log: list[Any] | None = None,
        index: int = 0,
    ) -> None:
        super().__init__()
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.w13_weight = nn.Parameter(torch.empty(2 * inter, hidden, **kw), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(hidden, inter, **kw), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(hidden, **kw), requires_grad=False)
        self.log = log
        self.index = index
        self.check: Any = None  # called with the layer as its forward starts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.log is not None:
            self.log.append(("forward", self.index))
        if self.check is not None:
            self.check(self)
        gate, up = F.linear(x, self.w13_weight).chunk(2, dim=-1)
        y = x + F.linear(F.silu(gate) * up, self.w2_weight)
        return _rms_norm(y) * self.scale


class Stack(nn.Module):
    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def make_stack(
    n: int,
    hidden: int = 16,
    inter: int = 24,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: Any = "cpu",
    log: list[Any] | None = None,
) -> Stack:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    layers = []
    for i in range(n):
        layer = SwiGLU(hidden, inter, dtype=dtype, device=device, log=log, index=i)
        with torch.no_grad():
            for p, fan_in in ((layer.w13_weight, hidden), (layer.w2_weight, inter)):
                p.copy_(
                    torch.randn(p.shape, generator=g, device=device, dtype=torch.float32).to(dtype)
                    / fan_in**0.5
                )
            layer.scale.copy_(1 + 0.1 * torch.randn(hidden, generator=g, device=device).to(dtype))
        layers.append(layer)
    return Stack(layers)


def set_log(model: Stack, log: list[Any] | None) -> None:
    for layer in model.layers:
        layer.log = log


def snapshot(model: nn.Module) -> list[tuple[str, int, torch.Tensor]]:
    return [(n, p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()]


def assert_untouched(model: nn.Module, snap: list[tuple[str, int, torch.Tensor]]) -> None:
    now = list(model.named_parameters())
    assert [n for n, _ in now] == [n for n, _, _ in snap]
    for (name, p), (_, ptr, val) in zip(now, snap):
        assert p.data_ptr() == ptr, f"{name} moved"
        assert p.device == val.device, f"{name} moved to {p.device}"
        if p.device.type != "meta":
            assert torch.equal(p.detach(), val), f"{name} changed"
    for m in model.modules():
        assert "forward" not in m.__dict__, "a forward wrapper was left behind"
        assert not m._forward_pre_hooks and not m._forward_hooks
        assert not hasattr(m, "_blockswap_offloader")


@pytest.fixture
def x() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(5, 16, generator=g)


# ---------------------------------------------------------------------------------------------
# Selection and slots
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "g", "m", "want"),
    [
        (4, 2, 1, [1, 3]),
        (7, 2, 1, [1, 3, 5]),
        (6, 3, 2, [1, 2, 4, 5]),
        (5, 1, 1, [0, 1, 2, 3, 4]),
        (8, 4, 4, list(range(8))),
        (9, 4, 1, [3, 7]),
        (0, 2, 1, []),
    ],
)
def test_select_layers(n: int, g: int, m: int, want: list[int]) -> None:
    assert select_layers(n, g, m) == want


@given(n=st.integers(0, 40), g=st.integers(1, 8), data=st.data())
def test_select_layers_formula(n: int, g: int, data: st.DataObject) -> None:
    m = data.draw(st.integers(1, g))
    got = select_layers(n, g, m)
    assert got == [i for i in range(n) if i % g >= g - m]
    assert len(got) == (n // g) * m + max(0, n % g - (g - m))


def test_matches_segment() -> None:
    assert matches_segment("w13_weight", "w13_weight")
    assert matches_segment("mlp.experts.w13_weight", "w13_weight")
    assert matches_segment("mlp.w2.weight", "mlp.w2")
    assert matches_segment("mlp.w2.weight", "w2")
    assert not matches_segment("w13_weight_scale", "w13_weight")
    assert not matches_segment("mlp.w2.weight", "w")
    assert not matches_segment("xw2.weight", "w2")


def test_layers_and_slots() -> None:
    model = make_stack(8)
    scale_ptrs = [layer.scale.data_ptr() for layer in model.layers]
    off = PrefetchOffloader(
        model.layers, group_size=2, num_in_group=1, prefetch_step=2, params=OFFLOAD
    )
    try:
        assert off.offloaded_layers == [1, 3, 5, 7]
        assert off.layer_slots == {1: 0, 3: 1, 5: 0, 7: 1}
        layers = model.layers
        # Layers that share a slot share its buffers; the two slots are apart.
        for name in OFFLOAD:
            ptr = {i: getattr(layers[i], name).data_ptr() for i in off.offloaded_layers}
            assert ptr[1] == ptr[5] and ptr[3] == ptr[7] and ptr[1] != ptr[3]
            assert len(set(ptr.values())) == off.prefetch_step
        # One buffer per distinct (shape, dtype) in a slot: w13 and w2 differ.
        assert layers[1].w13_weight.data_ptr() != layers[1].w2_weight.data_ptr()
        per_layer = sum(p.numel() * 4 for p in (layers[1].w13_weight, layers[1].w2_weight))
        assert off.slot_bytes >= per_layer
        assert off.device_bytes == 2 * off.slot_bytes
        assert off.offloaded_bytes == 4 * per_layer
        # Resident parameters (unselected layers, unmatched names) never move.
        assert [layer.scale.data_ptr() for layer in layers] == scale_ptrs
        # Fixed addresses: forwards change no pointer.
        ptrs = [p.data_ptr() for p in model.parameters()]
        with torch.no_grad():
            model(torch.randn(3, 16))
            model(torch.randn(3, 16))
        assert [p.data_ptr() for p in model.parameters()] == ptrs
    finally:
        off.close()


def test_slots_per_shape_and_dtype() -> None:
    """Layers of different shapes and a layer with two parameters of one shape."""

    class Odd(nn.Module):
        def __init__(self, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> None:
            super().__init__()
            self.ws = nn.ParameterList(
                [nn.Parameter(torch.randn(s).to(dtype), requires_grad=False) for s in shapes]
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen = [w.detach().clone() for w in self.ws]
            out = x
            for w in self.ws:
                out = out + w.float().sum()
            return out

    layers = [
        Odd([(4, 4), (4, 4)], torch.float32),  # two of one (shape, dtype) in one layer
        Odd([(4, 4)], torch.float32),
        Odd([(3, 5)], torch.float16),
    ]
    ref = [[w.detach().clone() for w in layer.ws] for layer in layers]
    expected = [layer(torch.zeros(2)) for layer in layers]
    off = PrefetchOffloader(layers, prefetch_step=1)
    try:
        w = [[p.data_ptr() for p in layer.ws] for layer in layers]
        # Keys: (4,4,f32)#0, (4,4,f32)#1, (3,5,f16)#0 -> three buffers in the one slot.
        assert w[0][0] != w[0][1]
        assert w[1][0] == w[0][0]
        assert w[2][0] not in (w[0][0], w[0][1])
        assert off.slot_bytes == 512 * 3  # each rounded up to 512 bytes
        with torch.no_grad():
            for _ in range(2):
                for layer, exp, vals in zip(layers, expected, ref):
                    assert torch.equal(layer(torch.zeros(2)), exp)
                    assert all(torch.equal(s, v) for s, v in zip(layer.seen, vals))
    finally:
        off.close()
    for layer, vals in zip(layers, ref):
        assert all(torch.equal(p, v) for p, v in zip(layer.ws, vals))


# ---------------------------------------------------------------------------------------------
# Correctness: every offloaded layer's forward sees its own weights
# ---------------------------------------------------------------------------------------------


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


def _replay_slots(trace: list[Any], off: PrefetchOffloader) -> None:
    """Checks from a trace that each offloaded layer ran with its own weights in its slot, that
    it waited for its copy first, and that every copy into a slot forked from the compute
    stream after the slot's previous reader ran."""
    k_of = {layer: k for k, layer in enumerate(off.offloaded_layers)}
    step = off.prefetch_step
    holder: dict[int, int] = {}
    waited: set[int] = set()
    last_forward: dict[int, int] = {}  # slot -> position of its last reader's forward
    fork_recorded: dict[str, int] = {}
    fork_waited: dict[str, int] = {}
    for pos, entry in enumerate(trace):
        kind = entry[0]
        if kind == "record" and entry[1].startswith("fork"):
            assert entry[2] == "compute"
            fork_recorded[entry[1]] = pos
        elif kind == "wait_event" and entry[1] == "copy":
            fork_waited[entry[2]] = pos
        elif kind == "onload":
            _, j, slot, _path, after = entry
            assert slot == j % step
            fork = f"fork[{j}]"
            # The copy stream waited for a fork recorded on the compute stream...
            assert fork_recorded[fork] < fork_waited[fork] < pos
            # ... after the slot's previous reader ran.
            if slot in last_forward:
                assert last_forward[slot] < fork_recorded[fork]
            if after is not None:
                assert after % step == slot
            holder[slot] = j
            waited.discard(j)
        elif kind == "wait":
            waited.add(entry[1])
        elif kind == "forward" and entry[1] in k_of:
            k = k_of[entry[1]]
            assert holder.get(k % step) == k, f"layer {entry[1]} ran on another layer's weights"
            assert k in waited, f"layer {entry[1]} ran without waiting for its copy"
            last_forward[k % step] = pos


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
            with pytest.raises(RuntimeError, match="expected"):
                model(x)
            off.reset()
            assert torch.equal(model(x), resident(x))
    finally:
        off.close()


def test_transfer_failure_is_reported(x: torch.Tensor) -> None:
    model = make_stack(6)
    resident = copy.deepcopy(model)
    off = PrefetchOffloader(model.layers, group_size=2, num_in_group=1, params=OFFLOAD)
    try:
        with torch.no_grad():
            assert torch.equal(model(x), resident(x))
            off.engine.inject_failures(1)
            with pytest.raises(WeightTransferError, match="failed"):
                for _ in range(2):
                    model(x)
            off.reset()
            assert torch.equal(model(x), resident(x))
            assert torch.equal(model(x), resident(x))
    finally:
        off.close()


# ---------------------------------------------------------------------------------------------
# CUDA graph hooks, emulated on the host
# ---------------------------------------------------------------------------------------------


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
        with pytest.raises(RuntimeError, match="cannot run during"), off.emulate_capture():
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


# ---------------------------------------------------------------------------------------------
# torch.compile (host mode)
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Validation: clear errors, model untouched
# ---------------------------------------------------------------------------------------------


def _bad_configs() -> list[tuple[str, dict[str, Any], type[Exception], str]]:
    return [
        ("num_in_group>group_size", {"group_size": 2, "num_in_group": 3}, OffloadConfigError, "num_in_group \\(3\\) is larger than group_size \\(2\\)"),
        ("group_size=0", {"group_size": 0}, OffloadConfigError, "group_size must be at least 1"),
        ("num_in_group=0", {"num_in_group": 0}, OffloadConfigError, "num_in_group must be at least 1"),
        ("group_size=bool", {"group_size": True}, OffloadConfigError, "group_size must be an int"),
        ("prefetch_step=0", {"prefetch_step": 0}, OffloadConfigError, "prefetch_step must be at least 1"),
        ("prefetch_step=-1", {"prefetch_step": -1}, OffloadConfigError, "prefetch_step must be at least 1"),
        ("prefetch_step=2.0", {"prefetch_step": 2.0}, OffloadConfigError, "prefetch_step must be an int"),
        ("too many slots", {"group_size": 2, "num_in_group": 1, "prefetch_step": 4}, OffloadConfigError, "prefetch_step \\(4\\) is larger than the number of offloaded layers \\(3\\)"),
        ("unmatched segment", {"params": ["w13_weight", "w4_weight"]}, OffloadConfigError, "\\['w4_weight'\\] match no parameter"),
        ("partial segment", {"params": ["w13"]}, OffloadConfigError, "\\['w13'\\] match no parameter"),
        ("empty segment", {"params": [""]}, OffloadConfigError, "non-empty strings"),
        ("nothing selected", {"group_size": 8, "num_in_group": 1}, OffloadConfigError, "nothing to offload"),
        ("device cuda", {"device": "cuda"}, OffloadDeviceError, "no CUDA device|is on cpu"),
        ("device meta", {"device": "meta"}, OffloadDeviceError, "meta"),
        ("device nonsense", {"device": "nonsense"}, OffloadDeviceError, "not a torch device"),
        ("engine_options h2d_stream", {"engine_options": {"h2d_stream": 5}}, OffloadConfigError, "h2d_stream"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [pytest.param(kw, e, m, id=i) for i, kw, e, m in _bad_configs()],
)
def test_validation_errors(kwargs: dict[str, Any], exc: type[Exception], match: str) -> None:
    model = make_stack(6)
    snap = snapshot(model)
    with pytest.raises(exc, match=match) as info:
        PrefetchOffloader(model.layers, **kwargs)
    assert isinstance(info.value, ValueError)
    assert_untouched(model, snap)


def test_validation_wrong_device_tensor() -> None:
    model = make_stack(4)
    with torch.device("meta"):
        model.layers[3].w2_weight = nn.Parameter(torch.empty(16, 24), requires_grad=False)
    snap = snapshot(model)
    with pytest.raises(OffloadDeviceError, match=r"layers\[3\]\.w2_weight.* is on meta"):
        PrefetchOffloader(model.layers, group_size=2, num_in_group=1, params=OFFLOAD)
    assert_untouched(model, snap)
    # Every offloaded weight on the wrong device.
    meta = Stack([SwiGLU(16, 24, device="meta") for _ in range(4)])
    with pytest.raises(OffloadDeviceError, match="not on meta"):
        PrefetchOffloader(meta.layers)
    with pytest.raises(OffloadDeviceError, match="not on meta"):
        ZeroCopyOffloader(meta.layers)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda m: [], "layers is empty"),
        (lambda m: m.layers[0], "sequence of modules"),
        (lambda m: 5, "sequence of nn.Module"),
        (lambda m: [m.layers[0], "layer"], r"layers\[1\] is a str"),
        (lambda m: [m.layers[0], m.layers[1], m.layers[0]], r"layers\[2\] is the same module"),
    ],
)
def test_validation_bad_layers(make: Any, match: str) -> None:
    model = make_stack(3)
    snap = snapshot(model)
    with pytest.raises(OffloadConfigError, match=match):
        PrefetchOffloader(make(model))
    assert_untouched(model, snap)


def test_failure_after_validation_leaves_model_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Allocation and engine failures happen before any parameter is repointed."""
    model = make_stack(4)
    snap = snapshot(model)
    with pytest.raises(TypeError):
        PrefetchOffloader(model.layers, engine_options={"no_such_option": 1})
    assert_untouched(model, snap)

    freed: list[int] = []
    real_free = blockswap.Engine.free_host

    def free_host(self: blockswap.Engine, arr: Any) -> None:
        freed.append(arr.nbytes)
        real_free(self, arr)

    def register(self: blockswap.Engine, *a: Any, **k: Any) -> int:
        raise blockswap.InvalidTransferError("no room for the slots")

    monkeypatch.setattr(blockswap.Engine, "free_host", free_host)
    monkeypatch.setattr(blockswap.Engine, "register", register)
    for make in (
        lambda: PrefetchOffloader(model.layers, group_size=2, num_in_group=1),
        lambda: PrefetchOffloader(model.layers, group_size=2, num_in_group=1, synchronous=True),
    ):
        freed.clear()
        with pytest.raises(blockswap.InvalidTransferError, match="no room"):
            make()
        assert freed, "the pinned buffer was not freed"
        assert_untouched(model, snap)


def test_validation_tied_weight() -> None:
    model = make_stack(4)
    model.layers[3].w2_weight = model.layers[2].w2_weight  # tied with a resident layer
    snap = snapshot(model)
    with pytest.raises(OffloadConfigError, match=r"layers\[3\]\.w2_weight is shared"):
        PrefetchOffloader(model.layers, group_size=2, num_in_group=1)
    assert_untouched(model, snap)


def test_validation_not_dense() -> None:
    model = make_stack(4)
    big = torch.randn(48, 32)
    model.layers[1].w13_weight = nn.Parameter(big[:, :16], requires_grad=False)
    snap = snapshot(model)
    with pytest.raises(OffloadConfigError, match="not dense"):
        PrefetchOffloader(model.layers, group_size=2, num_in_group=1)
    assert_untouched(model, snap)


def test_transposed_parameters_are_dense() -> None:
    model = make_stack(4)
    for layer in model.layers:
        layer.w2_weight = nn.Parameter(
            layer.w2_weight.detach().t().contiguous().t(), requires_grad=False
        )
    resident = copy.deepcopy(model)
    off = PrefetchOffloader(model.layers, group_size=2, num_in_group=1)
    try:
        assert model.layers[1].w2_weight.stride() == resident.layers[1].w2_weight.stride()
        with torch.no_grad():
            xi = torch.randn(3, 16)
            assert torch.equal(model(xi), resident(xi))
    finally:
        off.close()


def test_validation_twice_offloaded() -> None:
    model = make_stack(4)
    off = PrefetchOffloader(model.layers, group_size=2, num_in_group=1, params=OFFLOAD)
    try:
        ptrs = [p.data_ptr() for p in model.parameters()]
        with pytest.raises(OffloadConfigError, match="already offloaded"):
            PrefetchOffloader(model.layers, group_size=2, num_in_group=1)
        with pytest.raises(OffloadConfigError, match="already offloaded"):
            ZeroCopyOffloader(model.layers, group_size=4, num_in_group=1)
        assert [p.data_ptr() for p in model.parameters()] == ptrs
    finally:
        off.close()
    # After close the layers can be offloaded again.
    PrefetchOffloader(model.layers, group_size=2, num_in_group=1).close()


def test_zero_copy_validation_untouched() -> None:
    model = make_stack(4)
    snap = snapshot(model)
    with pytest.raises(OffloadConfigError, match="larger than group_size"):
        ZeroCopyOffloader(model.layers, group_size=1, num_in_group=2)
    with pytest.raises(OffloadConfigError, match="match no parameter"):
        ZeroCopyOffloader(model.layers, params=["nope"])
    assert_untouched(model, snap)


# ---------------------------------------------------------------------------------------------
# close, zero-copy, no-op
# ---------------------------------------------------------------------------------------------


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
    with pytest.raises(RuntimeError, match="closed"):
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


# ---------------------------------------------------------------------------------------------
# GPU: a 32-layer bf16 SwiGLU stack (hidden 4096, intermediate 14336), half the layers offloaded
# ---------------------------------------------------------------------------------------------

HIDDEN, INTER, LAYERS, TOKENS = 4096, 14336, 32, 128


@pytest.fixture(scope="module")
def gpu_resident() -> Any:
    model = make_stack(
        LAYERS, HIDDEN, INTER, seed=1234, dtype=torch.bfloat16, device="cuda"
    )  # ~11.3 GiB
    g = torch.Generator(device="cuda").manual_seed(99)
    xs = [
        torch.randn(TOKENS, HIDDEN, generator=g, device="cuda").to(torch.bfloat16) for _ in range(3)
    ]
    yield model, xs
    del model
    gc.collect()
    torch.cuda.empty_cache()


def _offloaded(resident: Stack, kind: str, step: int = 1) -> tuple[Stack, Any]:
    model = copy.deepcopy(resident)
    if kind == "zero_copy":
        off: Any = ZeroCopyOffloader(model.layers, group_size=2, num_in_group=1, params=OFFLOAD)
    else:
        off = PrefetchOffloader(
            model.layers,
            group_size=2,
            num_in_group=1,
            prefetch_step=step,
            params=OFFLOAD,
            synchronous=kind == "sync",
        )
    assert off.offloaded_layers == list(range(1, LAYERS, 2))
    return model, off


def _dispose(model: Stack, off: Any) -> None:
    off.close(restore=False)
    del model
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("kind", "step"), [("prefetch", 1), ("prefetch", 2), ("sync", 1), ("zero_copy", 1)]
)
def test_gpu_eager_bit_identical(gpu_resident: Any, kind: str, step: int) -> None:
    resident, xs = gpu_resident
    with torch.no_grad():
        refs = [resident(x) for x in xs]
    before = torch.cuda.memory_allocated()
    model, off = _offloaded(resident, kind, step)
    try:
        # The offloaded copy holds half of the MLP weights on the device, plus the slots.
        held = torch.cuda.memory_allocated() - before
        assert held < 0.55 * sum(p.numel() * 2 for p in resident.parameters()) + getattr(
            off, "device_bytes", 0
        )
        with torch.no_grad():
            for _ in range(2):
                for x, ref in zip(xs, refs):
                    out = model(x)
                    torch.cuda.synchronize()
                    assert torch.equal(out, ref)
        if kind != "zero_copy":
            assert off.submissions == 2 * 3 * 16 + (step if kind == "prefetch" else 0)
            stats = off.engine.stats()["h2d"]
            assert stats["failed"] == 0
    finally:
        _dispose(model, off)


def _capture(model: Stack, off: Any, x: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            off.sync_prev_onload()
            model(x)
            off.join_after_forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    off.sync_prev_onload()
    with torch.cuda.graph(graph):
        out = model(x)
        off.join_after_forward()
    return graph, out


@pytest.mark.cuda
@pytest.mark.parametrize("step", [1, 2])
def test_gpu_cuda_graph_bit_identical(gpu_resident: Any, step: int) -> None:
    resident, xs = gpu_resident
    with torch.no_grad():
        eager_refs = [resident(x) for x in xs]
        # The reference: the resident model captured and replayed the same way.
        noop = NoopOffloader(resident.layers)
        static_ref_in = xs[0].clone()
        ref_graph, ref_out = _capture(resident, noop, static_ref_in)
        graph_refs = []
        for x in xs:
            static_ref_in.copy_(x)
            ref_graph.replay()
            graph_refs.append(ref_out.clone())
        del ref_graph
    model, off = _offloaded(resident, "prefetch", step)
    try:
        with torch.no_grad():
            static_in = xs[0].clone()
            graph, out = _capture(model, off, static_in)
            for _ in range(2):
                for x, ref in zip(xs, graph_refs):
                    static_in.copy_(x)
                    off.sync_prev_onload()
                    graph.replay()
                    torch.cuda.synchronize()
                    assert torch.equal(out, ref)
            # Eager forwards and replays mixed on one stream.
            for x, ref_e, ref_g in zip(xs, eager_refs, graph_refs):
                y = model(x)
                static_in.copy_(x)
                off.sync_prev_onload()
                graph.replay()
                y2 = model(x)
                torch.cuda.synchronize()
                assert torch.equal(y, ref_e)
                assert torch.equal(out, ref_g)
                assert torch.equal(y2, ref_e)
            del graph
    finally:
        _dispose(model, off)


class _OrderingOnly:
    """Stands in for an offloader behind the compile-mode ordering ops: the resident model
    with the very same ``offload_wait`` / ``offload_done`` calls around the same layers, which
    do nothing. Inductor then compiles the same graph as for the offloaded model."""

    def _pre(self, k: int) -> None:
        pass

    def _post(self, k: int) -> None:
        pass


def _with_ordering_ops(resident: Stack, layers: list[int]) -> tuple[Stack, int]:
    model = copy.deepcopy(resident)
    oid = -1_000_000 - id(model)
    weights_mod._REGISTRY[oid] = _OrderingOnly()  # type: ignore[assignment]
    for k, i in enumerate(layers):
        layer = model.layers[i]
        layer.forward = weights_mod._make_forward(layer.forward, oid, k)
    return model, oid


@pytest.mark.cuda
def test_gpu_torch_compile_bits_do_not_depend_on_when_onloads_land(gpu_resident: Any) -> None:
    """Under torch.compile, for prefetch 1 and 2: the offloaded model gives the same bits on
    every call, also when its onloads are held back behind a 1 GiB copy on the link (a kernel
    reading a slot before its onload landed, or an onload overwriting a slot still being read,
    would change them), and agrees with the resident model compiled into the same graph (the
    same ordering ops, doing nothing) to bf16 rounding.

    Bit-identity with a separately compiled resident model is not the offloader's to give: the
    offloaded layers' parameters are views into shared slots, so Inductor compiles another graph
    and may choose other reduction configurations, by timing unless in deterministic mode
    (measured on an H100, torch 2.11: 96-109k of 524k elements differ, by at most 0.84 after 32
    layers, and identically on every call; in one run of three, without deterministic mode, it
    chose the same and no bit differed).
    """
    resident, xs = gpu_resident
    torch._dynamo.reset()
    same_graph, oid = _with_ordering_ops(resident, list(range(1, LAYERS, 2)))
    big = 1 << 30
    host = torch.empty(big, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(big, dtype=torch.uint8, device="cuda")
    busy = torch.cuda.Stream()
    try:
        with torch.no_grad():
            compiled_ref = torch.compile(same_graph)
            refs = [compiled_ref(x) for x in xs]
            for step in (1, 2):
                model, off = _offloaded(resident, "prefetch", step)
                try:
                    compiled = torch.compile(model)
                    first = [compiled(x) for x in xs]
                    again = [compiled(x) for x in xs]
                    torch.cuda.synchronize()
                    with torch.cuda.stream(busy):  # the link busy for ~20 ms: onloads land late
                        dev.copy_(host, non_blocking=True)
                    late = [compiled(x) for x in xs]
                    torch.cuda.synchronize()
                    for i, (a, b, c, ref) in enumerate(zip(first, again, late, refs)):
                        assert torch.equal(a, b), f"prefetch_step {step}, input {i}: call 2"
                        assert torch.equal(a, c), f"prefetch_step {step}, input {i}: late onloads"
                        torch.testing.assert_close(a, ref, atol=2.0, rtol=0.1)
                    assert off.submissions == 3 * 3 * 16 + step
                finally:
                    compiled = None
                    _dispose(model, off)
    finally:
        weights_mod._REGISTRY.pop(oid, None)
        torch._dynamo.reset()
