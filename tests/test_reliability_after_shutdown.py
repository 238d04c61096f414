"""Reliability: calls after shutdown; calls from a forked child."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from blockswap import InvalidTransferError, ShutdownError
from reliability_helpers import BAD, BEFORE, HandlerScene, KiB, MiB, Scene, run_isolated


def test_every_engine_entry_point_after_shutdown() -> None:
    sc = Scene()
    eng, s, d = sc.eng, sc.s, sc.d
    buf = eng.alloc_host(64 * KiB)
    eng.submit(BEFORE, [s], [d], [MiB // 2], "h2d")  # in flight at shutdown
    eng.shutdown()
    refused: list[tuple[str, Callable[[], Any]]] = [
        ("submit", lambda: eng.submit(BAD, [s], [d], [8])),
        ("submit of a bad batch", lambda: eng.submit(BAD, [s], [d], [-8])),
        ("submit_blocks", lambda: eng.submit_blocks(BAD, 0, [0], 1, [0])),
        ("register", lambda: eng.register(np.zeros(8, np.uint8))),
        ("pin", lambda: eng.pin(np.zeros(8, np.uint8))),
        ("alloc_host", lambda: eng.alloc_host(8)),
        ("register_table", lambda: eng.register_table([s], [64], [64], 1, "host")),
    ]
    for name, call in refused:
        with pytest.raises(ShutdownError, match="the engine is shut down"):
            call()
        assert name
    # what still works: results, waiting, statistics, releasing memory, shutting down again
    assert [(r.job_id, r.success, r.bytes) for r in eng.get_finished()] == [
        (BEFORE, True, MiB // 2)
    ]
    assert np.array_equal(sc.dst[: MiB // 2], sc.src[: MiB // 2])
    eng.wait([BEFORE, BAD])
    assert eng.get_finished() == []
    assert eng.stats()["in_flight"] == 0 and eng.info()["backend"] == "host"
    eng.unregister_table(sc.dev_table)
    eng.unregister(sc.dst)
    eng.free_host(buf)
    with pytest.raises(InvalidTransferError, match="no registered region"):
        eng.free_host(buf)  # freed exactly once
    eng.shutdown()
    with eng:
        pass
    assert eng.is_shut_down


def test_handler_after_shutdown() -> None:
    sc = HandlerScene.make(4, False)
    h = sc.h
    h.d2h.transfer_async(BEFORE, ([0, 1, 2, 3], [1]))
    h.shutdown()
    for call in (
        lambda: h.d2h.transfer_async(BAD, ([0], [0])),
        lambda: h.h2d.transfer_async(BAD, ([0], [0])),
        lambda: h.cpu_caches,
        lambda: h.gpu_caches,
    ):
        with pytest.raises(ShutdownError, match="shut down"):
            call()
    assert [(r.job_id, r.success) for r in h.get_finished()] == [(BEFORE, True)]
    h.wait([BEFORE])
    assert h.stats()["d2h"]["transfers"] == 1
    h.shutdown()


FORK_CHILD = """
import json, os, gc
import numpy as np
import blockswap
from blockswap import Engine

