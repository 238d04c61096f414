//! The module's functions: chunk ids, and the CUDA driver's queries for the Python layer.

use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;

use super::args::{self, copy_u64};
use super::{cuda, invalid, table, EngineError, MemoryKind};

/// The sub-block ids a transfer of `blocks` blocks names by `chunk_ids` (chunks of `unit`
/// sub-blocks, `num_chunks` of them: unbounded by default), starting `skip` sub-blocks into the
/// first chunk: the rule the engine applies to a chunked side (see `submit_groups`).
#[pyfunction]
#[pyo3(signature = (chunk_ids, unit, blocks, skip = 0, num_chunks = None))]
pub(super) fn chunk_blocks<'py>(
    py: Python<'py>,
    chunk_ids: &Bound<'py, PyAny>,
    unit: u64,
    blocks: usize,
    skip: u64,
    num_chunks: Option<u64>,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    // Any integer array, as a transfer's ids are taken (a strided or unaligned view included).
    let chunks = args::ids("chunk_ids", chunk_ids)?;
    // `blocks` is the caller's number: the ids it asks for may not fit in memory, which is a
    // MemoryError (as numpy's), not an abort of the process.
    let mut out = Vec::new();
    out.try_reserve_exact(blocks).map_err(|_| {
        pyo3::exceptions::PyMemoryError::new_err(format!(
            "cannot hold {blocks} block ids in memory"
        ))
    })?;
    let limit = num_chunks
        .unwrap_or(u64::MAX)
        .min(i64::MAX as u64 / unit.max(1));
    table::map_chunks(["CPU", "GPU"], unit, limit, &chunks, blocks, skip, &mut out)
        .map_err(EngineError::from)?;
    // In range of i64: every id is below `limit * unit <= i64::MAX`.
    Ok(PyArray1::from_vec(
        py,
        out.into_iter().map(|b| b as i64).collect(),
    ))
}

/// Sub-blocks a transfer of `blocks` GPU blocks skips in its first CPU block of `unit`: the
/// first block's index in its request modulo `unit` where it is known (`block_index`), else 0
/// for a store and `(-blocks) mod unit` for a load (it ends at its last CPU block's end).
#[pyfunction]
#[pyo3(signature = (unit, blocks, block_index = None, store = true))]
pub(super) fn chunk_skip(unit: u64, blocks: u64, block_index: Option<u64>, store: bool) -> u64 {
    table::chunk_skip(unit, blocks, block_index, store)
}

/// CPU blocks of `unit` a transfer of `blocks` GPU blocks from sub-block `skip` names:
/// `ceil((skip + blocks) / unit)`, none for no block.
#[pyfunction]
pub(super) fn chunk_count(unit: u64, blocks: u64, skip: u64) -> u64 {
    table::chunk_count(unit, blocks, skip)
}

/// Why blocks of a table whose segments' pages are `src_nbytes` bytes cannot be copied to one
/// whose are `dst_nbytes` (`table::compatibility`), or `None` where they can.
#[pyfunction]
pub(super) fn table_incompatibility(
    src_nbytes: PyReadonlyArray1<'_, i64>,
    dst_nbytes: PyReadonlyArray1<'_, i64>,
) -> PyResult<Option<String>> {
    let src = copy_u64("src_nbytes", &src_nbytes)?;
    let dst = copy_u64("dst_nbytes", &dst_nbytes)?;
    Ok(table::compatibility(&src, &dst)
        .err()
        .map(|e| e.to_string()))
}

