"""Type stubs of the compiled core (rust/py.rs). `make lint` checks them against the built
extension with mypy.stubtest."""

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Literal, final

import numpy as np
import numpy.typing as npt
from typing_extensions import Self, disjoint_base

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
    "MAX_KEEP_WARM",
    "REGISTRATION_LIMIT",
    "STAGED_CTAS",
    "STAGE_BYTES",
    "STAGE_MAX_AUTO",
    "AllocProgress",
    "ArgumentTypeError",
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
    "block_major_views",
    "check_int",
    "choose_route",
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
    "hold_host_buffer_table",
    "host_memory_available",
    "in_launcher",
    "launch_plan",
    "mirror_geometry",
    "shmem_huge",
    "shown",
    "stage_slot",
    "table_incompatibility",
    "table_spans",
    "tensor_segments",
]

__version__: str
DEFAULT_PIECE_BYTES: int
REGISTRATION_LIMIT: int
MAX_IN_FLIGHT: int
MAX_KEEP_WARM: float
KERNEL_BELOW_H2D: int
KERNEL_BELOW_D2H: int
STAGED_CTAS: int
STAGE_BYTES: int
STAGE_MAX_AUTO: int
HOST_ROUTE: str

class BlockswapError(Exception): ...
class InvalidTransferError(BlockswapError): ...
class PoolExhaustedError(BlockswapError): ...
class BackendError(BlockswapError): ...
class ShutdownError(BlockswapError): ...
class WaitTimeoutError(BlockswapError): ...

class ArgumentTypeError(InvalidTransferError, TypeError):
    """An argument of the wrong type: refused before anything was issued, like any
    :class:`InvalidTransferError`, and a ``TypeError`` too, as Python's own are."""

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
    def reason(self) -> str: ...
    def with_reason(self, reason: str) -> Route: ...
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

@disjoint_base
class Engine:
    """Moves batches of ``(src, dst, size)`` blocks on a backend (see ``rust/py/engine.rs``,
    and :class:`blockswap.Engine`, which adds registering Python objects)."""

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
        stage_step_bytes: int = 8388608,
        idle_issue: bool = False,
        early_wake: bool = True,
        keep_warm: float = 0.1,
        cpus: Iterable[int] | None = None,
    ) -> Self: ...
    def submit(
        self,
        job_id: int,
        src_ptrs: npt.ArrayLike,
        dst_ptrs: npt.ArrayLike,
        sizes: npt.ArrayLike,
        direction: Direction = "h2d",
        *,
        wait_stream: int | None = None,
        kernel_below: int = 0,
        launcher: Callable[[int, int, int, int, int, int, int], object] | None = None,
    ) -> None: ...
    def register_table(
        self,
        bases: npt.ArrayLike,
        strides: npt.ArrayLike,
        nbytes: npt.ArrayLike,
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
        src_ids: npt.ArrayLike,
        dst_table: int,
        dst_ids: npt.ArrayLike,
        direction: Direction = "h2d",
        *,
        wait_stream: int | None = None,
        kernel_below: int = 0,
        launcher: Callable[[int, int, int, int, int, int, int], object] | None = None,
    ) -> None: ...
    def submit_block_runs(
        self,
        job_id: int,
        src_table: int,
        src_ids: npt.ArrayLike,
        dst_table: int,
        dst_ids: npt.ArrayLike,
        direction: Direction = "h2d",
        *,
        wait_stream: int | None = None,
    ) -> None: ...
    def wake(self, direction: Direction) -> None: ...
    def submit_groups(
        self,
        job_id: int,
        groups: Iterable[tuple[int, npt.ArrayLike, int, npt.ArrayLike, int | None]],
        direction: Direction = "h2d",
        wait_stream: int | None = None,
        route: Route | None = None,
    ) -> None: ...
    def submit_group(
        self,
        job_id: int,
        src_table: int,
        src_ids: npt.ArrayLike,
        dst_table: int,
        dst_ids: npt.ArrayLike,
        block_index: int | None = None,
        direction: Direction = "h2d",
        wait_stream: int | None = None,
        route: Route | None = None,
    ) -> None: ...
    def submit_spec(
        self,
        job_id: int,
        gpu_ids: npt.ArrayLike,
        cpu_ids: npt.ArrayLike,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        tables: Sequence[Sequence[tuple[int, int]]],
        blocks_per_chunk: int,
        direction: Direction = "h2d",
        wait_stream: int | None = None,
        route: Route | None = None,
    ) -> None: ...
    def load_kernel(self, kernel: Mapping[str, Any]) -> int | None: ...
    def staged_row(self, table: int) -> int | None: ...
    def prepare_staged(self, direction: Direction, ring: bool | None = None) -> None: ...
    @property
    def stage_bytes(self) -> int: ...
    def block_runs(
        self, src_table: int, dst_table: int, direction: Direction = "h2d"
    ) -> list[tuple[int, int, int, int, int]] | None: ...
    def block_route(
        self,
        pairs: Iterable[tuple[int, int]],
        direction: Direction = "h2d",
        *,
        insist: bool = False,
    ) -> tuple[bool, str]: ...
    def staged_route(self, host_tables: Iterable[int]) -> tuple[int | None, str]: ...
    def get_finished(self) -> list[TransferResult]: ...
    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None: ...
    def shutdown(self) -> None: ...
    @property
    def is_shut_down(self) -> bool: ...
    def _register(self, ptr: int, nbytes: int, kind: MemoryKind) -> None: ...
    def _pin(self, ptr: int, nbytes: int) -> None: ...
    def _unregister(self, ptr: int) -> None: ...
    def _alloc_host(self, nbytes: int) -> int: ...
    def _free_host(self, ptr: int) -> None: ...
    def inject_failures(self, count: int) -> None: ...
    def stats(self) -> EngineStats: ...
    def info(self) -> EngineInfo: ...

