"""Bad input: every refusal names what was wrong, is a BlockswapError, and says it at once.

One regression test per report; the engine settings' limits themselves are tested in
tests/config.rs, where they live.
"""

from __future__ import annotations

import inspect
import math
import re
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import blockswap
from blockswap import BlockswapError, Engine, InvalidTransferError, _core


@pytest.fixture
def pair(engine):
    src = np.arange(64 << 10, dtype=np.uint8)
    dst = np.zeros(64 << 10, dtype=np.uint8)
    engine.register(src, kind="host")
    engine.register(dst, kind="device")
    return src, dst


def test_object_arrays_of_small_ints_are_accepted(engine, pair):
    src, dst = pair
    s = np.array([src.ctypes.data, src.ctypes.data + 4096], dtype=object)
    d = np.array([dst.ctypes.data, dst.ctypes.data + 8192], dtype=object)
    engine.submit(1, s, d, np.array([16, 32], dtype=object))
    engine.wait([1])
    (r,) = engine.get_finished()
    assert r.success and r.bytes == 48
    assert np.array_equal(dst[:16], src[:16])
    assert np.array_equal(dst[8192 : 8192 + 32], src[4096 : 4096 + 32])
    # Out of int64: the message names the value (a list with 2**64 in it becomes an object array).
    with pytest.raises(
        InvalidTransferError, match=r"sizes holds 18446744073709551616, outside int64"
    ):
        engine.submit(2, [src.ctypes.data] * 2, [dst.ctypes.data] * 2, [1, 1 << 64])


def test_infinite_timeouts_wait_forever(pair):
    src, dst = pair[0], pair[1]
    with Engine("host", shutdown_timeout=math.inf) as eng:
        eng.register(src, kind="host")
        eng.register(dst, kind="device")
        eng.submit(1, [src.ctypes.data], [dst.ctypes.data], [64])
        eng.wait([1], timeout=math.inf)
        # Past what the clock counts: no deadline, rather than an error or a panic.
        eng.wait([1], timeout=1.5e19)  # was a Rust panic: the deadline overflowed the clock
        eng.wait([1], timeout=1e300)
        eng.wait([1], timeout=10**400)
        eng.submit(2, [src.ctypes.data + 64], [dst.ctypes.data + 64], [64])
    assert eng.is_shut_down
    assert [r.success for r in eng.get_finished()] == [True, True]
    assert np.array_equal(dst[:128], src[:128])


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"max_in_flight": 0}, "max_in_flight must be an int from 1 to 16384, not 0"),
        ({"max_in_flight": 16385}, "max_in_flight must be an int from 1 to 16384, not 16385"),
        ({"max_descriptors": 0}, "max_descriptors must be an int from 1 to 1048576, not 0"),
        ({"max_descriptors": (1 << 20) + 1}, "max_descriptors must be an int from 1 to 1048576"),
        ({"pool_bytes": 6143}, r"pool_bytes must be an int from 6144 to \d+, not 6143"),
        ({"pool_bytes": 0}, "pool_bytes must be an int from 6144"),
        ({"stage_bytes": 4095}, "stage_bytes must be an int from 4096 to 1099511627776, not 4095"),
        ({"stage_step_bytes": 0}, "stage_step_bytes must be an int from 1 to 1099511627776, not 0"),
        ({"stage_step_bytes": 1 << 41}, "stage_step_bytes must be an int from 1 to 1099511627776"),
        ({"keep_warm": -1}, "keep_warm must be a number of seconds from 0 to 3600, not -1"),
        ({"keep_warm": 3601}, "keep_warm must be a number of seconds from 0 to 3600, not 3601"),
        ({"keep_warm": float("nan")}, "keep_warm must be a number of seconds from 0 to 3600"),
        ({"keep_warm": "0.1"}, "keep_warm must be a number of seconds, not '0.1'"),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else "",
)
def test_settings_outside_their_limits_are_refused_at_construction(options, match):
    with pytest.raises(InvalidTransferError, match=match):
        Engine("host", **options)


def test_the_smallest_settings_work():
    with Engine("host", max_in_flight=1, max_descriptors=1, pool_bytes=6144) as eng:
        info = eng.info()
        assert (info["max_in_flight"], info["max_descriptors"], info["pool_bytes"]) == (1, 1, 6144)
        src = np.arange(64, dtype=np.uint8)
        dst = np.zeros(64, dtype=np.uint8)
        eng.register(src, kind="host")
        eng.register(dst, kind="device")
        eng.submit(1, [src.ctypes.data], [dst.ctypes.data], [64])
        eng.wait([1])
        assert eng.get_finished()[0].success
        assert np.array_equal(dst, src)


