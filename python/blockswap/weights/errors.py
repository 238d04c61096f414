"""The errors of weight offloading (every one a :class:`~blockswap.BlockswapError`)."""

from __future__ import annotations

from .._core import BlockswapError
from ..errors import ConfigError


class OffloadConfigError(ConfigError):
    """A configuration the offloader refuses, an argument of the wrong type included (raised
    before the model is changed); a :class:`~blockswap.ConfigError`, so a ``ValueError``."""


class OffloadDeviceError(OffloadConfigError):
    """Tensors on the wrong device, or a device the offloader cannot use."""


class WeightTransferError(BlockswapError):
    """An onload of a layer's weights failed; the layer's slot holds unknown data."""


class OffloaderStateError(BlockswapError, RuntimeError):
    """An offloader used where its state cannot serve the call: closed, its layers run out of
    the order it prefetches them in, a layer run before it was loaded, ``reset()`` inside a CUDA
    graph capture, a compiled layer without a tensor to order its weights by. Nothing was
    onloaded for the call; a ``RuntimeError`` too."""
