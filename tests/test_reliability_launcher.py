"""Reliability, 6. A Python kernel launcher: it runs inside a submission, while the engine holds
its submit lock. A call from it into its own engine is refused rather than deadlocked, and the
other threads' calls that do not need the lock (``wait``) are not held up by it; a second
``shutdown`` returns once the first has drained; a child forked while the lock was held can shut
its copy of the engine down."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from blockswap import Engine, WaitTimeoutError
from reliability_helpers import DEADLOCK, run_isolated

MiB = 1 << 20

# Every call a launcher could make into its own engine, each from the launcher of a transfer of
# its own; the transfer fails with the refusal, and the engine works afterwards.
REENTRY = """
import json
import numpy as np
import blockswap

eng = blockswap.Engine("host")
src = np.random.default_rng(3).integers(1, 256, 1 << 16, dtype=np.uint8)
dst = np.zeros(1 << 16, dtype=np.uint8)
spare = np.zeros(4096, dtype=np.uint8)
eng.register(src, kind="host")
eng.register(dst, kind="device")
eng.register(spare, kind="host")
s, d = src.ctypes.data, dst.ctypes.data
table = eng.register_table([s], [4096], [4096], 16, "host")
calls = {
    "wait": lambda job: eng.wait([job], timeout=5),
    "submit": lambda job: eng.submit(100 + job, [s], [d + 8192], [64]),
    "shutdown": lambda job: eng.shutdown(),
    "register": lambda job: eng.register(np.zeros(64, np.uint8)),
    "unregister": lambda job: eng.unregister(spare),
    "unregister_table": lambda job: eng.unregister_table(table),
    "alloc_host": lambda job: eng.alloc_host(64),
    "staged_row": lambda job: eng.staged_row(table),
    "choose_route": lambda job: blockswap._core.choose_route(
        "h2d", "auto", on_cuda=False, page_sizes=[4096], errors=(ValueError, ValueError),
        engine=eng, tables=[(table, table)]),
}
out = {}
for job, (name, call) in enumerate(calls.items(), start=1):
    seen = []

    def launcher(*args, call=call, job=job, seen=seen):
        try:
            call(job)
        except blockswap.BlockswapError as e:
            seen.append([type(e).__name__, str(e)])
            raise

    eng.submit(job, [s], [d], [4096], kernel_below=1 << 20, launcher=launcher)
    eng.wait([job], timeout=30)
    (r,) = eng.get_finished()
    out[name] = {"seen": seen, "result": [r.job_id, r.success, r.error]}
# the engine still works: every call refused above goes through now
eng.submit(50, [s], [d], [1 << 16])
eng.wait([50], timeout=30)
out["after"] = [[r.job_id, r.success] for r in eng.get_finished()]
out["bytes"] = bool(np.array_equal(src, dst))
eng.unregister_table(table)
eng.unregister(spare)
eng.shutdown()
print(json.dumps(out))
"""


def test_a_launcher_calling_into_its_own_engine_is_refused_not_deadlocked() -> None:
    out = run_isolated(REENTRY)
    for name in (
        "wait",
        "submit",
        "shutdown",
        "register",
        "unregister",
        "unregister_table",
        "alloc_host",
        "staged_row",
        "choose_route",
    ):
        (seen,) = out[name]["seen"]
        kind, msg = seen
        assert kind == "InvalidTransferError", (name, seen)
        assert msg.startswith(f"{name} called from inside this engine's kernel launcher"), msg
        _, ok, error = out[name]["result"]
        assert not ok and "from inside this engine's kernel launcher" in error, out[name]
    assert out["after"] == [[50, True]] and out["bytes"]


# Engine A's launcher submits to engine B with a launcher of its own, which calls back into A:
# A's submit lock is held by this very thread, one launcher further out.
NESTED = """
import json
import numpy as np
import blockswap

a, b = blockswap.Engine("host"), blockswap.Engine("host")
src = np.random.default_rng(4).integers(1, 256, 4096, dtype=np.uint8)
dst = [np.zeros(4096, dtype=np.uint8) for _ in range(2)]
for e, d in ((a, dst[0]), (b, dst[1])):
    e.register(src, kind="host")
    e.register(d, kind="device")
s = src.ctypes.data
seen = []

def launcher_b(*args):
    try:
        a.submit(99, [s], [dst[0].ctypes.data + 2048], [8])
    except blockswap.BlockswapError as e:
        seen.append([type(e).__name__, str(e)])
        raise

