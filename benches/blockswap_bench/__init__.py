"""blockswap's benchmark suite (``python benches/suite.py``), beside the package, not in it.

Four sections, each beside the link's ceiling measured in the same run: a sweep of block size x
blocks per transfer x direction x path (:mod:`.sweep`), the offloading handler with real models'
KV-cache shapes (:mod:`.handlers`, :mod:`.models`), both directions at once (:mod:`.bidir`), and a
GEMM beside an onload (:mod:`.interference`). :mod:`.report` writes the tables, the JSON and the
plots; :mod:`.common` holds what every benchmark shares, with the pieces ``blockswap bench`` uses
too imported from :mod:`blockswap._bench` (the installed package imports nothing from here).
torch, triton and matplotlib are imported only where a section needs them: without a GPU the
suite runs on the host backend.
"""

from __future__ import annotations

from .context import SECTIONS, Profile, profile
from .suite import main, run_suite

__all__ = ["SECTIONS", "Profile", "main", "profile", "run_suite"]
