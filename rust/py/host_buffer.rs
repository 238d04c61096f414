//! `HostBuffer`: a large host buffer pinned in pieces.

use std::sync::Arc;

use pyo3::prelude::*;

use crate::hostmem::AllocProgress;

use super::args::{self, IntArg};
use super::detached::DropDetached;
use super::{cuda, hostmem, invalid, HostBuffer, Pinner};

/// Host memory of `rows` rows of `row_bytes` bytes, exactly that size, page-locked in pieces of
/// whole rows of at most `piece_bytes` (on the CUDA backend; on the host backend nothing is
/// pinned, but the pieces are recorded the same). Engines register it one region per piece.
#[pyclass(name = "HostBuffer", module = "blockswap._core", frozen)]
pub(super) struct PyHostBuffer {
    /// Dropped with the GIL released: the drop takes the process-wide table of host buffers'
    /// lock, which an unpin of another buffer holds across the driver's unlock of every piece,
    /// then unpins and unmaps.
    buf: DropDetached<HostBuffer>,
    backend: &'static str,
}

/// How far a `HostBuffer`'s allocation got (bytes faulted in, then page-locked), read by another
/// thread while the constructor runs with the GIL released.
#[pyclass(name = "AllocProgress", module = "blockswap._core", frozen)]
#[derive(Default)]
pub(super) struct PyAllocProgress(Arc<AllocProgress>);

#[pymethods]
impl PyAllocProgress {
    #[new]
    fn new() -> Self {
        Self::default()
    }

    /// `(total, faulted, locked, to_lock)` bytes now.
    fn get(&self) -> (u64, u64, u64, u64) {
        self.0.get()
    }
}

#[pymethods]
impl PyHostBuffer {
    #[new]
    /// `rows` of `row_bytes` host bytes in pieces of at most `piece_bytes`, page-locked on
    /// `backend`'s device (each argument checked here, refused by name).
    /// (None: `DEFAULT_PIECE_BYTES`, `"auto"`, device 0.)
    #[pyo3(signature = (rows, row_bytes, piece_bytes = None, backend = None, device = None,
        progress = None))]
    fn new(
        py: Python<'_>,
        rows: &Bound<'_, PyAny>,
        row_bytes: &Bound<'_, PyAny>,
        piece_bytes: Option<&Bound<'_, PyAny>>,
        backend: Option<&Bound<'_, PyAny>>,
        device: Option<&Bound<'_, PyAny>>,
        progress: Option<&PyAllocProgress>,
    ) -> PyResult<Self> {
        let positive = IntArg::within(1, args::U64_MAX);
        let rows: u64 = args::int("rows", rows, positive)?;
        let row_bytes: u64 = args::int("row_bytes", row_bytes, positive)?;
        let piece_bytes: u64 = piece_bytes.map_or(Ok(hostmem::DEFAULT_PIECE_BYTES), |p| {
            args::int("piece_bytes", p, positive)
        })?;
        let backend = backend.map_or(Ok("auto".to_owned()), |b| {
            args::text("backend", b, "'auto', 'host' or 'cuda'")
        })?;
        let i32_range = IntArg::within(i32::MIN.into(), i32::MAX.into());
        let device: i32 = device.map_or(Ok(0), |d| args::int("device", d, i32_range))?;
        let cuda = crate::backend::is_cuda(&backend).map_err(invalid)?;
        let progress = progress.map(|p| Arc::clone(&p.0));
        let buf = py.detach(|| {
            let pinner: Option<Box<dyn Pinner>> = if cuda {
                Some(Box::new(cuda::HostPinner::new(device)?))
            } else {
                None
            };
            HostBuffer::with_progress(rows, row_bytes, piece_bytes, pinner, progress.as_deref())
        })?;
        Ok(PyHostBuffer {
            buf: DropDetached::new(buf),
            backend: if cuda { "cuda" } else { "host" },
        })
    }

    #[getter]
    fn addr(&self) -> u64 {
        self.buf.addr()
    }

    #[getter]
    fn nbytes(&self) -> u64 {
        self.buf.len()
    }

    #[getter]
    fn rows(&self) -> u64 {
        self.buf.rows()
    }

    #[getter]
    fn row_bytes(&self) -> u64 {
        self.buf.row_bytes()
    }

    /// `(address, bytes)` of each piece, in address order.
    #[getter]
    fn pieces(&self) -> Vec<(u64, u64)> {
        self.buf.pieces().to_vec()
    }

    /// Detached: it waits for an unpin in progress (which holds the buffer while the driver
    /// unlocks every piece).
    #[getter]
    fn pinned(&self, py: Python<'_>) -> bool {
        py.detach(|| self.buf.is_pinned())
    }

    #[getter]
    fn backend(&self) -> &'static str {
        self.backend
    }

    /// Engine registrations in the buffer now. Detached: it takes the process-wide table of
    /// host buffers' lock, which an unpin holds while the driver unlocks every piece.
    #[getter]
    fn users(&self, py: Python<'_>) -> usize {
        py.detach(|| self.buf.users())
    }

    /// Unpins every piece now (refused while engines hold registrations in it); the memory
    /// stays mapped until the buffer is collected. Idempotent.
    fn unpin(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.buf.unpin()).map_err(Into::into)
    }
}

