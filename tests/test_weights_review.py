"""Weight offloading (blockswap.weights): what a review of the prefetcher found, each case
reproduced before its fix (host test mode)."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from blockswap import BlockswapError
from blockswap.weights import (
    OffloadConfigError,
    PrefetchOffloader,
    WeightTransferError,
)
from reliability_helpers import run_isolated
from weights_helpers import OFFLOAD, Stack, assert_untouched, make_stack, snapshot

# A view of a zero-copy weight kept past close(), then memory allocated over what close() used
# to free: the view must still read the weight (it segfaulted, reading freed memory).
ZERO_COPY_VIEW = """
import gc, json, sys
import torch
sys.path.insert(0, "tests")
from weights_helpers import make_stack, OFFLOAD
from blockswap.weights import ZeroCopyOffloader

model = make_stack(4, hidden=256, inter=512)
ref = model.layers[0].w2_weight.detach().clone()
off = ZeroCopyOffloader(model.layers, params=OFFLOAD)
held = model.layers[0].w2_weight.detach()  # a view a cache kept
inside = off._host.data_ptr() <= held.data_ptr() < off._host.data_ptr() + off.host_bytes
off.close()
del off
gc.collect()
junk = [torch.full((256 * 512,), 7.0) for _ in range(50)]
print(json.dumps({"inside": bool(inside), "equal": bool(torch.equal(held, ref))}))
"""


def test_a_zero_copy_weight_viewed_after_close_still_reads_its_bytes() -> None:
    out = run_isolated(ZERO_COPY_VIEW)
    assert out == {"inside": True, "equal": True}


def test_refused_first_onloads_leave_the_model_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """The construction's first onloads come after the parameters are repointed and the forwards
    wrapped: where they are refused, all of it is undone, and the model runs as before."""
    model = make_stack(6)
    snap = snapshot(model)
    originals = [p for p in model.parameters()]
    calls: list[int] = []

    def refused(self: PrefetchOffloader, j: int, after: int | None) -> None:
        calls.append(j)
        raise BlockswapError("the engine refused the onload")

    monkeypatch.setattr(PrefetchOffloader, "_onload", refused)
    with pytest.raises(BlockswapError, match="refused the onload"):
        PrefetchOffloader(model.layers, group_size=2, num_in_group=1, prefetch_step=2)
    assert calls == [0]
    assert_untouched(model, snap)
    assert [p for p in model.parameters()] == originals
    assert all("forward" not in layer.__dict__ for layer in model.layers)
    # Offloadable again: nothing of the refused offloader stayed registered.
    monkeypatch.undo()
    off = PrefetchOffloader(model.layers, group_size=2, num_in_group=1, prefetch_step=2)
    off.close()


@pytest.mark.parametrize(
    ("options", "exc", "match"),
    [
        ({"max_in_flight": 2}, OffloadConfigError, r"max_in_flight \(2\) must be more than"),
        ({"pool_bytes": 10}, OffloadConfigError, "engine_options: pool_bytes must be an int"),
        ({"max_in_flight": "x"}, TypeError, "max_in_flight must be an int, not 'x'"),
        ({"no_such_option": 1}, TypeError, "no_such_option"),
    ],
)
def test_engine_options_are_refused_as_configuration(
    options: dict[str, Any], exc: type[Exception], match: str
) -> None:
    model = make_stack(6)
    snap = snapshot(model)
    with pytest.raises(exc, match=match) as info:
        PrefetchOffloader(model.layers, group_size=2, num_in_group=1, prefetch_step=2,
                          engine_options=options)  # fmt: skip
    assert isinstance(info.value, BlockswapError)
    assert_untouched(model, snap)


def test_a_quantized_parameter_is_refused_by_name() -> None:
    class Quantized(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            with warnings.catch_warnings():  # torch deprecates its quantized tensors
                warnings.simplefilter("ignore")
                w = torch.quantize_per_tensor(torch.randn(8), 0.1, 0, torch.qint8)
            self.w = nn.Parameter(w, requires_grad=False)

    layers = nn.ModuleList([Quantized(), Quantized()])
    with pytest.raises(OffloadConfigError, match=r"layers\[0\]\.w is a quantized tensor"):
        PrefetchOffloader(layers)


def test_a_failed_onload_refuses_every_forward_until_reset(x: torch.Tensor) -> None:
    """A failure raised at a forward's last layer (as on CUDA, where a failed onload is seen
    only when results are next collected) leaves slots of unknown content: the next forward is
    refused, not run on them, until reset()."""
    model = make_stack(8)
    resident = copy.deepcopy(model)
    off = PrefetchOffloader(model.layers, group_size=2, num_in_group=1, prefetch_step=2)
    try:
        off._sync.is_cuda = True  # results collected as on CUDA: not in each layer's wait
        with torch.no_grad():
            assert torch.equal(model(x), resident(x))
            off.engine.inject_failures(1)
            with pytest.raises(WeightTransferError, match="failed"):
                for _ in range(3):
                    model(x)
            with pytest.raises(WeightTransferError, match="call reset"):
                model(x)
            off.reset()
            assert torch.equal(model(x), resident(x))
    finally:
        off.close()


def test_synchronous_mode_reports_a_failed_copy_in_its_own_forward(x: torch.Tensor) -> None:
    """synchronous=True with results collected as on CUDA: a failed copy of the last layer is
    raised by that forward (it returned wrong output, and the next forward blamed the layer)."""
    model = make_stack(4)
    off = PrefetchOffloader(model.layers, synchronous=True)
    try:
        off._sync.is_cuda = True
        h = x
        with torch.no_grad():
            for layer in model.layers[:-1]:
                h = layer(h)
            off.engine.inject_failures(1)
            with pytest.raises(WeightTransferError, match=r"offloaded layer 3 \(layers\[3\]\)"):
                model.layers[-1](h)
    finally:
        off.close()


def test_backward_through_offloaded_layers_raises_instead_of_wrong_gradients() -> None:
    """Slots are overwritten by the next layer that uses them: autograd's saved weights would be
    another layer's. Parameters that require grad are marked written at each onload, so a
    backward raises autograd's in-place error (it computed wrong gradients silently)."""
    torch.manual_seed(0)
    model: Stack = make_stack(4)
    for p in model.parameters():
        p.requires_grad_(True)
    off = PrefetchOffloader(model.layers, params=OFFLOAD, prefetch_step=1)
    try:
        x = torch.randn(2, 16, requires_grad=True)
        y = model(x).sum()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()
        # Inference is untouched.
        with torch.no_grad():
            model(x)
    finally:
        off.close()