@pytest.mark.parametrize(
    ("args", "options", "match"),
    [
        ((), {"max_in_flight": 1.5}, "max_in_flight must be an int, not 1.5"),
        ((), {"max_in_flight": True}, "max_in_flight must be an int, not True"),
        ((), {"pool_bytes": "1"}, "pool_bytes must be an int, not '1'"),
        ((), {"max_descriptors": 2.0}, "max_descriptors must be an int or None, not 2.0"),
        ((), {"coalesce": "no"}, "coalesce must be a bool, not 'no'"),
        ((), {"timing": 1}, "timing must be a bool, not 1"),
        ((), {"shutdown_timeout": "60"}, "shutdown_timeout must be a number of seconds, not '60'"),
        ((5,), {}, "backend must be 'auto', 'host' or 'cuda', not 5"),
        ((), {"copy_path": None}, "copy_path must be 'auto', 'batch' or 'loop', not None"),
        ((), {"h2d_order": 1}, "h2d_order must be 'any' or 'stream', not 1"),
        ((), {"d2h_stream": "s"}, "d2h_stream must be a raw CUstream int or None, not 's'"),
        ((), {"device": 0.0}, "device must be an int, not 0.0"),
    ],
    ids=lambda v: str(v) if v and not isinstance(v, str) else "",
)
def test_wrong_types_name_the_argument(args, options, match):
    with pytest.raises(TypeError, match=f"^{re.escape(match)}$") as e:
        Engine(*args, **options)
    assert isinstance(e.value, BlockswapError)
    assert isinstance(e.value, blockswap.ArgumentTypeError)


def test_wait_timeout_of_the_wrong_type_names_it(engine):
    with pytest.raises(
        blockswap.ArgumentTypeError, match=r"^timeout must be a number of seconds, not '1'$"
    ):
        engine.wait([1], timeout="1")


def test_ints_too_wide_for_the_core_are_refused_by_name():
    with pytest.raises(
        InvalidTransferError,
        match=r"device must be an int from -2\*\*31 to 2\*\*31 - 1, not 1099511627776",
    ):
        Engine("host", device=1 << 40)
    with pytest.raises(
        InvalidTransferError,
        match=r"h2d_stream must be a raw CUstream int from 0 to 2\*\*64 - 1, not -1",
    ):
        Engine("host", h2d_stream=-1)


def test_cuda_options_on_the_host_backend_warn():
    with pytest.warns(UserWarning, match=r"host backend, which ignores the CUDA options "
                      r"copy_path='batch', h2d_stream=5$"):  # fmt: skip
        Engine("host", copy_path="batch", h2d_stream=5).shutdown()
    with pytest.warns(UserWarning, match=r"ignores the CUDA option device=1$"):
        Engine("host", device=1).shutdown()
    with pytest.warns(UserWarning, match=r"ignores the CUDA option keep_warm=0$"):
        Engine("host", keep_warm=0).shutdown()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # The defaults, named or not, ignore nothing.
        Engine("host", copy_path="auto", d2h_order="stream", keep_warm=0.1).shutdown()
        Engine("host", max_batch=64, timing=False, early_wake=True, device=0).shutdown()
    with pytest.warns(UserWarning, match=r"ignores the CUDA option max_batch=32$"):
        Engine("host", max_batch=32).shutdown()
    # Misspelt, they are refused here too, not only on a GPU machine.
    with pytest.raises(InvalidTransferError, match="copy_path must be 'auto', 'batch' or 'loop'"):
        Engine("host", copy_path="fast")
    with pytest.raises(InvalidTransferError, match="completion must be"):
        Engine("host", completion="poll")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the host backend's warning that it ignores max_batch
        with pytest.raises(InvalidTransferError, match="max_batch must be at least 1"):
            Engine("host", max_batch=0)  # was silently one copy per call on CUDA


def test_every_error_class_is_a_blockswap_error():
    from blockswap.layout import BlockTable, LayoutError
    from blockswap.weights import OffloadConfigError, OffloadDeviceError, WeightTransferError

    for cls, builtin in [
        (LayoutError, ValueError),
        (OffloadConfigError, ValueError),
        (OffloadDeviceError, ValueError),
        (blockswap.ArgumentTypeError, TypeError),
    ]:
        assert issubclass(cls, BlockswapError) and issubclass(cls, builtin), cls
    assert issubclass(WeightTransferError, BlockswapError)
    with pytest.raises(BlockswapError, match="no tensors given"):
        BlockTable.from_tensors([], layout="kv_split")


