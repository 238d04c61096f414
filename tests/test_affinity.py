"""The engine option ``cpus``: the engine's threads run on the CPUs given, bad values are refused
by name, and an engine made on a thread bound to one CPU (whose threads would share it) warns.

Each case runs in a subprocess: binding the test process's own thread would leak into the tests
after it."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap

import pytest

from blockswap import ArgumentTypeError, Engine, InvalidTransferError

CPUS = sorted(os.sched_getaffinity(0))

# The threads of this process named in `names`, each as (name, the CPUs it may run on).
THREADS = textwrap.dedent(
    """
    import os

    def named(names):
        out = []
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
            except OSError:
                continue
            if name in names:
                out.append((name, sorted(os.sched_getaffinity(int(tid)))))
        return out
    """
)

# The engine's thread names (`blockswap-<lane>` on CUDA, `blockswap-host`) and the CPUs each may
# run on, once they have started and bound themselves; and the warnings raised making it.
PROBE = THREADS + textwrap.dedent(
    """
    import json, sys, time, warnings
    from blockswap import Engine
    backend, bind, options = json.loads(sys.argv[1])
    if bind is not None:
        os.sched_setaffinity(0, set(bind))
    names = {"host": ("blockswap-host",), "cuda": ("blockswap-h2d", "blockswap-d2h")}[backend]

    def threads():
        return dict(named(names))

    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        e = Engine(backend, **options)
    # Bound before the engine was returned; named once each has started.
    deadline = time.monotonic() + 10
    while len(threads()) < len(names) and time.monotonic() < deadline:
        time.sleep(0.01)
    seen = threads()
    e.shutdown()
    print(json.dumps({
        "threads": seen,
        "caller": sorted(os.sched_getaffinity(0)),
        "warnings": [str(w.message) for w in warned if w.category is UserWarning],
    }))
    """
)


def run(script: str, arg: object) -> dict:
    """``script`` run by a new interpreter with ``arg`` as JSON; the JSON its last line prints."""
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(arg)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def probe(backend: str, bind: list[int] | None, **options: object) -> dict:
    return run(PROBE, [backend, bind, options])


BACKENDS = ["host", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_engines_threads_run_on_the_cpus_given(backend: str) -> None:
    last = CPUS[-1]
    got = probe(backend, None, cpus=[last])
    assert got["threads"] and all(c == [last] for c in got["threads"].values()), got
    assert got["caller"] == CPUS  # the caller's own affinity is left alone
    assert got["warnings"] == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_engine_made_on_a_thread_bound_to_one_cpu_warns_and_its_threads_share_it(
    backend: str,
) -> None:
    first = CPUS[0]
    got = probe(backend, [first])
    assert all(c == [first] for c in got["threads"].values()), got
    (warning,) = got["warnings"]
    assert f"CPU {first} only" in warning and "cpus" in warning, warning


@pytest.mark.parametrize("backend", BACKENDS)
def test_cpus_moves_the_threads_off_a_caller_bound_to_one_cpu(backend: str) -> None:
    if len(CPUS) < 2:
        pytest.skip("needs two CPUs")
    got = probe(backend, [CPUS[0]], cpus=CPUS[1:])
    assert got["threads"] and all(c == CPUS[1:] for c in got["threads"].values()), got
    assert got["caller"] == [CPUS[0]]
    assert got["warnings"] == []  # the threads do not share the caller's CPU: nothing to say


def test_a_caller_free_to_run_on_several_cpus_gets_no_warning() -> None:
    if len(CPUS) < 2:
        pytest.skip("needs two CPUs")
    got = probe("host", CPUS[:2])
    assert got["warnings"] == []
    assert all(c == CPUS[:2] for c in got["threads"].values()), got


@pytest.mark.parametrize(
    ("value", "error", "words"),
    [
        ([], InvalidTransferError, "at least one"),
        ([4096], InvalidTransferError, "from 0 to 1023"),
        (range(10**9), InvalidTransferError, "from 0 to 1023"),
        (itertools.repeat(0), InvalidTransferError, "more than 4096 CPU ids"),
        ([-1], InvalidTransferError, "cpus"),
        ([1000], InvalidTransferError, "may not run a thread there"),
        ("0", ArgumentTypeError, "CPU ids"),
        (3, ArgumentTypeError, "CPU ids"),
        ([1.5], ArgumentTypeError, "cpus must be an int"),
    ],
)
def test_bad_cpus_are_refused_by_name(value: object, error: type, words: str) -> None:
    with pytest.raises(error, match="cpus") as e:
        Engine("host", cpus=value)
    assert words in str(e.value)


def test_cpus_takes_any_iterable_of_ids_and_none() -> None:
    for value in (set(CPUS), range(CPUS[0], CPUS[0] + 1), tuple(CPUS), None):
        Engine("host", cpus=value).shutdown()


# Two threads make engines at the same time, each with its own `cpus` (the set is tried with the
# GIL released, and each engine binds its thread as it starts it): every engine's thread ends on
# its own maker's CPUs, and neither maker's affinity moves.
RACE = THREADS + textwrap.dedent(
    """
    import json, sys, threading, time
    from blockswap import Engine
    a, b = json.loads(sys.argv[1])
    start = threading.Barrier(2)
    engines = []
    lock = threading.Lock()

    def maker(cpu):
        start.wait()
        for _ in range(4):
            e = Engine("host", cpus=[cpu])
            with lock:
                engines.append(e)

    def host_threads():
        return sorted(cpus for _, cpus in named(("blockswap-host",)))

    before = sorted(os.sched_getaffinity(0))
    ts = [threading.Thread(target=maker, args=(c,)) for c in (a, b)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    # Bound before each engine was returned; named once each thread has started.
    deadline = time.monotonic() + 10
    while len(host_threads()) < len(engines) and time.monotonic() < deadline:
        time.sleep(0.01)
    seen = host_threads()
    for e in engines:
        e.shutdown()
    print(json.dumps({"seen": seen, "made": len(engines), "caller": before == sorted(os.sched_getaffinity(0))}))
    """
)


def test_engines_made_from_two_threads_at_once_each_bind_their_own_cpus() -> None:
    a, b = CPUS[0], CPUS[-1]
    got = run(RACE, [a, b])
    assert got["made"] == 8, got
    assert got["seen"] == sorted([[a]] * 4 + [[b]] * 4), got
    assert got["caller"], got
