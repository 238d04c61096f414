"""Every error a public constructor raises is a BlockswapError (the package's promise), and an
argument of a wrong value or type keeps the builtin kind too (ValueError / TypeError), as
LayoutError does.

Two tests: the cases a user hits (a bad count, layout, backend, numpy caches) named one by one
with the kind each must be; and a sweep that passes each of a set of bad values to every
parameter of every public constructor, over otherwise valid arguments, and requires whatever is
raised to be a BlockswapError."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import blockswap
from blockswap import BlockswapError
from blockswap.errors import ConfigError, ConfigTypeError
from blockswap.handler import CpuGpuHandlers
from blockswap.hostmem import PinnedRows
from blockswap.layout import (
    BlockTable,
    LayoutError,
    make_block_major_cpu_cache,
    make_cpu_cache_like,
)
from blockswap.weights import PrefetchOffloader, ZeroCopyOffloader, create_offloader
from kv_helpers import kv_split
from weights_helpers import make_stack


def _caches() -> list[torch.Tensor]:
    return kv_split(torch.float16)


def _handlers(**kw: Any) -> Any:
    args: dict[str, Any] = {
        "gpu_caches": _caches(),
        "num_cpu_blocks": 4,
        "layout": "kv_split",
        "backend": "host",
    }
    args.update(kw)
    h = CpuGpuHandlers(**args)
    h.shutdown()
    return h


def _engine(**kw: Any) -> Any:
    args: dict[str, Any] = {"backend": "host"}
    args.update(kw)
    e = blockswap.Engine(**args)
    e.shutdown()
    return e


def _pinned(**kw: Any) -> Any:
    args: dict[str, Any] = {"rows": 4, "row_bytes": 4096, "backend": "host"}
    args.update(kw)
    return PinnedRows(**args)


def _table(**kw: Any) -> Any:
    args: dict[str, Any] = {"tensors": _caches(), "layout": "kv_split"}
    args.update(kw)
    return BlockTable.from_tensors(**args)


def _block_major(**kw: Any) -> Any:
    args: dict[str, Any] = {"gpu_tensors": _caches(), "num_cpu_blocks": 4, "layout": "kv_split"}
    args.update(kw)
    return make_block_major_cpu_cache(**args)


def _like(**kw: Any) -> Any:
    args: dict[str, Any] = {"gpu_tensors": _caches(), "num_cpu_blocks": 4, "layout": "kv_split"}
    args.update(kw)
    return make_cpu_cache_like(**args)


def _prefetch(**kw: Any) -> Any:
    args: dict[str, Any] = {"layers": list(make_stack(4).layers), "group_size": 2}
    args.update(kw)
    off = PrefetchOffloader(**args)
    off.close()
    return off


def _zero_copy(**kw: Any) -> Any:
    args: dict[str, Any] = {"layers": list(make_stack(4).layers), "group_size": 2}
    args.update(kw)
    off = ZeroCopyOffloader(**args)
    off.close()
    return off


def _create(**kw: Any) -> Any:
    args: dict[str, Any] = {"kind": "prefetch", "layers": list(make_stack(2).layers)}
    args.update(kw)
    off = create_offloader(**args)
    off.close()
    return off


#: name -> (builder taking keyword overrides, the callable whose parameters are swept).
CONSTRUCTORS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "Engine": (_engine, blockswap.Engine),
    "PinnedRows": (_pinned, PinnedRows.__init__),
    "CpuGpuHandlers": (_handlers, CpuGpuHandlers.__init__),
    "BlockTable.from_tensors": (_table, BlockTable.from_tensors),
    "make_block_major_cpu_cache": (_block_major, make_block_major_cpu_cache),
    "make_cpu_cache_like": (_like, make_cpu_cache_like),
    "PrefetchOffloader": (_prefetch, PrefetchOffloader.__init__),
    "ZeroCopyOffloader": (_zero_copy, ZeroCopyOffloader.__init__),
    "create_offloader": (_create, create_offloader),
}

BAD_VALUES: list[Any] = [
    None,
    "bogus",
    "",
    -1,
    0,
    2.5,
    True,
    1 << 70,
    object(),
    np.zeros(3),
    np.zeros((2, 4, 4, 2, 8), np.float16),
    [np.zeros(3)],
    torch.zeros(3),
    {"x": 1},
    [],
]


def _params(fn: Callable[..., Any]) -> list[str]:
    out = []
    for name, p in inspect.signature(fn).parameters.items():
        if name in ("self", "cls") or name.startswith("_"):
            continue
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        out.append(name)
    return out


def test_the_valid_arguments_build() -> None:
    """The sweep's baseline: each constructor builds with the arguments it starts from."""
    for build, _ in CONSTRUCTORS.values():
        build()


