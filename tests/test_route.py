"""``blockswap.Route``: the one description of how a transfer moves, made by the core, checked
when it is made, and taken back by ``submit_groups``."""

from __future__ import annotations

import numpy as np
import pytest

import blockswap
from blockswap import ArgumentTypeError, Engine, InvalidTransferError, Route


def _launcher(*args: int) -> None:
    raise AssertionError("never launched on these tables")


def test_each_route_says_what_it_is():
    assert Route.pages().plan == "pages" and Route.pages().kernel_below == 0
    r = Route.pages(4096, kernel=3, launch_bytes=1 << 20)
    assert (r.plan, r.kernel_below, r.kernel, r.launch_bytes, r.launcher) == (
        "pages",
        4096,
        3,
        1 << 20,
        None,
    )
    r = Route.pages(4096, launcher=_launcher)
    assert r.launcher is _launcher and r.kernel is None
    assert Route.blocks().plan == "blocks" and Route.blocks().kernel is None
    assert Route.staged(7).plan == "staged" and Route.staged(7).kernel == 7
    assert Route.staged().kernel is None
    direct = Route.staged(7, direct=True)
    assert (direct.plan, direct.kernel) == ("direct", 7)
    assert repr(direct) == "Route.staged(kernel=7, direct=True)"
    assert direct.launch_bytes is None
    bounded = Route.staged(7, direct=True, launch_bytes=8 << 20)
    assert bounded.launch_bytes == 8 << 20
    assert repr(bounded) == "Route.staged(kernel=7, direct=True, launch_bytes=8388608)"
    assert repr(Route.pages(64, kernel=1)) == "Route.pages(64, kernel=1, launch_bytes=None)"
    assert repr(Route.blocks()) == "Route.blocks()"
    assert repr(Route.staged(2)) == "Route.staged(kernel=2)"


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: Route.pages(4096), "kernel_below=4096 needs a kernel"),
        (lambda: Route.pages(kernel=1), "kernel_below is 0"),
        (lambda: Route.pages(4096, kernel=1, launcher=_launcher), "not both"),
        (lambda: Route.pages(4096, launcher=_launcher, launch_bytes=8), "slices its own"),
        (lambda: Route.pages(launch_bytes=8), "needs a kernel"),
        (lambda: Route.pages(4096, launcher=5), "launcher must be a callable, not int"),
        (lambda: Route.pages(-1), r"kernel_below must be an int from 0 to 2\*\*64 - 1"),
        (lambda: Route.staged(1, launch_bytes=8), "the staged plan's steps are its slots"),
        (
            lambda: Route.staged(1, direct=True, launch_bytes=-1),
            r"launch_bytes must be an int from 0 to 2\*\*64 - 1, not -1",
        ),
        (
            lambda: Route.staged(1 << 32),
            r"kernel must be an int from 0 to 2\*\*32 - 1, not 4294967296",
        ),
    ],
)
def test_a_route_the_core_cannot_take_is_refused_when_made(make, match):
    with pytest.raises(InvalidTransferError, match=match):
        make()


@pytest.mark.parametrize("bad", ["8", 2.0, True])
def test_a_route_names_an_argument_of_the_wrong_type(bad):
    with pytest.raises(ArgumentTypeError, match=r"^kernel_below must be an int or None, not "):
        Route.pages(bad)


@pytest.mark.parametrize("bad", [1, "yes", 1.0])
def test_a_staged_route_takes_direct_as_a_bool(bad):
    with pytest.raises(ArgumentTypeError, match=r"^direct must be a bool, not "):
        Route.staged(3, direct=bad)
    assert Route.staged(3, direct=np.bool_(True)).plan == "direct"


@pytest.mark.parametrize(
    "route",
    [Route.pages(), Route.pages(4096, kernel=3, launch_bytes=1 << 20),
     Route.pages(4096, launcher=_launcher), Route.blocks(), Route.staged(7),
     Route.staged(7, direct=True, launch_bytes=8 << 20)],
    ids=repr,
)  # fmt: skip
def test_a_route_carries_what_chose_it(route: Route) -> None:
    assert route.reason == ""  # made by a constructor: nothing chose it
    told = route.with_reason("calibrated: staged (the fastest here)")
    assert told.reason == "calibrated: staged (the fastest here)" and route.reason == ""
    got = ("plan", "kernel_below", "kernel", "launch_bytes", "launcher")
    assert [getattr(told, a) for a in got] == [getattr(route, a) for a in got]
    assert repr(told) == repr(route)


