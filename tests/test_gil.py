"""No binding waits for the engine lock, or for the process-wide host-buffer table's, while
holding the GIL.

A submit whose small descriptors go to a Python launcher holds the engine lock while it waits for
the lane's earlier copies and then calls the launcher, which needs the GIL. A binding that took the
engine lock with the GIL held would wait for that submit while the submit waits for it: a deadlock
(reproduced with ``register`` before the bindings released the GIL). Each case runs in a child
process with a time limit, so a deadlock fails the test instead of hanging the run.

The host-buffer table's lock is held by an unpin across the driver's unlock of every piece
(seconds, for a large buffer on CUDA): ``HostBuffer.users`` and ``.pinned``, and the drops of a
``HostBuffer`` and of an ``Engine`` (which take that lock), wait for it with the GIL released, so
that another Python thread keeps running meanwhile.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from blockswap import Engine, _core

SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    import numpy as np
    import blockswap

    call = sys.argv[1]
    eng = blockswap.Engine("host")
    big = 256 << 20
    src, dst = np.ones(big, np.uint8), np.zeros(big, np.uint8)
    eng.register(src, kind="host")
    eng.register(dst, kind="device")
    spare = np.zeros(1 << 16, np.uint8)
    if call in ("unregister", "unregister_table"):
        eng.register(spare, kind="host")
    table = eng.register_table([spare.ctypes.data], [4096], [4096], 16, "host") if call == (
        "unregister_table") else None
    # Block tables over the big buffers, for the calls that name tables.
    s0, d0 = src.ctypes.data, dst.ctypes.data
    host_t = eng.register_table([s0, s0 + 4096], [8192, 8192], [4096, 4096], 16, "host")
    dev_t = eng.register_table([d0, d0 + 16 * 4096], [4096, 4096], [4096, 4096], 16, "device")
    ids = np.arange(4, dtype=np.int64)
    # One large copy keeps the host lane busy...
    eng.submit(1, [src.ctypes.data], [dst.ctypes.data], [big])
    entered = threading.Event()

    def launcher(*args):
        entered.set()

    # ...so this submit holds the engine lock, waiting for it, then calls the Python launcher.
    submitting = threading.Event()

    def submit():
        submitting.set()
        eng.submit(2, [src.ctypes.data], [dst.ctypes.data + big - 4096], [4096],
                   kernel_below=1 << 20, launcher=launcher)

    t = threading.Thread(target=submit)
    t.start()
    # The call below comes after the submit took the lock: the thread is in it (a call that went
    # first, ``shutdown`` say, would refuse the submit instead), and gives the GIL up only there.
    submitting.wait()
    time.sleep(0.005)
    calls = {
        "register": lambda: eng.register(np.zeros(4096, np.uint8), kind="host"),
        "register_table": lambda: eng.register_table(
            [src.ctypes.data], [4096], [4096], 16, "host"),
        "unregister": lambda: eng.unregister(spare),
        "unregister_table": lambda: eng.unregister_table(table),
        "pin": lambda: eng.pin(np.zeros(4096, np.uint8)),
        "alloc_host": lambda: eng.alloc_host(4096),
        "wait": lambda: eng.wait([1, 2]),
        "shutdown": lambda: eng.shutdown(),
        "staged_row": lambda: eng.staged_row(host_t),
        "block_runs": lambda: eng.block_runs(host_t, dev_t),
        "block_route": lambda: eng.block_route([(host_t, dev_t)]),
        "staged_route": lambda: eng.staged_route([host_t]),
        "free_host": lambda: eng.free_host(eng.alloc_host(4096)),
        "load_kernel": lambda: eng.load_kernel(
            {"function": 0, "threads": 128, "shared": 0, "rows": 1, "ctas": 1,
             "params": ["ids", "rings", "bases", "strides", "offsets", "count", "segments",
                        "ring_base", "ring_src"]}),
        "submit": lambda: eng.submit(3, [s0], [d0 + 4096], [4096]),
        "submit_blocks": lambda: eng.submit_blocks(4, host_t, ids, dev_t, ids),
        "submit_block_runs": lambda: eng.submit_block_runs(5, host_t, ids, dev_t, ids),
        "submit_groups": lambda: eng.submit_groups(6, [(host_t, ids, dev_t, ids, None)]),
        "submit_group": lambda: eng.submit_group(7, host_t, ids, dev_t, ids),
        "submit_spec": lambda: eng.submit_spec(
            8, ids, ids, [len(ids)], [0], [((host_t, dev_t),)], 1),
        "wake": lambda: eng.wake("h2d"),
        "prepare_staged": lambda: eng.prepare_staged("h2d"),
        "get_finished": lambda: eng.get_finished(),
        "stats": lambda: eng.stats(),
        "info": lambda: eng.info(),
        "inject_failures": lambda: eng.inject_failures(0),
        "is_shut_down": lambda: eng.is_shut_down,
        "stage_bytes": lambda: eng.stage_bytes,
    }
    try:
        calls[call]()
    except blockswap.BlockswapError:
        pass  # refused (busy, say) is fine: only a hang is a failure
    t.join()
    assert entered.is_set(), "the launcher never ran"
    eng.wait([1, 2])
    print("ok")
    eng.shutdown()
    """
)


