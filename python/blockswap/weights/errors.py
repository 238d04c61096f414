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