def launcher_a(*args):
    b.submit(2, [s], [dst[1].ctypes.data], [1024], kernel_below=1 << 20, launcher=launcher_b)

a.submit(1, [s], [dst[0].ctypes.data], [1024], kernel_below=1 << 20, launcher=launcher_a)
out = {"seen": seen}
for name, e, job in (("a", a, 1), ("b", b, 2)):
    e.wait([job], timeout=30)
    out[name] = [[r.job_id, r.success, r.error] for r in e.get_finished()]
a.submit(3, [s], [dst[0].ctypes.data], [4096])
a.wait([3], timeout=30)
out["after"] = [[r.job_id, r.success] for r in a.get_finished()]
out["bytes"] = bool(np.array_equal(src, dst[0]))
a.shutdown()
b.shutdown()
print(json.dumps(out))
"""


def test_a_launcher_reaching_its_engine_through_another_engines_launcher_is_refused() -> None:
    out = run_isolated(NESTED)
    ((kind, msg),) = out["seen"]
    assert kind == "InvalidTransferError"
    assert msg.startswith("submit called from inside this engine's kernel launcher"), msg
    # B's transfer fails with its launcher's error; A's (whose launcher only submitted) runs.
    ((job, ok, error),) = out["b"]
    assert (job, ok) == (2, False) and "from inside this engine's kernel launcher" in error
    assert out["a"] == [[1, True, None]]
    assert out["after"] == [[3, True]] and out["bytes"]


class _HeldLauncher:
    """A submission on another thread whose launcher holds the engine's submit lock until
    :meth:`release`."""

    def __init__(self, eng: Engine, src: np.ndarray, dst: np.ndarray, job: int) -> None:
        self.entered, self.go = threading.Event(), threading.Event()
        self.released_at = float("inf")

        def launcher(*args: Any) -> None:
            self.entered.set()
            # No timeout: held until `release`, longer than any join of the tests (a daemon
            # thread, should a test fail before it releases).
            self.go.wait()

        self.thread = threading.Thread(
            daemon=True,
            target=lambda: eng.submit(
                job,
                [src.ctypes.data],
                [dst.ctypes.data],
                [4096],
                kernel_below=1 << 20,
                launcher=launcher,
            ),
        )
        self.thread.start()
        assert self.entered.wait(DEADLOCK), "the launcher never ran"

    def release(self) -> None:
        self.released_at = time.monotonic()
        self.go.set()
        self.thread.join(DEADLOCK)
        assert not self.thread.is_alive()


def _engine() -> tuple[Engine, np.ndarray, np.ndarray]:
    eng = Engine("host")
    src = np.random.default_rng(4).integers(1, 256, MiB, dtype=np.uint8)
    dst = np.zeros(MiB, dtype=np.uint8)
    eng.register(src, kind="host")
    eng.register(dst, kind="device")
    return eng, src, dst


def test_wait_keeps_its_timeout_while_a_launcher_holds_the_submit_lock() -> None:
    eng, src, dst = _engine()
    held = _HeldLauncher(eng, src, dst, 1)
    try:
        got: list[Any] = []

        def wait() -> None:
            try:
                eng.wait([1], timeout=0.05)  # the launcher's own transfer: live, not done
                got.append("returned")
            except WaitTimeoutError as e:
                got.append(str(e))
            eng.wait([99], timeout=0.05)  # not live: returns at once
            got.append("unknown id")

        t = threading.Thread(target=wait)
        t.start()
        # It must return while the launcher still holds the lock: the lock is released only
        # after this join.
        t.join(DEADLOCK)
        assert not t.is_alive(), "wait queued behind the submit lock"
        assert len(got) == 2 and "1" in got[0] and got[1] == "unknown id", got
    finally:
        held.release()
    eng.wait([1], timeout=30)
    assert [(r.job_id, r.success) for r in eng.get_finished()] == [(1, True)]
    eng.shutdown()


def test_a_second_shutdown_returns_once_the_first_has_drained() -> None:
    eng, src, dst = _engine()
    held = _HeldLauncher(eng, src, dst, 1)
    ends: dict[str, float] = {}

    def shutdown(name: str) -> None:
        eng.shutdown()
        ends[name] = time.monotonic()

    ts = [threading.Thread(target=shutdown, args=(n,), daemon=True) for n in ("first", "second")]
    try:
        for t in ts:
            t.start()
            time.sleep(0.05)
        time.sleep(0.1)
    finally:
        held.release()
    for t in ts:
        t.join(DEADLOCK)
        assert not t.is_alive()
    # Neither returned while the launcher's transfer, accepted before either call, was not
    # yet issued: each returned after the drain.
    assert all(end >= held.released_at for end in ends.values()), ends
    assert [(r.job_id, r.success) for r in eng.get_finished()] == [(1, True)]
    assert eng.stats()["in_flight"] == 0


FORK_LOCKED = """
import json, os, threading, time
import numpy as np
import blockswap