/// The byte ranges the pages of `tables` (each `(bases, strides, nbytes, num_blocks)`) fall in:
/// `(start, length)` rows, sorted, overlapping ranges merged (`table::merged_spans`): what a
/// handler registers.
#[pyfunction]
#[allow(clippy::type_complexity)] // the Python list of 4-tuples as pyo3 extracts it
pub(super) fn table_spans(
    tables: Vec<(
        PyReadonlyArray1<'_, i64>,
        PyReadonlyArray1<'_, i64>,
        PyReadonlyArray1<'_, i64>,
        u64,
    )>,
) -> PyResult<Vec<(u64, u64)>> {
    let mut ranges = Vec::new();
    for (bases, strides, nbytes, num_blocks) in &tables {
        if *num_blocks == 0 {
            continue;
        }
        let (b, st, n) = (
            copy_u64("bases", bases)?,
            copy_u64("strides", strides)?,
            copy_u64("nbytes", nbytes)?,
        );
        if st.len() != b.len() || n.len() != b.len() {
            return Err(invalid(format!(
                "a table's columns differ in length: {} bases, {} strides, {} nbytes",
                b.len(),
                st.len(),
                n.len()
            )));
        }
        ranges.extend(table::segment_spans(&b, &st, &n, *num_blocks));
    }
    Ok(table::merged_spans(ranges))
}

/// A tensor's segments (`table::tensor_segments`): `(offsets, block stride, page bytes,
/// blocks, block dim)`, or the reason it cannot be a table's, as a str.
#[pyfunction]
pub(super) fn tensor_segments<'py>(
    py: Python<'py>,
    layout: Option<&str>,
    shape: Vec<u64>,
    stride: Vec<u64>,
    item: u64,
    block_dim: i64,
) -> PyResult<Bound<'py, PyAny>> {
    match table::tensor_segments(layout, &shape, &stride, item, block_dim) {
        Ok(s) => Ok((
            s.offsets,
            s.block_stride,
            s.nbytes,
            s.num_blocks,
            s.block_dim,
        )
            .into_pyobject(py)?
            .into_any()),
        Err(why) => Ok(why.into_pyobject(py)?.into_any()),
    }
}

/// The mirror of a tensor (`table::mirror`): `(shape, strides, row elements)` of a dense CPU
/// tensor in the tensor's dim order with `blocks` blocks along `block_dim`.
#[pyfunction]
pub(super) fn mirror_geometry(
    shape: Vec<u64>,
    stride: Vec<u64>,
    block_dim: usize,
    blocks: &Bound<'_, PyAny>,
) -> PyResult<(Vec<u64>, Vec<u64>, u64)> {
    // A ValueError, as numbers a tensor cannot hold are where the Python layer builds one.
    let blocks: u64 = blocks.extract().map_err(|_| {
        pyo3::exceptions::PyValueError::new_err(format!(
            "{} blocks: not a number of blocks a tensor can hold",
            args::shown(blocks)
        ))
    })?;
    if block_dim >= shape.len() || stride.len() != shape.len() {
        return Err(invalid(format!(
            "block_dim {block_dim} and {} strides for a shape of {} dims",
            stride.len(),
            shape.len()
        )));
    }
    let m = table::mirror(&shape, &stride, block_dim, blocks);
    Ok((m.shape, m.strides, m.row_elems))
}

/// A block-major cache's views (`table::block_major_views`): `(segments, page elements,
/// [(strides, offset)])` for tensors given as `(shape, strides, block dim)`, or the index of the
/// first tensor whose page size differs, as an int.
#[pyfunction]
pub(super) fn block_major_views(
    py: Python<'_>,
    tensors: Vec<(Vec<u64>, Vec<u64>, usize)>,
) -> PyResult<Bound<'_, PyAny>> {
    if tensors
        .iter()
        .any(|(shape, strides, bd)| *bd >= shape.len() || strides.len() != shape.len())
    {
        return Err(invalid(
            "each tensor needs a block dim in range and a stride per dim",
        ));
    }
    match table::block_major_views(&tensors) {
        Ok(b) => Ok((b.segments, b.page_elems, b.views)
            .into_pyobject(py)?
            .into_any()),
        Err(i) => Ok(i.into_pyobject(py)?.into_any()),
    }
}