@pytest.mark.filterwarnings("ignore:this engine runs on the host backend")
@pytest.mark.parametrize("name", sorted(CONSTRUCTORS))
def test_every_parameter_refuses_with_a_blockswap_error(name: str) -> None:
    build, fn = CONSTRUCTORS[name]
    params = _params(fn)
    assert params, name
    raised = 0
    for param in params:
        for bad in BAD_VALUES:
            try:
                build(**{param: bad})
            except BlockswapError:
                raised += 1
            except Exception as e:  # what the test is for: name the call and the error
                pytest.fail(
                    f"{name}({param}={bad!r}) raised {type(e).__module__}.{type(e).__name__}, "
                    f"not a BlockswapError: {e}"
                )
    assert raised >= len(params), (name, raised)


# The cases a user hits, each with the builtin kind it keeps (issue: "num_cpu_blocks=0,
# layout='flash', backend='gpu', numpy caches raise plain ValueError/TypeError").
CASES: list[tuple[str, Callable[[], Any], type[Exception], type[Exception], str]] = [
    ("num_cpu_blocks=0", lambda: _handlers(num_cpu_blocks=0), ConfigError, ValueError,
     "num_cpu_blocks must be an int >= 1, not 0"),
    ("num_cpu_blocks=2.0", lambda: _handlers(num_cpu_blocks=2.0), ConfigTypeError, TypeError,
     "num_cpu_blocks must be an int"),
    ("layout='flash'", lambda: _handlers(layout="flash"), ConfigError, ValueError,
     "unknown layout 'flash'"),
    ("backend='gpu'", lambda: _handlers(backend="gpu"), ConfigError, ValueError,
     "backend must be 'auto', 'cuda' or 'host', not 'gpu'"),
    ("numpy caches", lambda: _handlers(gpu_caches=[np.zeros((2, 8, 4, 2, 8))]),
     ConfigTypeError, TypeError, "not a tensor"),
    ("path='fast'", lambda: _handlers(path="fast"), ConfigError, ValueError, "path must be"),
    ("cpu_layout='rows'", lambda: _handlers(cpu_layout="rows"), ConfigError, ValueError,
     "cpu_layout must be"),
    ("block_size_factor=0", lambda: _handlers(block_size_factor=0), ConfigError, ValueError,
     "block_size_factor"),
    ("pin_piece_bytes=0", lambda: _handlers(pin_piece_bytes=0), ConfigError, ValueError,
     "pin_piece_bytes"),
    ("layout of another shape", lambda: _handlers(layout="mla"), LayoutError, ValueError, ""),
    ("make_block_major_cpu_cache(num_cpu_blocks=-1)",
     lambda: _block_major(num_cpu_blocks=-1), ConfigError, ValueError, "num_cpu_blocks"),
    ("BlockTable of a list", lambda: _table(tensors=[[1, 2]]), ConfigTypeError, TypeError,
     "not a torch.Tensor"),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_cases_users_hit_keep_their_builtin_kind(case: Any) -> None:
    _, call, kind, builtin, words = case
    with pytest.raises(kind, match=None) as info:
        call()
    assert isinstance(info.value, BlockswapError)
    assert isinstance(info.value, builtin)
    assert words in str(info.value)


def test_the_hierarchy() -> None:
    assert issubclass(ConfigError, BlockswapError) and issubclass(ConfigError, ValueError)
    assert issubclass(ConfigTypeError, BlockswapError) and issubclass(ConfigTypeError, TypeError)
    assert issubclass(LayoutError, ConfigError)
    assert blockswap.ConfigError is ConfigError and blockswap.ConfigTypeError is ConfigTypeError
