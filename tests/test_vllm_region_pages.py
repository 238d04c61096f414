"""vLLM's region in huge pages: the region blockswap's specs make (``new_region``) advises its whole
mapping ``MADV_HUGEPAGE`` before any slot is faulted in (by the worker's fill, or by vLLM's own
shards under ``replicated_layout``), so that on a tmpfs mounted ``huge=advise`` the region gets 2
MiB pages; the worker's log names the pages the region gets and, in 4 KiB pages, how to get
larger ones."""

from __future__ import annotations

import ctypes
import logging
import mmap
import uuid

import pytest

pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed")
from vllm.v1.kv_offload.cpu import shared_offload_region as sor

from blockswap import _vllm_region as vr


def vm_flags(start: int, end: int) -> list[set[str]]:
    """The ``VmFlags`` of every mapping of this process that overlaps ``[start, end)``."""
    out: list[set[str]] = []
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and start < hi
            elif inside and head == "VmFlags:":
                out.append(set(line.split()[1:]))
    return out


@pytest.mark.parametrize(
    "segments,shard", [(1, None), (32, None), (32, (0, 1))], ids=["file", "segments", "shards"]
)
def test_the_regions_whole_mapping_is_advised_huge_pages_before_a_slot_is_faulted_in(
    monkeypatch: pytest.MonkeyPatch, segments: int, shard: tuple[int, int] | None
) -> None:
    page, n_chunks = mmap.PAGESIZE, 12
    row = 4 * page
    monkeypatch.setattr(sor, "_MIN_SEGMENT_BYTES", 4 * row)  # files of four rows
    advised_before_populate: list[bool] = []
    populate = sor._madvise_populate_write

    def spy(m: mmap.mmap, offset: int, length: int) -> None:
        # vLLM's own pre-faulting (its probe of one page, its shards): the mapping is advised.
        view = ctypes.c_char.from_buffer(m)
        base = ctypes.addressof(view)
        del view  # no export left to keep the mapping from closing
        advised_before_populate.append(all("hg" in f for f in vm_flags(base, base + len(m))))
        populate(m, offset, length)

    monkeypatch.setattr(sor, "_madvise_populate_write", spy)
    region = vr.new_region(
        engine_id=str(uuid.uuid4()),
        barrier=lambda: None,
        num_segments=segments,
        num_chunks=n_chunks,
        rank=0,
        kv_bytes_per_chunk=row,
        cpu_page_size=row,
        **({"populate_shard": shard} if shard else {}),
    )
    try:
        assert len(region._segments) == (1 if segments == 1 else 3)
        base, total = region.base_tensor.data_ptr(), region.total_size_bytes
        flags = vm_flags(base, base + total)
        assert flags and all("hg" in f for f in flags), flags
        if segments > 1:
            # vLLM faults in after mapping its files; the advice came with the mapping.
            assert advised_before_populate and all(advised_before_populate)
        if shard is None:
            _, fill, files = vr.pieces_and_fill(region, 1 << 30)
            assert fill and files  # the worker's fill comes after the advice
    finally:
        region.cleanup()


def test_the_log_names_the_pages_the_region_gets(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert vr.huge_pages_note([]) is None
    for policy, words in [
        (None, None),
        ("never", "4 KiB pages (its tmpfs is mounted huge=never)"),
        ("advise", "2 MiB pages where they fit (its tmpfs: huge=advise)"),
        ("within_size", "huge=within_size"),
    ]:
        monkeypatch.setattr(vr._core, "shmem_huge", lambda fd, p=policy: p)
        note = vr.huge_pages_note([(3, 0)])
        assert (note is None) if words is None else (note is not None and words in note)
    # pin_region logs it once, before its fill.
    monkeypatch.setattr(vr._core, "shmem_huge", lambda fd: "never")
    monkeypatch.setattr(vr._core, "fill_and_pin", lambda *a, **k: None)
    with caplog.at_level(logging.INFO, logger="blockswap.vllm"):
        assert vr.pin_region([], 0, [(1 << 30, 4096)], [(3, 0)]) == []
    notes = [r.getMessage() for r in caplog.records if "huge=" in r.getMessage()]
    assert len(notes) == 1 and "mount -o remount,huge=advise /dev/shm" in notes[0]
