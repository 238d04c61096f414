"""Mistakes a user makes with blockswap's API, each of which ``mypy --strict`` must report:
every line marked ``# planted: <error code>`` must get that error, and no other line any
(``tests/typing/check_planted.py`` runs it; ``make lint`` calls that). Never run, never collected
by pytest."""

from __future__ import annotations

import numpy as np
import torch

import blockswap
from blockswap.handler import CpuGpuHandlers
from blockswap.hostmem import PinnedRows
from blockswap.layout import make_block_major_cpu_cache
from blockswap.weights import create_offloader

caches = [torch.zeros(2, 8, 4, 2, 8) for _ in range(2)]
ids = np.arange(3, dtype=np.int64)

# ---- the offloading handler ------------------------------------------------------------------
CpuGpuHandlers(caches, 8, layout="flash")  # planted: arg-type
CpuGpuHandlers(caches, 8, layout="kv_split", backend="gpu")  # planted: arg-type
CpuGpuHandlers(caches, 8, layout="kv_split", path="fast")  # planted: arg-type
CpuGpuHandlers(caches, 8, layout="kv_split", cpu_layout="rows")  # planted: arg-type
CpuGpuHandlers(caches, "8", layout="kv_split")  # planted: arg-type
h = CpuGpuHandlers(caches, 8, layout="kv_split", path="staged", backend="host")
h.d2h.transfer_async(1, 5)  # planted: arg-type
h.d2h.transfer_async(1, ids)  # planted: arg-type
h.d2h.transfer_async("1", (ids, ids))  # planted: arg-type
h.d2h.transfer_async(1, (ids, ids), block_indices=0)  # planted: arg-type
h.wait(1)  # planted: arg-type
n: int = h.stats()["d2h"]["transfer"]  # planted: typeddict-item
done: bool = h.d2h.transfer_async(2, ([0, 1], [2, 3]))  # correct: no error
for r in h.get_finished():
    ok: int = r.succes  # planted: attr-defined

# ---- the engine, pinned memory, the CPU-cache makers, weights ---------------------------------
blockswap.Engine("gpu")  # planted: arg-type
blockswap.Engine("host", copy_path="fast")  # planted: arg-type
blockswap.Engine("host", max_in_flight="8")  # planted: arg-type
eng = blockswap.Engine("host")
eng.register(caches[0], kind="gpu")  # planted: arg-type
eng.submit(1, ids, ids, ids, "host_to_device")  # planted: arg-type
PinnedRows(4, 4096, backend="gpu")  # planted: arg-type
make_block_major_cpu_cache(caches, 8, layout="fused")  # planted: arg-type
create_offloader("prefetchh")  # planted: arg-type