/// How one launch of the copy kernel covers `n` descriptors: `(grid, split, rows, row_bytes)`
/// (see `kernel::launch_plan`), for the Python launcher as for the core's own launches.
#[pyfunction]
#[pyo3(signature = (n, max_ctas, block_bytes, max_size = None, total_bytes = None))]
pub(super) fn launch_plan(
    n: u64,
    max_ctas: u64,
    block_bytes: u64,
    max_size: Option<u64>,
    total_bytes: Option<u64>,
) -> (u64, u64, u64, u64) {
    crate::kernel::launch_plan(n, max_ctas, block_bytes, max_size, total_bytes)
}

/// Whether the CUDA backend can start here, and if not, why.
#[pyfunction]
pub(super) fn cuda_status() -> (bool, String) {
    match cuda::driver_available() {
        Ok(version) => (true, format!("CUDA driver {version}")),
        Err(e) => (false, e.to_string()),
    }
}

/// What the CUDA driver says the memory at `addr` is: "host" (page-locked) or "device"; None where
/// the driver does not know the address (pageable memory) or there is no driver.
#[pyfunction]
pub(super) fn cuda_memory_kind(py: Python<'_>, addr: u64) -> Option<&'static str> {
    py.detach(|| cuda::memory_kind(addr))
        .map(MemoryKind::as_str)
}

/// The address through which the device reaches mapped page-locked host memory at `addr`
/// (cuMemHostGetDevicePointer, in the calling thread's current context); None where there is no
/// driver.
#[pyfunction]
pub(super) fn cuda_device_pointer(py: Python<'_>, addr: u64) -> PyResult<Option<u64>> {
    py.detach(|| cuda::host_device_pointer(addr))
        .map_err(|e| EngineError::Backend(e).into())
}

/// Copies `nbytes` from `src` to `dst` with the driver's cuMemcpy, in the calling thread's current
/// context. The caller vouches that both ranges are allocated and do not overlap.
#[pyfunction]
pub(super) fn cuda_memcpy(py: Python<'_>, dst: u64, src: u64, nbytes: usize) -> PyResult<()> {
    // SAFETY: the Python caller vouches for both ranges (documented above).
    py.detach(|| unsafe { cuda::memcpy(dst, src, nbytes) })
        .map_err(|e| EngineError::Backend(e).into())
}

/// Page-locks `nbytes` of mapped host memory at `ptr` with the driver (`cuMemHostRegister`,
/// portable: every context of the process reaches it), in the primary context of `device`. The
/// caller vouches that the range stays mapped until `cuda_unpin(ptr)`.
#[pyfunction]
pub(super) fn cuda_pin(py: Python<'_>, ptr: u64, nbytes: u64, device: i32) -> PyResult<()> {
    py.detach(|| {
        let pinner = cuda::HostPinner::new(device)?;
        // SAFETY: the Python caller vouches that the range stays mapped until unpinned.
        unsafe { pinner.pin(ptr, nbytes) }
    })
    .map_err(|e| EngineError::Backend(e).into())
}

/// Undoes `cuda_pin` of the range starting at `ptr`. The caller vouches that no copy reaches it
/// any more.
#[pyfunction]
pub(super) fn cuda_unpin(py: Python<'_>, ptr: u64, device: i32) -> PyResult<()> {
    py.detach(|| {
        let pinner = cuda::HostPinner::new(device)?;
        // SAFETY: the Python caller vouches that no copy reaches the range any more.
        unsafe { pinner.unpin(ptr) }
    })
    .map_err(|e| EngineError::Backend(e).into())
}

/// The host's available memory in bytes (`MemAvailable`), None where it cannot be read: what a
/// CPU cache is checked against before it is allocated.
#[pyfunction]
pub(super) fn host_memory_available() -> Option<u64> {
    crate::hostmem::available_memory()
}

/// The staging slot a cache whose largest block row is `row` bytes gets by default (see
/// `choice::stage_slot`).
#[pyfunction]
pub(super) fn stage_slot(row: u64) -> u64 {
    crate::plan::choice::stage_slot(row)
}