@final
class AllocProgress:
    def __new__(cls) -> AllocProgress: ...
    def get(self) -> tuple[int, int, int, int]: ...

@final
class HostBuffer:
    def __new__(
        cls,
        rows: int,
        row_bytes: int,
        piece_bytes: int | None = None,
        backend: BackendName | None = None,
        device: int | None = None,
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

def in_launcher() -> bool: ...
def hold_host_buffer_table(seconds: float) -> None: ...
def cuda_status() -> tuple[bool, str]: ...
def check_int(
    name: str,
    value: object,
    lo: int | None,
    hi: int | None,
    optional: bool,
    numpy: bool,
    what: str,
    wrong_type: type[Exception],
    out_of_range: type[Exception],
) -> int | None: ...
def shown(value: object) -> str: ...
def table_spans(
    tables: Sequence[
        tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], int]
    ],
) -> list[tuple[int, int]]: ...
def tensor_segments(
    layout: str | None, shape: Sequence[int], stride: Sequence[int], item: int, block_dim: int
) -> tuple[list[int], int, int, int, int] | str: ...
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
    files: list[tuple[int, int]] | None = None,
    lock_threads: int | None = None,
) -> None: ...
def cuda_unpin(ptr: int, device: int) -> None: ...
def shmem_huge(fd: int) -> str | None: ...
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
def mirror_geometry(
    shape: Sequence[int], stride: Sequence[int], block_dim: int, blocks: int
) -> tuple[list[int], list[int], int]: ...
def block_major_views(
    tensors: Sequence[tuple[Sequence[int], Sequence[int], int]],
) -> tuple[int, int, list[tuple[list[int], int]]] | int: ...
def choose_route(
    direction: str,
    path: str,
    *,
    on_cuda: bool,
    page_sizes: Sequence[int],
    errors: tuple[Callable[[str, str], BaseException], Callable[[str], BaseException]],
    kernel_below: int | None = None,
    kernel_ctas: int = 16,
    launch_bytes: int | None = None,
    kernel_unavailable: Callable[[], str | None] | None = None,
    engine: Engine | None = None,
    tables: Sequence[tuple[int, int]] | None = None,
    load_kernel: Callable[[int, int, bool], tuple[int | None, str]] | None = None,
    launcher: Callable[[], object] | None = None,
    note: Callable[[str], object] | None = None,
) -> Route: ...
def chunk_blocks(
    chunk_ids: npt.ArrayLike,
    unit: int,
    blocks: int,
    skip: int = 0,
    num_chunks: int | None = None,
) -> npt.NDArray[np.int64]: ...
