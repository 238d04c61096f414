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
