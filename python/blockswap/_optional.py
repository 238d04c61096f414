"""The optional dependencies: torch and triton (``pip install 'blockswap[torch]'``).

``import blockswap`` and the engine need numpy only; the modules that need torch (``handler``,
``layout``, ``weights``, ``kernels``) import it through :func:`missing`, so that a machine
without it gets the install command rather than a bare ``No module named 'torch'``.
"""

from __future__ import annotations

from typing import NoReturn

# The packages the "torch" extra installs.
_EXTRA = {"torch": "torch", "triton": "torch"}


def missing(error: ModuleNotFoundError, importer: str) -> NoReturn:
    """Raises the error for ``importer`` failing to import a module with ``error``: the install
    command where the missing module is an optional dependency, ``error`` itself otherwise (a
    broken installation, a missing dependency of torch)."""
    top = (error.name or "").partition(".")[0]
    extra = _EXTRA.get(top)
    if extra is None:
        raise error
    raise ModuleNotFoundError(
        f"{importer} needs {top}, which is not installed: pip install 'blockswap[{extra}]'",
        name=error.name,
    ) from error
