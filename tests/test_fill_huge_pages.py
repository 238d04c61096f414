"""Which pages the fill gives a shared-memory file (``_core.fill_and_pin`` with ``files``): on a
tmpfs mounted ``huge=advise`` the faults through a mapping advised ``MADV_HUGEPAGE`` allocate
2 MiB pages, so the fill leaves such a file's pages to them (``fallocate`` would put 4 KiB pages
there first); elsewhere it allocates the pages in the file first, as before. ``_core.shmem_huge``
names the policy.

The fill's test mounts tmpfs file systems of each policy in a mount namespace of its own
(``unshare``), so the host's mounts are never touched; where the host allows no such namespace it
cannot run, and says so."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

from blockswap import _core

MIB = 1 << 20

# Run in a private mount namespace: mounts a tmpfs of each policy, fills a 16 MiB file mapped
# and advised as vLLM's worker maps and advises its region, and reports what the kernel gave.
CHILD = textwrap.dedent(
    """
    import ctypes, json, mmap, os, subprocess, tempfile
    from blockswap import _core

    SIZE = 16 << 20
    out = {}
    for policy in ("never", "advise", "within_size"):
        where = tempfile.mkdtemp()
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"huge={policy},size=64m", "none", where],
            check=True,
        )
        path = os.path.join(where, "region")
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, SIZE)
        m = mmap.mmap(fd, SIZE, flags=mmap.MAP_SHARED)
        m.madvise(mmap.MADV_HUGEPAGE)
        m[5] = 7  # one byte written before the fill stays
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))
        _core.fill_and_pin([(base, SIZE)], [], files=[(fd, 0)], threads=4)
        pmd = 0
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split()[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= base < hi
                elif inside and head == "ShmemPmdMapped:":
                    pmd += int(line.split()[1]) << 10
        out[policy] = {
            "named": _core.shmem_huge(fd),
            "pmd_mapped": pmd,
            "allocated": os.fstat(fd).st_blocks * 512,
            "kept": m[5],
        }
        m.close()
        os.close(fd)
        subprocess.run(["umount", where], check=True)
    print(json.dumps(out))
    """
)


def in_mount_namespace() -> list[str] | None:
    """The command prefix that runs a child in a mount namespace of its own, or ``None``."""
    if shutil.which("unshare") is None or not os.path.isdir("/sys/kernel/mm/transparent_hugepage"):
        return None
    with tempfile.TemporaryDirectory() as where:
        for prefix in (["unshare", "-m"], ["unshare", "-Urm"]):
            try:
                p = subprocess.run(
                    [*prefix, "mount", "-t", "tmpfs", "-o", "huge=advise", "none", where],
                    capture_output=True,
                    timeout=30,
                )
            except (OSError, subprocess.TimeoutExpired):
                continue
            if p.returncode == 0:
                return prefix
    return None


def test_the_fill_leaves_a_huge_advise_files_pages_to_the_faults_and_gets_huge_pages() -> None:
    prefix = in_mount_namespace()
    if prefix is None:
        pytest.skip("this host allows no mount namespace with a tmpfs of its own (unshare -m)")
    with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
        enabled = f.read()
    forced = "[deny]" in enabled or "[force]" in enabled
    p = subprocess.run(
        [*prefix, sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    size = 16 * MIB
    for policy, seen in got.items():
        assert seen["kept"] == 7, policy  # the fill changes no byte
        assert seen["allocated"] >= size, policy  # every page of the file is there
        if not forced:
            assert seen["named"] == policy
    if forced:
        return
    # huge=never: 4 KiB pages. huge=advise: 2 MiB pages, because the faults allocated them
    # (fallocate first left 4 KiB pages everywhere but the one 2 MiB page written before the
    # fill: 2 of 16 MiB). huge=within_size: 2 MiB pages, allocated in the file first. At least
    # half in 2 MiB pages, so that a host short of free 2 MiB pages for a moment does not fail
    # it (every one was, on the hosts it ran on).
    assert got["never"]["pmd_mapped"] == 0
    assert got["advise"]["pmd_mapped"] >= size // 2, got
    assert got["within_size"]["pmd_mapped"] >= size // 2, got


def test_shmem_huge_names_the_policy_of_a_files_tmpfs_and_none_elsewhere() -> None:
    """``_core.shmem_huge`` reads the ``huge=`` option of the tmpfs the descriptor's file is on
    (as ``/proc/self/mountinfo`` lists it by device), and gives ``None`` off a tmpfs."""
    r, w = os.pipe()
    try:
        assert _core.shmem_huge(r) is None
    finally:
        os.close(r)
        os.close(w)
    assert _core.shmem_huge(-1) is None
    if not os.path.isdir("/dev/shm"):
        return
    path = f"/dev/shm/blockswap-test-{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.unlink(path)
        dev = os.fstat(fd).st_dev
        want = None
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if fields[2] != f"{os.major(dev)}:{os.minor(dev)}":
                    continue
                fs, opts = fields[fields.index("-") + 1], fields[fields.index("-") + 3]
                if fs == "tmpfs":
                    huge = [o[5:] for o in opts.split(",") if o.startswith("huge=")]
                    want = huge[0] if huge else "never"
                break
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            enabled = f.read()
        if want is not None and "[deny]" in enabled:
            want = "never"
        if want is not None and "[force]" in enabled:
            want = "always"
        assert _core.shmem_huge(fd) == want
    finally:
        os.close(fd)
