"""What the weight offloading tests (``tests/test_weights_*.py``, blockswap.weights) share: the
model, a SwiGLU MLP stack (residual, then RMS norm at the end of each layer), parameter
snapshots, and the check of a trace's slots.

Without a GPU the offloaders run in their host test mode (``Engine("host")``, CPU tensors as
slots, host stand-ins for streams and events): selection, slot assignment, validation, hook
order, one batched submission per layer, emulated capture rules, torch.compile. The ``cuda``
tests check bit-identical outputs of a 32-layer bf16 SwiGLU stack on the GPU in eager,
CUDA-graph and torch.compile modes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from blockswap.weights import PrefetchOffloader

OFFLOAD = ["w13_weight", "w2_weight"]


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
