"""Custom ops (torch.compile) and the forward wrapper."""

from __future__ import annotations

import itertools
from typing import Any, Protocol

import torch

from .errors import OffloaderStateError


class _Wrapped(Protocol):
    """What the wrappers call on a registered offloader (a ``PrefetchOffloader``)."""

    def _pre(self, k: int) -> None: ...

    def _post(self, k: int) -> None: ...


_REGISTRY: dict[int, _Wrapped] = {}
_IDS = itertools.count(1)


def _lookup(oid: int) -> _Wrapped:
    off = _REGISTRY.get(oid)
    if off is None:
        raise OffloaderStateError(f"blockswap weight offloader #{oid} is closed")
    return off


@torch.library.custom_op("blockswap::offload_wait", mutates_args=("x",))
def _offload_wait(x: torch.Tensor, offloader: int, layer: int) -> None:
    """Waits for offloaded layer ``layer``'s weights (``x``, its input, is declared mutated so
    that the compiler keeps the layer's kernels after this op)."""
    del x
    _lookup(offloader)._pre(layer)


@_offload_wait.register_fake
def _offload_wait_fake(x: torch.Tensor, offloader: int, layer: int) -> None:
    del x, offloader, layer


@torch.library.custom_op("blockswap::offload_done", mutates_args=("x",))
def _offload_done(x: torch.Tensor, offloader: int, layer: int) -> None:
    """Layer ``layer`` has been issued: release its slot and start the next onload into it
    (``x``, its output, is declared mutated so that the compiler keeps this op after the
    layer's kernels and before the next layer's)."""
    del x
    _lookup(offloader)._post(layer)


@_offload_done.register_fake
def _offload_done_fake(x: torch.Tensor, offloader: int, layer: int) -> None:
    del x, offloader, layer


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for v in value:
            if isinstance(v, torch.Tensor):
                return v
    if isinstance(value, dict):
        for v in value.values():
            if isinstance(v, torch.Tensor):
                return v
    return None


def _make_forward(orig: Any, oid: int, k: int) -> Any:
    """The offloaded layer's forward: wait for its weights, run it, release its slot.

    Installed as the module's instance attribute ``forward`` rather than as forward hooks:
    Dynamo does not guard on module hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``
    is True by default), so code compiled before hooks were added would silently run without
    them; an instance ``forward`` is guarded on.
    """

    def forward(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            x = _first_tensor(args)
            if x is None:
                x = _first_tensor(kwargs)
            if x is None:
                raise OffloaderStateError(
                    "an offloaded layer compiled with torch.compile needs a tensor argument "
                    "(its input orders the weight wait)"
                )
            torch.ops.blockswap.offload_wait(x, oid, k)
            out = orig(*args, **kwargs)
            y = _first_tensor(out)
            if y is None:
                raise OffloaderStateError(
                    "an offloaded layer compiled with torch.compile must return a tensor (its "
                    "output orders the next prefetch)"
                )
            torch.ops.blockswap.offload_done(y, oid, k)
            return out
        off = _lookup(oid)
        off._pre(k)
        out = orig(*args, **kwargs)
        off._post(k)
        return out

    return forward
