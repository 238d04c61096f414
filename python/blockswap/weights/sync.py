"""Streams and events: CUDA, or the host stand-in of the CPU test mode."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..engine import Engine


class _CudaSync:
    """torch CUDA streams and events."""

    is_cuda = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy_stream = torch.cuda.Stream(device=device)

    def current(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def new_event(self, name: str) -> Any:
        del name
        return torch.cuda.Event()

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def wait_stream(self, stream: Any, other: Any) -> None:
        stream.wait_stream(other)

    def capturing(self) -> bool:
        return bool(torch.cuda.is_current_stream_capturing())

    def on(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def note_job(self, job: int) -> None:
        del job

    def drain(self) -> None:
        torch.cuda.synchronize(self.device)


class _HostStream:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<host stream {self.name}>"


class _HostEvent:
    __slots__ = ("capture_seq", "job", "name", "recorded")

    def __init__(self, name: str) -> None:
        self.name = name
        self.recorded = False
        self.job: int | None = None
        # None: recorded outside a capture; else its position in the capture.
        self.capture_seq: int | None = None


class _HostSync:
    """Stand-in for streams and events on the host backend (CPU test mode).

    Compute is synchronous on the CPU; the host engine copies on a worker thread. An event
    recorded on the copy stream remembers the last job submitted before it, and waiting on it
    waits for that job (jobs of one lane finish in order). While :meth:`capture` is open the
    CUDA capture rules are checked: no wait on an event recorded outside the capture, no
    ``wait_stream``, and every event recorded on the copy stream inside the capture must be
    waited on by the capturing stream before the capture ends.
    """

    is_cuda = False

    def __init__(self, engine: Engine, trace: list[Any] | None) -> None:
        self.engine = engine
        self.trace = trace
        self.compute = _HostStream("compute")
        self.copy_stream = _HostStream("copy")
        self._last_job: int | None = None
        self._capturing = False
        self._copy_joined = False
        self._seq = 0
        self._copy_last = 0
        self._joined = 0

    def _log(self, *entry: Any) -> None:
        if self.trace is not None:
            self.trace.append(entry)

    def current(self) -> _HostStream:
        return self.compute

    def new_event(self, name: str) -> _HostEvent:
        return _HostEvent(name)

    def record(self, event: _HostEvent, stream: _HostStream) -> None:
        event.recorded = True
        event.job = self._last_job if stream is self.copy_stream else None
        event.capture_seq = None
        if self._capturing and (stream is self.compute or self._copy_joined):
            self._seq += 1
            event.capture_seq = self._seq
            if stream is self.copy_stream:
                self._copy_last = self._seq
        self._log("record", event.name, stream.name)

    def wait_event(self, stream: _HostStream, event: _HostEvent) -> None:
        if not event.recorded:
            raise RuntimeError(f"{stream.name} waits on {event.name}, which was never recorded")
        if self._capturing:
            if event.capture_seq is None:
                raise RuntimeError(
                    f"capture isolation: {stream.name} waits on {event.name}, recorded outside "
                    "the capture"
                )
            if stream is self.copy_stream:
                self._copy_joined = True
            else:
                self._joined = max(self._joined, event.capture_seq)
        elif event.capture_seq is not None:
            raise RuntimeError(
                f"{event.name} was last recorded during a capture: it cannot be waited on "
                "outside it"
            )
        if event.job is not None:
            self.engine.wait([event.job])
        self._log("wait_event", stream.name, event.name)

    def wait_stream(self, stream: _HostStream, other: _HostStream) -> None:
        if self._capturing:
            raise RuntimeError(
                f"capture isolation: {stream.name} waits for all of {other.name}, whose work "
                "was issued outside the capture"
            )
        if other is self.copy_stream and self._last_job is not None:
            self.engine.wait([self._last_job])
        self._log("wait_stream", stream.name, other.name)

    def capturing(self) -> bool:
        return self._capturing

    def on(self, stream: _HostStream) -> Any:
        del stream
        return contextlib.nullcontext()

    def note_job(self, job: int) -> None:
        self._last_job = job

    def drain(self) -> None:
        if self._last_job is not None:
            self.engine.wait([self._last_job])

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        if self._capturing:
            raise RuntimeError("a capture is already open")
        self._capturing = True
        self._copy_joined = False
        self._seq = self._copy_last = self._joined = 0
        self._log("capture_begin")
        try:
            yield
        finally:
            self._capturing = False
            self._copy_joined = False
        self._log("capture_end")
        if self._copy_last > self._joined:
            raise RuntimeError(
                "the capture ended with copy-stream work the capturing stream never waited for "
                "(cudaErrorStreamCaptureUnjoined on a GPU): call join_after_forward() before "
                "the capture ends"
            )
