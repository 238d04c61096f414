"""What the vLLM worker's ``wait`` and ``get_finished`` call: only the handlers holding jobs in
flight. vLLM polls every step and waits for its expedited loads before the step that needs them;
a call into a handler with nothing of the jobs' costs the caller a call into the core, and a
wait on the other handler would come after the jobs' own (host backend)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed")

from blockswap.vllm import BlockswapOffloadingWorker
from test_vllm import BPC, N_CHUNKS, CPULoadStoreSpec, caches, spec_of


def recorded(handlers: Any, calls: list[tuple[str, Any]], name: str) -> None:
    """Records every ``wait`` and ``get_finished`` of ``handlers`` in ``calls``, calling
    through: ``("<name> wait", the ids)`` and ``("<name> poll", None)``."""
    wait, poll = handlers.wait, handlers.get_finished

    def waited(ids: Any, timeout: float | None = None) -> None:
        calls.append((f"{name} wait", sorted(ids)))
        wait(ids, timeout)

    def polled() -> Any:
        calls.append((f"{name} poll", None))
        return poll()

    handlers.wait, handlers.get_finished = waited, polled


def test_wait_and_get_finished_call_only_the_handlers_holding_jobs() -> None:
    kv, ts = caches()
    w = BlockswapOffloadingWorker(kv, BPC, N_CHUNKS, backend="host")
    calls: list[tuple[str, Any]] = []
    try:
        main, expedited = w.handlers
        recorded(main, calls, "main")
        recorded(expedited, calls, "expedited")
        spec = spec_of([[4], [], []], [0, 0, 0])
        # Nothing in flight: no handler is polled, and unknown ids are not waited for.
        assert w.get_finished() == []
        w.wait({7})
        assert calls == []
        assert w.submit_store(1, spec, CPULoadStoreSpec([2])) is True
        w.wait({1, 7})
        assert calls == [("main wait", [1])]
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True)]
        assert calls[1:] == [("main poll", None)]
        del calls[:]
        # An expedited load: its own handler only, the main one has nothing in flight.
        before = ts[0][4].clone()
        ts[0][5].zero_()
        load = spec_of([[5], [], []], [0, 0, 0])
        assert w.submit_load(2, CPULoadStoreSpec([2]), load, expedited=True) is True
        w.wait({2})
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(2, True)]
        assert calls == [("expedited wait", [2]), ("expedited poll", None)]
        assert ts[0][5][:192].equal(before[:192])
        del calls[:]
        # Both in flight: each waited for where it runs, both polled until reported.
        assert w.submit_store(3, spec, CPULoadStoreSpec([3])) is True
        assert w.submit_load(4, CPULoadStoreSpec([2]), load, expedited=True) is True
        w.wait({3, 4})
        assert sorted(c for c in calls if c[0].endswith("wait")) == [
            ("expedited wait", [4]),
            ("main wait", [3]),
        ]
        assert sorted(r.job_id for r in w.get_finished()) == [3, 4]
        assert {c for c in calls if c[0].endswith("poll")} == {
            ("main poll", None),
            ("expedited poll", None),
        }
        # An empty job rides behind the jobs of its lane, or is reported by the next poll.
        del calls[:]
        empty = spec_of([[], [], []], [0, 0, 0])
        assert w.submit_store(5, empty, CPULoadStoreSpec([])) is True
        w.wait({5})
        assert [(r.job_id, r.success, r.transfer_size) for r in w.get_finished()] == [(5, True, 0)]
        assert calls == []
    finally:
        w.shutdown()
