"""Weight offloading (blockswap.weights) with the GPU behind the host (review of 2026-12-01).

On CUDA the compute stream's waits on the copies are the GPU's: the host neither blocks on them
nor sees a copy finished (``engine.get_finished``) before the GPU has run it, which, where the
GPU falls behind, is long after the host went on. Found: with ``synchronous=True`` a failed copy
of a forward's last layer was raised by the next forward, or never (``close()`` and ``reset()``
dropped it); and a forward's onloads piled up past ``max_in_flight`` until the engine refused
one (``PoolExhaustedError``) mid-forward.

The host tests model this with :class:`_GpuBehind`: the compute stream's waits still order the
data (as the GPU does), but a copy is reported finished only once the host has waited for it,
the case of a GPU that has not caught up; the ``cuda`` tests keep a real GPU behind with
``torch.cuda._sleep``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import pytest
import torch

from blockswap import PoolExhaustedError
from blockswap.weights import PrefetchOffloader, WeightTransferError
from blockswap.weights.sync import _HostSync
from weights_helpers import Stack, make_stack


class _BehindSync(_HostSync):
    """The host stand-in for streams and events with CUDA's view of completion: the compute
    stream's waits order the data but report nothing to the host; ``drain`` (a device
    synchronize) does."""

    is_cuda = True

    def __init__(self, behind: _GpuBehind, old: _HostSync, trace: list[Any] | None) -> None:
        super().__init__(behind.engine, trace)
        self.behind = behind
        self._last_job = old._last_job

    def drain(self) -> None:
        super().drain()
        self.behind.catch_up()


class _GpuBehind:
    """The offloader's engine, seen from a host the GPU has fallen behind: a copy is reported
    finished (``get_finished``) only once the host waited for it or for a later one (one lane's
    copies finish in order), and a submission is refused, as the engine refuses it, while
    ``max_in_flight`` are not reported yet."""

    def __init__(self, off: PrefetchOffloader) -> None:
        self.engine = off.engine
        self.limit = int(self.engine.info()["max_in_flight"])
        self.unreported = set(off._job_layer)
        self.most = len(self.unreported)
        self.upto = 0
        self.held: list[Any] = []
        off.engine = self  # type: ignore[assignment]
        off._sync = _BehindSync(self, off._sync, off.trace)

    def submit(self, job: int, *args: Any) -> None:
        if len(self.unreported) >= self.limit:
            raise PoolExhaustedError(
                f"{len(self.unreported)} h2d transfers are in flight or finished but not yet "
                "polled (call get_finished, or raise max_in_flight)"
            )
        self.engine.submit(job, *args)
        self.unreported.add(job)
        self.most = max(self.most, len(self.unreported))

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        jobs = list(job_ids)
        self.engine.wait(jobs, timeout)
        self.upto = max([self.upto, *jobs])

    def catch_up(self) -> None:
        self.wait(self.unreported)

    def inject_failure(self) -> None:
        """The next copy submitted fails (the engine's failure injection, which fails the next
        copy its thread runs: the earlier ones first run, though not reported)."""
        self.engine.wait(list(self.unreported))
        self.engine.inject_failures(1)

    def get_finished(self) -> list[Any]:
        self.held += self.engine.get_finished()
        out = [r for r in self.held if r.job_id <= self.upto]
        self.held = [r for r in self.held if r.job_id > self.upto]
        self.unreported -= {r.job_id for r in out}
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def _behind(model: Stack, **kw: Any) -> tuple[PrefetchOffloader, _GpuBehind]:
    off = PrefetchOffloader(model.layers, **kw)
    return off, _GpuBehind(off)


def test_synchronous_mode_raises_the_last_layers_failed_copy_in_its_forward(
    x: torch.Tensor,
) -> None:
    """The forward's last layer waits on the host for the forward's copies: a failed copy of
    it is raised by the forward that ran on it (it was raised by the next one, blaming it)."""
    model = make_stack(4)
    resident = copy.deepcopy(model)
    off, behind = _behind(model, synchronous=True)
    try:
        with torch.no_grad():
            assert torch.equal(model(x), resident(x))
            h = x
            for layer in model.layers[:-1]:
                h = layer(h)
            behind.inject_failure()
            with pytest.raises(WeightTransferError, match=r"offloaded layer 3 \(layers\[3\]\)"):
                model.layers[-1](h)
            with pytest.raises(WeightTransferError, match="call reset"):
                model(x)
            off.reset()
            assert torch.equal(model(x), resident(x))
    finally:
        off.close()


@pytest.mark.parametrize("end", ["reset", "close"])
@pytest.mark.parametrize("synchronous", [True, False], ids=["sync", "prefetch"])
def test_a_failed_onload_no_forward_raised_is_raised_by_reset_or_close(
    x: torch.Tensor, end: str, synchronous: bool
) -> None:
    """A failed onload whose result no forward collected (a synchronous forward stopped after
    the layer; a forward's last prefetch) is raised by reset() or close(), not dropped.
    reset() raises before starting again, and the next reset() does; close() closes first."""
    model = make_stack(4)
    resident = copy.deepcopy(model)
    off, behind = _behind(model, synchronous=synchronous)
    try:
        with torch.no_grad():
            assert torch.equal(model(x), resident(x))
            h = x
            stop = 2 if synchronous else 4  # the failed copy: layer 1's / next forward's layer 0
            for i in range(stop):
                if i == stop - 1:
                    behind.inject_failure()
                h = model.layers[i](h)
            k = 1 if synchronous else 0
            failed = rf"offloaded layer {k} \(layers\[{k}\]\) failed"
            with pytest.raises(WeightTransferError, match=failed) as info:
                getattr(off, end)()
            assert "no forward raised it" in str(info.value)
            if end == "close":
                assert off.closed
                assert torch.equal(model(x), resident(x))
            else:
                with pytest.raises(WeightTransferError, match="call reset"):
                    model(x)
                off.reset()
                assert torch.equal(model(x), resident(x))
                off.close()  # nothing left unreported
    finally:
        off.close()


@pytest.mark.parametrize("step", [1, 2])
def test_max_in_flight_of_prefetch_step_plus_one_holds_with_the_gpu_behind(
    x: torch.Tensor, step: int
) -> None:
    """At max_in_flight onloads not yet reported, the next one waits on the host for the oldest
    (backpressure) instead of being refused mid-forward (PoolExhaustedError)."""
    model = make_stack(8)
    resident = copy.deepcopy(model)
    trace: list[Any] = []
    off, behind = _behind(
        model, prefetch_step=step, engine_options={"max_in_flight": step + 1}, trace=trace
    )
    try:
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(model(x), resident(x))
        assert behind.most == step + 1
        assert any(e[0] == "backpressure" for e in trace)
        assert not off._failed
    finally:
        off.close()


@pytest.mark.cuda
def test_cuda_synchronous_mode_raises_the_last_layers_failed_copy_in_its_forward() -> None:
    model = make_stack(4, device="cuda")
    resident = copy.deepcopy(model)
    off = PrefetchOffloader(model.layers, synchronous=True)
    try:
        with torch.no_grad():
            x = torch.randn(8, 16, device="cuda")
            assert torch.equal(model(x), resident(x))
            h = x
            for layer in model.layers[:-1]:
                h = layer(h)
            torch.cuda.synchronize()
            torch.cuda._sleep(1_000_000_000)  # ~0.5 s: the GPU behind the host, as in a model
            off.engine.inject_failures(1)  # the driver refuses the last layer's copy
            with pytest.raises(WeightTransferError, match=r"offloaded layer 3 \(layers\[3\]\)"):
                model.layers[-1](h)
            off.reset()
            assert torch.equal(model(x), resident(x))
    finally:
        off.close()


@pytest.mark.cuda
def test_cuda_a_failed_last_prefetch_is_raised_by_close() -> None:
    """The forward's last prefetch (the next forward's layer 0) fails behind the GPU's work:
    close() raises it (it dropped it), having closed."""
    model = make_stack(4, device="cuda")
    resident = copy.deepcopy(model)
    off = PrefetchOffloader(model.layers)
    try:
        with torch.no_grad():
            x = torch.randn(8, 16, device="cuda")
            h = x
            for layer in model.layers[:-1]:
                h = layer(h)
            torch.cuda._sleep(1_000_000_000)
            off.engine.inject_failures(1)  # the onload layer 3's forward starts
            model.layers[-1](h)
    except BaseException:
        off.close()
        raise
    with pytest.raises(WeightTransferError, match=r"offloaded layer 0 \(layers\[0\]\)"):
        off.close()
    assert off.closed
    with torch.no_grad():
        assert torch.equal(model(x), resident(x))


@pytest.mark.cuda
def test_cuda_max_in_flight_of_prefetch_step_plus_one_holds_with_the_gpu_behind() -> None:
    model = make_stack(8, device="cuda")
    resident = copy.deepcopy(model)
    trace: list[Any] = []
    off = PrefetchOffloader(model.layers, engine_options={"max_in_flight": 2}, trace=trace)
    try:
        with torch.no_grad():
            x = torch.randn(8, 16, device="cuda")
            ref = resident(x)
            torch.cuda.synchronize()
            torch.cuda._sleep(1_000_000_000)  # ~0.5 s: every onload of the forward queued
            out = model(x)
            assert torch.equal(out, ref)
            assert torch.equal(model(x), ref)
        assert any(e[0] == "backpressure" for e in trace)
    finally:
        off.close()