def test_the_never_raised_transfer_state_error_is_gone():
    assert not hasattr(blockswap, "TransferStateError")
    assert not hasattr(_core, "TransferStateError")
    with pytest.raises(AttributeError, match="no attribute 'TransferStateError'"):
        _ = blockswap.TransferStateError  # type: ignore[attr-defined]


# -- the typed surface ---------------------------------------------------------------------------


def test_engine_options_are_keyword_parameters_with_the_core_defaults():
    params = inspect.signature(Engine).parameters
    core = inspect.signature(_core.Engine).parameters
    assert list(params) == list(core)
    for name, p in params.items():
        assert p.default == core[name].default, name
        assert p.kind == core[name].kind, name
    assert params["backend"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert params["max_in_flight"].kind is inspect.Parameter.KEYWORD_ONLY


def test_polling_methods_are_documented_on_the_class(engine):
    for name in ("get_finished", "stats", "info"):
        assert inspect.getdoc(getattr(Engine, name)), name
    doc = inspect.getdoc(Engine) or ""
    assert "shutdown_timeout" in doc and "copy_path" in doc


def test_typed_dicts_match_what_the_core_returns(engine):
    stats = engine.stats()
    assert set(stats) == set(blockswap.EngineStats.__annotations__)
    assert set(stats["h2d"]) == set(blockswap.LaneStats.__annotations__)
    assert set(stats["pool"]) == set(blockswap.PoolStats.__annotations__)
    assert set(engine.info()) == set(blockswap.EngineInfo.__annotations__)


# -- optional dependencies -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "missing"),
    [
        ("blockswap.handler", "torch"),
        ("blockswap.layout", "torch"),
        ("blockswap.weights", "torch"),
        ("blockswap.kernels", "torch"),
        ("blockswap.kernels", "triton"),
    ],
)
def test_a_missing_optional_dependency_says_how_to_install_it(module, missing):
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules[{missing!r}] = None  # what an environment without it looks like to import
        import blockswap
        eng = blockswap.Engine("host")  # the engine needs numpy only
        eng.shutdown()
        try:
            import {module}
        except ImportError as e:
            print(type(e).__name__, e.name, e)
        else:
            print("imported")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.strip()
    assert out.startswith(f"ModuleNotFoundError {missing} "), out
    assert f"needs {missing}, which is not installed: pip install 'blockswap[torch]'" in out


@pytest.mark.parametrize(
    ("launch_bytes", "error", "match"),
    [
        ("8", blockswap.ArgumentTypeError, r"^launch_bytes must be an int or None, not '8'$"),
        (2.0, blockswap.ArgumentTypeError, r"^launch_bytes must be an int or None, not 2.0$"),
        (-1, InvalidTransferError, r"^launch_bytes must be an int from 0 to 2\*\*64 - 1, not -1$"),
        (
            1 << 64,
            InvalidTransferError,
            r"^launch_bytes must be an int from 0 to 2\*\*64 - 1, not 1844",
        ),
    ],
)
def test_a_route_names_a_bad_launch_bytes(launch_bytes, error, match):
    """The kernel route's bytes per launch is checked when the route is made."""
    with Engine("host") as eng:
        a, b = np.arange(1024, dtype=np.uint8), np.zeros(1024, dtype=np.uint8)
        eng.register(a)
        eng.register(b)
        ta = eng.register_table([a.ctypes.data], [256], [256], 4, "host")
        tb = eng.register_table([b.ctypes.data], [256], [256], 4, "host")
        with pytest.raises(error, match=match):
            blockswap.Route.pages(1 << 20, kernel=0, launch_bytes=launch_bytes)
        assert eng.stats()["in_flight"] == 0
        # The host backend loads no kernel: its pages go by memcpy.
        route = blockswap.Route.pages(1 << 20, kernel=0, launch_bytes=4096)
        eng.submit_groups(2, [(ta, [0], tb, [1], None)], "h2h", route=route)
        eng.wait([2])
        assert [r.success for r in eng.get_finished()] == [True]
        assert np.array_equal(b[256:512], a[:256])


def _kernel(params: list[str]) -> dict:
    return {"function": 1, "threads": 128, "shared": 0, "params": params, "rows": 1, "ctas": 1}


_PAGES = ["srcs", "dsts", "sizes", "count", "split", "src_base", "dst_base"]
_STAGED = [
    "ids", "rings", "bases", "strides", "offsets", "count", "segments", "ring_base", "ring_src",
]  # fmt: skip


