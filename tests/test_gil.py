"""No binding waits for the engine lock while holding the GIL.

A submit whose small descriptors go to a Python launcher holds the engine lock while it waits for
the lane's earlier copies and then calls the launcher, which needs the GIL. A binding that took the
engine lock with the GIL held would wait for that submit while the submit waits for it: a deadlock
(reproduced with ``register`` before the bindings released the GIL). Each case runs in a child
process with a time limit, so a deadlock fails the test instead of hanging the run.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

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
    # One large copy keeps the host lane busy...
    eng.submit(1, [src.ctypes.data], [dst.ctypes.data], [big])
    entered = threading.Event()

    def launcher(*args):
        entered.set()

    # ...so this submit holds the engine lock, waiting for it, then calls the Python launcher.
    t = threading.Thread(target=lambda: eng.submit(
        2, [src.ctypes.data], [dst.ctypes.data + big - 4096], [4096],
        kernel_below=1 << 20, launcher=launcher))
    t.start()
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
    }
    try:
        calls[call]()
    except blockswap.BlockswapError:
        pass  # refused (busy, say) is fine: only a hang is a failure
    t.join()
    assert entered.is_set(), "the launcher never ran"
    eng.wait([1, 2])
    print("ok")
    """
)

CALLS = [
    "register",
    "register_table",
    "unregister",
    "unregister_table",
    "pin",
    "alloc_host",
    "wait",
    "shutdown",
]


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
