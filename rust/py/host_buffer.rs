//! `HostBuffer`: a large host buffer pinned in pieces.

use std::sync::Arc;

use pyo3::prelude::*;

use crate::hostmem::AllocProgress;

use super::{cuda, hostmem, invalid, HostBuffer, Pinner};

/// Host memory of `rows` rows of `row_bytes` bytes, exactly that size, page-locked in pieces of
/// whole rows of at most `piece_bytes` (on the CUDA backend; on the host backend nothing is
/// pinned, but the pieces are recorded the same). Engines register it one region per piece.
#[pyclass(name = "HostBuffer", module = "blockswap._core", frozen)]
pub(super) struct PyHostBuffer {
    buf: HostBuffer,
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

    /// `(total, faulted, locked)` bytes now.
    fn get(&self) -> (u64, u64, u64) {
        self.0.get()
    }
}

#[pymethods]
impl PyHostBuffer {
    #[new]
    #[pyo3(signature = (rows, row_bytes, piece_bytes = hostmem::DEFAULT_PIECE_BYTES,
        backend = "auto", device = 0, progress = None))]
    fn new(
        py: Python<'_>,
        rows: u64,
        row_bytes: u64,
        piece_bytes: u64,
        backend: &str,
        device: i32,
        progress: Option<&PyAllocProgress>,
    ) -> PyResult<Self> {
        let cuda = crate::backend::is_cuda(backend).map_err(invalid)?;
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
            buf,
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

    #[getter]
    fn pinned(&self) -> bool {
        self.buf.is_pinned()
    }

    #[getter]
    fn backend(&self) -> &'static str {
        self.backend
    }

    /// Engine registrations in the buffer now.
    #[getter]
    fn users(&self) -> usize {
        self.buf.users()
    }

    /// Unpins every piece now (refused while engines hold registrations in it); the memory
    /// stays mapped until the buffer is collected. Idempotent.
    fn unpin(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.buf.unpin()).map_err(Into::into)
    }
}