eng = blockswap.Engine("host")
src = np.random.default_rng(5).integers(1, 256, 1 << 20, dtype=np.uint8)
dst = np.zeros(1 << 20, dtype=np.uint8)
spare = np.zeros(4096, dtype=np.uint8)
eng.register(src, kind="host")
eng.register(dst, kind="device")
eng.register(spare, kind="host")
table = eng.register_table([src.ctypes.data], [4096], [4096], 16, "host")
entered, go = threading.Event(), threading.Event()

def launcher(*args):
    entered.set()
    go.wait(120)

t = threading.Thread(target=lambda: eng.submit(
    1, [src.ctypes.data], [dst.ctypes.data], [4096], kernel_below=1 << 20, launcher=launcher))
t.start()
assert entered.wait(120)
# A registration waiting for that lock holds the engine's own registration lock meanwhile.
registering = threading.Thread(target=lambda: eng.register(np.zeros(4096, np.uint8)))
registering.start()
time.sleep(0.1)
r, w = os.pipe()
pid = os.fork()  # while the threads above hold the engine's submit and registration locks
if pid == 0:
    os.close(r)
    out = {}
    for name, call in {
        "unregister": lambda: eng.unregister(spare),
        "unregister_table": lambda: eng.unregister_table(table),
        "staged_row": lambda: eng.staged_row(table),
        "free_host": lambda: eng.free_host(spare),
    }.items():
        try:
            call()
            out[name] = "accepted"
        except blockswap.BlockswapError as e:
            out[name] = [type(e).__name__, str(e)]
    eng.shutdown()  # the parent's transfers are not the child's to drain
    out["shut"] = eng.is_shut_down
    os.write(w, json.dumps(out).encode())
    os._exit(0)
os.close(w)
child = json.loads(os.read(r, 1 << 16).decode() or "{}")
_, status = os.waitpid(pid, 0)
go.set()
t.join()
registering.join()
eng.wait([1], timeout=30)
parent = [[x.job_id, x.success] for x in eng.get_finished()]
eng.shutdown()
print(json.dumps({"child": child, "status": status, "parent": parent}))
"""


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork() with threads running
def test_a_child_forked_under_the_submit_lock_shuts_its_copy_down() -> None:
    out = run_isolated(FORK_LOCKED)
    assert out["status"] == 0
    child = out["child"]
    for name in ("unregister", "unregister_table", "staged_row", "free_host"):
        kind, msg = child[name]
        assert kind == "BackendError" and "created in another process" in msg, (name, msg)
    assert child["shut"] is True
    assert out["parent"] == [[1, True]]


INTERRUPTED = """
import json, signal, time
import numpy as np
import blockswap

# Python's own Ctrl-C handler, where the process was started with SIGINT ignored (a background
# job): what an interactive session has.
signal.signal(signal.SIGINT, signal.default_int_handler)

eng = blockswap.Engine("host")
src = np.ones(4096, np.uint8)
dst = np.zeros(4096, np.uint8)
eng.register(src, kind="host")
eng.register(dst, kind="device")

def launcher(*args):
    raise KeyboardInterrupt  # Ctrl-C while the kernel is launched

out = {"interrupted": False}
try:
    eng.submit(1, [src.ctypes.data], [dst.ctypes.data], [64], kernel_below=1 << 20,
               launcher=launcher)
    for _ in range(100):  # the interrupt is raised at the next check for signals
        time.sleep(0.01)
except KeyboardInterrupt:
    out["interrupted"] = True
eng.wait([1], timeout=30)
(r,) = eng.get_finished()
out["result"] = [r.job_id, r.success, r.error]
eng.shutdown()
print(json.dumps(out))
"""


def test_a_ctrl_c_in_a_launcher_fails_its_transfer_and_still_interrupts() -> None:
    out = run_isolated(INTERRUPTED)
    assert out["interrupted"], "the KeyboardInterrupt was swallowed"
    job, ok, error = out["result"]
    assert (job, ok) == (1, False) and "KeyboardInterrupt" in error, out