/// Faults in `ranges` (`(address, bytes)` of mapped host memory, disjoint, taken in order) from
/// `threads` threads (default: the host's cores, at most 16) and, with a `device`, page-locks
/// `pieces` (in address order) in its primary context (portable) from `lock_threads` threads
/// (default 2), each as soon as it is in, while the others go on (`hostmem::fill_and_pin`);
/// `progress` counts both. Where the kernel cannot
/// populate memory, the driver faults the pages in as it locks them. All or nothing: where a
/// piece is refused, every piece locked is unlocked again and the error names it. `files`:
/// one `(descriptor, offset)` per range where each range is a shared mapping of a file from that
/// offset (its pages are allocated in the file before they are faulted in). The caller vouches
/// that every range and piece stays mapped until each piece is unlocked (`cuda_unpin`), and that
/// each descriptor is the file mapped there and stays open until the call returns.
#[pyfunction]
#[allow(clippy::too_many_arguments)] // a Python function's keyword arguments
#[pyo3(signature = (
    ranges, pieces, device = None, threads = None, progress = None, files = None, lock_threads = None
))]
pub(super) fn fill_and_pin(
    py: Python<'_>,
    ranges: Vec<(u64, u64)>,
    pieces: Vec<(u64, u64)>,
    device: Option<i32>,
    threads: Option<usize>,
    progress: Option<&PyAllocProgress>,
    files: Option<Vec<(i32, u64)>>,
    lock_threads: Option<usize>,
) -> PyResult<()> {
    let files = files.unwrap_or_default();
    if !files.is_empty() && files.len() != ranges.len() {
        return Err(invalid(format!(
            "fill_and_pin: {} files for {} ranges (one per range, or none)",
            files.len(),
            ranges.len()
        )));
    }
    let progress = progress.map(|p| Arc::clone(&p.0));
    let threads = threads.unwrap_or_else(hostmem::fill_threads);
    let lockers = lock_threads.unwrap_or(hostmem::LOCK_THREADS);
    py.detach(|| {
        let pinner = device.map(cuda::HostPinner::new).transpose()?;
        if let Some(p) = &progress {
            // Bytes of the pieces beyond the ranges count as faulted in already (by whoever
            // filled them: vLLM, another rank).
            let filling: u64 = ranges.iter().map(|r| r.1).sum();
            let locking: u64 = pieces.iter().map(|r| r.1).sum();
            let total = filling.max(locking);
            p.start(
                total,
                total - filling,
                if pinner.is_some() { locking } else { 0 },
            );
        }
        // SAFETY: the Python caller vouches for the ranges and pieces (documented above); the
        // fill changes no byte.
        let filled = unsafe {
            hostmem::fill_and_pin(
                &ranges,
                &files,
                &pieces,
                pinner.as_ref().map(|p| p as &dyn Pinner),
                (threads, lockers),
                hostmem::Fallback::Skip,
                progress.as_deref(),
            )
        };
        match filled {
            Ok(()) => Ok(()),
            // Every piece locked (in any order, as each was ready) is unlocked again.
            Err(hostmem::FillError {
                piece: Some(k),
                error,
            }) => {
                let (start, n) = pieces[k];
                Err(crate::backend::BackendError::BadMemory(format!(
                    "could not page-lock piece {k} of {} ({n} bytes at {start:#x}): {error}",
                    pieces.len()
                )))
            }
            Err(e) => Err(e.error),
        }
    })
    .map_err(|e| crate::engine::EngineError::Backend(e).into())
}

/// The `huge=` policy of the tmpfs that holds the open file `fd` (`"never"`, `"always"`,
/// `"within_size"`, `"advise"`, as `shmem_enabled`'s `deny` or `force` may override it), or
/// `None` where the file is not on a tmpfs (`hostmem::shmem_huge`).
#[pyfunction]
pub(super) fn shmem_huge(fd: i32) -> Option<&'static str> {
    hostmem::shmem_huge(fd).map(hostmem::ShmemHuge::as_str)
}
