"""Weight offloading (blockswap.weights): selection and slots."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from blockswap.weights import PrefetchOffloader, matches_segment, select_layers
from weights_helpers import OFFLOAD, make_stack


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
