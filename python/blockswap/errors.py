"""Every error blockswap raises, in one hierarchy: each is a :class:`BlockswapError` (but for
the block-id helpers of :mod:`blockswap.layout`, which raise Python's own, as their docstrings
say).

Errors of a bad argument keep the builtin kind as a second base, so ``except ValueError`` and
``except TypeError`` written for Python's own errors still catch them:

* :class:`ConfigError` (a ``ValueError``): an argument or option whose value is refused when
  something is built (a handler, a pinned buffer, the vLLM plug-in's ``kv_connector_extra_config``).
  :class:`~blockswap.layout.LayoutError` is one: tensors that do not fit their layout.
* :class:`ConfigTypeError` (a ``TypeError``): an argument of the wrong type when something is
  built.
* :class:`~blockswap.InvalidTransferError`: a transfer or an engine call refused before anything
  was issued (:class:`~blockswap.ArgumentTypeError`, a ``TypeError`` too, for a wrong type).
* :class:`~blockswap.PoolExhaustedError`, :class:`~blockswap.BackendError`,
  :class:`~blockswap.ShutdownError`, :class:`~blockswap.WaitTimeoutError`: from the core.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar, cast

from ._core import ArgumentTypeError, BlockswapError, InvalidTransferError

__all__ = ["BlockswapError", "ConfigError", "ConfigTypeError", "refuses_with_config_errors"]


class ConfigError(BlockswapError, ValueError):
    """An argument or option with a value blockswap refuses when something is built; raised before
    anything is allocated where the value alone decides."""


class ConfigTypeError(BlockswapError, TypeError):
    """An argument of the wrong type when something is built."""


_F = TypeVar("_F", bound=Callable[..., Any])


def refuses_with_config_errors(fn: _F) -> _F:
    """A public constructor's guard: a ``TypeError`` or ``ValueError`` that is not a
    :class:`BlockswapError` yet (one torch or numpy raised deep in the build over an argument no
    check foresaw: a dict where a list was meant, a count past what torch takes), and an
    argument the engine refused while it was built (an
    :class:`~blockswap.InvalidTransferError`: an engine option out of its limits, a row count
    of 0), leave as a :class:`ConfigTypeError` / :class:`ConfigError` with the constructor's
    name and the same message, the original chained. The checks in the constructors name the
    argument; this makes the rule hold for the rest."""
    what = fn.__qualname__.removesuffix(".__init__")

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (ConfigError, ConfigTypeError):
            raise
        except ArgumentTypeError as e:
            raise ConfigTypeError(f"{what}: {e}") from e
        except InvalidTransferError as e:
            raise ConfigError(f"{what}: {e}") from e
        except BlockswapError:
            raise
        except TypeError as e:
            raise ConfigTypeError(f"{what}: {e}") from e
        except ValueError as e:
            raise ConfigError(f"{what}: {e}") from e

    return cast("_F", guarded)