eng = Engine("host")
src = np.random.default_rng(1).integers(1, 256, 1 << 20, dtype=np.uint8)
dst = np.zeros(1 << 20, dtype=np.uint8)
eng.register(src, kind="host")
eng.register(dst, kind="device")
s, d = src.ctypes.data, dst.ctypes.data
t_src = eng.register_table([s], [4096], [4096], 16, "host")
t_dst = eng.register_table([d + (1 << 19)], [4096], [4096], 16, "device")
eng.submit(1, [s], [d], [1 << 18], "h2d")  # before the fork, maybe in flight across it
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    out = {}
    calls = {
        "submit": lambda: eng.submit(2, [s], [d + 300000], [8]),
        "submit_blocks": lambda: eng.submit_blocks(2, t_src, [0], t_dst, [0]),
        "wait": lambda: eng.wait([1]),
        "unregister": lambda: eng.unregister(src),
        "unregister_table": lambda: eng.unregister_table(t_src),
        "register": lambda: eng.register(np.zeros(8, np.uint8)),
        "register_table": lambda: eng.register_table([s], [64], [64], 1, "host"),
        "alloc_host": lambda: eng.alloc_host(64),
    }
    for name, call in calls.items():
        try:
            call()
            out[name] = "accepted"
        except blockswap.BlockswapError as e:
            out[name] = [type(e).__name__, str(e)]
    out["polled"] = [r.job_id for r in eng.get_finished()]  # the parent's transfers
    # a new engine made in the child works
    e2 = Engine("host")
    a = np.arange(4096, dtype=np.uint8)
    b = np.zeros(4096, dtype=np.uint8)
    e2.register(a, kind="host")
    e2.register(b, kind="device")
    e2.submit(5, [a.ctypes.data], [b.ctypes.data], [4096])
    e2.wait([5])
    out["new_engine"] = [[r.job_id, r.success] for r in e2.get_finished()]
    out["new_engine_bytes"] = bool(np.array_equal(a, b))
    e2.shutdown()
    # the parent's engine can be dropped here without touching the parent's worker thread
    eng.shutdown()
    del eng
    gc.collect()
    out["dropped"] = True
    os.write(w, json.dumps(out).encode())
    os._exit(0)
os.close(w)
child = json.loads(os.read(r, 1 << 16).decode())
_, status = os.waitpid(pid, 0)
eng.submit(2, [s + (1 << 18)], [d + (1 << 18)], [1 << 18], "h2d")  # after the fork
eng.wait([1, 2])
res = sorted([r.job_id, r.success] for r in eng.get_finished())
ok = bool(np.array_equal(dst[: 1 << 19], src[: 1 << 19])) and not dst[1 << 19 :].any()
eng.shutdown()
print(json.dumps({"child": child, "status": status, "parent": res, "parent_bytes": ok}))
"""


def test_calls_from_a_forked_child() -> None:
    out = run_isolated(FORK_CHILD)
    child = out["child"]
    assert out["status"] == 0
    for name in (
        "submit",
        "submit_blocks",
        "wait",
        "unregister",
        "unregister_table",
        "register",
        "register_table",
        "alloc_host",
    ):
        kind, msg = child[name]
        assert kind == "BackendError", (name, child[name])
        assert "created in another process" in msg and "create a new engine in the child" in msg
    assert child["polled"] == []
    assert child["new_engine"] == [[5, True]] and child["new_engine_bytes"]
    assert child["dropped"]
    # the parent: the transfer before the fork and the one after it, once each, every byte
    assert out["parent"] == [[1, True], [2, True]]
    assert out["parent_bytes"]


FORK_UNDER_THE_HOST_BUFFER_TABLE = r"""
import json, os, signal, threading, time
import blockswap
from blockswap import _core
from blockswap.hostmem import PinnedRows

statuses = []
for _ in range(3):
    # Another thread holds the process-wide table of host buffers while this one forks, as an
    # engine registering in a buffer of many pieces holds it.
    t = threading.Thread(target=_core.hold_host_buffer_table, args=(0.5,))
    t.start()
    time.sleep(0.1)
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)  # a child that hangs dies of SIGALRM
        q = PinnedRows(2, 4096, backend="host", log_line=False)
        e = blockswap.Engine("host")
        e.register(q.array)
        e.unregister(q.array)
        e.shutdown()
        q.unpin()
        os._exit(0)
    statuses.append(os.waitpid(pid, 0)[1])
    t.join()
print(json.dumps({"statuses": statuses}))
"""


def test_a_child_forked_while_the_host_buffer_table_is_held_does_not_hang() -> None:
    """A fork while another thread holds the process-wide table of host buffers (an engine
    registering in a pinned buffer of many pieces): the child makes its own table, and its own
    buffers and engines work; before, it waited for the parent's lock forever (here: killed by
    its alarm after 20 s)."""
    out = run_isolated(FORK_UNDER_THE_HOST_BUFFER_TABLE)
    assert out["statuses"] == [0] * 3, out
