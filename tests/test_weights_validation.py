"""Weight offloading (blockswap.weights), validation: clear errors, model untouched."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import blockswap
from blockswap.weights import (
    OffloadConfigError,
    OffloadDeviceError,
    PrefetchOffloader,
    ZeroCopyOffloader,
)
from weights_helpers import OFFLOAD, Stack, SwiGLU, assert_untouched, make_stack, snapshot


def _bad_configs() -> list[tuple[str, dict[str, Any], type[Exception], str]]:
    return [
        ("num_in_group>group_size", {"group_size": 2, "num_in_group": 3}, OffloadConfigError, "num_in_group \\(3\\) is larger than group_size \\(2\\)"),
        ("group_size=0", {"group_size": 0}, OffloadConfigError, "group_size must be an int >= 1, not 0"),
        ("num_in_group=0", {"num_in_group": 0}, OffloadConfigError, "num_in_group must be an int >= 1, not 0"),
        ("group_size=bool", {"group_size": True}, OffloadConfigError, "group_size must be an int, not True"),
        ("prefetch_step=0", {"prefetch_step": 0}, OffloadConfigError, "prefetch_step must be an int >= 1, not 0"),
        ("prefetch_step=-1", {"prefetch_step": -1}, OffloadConfigError, "prefetch_step must be an int >= 1, not -1"),
        ("prefetch_step=2.0", {"prefetch_step": 2.0}, OffloadConfigError, "prefetch_step must be an int, not 2.0"),
        ("too many slots", {"group_size": 2, "num_in_group": 1, "prefetch_step": 4}, OffloadConfigError, "prefetch_step \\(4\\) is larger than the number of offloaded layers \\(3\\)"),
        ("unmatched segment", {"params": ["w13_weight", "w4_weight"]}, OffloadConfigError, "\\['w4_weight'\\] match no parameter"),
        ("partial segment", {"params": ["w13"]}, OffloadConfigError, "\\['w13'\\] match no parameter"),
        ("empty segment", {"params": [""]}, OffloadConfigError, "non-empty strings"),
        ("params=int", {"params": 5}, OffloadConfigError, "params must be a str or a list of parameter name segments, not int"),
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
        # What the engine refuses while the offloader is built is a ConfigError of it.
        with pytest.raises(blockswap.ConfigError, match="PrefetchOffloader: no room"):
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


class _Outer(nn.Module):
    """A layer whose parameters live in a submodule (``inner``)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def _run(mods: Any, x: torch.Tensor) -> torch.Tensor:
    for m in mods:
        x = m(x)
    return x


@pytest.mark.parametrize("outer_first", [True, False])
def test_a_parameter_offloaded_through_a_parent_or_a_submodule_is_refused(
    outer_first: bool,
) -> None:
    """A second offloader over the same parameters, reached through the layers' parents or
    their submodules, is refused (it copied from the first one's reused slots: weights lost
    for good); once the first is closed, the second takes them, and the weights come back."""
    model = make_stack(4)
    outer = nn.ModuleList([_Outer(layer) for layer in model.layers])
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    want = model(x)
    before = [p.detach().clone() for p in model.parameters()]
    first, second = (outer, model.layers) if outer_first else (model.layers, outer)
    off = PrefetchOffloader(first, prefetch_step=1)
    try:
        for make in (
            lambda: PrefetchOffloader(second, prefetch_step=1),
            lambda: ZeroCopyOffloader([second[2]]),
        ):
            with pytest.raises(OffloadConfigError, match=r"parameter .* is already offloaded"):
                make()
        assert torch.equal(_run(first, x), want)
    finally:
        off.close()
    again = ZeroCopyOffloader(second)
    try:
        assert torch.equal(_run(second, x), want)
    finally:
        again.close()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_a_layer_past_the_engines_descriptor_limit_is_refused_when_made() -> None:
    """Every layer's onload is checked against ``max_descriptors`` when the offloader is made,
    not only the first ``prefetch_step`` layers' (a later one failed every forward)."""
    model = make_stack(3)
    model.layers[2].extra = nn.Parameter(torch.ones(4), requires_grad=False)
    snap = snapshot(model)
    with pytest.raises(OffloadConfigError, match=r"onload is 4 copies .*max_descriptors=3"):
        PrefetchOffloader(model.layers, prefetch_step=1, engine_options={"max_descriptors": 3})
    assert_untouched(model, snap)


def test_max_in_flight_as_a_numpy_int_is_checked_as_an_int() -> None:
    model = make_stack(3)
    with pytest.raises(OffloadConfigError, match=r"max_in_flight \(1\) must be more than"):
        PrefetchOffloader(
            model.layers, prefetch_step=1, engine_options={"max_in_flight": np.int64(1)}
        )


def test_parameters_made_under_inference_mode_are_refused() -> None:
    """torch cannot point a parameter made under ``torch.inference_mode()`` at other memory
    (every later use raises): refused by name, the model as it was (torch's RuntimeError
    before)."""
    with torch.inference_mode():
        layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
    snap = snapshot(layers)
    for make in (
        lambda: PrefetchOffloader(layers, prefetch_step=1),
        lambda: ZeroCopyOffloader(layers),
    ):
        with pytest.raises(
            OffloadConfigError, match=r"parameter layers\[0\]\.weight was made under"
        ):
            make()
    assert_untouched(layers, snap)


def test_zero_copy_validation_untouched() -> None:
    model = make_stack(4)
    snap = snapshot(model)
    with pytest.raises(OffloadConfigError, match="larger than group_size"):
        ZeroCopyOffloader(model.layers, group_size=1, num_in_group=2)
    with pytest.raises(OffloadConfigError, match="match no parameter"):
        ZeroCopyOffloader(model.layers, params=["nope"])
    assert_untouched(model, snap)
