"""Type stubs of the compiled core (rust/py.rs). `make lint` checks them against the built
extension with mypy.stubtest."""

from collections.abc import Callable, Sequence
from types import TracebackType
from typing import ClassVar, Literal, final

import numpy as np
import numpy.typing as npt
from typing_extensions import deprecated

from ._types import (
    AccessOrder,
    BackendName,
    CompletionMode,
    CopyPath,
    Direction,
    EngineInfo,
    EngineStats,
    MemoryKind,
)

__all__ = [
    "BLOCK_MAX_COPIES",
    "BLOCK_MIN_PAGE",
    "DEFAULT_PIECE_BYTES",
    "HOST_ROUTE",
    "KERNEL_BELOW_D2H",
    "KERNEL_BELOW_H2D",
    "MAX_IN_FLIGHT",
    "REGISTRATION_LIMIT",
    "STAGED_CTAS",
    "STAGE_BYTES",
    "STAGE_MAX_AUTO",
    "AllocProgress",
    "BackendError",
    "BlockswapError",
    "Engine",
    "HostBuffer",
    "InvalidTransferError",
    "PoolExhaustedError",
    "Route",
    "ShutdownError",
    "TransferResult",
    "WaitTimeoutError",
    "__version__",
    "chunk_blocks",
    "chunk_count",
    "chunk_skip",
    "cuda_device_pointer",
    "cuda_memcpy",
    "cuda_memory_kind",
    "cuda_pin",
    "cuda_status",
    "cuda_unpin",
    "fill_and_pin",
    "host_memory_available",
    "launch_plan",
    "route_candidates",
    "stage_slot",
    "table_incompatibility",
]

__version__: str
DEFAULT_PIECE_BYTES: int
REGISTRATION_LIMIT: int
MAX_IN_FLIGHT: int
KERNEL_BELOW_H2D: int
KERNEL_BELOW_D2H: int
STAGED_CTAS: int
STAGE_BYTES: int
STAGE_MAX_AUTO: int
HOST_ROUTE: str

#: One ranked route of ``route_candidates``: ``(plan, reason, kernel_below, kernel)``, ``plan``
#: ``"dma"``, ``"kernel"``, ``"blocks"`` or ``"staged"``, ``kernel`` the ``(max_size, ctas,
#: staged)`` of a copy kernel to load into the core first (None: none; for ``"kernel"``, the
#: caller's launcher).
_Candidate = tuple[str, str, int, tuple[int, int, bool] | None]

class BlockswapError(Exception): ...
class InvalidTransferError(BlockswapError): ...
class PoolExhaustedError(BlockswapError): ...
class BackendError(BlockswapError): ...

@deprecated("never raised: no call can make a transfer take an edge it does not have")
class ShutdownError(BlockswapError): ...

class WaitTimeoutError(BlockswapError): ...

@final
class TransferResult:
    @property
    def job_id(self) -> int: ...
    @property
    def success(self) -> bool: ...
    @property
    def bytes(self) -> int: ...
    @property
    def seconds(self) -> float: ...
    @property
    def error(self) -> str | None: ...
    def __eq__(self, value: object, /) -> bool: ...
    __hash__: ClassVar[None]  # type: ignore[assignment]

@final
class Route:
    @staticmethod
    def pages(
        kernel_below: int | None = None,
        *,
        kernel: int | None = None,
        launch_bytes: int | None = None,
        launcher: Callable[[int, int, int, int, int, int, int], object] | None = None,
    ) -> Route: ...
    @staticmethod
    def blocks() -> Route: ...
    @staticmethod
    def staged(
        kernel: int | None = None, direct: bool | None = None, launch_bytes: int | None = None
    ) -> Route: ...
    @property
    def plan(self) -> Literal["pages", "blocks", "staged", "direct"]: ...
    @property
    def kernel_below(self) -> int: ...
    @property
    def kernel(self) -> int | None: ...
    @property
    def launch_bytes(self) -> int | None: ...
    @property
    def launcher(self) -> Callable[[int, int, int, int, int, int, int], object] | None: ...

