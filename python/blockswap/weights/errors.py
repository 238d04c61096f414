"""The errors of weight offloading (every one a :class:`~blockswap.BlockswapError`)."""

from __future__ import annotations

from .._core import BlockswapError


class OffloadConfigError(BlockswapError, ValueError):
    """A configuration the offloader refuses (raised before the model is changed)."""


class OffloadDeviceError(OffloadConfigError):
    """Tensors on the wrong device, or a device the offloader cannot use."""


class WeightTransferError(BlockswapError):
    """An onload of a layer's weights failed; the layer's slot holds unknown data."""
