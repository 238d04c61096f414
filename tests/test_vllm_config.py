"""``kv_connector_extra_config`` checked when vLLM's factory makes the spec: unknown
``blockswap_*`` keys refused with the known ones, bad values with the config key and what it
takes, before vLLM sizes the CPU cache and before blockswap allocates anything."""

from __future__ import annotations

import math
import os
import re
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed")

from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

import blockswap
from blockswap import BlockswapError, _core
from blockswap._vllm_config import OPTIONS, worker_options
from blockswap.errors import ConfigError, ConfigTypeError
from test_vllm_spec import offloading_config

ROOT = Path(__file__).resolve().parent.parent


def config_with(**extra: Any) -> Any:
    cfg = offloading_config()
    merged = dict(cfg.extra_config)
    for k, v in extra.items():
        if v is None:
            merged.pop(k, None)
        else:
            merged[k] = v
    return type(cfg)(**{**cfg.__dict__, "extra_config": merged})


@pytest.fixture
def allocations(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records every step that sizes or allocates: vLLM's CPU spec's constructor (it sizes the
    cache from cpu_bytes_to_use) and blockswap's host buffers."""
    seen: list[str] = []
    spec_init = CPUOffloadingSpec.__init__
    host_buffer = _core.HostBuffer

    def sizing(self: Any, config: Any) -> None:
        seen.append("vLLM sized the cache")
        spec_init(self, config)

    def buffer(*args: Any) -> Any:
        seen.append("host memory allocated")
        return host_buffer(*args)

    monkeypatch.setattr(CPUOffloadingSpec, "__init__", sizing)
    monkeypatch.setattr(_core, "HostBuffer", buffer)
    return seen


BAD = [
    # (extra config, error kind, words the message must hold)
    (
        {"blockswap_max_inflight": 8},
        ConfigError,
        [
            "'blockswap_max_inflight'",
            # Each known key with what it takes.
            "the known ones are blockswap_path ('auto', 'blocks', 'staged', 'dma' or 'kernel'); "
            f"blockswap_max_in_flight (an int from 1 to {_core.MAX_IN_FLIGHT}); "
            f"blockswap_pin_piece_bytes (an int from 1 to {_core.REGISTRATION_LIMIT - 1}); "
            "blockswap_idle_issue (true or false); "
            "blockswap_keep_warm (a number of seconds from 0 to 3600)",
        ],
    ),
    ({"blockswap_pth": "dma", "blockswap_zz": 1}, ConfigError, ["'blockswap_pth', 'blockswap_zz'"]),
    (
        {"blockswap_max_in_flight": 0},
        ConfigError,
        [f"blockswap_max_in_flight must be an int from 1 to {_core.MAX_IN_FLIGHT}, not 0"],
    ),
    ({"blockswap_max_in_flight": "8"}, ConfigTypeError, ["blockswap_max_in_flight", "'8'"]),
    (
        {"blockswap_path": "fast"},
        ConfigError,
        ["blockswap_path must be 'auto', 'blocks', 'staged', 'dma' or 'kernel', not 'fast'"],
    ),
    ({"blockswap_pin_piece_bytes": -4096}, ConfigError, ["blockswap_pin_piece_bytes"]),
    (
        {"blockswap_idle_issue": "yes"},
        ConfigTypeError,
        ["blockswap_idle_issue must be a bool, not 'yes'"],
    ),
    (
        {"blockswap_keep_warm": -0.5},
        ConfigError,
        ["blockswap_keep_warm must be a number of seconds from 0 to 3600, not -0.5"],
    ),
    (
        {"blockswap_keep_warm": "0.1"},
        ConfigTypeError,
        ["blockswap_keep_warm must be a number of seconds, not '0.1'"],
    ),
    ({"blockswap_keep_warm": True}, ConfigTypeError, ["blockswap_keep_warm", "True"]),
    ({"cpu_bytes_to_use": None}, ConfigError, ["cpu_bytes_to_use", "must be set"]),
    ({"cpu_bytes_to_use": "64GiB"}, ConfigTypeError, ["cpu_bytes_to_use", "number of bytes"]),
    ({"cpu_bytes_to_use": 0}, ConfigError, ["cpu_bytes_to_use must be at least 1 byte"]),
    # JSON's 1e400 reads as infinity: named, not int()'s OverflowError.
    ({"cpu_bytes_to_use": math.inf}, ConfigError, ["cpu_bytes_to_use must be a finite number"]),
    ({"cpu_bytes_to_use": math.nan}, ConfigError, ["cpu_bytes_to_use must be a finite number"]),
]


@pytest.mark.parametrize("extra,kind,words", BAD, ids=[str(b[0]) for b in BAD])
def test_vllms_factory_refuses_a_bad_config_before_any_allocation(
    allocations: list[str], extra: dict[str, Any], kind: type[Exception], words: list[str]
) -> None:
    with pytest.raises(kind) as info:
        OffloadingSpecFactory.create_spec(config_with(**extra))
    assert isinstance(info.value, BlockswapError)
    msg = str(info.value)
    for w in words:
        assert w in msg, (w, msg)
    assert "kv_connector_extra_config" in msg
    assert allocations == []  # refused before vLLM sized the cache or anything was allocated


def test_a_good_config_passes_and_sets_the_workers_options(allocations: list[str]) -> None:
    spec = OffloadingSpecFactory.create_spec(
        config_with(
            blockswap_path="staged",
            blockswap_pin_piece_bytes=1 << 20,
            blockswap_idle_issue=True,
            blockswap_keep_warm=0,
        )
    )
    assert allocations == ["vLLM sized the cache"]
    assert worker_options(spec.extra_config) == {
        "path": "staged",
        "max_in_flight": 8,
        "pin_piece_bytes": 1 << 20,
        "idle_issue": True,
        "keep_warm": 0.0,
    }
    # vLLM's own keys pass untouched.
    assert worker_options({"cpu_bytes_to_use": 1.5e9, "eviction_policy": "arc"}) == {}


def test_the_readme_and_the_module_list_every_option_and_value() -> None:
    """The option list users read matches the code (it once left out ``staged``)."""
    import blockswap.vllm as plugin

    readme = (ROOT / "README.md").read_text()
    doc = plugin.__doc__ or ""
    for key in OPTIONS:
        assert f"`{key}`" in readme and f"``{key}``" in doc, key
    section = readme[readme.index("`blockswap_path`") :][:400]
    for path in ("auto", "blocks", "staged", "dma", "kernel"):
        assert re.search(rf"`{path}`", section), path
        assert f'``"{path}"``' in doc, path


@pytest.mark.parametrize(
    ("world", "shared", "replicated"),
    [(1, False, False), (4, False, False), (1, True, False), (4, True, False), (4, True, True)],
)
def test_a_cache_larger_than_the_hosts_memory_is_refused_before_allocation(
    allocations: list[str],
    monkeypatch: pytest.MonkeyPatch,
    world: int,
    shared: bool,
    replicated: bool,
) -> None:
    """The README's 64 GiB example on a smaller host: refused where a worker is made, before it
    allocates, in GiB, with the host's available memory and the key to lower
    (cpu_bytes_to_use). The spec itself is made: vLLM makes it in the scheduler's process too,
    after the workers allocated the tier. A private cache counts the worker's cells; vLLM's
    shared region (on CUDA, with or without replicated_layout) the whole region, which every
    worker of the host maps, and nothing is left in /dev/shm."""
    from vllm.v1.kv_offload.cpu import spec as cpu_spec

    from test_vllm_spec import offloading_config, two_tensors

    monkeypatch.setattr(cpu_spec.current_platform, "is_cuda_alike", lambda: shared)
    monkeypatch.setattr(cpu_spec.current_platform, "is_rocm", lambda: False)
    available = _core.host_memory_available()
    assert available is not None and available > 0
    asked = 1 << 47  # 128 TiB: more than any host here has
    engine = f"fits-{uuid.uuid4()}"
    spec = OffloadingSpecFactory.create_spec(
        offloading_config(
            engine_id=engine,
            world_size=world,
            replicated_layout=replicated,
            cpu_bytes_to_use=asked,
        )
    )
    assert spec.replicated_layout is replicated
    with pytest.raises(ConfigError) as info:
        spec.create_worker(two_tensors(1)[0])
    msg = str(info.value)
    if shared:
        # The whole region: vLLM's chunks of every worker's cells.
        whole = spec.num_chunks * spec.kv_bytes_per_chunk / 2**30
        one = f", one for the {world} workers" if world > 1 else ""
        head = f"the CPU KV cache (vLLM's shared region{one}) needs {whole:.2f} GiB of host memory"
    else:
        # This worker's cells: at one worker, chunks of 2 blocks of 512 bytes, aligned to 4 KiB,
        # a quarter of what was asked.
        cells = spec.num_chunks * spec.cpu_page_size_per_worker / 2**30
        assert world > 1 or cells == asked / 4 / 2**30
        over = f" (cpu_bytes_to_use={asked} over {world} workers)" if world > 1 else ""
        head = f"the CPU KV cache needs {cells:.2f} GiB of host memory on this worker{over}"
    assert msg.startswith(head), msg
    assert re.search(r"the host has \d+\.\d\d GiB available \(MemAvailable\)", msg), msg
    assert f"lower cpu_bytes_to_use in kv_connector_extra_config (now {asked})" in msg
    assert allocations == ["vLLM sized the cache"]  # nothing allocated
    assert not [f for f in os.listdir("/dev/shm") if engine in f]


@pytest.mark.parametrize("replicated", [False, True])
def test_the_region_is_checked_whole_by_the_worker_that_makes_it(
    monkeypatch: pytest.MonkeyPatch, replicated: bool
) -> None:
    """One region holds the tier for every worker of the host, and each maps all of it (under the
    tiering spec's replicated_layout rank 0's cell is the whole row, and every rank faults it all
    in): the worker that creates the region checks the whole region, so a tier that does not fit
    is refused even where a rank's share would (it once counted a rank's share: 4 ranks took
    4 times the host's memory). A worker joining the region is not checked again."""
    from test_vllm_spec import offloading_config, two_tensors

    engine = f"whole-{uuid.uuid4()}"

    def spec(rank: int) -> Any:
        return OffloadingSpecFactory.create_spec(
            offloading_config(
                spec_name="BlockswapTieringOffloadingSpec",
                engine_id=engine,
                rank=rank,
                world_size=4,
                replicated_layout=replicated,
                cpu_bytes_to_use=1 << 22,
            )
        )

    first = spec(0)
    whole = first.num_chunks * first.kv_bytes_per_chunk
    assert whole > 3 * first.num_chunks * first.cpu_page_size_per_worker  # 4 workers' cells
    monkeypatch.setattr(_core, "host_memory_available", lambda: whole - 1)
    with pytest.raises(ConfigError, match=r"shared region, one for the 4 workers\) needs"):
        first.get_worker(two_tensors(0)[0])
    assert not [f for f in os.listdir("/dev/shm") if engine in f]
    monkeypatch.setattr(_core, "host_memory_available", lambda: whole)
    maker = first.get_worker(two_tensors(0)[0])
    try:
        # What the region took is gone from the host's memory: a joiner is not refused for it.
        monkeypatch.setattr(_core, "host_memory_available", lambda: 0)
        joiner = spec(1).get_worker(two_tensors(1)[0])
        joiner.shutdown()
    finally:
        maker.shutdown()


def test_the_tiering_spec_refuses_a_tier_under_one_chunk_before_its_region() -> None:
    """cpu_bytes_to_use under one chunk: the ConfigError that the CPU spec's worker gives, not
    vLLM's region failing to map an empty file."""
    from test_vllm_spec import offloading_config, two_tensors

    for name in ("BlockswapOffloadingSpec", "BlockswapTieringOffloadingSpec"):
        engine = f"empty-{uuid.uuid4()}"
        spec = OffloadingSpecFactory.create_spec(
            offloading_config(spec_name=name, engine_id=engine, cpu_bytes_to_use=1000)
        )
        assert spec.num_chunks == 0
        with pytest.raises(ConfigError, match="the CPU cache holds 0 chunks: raise cpu_bytes"):
            spec.get_worker(two_tensors(1)[0])
        assert not [f for f in os.listdir("/dev/shm") if engine in f], name


def test_a_cpu_bytes_to_use_string_of_digits_is_taken_as_vllm_takes_it() -> None:
    """vLLM reads the key as ``int(extra_config["cpu_bytes_to_use"])``: a string of digits
    sizes the cache as the number does."""
    by_int = OffloadingSpecFactory.create_spec(config_with(cpu_bytes_to_use=1 << 20))
    by_str = OffloadingSpecFactory.create_spec(config_with(cpu_bytes_to_use=str(1 << 20)))
    assert by_str.num_chunks == by_int.num_chunks > 0
    by_np = OffloadingSpecFactory.create_spec(config_with(cpu_bytes_to_use=np.int64(1 << 20)))
    assert by_np.num_chunks == by_int.num_chunks


def test_a_host_buffer_that_cannot_be_mapped_says_gib_errno_and_available() -> None:
    from blockswap.hostmem import PinnedRows

    with pytest.raises(blockswap.BackendError) as info:
        PinnedRows(1 << 20, 1 << 27, backend="host")  # 2^47 bytes: no address space for it
    msg = str(info.value)
    assert msg.startswith("could not map 131072.00 GiB (140737488355328 bytes) of host memory")
    assert "errno 12 (Cannot allocate memory)" in msg
    assert re.search(r"the host has \d+\.\d\d GiB available \(MemAvailable\)$", msg), msg


def short_form(size_gib: float) -> Any:
    """What vLLM 0.33 makes of ``--kv-offloading-size <size_gib> --kv-transfer-config '{...}'``
    (the README's short form), by its own code: the CLI's KVTransferConfig from the JSON, the
    cache config with the size, and VllmConfig's post-init step that turns the size into
    OffloadingConnector with cpu_bytes_to_use merged into the extra config. (vLLM's full CLI
    parsing needs a GPU to infer the device; this is the step that implements the option.)"""
    import json
    from types import SimpleNamespace

    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig

    readme = (ROOT / "README.md").read_text()
    flag = "--kv-transfer-config '"
    start = readme.index(flag, readme.index("--kv-offloading-size")) + len(flag)
    cli_json = readme[start : readme.index("'", start)]
    kvt = KVTransferConfig(**json.loads(cli_json))
    ns = SimpleNamespace(
        cache_config=CacheConfig(kv_offloading_size=size_gib), kv_transfer_config=kvt
    )
    VllmConfig._post_init_kv_transfer_config(ns)  # type: ignore[arg-type]
    return ns.kv_transfer_config


def test_vllms_kv_offloading_size_short_form_selects_blockswap(allocations: list[str]) -> None:
    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from blockswap.vllm import BlockswapOffloadingWorker

    kvt = short_form(64)
    assert kvt.kv_connector == "OffloadingConnector" and kvt.kv_role == "kv_both"
    assert kvt.kv_connector_extra_config == {
        "spec_name": "BlockswapOffloadingSpec",
        "spec_module_path": "blockswap.vllm",
        "cpu_bytes_to_use": 64 << 30,
    }
    # The same at a size this machine can hold (64 KiB), through vLLM's factory to a store.
    kvt = short_form((64 << 10) / (1 << 30))
    cfg = offloading_config()
    cfg = type(cfg)(**{**cfg.__dict__, "extra_config": kvt.kv_connector_extra_config})
    spec = OffloadingSpecFactory.create_spec(cfg)
    assert type(spec).__name__ == "BlockswapOffloadingSpec" and spec.num_chunks > 0
    ts = [torch.zeros((16, 256), dtype=torch.int8) for _ in range(2)]
    kv = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, 256) for t in ts],
        [[CanonicalKVCacheRef(0, 256), CanonicalKVCacheRef(1, 256)]],
    )
    w = spec.get_worker(kv)
    try:
        assert isinstance(w, BlockswapOffloadingWorker)
        assert w.submit_store(1, GPULoadStoreSpec([3, 5], [2], [0]), CPULoadStoreSpec([1]))
        w.wait({1})
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True)]
    finally:
        w.shutdown()