def test_routes_are_frozen():
    with pytest.raises(AttributeError):
        Route.blocks().plan = "pages"  # type: ignore[misc]


def test_submit_groups_moves_by_the_route_it_is_given_and_refuses_what_is_not_one():
    with Engine("host") as eng:
        a = np.arange(4096, dtype=np.uint8)
        b = np.zeros(4096, dtype=np.uint8)
        eng.register(a, kind="host")
        eng.register(b, kind="device")
        # One segment of 1 KiB pages, block-major: every route has a plan here.
        ta = eng.register_table([a.ctypes.data], [1024], [1024], 4, "host")
        tb = eng.register_table([b.ctypes.data], [1024], [1024], 4, "device")
        for job, route in enumerate([None, Route.pages(), Route.blocks(), Route.staged()]):
            b[:] = 0
            eng.submit_groups(job, [(ta, [job % 4], tb, [3 - job % 4], None)], "h2d", route=route)
            eng.wait([job])
            (r,) = eng.get_finished()
            assert r.success, (route, r.error)
            s, d = job % 4, 3 - job % 4
            assert np.array_equal(b[d * 1024 : (d + 1) * 1024], a[s * 1024 : (s + 1) * 1024])
        with pytest.raises(ArgumentTypeError, match=r"route must be a blockswap\.Route or None"):
            eng.submit_groups(9, [(ta, [0], tb, [1], None)], "h2d", route="staged")  # type: ignore[arg-type]
        assert eng.stats()["in_flight"] == 0


def test_the_handlers_choose_core_routes():
    torch = pytest.importorskip("torch")
    from blockswap.handler import CpuGpuHandlers

    gpu = [torch.zeros(2, 8, 4, 16, dtype=torch.float16) for _ in range(2)]
    with CpuGpuHandlers(gpu, 4, layout="kv_split", backend="host") as h:
        for route in h.routes.values():
            assert isinstance(route, blockswap.Route)
            assert route.reason and route.plan in ("pages", "blocks", "staged", "direct")


def test_the_core_says_where_the_staged_and_block_routes_go():
    """One rule each, in the core: what a submission refuses is what the route choice avoids."""
    page, blocks, layers = 64 * 1024, 4, 2
    with Engine("host", stage_bytes=layers * page) as eng:
        host = np.zeros(blocks * layers * page, np.uint8)
        dev = np.zeros(blocks * layers * page, np.uint8)
        eng.register(host, kind="host")
        eng.register(dev, kind="device")
        h, d = host.ctypes.data, dev.ctypes.data
        # Block-major host rows (a block's two pages side by side), GPU layer after layer.
        major = eng.register_table([h, h + page], [2 * page] * 2, [page] * 2, blocks, "host")
        gpu = eng.register_table([d, d + blocks * page], [page] * 2, [page] * 2, blocks, "device")
        assert eng.staged_route([major]) == (layers * page, "")
        # Layer-major on the host: no row per block.
        mirror = eng.register_table([h, h + blocks * page], [page] * 2, [page] * 2, blocks, "host")
        row, why = eng.staged_route([major, mirror])
        assert row is None and "not block-major" in why
        with pytest.raises(InvalidTransferError, match="not block-major"):
            eng.submit_groups(1, [(mirror, [0], gpu, [0], None)], "h2d", route=Route.staged())

        taken, why = eng.block_route([(gpu, major)], "d2h")
        assert taken and why.startswith("blocks: 1 2-D copy per block (2 pages of 65536 B"), why
        taken, why = eng.block_route([(gpu, major), (gpu, major)], "d2h")
        assert not taken and "share memory" in why
        with pytest.raises(InvalidTransferError, match="table 99"):
            eng.block_route([(gpu, 99)], "d2h")

    with Engine("host", stage_bytes=page) as eng:
        host = np.zeros(blocks * layers * page, np.uint8)
        eng.register(host, kind="host")
        h = host.ctypes.data
        major = eng.register_table([h, h + page], [2 * page] * 2, [page] * 2, blocks, "host")
        row, why = eng.staged_route([major])
        assert row is None and "more than a staging slot (stage_bytes = 65536)" in why