def _bindings() -> list[str]:
    """Every public method and property of the engine (the compiled core's, and the ones the
    Python class adds over the core's private ``_register`` and the like): a binding added later
    is tested here without anyone listing it."""
    import blockswap

    return sorted(name for name in dir(blockswap.Engine) if not name.startswith("_"))


CALLS = _bindings()


def test_every_binding_has_a_case() -> None:
    missing = [c for c in CALLS if f'"{c}":' not in SCRIPT]
    assert not missing, f"bindings without a case in SCRIPT: {missing}"


@pytest.mark.parametrize("call", CALLS)
def test_binding_does_not_deadlock_with_a_launcher_submit(call: str) -> None:
    try:
        out = subprocess.run(
            [sys.executable, "-c", SCRIPT, call],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{call} deadlocked with a submit calling a Python launcher")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# How long another thread holds the host-buffer table; a call waiting for it with the GIL held
# stops every other Python thread that long.
HOLD = 1.5
# The longest a ticking thread may go without running: far under HOLD, far over a scheduler's
# hiccup on a loaded machine.
GAP = 0.5


@contextmanager
def _table_held() -> Iterator[list[float]]:
    """Holds the process-wide host-buffer table's lock from another thread for ``HOLD`` seconds
    (as an unpin holds it) while a third thread ticks every millisecond; yields a list that
    holds, once the block is done, the longest gap between two ticks."""
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    ticker = threading.Thread(target=tick, daemon=True)
    holder = threading.Thread(target=_core.hold_host_buffer_table, args=(HOLD,), daemon=True)
    # No automatic collection meanwhile: an old generation's, in a large heap, holds the GIL for
    # as long as GAP by itself.
    automatic_gc = gc.isenabled()
    gc.disable()
    ticker.start()
    holder.start()
    time.sleep(0.1)  # the holder has the lock (it takes it at once, the GIL released)
    gap: list[float] = []
    try:
        yield gap
    finally:
        holder.join(HOLD + 30)
        stop.set()
        ticker.join(30)
        if automatic_gc:
            gc.enable()
    gap.append(max(b - a for a, b in zip(ticks, ticks[1:])))


def _timed(call: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def _check(took: float, gap: list[float], what: str) -> None:
    # It did wait for the lock (else the test shows nothing), and other threads ran meanwhile.
    assert took > GAP, f"{what} took {took:.2f}s: it never waited for the table"
    assert gap[0] < GAP, f"the GIL was held for {gap[0]:.2f}s while {what} waited for the table"


def test_host_buffer_users_waits_for_the_table_with_the_gil_released() -> None:
    buf = _core.HostBuffer(16, 4096, backend="host")
    with _table_held() as gap:
        took = _timed(lambda: buf.users)
    _check(took, gap, "HostBuffer.users")


def test_host_buffer_pinned_waits_for_an_unpin_with_the_gil_released() -> None:
    """An unpin holds its buffer while it waits for the table (and then while the driver
    unlocks the pieces): ``pinned`` waits for it."""
    buf = _core.HostBuffer(16, 4096, backend="host")
    with _table_held() as gap:
        unpin = threading.Thread(target=buf.unpin)
        unpin.start()
        time.sleep(0.1)  # the unpin holds the buffer, waiting for the table
        took = _timed(lambda: buf.pinned)
        unpin.join()
    _check(took, gap, "HostBuffer.pinned")


def _collected(how: str, obj: Any) -> Callable[[], None]:
    """What lets go of ``obj``, the only reference to it given here: dropping the reference
    (``del``), or the garbage collector on another thread (``obj`` in a reference cycle)."""
    if how == "del":
        held = [obj]
        return held.clear
    cycle: list[Any] = [obj]
    cycle.append(cycle)

    def collect() -> None:
        # The youngest generation only, where the cycle is (the fixture collected everything
        # older): a full collection walks the whole heap with the GIL held, for long enough in a
        # process that has imported torch and vLLM to look like the drop held it.
        t = threading.Thread(target=gc.collect, args=(0,))
        t.start()
        t.join()

    return collect


@pytest.fixture
def no_automatic_gc() -> Iterator[None]:
    """The cycles here are collected when the test says, not by an allocation before."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.usefixtures("no_automatic_gc")
@pytest.mark.parametrize("how", ["del", "gc"])
def test_a_host_buffer_dropped_waits_for_the_table_with_the_gil_released(how: str) -> None:
    drop = _collected(how, _core.HostBuffer(16, 4096, backend="host"))
    with _table_held() as gap:
        took = _timed(drop)
    _check(took, gap, f"a HostBuffer's drop ({how})")


@pytest.mark.usefixtures("no_automatic_gc")
@pytest.mark.parametrize("how", ["del", "gc"])
def test_an_engine_dropped_waits_for_the_table_with_the_gil_released(how: str) -> None:
    """The engine's drop forgets its ``alloc_host`` buffer in the table."""
    eng = Engine("host")
    eng.alloc_host(4096)  # the array goes at once; the buffer stays the engine's
    drop = _collected(how, eng)
    del eng
    with _table_held() as gap:
        took = _timed(drop)
    _check(took, gap, f"an Engine's drop ({how})")


# Dropped at the interpreter's exit (module globals, a cycle the last collection finds) with a
# daemon thread still running Python, and on other threads by the collector: each drop releases
# and takes the GIL back, which must stay sound there.
AT_EXIT = """
import gc, threading, time
import numpy as np
import blockswap
from blockswap import _core

def spin():
    while True:
        sum(range(1000))

threading.Thread(target=spin, daemon=True).start()
buf = _core.HostBuffer(16, 4096, backend="host")
eng = blockswap.Engine("host")
eng.alloc_host(4096)
src, dst = np.ones(1 << 20, np.uint8), np.zeros(1 << 20, np.uint8)
eng.register(src, kind="host")
eng.register(dst, kind="device")
eng.submit(1, [src.ctypes.data], [dst.ctypes.data], [1 << 20])
cyc = blockswap.Engine("host")
cyc.cycle = cyc
cyc_buf = [_core.HostBuffer(4, 4096, backend="host")]
cyc_buf.append(cyc_buf)
for _ in range(4):
    e = blockswap.Engine("host")
    e.cycle = e
    b = [_core.HostBuffer(4, 4096, backend="host")]
    b.append(b)
    del e, b
    t = threading.Thread(target=gc.collect)
    t.start()
    t.join()
del cyc, cyc_buf
print("ok", flush=True)
"""


def test_drops_at_exit_and_on_other_threads_stay_sound() -> None:
    out = subprocess.run(
        [sys.executable, "-c", AT_EXIT], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    assert "Exception ignored" not in out.stderr and "panic" not in out.stderr, out.stderr
