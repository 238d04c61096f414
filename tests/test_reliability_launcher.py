"""Reliability, 6. A Python kernel launcher: it runs inside a submission, while the engine holds
its submit lock. A call from it into its own engine, or into any other (whose launcher, on another
thread, may be calling into this one), that takes a submit lock or waits is refused rather than
deadlocked, and the other threads' calls that do not need the lock (``wait``) are not held up by it; a second
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
        assert msg.startswith(f"{name} called from inside a kernel launcher"), msg
        assert "a launcher may only launch its kernel" in msg, msg
        _, ok, error = out[name]["result"]
        assert not ok and "a launcher may only launch its kernel" in error, out[name]
    assert out["after"] == [[50, True]] and out["bytes"]


# Engine A's launcher calls into engine B: B's submit lock may be held by a thread in B's own
# launcher calling into A, whose lock this submission holds. Refused as a call into A itself is;
# B is left as it was.
OTHER = """
import json
import numpy as np
import blockswap

a, b = blockswap.Engine("host"), blockswap.Engine("host")
src = np.random.default_rng(4).integers(1, 256, 4096, dtype=np.uint8)
dst = [np.zeros(4096, dtype=np.uint8) for _ in range(2)]
for e, d in ((a, dst[0]), (b, dst[1])):
    e.register(src, kind="host")
    e.register(d, kind="device")
s, db = src.ctypes.data, dst[1].ctypes.data
calls = {
    "submit": lambda: b.submit(
        90, [s], [db], [1024], kernel_below=1 << 20, launcher=lambda *args: None),
    "wait": lambda: b.wait([90], timeout=5),
    "shutdown": lambda: b.shutdown(),
    "register": lambda: b.register(np.zeros(64, np.uint8)),
    "alloc_host": lambda: b.alloc_host(64),
}
out = {"in_launcher": []}
for job, (name, call) in enumerate(calls.items(), start=1):
    seen = []

    def launcher_a(*args, call=call, seen=seen):
        out["in_launcher"].append(blockswap._core.in_launcher())
        try:
            call()
        except blockswap.BlockswapError as e:
            seen.append([type(e).__name__, str(e)])
            raise

    a.submit(job, [s], [dst[0].ctypes.data], [1024], kernel_below=1 << 20, launcher=launcher_a)
    a.wait([job], timeout=30)
    (r,) = a.get_finished()
    out[name] = {"seen": seen, "result": [r.job_id, r.success, r.error]}
out["in_launcher"].append(blockswap._core.in_launcher())
out["b_before"] = [[r.job_id, r.success] for r in b.get_finished()]
for name, e, d, job in (("a", a, dst[0], 20), ("b", b, dst[1], 21)):
    e.submit(job, [s], [d.ctypes.data], [4096])
    e.wait([job], timeout=30)
    out[name] = [[r.job_id, r.success] for r in e.get_finished()]
out["bytes"] = all(bool(np.array_equal(src, d)) for d in dst)
a.shutdown()
b.shutdown()
print(json.dumps(out))
"""


def test_a_launcher_calling_into_another_engine_is_refused() -> None:
    out = run_isolated(OTHER)
    for name in ("submit", "wait", "shutdown", "register", "alloc_host"):
        ((kind, msg),) = out[name]["seen"]
        assert kind == "InvalidTransferError", (name, msg)
        assert msg.startswith(f"{name} called from inside a kernel launcher"), msg
        assert "a launcher may only launch its kernel" in msg, msg
        _, ok, error = out[name]["result"]
        assert not ok and "a launcher may only launch its kernel" in error, out[name]
    assert out["in_launcher"] == [True] * 5 + [False]
    # Nothing reached B from A's launchers; both engines work afterwards.
    assert out["b_before"] == []
    assert out["a"] == [[20, True]] and out["b"] == [[21, True]] and out["bytes"]


# Two engines, two threads: A's launcher submits to B while B's submits to A, each under its own
# engine's submit lock (a barrier makes sure both are there). Before the rule covered every
# engine, each waited for the other's lock forever.
ABBA = """
import json, os, threading
import numpy as np
import blockswap

def make(seed):
    e = blockswap.Engine("host")
    src = np.random.default_rng(seed).integers(1, 256, 1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    e.register(src, kind="host")
    e.register(dst, kind="device")
    return e, src, dst

(a, sa, da), (b, sb, db) = make(5), make(6)
barrier = threading.Barrier(2, timeout=30)
seen = {"a": [], "b": []}

def launcher(name, other, src, dst):
    def launch(*args):
        barrier.wait()  # both threads are in a launcher, under their own engine's lock
        try:
            other.submit(10, [src.ctypes.data], [dst.ctypes.data + 8192], [64])
        except blockswap.BlockswapError as e:
            seen[name].append([type(e).__name__, str(e)])
            raise
    return launch

def run(e, src, dst, launch):
    e.submit(1, [src.ctypes.data], [dst.ctypes.data], [4096], kernel_below=1 << 20,
             launcher=launch)

threads = [
    threading.Thread(target=run, args=(a, sa, da, launcher("a", b, sb, db)), daemon=True),
    threading.Thread(target=run, args=(b, sb, db, launcher("b", a, sa, da)), daemon=True),
]
for t in threads:
    t.start()
for t in threads:
    t.join(30)
out = {"hung": any(t.is_alive() for t in threads), "seen": seen}
if out["hung"]:
    print(json.dumps(out), flush=True)
    os._exit(0)  # the engines' locks are held forever: no shutdown
for name, e, src, dst in (("a", a, sa, da), ("b", b, sb, db)):
    e.wait([1], timeout=30)
    out[name] = [[r.job_id, r.success, r.error] for r in e.get_finished()]
    e.submit(2, [src.ctypes.data], [dst.ctypes.data], [1 << 16])
    e.wait([2], timeout=30)
    out[name] += [[r.job_id, r.success, r.error] for r in e.get_finished()]
    out[name + "_bytes"] = bool(np.array_equal(src, dst))
    e.shutdown()
print(json.dumps(out))
"""


def test_launchers_of_two_engines_calling_into_each_other_are_refused_not_deadlocked() -> None:
    out = run_isolated(ABBA, timeout=120)
    assert not out["hung"], "the launchers of two engines deadlocked on each other's lock"
    for name in ("a", "b"):
        ((kind, msg),) = out["seen"][name]
        assert kind == "InvalidTransferError"
        assert msg.startswith("submit called from inside a kernel launcher"), msg
        assert "a launcher may only launch its kernel" in msg, msg
        # The transfer whose launcher failed is reported failed with it; the engine works on.
        (job, ok, error), after = out[name]
        assert (job, ok) == (1, False) and "a launcher may only launch its kernel" in error
        assert after == [2, True, None] and out[name + "_bytes"]


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