@final
class Engine:
    def __new__(
        cls,
        backend: BackendName = "auto",
        *,
        device: int = 0,
        max_in_flight: int = 1024,
        pool_bytes: int = 268435456,
        max_descriptors: int | None = None,
        coalesce: bool = True,
        shutdown_timeout: float = 60.0,
        copy_path: CopyPath = "auto",
        max_batch: int | None = None,
        timing: bool = False,
        completion: CompletionMode = "auto",
        h2d_order: AccessOrder = "any",
        d2h_order: AccessOrder = "stream",
        h2d_stream: int | None = None,
        d2h_stream: int | None = None,
        stage_bytes: int = 16777216,
        idle_issue: bool = False,
        early_wake: bool = True,
    ) -> Engine: ...
    def submit(
        self,
        job_id: int,
        src_ptrs: npt.NDArray[np.int64],
        dst_ptrs: npt.NDArray[np.int64],
        sizes: npt.NDArray[np.int64],
        direction: Direction = "h2d",
        wait_stream: int | None = None,
        kernel_below: int = 0,
        launcher: Callable[[int, int, int, int, int, int, int], object] | None = None,
    ) -> None: ...
    def register_table(
        self,
        bases: npt.NDArray[np.int64],
        strides: npt.NDArray[np.int64],
        nbytes: npt.NDArray[np.int64],
        num_blocks: int,
        kind: MemoryKind,
        name: str = "",
        unit: int = 1,
    ) -> int: ...
    def unregister_table(self, table: int) -> None: ...
    def submit_blocks(
        self,
        job_id: int,
        src_table: int,
        src_ids: npt.NDArray[np.int64],
        dst_table: int,
        dst_ids: npt.NDArray[np.int64],
        direction: Direction = "h2d",
        wait_stream: int | None = None,
        kernel_below: int = 0,
        launcher: Callable[[int, int, int, int, int, int, int], object] | None = None,
    ) -> None: ...
    def wake(self, direction: Direction) -> None: ...
    def submit_groups(
        self,
        job_id: int,
        groups: Sequence[
            tuple[
                int,
                npt.NDArray[np.int64] | npt.NDArray[np.int32],
                int,
                npt.NDArray[np.int64] | npt.NDArray[np.int32],
                int | None,
            ]
        ],
        direction: Direction = "h2d",
        wait_stream: int | None = None,
        route: Route | None = None,
    ) -> None: ...
    def load_kernel(
        self,
        function: int,
        threads: int,
        shared: int,
        params: list[str],
        rows: int,
        ctas: int,
        row_bytes: int = 0,
        chained: bool = False,
    ) -> int | None: ...
    def staged_row(self, table: int) -> int | None: ...
    @property
    def stage_bytes(self) -> int: ...
    def submit_block_runs(
        self,
        job_id: int,
        src_table: int,
        src_ids: npt.NDArray[np.int64],
        dst_table: int,
        dst_ids: npt.NDArray[np.int64],
        direction: str = "h2d",
        wait_stream: int | None = None,
    ) -> None: ...
    def block_runs(
        self, src_table: int, dst_table: int, direction: str = "h2d"
    ) -> list[tuple[int, int, int, int, int]] | None: ...
    def block_route(
        self, pairs: list[tuple[int, int]], direction: str, insist: bool = False
    ) -> tuple[bool, str]: ...
    def staged_route(self, host_tables: list[int]) -> tuple[int | None, str]: ...
    def get_finished(self) -> list[TransferResult]: ...
    def wait(self, job_ids: list[int], timeout: float | None = None) -> None: ...
    def shutdown(self) -> None: ...
    @property
    def is_shut_down(self) -> bool: ...
    def register(self, ptr: int, nbytes: int, kind: MemoryKind) -> None: ...
    def pin(self, ptr: int, nbytes: int) -> None: ...
    def unregister(self, ptr: int) -> None: ...
    def alloc_host(self, nbytes: int) -> int: ...
    def free_host(self, ptr: int) -> None: ...
    def inject_failures(self, count: int) -> None: ...
    def stats(self) -> EngineStats: ...
    def info(self) -> EngineInfo: ...
    def __enter__(self) -> Engine: ...
    def __exit__(
        self,
        _ty: type[BaseException] | None,
        _value: BaseException | None,
        _tb: TracebackType | None,
    ) -> None: ...

@final
class AllocProgress:
    def __new__(cls) -> AllocProgress: ...
    def get(self) -> tuple[int, int, int]: ...

@final
class HostBuffer:
    def __new__(
        cls,
        rows: int,
        row_bytes: int,
        piece_bytes: int = ...,
        backend: BackendName = "auto",
        device: int = 0,
        progress: AllocProgress | None = None,
    ) -> HostBuffer: ...
    @property
    def addr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def rows(self) -> int: ...
    @property
    def row_bytes(self) -> int: ...
    @property
    def pieces(self) -> list[tuple[int, int]]: ...
    @property
    def pinned(self) -> bool: ...
    @property
    def backend(self) -> str: ...
    @property
    def users(self) -> int: ...
    def unpin(self) -> None: ...

BLOCK_MAX_COPIES: int
BLOCK_MIN_PAGE: int

def cuda_status() -> tuple[bool, str]: ...
def host_memory_available() -> int | None: ...
def cuda_memory_kind(addr: int) -> MemoryKind | None: ...
def cuda_device_pointer(addr: int) -> int | None: ...
def cuda_memcpy(dst: int, src: int, nbytes: int) -> None: ...
def cuda_pin(ptr: int, nbytes: int, device: int) -> None: ...
def fill_and_pin(
    ranges: list[tuple[int, int]],
    pieces: list[tuple[int, int]],
    device: int | None = None,
    threads: int | None = None,
    progress: AllocProgress | None = None,
) -> None: ...
def cuda_unpin(ptr: int, device: int) -> None: ...
def launch_plan(
    n: int,
    max_ctas: int,
    block_bytes: int,
    max_size: int | None = None,
    total_bytes: int | None = None,
) -> tuple[int, int, int, int]: ...
def chunk_skip(
    unit: int, blocks: int, block_index: int | None = None, store: bool = True
) -> int: ...
def chunk_count(unit: int, blocks: int, skip: int) -> int: ...
def table_incompatibility(
    src_nbytes: npt.NDArray[np.int64], dst_nbytes: npt.NDArray[np.int64]
) -> str | None: ...
def stage_slot(row: int) -> int: ...
def route_candidates(
    direction: str,
    path: str,
    *,
    on_cuda: bool,
    page_sizes: Sequence[int],
    kernel_below: int | None = None,
    kernel_ctas: int = 16,
    kernel_unavailable: Callable[[], str | None] | None = None,
    engine: Engine | None = None,
    tables: Sequence[tuple[int, int]] | None = None,
) -> tuple[list[_Candidate], list[str], tuple[str, str] | None]: ...
def chunk_blocks(
    chunk_ids: npt.NDArray[np.int64],
    unit: int,
    blocks: int,
    skip: int = 0,
    num_chunks: int | None = None,
) -> npt.NDArray[np.int64]: ...