@pytest.mark.parametrize(
    ("params", "error", "match"),
    [
        pytest.param([*_PAGES[:3], "cnt"], InvalidTransferError, '"cnt" is none of', id="unknown"),
        pytest.param([*_PAGES[:4], "srcs"], blockswap.BackendError, "named twice", id="twice"),
        pytest.param(_STAGED[:-1], blockswap.BackendError, "neither", id="staged-missing-one"),
        pytest.param([*_STAGED, "split"], blockswap.BackendError, "neither", id="kinds-mixed"),
    ],
)
def test_load_kernel_names_parameters_of_neither_kind(params, error, match):
    """A kernel's parameters must be a page kernel's or a staged kernel's: refused by name on
    every backend (the host backend launches no kernel, but takes no malformed one either); a
    kernel of either kind is taken (no id on the host backend)."""
    with Engine("host") as eng:
        with pytest.raises(error, match=match):
            eng.load_kernel(_kernel(params))
        assert eng.load_kernel(_kernel(_PAGES)) is None
        assert eng.load_kernel(_kernel(_STAGED)) is None


# -- the one int check ---------------------------------------------------------------------------

_WORDS_E = (KeyError, IndexError)


@pytest.mark.parametrize(
    ("value", "bounds", "options", "error", "message"),
    [
        pytest.param(0, (1, None), {}, ValueError, "n must be an int >= 1, not 0", id="below-lo"),
        pytest.param(9, (None, 8), {}, ValueError, "n must be an int <= 8, not 9", id="above-hi"),
        pytest.param(
            -1, (0, (1 << 64) - 1), {}, ValueError, "an int from 0 to 2**64 - 1, not -1", id="u64"
        ),
        pytest.param(
            1 << 40,
            (-(1 << 31), (1 << 31) - 1),
            {},
            ValueError,
            "from -2**31 to 2**31 - 1",
            id="i32",
        ),
        pytest.param(
            np.int64(-7), (0, None), {}, ValueError, "an int >= 0, not np.int64(-7)", id="numpy"
        ),
        pytest.param(True, (None, None), {}, TypeError, "n must be an int, not True", id="bool"),
        pytest.param(2.0, (1, None), {}, TypeError, "n must be an int, not 2.0", id="float"),
        pytest.param(
            "8", (1, None), {"optional": True}, TypeError, "an int or None, not '8'", id="optional"
        ),
        pytest.param([1], (None, None), {}, TypeError, "n must be an int, not a list", id="list"),
        pytest.param(
            np.int64(3), (1, None), {"numpy": False}, TypeError, "not np.int64(3)", id="no-numpy"
        ),
        pytest.param(
            -1,
            (0, None),
            {"what": "a raw CUstream int"},
            ValueError,
            "a raw CUstream int >= 0",
            id="what",
        ),
        pytest.param(
            1.5, (None, None), {"errors": _WORDS_E}, KeyError, "not 1.5", id="errors-type"
        ),
        pytest.param(
            -1, (0, None), {"errors": _WORDS_E}, IndexError, ">= 0, not -1", id="errors-range"
        ),
    ],
)
def test_check_int_words_every_refusal_one_way(value, bounds, options, error, message):
    from blockswap._checks import check_int

    with pytest.raises(error) as e:
        check_int("n", value, *bounds, **options)
    assert message in str(e.value)


def test_check_int_returns_a_python_int_and_lets_none_through_where_asked():
    from blockswap._checks import check_int

    got = check_int("n", np.int64(3), 1, 8)
    assert got == 3 and type(got) is int
    assert check_int("n", None, 1, optional=True) is None
    assert check_int("n", 5) == 5


@pytest.mark.parametrize("name", ["h2d_order", "d2h_order"])
def test_a_bad_access_order_names_its_argument(name: str) -> None:
    with pytest.raises(
        blockswap.InvalidTransferError, match=f"{name} .*must be 'stream' or 'any', not \"strem\""
    ):
        blockswap.Engine("host", **{name: "strem"})


@pytest.mark.parametrize(
    ("which", "group"),
    [("gpu_caches", None), ("cpu_caches", None), ("gpu_caches", 7), ("cpu_caches", "kv")],
)
def test_a_group_that_is_no_list_of_tensors_names_its_argument_and_group(which, group):
    # Was "CpuGpuHandlers: 'NoneType' object is not iterable", naming neither.
    import torch

    from blockswap.handler import CpuGpuHandlers

    gpu = [torch.zeros(2, 8, 4, 2, 8)]
    caches = {"gpu_caches": [gpu, group], "cpu_caches": None}
    if which == "cpu_caches":
        caches = {"gpu_caches": [gpu], "cpu_caches": [group]}
    kind = type(group).__name__
    with pytest.raises(
        blockswap.ConfigTypeError,
        match=rf"{which}: group {1 if which == 'gpu_caches' else 0} is a {kind}, not a list",
    ):
        CpuGpuHandlers(num_cpu_blocks=4, layout="kv_split", backend="host", **caches)
