"""blockswap's log lines inside vLLM: where vLLM's own appear, in its format, at INFO.

Standalone, the library prints nothing: the ``blockswap`` logger has only a ``NullHandler``
(:mod:`blockswap`), so its lines go wherever the application's logging sends them and nowhere
without a configuration. vLLM, though, configures only its own ``vllm`` logger (a handler, its
format, ``VLLM_LOGGING_LEVEL``, no propagation), which would leave blockswap's lines (the CPU
cache's size and pinning time, the routes chosen, warnings) invisible in a vLLM server.

:func:`attach`, called when vLLM makes the plug-in's spec, gives the ``blockswap`` logger one
handler that hands each record to the ``vllm`` logger: vLLM's handlers then format and write it as
one of vLLM's own, at vLLM's level (``VLLM_LOGGING_LEVEL=WARNING`` hides blockswap's INFO lines
too), whatever vLLM's logging configuration is when the line is logged (vLLM configures logging in
each process it starts, after imports; the ``vllm`` logger is looked up per record, so a later
``dictConfig`` is followed). A ``blockswap`` logger the application configured itself (a handler
other than the ``NullHandler``, or a level) is left alone.
"""

from __future__ import annotations

import logging

__all__ = ["attach"]

PACKAGE = "blockswap"
VLLM = "vllm"


class ToVllm(logging.Handler):
    """Hands each record to vLLM's ``vllm`` logger (its handlers, format and level)."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger(VLLM)
        if target.isEnabledFor(record.levelno):
            target.handle(record)


def attach() -> bool:
    """Sends the ``blockswap`` logger's records through vLLM's logging at INFO (see the module's
    documentation); returns whether it did (False: already attached, or configured by the
    application)."""
    log = logging.getLogger(PACKAGE)
    if any(isinstance(h, ToVllm) for h in log.handlers):
        return False
    if log.level != logging.NOTSET or any(
        not isinstance(h, logging.NullHandler) for h in log.handlers
    ):
        return False
    log.addHandler(ToVllm())
    log.setLevel(logging.INFO)
    # vLLM's own loggers do not propagate: neither do blockswap's here (no second copy through a
    # root handler).
    log.propagate = False
    return True
